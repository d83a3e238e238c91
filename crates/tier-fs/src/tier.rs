//! [`FsTier`]: the disk tier's `Tier` implementation. The front end (this type) lives on the
//! caller's thread and never waits for I/O: lookups answer from the in-memory index, submits go
//! to the workers through bounded channels, polls drain the completion channel. Stores go to one
//! writer thread (one sequential append stream for the root), loads to `workers` load threads,
//! each with its own channel: a load job goes to the first load thread with room for it in eight
//! pipelines' worth of jobs (`pick_loader`), which runs the jobs it is sent as a pipeline. Each
//! thread owns one I/O engine (see the `worker` module).

use std::collections::VecDeque;
use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError, TrySendError};
use offload_core::tier::{
    SlotMemory, SubmitError, Tier, TierChunk, TierCompletion, TierFailure, TierJob, TierLookup,
    TierOp,
};
use offload_core::{ChunkKey, JobBook, JobId, Medium, RequestId};

use crate::config::{EngineChoice, FsTierConfig};
use crate::direct::{probe_direct, warn};
use crate::error::FsError;
use crate::format::file_bytes;
use crate::io::sync::SyncEngine;
use crate::io::uring::UringEngine;
use crate::io::IoEngine;
use crate::layout::{new_instance_id, write_or_check_namespace_file, Layout};
use crate::probe::Prober;
use crate::scan::{scan, SweepPolicy};
use crate::stats::{add, FailureKind, FsStats, StatsCell};
use crate::worker::{Msg, Shared, Worker, WorkerSettings};

/// A load worker is sent this many pipelines' worth of jobs (`batch_bytes_max` each; those
/// beyond its pipeline wait in its channel) before the next worker gets any. A second worker
/// only helps when the first cannot keep up with verifying and copying; on the development
/// machine's disk the jobs spread over four workers put their reads at the disk side by side,
/// which it reads slower: the bench's eight 32 MiB jobs of 8 MiB chunks loaded at 0.75-0.80 of
/// the raw ceiling with four pipelines' worth per worker (the eighth job spilled to a second
/// worker) and at 0.87-0.94 with eight (`docs/perf.md`, disk tier).
const LOADER_PIPELINES: u64 = 8;

/// How often a shutdown checks whether the worker threads ended.
const STOP_POLL_INTERVAL: Duration = Duration::from_millis(1);

/// The disk tier. Start it with [`FsTier::start`]; it implements [`Tier`].
///
/// Dropping it shuts it down (cancels, drains, joins the workers, within `shutdown_deadline`).
pub struct FsTier {
    shared: Arc<Shared>,
    engine_name: &'static str,
    namespace_dir: PathBuf,
    slot_count: u32,
    slot_bytes: usize,
    jobs_in_flight_max: usize,
    /// Load jobs, one channel per load worker (see [`FsTier::loader_for`]).
    loaders: Option<Vec<Sender<Msg>>>,
    /// Record bytes of the load jobs sent to each load worker and not completed yet.
    loader_bytes: Vec<u64>,
    /// The record bytes of load jobs a load worker is sent before the next gets jobs:
    /// [`LOADER_PIPELINES`] times its pipeline budget ([`FsTierConfig::batch_bytes_max`]).
    loader_budget: u64,
    /// Store jobs, for the writer.
    stores: Option<Sender<Msg>>,
    done: Receiver<TierCompletion>,
    /// Completions received from the workers (checked against `book`) and not yet returned by
    /// `poll`.
    ready: VecDeque<TierCompletion>,
    /// Accepted jobs whose completion was not received from the workers yet, with their keys
    /// and whether a cancel was passed on (offload-core's ledger).
    book: JobBook<Option<(usize, u64)>>,
    workers: Vec<JoinHandle<()>>,
    prober: Option<Prober>,
    shut_down: bool,
    /// How long a shutdown waits for jobs and threads (see [`FsTierConfig::shutdown_deadline`]).
    shutdown_deadline: Duration,
    /// How long `Tier::drain` waits (see [`FsTierConfig::drain_deadline`]).
    drain_deadline: Duration,
    /// Whether a drain timeout was warned about (once per tier; each is counted).
    drain_timeout_warned: bool,
    quiet: bool,
    /// Holds the namespace directory's lock (see `prepare_dirs`) until the tier shuts down.
    dir_lock: Option<File>,
}

