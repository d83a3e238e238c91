//! One simulated engine instance wired to the connector: a connector configuration (the
//! connector's own file format) resolved against the simulated engine's geometry, its tiering
//! manager (host pool plus the secondary tiers the configuration names) built over the
//! simulator's host-pool bytes, and the engine simulator driving a `SchedulerHandle` over it.
//! [`TimedManager`] records the host pool's store and load latencies for p50/p99.
//! [`RunReport`] is what `kvtier run` and `kvtier replay` print.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use connector::config::{ConnectorConfig, EngineGeometry};
use connector::{AsTiering, TieringManager};
use engine_sim::host::HostMemory;
use engine_sim::{Sim, SimConfig, SimReport, Workload};
use offload_core::{
    ChunkKey, CoreError, KvEvent, LookupResult, OffloadManager, PreparedStore, RequestId, SlotId,
};
use serde::Serialize;

use crate::model::{CostModel, Savings};

/// The simulator type every instance runs.
pub type InstanceSim = Sim<engine_sim::connector::KvHandle<TimedManager>>;

/// Latency samples kept per direction (the oldest are dropped beyond it).
const SAMPLES_MAX: usize = 1 << 20;

/// A [`TieringManager`] that records, per chunk, the time from `prepare_store` to
/// `complete_store` and from `prepare_load` to `complete_load` (what the host pool's transfers
/// take as the engine sees them, including the steps a transfer waits for).
pub struct TimedManager {
    inner: TieringManager,
    store_started: BTreeMap<ChunkKey, Instant>,
    load_started: BTreeMap<ChunkKey, VecDeque<Instant>>,
    /// Store latencies, microseconds.
    pub store_us: Vec<u64>,
    /// Load latencies, microseconds.
    pub load_us: Vec<u64>,
}

impl TimedManager {
    /// Wraps `inner`.
    pub fn new(inner: TieringManager) -> Self {
        Self {
            inner,
            store_started: BTreeMap::new(),
            load_started: BTreeMap::new(),
            store_us: Vec::new(),
            load_us: Vec::new(),
        }
    }
}

fn push_sample(samples: &mut Vec<u64>, since: Instant) {
    if samples.len() < SAMPLES_MAX {
        samples.push(since.elapsed().as_micros() as u64);
    }
}

impl OffloadManager for TimedManager {
    fn lookup(&mut self, key: ChunkKey, request: RequestId) -> LookupResult {
        self.inner.lookup(key, request)
    }

    fn prepare_load(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        slots: &mut Vec<SlotId>,
    ) -> Result<(), CoreError> {
        self.inner.prepare_load(keys, request, slots)?;
        let now = Instant::now();
        for &k in keys {
            self.load_started.entry(k).or_default().push_back(now);
        }
        Ok(())
    }

    fn complete_load(&mut self, keys: &[ChunkKey]) {
        for k in keys {
            if let Some(q) = self.load_started.get_mut(k) {
                if let Some(t) = q.pop_front() {
                    push_sample(&mut self.load_us, t);
                }
                if q.is_empty() {
                    self.load_started.remove(k);
                }
            }
        }
        self.inner.complete_load(keys);
    }

    fn touch(&mut self, keys: &[ChunkKey], request: RequestId) {
        self.inner.touch(keys, request);
    }

    fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        out: &mut PreparedStore,
    ) -> Result<(), CoreError> {
        self.inner.prepare_store(keys, request, out)?;
        let now = Instant::now();
        for &k in &out.keys {
            self.store_started.insert(k, now);
        }
        Ok(())
    }

    fn complete_store(&mut self, keys: &[ChunkKey], success: bool) {
        for k in keys {
            if let Some(t) = self.store_started.remove(k) {
                if success {
                    push_sample(&mut self.store_us, t);
                }
            }
        }
        self.inner.complete_store(keys, success);
    }

    fn on_request_finished(&mut self, request: RequestId) {
        self.inner.on_request_finished(request);
    }

    fn reset(&mut self) {
        self.store_started.clear();
        self.load_started.clear();
        self.inner.reset();
    }

    fn release_held(&mut self, slots: &[SlotId]) {
        self.inner.release_held(slots);
    }

    fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        self.inner.take_events(out);
    }
}

