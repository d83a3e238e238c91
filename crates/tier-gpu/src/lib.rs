//! kvtier's primary-tier worker side: moves chunks between the engine's KV cache and the host pool.
//!
//! - [`plan`]: which byte ranges go where for a job, coalesced into the largest contiguous runs
//!   (pure code, tested with fake addresses).
//! - [`host`]: the host path: a host pool allocated once and prefaulted in parallel
//!   ([`HostPoolMemory`]), a small memcpy worker pool ([`HostCopier`]), and the job-level
//!   [`HostTransferEngine`]. Used where no GPU is present (and by the engine simulator).
//! - `cuda` (feature `cuda`): the same interface over CUDA streams through cudarc.
//!
//! Both engines implement [`TransferEngine`]: jobs are submitted, complete exactly once, and are
//! reported in submission order per direction.

pub mod bench;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
pub mod plan;

pub use host::{HostCopier, HostPoolMemory, HostTransferEngine};
pub use plan::{CopyRun, KvLayout, PlanError, Region};

use offload_core::{Job, JobId, JobKind};
use thiserror::Error;

/// Why a transfer engine refused a job (a refused job never completes).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum TransferError {
    /// The job does not fit the registered layout (a bad block, slot or group).
    #[error("job {job:?} does not fit the KV layout: {source}")]
    Plan {
        /// The job.
        job: JobId,
        /// What was wrong.
        source: PlanError,
    },
    /// Too many jobs in flight; submit again after polling.
    #[error("transfer queue full ({in_flight} jobs in flight)")]
    Busy {
        /// Jobs in flight.
        in_flight: usize,
    },
    /// The engine was shut down or its device failed.
    #[error("transfer engine unavailable: {0}")]
    Unavailable(String),
}

/// The single completion of a submitted job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferDone {
    /// The job.
    pub job: JobId,
    /// Its direction.
    pub kind: JobKind,
    /// Whether every byte was copied.
    pub success: bool,
}

/// A worker-side transfer engine between the engine's KV cache and the host pool.
///
/// Contract: every job accepted by `submit` completes exactly once (through `poll`, `wait` or
/// `drain`), with success or failure; completions of one direction are reported in submission
/// order; the host slots and engine blocks a job names belong to it until its completion has been
/// reported. A failed copy reports failure; nothing claims success for bytes not copied.
pub trait TransferEngine: Send {
    /// Accepts a job (a store copies engine blocks to host slots, a load the reverse), or refuses
    /// it without side effects.
    fn submit(&mut self, job: &Job) -> Result<(), TransferError>;
    /// Moves completions found so far into `out`, without blocking.
    fn poll(&mut self, out: &mut Vec<TransferDone>);
    /// Blocks until `job` (and every job of its direction submitted before it) completed; their
    /// completions are then reported by the next `poll`. Used to flush a store before the engine
    /// reuses its blocks.
    fn wait(&mut self, job: JobId);
    /// Blocks until every accepted job completed (completions then wait in `poll`).
    fn drain(&mut self);
}
