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
//! [`compare_vllm`] runs `crates/kvtier/scripts/bench_vllm_manager.py`, which replays the same
//! trace with the same semantics at vLLM's own `CPUOffloadingManager` (imported from an installed
//! vllm, never copied), one pass at a time between blocks of kvtier's passes, so `kvtier bench
//! manager --compare-vllm SCRIPT` gives both numbers and their ratios from one run, each vLLM
//! pass paired with the kvtier passes run just before and after it.
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

/// The kvtier passes of one run so far: their times, and the counts every pass must repeat.
#[derive(Debug, Default)]
struct Passes {
    times: Vec<f64>,
    cpu_times: Vec<Option<f64>>,
    first: Option<PassCounts>,
}

impl Passes {
    /// Runs one pass on a fresh pool created before its timer starts; returns its seconds.
    fn run_one(
        &mut self,
        trace: &ManagerTrace,
        config: &ManagerBenchConfig,
    ) -> Result<f64, CoreError> {
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
        self.cpu_times.push(
            cpu_start
                .and_then(|t| t.try_elapsed().ok())
                .map(|d| d.as_secs_f64()),
        );
        std::hint::black_box(&pool);
        self.times.push(elapsed);
        match self.first {
            None => self.first = Some(counts),
            Some(c) if c != counts => {
                return Err(CoreError::InvalidConfig {
                    key: "passes",
                    reason: format!(
                        "pass {} counted {counts:?}, pass 0 {c:?}: the replay is not deterministic",
                        self.times.len() - 1
                    ),
                })
            }
            Some(_) => {}
        }
        Ok(elapsed)
    }

    /// The report of the passes run.
    fn report(&self, trace: &ManagerTrace, config: &ManagerBenchConfig) -> ManagerBenchReport {
        let counts = self.first.unwrap_or_default();
        let per_s = |t: f64| rate(counts.block_ops, t);
        let (elapsed_s, fastest_s) = median_and_least(&self.times);
        // Every pass has a thread CPU time, or none is reported.
        let cpu_times: Vec<f64> = self
            .cpu_times
            .iter()
            .copied()
            .collect::<Option<_>>()
            .unwrap_or_default();
        let cpu = (!cpu_times.is_empty()).then(|| median_and_least(&cpu_times));
        ManagerBenchReport {
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
            passes: self.times.len() as u32,
            pass_elapsed_s: self.times.clone(),
            cpu_block_ops_per_s: cpu.map(|(median, _)| per_s(median)),
            best_cpu_block_ops_per_s: cpu.map(|(_, least)| per_s(least)),
            pass_cpu_s: cpu_times,
        }
    }
}

/// `a` over `b` (0 where `b` is not positive).
fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// `ops` over `seconds` (0 for no time).
fn rate(ops: u64, seconds: f64) -> f64 {
    ratio(ops as f64, seconds)
}

/// Runs `config.passes` passes, each on a fresh pool created before its timer starts.
/// `progress` hears after each pass.
pub fn run(
    trace: &ManagerTrace,
    config: &ManagerBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<ManagerBenchReport, CoreError> {
    let passes = config.passes.max(1);
    let mut done = Passes::default();
    for p in 0..passes {
        let elapsed = done.run_one(trace, config)?;
        progress(&format!("pass {}/{passes}: {elapsed:.4} s", p + 1));
    }
    Ok(done.report(trace, config))
}

/// The median pass time and the least one.
fn median_and_least(times: &[f64]) -> (f64, f64) {
    let least = times.iter().copied().fold(f64::INFINITY, f64::min);
    (offload_core::bench::median(&mut times.to_vec()), least)
}

/// What vLLM's passes measured, from the script's one line per pass (see [`compare_vllm`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
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
    /// One ratio per vLLM pass: kvtier's block_ops/s over the kvtier passes run just before and
    /// just after it (their median time) over that vLLM pass's. Both sides of each ratio ran
    /// within about a second of each other, so a change of the machine's speed during the run
    /// (other tenants, clock changes) moves both; see [`compare_vllm`].
    pub pass_ratios: Vec<f64>,
    /// The median of [`ManagerComparison::pass_ratios`]: the steadiest of the ratios here.
    pub paired_ratio: f64,
    /// The lowest of [`ManagerComparison::pass_ratios`].
    pub paired_ratio_min: f64,
    /// The highest of [`ManagerComparison::pass_ratios`].
    pub paired_ratio_max: f64,
    /// As [`ManagerComparison::paired_ratio`], by thread CPU time, where both sides have it.
    pub paired_cpu_ratio: Option<f64>,
}

