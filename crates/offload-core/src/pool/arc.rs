//! Adaptive replacement cache (ARC) eviction, after vLLM's ARC offloading manager.
//!
//! Present chunks are on T1 (seen once: stored but not touched since) or T2 (touched at least
//! once). Evicted chunks leave a ghost on B1 or B2: a fingerprint of the key (the high word of its
//! mixed hash, kept in the ghost, plus the table's tag bits; a false ghost hit only nudges the
//! target). The target size `p` of T1 adapts: touching a key whose ghost is on B1 grows it by
//! max(1, |B2|/|B1|), touching one on B2 shrinks it by max(1, |B1|/|B2|), within [0, slot_count].
//!
//! - insert: new chunks go to the head of T1; their ghost, if any, is dropped.
//! - touch (walked in reverse by the pool): T1 -> head of T2; T2 -> head of T2; ghost -> adapt p.
//!   Lookups and loads are not accesses.
//! - evict: from T1 when T1 is not empty and (T2 is empty or |T1| >= p), else from T2; within the
//!   list, the least recent evictable chunk. Unlike vLLM, which fails when the chosen list holds
//!   no evictable chunk, we then take one from the other list (the pool checked beforehand that
//!   enough evictable chunks exist, so selection never fails half-way).
//! - ghosts: |B1| + |B2| <= slot_count. When a new ghost would exceed that, the least recent
//!   ghost of B1 is dropped if |T1| + |B1| >= slot_count (the classic ARC bound on L1) or B2 is
//!   empty, else the least recent ghost of B2. (vLLM bounds each ghost list by the capacity
//!   separately; one shared bound halves the memory.)
//! - a failed store leaves no ghost.
//!
//! Ghosts live in the pool's key table beside the present keys: index `i < slot_count` names slot
//! `i`, index `slot_count + g` names ghost `g` (see [`GhostTable`]). So one probe of a touched key
//! finds its slot or its ghost, an eviction turns the key's table entry into its ghost's in place,
//! and storing a key again turns its ghost's entry back into the slot's, with nothing moved.

use super::list::{Link, Linked, List, NIL};
use super::table::{mix, IndexTable};
use super::{Slot, VictimCursor, LIST_FREE, LIST_MAIN, LIST_T2};

/// T1 is the pool's main list tag.
const LIST_T1: u8 = LIST_MAIN;

// The memory budget (design.md section 7) counts on this size.
const _: () = assert!(std::mem::size_of::<Ghost>() == 12);

/// A ghost: the high word of a recently evicted key's mixed hash (whose bit 0 is always 0, see
/// [`mix`]), with bit 0 saying which ghost list it is on (0: B1, 1: B2). 12 bytes.
#[derive(Clone, Copy, Debug)]
struct Ghost {
    fp: u32,
    link: Link,
}

impl Linked for Ghost {
    #[inline]
    fn link(&self) -> Link {
        self.link
    }
    #[inline]
    fn link_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

/// The fingerprint a ghost of the key with mixed hash `h` keeps (list flag clear).
#[inline]
fn ghost_fp(h: u64) -> u32 {
    (h >> 32) as u32
}

/// The hash rebuilt from a stored ghost: the high word exactly (enough for the table's home
/// bucket); the low word is not kept.
#[inline]
fn ghost_hash_of(g: &Ghost) -> u64 {
    u64::from(g.fp & !1) << 32
}

/// How the pool's key table indexes ghosts: after the slots.
#[derive(Clone, Copy, Debug)]
pub(super) struct GhostTable {
    /// The first table index that names a ghost (the slot count).
    pub(super) base: u32,
}

impl GhostTable {
    /// Whether table index `i` names a ghost.
    #[inline]
    pub(super) fn is_ghost(self, i: u32) -> bool {
        i >= self.base
    }
}

/// The ARC policy's state.
#[derive(Clone, Debug)]
pub(super) struct Arc {
    t1: List,
    t2: List,
    b1: List,
    b2: List,
    /// Target size of T1, in [0, capacity].
    target: u32,
    capacity: u32,
    ghosts: Vec<Ghost>,
    /// Head of the stack of unused ghost entries, linked through `link.next`.
    ghost_free: u32,
}

impl Arc {
    /// A policy for a pool of `capacity` slots (at most `capacity` ghosts).
    pub(super) fn new(capacity: u32) -> Self {
        let mut arc = Self {
            t1: List::EMPTY,
            t2: List::EMPTY,
            b1: List::EMPTY,
            b2: List::EMPTY,
            target: 0,
            capacity,
            ghosts: vec![
                Ghost {
                    fp: 0,
                    link: Link::UNLINKED,
                };
                capacity as usize
            ],
            ghost_free: NIL,
        };
        arc.clear();
        arc
    }

