//! Cross-tier runs of the engine simulator through the connector: the host pool plus the disk
//! tier (tier-fs in a temporary directory) and the peer tier (tier-p2p, two instances over
//! loopback), and fake tiers that fail mid-run. Every loaded chunk is compared with recompute by
//! the simulator; every tier's call log is checked against the lifecycle contract (a tier hears
//! `on_request_finished` exactly once per request, after every job naming it).

use kvtier_tests::FailingTier;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use connector::testing::ManualClock;
use connector::testing::{SharedTier, TierCall};
use connector::{TieringManager, TieringOptions};
use engine_sim::host::HostMemory;
use engine_sim::{
    KvHandle, ManagerCall, RequestSpec, SharedPrefix, SharedPrefixSpec, Sim, SimConfig, SimReport,
    WorkerFaults, Workload,
};
use offload_core::tier::Tier;
use offload_core::{HostPool, RequestId, SlotMemory};
use tier_fs::{FsTier, FsTierConfig, NamespaceId};
use tier_p2p::{Namespace, P2pConfig, P2pTier};
use tier_testkit::{FakeTier, FakeTierConfig};

type TieredSim = Sim<KvHandle<TieringManager>>;

/// Sync and async scheduling.
const MODES: [bool; 2] = [false, true];

/// Wall-clock bound of one run (peer lookups answer `Retry` until the peer replies).
const RUN_DEADLINE: Duration = Duration::from_secs(60);

const LOG_MAX: usize = 1 << 20;

fn fs_tier(dir: &std::path::Path, memory: Arc<dyn SlotMemory>, config: &SimConfig) -> FsTier {
    let namespace = NamespaceId {
        model: "engine-sim".to_owned(),
        dtype: "u8".to_owned(),
        tokens_per_chunk: config.tokens_per_block * config.blocks_per_chunk,
        parallel_layout: "tp1".to_owned(),
    };
    let fs = FsTierConfig {
        workers: 2,
        threads: 1,
        quiet: true,
        ..FsTierConfig::new(dir, namespace, 64 << 20)
    };
    FsTier::start(fs, memory).unwrap_or_else(|e| panic!("disk tier: {e}"))
}

fn p2p_tier(memory: Arc<dyn SlotMemory>, peers: Vec<std::net::SocketAddr>) -> P2pTier {
    let config = P2pConfig {
        peers: peers.into_iter().map(Into::into).collect(),
        lookup_cache_ttl: Duration::from_millis(1),
        ..P2pConfig::new(Namespace::new(
            &tier_p2p::NamespaceId {
                model: "engine-sim".into(),
                dtype: "u8".into(),
                tokens_per_chunk: 16,
                parallel_layout: "x4".into(),
            },
            1,
            1,
        ))
    };
    P2pTier::new(config, memory).unwrap_or_else(|e| panic!("peer tier: {e}"))
}

/// Steps until done (or the deadline), drains the tiers, and runs the end-of-run checks.
fn drive(sim: &mut TieredSim) -> SimReport {
    drive_with(sim, false)
}

/// Like [`drive`]; with `paced`, every step waits for the tiers' I/O (an engine whose steps take
/// longer than a disk write: the simulator's steps take microseconds, so otherwise cascades
/// still pin their host slots when the next requests need room).
fn drive_with(sim: &mut TieredSim, paced: bool) -> SimReport {
    let end = Instant::now() + RUN_DEADLINE;
    while !sim.is_done() && Instant::now() < end {
        sim.step();
        if paced {
            sim.handle_mut().drain_tiers();
        }
    }
    sim.handle_mut().drain_tiers();
    let report = sim
        .run_to_completion(1000)
        .unwrap_or_else(|e| panic!("{e}"));
    let json = serde_json::to_string_pretty(&report).unwrap_or_default();
    assert!(report.is_clean(), "seed {}: {json}", report.seed);
    let total = sim.request_count() as u64;
    assert_eq!(
        report.requests_finished + report.requests_aborted,
        total,
        "{json}"
    );
    let tiering = sim.handle().tiering();
    assert!(
        tiering.outstanding().is_empty(),
        "{:?}",
        tiering.outstanding()
    );
    assert_eq!(tiering.tracked_requests(), 0, "per-request state leaked");
    assert_eq!(tiering.counters().invariant_failures, 0);
    assert_eq!(sim.handle().scheduler().tracked_requests(), 0);
    report
}

