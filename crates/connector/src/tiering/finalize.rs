//! Finalization: a request's state goes, and the secondary tiers hear `on_request_finished`, once
//! it finished with no host store pending and its promotions and cascades went out.

use offload_core::RequestId;

use super::{TieringManager, FINALIZED_REMEMBERED_MAX};

impl TieringManager {
    /// A request may be finalized once finished with no host store pending.
    pub(super) fn try_finalize(&mut self, request: RequestId) {
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

    pub(super) fn finalize_waiting_requests(&mut self) {
        let waiting: Vec<RequestId> = self.finalize_waiting.iter().copied().collect();
        for request in waiting {
            self.try_finalize(request);
        }
    }
}
