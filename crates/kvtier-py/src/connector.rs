//! The native half of `kvtier.vllm.connector`: the connector crate's scheduler side
//! ([`SchedulerHandle`] over the tiering manager and its secondary tiers) and worker side
//! (`kvtier_worker::Worker`, the connector crate's `WorkerHandle` over tier-gpu's host-memory
//! transfer engine, or its CUDA engine for KV caches on a GPU), with a host pool both share.
//!
//! Everything crosses as plain values: request ids as `u64` (the Python half maps vLLM's `str`
//! ids), block hashes as `u128` (the xxh3-128 of vLLM's hash bytes, as the tiers' keys), block
//! ids as `u32`, compute streams as raw handles, and the per-step metadata and the workers'
//! outputs as JSON bytes (offload-core's `ConnectorMeta` and `WorkerOutput`, which serialize
//! because workers may live elsewhere).
//!
//! Layout: the host pool is an anonymous mapping of this process (the scheduler side, whose
//! tiers read and write it, and the worker side, whose copies fill it, in one process: vLLM's
//! UniProcExecutor), or a file in `/dev/shm` that the scheduler process and every worker process
//! map (`HostPool.open_shared`). The Python half refuses any other layout.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use connector::config::{ConnectorConfig, EngineGeometry, ResolvedConfig};
use connector::SchedulerHandle;
use kvtier_worker::{KvCache, PinnedPool, Worker, WorkerError};
use offload_core::scheduler::FinishedRequest;
use offload_core::{
    BlockId, ConnectorMeta, FinishKind, KvEvent, MatchResult, NewRequest, RequestId, SlotMemory,
    StepInput, StepRequest, WorkerOutput,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tier_gpu::{HostPoolMemory, Region};

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a call poisons the lock; the state behind it is all-or-nothing per call.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The host pool (primary tier) of one engine: `slot_count` chunk-sized slots in one anonymous
/// mapping, prefaulted at creation. The scheduler side's tiers and the worker side's copies
/// share it.
#[pyclass(module = "kvtier._kvtier", name = "HostPool", frozen)]
pub struct PyHostPool {
    memory: Arc<HostPoolMemory>,
    /// Its registration with the CUDA driver, while a CUDA worker uses it.
    pinned: PinnedPool,
}

#[pymethods]
impl PyHostPool {
    /// Maps and prefaults `slot_count` slots of `slot_bytes` bytes (without the GIL).
    #[new]
    fn new(py: Python<'_>, slot_bytes: usize, slot_count: u32) -> PyResult<Self> {
        if slot_bytes == 0 || slot_count == 0 {
            return Err(PyValueError::new_err(format!(
                "host pool of {slot_count} slots of {slot_bytes} bytes: both must be positive"
            )));
        }
        let memory = py
            .detach(|| HostPoolMemory::new(slot_bytes, slot_count))
            .map_err(|e| {
                PyRuntimeError::new_err(format!(
                    "cannot map a host pool of {slot_count} slots of {slot_bytes} bytes: {e}"
                ))
            })?;
        Ok(Self {
            memory: Arc::new(memory),
            pinned: PinnedPool::default(),
        })
    }

    /// The pool in the file at `path` (a file in `/dev/shm` is host memory), created at the
    /// pool's exact size if missing: every process that opens the same path shares the pool
    /// (the scheduler side and its worker processes). The caller removes the file after use.
    #[staticmethod]
    fn open_shared(
        py: Python<'_>,
        path: PathBuf,
        slot_bytes: usize,
        slot_count: u32,
    ) -> PyResult<Self> {
        let memory = py
            .detach(|| HostPoolMemory::open_shared(&path, slot_bytes, slot_count))
            .map_err(|e| PyRuntimeError::new_err(format!("cannot open a shared host pool: {e}")))?;
        Ok(Self {
            memory: Arc::new(memory),
            pinned: PinnedPool::default(),
        })
    }

    /// Bytes per slot.
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.memory.slot_bytes()
    }

    /// Slots in the pool.
    #[getter]
    fn slot_count(&self) -> u32 {
        self.memory.slot_count()
    }
}

