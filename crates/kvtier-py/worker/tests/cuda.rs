//! The CUDA worker on a GPU, in ONE sentinel test: without a usable CUDA driver and device it
//! says loudly on stderr "CUDA worker tests NOT RUN" and why, and passes; with one it drives
//! `kvtier_worker::Worker::cuda` (the code behind kvtier-py's `ConnectorWorker.cuda`) over
//! cuMemAlloc'd "KV caches" laid out like vLLM's per-layer tensors (K and V halves, so two
//! regions per layer), a pinned host pool and a compute stream given by its raw handle:
//! - a store bound after a slow "forward" that writes its blocks on the compute stream reads
//!   the written bytes (it waited for the forward, `after_compute(stream)`);
//! - the blocks are then overwritten, and a load of the stored chunk into other blocks, bound
//!   behind slow work on the compute stream that writes those blocks last, leaves the loaded
//!   bytes there (it waited for that work, `before_compute(stream)`), equal to the originals;
//! - a second `PinnedPool` user shares the first registration;
//! - stale metadata fails its jobs without a copy.

use std::sync::Arc;

use cudarc::driver::sys;
use kvtier_worker::{Done, KvCache, PinnedPool, Worker};
use offload_core::{
    BlockId, ChunkKey, ConnectorMeta, Job, JobId, JobKind, RequestId, SlotId, SlotMemory, Transfer,
};
use tier_gpu::cuda::{self, DeviceBuffer};
use tier_gpu::{HostPoolMemory, Region};

const DEVICE: u32 = 0;
const LAYERS: usize = 2;
/// One K (or V) half of one engine block of one layer: 16 tokens x 8 heads x 64 x 2 bytes.
const HALF_BYTES: usize = 16 * 8 * 64 * 2;
const NUM_BLOCKS: u32 = 32;
const BLOCKS_PER_CHUNK: u32 = 2;
const SLOT_COUNT: u32 = 8;

#[test]
fn cuda_worker_tests_ran_or_report_why_not() {
    if let Err(reason) = cuda::available() {
        use std::io::Write;
        let line = "==================================================================";
        let _ = writeln!(
            std::io::stderr(),
            "\n{line}\nCUDA worker tests NOT RUN: {reason}\n{line}"
        );
        return;
    }
    eprintln!("CUDA available: running the CUDA worker checks");
    let rig = Rig::new();
    store_after_the_forward_then_load_after_the_compute(&rig);
    stale_metadata_copies_nothing(&rig);
    eprintln!("CUDA worker tests RAN: all checks passed");
}

/// vLLM-style KV caches: one device tensor per layer, `(2, NUM_BLOCKS, HALF_BYTES)`, as regions
/// (K half, V half per layer), a host pool, and the worker.
struct Rig {
    layers: Vec<DeviceBuffer>,
    regions: Vec<Region>,
    memory: Arc<HostPoolMemory>,
    pinned: PinnedPool,
}

impl Rig {
    fn new() -> Self {
        let layer_bytes = 2 * NUM_BLOCKS as usize * HALF_BYTES;
        let layers: Vec<DeviceBuffer> = (0..LAYERS)
            .map(|_| DeviceBuffer::new(DEVICE, layer_bytes).expect("device allocation"))
            .collect();
        let regions = layers
            .iter()
            .flat_map(|layer| {
                (0..2u64).map(move |kv| Region {
                    base: layer.ptr() + kv * (NUM_BLOCKS as u64 * HALF_BYTES as u64),
                    num_blocks: NUM_BLOCKS,
                    block_bytes: HALF_BYTES as u64,
                    block_stride: HALF_BYTES as u64,
                    group: 0,
                })
            })
            .collect();
        let slot_bytes = 2 * LAYERS * HALF_BYTES * BLOCKS_PER_CHUNK as usize;
        let memory = Arc::new(HostPoolMemory::new(slot_bytes, SLOT_COUNT).expect("host pool"));
        Self {
            layers,
            regions,
            memory,
            pinned: PinnedPool::default(),
        }
    }

    fn worker(&self) -> Worker {
        let kv = KvCache::new(
            self.regions.clone(),
            BLOCKS_PER_CHUNK,
            &self.memory,
            0,
            None,
        )
        .expect("layout");
        let pinned = self
            .pinned
            .get_or_register(&self.memory, DEVICE)
            .expect("pinned pool");
        // SAFETY: the regions are live device buffers of the rig, which outlives the worker;
        // each check owns its blocks and slots while its jobs are in flight.
        unsafe { Worker::cuda(kv, pinned, DEVICE, 0, 16) }.expect("CUDA worker")
    }

