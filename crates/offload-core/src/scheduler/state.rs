//! The [`Scheduler`]: request table, job table, fences, and the engine-facing calls that move
//! requests through their lifecycle (design.md section 4, items 1-8 and 13).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::invariant;
use crate::key::{BlockId, ChunkKey, JobId, LookupResult, RequestId, SlotId};
use crate::manager::{OffloadManager, PreparedStore};
use crate::meta::{ConnectorMeta, Job, JobKind, Transfer, WorkerOutput};
use crate::scheduler::request::{len_u32, DrainingRequest, Finish, LiveRequest, Match, Tracked};
use crate::scheduler::{
    FinishedRequest, MatchResult, NewRequest, OffloadPolicy, SchedulerConfig, StepInput,
    UpdateOutcome,
};
use crate::CoreError;

/// Counters of the scheduler side (the host pool keeps its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerStats {
    /// Load jobs built.
    pub load_jobs: u64,
    /// Store jobs built.
    pub store_jobs: u64,
    /// Chunks in built load jobs.
    pub chunks_load_submitted: u64,
    /// Chunks in built store jobs.
    pub chunks_store_submitted: u64,
    /// Store preparations that failed for lack of room (retried next step).
    pub allocation_failures: u64,
    /// Store jobs that failed on a worker.
    pub store_failures: u64,
    /// Load jobs that failed (the engine recomputed).
    pub load_failures: u64,
    /// Store jobs flushed by a fence or a preemption.
    pub flushes: u64,
    /// Finish signals delivered to the manager.
    pub finish_signals: u64,
    /// Acknowledgements ignored because their job predates a reset.
    pub stale_acks: u64,
    /// Bookkeeping invariants broken (non-strict mode only; strict mode panics).
    pub invariant_failures: u64,
    /// Requests not tracked because the table was full.
    pub requests_untracked: u64,
    /// Live requests whose offload was switched off after a broken invariant about them
    /// (non-strict mode): no more stores or loads for them; the engine recomputes.
    pub requests_disabled: u64,
}

/// One job in flight, as the scheduler remembers it until every worker acknowledged it.
#[derive(Debug)]
struct JobRecord {
    request: RequestId,
    kind: JobKind,
    keys: Vec<ChunkKey>,
    /// The host slot of each key (what a reset holds for the job until it is over).
    slots: Vec<SlotId>,
    /// Engine blocks a store reads (its fences); empty for loads.
    blocks: Vec<BlockId>,
    /// Bit w set once worker w acknowledged.
    acked: u64,
    failed: bool,
}

/// A job that was in flight at a `reset_cache`: its acknowledgements no longer count, but its
/// host slots stay held (and its request's engine blocks kept) until every worker reported it,
/// since until then a transfer may still write them.
#[derive(Debug)]
struct StaleJob {
    request: RequestId,
    slots: Vec<SlotId>,
    /// Bit w set once worker w acknowledged.
    acked: u64,
    /// A load whose failure the engine hears when it is over (until then the request waits for
    /// it, holding the blocks it writes).
    report_load: bool,
}

/// The scheduler side of kvtier for one engine: request states, job building, acknowledgements.
///
/// It owns the chunk manager `M` (the host pool, or the connector's tiering manager) and is the
/// only caller of the manager's request-scoped methods, in an order that keeps the lifecycle
/// contract: every `prepare_store` of a request precedes its `on_request_finished`, which is
/// delivered exactly once.
pub struct Scheduler<M> {
    config: SchedulerConfig,
    manager: M,
    requests: BTreeMap<RequestId, Tracked>,
    jobs: BTreeMap<JobId, JobRecord>,
    /// `(engine block, store job)` for every in-flight store that reads that block.
    fences: BTreeSet<(BlockId, JobId)>,
    next_job_id: u64,
    /// Jobs older than this were cancelled by `reset_cache`; their acknowledgements are ignored.
    job_floor: JobId,
    /// A reset the workers have not heard of yet.
    pending_reset: Option<JobId>,
    /// Load jobs built since the last meta.
    loads_out: Vec<Job>,
    /// Store jobs to flush in the next meta.
    flush_out: BTreeSet<JobId>,
    /// Finish signals delivered since the last meta.
    finished_out: Vec<RequestId>,
    /// Finished requests whose blocks the engine may free.
    released: Vec<RequestId>,
    /// Loads that failed before a job existed, reported by the next `update_connector_output`.
    failed_loads: Vec<RequestId>,
    /// Requests that finished and wait for the next `build_connector_meta` to be signalled.
    finishing: BTreeSet<RequestId>,
    /// Jobs in flight at a reset and not yet acknowledged by every worker.
    stale_jobs: BTreeMap<JobId, StaleJob>,
    /// How many of `stale_jobs` each request has.
    stale_by_request: BTreeMap<RequestId, u32>,
    /// Finished requests whose engine blocks are released once their stale jobs are over.
    release_after_stale: BTreeSet<RequestId>,
    stats: SchedulerStats,
    scratch_keys: Vec<ChunkKey>,
    scratch_slots: Vec<SlotId>,
    scratch_candidates: Vec<(u32, u32, u32)>,
    scratch_prepared: PreparedStore,
}

