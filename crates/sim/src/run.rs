//! Running one seed: build the stack its [`Plan`] names, run the fault phase (resets, aborts,
//! worker and tier faults, stalls, a dying tier), turn every fault off, and run the convergence
//! phase, in which every request must finish and every job drain within a bound. The checks of
//! every step and of the end are listed in the crate doc.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use connector::testing::ManualClock;
use connector::testing::{SharedTier, TierCall};
use connector::{TieringManager, TieringOptions};
use engine_sim::host::HostMemory;
use engine_sim::rng::SplitMix64;
use engine_sim::trace::TraceRecord;
use engine_sim::{EngineConnector, KvHandle, KvScheduler, Sim, SimReport};
use offload_core::{HostPool, Medium};

use crate::fault::FaultTier;
use crate::model::{Lockstep, RefModel};
use crate::plan::{plan_with, ManagerKind, Plan};

/// Clock advance per step (1 ms).
const STEP_NS: u64 = 1_000_000;

/// What a clean seed did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeedOutcome {
    /// Steps in the fault phase and in the convergence phase.
    pub steps: (u64, u64),
    /// Requests finished and aborted.
    pub requests: (u64, u64),
    /// Successful loads and tokens they provided.
    pub loads_ok: u64,
    /// Failed or cancelled loads.
    pub loads_failed: u64,
    /// Tokens loaded.
    pub tokens_loaded: u64,
    /// Resets.
    pub resets: u64,
    /// Chunks promoted from secondary tiers.
    pub promoted: u64,
    /// Faults the tiers injected.
    pub tier_faults: u64,
    /// Manager calls compared with the reference model.
    pub model_calls: u64,
}

/// A failed seed: why, and how to replay it.
#[derive(Clone, Debug)]
pub struct SeedFailure {
    /// The seed.
    pub seed: u64,
    /// What went wrong (a panic's message or a failed end check).
    pub reason: String,
    /// The plan, in one line.
    pub plan: String,
}

/// The command that replays `seed` exactly (`tiny_host`: see [`crate::plan::plan_with`]).
pub fn replay_command(seed: u64, trace: Option<&str>, tiny_host: bool) -> String {
    let mut cmd = format!("cargo xtask sim --seed {seed}");
    if let Some(path) = trace {
        cmd.push_str(&format!(" --trace {path}"));
    }
    if tiny_host {
        cmd.push_str(" --tiny-host");
    }
    cmd
}

/// Runs `seed`; a panic anywhere inside (strict checks panic) becomes a [`SeedFailure`].
pub fn run_seed(seed: u64, trace: Option<&[TraceRecord]>) -> Result<SeedOutcome, SeedFailure> {
    run_seed_with(seed, trace, false)
}

/// [`run_seed`] with the host pool floor off when `tiny_host` ([`crate::plan::plan_with`]).
pub fn run_seed_with(
    seed: u64,
    trace: Option<&[TraceRecord]>,
    tiny_host: bool,
) -> Result<SeedOutcome, SeedFailure> {
    let p = plan_with(seed, trace, tiny_host);
    let described = p.describe();
    let result = catch_unwind(AssertUnwindSafe(|| match p.manager {
        ManagerKind::HostPool => run_host(&p),
        ManagerKind::Tiering { .. } => run_tiering(&p),
    }));
    let reason = match result {
        Ok(Ok(outcome)) => return Ok(outcome),
        Ok(Err(reason)) => reason,
        Err(payload) => payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "panic with a non-string payload".to_owned()),
    };
    Err(SeedFailure {
        seed,
        reason,
        plan: described,
    })
}

/// The per-seed hooks the common driver calls.
trait Stack {
    type C: EngineConnector;
    fn sim(&mut self) -> &mut Sim<Self::C>;
    /// Fault-phase events at the start of `step` (tier stalls, a tier dying).
    fn before_step(&mut self, _step: u64) {}
    /// After each step: advance the clock and check what the engine does not.
    fn after_step(&mut self) -> Result<(), String>;
    /// Turns every tier fault off.
    fn faults_off(&mut self) {}
    /// Work left outside the engine's own view (tier jobs in flight).
    fn settled(&self) -> bool {
        true
    }
    /// What is left outside the engine (for a convergence failure).
    fn stuck(&self) -> String {
        String::new()
    }
    /// Checks once everything converged.
    fn end_checks(&mut self, out: &mut SeedOutcome) -> Result<(), String>;
}

