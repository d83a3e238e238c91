//! The `kvtier` command: `run` (the main job), `replay` (a Mooncake trace through the engine
//! simulator) and `bench` (the manager alone, and each data path against the machine's ceiling).
//! Bad flags and bad input are one-line errors naming what was wrong (exit status 2); a run that
//! found an integrity or invariant failure exits with status 1.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvtier::bench_data::{self, DataBenchReport};
use kvtier::bench_manager::{self, ManagerBenchConfig, ManagerTrace};
use kvtier::model::{ModelChoice, ModelPreset};
use kvtier::progress::Progress;
use offload_core::EvictionPolicy;

/// kvtier: KV-cache offload for LLM inference engines (host pool, disk, peers).
#[derive(Debug, Parser)]
#[command(name = "kvtier", version, about)]
struct Cli {
    /// Print one JSON object instead of the table (and no progress line).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The main job: a built-in workload on two engine instances (host pool, disk tier, each
    /// other as peer over loopback), every loaded block checked against recompute.
    Run(RunArgs),
    /// Replays a Mooncake-format JSONL trace through one engine instance on the connector.
    Replay(ReplayArgs),
    /// Benchmarks: the host-pool manager alone, or a data path against the machine's ceiling.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Replays a trace at the host-pool manager alone and counts block operations per second.
    Manager(ManagerArgs),
    /// The host copy path (engine memory <-> host pool) vs single-thread memcpy.
    Host(HostArgs),
    /// The disk tier vs raw O_DIRECT sequential I/O on the same directory.
    Fs(FsArgs),
    /// Peer fetch over loopback TCP vs a raw loopback socket with the same write size.
    P2p(P2pArgs),
}

#[derive(Debug, Args)]
struct HostArgs {
    /// Chunk sizes in KiB, comma-separated.
    #[arg(
        long,
        value_name = "LIST",
        default_value = "64,256,1024,2048,4096,8192"
    )]
    chunk_kib: String,
    /// MiB moved per job.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=65536))]
    total_mib: u64,
    /// Copy threads of the host path.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    threads: u64,
    /// Repetitions; the best is reported.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=1000))]
    reps: u64,
}

/// I/O engine names on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum FsEngineArg {
    /// io_uring where the kernel allows it, else plain syscalls.
    Auto,
    /// io_uring only.
    Uring,
    /// Plain pread/pwrite.
    Sync,
}

#[derive(Debug, Args)]
struct FsArgs {
    /// Directory on the disk to measure (not tmpfs); default: the system's temporary directory.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Chunk sizes in KiB, comma-separated.
    #[arg(long, value_name = "LIST", default_value = "256,1024,2048,4096,8192")]
    chunk_kib: String,
    /// MiB moved per pass.
    #[arg(long, value_name = "N", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1048576))]
    total_mib: u64,
    /// The tier's I/O engine.
    #[arg(long, value_enum, default_value = "auto")]
    engine: FsEngineArg,
    /// The tier's worker threads (default: the tier's).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=64))]
    workers: Option<u64>,
    /// Interleaved rounds of (raw at depth 1, raw at the tier's depth, tier) per chunk size; the
    /// best of each is reported, and the median of the rounds' own ratios (more rounds, a
    /// steadier median).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    rounds: u64,
}

#[derive(Debug, Args)]
struct P2pArgs {
    /// Chunk sizes in KiB, comma-separated.
    #[arg(long, value_name = "LIST", default_value = "1024,2048,4096,8192")]
    chunk_kib: String,
    /// MiB moved per pass and chunk size.
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=65536))]
    total_mib: u64,
    /// Alternating raw/tier rounds; the best of each is reported.
    #[arg(long, value_name = "N", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=1000))]
    rounds: u64,
    /// Also measure instances that share a secret (row op fetch-keyed): every DATA payload
    /// carries a keyed tag (BLAKE3 over a keyed POLYVAL of the payload), as between hosts.
    #[arg(long)]
    keyed: bool,
}

