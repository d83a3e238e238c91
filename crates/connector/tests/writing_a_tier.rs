//! The complete example of docs/writing-a-tier.md: `MemoryTier`, a secondary tier that keeps
//! chunks in its own memory and completes each job after a modelled latency, its factory
//! (`type = "memory"` in a config file), the conformance suite run against it from one macro
//! line, and a config file naming it, end to end: parsed, resolved through a registry, started
//! under the tiering manager, a chunk cascaded into it and promoted back byte for byte. A last
//! test checks that every Rust block of the guide is a verbatim part of this file.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use connector::config::{ConfigError, ConnectorConfig, EngineGeometry, ResolvedConfig};
use connector::registry::{TierFactory, TierRegistry, TierSettings};
use offload_core::tier::{
    FailedKey, SlotMemory, SubmitError, Tier, TierChunk, TierCompletion, TierFailure, TierJob,
    TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobId, Medium, RequestId, SlotId};

// ANCHOR: settings
/// What a `type = "memory"` entry may say (every key optional but `capacity_bytes`).
#[derive(Clone, Copy, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryTierSettings {
    /// Most bytes of chunks kept; the least recently used chunk goes first.
    pub capacity_bytes: u64,
    /// Fixed cost of every job, in microseconds (default 50).
    #[serde(default = "default_latency_us")]
    pub latency_us: u64,
    /// Transfer rate in MiB/s, added to the fixed cost per byte (default 10240).
    #[serde(default = "default_bandwidth_mib_per_s")]
    pub bandwidth_mib_per_s: u64,
    /// Jobs accepted at once; more answer `Busy` (default 64).
    #[serde(default = "default_jobs_in_flight_max")]
    pub jobs_in_flight_max: usize,
}

fn default_latency_us() -> u64 {
    50
}

fn default_bandwidth_mib_per_s() -> u64 {
    10 * 1024
}

fn default_jobs_in_flight_max() -> usize {
    64
}

impl MemoryTierSettings {
    /// The latency model: how long a job moving `bytes` takes.
    fn job_duration(&self, bytes: u64) -> Duration {
        let per_second = self.bandwidth_mib_per_s.max(1) << 20;
        let transfer_ns = u128::from(bytes) * 1_000_000_000 / u128::from(per_second);
        Duration::from_micros(self.latency_us) + Duration::from_nanos(transfer_ns as u64)
    }
}
// ANCHOR_END: settings

// ANCHOR: state
/// A chunk the tier holds.
struct Stored {
    bytes: Vec<u8>,
    /// When it was last stored, loaded or touched (a tick of the tier's own counter).
    used: u64,
}

/// A job accepted and not yet reported.
struct InFlight {
    job: TierJob,
    /// When the latency model lets it finish.
    due: Instant,
    cancelled: bool,
}

/// An in-memory secondary tier with a latency model.
pub struct MemoryTier {
    memory: Arc<dyn SlotMemory>,
    settings: MemoryTierSettings,
    chunks: BTreeMap<ChunkKey, Stored>,
    stored_bytes: u64,
    tick: u64,
    in_flight: BTreeMap<JobId, InFlight>,
    ready: Vec<TierCompletion>,
    shut_down: bool,
}
// ANCHOR_END: state

// ANCHOR: helpers
impl MemoryTier {
    /// A tier over the host pool's bytes `memory`, which every job's slots index.
    pub fn new(memory: Arc<dyn SlotMemory>, settings: MemoryTierSettings) -> Self {
        Self {
            memory,
            settings,
            chunks: BTreeMap::new(),
            stored_bytes: 0,
            tick: 0,
            in_flight: BTreeMap::new(),
            ready: Vec::new(),
            shut_down: false,
        }
    }

    /// Why `job` is malformed, if it is: checked before anything else, so a refused job has
    /// no effect.
    fn invalid(&self, job: &TierJob) -> Option<String> {
        if self.in_flight.contains_key(&job.id) {
            return Some(format!("job id {} is already in flight", job.id.0));
        }
        let mut keys = std::collections::BTreeSet::new();
        let mut written = std::collections::BTreeSet::new();
        for &TierChunk { key, slot, len } in &job.chunks {
            if slot.0 >= self.memory.slot_count() {
                return Some(format!("slot {} out of range", slot.0));
            }
            if len == 0 || len as usize > self.memory.slot_bytes() {
                return Some(format!("length {len} of {key:?} outside one slot"));
            }
            if !keys.insert(key) {
                return Some(format!("{key:?} named twice"));
            }
            if job.op == TierOp::Load && !written.insert(slot) {
                return Some(format!("slot {} written twice", slot.0));
            }
        }
        None
    }

