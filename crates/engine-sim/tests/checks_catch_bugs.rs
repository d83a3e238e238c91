//! The simulator's checks must catch real bugs: each test breaks one thing (a copy, a fence, a
//! release, a job's target) between kvtier and the engine, runs in counting (non-strict) mode, and
//! asserts that the matching counter is non-zero. A baseline engine without offload is clean.

use engine_sim::connector::KvScheduler;
use engine_sim::{
    CopyDirection, CopyEngine, EngineConnector, MemcpyEngine, NullConnector, SharedPrefixSpec, Sim,
    SimConfig, SimReport, WorkerFaults, Workload,
};
use offload_core::scheduler::FinishedRequest;
use offload_core::{
    BlockId, ConnectorMeta, HostPool, KvEvent, MatchResult, NewRequest, RequestId, Scheduler,
    StepInput, UpdateOutcome, WorkerOutput,
};

/// What a [`Mutant`] breaks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Bug {
    /// Drops every `flush`: stores may read blocks already given to another request.
    NoFlush,
    /// Tells the engine to free blocks at once even while final stores are pending.
    FreeAtFinish,
    /// Loads into the wrong GPU blocks (rotated within the job).
    RotateLoadBlocks,
    /// Never delivers `take_released`.
    NeverRelease,
}

/// kvtier's scheduler with one bug injected between it and the engine.
struct Mutant {
    inner: KvScheduler<HostPool>,
    bug: Bug,
}

impl EngineConnector for Mutant {
    fn on_new_request(&mut self, request: NewRequest) {
        self.inner.on_new_request(request);
    }
    fn get_num_new_matched_tokens(
        &mut self,
        id: RequestId,
        n: u32,
        h: &[u128],
        c: u32,
    ) -> MatchResult {
        EngineConnector::get_num_new_matched_tokens(&mut self.inner, id, n, h, c)
    }
    fn update_state_after_alloc(&mut self, id: RequestId, blocks: &[BlockId], ext: u32) {
        EngineConnector::update_state_after_alloc(&mut self.inner, id, blocks, ext);
    }
    fn build_connector_meta(&mut self, step: &StepInput<'_>) -> ConnectorMeta {
        let mut meta = EngineConnector::build_connector_meta(&mut self.inner, step);
        match self.bug {
            Bug::NoFlush => meta.flush.clear(),
            Bug::RotateLoadBlocks => {
                for job in &mut meta.loads {
                    for t in &mut job.transfers {
                        t.gpu_blocks.rotate_left(1);
                    }
                }
            }
            Bug::FreeAtFinish | Bug::NeverRelease => {}
        }
        meta
    }
    fn update_connector_output(&mut self, outputs: &[WorkerOutput]) -> UpdateOutcome {
        EngineConnector::update_connector_output(&mut self.inner, outputs)
    }
    fn request_finished(&mut self, request: &FinishedRequest<'_>) -> bool {
        let keep = EngineConnector::request_finished(&mut self.inner, request);
        keep && self.bug != Bug::FreeAtFinish
    }
    fn reset_cache(&mut self) -> UpdateOutcome {
        EngineConnector::reset_cache(&mut self.inner)
    }
    fn take_released(&mut self, out: &mut Vec<RequestId>) {
        let mut released = Vec::new();
        EngineConnector::take_released(&mut self.inner, &mut released);
        if !matches!(self.bug, Bug::NeverRelease | Bug::FreeAtFinish) {
            out.append(&mut released);
        }
    }
    fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        EngineConnector::take_events(&mut self.inner, out);
    }
    fn is_request_closed(&self, id: RequestId) -> bool {
        self.inner.is_request_closed(id)
    }
    fn end_of_run_problems(&self, out: &mut Vec<String>) {
        self.inner.end_of_run_problems(out);
    }
    fn violations(&self) -> (u64, &[String]) {
        self.inner.violations()
    }
}

fn lax(seed: u64) -> SimConfig {
    SimConfig {
        seed,
        strict: false,
        num_gpu_blocks: 192,
        worker_count: 2,
        faults: WorkerFaults {
            store_delay_max: 6,
            ..WorkerFaults::default()
        },
        ..SimConfig::default()
    }
}

fn churn() -> Workload {
    Workload::shared_prefix(&SharedPrefixSpec {
        arrival_gap_steps: 60,
        background_per_request: 4,
        background_tokens: 2048,
        ..SharedPrefixSpec::default()
    })
}

