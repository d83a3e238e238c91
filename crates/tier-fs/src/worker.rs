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
//! lie one after another in a segment with one read of all of them, at most 16 MiB), verify header
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

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use offload_core::tier::{FailedKey, SlotMemory, TierChunk, TierCompletion, TierJob, TierOp};
use offload_core::{ChunkKey, JobId, SlotId};

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
/// The most bytes one merged read of neighbouring records moves.
const READ_MERGE_BYTES_MAX: u64 = 16 << 20;

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
/// submitted, or one whose injected error stands for its completion.
enum Ready {
    Op(IoOp),
    Fill(AlignedBuf),
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
    /// Reap errors in a row while load reads are in flight.
    load_reap_errors: u32,
    /// Store batches preallocate their range (until the file system says it cannot).
    preallocate: bool,
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
            load_reap_errors: 0,
            preallocate,
        }
    }

    /// A load worker's loop: runs load jobs as a pipeline. It starts every queued load job
    /// while the record bytes of the jobs it runs stay under `batch_bytes_max` (their reads go
    /// out at once, merged where records lie one after another), reaps reads as they complete
    /// (verifying each record and copying it into its slot), and finishes each job as soon as
    /// all of its reads completed. So one worker keeps the disk busy with several jobs' reads,
    /// and the other load workers wait on the channel instead of each running one job: no more
    /// threads are busy than the load needs. Waits for a job only when nothing is in flight. A
    /// job too large to run beside others (over `batch_bytes_max`, or [`BATCH_OPS_MAX`]
    /// records) runs alone, batch by batch, after the jobs in flight finished; so does a store
    /// job (which the tier sends to the writer). Returns after `Stop` (or the front end is
    /// gone) and every job it took finished.
    pub(crate) fn run(mut self, jobs: Receiver<Msg>, done: Sender<TierCompletion>) {
        let mut open = true;
        loop {
            let step = catch_unwind(AssertUnwindSafe(|| {
                if open {
                    open = self.take_loads(&jobs);
                }
                // Completions ready go out before the worker waits for more reads.
                if self.finished.is_empty() && self.loads_running() > 0 {
                    self.load_step();
                }
            }));
            if step.is_err() {
                self.loader_panicked();
            }
            let finished = std::mem::take(&mut self.finished);
            if finished.into_iter().any(|c| done.send(c).is_err()) {
                break;
            }
            if !open && self.loads_running() == 0 {
                break;
            }
        }
        self.seal_all();
    }

    /// Starts queued load jobs: waits for one if the worker has nothing to do, else takes those
    /// already queued while the running jobs' record bytes stay under `batch_bytes_max` and
    /// their reads in flight under what the engine runs at once (a sync engine's threads: the
    /// jobs beyond are left to the other load workers), returning early when completions are
    /// ready to send. Returns false once the channel says stop.
    fn take_loads(&mut self, jobs: &Receiver<Msg>) -> bool {
        loop {
            let idle = self.loads_running() == 0 && self.finished.is_empty();
            let full = self.load_bytes >= self.settings.batch_bytes_max as u64
                || self.load_ops.len() >= self.engine.parallel_max();
            if !idle && (full || !self.finished.is_empty()) {
                return true;
            }
            let Some(msg) = next_msg(jobs, idle) else {
                return true;
            };
            match msg {
                Some(Msg::Job(job)) => self.start_load(job),
                Some(Msg::Stop) | None => return false,
            }
        }
    }

    /// Number of load jobs the worker runs.
    fn loads_running(&self) -> usize {
        self.loads.iter().filter(|l| l.is_some()).count()
    }

    /// Starts load job `job` beside the running ones: its reads are prepared, merged and
    /// submitted (after enough running jobs finished to keep the record bytes under
    /// `batch_bytes_max` and the reads under [`BATCH_OPS_MAX`]). A job too large for that, or
    /// a store job, runs alone once nothing else is in flight.
    fn start_load(&mut self, job: TierJob) {
        let bytes: u64 = job
            .chunks
            .iter()
            .map(|&TierChunk { len, .. }| file_bytes(u64::from(len)))
            .fold(0, u64::saturating_add);
        let budget = self.settings.batch_bytes_max as u64;
        if job.op != TierOp::Load || bytes > budget || job.chunks.len() > BATCH_OPS_MAX {
            while self.loads_running() > 0 {
                self.load_step();
            }
            self.run_alone(job);
            return;
        }
        while self.loads_running() > 0
            && (self.load_bytes + bytes > budget
                || self.load_ops.len() + job.chunks.len() > BATCH_OPS_MAX)
        {
            self.load_step();
        }
        if self.loads_running() > 0 {
            add(&self.stats().loads_overlapped, 1);
        }
        let n = match self.loads.iter().position(Option::is_none) {
            Some(n) => n,
            None => {
                self.loads.push(None);
                self.loads.len() - 1
            }
        };
        self.loads[n] = Some(ActiveLoad {
            id: job.id,
            keys: job
                .chunks
                .iter()
                .map(|&TierChunk { key, .. }| key)
                .collect(),
            bytes,
        });
        self.load_failed.reset(n);
        self.load_bytes += bytes;
        if self.is_cancelled(job.id) {
            for &TierChunk { key, .. } in &job.chunks {
                self.load_failed
                    .add(&self.shared.stats, n, key, FailureKind::Cancelled);
            }
        } else {
            self.prune_readers();
            let mut items = Vec::with_capacity(job.chunks.len());
            for &TierChunk { key, slot, len } in &job.chunks {
                match self.prepare_load(n, key, slot, len) {
                    Ok(item) => items.push(item),
                    Err(kind) => self.load_failed.add(&self.shared.stats, n, key, kind),
                }
            }
            let items = self.merge_reads(items);
            self.submit_loads(items);
        }
        self.finish_loads();
    }

    /// Runs `job` alone (loads batch by batch) and queues its completion; a panic fails its keys.
    fn run_alone(&mut self, job: TierJob) {
        let group = [job];
        let completions = catch_unwind(AssertUnwindSafe(|| self.run_group(&group)))
            .unwrap_or_else(|_| self.panicked(&group));
        self.finished.extend(completions);
    }

    /// Submits reads of the running load jobs; handles at once those that complete without the
    /// engine (injected errors, refused submissions).
    fn submit_loads(&mut self, items: Vec<(Pending, Ready)>) {
        if items.is_empty() {
            return;
        }
        let mut results = Vec::new();
        let mut waiting = std::mem::take(&mut self.load_ops);
        self.fill_and_submit(items, &mut waiting, &mut results);
        self.load_ops = waiting;
        self.loads_done(results);
    }

    /// Hands completed reads of the running load jobs to `load_done` (verify, copy into the
    /// slot) and submits the reads it asks to retry.
    fn loads_done(&mut self, results: Vec<(Pending, io::Result<usize>, AlignedBuf)>) {
        let mut failed = std::mem::take(&mut self.load_failed);
        let mut retries = Vec::new();
        for (pending, result, buf) in results {
            self.load_done(pending, result, buf, &mut failed, &mut retries);
        }
        self.load_failed = failed;
        self.submit_loads(retries);
    }

    /// Reaps at least one read of the running load jobs (waiting for it), handles what was
    /// reaped, and finishes the jobs whose reads all completed.
    fn load_step(&mut self) {
        let mut reaped = Vec::new();
        if self.engine.in_flight() > 0 {
            if self.engine.reap(&mut reaped, 1).is_err() {
                self.load_reap_errors += 1;
                // A read into a slot owns it until reaped: never give up on those.
                let into_slot = self.load_ops.values().any(|p| p.zero_copy);
                if self.load_reap_errors <= REAP_ERRORS_MAX || into_slot {
                    std::thread::sleep(Duration::from_millis(1));
                } else {
                    self.give_up_load_ops();
                }
            } else {
                self.load_reap_errors = 0;
            }
        } else {
            // Nothing in flight, yet reads are waiting: the engine lost them.
            self.give_up_load_ops();
        }
        let results: Vec<_> = reaped
            .into_iter()
            .filter_map(|c| {
                let pending = self.load_ops.remove(&c.tag)?;
                Some((pending, c.result, c.buf))
            })
            .collect();
        self.loads_done(results);
        self.finish_loads();
    }

    /// Fails the reads of the running load jobs that the engine still holds (or lost). The
    /// engine may still use their descriptors: a reference to each is leaked so that its
    /// number is not reused.
    fn give_up_load_ops(&mut self) {
        let lost: Vec<_> = self.load_ops.drain().map(|(_, p)| p).collect();
        let stats = &self.shared.stats;
        for pending in lost {
            std::mem::forget(Arc::clone(&pending.file));
            let members = if pending.members.is_empty() {
                vec![(pending.job, pending.key)]
            } else {
                pending.members.iter().map(|m| (m.job, m.key)).collect()
            };
            for (job, key) in members {
                self.load_failed.add(stats, job, key, FailureKind::Io);
            }
        }
    }

    /// Finishes the running load jobs none of whose reads is in flight: their completions
    /// are queued and their bytes leave the budget.
    fn finish_loads(&mut self) {
        for n in 0..self.loads.len() {
            if self.loads[n].is_none() || self.load_ops.values().any(|p| p.job == n) {
                continue;
            }
            let Some(load) = self.loads[n].take() else {
                continue;
            };
            self.load_bytes -= load.bytes;
            let failed = self.load_failed.take(n);
            self.shared.cancelled().remove(&load.id);
            self.finished.push(TierCompletion {
                id: load.id,
                failed,
            });
        }
    }

    /// After a panic in the load pipeline: reaps every read in flight (some may move bytes
    /// into slots), then fails every key of the running load jobs.
    fn loader_panicked(&mut self) {
        let mut reaped = Vec::new();
        while self.engine.in_flight() > 0 {
            if self.engine.reap(&mut reaped, 1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            reaped.clear();
        }
        self.load_ops.clear();
        for n in 0..self.loads.len() {
            let Some(load) = self.loads[n].take() else {
                continue;
            };
            let mut failed = Failed::new(1);
            for &key in &load.keys {
                failed.add(&self.shared.stats, 0, key, FailureKind::Io);
            }
            self.shared.cancelled().remove(&load.id);
            self.finished.push(TierCompletion {
                id: load.id,
                failed: failed.take(0),
            });
        }
        self.load_bytes = 0;
    }

    /// The writer's loop: runs store jobs as one pipeline of appends to its open segment. It
    /// starts every queued job (while the record bytes of the jobs it runs stay under
    /// `batch_bytes_max`), reaps writes as they complete, and finishes each job as soon as all
    /// of its writes completed, so the disk always has the next jobs' writes queued. Waits for a
    /// job only when nothing is in flight. Returns after `Stop` (or the front end is gone) and
    /// every job it took finished, sealing its segments.
    pub(crate) fn run_writer(mut self, jobs: Receiver<Msg>, done: Sender<TierCompletion>) {
        let mut open = true;
        loop {
            let step = catch_unwind(AssertUnwindSafe(|| {
                if open {
                    open = self.take_stores(&jobs);
                }
                self.store_step();
            }));
            if step.is_err() {
                self.writer_panicked();
            }
            let finished = std::mem::take(&mut self.finished);
            if finished.into_iter().any(|c| done.send(c).is_err()) {
                break;
            }
            if !open && self.active.is_empty() {
                break;
            }
        }
        self.seal_all();
    }

    /// Starts queued jobs: waits for one if the writer has nothing to do, else takes those
    /// already queued while the running jobs' record bytes stay under `batch_bytes_max`.
    /// Returns false once the channel says stop.
    fn take_stores(&mut self, jobs: &Receiver<Msg>) -> bool {
        loop {
            let idle = self.active.is_empty() && self.finished.is_empty();
            if !idle && self.active_bytes >= self.settings.batch_bytes_max as u64 {
                return true;
            }
            let Some(msg) = next_msg(jobs, idle) else {
                return true;
            };
            match msg {
                Some(Msg::Job(job)) if job.op == TierOp::Store => self.start_store(&job),
                Some(Msg::Job(job)) => {
                    // A load shares the engine: the stores' writes are reaped first.
                    while !self.active.is_empty() {
                        self.store_step();
                    }
                    let completions = self.run_group(&[job]);
                    self.finished.extend(completions);
                }
                Some(Msg::Stop) | None => return false,
            }
        }
    }

    /// The completions of a group of jobs whose run panicked: every key failed. Operations
    /// still in flight are reaped first, since some may move bytes into or from the jobs' slots.
    fn panicked(&mut self, group: &[TierJob]) -> Vec<TierCompletion> {
        let mut reaped = Vec::new();
        while self.engine.in_flight() > 0 {
            if self.engine.reap(&mut reaped, 1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            // Only the memory matters here; the records are given up below.
            reaped.clear();
        }
        let mut failed = Failed::new(group.len());
        for (j, job) in group.iter().enumerate() {
            for &TierChunk { key, .. } in &job.chunks {
                failed.add(self.stats(), j, key, FailureKind::Io);
            }
        }
        // Whatever the batch wrote is not indexed, and writes may still be in flight: its
        // segments are given up unsealed (evictable; the next start verifies and seals them).
        let shared = Arc::clone(&self.shared);
        give_up_segments(&mut self.written, &mut self.segments, &mut shared.index());
        self.completions(group, failed)
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

    fn stats(&self) -> &StatsCell {
        &self.shared.stats
    }

    fn is_cancelled(&self, id: JobId) -> bool {
        self.shared.cancelled().contains(&id)
    }

    /// Runs a group of jobs of one kind (stores, or a single load) and returns their completions.
    fn run_group(&mut self, group: &[TierJob]) -> Vec<TierCompletion> {
        let mut failed = Failed::new(group.len());
        match group[0].op {
            TierOp::Store => {
                // Alone: started, then run until it finished.
                for job in group {
                    self.start_store(job);
                }
                while !self.active.is_empty() {
                    self.store_step();
                }
                let finished = std::mem::take(&mut self.finished);
                let mut cancelled = self.shared.cancelled();
                for job in group {
                    cancelled.remove(&job.id);
                }
                return finished;
            }
            TierOp::Load => {
                debug_assert_eq!(group.len(), 1, "loads run one job at a time");
                self.load(&group[0], &mut failed);
            }
        }
        self.completions(group, failed)
    }

    /// Splits `chunks` into batches of at most `batch_bytes_max` record bytes (at least one
    /// chunk) and [`BATCH_OPS_MAX`] chunks; returns the end of the batch starting at `start`.
    fn batch_end(&self, chunks: &[JobChunk], start: usize) -> usize {
        let mut bytes = 0u64;
        let mut end = start;
        while end < chunks.len() && end - start < BATCH_OPS_MAX {
            let next = file_bytes(u64::from(chunks[end].1.len));
            if end > start && bytes + next > self.settings.batch_bytes_max as u64 {
                break;
            }
            bytes += next;
            end += 1;
        }
        end
    }

    /// Runs `chunks` (of the jobs `ids`) batch by batch with `each`, failing what remains of a
    /// job once it is cancelled.
    fn batches(
        &mut self,
        ids: &[JobId],
        mut chunks: Vec<JobChunk>,
        failed: &mut Failed,
        each: BatchFn,
    ) {
        while !chunks.is_empty() {
            let cancelled: Vec<bool> = ids.iter().map(|&id| self.is_cancelled(id)).collect();
            if cancelled.iter().any(|&c| c) {
                let stats = &self.shared.stats;
                chunks.retain(|&(j, TierChunk { key, .. })| {
                    if cancelled[j] {
                        failed.add(stats, j, key, FailureKind::Cancelled);
                    }
                    !cancelled[j]
                });
                continue;
            }
            let end = self.batch_end(&chunks, 0);
            each(self, &chunks[..end], failed);
            chunks.drain(..end);
        }
    }

    // ---------------------------------------------------------------- store

    /// Starts store job `job`: its chunks not yet on disk are placed one after another in the
    /// open segment, the range is preallocated, and their writes go out (filled and submitted in
    /// groups of [`SUBMIT_BYTES_MIN`] bytes, so the first are on their way while the next are
    /// checksummed). A job with nothing to write finishes at once.
    fn start_store(&mut self, job: &TierJob) {
        let number = self.next_active;
        self.next_active += 1;
        let mut active = Active {
            id: job.id,
            keys: job.chunks.iter().map(|c| c.key).collect(),
            failed: Failed::new(1),
            records: 0,
            written: Vec::new(),
            bytes: 0,
        };
        let mut todo = Vec::new();
        if self.is_cancelled(job.id) {
            for &TierChunk { key, .. } in &job.chunks {
                active
                    .failed
                    .add(self.stats(), 0, key, FailureKind::Cancelled);
            }
        } else {
            let mut seen = HashSet::new();
            let mut index = self.shared.index();
            for &TierChunk { key, slot, len } in &job.chunks {
                if !seen.insert(key) {
                    continue;
                }
                if index.contains(key) {
                    // Already on disk: not rewritten (equal keys mean equal bytes).
                    index.touch(key);
                    add(&self.shared.stats.stores_skipped, 1);
                    continue;
                }
                todo.push((key, slot, len));
            }
        }
        // Active from here on, so that a panic still completes it (`writer_panicked`).
        self.active.insert(number, active);
        let mut items = Vec::with_capacity(todo.len());
        let mut failures = Vec::new();
        for (key, slot, len) in todo {
            match self.place(number, key, slot, len) {
                Ok(item) => items.push(item),
                Err(kind) => failures.push((key, kind)),
            }
        }
        let bytes: u64 = items.iter().map(|(p, _)| p.bytes).sum();
        if let Some(active) = self.active.get_mut(&number) {
            for (key, kind) in failures {
                active.failed.add(&self.shared.stats, 0, key, kind);
            }
            active.records = items.len();
            active.bytes = bytes;
        }
        self.active_bytes += bytes;
        self.preallocate();
        self.submit_stores(items);
        self.hand_over_written();
    }

    /// Fills and submits store records (or retries), handing results that need no I/O (an
    /// injected error, a refused submission) to `store_done` at once.
    fn submit_stores(&mut self, mut items: Vec<(Pending, Ready)>) {
        while !items.is_empty() {
            let mut results = Vec::new();
            let mut waiting = std::mem::take(&mut self.store_ops);
            self.fill_and_submit(std::mem::take(&mut items), &mut waiting, &mut results);
            self.store_ops = waiting;
            let mut failed = Failed::new(0);
            for (pending, result, buf) in results {
                self.store_done(pending, result, buf, &mut failed, &mut items);
            }
        }
    }

    /// Reaps at least one store write (if any is in flight) and finishes the jobs whose writes
    /// all completed. Writes the engine lost (or that never completed after many reap errors,
    /// none of them reading a slot) fail their records.
    fn store_step(&mut self) {
        let mut reaped = Vec::new();
        let mut errors = 0;
        while self.engine.in_flight() > 0 && reaped.is_empty() {
            if self.engine.reap(&mut reaped, 1).is_err() {
                errors += 1;
                // A write from a slot owns it until reaped: never give up on those.
                if errors > REAP_ERRORS_MAX && !self.store_ops.values().any(|p| p.zero_copy) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let mut retries = Vec::new();
        let mut failed = Failed::new(0);
        for completion in reaped {
            if let Some(pending) = self.store_ops.remove(&completion.tag) {
                let result = completion.result;
                self.store_done(pending, result, completion.buf, &mut failed, &mut retries);
            }
        }
        let gave_up = errors > REAP_ERRORS_MAX;
        if (self.engine.in_flight() == 0 || gave_up) && retries.is_empty() {
            for (_, pending) in std::mem::take(&mut self.store_ops) {
                // The engine still owns the operation and its buffer: leak a reference to the
                // descriptor so that its number is not reused while the engine may still use
                // it, and fail the record.
                std::mem::forget(Arc::clone(&pending.file));
                let error = io::Error::other("the I/O engine lost the operation");
                let buf = AlignedBuf::with_capacity(0);
                self.store_done(pending, Err(error), buf, &mut failed, &mut retries);
            }
        }
        self.submit_stores(retries);
        self.hand_over_written();
    }

    /// Hands completed record writes to their jobs, and finishes every job whose writes all
    /// completed.
    fn hand_over_written(&mut self) {
        for w in std::mem::take(&mut self.written) {
            if let Some(active) = self.active.get_mut(&w.job) {
                active.written.push(w);
            }
        }
        let done: Vec<usize> = self
            .active
            .iter()
            .filter(|(_, a)| a.written.len() >= a.records)
            .map(|(&n, _)| n)
            .collect();
        for number in done {
            if let Some(active) = self.active.remove(&number) {
                // Until its completion is pushed, a panic must still complete it.
                self.finishing = Some((active.id, active.keys.clone()));
                self.finish_store(active);
                self.finishing = None;
            }
        }
        self.seal_finished();
    }

    /// Allocates each open segment's blocks up to its cursor (a fresh segment: whole; `fallocate`,
    /// which also sets the file size) before the job's writes go out. Appending O_DIRECT writes
    /// that extend a file or fill a hole take the inode's lock exclusively (ext4, xfs), so the
    /// kernel runs them one at a time, and io_uring hands them to blocking worker threads; writes
    /// into allocated blocks below the file size run concurrently and asynchronously. Best effort:
    /// where it fails (a file system without `fallocate`, no space), the writes go out as they are
    /// and meet the same condition themselves. Not in a shared directory: there another instance's
    /// probe reads segments while they are appended, and a record inside the file size could be
    /// seen with its header written before its payload.
    fn preallocate(&mut self) {
        if !self.preallocate {
            return;
        }
        let segment_bytes = self.settings.segment_bytes;
        for seg in self.segments.iter_mut().filter(|s| s.allocated < s.cursor) {
            // A fresh segment is allocated whole: `fallocate` waits for every direct I/O in
            // flight on the file (ext4's `inode_dio_wait`), so growing it job by job would drain
            // the writer's queue at every job. Later calls only cover a rewound range or a
            // record larger than a segment.
            let end = if seg.allocated == 0 {
                seg.cursor.max(segment_bytes)
            } else {
                seg.cursor
            };
            let (offset, len) = (seg.allocated, end - seg.allocated);
            match crate::direct::allocate(&seg.file, offset, len) {
                Ok(()) => {
                    seg.allocated = end;
                    add(&self.shared.stats.bytes_preallocated, len);
                    // The allocated space is the segment's (and counts against the capacity).
                    self.shared.index().grow_segment(seg.id, end);
                }
                Err(e) if crate::direct::is_unsupported(&e) => {
                    self.preallocate = false;
                    return;
                }
                Err(_) => {}
            }
        }
    }

    /// Deletes (or forgets) evicted segments.
    fn evict(&mut self, victims: Vec<Victim>) {
        for victim in victims {
            if victim.delete {
                // A file already gone is as good as deleted.
                let _ = std::fs::remove_file(&*victim.path);
            }
            add(&self.stats().evictions, victim.chunks);
            add(&self.stats().evicted_bytes, victim.bytes);
        }
    }

    /// Reserves room for a record, places it in the open segment (creating one when needed) and
    /// fills its buffer. A failure has released what it reserved.
    fn place(
        &mut self,
        job: usize,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
    ) -> Result<(Pending, Ready), FailureKind> {
        let bytes = file_bytes(u64::from(len));
        let need_new = match self.segments.last() {
            None => true,
            Some(seg) => {
                seg.closed || (seg.cursor > 0 && seg.cursor + bytes > self.settings.segment_bytes)
            }
        };
        let reserve = bytes + if need_new { SEAL_BYTES } else { 0 };
        let victims = self
            .shared
            .index()
            .reserve(reserve)
            .ok_or(FailureKind::Capacity)?;
        self.evict(victims);
        if need_new {
            if let Some(last) = self.segments.last_mut() {
                last.closed = true;
            }
            if let Err(kind) = self.open_segment() {
                self.shared.index().release(reserve);
                return Err(kind);
            }
        }
        let at = self.segments.len() - 1;
        if let Err(kind) = self.prepare_segment(at, key) {
            self.shared.index().release(bytes);
            return Err(kind);
        }
        let zero_copy = self.segments[at].direct && self.slot_payload(slot, len).is_some();
        let buf_bytes = if zero_copy {
            HEADER_BYTES
        } else {
            bytes as usize
        };
        let buf = match self.pool.get(buf_bytes) {
            Ok(buf) => buf,
            Err(e) => {
                self.shared.index().release(bytes);
                return Err(failure_of(&e));
            }
        };
        let seg = &mut self.segments[at];
        let offset = seg.cursor;
        seg.cursor += bytes;
        seg.records_open += 1;
        let pending = Pending {
            job,
            key,
            slot,
            len,
            bytes,
            offset,
            segment: seg.id,
            location: None,
            file: Arc::clone(&seg.file),
            direct: seg.direct,
            retried: false,
            corrupt_after_read: false,
            zero_copy,
            members: Vec::new(),
        };
        Ok((pending, Ready::Fill(buf)))
    }

    /// Fills a placed record's buffer (header, the slot's payload, padding) and prepares its
    /// write, with the write faults applied.
    fn fill_record(&mut self, pending: Pending, mut buf: AlignedBuf) -> (Pending, Ready) {
        if pending.zero_copy {
            if let Some(payload) = self.slot_payload(pending.slot, pending.len) {
                // SAFETY: the slot belongs to this job until its completion is sent (the Tier
                // contract: the caller neither writes nor frees it meanwhile), the range is
                // inside it (`slot_payload`), and nothing in this worker writes it during a
                // store; the shared slice ends before the write is submitted.
                let bytes =
                    unsafe { std::slice::from_raw_parts(payload.ptr.as_ptr(), payload.len) };
                Header::for_payload(pending.key, bytes).encode(buf.as_full_mut_slice());
                return self.write_item(pending, buf);
            }
        }
        let memory = &self.memory;
        let (total, _) = encode_into(
            buf.as_full_mut_slice(),
            pending.key,
            pending.len as usize,
            |dst| memory.read_slot(pending.slot, 0, dst),
        );
        debug_assert_eq!(total as u64, pending.bytes);
        self.write_item(pending, buf)
    }

    /// Makes segment `at` ready for `key`'s record: buffered if the root switched, with the
    /// injected open faults (the open site stands for preparing the file for this record).
    fn prepare_segment(&mut self, at: usize, key: ChunkKey) -> Result<(), FailureKind> {
        if self.segments[at].direct && !self.direct() {
            self.reopen_buffered(at).map_err(|e| failure_of(&e))?;
        }
        let direct = self.segments[at].direct;
        match self.shared.fault(FaultSite::Open, key, direct) {
            Some(Fault::Stall) => {
                add(&self.stats().stalls, 1);
                let start = std::time::Instant::now();
                while !self.shared.stalls_released.load(Ordering::Acquire)
                    && start.elapsed() < STALL_MAX
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Ok(())
            }
            Some(Fault::Einval) => {
                let path = Arc::clone(&self.segments[at].path);
                self.fall_back(&format!("open {path:?} with O_DIRECT: injected EINVAL"));
                add(&self.stats().buffered_retries, 1);
                self.reopen_buffered(at).map_err(|e| failure_of(&e))
            }
            Some(fault) => Err(failure_of(&fault_error(fault))),
            None => Ok(()),
        }
    }

    /// Creates a new segment file (O_EXCL; EINVAL from O_DIRECT falls back to buffered) and
    /// makes it the open segment.
    fn open_segment(&mut self) -> Result<(), FailureKind> {
        let sequence = self.shared.next_sequence.fetch_add(1, Ordering::Relaxed);
        let path = self
            .settings
            .layout
            .segment_path(self.shared.instance, sequence);
        let direct = self.direct();
        let (file, direct) = match create_for_write(&path, direct) {
            Ok(file) => (file, direct),
            Err(e) if is_einval(&e) && direct => {
                self.fall_back(&format!("open {path:?} with O_DIRECT: {e}"));
                // EINVAL may come after the file was created; the name is ours alone.
                let _ = std::fs::remove_file(&path);
                match create_for_write(&path, false) {
                    Ok(file) => (file, false),
                    Err(e) => return Err(self.discard(&path, &e)),
                }
            }
            Err(e) => return Err(self.discard(&path, &e)),
        };
        if self.settings.durability == Durability::Fsync {
            let synced = path
                .parent()
                .map(|dir| File::open(dir).and_then(|d| d.sync_all()));
            if let Some(Err(e)) = synced {
                drop(file);
                return Err(self.discard(&path, &e));
            }
        }
        let id = self
            .shared
            .index()
            .add_segment(&path, 0, SegmentState::Writing);
        self.segments.push(OpenSegment {
            id,
            path: Arc::new(path),
            file: Arc::new(file),
            direct,
            cursor: 0,
            allocated: 0,
            closed: false,
            records_open: 0,
        });
        Ok(())
    }

    fn discard(&self, path: &std::path::Path, error: &io::Error) -> FailureKind {
        let _ = std::fs::remove_file(path);
        failure_of(error)
    }

    /// Reopens segment `at` without O_DIRECT (after EINVAL, or once the root switched).
    fn reopen_buffered(&mut self, at: usize) -> io::Result<()> {
        let seg = &mut self.segments[at];
        let file = reopen_buffered_for_write(&seg.path)?;
        seg.file = Arc::new(file);
        seg.direct = false;
        Ok(())
    }

    /// The write of a placed record, with the write faults applied.
    fn write_item(&mut self, mut pending: Pending, mut buf: AlignedBuf) -> (Pending, Ready) {
        let mut len = pending.bytes as usize;
        match self
            .shared
            .fault(FaultSite::Write, pending.key, pending.direct)
        {
            Some(Fault::Short) => len = short_len(len),
            Some(Fault::Corrupt) if pending.zero_copy => {
                // The slot is the caller's and is never modified by a store: the corrupted
                // record goes through a bounce buffer.
                match self.bounce_record(&pending, &buf) {
                    Ok(image) => {
                        self.pool.put(std::mem::replace(&mut buf, image));
                        pending.zero_copy = false;
                        flip_payload_byte(buf.as_full_mut_slice(), pending.len);
                    }
                    Err(e) => return (pending, Ready::Injected(e, buf)),
                }
            }
            Some(Fault::Corrupt) => flip_payload_byte(buf.as_full_mut_slice(), pending.len),
            Some(fault) => return (pending, Ready::Injected(fault_error(fault), buf)),
            None => {}
        }
        let span = match self.span_for(&pending, len) {
            Ok(span) => span,
            Err(e) => return (pending, Ready::Injected(e, buf)),
        };
        buf.set_len(if span.is_some() {
            HEADER_BYTES
        } else {
            pending.bytes as usize
        });
        let op = self.op_for(OpKind::Write, &pending, len, buf, span);
        (pending, Ready::Op(op))
    }

    /// The operation of `kind` on `pending`'s record: `len` bytes through `buf`, then `span`.
    fn op_for(
        &mut self,
        kind: OpKind,
        pending: &Pending,
        len: usize,
        buf: AlignedBuf,
        span: Option<SlotSpan>,
    ) -> IoOp {
        IoOp {
            tag: self.tag(),
            kind,
            fd: std::os::fd::AsRawFd::as_raw_fd(&*pending.file),
            offset: pending.offset,
            len,
            buf,
            span,
        }
    }

    /// The payload of `slot` for `len` bytes, when it can move straight between the slot and an
    /// O_DIRECT file: the memory has a stable address, and the slot's start and `len` are
    /// multiples of [`ALIGN`] (so the record needs no padding) and `len` fits the slot.
    fn slot_payload(&self, slot: SlotId, len: u32) -> Option<SlotSpanInfo> {
        let len = len as usize;
        if len == 0 || len % ALIGN != 0 || len > self.memory.slot_bytes() {
            return None;
        }
        if slot.0 >= self.memory.slot_count() {
            return None;
        }
        let ptr = self.memory.slot_ptr(slot)?;
        (ptr.as_ptr() as usize % ALIGN == 0).then_some(SlotSpanInfo { ptr, len })
    }

    /// The slot span of a zero-copy operation (`None` for a bounce-buffer one), shortened by the
    /// bytes an injected short transfer leaves out (`len` less than the record).
    fn span_for(&self, pending: &Pending, len: usize) -> io::Result<Option<SlotSpan>> {
        if !pending.zero_copy {
            return Ok(None);
        }
        let keep = len.saturating_sub(HEADER_BYTES);
        let Some(payload) = self.slot_payload(pending.slot, pending.len) else {
            return Err(io::Error::other(
                "the slot lost its stable aligned address between two operations",
            ));
        };
        add(&self.stats().zero_copy_ops, 1);
        // SAFETY: the slot belongs to this job until its completion is sent (the Tier
        // contract), the range is inside it (`slot_payload`), and this worker does not touch it
        // while the operation is in flight: `execute` reaps every operation it submitted before
        // the job completes (it keeps waiting, without a limit on errors, while zero-copy
        // operations are out), a panicking job first drains the engine (`panicked`), and the
        // engine, dropped before the memory (field order of `Worker`), waits for its operations.
        Ok(Some(unsafe {
            SlotSpan::new(payload.ptr, payload.len.min(keep))
        }))
    }

    /// A full record image of a zero-copy record (header from `header`, payload copied from the
    /// slot, no padding needed).
    fn bounce_record(&mut self, pending: &Pending, header: &AlignedBuf) -> io::Result<AlignedBuf> {
        let mut image = self.pool.get(pending.bytes as usize)?;
        let full = image.as_full_mut_slice();
        full[..HEADER_BYTES].copy_from_slice(&header.as_full_slice()[..HEADER_BYTES]);
        let end = HEADER_BYTES + pending.len as usize;
        self.memory
            .read_slot(pending.slot, 0, &mut full[HEADER_BYTES..end]);
        Ok(image)
    }

    /// Handles a record write's completion; returns the operation to retry buffered after EINVAL.
    fn store_done(
        &mut self,
        mut pending: Pending,
        result: io::Result<usize>,
        buf: AlignedBuf,
        _failed: &mut Failed,
        retries: &mut Vec<(Pending, Ready)>,
    ) {
        let failure = match result {
            Ok(n) if n as u64 == pending.bytes => None,
            Ok(_) => Some(FailureKind::ShortWrite),
            Err(e) if is_einval(&e) && pending.direct && !pending.retried => 'retry: {
                let Some(at) = self.position(pending.segment) else {
                    break 'retry Some(failure_of(&e));
                };
                self.fall_back(&format!(
                    "write {:?} at offset {}: {e}",
                    self.segments[at].path, pending.offset
                ));
                let reopened = if self.segments[at].direct {
                    self.reopen_buffered(at)
                } else {
                    Ok(())
                };
                match reopened {
                    Ok(()) => {
                        add(&self.stats().buffered_retries, 1);
                        pending.file = Arc::clone(&self.segments[at].file);
                        pending.direct = false;
                        pending.retried = true;
                        retries.push(self.write_item(pending, buf));
                        return;
                    }
                    Err(e) => Some(failure_of(&e)),
                }
            }
            Err(e) => Some(failure_of(&e)),
        };
        self.pool.put(buf);
        self.written.push(Written {
            job: pending.job,
            key: pending.key,
            len: pending.len,
            segment: pending.segment,
            offset: pending.offset,
            bytes: pending.bytes,
            failure,
        });
    }

    /// Finishes a store job whose writes all completed: flushes its segments (with
    /// `Durability::Fsync`), indexes its written records, and gives back the space of its failed
    /// ones: a failed record at the end of the open segment's records rewinds the segment (the
    /// next record goes there); one with records after it is covered by a skip record, so that
    /// later records stay reachable.
    fn finish_store(&mut self, mut active: Active) {
        self.active_bytes -= active.bytes;
        let mut records = std::mem::take(&mut active.written);
        records.sort_by_key(|w| (w.segment, w.offset));
        if self.settings.durability == Durability::Fsync {
            self.flush_records(&mut records);
        }
        // From the last record back, so that a failed tail rewinds as a whole.
        for w in records.iter().rev() {
            let at = self.position(w.segment);
            if let Some(at) = at {
                self.segments[at].records_open -= 1;
            }
            let Some(kind) = w.failure else {
                let mut index = self.shared.index();
                index.release(w.bytes);
                index.grow_segment(w.segment, w.offset + w.bytes);
                index.insert(w.key, w.segment, w.offset, w.bytes);
                drop(index);
                add(&self.stats().chunks_stored, 1);
                add(&self.stats().bytes_stored, u64::from(w.len));
                continue;
            };
            active.failed.add(self.stats(), 0, w.key, kind);
            self.shared.index().release(w.bytes);
            let Some(at) = at else {
                continue;
            };
            let seg = &mut self.segments[at];
            if seg.cursor == w.offset + w.bytes {
                // The failed tail is given back: the next record (or the seal) goes there.
                seg.cursor = w.offset;
                seg.allocated = seg.allocated.min(w.offset);
                if seg.file.set_len(w.offset).is_ok() {
                    self.shared.index().set_segment_bytes(w.segment, w.offset);
                }
                continue;
            }
            // Dead space before other records: a skip record keeps later records reachable by
            // the start-up scan (if it cannot be written, the scan cuts the segment there,
            // which only loses chunks).
            if write_skip(&seg.file, w.offset, w.bytes).is_err() {
                seg.closed = true;
            }
            self.shared
                .index()
                .grow_segment(w.segment, w.offset + w.bytes);
        }
        let failed = active.failed.into_keys().next().unwrap_or_default();
        self.shared.cancelled().remove(&active.id);
        self.finished.push(TierCompletion {
            id: active.id,
            failed,
        });
    }

    /// Flushes the segments of `records` that hold a written one; a failed flush fails those
    /// records and closes the segment.
    fn flush_records(&mut self, records: &mut [Written]) {
        let mut ids: Vec<SegmentId> = records
            .iter()
            .filter(|w| w.failure.is_none())
            .map(|w| w.segment)
            .collect();
        ids.dedup();
        for id in ids {
            let Some(at) = self.position(id) else {
                continue;
            };
            if let Err(e) = self.segments[at].file.sync_data() {
                for w in records.iter_mut().filter(|w| w.segment == id) {
                    w.failure = w.failure.or(Some(failure_of(&e)));
                }
                self.segments[at].closed = true;
            }
        }
    }

    /// Seals the segments that take no further record (closed, full, or not the last one) and
    /// have no record of an unfinished job.
    fn seal_finished(&mut self) {
        let segment_bytes = self.settings.segment_bytes;
        let last = self.segments.len().saturating_sub(1);
        let mut sealing = Vec::new();
        let mut keep = Vec::new();
        for (at, seg) in std::mem::take(&mut self.segments).into_iter().enumerate() {
            let no_more = seg.closed || at < last || seg.cursor >= segment_bytes;
            if no_more && seg.records_open == 0 {
                sealing.push(seg);
            } else {
                keep.push(seg);
            }
        }
        self.segments = keep;
        for seg in sealing {
            self.seal(seg);
        }
    }

    /// Where segment `id` is in `segments`.
    fn position(&self, id: SegmentId) -> Option<usize> {
        self.segments.iter().position(|s| s.id == id)
    }

    /// After a panic in the writer: every operation in flight is reaped (some read slots), every
    /// running job fails as a whole, and its segments are given up unsealed (evictable; the next
    /// start verifies and seals them).
    fn writer_panicked(&mut self) {
        let mut reaped = Vec::new();
        while self.engine.in_flight() > 0 {
            if self.engine.reap(&mut reaped, 1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            reaped.clear();
        }
        let mut index = self.shared.index();
        for (_, pending) in self.store_ops.drain() {
            index.release(pending.bytes);
        }
        give_up_segments(&mut self.written, &mut self.segments, &mut index);
        drop(index);
        let mut given_up: Vec<(JobId, Vec<ChunkKey>)> = self.finishing.take().into_iter().collect();
        for (_, active) in self.active.drain() {
            for w in &active.written {
                self.shared.index().release(w.bytes);
            }
            given_up.push((active.id, active.keys));
        }
        given_up.sort_by_key(|(id, _)| *id);
        for (id, keys) in given_up {
            let mut failed = Failed::new(1);
            for key in keys {
                failed.add(&self.shared.stats, 0, key, FailureKind::Io);
            }
            self.shared.cancelled().remove(&id);
            self.finished.push(TierCompletion {
                id,
                failed: failed.into_keys().next().unwrap_or_default(),
            });
        }
        self.active_bytes = 0;
    }

    /// Seals a segment that takes no further record (or removes it if it holds none).
    fn seal(&mut self, seg: OpenSegment) {
        if seg.cursor == 0 {
            let _ = std::fs::remove_file(&*seg.path);
            let mut index = self.shared.index();
            index.remove_segment(seg.id);
            index.release(SEAL_BYTES);
            return;
        }
        let durable = self.settings.durability == Durability::Fsync;
        // The allocated tail past the records goes; the seal then extends the file to its end.
        let trimmed = if seg.allocated > seg.cursor {
            seg.file.set_len(seg.cursor)
        } else {
            Ok(())
        };
        let sealed = trimmed
            .and_then(|()| write_seal(&seg.file, seg.cursor))
            .and_then(|()| {
                if durable {
                    seg.file.sync_data()
                } else {
                    Ok(())
                }
            });
        let size = seg.file.metadata().map(|m| m.len());
        let mut index = self.shared.index();
        index.release(SEAL_BYTES);
        if sealed.is_ok() {
            // Unsealed (a failed seal write), it is recovered by the next start's scan.
            index.grow_segment(seg.id, seg.cursor + SEAL_BYTES);
        }
        if let Ok(size) = size {
            // The allocated tail is gone (or, if the trim failed, still there).
            index.set_segment_bytes(seg.id, size);
        }
        index.set_state(seg.id, SegmentState::Sealed);
        drop(index);
        add(&self.stats().segments_sealed, 1);
    }

    /// Seals every segment this worker appends to (at shutdown).
    fn seal_all(&mut self) {
        let sealing: Vec<OpenSegment> = self.segments.drain(..).collect();
        for seg in sealing {
            self.seal(seg);
        }
    }

    // ---------------------------------------------------------------- load

    fn load(&mut self, job: &TierJob, failed: &mut Failed) {
        self.prune_readers();
        let chunks = job.chunks.iter().map(|&chunk| (0, chunk)).collect();
        self.batches(&[job.id], chunks, failed, Self::load_batch);
    }

    /// Closes cached descriptors of segments that left the index (so their space is freed).
    fn prune_readers(&mut self) {
        if self.readers.is_empty() {
            return;
        }
        let index = self.shared.index();
        self.readers
            .retain(|id, _| index.segment_path(*id).is_some());
    }

    fn load_batch(&mut self, chunks: &[JobChunk], failed: &mut Failed) {
        let mut items = Vec::with_capacity(chunks.len());
        for &(j, TierChunk { key, slot, len }) in chunks {
            match self.prepare_load(j, key, slot, len) {
                Ok(item) => items.push(item),
                Err(kind) => failed.add(self.stats(), j, key, kind),
            }
        }
        let items = self.merge_reads(items);
        self.run_to_completion(items, Self::load_done, failed);
    }

    /// Merges the reads of records that lie one after another in the same segment (read through
    /// the same descriptor, bounce-buffered, without an injected fault that changes the
    /// operation) into one read each, of at most [`READ_MERGE_BYTES_MAX`]; the others are
    /// returned as they are.
    fn merge_reads(&mut self, items: Vec<(Pending, Ready)>) -> Vec<(Pending, Ready)> {
        let mergeable = |(pending, ready): &(Pending, Ready)| match ready {
            Ready::Op(op) => {
                op.span.is_none()
                    && op.len as u64 == pending.bytes
                    && !pending.zero_copy
                    && pending.location.is_some()
            }
            _ => false,
        };
        let (mut reads, mut out): (Vec<_>, Vec<_>) = items.into_iter().partition(mergeable);
        let place = |p: &Pending| {
            let segment = p.location.as_ref().map(|l| l.segment);
            (segment, p.offset)
        };
        reads.sort_by_key(|(p, _)| place(p));
        let mut run: Vec<(Pending, Ready)> = Vec::new();
        for item in reads {
            let follows = run.last().is_some_and(|(last, _)| {
                let run_bytes: u64 = run.iter().map(|(p, _)| p.bytes).sum();
                Arc::ptr_eq(&last.file, &item.0.file)
                    && place(last).0 == place(&item.0).0
                    && last.offset + last.bytes == item.0.offset
                    && run_bytes + item.0.bytes <= READ_MERGE_BYTES_MAX
            });
            if !follows {
                self.flush_run(&mut run, &mut out);
            }
            run.push(item);
        }
        self.flush_run(&mut run, &mut out);
        out
    }

    /// Moves `run` (reads of neighbouring records) into `out`: as it is if it is a single read
    /// (or the merged buffer cannot be had), else as one merged read.
    fn flush_run(&mut self, run: &mut Vec<(Pending, Ready)>, out: &mut Vec<(Pending, Ready)>) {
        if run.len() < 2 {
            out.append(run);
            return;
        }
        let bytes: u64 = run.iter().map(|(p, _)| p.bytes).sum();
        let Ok(buf) = self.pool.get(bytes as usize) else {
            out.append(run);
            return;
        };
        let mut members = Vec::with_capacity(run.len());
        for (pending, ready) in run.drain(..) {
            if let Ready::Op(op) = ready {
                self.pool.put(op.buf);
            }
            members.push(pending);
        }
        let first = &members[0];
        let head = Pending {
            job: first.job,
            key: first.key,
            slot: first.slot,
            len: 0,
            bytes,
            offset: first.offset,
            segment: SegmentId(0),
            location: first.location.clone(),
            file: Arc::clone(&first.file),
            direct: first.direct,
            retried: false,
            corrupt_after_read: false,
            zero_copy: false,
            members,
        };
        add(&self.stats().reads_merged, head.members.len() as u64);
        let op = self.op_for(OpKind::Read, &head, bytes as usize, buf, None);
        out.push((head, Ready::Op(op)));
    }

    /// A read descriptor of `location`'s segment (cached), with or without O_DIRECT.
    fn reader(&mut self, location: &Location, direct: bool) -> io::Result<(Arc<File>, bool)> {
        if let Some((file, cached_direct)) = self.readers.get(&location.segment) {
            if *cached_direct == direct {
                return Ok((Arc::clone(file), direct));
            }
        }
        let file = Arc::new(open_for_read(&location.path, direct)?);
        if self.readers.len() >= READERS_MAX {
            // Operations in flight hold their own reference; nothing they use is closed.
            self.readers.clear();
        }
        self.readers
            .insert(location.segment, (Arc::clone(&file), direct));
        Ok((file, direct))
    }

    fn prepare_load(
        &mut self,
        job: usize,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
    ) -> Result<(Pending, Ready), FailureKind> {
        let bytes = file_bytes(u64::from(len));
        let location = {
            let mut index = self.shared.index();
            let location = index.location(key);
            index.touch(key);
            location
        };
        let Some(location) = location else {
            return Err(FailureKind::Missing);
        };
        if location.bytes != bytes {
            return Err(FailureKind::LengthMismatch);
        }
        let direct = self.direct();
        let opened = match self.shared.fault(FaultSite::Open, key, direct) {
            Some(fault) => Err(fault_error(fault)),
            None => self.reader(&location, direct),
        };
        let (file, direct) = match opened {
            Ok(opened) => opened,
            Err(e) if is_einval(&e) && direct => {
                self.fall_back(&format!("open {:?} with O_DIRECT: {e}", location.path));
                add(&self.stats().buffered_retries, 1);
                match self.reader(&location, false) {
                    Ok(opened) => opened,
                    Err(e) => return Err(self.open_failed(&location, &e)),
                }
            }
            Err(e) => return Err(self.open_failed(&location, &e)),
        };
        let zero_copy =
            self.settings.zero_copy_loads && direct && self.slot_payload(slot, len).is_some();
        let buf_bytes = if zero_copy {
            HEADER_BYTES
        } else {
            bytes as usize
        };
        let buf = self.pool.get(buf_bytes).map_err(|e| failure_of(&e))?;
        let pending = Pending {
            job,
            key,
            slot,
            len,
            bytes,
            offset: location.offset,
            segment: SegmentId(0),
            location: Some(location),
            file,
            direct,
            retried: false,
            corrupt_after_read: false,
            zero_copy,
            members: Vec::new(),
        };
        Ok(self.read_item(pending, buf))
    }

    fn open_failed(&self, location: &Location, error: &io::Error) -> FailureKind {
        if error.kind() == io::ErrorKind::NotFound {
            // Gone (evicted by another instance sharing the directory): drop it from the index.
            self.shared.index().remove_segment(location.segment);
            return FailureKind::Missing;
        }
        failure_of(error)
    }

    /// The read of a prepared load, with the read faults applied.
    fn read_item(&mut self, mut pending: Pending, mut buf: AlignedBuf) -> (Pending, Ready) {
        let mut len = pending.bytes as usize;
        match self
            .shared
            .fault(FaultSite::Read, pending.key, pending.direct)
        {
            Some(Fault::Short) => len = short_len(len),
            Some(Fault::Corrupt) => pending.corrupt_after_read = true,
            Some(fault) => return (pending, Ready::Injected(fault_error(fault), buf)),
            None => {}
        }
        let span = match self.span_for(&pending, len) {
            Ok(span) => span,
            Err(e) => return (pending, Ready::Injected(e, buf)),
        };
        buf.clear();
        let op = self.op_for(OpKind::Read, &pending, len, buf, span);
        (pending, Ready::Op(op))
    }

    /// Handles a load's completion; pushes the operation to retry buffered after EINVAL.
    fn load_done(
        &mut self,
        mut pending: Pending,
        result: io::Result<usize>,
        buf: AlignedBuf,
        failed: &mut Failed,
        retries: &mut Vec<(Pending, Ready)>,
    ) {
        if !pending.members.is_empty() {
            self.merged_done(pending, result, buf, failed, retries);
            return;
        }
        match result {
            Ok(n) => {
                self.verify_and_copy(&pending, n, &buf, failed);
                self.pool.put(buf);
            }
            Err(e) if is_einval(&e) && pending.direct && !pending.retried => {
                let Some(location) = pending.location.clone() else {
                    self.pool.put(buf);
                    failed.add(self.stats(), pending.job, pending.key, failure_of(&e));
                    return;
                };
                self.fall_back(&format!(
                    "read {:?} at offset {}: {e}",
                    location.path, location.offset
                ));
                match self.reader(&location, false) {
                    Ok((file, _)) => {
                        add(&self.stats().buffered_retries, 1);
                        pending.file = file;
                        pending.direct = false;
                        pending.retried = true;
                        retries.push(self.read_item(pending, buf));
                    }
                    Err(e) => {
                        self.pool.put(buf);
                        let kind = self.open_failed(&location, &e);
                        failed.add(self.stats(), pending.job, pending.key, kind);
                    }
                }
            }
            Err(e) => {
                // EIO and the like may be transient: the key fails, the record stays.
                self.pool.put(buf);
                failed.add(self.stats(), pending.job, pending.key, failure_of(&e));
            }
        }
    }

    /// Handles the completion of a merged read: each record it read whole is verified and
    /// copied like a single read; a record it did not read whole (a short read) and, after
    /// EINVAL, every record is read again on its own (where a short read means a torn record).
    fn merged_done(
        &mut self,
        mut head: Pending,
        result: io::Result<usize>,
        buf: AlignedBuf,
        failed: &mut Failed,
        retries: &mut Vec<(Pending, Ready)>,
    ) {
        let members = std::mem::take(&mut head.members);
        let n = match result {
            Ok(n) => n,
            Err(e) if is_einval(&e) && head.direct => {
                self.fall_back(&format!(
                    "read {:?} at offset {}: {e}",
                    head.location.as_ref().map(|l| &l.path),
                    head.offset
                ));
                // Each record alone, through a descriptor of the segment now without O_DIRECT.
                0
            }
            Err(e) => {
                self.pool.put(buf);
                for m in members {
                    failed.add(self.stats(), m.job, m.key, failure_of(&e));
                }
                return;
            }
        };
        let image = buf.as_full_slice();
        let mut again = Vec::new();
        for m in members {
            let at = (m.offset - head.offset) as usize;
            let end = at + m.bytes as usize;
            if n < end {
                again.push(m);
                continue;
            }
            self.verify_image(&m, &image[at..end], failed);
        }
        self.pool.put(buf);
        for mut m in again {
            if !self.direct() && m.direct {
                let Some(location) = m.location.clone() else {
                    failed.add(self.stats(), m.job, m.key, FailureKind::Io);
                    continue;
                };
                match self.reader(&location, false) {
                    Ok((file, _)) => {
                        add(&self.stats().buffered_retries, 1);
                        m.file = file;
                        m.direct = false;
                        m.retried = true;
                    }
                    Err(e) => {
                        let kind = self.open_failed(&location, &e);
                        failed.add(self.stats(), m.job, m.key, kind);
                        continue;
                    }
                }
            }
            match self.pool.get(m.bytes as usize) {
                Ok(buf) => retries.push(self.read_item(m, buf)),
                Err(e) => failed.add(self.stats(), m.job, m.key, failure_of(&e)),
            }
        }
    }

    /// Verifies `n` bytes read for `pending` and copies the payload into its slot; a short or
    /// corrupt record is quarantined.
    fn verify_and_copy(
        &mut self,
        pending: &Pending,
        n: usize,
        buf: &AlignedBuf,
        failed: &mut Failed,
    ) {
        let key = pending.key;
        if (n as u64) < pending.bytes {
            self.quarantine(key, pending.location.as_ref());
            failed.add(self.stats(), pending.job, key, FailureKind::ShortRead);
            return;
        }
        if pending.zero_copy {
            self.verify_in_slot(pending, buf, failed);
            return;
        }
        self.verify_image(
            pending,
            &buf.as_full_slice()[..pending.bytes as usize],
            failed,
        );
    }

    /// Verifies the record image `read` (header, payload, padding) for `pending` and copies its
    /// payload into the slot; a corrupt record is quarantined.
    fn verify_image(&mut self, pending: &Pending, read: &[u8], failed: &mut Failed) {
        let key = pending.key;
        let corrupted;
        let image = if pending.corrupt_after_read {
            let mut copy = read.to_vec();
            flip_payload_byte(&mut copy, pending.len);
            corrupted = copy;
            &corrupted[..]
        } else {
            read
        };
        match verify(image, key, u64::from(pending.len)) {
            Ok(payload) => {
                self.memory.write_slot(pending.slot, 0, payload);
                add(&self.stats().chunks_loaded, 1);
                add(&self.stats().bytes_loaded, u64::from(pending.len));
            }
            Err(e) if !e.is_corruption() => {
                failed.add(self.stats(), pending.job, key, FailureKind::LengthMismatch)
            }
            Err(_) => {
                self.quarantine(key, pending.location.as_ref());
                failed.add(self.stats(), pending.job, key, FailureKind::Corrupt);
            }
        }
    }

    /// Verifies a record read straight into its slot (header in `buf`, payload in the slot) in
    /// place. A record that does not verify leaves garbage in the slot, which the Tier contract
    /// allows: a failed key is never served.
    fn verify_in_slot(&mut self, pending: &Pending, buf: &AlignedBuf, failed: &mut Failed) {
        let key = pending.key;
        let Some(payload) = self.slot_payload(pending.slot, pending.len) else {
            failed.add(self.stats(), pending.job, key, FailureKind::Io);
            return;
        };
        // SAFETY: the read into the slot was reaped (this runs on its completion), the slot
        // belongs to this job until its completion is sent, and the range is inside it; this
        // is the only reference to it while it lives.
        let body = unsafe { std::slice::from_raw_parts_mut(payload.ptr.as_ptr(), payload.len) };
        if pending.corrupt_after_read {
            body[body.len() / 2] ^= 0x5A;
        }
        let header = &buf.as_full_slice()[..HEADER_BYTES];
        match verify_parts(header, body, key, u64::from(pending.len)) {
            Ok(_) => {
                add(&self.stats().chunks_loaded, 1);
                add(&self.stats().bytes_loaded, u64::from(pending.len));
            }
            Err(e) if !e.is_corruption() => {
                failed.add(self.stats(), pending.job, key, FailureKind::LengthMismatch)
            }
            Err(_) => {
                self.quarantine(key, pending.location.as_ref());
                failed.add(self.stats(), pending.job, key, FailureKind::Corrupt);
            }
        }
    }

    /// Drops a record that does not verify from the index and, in a segment this instance may
    /// modify, covers it with a skip record so that no later start indexes it again.
    fn quarantine(&self, key: ChunkKey, location: Option<&Location>) {
        add(&self.stats().quarantined, 1);
        let Some(location) = location else {
            return;
        };
        {
            let mut index = self.shared.index();
            let same = index
                .location(key)
                .is_some_and(|l| l.segment == location.segment && l.offset == location.offset);
            if same {
                index.remove(key);
            }
        }
        if self.may_modify(&location.path) {
            if let Ok(file) = open_for_repair(&location.path) {
                let _ = write_skip(&file, location.offset, location.bytes);
            }
        }
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

    /// Executes `items`, handing each result to `done` as it arrives, and executes again whatever
    /// `done` asks to retry (a buffered retry after EINVAL), until nothing is left.
    fn run_to_completion(
        &mut self,
        mut items: Vec<(Pending, Ready)>,
        done: CompletionHandler,
        failed: &mut Failed,
    ) {
        while !items.is_empty() {
            items = self.execute(items, done, failed);
        }
    }

    /// Submits the ready operations and reaps them all, handing each result to `done` as soon as
    /// it is reaped (so a load verifies and copies one record while later ones are still read);
    /// injected errors complete at once. Store records still to be filled are filled just before
    /// their submission, so that the disk writes the first records of a batch while the next ones
    /// are copied and checksummed (ops are submitted in groups of at least [`SUBMIT_BYTES_MIN`]
    /// bytes). Returns the operations `done` asked to retry.
    fn execute(
        &mut self,
        items: Vec<(Pending, Ready)>,
        done: CompletionHandler,
        failed: &mut Failed,
    ) -> Vec<(Pending, Ready)> {
        let mut results = Vec::new();
        let mut retries = Vec::new();
        let mut waiting: HashMap<u64, Pending> = HashMap::new();
        let submitted = self.fill_and_submit(items, &mut waiting, &mut results);
        let mut handle = |worker: &mut Worker, results: &mut Vec<_>| {
            for (pending, result, buf) in results.drain(..) {
                done(worker, pending, result, buf, failed, &mut retries);
            }
        };
        handle(self, &mut results);
        let mut reaped = 0;
        let mut errors = 0;
        let mut batch = Vec::new();
        while reaped < submitted && self.engine.in_flight() > 0 {
            if self.engine.reap(&mut batch, 1).is_err() {
                errors += 1;
                // An operation into or from a slot owns it until reaped: never give up on those.
                if errors > REAP_ERRORS_MAX && !waiting.values().any(|p| p.zero_copy) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            for completion in batch.drain(..) {
                reaped += 1;
                if let Some(pending) = waiting.remove(&completion.tag) {
                    results.push((pending, completion.result, completion.buf));
                }
            }
            handle(self, &mut results);
        }
        for (_, pending) in waiting {
            // The engine still owns the operation and its buffer: leak a reference to the
            // descriptor so that its number is not reused while the engine may still use it, and
            // fail the chunk.
            std::mem::forget(Arc::clone(&pending.file));
            let error = io::Error::other("the I/O engine lost the operation");
            results.push((pending, Err(error), AlignedBuf::with_capacity(0)));
        }
        handle(self, &mut results);
        retries
    }

    /// Fills the store records of `items` that are still to be filled, just before their
    /// submission, and submits the operations in groups of at least [`SUBMIT_BYTES_MIN`] bytes,
    /// each one's `Pending` in `waiting` under its tag (so the disk writes the first records while
    /// later ones are copied and checksummed). Injected errors, unfilled records and refused
    /// submissions go to `results`. Returns how many operations the engine took.
    fn fill_and_submit(
        &mut self,
        items: Vec<(Pending, Ready)>,
        waiting: &mut HashMap<u64, Pending>,
        results: &mut Vec<(Pending, io::Result<usize>, AlignedBuf)>,
    ) -> usize {
        let mut ops = Vec::new();
        let mut ops_bytes = 0;
        let mut submitted = 0;
        let total = items.len();
        for (n, (pending, ready)) in items.into_iter().enumerate() {
            let (pending, ready) = match ready {
                Ready::Fill(buf) => self.fill_record(pending, buf),
                other => (pending, other),
            };
            match ready {
                Ready::Injected(error, buf) => results.push((pending, Err(error), buf)),
                Ready::Fill(buf) => {
                    results.push((pending, Err(io::Error::other("record left unfilled")), buf))
                }
                Ready::Op(op) => {
                    ops_bytes += op.len;
                    waiting.insert(op.tag, pending);
                    ops.push(op);
                }
            }
            if !ops.is_empty() && (ops_bytes >= SUBMIT_BYTES_MIN || n + 1 == total) {
                submitted += self.submit(std::mem::take(&mut ops), waiting, results);
                ops_bytes = 0;
            }
        }
        submitted
    }

    /// Submits `ops`; returns how many the engine took (a refused group fails its items).
    fn submit(
        &mut self,
        ops: Vec<IoOp>,
        waiting: &mut HashMap<u64, Pending>,
        results: &mut Vec<(Pending, io::Result<usize>, AlignedBuf)>,
    ) -> usize {
        let count = ops.len();
        match self.engine.submit(ops) {
            Ok(()) => count,
            Err((error, ops)) => {
                for op in ops {
                    if let Some(pending) = waiting.remove(&op.tag) {
                        let error = io::Error::new(error.kind(), format!("submit: {error}"));
                        results.push((pending, Err(error), op.buf));
                    }
                }
                0
            }
        }
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
        ChunkKey::new(n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x77, 0)
    }

    fn worker(dir: &std::path::Path, shared: &Arc<Shared>, memory: &Arc<VecSlotMemory>) -> Worker {
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
        };
        let memory: Arc<dyn SlotMemory> = Arc::clone(memory) as Arc<dyn SlotMemory>;
        // Threads for every job's (merged) read at once.
        Worker::new(
            Box::new(SyncEngine::new(8).unwrap()),
            memory,
            Arc::clone(shared),
            settings,
        )
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
}
