//! The background workers: each owns an I/O engine, takes whole jobs from the shared job channel
//! one at a time (each batch of a job's chunks in one engine submission), and sends exactly one
//! completion per job. Several workers run jobs concurrently; completions may therefore arrive out
//! of submission order. Bookkeeping (index, reservations, faults) is shared under short mutex
//! sections without I/O.
//!
//! Store: reserve capacity (evicting the oldest segments), copy each slot into an aligned buffer
//! behind a header (or, zero-copy, write a 4 KiB header buffer and the slot itself as one
//! vectored write; see below), allocate the batch's range of the worker's open segment
//! (`fallocate`, so that the writes run concurrently), and write the records of the batch one
//! after another into it (one write per record, all in one submission). Only when a record's
//! write completed (and, with `Durability::Fsync`, the segment was flushed) does its chunk enter
//! the index. A failed record is either the segment's tail (the next record takes its place) or
//! is covered by a skip record so that later records stay reachable. A full segment is sealed
//! once every write into it completed, and a new one is created. Load: read each record into an
//! aligned buffer through a cached descriptor of its segment, verify header and checksum, and
//! only then copy the payload into the slot; a record that does not verify leaves the index
//! (and, in a segment this instance may modify, is covered by a skip record).
//!
//! Host slots are only touched through [`SlotMemory`] by the worker running the job, between the
//! job's start and the send of its completion, so the tier never touches them after the
//! completion is polled.
//!
//! Zero-copy: with O_DIRECT, when the memory gives the slot a stable address
//! ([`SlotMemory::slot_ptr`]) aligned to 4 KiB and the payload length is a multiple of 4 KiB (no
//! padding needed), a store's record moves as one vectored operation, the header through a 4 KiB
//! buffer and the payload straight from the slot (a [`SlotSpan`]); so does a load's with
//! `zero_copy_loads` (off by default), which then verifies the payload in the slot. Such an operation owns its slot until reaped, and `execute` reaps every one
//! before the job's completion can be sent. Injected corruption of a store goes through a bounce
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
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use offload_core::tier::{SlotMemory, TierCompletion, TierJob, TierOp};
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
        }
    }

    /// The fault to inject at this call, if any.
    fn fault(&self, site: FaultSite, key: ChunkKey, direct: bool) -> Option<Fault> {
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

/// The failed keys of a job, each once, in first-failure order.
#[derive(Default)]
struct Failed {
    keys: Vec<ChunkKey>,
    seen: HashSet<ChunkKey>,
}

impl Failed {
    fn add(&mut self, stats: &StatsCell, key: ChunkKey, kind: FailureKind) {
        stats.fail(kind);
        if self.seen.insert(key) {
            self.keys.push(key);
        }
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

/// A job's chunk: key, host slot, payload length.
type Chunk = (ChunkKey, SlotId, u32);

/// Runs one batch of a job's chunks.
type BatchFn = fn(&mut Worker, &[Chunk], &mut Failed);

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
    /// Takes no further record (full, or a write into it failed); sealed after the batch.
    closed: bool,
}

/// One record's file operation in flight.
struct Pending {
    key: ChunkKey,
    slot: SlotId,
    len: u32,
    /// Record bytes (header and padding included).
    bytes: u64,
    /// The record's offset in its segment.
    offset: u64,
    /// Store: the index of the segment in the worker's `segments`. Load: unused.
    segment: usize,
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
}

/// An operation ready to run, a store record whose buffer is filled just before it is
/// submitted, or one whose injected error stands for its completion.
enum Ready {
    Op(IoOp),
    Fill(AlignedBuf),
    Injected(io::Error, AlignedBuf),
}

/// What `store_done` and `load_done` are: they take one completed operation and return the
/// operation to retry, if any.
type CompletionHandler = fn(
    &mut Worker,
    Pending,
    io::Result<usize>,
    AlignedBuf,
    &mut Failed,
) -> Option<(Pending, Ready)>;

/// The outcome of one record write of a batch.
struct Written {
    key: ChunkKey,
    len: u32,
    segment: usize,
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
    /// last one) are sealed at the end of the batch.
    segments: Vec<OpenSegment>,
    /// The record writes of the batch in progress.
    written: Vec<Written>,
    /// Read descriptors by segment, with whether they use O_DIRECT.
    readers: HashMap<SegmentId, (Arc<File>, bool)>,
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
            readers: HashMap::new(),
            preallocate,
        }
    }

    /// Runs jobs until `Stop` or until the front end is gone, then seals the open segment.
    pub(crate) fn run(mut self, jobs: Receiver<Msg>, done: Sender<TierCompletion>) {
        while let Ok(msg) = jobs.recv() {
            let job = match msg {
                Msg::Stop => break,
                Msg::Job(job) => job,
            };
            // A panic here is a bug; it must not lose the job's completion nor kill the tier.
            let completion = catch_unwind(AssertUnwindSafe(|| self.run_job(&job)))
                .unwrap_or_else(|_| self.panicked(&job));
            if done.send(completion).is_err() {
                break;
            }
        }
        self.seal_all();
    }

    /// The completion of a job whose run panicked: every key failed. Operations still in flight
    /// are reaped first, since some may move bytes into or from the job's slots.
    fn panicked(&mut self, job: &TierJob) -> TierCompletion {
        let mut reaped = Vec::new();
        while self.engine.in_flight() > 0 {
            if self.engine.reap(&mut reaped, 1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            // Only the memory matters here; the records are given up below.
            reaped.clear();
        }
        let mut failed = Failed::default();
        for &(key, _, _) in &job.chunks {
            failed.add(self.stats(), key, FailureKind::Io);
        }
        // Whatever the batch wrote is not indexed, and writes may still be in flight: its
        // segments are given up unsealed (evictable; the next start verifies and seals them).
        let mut index = self.shared.index();
        for w in self.written.drain(..) {
            index.release(w.bytes);
        }
        for seg in self.segments.drain(..) {
            index.release(SEAL_BYTES);
            index.set_state(seg.id, SegmentState::Sealed);
        }
        drop(index);
        self.shared.cancelled().remove(&job.id);
        TierCompletion {
            id: job.id,
            failed: failed.keys,
        }
    }

    fn stats(&self) -> &StatsCell {
        &self.shared.stats
    }

    fn is_cancelled(&self, id: JobId) -> bool {
        self.shared.cancelled().contains(&id)
    }

    fn run_job(&mut self, job: &TierJob) -> TierCompletion {
        let mut failed = Failed::default();
        match job.op {
            TierOp::Store => self.store(job, &mut failed),
            TierOp::Load => self.load(job, &mut failed),
        }
        self.shared.cancelled().remove(&job.id);
        TierCompletion {
            id: job.id,
            failed: failed.keys,
        }
    }

    /// Splits `chunks` into batches of at most `batch_bytes_max` record bytes (at least one
    /// chunk) and [`BATCH_OPS_MAX`] chunks; returns the end of the batch starting at `start`.
    fn batch_end(&self, chunks: &[Chunk], start: usize) -> usize {
        let mut bytes = 0u64;
        let mut end = start;
        while end < chunks.len() && end - start < BATCH_OPS_MAX {
            let next = file_bytes(u64::from(chunks[end].2));
            if end > start && bytes + next > self.settings.batch_bytes_max as u64 {
                break;
            }
            bytes += next;
            end += 1;
        }
        end
    }

    /// Runs `chunks` batch by batch with `each`, failing what remains once the job is cancelled.
    fn batches(&mut self, job: &TierJob, chunks: &[Chunk], failed: &mut Failed, each: BatchFn) {
        let mut start = 0;
        while start < chunks.len() {
            if self.is_cancelled(job.id) {
                for &(key, _, _) in &chunks[start..] {
                    failed.add(self.stats(), key, FailureKind::Cancelled);
                }
                return;
            }
            let end = self.batch_end(chunks, start);
            each(self, &chunks[start..end], failed);
            start = end;
        }
    }

    // ---------------------------------------------------------------- store

    fn store(&mut self, job: &TierJob, failed: &mut Failed) {
        self.prune_readers();
        let mut seen = HashSet::new();
        let mut todo = Vec::new();
        {
            let mut index = self.shared.index();
            for &(key, slot, len) in &job.chunks {
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
        self.batches(job, &todo, failed, Self::store_batch);
    }

    fn store_batch(&mut self, chunks: &[Chunk], failed: &mut Failed) {
        let mut items = Vec::with_capacity(chunks.len());
        for &(key, slot, len) in chunks {
            match self.place(key, slot, len) {
                Ok(item) => items.push(item),
                Err(kind) => failed.add(self.stats(), key, kind),
            }
        }
        self.preallocate();
        self.run_to_completion(items, Self::store_done, failed);
        self.finish_batch(failed);
    }

    /// Allocates each open segment's blocks up to its cursor (`fallocate`, which also sets the
    /// file size) before the batch's writes go out. Appending O_DIRECT writes that extend a file
    /// or fill a hole take the inode's lock exclusively (ext4, xfs), so the kernel runs them one
    /// at a time, and io_uring hands them to blocking worker threads; writes into allocated
    /// blocks below the file size run concurrently and asynchronously. Best effort: where it
    /// fails (a file system without `fallocate`, no space), the writes go out as they are and
    /// meet the same condition themselves. Not in a shared directory: there another instance's
    /// probe reads segments while they are appended, and a record inside the file size could be
    /// seen with its header written before its payload.
    fn preallocate(&mut self) {
        if !self.preallocate {
            return;
        }
        for seg in self.segments.iter_mut().filter(|s| s.allocated < s.cursor) {
            let (offset, len) = (seg.allocated, seg.cursor - seg.allocated);
            match crate::direct::allocate(&seg.file, offset, len) {
                Ok(()) => {
                    seg.allocated = seg.cursor;
                    add(&self.shared.stats.bytes_preallocated, len);
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
        let pending = Pending {
            key,
            slot,
            len,
            bytes,
            offset,
            segment: at,
            location: None,
            file: Arc::clone(&seg.file),
            direct: seg.direct,
            retried: false,
            corrupt_after_read: false,
            zero_copy,
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
    ) -> Option<(Pending, Ready)> {
        let failure = match result {
            Ok(n) if n as u64 == pending.bytes => None,
            Ok(_) => Some(FailureKind::ShortWrite),
            Err(e) if is_einval(&e) && pending.direct && !pending.retried => {
                let at = pending.segment;
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
                        return Some(self.write_item(pending, buf));
                    }
                    Err(e) => Some(failure_of(&e)),
                }
            }
            Err(e) => Some(failure_of(&e)),
        };
        self.pool.put(buf);
        self.written.push(Written {
            key: pending.key,
            len: pending.len,
            segment: pending.segment,
            offset: pending.offset,
            bytes: pending.bytes,
            failure,
        });
        None
    }

    /// After every write of a batch completed: flushes (with `Durability::Fsync`), indexes the
    /// written records, covers dead space before a good record with a skip record (or rewinds the
    /// segment over a failed tail), and seals the segments that take no further record.
    fn finish_batch(&mut self, failed: &mut Failed) {
        let mut written = std::mem::take(&mut self.written);
        written.sort_by_key(|w| (w.segment, w.offset));
        let mut start = 0;
        while start < written.len() {
            let at = written[start].segment;
            let end = start + written[start..].partition_point(|w| w.segment == at);
            self.finish_segment(at, &mut written[start..end], failed);
            start = end;
        }
        let keep_last = self
            .segments
            .last()
            .is_some_and(|s| !s.closed && s.cursor < self.settings.segment_bytes);
        let done = self.segments.len() - usize::from(keep_last);
        let sealing: Vec<OpenSegment> = self.segments.drain(..done).collect();
        for seg in sealing {
            self.seal(seg);
        }
    }

    /// Finishes the batch's records of segment `at`, which are in offset order.
    fn finish_segment(&mut self, at: usize, records: &mut [Written], failed: &mut Failed) {
        let durable = self.settings.durability == Durability::Fsync;
        if durable && records.iter().any(|w| w.failure.is_none()) {
            if let Err(e) = self.segments[at].file.sync_data() {
                for w in records.iter_mut().filter(|w| w.failure.is_none()) {
                    w.failure = Some(failure_of(&e));
                }
                self.segments[at].closed = true;
            }
        }
        let good_end = records
            .iter()
            .filter(|w| w.failure.is_none())
            .map(|w| w.offset + w.bytes)
            .max();
        let (id, file) = (self.segments[at].id, Arc::clone(&self.segments[at].file));
        let mut rewind_to = None;
        for w in records.iter() {
            let Some(kind) = w.failure else {
                let mut index = self.shared.index();
                index.release(w.bytes);
                index.grow_segment(id, w.offset + w.bytes);
                index.insert(w.key, id, w.offset, w.bytes);
                drop(index);
                add(&self.stats().chunks_stored, 1);
                add(&self.stats().bytes_stored, u64::from(w.len));
                continue;
            };
            failed.add(self.stats(), w.key, kind);
            if good_end.is_some_and(|end| w.offset < end) {
                // Dead space before a good record: a skip record keeps later records reachable
                // by the start-up scan (if it cannot be written, the scan cuts the segment there,
                // which only loses chunks).
                if write_skip(&file, w.offset, w.bytes).is_err() {
                    self.segments[at].closed = true;
                }
                let mut index = self.shared.index();
                index.release(w.bytes);
                index.grow_segment(id, w.offset + w.bytes);
            } else {
                self.shared.index().release(w.bytes);
                rewind_to = Some(rewind_to.map_or(w.offset, |r: u64| r.min(w.offset)));
            }
        }
        if let Some(offset) = rewind_to {
            // The failed tail is given back: the next record (or the seal) goes there.
            let seg = &mut self.segments[at];
            seg.cursor = offset;
            seg.allocated = seg.allocated.min(offset);
            let _ = seg.file.set_len(offset);
        }
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
        let sealed = write_seal(&seg.file, seg.cursor).and_then(|()| {
            if durable {
                seg.file.sync_data()
            } else {
                Ok(())
            }
        });
        let mut index = self.shared.index();
        index.release(SEAL_BYTES);
        if sealed.is_ok() {
            // Unsealed (a failed seal write), it is recovered by the next start's scan.
            index.grow_segment(seg.id, seg.cursor + SEAL_BYTES);
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
        self.batches(job, &job.chunks, failed, Self::load_batch);
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

    fn load_batch(&mut self, chunks: &[Chunk], failed: &mut Failed) {
        let mut items = Vec::with_capacity(chunks.len());
        for &(key, slot, len) in chunks {
            match self.prepare_load(key, slot, len) {
                Ok(item) => items.push(item),
                Err(kind) => failed.add(self.stats(), key, kind),
            }
        }
        self.run_to_completion(items, Self::load_done, failed);
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
            key,
            slot,
            len,
            bytes,
            offset: location.offset,
            segment: 0,
            location: Some(location),
            file,
            direct,
            retried: false,
            corrupt_after_read: false,
            zero_copy,
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

    /// Handles a load's completion; returns the operation to retry buffered after EINVAL.
    fn load_done(
        &mut self,
        mut pending: Pending,
        result: io::Result<usize>,
        buf: AlignedBuf,
        failed: &mut Failed,
    ) -> Option<(Pending, Ready)> {
        match result {
            Ok(n) => {
                self.verify_and_copy(&pending, n, &buf, failed);
                self.pool.put(buf);
                None
            }
            Err(e) if is_einval(&e) && pending.direct && !pending.retried => {
                let location = pending.location.clone()?;
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
                        Some(self.read_item(pending, buf))
                    }
                    Err(e) => {
                        self.pool.put(buf);
                        let kind = self.open_failed(&location, &e);
                        failed.add(self.stats(), pending.key, kind);
                        None
                    }
                }
            }
            Err(e) => {
                // EIO and the like may be transient: the key fails, the record stays.
                self.pool.put(buf);
                failed.add(self.stats(), pending.key, failure_of(&e));
                None
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
            failed.add(self.stats(), key, FailureKind::ShortRead);
            return;
        }
        if pending.zero_copy {
            self.verify_in_slot(pending, buf, failed);
            return;
        }
        let read = &buf.as_full_slice()[..pending.bytes as usize];
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
                failed.add(self.stats(), key, FailureKind::LengthMismatch)
            }
            Err(_) => {
                self.quarantine(key, pending.location.as_ref());
                failed.add(self.stats(), key, FailureKind::Corrupt);
            }
        }
    }

    /// Verifies a record read straight into its slot (header in `buf`, payload in the slot) in
    /// place. A record that does not verify leaves garbage in the slot, which the Tier contract
    /// allows: a failed key is never served.
    fn verify_in_slot(&mut self, pending: &Pending, buf: &AlignedBuf, failed: &mut Failed) {
        let key = pending.key;
        let Some(payload) = self.slot_payload(pending.slot, pending.len) else {
            failed.add(self.stats(), key, FailureKind::Io);
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
                failed.add(self.stats(), key, FailureKind::LengthMismatch)
            }
            Err(_) => {
                self.quarantine(key, pending.location.as_ref());
                failed.add(self.stats(), key, FailureKind::Corrupt);
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
                submitted += self.submit(std::mem::take(&mut ops), &mut waiting, &mut results);
                ops_bytes = 0;
            }
        }
        let mut handle = |worker: &mut Worker, results: &mut Vec<_>| {
            for (pending, result, buf) in results.drain(..) {
                if let Some(retry) = done(worker, pending, result, buf, failed) {
                    retries.push(retry);
                }
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
