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
//!
//! Files, one idea each: `options.rs` ([`TieringOptions`], [`TierMask`]), `counters.rs`,
//! `events.rs` ([`TierEvent`]), `promotion.rs`, `cascade.rs`, `jobs.rs` (tier jobs in flight,
//! their reports, the drains), `finalize.rs`, and `offload.rs` (the [`OffloadManager`] calls the
//! scheduler makes). This file holds the manager's state and its inspection methods.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use offload_core::invariant;
use offload_core::tier::{Tier, TierChunk, TierCompletion, TierOp};
#[cfg(doc)]
use offload_core::OffloadManager;
use offload_core::{
    ChunkKey, CoreError, HostPool, JobId, KvEvent, Medium, PreparedStore, RequestId,
};

mod cascade;
mod counters;
mod events;
mod finalize;
mod jobs;
mod offload;
mod options;
mod promotion;

pub use counters::{FailureCounts, TierCounters, TieringCounters};
pub use events::TierEvent;
pub use options::{TierMask, TieringOptions};

/// Most secondary tiers (a [`TierMask`] has one bit per tier).
pub const TIERS_MAX: usize = 64;

/// Most keys of one request's lookup scan protected from eviction by its promotions.
pub const SCAN_HITS_MAX: usize = 4096;

/// How many finalized request ids are remembered to catch late calls for them.
pub const FINALIZED_REMEMBERED_MAX: usize = 65_536;

/// The name the host pool has in metrics and events.
pub const HOST_TIER_NAME: &str = "cpu";

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
}
