//! [`SimTransferEngine`]: a tier-gpu [`TransferEngine`] over the simulator's memories (a shared
//! GPU buffer and the host pool's bytes), moving one worker's byte shard of every block, so that
//! the connector's [`::connector::WorkerHandle`] can run on simulated memory. Copies happen at
//! submit; completions are reported by the next `poll`, in submission order.

use std::sync::{Arc, Mutex};

use offload_core::{Job, JobId, JobKind};
use tier_gpu::{TransferDone, TransferEngine, TransferError};

use crate::gpu::GpuMemory;
use crate::host::{
    transfer_copies, BlockCopy, CopyDirection, CopyEngine, CopyGeometry, HostMemory, MemcpyEngine,
    Shard,
};

/// One worker's transfer engine on simulated memory.
pub struct SimTransferEngine {
    gpu: Arc<Mutex<GpuMemory>>,
    host: HostMemory,
    geo: CopyGeometry,
    shard: Shard,
    done: Vec<TransferDone>,
    copies: Vec<BlockCopy>,
}

impl SimTransferEngine {
    /// Worker `rank` of `count`, over `gpu` and `host` with geometry `geo`.
    pub fn new(
        rank: u32,
        count: u32,
        gpu: Arc<Mutex<GpuMemory>>,
        host: HostMemory,
        geo: CopyGeometry,
    ) -> Self {
        Self {
            gpu,
            host,
            geo,
            shard: Shard::of(rank, count, geo.block_bytes),
            done: Vec::new(),
            copies: Vec::new(),
        }
    }
}

impl TransferEngine for SimTransferEngine {
    /// The simulated engine computes on the calling thread: nothing to wait for.
    type Dependency = ();

    fn submit_after(&mut self, job: &Job, _after: Option<()>) -> Result<(), TransferError> {
        self.copies.clear();
        for t in &job.transfers {
            transfer_copies(t, self.shard, self.geo, &mut self.copies)
                .map_err(|e| TransferError::Unavailable(format!("job {}: {e}", job.id.0)))?;
        }
        let direction = match job.kind {
            JobKind::Store => CopyDirection::GpuToHost,
            JobKind::Load => CopyDirection::HostToGpu,
        };
        let mut gpu = self.gpu.lock().unwrap_or_else(|e| e.into_inner());
        let success = MemcpyEngine
            .copy_blocks(
                direction,
                gpu.bytes_mut(),
                &mut self.host.bytes_mut(),
                &self.copies,
            )
            .is_ok();
        self.done.push(TransferDone {
            job: job.id,
            kind: job.kind,
            success,
        });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<TransferDone>) {
        out.append(&mut self.done);
    }

    fn wait(&mut self, _job: JobId) {}

    fn drain(&mut self) {}
}
