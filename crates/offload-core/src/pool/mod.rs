//! The host-pool manager: which chunk lives in which slot, slot reference counts, and eviction.
//! It manages metadata only; the bytes live in a [`crate::SlotMemory`] owned by a tier crate.
//!
//! Layout (all sized once, at creation; no allocation on the hot path):
//!
//! - `slots`: one 32-byte `Slot` per slot: the key, the reference count, the list the slot is on
//!   and its intrusive list links. Free slots form a stack threaded through the same links.
//! - `map`: an open-addressing table from the key's mixed hash to the slot index (`table.rs`),
//!   4-byte buckets, 4 per slot with LRU; with ARC 4.75 per slot (3.75 with a reuse threshold),
//!   and the table also holds the ghosts (indices from `slot_count` up), at most one per slot.
//! - the eviction policy ([`EvictionPolicy`]): LRU (`lru.rs`) or ARC (`arc.rs`, which adds a ghost
//!   arena of `slot_count` 12-byte fingerprints).
//! - with a reuse threshold above 1, a bounded lookup counter (`reuse.rs`).
//!
//! [`HostPool::metadata_bytes_per_slot`] adds these up; it stays at or below 64 bytes.

mod arc;
mod list;
mod lru;
mod reuse;
mod table;

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use crate::event::{KvEvent, Medium};
use crate::invariant;
use crate::key::{ChunkKey, LookupResult, RequestId, SlotId};
use crate::manager::{OffloadManager, PreparedStore};
use crate::stats::Stats;
use crate::CoreError;

use list::{Link, Linked, NIL};
use reuse::ReuseTracker;
use table::{mix, IndexTable};

/// Which chunks to evict first.
///
/// Non-exhaustive: more policies may come (S3-FIFO, ...); configuration constructs it, code
/// outside this crate that matches it keeps a `_` arm.
///
/// ```compile_fail
/// // Outside offload-core a match needs a `_` arm:
/// fn f(x: offload_core::EvictionPolicy) {
///     match x {
///         offload_core::EvictionPolicy::Lru => {}
///         offload_core::EvictionPolicy::Arc => {}
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
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

    /// The name [`EvictionPolicy::from_name`] reads: `"lru"` or `"arc"`.
    pub const fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Arc => "arc",
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

/// Most slots a pool may have (2^28 - 1; at 1 MiB per chunk, 256 TiB).
pub const SLOT_COUNT_MAX: u32 = table::ARENA_LEN_MAX;

/// Most slots an ARC pool may have (2^27 - 1): its key table also indexes one ghost per slot.
pub const ARC_SLOT_COUNT_MAX: u32 = table::ARENA_LEN_MAX / 2;

/// Most loads that may read one slot at once; a `prepare_load` beyond it fails.
pub const READERS_PER_SLOT_MAX: i32 = i16::MAX as i32;

/// Highest accepted [`PoolConfig::reuse_threshold`] (lookup counters saturate at 8 bits).
pub const REUSE_THRESHOLD_MAX: u32 = reuse::COUNT_MAX;

/// Key-table buckets per slot with LRU: load factor at most 1/4. The table's probe loops are the
/// hottest code; a lower load factor shortens them, and LRU's budget allows it.
const LRU_MAP_BUCKETS_PER_SLOT: (usize, usize) = (4, 1);
/// Key-table buckets per slot with ARC, whose table holds up to a ghost per slot besides the
/// present keys: 4.75, load factor at most 8/19. The probe loops' length (and how often their end
/// is mispredicted) makes the table's sparsity worth all of what is left of the 64-byte budget
/// (32 bytes of slot with its 128-bit key, 12 of ghost, 19 here). It was 6.5 with 64-bit keys.
const ARC_MAP_BUCKETS_PER_SLOT: (usize, usize) = (19, 4);
/// The same with a reuse threshold, whose tracker takes 4 bytes per slot: 3.75, load factor at
/// most 8/15 (5.5 with 64-bit keys).
const ARC_TRACKER_MAP_BUCKETS_PER_SLOT: (usize, usize) = (15, 4);

/// Calls with more keys than this dedupe new keys with a hash set; smaller ones with a filter of
/// [`DEDUPE_FILTER_BITS`] bits of the keys' hashes, and a linear scan only when a key's bit was
/// already set (for up to 256 keys, at most a sixteenth of them).
const DEDUPE_FILTER_MAX: usize = 256;
/// The touch memo's entry for a key that had a slot: bit 32 set, which no [`mix`] has.
const TOUCHED_PRESENT: u64 = u64::MAX;
/// Size of the dedupe filter.
const DEDUPE_FILTER_BITS: usize = 4096;
/// Shift that takes a hash's top bits as its filter bit (`DEDUPE_FILTER_BITS` is 2^12).
const DEDUPE_FILTER_SHIFT: u32 = 64 - DEDUPE_FILTER_BITS.trailing_zeros();
const _: () = assert!(DEDUPE_FILTER_BITS.is_power_of_two());

/// `Slot::list` of a free slot.
const LIST_FREE: u8 = 0;
/// `Slot::list` of a slot on the LRU list, or on ARC's T1.
const LIST_MAIN: u8 = 1;
/// `Slot::list` of a slot on ARC's T2.
const LIST_T2: u8 = 2;

