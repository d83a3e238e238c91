//! Counters kept by the core; the connector exports them as metrics.

use serde::{Deserialize, Serialize};

/// Monotonic counters of the host-pool manager and the scheduler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Keys looked up.
    pub lookups: u64,
    /// Lookups that answered `Hit` or `Pending`.
    pub lookup_hits: u64,
    /// Chunks stored (completed successfully).
    pub chunks_stored: u64,
    /// Chunks loaded (completed successfully).
    pub chunks_loaded: u64,
    /// Chunks evicted from the host pool.
    pub evictions: u64,
    /// `prepare_store` calls that failed for lack of room.
    pub allocation_failures: u64,
    /// Store jobs that failed.
    pub store_failures: u64,
    /// Load jobs that failed (the engine recomputed).
    pub load_failures: u64,
    /// Bookkeeping invariants broken (release builds only; debug builds panic).
    pub invariant_failures: u64,
    /// Requests whose offload was dropped after a broken invariant.
    pub requests_dropped: u64,
    /// Completions ignored because their job predates a reset.
    pub stale_completions: u64,
}
