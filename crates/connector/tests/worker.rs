//! The worker handle over a scripted transfer engine: loads start before the compute, stores
//! after it; flushes and resets wait; busy and refused jobs are still reported exactly once.
#![cfg(feature = "gpu")]

use std::collections::VecDeque;

use connector::WorkerHandle;
use offload_core::{ConnectorMeta, Job, JobId, JobKind, RequestId};
use tier_gpu::{PlanError, TransferDone, TransferEngine, TransferError};

#[derive(Debug, PartialEq, Eq, Clone)]
enum Event {
    Submit(u64),
    Wait(u64),
    Drain,
}

/// Completes a job on the `latency + 1`-th poll after its submit (the second by default); holds
/// at most `max` jobs; refuses job ids listed in `bad` as not fitting the layout.
struct Scripted {
    max: usize,
    latency: u32,
    /// Refuse every submit as busy, even when idle (a broken or wedged engine).
    always_busy: bool,
    /// Accepted jobs never complete (copies that stopped making progress): an unbounded
    /// `drain` would never return, so it panics; `drain_until` returns `false`.
    stuck: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Submit calls so far; a caller that loops on a busy engine without bound trips a panic.
    submit_calls: u32,
    bad: Vec<u64>,
    held: VecDeque<(Job, u32)>,
    log: Vec<Event>,
    /// Each accepted job and the compute point it was made to wait for.
    after: Vec<(u64, Option<u32>)>,
}

impl Scripted {
    fn new(max: usize) -> Self {
        Self {
            max,
            latency: 1,
            always_busy: false,
            stuck: Default::default(),
            submit_calls: 0,
            bad: Vec::new(),
            held: VecDeque::new(),
            log: Vec::new(),
            after: Vec::new(),
        }
    }
}

