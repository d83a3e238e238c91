//! Unit tests of `FakeTier`'s behaviour and each injected fault: completion delay, store and load
//! failures, corruption detected by the checksum, stall with cancel/drain/shutdown, `Busy`,
//! `Retry` lookups, and the caller bugs it refuses.

use std::sync::Arc;

use offload_core::tier::{
    FailedKey, SubmitError, Tier, TierChunk, TierCompletion, TierFailure, TierJob, TierLookup,
    TierOp,
};
use offload_core::{ChunkKey, JobId, RequestId, SlotId};
use tier_testkit::{FakeTier, FakeTierConfig, FaultPlan, VecSlotMemory};

const SLOT_BYTES: usize = 256;

fn key(n: u64) -> ChunkKey {
    ChunkKey::new(u128::from(n), 0)
}

fn job(id: u64, op: TierOp, chunks: &[(u64, u32, u32)]) -> TierJob {
    TierJob {
        id: JobId(id),
        request: None,
        op,
        chunks: chunks
            .iter()
            .map(|&(k, slot, len)| TierChunk::new(key(k), SlotId(slot), len))
            .collect(),
    }
}

fn setup(config: FakeTierConfig) -> (Arc<VecSlotMemory>, FakeTier) {
    let memory = Arc::new(VecSlotMemory::new(8, SLOT_BYTES));
    let tier = FakeTier::new(memory.clone(), config);
    (memory, tier)
}

fn poll(tier: &mut FakeTier) -> Vec<TierCompletion> {
    let mut out = Vec::new();
    tier.poll(&mut out);
    out
}

/// Stores key `k` from slot `slot` (filled with seed `k`) with job `id`, and completes it.
fn store(memory: &VecSlotMemory, tier: &mut FakeTier, id: u64, k: u64, slot: u32, len: u32) {
    memory.fill(SlotId(slot), len as usize, k);
    tier.submit(job(id, TierOp::Store, &[(k, slot, len)]))
        .expect("store accepted");
    tier.drain();
    let done = poll(tier);
    assert_eq!(
        done,
        vec![TierCompletion {
            id: JobId(id),
            failed: vec![]
        }]
    );
}

#[test]
fn completion_arrives_on_the_poll_after_the_delay() {
    let (memory, mut tier) = setup(FakeTierConfig {
        completion_delay_polls: 3,
        ..Default::default()
    });
    memory.fill(SlotId(0), 100, 1);
    tier.submit(job(1, TierOp::Store, &[(1, 0, 100)]))
        .expect("accepted");
    for _ in 0..3 {
        assert!(poll(&mut tier).is_empty());
        assert!(
            !tier.contains(key(1)),
            "data moves only when the job completes"
        );
    }
    assert_eq!(poll(&mut tier).len(), 1);
    assert!(poll(&mut tier).is_empty());
    assert_eq!(tier.stored_bytes(key(1)).map(<[u8]>::len), Some(100));
    assert_eq!(tier.jobs_in_flight(), 0);
}

#[test]
fn per_job_delay_reorders_completions() {
    let faults = FaultPlan {
        job_delay_polls: [(JobId(1), 2)].into(),
        ..Default::default()
    };
    let (_memory, mut tier) = setup(FakeTierConfig {
        faults,
        ..Default::default()
    });
    tier.submit(job(1, TierOp::Store, &[(1, 0, 8)]))
        .expect("accepted");
    tier.submit(job(2, TierOp::Store, &[(2, 1, 8)]))
        .expect("accepted");
    let ids = |c: Vec<TierCompletion>| c.iter().map(|c| c.id.0).collect::<Vec<_>>();
    assert_eq!(ids(poll(&mut tier)), vec![2]);
    assert_eq!(ids(poll(&mut tier)), Vec::<u64>::new());
    assert_eq!(ids(poll(&mut tier)), vec![1]);
}

#[test]
fn partial_chunk_round_trip() {
    let (memory, mut tier) = setup(FakeTierConfig::default());
    store(&memory, &mut tier, 1, 5, 0, 77);
    memory.fill(SlotId(3), SLOT_BYTES, 999);
    tier.submit(job(2, TierOp::Load, &[(5, 3, 77)]))
        .expect("accepted");
    assert_eq!(
        poll(&mut tier),
        vec![TierCompletion {
            id: JobId(2),
            failed: vec![]
        }]
    );
    assert!(memory.matches(SlotId(3), 77, 5));
    // Bytes past the chunk's length are not written.
    assert_eq!(
        memory.contents(SlotId(3))[77..],
        tier_testkit::pattern(999, SLOT_BYTES)[77..]
    );
}

#[test]
fn load_with_another_length_fails() {
    let (memory, mut tier) = setup(FakeTierConfig::default());
    store(&memory, &mut tier, 1, 5, 0, 77);
    tier.submit(job(2, TierOp::Load, &[(5, 3, 78)]))
        .expect("accepted");
    assert_eq!(
        poll(&mut tier)[0].failed,
        vec![FailedKey::new(key(5), TierFailure::Corrupt)]
    );
}

