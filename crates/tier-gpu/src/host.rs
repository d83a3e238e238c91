//! The host path of the primary tier: a host pool allocated once at its exact size and prefaulted
//! in parallel ([`HostPoolMemory`]), a small pool of memcpy threads ([`HostCopier`]), and the
//! job-level [`HostTransferEngine`] for engines whose KV cache lives in host memory (machines
//! without a GPU, CPU engines, the engine simulator).

use std::collections::VecDeque;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use offload_core::{Job, JobId, JobKind, SlotId, SlotMemory};

use crate::plan::{CopyRun, KvLayout};
use crate::{TransferDone, TransferEngine, TransferError};

const PAGE_BYTES: usize = 4096;

/// Runs smaller than this are not split across threads.
const SPLIT_MIN_BYTES: usize = 512 * 1024;

/// The host pool's bytes: one anonymous mapping of exactly `slot_count * slot_bytes` bytes, every
/// page touched once at start by several threads (first touch runs at ~0.3 GiB/s on one thread).
pub struct HostPoolMemory {
    map: memmap2::MmapMut,
    base: NonNull<u8>,
    slot_bytes: usize,
    slot_count: u32,
}

// SAFETY: the mapping is owned for the value's lifetime; concurrent access to slot bytes follows
// the `Tier`/`TransferEngine` ownership contract (one writer per slot, no reads while written).
unsafe impl Send for HostPoolMemory {}
// SAFETY: as above; `&self` methods only copy bytes of slots the caller owns by that contract.
unsafe impl Sync for HostPoolMemory {}

/// Bytes of a pool of `slot_count` slots of `slot_bytes`, or why that is no size.
fn pool_bytes(slot_bytes: usize, slot_count: u32) -> io::Result<usize> {
    slot_bytes
        .checked_mul(slot_count as usize)
        .filter(|&b| b > 0)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("host pool of {slot_count} slots of {slot_bytes} bytes: bad size"),
            )
        })
}

impl HostPoolMemory {
    /// Maps `slot_count` slots of `slot_bytes` each and prefaults them in parallel.
    pub fn new(slot_bytes: usize, slot_count: u32) -> io::Result<Self> {
        let bytes = pool_bytes(slot_bytes, slot_count)?;
        let pool = Self::over(
            memmap2::MmapOptions::new().len(bytes).map_anon()?,
            slot_bytes,
            slot_count,
        )?;
        pool.prefault();
        Ok(pool)
    }

    /// The same, over the file at `path` (created with mode 0600 if missing, sized to exactly
    /// `slot_count * slot_bytes`), mapped shared: processes that open one path share the pool's
    /// bytes (a file in `/dev/shm` is host memory). A file of another non-zero size is refused,
    /// naming the path and both sizes.
    pub fn open_shared(
        path: &std::path::Path,
        slot_bytes: usize,
        slot_count: u32,
    ) -> io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;

        let bytes = pool_bytes(slot_bytes, slot_count)?;
        let with_path = |e: io::Error| {
            io::Error::new(e.kind(), format!("host pool file {}: {e}", path.display()))
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(with_path)?;
        let len = file.metadata().map_err(with_path)?.len();
        if len == 0 {
            file.set_len(bytes as u64).map_err(with_path)?;
        } else if len != bytes as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "host pool file {} holds {len} bytes, not the {bytes} of {slot_count} slots \
                     of {slot_bytes} bytes",
                    path.display()
                ),
            ));
        }
        // SAFETY: the mapping is of a file this pool's users share on purpose; concurrent access
        // to slot bytes follows the Tier/TransferEngine ownership contract across processes, as
        // within one. Nobody truncates the file while it is mapped (only removed after use).
        let map =
            unsafe { memmap2::MmapOptions::new().len(bytes).map_mut(&file) }.map_err(with_path)?;
        let pool = Self::over(map, slot_bytes, slot_count)?;
        pool.prefault_shared();
        Ok(pool)
    }

    /// The pool over `map` (of `slot_count` slots of `slot_bytes`), not yet prefaulted.
    fn over(mut map: memmap2::MmapMut, slot_bytes: usize, slot_count: u32) -> io::Result<Self> {
        let base =
            NonNull::new(map.as_mut_ptr()).ok_or_else(|| io::Error::other("null mapping"))?;
        Ok(Self {
            map,
            base,
            slot_bytes,
            slot_count,
        })
    }

    /// Touches every page of a shared mapping without changing its bytes (another process may
    /// already have written them).
    fn prefault_shared(&self) {
        let len = self.map.len();
        let base = self.base.as_ptr() as usize;
        let mut at = 0;
        while at < len {
            // SAFETY: `at` is inside the mapping; a volatile read of one byte changes nothing.
            unsafe { std::ptr::read_volatile((base + at) as *const u8) };
            at += PAGE_BYTES;
        }
    }

    /// Touches every page, split among the machine's cores.
    fn prefault(&self) {
        let len = self.map.len();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(16);
        let per = len.div_ceil(threads).next_multiple_of(PAGE_BYTES);
        let base = self.base.as_ptr() as usize;
        std::thread::scope(|scope| {
            for t in 0..threads {
                let lo = t * per;
                let hi = (lo + per).min(len);
                scope.spawn(move || {
                    let mut at = lo;
                    while at < hi {
                        // SAFETY: `at` is inside the mapping (at < len), which outlives the scope;
                        // each thread touches its own disjoint page range.
                        unsafe { ((base + at) as *mut u8).write_volatile(0) };
                        at += PAGE_BYTES;
                    }
                });
            }
        });
    }

    /// The first byte of the pool.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Bytes in the pool.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the pool is empty (never: a pool has at least one slot).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn range(&self, slot: SlotId, offset: usize, len: usize) -> usize {
        assert!(
            slot.0 < self.slot_count,
            "slot {} outside a pool of {}",
            slot.0,
            self.slot_count
        );
        assert!(
            offset + len <= self.slot_bytes,
            "range past the end of slot {}",
            slot.0
        );
        slot.0 as usize * self.slot_bytes + offset
    }
}

