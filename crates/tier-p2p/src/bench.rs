//! Peer fetch throughput against the machine's own loopback ceiling, measured in the same run.
//!
//! For each chunk size the ceiling is a raw loopback TCP stream that moves the same bytes between
//! the same kind of memory as the tier: one connection, one chunk-sized `write` at a time, each
//! from a distinct source chunk (the pass's whole footprint, like the publisher's published
//! chunks) behind as many framing bytes as a DATA frame has, read into a ring of `slot_count`
//! chunk-sized buffers (like the fetcher's host slots) in reads of the fetcher's size. So the
//! ratio measures what the protocol costs (framing, requests, checksums), not where the bytes
//! sit. Each raw stream keeps its connection for all rounds and is warmed by an untimed pass, as
//! the fetcher's is. A raw stream that rewrites one cache-resident buffer is also measured and
//! shown on the progress line, but it is not the ceiling: no fetch moves its bytes out of cache.
//! The path is two [`P2pTier`] instances in this process, where A publishes the chunks and B
//! loads them over loopback (one connection, jobs of several chunks, two jobs in flight, every
//! chunk received straight into B's slots and verified by checksum). Rounds alternate raw and
//! tier (raw first in even rounds, last in odd ones) so that drift in the machine hits both
//! alike; each row has the best round of each, and the median of each round's own tier/raw
//! ratio (`round_ratio_median`), which a swing of the machine between rounds cannot move the
//! way it moves a best-of. With the `nixl` feature and `nixl` set, a second fetching instance
//! moves the same chunks by NIXL READ (row op `"fetch-nixl"`, same ceiling). With `keyed` set,
//! a second publisher and fetcher pair that share a secret moves them too (row op
//! `"fetch-keyed"`, same ceiling): every DATA payload then carries a keyed tag, as between
//! hosts, where a secret is required (the server keys each tag over the chunk's POLYVAL digest,
//! kept since publish; the client hashes each received payload); the plain rows use
//! the xxh3 checksum of loopback without one.
//!
//! Each row also has the CPU time the process spent per GiB moved ([`CpuPerGib`]), on the path
//! and on the ceiling, summed over all timed passes: on this 2-core machine CPU per byte decides
//! the ratio once another process takes a core, and unlike GiB/s it can be compared while the
//! machine is busy. `kvtier bench p2p` calls [`run_detailed`], the `p2p_bench` example [`run`].

use std::cell::UnsafeCell;
use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::bench::{median, BenchRow};
use offload_core::tier::{SlotMemory, Tier, TierChunk, TierCompletion, TierJob, TierOp};
use offload_core::{ChunkKey, JobId, SlotId};

use crate::client::HASH_PIECE_BYTES;
use crate::frame::{DATA_PREFIX_BYTES, HEADER_BYTES};
use crate::{Namespace, P2pConfig, P2pTier};

const MIB: usize = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
/// How long one load job of the benchmark may take before the run fails.
const JOB_DEADLINE: Duration = Duration::from_secs(60);

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct P2pBenchConfig {
    /// Bytes moved per pass and chunk size (rounded down to whole chunks, at least one).
    pub total_bytes: usize,
    /// The chunk sizes to measure, in bytes; each is one row.
    pub chunk_bytes: Vec<usize>,
    /// Alternating raw/tier rounds per chunk size; the best of each is reported (and the median
    /// of the rounds' own ratios). Loopback throughput here swings by tens of percent from one
    /// pass to the next: with 5 or 10 rounds a size's ratios moved by up to 0.2 from one run to
    /// the next; with 30 its medians moved by a few hundredths and its best-of by up to 0.1.
    pub rounds: usize,
    /// Host slots on the fetching side; two jobs of half of them each are in flight.
    pub slot_count: u32,
    /// Also measure the NIXL data plane (feature `nixl`; an error if NIXL cannot run).
    pub nixl: bool,
    /// Also measure fetches between instances that share a secret (keyed BLAKE3 tags).
    pub keyed: bool,
}

