//! The reference's lifecycle test plan, each scenario run through the engine simulator under sync
//! and async scheduling: final full and partial chunks around the finish, resets around the
//! deferred finish signal, preemption and fences, allocation failure on the finishing step, aborts
//! of never-scheduled requests, and 16 and 100 concurrent requests with one shared prefix on three
//! workers. Every loaded chunk is compared with recompute by the simulator; a failing run prints
//! its seed and report.

use engine_sim::{
    ManagerCall, RequestSpec, SharedPrefix, SharedPrefixSpec, Sim, SimConfig, SimReport,
    WorkerFaults, Workload,
};
use offload_core::RequestId;

const MAX_STEPS: u64 = 50_000;

/// Sync and async scheduling.
const MODES: [bool; 2] = [false, true];

fn run(config: SimConfig, workload: Workload) -> (SimReport, Sim) {
    let total = workload.requests.len() as u64;
    let mut sim = Sim::new(config, workload).expect("valid simulation setup");
    let report = sim
        .run_to_completion(MAX_STEPS)
        .unwrap_or_else(|e| panic!("{e}"));
    let json = serde_json::to_string_pretty(&report).unwrap_or_default();
    assert!(report.is_clean(), "seed {}: {json}", report.seed);
    assert_eq!(report.integrity_failures, 0, "{json}");
    assert_eq!(
        report.requests_finished + report.requests_aborted,
        total,
        "{json}"
    );
    assert_eq!(
        sim.scheduler().tracked_requests(),
        0,
        "per-request state leaked: {json}"
    );
    assert_eq!(
        sim.scheduler().jobs_in_flight(),
        0,
        "jobs never completed: {json}"
    );
    assert_eq!(sim.scheduler().stats().invariant_failures, 0, "{json}");
    (report, sim)
}

/// For every request: every `prepare_store` precedes its single `on_request_finished`.
fn assert_stores_precede_finish(sim: &Sim) {
    let log = sim.checker().log();
    for id in 0..sim.request_count() as u64 {
        let id = RequestId(id);
        let finishes: Vec<usize> = log
            .iter()
            .enumerate()
            .filter(|(_, c)| **c == ManagerCall::RequestFinished { request: id })
            .map(|(i, _)| i)
            .collect();
        assert_eq!(
            finishes.len(),
            1,
            "request {}: finish signalled {} times",
            id.0,
            finishes.len()
        );
        let last_store = log.iter().rposition(
            |c| matches!(c, ManagerCall::PrepareStore { request, .. } if *request == id),
        );
        assert!(
            last_store.is_none_or(|s| s < finishes[0]),
            "request {}: prepare_store after on_request_finished",
            id.0
        );
    }
}

fn request(
    arrival_step: u64,
    prefix: Option<SharedPrefix>,
    unique: u32,
    max_tokens: u32,
) -> RequestSpec {
    RequestSpec {
        arrival_step,
        prefix,
        segments: Vec::new(),
        unique_tokens: unique,
        seed: arrival_step.wrapping_mul(0x9e37_79b9) ^ u64::from(unique),
        max_tokens,
        abort_step: None,
        max_offload_tokens: None,
    }
}

/// Unrelated traffic that pushes earlier requests' blocks out of the GPU prefix cache.
fn background(workload: &mut Workload, from_step: u64, count: u32) {
    for k in 0..u64::from(count) {
        workload
            .requests
            .push(request(from_step + 4 * k, None, 2048 + k as u32, 2));
    }
}

#[test]
fn final_full_and_partial_chunks_are_stored_before_the_finish_and_load_back() {
    // Request 0 has a 100-token prompt (6 full blocks of 16: one full chunk of 4 blocks, then a
    // partial tail of 2 blocks). After background traffic, request 1 with the same prompt must
    // load both, the partial tail included, byte-identical to recompute.
    for async_scheduling in MODES {
        for prompt_only in [false, true] {
            let prefix = SharedPrefix {
                id: 77,
                tokens: 100,
            };
            let mut workload = Workload::default();
            workload.requests.push(request(0, Some(prefix), 0, 3));
            background(&mut workload, 5, 4);
            workload.requests.push(request(200, Some(prefix), 0, 3));
            let config = SimConfig {
                async_scheduling,
                offload_prompt_only: prompt_only,
                num_gpu_blocks: 160,
                worker_count: 2,
                ..SimConfig::default()
            };
            let (report, sim) = run(config, workload);
            assert_stores_precede_finish(&sim);
            assert!(
                report.finishes_deferred > 0,
                "no deferred final store: {report:?}"
            );
            assert!(
                report.tokens_loaded >= 96,
                "async {async_scheduling} prompt_only {prompt_only}: the full chunk and the \
                 partial tail were not both loaded: {report:?}"
            );
        }
    }
}

