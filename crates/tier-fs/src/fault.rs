//! Fault injection for tests: a [`FaultPlan`] lists rules, each injecting one [`Fault`] at one
//! I/O call site ([`FaultSite`]) of the worker, for one key or every n-th call.
//!
//! What each fault does where it is injected:
//! - `Einval`: the call fails with EINVAL, but only while the file is open with O_DIRECT (it
//!   stands for a file system that refuses O_DIRECT); the tier then falls back to buffered I/O.
//! - `Enospc`, `Eio`: the call fails with that error (the write or read is not issued).
//! - `Short`: the write or read is issued for one alignment unit less than the file (or half of
//!   it), so the file really is short (write) or the buffer really is incomplete (read).
//! - `Corrupt`: one payload byte is flipped after the checksum was computed (write: the file on
//!   disk is corrupt) or after the read (read: the buffer is corrupt).
//! - `Stall`: the writer hangs at the call (a disk that stops answering) until
//!   `FsTier::release_stalls` or for 10 s; then it goes on as if nothing happened (open only).
//!   At the probe site the probe thread of a shared directory hangs that way before it lists the
//!   directory for a probed key.

use std::io;

use offload_core::ChunkKey;

/// Where a fault is injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultSite {
    /// Opening a chunk file (the temporary file of a store, the chunk file of a load).
    Open,
    /// The write of a store.
    Write,
    /// The read of a load.
    Read,
    /// The probe thread's listing of a shared directory for a probed key (`Stall` only).
    Probe,
}

/// What is injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// EINVAL while the file uses O_DIRECT (open, write, read).
    Einval,
    /// ENOSPC (open, write).
    Enospc,
    /// EIO (open, write, read).
    Eio,
    /// A short write or read (write, read).
    Short,
    /// A flipped payload byte (write, read).
    Corrupt,
    /// The call hangs until released (open, probe).
    Stall,
}

impl Fault {
    /// Whether this fault can be injected at `site`.
    pub fn applies_to(self, site: FaultSite) -> bool {
        match self {
            Fault::Stall => matches!(site, FaultSite::Open | FaultSite::Probe),
            _ if site == FaultSite::Probe => false,
            Fault::Einval | Fault::Eio => true,
            Fault::Enospc => site != FaultSite::Read,
            Fault::Short | Fault::Corrupt => site != FaultSite::Open,
        }
    }

    /// The kernel error this fault stands for, for the error-returning faults.
    pub fn os_error(self) -> Option<io::Error> {
        let errno = match self {
            Fault::Einval => libc::EINVAL,
            Fault::Enospc => libc::ENOSPC,
            Fault::Eio => libc::EIO,
            Fault::Short | Fault::Corrupt | Fault::Stall => return None,
        };
        Some(io::Error::from_raw_os_error(errno))
    }
}

/// Which calls a rule hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultTarget {
    /// Every call at the site for this key.
    Key(ChunkKey),
    /// Every n-th call at the site (n >= 1; 1 is every call).
    EveryNth(u64),
}

/// One injection rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// The call site.
    pub site: FaultSite,
    /// The fault.
    pub fault: Fault,
    /// Which calls.
    pub target: FaultTarget,
    /// The most times the rule fires (`None`: unlimited).
    pub limit: Option<u32>,
}

impl FaultRule {
    /// `fault` at `site` for every call naming `key`.
    pub fn on_key(site: FaultSite, fault: Fault, key: ChunkKey) -> Self {
        Self {
            site,
            fault,
            target: FaultTarget::Key(key),
            limit: None,
        }
    }

    /// `fault` at `site` on every `n`-th call.
    pub fn every_nth(site: FaultSite, fault: Fault, n: u64) -> Self {
        Self {
            site,
            fault,
            target: FaultTarget::EveryNth(n),
            limit: None,
        }
    }

    /// The same rule, firing at most `times` times.
    pub fn times(self, times: u32) -> Self {
        Self {
            limit: Some(times),
            ..self
        }
    }
}

/// The faults a tier injects (none by default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// The rules, checked in order; the first that fires wins.
    pub rules: Vec<FaultRule>,
}

impl FaultPlan {
    /// A plan with these rules.
    pub fn new(rules: Vec<FaultRule>) -> Self {
        Self { rules }
    }

    /// Whether the plan injects nothing.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Checks that every rule's fault applies to its site and every n is at least 1.
    pub fn check(&self) -> Result<(), String> {
        for (i, rule) in self.rules.iter().enumerate() {
            if !rule.fault.applies_to(rule.site) {
                return Err(format!(
                    "rule {i}: {:?} cannot be injected at {:?}",
                    rule.fault, rule.site
                ));
            }
            if rule.target == FaultTarget::EveryNth(0) {
                return Err(format!("rule {i}: EveryNth(0)"));
            }
        }
        Ok(())
    }
}

/// The worker's running state of a plan: call counters and firing counts.
#[derive(Debug, Default)]
pub(crate) struct FaultState {
    rules: Vec<(FaultRule, u64, u32)>,
}

impl FaultState {
    pub(crate) fn new(plan: &FaultPlan) -> Self {
        Self {
            rules: plan.rules.iter().map(|&rule| (rule, 0, 0)).collect(),
        }
    }

    /// The fault to inject at this call, if any. `direct` says whether the file uses O_DIRECT
    /// (EINVAL is only injected then).
    pub(crate) fn check(&mut self, site: FaultSite, key: ChunkKey, direct: bool) -> Option<Fault> {
        let mut hit = None;
        for (rule, calls, fired) in &mut self.rules {
            if rule.site != site {
                continue;
            }
            *calls += 1;
            if hit.is_some() || rule.limit.is_some_and(|limit| *fired >= limit) {
                continue;
            }
            if rule.fault == Fault::Einval && !direct {
                continue;
            }
            let matches = match rule.target {
                FaultTarget::Key(k) => k == key,
                FaultTarget::EveryNth(n) => *calls % n == 0,
            };
            if matches {
                *fired += 1;
                hit = Some(rule.fault);
            }
        }
        hit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_fire_by_key_every_nth_and_limit() {
        let a = ChunkKey::new(1, 0);
        let b = ChunkKey::new(2, 0);
        let plan = FaultPlan::new(vec![
            FaultRule::on_key(FaultSite::Write, Fault::Eio, a),
            FaultRule::every_nth(FaultSite::Read, Fault::Short, 2).times(2),
            FaultRule::on_key(FaultSite::Open, Fault::Einval, b),
        ]);
        assert!(plan.check().is_ok());
        let mut state = FaultState::new(&plan);
        assert_eq!(state.check(FaultSite::Write, a, true), Some(Fault::Eio));
        assert_eq!(state.check(FaultSite::Write, b, true), None);
        let reads: Vec<_> = (0..8)
            .map(|_| state.check(FaultSite::Read, a, true))
            .collect();
        assert_eq!(reads.iter().filter(|f| f.is_some()).count(), 2);
        assert_eq!(reads[1], Some(Fault::Short));
        assert_eq!(state.check(FaultSite::Open, b, false), None);
        assert_eq!(state.check(FaultSite::Open, b, true), Some(Fault::Einval));
    }

    #[test]
    fn check_rejects_faults_at_the_wrong_site() {
        let key = ChunkKey::new(1, 0);
        let plan = FaultPlan::new(vec![FaultRule::on_key(FaultSite::Read, Fault::Enospc, key)]);
        assert!(plan.check().is_err());
        let plan = FaultPlan::new(vec![FaultRule::every_nth(FaultSite::Write, Fault::Eio, 0)]);
        assert!(plan.check().is_err());
    }
}
