//! `kvtier bench manager`: replays a trace at the host-pool manager alone, one request at a time
//! in file order, as a scheduler would, and counts block operations per second.
//!
//! For a request with keys `k[0..n)` (one key per hash id, group 0): look up `k[0]`, `k[1]`, ...
//! stopping at the first key that is not a hit (`h` hits); if `h > 0`, `prepare_load(k[..h])` then
//! `complete_load(k[..h])`; `touch(k[..n])`; if `h < n`, `prepare_store(k[h..])` and, if it
//! returned keys to store, `complete_store(those keys, success)`. `block_ops` counts the keys
//! handed to each of these calls (lookups including the first miss). These semantics are the
//! ones other implementations are compared with on the same trace; do not change them.
//!
//! [`run_vllm`] runs `crates/kvtier/scripts/bench_vllm_manager.py`, which replays the same trace
//! with the same semantics at vLLM's own `CPUOffloadingManager` (imported from an installed vllm,
//! never copied), so `kvtier bench manager --compare-vllm SCRIPT` gives both numbers and their
//! ratio from one run.
//!
//! Each pass is timed by the wall clock and by the thread's CPU time. On a shared machine the
//! wall clock also counts the time other processes held the core (the passes here take
//! milliseconds, the Python ones about a second, so they are hit differently); the CPU time does
//! not, and makes a steadier ratio. Both are reported.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use engine_sim::trace::TraceRecord;
use offload_core::{
    ChunkKey, CoreError, EvictionPolicy, HostPool, LookupResult, OffloadManager, PoolConfig,
    PreparedStore, RequestId, SlotId,
};
use serde::Serialize;

/// A trace reduced to what the manager sees: every request's keys, back to back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ManagerTrace {
    keys: Vec<ChunkKey>,
    /// Request `i` has keys `keys[starts[i]..starts[i + 1]]`.
    starts: Vec<usize>,
}

impl ManagerTrace {
    /// The keys of `records`, one per hash id, group 0, in file order.
    pub fn from_records(records: &[TraceRecord]) -> Self {
        let mut trace = Self {
            keys: Vec::with_capacity(records.iter().map(|r| r.hash_ids.len()).sum()),
            starts: Vec::with_capacity(records.len() + 1),
        };
        trace.starts.push(0);
        for r in records {
            trace
                .keys
                .extend(r.hash_ids.iter().map(|&h| ChunkKey::new(u128::from(h), 0)));
            trace.starts.push(trace.keys.len());
        }
        trace
    }

    /// Number of requests.
    pub fn requests(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// Number of keys over all requests.
    pub fn total_blocks(&self) -> usize {
        self.keys.len()
    }

    /// The keys of request `i`.
    pub fn request(&self, i: usize) -> &[ChunkKey] {
        &self.keys[self.starts[i]..self.starts[i + 1]]
    }

    fn longest_request(&self) -> usize {
        self.starts
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }
}

/// Settings of one benchmark run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManagerBenchConfig {
    /// Host-pool slots (chunk-sized), at least 1.
    pub capacity_blocks: u32,
    /// Eviction policy.
    pub policy: EvictionPolicy,
    /// Passes over the trace, each on a fresh pool (at least 1); the reported time is the
    /// median pass.
    pub passes: u32,
}

/// What one pass counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassCounts {
    /// Keys found by the prefix lookups (the `h` of every request, summed).
    pub hit_blocks: u64,
    /// Keys handed to lookup, prepare_load, complete_load, touch, prepare_store and
    /// complete_store.
    pub block_ops: u64,
    /// `prepare_store` calls that failed for lack of room (nothing stored).
    pub store_failures: u64,
}

