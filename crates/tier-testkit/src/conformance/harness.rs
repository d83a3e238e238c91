//! The conformance harness: drives one tier for one case, keeps a ledger of accepted jobs and
//! their completions (so a missing, duplicate or unknown completion fails the case at once), and
//! polls with a deadline.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{
    SlotMemory, SubmitError, Tier, TierChunk, TierCompletion, TierJob, TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobId, RequestId, SlotId};

use super::{MakeTier, SuiteConfig};
use crate::fake::checksum;
use crate::memory::{fill_slot, first_mismatch};

/// Polls between two short sleeps while waiting; before that, polls only yield the thread.
const SPINS_BEFORE_SLEEP: u32 = 64;
/// The sleep between polls once a wait has spun `SPINS_BEFORE_SLEEP` times.
const POLL_SLEEP: Duration = Duration::from_micros(100);
/// Extra polls after a job set is complete, to catch late duplicate completions.
const SETTLE_POLL_COUNT: u32 = 16;

/// Waits a little between two polls: yield first, then short sleeps.
fn pause(spins: &mut u32) {
    *spins += 1;
    if *spins < SPINS_BEFORE_SLEEP {
        std::thread::yield_now();
    } else {
        std::thread::sleep(POLL_SLEEP);
    }
}

/// One tier under test for one case, with the ledger of its jobs.
pub(crate) struct Harness {
    case: &'static str,
    deadline: Duration,
    memory: Arc<dyn SlotMemory>,
    tier: Option<Box<dyn Tier>>,
    name: String,
    accepted: BTreeMap<JobId, TierJob>,
    completions: BTreeMap<JobId, TierCompletion>,
    next_job: u64,
    key_base: u128,
    shut_down: bool,
}

impl Harness {
    /// A fresh memory and tier for `case`.
    pub(crate) fn new(case: &'static str, config: &SuiteConfig, make: &mut MakeTier<'_>) -> Self {
        config.check();
        let memory = (config.new_memory)(config.slot_count, config.slot_bytes);
        let tier = make(Arc::clone(&memory));
        let name = tier.name().to_owned();
        let harness = Self {
            case,
            deadline: config.deadline,
            memory,
            tier: Some(tier),
            name,
            accepted: BTreeMap::new(),
            completions: BTreeMap::new(),
            next_job: 1,
            // The case's keys fill all 128 bits: a per-case high half, the index below.
            key_base: (u128::from(checksum(case.as_bytes())) << 64) | 0x5A5A_0000_0000_0000,
            shut_down: false,
        };
        if harness.name.is_empty() {
            harness.fail("Tier::name is empty");
        }
        harness
    }

    /// Fails the case with a message naming the case and the tier.
    pub(crate) fn fail(&self, message: impl std::fmt::Display) -> ! {
        panic!(
            "tier conformance case `{}` failed for tier `{}`: {message}",
            self.case, self.name
        )
    }

    /// The tier, for calls the harness does not wrap (lookup, touch, cancel, ...).
    pub(crate) fn tier(&mut self) -> &mut dyn Tier {
        match self.tier.as_deref_mut() {
            Some(tier) => tier,
            None => panic!(
                "tier conformance case `{}`: tier lost by the harness",
                self.case
            ),
        }
    }

    pub(crate) fn slot_bytes(&self) -> usize {
        self.memory.slot_bytes()
    }

    pub(crate) fn slot_count(&self) -> u32 {
        self.memory.slot_count()
    }

    /// The case's `index`-th key (distinct per case; groups 0 and 1 alternate).
    pub(crate) fn key(&self, index: u64) -> ChunkKey {
        ChunkKey::new(self.key_base | u128::from(index), (index % 2) as u32)
    }

    /// The case's `index`-th key with its hash's high 64 bits xor `high_xor`: the same low 64
    /// bits and group, another key.
    pub(crate) fn key_high_xor(&self, index: u64, high_xor: u64) -> ChunkKey {
        let key = self.key(index);
        ChunkKey::new(key.hash ^ (u128::from(high_xor) << 64), key.group)
    }

