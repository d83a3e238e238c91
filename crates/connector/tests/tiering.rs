//! The tiering manager against fake tiers: cascades and their pins, promotions and their pins
//! (a prefix larger than the host pool converges), the per-request finalization order, reset,
//! busy and failing tiers, and strict checks on tier reports.

use std::sync::Arc;

use connector::testing::{SharedTier, TierCall};
use connector::{TierEvent, TierMask, TieringManager, TieringOptions};
use offload_core::tier::{
    SubmitError, Tier, TierCompletion, TierFailure, TierJob, TierLookup, TierOp,
};
use offload_core::{
    ChunkKey, EvictionPolicy, HostPool, JobId, KvEvent, LookupResult, Medium, OffloadManager,
    PoolConfig, PreparedStore, RequestId, SlotId, SlotMemory,
};
use tier_testkit::{fill_slot, read_slot_vec, FakeTier, FakeTierConfig, VecSlotMemory};

const SLOT_BYTES: usize = 64;

fn key(n: u64) -> ChunkKey {
    ChunkKey::new(u128::from(n), 0)
}

struct Fixture {
    memory: Arc<VecSlotMemory>,
    tiers: Vec<SharedTier<FakeTier>>,
    manager: TieringManager,
}

fn fixture_with(slots: u32, configs: Vec<FakeTierConfig>, strict: bool) -> Fixture {
    let options = TieringOptions {
        strict,
        ..TieringOptions::new(SLOT_BYTES as u32)
    };
    fixture_with_options(slots, configs, options)
}

fn fixture_with_options(
    slots: u32,
    configs: Vec<FakeTierConfig>,
    options: TieringOptions,
) -> Fixture {
    fixture_with_pool(slots, 0, configs, options)
}

fn fixture_with_pool(
    slots: u32,
    reuse_threshold: u32,
    configs: Vec<FakeTierConfig>,
    options: TieringOptions,
) -> Fixture {
    let strict = options.strict;
    let memory = Arc::new(VecSlotMemory::new(slots, SLOT_BYTES));
    let tiers: Vec<SharedTier<FakeTier>> = configs
        .into_iter()
        .map(|c| {
            let dyn_memory: Arc<dyn SlotMemory> = memory.clone();
            SharedTier::new(FakeTier::new(dyn_memory, c), 10_000)
        })
        .collect();
    let host = HostPool::with_strictness(
        PoolConfig {
            slot_count: slots,
            policy: EvictionPolicy::Lru,
            reuse_threshold,
            events: true,
        },
        strict,
    )
    .expect("pool config");
    let manager = TieringManager::new(host, tiers.iter().map(|t| t.boxed()).collect(), options)
        .expect("manager");
    Fixture {
        memory,
        tiers,
        manager,
    }
}

fn fixture(slots: u32, tier_count: usize) -> Fixture {
    let configs = (0..tier_count)
        .map(|i| FakeTierConfig {
            name: format!("fake{i}"),
            medium: if i == 0 { Medium::Disk } else { Medium::Peer },
            ..FakeTierConfig::default()
        })
        .collect();
    fixture_with(slots, configs, true)
}

/// Stores `keys` for `request` through the host pool as the scheduler would, writing a pattern
/// per key into each slot; returns the slots.
fn store(f: &mut Fixture, request: RequestId, keys: &[ChunkKey]) -> Vec<SlotId> {
    let mut prepared = PreparedStore::default();
    f.manager
        .prepare_store(keys, request, &mut prepared)
        .expect("room");
    for (k, s) in prepared.keys.iter().zip(&prepared.slots) {
        fill_slot(f.memory.as_ref(), *s, SLOT_BYTES, k.hash_low());
    }
    f.manager.complete_store(&prepared.keys, true);
    prepared.slots
}

fn no_fake_violations(f: &Fixture) {
    for t in &f.tiers {
        let v = t.with(|t| t.violations().to_vec());
        assert!(v.is_empty(), "tier saw contract violations: {v:?}");
    }
}

#[test]
fn cascade_pins_slots_until_each_tier_reports() {
    let mut f = fixture(4, 2);
    let r = RequestId(1);
    store(&mut f, r, &[key(10), key(11)]);
    // One read pin per tier while the cascades are in flight.
    assert_eq!(f.manager.host().ref_count(key(10)), Some(2));
    assert_eq!(f.manager.tier_jobs_in_flight(), 2);
    f.manager.begin_step();
    assert_eq!(f.manager.host().ref_count(key(10)), Some(0));
    assert_eq!(f.manager.tier_jobs_in_flight(), 0);
    for t in &f.tiers {
        assert!(t.with(|t| t.contains(key(10)) && t.contains(key(11))));
        let bytes = t.with(|t| t.stored_bytes(key(11)).map(<[u8]>::to_vec));
        assert_eq!(bytes, Some(tier_testkit::pattern(11, SLOT_BYTES)));
    }
    let mut events = Vec::new();
    f.manager.take_tier_events(&mut events);
    let stored_in = |tier: &str, m: Medium| {
        events.iter().any(|e| {
            e.tier == tier
                && e.event
                    == KvEvent::Stored {
                        key: key(10),
                        medium: m,
                    }
        })
    };
    assert!(stored_in("cpu", Medium::Cpu));
    assert!(stored_in("fake0", Medium::Disk));
    assert!(stored_in("fake1", Medium::Peer));
    no_fake_violations(&f);
}

#[test]
fn host_miss_promotes_from_the_first_tier_that_hits_once() {
    let mut f = fixture(4, 2);
    store(&mut f, RequestId(1), &[key(7)]);
    f.manager.on_request_finished(RequestId(1));
    f.manager.begin_step();
    // Drop the host copy: the tiers keep theirs.
    f.manager.reset();
    assert_eq!(f.manager.host().len(), 0);
    fill_slot(f.memory.as_ref(), SlotId(0), SLOT_BYTES, 0xdead);
    let r = RequestId(2);
    assert_eq!(f.manager.lookup(key(7), r), LookupResult::Pending);
    // The slot is reserved: a second lookup sees pending and promotes nothing more.
    assert_eq!(
        f.manager.lookup(key(7), RequestId(3)),
        LookupResult::Pending
    );
    f.manager.end_step();
    f.manager.begin_step();
    assert_eq!(f.manager.lookup(key(7), r), LookupResult::Hit);
    let slot = f.manager.host().slot_of(key(7)).expect("promoted");
    assert_eq!(
        read_slot_vec(f.memory.as_ref(), slot, SLOT_BYTES),
        tier_testkit::pattern(7, SLOT_BYTES)
    );
    let loads = |t: &SharedTier<FakeTier>| {
        t.log()
            .iter()
            .filter(|c| {
                matches!(
                    c,
                    TierCall::Submit {
                        op: TierOp::Load,
                        ..
                    }
                )
            })
            .count()
    };
    assert_eq!(loads(&f.tiers[0]), 1, "one promotion, from the first tier");
    assert_eq!(loads(&f.tiers[1]), 0);
    assert_eq!(f.manager.tier_counters(0).map(|c| c.chunks_loaded), Some(1));
    no_fake_violations(&f);
}

