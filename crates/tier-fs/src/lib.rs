//! kvtier's disk tier: chunks in segment files on local or shared disks, through io_uring or
//! plain syscalls, implementing offload-core's [`Tier`](offload_core::Tier) trait.
//!
//! - [`io`]: the I/O engines (io_uring, and `pread`/`pwrite` on a small thread pool) behind one
//!   interface, with [`io::AlignedBuf`] buffers owned by in-flight operations.
//! - [`config`]: [`FsTierConfig`] and the namespace identity ([`NamespaceId`]).
//! - [`layout`]: where files live (namespace directory, segment names) and the namespace config
//!   file.
//! - [`format`](mod@format): the on-disk record format (a 4 KiB header with a checksum, then the
//!   payload; skip records; the seal).
//! - [`index`]: the in-memory index of chunk locations and segments, with last-access order and
//!   the byte limit.
//! - [`fault`]: fault injection for tests ([`FaultPlan`]).
//! - [`stats`]: counters ([`FsStats`]).
//! - [`tier`]: [`FsTier`], the `Tier` implementation: a front end on the caller's thread and
//!   background workers, each owning an I/O engine.
//! - `bench` (feature `bench`): the store/load benchmark against raw O_DIRECT of the same
//!   directory.
//!
//! On disk: `<root>/<namespace hash>/namespace.json` (the layout identity, checked at start) and
//! segment files `<instance>-<sequence>.seg`, each appended by one worker of one instance: a
//! sequence of records (header + payload, 4 KiB aligned), ended by a seal once every write into
//! it completed.
//!
//! Why segments and not one file per chunk: on the ext4 disk this was measured on, creating,
//! renaming and later deleting a file per chunk cost up to a millisecond each (growing with the
//! number of files deleted before), which held stores of 1-2 MiB chunks to 0.5-0.8x of raw
//! O_DIRECT sequential writes. Appending to a few large files removes that per-chunk metadata
//! work; eviction deletes whole segments. A chunk still becomes visible (enters the index) only
//! after its bytes are written, and a torn tail left by a kill is found by checksum and cut at the
//! next start, so nothing torn is ever served.
//!
//! Architecture invariant: lookups and submits never wait for I/O; a chunk enters the index only
//! after its record's write completed (and was flushed with `Durability::Fsync`); a load never
//! reports success for bytes whose header or checksum do not verify; an instance writes only into
//! its own segments when the directory is shared.

#[cfg(feature = "bench")]
pub mod bench;
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
mod segment;
mod worker;

pub use config::{Durability, EngineChoice, FsTierConfig, NamespaceId};
pub use error::{FsError, FsErrorKind};
pub use fault::{Fault, FaultPlan, FaultRule, FaultSite, FaultTarget};
pub use stats::{FailureKind, FsStats};
pub use tier::FsTier;
