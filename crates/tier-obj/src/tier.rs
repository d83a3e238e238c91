//! `ObjTier`: the [`Tier`] over an object store. The engine-facing calls only touch in-memory
//! state (the index of present keys, offload-core's [`JobBook`] of jobs in flight, a completion
//! channel); each accepted job runs as a task on the tier's own small tokio runtime, one object
//! request per chunk, at most `requests_in_flight_max` requests at once over all jobs, each with
//! a deadline.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::{join_all, select, try_join_all, Either};
use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use offload_core::event::Medium;
use offload_core::tier::{
    FailedKey, SlotMemory, SubmitError, Tier, TierChunk, TierCompletion, TierFailure, TierJob,
    TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobBook, JobId, RequestId, SlotId};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;

use crate::config::ObjTierConfig;
use crate::error::ObjError;
use crate::record::{self, file_bytes, FormatError};

/// How long aborting a failed multipart upload or deleting a corrupt object may take; also how
/// long dropping a tier whose drain gave up waits for the runtime's tasks to stop.
const CLEANUP_DEADLINE: Duration = Duration::from_secs(5);

/// The most keys the tier keeps for [`Tier::take_evicted`] (keys it dropped by itself and not
/// yet reported); beyond it the oldest are dropped unreported and counted (the count is what
/// `take_evicted` returns, and [`ObjStats::evictions_unreported`]).
pub const EVICTED_KEPT_MAX: usize = 1 << 16;

/// The object name of `key` inside the namespace prefix: `<hash as 32 hex digits>-<group>`
/// (record format version 3; version 2's objects, of 64-bit keys, had 16 digits).
pub fn object_name(key: ChunkKey) -> String {
    format!("{:032x}-{}", key.hash, key.group)
}

/// The key an object name stands for, if it is exactly [`object_name`] of some key. A name of
/// the previous format (16 hex digits: a 64-bit key) is none.
pub fn parse_object_name(name: &str) -> Option<ChunkKey> {
    let (hash, group) = name.split_once('-')?;
    let key = ChunkKey::new(
        u128::from_str_radix(hash, 16).ok()?,
        group.parse::<u32>().ok()?,
    );
    (object_name(key) == name).then_some(key)
}

/// Whether `name` is a chunk object's name of record format version 2 (`<hash as 16 hex
/// digits>-<group>`, a 64-bit key), which this version neither lists nor loads.
pub fn is_version_2_object_name(name: &str) -> bool {
    name.split_once('-').is_some_and(|(hash, group)| {
        hash.len() == 16
            && hash
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            && group.parse::<u32>().is_ok_and(|g| g.to_string() == group)
    })
}

/// Counters of the tier's work since it started (a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjStats {
    /// Keys found by the start-up listing.
    pub keys_listed: u64,
    /// Objects of record format version 2 (64-bit keys) found by the start-up listing and
    /// ignored: never listed as present, never loaded.
    pub old_format_objects: u64,
    /// Chunks stored (a put or multipart upload completed).
    pub chunks_stored: u64,
    /// Stores of keys already present, answered without a request.
    pub stores_skipped: u64,
    /// Stores uploaded in parts.
    pub multipart_uploads: u64,
    /// Chunks loaded and verified.
    pub chunks_loaded: u64,
    /// Loads of keys the store does not hold.
    pub load_misses: u64,
    /// Loads whose object failed verification (the object is deleted).
    pub corrupt: u64,
    /// Requests past their deadline.
    pub timeouts: u64,
    /// Requests the store answered with an error (other than "not found").
    pub request_errors: u64,
    /// Chunks failed because their job was cancelled first.
    pub cancelled: u64,
    /// Record bytes uploaded.
    pub bytes_stored: u64,
    /// Record bytes downloaded.
    pub bytes_loaded: u64,
    /// Keys the tier dropped by itself (a corrupt object deleted, an object found missing) and
    /// reported through `Tier::take_evicted`.
    pub evictions_reported: u64,
    /// Keys it dropped whose report was lost because more than [`EVICTED_KEPT_MAX`] waited.
    pub evictions_unreported: u64,
    /// Drains that returned at `drain_deadline` with jobs still in flight (reported later).
    pub drain_timeouts: u64,
    /// Jobs failed as `TierDown` because their task ended without reporting them.
    pub jobs_orphaned: u64,
    /// Completions the job book refused (a second one for a job, a key the job does not name):
    /// a bug of the tier, never handed out.
    pub invariant_failures: u64,
}

