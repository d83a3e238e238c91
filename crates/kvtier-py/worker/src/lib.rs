//! The worker side of kvtier's vLLM connector (`kvtier.vllm.connector`), without Python:
//! [`Worker`] executes each step's [`ConnectorMeta`] on a transfer engine between the engine's
//! KV cache and the host pool, and reports every job exactly once. kvtier-py's
//! `ConnectorWorker` wraps it; its CUDA test drives it with nothing but a driver.
//!
//! Two engines: tier-gpu's [`HostTransferEngine`] (memcpy threads) for KV caches in host memory,
//! and its [`CudaTransferEngine`] for KV caches in device memory, over the host pool page-locked
//! once per process ([`PinnedPool`]).
//!
//! Compute ordering on CUDA (design.md section 4, item 14). The engine's forward pass runs
//! asynchronously on its compute stream, which the caller names by its raw handle (PyTorch's
//! `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default stream):
//! - [`Worker::before_compute`] records a [`StreamEvent`] on that stream, before this step's
//!   forward is enqueued, and the loads' copies wait for it: the kernels that still read or write
//!   the blocks they overwrite (a previous step's, under async scheduling) go first.
//! - [`Worker::after_compute`] records another one after the forward was enqueued, and the
//!   stores' copies wait for it: they read the blocks only once the forward wrote them.
//! - A load is reported only when its completion event says the bytes are on the device, and
//!   vLLM runs no forward over a loading request's blocks before that report (its loads are
//!   asynchronous), so no forward reads a block a load still writes.
//! - A store that the metadata flushes (its source blocks are reused) is waited for on the host
//!   (the connector crate's `WorkerHandle`), before this step's forward is enqueued.
//!
//! When no event can be recorded (a stream capturing a CUDA graph, a driver error), the jobs that
//! needed it fail without a copy: a failed load is recomputed, a failed store frees its slots.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use connector::{WorkerCounters, WorkerHandle};
use offload_core::{ConnectorMeta, Job, JobAck, JobKind, SlotMemory, WorkerOutput};
use thiserror::Error;
use tier_gpu::cuda::{
    self, ComputeEvent, CudaEngineConfig, CudaTransferEngine, PinnedHostPool, StreamEvent,
    REGISTER_PIECE_BYTES_DEFAULT,
};
use tier_gpu::{
    HostCopier, HostPoolMemory, HostTransferEngine, KvLayout, PlanError, Region, TransferError,
};

/// Why a worker could not be made.
#[derive(Debug, Error)]
pub enum WorkerError {
    /// A region's address is 0.
    #[error("a KV cache region's address is 0")]
    NullRegion,
    /// The regions do not form a layout for the pool.
    #[error("KV cache layout of rank {rank}: {source}")]
    Layout {
        /// The worker's rank.
        rank: u32,
        /// What was wrong.
        source: PlanError,
    },
    /// The regions' chunk size differs from the pool's slot size.
    #[error(
        "the registered KV caches hold {layout} bytes per chunk, the host pool's slots {pool}"
    )]
    SlotBytes {
        /// Bytes per chunk of the layout.
        layout: u64,
        /// Bytes per slot of the pool.
        pool: u64,
    },
    /// The host path's copy threads did not start.
    #[error("copy threads did not start: {0}")]
    CopyThreads(std::io::Error),
    /// The host transfer engine refused the layout.
    #[error("host transfer engine: {0}")]
    HostEngine(String),
    /// No usable CUDA driver (or device) in this process.
    #[error(
        "KV caches on CUDA device {device} need the CUDA driver, which is not usable here: \
         {reason}"
    )]
    NoDriver {
        /// The device the KV caches are on.
        device: u32,
        /// What failed (library not found, no device, initialisation).
        reason: String,
    },
    /// A CUDA call failed (registration of the host pool, engine creation, events).
    #[error("CUDA device {device}: {source}")]
    Cuda {
        /// The device.
        device: u32,
        /// What failed.
        source: TransferError,
    },
}

/// The engine's KV cache as tier-gpu's layout, checked against the host pool.
pub struct KvCache {
    layout: KvLayout,
    /// Bytes of one engine block, all regions together.
    block_bytes: u64,
}

