//! The connector's two engine-facing handles wired by hand, the way an engine embeds them: one
//! [`connector::SchedulerHandle`] on the scheduler side, and one [`connector::WorkerHandle`] per
//! tensor-parallel worker (here over engine-sim's [`SimTransferEngine`], on simulated GPU and
//! host memory). Request A computes a 256-token prompt and finishes; its chunks are stored to
//! the host pool and cascaded to the disk tier (with the `fs` feature). `reset_cache` then drops
//! the host pool, and request B, which shares A's prompt, finds it on disk: the lookup promotes
//! the chunks into the host pool, B loads them, and the loaded GPU bytes are compared with
//! recompute. Exits non-zero if they differ.
//!
//! Usage: `cargo run -p engine-sim --features fs --example handles`.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use connector::config::{ConnectorConfig, EngineGeometry};
use connector::{SchedulerHandle, WorkerHandle};
use engine_sim::gpu::GpuMemory;
use engine_sim::host::{CopyGeometry, HostMemory};
use engine_sim::model::{prefix_tokens, unique_tokens, KvModel, TokenChain};
use engine_sim::transfer::SimTransferEngine;
use offload_core::scheduler::FinishedRequest;
use offload_core::{
    BlockId, FinishKind, MatchResult, NewRequest, RequestId, StepInput, StepRequest,
};

const TPB: u32 = 16;
const BLOCK_BYTES: u32 = 256;
const GPU_BLOCKS: u32 = 64;
const WORKERS: u32 = 2;

/// The engine: both handles and the simulated memories.
struct Engine {
    scheduler: SchedulerHandle,
    workers: Vec<WorkerHandle<SimTransferEngine>>,
    gpu: Arc<Mutex<GpuMemory>>,
    model: KvModel,
    step: u64,
}

