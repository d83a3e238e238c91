//! Unit tests of the host pool: one test per rule of design.md section 4, items 9-10, for both
//! eviction policies where the rule is policy-independent.

use super::*;

const R: RequestId = RequestId(1);

fn k(n: u64) -> ChunkKey {
    ChunkKey::new(u128::from(n), 0)
}

fn ks(ns: &[u64]) -> Vec<ChunkKey> {
    ns.iter().map(|&n| k(n)).collect()
}

fn config(slot_count: u32, policy: EvictionPolicy) -> PoolConfig {
    PoolConfig {
        slot_count,
        policy,
        reuse_threshold: 0,
        events: true,
    }
}

fn pool(slot_count: u32, policy: EvictionPolicy) -> HostPool {
    HostPool::with_strictness(config(slot_count, policy), true).unwrap()
}

const POLICIES: [EvictionPolicy; 2] = [EvictionPolicy::Lru, EvictionPolicy::Arc];

/// Prepares and completes (successfully) a store of `ns`; returns the keys stored.
fn store(p: &mut HostPool, ns: &[u64]) -> Vec<ChunkKey> {
    let mut out = PreparedStore::default();
    p.prepare_store(&ks(ns), R, &mut out).unwrap();
    p.complete_store(&out.keys, true);
    p.check_invariants().unwrap();
    out.keys
}

fn events(p: &mut HostPool) -> Vec<KvEvent> {
    let mut v = Vec::new();
    p.take_events(&mut v);
    v
}

fn stored(n: u64) -> KvEvent {
    KvEvent::Stored {
        key: k(n),
        medium: Medium::Cpu,
    }
}

fn removed(n: u64) -> KvEvent {
    KvEvent::Removed {
        key: k(n),
        medium: Medium::Cpu,
    }
}

#[test]
fn config_is_validated() {
    for (c, policy, t, what) in [
        (0, EvictionPolicy::Lru, 0, "slot_count"),
        (SLOT_COUNT_MAX + 1, EvictionPolicy::Lru, 0, "slot_count"),
        // ARC's key table also indexes a ghost per slot.
        (ARC_SLOT_COUNT_MAX + 1, EvictionPolicy::Arc, 0, "slot_count"),
        (
            4,
            EvictionPolicy::Lru,
            REUSE_THRESHOLD_MAX + 1,
            "reuse_threshold",
        ),
    ] {
        let mut cfg = config(c, policy);
        cfg.reuse_threshold = t;
        match HostPool::new(cfg) {
            Err(CoreError::InvalidConfig { key, .. }) => assert_eq!(key, what),
            other => panic!(
                "expected InvalidConfig for {what}, got {:?}",
                other.map(|_| ())
            ),
        }
    }
    assert_eq!(
        EvictionPolicy::from_name("ARC").unwrap(),
        EvictionPolicy::Arc
    );
    assert_eq!(
        EvictionPolicy::from_name("lru").unwrap(),
        EvictionPolicy::Lru
    );
    assert!(EvictionPolicy::from_name("fifo").is_err());
}

#[test]
fn lookup_answers_miss_pending_hit_and_counts() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        assert_eq!(p.lookup(k(1), R), LookupResult::Miss);
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[1]), R, &mut out).unwrap();
        assert_eq!(p.lookup(k(1), R), LookupResult::Pending);
        assert_eq!(p.ref_count(k(1)), Some(-1));
        p.complete_store(&ks(&[1]), true);
        assert_eq!(p.lookup(k(1), R), LookupResult::Hit);
        assert_eq!(p.ref_count(k(1)), Some(0));
        // Same hash, other group: a different key.
        assert_eq!(p.lookup(ChunkKey::new(1, 1), R), LookupResult::Miss);
        let s = p.stats();
        assert_eq!((s.lookups, s.lookup_hits), (4, 2));
    }
}

