//! Checks: the structure of every [`ConnectorMeta`] against the engine's state (job ids grow, each
//! transfer maps its key's chunk onto the request's own blocks, loads fill exactly the blocks the
//! request waits for and nothing shared, stores read only written KV of blocks the request holds,
//! no job after a finish signal), and the bytes: stores against the model when they complete,
//! loaded blocks when a load succeeds, and a request's whole KV when it finishes or is preempted.

use offload_core::{ConnectorMeta, Job, JobKind, Transfer};

use super::request::{Phase, Req};
use super::{EngineConnector, Plan, Sim, TrackedJob};
use crate::worker::Completion;

/// Where a transfer's blocks lie in its request: the chunk's first block index and the index of
/// the block whose hash is the key.
struct Placement {
    chunk_start: u32,
    key_block: u32,
}

/// Where the key's chunk lies in the request (from the key alone; the block table may be gone).
fn locate(r: &Req, t: &Transfer, blocks_per_chunk: u32) -> Result<Placement, String> {
    if t.key.group != 0 {
        return Err(format!(
            "key {:#x} has KV group {}, expected 0",
            t.key.hash, t.key.group
        ));
    }
    let Some(j) = r.hashes.iter().position(|&h| h == t.key.hash) else {
        return Err(format!(
            "key {:#x} is not a known block hash of request {}",
            t.key.hash, r.id.0
        ));
    };
    let key_block = j as u32;
    let chunk_start = key_block / blocks_per_chunk * blocks_per_chunk;
    let last = chunk_start + t.first_block_in_chunk + t.gpu_blocks.len() as u32;
    if t.gpu_blocks.is_empty() || last > key_block + 1 {
        return Err(format!(
            "transfer of key {:#x} (block {key_block}) covers chunk blocks {}..{}",
            t.key.hash,
            t.first_block_in_chunk,
            t.first_block_in_chunk + t.gpu_blocks.len() as u32
        ));
    }
    Ok(Placement {
        chunk_start,
        key_block,
    })
}

/// [`locate`], and every GPU block of the transfer is the request's block at that position.
fn place(r: &Req, t: &Transfer, blocks_per_chunk: u32) -> Result<Placement, String> {
    let p = locate(r, t, blocks_per_chunk)?;
    for (i, g) in t.gpu_blocks.iter().enumerate() {
        let b = (p.chunk_start + t.first_block_in_chunk) as usize + i;
        if r.blocks.get(b) != Some(g) {
            return Err(format!(
                "transfer of key {:#x} names GPU block {} for request block {b}, which is {:?}",
                t.key.hash,
                g.0,
                r.blocks.get(b).map(|x| x.0)
            ));
        }
    }
    Ok(p)
}

impl<C: EngineConnector> Sim<C> {
    pub(super) fn check_meta(&mut self, step: u64, meta: &ConnectorMeta, plan: &Plan) {
        if meta.step != step {
            self.violation(format!("meta for step {} built in step {step}", meta.step));
        }
        self.check_job_ids(meta);
        for job in &meta.loads {
            self.check_job(job, JobKind::Load, plan);
        }
        for job in &meta.stores {
            self.check_job(job, JobKind::Store, plan);
        }
        for &id in &meta.flush {
            self.report.flushes += 1;
            let known = self.max_job.is_some_and(|m| id <= m);
            if self.jobs.get(&id).is_some_and(|j| j.kind == JobKind::Load) || !known {
                self.violation(format!(
                    "flush names job {}, which is not an issued store",
                    id.0
                ));
            }
        }
        for &id in &meta.finished {
            self.check_finish_signal(id);
        }
    }

    fn check_job_ids(&mut self, meta: &ConnectorMeta) {
        let mut ids: Vec<_> = meta
            .loads
            .iter()
            .chain(&meta.stores)
            .map(|j| j.id)
            .collect();
        ids.sort_unstable();
        let Some((&first, &last)) = ids.first().zip(ids.last()) else {
            return;
        };
        if ids.windows(2).any(|w| w[0] == w[1]) {
            self.violation(format!("a job id appears twice in one meta: {ids:?}"));
        }
        if let Some(max) = self.max_job.filter(|&m| first <= m) {
            self.violation(format!(
                "job id {} is not above the last issued id {}",
                first.0, max.0
            ));
        }
        self.max_job = Some(self.max_job.map_or(last, |m| m.max(last)));
    }

