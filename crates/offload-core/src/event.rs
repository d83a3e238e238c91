//! KV events in the shape cache-aware routers read: a chunk stored in, or removed from, a medium.

use serde::{Deserialize, Serialize};

use crate::key::ChunkKey;

/// Where a copy of a chunk lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
