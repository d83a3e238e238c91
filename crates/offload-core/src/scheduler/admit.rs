//! A request's admission: it arrives ([`Scheduler::on_new_request`]), its prefix is looked up
//! ([`Scheduler::get_num_new_matched_tokens`]), and once the engine allocated its blocks its load
//! job is built ([`Scheduler::update_state_after_alloc`]).

use crate::key::{BlockId, ChunkKey, LookupResult, RequestId, SlotId};
use crate::manager::OffloadManager;
use crate::meta::{Job, JobKind, Transfer};
use crate::scheduler::request::{len_u32, LiveRequest, Match, Tracked};
use crate::scheduler::{JobRecord, MatchResult, NewRequest, Scheduler};

impl<M: OffloadManager> Scheduler<M> {
    /// Starts tracking a request. A request beyond `requests_max` is not offloaded.
    pub fn on_new_request(&mut self, request: NewRequest) {
        if self.requests.contains_key(&request.id) {
            self.broken(format_args!("request {:?} arrived twice", request.id));
            return;
        }
        if self.requests.len() >= self.config.requests_max as usize {
            self.stats.requests_untracked += 1;
            return;
        }
        let live = LiveRequest::new(&request);
        self.requests
            .insert(request.id, Tracked::Live(Box::new(live)));
    }

    /// Maximal-prefix lookup for a waiting request whose first `num_computed_tokens` tokens are
    /// already in the GPU cache; `block_hashes` are its full-block hashes, `num_tokens` its length.
    ///
    /// Answers `RetryLater` while any job of the request is in flight or a chunk of its prefix is
    /// pending or unknown; otherwise the tokens (whole blocks, never reaching the last token) that
    /// can be loaded beyond `num_computed_tokens`.
    pub fn get_num_new_matched_tokens(
        &mut self,
        id: RequestId,
        num_tokens: u32,
        block_hashes: &[u128],
        num_computed_tokens: u32,
    ) -> MatchResult {
        let config = self.config;
        let Some(Tracked::Live(req)) = self.requests.get_mut(&id) else {
            if self.requests.contains_key(&id) {
                self.broken(format_args!("lookup for finished request {id:?}"));
            }
            return MatchResult::Tokens(0);
        };
        req.matched = None;
        if req.disabled || req.finish.is_some() {
            return MatchResult::Tokens(0);
        }
        if req.has_jobs() {
            return MatchResult::RetryLater;
        }
        req.num_tokens = num_tokens;
        req.learn_hashes(block_hashes);
        let tpb = config.tokens_per_block;
        let bpc = config.blocks_per_chunk;
        let blocks = (num_tokens / tpb).min(len_u32(block_hashes.len()));
        let first_block = num_computed_tokens / tpb;
        let mut chunk = first_block / bpc;
        let mut hit_end_block = first_block;
        let mut deferred = false;
        let mut chunks = Vec::new();
        while chunk * bpc < blocks {
            let last_block = ((chunk + 1) * bpc).min(blocks) - 1;
            let key = ChunkKey::new(block_hashes[last_block as usize], config.kv_group);
            match self.manager.lookup(key, id) {
                LookupResult::Miss => break,
                LookupResult::Hit => {
                    if !deferred {
                        hit_end_block = last_block + 1;
                        chunks.push((chunk, key));
                    }
                }
                LookupResult::Pending | LookupResult::Retry => deferred = true,
            }
            chunk += 1;
        }
        if deferred {
            return MatchResult::RetryLater;
        }
        // The engine computes at least the last token itself.
        let load_end_block = hit_end_block.min(num_tokens.saturating_sub(1) / tpb);
        let tokens = (load_end_block * tpb).saturating_sub(num_computed_tokens);
        if tokens == 0 {
            return MatchResult::Tokens(0);
        }
        chunks.retain(|&(c, _)| c * bpc < load_end_block);
        req.matched = Some(Match {
            computed_tokens: num_computed_tokens,
            tokens,
            chunks,
        });
        MatchResult::Tokens(tokens)
    }

    /// The engine allocated `block_ids` (the request's whole block table) and will take
    /// `num_external_tokens` tokens (as matched before) from the offload: builds the load job,
    /// which goes out with the next [`Scheduler::build_connector_meta`].
    pub fn update_state_after_alloc(
        &mut self,
        id: RequestId,
        block_ids: &[BlockId],
        num_external_tokens: u32,
    ) {
        let config = self.config;
        let Some(Tracked::Live(req)) = self.requests.get_mut(&id) else {
            if num_external_tokens > 0 {
                self.broken_for(
                    id,
                    format_args!("load for untracked or finished request {id:?}"),
                );
            }
            return;
        };
        let matched = req.matched.take();
        if num_external_tokens == 0 {
            return;
        }
        let Some(matched) = matched.filter(|m| m.tokens >= num_external_tokens) else {
            self.broken_for(
                id,
                format_args!(
                    "request {id:?} takes {num_external_tokens} external tokens that were not \
                     matched"
                ),
            );
            return;
        };
        if req.has_jobs() || num_external_tokens % config.tokens_per_block != 0 {
            self.broken_for(
                id,
                format_args!("load for request {id:?}: jobs in flight or unaligned token count"),
            );
            return;
        }
        let tpb = config.tokens_per_block;
        let bpc = config.blocks_per_chunk;
        let first_block = matched.computed_tokens / tpb;
        let end_block = first_block + num_external_tokens / tpb;
        if block_ids.len() < end_block as usize {
            self.broken_for(
                id,
                format_args!(
                    "request {id:?} allocated {} blocks, load needs {end_block}",
                    block_ids.len()
                ),
            );
            return;
        }
        self.scratch_keys.clear();
        let mut transfers = Vec::new();
        for &(chunk, key) in &matched.chunks {
            let chunk_start = chunk * bpc;
            let lo = chunk_start.max(first_block);
            let hi = (chunk_start + bpc).min(end_block);
            if lo >= hi {
                continue;
            }
            self.scratch_keys.push(key);
            transfers.push(Transfer {
                key,
                slot: SlotId(0),
                first_block_in_chunk: lo - chunk_start,
                gpu_blocks: block_ids[lo as usize..hi as usize].to_vec(),
            });
        }
        self.scratch_slots.clear();
        if self
            .manager
            .prepare_load(&self.scratch_keys, id, &mut self.scratch_slots)
            .is_err()
        {
            self.failed_loads.push(id);
            self.stats.load_failures += 1;
            return;
        }
        self.manager.touch(&self.scratch_keys, id);
        for (transfer, &slot) in transfers.iter_mut().zip(&self.scratch_slots) {
            transfer.slot = slot;
        }
        let job_id = self.allocate_job_id();
        if let Some(Tracked::Live(req)) = self.requests.get_mut(&id) {
            req.load_job = Some(job_id);
        }
        self.stats.load_jobs += 1;
        self.stats.chunks_load_submitted += transfers.len() as u64;
        self.jobs.insert(
            job_id,
            JobRecord {
                request: id,
                kind: JobKind::Load,
                keys: self.scratch_keys.clone(),
                slots: self.scratch_slots.clone(),
                blocks: Vec::new(),
                acked: 0,
                failed: false,
            },
        );
        self.loads_out.push(Job {
            id: job_id,
            request: id,
            kind: JobKind::Load,
            transfers,
        });
    }
}
