//! Scheduler-level lifecycle tests: each drives the [`Scheduler`] with the engine's calls and
//! checks the manager calls it makes, as a snapshot with one line per call (design.md section 4).

use offload_core::{
    BlockId, ChunkKey, ConnectorMeta, EvictionPolicy, FinishKind, FinishedRequest, HostPool,
    JobAck, JobId, KvEvent, LookupResult, MatchResult, NewRequest, OffloadManager, OffloadPolicy,
    PoolConfig, PreparedStore, RequestId, Scheduler, SchedulerConfig, SlotId, StepInput,
    StepRequest, WorkerOutput,
};

/// A manager that forwards to a [`HostPool`] and logs every request-scoped call.
struct Logged {
    pool: HostPool,
    log: Vec<String>,
    finished: Vec<RequestId>,
}

impl Logged {
    fn new(slots: u32) -> Self {
        let pool = HostPool::new(PoolConfig {
            slot_count: slots,
            policy: EvictionPolicy::Lru,
            reuse_threshold: 0,
            events: true,
        })
        .expect("valid pool config");
        Self {
            pool,
            log: Vec::new(),
            finished: Vec::new(),
        }
    }
}

fn fmt_keys(keys: &[ChunkKey]) -> String {
    let names: Vec<String> = keys.iter().map(|k| format!("{:x}", k.hash)).collect();
    names.join(",")
}

impl OffloadManager for Logged {
    fn lookup(&mut self, key: ChunkKey, request: RequestId) -> LookupResult {
        self.pool.lookup(key, request)
    }
    fn prepare_load(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        slots: &mut Vec<SlotId>,
    ) -> Result<(), offload_core::CoreError> {
        self.log
            .push(format!("prepare_load r{} [{}]", request.0, fmt_keys(keys)));
        self.pool.prepare_load(keys, request, slots)
    }
    fn complete_load(&mut self, keys: &[ChunkKey]) {
        self.log.push(format!("complete_load [{}]", fmt_keys(keys)));
        self.pool.complete_load(keys)
    }
    fn touch(&mut self, keys: &[ChunkKey], request: RequestId) {
        assert!(
            !self.finished.contains(&request),
            "touch for finished request {request:?}"
        );
        self.pool.touch(keys, request)
    }
    fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        out: &mut PreparedStore,
    ) -> Result<(), offload_core::CoreError> {
        // The reference's crash: a store prepared for a request the manager saw finish.
        assert!(
            !self.finished.contains(&request),
            "prepare_store for finished request {request:?}"
        );
        let result = self.pool.prepare_store(keys, request, out);
        let verdict = if result.is_ok() { "ok" } else { "no space" };
        self.log.push(format!(
            "prepare_store r{} [{}] {verdict}",
            request.0,
            fmt_keys(keys)
        ));
        result
    }
    fn complete_store(&mut self, keys: &[ChunkKey], success: bool) {
        self.log
            .push(format!("complete_store [{}] {success}", fmt_keys(keys)));
        self.pool.complete_store(keys, success)
    }
    fn on_request_finished(&mut self, request: RequestId) {
        assert!(
            !self.finished.contains(&request),
            "finish signalled twice for {request:?}"
        );
        self.finished.push(request);
        self.log.push(format!("finished r{}", request.0));
    }
    fn reset(&mut self) {
        self.log.push("reset".to_string());
        self.pool.reset()
    }
    fn release_held(&mut self, slots: &[SlotId]) {
        let names: Vec<String> = slots.iter().map(|s| s.0.to_string()).collect();
        self.log.push(format!("release_held [{}]", names.join(",")));
        self.pool.release_held(slots)
    }
    fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        self.pool.take_events(out)
    }
}

const TPB: u32 = 4;
const BPC: u32 = 2;

fn config(workers: u32) -> SchedulerConfig {
    SchedulerConfig {
        tokens_per_block: TPB,
        blocks_per_chunk: BPC,
        worker_count: workers,
        strict: true,
        ..SchedulerConfig::default()
    }
}

fn scheduler(slots: u32, workers: u32) -> Scheduler<Logged> {
    Scheduler::new(config(workers), Logged::new(slots)).expect("valid scheduler config")
}

/// Hashes of request `r`'s first `n` blocks: requests with the same `prefix` share them.
fn hashes(prefix: u64, n: usize) -> Vec<u128> {
    (0..n as u128)
        .map(|i| (u128::from(prefix) << 32) | (0xa0 + i))
        .collect()
}

