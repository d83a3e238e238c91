//! [`FaultTier`]: a fault-injecting [`Tier`] around tier-testkit's [`FakeTier`], driven by its
//! own seeded PRNG stream. It fails whole jobs (as an EINVAL or ENOSPC or EIO would), fails some
//! keys of a job (partial promotion or cascade failure, short I/O), scribbles over the slots of a
//! failed load's keys (a torn copy that must never be served), corrupts loaded bytes (the fake
//! tier's checksum catches it and quarantines the copy), refuses jobs as busy, delays and reorders
//! completions, stalls (jobs complete only when cancelled or drained) and dies (every job fails,
//! every lookup misses). [`FaultTier::set_enabled`] turns every fault off at once, for the
//! simulator's convergence phase; a dead or stalled tier then comes back.

use std::collections::BTreeMap;
use std::sync::Arc;

use engine_sim::rng::SplitMix64;
use offload_core::tier::{
    FailedKey, SlotMemory, SubmitError, Tier, TierChunk, TierCompletion, TierFailure, TierJob,
    TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobId, Medium, RequestId};
use tier_testkit::{FakeTier, FakeTierConfig};

/// Byte written over the slot of a failed load's key.
pub const TORN: u8 = 0xA5;

/// How often each fault happens, in parts per million per job (or per key, where noted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierFaults {
    /// A whole store job fails (EINVAL, ENOSPC, EIO).
    pub store_fail_ppm: u32,
    /// A whole load job fails.
    pub load_fail_ppm: u32,
    /// Per key: the key of a job fails alone (partial failure, short I/O).
    pub key_fail_ppm: u32,
    /// Per key of a load: its bytes are corrupted on the way (caught by the checksum).
    pub corrupt_ppm: u32,
    /// A failed load key leaves garbage in its slot.
    pub torn_on_failure: bool,
    /// A submit is refused as busy.
    pub busy_ppm: u32,
    /// A job's completion is held up to this many more polls (reordering jobs).
    pub delay_polls_max: u32,
    /// The tier may stall: [`FaultTier::set_stalled`] takes effect (the simulator toggles it at
    /// random steps); a stall ends with `set_stalled(false)` or when faults are turned off.
    pub stall: bool,
    /// The tier may die: [`FaultTier::kill`] takes effect (the simulator calls it at one random
    /// step); it comes back when faults are turned off.
    pub die: bool,
}

/// A [`FakeTier`] with seeded faults at the `Tier` boundary.
pub struct FaultTier {
    inner: FakeTier,
    memory: Arc<dyn SlotMemory>,
    rng: SplitMix64,
    faults: TierFaults,
    enabled: bool,
    dead: bool,
    /// Keys failed by this wrapper, merged into the job's completion.
    failed: BTreeMap<JobId, (TierOp, Vec<(ChunkKey, u32)>)>,
    /// Completions of jobs failed whole while dead (returned at the next poll).
    dead_jobs: Vec<TierCompletion>,
    /// Faults injected so far.
    injected: u64,
}

impl FaultTier {
    /// A fake tier named `name` over `memory`, with `faults` drawn from `rng`.
    pub fn new(
        name: &str,
        medium: Medium,
        memory: Arc<dyn SlotMemory>,
        rng: SplitMix64,
        faults: TierFaults,
        lookup_retry_count: u32,
    ) -> Self {
        let inner = FakeTier::new(
            Arc::clone(&memory),
            FakeTierConfig {
                name: name.to_owned(),
                medium,
                completion_delay_polls: 0,
                jobs_in_flight_max: 4096,
                lookup_retry_count,
                ..FakeTierConfig::default()
            },
        );
        Self {
            inner,
            memory,
            rng,
            faults,
            enabled: true,
            dead: false,
            failed: BTreeMap::new(),
            dead_jobs: Vec::new(),
            injected: 0,
        }
    }

    /// Turns every fault on or off; off also revives a dead tier and ends a stall.
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
        if !on {
            self.dead = false;
            self.inner.faults_mut().stall = false;
        }
    }

    /// Starts or ends a stall (only while faults are on and the plan allows stalls).
    pub fn set_stalled(&mut self, on: bool) {
        if on && !(self.enabled && self.faults.stall) {
            return;
        }
        self.inner.faults_mut().stall = on;
    }

    /// Kills the tier (only while faults are on and the plan allows it).
    pub fn kill(&mut self) {
        if self.enabled && self.faults.die {
            self.dead = true;
        }
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.injected
    }

    /// The fake tier's caller-side contract violations.
    pub fn violations(&self) -> &[String] {
        self.inner.violations()
    }

    /// Jobs accepted and not yet completed.
    pub fn jobs_in_flight(&self) -> usize {
        self.inner.jobs_in_flight() + self.dead_jobs.len()
    }

    fn chance(&mut self, ppm: u32) -> bool {
        self.enabled && self.rng.chance_ppm(ppm)
    }
}

