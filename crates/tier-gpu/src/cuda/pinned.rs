//! The pinned host pool: a [`HostPoolMemory`] page-locked for DMA with `cuMemHostRegister`, in
//! pieces (1 GiB by default), all or nothing; and the pure helpers that cut the pool into pieces
//! and keep every copy inside one registered piece.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{check, Context};
use crate::plan::CopyRun;
use crate::{HostPoolMemory, TransferError};

/// Default size of one `cuMemHostRegister` call.
pub const REGISTER_PIECE_BYTES_DEFAULT: usize = 1 << 30;

/// Host page size that registration pieces must be a multiple of.
const PAGE_BYTES: usize = 4096;

/// A host pool registered with the CUDA driver (page-locked, `CU_MEMHOSTREGISTER_PORTABLE`: pinned
/// for every context, not write-combined, so host-side reads of stored chunks stay fast).
///
/// Shared by every [`CudaTransferEngine`](super::CudaTransferEngine) that copies into it (hold it
/// in an `Arc`); the registration ends when the last holder drops it. Engines synchronise their
/// streams before releasing their `Arc`, so no copy is in flight when the pool is unregistered.
/// The memory itself (an `Arc<HostPoolMemory>`, which tiers also read as
/// [`SlotMemory`](offload_core::SlotMemory)) outlives the registration as long as anyone holds it.
pub struct PinnedHostPool {
    memory: Arc<HostPoolMemory>,
    piece_bytes: usize,
    ctx: Context,
}

impl PinnedHostPool {
    /// Registers all of `memory` with the driver of device `ordinal`, in pieces of `piece_bytes`
    /// (a positive multiple of 4096; [`REGISTER_PIECE_BYTES_DEFAULT`] is a good choice). If a
    /// piece fails, the pieces already registered are unregistered and the error names the piece.
    pub fn register(
        memory: Arc<HostPoolMemory>,
        ordinal: u32,
        piece_bytes: usize,
    ) -> Result<Self, TransferError> {
        if piece_bytes == 0 || piece_bytes % PAGE_BYTES != 0 {
            return Err(TransferError::Unavailable(format!(
                "registration piece of {piece_bytes} bytes: must be a positive multiple of \
                 {PAGE_BYTES}"
            )));
        }
        let ctx = Context::retain(ordinal)?;
        let entered = ctx.enter()?;
        let base = memory.as_ptr();
        let pieces = registration_pieces(memory.len(), piece_bytes);
        for (done, &(offset, len)) in pieces.iter().enumerate() {
            // SAFETY: `offset..offset+len` lies inside the pool's mapping (registration_pieces
            // covers exactly `0..len()`), which `memory` keeps alive for as long as `Self`.
            let code = unsafe {
                sys::cuMemHostRegister_v2(
                    base.add(offset).cast::<c_void>(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            if let Err(failure) = check(code, || {
                format!(
                    "cuMemHostRegister(pool offset {offset}, {len} bytes, piece {done} of {})",
                    pieces.len()
                )
            }) {
                unregister(base, &pieces[..done]);
                return Err(failure.into());
            }
        }
        drop(entered);
        Ok(Self {
            memory,
            piece_bytes,
            ctx,
        })
    }

    /// The registered memory.
    pub fn memory(&self) -> &Arc<HostPoolMemory> {
        &self.memory
    }

    /// Bytes in the pool.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Whether the pool is empty (never: a host pool has at least one slot).
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// Size of each registered piece (the last may be shorter); no copy crosses a piece boundary.
    pub fn piece_bytes(&self) -> usize {
        self.piece_bytes
    }

    /// The first byte of the pool.
    pub fn as_ptr(&self) -> *mut u8 {
        self.memory.as_ptr()
    }
}

impl Drop for PinnedHostPool {
    fn drop(&mut self) {
        let entered = self.ctx.enter();
        let pieces = registration_pieces(self.memory.len(), self.piece_bytes);
        unregister(self.memory.as_ptr(), &pieces);
        drop(entered);
    }
}

/// Unregisters `pieces` of the pool at `base`; errors (a torn-down driver) leave nothing to undo.
fn unregister(base: *mut u8, pieces: &[(usize, usize)]) {
    for &(offset, _) in pieces {
        // SAFETY: each piece was registered at exactly this address by `register`, and the
        // mapping is still alive (the caller holds the memory).
        let _ = unsafe { sys::cuMemHostUnregister(base.add(offset).cast::<c_void>()) };
    }
}

/// Cuts `len` bytes into `(offset, len)` pieces of `piece_bytes` (the last one shorter).
pub(crate) fn registration_pieces(len: usize, piece_bytes: usize) -> Vec<(usize, usize)> {
    assert!(piece_bytes > 0, "registration piece size must be positive");
    (0..len)
        .step_by(piece_bytes)
        .map(|offset| (offset, piece_bytes.min(len - offset)))
        .collect()
}

/// Writes `runs` into `out` (cleared first), each run cut where its host range crosses a multiple
/// of `piece_bytes`, so that every copy reads or writes one registered piece only. Both sides of a
/// cut advance together; the order of `runs` is kept.
pub(crate) fn split_at_pieces(runs: &[CopyRun], piece_bytes: u64, out: &mut Vec<CopyRun>) {
    assert!(piece_bytes > 0, "registration piece size must be positive");
    out.clear();
    for run in runs {
        let mut run = *run;
        while run.len > 0 {
            let to_boundary = piece_bytes - run.host_offset % piece_bytes;
            let len = run.len.min(to_boundary);
            out.push(CopyRun { len, ..run });
            run.engine_addr += len;
            run.host_offset += len;
            run.len -= len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_pool_exactly_with_a_short_tail() {
        assert_eq!(
            registration_pieces(10, 4),
            vec![(0, 4), (4, 4), (8, 2)],
            "a short last piece"
        );
        assert_eq!(registration_pieces(8, 4), vec![(0, 4), (4, 4)]);
        assert_eq!(registration_pieces(3, 4), vec![(0, 3)]);
        assert!(registration_pieces(0, 4).is_empty());
        let gib = REGISTER_PIECE_BYTES_DEFAULT;
        let pieces = registration_pieces(5 * gib / 2, gib);
        assert_eq!(pieces, vec![(0, gib), (gib, gib), (2 * gib, gib / 2)]);
    }

    #[test]
    fn runs_crossing_a_piece_boundary_are_cut_there_and_others_are_kept() {
        let run = |engine_addr, host_offset, len| CopyRun {
            engine_addr,
            host_offset,
            len,
        };
        let mut out = vec![run(9, 9, 9)];
        let runs = [
            run(0x1000, 90, 30),
            run(0x5000, 0, 100),
            run(0x9000, 150, 260),
        ];
        split_at_pieces(&runs, 100, &mut out);
        assert_eq!(
            out,
            vec![
                run(0x1000, 90, 10),
                run(0x1000 + 10, 100, 20),
                run(0x5000, 0, 100),
                run(0x9000, 150, 50),
                run(0x9000 + 50, 200, 100),
                run(0x9000 + 150, 300, 100),
                run(0x9000 + 250, 400, 10),
            ]
        );
        let total = |runs: &[CopyRun]| runs.iter().map(|r| r.len).sum::<u64>();
        assert_eq!(total(&out), total(&runs), "no byte lost or added");
        split_at_pieces(&[], 100, &mut out);
        assert!(out.is_empty());
    }
}