/// One slot's metadata (32 bytes: the 20 bytes of the key, then 12 of state, no padding).
#[derive(Clone, Copy, Debug)]
struct Slot {
    /// The key's hash (meaningful only while the slot is present).
    hash: u128,
    /// The key's group.
    group: u32,
    /// -1: being written; 0: idle (evictable); n > 0: n loads read it.
    refc: i16,
    /// Which list the slot is on (`LIST_*`); `LIST_FREE` for a free slot.
    list: u8,
    /// Set while a `prepare_store` call names this (idle) slot's key, so it is not evicted.
    mark: u8,
    /// Recency-list links; for a free slot, `next` links the free stack.
    link: Link,
}

// The memory budget (design.md section 7) counts on these sizes.
const _: () = assert!(std::mem::size_of::<Slot>() == 32);

impl Slot {
    const FREE: Slot = Slot {
        hash: 0,
        group: 0,
        refc: 0,
        list: LIST_FREE,
        mark: 0,
        link: Link::UNLINKED,
    };

    /// Takes new key `key`, being written (list and links are the policy's to set).
    #[inline]
    fn set_writing(&mut self, key: ChunkKey) {
        self.hash = key.hash;
        self.group = key.group;
        self.refc = -1;
    }

    #[inline]
    fn evictable(&self) -> bool {
        self.refc == 0 && self.mark == 0
    }

    #[inline]
    fn present(&self) -> bool {
        self.list != LIST_FREE
    }

    #[inline]
    fn key(&self) -> ChunkKey {
        ChunkKey::new(self.hash, self.group)
    }

    #[inline]
    fn is(&self, key: ChunkKey) -> bool {
        self.hash == key.hash && self.group == key.group
    }
}

impl Linked for Slot {
    #[inline]
    fn link(&self) -> Link {
        self.link
    }
    #[inline]
    fn link_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

/// The eviction policy's state (enum dispatch: one branch per call, no virtual call).
#[derive(Clone, Debug)]
enum Policy {
    Lru(lru::Lru),
    Arc(arc::Arc),
}

/// Where the search for eviction victims stands within one `prepare_store` (list positions).
#[derive(Clone, Copy, Debug)]
struct VictimCursor {
    /// LRU: the next slot to examine. ARC: the next slot of T1.
    first: u32,
    /// ARC: the next slot of T2.
    second: u32,
}

impl Policy {
    fn victim_cursor(&self) -> VictimCursor {
        match self {
            Policy::Lru(l) => l.victim_cursor(),
            Policy::Arc(a) => a.victim_cursor(),
        }
    }

    /// Evicts up to `count` chunks, in the policy's order: each one off the policy's list and
    /// out of the key table (with ARC its table entry becomes its ghost's), its slot appended to
    /// `victims`, still holding its key. Stops early only when no evictable chunk is left.
    /// One dispatch per call, not per eviction.
    #[inline]
    fn evict_into(
        &mut self,
        slots: &mut [Slot],
        map: &mut IndexTable,
        count: usize,
        victims: &mut Vec<SlotId>,
    ) {
        let mut cursor = self.victim_cursor();
        match self {
            Policy::Lru(l) => {
                for _ in 0..count {
                    let Some(v) = l.next_victim(slots, &mut cursor) else {
                        return;
                    };
                    let h = mix(slots[v as usize].key());
                    l.remove(slots, v);
                    let slots = &*slots;
                    let found = map.remove(h, v, |i| mix(slots[i as usize].key()));
                    debug_assert!(found, "slot {v} missing from the key table");
                    victims.push(SlotId(v));
                }
            }
            Policy::Arc(a) => {
                for _ in 0..count {
                    let Some(v) = a.next_victim(slots, &mut cursor) else {
                        return;
                    };
                    let h = mix(slots[v as usize].key());
                    a.evict(slots, map, v, h);
                    victims.push(SlotId(v));
                }
            }
        }
    }
}

/// The hash of key-table index `i`: slot `i`'s key, or with ARC past the slots a ghost's (exact
/// in the high word, which is all the table needs to rebuild a home bucket).
#[inline]
fn hash_at(slots: &[Slot], policy: &Policy, i: u32) -> u64 {
    match policy {
        Policy::Lru(_) => mix(slots[i as usize].key()),
        Policy::Arc(a) => a.hash_at(slots, i),
    }
}

/// An entry of the scratch set that dedupes new keys within one large `prepare_store` call.
#[derive(Clone, Copy, Debug, Default)]
struct DedupeEntry {
    h: u64,
    generation: u32,
    index: u32,
}

/// The host-pool manager (design.md section 4, items 9-10).
///
/// Every present key occupies one slot whose reference count is -1 while being written (after
/// `prepare_store`, before `complete_store`), 0 while idle (the only evictable state) and n > 0
/// while n loads read it. See [`OffloadManager`] for the operations and [`EvictionPolicy`] for the
/// order of eviction.
///
/// Counters kept here: `lookups`, `lookup_hits`, `chunks_stored`, `evictions`,
/// `allocation_failures` and `invariant_failures`. Loads and failed store jobs are counted by the
/// caller, which knows how a job ended.
#[derive(Clone, Debug)]
pub struct HostPool {
    config: PoolConfig,
    strict: bool,
    slots: Vec<Slot>,
    map: IndexTable,
    /// Head of the free-slot stack (linked through `Slot::link.next`).
    free_head: u32,
    free_count: u32,
    /// Present slots with reference count 0.
    idle_count: u32,
    /// Slots a job in flight at a reset still writes or reads, with the number of such jobs
    /// (holds): neither present nor free until [`OffloadManager::release_held`] ends the last
    /// hold. Touched only by `reset` and `release_held`, never on the hot path.
    held: BTreeMap<u32, u32>,
    policy: Policy,
    tracker: Option<ReuseTracker>,
    stats: Stats,
    events: Vec<KvEvent>,
    /// `prepare_store` scratch: the mixed hash of each key to store.
    new_hashes: Vec<u64>,
    /// `prepare_store` scratch: slots marked as named by the call.
    marked: Vec<u32>,
    /// What the last `touch` found, one entry per key, last key first: the key's mixed hash
    /// where it had no slot, [`TOUCHED_PRESENT`] where it had one (empty: no memo). Only
    /// `prepare_store`'s install makes a key present, and every `prepare_store` empties the
    /// memo, so a key the memo calls absent is still absent while it lasts. `prepare_store` of a
    /// suffix of the touched keys (the engines' usual call: the blocks past the prefix hit)
    /// skips its probe of each key whose mix equals the memo's entry. At most the slot count of
    /// entries, like the other per-call scratch buffers here.
    touched: Vec<u64>,
    /// The slots the last successful `prepare_store` reserved, in order: `complete_store` tries
    /// `last_store[i]` for its `i`-th key before probing the table (a hint, checked against the
    /// slot's key and state, so a stale one only costs the check).
    last_store: Vec<u32>,
    dedupe: Vec<DedupeEntry>,
    dedupe_generation: u32,
    /// `prepare_store` scratch of calls with at most [`DEDUPE_FILTER_MAX`] keys: a bit per hash
    /// value of the new keys so far (the top 12 bits of the hash).
    dedupe_filter: [u64; DEDUPE_FILTER_BITS / 64],
}

impl HostPool {
    /// Creates an empty pool; fails with an error naming the setting if `config` is invalid.
    /// Broken bookkeeping invariants (for example completing a load that was never prepared)
    /// panic in debug builds and are counted and ignored in release builds.
    pub fn new(config: PoolConfig) -> Result<Self, CoreError> {
        Self::with_strictness(config, invariant::STRICT_DEFAULT)
    }

