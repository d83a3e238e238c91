//! The simulator's settings, with a small sane default, and their validation.

use offload_core::{EvictionPolicy, OffloadPolicy, PoolConfig, SchedulerConfig};
use serde::{Deserialize, Serialize};

use crate::report::SimError;
use crate::worker::WorkerFaults;

/// In which order the engine handles one step's model output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutputOrder {
    /// Sampled tokens and finishes (`request_finished`) first, then the workers' acknowledgements
    /// (`update_connector_output`): vLLM's `update_from_output` order.
    FinishesFirst,
    /// Acknowledgements first, then tokens and finishes.
    AcksFirst,
}

/// Every knob of a simulation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    /// Seed of every random choice (aborts, worker delays and failures).
    pub seed: u64,
    /// Tokens per engine block.
    pub tokens_per_block: u32,
    /// Engine blocks per chunk.
    pub blocks_per_chunk: u32,
    /// Bytes per engine block (a multiple of `tokens_per_block`, at least `worker_count` per token).
    pub block_bytes: u32,
    /// Engine blocks in the GPU KV cache.
    pub num_gpu_blocks: u32,
    /// Slots in the host pool.
    pub host_slots: u32,
    /// Tensor-parallel workers (1 to 64).
    pub worker_count: u32,
    /// vLLM's async scheduling: step N+1 is scheduled before step N's output is processed.
    pub async_scheduling: bool,
    /// Token budget per step.
    pub max_num_batched_tokens: u32,
    /// Most running requests.
    pub max_num_seqs: u32,
    /// kvtier: block-level or request-level offload.
    pub offload_policy: OffloadPolicy,
    /// kvtier: offload only prompts.
    pub offload_prompt_only: bool,
    /// Host pool eviction policy.
    pub eviction: EvictionPolicy,
    /// Host pool reuse threshold.
    pub reuse_threshold: u32,
    /// kvtier: most jobs in flight.
    pub jobs_in_flight_max: u32,
    /// Delays and failures of every worker (change one worker's with `Sim::worker_mut`).
    pub faults: WorkerFaults,
    /// Probability, in parts per million, that a live request is aborted at a step.
    pub abort_ppm: u32,
    /// Steps at whose start `reset_cache` is called.
    pub reset_cache_steps: Vec<u64>,
    /// Order of output handling within a step.
    pub output_order: OutputOrder,
    /// Panic at the first contract violation (with the seed); otherwise count them in the report.
    pub strict: bool,
    /// Verify each request's whole computed KV when it finishes or is preempted.
    pub verify_requests: bool,
    /// Most manager calls the checker logs.
    pub call_log_max: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            tokens_per_block: 16,
            blocks_per_chunk: 4,
            block_bytes: 256,
            num_gpu_blocks: 256,
            host_slots: 512,
            worker_count: 1,
            async_scheduling: false,
            max_num_batched_tokens: 512,
            max_num_seqs: 16,
            offload_policy: OffloadPolicy::Block,
            offload_prompt_only: false,
            eviction: EvictionPolicy::Lru,
            reuse_threshold: 0,
            jobs_in_flight_max: 4096,
            faults: WorkerFaults::default(),
            abort_ppm: 0,
            reset_cache_steps: Vec::new(),
            output_order: OutputOrder::FinishesFirst,
            strict: true,
            verify_requests: true,
            call_log_max: 1 << 20,
        }
    }
}

impl SimConfig {
    /// kvtier's scheduler settings for this simulation (strict bookkeeping).
    pub fn scheduler_config(&self) -> SchedulerConfig {
        SchedulerConfig {
            tokens_per_block: self.tokens_per_block,
            blocks_per_chunk: self.blocks_per_chunk,
            offload_prompt_only: self.offload_prompt_only,
            policy: self.offload_policy,
            worker_count: self.worker_count,
            kv_group: 0,
            jobs_in_flight_max: self.jobs_in_flight_max,
            requests_max: 65_536,
            strict: self.strict,
        }
    }

    /// The host pool's settings.
    pub fn pool_config(&self) -> PoolConfig {
        PoolConfig {
            slot_count: self.host_slots,
            policy: self.eviction,
            reuse_threshold: self.reuse_threshold,
            events: true,
        }
    }

    /// Bytes per host slot.
    pub fn slot_bytes(&self) -> usize {
        self.blocks_per_chunk as usize * self.block_bytes as usize
    }

    /// Checks every setting; the error names the first bad one.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |field: &'static str, reason: &str| {
            Err(SimError::InvalidConfig {
                field,
                reason: reason.to_string(),
            })
        };
        if self.tokens_per_block == 0 {
            return bad("tokens_per_block", "must be at least 1");
        }
        if self.blocks_per_chunk == 0 {
            return bad("blocks_per_chunk", "must be at least 1");
        }
        if self.block_bytes == 0 || self.block_bytes % self.tokens_per_block != 0 {
            return bad(
                "block_bytes",
                "must be a positive multiple of tokens_per_block",
            );
        }
        if !(1..=64).contains(&self.worker_count) {
            return bad("worker_count", "must be 1 to 64");
        }
        if self.block_bytes / self.tokens_per_block < self.worker_count {
            return bad(
                "block_bytes",
                "each worker needs at least one byte of every token",
            );
        }
        if self.num_gpu_blocks == 0 {
            return bad("num_gpu_blocks", "must be at least 1");
        }
        if self.host_slots == 0 {
            return bad("host_slots", "must be at least 1");
        }
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens", "must be at least 1");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs", "must be at least 1");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_consistent() {
        let c = SimConfig::default();
        c.validate().unwrap();
        assert_eq!(c.scheduler_config().tokens_per_block, 16);
        assert_eq!(c.pool_config().slot_count, 512);
        assert_eq!(c.slot_bytes(), 1024);
    }

    #[test]
    fn bad_settings_are_named() {
        let c = SimConfig {
            block_bytes: 100,
            ..SimConfig::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("block_bytes"), "{e}");
        let c = SimConfig {
            worker_count: 0,
            ..SimConfig::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("worker_count"));
    }
}
