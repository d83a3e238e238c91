//! The disk tier's throughput benchmark against the disk's own ceiling, measured in the same run
//! (what `kvtier bench fs` and the `fs_bench` example run).
//!
//! For each chunk size: raw O_DIRECT sequential writes then reads of one fresh file in the
//! target directory, once at queue depth 1 (one chunk-sized `pwrite`/`pread` at a time, the
//! writes appending) and once at the queue depth the tier runs (`workers * chunks_per_job`
//! threads taking the next chunk, into a file preallocated like the tier's segments, since
//! concurrent appends to one file are serialized by the file system); the better of the two is
//! the ceiling, so the tier is never flattered. Then the tier stores the same number of chunks
//! (jobs of `chunks_per_job`, as many jobs in flight as it takes) into an empty namespace in the
//! same directory and loads them all back (every load verified; a few jobs' loads, untimed,
//! first, so that the tier's read buffers are warm as in a running engine). The three passes are repeated
//! `repeats` times, interleaved (each round starts with another of them), and each side keeps
//! its best (the ceiling has twice the tier's samples), because a shared disk's bandwidth drifts
//! by tens of percent within a minute. A virtual disk may also serve a burst after an idle
//! spell, so an untimed raw pass runs first, and every pass is preceded by the same pause. Each
//! row is the tier's GiB/s with the ceiling's.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::bench::{median, BenchRow};
use offload_core::tier::{SlotMemory, Tier, TierChunk, TierCompletion, TierJob, TierOp};
use offload_core::{ChunkKey, JobId, SlotId};

use crate::config::{EngineChoice, FsTierConfig, NamespaceId};
use crate::error::FsError;
use crate::io::AlignedBuf;
use crate::tier::FsTier;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
const GIB: f64 = (1u64 << 30) as f64;
/// Jobs in flight at once; each has its own group of `chunks_per_job` host slots, so that no two
/// jobs in flight share a slot (the Tier contract: a job owns its slots until it completes).
const JOBS_IN_FLIGHT_MAX: usize = 8;
/// The fewest chunks a pass moves.
const CHUNKS_MIN: usize = 32;
/// The longest one pass may take before the benchmark gives up.
const PASS_DEADLINE: Duration = Duration::from_secs(600);
/// The most raw-I/O threads.
const RAW_THREADS_MAX: usize = 64;
/// How often the benchmark polls the tier for completions.
const POLL_INTERVAL: Duration = Duration::from_millis(1);

/// What to measure.
#[derive(Clone, Debug)]
pub struct FsBenchConfig {
    /// The directory to measure (on the disk in question, not tmpfs); scratch files and a
    /// namespace directory are created under it and removed after each pass.
    pub dir: PathBuf,
    /// Bytes moved per pass (at least `2 * 16` chunks are moved whatever the size).
    pub total_bytes: u64,
    /// Chunk sizes, in bytes (each a multiple of 4096 is best, like real KV chunks).
    pub chunk_sizes: Vec<usize>,
    /// The tier's I/O engine.
    pub engine: EngineChoice,
    /// The tier's worker threads.
    pub workers: usize,
    /// Chunks per tier job.
    pub chunks_per_job: usize,
    /// Rounds of (raw at depth 1, raw at the tier's depth, tier) per chunk size; each side keeps
    /// its best.
    pub repeats: usize,
    /// `sync` and pause briefly between passes, so that one pass's deletions do not slow the next
    /// (off for quick tests).
    pub settle: bool,
}