impl AsTiering for TimedManager {
    fn tiering(&self) -> &TieringManager {
        &self.inner
    }
    fn tiering_mut(&mut self) -> &mut TieringManager {
        &mut self.inner
    }
}

/// The simulated engine's shape, beyond what the connector's configuration says.
#[derive(Clone, Debug)]
pub struct EngineShape {
    /// Tokens per engine block.
    pub tokens_per_block: u32,
    /// KV bytes per token (every layer, every worker's shard).
    pub kv_bytes_per_token: u32,
    /// Tensor-parallel workers.
    pub workers: u32,
    /// Engine blocks in the GPU KV cache.
    pub gpu_blocks: u32,
    /// Token budget per step.
    pub max_num_batched_tokens: u32,
    /// Most running requests.
    pub max_num_seqs: u32,
    /// vLLM's async scheduling.
    pub async_scheduling: bool,
    /// Verify each request's whole KV when it finishes (off for the scheduler-path-only mode).
    pub verify_requests: bool,
    /// Seed of the simulator's choices.
    pub seed: u64,
}

/// Builds one instance: the configuration resolved against `shape`, its tiers started over the
/// simulator's host memory, and the simulator over `workload`. Errors name the bad key.
pub fn build(
    config: &ConnectorConfig,
    shape: &EngineShape,
    workload: Workload,
) -> Result<InstanceSim, String> {
    let block_bytes = u64::from(shape.kv_bytes_per_token) * u64::from(shape.tokens_per_block);
    let block_bytes_u32 = u32::try_from(block_bytes).map_err(|_| {
        format!("--kv-bytes-per-token: {block_bytes} bytes per engine block is too many")
    })?;
    let engine = EngineGeometry {
        worker_count: shape.workers,
        ..EngineGeometry::new("kvtier-sim", shape.tokens_per_block, block_bytes)
    };
    let resolved = config.resolve(&engine).map_err(|e| e.to_string())?;
    let sim_config = SimConfig {
        seed: shape.seed,
        tokens_per_block: shape.tokens_per_block,
        blocks_per_chunk: resolved.scheduler.blocks_per_chunk,
        block_bytes: block_bytes_u32,
        num_gpu_blocks: shape.gpu_blocks,
        host_slots: resolved.pool.slot_count,
        worker_count: shape.workers,
        async_scheduling: shape.async_scheduling,
        max_num_batched_tokens: shape.max_num_batched_tokens,
        max_num_seqs: shape.max_num_seqs,
        offload_policy: resolved.scheduler.policy,
        offload_prompt_only: resolved.scheduler.offload_prompt_only,
        eviction: resolved.pool.policy,
        reuse_threshold: resolved.pool.reuse_threshold,
        // Count failures (and exit non-zero) rather than panic.
        strict: false,
        verify_requests: shape.verify_requests,
        call_log_max: 0,
        ..SimConfig::default()
    };
    let host = HostMemory::new(sim_config.host_slots, sim_config.slot_bytes());
    let manager = resolved
        .build_manager(host.slot_memory(), false)
        .map_err(|e| e.to_string())?;
    Sim::with_handle(sim_config, workload, TimedManager::new(manager), host)
        .map_err(|e| e.to_string())
}

/// Types of the secondary tiers a configuration lists (`fs`, `p2p`, ...), in order.
pub fn tier_kinds(config: &ConnectorConfig) -> Vec<&str> {
    config
        .secondary_tiers
        .iter()
        .map(|t| t.type_name.as_str())
        .collect()
}

