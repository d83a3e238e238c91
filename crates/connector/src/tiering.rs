//! [`TieringManager`]: the host pool (primary tier) composed with an ordered list of secondary
//! tiers (disk, peers), behind offload-core's [`OffloadManager`] so that
//! `Scheduler<TieringManager>` drives it unchanged.
//!
//! What it adds to the host pool (design.md section 4, items 4, 11, 12 and 15):
//!
//! - **Cascade.** After every successful host `complete_store`, the chunks' host slots are pinned
//!   (one read reference per tier) and one Store job per secondary tier is submitted; each tier's
//!   pin is dropped when that tier reports the job.
//! - **Promotion.** A lookup that misses the host pool asks the secondary tiers in order (only those
//!   the request's [`TierMask`] allows). A `Hit` reserves a host slot at once (the key then reads
//!   `Pending`, so it is never promoted twice) and queues the chunk; [`TieringManager::end_step`]
//!   submits the queue as one Load job per tier and request. A full host pool makes the lookup a
//!   miss. When the tier reports, the slot's store completes (success or failure; a failed key is
//!   freed, never served, and that request does not ask the tier for it again).
//! - **Promotion pins.** A promoted chunk keeps one read reference on behalf of the request it was
//!   promoted for, until that request's `prepare_load` (which pins what it loads), its
//!   `on_request_finished`, a reset, or the promotion deadline, whichever comes first; each is
//!   released exactly once. Without it, the promotions of a prefix larger than the free part of
//!   the pool evicted each other (idle, not yet loaded) and the request waited forever. With it, a
//!   promotion that finds no evictable slot is a miss, the lookup stops there, and the request
//!   loads what was promoted and recomputes the rest. A promotion also never evicts the keys that
//!   the same request's lookups just found in the host pool (since its last miss or the step's
//!   start), for the same reason.
//! - **Per-request state** (host stores pending, finished, tier mask) is finalized only once the
//!   request finished and no host store of it is pending; queued promotions of the request are
//!   submitted (or cancelled when a tier refuses) and its cascades submitted before the tiers hear
//!   `on_request_finished`. After that no tier job or lookup names the request.
//! - **Deadlines.** A cascade queued behind a busy tier past `cascade_deadline_ns` is dropped
//!   (pins released); one in flight past it is cancelled (pins kept until the tier reports).
//! - **Reset** waits for every tier job (up to `reset_drain_deadline_ns`, then cancels the rest
//!   and drains the tiers holding them) before the host slots are freed, finalizes finished
//!   requests exactly once, and keeps the secondary tiers' data.
//! - **Strict tier reports.** A completion with an unknown job id, a second completion of a job,
//!   or one from another tier than the job's is a broken bookkeeping invariant
//!   ([`offload_core::invariant`]): a panic in strict mode, counted otherwise.
//!
//! It starts no thread: tiers are non-blocking and poll-driven, and the engine-facing
//! [`crate::SchedulerHandle`] calls [`TieringManager::begin_step`] and
//! [`TieringManager::end_step`] around each step's metadata.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use offload_core::invariant;
use offload_core::tier::{
    SubmitError, Tier, TierChunk, TierCompletion, TierFailure, TierJob, TierLookup, TierOp,
};
use offload_core::{
    ChunkKey, CoreError, HostPool, JobId, KvEvent, LookupResult, Medium, OffloadManager,
    PreparedStore, RequestId, SlotId,
};
use serde::Serialize;

use crate::clock::{Clock, MonotonicClock};

/// Most secondary tiers (a [`TierMask`] has one bit per tier).
pub const TIERS_MAX: usize = 64;

/// Most keys of one request's lookup scan protected from eviction by its promotions.
pub const SCAN_HITS_MAX: usize = 4096;

/// How many finalized request ids are remembered to catch late calls for them.
pub const FINALIZED_REMEMBERED_MAX: usize = 65_536;

/// The name the host pool has in metrics and events.
pub const HOST_TIER_NAME: &str = "cpu";

/// Which secondary tiers a request may load from: bit `i` is tier `i` (in configuration order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct TierMask(pub u64);

impl TierMask {
    /// Every tier.
    pub const ALL: TierMask = TierMask(u64::MAX);
    /// No secondary tier (host pool only).
    pub const NONE: TierMask = TierMask(0);

    /// Whether tier `index` is allowed.
    pub fn allows(self, index: usize) -> bool {
        index < TIERS_MAX && self.0 & (1u64 << index) != 0
    }

    /// The mask of exactly the tiers listed.
    pub fn of(indices: &[usize]) -> Self {
        TierMask(
            indices
                .iter()
                .filter(|&&i| i < TIERS_MAX)
                .fold(0, |m, &i| m | (1u64 << i)),
        )
    }
}

/// A KV event with the tier it happened in ([`HOST_TIER_NAME`] for the host pool, else the
/// secondary tier's [`Tier::name`]), in the shape cache-aware routers read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TierEvent {
    /// The tier's name.
    pub tier: String,
    /// What happened (its medium is the tier's medium).
    pub event: KvEvent,
}

/// Failed chunks of one tier (stores and promotions together) by the [`TierFailure`] the tier
/// reported. Every failed promotion is a recompute whatever its kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FailureCounts {
    /// [`TierFailure::Missing`]: the tier did not hold the chunk.
    pub missing: u64,
    /// [`TierFailure::Corrupt`]: the bytes did not verify.
    pub corrupt: u64,
    /// [`TierFailure::Cancelled`]: cancelled before the transfer (deadline, drain, shutdown).
    pub cancelled: u64,
    /// [`TierFailure::TierDown`]: the tier could not serve (shut down, unreachable).
    pub tier_down: u64,
    /// [`TierFailure::Timeout`]: a deadline of the tier passed.
    pub timeout: u64,
    /// [`TierFailure::Io`]: an I/O or transport error, no space.
    pub io: u64,
    /// A kind this version does not know (the enum is non-exhaustive).
    pub other: u64,
}

impl FailureCounts {
    /// Counts one failed chunk of `kind`.
    pub fn add(&mut self, kind: TierFailure) {
        *self.slot(kind) += 1;
    }

    /// Failed chunks of `kind`.
    pub fn of(&self, kind: TierFailure) -> u64 {
        let mut copy = *self;
        *copy.slot(kind)
    }

