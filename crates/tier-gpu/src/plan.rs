//! Copy planning: which byte ranges of the engine's KV cache go to which bytes of the host pool for
//! a job, coalesced into the largest contiguous runs. Pure code over plain addresses, so it is
//! tested with fake ones; the CUDA and host engines execute its output.
//!
//! The engine's KV cache is registered as [`Region`]s: each holds `num_blocks` engine blocks of
//! `block_bytes` bytes, `block_stride` bytes apart (per-layer pages are one region per layer;
//! pages contiguous across layers are one region whose block holds every layer). A host slot holds,
//! for the chunk's KV group, each region of that group in registration order, each as
//! `blocks_per_chunk` consecutive blocks of that region's `block_bytes`.

use offload_core::{ChunkKey, Transfer};
use thiserror::Error;

/// One registered region of the engine's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Address of block 0 (a device pointer on the CUDA path, a host address on the host path).
    pub base: u64,
    /// Engine blocks in the region.
    pub num_blocks: u32,
    /// Bytes of one block in this region.
    pub block_bytes: u64,
    /// Distance between the starts of consecutive blocks (at least `block_bytes`).
    pub block_stride: u64,
    /// The KV group whose chunks this region holds.
    pub group: u32,
}

/// A planning error; names what was wrong.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum PlanError {
    /// The layout is unusable.
    #[error("invalid KV layout: {0}")]
    Layout(String),
    /// A transfer names a group no region holds.
    #[error("chunk {key:?} is in KV group {group}, which no registered region holds")]
    UnknownGroup {
        /// The chunk.
        key: ChunkKey,
        /// Its group.
        group: u32,
    },
    /// A transfer names an engine block outside a region.
    #[error("engine block {block} is outside region {region} ({num_blocks} blocks)")]
    BlockOutOfRange {
        /// The block.
        block: u32,
        /// The region index.
        region: usize,
        /// Blocks in that region.
        num_blocks: u32,
    },
    /// A transfer's blocks do not fit in a chunk.
    #[error("chunk {key:?}: blocks {first}..{end} do not fit in a chunk of {blocks_per_chunk}")]
    ChunkOverflow {
        /// The chunk.
        key: ChunkKey,
        /// First block within the chunk.
        first: u32,
        /// One past the last block within the chunk.
        end: u64,
        /// Blocks per chunk.
        blocks_per_chunk: u32,
    },
    /// A slot index beyond the pool.
    #[error("slot {slot} is outside the host pool ({slot_count} slots)")]
    SlotOutOfRange {
        /// The slot.
        slot: u32,
        /// Slots in the pool.
        slot_count: u32,
    },
}

/// One contiguous copy between the engine's memory and the host pool (direction chosen by the
/// caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CopyRun {
    /// Engine-side address.
    pub engine_addr: u64,
    /// Byte offset in the host pool.
    pub host_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The engine's KV cache as regions, and the host slot layout derived from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    regions: Vec<Region>,
    blocks_per_chunk: u32,
    slot_count: u32,
    /// Offset of region `i`'s part within this layout's share of a slot.
    region_offsets: Vec<u64>,
    slot_bytes: u64,
    /// Where this layout's share starts within a slot (0 unless built by [`KvLayout::share`]).
    share_offset: u64,
}

