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

use serde::{Deserialize, Serialize};

use crate::key::{BlockId, RequestId};
mod request;
mod state;

pub use state::{Scheduler, SchedulerStats};

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
