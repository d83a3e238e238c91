//! A request's finish: recorded by [`Scheduler::request_finished`], signalled to the manager in
//! exactly one place (`deliver_finish`) after the step's stores were built, and its engine blocks
//! released ([`Scheduler::take_released`]) once no job may read or write them.

use crate::key::RequestId;
use crate::manager::OffloadManager;
use crate::scheduler::request::{DrainingRequest, Finish, Tracked};
use crate::scheduler::{FinishedRequest, Scheduler};

impl<M: OffloadManager> Scheduler<M> {
    /// Records that a request finished or was aborted. Never notifies the manager of a tracked
    /// request with work left: its final stores are built by the next `build_connector_meta`,
    /// which then signals the finish. Returns whether the engine must keep the request's blocks
    /// until [`Scheduler::take_released`] names it.
    pub fn request_finished(&mut self, request: &FinishedRequest<'_>) -> bool {
        let id = request.id;
        let config = self.config;
        match self.requests.get_mut(&id) {
            None => {
                // Never tracked: nothing can be stored, so the signal goes at once.
                self.deliver_finish(id);
                self.keep_blocks_for_stale_jobs(id)
            }
            Some(Tracked::Draining(_)) => {
                self.broken(format_args!("request {id:?} finished twice"));
                true
            }
            Some(Tracked::Live(req)) => {
                if req.finish.is_some() {
                    self.broken(format_args!("request {id:?} finished twice"));
                    return true;
                }
                req.finish = Some(Finish {
                    kind: request.kind,
                    num_tokens: request.num_tokens,
                    num_computed_tokens: request.num_computed_tokens,
                });
                req.num_tokens = request.num_tokens;
                req.learn_hashes(request.block_hashes);
                req.matched = None;
                let mut candidates = std::mem::take(&mut self.scratch_candidates);
                req.store_candidates(&config, &mut candidates);
                let nothing_left = req.disabled || candidates.is_empty();
                self.scratch_candidates = candidates;
                if nothing_left && !req.has_jobs() {
                    self.requests.remove(&id);
                    self.deliver_finish(id);
                    return self.keep_blocks_for_stale_jobs(id);
                }
                self.finishing.insert(id);
                true
            }
        }
    }

    /// Moves into `out` the finished requests whose engine blocks the engine may now free.
    pub fn take_released(&mut self, out: &mut Vec<RequestId>) {
        out.append(&mut self.released);
    }

    /// Signals a finishing request's finish. Called only after this step's stores were built,
    /// and only for requests whose final stores did not have to wait.
    pub(super) fn signal_finish_if_ready(&mut self, id: RequestId) {
        self.finishing.remove(&id);
        let Some(Tracked::Live(req)) = self.requests.get(&id) else {
            return;
        };
        let jobs = req.store_jobs.clone();
        if jobs.is_empty() {
            self.requests.remove(&id);
            self.release(id);
        } else {
            self.requests
                .insert(id, Tracked::Draining(DrainingRequest { jobs }));
        }
        self.deliver_finish(id);
    }

    /// The engine may free `id`'s blocks: now, or once the jobs it had in flight at a reset are
    /// over (they may still read or write those blocks).
    pub(super) fn release(&mut self, id: RequestId) {
        if self.stale_by_request.contains_key(&id) {
            self.release_after_stale.insert(id);
        } else {
            self.released.push(id);
        }
    }

    /// For a request that finished with no job in flight: whether the engine must still keep
    /// its blocks, because a job it had in flight at a reset may still read or write them (it is
    /// then released once those jobs are over).
    fn keep_blocks_for_stale_jobs(&mut self, id: RequestId) -> bool {
        if !self.stale_by_request.contains_key(&id) {
            return false;
        }
        self.release_after_stale.insert(id);
        true
    }

    /// The single place the manager hears `on_request_finished`.
    pub(super) fn deliver_finish(&mut self, id: RequestId) {
        self.manager.on_request_finished(id);
        self.finished_out.push(id);
        self.stats.finish_signals += 1;
    }
}