fn blocks(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

fn ack_all(
    s: &mut Scheduler<Logged>,
    jobs: &[JobId],
    workers: u32,
    success: bool,
) -> Vec<(RequestId, bool)> {
    let outputs: Vec<WorkerOutput> = (0..workers)
        .map(|w| WorkerOutput {
            worker: w,
            acks: jobs.iter().map(|&job| JobAck { job, success }).collect(),
        })
        .collect();
    s.update_connector_output(&outputs).loads
}

fn job_ids(meta: &ConnectorMeta) -> Vec<JobId> {
    meta.loads
        .iter()
        .chain(&meta.stores)
        .map(|j| j.id)
        .collect()
}

fn released(s: &mut Scheduler<Logged>) -> Vec<RequestId> {
    let mut out = Vec::new();
    s.take_released(&mut out);
    out
}

fn log(s: &mut Scheduler<Logged>) -> Vec<String> {
    std::mem::take(&mut s.manager_mut().log)
}

fn step_one<'a>(
    step: u64,
    req: &'a [StepRequest<'a>],
    preempted: &'a [RequestId],
) -> StepInput<'a> {
    StepInput {
        step,
        scheduled: req,
        preempted,
    }
}

/// Prefill of a whole prompt in one step.
fn prefill<'a>(id: u64, tokens: u32, table: &'a [BlockId], hashes: &'a [u128]) -> StepRequest<'a> {
    StepRequest {
        id: RequestId(id),
        num_computed_tokens: 0,
        num_scheduled_tokens: tokens,
        num_tokens: tokens,
        new_block_ids: table,
        replace_blocks: true,
        block_hashes: hashes,
    }
}

#[test]
fn final_full_chunk_store_precedes_finish_signal() {
    // Prompt of 14 tokens (blocks 0-3); the last block's hash only arrives with the finish, as
    // under async scheduling: the final full chunk (blocks 2,3) is stored at finish.
    let mut s = scheduler(16, 1);
    s.on_new_request(NewRequest {
        id: RequestId(1),
        prompt_tokens: 14,
        max_offload_tokens: None,
    });
    let table = blocks(0..4);
    let h = hashes(1, 4);
    let reqs = [prefill(1, 14, &table, &h[..3])];
    let meta1 = s.build_connector_meta(&step_one(1, &reqs, &[]));
    assert_eq!(meta1.stores.len(), 1, "chunk 0 stored during prefill");
    assert!(meta1.finished.is_empty());
    // Two decode steps later the request finishes with 17 tokens: KV written for 16.
    let keep = s.request_finished(&FinishedRequest {
        id: RequestId(1),
        kind: FinishKind::Finished,
        num_tokens: 17,
        num_computed_tokens: 16,
        block_hashes: &h,
    });
    assert!(keep, "blocks must be held for the deferred final store");
    assert!(
        s.manager().finished.is_empty(),
        "request_finished must not notify the manager"
    );
    let meta2 = s.build_connector_meta(&step_one(2, &[], &[]));
    assert_eq!(meta2.stores.len(), 1, "the deferred final store is built");
    assert_eq!(meta2.stores[0].transfers[0].gpu_blocks, blocks(2..4));
    assert_eq!(meta2.finished, vec![RequestId(1)]);
    // complete_store may arrive after the finish signal; the blocks are released only then.
    assert!(released(&mut s).is_empty());
    ack_all(&mut s, &job_ids(&meta1), 1, true);
    ack_all(&mut s, &job_ids(&meta2), 1, true);
    assert_eq!(released(&mut s), vec![RequestId(1)]);
    assert_eq!(
        log(&mut s),
        vec![
            "prepare_store r1 [1000000a1] ok",
            "prepare_store r1 [1000000a3] ok",
            "finished r1",
            "complete_store [1000000a1] true",
            "complete_store [1000000a3] true",
        ]
    );
    assert_eq!(s.tracked_requests(), 0, "no state leaked");
}

