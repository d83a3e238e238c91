//! A simulated tensor-parallel worker: it owns one byte shard of every GPU block and every host
//! slot, runs the jobs of each step's [`ConnectorMeta`] in the documented order, and acknowledges
//! each job exactly once. Completions can be delayed and jobs can fail, both decided by a seeded
//! PRNG, so that the scheduler side meets late and failed acknowledgements.
//!
//! Copies happen when a job *completes*, the latest moment a real transfer could touch memory:
//! a store therefore reads its source blocks as late as possible, which exposes a missing fence.
//! A reset (`reset_before`) drains the jobs older than it, as a real worker does: they are on a
//! GPU stream already, so they complete and make their copies (their acknowledgements are then
//! ignored by the scheduler). A slot or block they write must not have been handed on before.

use std::collections::VecDeque;

use offload_core::{ConnectorMeta, Job, JobAck, JobId, JobKind, WorkerOutput};
use serde::{Deserialize, Serialize};

use crate::gpu::GpuMemory;
use crate::host::{
    transfer_copies, BlockCopy, CopyDirection, CopyEngine, CopyGeometry, HostMemory, Shard,
};
use crate::rng::SplitMix64;

/// Byte written over a failed transfer's destination (a torn copy).
pub const SCRIBBLE: u8 = 0xDE;

/// Delays and failures of one worker.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerFaults {
    /// Job ids this worker fails.
    pub fail_jobs: Vec<u64>,
    /// Probability, in parts per million, that this worker fails a job.
    pub fail_ppm: u32,
    /// A store completes up to this many steps after the step that issued it.
    pub store_delay_max: u32,
    /// A load completes up to this many steps after the step that issued it.
    pub load_delay_max: u32,
    /// A failed transfer leaves garbage in its destination shard (a torn copy).
    pub scribble_on_failure: bool,
}

/// Memory and geometry a worker runs its copies against.
pub struct WorkerEnv<'a> {
    /// The GPU KV cache.
    pub gpu: &'a mut GpuMemory,
    /// The host pool's bytes.
    pub host: &'a mut HostMemory,
    /// How bytes are moved.
    pub copier: &'a mut dyn CopyEngine,
    /// Block and slot geometry.
    pub geo: CopyGeometry,
}

/// One job this worker completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The worker's rank.
    pub worker: u32,
    /// The job.
    pub job: Job,
    /// Whether this worker's part succeeded.
    pub success: bool,
    /// It was older than a reset and drained by its `reset_before` (its copies were made; its
    /// acknowledgement is ignored by the scheduler).
    pub before_reset: bool,
}

#[derive(Clone, Debug)]
struct Pending {
    job: Job,
    due: u64,
    fail: bool,
}

/// One simulated worker (tensor-parallel rank).
pub struct Worker {
    rank: u32,
    shard: Shard,
    rng: SplitMix64,
    faults: WorkerFaults,
    loads: VecDeque<Pending>,
    stores: VecDeque<Pending>,
    acks: Vec<JobAck>,
    copies: Vec<BlockCopy>,
}

impl Worker {
    /// Worker `rank` of `count`, for blocks of `block_bytes`, with its own PRNG stream of `seed`.
    pub fn new(rank: u32, count: u32, block_bytes: u32, seed: u64, faults: WorkerFaults) -> Self {
        Self {
            rank,
            shard: Shard::of(rank, count, block_bytes),
            rng: SplitMix64::stream(seed, 0x1000 + u64::from(rank)),
            faults,
            loads: VecDeque::new(),
            stores: VecDeque::new(),
            acks: Vec::new(),
            copies: Vec::new(),
        }
    }

    /// The worker's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Its byte shard of each block.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Its fault settings, to change between steps (fail a given job, add delay).
    pub fn faults_mut(&mut self) -> &mut WorkerFaults {
        &mut self.faults
    }