    /// Every count with its label (`TierFailure::name`, and `"other"`), for metrics.
    pub fn labelled(&self) -> [(&'static str, u64); 7] {
        [
            (TierFailure::Missing.name(), self.missing),
            (TierFailure::Corrupt.name(), self.corrupt),
            (TierFailure::Cancelled.name(), self.cancelled),
            (TierFailure::TierDown.name(), self.tier_down),
            (TierFailure::Timeout.name(), self.timeout),
            (TierFailure::Io.name(), self.io),
            ("other", self.other),
        ]
    }

    fn slot(&mut self, kind: TierFailure) -> &mut u64 {
        match kind {
            TierFailure::Missing => &mut self.missing,
            TierFailure::Corrupt => &mut self.corrupt,
            TierFailure::Cancelled => &mut self.cancelled,
            TierFailure::TierDown => &mut self.tier_down,
            TierFailure::Timeout => &mut self.timeout,
            TierFailure::Io => &mut self.io,
            _ => &mut self.other,
        }
    }
}

/// Counters of one tier (secondary tiers; the host pool's come from [`HostPool::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierCounters {
    /// Keys looked up in the tier (after a host-pool miss).
    pub lookups: u64,
    /// Lookups that answered `Hit`.
    pub hits: u64,
    /// Lookups that answered `Retry`.
    pub retries: u64,
    /// Hits that could not be promoted because the host pool was full.
    pub promotion_no_space: u64,
    /// Hits not promoted because the host pool's reuse threshold did not admit the key yet
    /// (`reuse_threshold`: a key is stored only after that many lookups).
    pub promotion_below_reuse_threshold: u64,
    /// Store (cascade) jobs submitted.
    pub store_jobs: u64,
    /// Chunks stored successfully.
    pub chunks_stored: u64,
    /// Chunks whose store failed.
    pub store_chunks_failed: u64,
    /// Bytes stored successfully (slot bytes per chunk).
    pub bytes_stored: u64,
    /// Nanoseconds from submit to completion, summed over store jobs.
    pub store_ns: u64,
    /// Load (promotion) jobs submitted.
    pub load_jobs: u64,
    /// Chunks promoted successfully.
    pub chunks_loaded: u64,
    /// Chunks whose promotion failed (the engine recomputes).
    pub load_chunks_failed: u64,
    /// Failed chunks, stores and promotions, by the kind the tier reported.
    pub failures: FailureCounts,
    /// Keys the tier reported dropping by itself (`Tier::take_evicted`), each a `Removed` event.
    pub evictions_reported: u64,
    /// Removals the tier dropped unreported because its list was full (no event for them).
    pub evictions_unreported: u64,
    /// Bytes promoted successfully.
    pub bytes_loaded: u64,
    /// Nanoseconds from submit to completion, summed over load jobs.
    pub load_ns: u64,
    /// Submits refused as busy (retried later).
    pub submits_busy: u64,
    /// Jobs dropped because the tier refused them for good (shut down, invalid) or a request
    /// finished while its promotion could not be submitted.
    pub jobs_dropped: u64,
    /// Promotions cancelled because they passed the promotion deadline.
    pub promotions_timed_out: u64,
    /// Cascades dropped (their host pins released, never submitted) because they waited behind
    /// a busy tier longer than the cascade deadline.
    pub cascades_expired: u64,
    /// Cascades submitted and not reported within the cascade deadline: cancelled (their pins
    /// stay until the tier reports them).
    pub cascades_timed_out: u64,
    /// Jobs still in flight when a reset's wait for this tier passed its deadline: cancelled.
    pub reset_jobs_cancelled: u64,
    /// Jobs still in flight when a reset ended (after its deadline): their host slots were held
    /// out of use, not freed, until the tier reported them.
    pub reset_jobs_held: u64,
    /// Of those, the ones the tier has reported since (their slots' holds ended).
    pub reset_held_jobs_reported: u64,
}

/// Counters of the tiering manager itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TieringCounters {
    /// Broken bookkeeping invariants (non-strict mode; strict mode panics).
    pub invariant_failures: u64,
    /// Requests finalized (tiers heard `on_request_finished`).
    pub requests_finalized: u64,
    /// Chunks stored from the GPU into the host pool.
    pub host_chunks_stored: u64,
    /// Bytes stored from the GPU into the host pool.
    pub host_bytes_stored: u64,
    /// Nanoseconds from `prepare_store` to `complete_store`, summed over host store calls.
    pub host_store_ns: u64,
    /// Chunks loaded from the host pool into the GPU.
    pub host_chunks_loaded: u64,
    /// Bytes loaded from the host pool into the GPU.
    pub host_bytes_loaded: u64,
    /// Nanoseconds from `prepare_load` to `complete_load`, summed over host load calls.
    pub host_load_ns: u64,
    /// Resets.
    pub resets: u64,
    /// Promotion pins dropped at the promotion deadline because their request never loaded them.
    pub promotion_pins_expired: u64,
    /// Resets whose wait for the tiers' jobs passed the reset drain deadline (the jobs still in
    /// flight were then cancelled, and their host slots held until reported).
    pub reset_drain_timeouts: u64,
    /// Calls of [`TieringManager::drain`] (and drops) whose wait passed the drain deadline with
    /// tier jobs still in flight (cancelled, left to report later).
    pub drain_timeouts: u64,
}

/// Settings of a [`TieringManager`] beyond its parts.
#[derive(Clone)]
pub struct TieringOptions {
    /// Bytes per host slot (the payload length of every tier job's chunks).
    pub slot_bytes: u32,
    /// Panic on a broken bookkeeping invariant (tests, simulators, debug builds).
    pub strict: bool,
    /// A promotion in flight longer than this is cancelled (it then fails, and the engine
    /// recomputes). Tiers have their own deadlines; this one bounds a tier that breaks them.
    pub promotion_deadline_ns: u64,
    /// A cascade queued behind a busy tier longer than this is dropped (its host pins released);
    /// one submitted and not reported within it is cancelled. It bounds how long a stalled or
    /// busy tier keeps host slots pinned.
    pub cascade_deadline_ns: u64,
    /// How long a reset waits for the tiers' jobs before it cancels those still in flight.
    pub reset_drain_deadline_ns: u64,
    /// Gather [`TierEvent`]s.
    pub events: bool,
    /// Where time comes from (for metrics and the promotion deadline).
    pub clock: Arc<dyn Clock>,
}

impl TieringOptions {
    /// Options for slots of `slot_bytes`, with strictness from the build (debug: strict), a
    /// 10-second promotion deadline, a 30-second cascade deadline, a 5-second reset drain
    /// deadline, events on, and the monotonic clock.
    pub fn new(slot_bytes: u32) -> Self {
        Self {
            slot_bytes,
            strict: invariant::STRICT_DEFAULT,
            promotion_deadline_ns: 10_000_000_000,
            cascade_deadline_ns: 30_000_000_000,
            reset_drain_deadline_ns: 5_000_000_000,
            events: true,
            clock: Arc::new(MonotonicClock::new()),
        }
    }
}

impl std::fmt::Debug for TieringOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieringOptions")
            .field("slot_bytes", &self.slot_bytes)
            .field("strict", &self.strict)
            .field("promotion_deadline_ns", &self.promotion_deadline_ns)
            .field("cascade_deadline_ns", &self.cascade_deadline_ns)
            .field("reset_drain_deadline_ns", &self.reset_drain_deadline_ns)
            .field("events", &self.events)
            .finish_non_exhaustive()
    }
}

/// How long a reset sleeps (on the manager's clock) between two polls of the tiers.
pub const RESET_DRAIN_POLL_INTERVAL_NS: u64 = 1_000_000;

