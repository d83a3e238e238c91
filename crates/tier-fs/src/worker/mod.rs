//! The background workers, each with its own I/O engine, sending exactly one completion per job:
//! one writer, which runs every store job of the tier (so the root gets one sequential append
//! stream), and the load workers, which take load jobs from the shared load channel and run them
//! as a pipeline (every queued job while their record bytes stay under `batch_bytes_max`, each
//! finished as soon as its reads completed), so that one thread keeps the disk busy and the
//! others wait on the channel. Loads run concurrently with each other and with stores;
//! completions may therefore arrive out of submission order. Bookkeeping (index, reservations, faults) is shared under short mutex
//! sections without I/O.
//!
//! Store: the writer runs store jobs as a pipeline. It starts every queued job while the record
//! bytes of the jobs it runs stay under `batch_bytes_max`, appending their records one after
//! another to its open segment, reaps writes as they complete, and finishes each job once all of
//! its writes completed (so the disk has the next jobs' writes queued meanwhile). Per job: reserve
//! capacity (evicting the oldest segments), copy each slot into an aligned buffer behind a header
//! (or, zero-copy, write a 4 KiB header buffer and the slot itself as one vectored write; see
//! below), allocate a fresh segment whole (`fallocate`, so that the writes run concurrently; see
//! `Worker::preallocate`), and write the records one after another into it (one write per record).
//! Only when a record's write completed (and, with `Durability::Fsync`, the segment was flushed)
//! does its chunk enter the index. A failed record is either the segment's tail (the next record
//! takes its place) or is covered by a skip record so that later records stay reachable. A full
//! segment is sealed once every job with a record in it finished, and a new one is created. Load:
//! a load worker starts a job beside the ones it runs (or, too large for the budget, alone after
//! them, batch by batch); read each record into an aligned buffer through a cached descriptor of its segment (records that
//! lie one after another in a segment with one read of all of them, at most 2 MiB), verify header
//! and checksum, and only then copy the payload into the slot; a record that does not verify leaves
//! the index (and, in a segment this instance may modify, is covered by a skip record). A merged
//! read that comes back short reads the records it did not cover again one by one, so only a torn
//! record itself fails.
//!
//! Host slots are only touched through [`SlotMemory`] by the worker running the job, between the
//! job's start and the send of its completion, so the tier never touches them after the
//! completion is polled.
//!
//! Zero-copy: with O_DIRECT, when the memory gives the slot a stable address
//! ([`SlotMemory::slot_ptr`]) aligned to 4 KiB and the payload length is a multiple of 4 KiB (no
//! padding needed), a store's record moves as one vectored operation, the header through a 4 KiB
//! buffer and the payload straight from the slot (a [`SlotSpan`]); so does a load's with
//! `zero_copy_loads` (off by default), which then verifies the payload in the slot (such reads are
//! never merged). Such an operation owns its slot until reaped; `execute` (loads) and the writer
//! (stores) reap every one before the job's completion can be sent. Injected corruption of a store goes through a bounce
//! buffer (a store never modifies its slot).
//!
//! Races between workers (an eviction deleting a segment another worker is reading through a
//! cached descriptor) can only lose a chunk, never serve wrong bytes: every load checks the key in
//! the record header and the payload checksum.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use offload_core::tier::{FailedKey, SlotMemory, TierChunk, TierCompletion, TierJob, TierOp};
use offload_core::{invariant, ChunkKey, JobId, SlotId};

use crate::config::Durability;
use crate::direct::{create_for_write, is_einval, open_for_read, reopen_buffered_for_write, warn};
use crate::error::{io_kind, FsErrorKind};
use crate::fault::{Fault, FaultPlan, FaultSite, FaultState};
use crate::format::{encode_into, file_bytes, verify, verify_parts, Header, ALIGN, HEADER_BYTES};
use crate::index::{Index, Location, SegmentId, SegmentState, Victim};
use crate::io::{AlignedBuf, IoEngine, IoOp, OpKind, SlotSpan};
use crate::layout::Layout;
use crate::segment::{open_for_repair, write_seal, write_skip};
use crate::stats::{add, FailureKind, StatsCell};

mod exec;
mod housekeep;
mod load;
mod store;

/// The most operations in one engine submission.
const BATCH_OPS_MAX: usize = 1024;
/// Reap errors tolerated (with a short pause each) before the worker gives up on a batch.
const REAP_ERRORS_MAX: u32 = 1000;
/// Read descriptors of segments a worker keeps open (beyond it, the cache is emptied).
const READERS_MAX: usize = 256;
/// Bytes of the seal a segment ends with (reserved when the segment is created).
const SEAL_BYTES: u64 = HEADER_BYTES as u64;
/// Operations of a batch are submitted in groups of at least this many bytes.
const SUBMIT_BYTES_MIN: usize = 1 << 20;
/// The most bytes one merged read of neighbouring records moves. Small records (under 1 MiB)
/// are merged into reads of up to this size; records of 1 MiB or more are read one by one. On
/// the development machine's virtio disk (requests split at 4 MiB, `max_sectors_kb`), raw reads
/// of 16 MiB moved ~25% slower than 1 MiB ones, and loads of 1 and 4 MiB chunks merged into
/// reads of up to 16 MiB reached 0.70-0.91 of the raw ceiling against 0.90-1.09 read one record
/// at a time (`docs/perf.md`, disk tier).
const READ_MERGE_BYTES_MAX: u64 = 2 << 20;
/// The most bytes of reads a load worker keeps in flight (at least one read always goes); the
/// rest of its running jobs' reads wait in its queue and go as earlier ones complete, before
/// the worker verifies and copies what completed. So up to seven 1 MiB records are read side by
/// side, while 4 and 8 MiB records go one at a time, each submitted the moment the one before
/// completes. On the development machine's virtio disk, which reads large requests faster one
/// at a time than side by side, two 8 MiB reads in flight loaded slower than one, and 15 reads
/// of 1 MiB in flight slower than 7 (`docs/perf.md`, disk tier).
const LOAD_READ_BYTES_IN_FLIGHT_MAX: u64 = 8 << 20;