#[test]
fn prepare_store_returns_absent_keys_in_order_deduped() {
    for policy in POLICIES {
        let mut p = pool(8, policy);
        store(&mut p, &[2]);
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[5, 2, 3, 5, 4, 3]), R, &mut out)
            .unwrap();
        assert_eq!(out.keys, ks(&[5, 3, 4]));
        assert_eq!(out.slots.len(), 3);
        for (key, slot) in out.keys.iter().zip(&out.slots) {
            assert_eq!(p.slot_of(*key), Some(*slot));
            assert_eq!(p.key_in(*slot), Some(*key));
            assert_eq!(p.ref_count(*key), Some(-1));
        }
        let mut distinct = out.slots.clone();
        distinct.push(p.slot_of(k(2)).unwrap());
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 4, "slots are distinct");
        assert_eq!(p.len(), 4);
        assert_eq!(p.free_slot_count(), 4);
        // Pending keys are present: asking again stores nothing.
        p.prepare_store(&ks(&[5, 3]), R, &mut out).unwrap();
        assert!(out.keys.is_empty() && out.slots.is_empty());
        p.check_invariants().unwrap();
    }
}

#[test]
fn large_calls_dedupe_with_the_filter_and_with_the_hash_set() {
    // 40 distinct keys: the filter (and a scan where a key's bit is set); 300: the hash set.
    for distinct in [40u64, 300] {
        for policy in POLICIES {
            let mut p = pool(1024, policy);
            let mut keys: Vec<u64> = (0..distinct).collect();
            keys.extend(0..distinct);
            keys.extend([7, 7, distinct - 1]);
            let mut out = PreparedStore::default();
            p.prepare_store(&ks(&keys), R, &mut out).unwrap();
            assert_eq!(out.keys, ks(&(0..distinct).collect::<Vec<_>>()));
            // A second call (a fresh filter, or the next generation of the set) dedupes again.
            let more: Vec<u64> = (1000..1000 + distinct)
                .chain(1000..1000 + distinct)
                .collect();
            p.prepare_store(&ks(&more), R, &mut out).unwrap();
            assert_eq!(out.keys, ks(&(1000..1000 + distinct).collect::<Vec<_>>()));
            p.check_invariants().unwrap();
        }
    }
}

#[test]
fn complete_store_success_failure_and_ready_noop() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[1, 2]), R, &mut out).unwrap();
        let slot2 = p.slot_of(k(2)).unwrap();
        p.complete_store(&ks(&[1]), true);
        p.complete_store(&ks(&[2]), false);
        assert_eq!(p.lookup(k(2), R), LookupResult::Miss, "failed store frees");
        assert_eq!(p.len(), 1);
        assert_eq!(p.free_slot_count(), 3);
        assert_eq!(events(&mut p), vec![stored(1)]);
        // Completing a ready key again, either way, does nothing.
        p.complete_store(&ks(&[1]), true);
        p.complete_store(&ks(&[1]), false);
        p.complete_store(&ks(&[9]), true);
        assert_eq!(p.lookup(k(1), R), LookupResult::Hit);
        assert!(events(&mut p).is_empty());
        assert_eq!(p.stats().chunks_stored, 1);
        // The freed slot is reused first.
        p.prepare_store(&ks(&[3]), R, &mut out).unwrap();
        assert_eq!(out.slots, vec![slot2]);
        p.check_invariants().unwrap();
    }
}

#[test]
fn prepare_load_pins_and_fails_without_effect() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        store(&mut p, &[1, 2]);
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[3]), R, &mut out).unwrap();
        let mut slots = vec![SlotId(99)];
        for bad in [&[1, 3][..], &[2, 7][..]] {
            let err = p.prepare_load(&ks(bad), R, &mut slots).unwrap_err();
            assert!(
                matches!(err, CoreError::BadKeyState { hash, .. } if hash == u128::from(bad[1]))
            );
            assert_eq!(slots, vec![SlotId(99)], "slots untouched on error");
            assert_eq!(p.ref_count(k(1)), Some(0), "no pin on error");
        }
        assert_eq!(p.idle_count(), 2);
        p.prepare_load(&ks(&[2, 1, 2]), R, &mut slots).unwrap();
        let expect = [
            SlotId(99),
            p.slot_of(k(2)).unwrap(),
            p.slot_of(k(1)).unwrap(),
        ];
        assert_eq!(slots[..3], expect);
        assert_eq!(slots[3], expect[1]);
        assert_eq!(p.ref_count(k(2)), Some(2));
        assert_eq!(p.ref_count(k(1)), Some(1));
        assert_eq!(p.idle_count(), 0);
        p.check_invariants().unwrap();
        p.complete_load(&ks(&[2, 1]));
        assert_eq!(p.ref_count(k(2)), Some(1));
        assert_eq!(p.ref_count(k(1)), Some(0));
        assert_eq!(p.idle_count(), 1);
        p.complete_load(&ks(&[2]));
        assert_eq!(p.idle_count(), 2);
        p.check_invariants().unwrap();
    }
}