#[test]
fn final_partial_chunk_is_stored_at_finish() {
    let mut s = scheduler(16, 1);
    s.on_new_request(NewRequest {
        id: RequestId(2),
        prompt_tokens: 12,
        max_offload_tokens: None,
    });
    let table = blocks(0..3);
    let h = hashes(2, 3);
    let reqs = [prefill(2, 12, &table, &h)];
    let meta1 = s.build_connector_meta(&step_one(1, &reqs, &[]));
    assert_eq!(meta1.stores[0].transfers.len(), 1, "one full chunk");
    let keep = s.request_finished(&FinishedRequest {
        id: RequestId(2),
        kind: FinishKind::Finished,
        num_tokens: 13,
        num_computed_tokens: 12,
        block_hashes: &h,
    });
    assert!(keep);
    let meta2 = s.build_connector_meta(&step_one(2, &[], &[]));
    let tail = &meta2.stores[0].transfers[0];
    assert_eq!(
        tail.key.hash, h[2],
        "a partial chunk is keyed by its last full block"
    );
    assert_eq!(tail.gpu_blocks, blocks(2..3));
    assert_eq!(meta2.finished, vec![RequestId(2)]);
    ack_all(&mut s, &job_ids(&meta2), 1, true);
    ack_all(&mut s, &job_ids(&meta1), 1, true);
    assert_eq!(released(&mut s), vec![RequestId(2)]);
    let lines = log(&mut s);
    let store = lines
        .iter()
        .position(|l| l.starts_with("prepare_store r2 [2000000a2]"));
    let finish = lines.iter().position(|l| l == "finished r2");
    assert!(store.expect("tail stored") < finish.expect("finish signalled"));
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("finished")).count(),
        1
    );
}

#[test]
fn finish_with_nothing_left_is_signalled_at_once() {
    let mut s = scheduler(16, 1);
    // Never tracked: signalled at once.
    assert!(!s.request_finished(&FinishedRequest {
        id: RequestId(9),
        kind: FinishKind::Aborted,
        num_tokens: 5,
        num_computed_tokens: 0,
        block_hashes: &[],
    }));
    // Aborted before it was ever scheduled: no job, signalled at once.
    s.on_new_request(NewRequest {
        id: RequestId(3),
        prompt_tokens: 40,
        max_offload_tokens: None,
    });
    assert!(!s.request_finished(&FinishedRequest {
        id: RequestId(3),
        kind: FinishKind::Aborted,
        num_tokens: 40,
        num_computed_tokens: 0,
        block_hashes: &hashes(3, 10),
    }));
    let meta = s.build_connector_meta(&step_one(1, &[], &[]));
    assert!(
        meta.stores.is_empty() && meta.loads.is_empty(),
        "no job for a never-scheduled abort"
    );
    assert_eq!(meta.finished, vec![RequestId(9), RequestId(3)]);
    assert_eq!(log(&mut s), vec!["finished r9", "finished r3"]);
    assert_eq!(s.tracked_requests(), 0);
}

#[test]
fn allocation_failure_is_retried_on_the_finishing_step() {
    // One slot, pinned by a reader: the store cannot get room.
    let mut s = scheduler(1, 1);
    let other = hashes(7, 2);
    s.on_new_request(NewRequest {
        id: RequestId(7),
        prompt_tokens: 8,
        max_offload_tokens: None,
    });
    let t7 = blocks(10..12);
    let m = s.build_connector_meta(&step_one(1, &[prefill(7, 8, &t7, &other)], &[]));
    ack_all(&mut s, &job_ids(&m), 1, true);
    let pinned = [ChunkKey::new(other[1], 0)];
    let mut slots = Vec::new();
    s.manager_mut()
        .prepare_load(&pinned, RequestId(7), &mut slots)
        .expect("ready chunk");

    s.on_new_request(NewRequest {
        id: RequestId(4),
        prompt_tokens: 8,
        max_offload_tokens: None,
    });
    let table = blocks(0..2);
    let h = hashes(4, 2);
    let meta1 = s.build_connector_meta(&step_one(2, &[prefill(4, 8, &table, &h)], &[]));
    assert!(meta1.stores.is_empty(), "no room: no job");
    assert_eq!(s.stats().allocation_failures, 1);
    assert!(s.request_finished(&FinishedRequest {
        id: RequestId(4),
        kind: FinishKind::Finished,
        num_tokens: 9,
        num_computed_tokens: 8,
        block_hashes: &h,
    }));
    // The reader lets go; the finishing step retries the same chunk (the cursor did not move).
    s.manager_mut().complete_load(&pinned);
    let meta2 = s.build_connector_meta(&step_one(3, &[], &[]));
    assert_eq!(meta2.stores.len(), 1, "retried on the finishing step");
    assert_eq!(meta2.stores[0].transfers[0].key.hash, h[1]);
    assert_eq!(meta2.finished, vec![RequestId(4)]);
    let lines: Vec<String> = log(&mut s)
        .into_iter()
        .filter(|l| l.contains("r4"))
        .collect();
    assert_eq!(
        lines,
        [
            "prepare_store r4 [4000000a1] no space",
            "prepare_store r4 [4000000a1] ok",
            "finished r4"
        ]
    );
}

