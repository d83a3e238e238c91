//! Per-request state of the scheduler side: a live request (it may still prepare stores and loads)
//! or a draining one (its finish was signalled; only acknowledgements of its jobs remain).
//!
//! The split is what makes "prepare_store after on_request_finished" unrepresentable: the job
//! builder only ever sees [`LiveRequest`]s, and signalling a finish consumes the live record.

use crate::key::{BlockId, ChunkKey, JobId};
use crate::scheduler::{FinishKind, NewRequest, SchedulerConfig};

/// How a live request ended, recorded by `request_finished` and acted on by the next
/// `build_connector_meta` (which builds the final stores, then signals the finish).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Finish {
    pub kind: FinishKind,
    pub num_tokens: u32,
    pub num_computed_tokens: u32,
}

/// A prefix match remembered between `get_num_new_matched_tokens` and `update_state_after_alloc`.
#[derive(Clone, Debug, Default)]
pub(crate) struct Match {
    /// Tokens already in the GPU cache when the lookup ran (block aligned).
    pub computed_tokens: u32,
    /// Tokens the offload can provide beyond them.
    pub tokens: u32,
    /// `(chunk index, key)` of every chunk that overlaps the loadable range, in order.
    pub chunks: Vec<(u32, ChunkKey)>,
}

/// A request that may still store or load.
#[derive(Debug)]
pub(crate) struct LiveRequest {
    pub prompt_tokens: u32,
    pub max_offload_tokens: Option<u32>,
    /// The engine block table, in token order.
    pub block_ids: Vec<BlockId>,
    /// Full-block prefix hashes known so far.
    pub block_hashes: Vec<u128>,
    /// All tokens (prompt and output) as of the last step or finish.
    pub num_tokens: u32,
    /// Computed tokens before the last step this request was scheduled in.
    pub num_computed_tokens: u32,
    /// Tokens scheduled in that step.
    pub num_scheduled_tokens: u32,
    /// Store cursor: full chunks already prepared (or found present). Only moves forward, but
    /// `reset_cache` rewinds it.
    pub stored_chunks: u32,
    /// Whether the partial tail chunk was prepared at finish.
    pub tail_stored: bool,
    /// Store jobs in flight (built, not yet acknowledged by every worker).
    pub store_jobs: Vec<JobId>,
    /// The load job in flight, if any (never together with store jobs).
    pub load_job: Option<JobId>,
    /// The last prefix match, for `update_state_after_alloc`.
    pub matched: Option<Match>,
    /// Set by `request_finished`.
    pub finish: Option<Finish>,
    /// Offload dropped after a broken invariant: no more jobs are built for it.
    pub disabled: bool,
}

impl LiveRequest {
    pub fn new(request: &NewRequest) -> Self {
        Self {
            prompt_tokens: request.prompt_tokens,
            max_offload_tokens: request.max_offload_tokens,
            block_ids: Vec::new(),
            block_hashes: Vec::new(),
            num_tokens: request.prompt_tokens,
            num_computed_tokens: 0,
            num_scheduled_tokens: 0,
            stored_chunks: 0,
            tail_stored: false,
            store_jobs: Vec::new(),
            load_job: None,
            matched: None,
            finish: None,
            disabled: false,
        }
    }

    /// Whether any job of the request is in flight.
    pub fn has_jobs(&self) -> bool {
        self.load_job.is_some() || !self.store_jobs.is_empty()
    }

    /// Keeps the longest hash list seen (hashes only grow; a shorter list adds nothing).
    pub fn learn_hashes(&mut self, hashes: &[u128]) {
        if hashes.len() > self.block_hashes.len() {
            let known = self.block_hashes.len();
            self.block_hashes.extend_from_slice(&hashes[known..]);
        }
    }

    /// Design.md section 4 item 8: how many tokens have KV that is written and may be stored.
    pub fn watermark_tokens(&self, config: &SchedulerConfig) -> u32 {
        let raw = match self.finish {
            Some(Finish {
                kind: FinishKind::Finished,
                num_tokens,
                ..
            }) => self.prompt_tokens.max(num_tokens.saturating_sub(1)),
            Some(Finish {
                kind: FinishKind::Aborted,
                num_computed_tokens,
                ..
            }) => num_computed_tokens,
            None => self
                .num_computed_tokens
                .saturating_add(self.num_scheduled_tokens),
        };
        let mut cap = raw.min(self.num_tokens);
        if let Some(max) = self.max_offload_tokens {
            cap = cap.min(max);
        }
        if config.offload_prompt_only {
            cap = cap.min(self.prompt_tokens);
        }
        let allocated = (self.block_ids.len() as u64) * u64::from(config.tokens_per_block);
        cap.min(u32::try_from(allocated).unwrap_or(u32::MAX))
    }

    /// Full engine blocks under the watermark that also have a hash (a key exists only once its
    /// hash exists).
    pub fn storable_blocks(&self, config: &SchedulerConfig) -> u32 {
        let by_tokens = self.watermark_tokens(config) / config.tokens_per_block;
        by_tokens.min(len_u32(self.block_hashes.len()))
    }

    /// Chunks to store now, as `(chunk index, first block, block count)`, from the cursor on: full
    /// chunks, plus the partial tail once the request finished.
    pub fn store_candidates(&self, config: &SchedulerConfig, out: &mut Vec<(u32, u32, u32)>) {
        out.clear();
        let bpc = config.blocks_per_chunk;
        let blocks = self.storable_blocks(config);
        let full_chunks = blocks / bpc;
        for chunk in self.stored_chunks..full_chunks {
            out.push((chunk, chunk * bpc, bpc));
        }
        let tail = blocks % bpc;
        if self.finish.is_some()
            && tail != 0
            && !self.tail_stored
            && self.stored_chunks <= full_chunks
        {
            out.push((full_chunks, full_chunks * bpc, tail));
        }
    }

    /// Moves the cursor past `candidates` (called when they were prepared or found present).
    pub fn advance_cursor(&mut self, config: &SchedulerConfig) {
        let blocks = self.storable_blocks(config);
        let full_chunks = blocks / config.blocks_per_chunk;
        self.stored_chunks = self.stored_chunks.max(full_chunks);
        if self.finish.is_some() && blocks % config.blocks_per_chunk != 0 {
            self.tail_stored = true;
        }
    }
}

/// A request whose finish was signalled; it lives until its last job is acknowledged.
#[derive(Debug)]
pub(crate) struct DrainingRequest {
    /// Jobs still in flight (at least one while the record exists).
    pub jobs: Vec<JobId>,
}

/// Either kind of tracked request.
#[derive(Debug)]
pub(crate) enum Tracked {
    Live(Box<LiveRequest>),
    Draining(DrainingRequest),
}

/// `usize` to `u32`, saturating (block counts never approach it).
pub(crate) fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}