#[test]
fn promotions_go_out_in_one_batch_per_tier_and_request() {
    let mut f = fixture(8, 1);
    store(&mut f, RequestId(1), &[key(1), key(2), key(3)]);
    f.manager.on_request_finished(RequestId(1));
    f.manager.begin_step();
    f.manager.reset();
    for k in 1..=3 {
        assert_eq!(
            f.manager.lookup(key(k), RequestId(5)),
            LookupResult::Pending
        );
    }
    assert_eq!(
        f.manager.lookup(key(1), RequestId(6)),
        LookupResult::Pending
    );
    f.manager.end_step();
    let batches: Vec<Vec<ChunkKey>> = f.tiers[0]
        .log()
        .into_iter()
        .filter_map(|c| match c {
            TierCall::Submit {
                op: TierOp::Load,
                keys,
                request,
                ..
            } => {
                assert_eq!(request, Some(RequestId(5)));
                Some(keys)
            }
            _ => None,
        })
        .collect();
    assert_eq!(batches, vec![vec![key(1), key(2), key(3)]]);
}

#[test]
fn a_full_host_pool_turns_a_tier_hit_into_a_miss() {
    let mut f = fixture(1, 1);
    store(&mut f, RequestId(1), &[key(1)]);
    f.manager.on_request_finished(RequestId(1));
    f.manager.begin_step();
    f.manager.reset();
    // The only slot is being written by another store.
    let mut prepared = PreparedStore::default();
    f.manager
        .prepare_store(&[key(2)], RequestId(2), &mut prepared)
        .expect("room");
    assert_eq!(f.manager.lookup(key(1), RequestId(3)), LookupResult::Miss);
    assert_eq!(
        f.manager.tier_counters(0).map(|c| c.promotion_no_space),
        Some(1)
    );
    f.manager.complete_store(&prepared.keys, false);
}

#[test]
fn a_promotion_the_reuse_threshold_leaves_out_is_not_counted_as_no_space() {
    // A key is stored in the host pool only after 2 lookups there.
    let options = TieringOptions {
        strict: true,
        ..TieringOptions::new(SLOT_BYTES as u32)
    };
    let mut f = fixture_with_pool(4, 2, vec![FakeTierConfig::default()], options);
    for _ in 0..2 {
        assert_eq!(f.manager.lookup(key(1), RequestId(1)), LookupResult::Miss);
    }
    store(&mut f, RequestId(1), &[key(1)]);
    f.manager.on_request_finished(RequestId(1));
    f.manager.begin_step();
    assert!(
        f.tiers[0].with(|t| t.contains(key(1))),
        "cascaded to the tier"
    );
    f.manager.reset();
    // Only the tier holds key(1) now; the host pool saw it looked up once since the reset, so
    // its promotion is not admitted yet: a miss, counted as such, with room to spare.
    assert_eq!(f.manager.lookup(key(1), RequestId(2)), LookupResult::Miss);
    let c = f.manager.tier_counters(0).expect("tier 0");
    assert_eq!(
        (c.promotion_below_reuse_threshold, c.promotion_no_space),
        (1, 0)
    );
}

#[test]
fn tier_filter_limits_where_a_request_loads_from() {
    let mut f = fixture(4, 2);
    store(&mut f, RequestId(1), &[key(1)]);
    f.manager.on_request_finished(RequestId(1));
    f.manager.begin_step();
    f.manager.reset();
    f.manager.set_request_tiers(RequestId(2), TierMask::NONE);
    assert_eq!(f.manager.lookup(key(1), RequestId(2)), LookupResult::Miss);
    f.manager
        .set_request_tiers(RequestId(3), TierMask::of(&[1]));
    assert_eq!(
        f.manager.lookup(key(1), RequestId(3)),
        LookupResult::Pending
    );
    f.manager.end_step();
    let from_peer = f.tiers[1].log().iter().any(|c| {
        matches!(
            c,
            TierCall::Submit {
                op: TierOp::Load,
                ..
            }
        )
    });
    assert!(from_peer, "request 3 may load only from tier 1");
    assert_eq!(f.manager.tier_counters(0).map(|c| c.lookups), Some(0));
}

#[test]
fn tiers_hear_the_finish_only_after_every_host_store_completed_and_cascaded() {
    let mut f = fixture(4, 1);
    let r = RequestId(9);
    let mut prepared = PreparedStore::default();
    f.manager
        .prepare_store(&[key(1)], r, &mut prepared)
        .expect("room");
    // The finish arrives while the host store is still in flight (the reference's crash).
    f.manager.on_request_finished(r);
    assert!(!f.manager.is_finalized(r));
    assert!(!f.tiers[0].log().contains(&TierCall::Finished(r)));
    f.manager.complete_store(&prepared.keys, true);
    assert!(f.manager.is_finalized(r));
    let log = f.tiers[0].log();
    let submit = log
        .iter()
        .position(|c| matches!(c, TierCall::Submit { request: Some(q), .. } if *q == r));
    let finished = log.iter().position(|c| *c == TierCall::Finished(r));
    assert!(
        submit.is_some() && finished.is_some() && submit < finished,
        "{log:?}"
    );
    f.manager.begin_step();
    no_fake_violations(&f);
}

#[test]
fn queued_promotions_are_submitted_before_the_tiers_hear_the_finish() {
    let mut f = fixture(4, 1);
    store(&mut f, RequestId(1), &[key(1)]);
    f.manager.on_request_finished(RequestId(1));
    f.manager.begin_step();
    f.manager.reset();
    let r = RequestId(2);
    assert_eq!(f.manager.lookup(key(1), r), LookupResult::Pending);
    // Aborted before the end of the step.
    f.manager.on_request_finished(r);
    let log = f.tiers[0].log();
    let load = log.iter().position(
        |c| matches!(c, TierCall::Submit { op: TierOp::Load, request: Some(q), .. } if *q == r),
    );
    let finished = log.iter().position(|c| *c == TierCall::Finished(r));
    assert!(load.is_some() && load < finished, "{log:?}");
    f.manager.begin_step();
    assert!(
        f.manager.outstanding().is_empty(),
        "{:?}",
        f.manager.outstanding()
    );
    no_fake_violations(&f);
}