    /// Every layer's bytes of engine block `block` (K then V).
    fn block(&self, block: u32) -> Vec<u8> {
        let mut out = Vec::new();
        for layer in &self.layers {
            for kv in 0..2 {
                let mut half = vec![0u8; HALF_BYTES];
                let at = (kv * NUM_BLOCKS as usize + block as usize) * HALF_BYTES;
                layer.read(at, &mut half).expect("device read");
                out.extend(half);
            }
        }
        out
    }

    /// Block `k` of `slot`, as `block` returns an engine block: the slot holds, region after
    /// region (layer 0 K, layer 0 V, layer 1 K, ...), `BLOCKS_PER_CHUNK` blocks each.
    fn slot_block(&self, slot: u32, k: usize) -> Vec<u8> {
        let mut out = vec![0u8; 2 * LAYERS * HALF_BYTES];
        for (r, half) in out.chunks_mut(HALF_BYTES).enumerate() {
            let offset = (r * BLOCKS_PER_CHUNK as usize + k) * HALF_BYTES;
            self.memory.read_slot(SlotId(slot), offset, half);
        }
        out
    }

    /// Writes `bytes` (as `block` returns them) into engine block `block`, synchronously.
    fn write_block(&self, block: u32, bytes: &[u8]) {
        for (l, layer) in self.layers.iter().enumerate() {
            for kv in 0..2 {
                let at = (kv * NUM_BLOCKS as usize + block as usize) * HALF_BYTES;
                let from = (2 * l + kv) * HALF_BYTES;
                layer
                    .write(at, &bytes[from..from + HALF_BYTES])
                    .expect("device write");
            }
        }
    }
}

fn pattern(seed: u8, block: u32) -> Vec<u8> {
    (0..2 * LAYERS * HALF_BYTES)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (block as u8).wrapping_mul(7))
        .collect()
}

/// A non-blocking stream (the "compute stream") with device copies as its kernels.
struct Compute {
    stream: sys::CUstream,
    _ctx: Arc<cudarc::driver::CudaContext>,
}

impl Compute {
    fn new() -> Self {
        let ctx = cudarc::driver::CudaContext::new(DEVICE as usize).expect("context");
        let mut stream = std::ptr::null_mut();
        // SAFETY: the primary context is current on this thread (CudaContext::new binds it).
        let code = unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuStreamCreate");
        Self { stream, _ctx: ctx }
    }

    fn handle(&self) -> Option<usize> {
        Some(self.stream as usize)
    }

    /// Enqueues ~ms of copies between two scratch buffers, then copies `src` over engine block
    /// `block` of every layer: a slow forward that writes the block last.
    fn slow_write(&self, rig: &Rig, scratch: &[DeviceBuffer; 2], src: &DeviceBuffer, block: u32) {
        for _ in 0..8 {
            self.copy(scratch[1].ptr(), scratch[0].ptr(), scratch[0].len());
        }
        for (l, layer) in rig.layers.iter().enumerate() {
            for kv in 0..2usize {
                let at = ((kv * NUM_BLOCKS as usize + block as usize) * HALF_BYTES) as u64;
                let from = ((2 * l + kv) * HALF_BYTES) as u64;
                self.copy(layer.ptr() + at, src.ptr() + from, HALF_BYTES);
            }
        }
    }

    fn copy(&self, dst: u64, src: u64, len: usize) {
        // SAFETY: both ranges are inside live device buffers of the test.
        let code = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemcpyDtoDAsync");
    }