impl ManagerComparison {
    /// Pairs two reports of the same trace and settings with the interleaved run's per-pass
    /// ratios (at least one; by CPU time, none without a thread CPU clock).
    fn new(
        kvtier: ManagerBenchReport,
        vllm: VllmReport,
        pass_ratios: Vec<f64>,
        pass_cpu_ratios: Vec<f64>,
    ) -> Self {
        debug_assert!(!pass_ratios.is_empty());
        let both = |a: Option<f64>, b: Option<f64>| Some(ratio(a?, b?));
        let (paired_ratio, paired_ratio_min) = median_and_least(&pass_ratios);
        let paired_ratio_max = pass_ratios
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        let paired_cpu_ratio = (!pass_cpu_ratios.is_empty())
            .then(|| offload_core::bench::median(&mut pass_cpu_ratios.clone()));
        Self {
            ratio: ratio(kvtier.block_ops_per_s, vllm.block_ops_per_s),
            best_ratio: ratio(kvtier.best_block_ops_per_s, vllm.best_block_ops_per_s),
            cpu_ratio: both(kvtier.cpu_block_ops_per_s, vllm.cpu_block_ops_per_s),
            best_cpu_ratio: both(
                kvtier.best_cpu_block_ops_per_s,
                vllm.best_cpu_block_ops_per_s,
            ),
            pass_ratios,
            paired_ratio,
            paired_ratio_min,
            paired_ratio_max,
            paired_cpu_ratio,
            kvtier,
            vllm,
        }
    }
}

/// What failed in a comparison run.
#[derive(Debug)]
pub enum CompareError {
    /// kvtier's own passes (bad settings, a replay that is not deterministic).
    Kvtier(CoreError),
    /// The vLLM script: could not start, failed, or broke the protocol.
    Vllm(String),
}

impl std::fmt::Display for CompareError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompareError::Kvtier(e) => write!(f, "{e}"),
            CompareError::Vllm(e) => f.write_str(e),
        }
    }
}

/// The first line of the script's serve mode.
#[derive(serde::Deserialize)]
struct VllmHello {
    vllm_version: String,
    import: String,
}

/// One pass as the script's serve mode reports it.
#[derive(serde::Deserialize)]
struct VllmPass {
    elapsed_s: f64,
    cpu_s: f64,
    hit_blocks: u64,
    block_ops: u64,
    store_failures: u64,
}

/// The vLLM script running in its serve mode: one pass per `pass` line on its input, one JSON
/// line per pass on its output; it exits when its input closes.
struct VllmServer {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    stderr: Option<std::thread::JoinHandle<String>>,
    what: String,
}

