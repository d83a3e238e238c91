//! Disk tier throughput against the disk's own ceiling, measured in the same run: for chunk sizes
//! from 256 KiB to 8 MiB, raw O_DIRECT sequential writes and reads of one file (one chunk-sized
//! `pwrite`/`pread` at a time) in the target directory, then the tier's store and load of the same
//! bytes (jobs of several chunks, many jobs in flight, every load verified). Prints GiB/s and the
//! tier/raw ratio.
//!
//! Usage: `cargo run --release -p tier-fs --example fs_bench -- [DIR] [--engine auto|uring|sync]
//! [--total-mib N] [--workers N]` (DIR defaults to the system's temporary directory; it must be on the disk
//! to measure, not tmpfs).

use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{SlotMemory, Tier, TierCompletion, TierJob, TierOp};
use offload_core::{ChunkKey, JobId, SlotId};
use tier_fs::io::AlignedBuf;
use tier_fs::{EngineChoice, FsTier, FsTierConfig, NamespaceId};
use tier_testkit::VecSlotMemory;

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;
const GIB: f64 = (1u64 << 30) as f64;
/// Chunks per tier job.
const CHUNKS_PER_JOB: usize = 4;
/// Host slots (the jobs cycle through them).
const SLOT_COUNT: u32 = 16;

struct Args {
    dir: PathBuf,
    engine: EngineChoice,
    total_bytes: usize,
    workers: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        dir: std::env::temp_dir(),
        engine: EngineChoice::Auto,
        total_bytes: 1024 * MIB,
        workers: FsTierConfig::new("/", bench_namespace(), 1).workers,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--engine" => {
                args.engine = match it.next().as_deref() {
                    Some("auto") => EngineChoice::Auto,
                    Some("uring") => EngineChoice::Uring,
                    Some("sync") => EngineChoice::Sync,
                    other => return Err(format!("--engine: unknown {other:?}")),
                }
            }
            "--workers" => {
                args.workers = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--workers needs a number")?;
            }
            "--total-mib" => {
                let mib: usize = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--total-mib needs a number")?;
                args.total_bytes = mib * MIB;
            }
            dir if !dir.starts_with("--") => args.dir = PathBuf::from(dir),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

fn bench_namespace() -> NamespaceId {
    NamespaceId {
        model: "bench".into(),
        dtype: "bf16".into(),
        tokens_per_chunk: 256,
        parallel_layout: "tp1".into(),
    }
}

/// Lets the file system finish with deleted files (journal commit, discards) before the next
/// measurement, so that one pass's deletions do not slow the next.
fn settle() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::thread::sleep(Duration::from_millis(500));
}

fn gib_per_s(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / GIB / elapsed.as_secs_f64()
}

/// Raw O_DIRECT sequential write then read of `count` blocks of `size` bytes; returns GiB/s.
fn raw(dir: &Path, size: usize, count: usize) -> std::io::Result<(f64, f64)> {
    let path = dir.join("raw-direct.bin");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)?;
    let mut buf = AlignedBuf::with_capacity(size);
    for (i, b) in buf.as_full_mut_slice().iter_mut().enumerate() {
        *b = (i * 31) as u8;
    }
    buf.set_len(size);
    let start = Instant::now();
    for i in 0..count {
        let n = file.write_at(buf.as_slice(), (i * size) as u64)?;
        assert_eq!(n, size, "short raw write");
    }
    let write = gib_per_s(size * count, start.elapsed());
    let start = Instant::now();
    for i in 0..count {
        let n = file.read_at(buf.as_mut_slice(), (i * size) as u64)?;
        assert_eq!(n, size, "short raw read");
    }
    let read = gib_per_s(size * count, start.elapsed());
    drop(file);
    fs::remove_file(&path)?;
    settle();
    Ok((write, read))
}