#[test]
fn full_pool_fails_atomically() {
    for policy in POLICIES {
        let mut p = pool(3, policy);
        store(&mut p, &[1, 2, 3]);
        events(&mut p);
        let mut slots = Vec::new();
        p.prepare_load(&ks(&[1, 2]), R, &mut slots).unwrap();
        // Needs 2 slots; only key 3 is evictable.
        let mut out = PreparedStore {
            keys: ks(&[77]),
            slots: vec![SlotId(5)],
        };
        let err = p.prepare_store(&ks(&[4, 5]), R, &mut out).unwrap_err();
        assert_eq!(
            err,
            CoreError::NoSpace {
                needed: 2,
                evictable: 1
            }
        );
        assert!(out.keys.is_empty() && out.slots.is_empty(), "out cleared");
        for n in 1..=3 {
            assert_eq!(
                p.ref_count(k(n)).map(|r| r >= 0),
                Some(true),
                "key {n} kept"
            );
        }
        assert_eq!(p.ref_count(k(4)), None);
        assert!(events(&mut p).is_empty(), "no events on failure");
        let s = p.stats();
        assert_eq!((s.allocation_failures, s.evictions), (1, 0));
        p.check_invariants().unwrap();
        // One new key fits, by evicting 3 (the only idle chunk).
        p.prepare_store(&ks(&[4]), R, &mut out).unwrap();
        assert_eq!(out.keys, ks(&[4]));
        assert_eq!(events(&mut p), vec![removed(3)]);
        // Now nothing is evictable: pinned (1, 2) and pending (4).
        let err = p.prepare_store(&ks(&[5]), R, &mut out).unwrap_err();
        assert_eq!(
            err,
            CoreError::NoSpace {
                needed: 1,
                evictable: 0
            }
        );
        assert_eq!(p.stats().allocation_failures, 2);
        p.check_invariants().unwrap();
    }
}

#[test]
fn never_evicts_a_key_of_the_same_call() {
    for policy in POLICIES {
        let mut p = pool(2, policy);
        store(&mut p, &[1, 2]);
        events(&mut p);
        // Key 1 is the first victim by every policy, but it is named in the call.
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[1, 3]), R, &mut out).unwrap();
        assert_eq!(out.keys, ks(&[3]));
        assert_eq!(events(&mut p), vec![removed(2)]);
        assert_eq!(p.lookup(k(1), R), LookupResult::Hit);
        p.complete_store(&out.keys, true);
        // Both present keys named: no room for a third even though both are idle.
        let err = p.prepare_store(&ks(&[3, 1, 9]), R, &mut out).unwrap_err();
        assert_eq!(
            err,
            CoreError::NoSpace {
                needed: 1,
                evictable: 0
            }
        );
        assert_eq!(p.len(), 2);
        p.check_invariants().unwrap();
        // Without naming them, it succeeds.
        p.prepare_store(&ks(&[9]), R, &mut out).unwrap();
        assert_eq!(out.keys, ks(&[9]));
        p.check_invariants().unwrap();
    }
}

