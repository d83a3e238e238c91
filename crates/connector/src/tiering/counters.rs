//! The tiering manager's counters: per secondary tier ([`TierCounters`]) and its own
//! ([`TieringCounters`]).

use offload_core::tier::TierFailure;
use serde::Serialize;

#[cfg(doc)]
use super::TieringManager;

/// Failed chunks of one tier (stores and promotions together) by the [`TierFailure`] the tier
/// reported. Every failed promotion is a recompute whatever its kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FailureCounts {
    /// [`TierFailure::Missing`]: the tier did not hold the chunk.
    pub missing: u64,
    /// [`TierFailure::Corrupt`]: the bytes did not verify.
    pub corrupt: u64,
    /// [`TierFailure::Cancelled`]: cancelled before the transfer (deadline, drain, shutdown).
    pub cancelled: u64,
    /// [`TierFailure::TierDown`]: the tier could not serve (shut down, unreachable).
    pub tier_down: u64,
    /// [`TierFailure::Timeout`]: a deadline of the tier passed.
    pub timeout: u64,
    /// [`TierFailure::Io`]: an I/O or transport error, no space.
    pub io: u64,
    /// A kind this version does not know (the enum is non-exhaustive).
    pub other: u64,
}

impl FailureCounts {
    /// Counts one failed chunk of `kind`.
    pub fn add(&mut self, kind: TierFailure) {
        *self.slot(kind) += 1;
    }

    /// Failed chunks of `kind`.
    pub fn of(&self, kind: TierFailure) -> u64 {
        let mut copy = *self;
        *copy.slot(kind)
    }

    /// Every count with its label (`TierFailure::name`, and `"other"`), for metrics.
    pub fn labelled(&self) -> [(&'static str, u64); 7] {
        [
            (TierFailure::Missing.name(), self.missing),
            (TierFailure::Corrupt.name(), self.corrupt),
            (TierFailure::Cancelled.name(), self.cancelled),
            (TierFailure::TierDown.name(), self.tier_down),
            (TierFailure::Timeout.name(), self.timeout),
            (TierFailure::Io.name(), self.io),
            ("other", self.other),
        ]
    }

    fn slot(&mut self, kind: TierFailure) -> &mut u64 {
        match kind {
            TierFailure::Missing => &mut self.missing,
            TierFailure::Corrupt => &mut self.corrupt,
            TierFailure::Cancelled => &mut self.cancelled,
            TierFailure::TierDown => &mut self.tier_down,
            TierFailure::Timeout => &mut self.timeout,
            TierFailure::Io => &mut self.io,
            _ => &mut self.other,
        }
    }
}

/// Counters of one tier (secondary tiers; the host pool's come from [`HostPool::stats`]).
///
/// [`HostPool::stats`]: offload_core::HostPool::stats
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierCounters {
    /// Keys looked up in the tier (after a host-pool miss).
    pub lookups: u64,
    /// Lookups that answered `Hit`.
    pub hits: u64,
    /// Lookups that answered `Retry`.
    pub retries: u64,
    /// Hits that could not be promoted because the host pool was full.
    pub promotion_no_space: u64,
    /// Hits not promoted because the host pool's reuse threshold did not admit the key yet
    /// (`reuse_threshold`: a key is stored only after that many lookups).
    pub promotion_below_reuse_threshold: u64,
    /// Store (cascade) jobs submitted.
    pub store_jobs: u64,
    /// Chunks stored successfully.
    pub chunks_stored: u64,
    /// Chunks whose store failed.
    pub store_chunks_failed: u64,
    /// Bytes stored successfully (slot bytes per chunk).
    pub bytes_stored: u64,
    /// Nanoseconds from submit to completion, summed over store jobs.
    pub store_ns: u64,
    /// Load (promotion) jobs submitted.
    pub load_jobs: u64,
    /// Chunks promoted successfully.
    pub chunks_loaded: u64,
    /// Chunks whose promotion failed (the engine recomputes).
    pub load_chunks_failed: u64,
    /// Failed chunks, stores and promotions, by the kind the tier reported.
    pub failures: FailureCounts,
    /// Keys the tier reported dropping by itself (`Tier::take_evicted`), each a `Removed` event.
    pub evictions_reported: u64,
    /// Removals the tier dropped unreported because its list was full (no event for them).
    pub evictions_unreported: u64,
    /// Bytes promoted successfully.
    pub bytes_loaded: u64,
    /// Nanoseconds from submit to completion, summed over load jobs.
    pub load_ns: u64,
    /// Submits refused as busy (retried later).
    pub submits_busy: u64,
    /// Jobs dropped because the tier refused them for good (shut down, invalid) or a request
    /// finished while its promotion could not be submitted.
    pub jobs_dropped: u64,
    /// Promotions cancelled because they passed the promotion deadline.
    pub promotions_timed_out: u64,
    /// Cascades dropped (their host pins released, never submitted) because they waited behind
    /// a busy tier longer than the cascade deadline.
    pub cascades_expired: u64,
    /// Cascades submitted and not reported within the cascade deadline: cancelled (their pins
    /// stay until the tier reports them).
    pub cascades_timed_out: u64,
    /// Jobs still in flight when a reset's wait for this tier passed its deadline: cancelled.
    pub reset_jobs_cancelled: u64,
    /// Jobs still in flight when a reset ended (after its deadline): their host slots were held
    /// out of use, not freed, until the tier reported them.
    pub reset_jobs_held: u64,
    /// Of those, the ones the tier has reported since (their slots' holds ended).
    pub reset_held_jobs_reported: u64,
}

/// Counters of the tiering manager itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TieringCounters {
    /// Broken bookkeeping invariants (non-strict mode; strict mode panics).
    pub invariant_failures: u64,
    /// Requests finalized (tiers heard `on_request_finished`).
    pub requests_finalized: u64,
    /// Chunks stored from the GPU into the host pool.
    pub host_chunks_stored: u64,
    /// Bytes stored from the GPU into the host pool.
    pub host_bytes_stored: u64,
    /// Nanoseconds from `prepare_store` to `complete_store`, summed over host store calls.
    pub host_store_ns: u64,
    /// Chunks loaded from the host pool into the GPU.
    pub host_chunks_loaded: u64,
    /// Bytes loaded from the host pool into the GPU.
    pub host_bytes_loaded: u64,
    /// Nanoseconds from `prepare_load` to `complete_load`, summed over host load calls.
    pub host_load_ns: u64,
    /// Resets.
    pub resets: u64,
    /// Promotion pins dropped at the promotion deadline because their request never loaded them.
    pub promotion_pins_expired: u64,
    /// Resets whose wait for the tiers' jobs passed the reset drain deadline (the jobs still in
    /// flight were then cancelled, and their host slots held until reported).
    pub reset_drain_timeouts: u64,
    /// Calls of [`TieringManager::drain`] (and drops) whose wait passed the drain deadline with
    /// tier jobs still in flight (cancelled, left to report later).
    pub drain_timeouts: u64,
}
