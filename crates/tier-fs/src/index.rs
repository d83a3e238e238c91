//! The in-memory index of what is on disk: every chunk's location (segment, offset, record
//! bytes) and last access, every segment's bytes and state, the byte limit, and reservations for
//! records in flight. Eviction removes whole segments, the one whose most recent access is oldest
//! first (a segment is as fresh as its freshest chunk); a segment being appended by this instance
//! is never evicted.
//!
//! Invariant: `used_bytes` is the sum of the segments' bytes (what their files occupy), and
//! `used_bytes + reserved_bytes` stays at or under `capacity_bytes` (except after a scan or a probe
//! found more than fits, until the next eviction).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use offload_core::ChunkKey;

/// The index's handle of a segment (not stored on disk).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(pub u64);

/// What may happen to a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentState {
    /// Appended by a worker of this instance: never evicted.
    Writing,
    /// Sealed by this instance, or found at start: eviction deletes its file.
    Sealed,
    /// Another live instance may still append to it: eviction only forgets it.
    Foreign,
}

/// Where a chunk's record is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The segment.
    pub segment: SegmentId,
    /// The segment file.
    pub path: Arc<PathBuf>,
    /// Byte offset of the record's header in the file.
    pub offset: u64,
    /// Bytes of the record (header, payload, padding).
    pub bytes: u64,
}

/// A segment removed by eviction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Victim {
    /// Its file.
    pub path: Arc<PathBuf>,
    /// Whether the file is to be deleted (`false`: only forgotten, another instance owns it).
    pub delete: bool,
    /// Chunks it held.
    pub chunks: u64,
    /// Its bytes.
    pub bytes: u64,
}

#[derive(Clone, Debug)]
struct ChunkEntry {
    segment: SegmentId,
    offset: u64,
    bytes: u64,
    tick: u64,
}

#[derive(Debug)]
struct SegmentEntry {
    path: Arc<PathBuf>,
    bytes: u64,
    keys: Vec<ChunkKey>,
    /// The most recent access of any of its chunks (or its creation).
    newest: u64,
    state: SegmentState,
}

/// The index. Not synchronised; the tier wraps it in a mutex held only for short, I/O-free
/// sections.
#[derive(Debug)]
pub struct Index {
    chunks: HashMap<ChunkKey, ChunkEntry>,
    segments: HashMap<SegmentId, SegmentEntry>,
    /// `(newest access, segment)`, oldest first.
    order: BTreeSet<(u64, SegmentId)>,
    next_tick: u64,
    next_segment: u64,
    used_bytes: u64,
    reserved_bytes: u64,
    capacity_bytes: u64,
    /// Keys that left the index (evicted with their segment, or dropped as unreadable) and that
    /// [`Index::take_removed`] has not handed out yet; at most [`REMOVED_KEPT_MAX`].
    removed: VecDeque<ChunkKey>,
    /// Removed keys dropped from `removed` because it was full.
    removed_overflow: u64,
}

/// The most removed keys kept for [`Index::take_removed`] (the oldest go first beyond it).
pub const REMOVED_KEPT_MAX: usize = 1 << 16;

