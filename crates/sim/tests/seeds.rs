//! A few seeds of the simulator as a plain test (the full sweep is `cargo xtask sim`): each must
//! run clean, and together they must exercise both managers, loads, promotions and tier faults.

use kvtier_sim::plan::{plan, ManagerKind};
use kvtier_sim::{replay_command, run_seed};

#[test]
fn a_few_seeds_run_clean_and_exercise_the_stack() {
    let mut host_seeds = 0;
    let mut tiering_seeds = 0;
    let (mut loads, mut promoted, mut faults, mut model_calls) = (0, 0, 0, 0);
    for seed in 1..=12 {
        match plan(seed, None).manager {
            ManagerKind::HostPool => host_seeds += 1,
            ManagerKind::Tiering { .. } => tiering_seeds += 1,
        }
        let o = run_seed(seed, None).unwrap_or_else(|f| {
            panic!(
                "seed {seed}: {}\nplan: {}\nreplay: {}",
                f.reason,
                f.plan,
                replay_command(seed, None, false)
            )
        });
        loads += o.loads_ok;
        promoted += o.promoted;
        faults += o.tier_faults;
        model_calls += o.model_calls;
    }
    assert!(
        host_seeds > 0 && tiering_seeds > 0,
        "{host_seeds} {tiering_seeds}"
    );
    assert!(
        loads > 0 && faults > 0 && model_calls > 0,
        "{loads} {faults} {model_calls}"
    );
    eprintln!("promoted chunks {promoted}");
}

#[test]
fn the_replay_command_names_the_seed_and_trace() {
    assert_eq!(replay_command(42, None, false), "cargo xtask sim --seed 42");
    assert_eq!(
        replay_command(42, Some("t.jsonl"), true),
        "cargo xtask sim --seed 42 --trace t.jsonl --tiny-host"
    );
}
