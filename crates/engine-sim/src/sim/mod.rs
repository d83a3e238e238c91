//! The simulated engine: a vLLM-v1-style scheduler loop (waiting queue, running list, token
//! budget, chunked prefill, preemption, GPU prefix cache) that drives kvtier's scheduler-side API
//! exactly as an engine does, with simulated tensor-parallel workers, in sync or async
//! (one-step-pipelined) scheduling.
//!
//! One step, in order: arrivals (`on_new_request`), aborts (`request_finished`), an optional
//! `reset_cache`, scheduling (GPU prefix cache, `get_num_new_matched_tokens`, allocation,
//! `update_state_after_alloc`), `build_connector_meta`, the meta's checks, the workers and the
//! compute (flush, loads, compute, stores), then the model output: this step's in sync mode, the
//! previous step's in async mode (tokens, finishes with `request_finished`, and
//! `update_connector_output`). `take_released` follows every connector call.

mod execute;
mod output;
mod request;
mod schedule;
mod verify;

use std::collections::{BTreeMap, VecDeque};

use offload_core::{
    BlockId, HostPool, JobId, JobKind, KvEvent, OffloadManager, RequestId, Scheduler, WorkerOutput,
};
use serde::Serialize;

pub use request::{Phase, RequestView};

use crate::checked::CheckedManager;
use crate::config::SimConfig;
use crate::connector::{EngineConnector, KvHandle, KvScheduler};
use crate::gpu::{BlockPool, GpuMemory};
use crate::host::{default_copy_engine, CopyEngine, CopyGeometry, HostMemory};
use crate::model::KvModel;
use crate::report::{SimError, SimReport};
use crate::rng::SplitMix64;
use crate::worker::Worker;
use crate::workload::Workload;
use ::connector::{AsTiering, SchedulerHandle, TieringManager, TieringOptions};
use offload_core::tier::Tier;
use offload_core::SlotMemory;
use request::Req;
use std::sync::Arc;

/// What one step did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StepSummary {
    /// The step number.
    pub step: u64,
    /// Requests scheduled.
    pub scheduled: usize,
    /// Tokens scheduled.
    pub scheduled_tokens: u32,
    /// Requests preempted.
    pub preempted: usize,
    /// Load jobs in the meta.
    pub loads: usize,
    /// Store jobs in the meta.
    pub stores: usize,
    /// Jobs flushed by the meta.
    pub flushes: usize,
    /// Finish signals in the meta.
    pub finished_signals: usize,
}

/// One step's model output, as the engine processes it (later, in async mode).
#[derive(Debug, Default)]
struct StepOutput {
    workers: Vec<WorkerOutput>,
    /// Requests that sampled a token.
    sampled: Vec<usize>,
}

impl StepOutput {
    fn is_empty(&self) -> bool {
        self.sampled.is_empty() && self.workers.iter().all(|w| w.acks.is_empty())
    }
}

/// A job the meta issued, until every worker completed it.
#[derive(Clone, Copy, Debug)]
struct TrackedJob {
    kind: JobKind,
    acks: u32,
}

/// A request scheduled in a step.
#[derive(Clone, Debug)]
struct Scheduled {
    idx: usize,
    computed_before: u32,
    num_new: u32,
    new_blocks: Vec<BlockId>,
    replace: bool,
}

/// One step's scheduling decisions.
#[derive(Clone, Debug, Default)]
struct Plan {
    scheduled: Vec<Scheduled>,
    preempted: Vec<RequestId>,
}

/// The simulated engine over a connector `C` (by default kvtier's scheduler over a checked host pool).
pub struct Sim<C = KvScheduler<HostPool>> {
    cfg: SimConfig,
    model: KvModel,
    geo: CopyGeometry,
    connector: C,
    reqs: Vec<Req>,
    arrivals: Vec<usize>,
    next_arrival: usize,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    pool: BlockPool,
    gpu: GpuMemory,
    host: HostMemory,
    workers: Vec<Worker>,
    copier: Box<dyn CopyEngine>,
    step: u64,
    pending_output: Option<StepOutput>,
    abort_rng: SplitMix64,
    report: SimReport,
    jobs: BTreeMap<JobId, TrackedJob>,
    max_job: Option<JobId>,
    released: Vec<RequestId>,
    events: Vec<KvEvent>,
    finalized: bool,
}

impl Sim<KvScheduler<HostPool>> {
    /// A simulation of `workload` on kvtier's scheduler over a host pool sized by `config`.
    pub fn new(config: SimConfig, workload: Workload) -> Result<Self, SimError> {
        config.validate()?;
        let pool = HostPool::with_strictness(config.pool_config(), config.strict)?;
        Self::with_manager(config, workload, pool)
    }
}

