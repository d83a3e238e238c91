//! [`FakeTier`]: an in-memory [`Tier`] with injectable delays and faults (a [`FaultPlan`]), for
//! tests of everything that drives tiers. Deterministic: no randomness, no clock, no threads.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use offload_core::tier::{
    FailedKey, SlotMemory, SubmitError, Tier, TierChunk, TierCompletion, TierFailure, TierJob,
    TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobBook, JobId, Medium, RequestId, SlotId};

/// Faults a [`FakeTier`] injects. Keys named here fail every time they are stored or loaded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Stores of these keys fail (the key is then not stored; an older copy stays).
    pub store_fail: BTreeSet<ChunkKey>,
    /// Loads of these keys fail without writing their slot.
    pub load_fail: BTreeSet<ChunkKey>,
    /// Loads of these keys copy one flipped byte into the slot; the tier's checksum detects it,
    /// reports the key as failed and quarantines (drops) its copy.
    pub corrupt_on_load: BTreeSet<ChunkKey>,
    /// Jobs never complete by polling; only `cancel`, `drain` and `shutdown` complete them, with
    /// every key failed.
    pub stall: bool,
    /// Per-job completion delay in polls, overriding [`FakeTierConfig::completion_delay_polls`]
    /// (to complete jobs out of submission order).
    pub job_delay_polls: BTreeMap<JobId, u32>,
}

/// How a [`FakeTier`] behaves. Build with struct-update syntax over `Default`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeTierConfig {
    /// Name reported by [`Tier::name`].
    pub name: String,
    /// Medium reported by [`Tier::medium`].
    pub medium: Medium,
    /// Polls that pass over a job before the poll that completes it: the completion of a job is
    /// returned by the `(k + 1)`-th call to `poll` after its submit (0: the next poll).
    pub completion_delay_polls: u32,
    /// The most jobs held at once (accepted, completion not yet returned by `poll`); beyond it,
    /// submit answers [`SubmitError::Busy`].
    pub jobs_in_flight_max: usize,
    /// The first `n` lookups of each key answer [`TierLookup::Retry`] (an asynchronous probe).
    pub lookup_retry_count: u32,
    /// Injected faults.
    pub faults: FaultPlan,
}

impl Default for FakeTierConfig {
    fn default() -> Self {
        Self {
            name: "fake".to_owned(),
            medium: Medium::Disk,
            completion_delay_polls: 0,
            jobs_in_flight_max: 1024,
            lookup_retry_count: 0,
            faults: FaultPlan::default(),
        }
    }
}

/// Counters a [`FakeTier`] keeps, for assertions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FakeTierStats {
    /// Jobs accepted by `submit`.
    pub jobs_accepted: u64,
    /// Jobs refused by `submit` (any reason).
    pub jobs_refused: u64,
    /// Completions returned by `poll`.
    pub completions_returned: u64,
    /// Jobs completed because of `cancel`, `shutdown`, or `drain` in stall mode.
    pub jobs_cancelled: u64,
    /// Keys reported as failed in completions.
    pub keys_failed: u64,
    /// Loads whose checksum did not match (each one also a failed key).
    pub corruption_detected: u64,
    /// Calls to `lookup`.
    pub lookups: u64,
    /// Keys passed to `touch`.
    pub keys_touched: u64,
}

/// One chunk held by the fake tier, with the checksum taken when it was stored.
#[derive(Clone, Debug)]
struct StoredChunk {
    bytes: Vec<u8>,
    checksum: u64,
}

/// An accepted job whose completion has not yet been returned by `poll`.
#[derive(Debug)]
struct HeldJob {
    job: TierJob,
    polls_left: u32,
    /// Completed; its completion waits in the ready queue (it still owns its slots).
    done: bool,
}

