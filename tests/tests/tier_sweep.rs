//! A seed sweep of random engine scenarios (settings, workload, worker delays and failures,
//! aborts, resets) on the tiering manager with two deterministic fake tiers: first one that fails
//! some of its jobs (stores and promotions), then one slow and often busy whose lookups first
//! answer "retry". Each run must finish
//! cleanly (every loaded chunk equal to recompute), leave no tier job or request state behind,
//! and keep the tier lifecycle (each request's finish heard once, after every job naming it).
//! `KVTIER_TIER_SEEDS=N` sweeps more seeds; `KVTIER_TIER_SEED=S` replays one.

use kvtier_tests::FailingTier;
use std::collections::BTreeSet;
use std::sync::Arc;

use connector::testing::ManualClock;
use connector::testing::{SharedTier, TierCall};
use connector::{TieringManager, TieringOptions};
use engine_sim::host::HostMemory;
use engine_sim::scenario::{random_scenario, ScenarioLimits};
use engine_sim::{KvHandle, Sim};
use offload_core::{HostPool, Medium};
use tier_testkit::{FakeTier, FakeTierConfig};

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("KVTIER_TIER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    let count = std::env::var("KVTIER_TIER_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(32);
    (1..=count).collect()
}

fn check_tier_log(seed: u64, log: &[TierCall], requests: usize) {
    let mut finished = BTreeSet::new();
    for call in log {
        match call {
            TierCall::Finished(r) => assert!(finished.insert(*r), "seed {seed}: {r:?} twice"),
            TierCall::Submit {
                request: Some(r), ..
            } => assert!(
                !finished.contains(r),
                "seed {seed}: job for {r:?} after its finish"
            ),
            _ => {}
        }
    }
    assert_eq!(finished.len(), requests, "seed {seed}: finishes heard");
}

#[test]
fn random_scenarios_on_slow_busy_and_flaky_tiers() {
    let mut totals = [0u64; 5];
    for seed in seeds() {
        let replay =
            format!("replay: KVTIER_TIER_SEED={seed} cargo test -p kvtier-tests --test tier_sweep");
        let (config, workload) = random_scenario(seed, ScenarioLimits::default());
        let requests = workload.requests.len();
        let host = HostMemory::new(config.host_slots, config.slot_bytes());
        let slow = SharedTier::new(
            FakeTier::new(
                host.slot_memory(),
                FakeTierConfig {
                    name: "slow".to_owned(),
                    completion_delay_polls: (seed % 4) as u32,
                    jobs_in_flight_max: 2 + (seed % 5) as usize,
                    lookup_retry_count: (seed % 3) as u32,
                    ..FakeTierConfig::default()
                },
            ),
            1 << 20,
        );
        let flaky = SharedTier::new(
            // Fails every job whose id is divisible by `every` (all its keys).
            {
                let every = 2 + seed % 4;
                FailingTier::new(
                    FakeTier::new(
                        host.slot_memory(),
                        FakeTierConfig {
                            name: "flaky".to_owned(),
                            medium: Medium::Peer,
                            ..FakeTierConfig::default()
                        },
                    ),
                    move |job| job.id.0 % every == 0,
                )
            },
            1 << 20,
        );
        let clock = ManualClock::new();
        let options = TieringOptions {
            strict: true,
            promotion_deadline_ns: 20_000_000,
            clock: Arc::new(clock.clone()),
            ..TieringOptions::new(config.slot_bytes() as u32)
        };
        let pool = HostPool::with_strictness(config.pool_config(), true).expect("pool");
        let manager =
            TieringManager::new(pool, vec![flaky.boxed(), slow.boxed()], options).expect("manager");
        let mut sim: Sim<KvHandle> = Sim::with_handle(config.clone(), workload, manager, host)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}; {replay}"));
        for _ in 0..50_000 {
            if sim.is_done() {
                break;
            }
            sim.step();
            clock.advance(1_000_000);
        }
        sim.handle_mut().drain_tiers();
        let report = sim
            .run_to_completion(100)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}; {replay}; config {config:?}"));
        assert!(report.is_clean(), "seed {seed}: {report:?}; {replay}");
        let tiering = sim.handle().tiering();
        for i in 0..2 {
            let c = tiering.tier_counters(i).expect("tier");
            totals[0] += c.chunks_loaded;
            totals[1] += c.load_chunks_failed;
            totals[2] += c.submits_busy;
            totals[3] += c.retries;
            totals[4] += c.chunks_stored;
        }
        assert!(
            tiering.outstanding().is_empty(),
            "seed {seed}: {:?}; {replay}",
            tiering.outstanding()
        );
        assert_eq!(tiering.tracked_requests(), 0, "seed {seed}; {replay}");
        check_tier_log(seed, &slow.log(), requests);
        check_tier_log(seed, &flaky.log(), requests);
        let violations = slow.with(|t| t.violations().to_vec());
        assert!(
            violations.is_empty(),
            "seed {seed}: {violations:?}; {replay}"
        );
        let violations = flaky.with(|t| t.inner().violations().to_vec());
        assert!(
            violations.is_empty(),
            "seed {seed}: {violations:?}; {replay}"
        );
    }
    // The sweep as a whole must have exercised promotions that landed and failed, busy tiers,
    // retried lookups and cascades (when one seed is replayed, only report).
    eprintln!("promoted, failed, busy, retries, cascaded: {totals:?}");
    if seeds().len() > 8 {
        assert!(totals.iter().all(|&t| t > 0), "{totals:?}");
    }
}
