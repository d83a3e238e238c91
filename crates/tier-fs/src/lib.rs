//! kvtier's disk tier: chunks in files on local or shared disks, through io_uring or plain
//! syscalls, implementing offload-core's [`Tier`](offload_core::Tier) trait.
//!
//! - [`io`]: the I/O engines (io_uring, and `pread`/`pwrite` on a small thread pool) behind one
//!   interface, with [`io::AlignedBuf`] buffers owned by in-flight operations.
//! - [`config`]: [`FsTierConfig`] and the namespace identity ([`NamespaceId`]).
//! - [`layout`]: where a chunk's file lives (namespace directory, hash fan-out, temporary names)
//!   and the namespace config file.
//! - [`format`](mod@format): the on-disk chunk format (a 4 KiB header with a checksum, then the payload).
//! - [`index`]: the in-memory index of stored chunks with last-access order and the byte limit.
//! - [`fault`]: fault injection for tests ([`FaultPlan`]).
//! - [`stats`]: counters ([`FsStats`]).
//! - [`tier`]: [`FsTier`], the `Tier` implementation: a front end on the caller's thread and
//!   background workers, each owning an I/O engine.
//!
//! On disk: `<root>/<namespace hash>/namespace.json` (the layout identity, checked at start) and
//! one file per chunk, `<root>/<namespace hash>/<first 2 hex digits>/<key hash>-<group>.kv`,
//! written as `<name>.<pid>-<n>.tmp` (O_EXCL) and renamed into place.
//!
//! Architecture invariant: lookups and submits never wait for I/O; a chunk file becomes visible
//! under its final name only when it is complete (written to a temporary file, then renamed); a
//! load never reports success for bytes whose header or checksum do not verify.

pub mod config;
pub mod error;
pub mod fault;
pub mod format;
pub mod index;
pub mod io;
pub mod layout;
pub mod stats;
pub mod tier;

mod direct;
mod probe;
mod scan;
mod worker;

pub use config::{Durability, EngineChoice, FsTierConfig, NamespaceId};
pub use error::{FsError, FsErrorKind};
pub use fault::{Fault, FaultPlan, FaultRule, FaultSite, FaultTarget};
pub use stats::{FailureKind, FsStats};
pub use tier::FsTier;
