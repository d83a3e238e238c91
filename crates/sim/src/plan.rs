//! [`Plan`]: what one seed decides before the run starts. The seed picks the manager (the host
//! pool alone with the reference model in lockstep, or the connector's tiering manager with one or
//! two fault-injecting secondary tiers), the engine's settings (sync or async scheduling, worker
//! count, GPU and host sizes, offload policy, output order), the workload (generated, or a window
//! of a Mooncake trace), and a random subset of event kinds ([`EventKind`]), each with its own
//! random weight, so rare combinations get their turn.

use engine_sim::rng::SplitMix64;
use engine_sim::scenario::{random_scenario, ScenarioLimits};
use engine_sim::trace::TraceRecord;
use engine_sim::{OutputOrder, SimConfig, WorkerFaults, Workload};
use offload_core::{EvictionPolicy, OffloadPolicy};

use crate::fault::TierFaults;

/// The kinds of event a seed may enable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum EventKind {
    /// Requests aborted at random steps.
    Abort,
    /// `reset_cache` at random steps.
    Reset,
    /// Workers fail jobs.
    WorkerFail,
    /// Workers complete jobs late (reordering across workers).
    WorkerDelay,
    /// A small GPU, so requests are preempted.
    Preempt,
    /// A small host pool, so chunks are evicted and allocations fail.
    HostPressure,
    /// Whole tier store jobs fail.
    TierStoreFail,
    /// Whole tier load (promotion) jobs fail.
    TierLoadFail,
    /// Single keys of tier jobs fail (partial promotions, short I/O).
    TierKeyFail,
    /// Loaded bytes are corrupted.
    TierCorrupt,
    /// Tiers refuse jobs as busy.
    TierBusy,
    /// Tier completions are delayed and reordered.
    TierDelay,
    /// A tier stalls for a while.
    TierStall,
    /// A tier dies.
    TierDie,
    /// Tier lookups first answer "retry".
    TierRetry,
}

/// Every event kind.
pub const EVENT_KINDS: [EventKind; 15] = [
    EventKind::Abort,
    EventKind::Reset,
    EventKind::WorkerFail,
    EventKind::WorkerDelay,
    EventKind::Preempt,
    EventKind::HostPressure,
    EventKind::TierStoreFail,
    EventKind::TierLoadFail,
    EventKind::TierKeyFail,
    EventKind::TierCorrupt,
    EventKind::TierBusy,
    EventKind::TierDelay,
    EventKind::TierStall,
    EventKind::TierDie,
    EventKind::TierRetry,
];

/// Which manager a seed runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManagerKind {
    /// kvtier's scheduler over the host pool, with the reference model in lockstep.
    HostPool,
    /// The connector's scheduler handle over the tiering manager and `tiers` fault tiers.
    Tiering {
        /// Secondary tiers (1 or 2).
        tiers: u32,
    },
}

/// What a seed decided.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The seed.
    pub seed: u64,
    /// The manager.
    pub manager: ManagerKind,
    /// The enabled event kinds with their weights (1..=8).
    pub events: Vec<(EventKind, u32)>,
    /// The engine's settings (faults of the first phase included).
    pub config: SimConfig,
    /// The requests.
    pub workload: Workload,
    /// Steps of the fault phase.
    pub fault_steps: u64,
    /// Steps the convergence phase may take at most.
    pub converge_steps: u64,
    /// `reset_cache` at the start of these steps (fault phase only).
    pub reset_steps: Vec<u64>,
    /// Per step, the chance (ppm) that a tier starts or ends a stall.
    pub stall_toggle_ppm: u32,
    /// The step at which a tier dies, if one does.
    pub die_step: Option<u64>,
    /// Faults of each secondary tier.
    pub tier_faults: Vec<TierFaults>,
    /// Lookup retries of each secondary tier.
    pub tier_retries: Vec<u32>,
    /// Promotion deadline (ns of the manual clock, which advances 1 ms per step).
    pub promotion_deadline_ns: u64,
}

impl Plan {
    /// Weight of `kind`, 0 when disabled.
    pub fn weight(&self, kind: EventKind) -> u32 {
        self.events
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |e| e.1)
    }

    /// A one-line description (for logs and failures).
    pub fn describe(&self) -> String {
        let events: Vec<String> = self
            .events
            .iter()
            .map(|(k, w)| format!("{k:?}x{w}"))
            .collect();
        format!(
            "{:?}, {} requests, {} workers, {} scheduling, gpu {} blocks, host {} slots, {:?}, \
             fault steps {}, events [{}]",
            self.manager,
            self.workload.requests.len(),
            self.config.worker_count,
            if self.config.async_scheduling {
                "async"
            } else {
                "sync"
            },
            self.config.num_gpu_blocks,
            self.config.host_slots,
            self.config.eviction,
            self.fault_steps,
            events.join(" ")
        )
    }
}

