//! The host-pool manager: which chunk lives in which slot, slot reference counts, and eviction.
//! It manages metadata only; the bytes live in a [`crate::SlotMemory`] owned by a tier crate.

use crate::event::KvEvent;
use crate::key::{ChunkKey, LookupResult, RequestId, SlotId};
use crate::manager::{OffloadManager, PreparedStore};
use crate::stats::Stats;
use crate::CoreError;

/// Which chunks to evict first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum EvictionPolicy {
    /// Least recently used.
    Lru,
    /// Adaptive replacement cache (recency and frequency lists with ghost lists).
    Arc,
}

impl EvictionPolicy {
    /// Parses `"lru"` or `"arc"` (any case).
    pub fn from_name(name: &str) -> Result<Self, CoreError> {
        match name.to_ascii_lowercase().as_str() {
            "lru" => Ok(EvictionPolicy::Lru),
            "arc" => Ok(EvictionPolicy::Arc),
            other => Err(CoreError::InvalidConfig {
                key: "eviction_policy",
                reason: format!("unknown policy {other:?}; expected \"lru\" or \"arc\""),
            }),
        }
    }
}

/// Settings of a [`HostPool`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Number of chunk-sized slots (at least 1).
    pub slot_count: u32,
    /// Eviction policy.
    pub policy: EvictionPolicy,
    /// Store a chunk only after it was looked up this many times (0 or 1: always store).
    pub reuse_threshold: u32,
    /// Gather KV events for `take_events`.
    pub events: bool,
}

/// The host-pool manager (design.md section 4, items 9-10).
pub struct HostPool {
    _todo: (),
}

impl HostPool {
    /// Creates an empty pool; fails with an error naming the setting if `config` is invalid.
    pub fn new(config: PoolConfig) -> Result<Self, CoreError> {
        let _ = config;
        todo!()
    }
    /// Counters so far.
    pub fn stats(&self) -> Stats {
        todo!()
    }
}

impl OffloadManager for HostPool {
    fn lookup(&mut self, _key: ChunkKey, _request: RequestId) -> LookupResult {
        todo!()
    }
    fn prepare_load(
        &mut self,
        _keys: &[ChunkKey],
        _request: RequestId,
        _slots: &mut Vec<SlotId>,
    ) -> Result<(), CoreError> {
        todo!()
    }
    fn complete_load(&mut self, _keys: &[ChunkKey]) {
        todo!()
    }
    fn touch(&mut self, _keys: &[ChunkKey], _request: RequestId) {
        todo!()
    }
    fn prepare_store(
        &mut self,
        _keys: &[ChunkKey],
        _request: RequestId,
        _out: &mut PreparedStore,
    ) -> Result<(), CoreError> {
        todo!()
    }
    fn complete_store(&mut self, _keys: &[ChunkKey], _success: bool) {
        todo!()
    }
    fn on_request_finished(&mut self, _request: RequestId) {}
    fn reset(&mut self) {
        todo!()
    }
    fn take_events(&mut self, _out: &mut Vec<KvEvent>) {
        todo!()
    }
}
