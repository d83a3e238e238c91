//! The published-chunk store: the bytes this instance serves to its peers, each with the xxh3
//! checksum computed when it was published (and, for keyed tags, its POLYVAL digest), bounded
//! by a byte capacity with least-recently-used eviction.
//!
//! Why a copy and not the host pool's slots: the host pool reuses a slot as soon as its chunk is
//! evicted, and it does not tell secondary tiers. Serving a slot in place could send a peer the
//! bytes of another chunk under the old key. So a cascade `Store` job "publishes": it copies the
//! slot into this store, which owns its memory; a chunk being sent is held by an `Arc` and stays
//! intact even if it is evicted meanwhile.
//!
//! A chunk is "announced" once a local store job that published it was handed out as a success
//! (the tiering manager then emitted a `Stored` event with this tier's medium); a chunk that a
//! peer pushed here is not, until such a job names it. When an announced chunk leaves the store
//! (evicted, or removed as corrupt), its key waits in a bounded list for `Tier::take_evicted`, so
//! that every `Stored` event of this tier is followed by a `Removed` one when the chunk goes.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, OnceLock};

use offload_core::ChunkKey;

use crate::auth::{digest, DIGEST_BYTES};
use crate::polyval::PolyvalKey;

/// One published chunk.
#[derive(Debug)]
pub(crate) struct PublishedChunk {
    /// Its NIXL registration, made when it is first offered (`None` inside: registration
    /// failed). Declared before `bytes`, so it is dropped (deregistered) before they are freed.
    #[cfg(feature = "nixl")]
    pub(crate) registration: std::sync::OnceLock<Option<nixl_sys::RegistrationHandle>>,
    /// The chunk's bytes.
    pub(crate) bytes: Box<[u8]>,
    /// xxh3-64 of `bytes`, computed when it was published.
    pub(crate) checksum: u64,
    /// The digest of `bytes` that keyed tags bind ([`crate::auth::ChunkAuth`]) and the hash
    /// key it is under: computed when it was published by an instance with a secret, else on
    /// first need. (Every connection of one tier has the same hash key.)
    digest: OnceLock<(PolyvalKey, [u8; DIGEST_BYTES])>,
}

impl PublishedChunk {
    /// A chunk of `bytes` with their checksum.
    pub(crate) fn new(bytes: Box<[u8]>, checksum: u64) -> Self {
        Self {
            #[cfg(feature = "nixl")]
            registration: std::sync::OnceLock::new(),
            bytes,
            checksum,
            digest: OnceLock::new(),
        }
    }

    /// The digest of its bytes under `key`, kept from the first call (computed again, not kept,
    /// under another key, which no connection of one tier has).
    pub(crate) fn digest(&self, key: &PolyvalKey) -> [u8; DIGEST_BYTES] {
        let (kept_key, kept) = self
            .digest
            .get_or_init(|| (key.clone(), digest(key, &self.bytes)));
        match kept_key.same_as(key) {
            true => *kept,
            false => digest(key, &self.bytes),
        }
    }
}

/// The xxh3-64 checksum the protocol uses.
pub fn checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

#[derive(Debug)]
struct Entry {
    chunk: Arc<PublishedChunk>,
    tick: u64,
    /// Whether a `Stored` event was emitted for it (see the module doc).
    announced: bool,
}

/// The most removed keys kept for [`PublishedStore::take_removed`] (the oldest go first beyond
/// it, counted).
pub(crate) const REMOVED_KEPT_MAX: usize = 1 << 16;

/// Published chunks by key, with their recency order.
#[derive(Debug)]
pub(crate) struct PublishedStore {
    entries: HashMap<ChunkKey, Entry>,
    /// Recency tick to key; the smallest tick is evicted first.
    order: BTreeMap<u64, ChunkKey>,
    tick: u64,
    bytes: usize,
    bytes_max: usize,
    /// Announced keys that left the store, not yet taken; at most [`REMOVED_KEPT_MAX`].
    removed: VecDeque<ChunkKey>,
    /// Removed keys dropped from `removed` because it was full, not yet taken.
    removed_overflow: u64,
}

/// Why a chunk could not be published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TooLarge;