#[test]
fn reset_finalizes_a_finished_request_exactly_once_and_rewinds_live_ones() {
    let mut s = scheduler(16, 1);
    for id in [5, 6] {
        s.on_new_request(NewRequest {
            id: RequestId(id),
            prompt_tokens: 8,
            max_offload_tokens: None,
        });
    }
    let (t5, t6) = (blocks(0..2), blocks(2..4));
    let (h5, h6) = (hashes(5, 2), hashes(6, 2));
    let reqs = [prefill(5, 8, &t5, &h5), prefill(6, 8, &t6, &h6)];
    let meta1 = s.build_connector_meta(&step_one(1, &reqs, &[]));
    assert_eq!(meta1.stores.len(), 2);
    // Request 5 finishes with its store still pending (not acknowledged): its signal is pending.
    assert!(s.request_finished(&FinishedRequest {
        id: RequestId(5),
        kind: FinishKind::Finished,
        num_tokens: 9,
        num_computed_tokens: 8,
        block_hashes: &h5,
    }));
    let cancelled = s.reset_cache();
    assert!(cancelled.loads.is_empty());
    assert!(
        released(&mut s).is_empty(),
        "request 5's store may still read its blocks"
    );
    let meta2 = s.build_connector_meta(&step_one(2, &[], &[]));
    assert_eq!(
        meta2.reset_before,
        Some(JobId(3)),
        "workers drain jobs older than the reset"
    );
    assert_eq!(
        meta2.finished,
        vec![RequestId(5)],
        "signalled by the reset, once"
    );
    // Late acknowledgements of pre-reset jobs complete nothing, but end the holds on their
    // slots and release request 5's blocks.
    ack_all(&mut s, &job_ids(&meta1), 1, true);
    assert_eq!(s.stats().stale_acks, 2);
    assert_eq!(released(&mut s), vec![RequestId(5)]);
    assert_eq!(s.stale_jobs(), 0);
    // Request 6 is alive with its cursor rewound: its chunk is stored again.
    let again = [StepRequest {
        id: RequestId(6),
        num_computed_tokens: 8,
        num_scheduled_tokens: 1,
        num_tokens: 9,
        new_block_ids: &[],
        replace_blocks: false,
        block_hashes: &h6,
    }];
    let meta3 = s.build_connector_meta(&step_one(3, &again, &[]));
    assert_eq!(meta3.stores.len(), 1);
    assert_eq!(meta3.stores[0].transfers[0].key.hash, h6[1]);
    let lines = log(&mut s);
    assert_eq!(lines.iter().filter(|l| *l == "finished r5").count(), 1);
    assert!(
        !lines.iter().any(|l| l.starts_with("complete_store")),
        "stale acks reach no manager"
    );
}

#[test]
fn preemption_flushes_pending_stores() {
    let mut s = scheduler(16, 1);
    s.on_new_request(NewRequest {
        id: RequestId(8),
        prompt_tokens: 16,
        max_offload_tokens: None,
    });
    let table = blocks(0..4);
    let h = hashes(8, 4);
    let meta1 = s.build_connector_meta(&step_one(1, &[prefill(8, 16, &table, &h)], &[]));
    assert_eq!(meta1.stores.len(), 1);
    let meta2 = s.build_connector_meta(&step_one(2, &[], &[RequestId(8)]));
    assert_eq!(meta2.flush, vec![meta1.stores[0].id]);
    // Still retry-later until the flushed store is acknowledged (item 5).
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(8), 16, &h, 0),
        MatchResult::RetryLater
    );
    ack_all(&mut s, &job_ids(&meta1), 1, true);
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(8), 16, &h, 0),
        MatchResult::Tokens(12)
    );
}