#[test]
fn a_failed_promotion_is_freed_and_that_request_recomputes() {
    let mut f = fixture(4, 1);
    store(&mut f, RequestId(1), &[key(1)]);
    f.manager.on_request_finished(RequestId(1));
    f.manager.begin_step();
    f.manager.reset();
    f.tiers[0].with(|t| t.faults_mut().corrupt_on_load.insert(key(1)));
    let r = RequestId(2);
    assert_eq!(f.manager.lookup(key(1), r), LookupResult::Pending);
    f.manager.end_step();
    f.manager.begin_step();
    assert_eq!(f.manager.host().slot_of(key(1)), None, "never served");
    assert_eq!(f.manager.lookup(key(1), r), LookupResult::Miss);
    assert_eq!(
        f.manager.tier_counters(0).map(|c| c.load_chunks_failed),
        Some(1)
    );
}

#[test]
fn failed_promotions_are_counted_by_the_kind_the_tier_reported_and_each_recomputes() {
    let mut f = fixture(4, 1);
    store(&mut f, RequestId(1), &[key(1), key(2)]);
    f.manager.on_request_finished(RequestId(1));
    f.manager.begin_step();
    f.manager.reset();
    f.tiers[0].with(|t| {
        t.faults_mut().corrupt_on_load.insert(key(1));
        t.faults_mut().load_fail.insert(key(2));
    });
    let r = RequestId(2);
    assert_eq!(f.manager.lookup(key(1), r), LookupResult::Pending);
    assert_eq!(f.manager.lookup(key(2), r), LookupResult::Pending);
    f.manager.end_step();
    f.manager.begin_step();
    for k in [key(1), key(2)] {
        assert_eq!(f.manager.host().slot_of(k), None, "never served");
        assert_eq!(f.manager.lookup(k, r), LookupResult::Miss, "recomputed");
    }
    let c = f.manager.tier_counters(0).expect("tier 0");
    assert_eq!(c.load_chunks_failed, 2);
    assert_eq!((c.failures.corrupt, c.failures.io), (1, 1), "{c:?}");
    assert_eq!(c.failures.of(TierFailure::Corrupt), 1);
    let others: u64 = c.failures.labelled().iter().map(|(_, v)| v).sum::<u64>() - 2;
    assert_eq!(others, 0, "{:?}", c.failures);
    no_fake_violations(&f);
}

#[test]
fn a_secondary_tiers_own_evictions_become_removed_events_with_its_medium() {
    let mut f = fixture(4, 1);
    store(&mut f, RequestId(1), &[key(1), key(2)]);
    f.manager.on_request_finished(RequestId(1));
    f.manager.begin_step();
    let mut events = Vec::new();
    f.manager.take_tier_events(&mut events);
    assert!(f.tiers[0].with(|t| t.evict(key(2))), "the fake held key 2");
    f.manager.begin_step();
    events.clear();
    f.manager.take_tier_events(&mut events);
    let name = f.tiers[0].name().to_owned();
    let medium = f.tiers[0].medium();
    let removed: Vec<&TierEvent> = events
        .iter()
        .filter(|e| matches!(e.event, KvEvent::Removed { .. }))
        .collect();
    assert_eq!(
        removed,
        vec![&TierEvent {
            tier: name,
            event: KvEvent::Removed {
                key: key(2),
                medium
            }
        }],
        "{events:?}"
    );
    let c = f.manager.tier_counters(0).expect("tier 0");
    assert_eq!((c.evictions_reported, c.evictions_unreported), (1, 0));
    no_fake_violations(&f);
}

#[test]
fn a_busy_tier_gets_its_cascade_later_and_the_finish_waits_for_it() {
    let configs = vec![FakeTierConfig {
        name: "slow".to_owned(),
        jobs_in_flight_max: 1,
        completion_delay_polls: 1,
        ..FakeTierConfig::default()
    }];
    let mut f = fixture_with(8, configs, true);
    let r = RequestId(1);
    store(&mut f, r, &[key(1)]);
    store(&mut f, r, &[key(2)]);
    assert_eq!(f.manager.tier_counters(0).map(|c| c.submits_busy), Some(1));
    f.manager.on_request_finished(r);
    assert!(!f.manager.is_finalized(r), "a cascade is still queued");
    for _ in 0..4 {
        f.manager.begin_step();
        f.manager.end_step();
    }
    assert!(f.manager.is_finalized(r));
    assert!(f.tiers[0].with(|t| t.contains(key(1)) && t.contains(key(2))));
    assert_eq!(f.manager.host().ref_count(key(2)), Some(0));
    no_fake_violations(&f);
}

#[test]
fn reset_drains_tier_io_first_and_finalizes_finished_requests_once() {
    let configs = vec![FakeTierConfig {
        completion_delay_polls: 100,
        ..FakeTierConfig::default()
    }];
    let mut f = fixture_with(4, configs, true);
    let r = RequestId(1);
    store(&mut f, r, &[key(1)]);
    let mut prepared = PreparedStore::default();
    f.manager
        .prepare_store(&[key(2)], r, &mut prepared)
        .expect("room");
    f.manager.on_request_finished(r);
    assert_eq!(f.manager.tier_jobs_in_flight(), 1);
    f.manager.reset();
    assert_eq!(
        f.manager.tier_jobs_in_flight(),
        0,
        "drained before the slots were freed"
    );
    // The reset polled the tier until the job completed (within the reset drain deadline), so
    // it neither cancelled nor blocked in `drain`.
    let log = f.tiers[0].log();
    assert!(
        log.iter().any(|c| matches!(c, TierCall::Completed { .. })),
        "{log:?}"
    );
    assert!(
        !log.iter()
            .any(|c| matches!(c, TierCall::Cancel(_) | TierCall::Drain)),
        "{log:?}"
    );
    assert_eq!(f.manager.counters().reset_drain_timeouts, 0);
    assert_eq!(
        log.iter().filter(|c| **c == TierCall::Finished(r)).count(),
        1
    );
    assert!(f.tiers[0].with(|t| t.contains(key(1))), "tier data kept");
    assert_eq!(f.manager.host().len(), 0);
    assert!(
        f.manager.outstanding().is_empty(),
        "{:?}",
        f.manager.outstanding()
    );
    no_fake_violations(&f);
}

/// A tier that reports what it is told to, to break the report rules.
struct Liar {
    reports: Vec<TierCompletion>,
}

impl Tier for Liar {
    fn name(&self) -> &str {
        "liar"
    }
    fn medium(&self) -> Medium {
        Medium::Disk
    }
    fn lookup(&mut self, _: ChunkKey) -> TierLookup {
        TierLookup::Miss
    }
    fn touch(&mut self, _: &[ChunkKey]) {}
    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        // Reports each job twice, a job nobody submitted, and the next tier's job (the manager
        // submits one cascade per tier, in tier order, with consecutive ids).
        self.reports.push(TierCompletion {
            id: JobId(job.id.0 + 1),
            failed: Vec::new(),
        });
        for _ in 0..2 {
            self.reports.push(TierCompletion {
                id: job.id,
                failed: Vec::new(),
            });
        }
        self.reports.push(TierCompletion {
            id: JobId(job.id.0 + 1000),
            failed: Vec::new(),
        });
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        out.append(&mut self.reports);
    }
    fn cancel(&mut self, _: JobId) {}
    fn drain(&mut self) {}
    fn on_request_finished(&mut self, _: RequestId) {}
    fn shutdown(&mut self) {}
}