/// The longest an injected stall lasts when nothing releases it (so a test never hangs).
const STALL_MAX: Duration = Duration::from_secs(10);

/// State shared by the front end, the workers and the prober.
///
/// The root's I/O mode is `stats.direct_io` (O_DIRECT until the first EINVAL).
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) index: Mutex<Index>,
    /// Jobs whose cancellation was requested and whose completion was not sent yet.
    pub(crate) cancelled: Mutex<HashSet<JobId>>,
    pub(crate) stats: StatsCell,
    /// This tier instance's id (the prefix of the segments it creates).
    pub(crate) instance: u64,
    /// The next segment sequence number of this instance.
    next_sequence: AtomicU32,
    /// Injected faults, shared by the workers (so that counts and limits are global).
    faults: Option<Mutex<FaultState>>,
    /// Injected stalls end once this is set (tests).
    pub(crate) stalls_released: AtomicBool,
}

impl Shared {
    pub(crate) fn new(capacity_bytes: u64, faults: &FaultPlan, instance: u64) -> Self {
        Self {
            index: Mutex::new(Index::new(capacity_bytes)),
            cancelled: Mutex::new(HashSet::new()),
            stats: StatsCell::default(),
            instance,
            next_sequence: AtomicU32::new(0),
            faults: (!faults.is_empty()).then(|| Mutex::new(FaultState::new(faults))),
            stalls_released: AtomicBool::new(false),
        }
    }

    /// The fault to inject at this call, if any.
    pub(crate) fn fault(&self, site: FaultSite, key: ChunkKey, direct: bool) -> Option<Fault> {
        let faults = self.faults.as_ref()?;
        let mut state = faults.lock().unwrap_or_else(PoisonError::into_inner);
        state.check(site, key, direct)
    }

    /// The index (held only for short sections without I/O).
    pub(crate) fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn cancelled(&self) -> MutexGuard<'_, HashSet<JobId>> {
        self.cancelled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the front end sends the worker.
pub(crate) enum Msg {
    /// Run this job and send its completion.
    Job(TierJob),
    /// Exit the loop (after every earlier job), sealing the open segment.
    Stop,
}

/// The worker's settings.
pub(crate) struct WorkerSettings {
    pub(crate) layout: Layout,
    pub(crate) durability: Durability,
    pub(crate) quiet: bool,
    pub(crate) batch_bytes_max: usize,
    /// A segment takes no further record once it holds this many bytes.
    pub(crate) segment_bytes: u64,
    /// Other instances share the directory: only this instance's segments are modified.
    pub(crate) shared_dir: bool,
    /// Loads may read payloads straight into slots (`FsTierConfig::zero_copy_loads`).
    pub(crate) zero_copy_loads: bool,
    /// A broken invariant at the I/O edge panics (see [`Worker::broken`]); the tier sets
    /// [`invariant::STRICT_DEFAULT`] (debug builds), the rule of offload-core.
    pub(crate) strict: bool,
}

/// The failed keys of the jobs run together (one load job, or the group of store jobs the
/// writer takes at once), by job index in the group, or of a load worker's running load jobs, by
/// their number: each key once per job, in first-failure order.
#[derive(Default)]
struct Failed {
    jobs: Vec<(Vec<FailedKey>, HashSet<ChunkKey>)>,
}

impl Failed {
    fn new(job_count: usize) -> Self {
        Self {
            jobs: (0..job_count).map(|_| Default::default()).collect(),
        }
    }

    fn add(&mut self, stats: &StatsCell, job: usize, key: ChunkKey, kind: FailureKind) {
        stats.fail(kind);
        let (keys, seen) = &mut self.jobs[job];
        if seen.insert(key) {
            keys.push(FailedKey::new(key, kind.tier_failure()));
        }
    }

    /// Starts job `job` with no failed key (a load worker reuses the numbers of finished jobs).
    fn reset(&mut self, job: usize) {
        if self.jobs.len() <= job {
            self.jobs.resize_with(job + 1, Default::default);
        }
        self.jobs[job] = Default::default();
    }

    /// Job `job`'s failed keys, leaving none.
    fn take(&mut self, job: usize) -> Vec<FailedKey> {
        std::mem::take(&mut self.jobs[job]).0
    }