    /// Like [`HostPool::new`], choosing whether a broken bookkeeping invariant panics (`strict`:
    /// tests, simulators) or is counted in [`Stats::invariant_failures`] and ignored.
    pub fn with_strictness(config: PoolConfig, strict: bool) -> Result<Self, CoreError> {
        if config.slot_count == 0 || config.slot_count > SLOT_COUNT_MAX {
            return Err(CoreError::InvalidConfig {
                key: "slot_count",
                reason: format!(
                    "{} is out of range; expected 1 to {SLOT_COUNT_MAX}",
                    config.slot_count
                ),
            });
        }
        if config.policy == EvictionPolicy::Arc && config.slot_count > ARC_SLOT_COUNT_MAX {
            return Err(CoreError::InvalidConfig {
                key: "slot_count",
                reason: format!(
                    "{} is out of range for ARC; expected 1 to {ARC_SLOT_COUNT_MAX}",
                    config.slot_count
                ),
            });
        }
        if config.reuse_threshold > REUSE_THRESHOLD_MAX {
            return Err(CoreError::InvalidConfig {
                key: "reuse_threshold",
                reason: format!(
                    "{} is above the maximum {REUSE_THRESHOLD_MAX}",
                    config.reuse_threshold
                ),
            });
        }
        let c = config.slot_count;
        // ARC's ghosts share the key table, indexed after the slots.
        let (policy, buckets_per_slot, indices) = match config.policy {
            EvictionPolicy::Lru => (
                Policy::Lru(lru::Lru::default()),
                LRU_MAP_BUCKETS_PER_SLOT,
                c,
            ),
            EvictionPolicy::Arc if config.reuse_threshold > 1 => (
                Policy::Arc(arc::Arc::new(c)),
                ARC_TRACKER_MAP_BUCKETS_PER_SLOT,
                2 * c,
            ),
            EvictionPolicy::Arc => (
                Policy::Arc(arc::Arc::new(c)),
                ARC_MAP_BUCKETS_PER_SLOT,
                2 * c,
            ),
        };
        let tracker = (config.reuse_threshold > 1).then(|| ReuseTracker::new(c));
        let mut pool = Self {
            config,
            strict,
            slots: vec![Slot::FREE; c as usize],
            map: IndexTable::new(
                indices,
                (c as usize * buckets_per_slot.0).div_ceil(buckets_per_slot.1) + 1,
            ),
            free_head: NIL,
            free_count: 0,
            idle_count: 0,
            held: BTreeMap::new(),
            policy,
            tracker,
            stats: Stats::default(),
            events: Vec::new(),
            new_hashes: Vec::new(),
            marked: Vec::new(),
            touched: Vec::new(),
            last_store: Vec::new(),
            dedupe: Vec::new(),
            dedupe_generation: 0,
            dedupe_filter: [0; DEDUPE_FILTER_BITS / 64],
        };
        pool.rebuild_free_stack();
        Ok(pool)
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The configuration the pool was created with.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.config.slot_count
    }

    /// Number of present keys (ready or being written).
    pub fn len(&self) -> usize {
        (self.config.slot_count - self.free_count) as usize - self.held.len()
    }

