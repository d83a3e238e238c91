//! The background workers: each owns an I/O engine, takes whole jobs from the shared job channel
//! one at a time (each batch of a job's chunks in one engine submission), and sends exactly one
//! completion per job. Several workers run jobs concurrently, so that one job's file creations
//! and renames (slow metadata operations) overlap another's transfers; completions may therefore
//! arrive out of submission order. Bookkeeping (index, reservations, faults) is shared under
//! short mutex sections without I/O.
//!
//! Store: reserve capacity (evicting least recently accessed chunks), copy each slot into an
//! aligned buffer behind a header, write it to a fresh temporary file, optionally fsync, and
//! rename it into place. Load: read each file into an aligned buffer, verify header and checksum,
//! and only then copy the payload into the slot; a file that does not verify is removed.
//!
//! Host slots are only touched through [`SlotMemory`] by the worker running the job, between the
//! job's start and the send of its completion, so the tier never touches them after the
//! completion is polled.
//!
//! Races between workers (an eviction or quarantine deleting a file another worker has just
//! republished) can only lose a chunk, never serve wrong bytes: a later load of it misses and
//! drops it from the index.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use offload_core::tier::{SlotMemory, TierCompletion, TierJob, TierOp};
use offload_core::{ChunkKey, JobId, SlotId};

use crate::config::Durability;
use crate::direct::{create_for_write, is_einval, open_for_read, reopen_buffered_for_write, warn};
use crate::error::{io_kind, FsErrorKind};
use crate::fault::{Fault, FaultPlan, FaultSite, FaultState};
use crate::format::{encode_into, file_bytes, verify, ALIGN, HEADER_BYTES};
use crate::index::Index;
use crate::io::{AlignedBuf, IoEngine, IoOp, OpKind};
use crate::layout::Layout;
use crate::stats::{add, FailureKind, StatsCell};

/// The most operations in one engine submission.
const BATCH_OPS_MAX: usize = 1024;
/// Reap errors tolerated (with a short pause each) before the worker gives up on a batch.
const REAP_ERRORS_MAX: u32 = 1000;

/// State shared by the front end, the workers and the prober.
///
/// The root's I/O mode is `stats.direct_io` (O_DIRECT until the first EINVAL).
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) index: Mutex<Index>,
    /// Jobs whose cancellation was requested and whose completion was not sent yet.
    pub(crate) cancelled: Mutex<HashSet<JobId>>,
    pub(crate) stats: StatsCell,
    /// Injected faults, shared by the workers (so that counts and limits are global).
    faults: Option<Mutex<FaultState>>,
}

impl Shared {
    pub(crate) fn new(capacity_bytes: u64, faults: &FaultPlan) -> Self {
        Self {
            index: Mutex::new(Index::new(capacity_bytes)),
            cancelled: Mutex::new(HashSet::new()),
            stats: StatsCell::default(),
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
    /// Exit the loop (after every earlier job).
    Stop,
}

/// The worker's settings.
pub(crate) struct WorkerSettings {
    pub(crate) layout: Layout,
    pub(crate) durability: Durability,
    pub(crate) quiet: bool,
    pub(crate) batch_bytes_max: usize,
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

/// A job's chunk: key, host slot, payload length.
type Chunk = (ChunkKey, SlotId, u32);

/// Runs one batch of a job's chunks.
type BatchFn = fn(&mut Worker, &[Chunk], &mut Failed);

/// One chunk's file operation in flight.
struct Pending {
    key: ChunkKey,
    slot: SlotId,
    len: u32,
    /// File bytes (header and padding included).
    bytes: u64,
    /// The temporary file (store) or the chunk file (load).
    path: PathBuf,
    /// Kept open until the operation's completion is reaped (`None` only after the engine lost
    /// the operation: the descriptor is then leaked on purpose, see [`Worker::execute`]).
    file: Option<File>,
    direct: bool,
    retried: bool,
    /// A fault to apply when the read completes (corruption of the buffer).
    corrupt_after_read: bool,
}

impl Pending {
    /// The descriptor the operation uses (-1, which fails with EBADF, after a lost operation).
    fn fd(&self) -> RawFd {
        self.file.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }
}

/// An operation ready to run, or one whose injected error stands for its completion.
enum Ready {
    Op(IoOp),
    Injected(io::Error, AlignedBuf),
}

/// One worker: runs jobs on its own thread with its own I/O engine.
/// What `store_done` and `load_done` are: they take one completed operation and return the
/// operation to retry, if any.
type CompletionHandler = fn(
    &mut Worker,
    Pending,
    io::Result<usize>,
    AlignedBuf,
    &mut Failed,
) -> Option<(Pending, Ready)>;

pub(crate) struct Worker {
    engine: Box<dyn IoEngine>,
    memory: Arc<dyn SlotMemory>,
    shared: Arc<Shared>,
    settings: WorkerSettings,
    pool: BufPool,
    next_tag: u64,
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
        }
    }

    /// Runs jobs until `Stop` or until the front end is gone.
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
    }