impl<M: OffloadManager> Sim<KvScheduler<M>> {
    /// A simulation on kvtier's scheduler over `manager` (wrapped in a [`CheckedManager`]).
    pub fn with_manager(
        config: SimConfig,
        workload: Workload,
        manager: M,
    ) -> Result<Self, SimError> {
        config.validate()?;
        let checked = CheckedManager::new(manager, config.strict, config.call_log_max);
        let scheduler = Scheduler::new(config.scheduler_config(), checked)?;
        Sim::with_connector(config, workload, scheduler)
    }

    /// kvtier's scheduler.
    pub fn scheduler(&self) -> &KvScheduler<M> {
        &self.connector
    }

    /// kvtier's scheduler, for direct calls.
    pub fn scheduler_mut(&mut self) -> &mut KvScheduler<M> {
        &mut self.connector
    }

    /// The lifecycle checker around the manager (its call log and violations).
    pub fn checker(&self) -> &CheckedManager<M> {
        self.connector.manager()
    }
}

impl<M: AsTiering> Sim<KvHandle<M>> {
    /// A simulation on the connector's scheduler handle over `manager` (wrapped in a
    /// [`CheckedManager`]), whose secondary tiers read and write `host` (build them over
    /// [`HostMemory::slot_memory`]); `host` must have `config`'s slot count and slot size.
    pub fn with_handle(
        config: SimConfig,
        workload: Workload,
        manager: M,
        host: HostMemory,
    ) -> Result<Self, SimError> {
        config.validate()?;
        let checked = CheckedManager::new(manager, config.strict, config.call_log_max);
        let handle = SchedulerHandle::new(config.scheduler_config(), checked)?;
        Sim::with_connector_and_host(config, workload, handle, host)
    }

    /// The connector's scheduler handle.
    pub fn handle(&self) -> &KvHandle<M> {
        &self.connector
    }

    /// The connector's scheduler handle, for direct calls.
    pub fn handle_mut(&mut self) -> &mut KvHandle<M> {
        &mut self.connector
    }
}

impl Sim<KvHandle<TieringManager>> {
    /// A simulation on a [`TieringManager`] over a host pool sized by `config` and the secondary
    /// tiers `tiers` builds over the host pool's bytes (tried in that order on a host miss).
    pub fn with_tiers(
        config: SimConfig,
        workload: Workload,
        tiers: impl FnOnce(Arc<dyn SlotMemory>) -> Vec<Box<dyn Tier>>,
    ) -> Result<Self, SimError> {
        config.validate()?;
        let host = HostMemory::new(config.host_slots, config.slot_bytes());
        let pool = HostPool::with_strictness(config.pool_config(), config.strict)?;
        let options = TieringOptions {
            strict: config.strict,
            ..TieringOptions::new(config.slot_bytes() as u32)
        };
        let manager = TieringManager::new(pool, tiers(host.slot_memory()), options)?;
        Self::with_handle(config, workload, manager, host)
    }
}

impl<C: EngineConnector> Sim<C> {
    /// A simulation of `workload` on a connector whose tiers share `host` with the workers.
    pub fn with_connector_and_host(
        config: SimConfig,
        workload: Workload,
        connector: C,
        host: HostMemory,
    ) -> Result<Self, SimError> {
        if host.slot_count() != config.host_slots || host.slot_bytes() != config.slot_bytes() {
            return Err(SimError::InvalidConfig {
                field: "host_slots",
                reason: format!(
                    "host memory has {} slots of {} bytes, the config {} of {}",
                    host.slot_count(),
                    host.slot_bytes(),
                    config.host_slots,
                    config.slot_bytes()
                ),
            });
        }
        let mut sim = Self::with_connector(config, workload, connector)?;
        sim.host = host;
        Ok(sim)
    }

    /// The host pool's bytes (shared with the secondary tiers).
    pub fn host_memory(&self) -> &HostMemory {
        &self.host
    }