impl FsBenchConfig {
    /// The defaults over `dir`: 1 GiB per pass, chunks of 256 KiB to 8 MiB, the tier's default
    /// engine and workers, jobs of 4 chunks.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        let defaults = FsTierConfig::new("/", bench_namespace(), 1);
        Self {
            dir: dir.into(),
            total_bytes: 1 << 30,
            chunk_sizes: vec![256 * KIB, MIB, 2 * MIB, 4 * MIB, 8 * MIB],
            engine: defaults.engine,
            workers: defaults.workers,
            chunks_per_job: 4,
            repeats: 3,
            settle: true,
        }
    }

    /// The raw queue depth that matches the tier's (chunks in flight at once).
    pub fn raw_queue_depth(&self) -> usize {
        (self.workers * self.chunks_per_job).clamp(1, RAW_THREADS_MAX)
    }

    fn check(&self) -> Result<(), FsError> {
        let fail = |field: &'static str, reason: &str| {
            Err(FsError::Config {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.chunk_sizes.is_empty() {
            return fail("chunk_sizes", "must not be empty");
        }
        if self
            .chunk_sizes
            .iter()
            .any(|&s| s == 0 || s > u32::MAX as usize)
        {
            return fail("chunk_sizes", "each must be between 1 byte and 4 GiB");
        }
        if self.chunks_per_job == 0 {
            return fail("chunks_per_job", "must be at least 1");
        }
        if self.repeats == 0 {
            return fail("repeats", "must be at least 1");
        }
        if self.total_bytes == 0 {
            return fail("total_bytes", "must be at least 1");
        }
        Ok(())
    }
}

/// The benchmark's namespace.
fn bench_namespace() -> NamespaceId {
    NamespaceId {
        model: "kvtier-bench".into(),
        dtype: "bf16".into(),
        tokens_per_chunk: 256,
        parallel_layout: "tp1".into(),
    }
}

/// A host pool like the engine-facing one: one page-aligned allocation, slot after slot, with a
/// stable address (`slot_ptr`), so that the tier may move payloads straight between slots and
/// files. Used by the benchmark and by tier-fs's tests. Whoever hands a slot to a job must not
/// touch it until the job's completion (the `Tier` contract), so accesses never overlap.
pub struct AlignedSlotMemory {
    bytes: std::cell::UnsafeCell<AlignedBuf>,
    base: std::ptr::NonNull<u8>,
    slot_count: u32,
    slot_bytes: usize,
}

// SAFETY: the allocation is only reached through `base` for ranges of one slot, and a slot is
// used by one job at a time (the Tier contract), like a pool of `&mut [u8]`.
unsafe impl Send for AlignedSlotMemory {}
// SAFETY: as for `Send`.
unsafe impl Sync for AlignedSlotMemory {}

impl AlignedSlotMemory {
    /// `slot_count` slots of `slot_bytes` rounded up to 4 KiB, zeroed.
    pub fn new(slot_count: u32, slot_bytes: usize) -> Result<Self, FsError> {
        let slot_bytes = slot_bytes.next_multiple_of(crate::io::buf::ALIGN);
        let total = slot_bytes * slot_count as usize;
        let mut buf = AlignedBuf::try_with_capacity(total)
            .map_err(|e| bench_error(format!("aligned host pool of {total} bytes: {e}")))?;
        buf.as_full_mut_slice().fill(0);
        let base = std::ptr::NonNull::new(buf.as_mut_ptr())
            .ok_or_else(|| bench_error("aligned host pool: null allocation".into()))?;
        Ok(Self {
            bytes: std::cell::UnsafeCell::new(buf),
            base,
            slot_count,
            slot_bytes,
        })
    }

    /// Fills every slot with a fixed, position-dependent pattern (the benchmark's payload).
    fn fill_pattern(&mut self) {
        for (i, b) in self
            .bytes
            .get_mut()
            .as_full_mut_slice()
            .iter_mut()
            .enumerate()
        {
            *b = (i as u64).wrapping_mul(31).wrapping_add(i as u64 >> 20) as u8;
        }
    }

    fn at(&self, slot: SlotId, offset: usize, len: usize) -> *mut u8 {
        assert!(
            slot.0 < self.slot_count && offset + len <= self.slot_bytes,
            "aligned host pool: slot {} offset {offset} len {len} outside the pool",
            slot.0
        );
        // Keeps the allocation (owned by `bytes`) tied to this struct's lifetime.
        let _ = &self.bytes;
        // SAFETY: inside the allocation (checked above).
        unsafe {
            self.base
                .as_ptr()
                .add(slot.0 as usize * self.slot_bytes + offset)
        }
    }
}

impl SlotMemory for AlignedSlotMemory {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        self.slot_count
    }

    fn read_slot(&self, slot: SlotId, offset: usize, dst: &mut [u8]) {
        let src = self.at(slot, offset, dst.len());
        // SAFETY: inside the pool (checked by `at`); the calling job owns the slot.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
    }

    fn write_slot(&self, slot: SlotId, offset: usize, src: &[u8]) {
        let dst = self.at(slot, offset, src.len());
        // SAFETY: as in `read_slot`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
    }

    fn slot_ptr(&self, slot: SlotId) -> Option<std::ptr::NonNull<u8>> {
        std::ptr::NonNull::new(self.at(slot, 0, 0))
    }
}

