//! The complete example of docs/writing-a-tier.md: `MemoryTier`, a secondary tier that keeps
//! chunks in its own memory (least recently used evicted first, evictions reported through
//! `Tier::take_evicted`) and its jobs in offload-core's `JobBook`, completing each after a
//! modelled latency; its factory (`type = "memory"` in a config file), the conformance suite run
//! against it from one macro line, and a config file naming it, end to end: parsed, resolved
//! through a registry, started under the tiering manager, chunks cascaded into it and promoted
//! back byte for byte, one evicted and seen as a `Removed` event. A last test checks that every
//! Rust block of the guide is a verbatim part of this file.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use connector::config::{ConfigError, ConnectorConfig, EngineGeometry, ResolvedConfig};
use connector::registry::{TierFactory, TierRegistry, TierSettings};
use offload_core::tier::{
    FailedKey, SlotMemory, SubmitError, Tier, TierChunk, TierCompletion, TierFailure, TierJob,
    TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobBook, JobId, Medium, RequestId, SlotId};

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
    /// When it was last stored, loaded or touched (a tick of the store's own counter).
    used: u64,
}

/// The most evicted keys kept for `Tier::take_evicted`; beyond it the oldest are dropped and
/// counted. The tiering manager takes them at every poll, so only a tier nobody polls fills it.
const EVICTED_KEPT_MAX: usize = 4096;

/// The chunks the tier holds, at most `bytes_max` bytes of them, the least recently used
/// evicted first; evicted keys wait here for `Tier::take_evicted`.
struct LruChunks {
    chunks: BTreeMap<ChunkKey, Stored>,
    bytes: u64,
    bytes_max: u64,
    tick: u64,
    /// Keys evicted and not yet taken, oldest first; at most `EVICTED_KEPT_MAX`.
    evicted: VecDeque<ChunkKey>,
    /// Keys dropped from a full `evicted` since the last `take_evicted`.
    evicted_dropped: u64,
}

/// What the tier keeps about a job in its `JobBook` (the book itself keeps the job's keys and
/// whether a cancel was asked).
struct Pending {
    job: TierJob,
    /// When the latency model lets it finish.
    due: Instant,
}

/// An in-memory secondary tier with a latency model.
pub struct MemoryTier {
    memory: Arc<dyn SlotMemory>,
    settings: MemoryTierSettings,
    chunks: LruChunks,
    /// The jobs accepted whose completion is not in `ready` yet: offload-core's ledger.
    jobs: JobBook<Pending>,
    /// Completions for `poll` to hand out, their jobs already taken out of `jobs`.
    ready: Vec<TierCompletion>,
    shut_down: bool,
}
// ANCHOR_END: state

// ANCHOR: chunks
impl LruChunks {
    fn new(bytes_max: u64) -> Self {
        Self {
            chunks: BTreeMap::new(),
            bytes: 0,
            bytes_max,
            tick: 0,
            evicted: VecDeque::new(),
            evicted_dropped: 0,
        }
    }

    fn contains(&self, key: ChunkKey) -> bool {
        self.chunks.contains_key(&key)
    }

    /// Marks `key` as the most recently used chunk.
    fn touch(&mut self, key: ChunkKey) {
        self.tick += 1;
        if let Some(chunk) = self.chunks.get_mut(&key) {
            chunk.used = self.tick;
        }
    }

    /// Copies one chunk from its host slot in, evicting the least recently used chunks to make
    /// room; `Io` (no space) if it cannot fit at all.
    fn store(
        &mut self,
        memory: &dyn SlotMemory,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
    ) -> Result<(), TierFailure> {
        let len = u64::from(len);
        if len > self.bytes_max {
            return Err(TierFailure::Io);
        }
        if let Some(old) = self.chunks.remove(&key) {
            self.bytes -= old.bytes.len() as u64;
        }
        // Stored again before its eviction was reported: it is held, so no `Removed` for it.
        self.evicted.retain(|&k| k != key);
        while self.bytes + len > self.bytes_max {
            self.evict_oldest();
        }
        let mut bytes = vec![0u8; len as usize];
        memory.read_slot(slot, 0, &mut bytes);
        self.tick += 1;
        self.bytes += len;
        let used = self.tick;
        self.chunks.insert(key, Stored { bytes, used });
        debug_assert!(self.bytes <= self.bytes_max);
        Ok(())
    }

