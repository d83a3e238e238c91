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

/// Completes a job on the second poll after its submit; holds at most `max` jobs; refuses job
/// ids listed in `bad` as not fitting the layout.
struct Scripted {
    max: usize,
    bad: Vec<u64>,
    held: VecDeque<(Job, u32)>,
    log: Vec<Event>,
}

impl Scripted {
    fn new(max: usize) -> Self {
        Self {
            max,
            bad: Vec::new(),
            held: VecDeque::new(),
            log: Vec::new(),
        }
    }
}

impl TransferEngine for Scripted {
    fn submit(&mut self, job: &Job) -> Result<(), TransferError> {
        if self.bad.contains(&job.id.0) {
            return Err(TransferError::Plan {
                job: job.id,
                source: PlanError::Layout("refused".to_owned()),
            });
        }
        if self.held.len() >= self.max {
            return Err(TransferError::Busy {
                in_flight: self.held.len(),
            });
        }
        self.log.push(Event::Submit(job.id.0));
        self.held.push_back((job.clone(), 1));
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<TransferDone>) {
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
        self.log.push(Event::Drain);
        for h in &mut self.held {
            h.1 = 0;
        }
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
    w.before_compute(&meta);
    assert_eq!(
        w.engine().log,
        vec![Event::Submit(1)],
        "stores wait for the compute"
    );
    w.after_compute(&meta);
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
    w.after_compute(&ConnectorMeta {
        stores: vec![job(3, JobKind::Store)],
        ..ConnectorMeta::default()
    });
    w.before_compute(&ConnectorMeta {
        flush: vec![JobId(3)],
        ..ConnectorMeta::default()
    });
    assert!(w.engine().log.contains(&Event::Wait(3)));
    assert_eq!(
        acked(&[w.take_output()]),
        vec![(3, true)],
        "flushed store is done"
    );
    w.after_compute(&ConnectorMeta {
        stores: vec![job(4, JobKind::Store)],
        ..ConnectorMeta::default()
    });
    w.before_compute(&ConnectorMeta {
        reset_before: Some(JobId(5)),
        ..ConnectorMeta::default()
    });
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
    w.before_compute(&meta);
    w.after_compute(&meta);
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