/// Runs jobs of `op` over `keys` (chunks cycling through the slots), keeping as many jobs in
/// flight as the tier takes; returns the elapsed time.
fn run_jobs(
    tier: &mut FsTier,
    op: TierOp,
    keys: &[ChunkKey],
    size: u32,
    first_id: u64,
) -> Duration {
    let jobs: Vec<TierJob> = keys
        .chunks(CHUNKS_PER_JOB)
        .enumerate()
        .map(|(j, chunk)| TierJob {
            id: JobId(first_id + j as u64),
            request: None,
            op,
            chunks: chunk
                .iter()
                .enumerate()
                .map(|(i, &key)| {
                    let slot = ((j * CHUNKS_PER_JOB + i) % SLOT_COUNT as usize) as u32;
                    (key, SlotId(slot), size)
                })
                .collect(),
        })
        .collect();
    let total = jobs.len();
    let mut pending = jobs.into_iter().peekable();
    let mut done = 0;
    let mut out: Vec<TierCompletion> = Vec::new();
    let start = Instant::now();
    while done < total {
        while let Some(job) = pending.peek() {
            match tier.submit(job.clone()) {
                Ok(()) => {
                    pending.next();
                }
                Err(_) => break,
            }
        }
        tier.poll(&mut out);
        for completion in out.drain(..) {
            assert!(
                completion.is_success(),
                "{op:?} job {:?} failed keys {:?}",
                completion.id,
                completion.failed
            );
            done += 1;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    start.elapsed()
}

/// The tier's store and load of `count` chunks of `size` bytes; returns GiB/s and the engine.
fn tier(args: &Args, size: usize, count: usize) -> Result<(f64, f64, String), String> {
    let root = args
        .dir
        .join(format!("kvtier-fs-bench-{}", std::process::id()));
    let memory = Arc::new(VecSlotMemory::new(SLOT_COUNT, size));
    for slot in 0..SLOT_COUNT {
        memory.fill(SlotId(slot), size, u64::from(slot));
    }
    let config = FsTierConfig {
        engine: args.engine,
        workers: args.workers,
        batch_bytes_max: (CHUNKS_PER_JOB * (size + 4 * KIB)).max(64 * MIB),
        ..FsTierConfig::new(&root, bench_namespace(), u64::MAX / 2)
    };
    let mut fs_tier =
        FsTier::start(config, memory.clone() as Arc<dyn SlotMemory>).map_err(|e| e.to_string())?;
    let keys: Vec<ChunkKey> = (0..count as u64)
        .map(|n| ChunkKey::new(n.wrapping_mul(0x9E37_79B9_7F4A_7C15), 0))
        .collect();
    let store = run_jobs(&mut fs_tier, TierOp::Store, &keys, size as u32, 1);
    let load = run_jobs(&mut fs_tier, TierOp::Load, &keys, size as u32, 1_000_000);
    let stats = fs_tier.stats();
    let engine = format!(
        "{}{}",
        stats.engine,
        if stats.direct_io {
            "+O_DIRECT"
        } else {
            "+buffered"
        }
    );
    drop(fs_tier);
    fs::remove_dir_all(&root).map_err(|e| format!("removing {root:?}: {e}"))?;
    settle();
    Ok((
        gib_per_s(size * count, store),
        gib_per_s(size * count, load),
        engine,
    ))
}

fn main() -> Result<(), String> {
    let args = parse_args()?;
    println!(
        "tier-fs bench in {:?}: {} MiB per pass, jobs of {CHUNKS_PER_JOB} chunks, {} workers",
        args.dir,
        args.total_bytes / MIB,
        args.workers
    );
    println!(
        "{:>8}  {:>9} {:>9} {:>6}  {:>9} {:>9} {:>6}  engine",
        "chunk", "raw wr", "store", "ratio", "raw rd", "load", "ratio"
    );
    for size in [256 * KIB, MIB, 2 * MIB, 4 * MIB, 8 * MIB] {
        let count = (args.total_bytes / size).max(2 * SLOT_COUNT as usize);
        let (raw_write, raw_read) = raw(&args.dir, size, count)
            .map_err(|e| format!("raw O_DIRECT in {:?}: {e}", args.dir))?;
        let (store, load, engine) = tier(&args, size, count)?;
        println!(
            "{:>6}KiB  {:>9.2} {:>9.2} {:>5.2}x  {:>9.2} {:>9.2} {:>5.2}x  {engine}",
            size / KIB,
            raw_write,
            store,
            store / raw_write,
            raw_read,
            load,
            load / raw_read
        );
    }
    println!("(GiB/s; ratio = tier / raw O_DIRECT of the same directory)");
    Ok(())
}