    /// Copies one chunk from its host slot into the tier, evicting the least recently used
    /// chunks to make room; `Io` (no space) if it cannot fit at all.
    fn store_chunk(&mut self, key: ChunkKey, slot: SlotId, len: u32) -> Result<(), TierFailure> {
        let len = u64::from(len);
        if len > self.settings.capacity_bytes {
            return Err(TierFailure::Io);
        }
        if let Some(old) = self.chunks.remove(&key) {
            self.stored_bytes -= old.bytes.len() as u64;
        }
        while self.stored_bytes + len > self.settings.capacity_bytes {
            let Some((&oldest, _)) = self.chunks.iter().min_by_key(|(_, c)| c.used) else {
                break;
            };
            let evicted = self.chunks.remove(&oldest).map_or(0, |c| c.bytes.len());
            self.stored_bytes -= evicted as u64;
        }
        let mut bytes = vec![0u8; len as usize];
        self.memory.read_slot(slot, 0, &mut bytes);
        self.tick += 1;
        self.stored_bytes += len;
        self.chunks.insert(
            key,
            Stored {
                bytes,
                used: self.tick,
            },
        );
        Ok(())
    }

    /// Copies one chunk into its host slot; `Missing` if the tier does not hold it, `Corrupt` if
    /// it holds another length under that key.
    fn load_chunk(&mut self, key: ChunkKey, slot: SlotId, len: u32) -> Result<(), TierFailure> {
        self.tick += 1;
        let tick = self.tick;
        match self.chunks.get_mut(&key) {
            Some(chunk) if chunk.bytes.len() == len as usize => {
                chunk.used = tick;
                self.memory.write_slot(slot, 0, &chunk.bytes);
                Ok(())
            }
            Some(_) => Err(TierFailure::Corrupt),
            None => Err(TierFailure::Missing),
        }
    }

    /// Reports every job that is due (or cancelled, or, with `all`, every job), in id order.
    fn finish_jobs(&mut self, now: Instant, all: bool) {
        let done: Vec<JobId> = self
            .in_flight
            .iter()
            .filter(|(_, j)| all || j.cancelled || j.due <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in done {
            let Some(InFlight { job, cancelled, .. }) = self.in_flight.remove(&id) else {
                continue;
            };
            let mut failed = Vec::new();
            for &TierChunk { key, slot, len } in &job.chunks {
                let moved = match (cancelled, job.op) {
                    (true, _) => Err(TierFailure::Cancelled),
                    (false, TierOp::Store) => self.store_chunk(key, slot, len),
                    (false, TierOp::Load) => self.load_chunk(key, slot, len),
                };
                if let Err(kind) = moved {
                    failed.push(FailedKey::new(key, kind));
                }
            }
            self.ready.push(TierCompletion { id, failed });
        }
    }
}
// ANCHOR_END: helpers

// ANCHOR: tier
impl Tier for MemoryTier {
    fn name(&self) -> &str {
        "memory"
    }

    fn medium(&self) -> Medium {
        Medium::Cpu
    }

    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        if self.chunks.contains_key(&key) {
            TierLookup::Hit
        } else {
            TierLookup::Miss
        }
    }

    fn touch(&mut self, keys: &[ChunkKey]) {
        // Reverse order: the first chunk of a prefix becomes the most recently used.
        for key in keys.iter().rev() {
            self.tick += 1;
            if let Some(chunk) = self.chunks.get_mut(key) {
                chunk.used = self.tick;
            }
        }
    }

    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        if self.shut_down {
            return Err(SubmitError::ShutDown);
        }
        if let Some(reason) = self.invalid(&job) {
            return Err(SubmitError::Invalid(reason));
        }
        if self.in_flight.len() >= self.settings.jobs_in_flight_max {
            return Err(SubmitError::Busy {
                in_flight: self.in_flight.len(),
            });
        }
        let bytes = job.chunks.iter().map(|c| u64::from(c.len)).sum();
        let due = Instant::now() + self.settings.job_duration(bytes);
        let id = job.id;
        let cancelled = false;
        self.in_flight.insert(
            id,
            InFlight {
                job,
                due,
                cancelled,
            },
        );
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        self.finish_jobs(Instant::now(), false);
        out.append(&mut self.ready);
    }

    fn cancel(&mut self, id: JobId) {
        if let Some(job) = self.in_flight.get_mut(&id) {
            job.cancelled = true;
        }
    }

    fn drain(&mut self) {
        // Wait out the latency model (bounded by the longest job), then finish everything.
        let latest = self.in_flight.values().map(|j| j.due).max();
        if let Some(wait) = latest.and_then(|due| due.checked_duration_since(Instant::now())) {
            std::thread::sleep(wait);
        }
        self.finish_jobs(Instant::now(), true);
    }

    fn on_request_finished(&mut self, _request: RequestId) {}

    fn shutdown(&mut self) {
        for job in self.in_flight.values_mut() {
            job.cancelled = true;
        }
        self.finish_jobs(Instant::now(), true);
        self.shut_down = true;
    }
}
// ANCHOR_END: tier