/// Eviction policy names on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum PolicyArg {
    /// Least recently used.
    Lru,
    /// Adaptive replacement cache.
    Arc,
}

impl From<PolicyArg> for EvictionPolicy {
    fn from(p: PolicyArg) -> Self {
        match p {
            PolicyArg::Lru => EvictionPolicy::Lru,
            PolicyArg::Arc => EvictionPolicy::Arc,
        }
    }
}

#[derive(Debug, Args)]
struct RunArgs {
    /// The connector's configuration file (TOML or JSON), used by both instances (each disk
    /// tier gets an `instance-N` subdirectory; a peer tier without listen/peers gets loopback
    /// ports, the other instance as its peer).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Conversations per instance (4 turns each).
    #[arg(long, value_name = "N", default_value_t = 12, value_parser = clap::value_parser!(u32).range(1..=10000))]
    conversations: u32,
    /// Seed of the workload and the simulator.
    #[arg(long, value_name = "S", default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    model: ModelArgs,
}

/// The model a run simulates and the assumptions that turn its loads into time.
#[derive(Debug, Args)]
struct ModelArgs {
    /// A real model's KV size: llama-3.2-1b, llama-3-8b, llama-3-70b, qwen3-8b, qwen3-32b,
    /// mistral-7b (run: llama-3-8b by default; replay: none, 32 bytes per token).
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// KV bytes per token (all layers, all workers); overrides the model's.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=16777216))]
    kv_bytes_per_token: Option<u32>,
    /// Effective prefill throughput in TFLOP/s, for the prefill time saved.
    #[arg(long, value_name = "TFLOPS", default_value_t = kvtier::model::PREFILL_FLOPS_DEFAULT / 1e12)]
    prefill_tflops: f64,
    /// Host-to-GPU bandwidth in GB/s, for the time loads take.
    #[arg(long, value_name = "GBPS", default_value_t = kvtier::model::LOAD_BYTES_PER_S_DEFAULT / 1e9)]
    load_gb_per_s: f64,
}

impl ModelArgs {
    /// The choice, with `default` as the preset when neither `--model` nor
    /// `--kv-bytes-per-token` was given.
    fn choice(&self, default: Option<ModelPreset>) -> Result<ModelChoice, Failure> {
        let preset = match &self.model {
            Some(name) => Some(kvtier::model::preset(name).map_err(Failure::Input)?),
            None if self.kv_bytes_per_token.is_some() => None,
            None => default,
        };
        Ok(ModelChoice {
            preset,
            kv_bytes_per_token: self.kv_bytes_per_token,
            prefill_flops: self.prefill_tflops * 1e12,
            load_bytes_per_s: self.load_gb_per_s * 1e9,
        })
    }
}

#[derive(Debug, Args)]
struct ReplayArgs {
    /// Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids).
    #[arg(long, value_name = "FILE")]
    trace: PathBuf,
    /// Tiers, comma-separated: cpu (required) and any of fs, p2p.
    #[arg(long, value_name = "LIST", default_value = "cpu,fs")]
    tiers: String,
    /// Host-pool bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 30)]
    cpu_bytes: u64,
    /// Disk tier directory (default: a temporary directory, removed at the end).
    #[arg(long, value_name = "DIR")]
    fs_dir: Option<PathBuf>,
    /// Disk tier capacity, bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 8 << 30)]
    fs_bytes: u64,
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens per engine block (need not divide the trace's 512-token blocks).
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=65536))]
    tokens_per_block: u32,
    /// Engine blocks per chunk.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    blocks_per_chunk: u32,
    /// Host-pool eviction policy.
    #[arg(long, value_enum, default_value = "lru")]
    eviction_policy: PolicyArg,
    /// vLLM's async scheduling (step N+1 scheduled before step N's output is handled).
    #[arg(long)]
    async_scheduling: bool,
    /// Offload only prompts.
    #[arg(long, value_name = "BOOL", default_value_t = false, action = clap::ArgAction::Set)]
    offload_prompt_only: bool,
    /// Tensor-parallel workers.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    workers: u32,
    /// Move (almost) no KV bytes: the scheduler path alone.
    #[arg(long)]
    no_data: bool,
    /// Replay only the first N requests.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Seed of the simulator's choices.
    #[arg(long, value_name = "S", default_value_t = 1)]
    seed: u64,
    /// Engine blocks in the GPU KV cache (default: enough for the largest request, at least 4096).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    gpu_blocks: Option<u32>,
    /// Simulated milliseconds per engine step (arrival step = timestamp / this).
    #[arg(long, value_name = "MS", default_value_t = 10.0)]
    ms_per_step: f64,
    /// Token budget per engine step.
    #[arg(long, value_name = "N", default_value_t = 8192, value_parser = clap::value_parser!(u32).range(1..))]
    max_num_batched_tokens: u32,
}