/// The result of `kvtier bench manager` (its `--json` output).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ManagerBenchReport {
    /// `"lru"` or `"arc"`.
    pub policy: String,
    /// Host-pool slots.
    pub capacity_blocks: u32,
    /// Requests in the trace.
    pub requests: u64,
    /// Keys over all requests.
    pub total_blocks: u64,
    /// Keys found by the prefix lookups, one pass.
    pub hit_blocks: u64,
    /// Block operations of one pass.
    pub block_ops: u64,
    /// `prepare_store` calls that failed for lack of room, one pass.
    pub store_failures: u64,
    /// Seconds of the median pass.
    pub elapsed_s: f64,
    /// `block_ops / elapsed_s`.
    pub block_ops_per_s: f64,
    /// `block_ops` over the fastest pass (the least disturbed by other work on the machine).
    pub best_block_ops_per_s: f64,
    /// Passes run.
    pub passes: u32,
    /// Seconds of every pass, in order.
    pub pass_elapsed_s: Vec<f64>,
    /// `block_ops` over the median pass by thread CPU time (`None` where the platform has no
    /// thread CPU clock).
    pub cpu_block_ops_per_s: Option<f64>,
    /// `block_ops` over the pass with the least thread CPU time.
    pub best_cpu_block_ops_per_s: Option<f64>,
    /// Thread CPU seconds of every pass, in order (empty without a thread CPU clock).
    pub pass_cpu_s: Vec<f64>,
}

/// Reusable buffers of a pass (allocated before the timer starts).
struct Scratch {
    slots: Vec<SlotId>,
    store: PreparedStore,
}

/// Replays `trace` once at `pool` with the semantics in this module's doc.
pub fn run_pass(pool: &mut HostPool, trace: &ManagerTrace) -> Result<PassCounts, CoreError> {
    let longest = trace.longest_request();
    let mut scratch = Scratch {
        slots: Vec::with_capacity(longest),
        store: PreparedStore {
            keys: Vec::with_capacity(longest),
            slots: Vec::with_capacity(longest),
        },
    };
    replay(pool, trace, &mut scratch)
}