impl KvCache {
    /// The layout of `regions` (in the order a slot holds them) over `pool`: whole slots, or with
    /// `share_offset` only this worker's share of each slot (tensor-parallel rank `rank`), from
    /// that offset on.
    pub fn new(
        regions: Vec<Region>,
        blocks_per_chunk: u32,
        pool: &HostPoolMemory,
        rank: u32,
        share_offset: Option<u64>,
    ) -> Result<Self, WorkerError> {
        if regions.iter().any(|r| r.base == 0) {
            return Err(WorkerError::NullRegion);
        }
        let block_bytes = regions.iter().map(|r| r.block_bytes).sum();
        let slot_count = pool.slot_count();
        let slot_bytes = pool.slot_bytes() as u64;
        let layout = match share_offset {
            None => KvLayout::new(regions, blocks_per_chunk, slot_count),
            Some(offset) => {
                KvLayout::share(regions, blocks_per_chunk, slot_count, offset, slot_bytes)
            }
        }
        .map_err(|source| WorkerError::Layout { rank, source })?;
        if layout.slot_bytes() != slot_bytes {
            return Err(WorkerError::SlotBytes {
                layout: layout.slot_bytes(),
                pool: slot_bytes,
            });
        }
        Ok(Self {
            layout,
            block_bytes,
        })
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
}

/// A host pool's registration with the CUDA driver, shared by every CUDA worker over that pool
/// in this process: pages can be registered once only, and the registration ends when the last
/// worker using it is dropped.
#[derive(Default)]
pub struct PinnedPool(Mutex<Weak<PinnedHostPool>>);

impl PinnedPool {
    /// The registration of `memory`, made now (with device `device`'s driver) if no worker holds
    /// one. Says first, naming it, when the CUDA driver is not usable.
    pub fn get_or_register(
        &self,
        memory: &Arc<HostPoolMemory>,
        device: u32,
    ) -> Result<Arc<PinnedHostPool>, WorkerError> {
        cuda::available().map_err(|reason| WorkerError::NoDriver { device, reason })?;
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pinned) = held.upgrade() {
            return Ok(pinned);
        }
        let pinned =
            PinnedHostPool::register(Arc::clone(memory), device, REGISTER_PIECE_BYTES_DEFAULT)
                .map_err(|source| WorkerError::Cuda { device, source })?;
        let pinned = Arc::new(pinned);
        *held = Arc::downgrade(&pinned);
        Ok(pinned)
    }
}

/// What the worker remembers of a job it was given, until it reports it.
struct JobInfo {
    request: u64,
    kind: JobKind,
    blocks: Vec<u32>,
    bytes: u64,
    started: Instant,
    /// The job is older than a reset: a load is reported failed (recompute), whatever its copy.
    cancelled: bool,
}

/// One reported job.
#[derive(Clone, Debug, PartialEq)]
pub struct Done {
    /// The job.
    pub job: u64,
    /// Its request.
    pub request: u64,
    /// A load (else a store).
    pub is_load: bool,
    /// Whether it succeeded (a load older than a reset never does).
    pub ok: bool,
    /// Bytes copied (0 when it failed).
    pub bytes: u64,
    /// Seconds from `bind` to the report.
    pub seconds: f64,
    /// The engine blocks it named.
    pub blocks: Vec<u32>,
}

/// The CUDA engine and the events its jobs wait on. The handle is declared first, so it drops
/// first: its engine synchronises its streams, and no queued job names an event any more, when
/// the events are destroyed.
struct CudaCopies {
    handle: WorkerHandle<CudaTransferEngine>,
    /// Recorded before the forward; the loads wait on it.
    loads_after: StreamEvent,
    /// Recorded after the forward; the stores wait on it.
    stores_after: StreamEvent,
}

/// The engine a worker copies with (each boxed: a worker holds one).
enum Copies {
    Host(Box<WorkerHandle<HostTransferEngine>>),
    Cuda(Box<CudaCopies>),
}

/// Records `event` on `stream` when `jobs` need it; `Err` says why it could not be.
fn dependency(
    event: &mut StreamEvent,
    jobs: &[Job],
    stream: Option<usize>,
) -> Result<Option<ComputeEvent>, TransferError> {
    if jobs.is_empty() {
        // Nothing waits on it (and vLLM's warm-up and graph-capture runs carry no jobs).
        return Ok(None);
    }
    // SAFETY: the stream is the caller's live compute stream of this device (or 0, the legacy
    // stream: `Worker::before_compute`'s contract); the event outlives every submit given the
    // dependency (`CudaCopies` drops its handle first).
    unsafe { event.record(stream.unwrap_or(0)) }.map(Some)
}

