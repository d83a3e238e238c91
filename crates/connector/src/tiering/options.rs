//! The settings of a [`TieringManager`]: [`TieringOptions`], and the [`TierMask`] that limits the
//! secondary tiers a request may load from.

use std::sync::Arc;

use offload_core::invariant;
use serde::Serialize;

use super::TIERS_MAX;
#[cfg(doc)]
use super::{TierEvent, TieringManager};
use crate::clock::{Clock, MonotonicClock};

/// Which secondary tiers a request may load from: bit `i` is tier `i` (in configuration order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct TierMask(pub u64);

impl TierMask {
    /// Every tier.
    pub const ALL: TierMask = TierMask(u64::MAX);
    /// No secondary tier (host pool only).
    pub const NONE: TierMask = TierMask(0);

    /// Whether tier `index` is allowed.
    pub fn allows(self, index: usize) -> bool {
        index < TIERS_MAX && self.0 & (1u64 << index) != 0
    }

    /// The mask of exactly the tiers listed.
    pub fn of(indices: &[usize]) -> Self {
        TierMask(
            indices
                .iter()
                .filter(|&&i| i < TIERS_MAX)
                .fold(0, |m, &i| m | (1u64 << i)),
        )
    }
}

/// Settings of a [`TieringManager`] beyond its parts.
#[derive(Clone)]
pub struct TieringOptions {
    /// Bytes per host slot (the payload length of every tier job's chunks).
    pub slot_bytes: u32,
    /// Panic on a broken bookkeeping invariant (tests, simulators, debug builds).
    pub strict: bool,
    /// A promotion in flight longer than this is cancelled (it then fails, and the engine
    /// recomputes). Tiers have their own deadlines; this one bounds a tier that breaks them.
    pub promotion_deadline_ns: u64,
    /// A cascade queued behind a busy tier longer than this is dropped (its host pins released);
    /// one submitted and not reported within it is cancelled. It bounds how long a stalled or
    /// busy tier keeps host slots pinned.
    pub cascade_deadline_ns: u64,
    /// How long a reset waits for the tiers' jobs before it cancels those still in flight.
    pub reset_drain_deadline_ns: u64,
    /// Gather [`TierEvent`]s.
    pub events: bool,
    /// Where time comes from (for metrics and the promotion deadline).
    pub clock: Arc<dyn Clock>,
}

impl TieringOptions {
    /// Options for slots of `slot_bytes`, with strictness from the build (debug: strict), a
    /// 10-second promotion deadline, a 30-second cascade deadline, a 5-second reset drain
    /// deadline, events on, and the monotonic clock.
    pub fn new(slot_bytes: u32) -> Self {
        Self {
            slot_bytes,
            strict: invariant::STRICT_DEFAULT,
            promotion_deadline_ns: 10_000_000_000,
            cascade_deadline_ns: 30_000_000_000,
            reset_drain_deadline_ns: 5_000_000_000,
            events: true,
            clock: Arc::new(MonotonicClock::new()),
        }
    }
}

impl std::fmt::Debug for TieringOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieringOptions")
            .field("slot_bytes", &self.slot_bytes)
            .field("strict", &self.strict)
            .field("promotion_deadline_ns", &self.promotion_deadline_ns)
            .field("cascade_deadline_ns", &self.cascade_deadline_ns)
            .field("reset_drain_deadline_ns", &self.reset_drain_deadline_ns)
            .field("events", &self.events)
            .finish_non_exhaustive()
    }
}
