//! Wires the engine simulator to the connector's engine-facing API: a configuration file (TOML or
//! JSON, the reference's keys) is checked against the simulated engine's geometry, its tiering
//! manager (host pool plus the secondary tiers it names) is built over the simulator's host-pool
//! bytes, and the simulator drives a [`connector::SchedulerHandle`] over it. Requests share one
//! prefix that background traffic evicts from the GPU and from the small host pool, so later
//! requests promote it back from disk; every loaded block is compared with recompute. Prints the
//! report summary, the KV event counts and the Prometheus metrics; exits non-zero on any
//! integrity or invariant failure.
//!
//! Usage: `cargo run -p engine-sim --features fs --example tiered -- [CONFIG.toml|CONFIG.json]`.
//! Without a file it uses a built-in configuration: 40 host slots and, when the `fs` feature is
//! on, a disk tier in a fresh directory under the system's temporary directory.

use std::process::ExitCode;

use connector::config::{ConnectorConfig, EngineGeometry};
use engine_sim::host::HostMemory;
use engine_sim::{RequestSpec, SharedPrefix, Sim, SimConfig, Workload};

fn workload() -> Workload {
    let prefix = SharedPrefix { id: 5, tokens: 512 };
    let request =
        |arrival: u64, prefix: Option<SharedPrefix>, unique: u32, seed: u64| RequestSpec {
            arrival_step: arrival,
            prefix,
            segments: Vec::new(),
            unique_tokens: unique,
            seed,
            max_tokens: 4,
            abort_step: None,
            max_offload_tokens: None,
        };
    let mut w = Workload::default();
    w.requests.push(request(0, Some(prefix), 64, 1));
    for k in 0..8u64 {
        w.requests.push(request(10 + 4 * k, None, 2048, 100 + k));
    }
    w.requests.push(request(400, Some(prefix), 64, 2));
    w
}

fn default_config(dir: &std::path::Path) -> String {
    let tiers = if cfg!(feature = "fs") {
        format!(
            "secondary_tiers = [{{ type = \"fs\", root_dir = {:?}, capacity_bytes = 67108864 }}]\n",
            dir.display().to_string()
        )
    } else {
        String::new()
    };
    format!(
        "cpu_bytes_to_use = {}\nblock_size = 64\neviction_policy = \"lru\"\n\
         offload_prompt_only = false\n{tiers}",
        40 * 4 * 256
    )
}

fn run() -> Result<bool, String> {
    let dir = std::env::temp_dir().join(format!("kvtier-tiered-example-{}", std::process::id()));
    let config = match std::env::args().nth(1) {
        Some(path) => ConnectorConfig::from_path(std::path::Path::new(&path)),
        None => ConnectorConfig::from_toml_str(&default_config(&dir)),
    }
    .map_err(|e| e.to_string())?;
    let base = SimConfig {
        async_scheduling: true,
        worker_count: 2,
        num_gpu_blocks: 160,
        ..SimConfig::default()
    };
    let engine = EngineGeometry {
        worker_count: base.worker_count,
        ..EngineGeometry::new(
            "engine-sim",
            base.tokens_per_block,
            u64::from(base.block_bytes),
        )
    };
    let resolved = config.resolve(&engine).map_err(|e| e.to_string())?;
    let sim_config = SimConfig {
        blocks_per_chunk: resolved.scheduler.blocks_per_chunk,
        host_slots: resolved.pool.slot_count,
        offload_prompt_only: resolved.scheduler.offload_prompt_only,
        offload_policy: resolved.scheduler.policy,
        eviction: resolved.pool.policy,
        reuse_threshold: resolved.pool.reuse_threshold,
        ..base
    };
    let host = HostMemory::new(sim_config.host_slots, sim_config.slot_bytes());
    let manager = resolved
        .build_manager(host.slot_memory(), true)
        .map_err(|e| e.to_string())?;
    let mut sim =
        Sim::with_handle(sim_config, workload(), manager, host).map_err(|e| e.to_string())?;
    while !sim.is_done() && sim.current_step() < 100_000 {
        sim.step();
        // A real engine's step takes longer than a disk write; let the tiers keep up.
        sim.handle_mut().drain_tiers();
    }
    let report = sim.run_to_completion(1000).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "steps {} requests {} tokens computed {} loaded {} (loads ok {}, failed {}) integrity failures {} invariant failures {}",
        report.steps,
        report.requests_finished,
        report.tokens_computed,
        report.tokens_loaded,
        report.loads_ok,
        report.loads_failed,
        report.integrity_failures,
        report.invariant_failures
    );
    println!(
        "KV events: {} stored, {} removed (host pool and tiers)",
        report.events_stored, report.events_removed
    );
    print!("{}", sim.handle().prometheus_text());
    Ok(report.is_clean())
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("integrity or invariant failures (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