/// A [`ConnectorMeta`] with only the bookkeeping, none of its own copies.
fn without_copies(meta: &ConnectorMeta) -> ConnectorMeta {
    ConnectorMeta {
        loads: Vec::new(),
        stores: Vec::new(),
        ..meta.clone()
    }
}

/// kvtier's worker side over one transfer engine: binds each step's metadata, runs it around the
/// engine's compute, and reports every job once.
pub struct Worker {
    copies: Copies,
    meta: Option<ConnectorMeta>,
    before_done: bool,
    jobs: HashMap<u64, JobInfo>,
    /// Jobs completed here as failed without a copy (stale metadata, never started, no compute
    /// event): reported with the next output, each once.
    failed_here: Vec<JobAck>,
    block_bytes: u64,
    compute_events_failed: u64,
}

impl Worker {
    /// A worker over KV caches in host memory, copying with `copy_threads` memcpy threads.
    ///
    /// # Safety
    ///
    /// The regions of `kv` must be host memory that stays allocated and in place until the worker
    /// is dropped, and the engine blocks and slots a job names are written by no one else until
    /// its completion is reported (the scheduler side's fences and the host pool's reference
    /// counts see to that).
    pub unsafe fn host(
        kv: KvCache,
        pool: Arc<HostPoolMemory>,
        rank: u32,
        copy_threads: usize,
        jobs_in_flight_max: usize,
    ) -> Result<Self, WorkerError> {
        let copier = HostCopier::new(copy_threads).map_err(WorkerError::CopyThreads)?;
        // SAFETY: forwarded from the caller.
        let engine = unsafe {
            HostTransferEngine::new(kv.layout, pool, Arc::new(copier), jobs_in_flight_max)
        }
        .map_err(WorkerError::HostEngine)?;
        Ok(Self::over(
            Copies::Host(Box::new(WorkerHandle::new(rank, engine))),
            kv.block_bytes,
        ))
    }

    /// A worker over KV caches in the memory of CUDA device `device`, copying on the CUDA
    /// engine's streams to and from `pinned`.
    ///
    /// # Safety
    ///
    /// The regions of `kv` must be device memory of `device` that stays allocated and in place
    /// until the worker is dropped (vLLM's KV cache tensors, held by the caller), with the same
    /// ownership rule as [`Worker::host`].
    pub unsafe fn cuda(
        kv: KvCache,
        pinned: Arc<PinnedHostPool>,
        device: u32,
        rank: u32,
        jobs_in_flight_max: usize,
    ) -> Result<Self, WorkerError> {
        cuda::available().map_err(|reason| WorkerError::NoDriver { device, reason })?;
        let failed = |source| WorkerError::Cuda { device, source };
        let config = CudaEngineConfig {
            device_ordinal: device,
            jobs_in_flight_max,
            ..CudaEngineConfig::default()
        };
        // SAFETY: forwarded from the caller.
        let engine =
            unsafe { CudaTransferEngine::new(kv.layout, pinned, config) }.map_err(failed)?;
        let copies = CudaCopies {
            handle: WorkerHandle::new(rank, engine),
            loads_after: StreamEvent::new(device).map_err(failed)?,
            stores_after: StreamEvent::new(device).map_err(failed)?,
        };
        Ok(Self::over(Copies::Cuda(Box::new(copies)), kv.block_bytes))
    }

    fn over(copies: Copies, block_bytes: u64) -> Self {
        Self {
            copies,
            meta: None,
            before_done: false,
            jobs: HashMap::new(),
            failed_here: Vec::new(),
            block_bytes,
            compute_events_failed: 0,
        }
    }

    /// Whether this worker copies with the CUDA engine.
    pub fn is_cuda(&self) -> bool {
        matches!(self.copies, Copies::Cuda(_))
    }

    /// Fails `jobs` without copying anything.
    fn fail(&mut self, jobs: &[Job]) {
        self.failed_here.extend(jobs.iter().map(|j| JobAck {
            job: j.id,
            success: false,
        }));
    }