impl VllmServer {
    fn start(
        python: &Path,
        script: &Path,
        trace: &Path,
        limit: Option<usize>,
        config: &ManagerBenchConfig,
    ) -> Result<(Self, VllmHello), String> {
        use std::process::Stdio;
        let mut cmd = Command::new(python);
        cmd.arg(script)
            .arg("--trace")
            .arg(trace)
            .arg("--capacity-blocks")
            .arg(config.capacity_blocks.to_string())
            .arg("--policy")
            .arg(config.policy.name())
            .arg("--serve");
        if let Some(n) = limit {
            cmd.arg("--limit").arg(n.to_string());
        }
        let what = format!("{} {}", python.display(), script.display());
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {what}: {e}"))?;
        let (Some(stdin), Some(stdout), Some(mut err)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{what}: started without its pipes"));
        };
        // Drained on a thread, so that a chatty stderr never blocks the script.
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut err, &mut text);
            text
        });
        let mut server = Self {
            child,
            stdin: Some(stdin),
            stdout: std::io::BufReader::new(stdout),
            stderr: Some(stderr),
            what,
        };
        let hello = server.read_reply("its serve-mode greeting")?;
        Ok((server, hello))
    }

    /// Reads lines until a JSON object, parsed as `T` (other lines are skipped). A closed
    /// output means the script ended: its exit status and last stderr line make the error.
    fn read_reply<T: serde::de::DeserializeOwned>(&mut self, wanted: &str) -> Result<T, String> {
        use std::io::BufRead;
        let mut line = String::new();
        loop {
            line.clear();
            let n = self
                .stdout
                .read_line(&mut line)
                .map_err(|e| format!("{}: reading {wanted}: {e}", self.what))?;
            if n == 0 {
                return Err(self.ended(wanted));
            }
            let text = line.trim();
            if text.starts_with('{') {
                return serde_json::from_str(text)
                    .map_err(|e| format!("{} printed no {wanted} ({e}): {text:?}", self.what));
            }
        }
    }

    /// The error for a script that ended before `wanted`.
    fn ended(&mut self, wanted: &str) -> String {
        self.stdin = None;
        let status = self
            .child
            .wait()
            .map_or_else(|e| format!("wait failed: {e}"), |s| s.to_string());
        let err = self
            .stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        let last = err.lines().last().unwrap_or("").trim();
        format!("{} failed ({status}) before {wanted}: {last}", self.what)
    }

    /// Asks for one pass and reads its report.
    fn pass(&mut self) -> Result<VllmPass, String> {
        use std::io::Write;
        let sent = match self.stdin.as_mut() {
            Some(stdin) => writeln!(stdin, "pass").and_then(|()| stdin.flush()).is_ok(),
            None => false,
        };
        if !sent {
            return Err(self.ended("a pass"));
        }
        self.read_reply("a pass")
    }

    /// Closes its input (the script then exits) and checks that it exited cleanly.
    fn finish(mut self) -> Result<(), String> {
        self.stdin = None;
        let status = self
            .child
            .wait()
            .map_err(|e| format!("{}: {e}", self.what))?;
        if status.success() {
            let _ = self.stderr.take().map(|h| h.join());
            Ok(())
        } else {
            Err(self.ended("a clean exit"))
        }
    }
}

