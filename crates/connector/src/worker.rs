//! [`WorkerHandle`]: what each engine worker (tensor-parallel rank) embeds. It executes the
//! scheduler side's [`ConnectorMeta`] on a tier-gpu [`TransferEngine`] (the CUDA engine, or the
//! host path for engines whose KV cache lives in host memory) and reports every job exactly once
//! in a [`WorkerOutput`].
//!
//! Per step, in the meta's order (design.md section 4, item 14): [`WorkerHandle::before_compute`]
//! finishes every job older than a reset (those the engine has complete, those still queued here
//! are cancelled), waits for the stores to flush, and starts the loads;
//! the engine runs its forward pass; [`WorkerHandle::after_compute`] starts the stores;
//! [`WorkerHandle::take_output`] reports what completed.
//!
//! Compute ordering: on a GPU the forward pass is asynchronous, so each call takes the point in
//! the engine's compute its copies must wait for (the engine's [`TransferEngine::Dependency`], a
//! CUDA event on the compute stream): loads wait until the kernels that still read their
//! destination blocks (the previous step's, under async scheduling) are done, stores until the
//! kernels that write their source blocks are. A job that waits in the handle's queue (the
//! engine was busy) keeps its dependency.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use offload_core::{ConnectorMeta, Job, JobAck, JobId, WorkerOutput};
use tier_gpu::{TransferDone, TransferEngine, TransferError};

/// Counters of one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkerCounters {
    /// Jobs submitted to the transfer engine.
    pub jobs_submitted: u64,
    /// Jobs that completed successfully.
    pub jobs_ok: u64,
    /// Jobs that failed (copy failure, refused as not fitting the layout, engine unavailable).
    pub jobs_failed: u64,
    /// Submits refused as busy (retried on the next call).
    pub submits_busy: u64,
    /// Stores waited for because the meta flushed them.
    pub flushes: u64,
    /// Jobs older than a reset that were still queued here (the engine was busy) when the reset
    /// arrived: never submitted, acknowledged as failed.
    pub jobs_cancelled_at_reset: u64,
    /// Jobs a drain or a flush had to submit and the engine refused as busy although it had just
    /// been drained (nothing in flight): waiting longer cannot help, so they were acknowledged
    /// as failed instead of retried forever.
    pub jobs_refused_when_drained: u64,
    /// Drains ([`WorkerHandle::drain`]) that returned at their deadline with transfers still
    /// in flight (the engine's copies or stream stopped making progress); those jobs stay in
    /// flight and a later `take_output` reports them.
    pub engine_drain_timeouts: u64,
}

/// One worker's side of kvtier over a transfer engine `E`.
pub struct WorkerHandle<E: TransferEngine> {
    rank: u32,
    engine: E,
    /// Jobs refused as busy, in order, each with what it waits for; submitted before anything
    /// newer.
    queued: VecDeque<(Job, Option<E::Dependency>)>,
    acks: Vec<JobAck>,
    done: Vec<TransferDone>,
    counters: WorkerCounters,
    /// How long one [`WorkerHandle::drain`] waits for the engine.
    drain_deadline: Duration,
}

/// The default of [`WorkerHandle::drain`]'s deadline.
pub const WORKER_DRAIN_DEADLINE: Duration = Duration::from_secs(30);

impl<E: TransferEngine> WorkerHandle<E> {
    /// Worker `rank` over `engine`; a drain waits at most [`WORKER_DRAIN_DEADLINE`].
    pub fn new(rank: u32, engine: E) -> Self {
        Self::with_drain_deadline(rank, engine, WORKER_DRAIN_DEADLINE)
    }