#[derive(Debug, Args)]
struct ManagerArgs {
    /// Mooncake-format JSONL trace.
    #[arg(long, value_name = "FILE")]
    trace: PathBuf,
    /// Host-pool slots (one per hash id).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    capacity_blocks: u32,
    /// Eviction policy.
    #[arg(long, value_enum, default_value = "lru")]
    policy: PolicyArg,
    /// Passes over the trace, each on a fresh pool; the median pass is reported.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    passes: u32,
    /// Read only the first N requests of the trace.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Also replay the trace at vLLM's CPUOffloadingManager with this script
    /// (crates/kvtier/scripts/bench_vllm_manager.py), one vLLM pass between each two blocks of
    /// kvtier's passes, and print both and their ratios (paired_ratio: the median of each vLLM
    /// pass against the kvtier passes beside it).
    #[arg(long, value_name = "SCRIPT")]
    compare_vllm: Option<PathBuf>,
    /// The Python that runs the --compare-vllm script (one with vllm installed).
    #[arg(long, value_name = "PYTHON", default_value = "python3")]
    python: PathBuf,
    /// Passes of the vLLM replay (each takes about a second on the Mooncake trace); --passes is
    /// raised to at least one more than this.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    vllm_passes: u32,
}

/// How a command ended when it did not succeed.
enum Failure {
    /// Bad input (flag, file, trace line, config): exit status 2.
    Input(String),
    /// The work ran and found failures (integrity, invariants): exit status 1.
    Check(String),
}

fn main() -> ExitCode {
    // The tiers log through `tracing`: warnings and errors to stderr unless KVTIER_LOG says more
    // or less (for example KVTIER_LOG=debug or KVTIER_LOG=off).
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVTIER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
                || matches!(
                    e.kind(),
                    ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
                )
            {
                let _ = e.print();
                return if e.use_stderr() {
                    ExitCode::from(2)
                } else {
                    ExitCode::SUCCESS
                };
            }
            eprintln!("kvtier: {}", one_line(&e.render().to_string()));
            return ExitCode::from(2);
        }
    };
    match dispatch(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Input(msg)) => {
            eprintln!("kvtier: {msg}");
            ExitCode::from(2)
        }
        Err(Failure::Check(msg)) => {
            eprintln!("kvtier: {msg}");
            ExitCode::from(1)
        }
    }
}

/// Clap's error as one line naming the flag: its first paragraph (the message, and for a missing
/// argument the indented names below it), joined.
fn one_line(text: &str) -> String {
    let words: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let line = words.join(" ");
    let line = line.trim_start_matches("error: ");
    if line.is_empty() {
        "bad arguments (see --help)".to_owned()
    } else {
        line.to_owned()
    }
}

fn dispatch(cli: &Cli) -> Result<(), Failure> {
    match &cli.command {
        Command::Run(args) => run_cmd(args, cli.json),
        Command::Replay(args) => replay_cmd(args, cli.json),
        Command::Bench {
            which: BenchCommand::Manager(args),
        } => bench_manager_cmd(args, cli.json),
        Command::Bench {
            which: BenchCommand::Host(args),
        } => bench_host_cmd(args, cli.json),
        Command::Bench {
            which: BenchCommand::Fs(args),
        } => bench_fs_cmd(args, cli.json),
        Command::Bench {
            which: BenchCommand::P2p(args),
        } => bench_p2p_cmd(args, cli.json),
    }
}

