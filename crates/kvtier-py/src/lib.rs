//! `kvtier._kvtier`: the native half of the Python package `kvtier`.
//!
//! It exposes kvtier's secondary tiers (`tier-fs`, `tier-p2p`) as Python classes that read and
//! write an engine's host KV buffer in place (vLLM's `primary_kv_view`), and, in `connector.rs`,
//! the connector crate's scheduler and worker handles over a host pool of its own (for
//! `kvtier.vllm.connector`). The Python half (`python/kvtier/`) turns vLLM's calls, keys and
//! configuration into these.
//!
//! Keys cross as vLLM `OffloadKey`s (`block_hash + group.to_bytes(4, "big")`): the chunk key's
//! hash is the xxh3-128 of the block-hash bytes, its group the last four bytes. A job crosses as
//! `(job_id, op, keys, slots)`; its completion comes back from `poll` as `(job_id, failed)`,
//! `failed` being the positions of the keys that did not transfer (empty on success).
//!
//! Logging: the tiers log through `tracing`; without a `tracing` subscriber those events become
//! `log` records, which [`pyo3_log`] hands to Python's `logging` (logger names `tier_fs...`,
//! `tier_p2p...`). Identical messages repeated within [`REPEAT_WINDOW`] are dropped and counted.

mod connector;

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use offload_core::tier::{SubmitError, TierChunk};
use offload_core::{
    ChunkKey, JobId, RequestId, SlotId, SlotMemory, Tier, TierCompletion, TierJob, TierLookup,
    TierOp,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// How long an identical log message is suppressed after it was last passed on.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(10);

/// An engine's host KV buffer: `slot_count` rows of `slot_bytes`, at a fixed address, owned by a
/// Python object this struct keeps alive.
struct BufferMemory {
    base: NonNull<u8>,
    slot_bytes: usize,
    slot_count: u32,
    /// The exporting object (a memoryview): while it lives, the buffer can neither move nor be
    /// freed (numpy refuses to resize and mmap to close an exported buffer).
    _owner: Py<PyAny>,
}

// SAFETY: the buffer is plain bytes at a fixed address; the Tier contract makes sure no two
// in-flight jobs write one slot and no slot is written while it is read.
unsafe impl Send for BufferMemory {}
// SAFETY: as above.
unsafe impl Sync for BufferMemory {}

impl BufferMemory {
    fn range(&self, slot: SlotId, offset: usize, len: usize) -> *mut u8 {
        assert!(
            slot.0 < self.slot_count
                && offset
                    .checked_add(len)
                    .is_some_and(|e| e <= self.slot_bytes),
            "slot {} [{offset}, +{len}) outside the buffer ({} slots of {} bytes)",
            slot.0,
            self.slot_count,
            self.slot_bytes
        );
        // In bounds: checked above.
        self.base
            .as_ptr()
            .wrapping_add(slot.0 as usize * self.slot_bytes + offset)
    }
}

impl SlotMemory for BufferMemory {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        self.slot_count
    }

    fn read_slot(&self, slot: SlotId, offset: usize, dst: &mut [u8]) {
        let src = self.range(slot, offset, dst.len());
        // SAFETY: in bounds (checked by `range`); the job owns the slot (Tier contract).
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
    }

    fn write_slot(&self, slot: SlotId, offset: usize, src: &[u8]) {
        let dst = self.range(slot, offset, src.len());
        // SAFETY: as in read_slot.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
    }

    fn slot_ptr(&self, slot: SlotId) -> Option<NonNull<u8>> {
        NonNull::new(self.range(slot, 0, 0))
    }
}

/// The 128-bit key hash of a vLLM block hash (its bytes, of any length): their xxh3-128. Not
/// the first 16 bytes, which would make two hashes that differ only after them one key; xxh3-128
/// takes every byte, whatever the engine's hash function and length.
pub(crate) fn key_hash(block_hash: &[u8]) -> u128 {
    twox_hash::XxHash3_128::oneshot(block_hash)
}

/// The chunk key of a vLLM `OffloadKey` (block hash bytes, then the group as 4 big-endian bytes).
fn chunk_key(key: &[u8]) -> PyResult<ChunkKey> {
    if key.len() < 5 {
        return Err(PyValueError::new_err(format!(
            "offload key of {} bytes: expected a block hash and a 4-byte group index",
            key.len()
        )));
    }
    let (hash, group) = key.split_at(key.len() - 4);
    let group = u32::from_be_bytes(group.try_into().expect("4 bytes"));
    Ok(ChunkKey::new(key_hash(hash), group))
}

