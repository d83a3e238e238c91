//! kvtier's deterministic core: chunk keys, lookup answers, KV events, the host-pool manager,
//! the per-request state machine and job builder (the scheduler side), and the [`Tier`] trait
//! that every storage backend implements.
//!
//! Architecture invariant: this crate performs no I/O, reads no clock, starts no thread, draws no
//! random number and never depends on hash-map iteration order. Time and completions come in as
//! inputs; work to do goes out as plain data ([`ConnectorMeta`]).

#![forbid(unsafe_code)]

#[cfg(feature = "bench")]
pub mod bench;
pub mod error;
pub mod event;
pub mod invariant;
pub mod job_book;
pub mod key;
pub mod manager;
pub mod meta;
pub mod namespace;
pub mod pool;
pub mod record;
pub mod scheduler;
pub mod stats;
pub mod tier;

pub use error::{CoreError, ErrorKind};
pub use event::{KvEvent, Medium};
pub use job_book::{BookError, Booked, JobBook};
pub use key::{BlockId, ChunkKey, JobId, LookupResult, RequestId, SlotId};
pub use manager::{OffloadManager, PreparedStore};
pub use meta::{ConnectorMeta, Job, JobAck, JobKind, Transfer, WorkerOutput};
pub use namespace::NamespaceId;
pub use pool::{EvictionPolicy, HostPool, PoolConfig};
pub use scheduler::{
    FinishKind, FinishedRequest, MatchResult, NewRequest, OffloadPolicy, Scheduler,
    SchedulerConfig, SchedulerStats, StepInput, StepRequest, UpdateOutcome,
};
pub use stats::Stats;
pub use tier::{
    FailedKey, SlotMemory, Tier, TierChunk, TierCompletion, TierFailure, TierJob, TierLookup,
    TierOp,
};