    /// Each job's failed keys, in job order.
    fn into_keys(self) -> impl Iterator<Item = Vec<FailedKey>> {
        self.jobs.into_iter().map(|(keys, _)| keys)
    }
}

/// Aligned buffers kept for reuse (fresh memory is slow to touch), at most `bytes_max` of them.
struct BufPool {
    free: Vec<AlignedBuf>,
    bytes: usize,
    bytes_max: usize,
}

impl BufPool {
    fn get(&mut self, len: usize) -> io::Result<AlignedBuf> {
        let fits = |cap: usize| cap >= len && cap <= len.saturating_mul(2).max(ALIGN);
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| fits(b.capacity()))
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        if let Some(i) = best {
            let buf = self.free.swap_remove(i);
            self.bytes -= buf.capacity();
            return Ok(buf);
        }
        AlignedBuf::try_with_capacity(len)
    }

    fn put(&mut self, mut buf: AlignedBuf) {
        let cap = buf.capacity();
        if cap == 0 || cap > self.bytes_max {
            return;
        }
        while self.bytes + cap > self.bytes_max && !self.free.is_empty() {
            let old = self.free.remove(0);
            self.bytes -= old.capacity();
        }
        buf.clear();
        self.bytes += cap;
        self.free.push(buf);
    }
}

/// A slot's payload range that can move without a bounce buffer (see `Worker::slot_payload`).
struct SlotSpanInfo {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

/// A chunk with the index of its job in the group run together.
type JobChunk = (usize, TierChunk);

/// Runs one batch of the chunks of a group of jobs.
type BatchFn = fn(&mut Worker, &[JobChunk], &mut Failed);

/// A segment this worker appends to.
struct OpenSegment {
    id: SegmentId,
    path: Arc<PathBuf>,
    file: Arc<File>,
    direct: bool,
    /// Where the next record goes (the end of the records written or in flight).
    cursor: u64,
    /// The file's blocks are allocated (and its size set) up to here, so that writes below it
    /// neither extend the file nor fill holes (see `Worker::preallocate`).
    allocated: u64,
    /// The file size of its first record: a fresh segment is allocated for as many records of
    /// that size as it takes, plus the seal (see `Worker::preallocate`).
    first_record: u64,
    /// Takes no further record (full, or a write into it failed); sealed once `records_open`
    /// is 0.
    closed: bool,
    /// Records placed in it whose job has not finished yet.
    records_open: usize,
}

/// A store job the writer runs: its records are placed and their writes in flight.
struct Active {
    id: JobId,
    /// Every key of the job (failed as a whole if the writer panics).
    keys: Vec<ChunkKey>,
    failed: Failed,
    /// Records placed; the job finishes when as many writes completed.
    records: usize,
    written: Vec<Written>,
    /// Record bytes, counted in the writer's bytes in flight.
    bytes: u64,
}

/// A load job a load worker runs: its reads are in flight (or about to be submitted again).
struct ActiveLoad {
    id: JobId,
    /// Every key of the job (failed as a whole if the worker panics).
    keys: Vec<ChunkKey>,
    /// Record bytes, counted in the worker's load bytes in flight.
    bytes: u64,
}

/// One record's file operation in flight (or, with `members`, one read of several neighbouring
/// records).
struct Pending {
    /// The index of the record's job in the group run together (a load worker's pipelined
    /// load: the job's number).
    job: usize,
    key: ChunkKey,
    slot: SlotId,
    len: u32,
    /// Record bytes (header and padding included).
    bytes: u64,
    /// The record's offset in its segment.
    offset: u64,
    /// Store: the segment (in the worker's `segments`). Load: unused.
    segment: SegmentId,
    /// Load: where the record is.
    location: Option<Location>,
    /// Kept open until the operation's completion is reaped.
    file: Arc<File>,
    direct: bool,
    retried: bool,
    /// A fault to apply when the read completes (corruption of the buffer).
    corrupt_after_read: bool,
    /// The payload moves straight between the slot and the file (the operation's buffer holds
    /// only the header): the operation carries a [`SlotSpan`] of the slot.
    zero_copy: bool,
    /// A merged read: the records it reads, one after another from `offset` (each with its own
    /// key, slot and location; `bytes` is their sum). Empty for a single record.
    members: Vec<Pending>,
}

/// An operation ready to run, a store record whose buffer is filled just before it is
/// submitted, a read whose buffer is taken from the pool just before it is submitted, or one
/// whose injected error stands for its completion.
enum Ready {
    Op(IoOp),
    Fill(AlignedBuf),
    /// A read checked for a buffer of `buf_len()` bytes and carrying none yet, so that only the
    /// reads in flight hold buffers (see [`Worker::read_op_for`]).
    Take(IoOp),
    Injected(io::Error, AlignedBuf),
}

/// What `store_done` and `load_done` are: they take one completed operation and push the
/// operations to retry, if any, onto the last argument.
type CompletionHandler = fn(
    &mut Worker,
    Pending,
    io::Result<usize>,
    AlignedBuf,
    &mut Failed,
    &mut Vec<(Pending, Ready)>,
);

/// The outcome of one record write of a store job.
struct Written {
    /// The writer's number of the job (see `Active`).
    job: usize,
    key: ChunkKey,
    len: u32,
    segment: SegmentId,
    offset: u64,
    bytes: u64,
    /// `None`: written; else why it failed.
    failure: Option<FailureKind>,
}

/// One worker: runs jobs on its own thread with its own I/O engine.
pub(crate) struct Worker {
    engine: Box<dyn IoEngine>,
    memory: Arc<dyn SlotMemory>,
    shared: Arc<Shared>,
    settings: WorkerSettings,
    pool: BufPool,
    next_tag: u64,
    /// Segments being appended: the last one is the open segment; earlier ones (and a closed
    /// last one) are sealed once every job with a record in them finished.
    segments: Vec<OpenSegment>,
    /// Record writes completed and not yet handed to their job.
    written: Vec<Written>,
    /// Store jobs started and not finished, by the writer's number.
    active: HashMap<usize, Active>,
    /// The writer's number of the next store job.
    next_active: usize,
    /// Record bytes of the active store jobs.
    active_bytes: u64,
    /// Store writes in flight, by tag.
    store_ops: HashMap<u64, Pending>,
    /// Completions of finished store jobs, not yet sent.
    finished: Vec<TierCompletion>,
    /// The store job being finished (out of `active`, its completion not pushed yet).
    finishing: Option<(JobId, Vec<ChunkKey>)>,
    /// Read descriptors by segment, with whether they use O_DIRECT.
    readers: HashMap<SegmentId, (Arc<File>, bool)>,
    /// Load jobs a load worker runs at once, by number (`Pending::job` of their reads); a
    /// finished job's number is reused.
    loads: Vec<Option<ActiveLoad>>,
    /// The failed keys of the running load jobs, by number.
    load_failed: Failed,
    /// Record bytes of the running load jobs.
    load_bytes: u64,
    /// Reads of the running load jobs in flight, by tag.
    load_ops: HashMap<u64, Pending>,
    /// Record bytes of `load_ops`.
    load_ops_bytes: u64,
    /// Reads of the running load jobs prepared but not submitted yet (see
    /// [`LOAD_READ_BYTES_IN_FLIGHT_MAX`]), in submission order.
    load_queue: VecDeque<(Pending, Ready)>,
    /// Reap errors in a row while load reads are in flight.
    load_reap_errors: u32,
    /// Store batches preallocate their range (until the file system says it cannot).
    preallocate: bool,
    /// The writer's seals and next segment, off its thread (started by `run_writer`).
    housekeeper: Option<housekeep::Housekeeper>,
}

fn failure_of(error: &io::Error) -> FailureKind {
    match io_kind(error) {
        FsErrorKind::NoSpace => FailureKind::NoSpace,
        _ => FailureKind::Io,
    }
}

impl Worker {
    pub(crate) fn new(
        engine: Box<dyn IoEngine>,
        memory: Arc<dyn SlotMemory>,
        shared: Arc<Shared>,
        settings: WorkerSettings,
    ) -> Self {
        let preallocate = !settings.shared_dir;
        let pool = BufPool {
            free: Vec::new(),
            bytes: 0,
            bytes_max: settings.batch_bytes_max,
        };
        Self {
            engine,
            memory,
            shared,
            settings,
            pool,
            next_tag: 0,
            segments: Vec::new(),
            written: Vec::new(),
            active: HashMap::new(),
            next_active: 0,
            active_bytes: 0,
            store_ops: HashMap::new(),
            finished: Vec::new(),
            finishing: None,
            readers: HashMap::new(),
            loads: Vec::new(),
            load_failed: Failed::default(),
            load_bytes: 0,
            load_ops: HashMap::new(),
            load_ops_bytes: 0,
            load_queue: VecDeque::new(),
            load_reap_errors: 0,
            preallocate,
            housekeeper: None,
        }
    }