    /// The completion of a job whose run panicked: every key failed.
    fn panicked(&self, job: &TierJob) -> TierCompletion {
        let mut failed = Failed::default();
        for &(key, _, _) in &job.chunks {
            failed.add(self.stats(), key, FailureKind::Io);
        }
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

    /// Splits `chunks` into batches of at most `batch_bytes_max` file bytes (at least one chunk)
    /// and [`BATCH_OPS_MAX`] chunks; returns the end of the batch starting at `start`.
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
        let mut victims = Vec::new();
        let mut accepted = Vec::new();
        {
            let mut index = self.shared.index();
            for &(key, slot, len) in chunks {
                let bytes = file_bytes(u64::from(len));
                match index.reserve(bytes, &|_| false) {
                    Some(evicted) => {
                        victims.extend(evicted);
                        accepted.push((key, slot, len, bytes));
                    }
                    None => failed.add(&self.shared.stats, key, FailureKind::Capacity),
                }
            }
        }
        for (key, bytes) in victims {
            // A file already gone is as good as deleted.
            let _ = fs::remove_file(self.settings.layout.chunk_path(key));
            add(&self.stats().evictions, 1);
            add(&self.stats().evicted_bytes, bytes);
        }
        let mut items = Vec::with_capacity(accepted.len());
        for (key, slot, len, bytes) in accepted {
            match self.prepare_store(key, slot, len, bytes) {
                Ok(item) => items.push(item),
                Err(kind) => {
                    self.shared.index().release(bytes);
                    failed.add(self.stats(), key, kind);
                }
            }
        }
        self.run_to_completion(items, Self::store_done, failed);
    }

    /// Opens the temporary file and fills the buffer; a failure has removed the temporary file.
    fn prepare_store(
        &mut self,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
        bytes: u64,
    ) -> Result<(Pending, Ready), FailureKind> {
        let path = self.settings.layout.temp_path(key);
        let direct = self.direct();
        let opened = match self.shared.fault(FaultSite::Open, key, direct) {
            Some(fault) => Err(fault_error(fault)),
            None => create_for_write(&path, direct),
        };
        let (file, direct) = match opened {
            Ok(file) => (file, direct),
            Err(e) if is_einval(&e) && direct => {
                self.fall_back(&format!("open {path:?} with O_DIRECT: {e}"));
                // EINVAL may come after the file was created; the name is ours alone.
                let _ = fs::remove_file(&path);
                match create_for_write(&path, false) {
                    Ok(file) => (file, false),
                    Err(e) => return Err(self.discard_temp(&path, &e)),
                }
            }
            Err(e) => return Err(self.discard_temp(&path, &e)),
        };
        let mut buf = match self.pool.get(bytes as usize) {
            Ok(buf) => buf,
            Err(e) => {
                drop(file);
                return Err(self.discard_temp(&path, &e));
            }
        };
        let memory = &self.memory;
        let (total, _) = encode_into(buf.as_full_mut_slice(), key, len as usize, |dst| {
            memory.read_slot(slot, 0, dst)
        });
        debug_assert_eq!(total as u64, bytes);
        buf.set_len(total);
        let pending = Pending {
            key,
            slot,
            len,
            bytes,
            path,
            file: Some(file),
            direct,
            retried: false,
            corrupt_after_read: false,
        };
        Ok(self.write_item(pending, buf))
    }

    fn discard_temp(&self, path: &std::path::Path, error: &io::Error) -> FailureKind {
        let _ = fs::remove_file(path);
        failure_of(error)
    }

    /// The write of a prepared store, with the write faults applied.
    fn write_item(&mut self, pending: Pending, mut buf: AlignedBuf) -> (Pending, Ready) {
        let mut len = pending.bytes as usize;
        match self
            .shared
            .fault(FaultSite::Write, pending.key, pending.direct)
        {
            Some(Fault::Short) => len = short_len(len),
            Some(Fault::Corrupt) => flip_payload_byte(buf.as_full_mut_slice(), pending.len),
            Some(fault) => return (pending, Ready::Injected(fault_error(fault), buf)),
            None => {}
        }
        buf.set_len(pending.bytes as usize);
        let op = IoOp {
            tag: self.tag(),
            kind: OpKind::Write,
            fd: pending.fd(),
            offset: 0,
            len,
            buf,
        };
        (pending, Ready::Op(op))
    }

