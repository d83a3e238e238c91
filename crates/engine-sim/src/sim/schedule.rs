//! Scheduling, as vLLM v1's scheduler does it: running requests first (decode, or the next chunk
//! of a prefill), preempting the last running request when blocks run out; then, if nothing was
//! preempted, waiting requests in order: GPU prefix cache, kvtier lookup, allocation,
//! `update_state_after_alloc`. A request with external tokens waits for its load
//! (`WAITING_FOR_REMOTE_KVS`); a `RetryLater` answer skips it for this step.

use offload_core::{
    BlockId, ConnectorMeta, FinishKind, MatchResult, NewRequest, StepInput, StepRequest,
};

use super::request::{KvSource, Phase};
use super::{EngineConnector, Plan, Scheduled, Sim};

/// What happened to a waiting request this step.
enum Admit {
    /// Scheduled with this many tokens.
    Scheduled(u32),
    /// Not scheduled (load started, load in flight, or retry later); stays in the queue.
    Skip,
    /// Not enough free blocks: stop admitting (unless nothing runs).
    NoRoom,
}

impl<C: EngineConnector> Sim<C> {
    pub(super) fn arrive(&mut self, step: u64) {
        while let Some(&idx) = self.arrivals.get(self.next_arrival) {
            if self.reqs[idx].spec.arrival_step > step {
                break;
            }
            self.next_arrival += 1;
            let r = &mut self.reqs[idx];
            r.phase = Phase::Waiting;
            self.report.prompt_tokens += u64::from(r.prompt_len);
            self.waiting.push_back(idx);
            self.connector.on_new_request(NewRequest {
                id: r.id,
                prompt_tokens: r.prompt_len,
                max_offload_tokens: r.spec.max_offload_tokens,
            });
        }
    }

    pub(super) fn abort_due(&mut self, step: u64) {
        for idx in 0..self.reqs.len() {
            let r = &self.reqs[idx];
            if !r.is_live() {
                continue;
            }
            let due = r.spec.abort_step.is_some_and(|s| s <= step);
            if due || self.abort_rng.chance_ppm(self.cfg.abort_ppm) {
                self.finish(idx, FinishKind::Aborted);
            }
        }
    }

    pub(super) fn schedule(&mut self) -> Plan {
        let mut plan = Plan::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        self.schedule_running(&mut budget, &mut plan);
        if plan.preempted.is_empty() {
            let no_room = self.schedule_waiting(&mut budget, &mut plan);
            if no_room && plan.scheduled.is_empty() && self.running.is_empty() {
                // Nothing runs and nothing fits: requests back from loads hold the blocks others
                // need (a deadlock vLLM can reach too).
                self.evict_waiting_holder(&mut plan);
            }
        }
        for s in &plan.scheduled {
            self.after_schedule(s.idx, s.computed_before, s.num_new);
        }
        plan
    }

    pub(super) fn build_meta(&mut self, step: u64, plan: &Plan) -> ConnectorMeta {
        let scheduled: Vec<StepRequest<'_>> = plan
            .scheduled
            .iter()
            .map(|s| {
                let r = &self.reqs[s.idx];
                StepRequest {
                    id: r.id,
                    num_computed_tokens: s.computed_before,
                    num_scheduled_tokens: s.num_new,
                    num_tokens: r.num_known,
                    new_block_ids: &s.new_blocks,
                    replace_blocks: s.replace,
                    block_hashes: &r.hashes,
                }
            })
            .collect();
        let input = StepInput {
            step,
            scheduled: &scheduled,
            preempted: &plan.preempted,
        };
        let meta = self.connector.build_connector_meta(&input);
        self.drain_released();
        meta
    }

    fn schedule_running(&mut self, budget: &mut u32, plan: &mut Plan) {
        let mut i = 0;
        for _ in 0..self.running.len() {
            if i >= self.running.len() || *budget == 0 {
                break;
            }
            let idx = self.running[i];
            let r = &self.reqs[idx];
            let computed = r.num_computed;
            let num_new = r
                .num_tokens_with_placeholders()
                .saturating_sub(computed)
                .min(*budget);
            if num_new == 0 {
                i += 1;
                continue;
            }
            let Some(new_blocks) = self.grow_blocks(idx, computed + num_new, plan) else {
                break;
            };
            plan.scheduled.push(Scheduled {
                idx,
                computed_before: computed,
                num_new,
                new_blocks,
                replace: false,
            });
            *budget -= num_new;
            i += 1;
        }
    }

