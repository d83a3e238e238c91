//! kvtier's connector: what an inference engine embeds.
//!
//! - [`TieringManager`] ([`tiering`]): the host pool (primary tier) composed with an ordered list
//!   of secondary tiers (disk, peers); it implements [`offload_core::OffloadManager`], so
//!   offload-core's scheduler drives it unchanged.
//! - [`SchedulerHandle`] ([`handle`]): the engine's scheduler side (request lifecycle, per-step
//!   worker metadata, prefix lookups across tiers, KV events, metrics).
//! - `WorkerHandle` (`worker`, feature `gpu`): each engine worker's side; executes the per-step
//!   metadata on a tier-gpu `TransferEngine` (CUDA or the host path) and reports every job once.
//! - [`SharedTier`] ([`shared`]): a tier its builder keeps a handle to (fault injection, counters).
//! - [`config`]: configuration from TOML or JSON with the reference's keys, checked against the
//!   engine's geometry, and the tiers it names started.
//! - [`metrics`]: counters and their Prometheus text format; [`clock`]: time behind a trait a
//!   simulator can control.
//!
//! Cargo features pick the tiers compiled in: `gpu` (tier-gpu's worker side, default), `fs`
//! (tier-fs), `p2p` (tier-p2p).

pub mod clock;
pub mod config;
pub mod handle;
pub mod metrics;
pub mod shared;
pub mod tiering;
#[cfg(feature = "gpu")]
pub mod worker;

pub use offload_core as core;

pub use clock::{Clock, ManualClock, MonotonicClock};
pub use config::{ConfigError, ConnectorConfig, EngineGeometry, ResolvedConfig};
pub use handle::{AsTiering, SchedulerHandle};
pub use metrics::{Metrics, PoolUsage};
pub use shared::{SharedTier, TierCall};
pub use tiering::{
    TierCounters, TierEvent, TierMask, TieringCounters, TieringManager, TieringOptions,
    HOST_TIER_NAME, TIERS_MAX,
};
#[cfg(feature = "gpu")]
pub use worker::{WorkerCounters, WorkerHandle};