    /// Handles a store's completion; returns the operation to retry buffered after EINVAL.
    fn store_done(
        &mut self,
        mut pending: Pending,
        result: io::Result<usize>,
        buf: AlignedBuf,
        failed: &mut Failed,
    ) -> Option<(Pending, Ready)> {
        match result {
            Ok(n) if n as u64 == pending.bytes => {
                self.pool.put(buf);
                self.publish(pending, failed);
                None
            }
            Ok(_) => {
                self.pool.put(buf);
                self.abandon_store(pending, FailureKind::ShortWrite, failed);
                None
            }
            Err(e) if is_einval(&e) && pending.direct && !pending.retried => {
                self.fall_back(&format!("write {:?} at offset 0: {e}", pending.path));
                match reopen_buffered_for_write(&pending.path) {
                    Ok(file) => {
                        add(&self.stats().buffered_retries, 1);
                        pending.file = Some(file);
                        pending.direct = false;
                        pending.retried = true;
                        Some(self.write_item(pending, buf))
                    }
                    Err(e) => {
                        self.pool.put(buf);
                        self.abandon_store(pending, failure_of(&e), failed);
                        None
                    }
                }
            }
            Err(e) => {
                self.pool.put(buf);
                self.abandon_store(pending, failure_of(&e), failed);
                None
            }
        }
    }

    /// Removes a failed store's temporary file and gives back its reservation.
    fn abandon_store(&mut self, pending: Pending, kind: FailureKind, failed: &mut Failed) {
        drop(pending.file);
        let _ = fs::remove_file(&pending.path);
        self.shared.index().release(pending.bytes);
        failed.add(self.stats(), pending.key, kind);
    }

    /// Makes a fully written temporary file the chunk file (fsync around the rename if asked).
    fn publish(&mut self, pending: Pending, failed: &mut Failed) {
        let durable = self.settings.durability == Durability::Fsync;
        if durable {
            let synced = pending.file.as_ref().map_or(Ok(()), File::sync_all);
            if let Err(e) = synced {
                let kind = failure_of(&e);
                self.abandon_store(pending, kind, failed);
                return;
            }
        }
        let final_path = self.settings.layout.chunk_path(pending.key);
        if let Err(e) = fs::rename(&pending.path, &final_path) {
            let kind = failure_of(&e);
            self.abandon_store(pending, kind, failed);
            return;
        }
        if durable {
            let synced = final_path
                .parent()
                .map(|dir| File::open(dir).and_then(|d| d.sync_all()));
            if let Some(Err(e)) = synced {
                let _ = fs::remove_file(&final_path);
                let kind = failure_of(&e);
                self.abandon_store(pending, kind, failed);
                return;
            }
        }
        self.shared.index().commit(pending.key, pending.bytes);
        add(&self.stats().chunks_stored, 1);
        add(&self.stats().bytes_stored, u64::from(pending.len));
    }

    // ---------------------------------------------------------------- load

    fn load(&mut self, job: &TierJob, failed: &mut Failed) {
        self.batches(job, &job.chunks, failed, Self::load_batch);
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

    fn prepare_load(
        &mut self,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
    ) -> Result<(Pending, Ready), FailureKind> {
        let bytes = file_bytes(u64::from(len));
        let stored = {
            let mut index = self.shared.index();
            let stored = index.file_bytes(key);
            index.touch(key);
            stored
        };
        match stored {
            None => return Err(FailureKind::Missing),
            Some(s) if s != bytes => return Err(FailureKind::LengthMismatch),
            Some(_) => {}
        }
        let path = self.settings.layout.chunk_path(key);
        let direct = self.direct();
        let opened = match self.shared.fault(FaultSite::Open, key, direct) {
            Some(fault) => Err(fault_error(fault)),
            None => open_for_read(&path, direct),
        };
        let (file, direct) = match opened {
            Ok(file) => (file, direct),
            Err(e) if is_einval(&e) && direct => {
                self.fall_back(&format!("open {path:?} with O_DIRECT: {e}"));
                match open_for_read(&path, false) {
                    Ok(file) => (file, false),
                    Err(e) => return Err(self.open_failed(key, &e)),
                }
            }
            Err(e) => return Err(self.open_failed(key, &e)),
        };
        let buf = self.pool.get(bytes as usize).map_err(|e| failure_of(&e))?;
        let pending = Pending {
            key,
            slot,
            len,
            bytes,
            path,
            file: Some(file),
            direct,
            retried: false,
            corrupt_after_read: false,
        };
        Ok(self.read_item(pending, buf))
    }

    fn open_failed(&self, key: ChunkKey, error: &io::Error) -> FailureKind {
        if error.kind() == io::ErrorKind::NotFound {
            // Gone (evicted by another instance sharing the directory): drop it from the index.
            self.shared.index().remove(key);
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
        buf.clear();
        let op = IoOp {
            tag: self.tag(),
            kind: OpKind::Read,
            fd: pending.fd(),
            offset: 0,
            len,
            buf,
        };
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
                self.fall_back(&format!("read {:?} at offset 0: {e}", pending.path));
                match open_for_read(&pending.path, false) {
                    Ok(file) => {
                        add(&self.stats().buffered_retries, 1);
                        pending.file = Some(file);
                        pending.direct = false;
                        pending.retried = true;
                        Some(self.read_item(pending, buf))
                    }
                    Err(e) => {
                        self.pool.put(buf);
                        let kind = self.open_failed(pending.key, &e);
                        failed.add(self.stats(), pending.key, kind);
                        None
                    }
                }
            }
            Err(e) => {
                // EIO and the like may be transient: the key fails, the file stays.
                self.pool.put(buf);
                failed.add(self.stats(), pending.key, failure_of(&e));
                None
            }
        }
    }