/// An in-memory tier implementing the [`Tier`] contract, with injectable faults.
///
/// Chunks live in a `BTreeMap` with a checksum each; data moves to and from the [`SlotMemory`]
/// given at construction when a job completes (during `poll`, `drain`), never at submit.
///
/// Beyond the trait's contract, it refuses as [`SubmitError::Invalid`] these caller bugs: a job id
/// that does not grow past every accepted id (so also a duplicate in-flight id), a chunk of length
/// 0, a key named twice in one job, a load naming one slot twice, a job whose slots conflict with a
/// held job's (a load writing a slot that another job reads or writes, a store reading a slot that
/// a load writes), and a job naming a request after `on_request_finished` for it.
/// A job with no chunks is accepted and succeeds.
pub struct FakeTier {
    memory: Arc<dyn SlotMemory>,
    config: FakeTierConfig,
    chunks: BTreeMap<ChunkKey, StoredChunk>,
    lookup_counts: BTreeMap<ChunkKey, u32>,
    /// The jobs accepted whose completion `poll` has not returned yet (offload-core's ledger).
    held: JobBook<HeldJob>,
    ready: VecDeque<TierCompletion>,
    /// Keys dropped by `evict`, not yet taken by `take_evicted`.
    evicted: Vec<ChunkKey>,
    last_accepted: Option<JobId>,
    finished_requests: BTreeSet<RequestId>,
    violations: Vec<String>,
    stats: FakeTierStats,
    shut_down: bool,
}

/// FNV-1a over `bytes`: the fake tier's per-chunk checksum.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

impl FakeTier {
    /// A fake tier over `memory`, behaving as `config` says.
    pub fn new(memory: Arc<dyn SlotMemory>, config: FakeTierConfig) -> Self {
        let held = JobBook::new(config.jobs_in_flight_max);
        Self {
            memory,
            config,
            chunks: BTreeMap::new(),
            lookup_counts: BTreeMap::new(),
            held,
            ready: VecDeque::new(),
            evicted: Vec::new(),
            last_accepted: None,
            finished_requests: BTreeSet::new(),
            violations: Vec::new(),
            stats: FakeTierStats::default(),
            shut_down: false,
        }
    }

    /// The fault plan, to change faults between steps of a test.
    pub fn faults_mut(&mut self) -> &mut FaultPlan {
        &mut self.config.faults
    }

    /// Whether the tier holds `key`.
    pub fn contains(&self, key: ChunkKey) -> bool {
        self.chunks.contains_key(&key)
    }

    /// The bytes stored under `key`, if any.
    pub fn stored_bytes(&self, key: ChunkKey) -> Option<&[u8]> {
        self.chunks.get(&key).map(|chunk| chunk.bytes.as_slice())
    }

    /// Drops `key` as an eviction would (tests): reported by the next `take_evicted`. False if
    /// the tier did not hold it.
    pub fn evict(&mut self, key: ChunkKey) -> bool {
        if self.chunks.remove(&key).is_none() {
            return false;
        }
        self.evicted.push(key);
        true
    }

    /// Number of chunks held.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// Jobs accepted whose completion `poll` has not returned yet.
    pub fn jobs_in_flight(&self) -> usize {
        self.held.len()
    }

    /// Counters so far.
    pub fn stats(&self) -> FakeTierStats {
        self.stats
    }

    /// Caller-side contract violations seen that the trait cannot refuse (for example a second
    /// `on_request_finished` for one request); tests assert this is empty.
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Why `job` must be refused, if it must; no side effects.
    fn refusal(&self, job: &TierJob) -> Option<SubmitError> {
        if self.shut_down {
            return Some(SubmitError::ShutDown);
        }
        if let Some(reason) = self.invalid_reason(job) {
            return Some(SubmitError::Invalid(reason));
        }
        self.held.check(job).err()
    }