/// Reads `key` of `geometry` (a dict), which must be there.
fn geometry_item<'py, T: pyo3::conversion::FromPyObjectOwned<'py>>(
    geometry: &Bound<'py, PyDict>,
    key: &str,
) -> PyResult<T> {
    let value = geometry
        .get_item(key)?
        .ok_or_else(|| PyValueError::new_err(format!("engine geometry: {key:?} missing")))?;
    value.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        PyValueError::new_err(format!("engine geometry {key:?}: {e}"))
    })
}

/// The connector configuration (JSON text, the connector crate's keys) checked against the
/// engine's geometry (`model`, `dtype`, `tokens_per_block`, `block_bytes` (every worker's shard
/// together), `parallel_layout`, `hash_seed`, and optionally `worker_count`, default 1).
fn resolve(config_json: &str, geometry: &Bound<'_, PyDict>) -> PyResult<ResolvedConfig> {
    let config = ConnectorConfig::from_json_str(config_json)
        .map_err(|e| PyValueError::new_err(format!("kvtier connector config: {e}")))?;
    let engine = EngineGeometry {
        model: geometry_item(geometry, "model")?,
        dtype: geometry_item(geometry, "dtype")?,
        tokens_per_block: geometry_item(geometry, "tokens_per_block")?,
        block_bytes: geometry_item(geometry, "block_bytes")?,
        worker_count: match geometry.get_item("worker_count")? {
            Some(_) => geometry_item(geometry, "worker_count")?,
            None => 1,
        },
        parallel_layout: geometry_item(geometry, "parallel_layout")?,
        hash_seed: geometry_item(geometry, "hash_seed")?,
    };
    config
        .resolve(&engine)
        .map_err(|e| PyValueError::new_err(format!("kvtier connector config: {e}")))
}

/// Checks a connector configuration against the engine; returns what the Python half needs to
/// make the host pool and the worker: `slot_bytes`, `slot_count`, `blocks_per_chunk`,
/// `tokens_per_block`, `kv_group`.
#[pyfunction]
pub fn resolve_connector_config<'py>(
    py: Python<'py>,
    config_json: &str,
    geometry: Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyDict>> {
    let r = resolve(config_json, &geometry)?;
    let d = PyDict::new(py);
    d.set_item("slot_bytes", r.slot_bytes)?;
    d.set_item("slot_count", r.pool.slot_count)?;
    d.set_item("blocks_per_chunk", r.scheduler.blocks_per_chunk)?;
    d.set_item("tokens_per_block", r.scheduler.tokens_per_block)?;
    d.set_item("kv_group", r.scheduler.kv_group)?;
    Ok(d)
}

/// vLLM block hashes (bytes) as kvtier's 128-bit block hashes: the xxh3-128 of each, as the
/// tiers key chunks (`offload_key_to_chunk_key`).
#[pyfunction]
pub fn block_hashes_to_u128(hashes: Vec<Vec<u8>>) -> Vec<u128> {
    hashes.iter().map(|h| crate::key_hash(h)).collect()
}

/// A request scheduled in one step, as the Python half passes it: `(id, num_computed_tokens,
/// num_scheduled_tokens, num_tokens, new_block_ids, replace_blocks, block_hashes)`.
type ScheduledTuple = (u64, u32, u32, u32, Vec<u32>, bool, Vec<u128>);

/// kvtier's scheduler side: offload-core's request state machine over the tiering manager (host
/// pool plus the configured secondary tiers).
#[pyclass(module = "kvtier._kvtier", name = "ConnectorScheduler", frozen)]
pub struct PyConnectorScheduler {
    handle: Mutex<SchedulerHandle>,
    slot_bytes: u32,
}

#[pymethods]
impl PyConnectorScheduler {
    /// Resolves `config_json` against `geometry`, starts the secondary tiers it names over
    /// `pool`, and builds the scheduler. `strict`: panic on a broken bookkeeping invariant
    /// (tests); otherwise the request's offload is dropped and counted.
    #[new]
    #[pyo3(signature = (config_json, geometry, pool, strict=false))]
    fn new(
        py: Python<'_>,
        config_json: &str,
        geometry: Bound<'_, PyDict>,
        pool: &PyHostPool,
        strict: bool,
    ) -> PyResult<Self> {
        let resolved = resolve(config_json, &geometry)?;
        let memory: Arc<dyn SlotMemory> = pool.memory.clone();
        // One call, one strictness for the scheduler, the host pool and the tiering manager.
        let handle = py
            .detach(|| resolved.build_scheduler(memory, strict))
            .map_err(|e| PyValueError::new_err(format!("kvtier connector: {e}")))?;
        Ok(Self {
            handle: Mutex::new(handle),
            slot_bytes: resolved.slot_bytes,
        })
    }