/// A cascade refused as busy and queued: its request, chunks (pinned), and when it was queued.
#[derive(Debug)]
struct QueuedCascade {
    request: RequestId,
    chunks: Vec<TierChunk>,
    queued_ns: u64,
}

/// One secondary tier and what the manager keeps about it.
struct TierEntry {
    tier: Box<dyn Tier>,
    name: String,
    medium: Medium,
    /// Cascades refused as busy, oldest first, retried every step until the cascade deadline.
    cascades: VecDeque<QueuedCascade>,
    counters: TierCounters,
}

/// A tier job in flight.
#[derive(Debug)]
struct InFlight {
    tier: usize,
    /// The request the job was submitted for.
    request: RequestId,
    op: TierOp,
    chunks: Vec<TierChunk>,
    submitted_ns: u64,
    cancelled: bool,
    /// Still in flight when a reset ended: its host slots are held (out of use) until the tier
    /// reports it, and the report only ends those holds.
    held: bool,
}

/// What the manager keeps per request until it is finalized.
#[derive(Debug)]
struct RequestState {
    /// Keys of this request prepared in the host pool and not yet completed.
    host_stores_pending: u32,
    /// `on_request_finished` was heard.
    finished: bool,
    /// Cascades of this request queued (refused as busy) and not yet submitted.
    cascades_queued: u32,
    /// Tiers the request may load from.
    tiers: TierMask,
    /// `(key, tier)` promotions that failed for this request: not asked again.
    failed: BTreeSet<(ChunkKey, usize)>,
    /// Chunks promoted for this request and pinned (one read reference each) on its behalf until
    /// its `prepare_load`, its finish, a reset or the promotion deadline; with the time pinned.
    promoted: BTreeMap<ChunkKey, u64>,
    /// Keys this request's lookups found in the host pool since the last miss or step start: a
    /// promotion for the request does not evict them (they are the prefix it is about to load).
    scan_hits: Vec<ChunkKey>,
}

impl RequestState {
    fn new(tiers: TierMask) -> Self {
        Self {
            host_stores_pending: 0,
            finished: false,
            cascades_queued: 0,
            tiers,
            failed: BTreeSet::new(),
            promoted: BTreeMap::new(),
            scan_hits: Vec::new(),
        }
    }
}

/// The tiering manager: the host pool plus ordered secondary tiers. See the module doc.
pub struct TieringManager {
    host: HostPool,
    tiers: Vec<TierEntry>,
    options: TieringOptions,
    next_job: u64,
    in_flight: BTreeMap<JobId, InFlight>,
    requests: BTreeMap<RequestId, RequestState>,
    /// Host keys prepared by the scheduler's stores, with their request and prepare time.
    host_stores: BTreeMap<ChunkKey, (RequestId, u64)>,
    /// Host load pins: first key of each `prepare_load` call, with its start times.
    host_loads: BTreeMap<ChunkKey, VecDeque<u64>>,
    /// Promotions queued this step: one batch per (request, tier).
    promotions: BTreeMap<(RequestId, usize), Vec<TierChunk>>,
    /// When each batch of `promotions` was first queued (a busy tier keeps it queued).
    promotions_queued_ns: BTreeMap<(RequestId, usize), u64>,
    /// Requests finished with no host store pending, waiting for queued cascades to go out.
    finalize_waiting: BTreeSet<RequestId>,
    finalized: BTreeSet<RequestId>,
    finalized_order: VecDeque<RequestId>,
    default_mask: TierMask,
    /// Promotion pins held, over all requests (see `RequestState::promoted`).
    promotion_pins: usize,
    counters: TieringCounters,
    events: Vec<TierEvent>,
    host_events: Vec<KvEvent>,
    scratch_completions: Vec<TierCompletion>,
    scratch_prepared: PreparedStore,
}

impl TieringManager {
    /// Composes `host` with `tiers` (tried in this order on a host miss). Fails naming the
    /// setting when there are more than [`TIERS_MAX`] tiers or `slot_bytes` is 0.
    pub fn new(
        host: HostPool,
        tiers: Vec<Box<dyn Tier>>,
        options: TieringOptions,
    ) -> Result<Self, CoreError> {
        if tiers.len() > TIERS_MAX {
            return Err(CoreError::InvalidConfig {
                key: "secondary_tiers",
                reason: format!("{} tiers, at most {TIERS_MAX}", tiers.len()),
            });
        }
        if options.slot_bytes == 0 {
            return Err(CoreError::InvalidConfig {
                key: "slot_bytes",
                reason: "must be at least 1".to_owned(),
            });
        }
        let tiers = tiers
            .into_iter()
            .map(|tier| TierEntry {
                name: tier.name().to_owned(),
                medium: tier.medium(),
                tier,
                cascades: VecDeque::new(),
                counters: TierCounters::default(),
            })
            .collect();
        Ok(Self {
            host,
            tiers,
            options,
            next_job: 1,
            in_flight: BTreeMap::new(),
            requests: BTreeMap::new(),
            host_stores: BTreeMap::new(),
            host_loads: BTreeMap::new(),
            promotions: BTreeMap::new(),
            promotions_queued_ns: BTreeMap::new(),
            finalize_waiting: BTreeSet::new(),
            finalized: BTreeSet::new(),
            finalized_order: VecDeque::new(),
            default_mask: TierMask::ALL,
            promotion_pins: 0,
            counters: TieringCounters::default(),
            events: Vec::new(),
            host_events: Vec::new(),
            scratch_completions: Vec::new(),
            scratch_prepared: PreparedStore::default(),
        })
    }

    /// The host pool, for inspection.
    pub fn host(&self) -> &HostPool {
        &self.host
    }

    /// Number of secondary tiers.
    pub fn tier_count(&self) -> usize {
        self.tiers.len()
    }

    /// Secondary tier `index`'s name, if it exists.
    pub fn tier_name(&self, index: usize) -> Option<&str> {
        self.tiers.get(index).map(|t| t.name.as_str())
    }

    /// Secondary tier `index`'s counters, if it exists.
    pub fn tier_counters(&self, index: usize) -> Option<TierCounters> {
        self.tiers.get(index).map(|t| t.counters)
    }

    /// The manager's own counters.
    pub fn counters(&self) -> TieringCounters {
        self.counters
    }

    /// The options it was created with.
    pub fn options(&self) -> &TieringOptions {
        &self.options
    }

    /// Tier jobs submitted and not yet reported.
    pub fn tier_jobs_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Requests with state (not yet finalized).
    pub fn tracked_requests(&self) -> usize {
        self.requests.len()
    }

    /// Whether the tiers heard `on_request_finished` for `request` (among the last
    /// [`FINALIZED_REMEMBERED_MAX`] finalized requests).
    pub fn is_finalized(&self, request: RequestId) -> bool {
        self.finalized.contains(&request)
    }

    /// Whether `request` finished and its finalization waits (for host stores or for queued
    /// cascades); `false` for finalized and for live requests.
    pub fn is_awaiting_finalization(&self, request: RequestId) -> bool {
        self.requests.get(&request).is_some_and(|r| r.finished)
    }