#[test]
fn fenced_block_reused_in_the_same_step_forces_a_flush() {
    let mut s = scheduler(16, 1);
    s.on_new_request(NewRequest {
        id: RequestId(10),
        prompt_tokens: 8,
        max_offload_tokens: None,
    });
    s.on_new_request(NewRequest {
        id: RequestId(11),
        prompt_tokens: 8,
        max_offload_tokens: None,
    });
    let t10 = blocks(0..2);
    let h10 = hashes(10, 2);
    let meta1 = s.build_connector_meta(&step_one(1, &[prefill(10, 8, &t10, &h10)], &[]));
    let store = meta1.stores[0].id;
    // The engine reallocates block 1 to another request before the store was acknowledged.
    let t11 = [BlockId(1), BlockId(5)];
    let h11 = hashes(11, 2);
    let meta2 = s.build_connector_meta(&step_one(2, &[prefill(11, 8, &t11, &h11)], &[]));
    assert_eq!(meta2.flush, vec![store]);
    // An unrelated block does not flush.
    ack_all(&mut s, &[store], 1, true);
    let t12 = [BlockId(9)];
    let next = [StepRequest {
        new_block_ids: &t12,
        replace_blocks: false,
        ..prefill(11, 0, &[], &h11)
    }];
    let meta3 = s.build_connector_meta(&step_one(3, &next, &[]));
    assert!(meta3.flush.is_empty());
}

#[test]
fn load_then_three_workers_must_all_acknowledge() {
    let workers = 3;
    let mut s = scheduler(16, workers);
    let h = hashes(12, 4);
    s.on_new_request(NewRequest {
        id: RequestId(12),
        prompt_tokens: 16,
        max_offload_tokens: None,
    });
    let t = blocks(0..4);
    let meta = s.build_connector_meta(&step_one(1, &[prefill(12, 16, &t, &h)], &[]));
    ack_all(&mut s, &job_ids(&meta), workers, true);
    // A second request with the same 16-token prompt, 4 tokens (block 0) in the GPU cache.
    s.on_new_request(NewRequest {
        id: RequestId(13),
        prompt_tokens: 17,
        max_offload_tokens: None,
    });
    let mut h13 = h.clone();
    h13.truncate(4);
    let got = s.get_num_new_matched_tokens(RequestId(13), 17, &h13, 4);
    assert_eq!(
        got,
        MatchResult::Tokens(12),
        "chunks 0 and 1 hit; block 0 already cached"
    );
    let t13 = blocks(20..25);
    s.update_state_after_alloc(RequestId(13), &t13, 12);
    let meta2 = s.build_connector_meta(&step_one(2, &[], &[]));
    let load = &meta2.loads[0];
    assert_eq!(
        load.transfers[0].first_block_in_chunk, 1,
        "first chunk starts mid-chunk"
    );
    assert_eq!(load.transfers[0].gpu_blocks, blocks(21..22));
    assert_eq!(load.transfers[1].gpu_blocks, blocks(22..24));
    // Two of three acknowledgements do not complete the job.
    let partial = [WorkerOutput {
        worker: 0,
        acks: vec![JobAck {
            job: load.id,
            success: true,
        }],
    }];
    assert!(s.update_connector_output(&partial).loads.is_empty());
    let rest: Vec<WorkerOutput> = (1..3)
        .map(|w| WorkerOutput {
            worker: w,
            acks: vec![JobAck {
                job: load.id,
                success: true,
            }],
        })
        .collect();
    assert_eq!(
        s.update_connector_output(&rest).loads,
        vec![(RequestId(13), true)]
    );
}

#[test]
#[should_panic(expected = "acknowledged job")]
fn a_worker_acknowledging_twice_is_an_invariant_failure() {
    let mut s = scheduler(16, 2);
    s.on_new_request(NewRequest {
        id: RequestId(14),
        prompt_tokens: 8,
        max_offload_tokens: None,
    });
    let t = blocks(0..2);
    let h = hashes(14, 2);
    let meta = s.build_connector_meta(&step_one(1, &[prefill(14, 8, &t, &h)], &[]));
    let twice = WorkerOutput {
        worker: 0,
        acks: vec![
            JobAck {
                job: meta.stores[0].id,
                success: true
            };
            2
        ],
    };
    s.update_connector_output(&[twice]);
}