impl Drop for VllmServer {
    fn drop(&mut self) {
        // An error path: the script is not needed any more.
        if self.stderr.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// kvtier's passes and vLLM's on the same trace and settings, interleaved: `config.passes`
/// kvtier passes (at least `vllm_passes + 1`) in `vllm_passes + 1` blocks, with one vLLM pass
/// (the script `script` run by `python` in its serve mode, on the trace file `trace_path` with
/// `limit`) between each two blocks. Each vLLM pass is paired with the kvtier blocks before and
/// after it ([`ManagerComparison::pass_ratios`]). On a shared host both sides' speed moves by up
/// to 2x within seconds; run one after the other, such a change showed up as a change of the
/// ratio. `progress` hears before each vLLM pass.
#[allow(clippy::too_many_arguments)]
pub fn compare_vllm(
    trace: &ManagerTrace,
    trace_path: &Path,
    limit: Option<usize>,
    config: &ManagerBenchConfig,
    python: &Path,
    script: &Path,
    vllm_passes: u32,
    progress: &mut dyn FnMut(&str),
) -> Result<ManagerComparison, CompareError> {
    let vllm_passes = vllm_passes.max(1) as usize;
    let blocks = vllm_passes + 1;
    let kvtier_passes = (config.passes as usize).max(blocks);
    // Block b runs kvtier passes [bounds(b), bounds(b + 1)): none is empty.
    let bounds = |b: usize| kvtier_passes * b / blocks;
    // A bad setting fails before Python starts.
    bench_pool(config).map_err(CompareError::Kvtier)?;
    let (mut server, hello) =
        VllmServer::start(python, script, trace_path, limit, config).map_err(CompareError::Vllm)?;
    let mut kvtier = Passes::default();
    let mut vllm: Vec<VllmPass> = Vec::with_capacity(vllm_passes);
    for b in 0..blocks {
        for _ in bounds(b)..bounds(b + 1) {
            kvtier
                .run_one(trace, config)
                .map_err(CompareError::Kvtier)?;
        }
        if b == vllm_passes {
            break;
        }
        progress(&format!("vLLM pass {}/{vllm_passes}", b + 1));
        let pass = server.pass().map_err(CompareError::Vllm)?;
        let counts = |p: &VllmPass| (p.hit_blocks, p.block_ops, p.store_failures);
        if let Some(first) = vllm.first().filter(|f| counts(f) != counts(&pass)) {
            return Err(CompareError::Vllm(format!(
                "{}: vLLM pass {} counted (hit_blocks, block_ops, store_failures) {:?}, its \
                 first {:?}: the replay is not deterministic",
                script.display(),
                b + 1,
                counts(&pass),
                counts(first)
            )));
        }
        vllm.push(pass);
    }
    server.finish().map_err(CompareError::Vllm)?;
    let report = kvtier.report(trace, config);
    let times: Vec<f64> = vllm.iter().map(|p| p.elapsed_s).collect();
    let cpu: Vec<f64> = vllm.iter().map(|p| p.cpu_s).collect();
    let (median, least) = median_and_least(&times);
    let (cpu_median, cpu_least) = median_and_least(&cpu);
    let first = &vllm[0];
    let ops = first.block_ops;
    let vllm_report = VllmReport {
        vllm_version: hello.vllm_version,
        import: hello.import,
        hit_blocks: first.hit_blocks,
        block_ops: ops,
        store_failures: first.store_failures,
        block_ops_per_s: rate(ops, median),
        best_block_ops_per_s: rate(ops, least),
        pass_elapsed_s: times.clone(),
        cpu_block_ops_per_s: Some(rate(ops, cpu_median)),
        best_cpu_block_ops_per_s: Some(rate(ops, cpu_least)),
    };
    // vLLM pass i ran between kvtier blocks i and i + 1.
    let paired = |kvtier_s: &[f64], vllm_s: &[f64]| -> Vec<f64> {
        (0..vllm_passes)
            .map(|i| {
                let (t, _) = median_and_least(&kvtier_s[bounds(i)..bounds(i + 2)]);
                ratio(rate(report.block_ops, t), rate(ops, vllm_s[i]))
            })
            .collect()
    };
    let pass_ratios = paired(&report.pass_elapsed_s, &times);
    let pass_cpu_ratios = if report.pass_cpu_s.len() == report.pass_elapsed_s.len() {
        paired(&report.pass_cpu_s, &cpu)
    } else {
        Vec::new()
    };
    Ok(ManagerComparison::new(
        report,
        vllm_report,
        pass_ratios,
        pass_cpu_ratios,
    ))
}

/// The comparison as lines for people, after the kvtier table.
pub fn render_comparison(c: &ManagerComparison) -> String {
    let mut text = render(&c.kvtier);
    text.push_str(&format!(
        "vllm             {} ({} import), {} pass(es), hit_blocks {}, block_ops {}\n\
         vllm_ops_per_s   {:>14.0}  ({:.3} M/s; fastest pass {:.3} M/s)\n\
         paired_ratio     {:>14.1}  (median of {} vLLM passes, each against the kvtier passes \
         beside it; lowest {:.1}, highest {:.1}; by thread CPU time {})\n\
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
        c.paired_ratio,
        c.pass_ratios.len(),
        c.paired_ratio_min,
        c.paired_ratio_max,
        c.paired_cpu_ratio.map_or("-".into(), |r| format!("{r:.1}")),
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

    /// A stand-in for the vLLM script's serve mode, run with `sh` as the "python": checks its
    /// arguments, greets, and answers the `i`-th `pass` line with `elapsed[i]` seconds,
    /// `hits[i]` hit blocks and 100 block ops.
    fn serve_script(name: &str, checks: &str, elapsed: &[f64], hits: &[u64]) -> std::path::PathBuf {
        let passes: Vec<String> = elapsed
            .iter()
            .zip(hits)
            .map(|(t, n)| format!("{t}:{n}"))
            .collect();
        fake_script(
            name,
            &format!(
                r#"{checks}
echo progress on stdout first
echo '{{"vllm_version": "0.33.0", "import": "light", "requests": 50}}'
set -- {passes}
while read -r cmd; do
  [ "$cmd" = pass ] || {{ echo "bad command $cmd" >&2; exit 4; }}
  p=$1; shift
  t=${{p%:*}}; n=${{p#*:}}
  echo "{{\"elapsed_s\": $t, \"cpu_s\": $t, \"hit_blocks\": $n, \"block_ops\": 100, \"store_failures\": 0}}"
done
"#,
                passes = passes.join(" ")
            ),
        )
    }

    #[test]
    fn vllm_comparison_interleaves_passes_and_pairs_them() {
        let config = ManagerBenchConfig {
            capacity_blocks: 64,
            policy: EvictionPolicy::Arc,
            passes: 2,
        };
        let checks = r#"[ "$2" = trace.jsonl ] && [ "$4" = 64 ] && [ "$6" = arc ] && [ "$7" = --serve ] \
    && [ "$9" = 7 ] || { echo "bad args: $*" >&2; exit 3; }"#;
        let script = serve_script("ok", checks, &[0.1, 0.4, 0.2], &[5, 5, 5]);
        let sh = std::path::Path::new("sh");
        let path = std::path::Path::new("trace.jsonl");
        let records = generated_trace(50, 1);
        let trace = ManagerTrace::from_records(&records);
        let mut heard = Vec::new();
        let c = compare_vllm(&trace, path, Some(7), &config, sh, &script, 3, &mut |m| {
            heard.push(m.to_string())
        })
        .unwrap();
        // --passes 2 is raised to one block of kvtier passes before, between and after the
        // three vLLM passes.
        assert_eq!(c.kvtier.passes, 4);
        assert_eq!(heard.len(), 3, "{heard:?}");
        assert_eq!((c.vllm.block_ops, c.vllm.hit_blocks), (100, 5));
        assert_eq!(c.vllm.import, "light");
        assert_eq!(c.vllm.pass_elapsed_s, vec![0.1, 0.4, 0.2]);
        assert_eq!(c.vllm.block_ops_per_s, 100.0 / 0.2);
        assert_eq!(c.vllm.best_block_ops_per_s, 100.0 / 0.1);
        // vLLM pass i against the kvtier passes i and i + 1 (one per block here), by an
        // independent computation: the upper median of two is the larger (slower) time.
        let k = &c.kvtier.pass_elapsed_s;
        let want: Vec<f64> = [0.1, 0.4, 0.2]
            .iter()
            .enumerate()
            .map(|(i, v)| (c.kvtier.block_ops as f64 / k[i].max(k[i + 1])) / (100.0 / v))
            .collect();
        assert_eq!(c.pass_ratios, want);
        let mut sorted = want.clone();
        sorted.sort_by(f64::total_cmp);
        assert_eq!(c.paired_ratio, sorted[1]);
        assert_eq!(
            (c.paired_ratio_min, c.paired_ratio_max),
            (sorted[0], sorted[2])
        );
        assert!(c.paired_cpu_ratio.is_some_and(|r| r > 0.0));
        assert_eq!(c.ratio, c.kvtier.block_ops_per_s / (100.0 / 0.2));
        let text = render_comparison(&c);
        assert!(
            text.contains("paired_ratio") && text.contains("median of 3 vLLM passes"),
            "{text}"
        );

        // The error message of a run that must fail.
        let fails = |script: &std::path::Path, vllm_passes: u32| {
            compare_vllm(
                &trace,
                path,
                None,
                &config,
                sh,
                script,
                vllm_passes,
                &mut |_| {},
            )
            .unwrap_err()
            .to_string()
        };
        // Wrong settings: the script fails, and its last error line is in the message.
        let err = fails(&script, 3);
        assert!(
            err.contains("bad args") && err.contains("greeting"),
            "{err}"
        );
        // No greeting at all.
        let silent = fake_script("silent", "echo not json\n");
        let err = fails(&silent, 3);
        assert!(err.contains("before its serve-mode greeting"), "{err}");
        // Passes that count differently.
        let drift = serve_script("drift", "", &[0.1, 0.1], &[5, 6]);
        let err = fails(&drift, 2);
        assert!(err.contains("not deterministic"), "{err}");
        // A script that dies after its first pass.
        let dies = fake_script(
            "dies",
            r#"echo '{"vllm_version": "0.33.0", "import": "full"}'
read -r cmd
echo '{"elapsed_s": 0.1, "cpu_s": 0.1, "hit_blocks": 1, "block_ops": 10, "store_failures": 0}'
read -r cmd
echo "out of memory" >&2
exit 5
"#,
        );
        let err = fails(&dies, 3);
        assert!(
            err.contains("out of memory") && err.contains("a pass"),
            "{err}"
        );
        // A bad kvtier setting fails before the script runs.
        let zero = ManagerBenchConfig {
            capacity_blocks: 0,
            ..config
        };
        let err = compare_vllm(&trace, path, None, &zero, sh, &script, 3, &mut |_| {});
        assert!(matches!(err, Err(CompareError::Kvtier(_))), "{err:?}");
        for p in [script, silent, drift, dies] {
            let _ = std::fs::remove_file(p);
        }
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