    /// Bookkeeping left over once every engine job was acknowledged: host stores never
    /// completed, promotions queued and never submitted, finished requests never finalized. Tier
    /// jobs still in flight are not leaks (see [`TieringManager::outstanding`]).
    pub fn leaks(&self) -> Vec<String> {
        let mut out = self.outstanding();
        if !self.in_flight.is_empty() {
            out.remove(0);
        }
        out
    }

    /// Problems visible at the end of a run: tier jobs or host stores outstanding, requests
    /// finished but not finalized. Empty when everything was reported.
    pub fn outstanding(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.in_flight.is_empty() {
            out.push(format!("{} tier jobs never reported", self.in_flight.len()));
        }
        if !self.host_stores.is_empty() {
            out.push(format!(
                "{} host stores prepared and never completed",
                self.host_stores.len()
            ));
        }
        let queued: usize = self.promotions.values().map(Vec::len).sum();
        if queued > 0 {
            out.push(format!("{queued} promotions queued and never submitted"));
        }
        let unfinalized = self.requests.values().filter(|r| r.finished).count();
        if unfinalized > 0 {
            out.push(format!("{unfinalized} finished requests never finalized"));
        }
        let held: usize = self.requests.values().map(|r| r.promoted.len()).sum();
        if held != self.promotion_pins {
            out.push(format!(
                "{} promotion pins counted, {held} held by requests",
                self.promotion_pins
            ));
        }
        let finished_pins: usize = self
            .requests
            .values()
            .filter(|r| r.finished)
            .map(|r| r.promoted.len())
            .sum();
        if finished_pins > 0 {
            out.push(format!(
                "{finished_pins} promotion pins held for finished requests"
            ));
        }
        out
    }

    /// Promoted chunks pinned on behalf of the requests they were promoted for and not yet
    /// released (by the request's `prepare_load`, its finish, a reset or the deadline).
    pub fn promotion_pins(&self) -> usize {
        self.promotion_pins
    }

    /// Tiers a request that never had [`TieringManager::set_request_tiers`] may load from
    /// (all by default).
    pub fn set_default_tiers(&mut self, mask: TierMask) {
        self.default_mask = mask;
    }

    /// Limits the secondary tiers `request` may load from. Call it before the request's first
    /// lookup; calling it for a finished request is a broken invariant.
    pub fn set_request_tiers(&mut self, request: RequestId, mask: TierMask) {
        if self.check_live(request, "set_request_tiers") {
            self.state(request).tiers = mask;
        }
    }

    /// Moves the tier-attributed events gathered since the last call into `out` (host-pool events
    /// included, named [`HOST_TIER_NAME`]). [`OffloadManager::take_events`] gives the same events
    /// without the tier names; use one or the other.
    pub fn take_tier_events(&mut self, out: &mut Vec<TierEvent>) {
        self.pull_host_events();
        out.append(&mut self.events);
    }

    /// Start of a step (before the step's metadata is built): reaps tier completions (unpins
    /// cascaded slots, completes promotions), retries cascades refused as busy, drops queued
    /// cascades past the cascade deadline, cancels promotions and cascades in flight past their
    /// deadlines, drops promotion pins past theirs, and finalizes requests that were waiting.
    pub fn begin_step(&mut self) {
        self.poll_tiers();
        self.retry_cascades();
        self.expire_queued_cascades();
        self.expire_queued_promotions();
        self.cancel_overdue_jobs();
        self.expire_promotion_pins();
        for state in self.requests.values_mut() {
            state.scan_hits.clear();
        }
        self.finalize_waiting_requests();
    }

    /// End of a step (after the step's metadata was built): submits the step's promotions, one
    /// Load job per tier and request, and reaps what completed meanwhile.
    pub fn end_step(&mut self) {
        let batches: Vec<(RequestId, usize)> = self.promotions.keys().copied().collect();
        for (request, tier) in batches {
            self.submit_promotion(request, tier, false);
        }
        self.poll_tiers();
        self.finalize_waiting_requests();
    }

    /// Waits until every tier job was reported, and applies the reports, for at most the reset
    /// drain deadline (polling the tiers, sleeping on the clock between polls); past it the jobs
    /// still in flight are cancelled, the wait is counted (`drain_timeouts`) and `false` is
    /// returned. The jobs stay in flight, their slots pinned, until their tiers report them.
    pub fn drain(&mut self) -> bool {
        let start = self.now();
        loop {
            self.poll_tiers();
            if self.in_flight.is_empty() {
                return true;
            }
            if self.now().saturating_sub(start) >= self.options.reset_drain_deadline_ns {
                break;
            }
            self.options.clock.sleep_ns(RESET_DRAIN_POLL_INTERVAL_NS);
        }
        self.counters.drain_timeouts += 1;
        for (&id, job) in self.in_flight.iter_mut() {
            if !job.cancelled {
                job.cancelled = true;
                self.tiers[job.tier].tier.cancel(id);
            }
        }
        self.poll_tiers();
        self.in_flight.is_empty()
    }

    /// Submits what is queued, drains every tier and shuts them down (they refuse jobs after it).
    pub fn shutdown(&mut self) {
        self.end_step();
        for entry in &mut self.tiers {
            entry.tier.shutdown();
        }
        self.poll_tiers();
    }

    // ---- internals ----

    fn allocate_job(&mut self) -> JobId {
        let id = JobId(self.next_job);
        self.next_job += 1;
        id
    }

    fn now(&self) -> u64 {
        self.options.clock.now_ns()
    }

    #[track_caller]
    fn broken(&mut self, what: std::fmt::Arguments<'_>) {
        self.counters.invariant_failures += 1;
        invariant::broken(self.options.strict, what);
    }

    /// Whether a call for `request` is allowed (not finished); a broken invariant otherwise.
    #[track_caller]
    fn check_live(&mut self, request: RequestId, call: &str) -> bool {
        let finished = self.finalized.contains(&request)
            || self.requests.get(&request).is_some_and(|r| r.finished);
        if finished {
            self.broken(format_args!(
                "{call} for request {} after its on_request_finished",
                request.0
            ));
        }
        !finished
    }

    fn state(&mut self, request: RequestId) -> &mut RequestState {
        let mask = self.default_mask;
        self.requests
            .entry(request)
            .or_insert_with(|| RequestState::new(mask))
    }

    fn pull_host_events(&mut self) {
        if !self.options.events {
            self.host_events.clear();
            return;
        }
        self.host.take_events(&mut self.host_events);
        for event in self.host_events.drain(..) {
            self.events.push(TierEvent {
                tier: HOST_TIER_NAME.to_owned(),
                event,
            });
        }
    }

    fn push_tier_event(&mut self, tier: usize, event: KvEvent) {
        if self.options.events {
            // Keep the order: host events gathered so far come first.
            self.pull_host_events();
            let name = self.tiers[tier].name.clone();
            self.events.push(TierEvent { tier: name, event });
        }
    }