impl std::fmt::Debug for FsTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsTier")
            .field("namespace_dir", &self.namespace_dir)
            .field("engine", &self.engine_name)
            .field("jobs_in_flight", &(self.book.len() + self.ready.len()))
            .field("shut_down", &self.shut_down)
            .finish()
    }
}

/// Creates one I/O engine per worker and one for the writer; `Auto` probes io_uring once, and a
/// fallback from it is warned about.
fn create_engines(
    config: &FsTierConfig,
    stats: &StatsCell,
) -> Result<Vec<Box<dyn IoEngine>>, FsError> {
    let sync = || -> Result<Box<dyn IoEngine>, FsError> {
        SyncEngine::new(config.threads)
            .map(|e| Box::new(e) as Box<dyn IoEngine>)
            .map_err(|e| FsError::Worker(format!("starting the sync engine: {e}")))
    };
    let uring = || -> Result<Box<dyn IoEngine>, String> {
        UringEngine::new(config.uring_entries)
            .map(|e| Box::new(e) as Box<dyn IoEngine>)
            .map_err(|e| format!("io_uring_setup: {e}"))
    };
    let use_uring = match config.engine {
        EngineChoice::Sync => false,
        EngineChoice::Uring => {
            UringEngine::probe().map_err(FsError::Unsupported)?;
            true
        }
        EngineChoice::Auto => match UringEngine::probe() {
            Ok(()) => true,
            Err(reason) => {
                warn(
                    stats,
                    config.quiet,
                    &format!("io_uring unavailable ({reason}); using the sync engine"),
                );
                false
            }
        },
    };
    (0..config.workers + 1)
        .map(|_| {
            if use_uring {
                uring().map_err(FsError::Unsupported)
            } else {
                sync()
            }
        })
        .collect()
}

/// Creates the namespace directory (owner-only permissions) and its config file, and takes the
/// directory's lock: exclusive in a private directory, shared in a shared one. The lock lasts
/// as long as the returned file is open (flock; released by the kernel if the process dies).
fn prepare_dirs(layout: &Layout, config: &FsTierConfig) -> Result<File, FsError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(layout.dir())
        .map_err(|e| FsError::io("mkdir", layout.dir(), 0, e))?;
    let path = layout.dir().join(crate::layout::LOCK_FILE);
    let lock = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(crate::direct::FILE_MODE)
        .open(&path)
        .map_err(|e| FsError::io("open", &path, 0, e))?;
    let how = if config.shared_dir {
        libc::LOCK_SH
    } else {
        libc::LOCK_EX
    };
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    if unsafe { libc::flock(lock.as_raw_fd(), how | libc::LOCK_NB) } != 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(FsError::Config {
                field: "root_dir",
                reason: format!(
                    "namespace directory {} is in use by another tier instance{}; give each \
                     instance its own root_dir, or set shared_dir on all of them",
                    layout.dir().display(),
                    if config.shared_dir {
                        " in a private (exclusive) mode"
                    } else {
                        ""
                    }
                ),
            });
        }
        return Err(FsError::io("flock", &path, 0, error));
    }
    write_or_check_namespace_file(layout, &config.namespace)?;
    Ok(lock)
}

/// The bytes after which a segment takes no further record: `segment_bytes_max`, but small
/// enough that the segments being appended (one per worker) stay a small part of the byte limit,
/// and eviction (by whole segment) stays fine-grained.
fn segment_bytes(config: &FsTierConfig) -> u64 {
    let share = config.capacity_bytes / (4 * config.workers as u64);
    share.clamp(
        crate::format::ALIGN as u64,
        config.segment_bytes_max.max(crate::format::ALIGN as u64),
    )
}