#[test]
fn watermark_respects_prompt_only_and_max_offload_tokens() {
    let mut cfg = config(1);
    cfg.offload_prompt_only = true;
    let mut s = Scheduler::new(cfg, Logged::new(32)).expect("valid");
    s.on_new_request(NewRequest {
        id: RequestId(15),
        prompt_tokens: 9,
        max_offload_tokens: None,
    });
    s.on_new_request(NewRequest {
        id: RequestId(16),
        prompt_tokens: 32,
        max_offload_tokens: Some(8),
    });
    let (t15, t16) = (blocks(0..6), blocks(6..14));
    let (h15, h16) = (hashes(15, 6), hashes(16, 8));
    // Request 15 has decoded up to 24 tokens; only its 9-token prompt may be stored.
    let reqs = [
        StepRequest {
            id: RequestId(15),
            num_computed_tokens: 23,
            num_scheduled_tokens: 1,
            num_tokens: 24,
            new_block_ids: &t15,
            replace_blocks: true,
            block_hashes: &h15,
        },
        prefill(16, 32, &t16, &h16),
    ];
    let meta = s.build_connector_meta(&step_one(1, &reqs, &[]));
    let stored: Vec<(u64, usize)> = meta
        .stores
        .iter()
        .flat_map(|j| {
            j.transfers
                .iter()
                .map(move |t| (j.request.0, t.gpu_blocks.len()))
        })
        .collect();
    assert_eq!(
        stored,
        vec![(15, 2), (16, 2)],
        "one chunk each: prompt cap and max_offload_tokens"
    );
}

#[test]
fn request_level_policy_stores_only_at_finish() {
    let mut cfg = config(1);
    cfg.policy = OffloadPolicy::Request;
    let mut s = Scheduler::new(cfg, Logged::new(32)).expect("valid");
    s.on_new_request(NewRequest {
        id: RequestId(17),
        prompt_tokens: 16,
        max_offload_tokens: None,
    });
    let t = blocks(0..4);
    let h = hashes(17, 4);
    let meta1 = s.build_connector_meta(&step_one(1, &[prefill(17, 16, &t, &h)], &[]));
    assert!(meta1.stores.is_empty());
    assert!(s.request_finished(&FinishedRequest {
        id: RequestId(17),
        kind: FinishKind::Finished,
        num_tokens: 17,
        num_computed_tokens: 16,
        block_hashes: &h,
    }));
    let meta2 = s.build_connector_meta(&step_one(2, &[], &[]));
    assert_eq!(meta2.stores[0].transfers.len(), 2);
    assert_eq!(meta2.finished, vec![RequestId(17)]);
}

#[test]
fn failed_load_is_reported_for_recompute() {
    let mut s = scheduler(16, 2);
    let h = hashes(18, 4);
    s.on_new_request(NewRequest {
        id: RequestId(18),
        prompt_tokens: 16,
        max_offload_tokens: None,
    });
    let t = blocks(0..4);
    let meta = s.build_connector_meta(&step_one(1, &[prefill(18, 16, &t, &h)], &[]));
    ack_all(&mut s, &job_ids(&meta), 2, true);
    s.on_new_request(NewRequest {
        id: RequestId(19),
        prompt_tokens: 20,
        max_offload_tokens: None,
    });
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(19), 20, &h, 0),
        MatchResult::Tokens(16)
    );
    s.update_state_after_alloc(RequestId(19), &blocks(4..9), 16);
    let meta2 = s.build_connector_meta(&step_one(2, &[], &[]));
    let id = meta2.loads[0].id;
    let outputs = [
        WorkerOutput {
            worker: 0,
            acks: vec![JobAck {
                job: id,
                success: true,
            }],
        },
        WorkerOutput {
            worker: 1,
            acks: vec![JobAck {
                job: id,
                success: false,
            }],
        },
    ];
    assert_eq!(
        s.update_connector_output(&outputs).loads,
        vec![(RequestId(19), false)]
    );
    // The chunks stay readable for the next lookup: the pins were released.
    assert_eq!(s.manager().pool.ref_count(ChunkKey::new(h[1], 0)), Some(0));
}