impl Engine {
    /// One engine step: metadata, workers around the compute, acknowledgements.
    fn step(
        &mut self,
        scheduled: &[StepRequest<'_>],
        compute: &[(&TokenChain, u32, u32, &[BlockId])],
    ) {
        let meta = self.scheduler.build_connector_meta(&StepInput {
            step: self.step,
            scheduled,
            preempted: &[],
        });
        for w in &mut self.workers {
            w.before_compute(&meta, None);
        }
        for &(chain, from, to, blocks) in compute {
            self.compute(chain, from, to, blocks);
        }
        for w in &mut self.workers {
            w.after_compute(&meta, None);
        }
        let outputs: Vec<_> = self.workers.iter_mut().map(|w| w.take_output()).collect();
        let outcome = self.scheduler.update_connector_output(&outputs);
        for (id, ok) in outcome.loads {
            println!(
                "step {}: load of request {} ended, ok {ok}",
                self.step, id.0
            );
        }
        self.step += 1;
    }

    /// The forward pass: writes the KV of tokens `from..to` into their blocks.
    fn compute(&mut self, chain: &TokenChain, from: u32, to: u32, blocks: &[BlockId]) {
        let mut gpu = self.gpu.lock().unwrap_or_else(|e| e.into_inner());
        let width = self.model.token_bytes();
        for t in from..to {
            let at = self.model.offset_in_block(t);
            let block = gpu.block_mut(blocks[(t / TPB) as usize]);
            self.model
                .token_kv(chain.token_hash(t), &mut block[at..at + width]);
        }
    }

    /// Whether GPU blocks `blocks[..n]` hold exactly what recompute would write.
    fn matches_recompute(&self, chain: &TokenChain, blocks: &[BlockId], n: u32) -> bool {
        let gpu = self.gpu.lock().unwrap_or_else(|e| e.into_inner());
        let mut expected = vec![0u8; BLOCK_BYTES as usize];
        (0..n).all(|j| {
            self.model.block_kv(chain, j, &mut expected);
            gpu.block(blocks[j as usize]) == &expected[..]
        })
    }
}

fn hashes(chain: &TokenChain) -> Vec<u128> {
    let mut out = Vec::new();
    chain.extend_block_hashes(TPB, chain.len(), &mut out);
    out
}

fn blocks(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

fn run() -> Result<bool, String> {
    let dir = std::env::temp_dir().join(format!("kvtier-handles-example-{}", std::process::id()));
    let tiers = if cfg!(feature = "fs") {
        format!(
            "secondary_tiers = [{{ type = \"fs\", root_dir = {:?}, capacity_bytes = 16777216 }}]",
            dir.display().to_string()
        )
    } else {
        String::new()
    };
    let text = format!("cpu_bytes_to_use = 32768\nblock_size = 64\n{tiers}\n");
    let config = ConnectorConfig::from_toml_str(&text).map_err(|e| e.to_string())?;
    let geometry = EngineGeometry {
        worker_count: WORKERS,
        ..EngineGeometry::new("engine-sim", TPB, u64::from(BLOCK_BYTES))
    };
    let resolved = config.resolve(&geometry).map_err(|e| e.to_string())?;
    let host = HostMemory::new(resolved.pool.slot_count, resolved.slot_bytes as usize);
    let manager = resolved
        .build_manager(host.slot_memory(), true)
        .map_err(|e| e.to_string())?;
    let scheduler = SchedulerHandle::new(resolved.scheduler, manager).map_err(|e| e.to_string())?;
    let gpu = Arc::new(Mutex::new(GpuMemory::new(GPU_BLOCKS, BLOCK_BYTES)));
    let geo = CopyGeometry {
        block_bytes: BLOCK_BYTES,
        blocks_per_chunk: resolved.scheduler.blocks_per_chunk,
        gpu_blocks: GPU_BLOCKS,
        slots: resolved.pool.slot_count,
    };
    let workers = (0..WORKERS)
        .map(|r| {
            let engine = SimTransferEngine::new(r, WORKERS, gpu.clone(), host.clone(), geo);
            WorkerHandle::new(r, engine)
        })
        .collect();
    let mut engine = Engine {
        scheduler,
        workers,
        gpu,
        model: KvModel {
            tokens_per_block: TPB,
            block_bytes: BLOCK_BYTES,
        },
        step: 0,
    };

    // Request A: a 256-token prompt, computed in one step, then finished.
    let mut prompt = Vec::new();
    prefix_tokens(42, 256, &mut prompt);
    let a_chain = TokenChain::new(&prompt);
    let (a, a_blocks) = (RequestId(0), blocks(0..17));
    let a_hashes = hashes(&a_chain);
    engine.scheduler.on_new_request(NewRequest {
        id: a,
        prompt_tokens: 256,
        max_offload_tokens: None,
    });
    let matched = engine
        .scheduler
        .get_num_new_matched_tokens(a, 256, &a_hashes, 0);
    println!("request A: lookup {matched:?}");
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
    engine.step(&scheduled, &[(&a_chain, 0, 256, &a_blocks)]);
    let keep = engine.scheduler.request_finished(&FinishedRequest {
        id: a,
        kind: FinishKind::Finished,
        num_tokens: 257,
        num_computed_tokens: 256,
        block_hashes: &a_hashes,
    });
    let mut released = Vec::new();
    while keep && !released.contains(&a) {
        engine.step(&[], &[]);
        engine.scheduler.take_released(&mut released);
    }
    engine.scheduler.drain_tiers();
    let m = engine.scheduler.metrics();
    println!(
        "request A done: {} chunks in the host pool, {} on secondary tiers",
        m.tiering.host_chunks_stored,
        m.tiers.iter().map(|t| t.1.chunks_stored).sum::<u64>()
    );

    // Drop the host pool (the disk keeps its copy) and clear A's GPU blocks.
    engine.scheduler.reset_cache();
    engine
        .gpu
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .bytes_mut()
        .fill(0);

    // Request B: A's prompt plus 32 tokens of its own.
    unique_tokens(7, 32, &mut prompt);
    let b_chain = TokenChain::new(&prompt);
    let (b, b_blocks) = (RequestId(1), blocks(20..39));
    let b_hashes = hashes(&b_chain);
    engine.scheduler.on_new_request(NewRequest {
        id: b,
        prompt_tokens: 288,
        max_offload_tokens: None,
    });
    let mut loaded = 0;
    for _ in 0..100 {
        match engine
            .scheduler
            .get_num_new_matched_tokens(b, 288, &b_hashes, 0)
        {
            MatchResult::Tokens(n) => {
                loaded = n;
                break;
            }
            MatchResult::RetryLater => {
                // Promotions from the disk are in flight: run a step, let them land.
                engine.step(&[], &[]);
                engine.scheduler.drain_tiers();
            }
        }
    }
    println!("request B: {loaded} tokens to load");
    engine
        .scheduler
        .update_state_after_alloc(b, &b_blocks, loaded);
    engine.step(&[], &[]);
    let ok = engine.matches_recompute(&b_chain, &b_blocks, loaded / TPB);
    println!("request B: loaded bytes match recompute: {ok}");
    let scheduled = [StepRequest {
        id: b,
        num_computed_tokens: loaded,
        num_scheduled_tokens: 288 - loaded,
        num_tokens: 288,
        new_block_ids: &b_blocks,
        replace_blocks: true,
        block_hashes: &b_hashes,
    }];
    engine.step(&scheduled, &[(&b_chain, loaded, 288, &b_blocks)]);
    engine.scheduler.request_finished(&FinishedRequest {
        id: b,
        kind: FinishKind::Finished,
        num_tokens: 289,
        num_computed_tokens: 288,
        block_hashes: &b_hashes,
    });
    for _ in 0..4 {
        engine.step(&[], &[]);
    }
    engine.scheduler.drain_tiers();
    let _ = std::fs::remove_dir_all(&dir);
    print!("{}", engine.scheduler.prometheus_text());
    let expected = if cfg!(feature = "fs") { 256 } else { 0 };
    Ok(ok && loaded == expected)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("the loaded KV differed from recompute, or nothing was loaded");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