fn replay(
    pool: &mut HostPool,
    trace: &ManagerTrace,
    scratch: &mut Scratch,
) -> Result<PassCounts, CoreError> {
    let mut counts = PassCounts::default();
    for i in 0..trace.requests() {
        let k = trace.request(i);
        let n = k.len();
        let request = RequestId(i as u64);
        let mut h = 0;
        while h < n && pool.lookup(k[h], request) == LookupResult::Hit {
            h += 1;
        }
        counts.block_ops += (h + usize::from(h < n)) as u64;
        counts.hit_blocks += h as u64;
        if h > 0 {
            scratch.slots.clear();
            pool.prepare_load(&k[..h], request, &mut scratch.slots)?;
            pool.complete_load(&k[..h]);
            counts.block_ops += 2 * h as u64;
        }
        pool.touch(k, request);
        counts.block_ops += n as u64;
        if h < n {
            counts.block_ops += (n - h) as u64;
            match pool.prepare_store(&k[h..], request, &mut scratch.store) {
                Ok(()) if !scratch.store.keys.is_empty() => {
                    pool.complete_store(&scratch.store.keys, true);
                    counts.block_ops += scratch.store.keys.len() as u64;
                }
                Ok(()) => {}
                Err(CoreError::NoSpace { .. }) => counts.store_failures += 1,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(counts)
}

/// A fresh pool for the benchmark (no events, no reuse threshold).
pub fn bench_pool(config: &ManagerBenchConfig) -> Result<HostPool, CoreError> {
    HostPool::new(PoolConfig {
        slot_count: config.capacity_blocks,
        policy: config.policy,
        reuse_threshold: 0,
        events: false,
    })
}

/// Runs `config.passes` passes, each on a fresh pool created before its timer starts.
/// `progress` hears after each pass.
pub fn run(
    trace: &ManagerTrace,
    config: &ManagerBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<ManagerBenchReport, CoreError> {
    let passes = config.passes.max(1);
    let mut times = Vec::with_capacity(passes as usize);
    let mut cpu_times = Vec::with_capacity(passes as usize);
    let mut first: Option<PassCounts> = None;
    for p in 0..passes {
        let mut pool = bench_pool(config)?;
        let longest = trace.longest_request();
        let mut scratch = Scratch {
            slots: Vec::with_capacity(longest),
            store: PreparedStore {
                keys: Vec::with_capacity(longest),
                slots: Vec::with_capacity(longest),
            },
        };
        let cpu_start = cpu_time::ThreadTime::try_now().ok();
        let start = Instant::now();
        let counts = replay(&mut pool, trace, &mut scratch)?;
        let elapsed = start.elapsed().as_secs_f64();
        cpu_times.push(cpu_start.and_then(|t| t.try_elapsed().ok()));
        std::hint::black_box(&pool);
        times.push(elapsed);
        match first {
            None => first = Some(counts),
            Some(c) if c != counts => {
                return Err(CoreError::InvalidConfig {
                    key: "passes",
                    reason: format!(
                        "pass {p} counted {counts:?}, pass 0 {c:?}: the replay is not deterministic"
                    ),
                })
            }
            Some(_) => {}
        }
        progress(&format!("pass {}/{passes}: {elapsed:.4} s", p + 1));
    }
    let counts = first.unwrap_or_default();
    let per_s = |t: f64| {
        if t > 0.0 {
            counts.block_ops as f64 / t
        } else {
            0.0
        }
    };
    let (elapsed_s, fastest_s) = median_and_least(&times);
    // Every pass has a thread CPU time, or none is reported.
    let cpu_times: Vec<f64> = cpu_times
        .into_iter()
        .map(|t| t.map(|d| d.as_secs_f64()))
        .collect::<Option<_>>()
        .unwrap_or_default();
    let cpu = (!cpu_times.is_empty()).then(|| median_and_least(&cpu_times));
    Ok(ManagerBenchReport {
        policy: config.policy.name().into(),
        capacity_blocks: config.capacity_blocks,
        requests: trace.requests() as u64,
        total_blocks: trace.total_blocks() as u64,
        hit_blocks: counts.hit_blocks,
        block_ops: counts.block_ops,
        store_failures: counts.store_failures,
        elapsed_s,
        block_ops_per_s: per_s(elapsed_s),
        best_block_ops_per_s: per_s(fastest_s),
        passes,
        pass_elapsed_s: times,
        cpu_block_ops_per_s: cpu.map(|(median, _)| per_s(median)),
        best_cpu_block_ops_per_s: cpu.map(|(_, least)| per_s(least)),
        pass_cpu_s: cpu_times,
    })
}

/// The median pass time and the least one.
fn median_and_least(times: &[f64]) -> (f64, f64) {
    let least = times.iter().copied().fold(f64::INFINITY, f64::min);
    (offload_core::bench::median(&mut times.to_vec()), least)
}

/// What the vLLM script reported (its JSON output, the fields used here).
#[derive(Clone, Debug, PartialEq, serde::Deserialize, Serialize)]
pub struct VllmReport {
    /// The vllm version the script imported.
    pub vllm_version: String,
    /// `"full"` (vllm imported as installed) or `"light"` (torch stood in for; see the script).
    pub import: String,
    /// Keys found by the prefix lookups, one pass.
    pub hit_blocks: u64,
    /// Block operations of one pass.
    pub block_ops: u64,
    /// `prepare_store` calls that failed for lack of room, one pass.
    pub store_failures: u64,
    /// `block_ops` over the median pass.
    pub block_ops_per_s: f64,
    /// `block_ops` over the fastest pass.
    pub best_block_ops_per_s: f64,
    /// Seconds of every pass, in order.
    pub pass_elapsed_s: Vec<f64>,
    /// `block_ops` over the median pass by thread CPU time.
    pub cpu_block_ops_per_s: Option<f64>,
    /// `block_ops` over the pass with the least thread CPU time.
    pub best_cpu_block_ops_per_s: Option<f64>,
}

/// The Rust manager and vLLM's on one trace, measured in the same run (`--compare-vllm`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ManagerComparison {
    /// The Rust host pool.
    pub kvtier: ManagerBenchReport,
    /// vLLM's CPUOffloadingManager.
    pub vllm: VllmReport,
    /// kvtier's median-pass block_ops/s over vLLM's.
    pub ratio: f64,
    /// kvtier's fastest-pass block_ops/s over vLLM's (the passes least disturbed by other work).
    pub best_ratio: f64,
    /// The median passes' ratio by thread CPU time (not counting time other processes held the
    /// core), where both sides have it.
    pub cpu_ratio: Option<f64>,
    /// The fastest passes' ratio by thread CPU time.
    pub best_cpu_ratio: Option<f64>,
}

impl ManagerComparison {
    /// Pairs two reports of the same trace and settings.
    pub fn new(kvtier: ManagerBenchReport, vllm: VllmReport) -> Self {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let both = |a: Option<f64>, b: Option<f64>| Some(ratio(a?, b?));
        Self {
            ratio: ratio(kvtier.block_ops_per_s, vllm.block_ops_per_s),
            best_ratio: ratio(kvtier.best_block_ops_per_s, vllm.best_block_ops_per_s),
            cpu_ratio: both(kvtier.cpu_block_ops_per_s, vllm.cpu_block_ops_per_s),
            best_cpu_ratio: both(
                kvtier.best_cpu_block_ops_per_s,
                vllm.best_cpu_block_ops_per_s,
            ),
            kvtier,
            vllm,
        }
    }
}

/// Runs the vLLM replay script `script` with `python` on the same trace and settings (`passes`
/// passes of its own) and reads its one-line JSON report.
pub fn run_vllm(
    python: &Path,
    script: &Path,
    trace: &Path,
    limit: Option<usize>,
    config: &ManagerBenchConfig,
    passes: u32,
) -> Result<VllmReport, String> {
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .arg("--trace")
        .arg(trace)
        .arg("--capacity-blocks")
        .arg(config.capacity_blocks.to_string())
        .arg("--policy")
        .arg(config.policy.name())
        .arg("--passes")
        .arg(passes.max(1).to_string());
    if let Some(n) = limit {
        cmd.arg("--limit").arg(n.to_string());
    }
    let what = format!("{} {}", python.display(), script.display());
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("").trim();
        return Err(format!("{what} failed ({}): {last}", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or("");
    serde_json::from_str(line).map_err(|e| format!("{what} printed no report ({e}): {line:?}"))
}

/// The comparison as lines for people, after the kvtier table.
pub fn render_comparison(c: &ManagerComparison) -> String {
    let mut text = render(&c.kvtier);
    text.push_str(&format!(
        "vllm             {} ({} import), {} pass(es), hit_blocks {}, block_ops {}\n\
         vllm_ops_per_s   {:>14.0}  ({:.3} M/s; fastest pass {:.3} M/s)\n\
         ratio            {:>14.1}  (median passes; fastest passes {:.1})\n\
         cpu_ratio        {:>14}  (by thread CPU time: median passes; fastest passes {})\n",
        c.vllm.vllm_version,
        c.vllm.import,
        c.vllm.pass_elapsed_s.len(),
        c.vllm.hit_blocks,
        c.vllm.block_ops,
        c.vllm.block_ops_per_s,
        c.vllm.block_ops_per_s / 1e6,
        c.vllm.best_block_ops_per_s / 1e6,
        c.ratio,
        c.best_ratio,
        c.cpu_ratio.map_or("-".into(), |r| format!("{r:.1}")),
        c.best_cpu_ratio.map_or("-".into(), |r| format!("{r:.1}")),
    ));
    text
}

/// The report as a table for people.
pub fn render(report: &ManagerBenchReport) -> String {
    let pct = |a: u64, b: u64| {
        if b == 0 {
            0.0
        } else {
            100.0 * a as f64 / b as f64
        }
    };
    let times: Vec<String> = report
        .pass_elapsed_s
        .iter()
        .map(|t| format!("{t:.4}"))
        .collect();
    format!(
        "bench manager: policy {}, capacity {} blocks, {} pass(es)\n\
         requests         {:>14}\n\
         total_blocks     {:>14}\n\
         hit_blocks       {:>14}  ({:.1}% of total_blocks)\n\
         block_ops        {:>14}\n\
         store_failures   {:>14}\n\
         elapsed_s        {:>14.6}  (median pass; passes: {})\n\
         block_ops_per_s  {:>14.0}  ({:.1} M/s; fastest pass {:.1} M/s)\n\
         cpu_ops_per_s    {:>14}  (by thread CPU time; fastest pass {})\n",
        report.policy,
        report.capacity_blocks,
        report.passes,
        report.requests,
        report.total_blocks,
        report.hit_blocks,
        pct(report.hit_blocks, report.total_blocks),
        report.block_ops,
        report.store_failures,
        report.elapsed_s,
        times.join(" "),
        report.block_ops_per_s,
        report.block_ops_per_s / 1e6,
        report.best_block_ops_per_s / 1e6,
        report
            .cpu_block_ops_per_s
            .map_or("-".into(), |r| format!("{r:.0}")),
        report
            .best_cpu_block_ops_per_s
            .map_or("-".into(), |r| format!("{:.1} M/s", r / 1e6)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, HashMap, HashSet};

    /// An independent model: an LRU of `cap` slots, keyed by hash id, with the same calls as the
    /// benchmark makes: prefix lookup, reverse-order touch of present keys, then the absent keys
    /// inserted in order (evicting the least recent keys other than the present ones among
    /// `ids[h..]`), or none when they do not fit beside those.
    struct LruModel {
        cap: usize,
        clock: u64,
        stamp: HashMap<u64, u64>,
        order: BTreeMap<u64, u64>,
    }

    impl LruModel {
        fn new(cap: usize) -> Self {
            Self {
                cap,
                clock: 0,
                stamp: HashMap::new(),
                order: BTreeMap::new(),
            }
        }

        fn use_now(&mut self, id: u64) {
            self.clock += 1;
            if let Some(old) = self.stamp.insert(id, self.clock) {
                self.order.remove(&old);
            }
            self.order.insert(self.clock, id);
        }

        /// Handles one request; returns its prefix hits.
        fn request(&mut self, ids: &[u64]) -> u64 {
            let h = ids
                .iter()
                .take_while(|id| self.stamp.contains_key(id))
                .count();
            for &id in ids.iter().rev() {
                if self.stamp.contains_key(&id) {
                    self.use_now(id);
                }
            }
            // Only the keys handed to prepare_store (ids[h..]) are safe from its evictions.
            let present: HashSet<u64> = ids[h..]
                .iter()
                .copied()
                .filter(|id| self.stamp.contains_key(id))
                .collect();
            let mut new = Vec::new();
            for &id in &ids[h..] {
                if !present.contains(&id) && !new.contains(&id) {
                    new.push(id);
                }
            }
            if new.len() > self.cap - present.len() {
                return h as u64;
            }
            while self.stamp.len() + new.len() > self.cap {
                let (&t, &victim) = self
                    .order
                    .iter()
                    .find(|(_, id)| !present.contains(id))
                    .expect("room was checked");
                self.order.remove(&t);
                self.stamp.remove(&victim);
            }
            for id in new {
                self.use_now(id);
            }
            h as u64
        }
    }

    /// A prefix-chained trace: conversations that grow turn by turn, documents shared by several
    /// requests, and one-off requests, some longer than small pools.
    fn generated_trace(requests: usize, seed: u64) -> Vec<TraceRecord> {
        let mut state = seed;
        let mut next = move |n: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % n
        };
        let mut fresh = 1_000_000u64;
        let mut convs: Vec<Vec<u64>> = (0..8).map(|c| vec![c * 10]).collect();
        let mut out = Vec::new();
        for _ in 0..requests {
            let ids = match next(3) {
                0 => {
                    let c = next(convs.len() as u64) as usize;
                    for _ in 0..1 + next(4) {
                        fresh += 1;
                        convs[c].push(fresh);
                    }
                    convs[c].clone()
                }
                1 => {
                    let doc = next(5);
                    let mut ids: Vec<u64> = (0..6).map(|b| 500 + doc * 100 + b).collect();
                    for _ in 0..next(5) {
                        fresh += 1;
                        ids.push(fresh);
                    }
                    ids
                }
                _ => (0..1 + next(40))
                    .map(|_| {
                        fresh += 1;
                        fresh
                    })
                    .collect(),
            };
            out.push(TraceRecord {
                timestamp_ms: out.len() as f64,
                input_length: ids.len() as u32 * 512,
                output_length: 1,
                hash_ids: ids,
            });
        }
        out
    }

    fn model_hits(records: &[TraceRecord], cap: usize) -> u64 {
        let mut model = LruModel::new(cap);
        records.iter().map(|r| model.request(&r.hash_ids)).sum()
    }

    fn pool_counts(records: &[TraceRecord], cap: u32, policy: EvictionPolicy) -> PassCounts {
        let config = ManagerBenchConfig {
            capacity_blocks: cap,
            policy,
            passes: 1,
        };
        let mut pool = bench_pool(&config).unwrap();
        run_pass(&mut pool, &ManagerTrace::from_records(records)).unwrap()
    }

    #[test]
    fn lru_hits_equal_an_independent_lru_model() {
        let records = generated_trace(2000, 7);
        let mut saw_failure = false;
        for cap in [8u32, 24, 64, 200, 100_000] {
            let counts = pool_counts(&records, cap, EvictionPolicy::Lru);
            assert_eq!(
                counts.hit_blocks,
                model_hits(&records, cap as usize),
                "capacity {cap}"
            );
            saw_failure |= counts.store_failures > 0;
        }
        assert!(
            saw_failure,
            "the small pools must also meet too-long requests"
        );
        // Unbounded: every repeated prefix block hits.
        let big = pool_counts(&records, 100_000, EvictionPolicy::Lru);
        assert!(big.hit_blocks > pool_counts(&records, 8, EvictionPolicy::Lru).hit_blocks);
    }

    #[test]
    fn lru_hits_equal_the_model_on_the_real_trace_prefix_when_present() {
        // Generated data always; the shared trace too where this checkout has it beside it.
        let mut sets = vec![generated_trace(500, 99)];
        let path = std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/traces/mooncake_synthetic_trace.jsonl"
        ));
        if path.exists() {
            sets.push(engine_sim::trace::read_trace_file(path, 400).unwrap());
        } else {
            eprintln!("note: {} absent; generated trace only", path.display());
        }
        for records in sets {
            for cap in [256u32, 2048] {
                let counts = pool_counts(&records, cap, EvictionPolicy::Lru);
                assert_eq!(counts.hit_blocks, model_hits(&records, cap as usize));
            }
        }
    }

    #[test]
    fn block_ops_follow_the_written_semantics() {
        // Capacity 4; request A = [1,2,3]: 1 lookup (miss), touch 3, prepare_store 3,
        // complete_store 3 -> 10. Request B = [1,2,9]: 3 lookups (2 hits + miss), load 2 + 2,
        // touch 3, prepare_store 1, complete_store 1 -> 12. Request C = [5,6,7,8,9]: miss 1,
        // touch 5, prepare_store 5 fails (5 keys, 4 slots) -> 11.
        let rec = |ids: &[u64]| TraceRecord {
            timestamp_ms: 0.0,
            input_length: ids.len() as u32 * 512,
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        let records = [rec(&[1, 2, 3]), rec(&[1, 2, 9]), rec(&[5, 6, 7, 8, 9])];
        let counts = pool_counts(&records, 4, EvictionPolicy::Lru);
        assert_eq!(counts.hit_blocks, 2);
        assert_eq!(counts.block_ops, 10 + 12 + 11);
        assert_eq!(counts.store_failures, 1);
    }

    /// A stand-in for the vLLM script: a shell script that checks its arguments and prints a
    /// report (or fails), run with `sh` as the "python".
    fn fake_script(name: &str, body: &str) -> std::path::PathBuf {
        let path =
            std::env::temp_dir().join(format!("kvtier-fake-vllm-{}-{name}.sh", std::process::id()));
        std::fs::write(&path, body).unwrap();
        path
    }

    #[test]
    fn vllm_comparison_passes_the_settings_and_reads_the_report() {
        let script = fake_script(
            "ok",
            r#"[ "$2" = trace.jsonl ] && [ "$4" = 64 ] && [ "$6" = arc ] && [ "$8" = 2 ] \
                && [ "${10}" = 7 ] || { echo "bad args: $*" >&2; exit 3; }
echo progress on stdout first
echo '{"vllm_version": "0.33.0", "import": "light", "hit_blocks": 5, "block_ops": 100,
 "store_failures": 0, "block_ops_per_s": 1000.0, "best_block_ops_per_s": 2000.0,
 "pass_elapsed_s": [0.1, 0.05], "cpu_block_ops_per_s": 1500.0,
 "best_cpu_block_ops_per_s": 2500.0, "extra": 1}' | tr -d '\n'
"#,
        );
        let config = ManagerBenchConfig {
            capacity_blocks: 64,
            policy: EvictionPolicy::Arc,
            passes: 1,
        };
        let sh = std::path::Path::new("sh");
        let trace = std::path::Path::new("trace.jsonl");
        let vllm = run_vllm(sh, &script, trace, Some(7), &config, 2).unwrap();
        assert_eq!(vllm.block_ops, 100);
        assert_eq!(vllm.import, "light");
        let records = generated_trace(50, 1);
        let report = run(&ManagerTrace::from_records(&records), &config, &mut |_| {}).unwrap();
        let c = ManagerComparison::new(report.clone(), vllm);
        assert_eq!(c.ratio, report.block_ops_per_s / 1000.0);
        assert_eq!(c.best_ratio, report.best_block_ops_per_s / 2000.0);
        let cpu = report
            .cpu_block_ops_per_s
            .expect("Linux has a thread CPU clock");
        assert_eq!(c.cpu_ratio, Some(cpu / 1500.0));
        assert!(render_comparison(&c).contains("ratio"));

        // Wrong settings: the script fails, and its last error line is in the message.
        let err = run_vllm(sh, &script, trace, None, &config, 2).unwrap_err();
        assert!(err.contains("bad args"), "{err}");
        let silent = fake_script("silent", "echo not json\n");
        let err = run_vllm(sh, &silent, trace, None, &config, 2).unwrap_err();
        assert!(err.contains("printed no report"), "{err}");
        let _ = std::fs::remove_file(script);
        let _ = std::fs::remove_file(silent);
    }

    #[test]
    fn report_counts_are_consistent_and_arc_runs() {
        let trace = ManagerTrace::from_records(&generated_trace(300, 3));
        for policy in [EvictionPolicy::Lru, EvictionPolicy::Arc] {
            let config = ManagerBenchConfig {
                capacity_blocks: 64,
                policy,
                passes: 3,
            };
            let mut heard = 0;
            let report = run(&trace, &config, &mut |_| heard += 1).unwrap();
            assert_eq!(heard, 3);
            assert_eq!(report.requests, 300);
            assert_eq!(report.total_blocks, trace.total_blocks() as u64);
            assert!(report.hit_blocks <= report.total_blocks);
            assert!(report.block_ops >= report.total_blocks * 2);
            assert_eq!(report.pass_elapsed_s.len(), 3);
            assert!(render(&report).contains("block_ops_per_s"));
        }
    }
}
