//! The simulated host pool's bytes, tensor-parallel shards, and the block copy behind a small
//! trait ([`CopyEngine`]) so that a real host-path implementation can replace the plain memcpy.
//!
//! The pool's bytes are one buffer shared by every worker (each writes its byte shard of every
//! slot) and by the secondary tiers (through [`HostMemory::slot_memory`], an
//! [`offload_core::SlotMemory`]): a cascade stores exactly what the workers wrote, and a promotion
//! is what the workers' loads read. A lock serialises access; the `Tier` ownership rules already
//! keep tiers and workers off each other's slots.

use std::sync::{Arc, Mutex, MutexGuard};

use offload_core::{BlockId, SlotId, SlotMemory, Transfer};

/// The bytes behind a [`HostMemory`], as tiers see them.
#[derive(Debug)]
struct SharedSlots {
    slot_bytes: usize,
    slot_count: u32,
    bytes: Mutex<Vec<u8>>,
}

impl SharedSlots {
    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn range(&self, slot: SlotId, offset: usize, len: usize) -> std::ops::Range<usize> {
        assert!(
            slot.0 < self.slot_count && offset + len <= self.slot_bytes,
            "range {offset}+{len} of slot {} outside a pool of {} slots of {} bytes",
            slot.0,
            self.slot_count,
            self.slot_bytes
        );
        let at = slot.0 as usize * self.slot_bytes + offset;
        at..at + len
    }
}

impl SlotMemory for SharedSlots {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        self.slot_count
    }

    fn read_slot(&self, slot: SlotId, offset: usize, dst: &mut [u8]) {
        let range = self.range(slot, offset, dst.len());
        dst.copy_from_slice(&self.lock()[range]);
    }

    fn write_slot(&self, slot: SlotId, offset: usize, src: &[u8]) {
        let range = self.range(slot, offset, src.len());
        self.lock()[range].copy_from_slice(src);
    }
}

/// The host pool's bytes: `slot_count` slots of `slot_bytes` in one buffer. Clones share it.
#[derive(Clone, Debug)]
pub struct HostMemory {
    shared: Arc<SharedSlots>,
}

impl HostMemory {
    /// Zeroed memory for `slot_count` slots.
    pub fn new(slot_count: u32, slot_bytes: usize) -> Self {
        Self {
            shared: Arc::new(SharedSlots {
                slot_bytes,
                slot_count,
                bytes: Mutex::new(vec![0; slot_count as usize * slot_bytes]),
            }),
        }
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.shared.slot_bytes
    }

    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.shared.slot_count
    }

    /// A copy of one slot's bytes.
    pub fn slot(&self, slot: SlotId) -> Vec<u8> {
        let range = self.shared.range(slot, 0, self.shared.slot_bytes);
        self.shared.lock()[range].to_vec()
    }

    /// The whole buffer, writable (for copy engines), locked until the guard is dropped.
    pub fn bytes_mut(&mut self) -> MutexGuard<'_, Vec<u8>> {
        self.shared.lock()
    }

    /// The same bytes as a [`SlotMemory`], for secondary tiers.
    pub fn slot_memory(&self) -> Arc<dyn SlotMemory> {
        self.shared.clone()
    }
}

/// The byte range of every block (and of every block-sized piece of a slot) that one
/// tensor-parallel worker owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// First byte within the block.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

impl Shard {
    /// Worker `rank`'s shard of a `block_bytes` block split among `count` workers.
    pub fn of(rank: u32, count: u32, block_bytes: u32) -> Self {
        let (rank, count, bytes) = (rank as usize, count.max(1) as usize, block_bytes as usize);
        let lo = rank * bytes / count;
        let hi = (rank + 1) * bytes / count;
        Self {
            offset: lo,
            len: hi - lo,
        }
    }
}

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    /// GPU blocks into host slots (a store).
    GpuToHost,
    /// Host slots into GPU blocks (a load).
    HostToGpu,
}

/// One contiguous copy between the GPU buffer and the host buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    /// Byte offset in the GPU buffer.
    pub gpu_offset: usize,
    /// Byte offset in the host buffer.
    pub host_offset: usize,
    /// Bytes.
    pub len: usize,
}

/// Performs block copies. The simulator's default is [`HostPathEngine`], tier-gpu's host path.
pub trait CopyEngine {
    /// Copies every range of `copies` in `direction`. Ranges are in bounds (checked by
    /// [`transfer_copies`]); an error means nothing may be assumed copied (the job fails).
    fn copy_blocks(
        &mut self,
        direction: CopyDirection,
        gpu: &mut [u8],
        host: &mut [u8],
        copies: &[BlockCopy],
    ) -> Result<(), String>;
}