impl KvLayout {
    /// Validates the regions and derives the slot layout for `slot_count` slots.
    pub fn new(
        regions: Vec<Region>,
        blocks_per_chunk: u32,
        slot_count: u32,
    ) -> Result<Self, PlanError> {
        let bad = |what: String| Err(PlanError::Layout(what));
        if regions.is_empty() {
            return bad("no region registered".into());
        }
        if blocks_per_chunk == 0 {
            return bad("blocks_per_chunk must be at least 1".into());
        }
        if slot_count == 0 {
            return bad("slot_count must be at least 1".into());
        }
        let mut region_offsets = Vec::with_capacity(regions.len());
        let mut group_bytes: std::collections::BTreeMap<u32, u64> = Default::default();
        for (i, r) in regions.iter().enumerate() {
            if r.block_bytes == 0 || r.num_blocks == 0 {
                return bad(format!(
                    "region {i}: block_bytes and num_blocks must be positive"
                ));
            }
            if r.block_stride < r.block_bytes {
                return bad(format!(
                    "region {i}: block_stride {} is smaller than block_bytes {}",
                    r.block_stride, r.block_bytes
                ));
            }
            let span = u64::from(r.num_blocks - 1)
                .checked_mul(r.block_stride)
                .and_then(|s| s.checked_add(r.block_bytes))
                .and_then(|s| s.checked_add(r.base));
            if span.is_none() {
                return bad(format!("region {i}: address range overflows"));
            }
            let used = group_bytes.entry(r.group).or_insert(0);
            region_offsets.push(*used);
            let part = r.block_bytes.checked_mul(u64::from(blocks_per_chunk));
            let Some(next) = part.and_then(|p| used.checked_add(p)) else {
                return bad(format!("region {i}: slot size overflows"));
            };
            *used = next;
        }
        let slot_bytes = group_bytes.values().copied().max().unwrap_or(0);
        if slot_bytes.checked_mul(u64::from(slot_count)).is_none() {
            return bad("host pool size overflows".into());
        }
        Ok(Self {
            regions,
            blocks_per_chunk,
            slot_count,
            region_offsets,
            slot_bytes,
            share_offset: 0,
        })
    }

    /// One worker's share of slots that several workers fill (tensor-parallel ranks, each with
    /// its own shard of every engine block): the slot is `slot_bytes` long, and this worker's
    /// regions take the `share_bytes` from `share_offset` on, laid out as [`KvLayout::new`] lays
    /// out a whole slot. Fails unless that share fits in the slot.
    pub fn share(
        regions: Vec<Region>,
        blocks_per_chunk: u32,
        slot_count: u32,
        share_offset: u64,
        slot_bytes: u64,
    ) -> Result<Self, PlanError> {
        let mut layout = Self::new(regions, blocks_per_chunk, slot_count)?;
        let end = share_offset.checked_add(layout.slot_bytes);
        if end.is_none_or(|e| e > slot_bytes) {
            return Err(PlanError::Layout(format!(
                "a share of {} bytes at offset {share_offset} does not fit in a slot of \
                 {slot_bytes} bytes",
                layout.slot_bytes
            )));
        }
        if slot_bytes.checked_mul(u64::from(slot_count)).is_none() {
            return Err(PlanError::Layout("host pool size overflows".into()));
        }
        layout.share_offset = share_offset;
        layout.slot_bytes = slot_bytes;
        Ok(layout)
    }

    /// The regions, in registration order.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Bytes per host slot (the largest group's chunk, or the whole slot of a
    /// [`KvLayout::share`]).
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Slots in the host pool.
    pub fn slot_count(&self) -> u32 {
        self.slot_count
    }

    /// Bytes of the whole host pool.
    pub fn pool_bytes(&self) -> u64 {
        self.slot_bytes * u64::from(self.slot_count)
    }

    /// Engine blocks per chunk.
    pub fn blocks_per_chunk(&self) -> u32 {
        self.blocks_per_chunk
    }

    /// Appends to `out` the copies of `transfers`, coalesced: runs that are contiguous on both
    /// sides are merged, and the result is sorted by engine address. `out` is cleared first.
    /// Returns the bytes to move. Nothing is appended on error.
    pub fn plan(&self, transfers: &[Transfer], out: &mut Vec<CopyRun>) -> Result<u64, PlanError> {
        out.clear();
        for t in transfers {
            if let Err(e) = self.plan_transfer(t, out) {
                out.clear();
                return Err(e);
            }
        }
        Ok(coalesce(out))
    }