    /// Asks the allowed secondary tiers for `key` after a host miss.
    fn lookup_tiers(&mut self, key: ChunkKey, request: RequestId) -> LookupResult {
        let state = self.requests.get(&request);
        let mask = state.map_or(self.default_mask, |r| r.tiers);
        let mut retry = false;
        let mut hit = None;
        for (i, entry) in self.tiers.iter_mut().enumerate() {
            if !mask.allows(i) || state.is_some_and(|r| r.failed.contains(&(key, i))) {
                continue;
            }
            entry.counters.lookups += 1;
            match entry.tier.lookup(key) {
                TierLookup::Miss => {}
                TierLookup::Retry => {
                    entry.counters.retries += 1;
                    retry = true;
                }
                TierLookup::Hit => {
                    entry.counters.hits += 1;
                    hit = Some(i);
                    break;
                }
            }
        }
        match hit {
            Some(i) => self.reserve_promotion(key, request, i),
            None if retry => LookupResult::Retry,
            None => LookupResult::Miss,
        }
    }

    /// Reserves a host slot for `key` (so a second lookup sees `Pending`) and queues its
    /// promotion from tier `tier`. A full host pool makes it a miss: idle chunks can be evicted
    /// for it, but not chunks promoted and pinned for a request that has yet to load them, nor
    /// the prefix this request's lookups just found in the host pool. So a request whose prefix
    /// does not fit loads what fits and recomputes the rest instead of promoting forever.
    fn reserve_promotion(
        &mut self,
        key: ChunkKey,
        request: RequestId,
        tier: usize,
    ) -> LookupResult {
        let mut prepared = std::mem::take(&mut self.scratch_prepared);
        // The prefix this request found in the host pool is passed along so that it is not
        // evicted for the request's own promotion (prepare_store never evicts keys it is given).
        let mut keys = self
            .requests
            .get_mut(&request)
            .map(|r| std::mem::take(&mut r.scan_hits))
            .unwrap_or_default();
        keys.push(key);
        let ok = self
            .host
            .prepare_store(&keys, request, &mut prepared)
            .is_ok();
        // Room was there, but the reuse threshold left the key out (not a lack of space).
        let not_admitted = ok && !prepared.keys.contains(&key);
        keys.pop();
        if let Some(r) = self.requests.get_mut(&request) {
            r.scan_hits = keys;
        }
        let slot = match (prepared.keys.as_slice(), prepared.slots.as_slice()) {
            ([k], [s]) if *k == key => Some(*s),
            _ => None,
        };
        self.scratch_prepared = prepared;
        let (true, Some(slot)) = (ok, slot) else {
            if not_admitted {
                self.tiers[tier].counters.promotion_below_reuse_threshold += 1;
            } else {
                self.tiers[tier].counters.promotion_no_space += 1;
            }
            return LookupResult::Miss;
        };
        self.state(request);
        let len = self.options.slot_bytes;
        let now = self.now();
        self.promotions_queued_ns
            .entry((request, tier))
            .or_insert(now);
        self.promotions
            .entry((request, tier))
            .or_default()
            .push(TierChunk::new(key, slot, len));
        LookupResult::Pending
    }

    /// Submits the queued promotions of `(request, tier)`. On a busy tier they stay queued for
    /// the next step, unless `must_go` (the request is being finalized): then, and on any other
    /// refusal, they are cancelled (their host slots freed).
    fn submit_promotion(&mut self, request: RequestId, tier: usize, must_go: bool) {
        let Some(chunks) = self.promotions.remove(&(request, tier)) else {
            return;
        };
        let queued_ns = self.promotions_queued_ns.remove(&(request, tier));
        let id = self.allocate_job();
        let job = TierJob {
            id,
            request: Some(request),
            op: TierOp::Load,
            chunks,
        };
        let now = self.now();
        let entry = &mut self.tiers[tier];
        match entry.tier.submit(job.clone()) {
            Ok(()) => {
                entry.counters.load_jobs += 1;
                self.in_flight.insert(
                    id,
                    InFlight {
                        tier,
                        request,
                        op: TierOp::Load,
                        chunks: job.chunks,
                        submitted_ns: now,
                        cancelled: false,
                        held: false,
                    },
                );
            }
            Err(SubmitError::Busy { .. }) if !must_go => {
                entry.counters.submits_busy += 1;
                self.promotions.insert((request, tier), job.chunks);
                self.promotions_queued_ns
                    .insert((request, tier), queued_ns.unwrap_or(now));
            }
            Err(_) => {
                entry.counters.jobs_dropped += 1;
                self.cancel_promotion(request, tier, &job.chunks);
            }
        }
    }

    /// Frees the host slots of promotions that will not happen; the requests waiting for them
    /// recompute, and `request` does not ask `tier` for these keys again.
    fn cancel_promotion(&mut self, request: RequestId, tier: usize, chunks: &[TierChunk]) {
        let keys: Vec<ChunkKey> = chunks.iter().map(|c| c.key).collect();
        self.host.complete_store(&keys, false);
        if let Some(r) = self.requests.get_mut(&request) {
            r.failed.extend(keys.iter().map(|&k| (k, tier)));
        }
    }

    /// Pins chunks just promoted for `request` on its behalf, so that later promotions cannot
    /// evict them before the request loads them. Nothing is pinned for a finished request.
    fn pin_promoted(&mut self, request: RequestId, keys: &[ChunkKey]) {
        if keys.is_empty() || self.requests.get(&request).is_none_or(|r| r.finished) {
            return;
        }
        let now = self.now();
        let mut slots = Vec::with_capacity(1);
        for &key in keys {
            let already = self
                .requests
                .get(&request)
                .is_some_and(|r| r.promoted.contains_key(&key));
            slots.clear();
            if already || self.host.prepare_load(&[key], request, &mut slots).is_err() {
                continue;
            }
            if let Some(r) = self.requests.get_mut(&request) {
                r.promoted.insert(key, now);
                self.promotion_pins += 1;
            }
        }
    }

    /// Drops every promotion pin held for `request`, each exactly once.
    fn release_promotion_pins(&mut self, request: RequestId) {
        let Some(state) = self.requests.get_mut(&request) else {
            return;
        };
        if state.promoted.is_empty() {
            return;
        }
        let keys: Vec<ChunkKey> = std::mem::take(&mut state.promoted).into_keys().collect();
        self.promotion_pins -= keys.len();
        self.host.complete_load(&keys);
    }

    /// Drops promotion pins older than the promotion deadline: their request did not load them
    /// in time, and the slots go back to the pool.
    fn expire_promotion_pins(&mut self) {
        if self.promotion_pins == 0 {
            return;
        }
        let now = self.now();
        let deadline = self.options.promotion_deadline_ns;
        let mut expired = Vec::new();
        for state in self.requests.values_mut() {
            state.promoted.retain(|&key, &mut at| {
                let keep = now.saturating_sub(at) <= deadline;
                if !keep {
                    expired.push(key);
                }
                keep
            });
        }
        if expired.is_empty() {
            return;
        }
        self.promotion_pins -= expired.len();
        self.counters.promotion_pins_expired += expired.len() as u64;
        self.host.complete_load(&expired);
    }