/// `chunk_key` as Python sees it: `(hash, group)`, the hash a 128-bit int.
#[pyfunction]
fn offload_key_to_chunk_key(key: &[u8]) -> PyResult<(u128, u32)> {
    let k = chunk_key(key)?;
    Ok((k.hash, k.group))
}

/// One tier behind a lock (Python may call from several threads), with the keys of its jobs in
/// flight so a completion's failed keys become positions.
struct TierState {
    tier: Inner,
    jobs: HashMap<u64, Vec<ChunkKey>>,
    completions: Vec<TierCompletion>,
    shut_down: bool,
}

/// The tier behind a `PyTier`.
enum Inner {
    Fs(tier_fs::FsTier),
    P2p(tier_p2p::P2pTier),
}

impl std::ops::Deref for Inner {
    type Target = dyn Tier;
    fn deref(&self) -> &Self::Target {
        match self {
            Inner::Fs(t) => t,
            Inner::P2p(t) => t,
        }
    }
}

impl std::ops::DerefMut for Inner {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match self {
            Inner::Fs(t) => t,
            Inner::P2p(t) => t,
        }
    }
}

/// A kvtier secondary tier over an engine's host KV buffer. Made by `Tier.fs(...)` or
/// `Tier.p2p(...)`; every method is safe to call from any Python thread.
#[pyclass(module = "kvtier._kvtier", name = "Tier")]
struct PyTier {
    state: Mutex<TierState>,
    kind: &'static str,
    memory: Arc<BufferMemory>,
    /// The fs tier's namespace directory.
    namespace_dir: Option<PathBuf>,
    /// The p2p tier's listening address.
    addr: Option<SocketAddr>,
}

impl PyTier {
    fn new(inner: Inner, memory: Arc<BufferMemory>) -> Self {
        let (kind, namespace_dir, addr) = match &inner {
            Inner::Fs(t) => ("fs", Some(t.namespace_dir().to_path_buf()), None),
            Inner::P2p(t) => ("p2p", None, Some(t.local_addr())),
        };
        Self {
            state: Mutex::new(TierState {
                tier: inner,
                jobs: HashMap::new(),
                completions: Vec::new(),
                shut_down: false,
            }),
            kind,
            memory,
            namespace_dir,
            addr,
        }
    }
}

fn buffer(
    view: Bound<'_, PyAny>,
    address: usize,
    slot_bytes: usize,
    slot_count: u32,
) -> PyResult<Arc<BufferMemory>> {
    let base = NonNull::new(address as *mut u8)
        .ok_or_else(|| PyValueError::new_err("primary KV buffer address is 0"))?;
    if slot_bytes == 0 || slot_count == 0 {
        return Err(PyValueError::new_err(format!(
            "primary KV buffer of {slot_count} slots of {slot_bytes} bytes: both must be positive"
        )));
    }
    Ok(Arc::new(BufferMemory {
        base,
        slot_bytes,
        slot_count,
        _owner: view.unbind(),
    }))
}

fn lock(state: &Mutex<TierState>) -> std::sync::MutexGuard<'_, TierState> {
    // A panic inside a tier call poisons the lock; the tier's own state is still consistent
    // (its calls are all-or-nothing), so go on with it.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Setting `key` of a `tier` tier's config, which must be there.
fn required<'py>(
    config: &Bound<'py, PyDict>,
    tier: &str,
    key: &str,
) -> PyResult<Bound<'py, PyAny>> {
    config
        .get_item(key)?
        .ok_or_else(|| PyValueError::new_err(format!("{tier} tier: setting {key:?} missing")))
}

fn dict_get<'py, T: pyo3::conversion::FromPyObjectOwned<'py>>(
    d: &Bound<'py, PyDict>,
    key: &str,
) -> PyResult<Option<T>> {
    match d.get_item(key)? {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.extract::<T>().map(Some).map_err(|e| {
            let e: PyErr = e.into();
            PyValueError::new_err(format!("setting {key:?}: {e}"))
        }),
    }
}

