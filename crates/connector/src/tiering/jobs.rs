//! Tier jobs in flight: reaping and checking the tiers' reports, cancelling jobs past their
//! deadlines, and the waits of `drain` and `reset`.

use std::collections::BTreeSet;

use offload_core::tier::{TierCompletion, TierOp};
use offload_core::{ChunkKey, KvEvent, OffloadManager, SlotId};

use super::{TieringManager, RESET_DRAIN_POLL_INTERVAL_NS};

impl TieringManager {
    /// Waits until every tier job was reported, and applies the reports, for at most the reset
    /// drain deadline (polling the tiers, sleeping on the clock between polls); past it the jobs
    /// still in flight are cancelled, the wait is counted (`drain_timeouts`) and `false` is
    /// returned. The jobs stay in flight, their slots pinned, until their tiers report them.
    pub fn drain(&mut self) -> bool {
        let start = self.now();
        loop {
            self.poll_tiers();
            if self.in_flight.is_empty() {
                return true;
            }
            if self.now().saturating_sub(start) >= self.options.reset_drain_deadline_ns {
                break;
            }
            self.options.clock.sleep_ns(RESET_DRAIN_POLL_INTERVAL_NS);
        }
        self.counters.drain_timeouts += 1;
        for (&id, job) in self.in_flight.iter_mut() {
            if !job.cancelled {
                job.cancelled = true;
                self.tiers[job.tier].tier.cancel(id);
            }
        }
        self.poll_tiers();
        self.in_flight.is_empty()
    }

    /// Cancels each tier job submitted longer ago than its deadline (a promotion: the promotion
    /// deadline; a cascade: the cascade deadline) and not reported yet, once, and counts it. Its
    /// pins stay: the tier may touch the slots until it reports the job (buffer ownership),
    /// which a cancelled job still does exactly once.
    pub(super) fn cancel_overdue_jobs(&mut self) {
        let now = self.now();
        for (&id, job) in self.in_flight.iter_mut() {
            let deadline = match job.op {
                TierOp::Load => self.options.promotion_deadline_ns,
                TierOp::Store => self.options.cascade_deadline_ns,
            };
            if job.cancelled || now.saturating_sub(job.submitted_ns) <= deadline {
                continue;
            }
            job.cancelled = true;
            let entry = &mut self.tiers[job.tier];
            match job.op {
                TierOp::Load => entry.counters.promotions_timed_out += 1,
                TierOp::Store => entry.counters.cascades_timed_out += 1,
            }
            entry.tier.cancel(id);
        }
    }

    /// Waits for every tier job to be reported, up to the reset drain deadline, polling the
    /// tiers and sleeping on the clock between polls (a reset already blocks the caller). Past
    /// the deadline the jobs still in flight are cancelled and marked held: the host pool's reset
    /// then holds their slots (out of use, not freed) until the tier reports them, since a job's
    /// slots belong to it until the
    /// tier reports it (buffer ownership).
    pub(super) fn drain_for_reset(&mut self) {
        let start = self.now();
        let deadline = self.options.reset_drain_deadline_ns;
        loop {
            self.poll_tiers();
            if self.in_flight.is_empty() {
                return;
            }
            if self.now().saturating_sub(start) >= deadline {
                break;
            }
            self.options.clock.sleep_ns(RESET_DRAIN_POLL_INTERVAL_NS);
        }
        self.counters.reset_drain_timeouts += 1;
        for (&id, job) in self.in_flight.iter_mut() {
            if !job.cancelled {
                job.cancelled = true;
                let entry = &mut self.tiers[job.tier];
                entry.counters.reset_jobs_cancelled += 1;
                entry.tier.cancel(id);
            }
        }
        // A tier honouring cancel reports at once (applied as usual, before the pool's reset).
        // What is still in flight after this poll is held: the pool's reset holds its slots
        // (never freed or reused) until the tier reports it, however long that takes.
        self.poll_tiers();
        for job in self.in_flight.values_mut() {
            if !job.held {
                job.held = true;
                self.tiers[job.tier].counters.reset_jobs_held += 1;
            }
        }
    }

    /// Reaps every tier's completions and applies them.
    pub(super) fn poll_tiers(&mut self) {
        let mut completions = std::mem::take(&mut self.scratch_completions);
        for tier in 0..self.tiers.len() {
            completions.clear();
            self.tiers[tier].tier.poll(&mut completions);
            for completion in completions.drain(..) {
                self.apply_completion(tier, completion);
            }
            self.take_evicted(tier);
        }
        self.scratch_completions = completions;
    }

    /// Turns the keys `tier` dropped by itself into `Removed` events with its medium.
    fn take_evicted(&mut self, tier: usize) {
        let mut keys = Vec::new();
        let lost = self.tiers[tier].tier.take_evicted(&mut keys);
        let entry = &mut self.tiers[tier];
        entry.counters.evictions_reported += keys.len() as u64;
        entry.counters.evictions_unreported += lost;
        let medium = entry.medium;
        for key in keys {
            self.push_tier_event(tier, KvEvent::Removed { key, medium });
        }
    }

    fn apply_completion(&mut self, tier: usize, completion: TierCompletion) {
        let id = completion.id;
        let Some(job) = self.in_flight.get(&id) else {
            let what = if id.0 < self.next_job {
                "reported twice (or is not a job of this manager)"
            } else {
                "unknown"
            };
            let name = self.tiers[tier].name.clone();
            self.broken(format_args!(
                "tier {name} reported job {} which is {what}",
                id.0
            ));
            return;
        };
        if job.tier != tier {
            let (name, owner) = (
                self.tiers[tier].name.clone(),
                self.tiers[job.tier].name.clone(),
            );
            self.broken(format_args!(
                "tier {name} reported job {} which was submitted to tier {owner}",
                id.0
            ));
            return;
        }
        let Some(job) = self.in_flight.remove(&id) else {
            return;
        };
        if job.held {
            // From before a reset: its keys mean nothing now; only its slots' holds end.
            let slots: Vec<SlotId> = job.chunks.iter().map(|c| c.slot).collect();
            self.host.release_held(&slots);
            self.tiers[tier].counters.reset_held_jobs_reported += 1;
            return;
        }
        let failed: BTreeSet<ChunkKey> = completion.failed_keys().collect();
        if let Some(stray) = failed
            .iter()
            .find(|k| !job.chunks.iter().any(|c| c.key == **k))
        {
            let name = self.tiers[tier].name.clone();
            self.broken(format_args!(
                "tier {name} failed key {:#x}/{} which job {} does not name",
                stray.hash, stray.group, id.0
            ));
        }
        let mut counted = BTreeSet::new();
        for f in &completion.failed {
            let named = job.chunks.iter().any(|c| c.key == f.key);
            if named && counted.insert(f.key) {
                self.tiers[tier].counters.failures.add(f.kind);
            }
        }
        let elapsed = self.now().saturating_sub(job.submitted_ns);
        match job.op {
            TierOp::Store => self.cascade_done(tier, &job, &failed, elapsed),
            TierOp::Load => self.promotion_done(tier, &job, &failed, elapsed),
        }
    }
}