    /// Pins the ready chunks among `keys` and submits one Store job per tier.
    fn cascade(&mut self, request: RequestId, keys: &[ChunkKey]) {
        if self.tiers.is_empty() || keys.is_empty() {
            return;
        }
        let len = self.options.slot_bytes;
        for tier in 0..self.tiers.len() {
            let mut slots = Vec::with_capacity(keys.len());
            if self.host.prepare_load(keys, request, &mut slots).is_err() {
                self.broken(format_args!(
                    "cascade of request {}: a just-stored chunk is not ready",
                    request.0
                ));
                return;
            }
            let chunks: Vec<TierChunk> = keys
                .iter()
                .zip(&slots)
                .map(|(&k, &s)| TierChunk::new(k, s, len))
                .collect();
            if !self.tiers[tier].cascades.is_empty() {
                // Keep submission order: older cascades of this tier go first.
                self.queue_cascade(tier, request, chunks);
                continue;
            }
            if let Some(chunks) = self.submit_cascade(tier, request, chunks) {
                self.queue_cascade(tier, request, chunks);
            }
        }
    }

    fn queue_cascade(&mut self, tier: usize, request: RequestId, chunks: Vec<TierChunk>) {
        let queued_ns = self.now();
        self.tiers[tier].cascades.push_back(QueuedCascade {
            request,
            chunks,
            queued_ns,
        });
        self.state(request).cascades_queued += 1;
    }

    /// Submits a cascade; returns the chunks back if the tier was busy. A job refused for good
    /// is dropped (its pins released).
    fn submit_cascade(
        &mut self,
        tier: usize,
        request: RequestId,
        chunks: Vec<TierChunk>,
    ) -> Option<Vec<TierChunk>> {
        let id = self.allocate_job();
        let job = TierJob {
            id,
            request: Some(request),
            op: TierOp::Store,
            chunks,
        };
        let now = self.now();
        let entry = &mut self.tiers[tier];
        match entry.tier.submit(job.clone()) {
            Ok(()) => {
                entry.counters.store_jobs += 1;
                self.in_flight.insert(
                    id,
                    InFlight {
                        tier,
                        request,
                        op: TierOp::Store,
                        chunks: job.chunks,
                        submitted_ns: now,
                        cancelled: false,
                        held: false,
                    },
                );
                None
            }
            Err(SubmitError::Busy { .. }) => {
                entry.counters.submits_busy += 1;
                Some(job.chunks)
            }
            Err(_) => {
                entry.counters.jobs_dropped += 1;
                let keys: Vec<ChunkKey> = job.chunks.iter().map(|c| c.key).collect();
                self.host.complete_load(&keys);
                None
            }
        }
    }

    fn retry_cascades(&mut self) {
        for tier in 0..self.tiers.len() {
            while let Some(cascade) = self.tiers[tier].cascades.pop_front() {
                let QueuedCascade {
                    request,
                    chunks,
                    queued_ns,
                } = cascade;
                if let Some(chunks) = self.submit_cascade(tier, request, chunks) {
                    self.tiers[tier].cascades.push_front(QueuedCascade {
                        request,
                        chunks,
                        queued_ns,
                    });
                    break;
                }
                if let Some(r) = self.requests.get_mut(&request) {
                    r.cascades_queued -= 1;
                }
            }
        }
    }

    /// Drops queued cascades (their pins released), for a reset.
    fn drop_queued_cascades(&mut self) {
        for tier in 0..self.tiers.len() {
            let queued: Vec<QueuedCascade> = self.tiers[tier].cascades.drain(..).collect();
            for cascade in queued {
                self.tiers[tier].counters.jobs_dropped += 1;
                self.unqueue_cascade(&cascade);
            }
        }
    }

    /// Releases a queued cascade's host pins (it will not be submitted).
    fn unqueue_cascade(&mut self, cascade: &QueuedCascade) {
        let keys: Vec<ChunkKey> = cascade.chunks.iter().map(|c| c.key).collect();
        self.host.complete_load(&keys);
        if let Some(r) = self.requests.get_mut(&cascade.request) {
            r.cascades_queued -= 1;
        }
    }

    /// Drops cascades queued behind a busy tier for longer than the cascade deadline, so a tier
    /// that stays busy does not keep host slots pinned: their pins are released and the chunks
    /// stay in the host pool only. The queue is in queueing order, so the oldest go first.
    fn expire_queued_cascades(&mut self) {
        let now = self.now();
        let deadline = self.options.cascade_deadline_ns;
        for tier in 0..self.tiers.len() {
            while self.tiers[tier]
                .cascades
                .front()
                .is_some_and(|c| now.saturating_sub(c.queued_ns) > deadline)
            {
                let Some(cascade) = self.tiers[tier].cascades.pop_front() else {
                    break;
                };
                self.tiers[tier].counters.cascades_expired += 1;
                self.unqueue_cascade(&cascade);
            }
        }
    }

    /// Cancels each tier job submitted longer ago than its deadline (a promotion: the promotion
    /// deadline; a cascade: the cascade deadline) and not reported yet, once, and counts it. Its
    /// pins stay: the tier may touch the slots until it reports the job (buffer ownership),
    /// which a cancelled job still does exactly once.
    fn cancel_overdue_jobs(&mut self) {
        let now = self.now();
        for (&id, job) in self.in_flight.iter_mut() {
            let deadline = match job.op {
                TierOp::Load => self.options.promotion_deadline_ns,
                TierOp::Store => self.options.cascade_deadline_ns,
            };
            if job.cancelled || now.saturating_sub(job.submitted_ns) <= deadline {
                continue;
            }
            job.cancelled = true;
            let entry = &mut self.tiers[job.tier];
            match job.op {
                TierOp::Load => entry.counters.promotions_timed_out += 1,
                TierOp::Store => entry.counters.cascades_timed_out += 1,
            }
            entry.tier.cancel(id);
        }
    }

    /// Waits for every tier job to be reported, up to the reset drain deadline, polling the
    /// tiers and sleeping on the clock between polls (a reset already blocks the caller). Past
    /// the deadline the jobs still in flight are cancelled and marked held: the host pool's reset
    /// then holds their slots (out of use, not freed) until the tier reports them, since a job's
    /// slots belong to it until the
    /// tier reports it (buffer ownership).
    fn drain_for_reset(&mut self) {
        let start = self.now();
        let deadline = self.options.reset_drain_deadline_ns;
        loop {
            self.poll_tiers();
            if self.in_flight.is_empty() {
                return;
            }
            if self.now().saturating_sub(start) >= deadline {
                break;
            }
            self.options.clock.sleep_ns(RESET_DRAIN_POLL_INTERVAL_NS);
        }
        self.counters.reset_drain_timeouts += 1;
        for (&id, job) in self.in_flight.iter_mut() {
            if !job.cancelled {
                job.cancelled = true;
                let entry = &mut self.tiers[job.tier];
                entry.counters.reset_jobs_cancelled += 1;
                entry.tier.cancel(id);
            }
        }
        // A tier honouring cancel reports at once (applied as usual, before the pool's reset).
        // What is still in flight after this poll is held: the pool's reset holds its slots
        // (never freed or reused) until the tier reports it, however long that takes.
        self.poll_tiers();
        for job in self.in_flight.values_mut() {
            if !job.held {
                job.held = true;
                self.tiers[job.tier].counters.reset_jobs_held += 1;
            }
        }
    }

