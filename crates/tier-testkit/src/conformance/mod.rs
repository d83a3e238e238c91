//! The `Tier` conformance suite, written once against the trait: every tier crate (and the fake)
//! runs it against itself, through [`tier_conformance_tests!`](crate::tier_conformance_tests)
//! (one `#[test]` per case) or [`run_all`].
//!
//! Each case builds a fresh host pool (by [`SuiteConfig::new_memory`]) and a fresh tier over it,
//! drives the tier only through [`Tier`], polls with a deadline, and panics with a message naming
//! the case and the tier on the first broken promise. Every case keeps a ledger of accepted jobs:
//! a completion that is missing, repeated, or for a job never accepted fails it. Every case ends
//! by shutting the tier down. `drain` and `shutdown` run on a helper thread so that one that
//! blocks forever fails the case instead of hanging it (so tiers must work when moved between
//! threads, as `Tier: Send` promises).

mod harness;

use std::sync::Arc;
use std::time::Duration;

use offload_core::tier::{
    FailedKey, SlotMemory, SubmitError, Tier, TierChunk, TierFailure, TierJob, TierLookup, TierOp,
};
use offload_core::{ChunkKey, RequestId, SlotId};

use crate::memory::VecSlotMemory;
use harness::Harness;

/// What the suite calls to build the tier under test over the host pool it made.
pub type MakeTier<'a> = dyn FnMut(Arc<dyn SlotMemory>) -> Box<dyn Tier> + 'a;

/// Sizes and limits of a suite run.
#[derive(Clone, Copy, Debug)]
pub struct SuiteConfig {
    /// Slots in the host pool; at least 24.
    pub slot_count: u32,
    /// Bytes per slot; at least 16. Partial chunks use lengths such as 1 and `slot_bytes - 1`.
    pub slot_bytes: usize,
    /// How long any one wait (a completion, a settled lookup, a drain) may take.
    pub deadline: Duration,
    /// Builds the host pool for each case (a [`VecSlotMemory`] by default; a tier that needs its
    /// own memory, such as a pinned one, passes its constructor).
    pub new_memory: fn(u32, usize) -> Arc<dyn SlotMemory>,
}

/// The default host pool: a [`VecSlotMemory`].
pub fn vec_memory(slot_count: u32, slot_bytes: usize) -> Arc<dyn SlotMemory> {
    Arc::new(VecSlotMemory::new(slot_count, slot_bytes))
}

impl Default for SuiteConfig {
    fn default() -> Self {
        Self {
            slot_count: 32,
            slot_bytes: 16 * 1024,
            deadline: Duration::from_secs(10),
            new_memory: vec_memory,
        }
    }
}

impl SuiteConfig {
    /// Panics unless the sizes are large enough for every case.
    fn check(&self) {
        assert!(
            self.slot_count >= 24,
            "SuiteConfig: slot_count {} < 24",
            self.slot_count
        );
        assert!(
            self.slot_bytes >= 16,
            "SuiteConfig: slot_bytes {} < 16",
            self.slot_bytes
        );
        assert!(
            u32::try_from(self.slot_bytes).is_ok(),
            "SuiteConfig: slot_bytes {} does not fit a chunk length (u32)",
            self.slot_bytes
        );
    }
}

/// One named case of the suite.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// The case's name, also its function's name in this module.
    pub name: &'static str,
    /// Runs the case; panics with a clear message if the tier breaks the contract.
    pub run: fn(&SuiteConfig, &mut MakeTier<'_>),
}