// ANCHOR: factory
/// Starts `type = "memory"` entries.
pub struct MemoryTierFactory;

impl TierFactory for MemoryTierFactory {
    fn check(&self, settings: &TierSettings, config: &ResolvedConfig) -> Result<(), ConfigError> {
        let memory: MemoryTierSettings = settings.parse()?;
        if memory.capacity_bytes < u64::from(config.slot_bytes) {
            return Err(settings.invalid(
                "capacity_bytes",
                format!("less than one chunk ({} bytes)", config.slot_bytes),
            ));
        }
        if memory.bandwidth_mib_per_s == 0 {
            return Err(settings.invalid("bandwidth_mib_per_s", "must be at least 1"));
        }
        if memory.jobs_in_flight_max == 0 {
            return Err(settings.invalid("jobs_in_flight_max", "must be at least 1"));
        }
        Ok(())
    }

    fn start(
        &self,
        settings: &TierSettings,
        _config: &ResolvedConfig,
        memory: Arc<dyn SlotMemory>,
    ) -> Result<Box<dyn Tier>, ConfigError> {
        Ok(Box::new(MemoryTier::new(memory, settings.parse()?)))
    }
}
// ANCHOR_END: factory

// ANCHOR: conformance
mod conformance {
    tier_testkit::tier_conformance_tests!(super::conformance_tier);
}

/// The tier each conformance case runs against: room for every chunk the suite stores, and a
/// latency (200 µs plus 1 GiB/s) long enough that jobs are still in flight when the suite
/// cancels, drains and shuts down.
fn conformance_tier(memory: Arc<dyn SlotMemory>) -> Box<dyn Tier> {
    let settings = MemoryTierSettings {
        capacity_bytes: 64 << 20,
        latency_us: 200,
        bandwidth_mib_per_s: 1024,
        jobs_in_flight_max: 64,
    };
    Box::new(MemoryTier::new(memory, settings))
}
// ANCHOR_END: conformance

// ANCHOR: config
const CONFIG: &str = r#"
cpu_bytes_to_use = 65536
block_size = 64

[[secondary_tiers]]
type = "memory"
capacity_bytes = 1048576
latency_us = 300
"#;

/// The registry an embedding program builds: the built-in types and its own.
fn registry() -> TierRegistry {
    let mut registry = TierRegistry::new();
    registry
        .register("memory", MemoryTierFactory)
        .expect("a new type name");
    registry
}
// ANCHOR_END: config

fn engine() -> EngineGeometry {
    EngineGeometry::new("example-model", 16, 1024)
}