/// Each request: every manager `prepare_store` precedes its single `on_request_finished`.
fn assert_stores_precede_finish(sim: &TieredSim) {
    let log = sim.handle().manager().log();
    for id in 0..sim.request_count() as u64 {
        let id = RequestId(id);
        let finishes: Vec<usize> = log
            .iter()
            .enumerate()
            .filter(|(_, c)| **c == ManagerCall::RequestFinished { request: id })
            .map(|(i, _)| i)
            .collect();
        assert_eq!(finishes.len(), 1, "request {}", id.0);
        let last_store = log.iter().rposition(
            |c| matches!(c, ManagerCall::PrepareStore { request, .. } if *request == id),
        );
        assert!(
            last_store.is_none_or(|s| s < finishes[0]),
            "request {}",
            id.0
        );
    }
}

/// A tier's log: every request of the run heard `on_request_finished` exactly once, after every
/// job naming it was submitted.
fn assert_tier_lifecycle(log: &[TierCall], requests: usize) {
    let mut finished: BTreeMap<RequestId, usize> = BTreeMap::new();
    for (i, call) in log.iter().enumerate() {
        match call {
            TierCall::Finished(r) => {
                assert!(finished.insert(*r, i).is_none(), "{r:?} finished twice");
            }
            TierCall::Submit {
                request: Some(r), ..
            } => {
                assert!(
                    !finished.contains_key(r),
                    "job for {r:?} after its on_request_finished"
                );
            }
            _ => {}
        }
    }
    for id in 0..requests as u64 {
        assert!(
            finished.contains_key(&RequestId(id)),
            "request {id} never reached the tier"
        );
    }
}

fn request(
    arrival: u64,
    prefix: Option<SharedPrefix>,
    unique: u32,
    max_tokens: u32,
) -> RequestSpec {
    RequestSpec {
        arrival_step: arrival,
        prefix,
        segments: Vec::new(),
        unique_tokens: unique,
        seed: arrival.wrapping_mul(0x9e37_79b9) ^ u64::from(unique),
        max_tokens,
        abort_step: None,
        max_offload_tokens: None,
    }
}

/// Unrelated traffic that pushes earlier requests out of the GPU cache (and, with a small host
/// pool, out of the host pool).
fn background(workload: &mut Workload, from_step: u64, count: u32) {
    for k in 0..u64::from(count) {
        workload
            .requests
            .push(request(from_step + 4 * k, None, 2048 + k as u32, 2));
    }
}

fn counters(sim: &TieredSim, tier: usize) -> connector::TierCounters {
    sim.handle()
        .tiering()
        .tier_counters(tier)
        .expect("tier exists")
}

#[test]
fn reference_failure_scenario_with_disk_and_peer_tiers() {
    // The reference crashed here: the final store of a request is built in the same step that
    // handles its finish, with secondary tiers present, offload_prompt_only=false, async
    // scheduling. A 100-token prompt: one full chunk plus a partial tail, both stored at the
    // finish; a later request with the same prompt loads both.
    for async_scheduling in MODES {
        let dir = tempfile::tempdir().expect("temp dir");
        let prefix = SharedPrefix {
            id: 77,
            tokens: 100,
        };
        let mut workload = Workload::default();
        workload.requests.push(request(0, Some(prefix), 0, 3));
        background(&mut workload, 5, 4);
        workload.requests.push(request(200, Some(prefix), 0, 3));
        let requests = workload.requests.len();
        let config = SimConfig {
            async_scheduling,
            offload_prompt_only: false,
            num_gpu_blocks: 160,
            worker_count: 2,
            ..SimConfig::default()
        };
        let mut handles = None;
        let cfg = config.clone();
        let mut sim = Sim::with_tiers(config, workload, |memory| {
            let fs = SharedTier::new(fs_tier(dir.path(), memory.clone(), &cfg), LOG_MAX);
            let p2p = SharedTier::new(p2p_tier(memory, Vec::new()), LOG_MAX);
            let boxed = vec![fs.boxed(), p2p.boxed()];
            handles = Some((fs, p2p));
            boxed
        })
        .expect("valid setup");
        let report = drive(&mut sim);
        assert!(
            report.finishes_deferred > 0,
            "no deferred final store: {report:?}"
        );
        assert!(report.tokens_loaded >= 96, "{report:?}");
        assert_stores_precede_finish(&sim);
        let (fs, p2p) = handles.expect("tiers built");
        assert_tier_lifecycle(&fs.log(), requests);
        assert_tier_lifecycle(&p2p.log(), requests);
        assert!(counters(&sim, 0).chunks_stored > 0 && counters(&sim, 1).chunks_stored > 0);
    }
}