/// Every case of the suite, in a stable order.
pub const CASES: &[Case] = &[
    Case {
        name: "store_load_round_trip",
        run: store_load_round_trip,
    },
    Case {
        name: "lookup_hit_after_store_miss_when_absent",
        run: lookup_hit_after_store_miss_when_absent,
    },
    Case {
        name: "every_accepted_job_completes_once",
        run: every_accepted_job_completes_once,
    },
    Case {
        name: "refused_submit_has_no_effect",
        run: refused_submit_has_no_effect,
    },
    Case {
        name: "load_of_missing_key_fails_only_that_key",
        run: load_of_missing_key_fails_only_that_key,
    },
    Case {
        name: "cancel_still_completes_once",
        run: cancel_still_completes_once,
    },
    Case {
        name: "drain_completes_every_job",
        run: drain_completes_every_job,
    },
    Case {
        name: "shutdown_refuses_submit_and_returns_pending",
        run: shutdown_refuses_submit_and_returns_pending,
    },
    Case {
        name: "touch_and_request_finished_are_harmless",
        run: touch_and_request_finished_are_harmless,
    },
    Case {
        name: "many_jobs_in_flight",
        run: many_jobs_in_flight,
    },
    Case {
        name: "repeated_store_of_a_key_is_harmless",
        run: repeated_store_of_a_key_is_harmless,
    },
    Case {
        name: "keys_equal_in_low_64_bits_are_distinct",
        run: keys_equal_in_low_64_bits_are_distinct,
    },
];

/// Runs every case with the default [`SuiteConfig`], each on a fresh tier from `make`.
pub fn run_all<F>(make: F)
where
    F: FnMut(Arc<dyn SlotMemory>) -> Box<dyn Tier>,
{
    run_all_with(&SuiteConfig::default(), make);
}

/// Runs every case with `config`, each on a fresh tier from `make`.
pub fn run_all_with<F>(config: &SuiteConfig, mut make: F)
where
    F: FnMut(Arc<dyn SlotMemory>) -> Box<dyn Tier>,
{
    for case in CASES {
        (case.run)(config, &mut make);
    }
}

