//! [`SchedulerHandle`]: what an engine's scheduler embeds. It wraps offload-core's
//! [`Scheduler`] over a [`TieringManager`] and calls the manager's per-step hooks around each
//! step's metadata, so the engine makes the same calls, in the same order, as with the bare
//! scheduler (see [`offload_core::scheduler`]'s module doc for that order).

use offload_core::scheduler::FinishedRequest;
use offload_core::{
    BlockId, ConnectorMeta, CoreError, KvEvent, MatchResult, NewRequest, OffloadManager, RequestId,
    Scheduler, SchedulerConfig, StepInput, UpdateOutcome, WorkerOutput,
};

use crate::metrics::Metrics;
use crate::tiering::{TierEvent, TierMask, TieringManager};

/// A manager that is, or wraps, a [`TieringManager`] (for example a checking wrapper in a test
/// harness), so that [`SchedulerHandle`] can reach its per-step hooks.
pub trait AsTiering: OffloadManager {
    /// The tiering manager.
    fn tiering(&self) -> &TieringManager;
    /// The tiering manager, for its hooks. Calls that bypass a wrapper's checks must not be made
    /// through it.
    fn tiering_mut(&mut self) -> &mut TieringManager;
}

impl AsTiering for TieringManager {
    fn tiering(&self) -> &TieringManager {
        self
    }
    fn tiering_mut(&mut self) -> &mut TieringManager {
        self
    }
}

/// The engine-facing scheduler side of kvtier: request lifecycle, per-step worker metadata,
/// prefix lookups across every tier, KV events and metrics.
///
/// Per step the engine calls, in order: `on_new_request` / `request_finished` as requests come
/// and go, `get_num_new_matched_tokens` and `update_state_after_alloc` while scheduling,
/// `build_connector_meta` once (send the meta to every worker), `update_connector_output` with
/// the workers' outputs, and `take_released` to learn which finished requests' blocks may be
/// freed.
pub struct SchedulerHandle<M: AsTiering = TieringManager> {
    scheduler: Scheduler<M>,
}

impl<M: AsTiering> SchedulerHandle<M> {
    /// A handle over `manager`; fails naming the setting if `config` is invalid.
    pub fn new(config: SchedulerConfig, manager: M) -> Result<Self, CoreError> {
        Ok(Self {
            scheduler: Scheduler::new(config, manager)?,
        })
    }

    /// A request arrived.
    pub fn on_new_request(&mut self, request: NewRequest) {
        self.scheduler.on_new_request(request);
    }

    /// Limits the secondary tiers `request` may load from (call before its first lookup).
    pub fn set_request_tiers(&mut self, request: RequestId, tiers: TierMask) {
        self.scheduler
            .manager_mut()
            .tiering_mut()
            .set_request_tiers(request, tiers);
    }

    /// Prefix lookup for a waiting request (host pool, then the secondary tiers in order).
    pub fn get_num_new_matched_tokens(
        &mut self,
        id: RequestId,
        num_tokens: u32,
        block_hashes: &[u128],
        num_computed_tokens: u32,
    ) -> MatchResult {
        self.scheduler
            .get_num_new_matched_tokens(id, num_tokens, block_hashes, num_computed_tokens)
    }

    /// The request's blocks were allocated; builds its load job.
    pub fn update_state_after_alloc(
        &mut self,
        id: RequestId,
        block_ids: &[BlockId],
        num_external_tokens: u32,
    ) {
        self.scheduler
            .update_state_after_alloc(id, block_ids, num_external_tokens);
    }

    /// This step's metadata for every worker. Reaps tier completions first and submits the
    /// step's promotions after.
    pub fn build_connector_meta(&mut self, step: &StepInput<'_>) -> ConnectorMeta {
        self.scheduler.manager_mut().tiering_mut().begin_step();
        let meta = self.scheduler.build_connector_meta(step);
        self.scheduler.manager_mut().tiering_mut().end_step();
        meta
    }

    /// The workers' acknowledgements (host stores completed here start their cascades).
    pub fn update_connector_output(&mut self, outputs: &[WorkerOutput]) -> UpdateOutcome {
        self.scheduler.update_connector_output(outputs)
    }

    /// A request finished or was aborted; `true`: keep its blocks until
    /// [`SchedulerHandle::take_released`] names it.
    pub fn request_finished(&mut self, request: &FinishedRequest<'_>) -> bool {
        self.scheduler.request_finished(request)
    }

    /// Drops everything in the host pool (secondary tiers keep their data); returns the loads
    /// cancelled before any worker got them, which the engine recomputes. Loads the workers
    /// already have fail in the `update_connector_output` that brings their last
    /// acknowledgement (they may write the request's blocks until then); slots that jobs in
    /// flight may still write stay out of use until those jobs are over.
    pub fn reset_cache(&mut self) -> UpdateOutcome {
        self.scheduler.reset_cache()
    }

    /// Finished requests whose engine blocks may now be freed.
    pub fn take_released(&mut self, out: &mut Vec<RequestId>) {
        self.scheduler.take_released(out);
    }

    /// KV events since the last call (no tier names; see [`SchedulerHandle::take_tier_events`]).
    pub fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        self.scheduler.manager_mut().take_events(out);
    }

    /// KV events since the last call, each with its tier's name.
    pub fn take_tier_events(&mut self, out: &mut Vec<TierEvent>) {
        self.scheduler
            .manager_mut()
            .tiering_mut()
            .take_tier_events(out);
    }

    /// A snapshot of every counter.
    pub fn metrics(&self) -> Metrics {
        Metrics::gather(self.scheduler.stats(), self.scheduler.manager().tiering())
    }

    /// Every counter in the Prometheus text format.
    pub fn prometheus_text(&self) -> String {
        self.metrics().to_prometheus()
    }

    /// Reaps secondary-tier completions without blocking (what `build_connector_meta` does
    /// first); an engine with no step to run for a while calls it so that cascades release their
    /// host-slot pins and promotions land.
    pub fn poll_tiers(&mut self) {
        self.scheduler.manager_mut().tiering_mut().begin_step();
    }

    /// Waits until every secondary-tier job was reported (for shutdown and tests), at most the
    /// reset drain deadline ([`TieringManager::drain`]); `false` if jobs are still in flight.
    pub fn drain_tiers(&mut self) -> bool {
        let drained = self.scheduler.manager_mut().tiering_mut().drain();
        self.scheduler.manager_mut().tiering_mut().begin_step();
        drained
    }

    /// The scheduler, for inspection.
    pub fn scheduler(&self) -> &Scheduler<M> {
        &self.scheduler
    }

    /// The scheduler, for direct calls (tests and tools); they bypass the per-step hooks.
    pub fn scheduler_mut(&mut self) -> &mut Scheduler<M> {
        &mut self.scheduler
    }

    /// The manager.
    pub fn manager(&self) -> &M {
        self.scheduler.manager()
    }

    /// The tiering manager.
    pub fn tiering(&self) -> &TieringManager {
        self.scheduler.manager().tiering()
    }
}