    /// Where ghosts sit in the key table.
    #[inline]
    pub(super) fn ghost_table(&self) -> GhostTable {
        GhostTable {
            base: self.capacity,
        }
    }

    /// The hash of table index `i`, a slot or a ghost (exact in the high word, which is all the
    /// table needs to rebuild a home bucket).
    #[inline]
    pub(super) fn hash_at(&self, slots: &[Slot], i: u32) -> u64 {
        if i < self.capacity {
            mix(slots[i as usize].key())
        } else {
            ghost_hash_of(&self.ghosts[(i - self.capacity) as usize])
        }
    }

    /// Whether table index `i` is a ghost with the fingerprint of the key with mixed hash `h`.
    #[inline]
    pub(super) fn is_ghost_of(&self, i: u32, h: u64) -> bool {
        i >= self.capacity && self.ghosts[(i - self.capacity) as usize].fp & !1 == ghost_fp(h)
    }

    /// The adaptive target size of T1.
    pub(super) fn target(&self) -> u32 {
        self.target
    }

    /// Sizes of T1, T2, B1, B2.
    pub(super) fn list_lens(&self) -> [u32; 4] {
        [self.t1.len, self.t2.len, self.b1.len, self.b2.len]
    }

    /// Puts the newly reserved slot `s` (key hash `h`) at the head of T1 and into the key table;
    /// a ghost of the key gives up its table entry to the slot.
    #[inline]
    pub(super) fn insert(&mut self, slots: &mut [Slot], map: &mut IndexTable, s: u32, h: u64) {
        debug_assert_eq!(slots[s as usize].list, LIST_FREE);
        slots[s as usize].list = LIST_T1;
        self.t1.push_front(slots, s);
        let this = &*self;
        let slots_ro = &*slots;
        let old = map.insert_or_replace(
            h,
            s,
            |i| this.is_ghost_of(i, h),
            |i| this.hash_at(slots_ro, i),
        );
        if let Some(i) = old {
            self.free_ghost(i - self.capacity);
        }
    }

    /// Takes slot `s` off its list (failed store: no ghost).
    #[inline]
    pub(super) fn remove(&mut self, slots: &mut [Slot], s: u32) {
        match slots[s as usize].list {
            LIST_T1 => self.t1.unlink(slots, s),
            LIST_T2 => self.t2.unlink(slots, s),
            other => unreachable!("slot {s} on no ARC list (tag {other})"),
        }
        slots[s as usize].list = LIST_FREE;
    }

    /// An access to present slot `s`: T1 -> head of T2, T2 -> head of T2.
    #[inline]
    pub(super) fn touch(&mut self, slots: &mut [Slot], s: u32) {
        match slots[s as usize].list {
            LIST_T1 => {
                self.t1.unlink(slots, s);
                slots[s as usize].list = LIST_T2;
                self.t2.push_front(slots, s);
            }
            LIST_T2 => self.t2.move_to_front(slots, s),
            other => unreachable!("slot {s} on no ARC list (tag {other})"),
        }
    }