fn drive<S: Stack>(p: &Plan, stack: &mut S) -> Result<SeedOutcome, String> {
    let resets: BTreeSet<u64> = p.reset_steps.iter().copied().collect();
    let mut out = SeedOutcome::default();
    for step in 0..p.fault_steps {
        if stack.sim().is_done() && stack.settled() {
            break;
        }
        if resets.contains(&step) {
            stack.sim().reset_cache();
        }
        stack.before_step(step);
        stack.sim().step();
        stack.after_step()?;
        out.steps.0 += 1;
    }
    // Convergence: no fault of any kind from here on.
    let workers = stack.sim().config().worker_count;
    for rank in 0..workers {
        if let Some(w) = stack.sim().worker_mut(rank) {
            let f = w.faults_mut();
            f.fail_ppm = 0;
            f.fail_jobs.clear();
        }
    }
    stack.faults_off();
    while !(stack.sim().is_done() && stack.settled()) {
        if out.steps.1 >= p.converge_steps {
            let engine = match stack.sim().run_to_completion(0) {
                Err(e) => e.to_string(),
                Ok(_) => "the engine is done".to_owned(),
            };
            return Err(format!(
                "no convergence: not done {} steps after faults were turned off: {engine}; {}",
                out.steps.1,
                stack.stuck()
            ));
        }
        stack.sim().step();
        stack.after_step()?;
        out.steps.1 += 1;
    }
    let report = stack
        .sim()
        .run_to_completion(1)
        .map_err(|e| e.to_string())?;
    check_report(&report)?;
    out.requests = (report.requests_finished, report.requests_aborted);
    out.loads_ok = report.loads_ok;
    out.loads_failed = report.loads_failed;
    out.tokens_loaded = report.tokens_loaded;
    out.resets = report.resets;
    stack.end_checks(&mut out)?;
    Ok(out)
}

fn check_report(report: &SimReport) -> Result<(), String> {
    if !report.is_clean() {
        return Err(format!("run not clean: {report:?}"));
    }
    if report.requests_finished + report.requests_aborted != report.requests_total {
        return Err(format!(
            "{} finished + {} aborted of {} requests",
            report.requests_finished, report.requests_aborted, report.requests_total
        ));
    }
    Ok(())
}

/// kvtier's scheduler over the host pool, the reference model in lockstep.
struct HostStack {
    sim: Sim<KvScheduler<Lockstep<HostPool>>>,
}

impl Stack for HostStack {
    type C = KvScheduler<Lockstep<HostPool>>;
    fn sim(&mut self) -> &mut Sim<Self::C> {
        &mut self.sim
    }
    fn after_step(&mut self) -> Result<(), String> {
        let lockstep = self.sim.checker().inner();
        let pool = lockstep.inner();
        pool.check_invariants()
            .map_err(|e| format!("host pool invariant: {e}"))?;
        if pool.len() != lockstep.model().len() {
            return Err(format!(
                "host pool holds {} chunks, the model {}",
                pool.len(),
                lockstep.model().len()
            ));
        }
        Ok(())
    }
    fn end_checks(&mut self, out: &mut SeedOutcome) -> Result<(), String> {
        let scheduler = self.sim.scheduler();
        if scheduler.tracked_requests() != 0 || scheduler.jobs_in_flight() != 0 {
            return Err(format!(
                "scheduler state leaked: {} requests, {} jobs",
                scheduler.tracked_requests(),
                scheduler.jobs_in_flight()
            ));
        }
        let lockstep = self.sim.checker().inner();
        let (writing, pins) = lockstep.model().outstanding();
        if writing != 0 || pins != 0 {
            return Err(format!(
                "at the end {writing} chunks still being written, {pins} read pins held"
            ));
        }
        out.model_calls = lockstep.calls();
        Ok(())
    }
}

fn run_host(p: &Plan) -> Result<SeedOutcome, String> {
    let pool =
        HostPool::with_strictness(p.config.pool_config(), true).map_err(|e| e.to_string())?;
    let exact = p.config.eviction == offload_core::EvictionPolicy::Lru;
    let model = RefModel::new(p.config.host_slots, exact);
    let manager = Lockstep::new(pool, model, true);
    let sim = Sim::with_manager(p.config.clone(), p.workload.clone(), manager)
        .map_err(|e| e.to_string())?;
    drive(p, &mut HostStack { sim })
}