/// One tier's line of the report, summed over instances.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TierLine {
    /// `cpu` (the host pool), or the secondary tier's name.
    pub name: String,
    /// Host pool: chunks that requests' prefix lookups found there and loaded (load jobs built;
    /// a chunk looked up again while its request waited counts once). Secondary tiers: lookups
    /// they answered after a host-pool miss.
    pub hits: u64,
    /// Chunks stored.
    pub stores: u64,
    /// Chunks loaded (host pool: into the GPU; secondary tiers: promoted into the host pool).
    pub loads: u64,
    /// Bytes stored.
    pub bytes_stored: u64,
    /// Bytes loaded.
    pub bytes_loaded: u64,
    /// Tokens whose KV this tier provided (host pool: loaded into the GPU, the report's
    /// `tokens_loaded`; secondary tiers: promoted into the host pool, counted as chunks times
    /// tokens per chunk, and a promoted chunk may be evicted again before the engine reads it).
    pub tokens_served: u64,
}

/// What `kvtier run` and `kvtier replay` report (their `--json` output).
///
/// The prompt split is exact: `prompt_tokens = prompt_tokens_gpu_cached + prompt_tokens_loaded +
/// prompt_tokens_computed + prompt_tokens_unserved`, each prompt position of each request counted
/// once, where its KV came from the first time. What a request got again after a preemption is
/// counted apart (`tokens_*_again`, `tokens_recomputed`), and `tokens_computed =
/// prompt_tokens_computed + decode_tokens_computed + tokens_recomputed`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RunReport {
    /// Engine instances (`run`: two, peers of each other; `replay`: one).
    pub instances: u32,
    /// Requests in the workload.
    pub requests_total: u64,
    /// Requests that finished normally.
    pub requests_finished: u64,
    /// Requests aborted.
    pub requests_aborted: u64,
    /// Prompt tokens of the requests.
    pub prompt_tokens: u64,
    /// Prompt tokens the workload lets a cache serve at best (each request's longest prefix of
    /// full blocks that an earlier-arriving request also had, short of its last token).
    pub prompt_tokens_reusable: u64,
    /// Prompt tokens whose KV first came from the engine's GPU prefix cache.
    pub prompt_tokens_gpu_cached: u64,
    /// Prompt tokens whose KV first came from a kvtier load.
    pub prompt_tokens_loaded: u64,
    /// Prompt tokens the engine computed (the first time).
    pub prompt_tokens_computed: u64,
    /// Prompt tokens of aborted requests that never had KV.
    pub prompt_tokens_unserved: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Tokens a preempted request had before and got back from the GPU prefix cache.
    pub tokens_gpu_cached_again: u64,
    /// Tokens a preempted request had before and got back from a kvtier load.
    pub tokens_loaded_again: u64,
    /// Tokens a preempted request had before and computed again.
    pub tokens_recomputed: u64,
    /// Tokens past the prompt computed (decode).
    pub decode_tokens_computed: u64,
    /// Tokens past the prompt whose KV first came from a cache (another request sampled the same).
    pub decode_tokens_reused: u64,
    /// Tokens the engine computed in all.
    pub tokens_computed: u64,
    /// Tokens kvtier loaded into the GPU in all (first time, again, and decode reuse).
    pub tokens_loaded: u64,
    /// The stated assumptions behind `savings`.
    pub cost: CostModel,
    /// What kvtier's loads saved under `cost`.
    pub savings: Savings,
    /// Engine steps (summed over instances).
    pub steps: u64,
    /// Per tier, summed over instances.
    pub tiers: Vec<TierLine>,
    /// Host-pool store latency (prepare to complete, as the engine sees it), p50, microseconds.
    pub store_latency_us_p50: u64,
    /// Host-pool store latency, p99, microseconds.
    pub store_latency_us_p99: u64,
    /// Host-pool load latency, p50, microseconds.
    pub load_latency_us_p50: u64,
    /// Host-pool load latency, p99, microseconds.
    pub load_latency_us_p99: u64,
    /// Loaded blocks whose bytes differed from recompute (must be 0).
    pub integrity_failures: u64,
    /// Stores that copied other bytes than the model's (must be 0).
    pub store_mismatches: u64,
    /// Requests whose GPU KV was corrupted (must be 0).
    pub gpu_corruptions: u64,
    /// Broken contract rules (must be 0).
    pub invariant_failures: u64,
    /// The first failure messages.
    pub failures: Vec<String>,
    /// Wall-clock seconds of the whole run.
    pub elapsed_s: f64,
    /// What this run did not do (for example a peer tier with no peer).
    pub notes: Vec<String>,
}