impl Tier for FaultTier {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn medium(&self) -> Medium {
        self.inner.medium()
    }

    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        if self.dead {
            return TierLookup::Miss;
        }
        self.inner.lookup(key)
    }

    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        self.inner.take_evicted(out)
    }

    fn touch(&mut self, keys: &[ChunkKey]) {
        self.inner.touch(keys);
    }

    fn submit(&mut self, mut job: TierJob) -> Result<(), SubmitError> {
        if self.chance(self.faults.busy_ppm) {
            self.injected += 1;
            return Err(SubmitError::Busy { in_flight: 0 });
        }
        if self.dead {
            self.injected += 1;
            let keys = job.chunks.iter().map(|c| c.key);
            let kind = TierFailure::TierDown;
            self.dead_jobs
                .push(TierCompletion::all_failed(job.id, keys, kind));
            return Ok(());
        }
        let whole = match job.op {
            TierOp::Store => self.chance(self.faults.store_fail_ppm),
            TierOp::Load => self.chance(self.faults.load_fail_ppm),
        };
        let mut failed = Vec::new();
        let mut kept = Vec::with_capacity(job.chunks.len());
        let mut corrupt = Vec::new();
        for &chunk in &job.chunks {
            let TierChunk { key, slot, .. } = chunk;
            if whole || self.chance(self.faults.key_fail_ppm) {
                failed.push((key, slot.0));
                continue;
            }
            if job.op == TierOp::Load && self.chance(self.faults.corrupt_ppm) {
                corrupt.push(key);
            }
            kept.push(chunk);
        }
        let delay = if self.enabled && self.faults.delay_polls_max > 0 {
            self.rng.below(u64::from(self.faults.delay_polls_max) + 1) as u32
        } else {
            0
        };
        let id = job.id;
        let op = job.op;
        job.chunks = kept;
        let plan = self.inner.faults_mut();
        plan.job_delay_polls.insert(id, delay);
        for &k in &corrupt {
            plan.corrupt_on_load.insert(k);
        }
        let result = self.inner.submit(job);
        let plan = self.inner.faults_mut();
        plan.job_delay_polls.remove(&id);
        if result.is_err() {
            for k in &corrupt {
                plan.corrupt_on_load.remove(k);
            }
            return result;
        }
        self.injected += (failed.len() + corrupt.len()) as u64;
        if !failed.is_empty() || !corrupt.is_empty() {
            self.failed.insert(id, (op, failed));
        }
        // Corruption keys stay in the plan until this job completes (see `poll`).
        if !corrupt.is_empty() {
            let entry = self.failed.entry(id).or_insert((op, Vec::new()));
            entry.1.extend(corrupt.iter().map(|&k| (k, u32::MAX)));
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        let start = out.len();
        self.inner.poll(out);
        out.append(&mut self.dead_jobs);
        for c in &mut out[start..] {
            let Some((op, keys)) = self.failed.remove(&c.id) else {
                continue;
            };
            for (key, slot) in keys {
                if slot == u32::MAX {
                    // A corruption marker: the fake tier already failed it if it landed.
                    self.inner.faults_mut().corrupt_on_load.remove(&key);
                    continue;
                }
                if op == TierOp::Load && self.faults.torn_on_failure {
                    let garbage = vec![TORN; self.memory.slot_bytes()];
                    self.memory
                        .write_slot(offload_core::SlotId(slot), 0, &garbage);
                }
                if c.failure_of(key).is_none() {
                    c.failed.push(FailedKey::new(key, TierFailure::Io));
                }
            }
        }
    }

    fn cancel(&mut self, id: JobId) {
        self.inner.cancel(id);
    }

    fn drain(&mut self) {
        self.inner.drain();
    }

    fn on_request_finished(&mut self, request: RequestId) {
        self.inner.on_request_finished(request);
    }

    fn shutdown(&mut self) {
        self.inner.shutdown();
    }
}
