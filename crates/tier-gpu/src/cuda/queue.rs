//! The in-flight bookkeeping of the CUDA engine, kept free of driver calls so that it is tested
//! without a GPU: one FIFO lane per direction whose entries each own a completion event, a fixed
//! set of events (one per job that may be in flight), and the completions found by blocking waits
//! that the next poll reports.
//!
//! Ordering argument: a lane's events are recorded on one stream in submission order, so an event
//! completes only after every earlier event of its lane; reaping each lane front to back, and
//! stopping at the first pending event, therefore reports completions in submission order without
//! ever handing back memory that a copy may still write.

use std::collections::VecDeque;

use offload_core::{JobId, JobKind};

use super::driver::DriverFailure;
use crate::TransferDone;

/// How to look at an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Look {
    /// Without blocking (`cuEventQuery`).
    Query,
    /// Blocking until it completed (`cuEventSynchronize`).
    Block,
}

/// What the driver said about an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum EventState {
    /// Every copy recorded before it finished.
    Complete,
    /// Not yet (only from [`Look::Query`]).
    NotReady,
    /// The driver reported an error; the job failed.
    Failed(DriverFailure),
}

/// One accepted job.
struct Entry<E> {
    job: JobId,
    kind: JobKind,
    event: E,
    /// Whether `event` was recorded after the job's copies. If not, the stream was synchronised at
    /// submit time (or is dead), so the entry completes, failed, when it reaches the front.
    recorded: bool,
    /// Whether every copy was enqueued without error.
    enqueued_ok: bool,
}

/// Lanes of in-flight jobs plus the pool of completion events; `E` is the event handle.
pub(crate) struct Queues<E> {
    lanes: [VecDeque<Entry<E>>; 2],
    /// Completions found by `wait`/`drain`, reported by the next `poll`.
    ready: VecDeque<TransferDone>,
    free: Vec<E>,
    capacity: usize,
}

/// The lane of a direction: stores (device to host) and loads (host to device).
pub(crate) fn lane(kind: JobKind) -> usize {
    match kind {
        JobKind::Store => 0,
        JobKind::Load => 1,
    }
}

impl<E: Copy> Queues<E> {
    /// Empty lanes and no event.
    pub(crate) fn new() -> Self {
        Self {
            lanes: [VecDeque::new(), VecDeque::new()],
            ready: VecDeque::new(),
            free: Vec::new(),
            capacity: 0,
        }
    }

    /// Adds an event to the pool: one more job may be in flight.
    pub(crate) fn add_event(&mut self, event: E) {
        self.free.push(event);
        self.capacity += 1;
    }

    /// Jobs that may be accepted and not yet reported.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Jobs accepted and not yet reported by `poll` (in a lane, or found complete by a wait).
    pub(crate) fn in_flight(&self) -> usize {
        self.lanes.iter().map(VecDeque::len).sum::<usize>() + self.ready.len()
    }

    /// An event for a new job, or `None` when `capacity` jobs are in flight.
    pub(crate) fn take_event(&mut self) -> Option<E> {
        if self.in_flight() >= self.capacity {
            return None;
        }
        self.free.pop()
    }

    /// Appends an accepted job to its lane; `event` came from [`Queues::take_event`].
    pub(crate) fn push(
        &mut self,
        job: JobId,
        kind: JobKind,
        event: E,
        recorded: bool,
        enqueued_ok: bool,
    ) {
        self.lanes[lane(kind)].push_back(Entry {
            job,
            kind,
            event,
            recorded,
            enqueued_ok,
        });
        debug_assert!(self.in_flight() <= self.capacity, "more jobs than events");
    }

    /// Whether `job` is in a lane (accepted, completion not yet found).
    pub(crate) fn is_pending(&self, job: JobId) -> bool {
        self.lanes.iter().flatten().any(|e| e.job == job)
    }

    /// Reports completions: first those found by waits, then each lane front to back, stopping at
    /// its first pending event. Never blocks (looks with [`Look::Query`]).
    pub(crate) fn poll(
        &mut self,
        mut look: impl FnMut(E, Look) -> EventState,
        out: &mut Vec<TransferDone>,
    ) {
        out.extend(self.ready.drain(..));
        self.query_fronts(&mut look, |done| out.push(done));
    }

    /// Finishes, lane by lane from the front, every job whose event says complete (looking with
    /// [`Look::Query`]), handing each completion to `done`; stops a lane at its first pending
    /// event.
    fn query_fronts(
        &mut self,
        look: &mut impl FnMut(E, Look) -> EventState,
        mut done: impl FnMut(TransferDone),
    ) {
        for lane in 0..self.lanes.len() {
            while let Some(front) = self.lanes[lane].front() {
                let state = if front.recorded {
                    look(front.event, Look::Query)
                } else {
                    EventState::Complete
                };
                if state == EventState::NotReady {
                    break;
                }
                done(self.finish(lane, &state));
            }
        }
    }