#[test]
fn pinned_and_pending_chunks_are_skipped_by_eviction() {
    for policy in POLICIES {
        let mut p = pool(3, policy);
        store(&mut p, &[1, 2]);
        let mut slots = Vec::new();
        p.prepare_load(&ks(&[1]), R, &mut slots).unwrap();
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[3]), R, &mut out).unwrap(); // pending, uses the free slot
        events(&mut p);
        p.prepare_store(&ks(&[4]), R, &mut out).unwrap();
        assert_eq!(
            events(&mut p),
            vec![removed(2)],
            "only idle key 2 is evictable"
        );
        assert_eq!(p.ref_count(k(1)), Some(1));
        assert_eq!(p.ref_count(k(3)), Some(-1));
        p.check_invariants().unwrap();
    }
}

#[test]
fn lru_touch_walks_in_reverse_so_first_key_is_evicted_last() {
    let mut p = pool(3, EvictionPolicy::Lru);
    store(&mut p, &[1, 2, 3]);
    // Stored in order: 1 is least recent.
    assert_eq!(p.keys_by_recency(), ks(&[1, 2, 3]));
    p.touch(&ks(&[3, 2, 1]), R);
    // Walked 1, 2, 3 in reverse: key 3 (first named) is most recent.
    assert_eq!(p.keys_by_recency(), ks(&[1, 2, 3]));
    p.touch(&ks(&[1, 2, 3]), R);
    assert_eq!(p.keys_by_recency(), ks(&[3, 2, 1]));
    events(&mut p);
    store(&mut p, &[4, 5]);
    assert_eq!(
        events(&mut p),
        vec![removed(3), removed(2), stored(4), stored(5)]
    );
    assert_eq!(p.lookup(k(1), R), LookupResult::Hit);
    // Touching absent keys changes nothing.
    p.touch(&ks(&[42]), R);
    assert_eq!(p.keys_by_recency(), ks(&[1, 4, 5]));
}

#[test]
fn removed_precedes_stored_that_reuses_the_capacity() {
    for policy in POLICIES {
        let mut p = pool(2, policy);
        store(&mut p, &[1, 2]);
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[3]), R, &mut out).unwrap();
        p.complete_store(&out.keys, true);
        let ev = events(&mut p);
        assert_eq!(ev[..2], [stored(1), stored(2)]);
        assert_eq!(ev.len(), 4);
        assert!(matches!(ev[2], KvEvent::Removed { .. }));
        assert_eq!(ev[3], stored(3));
        assert_eq!(p.stats().evictions, 1);
    }
}

#[test]
fn events_are_gathered_only_when_enabled() {
    let mut cfg = config(1, EvictionPolicy::Lru);
    cfg.events = false;
    let mut p = HostPool::with_strictness(cfg, true).unwrap();
    store(&mut p, &[1]);
    store(&mut p, &[2]);
    assert!(events(&mut p).is_empty());
    assert_eq!(p.stats().evictions, 1);
    assert_eq!(p.stats().chunks_stored, 2);
}

#[test]
fn reuse_threshold_stores_only_keys_looked_up_often_enough() {
    for policy in POLICIES {
        let mut cfg = config(4, policy);
        cfg.reuse_threshold = 2;
        let mut p = HostPool::with_strictness(cfg, true).unwrap();
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[1, 2]), R, &mut out).unwrap();
        assert!(out.keys.is_empty(), "never looked up: not stored");
        p.lookup(k(1), R);
        p.lookup(k(2), R);
        p.lookup(k(2), R);
        assert_eq!((p.lookup_count(k(1)), p.lookup_count(k(2))), (1, 2));
        p.prepare_store(&ks(&[1, 2]), R, &mut out).unwrap();
        assert_eq!(out.keys, ks(&[2]));
        p.lookup(k(1), R);
        p.prepare_store(&ks(&[1, 2]), R, &mut out).unwrap();
        assert_eq!(out.keys, ks(&[1]));
        // Reset forgets the counts.
        p.complete_store(&ks(&[1, 2]), true);
        p.reset();
        assert_eq!(p.lookup_count(k(1)), 0);
        p.prepare_store(&ks(&[1]), R, &mut out).unwrap();
        assert!(out.keys.is_empty());
        p.check_invariants().unwrap();
    }
}

