//! What a simulation reports: counters, the failures it found, and its error type.

use std::fmt;

use offload_core::CoreError;
use serde::Serialize;

/// Most failure messages a report keeps (the counters keep counting).
pub const FAILURES_KEPT_MAX: usize = 32;

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
    /// Tokens the engine computed (prefill, decode and recompute).
    pub tokens_computed: u64,
    /// Tokens the GPU prefix cache provided when a waiting request was scheduled.
    pub tokens_gpu_cached: u64,
    /// Tokens loaded from the offload (successful loads).
    pub tokens_loaded: u64,
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
