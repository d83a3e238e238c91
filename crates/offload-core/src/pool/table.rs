//! The key hash and a compact open-addressing index table: maps a 64-bit key hash to an index
//! into an arena (slots or ghost entries) that holds the keys themselves.
//!
//! Each table entry is one `u32`: the arena index in the low bits (as many as the arena needs),
//! the entry's displacement from its home bucket in the top [`DISP_BITS`] bits (saturating), and
//! a tag (more bits of the hash) in between. Linear probing in Robin Hood order: along a
//! probe path, displacements never grow by more than one per bucket, so
//!
//! - a search rejects most non-matching entries by tag without touching the arena, and stops as
//!   soon as it meets an entry displaced less than its own probe distance;
//! - a deletion shifts the following entries back by one until an empty bucket or an entry at its
//!   home (no tombstones, no re-hashing).
//!
//! Only a saturated displacement (rare at our load factor) needs the key's hash, which the caller
//! supplies by index. The capacity is chosen at creation and never changes, so the load factor is
//! bounded by `arena_len / capacity`. Iteration order is never exposed.

use crate::key::ChunkKey;

/// The mixed hash of a key, used for the index table, ghost fingerprints and the reuse tracker:
/// `fold(fold(x * M1) * M2)`, where `x = low ^ fold(high * H) ^ group * G`, `low` and `high` are
/// the two halves of the 128-bit hash, `fold` folds a full 64x64 -> 128-bit product to 64 bits
/// (high half xor low half) and `H`, `G`, `M1`, `M2` are odd constants; bit 32 is then cleared.
///
/// Why this is enough: equal mixes of different keys only cost probes (the table compares whole
/// keys), so the mix needs a spread like a random function's, not strength. Real block hashes
/// are already uniform, and for them a fold of the halves would do; the two folded products are
/// for keys that are not (test keys and trace ids are small integers with a zero high half).
/// One folded product is not enough: its low half is then a Weyl sequence of the key, whose
/// spread depends on the constant and on which ids are live (on the Mooncake trace, probe costs
/// varied by up to 2.4x between constants); with two, the bench's instruction counts stayed
/// within 0.3% over five constants, as with the splitmix64 finalizer this replaced, for about
/// half its instructions (every probe of the pool's hot path starts with a mix). The high half
/// goes through its own folded product rather than a plain xor or a 64-bit product, so that no
/// one-bit change of `high` (bit 63 included) equals a one-bit change of `low`: keys that differ
/// only in their high half spread like any others.
///
/// A ghost keeps only the high word, and uses its lowest bit for a flag; clearing bit 32 here
/// means the high word alone rebuilds the table's home bucket of both a present key and its
/// ghost, so an entry can turn from one into the other in place.
#[inline]
pub(crate) fn mix(key: ChunkKey) -> u64 {
    let x = key.hash_low()
        ^ fold_mul(key.hash_high(), 0xD6E8_FEB8_6659_FD93)
        ^ u64::from(key.group).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    fold_mul(fold_mul(x, 0xBF58_476D_1CE4_E5B9), 0x94D0_49BB_1331_11EB) & !(1 << 32)
}

/// The full 128-bit product of `a` and `b`, its halves xored.
#[inline]
fn fold_mul(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    p as u64 ^ (p >> 64) as u64
}

/// An empty table entry. Never a valid entry: its index part is `idx_mask`, and every arena index
/// is below `idx_mask`.
const EMPTY: u32 = u32::MAX;

/// Bits an entry spends on its displacement (the top bits).
pub(crate) const DISP_BITS: u32 = 4;
const DISP_SHIFT: u32 = 32 - DISP_BITS;
/// Largest displacement stored exactly; this value also means "this or more".
const DISP_MAX: u32 = (1 << DISP_BITS) - 1;

/// Largest arena an index table can serve (the index bits must leave room for the displacement).
pub(crate) const ARENA_LEN_MAX: u32 = (1 << DISP_SHIFT) - 1;

/// Maps hashes to arena indices; the caller supplies key comparison and re-hashing by index.
#[derive(Clone, Debug)]
pub(crate) struct IndexTable {
    entries: Vec<u32>,
    idx_mask: u32,
    /// Bits of the tag: between the index and the displacement.
    tag_mask: u32,
    len: u32,
}