#[test]
fn reports_twice_unknown_or_from_the_wrong_tier_are_invariant_failures() {
    let memory = Arc::new(VecSlotMemory::new(4, SLOT_BYTES));
    let host = HostPool::with_strictness(
        PoolConfig {
            slot_count: 4,
            policy: EvictionPolicy::Lru,
            reuse_threshold: 0,
            events: true,
        },
        false,
    )
    .expect("pool");
    let dyn_memory: Arc<dyn SlotMemory> = memory.clone();
    let honest = FakeTier::new(dyn_memory, FakeTierConfig::default());
    let options = TieringOptions {
        strict: false,
        ..TieringOptions::new(SLOT_BYTES as u32)
    };
    let tiers: Vec<Box<dyn Tier>> = vec![
        Box::new(honest),
        Box::new(Liar {
            reports: Vec::new(),
        }),
    ];
    let mut manager = TieringManager::new(host, tiers, options).expect("manager");
    let mut prepared = PreparedStore::default();
    manager
        .prepare_store(&[key(1)], RequestId(1), &mut prepared)
        .expect("room");
    manager.complete_store(&prepared.keys, true);
    // Jobs 1 (liar) and 2 (honest). The liar, polled first, reports 2 (the honest tier's: wrong
    // tier), 1 twice, and 1001 (unknown); the honest tier's own report of 2 still counts.
    manager.begin_step();
    assert_eq!(manager.counters().invariant_failures, 3);
    assert_eq!(manager.tier_jobs_in_flight(), 0);
    assert_eq!(manager.tier_counters(1).map(|c| c.chunks_stored), Some(1));
    assert_eq!(
        manager.host().ref_count(key(1)),
        Some(0),
        "both pins released once"
    );

    // Strict mode panics on the first.
    let strict = std::panic::catch_unwind(|| {
        let mut f = fixture(4, 0);
        let liar: Box<dyn Tier> = Box::new(Liar {
            reports: Vec::new(),
        });
        let host = HostPool::new(PoolConfig {
            slot_count: 4,
            policy: EvictionPolicy::Lru,
            reuse_threshold: 0,
            events: false,
        })
        .expect("pool");
        f.manager = TieringManager::new(
            host,
            vec![liar],
            TieringOptions {
                strict: true,
                ..TieringOptions::new(SLOT_BYTES as u32)
            },
        )
        .expect("manager");
        store(&mut f, RequestId(1), &[key(1)]);
        f.manager.begin_step();
    });
    assert!(strict.is_err(), "strict mode must panic on a bad report");
}

#[test]
fn calls_for_a_finished_request_are_invariant_failures() {
    let mut f = fixture_with(4, vec![FakeTierConfig::default()], false);
    let r = RequestId(4);
    f.manager.on_request_finished(r);
    assert!(f.manager.is_finalized(r));
    let mut prepared = PreparedStore::default();
    assert!(f
        .manager
        .prepare_store(&[key(1)], r, &mut prepared)
        .is_err());
    f.manager.on_request_finished(r);
    assert_eq!(f.manager.counters().invariant_failures, 2);
    assert!(f.manager.host().is_empty(), "nothing was reserved");
}

#[test]
fn a_promotion_stuck_behind_a_busy_tier_is_cancelled_at_its_deadline() {
    let memory = Arc::new(VecSlotMemory::new(4, SLOT_BYTES));
    let dyn_memory: Arc<dyn SlotMemory> = memory.clone();
    let fake = SharedTier::new(
        FakeTier::new(
            dyn_memory,
            FakeTierConfig {
                jobs_in_flight_max: 1,
                ..FakeTierConfig::default()
            },
        ),
        1000,
    );
    let clock = connector::testing::ManualClock::new();
    let options = TieringOptions {
        strict: true,
        promotion_deadline_ns: 1000,
        clock: Arc::new(clock.clone()),
        ..TieringOptions::new(SLOT_BYTES as u32)
    };
    let host = HostPool::new(PoolConfig {
        slot_count: 4,
        policy: EvictionPolicy::Lru,
        reuse_threshold: 0,
        events: false,
    })
    .expect("pool");
    let mut manager = TieringManager::new(host, vec![fake.boxed()], options).expect("manager");
    let mut prepared = PreparedStore::default();
    manager
        .prepare_store(&[key(1)], RequestId(1), &mut prepared)
        .expect("room");
    manager.complete_store(&prepared.keys, true);
    manager.on_request_finished(RequestId(1));
    manager.begin_step();
    manager.reset();
    // The tier's only job slot is taken by a stalled cascade of another chunk.
    fake.with(|t| t.faults_mut().stall = true);
    manager
        .prepare_store(&[key(2)], RequestId(2), &mut prepared)
        .expect("room");
    manager.complete_store(&prepared.keys, true);
    let r = RequestId(3);
    assert_eq!(manager.lookup(key(1), r), LookupResult::Pending);
    manager.end_step();
    assert_eq!(manager.tier_counters(0).map(|c| c.submits_busy), Some(1));
    clock.advance(500);
    manager.begin_step();
    assert_eq!(
        manager.lookup(key(1), r),
        LookupResult::Pending,
        "still queued"
    );
    clock.advance(1000);
    manager.begin_step();
    assert_eq!(manager.host().slot_of(key(1)), None, "reserved slot freed");
    assert_eq!(manager.lookup(key(1), r), LookupResult::Miss);
    assert_eq!(
        manager.tier_counters(0).map(|c| c.promotions_timed_out),
        Some(1)
    );
    fake.with(|t| t.faults_mut().stall = false);
    manager.on_request_finished(RequestId(2));
    manager.on_request_finished(r);
    manager.drain();
    assert!(
        manager.outstanding().is_empty(),
        "{:?}",
        manager.outstanding()
    );
}

#[test]
fn the_manager_and_the_handle_can_move_to_another_thread() {
    fn send<T: Send>(_: &T) {}
    let f = fixture(2, 1);
    send(&f.manager);
    let handle =
        connector::SchedulerHandle::new(offload_core::SchedulerConfig::default(), f.manager)
            .expect("handle");
    send(&handle);
    assert_eq!(handle.tiering().tier_count(), 1);
}

/// Leaves `keys` in the (only) tier and none in the host pool, whatever the pool's size: stores
/// them through the host pool in batches that fit, lets each batch cascade, then resets.
fn keys_only_in_the_tier(f: &mut Fixture, keys: &[ChunkKey]) {
    let owner = RequestId(1000);
    let batch = f.manager.host().slot_count() as usize;
    for part in keys.chunks(batch) {
        store(f, owner, part);
        f.manager.begin_step();
    }
    f.manager.on_request_finished(owner);
    f.manager.reset();
    assert_eq!(f.manager.host().len(), 0);
    for &k in keys {
        assert!(f.tiers[0].with(|t| t.contains(k)));
    }
}