    /// Drops promotions queued behind a busy tier for longer than the promotion deadline (never
    /// submitted), counting them.
    fn expire_queued_promotions(&mut self) {
        let now = self.now();
        let deadline = self.options.promotion_deadline_ns;
        // Queued behind a busy tier for too long: never submitted.
        let stale: Vec<(RequestId, usize)> = self
            .promotions_queued_ns
            .iter()
            .filter(|(_, &at)| now.saturating_sub(at) > deadline)
            .map(|(&batch, _)| batch)
            .collect();
        for (request, tier) in stale {
            self.promotions_queued_ns.remove(&(request, tier));
            if let Some(chunks) = self.promotions.remove(&(request, tier)) {
                self.tiers[tier].counters.promotions_timed_out += 1;
                self.tiers[tier].counters.jobs_dropped += 1;
                self.cancel_promotion(request, tier, &chunks);
            }
        }
    }

    /// Reaps every tier's completions and applies them.
    fn poll_tiers(&mut self) {
        let mut completions = std::mem::take(&mut self.scratch_completions);
        for tier in 0..self.tiers.len() {
            completions.clear();
            self.tiers[tier].tier.poll(&mut completions);
            for completion in completions.drain(..) {
                self.apply_completion(tier, completion);
            }
            self.take_evicted(tier);
        }
        self.scratch_completions = completions;
    }

    /// Turns the keys `tier` dropped by itself into `Removed` events with its medium.
    fn take_evicted(&mut self, tier: usize) {
        let mut keys = Vec::new();
        let lost = self.tiers[tier].tier.take_evicted(&mut keys);
        let entry = &mut self.tiers[tier];
        entry.counters.evictions_reported += keys.len() as u64;
        entry.counters.evictions_unreported += lost;
        let medium = entry.medium;
        for key in keys {
            self.push_tier_event(tier, KvEvent::Removed { key, medium });
        }
    }

    fn apply_completion(&mut self, tier: usize, completion: TierCompletion) {
        let id = completion.id;
        let Some(job) = self.in_flight.get(&id) else {
            let what = if id.0 < self.next_job {
                "reported twice (or is not a job of this manager)"
            } else {
                "unknown"
            };
            let name = self.tiers[tier].name.clone();
            self.broken(format_args!(
                "tier {name} reported job {} which is {what}",
                id.0
            ));
            return;
        };
        if job.tier != tier {
            let (name, owner) = (
                self.tiers[tier].name.clone(),
                self.tiers[job.tier].name.clone(),
            );
            self.broken(format_args!(
                "tier {name} reported job {} which was submitted to tier {owner}",
                id.0
            ));
            return;
        }
        let Some(job) = self.in_flight.remove(&id) else {
            return;
        };
        if job.held {
            // From before a reset: its keys mean nothing now; only its slots' holds end.
            let slots: Vec<SlotId> = job.chunks.iter().map(|c| c.slot).collect();
            self.host.release_held(&slots);
            self.tiers[tier].counters.reset_held_jobs_reported += 1;
            return;
        }
        let failed: BTreeSet<ChunkKey> = completion.failed_keys().collect();
        if let Some(stray) = failed
            .iter()
            .find(|k| !job.chunks.iter().any(|c| c.key == **k))
        {
            let name = self.tiers[tier].name.clone();
            self.broken(format_args!(
                "tier {name} failed key {:#x}/{} which job {} does not name",
                stray.hash, stray.group, id.0
            ));
        }
        let mut counted = BTreeSet::new();
        for f in &completion.failed {
            let named = job.chunks.iter().any(|c| c.key == f.key);
            if named && counted.insert(f.key) {
                self.tiers[tier].counters.failures.add(f.kind);
            }
        }
        let elapsed = self.now().saturating_sub(job.submitted_ns);
        match job.op {
            TierOp::Store => self.cascade_done(tier, &job, &failed, elapsed),
            TierOp::Load => self.promotion_done(tier, &job, &failed, elapsed),
        }
    }

    fn cascade_done(
        &mut self,
        tier: usize,
        job: &InFlight,
        failed: &BTreeSet<ChunkKey>,
        elapsed: u64,
    ) {
        let keys: Vec<ChunkKey> = job.chunks.iter().map(|c| c.key).collect();
        self.host.complete_load(&keys);
        let medium = self.tiers[tier].medium;
        let counters = &mut self.tiers[tier].counters;
        counters.store_ns += elapsed;
        let mut stored = Vec::new();
        for &TierChunk { key, len, .. } in &job.chunks {
            if failed.contains(&key) {
                counters.store_chunks_failed += 1;
            } else {
                counters.chunks_stored += 1;
                counters.bytes_stored += u64::from(len);
                stored.push(key);
            }
        }
        for key in stored {
            self.push_tier_event(tier, KvEvent::Stored { key, medium });
        }
    }

    fn promotion_done(
        &mut self,
        tier: usize,
        job: &InFlight,
        failed: &BTreeSet<ChunkKey>,
        elapsed: u64,
    ) {
        let mut ok = Vec::new();
        let mut bad = Vec::new();
        for &TierChunk { key, .. } in &job.chunks {
            if failed.contains(&key) {
                bad.push(key);
            } else {
                ok.push(key);
            }
        }
        let counters = &mut self.tiers[tier].counters;
        counters.load_ns += elapsed;
        counters.chunks_loaded += ok.len() as u64;
        counters.bytes_loaded += ok.len() as u64 * u64::from(self.options.slot_bytes);
        counters.load_chunks_failed += bad.len() as u64;
        // A failed key's slot holds no valid data: freed, never served.
        self.host.complete_store(&ok, true);
        self.host.complete_store(&bad, false);
        self.pin_promoted(job.request, &ok);
        if bad.is_empty() {
            return;
        }
        // Remember the failure for the requests that wait on it, so they recompute instead of
        // asking the same tier again. The job's request is the one that asked.
        for state in self.requests.values_mut() {
            for &key in &bad {
                state.failed.insert((key, tier));
            }
        }
    }

