//! Promotion: a host miss asks the secondary tiers, a hit reserves a host slot and queues the
//! chunk, `end_step` submits one Load job per tier and request, and the promoted chunk stays
//! pinned for its request until it loads it, finishes, a reset, or the promotion deadline.

use std::collections::BTreeSet;

use offload_core::tier::{SubmitError, TierChunk, TierJob, TierLookup, TierOp};
use offload_core::{ChunkKey, LookupResult, OffloadManager, RequestId};

use super::{InFlight, TieringManager};

impl TieringManager {
    /// Asks the allowed secondary tiers for `key` after a host miss.
    pub(super) fn lookup_tiers(&mut self, key: ChunkKey, request: RequestId) -> LookupResult {
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
    pub(super) fn submit_promotion(&mut self, request: RequestId, tier: usize, must_go: bool) {
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
    pub(super) fn release_promotion_pins(&mut self, request: RequestId) {
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
    pub(super) fn expire_promotion_pins(&mut self) {
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

    /// Drops promotions queued behind a busy tier for longer than the promotion deadline (never
    /// submitted), counting them.
    pub(super) fn expire_queued_promotions(&mut self) {
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

    pub(super) fn promotion_done(
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
}