    /// Blocks until `job` and every earlier job of its lane completed; their completions are
    /// reported by the next `poll`. Returns whether `job` was pending.
    pub(crate) fn wait(&mut self, job: JobId, look: impl FnMut(E, Look) -> EventState) -> bool {
        for lane in 0..self.lanes.len() {
            if let Some(at) = self.lanes[lane].iter().position(|e| e.job == job) {
                self.block_on_front(lane, at + 1, look);
                return true;
            }
        }
        false
    }

    /// Blocks until every pending job completed; completions are reported by the next `poll`.
    pub(crate) fn drain(&mut self, mut look: impl FnMut(E, Look) -> EventState) {
        for lane in 0..self.lanes.len() {
            let count = self.lanes[lane].len();
            self.block_on_front(lane, count, &mut look);
        }
    }

    /// Like [`Queues::drain`], but only queries events (never blocks in the driver) and gives up
    /// at `deadline`: returns whether every pending job completed. Jobs not completed stay in
    /// their lanes (their memory theirs); completions found are reported by the next `poll`.
    pub(crate) fn drain_until(
        &mut self,
        deadline: std::time::Instant,
        mut look: impl FnMut(E, Look) -> EventState,
    ) -> bool {
        let mut found = Vec::new();
        loop {
            self.query_fronts(&mut look, |done| found.push(done));
            self.ready.extend(found.drain(..));
            if self.lanes.iter().all(VecDeque::is_empty) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(DRAIN_QUERY_INTERVAL);
        }
    }

    /// Every event handle, free or in a lane (to destroy them).
    pub(crate) fn events(&self) -> impl Iterator<Item = E> + '_ {
        let pending = self.lanes.iter().flatten().map(|e| e.event);
        self.free.iter().copied().chain(pending)
    }

    /// Finishes the first `count` entries of `lane`, blocking on each event, into `ready`.
    fn block_on_front(
        &mut self,
        lane: usize,
        count: usize,
        mut look: impl FnMut(E, Look) -> EventState,
    ) {
        for _ in 0..count {
            let Some(front) = self.lanes[lane].front() else {
                return;
            };
            let state = if front.recorded {
                // A blocking look never answers "not ready"; if a driver did, look again rather
                // than hand back memory that a copy may still write.
                loop {
                    match look(front.event, Look::Block) {
                        EventState::NotReady => continue,
                        state => break state,
                    }
                }
            } else {
                EventState::Complete
            };
            let done = self.finish(lane, &state);
            self.ready.push_back(done);
        }
    }

    /// Pops the front of `lane`, returns its event to the pool, and says how the job ended.
    fn finish(&mut self, lane: usize, state: &EventState) -> TransferDone {
        let Some(entry) = self.lanes[lane].pop_front() else {
            unreachable!("finish is called on a non-empty lane");
        };
        self.free.push(entry.event);
        TransferDone {
            job: entry.job,
            kind: entry.kind,
            success: entry.recorded && entry.enqueued_ok && *state == EventState::Complete,
        }
    }
}