    fn check_finish_signal(&mut self, id: offload_core::RequestId) {
        let Some(idx) = self.index_of(id) else {
            self.violation(format!("meta.finished names unknown request {}", id.0));
            return;
        };
        let r = &mut self.reqs[idx];
        let (called, twice) = (r.finish_called, r.signalled);
        r.signalled = true;
        if !called {
            self.violation(format!(
                "meta.finished names request {} before request_finished",
                id.0
            ));
        }
        if twice {
            self.violation(format!("meta.finished names request {} twice", id.0));
        }
    }

    fn check_job(&mut self, job: &Job, kind: JobKind, plan: &Plan) {
        if job.kind != kind {
            self.violation(format!(
                "job {} is a {:?} in the {kind:?} list",
                job.id.0, job.kind
            ));
        }
        self.jobs.insert(job.id, TrackedJob { kind, acks: 0 });
        match kind {
            JobKind::Load => self.report.load_jobs += 1,
            JobKind::Store => {
                self.report.store_jobs += 1;
                self.report.chunks_stored += job.transfers.len() as u64;
            }
        }
        let problem = match self.index_of(job.request) {
            None => Some(format!("names unknown request {}", job.request.0)),
            Some(idx) => match kind {
                JobKind::Load => self.load_problem(idx, job),
                JobKind::Store => self.store_problem(idx, job, plan),
            },
        };
        if let Some(p) = problem {
            self.violation(format!(
                "{kind:?} job {} for request {}: {p}",
                job.id.0, job.request.0
            ));
        }
    }

    fn load_problem(&self, idx: usize, job: &Job) -> Option<String> {
        let r = &self.reqs[idx];
        if r.signalled {
            return Some("issued after the request's finish was signalled".into());
        }
        let (Phase::WaitingForRemote, Some((local, ext))) = (r.phase, r.load) else {
            return Some(format!(
                "the request is {:?} and waits for no load",
                r.phase
            ));
        };
        let tpb = self.cfg.tokens_per_block;
        let (first, end) = (local / tpb, (local + ext) / tpb);
        let mut covered = vec![false; (end - first) as usize];
        for t in &job.transfers {
            let p = match place(r, t, self.cfg.blocks_per_chunk) {
                Ok(p) => p,
                Err(e) => return Some(e),
            };
            for (i, g) in t.gpu_blocks.iter().enumerate() {
                let b = p.chunk_start + t.first_block_in_chunk + i as u32;
                if !(first..end).contains(&b)
                    || std::mem::replace(&mut covered[(b - first) as usize], true)
                {
                    return Some(format!(
                        "block {b} is outside blocks {first}..{end} or loaded twice"
                    ));
                }
                if self.pool.ref_count(*g) != 1 || self.pool.cached_hash(*g).is_some() {
                    return Some(format!(
                        "GPU block {} is shared or cached; a load would overwrite it",
                        g.0
                    ));
                }
            }
        }
        if let Some(b) = covered.iter().position(|c| !c) {
            return Some(format!(
                "block {} of the loaded range {first}..{end} is not loaded",
                first + b as u32
            ));
        }
        None
    }

