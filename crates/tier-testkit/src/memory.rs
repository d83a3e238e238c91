//! [`VecSlotMemory`], a host pool over plain heap memory for tests, and helpers that fill slots
//! with deterministic bytes from a seed and compare them back, on any [`SlotMemory`].

use std::sync::{Mutex, PoisonError};

use offload_core::tier::SlotMemory;
use offload_core::SlotId;

/// A [`SlotMemory`] over ordinary heap memory: one `Mutex<Box<[u8]>>` per slot, safe code only.
///
/// It has no stable address for zero-copy I/O ([`SlotMemory::slot_ptr`] answers `None`), so tiers
/// run against it exercise their copying path.
#[derive(Debug)]
pub struct VecSlotMemory {
    slot_bytes: usize,
    slots: Vec<Mutex<Box<[u8]>>>,
}

impl VecSlotMemory {
    /// `slot_count` zeroed slots of `slot_bytes` bytes each.
    pub fn new(slot_count: u32, slot_bytes: usize) -> Self {
        let slots = (0..slot_count)
            .map(|_| Mutex::new(vec![0u8; slot_bytes].into_boxed_slice()))
            .collect();
        Self { slot_bytes, slots }
    }

    /// Writes the first `len` bytes of `slot` with [`pattern`]`(seed, len)`.
    pub fn fill(&self, slot: SlotId, len: usize, seed: u64) {
        fill_slot(self, slot, len, seed);
    }

    /// Whether the first `len` bytes of `slot` equal [`pattern`]`(seed, len)`.
    pub fn matches(&self, slot: SlotId, len: usize, seed: u64) -> bool {
        first_mismatch(self, slot, len, seed).is_none()
    }

    /// A copy of the whole slot.
    pub fn contents(&self, slot: SlotId) -> Vec<u8> {
        read_slot_vec(self, slot, self.slot_bytes)
    }

    fn slot(&self, slot: SlotId) -> &Mutex<Box<[u8]>> {
        match self.slots.get(slot.0 as usize) {
            Some(row) => row,
            None => panic!(
                "VecSlotMemory: slot {} out of range (slot_count {})",
                slot.0,
                self.slots.len()
            ),
        }
    }
}

/// Panics with a clear message unless `offset..offset + len` lies inside a slot of `slot_bytes`.
fn check_range(slot: SlotId, offset: usize, len: usize, slot_bytes: usize) {
    let end = offset.checked_add(len);
    if end.is_none_or(|end| end > slot_bytes) {
        panic!(
            "VecSlotMemory: range {offset}+{len} outside slot {} of {slot_bytes} bytes",
            slot.0
        );
    }
}

impl SlotMemory for VecSlotMemory {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        // The constructor took a u32, so the length always fits.
        u32::try_from(self.slots.len()).unwrap_or(u32::MAX)
    }

    fn read_slot(&self, slot: SlotId, offset: usize, dst: &mut [u8]) {
        check_range(slot, offset, dst.len(), self.slot_bytes);
        let row = self
            .slot(slot)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        dst.copy_from_slice(&row[offset..offset + dst.len()]);
    }

    fn write_slot(&self, slot: SlotId, offset: usize, src: &[u8]) {
        check_range(slot, offset, src.len(), self.slot_bytes);
        let mut row = self
            .slot(slot)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        row[offset..offset + src.len()].copy_from_slice(src);
    }
}

/// The next value of a splitmix64 stream (a small, well-mixed, deterministic generator).
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `len` deterministic bytes derived from `seed`; different seeds give different bytes.
///
/// A prefix of `pattern(seed, n)` equals `pattern(seed, m)` for `m < n`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes [`pattern`]`(seed, len)` into the first `len` bytes of `slot`.
pub fn fill_slot(memory: &dyn SlotMemory, slot: SlotId, len: usize, seed: u64) {
    memory.write_slot(slot, 0, &pattern(seed, len));
}

/// Copies the first `len` bytes of `slot` out.
pub fn read_slot_vec(memory: &dyn SlotMemory, slot: SlotId, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    memory.read_slot(slot, 0, &mut out);
    out
}

/// The first index at which the first `len` bytes of `slot` differ from [`pattern`]`(seed, len)`,
/// or `None` when they are equal.
pub fn first_mismatch(
    memory: &dyn SlotMemory,
    slot: SlotId,
    len: usize,
    seed: u64,
) -> Option<usize> {
    let actual = read_slot_vec(memory, slot, len);
    let expected = pattern(seed, len);
    actual.iter().zip(&expected).position(|(a, e)| a != e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_deterministic_and_seed_dependent() {
        assert_eq!(pattern(7, 100), pattern(7, 100));
        assert_ne!(pattern(7, 100), pattern(8, 100));
        assert_eq!(pattern(7, 13)[..], pattern(7, 100)[..13]);
        assert_eq!(pattern(0, 0).len(), 0);
        assert!(pattern(0, 64).iter().any(|&b| b != 0));
    }

    #[test]
    fn fill_then_matches() {
        let memory = VecSlotMemory::new(3, 64);
        assert_eq!(memory.slot_count(), 3);
        assert_eq!(memory.slot_bytes(), 64);
        memory.fill(SlotId(1), 40, 5);
        assert!(memory.matches(SlotId(1), 40, 5));
        assert!(!memory.matches(SlotId(1), 40, 6));
        assert!(!memory.matches(SlotId(0), 40, 5));
        assert_eq!(memory.contents(SlotId(1))[40..], [0u8; 24]);
        memory.write_slot(SlotId(1), 10, &[0xAA]);
        assert_eq!(first_mismatch(&memory, SlotId(1), 40, 5), Some(10));
    }

    #[test]
    fn offsets_read_and_write_inside_the_slot() {
        let memory = VecSlotMemory::new(1, 16);
        memory.write_slot(SlotId(0), 12, &[1, 2, 3, 4]);
        let mut dst = [0u8; 4];
        memory.read_slot(SlotId(0), 12, &mut dst);
        assert_eq!(dst, [1, 2, 3, 4]);
    }

    #[test]
    fn out_of_range_access_panics_with_a_message() {
        let memory = VecSlotMemory::new(1, 16);
        let outside = std::panic::catch_unwind(|| memory.write_slot(SlotId(0), 10, &[0u8; 7]));
        assert!(outside.is_err(), "a write past the slot end must panic");
        let no_slot = std::panic::catch_unwind(|| memory.read_slot(SlotId(1), 0, &mut [0u8; 1]));
        assert!(no_slot.is_err(), "a read of a missing slot must panic");
    }
}