/// Lets the file system finish with deleted files (journal commit, discards) before the next
/// measurement.
fn settle(config: &FsBenchConfig) {
    if config.settle {
        // SAFETY: sync(2) takes no arguments and cannot fail.
        unsafe { libc::sync() };
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn gib_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / GIB / elapsed.as_secs_f64().max(1e-9)
}

fn bench_error(what: String) -> FsError {
    FsError::Bench(what)
}

/// `threads` threads each moving the next chunk of `file` (chunk `i` at `i * size`) until
/// `count` chunks moved; returns the elapsed time.
fn raw_pass(
    file: &Arc<File>,
    path: &Path,
    size: usize,
    count: usize,
    threads: usize,
    write: bool,
) -> Result<Duration, FsError> {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let results: Vec<Result<(), FsError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (next, file) = (Arc::clone(&next), Arc::clone(file));
                scope.spawn(move || -> Result<(), FsError> {
                    let mut buf = AlignedBuf::try_with_capacity(size)
                        .map_err(|e| FsError::io("alloc", path, 0, e))?;
                    for (i, b) in buf.as_full_mut_slice().iter_mut().enumerate() {
                        *b = (i * 31) as u8;
                    }
                    buf.set_len(size);
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= count {
                            return Ok(());
                        }
                        let offset = (i * size) as u64;
                        let moved = if write {
                            file.write_at(buf.as_slice(), offset)
                        } else {
                            file.read_at(buf.as_mut_slice(), offset)
                        };
                        let op = if write { "write" } else { "read" };
                        match moved {
                            Ok(n) if n == size => {}
                            Ok(n) => {
                                return Err(bench_error(format!(
                                    "raw {op} of {path:?} at offset {offset}: {n} of {size} bytes"
                                )))
                            }
                            Err(e) => return Err(FsError::io(op, path, offset, e)),
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(bench_error("a raw I/O thread panicked".into())))
            })
            .collect()
    });
    results.into_iter().collect::<Result<Vec<()>, FsError>>()?;
    Ok(start.elapsed())
}

/// Raw O_DIRECT sequential write of a fresh file then read of it, at `threads` chunks in flight
/// (with more than one, into a preallocated file); returns (write, read) GiB/s.
fn raw(
    config: &FsBenchConfig,
    size: usize,
    count: usize,
    threads: usize,
) -> Result<(f64, f64), FsError> {
    let path = config
        .dir
        .join(format!("kvtier-raw-direct-{}.bin", std::process::id()));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(|e| FsError::io("open O_DIRECT", &path, 0, e))?;
    let file = Arc::new(file);
    let bytes = (size * count) as u64;
    let measured = (|| {
        if threads > 1 {
            crate::direct::allocate(&file, 0, bytes)
                .map_err(|e| FsError::io("fallocate", &path, 0, e))?;
        }
        let write = raw_pass(&file, &path, size, count, threads, true)?;
        let read = raw_pass(&file, &path, size, count, threads, false)?;
        Ok((gib_per_s(bytes, write), gib_per_s(bytes, read)))
    })();
    drop(file);
    let _ = fs::remove_file(&path);
    settle(config);
    measured
}