    /// Drops the least recently used chunk (a linear scan: keep a recency index, as tier-p2p's
    /// store does, when a tier holds many chunks) and notes its key for `take_evicted`.
    fn evict_oldest(&mut self) {
        let Some((&oldest, _)) = self.chunks.iter().min_by_key(|(_, c)| c.used) else {
            return;
        };
        let Some(chunk) = self.chunks.remove(&oldest) else {
            return;
        };
        self.bytes -= chunk.bytes.len() as u64;
        if self.evicted.len() == EVICTED_KEPT_MAX {
            self.evicted.pop_front();
            self.evicted_dropped += 1;
        }
        self.evicted.push_back(oldest);
    }

    /// Copies one chunk into its host slot; `Missing` if the tier does not hold it, `Corrupt` if
    /// it holds another length under that key.
    fn load(
        &mut self,
        memory: &dyn SlotMemory,
        key: ChunkKey,
        slot: SlotId,
        len: u32,
    ) -> Result<(), TierFailure> {
        self.tick += 1;
        let tick = self.tick;
        match self.chunks.get_mut(&key) {
            Some(chunk) if chunk.bytes.len() == len as usize => {
                chunk.used = tick;
                memory.write_slot(slot, 0, &chunk.bytes);
                Ok(())
            }
            Some(_) => Err(TierFailure::Corrupt),
            None => Err(TierFailure::Missing),
        }
    }

    /// Moves the evicted keys into `out`, oldest first; returns how many were dropped unreported.
    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        out.extend(self.evicted.drain(..));
        std::mem::take(&mut self.evicted_dropped)
    }
}
// ANCHOR_END: chunks

// ANCHOR: helpers
impl MemoryTier {
    /// A tier over the host pool's bytes `memory`, which every job's slots index.
    pub fn new(memory: Arc<dyn SlotMemory>, settings: MemoryTierSettings) -> Self {
        Self {
            memory,
            chunks: LruChunks::new(settings.capacity_bytes),
            jobs: JobBook::new(settings.jobs_in_flight_max),
            settings,
            ready: Vec::new(),
            shut_down: false,
        }
    }

    /// Why `job`'s chunks are malformed, if they are: checked before anything else, so a refused
    /// job has no effect (the book checks the job's id).
    fn invalid(&self, job: &TierJob) -> Option<String> {
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

    /// Finishes every job that is due or was asked to cancel (with `all`, every job), in id
    /// order.
    fn finish_jobs(&mut self, all: bool) {
        let now = Instant::now();
        let done: Vec<JobId> = self
            .jobs
            .iter()
            .filter(|(_, b)| all || b.cancelled || b.value.due <= now)
            .map(|(id, _)| id)
            .collect();
        for id in done {
            self.finish_job(id);
        }
    }

    /// Runs job `id` (or, if a cancel was asked, fails every key `Cancelled`), takes it out of
    /// the book and queues its completion.
    fn finish_job(&mut self, id: JobId) {
        let Some(booked) = self.jobs.get(id) else {
            return;
        };
        let memory = self.memory.as_ref();
        let mut failed = Vec::new();
        for &TierChunk { key, slot, len } in &booked.value.job.chunks {
            let moved = match (booked.cancelled, booked.value.job.op) {
                (true, _) => Err(TierFailure::Cancelled),
                (false, TierOp::Store) => self.chunks.store(memory, key, slot, len),
                (false, TierOp::Load) => self.chunks.load(memory, key, slot, len),
            };
            if let Err(kind) = moved {
                failed.push(FailedKey::new(key, kind));
            }
        }
        let completion = TierCompletion { id, failed };
        match self.jobs.complete(&completion) {
            Ok(_) => self.ready.push(completion),
            // Not here (the job is in flight and fails only its own keys, once); a tier whose
            // workers report completions counts such a refusal and does not hand it out.
            Err(broken) => debug_assert!(false, "memory tier: {broken}"),
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
        if self.chunks.contains(key) {
            TierLookup::Hit
        } else {
            TierLookup::Miss
        }
    }

    fn touch(&mut self, keys: &[ChunkKey]) {
        // Reverse order: the first chunk of a prefix becomes the most recently used.
        for &key in keys.iter().rev() {
            self.chunks.touch(key);
        }
    }

    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        if self.shut_down {
            return Err(SubmitError::ShutDown);
        }
        if let Some(reason) = self.invalid(&job) {
            return Err(SubmitError::Invalid(reason));
        }
        let bytes = job.chunks.iter().map(|c| u64::from(c.len)).sum();
        let due = Instant::now() + self.settings.job_duration(bytes);
        let pending = Pending {
            job: job.clone(),
            due,
        };
        // The book refuses, changing nothing, an id already in flight (`Invalid`) and a job
        // beyond `jobs_in_flight_max` (`Busy`).
        self.jobs.insert(&job, pending)
    }

    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        self.finish_jobs(false);
        out.append(&mut self.ready);
    }