    /// Stores are synced (`Durability::Fsync`).
    fn durable(&self) -> bool {
        self.settings.durability == Durability::Fsync
    }

    /// The completions of `group`, whose runs are over, with their failed keys.
    fn completions(&self, group: &[TierJob], failed: Failed) -> Vec<TierCompletion> {
        let mut cancelled = self.shared.cancelled();
        group
            .iter()
            .zip(failed.into_keys())
            .map(|(job, failed)| {
                cancelled.remove(&job.id);
                TierCompletion { id: job.id, failed }
            })
            .collect()
    }

    /// Reports a broken invariant of the worker at the I/O edge (design.md section 4): panics in
    /// strict mode; otherwise counts it in `invariant_failures`, logs it and returns, and the
    /// caller fails the chunk (the engine recomputes it) without touching its slot.
    #[track_caller]
    fn broken(&self, what: std::fmt::Arguments<'_>) {
        add(&self.stats().invariant_failures, 1);
        let message = format!("tier-fs worker: {what}");
        warn(
            self.stats(),
            self.settings.quiet,
            &format!("broken invariant: {message}"),
        );
        invariant::broken(self.settings.strict, format_args!("{message}"));
    }

    /// A completion whose tag names no operation in flight (unknown, or reaped twice): a broken
    /// invariant of the engine; the completion is dropped.
    #[track_caller]
    fn unknown_tag(&self, tag: u64, what: &str) {
        self.broken(format_args!(
            "a completion's tag {tag} names no {what} in flight (unknown or reaped twice)"
        ));
    }

    fn stats(&self) -> &StatsCell {
        &self.shared.stats
    }

    fn is_cancelled(&self, id: JobId) -> bool {
        self.shared.cancelled().contains(&id)
    }