impl Default for P2pBenchConfig {
    /// 512 MiB per pass, chunks of 1, 2, 4 and 8 MiB, best of 30, 16 slots (about a minute).
    fn default() -> Self {
        Self {
            total_bytes: 512 * MIB,
            chunk_bytes: vec![MIB, 2 * MIB, 4 * MIB, 8 * MIB],
            rounds: 30,
            slot_count: 16,
            nixl: false,
            keyed: false,
        }
    }
}

/// CPU time of the whole process (every thread: the sending side, the receiving side and, for
/// the path, the caller polling for completions) per GiB moved, summed over every timed pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuPerGib {
    /// CPU-seconds per GiB fetched by the path.
    pub path_s: f64,
    /// CPU-seconds per GiB moved by the raw loopback stream (the ceiling).
    pub ceiling_s: f64,
}

/// One row of [`run_detailed`]: throughput against the ceiling, and CPU per GiB of each.
#[derive(Clone, Debug, PartialEq)]
pub struct P2pBenchRow {
    /// GiB/s of the path and the ceiling.
    pub row: BenchRow,
    /// CPU-seconds per GiB of the path and the ceiling.
    pub cpu: CpuPerGib,
}

/// Runs the benchmark: one `BenchRow` with op `"fetch"` per chunk size (the tier's GiB/s and
/// the raw socket's, same run). `progress` hears one line per finished chunk size.
pub fn run(
    config: &P2pBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<BenchRow>, String> {
    let rows = run_detailed(config, progress)?;
    Ok(rows.into_iter().map(|r| r.row).collect())
}

/// [`run`], with the CPU time per GiB of the path and of the ceiling in each row.
pub fn run_detailed(
    config: &P2pBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<P2pBenchRow>, String> {
    if config.rounds == 0 || config.slot_count < 2 {
        return Err(format!(
            "p2p bench: rounds must be >= 1 and slot_count >= 2, got {} and {}",
            config.rounds, config.slot_count
        ));
    }
    let mut rows = Vec::new();
    for &bytes in &config.chunk_bytes {
        if bytes == 0 || bytes > u32::MAX as usize {
            return Err(format!(
                "p2p bench: chunk size {bytes} is not in 1..=u32::MAX"
            ));
        }
        let (measured, hot) = measure(config, bytes)?;
        for P2pBenchRow { row, cpu } in measured {
            progress(&format!(
                "{} {:>6} KiB: raw tcp {:.2} GiB/s (one cache-resident buffer: {hot:.2}), p2p \
                 {:.2} GiB/s, ratio {:.2} (median of the rounds' own ratios: {:.2}); CPU s/GiB \
                 raw {:.3}, p2p {:.3}",
                row.op,
                bytes / 1024,
                row.ceiling_gib_per_s,
                row.gib_per_s,
                row.ratio(),
                row.round_ratio_median.unwrap_or(0.0),
                cpu.ceiling_s,
                cpu.path_s,
            ));
            rows.push(P2pBenchRow { row, cpu });
        }
    }
    Ok(rows)
}

/// Every path at one chunk size: the TCP row, then the NIXL row if asked; and the best raw
/// GiB/s from one cache-resident buffer (shown, not a ceiling).
fn measure(config: &P2pBenchConfig, bytes: usize) -> Result<(Vec<P2pBenchRow>, f64), String> {
    let count = (config.total_bytes / bytes).max(1);
    let total = count * bytes;
    let a = publisher(count, bytes, total, None)?;
    let keyed = match config.keyed {
        true => Some(publisher(count, bytes, total, Some(BENCH_SECRET))?),
        false => None,
    };
    let mut raw_memory = RawStream::new(total, bytes * config.slot_count as usize, bytes, total)?;
    let mut raw_hot = RawStream::new(bytes, bytes, bytes, total)?;
    let mut paths = vec![("fetch", fetcher(&a, config, bytes, false)?)];
    if config.nixl {
        paths.push(("fetch-nixl", fetcher(&a, config, bytes, true)?));
    }
    if let Some(keyed) = &keyed {
        paths.push(("fetch-keyed", fetcher(keyed, config, bytes, false)?));
    }
    let mut passes: Vec<Pass<'_>> = paths
        .iter_mut()
        .map(|(_, tier)| Pass {
            tier,
            next_id: 1,
            slot_count: config.slot_count,
            bytes,
        })
        .collect();
    // Warm-up: connects and warms the path.
    let warm_up = count.min(config.slot_count as usize);
    for pass in &mut passes {
        pass.run(warm_up)?;
    }
    if config.nixl {
        check_nixl_used(passes[1].tier)?;
    }
    let (mut raw, mut hot) = (0.0f64, 0.0f64);
    let mut best = vec![0.0f64; passes.len()];
    let mut ratios = vec![Vec::new(); passes.len()];
    // CPU time of the timed passes: the raw ceiling's, and each path's.
    let mut raw_cpu = Duration::ZERO;
    let mut path_cpu = vec![Duration::ZERO; passes.len()];
    for round in 0..config.rounds {
        // Raw first in even rounds, last in odd ones: a drift within rounds favours neither.
        let mut tiers = Vec::new();
        if round % 2 == 1 {
            for (pass, cpu) in passes.iter_mut().zip(&mut path_cpu) {
                tiers.push(on_cpu(cpu, || pass.run(count))?);
            }
        }
        let round_raw = on_cpu(&mut raw_cpu, || raw_memory.pass())?;
        raw = raw.max(round_raw);
        hot = hot.max(raw_hot.pass()?);
        if round % 2 == 0 {
            for (pass, cpu) in passes.iter_mut().zip(&mut path_cpu) {
                tiers.push(on_cpu(cpu, || pass.run(count))?);
            }
        }
        for ((tier, best), ratios) in tiers.into_iter().zip(&mut best).zip(&mut ratios) {
            *best = best.max(tier);
            ratios.push(tier / round_raw);
        }
    }
    // Every chunk a pass counted came over the wire from the publisher and verified.
    let expected = (warm_up + config.rounds * count) as u64;
    for (op, tier) in &paths {
        let fetched = tier.stats().chunks_fetched;
        if fetched != expected {
            return Err(format!(
                "p2p bench: the {op} fetcher fetched {fetched} chunks, expected {expected}"
            ));
        }
    }
    // Every timed pass, raw or path, moves `total` bytes.
    let gib = (config.rounds * total) as f64 / GIB;
    let rows = paths
        .iter()
        .zip(best)
        .zip(&mut ratios)
        .zip(path_cpu)
        .map(|((((op, _), gib_per_s), ratios), cpu)| P2pBenchRow {
            row: BenchRow {
                op: (*op).into(),
                chunk_bytes: bytes as u64,
                gib_per_s,
                ceiling_gib_per_s: raw,
                round_ratio_median: Some(median(ratios)),
            },
            cpu: CpuPerGib {
                path_s: cpu.as_secs_f64() / gib,
                ceiling_s: raw_cpu.as_secs_f64() / gib,
            },
        })
        .collect();
    Ok((rows, hot))
}

/// Runs `f`, adding the CPU time the process spent meanwhile to `total`.
fn on_cpu<T>(total: &mut Duration, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    let start = process_cpu()?;
    let result = f()?;
    *total += process_cpu()?.saturating_sub(start);
    Ok(result)
}

/// CPU time used so far by every thread of this process, alive or ended.
pub fn process_cpu() -> Result<Duration, String> {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the call's duration.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) };
    if rc != 0 {
        let error = std::io::Error::last_os_error();
        return Err(format!(
            "p2p bench: clock_gettime(CLOCK_PROCESS_CPUTIME_ID): {error}"
        ));
    }
    let secs = u64::try_from(now.tv_sec).unwrap_or(0);
    let nanos = u32::try_from(now.tv_nsec).unwrap_or(0);
    Ok(Duration::new(secs, nanos))
}

/// Fails unless `tier` fetched its chunks by NIXL (else the row would measure TCP).
fn check_nixl_used(tier: &P2pTier) -> Result<(), String> {
    if tier.stats().chunks_fetched_nixl > 0 {
        return Ok(());
    }
    #[cfg(feature = "nixl")]
    let why = crate::nixl::available()
        .err()
        .unwrap_or_else(|| "NIXL is loaded but the fetch went over TCP (see the log)".into());
    #[cfg(not(feature = "nixl"))]
    let why = "tier-p2p was built without the `nixl` feature".to_owned();
    Err(format!("p2p bench: cannot measure NIXL: {why}"))
}

/// A host pool in one prefaulted allocation with stable slot addresses (like a pinned pool), so
/// that payloads are received straight into the slots (and NIXL can register them).
pub struct FlatSlotMemory {
    bytes: Box<[UnsafeCell<u8>]>,
    slot_bytes: usize,
    slot_count: u32,
}

// SAFETY: the `Tier` ownership rules give each in-flight job exclusive use of its slots, so no
// two threads touch the same bytes at once; the cells are only reached through those rules.
unsafe impl Sync for FlatSlotMemory {}

impl FlatSlotMemory {
    /// `slot_count` slots of `slot_bytes`, every byte written (a pattern) so the pool is
    /// prefaulted.
    pub fn new(slot_count: u32, slot_bytes: usize) -> Self {
        // Writing every byte prefaults the pool before any measurement.
        let bytes = (0..slot_count as usize * slot_bytes)
            .map(|i| UnsafeCell::new((i % 251) as u8))
            .collect();
        Self {
            bytes,
            slot_bytes,
            slot_count,
        }
    }

    fn base(&self, slot: SlotId, offset: usize, len: usize) -> *mut u8 {
        assert!(
            slot.0 < self.slot_count && offset + len <= self.slot_bytes,
            "bench memory: slot {} offset {offset} len {len} outside the pool",
            slot.0
        );
        self.bytes[slot.0 as usize * self.slot_bytes + offset].get()
    }
}

impl SlotMemory for FlatSlotMemory {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        self.slot_count
    }

    fn read_slot(&self, slot: SlotId, offset: usize, dst: &mut [u8]) {
        let src = self.base(slot, offset, dst.len());
        // SAFETY: the range is inside the allocation (checked in `base`), and the slot is owned
        // by the calling job, so nobody writes it meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
    }

    fn write_slot(&self, slot: SlotId, offset: usize, src: &[u8]) {
        let dst = self.base(slot, offset, src.len());
        // SAFETY: as in `read_slot`; the job owns the slot exclusively.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
    }

    fn slot_ptr(&self, slot: SlotId) -> Option<NonNull<u8>> {
        NonNull::new(self.base(slot, 0, 0))
    }
}

fn key(index: usize) -> ChunkKey {
    ChunkKey::new(0xBE4C_0000_0000 + index as u128, 0)
}

fn raw_error(what: &str, e: std::io::Error) -> String {
    format!("p2p bench raw loopback: {what}: {e}")
}

/// Bytes ahead of each raw write's chunk: as many as a DATA frame's header and prefix.
const RAW_FRAMING_BYTES: usize = HEADER_BYTES + DATA_PREFIX_BYTES;

/// A raw loopback stream, kept open for all rounds of a chunk size (as the fetcher keeps its
/// connection): write `i` of a pass sends [`RAW_FRAMING_BYTES`] and the `i`-th chunk of `source`
/// (cycling) in one `writev`, and the chunk is read into the `i`-th chunk of `ring` (cycling), in
/// reads of the size the fetcher uses ([`HASH_PIECE_BYTES`]). The framing bytes matter on this
/// machine's CPU: without them the kernel copies between pages at the same offset on both
/// sides, which ran 10-40% slower in interleaved runs (2.0-2.6 against 2.7-3.3 GiB/s at 1-8
/// MiB), and a ceiling that slow is no ceiling. One chunk each is the cache-resident stream; a
/// source as large as the pass and a ring as large as the fetcher's slots is the ceiling. Memory
/// is allocated and prefaulted once, and an untimed pass warms the connection (its buffers grow
/// with use).
struct RawStream {
    stream: TcpStream,
    ring: Box<[u8]>,
    write_bytes: usize,
    writes: usize,
    /// One message per pass for the writer; dropping it ends the writer.
    go: Option<std::sync::mpsc::Sender<()>>,
    writer: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl RawStream {
    fn new(
        source_bytes: usize,
        ring_bytes: usize,
        write_bytes: usize,
        total: usize,
    ) -> Result<Self, String> {
        let source: Arc<[u8]> = (0..source_bytes).map(|i| (i % 251) as u8).collect();
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| raw_error("bind", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| raw_error("local_addr", e))?;
        let writes = total / write_bytes;
        let (go, passes) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn(move || -> std::io::Result<()> {
            let (mut stream, _) = listener.accept()?;
            stream.set_nodelay(true)?;
            let framing = [0x5Au8; RAW_FRAMING_BYTES];
            for () in passes {
                for chunk in source.chunks_exact(write_bytes).cycle().take(writes) {
                    let mut bufs = [IoSlice::new(&framing), IoSlice::new(chunk)];
                    let mut bufs = &mut bufs[..];
                    while !bufs.is_empty() {
                        match stream.write_vectored(bufs)? {
                            0 => return Err(std::io::ErrorKind::WriteZero.into()),
                            n => IoSlice::advance_slices(&mut bufs, n),
                        }
                    }
                }
            }
            Ok(())
        });
        let stream = TcpStream::connect(addr).map_err(|e| raw_error("connect", e))?;
        stream
            .set_nodelay(true)
            .map_err(|e| raw_error("nodelay", e))?;
        let mut raw = Self {
            stream,
            ring: vec![1u8; ring_bytes].into_boxed_slice(),
            write_bytes,
            writes,
            go: Some(go),
            writer: Some(writer),
        };
        raw.pass()?;
        Ok(raw)
    }

    /// One pass of `total` bytes; GiB/s from the writer's go to the last byte read.
    fn pass(&mut self) -> Result<f64, String> {
        let write_bytes = self.write_bytes;
        let slots = self.ring.len() / write_bytes;
        let start = Instant::now();
        if self.go.as_ref().is_none_or(|go| go.send(()).is_err()) {
            return Err("p2p bench raw loopback: the writer thread is gone".into());
        }
        let mut framing = [0u8; RAW_FRAMING_BYTES];
        for i in 0..self.writes {
            self.stream
                .read_exact(&mut framing)
                .map_err(|e| raw_error("read", e))?;
            let at = (i % slots) * write_bytes;
            for piece in self.ring[at..at + write_bytes].chunks_mut(HASH_PIECE_BYTES) {
                self.stream
                    .read_exact(piece)
                    .map_err(|e| raw_error("read", e))?;
            }
        }
        Ok((self.writes * write_bytes) as f64 / GIB / start.elapsed().as_secs_f64())
    }
}

impl Drop for RawStream {
    fn drop(&mut self) {
        // Ends the writer's loop, and wakes it if it is blocked writing.
        self.go = None;
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(writer) = self.writer.take() {
            // A write error after the shutdown is expected; every pass already read all its bytes.
            let _ = writer.join();
        }
    }
}

/// The secret shared by the `keyed` publisher and fetcher.
const BENCH_SECRET: &[u8] = b"kvtier p2p bench secret";

fn bench_config(bytes: usize, total: usize, secret: Option<&[u8]>) -> P2pConfig {
    let mut config = P2pConfig::new(Namespace::new(
        &crate::NamespaceId {
            model: "bench".into(),
            dtype: "u8".into(),
            tokens_per_chunk: 1,
            parallel_layout: "flat".into(),
        },
        1,
        1,
    ));
    config.secret = secret.map(<[u8]>::to_vec);
    config.published_bytes_max = total + bytes;
    config.frame_body_bytes_max = config.frame_body_bytes_max.max(bytes + 64);
    config.fetch_deadline = JOB_DEADLINE;
    config
}

/// A fresh instance that publishes `count` chunks of `bytes` (all from one filled slot), with
/// `secret` if any.
fn publisher(
    count: usize,
    bytes: usize,
    total: usize,
    secret: Option<&[u8]>,
) -> Result<P2pTier, String> {
    let memory: Arc<dyn SlotMemory> = Arc::new(FlatSlotMemory::new(1, bytes));
    let mut tier = P2pTier::new(bench_config(bytes, total, secret), memory)
        .map_err(|e| format!("p2p bench: publisher: {e}"))?;
    let chunks = (0..count)
        .map(|i| TierChunk::new(key(i), SlotId(0), bytes as u32))
        .collect();
    let id = JobId(1);
    let job = TierJob {
        id,
        request: None,
        op: TierOp::Store,
        chunks,
    };
    tier.submit(job)
        .map_err(|e| format!("p2p bench: publish refused: {e:?}"))?;
    wait(&mut tier, id, &mut Vec::new())?;
    Ok(tier)
}

/// A fetching instance with `publisher` as its peer (and its secret) and its own slots; `nixl`
/// picks the data plane.
fn fetcher(
    publisher: &P2pTier,
    bench: &P2pBenchConfig,
    bytes: usize,
    nixl: bool,
) -> Result<P2pTier, String> {
    let memory: Arc<dyn SlotMemory> = Arc::new(FlatSlotMemory::new(bench.slot_count, bytes));
    let mut config = bench_config(bytes, bytes, publisher.config().secret.as_deref());
    config.peers = vec![publisher.local_addr().into()];
    config.nixl = nixl;
    P2pTier::new(config, memory).map_err(|e| format!("p2p bench: fetcher: {e}"))
}

/// Polls `tier` until job `id` completes; a failed or late job is an error.
fn wait(tier: &mut P2pTier, id: JobId, out: &mut Vec<TierCompletion>) -> Result<(), String> {
    let start = Instant::now();
    loop {
        if let Some(i) = out.iter().position(|c| c.id == id) {
            let done = out.swap_remove(i);
            if !done.is_success() {
                return Err(format!(
                    "p2p bench: job {} failed {} keys",
                    id.0,
                    done.failed.len()
                ));
            }
            return Ok(());
        }
        if start.elapsed() > JOB_DEADLINE {
            return Err(format!(
                "p2p bench: job {} not done in {JOB_DEADLINE:?}",
                id.0
            ));
        }
        tier.poll(out);
        // Poll every millisecond, as an engine polls once per scheduler step (which is longer).
        // With the default sizes two jobs of at least 8 MiB are queued, so the client never
        // waits for this poller. A 200 us poll loop took a tenth of a core on this 2-core
        // machine (schedstat), from the threads that move the bytes: a cost of the caller, which
        // the raw stream does not pay.
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Loads chunks through one fetching instance.
struct Pass<'a> {
    tier: &'a mut P2pTier,
    next_id: u64,
    slot_count: u32,
    bytes: usize,
}

impl Pass<'_> {
    /// Loads chunks `0..count`, two jobs of half the slots each in flight; returns GiB/s.
    fn run(&mut self, count: usize) -> Result<f64, String> {
        let per_job = self.slot_count as usize / 2;
        let mut out = Vec::new();
        let mut in_flight: Vec<JobId> = Vec::new();
        let start = Instant::now();
        for (job_index, first) in (0..count).step_by(per_job).enumerate() {
            let half = (job_index % 2) as u32 * per_job as u32;
            let chunks = (first..(first + per_job).min(count))
                .enumerate()
                .map(|(n, i)| TierChunk::new(key(i), SlotId(half + n as u32), self.bytes as u32))
                .collect();
            if in_flight.len() == 2 {
                let oldest = in_flight.remove(0);
                wait(self.tier, oldest, &mut out)?;
            }
            let id = JobId(self.next_id);
            self.next_id += 1;
            let job = TierJob {
                id,
                request: None,
                op: TierOp::Load,
                chunks,
            };
            self.tier
                .submit(job)
                .map_err(|e| format!("p2p bench: load refused: {e:?}"))?;
            in_flight.push(id);
        }
        for id in in_flight {
            wait(self.tier, id, &mut out)?;
        }
        Ok((count * self.bytes) as f64 / GIB / start.elapsed().as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_run_reports_one_positive_row_per_chunk_size() {
        let config = P2pBenchConfig {
            total_bytes: 256 * 1024,
            chunk_bytes: vec![64 * 1024, 128 * 1024],
            rounds: 1,
            slot_count: 4,
            nixl: false,
            keyed: false,
        };
        let mut lines = Vec::new();
        let rows = run(&config, &mut |line| lines.push(line.to_owned())).expect("bench runs");
        assert_eq!(rows.len(), 2);
        assert_eq!(lines.len(), 2);
        for (row, bytes) in rows.iter().zip([64 * 1024u64, 128 * 1024]) {
            assert_eq!(row.op, "fetch");
            assert_eq!(row.chunk_bytes, bytes);
            assert!(row.gib_per_s > 0.0 && row.gib_per_s.is_finite(), "{row:?}");
            assert!(row.ceiling_gib_per_s > 0.0, "{row:?}");
            let median = row.round_ratio_median.expect("paired rounds give a median");
            assert!(median > 0.0 && median.is_finite(), "{row:?}");
        }
    }

    #[test]
    fn detailed_run_reports_cpu_per_gib_of_path_and_ceiling() {
        let config = P2pBenchConfig {
            total_bytes: 4 * MIB,
            chunk_bytes: vec![MIB],
            rounds: 2,
            slot_count: 4,
            nixl: false,
            keyed: false,
        };
        let rows = run_detailed(&config, &mut |_| {}).expect("bench runs");
        assert_eq!(rows.len(), 1);
        let cpu = rows[0].cpu;
        // Moving bytes over loopback costs CPU on both sides: neither can be free, and no
        // machine moves a GiB with less than a microsecond or more than a minute of CPU.
        for s in [cpu.path_s, cpu.ceiling_s] {
            assert!(s > 1e-6 && s < 60.0, "{cpu:?}");
        }
    }

    #[test]
    fn keyed_run_adds_a_row_fetched_between_instances_with_a_secret() {
        let config = P2pBenchConfig {
            total_bytes: 2 * MIB,
            chunk_bytes: vec![MIB],
            rounds: 1,
            slot_count: 2,
            nixl: false,
            keyed: true,
        };
        let rows = run_detailed(&config, &mut |_| {}).expect("bench runs");
        let ops: Vec<&str> = rows.iter().map(|r| r.row.op.as_str()).collect();
        assert_eq!(ops, ["fetch", "fetch-keyed"]);
        for r in &rows {
            assert!(r.row.gib_per_s > 0.0 && r.cpu.path_s > 0.0, "{r:?}");
            assert_eq!(r.row.ceiling_gib_per_s, rows[0].row.ceiling_gib_per_s);
        }
    }

    #[test]
    fn process_cpu_counts_work_of_other_threads() {
        let before = process_cpu().expect("process CPU clock");
        let spin = std::thread::spawn(|| {
            let start = Instant::now();
            let mut x = 0u64;
            while start.elapsed() < Duration::from_millis(50) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            x
        });
        spin.join().expect("spinning thread");
        let used = process_cpu()
            .expect("process CPU clock")
            .saturating_sub(before);
        // The spinning thread alone ran for 50 ms of wall time; on a loaded machine it may get
        // less than all of it, but not less than a tenth.
        assert!(used >= Duration::from_millis(5), "{used:?}");
    }

    #[test]
    fn bad_config_is_refused() {
        let config = P2pBenchConfig {
            rounds: 0,
            ..P2pBenchConfig::default()
        };
        assert!(run(&config, &mut |_| {}).is_err());
        let config = P2pBenchConfig {
            chunk_bytes: vec![0],
            ..P2pBenchConfig::default()
        };
        assert!(run(&config, &mut |_| {}).is_err());
    }
}