    fn store_problem(&self, idx: usize, job: &Job, plan: &Plan) -> Option<String> {
        let r = &self.reqs[idx];
        if r.signalled {
            return Some("issued after the request's finish was signalled".into());
        }
        if plan.preempted.contains(&r.id) || r.blocks.is_empty() {
            return Some(format!(
                "the request holds no blocks ({:?}, preempted this step or freed)",
                r.phase
            ));
        }
        let tpb = self.cfg.tokens_per_block;
        for t in &job.transfers {
            let p = match place(r, t, self.cfg.blocks_per_chunk) {
                Ok(p) => p,
                Err(e) => return Some(e),
            };
            let last = p.chunk_start + t.first_block_in_chunk + t.gpu_blocks.len() as u32 - 1;
            if last != p.key_block {
                return Some(format!(
                    "chunk {:#x} ends at block {last}, not at its key's block {}",
                    t.key.hash, p.key_block
                ));
            }
            if (last + 1) * tpb > r.num_computed {
                return Some(format!(
                    "reads block {last}, whose KV is not written ({} tokens computed by this step)",
                    r.num_computed
                ));
            }
        }
        None
    }

    /// A worker completed a store: its shard of each slot must hold the model's bytes.
    pub(super) fn verify_store(&mut self, c: &Completion) {
        let Some(idx) = self.index_of(c.job.request) else {
            return;
        };
        let shard = self.workers[c.worker as usize].shard();
        let bb = self.cfg.block_bytes as usize;
        let mut scratch = Vec::new();
        let mut bad = None;
        for t in &c.job.transfers {
            let r = &self.reqs[idx];
            let Ok(p) = locate(r, t, self.cfg.blocks_per_chunk) else {
                continue;
            };
            let slot = self.host.slot(t.slot);
            for i in 0..t.gpu_blocks.len() {
                let in_chunk = t.first_block_in_chunk as usize + i;
                let b = p.chunk_start + in_chunk as u32;
                let range = shard.offset..shard.offset + shard.len;
                let got = &slot[in_chunk * bb..(in_chunk + 1) * bb];
                if !self
                    .model
                    .block_kv_matches(&r.chain, b, got, range, &mut scratch)
                {
                    bad = Some((b, t.gpu_blocks[i].0));
                }
            }
        }
        if let Some((b, g)) = bad {
            self.report.store_mismatches += 1;
            let msg = format!(
                "step {}: store job {} (worker {}) of request {} copied wrong bytes for block {b} (GPU block {g})",
                self.step, c.job.id.0, c.worker, c.job.request.0
            );
            self.report.note(msg);
        }
    }

    /// A load succeeded: every loaded block must hold the model's bytes for that block.
    pub(super) fn verify_loaded(&mut self, idx: usize, local: u32, ext: u32) {
        let tpb = self.cfg.tokens_per_block;
        let bb = self.cfg.block_bytes as usize;
        let mut scratch = Vec::new();
        let r = &self.reqs[idx];
        let mut bad = Vec::new();
        for b in local / tpb..(local + ext) / tpb {
            let g = r.blocks[b as usize];
            let got = self.gpu.block(g);
            if !self
                .model
                .block_kv_matches(&r.chain, b, got, 0..bb, &mut scratch)
            {
                bad.push((b, g.0));
            }
        }
        if bad.is_empty() {
            return;
        }
        self.report.integrity_failures += bad.len() as u64;
        let msg = format!(
            "step {}: request {} loaded {} blocks with wrong bytes (block, GPU block): {:?}",
            self.step,
            r.id.0,
            bad.len(),
            &bad[..bad.len().min(8)]
        );
        self.report.note(msg);
    }

    /// Every computed token of the request must hold the model's bytes in GPU memory.
    pub(super) fn verify_request_kv(&mut self, idx: usize, when: &str) {
        let tpb = self.cfg.tokens_per_block;
        let width = self.model.token_bytes();
        let r = &self.reqs[idx];
        let bad = (0..r.num_computed).find(|&t| {
            let Some(&g) = r.blocks.get((t / tpb) as usize) else {
                return true;
            };
            let at = self.model.offset_in_block(t);
            !self
                .model
                .token_kv_matches(r.chain.token_hash(t), &self.gpu.block(g)[at..at + width])
        });
        if let Some(t) = bad {
            self.report.gpu_corruptions += 1;
            let msg = format!(
                "step {}: at {when}, request {} token {t} (of {} computed) has wrong KV in GPU memory",
                self.step,
                r.id.0,
                r.num_computed
            );
            self.report.note(msg);
        }
    }
}
