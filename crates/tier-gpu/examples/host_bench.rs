//! Host-path bandwidth against the machine's ceiling, measured in the same run (a thin wrapper
//! over [`tier_gpu::bench::run`]; `kvtier bench host` is the same measurement).
//! Usage: `cargo run --release -p tier-gpu --example host_bench [-- --threads N --reps N]`.

use tier_gpu::bench::{self, HostBenchConfig};

fn arg(name: &str, default: usize) -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let v = args.get(i + 1).ok_or(format!("{name} needs a value"))?;
            v.parse().map_err(|e| format!("{name} {v:?}: {e}"))
        }
    }
}

fn main() -> Result<(), String> {
    let defaults = HostBenchConfig::default();
    let config = HostBenchConfig {
        threads: arg("--threads", defaults.threads)?,
        reps: arg("--reps", defaults.reps)?,
        ..defaults
    };
    println!(
        "host path ({} copy threads) vs single-thread memcpy, {} MiB per job, best of {}",
        config.threads,
        config.total_bytes >> 20,
        config.reps
    );
    let rows = bench::run(&config, &mut |_| {})?;
    println!(
        "{:>10} {:>6} {:>12} {:>12} {:>7}",
        "chunk", "dir", "path GiB/s", "memcpy GiB/s", "ratio"
    );
    for r in rows {
        println!(
            "{:>7} KiB {:>6} {:>12.2} {:>12.2} {:>7.2}",
            r.chunk_bytes >> 10,
            r.op,
            r.gib_per_s,
            r.ceiling_gib_per_s,
            r.ratio()
        );
    }
    Ok(())
}
