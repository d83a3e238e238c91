//! Identities: chunk keys (content addresses), request, job, slot and engine-block ids, and the
//! answer a lookup gives.

use serde::{Deserialize, Serialize};

/// A chunk's identity: the engine's chained prefix hash of the chunk's last engine block, plus the
/// KV group index. Equal keys mean equal KV bytes.
///
/// The hash has 128 bits end to end (pool, tiers, the p2p protocol, the record format), so that
/// two different prefixes colliding is negligible even over a fleet's lifetime: with 2^40 keys
/// alive at once the odds of any collision are about 2^-49, where 64 bits gave about 1 in 30.
/// Engines whose block hashes are wider (vLLM's are 256-bit) give their first 128 bits, or a
/// 128-bit hash of them. It is a plain `u128` (so keys from small integers stay literals, and
/// order, hashing and serde come derived); the cost is the `u128`'s 16-byte alignment, which
/// makes a `ChunkKey` 32 bytes in memory (the host pool's slots store the fields unpadded).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ChunkKey {
    /// Chained prefix hash of the chunk's last engine block (128 bits).
    pub hash: u128,
    /// KV cache group index (0 for models with one group).
    pub group: u32,
}

impl ChunkKey {
    /// The key of the chunk whose last engine block has prefix hash `hash`, in KV group `group`.
    pub const fn new(hash: u128, group: u32) -> Self {
        Self { hash, group }
    }

    /// The hash's low 64 bits.
    pub const fn hash_low(self) -> u64 {
        self.hash as u64
    }

    /// The hash's high 64 bits.
    pub const fn hash_high(self) -> u64 {
        (self.hash >> 64) as u64
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