#[derive(Default)]
struct Counters {
    keys_listed: AtomicU64,
    old_format_objects: AtomicU64,
    chunks_stored: AtomicU64,
    stores_skipped: AtomicU64,
    multipart_uploads: AtomicU64,
    chunks_loaded: AtomicU64,
    load_misses: AtomicU64,
    corrupt: AtomicU64,
    timeouts: AtomicU64,
    request_errors: AtomicU64,
    cancelled: AtomicU64,
    bytes_stored: AtomicU64,
    bytes_loaded: AtomicU64,
    evictions_reported: AtomicU64,
    evictions_unreported: AtomicU64,
    drain_timeouts: AtomicU64,
    jobs_orphaned: AtomicU64,
    invariant_failures: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl Counters {
    fn snapshot(&self) -> ObjStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ObjStats {
            keys_listed: get(&self.keys_listed),
            old_format_objects: get(&self.old_format_objects),
            chunks_stored: get(&self.chunks_stored),
            stores_skipped: get(&self.stores_skipped),
            multipart_uploads: get(&self.multipart_uploads),
            chunks_loaded: get(&self.chunks_loaded),
            load_misses: get(&self.load_misses),
            corrupt: get(&self.corrupt),
            timeouts: get(&self.timeouts),
            request_errors: get(&self.request_errors),
            cancelled: get(&self.cancelled),
            bytes_stored: get(&self.bytes_stored),
            bytes_loaded: get(&self.bytes_loaded),
            evictions_reported: get(&self.evictions_reported),
            evictions_unreported: get(&self.evictions_unreported),
            drain_timeouts: get(&self.drain_timeouts),
            jobs_orphaned: get(&self.jobs_orphaned),
            invariant_failures: get(&self.invariant_failures),
        }
    }
}

/// A job's cancellation: a flag for chunks not started, a notification for requests under way.
#[derive(Default)]
struct Cancel {
    flag: AtomicBool,
    notify: Notify,
}

impl Cancel {
    fn cancel(&self) {
        self.flag.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }
}

/// Keys that left the index by the tier's own doing, oldest first, at most `kept_max`; the
/// oldest go (counted in `overflow`) when more wait.
struct Evicted {
    keys: VecDeque<ChunkKey>,
    overflow: u64,
    kept_max: usize,
}

impl Evicted {
    fn new(kept_max: usize) -> Self {
        Self {
            keys: VecDeque::new(),
            overflow: 0,
            kept_max,
        }
    }

    fn push(&mut self, key: ChunkKey) {
        if self.keys.len() >= self.kept_max {
            self.keys.pop_front();
            self.overflow += 1;
        }
        self.keys.push_back(key);
    }

    /// Moves the keys into `out`, oldest first; returns how many were dropped since last time.
    fn take(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        out.extend(self.keys.drain(..));
        std::mem::take(&mut self.overflow)
    }
}

/// Why one chunk's request did not finish.
enum Stop {
    Deadline,
    Cancelled,
}

/// What the job tasks share with the engine-facing side.
struct Shared {
    store: Arc<dyn ObjectStore>,
    memory: Arc<dyn SlotMemory>,
    /// `<prefix>/<namespace hash>`.
    dir: Path,
    /// Keys whose objects are known to be present (stored here, or listed at start).
    index: Mutex<HashSet<ChunkKey>>,
    /// Keys that left `index` because of a load (corrupt, missing), for `take_evicted`.
    evicted: Mutex<Evicted>,
    requests: Semaphore,
    request_deadline: Duration,
    multipart_threshold_bytes: usize,
    part_bytes: usize,
    counters: Counters,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking job task cannot leave the index or counter half-updated (single operations).
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    fn path_of(&self, key: ChunkKey) -> Path {
        self.dir.clone().join(object_name(key))
    }

    /// Takes `key` out of the index because the store no longer holds it (or holds a damaged
    /// copy); if it was there, its removal waits for `take_evicted`.
    fn forget(&self, key: ChunkKey) {
        if lock(&self.index).remove(&key) {
            lock(&self.evicted).push(key);
        }
    }