#[test]
fn store_failure_fails_only_that_key() {
    let faults = FaultPlan {
        store_fail: [key(2)].into(),
        ..Default::default()
    };
    let (memory, mut tier) = setup(FakeTierConfig {
        faults,
        ..Default::default()
    });
    memory.fill(SlotId(0), 10, 1);
    memory.fill(SlotId(1), 10, 2);
    tier.submit(job(1, TierOp::Store, &[(1, 0, 10), (2, 1, 10)]))
        .expect("accepted");
    assert_eq!(
        poll(&mut tier)[0].failed,
        vec![FailedKey::new(key(2), TierFailure::Io)]
    );
    assert!(tier.contains(key(1)));
    assert!(!tier.contains(key(2)));
    assert_eq!(tier.lookup(key(2)), TierLookup::Miss);
}

#[test]
fn load_failure_leaves_slot_untouched() {
    let faults = FaultPlan {
        load_fail: [key(1)].into(),
        ..Default::default()
    };
    let (memory, mut tier) = setup(FakeTierConfig {
        faults,
        ..Default::default()
    });
    store(&memory, &mut tier, 1, 1, 0, 10);
    assert_eq!(
        tier.lookup(key(1)),
        TierLookup::Hit,
        "a planned failure is unexpected: still a hit"
    );
    memory.fill(SlotId(4), SLOT_BYTES, 42);
    tier.submit(job(2, TierOp::Load, &[(1, 4, 10)]))
        .expect("accepted");
    assert_eq!(
        poll(&mut tier)[0].failed,
        vec![FailedKey::new(key(1), TierFailure::Io)]
    );
    assert!(memory.matches(SlotId(4), SLOT_BYTES, 42));
    tier.faults_mut().load_fail.clear();
    tier.submit(job(3, TierOp::Load, &[(1, 4, 10)]))
        .expect("accepted");
    assert!(poll(&mut tier)[0].is_success());
    assert!(memory.matches(SlotId(4), 10, 1));
}

#[test]
fn corruption_is_detected_as_a_failed_key_and_quarantined() {
    let faults = FaultPlan {
        corrupt_on_load: [key(1)].into(),
        ..Default::default()
    };
    let (memory, mut tier) = setup(FakeTierConfig {
        faults,
        ..Default::default()
    });
    store(&memory, &mut tier, 1, 1, 0, 100);
    store(&memory, &mut tier, 2, 2, 1, 100);
    tier.submit(job(3, TierOp::Load, &[(1, 4, 100), (2, 5, 100)]))
        .expect("accepted");
    let done = poll(&mut tier);
    assert_eq!(
        done,
        vec![TierCompletion {
            id: JobId(3),
            failed: vec![FailedKey::new(key(1), TierFailure::Corrupt)]
        }]
    );
    assert!(
        !memory.matches(SlotId(4), 100, 1),
        "the torn copy landed in the slot"
    );
    assert!(memory.matches(SlotId(5), 100, 2));
    assert_eq!(tier.stats().corruption_detected, 1);
    assert_eq!(
        tier.lookup(key(1)),
        TierLookup::Miss,
        "a corrupt copy is quarantined"
    );
}

#[test]
fn stall_completes_only_by_cancel_drain_or_shutdown() {
    let faults = FaultPlan {
        stall: true,
        ..Default::default()
    };
    let (memory, mut tier) = setup(FakeTierConfig {
        faults,
        ..Default::default()
    });
    memory.fill(SlotId(0), 10, 1);
    for id in 1..=3 {
        tier.submit(job(id, TierOp::Store, &[(id, id as u32, 10)]))
            .expect("accepted");
    }
    for _ in 0..100 {
        assert!(poll(&mut tier).is_empty());
    }
    tier.cancel(JobId(1));
    tier.cancel(JobId(1));
    assert_eq!(
        poll(&mut tier),
        vec![TierCompletion {
            id: JobId(1),
            failed: vec![FailedKey::new(key(1), TierFailure::Cancelled)]
        }]
    );
    tier.drain();
    let drained = poll(&mut tier);
    assert_eq!(
        drained.iter().map(|c| c.id.0).collect::<Vec<_>>(),
        vec![2, 3]
    );
    assert!(drained.iter().all(|c| !c.is_success()));
    tier.submit(job(4, TierOp::Store, &[(4, 4, 10)]))
        .expect("accepted");
    tier.shutdown();
    assert_eq!(
        poll(&mut tier),
        vec![TierCompletion {
            id: JobId(4),
            failed: vec![FailedKey::new(key(4), TierFailure::Cancelled)]
        }]
    );
    assert!(!tier.contains(key(1)) && !tier.contains(key(3)));
    assert_eq!(tier.stats().jobs_cancelled, 4);
}