impl FsTier {
    /// Starts the tier over `memory` (the host pool): checks the configuration and the namespace,
    /// probes O_DIRECT and io_uring, scans the namespace to rebuild the index (recovering unsealed
    /// segments, sweeping stale temporary files), and starts the workers. Blocks for the scan.
    pub fn start(config: FsTierConfig, memory: Arc<dyn SlotMemory>) -> Result<Self, FsError> {
        config.validate()?;
        let layout = Layout::new(&config.root_dir, &config.namespace);
        let dir_lock = prepare_dirs(&layout, &config)?;
        let instance = new_instance_id();
        let shared = Arc::new(Shared::new(config.capacity_bytes, &config.faults, instance));
        let direct = config.direct_io && detect_direct(&layout, &config, &shared.stats)?;
        shared.stats.direct_io.store(direct, Ordering::Relaxed);
        let policy = SweepPolicy {
            shared: config.shared_dir,
            stale_tmp_age: config.stale_tmp_age,
        };
        let scanned = scan(&layout, policy, &mut shared.index(), &shared.stats)?;
        let engines = create_engines(&config, &shared.stats)?;
        let engine_name = engines.first().map_or("none", |e| e.name());
        // Room for every job in flight plus a Stop in each, so sends never block.
        let (loaders, loader_rxs): (Vec<_>, Vec<_>) = (0..config.workers)
            .map(|_| crossbeam_channel::bounded(config.jobs_in_flight_max + 1))
            .unzip();
        let mut loader_rxs = loader_rxs.into_iter();
        let (stores, stores_rx) = crossbeam_channel::bounded(config.jobs_in_flight_max + 1);
        let (done_tx, done) = crossbeam_channel::bounded(config.jobs_in_flight_max);
        let mut workers = Vec::with_capacity(engines.len());
        // Engine 0 is the writer's: every store job of the tier goes to it, so that the root
        // gets one sequential append stream; the others run loads.
        for (n, engine) in engines.into_iter().enumerate() {
            let settings = WorkerSettings {
                layout: layout.clone(),
                durability: config.durability,
                quiet: config.quiet,
                batch_bytes_max: config.batch_bytes_max,
                segment_bytes: segment_bytes(&config),
                shared_dir: config.shared_dir,
                zero_copy_loads: config.zero_copy_loads,
                strict: offload_core::invariant::STRICT_DEFAULT,
            };
            let worker = Worker::new(engine, Arc::clone(&memory), Arc::clone(&shared), settings);
            let done_tx = done_tx.clone();
            let spawned = if n == 0 {
                let rx = stores_rx.clone();
                std::thread::Builder::new()
                    .name("kvtier-fs-writer".to_owned())
                    .spawn(move || worker.run_writer(rx, done_tx))
            } else {
                let rx = loader_rxs.next().unwrap_or_else(crossbeam_channel::never);
                std::thread::Builder::new()
                    .name(format!("kvtier-fs-{}", n - 1))
                    .spawn(move || worker.run(rx, done_tx))
            };
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(e) => {
                    let _ = stores.send(Msg::Stop);
                    for loader in &loaders {
                        let _ = loader.send(Msg::Stop);
                    }
                    for handle in workers {
                        let _ = handle.join();
                    }
                    return Err(FsError::Worker(format!("spawning a worker: {e}")));
                }
            }
        }
        let prober = if config.shared_dir {
            Some(Prober::start(
                layout.clone(),
                Arc::clone(&shared),
                config.probe_deadline,
                config.probes_in_flight_max,
                scanned,
            )?)
        } else {
            None
        };
        Ok(Self {
            shared,
            engine_name,
            namespace_dir: layout.dir().to_owned(),
            slot_count: memory.slot_count(),
            slot_bytes: memory.slot_bytes(),
            jobs_in_flight_max: config.jobs_in_flight_max,
            loader_bytes: vec![0; loaders.len()],
            loaders: Some(loaders),
            loader_budget: (config.batch_bytes_max as u64).saturating_mul(LOADER_PIPELINES),
            stores: Some(stores),
            done,
            ready: VecDeque::new(),
            book: JobBook::new(config.jobs_in_flight_max),
            workers,
            prober,
            shut_down: false,
            shutdown_deadline: config.shutdown_deadline,
            drain_deadline: config.drain_deadline,
            drain_timeout_warned: false,
            quiet: config.quiet,
            dir_lock: Some(dir_lock),
        })
    }

    /// Ends every injected stall ([`crate::Fault::Stall`]; tests).
    pub fn release_stalls(&self) {
        self.shared.stalls_released.store(true, Ordering::Release);
    }

    /// Waits until every accepted job has completed (completions then wait in `poll`) or
    /// `deadline` passes; returns whether every job completed. Jobs not completed by then stay in
    /// flight, their slots theirs, and are reported by a later `poll` (or at shutdown). Neither
    /// counted nor warned about: `Tier::drain` is this with `drain_deadline`, and counts.
    pub fn drain_until(&mut self, deadline: Instant) -> bool {
        while self.awaiting() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.done.recv_timeout(left) {
                Ok(completion) => self.arrived(completion),
                Err(RecvTimeoutError::Timeout) => return false,
                Err(RecvTimeoutError::Disconnected) => {
                    self.fail_orphans();
                    break;
                }
            }
        }
        true
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> FsStats {
        self.shared.stats.snapshot(self.engine_name)
    }

    /// The namespace directory (`<root>/<namespace hash>`).
    pub fn namespace_dir(&self) -> &Path {
        &self.namespace_dir
    }

    /// The I/O engine's name (`"io_uring"` or `"sync"`).
    pub fn engine_name(&self) -> &'static str {
        self.engine_name
    }

    /// Chunks indexed.
    pub fn chunk_count(&self) -> usize {
        self.shared.index().len()
    }

    /// Bytes of the indexed segment files (records, dead space and seals).
    pub fn used_bytes(&self) -> u64 {
        self.shared.index().used_bytes()
    }

    /// Segment files indexed.
    pub fn segment_count(&self) -> usize {
        self.shared.index().segment_count()
    }

    /// Where `key`'s record is: its segment file and the byte offset of its header (for tools
    /// and tests that inspect the disk).
    pub fn chunk_location(&self, key: ChunkKey) -> Option<(PathBuf, u64)> {
        self.shared
            .index()
            .location(key)
            .map(|l| ((*l.path).clone(), l.offset))
    }

    /// The indexed keys, least recently accessed first.
    pub fn keys(&self) -> Vec<ChunkKey> {
        self.shared.index().keys_by_age()
    }

    /// Moves the keys that left the tier since the last call (evicted with their segment, or
    /// dropped as unreadable) into `out`, oldest first, so an engine can publish their removal.
    /// Returns how many removals were dropped unreported because more than
    /// [`index::REMOVED_KEPT_MAX`](crate::index::REMOVED_KEPT_MAX) waited.
    pub fn take_removed(&self, out: &mut Vec<ChunkKey>) -> u64 {
        self.shared.index().take_removed(out)
    }

    /// The load worker a load job of `bytes` record bytes goes to ([`pick_loader`] over the
    /// record bytes each worker was sent and has not completed yet).
    fn loader_for(&self, bytes: u64) -> usize {
        pick_loader(&self.loader_bytes, self.loader_budget, bytes)
    }

    /// Checks a job against the host pool and the jobs in flight.
    fn check(&self, job: &TierJob) -> Result<(), SubmitError> {
        if self.book.contains(job.id) {
            return Err(SubmitError::Invalid(format!(
                "job id {} is already in flight",
                job.id.0
            )));
        }
        for TierChunk { key, slot, len } in &job.chunks {
            if slot.0 >= self.slot_count {
                return Err(SubmitError::Invalid(format!(
                    "chunk {:#x}/{}: slot {} out of range (slot_count {})",
                    key.hash, key.group, slot.0, self.slot_count
                )));
            }
            if *len as usize > self.slot_bytes {
                return Err(SubmitError::Invalid(format!(
                    "chunk {:#x}/{}: length {len} over the slot size {}",
                    key.hash, key.group, self.slot_bytes
                )));
            }
        }
        Ok(())
    }

    /// Takes a completion from the workers out of the book and queues it for `poll`; one the
    /// book refuses (a second completion, a stray key) is a broken invariant of the worker:
    /// never handed out.
    fn arrived(&mut self, completion: TierCompletion) {
        match self.book.complete(&completion) {
            Ok(booked) => {
                if let Some((n, bytes)) = booked.value {
                    self.loader_bytes[n] -= bytes;
                }
                self.ready.push_back(completion);
            }
            Err(e) => {
                add(&self.shared.stats.invariant_failures, 1);
                crate::direct::warn(&self.shared.stats, self.quiet, &format!("fs tier: {e}"));
                debug_assert!(false, "fs tier: {e}");
            }
        }
    }

    /// The worker is gone: completes every job still waiting for it with all keys failed (the
    /// worker no longer touches any slot).
    fn fail_orphans(&mut self) {
        self.loader_bytes.fill(0);
        for (completion, _) in self.book.fail_where(TierFailure::TierDown, |_, _| true) {
            for _ in &completion.failed {
                self.shared.stats.fail(FailureKind::Unavailable);
            }
            self.ready.push_back(completion);
        }
    }

    /// Jobs accepted whose completion has not been received yet.
    fn awaiting(&self) -> usize {
        self.book.len()
    }

    /// Jobs accepted that have not completed yet (after a `drain` that timed out: those it left
    /// in flight; a later `poll` reports them).
    pub fn jobs_unfinished(&self) -> usize {
        self.awaiting()
    }

    /// Tells every worker to stop and joins those that end by `deadline` (polling; a thread
    /// cannot be interrupted in a system call); the others are detached and counted. Returns
    /// whether every worker ended.
    fn stop_worker(&mut self, deadline: Instant) -> bool {
        if let Some(stores) = self.stores.take() {
            let _ = stores.send(Msg::Stop);
        }
        if let Some(loaders) = self.loaders.take() {
            for loader in loaders {
                let _ = loader.send(Msg::Stop);
            }
        }
        let mut running: Vec<JoinHandle<()>> = self.workers.drain(..).collect();
        loop {
            let (done, left): (Vec<_>, Vec<_>) = running.into_iter().partition(|w| w.is_finished());
            for worker in done {
                let _ = worker.join();
            }
            running = left;
            if running.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(STOP_POLL_INTERVAL);
        }
        let detached = running.len() as u64;
        // Dropping a handle detaches its thread, which keeps its own `Arc` of the host memory.
        drop(running);
        add(&self.shared.stats.threads_detached, detached);
        // The probe thread only reads the directory: one left running does not keep the lock.
        if let Some(mut prober) = self.prober.take() {
            prober.stop(deadline, &self.shared);
        }
        detached == 0
    }
}