    /// Runs `fut` until it finishes, the deadline passes, or the job is cancelled.
    async fn bounded<T>(
        &self,
        fut: impl Future<Output = T>,
        deadline: Instant,
        cancel: &Cancel,
    ) -> Result<T, Stop> {
        let notified = cancel.notify.notified();
        let mut notified = std::pin::pin!(notified);
        notified.as_mut().enable();
        if cancel.is_cancelled() {
            return Err(Stop::Cancelled);
        }
        let timed = std::pin::pin!(tokio::time::timeout_at(deadline, fut));
        match select(timed, notified).await {
            Either::Left((Ok(value), _)) => Ok(value),
            Either::Left((Err(_elapsed), _)) => Err(Stop::Deadline),
            Either::Right(((), _)) => Err(Stop::Cancelled),
        }
    }

    /// Counts a stop and says what it makes of the key.
    fn count_stop(&self, stop: &Stop) -> TierFailure {
        match stop {
            Stop::Deadline => {
                bump(&self.counters.timeouts, 1);
                TierFailure::Timeout
            }
            Stop::Cancelled => {
                bump(&self.counters.cancelled, 1);
                TierFailure::Cancelled
            }
        }
    }

    /// One chunk of a job; `Err` says why it failed.
    async fn chunk(
        &self,
        op: TierOp,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
        cancel: &Cancel,
    ) -> Result<(), TierFailure> {
        let permit_deadline = Instant::now() + self.request_deadline;
        let permit = match self
            .bounded(self.requests.acquire(), permit_deadline, cancel)
            .await
        {
            Ok(Ok(permit)) => permit,
            Ok(Err(_closed)) => return Err(TierFailure::TierDown),
            Err(stop) => return Err(self.count_stop(&stop)),
        };
        let deadline = Instant::now() + self.request_deadline;
        let ok = match op {
            TierOp::Store => self.store_chunk(key, slot, len, deadline, cancel).await,
            TierOp::Load => self.load_chunk(key, slot, len, deadline, cancel).await,
        };
        drop(permit);
        ok
    }

    async fn store_chunk(
        &self,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
        deadline: Instant,
        cancel: &Cancel,
    ) -> Result<(), TierFailure> {
        if lock(&self.index).contains(&key) {
            // Content addressing: the same key holds the same bytes.
            bump(&self.counters.stores_skipped, 1);
            return Ok(());
        }
        let len = len as usize;
        let mut image = vec![0u8; file_bytes(len as u64) as usize];
        let (total, _header) = record::encode_into(&mut image, key, len, |dst| {
            self.memory.read_slot(slot, 0, dst)
        });
        image.truncate(total);
        let data = Bytes::from(image);
        let path = self.path_of(key);
        let result = if data.len() > self.multipart_threshold_bytes {
            self.put_multipart(&path, data.clone(), deadline, cancel)
                .await
        } else {
            let put = self.store.put(&path, PutPayload::from(data.clone()));
            match self.bounded(put, deadline, cancel).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(Ok(e)),
                Err(stop) => Err(Err(self.count_stop(&stop))),
            }
        };
        match result {
            Ok(()) => {
                lock(&self.index).insert(key);
                bump(&self.counters.chunks_stored, 1);
                bump(&self.counters.bytes_stored, data.len() as u64);
                Ok(())
            }
            Err(Ok(e)) => {
                bump(&self.counters.request_errors, 1);
                tracing::warn!(path = %path, error = %e, "object tier: store failed");
                Err(TierFailure::Io)
            }
            Err(Err(stopped)) => Err(stopped),
        }
    }

    /// Uploads `data` in parts of `part_bytes`; aborts the upload when a part or the completion
    /// fails. `Err(Err(kind))`: deadline or cancel (counted here).
    async fn put_multipart(
        &self,
        path: &Path,
        data: Bytes,
        deadline: Instant,
        cancel: &Cancel,
    ) -> Result<(), Result<object_store::Error, TierFailure>> {
        let started = self.bounded(self.store.put_multipart(path), deadline, cancel);
        let mut upload = match started.await {
            Ok(Ok(upload)) => upload,
            Ok(Err(e)) => return Err(Ok(e)),
            Err(stop) => return Err(Err(self.count_stop(&stop))),
        };
        let mut parts = Vec::new();
        let mut at = 0;
        while at < data.len() {
            let end = (at + self.part_bytes).min(data.len());
            parts.push(upload.put_part(PutPayload::from(data.slice(at..end))));
            at = end;
        }
        let finished = async {
            try_join_all(parts).await?;
            upload.complete().await
        };
        let outcome = match self.bounded(finished, deadline, cancel).await {
            Ok(Ok(_)) => {
                bump(&self.counters.multipart_uploads, 1);
                return Ok(());
            }
            Ok(Err(e)) => Err(Ok(e)),
            Err(stop) => Err(Err(self.count_stop(&stop))),
        };
        let abort = tokio::time::timeout(CLEANUP_DEADLINE, upload.abort()).await;
        if !matches!(abort, Ok(Ok(()))) {
            tracing::warn!(path = %path, "object tier: aborting a failed multipart upload failed");
        }
        outcome
    }

    async fn load_chunk(
        &self,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
        deadline: Instant,
        cancel: &Cancel,
    ) -> Result<(), TierFailure> {
        let path = self.path_of(key);
        let fetch = async {
            let got = self.store.get(&path).await?;
            got.bytes().await
        };
        let bytes = match self.bounded(fetch, deadline, cancel).await {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(object_store::Error::NotFound { .. })) => {
                bump(&self.counters.load_misses, 1);
                self.forget(key);
                return Err(TierFailure::Missing);
            }
            Ok(Err(e)) => {
                bump(&self.counters.request_errors, 1);
                tracing::warn!(path = %path, error = %e, "object tier: load failed");
                return Err(TierFailure::Io);
            }
            Err(stop) => return Err(self.count_stop(&stop)),
        };
        bump(&self.counters.bytes_loaded, bytes.len() as u64);
        match record::verify(&bytes, key, u64::from(len)) {
            Ok(payload) => {
                self.memory.write_slot(slot, 0, payload);
                bump(&self.counters.chunks_loaded, 1);
                Ok(())
            }
            Err(e) => {
                self.quarantine(key, &path, &e).await;
                Err(TierFailure::Corrupt)
            }
        }
    }

    /// A record that does not verify: fail the key; a damaged object leaves the index and the
    /// store (a length mismatch is a valid object asked for with another length: kept).
    async fn quarantine(&self, key: ChunkKey, path: &Path, error: &FormatError) {
        tracing::warn!(path = %path, error = %error, "object tier: record does not verify");
        if !error.is_corruption() {
            return;
        }
        bump(&self.counters.corrupt, 1);
        self.forget(key);
        let delete = tokio::time::timeout(CLEANUP_DEADLINE, self.store.delete(path)).await;
        if !matches!(delete, Ok(Ok(()))) {
            tracing::warn!(path = %path, "object tier: deleting a corrupt object failed");
        }
    }
}