/// Runs one case; the entry point of [`tier_conformance_tests!`](crate::tier_conformance_tests).
/// Generic over `make` so that a closure passed here gets its argument and return types inferred.
pub fn run_case<F>(case: fn(&SuiteConfig, &mut MakeTier<'_>), config: &SuiteConfig, mut make: F)
where
    F: FnMut(Arc<dyn SlotMemory>) -> Box<dyn Tier>,
{
    case(config, &mut make);
}

/// Chunk lengths every data case uses: a full slot and partial chunks down to one byte.
fn lengths(slot_bytes: usize) -> [u32; 4] {
    let full = u32::try_from(slot_bytes).unwrap_or(u32::MAX);
    [full, full - 1, full / 2 + 1, 1]
}

/// The seed of the bytes stored under key index `index`.
fn seed_of(index: u64) -> u64 {
    0x5EED_0000 + index
}

/// Fills `slot` with key `index`'s bytes and returns its chunk entry.
fn prepared(h: &Harness, index: u64, slot: u32, len: u32) -> TierChunk {
    h.fill(SlotId(slot), len, seed_of(index));
    TierChunk::new(h.key(index), SlotId(slot), len)
}

/// Stores keys `(index, slot, len)` in one job and fails unless it succeeds.
fn store_ok(h: &mut Harness, entries: &[(u64, u32, u32)], what: &str) {
    let chunks = entries
        .iter()
        .map(|&(i, slot, len)| prepared(h, i, slot, len))
        .collect();
    let job = h.job(TierOp::Store, chunks);
    let id = h.submit(&job);
    h.wait_success(id, what);
}

/// Scrambles each destination slot, loads keys `(index, slot, len)` in one job, fails unless it
/// succeeds, and checks every slot's bytes.
fn load_ok(h: &mut Harness, entries: &[(u64, u32, u32)], what: &str) {
    let slot_bytes = h.slot_bytes() as u32;
    for &(_, slot, _) in entries {
        h.fill(SlotId(slot), slot_bytes, 0xBAD0_0000 + u64::from(slot));
    }
    let chunks = entries
        .iter()
        .map(|&(i, slot, len)| TierChunk::new(h.key(i), SlotId(slot), len))
        .collect();
    let job = h.job(TierOp::Load, chunks);
    let id = h.submit(&job);
    h.wait_success(id, what);
    for &(i, slot, len) in entries {
        h.expect_slot(SlotId(slot), len, seed_of(i), what);
    }
}

/// Store then load is byte-identical, for full and partial chunks, in multi-chunk jobs, loaded
/// into other slots than they were stored from.
pub fn store_load_round_trip(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("store_load_round_trip", config, make);
    let lens = lengths(h.slot_bytes());
    let entries: Vec<(u64, u32, u32)> = (0..8u32)
        .map(|i| (u64::from(i), i, lens[i as usize % 4]))
        .collect();
    store_ok(&mut h, &entries[..4], "store of the first four chunks");
    store_ok(&mut h, &entries[4..], "store of the last four chunks");
    let moved: Vec<(u64, u32, u32)> = entries
        .iter()
        .map(|&(i, slot, len)| (i, slot + 8, len))
        .collect();
    load_ok(
        &mut h,
        &moved,
        "load of eight stored chunks into other slots",
    );
    let back: Vec<(u64, u32, u32)> = entries.iter().rev().copied().collect();
    load_ok(
        &mut h,
        &back,
        "second load of the chunks into their own slots",
    );
    h.finish();
}

/// Lookup answers `Hit` for stored keys and `Miss` for keys never stored (`Retry` is polled
/// until it settles, within the deadline).
pub fn lookup_hit_after_store_miss_when_absent(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("lookup_hit_after_store_miss_when_absent", config, make);
    let lens = lengths(h.slot_bytes());
    let first = h.key(0);
    h.expect_lookup(first, TierLookup::Miss, "before any store");
    store_ok(
        &mut h,
        &[(0, 0, lens[0]), (1, 1, lens[1]), (2, 2, lens[3])],
        "store of three chunks",
    );
    for index in 0..3 {
        let key = h.key(index);
        h.expect_lookup(key, TierLookup::Hit, "stored");
    }
    for index in 100..104 {
        let key = h.key(index);
        h.expect_lookup(key, TierLookup::Miss, "never stored");
    }
    h.finish();
}

/// Many stores and loads (some of missing keys) submitted together each complete exactly once.
pub fn every_accepted_job_completes_once(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("every_accepted_job_completes_once", config, make);
    let lens = lengths(h.slot_bytes());
    for index in 0..8u32 {
        let chunk = prepared(&h, u64::from(index), index, lens[index as usize % 4]);
        let job = h.job(TierOp::Store, vec![chunk]);
        h.submit(&job);
    }
    let pair = vec![prepared(&h, 8, 8, lens[0]), prepared(&h, 9, 9, lens[2])];
    let job = h.job(TierOp::Store, pair);
    h.submit(&job);
    h.wait_all();
    // Loads of stored and never-stored keys, each into its own slot, all in flight together.
    for index in 0..6u32 {
        let key_index = if index % 2 == 0 {
            u64::from(index)
        } else {
            200 + u64::from(index)
        };
        let chunk = TierChunk::new(
            h.key(key_index),
            SlotId(16 + index),
            lens[index as usize % 4],
        );
        let job = h.job(TierOp::Load, vec![chunk]);
        h.submit(&job);
    }
    h.wait_all();
    h.settle();
    h.finish();
}

/// A refused submit (slot out of range, length over the slot, duplicate in-flight id) answers
/// `Invalid`, never completes, and stores nothing.
pub fn refused_submit_has_no_effect(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("refused_submit_has_no_effect", config, make);
    let slot_bytes = h.slot_bytes() as u32;
    let outside = h.slot_count();
    let refused = [
        vec![
            prepared(&h, 0, 0, slot_bytes),
            TierChunk::new(h.key(1), SlotId(outside), slot_bytes),
        ],
        vec![TierChunk::new(h.key(2), SlotId(1), slot_bytes + 1)],
    ];
    for chunks in refused {
        let job = h.job(TierOp::Store, chunks);
        match h.try_submit(&job) {
            Err(SubmitError::Invalid(_)) => {}
            other => h.fail(format!(
                "malformed job {:?} answered {other:?}, expected Invalid",
                job.chunks
            )),
        }
    }
    let valid = h.job(TierOp::Store, vec![prepared(&h, 3, 2, slot_bytes)]);
    h.submit(&valid);
    let duplicate = TierJob {
        id: valid.id,
        request: None,
        op: TierOp::Store,
        chunks: vec![prepared(&h, 4, 3, slot_bytes)],
    };
    match h.try_submit(&duplicate) {
        Err(SubmitError::Invalid(_)) => {}
        other => h.fail(format!(
            "job reusing in-flight id {} answered {other:?}, expected Invalid (validity is checked before capacity)",
            valid.id.0
        )),
    }
    h.wait_success(valid.id, "store of the valid job");
    h.settle();
    for index in [0, 1, 2, 4] {
        let key = h.key(index);
        h.expect_lookup(key, TierLookup::Miss, "named only by a refused job");
    }
    let stored = h.key(3);
    h.expect_lookup(stored, TierLookup::Hit, "stored by the valid job");
    h.finish();
}

/// A load naming a missing key fails exactly that key; the job's other keys still load.
pub fn load_of_missing_key_fails_only_that_key(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("load_of_missing_key_fails_only_that_key", config, make);
    let lens = lengths(h.slot_bytes());
    store_ok(
        &mut h,
        &[(0, 0, lens[0]), (2, 1, lens[1])],
        "store of two chunks",
    );
    for slot in 8..11 {
        h.fill(SlotId(slot), lens[0], 0xBAD0_0000 + u64::from(slot));
    }
    let missing = h.key(1);
    let chunks = vec![
        TierChunk::new(h.key(0), SlotId(8), lens[0]),
        TierChunk::new(missing, SlotId(9), lens[0]),
        TierChunk::new(h.key(2), SlotId(10), lens[1]),
    ];
    let job = h.job(TierOp::Load, chunks);
    let id = h.submit(&job);
    let done = h.wait(id);
    if done.failed != [FailedKey::new(missing, TierFailure::Missing)] {
        h.fail(format!(
            "load with one missing key {missing:?} failed keys {:?} (expected it alone, Missing)",
            done.failed
        ));
    }
    h.expect_slot(
        SlotId(8),
        lens[0],
        seed_of(0),
        "present key loaded beside a missing one",
    );
    h.expect_slot(
        SlotId(10),
        lens[1],
        seed_of(2),
        "present key loaded beside a missing one",
    );
    let only_missing = h.job(
        TierOp::Load,
        vec![TierChunk::new(h.key(5), SlotId(11), lens[2])],
    );
    let id = h.submit(&only_missing);
    let done = h.wait(id);
    if done.failed != [FailedKey::new(h.key(5), TierFailure::Missing)] {
        h.fail(format!(
            "load of one missing key failed keys {:?} (expected it, Missing)",
            done.failed
        ));
    }
    h.finish();
}

/// A cancelled store or load still completes exactly once; keys it does not list as failed were
/// really transferred; cancelling twice, or a finished or unknown job, adds no completion.
pub fn cancel_still_completes_once(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("cancel_still_completes_once", config, make);
    let lens = lengths(h.slot_bytes());
    let entries: Vec<(u64, u32, u32)> = (0..6u32)
        .map(|i| (u64::from(i), i, lens[i as usize % 4]))
        .collect();
    let chunks = entries
        .iter()
        .map(|&(i, slot, len)| prepared(&h, i, slot, len))
        .collect();
    let store = h.job(TierOp::Store, chunks);
    h.submit(&store);
    h.tier().cancel(store.id);
    h.tier().cancel(store.id);
    let done = h.wait(store.id);
    let mut loadable = Vec::new();
    for &(index, slot, len) in &entries {
        let key = h.key(index);
        if done.failure_of(key).is_none() {
            h.expect_lookup(
                key,
                TierLookup::Hit,
                "stored by a cancelled job that did not list it as failed",
            );
            loadable.push((index, slot + 8, len));
        }
    }
    if !loadable.is_empty() {
        load_ok(
            &mut h,
            &loadable,
            "load of keys a cancelled store reported as stored",
        );
    }
    store_ok(
        &mut h,
        &[(10, 0, lens[0]), (11, 1, lens[1])],
        "store before a cancelled load",
    );
    for slot in 16..18 {
        h.fill(SlotId(slot), lens[0], 0xBAD0_0000 + u64::from(slot));
    }
    let load = h.job(
        TierOp::Load,
        vec![
            TierChunk::new(h.key(10), SlotId(16), lens[0]),
            TierChunk::new(h.key(11), SlotId(17), lens[1]),
        ],
    );
    h.submit(&load);
    h.tier().cancel(load.id);
    let done = h.wait(load.id);
    for (index, slot, len) in [(10, 16, lens[0]), (11, 17, lens[1])] {
        if done.failure_of(h.key(index)).is_none() {
            h.expect_slot(
                SlotId(slot),
                len,
                seed_of(index),
                "key a cancelled load did not list as failed",
            );
        }
    }
    h.tier().cancel(load.id);
    let never = h.job_id();
    h.tier().cancel(never);
    h.settle();
    h.finish();
}

/// After `drain`, one poll returns every outstanding completion, and the tier stays usable.
pub fn drain_completes_every_job(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("drain_completes_every_job", config, make);
    let lens = lengths(h.slot_bytes());
    for index in 0..6u32 {
        let chunk = prepared(&h, u64::from(index), index, lens[index as usize % 4]);
        let job = h.job(TierOp::Store, vec![chunk]);
        h.submit(&job);
    }
    h.drain();
    h.expect_all_returned_by_one_poll("drain");
    h.drain();
    store_ok(&mut h, &[(20, 8, lens[1])], "store after drain");
    load_ok(&mut h, &[(20, 9, lens[1])], "load after drain");
    h.finish();
}

/// `shutdown` completes every accepted job (one poll returns them all); afterwards submit
/// answers `ShutDown`, and cancel, drain and poll add nothing.
pub fn shutdown_refuses_submit_and_returns_pending(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("shutdown_refuses_submit_and_returns_pending", config, make);
    let lens = lengths(h.slot_bytes());
    store_ok(&mut h, &[(0, 0, lens[0])], "store before shutdown");
    for index in 1..5u32 {
        let chunk = prepared(&h, u64::from(index), index, lens[index as usize % 4]);
        let job = h.job(TierOp::Store, vec![chunk]);
        h.submit(&job);
    }
    let load = h.job(
        TierOp::Load,
        vec![TierChunk::new(h.key(0), SlotId(8), lens[0])],
    );
    h.submit(&load);
    h.shutdown();
    h.expect_all_returned_by_one_poll("shutdown");
    for op in [TierOp::Store, TierOp::Load] {
        let late = h.job(op, vec![prepared(&h, 9, 9, lens[0])]);
        match h.try_submit(&late) {
            Err(SubmitError::ShutDown) => {}
            other => h.fail(format!(
                "{op:?} submitted after shutdown answered {other:?}, expected ShutDown"
            )),
        }
    }
    h.tier().cancel(load.id);
    h.drain();
    h.settle();
    h.finish();
}

/// `touch` (of stored, unknown and no keys) and `on_request_finished` (of a request with stores
/// and of one never seen) change no data: stored keys still hit and load.
pub fn touch_and_request_finished_are_harmless(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("touch_and_request_finished_are_harmless", config, make);
    let lens = lengths(h.slot_bytes());
    let keys: Vec<ChunkKey> = (0..3).map(|i| h.key(i)).collect();
    h.tier().touch(&keys);
    let chunks = (0..3u32)
        .map(|i| prepared(&h, u64::from(i), i, lens[i as usize]))
        .collect();
    let mut job = h.job(TierOp::Store, chunks);
    job.request = Some(RequestId(7));
    let id = h.submit(&job);
    h.wait_success(id, "store for request 7");
    let mut touched = keys.clone();
    touched.push(h.key(99));
    h.tier().touch(&touched);
    h.tier().touch(&[]);
    h.finish_request(RequestId(7));
    h.finish_request(RequestId(8));
    for &key in &keys {
        h.expect_lookup(key, TierLookup::Hit, "stored, touched, request finished");
    }
    load_ok(
        &mut h,
        &[(0, 8, lens[0]), (1, 9, lens[1]), (2, 10, lens[2])],
        "load after touch and finish",
    );
    h.finish();
}

/// Four stores per slot in flight at once, then half a pool of loads in flight at once, all
/// byte-identical (a bounded tier's `Busy` is retried after polling).
pub fn many_jobs_in_flight(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("many_jobs_in_flight", config, make);
    let lens = lengths(h.slot_bytes());
    let half = h.slot_count() / 2;
    let key_count = u64::from(half) * 4;
    let slot_of = |index: u64| (index % u64::from(half)) as u32;
    let len_of = |index: u64| lens[(index % 4) as usize];
    // Keys sharing a source slot share its bytes: the seed is the slot's, the key is distinct.
    let seed_slot = |index: u64| seed_of(u64::from(slot_of(index)));
    for slot in 0..half {
        h.fill(SlotId(slot), lens[0], seed_of(u64::from(slot)));
    }
    let mut stores = Vec::new();
    for index in 0..key_count {
        let job = h.job(
            TierOp::Store,
            vec![TierChunk::new(
                h.key(index),
                SlotId(slot_of(index)),
                len_of(index),
            )],
        );
        stores.push(h.submit(&job));
    }
    for id in stores {
        h.wait_success(id, "one of many stores in flight");
    }
    for round in 0..4u64 {
        let mut loads = Vec::new();
        for offset in 0..u64::from(half) {
            let index = round * u64::from(half) + offset;
            let slot = SlotId(half + offset as u32);
            h.fill(slot, lens[0], 0xBAD0_0000 + index);
            let job = h.job(
                TierOp::Load,
                vec![TierChunk::new(h.key(index), slot, len_of(index))],
            );
            loads.push((h.submit(&job), index, slot));
        }
        for &(id, index, slot) in &loads {
            h.wait_success(id, "one of many loads in flight");
            h.expect_slot(
                slot,
                len_of(index),
                seed_slot(index),
                "one of many loads in flight",
            );
        }
    }
    h.finish();
}

/// Storing a key that is already stored (same bytes, from another slot) succeeds and the key
/// still loads byte-identical.
pub fn repeated_store_of_a_key_is_harmless(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("repeated_store_of_a_key_is_harmless", config, make);
    let lens = lengths(h.slot_bytes());
    store_ok(&mut h, &[(0, 0, lens[1])], "first store of a key");
    store_ok(&mut h, &[(0, 1, lens[1])], "second store of the same key");
    h.expect_lookup(h.key(0), TierLookup::Hit, "stored twice");
    load_ok(&mut h, &[(0, 8, lens[1])], "load of a key stored twice");
    h.finish();
}

/// Keys whose hashes share their low 64 bits and group but differ in the high 64 (bit 64, bit
/// 127) are distinct keys: storing one is no hit for the others, a load of another fails, and
/// once all are stored each loads its own bytes.
pub fn keys_equal_in_low_64_bits_are_distinct(config: &SuiteConfig, make: &mut MakeTier<'_>) {
    let mut h = Harness::new("keys_equal_in_low_64_bits_are_distinct", config, make);
    let len = lengths(h.slot_bytes())[0];
    let (a, b, c) = (h.key(0), h.key_high_xor(0, 1), h.key_high_xor(0, 1 << 63));
    let seeds = [(a, 0xA000_0001u64), (b, 0xB000_0002), (c, 0xC000_0003)];
    h.fill(SlotId(0), len, seeds[0].1);
    let job = h.job(TierOp::Store, vec![TierChunk::new(a, SlotId(0), len)]);
    let id = h.submit(&job);
    h.wait_success(id, "store of the first key");
    h.expect_lookup(a, TierLookup::Hit, "stored");
    for other in [b, c] {
        h.expect_lookup(
            other,
            TierLookup::Miss,
            "never stored; only a key with the same low 64 bits was",
        );
    }
    for slot in 8..10 {
        h.fill(SlotId(slot), len, 0xBAD0_0000 + u64::from(slot));
    }
    let job = h.job(
        TierOp::Load,
        vec![
            TierChunk::new(a, SlotId(8), len),
            TierChunk::new(b, SlotId(9), len),
        ],
    );
    let id = h.submit(&job);
    let done = h.wait(id);
    if done.failed != [FailedKey::new(b, TierFailure::Missing)] {
        h.fail(format!(
            "load of {a:?} and {b:?} (never stored, same low 64 bits) failed keys {:?}",
            done.failed
        ));
    }
    h.expect_slot(
        SlotId(8),
        len,
        seeds[0].1,
        "stored key loaded beside its twin",
    );
    h.fill(SlotId(1), len, seeds[1].1);
    h.fill(SlotId(2), len, seeds[2].1);
    let job = h.job(
        TierOp::Store,
        vec![
            TierChunk::new(b, SlotId(1), len),
            TierChunk::new(c, SlotId(2), len),
        ],
    );
    let id = h.submit(&job);
    h.wait_success(
        id,
        "store of the two keys that differ only in their high bits",
    );
    let loads: Vec<TierChunk> = seeds
        .iter()
        .enumerate()
        .map(|(i, &(key, _))| TierChunk::new(key, SlotId(10 + i as u32), len))
        .collect();
    for &TierChunk { slot, .. } in &loads {
        h.fill(slot, len, 0xBAD0_0000 + u64::from(slot.0));
    }
    let job = h.job(TierOp::Load, loads.clone());
    let id = h.submit(&job);
    h.wait_success(id, "load of three keys equal in their low 64 bits");
    for (&(_, seed), &TierChunk { slot, .. }) in seeds.iter().zip(&loads) {
        h.expect_slot(slot, len, seed, "each key loads its own bytes");
    }
    h.finish();
}

/// Expands to one `#[test]` per conformance case, each building its tier with `$make` (an
/// expression of a type `FnMut(Arc<dyn SlotMemory>) -> Box<dyn Tier>`, evaluated once per test),
/// plus a test that the list of cases matches [`conformance::CASES`](crate::conformance::CASES).
/// An optional second argument is the [`SuiteConfig`](crate::conformance::SuiteConfig).
///
/// Invoke it inside its own module, once per tier configuration:
///
/// ```
/// mod fake_no_delay {
///     tier_testkit::tier_conformance_tests!(|memory| {
///         Box::new(tier_testkit::FakeTier::new(memory, Default::default()))
///     });
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! tier_conformance_tests {
    ($make:expr) => {
        $crate::tier_conformance_tests!($make, $crate::conformance::SuiteConfig::default());
    };
    ($make:expr, $config:expr) => {
        $crate::__tier_conformance_cases!(
            ($make, $config)
            store_load_round_trip
            lookup_hit_after_store_miss_when_absent
            every_accepted_job_completes_once
            refused_submit_has_no_effect
            load_of_missing_key_fails_only_that_key
            cancel_still_completes_once
            drain_completes_every_job
            shutdown_refuses_submit_and_returns_pending
            touch_and_request_finished_are_harmless
            many_jobs_in_flight
            repeated_store_of_a_key_is_harmless
            keys_equal_in_low_64_bits_are_distinct
        );
    };
}

/// The expansion of [`tier_conformance_tests!`]: one test per listed case.
#[doc(hidden)]
#[macro_export]
macro_rules! __tier_conformance_cases {
    (($make:expr, $config:expr) $($case:ident)*) => {
        $(
            #[test]
            fn $case() {
                $crate::conformance::run_case($crate::conformance::$case, &$config, $make);
            }
        )*

        #[test]
        fn conformance_case_list_is_complete() {
            let listed: &[&str] = &[$(stringify!($case)),*];
            let all: ::std::vec::Vec<&str> =
                $crate::conformance::CASES.iter().map(|case| case.name).collect();
            assert_eq!(listed, all.as_slice(), "tier_conformance_tests! and CASES disagree");
        }
    };
}
