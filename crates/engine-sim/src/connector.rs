//! The engine-facing calls the simulator makes, as a trait: kvtier's [`Scheduler`] (wrapped around a
//! [`CheckedManager`]) implements it, so does the connector's [`SchedulerHandle`] over a checked
//! tiering manager ([`KvHandle`]: host pool plus secondary tiers), and so does [`NullConnector`], an
//! engine without offload that serves as the baseline and lets the engine loop be tested on its own.

use offload_core::scheduler::FinishedRequest;
use offload_core::{
    BlockId, ConnectorMeta, KvEvent, MatchResult, NewRequest, OffloadManager, RequestId, Scheduler,
    StepInput, UpdateOutcome, WorkerOutput,
};

use ::connector::{AsTiering, SchedulerHandle, TieringManager};

use crate::checked::CheckedManager;

/// kvtier's scheduler as the simulator drives it: over a checked manager.
pub type KvScheduler<M> = Scheduler<CheckedManager<M>>;

/// The connector's scheduler handle as the simulator drives it: over a checked tiering manager.
pub type KvHandle<M = TieringManager> = SchedulerHandle<CheckedManager<M>>;

/// The scheduler-side connector calls, in the shape of [`Scheduler`]'s API (see its module doc for
/// the call order).
pub trait EngineConnector {
    /// A request arrived.
    fn on_new_request(&mut self, request: NewRequest);
    /// Prefix lookup for a waiting request.
    fn get_num_new_matched_tokens(
        &mut self,
        id: RequestId,
        num_tokens: u32,
        block_hashes: &[u128],
        num_computed_tokens: u32,
    ) -> MatchResult;
    /// The request's whole block table was allocated.
    fn update_state_after_alloc(
        &mut self,
        id: RequestId,
        block_ids: &[BlockId],
        num_external_tokens: u32,
    );
    /// This step's worker metadata.
    fn build_connector_meta(&mut self, step: &StepInput<'_>) -> ConnectorMeta;
    /// Workers' acknowledgements.
    fn update_connector_output(&mut self, outputs: &[WorkerOutput]) -> UpdateOutcome;
    /// A request finished or was aborted; `true`: keep its blocks until released.
    fn request_finished(&mut self, request: &FinishedRequest<'_>) -> bool;
    /// Drop everything offloaded.
    fn reset_cache(&mut self) -> UpdateOutcome;
    /// Finished requests whose blocks may now be freed.
    fn take_released(&mut self, out: &mut Vec<RequestId>);
    /// KV events since the last call.
    fn take_events(&mut self, out: &mut Vec<KvEvent>);
    /// Whether the manager heard `on_request_finished` for `id` (true where nothing tracks it).
    fn is_request_closed(&self, id: RequestId) -> bool;
    /// Problems visible only at the end of a run (leaked pins or prepared stores), appended to `out`.
    fn end_of_run_problems(&self, out: &mut Vec<String>);
    /// Contract violations the connector counted without panicking (its own and its checker's),
    /// and the checker's first messages.
    fn violations(&self) -> (u64, &[String]);
}

impl<M: OffloadManager> EngineConnector for KvScheduler<M> {
    fn on_new_request(&mut self, request: NewRequest) {
        Scheduler::on_new_request(self, request);
    }
    fn get_num_new_matched_tokens(
        &mut self,
        id: RequestId,
        num_tokens: u32,
        block_hashes: &[u128],
        num_computed_tokens: u32,
    ) -> MatchResult {
        Scheduler::get_num_new_matched_tokens(
            self,
            id,
            num_tokens,
            block_hashes,
            num_computed_tokens,
        )
    }
    fn update_state_after_alloc(
        &mut self,
        id: RequestId,
        block_ids: &[BlockId],
        num_external_tokens: u32,
    ) {
        Scheduler::update_state_after_alloc(self, id, block_ids, num_external_tokens);
    }
    fn build_connector_meta(&mut self, step: &StepInput<'_>) -> ConnectorMeta {
        Scheduler::build_connector_meta(self, step)
    }
    fn update_connector_output(&mut self, outputs: &[WorkerOutput]) -> UpdateOutcome {
        Scheduler::update_connector_output(self, outputs)
    }
    fn request_finished(&mut self, request: &FinishedRequest<'_>) -> bool {
        Scheduler::request_finished(self, request)
    }
    fn reset_cache(&mut self) -> UpdateOutcome {
        Scheduler::reset_cache(self)
    }
    fn take_released(&mut self, out: &mut Vec<RequestId>) {
        Scheduler::take_released(self, out);
    }
    fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        self.manager_mut().take_events(out);
    }
    fn is_request_closed(&self, id: RequestId) -> bool {
        self.manager().is_finished(id)
    }
    fn end_of_run_problems(&self, out: &mut Vec<String>) {
        let (stores, pins) = self.manager().outstanding();
        if stores > 0 {
            out.push(format!("{stores} prepared stores never completed"));
        }
        if pins > 0 {
            out.push(format!("{pins} load pins never released"));
        }
    }
    fn violations(&self) -> (u64, &[String]) {
        let count = self.manager().violation_count() + self.stats().invariant_failures;
        (count, self.manager().violations())
    }
}

impl<M: AsTiering> EngineConnector for KvHandle<M> {
    fn on_new_request(&mut self, request: NewRequest) {
        SchedulerHandle::on_new_request(self, request);
    }
    fn get_num_new_matched_tokens(
        &mut self,
        id: RequestId,
        num_tokens: u32,
        block_hashes: &[u128],
        num_computed_tokens: u32,
    ) -> MatchResult {
        SchedulerHandle::get_num_new_matched_tokens(
            self,
            id,
            num_tokens,
            block_hashes,
            num_computed_tokens,
        )
    }
    fn update_state_after_alloc(
        &mut self,
        id: RequestId,
        block_ids: &[BlockId],
        num_external_tokens: u32,
    ) {
        SchedulerHandle::update_state_after_alloc(self, id, block_ids, num_external_tokens);
    }
    fn build_connector_meta(&mut self, step: &StepInput<'_>) -> ConnectorMeta {
        SchedulerHandle::build_connector_meta(self, step)
    }
    fn update_connector_output(&mut self, outputs: &[WorkerOutput]) -> UpdateOutcome {
        SchedulerHandle::update_connector_output(self, outputs)
    }
    fn request_finished(&mut self, request: &FinishedRequest<'_>) -> bool {
        SchedulerHandle::request_finished(self, request)
    }
    fn reset_cache(&mut self) -> UpdateOutcome {
        SchedulerHandle::reset_cache(self)
    }
    fn take_released(&mut self, out: &mut Vec<RequestId>) {
        SchedulerHandle::take_released(self, out);
    }
    fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        SchedulerHandle::take_events(self, out);
    }
    /// Closed once the checker saw the finish and the tiers heard it (a finished request may
    /// wait for its cascades to be submitted to a busy tier).
    fn is_request_closed(&self, id: RequestId) -> bool {
        self.manager().is_finished(id) && !self.tiering().is_awaiting_finalization(id)
    }
    fn end_of_run_problems(&self, out: &mut Vec<String>) {
        let (stores, pins) = self.manager().outstanding();
        if stores > 0 {
            out.push(format!("{stores} prepared stores never completed"));
        }
        if pins > 0 {
            out.push(format!("{pins} load pins never released"));
        }
        out.extend(self.tiering().leaks());
    }
    fn violations(&self) -> (u64, &[String]) {
        let count = self.manager().violation_count()
            + self.scheduler().stats().invariant_failures
            + self.tiering().counters().invariant_failures;
        (count, self.manager().violations())
    }
}

