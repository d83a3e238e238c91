//! A seed sweep over random scenarios (settings, workload, delays, failures, aborts): each must
//! complete cleanly. `KVTIER_SIM_SEEDS=N` sweeps more seeds; `KVTIER_SIM_SEED=S` replays one.

use engine_sim::scenario::{random_scenario, ScenarioLimits};
use engine_sim::Sim;

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("KVTIER_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    let count = std::env::var("KVTIER_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(48);
    (1..=count).collect()
}

fn sweep(limits: ScenarioLimits) {
    for seed in seeds() {
        let (config, workload) = random_scenario(seed, limits);
        let replay =
            format!("replay: KVTIER_SIM_SEED={seed} cargo test -p engine-sim --test seed_sweep");
        let total = workload.requests.len() as u64;
        let mut sim = Sim::new(config.clone(), workload)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}; {replay}"));
        let report = sim
            .run_to_completion(50_000)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}; {replay}; config {config:?}"));
        assert!(report.is_clean(), "seed {seed}: {report:?}; {replay}");
        assert_eq!(
            report.requests_finished + report.requests_aborted,
            total,
            "seed {seed}; {replay}"
        );
    }
}

#[test]
fn random_scenarios_without_resets() {
    sweep(ScenarioLimits {
        resets: false,
        ..ScenarioLimits::default()
    });
}

#[test]
fn random_scenarios_with_resets() {
    sweep(ScenarioLimits::default());
}