fn mutant(cfg: SimConfig, workload: Workload, bug: Bug, steps: u64) -> SimReport {
    let pool = HostPool::new(cfg.pool_config()).expect("pool");
    let checked = engine_sim::CheckedManager::new(pool, false, 1 << 16);
    let inner = Scheduler::new(cfg.scheduler_config(), checked).expect("scheduler");
    let mut sim = Sim::with_connector(cfg, workload, Mutant { inner, bug }).expect("sim");
    match sim.run_to_completion(steps) {
        Ok(r) => r,
        Err(_) => sim.report(),
    }
}

#[test]
fn baseline_without_offload_is_clean_and_loads_nothing() {
    for async_scheduling in [false, true] {
        let cfg = SimConfig {
            async_scheduling,
            ..lax(1)
        };
        let mut sim = Sim::with_connector(cfg, churn(), NullConnector).expect("sim");
        let r = sim.run_to_completion(20_000).expect("completes");
        assert!(r.is_clean(), "{r:?}");
        assert_eq!(r.tokens_loaded, 0);
        assert_eq!(r.requests_finished, 80);
    }
}

/// Corrupts one byte of every copy in one direction.
struct Corrupting(CopyDirection);

impl CopyEngine for Corrupting {
    fn copy_blocks(
        &mut self,
        d: CopyDirection,
        gpu: &mut [u8],
        host: &mut [u8],
        copies: &[engine_sim::host::BlockCopy],
    ) -> Result<(), String> {
        MemcpyEngine.copy_blocks(d, gpu, host, copies)?;
        if d != self.0 {
            return Ok(());
        }
        for c in copies {
            match d {
                CopyDirection::GpuToHost => host[c.host_offset] ^= 1,
                CopyDirection::HostToGpu => gpu[c.gpu_offset] ^= 1,
            }
        }
        Ok(())
    }
}

#[test]
fn corrupted_loads_are_integrity_failures() {
    let mut sim = Sim::new(lax(1), churn())
        .expect("sim")
        .with_copy_engine(Box::new(Corrupting(CopyDirection::HostToGpu)));
    let r = sim.run_to_completion(20_000).expect("completes");
    assert!(r.integrity_failures > 0, "{r:?}");
}

#[test]
fn corrupted_stores_are_caught_at_the_store_and_at_the_load() {
    let mut sim = Sim::new(lax(1), churn())
        .expect("sim")
        .with_copy_engine(Box::new(Corrupting(CopyDirection::GpuToHost)));
    let r = sim.run_to_completion(20_000).expect("completes");
    assert!(r.store_mismatches > 0 && r.integrity_failures > 0, "{r:?}");
}

#[test]
fn loads_into_the_wrong_blocks_are_caught() {
    let r = mutant(lax(1), churn(), Bug::RotateLoadBlocks, 20_000);
    assert!(
        r.invariant_failures > 0 && r.integrity_failures > 0,
        "{r:?}"
    );
}

#[test]
fn missing_fences_are_caught() {
    // Burst of requests in a small GPU with slow stores: preemptions reuse blocks that pending
    // stores still read.
    let mut caught = 0;
    for seed in 1..=6 {
        let cfg = SimConfig {
            num_gpu_blocks: 128,
            ..lax(seed)
        };
        let r = mutant(
            cfg,
            Workload::shared_prefix(&SharedPrefixSpec::default()),
            Bug::NoFlush,
            20_000,
        );
        caught += r.store_mismatches;
    }
    assert!(
        caught > 0,
        "no store that read a reallocated block was detected"
    );
}

#[test]
fn freeing_blocks_under_pending_stores_is_caught() {
    let r = mutant(lax(2), churn(), Bug::FreeAtFinish, 20_000);
    assert!(r.invariant_failures > 0, "{r:?}");
}

#[test]
fn a_request_never_released_is_reported_as_stuck() {
    let pool = HostPool::new(lax(1).pool_config()).expect("pool");
    let checked = engine_sim::CheckedManager::new(pool, false, 1 << 16);
    let inner = Scheduler::new(lax(1).scheduler_config(), checked).expect("scheduler");
    let bug = Mutant {
        inner,
        bug: Bug::NeverRelease,
    };
    let mut sim = Sim::with_connector(lax(1), churn(), bug).expect("sim");
    let err = sim
        .run_to_completion(5_000)
        .expect_err("cannot complete")
        .to_string();
    assert!(err.contains("kept true"), "{err}");
    assert!(err.contains("seed 1"), "{err}");
}
