//! Shows that the conformance suite catches broken tiers: a wrapper around `FakeTier` breaks one
//! promise of the contract at a time, and the case that guards it must fail with a clear message.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use offload_core::tier::{
    SlotMemory, SubmitError, Tier, TierCompletion, TierFailure, TierJob, TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobId, Medium, RequestId};
use tier_testkit::conformance::{self, vec_memory, MakeTier, SuiteConfig};
use tier_testkit::{FakeTier, FakeTierConfig, FaultPlan};

/// One broken promise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Break {
    None,
    DuplicateCompletion,
    LostCompletion,
    UnknownCompletion,
    SilentCorruption,
    FalseHit,
    AcceptAfterShutdown,
    AcceptInvalid,
    CancelLosesJob,
    DrainDoesNotDeliver,
    DrainHangs,
    FailAllKeysOnPartialMiss,
    MissingReportedAsIo,
}

/// `FakeTier` with one promise broken.
struct Broken {
    inner: FakeTier,
    memory: Arc<dyn SlotMemory>,
    mode: Break,
    loads: Vec<TierJob>,
    cancelled: Vec<JobId>,
    polls: u64,
    shut_down: bool,
}

impl Tier for Broken {
    fn name(&self) -> &str {
        "broken"
    }
    fn medium(&self) -> Medium {
        Medium::Disk
    }
    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        match self.mode {
            Break::FalseHit => TierLookup::Hit,
            _ => self.inner.lookup(key),
        }
    }
    fn touch(&mut self, keys: &[ChunkKey]) {
        self.inner.touch(keys);
    }
    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        if self.mode == Break::AcceptAfterShutdown && self.shut_down {
            return Ok(());
        }
        if job.op == TierOp::Load {
            self.loads.push(job.clone());
        }
        match self.inner.submit(job) {
            Err(SubmitError::Invalid(_)) if self.mode == Break::AcceptInvalid => Ok(()),
            other => other,
        }
    }
    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        self.polls += 1;
        let mut got = Vec::new();
        self.inner.poll(&mut got);
        for mut completion in got {
            match self.mode {
                Break::DuplicateCompletion => out.push(completion.clone()),
                Break::LostCompletion if completion.id == JobId(3) => continue,
                Break::CancelLosesJob if self.cancelled.contains(&completion.id) => continue,
                Break::SilentCorruption => self.corrupt(&completion),
                Break::FailAllKeysOnPartialMiss if !completion.failed.is_empty() => {
                    if let Some(job) = self.loads.iter().find(|j| j.id == completion.id) {
                        let keys = job.chunks.iter().map(|c| c.key);
                        completion = TierCompletion::all_failed(job.id, keys, TierFailure::Missing);
                    }
                }
                Break::MissingReportedAsIo => {
                    for failed in &mut completion.failed {
                        failed.kind = TierFailure::Io;
                    }
                }
                _ => {}
            }
            out.push(completion);
        }
        if self.mode == Break::UnknownCompletion && self.polls == 5 {
            out.push(TierCompletion {
                id: JobId(999_999),
                failed: vec![],
            });
        }
    }
    fn cancel(&mut self, id: JobId) {
        self.cancelled.push(id);
        self.inner.cancel(id);
    }
    fn drain(&mut self) {
        match self.mode {
            Break::DrainDoesNotDeliver => {}
            Break::DrainHangs => loop {
                std::thread::sleep(Duration::from_secs(1));
            },
            _ => self.inner.drain(),
        }
    }
    fn on_request_finished(&mut self, request: RequestId) {
        self.inner.on_request_finished(request);
    }
    fn shutdown(&mut self) {
        self.shut_down = true;
        self.inner.shutdown();
    }
}

impl Broken {
    /// After a successful load, flips a byte in its first slot: wrong KV reported as success.
    fn corrupt(&self, completion: &TierCompletion) {
        let Some(job) = self.loads.iter().find(|j| j.id == completion.id) else {
            return;
        };
        if let (true, Some(&offload_core::TierChunk { slot, .. })) =
            (completion.is_success(), job.chunks.first())
        {
            let mut byte = [0u8];
            self.memory.read_slot(slot, 0, &mut byte);
            self.memory.write_slot(slot, 0, &[byte[0] ^ 1]);
        }
    }
}

const SHORT: SuiteConfig = SuiteConfig {
    slot_count: 32,
    slot_bytes: 1024,
    deadline: Duration::from_millis(300),
    new_memory: vec_memory,
};