#[test]
fn reset_drops_everything_and_reports_ready_chunks_in_slot_order() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        store(&mut p, &[5, 6, 7]);
        p.touch(&ks(&[6]), R);
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[8]), R, &mut out).unwrap();
        p.complete_store(&ks(&[8]), false); // frees slot 3 again
        p.complete_store(&ks(&[6]), false); // ready: no effect
        events(&mut p);
        p.reset();
        assert_eq!(events(&mut p), vec![removed(5), removed(6), removed(7)]);
        assert!(p.is_empty());
        assert_eq!(p.free_slot_count(), 4);
        assert_eq!(p.lookup(k(5), R), LookupResult::Miss);
        assert_eq!(p.arc_target().unwrap_or(0), 0);
        if let Some(lens) = p.arc_list_lens() {
            assert_eq!(lens, [0; 4], "ghosts dropped too");
        }
        p.check_invariants().unwrap();
        // A fresh pool and a reset one hand out the same slots.
        let first = store(&mut p, &[9]);
        assert_eq!(p.slot_of(first[0]), Some(SlotId(0)));
    }
}

#[test]
fn arc_touch_promotes_and_ghost_hits_adapt_the_target() {
    let mut p = pool(2, EvictionPolicy::Arc);
    store(&mut p, &[1, 2]);
    assert_eq!(p.arc_list_lens(), Some([2, 0, 0, 0]));
    p.touch(&ks(&[1]), R);
    assert_eq!(p.arc_list_lens(), Some([1, 1, 0, 0]));
    // T1 = [2], T2 = [1], p = 0: evict from T1 (|T1| >= p): key 2 goes to B1.
    events(&mut p);
    store(&mut p, &[3]);
    assert_eq!(events(&mut p), vec![removed(2), stored(3)]);
    assert_eq!(p.arc_list_lens(), Some([1, 1, 1, 0]));
    // A B1 ghost hit grows the target.
    p.touch(&ks(&[2]), R);
    assert_eq!(p.arc_target(), Some(1));
    // T1 = [3], T2 = [1], p = 1: |T1| >= p, so T1 again: key 3 to B1 (ghosts: 2, 3; bound 2).
    store(&mut p, &[4]);
    assert_eq!(p.arc_list_lens(), Some([1, 1, 2, 0]));
    p.touch(&ks(&[3, 2]), R);
    assert_eq!(p.arc_target(), Some(2), "capped at the slot count");
    // p = 2 > |T1| = 1: evict from T2 (key 1), onto B2. Ghost bound: |T1|+|B1| = 3 >= 2, so
    // the oldest B1 ghost (2) goes.
    events(&mut p);
    store(&mut p, &[5]);
    assert_eq!(events(&mut p), vec![removed(1), stored(5)]);
    assert_eq!(p.arc_list_lens(), Some([2, 0, 1, 1]));
    p.touch(&ks(&[2]), R);
    assert_eq!(p.arc_target(), Some(2), "ghost of 2 was dropped");
    p.touch(&ks(&[1]), R);
    assert_eq!(p.arc_target(), Some(1), "B2 hit shrinks the target");
    // Storing 3 evicts 4 from T1 (T2 is empty); the ghost bound drops B1's oldest (3).
    events(&mut p);
    store(&mut p, &[3]);
    assert_eq!(events(&mut p), vec![removed(4), stored(3)]);
    assert_eq!(p.arc_list_lens(), Some([2, 0, 1, 1]));
    p.check_invariants().unwrap();
}

#[test]
fn arc_storing_a_key_again_drops_its_ghost() {
    let mut p = pool(2, EvictionPolicy::Arc);
    store(&mut p, &[1, 2]);
    store(&mut p, &[3]); // evicts 1 into B1
    let mut out = PreparedStore::default();
    p.prepare_store(&ks(&[4]), R, &mut out).unwrap(); // evicts 2 into B1
    p.complete_store(&out.keys, false); // frees a slot
    assert_eq!(p.arc_list_lens(), Some([1, 0, 2, 0]));
    store(&mut p, &[1]); // a free slot: no eviction; 1's ghost goes
    assert_eq!(p.arc_list_lens(), Some([2, 0, 1, 0]));
    p.touch(&ks(&[1]), R);
    assert_eq!(
        p.arc_target(),
        Some(0),
        "1 is present, not a ghost: no adaptation"
    );
    p.touch(&ks(&[2]), R);
    assert_eq!(p.arc_target(), Some(1), "2 is still a ghost");
    p.check_invariants().unwrap();
}