    /// Bytes per chunk (host slot).
    #[getter]
    fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    /// A request arrived.
    #[pyo3(signature = (id, prompt_tokens, max_offload_tokens=None))]
    fn on_new_request(&self, id: u64, prompt_tokens: u32, max_offload_tokens: Option<u32>) {
        locked(&self.handle).on_new_request(NewRequest {
            id: RequestId(id),
            prompt_tokens,
            max_offload_tokens,
        });
    }

    /// Whether the request is tracked (arrived and not yet released).
    fn is_tracked(&self, id: u64) -> bool {
        locked(&self.handle).scheduler().is_tracked(RequestId(id))
    }

    /// Prefix lookup: tokens that can be loaded beyond `num_computed_tokens`, or `None` (ask
    /// again next step).
    fn get_num_new_matched_tokens(
        &self,
        id: u64,
        num_tokens: u32,
        block_hashes: Vec<u128>,
        num_computed_tokens: u32,
    ) -> Option<u32> {
        match locked(&self.handle).get_num_new_matched_tokens(
            RequestId(id),
            num_tokens,
            &block_hashes,
            num_computed_tokens,
        ) {
            MatchResult::Tokens(n) => Some(n),
            MatchResult::RetryLater => None,
        }
    }

    /// The request's blocks were allocated (its whole block table). Returns whether the load of
    /// `num_external_tokens` was built (always true for 0): false means no load job exists, and
    /// the engine must recompute those tokens.
    fn update_state_after_alloc(
        &self,
        id: u64,
        block_ids: Vec<u32>,
        num_external_tokens: u32,
    ) -> bool {
        let blocks: Vec<BlockId> = block_ids.into_iter().map(BlockId).collect();
        let mut h = locked(&self.handle);
        let before = h.scheduler().stats().load_jobs;
        h.update_state_after_alloc(RequestId(id), &blocks, num_external_tokens);
        num_external_tokens == 0 || h.scheduler().stats().load_jobs > before
    }