    fn plan_transfer(&self, t: &Transfer, out: &mut Vec<CopyRun>) -> Result<(), PlanError> {
        if t.slot.0 >= self.slot_count {
            return Err(PlanError::SlotOutOfRange {
                slot: t.slot.0,
                slot_count: self.slot_count,
            });
        }
        let end = u64::from(t.first_block_in_chunk) + t.gpu_blocks.len() as u64;
        if end > u64::from(self.blocks_per_chunk) {
            return Err(PlanError::ChunkOverflow {
                key: t.key,
                first: t.first_block_in_chunk,
                end,
                blocks_per_chunk: self.blocks_per_chunk,
            });
        }
        let slot_base = u64::from(t.slot.0) * self.slot_bytes + self.share_offset;
        let mut found = false;
        for (i, r) in self.regions.iter().enumerate() {
            if r.group != t.key.group {
                continue;
            }
            found = true;
            let part = slot_base + self.region_offsets[i];
            for (k, block) in t.gpu_blocks.iter().enumerate() {
                if block.0 >= r.num_blocks {
                    return Err(PlanError::BlockOutOfRange {
                        block: block.0,
                        region: i,
                        num_blocks: r.num_blocks,
                    });
                }
                let in_chunk = u64::from(t.first_block_in_chunk) + k as u64;
                out.push(CopyRun {
                    engine_addr: r.base + u64::from(block.0) * r.block_stride,
                    host_offset: part + in_chunk * r.block_bytes,
                    len: r.block_bytes,
                });
            }
        }
        if !found {
            return Err(PlanError::UnknownGroup {
                key: t.key,
                group: t.key.group,
            });
        }
        Ok(())
    }
}