    fn cancel(&mut self, id: JobId) {
        // The book remembers it; the next poll fails the job's keys `Cancelled`.
        self.jobs.cancel(id);
    }

    fn drain(&mut self) {
        // Wait out the latency model (bounded by the longest job), then finish everything.
        let latest = self.jobs.iter().map(|(_, b)| b.value.due).max();
        if let Some(wait) = latest.and_then(|due| due.checked_duration_since(Instant::now())) {
            std::thread::sleep(wait);
        }
        self.finish_jobs(true);
    }

    fn on_request_finished(&mut self, _request: RequestId) {}

    fn shutdown(&mut self) {
        // Every job still in flight fails whole, taken out of the book with its completion.
        for (completion, _) in self.jobs.fail_where(TierFailure::Cancelled, |_, _| true) {
            self.ready.push(completion);
        }
        self.shut_down = true;
    }

    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        // A completion still in `ready` (after `drain`) may have stored a key evicted since:
        // its `Stored` event comes when `poll` hands it out, so its `Removed` waits for that.
        if !self.ready.is_empty() {
            return 0;
        }
        self.chunks.take_evicted(out)
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
capacity_bytes = 12288  # three chunks of 4096 bytes
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

/// Stores `keys` through the host pool for `request` (each slot filled with its key's pattern),
/// finishes the request, and waits until every cascade into the secondary tier is over.
fn store_and_cascade(
    manager: &mut connector::TieringManager,
    memory: &dyn SlotMemory,
    keys: &[ChunkKey],
    request: RequestId,
    what: &str,
) {
    use offload_core::{OffloadManager, PreparedStore};

    let mut prepared = PreparedStore::default();
    manager
        .prepare_store(keys, request, &mut prepared)
        .expect("room");
    for (key, slot) in prepared.keys.iter().zip(&prepared.slots) {
        tier_testkit::fill_slot(memory, *slot, memory.slot_bytes(), key.hash_low());
    }
    manager.complete_store(&prepared.keys, true);
    manager.on_request_finished(request);
    poll_until(
        || {
            manager.begin_step();
            manager.tier_jobs_in_flight() == 0
        },
        what,
    );
}

#[test]
fn a_config_file_names_the_memory_tier_and_a_chunk_comes_back_from_it_byte_for_byte() {
    use offload_core::{KvEvent, LookupResult, OffloadManager};
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
    store_and_cascade(
        &mut manager,
        memory.as_ref(),
        &keys,
        RequestId(1),
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

    // A fourth chunk fills the memory tier past its three chunks: it evicts the least recently
    // used (the first, loaded first), and the manager reports that as a `Removed` event of the
    // memory tier with its medium, after that key's `Stored` event.
    let mut events = Vec::new();
    manager.take_tier_events(&mut events);
    let fourth = ChunkKey::new(0x5eed_0004, 0);
    store_and_cascade(
        &mut manager,
        memory.as_ref(),
        &[fourth],
        RequestId(3),
        "the fourth cascade",
    );
    manager.take_tier_events(&mut events);
    let medium = Medium::Cpu; // `MemoryTier::medium`, which the manager asks each tier for
    let in_memory_tier: Vec<&KvEvent> = events
        .iter()
        .filter(|e| e.tier == "memory")
        .map(|e| &e.event)
        .collect();
    let at = |event: KvEvent| in_memory_tier.iter().position(|e| **e == event);
    let removed = at(KvEvent::Removed {
        key: keys[0],
        medium,
    });
    let stored = at(KvEvent::Stored {
        key: keys[0],
        medium,
    });
    assert!(
        removed.is_some() && stored < removed,
        "the memory tier's events: {in_memory_tier:?}"
    );
    let removals = in_memory_tier
        .iter()
        .filter(|e| matches!(e, KvEvent::Removed { .. }))
        .count();
    assert_eq!(removals, 1, "one eviction: {in_memory_tier:?}");
    let counters = manager.tier_counters(0).expect("tier 0");
    assert_eq!(
        (counters.evictions_reported, counters.evictions_unreported),
        (1, 0)
    );
}

/// The tier alone: a key evicted by a store whose completion is not handed out yet is held back
/// until `poll` hands it out (its `Stored` event first), a key stored again before its eviction
/// was reported is not reported, and each report comes once.
#[test]
fn evicted_keys_are_reported_after_the_completions_that_stored_them_and_once() {
    use tier_testkit::{fill_slot, VecSlotMemory};

    let memory = Arc::new(VecSlotMemory::new(4, 64));
    let settings = MemoryTierSettings {
        capacity_bytes: 64,
        latency_us: 0,
        bandwidth_mib_per_s: 1024,
        jobs_in_flight_max: 4,
    };
    let mut tier = MemoryTier::new(memory.clone(), settings);
    let (a, b) = (ChunkKey::new(0xa, 0), ChunkKey::new(0xb, 0));
    fill_slot(memory.as_ref(), SlotId(0), 64, 1);
    fill_slot(memory.as_ref(), SlotId(1), 64, 2);
    let store = |id, chunks: &[(ChunkKey, u32)]| TierJob {
        id: JobId(id),
        request: None,
        op: TierOp::Store,
        chunks: chunks
            .iter()
            .map(|&(key, slot)| TierChunk::new(key, SlotId(slot), 64))
            .collect(),
    };
    // Room for one chunk: storing b evicts a, before job 1's completion is handed out.
    tier.submit(store(1, &[(a, 0), (b, 1)])).expect("accepted");
    tier.drain();
    let mut evicted = Vec::new();
    assert_eq!(tier.take_evicted(&mut evicted), 0);
    assert_eq!(evicted, [], "reported before the completion that stored it");
    let mut done = Vec::new();
    tier.poll(&mut done);
    assert_eq!(done, [TierCompletion::success(JobId(1))]);
    // a comes back (evicting b) before the eviction of a was taken: only b is gone.
    tier.submit(store(2, &[(a, 0)])).expect("accepted");
    poll_until(
        || {
            tier.poll(&mut done);
            done.len() == 2
        },
        "job 2",
    );
    assert_eq!(tier.take_evicted(&mut evicted), 0);
    assert_eq!(evicted, [b]);
    assert_eq!(
        (tier.lookup(a), tier.lookup(b)),
        (TierLookup::Hit, TierLookup::Miss)
    );
    evicted.clear();
    tier.poll(&mut done);
    assert_eq!(tier.take_evicted(&mut evicted), 0);
    assert_eq!(evicted, [], "reported once");
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
    let small = CONFIG.replace("capacity_bytes = 12288", "capacity_bytes = 100");
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
