//! KV events in the shape cache-aware routers read: a chunk stored in, or removed from, a medium.

use serde::{Deserialize, Serialize};

use crate::key::ChunkKey;

/// Where a copy of a chunk lives.
///
/// Non-exhaustive: a new kind of tier (object store, remote cache) may need its own medium, so
/// code outside this crate that matches it keeps a `_` arm.
///
/// ```compile_fail
/// // Outside offload-core a match needs a `_` arm:
/// fn f(x: offload_core::Medium) {
///     match x {
///         offload_core::Medium::Gpu => {}
///         offload_core::Medium::Cpu => {}
///         offload_core::Medium::Disk => {}
///         offload_core::Medium::Peer => {}
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Medium {
    /// The engine's GPU KV cache.
    Gpu,
    /// The pinned host pool (primary tier).
    Cpu,
    /// A local or shared disk tier.
    Disk,
    /// A peer instance.
    Peer,
}

impl Medium {
    /// The lower-case name routers use (`"GPU"`, `"CPU"`, `"DISK"`, `"PEER"`, as in vLLM's events).
    pub const fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Disk => "DISK",
            Medium::Peer => "PEER",
        }
    }
}

/// A change to the set of chunks a medium holds.
///
/// Non-exhaustive: routers' event streams have more kinds (vLLM's "all blocks cleared"), which
/// may be added; a consumer skips kinds it does not know.
///
/// ```compile_fail
/// // Outside offload-core a match needs a `_` arm:
/// fn f(x: offload_core::KvEvent) {
///     match x {
///         offload_core::KvEvent::Stored { .. } => {}
///         offload_core::KvEvent::Removed { .. } => {}
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum KvEvent {
    /// The chunk became readable in `medium`.
    Stored {
        /// The chunk.
        key: ChunkKey,
        /// Where it is now.
        medium: Medium,
    },
    /// The chunk is no longer in `medium`. For an eviction this precedes the `Stored` event that
    /// reuses its capacity.
    Removed {
        /// The chunk.
        key: ChunkKey,
        /// Where it was.
        medium: Medium,
    },
}
