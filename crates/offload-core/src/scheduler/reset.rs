//! [`Scheduler::reset_cache`]: jobs in flight become stale (their slots held until every worker
//! reported them), finished requests are signalled once, live ones rewound.

use std::collections::BTreeSet;

use crate::key::{JobId, RequestId};
use crate::manager::OffloadManager;
use crate::scheduler::request::Tracked;
use crate::scheduler::{Scheduler, StaleJob, UpdateOutcome};

impl<M: OffloadManager> Scheduler<M> {
    /// Drops everything offloaded. Workers hear of it in the next meta (`reset_before`) and finish
    /// every older job before touching a slot; acknowledgements of those jobs are ignored, but
    /// the host slots they name stay held (handed to no new key) and their requests' engine
    /// blocks kept until every worker acknowledged them, since a transfer may still write them
    /// until then. Finished requests whose signal was pending are signalled here, exactly once,
    /// and released (once their jobs are over); live requests keep their state with their store
    /// cursors rewound. Returns the loads cancelled before any worker got them; a load the
    /// workers already have is reported failed by the `update_connector_output` that brings its
    /// last acknowledgement (until then it may write the request's blocks). The engine
    /// recomputes the tokens of every failed load.
    pub fn reset_cache(&mut self) -> UpdateOutcome {
        let mut outcome = UpdateOutcome::default();
        for id in self.failed_loads.drain(..) {
            outcome.loads.push((id, false));
        }
        let floor = JobId(self.next_job_id);
        self.job_floor = floor;
        self.pending_reset = Some(floor);
        // Loads built and not yet sent: no worker will run them, so they hold nothing.
        let unsent: BTreeSet<JobId> = self.loads_out.drain(..).map(|j| j.id).collect();
        let jobs = std::mem::take(&mut self.jobs);
        let mut unsent_slots = Vec::new();
        for (id, record) in jobs {
            if unsent.contains(&id) {
                unsent_slots.extend_from_slice(&record.slots);
                continue;
            }
            *self.stale_by_request.entry(record.request).or_insert(0) += 1;
            self.stale_jobs.insert(
                id,
                StaleJob {
                    request: record.request,
                    slots: record.slots,
                    acked: record.acked,
                    report_load: false,
                },
            );
        }
        self.fences.clear();
        self.flush_out.clear();
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.reset_request(id, &mut outcome);
        }
        self.finishing.clear();
        self.manager.reset();
        if !unsent_slots.is_empty() {
            self.manager.release_held(&unsent_slots);
        }
        self.check_invariants();
        outcome
    }

    /// Jobs in flight at a reset that not every worker has acknowledged yet (their host slots
    /// are held until then).
    pub fn stale_jobs(&self) -> usize {
        self.stale_jobs.len()
    }

    fn reset_request(&mut self, id: RequestId, outcome: &mut UpdateOutcome) {
        let Some(tracked) = self.requests.get_mut(&id) else {
            return;
        };
        match tracked {
            Tracked::Draining(_) => {
                self.requests.remove(&id);
                self.release(id);
            }
            Tracked::Live(req) => {
                if let Some(job) = req.load_job.take() {
                    match self.stale_jobs.get_mut(&job) {
                        // Sent: it fails once every worker drained it (it may still write the
                        // request's blocks until then).
                        Some(stale) => stale.report_load = true,
                        None => outcome.loads.push((id, false)),
                    }
                }
                req.store_jobs.clear();
                req.stored_chunks = 0;
                req.tail_stored = false;
                req.matched = None;
                if req.finish.is_some() {
                    self.requests.remove(&id);
                    self.deliver_finish(id);
                    self.release(id);
                }
            }
        }
    }
}