    /// Worker `rank` over `engine`; a drain waits at most `drain_deadline` for the engine.
    pub fn with_drain_deadline(rank: u32, engine: E, drain_deadline: Duration) -> Self {
        Self {
            drain_deadline,
            rank,
            engine,
            queued: VecDeque::new(),
            acks: Vec::new(),
            done: Vec::new(),
            counters: WorkerCounters::default(),
        }
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Counters so far.
    pub fn counters(&self) -> WorkerCounters {
        self.counters
    }

    /// The transfer engine.
    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// Before the step's compute: ends every job older than `meta.reset_before`: those the engine
    /// has complete (drained), those still queued here because the engine was busy are cancelled,
    /// never submitted, since their slots and blocks may be reused once the scheduler hears they
    /// are over (their acknowledgements, failed for the cancelled ones, are still sent: the
    /// scheduler holds their slots until then). Then waits for the stores named
    /// in `meta.flush`, and starts `meta.loads`, each after `reads_done`: the point in the
    /// engine's compute after which no kernel reads the blocks the loads overwrite (`None` when
    /// the compute is synchronous or idle).
    ///
    /// The reset drain and the flush waits here have no deadline, on purpose: they wait for the
    /// engine's own copies to finish before the compute reuses or overwrites the blocks those
    /// copies read or write, and giving up would let a store capture overwritten KV or a load
    /// write into reused blocks. (Every other wait of the worker is bounded: [`Self::drain`].)
    pub fn before_compute(&mut self, meta: &ConnectorMeta, reads_done: Option<E::Dependency>) {
        if let Some(floor) = meta.reset_before {
            self.cancel_queued_before(floor);
            self.engine.drain();
        }
        for &job in &meta.flush {
            self.counters.flushes += 1;
            self.submit_through(job);
            self.engine.wait(job);
        }
        for job in &meta.loads {
            self.submit(job.clone(), reads_done);
        }
        self.reap();
    }

    /// After the step's compute was issued: starts `meta.stores`, each after `writes_done`, the
    /// point in the engine's compute after which the kernels that write their source blocks are
    /// done (`None` when the compute is synchronous and has returned).
    pub fn after_compute(&mut self, meta: &ConnectorMeta, writes_done: Option<E::Dependency>) {
        for job in &meta.stores {
            self.submit(job.clone(), writes_done);
        }
        self.reap();
    }

    /// The jobs completed since the last call, each exactly once.
    pub fn take_output(&mut self) -> WorkerOutput {
        self.reap();
        self.submit_queued();
        WorkerOutput {
            worker: self.rank,
            acks: std::mem::take(&mut self.acks),
        }
    }

    /// Blocks until every job was submitted and completed (shutdown, tests); the completions
    /// are reported by the next [`WorkerHandle::take_output`]. Bounded: each queued job costs at
    /// most one drain of the engine, and one the drained engine still refuses as busy is
    /// acknowledged as failed (`jobs_refused_when_drained`).
    ///
    /// Each wait on the engine is bounded by the drain deadline: past it the drain returns
    /// `false` (counted in `engine_drain_timeouts`), the jobs in flight stay in flight (their
    /// memory theirs) and the queued ones queued; a later `take_output` reports them.
    pub fn drain(&mut self) -> bool {
        while !self.queued.is_empty() {
            if !self.drain_engine() {
                return false;
            }
            self.reap();
            if !self.try_submit_front() {
                self.fail_front_refused_when_drained();
            }
            self.submit_queued();
        }
        let drained = self.drain_engine();
        self.reap();
        drained
    }

    /// Drains the engine for at most the drain deadline; counts a timeout.
    fn drain_engine(&mut self) -> bool {
        let drained = self
            .engine
            .drain_until(Instant::now() + self.drain_deadline);
        if !drained {
            self.counters.engine_drain_timeouts += 1;
        }
        drained
    }

    /// Acknowledges as failed, without submitting them, the queued jobs older than `floor`.
    fn cancel_queued_before(&mut self, floor: JobId) {
        let mut keep = VecDeque::with_capacity(self.queued.len());
        for (job, after) in self.queued.drain(..) {
            if job.id >= floor {
                keep.push_back((job, after));
                continue;
            }
            self.counters.jobs_cancelled_at_reset += 1;
            self.counters.jobs_failed += 1;
            self.acks.push(JobAck {
                job: job.id,
                success: false,
            });
        }
        self.queued = keep;
    }

    /// Submits queued jobs in order until `job` went out (for a flush).
    fn submit_through(&mut self, job: JobId) {
        if !self.queued.iter().any(|(j, _)| j.id == job) {
            return;
        }
        while let Some(next) = self.queued.front().map(|(j, _)| j.id) {
            if !self.try_submit_front() {
                // Busy: make room by finishing what is in flight. A drained engine that still
                // refuses will not take the job at all: it fails (a failed store is freed).
                self.engine.drain();
                self.reap();
                if !self.try_submit_front() {
                    self.fail_front_refused_when_drained();
                }
            }
            if next == job {
                break;
            }
        }
    }

    /// Acknowledges the first queued job as failed: the engine refused it as busy with nothing
    /// in flight, so no wait can get it accepted.
    fn fail_front_refused_when_drained(&mut self) {
        let Some((job, _)) = self.queued.pop_front() else {
            return;
        };
        self.counters.jobs_refused_when_drained += 1;
        self.counters.jobs_failed += 1;
        self.acks.push(JobAck {
            job: job.id,
            success: false,
        });
    }

    fn submit(&mut self, job: Job, after: Option<E::Dependency>) {
        self.queued.push_back((job, after));
        self.submit_queued();
    }

    fn submit_queued(&mut self) {
        while !self.queued.is_empty() {
            if !self.try_submit_front() {
                self.reap();
                if !self.try_submit_front() {
                    return;
                }
            }
        }
    }

    /// Submits the first queued job; `false` if the engine is busy (the job stays queued).
    fn try_submit_front(&mut self) -> bool {
        let Some((job, after)) = self.queued.front() else {
            return true;
        };
        match self.engine.submit_after(job, *after) {
            Ok(()) => {
                self.counters.jobs_submitted += 1;
                self.queued.pop_front();
                true
            }
            Err(TransferError::Busy { .. }) => {
                self.counters.submits_busy += 1;
                false
            }
            Err(_) => {
                // Refused for good: the job still completes exactly once, with failure.
                let id = job.id;
                self.queued.pop_front();
                self.counters.jobs_failed += 1;
                self.acks.push(JobAck {
                    job: id,
                    success: false,
                });
                true
            }
        }
    }

    fn reap(&mut self) {
        self.engine.poll(&mut self.done);
        for d in self.done.drain(..) {
            if d.success {
                self.counters.jobs_ok += 1;
            } else {
                self.counters.jobs_failed += 1;
            }
            self.acks.push(JobAck {
                job: d.job,
                success: d.success,
            });
        }
    }
}