/// The plan of `seed`; with `trace`, the workload is a window of those records.
pub fn plan(seed: u64, trace: Option<&[TraceRecord]>) -> Plan {
    plan_with(seed, trace, false)
}

/// [`plan`], and with `tiny_host` the host pool under pressure may be as small as 1 slot (4
/// without it).
///
/// Under host pressure the pool may be smaller than one request's prefix. That once livelocked
/// the tiering manager (promotions for a waiting request evicted each other before it could load
/// them); promoted chunks now stay pinned for their request, and the pool has no floor tied to
/// the longest request any more.
pub fn plan_with(seed: u64, trace: Option<&[TraceRecord]>, tiny_host: bool) -> Plan {
    let mut rng = SplitMix64::stream(seed, 0x91A4);
    let manager = match rng.below(3) {
        0 => ManagerKind::HostPool,
        _ => ManagerKind::Tiering {
            tiers: 1 + rng.below(2) as u32,
        },
    };
    let mut events = Vec::new();
    for kind in EVENT_KINDS {
        let tier_kind = kind >= EventKind::TierStoreFail;
        if tier_kind && manager == ManagerKind::HostPool {
            continue;
        }
        if rng.below(2) == 0 {
            events.push((kind, 1 + rng.below(8) as u32));
        }
    }
    // The base settings and workload come from engine-sim's scenario generator (same seed,
    // its own stream); this plan then overrides what its event kinds control.
    let limits = ScenarioLimits {
        resets: false,
        failures: false,
        aborts: false,
    };
    let (mut config, mut workload) = random_scenario(seed, limits);
    if let Some(records) = trace {
        workload = trace_window(records, &mut rng, &config);
    }
    let mut p = Plan {
        seed,
        manager,
        events,
        config: SimConfig::default(),
        workload: Workload::default(),
        fault_steps: 0,
        converge_steps: 0,
        reset_steps: Vec::new(),
        stall_toggle_ppm: 0,
        die_step: None,
        tier_faults: Vec::new(),
        tier_retries: Vec::new(),
        promotion_deadline_ns: 5_000_000 + rng.below(50) * 1_000_000,
    };
    let last_arrival = workload
        .requests
        .iter()
        .map(|r| r.arrival_step)
        .max()
        .unwrap_or(0);
    p.fault_steps = 20 + rng.below(last_arrival + 200);
    p.converge_steps = 20_000;
    let weights = p.events.clone();
    let w = |k: EventKind| weights.iter().find(|(e, _)| *e == k).map_or(0, |e| e.1);
    config.seed = seed;
    config.strict = true;
    config.call_log_max = 256;
    config.abort_ppm = 0;
    config.reset_cache_steps = Vec::new();
    config.eviction = if manager == ManagerKind::HostPool && rng.below(3) == 0 {
        EvictionPolicy::Arc
    } else {
        EvictionPolicy::Lru
    };
    config.reuse_threshold = 0;
    config.async_scheduling = rng.below(2) == 0;
    config.worker_count = 1 + rng.below(4) as u32;
    config.output_order = if rng.below(2) == 0 {
        OutputOrder::FinishesFirst
    } else {
        OutputOrder::AcksFirst
    };
    config.offload_policy = if rng.below(4) == 0 {
        OffloadPolicy::Request
    } else {
        OffloadPolicy::Block
    };
    // Aborts: each request may be aborted at a random step of the fault phase.
    let abort_ppm = w(EventKind::Abort) * 40_000;
    for r in &mut workload.requests {
        r.abort_step = None;
        if rng.chance_ppm(abort_ppm) {
            r.abort_step = Some(r.arrival_step + rng.below(60));
        }
        // A request's own tokens are a fresh draw for the trace window too.
        if trace.is_some() && r.unique_tokens == 0 && rng.below(4) == 0 {
            r.unique_tokens = 1 + rng.below(64) as u32;
        }
    }
    let need_blocks = workload
        .requests
        .iter()
        .map(|r| (r.prompt_len() + r.max_tokens + 1).div_ceil(config.tokens_per_block))
        .max()
        .unwrap_or(1);
    config.num_gpu_blocks = if w(EventKind::Preempt) > 0 {
        need_blocks + rng.below(u64::from(need_blocks / 2 + 8)) as u32
    } else {
        config.num_gpu_blocks.max(need_blocks) * 2
    };
    let slots_min = if tiny_host { 1 } else { 4 };
    config.host_slots = if w(EventKind::HostPressure) > 0 {
        slots_min + rng.below(64) as u32
    } else {
        config.host_slots.max(256)
    };
    config.faults = WorkerFaults {
        fail_ppm: w(EventKind::WorkerFail) * 10_000,
        store_delay_max: if w(EventKind::WorkerDelay) > 0 {
            w(EventKind::WorkerDelay)
        } else {
            0
        },
        load_delay_max: w(EventKind::WorkerDelay) / 2,
        scribble_on_failure: true,
        ..WorkerFaults::default()
    };
    if w(EventKind::Reset) > 0 {
        let n = 1 + rng.below(u64::from(w(EventKind::Reset)));
        p.reset_steps = (0..n).map(|_| rng.below(p.fault_steps)).collect();
    }
    if let ManagerKind::Tiering { tiers } = manager {
        for _ in 0..tiers {
            let on = |rng: &mut SplitMix64, k: EventKind, ppm: u32| {
                if w(k) > 0 && rng.below(4) != 0 {
                    w(k) * ppm
                } else {
                    0
                }
            };
            let faults = TierFaults {
                store_fail_ppm: on(&mut rng, EventKind::TierStoreFail, 30_000),
                load_fail_ppm: on(&mut rng, EventKind::TierLoadFail, 30_000),
                key_fail_ppm: on(&mut rng, EventKind::TierKeyFail, 15_000),
                corrupt_ppm: on(&mut rng, EventKind::TierCorrupt, 15_000),
                torn_on_failure: rng.below(2) == 0,
                busy_ppm: on(&mut rng, EventKind::TierBusy, 40_000),
                delay_polls_max: if w(EventKind::TierDelay) > 0 {
                    rng.below(u64::from(w(EventKind::TierDelay)) + 1) as u32
                } else {
                    0
                },
                stall: w(EventKind::TierStall) > 0 && rng.below(2) == 0,
                die: w(EventKind::TierDie) > 0 && rng.below(2) == 0,
            };
            p.tier_faults.push(faults);
            p.tier_retries.push(if w(EventKind::TierRetry) > 0 {
                rng.below(u64::from(w(EventKind::TierRetry)) + 1) as u32
            } else {
                0
            });
        }
        p.stall_toggle_ppm = w(EventKind::TierStall) * 10_000;
        if w(EventKind::TierDie) > 0 {
            p.die_step = Some(rng.below(p.fault_steps));
        }
    }
    p.config = config;
    p.workload = workload;
    p
}