    /// Number of slots held since a reset for jobs that were in flight then (neither present nor
    /// free; see [`OffloadManager::release_held`]).
    pub fn held_slot_count(&self) -> usize {
        self.held.len()
    }

    /// Whether `slot` is held since a reset for a job that was in flight then.
    pub fn is_held(&self, slot: SlotId) -> bool {
        self.held.contains_key(&slot.0)
    }

    /// Whether no key is present.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of slots holding no key.
    pub fn free_slot_count(&self) -> u32 {
        self.free_count
    }

    /// Number of present keys with reference count 0 (ready and not being read): the chunks that
    /// could be evicted.
    pub fn idle_count(&self) -> u32 {
        self.idle_count
    }

    /// The reference count of `key`'s slot (-1: being written, 0: idle, n: n readers), or `None`
    /// if absent. Changes nothing (no statistics, no recency).
    pub fn ref_count(&self, key: ChunkKey) -> Option<i32> {
        self.find(key, mix(key))
            .map(|s| i32::from(self.slots[s as usize].refc))
    }

    /// The slot holding `key`, or `None` if absent. Changes nothing.
    pub fn slot_of(&self, key: ChunkKey) -> Option<SlotId> {
        self.find(key, mix(key)).map(SlotId)
    }

    /// The key held in `slot`, or `None` if the slot is free or out of range. Changes nothing.
    pub fn key_in(&self, slot: SlotId) -> Option<ChunkKey> {
        self.slots
            .get(slot.0 as usize)
            .filter(|s| s.present())
            .map(Slot::key)
    }

    /// How many lookups of `key` the reuse tracker remembers; 0 when the pool has no reuse
    /// threshold (or the key was forgotten: the tracker holds about `slot_count` keys, a
    /// least-recently-looked-up one per bucket of 16 making room for a new one).
    pub fn lookup_count(&self, key: ChunkKey) -> u32 {
        self.tracker.as_ref().map_or(0, |t| t.count_key(key))
    }

    /// ARC's adaptive target size of its recency list T1; `None` for LRU.
    pub fn arc_target(&self) -> Option<u32> {
        match &self.policy {
            Policy::Lru(_) => None,
            Policy::Arc(a) => Some(a.target()),
        }
    }

    /// Present keys from the first to be evicted to the last, by the policy's order alone
    /// (ignoring reference counts). For LRU: least recent first. For ARC: T1 then T2, each least
    /// recent first (the order among lists depends on the adaptive target). Allocates; for tests.
    pub fn keys_by_recency(&self) -> Vec<ChunkKey> {
        let mut order = match &self.policy {
            Policy::Lru(l) => l.order(&self.slots).unwrap_or_default(),
            Policy::Arc(a) => a
                .order(&self.slots, &self.map)
                .map(|(t1, t2)| t2.into_iter().chain(t1).collect())
                .unwrap_or_default(),
        };
        order.reverse();
        order
            .into_iter()
            .map(|s| self.slots[s as usize].key())
            .collect()
    }

    /// Bytes of metadata per slot, everything included: slot array, key table (at its real
    /// capacity), ARC ghosts and their table, the reuse tracker and the scratch buffers, divided
    /// by the slot count and rounded up. The event queue is output waiting to be taken, not
    /// metadata, and is left out.
    pub fn metadata_bytes_per_slot(&self) -> usize {
        let mut bytes = std::mem::size_of::<Self>()
            + self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.map.bytes()
            + self.new_hashes.capacity() * std::mem::size_of::<u64>()
            + self.marked.capacity() * std::mem::size_of::<u32>()
            + self.touched.capacity() * std::mem::size_of::<u64>()
            + self.last_store.capacity() * std::mem::size_of::<u32>()
            + self.dedupe.capacity() * std::mem::size_of::<DedupeEntry>();
        if let Policy::Arc(a) = &self.policy {
            bytes += a.bytes();
        }
        if let Some(t) = &self.tracker {
            bytes += t.bytes();
        }
        bytes.div_ceil(self.config.slot_count as usize)
    }