/// How often a bounded drain queries a pending event.
const DRAIN_QUERY_INTERVAL: std::time::Duration = std::time::Duration::from_micros(50);

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use cudarc::driver::sys::cudaError_enum;

    use super::*;

    /// Fake events: ids; a set of completed ones; a set of broken ones; blocking completes.
    #[derive(Default)]
    struct FakeDevice {
        complete: BTreeSet<u32>,
        broken: BTreeSet<u32>,
        looks: Vec<(u32, Look)>,
    }

    impl FakeDevice {
        fn look(&mut self, event: u32, how: Look) -> EventState {
            self.looks.push((event, how));
            if self.broken.contains(&event) {
                return EventState::Failed(DriverFailure {
                    op: format!("event {event}"),
                    code: cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS,
                });
            }
            if how == Look::Block {
                self.complete.insert(event);
            }
            if self.complete.contains(&event) {
                EventState::Complete
            } else {
                EventState::NotReady
            }
        }
    }

    fn queues(capacity: u32) -> Queues<u32> {
        let mut q = Queues::new();
        for e in 0..capacity {
            q.add_event(e);
        }
        q
    }

    /// Submits `job` of `kind` with an event from the pool; returns the event.
    fn submit(q: &mut Queues<u32>, job: u64, kind: JobKind) -> u32 {
        let event = q.take_event().expect("an event is free");
        q.push(JobId(job), kind, event, true, true);
        event
    }

    fn done(job: u64, kind: JobKind, success: bool) -> TransferDone {
        TransferDone {
            job: JobId(job),
            kind,
            success,
        }
    }

    use JobKind::{Load, Store};

    #[test]
    fn each_direction_completes_in_submission_order_even_when_a_later_event_finishes_first() {
        let mut q = queues(8);
        let mut dev = FakeDevice::default();
        let s1 = submit(&mut q, 1, Store);
        let l2 = submit(&mut q, 2, Load);
        let s3 = submit(&mut q, 3, Store);
        let l4 = submit(&mut q, 4, Load);
        // The later store's and the later load's events complete first (they cannot on one
        // stream, but the lanes must not rely on it to keep order).
        dev.complete.extend([s3, l4]);
        let mut out = Vec::new();
        q.poll(|e, how| dev.look(e, how), &mut out);
        assert!(out.is_empty(), "nothing before the lane fronts: {out:?}");
        dev.complete.insert(l2);
        q.poll(|e, how| dev.look(e, how), &mut out);
        assert_eq!(out, vec![done(2, Load, true), done(4, Load, true)]);
        dev.complete.insert(s1);
        out.clear();
        q.poll(|e, how| dev.look(e, how), &mut out);
        assert_eq!(out, vec![done(1, Store, true), done(3, Store, true)]);
        assert_eq!(q.in_flight(), 0);
        assert!(
            dev.looks.iter().all(|&(_, how)| how == Look::Query),
            "poll never blocks"
        );
    }

    #[test]
    fn wait_finishes_the_job_and_its_lane_predecessors_only_and_poll_reports_them_first() {
        let mut q = queues(8);
        let mut dev = FakeDevice::default();
        for (job, kind) in [(1, Store), (2, Load), (3, Store), (4, Store)] {
            submit(&mut q, job, kind);
        }
        assert!(q.wait(JobId(3), |e, how| dev.look(e, how)));
        assert!(!q.is_pending(JobId(1)) && !q.is_pending(JobId(3)));
        assert!(q.is_pending(JobId(2)) && q.is_pending(JobId(4)));
        assert_eq!(q.in_flight(), 4, "found but unreported jobs still count");
        assert!(
            !q.wait(JobId(3), |e, how| dev.look(e, how)),
            "already found"
        );
        assert!(!q.wait(JobId(99), |e, how| dev.look(e, how)), "unknown job");
        let mut out = Vec::new();
        q.poll(|e, how| dev.look(e, how), &mut out);
        assert_eq!(out, vec![done(1, Store, true), done(3, Store, true)]);
        q.drain(|e, how| dev.look(e, how));
        out.clear();
        q.poll(|e, how| dev.look(e, how), &mut out);
        assert_eq!(out, vec![done(4, Store, true), done(2, Load, true)]);
        assert_eq!(q.in_flight(), 0);
    }

    #[test]
    fn capacity_counts_found_but_unreported_jobs_and_every_event_comes_back_once() {
        let mut q = queues(2);
        let mut dev = FakeDevice::default();
        submit(&mut q, 1, Store);
        submit(&mut q, 2, Load);
        assert_eq!(q.take_event(), None, "two in flight");
        q.drain(|e, how| dev.look(e, how));
        assert_eq!(q.take_event(), None, "found, not yet reported");
        let mut out = Vec::new();
        q.poll(|e, how| dev.look(e, how), &mut out);
        assert_eq!(out.len(), 2);
        let mut events: Vec<u32> = q.events().collect();
        events.sort_unstable();
        assert_eq!(events, vec![0, 1], "each event exactly once, none lost");
        assert!(q.take_event().is_some());
    }

    #[test]
    fn failed_enqueue_unrecorded_event_and_driver_errors_report_failure_in_order() {
        let mut q = queues(8);
        let mut dev = FakeDevice::default();
        let e1 = q.take_event().expect("free");
        q.push(JobId(1), Store, e1, true, false); // a copy failed to enqueue
        let e2 = q.take_event().expect("free");
        q.push(JobId(2), Store, e2, false, true); // the completion event could not be recorded
        let e3 = submit(&mut q, 3, Store);
        dev.broken.insert(e3); // the driver reports an error on the event
        submit(&mut q, 4, Store);
        dev.complete.insert(e1);
        let mut out = Vec::new();
        q.poll(|e, how| dev.look(e, how), &mut out);
        assert_eq!(
            out,
            vec![
                done(1, Store, false),
                done(2, Store, false),
                done(3, Store, false)
            ]
        );
        assert!(
            !dev.looks.iter().any(|&(e, _)| e == e2),
            "an unrecorded event is never queried"
        );
        q.drain(|e, how| dev.look(e, how));
        out.clear();
        q.poll(|e, how| dev.look(e, how), &mut out);
        assert_eq!(out, vec![done(4, Store, true)]);
    }

    #[test]
    fn a_bounded_drain_queries_only_and_leaves_a_stuck_job_pending_at_its_deadline() {
        // Issue 18 item 5: the worker's drain of the CUDA engine blocked in cuEventSynchronize
        // with no bound. The bounded drain only queries, and gives up at its deadline.
        let mut q = queues(8);
        let mut dev = FakeDevice::default();
        let s1 = submit(&mut q, 1, Store);
        let l2 = submit(&mut q, 2, Load);
        dev.complete.insert(l2);
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(5);
        assert!(!q.drain_until(deadline, |e, how| dev.look(e, how)));
        assert!(q.is_pending(JobId(1)), "the stuck store stays in flight");
        assert!(!q.is_pending(JobId(2)), "the completed load was found");
        assert!(dev.looks.iter().all(|(_, how)| *how == Look::Query));
        dev.complete.insert(s1);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        assert!(q.drain_until(deadline, |e, how| dev.look(e, how)));
        let mut out = Vec::new();
        q.poll(|e, how| dev.look(e, how), &mut out);
        out.sort_by_key(|d| d.job);
        assert_eq!(out, vec![done(1, Store, true), done(2, Load, true)]);
    }
}
