//! Store jobs: a request's store candidates prepared in the manager, and one store job for the
//! keys not yet present, with the fences on the engine blocks it reads.

use crate::key::{BlockId, ChunkKey, RequestId};
use crate::manager::{OffloadManager, PreparedStore};
use crate::meta::{Job, JobKind, Transfer};
use crate::scheduler::request::{LiveRequest, Tracked};
use crate::scheduler::{JobRecord, Scheduler};

impl<M: OffloadManager> Scheduler<M> {
    /// Prepares the request's store candidates in the manager and, for the keys not yet present,
    /// builds one store job. A failed allocation leaves the cursor where it was. Returns `false`
    /// when the stores had to wait (a load in flight, or `jobs_in_flight_max` reached): a finishing
    /// request is then signalled in a later step, after its final stores.
    pub(super) fn build_stores(&mut self, id: RequestId, stores: &mut Vec<Job>) -> bool {
        let config = self.config;
        let Some(Tracked::Live(req)) = self.requests.get_mut(&id) else {
            return true;
        };
        if req.disabled {
            return true;
        }
        if req.load_job.is_some() || self.jobs.len() >= config.jobs_in_flight_max as usize {
            return false;
        }
        let mut candidates = std::mem::take(&mut self.scratch_candidates);
        req.store_candidates(&config, &mut candidates);
        if candidates.is_empty() {
            req.advance_cursor(&config);
            self.scratch_candidates = candidates;
            return true;
        }
        self.scratch_keys.clear();
        for &(_, first, count) in &candidates {
            let last = (first + count - 1) as usize;
            self.scratch_keys
                .push(ChunkKey::new(req.block_hashes[last], config.kv_group));
        }
        let mut prepared = std::mem::take(&mut self.scratch_prepared);
        let result = self
            .manager
            .prepare_store(&self.scratch_keys, id, &mut prepared);
        let built = match result {
            Ok(()) => {
                req.advance_cursor(&config);
                store_job_parts(req, &candidates, &self.scratch_keys, &prepared)
            }
            Err(_) => {
                self.stats.allocation_failures += 1;
                None
            }
        };
        self.scratch_prepared = prepared;
        self.scratch_candidates = candidates;
        let Some((transfers, blocks)) = built else {
            return true;
        };
        let job_id = self.allocate_job_id();
        if let Some(Tracked::Live(req)) = self.requests.get_mut(&id) {
            req.store_jobs.push(job_id);
        }
        for &block in &blocks {
            self.fences.insert((block, job_id));
        }
        self.stats.store_jobs += 1;
        self.stats.chunks_store_submitted += transfers.len() as u64;
        let keys = transfers.iter().map(|t| t.key).collect();
        let slots = transfers.iter().map(|t| t.slot).collect();
        self.jobs.insert(
            job_id,
            JobRecord {
                request: id,
                kind: JobKind::Store,
                keys,
                slots,
                blocks,
                acked: 0,
                failed: false,
            },
        );
        stores.push(Job {
            id: job_id,
            request: id,
            kind: JobKind::Store,
            transfers,
        });
        true
    }
}

/// The transfers of a store job for the keys `prepared` says to write, and the engine blocks they
/// read; `None` when every key was already present.
fn store_job_parts(
    req: &LiveRequest,
    candidates: &[(u32, u32, u32)],
    keys: &[ChunkKey],
    prepared: &PreparedStore,
) -> Option<(Vec<Transfer>, Vec<BlockId>)> {
    if prepared.keys.is_empty() {
        return None;
    }
    let mut transfers = Vec::with_capacity(prepared.keys.len());
    let mut blocks = Vec::new();
    let mut next = 0usize;
    for (&key, &slot) in prepared.keys.iter().zip(&prepared.slots) {
        // Prepared keys are a subsequence of the candidate keys.
        while next < keys.len() && keys[next] != key {
            next += 1;
        }
        let &(_, first, count) = candidates.get(next)?;
        next += 1;
        let gpu_blocks = req.block_ids[first as usize..(first + count) as usize].to_vec();
        blocks.extend_from_slice(&gpu_blocks);
        transfers.push(Transfer {
            key,
            slot,
            first_block_in_chunk: 0,
            gpu_blocks,
        });
    }
    Some((transfers, blocks))
}