/// Calls `step` until `done` holds, failing after a deadline (a latency model is time).
fn poll_until(mut step: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !step() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

#[test]
fn a_config_file_names_the_memory_tier_and_a_chunk_comes_back_from_it_byte_for_byte() {
    use offload_core::{LookupResult, OffloadManager, PreparedStore};
    use tier_testkit::{fill_slot, first_mismatch, VecSlotMemory};

    let config = ConnectorConfig::from_toml_str(CONFIG).expect("parses");
    let resolved = config
        .resolve_with(&engine(), &registry())
        .expect("resolves");
    assert_eq!(resolved.tiers[0].type_name(), "memory");
    let slot_bytes = resolved.slot_bytes as usize;
    let memory = Arc::new(VecSlotMemory::new(resolved.pool.slot_count, slot_bytes));
    let mut manager = resolved
        .build_manager(memory.clone(), true)
        .expect("starts");
    assert_eq!(manager.tier_name(0), Some("memory"));

    // Store three chunks through the host pool; each cascades into the memory tier.
    let keys: Vec<ChunkKey> = (1..=3).map(|n| ChunkKey::new(0x5eed_0000 + n, 0)).collect();
    let mut prepared = PreparedStore::default();
    manager
        .prepare_store(&keys, RequestId(1), &mut prepared)
        .expect("room");
    for (key, slot) in prepared.keys.iter().zip(&prepared.slots) {
        fill_slot(memory.as_ref(), *slot, slot_bytes, key.hash_low());
    }
    manager.complete_store(&prepared.keys, true);
    manager.on_request_finished(RequestId(1));
    poll_until(
        || {
            manager.begin_step();
            manager.tier_jobs_in_flight() == 0
        },
        "the cascade",
    );
    assert_eq!(manager.tier_counters(0).map(|c| c.chunks_stored), Some(3));

    // Drop the host copies and scribble over every slot: only the tier has the bytes now.
    manager.reset();
    assert_eq!(manager.host().len(), 0);
    for slot in 0..resolved.pool.slot_count {
        fill_slot(
            memory.as_ref(),
            offload_core::SlotId(slot),
            slot_bytes,
            0xbad,
        );
    }
    for &key in &keys {
        assert_eq!(manager.lookup(key, RequestId(2)), LookupResult::Pending);
    }
    manager.end_step();
    poll_until(
        || {
            manager.begin_step();
            keys.iter()
                .all(|&k| manager.lookup(k, RequestId(2)) == LookupResult::Hit)
        },
        "the promotions",
    );
    for &key in &keys {
        let slot = manager.host().slot_of(key).expect("promoted");
        let differs = first_mismatch(memory.as_ref(), slot, slot_bytes, key.hash_low());
        assert_eq!(
            differs, None,
            "bytes of {key:?} after the round trip through the memory tier (first differing offset)"
        );
    }
    assert_eq!(manager.tier_counters(0).map(|c| c.chunks_loaded), Some(3));
}

#[test]
fn without_its_registration_the_type_is_unknown_and_the_error_lists_the_known_ones() {
    let config = ConnectorConfig::from_toml_str(CONFIG).expect("parses");
    let error = config.resolve(&engine()).expect_err("not registered");
    match &error {
        ConfigError::UnknownTierType {
            key,
            type_name,
            registered,
        } => {
            assert_eq!(key, "secondary_tiers[0].type");
            assert_eq!(type_name, "memory");
            assert_eq!(registered, "fs, obj, p2p");
        }
        other => panic!("expected an unknown tier type, got {other:?}"),
    }
    let text = CONFIG.replace("\"memory\"", "\"memroy\"");
    let error = ConnectorConfig::from_toml_str(&text)
        .and_then(|c| c.resolve_with(&engine(), &registry()))
        .expect_err("misspelt")
        .to_string();
    assert!(
        error.contains("\"memroy\"") && error.contains("fs, memory, obj, p2p"),
        "{error}"
    );
}

#[test]
fn the_factory_checks_its_settings_and_errors_name_the_key() {
    let resolve = |extra: &str| {
        ConnectorConfig::from_toml_str(&format!("{CONFIG}{extra}\n"))
            .and_then(|c| c.resolve_with(&engine(), &registry()))
    };
    match resolve("jobs_in_flight_max = 0") {
        Err(ConfigError::Invalid { key, .. }) => {
            assert_eq!(key, "secondary_tiers[0].jobs_in_flight_max")
        }
        other => panic!("expected an invalid key, got {other:?}"),
    }
    let error = resolve("colour = \"red\"")
        .expect_err("unknown key")
        .to_string();
    assert!(
        error.contains("secondary_tiers[0]") && error.contains("colour"),
        "{error}"
    );
    let small = CONFIG.replace("capacity_bytes = 1048576", "capacity_bytes = 100");
    match ConnectorConfig::from_toml_str(&small)
        .and_then(|c| c.resolve_with(&engine(), &registry()))
    {
        Err(ConfigError::Invalid { key, .. }) => {
            assert_eq!(key, "secondary_tiers[0].capacity_bytes")
        }
        other => panic!("expected an invalid key, got {other:?}"),
    }
}

#[test]
fn every_rust_block_of_the_guide_is_part_of_this_file() {
    let guide = include_str!("../../../docs/writing-a-tier.md");
    let source = include_str!("writing_a_tier.rs");
    let mut blocks = 0;
    for block in guide.split("```rust\n").skip(1) {
        let code = block.split("```").next().unwrap_or_default();
        assert!(
            source.contains(code),
            "docs/writing-a-tier.md has a Rust block that is not in \
             crates/connector/tests/writing_a_tier.rs:\n{code}"
        );
        blocks += 1;
    }
    assert!(blocks >= 5, "the guide shows only {blocks} Rust blocks");
}