impl IndexTable {
    /// A table for an arena of at most [`ARENA_LEN_MAX`] entries with `capacity` buckets;
    /// `capacity` must exceed `arena_len`, so probing always ends at an empty bucket.
    pub(crate) fn new(arena_len: u32, capacity: usize) -> Self {
        assert!(
            arena_len <= ARENA_LEN_MAX,
            "arena too large for an index table"
        );
        assert!(capacity > arena_len as usize && capacity <= u32::MAX as usize);
        let idx_bits = 32 - arena_len.leading_zeros();
        let idx_mask = low_bits(idx_bits);
        debug_assert!(arena_len <= idx_mask);
        Self {
            entries: vec![EMPTY; capacity],
            idx_mask,
            tag_mask: low_bits(DISP_SHIFT) & !idx_mask,
            len: 0,
        }
    }

    /// Number of indices stored.
    #[inline]
    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    /// Bytes of memory the table holds.
    pub(crate) fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<u32>()
    }

    #[inline]
    fn home(&self, h: u64) -> usize {
        // Range reduction by multiplication (Lemire): no power-of-two capacity needed.
        (((h >> 32) * self.entries.len() as u64) >> 32) as usize
    }

    #[inline]
    fn tag(&self, h: u64) -> u32 {
        // The low word's top bits; independent of the bits `home` uses.
        (h as u32) & self.tag_mask
    }

    #[inline]
    fn disp(&self, e: u32) -> u32 {
        e >> DISP_SHIFT
    }

    #[inline]
    fn with_disp(&self, e: u32, disp: usize) -> u32 {
        let d = (disp as u32).min(DISP_MAX);
        (e & low_bits(DISP_SHIFT)) | (d << DISP_SHIFT)
    }

    /// Where a probe stops, as one comparison: `ends_probe(e, stop)` holds for an empty bucket
    /// and for an entry displaced less than the probe's distance `d`, where `stop` is
    /// `min(d, DISP_MAX)` in the displacement field (see [`next_stop`]). The displacement is
    /// the entry's top bits, so `disp(e) < min(d, DISP_MAX)` is `e < stop`, and `EMPTY + 1`
    /// wraps to 0.
    #[inline]
    fn ends_probe(e: u32, stop: u32) -> bool {
        e.wrapping_add(1) <= stop
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        let j = i + 1;
        if j == self.entries.len() {
            0
        } else {
            j
        }
    }

    /// Cyclic distance from bucket `a` forward to bucket `b`.
    #[inline]
    fn dist(&self, a: usize, b: usize) -> usize {
        if b >= a {
            b - a
        } else {
            b + self.entries.len() - a
        }
    }

    /// The index whose entry has `h`'s tag and for which `eq` holds, if any.
    #[inline]
    pub(crate) fn find(&self, h: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let tag = self.tag(h);
        let mut i = self.home(h);
        let mut stop = 0u32;
        loop {
            let e = self.entries[i];
            // An empty bucket, or an entry displaced less than our probe distance: in Robin Hood
            // order, the key would sit before it. (A saturated displacement never ends the
            // search early.)
            if Self::ends_probe(e, stop) {
                return None;
            }
            if e & self.tag_mask == tag && eq(e & self.idx_mask) {
                return Some(e & self.idx_mask);
            }
            i = self.next(i);
            stop = next_stop(stop);
        }
    }

    /// The exact displacement of entry `e` at bucket `i`, recomputing it from the key's hash only
    /// when the stored field is saturated.
    #[inline]
    fn exact_disp(&self, e: u32, i: usize, hash_of: &mut impl FnMut(u32) -> u64) -> u32 {
        let d = self.disp(e);
        if d < DISP_MAX {
            d
        } else {
            self.dist(self.home(hash_of(e & self.idx_mask)), i) as u32
        }
    }

    /// Whether entry `e` at bucket `i` sits closer to its home than `d` buckets: where a probe
    /// `d` buckets from its home stops, and where Robin Hood insertion takes the bucket.
    #[inline]
    fn yields(&self, e: u32, i: usize, d: u32, hash_of: &mut impl FnMut(u32) -> u64) -> bool {
        let stored = self.disp(e);
        stored < d.min(DISP_MAX)
            || (stored == DISP_MAX && d > stored && self.exact_disp(e, i, hash_of) < d)
    }

    /// Adds `idx` under `h`. The caller guarantees that no equal key is present. `hash_of` gives
    /// the hash stored for any other index (called only for saturated displacements).
    #[inline]
    pub(crate) fn insert(&mut self, h: u64, idx: u32, hash_of: impl FnMut(u32) -> u64) {
        debug_assert!(idx < self.idx_mask);
        self.insert_from(self.home(h), 0, self.tag(h) | idx, hash_of);
    }

    /// Adds `idx` under `h`, unless an entry with `h`'s tag for which `is_old` holds is on `h`'s
    /// probe path: that entry then takes `idx` in place (same bucket, tag and displacement, so
    /// nothing moves) and its old index is returned. One walk of the probe path either way.
    /// The caller guarantees that no key equal to `idx`'s is present.
    #[inline]
    pub(crate) fn insert_or_replace(
        &mut self,
        h: u64,
        idx: u32,
        mut is_old: impl FnMut(u32) -> bool,
        mut hash_of: impl FnMut(u32) -> u64,
    ) -> Option<u32> {
        debug_assert!(idx < self.idx_mask);
        let tag = self.tag(h);
        let mut i = self.home(h);
        let mut d = 0u32;
        let mut stop = 0u32;
        loop {
            let e = self.entries[i];
            // Where `find` would stop, Robin Hood insertion places the new entry (`yields`, with
            // the common cases in one comparison).
            if Self::ends_probe(e, stop)
                || (self.disp(e) == DISP_MAX && self.yields(e, i, d, &mut hash_of))
            {
                break;
            }
            if e & self.tag_mask == tag && is_old(e & self.idx_mask) {
                self.entries[i] = (e & !self.idx_mask) | idx;
                return Some(e & self.idx_mask);
            }
            i = self.next(i);
            d += 1;
            stop = next_stop(stop);
        }
        self.insert_from(i, d, tag | idx, hash_of);
        None
    }

    /// Robin Hood insertion of entry `carried` (tag and index) at bucket `i`, `d` buckets from
    /// its home, shifting later entries as needed.
    #[inline]
    fn insert_from(
        &mut self,
        mut i: usize,
        mut d: u32,
        mut carried: u32,
        mut hash_of: impl FnMut(u32) -> u64,
    ) {
        debug_assert!(
            (self.len as usize) < self.entries.len() - 1,
            "index table full"
        );
        loop {
            let e = self.entries[i];
            if e == EMPTY {
                self.entries[i] = self.with_disp(carried, d as usize);
                self.len += 1;
                return;
            }
            debug_assert!(
                e & self.idx_mask != carried & self.idx_mask,
                "index inserted twice"
            );
            // Robin Hood: the entry closer to its home yields its bucket.
            if self.yields(e, i, d, &mut hash_of) {
                let e_disp = self.exact_disp(e, i, &mut hash_of);
                self.entries[i] = self.with_disp(carried, d as usize);
                carried = e;
                d = e_disp;
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// Like [`IndexTable::find`], for entries of two kinds: returns the first index on `h`'s
    /// probe path for which `primary` holds, or else the first for which `secondary` holds.
    #[inline]
    pub(crate) fn find_either(
        &self,
        h: u64,
        mut primary: impl FnMut(u32) -> bool,
        mut secondary: impl FnMut(u32) -> bool,
    ) -> Option<u32> {
        let tag = self.tag(h);
        let mut i = self.home(h);
        let mut stop = 0u32;
        let mut second = None;
        loop {
            let e = self.entries[i];
            if Self::ends_probe(e, stop) {
                return second;
            }
            if e & self.tag_mask == tag {
                let idx = e & self.idx_mask;
                if primary(idx) {
                    return Some(idx);
                }
                if second.is_none() && secondary(idx) {
                    second = Some(idx);
                }
            }
            i = self.next(i);
            stop = next_stop(stop);
        }
    }

    /// The bucket of the entry for `idx`, stored under `h`.
    #[inline]
    fn position(&self, h: u64, idx: u32) -> Option<usize> {
        let mut i = self.home(h);
        let mut d = 0u32;
        loop {
            let e = self.entries[i];
            if e == EMPTY || self.disp(e) < d.min(DISP_MAX) {
                return None;
            }
            if e & self.idx_mask == idx {
                return Some(i);
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// The bucket of the entry for `idx`, stored under `h`, for the callers that own that entry
    /// (its slot or ghost is in the table): no Robin Hood early exit, which in a table that
    /// keeps its invariants never fires before the entry is reached, only the end of the
    /// cluster (every table has an empty bucket). `None` only if the entry is missing.
    #[inline]
    fn position_owned(&self, h: u64, idx: u32) -> Option<usize> {
        let mut i = self.home(h);
        // Most entries sit within a few buckets of their home: the first four are compared at
        // once, without a branch per bucket (the probe's length varies too much to predict).
        // Indices are unique and no empty bucket matches, so a match there is the entry, even
        // past an empty bucket.
        if let Some(w) = self.entries.get(i..i + 4) {
            let m = self.idx_mask;
            let hits = u32::from(w[0] & m == idx)
                | u32::from(w[1] & m == idx) << 1
                | u32::from(w[2] & m == idx) << 2
                | u32::from(w[3] & m == idx) << 3;
            if hits != 0 {
                return Some(i + hits.trailing_zeros() as usize);
            }
        }
        loop {
            let e = self.entries[i];
            if e & self.idx_mask == idx {
                return Some(i);
            }
            if e == EMPTY {
                return None;
            }
            i = self.next(i);
        }
    }

    /// Whether the entry for `idx` is stored under `h` (invariant checks).
    pub(crate) fn contains(&self, h: u64, idx: u32) -> bool {
        self.position(h, idx).is_some()
    }

    /// Gives the entry for `old`, stored under `h`, the index `new` in place: the same key (hash)
    /// now names another arena entry. Returns whether `old` was found.
    #[inline]
    pub(crate) fn replace(&mut self, h: u64, old: u32, new: u32) -> bool {
        debug_assert!(new < self.idx_mask);
        let Some(i) = self.position_owned(h, old) else {
            return false;
        };
        self.entries[i] = (self.entries[i] & !self.idx_mask) | new;
        true
    }

    /// Removes the entry for `idx`, stored under `h`. `hash_of` gives the hash stored for any
    /// other index (called only for saturated displacements). Returns whether it was found.
    #[inline]
    pub(crate) fn remove(&mut self, h: u64, idx: u32, mut hash_of: impl FnMut(u32) -> u64) -> bool {
        let Some(i) = self.position_owned(h, idx) else {
            return false;
        };
        // Backward shift: each following entry away from its home moves back one bucket.
        let mut hole = i;
        // Most shifts move no entry or one (at about 40% load, either about as often): the
        // first two steps are taken with selects rather than a branch on how many, where
        // neither entry's displacement is saturated. Only a shift of two or more goes on in
        // the loop below.
        let j1 = self.next(hole);
        let j2 = self.next(j1);
        let (e1, e2) = (self.entries[j1], self.entries[j2]);
        // (An empty bucket's displacement bits read as saturated: `EMPTY` is all ones.)
        let saturated = |e: u32| (e != EMPTY) & (self.disp(e) == DISP_MAX);
        if !(saturated(e1) | saturated(e2)) & (self.entries.len() > 2) {
            let end = 1 << DISP_SHIFT;
            // Empty, or at its home: it stays, and so does everything after it.
            let (stays1, stays2) = (Self::ends_probe(e1, end), Self::ends_probe(e2, end));
            self.entries[hole] = if stays1 { EMPTY } else { e1.wrapping_sub(end) };
            let second = if stays2 { EMPTY } else { e2.wrapping_sub(end) };
            self.entries[j1] = if stays1 { e1 } else { second };
            if stays1 | stays2 {
                self.len -= 1;
                return true;
            }
            hole = j2;
        }
        loop {
            let j = self.next(hole);
            let e = self.entries[j];
            if e == EMPTY || self.disp(e) == 0 {
                break;
            }
            // A displacement stored exactly just drops by one; a saturated one is recomputed.
            self.entries[hole] = if self.disp(e) < DISP_MAX {
                e - (1 << DISP_SHIFT)
            } else {
                let d = self.exact_disp(e, j, &mut hash_of);
                self.with_disp(e, d as usize - 1)
            };
            hole = j;
        }
        self.entries[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Removes every entry.
    pub(crate) fn clear(&mut self) {
        self.entries.fill(EMPTY);
        self.len = 0;
    }

    /// Checks that every stored entry is reachable from its home bucket, with the right tag and
    /// displacement, in Robin Hood order (tests and invariant checks only; O(capacity) hash computations).
    /// Tags are checked for the indices where `check_tag` holds; for the others `hash_of` need
    /// only be right in its high word (the home bucket).
    pub(crate) fn check(
        &self,
        mut hash_of: impl FnMut(u32) -> u64,
        check_tag: impl Fn(u32) -> bool,
    ) -> Result<(), String> {
        let mut count = 0u32;
        for (pos, &e) in self.entries.iter().enumerate() {
            if e == EMPTY {
                continue;
            }
            count += 1;
            let idx = e & self.idx_mask;
            let h = hash_of(idx);
            if check_tag(idx) && e & self.tag_mask != self.tag(h) {
                return Err(format!("index table entry {idx} has a wrong tag"));
            }
            let home = self.home(h);
            let want = (self.dist(home, pos) as u32).min(DISP_MAX);
            if self.disp(e) != want {
                return Err(format!(
                    "index table entry {idx} has displacement {}, expected {want}",
                    self.disp(e)
                ));
            }
            let prev = self.entries[(pos + self.entries.len() - 1) % self.entries.len()];
            let exact = self.dist(home, pos);
            if prev == EMPTY && exact != 0 {
                return Err(format!(
                    "index table entry {idx} starts a cluster away from home"
                ));
            }
            if prev != EMPTY {
                let prev_pos = (pos + self.entries.len() - 1) % self.entries.len();
                let prev_exact = self.dist(self.home(hash_of(prev & self.idx_mask)), prev_pos);
                if exact > prev_exact + 1 {
                    return Err(format!("index table entry {idx} breaks Robin Hood order"));
                }
            }
            let mut i = home;
            while i != pos {
                if self.entries[i] == EMPTY {
                    return Err(format!("index table entry {idx} unreachable from its home"));
                }
                i = self.next(i);
            }
        }
        if count != self.len {
            return Err(format!(
                "index table holds {count} entries, len says {}",
                self.len
            ));
        }
        Ok(())
    }
}

/// The stop mark of a probe one bucket further (see [`IndexTable::ends_probe`]): the distance
/// in the displacement field, saturated at [`DISP_MAX`].
#[inline]
fn next_stop(stop: u32) -> u32 {
    if stop < DISP_MAX << DISP_SHIFT {
        stop + (1 << DISP_SHIFT)
    } else {
        stop
    }
}

/// A mask of the `n` low bits (`n` <= 32).
fn low_bits(n: u32) -> u32 {
    if n >= 32 {
        u32::MAX
    } else {
        (1u32 << n) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> ChunkKey {
        ChunkKey::new(u128::from(n), 0)
    }

    #[test]
    fn mix_differs_by_group_and_hash() {
        assert_ne!(mix(ChunkKey::new(1, 0)), mix(ChunkKey::new(1, 1)));
        assert_ne!(mix(key(1)), mix(key(2)));
        assert_eq!(mix(key(7)), mix(key(7)));
    }

    #[test]
    fn mix_takes_every_bit_of_the_key() {
        // Flipping any one bit of the 128-bit hash or of the group gives another mix, so keys
        // equal in their low 64 bits do not all share a home bucket.
        let base = ChunkKey::new(0x0123_4567_89AB_CDEF_FEDC_BA98_7654_3210, 3);
        let mut seen = std::collections::BTreeSet::new();
        seen.insert(mix(base));
        for bit in 0..128 {
            let flipped = ChunkKey::new(base.hash ^ (1u128 << bit), base.group);
            assert!(
                seen.insert(mix(flipped)),
                "hash bit {bit} does not feed the mix"
            );
        }
        for bit in 0..32 {
            let flipped = ChunkKey::new(base.hash, base.group ^ (1 << bit));
            assert!(
                seen.insert(mix(flipped)),
                "group bit {bit} does not feed the mix"
            );
        }
    }

    #[test]
    fn insert_find_remove_with_full_clusters() {
        // A tiny table forces long clusters and wrap-around.
        let n = 40u32;
        let hashes: Vec<u64> = (0..n).map(|i| mix(key(u64::from(i)))).collect();
        let mut t = IndexTable::new(n, n as usize + 1);
        for (i, &h) in hashes.iter().enumerate() {
            t.insert(h, i as u32, |j| hashes[j as usize]);
        }
        t.check(|i| hashes[i as usize], |_| true).unwrap();
        for (i, &h) in hashes.iter().enumerate() {
            assert_eq!(t.find(h, |j| j == i as u32), Some(i as u32));
        }
        // Remove every other one, then every lookup must still agree.
        for i in (0..n).step_by(2) {
            assert!(t.remove(hashes[i as usize], i, |j| hashes[j as usize]));
            t.check(|i| hashes[i as usize], |_| true).unwrap();
        }
        assert!(!t.remove(hashes[0], 0, |j| hashes[j as usize]));
        for i in 0..n {
            let found = t.find(hashes[i as usize], |j| j == i);
            assert_eq!(found.is_some(), i % 2 == 1, "index {i}");
        }
        assert_eq!(t.len(), n / 2);
        t.clear();
        assert_eq!(t.len(), 0);
        assert_eq!(t.find(hashes[1], |_| true), None);
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Random inserts and removes at a high load factor agree with a plain vector model,
        /// and the table's own check (tags, displacements, reachability) holds after each step.
        #[test]
        fn table_agrees_with_a_vector(
            capacity_extra in 1usize..8,
            ops in prop::collection::vec((any::<bool>(), 0u32..48), 1..300),
        ) {
            let arena = 48u32;
            // Hashes with few distinct home buckets, to force collisions and long clusters.
            let hashes: Vec<u64> = (0..arena)
                .map(|i| (u64::from(i % 5) << 61) | u64::from(i).wrapping_mul(0x9E37_79B9))
                .collect();
            let mut t = IndexTable::new(arena, arena as usize + capacity_extra);
            let mut present = vec![false; arena as usize];
            for (insert, i) in ops {
                let h = hashes[i as usize];
                if insert && !present[i as usize] {
                    t.insert(h, i, |j| hashes[j as usize]);
                    present[i as usize] = true;
                } else if !insert {
                    let removed = t.remove(h, i, |j| hashes[j as usize]);
                    prop_assert_eq!(removed, present[i as usize]);
                    present[i as usize] = false;
                }
                if let Err(e) = t.check(|j| hashes[j as usize], |_| true) {
                    return Err(TestCaseError::fail(e));
                }
                for j in 0..arena {
                    let found = t.find(hashes[j as usize], |x| x == j);
                    prop_assert_eq!(found.is_some(), present[j as usize]);
                }
            }
        }

        /// Keys that move between two arena indices in place (a slot and its ghost): `replace`
        /// and `insert_or_replace` agree with a model of where each key is, mixed with plain
        /// inserts and removes, and the table's own check holds after each step.
        #[test]
        fn in_place_moves_agree_with_a_model(
            capacity_extra in 1usize..8,
            ops in prop::collection::vec((0u8..4, 0u32..24), 1..300),
        ) {
            // Index k and its twin k + 24 stand for one key: equal hashes, few home buckets.
            let keys = 24u32;
            let hashes: Vec<u64> = (0..2 * keys)
                .map(|i| {
                    let k = i % keys;
                    (u64::from(k % 5) << 61) | u64::from(k).wrapping_mul(0x9E37_79B9)
                })
                .collect();
            let mut t = IndexTable::new(2 * keys, 2 * keys as usize + capacity_extra);
            // Where each key is: None, Some(k) or Some(k + 24).
            let mut at: Vec<Option<u32>> = vec![None; keys as usize];
            for (op, k) in ops {
                let h = hashes[k as usize];
                let twin = k + keys;
                match (op, at[k as usize]) {
                    (0, None) => {
                        t.insert(h, k, |j| hashes[j as usize]);
                        at[k as usize] = Some(k);
                    }
                    (1, Some(i)) => {
                        prop_assert!(t.remove(h, i, |j| hashes[j as usize]));
                        at[k as usize] = None;
                    }
                    (2, Some(i)) => {
                        // Slot to ghost (or back) in place.
                        let other = if i == k { twin } else { k };
                        prop_assert!(t.replace(h, i, other));
                        at[k as usize] = Some(other);
                    }
                    (3, now) => {
                        // Insert index k, taking over the twin's entry if it is there.
                        if now == Some(k) {
                            continue;
                        }
                        let old = t.insert_or_replace(h, k, |j| j == twin, |j| hashes[j as usize]);
                        prop_assert_eq!(old, now);
                        at[k as usize] = Some(k);
                    }
                    _ => continue,
                }
                if let Err(e) = t.check(|j| hashes[j as usize], |_| true) {
                    return Err(TestCaseError::fail(e));
                }
                for k in 0..keys {
                    let h = hashes[k as usize];
                    let found = t.find(h, |x| x == k || x == k + keys);
                    prop_assert_eq!(found, at[k as usize]);
                    let either = t.find_either(h, |x| x == k, |x| x == k + keys);
                    prop_assert_eq!(either, at[k as usize]);
                }
            }
        }
    }
}