    /// This step's metadata for the workers, as JSON bytes (offload-core's `ConnectorMeta`).
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        scheduled: Vec<ScheduledTuple>,
        preempted: Vec<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let blocks: Vec<Vec<BlockId>> = scheduled
            .iter()
            .map(|s| s.4.iter().copied().map(BlockId).collect())
            .collect();
        let requests: Vec<StepRequest<'_>> = scheduled
            .iter()
            .zip(&blocks)
            .map(|(s, b)| StepRequest {
                id: RequestId(s.0),
                num_computed_tokens: s.1,
                num_scheduled_tokens: s.2,
                num_tokens: s.3,
                new_block_ids: b,
                replace_blocks: s.5,
                block_hashes: &s.6,
            })
            .collect();
        let preempted: Vec<RequestId> = preempted.into_iter().map(RequestId).collect();
        let meta = locked(&self.handle).build_connector_meta(&StepInput {
            step,
            scheduled: &requests,
            preempted: &preempted,
        });
        let bytes = serde_json::to_vec(&meta)
            .map_err(|e| PyRuntimeError::new_err(format!("connector meta: {e}")))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The workers' outputs (JSON bytes of `WorkerOutput`). Returns the loads that ended:
    /// `[(request, ok)]`.
    fn update_connector_output(&self, outputs: Vec<Vec<u8>>) -> PyResult<Vec<(u64, bool)>> {
        let outputs = outputs
            .iter()
            .map(|b| serde_json::from_slice::<WorkerOutput>(b))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| PyValueError::new_err(format!("worker output is not valid: {e}")))?;
        let outcome = locked(&self.handle).update_connector_output(&outputs);
        Ok(outcome.loads.into_iter().map(|(r, ok)| (r.0, ok)).collect())
    }

    /// The request finished (`aborted`: by the client or engine). Returns true when the engine
    /// must keep its blocks until `take_released` names it.
    fn request_finished(
        &self,
        id: u64,
        aborted: bool,
        num_tokens: u32,
        num_computed_tokens: u32,
        block_hashes: Vec<u128>,
    ) -> bool {
        locked(&self.handle).request_finished(&FinishedRequest {
            id: RequestId(id),
            kind: if aborted {
                FinishKind::Aborted
            } else {
                FinishKind::Finished
            },
            num_tokens,
            num_computed_tokens,
            block_hashes: &block_hashes,
        })
    }

    /// Drops everything in the host pool (the secondary tiers keep their data); returns the loads
    /// cancelled, `[(request, False)]`. Waits for the tiers' jobs (bounded), without the GIL.
    fn reset_cache(&self, py: Python<'_>) -> Vec<(u64, bool)> {
        let outcome = py.detach(|| locked(&self.handle).reset_cache());
        outcome.loads.into_iter().map(|(r, ok)| (r.0, ok)).collect()
    }

    /// Finished requests whose engine blocks may now be freed.
    fn take_released(&self) -> Vec<u64> {
        let mut out = Vec::new();
        locked(&self.handle).take_released(&mut out);
        out.into_iter().map(|r| r.0).collect()
    }

    /// KV events since the last call: `[(stored, medium, tier, hash, group)]`, `stored` false
    /// for a removal, in the order they happened.
    fn take_events(&self) -> Vec<(bool, &'static str, String, u128, u32)> {
        let mut events = Vec::new();
        locked(&self.handle).take_tier_events(&mut events);
        events
            .into_iter()
            .filter_map(|e| match e.event {
                KvEvent::Stored { key, medium } => {
                    Some((true, medium.as_str(), e.tier, key.hash, key.group))
                }
                KvEvent::Removed { key, medium } => {
                    Some((false, medium.as_str(), e.tier, key.hash, key.group))
                }
                // A kind this binding does not pass on (KvEvent may grow).
                _ => None,
            })
            .collect()
    }

    /// Every counter (scheduler, host pool, tiering, each tier, pool usage) as JSON text.
    fn metrics_json(&self) -> PyResult<String> {
        serde_json::to_string(&locked(&self.handle).metrics())
            .map_err(|e| PyRuntimeError::new_err(format!("metrics: {e}")))
    }

    /// Every counter in the Prometheus text format (kvtier's own names).
    fn prometheus_text(&self) -> String {
        locked(&self.handle).prometheus_text()
    }

    /// Jobs (loads and stores) the workers have not acknowledged yet.
    fn jobs_in_flight(&self) -> usize {
        locked(&self.handle).scheduler().jobs_in_flight()
    }

    /// Requests tracked (live or waiting for their jobs).
    fn tracked_requests(&self) -> usize {
        locked(&self.handle).scheduler().tracked_requests()
    }

    /// Secondary-tier jobs in flight.
    fn tier_jobs_in_flight(&self) -> usize {
        locked(&self.handle).tiering().tier_jobs_in_flight()
    }

    /// Reaps secondary-tier completions without blocking.
    fn poll_tiers(&self) {
        locked(&self.handle).poll_tiers();
    }

    /// Blocks (without the GIL) until every secondary-tier job was reported.
    fn drain_tiers(&self, py: Python<'_>) {
        py.detach(|| locked(&self.handle).drain_tiers());
    }

    /// Submits what is queued, drains and shuts down every secondary tier (a disk tier releases
    /// its directory; a peer tier stops serving). Later tier jobs are refused (and fail).
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| {
            locked(&self.handle)
                .scheduler_mut()
                .manager_mut()
                .shutdown()
        });
    }
}

/// One completed job as the Python half sees it.
type DoneTuple = (u64, u64, bool, bool, u64, f64, Vec<u32>);

/// The Python error for a worker that could not be made: a bad layout is a `ValueError`, a
/// missing driver or a failed CUDA call a `RuntimeError`.
fn worker_error(e: WorkerError) -> PyErr {
    match e {
        WorkerError::NullRegion | WorkerError::Layout { .. } | WorkerError::SlotBytes { .. } => {
            PyValueError::new_err(e.to_string())
        }
        _ => PyRuntimeError::new_err(format!("kvtier connector: {e}")),
    }
}

/// The regions as tier-gpu's, from `(base address, num_blocks, block_bytes, block_stride,
/// group)` each.
fn to_regions(regions: Vec<(u64, u32, u64, u64, u32)>) -> Vec<Region> {
    regions
        .into_iter()
        .map(
            |(base, num_blocks, block_bytes, block_stride, group)| Region {
                base,
                num_blocks,
                block_bytes,
                block_stride,
                group,
            },
        )
        .collect()
}

