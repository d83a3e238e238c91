//! Least-recently-used eviction: one recency list over the present slots, most recent at the head.
//! New chunks enter at the head; `touch` moves a chunk to the head; victims are taken from the
//! tail, skipping chunks that are not evictable (pinned, being written, or named by the call).

use super::list::{List, NIL};
use super::{Slot, VictimCursor, LIST_FREE, LIST_MAIN};

/// The LRU policy's state: the recency list (links live in the slots).
#[derive(Clone, Debug, Default)]
pub(super) struct Lru {
    list: List,
}

impl Lru {
    /// Puts the newly reserved slot `s` at the most recent end.
    #[inline]
    pub(super) fn insert(&mut self, slots: &mut [Slot], s: u32) {
        debug_assert_eq!(slots[s as usize].list, LIST_FREE);
        slots[s as usize].list = LIST_MAIN;
        self.list.push_front(slots, s);
    }

    /// Takes slot `s` off the list (failed store or eviction).
    #[inline]
    pub(super) fn remove(&mut self, slots: &mut [Slot], s: u32) {
        debug_assert_eq!(slots[s as usize].list, LIST_MAIN);
        self.list.unlink(slots, s);
        slots[s as usize].list = LIST_FREE;
    }

    /// Marks slot `s` most recently used.
    #[inline]
    pub(super) fn touch(&mut self, slots: &mut [Slot], s: u32) {
        debug_assert_eq!(slots[s as usize].list, LIST_MAIN);
        self.list.move_to_front(slots, s);
    }

    /// Where a victim search starts: the least recent slot.
    pub(super) fn victim_cursor(&self) -> VictimCursor {
        VictimCursor {
            first: self.list.tail,
            second: NIL,
        }
    }

    /// The least recent evictable slot at or after the cursor (toward the head); the cursor
    /// moves past it, so evicting the returned slot keeps the cursor valid.
    #[inline]
    pub(super) fn next_victim(&self, slots: &[Slot], cursor: &mut VictimCursor) -> Option<u32> {
        while cursor.first != NIL {
            let i = cursor.first;
            let slot = &slots[i as usize];
            cursor.first = slot.link.prev;
            if slot.evictable() {
                return Some(i);
            }
        }
        None
    }

    /// Forgets every slot (the pool rebuilds the slot links).
    pub(super) fn clear(&mut self) {
        self.list = List::EMPTY;
    }

    /// Present slots in recency order, most recent first (checks the links).
    pub(super) fn order(&self, slots: &[Slot]) -> Result<Vec<u32>, String> {
        let order = self.list.collect(slots)?;
        if let Some(&bad) = order.iter().find(|&&s| slots[s as usize].list != LIST_MAIN) {
            return Err(format!("slot {bad} on the LRU list has list tag != main"));
        }
        Ok(order)
    }
}
