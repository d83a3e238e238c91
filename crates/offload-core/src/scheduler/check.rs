//! Broken bookkeeping invariants (panic in strict mode, counted otherwise; a request they concern
//! is switched off) and the strict cross-checks of the request table, job table and fences.

use std::collections::BTreeMap;

use crate::invariant;
use crate::key::{JobId, RequestId};
use crate::manager::OffloadManager;
use crate::meta::JobKind;
use crate::scheduler::request::Tracked;
use crate::scheduler::Scheduler;

impl<M: OffloadManager> Scheduler<M> {
    /// Reports a broken bookkeeping invariant: panics in strict mode, else counts it.
    #[track_caller]
    pub(super) fn broken(&mut self, what: std::fmt::Arguments<'_>) {
        self.stats.invariant_failures += 1;
        invariant::broken(self.config.strict, what);
    }

    /// A broken invariant about request `id` (design.md section 4, last paragraph): panics in
    /// strict mode; otherwise counts it and, if the request is live, switches its offload off
    /// (no more loads or stores for it; its jobs in flight still complete), so that a request
    /// whose state is not trusted never moves KV again.
    #[track_caller]
    pub(super) fn broken_for(&mut self, id: RequestId, what: std::fmt::Arguments<'_>) {
        self.broken(what);
        if let Some(Tracked::Live(req)) = self.requests.get_mut(&id) {
            if !req.disabled {
                req.disabled = true;
                req.matched = None;
                self.stats.requests_disabled += 1;
            }
        }
    }

    /// Cross-checks the request table, the job table and the fences (strict mode only: it walks
    /// every table).
    pub(super) fn check_invariants(&mut self) {
        if !self.config.strict {
            return;
        }
        let mut counted = 0usize;
        for (&id, tracked) in &self.requests {
            let (loads, stores): (Vec<JobId>, &[JobId]) = match tracked {
                Tracked::Live(req) => {
                    // Item 5: one load or any number of stores, never both.
                    assert!(
                        req.load_job.is_none() || req.store_jobs.is_empty(),
                        "request {id:?} has a load and stores in flight"
                    );
                    (req.load_job.into_iter().collect(), &req.store_jobs)
                }
                Tracked::Draining(d) => {
                    assert!(!d.jobs.is_empty(), "draining request {id:?} has no job");
                    (Vec::new(), &d.jobs)
                }
            };
            for job in loads.iter().chain(stores) {
                let record = self.jobs.get(job);
                assert!(
                    record.is_some_and(|r| r.request == id),
                    "request {id:?} lists job {job:?} that is not its own"
                );
                counted += 1;
            }
        }
        assert_eq!(counted, self.jobs.len(), "jobs without a request");
        let mut stale: BTreeMap<RequestId, u32> = BTreeMap::new();
        for job in self.stale_jobs.values() {
            *stale.entry(job.request).or_insert(0) += 1;
        }
        assert_eq!(
            stale, self.stale_by_request,
            "stale jobs miscounted per request"
        );
        for id in &self.release_after_stale {
            assert!(
                self.stale_by_request.contains_key(id) && !self.requests.contains_key(id),
                "request {id:?} waits for stale jobs it does not have, or is still tracked"
            );
        }
        for &(_, job) in &self.fences {
            assert!(
                self.jobs
                    .get(&job)
                    .is_some_and(|r| r.kind == JobKind::Store),
                "fence on job {job:?} that is not an in-flight store"
            );
        }
        for id in &self.finishing {
            assert!(
                matches!(self.requests.get(id), Some(Tracked::Live(r)) if r.finish.is_some()),
                "finishing request {id:?} is not a finished live request"
            );
        }
    }
}