    /// Checks every invariant of the pool in O(slot count): free count plus present count equals
    /// the slot count, every present key is found in its slot and on exactly one policy list,
    /// reference counts are in range, the idle count is right, the ARC ghost bookkeeping holds.
    /// For tests and the simulator.
    pub fn check_invariants(&self) -> Result<(), String> {
        let c = self.config.slot_count as usize;
        let mut free = 0usize;
        let mut i = self.free_head;
        while i != NIL {
            let s = &self.slots[i as usize];
            if s.present() {
                return Err(format!("slot {i} is on the free stack but present"));
            }
            free += 1;
            if free > c {
                return Err("free stack has a cycle".into());
            }
            i = s.link.next;
        }
        if free != self.free_count as usize {
            return Err(format!(
                "free stack holds {free}, free_count says {}",
                self.free_count
            ));
        }
        let mut present = 0usize;
        let mut idle = 0u32;
        for (i, s) in self.slots.iter().enumerate() {
            if !s.present() {
                continue;
            }
            present += 1;
            if s.mark != 0 {
                return Err(format!("slot {i} is still marked"));
            }
            if s.refc < -1 {
                return Err(format!("slot {i} has reference count {}", s.refc));
            }
            if s.refc == 0 {
                idle += 1;
            }
            if self.find(s.key(), mix(s.key())) != Some(i as u32) {
                return Err(format!("slot {i}'s key is not found in the key table"));
            }
        }
        for &h in self.held.keys() {
            if self.slots.get(h as usize).is_none_or(Slot::present) {
                return Err(format!("held slot {h} is present or out of range"));
            }
        }
        let held = self.held.len();
        if present + free + held != c {
            return Err(format!(
                "{present} present + {free} free + {held} held != {c} slots"
            ));
        }
        if idle != self.idle_count {
            return Err(format!(
                "{idle} idle slots, idle_count says {}",
                self.idle_count
            ));
        }
        let ghosts = self.ghost_count();
        if self.map.len() as usize != present + ghosts {
            return Err(format!(
                "key table holds {}, {present} present and {ghosts} ghosts",
                self.map.len()
            ));
        }
        // Ghosts keep only the high word of their hash, so only slot entries' tags are checked.
        let slot_count = self.config.slot_count;
        self.map.check(|i| self.hash_at(i), |i| i < slot_count)?;
        let on_lists = match &self.policy {
            Policy::Lru(l) => l.order(&self.slots)?.len(),
            Policy::Arc(a) => {
                let (t1, t2) = a.order(&self.slots, &self.map)?;
                for s in t1.iter().chain(&t2) {
                    let h = mix(self.slots[*s as usize].key());
                    if a.ghost_list_of(&self.map, h).is_some() {
                        return Err(format!("present slot {s} also has a ghost"));
                    }
                }
                t1.len() + t2.len()
            }
        };
        if on_lists != present {
            return Err(format!(
                "{on_lists} slots on policy lists, {present} present"
            ));
        }
        Ok(())
    }

    /// Sizes of ARC's lists T1, T2, B1, B2 (`None` for LRU). For tests.
    pub fn arc_list_lens(&self) -> Option<[u32; 4]> {
        match &self.policy {
            Policy::Lru(_) => None,
            Policy::Arc(a) => Some(a.list_lens()),
        }
    }

    /// Cheap consistency checks of the counters, after every mutating call (debug builds).
    #[inline]
    fn debug_check_counts(&self) {
        debug_assert!(self.free_count <= self.config.slot_count);
        let ghosts = self.ghost_count();
        debug_assert_eq!(
            self.map.len() as usize,
            self.len() + ghosts,
            "key table != present keys + ghosts"
        );
        debug_assert!(
            self.idle_count as usize <= self.len(),
            "more idle than present"
        );
        debug_assert!(self.marked.is_empty() && self.new_hashes.is_empty());
    }

    #[inline]
    fn find(&self, key: ChunkKey, h: u64) -> Option<u32> {
        let slots = &self.slots;
        // With ARC, indices past the slots are ghosts: never a present key.
        self.map.find(h, |s| {
            slots.get(s as usize).is_some_and(|slot| slot.is(key))
        })
    }

    /// Ghosts in the key table (ARC's; none with LRU).
    fn ghost_count(&self) -> usize {
        match &self.policy {
            Policy::Lru(_) => 0,
            Policy::Arc(a) => a.ghost_count() as usize,
        }
    }

    /// The hash of key-table index `i` (a slot, or with ARC a ghost: then exact in the high word,
    /// which is all the table needs).
    #[inline]
    fn hash_at(&self, i: u32) -> u64 {
        hash_at(&self.slots, &self.policy, i)
    }

    /// Every slot not held becomes free (the stack pops them in index order); held slots are
    /// left out of it.
    fn rebuild_free_stack(&mut self) {
        let mut head = NIL;
        let mut count = 0;
        for i in (0..self.slots.len() as u32).rev() {
            self.slots[i as usize] = Slot {
                link: Link {
                    prev: NIL,
                    next: head,
                },
                ..Slot::FREE
            };
            if self.held.contains_key(&i) {
                self.slots[i as usize].link = Link::UNLINKED;
                continue;
            }
            head = i;
            count += 1;
        }
        self.free_head = head;
        self.free_count = count;
        self.idle_count = 0;
    }

    #[inline]
    fn pop_free(&mut self) -> u32 {
        let s = self.free_head;
        debug_assert_ne!(s, NIL, "free stack empty");
        self.free_head = self.slots[s as usize].link.next;
        self.slots[s as usize].link = Link::UNLINKED;
        self.free_count -= 1;
        s
    }

    #[inline]
    fn push_free(&mut self, s: u32) {
        debug_assert!(!self.slots[s as usize].present());
        self.slots[s as usize] = Slot {
            link: Link {
                prev: NIL,
                next: self.free_head,
            },
            ..Slot::FREE
        };
        self.free_head = s;
        self.free_count += 1;
        debug_assert!(self.free_count <= self.config.slot_count);
    }

    /// Removes present slot `s` (whose key has hash `h`) from the key table.
    #[inline]
    fn unmap(&mut self, s: u32, h: u64) {
        let (slots, policy) = (&self.slots, &self.policy);
        let found = self.map.remove(h, s, |i| hash_at(slots, policy, i));
        debug_assert!(found, "slot {s} missing from the key table");
    }

    fn broken(&mut self, what: std::fmt::Arguments<'_>) {
        self.stats.invariant_failures += 1;
        invariant::broken(self.strict, what);
    }