/// The connector's handle over the tiering manager and fault tiers.
struct TieringStack {
    sim: Sim<KvHandle<TieringManager>>,
    tiers: Vec<SharedTier<FaultTier>>,
    clock: ManualClock,
    rng: SplitMix64,
    stall_toggle_ppm: u32,
    die_step: Option<u64>,
    requests: usize,
}

impl Stack for TieringStack {
    type C = KvHandle<TieringManager>;
    fn sim(&mut self) -> &mut Sim<Self::C> {
        &mut self.sim
    }
    fn before_step(&mut self, step: u64) {
        for t in &self.tiers {
            if self.rng.chance_ppm(self.stall_toggle_ppm) {
                let on = self.rng.below(2) == 0;
                t.with(|t| t.set_stalled(on));
            }
        }
        if self.die_step == Some(step) {
            let i = self.rng.below(self.tiers.len() as u64) as usize;
            self.tiers[i].with(FaultTier::kill);
        }
    }
    fn after_step(&mut self) -> Result<(), String> {
        self.clock.advance(STEP_NS);
        let tiering = self.sim.handle().tiering();
        tiering
            .host()
            .check_invariants()
            .map_err(|e| format!("host pool invariant: {e}"))?;
        for t in &self.tiers {
            let v = t.with(|t| t.violations().to_vec());
            if !v.is_empty() {
                return Err(format!("tier contract broken by the manager: {v:?}"));
            }
        }
        Ok(())
    }
    fn faults_off(&mut self) {
        for t in &self.tiers {
            t.with(|t| t.set_enabled(false));
        }
    }
    fn settled(&self) -> bool {
        self.sim.handle().tiering().tier_jobs_in_flight() == 0
            && self
                .tiers
                .iter()
                .all(|t| t.with(|t| t.jobs_in_flight()) == 0)
    }
    fn stuck(&self) -> String {
        let tiering = self.sim.handle().tiering();
        let fakes: Vec<usize> = self
            .tiers
            .iter()
            .map(|t| t.with(|t| t.jobs_in_flight()))
            .collect();
        let host = tiering.host();
        let slots: Vec<String> = (0..host.slot_count())
            .filter_map(|s| host.key_in(offload_core::SlotId(s)))
            .map(|k| format!("{:#x}:{:?}", k.hash, host.ref_count(k)))
            .collect();
        format!(
            "tiering: host slots [{}], {} tier jobs in flight, outstanding {:?}, {} requests \
             tracked; fake tiers hold {fakes:?} jobs",
            slots.join(" "),
            tiering.tier_jobs_in_flight(),
            tiering.outstanding(),
            tiering.tracked_requests()
        )
    }
    fn end_checks(&mut self, out: &mut SeedOutcome) -> Result<(), String> {
        let handle = self.sim.handle();
        let tiering = handle.tiering();
        if !tiering.outstanding().is_empty() {
            return Err(format!("tier work left: {:?}", tiering.outstanding()));
        }
        if !tiering.leaks().is_empty() {
            return Err(format!("leaks: {:?}", tiering.leaks()));
        }
        if tiering.tracked_requests() != 0 {
            return Err(format!(
                "{} requests still tracked by the tiering manager",
                tiering.tracked_requests()
            ));
        }
        let scheduler = handle.scheduler();
        if scheduler.tracked_requests() != 0 || scheduler.jobs_in_flight() != 0 {
            return Err(format!(
                "scheduler state leaked: {} requests, {} jobs",
                scheduler.tracked_requests(),
                scheduler.jobs_in_flight()
            ));
        }
        for (i, t) in self.tiers.iter().enumerate() {
            check_tier_log(&t.log(), self.requests).map_err(|e| format!("tier {i}: {e}"))?;
            out.tier_faults += t.with(|t| t.injected());
            out.promoted += tiering.tier_counters(i).map_or(0, |c| c.chunks_loaded);
        }
        Ok(())
    }
}

