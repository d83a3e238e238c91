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

#[cfg(feature = "bench")]
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
    /// A point in the engine's compute that a job can be made to wait for (design.md section 4,
    /// item 14): on a GPU, an event recorded on the compute stream after the kernels that write a
    /// store's source blocks, or that last read a load's destination blocks. `()` for engines
    /// whose compute has finished when the engine's forward call returns (host memory).
    type Dependency: Copy + Send;

    /// Accepts a job (a store copies engine blocks to host slots, a load the reverse) whose
    /// copies start only after `after` (if given), or refuses it without side effects.
    fn submit_after(
        &mut self,
        job: &Job,
        after: Option<Self::Dependency>,
    ) -> Result<(), TransferError>;

    /// [`TransferEngine::submit_after`] with no dependency: the copies may start at once.
    fn submit(&mut self, job: &Job) -> Result<(), TransferError> {
        self.submit_after(job, None)
    }
    /// Moves completions found so far into `out`, without blocking.
    fn poll(&mut self, out: &mut Vec<TransferDone>);
    /// Blocks until `job` (and every job of its direction submitted before it) completed; their
    /// completions are then reported by the next `poll`. Used to flush a store before the engine
    /// reuses its blocks.
    fn wait(&mut self, job: JobId);
    /// Blocks until every accepted job completed (completions then wait in `poll`).
    fn drain(&mut self);
    /// Like [`TransferEngine::drain`], but returns at `deadline` (a copy thread or stream that
    /// stopped making progress); returns whether every job completed. Jobs not completed stay
    /// in flight, the memory they name theirs, and a later `poll` reports them. The default
    /// waits without a bound and answers `true`; the host and CUDA engines bound it.
    fn drain_until(&mut self, deadline: std::time::Instant) -> bool {
        let _ = deadline;
        self.drain();
        true
    }
}