/// One lookup scan of a prefix as the scheduler does it (design.md section 4 item 11): stops at
/// the first miss, a pending or retry answer defers the request. `None` when deferred, else the
/// keys it would load.
fn scan(m: &mut TieringManager, request: RequestId, keys: &[ChunkKey]) -> Option<Vec<ChunkKey>> {
    let mut hits = Vec::new();
    let mut deferred = false;
    for &k in keys {
        match m.lookup(k, request) {
            LookupResult::Miss => break,
            LookupResult::Hit if !deferred => hits.push(k),
            LookupResult::Hit => {}
            LookupResult::Pending | LookupResult::Retry => deferred = true,
        }
    }
    (!deferred).then_some(hits)
}

/// Steps a waiting request (lookup scan each step) until its lookup stops deferring, at most
/// `steps_max` steps; then pins what it matched with `prepare_load`. Returns the keys loaded, or
/// `None` when it was still deferred.
fn wait_and_load(
    f: &mut Fixture,
    request: RequestId,
    keys: &[ChunkKey],
    steps_max: u32,
) -> Option<Vec<ChunkKey>> {
    for _ in 0..steps_max {
        f.manager.begin_step();
        if let Some(hits) = scan(&mut f.manager, request, keys) {
            let mut slots = Vec::new();
            f.manager
                .prepare_load(&hits, request, &mut slots)
                .expect("matched chunks are ready");
            return Some(hits);
        }
        f.manager.end_step();
    }
    None
}

#[test]
fn a_prefix_larger_than_the_host_pool_loads_what_fits_instead_of_waiting_forever() {
    // 4 host slots, a prefix of 8 chunks that only the tier holds. Before promotion pins, each
    // step's promotions evicted the previous step's (idle, not yet loaded) and the lookup
    // deferred forever.
    let mut f = fixture(4, 1);
    let prefix: Vec<ChunkKey> = (1..=8).map(key).collect();
    keys_only_in_the_tier(&mut f, &prefix);
    let r = RequestId(2);
    let loaded = wait_and_load(&mut f, r, &prefix, 20).expect("the lookup converged");
    assert_eq!(loaded, prefix[..4].to_vec(), "the part that fits, in order");
    assert_eq!(
        f.manager.promotion_pins(),
        0,
        "the load took over the promotion pins"
    );
    for &k in &prefix[..4] {
        assert_eq!(f.manager.host().ref_count(k), Some(1), "pinned by the load");
        let slot = f.manager.host().slot_of(k).expect("present");
        assert_eq!(
            read_slot_vec(f.memory.as_ref(), slot, SLOT_BYTES),
            tier_testkit::pattern(k.hash_low(), SLOT_BYTES)
        );
    }
    assert!(
        f.manager
            .tier_counters(0)
            .is_some_and(|c| c.promotion_no_space > 0),
        "the fifth chunk found no room"
    );
    f.manager.complete_load(&loaded);
    f.manager.on_request_finished(r);
    f.manager.begin_step();
    for &k in &prefix[..4] {
        assert_eq!(f.manager.host().ref_count(k), Some(0));
    }
    assert!(
        f.manager.outstanding().is_empty(),
        "{:?}",
        f.manager.outstanding()
    );
    no_fake_violations(&f);
}

#[test]
fn two_waiting_requests_larger_together_than_the_pool_both_converge() {
    // 6 host slots, two prefixes of 4 chunks that only the tier holds. `a` starts a step
    // earlier; from then on `b` looks up first in each step, so without promotion pins `b`'s
    // promotions evict `a`'s (done, idle, not yet loaded) and the other way round, forever.
    let mut f = fixture(6, 1);
    let a: Vec<ChunkKey> = (1..=4).map(key).collect();
    let b: Vec<ChunkKey> = (11..=14).map(key).collect();
    let all: Vec<ChunkKey> = a.iter().chain(&b).copied().collect();
    keys_only_in_the_tier(&mut f, &all);
    let (ra, rb) = (RequestId(2), RequestId(3));
    let mut done_a = None;
    let mut done_b = None;
    for step in 0..20 {
        f.manager.begin_step();
        let order = if step == 0 {
            vec![(ra, &a, &mut done_a)]
        } else {
            vec![(rb, &b, &mut done_b), (ra, &a, &mut done_a)]
        };
        for (r, keys, done) in order {
            if done.is_some() {
                continue;
            }
            if let Some(hits) = scan(&mut f.manager, r, keys) {
                let mut slots = Vec::new();
                f.manager.prepare_load(&hits, r, &mut slots).expect("ready");
                *done = Some(hits);
            }
        }
        f.manager.end_step();
        if done_a.is_some() && done_b.is_some() {
            break;
        }
    }
    let (Some(la), Some(lb)) = (done_a, done_b) else {
        panic!("a request still waits");
    };
    assert_eq!(la, a, "the first request keeps what was promoted for it");
    assert_eq!(lb, b[..2].to_vec(), "the second gets what is left");
    assert_eq!(f.manager.promotion_pins(), 0);
    f.manager.complete_load(&la);
    f.manager.complete_load(&lb);
    f.manager.on_request_finished(ra);
    f.manager.on_request_finished(rb);
    f.manager.begin_step();
    assert!(
        f.manager.outstanding().is_empty(),
        "{:?}",
        f.manager.outstanding()
    );
    no_fake_violations(&f);
}

#[test]
fn a_promotion_does_not_evict_the_prefix_its_own_request_just_found() {
    // Host: chunks 1 and 2 (idle) and two free slots; the tier has 1 to 6.
    let mut f = fixture(4, 1);
    keys_only_in_the_tier(&mut f, &[key(3), key(4), key(5), key(6)]);
    store(&mut f, RequestId(1), &[key(1), key(2)]);
    f.manager.on_request_finished(RequestId(1));
    let prefix: Vec<ChunkKey> = (1..=6).map(key).collect();
    let r = RequestId(2);
    let loaded = wait_and_load(&mut f, r, &prefix, 20).expect("converged");
    // Promoting 5 would have evicted 1 (and 6 evicted 2): the next scan would then miss at 1.
    assert_eq!(loaded, prefix[..4].to_vec());
    f.manager.complete_load(&loaded);
    f.manager.on_request_finished(r);
    f.manager.begin_step();
    assert!(
        f.manager.outstanding().is_empty(),
        "{:?}",
        f.manager.outstanding()
    );
}

