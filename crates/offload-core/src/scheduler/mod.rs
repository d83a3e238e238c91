//! The scheduler-side request state machine and job builder (design.md section 4, items 1-8 and 13).
//!
//! The engine drives a [`Scheduler`] with the calls vLLM's connector API has, in the engine's order:
//!
//! 1. [`Scheduler::on_new_request`] when a request arrives;
//! 2. [`Scheduler::get_num_new_matched_tokens`] while scheduling a waiting request (prefix lookup);
//! 3. [`Scheduler::update_state_after_alloc`] once its blocks are allocated (builds its load job);
//! 4. [`Scheduler::build_connector_meta`] once per step, after scheduling: this step's store jobs
//!    (including deferred final stores of requests that finished), the jobs to flush, and, only
//!    after every store was built, the finish signals;
//! 5. [`Scheduler::update_connector_output`] with the workers' acknowledgements;
//! 6. [`Scheduler::request_finished`] when a request finishes or is aborted (never notifies the
//!    manager itself; it only records the finish);
//! 7. [`Scheduler::reset_cache`] to drop everything offloaded;
//! 8. [`Scheduler::take_released`] to learn which finished requests' engine blocks may be freed.
//!
//! A request's state is `Live` (it may still prepare stores) until its finish is signalled; it is
//! then moved into a `Draining` record that has no block table and no cursor, so a store for a
//! finished request cannot be built: the reference's "prepare_store after on_request_finished"
//! crash is unrepresentable here.
//!
//! Files, one idea each: this one holds the settings, the engine's inputs, and the
//! [`Scheduler`]'s tables (request table, job table, fences) with its inspection methods;
//! `admit.rs` a request's arrival, prefix lookup and load job; `step.rs` each step's metadata,
//! preemptions and fences; `store.rs` store jobs; `finish.rs` finishes, the single finish signal
//! and block release; `ack.rs` the workers' acknowledgements; `reset.rs` `reset_cache`;
//! `check.rs` broken invariants and the strict cross-checks; `request.rs` a request's own
//! state (watermark, store candidates).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::key::{BlockId, ChunkKey, JobId, RequestId, SlotId};
use crate::manager::{OffloadManager, PreparedStore};
use crate::meta::{Job, JobKind};
use crate::scheduler::request::Tracked;
use crate::CoreError;

mod ack;
mod admit;
mod check;
mod finish;
mod request;
mod reset;
mod step;
mod store;

/// When a request's chunks are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OffloadPolicy {
    /// Each chunk as soon as its KV is written (every step).
    Block,
    /// All chunks at once, when the request finishes.
    Request,
}

/// Settings of a [`Scheduler`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Tokens per engine block (at least 1).
    pub tokens_per_block: u32,
    /// Engine blocks per chunk (at least 1).
    pub blocks_per_chunk: u32,
    /// Offload only the prompt's KV.
    pub offload_prompt_only: bool,
    /// Block-level or request-level offload.
    pub policy: OffloadPolicy,
    /// Number of workers that acknowledge every job (1 to 64).
    pub worker_count: u32,
    /// The KV group index written into keys.
    pub kv_group: u32,
    /// Most jobs in flight at once; stores wait (cursor unmoved) beyond it.
    pub jobs_in_flight_max: u32,
    /// Most requests tracked at once; beyond it new requests are not offloaded.
    pub requests_max: u32,
    /// Panic on a broken bookkeeping invariant (tests, simulators, debug builds).
    pub strict: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            tokens_per_block: 16,
            blocks_per_chunk: 4,
            offload_prompt_only: false,
            policy: OffloadPolicy::Block,
            worker_count: 1,
            kv_group: 0,
            jobs_in_flight_max: 4096,
            requests_max: 65_536,
            strict: crate::invariant::STRICT_DEFAULT,
        }
    }
}

/// A request as it arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewRequest {
    /// Its id.
    pub id: RequestId,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Offload at most this many tokens of it (`None`: no per-request cap).
    pub max_offload_tokens: Option<u32>,
}

/// What a prefix lookup answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MatchResult {
    /// This many tokens beyond `num_computed_tokens` can be loaded (0: none).
    Tokens(u32),
    /// Ask again next step: a job of the request is in flight, or a chunk is pending.
    RetryLater,
}

/// A scheduled request in one step, as the engine's scheduler output describes it.
#[derive(Clone, Copy, Debug)]
pub struct StepRequest<'a> {
    /// The request.
    pub id: RequestId,
    /// Tokens whose KV was computed before this step (GPU cache hits and loads included).
    pub num_computed_tokens: u32,
    /// Tokens computed in this step.
    pub num_scheduled_tokens: u32,
    /// All tokens the request has now (prompt and output).
    pub num_tokens: u32,
    /// Engine blocks allocated to the request in this step.
    pub new_block_ids: &'a [BlockId],
    /// `new_block_ids` is the whole block table (a new or resumed request), not an addition.
    pub replace_blocks: bool,
    /// The request's full-block prefix hashes so far (one per full engine block; 128 bits, see
    /// [`crate::ChunkKey`]).
    pub block_hashes: &'a [u128],
}

/// One engine step's scheduling decisions.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    /// The step number (grows by one each step).
    pub step: u64,
    /// Requests scheduled this step.
    pub scheduled: &'a [StepRequest<'a>],
    /// Requests preempted this step (their blocks were freed and may be reallocated now).
    pub preempted: &'a [RequestId],
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishKind {
    /// Finished normally (stop token or length).
    Finished,
    /// Aborted by the client or the engine.
    Aborted,
}

/// A finishing request, as `request_finished` receives it.
#[derive(Clone, Copy, Debug)]
pub struct FinishedRequest<'a> {
    /// The request.
    pub id: RequestId,
    /// How it ended.
    pub kind: FinishKind,
    /// All tokens it has (prompt and output).
    pub num_tokens: u32,
    /// Tokens whose KV was computed.
    pub num_computed_tokens: u32,
    /// Its full-block prefix hashes.
    pub block_hashes: &'a [u128],
}

/// What `update_connector_output` and `reset_cache` tell the engine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UpdateOutcome {
    /// Load jobs that ended: the request, and whether its loaded tokens are valid. On `false`
    /// the engine recomputes the tokens the load would have provided.
    pub loads: Vec<(RequestId, bool)>,
}

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

    fn allocate_job_id(&mut self) -> JobId {
        let id = JobId(self.next_job_id);
        self.next_job_id += 1;
        id
    }
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
