//! End-to-end runs of kvtier's scheduler and host pool on the simulated engine: shared-prefix
//! workloads under sync and async scheduling with one and three workers, with delays, failures,
//! aborts and resets. Every run must finish every request with zero integrity failures and zero
//! broken contract rules; a failure prints the seed and the report.

use engine_sim::{
    ManagerCall, OutputOrder, Phase, SharedPrefixSpec, Sim, SimConfig, SimReport, WorkerFaults,
    Workload,
};
use offload_core::{OffloadPolicy, RequestId};

const MAX_STEPS: u64 = 20_000;

/// 16 requests arriving together: GPU prefix-cache hits, preemptions and reloads.
fn burst() -> Workload {
    Workload::shared_prefix(&SharedPrefixSpec::default())
}

/// 16 requests sharing a prefix, spaced out, with background traffic in between that evicts the
/// prefix from the GPU cache: every later request loads the prefix from the host pool.
fn churn() -> Workload {
    Workload::shared_prefix(&SharedPrefixSpec {
        arrival_gap_steps: 60,
        background_per_request: 4,
        background_tokens: 2048,
        ..SharedPrefixSpec::default()
    })
}

fn config(async_scheduling: bool, workers: u32) -> SimConfig {
    SimConfig {
        async_scheduling,
        worker_count: workers,
        num_gpu_blocks: 192,
        ..SimConfig::default()
    }
}

fn run(config: SimConfig, workload: Workload) -> (SimReport, Sim) {
    let total = workload.requests.len() as u64;
    let mut sim = Sim::new(config, workload).expect("valid setup");
    let report = match sim.run_to_completion(MAX_STEPS) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    };
    let json = serde_json::to_string_pretty(&report).unwrap_or_default();
    assert!(report.is_clean(), "seed {}: {json}", report.seed);
    assert_eq!(
        report.requests_finished + report.requests_aborted,
        total,
        "{json}"
    );
    (report, sim)
}

fn assert_loads(report: &SimReport) {
    assert!(
        report.tokens_loaded > 0 && report.loads_ok > 0,
        "no loads: {report:?}"
    );
}

#[test]
fn burst_sync_one_worker() {
    let (r, _) = run(config(false, 1), burst());
    assert_loads(&r);
    assert!(r.preemptions > 0 && r.tokens_gpu_cached_again > 0, "{r:?}");
}

#[test]
fn burst_async_one_worker() {
    let (r, _) = run(config(true, 1), burst());
    assert_loads(&r);
}

#[test]
fn burst_sync_three_workers() {
    let (r, _) = run(config(false, 3), burst());
    assert_loads(&r);
}

#[test]
fn burst_async_three_workers() {
    let (r, _) = run(config(true, 3), burst());
    assert_loads(&r);
}

#[test]
fn churn_loads_the_prefix_in_every_mode() {
    for (async_scheduling, workers) in [(false, 1), (true, 1), (false, 3), (true, 3)] {
        let (r, _) = run(config(async_scheduling, workers), churn());
        assert!(
            r.loads_ok >= 10,
            "async {async_scheduling} workers {workers}: {r:?}"
        );
        assert!(r.tokens_loaded >= 10 * 512, "{r:?}");
    }
}

#[test]
fn delayed_workers_keep_everything_correct() {
    for seed in 1..=4 {
        let faults = WorkerFaults {
            store_delay_max: 4,
            load_delay_max: 3,
            ..WorkerFaults::default()
        };
        let cfg = SimConfig {
            seed,
            faults,
            ..config(seed % 2 == 0, 3)
        };
        let (r, _) = run(cfg.clone(), burst());
        assert!(r.flushes > 0 || r.preemptions == 0, "seed {seed}: {r:?}");
        run(cfg, churn());
    }
}

#[test]
fn failed_jobs_are_recomputed_never_served() {
    for seed in 1..=4 {
        let faults = WorkerFaults {
            fail_ppm: 200_000,
            scribble_on_failure: true,
            store_delay_max: 2,
            load_delay_max: 2,
            ..WorkerFaults::default()
        };
        let cfg = SimConfig {
            seed,
            faults,
            ..config(seed % 2 == 1, 2)
        };
        let (r, _) = run(cfg, churn());
        assert!(r.acks_failed > 0, "seed {seed}: {r:?}");
    }
}

