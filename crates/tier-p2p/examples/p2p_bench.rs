//! Peer fetch throughput against a raw loopback socket with the same write size, measured in the
//! same run: a thin command-line wrapper over [`tier_p2p::bench::run`].
//!
//! Usage: `cargo run --release -p tier-p2p --example p2p_bench -- [--total-mib N] [--rounds N]
//! [--chunk-mib N] [--nixl] [--keyed]`. `--chunk-mib` measures that one chunk size only; `--keyed`
//! also measures instances that share a secret (keyed BLAKE3 tags); `--nixl` also
//! measures the NIXL data plane (build with `--features nixl` and make the NIXL library
//! findable, see `tier_p2p::nixl`).

use tier_p2p::bench::{self, P2pBenchConfig};

fn main() {
    let mut config = P2pBenchConfig::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--nixl" {
            config.nixl = true;
            continue;
        }
        if arg == "--keyed" {
            config.keyed = true;
            continue;
        }
        let value: Option<usize> = args.next().and_then(|v| v.parse().ok());
        match (arg.as_str(), value) {
            ("--total-mib", Some(v)) => config.total_bytes = v << 20,
            ("--rounds", Some(v)) => config.rounds = v,
            ("--chunk-mib", Some(v)) => config.chunk_bytes = vec![v << 20],
            _ => {
                eprintln!("usage: p2p_bench [--total-mib N] [--rounds N] [--chunk-mib N] [--nixl] [--keyed]");
                std::process::exit(2);
            }
        }
    }
    println!(
        "peer fetch over loopback TCP, {} MiB per pass, best of {} (GiB/s)",
        config.total_bytes >> 20,
        config.rounds
    );
    let rows = match bench::run(&config, &mut |line| eprintln!("{line}")) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("p2p_bench: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "{:>10} {:>6} {:>9} {:>9} {:>7} {:>7}",
        "path", "chunk", "raw tcp", "p2p", "ratio", "median"
    );
    for row in rows {
        println!(
            "{:>10} {:>4}Mi {:>9.2} {:>9.2} {:>7.2} {:>7.2}",
            row.op,
            row.chunk_bytes >> 20,
            row.ceiling_gib_per_s,
            row.gib_per_s,
            row.ratio(),
            row.round_ratio_median.unwrap_or(0.0)
        );
    }
}