    /// Takes this step's metadata. Jobs of a previous metadata that were never started fail
    /// without a copy; jobs older than the metadata's reset are marked (a load among them is
    /// reported failed).
    pub fn bind(&mut self, meta: ConnectorMeta) {
        if let Some(old) = self.meta.take() {
            // The previous step's metadata was never finished: what it did not start fails.
            if !self.before_done {
                self.fail(&old.loads);
            }
            self.fail(&old.stores);
        }
        if let Some(floor) = meta.reset_before {
            for (id, job) in self.jobs.iter_mut() {
                if *id < floor.0 {
                    job.cancelled = true;
                }
            }
        }
        let now = Instant::now();
        for job in meta.loads.iter().chain(&meta.stores) {
            let blocks: Vec<u32> = job
                .transfers
                .iter()
                .flat_map(|t| t.gpu_blocks.iter().map(|b| b.0))
                .collect();
            let bytes = blocks.len() as u64 * self.block_bytes;
            self.jobs.insert(
                job.id.0,
                JobInfo {
                    request: job.request.0,
                    kind: job.kind,
                    blocks,
                    bytes,
                    started: now,
                    cancelled: false,
                },
            );
        }
        self.meta = Some(meta);
        self.before_done = false;
    }

    /// Before the step's compute is enqueued: finishes jobs older than a reset, waits for the
    /// stores to flush, starts the loads (on CUDA after the work enqueued on `stream` so far).
    /// Once per bound metadata. `stale`: the metadata was built before a reset that has
    /// happened since: its loads and stores fail without a copy (their slots may belong to other
    /// chunks now); the rest still runs.
    ///
    /// `stream`: the raw handle of the engine's compute stream on the KV caches' device (`None`:
    /// the legacy default stream); ignored by a host worker. It must be a live stream of the
    /// device's primary context.
    pub fn before_compute(&mut self, stale: bool, stream: Option<usize>) {
        if self.before_done {
            return;
        }
        let Some(meta) = self.meta.take() else {
            return;
        };
        let mut run = if stale {
            self.fail(&meta.loads);
            self.fail(&meta.stores);
            without_copies(&meta)
        } else {
            meta
        };
        match &mut self.copies {
            Copies::Host(handle) => handle.before_compute(&run, None),
            Copies::Cuda(c) => match dependency(&mut c.loads_after, &run.loads, stream) {
                Ok(after) => c.handle.before_compute(&run, after),
                Err(err) => {
                    log::warn!(
                        "kvtier worker: no compute event for {} load(s), which fail (recompute): \
                         {err}",
                        run.loads.len()
                    );
                    self.compute_events_failed += 1;
                    let loads = std::mem::take(&mut run.loads);
                    c.handle.before_compute(&run, None);
                    self.failed_here.extend(loads.iter().map(|j| JobAck {
                        job: j.id,
                        success: false,
                    }));
                }
            },
        }
        run.loads.clear();
        self.meta = Some(run);
        self.before_done = true;
    }

    /// After the step's compute was enqueued: starts the stores (on CUDA after the work enqueued
    /// on `stream` so far), running [`Worker::before_compute`] first if it was not. `stale` and
    /// `stream` as there.
    pub fn after_compute(&mut self, stale: bool, stream: Option<usize>) {
        self.before_compute(stale, stream);
        let Some(meta) = self.meta.take() else {
            return;
        };
        if stale {
            self.fail(&meta.stores);
            return;
        }
        match &mut self.copies {
            Copies::Host(handle) => handle.after_compute(&meta, None),
            Copies::Cuda(c) => match dependency(&mut c.stores_after, &meta.stores, stream) {
                Ok(after) => c.handle.after_compute(&meta, after),
                Err(err) => {
                    log::warn!(
                        "kvtier worker: no compute event for {} store(s), which fail: {err}",
                        meta.stores.len()
                    );
                    self.compute_events_failed += 1;
                    self.fail(&meta.stores);
                }
            },
        }
    }

    /// Drops the bound metadata. Jobs of it that were not started (no `before_compute` for its
    /// loads, no `after_compute` for its stores) fail without a copy, so each still completes
    /// once.
    pub fn clear(&mut self) {
        if let Some(meta) = self.meta.take() {
            if !self.before_done {
                self.fail(&meta.loads);
            }
            self.fail(&meta.stores);
        }
    }