/// kvtier's worker side: executes each step's metadata between the engine's KV cache and the
/// host pool (with memcpy threads for KV caches in host memory, with tier-gpu's CUDA engine for
/// KV caches on a GPU), and reports every job once. The logic is `kvtier_worker::Worker`.
#[pyclass(module = "kvtier._kvtier", name = "ConnectorWorker", frozen)]
pub struct PyConnectorWorker {
    state: Mutex<Worker>,
    /// The objects owning the regions' memory (vLLM's KV cache tensors); dropped after `state`,
    /// so no copy thread or stream can touch freed memory.
    _owners: Vec<Py<PyAny>>,
}

#[pymethods]
impl PyConnectorWorker {
    /// A worker over `pool` and the engine's KV cache `regions` in host memory: `(base address,
    /// num_blocks, block_bytes, block_stride, group)` each, in the order a slot holds them.
    /// `owners` are the objects whose memory the regions are (kept alive while the worker
    /// lives). With `share_offset`, this worker (tensor-parallel rank `rank`) fills only its
    /// share of each slot, from that offset on; without, its regions fill whole slots.
    #[new]
    #[pyo3(signature = (pool, regions, blocks_per_chunk, owners, rank=0, share_offset=None, copy_threads=2, jobs_in_flight_max=64))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        pool: &PyHostPool,
        regions: Vec<(u64, u32, u64, u64, u32)>,
        blocks_per_chunk: u32,
        owners: Vec<Py<PyAny>>,
        rank: u32,
        share_offset: Option<u64>,
        copy_threads: usize,
        jobs_in_flight_max: usize,
    ) -> PyResult<Self> {
        let kv = KvCache::new(
            to_regions(regions),
            blocks_per_chunk,
            &pool.memory,
            rank,
            share_offset,
        )
        .map_err(worker_error)?;
        // SAFETY: every region lies in memory owned by one of `owners` (the caller's promise:
        // vLLM's KV cache tensors, whose storage never moves), which this worker keeps alive
        // until after the engine is dropped (its drop waits for every copy). Engine blocks and
        // slots a job names are not written by anyone else until its completion: the scheduler
        // side's fences and the host pool's reference counts make sure of it.
        let worker = unsafe {
            Worker::host(
                kv,
                pool.memory.clone(),
                rank,
                copy_threads,
                jobs_in_flight_max,
            )
        }
        .map_err(worker_error)?;
        Ok(Self {
            state: Mutex::new(worker),
            _owners: owners,
        })
    }

    /// A worker over KV caches in the memory of CUDA device `device` (`regions` are device
    /// addresses, as `data_ptr()` gives them; the rest as for the constructor), copying with
    /// tier-gpu's CUDA engine to and from `pool`, which is page-locked once per process. Raises
    /// `RuntimeError` naming the CUDA driver when none is usable in this process.
    #[staticmethod]
    #[pyo3(signature = (pool, regions, blocks_per_chunk, owners, device, rank=0, share_offset=None, jobs_in_flight_max=64))]
    #[allow(clippy::too_many_arguments)]
    fn cuda(
        py: Python<'_>,
        pool: &PyHostPool,
        regions: Vec<(u64, u32, u64, u64, u32)>,
        blocks_per_chunk: u32,
        owners: Vec<Py<PyAny>>,
        device: u32,
        rank: u32,
        share_offset: Option<u64>,
        jobs_in_flight_max: usize,
    ) -> PyResult<Self> {
        let kv = KvCache::new(
            to_regions(regions),
            blocks_per_chunk,
            &pool.memory,
            rank,
            share_offset,
        )
        .map_err(worker_error)?;
        // Registration page-locks the whole pool: seconds for a large one, without the GIL.
        let pinned = py
            .detach(|| pool.pinned.get_or_register(&pool.memory, device))
            .map_err(worker_error)?;
        // SAFETY: every region lies in device memory of `device` owned by one of `owners` (the
        // caller's promise: vLLM's KV cache tensors on that device, whose storage never moves),
        // which this worker keeps alive until after the engine is dropped (its drop
        // synchronises its streams). Ownership of blocks and slots as in `new`.
        let worker = unsafe { Worker::cuda(kv, pinned, device, rank, jobs_in_flight_max) }
            .map_err(worker_error)?;
        Ok(Self {
            state: Mutex::new(worker),
            _owners: owners,
        })
    }

    /// Whether this worker copies with the CUDA engine.
    #[getter]
    fn is_cuda(&self) -> bool {
        locked(&self.state).is_cuda()
    }

    /// Takes this step's metadata (JSON bytes from `ConnectorScheduler.build_connector_meta`).
    fn bind(&self, meta: &[u8]) -> PyResult<()> {
        let meta: ConnectorMeta = serde_json::from_slice(meta)
            .map_err(|e| PyValueError::new_err(format!("connector metadata is not valid: {e}")))?;
        locked(&self.state).bind(meta);
        Ok(())
    }

    /// Before the step's compute: finishes jobs older than a reset, waits for the stores to
    /// flush, starts the loads. Once per bound metadata; blocks without the GIL. `stale`: the
    /// metadata was built before a reset that has happened since: its loads and stores fail
    /// without a copy (their slots may belong to other chunks now); the rest still runs.
    /// `stream`: on CUDA, the raw handle of the compute stream (`torch.cuda.current_stream()
    /// .cuda_stream`; `None` or 0: the legacy default stream); the loads start after the work
    /// enqueued on it so far. Ignored on the host.
    #[pyo3(signature = (stale=false, stream=None))]
    fn before_compute(&self, py: Python<'_>, stale: bool, stream: Option<usize>) {
        py.detach(|| locked(&self.state).before_compute(stale, stream));
    }

    /// After the step's compute was enqueued: starts the stores (runs `before_compute` first if
    /// it was not). `stale` as for `before_compute`: the stores fail without a copy. `stream`
    /// as there: the stores start after the work enqueued on it so far (the forward that wrote
    /// their blocks).
    #[pyo3(signature = (stale=false, stream=None))]
    fn after_compute(&self, py: Python<'_>, stale: bool, stream: Option<usize>) {
        py.detach(|| locked(&self.state).after_compute(stale, stream));
    }

    /// Drops the bound metadata. Jobs of it that were not started (no `before_compute` for its
    /// loads, no `after_compute` for its stores) fail without a copy, so each still completes
    /// once.
    fn clear(&self) {
        locked(&self.state).clear();
    }

    /// The jobs completed since the last call: the output for the scheduler side (JSON bytes of
    /// `WorkerOutput`) and `[(job, request, is_load, ok, bytes, seconds, block_ids)]`; a load
    /// older than a reset reads as failed.
    fn take_output<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyBytes>, Vec<DoneTuple>)> {
        let (output, done) = locked(&self.state).take_output();
        let bytes = serde_json::to_vec(&output)
            .map_err(|e| PyRuntimeError::new_err(format!("worker output: {e}")))?;
        let done = done
            .into_iter()
            .map(|d| {
                (
                    d.job, d.request, d.is_load, d.ok, d.bytes, d.seconds, d.blocks,
                )
            })
            .collect();
        Ok((PyBytes::new(py, &bytes), done))
    }

    /// Jobs given to this worker and not yet reported.
    fn jobs_in_flight(&self) -> usize {
        locked(&self.state).jobs_in_flight()
    }

    /// Blocks (without the GIL) until every job given was copied, at most the worker's drain
    /// deadline (30 s; counted in `engine_drain_timeouts`); returns whether every job was.
    /// `take_output` reports them (those past the deadline later).
    fn drain(&self, py: Python<'_>) -> bool {
        py.detach(|| locked(&self.state).drain())
    }

    /// The worker's counters.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = locked(&self.state);
        let c = st.counters();
        let d = PyDict::new(py);
        d.set_item("jobs_submitted", c.jobs_submitted)?;
        d.set_item("engine_drain_timeouts", c.engine_drain_timeouts)?;
        d.set_item("jobs_ok", c.jobs_ok)?;
        d.set_item("jobs_failed", c.jobs_failed)?;
        d.set_item("submits_busy", c.submits_busy)?;
        d.set_item("flushes", c.flushes)?;
        d.set_item("compute_events_failed", st.compute_events_failed())?;
        Ok(d)
    }
}

/// Whether the CUDA driver and a device are usable in this process: `None` when they are, else
/// why not (the library is missing, no device, initialisation failed). Never raises; loading
/// this module never loads the driver.
#[pyfunction]
pub fn cuda_unavailable_reason() -> Option<String> {
    tier_gpu::cuda::available().err()
}