#[test]
fn release_mode_disables_a_broken_request_and_goes_on() {
    // Design.md section 4, last paragraph: outside strict mode, a broken invariant about one
    // request switches that request's offload off (counted); other requests go on offloading.
    let mut s = Scheduler::new(
        SchedulerConfig {
            strict: false,
            ..config(1)
        },
        Logged::new(16),
    )
    .expect("valid scheduler config");
    for id in [20, 21] {
        s.on_new_request(NewRequest {
            id: RequestId(id),
            prompt_tokens: 32,
            max_offload_tokens: None,
        });
    }
    // The engine claims 8 external tokens for request 20 that were never matched.
    let t20 = blocks(0..8);
    s.update_state_after_alloc(RequestId(20), &t20, 8);
    assert_eq!(s.stats().invariant_failures, 1);
    assert_eq!(s.stats().requests_disabled, 1);
    let (h20, h21) = (hashes(20, 8), hashes(21, 8));
    let t21 = blocks(8..16);
    let reqs = [prefill(20, 32, &t20, &h20), prefill(21, 32, &t21, &h21)];
    let meta = s.build_connector_meta(&step_one(1, &reqs, &[]));
    assert!(meta.loads.is_empty());
    let stored: Vec<RequestId> = meta.stores.iter().map(|j| j.request).collect();
    assert!(!stored.is_empty(), "request 21 still offloads");
    assert!(
        stored.iter().all(|&r| r == RequestId(21)),
        "disabled request 20 stored: {stored:?}"
    );
    // Its lookups answer nothing to load, and it still finishes and is released.
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(20), 32, &h20, 0),
        MatchResult::Tokens(0)
    );
    let keep = s.request_finished(&FinishedRequest {
        id: RequestId(20),
        kind: FinishKind::Finished,
        num_tokens: 33,
        num_computed_tokens: 32,
        block_hashes: &h20,
    });
    assert!(
        !keep,
        "nothing of request 20 is stored, so nothing holds its blocks"
    );
    let meta2 = s.build_connector_meta(&step_one(2, &[], &[]));
    assert!(meta2.stores.iter().all(|j| j.request != RequestId(20)));
    assert!(meta2.finished.contains(&RequestId(20)));
    assert_eq!(s.stats().requests_disabled, 1, "counted once");
}

#[test]
fn a_slot_written_by_a_store_in_flight_at_reset_is_not_reused_until_the_store_is_acked() {
    // One host slot. Request 1's store job writes it and is still in flight at the reset; a
    // worker (a GPU stream) may still write the slot until it acknowledges the job.
    let mut s = scheduler(1, 2);
    for id in [1, 2] {
        s.on_new_request(NewRequest {
            id: RequestId(id),
            prompt_tokens: 8,
            max_offload_tokens: None,
        });
    }
    let (t1, h1) = (blocks(0..2), hashes(1, 2));
    let meta1 = s.build_connector_meta(&step_one(1, &[prefill(1, 8, &t1, &h1)], &[]));
    assert_eq!(meta1.stores.len(), 1);
    let slot = meta1.stores[0].transfers[0].slot;
    // One of the two workers acknowledges before the reset; the other has not.
    s.update_connector_output(&[WorkerOutput {
        worker: 0,
        acks: vec![JobAck {
            job: meta1.stores[0].id,
            success: true,
        }],
    }]);
    s.reset_cache();
    // Request 2 wants to store: the only slot is still held by the pre-reset store.
    let (t2, h2) = (blocks(2..4), hashes(2, 2));
    let meta2 = s.build_connector_meta(&step_one(2, &[prefill(2, 8, &t2, &h2)], &[]));
    let reused: Vec<SlotId> = meta2
        .stores
        .iter()
        .flat_map(|j| j.transfers.iter().map(|t| t.slot))
        .collect();
    assert!(
        !reused.contains(&slot),
        "slot {slot:?} handed to a new store while the pre-reset store may still write it"
    );
    assert_eq!(s.manager().pool.held_slot_count(), 1);
    // The second worker's acknowledgement ends the job: the slot is free again.
    s.update_connector_output(&[WorkerOutput {
        worker: 1,
        acks: vec![JobAck {
            job: meta1.stores[0].id,
            success: true,
        }],
    }]);
    assert_eq!(s.manager().pool.held_slot_count(), 0);
    let more = [StepRequest {
        id: RequestId(2),
        num_computed_tokens: 8,
        num_scheduled_tokens: 1,
        num_tokens: 9,
        new_block_ids: &[],
        replace_blocks: false,
        block_hashes: &h2,
    }];
    let meta3 = s.build_connector_meta(&step_one(3, &more, &[]));
    assert_eq!(
        meta3.stores.len(),
        1,
        "the slot is free again after the ack"
    );
    assert_eq!(meta3.stores[0].transfers[0].slot, slot);
    assert!(log(&mut s).contains(&format!("release_held [{}]", slot.0)));
}