    fn sync(&self) {
        // SAFETY: a live stream of this value.
        let code = unsafe { sys::cuStreamSynchronize(self.stream) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuStreamSynchronize");
    }
}

impl Drop for Compute {
    fn drop(&mut self) {
        // SAFETY: a live stream of this value, destroyed once after it is idle.
        unsafe {
            sys::cuStreamSynchronize(self.stream);
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

fn job(id: u64, kind: JobKind, slot: u32, blocks: &[u32]) -> Job {
    Job {
        id: JobId(id),
        request: RequestId(id),
        kind,
        transfers: vec![Transfer {
            key: ChunkKey::new(500 + u128::from(id), 0),
            slot: SlotId(slot),
            first_block_in_chunk: 0,
            gpu_blocks: blocks.iter().map(|&b| BlockId(b)).collect(),
        }],
    }
}

fn meta(step: u64, loads: Vec<Job>, stores: Vec<Job>) -> ConnectorMeta {
    ConnectorMeta {
        step,
        loads,
        stores,
        ..ConnectorMeta::default()
    }
}

/// Drains the worker and returns its reports.
fn reports(worker: &mut Worker) -> Vec<Done> {
    assert!(worker.drain(), "the worker drained within its deadline");
    worker.take_output().1
}

/// A device buffer holding `pattern(seed, block)`, laid out as `Rig::block` returns a block.
fn staged(seed: u8, block: u32) -> DeviceBuffer {
    let bytes = pattern(seed, block);
    let buffer = DeviceBuffer::new(DEVICE, bytes.len()).expect("staging buffer");
    buffer.write(0, &bytes).expect("device write");
    buffer
}

fn store_after_the_forward_then_load_after_the_compute(rig: &Rig) {
    let mut worker = rig.worker();
    assert!(worker.is_cuda());
    let compute = Compute::new();
    let scratch = [
        DeviceBuffer::new(DEVICE, 256 << 20).expect("scratch"),
        DeviceBuffer::new(DEVICE, 256 << 20).expect("scratch"),
    ];
    let (a, b) = (4u32, 5u32);
    rig.write_block(a, &pattern(1, a));
    rig.write_block(b, &pattern(1, b));
    // The forward writes blocks 4 and 5 (pattern 2) on the compute stream, slowly; the store
    // is started after it was enqueued, as vLLM's wait_for_save does.
    let forward = [staged(2, a), staged(2, b)];
    worker.bind(meta(1, vec![], vec![job(1, JobKind::Store, 3, &[a, b])]));
    worker.before_compute(false, compute.handle());
    compute.slow_write(rig, &scratch, &forward[0], a);
    compute.slow_write(rig, &scratch, &forward[1], b);
    worker.after_compute(false, compute.handle());
    let done = reports(&mut worker);
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(done[0].ok && !done[0].is_load, "{done:?}");
    compute.sync();
    assert!(
        rig.slot_block(3, 0) == pattern(2, a) && rig.slot_block(3, 1) == pattern(2, b),
        "the store read its blocks before the forward wrote them"
    );
    // Overwrite both blocks, then load the chunk into blocks 9 and 10 while the compute stream
    // still has slow work that writes pattern 3 into them last: the load must land after it.
    rig.write_block(a, &pattern(0, a));
    rig.write_block(b, &pattern(0, b));
    let (c, d) = (9u32, 10u32);
    let late = [staged(3, a), staged(3, b)];
    compute.slow_write(rig, &scratch, &late[0], c);
    compute.slow_write(rig, &scratch, &late[1], d);
    worker.bind(meta(2, vec![job(2, JobKind::Load, 3, &[c, d])], vec![]));
    worker.before_compute(false, compute.handle());
    worker.after_compute(false, compute.handle());
    let done = reports(&mut worker);
    compute.sync();
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(done[0].ok && done[0].is_load, "{done:?}");
    assert_eq!(done[0].blocks, vec![c, d]);
    assert!(
        rig.block(c) == pattern(2, a) && rig.block(d) == pattern(2, b),
        "the loaded blocks differ from what was stored (or the compute's later write won)"
    );
    // A second worker over the same pool shares its registration.
    let second = rig.worker();
    drop(second);
    drop(worker);
    eprintln!("ok: store after the forward, load after the compute, bytes equal the originals");
}

fn stale_metadata_copies_nothing(rig: &Rig) {
    let mut worker = rig.worker();
    rig.write_block(12, &pattern(5, 12));
    worker.bind(meta(3, vec![], vec![job(3, JobKind::Store, 6, &[12, 13])]));
    worker.after_compute(true, None);
    let done = reports(&mut worker);
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(!done[0].ok && done[0].bytes == 0, "{done:?}");
    assert_eq!(
        worker.counters().jobs_submitted,
        0,
        "nothing reached the engine"
    );
    eprintln!("ok: stale metadata fails its store without a copy");
}