fn concurrent_shared_prefix(requests: u32) {
    for async_scheduling in MODES {
        let dir = tempfile::tempdir().expect("temp dir");
        let spec = SharedPrefixSpec {
            requests,
            ..SharedPrefixSpec::default()
        };
        let config = SimConfig {
            async_scheduling,
            worker_count: 3,
            num_gpu_blocks: 256,
            host_slots: 1024,
            max_num_seqs: 32,
            faults: WorkerFaults {
                store_delay_max: 2,
                load_delay_max: 2,
                ..WorkerFaults::default()
            },
            ..SimConfig::default()
        };
        let cfg = config.clone();
        let mut fs_handle = None;
        let mut sim = Sim::with_tiers(config, Workload::shared_prefix(&spec), |memory| {
            let fs = SharedTier::new(fs_tier(dir.path(), memory.clone(), &cfg), LOG_MAX);
            let boxed = vec![
                fs.boxed(),
                Box::new(p2p_tier(memory, Vec::new())) as Box<dyn Tier>,
            ];
            fs_handle = Some(fs);
            boxed
        })
        .expect("valid setup");
        let report = drive(&mut sim);
        assert_eq!(report.requests_finished, u64::from(requests));
        assert!(report.loads_ok > 0, "no chunk was loaded back: {report:?}");
        assert_stores_precede_finish(&sim);
        let fs = fs_handle.expect("built");
        assert_tier_lifecycle(&fs.log(), requests as usize);
        let shared_chunks = (spec.prefix_tokens / (16 * 4)) as u64;
        assert!(counters(&sim, 0).chunks_stored >= shared_chunks);
        // Content addressing: the shared prefix is cascaded once, not once per request.
        assert!(
            counters(&sim, 0).store_jobs < u64::from(requests) * 20,
            "{:?}",
            counters(&sim, 0)
        );
    }
}

#[test]
fn sixteen_concurrent_requests_with_one_shared_prefix_across_tiers() {
    concurrent_shared_prefix(16);
}

#[test]
fn a_hundred_concurrent_requests_with_one_shared_prefix_across_tiers() {
    concurrent_shared_prefix(100);
}

/// A workload whose prefix is evicted from a small host pool by background traffic, then asked
/// for again.
fn evicting_workload() -> Workload {
    let prefix = SharedPrefix { id: 5, tokens: 512 };
    let mut workload = Workload::default();
    workload.requests.push(request(0, Some(prefix), 64, 4));
    background(&mut workload, 10, 8);
    workload.requests.push(request(400, Some(prefix), 64, 4));
    workload
}

fn small_pool_config(async_scheduling: bool) -> SimConfig {
    SimConfig {
        async_scheduling,
        worker_count: 2,
        num_gpu_blocks: 160,
        host_slots: 40,
        ..SimConfig::default()
    }
}

#[test]
fn a_chunk_evicted_from_the_host_pool_is_promoted_back_from_disk() {
    for async_scheduling in MODES {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = small_pool_config(async_scheduling);
        let cfg = config.clone();
        let mut sim = Sim::with_tiers(config, evicting_workload(), |memory| {
            vec![Box::new(fs_tier(dir.path(), memory, &cfg)) as Box<dyn Tier>]
        })
        .expect("valid setup");
        let report = drive_with(&mut sim, true);
        let fs = counters(&sim, 0);
        assert!(
            sim.handle().metrics().host.evictions > 0,
            "nothing was evicted: {:?} {report:?}",
            sim.handle().metrics()
        );
        assert!(
            fs.chunks_loaded >= 8,
            "prefix not promoted from disk: {fs:?}"
        );
        assert!(report.tokens_loaded >= 512, "{report:?}");
        let text = sim.handle().prometheus_text();
        assert!(
            text.contains(&format!(
                "kvtier_chunks_total{{tier=\"fs\",direction=\"load\",result=\"ok\"}} {}",
                fs.chunks_loaded
            )),
            "{text}"
        );
    }
}

#[test]
fn a_peer_serves_what_another_instance_stored() {
    // Instance A runs the prefix and publishes it; instance B, whose only secondary tier is a
    // peer tier pointed at A, loads it over loopback instead of recomputing.
    let prefix = SharedPrefix { id: 9, tokens: 512 };
    let mut first = Workload::default();
    first.requests.push(request(0, Some(prefix), 64, 4));
    let mut second = Workload::default();
    second.requests.push(request(0, Some(prefix), 32, 4));
    let config = SimConfig {
        worker_count: 2,
        ..SimConfig::default()
    };
    let mut addr = None;
    let mut a = Sim::with_tiers(config.clone(), first, |memory| {
        let tier = p2p_tier(memory, Vec::new());
        addr = Some(tier.local_addr());
        vec![Box::new(tier) as Box<dyn Tier>]
    })
    .expect("valid setup");
    drive(&mut a);
    assert!(counters(&a, 0).chunks_stored >= 8, "{:?}", counters(&a, 0));
    let peer = addr.expect("listening");
    let mut b = Sim::with_tiers(config, second, |memory| {
        vec![Box::new(p2p_tier(memory, vec![peer])) as Box<dyn Tier>]
    })
    .expect("valid setup");
    let report = drive(&mut b);
    let p2p = counters(&b, 0);
    assert!(
        p2p.chunks_loaded >= 8,
        "prefix not fetched from the peer: {p2p:?}"
    );
    assert!(report.tokens_loaded >= 512, "{report:?}");
}