impl RunReport {
    /// No integrity failure, store mismatch, GPU corruption or invariant failure.
    pub fn is_clean(&self) -> bool {
        self.integrity_failures == 0
            && self.store_mismatches == 0
            && self.gpu_corruptions == 0
            && self.invariant_failures == 0
    }

    /// Prompt tokens that were not computed the first time (GPU prefix cache or kvtier).
    pub fn prompt_tokens_hit(&self) -> u64 {
        self.prompt_tokens_gpu_cached + self.prompt_tokens_loaded
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn tier_line<'a>(lines: &'a mut Vec<TierLine>, name: &str) -> &'a mut TierLine {
    let i = match lines.iter().position(|l| l.name == name) {
        Some(i) => i,
        None => {
            lines.push(TierLine {
                name: name.to_owned(),
                ..TierLine::default()
            });
            lines.len() - 1
        }
    };
    &mut lines[i]
}

/// Adds one simulator's token counters to `r`.
fn add_tokens(r: &mut RunReport, rep: &SimReport) {
    r.requests_total += rep.requests_total;
    r.requests_finished += rep.requests_finished;
    r.requests_aborted += rep.requests_aborted;
    r.prompt_tokens += rep.prompt_tokens;
    r.prompt_tokens_reusable += rep.prompt_tokens_reusable;
    r.prompt_tokens_gpu_cached += rep.prompt_tokens_gpu_cached;
    r.prompt_tokens_loaded += rep.prompt_tokens_loaded;
    r.prompt_tokens_computed += rep.prompt_tokens_computed;
    r.prompt_tokens_unserved += rep.prompt_tokens_unserved;
    r.preemptions += rep.preemptions;
    r.tokens_gpu_cached_again += rep.tokens_gpu_cached_again;
    r.tokens_loaded_again += rep.tokens_loaded_again;
    r.tokens_recomputed += rep.tokens_recomputed;
    r.decode_tokens_computed += rep.decode_tokens_computed;
    r.decode_tokens_reused += rep.decode_tokens_reused;
    r.tokens_computed += rep.tokens_computed;
    r.tokens_loaded += rep.tokens_loaded;
}