    fn invalid_reason(&self, job: &TierJob) -> Option<String> {
        if self.held.contains(job.id) {
            return Some(format!("duplicate in-flight job id {}", job.id.0));
        }
        if let Some(last) = self.last_accepted.filter(|last| job.id <= *last) {
            return Some(format!("job id {} does not grow past {}", job.id.0, last.0));
        }
        if let Some(request) = job.request.filter(|r| self.finished_requests.contains(r)) {
            return Some(format!("request {} already finished", request.0));
        }
        self.invalid_chunks(job).or_else(|| self.slot_conflict(job))
    }

    fn invalid_chunks(&self, job: &TierJob) -> Option<String> {
        let slot_count = self.memory.slot_count();
        let slot_bytes = self.memory.slot_bytes();
        let mut keys = BTreeSet::new();
        let mut slots = BTreeSet::new();
        for &TierChunk { key, slot, len } in &job.chunks {
            if slot.0 >= slot_count {
                return Some(format!(
                    "slot {} out of range (slot_count {slot_count})",
                    slot.0
                ));
            }
            if len == 0 || len as usize > slot_bytes {
                return Some(format!("length {len} of {key:?} not in 1..={slot_bytes}"));
            }
            if !keys.insert(key) {
                return Some(format!("{key:?} named twice"));
            }
            if job.op == TierOp::Load && !slots.insert(slot) {
                return Some(format!("load writes slot {} twice", slot.0));
            }
        }
        None
    }

    /// A held job that owns one of `job`'s slots in a conflicting way.
    fn slot_conflict(&self, job: &TierJob) -> Option<String> {
        for held in self.held.iter().map(|(_, b)| &b.value) {
            let both_read = held.job.op == TierOp::Store && job.op == TierOp::Store;
            if both_read {
                continue;
            }
            let held_slots: BTreeSet<SlotId> = held.job.chunks.iter().map(|c| c.slot).collect();
            if let Some(&TierChunk { slot, .. }) =
                job.chunks.iter().find(|c| held_slots.contains(&c.slot))
            {
                return Some(format!(
                    "slot {} is owned by in-flight job {}",
                    slot.0, held.job.id.0
                ));
            }
        }
        None
    }

    /// Runs (or, when `cancelled`, abandons) a held job and queues its completion.
    fn complete(&mut self, id: JobId, cancelled: bool) {
        let Some(held) = self.held.value_mut(id) else {
            return;
        };
        if held.done {
            return;
        }
        held.done = true;
        let job = held.job.clone();
        let failed = if cancelled {
            self.stats.jobs_cancelled += 1;
            let keys = job.chunks.iter().map(|c| c.key);
            keys.map(|key| FailedKey::new(key, TierFailure::Cancelled))
                .collect()
        } else {
            self.transfer(&job)
        };
        self.stats.keys_failed += failed.len() as u64;
        self.ready.push_back(TierCompletion { id, failed });
    }

    /// Moves the job's chunks; returns the keys that failed.
    fn transfer(&mut self, job: &TierJob) -> Vec<FailedKey> {
        let mut failed = Vec::new();
        for &TierChunk { key, slot, len } in &job.chunks {
            let moved = match job.op {
                TierOp::Store => self.store_chunk(key, slot, len as usize),
                TierOp::Load => self.load_chunk(key, slot, len as usize),
            };
            if let Err(kind) = moved {
                failed.push(FailedKey::new(key, kind));
            }
        }
        failed
    }

    /// An injected store failure is an I/O failure.
    fn store_chunk(&mut self, key: ChunkKey, slot: SlotId, len: usize) -> Result<(), TierFailure> {
        if self.config.faults.store_fail.contains(&key) {
            return Err(TierFailure::Io);
        }
        let mut bytes = vec![0u8; len];
        self.memory.read_slot(slot, 0, &mut bytes);
        let checksum = checksum(&bytes);
        self.chunks.insert(key, StoredChunk { bytes, checksum });
        Ok(())
    }

