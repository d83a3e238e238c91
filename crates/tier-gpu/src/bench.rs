//! The host-path benchmark as a library: for each chunk size, stores (engine memory to host pool)
//! and loads (the reverse) of `total_bytes` per job through [`HostTransferEngine`], next to a
//! plain single-thread memcpy of the same chunks between the same places (the ceiling), measured
//! in the same run. `kvtier bench host` and the `host_bench` example call [`run`].

use std::sync::Arc;
use std::time::Instant;

use offload_core::bench::BenchRow;
use offload_core::{BlockId, ChunkKey, Job, JobId, JobKind, RequestId, SlotId, Transfer};

use crate::{HostCopier, HostPoolMemory, HostTransferEngine, KvLayout, Region, TransferEngine};

/// Engine blocks per chunk in the benchmark's layout.
const BLOCKS_PER_CHUNK: u32 = 4;

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostBenchConfig {
    /// Bytes per job (rounded down to whole chunks, at least one chunk).
    pub total_bytes: usize,
    /// Chunk sizes, in bytes (each a multiple of 4, so that a chunk splits into 4 engine blocks).
    pub chunk_sizes: Vec<usize>,
    /// Copy threads of the host path.
    pub threads: usize,
    /// Repetitions of each measurement; the best is reported.
    pub reps: usize,
}

impl Default for HostBenchConfig {
    /// 128 MiB per job, chunks of 64 KiB to 8 MiB, 2 copy threads, best of 5.
    fn default() -> Self {
        Self {
            total_bytes: 128 << 20,
            chunk_sizes: [64usize, 256, 1024, 2048, 4096, 8192]
                .iter()
                .map(|k| k << 10)
                .collect(),
            threads: 2,
            reps: 5,
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
    if secs > 0.0 {
        bytes as f64 / secs / f64::from(1u32 << 30)
    } else {
        0.0
    }
}

fn best_of(reps: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Runs the benchmark; `progress` hears one line per measured row. Returns one `store` and one
/// `load` row per chunk size, each with the single-thread memcpy of the same run as its ceiling.
pub fn run(
    config: &HostBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<BenchRow>, String> {
    let copier = Arc::new(HostCopier::new(config.threads.max(1)).map_err(|e| e.to_string())?);
    let mut rows = Vec::new();
    for &chunk in &config.chunk_sizes {
        if chunk < BLOCKS_PER_CHUNK as usize || chunk % BLOCKS_PER_CHUNK as usize != 0 {
            return Err(format!(
                "host bench: chunk size {chunk} is not a positive multiple of {BLOCKS_PER_CHUNK}"
            ));
        }
        let chunks = (config.total_bytes / chunk).max(1);
        let chunks = u32::try_from(chunks)
            .map_err(|_| format!("host bench: {chunks} chunks of {chunk} bytes are too many"))?;
        for row in measure(config, &copier, chunk, chunks)? {
            progress(&format!(
                "host {} {} KiB: path {:.2} GiB/s, memcpy {:.2} GiB/s, ratio {:.2}",
                row.op,
                chunk >> 10,
                row.gib_per_s,
                row.ceiling_gib_per_s,
                row.ratio()
            ));
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Both directions at one chunk size.
fn measure(
    config: &HostBenchConfig,
    copier: &Arc<HostCopier>,
    chunk: usize,
    chunks: u32,
) -> Result<Vec<BenchRow>, String> {
    let total = chunk * chunks as usize;
    // Engine memory, prefaulted like the pool, so neither side pays first-touch costs.
    let mut engine_mem = vec![0x5au8; total];
    let mut ceiling_dst = vec![0u8; total];
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
    // SAFETY: `engine_mem` outlives the engine (declared before it, so dropped after it) and is
    // not touched while a job is in flight: each job is drained before the next starts, and the
    // ceiling's reads of it run only between jobs.
    let mut engine = unsafe { HostTransferEngine::new(layout, pool, copier.clone(), 4) }?;
    let slots = shuffle(chunks, 7);
    let places = shuffle(chunks, 11);
    let transfers: Vec<Transfer> = (0..chunks as usize)
        .map(|i| Transfer {
            key: ChunkKey::new(i as u128, 0),
            slot: SlotId(slots[i]),
            first_block_in_chunk: 0,
            gpu_blocks: (0..BLOCKS_PER_CHUNK)
                .map(|b| BlockId(places[i] * BLOCKS_PER_CHUNK + b))
                .collect(),
        })
        .collect();
    let mut rows = Vec::new();
    let mut next = 0u64;
    let mut done = Vec::new();
    for kind in [JobKind::Store, JobKind::Load] {
        let path = best_of(config.reps, || {
            next += 1;
            let job = Job {
                id: JobId(next),
                request: RequestId(0),
                kind,
                transfers: transfers.clone(),
            };
            engine.submit(&job).map_err(|e| e.to_string())?;
            engine.drain();
            done.clear();
            engine.poll(&mut done);
            if done.len() != 1 || !done.iter().all(|d| d.success) {
                return Err(format!(
                    "host bench: job {next} did not complete successfully"
                ));
            }
            Ok(())
        })?;
        // The ceiling: the same chunk copies, one thread, plain memcpy between two buffers.
        let ceiling = best_of(config.reps, || {
            for i in 0..chunks as usize {
                let (src, dst) = (places[i] as usize * chunk, slots[i] as usize * chunk);
                ceiling_dst[dst..dst + chunk].copy_from_slice(&engine_mem[src..src + chunk]);
            }
            std::hint::black_box(&mut ceiling_dst);
            Ok(())
        })?;
        rows.push(BenchRow {
            op: match kind {
                JobKind::Store => "store".into(),
                JobKind::Load => "load".into(),
            },
            chunk_bytes: chunk as u64,
            gib_per_s: gib_per_s(total, path),
            ceiling_gib_per_s: gib_per_s(total, ceiling),
            // Path and ceiling are each the best of their own reps, not paired rounds.
            round_ratio_median: None,
        });
    }
    drop(engine);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_gives_a_store_and_a_load_row_per_chunk_size() {
        let config = HostBenchConfig {
            total_bytes: 1 << 20,
            chunk_sizes: vec![64 << 10, 256 << 10],
            threads: 1,
            reps: 1,
        };
        let mut lines = 0;
        let rows = run(&config, &mut |_| lines += 1).unwrap();
        assert_eq!(rows.len(), 4);
        assert_eq!(lines, 4);
        assert_eq!(
            rows.iter().map(|r| r.op.as_str()).collect::<Vec<_>>(),
            ["store", "load", "store", "load"]
        );
        assert!(rows
            .iter()
            .all(|r| r.gib_per_s > 0.0 && r.ceiling_gib_per_s > 0.0));
        assert_eq!(rows[2].chunk_bytes, 256 << 10);
    }

    #[test]
    fn bad_chunk_size_is_named() {
        let config = HostBenchConfig {
            chunk_sizes: vec![6],
            ..HostBenchConfig::default()
        };
        let err = run(&config, &mut |_| {}).unwrap_err();
        assert!(err.contains("chunk size 6"), "{err}");
    }
}