/// Plain `copy_from_slice` copies on the calling thread.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemcpyEngine;

impl CopyEngine for MemcpyEngine {
    fn copy_blocks(
        &mut self,
        direction: CopyDirection,
        gpu: &mut [u8],
        host: &mut [u8],
        copies: &[BlockCopy],
    ) -> Result<(), String> {
        for c in copies {
            let g = c.gpu_offset..c.gpu_offset + c.len;
            let h = c.host_offset..c.host_offset + c.len;
            match direction {
                CopyDirection::GpuToHost => host[h].copy_from_slice(&gpu[g]),
                CopyDirection::HostToGpu => gpu[g].copy_from_slice(&host[h]),
            }
        }
        Ok(())
    }
}

/// tier-gpu's host path ([`tier_gpu::HostCopier`]): bounds- and overlap-checked copies, split
/// across its copy threads when large (small batches run on the calling thread).
pub struct HostPathEngine {
    copier: std::sync::Arc<tier_gpu::HostCopier>,
    runs: Vec<tier_gpu::CopyRun>,
}

impl HostPathEngine {
    /// Copies through `copier`.
    pub fn new(copier: std::sync::Arc<tier_gpu::HostCopier>) -> Self {
        Self {
            copier,
            runs: Vec::new(),
        }
    }
}

/// The process-wide host-path copier the simulator uses by default (two copy threads), or `None`
/// if its threads could not be started.
pub fn shared_copier() -> Option<std::sync::Arc<tier_gpu::HostCopier>> {
    static COPIER: std::sync::OnceLock<Option<std::sync::Arc<tier_gpu::HostCopier>>> =
        std::sync::OnceLock::new();
    COPIER
        .get_or_init(|| tier_gpu::HostCopier::new(2).ok().map(std::sync::Arc::new))
        .clone()
}

/// The default copy engine: tier-gpu's host path, or plain memcpy if its threads could not start.
pub fn default_copy_engine() -> Box<dyn CopyEngine> {
    match shared_copier() {
        Some(copier) => Box::new(HostPathEngine::new(copier)),
        None => Box::new(MemcpyEngine),
    }
}

impl CopyEngine for HostPathEngine {
    fn copy_blocks(
        &mut self,
        direction: CopyDirection,
        gpu: &mut [u8],
        host: &mut [u8],
        copies: &[BlockCopy],
    ) -> Result<(), String> {
        self.runs.clear();
        self.runs.extend(copies.iter().map(|c| tier_gpu::CopyRun {
            engine_addr: c.gpu_offset as u64,
            host_offset: c.host_offset as u64,
            len: c.len as u64,
        }));
        let direction = match direction {
            CopyDirection::GpuToHost => tier_gpu::host::Direction::ToHost,
            CopyDirection::HostToGpu => tier_gpu::host::Direction::ToEngine,
        };
        self.copier.copy(direction, gpu, host, &self.runs)
    }
}

/// The geometry copies are computed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyGeometry {
    /// Bytes per engine block.
    pub block_bytes: u32,
    /// Engine blocks per chunk (slot).
    pub blocks_per_chunk: u32,
    /// Engine blocks in the GPU cache.
    pub gpu_blocks: u32,
    /// Slots in the host pool.
    pub slots: u32,
}