    /// Verifies `n` bytes read for `pending` and copies the payload into its slot; a short or
    /// corrupt file is removed.
    fn verify_and_copy(
        &mut self,
        pending: &Pending,
        n: usize,
        buf: &AlignedBuf,
        failed: &mut Failed,
    ) {
        let key = pending.key;
        if (n as u64) < pending.bytes {
            self.quarantine(key, &pending.path);
            failed.add(self.stats(), key, FailureKind::ShortRead);
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
                self.quarantine(key, &pending.path);
                failed.add(self.stats(), key, FailureKind::Corrupt);
            }
        }
    }

    /// Removes a chunk whose file does not verify, from the index and the disk.
    fn quarantine(&self, key: ChunkKey, path: &std::path::Path) {
        self.shared.index().remove(key);
        let _ = fs::remove_file(path);
        add(&self.stats().quarantined, 1);
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

    /// Executes `items`, handing each result to `done`, and executes again whatever `done` asks to
    /// retry (a buffered retry after EINVAL), until nothing is left.
    fn run_to_completion(
        &mut self,
        mut items: Vec<(Pending, Ready)>,
        done: CompletionHandler,
        failed: &mut Failed,
    ) {
        while !items.is_empty() {
            let results = self.execute(items);
            items = Vec::new();
            for (pending, result, buf) in results {
                if let Some(retry) = done(self, pending, result, buf, failed) {
                    items.push(retry);
                }
            }
        }
    }

    /// Submits the ready operations in one batch and reaps them all; injected errors complete
    /// at once. Returns every item with its result and buffer.
    fn execute(
        &mut self,
        items: Vec<(Pending, Ready)>,
    ) -> Vec<(Pending, io::Result<usize>, AlignedBuf)> {
        let mut results = Vec::with_capacity(items.len());
        let mut waiting: HashMap<u64, Pending> = HashMap::new();
        let mut ops = Vec::new();
        for (pending, ready) in items {
            match ready {
                Ready::Injected(error, buf) => results.push((pending, Err(error), buf)),
                Ready::Op(op) => {
                    waiting.insert(op.tag, pending);
                    ops.push(op);
                }
            }
        }
        if ops.is_empty() {
            return results;
        }
        let count = ops.len();
        if let Err((error, ops)) = self.engine.submit(ops) {
            for op in ops {
                if let Some(pending) = waiting.remove(&op.tag) {
                    let error = io::Error::new(error.kind(), format!("submit: {error}"));
                    results.push((pending, Err(error), op.buf));
                }
            }
            return results;
        }
        let mut done = Vec::with_capacity(count);
        let mut errors = 0;
        while done.len() < count && self.engine.in_flight() > 0 {
            let missing = count - done.len();
            if self.engine.reap(&mut done, missing).is_err() {
                errors += 1;
                if errors > REAP_ERRORS_MAX {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        for completion in done {
            if let Some(pending) = waiting.remove(&completion.tag) {
                results.push((pending, completion.result, completion.buf));
            }
        }
        for (_, mut pending) in waiting {
            // The engine still owns the operation and its buffer: leak the descriptor so that
            // its number is not reused while the engine may still use it, and fail the chunk.
            if let Some(file) = pending.file.take() {
                let _ = file.into_raw_fd();
            }
            let error = io::Error::other("the I/O engine lost the operation");
            results.push((pending, Err(error), AlignedBuf::with_capacity(0)));
        }
        results
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
