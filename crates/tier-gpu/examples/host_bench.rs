//! Host-path bandwidth against the machine's ceiling, measured in the same run: for chunk sizes
//! 64 KiB to 8 MiB, stores (engine memory to host pool) and loads (the reverse) of 128 MiB per job
//! through [`HostTransferEngine`], next to a plain single-thread memcpy of the same chunks.
//! Usage: `cargo run --release -p tier-gpu --example host_bench [-- --threads N --reps N]`.

use std::sync::Arc;
use std::time::Instant;

use offload_core::{BlockId, ChunkKey, Job, JobId, JobKind, RequestId, SlotId, Transfer};
use tier_gpu::{HostCopier, HostPoolMemory, HostTransferEngine, KvLayout, Region, TransferEngine};

const TOTAL_BYTES: usize = 128 << 20;
const BLOCKS_PER_CHUNK: u32 = 4;

fn arg(name: &str, default: usize) -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let v = args.get(i + 1).ok_or(format!("{name} needs a value"))?;
            v.parse().map_err(|e| format!("{name} {v:?}: {e}"))
        }
    }
}

/// A fixed shuffle of `0..n` (chunks land in scattered slots and scattered engine blocks).
fn shuffle(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn gib_per_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / f64::from(1u32 << 30)
}

fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() -> Result<(), String> {
    let threads = arg("--threads", 2)?;
    let reps = arg("--reps", 5)?;
    let copier = Arc::new(HostCopier::new(threads).map_err(|e| e.to_string())?);
    // Engine memory, prefaulted like the pool, so neither side pays first-touch costs.
    let mut engine_mem = vec![0x5au8; TOTAL_BYTES];
    let mut ceiling_dst = vec![0u8; TOTAL_BYTES];
    println!(
        "host path ({threads} copy threads) vs single-thread memcpy, {} MiB per job, best of {reps}",
        TOTAL_BYTES >> 20
    );
    println!(
        "{:>10} {:>6} {:>12} {:>12} {:>7}",
        "chunk", "dir", "path GiB/s", "memcpy GiB/s", "ratio"
    );
    for chunk_kib in [64usize, 256, 1024, 2048, 4096, 8192] {
        let chunk = chunk_kib << 10;
        let chunks = (TOTAL_BYTES / chunk) as u32;
        let block_bytes = (chunk / BLOCKS_PER_CHUNK as usize) as u64;
        let region = Region {
            base: engine_mem.as_mut_ptr() as u64,
            num_blocks: chunks * BLOCKS_PER_CHUNK,
            block_bytes,
            block_stride: block_bytes,
            group: 0,
        };
        let layout =
            KvLayout::new(vec![region], BLOCKS_PER_CHUNK, chunks).map_err(|e| e.to_string())?;
        let pool = Arc::new(HostPoolMemory::new(chunk, chunks).map_err(|e| e.to_string())?);
        // SAFETY: `engine_mem` outlives the engine (dropped at the end of this iteration) and is not
        // touched while a job is in flight; each job is drained before the next starts.
        let mut engine =
            unsafe { HostTransferEngine::new(layout, pool.clone(), copier.clone(), 4) }?;
        let slots = shuffle(chunks, 7);
        let places = shuffle(chunks, 11);
        let transfers: Vec<Transfer> = (0..chunks as usize)
            .map(|i| Transfer {
                key: ChunkKey::new(i as u64, 0),
                slot: SlotId(slots[i]),
                first_block_in_chunk: 0,
                gpu_blocks: (0..BLOCKS_PER_CHUNK)
                    .map(|b| BlockId(places[i] * BLOCKS_PER_CHUNK + b))
                    .collect(),
            })
            .collect();
        for kind in [JobKind::Store, JobKind::Load] {
            let mut next = 0u64;
            let path = best_of(reps, || {
                next += 1;
                let job = Job {
                    id: JobId(next),
                    request: RequestId(0),
                    kind,
                    transfers: transfers.clone(),
                };
                engine.submit(&job).expect("job fits the layout");
                engine.drain();
                let mut done = Vec::new();
                engine.poll(&mut done);
                assert!(done.iter().all(|d| d.success), "a copy failed");
            });
            // The ceiling: the same chunk copies, one thread, plain memcpy between two buffers.
            let ceiling = best_of(reps, || {
                for i in 0..chunks as usize {
                    let (src, dst) = (places[i] as usize * chunk, slots[i] as usize * chunk);
                    ceiling_dst[dst..dst + chunk].copy_from_slice(&engine_mem[src..src + chunk]);
                }
                std::hint::black_box(&mut ceiling_dst);
            });
            let (p, c) = (
                gib_per_s(TOTAL_BYTES, path),
                gib_per_s(TOTAL_BYTES, ceiling),
            );
            let dir = if kind == JobKind::Store {
                "store"
            } else {
                "load"
            };
            println!(
                "{:>7} KiB {dir:>6} {p:>12.2} {c:>12.2} {:>7.2}",
                chunk_kib,
                p / c
            );
        }
    }
    Ok(())
}