    /// Allocates blocks so the running request `idx` covers `tokens`, preempting the last running
    /// requests while blocks are short. `None` if `idx` itself was preempted.
    fn grow_blocks(&mut self, idx: usize, tokens: u32, plan: &mut Plan) -> Option<Vec<BlockId>> {
        let need = self
            .blocks_for(tokens)
            .saturating_sub(self.reqs[idx].blocks.len()) as u32;
        for _ in 0..=self.running.len() + self.waiting.len() {
            let mut fresh = Vec::new();
            if self.pool.allocate(need, &mut fresh) {
                self.reqs[idx].blocks.extend_from_slice(&fresh);
                return Some(fresh);
            }
            // Lowest priority first: the last running request, then waiting requests that hold
            // blocks (back from a load), and only then the request itself.
            if self.running.last() == Some(&idx) && self.evict_waiting_holder(plan) {
                continue;
            }
            let victim = self.running.pop()?;
            self.preempt(victim, plan);
            if victim == idx {
                return None;
            }
        }
        None
    }

    fn preempt(&mut self, idx: usize, plan: &mut Plan) {
        if self.cfg.verify_requests {
            self.verify_request_kv(idx, "preemption");
        }
        let blocks = std::mem::take(&mut self.reqs[idx].blocks);
        self.pool.release(&blocks);
        let r = &mut self.reqs[idx];
        r.num_computed = 0;
        r.cached_blocks = 0;
        r.phase = Phase::Waiting;
        r.skip_lookup = false;
        plan.preempted.push(r.id);
        self.report.preemptions += 1;
        self.waiting.push_front(idx);
    }

    /// Admits waiting requests in order; returns whether one did not fit.
    fn schedule_waiting(&mut self, budget: &mut u32, plan: &mut Plan) -> bool {
        let mut skipped = Vec::new();
        let mut no_room = false;
        for _ in 0..self.waiting.len() {
            if *budget == 0 || self.running.len() >= self.cfg.max_num_seqs as usize {
                break;
            }
            let Some(idx) = self.waiting.pop_front() else {
                break;
            };
            match self.admit(idx, *budget, plan) {
                Admit::Scheduled(n) => {
                    *budget -= n;
                    self.running.push(idx);
                }
                Admit::Skip => skipped.push(idx),
                // Deliberate deviation from vLLM: with nothing running, no block will be freed
                // by this loop's requests, and a request that holds blocks (back from a load)
                // may sit behind one that does not fit; keep looking instead of deadlocking.
                Admit::NoRoom if self.running.is_empty() => {
                    no_room = true;
                    skipped.push(idx);
                }
                Admit::NoRoom => {
                    no_room = true;
                    self.waiting.push_front(idx);
                    break;
                }
            }
        }
        for idx in skipped.into_iter().rev() {
            self.waiting.push_front(idx);
        }
        no_room
    }

    /// Frees the blocks of the last request in the waiting queue that holds some (one back from
    /// a load); it starts over, listed as preempted so kvtier forgets its blocks. Returns whether
    /// there was one.
    fn evict_waiting_holder(&mut self, plan: &mut Plan) -> bool {
        let victim = self
            .waiting
            .iter()
            .rev()
            .copied()
            .find(|&i| self.reqs[i].phase == Phase::Waiting && !self.reqs[i].blocks.is_empty());
        let Some(idx) = victim else { return false };
        if self.cfg.verify_requests {
            self.verify_request_kv(idx, "preemption while waiting");
        }
        let blocks = std::mem::take(&mut self.reqs[idx].blocks);
        self.pool.release(&blocks);
        let r = &mut self.reqs[idx];
        r.num_computed = 0;
        r.cached_blocks = 0;
        r.skip_lookup = false;
        plan.preempted.push(r.id);
        self.report.preemptions += 1;
        true
    }

    fn admit(&mut self, idx: usize, budget: u32, plan: &mut Plan) -> Admit {
        match self.reqs[idx].phase {
            Phase::Waiting if self.reqs[idx].skip_lookup => {
                self.admit_after_load(idx, budget, plan)
            }
            Phase::Waiting => self.admit_fresh(idx, budget, plan),
            _ => Admit::Skip,
        }
    }

