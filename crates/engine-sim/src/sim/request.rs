//! The engine's per-request state: tokens (the executor's, which may run one sampled token ahead
//! of the scheduler's view under async scheduling), block table, and scheduling phase.

use offload_core::{BlockId, FinishKind, RequestId};
use serde::Serialize;

use crate::model::TokenChain;
use crate::report::TokenSplit;
use crate::workload::RequestSpec;

/// Where a range of a request's KV came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvSource {
    /// The GPU prefix cache.
    GpuCache,
    /// A kvtier load.
    Loaded,
    /// The engine's compute.
    Computed,
}

/// What [`Req::gain`] counted: positions that had KV for the first time, split into prompt and
/// later ones, and positions the request had had before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Gain {
    /// Prompt positions with KV for the first time.
    pub prompt: u32,
    /// Positions past the prompt with KV for the first time.
    pub beyond_prompt: u32,
    /// Positions the request had had KV for before (lost to a preemption).
    pub again: u32,
}

/// Where a request is in the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Phase {
    /// Not arrived yet.
    Pending,
    /// In the waiting queue (new, preempted, or back from a load).
    Waiting,
    /// In the waiting queue with blocks allocated, until its load job is acknowledged (vLLM's
    /// `WAITING_FOR_REMOTE_KVS`).
    WaitingForRemote,
    /// In the running list.
    Running,
    /// Finished or aborted.
    Done,
}

/// A read-only view of one request, for tests and reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RequestView {
    /// Its id.
    pub id: RequestId,
    /// Its phase.
    pub phase: Phase,
    /// Tokens the scheduler knows (prompt and sampled output).
    pub num_tokens: u32,
    /// Tokens whose KV is computed (or scheduled to be, this step).
    pub num_computed_tokens: u32,
    /// Blocks it holds.
    pub block_count: usize,
    /// Finished and holding its blocks until kvtier releases them.
    pub kept: bool,
    /// How it ended, if it did.
    pub finish: Option<FinishKind>,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Where its prompt KV came from, each position counted once (the first time it had KV).
    pub prompt_split: TokenSplit,
    /// Prompt tokens it could reuse at best: the longest prefix of full blocks an
    /// earlier-arriving request also had, short of its last token.
    pub prompt_tokens_reusable: u32,
}

/// One request's engine state.
#[derive(Clone, Debug)]
pub(crate) struct Req {
    pub id: RequestId,
    pub spec: RequestSpec,
    pub prompt_len: u32,
    /// Every token the executor produced (the scheduler knows the first `num_known`).
    pub chain: TokenChain,
    /// Hashes of the full blocks within the first `num_known` tokens.
    pub hashes: Vec<u128>,
    pub num_known: u32,
    /// Sampled tokens scheduled but not yet processed (vLLM's `num_output_placeholders`).
    pub placeholders: u32,
    pub num_computed: u32,
    /// Most tokens whose KV this request ever had: positions below it are counted in `split`
    /// (or past the prompt) already, and getting them again is counted as "again".
    pub high_water: u32,
    /// Where each prompt position's KV came from the first time.
    pub split: TokenSplit,
    /// Prompt tokens it could reuse at best (the workload's own prefix sharing).
    pub reusable: u32,
    pub blocks: Vec<BlockId>,
    /// Blocks of the table already offered to the GPU prefix cache.
    pub cached_blocks: usize,
    pub phase: Phase,
    /// Back from a load: schedule without a new prefix lookup.
    pub skip_lookup: bool,
    /// The load in flight: (GPU-cached tokens, external tokens).
    pub load: Option<(u32, u32)>,
    /// Finished, blocks held until `take_released` names it.
    pub kept: bool,
    pub finish: Option<FinishKind>,
    /// `request_finished` was called.
    pub finish_called: bool,
    /// A meta listed it in `finished`.
    pub signalled: bool,
}

impl Req {
    pub fn new(index: usize, spec: RequestSpec, tokens_per_block: u32) -> Self {
        let prompt = spec.prompt();
        let chain = TokenChain::new(&prompt);
        let mut hashes = Vec::new();
        chain.extend_block_hashes(tokens_per_block, chain.len(), &mut hashes);
        Self {
            id: RequestId(index as u64),
            prompt_len: chain.len(),
            num_known: chain.len(),
            chain,
            hashes,
            spec,
            placeholders: 0,
            num_computed: 0,
            high_water: 0,
            split: TokenSplit::default(),
            reusable: 0,
            blocks: Vec::new(),
            cached_blocks: 0,
            phase: Phase::Pending,
            skip_lookup: false,
            load: None,
            kept: false,
            finish: None,
            finish_called: false,
            signalled: false,
        }
    }

    /// Tokens the scheduler counts, sampled-but-unprocessed ones included.
    pub fn num_tokens_with_placeholders(&self) -> u32 {
        self.num_known + self.placeholders
    }

    pub fn is_live(&self) -> bool {
        matches!(
            self.phase,
            Phase::Waiting | Phase::WaitingForRemote | Phase::Running
        )
    }

    /// Records that positions `from..to` have KV now, obtained from `source`. KV always grows
    /// as a prefix, so `from` is at most the high water: positions from there to `to` are new
    /// (the prompt's ones go to the split), the ones below it are had again.
    pub fn gain(&mut self, from: u32, to: u32, source: KvSource) -> Gain {
        debug_assert!(
            from <= self.high_water,
            "request {}: KV from {from} past its high water {}",
            self.id.0,
            self.high_water
        );
        if to <= from {
            return Gain::default();
        }
        let fresh_from = from.max(self.high_water).min(to);
        let prompt_end = to.min(self.prompt_len);
        let gain = Gain {
            prompt: prompt_end.saturating_sub(fresh_from),
            beyond_prompt: to - fresh_from.max(prompt_end),
            again: fresh_from - from,
        };
        let part = match source {
            KvSource::GpuCache => &mut self.split.gpu_cached,
            KvSource::Loaded => &mut self.split.loaded,
            KvSource::Computed => &mut self.split.computed,
        };
        *part += gain.prompt;
        self.high_water = self.high_water.max(to);
        debug_assert!(self.split.total() <= self.prompt_len);
        gain
    }

    pub fn view(&self) -> RequestView {
        RequestView {
            id: self.id,
            phase: self.phase,
            num_tokens: self.num_known,
            num_computed_tokens: self.num_computed,
            block_count: self.blocks.len(),
            kept: self.kept,
            finish: self.finish,
            prompt_tokens: self.prompt_len,
            prompt_split: self.split,
            prompt_tokens_reusable: self.reusable,
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "request {} {:?} tokens {} computed {} blocks {} kept {} load {:?} finish_called {}",
            self.id.0,
            self.phase,
            self.num_known,
            self.num_computed,
            self.blocks.len(),
            self.kept,
            self.load,
            self.finish_called
        )
    }
}