    /// Whether this instance may write into the segment at `path`: every segment in a private
    /// directory, only its own in a shared one.
    fn may_modify(&self, path: &std::path::Path) -> bool {
        if !self.settings.shared_dir {
            return true;
        }
        let own = format!("{:016x}-", self.shared.instance);
        path.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&own))
    }

    // ---------------------------------------------------------------- engine

    /// Whether files are opened with O_DIRECT now.
    fn direct(&self) -> bool {
        self.shared.stats.direct_io.load(Ordering::Relaxed)
    }

    fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        self.next_tag
    }

    /// Switches this root to buffered I/O (once, with one warning).
    fn fall_back(&mut self, what: &str) {
        let stats = &self.shared.stats;
        if !stats.direct_io.swap(false, Ordering::Relaxed) {
            return;
        }
        add(&stats.direct_fallbacks, 1);
        warn(
            stats,
            self.settings.quiet,
            &format!(
                "O_DIRECT refused ({what}); {:?} switches to buffered I/O",
                self.settings.layout.dir()
            ),
        );
    }
}

/// The length of an injected short transfer: one alignment unit less, or half.
fn short_len(len: usize) -> usize {
    if len > ALIGN {
        len - ALIGN
    } else {
        len / 2
    }
}

/// Flips one payload byte of a file image (a header byte for an empty payload).
fn flip_payload_byte(image: &mut [u8], payload_len: u32) {
    let at = if payload_len == 0 {
        20
    } else {
        HEADER_BYTES + payload_len as usize / 2
    };
    image[at] ^= 0x5A;
}

/// The kernel error an injected fault stands for.
fn fault_error(fault: Fault) -> io::Error {
    fault
        .os_error()
        .unwrap_or_else(|| io::Error::other(format!("injected {fault:?}")))
}

/// Releases the space of records written but not indexed and of the open segments' seals, and
/// leaves those segments unsealed (evictable; the next start verifies and seals them).
fn give_up_segments(
    written: &mut Vec<Written>,
    segments: &mut Vec<OpenSegment>,
    index: &mut Index,
) {
    for w in written.drain(..) {
        index.release(w.bytes);
    }
    for seg in segments.drain(..) {
        index.release(SEAL_BYTES);
        index.set_state(seg.id, SegmentState::Sealed);
    }
}