    /// Jobs accepted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.loads.len() + self.stores.len()
    }

    /// The part of a step before the engine's compute: `reset_before`, `flush`, then `loads`
    /// (started; those due now complete now). Completions are appended to `done`.
    pub fn begin_step(
        &mut self,
        step: u64,
        meta: &ConnectorMeta,
        env: &mut WorkerEnv<'_>,
        done: &mut Vec<Completion>,
    ) {
        if let Some(before) = meta.reset_before {
            self.drain_before(before, env, done);
        }
        for &id in &meta.flush {
            self.flush(id, env, done);
        }
        for job in &meta.loads {
            let pending = self.accept(job, step, self.faults.load_delay_max, JobKind::Load);
            self.loads.push_back(pending);
        }
        while self.loads.front().is_some_and(|p| p.due <= step) {
            let Some(p) = self.loads.pop_front() else {
                break;
            };
            self.complete(p, env, done);
        }
    }

    /// The part of a step after the engine's compute: `stores` start (they read this step's KV)
    /// and every store due by now completes, in submission order.
    pub fn end_step(
        &mut self,
        step: u64,
        meta: &ConnectorMeta,
        env: &mut WorkerEnv<'_>,
        done: &mut Vec<Completion>,
    ) {
        for job in &meta.stores {
            let pending = self.accept(job, step, self.faults.store_delay_max, JobKind::Store);
            self.stores.push_back(pending);
        }
        while self.stores.front().is_some_and(|p| p.due <= step) {
            let Some(p) = self.stores.pop_front() else {
                break;
            };
            self.complete(p, env, done);
        }
    }

    /// Completes every job still queued, in order (loads first), as a shutdown would.
    pub fn drain(&mut self, env: &mut WorkerEnv<'_>, done: &mut Vec<Completion>) {
        while let Some(p) = self.loads.pop_front() {
            self.complete(p, env, done);
        }
        while let Some(p) = self.stores.pop_front() {
            self.complete(p, env, done);
        }
    }

    /// This worker's acknowledgements since the last call.
    pub fn take_output(&mut self) -> WorkerOutput {
        WorkerOutput {
            worker: self.rank,
            acks: std::mem::take(&mut self.acks),
        }
    }

    fn accept(&mut self, job: &Job, step: u64, delay_max: u32, kind: JobKind) -> Pending {
        let queue = match kind {
            JobKind::Load => &self.loads,
            JobKind::Store => &self.stores,
        };
        let after = queue.back().map_or(0, |p| p.due);
        let due = (step + self.rng.below(u64::from(delay_max) + 1)).max(after);
        let fail =
            self.rng.chance_ppm(self.faults.fail_ppm) || self.faults.fail_jobs.contains(&job.id.0);
        Pending {
            job: job.clone(),
            due,
            fail,
        }
    }

    /// Completes every job older than `before`, copies included, in submission order per
    /// direction (loads first), as a real worker drains its streams at a reset.
    fn drain_before(&mut self, before: JobId, env: &mut WorkerEnv<'_>, done: &mut Vec<Completion>) {
        let old_loads: Vec<Pending> = take_older(&mut self.loads, before);
        let old_stores: Vec<Pending> = take_older(&mut self.stores, before);
        for p in old_loads.into_iter().chain(old_stores) {
            let at = done.len();
            self.complete(p, env, done);
            for c in &mut done[at..] {
                c.before_reset = true;
            }
        }
    }

    fn flush(&mut self, id: JobId, env: &mut WorkerEnv<'_>, done: &mut Vec<Completion>) {
        let Some(pos) = self.stores.iter().position(|p| p.job.id == id) else {
            return;
        };
        for _ in 0..=pos {
            let Some(p) = self.stores.pop_front() else {
                break;
            };
            self.complete(p, env, done);
        }
    }

    fn complete(&mut self, p: Pending, env: &mut WorkerEnv<'_>, done: &mut Vec<Completion>) {
        self.copies.clear();
        let mut valid = true;
        for t in &p.job.transfers {
            valid &= transfer_copies(t, self.shard, env.geo, &mut self.copies).is_ok();
        }
        let direction = match p.job.kind {
            JobKind::Store => CopyDirection::GpuToHost,
            JobKind::Load => CopyDirection::HostToGpu,
        };
        let mut success = valid && !p.fail;
        if success {
            // A copy the engine could not make is a failed job, never a claimed success.
            success = env
                .copier
                .copy_blocks(
                    direction,
                    env.gpu.bytes_mut(),
                    &mut env.host.bytes_mut(),
                    &self.copies,
                )
                .is_ok();
        } else if valid && self.faults.scribble_on_failure {
            scribble(direction, env, &self.copies);
        }
        self.acks.push(JobAck {
            job: p.job.id,
            success,
        });
        done.push(Completion {
            worker: self.rank,
            job: p.job,
            success,
            before_reset: false,
        });
    }
}