/// Runs jobs of `op` over `keys` (chunks cycling through the slots), keeping as many jobs in
/// flight as the tier takes; returns the elapsed time.
fn run_jobs(
    tier: &mut FsTier,
    op: TierOp,
    keys: &[ChunkKey],
    size: u32,
    chunks_per_job: usize,
    first_id: u64,
) -> Result<Duration, FsError> {
    // A job takes a free group of slots when submitted and gives it back when it completes.
    let job_of = |j: usize, group: usize| TierJob {
        id: JobId(first_id + j as u64),
        request: None,
        op,
        chunks: keys[j * chunks_per_job..keys.len().min((j + 1) * chunks_per_job)]
            .iter()
            .enumerate()
            .map(|(i, &key)| {
                let slot = (group * chunks_per_job + i) as u32;
                TierChunk::new(key, SlotId(slot), size)
            })
            .collect(),
    };
    let total = keys.len().div_ceil(chunks_per_job);
    let mut free_groups: Vec<usize> = (0..JOBS_IN_FLIGHT_MAX).rev().collect();
    let mut group_of: std::collections::HashMap<JobId, usize> = std::collections::HashMap::new();
    let mut next = 0;
    let mut done = 0;
    let mut out: Vec<TierCompletion> = Vec::new();
    let start = Instant::now();
    while done < total {
        while next < total {
            let Some(&group) = free_groups.last() else {
                break;
            };
            let job = job_of(next, group);
            let id = job.id;
            match tier.submit(job) {
                Ok(()) => {
                    free_groups.pop();
                    group_of.insert(id, group);
                    next += 1;
                }
                Err(offload_core::tier::SubmitError::Busy { .. }) => break,
                Err(e) => return Err(bench_error(format!("{op:?} submit refused: {e}"))),
            }
        }
        tier.poll(&mut out);
        for completion in out.drain(..) {
            if let Some(group) = group_of.remove(&completion.id) {
                free_groups.push(group);
            }
            if !completion.is_success() {
                return Err(bench_error(format!(
                    "{op:?} job {} failed keys {:?} (stats: {:?})",
                    completion.id.0,
                    completion.failed,
                    tier.stats()
                )));
            }
            done += 1;
        }
        if start.elapsed() > PASS_DEADLINE {
            return Err(bench_error(format!(
                "{op:?} pass did not finish within {PASS_DEADLINE:?}"
            )));
        }
        // Poll every millisecond, as an engine polls once per scheduler step (which is longer).
        // Eight jobs of at least 1 MiB each are queued, so the tier never waits for this poller.
        // A 50 us poll loop woke this thread 20,000 times a second, taking CPU from the tier's
        // threads on a loaded 2-core machine: a cost of the caller, which the raw passes do not
        // pay (as in tier-p2p's bench).
        std::thread::sleep(POLL_INTERVAL);
    }
    Ok(start.elapsed())
}

