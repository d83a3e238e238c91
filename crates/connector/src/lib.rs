//! kvtier's connector: what an inference engine embeds.
//!
//! - [`TieringManager`] ([`tiering`]): the host pool (primary tier) composed with an ordered list
//!   of secondary tiers (disk, peers); it implements [`offload_core::OffloadManager`], so
//!   offload-core's scheduler drives it unchanged.
//! - [`SchedulerHandle`] ([`handle`]): the engine's scheduler side (request lifecycle, per-step
//!   worker metadata, prefix lookups across tiers, KV events, metrics).
//! - `WorkerHandle` (`worker`, feature `gpu`): each engine worker's side; executes the per-step
//!   metadata on a tier-gpu `TransferEngine` (CUDA or the host path) and reports every job once.
//! - [`config`]: configuration from TOML or JSON with the reference's keys, checked against the
//!   engine's geometry, and the tiers it names started; [`registry`]: the tier types a
//!   configuration may name (the built-in `fs` and `p2p`, and the embedding program's own).
//! - [`testing`]: seams for tests and simulators ([`testing::SharedTier`], a tier its builder
//!   keeps a handle to for fault injection and its call log; [`testing::ManualClock`]).
//! - [`metrics`]: counters and their Prometheus text format; [`clock`]: time behind a trait a
//!   simulator can control.
//!
//! How an engine embeds it: read the configuration, check it against the engine's geometry
//! (with a [`registry::TierRegistry`] holding its own tier types, if any), build the
//! [`SchedulerHandle`] over the tiering manager over the host pool's bytes (the same
//! [`offload_core::SlotMemory`] the workers' transfer engines copy into) in one call, and drive
//! it with the engine's scheduler calls; each worker runs a `WorkerHandle` on the metadata of
//! every step. `docs/writing-a-tier.md` shows how to write a tier and name it in the file.
//!
//! ```
//! use std::sync::Arc;
//! use connector::config::{ConnectorConfig, EngineGeometry};
//! use connector::SchedulerHandle;
//! use offload_core::{MatchResult, NewRequest, RequestId, StepInput};
//!
//! let config = ConnectorConfig::from_toml_str("cpu_bytes_to_use = 65536\nblock_size = 64\n")?;
//! let resolved = config.resolve(&EngineGeometry::new("my-model", 16, 4096))?;
//! let memory = Arc::new(tier_testkit::VecSlotMemory::new(
//!     resolved.pool.slot_count,
//!     resolved.slot_bytes as usize,
//! ));
//! let mut scheduler: SchedulerHandle = resolved.build_scheduler(memory, true)?;
//! scheduler.on_new_request(NewRequest { id: RequestId(1), prompt_tokens: 100, max_offload_tokens: None });
//! let hashes: Vec<u128> = (1..=6).collect();
//! assert_eq!(
//!     scheduler.get_num_new_matched_tokens(RequestId(1), 100, &hashes, 0),
//!     MatchResult::Tokens(0)
//! );
//! let meta = scheduler.build_connector_meta(&StepInput { step: 0, scheduled: &[], preempted: &[] });
//! assert!(meta.loads.is_empty());
//! assert!(scheduler.prometheus_text().contains("kvtier_pool_slots 4"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Cargo features pick the tiers compiled in: `gpu` (tier-gpu's worker side, default), `fs`
//! (tier-fs), `p2p` (tier-p2p).

pub mod clock;
pub mod config;
pub mod handle;
pub mod metrics;
pub mod registry;
mod shared;
pub mod tiering;
#[cfg(feature = "gpu")]
pub mod worker;

pub use offload_core as core;

pub use clock::{Clock, MonotonicClock};
pub use config::{ConfigError, ConnectorConfig, EngineGeometry, ResolvedConfig};
pub use handle::{AsTiering, SchedulerHandle};
pub use metrics::{Metrics, PoolUsage};
pub use registry::{TierFactory, TierRegistry, TierSettings};
pub use tiering::{
    FailureCounts, TierCounters, TierEvent, TierMask, TieringCounters, TieringManager,
    TieringOptions, HOST_TIER_NAME, TIERS_MAX,
};
#[cfg(feature = "gpu")]
pub use worker::{WorkerCounters, WorkerHandle, WORKER_DRAIN_DEADLINE};

/// Seams for tests and simulators, kept out of the crate root: [`SharedTier`](crate::shared::SharedTier) (a tier behind a
/// shared lock with a call log, so the builder keeps a handle to a tier it gave the manager, for
/// fault injection mid-run) and its [`TierCall`](crate::shared::TierCall) log entries, and
/// [`ManualClock`](crate::clock::ManualClock) (time that moves only when told, which the
/// deterministic simulator and the deadline tests run on; an engine uses the monotonic clock).
///
/// ```
/// use connector::testing::{ManualClock, SharedTier, TierCall};
/// use connector::Clock;
///
/// let clock = ManualClock::new();
/// clock.advance(5);
/// assert_eq!(clock.now_ns(), 5);
/// ```
///
/// None of them is at the crate root:
///
/// ```compile_fail
/// use connector::ManualClock;
/// ```
///
/// ```compile_fail
/// use connector::SharedTier;
/// ```
pub mod testing {
    pub use crate::clock::ManualClock;
    pub use crate::shared::{SharedTier, TierCall};
}