    /// An injected load failure is an I/O failure, a length or checksum mismatch corruption.
    fn load_chunk(&mut self, key: ChunkKey, slot: SlotId, len: usize) -> Result<(), TierFailure> {
        if self.config.faults.load_fail.contains(&key) {
            return Err(TierFailure::Io);
        }
        let Some(chunk) = self.chunks.get(&key) else {
            return Err(TierFailure::Missing);
        };
        if chunk.bytes.len() != len {
            // A load must ask for exactly the stored length; anything else is a short read.
            return Err(TierFailure::Corrupt);
        }
        let expected = chunk.checksum;
        let mut bytes = chunk.bytes.clone();
        if self.config.faults.corrupt_on_load.contains(&key) {
            let middle = len / 2;
            bytes[middle] ^= 0xFF;
        }
        self.memory.write_slot(slot, 0, &bytes);
        // Verify what actually landed in the slot, as a real tier verifies after its copy.
        let mut landed = vec![0u8; len];
        self.memory.read_slot(slot, 0, &mut landed);
        if checksum(&landed) != expected {
            self.stats.corruption_detected += 1;
            self.chunks.remove(&key);
            return Err(TierFailure::Corrupt);
        }
        Ok(())
    }

    /// Completes every held job that is not done: run it, or fail it when `cancel` or stalled.
    fn complete_all(&mut self, cancel: bool) {
        let pending: Vec<JobId> = self
            .held
            .iter()
            .filter(|(_, h)| !h.value.done)
            .map(|(id, _)| id)
            .collect();
        let cancel = cancel || self.config.faults.stall;
        for id in pending {
            self.complete(id, cancel);
        }
    }
}

impl Tier for FakeTier {
    fn name(&self) -> &str {
        &self.config.name
    }

    fn medium(&self) -> Medium {
        self.config.medium
    }

    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        self.stats.lookups += 1;
        let count = self.lookup_counts.entry(key).or_insert(0);
        if *count < self.config.lookup_retry_count {
            *count += 1;
            return TierLookup::Retry;
        }
        if self.chunks.contains_key(&key) {
            TierLookup::Hit
        } else {
            TierLookup::Miss
        }
    }

    fn touch(&mut self, keys: &[ChunkKey]) {
        self.stats.keys_touched += keys.len() as u64;
    }

    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        if let Some(refusal) = self.refusal(&job) {
            self.stats.jobs_refused += 1;
            return Err(refusal);
        }
        let polls_left = match self.config.faults.job_delay_polls.get(&job.id) {
            Some(&delay) => delay,
            None => self.config.completion_delay_polls,
        };
        self.stats.jobs_accepted += 1;
        self.last_accepted = Some(job.id);
        let held = HeldJob {
            job: job.clone(),
            polls_left,
            done: false,
        };
        // `refusal` checked it against the book: this cannot refuse.
        self.held.insert(&job, held)
    }

    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        if !self.config.faults.stall {
            let mut due = Vec::new();
            for (id, held) in self.held.values_mut().filter(|(_, h)| !h.done) {
                if held.polls_left == 0 {
                    due.push(id);
                } else {
                    held.polls_left -= 1;
                }
            }
            for id in due {
                self.complete(id, false);
            }
        }
        while let Some(completion) = self.ready.pop_front() {
            if let Err(e) = self.held.complete(&completion) {
                // The fake's own bug: never handed out, so the conformance suite reports the job
                // as lost.
                self.violations.push(format!("fake tier: {e}"));
                continue;
            }
            self.stats.completions_returned += 1;
            out.push(completion);
        }
    }

    fn cancel(&mut self, id: JobId) {
        self.complete(id, true);
    }

    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        out.append(&mut self.evicted);
        0
    }

    fn drain(&mut self) {
        self.complete_all(false);
    }

    fn on_request_finished(&mut self, request: RequestId) {
        if !self.finished_requests.insert(request) {
            self.violations.push(format!(
                "on_request_finished twice for request {}",
                request.0
            ));
        }
    }

    fn shutdown(&mut self) {
        self.shut_down = true;
        self.complete_all(true);
    }
}