    /// Whether `key` (hash `h`) already is among the call's new keys `new_keys` (whose hashes are
    /// in `self.new_hashes`). Large calls use the scratch hash set, others the filter and, when
    /// the key's bit is already set, a linear scan.
    #[inline]
    fn is_duplicate(&mut self, new_keys: &[ChunkKey], key: ChunkKey, h: u64, large: bool) -> bool {
        if !large {
            let bit = (h >> DEDUPE_FILTER_SHIFT) as usize;
            let (word, mask) = (bit / 64, 1u64 << (bit % 64));
            if self.dedupe_filter[word] & mask == 0 {
                self.dedupe_filter[word] |= mask;
                return false;
            }
            return self
                .new_hashes
                .iter()
                .zip(new_keys)
                .any(|(&hj, &kj)| hj == h && kj == key);
        }
        let mask = self.dedupe.len() - 1;
        let mut p = (h >> 40) as usize & mask;
        loop {
            let e = self.dedupe[p];
            if e.generation != self.dedupe_generation {
                self.dedupe[p] = DedupeEntry {
                    h,
                    generation: self.dedupe_generation,
                    index: new_keys.len() as u32,
                };
                return false;
            }
            if e.h == h && new_keys[e.index as usize] == key {
                return true;
            }
            p = (p + 1) & mask;
        }
    }

    /// Prepares the dedupe set for a call with `n` keys; returns whether the call uses it.
    fn start_dedupe(&mut self, n: usize) -> bool {
        if n <= DEDUPE_FILTER_MAX {
            self.dedupe_filter = [0; DEDUPE_FILTER_BITS / 64];
            return false;
        }
        let want = (2 * n).next_power_of_two();
        if self.dedupe.len() < want {
            self.dedupe.clear();
            self.dedupe.resize(want, DedupeEntry::default());
            self.dedupe_generation = 0;
        }
        self.dedupe_generation = self.dedupe_generation.wrapping_add(1);
        if self.dedupe_generation == 0 {
            self.dedupe.fill(DedupeEntry::default());
            self.dedupe_generation = 1;
        }
        true
    }

    fn unmark_all(&mut self) {
        for &s in &self.marked {
            self.slots[s as usize].mark = 0;
        }
        self.marked.clear();
    }

    /// Gives the new keys `keys` (hashes `hashes`) the slots `slots`, in order: each one being
    /// written, on the policy's list and in the key table (taking over the table entry of the
    /// key's ghost, if any). Every slot is free and off the free stack (popped from it, or an
    /// evicted slot handed over directly).
    #[inline]
    fn install(&mut self, keys: &[ChunkKey], hashes: &[u64], slots: &[SlotId]) {
        debug_assert!(keys.len() == slots.len() && hashes.len() >= keys.len());
        // One policy dispatch per call, not per key.
        match &mut self.policy {
            Policy::Lru(l) => {
                for ((&key, &h), &SlotId(s)) in keys.iter().zip(hashes).zip(slots) {
                    self.slots[s as usize].set_writing(key);
                    l.insert(&mut self.slots, s);
                    let slots = &self.slots;
                    self.map.insert(h, s, |i| mix(slots[i as usize].key()));
                }
            }
            Policy::Arc(a) => {
                for ((&key, &h), &SlotId(s)) in keys.iter().zip(hashes).zip(slots) {
                    self.slots[s as usize].set_writing(key);
                    // A ghost of the key gives its table entry to the slot.
                    a.insert(&mut self.slots, &mut self.map, s, h);
                }
            }
        }
    }

    /// Finishes the eviction of `victims`, already off the policy and out of the key table:
    /// counted, and a Removed event each. The slots are not put on the free stack: the caller
    /// hands them to new keys.
    #[inline]
    fn evicted(&mut self, victims: &[SlotId]) {
        debug_assert!(victims.iter().all(|&SlotId(s)| {
            let slot = &self.slots[s as usize];
            !slot.present() && slot.evictable()
        }));
        self.idle_count -= victims.len() as u32;
        self.stats.evictions += victims.len() as u64;
        if self.config.events {
            for &SlotId(s) in victims {
                self.events.push(KvEvent::Removed {
                    key: self.slots[s as usize].key(),
                    medium: Medium::Cpu,
                });
            }
        }
    }
}

impl OffloadManager for HostPool {
    fn lookup(&mut self, key: ChunkKey, _request: RequestId) -> LookupResult {
        let h = mix(key);
        self.stats.lookups += 1;
        if let Some(t) = &mut self.tracker {
            t.record(h);
        }
        match self.find(key, h) {
            None => LookupResult::Miss,
            Some(s) => {
                self.stats.lookup_hits += 1;
                if self.slots[s as usize].refc < 0 {
                    LookupResult::Pending
                } else {
                    LookupResult::Hit
                }
            }
        }
    }