impl SlotMemory for HostPoolMemory {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        self.slot_count
    }

    fn read_slot(&self, slot: SlotId, offset: usize, dst: &mut [u8]) {
        let at = self.range(slot, offset, dst.len());
        // SAFETY: the range is inside the mapping (checked); the caller owns the slot for reading.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(at), dst.as_mut_ptr(), dst.len()) }
    }

    fn write_slot(&self, slot: SlotId, offset: usize, src: &[u8]) {
        let at = self.range(slot, offset, src.len());
        // SAFETY: the range is inside the mapping (checked); the caller owns the slot for writing.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.as_ptr().add(at), src.len()) }
    }

    fn slot_ptr(&self, slot: SlotId) -> Option<NonNull<u8>> {
        let at = self.range(slot, 0, 0);
        // SAFETY: `at` is inside the mapping.
        NonNull::new(unsafe { self.as_ptr().add(at) })
    }
}

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Engine memory into the host pool (a store).
    ToHost,
    /// Host pool into engine memory (a load).
    ToEngine,
}

/// Completion state of one batch of copies, shared with the copy threads.
#[derive(Debug, Default)]
struct Batch {
    remaining: AtomicUsize,
    failed: AtomicBool,
    done: Mutex<bool>,
    cv: Condvar,
}

impl Batch {
    fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    fn finish_piece(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
            *done = true;
            self.cv.notify_all();
        }
    }

    fn wait(&self) {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while !*done && !self.is_done() {
            done = self.cv.wait(done).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits until the batch is done or `deadline` passes; returns whether it is done.
    fn wait_until(&self, deadline: std::time::Instant) -> bool {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while !*done && !self.is_done() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            done = self
                .cv
                .wait_timeout(done, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

/// One piece of work for a copy thread: raw `(src, dst, len)` copies.
struct Piece {
    copies: Vec<(usize, usize, usize)>,
    batch: Arc<Batch>,
}

/// A small pool of memcpy threads. Copies are split into pieces of balanced size, one per thread
/// (large runs are cut), so one job uses every thread.
pub struct HostCopier {
    tx: Option<Sender<Piece>>,
    threads: Vec<JoinHandle<()>>,
}

impl HostCopier {
    /// Starts `threads` copy threads (at least one).
    pub fn new(threads: usize) -> io::Result<Self> {
        let threads = threads.max(1);
        let (tx, rx) = crossbeam_channel::bounded::<Piece>(threads * 64);
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let rx: Receiver<Piece> = rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("kvtier-copy-{i}"))
                .spawn(move || copy_thread(&rx))?;
            handles.push(handle);
        }
        Ok(Self {
            tx: Some(tx),
            threads: handles,
        })
    }

    /// One thread per core, at most 8.
    pub fn with_default_threads() -> io::Result<Self> {
        Self::new(
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(8),
        )
    }

    /// Number of copy threads.
    pub fn thread_count(&self) -> usize {
        self.threads.len()
    }

    /// Copies `runs` between `engine` (run `engine_addr` is an offset into it) and `host`, using
    /// the copy threads, and returns when every byte was copied. Fails, copying nothing, if a run
    /// is out of bounds or two runs write overlapping bytes.
    pub fn copy(
        &self,
        direction: Direction,
        engine: &mut [u8],
        host: &mut [u8],
        runs: &[CopyRun],
    ) -> Result<(), String> {
        let (engine_len, host_len) = (engine.len() as u64, host.len() as u64);
        let mut dst: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
        for r in runs {
            let engine_end = r
                .engine_addr
                .checked_add(r.len)
                .filter(|&e| e <= engine_len);
            let host_end = r.host_offset.checked_add(r.len).filter(|&e| e <= host_len);
            if engine_end.is_none() || host_end.is_none() {
                return Err(format!("copy run {r:?} is out of bounds"));
            }
            dst.push(match direction {
                Direction::ToHost => (r.host_offset, r.len),
                Direction::ToEngine => (r.engine_addr, r.len),
            });
        }
        dst.sort_unstable();
        if dst.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err("copy runs write overlapping bytes".to_string());
        }
        let (e, h) = (engine.as_mut_ptr() as usize, host.as_mut_ptr() as usize);
        let copies: Vec<(usize, usize, usize)> = runs
            .iter()
            .map(|r| {
                let (ea, ha, len) = (
                    e + r.engine_addr as usize,
                    h + r.host_offset as usize,
                    r.len as usize,
                );
                match direction {
                    Direction::ToHost => (ea, ha, len),
                    Direction::ToEngine => (ha, ea, len),
                }
            })
            .collect();
        let batch = self.spawn(copies, true);
        // The slices stay borrowed until every piece has finished.
        batch.wait();
        if batch.failed.load(Ordering::Acquire) {
            return Err("a copy thread failed".to_string());
        }
        Ok(())
    }

    /// Splits raw copies into balanced pieces and hands them to the threads; with `help`, the
    /// calling thread copies the last piece itself.
    fn spawn(&self, copies: Vec<(usize, usize, usize)>, help: bool) -> Arc<Batch> {
        let pieces = split(copies, self.threads.len());
        let batch = Arc::new(Batch::default());
        batch
            .remaining
            .store(pieces.len().max(1), Ordering::Release);
        if pieces.is_empty() {
            batch.finish_piece();
            return batch;
        }
        let mut pieces = pieces.into_iter();
        let own = if help { pieces.next_back() } else { None };
        for copies in pieces {
            let piece = Piece {
                copies,
                batch: batch.clone(),
            };
            let sent = self.tx.as_ref().map(|tx| tx.send(piece));
            if !matches!(sent, Some(Ok(()))) {
                batch.failed.store(true, Ordering::Release);
                batch.finish_piece();
            }
        }
        if let Some(copies) = own {
            run_piece(&Piece {
                copies,
                batch: batch.clone(),
            });
        }
        batch
    }
}

impl Drop for HostCopier {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn copy_thread(rx: &Receiver<Piece>) {
    while let Ok(piece) = rx.recv() {
        run_piece(&piece);
    }
}

fn run_piece(piece: &Piece) {
    for &(src, dst, len) in &piece.copies {
        // SAFETY: every copy was bounds-checked against memory that stays valid until the batch
        // completes (the submitter waits for it, or the job owns the memory until reaped), and
        // destinations do not overlap other copies in flight (checked by the submitter).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
    }
    piece.batch.finish_piece();
}

/// Splits copies into at most `parts` pieces of about equal bytes, cutting large copies.
fn split(copies: Vec<(usize, usize, usize)>, parts: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let total: usize = copies.iter().map(|c| c.2).sum();
    if total == 0 {
        return Vec::new();
    }
    let parts = parts.clamp(1, (total / SPLIT_MIN_BYTES).max(1));
    let target = total.div_ceil(parts);
    let mut out = Vec::with_capacity(parts);
    let mut current = Vec::new();
    let mut filled = 0usize;
    for (src, dst, len) in copies {
        let mut done = 0;
        while done < len {
            let take = (len - done).min(target - filled);
            current.push((src + done, dst + done, take));
            done += take;
            filled += take;
            if filled == target {
                out.push(std::mem::take(&mut current));
                filled = 0;
            }
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// One submitted job of a [`HostTransferEngine`].
struct InFlight {
    job: JobId,
    kind: JobKind,
    batch: Arc<Batch>,
}

/// The job-level host path: plans each job with the [`KvLayout`] (regions at host addresses) and
/// copies through a shared [`HostCopier`] into or out of a [`HostPoolMemory`].
pub struct HostTransferEngine {
    layout: KvLayout,
    pool: Arc<HostPoolMemory>,
    copier: Arc<HostCopier>,
    queues: [VecDeque<InFlight>; 2],
    /// Most jobs in flight per direction.
    jobs_in_flight_max: usize,
    runs: Vec<CopyRun>,
}

impl HostTransferEngine {
    /// Creates an engine over engine memory described by `layout` and the host `pool`.
    ///
    /// # Safety
    ///
    /// Every region of `layout` must be valid host memory for the engine's whole lifetime, and the
    /// caller must follow the [`TransferEngine`] ownership contract: the engine blocks and slots a
    /// job names are not written by anyone else until its completion is reported.
    pub unsafe fn new(
        layout: KvLayout,
        pool: Arc<HostPoolMemory>,
        copier: Arc<HostCopier>,
        jobs_in_flight_max: usize,
    ) -> Result<Self, String> {
        if layout.slot_bytes() != pool.slot_bytes() as u64
            || layout.slot_count() != pool.slot_count()
        {
            return Err(format!(
                "layout needs {} slots of {} bytes, the host pool has {} of {}",
                layout.slot_count(),
                layout.slot_bytes(),
                pool.slot_count(),
                pool.slot_bytes()
            ));
        }
        Ok(Self {
            layout,
            pool,
            copier,
            queues: [VecDeque::new(), VecDeque::new()],
            jobs_in_flight_max: jobs_in_flight_max.max(1),
            runs: Vec::new(),
        })
    }

    fn queue_of(kind: JobKind) -> usize {
        match kind {
            JobKind::Store => 0,
            JobKind::Load => 1,
        }
    }
}

impl TransferEngine for HostTransferEngine {
    /// The engine's KV cache is host memory written by the calling thread: its compute is done
    /// when the forward call returns, so there is nothing to wait for.
    type Dependency = ();

    fn submit_after(&mut self, job: &Job, _after: Option<()>) -> Result<(), TransferError> {
        // Bounded per direction, so a burst of stores never holds back a load.
        let in_flight = self.queues[Self::queue_of(job.kind)].len();
        if in_flight >= self.jobs_in_flight_max {
            return Err(TransferError::Busy { in_flight });
        }
        self.layout
            .plan(&job.transfers, &mut self.runs)
            .map_err(|source| TransferError::Plan {
                job: job.id,
                source,
            })?;
        let host = self.pool.as_ptr() as usize;
        let copies = self
            .runs
            .iter()
            .map(|r| {
                let (engine, pool) = (r.engine_addr as usize, host + r.host_offset as usize);
                match job.kind {
                    JobKind::Store => (engine, pool, r.len as usize),
                    JobKind::Load => (pool, engine, r.len as usize),
                }
            })
            .collect();
        let batch = self.copier.spawn(copies, false);
        self.queues[Self::queue_of(job.kind)].push_back(InFlight {
            job: job.id,
            kind: job.kind,
            batch,
        });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<TransferDone>) {
        for queue in &mut self.queues {
            while queue.front().is_some_and(|f| f.batch.is_done()) {
                if let Some(f) = queue.pop_front() {
                    let success = !f.batch.failed.load(Ordering::Acquire);
                    out.push(TransferDone {
                        job: f.job,
                        kind: f.kind,
                        success,
                    });
                }
            }
        }
    }

    fn wait(&mut self, job: JobId) {
        for queue in &self.queues {
            if let Some(at) = queue.iter().position(|f| f.job == job) {
                for f in queue.iter().take(at + 1) {
                    f.batch.wait();
                }
            }
        }
    }

    fn drain(&mut self) {
        for queue in &self.queues {
            for f in queue {
                f.batch.wait();
            }
        }
    }
    fn drain_until(&mut self, deadline: std::time::Instant) -> bool {
        self.queues
            .iter()
            .flatten()
            .all(|f| f.batch.wait_until(deadline))
    }
}

impl Drop for HostTransferEngine {
    fn drop(&mut self) {
        // Memory the copy threads may still write belongs to the in-flight jobs: wait for them.
        self.drain();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_batch_wait_with_a_deadline_returns_at_it_while_a_piece_is_stuck() {
        // Issue 18 item 5: the host engine's drain waited for its copy threads with no bound.
        let batch = Arc::new(Batch {
            remaining: AtomicUsize::new(2),
            ..Batch::default()
        });
        batch.finish_piece();
        assert!(
            !batch.wait_until(Instant::now() + Duration::from_millis(5)),
            "one piece is still running: not done"
        );
        let other = Arc::clone(&batch);
        let finisher = std::thread::spawn(move || other.finish_piece());
        assert!(batch.wait_until(Instant::now() + Duration::from_secs(60)));
        finisher.join().expect("the finisher ended");
    }
}