#[test]
fn deferred_finish_signals_survive_resets_exactly_once() {
    for async_scheduling in MODES {
        for seed in 1..=3 {
            let spec = SharedPrefixSpec {
                arrival_gap_steps: 25,
                background_per_request: 2,
                background_tokens: 1024,
                max_tokens: 5,
                seed,
                ..SharedPrefixSpec::default()
            };
            let config = SimConfig {
                seed,
                async_scheduling,
                worker_count: 3,
                num_gpu_blocks: 192,
                faults: WorkerFaults {
                    store_delay_max: 3,
                    load_delay_max: 2,
                    ..WorkerFaults::default()
                },
                reset_cache_steps: (1..40).map(|k| k * 11).collect(),
                ..SimConfig::default()
            };
            let (report, sim) = run(config, Workload::shared_prefix(&spec));
            assert!(report.resets > 10, "{report:?}");
            assert!(report.finishes_deferred > 0, "{report:?}");
            assert_stores_precede_finish(&sim);
            let log = sim.checker().log();
            assert!(
                log.contains(&ManagerCall::Reset),
                "no reset reached the manager"
            );
        }
    }
}

#[test]
fn preemption_and_fences_flush_pending_stores() {
    // A GPU cache too small for the batch forces preemptions while stores are still pending on
    // slow workers. Workers copy at completion time, so a store that was not flushed before its
    // blocks were reused would copy the new owner's bytes: a store mismatch in the report.
    for async_scheduling in MODES {
        for seed in 1..=3 {
            let config = SimConfig {
                seed,
                async_scheduling,
                worker_count: 3,
                num_gpu_blocks: 96,
                faults: WorkerFaults {
                    store_delay_max: 4,
                    ..WorkerFaults::default()
                },
                ..SimConfig::default()
            };
            let (report, _) = run(
                config,
                Workload::shared_prefix(&SharedPrefixSpec::default()),
            );
            assert!(report.preemptions > 0, "no preemption: {report:?}");
            assert!(report.flushes > 0, "no flush: {report:?}");
            assert_eq!(report.store_mismatches, 0);
        }
    }
}

#[test]
fn allocation_failures_are_retried_and_never_lose_a_finish() {
    // A host pool of 6 slots for 16 requests: prepare_store often finds no room.
    for async_scheduling in MODES {
        let config = SimConfig {
            async_scheduling,
            host_slots: 6,
            worker_count: 2,
            faults: WorkerFaults {
                store_delay_max: 3,
                load_delay_max: 1,
                ..WorkerFaults::default()
            },
            ..SimConfig::default()
        };
        let spec = SharedPrefixSpec {
            arrival_gap_steps: 3,
            ..SharedPrefixSpec::default()
        };
        let (_, sim) = run(config, Workload::shared_prefix(&spec));
        let failures = sim
            .checker()
            .log()
            .iter()
            .filter(|c| matches!(c, ManagerCall::PrepareStore { ok: false, .. }));
        assert!(failures.count() > 0, "the pool never ran out of room");
        assert!(sim.scheduler().stats().allocation_failures > 0);
        assert_stores_precede_finish(&sim);
    }
}

#[test]
fn aborting_a_never_scheduled_request_builds_no_job() {
    for async_scheduling in MODES {
        let prefix = SharedPrefix { id: 5, tokens: 256 };
        let mut workload = Workload::default();
        workload.requests.push(request(0, Some(prefix), 64, 8));
        let mut never = request(3, Some(prefix), 64, 8);
        never.abort_step = Some(3);
        workload.requests.push(never);
        let config = SimConfig {
            async_scheduling,
            ..SimConfig::default()
        };
        let (report, sim) = run(config, workload);
        assert_eq!(report.requests_aborted, 1);
        let id = RequestId(1);
        let calls: Vec<&ManagerCall> = sim
            .checker()
            .log()
            .iter()
            .filter(|c| c.request() == Some(id))
            .collect();
        assert!(
            !calls.iter().any(|c| matches!(
                c,
                ManagerCall::PrepareStore { .. } | ManagerCall::PrepareLoad { .. }
            )),
            "a never-scheduled abort built a job: {calls:?}"
        );
        assert_eq!(
            calls.last(),
            Some(&&ManagerCall::RequestFinished { request: id })
        );
    }
}

fn concurrent_shared_prefix(requests: u32) {
    for async_scheduling in MODES {
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
        let (report, sim) = run(config, Workload::shared_prefix(&spec));
        assert_eq!(report.requests_finished, u64::from(requests));
        assert!(
            report.loads_ok > 0,
            "no chunk was ever loaded back: {report:?}"
        );
        assert!(
            report.jobs_acked >= 3 * (report.store_jobs + report.load_jobs),
            "{report:?}"
        );
        assert_stores_precede_finish(&sim);
    }
}

#[test]
fn sixteen_concurrent_requests_with_one_shared_prefix() {
    concurrent_shared_prefix(16);
}

#[test]
fn a_hundred_concurrent_requests_with_one_shared_prefix() {
    concurrent_shared_prefix(100);
}
