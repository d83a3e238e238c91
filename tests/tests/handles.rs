//! The connector's two engine-facing handles wired by hand as an engine embeds them (the shape of
//! engine-sim's `handles` example): a `SchedulerHandle` from a TOML config with a disk tier, and
//! two `WorkerHandle`s over engine-sim's `SimTransferEngine`. Request A's prompt is stored and
//! cascaded to disk; after `reset_cache` request B, which shares it, promotes it from disk and
//! loads it; the loaded GPU bytes must equal recompute.

use std::sync::{Arc, Mutex};

use connector::config::{ConnectorConfig, EngineGeometry};
use connector::{SchedulerHandle, WorkerHandle};
use engine_sim::gpu::GpuMemory;
use engine_sim::host::{CopyGeometry, HostMemory};
use engine_sim::model::{prefix_tokens, unique_tokens, KvModel, TokenChain};
use engine_sim::transfer::SimTransferEngine;
use offload_core::scheduler::FinishedRequest;
use offload_core::{
    BlockId, FinishKind, MatchResult, NewRequest, RequestId, StepInput, StepRequest, UpdateOutcome,
};

const TPB: u32 = 16;
const BLOCK_BYTES: u32 = 256;
const GPU_BLOCKS: u32 = 64;

struct Engine {
    scheduler: SchedulerHandle,
    workers: Vec<WorkerHandle<SimTransferEngine>>,
    gpu: Arc<Mutex<GpuMemory>>,
    model: KvModel,
    step: u64,
}