/// Runs the O_DIRECT probe; a refusal is warned about once and counted as the root's fallback.
fn detect_direct(
    layout: &Layout,
    config: &FsTierConfig,
    stats: &StatsCell,
) -> Result<bool, FsError> {
    match probe_direct(layout)? {
        Ok(()) => Ok(true),
        Err(reason) => {
            add(&stats.direct_fallbacks, 1);
            warn(
                stats,
                config.quiet,
                &format!(
                    "O_DIRECT refused ({reason}); {:?} uses buffered I/O",
                    layout.dir()
                ),
            );
            Ok(false)
        }
    }
}

/// Which load worker a load job of `bytes` record bytes goes to, given the record bytes of the
/// jobs sent to each worker and not completed yet (`in_flight`) and a worker's pipeline budget
/// (`budget`, [`FsTierConfig::batch_bytes_max`]): the first worker with room for the job in its
/// budget (or with nothing in flight), else the one with the fewest bytes in flight (the
/// first of those). So the first worker runs the load while it keeps up, and the others take
/// jobs only when it has its fill (or runs a large job alone): no more threads are busy than
/// the load needs, and their read buffers stay warm. Sending each job to whichever worker was
/// idle spread the jobs over every worker, each reading one record at a time and competing
/// for the cores (`docs/perf.md`, disk tier). 0 if there are no workers.
fn pick_loader(in_flight: &[u64], budget: u64, bytes: u64) -> usize {
    in_flight
        .iter()
        .position(|&b| b == 0 || b.saturating_add(bytes) <= budget)
        .unwrap_or_else(|| {
            (0..in_flight.len())
                .min_by_key(|&n| in_flight[n])
                .unwrap_or(0)
        })
}

