//! The workers' acknowledgements ([`Scheduler::update_connector_output`]): a job completes at
//! its `worker_count`-th, a job from before a reset only ends its holds, and a completed job
//! leaves its request.

use crate::key::{JobId, RequestId};
use crate::manager::OffloadManager;
use crate::meta::{JobKind, WorkerOutput};
use crate::scheduler::request::Tracked;
use crate::scheduler::{Scheduler, UpdateOutcome};

impl<M: OffloadManager> Scheduler<M> {
    /// Takes the workers' acknowledgements. A job completes at its `worker_count`-th
    /// acknowledgement, and fails if any worker failed it. Acknowledgements of jobs older than the
    /// last `reset_cache` are ignored.
    pub fn update_connector_output(&mut self, outputs: &[WorkerOutput]) -> UpdateOutcome {
        let mut outcome = UpdateOutcome::default();
        for id in self.failed_loads.drain(..) {
            outcome.loads.push((id, false));
        }
        for output in outputs {
            for ack in &output.acks {
                self.take_ack(output.worker, ack.job, ack.success, &mut outcome);
            }
        }
        self.check_invariants();
        outcome
    }

    fn take_ack(&mut self, worker: u32, job: JobId, success: bool, outcome: &mut UpdateOutcome) {
        if job < self.job_floor {
            self.stats.stale_acks += 1;
            self.take_stale_ack(worker, job, outcome);
            return;
        }
        if worker >= self.config.worker_count {
            self.broken(format_args!("ack from unknown worker {worker}"));
            return;
        }
        let Some(record) = self.jobs.get_mut(&job) else {
            self.broken(format_args!(
                "ack for unknown or completed job {job:?} from worker {worker}"
            ));
            return;
        };
        let bit = 1u64 << worker;
        if record.acked & bit != 0 {
            self.broken(format_args!(
                "worker {worker} acknowledged job {job:?} twice"
            ));
            return;
        }
        record.acked |= bit;
        record.failed |= !success;
        if record.acked.count_ones() == self.config.worker_count {
            self.complete_job(job, outcome);
        }
    }

    /// An acknowledgement of a job from before the last reset: at the last worker's, the job is
    /// over, so its host slots' holds end and its request's blocks may be released.
    fn take_stale_ack(&mut self, worker: u32, job: JobId, outcome: &mut UpdateOutcome) {
        let Some(stale) = self.stale_jobs.get_mut(&job) else {
            // A job of a reset with nothing held (never sent) or already over.
            return;
        };
        let bit = 1u64 << worker.min(63);
        if worker >= self.config.worker_count || stale.acked & bit != 0 {
            self.broken(format_args!(
                "stale job {job:?}: unknown worker {worker} or its second acknowledgement"
            ));
            return;
        }
        stale.acked |= bit;
        if stale.acked.count_ones() < self.config.worker_count {
            return;
        }
        let Some(stale) = self.stale_jobs.remove(&job) else {
            return;
        };
        if !stale.slots.is_empty() {
            self.manager.release_held(&stale.slots);
        }
        let request = stale.request;
        if stale.report_load {
            outcome.loads.push((request, false));
        }
        let left = self.stale_by_request.get_mut(&request).map(|n| {
            *n -= 1;
            *n
        });
        if left == Some(0) {
            self.stale_by_request.remove(&request);
            if self.release_after_stale.remove(&request) {
                self.released.push(request);
            }
        }
    }

    fn complete_job(&mut self, job: JobId, outcome: &mut UpdateOutcome) {
        let Some(record) = self.jobs.remove(&job) else {
            return;
        };
        for &block in &record.blocks {
            self.fences.remove(&(block, job));
        }
        self.flush_out.remove(&job);
        let success = !record.failed;
        match record.kind {
            JobKind::Store => {
                self.manager.complete_store(&record.keys, success);
                if !success {
                    self.stats.store_failures += 1;
                }
            }
            JobKind::Load => {
                self.manager.complete_load(&record.keys);
                if !success {
                    self.stats.load_failures += 1;
                }
                outcome.loads.push((record.request, success));
            }
        }
        self.detach_job(record.request, job, record.kind);
    }

    /// Removes a completed job from its request; a draining request with no job left is released.
    fn detach_job(&mut self, id: RequestId, job: JobId, kind: JobKind) {
        match self.requests.get_mut(&id) {
            Some(Tracked::Live(req)) => match kind {
                JobKind::Load => req.load_job = None,
                JobKind::Store => req.store_jobs.retain(|&j| j != job),
            },
            Some(Tracked::Draining(draining)) => {
                draining.jobs.retain(|&j| j != job);
                if draining.jobs.is_empty() {
                    self.requests.remove(&id);
                    self.release(id);
                }
            }
            None => self.broken(format_args!(
                "job {job:?} belongs to untracked request {id:?}"
            )),
        }
    }
}