/// The tier's store and load of `count` chunks of `size` bytes; returns (store, load) GiB/s and
/// the engine in use.
fn tier(config: &FsBenchConfig, size: usize, count: usize) -> Result<(f64, f64, String), FsError> {
    let root = config
        .dir
        .join(format!("kvtier-fs-bench-{}", std::process::id()));
    let slot_count = u32::try_from(JOBS_IN_FLIGHT_MAX * config.chunks_per_job)
        .map_err(|_| bench_error("too many chunks per job".into()))?;
    let mut memory = AlignedSlotMemory::new(slot_count, size)?;
    memory.fill_pattern();
    let memory = Arc::new(memory);
    let tier_config = FsTierConfig {
        engine: config.engine,
        workers: config.workers,
        quiet: true,
        // The tier's pipeline holds the records of the raw side's deeper pass (`raw_queue_depth`
        // chunks, at least one job), so both sides keep the same bytes in flight. The bench's
        // other queued jobs then wait in the tier's channel, and the writer starts one as soon as
        // a running one completes, without waiting for this caller's next poll. (A pipeline as
        // large as every job in flight drained whole before the caller refilled it: the disk sat
        // idle 1-5 ms in every 14 ms at 1 MiB chunks.)
        batch_bytes_max: config.raw_queue_depth().max(config.chunks_per_job) * (size + 4 * KIB),
        ..FsTierConfig::new(&root, bench_namespace(), u64::MAX / 2)
    };
    let measured = (|| {
        let mut fs_tier = FsTier::start(tier_config, memory as Arc<dyn SlotMemory>)?;
        let keys: Vec<ChunkKey> = (0..count as u64)
            .map(|n| {
                ChunkKey::new(
                    u128::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) | 1,
                    0,
                )
            })
            .collect();
        let per_job = config.chunks_per_job;
        let store = run_jobs(&mut fs_tier, TierOp::Store, &keys, size as u32, per_job, 1)?;
        // Untimed, like the raw side's first pass: the load workers fault in their read buffers
        // (kept for reuse) as in an engine's long-running tier, not in the timed pass.
        let warm = keys.len().min(2 * JOBS_IN_FLIGHT_MAX * per_job);
        run_jobs(
            &mut fs_tier,
            TierOp::Load,
            &keys[..warm],
            size as u32,
            per_job,
            1 << 39,
        )?;
        let load = run_jobs(
            &mut fs_tier,
            TierOp::Load,
            &keys,
            size as u32,
            per_job,
            1 << 40,
        )?;
        let stats = fs_tier.stats();
        let mode = if stats.direct_io {
            "O_DIRECT"
        } else {
            "buffered"
        };
        let bytes = (size * count) as u64;
        Ok((
            gib_per_s(bytes, store),
            gib_per_s(bytes, load),
            format!("{}+{mode}", stats.engine),
        ))
    })();
    let removed = fs::remove_dir_all(&root);
    settle(config);
    let measured = measured?;
    removed.map_err(|e| FsError::io("remove_dir_all", &root, 0, e))?;
    Ok(measured)
}

/// Chunks of `size` moved per pass.
fn chunk_count(config: &FsBenchConfig, size: usize) -> usize {
    usize::try_from(config.total_bytes / size as u64)
        .unwrap_or(usize::MAX)
        .max(CHUNKS_MIN)
}

