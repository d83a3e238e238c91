//! Runs 16 requests that share one prefix through kvtier's scheduler and host pool on the
//! simulated engine, prints the report as JSON, and exits non-zero on any integrity or invariant
//! failure. Usage: `cargo run -p engine-sim --example shared_prefix -- [--seed N] [--async]
//! [--workers N] [--delay N] [--gpu-blocks N] [--gap STEPS] [--background N]` (`--gap 60
//! --background 4` spaces the requests out with background traffic that evicts the prefix from
//! the GPU cache, so each later request loads it from the host pool).

use std::process::ExitCode;

use engine_sim::{SharedPrefixSpec, Sim, SimConfig, WorkerFaults, Workload};

/// Command-line settings.
struct Args {
    seed: u64,
    async_scheduling: bool,
    workers: u32,
    delay: u32,
    gpu_blocks: u32,
    gap: u64,
    background: u32,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        seed: 1,
        async_scheduling: false,
        workers: 1,
        delay: 0,
        // Too small for all 16 at once: preempted requests reload their KV from the host pool.
        gpu_blocks: 128,
        gap: 0,
        background: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = it.next().ok_or(format!("{name} needs a value"))?;
            v.parse().map_err(|e| format!("{name} {v:?}: {e}"))
        };
        match flag.as_str() {
            "--seed" => args.seed = value("--seed")?,
            "--async" => args.async_scheduling = true,
            "--workers" => {
                args.workers = u32::try_from(value("--workers")?).map_err(|e| e.to_string())?
            }
            "--delay" => {
                args.delay = u32::try_from(value("--delay")?).map_err(|e| e.to_string())?
            }
            "--gpu-blocks" => {
                args.gpu_blocks =
                    u32::try_from(value("--gpu-blocks")?).map_err(|e| e.to_string())?
            }
            "--gap" => args.gap = value("--gap")?,
            "--background" => {
                args.background =
                    u32::try_from(value("--background")?).map_err(|e| e.to_string())?
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("shared_prefix: {e}");
            return ExitCode::from(2);
        }
    };
    let config = SimConfig {
        seed: args.seed,
        worker_count: args.workers,
        async_scheduling: args.async_scheduling,
        num_gpu_blocks: args.gpu_blocks,
        faults: WorkerFaults {
            store_delay_max: args.delay,
            load_delay_max: args.delay,
            ..WorkerFaults::default()
        },
        strict: false,
        ..SimConfig::default()
    };
    let workload = Workload::shared_prefix(&SharedPrefixSpec {
        seed: args.seed,
        arrival_gap_steps: args.gap,
        background_per_request: args.background,
        ..SharedPrefixSpec::default()
    });
    let mut sim = match Sim::new(config, workload) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("shared_prefix: {e}");
            return ExitCode::from(2);
        }
    };
    let report = match sim.run_to_completion(100_000) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("shared_prefix: {e}");
            return ExitCode::FAILURE;
        }
    };
    match serde_json::to_string_pretty(&report) {
        Ok(json) => println!("{json}"),
        Err(e) => eprintln!("shared_prefix: cannot print the report: {e}"),
    }
    if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "shared_prefix: FAILED (seed {}): replay with `cargo run -p engine-sim --example shared_prefix -- --seed {}`",
            report.seed, report.seed
        );
        ExitCode::FAILURE
    }
}