#[pymethods]
impl PyTier {
    /// A disk tier (tier-fs) over the buffer at `address`, which `view` exports.
    ///
    /// `config` keys (all already validated and converted by `kvtier.config`): `root_dir`,
    /// `capacity_bytes`, `model`, `dtype`, `tokens_per_chunk`, `parallel_layout`, and optionally
    /// `workers`, `engine` ("auto", "uring", "sync"), `direct_io`, `jobs_in_flight_max`,
    /// `shared_dir`, `fsync`.
    #[staticmethod]
    fn fs(
        py: Python<'_>,
        view: Bound<'_, PyAny>,
        address: usize,
        slot_bytes: usize,
        slot_count: u32,
        config: Bound<'_, PyDict>,
    ) -> PyResult<Self> {
        let memory = buffer(view, address, slot_bytes, slot_count)?;
        let need = |key: &str| required(&config, "fs", key);
        let namespace = tier_fs::NamespaceId {
            model: need("model")?.extract()?,
            dtype: need("dtype")?.extract()?,
            tokens_per_chunk: need("tokens_per_chunk")?.extract()?,
            parallel_layout: need("parallel_layout")?.extract()?,
        };
        let root: PathBuf = need("root_dir")?.extract()?;
        let mut cfg =
            tier_fs::FsTierConfig::new(root, namespace, need("capacity_bytes")?.extract()?);
        if let Some(w) = dict_get::<usize>(&config, "workers")? {
            cfg.workers = w;
        }
        if let Some(e) = dict_get::<String>(&config, "engine")? {
            cfg.engine = match e.as_str() {
                "auto" => tier_fs::EngineChoice::Auto,
                "uring" | "io_uring" => tier_fs::EngineChoice::Uring,
                "sync" => tier_fs::EngineChoice::Sync,
                other => {
                    return Err(PyValueError::new_err(format!(
                        "fs tier: engine {other:?}: expected \"auto\", \"uring\" or \"sync\""
                    )))
                }
            };
        }
        if let Some(d) = dict_get::<bool>(&config, "direct_io")? {
            cfg.direct_io = d;
        }
        if let Some(j) = dict_get::<usize>(&config, "jobs_in_flight_max")? {
            cfg.jobs_in_flight_max = j;
        }
        if let Some(s) = dict_get::<bool>(&config, "shared_dir")? {
            cfg.shared_dir = s;
        }
        if dict_get::<bool>(&config, "fsync")?.unwrap_or(false) {
            cfg.durability = tier_fs::Durability::Fsync;
        }
        cfg.validate()
            .map_err(|e| PyValueError::new_err(format!("fs tier: {e}")))?;
        let mem: Arc<dyn SlotMemory> = memory.clone();
        let tier = py
            .detach(move || tier_fs::FsTier::start(cfg, mem))
            .map_err(|e| PyRuntimeError::new_err(format!("fs tier did not start: {e}")))?;
        Ok(Self::new(Inner::Fs(tier), memory))
    }

