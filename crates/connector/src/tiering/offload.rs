//! The [`OffloadManager`] calls the scheduler makes on the tiering manager (lookups across tiers,
//! host loads and stores, finish, reset), and the drain on drop.

use std::collections::{BTreeMap, VecDeque};

use offload_core::{
    ChunkKey, CoreError, KvEvent, LookupResult, OffloadManager, PreparedStore, RequestId, SlotId,
};

use super::{TieringManager, SCAN_HITS_MAX};

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