    /// A fresh, growing job id.
    pub(crate) fn job_id(&mut self) -> JobId {
        let id = JobId(self.next_job);
        self.next_job += 1;
        id
    }

    /// A job with a fresh id and no request.
    pub(crate) fn job(&mut self, op: TierOp, chunks: Vec<TierChunk>) -> TierJob {
        let id = self.job_id();
        TierJob {
            id,
            request: None,
            op,
            chunks,
        }
    }

    /// Writes the seed's pattern into the first `len` bytes of `slot`.
    pub(crate) fn fill(&self, slot: SlotId, len: u32, seed: u64) {
        fill_slot(&*self.memory, slot, len as usize, seed);
    }

    /// Fails unless the first `len` bytes of `slot` hold the seed's pattern.
    pub(crate) fn expect_slot(&self, slot: SlotId, len: u32, seed: u64, what: &str) {
        if let Some(at) = first_mismatch(&*self.memory, slot, len as usize, seed) {
            self.fail(format!(
                "{what}: slot {} differs from the stored bytes at offset {at} (len {len})",
                slot.0
            ));
        }
    }

    /// Submits once; records the job if accepted.
    pub(crate) fn try_submit(&mut self, job: &TierJob) -> Result<(), SubmitError> {
        let result = self.tier().submit(job.clone());
        if result.is_ok() {
            if self.accepted.contains_key(&job.id) {
                self.fail(format!("submit accepted job id {} a second time", job.id.0));
            }
            self.accepted.insert(job.id, job.clone());
        }
        result
    }

    /// Submits, polling and retrying while the tier is busy; fails on any other refusal.
    pub(crate) fn submit(&mut self, job: &TierJob) -> JobId {
        let start = Instant::now();
        let mut spins = 0;
        loop {
            match self.try_submit(job) {
                Ok(()) => return job.id,
                Err(SubmitError::Busy { .. }) if start.elapsed() < self.deadline => {
                    self.poll();
                    pause(&mut spins);
                }
                Err(error) => {
                    self.fail(format!("submit of valid job {} refused: {error}", job.id.0))
                }
            }
        }
    }

    /// Polls once; checks and records every completion; returns the new ones.
    pub(crate) fn poll(&mut self) -> Vec<TierCompletion> {
        let mut out = Vec::new();
        self.tier().poll(&mut out);
        for completion in &out {
            self.record(completion);
        }
        out
    }

    fn record(&mut self, completion: &TierCompletion) {
        let id = completion.id;
        let Some(job) = self.accepted.get(&id) else {
            self.fail(format!(
                "completion for job {} that was never accepted",
                id.0
            ));
        };
        if self.completions.contains_key(&id) {
            self.fail(format!("job {} completed more than once", id.0));
        }
        let keys: BTreeSet<ChunkKey> = job.chunks.iter().map(|c| c.key).collect();
        let mut seen = BTreeSet::new();
        for key in &completion.failed_keys().collect::<Vec<_>>() {
            if !keys.contains(key) {
                self.fail(format!(
                    "job {} lists failed key {key:?} that it does not name",
                    id.0
                ));
            }
            if !seen.insert(*key) {
                self.fail(format!("job {} lists failed key {key:?} twice", id.0));
            }
        }
        self.completions.insert(id, completion.clone());
    }

    /// Polls until `id` has completed; fails after the deadline.
    pub(crate) fn wait(&mut self, id: JobId) -> TierCompletion {
        let start = Instant::now();
        let mut spins = 0;
        loop {
            if let Some(done) = self.completions.get(&id) {
                return done.clone();
            }
            if start.elapsed() > self.deadline {
                self.fail(format!(
                    "job {} did not complete within {:?}",
                    id.0, self.deadline
                ));
            }
            self.poll();
            pause(&mut spins);
        }
    }

    /// Waits for `id` and fails unless every key succeeded.
    pub(crate) fn wait_success(&mut self, id: JobId, what: &str) {
        let done = self.wait(id);
        if !done.is_success() {
            self.fail(format!(
                "{what} (job {}) failed keys {:?}",
                id.0, done.failed
            ));
        }
    }