/// An engine without offload: nothing matches, no job is ever built, blocks are freed at once.
#[derive(Clone, Debug, Default)]
pub struct NullConnector;

impl EngineConnector for NullConnector {
    fn on_new_request(&mut self, _request: NewRequest) {}
    fn get_num_new_matched_tokens(
        &mut self,
        _: RequestId,
        _: u32,
        _: &[u128],
        _: u32,
    ) -> MatchResult {
        MatchResult::Tokens(0)
    }
    fn update_state_after_alloc(&mut self, _: RequestId, _: &[BlockId], _: u32) {}
    fn build_connector_meta(&mut self, step: &StepInput<'_>) -> ConnectorMeta {
        ConnectorMeta {
            step: step.step,
            ..ConnectorMeta::default()
        }
    }
    fn update_connector_output(&mut self, _: &[WorkerOutput]) -> UpdateOutcome {
        UpdateOutcome::default()
    }
    fn request_finished(&mut self, _: &FinishedRequest<'_>) -> bool {
        false
    }
    fn reset_cache(&mut self) -> UpdateOutcome {
        UpdateOutcome::default()
    }
    fn take_released(&mut self, _: &mut Vec<RequestId>) {}
    fn take_events(&mut self, _: &mut Vec<KvEvent>) {}
    fn is_request_closed(&self, _: RequestId) -> bool {
        true
    }
    fn end_of_run_problems(&self, _: &mut Vec<String>) {}
    fn violations(&self) -> (u64, &[String]) {
        (0, &[])
    }
}