impl Scripted {
    fn is_stuck(&self) -> bool {
        self.stuck.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl TransferEngine for Scripted {
    /// A compute point: a step number.
    type Dependency = u32;

    fn submit_after(&mut self, job: &Job, after: Option<u32>) -> Result<(), TransferError> {
        if self.bad.contains(&job.id.0) {
            return Err(TransferError::Plan {
                job: job.id,
                source: PlanError::Layout("refused".to_owned()),
            });
        }
        self.submit_calls += 1;
        assert!(
            self.submit_calls < 10_000,
            "the caller retries a busy engine forever"
        );
        if self.always_busy || self.held.len() >= self.max {
            return Err(TransferError::Busy {
                in_flight: self.held.len(),
            });
        }
        self.log.push(Event::Submit(job.id.0));
        self.after.push((job.id.0, after));
        self.held.push_back((job.clone(), self.latency));
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<TransferDone>) {
        if self.is_stuck() {
            return;
        }
        let mut keep = VecDeque::new();
        for (job, left) in self.held.drain(..) {
            if left == 0 {
                out.push(TransferDone {
                    job: job.id,
                    kind: job.kind,
                    success: true,
                });
            } else {
                keep.push_back((job, left - 1));
            }
        }
        self.held = keep;
    }
    fn wait(&mut self, job: JobId) {
        self.log.push(Event::Wait(job.0));
        for h in &mut self.held {
            h.1 = 0;
        }
    }
    fn drain(&mut self) {
        assert!(
            !self.is_stuck() || self.held.is_empty(),
            "an unbounded drain of a stuck engine never returns"
        );
        self.log.push(Event::Drain);
        for h in &mut self.held {
            h.1 = 0;
        }
    }
    fn drain_until(&mut self, _deadline: std::time::Instant) -> bool {
        if self.is_stuck() && !self.held.is_empty() {
            self.log.push(Event::Drain);
            return false;
        }
        self.drain();
        true
    }
}

fn job(id: u64, kind: JobKind) -> Job {
    Job {
        id: JobId(id),
        request: RequestId(1),
        kind,
        transfers: Vec::new(),
    }
}

fn acked(outputs: &[offload_core::WorkerOutput]) -> Vec<(u64, bool)> {
    let mut v: Vec<(u64, bool)> = outputs
        .iter()
        .flat_map(|o| o.acks.iter().map(|a| (a.job.0, a.success)))
        .collect();
    v.sort_unstable();
    v
}

#[test]
fn loads_start_before_compute_and_stores_after() {
    let mut w = WorkerHandle::new(0, Scripted::new(8));
    let meta = ConnectorMeta {
        loads: vec![job(1, JobKind::Load)],
        stores: vec![job(2, JobKind::Store)],
        ..ConnectorMeta::default()
    };
    w.before_compute(&meta, None);
    assert_eq!(
        w.engine().log,
        vec![Event::Submit(1)],
        "stores wait for the compute"
    );
    w.after_compute(&meta, None);
    assert_eq!(w.engine().log, vec![Event::Submit(1), Event::Submit(2)]);
    let mut outputs = Vec::new();
    for _ in 0..4 {
        outputs.push(w.take_output());
    }
    assert_eq!(acked(&outputs), vec![(1, true), (2, true)]);
    assert!(outputs.iter().all(|o| o.worker == 0));
}

#[test]
fn flush_waits_for_the_store_and_reset_drains_older_jobs() {
    let mut w = WorkerHandle::new(1, Scripted::new(8));
    w.after_compute(
        &ConnectorMeta {
            stores: vec![job(3, JobKind::Store)],
            ..ConnectorMeta::default()
        },
        None,
    );
    w.before_compute(
        &ConnectorMeta {
            flush: vec![JobId(3)],
            ..ConnectorMeta::default()
        },
        None,
    );
    assert!(w.engine().log.contains(&Event::Wait(3)));
    assert_eq!(
        acked(&[w.take_output()]),
        vec![(3, true)],
        "flushed store is done"
    );
    w.after_compute(
        &ConnectorMeta {
            stores: vec![job(4, JobKind::Store)],
            ..ConnectorMeta::default()
        },
        None,
    );
    w.before_compute(
        &ConnectorMeta {
            reset_before: Some(JobId(5)),
            ..ConnectorMeta::default()
        },
        None,
    );
    let drain = w.engine().log.iter().rposition(|e| *e == Event::Drain);
    assert!(drain.is_some());
    assert_eq!(acked(&[w.take_output()]), vec![(4, true)]);
}

#[test]
fn busy_and_refused_jobs_are_reported_exactly_once() {
    let mut engine = Scripted::new(1);
    engine.bad.push(12);
    let mut w = WorkerHandle::new(0, engine);
    let meta = ConnectorMeta {
        stores: (10..14).map(|i| job(i, JobKind::Store)).collect(),
        ..ConnectorMeta::default()
    };
    w.before_compute(&meta, None);
    w.after_compute(&meta, None);
    let mut outputs = Vec::new();
    for _ in 0..20 {
        outputs.push(w.take_output());
    }
    assert_eq!(
        acked(&outputs),
        vec![(10, true), (11, true), (12, false), (13, true)]
    );
    assert!(w.counters().submits_busy > 0);
    assert_eq!(w.counters().jobs_failed, 1);
}

#[test]
fn loads_wait_for_the_reads_and_stores_for_the_writes_of_the_compute() {
    // Design.md section 4 item 14 (issue 18 item 1): every copy is ordered after the compute it
    // depends on; a job that waited in the handle's queue (engine busy) keeps its dependency.
    let mut w = WorkerHandle::new(0, Scripted::new(2));
    let step = |loads: std::ops::Range<u64>, stores: std::ops::Range<u64>| ConnectorMeta {
        loads: loads.map(|i| job(i, JobKind::Load)).collect(),
        stores: stores.map(|i| job(i, JobKind::Store)).collect(),
        ..ConnectorMeta::default()
    };
    // Step 7: the previous step's kernels (point 6) may still read the blocks loads overwrite;
    // this step's kernels are done writing at point 7.
    let meta = step(1..3, 3..6);
    w.before_compute(&meta, Some(6));
    w.after_compute(&meta, Some(7));
    let meta = step(6..7, 7..8);
    w.before_compute(&meta, Some(7));
    w.after_compute(&meta, Some(8));
    for _ in 0..20 {
        w.take_output();
    }
    let mut after = w.engine().after.clone();
    after.sort_unstable();
    assert_eq!(
        after,
        vec![
            (1, Some(6)),
            (2, Some(6)),
            (3, Some(7)),
            (4, Some(7)),
            (5, Some(7)),
            (6, Some(7)),
            (7, Some(8)),
        ]
    );
    assert!(
        w.counters().submits_busy > 0,
        "some jobs waited in the queue"
    );
}

#[test]
fn a_reset_ends_every_queued_older_job_even_behind_a_busy_engine() {
    // Issue 18 item 2: the engine holds one job; later ones wait in the handle's queue. A reset
    // must end all of them before anything newer runs: none may be submitted after the reset,
    // when its slots and blocks may already belong to newer jobs.
    let mut engine = Scripted::new(1);
    engine.latency = 3;
    let mut w = WorkerHandle::new(0, engine);
    w.after_compute(
        &ConnectorMeta {
            stores: (1..5).map(|i| job(i, JobKind::Store)).collect(),
            ..ConnectorMeta::default()
        },
        None,
    );
    assert_eq!(
        w.engine().log,
        vec![Event::Submit(1)],
        "jobs 2-4 wait in the handle's queue"
    );
    let reset = ConnectorMeta {
        reset_before: Some(JobId(5)),
        loads: vec![job(5, JobKind::Load)],
        ..ConnectorMeta::default()
    };
    w.before_compute(&reset, None);
    w.after_compute(&reset, None);
    let mut outputs = Vec::new();
    for _ in 0..20 {
        outputs.push(w.take_output());
    }
    let log = &w.engine().log;
    let drain = log
        .iter()
        .position(|e| *e == Event::Drain)
        .expect("the reset drains the engine");
    let late: Vec<&Event> = log[drain..]
        .iter()
        .filter(|e| matches!(e, Event::Submit(id) if *id < 5))
        .collect();
    assert!(
        late.is_empty(),
        "pre-reset jobs submitted after the reset: {late:?}"
    );
    assert_eq!(
        acked(&outputs),
        vec![(1, true), (2, false), (3, false), (4, false), (5, true)],
        "every job reported exactly once; the queued ones cancelled"
    );
    assert_eq!(w.counters().jobs_cancelled_at_reset, 3);
}

#[test]
fn drain_and_flush_end_against_an_engine_that_stays_busy_when_idle() {
    // Issue 18 item 5: the worker's drain and flush loops retried a busy engine forever. A
    // drained engine that still refuses will never take the job: it is acknowledged as failed.
    let mut engine = Scripted::new(8);
    engine.always_busy = true;
    let mut w = WorkerHandle::new(0, engine);
    w.after_compute(
        &ConnectorMeta {
            stores: (1..4).map(|i| job(i, JobKind::Store)).collect(),
            ..ConnectorMeta::default()
        },
        None,
    );
    w.before_compute(
        &ConnectorMeta {
            flush: vec![JobId(1)],
            ..ConnectorMeta::default()
        },
        None,
    );
    assert_eq!(
        acked(&[w.take_output()]),
        vec![(1, false)],
        "the flushed store failed"
    );
    w.drain();
    assert_eq!(acked(&[w.take_output()]), vec![(2, false), (3, false)]);
    assert_eq!(w.counters().jobs_refused_when_drained, 3);
    assert!(
        acked(&[w.take_output()]).is_empty(),
        "each job reported once"
    );
}

#[test]
fn drain_returns_at_its_deadline_when_the_engine_is_stuck_and_reports_the_jobs_later() {
    // Issue 18 item 5: the worker's drain waited on the engine's drain with no bound (a GPU
    // stream or copy thread that stopped). It now waits at most its deadline, says so, counts
    // it, and the jobs stay in flight until the engine reports them.
    let engine = Scripted::new(1);
    let stuck = std::sync::Arc::clone(&engine.stuck);
    stuck.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut w = WorkerHandle::with_drain_deadline(0, engine, std::time::Duration::from_millis(1));
    w.after_compute(
        &ConnectorMeta {
            stores: (1..3).map(|i| job(i, JobKind::Store)).collect(),
            ..ConnectorMeta::default()
        },
        None,
    );
    assert!(!w.drain(), "a stuck engine: the drain gave up");
    assert!(!w.drain());
    assert_eq!(w.counters().engine_drain_timeouts, 2);
    assert!(
        acked(&[w.take_output()]).is_empty(),
        "jobs in flight and queued are not reported while the engine holds them"
    );
    stuck.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(w.drain());
    assert_eq!(acked(&[w.take_output()]), vec![(1, true), (2, true)]);
    assert_eq!(w.counters().engine_drain_timeouts, 2);
}
