//! The reuse tracker: counts how often each key was looked up, in bounded memory, so that a pool
//! with a reuse threshold stores only chunks that were asked for often enough.
//!
//! A set-associative table: `bucket_count` buckets of [`WAYS`] entries (one 64-byte cache line
//! each), 4 bytes per key. An entry packs 24 bits of the key's mixed hash (a fingerprint; the
//! bucket is chosen by other bits) with an 8-bit saturating count; 0 is an empty entry. Within a
//! bucket, entries are kept most recently looked up first; a new key enters at the front and
//! pushes the bucket's least recently looked-up key out. So the tracker is an LRU of counters per
//! bucket, holding at most `bucket_count * WAYS` keys. Two keys of one bucket whose fingerprints
//! collide (odds 2^-24 per pair) share a counter; the only effect is that a chunk may be stored
//! a lookup early.

use super::table::mix;
use crate::key::ChunkKey;

/// Entries per bucket: one cache line of `u32`.
pub(crate) const WAYS: usize = 16;

const COUNT_MASK: u32 = 0xFF;

/// The highest count a counter reaches.
pub(crate) const COUNT_MAX: u32 = COUNT_MASK;

/// Per-bucket LRU of lookup counters.
#[derive(Clone, Debug)]
pub(crate) struct ReuseTracker {
    buckets: Vec<[u32; WAYS]>,
}

impl ReuseTracker {
    /// A tracker for about `keys_max` keys (rounded up to whole buckets).
    pub(crate) fn new(keys_max: u32) -> Self {
        let bucket_count = (keys_max as usize).div_ceil(WAYS).max(1);
        Self {
            buckets: vec![[0; WAYS]; bucket_count],
        }
    }

    /// The bucket that holds `key`'s counter.
    #[inline]
    pub(crate) fn bucket_of(&self, h: u64) -> usize {
        ((u64::from(h as u32) * self.buckets.len() as u64) >> 32) as usize
    }

    /// Number of buckets.
    #[cfg(test)]
    pub(crate) fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    #[inline]
    fn fingerprint(h: u64) -> u32 {
        // The top 24 bits of the high word, shifted above the count.
        ((h >> 40) as u32) << 8
    }

    /// Counts one lookup of the key with mixed hash `h`, making it the bucket's most recent.
    #[inline]
    pub(crate) fn record(&mut self, h: u64) {
        let fp = Self::fingerprint(h);
        let b = self.bucket_of(h);
        let bucket = &mut self.buckets[b];
        let pos = bucket.iter().position(|&e| e != 0 && e & !COUNT_MASK == fp);
        let entry = match pos {
            Some(i) => {
                let e = bucket[i];
                let count = ((e & COUNT_MASK) + 1).min(COUNT_MASK);
                // Shift [0, i) one place back, then put the entry first.
                bucket.copy_within(0..i, 1);
                fp | count
            }
            None => {
                // Drop the last (least recent) entry; empty entries always sit at the end.
                bucket.copy_within(0..WAYS - 1, 1);
                fp | 1
            }
        };
        bucket[0] = entry;
    }

    /// How many lookups of the key with mixed hash `h` the tracker remembers (0 if forgotten).
    #[inline]
    pub(crate) fn count(&self, h: u64) -> u32 {
        let fp = Self::fingerprint(h);
        let bucket = &self.buckets[self.bucket_of(h)];
        for &e in bucket {
            if e == 0 {
                return 0;
            }
            if e & !COUNT_MASK == fp {
                return e & COUNT_MASK;
            }
        }
        0
    }

    /// The count for `key` (test helper).
    pub(crate) fn count_key(&self, key: ChunkKey) -> u32 {
        self.count(mix(key))
    }

    /// Forgets every key.
    pub(crate) fn clear(&mut self) {
        self.buckets.fill([0; WAYS]);
    }

    /// Bytes of memory held.
    pub(crate) fn bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<[u32; WAYS]>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_forgets_least_recent_in_bucket() {
        // One bucket: every key shares it.
        let mut t = ReuseTracker::new(WAYS as u32);
        assert_eq!(t.bucket_count(), 1);
        let k = |n: u64| ChunkKey::new(u128::from(n), 0);
        t.record(mix(k(100)));
        t.record(mix(k(100)));
        assert_eq!(t.count_key(k(100)), 2);
        for n in 0..(WAYS as u64 - 1) {
            t.record(mix(k(n)));
        }
        // 100 is now least recent but still held.
        assert_eq!(t.count_key(k(100)), 2);
        t.record(mix(k(999)));
        assert_eq!(t.count_key(k(100)), 0, "least recent key forgotten");
        assert_eq!(t.count_key(k(0)), 1);
        // Re-recording 0 moves it to the front, so the next newcomer drops 1 instead.
        t.record(mix(k(0)));
        t.record(mix(k(1000)));
        assert_eq!(t.count_key(k(0)), 2);
        assert_eq!(t.count_key(k(1)), 0);
        t.clear();
        assert_eq!(t.count_key(k(0)), 0);
    }

    #[test]
    fn count_saturates() {
        let mut t = ReuseTracker::new(1);
        let h = mix(ChunkKey::new(5, 1));
        for _ in 0..300 {
            t.record(h);
        }
        assert_eq!(t.count(h), COUNT_MAX);
    }
}