#[test]
fn aborts_are_survived() {
    for seed in 1..=4 {
        let cfg = SimConfig {
            seed,
            abort_ppm: 5_000,
            faults: WorkerFaults {
                store_delay_max: 3,
                load_delay_max: 3,
                ..WorkerFaults::default()
            },
            output_order: if seed % 2 == 0 {
                OutputOrder::AcksFirst
            } else {
                OutputOrder::FinishesFirst
            },
            ..config(seed > 2, 3)
        };
        let (r, _) = run(cfg.clone(), churn());
        assert!(r.requests_aborted > 0, "seed {seed}: {r:?}");
        run(cfg, burst());
    }
}

#[test]
fn resets_between_quiescent_steps_are_survived() {
    // Sync scheduling without delays: every job is acknowledged within its step.
    for seed in 1..=2 {
        let cfg = SimConfig {
            seed,
            reset_cache_steps: vec![40, 300, 301, 700],
            ..config(false, 3)
        };
        let (r, _) = run(cfg.clone(), churn());
        assert!(r.resets == 4 && r.loads_ok > 0, "seed {seed}: {r:?}");
        run(cfg, burst());
    }
}

#[test]
fn resets_with_jobs_in_flight_are_survived() {
    for seed in 1..=4 {
        let cfg = SimConfig {
            seed,
            reset_cache_steps: vec![40, 300, 301, 700],
            faults: WorkerFaults {
                store_delay_max: 3,
                load_delay_max: 3,
                ..WorkerFaults::default()
            },
            ..config(seed > 2, 3)
        };
        let (r, _) = run(cfg.clone(), churn());
        assert!(r.resets == 4, "seed {seed}: {r:?}");
        run(cfg, burst());
    }
}

#[test]
fn request_policy_and_prompt_only_offload() {
    for (policy, prompt_only) in [
        (OffloadPolicy::Request, false),
        (OffloadPolicy::Block, true),
        (OffloadPolicy::Request, true),
    ] {
        let cfg = SimConfig {
            offload_policy: policy,
            offload_prompt_only: prompt_only,
            ..config(true, 2)
        };
        let (r, _) = run(cfg, churn());
        assert_loads(&r);
    }
}

#[test]
fn final_stores_precede_the_finish_signal() {
    let (_, sim) = run(config(true, 1), churn());
    let checker = sim.checker();
    for id in 0..sim.request_count() as u64 {
        let id = RequestId(id);
        let last_store = checker.last_index(
            |c| matches!(c, ManagerCall::PrepareStore { request, .. } if *request == id),
        );
        let finish = checker.first_index(|c| *c == ManagerCall::RequestFinished { request: id });
        let finish =
            finish.unwrap_or_else(|| panic!("request {} never finished at the manager", id.0));
        assert!(
            last_store.is_none_or(|s| s < finish),
            "request {}: prepare_store after on_request_finished",
            id.0
        );
    }
}

#[test]
fn runs_are_deterministic() {
    let cfg = SimConfig {
        faults: WorkerFaults {
            store_delay_max: 3,
            fail_ppm: 50_000,
            ..WorkerFaults::default()
        },
        abort_ppm: 2_000,
        ..config(true, 3)
    };
    let (a, _) = run(cfg.clone(), burst());
    let (b, _) = run(cfg, burst());
    assert_eq!(a, b);
}

#[test]
fn a_loading_request_waits_until_every_worker_acknowledged() {
    let cfg = SimConfig {
        faults: WorkerFaults {
            load_delay_max: 3,
            ..WorkerFaults::default()
        },
        ..config(false, 3)
    };
    let total = churn().requests.len();
    let mut sim = Sim::new(cfg, churn()).expect("valid setup");
    let mut waited: Vec<u32> = vec![0; total];
    let mut longest = 0;
    for _ in 0..MAX_STEPS {
        if sim.is_done() {
            break;
        }
        sim.step();
        for (i, w) in waited.iter_mut().enumerate() {
            let view = sim.request(RequestId(i as u64)).expect("request");
            if view.phase == Phase::WaitingForRemote {
                *w += 1;
                longest = longest.max(*w);
            } else {
                *w = 0;
            }
        }
    }
    let report = sim.run_to_completion(MAX_STEPS).expect("completes");
    assert!(report.is_clean() && report.loads_ok >= 10, "{report:?}");
    assert!(longest >= 2, "no load was ever delayed past its step");
}