fn make(mode: Break) -> impl FnMut(Arc<dyn SlotMemory>) -> Box<dyn Tier> {
    move |memory| {
        let delay = if mode == Break::DrainDoesNotDeliver {
            1000
        } else {
            1
        };
        let config = FakeTierConfig {
            completion_delay_polls: delay,
            ..FakeTierConfig::default()
        };
        Box::new(Broken {
            inner: FakeTier::new(memory.clone(), config),
            memory,
            mode,
            loads: Vec::new(),
            cancelled: Vec::new(),
            polls: 0,
            shut_down: false,
        })
    }
}

/// Runs `case` on a tier broken by `mode`; returns the panic message, or `None` if it passed.
fn failure(case: &str, mode: Break) -> Option<String> {
    let case = conformance::CASES
        .iter()
        .find(|c| c.name == case)
        .unwrap_or_else(|| panic!("no conformance case named {case}"));
    let mut make = make(mode);
    let make: &mut MakeTier<'_> = &mut make;
    let result = catch_unwind(AssertUnwindSafe(|| (case.run)(&SHORT, make)));
    let payload = result.err()?;
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default();
    Some(message)
}

fn expect_failure(case: &str, mode: Break, needle: &str) {
    match failure(case, mode) {
        None => panic!("case {case} passed although the tier breaks the contract ({mode:?})"),
        Some(message) => assert!(
            message.contains(needle) && message.contains(case) && message.contains("broken"),
            "case {case} with {mode:?} failed with an unexpected message: {message}"
        ),
    }
}

#[test]
fn the_wrapper_itself_conforms() {
    for case in conformance::CASES {
        assert_eq!(failure(case.name, Break::None), None, "case {}", case.name);
    }
}

#[test]
fn duplicate_completion_is_caught() {
    expect_failure(
        "every_accepted_job_completes_once",
        Break::DuplicateCompletion,
        "more than once",
    );
}

#[test]
fn lost_completion_is_caught() {
    expect_failure(
        "every_accepted_job_completes_once",
        Break::LostCompletion,
        "did not complete",
    );
}

#[test]
fn completion_of_unknown_job_is_caught() {
    expect_failure(
        "many_jobs_in_flight",
        Break::UnknownCompletion,
        "never accepted",
    );
}

#[test]
fn silent_corruption_is_caught() {
    expect_failure(
        "store_load_round_trip",
        Break::SilentCorruption,
        "differs from the stored bytes",
    );
}

#[test]
fn false_hit_is_caught() {
    expect_failure(
        "lookup_hit_after_store_miss_when_absent",
        Break::FalseHit,
        "expected Miss",
    );
}

#[test]
fn accepting_after_shutdown_is_caught() {
    expect_failure(
        "shutdown_refuses_submit_and_returns_pending",
        Break::AcceptAfterShutdown,
        "expected ShutDown",
    );
}

#[test]
fn accepting_invalid_jobs_is_caught() {
    expect_failure(
        "refused_submit_has_no_effect",
        Break::AcceptInvalid,
        "expected Invalid",
    );
}

#[test]
fn cancel_that_loses_the_job_is_caught() {
    expect_failure(
        "cancel_still_completes_once",
        Break::CancelLosesJob,
        "did not complete",
    );
}

#[test]
fn drain_that_does_not_deliver_is_caught() {
    expect_failure(
        "drain_completes_every_job",
        Break::DrainDoesNotDeliver,
        "one poll did not return",
    );
}

#[test]
fn drain_that_hangs_is_caught() {
    expect_failure(
        "drain_completes_every_job",
        Break::DrainHangs,
        "drain did not return within",
    );
}

#[test]
fn failing_present_keys_beside_a_missing_one_is_caught() {
    expect_failure(
        "load_of_missing_key_fails_only_that_key",
        Break::FailAllKeysOnPartialMiss,
        "failed keys",
    );
}

#[test]
fn a_missing_key_reported_with_another_failure_kind_is_caught() {
    expect_failure(
        "load_of_missing_key_fails_only_that_key",
        Break::MissingReportedAsIo,
        "expected it alone, Missing",
    );
}

#[test]
fn a_stalled_fake_fails_the_suite() {
    let mut make = |memory: Arc<dyn SlotMemory>| -> Box<dyn Tier> {
        let faults = FaultPlan {
            stall: true,
            ..FaultPlan::default()
        };
        Box::new(FakeTier::new(
            memory,
            FakeTierConfig {
                faults,
                ..FakeTierConfig::default()
            },
        ))
    };
    let result = catch_unwind(AssertUnwindSafe(|| {
        conformance::store_load_round_trip(&SHORT, &mut make)
    }));
    assert!(
        result.is_err(),
        "a tier whose jobs never complete must fail the round trip"
    );
}