    /// Accepted jobs without a completion yet.
    pub(crate) fn outstanding(&self) -> Vec<JobId> {
        self.accepted
            .keys()
            .filter(|id| !self.completions.contains_key(id))
            .copied()
            .collect()
    }

    /// Polls until every accepted job has completed; fails after the deadline.
    pub(crate) fn wait_all(&mut self) {
        let start = Instant::now();
        let mut spins = 0;
        while !self.outstanding().is_empty() {
            if start.elapsed() > self.deadline {
                let missing = self.outstanding();
                self.fail(format!(
                    "jobs {missing:?} did not complete within {:?}",
                    self.deadline
                ));
            }
            self.poll();
            pause(&mut spins);
        }
    }

    /// Polls a few more times; the ledger fails on any late duplicate or unknown completion.
    pub(crate) fn settle(&mut self) {
        let mut spins = 0;
        for _ in 0..SETTLE_POLL_COUNT {
            self.poll();
            pause(&mut spins);
        }
    }

    /// After a drain or shutdown: one poll must return every outstanding completion.
    pub(crate) fn expect_all_returned_by_one_poll(&mut self, after: &str) {
        self.poll();
        let missing = self.outstanding();
        if !missing.is_empty() {
            self.fail(format!(
                "after {after}, one poll did not return the completions of jobs {missing:?}"
            ));
        }
    }

    /// Looks `key` up until the answer is not `Retry` (polling in between); fails after the
    /// deadline.
    pub(crate) fn lookup_settled(&mut self, key: ChunkKey) -> TierLookup {
        let start = Instant::now();
        let mut spins = 0;
        loop {
            let answer = self.tier().lookup(key);
            if answer != TierLookup::Retry {
                return answer;
            }
            if start.elapsed() > self.deadline {
                self.fail(format!(
                    "lookup of {key:?} still answers Retry after {:?}",
                    self.deadline
                ));
            }
            self.poll();
            pause(&mut spins);
        }
    }

    /// Fails unless the settled lookup of `key` is `expected`.
    pub(crate) fn expect_lookup(&mut self, key: ChunkKey, expected: TierLookup, why: &str) {
        let answer = self.lookup_settled(key);
        if answer != expected {
            self.fail(format!(
                "lookup of {key:?} ({why}) answered {answer:?}, expected {expected:?}"
            ));
        }
    }

    /// Runs a call that may block (drain, shutdown) on another thread, failing if it does not
    /// return within the deadline or panics.
    fn blocking(&mut self, what: &str, call: fn(&mut dyn Tier)) {
        let Some(mut tier) = self.tier.take() else {
            self.fail("tier lost by the harness");
        };
        let (sender, receiver) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name(format!("conformance-{what}"))
            .spawn(move || {
                call(&mut *tier);
                // The receiver is gone only if the case already failed on the deadline.
                let _ = sender.send(tier);
            });
        if let Err(error) = spawned {
            self.fail(format!("could not start a thread for {what}: {error}"));
        }
        match receiver.recv_timeout(self.deadline) {
            Ok(tier) => self.tier = Some(tier),
            Err(RecvTimeoutError::Timeout) => {
                self.fail(format!("{what} did not return within {:?}", self.deadline))
            }
            Err(RecvTimeoutError::Disconnected) => {
                self.fail(format!("the tier panicked in {what}"))
            }
        }
    }

    /// `Tier::drain` under the deadline.
    pub(crate) fn drain(&mut self) {
        self.blocking("drain", |tier| tier.drain());
    }

    /// `Tier::shutdown` under the deadline.
    pub(crate) fn shutdown(&mut self) {
        self.blocking("shutdown", |tier| tier.shutdown());
        self.shut_down = true;
    }

    /// Tells the tier a request finished.
    pub(crate) fn finish_request(&mut self, request: RequestId) {
        self.tier().on_request_finished(request);
    }

    /// Ends the case: every accepted job completes once, the tier shuts down cleanly, and no
    /// completion arrives after that.
    pub(crate) fn finish(mut self) {
        self.wait_all();
        if !self.shut_down {
            self.shutdown();
        }
        self.settle();
        let missing = self.outstanding();
        if !missing.is_empty() {
            self.fail(format!("jobs {missing:?} never completed"));
        }
    }
}
