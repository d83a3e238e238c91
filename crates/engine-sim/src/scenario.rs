//! Random scenarios: one seed picks every setting (scheduling mode, workers, GPU size, delays,
//! failures, aborts, offload policy, output order) and the workload, so a seed sweep explores the
//! lifecycle and a failing seed replays exactly.

use offload_core::OffloadPolicy;

use crate::config::{OutputOrder, SimConfig};
use crate::rng::SplitMix64;
use crate::worker::WorkerFaults;
use crate::workload::{SharedPrefixSpec, Workload};

/// What a random scenario may include.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScenarioLimits {
    /// Allow `reset_cache` calls while jobs are in flight.
    pub resets: bool,
    /// Allow job failures.
    pub failures: bool,
    /// Allow aborts.
    pub aborts: bool,
}

impl Default for ScenarioLimits {
    fn default() -> Self {
        Self {
            resets: true,
            failures: true,
            aborts: true,
        }
    }
}

/// The settings and workload that `seed` picks.
pub fn random_scenario(seed: u64, limits: ScenarioLimits) -> (SimConfig, Workload) {
    let mut rng = SplitMix64::stream(seed, 0x5CE7);
    let mut pick = |n: u64| rng.below(n);
    let delay = pick(5) as u32;
    let faults = WorkerFaults {
        fail_ppm: if limits.failures && pick(3) == 0 {
            20_000 + pick(150_000) as u32
        } else {
            0
        },
        store_delay_max: delay,
        load_delay_max: pick(u64::from(delay) + 1) as u32,
        scribble_on_failure: true,
        ..WorkerFaults::default()
    };
    let reset_cache_steps = if limits.resets && pick(4) == 0 {
        (0..1 + pick(3)).map(|_| pick(400)).collect()
    } else {
        Vec::new()
    };
    let config = SimConfig {
        seed,
        async_scheduling: pick(2) == 0,
        worker_count: 1 + pick(4) as u32,
        num_gpu_blocks: 160 + 32 * pick(3) as u32,
        host_slots: [48, 128, 512][pick(3) as usize],
        max_num_batched_tokens: [256, 512, 2048][pick(3) as usize],
        max_num_seqs: [4, 16, 64][pick(3) as usize],
        offload_policy: if pick(4) == 0 {
            OffloadPolicy::Request
        } else {
            OffloadPolicy::Block
        },
        offload_prompt_only: pick(4) == 0,
        output_order: if pick(2) == 0 {
            OutputOrder::FinishesFirst
        } else {
            OutputOrder::AcksFirst
        },
        abort_ppm: if limits.aborts && pick(3) == 0 {
            1_000 + pick(10_000) as u32
        } else {
            0
        },
        reset_cache_steps,
        faults,
        ..SimConfig::default()
    };
    let spec = SharedPrefixSpec {
        requests: 4 + pick(16) as u32,
        prefix_tokens: [0, 100, 512, 1000][pick(4) as usize],
        unique_tokens: 16 + pick(600) as u32,
        unique_jitter: pick(200) as u32,
        max_tokens: 1 + pick(80) as u32,
        arrival_gap_steps: [0, 10, 30, 60][pick(4) as usize],
        background_per_request: pick(6) as u32,
        background_tokens: 512 + pick(1536) as u32,
        background_max_tokens: 1 + pick(8) as u32,
        seed,
    };
    (config, Workload::shared_prefix(&spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenarios_are_valid_and_deterministic() {
        for seed in 0..50 {
            let (c, w) = random_scenario(seed, ScenarioLimits::default());
            c.validate().unwrap();
            assert!(!w.requests.is_empty());
            assert_eq!(
                (c.clone(), w.clone()),
                random_scenario(seed, ScenarioLimits::default())
            );
        }
    }
}