    fn prepare_load(
        &mut self,
        keys: &[ChunkKey],
        _request: RequestId,
        slots: &mut Vec<SlotId>,
    ) -> Result<(), CoreError> {
        let start = slots.len();
        for &key in keys {
            match self.find(key, mix(key)) {
                Some(s) if self.slots[s as usize].refc >= 0 => slots.push(SlotId(s)),
                _ => {
                    slots.truncate(start);
                    return Err(CoreError::BadKeyState {
                        hash: key.hash,
                        group: key.group,
                        expected: "stored and ready",
                    });
                }
            }
        }
        // Pin each slot once per time the call names it; a slot already at the reader limit
        // fails the whole call, and the pins taken so far are given back (all or nothing).
        for i in start..slots.len() {
            let s = slots[i].0 as usize;
            if i32::from(self.slots[s].refc) >= READERS_PER_SLOT_MAX {
                for &SlotId(undo) in &slots[start..i] {
                    let slot = &mut self.slots[undo as usize];
                    slot.refc -= 1;
                    if slot.refc == 0 {
                        self.idle_count += 1;
                    }
                }
                let key = keys[i - start];
                slots.truncate(start);
                return Err(CoreError::BadKeyState {
                    hash: key.hash,
                    group: key.group,
                    expected: "below the limit of concurrent readers",
                });
            }
            let slot = &mut self.slots[s];
            debug_assert!(slot.present() && slot.refc >= 0);
            if slot.refc == 0 {
                self.idle_count -= 1;
            }
            slot.refc += 1;
        }
        self.debug_check_counts();
        Ok(())
    }

    fn complete_load(&mut self, keys: &[ChunkKey]) {
        for &key in keys {
            let Some(s) = self.find(key, mix(key)) else {
                self.broken(format_args!(
                    "complete_load of absent chunk {:#x}/{}",
                    key.hash, key.group
                ));
                continue;
            };
            let slot = &mut self.slots[s as usize];
            if slot.refc <= 0 {
                let refc = slot.refc;
                self.broken(format_args!(
                    "complete_load of chunk {:#x}/{} with reference count {refc}",
                    key.hash, key.group
                ));
                continue;
            }
            slot.refc -= 1;
            if slot.refc == 0 {
                self.idle_count += 1;
            }
        }
    }

    fn touch(&mut self, keys: &[ChunkKey], _request: RequestId) {
        // The memo of what this call finds, last key first, bounded by the slot count (a longer
        // call is left without one: `prepare_store` then probes every key).
        let mut memo = std::mem::take(&mut self.touched);
        memo.clear();
        let on = keys.len() <= self.slots.len();
        match &mut self.policy {
            Policy::Lru(l) => {
                for &key in keys.iter().rev() {
                    let h = mix(key);
                    let slots = &self.slots;
                    let found = self.map.find(h, |s| slots[s as usize].is(key));
                    let entry = match found {
                        Some(s) => {
                            l.touch(&mut self.slots, s);
                            TOUCHED_PRESENT
                        }
                        None => h,
                    };
                    if on {
                        memo.push(entry);
                    }
                }
            }
            Policy::Arc(a) => {
                let ghosts = a.ghost_table();
                for &key in keys.iter().rev() {
                    // One probe finds the key's slot, or else its ghost.
                    let h = mix(key);
                    let slots = &self.slots;
                    let found = self.map.find_either(
                        h,
                        |i| slots.get(i as usize).is_some_and(|slot| slot.is(key)),
                        |i| a.is_ghost_of(i, h),
                    );
                    let entry = match found {
                        None => h,
                        Some(i) if ghosts.is_ghost(i) => {
                            a.ghost_hit(i);
                            h
                        }
                        Some(s) => {
                            a.touch(&mut self.slots, s);
                            TOUCHED_PRESENT
                        }
                    };
                    if on {
                        memo.push(entry);
                    }
                }
            }
        }
        self.touched = memo;
    }

    fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        _request: RequestId,
        out: &mut PreparedStore,
    ) -> Result<(), CoreError> {
        out.clear();
        debug_assert!(self.new_hashes.is_empty() && self.marked.is_empty());
        self.new_hashes.clear();
        let large = self.start_dedupe(keys.len());
        let threshold = self.config.reuse_threshold;

        // Phase 1: gather the keys to store into `out.keys`; mark present idle keys so they are
        // not evicted.
        let mut marked_idle = 0u32;
        // The last touch's memo, where these keys are a suffix of its keys (checked key by key:
        // a key whose mix differs from its entry is probed).
        let mut memo = std::mem::take(&mut self.touched);
        if keys.len() > memo.len() {
            memo.clear();
        }
        // The memo runs last key first: key `j` of a suffix is entry `keys.len() - 1 - j`.
        let mut absent = memo[..keys.len().min(memo.len())].iter().rev();
        for &key in keys {
            let h = mix(key);
            let known_absent = absent.next() == Some(&h);
            if let Some(s) = (!known_absent).then(|| self.find(key, h)).flatten() {
                let slot = &mut self.slots[s as usize];
                if slot.refc == 0 && slot.mark == 0 {
                    slot.mark = 1;
                    self.marked.push(s);
                    marked_idle += 1;
                }
                continue;
            }
            if let Some(t) = &self.tracker {
                if t.count(h) < threshold {
                    continue;
                }
            }
            if self.is_duplicate(&out.keys, key, h, large) {
                continue;
            }
            out.keys.push(key);
            self.new_hashes.push(h);
        }
        // Give the memo's buffer back (its capacity), spent.
        self.touched = memo;
        self.touched.clear();

        // Phase 2: is there room? Decided from counters, before changing anything.
        let needed = out.keys.len();
        let to_evict = needed.saturating_sub(self.free_count as usize);
        let evictable = (self.idle_count - marked_idle) as usize;
        if to_evict > evictable {
            self.unmark_all();
            self.new_hashes.clear();
            out.clear();
            self.stats.allocation_failures += 1;
            return Err(CoreError::NoSpace {
                needed,
                evictable: self.free_count as usize + evictable,
            });
        }

        // Phase 3: evict (each eviction's Removed event precedes any later Stored event), then
        // give each new key a slot, in the order given. The victims go straight to the first
        // new keys, last victim first, then the free stack's slots: the order a free stack with
        // the victims pushed on top would hand them out, without the round trip through it.
        self.last_store.clear();
        self.policy
            .evict_into(&mut self.slots, &mut self.map, to_evict, &mut out.slots);
        let evicted = out.slots.len();
        if evicted < to_evict {
            // The idle count promised more evictable chunks than the lists hold.
            self.broken(format_args!(
                "{evictable} slots counted evictable, fewer found"
            ));
        }
        self.evicted(&out.slots);
        out.slots.reverse();
        // Only after a broken invariant above are there fewer slots than new keys: then store
        // what fits.
        let storable = needed.min(out.slots.len() + self.free_count as usize);
        out.keys.truncate(storable);
        while out.slots.len() < storable {
            let s = self.pop_free();
            out.slots.push(SlotId(s));
        }
        let new_hashes = std::mem::take(&mut self.new_hashes);
        self.install(&out.keys, &new_hashes, &out.slots);
        self.new_hashes = new_hashes;
        self.last_store.extend(out.slots.iter().map(|s| s.0));
        self.new_hashes.clear();
        self.unmark_all();
        debug_assert_eq!(out.keys.len(), out.slots.len());
        self.debug_check_counts();
        Ok(())
    }