impl PublishedStore {
    /// An empty store holding at most `bytes_max` bytes of chunks.
    pub(crate) fn new(bytes_max: usize) -> Self {
        Self {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            bytes: 0,
            bytes_max,
            removed: VecDeque::new(),
            removed_overflow: 0,
        }
    }

    /// Marks `keys` (the successes of a store job just handed out) as announced. A key no longer
    /// here (evicted or removed since it was published) is reported removed at once, after the
    /// `Stored` event its job's completion produces.
    pub(crate) fn announce(&mut self, keys: &[ChunkKey]) {
        for &key in keys {
            match self.entries.get_mut(&key) {
                Some(entry) => entry.announced = true,
                None => self.note_removed(key),
            }
        }
    }

    /// Moves the announced keys that left the store since the last call into `out`, oldest
    /// first; returns how many were dropped unreported because more than [`REMOVED_KEPT_MAX`]
    /// waited.
    pub(crate) fn take_removed(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        out.extend(self.removed.drain(..));
        std::mem::take(&mut self.removed_overflow)
    }

    fn note_removed(&mut self, key: ChunkKey) {
        if self.removed.len() == REMOVED_KEPT_MAX {
            self.removed.pop_front();
            self.removed_overflow += 1;
        }
        self.removed.push_back(key);
        debug_assert!(self.removed.len() <= REMOVED_KEPT_MAX);
    }

    /// Takes `key`'s entry out of the table (not out of `order`), noting its removal if it was
    /// announced.
    fn take_entry(&mut self, key: ChunkKey) -> Option<Entry> {
        let entry = self.entries.remove(&key)?;
        self.bytes -= entry.chunk.bytes.len();
        if entry.announced {
            self.note_removed(key);
        }
        Some(entry)
    }

    /// Whether `key` is published.
    pub(crate) fn contains(&self, key: ChunkKey) -> bool {
        self.entries.contains_key(&key)
    }