    /// A peer tier (tier-p2p) over the buffer at `address`, which `view` exports.
    ///
    /// `config` keys: `listen` ("host:port"), `peers` (list of "host:port"), the namespace
    /// (`model`, `dtype`, `tokens_per_chunk`, `parallel_layout`, as for [`Tier::fs`]),
    /// `block_bytes` (bytes of one engine block), `hash_seed`, and optionally `secret` (bytes), `published_bytes_max`, `lookup_deadline_s`,
    /// `fetch_deadline_s`, `nixl`.
    #[staticmethod]
    fn p2p(
        py: Python<'_>,
        view: Bound<'_, PyAny>,
        address: usize,
        slot_bytes: usize,
        slot_count: u32,
        config: Bound<'_, PyDict>,
    ) -> PyResult<Self> {
        let memory = buffer(view, address, slot_bytes, slot_count)?;
        let need = |key: &str| required(&config, "p2p", key);
        let namespace = tier_p2p::NamespaceId {
            model: need("model")?.extract()?,
            dtype: need("dtype")?.extract()?,
            tokens_per_chunk: need("tokens_per_chunk")?.extract()?,
            parallel_layout: need("parallel_layout")?.extract()?,
        };
        let block_bytes: u64 = need("block_bytes")?.extract()?;
        let seed: u64 = need("hash_seed")?.extract()?;
        let namespace = tier_p2p::Namespace::new(&namespace, block_bytes, seed);
        let mut cfg = tier_p2p::P2pConfig::new(namespace);
        let resolve = |what: &str, s: &str| -> PyResult<SocketAddr> {
            s.to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "p2p tier: {what} {s:?} is not a host:port that resolves"
                    ))
                })
        };
        if let Some(l) = dict_get::<String>(&config, "listen")? {
            cfg.listen = resolve("listen", &l)?;
        }
        if let Some(peers) = dict_get::<Vec<String>>(&config, "peers")? {
            // Names are resolved by the tier at every connect, not here.
            cfg.peers = peers
                .iter()
                .map(|p| {
                    p.parse::<tier_p2p::PeerAddr>()
                        .map_err(|e| PyValueError::new_err(format!("p2p tier: peer {e}")))
                })
                .collect::<PyResult<_>>()?;
        }
        cfg.secret = dict_get::<Vec<u8>>(&config, "secret")?;
        if let Some(b) = dict_get::<usize>(&config, "published_bytes_max")? {
            cfg.published_bytes_max = b;
        }
        if let Some(s) = dict_get::<f64>(&config, "lookup_deadline_s")? {
            cfg.lookup_deadline = seconds("lookup_deadline_s", s)?;
        }
        if let Some(s) = dict_get::<f64>(&config, "fetch_deadline_s")? {
            cfg.fetch_deadline = seconds("fetch_deadline_s", s)?;
        }
        if let Some(n) = dict_get::<bool>(&config, "nixl")? {
            cfg.nixl = n;
        }
        cfg.validate(slot_bytes)
            .map_err(|e| PyValueError::new_err(format!("p2p tier: {e}")))?;
        let mem: Arc<dyn SlotMemory> = memory.clone();
        let tier = py
            .detach(move || tier_p2p::P2pTier::new(cfg, mem))
            .map_err(|e| PyRuntimeError::new_err(format!("p2p tier did not start: {e}")))?;
        Ok(Self::new(Inner::P2p(tier), memory))
    }

    /// "fs" or "p2p".
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// Bytes per slot of the primary buffer.
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.memory.slot_bytes
    }

    /// The p2p tier's listening address ("host:port"); None for other tiers.
    #[getter]
    fn address(&self) -> Option<String> {
        self.addr.map(|a| a.to_string())
    }

    /// The fs tier's namespace directory; None for other tiers.
    #[getter]
    fn namespace_dir(&self) -> Option<String> {
        self.namespace_dir
            .as_ref()
            .map(|d| d.to_string_lossy().into_owned())
    }

    /// 0 (miss), 1 (hit) or 2 (retry: ask again) for one offload key. Never blocks on I/O.
    fn lookup(&self, key: &[u8]) -> PyResult<u8> {
        let k = chunk_key(key)?;
        Ok(code(lock(&self.state).tier.lookup(k)))
    }

    /// `lookup` for many keys under one lock: a bytes object of answer codes.
    fn lookup_many<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let keys = keys
            .iter()
            .map(|k| chunk_key(k))
            .collect::<PyResult<Vec<_>>>()?;
        let mut st = lock(&self.state);
        let out: Vec<u8> = keys.iter().map(|&k| code(st.tier.lookup(k))).collect();
        Ok(PyBytes::new(py, &out))
    }

    /// Marks keys as recently used (first key evicted last).
    fn touch(&self, keys: Vec<Vec<u8>>) -> PyResult<()> {
        let keys = keys
            .iter()
            .map(|k| chunk_key(k))
            .collect::<PyResult<Vec<_>>>()?;
        lock(&self.state).tier.touch(&keys);
        Ok(())
    }

    /// Submits a job: `op` "store" (slots into the tier) or "load" (the tier into slots).
    /// Returns False when the tier's queue is full (submit again later; nothing was taken).
    /// Raises ValueError for a malformed job and RuntimeError after shutdown.
    #[pyo3(signature = (job_id, op, keys, slots, request=None))]
    fn submit(
        &self,
        job_id: u64,
        op: &str,
        keys: Vec<Vec<u8>>,
        slots: Vec<u32>,
        request: Option<u64>,
    ) -> PyResult<bool> {
        let op = match op {
            "store" => TierOp::Store,
            "load" => TierOp::Load,
            other => {
                return Err(PyValueError::new_err(format!(
                    "job {job_id}: op {other:?}: expected \"store\" or \"load\""
                )))
            }
        };
        if keys.len() != slots.len() {
            return Err(PyValueError::new_err(format!(
                "job {job_id}: {} keys but {} slots",
                keys.len(),
                slots.len()
            )));
        }
        let chunk_keys = keys
            .iter()
            .map(|k| chunk_key(k))
            .collect::<PyResult<Vec<_>>>()?;
        let len = u32::try_from(self.memory.slot_bytes)
            .map_err(|_| PyValueError::new_err("slot size over 4 GiB"))?;
        let job = TierJob {
            id: JobId(job_id),
            request: request.map(RequestId),
            op,
            chunks: chunk_keys
                .iter()
                .zip(&slots)
                .map(|(&k, &s)| TierChunk::new(k, SlotId(s), len))
                .collect(),
        };
        let mut st = lock(&self.state);
        if st.jobs.contains_key(&job_id) {
            return Err(PyValueError::new_err(format!(
                "job {job_id} is already in flight"
            )));
        }
        match st.tier.submit(job) {
            Ok(()) => {
                st.jobs.insert(job_id, chunk_keys);
                Ok(true)
            }
            Err(SubmitError::Busy { .. }) => Ok(false),
            Err(SubmitError::ShutDown) => Err(PyRuntimeError::new_err(format!(
                "{} tier is shut down",
                self.kind
            ))),
            Err(e) => Err(PyValueError::new_err(format!("job {job_id}: {e}"))),
        }
    }

    /// Completions since the last call: `[(job_id, [failed key positions])]`. Never blocks.
    fn poll(&self) -> Vec<(u64, Vec<usize>)> {
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.tier.poll(&mut st.completions);
        let mut out = Vec::with_capacity(st.completions.len());
        for c in st.completions.drain(..) {
            let keys = st.jobs.remove(&c.id.0).unwrap_or_default();
            let failed = if c.failed.is_empty() {
                Vec::new()
            } else {
                let failed: std::collections::HashSet<ChunkKey> = c.failed_keys().collect();
                keys.iter()
                    .enumerate()
                    .filter(|(_, k)| failed.contains(k))
                    .map(|(i, _)| i)
                    .collect()
            };
            out.push((c.id.0, failed));
        }
        out
    }

    /// Number of jobs submitted whose completion `poll` has not returned yet.
    fn jobs_in_flight(&self) -> usize {
        lock(&self.state).jobs.len()
    }

    /// Asks a job to stop early; it still completes once.
    fn cancel(&self, job_id: u64) {
        lock(&self.state).tier.cancel(JobId(job_id));
    }

    /// Blocks (without the GIL) until every submitted job has completed (their completions then
    /// wait for `poll`) or the tier's drain deadline passes (fs: 30 s, counted in the stats'
    /// `drain_timeouts`); returns whether every job completed. Jobs not completed stay in
    /// flight and a later `poll` reports them. The p2p tier does not wait for a job whose NIXL
    /// READ is stuck (it completes when NIXL ends the READ) and answers `True`.
    fn drain(&self, py: Python<'_>) -> bool {
        py.detach(|| {
            let mut st = lock(&self.state);
            st.tier.drain();
            match &st.tier {
                Inner::Fs(t) => t.jobs_unfinished() == 0,
                Inner::P2p(_) => true,
            }
        })
    }

    /// The request finished: every store for it was submitted.
    fn on_request_finished(&self, request: u64) {
        lock(&self.state)
            .tier
            .on_request_finished(RequestId(request));
    }

    /// Cancels and drains everything; later submits raise. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| {
            let mut st = lock(&self.state);
            if !st.shut_down {
                st.tier.shutdown();
                st.shut_down = true;
            }
        });
    }

    /// Chunks that left the tier since the last call (evicted, or dropped as unreadable), as
    /// `(hash, group)` chunk keys, oldest first, and how many removals went unreported because
    /// too many waited. Only the fs tier evicts by itself; the p2p tier reports none.
    fn take_removed(&self) -> (Vec<(u128, u32)>, u64) {
        let mut keys = Vec::new();
        let lost = match &mut lock(&self.state).tier {
            Inner::Fs(t) => Tier::take_evicted(t, &mut keys),
            Inner::P2p(t) => Tier::take_evicted(t, &mut keys),
        };
        (keys.iter().map(|k| (k.hash, k.group)).collect(), lost)
    }

    /// The tier's counters as a dict (ints, and the fs engine's name).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        match &lock(&self.state).tier {
            Inner::Fs(t) => {
                let s = t.stats();
                d.set_item("engine", s.engine)?;
                d.set_item("direct_io", s.direct_io)?;
                d.set_item("chunks_stored", s.chunks_stored)?;
                d.set_item("bytes_stored", s.bytes_stored)?;
                d.set_item("stores_skipped", s.stores_skipped)?;
                d.set_item("chunks_loaded", s.chunks_loaded)?;
                d.set_item("bytes_loaded", s.bytes_loaded)?;
                d.set_item("evictions", s.evictions)?;
                d.set_item("evicted_bytes", s.evicted_bytes)?;
                d.set_item("chunks_found_at_start", s.chunks_found_at_start)?;
                d.set_item("failures", s.failures_total())?;
                d.set_item("drain_timeouts", s.drain_timeouts)?;
                d.set_item("shutdown_timeouts", s.shutdown_timeouts)?;
                d.set_item("threads_detached", s.threads_detached)?;
                d.set_item("invariant_failures", s.invariant_failures)?;
                d.set_item("chunk_count", t.chunk_count())?;
                d.set_item("used_bytes", t.used_bytes())?;
            }
            Inner::P2p(t) => {
                let s = t.stats();
                d.set_item("published_chunks", s.published_chunks)?;
                d.set_item("published_bytes", s.published_bytes)?;
                d.set_item("evictions", s.evictions)?;
                d.set_item("lookup_hits", s.lookup_hits)?;
                d.set_item("lookup_misses", s.lookup_misses)?;
                d.set_item("chunks_fetched", s.chunks_fetched)?;
                d.set_item("bytes_fetched", s.bytes_fetched)?;
                d.set_item("chunks_served", s.chunks_served)?;
                d.set_item("checksum_mismatches", s.checksum_mismatches)?;
                d.set_item("load_keys_failed", s.load_keys_failed)?;
                d.set_item("peer_failures", s.peer_failures)?;
                d.set_item("mac_failures", s.mac_failures)?;
                d.set_item("frames_rejected", s.frames_rejected)?;
                d.set_item("invariant_failures", s.invariant_failures)?;
            }
        }
        Ok(d)
    }
}