    fn complete_store(&mut self, keys: &[ChunkKey], success: bool) {
        // Chunks made ready, counted once at the end.
        let mut stored = 0u32;
        // The usual call, a successful store of the keys of the last prepare_store in order,
        // needs only the slots: this loop touches nothing else (so the compiler keeps the rest
        // in registers), and the general loop below takes over from the first key it cannot
        // finish.
        let mut done = 0;
        if success {
            let slots = &mut self.slots[..];
            for (&key, &hint) in keys.iter().zip(&self.last_store) {
                match slots.get_mut(hint as usize) {
                    // `refc == -1` implies present: only `set_writing` sets it.
                    Some(slot) if slot.is(key) && slot.refc == -1 => {
                        debug_assert!(slot.present());
                        slot.refc = 0;
                    }
                    _ => break,
                }
                done += 1;
            }
            stored = done as u32;
            if self.config.events {
                self.events
                    .extend(keys[..done].iter().map(|&key| KvEvent::Stored {
                        key,
                        medium: Medium::Cpu,
                    }));
            }
        }
        for (i, &key) in keys.iter().enumerate().skip(done) {
            // Usually the keys of the last prepare_store, in order: their slots need no probe.
            // A slot that holds `key` is `key`'s slot (keys are unique), so the check is exact.
            let hint = self.last_store.get(i).map_or(NIL, |&s| s);
            let s = match self.slots.get(hint as usize) {
                Some(slot) if slot.is(key) && slot.present() => hint,
                _ => match self.find(key, mix(key)) {
                    Some(s) => s,
                    None => continue,
                },
            };
            if self.slots[s as usize].refc != -1 {
                continue;
            }
            if success {
                self.slots[s as usize].refc = 0;
                stored += 1;
                if self.config.events {
                    self.events.push(KvEvent::Stored {
                        key,
                        medium: Medium::Cpu,
                    });
                }
            } else {
                match &mut self.policy {
                    Policy::Lru(l) => l.remove(&mut self.slots, s),
                    Policy::Arc(a) => a.remove(&mut self.slots, s),
                }
                self.unmap(s, mix(key));
                self.push_free(s);
            }
        }
        self.idle_count += stored;
        self.stats.chunks_stored += u64::from(stored);
    }

    fn on_request_finished(&mut self, _request: RequestId) {}

    fn reset(&mut self) {
        // Chunks still being written or read are dropped too, but their slots are held, one hold
        // per job (the writer, each reader), until `release_held` says the job is over: a job in
        // flight keeps its memory (a GPU stream or a tier thread may still write it), so no
        // new key gets such a slot before then.
        for (i, s) in self.slots.iter().enumerate() {
            if !s.present() {
                continue;
            }
            if s.refc != 0 {
                let holds = if s.refc < 0 { 1 } else { s.refc as u32 };
                *self.held.entry(i as u32).or_insert(0) += holds;
            }
            if s.refc >= 0 && self.config.events {
                self.events.push(KvEvent::Removed {
                    key: s.key(),
                    medium: Medium::Cpu,
                });
            }
        }
        self.map.clear();
        match &mut self.policy {
            Policy::Lru(l) => l.clear(),
            Policy::Arc(a) => a.clear(),
        }
        if let Some(t) = &mut self.tracker {
            t.clear();
        }
        self.last_store.clear();
        self.rebuild_free_stack();
    }

    fn release_held(&mut self, slots: &[SlotId]) {
        for &slot in slots {
            let Some(holds) = self.held.get_mut(&slot.0) else {
                self.broken(format_args!(
                    "release_held of slot {}, which is not held",
                    slot.0
                ));
                continue;
            };
            *holds -= 1;
            if *holds == 0 {
                self.held.remove(&slot.0);
                self.push_free(slot.0);
            }
        }
    }

    fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events);
    }
}
