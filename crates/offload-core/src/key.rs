//! Identities: chunk keys (content addresses), request, job, slot and engine-block ids, and the
//! answer a lookup gives.

use serde::{Deserialize, Serialize};

/// A chunk's identity: the engine's chained prefix hash of the chunk's last engine block, plus the
/// KV group index. Equal keys mean equal KV bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ChunkKey {
    /// Chained prefix hash of the chunk's last engine block.
    pub hash: u64,
    /// KV cache group index (0 for models with one group).
    pub group: u32,
}

impl ChunkKey {
    /// The key of the chunk whose last engine block has prefix hash `hash`, in KV group `group`.
    pub const fn new(hash: u64, group: u32) -> Self {
        Self { hash, group }
    }
}

/// An engine request's id, unique for the engine's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// A transfer job's id. Job ids only grow, also across `reset_cache`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct JobId(pub u64);

/// A row of the host pool, one chunk in size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SlotId(pub u32);

/// An engine block (GPU page) index in the engine's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BlockId(pub u32);

/// What a lookup of one key answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LookupResult {
    /// Not stored here; a prefix scan stops.
    Miss,
    /// Stored and readable now.
    Hit,
    /// Being written (a store or a promotion is in flight): counts as a hit, but the request must
    /// wait until it is ready.
    Pending,
    /// Not known yet (an asynchronous probe is under way): the request waits, the scan goes on.
    Retry,
}