    /// A request may be finalized once finished with no host store pending.
    fn try_finalize(&mut self, request: RequestId) {
        let Some(state) = self.requests.get(&request) else {
            return;
        };
        if !state.finished || state.host_stores_pending > 0 {
            return;
        }
        // Design.md section 4 item 4: queued promotions go out (or are cancelled) first.
        for tier in 0..self.tiers.len() {
            self.submit_promotion(request, tier, true);
        }
        if self
            .requests
            .get(&request)
            .is_some_and(|r| r.cascades_queued > 0)
        {
            self.retry_cascades();
        }
        if self
            .requests
            .get(&request)
            .is_some_and(|r| r.cascades_queued > 0)
        {
            // Its cascades wait for a busy tier; finalized once they went out.
            self.finalize_waiting.insert(request);
            return;
        }
        self.finalize_waiting.remove(&request);
        self.requests.remove(&request);
        for entry in &mut self.tiers {
            entry.tier.on_request_finished(request);
        }
        self.counters.requests_finalized += 1;
        if self.finalized.insert(request) {
            self.finalized_order.push_back(request);
        }
        while self.finalized_order.len() > FINALIZED_REMEMBERED_MAX {
            if let Some(old) = self.finalized_order.pop_front() {
                self.finalized.remove(&old);
            }
        }
    }

    fn finalize_waiting_requests(&mut self) {
        let waiting: Vec<RequestId> = self.finalize_waiting.iter().copied().collect();
        for request in waiting {
            self.try_finalize(request);
        }
    }
}

impl OffloadManager for TieringManager {
    fn lookup(&mut self, key: ChunkKey, request: RequestId) -> LookupResult {
        if !self.check_live(request, "lookup") {
            return LookupResult::Miss;
        }
        if self.tiers.is_empty() {
            return self.host.lookup(key, request);
        }
        let answer = match self.host.lookup(key, request) {
            LookupResult::Miss => self.lookup_tiers(key, request),
            LookupResult::Hit => {
                let hits = &mut self.state(request).scan_hits;
                if hits.len() < SCAN_HITS_MAX {
                    hits.push(key);
                }
                LookupResult::Hit
            }
            answer => answer,
        };
        if answer == LookupResult::Miss {
            // The scan stops here; the next lookup of this request starts another.
            if let Some(r) = self.requests.get_mut(&request) {
                r.scan_hits.clear();
            }
        }
        answer
    }

    fn prepare_load(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        slots: &mut Vec<SlotId>,
    ) -> Result<(), CoreError> {
        if !self.check_live(request, "prepare_load") {
            return Err(CoreError::Invariant(format!(
                "prepare_load for finished request {}",
                request.0
            )));
        }
        let loaded = self.host.prepare_load(keys, request, slots);
        // The request took what it could (or failed and recomputes): its promotion pins go, the
        // chunks it loads being pinned by the load itself.
        self.release_promotion_pins(request);
        loaded?;
        if let Some(&first) = keys.first() {
            let now = self.now();
            self.host_loads.entry(first).or_default().push_back(now);
        }
        Ok(())
    }

    fn complete_load(&mut self, keys: &[ChunkKey]) {
        self.host.complete_load(keys);
        let Some(&first) = keys.first() else {
            return;
        };
        let start = self
            .host_loads
            .get_mut(&first)
            .and_then(VecDeque::pop_front);
        if self.host_loads.get(&first).is_some_and(VecDeque::is_empty) {
            self.host_loads.remove(&first);
        }
        let now = self.now();
        self.counters.host_chunks_loaded += keys.len() as u64;
        self.counters.host_bytes_loaded += keys.len() as u64 * u64::from(self.options.slot_bytes);
        if let Some(start) = start {
            self.counters.host_load_ns += now.saturating_sub(start);
        }
    }

    fn touch(&mut self, keys: &[ChunkKey], request: RequestId) {
        if !self.check_live(request, "touch") {
            return;
        }
        self.host.touch(keys, request);
        for entry in &mut self.tiers {
            entry.tier.touch(keys);
        }
    }

    fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        out: &mut PreparedStore,
    ) -> Result<(), CoreError> {
        if !self.check_live(request, "prepare_store") {
            out.clear();
            return Err(CoreError::Invariant(format!(
                "prepare_store for finished request {}",
                request.0
            )));
        }
        self.host.prepare_store(keys, request, out)?;
        let now = self.now();
        for &key in &out.keys {
            self.host_stores.insert(key, (request, now));
        }
        self.state(request).host_stores_pending += out.keys.len() as u32;
        Ok(())
    }

    fn complete_store(&mut self, keys: &[ChunkKey], success: bool) {
        // Group this call's keys by request (one store job serves one request).
        let mut by_request: BTreeMap<RequestId, (Vec<ChunkKey>, u64)> = BTreeMap::new();
        for &key in keys {
            if let Some((request, start)) = self.host_stores.remove(&key) {
                let entry = by_request.entry(request).or_insert((Vec::new(), start));
                entry.0.push(key);
                entry.1 = entry.1.min(start);
            }
        }
        self.host.complete_store(keys, success);
        let now = self.now();
        for (request, (keys, start)) in by_request {
            if success {
                self.counters.host_chunks_stored += keys.len() as u64;
                self.counters.host_bytes_stored +=
                    keys.len() as u64 * u64::from(self.options.slot_bytes);
                self.counters.host_store_ns += now.saturating_sub(start);
                self.cascade(request, &keys);
            }
            if let Some(state) = self.requests.get_mut(&request) {
                state.host_stores_pending -= keys.len() as u32;
            }
            self.try_finalize(request);
        }
    }

    fn on_request_finished(&mut self, request: RequestId) {
        if self.finalized.contains(&request)
            || self.requests.get(&request).is_some_and(|r| r.finished)
        {
            self.broken(format_args!(
                "on_request_finished twice for request {}",
                request.0
            ));
            return;
        }
        self.state(request).finished = true;
        self.release_promotion_pins(request);
        self.try_finalize(request);
    }

    fn reset(&mut self) {
        self.counters.resets += 1;
        // Promotions queued and not submitted: no tier touches their slots, which are freed.
        let queued = std::mem::take(&mut self.promotions);
        self.promotions_queued_ns.clear();
        for chunks in queued.into_values() {
            let keys: Vec<ChunkKey> = chunks.iter().map(|c| c.key).collect();
            self.host.complete_store(&keys, false);
        }
        // Tier I/O reads and writes host slots. The wait has a deadline, after which what is
        // still in flight is cancelled and its slots held by the pool's reset below.
        self.drain_for_reset();
        self.drop_queued_cascades();
        // Promotion pins guard no I/O: released before the pool's reset, so nothing holds them.
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for &id in &ids {
            self.release_promotion_pins(id);
        }
        self.host.reset();
        // The scheduler's host stores and loads end with its jobs (it ends their holds).
        self.host_stores.clear();
        self.host_loads.clear();
        for id in ids {
            if let Some(state) = self.requests.get_mut(&id) {
                state.host_stores_pending = 0;
                state.failed.clear();
                state.scan_hits.clear();
            }
            self.try_finalize(id);
        }
    }

    fn release_held(&mut self, slots: &[SlotId]) {
        self.host.release_held(slots);
    }

    fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        self.pull_host_events();
        out.extend(self.events.drain(..).map(|e| e.event));
    }
}

impl Drop for TieringManager {
    fn drop(&mut self) {
        // Tier jobs own host slots until reported: wait for them, up to the drain deadline.
        // Past it they are cancelled; each tier's own drop then ends its I/O (its threads hold
        // the slot memory they may still write) before that memory can go.
        self.drain();
    }
}
