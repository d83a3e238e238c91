//! Helpers shared by tier-fs's integration tests: configurations over temporary directories, a
//! small rig that stores and loads with deadlines, and file-system inspection.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{
    SlotMemory, Tier, TierChunk, TierCompletion, TierJob, TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobId, Medium, RequestId, SlotId};
use tempfile::TempDir;
use tier_fs::io::uring::UringEngine;
use tier_fs::{EngineChoice, FsTier, FsTierConfig, NamespaceId};
use tier_testkit::{fill_slot, first_mismatch, pattern, VecSlotMemory};

/// How long any wait in these tests may take.
pub const DEADLINE: Duration = Duration::from_secs(20);
/// Slot size of the rig's host pool.
pub const SLOT_BYTES: usize = 64 * 1024;
/// Slots of the rig's host pool.
pub const SLOT_COUNT: u32 = 16;
/// Record bytes of a full-slot chunk (header plus payload).
pub const FULL_FILE_BYTES: u64 = 4096 + SLOT_BYTES as u64;
/// Bytes of a segment's seal record.
pub const SEAL_BYTES: u64 = 4096;

/// The namespace every test uses.
pub fn namespace() -> NamespaceId {
    NamespaceId {
        model: "test-model".into(),
        dtype: "bfloat16".into(),
        tokens_per_chunk: 256,
        parallel_layout: "tp1".into(),
    }
}

/// Whether io_uring works here.
pub fn uring_available() -> bool {
    UringEngine::probe().is_ok()
}

/// `engine`, or `None` (with a loud note) when it is io_uring and io_uring is unavailable.
pub fn engine_or_skip(engine: EngineChoice, test: &str) -> Option<EngineChoice> {
    if engine == EngineChoice::Uring && !uring_available() {
        eprintln!("SKIPPED {test}: io_uring is unavailable on this machine");
        return None;
    }
    Some(engine)
}

/// A quiet configuration over `root` with 1 GiB of capacity (with zero-copy loads when this
/// thread's rigs use aligned memory, see [`use_aligned_memory`]).
pub fn config(root: &Path, engine: EngineChoice) -> FsTierConfig {
    FsTierConfig {
        engine,
        quiet: true,
        zero_copy_loads: ALIGNED_MEMORY.with(|cell| cell.get()),
        ..FsTierConfig::new(root, namespace(), 1 << 30)
    }
}

/// A host pool with a stable, 4 KiB-aligned address per slot (like the engine-facing pool), so
/// that the tier moves aligned payloads straight between slots and files.
pub use tier_fs::bench::AlignedSlotMemory;