/// Removes the jobs older than `before` from `queue`, keeping their order.
fn take_older(queue: &mut VecDeque<Pending>, before: JobId) -> Vec<Pending> {
    let (old, keep): (VecDeque<Pending>, VecDeque<Pending>) =
        queue.drain(..).partition(|p| p.job.id < before);
    *queue = keep;
    old.into()
}

fn scribble(direction: CopyDirection, env: &mut WorkerEnv<'_>, copies: &[BlockCopy]) {
    for c in copies {
        match direction {
            CopyDirection::GpuToHost => {
                env.host.bytes_mut()[c.host_offset..c.host_offset + c.len].fill(SCRIBBLE)
            }
            CopyDirection::HostToGpu => {
                env.gpu.bytes_mut()[c.gpu_offset..c.gpu_offset + c.len].fill(SCRIBBLE)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemcpyEngine;
    use offload_core::{BlockId, ChunkKey, RequestId, SlotId, Transfer};

    const GEO: CopyGeometry = CopyGeometry {
        block_bytes: 8,
        blocks_per_chunk: 2,
        gpu_blocks: 4,
        slots: 2,
    };

    fn job(id: u64, kind: JobKind, slot: u32, blocks: &[u32]) -> Job {
        Job {
            id: JobId(id),
            request: RequestId(1),
            kind,
            transfers: vec![Transfer {
                key: ChunkKey::new(u128::from(id), 0),
                slot: SlotId(slot),
                first_block_in_chunk: 0,
                gpu_blocks: blocks.iter().map(|&b| BlockId(b)).collect(),
            }],
        }
    }

    struct Fixture {
        gpu: GpuMemory,
        host: HostMemory,
        copier: MemcpyEngine,
    }

    impl Fixture {
        fn new() -> Self {
            let mut gpu = GpuMemory::new(4, 8);
            for (i, b) in gpu.bytes_mut().iter_mut().enumerate() {
                *b = i as u8 + 1;
            }
            Self {
                gpu,
                host: HostMemory::new(2, 16),
                copier: MemcpyEngine,
            }
        }
        fn env(&mut self) -> WorkerEnv<'_> {
            WorkerEnv {
                gpu: &mut self.gpu,
                host: &mut self.host,
                copier: &mut self.copier,
                geo: GEO,
            }
        }
    }

    fn meta_with(stores: Vec<Job>, loads: Vec<Job>) -> ConnectorMeta {
        ConnectorMeta {
            stores,
            loads,
            ..ConnectorMeta::default()
        }
    }

    #[test]
    fn two_shards_store_and_load_whole_blocks() {
        let mut fx = Fixture::new();
        let mut workers: Vec<Worker> = (0..2)
            .map(|r| Worker::new(r, 2, 8, 1, WorkerFaults::default()))
            .collect();
        let meta = meta_with(vec![job(1, JobKind::Store, 1, &[2, 0])], vec![]);
        let mut done = Vec::new();
        for w in &mut workers {
            w.begin_step(0, &meta, &mut fx.env(), &mut done);
            w.end_step(0, &meta, &mut fx.env(), &mut done);
        }
        assert_eq!(done.len(), 2);
        assert!(done.iter().all(|c| c.success));
        let slot = fx.host.slot(SlotId(1));
        assert_eq!(slot[..8], *fx.gpu.block(BlockId(2)));
        assert_eq!(slot[8..], *fx.gpu.block(BlockId(0)));
        // Load the slot back into blocks 3 and 1; only worker 0 acts in this step.
        let meta = meta_with(vec![], vec![job(2, JobKind::Load, 1, &[3, 1])]);
        workers[0].begin_step(1, &meta, &mut fx.env(), &mut done);
        assert_eq!(fx.gpu.block(BlockId(3))[..4], slot[..4]);
        assert_ne!(fx.gpu.block(BlockId(3))[4..], slot[4..8]);
        workers[1].begin_step(1, &meta, &mut fx.env(), &mut done);
        assert_eq!(*fx.gpu.block(BlockId(3)), slot[..8]);
        assert_eq!(*fx.gpu.block(BlockId(1)), slot[8..]);
        let outs: Vec<WorkerOutput> = workers.iter_mut().map(Worker::take_output).collect();
        assert_eq!(
            outs[0].acks,
            vec![
                JobAck {
                    job: JobId(1),
                    success: true
                },
                JobAck {
                    job: JobId(2),
                    success: true
                }
            ]
        );
        assert_eq!(outs[1].worker, 1);
        assert!(
            workers[0].take_output().acks.is_empty(),
            "acks are reported once"
        );
    }

    #[test]
    fn delayed_stores_complete_in_order_and_flush_forces_them() {
        let mut fx = Fixture::new();
        let faults = WorkerFaults {
            store_delay_max: 50,
            ..WorkerFaults::default()
        };
        let mut w = Worker::new(0, 1, 8, 9, faults);
        let mut done = Vec::new();
        for (step, id) in [(0u64, 1u64), (1, 2), (2, 3)] {
            let meta = meta_with(vec![job(id, JobKind::Store, 0, &[0])], vec![]);
            w.begin_step(step, &meta, &mut fx.env(), &mut done);
            w.end_step(step, &meta, &mut fx.env(), &mut done);
        }
        let before = done.len();
        let flush = ConnectorMeta {
            flush: vec![JobId(2)],
            ..ConnectorMeta::default()
        };
        w.begin_step(3, &flush, &mut fx.env(), &mut done);
        let ids: Vec<u64> = done.iter().map(|c| c.job.id.0).collect();
        assert!(
            ids.contains(&1) && ids.contains(&2),
            "flushed through job 2: {ids:?}"
        );
        assert!(
            ids.windows(2).all(|p| p[0] < p[1]),
            "in submission order: {ids:?}"
        );
        assert!(before < 3 || w.in_flight() == 0);
        for step in 4..200 {
            w.end_step(step, &ConnectorMeta::default(), &mut fx.env(), &mut done);
        }
        assert_eq!(done.len(), 3);
        assert_eq!(w.in_flight(), 0);
    }

    #[test]
    fn failures_ack_false_and_scribble() {
        let mut fx = Fixture::new();
        let faults = WorkerFaults {
            fail_jobs: vec![5],
            scribble_on_failure: true,
            ..WorkerFaults::default()
        };
        let mut w = Worker::new(0, 1, 8, 2, faults);
        let mut done = Vec::new();
        let meta = meta_with(vec![], vec![job(5, JobKind::Load, 0, &[1])]);
        w.begin_step(0, &meta, &mut fx.env(), &mut done);
        assert!(!done[0].success);
        assert_eq!(fx.gpu.block(BlockId(1)), &[SCRIBBLE; 8]);
        assert_eq!(
            w.take_output().acks,
            vec![JobAck {
                job: JobId(5),
                success: false
            }]
        );
    }

    #[test]
    fn reset_drains_older_jobs_with_their_copies() {
        let mut fx = Fixture::new();
        let faults = WorkerFaults {
            store_delay_max: 1000,
            ..WorkerFaults::default()
        };
        let mut w = Worker::new(0, 1, 8, 3, faults);
        let mut done = Vec::new();
        let mut step = 0;
        // Find a step where the store stays queued (delay > 0); bounded.
        while w.in_flight() == 0 && step < 50 {
            let meta = meta_with(vec![job(10 + step, JobKind::Store, 0, &[0])], vec![]);
            w.begin_step(step, &meta, &mut fx.env(), &mut done);
            w.end_step(step, &meta, &mut fx.env(), &mut done);
            step += 1;
        }
        assert!(w.in_flight() > 0);
        fx.host.bytes_mut()[..8].fill(0);
        let done_before = done.len();
        let reset = ConnectorMeta {
            reset_before: Some(JobId(1_000)),
            ..ConnectorMeta::default()
        };
        w.begin_step(step, &reset, &mut fx.env(), &mut done);
        assert_eq!(w.in_flight(), 0);
        assert!(done[done_before..]
            .iter()
            .all(|c| c.before_reset && c.success));
        assert_eq!(
            fx.host.slot(SlotId(0))[..8],
            *fx.gpu.block(BlockId(0)),
            "the drained store made its copy, as a GPU stream would"
        );
    }
}