/// Every accepted tier job completes exactly once; each request's finish is heard exactly once,
/// and no job names a request after it.
fn check_tier_log(log: &[TierCall], requests: usize) -> Result<(), String> {
    let mut finished = BTreeSet::new();
    let mut open: BTreeMap<u64, bool> = BTreeMap::new();
    for call in log {
        match call {
            TierCall::Finished(r) => {
                if !finished.insert(*r) {
                    return Err(format!("finish of {r:?} heard twice"));
                }
            }
            TierCall::Submit {
                id,
                request,
                accepted,
                ..
            } => {
                if let Some(r) = request.filter(|r| finished.contains(r)) {
                    return Err(format!("job {} for {r:?} after its finish", id.0));
                }
                if *accepted && open.insert(id.0, true).is_some() {
                    return Err(format!("job id {} accepted twice", id.0));
                }
            }
            TierCall::Completed { id, .. } => {
                if open.remove(&id.0).is_none() {
                    return Err(format!("job {} completed twice or never submitted", id.0));
                }
            }
            TierCall::Cancel(_) | TierCall::Drain => {}
        }
    }
    if let Some(id) = open.keys().next() {
        return Err(format!("job {id} never completed ({} open)", open.len()));
    }
    if finished.len() != requests {
        return Err(format!(
            "{} of {requests} request finishes heard",
            finished.len()
        ));
    }
    Ok(())
}

fn run_tiering(p: &Plan) -> Result<SeedOutcome, String> {
    let host = HostMemory::new(p.config.host_slots, p.config.slot_bytes());
    let tiers: Vec<SharedTier<FaultTier>> = p
        .tier_faults
        .iter()
        .zip(&p.tier_retries)
        .enumerate()
        .map(|(i, (faults, &retries))| {
            let medium = if i == 0 { Medium::Disk } else { Medium::Peer };
            let rng = SplitMix64::stream(p.seed, 0x7157 + i as u64);
            let tier = FaultTier::new(
                &format!("tier{i}"),
                medium,
                host.slot_memory(),
                rng,
                *faults,
                retries,
            );
            SharedTier::new(tier, 1 << 22)
        })
        .collect();
    let clock = ManualClock::new();
    let options = TieringOptions {
        strict: true,
        promotion_deadline_ns: p.promotion_deadline_ns,
        clock: Arc::new(clock.clone()),
        ..TieringOptions::new(p.config.slot_bytes() as u32)
    };
    let pool =
        HostPool::with_strictness(p.config.pool_config(), true).map_err(|e| e.to_string())?;
    let boxed = tiers.iter().map(SharedTier::boxed).collect();
    let manager = TieringManager::new(pool, boxed, options).map_err(|e| e.to_string())?;
    let sim = Sim::with_handle(p.config.clone(), p.workload.clone(), manager, host)
        .map_err(|e| e.to_string())?;
    let mut stack = TieringStack {
        sim,
        tiers,
        clock,
        rng: SplitMix64::stream(p.seed, 0xD1E),
        stall_toggle_ppm: p.stall_toggle_ppm,
        die_step: p.die_step,
        requests: p.workload.requests.len(),
    };
    drive(p, &mut stack)
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::tier::TierOp;
    use offload_core::{JobId, RequestId};

    fn submit(id: u64, request: u64) -> TierCall {
        TierCall::Submit {
            id: JobId(id),
            request: Some(RequestId(request)),
            op: TierOp::Store,
            keys: Vec::new(),
            accepted: true,
        }
    }

    fn completed(id: u64) -> TierCall {
        TierCall::Completed {
            id: JobId(id),
            success: true,
        }
    }

    #[test]
    fn the_tier_log_check_catches_each_broken_rule() {
        let good = [submit(1, 0), completed(1), TierCall::Finished(RequestId(0))];
        assert_eq!(check_tier_log(&good, 1), Ok(()));
        let twice = [submit(1, 0), completed(1), completed(1)];
        assert!(check_tier_log(&twice, 0)
            .unwrap_err()
            .contains("completed twice"));
        let never = [submit(1, 0)];
        assert!(check_tier_log(&never, 0)
            .unwrap_err()
            .contains("never completed"));
        let late = [TierCall::Finished(RequestId(0)), submit(1, 0), completed(1)];
        assert!(check_tier_log(&late, 1)
            .unwrap_err()
            .contains("after its finish"));
        let unheard = [submit(1, 0), completed(1)];
        assert!(check_tier_log(&unheard, 1).unwrap_err().contains("0 of 1"));
    }

    #[test]
    fn a_seed_replays_exactly() {
        for seed in [3, 4] {
            let a = run_seed(seed, None).expect("clean seed");
            let b = run_seed(seed, None).expect("clean seed");
            assert_eq!(a, b, "seed {seed}");
            assert!(a.steps.0 + a.steps.1 > 0);
        }
    }
}