#[test]
fn arc_falls_back_to_the_other_list_when_the_chosen_one_is_pinned() {
    let mut p = pool(2, EvictionPolicy::Arc);
    store(&mut p, &[1, 2]);
    p.touch(&ks(&[2]), R); // T1 = [1], T2 = [2]
    let mut slots = Vec::new();
    p.prepare_load(&ks(&[1]), R, &mut slots).unwrap();
    // p = 0, so T1 is chosen, but its only chunk is pinned: T2's chunk goes instead.
    events(&mut p);
    store(&mut p, &[3]);
    assert_eq!(events(&mut p), vec![removed(2), stored(3)]);
    p.check_invariants().unwrap();
}

#[test]
fn metadata_fits_in_64_bytes_per_slot() {
    for policy in POLICIES {
        for reuse_threshold in [0, 2] {
            let mut cfg = config(100_000, policy);
            cfg.reuse_threshold = reuse_threshold;
            let mut p = HostPool::with_strictness(cfg, true).unwrap();
            // Fill it, churn it and use the scratch buffers, then measure.
            let keys: Vec<ChunkKey> = (0..150_000).map(k).collect();
            let mut out = PreparedStore::default();
            for chunk in keys.chunks(500) {
                for &key in chunk {
                    p.lookup(key, R);
                    p.lookup(key, R);
                }
                p.prepare_store(chunk, R, &mut out).unwrap();
                p.complete_store(&out.keys, true);
                p.touch(&chunk[..100], R);
                events(&mut p);
            }
            assert_eq!(p.len(), 100_000);
            let bytes = p.metadata_bytes_per_slot();
            println!("{policy:?} reuse {reuse_threshold}: {bytes} bytes per slot");
            assert!(bytes <= 64, "{policy:?}: {bytes} bytes per slot");
            assert!(
                bytes >= 32,
                "{policy:?}: {bytes} bytes per slot is implausibly low"
            );
        }
    }
}

#[test]
fn lenient_pool_counts_broken_invariants_instead_of_panicking() {
    let mut p = HostPool::with_strictness(config(2, EvictionPolicy::Lru), false).unwrap();
    store(&mut p, &[1]);
    p.complete_load(&ks(&[1, 2]));
    assert_eq!(p.ref_count(k(1)), Some(0));
    assert_eq!(p.stats().invariant_failures, 2);
    p.check_invariants().unwrap();
}

#[test]
fn reset_drops_chunks_being_written_or_read_too() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        store(&mut p, &[1, 2]);
        let mut slots = Vec::new();
        p.prepare_load(&ks(&[2]), R, &mut slots).unwrap();
        let mut out = PreparedStore::default();
        p.prepare_store(&ks(&[3]), R, &mut out).unwrap();
        events(&mut p);
        p.reset();
        // Chunk 2 was announced and is being read: removed. Chunk 3 was never announced.
        assert_eq!(events(&mut p), vec![removed(1), removed(2)]);
        assert!(p.is_empty());
        assert_eq!((p.idle_count(), p.stats().invariant_failures), (0, 0));
        p.check_invariants().unwrap();
        // The pool is usable at once; the stale completions never arrive (the scheduler drops
        // them), and new stores of the same keys start afresh.
        store(&mut p, &[3, 2]);
        assert_eq!(p.lookup(k(3), R), LookupResult::Hit);
        assert_eq!(p.ref_count(k(2)), Some(0));
    }
}