impl Engine {
    fn step(
        &mut self,
        scheduled: &[StepRequest<'_>],
        compute: Option<(&TokenChain, u32, u32, &[BlockId])>,
    ) -> UpdateOutcome {
        let meta = self.scheduler.build_connector_meta(&StepInput {
            step: self.step,
            scheduled,
            preempted: &[],
        });
        self.step += 1;
        for w in &mut self.workers {
            w.before_compute(&meta, None);
        }
        if let Some((chain, from, to, blocks)) = compute {
            let mut gpu = self.gpu.lock().expect("gpu lock");
            let width = self.model.token_bytes();
            for t in from..to {
                let at = self.model.offset_in_block(t);
                let block = gpu.block_mut(blocks[(t / TPB) as usize]);
                self.model
                    .token_kv(chain.token_hash(t), &mut block[at..at + width]);
            }
        }
        for w in &mut self.workers {
            w.after_compute(&meta, None);
        }
        let outputs: Vec<_> = self.workers.iter_mut().map(|w| w.take_output()).collect();
        self.scheduler.update_connector_output(&outputs)
    }
}

fn hashes(chain: &TokenChain) -> Vec<u128> {
    let mut out = Vec::new();
    chain.extend_block_hashes(TPB, chain.len(), &mut out);
    out
}

#[test]
fn scheduler_and_worker_handles_promote_a_prefix_from_disk_after_reset() {
    let dir = tempfile::tempdir().expect("temp dir");
    let text = format!(
        "cpu_bytes_to_use = 32768\nblock_size = 64\nsecondary_tiers = [{{ type = \"fs\", \
         root_dir = {:?}, capacity_bytes = 16777216 }}]\n",
        dir.path().display().to_string()
    );
    let geometry = EngineGeometry {
        worker_count: 2,
        ..EngineGeometry::new("engine-sim", TPB, u64::from(BLOCK_BYTES))
    };
    let resolved = ConnectorConfig::from_toml_str(&text)
        .and_then(|c| c.resolve(&geometry))
        .expect("valid config");
    let host = HostMemory::new(resolved.pool.slot_count, resolved.slot_bytes as usize);
    let manager = resolved
        .build_manager(host.slot_memory(), true)
        .expect("tiers start");
    let gpu = Arc::new(Mutex::new(GpuMemory::new(GPU_BLOCKS, BLOCK_BYTES)));
    let geo = CopyGeometry {
        block_bytes: BLOCK_BYTES,
        blocks_per_chunk: resolved.scheduler.blocks_per_chunk,
        gpu_blocks: GPU_BLOCKS,
        slots: resolved.pool.slot_count,
    };
    let mut engine = Engine {
        scheduler: SchedulerHandle::new(resolved.scheduler, manager).expect("scheduler"),
        workers: (0..2)
            .map(|r| {
                WorkerHandle::new(
                    r,
                    SimTransferEngine::new(r, 2, gpu.clone(), host.clone(), geo),
                )
            })
            .collect(),
        gpu,
        model: KvModel {
            tokens_per_block: TPB,
            block_bytes: BLOCK_BYTES,
        },
        step: 0,
    };

    let mut prompt = Vec::new();
    prefix_tokens(42, 256, &mut prompt);
    let a_chain = TokenChain::new(&prompt);
    let a_hashes = hashes(&a_chain);
    let a_blocks: Vec<BlockId> = (0..17).map(BlockId).collect();
    let a = RequestId(0);
    engine.scheduler.on_new_request(NewRequest {
        id: a,
        prompt_tokens: 256,
        max_offload_tokens: None,
    });
    assert_eq!(
        engine
            .scheduler
            .get_num_new_matched_tokens(a, 256, &a_hashes, 0),
        MatchResult::Tokens(0)
    );
    engine.scheduler.update_state_after_alloc(a, &a_blocks, 0);
    let scheduled = [StepRequest {
        id: a,
        num_computed_tokens: 0,
        num_scheduled_tokens: 256,
        num_tokens: 256,
        new_block_ids: &a_blocks,
        replace_blocks: true,
        block_hashes: &a_hashes,
    }];
    engine.step(&scheduled, Some((&a_chain, 0, 256, &a_blocks)));
    let keep = engine.scheduler.request_finished(&FinishedRequest {
        id: a,
        kind: FinishKind::Finished,
        num_tokens: 257,
        num_computed_tokens: 256,
        block_hashes: &a_hashes,
    });
    let mut released = Vec::new();
    for _ in 0..10 {
        engine.step(&[], None);
        engine.scheduler.take_released(&mut released);
    }
    assert!(!keep || released.contains(&a), "A's blocks never released");
    assert!(engine.scheduler.tiering().is_finalized(a));
    engine.scheduler.drain_tiers();
    assert_eq!(engine.scheduler.metrics().tiers[0].1.chunks_stored, 4);

    engine.scheduler.reset_cache();
    engine.gpu.lock().expect("gpu lock").bytes_mut().fill(0);

    unique_tokens(7, 32, &mut prompt);
    let b_chain = TokenChain::new(&prompt);
    let b_hashes = hashes(&b_chain);
    let b_blocks: Vec<BlockId> = (20..39).map(BlockId).collect();
    let b = RequestId(1);
    engine.scheduler.on_new_request(NewRequest {
        id: b,
        prompt_tokens: 288,
        max_offload_tokens: None,
    });
    let mut answers = Vec::new();
    let loaded = loop {
        let m = engine
            .scheduler
            .get_num_new_matched_tokens(b, 288, &b_hashes, 0);
        answers.push(m);
        match m {
            MatchResult::Tokens(n) => break n,
            MatchResult::RetryLater if answers.len() < 50 => {
                engine.step(&[], None);
                engine.scheduler.drain_tiers();
            }
            MatchResult::RetryLater => panic!("the promotion never landed"),
        }
    };
    assert_eq!(
        answers[0],
        MatchResult::RetryLater,
        "the first lookup starts the promotion"
    );
    assert_eq!(loaded, 256);
    engine
        .scheduler
        .update_state_after_alloc(b, &b_blocks, loaded);
    let outcome = engine.step(&[], None);
    assert_eq!(outcome.loads, vec![(b, true)]);
    let gpu = engine.gpu.lock().expect("gpu lock");
    let mut expected = vec![0u8; BLOCK_BYTES as usize];
    for j in 0..loaded / TPB {
        engine.model.block_kv(&b_chain, j, &mut expected);
        assert_eq!(gpu.block(b_blocks[j as usize]), &expected[..], "block {j}");
    }
    drop(gpu);
    let fs = engine.scheduler.metrics().tiers[0].1;
    assert_eq!(fs.chunks_loaded, 4, "{fs:?}");
    assert!(engine.workers.iter().all(|w| w.counters().jobs_failed == 0));
}