/// Sums the finished instances' reports into one; `cost` turns the loaded tokens into time.
pub fn summarize(
    parts: &[(&InstanceSim, &SimReport)],
    elapsed_s: f64,
    cost: CostModel,
) -> RunReport {
    let mut r = RunReport {
        instances: parts.len() as u32,
        elapsed_s,
        ..RunReport::default()
    };
    let (mut store_us, mut load_us) = (Vec::new(), Vec::new());
    for (sim, rep) in parts {
        add_tokens(&mut r, rep);
        r.steps += rep.steps;
        r.integrity_failures += rep.integrity_failures;
        r.store_mismatches += rep.store_mismatches;
        r.gpu_corruptions += rep.gpu_corruptions;
        r.invariant_failures += rep.invariant_failures;
        r.failures.extend(rep.failures.iter().take(8).cloned());
        let handle = sim.handle();
        let metrics = handle.metrics();
        r.invariant_failures += metrics.tiering.invariant_failures;
        let cfg = sim.config();
        let tokens_per_chunk = u64::from(cfg.tokens_per_block * cfg.blocks_per_chunk);
        let t = &metrics.tiering;
        let cpu = tier_line(&mut r.tiers, connector::HOST_TIER_NAME);
        // Chunks the requests' prefix lookups found here and took (load jobs built), each once
        // per load: the host pool's own `lookup_hits` counts every lookup, and vLLM's scheduler
        // (as engine-sim's) looks a waiting request up again every step.
        cpu.hits += metrics.scheduler.chunks_load_submitted;
        cpu.stores += t.host_chunks_stored;
        cpu.loads += t.host_chunks_loaded;
        cpu.bytes_stored += t.host_bytes_stored;
        cpu.bytes_loaded += t.host_bytes_loaded;
        cpu.tokens_served += rep.tokens_loaded;
        for (name, c) in &metrics.tiers {
            let line = tier_line(&mut r.tiers, name);
            line.hits += c.hits;
            line.stores += c.chunks_stored;
            line.loads += c.chunks_loaded;
            line.bytes_stored += c.bytes_stored;
            line.bytes_loaded += c.bytes_loaded;
            line.tokens_served += c.chunks_loaded * tokens_per_chunk;
        }
        let timed = handle.manager().inner();
        store_us.extend_from_slice(&timed.store_us);
        load_us.extend_from_slice(&timed.load_us);
    }
    store_us.sort_unstable();
    load_us.sort_unstable();
    r.store_latency_us_p50 = percentile(&store_us, 0.5);
    r.store_latency_us_p99 = percentile(&store_us, 0.99);
    r.load_latency_us_p50 = percentile(&load_us, 0.5);
    r.load_latency_us_p99 = percentile(&load_us, 0.99);
    r.savings = Savings::of(&cost, r.tokens_loaded, r.requests_finished);
    r.cost = cost;
    r
}