/// Runs one job to its single completion, sent on `done`; a panic inside fails every key of the
/// job. If the task is dropped before (the runtime stopped), its sender goes with it, and once
/// every sender is gone the tier fails what is left in its book (orphans).
async fn run_job(
    shared: Arc<Shared>,
    job: TierJob,
    cancel: Arc<Cancel>,
    done: SyncSender<TierCompletion>,
) {
    let inner_shared = Arc::clone(&shared);
    let chunks = job.chunks.clone();
    let op = job.op;
    let inner = tokio::spawn(async move {
        let work = chunks.iter().map(|&TierChunk { key, slot, len }| {
            let shared = &inner_shared;
            let cancel = &cancel;
            async move { (key, shared.chunk(op, key, slot, len, cancel).await) }
        });
        let results = join_all(work).await;
        results
            .into_iter()
            .filter_map(|(key, result)| result.err().map(|kind| FailedKey::new(key, kind)))
            .collect::<Vec<_>>()
    });
    let failed = match inner.await {
        Ok(failed) => failed,
        Err(e) => {
            tracing::error!(job = job.id.0, error = %e, "object tier: job task failed");
            job.chunks
                .iter()
                .map(|&TierChunk { key, .. }| FailedKey::new(key, TierFailure::Io))
                .collect()
        }
    };
    // Never full: the channel holds `jobs_in_flight_max`, and a job stays in the book (which
    // holds at most that many) until the tier received its completion.
    if done
        .try_send(TierCompletion { id: job.id, failed })
        .is_err()
    {
        tracing::error!(
            job = job.id.0,
            "object tier: completion channel full or closed"
        );
    }
}