/// Appends the copies of `shard` for `transfer`: block `i` of its `gpu_blocks` is chunk block
/// `first_block_in_chunk + i`, at that block's offset in the slot. Fails, naming the problem, if
/// the transfer is out of bounds (a bad job from the scheduler side).
pub fn transfer_copies(
    transfer: &Transfer,
    shard: Shard,
    geo: CopyGeometry,
    out: &mut Vec<BlockCopy>,
) -> Result<(), String> {
    let end = u64::from(transfer.first_block_in_chunk) + transfer.gpu_blocks.len() as u64;
    if end > u64::from(geo.blocks_per_chunk) {
        return Err(format!(
            "transfer of chunk {:#x} covers chunk blocks {}..{end}, beyond {} per chunk",
            transfer.key.hash, transfer.first_block_in_chunk, geo.blocks_per_chunk
        ));
    }
    if transfer.slot.0 >= geo.slots {
        return Err(format!(
            "slot {} out of range ({} slots)",
            transfer.slot.0, geo.slots
        ));
    }
    if let Some(b) = transfer.gpu_blocks.iter().find(|b| b.0 >= geo.gpu_blocks) {
        return Err(format!(
            "GPU block {} out of range ({} blocks)",
            b.0, geo.gpu_blocks
        ));
    }
    let bb = geo.block_bytes as usize;
    let slot_base = transfer.slot.0 as usize * bb * geo.blocks_per_chunk as usize;
    for (i, &BlockId(b)) in transfer.gpu_blocks.iter().enumerate() {
        let in_chunk = transfer.first_block_in_chunk as usize + i;
        out.push(BlockCopy {
            gpu_offset: b as usize * bb + shard.offset,
            host_offset: slot_base + in_chunk * bb + shard.offset,
            len: shard.len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::ChunkKey;

    #[test]
    fn shards_tile_the_block() {
        for count in 1..=5 {
            let mut next = 0;
            for rank in 0..count {
                let s = Shard::of(rank, count, 250);
                assert_eq!(s.offset, next);
                next += s.len;
            }
            assert_eq!(next, 250);
        }
    }

    fn geo() -> CopyGeometry {
        CopyGeometry {
            block_bytes: 8,
            blocks_per_chunk: 4,
            gpu_blocks: 10,
            slots: 3,
        }
    }

    #[test]
    fn copies_honour_first_block_in_chunk_and_shard() {
        let t = Transfer {
            key: ChunkKey::new(1, 0),
            slot: SlotId(2),
            first_block_in_chunk: 1,
            gpu_blocks: vec![BlockId(7), BlockId(3)],
        };
        let mut out = Vec::new();
        transfer_copies(&t, Shard::of(1, 2, 8), geo(), &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                BlockCopy {
                    gpu_offset: 7 * 8 + 4,
                    host_offset: 2 * 32 + 8 + 4,
                    len: 4
                },
                BlockCopy {
                    gpu_offset: 3 * 8 + 4,
                    host_offset: 2 * 32 + 16 + 4,
                    len: 4
                },
            ]
        );
    }

    #[test]
    fn sharded_round_trip_moves_whole_blocks_with_either_engine() {
        let copier = shared_copier().expect("copy threads start");
        let engines: [Box<dyn CopyEngine>; 2] = [
            Box::new(MemcpyEngine),
            Box::new(HostPathEngine::new(copier)),
        ];
        for mut engine in engines {
            let g = geo();
            let mut gpu: Vec<u8> = (0..80).map(|i| i as u8).collect();
            let mut host = vec![0u8; 3 * 32];
            let t = Transfer {
                key: ChunkKey::new(1, 0),
                slot: SlotId(1),
                first_block_in_chunk: 2,
                gpu_blocks: vec![BlockId(4), BlockId(5)],
            };
            for rank in 0..3 {
                let mut copies = Vec::new();
                transfer_copies(&t, Shard::of(rank, 3, 8), g, &mut copies).unwrap();
                engine
                    .copy_blocks(CopyDirection::GpuToHost, &mut gpu, &mut host, &copies)
                    .expect("in bounds");
            }
            assert_eq!(host[32 + 16..32 + 32], gpu[32..48]);
            assert!(host[..32 + 16].iter().all(|&b| b == 0));
            let mut back = vec![0u8; 80];
            for rank in 0..3 {
                let mut copies = Vec::new();
                transfer_copies(&t, Shard::of(rank, 3, 8), g, &mut copies).unwrap();
                engine
                    .copy_blocks(CopyDirection::HostToGpu, &mut back, &mut host, &copies)
                    .expect("in bounds");
            }
            assert_eq!(back[32..48], gpu[32..48]);
            assert!(back[..32].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn out_of_bounds_transfers_are_rejected() {
        let mut t = Transfer {
            key: ChunkKey::new(1, 0),
            slot: SlotId(0),
            first_block_in_chunk: 3,
            gpu_blocks: vec![BlockId(0), BlockId(1)],
        };
        let mut out = Vec::new();
        assert!(transfer_copies(&t, Shard::of(0, 1, 8), geo(), &mut out).is_err());
        t.first_block_in_chunk = 0;
        t.slot = SlotId(3);
        assert!(transfer_copies(&t, Shard::of(0, 1, 8), geo(), &mut out).is_err());
        t.slot = SlotId(0);
        t.gpu_blocks[1] = BlockId(10);
        assert!(transfer_copies(&t, Shard::of(0, 1, 8), geo(), &mut out).is_err());
        assert!(out.is_empty());
    }
}
