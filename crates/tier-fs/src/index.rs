//! The in-memory index of the chunks on disk: key to file size and last access, in
//! least-recently-accessed order, with the byte limit and reservations for stores in flight.
//!
//! Invariant: `used_bytes` is the sum of the entries' file sizes, and `used_bytes +
//! reserved_bytes` stays at or under `capacity_bytes` (except after a scan or a probe found more
//! than fits, until the next eviction).

use std::collections::{BTreeMap, HashMap};

use offload_core::ChunkKey;

#[derive(Clone, Copy, Debug)]
struct Entry {
    file_bytes: u64,
    tick: u64,
}

/// The index. Not synchronised; the tier wraps it in a mutex held only for short, I/O-free
/// sections.
#[derive(Debug)]
pub struct Index {
    entries: HashMap<ChunkKey, Entry>,
    /// Last-access tick to key; the first entry is the least recently accessed.
    order: BTreeMap<u64, ChunkKey>,
    next_tick: u64,
    used_bytes: u64,
    reserved_bytes: u64,
    capacity_bytes: u64,
}

impl Index {
    /// An empty index limited to `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next_tick: 0,
            used_bytes: 0,
            reserved_bytes: 0,
            capacity_bytes,
        }
    }

    /// Chunks indexed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no chunk is indexed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of the indexed files.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Bytes reserved by stores in flight.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes
    }

    /// The byte limit.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Whether `key` is indexed.
    pub fn contains(&self, key: ChunkKey) -> bool {
        self.entries.contains_key(&key)
    }

    /// The file size of `key`, if indexed.
    pub fn file_bytes(&self, key: ChunkKey) -> Option<u64> {
        self.entries.get(&key).map(|e| e.file_bytes)
    }

    /// Keys from least to most recently accessed.
    pub fn keys_by_age(&self) -> Vec<ChunkKey> {
        self.order.values().copied().collect()
    }

    fn tick(&mut self) -> u64 {
        let tick = self.next_tick;
        self.next_tick += 1;
        tick
    }

    /// Adds `key` as the most recently accessed chunk. If it is already indexed, it is only
    /// touched (its size is kept) and `false` is returned.
    pub fn insert(&mut self, key: ChunkKey, file_bytes: u64) -> bool {
        if self.contains(key) {
            self.touch(key);
            return false;
        }
        let tick = self.tick();
        self.entries.insert(key, Entry { file_bytes, tick });
        self.order.insert(tick, key);
        self.used_bytes += file_bytes;
        true
    }

    /// Removes `key`; returns its file size if it was indexed.
    pub fn remove(&mut self, key: ChunkKey) -> Option<u64> {
        let entry = self.entries.remove(&key)?;
        self.order.remove(&entry.tick);
        self.used_bytes -= entry.file_bytes;
        Some(entry.file_bytes)
    }

    /// Marks `key` as the most recently accessed (no effect if not indexed).
    pub fn touch(&mut self, key: ChunkKey) {
        let tick = self.tick();
        let Some(entry) = self.entries.get_mut(&key) else {
            return;
        };
        self.order.remove(&entry.tick);
        entry.tick = tick;
        self.order.insert(tick, key);
    }

    /// Touches `keys` in reverse order, so that the first (the prefix's start) is evicted last.
    pub fn touch_prefix(&mut self, keys: &[ChunkKey]) {
        for &key in keys.iter().rev() {
            self.touch(key);
        }
    }

    /// Removes least recently accessed entries until `used + reserved + extra <= capacity`,
    /// never removing a key for which `keep` answers true; returns the removed `(key, bytes)`.
    fn evict_until_fits(
        &mut self,
        extra: u64,
        keep: &dyn Fn(ChunkKey) -> bool,
    ) -> Vec<(ChunkKey, u64)> {
        let mut victims = Vec::new();
        let mut skipped = Vec::new();
        while self.used_bytes + self.reserved_bytes + extra > self.capacity_bytes {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            if keep(key) {
                skipped.push(key);
                continue;
            }
            if let Some(entry) = self.entries.remove(&key) {
                self.used_bytes -= entry.file_bytes;
                victims.push((key, entry.file_bytes));
            }
        }
        for key in skipped {
            if let Some(entry) = self.entries.get(&key) {
                self.order.insert(entry.tick, key);
            }
        }
        victims
    }

    /// Reserves `bytes` for a store about to be written, evicting least recently accessed
    /// chunks (never one for which `keep` answers true) to make room. Returns the evicted
    /// `(key, bytes)` (their files must be deleted), or `None`, with nothing evicted or reserved,
    /// when `bytes` cannot fit even after evicting every evictable chunk.
    pub fn reserve(
        &mut self,
        bytes: u64,
        keep: &dyn Fn(ChunkKey) -> bool,
    ) -> Option<Vec<(ChunkKey, u64)>> {
        let pinned: u64 = self
            .entries
            .iter()
            .filter(|(key, _)| keep(**key))
            .map(|(_, e)| e.file_bytes)
            .sum();
        if pinned + self.reserved_bytes + bytes > self.capacity_bytes {
            return None;
        }
        let victims = self.evict_until_fits(bytes, keep);
        self.reserved_bytes += bytes;
        Some(victims)
    }

    /// Gives back a reservation whose store failed.
    pub fn release(&mut self, bytes: u64) {
        debug_assert!(
            bytes <= self.reserved_bytes,
            "release of an unreserved amount"
        );
        self.reserved_bytes = self.reserved_bytes.saturating_sub(bytes);
    }

    /// Turns a reservation into the entry of the stored chunk.
    pub fn commit(&mut self, key: ChunkKey, bytes: u64) {
        self.release(bytes);
        self.insert(key, bytes);
    }

    /// Evicts least recently accessed chunks until the indexed bytes fit the limit (after a scan
    /// found more than fits); returns the evicted `(key, bytes)`.
    pub fn evict_over_capacity(&mut self) -> Vec<(ChunkKey, u64)> {
        self.evict_until_fits(0, &|_| false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64) -> ChunkKey {
        ChunkKey::new(n, 0)
    }

    #[test]
    fn eviction_takes_the_least_recently_accessed() {
        let mut index = Index::new(300);
        for n in 0..3 {
            assert!(index.insert(k(n), 100));
        }
        index.touch(k(0));
        let victims = index.reserve(100, &|_| false).unwrap();
        assert_eq!(victims, vec![(k(1), 100)]);
        index.commit(k(3), 100);
        assert_eq!(index.used_bytes(), 300);
        assert_eq!(index.reserved_bytes(), 0);
        assert_eq!(index.keys_by_age(), vec![k(2), k(0), k(3)]);
    }

    #[test]
    fn touch_prefix_keeps_the_first_key_longest() {
        let mut index = Index::new(1000);
        for n in 0..4 {
            index.insert(k(n), 10);
        }
        index.touch_prefix(&[k(0), k(1), k(2)]);
        assert_eq!(index.keys_by_age(), vec![k(3), k(2), k(1), k(0)]);
    }

    #[test]
    fn reserve_refuses_what_cannot_fit_without_side_effects() {
        let mut index = Index::new(250);
        index.insert(k(0), 100);
        index.insert(k(1), 100);
        assert!(index.reserve(300, &|_| false).is_none());
        assert!(index.reserve(200, &|key| key == k(0)).is_none());
        assert_eq!(index.len(), 2);
        assert_eq!(index.reserved_bytes(), 0);
        let victims = index.reserve(150, &|key| key == k(0)).unwrap();
        assert_eq!(victims, vec![(k(1), 100)]);
        assert_eq!(index.keys_by_age(), vec![k(0)]);
        index.release(150);
        assert_eq!(index.reserved_bytes(), 0);
    }

    #[test]
    fn insert_of_a_present_key_only_touches() {
        let mut index = Index::new(1000);
        index.insert(k(0), 10);
        index.insert(k(1), 10);
        assert!(!index.insert(k(0), 999));
        assert_eq!(index.used_bytes(), 20);
        assert_eq!(index.keys_by_age(), vec![k(1), k(0)]);
        assert_eq!(index.remove(k(0)), Some(10));
        assert_eq!(index.remove(k(0)), None);
        assert_eq!(index.used_bytes(), 10);
    }

    /// Random operations against a reference model (a vector in access order).
    #[test]
    fn matches_a_reference_model() {
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
            match next(4) {
                0 => {
                    let bytes = 50 + next(200);
                    if let Some(pos) = model.iter().position(|e| e.0 == key) {
                        let entry = model.remove(pos);
                        model.push(entry);
                        index.touch(key);
                        continue;
                    }
                    let victims = index.reserve(bytes, &|_| false).unwrap();
                    let mut expected = Vec::new();
                    while model.iter().map(|e| e.1).sum::<u64>() + bytes > capacity {
                        expected.push(model.remove(0));
                    }
                    assert_eq!(victims, expected);
                    index.commit(key, bytes);
                    model.push((key, bytes));
                }
                1 => {
                    index.touch(key);
                    if let Some(pos) = model.iter().position(|e| e.0 == key) {
                        let entry = model.remove(pos);
                        model.push(entry);
                    }
                }
                2 => {
                    let removed = index.remove(key);
                    let pos = model.iter().position(|e| e.0 == key);
                    assert_eq!(removed, pos.map(|p| model.remove(p).1));
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
