//! What a simulation reports: counters, the failures it found, and its error type.

use std::fmt;

use offload_core::CoreError;
use serde::Serialize;

/// Most failure messages a report keeps (the counters keep counting).
pub const FAILURES_KEPT_MAX: usize = 32;

/// Where one request's prompt KV came from, each prompt position counted once, the first time
/// it had KV. For a finished request the three parts sum to its prompt length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TokenSplit {
    /// From the GPU prefix cache (blocks other requests computed).
    pub gpu_cached: u32,
    /// Loaded by kvtier.
    pub loaded: u32,
    /// Computed by the engine.
    pub computed: u32,
}

impl TokenSplit {
    /// The three parts summed.
    pub fn total(&self) -> u32 {
        self.gpu_cached + self.loaded + self.computed
    }
}

/// Counters and findings of a simulation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SimReport {
    /// The seed that replays this run.
    pub seed: u64,
    /// Steps run.
    pub steps: u64,
    /// Requests in the workload.
    pub requests_total: u64,
    /// Requests that finished normally.
    pub requests_finished: u64,
    /// Requests aborted.
    pub requests_aborted: u64,
    /// Prompt tokens of the requests that arrived.
    pub prompt_tokens: u64,
    /// Tokens sampled (and kept).
    pub output_tokens: u64,
    /// Prompt tokens the workload lets a cache serve at best: per request, the longest prefix of
    /// full blocks an earlier-arriving request also had, short of its last token.
    /// `prompt_tokens_hit()` stays within it (but for reorderings: a request that waits while a
    /// later one computes their shared prefix).
    pub prompt_tokens_reusable: u64,
    /// Prompt tokens whose KV first came from the GPU prefix cache (blocks other requests
    /// computed). With [`SimReport::prompt_tokens_loaded`], [`SimReport::prompt_tokens_computed`]
    /// and [`SimReport::prompt_tokens_unserved`] it splits `prompt_tokens` exactly: each prompt
    /// position of each request is counted once, by where its KV came from the first time.
    pub prompt_tokens_gpu_cached: u64,
    /// Prompt tokens whose KV first came from a kvtier load.
    pub prompt_tokens_loaded: u64,
    /// Prompt tokens whose KV was first computed by the engine.
    pub prompt_tokens_computed: u64,
    /// Prompt tokens of aborted requests that never had KV (the split's remainder).
    pub prompt_tokens_unserved: u64,
    /// Tokens the engine computed in all: `prompt_tokens_computed + decode_tokens_computed +
    /// tokens_recomputed`.
    pub tokens_computed: u64,
    /// Tokens past the prompt computed for the first time (decode, and the sampled tokens a
    /// chunk carries).
    pub decode_tokens_computed: u64,
    /// Tokens past the prompt that first had KV from the GPU prefix cache or a kvtier load (a
    /// preempted request finding output blocks that another request with the same tokens
    /// computed; rare).
    pub decode_tokens_reused: u64,
    /// Tokens loaded by successful kvtier loads, in all: `prompt_tokens_loaded +
    /// tokens_loaded_again` plus the loaded part of `decode_tokens_reused`.
    pub tokens_loaded: u64,
    /// Tokens a request had had before (lost to preemption) that the GPU prefix cache gave back
    /// (vLLM counts these as preempted prefix-cache hits, apart from the others).
    pub tokens_gpu_cached_again: u64,
    /// Tokens a request had had before that a kvtier load gave back.
    pub tokens_loaded_again: u64,
    /// Computed tokens whose KV the request had had before (lost to preemption).
    pub tokens_recomputed: u64,
    /// Tokens a failed or cancelled load should have provided (computed instead).
    pub tokens_load_failed: u64,
    /// Loads that succeeded.
    pub loads_ok: u64,
    /// Loads that failed (or were cancelled by a reset).
    pub loads_failed: u64,
    /// Load jobs issued.
    pub load_jobs: u64,
    /// Store jobs issued.
    pub store_jobs: u64,
    /// Chunks in store jobs.
    pub chunks_stored: u64,
    /// Store jobs named in a `flush`.
    pub flushes: u64,
    /// Acknowledgements sent by workers (all workers, all jobs).
    pub jobs_acked: u64,
    /// Acknowledgements that reported failure.
    pub acks_failed: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Lookups answered `RetryLater`.
    pub retry_laters: u64,
    /// `request_finished` calls that returned true (blocks kept until released).
    pub finishes_deferred: u64,
    /// `reset_cache` calls.
    pub resets: u64,
    /// KV "stored" events.
    pub events_stored: u64,
    /// KV "removed" events.
    pub events_removed: u64,
    /// Loaded GPU blocks whose bytes differed from the model's (wrong KV served).
    pub integrity_failures: u64,
    /// Successful stores whose copied bytes differed from the model's (a store read a block it
    /// did not own any more, or the wrong block).
    pub store_mismatches: u64,
    /// Requests whose computed KV in GPU memory differed from the model's when checked.
    pub gpu_corruptions: u64,
    /// Broken contract rules (engine side, workers, manager checker, end of run).
    pub invariant_failures: u64,
    /// The first failure messages.
    pub failures: Vec<String>,
}

impl SimReport {
    /// No integrity failure, store mismatch, GPU corruption or invariant failure.
    pub fn is_clean(&self) -> bool {
        self.integrity_failures == 0
            && self.store_mismatches == 0
            && self.gpu_corruptions == 0
            && self.invariant_failures == 0
    }

    /// Prompt tokens served without compute the first time: from the GPU prefix cache or loaded
    /// by kvtier. Within `prompt_tokens_reusable` (see there for the one exception).
    pub fn prompt_tokens_hit(&self) -> u64 {
        self.prompt_tokens_gpu_cached + self.prompt_tokens_loaded
    }

    pub(crate) fn note(&mut self, message: String) {
        if self.failures.len() < FAILURES_KEPT_MAX {
            self.failures.push(message);
        }
    }
}

/// Why a simulation could not be set up or did not finish.
#[derive(Debug)]
pub enum SimError {
    /// A setting is out of range.
    InvalidConfig {
        /// The setting.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// A request of the workload cannot run with these settings.
    InvalidWorkload {
        /// Why, naming the request.
        reason: String,
    },
    /// kvtier refused its configuration.
    Core(CoreError),
    /// Requests were still unfinished (or jobs unacknowledged) after the step limit.
    NoProgress {
        /// The seed of the run.
        seed: u64,
        /// Steps run.
        steps: u64,
        /// What was still pending: one line per stuck request or job.
        stuck: Vec<String>,
    },
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::InvalidConfig { field, reason } => {
                write!(f, "invalid sim config `{field}`: {reason}")
            }
            SimError::InvalidWorkload { reason } => write!(f, "invalid workload: {reason}"),
            SimError::Core(e) => write!(f, "kvtier rejected the configuration: {e}"),
            SimError::NoProgress { seed, steps, stuck } => {
                write!(
                    f,
                    "no completion after {steps} steps (seed {seed}); stuck: {}",
                    stuck.join("; ")
                )
            }
        }
    }
}

impl std::error::Error for SimError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SimError::Core(e) => Some(e),
            _ => None,
        }
    }
}

impl From<CoreError> for SimError {
    fn from(e: CoreError) -> Self {
        SimError::Core(e)
    }
}