/// A window of 4 to 40 consecutive trace records, rescaled so that the longest fits the GPU.
fn trace_window(records: &[TraceRecord], rng: &mut SplitMix64, config: &SimConfig) -> Workload {
    let len = (4 + rng.below(37) as usize).min(records.len());
    let start = rng.below((records.len() - len + 1) as u64) as usize;
    let window: Vec<TraceRecord> = records[start..start + len]
        .iter()
        .map(|r| {
            let mut r = r.clone();
            // Keep prompts small enough for a simulated GPU: at most 8 of the 512-token blocks.
            r.input_length = r.input_length.min(8 * 512);
            r.hash_ids.truncate(r.input_length.div_ceil(512) as usize);
            r.output_length = r.output_length.clamp(1, 64);
            r
        })
        .collect();
    let options = engine_sim::trace::TraceOptions {
        ms_per_step: 50.0 + rng.below(500) as f64,
        seed: rng.next_u64() ^ config.seed,
    };
    engine_sim::trace::to_workload(&window, &options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_decides_the_same_plan_and_seeds_differ() {
        let a = plan(7, None);
        let b = plan(7, None);
        assert_eq!(a.describe(), b.describe());
        assert_eq!(a.config, b.config);
        assert_eq!(a.workload, b.workload);
        let kinds: std::collections::BTreeSet<String> = (0..64)
            .map(|s| format!("{:?}", plan(s, None).events))
            .collect();
        assert!(
            kinds.len() > 32,
            "event subsets barely vary: {}",
            kinds.len()
        );
    }

    #[test]
    fn plans_are_valid_for_the_engine() {
        for seed in 0..64 {
            let p = plan(seed, None);
            p.config.validate().unwrap();
            assert!(!p.workload.requests.is_empty());
            let need = p
                .workload
                .requests
                .iter()
                .map(|r| (r.prompt_len() + r.max_tokens + 1).div_ceil(p.config.tokens_per_block))
                .max()
                .unwrap();
            assert!(need <= p.config.num_gpu_blocks, "seed {seed}");
        }
    }
}