    /// The chunk under `key`, marked as recently used.
    pub(crate) fn get(&mut self, key: ChunkKey) -> Option<Arc<PublishedChunk>> {
        self.bump(key);
        self.entries.get(&key).map(|e| Arc::clone(&e.chunk))
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Chunks held.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Publishes `chunk` under `key`, evicting least recently used chunks to make room; returns
    /// how many were evicted. A key already present is only marked as used (equal keys mean equal
    /// bytes).
    pub(crate) fn insert(
        &mut self,
        key: ChunkKey,
        chunk: PublishedChunk,
    ) -> Result<usize, TooLarge> {
        if self.contains(key) {
            self.bump(key);
            return Ok(0);
        }
        let len = chunk.bytes.len();
        if len > self.bytes_max {
            return Err(TooLarge);
        }
        let mut evicted = 0;
        while self.bytes + len > self.bytes_max {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if self.take_entry(oldest).is_some() {
                evicted += 1;
            }
        }
        self.tick += 1;
        self.order.insert(self.tick, key);
        self.entries.insert(
            key,
            Entry {
                chunk: Arc::new(chunk),
                tick: self.tick,
                announced: false,
            },
        );
        self.bytes += len;
        debug_assert!(self.bytes <= self.bytes_max);
        debug_assert_eq!(self.order.len(), self.entries.len());
        Ok(evicted)
    }

    /// Removes `key` (a copy that failed its checksum). Returns whether it was there.
    pub(crate) fn remove(&mut self, key: ChunkKey) -> bool {
        let Some(entry) = self.take_entry(key) else {
            return false;
        };
        self.order.remove(&entry.tick);
        true
    }

    /// Marks `keys` as used, in reverse order, so that the first key is evicted last.
    pub(crate) fn touch(&mut self, keys: &[ChunkKey]) {
        for &key in keys.iter().rev() {
            self.bump(key);
        }
    }

    fn bump(&mut self, key: ChunkKey) {
        let Some(entry) = self.entries.get_mut(&key) else {
            return;
        };
        self.order.remove(&entry.tick);
        self.tick += 1;
        entry.tick = self.tick;
        self.order.insert(self.tick, key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(len: usize, fill: u8) -> PublishedChunk {
        let bytes = vec![fill; len].into_boxed_slice();
        let checksum = checksum(&bytes);
        PublishedChunk::new(bytes, checksum)
    }

    fn key(i: u64) -> ChunkKey {
        ChunkKey::new(u128::from(i), 0)
    }

    #[test]
    fn evicts_least_recently_used_within_capacity() {
        let mut store = PublishedStore::new(300);
        for i in 0..3 {
            assert_eq!(store.insert(key(i), chunk(100, i as u8)), Ok(0));
        }
        store.touch(&[key(0), key(1)]);
        // Recency now: 2 (oldest), 1, 0 (newest).
        assert_eq!(store.insert(key(3), chunk(150, 3)), Ok(2));
        assert!(store.contains(key(0)));
        assert!(!store.contains(key(1)));
        assert!(!store.contains(key(2)));
        assert_eq!(store.bytes(), 250);
        assert_eq!(store.len(), 2);
        assert_eq!(store.insert(key(9), chunk(301, 9)), Err(TooLarge));
    }

    #[test]
    fn announced_keys_that_leave_are_reported_once_and_pushed_ones_are_not() {
        let mut store = PublishedStore::new(300);
        for i in 0..3 {
            store.insert(key(i), chunk(100, i as u8)).expect("fits");
        }
        // 0 and 1 were stored by local jobs; 2 was pushed by a peer (never announced).
        store.announce(&[key(0), key(1)]);
        assert_eq!(store.insert(key(3), chunk(100, 3)), Ok(1));
        assert_eq!(store.insert(key(4), chunk(100, 4)), Ok(1));
        assert_eq!(store.insert(key(5), chunk(100, 5)), Ok(1));
        assert!(store.remove(key(3)));
        let mut out = Vec::new();
        assert_eq!(store.take_removed(&mut out), 0);
        assert_eq!(out, vec![key(0), key(1)]);
        // A job whose key was evicted before its completion was handed out: removed at once.
        store.announce(&[key(2), key(4)]);
        out.clear();
        assert_eq!(store.take_removed(&mut out), 0);
        assert_eq!(out, vec![key(2)]);
        out.clear();
        assert_eq!(store.take_removed(&mut out), 0);
        assert!(out.is_empty(), "each removal is reported once: {out:?}");
    }

    #[test]
    fn removed_list_is_bounded_and_counts_what_it_drops() {
        let mut store = PublishedStore::new(1);
        let keys: Vec<ChunkKey> = (0..REMOVED_KEPT_MAX as u64 + 3).map(key).collect();
        store.announce(&keys);
        let mut out = Vec::new();
        assert_eq!(store.take_removed(&mut out), 3);
        assert_eq!(out.len(), REMOVED_KEPT_MAX);
        assert_eq!(out[0], key(3), "the oldest go first");
        assert_eq!(store.take_removed(&mut out), 0);
    }

    #[test]
    fn streaming_hash_equals_one_shot_checksum() {
        use std::hash::Hasher;
        let bytes: Vec<u8> = (0..1_000_003u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let mut hasher = twox_hash::XxHash3_64::default();
        for piece in bytes.chunks(256 * 1024) {
            hasher.write(piece);
        }
        assert_eq!(hasher.finish(), checksum(&bytes));
    }

    #[test]
    fn checksum_is_the_standard_xxh3_64() {
        for len in [0usize, 1, 16, 17, 128, 129, 240, 241, 1024, 1 << 20] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            assert_eq!(
                checksum(&bytes),
                xxhash_rust::xxh3::xxh3_64(&bytes),
                "{len} bytes"
            );
        }
    }

    #[test]
    fn reinsert_and_remove_keep_accounting() {
        let mut store = PublishedStore::new(1000);
        store.insert(key(1), chunk(10, 1)).expect("fits");
        store.insert(key(1), chunk(10, 1)).expect("again");
        assert_eq!(store.bytes(), 10);
        let got = store.get(key(1)).expect("present");
        assert_eq!(got.checksum, checksum(&got.bytes));
        assert!(store.remove(key(1)));
        assert!(!store.remove(key(1)));
        assert_eq!(store.bytes(), 0);
        assert!(store.get(key(1)).is_none());
    }
}