#[test]
fn promotion_pins_go_with_the_finish_the_reset_and_the_deadline_exactly_once() {
    let clock = connector::testing::ManualClock::new();
    let options = TieringOptions {
        strict: true,
        promotion_deadline_ns: 1000,
        clock: Arc::new(clock.clone()),
        ..TieringOptions::new(SLOT_BYTES as u32)
    };
    // The host pool is strict too: a second release of a pin panics there.
    let mut f = fixture_with_options(8, vec![FakeTierConfig::default()], options);
    let keys: Vec<ChunkKey> = (1..=3).map(key).collect();
    keys_only_in_the_tier(&mut f, &keys);
    let promote = |f: &mut Fixture, r: RequestId| {
        f.manager.begin_step();
        assert_eq!(scan(&mut f.manager, r, &keys), None, "deferred");
        f.manager.end_step();
        f.manager.begin_step();
    };

    // Finish without a load.
    let r = RequestId(2);
    promote(&mut f, r);
    assert_eq!(f.manager.promotion_pins(), 3);
    assert_eq!(f.manager.host().ref_count(key(1)), Some(1));
    assert_eq!(
        scan(&mut f.manager, r, &keys),
        Some(keys.clone()),
        "the same request sees its promoted chunks as hits"
    );
    f.manager.on_request_finished(r);
    assert_eq!(f.manager.promotion_pins(), 0);
    for &k in &keys {
        assert_eq!(f.manager.host().ref_count(k), Some(0));
    }
    assert!(f.manager.is_finalized(r));

    // Reset: the pool drops the pinned chunks; the later finish releases nothing again.
    f.manager.reset();
    let r = RequestId(3);
    promote(&mut f, r);
    assert_eq!(f.manager.promotion_pins(), 3);
    f.manager.reset();
    assert_eq!(f.manager.promotion_pins(), 0);
    assert_eq!(f.manager.host().len(), 0);
    f.manager.on_request_finished(r);
    assert!(
        f.manager.outstanding().is_empty(),
        "{:?}",
        f.manager.outstanding()
    );

    // Deadline: a request that never loads gives its pins back; its finish releases nothing.
    let r = RequestId(4);
    promote(&mut f, r);
    assert_eq!(f.manager.promotion_pins(), 3);
    clock.advance(1000);
    f.manager.begin_step();
    assert_eq!(f.manager.promotion_pins(), 3, "not past the deadline yet");
    clock.advance(1);
    f.manager.begin_step();
    assert_eq!(f.manager.promotion_pins(), 0);
    assert_eq!(f.manager.counters().promotion_pins_expired, 3);
    for &k in &keys {
        assert_eq!(f.manager.host().ref_count(k), Some(0), "idle again");
    }
    f.manager.on_request_finished(r);

    // A promotion that completes after its request finished pins nothing.
    f.manager.reset();
    let r = RequestId(5);
    f.manager.begin_step();
    assert_eq!(scan(&mut f.manager, r, &keys), None);
    f.manager.on_request_finished(r);
    f.manager.drain();
    assert_eq!(f.manager.promotion_pins(), 0);
    assert_eq!(f.manager.host().ref_count(key(1)), Some(0));
    assert!(
        f.manager.outstanding().is_empty(),
        "{:?}",
        f.manager.outstanding()
    );
    assert_eq!(f.manager.counters().invariant_failures, 0);
    no_fake_violations(&f);
}

// ---- deadlines (design.md section 4 item 15) ----

/// Options on a manual clock with the given cascade and reset drain deadlines.
fn deadline_options(
    clock: &connector::testing::ManualClock,
    cascade_deadline_ns: u64,
    reset_drain_deadline_ns: u64,
) -> TieringOptions {
    TieringOptions {
        strict: true,
        cascade_deadline_ns,
        reset_drain_deadline_ns,
        clock: Arc::new(clock.clone()),
        ..TieringOptions::new(SLOT_BYTES as u32)
    }
}

fn stalled() -> FakeTierConfig {
    let mut config = FakeTierConfig::default();
    config.faults.stall = true;
    config
}

/// Whether the host pool has room for `k` (prepared and then failed, so nothing stays).
fn has_room(f: &mut Fixture, request: RequestId, k: ChunkKey) -> bool {
    let mut prepared = PreparedStore::default();
    let ok = f
        .manager
        .prepare_store(&[k], request, &mut prepared)
        .is_ok();
    if ok {
        f.manager.complete_store(&prepared.keys, false);
    }
    ok
}

fn every_job_reported_once(f: &Fixture) {
    for t in &f.tiers {
        let stats = t.with(|t| t.stats());
        assert_eq!(stats.completions_returned, stats.jobs_accepted, "{stats:?}");
        assert_eq!(t.with(|t| t.jobs_in_flight()), 0);
    }
    assert_eq!(f.manager.tier_jobs_in_flight(), 0);
    assert_eq!(f.manager.counters().invariant_failures, 0);
    no_fake_violations(f);
}

#[test]
fn a_stalled_cascade_is_cancelled_at_the_deadline_and_unpinned_only_when_reported() {
    let clock = connector::testing::ManualClock::new();
    let options = deadline_options(&clock, 1000, 1_000_000);
    let mut f = fixture_with_options(2, vec![stalled()], options);
    let r = RequestId(1);
    store(&mut f, r, &[key(1), key(2)]);
    assert_eq!(f.manager.host().ref_count(key(1)), Some(1), "cascade pin");
    assert!(
        !has_room(&mut f, r, key(3)),
        "the stalled cascade pins the pool"
    );

    clock.advance(1000);
    f.manager.begin_step();
    assert_eq!(
        f.manager.tier_counters(0).map(|c| c.cascades_timed_out),
        Some(0)
    );
    clock.advance(1);
    f.manager.begin_step();
    assert_eq!(
        f.manager.tier_counters(0).map(|c| c.cascades_timed_out),
        Some(1)
    );
    // Cancelled, but not reported yet: the tier may still read the slots.
    assert_eq!(f.manager.tier_jobs_in_flight(), 1);
    assert_eq!(
        f.manager.host().ref_count(key(1)),
        Some(1),
        "pinned until reported"
    );
    assert!(!has_room(&mut f, r, key(3)));

    f.manager.end_step();
    assert_eq!(f.manager.host().ref_count(key(1)), Some(0));
    assert_eq!(f.manager.host().ref_count(key(2)), Some(0));
    assert!(
        has_room(&mut f, r, key(3)),
        "after the deadline, new stores find room"
    );
    store(&mut f, r, &[key(3)]);
    let counters = f.manager.tier_counters(0).expect("tier");
    assert_eq!(counters.store_chunks_failed, 2);
    assert_eq!(counters.cascades_timed_out, 1, "cancelled once");
    assert_eq!(f.tiers[0].with(|t| t.stats().jobs_cancelled), 1);
    f.tiers[0].with(|t| t.faults_mut().stall = false);
    f.manager.on_request_finished(r);
    f.manager.begin_step();
    assert!(f.manager.is_finalized(r));
    every_job_reported_once(&f);
}