    /// A simulation of `workload` on any connector.
    pub fn with_connector(
        config: SimConfig,
        workload: Workload,
        connector: C,
    ) -> Result<Self, SimError> {
        config.validate()?;
        validate_workload(&config, &workload)?;
        let model = KvModel {
            tokens_per_block: config.tokens_per_block,
            block_bytes: config.block_bytes,
        };
        let geo = CopyGeometry {
            block_bytes: config.block_bytes,
            blocks_per_chunk: config.blocks_per_chunk,
            gpu_blocks: config.num_gpu_blocks,
            slots: config.host_slots,
        };
        let reusable = crate::reuse::reusable_tokens(&workload, config.tokens_per_block);
        let mut reqs: Vec<Req> = workload
            .requests
            .into_iter()
            .enumerate()
            .map(|(i, spec)| Req::new(i, spec, config.tokens_per_block))
            .collect();
        let mut arrivals: Vec<usize> = (0..reqs.len()).collect();
        arrivals.sort_by_key(|&i| (reqs[i].spec.arrival_step, i));
        let workers = (0..config.worker_count)
            .map(|r| {
                Worker::new(
                    r,
                    config.worker_count,
                    config.block_bytes,
                    config.seed,
                    config.faults.clone(),
                )
            })
            .collect();
        let report = SimReport {
            seed: config.seed,
            requests_total: reqs.len() as u64,
            prompt_tokens_reusable: reusable.iter().map(|&n| u64::from(n)).sum(),
            ..SimReport::default()
        };
        for (r, n) in reqs.iter_mut().zip(reusable) {
            r.reusable = n;
        }
        Ok(Self {
            model,
            geo,
            connector,
            arrivals,
            next_arrival: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pool: BlockPool::new(config.num_gpu_blocks),
            gpu: GpuMemory::new(config.num_gpu_blocks, config.block_bytes),
            host: HostMemory::new(config.host_slots, config.slot_bytes()),
            workers,
            copier: default_copy_engine(),
            step: 0,
            pending_output: None,
            abort_rng: SplitMix64::stream(config.seed, 0xAB07),
            report,
            jobs: BTreeMap::new(),
            max_job: None,
            released: Vec::new(),
            events: Vec::new(),
            finalized: false,
            reqs,
            cfg: config,
        })
    }

    /// Replaces the block copy engine (for example with a tier crate's host path).
    pub fn with_copy_engine(mut self, engine: Box<dyn CopyEngine>) -> Self {
        self.copier = engine;
        self
    }

    /// The settings.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// The connector.
    pub fn connector(&self) -> &C {
        &self.connector
    }

    /// The connector, for direct calls.
    pub fn connector_mut(&mut self) -> &mut C {
        &mut self.connector
    }

    /// Worker `rank` (to change its faults between steps).
    pub fn worker_mut(&mut self, rank: u32) -> Option<&mut Worker> {
        self.workers.get_mut(rank as usize)
    }

    /// The GPU block pool.
    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The next step's number.
    pub fn current_step(&self) -> u64 {
        self.step
    }

    /// Number of requests in the workload.
    pub fn request_count(&self) -> usize {
        self.reqs.len()
    }

    /// A view of request `id`.
    pub fn request(&self, id: RequestId) -> Option<RequestView> {
        self.reqs.get(id.0 as usize).map(Req::view)
    }

    /// Runs one engine step.
    pub fn step(&mut self) -> StepSummary {
        let step = self.step;
        self.arrive(step);
        self.abort_due(step);
        if self.cfg.reset_cache_steps.contains(&step) {
            self.reset_cache();
        }
        let plan = self.schedule();
        let meta = self.build_meta(step, &plan);
        self.check_meta(step, &meta, &plan);
        let output = self.execute(step, &plan, &meta);
        if self.cfg.async_scheduling {
            if let Some(previous) = self.pending_output.replace(output) {
                self.process_output(previous);
            }
        } else {
            self.process_output(output);
        }
        self.drain_events();
        self.step += 1;
        self.report.steps = self.step;
        StepSummary {
            step,
            scheduled: plan.scheduled.len(),
            scheduled_tokens: plan.scheduled.iter().map(|s| s.num_new).sum(),
            preempted: plan.preempted.len(),
            loads: meta.loads.len(),
            stores: meta.stores.len(),
            flushes: meta.flush.len(),
            finished_signals: meta.finished.len(),
        }
    }

    /// Calls kvtier's `reset_cache` now (between steps); cancelled loads are recomputed.
    pub fn reset_cache(&mut self) {
        let outcome = self.connector.reset_cache();
        self.report.resets += 1;
        self.drain_released();
        for (id, ok) in outcome.loads {
            self.on_load_end(id, ok);
        }
    }

    /// Whether every request ended, every block was freed, every job was acknowledged and every
    /// finish was delivered to the manager.
    pub fn is_done(&self) -> bool {
        self.next_arrival == self.arrivals.len()
            && self.reqs.iter().all(|r| r.phase == Phase::Done && !r.kept)
            && self
                .pending_output
                .as_ref()
                .is_none_or(StepOutput::is_empty)
            && self.workers.iter().all(|w| w.in_flight() == 0)
            && self
                .reqs
                .iter()
                .all(|r| self.connector.is_request_closed(r.id))
    }