impl Drop for PyTier {
    fn drop(&mut self) {
        // The tier's threads must be gone before the buffer's owner is released.
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if !st.shut_down {
            st.tier.shutdown();
            st.shut_down = true;
        }
    }
}

fn seconds(key: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| PyValueError::new_err(format!("{key}: {s} is not a duration in seconds")))
}

fn code(l: TierLookup) -> u8 {
    match l {
        TierLookup::Miss => 0,
        TierLookup::Hit => 1,
        TierLookup::Retry => 2,
    }
}

/// A `log` logger that drops a message identical to one passed on less than [`REPEAT_WINDOW`]
/// ago, and says how many were dropped when it next passes one on.
struct RateLimited {
    inner: pyo3_log::Logger,
    seen: Mutex<HashMap<String, (Instant, u64)>>,
}

impl log::Log for RateLimited {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.inner.enabled(record.metadata()) {
            return;
        }
        let text = record.args().to_string();
        let now = Instant::now();
        let dropped = {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if seen.len() > 1024 {
                seen.retain(|_, (at, _)| now.duration_since(*at) < REPEAT_WINDOW);
            }
            match seen.get_mut(&text) {
                Some((at, n)) if now.duration_since(*at) < REPEAT_WINDOW => {
                    *n += 1;
                    return;
                }
                Some((at, n)) => {
                    let dropped = *n;
                    *at = now;
                    *n = 0;
                    dropped
                }
                None => {
                    seen.insert(text.clone(), (now, 0));
                    0
                }
            }
        };
        if dropped == 0 {
            self.inner.log(record);
        } else {
            let text = format!("{text} ({dropped} identical messages suppressed)");
            self.inner.log(
                &log::Record::builder()
                    .args(format_args!("{text}"))
                    .metadata(record.metadata().clone())
                    .module_path(record.module_path())
                    .file(record.file())
                    .line(record.line())
                    .build(),
            );
        }
    }

    fn flush(&self) {
        self.inner.flush();
    }
}

/// The native module.
#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let logger = RateLimited {
        inner: pyo3_log::Logger::new(m.py(), pyo3_log::Caching::LoggersAndLevels)?,
        seen: Mutex::new(HashMap::new()),
    };
    // A second import in one process (sub-interpreters, reloads) keeps the first logger.
    if log::set_boxed_logger(Box::new(logger)).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
    m.add_class::<PyTier>()?;
    m.add_class::<connector::PyHostPool>()?;
    m.add_class::<connector::PyConnectorScheduler>()?;
    m.add_class::<connector::PyConnectorWorker>()?;
    m.add_function(wrap_pyfunction!(connector::resolve_connector_config, m)?)?;
    m.add_function(wrap_pyfunction!(connector::block_hashes_to_u128, m)?)?;
    m.add_function(wrap_pyfunction!(connector::cuda_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(offload_key_to_chunk_key, m)?)?;
    m.add("REPEAT_WINDOW_S", REPEAT_WINDOW.as_secs_f64())?;
    Ok(())
}
