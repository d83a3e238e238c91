//! `kvtier replay`: a Mooncake-format trace through one simulated engine instance on the
//! connector, with the tiers and geometry given on the command line. Requests arrive in timestamp
//! order (`ms_per_step` simulated milliseconds per engine step; the simulated clock runs as fast
//! as the machine allows).

use std::path::{Path, PathBuf};

use connector::config::ConnectorConfig;
use engine_sim::trace::{self, TraceOptions};

use crate::instance::{self, EngineShape, RunReport};
use crate::model::ModelChoice;
use crate::run::TempDir;

/// KV bytes per token without `--model` or `--kv-bytes-per-token` (small, so that a whole trace
/// replays in memory; not a real model's size).
pub const KV_BYTES_PER_TOKEN_DEFAULT: u32 = 32;

/// Everything `kvtier replay` takes.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplaySpec {
    /// The trace.
    pub trace: PathBuf,
    /// Tiers: `cpu` (required: the host pool), and any of `fs`, `p2p`.
    pub tiers: Vec<String>,
    /// Host-pool bytes.
    pub cpu_bytes: u64,
    /// Disk tier directory (default: a temporary directory, removed at the end).
    pub fs_dir: Option<PathBuf>,
    /// Disk tier capacity in bytes.
    pub fs_bytes: u64,
    /// The model (`--model`, `--kv-bytes-per-token`); without either, 32 bytes per token move
    /// and no time is reported.
    pub model: ModelChoice,
    /// Tokens per engine block.
    pub tokens_per_block: u32,
    /// Engine blocks per chunk.
    pub blocks_per_chunk: u32,
    /// `lru` or `arc`.
    pub eviction_policy: String,
    /// vLLM's async scheduling.
    pub async_scheduling: bool,
    /// Offload only prompts.
    pub offload_prompt_only: bool,
    /// Tensor-parallel workers.
    pub workers: u32,
    /// No KV bytes to speak of: one byte per token and worker, no per-request verification.
    pub no_data: bool,
    /// Replay only the first N requests.
    pub limit: Option<usize>,
    /// Seed of the simulator's choices.
    pub seed: u64,
    /// Engine blocks in the GPU KV cache (default: enough for the largest request, at least
    /// 4096).
    pub gpu_blocks: Option<u32>,
    /// Simulated milliseconds per engine step.
    pub ms_per_step: f64,
    /// Token budget per step.
    pub max_num_batched_tokens: u32,
}

impl ReplaySpec {
    /// The defaults for `trace`.
    pub fn new(trace: PathBuf) -> Self {
        Self {
            trace,
            tiers: vec!["cpu".into(), "fs".into()],
            cpu_bytes: 1 << 30,
            fs_dir: None,
            fs_bytes: 8 << 30,
            model: ModelChoice::default(),
            tokens_per_block: 16,
            blocks_per_chunk: 4,
            eviction_policy: "lru".into(),
            async_scheduling: false,
            offload_prompt_only: false,
            workers: 1,
            no_data: false,
            limit: None,
            seed: 1,
            gpu_blocks: None,
            ms_per_step: 10.0,
            max_num_batched_tokens: 8192,
        }
    }
}

/// The connector configuration (TOML) the flags describe.
pub fn config_text(spec: &ReplaySpec, fs_dir: &Path) -> Result<String, String> {
    let mut tiers = Vec::new();
    let mut cpu = false;
    for t in &spec.tiers {
        match t.as_str() {
            "cpu" => cpu = true,
            "fs" => tiers.push(format!(
                "{{ type = \"fs\", root_dir = {:?}, capacity_bytes = {} }}",
                fs_dir.display().to_string(),
                spec.fs_bytes
            )),
            "p2p" => tiers.push("{ type = \"p2p\" }".to_owned()),
            other => {
                return Err(format!(
                    "--tiers: unknown tier {other:?}; expected any of cpu,fs,p2p"
                ))
            }
        }
    }
    if !cpu {
        return Err(
            "--tiers: cpu (the host pool) is required; every other tier sits behind it".into(),
        );
    }
    if !matches!(spec.eviction_policy.as_str(), "lru" | "arc") {
        return Err(format!(
            "--eviction-policy: {:?} is not lru or arc",
            spec.eviction_policy
        ));
    }
    Ok(format!(
        "cpu_bytes_to_use = {}\nblocks_per_chunk = {}\neviction_policy = \"{}\"\n\
         offload_prompt_only = {}\nsecondary_tiers = [{}]\n",
        spec.cpu_bytes,
        spec.blocks_per_chunk,
        spec.eviction_policy,
        spec.offload_prompt_only,
        tiers.join(", ")
    ))
}