/// Runs the benchmark; `progress` gets one line per measurement. Returns one `store` and one
/// `load` row per chunk size, each with the better raw O_DIRECT number of the same run as its
/// ceiling.
pub fn run(
    config: &FsBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<BenchRow>, FsError> {
    config.check()?;
    fs::create_dir_all(&config.dir).map_err(|e| FsError::io("mkdir", &config.dir, 0, e))?;
    let depth = config.raw_queue_depth();
    progress(&format!(
        "tier-fs bench in {:?}: {} MiB per pass, jobs of {} chunks, {} workers, raw at queue \
         depth 1 and {depth}",
        config.dir,
        config.total_bytes >> 20,
        config.chunks_per_job,
        config.workers
    ));
    // Drains a burst the disk may hold after an idle spell, which would flatter whichever pass
    // came first.
    let first = config.chunk_sizes[0];
    raw(config, first, chunk_count(config, first), 1)?;
    let mut rows = Vec::new();
    for &size in &config.chunk_sizes {
        let count = chunk_count(config, size);
        let mut best = [0f64; 6];
        // Each round's store and load ratio against that round's raw ceiling.
        let (mut store_ratios, mut load_ratios) = (Vec::new(), Vec::new());
        for round in 0..config.repeats {
            // The pass that runs first after a pause may get a burst from the disk: each pass
            // takes its turn at going first.
            let (mut raw_1, mut raw_n, mut measured) = (None, None, None);
            for pass in 0..3 {
                match (pass + round) % 3 {
                    0 => raw_1 = Some(raw(config, size, count, 1)?),
                    1 => raw_n = Some(raw(config, size, count, depth)?),
                    _ => measured = Some(tier(config, size, count)?),
                }
            }
            let ((write_1, read_1), (write_n, read_n)) =
                (raw_1.unwrap_or_default(), raw_n.unwrap_or_default());
            let (store, load, engine) = measured.unwrap_or_default();
            progress(&format!(
                "{:>6} KiB round {}: raw write {write_1:.2} (qd1) {write_n:.2} (qd{depth}), store \
                 {store:.2} | raw read {read_1:.2} (qd1) {read_n:.2} (qd{depth}), load {load:.2} \
                 GiB/s [{engine}]",
                size / KIB,
                round + 1
            ));
            for (slot, value) in best
                .iter_mut()
                .zip([write_1, write_n, store, read_1, read_n, load])
            {
                *slot = slot.max(value);
            }
            store_ratios.push(store / write_1.max(write_n));
            load_ratios.push(load / read_1.max(read_n));
        }
        let [write_1, write_n, store, read_1, read_n, load] = best;
        let (write_ceiling, read_ceiling) = (write_1.max(write_n), read_1.max(read_n));
        let (store_median, load_median) = (median(&mut store_ratios), median(&mut load_ratios));
        progress(&format!(
            "{:>6} KiB best of {}: store {store:.2} / ceiling {write_ceiling:.2} = {:.2}x | load \
             {load:.2} / ceiling {read_ceiling:.2} = {:.2}x (median of the rounds' own ratios: \
             store {:.2}x, load {:.2}x)",
            size / KIB,
            config.repeats,
            store / write_ceiling,
            load / read_ceiling,
            store_median,
            load_median,
        ));
        for (op, gib, ceiling, median) in [
            ("store", store, write_ceiling, store_median),
            ("load", load, read_ceiling, load_median),
        ] {
            rows.push(BenchRow {
                op: op.into(),
                chunk_bytes: size as u64,
                gib_per_s: gib,
                ceiling_gib_per_s: ceiling,
                round_ratio_median: Some(median),
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_run_gives_a_store_and_a_load_row_per_size() {
        let dir = tempfile::tempdir().unwrap();
        let config = FsBenchConfig {
            total_bytes: 1 << 20,
            chunk_sizes: vec![64 * KIB, 100 * KIB],
            workers: 2,
            repeats: 1,
            settle: false,
            ..FsBenchConfig::new(dir.path())
        };
        let mut lines = Vec::new();
        let rows = run(&config, &mut |line| lines.push(line.to_owned())).unwrap();
        assert_eq!(rows.len(), 4);
        let ops: Vec<&str> = rows.iter().map(|r| r.op.as_str()).collect();
        assert_eq!(ops, ["store", "load", "store", "load"]);
        assert_eq!(rows[2].chunk_bytes, 100 * KIB as u64);
        for row in &rows {
            assert!(
                row.gib_per_s > 0.0 && row.ceiling_gib_per_s > 0.0,
                "{row:?}"
            );
            assert!(
                row.round_ratio_median
                    .is_some_and(|m| m > 0.0 && m.is_finite()),
                "{row:?}"
            );
        }
        // The header, then a round line and a best line per size.
        assert_eq!(lines.len(), 5);
        // Everything the bench created is gone.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn bad_settings_name_the_field() {
        let mut config = FsBenchConfig::new("/nonexistent");
        config.chunk_sizes.clear();
        match run(&config, &mut |_| {}) {
            Err(FsError::Config { field, .. }) => assert_eq!(field, "chunk_sizes"),
            other => panic!("expected a config error, got {other:?}"),
        }
        config.chunk_sizes = vec![4096];
        config.chunks_per_job = 0;
        match run(&config, &mut |_| {}) {
            Err(FsError::Config { field, .. }) => assert_eq!(field, "chunks_per_job"),
            other => panic!("expected a config error, got {other:?}"),
        }
    }
}