/// A worker's next message: waited for if it is `idle`, else one already queued. `None`: nothing
/// is queued (only when not idle); `Some(None)`: the channel is closed.
fn next_msg(jobs: &Receiver<Msg>, idle: bool) -> Option<Option<Msg>> {
    if idle {
        return Some(jobs.recv().ok());
    }
    match jobs.try_recv() {
        Ok(msg) => Some(Some(msg)),
        Err(crossbeam_channel::TryRecvError::Empty) => None,
        Err(crossbeam_channel::TryRecvError::Disconnected) => Some(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NamespaceId;
    use crate::io::sync::SyncEngine;
    use tier_testkit::VecSlotMemory;

    const SLOT_BYTES: usize = 64 << 10;

    fn key(n: u64) -> ChunkKey {
        ChunkKey::new(
            u128::from(n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x77) << 64 | u128::from(n),
            0,
        )
    }

    fn worker(dir: &std::path::Path, shared: &Arc<Shared>, memory: &Arc<VecSlotMemory>) -> Worker {
        // Threads for every job's (merged) read at once.
        let engine = Box::new(SyncEngine::new(8).unwrap());
        worker_with(dir, shared, memory, engine, true)
    }

    fn worker_with(
        dir: &std::path::Path,
        shared: &Arc<Shared>,
        memory: &Arc<VecSlotMemory>,
        engine: Box<dyn IoEngine>,
        strict: bool,
    ) -> Worker {
        let namespace = NamespaceId {
            model: "worker-test".into(),
            dtype: "bf16".into(),
            tokens_per_chunk: 16,
            parallel_layout: "tp1".into(),
        };
        let layout = Layout::new(dir, &namespace);
        std::fs::create_dir_all(layout.dir()).unwrap();
        let settings = WorkerSettings {
            layout,
            durability: Durability::None,
            quiet: true,
            batch_bytes_max: 32 << 20,
            segment_bytes: 16 << 20,
            shared_dir: false,
            zero_copy_loads: false,
            strict,
        };
        let memory: Arc<dyn SlotMemory> = Arc::clone(memory) as Arc<dyn SlotMemory>;
        Worker::new(engine, memory, Arc::clone(shared), settings)
    }

    /// An engine whose completions come back under another tag than their operation's (a
    /// broken engine): every tag is shifted by 2^62.
    struct ShiftedTags(SyncEngine);

    impl IoEngine for ShiftedTags {
        fn name(&self) -> &'static str {
            "shifted-tags"
        }
        fn submit(&mut self, ops: Vec<IoOp>) -> Result<(), (io::Error, Vec<IoOp>)> {
            self.0.submit(ops)
        }
        fn reap(&mut self, out: &mut Vec<crate::io::IoCompletion>, min: usize) -> io::Result<()> {
            let from = out.len();
            self.0.reap(out, min)?;
            for c in &mut out[from..] {
                c.tag ^= 1 << 62;
            }
            Ok(())
        }
        fn in_flight(&self) -> usize {
            self.0.in_flight()
        }
        fn parallel_max(&self) -> usize {
            self.0.parallel_max()
        }
    }

    /// The panic message of `f`, or `None` if it returned.
    fn panic_of<T>(f: impl FnOnce() -> T) -> Option<String> {
        let payload = catch_unwind(AssertUnwindSafe(f)).err()?;
        let text = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()));
        Some(text.unwrap_or_default())
    }

    fn invariant_failures(shared: &Shared) -> u64 {
        shared.stats.snapshot("test").invariant_failures
    }

    /// A stand-alone read of `len` payload bytes of `key` into `slot` at `offset` of `file`.
    fn pending(file: &Arc<File>, key: ChunkKey, slot: u32, len: u32, offset: u64) -> Pending {
        Pending {
            job: 0,
            key,
            slot: SlotId(slot),
            len,
            bytes: file_bytes(u64::from(len)),
            offset,
            segment: SegmentId(0),
            location: None,
            file: Arc::clone(file),
            direct: true,
            retried: false,
            corrupt_after_read: false,
            zero_copy: false,
            members: Vec::new(),
        }
    }

    /// A completion whose tag names no read in flight fails its chunk (the slot keeps its
    /// bytes) and is counted in lenient mode; strict mode panics naming the invariant.
    #[test]
    fn a_completion_under_an_unknown_tag_fails_its_chunk_or_panics_when_strict() {
        let dir = tempfile::tempdir().unwrap();
        let memory = Arc::new(VecSlotMemory::new(4, SLOT_BYTES));
        let shared = Arc::new(Shared::new(1 << 30, &FaultPlan::default(), 1));
        memory.fill(SlotId(0), SLOT_BYTES, 7);
        memory.fill(SlotId(1), SLOT_BYTES, 8);
        let stored = worker(dir.path(), &shared, &memory).run_group(&[job(
            1,
            TierOp::Store,
            vec![(key(1), SlotId(0), SLOT_BYTES as u32)],
        )]);
        assert!(stored.iter().all(|c| c.is_success()), "{stored:?}");
        let load = job(
            2,
            TierOp::Load,
            vec![(key(1), SlotId(1), SLOT_BYTES as u32)],
        );

        let engine = Box::new(ShiftedTags(SyncEngine::new(2).unwrap()));
        let mut lenient = worker_with(dir.path(), &shared, &memory, engine, false);
        let done = lenient.run_group(std::slice::from_ref(&load));
        assert_eq!(done.len(), 1, "{done:?}");
        assert_eq!(done[0].failed_keys().collect::<Vec<_>>(), vec![key(1)]);
        assert_eq!(invariant_failures(&shared), 1);
        assert_eq!(
            memory.contents(SlotId(1)),
            tier_testkit::pattern(8, SLOT_BYTES)
        );

        let engine = Box::new(ShiftedTags(SyncEngine::new(2).unwrap()));
        let mut strict = worker_with(dir.path(), &shared, &memory, engine, true);
        let message = panic_of(|| strict.run_group(std::slice::from_ref(&load)));
        let message = message.expect("strict mode panics");
        assert!(
            message.contains("names no operation in flight"),
            "{message}"
        );
    }

    /// An O_DIRECT operation at an offset that is not a multiple of ALIGN, one longer than its
    /// record, and a zero-copy span outside its slot are never submitted: lenient mode counts
    /// each and fails the operation; strict mode panics naming the invariant.
    #[test]
    fn a_misplanned_operation_is_never_submitted() {
        let dir = tempfile::tempdir().unwrap();
        let memory = Arc::new(VecSlotMemory::new(2, SLOT_BYTES));
        let shared = Arc::new(Shared::new(1 << 30, &FaultPlan::default(), 1));
        let file = Arc::new(File::create(dir.path().join("f")).unwrap());
        let mut lenient = worker(dir.path(), &shared, &memory);
        lenient.settings.strict = false;
        let misaligned = pending(&file, key(1), 0, SLOT_BYTES as u32, 100);
        let too_long = pending(&file, key(2), 0, SLOT_BYTES as u32, 0);
        let bytes = too_long.bytes as usize;
        let mut outside = vec![0u8; ALIGN];
        // SAFETY: the span is never submitted (the check refuses it) and `outside` outlives it.
        let span =
            unsafe { SlotSpan::new(std::ptr::NonNull::new(outside.as_mut_ptr()).unwrap(), ALIGN) };
        let cases: Vec<(Pending, usize, Option<SlotSpan>, &str)> = vec![
            (misaligned, bytes, None, "O_DIRECT offset"),
            (too_long, bytes + ALIGN, None, "for a record of"),
            (
                pending(&file, key(3), 0, ALIGN as u32, 0),
                HEADER_BYTES + ALIGN,
                Some(span),
                "outside slot",
            ),
        ];
        for (n, (p, len, span, what)) in cases.into_iter().enumerate() {
            let buf = AlignedBuf::with_capacity(bytes + ALIGN);
            let ready = lenient.op_for(OpKind::Read, &p, len, buf, span);
            let Ready::Injected(error, _) = ready else {
                panic!("case {what}: submitted");
            };
            assert!(error.to_string().contains(what), "{error}");
            assert_eq!(invariant_failures(&shared), n as u64 + 1);
        }
        let mut strict = worker(dir.path(), &shared, &memory);
        let p = pending(&file, key(1), 0, SLOT_BYTES as u32, 100);
        let buf = AlignedBuf::with_capacity(bytes);
        let message = panic_of(|| strict.op_for(OpKind::Read, &p, bytes, buf, None));
        let message = message.expect("strict mode panics");
        assert!(
            message.contains("invariant broken") && message.contains("O_DIRECT"),
            "{message}"
        );
    }

    /// A verified record whose payload would not fit its slot, or whose header names another
    /// key than the job asked for, is never copied: lenient mode counts it and fails the key
    /// (the slot keeps its bytes); strict mode panics naming the invariant.
    #[test]
    fn a_load_copy_past_its_slot_or_of_another_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let memory = Arc::new(VecSlotMemory::new(2, SLOT_BYTES));
        let shared = Arc::new(Shared::new(1 << 30, &FaultPlan::default(), 1));
        memory.fill(SlotId(0), SLOT_BYTES, 9);
        let file = Arc::new(File::create(dir.path().join("f")).unwrap());
        let over = (SLOT_BYTES + ALIGN) as u32;
        let p = pending(&file, key(1), 0, over, 0);
        let mut image = vec![0u8; p.bytes as usize];
        encode_into(&mut image, key(1), over as usize, |b| b.fill(3));

        let mut lenient = worker(dir.path(), &shared, &memory);
        lenient.settings.strict = false;
        let mut failed = Failed::new(1);
        lenient.verify_image(&p, &image, &mut failed);
        let failed_keys: Vec<_> = failed.take(0).into_iter().map(|f| f.key).collect();
        assert_eq!(failed_keys, vec![key(1)]);
        assert_eq!(invariant_failures(&shared), 1);
        assert_eq!(
            memory.contents(SlotId(0)),
            tier_testkit::pattern(9, SLOT_BYTES)
        );
        // The header of another key (verification would refuse it: the check stands behind).
        let other = pending(&file, key(2), 0, over, 0);
        assert!(!lenient.verified_fits(&other, &image, over as usize));
        assert_eq!(invariant_failures(&shared), 2);

        let mut strict = worker(dir.path(), &shared, &memory);
        let message = panic_of(|| strict.verify_image(&p, &image, &mut Failed::new(1)));
        let message = message.expect("strict mode panics");
        assert!(message.contains("load copy"), "{message}");
        let message = panic_of(|| strict.verified_fits(&other, &image, over as usize));
        assert!(message
            .expect("strict mode panics")
            .contains("not the requested key"));
    }

    fn job(id: u64, op: TierOp, chunks: Vec<(ChunkKey, SlotId, u32)>) -> TierJob {
        TierJob {
            id: JobId(id),
            request: None,
            op,
            chunks: chunks
                .into_iter()
                .map(|(key, slot, len)| TierChunk::new(key, slot, len))
                .collect(),
        }
    }

    /// Eight load jobs queued at once run as one pipeline on one load worker: each starts while
    /// the others' reads are in flight (`loads_overlapped`), and each completes exactly once,
    /// with its own failed keys (a key never stored) and every loaded slot holding its bytes.
    #[test]
    fn one_load_worker_runs_queued_load_jobs_together_and_finishes_each() {
        let dir = tempfile::tempdir().unwrap();
        let memory = Arc::new(VecSlotMemory::new(64, SLOT_BYTES));
        let shared = Arc::new(Shared::new(1 << 30, &FaultPlan::default(), 1));
        for n in 0..16u32 {
            memory.fill(SlotId(n), SLOT_BYTES, 500 + u64::from(n));
        }
        let chunks = (0..16u32)
            .map(|n| (key(u64::from(n)), SlotId(n), SLOT_BYTES as u32))
            .collect();
        let mut writer = worker(dir.path(), &shared, &memory);
        let stored = writer.run_group(&[job(1, TierOp::Store, chunks)]);
        assert!(stored.iter().all(|c| c.is_success()), "{stored:?}");

        // Job j loads chunks 2j and 2j+1 into slots 32+2j and 33+2j; job 3 also asks for a
        // key never stored.
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded();
        for j in 0..8u32 {
            let mut chunks: Vec<_> = (2 * j..2 * j + 2)
                .map(|n| (key(u64::from(n)), SlotId(32 + n), SLOT_BYTES as u32))
                .collect();
            if j == 3 {
                chunks.push((key(99), SlotId(63), SLOT_BYTES as u32));
            }
            jobs_tx
                .send(Msg::Job(job(100 + u64::from(j), TierOp::Load, chunks)))
                .unwrap();
        }
        jobs_tx.send(Msg::Stop).unwrap();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let loader = worker(dir.path(), &shared, &memory);
        let running = std::thread::spawn(move || loader.run(jobs_rx, done_tx));
        // A job's slots hold their bytes by the time its completion is sent.
        let mut done = Vec::new();
        for c in done_rx.iter() {
            let j = (c.id.0 - 100) as u32;
            for n in 2 * j..2 * j + 2 {
                assert!(
                    memory.matches(SlotId(32 + n), SLOT_BYTES, 500 + u64::from(n)),
                    "slot {} differs when job {:?} completed",
                    32 + n,
                    c.id
                );
            }
            done.push(c);
        }
        running.join().unwrap();
        done.sort_by_key(|c| c.id);
        let ids: Vec<_> = done.iter().map(|c| c.id.0).collect();
        assert_eq!(ids, (100..108).collect::<Vec<_>>());
        for c in &done {
            let expected = if c.id == JobId(103) {
                vec![FailedKey::new(
                    key(99),
                    offload_core::tier::TierFailure::Missing,
                )]
            } else {
                Vec::new()
            };
            assert_eq!(c.failed, expected, "job {:?}", c.id);
        }
        for n in 0..16u32 {
            assert!(
                memory.matches(SlotId(32 + n), SLOT_BYTES, 500 + u64::from(n)),
                "slot {} differs",
                32 + n
            );
        }
        let stats = shared.stats.snapshot("sync");
        assert_eq!(stats.loads_overlapped, 7, "{stats:?}");
        assert_eq!(stats.chunks_loaded, 16, "{stats:?}");
        assert_eq!(stats.failures_of(FailureKind::Missing), 1, "{stats:?}");
    }

    /// An engine that counts the read bytes it holds at once (a read's `len`, from its submit to
    /// its completion being reaped), to check what the load worker keeps in flight.
    struct CountingReads {
        inner: SyncEngine,
        lens: HashMap<u64, u64>,
        now: u64,
        most: Arc<std::sync::atomic::AtomicU64>,
    }

    impl IoEngine for CountingReads {
        fn name(&self) -> &'static str {
            "counting-reads"
        }
        fn submit(&mut self, ops: Vec<IoOp>) -> Result<(), (io::Error, Vec<IoOp>)> {
            for op in ops.iter().filter(|op| op.kind == OpKind::Read) {
                self.lens.insert(op.tag, op.len as u64);
                self.now += op.len as u64;
            }
            self.most
                .fetch_max(self.now, std::sync::atomic::Ordering::Relaxed);
            self.inner.submit(ops)
        }
        fn reap(&mut self, out: &mut Vec<crate::io::IoCompletion>, min: usize) -> io::Result<()> {
            let from = out.len();
            self.inner.reap(out, min)?;
            for c in &out[from..] {
                self.now -= self.lens.remove(&c.tag).unwrap_or(0);
            }
            Ok(())
        }
        fn in_flight(&self) -> usize {
            self.inner.in_flight()
        }
        fn parallel_max(&self) -> usize {
            self.inner.parallel_max()
        }
    }

    /// A load job whose reads add up to far more than [`LOAD_READ_BYTES_IN_FLIGHT_MAX`] keeps
    /// at most that much (or one read) at the disk, the rest waiting in the worker's queue
    /// without a buffer, and still loads every chunk byte for byte.
    #[test]
    fn a_large_load_keeps_its_reads_in_flight_under_the_cap_and_loads_every_byte() {
        const CHUNK: usize = 1 << 20;
        const CHUNKS: u32 = 24;
        let dir = tempfile::tempdir().unwrap();
        let memory = Arc::new(VecSlotMemory::new(2 * CHUNKS, CHUNK));
        let shared = Arc::new(Shared::new(1 << 30, &FaultPlan::default(), 1));
        for n in 0..CHUNKS {
            memory.fill(SlotId(n), CHUNK, 900 + u64::from(n));
        }
        let stored: Vec<_> = (0..CHUNKS)
            .map(|n| (key(u64::from(n)), SlotId(n), CHUNK as u32))
            .collect();
        let mut writer = worker(dir.path(), &shared, &memory);
        let done = writer.run_group(&[job(1, TierOp::Store, stored)]);
        assert!(done.iter().all(|c| c.is_success()), "{done:?}");

        // Every other chunk first, then the rest: reads both merged and not.
        let order = (0..CHUNKS).step_by(2).chain((1..CHUNKS).step_by(2));
        let chunks = order
            .map(|n| (key(u64::from(n)), SlotId(CHUNKS + n), CHUNK as u32))
            .collect();
        let most = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let engine = Box::new(CountingReads {
            inner: SyncEngine::new(8).unwrap(),
            lens: HashMap::new(),
            now: 0,
            most: Arc::clone(&most),
        });
        let loader = worker_with(dir.path(), &shared, &memory, engine, true);
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded();
        jobs_tx
            .send(Msg::Job(job(2, TierOp::Load, chunks)))
            .unwrap();
        jobs_tx.send(Msg::Stop).unwrap();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        loader.run(jobs_rx, done_tx);
        let done: Vec<_> = done_rx.iter().collect();
        assert_eq!(done.len(), 1, "{done:?}");
        assert!(done[0].is_success(), "{done:?}");
        for n in 0..CHUNKS {
            assert!(
                memory.matches(SlotId(CHUNKS + n), CHUNK, 900 + u64::from(n)),
                "slot {} differs",
                CHUNKS + n
            );
        }
        let most = most.load(std::sync::atomic::Ordering::Relaxed);
        let largest_read = READ_MERGE_BYTES_MAX.max(file_bytes(CHUNK as u64));
        assert!(most > 0, "no read was counted");
        assert!(
            most <= LOAD_READ_BYTES_IN_FLIGHT_MAX.max(largest_read),
            "{most} read bytes in flight at once"
        );
        assert!(
            most < u64::from(CHUNKS) * file_bytes(CHUNK as u64),
            "every read went out at once ({most} bytes)"
        );
    }
}