fn print_json<T: serde::Serialize>(value: &T) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Failure::Check(format!("cannot encode the report as JSON: {e}")))?;
    println!("{text}");
    Ok(())
}

fn bench_manager_cmd(args: &ManagerArgs, json: bool) -> Result<(), Failure> {
    let mut progress = Progress::new(!json);
    progress.set(&format!("reading {}", args.trace.display()));
    let records = engine_sim::trace::read_trace_file(&args.trace, args.limit.unwrap_or(usize::MAX))
        .map_err(|e| Failure::Input(e.to_string()))?;
    let trace = ManagerTrace::from_records(&records);
    drop(records);
    let config = ManagerBenchConfig {
        capacity_blocks: args.capacity_blocks,
        policy: args.policy.into(),
        passes: args.passes,
    };
    let Some(script) = &args.compare_vllm else {
        let report = bench_manager::run(&trace, &config, &mut |m| progress.set(m))
            .map_err(|e| Failure::Input(format!("--capacity-blocks: {e}")))?;
        progress.finish();
        return if json {
            print_json(&report)
        } else {
            print!("{}", bench_manager::render(&report));
            Ok(())
        };
    };
    let comparison = bench_manager::compare_vllm(
        &trace,
        &args.trace,
        args.limit,
        &config,
        &args.python,
        script,
        args.vllm_passes,
        &mut |m| progress.set(m),
    )
    .map_err(|e| match e {
        bench_manager::CompareError::Kvtier(e) => Failure::Input(format!("--capacity-blocks: {e}")),
        bench_manager::CompareError::Vllm(e) => Failure::Input(format!("--compare-vllm: {e}")),
    })?;
    progress.finish();
    if json {
        print_json(&comparison)
    } else {
        print!("{}", bench_manager::render_comparison(&comparison));
        Ok(())
    }
}

fn print_data_report(report: &DataBenchReport, json: bool) -> Result<(), Failure> {
    if json {
        print_json(report)
    } else {
        print!("{}", bench_data::render(report));
        Ok(())
    }
}

fn bench_host_cmd(args: &HostArgs, json: bool) -> Result<(), Failure> {
    let config = tier_gpu::bench::HostBenchConfig {
        total_bytes: (args.total_mib << 20) as usize,
        chunk_sizes: bench_data::parse_kib_list(&args.chunk_kib, "--chunk-kib")
            .map_err(Failure::Input)?,
        threads: args.threads as usize,
        reps: args.reps as usize,
    };
    let mut progress = Progress::new(!json);
    let rows = tier_gpu::bench::run(&config, &mut |m| progress.set(m))
        .map_err(|e| Failure::Check(format!("bench host: {e}")))?;
    progress.finish();
    let ceiling = "single-thread memcpy of the same chunks";
    print_data_report(&DataBenchReport::new("host", ceiling, &rows), json)
}

fn bench_fs_cmd(args: &FsArgs, json: bool) -> Result<(), Failure> {
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let mut config = tier_fs::bench::FsBenchConfig::new(dir);
    config.chunk_sizes =
        bench_data::parse_kib_list(&args.chunk_kib, "--chunk-kib").map_err(Failure::Input)?;
    config.total_bytes = args.total_mib << 20;
    config.engine = match args.engine {
        FsEngineArg::Auto => tier_fs::EngineChoice::Auto,
        FsEngineArg::Uring => tier_fs::EngineChoice::Uring,
        FsEngineArg::Sync => tier_fs::EngineChoice::Sync,
    };
    if let Some(w) = args.workers {
        config.workers = w as usize;
    }
    config.repeats = args.rounds as usize;
    let mut progress = Progress::new(!json);
    let rows = tier_fs::bench::run(&config, &mut |m| progress.set(m))
        .map_err(|e| Failure::Check(format!("bench fs: {e}")))?;
    progress.finish();
    let ceiling = "raw O_DIRECT sequential I/O in the same directory";
    print_data_report(&DataBenchReport::new("fs", ceiling, &rows), json)
}