impl Index {
    /// An empty index limited to `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            chunks: HashMap::new(),
            segments: HashMap::new(),
            order: BTreeSet::new(),
            next_tick: 0,
            next_segment: 0,
            used_bytes: 0,
            reserved_bytes: 0,
            capacity_bytes,
            removed: VecDeque::new(),
            removed_overflow: 0,
        }
    }

    fn note_removed(&mut self, key: ChunkKey) {
        if self.removed.len() == REMOVED_KEPT_MAX {
            self.removed.pop_front();
            self.removed_overflow += 1;
        }
        self.removed.push_back(key);
    }

    /// Moves the keys removed since the last call into `out` (oldest first); returns how many
    /// removals were dropped unreported because more than [`REMOVED_KEPT_MAX`] waited.
    pub fn take_removed(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        out.extend(self.removed.drain(..));
        std::mem::take(&mut self.removed_overflow)
    }

    /// Chunks indexed.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether no chunk is indexed.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Segments indexed.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Bytes of the indexed segments.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Bytes reserved by records in flight.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes
    }

    /// The byte limit.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Whether `key` is indexed.
    pub fn contains(&self, key: ChunkKey) -> bool {
        self.chunks.contains_key(&key)
    }

    /// Where `key`'s record is, if indexed.
    pub fn location(&self, key: ChunkKey) -> Option<Location> {
        let entry = self.chunks.get(&key)?;
        let segment = self.segments.get(&entry.segment)?;
        Some(Location {
            segment: entry.segment,
            path: Arc::clone(&segment.path),
            offset: entry.offset,
            bytes: entry.bytes,
        })
    }

    /// Keys from least to most recently accessed.
    pub fn keys_by_age(&self) -> Vec<ChunkKey> {
        let mut keys: Vec<(u64, ChunkKey)> =
            self.chunks.iter().map(|(k, e)| (e.tick, *k)).collect();
        keys.sort_unstable();
        keys.into_iter().map(|(_, k)| k).collect()
    }

    /// The path of a segment, if indexed.
    pub fn segment_path(&self, segment: SegmentId) -> Option<Arc<PathBuf>> {
        self.segments.get(&segment).map(|s| Arc::clone(&s.path))
    }

    /// The bytes of a segment, if indexed.
    pub fn segment_bytes(&self, segment: SegmentId) -> Option<u64> {
        self.segments.get(&segment).map(|s| s.bytes)
    }

    fn tick(&mut self) -> u64 {
        let tick = self.next_tick;
        self.next_tick += 1;
        tick
    }

    /// Adds a segment of `bytes` bytes (already on disk) in `state`; it counts as accessed now.
    pub fn add_segment(&mut self, path: &Path, bytes: u64, state: SegmentState) -> SegmentId {
        let id = SegmentId(self.next_segment);
        self.next_segment += 1;
        let newest = self.tick();
        self.segments.insert(
            id,
            SegmentEntry {
                path: Arc::new(path.to_owned()),
                bytes,
                keys: Vec::new(),
                newest,
                state,
            },
        );
        self.order.insert((newest, id));
        self.used_bytes += bytes;
        id
    }

    /// Changes a segment's state (a sealed segment becomes evictable).
    pub fn set_state(&mut self, segment: SegmentId, state: SegmentState) {
        if let Some(entry) = self.segments.get_mut(&segment) {
            entry.state = state;
        }
    }

    /// Sets a segment's bytes to `bytes` (its file's size: after its allocated tail was trimmed
    /// or a failed tail cut).
    pub fn set_segment_bytes(&mut self, segment: SegmentId, bytes: u64) {
        if let Some(entry) = self.segments.get_mut(&segment) {
            self.used_bytes = self.used_bytes - entry.bytes + bytes;
            entry.bytes = bytes;
        }
    }

    /// Grows a segment to `bytes` (no effect if it is already that large).
    pub fn grow_segment(&mut self, segment: SegmentId, bytes: u64) {
        if let Some(entry) = self.segments.get_mut(&segment) {
            if bytes > entry.bytes {
                self.used_bytes += bytes - entry.bytes;
                entry.bytes = bytes;
            }
        }
    }

    /// Adds `key`'s record at `offset` (`bytes` long) in `segment` as the most recently accessed
    /// chunk. Returns `false`, changing nothing but the access order, if `key` is already indexed
    /// (or the segment is unknown).
    pub fn insert(&mut self, key: ChunkKey, segment: SegmentId, offset: u64, bytes: u64) -> bool {
        if self.contains(key) {
            self.touch(key);
            return false;
        }
        if !self.segments.contains_key(&segment) {
            return false;
        }
        let tick = self.tick();
        self.chunks.insert(
            key,
            ChunkEntry {
                segment,
                offset,
                bytes,
                tick,
            },
        );
        if let Some(entry) = self.segments.get_mut(&segment) {
            entry.keys.push(key);
        }
        self.freshen(segment, tick);
        true
    }

    fn freshen(&mut self, segment: SegmentId, tick: u64) {
        if let Some(entry) = self.segments.get_mut(&segment) {
            self.order.remove(&(entry.newest, segment));
            entry.newest = tick;
            self.order.insert((tick, segment));
        }
    }

    /// Drops `key` from the index (its record stays on disk until its segment goes); returns
    /// where it was.
    pub fn remove(&mut self, key: ChunkKey) -> Option<Location> {
        let location = self.location(key)?;
        self.chunks.remove(&key);
        self.note_removed(key);
        Some(location)
    }

    /// Marks `key` as the most recently accessed (no effect if not indexed).
    pub fn touch(&mut self, key: ChunkKey) {
        let tick = self.tick();
        let Some(entry) = self.chunks.get_mut(&key) else {
            return;
        };
        entry.tick = tick;
        let segment = entry.segment;
        self.freshen(segment, tick);
    }

    /// Touches `keys` in reverse order, so that the first (the prefix's start) is evicted last.
    pub fn touch_prefix(&mut self, keys: &[ChunkKey]) {
        for &key in keys.iter().rev() {
            self.touch(key);
        }
    }

    /// Removes a segment and its chunks from the index.
    fn take_segment(&mut self, segment: SegmentId) -> Option<Victim> {
        let entry = self.segments.remove(&segment)?;
        self.order.remove(&(entry.newest, segment));
        self.used_bytes -= entry.bytes;
        let mut chunks = 0;
        for key in &entry.keys {
            if self.chunks.get(key).is_some_and(|c| c.segment == segment) {
                self.chunks.remove(key);
                chunks += 1;
                self.note_removed(*key);
            }
        }
        Some(Victim {
            path: entry.path,
            delete: entry.state == SegmentState::Sealed,
            chunks,
            bytes: entry.bytes,
        })
    }

    /// Removes a segment (a failed or vanished file) and its chunks; returns it.
    pub fn remove_segment(&mut self, segment: SegmentId) -> Option<Victim> {
        self.take_segment(segment)
    }

    /// Bytes of segments eviction may not take.
    fn pinned_bytes(&self) -> u64 {
        self.segments
            .values()
            .filter(|s| s.state == SegmentState::Writing)
            .map(|s| s.bytes)
            .sum()
    }

    /// Removes the oldest evictable segments until `used + reserved + extra <= capacity`.
    fn evict_until_fits(&mut self, extra: u64) -> Vec<Victim> {
        let mut victims = Vec::new();
        let mut cursor = self.order.iter().next().copied();
        while self.used_bytes + self.reserved_bytes + extra > self.capacity_bytes {
            let Some(at) = cursor else {
                break;
            };
            cursor = self
                .order
                .range((std::ops::Bound::Excluded(at), std::ops::Bound::Unbounded))
                .next()
                .copied();
            let (_, segment) = at;
            let evictable = self
                .segments
                .get(&segment)
                .is_some_and(|s| s.state != SegmentState::Writing);
            if evictable {
                victims.extend(self.take_segment(segment));
            }
        }
        victims
    }

    /// Reserves `bytes` for a record about to be written, evicting the oldest segments to make
    /// room. Returns the evicted segments (their files must be deleted when `delete` says so), or
    /// `None`, with nothing evicted or reserved, when `bytes` cannot fit even after evicting every
    /// evictable segment.
    pub fn reserve(&mut self, bytes: u64) -> Option<Vec<Victim>> {
        if self.pinned_bytes() + self.reserved_bytes + bytes > self.capacity_bytes {
            return None;
        }
        let victims = self.evict_until_fits(bytes);
        self.reserved_bytes += bytes;
        Some(victims)
    }

    /// Gives back a reservation whose record failed.
    pub fn release(&mut self, bytes: u64) {
        debug_assert!(
            bytes <= self.reserved_bytes,
            "release of an unreserved amount"
        );
        self.reserved_bytes = self.reserved_bytes.saturating_sub(bytes);
    }

    /// Evicts the oldest segments until the indexed bytes fit the limit (after a scan found more
    /// than fits); returns the evicted segments.
    pub fn evict_over_capacity(&mut self) -> Vec<Victim> {
        self.evict_until_fits(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64) -> ChunkKey {
        ChunkKey::new(u128::from(n), 0)
    }

    /// Adds a sealed one-chunk segment for `key` of `bytes`, reserving first like a store.
    fn store_alone(index: &mut Index, key: ChunkKey, bytes: u64) -> Vec<Victim> {
        let victims = index.reserve(bytes).expect("fits");
        let seg = index.add_segment(
            Path::new(&format!("/s/{}", key.hash)),
            0,
            SegmentState::Writing,
        );
        index.release(bytes);
        index.grow_segment(seg, bytes);
        assert!(index.insert(key, seg, 0, bytes));
        index.set_state(seg, SegmentState::Sealed);
        victims
    }

    #[test]
    fn eviction_takes_the_segment_accessed_least_recently() {
        let mut index = Index::new(300);
        for n in 0..3 {
            assert!(store_alone(&mut index, k(n), 100).is_empty());
        }
        index.touch(k(0));
        let victims = store_alone(&mut index, k(3), 100);
        assert_eq!(victims.len(), 1);
        assert_eq!(*victims[0].path, PathBuf::from("/s/1"));
        assert!(victims[0].delete);
        assert_eq!(index.used_bytes(), 300);
        assert_eq!(index.reserved_bytes(), 0);
        assert_eq!(index.keys_by_age(), vec![k(2), k(0), k(3)]);
    }

    #[test]
    fn a_segment_goes_whole_and_a_fresh_chunk_keeps_it() {
        let mut index = Index::new(1000);
        let a = index.add_segment(Path::new("/a"), 400, SegmentState::Sealed);
        let b = index.add_segment(Path::new("/b"), 400, SegmentState::Sealed);
        index.insert(k(1), a, 0, 200);
        index.insert(k(2), a, 200, 200);
        index.insert(k(3), b, 0, 400);
        // k(1) is fresher than k(3): segment b is the older one.
        index.touch(k(1));
        let victims = index.reserve(400).unwrap();
        assert_eq!(victims.len(), 1);
        assert_eq!(*victims[0].path, PathBuf::from("/b"));
        assert_eq!(victims[0].chunks, 1);
        assert!(index.contains(k(2)));
        assert!(!index.contains(k(3)));
        assert_eq!(index.location(k(2)).unwrap().offset, 200);
        // A removed chunk leaves its bytes until the segment goes.
        assert_eq!(index.remove(k(2)).map(|l| l.segment), Some(a));
        assert_eq!(index.used_bytes(), 400);
    }

    #[test]
    fn writing_segments_are_never_evicted_and_foreign_ones_are_only_forgotten() {
        let mut index = Index::new(1000);
        let w = index.add_segment(Path::new("/w"), 500, SegmentState::Writing);
        let f = index.add_segment(Path::new("/f"), 400, SegmentState::Foreign);
        index.insert(k(1), w, 0, 500);
        index.insert(k(2), f, 0, 400);
        assert!(index.reserve(600).is_none());
        assert_eq!(index.reserved_bytes(), 0);
        let victims = index.reserve(500).unwrap();
        assert_eq!(victims.len(), 1);
        assert!(!victims[0].delete);
        assert!(index.contains(k(1)));
        index.release(500);
        assert_eq!(index.segment_count(), 1);
    }

    #[test]
    fn insert_of_a_present_key_only_touches() {
        let mut index = Index::new(1000);
        let s = index.add_segment(Path::new("/s"), 20, SegmentState::Sealed);
        index.insert(k(0), s, 0, 10);
        index.insert(k(1), s, 10, 10);
        assert!(!index.insert(k(0), s, 999, 999));
        assert_eq!(index.keys_by_age(), vec![k(1), k(0)]);
        assert!(!index.insert(k(5), SegmentId(99), 0, 1));
        assert_eq!(index.remove(k(0)).map(|l| l.offset), Some(0));
        assert_eq!(index.remove(k(0)), None);
        assert_eq!(index.len(), 1);
    }

    /// Random operations on one-chunk segments against a reference model (a vector in access
    /// order): then eviction is exactly least-recently-used by chunk.
    #[test]
    fn one_chunk_segments_match_a_reference_lru() {
        let mut state = 0x1234_5678_u64;
        let mut next = move |bound: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % bound
        };
        let capacity = 1000;
        let mut index = Index::new(capacity);
        let mut model: Vec<(ChunkKey, u64)> = Vec::new();
        for _ in 0..5000 {
            let key = k(next(40));
            match next(3) {
                0 => {
                    let bytes = 50 + next(200);
                    if let Some(pos) = model.iter().position(|e| e.0 == key) {
                        let entry = model.remove(pos);
                        model.push(entry);
                        index.touch(key);
                        continue;
                    }
                    let victims = store_alone(&mut index, key, bytes);
                    let mut expected = 0;
                    while model.iter().map(|e| e.1).sum::<u64>() + bytes > capacity {
                        model.remove(0);
                        expected += 1;
                    }
                    assert_eq!(victims.len(), expected);
                    model.push((key, bytes));
                }
                1 => {
                    index.touch(key);
                    if let Some(pos) = model.iter().position(|e| e.0 == key) {
                        let entry = model.remove(pos);
                        model.push(entry);
                    }
                }
                _ => assert_eq!(index.contains(key), model.iter().any(|e| e.0 == key)),
            }
            assert_eq!(index.used_bytes(), model.iter().map(|e| e.1).sum::<u64>());
            assert!(index.used_bytes() <= capacity);
            let keys: Vec<ChunkKey> = model.iter().map(|e| e.0).collect();
            assert_eq!(index.keys_by_age(), keys);
        }
    }
}