/// Sorts runs by engine address and merges those contiguous on both sides; returns total bytes.
fn coalesce(runs: &mut Vec<CopyRun>) -> u64 {
    runs.sort_unstable();
    let mut merged = 0usize;
    for i in 0..runs.len() {
        let run = runs[i];
        if merged > 0 {
            let last = &mut runs[merged - 1];
            if last.engine_addr + last.len == run.engine_addr
                && last.host_offset + last.len == run.host_offset
            {
                last.len += run.len;
                continue;
            }
        }
        runs[merged] = run;
        merged += 1;
    }
    runs.truncate(merged);
    runs.iter().map(|r| r.len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::{BlockId, SlotId};

    fn transfer(hash: u128, group: u32, slot: u32, first: u32, blocks: &[u32]) -> Transfer {
        Transfer {
            key: ChunkKey::new(hash, group),
            slot: SlotId(slot),
            first_block_in_chunk: first,
            gpu_blocks: blocks.iter().map(|&b| BlockId(b)).collect(),
        }
    }

    fn region(base: u64, bytes: u64, stride: u64, group: u32) -> Region {
        Region {
            base,
            num_blocks: 100,
            block_bytes: bytes,
            block_stride: stride,
            group,
        }
    }

    #[test]
    fn contiguous_pages_coalesce_into_one_run_per_chunk_and_across_adjacent_slots() {
        let layout = KvLayout::new(vec![region(0x10000, 64, 64, 0)], 4, 8).expect("valid");
        assert_eq!(layout.slot_bytes(), 256);
        let mut out = Vec::new();
        let t = [
            transfer(1, 0, 2, 0, &[4, 5, 6, 7]),
            transfer(2, 0, 3, 0, &[8, 9, 10, 11]),
        ];
        let bytes = layout.plan(&t, &mut out).expect("plans");
        assert_eq!(bytes, 512);
        assert_eq!(
            out,
            vec![CopyRun {
                engine_addr: 0x10000 + 4 * 64,
                host_offset: 512,
                len: 512
            }]
        );
    }

    #[test]
    fn scattered_blocks_stay_separate_runs() {
        let layout = KvLayout::new(vec![region(0, 64, 64, 0)], 4, 8).expect("valid");
        let mut out = Vec::new();
        layout
            .plan(&[transfer(1, 0, 0, 0, &[9, 3, 4, 20])], &mut out)
            .expect("plans");
        assert_eq!(
            out,
            vec![
                CopyRun {
                    engine_addr: 3 * 64,
                    host_offset: 64,
                    len: 128
                },
                CopyRun {
                    engine_addr: 9 * 64,
                    host_offset: 0,
                    len: 64
                },
                CopyRun {
                    engine_addr: 20 * 64,
                    host_offset: 192,
                    len: 64
                },
            ]
        );
    }

    #[test]
    fn per_layer_regions_fill_their_part_of_the_slot_and_skip_cached_blocks() {
        // Two layers, strided pages (stride 128 > 32 bytes used), a chunk of 4 blocks whose
        // first block is already in the GPU cache (first_block_in_chunk = 1).
        let regions = vec![region(0x1000, 32, 128, 0), region(0x9000, 32, 128, 0)];
        let layout = KvLayout::new(regions, 4, 2).expect("valid");
        assert_eq!(layout.slot_bytes(), 256);
        let mut out = Vec::new();
        let bytes = layout
            .plan(&[transfer(1, 0, 1, 1, &[5, 6, 7])], &mut out)
            .expect("plans");
        assert_eq!(bytes, 6 * 32);
        let expect: Vec<CopyRun> = [0x1000u64, 0x9000]
            .iter()
            .enumerate()
            .flat_map(|(layer, &base)| {
                (0..3u64).map(move |k| CopyRun {
                    engine_addr: base + (5 + k) * 128,
                    host_offset: 256 + layer as u64 * 128 + (1 + k) * 32,
                    len: 32,
                })
            })
            .collect();
        assert_eq!(out, expect);
    }

    #[test]
    fn a_share_of_the_slot_starts_at_its_offset_and_must_fit() {
        // Two workers, each 2 regions of 100 bytes per block, 2 blocks per chunk: a share is 400
        // bytes of an 800-byte slot; rank 1's starts at 400.
        let regions = vec![region(0, 100, 100, 0), region(1 << 20, 100, 100, 0)];
        let layout = KvLayout::share(regions.clone(), 2, 4, 400, 800).expect("fits");
        assert_eq!(layout.slot_bytes(), 800);
        let mut runs = Vec::new();
        layout
            .plan(&[transfer(1, 0, 3, 0, &[5, 6])], &mut runs)
            .expect("plans");
        assert_eq!(
            runs,
            vec![
                CopyRun {
                    engine_addr: 500,
                    host_offset: 3 * 800 + 400,
                    len: 200
                },
                CopyRun {
                    engine_addr: (1 << 20) + 500,
                    host_offset: 3 * 800 + 600,
                    len: 200
                },
            ]
        );
        let err = KvLayout::share(regions, 2, 4, 401, 800).expect_err("does not fit");
        assert!(err.to_string().contains("offset 401"), "{err}");
    }

    #[test]
    fn kv_groups_use_only_their_regions() {
        let regions = vec![region(0, 16, 16, 0), region(0x100000, 48, 48, 1)];
        let layout = KvLayout::new(regions, 2, 4).expect("valid");
        assert_eq!(
            layout.slot_bytes(),
            96,
            "the larger group decides the slot size"
        );
        let mut out = Vec::new();
        layout
            .plan(&[transfer(7, 1, 3, 0, &[2, 3])], &mut out)
            .expect("plans");
        assert_eq!(
            out,
            vec![CopyRun {
                engine_addr: 0x100000 + 96,
                host_offset: 288,
                len: 96
            }]
        );
    }

    #[test]
    fn bad_transfers_are_errors_naming_the_problem_and_plan_nothing() {
        let layout = KvLayout::new(vec![region(0, 64, 64, 0)], 4, 8).expect("valid");
        let mut out = vec![CopyRun {
            engine_addr: 1,
            host_offset: 1,
            len: 1,
        }];
        let err = layout
            .plan(&[transfer(1, 0, 8, 0, &[1])], &mut out)
            .unwrap_err();
        assert_eq!(
            err,
            PlanError::SlotOutOfRange {
                slot: 8,
                slot_count: 8
            }
        );
        assert!(out.is_empty());
        let err = layout
            .plan(&[transfer(1, 0, 0, 0, &[100])], &mut out)
            .unwrap_err();
        assert!(
            matches!(err, PlanError::BlockOutOfRange { block: 100, .. }),
            "{err}"
        );
        let err = layout
            .plan(&[transfer(1, 0, 0, 3, &[1, 2])], &mut out)
            .unwrap_err();
        assert!(matches!(err, PlanError::ChunkOverflow { .. }), "{err}");
        let err = layout
            .plan(&[transfer(1, 5, 0, 0, &[1])], &mut out)
            .unwrap_err();
        assert!(
            matches!(err, PlanError::UnknownGroup { group: 5, .. }),
            "{err}"
        );
        assert!(
            KvLayout::new(vec![region(0, 64, 32, 0)], 4, 8).is_err(),
            "stride < block"
        );
        assert!(KvLayout::new(vec![], 4, 8).is_err());
    }
}
