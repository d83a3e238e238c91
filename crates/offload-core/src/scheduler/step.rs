//! Each step's metadata for the workers ([`Scheduler::build_connector_meta`]): preempted
//! requests' stores flushed, fences on reallocated blocks, the engine's view of each scheduled
//! request, then this step's stores and, after all of them, the finish signals.

use crate::key::{BlockId, JobId, RequestId};
use crate::manager::OffloadManager;
use crate::meta::ConnectorMeta;
use crate::scheduler::request::Tracked;
use crate::scheduler::{OffloadPolicy, Scheduler, StepInput};

impl<M: OffloadManager> Scheduler<M> {
    /// Builds this step's metadata for the workers: the reset marker, stores to flush, loads,
    /// this step's stores (the deferred final stores of finished requests included) and, after
    /// all of them, the finish signals.
    pub fn build_connector_meta(&mut self, step: &StepInput<'_>) -> ConnectorMeta {
        let mut meta = ConnectorMeta {
            step: step.step,
            reset_before: self.pending_reset.take(),
            ..ConnectorMeta::default()
        };
        for &id in step.preempted {
            self.on_preempted(id);
        }
        for scheduled in step.scheduled {
            self.apply_fences(scheduled.new_block_ids);
            self.absorb_step(scheduled);
        }
        for scheduled in step.scheduled {
            if self.config.policy == OffloadPolicy::Block {
                self.build_stores(scheduled.id, &mut meta.stores);
            }
        }
        let finishing: Vec<RequestId> = self.finishing.iter().copied().collect();
        let mut ready = Vec::with_capacity(finishing.len());
        for id in finishing {
            if self.build_stores(id, &mut meta.stores) {
                ready.push(id);
            }
        }
        // Only after every store of this step was built: the finish signals.
        for id in ready {
            self.signal_finish_if_ready(id);
        }
        meta.loads = std::mem::take(&mut self.loads_out);
        meta.flush = std::mem::take(&mut self.flush_out).into_iter().collect();
        meta.finished = std::mem::take(&mut self.finished_out);
        self.check_invariants();
        meta
    }

    /// Design.md section 4 item 13: a preempted request's pending stores are flushed; its blocks
    /// are gone, so its block table is cleared until it is scheduled again.
    fn on_preempted(&mut self, id: RequestId) {
        let Some(Tracked::Live(req)) = self.requests.get_mut(&id) else {
            return;
        };
        if req.finish.is_some() || req.load_job.is_some() {
            self.broken_for(
                id,
                format_args!("preempted request {id:?} is finished or loading"),
            );
            return;
        }
        req.block_ids.clear();
        req.num_computed_tokens = 0;
        req.num_scheduled_tokens = 0;
        let jobs = req.store_jobs.clone();
        for job in jobs {
            self.flush(job);
        }
    }

    /// Any in-flight store reading a block that was just reallocated is flushed.
    fn apply_fences(&mut self, new_blocks: &[BlockId]) {
        if self.fences.is_empty() {
            return;
        }
        for &block in new_blocks {
            let hits: Vec<JobId> = self
                .fences
                .range((block, JobId(0))..=(block, JobId(u64::MAX)))
                .map(|&(_, job)| job)
                .collect();
            for job in hits {
                self.flush(job);
            }
        }
    }

    fn flush(&mut self, job: JobId) {
        if self.flush_out.insert(job) {
            self.stats.flushes += 1;
        }
    }

    /// Takes the engine's view of a scheduled request.
    fn absorb_step(&mut self, scheduled: &crate::scheduler::StepRequest<'_>) {
        let id = scheduled.id;
        let Some(tracked) = self.requests.get_mut(&id) else {
            return;
        };
        let Tracked::Live(req) = tracked else {
            self.broken(format_args!("finished request {id:?} was scheduled"));
            return;
        };
        if req.finish.is_some() || req.load_job.is_some() {
            self.broken_for(
                id,
                format_args!("request {id:?} scheduled while finished or loading"),
            );
            return;
        }
        if scheduled.replace_blocks {
            req.block_ids.clear();
        }
        req.block_ids.extend_from_slice(scheduled.new_block_ids);
        req.num_computed_tokens = scheduled.num_computed_tokens;
        req.num_scheduled_tokens = scheduled.num_scheduled_tokens;
        req.num_tokens = scheduled.num_tokens;
        req.learn_hashes(scheduled.block_hashes);
    }
}
