//! Runs 16 requests that share one prefix through kvtier's scheduler and host pool on the
//! simulated engine, prints a summary (or the whole report with `--json`), and exits non-zero on
//! any integrity or invariant failure. Usage: `cargo run -p engine-sim --example shared_prefix --
//! [--seed N] [--sync] [--workers N] [--delay N] [--gpu-blocks N] [--gap STEPS] [--background N]
//! [--json]`. By default the requests arrive 60 steps apart with 4 unrelated background requests
//! between them, which evict the prefix from the GPU cache, so each later request loads it from the
//! host pool (`--gap 0 --background 0`: all 16 at once).

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
    json: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        seed: 1,
        async_scheduling: true,
        workers: 2,
        delay: 2,
        // Too small to keep every prefix: requests reload their KV from the host pool.
        gpu_blocks: 192,
        gap: 60,
        background: 4,
        json: false,
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
            "--sync" => args.async_scheduling = false,
            "--json" => args.json = true,
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
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(json) => println!("{json}"),
            Err(e) => eprintln!("shared_prefix: cannot print the report: {e}"),
        }
    } else {
        print_summary(&report, &args);
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

/// A short human-readable summary of a run.
fn print_summary(r: &engine_sim::SimReport, args: &Args) {
    let mode = if args.async_scheduling {
        "async"
    } else {
        "sync"
    };
    let pct = |n: u64| 100.0 * n as f64 / r.prompt_tokens.max(1) as f64;
    println!(
        "kvtier engine simulation (seed {}, {mode} scheduling, {} workers, {} steps)",
        r.seed, args.workers, r.steps
    );
    println!(
        "  requests       {} finished, {} aborted of {}",
        r.requests_finished, r.requests_aborted, r.requests_total
    );
    println!("  prompt tokens  {}", r.prompt_tokens);
    println!(
        "    from GPU prefix cache  {:>8} ({:.1}%)",
        r.prompt_tokens_gpu_cached,
        pct(r.prompt_tokens_gpu_cached)
    );
    println!(
        "    loaded by kvtier       {:>8} ({:.1}%)",
        r.prompt_tokens_loaded,
        pct(r.prompt_tokens_loaded)
    );
    println!(
        "    computed               {:>8} ({:.1}%)",
        r.prompt_tokens_computed,
        pct(r.prompt_tokens_computed)
    );
    println!(
        "    after preemptions: {} from the GPU cache again, {} loaded again, {} computed again",
        r.tokens_gpu_cached_again, r.tokens_loaded_again, r.tokens_recomputed
    );
    println!(
        "  jobs           {} loads ok, {} failed; {} stores ({} chunks), {} flushed",
        r.loads_ok, r.loads_failed, r.store_jobs, r.chunks_stored, r.flushes
    );
    println!(
        "  deferred final stores {}, preemptions {}",
        r.finishes_deferred, r.preemptions
    );
    println!(
        "  integrity failures {} (loaded blocks differing from recompute), store mismatches {}, \
         invariant failures {}",
        r.integrity_failures, r.store_mismatches, r.invariant_failures
    );
}