/// Replays the trace; `progress` hears finished and total requests.
pub fn replay(spec: &ReplaySpec, progress: &mut dyn FnMut(u64, u64)) -> Result<RunReport, String> {
    let started = std::time::Instant::now();
    if spec.tokens_per_block == 0 {
        return Err("--tokens-per-block: must be at least 1".into());
    }
    if spec.workers == 0 || spec.workers > 64 {
        return Err("--workers: must be 1 to 64".into());
    }
    if spec.ms_per_step.is_nan() || spec.ms_per_step <= 0.0 {
        return Err("--ms-per-step: must be positive".into());
    }
    let records = trace::read_trace_file(&spec.trace, spec.limit.unwrap_or(usize::MAX))
        .map_err(|e| e.to_string())?;
    let workload = trace::to_workload(
        &records,
        &TraceOptions {
            ms_per_step: spec.ms_per_step,
            seed: spec.seed,
        },
    );
    drop(records);
    let largest = workload
        .requests
        .iter()
        .map(|r| u64::from(r.prompt_len()) + u64::from(r.max_tokens) + 1)
        .max()
        .unwrap_or(1)
        .div_ceil(u64::from(spec.tokens_per_block));
    let gpu_blocks = match spec.gpu_blocks {
        Some(n) => n,
        None => u32::try_from((largest + largest / 4).max(4096))
            .map_err(|_| "the largest request needs more than 2^32 GPU blocks".to_owned())?,
    };
    let temp = match &spec.fs_dir {
        Some(_) => None,
        None => Some(TempDir::new("replay")?),
    };
    let fs_dir = spec
        .fs_dir
        .clone()
        .or_else(|| temp.as_ref().map(|t| t.0.clone()))
        .unwrap_or_else(std::env::temp_dir);
    let config =
        ConnectorConfig::from_toml_str(&config_text(spec, &fs_dir)?).map_err(|e| e.to_string())?;
    let cost = spec.model.cost(KV_BYTES_PER_TOKEN_DEFAULT)?;
    let kv_bytes_per_token = if spec.no_data {
        spec.workers
    } else {
        cost.kv_bytes_per_token
    };
    let shape = EngineShape {
        tokens_per_block: spec.tokens_per_block,
        kv_bytes_per_token,
        workers: spec.workers,
        gpu_blocks,
        max_num_batched_tokens: spec.max_num_batched_tokens,
        max_num_seqs: 64,
        async_scheduling: spec.async_scheduling,
        verify_requests: !spec.no_data,
        seed: spec.seed,
    };
    let sim = instance::build(&config, &shape, workload)?;
    let mut sims = [sim];
    let reports = instance::drive(&mut sims, u64::MAX, progress)?;
    let parts: Vec<_> = sims.iter().zip(&reports).collect();
    let mut report = instance::summarize(&parts, started.elapsed().as_secs_f64(), cost);
    if spec.tiers.iter().any(|t| t == "p2p") {
        report.notes.push(
            "replay runs one instance: its p2p tier publishes for peers and has no peer to fetch from"
                .into(),
        );
    }
    if spec.no_data {
        report.notes.push(format!(
            "--no-data: one byte per token and worker moves (the load time above is for {} bytes \
             per token); per-request verification is off",
            report.cost.kv_bytes_per_token
        ));
    }
    drop(sims);
    drop(temp);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_become_a_connector_config() {
        let mut spec = ReplaySpec::new("t".into());
        spec.tiers = vec!["cpu".into(), "fs".into(), "p2p".into()];
        spec.eviction_policy = "arc".into();
        let text = config_text(&spec, Path::new("/d")).unwrap();
        let c = ConnectorConfig::from_toml_str(&text).unwrap();
        assert_eq!(c.cpu_bytes_to_use, 1 << 30);
        assert_eq!(c.blocks_per_chunk, Some(4));
        assert_eq!(c.secondary_tiers.len(), 2);

        spec.tiers = vec!["fs".into()];
        assert!(config_text(&spec, Path::new("/d"))
            .unwrap_err()
            .contains("--tiers"));
        spec.tiers = vec!["cpu".into(), "tape".into()];
        assert!(config_text(&spec, Path::new("/d"))
            .unwrap_err()
            .contains("tape"));
        spec.tiers = vec!["cpu".into()];
        spec.eviction_policy = "fifo".into();
        assert!(config_text(&spec, Path::new("/d"))
            .unwrap_err()
            .contains("--eviction-policy"));
    }
}