impl<M: OffloadManager> Scheduler<M> {
    /// Creates a scheduler over `manager`; fails naming the setting if `config` is invalid.
    pub fn new(config: SchedulerConfig, manager: M) -> Result<Self, CoreError> {
        validate(&config)?;
        Ok(Self {
            config,
            manager,
            requests: BTreeMap::new(),
            jobs: BTreeMap::new(),
            fences: BTreeSet::new(),
            next_job_id: 1,
            job_floor: JobId(0),
            pending_reset: None,
            loads_out: Vec::new(),
            flush_out: BTreeSet::new(),
            finished_out: Vec::new(),
            released: Vec::new(),
            failed_loads: Vec::new(),
            finishing: BTreeSet::new(),
            stale_jobs: BTreeMap::new(),
            stale_by_request: BTreeMap::new(),
            release_after_stale: BTreeSet::new(),
            stats: SchedulerStats::default(),
            scratch_keys: Vec::new(),
            scratch_slots: Vec::new(),
            scratch_candidates: Vec::new(),
            scratch_prepared: PreparedStore::default(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The manager, for inspection.
    pub fn manager(&self) -> &M {
        &self.manager
    }

    /// The manager, for direct calls (tests and tools). Calls made through it bypass the
    /// lifecycle bookkeeping.
    pub fn manager_mut(&mut self) -> &mut M {
        &mut self.manager
    }

    /// Counters so far.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// Requests tracked (live or draining).
    pub fn tracked_requests(&self) -> usize {
        self.requests.len()
    }

    /// Jobs built and not yet acknowledged by every worker.
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// Whether `id` is tracked.
    pub fn is_tracked(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    /// Starts tracking a request. A request beyond `requests_max` is not offloaded.
    pub fn on_new_request(&mut self, request: NewRequest) {
        if self.requests.contains_key(&request.id) {
            self.broken(format_args!("request {:?} arrived twice", request.id));
            return;
        }
        if self.requests.len() >= self.config.requests_max as usize {
            self.stats.requests_untracked += 1;
            return;
        }
        let live = LiveRequest::new(&request);
        self.requests
            .insert(request.id, Tracked::Live(Box::new(live)));
    }

    /// Maximal-prefix lookup for a waiting request whose first `num_computed_tokens` tokens are
    /// already in the GPU cache; `block_hashes` are its full-block hashes, `num_tokens` its length.
    ///
    /// Answers `RetryLater` while any job of the request is in flight or a chunk of its prefix is
    /// pending or unknown; otherwise the tokens (whole blocks, never reaching the last token) that
    /// can be loaded beyond `num_computed_tokens`.
    pub fn get_num_new_matched_tokens(
        &mut self,
        id: RequestId,
        num_tokens: u32,
        block_hashes: &[u128],
        num_computed_tokens: u32,
    ) -> MatchResult {
        let config = self.config;
        let Some(Tracked::Live(req)) = self.requests.get_mut(&id) else {
            if self.requests.contains_key(&id) {
                self.broken(format_args!("lookup for finished request {id:?}"));
            }
            return MatchResult::Tokens(0);
        };
        req.matched = None;
        if req.disabled || req.finish.is_some() {
            return MatchResult::Tokens(0);
        }
        if req.has_jobs() {
            return MatchResult::RetryLater;
        }
        req.num_tokens = num_tokens;
        req.learn_hashes(block_hashes);
        let tpb = config.tokens_per_block;
        let bpc = config.blocks_per_chunk;
        let blocks = (num_tokens / tpb).min(len_u32(block_hashes.len()));
        let first_block = num_computed_tokens / tpb;
        let mut chunk = first_block / bpc;
        let mut hit_end_block = first_block;
        let mut deferred = false;
        let mut chunks = Vec::new();
        while chunk * bpc < blocks {
            let last_block = ((chunk + 1) * bpc).min(blocks) - 1;
            let key = ChunkKey::new(block_hashes[last_block as usize], config.kv_group);
            match self.manager.lookup(key, id) {
                LookupResult::Miss => break,
                LookupResult::Hit => {
                    if !deferred {
                        hit_end_block = last_block + 1;
                        chunks.push((chunk, key));
                    }
                }
                LookupResult::Pending | LookupResult::Retry => deferred = true,
            }
            chunk += 1;
        }
        if deferred {
            return MatchResult::RetryLater;
        }
        // The engine computes at least the last token itself.
        let load_end_block = hit_end_block.min(num_tokens.saturating_sub(1) / tpb);
        let tokens = (load_end_block * tpb).saturating_sub(num_computed_tokens);
        if tokens == 0 {
            return MatchResult::Tokens(0);
        }
        chunks.retain(|&(c, _)| c * bpc < load_end_block);
        req.matched = Some(Match {
            computed_tokens: num_computed_tokens,
            tokens,
            chunks,
        });
        MatchResult::Tokens(tokens)
    }

    /// The engine allocated `block_ids` (the request's whole block table) and will take
    /// `num_external_tokens` tokens (as matched before) from the offload: builds the load job,
    /// which goes out with the next [`Scheduler::build_connector_meta`].
    pub fn update_state_after_alloc(
        &mut self,
        id: RequestId,
        block_ids: &[BlockId],
        num_external_tokens: u32,
    ) {
        let config = self.config;
        let Some(Tracked::Live(req)) = self.requests.get_mut(&id) else {
            if num_external_tokens > 0 {
                self.broken_for(
                    id,
                    format_args!("load for untracked or finished request {id:?}"),
                );
            }
            return;
        };
        let matched = req.matched.take();
        if num_external_tokens == 0 {
            return;
        }
        let Some(matched) = matched.filter(|m| m.tokens >= num_external_tokens) else {
            self.broken_for(
                id,
                format_args!(
                    "request {id:?} takes {num_external_tokens} external tokens that were not \
                     matched"
                ),
            );
            return;
        };
        if req.has_jobs() || num_external_tokens % config.tokens_per_block != 0 {
            self.broken_for(
                id,
                format_args!("load for request {id:?}: jobs in flight or unaligned token count"),
            );
            return;
        }
        let tpb = config.tokens_per_block;
        let bpc = config.blocks_per_chunk;
        let first_block = matched.computed_tokens / tpb;
        let end_block = first_block + num_external_tokens / tpb;
        if block_ids.len() < end_block as usize {
            self.broken_for(
                id,
                format_args!(
                    "request {id:?} allocated {} blocks, load needs {end_block}",
                    block_ids.len()
                ),
            );
            return;
        }
        self.scratch_keys.clear();
        let mut transfers = Vec::new();
        for &(chunk, key) in &matched.chunks {
            let chunk_start = chunk * bpc;
            let lo = chunk_start.max(first_block);
            let hi = (chunk_start + bpc).min(end_block);
            if lo >= hi {
                continue;
            }
            self.scratch_keys.push(key);
            transfers.push(Transfer {
                key,
                slot: SlotId(0),
                first_block_in_chunk: lo - chunk_start,
                gpu_blocks: block_ids[lo as usize..hi as usize].to_vec(),
            });
        }
        self.scratch_slots.clear();
        if self
            .manager
            .prepare_load(&self.scratch_keys, id, &mut self.scratch_slots)
            .is_err()
        {
            self.failed_loads.push(id);
            self.stats.load_failures += 1;
            return;
        }
        self.manager.touch(&self.scratch_keys, id);
        for (transfer, &slot) in transfers.iter_mut().zip(&self.scratch_slots) {
            transfer.slot = slot;
        }
        let job_id = self.allocate_job_id();
        if let Some(Tracked::Live(req)) = self.requests.get_mut(&id) {
            req.load_job = Some(job_id);
        }
        self.stats.load_jobs += 1;
        self.stats.chunks_load_submitted += transfers.len() as u64;
        self.jobs.insert(
            job_id,
            JobRecord {
                request: id,
                kind: JobKind::Load,
                keys: self.scratch_keys.clone(),
                slots: self.scratch_slots.clone(),
                blocks: Vec::new(),
                acked: 0,
                failed: false,
            },
        );
        self.loads_out.push(Job {
            id: job_id,
            request: id,
            kind: JobKind::Load,
            transfers,
        });
    }

    /// Builds this step's metadata for the workers: the reset marker, stores to flush, loads,
    /// this step's stores (the deferred final stores of finished requests included) and, after
    /// all of them, the finish signals.
    pub fn build_connector_meta(&mut self, step: &StepInput<'_>) -> ConnectorMeta {
        let mut meta = ConnectorMeta {
            step: step.step,
            reset_before: self.pending_reset.take(),
            ..ConnectorMeta::default()
        };
        for &id in step.preempted {
            self.on_preempted(id);
        }
        for scheduled in step.scheduled {
            self.apply_fences(scheduled.new_block_ids);
            self.absorb_step(scheduled);
        }
        for scheduled in step.scheduled {
            if self.config.policy == OffloadPolicy::Block {
                self.build_stores(scheduled.id, &mut meta.stores);
            }
        }
        let finishing: Vec<RequestId> = self.finishing.iter().copied().collect();
        let mut ready = Vec::with_capacity(finishing.len());
        for id in finishing {
            if self.build_stores(id, &mut meta.stores) {
                ready.push(id);
            }
        }
        // Only after every store of this step was built: the finish signals.
        for id in ready {
            self.signal_finish_if_ready(id);
        }
        meta.loads = std::mem::take(&mut self.loads_out);
        meta.flush = std::mem::take(&mut self.flush_out).into_iter().collect();
        meta.finished = std::mem::take(&mut self.finished_out);
        self.check_invariants();
        meta
    }

    /// Takes the workers' acknowledgements. A job completes at its `worker_count`-th
    /// acknowledgement, and fails if any worker failed it. Acknowledgements of jobs older than the
    /// last `reset_cache` are ignored.
    pub fn update_connector_output(&mut self, outputs: &[WorkerOutput]) -> UpdateOutcome {
        let mut outcome = UpdateOutcome::default();
        for id in self.failed_loads.drain(..) {
            outcome.loads.push((id, false));
        }
        for output in outputs {
            for ack in &output.acks {
                self.take_ack(output.worker, ack.job, ack.success, &mut outcome);
            }
        }
        self.check_invariants();
        outcome
    }

    /// Records that a request finished or was aborted. Never notifies the manager of a tracked
    /// request with work left: its final stores are built by the next `build_connector_meta`,
    /// which then signals the finish. Returns whether the engine must keep the request's blocks
    /// until [`Scheduler::take_released`] names it.
    pub fn request_finished(&mut self, request: &FinishedRequest<'_>) -> bool {
        let id = request.id;
        let config = self.config;
        match self.requests.get_mut(&id) {
            None => {
                // Never tracked: nothing can be stored, so the signal goes at once.
                self.deliver_finish(id);
                self.keep_blocks_for_stale_jobs(id)
            }
            Some(Tracked::Draining(_)) => {
                self.broken(format_args!("request {id:?} finished twice"));
                true
            }
            Some(Tracked::Live(req)) => {
                if req.finish.is_some() {
                    self.broken(format_args!("request {id:?} finished twice"));
                    return true;
                }
                req.finish = Some(Finish {
                    kind: request.kind,
                    num_tokens: request.num_tokens,
                    num_computed_tokens: request.num_computed_tokens,
                });
                req.num_tokens = request.num_tokens;
                req.learn_hashes(request.block_hashes);
                req.matched = None;
                let mut candidates = std::mem::take(&mut self.scratch_candidates);
                req.store_candidates(&config, &mut candidates);
                let nothing_left = req.disabled || candidates.is_empty();
                self.scratch_candidates = candidates;
                if nothing_left && !req.has_jobs() {
                    self.requests.remove(&id);
                    self.deliver_finish(id);
                    return self.keep_blocks_for_stale_jobs(id);
                }
                self.finishing.insert(id);
                true
            }
        }
    }

    /// Drops everything offloaded. Workers hear of it in the next meta (`reset_before`) and finish
    /// every older job before touching a slot; acknowledgements of those jobs are ignored, but
    /// the host slots they name stay held (handed to no new key) and their requests' engine
    /// blocks kept until every worker acknowledged them, since a transfer may still write them
    /// until then. Finished requests whose signal was pending are signalled here, exactly once,
    /// and released (once their jobs are over); live requests keep their state with their store
    /// cursors rewound. Returns the loads cancelled before any worker got them; a load the
    /// workers already have is reported failed by the `update_connector_output` that brings its
    /// last acknowledgement (until then it may write the request's blocks). The engine
    /// recomputes the tokens of every failed load.
    pub fn reset_cache(&mut self) -> UpdateOutcome {
        let mut outcome = UpdateOutcome::default();
        for id in self.failed_loads.drain(..) {
            outcome.loads.push((id, false));
        }
        let floor = JobId(self.next_job_id);
        self.job_floor = floor;
        self.pending_reset = Some(floor);
        // Loads built and not yet sent: no worker will run them, so they hold nothing.
        let unsent: BTreeSet<JobId> = self.loads_out.drain(..).map(|j| j.id).collect();
        let jobs = std::mem::take(&mut self.jobs);
        let mut unsent_slots = Vec::new();
        for (id, record) in jobs {
            if unsent.contains(&id) {
                unsent_slots.extend_from_slice(&record.slots);
                continue;
            }
            *self.stale_by_request.entry(record.request).or_insert(0) += 1;
            self.stale_jobs.insert(
                id,
                StaleJob {
                    request: record.request,
                    slots: record.slots,
                    acked: record.acked,
                    report_load: false,
                },
            );
        }
        self.fences.clear();
        self.flush_out.clear();
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.reset_request(id, &mut outcome);
        }
        self.finishing.clear();
        self.manager.reset();
        if !unsent_slots.is_empty() {
            self.manager.release_held(&unsent_slots);
        }
        self.check_invariants();
        outcome
    }

    /// Jobs in flight at a reset that not every worker has acknowledged yet (their host slots
    /// are held until then).
    pub fn stale_jobs(&self) -> usize {
        self.stale_jobs.len()
    }

    /// Moves into `out` the finished requests whose engine blocks the engine may now free.
    pub fn take_released(&mut self, out: &mut Vec<RequestId>) {
        out.append(&mut self.released);
    }

    fn reset_request(&mut self, id: RequestId, outcome: &mut UpdateOutcome) {
        let Some(tracked) = self.requests.get_mut(&id) else {
            return;
        };
        match tracked {
            Tracked::Draining(_) => {
                self.requests.remove(&id);
                self.release(id);
            }
            Tracked::Live(req) => {
                if let Some(job) = req.load_job.take() {
                    match self.stale_jobs.get_mut(&job) {
                        // Sent: it fails once every worker drained it (it may still write the
                        // request's blocks until then).
                        Some(stale) => stale.report_load = true,
                        None => outcome.loads.push((id, false)),
                    }
                }
                req.store_jobs.clear();
                req.stored_chunks = 0;
                req.tail_stored = false;
                req.matched = None;
                if req.finish.is_some() {
                    self.requests.remove(&id);
                    self.deliver_finish(id);
                    self.release(id);
                }
            }
        }
    }

    fn allocate_job_id(&mut self) -> JobId {
        let id = JobId(self.next_job_id);
        self.next_job_id += 1;
        id
    }

    /// Design.md section 4 item 13: a preempted request's pending stores are flushed; its blocks
    /// are gone, so its block table is cleared until it is scheduled again.
    fn on_preempted(&mut self, id: RequestId) {
        let Some(Tracked::Live(req)) = self.requests.get_mut(&id) else {
            return;
        };
        if req.finish.is_some() || req.load_job.is_some() {
            self.broken_for(
                id,
                format_args!("preempted request {id:?} is finished or loading"),
            );
            return;
        }
        req.block_ids.clear();
        req.num_computed_tokens = 0;
        req.num_scheduled_tokens = 0;
        let jobs = req.store_jobs.clone();
        for job in jobs {
            self.flush(job);
        }
    }

    /// Any in-flight store reading a block that was just reallocated is flushed.
    fn apply_fences(&mut self, new_blocks: &[BlockId]) {
        if self.fences.is_empty() {
            return;
        }
        for &block in new_blocks {
            let hits: Vec<JobId> = self
                .fences
                .range((block, JobId(0))..=(block, JobId(u64::MAX)))
                .map(|&(_, job)| job)
                .collect();
            for job in hits {
                self.flush(job);
            }
        }
    }

    fn flush(&mut self, job: JobId) {
        if self.flush_out.insert(job) {
            self.stats.flushes += 1;
        }
    }

    /// Takes the engine's view of a scheduled request.
    fn absorb_step(&mut self, scheduled: &crate::scheduler::StepRequest<'_>) {
        let id = scheduled.id;
        let Some(tracked) = self.requests.get_mut(&id) else {
            return;
        };
        let Tracked::Live(req) = tracked else {
            self.broken(format_args!("finished request {id:?} was scheduled"));
            return;
        };
        if req.finish.is_some() || req.load_job.is_some() {
            self.broken_for(
                id,
                format_args!("request {id:?} scheduled while finished or loading"),
            );
            return;
        }
        if scheduled.replace_blocks {
            req.block_ids.clear();
        }
        req.block_ids.extend_from_slice(scheduled.new_block_ids);
        req.num_computed_tokens = scheduled.num_computed_tokens;
        req.num_scheduled_tokens = scheduled.num_scheduled_tokens;
        req.num_tokens = scheduled.num_tokens;
        req.learn_hashes(scheduled.block_hashes);
    }

    /// Prepares the request's store candidates in the manager and, for the keys not yet present,
    /// builds one store job. A failed allocation leaves the cursor where it was. Returns `false`
    /// when the stores had to wait (a load in flight, or `jobs_in_flight_max` reached): a finishing
    /// request is then signalled in a later step, after its final stores.
    fn build_stores(&mut self, id: RequestId, stores: &mut Vec<Job>) -> bool {
        let config = self.config;
        let Some(Tracked::Live(req)) = self.requests.get_mut(&id) else {
            return true;
        };
        if req.disabled {
            return true;
        }
        if req.load_job.is_some() || self.jobs.len() >= config.jobs_in_flight_max as usize {
            return false;
        }
        let mut candidates = std::mem::take(&mut self.scratch_candidates);
        req.store_candidates(&config, &mut candidates);
        if candidates.is_empty() {
            req.advance_cursor(&config);
            self.scratch_candidates = candidates;
            return true;
        }
        self.scratch_keys.clear();
        for &(_, first, count) in &candidates {
            let last = (first + count - 1) as usize;
            self.scratch_keys
                .push(ChunkKey::new(req.block_hashes[last], config.kv_group));
        }
        let mut prepared = std::mem::take(&mut self.scratch_prepared);
        let result = self
            .manager
            .prepare_store(&self.scratch_keys, id, &mut prepared);
        let built = match result {
            Ok(()) => {
                req.advance_cursor(&config);
                store_job_parts(req, &candidates, &self.scratch_keys, &prepared)
            }
            Err(_) => {
                self.stats.allocation_failures += 1;
                None
            }
        };
        self.scratch_prepared = prepared;
        self.scratch_candidates = candidates;
        let Some((transfers, blocks)) = built else {
            return true;
        };
        let job_id = self.allocate_job_id();
        if let Some(Tracked::Live(req)) = self.requests.get_mut(&id) {
            req.store_jobs.push(job_id);
        }
        for &block in &blocks {
            self.fences.insert((block, job_id));
        }
        self.stats.store_jobs += 1;
        self.stats.chunks_store_submitted += transfers.len() as u64;
        let keys = transfers.iter().map(|t| t.key).collect();
        let slots = transfers.iter().map(|t| t.slot).collect();
        self.jobs.insert(
            job_id,
            JobRecord {
                request: id,
                kind: JobKind::Store,
                keys,
                slots,
                blocks,
                acked: 0,
                failed: false,
            },
        );
        stores.push(Job {
            id: job_id,
            request: id,
            kind: JobKind::Store,
            transfers,
        });
        true
    }

    /// Signals a finishing request's finish. Called only after this step's stores were built,
    /// and only for requests whose final stores did not have to wait.
    fn signal_finish_if_ready(&mut self, id: RequestId) {
        self.finishing.remove(&id);
        let Some(Tracked::Live(req)) = self.requests.get(&id) else {
            return;
        };
        let jobs = req.store_jobs.clone();
        if jobs.is_empty() {
            self.requests.remove(&id);
            self.release(id);
        } else {
            self.requests
                .insert(id, Tracked::Draining(DrainingRequest { jobs }));
        }
        self.deliver_finish(id);
    }

    /// The engine may free `id`'s blocks: now, or once the jobs it had in flight at a reset are
    /// over (they may still read or write those blocks).
    fn release(&mut self, id: RequestId) {
        if self.stale_by_request.contains_key(&id) {
            self.release_after_stale.insert(id);
        } else {
            self.released.push(id);
        }
    }

    /// For a request that finished with no job in flight: whether the engine must still keep
    /// its blocks, because a job it had in flight at a reset may still read or write them (it is
    /// then released once those jobs are over).
    fn keep_blocks_for_stale_jobs(&mut self, id: RequestId) -> bool {
        if !self.stale_by_request.contains_key(&id) {
            return false;
        }
        self.release_after_stale.insert(id);
        true
    }

    /// The single place the manager hears `on_request_finished`.
    fn deliver_finish(&mut self, id: RequestId) {
        self.manager.on_request_finished(id);
        self.finished_out.push(id);
        self.stats.finish_signals += 1;
    }

    fn take_ack(&mut self, worker: u32, job: JobId, success: bool, outcome: &mut UpdateOutcome) {
        if job < self.job_floor {
            self.stats.stale_acks += 1;
            self.take_stale_ack(worker, job, outcome);
            return;
        }
        if worker >= self.config.worker_count {
            self.broken(format_args!("ack from unknown worker {worker}"));
            return;
        }
        let Some(record) = self.jobs.get_mut(&job) else {
            self.broken(format_args!(
                "ack for unknown or completed job {job:?} from worker {worker}"
            ));
            return;
        };
        let bit = 1u64 << worker;
        if record.acked & bit != 0 {
            self.broken(format_args!(
                "worker {worker} acknowledged job {job:?} twice"
            ));
            return;
        }
        record.acked |= bit;
        record.failed |= !success;
        if record.acked.count_ones() == self.config.worker_count {
            self.complete_job(job, outcome);
        }
    }

    /// An acknowledgement of a job from before the last reset: at the last worker's, the job is
    /// over, so its host slots' holds end and its request's blocks may be released.
    fn take_stale_ack(&mut self, worker: u32, job: JobId, outcome: &mut UpdateOutcome) {
        let Some(stale) = self.stale_jobs.get_mut(&job) else {
            // A job of a reset with nothing held (never sent) or already over.
            return;
        };
        let bit = 1u64 << worker.min(63);
        if worker >= self.config.worker_count || stale.acked & bit != 0 {
            self.broken(format_args!(
                "stale job {job:?}: unknown worker {worker} or its second acknowledgement"
            ));
            return;
        }
        stale.acked |= bit;
        if stale.acked.count_ones() < self.config.worker_count {
            return;
        }
        let Some(stale) = self.stale_jobs.remove(&job) else {
            return;
        };
        if !stale.slots.is_empty() {
            self.manager.release_held(&stale.slots);
        }
        let request = stale.request;
        if stale.report_load {
            outcome.loads.push((request, false));
        }
        let left = self.stale_by_request.get_mut(&request).map(|n| {
            *n -= 1;
            *n
        });
        if left == Some(0) {
            self.stale_by_request.remove(&request);
            if self.release_after_stale.remove(&request) {
                self.released.push(request);
            }
        }
    }

    fn complete_job(&mut self, job: JobId, outcome: &mut UpdateOutcome) {
        let Some(record) = self.jobs.remove(&job) else {
            return;
        };
        for &block in &record.blocks {
            self.fences.remove(&(block, job));
        }
        self.flush_out.remove(&job);
        let success = !record.failed;
        match record.kind {
            JobKind::Store => {
                self.manager.complete_store(&record.keys, success);
                if !success {
                    self.stats.store_failures += 1;
                }
            }
            JobKind::Load => {
                self.manager.complete_load(&record.keys);
                if !success {
                    self.stats.load_failures += 1;
                }
                outcome.loads.push((record.request, success));
            }
        }
        self.detach_job(record.request, job, record.kind);
    }

    /// Removes a completed job from its request; a draining request with no job left is released.
    fn detach_job(&mut self, id: RequestId, job: JobId, kind: JobKind) {
        match self.requests.get_mut(&id) {
            Some(Tracked::Live(req)) => match kind {
                JobKind::Load => req.load_job = None,
                JobKind::Store => req.store_jobs.retain(|&j| j != job),
            },
            Some(Tracked::Draining(draining)) => {
                draining.jobs.retain(|&j| j != job);
                if draining.jobs.is_empty() {
                    self.requests.remove(&id);
                    self.release(id);
                }
            }
            None => self.broken(format_args!(
                "job {job:?} belongs to untracked request {id:?}"
            )),
        }
    }

    /// Reports a broken bookkeeping invariant: panics in strict mode, else counts it.
    #[track_caller]
    fn broken(&mut self, what: std::fmt::Arguments<'_>) {
        self.stats.invariant_failures += 1;
        invariant::broken(self.config.strict, what);
    }

    /// A broken invariant about request `id` (design.md section 4, last paragraph): panics in
    /// strict mode; otherwise counts it and, if the request is live, switches its offload off
    /// (no more loads or stores for it; its jobs in flight still complete), so that a request
    /// whose state is not trusted never moves KV again.
    #[track_caller]
    fn broken_for(&mut self, id: RequestId, what: std::fmt::Arguments<'_>) {
        self.broken(what);
        if let Some(Tracked::Live(req)) = self.requests.get_mut(&id) {
            if !req.disabled {
                req.disabled = true;
                req.matched = None;
                self.stats.requests_disabled += 1;
            }
        }
    }

    /// Cross-checks the request table, the job table and the fences (strict mode only: it walks
    /// every table).
    fn check_invariants(&mut self) {
        if !self.config.strict {
            return;
        }
        let mut counted = 0usize;
        for (&id, tracked) in &self.requests {
            let (loads, stores): (Vec<JobId>, &[JobId]) = match tracked {
                Tracked::Live(req) => {
                    // Item 5: one load or any number of stores, never both.
                    assert!(
                        req.load_job.is_none() || req.store_jobs.is_empty(),
                        "request {id:?} has a load and stores in flight"
                    );
                    (req.load_job.into_iter().collect(), &req.store_jobs)
                }
                Tracked::Draining(d) => {
                    assert!(!d.jobs.is_empty(), "draining request {id:?} has no job");
                    (Vec::new(), &d.jobs)
                }
            };
            for job in loads.iter().chain(stores) {
                let record = self.jobs.get(job);
                assert!(
                    record.is_some_and(|r| r.request == id),
                    "request {id:?} lists job {job:?} that is not its own"
                );
                counted += 1;
            }
        }
        assert_eq!(counted, self.jobs.len(), "jobs without a request");
        let mut stale: BTreeMap<RequestId, u32> = BTreeMap::new();
        for job in self.stale_jobs.values() {
            *stale.entry(job.request).or_insert(0) += 1;
        }
        assert_eq!(
            stale, self.stale_by_request,
            "stale jobs miscounted per request"
        );
        for id in &self.release_after_stale {
            assert!(
                self.stale_by_request.contains_key(id) && !self.requests.contains_key(id),
                "request {id:?} waits for stale jobs it does not have, or is still tracked"
            );
        }
        for &(_, job) in &self.fences {
            assert!(
                self.jobs
                    .get(&job)
                    .is_some_and(|r| r.kind == JobKind::Store),
                "fence on job {job:?} that is not an in-flight store"
            );
        }
        for id in &self.finishing {
            assert!(
                matches!(self.requests.get(id), Some(Tracked::Live(r)) if r.finish.is_some()),
                "finishing request {id:?} is not a finished live request"
            );
        }
    }
}

/// The transfers of a store job for the keys `prepared` says to write, and the engine blocks they
/// read; `None` when every key was already present.
fn store_job_parts(
    req: &LiveRequest,
    candidates: &[(u32, u32, u32)],
    keys: &[ChunkKey],
    prepared: &PreparedStore,
) -> Option<(Vec<Transfer>, Vec<BlockId>)> {
    if prepared.keys.is_empty() {
        return None;
    }
    let mut transfers = Vec::with_capacity(prepared.keys.len());
    let mut blocks = Vec::new();
    let mut next = 0usize;
    for (&key, &slot) in prepared.keys.iter().zip(&prepared.slots) {
        // Prepared keys are a subsequence of the candidate keys.
        while next < keys.len() && keys[next] != key {
            next += 1;
        }
        let &(_, first, count) = candidates.get(next)?;
        next += 1;
        let gpu_blocks = req.block_ids[first as usize..(first + count) as usize].to_vec();
        blocks.extend_from_slice(&gpu_blocks);
        transfers.push(Transfer {
            key,
            slot,
            first_block_in_chunk: 0,
            gpu_blocks,
        });
    }
    Some((transfers, blocks))
}

fn validate(config: &SchedulerConfig) -> Result<(), CoreError> {
    let bad = |key: &'static str, reason: &str| {
        Err(CoreError::InvalidConfig {
            key,
            reason: reason.to_string(),
        })
    };
    if config.tokens_per_block == 0 {
        return bad("tokens_per_block", "must be at least 1");
    }
    if config.blocks_per_chunk == 0 {
        return bad("blocks_per_chunk", "must be at least 1");
    }
    if config
        .tokens_per_block
        .checked_mul(config.blocks_per_chunk)
        .is_none()
    {
        return bad("blocks_per_chunk", "tokens per chunk overflow u32");
    }
    if config.worker_count == 0 || config.worker_count > 64 {
        return bad("worker_count", "must be between 1 and 64");
    }
    if config.jobs_in_flight_max == 0 {
        return bad("jobs_in_flight_max", "must be at least 1");
    }
    if config.requests_max == 0 {
        return bad("requests_max", "must be at least 1");
    }
    Ok(())
}