#[test]
fn a_cascade_queued_behind_a_busy_tier_expires_its_pins_go_and_its_request_finalizes() {
    let clock = connector::testing::ManualClock::new();
    let options = deadline_options(&clock, 1000, 1_000_000);
    let busy = FakeTierConfig {
        jobs_in_flight_max: 0,
        ..FakeTierConfig::default()
    };
    let mut f = fixture_with_options(2, vec![busy], options);
    let r = RequestId(1);
    store(&mut f, r, &[key(1), key(2)]);
    assert_eq!(
        f.manager.host().ref_count(key(2)),
        Some(1),
        "queued, pinned"
    );
    f.manager.on_request_finished(r);
    assert!(
        f.manager.is_awaiting_finalization(r),
        "its cascade is queued"
    );
    assert!(!has_room(&mut f, RequestId(2), key(3)));

    clock.advance(1000);
    f.manager.begin_step();
    assert_eq!(
        f.manager.tier_counters(0).map(|c| c.cascades_expired),
        Some(0)
    );
    assert!(f.manager.is_awaiting_finalization(r));
    clock.advance(1);
    f.manager.begin_step();
    let counters = f.manager.tier_counters(0).expect("tier");
    assert_eq!(counters.cascades_expired, 1);
    assert!(counters.submits_busy >= 2, "retried until the deadline");
    assert_eq!(counters.store_jobs, 0);
    assert_eq!(f.manager.host().ref_count(key(1)), Some(0));
    assert_eq!(f.manager.host().ref_count(key(2)), Some(0));
    assert!(
        f.manager.is_finalized(r),
        "finalized once its cascade was dropped"
    );
    store(&mut f, RequestId(2), &[key(3)]);
    f.manager.on_request_finished(RequestId(2));
    clock.advance(1001);
    f.manager.begin_step();
    assert_eq!(
        f.manager.tier_counters(0).map(|c| c.cascades_expired),
        Some(2)
    );
    assert!(
        f.manager.outstanding().is_empty(),
        "{:?}",
        f.manager.outstanding()
    );
    every_job_reported_once(&f);
}

/// A stalled tier whose `drain` would block forever while a job it holds is not cancelled (as a
/// real tier blocked on I/O does): here it panics instead. It also checks that every job is
/// reported exactly once.
struct DrainBlocksUntilCancelled {
    inner: FakeTier,
    /// Ignore `cancel` (a tier blocked in I/O that it cannot interrupt): its jobs end only when
    /// the stall is lifted, and `drain` would block forever on them.
    ignore_cancel: bool,
    open: std::collections::BTreeSet<JobId>,
    cancelled: std::collections::BTreeSet<JobId>,
    reported: std::collections::BTreeSet<JobId>,
    reported_twice: u32,
}

impl Tier for DrainBlocksUntilCancelled {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn medium(&self) -> Medium {
        self.inner.medium()
    }
    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        self.inner.lookup(key)
    }
    fn touch(&mut self, keys: &[ChunkKey]) {
        self.inner.touch(keys);
    }
    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        let id = job.id;
        self.inner.submit(job)?;
        self.open.insert(id);
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        let from = out.len();
        self.inner.poll(out);
        for c in &out[from..] {
            self.open.remove(&c.id);
            if !self.reported.insert(c.id) {
                self.reported_twice += 1;
            }
        }
    }
    fn cancel(&mut self, id: JobId) {
        if self.ignore_cancel {
            return;
        }
        self.cancelled.insert(id);
        self.inner.cancel(id);
    }
    fn drain(&mut self) {
        let stuck: Vec<&JobId> = self.open.difference(&self.cancelled).collect();
        assert!(stuck.is_empty(), "drain would block forever on {stuck:?}");
        self.inner.drain();
    }
    fn on_request_finished(&mut self, request: RequestId) {
        self.inner.on_request_finished(request);
    }
    fn shutdown(&mut self) {
        self.inner.shutdown();
    }
}

#[test]
fn reset_against_a_stalled_tier_returns_at_its_deadline_and_counts_it() {
    let clock = connector::testing::ManualClock::new();
    let deadline = 5 * connector::tiering::RESET_DRAIN_POLL_INTERVAL_NS;
    let options = deadline_options(&clock, u64::MAX, deadline);
    let memory = Arc::new(VecSlotMemory::new(2, SLOT_BYTES));
    let dyn_memory: Arc<dyn SlotMemory> = memory.clone();
    let tier = SharedTier::new(
        DrainBlocksUntilCancelled {
            inner: FakeTier::new(dyn_memory, stalled()),
            ignore_cancel: false,
            open: Default::default(),
            cancelled: Default::default(),
            reported: Default::default(),
            reported_twice: 0,
        },
        10_000,
    );
    let host = HostPool::with_strictness(
        PoolConfig {
            slot_count: 2,
            policy: EvictionPolicy::Lru,
            reuse_threshold: 0,
            events: true,
        },
        true,
    )
    .expect("pool config");
    let mut manager = TieringManager::new(host, vec![tier.boxed()], options).expect("manager");
    let r = RequestId(1);
    let mut prepared = PreparedStore::default();
    manager
        .prepare_store(&[key(1), key(2)], r, &mut prepared)
        .expect("room");
    manager.complete_store(&prepared.keys, true);
    assert_eq!(manager.tier_jobs_in_flight(), 1);

    let start = connector::Clock::now_ns(&clock);
    manager.reset();
    let waited = connector::Clock::now_ns(&clock) - start;
    assert!(
        waited >= deadline,
        "waited {waited} ns, less than the deadline"
    );
    assert!(
        waited <= deadline + connector::tiering::RESET_DRAIN_POLL_INTERVAL_NS,
        "waited {waited} ns, past the deadline"
    );
    assert_eq!(manager.counters().reset_drain_timeouts, 1);
    assert_eq!(
        manager.tier_counters(0).map(|c| c.reset_jobs_cancelled),
        Some(1)
    );
    // The cancelled job was reported before the pool's slots were freed, exactly once.
    assert_eq!(manager.tier_jobs_in_flight(), 0);
    tier.with(|t| {
        assert!(t.open.is_empty(), "{:?}", t.open);
        assert_eq!(t.reported.len(), 1);
        assert_eq!(t.reported_twice, 0);
        assert!(
            t.inner.violations().is_empty(),
            "{:?}",
            t.inner.violations()
        );
    });
    assert_eq!(manager.host().len(), 0);

    // A tier that answers in time costs the reset no timeout.
    tier.with(|t| t.inner.faults_mut().stall = false);
    manager
        .prepare_store(&[key(3)], r, &mut prepared)
        .expect("room after the reset");
    manager.complete_store(&prepared.keys, true);
    manager.reset();
    assert_eq!(manager.counters().reset_drain_timeouts, 1);
    assert_eq!(manager.tier_jobs_in_flight(), 0);
    manager.on_request_finished(r);
    assert!(
        manager.outstanding().is_empty(),
        "{:?}",
        manager.outstanding()
    );
    assert_eq!(manager.counters().invariant_failures, 0);
}

