//! One step on the workers: `reset_before`, flushes and loads, then the compute (the model writes
//! the KV bytes of every scheduled token and samples where a request reached its end), then stores.
//! Every completion is checked as it happens: a successful store's copied bytes must equal the
//! model's, and no load may write blocks of a request that no longer holds them.

use offload_core::{ConnectorMeta, JobKind};

use super::request::Phase;
use super::{EngineConnector, Plan, Sim, StepOutput, TrackedJob};
use crate::worker::{Completion, Worker, WorkerEnv};

impl<C: EngineConnector> Sim<C> {
    pub(super) fn execute(&mut self, step: u64, plan: &Plan, meta: &ConnectorMeta) -> StepOutput {
        let mut done = Vec::new();
        self.each_worker(
            |w, env, done| w.begin_step(step, meta, env, done),
            &mut done,
        );
        self.on_completions(&done);
        done.clear();
        let sampled = self.compute(plan);
        self.each_worker(|w, env, done| w.end_step(step, meta, env, done), &mut done);
        self.on_completions(&done);
        StepOutput {
            workers: self.workers.iter_mut().map(|w| w.take_output()).collect(),
            sampled,
        }
    }

    /// Runs `f` on every worker with its view of the GPU and host memory, gathering completions.
    fn each_worker(
        &mut self,
        mut f: impl FnMut(&mut Worker, &mut WorkerEnv<'_>, &mut Vec<Completion>),
        done: &mut Vec<Completion>,
    ) {
        for w in &mut self.workers {
            let mut env = WorkerEnv {
                gpu: &mut self.gpu,
                host: &mut self.host,
                copier: self.copier.as_mut(),
                geo: self.geo,
            };
            f(w, &mut env, done);
        }
    }

    /// The forward pass: writes each scheduled token's KV into its block, and samples the next
    /// token for requests whose scheduled tokens reach their last token.
    fn compute(&mut self, plan: &Plan) -> Vec<usize> {
        let width = self.model.token_bytes();
        let tpb = self.cfg.tokens_per_block;
        let mut sampled = Vec::new();
        for s in &plan.scheduled {
            let r = &mut self.reqs[s.idx];
            let end = s.computed_before + s.num_new;
            for t in s.computed_before..end {
                let block = r.blocks[(t / tpb) as usize];
                let at = self.model.offset_in_block(t);
                let dst = &mut self.gpu.block_mut(block)[at..at + width];
                self.model.token_kv(r.chain.token_hash(t), dst);
            }
            if end == r.chain.len() {
                let token = r.chain.next_token();
                r.chain.push(token);
                sampled.push(s.idx);
            }
        }
        sampled
    }

    fn on_completions(&mut self, done: &[Completion]) {
        for c in done {
            self.report.jobs_acked += 1;
            if !c.success {
                self.report.acks_failed += 1;
            }
            self.count_ack(c);
            match c.job.kind {
                JobKind::Store if c.success => self.verify_store(c),
                JobKind::Load => self.check_load_target(c),
                _ => {}
            }
        }
    }

    fn count_ack(&mut self, c: &Completion) {
        let workers = self.cfg.worker_count;
        let Some(job) = self.jobs.get_mut(&c.job.id) else {
            self.violation(format!(
                "worker {} completed job {}, which is not in flight",
                c.worker, c.job.id.0
            ));
            return;
        };
        let TrackedJob { kind, acks } = job;
        *acks += 1;
        debug_assert_eq!(*kind, c.job.kind);
        if *acks == workers {
            self.jobs.remove(&c.job.id);
        }
    }

    /// A load (or a failed load's torn copy) wrote GPU blocks: the request must still hold them.
    fn check_load_target(&mut self, c: &Completion) {
        let Some(idx) = self.index_of(c.job.request) else {
            return;
        };
        let r = &self.reqs[idx];
        let holds = r.phase == Phase::WaitingForRemote || (r.phase == Phase::Done && r.kept);
        if !holds {
            let what = format!(
                "load job {} wrote GPU blocks of request {} ({:?}, kept {}), which no longer holds them",
                c.job.id.0, r.id.0, r.phase, r.kept
            );
            self.violation(what);
        }
    }
}