    /// The jobs completed since the last call: the output for the scheduler side and each job's
    /// report; a load older than a reset reads as failed.
    pub fn take_output(&mut self) -> (WorkerOutput, Vec<Done>) {
        let mut output = match &mut self.copies {
            Copies::Host(handle) => handle.take_output(),
            Copies::Cuda(c) => c.handle.take_output(),
        };
        output.acks.append(&mut self.failed_here);
        let now = Instant::now();
        let mut done = Vec::with_capacity(output.acks.len());
        for ack in &output.acks {
            let Some(job) = self.jobs.remove(&ack.job.0) else {
                continue;
            };
            let is_load = job.kind == JobKind::Load;
            done.push(Done {
                job: ack.job.0,
                request: job.request,
                is_load,
                ok: ack.success && !(is_load && job.cancelled),
                bytes: if ack.success { job.bytes } else { 0 },
                seconds: now.duration_since(job.started).as_secs_f64(),
                blocks: job.blocks,
            });
        }
        (output, done)
    }

    /// Jobs given to this worker and not yet reported.
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// Blocks until every job given was copied, at most the worker's drain deadline; returns
    /// whether every job was. `take_output` reports them (those past the deadline later).
    pub fn drain(&mut self) -> bool {
        match &mut self.copies {
            Copies::Host(handle) => handle.drain(),
            Copies::Cuda(c) => c.handle.drain(),
        }
    }

    /// The worker handle's counters.
    pub fn counters(&self) -> WorkerCounters {
        match &self.copies {
            Copies::Host(handle) => handle.counters(),
            Copies::Cuda(c) => c.handle.counters(),
        }
    }

    /// Steps whose loads or stores failed without a copy because no compute event could be
    /// recorded on the compute stream.
    pub fn compute_events_failed(&self) -> u64 {
        self.compute_events_failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::{BlockId, ChunkKey, JobId, RequestId, SlotId, Transfer};

    const BLOCK_BYTES: usize = 256;
    const NUM_BLOCKS: u32 = 16;
    const SLOTS: u32 = 4;

    /// Two host "KV cache" regions and a pool of whole-chunk slots (two blocks per chunk).
    struct Host {
        kv: Vec<Vec<u8>>,
        pool: Arc<HostPoolMemory>,
    }

    impl Host {
        fn new() -> Self {
            let kv = (0..2)
                .map(|r| {
                    (0..NUM_BLOCKS as usize * BLOCK_BYTES)
                        .map(|i| (i * 7 + r * 101) as u8)
                        .collect()
                })
                .collect();
            let pool = Arc::new(HostPoolMemory::new(2 * 2 * BLOCK_BYTES, SLOTS).expect("pool"));
            Self { kv, pool }
        }

        fn regions(&mut self) -> Vec<Region> {
            self.kv
                .iter_mut()
                .map(|region| Region {
                    base: region.as_mut_ptr() as u64,
                    num_blocks: NUM_BLOCKS,
                    block_bytes: BLOCK_BYTES as u64,
                    block_stride: BLOCK_BYTES as u64,
                    group: 0,
                })
                .collect()
        }

        fn worker(&mut self) -> Worker {
            let kv = KvCache::new(self.regions(), 2, &self.pool, 0, None).expect("layout");
            // SAFETY: the regions are `self.kv`, which each test keeps alive and untouched
            // while the worker has jobs in flight (every test drains before reading).
            unsafe { Worker::host(kv, Arc::clone(&self.pool), 0, 1, 8) }.expect("worker")
        }

        fn block(&self, r: usize, block: u32) -> &[u8] {
            &self.kv[r][block as usize * BLOCK_BYTES..][..BLOCK_BYTES]
        }
    }

    fn job(id: u64, kind: JobKind, slot: u32, blocks: &[u32]) -> Job {
        Job {
            id: JobId(id),
            request: RequestId(100 + id),
            kind,
            transfers: vec![Transfer {
                key: ChunkKey::new(u128::from(id), 0),
                slot: SlotId(slot),
                first_block_in_chunk: 0,
                gpu_blocks: blocks.iter().map(|&b| BlockId(b)).collect(),
            }],
        }
    }

    fn meta(loads: Vec<Job>, stores: Vec<Job>) -> ConnectorMeta {
        ConnectorMeta {
            loads,
            stores,
            ..ConnectorMeta::default()
        }
    }

    fn reports(worker: &mut Worker) -> Vec<Done> {
        assert!(worker.drain());
        let (output, done) = worker.take_output();
        assert_eq!(
            output.acks.len(),
            done.len(),
            "one report per acknowledgement"
        );
        done
    }

    #[test]
    fn host_store_then_load_moves_the_exact_bytes_and_reports_each_job_once() {
        let mut host = Host::new();
        let mut worker = host.worker();
        assert!(!worker.is_cuda());
        worker.bind(meta(vec![], vec![job(1, JobKind::Store, 2, &[3, 4])]));
        worker.before_compute(false, None);
        worker.after_compute(false, None);
        let done = reports(&mut worker);
        assert_eq!(done.len(), 1);
        assert!(done[0].ok && !done[0].is_load);
        assert_eq!(
            done[0].bytes,
            2 * 2 * BLOCK_BYTES as u64,
            "2 blocks of 2 regions"
        );
        assert_eq!((done[0].request, done[0].blocks.clone()), (101, vec![3, 4]));
        worker.bind(meta(vec![job(2, JobKind::Load, 2, &[9, 10])], vec![]));
        worker.before_compute(false, None);
        worker.after_compute(false, None);
        let done = reports(&mut worker);
        assert_eq!(done.len(), 1);
        assert!(done[0].ok && done[0].is_load);
        assert!(reports(&mut worker).is_empty(), "reported once");
        drop(worker);
        for r in 0..2 {
            assert_eq!(host.block(r, 9), host.block(r, 3).to_vec(), "region {r}");
            assert_eq!(host.block(r, 10), host.block(r, 4).to_vec(), "region {r}");
        }
    }

    #[test]
    fn stale_or_unstarted_metadata_fails_its_jobs_without_a_copy() {
        let mut host = Host::new();
        let before: Vec<u8> = host.block(0, 9).to_vec();
        let mut worker = host.worker();
        // Stale: the load and the store fail, nothing reaches the engine.
        worker.bind(meta(
            vec![job(1, JobKind::Load, 1, &[9, 10])],
            vec![job(2, JobKind::Store, 2, &[3, 4])],
        ));
        worker.before_compute(true, None);
        worker.after_compute(true, None);
        let done = reports(&mut worker);
        assert_eq!(done.len(), 2, "{done:?}");
        assert!(done.iter().all(|d| !d.ok && d.bytes == 0), "{done:?}");
        assert_eq!(worker.counters().jobs_submitted, 0);
        // Bound and replaced before any compute: both jobs of the first fail, once each.
        worker.bind(meta(
            vec![job(3, JobKind::Load, 1, &[9, 10])],
            vec![job(4, JobKind::Store, 2, &[3, 4])],
        ));
        worker.bind(meta(vec![], vec![]));
        worker.clear();
        let done = reports(&mut worker);
        let mut ids: Vec<u64> = done.iter().map(|d| d.job).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![3, 4]);
        assert!(done.iter().all(|d| !d.ok));
        assert_eq!(worker.counters().jobs_submitted, 0);
        assert_eq!(worker.jobs_in_flight(), 0);
        drop(worker);
        assert_eq!(host.block(0, 9), before, "no load wrote the blocks");
    }