#[test]
fn reader_limit_is_enforced() {
    let mut p = pool(1, EvictionPolicy::Lru);
    store(&mut p, &[1]);
    let keys = vec![k(1); READERS_PER_SLOT_MAX as usize];
    let mut slots = Vec::new();
    p.prepare_load(&keys, R, &mut slots).unwrap();
    assert_eq!(p.ref_count(k(1)), Some(READERS_PER_SLOT_MAX));
    let err = p.prepare_load(&ks(&[1]), R, &mut slots).unwrap_err();
    assert!(matches!(err, CoreError::BadKeyState { .. }));
    assert_eq!(p.ref_count(k(1)), Some(READERS_PER_SLOT_MAX));
}

#[test]
fn reader_limit_counts_each_key_not_the_call() {
    // A key one pin short of the limit can still be loaded in a call with many other keys (the
    // limit is per slot, not per call); a call that would push a slot past it fails whole, and
    // the pins it took on other keys are given back.
    let mut p = pool(8, EvictionPolicy::Lru);
    store(&mut p, &[1, 2, 3, 4]);
    let mut slots = Vec::new();
    let near = vec![k(1); READERS_PER_SLOT_MAX as usize - 1];
    p.prepare_load(&near, R, &mut slots).unwrap();
    slots.clear();
    p.prepare_load(&ks(&[1, 2, 3, 4]), R, &mut slots).unwrap();
    assert_eq!(p.ref_count(k(1)), Some(READERS_PER_SLOT_MAX));
    assert_eq!(p.ref_count(k(4)), Some(1));
    slots.clear();
    let err = p.prepare_load(&ks(&[2, 3, 1]), R, &mut slots).unwrap_err();
    assert!(matches!(err, CoreError::BadKeyState { .. }), "{err:?}");
    assert!(slots.is_empty());
    assert_eq!(p.ref_count(k(2)), Some(1), "pin on k2 given back");
    assert_eq!(p.ref_count(k(3)), Some(1), "pin on k3 given back");
    p.check_invariants().unwrap();
}

#[test]
fn keys_equal_in_their_low_64_bits_are_distinct() {
    // Three keys whose hashes share the low 64 bits, and a fourth differing only in its group.
    let keys = [
        ChunkKey::new(5, 0),
        ChunkKey::new((1u128 << 64) | 5, 0),
        ChunkKey::new((u128::from(u64::MAX) << 64) | 5, 0),
        ChunkKey::new((1u128 << 64) | 5, 1),
    ];
    for policy in POLICIES {
        let mut p = pool(4, policy);
        let mut out = PreparedStore::default();
        p.prepare_store(&keys[..1], R, &mut out).unwrap();
        p.complete_store(&keys[..1], true);
        for &other in &keys[1..] {
            assert_eq!(
                p.lookup(other, R),
                LookupResult::Miss,
                "{policy:?} {other:x?}"
            );
            assert_eq!(p.slot_of(other), None);
        }
        p.prepare_store(&keys, R, &mut out).unwrap();
        assert_eq!(out.keys, keys[1..], "{policy:?}: every other key is new");
        p.complete_store(&keys, true);
        let slots: Vec<SlotId> = keys.iter().map(|&key| p.slot_of(key).unwrap()).collect();
        for (i, &key) in keys.iter().enumerate() {
            assert_eq!(p.key_in(slots[i]), Some(key), "{policy:?}");
            assert!(
                slots[..i].iter().all(|&s| s != slots[i]),
                "{policy:?}: shared slot"
            );
        }
        // A load pins only its own key's slot.
        let mut pinned = Vec::new();
        p.prepare_load(&keys[2..3], R, &mut pinned).unwrap();
        let refs: Vec<_> = keys.iter().map(|&key| p.ref_count(key)).collect();
        assert_eq!(refs, [Some(0), Some(0), Some(1), Some(0)], "{policy:?}");
        p.complete_load(&keys[2..3]);
        // Evicting one leaves the others.
        p.touch(&keys[1..], R);
        p.prepare_store(&[k(99)], R, &mut out).unwrap();
        assert_eq!(
            p.slot_of(keys[0]),
            None,
            "{policy:?}: the least recent key is evicted"
        );
        assert!(keys[1..]
            .iter()
            .all(|&key| p.lookup(key, R) == LookupResult::Hit));
        p.check_invariants().unwrap();
    }
}