#[test]
fn a_secondary_tier_failing_mid_run_costs_recompute_only() {
    for async_scheduling in MODES {
        let config = small_pool_config(async_scheduling);
        let broken = Arc::new(AtomicBool::new(false));
        let flag = broken.clone();
        let mut sim = Sim::with_tiers(config, evicting_workload(), |memory| {
            let fake = FakeTier::new(memory, FakeTierConfig::default());
            // Once `broken` is set, every job fails all its keys; lookups answer as before.
            vec![Box::new(FailingTier::new(fake, move |_| {
                flag.load(Ordering::Relaxed)
            })) as Box<dyn Tier>]
        })
        .expect("valid setup");
        // The first request's chunks reach the tier; then it breaks.
        while sim.current_step() < 300 {
            sim.step();
        }
        assert!(counters(&sim, 0).chunks_stored >= 8);
        broken.store(true, Ordering::Relaxed);
        let report = drive(&mut sim);
        let c = counters(&sim, 0);
        assert!(c.load_chunks_failed > 0, "no promotion was tried: {c:?}");
        assert_eq!(c.chunks_loaded, 0, "{c:?}");
        assert!(
            report.requests_finished == sim.request_count() as u64,
            "{report:?}"
        );
    }
}

#[test]
fn a_stalled_tier_is_cut_off_by_the_promotion_deadline() {
    // A tier that stops completing jobs (its own deadlines broken): the manager cancels the
    // promotion after its deadline (simulated time), the request recomputes.
    let config = small_pool_config(true);
    let host = HostMemory::new(config.host_slots, config.slot_bytes());
    let fake = SharedTier::new(
        FakeTier::new(host.slot_memory(), FakeTierConfig::default()),
        LOG_MAX,
    );
    let clock = ManualClock::new();
    let options = TieringOptions {
        strict: true,
        promotion_deadline_ns: 1_000_000,
        clock: Arc::new(clock.clone()),
        ..TieringOptions::new(config.slot_bytes() as u32)
    };
    let pool = HostPool::with_strictness(config.pool_config(), true).expect("pool");
    let manager = TieringManager::new(pool, vec![fake.boxed()], options).expect("manager");
    let mut sim: TieredSim =
        Sim::with_handle(config, evicting_workload(), manager, host).expect("valid setup");
    while sim.current_step() < 300 {
        sim.step();
        clock.advance(10_000);
    }
    fake.with(|t| t.faults_mut().stall = true);
    let end = Instant::now() + RUN_DEADLINE;
    while !sim.is_done() && Instant::now() < end {
        sim.step();
        clock.advance(10_000);
    }
    let report = drive(&mut sim);
    let c = counters(&sim, 0);
    assert!(c.promotions_timed_out > 0, "{c:?}");
    assert_eq!(c.chunks_loaded, 0, "{c:?}");
    assert_eq!(report.requests_finished, sim.request_count() as u64);
}

#[test]
fn reset_cache_under_load_keeps_the_disk_tier_and_promotes_from_it() {
    for async_scheduling in MODES {
        let dir = tempfile::tempdir().expect("temp dir");
        let spec = SharedPrefixSpec {
            requests: 24,
            arrival_gap_steps: 15,
            background_per_request: 1,
            background_tokens: 2048,
            ..SharedPrefixSpec::default()
        };
        let config = SimConfig {
            async_scheduling,
            worker_count: 2,
            num_gpu_blocks: 192,
            reset_cache_steps: vec![40, 90, 91, 200, 260],
            faults: WorkerFaults {
                store_delay_max: 3,
                load_delay_max: 3,
                ..WorkerFaults::default()
            },
            ..SimConfig::default()
        };
        let cfg = config.clone();
        let mut fs_handle = None;
        let mut sim = Sim::with_tiers(config, Workload::shared_prefix(&spec), |memory| {
            let fs = SharedTier::new(fs_tier(dir.path(), memory, &cfg), LOG_MAX);
            let boxed = vec![fs.boxed()];
            fs_handle = Some(fs);
            boxed
        })
        .expect("valid setup");
        let report = drive(&mut sim);
        assert_eq!(report.resets, 5);
        assert_stores_precede_finish(&sim);
        let fs = fs_handle.expect("built");
        assert_tier_lifecycle(&fs.log(), sim.request_count());
        let c = counters(&sim, 0);
        assert!(
            c.chunks_loaded > 0,
            "nothing promoted after the resets: {c:?} {:?} {report:?}",
            sim.handle().metrics()
        );
        assert_eq!(sim.handle().tiering().counters().resets, 5);
    }
}
