//! Engine simulator: a small but real engine scheduler in the manner of vLLM's v1 scheduler that
//! drives kvtier's scheduler-side API exactly as an engine does, with simulated tensor-parallel
//! workers that move real bytes, and a deterministic model whose KV bytes are a function of the
//! token prefix, so that every load can be checked byte for byte.
//!
//! - [`model`]: tokens, chained block hashes, KV bytes of every token and block.
//! - [`gpu`]: the GPU KV cache and its block pool (reference counts, LRU free queue, prefix cache).
//! - [`host`], [`worker`]: the host pool's bytes, shards, block copies, and the workers.
//! - [`checked`]: [`CheckedManager`], a lifecycle checker around any offload manager.
//! - [`connector`]: the connector calls as a trait, for kvtier's scheduler, the connector crate's
//!   [`::connector::SchedulerHandle`] (tiering across host, disk and peers) and a no-offload baseline.
//! - [`transfer`]: [`transfer::SimTransferEngine`], a tier-gpu transfer engine on simulated
//!   memory, for the connector's worker handle.
//! - [`sim`]: [`Sim`], the engine loop (sync or async scheduling), with its checks.
//!
//! One seed ([`SimConfig::seed`]) decides every choice; a failure names it.

#![forbid(unsafe_code)]

pub mod checked;
pub mod config;
pub mod connector;
pub mod gpu;
pub mod host;
pub mod model;
pub mod report;
pub mod reuse;
pub mod rng;
pub mod scenario;
pub mod sim;
pub mod trace;
pub mod transfer;
pub mod worker;
pub mod workload;

pub use self::connector::{EngineConnector, KvHandle, KvScheduler, NullConnector};
pub use checked::{CheckedManager, ManagerCall};
pub use config::{OutputOrder, SimConfig};
pub use host::{CopyDirection, CopyEngine, HostPathEngine, MemcpyEngine};
pub use report::{SimError, SimReport, TokenSplit};
pub use sim::{Phase, RequestView, Sim, StepSummary};
pub use worker::{Worker, WorkerFaults};
pub use workload::{RequestSpec, SharedPrefix, SharedPrefixSpec, Workload};