impl Tier for FsTier {
    fn name(&self) -> &str {
        "fs"
    }

    fn medium(&self) -> Medium {
        Medium::Disk
    }

    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        if self.shared.index().contains(key) {
            return TierLookup::Hit;
        }
        match &mut self.prober {
            Some(prober) => prober.lookup(key, &self.shared),
            None => TierLookup::Miss,
        }
    }

    fn touch(&mut self, keys: &[ChunkKey]) {
        self.shared.index().touch_prefix(keys);
    }

    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        if self.shut_down {
            return Err(SubmitError::ShutDown);
        }
        self.check(&job)?;
        let in_flight = self.book.len() + self.ready.len();
        if in_flight >= self.jobs_in_flight_max {
            return Err(SubmitError::Busy { in_flight });
        }
        let id = job.id;
        let keys: Vec<ChunkKey> = job.chunks.iter().map(|c| c.key).collect();
        let (queue, value) = match job.op {
            TierOp::Store => (self.stores.as_ref(), None),
            TierOp::Load => {
                let bytes = job
                    .chunks
                    .iter()
                    .map(|c| file_bytes(u64::from(c.len)))
                    .fold(0, u64::saturating_add);
                let n = self.loader_for(bytes);
                let queue = self.loaders.as_ref().and_then(|l| l.get(n));
                (queue, Some((n, bytes)))
            }
        };
        let Some(queue) = queue else {
            return Err(SubmitError::ShutDown);
        };
        match queue.try_send(Msg::Job(job)) {
            // Checked above (fewer than the most in flight, a fresh id): this cannot refuse.
            Ok(()) => {
                if let Some((n, bytes)) = value {
                    self.loader_bytes[n] += bytes;
                }
                self.book.insert_keys(id, keys, value)
            }
            Err(TrySendError::Full(_)) => Err(SubmitError::Busy { in_flight }),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::ShutDown),
        }
    }

    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        loop {
            match self.done.try_recv() {
                Ok(completion) => self.arrived(completion),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.fail_orphans();
                    break;
                }
            }
        }
        out.extend(self.ready.drain(..));
    }

    fn cancel(&mut self, id: JobId) {
        if !self.book.cancel(id) {
            return;
        }
        self.shared.cancelled().insert(id);
    }

    /// Waits at most `drain_deadline` (see [`FsTierConfig::drain_deadline`]): past it the jobs
    /// still in flight stay in flight and are reported later; counted in
    /// `FsStats::drain_timeouts` and warned about once.
    fn drain(&mut self) {
        if self.drain_until(Instant::now() + self.drain_deadline) {
            return;
        }
        add(&self.shared.stats.drain_timeouts, 1);
        if !self.drain_timeout_warned {
            self.drain_timeout_warned = true;
            let message = format!(
                "fs tier {:?}: drain gave up after {:?} with {} jobs in flight (a disk that does \
                 not answer?); they are reported when they complete (warned once, counted in \
                 drain_timeouts)",
                self.namespace_dir,
                self.drain_deadline,
                self.awaiting()
            );
            crate::direct::warn(&self.shared.stats, self.quiet, &message);
        }
    }

    fn on_request_finished(&mut self, _request: RequestId) {
        // Chunks are content-addressed and shared between requests: nothing is per request.
    }

    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        self.take_removed(out)
    }

    fn shutdown(&mut self) {
        if !self.shut_down {
            self.shut_down = true;
            let ids: Vec<JobId> = self.book.iter().map(|(id, _)| id).collect();
            for id in ids {
                self.cancel(id);
            }
        }
        let deadline = Instant::now() + self.shutdown_deadline;
        if !self.drain_until(deadline) {
            // Jobs still in flight stay unreported: their slots stay theirs.
            add(&self.shared.stats.shutdown_timeouts, 1);
        }
        // The threads get as long again to see their stop message and end.
        if self.stop_worker(Instant::now() + self.shutdown_deadline) {
            // Nothing touches the directory any more: another instance may take it now.
            self.dir_lock = None;
        } else if let Some(lock) = self.dir_lock.take() {
            // A detached worker may still write the directory: it stays locked (the descriptor
            // is leaked on purpose) for the life of the process.
            std::mem::forget(lock);
        }
    }
}