#[test]
fn busy_when_the_queue_is_full_until_a_completion_is_polled() {
    let (_memory, mut tier) = setup(FakeTierConfig {
        jobs_in_flight_max: 2,
        ..Default::default()
    });
    tier.submit(job(1, TierOp::Store, &[(1, 0, 8)]))
        .expect("accepted");
    tier.submit(job(2, TierOp::Store, &[(2, 0, 8)]))
        .expect("accepted");
    assert_eq!(
        tier.submit(job(3, TierOp::Store, &[(3, 0, 8)])),
        Err(SubmitError::Busy { in_flight: 2 })
    );
    tier.drain();
    // Completed but not yet returned: the jobs still hold their slots and their queue places.
    assert!(matches!(
        tier.submit(job(3, TierOp::Store, &[(3, 0, 8)])),
        Err(SubmitError::Busy { .. })
    ));
    assert_eq!(poll(&mut tier).len(), 2);
    tier.submit(job(3, TierOp::Store, &[(3, 0, 8)]))
        .expect("accepted after poll");
    assert_eq!(poll(&mut tier).len(), 1);
    assert_eq!(tier.stats().jobs_refused, 2);
}

#[test]
fn lookup_retries_then_settles() {
    let (memory, mut tier) = setup(FakeTierConfig {
        lookup_retry_count: 2,
        ..Default::default()
    });
    store(&memory, &mut tier, 1, 1, 0, 8);
    for k in [1, 2] {
        assert_eq!(tier.lookup(key(k)), TierLookup::Retry);
        assert_eq!(tier.lookup(key(k)), TierLookup::Retry);
    }
    assert_eq!(tier.lookup(key(1)), TierLookup::Hit);
    assert_eq!(tier.lookup(key(2)), TierLookup::Miss);
}

#[test]
fn invalid_jobs_are_refused_without_side_effects() {
    let (memory, mut tier) = setup(FakeTierConfig {
        completion_delay_polls: 1,
        ..Default::default()
    });
    let len = SLOT_BYTES as u32;
    tier.submit(job(5, TierOp::Store, &[(1, 0, 8)]))
        .expect("accepted");
    let invalid = [
        job(5, TierOp::Store, &[(2, 1, 8)]), // duplicate in-flight id
        job(4, TierOp::Store, &[(2, 1, 8)]), // id does not grow
        job(6, TierOp::Store, &[(2, 8, 8)]), // slot out of range
        job(6, TierOp::Store, &[(2, 1, len + 1)]), // longer than a slot
        job(6, TierOp::Store, &[(2, 1, 0)]), // empty chunk
        job(6, TierOp::Store, &[(2, 1, 8), (2, 2, 8)]), // key twice
        job(6, TierOp::Load, &[(2, 1, 8), (3, 1, 8)]), // load writes a slot twice
        job(6, TierOp::Load, &[(2, 0, 8)]),  // load into a slot a store reads
    ];
    for bad in invalid {
        let answer = tier.submit(bad.clone());
        assert!(
            matches!(answer, Err(SubmitError::Invalid(_))),
            "{bad:?} answered {answer:?}"
        );
    }
    // Two stores may read one slot.
    tier.submit(job(6, TierOp::Store, &[(2, 0, 8)]))
        .expect("two readers of a slot");
    tier.drain();
    let done = poll(&mut tier);
    assert_eq!(done.iter().map(|c| c.id.0).collect::<Vec<_>>(), vec![5, 6]);
    assert_eq!(tier.chunk_count(), 2);
    assert_eq!(tier.stats().jobs_refused, 8);
    let _ = memory;
}

#[test]
fn jobs_for_a_finished_request_are_refused_and_double_finish_recorded() {
    let (_memory, mut tier) = setup(FakeTierConfig::default());
    let mut store = job(1, TierOp::Store, &[(1, 0, 8)]);
    store.request = Some(RequestId(3));
    tier.submit(store.clone()).expect("accepted");
    tier.on_request_finished(RequestId(3));
    store.id = JobId(2);
    assert!(matches!(tier.submit(store), Err(SubmitError::Invalid(_))));
    assert!(tier.violations().is_empty());
    tier.on_request_finished(RequestId(3));
    assert_eq!(tier.violations().len(), 1);
    assert_eq!(
        poll(&mut tier).len(),
        1,
        "the job accepted before the finish still completes"
    );
}

#[test]
fn empty_job_succeeds_and_shutdown_refuses() {
    let (_memory, mut tier) = setup(FakeTierConfig::default());
    tier.submit(job(1, TierOp::Load, &[])).expect("accepted");
    assert_eq!(
        poll(&mut tier),
        vec![TierCompletion {
            id: JobId(1),
            failed: vec![]
        }]
    );
    tier.shutdown();
    assert_eq!(
        tier.submit(job(2, TierOp::Store, &[(1, 0, 8)])),
        Err(SubmitError::ShutDown)
    );
    assert!(poll(&mut tier).is_empty());
    assert_eq!(tier.name(), "fake");
    assert_eq!(tier.medium(), offload_core::Medium::Disk);
}