    /// Steps until [`Sim::is_done`], at most `max_steps` more; then runs the end-of-run checks.
    /// Fails naming the stuck requests and jobs if the run did not complete.
    pub fn run_to_completion(&mut self, max_steps: u64) -> Result<SimReport, SimError> {
        for _ in 0..max_steps {
            if self.is_done() {
                break;
            }
            self.step();
        }
        if !self.is_done() {
            return Err(SimError::NoProgress {
                seed: self.cfg.seed,
                steps: self.step,
                stuck: self.stuck(),
            });
        }
        self.finalize();
        Ok(self.report())
    }

    /// The counters so far (with the connector's counted violations).
    pub fn report(&self) -> SimReport {
        let mut report = self.report.clone();
        let (count, messages) = self.connector.violations();
        report.invariant_failures += count;
        for m in messages {
            report.note(format!("manager: {m}"));
        }
        report
    }

    fn stuck(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .reqs
            .iter()
            .filter(|r| r.phase != Phase::Done || r.kept || !self.connector.is_request_closed(r.id))
            .map(|r| {
                format!(
                    "{} closed {}",
                    r.describe(),
                    self.connector.is_request_closed(r.id)
                )
            })
            .take(32)
            .collect();
        out.push(format!(
            "GPU blocks free {} of {}; running {:?}; waiting {:?}",
            self.pool.free_count(),
            self.pool.block_count(),
            self.running,
            self.waiting
        ));
        for w in &self.workers {
            if w.in_flight() > 0 {
                out.push(format!(
                    "worker {} has {} jobs in flight",
                    w.rank(),
                    w.in_flight()
                ));
            }
        }
        out.extend(
            self.jobs
                .keys()
                .take(8)
                .map(|j| format!("job {} not acknowledged by every worker", j.0)),
        );
        out
    }

    fn finalize(&mut self) {
        if self.finalized {
            return;
        }
        self.finalized = true;
        let referenced = self.pool.block_count() - self.pool.free_count();
        if referenced > 0 {
            self.violation(format!(
                "{referenced} GPU blocks still referenced at the end of the run"
            ));
        }
        let mut problems = Vec::new();
        self.connector.end_of_run_problems(&mut problems);
        for p in problems {
            self.violation(p);
        }
    }

    /// Records a broken contract rule; panics with the seed in strict mode.
    fn violation(&mut self, what: String) {
        let msg = format!("step {}: {what}", self.step);
        if self.cfg.strict {
            panic!(
                "engine-sim contract violation (seed {}): {msg}",
                self.cfg.seed
            );
        }
        self.report.invariant_failures += 1;
        self.report.note(msg);
    }

    fn index_of(&self, id: RequestId) -> Option<usize> {
        let i = usize::try_from(id.0).ok()?;
        (i < self.reqs.len()).then_some(i)
    }

    fn blocks_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.cfg.tokens_per_block) as usize
    }

    fn drain_released(&mut self) {
        self.connector.take_released(&mut self.released);
        let released = std::mem::take(&mut self.released);
        for id in &released {
            self.on_released(*id);
        }
        self.released = released;
        self.released.clear();
    }

    fn drain_events(&mut self) {
        self.connector.take_events(&mut self.events);
        for e in self.events.drain(..) {
            match e {
                KvEvent::Stored { .. } => self.report.events_stored += 1,
                KvEvent::Removed { .. } => self.report.events_removed += 1,
                // A kind this simulator does not count.
                _ => {}
            }
        }
    }
}

fn validate_workload(cfg: &SimConfig, workload: &Workload) -> Result<(), SimError> {
    for (i, r) in workload.requests.iter().enumerate() {
        if r.prompt_len() == 0 {
            return Err(SimError::InvalidWorkload {
                reason: format!("request {i} has an empty prompt"),
            });
        }
        if r.max_tokens == 0 {
            return Err(SimError::InvalidWorkload {
                reason: format!("request {i} has max_tokens 0"),
            });
        }
        let tokens = u64::from(r.prompt_len()) + u64::from(r.max_tokens) + 1;
        let blocks = tokens.div_ceil(u64::from(cfg.tokens_per_block));
        if blocks > u64::from(cfg.num_gpu_blocks) {
            return Err(SimError::InvalidWorkload {
                reason: format!(
                    "request {i} needs {blocks} GPU blocks, more than the {} there are",
                    cfg.num_gpu_blocks
                ),
            });
        }
    }
    Ok(())
}