impl Drop for FsTier {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::pick_loader;

    const MIB: u64 = 1 << 20;

    #[test]
    fn loads_go_to_the_first_worker_while_it_has_room() {
        let budget = 64 * MIB;
        // Nothing in flight anywhere: the first worker.
        assert_eq!(pick_loader(&[0, 0, 0, 0], budget, 8 * MIB), 0);
        // The first worker still has room: it takes the job, the others stay idle.
        assert_eq!(pick_loader(&[56 * MIB, 0, 0, 0], budget, 8 * MIB), 0);
        // One byte over its budget: the next worker with room.
        assert_eq!(pick_loader(&[56 * MIB + 1, 0, 0, 0], budget, 8 * MIB), 1);
        assert_eq!(
            pick_loader(&[64 * MIB, 60 * MIB, 8 * MIB, 0], budget, 8 * MIB),
            2
        );
    }

    #[test]
    fn a_job_over_the_budget_goes_to_an_idle_worker_then_the_least_loaded() {
        let budget = 64 * MIB;
        // Too large for any budget: the first worker with nothing in flight runs it alone.
        assert_eq!(pick_loader(&[8 * MIB, 0, 0], budget, 100 * MIB), 1);
        // Every worker full: the least loaded one (the first of equals).
        assert_eq!(
            pick_loader(&[64 * MIB, 40 * MIB, 60 * MIB], budget, 32 * MIB),
            1
        );
        assert_eq!(pick_loader(&[64 * MIB, 64 * MIB], budget, 32 * MIB), 0);
        // No workers: 0 (the caller finds no channel and reports the tier shut down).
        assert_eq!(pick_loader(&[], budget, MIB), 0);
        // Byte counts near the top do not overflow.
        assert_eq!(pick_loader(&[u64::MAX, 1], budget, u64::MAX), 1);
    }
}