/// The object-store tier.
pub struct ObjTier {
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
    completions: Receiver<TierCompletion>,
    /// The sender each job task gets a copy of; dropped at shutdown, so that the channel
    /// disconnects once no task is left.
    sender: Option<SyncSender<TierCompletion>>,
    /// Completions received from the tasks (checked against `book`), not yet returned by `poll`.
    ready: VecDeque<TierCompletion>,
    /// Accepted jobs whose completion was not received yet, each with its cancellation
    /// (offload-core's ledger: keys, cancel asked, exactly-once completion, orphans).
    book: JobBook<Arc<Cancel>>,
    jobs_in_flight_max: usize,
    /// How long `Tier::drain` waits (see [`ObjTierConfig::drain_deadline`]).
    drain_deadline: Duration,
    /// Whether a drain timeout was warned about (once per tier; each is counted).
    drain_timeout_warned: bool,
    shut_down: bool,
}

impl ObjTier {
    /// Starts the tier on `store`: its runtime, then a listing of the namespace prefix that
    /// rebuilds the index of present keys (warm restart), bounded by `list_deadline`.
    pub fn start(
        config: ObjTierConfig,
        store: Arc<dyn ObjectStore>,
        memory: Arc<dyn SlotMemory>,
    ) -> Result<Self, ObjError> {
        config.validate()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.runtime_threads)
            // The local backend's file calls and DNS lookups run here: no more than requests.
            .max_blocking_threads(config.requests_in_flight_max)
            .thread_name("kvtier-obj")
            .enable_all()
            .build()
            .map_err(ObjError::Runtime)?;
        let dir = namespace_dir(&config)?;
        let (index, old_format) =
            runtime.block_on(list_keys(&store, &dir, config.list_deadline))?;
        let (tx, rx) = std::sync::mpsc::sync_channel(config.jobs_in_flight_max);
        let counters = Counters::default();
        bump(&counters.keys_listed, index.len() as u64);
        if old_format > 0 {
            bump(&counters.old_format_objects, old_format);
            tracing::warn!(
                dir = %dir,
                objects = old_format,
                "object tier: ignoring objects of record format version 2 (64-bit keys, written \
                 by an older kvtier); they are never loaded and may be deleted"
            );
        }
        tracing::info!(dir = %dir, keys = index.len(), "object tier started");
        let shared = Arc::new(Shared {
            store,
            memory,
            dir,
            index: Mutex::new(index),
            evicted: Mutex::new(Evicted::new(EVICTED_KEPT_MAX)),
            requests: Semaphore::new(config.requests_in_flight_max),
            request_deadline: config.request_deadline,
            multipart_threshold_bytes: config.multipart_threshold_bytes,
            part_bytes: config.part_bytes,
            counters,
        });
        Ok(Self {
            shared,
            runtime: Some(runtime),
            completions: rx,
            sender: Some(tx),
            ready: VecDeque::new(),
            book: JobBook::new(config.jobs_in_flight_max),
            jobs_in_flight_max: config.jobs_in_flight_max,
            drain_deadline: config.drain_deadline,
            drain_timeout_warned: false,
            shut_down: false,
        })
    }

    /// Waits until every accepted job has completed (completions then wait in `poll`) or
    /// `deadline` passes; returns whether every job completed. Jobs not completed by then stay
    /// in flight, their slots theirs, and are reported by a later `poll`. Neither counted nor
    /// warned about: `Tier::drain` is this with `drain_deadline`, and counts.
    pub fn drain_until(&mut self, deadline: std::time::Instant) -> bool {
        while !self.book.is_empty() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.completions.recv_timeout(left) {
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

    /// Jobs accepted and not yet returned by `poll`.
    pub fn jobs_in_flight(&self) -> usize {
        self.book.len() + self.ready.len()
    }

    /// Takes a completion from a job task out of the book and queues it for `poll`; one the book
    /// refuses (a second completion, a stray key) is a bug of the tier: never handed out.
    fn arrived(&mut self, completion: TierCompletion) {
        match self.book.complete(&completion) {
            Ok(_) => self.ready.push_back(completion),
            Err(e) => {
                bump(&self.shared.counters.invariant_failures, 1);
                tracing::error!(error = %e, "object tier: completion refused by the job book");
                debug_assert!(false, "object tier: {e}");
            }
        }
    }

    /// Every job task is gone (each took its sender with it): fails every job still in the
    /// book, all keys `TierDown` (no task touches their slots any more).
    fn fail_orphans(&mut self) {
        for (completion, _) in self.book.fail_where(TierFailure::TierDown, |_, _| true) {
            bump(&self.shared.counters.jobs_orphaned, 1);
            tracing::warn!(job = completion.id.0, "object tier: job lost by its task");
            self.ready.push_back(completion);
        }
    }

    /// The namespace prefix the objects live under.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The object path of `key`.
    pub fn path_of(&self, key: ChunkKey) -> Path {
        self.shared.path_of(key)
    }

    /// Keys in the index (present as far as this tier knows).
    pub fn key_count(&self) -> usize {
        lock(&self.shared.index).len()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ObjStats {
        self.shared.counters.snapshot()
    }

    fn validate(&self, job: &TierJob) -> Result<(), SubmitError> {
        if self.book.contains(job.id) {
            return Err(SubmitError::Invalid(format!(
                "job id {} is already in flight",
                job.id.0
            )));
        }
        let slot_count = self.shared.memory.slot_count();
        let slot_bytes = self.shared.memory.slot_bytes();
        for &TierChunk { key, slot, len } in &job.chunks {
            if slot.0 >= slot_count {
                return Err(SubmitError::Invalid(format!(
                    "key {:#x}/{}: slot {} out of range ({slot_count} slots)",
                    key.hash, key.group, slot.0
                )));
            }
            if len as usize > slot_bytes {
                return Err(SubmitError::Invalid(format!(
                    "key {:#x}/{}: length {len} over the slot size {slot_bytes}",
                    key.hash, key.group
                )));
            }
        }
        Ok(())
    }
}

/// `<prefix>/<namespace hash as 16 hex digits>`.
fn namespace_dir(config: &ObjTierConfig) -> Result<Path, ObjError> {
    let ns = format!("{:016x}", crate::config::namespace_hash(&config.namespace));
    let prefix = config.prefix.trim_matches('/');
    let text = if prefix.is_empty() {
        ns
    } else {
        format!("{prefix}/{ns}")
    };
    Path::parse(&text).map_err(|e| ObjError::Config {
        what: format!("object prefix {:?}: {e}", config.prefix),
    })
}

/// The keys of the chunk objects under `dir` (other names are ignored), and how many objects
/// have a name of record format version 2.
async fn list_keys(
    store: &Arc<dyn ObjectStore>,
    dir: &Path,
    deadline: Duration,
) -> Result<(HashSet<ChunkKey>, u64), ObjError> {
    let listing = async {
        let mut keys = HashSet::new();
        let mut old_format = 0u64;
        let mut stream = store.list(Some(dir));
        while let Some(meta) = stream.next().await {
            let meta = meta?;
            let name = meta.location.filename().unwrap_or_default();
            let parent_ok = meta.location.prefix_match(dir).map(|mut rest| {
                rest.next();
                rest.next().is_none()
            });
            if parent_ok == Some(true) {
                if let Some(key) = parse_object_name(name) {
                    keys.insert(key);
                } else if is_version_2_object_name(name) {
                    old_format += 1;
                }
            }
        }
        Ok::<_, object_store::Error>((keys, old_format))
    };
    match tokio::time::timeout(deadline, listing).await {
        Ok(Ok(keys)) => Ok(keys),
        Ok(Err(source)) => Err(ObjError::Store {
            op: "list",
            path: dir.to_string(),
            source,
        }),
        Err(_) => Err(ObjError::Timeout {
            op: "list",
            path: dir.to_string(),
            deadline_ms: u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
        }),
    }
}

impl Tier for ObjTier {
    fn name(&self) -> &str {
        "obj"
    }

    fn medium(&self) -> Medium {
        Medium::Disk
    }

    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        if lock(&self.shared.index).contains(&key) {
            TierLookup::Hit
        } else {
            TierLookup::Miss
        }
    }

    fn touch(&mut self, _keys: &[ChunkKey]) {
        // No eviction here: an object store's own lifecycle rules bound its size.
    }

    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        if self.shut_down {
            return Err(SubmitError::ShutDown);
        }
        self.validate(&job)?;
        let in_flight = self.jobs_in_flight();
        if in_flight >= self.jobs_in_flight_max {
            return Err(SubmitError::Busy { in_flight });
        }
        let (Some(runtime), Some(sender)) = (&self.runtime, &self.sender) else {
            return Err(SubmitError::ShutDown);
        };
        let cancel = Arc::new(Cancel::default());
        // Checked above (a fresh id, fewer than the most in flight): this cannot refuse.
        self.book.insert(&job, Arc::clone(&cancel))?;
        let task = run_job(Arc::clone(&self.shared), job, cancel, sender.clone());
        runtime.spawn(task);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        loop {
            match self.completions.try_recv() {
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
        if let Some(booked) = self.book.get(id) {
            booked.value.cancel();
        }
    }

    /// Waits at most `drain_deadline` (see [`ObjTierConfig::drain_deadline`]): past it the jobs
    /// still in flight stay in flight and are reported later; counted in
    /// [`ObjStats::drain_timeouts`] and warned about once.
    fn drain(&mut self) {
        if self.drain_until(std::time::Instant::now() + self.drain_deadline) {
            return;
        }
        bump(&self.shared.counters.drain_timeouts, 1);
        if !self.drain_timeout_warned {
            self.drain_timeout_warned = true;
            tracing::warn!(
                dir = %self.shared.dir,
                deadline = ?self.drain_deadline,
                jobs_in_flight = self.book.len(),
                "object tier: drain gave up with jobs in flight (a store that does not answer?); \
                 they are reported when they complete (warned once, counted in drain_timeouts)"
            );
        }
    }

    fn on_request_finished(&mut self, _request: RequestId) {
        // Per-request state: none.
    }

    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        let before = out.len();
        let lost = lock(&self.shared.evicted).take(out);
        let counters = &self.shared.counters;
        bump(&counters.evictions_reported, (out.len() - before) as u64);
        bump(&counters.evictions_unreported, lost);
        lost
    }

    fn shutdown(&mut self) {
        self.shut_down = true;
        let ids: Vec<JobId> = self.book.iter().map(|(id, _)| id).collect();
        for id in ids {
            self.cancel(id);
        }
        // No more submits: once every task is gone the channel disconnects (orphans fail then).
        self.sender = None;
        self.drain();
    }
}

impl Drop for ObjTier {
    fn drop(&mut self) {
        self.shutdown();
        let Some(runtime) = self.runtime.take() else {
            return;
        };
        if self.book.is_empty() {
            // Every job finished (drained above); nothing is left to wait for.
            runtime.shutdown_background();
        } else {
            // The drain gave up: stop the tasks (dropped at their next await) and wait for the
            // worker threads, so that no task reads or writes a host slot after the tier is gone.
            runtime.shutdown_timeout(CLEANUP_DEADLINE);
        }
    }
}

#[cfg(test)]
mod name_tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every key's object name parses back to that key (all 128 bits of the hash, any
        /// group), is never a version 2 name, and keys differing only in the hash's high half
        /// get different names.
        #[test]
        fn object_names_round_trip_every_key(hash: u128, group: u32, high_xor in 1u64..) {
            let key = ChunkKey::new(hash, group);
            let name = object_name(key);
            prop_assert_eq!(name.len(), 32 + 1 + group.to_string().len());
            prop_assert_eq!(parse_object_name(&name), Some(key));
            prop_assert!(!is_version_2_object_name(&name));
            let twin = ChunkKey::new(hash ^ (u128::from(high_xor) << 64), group);
            prop_assert_ne!(object_name(twin), name);
        }

        /// Version 2 names (16 hex digits) never parse as a key.
        #[test]
        fn version_2_names_are_no_key(hash: u64, group: u32) {
            let name = format!("{hash:016x}-{group}");
            prop_assert!(is_version_2_object_name(&name));
            prop_assert_eq!(parse_object_name(&name), None);
        }
    }

    #[test]
    fn malformed_names_are_no_key() {
        for name in [
            "",
            "-",
            "0-0",
            &format!("{:032X}-1", 0xABu128),
            &format!("{:032x}-01", 5u128),
            &format!("{:033x}-1", 5u128),
            &format!("{:032x}", 5u128),
            &format!("{:032x}-x", 5u128),
        ] {
            assert_eq!(parse_object_name(name), None, "{name}");
        }
    }
}

#[cfg(test)]
mod evicted_tests {
    use super::*;

    /// The list keeps the newest `kept_max` keys, oldest first, and counts the ones it dropped
    /// once; taking empties it.
    #[test]
    fn the_evicted_list_is_bounded_and_counts_what_it_dropped() {
        let mut list = Evicted::new(2);
        let keys: Vec<ChunkKey> = (0..5).map(|i| ChunkKey::new(i, 0)).collect();
        for &k in &keys {
            list.push(k);
        }
        let mut out = Vec::new();
        assert_eq!(list.take(&mut out), 3, "three pushed out by newer keys");
        assert_eq!(out, keys[3..]);
        out.clear();
        assert_eq!(list.take(&mut out), 0);
        assert!(out.is_empty());
    }
}