fn bench_p2p_cmd(args: &P2pArgs, json: bool) -> Result<(), Failure> {
    let config = tier_p2p::bench::P2pBenchConfig {
        total_bytes: (args.total_mib << 20) as usize,
        chunk_bytes: bench_data::parse_kib_list(&args.chunk_kib, "--chunk-kib")
            .map_err(Failure::Input)?,
        rounds: args.rounds as usize,
        keyed: args.keyed,
        ..tier_p2p::bench::P2pBenchConfig::default()
    };
    let mut progress = Progress::new(!json);
    let detailed = tier_p2p::bench::run_detailed(&config, &mut |m| progress.set(m))
        .map_err(|e| Failure::Check(format!("bench p2p: {e}")))?;
    progress.finish();
    let ceiling = "raw loopback TCP socket with the same write size";
    let cpu: Vec<bench_data::CpuRow> = detailed
        .iter()
        .map(|r| bench_data::CpuRow {
            path: r.cpu.path_s,
            ceiling: r.cpu.ceiling_s,
        })
        .collect();
    let rows: Vec<_> = detailed.into_iter().map(|r| r.row).collect();
    let report = DataBenchReport::with_cpu("p2p", ceiling, &rows, &cpu);
    print_data_report(&report, json)
}

fn print_run_report(report: &kvtier::instance::RunReport, json: bool) -> Result<(), Failure> {
    if json {
        print_json(report)?;
    } else {
        print!("{}", kvtier::instance::render(report));
    }
    if report.is_clean() {
        Ok(())
    } else {
        Err(Failure::Check(format!(
            "{} integrity failures, {} store mismatches, {} GPU corruptions, {} invariant failures",
            report.integrity_failures,
            report.store_mismatches,
            report.gpu_corruptions,
            report.invariant_failures
        )))
    }
}

fn run_cmd(args: &RunArgs, json: bool) -> Result<(), Failure> {
    let spec = kvtier::run::RunSpec {
        conversations: args.conversations,
        seed: args.seed,
        model: args.model.choice(Some(kvtier::run::default_model()))?,
        ..kvtier::run::RunSpec::default()
    };
    let mut progress = Progress::new(!json);
    let report = kvtier::run::run(&spec, args.config.as_deref(), &mut |done, total| {
        progress.bar("requests finished", done, total)
    })
    .map_err(Failure::Input)?;
    progress.finish();
    print_run_report(&report, json)
}

fn replay_cmd(args: &ReplayArgs, json: bool) -> Result<(), Failure> {
    let spec = kvtier::replay::ReplaySpec {
        trace: args.trace.clone(),
        tiers: args.tiers.split(',').map(|t| t.trim().to_owned()).collect(),
        cpu_bytes: args.cpu_bytes,
        fs_dir: args.fs_dir.clone(),
        fs_bytes: args.fs_bytes,
        model: args.model.choice(None)?,
        tokens_per_block: args.tokens_per_block,
        blocks_per_chunk: args.blocks_per_chunk,
        eviction_policy: EvictionPolicy::from(args.eviction_policy).name().into(),
        async_scheduling: args.async_scheduling,
        offload_prompt_only: args.offload_prompt_only,
        workers: args.workers,
        no_data: args.no_data,
        limit: args.limit,
        seed: args.seed,
        gpu_blocks: args.gpu_blocks,
        ms_per_step: args.ms_per_step,
        max_num_batched_tokens: args.max_num_batched_tokens,
    };
    let mut progress = Progress::new(!json);
    let report = kvtier::replay::replay(&spec, &mut |done, total| {
        progress.bar("requests finished", done, total)
    })
    .map_err(Failure::Input)?;
    progress.finish();
    print_run_report(&report, json)
}
