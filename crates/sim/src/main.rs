//! `kvtier-sim`: runs seeds of the deterministic simulator (`cargo xtask sim` builds and runs it).
//! `--seed S` replays one seed; `--seeds N [--base B]` runs seeds B..B+N; `--trace [PATH]` takes
//! arrivals from a Mooncake trace; `--keep-going` runs every seed and counts failures;
//! `--tiny-host` lets a host pool under pressure shrink to 1 slot (4 without it). A failure prints the seed, what broke and the replay command.

use std::process::ExitCode;
use std::time::Instant;

use engine_sim::trace::{read_trace_file, TraceRecord};
use kvtier_sim::{replay_command, run_seed_with};

/// The trace `--trace` reads when no path follows it.
const DEFAULT_TRACE: &str = "/work/shared/traces/mooncake_synthetic_trace.jsonl";

/// Most trace records read.
const TRACE_RECORDS_MAX: usize = 20_000;

struct Args {
    seeds: Vec<u64>,
    trace: Option<String>,
    verbose: bool,
    keep_going: bool,
    tiny_host: bool,
}

const USAGE: &str = "usage: kvtier-sim [--seed S | --seeds N [--base B]] [--trace [PATH]] \
                     [--keep-going] [--tiny-host] [--verbose]";

fn parse(args: &[String]) -> Result<Args, String> {
    let mut seed = None;
    let mut count = None;
    let mut base = 1u64;
    let mut trace = None;
    let mut verbose = false;
    let mut keep_going = false;
    let mut tiny_host = false;
    let mut i = 0;
    let number = |i: usize, name: &str| -> Result<u64, String> {
        let v = args
            .get(i + 1)
            .ok_or_else(|| format!("{name} needs a number"))?;
        v.parse()
            .map_err(|_| format!("{name} needs a number, got `{v}`"))
    };
    while i < args.len() {
        match args[i].as_str() {
            "--seed" => {
                seed = Some(number(i, "--seed")?);
                i += 1;
            }
            "--seeds" => {
                count = Some(number(i, "--seeds")?);
                i += 1;
            }
            "--base" => {
                base = number(i, "--base")?;
                i += 1;
            }
            "--trace" => match args.get(i + 1).filter(|a| !a.starts_with("--")) {
                Some(path) => {
                    trace = Some(path.clone());
                    i += 1;
                }
                None => trace = Some(DEFAULT_TRACE.to_owned()),
            },
            "--verbose" => verbose = true,
            "--keep-going" => keep_going = true,
            "--tiny-host" => tiny_host = true,
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument `{other}`; {USAGE}")),
        }
        i += 1;
    }
    let seeds = match (seed, count) {
        (Some(_), Some(_)) => return Err("give --seed or --seeds, not both".to_owned()),
        (Some(s), None) => vec![s],
        (None, Some(n)) => (0..n).map(|k| base.wrapping_add(k)).collect(),
        (None, None) => (0..64).map(|k| base.wrapping_add(k)).collect(),
    };
    Ok(Args {
        seeds,
        trace,
        verbose,
        keep_going,
        tiny_host,
    })
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse(&raw) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let records: Option<Vec<TraceRecord>> = match &args.trace {
        None => None,
        Some(path) => match read_trace_file(std::path::Path::new(path), TRACE_RECORDS_MAX) {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!("cannot read trace {path}: {e}");
                return ExitCode::from(2);
            }
        },
    };
    // Strict checks panic; the runner reports the seed itself, so keep the default hook quiet.
    std::panic::set_hook(Box::new(|_| {}));
    let start = Instant::now();
    let mut totals = kvtier_sim::SeedOutcome::default();
    let mut failures = 0u64;
    for (n, &seed) in args.seeds.iter().enumerate() {
        match run_seed_with(seed, records.as_deref(), args.tiny_host) {
            Ok(o) => {
                if args.verbose {
                    println!("seed {seed}: ok {o:?}");
                }
                totals.steps.0 += o.steps.0;
                totals.steps.1 += o.steps.1;
                totals.requests.0 += o.requests.0;
                totals.requests.1 += o.requests.1;
                totals.loads_ok += o.loads_ok;
                totals.loads_failed += o.loads_failed;
                totals.tokens_loaded += o.tokens_loaded;
                totals.resets += o.resets;
                totals.promoted += o.promoted;
                totals.tier_faults += o.tier_faults;
                totals.model_calls += o.model_calls;
            }
            Err(f) => {
                println!("SIM FAILURE at seed {} (after {n} clean seeds)", f.seed);
                println!("plan: {}", f.plan);
                println!("what: {}", f.reason);
                println!(
                    "replay: {}",
                    replay_command(f.seed, args.trace.as_deref(), args.tiny_host)
                );
                failures += 1;
                if !args.keep_going {
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    if failures > 0 {
        println!("sim: {failures} of {} seeds FAILED", args.seeds.len());
        return ExitCode::FAILURE;
    }
    println!(
        "sim: {} seeds clean in {secs:.1} s ({:.1} seeds/s); steps {} faulty + {} converging, \
         requests {} finished + {} aborted, loads {} ok / {} failed ({} tokens), resets {}, \
         promoted chunks {}, tier faults {}, model-checked calls {}",
        args.seeds.len(),
        args.seeds.len() as f64 / secs.max(1e-9),
        totals.steps.0,
        totals.steps.1,
        totals.requests.0,
        totals.requests.1,
        totals.loads_ok,
        totals.loads_failed,
        totals.tokens_loaded,
        totals.resets,
        totals.promoted,
        totals.tier_faults,
        totals.model_calls
    );
    ExitCode::SUCCESS
}
