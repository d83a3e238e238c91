//! Disk tier throughput against the disk's own ceiling, measured in the same run: a thin wrapper
//! over [`tier_fs::bench::run`] that prints its progress lines and a table of ratios.
//!
//! Usage: `cargo run --release -p tier-fs --example fs_bench -- [DIR] [--engine auto|uring|sync]
//! [--total-mib N] [--workers N] [--repeats N] [--sizes-kib 256,1024,...]` (DIR defaults to the system's
//! temporary directory; it must be on the disk to measure, not tmpfs).

use tier_fs::bench::{run, FsBenchConfig};
use tier_fs::EngineChoice;

fn number<T: std::str::FromStr>(value: Option<String>, flag: &str) -> Result<T, String> {
    value
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("{flag} needs a number"))
}

fn parse_args() -> Result<FsBenchConfig, String> {
    let mut config = FsBenchConfig::new(std::env::temp_dir());
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--engine" => {
                config.engine = match it.next().as_deref() {
                    Some("auto") => EngineChoice::Auto,
                    Some("uring") => EngineChoice::Uring,
                    Some("sync") => EngineChoice::Sync,
                    other => return Err(format!("--engine: unknown {other:?}")),
                }
            }
            "--workers" => config.workers = number(it.next(), "--workers")?,
            "--repeats" => config.repeats = number(it.next(), "--repeats")?,
            "--total-mib" => config.total_bytes = number::<u64>(it.next(), "--total-mib")? << 20,
            "--sizes-kib" => {
                let list = it.next().ok_or("--sizes-kib needs a list")?;
                config.chunk_sizes = list
                    .split(',')
                    .map(|s| s.trim().parse::<usize>().map(|k| k * 1024))
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("--sizes-kib {list:?}: {e}"))?;
            }
            dir if !dir.starts_with("--") => config.dir = dir.into(),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(config)
}

fn main() -> Result<(), String> {
    let config = parse_args()?;
    let rows = run(&config, &mut |line| println!("{line}")).map_err(|e| e.to_string())?;
    println!(
        "{:>8}  {:>6}  {:>9} {:>9} {:>6} {:>7}",
        "chunk", "op", "tier", "ceiling", "ratio", "median"
    );
    for row in &rows {
        println!(
            "{:>5}KiB  {:>6}  {:>9.2} {:>9.2} {:>5.2}x {:>6.2}x",
            row.chunk_bytes / 1024,
            row.op,
            row.gib_per_s,
            row.ceiling_gib_per_s,
            row.ratio(),
            row.round_ratio_median.unwrap_or(0.0)
        );
    }
    println!(
        "(GiB/s, best of {} rounds each; ceiling = the better of raw O_DIRECT at queue depth 1 \
         and at the tier's depth, same directory, same run; median = of each round's own ratio)",
        config.repeats
    );
    Ok(())
}
