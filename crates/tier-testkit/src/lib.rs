//! Test kit for tiers: [`VecSlotMemory`] (a host pool over plain heap memory), [`FakeTier`] (an
//! in-memory tier with injectable delays and faults), and the [`conformance`] suite that every
//! tier crate runs against itself through [`tier_conformance_tests!`].

#![forbid(unsafe_code)]

pub mod conformance;
pub mod fake;
pub mod memory;

pub use fake::{checksum, FakeTier, FakeTierConfig, FakeTierStats, FaultPlan};
pub use memory::{fill_slot, first_mismatch, pattern, read_slot_vec, VecSlotMemory};