    #[test]
    fn cuda_kv_caches_without_a_driver_are_refused_naming_it() {
        if let Ok(()) = cuda::available() {
            eprintln!("NOTE: a CUDA driver is present: the missing-driver error is NOT CHECKED");
            return;
        }
        let mut host = Host::new();
        let err = PinnedPool::default()
            .get_or_register(&host.pool, 1)
            .err()
            .expect("no registration without a driver");
        assert!(
            matches!(err, WorkerError::NoDriver { device: 1, .. }),
            "{err}"
        );
        let message = err.to_string();
        assert!(
            message.contains("CUDA device 1") && message.contains("CUDA driver library"),
            "{message}"
        );
        // Worker::cuda says the same before anything else (it needs a PinnedHostPool, which
        // cannot exist here, so the pool registration above is the first thing that fails).
        let kv = KvCache::new(host.regions(), 2, &host.pool, 0, None).expect("layout");
        assert_eq!(kv.layout().slot_bytes(), host.pool.slot_bytes() as u64);
    }

    #[test]
    fn a_layout_that_does_not_fill_the_slots_is_refused() {
        let mut host = Host::new();
        let mut regions = host.regions();
        regions.pop();
        let err = KvCache::new(regions, 2, &host.pool, 0, None)
            .err()
            .expect("half a slot");
        assert!(matches!(err, WorkerError::SlotBytes { .. }), "{err}");
        let mut regions = host.regions();
        regions[1].base = 0;
        assert!(matches!(
            KvCache::new(regions, 2, &host.pool, 0, None),
            Err(WorkerError::NullRegion)
        ));
    }
}
