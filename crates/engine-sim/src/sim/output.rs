//! Processing a step's model output: sampled tokens (a request finishes at its output length),
//! the workers' acknowledgements (`update_connector_output`, whose load outcomes let waiting
//! requests go on), finishes (`request_finished`) and releases (`take_released`).

use offload_core::scheduler::FinishedRequest;
use offload_core::{FinishKind, RequestId, WorkerOutput};

use super::request::{KvSource, Phase};
use super::{EngineConnector, Sim, StepOutput};
use crate::config::OutputOrder;

impl<C: EngineConnector> Sim<C> {
    pub(super) fn process_output(&mut self, out: StepOutput) {
        if self.cfg.output_order == OutputOrder::AcksFirst {
            self.handle_acks(&out.workers);
        }
        for &idx in &out.sampled {
            self.on_sampled(idx);
        }
        if self.cfg.output_order == OutputOrder::FinishesFirst {
            self.handle_acks(&out.workers);
        }
    }

    fn on_sampled(&mut self, idx: usize) {
        let tpb = self.cfg.tokens_per_block;
        let r = &mut self.reqs[idx];
        if r.phase == Phase::Done {
            return;
        }
        r.placeholders -= 1;
        r.num_known += 1;
        r.chain.extend_block_hashes(tpb, r.num_known, &mut r.hashes);
        self.report.output_tokens += 1;
        if r.num_known - r.prompt_len >= r.spec.max_tokens {
            self.finish(idx, FinishKind::Finished);
        }
    }

    fn handle_acks(&mut self, outputs: &[WorkerOutput]) {
        let outcome = self.connector.update_connector_output(outputs);
        self.drain_released();
        for (id, ok) in outcome.loads {
            self.on_load_end(id, ok);
        }
    }

    /// A load job ended: on success its tokens count as computed (after checking every loaded
    /// block against the model); on failure they are recomputed.
    pub(super) fn on_load_end(&mut self, id: RequestId, ok: bool) {
        let Some(idx) = self.index_of(id) else {
            self.violation(format!("load outcome for unknown request {}", id.0));
            return;
        };
        let r = &mut self.reqs[idx];
        let load = r.load.take();
        if r.phase == Phase::Done {
            return;
        }
        let (Some((local, ext)), Phase::WaitingForRemote) = (load, r.phase) else {
            let what = format!(
                "load outcome for request {} ({:?}), which has no load in flight",
                id.0, r.phase
            );
            self.violation(what);
            return;
        };
        if ok {
            self.verify_loaded(idx, local, ext);
            self.report.loads_ok += 1;
            self.report.tokens_loaded += u64::from(ext);
            let gain = self.reqs[idx].gain(local, local + ext, KvSource::Loaded);
            self.report.prompt_tokens_loaded += u64::from(gain.prompt);
            self.report.decode_tokens_reused += u64::from(gain.beyond_prompt);
            self.report.tokens_loaded_again += u64::from(gain.again);
        } else {
            self.report.loads_failed += 1;
            self.report.tokens_load_failed += u64::from(ext);
        }
        let computed = if ok { local + ext } else { local };
        let r = &mut self.reqs[idx];
        r.num_computed = computed;
        r.phase = Phase::Waiting;
        r.skip_lookup = true;
        self.cache_blocks(idx, computed);
    }

    /// Ends a request: `request_finished`, then frees its blocks unless kvtier keeps them.
    pub(super) fn finish(&mut self, idx: usize, kind: FinishKind) {
        if self.cfg.verify_requests {
            self.verify_request_kv(idx, "finish");
        }
        self.running.retain(|&i| i != idx);
        self.waiting.retain(|&i| i != idx);
        let r = &mut self.reqs[idx];
        r.phase = Phase::Done;
        r.finish = Some(kind);
        r.finish_called = true;
        match kind {
            FinishKind::Finished => self.report.requests_finished += 1,
            FinishKind::Aborted => self.report.requests_aborted += 1,
        }
        let unserved = r.prompt_len - r.split.total();
        self.report.prompt_tokens_unserved += u64::from(unserved);
        if kind == FinishKind::Finished && unserved > 0 {
            let what = format!(
                "request {} finished with {unserved} of its {} prompt tokens never given KV",
                r.id.0, r.prompt_len
            );
            self.violation(what);
        }
        let r = &mut self.reqs[idx];
        let finished = FinishedRequest {
            id: r.id,
            kind,
            num_tokens: r.num_known,
            num_computed_tokens: r.num_computed,
            block_hashes: &r.hashes,
        };
        let keep = self.connector.request_finished(&finished);
        if keep {
            r.kept = true;
            self.report.finishes_deferred += 1;
        } else {
            self.free_blocks(idx);
        }
        self.drain_released();
    }

    pub(super) fn on_released(&mut self, id: RequestId) {
        let held = self
            .index_of(id)
            .filter(|&i| self.reqs[i].phase == Phase::Done && self.reqs[i].kept);
        let Some(idx) = held else {
            self.violation(format!(
                "take_released named request {}, whose blocks the engine does not hold for kvtier",
                id.0
            ));
            return;
        };
        self.reqs[idx].kept = false;
        self.free_blocks(idx);
    }

    /// Frees a finished request's blocks (its computed full blocks stay in the prefix cache).
    fn free_blocks(&mut self, idx: usize) {
        let computed = self.reqs[idx].num_computed;
        self.cache_blocks(idx, computed);
        let blocks = std::mem::take(&mut self.reqs[idx].blocks);
        self.pool.release(&blocks);
    }
}