/// Steps `sims` in turn until all are done (at most `max_steps` steps each), polling the tiers
/// after every step without waiting for them (as an engine does: its steps do not wait for the
/// disk or the peers, so lookups meet `Retry`, promotions stay pending across steps, and busy
/// tiers and deadlines come into play), then drains the tiers and runs each simulator's
/// end-of-run checks. `progress` hears finished and total requests.
pub fn drive(
    sims: &mut [InstanceSim],
    max_steps: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Vec<SimReport>, String> {
    let total: u64 = sims.iter().map(|s| s.request_count() as u64).sum();
    let mut steps = 0u64;
    while sims.iter().any(|s| !s.is_done()) && steps < max_steps {
        for sim in sims.iter_mut() {
            if !sim.is_done() {
                sim.step();
                sim.handle_mut().poll_tiers();
            }
        }
        steps += 1;
        if steps % 16 == 0 {
            let done: u64 = sims.iter().map(|s| s.report().requests_finished).sum();
            progress(done, total);
        }
    }
    let mut reports = Vec::with_capacity(sims.len());
    for sim in sims.iter_mut() {
        sim.handle_mut().drain_tiers();
        reports.push(sim.run_to_completion(1000).map_err(|e| e.to_string())?);
    }
    progress(total, total);
    Ok(reports)
}

fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// The model line: what moves per token and per chunk.
fn render_model(r: &RunReport, out: &mut String) {
    let c = &r.cost;
    let name = c.model.map_or("(no --model)", |m| m.name);
    let kib = match c.kv_bytes_per_token {
        b if b >= 1024 => format!(" ({:.0} KiB)", f64::from(b) / 1024.0),
        _ => String::new(),
    };
    out.push_str(&format!(
        "model           {name}: {} KV bytes per token{kib}\n",
        c.kv_bytes_per_token
    ));
}

/// The exact prompt split, what preemptions cost, and the compute total.
fn render_tokens(r: &RunReport, out: &mut String) {
    let p = r.prompt_tokens;
    out.push_str(&format!(
        "prompt tokens   {p}   (each counted once, by where its KV came from the first time)\n"
    ));
    let mut part = |label: &str, n: u64| {
        out.push_str(&format!("  {label:<23}{n:>10}  ({:.1}%)\n", percent(n, p)));
    };
    part("from GPU prefix cache", r.prompt_tokens_gpu_cached);
    part("loaded by kvtier", r.prompt_tokens_loaded);
    part("computed", r.prompt_tokens_computed);
    if r.prompt_tokens_unserved > 0 {
        part("aborted before any KV", r.prompt_tokens_unserved);
    }
    out.push_str(&format!(
        "  reusable at best {:>16}  ({:.1}%: the workload's own prefix sharing; cache hits above are {:.1}% of it)\n",
        r.prompt_tokens_reusable,
        percent(r.prompt_tokens_reusable, p),
        percent(r.prompt_tokens_hit(), r.prompt_tokens_reusable)
    ));
    if r.preemptions > 0 {
        out.push_str(&format!(
            "after {} preemptions (not in the split): {} tokens from the GPU prefix cache again, \
             {} loaded by kvtier again, {} computed again\n",
            r.preemptions, r.tokens_gpu_cached_again, r.tokens_loaded_again, r.tokens_recomputed
        ));
    }
    out.push_str(&format!(
        "tokens computed {} in all = {} prompt + {} decode + {} again\n",
        r.tokens_computed, r.prompt_tokens_computed, r.decode_tokens_computed, r.tokens_recomputed
    ));
}

/// Prefill saved by kvtier's loads, with the assumptions that make it time.
fn render_savings(r: &RunReport, out: &mut String) {
    let (s, c) = (&r.savings, &r.cost);
    out.push_str(&format!(
        "prefill saved   {} tokens loaded by kvtier instead of computed",
        s.prefill_tokens_saved
    ));
    match (c.model, c.prefill_us_per_token(), s.prefill_s_saved) {
        (Some(m), Some(us), Some(saved)) => {
            out.push_str(&format!(
                ": {saved:.2} s of prefill at {us:.1} us/token (2 FLOPs x {:.3e} parameters at {:.0} TFLOP/s), \
                 {:.2} s to load at {:.0} GB/s",
                m.params,
                c.prefill_flops / 1e12,
                s.load_s,
                c.load_bytes_per_s / 1e9
            ));
            if let Some(ms) = s.ttft_saved_ms_per_request {
                out.push_str(&format!(
                    "; {ms:.1} ms less time to first token per finished request"
                ));
            }
            out.push('\n');
        }
        _ => out.push_str(" (name a --model to turn them into time)\n"),
    }
}

/// The report as a table for people.
pub fn render(r: &RunReport) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "requests        {} finished of {} ({} instance(s), {} engine steps, {:.1} s)\n",
        r.requests_finished, r.requests_total, r.instances, r.steps, r.elapsed_s
    ));
    render_model(r, &mut out);
    render_tokens(r, &mut out);
    render_savings(r, &mut out);
    out.push_str(&format!(
        "{:<6} {:>8} {:>8} {:>8} {:>12} {:>12} {:>10}\n",
        "tier", "hits", "stores", "loads", "MB stored", "MB loaded", "tokens"
    ));
    for t in &r.tiers {
        out.push_str(&format!(
            "{:<6} {:>8} {:>8} {:>8} {:>12.1} {:>12.1} {:>10}\n",
            t.name,
            t.hits,
            t.stores,
            t.loads,
            t.bytes_stored as f64 / 1e6,
            t.bytes_loaded as f64 / 1e6,
            t.tokens_served,
        ));
    }
    out.push_str(&format!(
        "host-pool latency (prepare to complete): store p50 {} us p99 {} us, load p50 {} us p99 {} us\n",
        r.store_latency_us_p50, r.store_latency_us_p99, r.load_latency_us_p50, r.load_latency_us_p99
    ));
    out.push_str(&format!(
        "integrity failures {}  store mismatches {}  GPU corruptions {}  invariant failures {}  -> {}\n",
        r.integrity_failures,
        r.store_mismatches,
        r.gpu_corruptions,
        r.invariant_failures,
        if r.is_clean() { "OK" } else { "FAILED" }
    ));
    for f in &r.failures {
        out.push_str(&format!("  failure: {f}\n"));
    }
    for n in &r.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    out
}