thread_local! {
    /// Whether `Rig::start` on this thread uses an [`AlignedSlotMemory`] (zero-copy transfers)
    /// instead of a [`VecSlotMemory`] (bounce buffers). Each test runs on its own thread.
    static ALIGNED_MEMORY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Makes the rigs this thread starts from now on use aligned host memory (or not).
pub fn use_aligned_memory(aligned: bool) {
    ALIGNED_MEMORY.with(|cell| cell.set(aligned));
}

/// A tier with its host pool, driven with deadlines.
pub struct Rig {
    pub tier: FsTier,
    pub memory: Arc<dyn SlotMemory>,
    next_job: u64,
}

impl Rig {
    /// Starts a tier over a fresh host pool (aligned if [`use_aligned_memory`] said so on this
    /// thread); panics if it does not start.
    pub fn start(config: FsTierConfig) -> Rig {
        let memory: Arc<dyn SlotMemory> = if ALIGNED_MEMORY.with(|cell| cell.get()) {
            Arc::new(AlignedSlotMemory::new(SLOT_COUNT, SLOT_BYTES).expect("aligned host pool"))
        } else {
            Arc::new(VecSlotMemory::new(SLOT_COUNT, SLOT_BYTES))
        };
        let tier = FsTier::start(config, Arc::clone(&memory))
            .unwrap_or_else(|e| panic!("tier did not start: {e}"));
        Rig {
            tier,
            memory,
            next_job: 1,
        }
    }

    fn job(&mut self, op: TierOp, chunks: Vec<(ChunkKey, SlotId, u32)>) -> TierJob {
        let id = JobId(self.next_job);
        self.next_job += 1;
        TierJob {
            id,
            request: Some(RequestId(1)),
            op,
            chunks: chunks
                .into_iter()
                .map(|(key, slot, len)| TierChunk::new(key, slot, len))
                .collect(),
        }
    }

    /// Submits `job` (retrying while busy) and waits for its completion.
    pub fn run(&mut self, job: TierJob) -> TierCompletion {
        let id = job.id;
        let start = Instant::now();
        loop {
            match self.tier.submit(job.clone()) {
                Ok(()) => break,
                Err(e) if start.elapsed() < DEADLINE => {
                    assert!(
                        matches!(e, offload_core::tier::SubmitError::Busy { .. }),
                        "submit refused: {e}"
                    );
                    std::thread::yield_now();
                }
                Err(e) => panic!("submit refused: {e}"),
            }
        }
        self.wait(id)
    }

    /// Polls until job `id` completes; panics after the deadline.
    pub fn wait(&mut self, id: JobId) -> TierCompletion {
        let start = Instant::now();
        let mut out = Vec::new();
        loop {
            self.tier.poll(&mut out);
            if let Some(pos) = out.iter().position(|c| c.id == id) {
                return out.swap_remove(pos);
            }
            assert!(start.elapsed() < DEADLINE, "job {id:?} did not complete");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Fills each slot with `pattern(seed, len)` and stores the chunks in one job.
    pub fn store(&mut self, chunks: &[(ChunkKey, u32, u32, u64)]) -> TierCompletion {
        let mut list = Vec::new();
        for &(key, slot, len, seed) in chunks {
            fill_slot(&*self.memory, SlotId(slot), len as usize, seed);
            list.push((key, SlotId(slot), len));
        }
        let job = self.job(TierOp::Store, list);
        self.run(job)
    }

    /// Scrambles each slot and loads the chunks in one job.
    pub fn load(&mut self, chunks: &[(ChunkKey, u32, u32)]) -> TierCompletion {
        let mut list = Vec::new();
        for &(key, slot, len) in chunks {
            fill_slot(
                &*self.memory,
                SlotId(slot),
                SLOT_BYTES,
                0xBAD0_0000 + u64::from(slot),
            );
            list.push((key, SlotId(slot), len));
        }
        let job = self.job(TierOp::Load, list);
        self.run(job)
    }

    /// Whether the first `len` bytes of `slot` are `pattern(seed, len)`.
    pub fn slot_is(&self, slot: u32, len: u32, seed: u64) -> bool {
        first_mismatch(&*self.memory, SlotId(slot), len as usize, seed).is_none()
    }

    /// The settled lookup answer (polling through `Retry`).
    pub fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        let start = Instant::now();
        loop {
            let answer = self.tier.lookup(key);
            if answer != TierLookup::Retry {
                return answer;
            }
            assert!(start.elapsed() < DEADLINE, "lookup of {key:?} still Retry");
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// A key with a hash that spreads over all 128 bits.
pub fn key(n: u64) -> ChunkKey {
    let low = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x1234;
    ChunkKey::new(
        u128::from(low.rotate_left(29) ^ 0xF5) << 64 | u128::from(low),
        (n % 3) as u32,
    )
}

/// Every file under `dir` (recursively) whose name ends with `suffix`.
pub fn files_with_suffix(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.to_string_lossy().ends_with(suffix) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The sum of the sizes of the segment files under `dir`.
pub fn chunk_file_bytes(dir: &Path) -> u64 {
    files_with_suffix(dir, ".seg")
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

/// The bytes `pattern(seed, len)` (re-exported for tests that check files directly).
pub fn bytes_of(seed: u64, len: usize) -> Vec<u8> {
    pattern(seed, len)
}

/// A tier that owns its temporary directory (removed after the tier shut down), for the
/// conformance suite, which builds one tier per case.
pub struct OwnedDirTier {
    tier: FsTier,
    _dir: TempDir,
}

impl OwnedDirTier {
    /// A tier over `memory` in a fresh temporary directory.
    pub fn new(
        memory: Arc<dyn SlotMemory>,
        adjust: impl FnOnce(FsTierConfig) -> FsTierConfig,
    ) -> OwnedDirTier {
        let dir = tempfile::tempdir().expect("temporary directory");
        let config = adjust(config(dir.path(), EngineChoice::Auto));
        let tier = FsTier::start(config, memory).unwrap_or_else(|e| panic!("tier start: {e}"));
        OwnedDirTier { tier, _dir: dir }
    }
}

impl Tier for OwnedDirTier {
    fn name(&self) -> &str {
        self.tier.name()
    }
    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        self.tier.take_evicted(out)
    }
    fn medium(&self) -> Medium {
        self.tier.medium()
    }
    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        self.tier.lookup(key)
    }
    fn touch(&mut self, keys: &[ChunkKey]) {
        self.tier.touch(keys)
    }
    fn submit(&mut self, job: TierJob) -> Result<(), offload_core::tier::SubmitError> {
        self.tier.submit(job)
    }
    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        self.tier.poll(out)
    }
    fn cancel(&mut self, id: JobId) {
        self.tier.cancel(id)
    }
    fn drain(&mut self) {
        self.tier.drain()
    }
    fn on_request_finished(&mut self, request: RequestId) {
        self.tier.on_request_finished(request)
    }
    fn shutdown(&mut self) {
        self.tier.shutdown()
    }
}