/// A manager over a two-slot pool and one stalled tier that ignores `cancel` (its `drain` would
/// block forever), on `clock` with a reset (and drain) deadline of five poll intervals.
fn manager_over_a_tier_that_ignores_cancel(
    clock: &connector::testing::ManualClock,
) -> (TieringManager, SharedTier<DrainBlocksUntilCancelled>) {
    let deadline = 5 * connector::tiering::RESET_DRAIN_POLL_INTERVAL_NS;
    let options = deadline_options(clock, u64::MAX, deadline);
    let memory = Arc::new(VecSlotMemory::new(2, SLOT_BYTES));
    let dyn_memory: Arc<dyn SlotMemory> = memory;
    let tier = SharedTier::new(
        DrainBlocksUntilCancelled {
            inner: FakeTier::new(dyn_memory, stalled()),
            ignore_cancel: true,
            open: Default::default(),
            cancelled: Default::default(),
            reported: Default::default(),
            reported_twice: 0,
        },
        10_000,
    );
    let host = HostPool::with_strictness(
        PoolConfig {
            slot_count: 2,
            policy: EvictionPolicy::Lru,
            reuse_threshold: 0,
            events: true,
        },
        true,
    )
    .expect("pool config");
    let manager = TieringManager::new(host, vec![tier.boxed()], options).expect("manager");
    (manager, tier)
}

#[test]
fn reset_against_a_tier_that_ignores_cancel_holds_its_slots_instead_of_blocking() {
    // Issue 18 item 5: the reset returns at its deadline even though the tier never reports;
    // the slots the tier may still read are held (never reused) until it does report.
    let clock = connector::testing::ManualClock::new();
    let (mut manager, tier) = manager_over_a_tier_that_ignores_cancel(&clock);
    let r = RequestId(1);
    let mut prepared = PreparedStore::default();
    manager
        .prepare_store(&[key(1), key(2)], r, &mut prepared)
        .expect("room");
    manager.complete_store(&prepared.keys, true);
    let cascaded = prepared.slots.clone();
    manager.reset();
    let counters = manager.tier_counters(0).expect("tier");
    assert_eq!(manager.counters().reset_drain_timeouts, 1);
    assert_eq!(
        (counters.reset_jobs_cancelled, counters.reset_jobs_held),
        (1, 1)
    );
    assert_eq!(manager.tier_jobs_in_flight(), 1, "not reported yet");
    assert_eq!(manager.host().held_slot_count(), 2);
    assert!(cascaded.iter().all(|&s| manager.host().is_held(s)));
    assert!(
        manager.prepare_store(&[key(3)], r, &mut prepared).is_err(),
        "a held slot is handed to no new key"
    );
    // Steps go on while the tier is stuck; then it reports: only then the slots are free.
    manager.begin_step();
    assert_eq!(manager.host().held_slot_count(), 2);
    tier.with(|t| t.inner.faults_mut().stall = false);
    manager.begin_step();
    assert_eq!(manager.tier_jobs_in_flight(), 0);
    assert_eq!(manager.host().held_slot_count(), 0);
    assert_eq!(
        manager.tier_counters(0).map(|c| c.reset_held_jobs_reported),
        Some(1)
    );
    manager
        .prepare_store(&[key(3), key(4)], r, &mut prepared)
        .expect("both slots free again");
    manager.complete_store(&prepared.keys, false);
    manager.on_request_finished(r);
    assert!(
        manager.outstanding().is_empty(),
        "{:?}",
        manager.outstanding()
    );
    tier.with(|t| assert_eq!((t.reported.len(), t.reported_twice), (1, 0)));
    assert_eq!(manager.counters().invariant_failures, 0);
}

#[test]
fn drain_and_drop_return_at_the_deadline_against_a_tier_that_ignores_cancel() {
    let clock = connector::testing::ManualClock::new();
    let (mut manager, tier) = manager_over_a_tier_that_ignores_cancel(&clock);
    let r = RequestId(1);
    let mut prepared = PreparedStore::default();
    manager
        .prepare_store(&[key(1)], r, &mut prepared)
        .expect("room");
    manager.complete_store(&prepared.keys, true);
    let start = connector::Clock::now_ns(&clock);
    assert!(!manager.drain(), "the job is still in flight");
    let waited = connector::Clock::now_ns(&clock) - start;
    assert_eq!(waited, 5 * connector::tiering::RESET_DRAIN_POLL_INTERVAL_NS);
    assert_eq!(manager.counters().drain_timeouts, 1);
    assert_eq!(manager.tier_jobs_in_flight(), 1);
    assert_eq!(manager.host().ref_count(key(1)), Some(1), "still pinned");
    // Dropping the manager waits as long again, then returns (the tier's own drop ends its I/O).
    drop(manager);
    assert_eq!(
        connector::Clock::now_ns(&clock) - start,
        10 * connector::tiering::RESET_DRAIN_POLL_INTERVAL_NS
    );
    tier.with(|t| assert_eq!(t.reported.len(), 0));
}

#[test]
fn a_slot_a_pre_reset_store_still_writes_is_not_handed_to_a_promotion() {
    // Issue 18 item 2: a GPU store into slot S is in flight at the reset. A promotion that got S
    // would have a tier thread fill it while the GPU stream still writes it.
    let mut f = fixture(1, 1);
    keys_only_in_the_tier(&mut f, &[key(9)]);
    let mut prepared = PreparedStore::default();
    f.manager
        .prepare_store(&[key(1)], RequestId(1), &mut prepared)
        .expect("room");
    let slot = prepared.slots[0];
    f.manager.reset();
    let r = RequestId(2);
    assert_eq!(
        f.manager.lookup(key(9), r),
        LookupResult::Miss,
        "no free slot while the pre-reset store may write it"
    );
    assert!(f.manager.host().is_held(slot));
    f.manager.end_step();
    assert_eq!(f.manager.tier_counters(0).map(|c| c.load_jobs), Some(0));
    // The store's last acknowledgement ends the hold (the scheduler calls release_held).
    f.manager.release_held(&[slot]);
    f.manager.begin_step();
    assert_eq!(
        f.manager.lookup(key(9), RequestId(3)),
        LookupResult::Pending
    );
    f.manager.end_step();
    assert_eq!(f.manager.tier_counters(0).map(|c| c.load_jobs), Some(1));
    assert!(wait_and_load(&mut f, RequestId(3), &[key(9)], 10).is_some());
    f.manager.complete_load(&[key(9)]);
    for id in [1, 2, 3] {
        f.manager.on_request_finished(RequestId(id));
    }
    f.manager.begin_step();
    every_job_reported_once(&f);
}