    /// An access to a key whose ghost has table index `i`: adapts the target.
    #[inline]
    pub(super) fn ghost_hit(&mut self, i: u32) {
        let g = i - self.capacity;
        let (b1, b2) = (self.b1.len, self.b2.len);
        if self.ghosts[g as usize].fp & 1 == 0 {
            let delta = b2.checked_div(b1).map_or(1, |d| d.max(1));
            self.target = self.target.saturating_add(delta).min(self.capacity);
        } else {
            let delta = b1.checked_div(b2).map_or(1, |d| d.max(1));
            self.target = self.target.saturating_sub(delta);
        }
    }

    /// Where a victim search starts: the least recent slots of T1 and T2.
    pub(super) fn victim_cursor(&self) -> VictimCursor {
        VictimCursor {
            first: self.t1.tail,
            second: self.t2.tail,
        }
    }

    /// The next victim: from T1 when T1 is not empty and (T2 is empty or |T1| >= p), else from
    /// T2, falling back to the other list; the least recent evictable slot at or after that
    /// list's cursor. The cursors move past it, so evicting it keeps them valid.
    #[inline]
    pub(super) fn next_victim(&self, slots: &[Slot], cursor: &mut VictimCursor) -> Option<u32> {
        let (t1_len, t2_len) = (self.t1.len, self.t2.len);
        let from_t1 = t1_len > 0 && (t2_len == 0 || t1_len >= self.target);
        if from_t1 {
            next_evictable(slots, &mut cursor.first)
                .or_else(|| next_evictable(slots, &mut cursor.second))
        } else {
            next_evictable(slots, &mut cursor.second)
                .or_else(|| next_evictable(slots, &mut cursor.first))
        }
    }

    /// Evicts slot `s` (key hash `h`): off T1/T2, and a ghost onto B1/B2 that takes over the
    /// key's table entry in place. When the ghosts are at their bound, the dropped ghost's arena
    /// entry is reused for the new one (the free stack would hand it straight back).
    #[inline]
    pub(super) fn evict(&mut self, slots: &mut [Slot], map: &mut IndexTable, s: u32, h: u64) {
        let to_b2 = match slots[s as usize].list {
            LIST_T1 => {
                self.t1.unlink(slots, s);
                false
            }
            LIST_T2 => {
                self.t2.unlink(slots, s);
                true
            }
            other => unreachable!("slot {s} on no ARC list (tag {other})"),
        };
        slots[s as usize].list = LIST_FREE;
        let (b1_len, b2_len) = (self.b1.len, self.b2.len);
        let g = if b1_len + b2_len >= self.capacity {
            let from_b1 = b1_len > 0 && (self.t1.len + b1_len >= self.capacity || b2_len == 0);
            // The dropped ghost's entry becomes the new ghost: when both are on one list, its
            // least recent entry moves to the front in one step.
            let g = match (from_b1, to_b2) {
                (true, false) => self.b1.rotate_tail_to_front(&mut self.ghosts),
                (false, true) => self.b2.rotate_tail_to_front(&mut self.ghosts),
                (true, true) => {
                    let g = self.b1.tail;
                    self.b1.unlink(&mut self.ghosts, g);
                    self.b2.push_front(&mut self.ghosts, g);
                    g
                }
                (false, false) => {
                    let g = self.b2.tail;
                    self.b2.unlink(&mut self.ghosts, g);
                    self.b1.push_front(&mut self.ghosts, g);
                    g
                }
            };
            debug_assert_ne!(g, NIL);
            let this = &*self;
            let slots_ro = &*slots;
            let found = map.remove(
                ghost_hash_of(&self.ghosts[g as usize]),
                self.capacity + g,
                |i| this.hash_at(slots_ro, i),
            );
            debug_assert!(found, "ghost {g} missing from the key table");
            g
        } else {
            let g = self.ghost_free;
            debug_assert_ne!(g, NIL, "ghost arena exhausted");
            self.ghost_free = self.ghosts[g as usize].link.next;
            self.ghosts[g as usize].link = Link::UNLINKED;
            if to_b2 {
                self.b2.push_front(&mut self.ghosts, g);
            } else {
                self.b1.push_front(&mut self.ghosts, g);
            }
            g
        };
        self.ghosts[g as usize].fp = ghost_fp(h) | u32::from(to_b2);
        let found = map.replace(h, s, self.capacity + g);
        debug_assert!(found, "slot {s} missing from the key table");
    }