    /// A new or preempted request: GPU prefix cache, then kvtier's lookup, then allocation.
    fn admit_fresh(&mut self, idx: usize, budget: u32, plan: &mut Plan) -> Admit {
        let tpb = self.cfg.tokens_per_block;
        let r = &self.reqs[idx];
        let num_tokens = r.num_known;
        let max_hit = (((num_tokens - 1) / tpb) as usize).min(r.hashes.len());
        let mut hit = Vec::new();
        self.pool.find_cached_prefix(&r.hashes[..max_hit], &mut hit);
        let local = hit.len() as u32 * tpb;
        let answer = self
            .connector
            .get_num_new_matched_tokens(r.id, num_tokens, &r.hashes, local);
        let ext = match answer {
            MatchResult::RetryLater => {
                self.report.retry_laters += 1;
                return Admit::Skip;
            }
            MatchResult::Tokens(n) => self.checked_external(idx, local, n),
        };
        let (target, num_new) = match ext {
            0 => {
                let n = (num_tokens - local).min(budget);
                (local + n, n)
            }
            _ => (local + ext, 0),
        };
        let need = self.blocks_for(target).saturating_sub(hit.len()) as u32;
        if self.pool.free_count() - self.pool.free_among(&hit) < need {
            return Admit::NoRoom;
        }
        self.pool.acquire(&hit);
        let mut blocks = hit;
        let allocated = self.pool.allocate(need, &mut blocks);
        debug_assert!(allocated, "free blocks were counted");
        let r = &mut self.reqs[idx];
        let gain = r.gain(0, local, KvSource::GpuCache);
        self.report.prompt_tokens_gpu_cached += u64::from(gain.prompt);
        self.report.decode_tokens_reused += u64::from(gain.beyond_prompt);
        self.report.tokens_gpu_cached_again += u64::from(gain.again);
        r.blocks = blocks;
        r.num_computed = local;
        self.connector
            .update_state_after_alloc(r.id, &r.blocks, ext);
        if ext > 0 {
            r.load = Some((local, ext));
            r.phase = Phase::WaitingForRemote;
            return Admit::Skip;
        }
        r.phase = Phase::Running;
        plan.scheduled.push(Scheduled {
            idx,
            computed_before: local,
            num_new,
            new_blocks: r.blocks.clone(),
            replace: true,
        });
        Admit::Scheduled(num_new)
    }

    /// A request whose load ended: no new lookup; allocate the rest and schedule it.
    fn admit_after_load(&mut self, idx: usize, budget: u32, plan: &mut Plan) -> Admit {
        let r = &self.reqs[idx];
        let computed = r.num_computed;
        let num_new = (r.num_known - computed).min(budget);
        let need = self
            .blocks_for(computed + num_new)
            .saturating_sub(r.blocks.len()) as u32;
        let mut fresh = Vec::new();
        if !self.pool.allocate(need, &mut fresh) {
            return Admit::NoRoom;
        }
        let r = &mut self.reqs[idx];
        r.blocks.extend_from_slice(&fresh);
        self.connector.update_state_after_alloc(r.id, &r.blocks, 0);
        r.skip_lookup = false;
        r.phase = Phase::Running;
        plan.scheduled.push(Scheduled {
            idx,
            computed_before: computed,
            num_new,
            new_blocks: r.blocks.clone(),
            replace: true,
        });
        Admit::Scheduled(num_new)
    }

    /// Checks a lookup answer: block aligned, short of the last token, within known hashes.
    fn checked_external(&mut self, idx: usize, local: u32, ext: u32) -> u32 {
        let tpb = self.cfg.tokens_per_block;
        let r = &self.reqs[idx];
        let (num_tokens, hashed) = (r.num_known, r.hashes.len() as u32 * tpb);
        if ext % tpb == 0 && local + ext < num_tokens && local + ext <= hashed {
            return ext;
        }
        let id = r.id.0;
        self.violation(format!(
            "get_num_new_matched_tokens(request {id}) answered {ext} tokens beyond {local} of {num_tokens} \
             (must be block aligned, short of the last token, within full blocks); ignored"
        ));
        0
    }

    /// vLLM's `_update_after_schedule`: computed tokens advance at scheduling time; a step that
    /// reaches the end of the known tokens adds an output placeholder. Full blocks with known
    /// hashes enter the GPU prefix cache.
    fn after_schedule(&mut self, idx: usize, before: u32, num_new: u32) {
        let end = before + num_new;
        let r = &mut self.reqs[idx];
        let gain = r.gain(before, end, KvSource::Computed);
        self.report.tokens_computed += u64::from(num_new);
        self.report.prompt_tokens_computed += u64::from(gain.prompt);
        self.report.decode_tokens_computed += u64::from(gain.beyond_prompt);
        self.report.tokens_recomputed += u64::from(gain.again);
        r.num_computed = end;
        if end == r.num_tokens_with_placeholders() {
            r.placeholders += 1;
        }
        self.cache_blocks(idx, end);
    }

    /// Offers the request's full blocks within its first `tokens` tokens to the GPU prefix cache.
    pub(super) fn cache_blocks(&mut self, idx: usize, tokens: u32) {
        let r = &mut self.reqs[idx];
        let upto = ((tokens / self.cfg.tokens_per_block) as usize)
            .min(r.hashes.len())
            .min(r.blocks.len());
        for j in r.cached_blocks..upto {
            self.pool.cache(r.blocks[j], r.hashes[j]);
        }
        r.cached_blocks = r.cached_blocks.max(upto);
    }
}