    /// Takes ghost `g`, whose table entry is gone or taken over, off its list and onto the free
    /// stack.
    #[inline]
    fn free_ghost(&mut self, g: u32) {
        if self.ghosts[g as usize].fp & 1 == 0 {
            self.b1.unlink(&mut self.ghosts, g);
        } else {
            self.b2.unlink(&mut self.ghosts, g);
        }
        self.ghosts[g as usize].link.next = self.ghost_free;
        self.ghost_free = g;
    }

    /// Forgets every slot and ghost; the target goes back to 0.
    pub(super) fn clear(&mut self) {
        self.t1 = List::EMPTY;
        self.t2 = List::EMPTY;
        self.b1 = List::EMPTY;
        self.b2 = List::EMPTY;
        self.target = 0;
        let n = self.ghosts.len() as u32;
        for (i, g) in self.ghosts.iter_mut().enumerate() {
            let next = i as u32 + 1;
            *g = Ghost {
                fp: 0,
                link: Link {
                    prev: NIL,
                    next: if next == n { NIL } else { next },
                },
            };
        }
        self.ghost_free = if n == 0 { NIL } else { 0 };
    }

    /// Bytes of memory held (the ghost arena; ghost entries of the key table and slot links are
    /// counted by the pool).
    pub(super) fn bytes(&self) -> usize {
        self.ghosts.capacity() * std::mem::size_of::<Ghost>()
    }

    /// Whether the key with hash `h` has a ghost, and on which list (false: B1, true: B2).
    pub(super) fn ghost_list_of(&self, map: &IndexTable, h: u64) -> Option<bool> {
        map.find(h, |i| self.is_ghost_of(i, h))
            .map(|i| self.ghosts[(i - self.capacity) as usize].fp & 1 == 1)
    }

    /// Number of ghosts (B1 and B2).
    pub(super) fn ghost_count(&self) -> u32 {
        self.b1.len + self.b2.len
    }

    /// T1 and T2 in recency order, most recent first; checks links, tags, ghost bookkeeping.
    pub(super) fn order(
        &self,
        slots: &[Slot],
        map: &IndexTable,
    ) -> Result<(Vec<u32>, Vec<u32>), String> {
        let t1 = self.t1.collect(slots)?;
        let t2 = self.t2.collect(slots)?;
        if let Some(&bad) = t1.iter().find(|&&s| slots[s as usize].list != LIST_T1) {
            return Err(format!("slot {bad} on T1 has a wrong list tag"));
        }
        if let Some(&bad) = t2.iter().find(|&&s| slots[s as usize].list != LIST_T2) {
            return Err(format!("slot {bad} on T2 has a wrong list tag"));
        }
        let b1 = self.b1.collect(&self.ghosts)?;
        let b2 = self.b2.collect(&self.ghosts)?;
        if b1.iter().any(|&g| self.ghosts[g as usize].fp & 1 != 0)
            || b2.iter().any(|&g| self.ghosts[g as usize].fp & 1 != 1)
        {
            return Err("ghost list tag mismatch".into());
        }
        if self.b1.len + self.b2.len > self.capacity {
            return Err("more ghosts than slots".into());
        }
        if self.target > self.capacity {
            return Err(format!("ARC target {} > capacity", self.target));
        }
        for g in b1.iter().chain(&b2) {
            if !map.contains(ghost_hash_of(&self.ghosts[*g as usize]), self.capacity + g) {
                return Err(format!("ghost {g} missing from the key table"));
            }
        }
        Ok((t1, t2))
    }
}

/// Walks `cursor` toward the head until an evictable slot; returns it and leaves the cursor on
/// the slot after it.
#[inline]
fn next_evictable(slots: &[Slot], cursor: &mut u32) -> Option<u32> {
    while *cursor != NIL {
        let i = *cursor;
        let slot = &slots[i as usize];
        *cursor = slot.link.prev;
        if slot.evictable() {
            return Some(i);
        }
    }
    None
}
