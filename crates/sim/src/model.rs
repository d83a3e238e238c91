//! [`Lockstep`]: an [`OffloadManager`] that forwards every call to the real host pool and to a
//! deliberately simple reference model ([`RefModel`]: a `BTreeMap` of present keys and a `Vec`
//! recency list, scanned linearly), and compares their answers call by call.
//!
//! What the model decides on its own: every lookup answer (miss, pending, hit), whether a
//! `prepare_load` succeeds, which keys a `prepare_store` returns and whether it fails, how many
//! chunks it evicts and that each victim was idle and not named by the call, that no slot is handed
//! to two present keys, read reference counts (a `complete_load` without a matching pin is an
//! error), and the `Stored`/`Removed` events. With exact LRU (`RefModel::exact_lru`) it also
//! predicts *which* chunks are evicted. Slot numbers are the pool's choice; the model only checks
//! that they are in range and unshared.

use std::collections::{BTreeMap, BTreeSet};

use offload_core::{
    ChunkKey, CoreError, KvEvent, LookupResult, Medium, OffloadManager, PreparedStore, RequestId,
    SlotId,
};

/// A present chunk in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    /// Being written (`prepare_store` without `complete_store`).
    writing: bool,
    /// Reads in flight (`prepare_load` minus `complete_load`).
    readers: u32,
    /// The slot the real pool gave it.
    slot: u32,
}

/// The reference model of the host pool (design.md section 4, items 9-11).
#[derive(Clone, Debug)]
pub struct RefModel {
    slot_count: u32,
    exact_lru: bool,
    present: BTreeMap<ChunkKey, Entry>,
    /// Slots held since a reset (a job was writing or reading them then): slot -> holds.
    held: BTreeMap<u32, u32>,
    /// Recency, least recent first (only kept exactly with LRU).
    recency: Vec<ChunkKey>,
}

impl RefModel {
    /// A model of a pool of `slot_count` slots; `exact_lru` predicts eviction victims (LRU, no
    /// reuse threshold).
    pub fn new(slot_count: u32, exact_lru: bool) -> Self {
        Self {
            slot_count,
            exact_lru,
            present: BTreeMap::new(),
            held: BTreeMap::new(),
            recency: Vec::new(),
        }
    }

    /// Present chunks.
    pub fn len(&self) -> usize {
        self.present.len()
    }

    /// Whether no chunk is present.
    pub fn is_empty(&self) -> bool {
        self.present.is_empty()
    }

    /// Chunks still being written and read pins held (both must be 0 once every job drained).
    pub fn outstanding(&self) -> (usize, u64) {
        let writing = self.present.values().filter(|e| e.writing).count();
        let pins = self.present.values().map(|e| u64::from(e.readers)).sum();
        (writing, pins)
    }

    fn lookup(&self, key: ChunkKey) -> LookupResult {
        match self.present.get(&key) {
            None => LookupResult::Miss,
            Some(e) if e.writing => LookupResult::Pending,
            Some(_) => LookupResult::Hit,
        }
    }

    fn make_most_recent(&mut self, key: ChunkKey) {
        if let Some(i) = self.recency.iter().position(|&k| k == key) {
            self.recency.remove(i);
            self.recency.push(key);
        }
    }

    fn remove(&mut self, key: ChunkKey) {
        self.present.remove(&key);
        if let Some(i) = self.recency.iter().position(|&k| k == key) {
            self.recency.remove(i);
        }
    }

    fn evictable(&self, key: ChunkKey, named: &[ChunkKey]) -> bool {
        self.present
            .get(&key)
            .is_some_and(|e| !e.writing && e.readers == 0)
            && !named.contains(&key)
    }
}

/// The real manager `M` and the model in lockstep; every disagreement is recorded (and panics
/// when `strict`).
pub struct Lockstep<M> {
    inner: M,
    model: RefModel,
    strict: bool,
    /// Events taken from `inner` early (to see evictions), handed on by `take_events`.
    events: Vec<KvEvent>,
    scratch: Vec<KvEvent>,
    disagreements: Vec<String>,
    calls: u64,
}

impl<M: OffloadManager> Lockstep<M> {
    /// `inner` (whose events must be on) checked against `model`.
    pub fn new(inner: M, model: RefModel, strict: bool) -> Self {
        Self {
            inner,
            model,
            strict,
            events: Vec::new(),
            scratch: Vec::new(),
            disagreements: Vec::new(),
            calls: 0,
        }
    }

    /// The real manager.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The model.
    pub fn model(&self) -> &RefModel {
        &self.model
    }

    /// Disagreements so far (the first 32).
    pub fn disagreements(&self) -> &[String] {
        &self.disagreements
    }

    /// Calls compared.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    fn disagree(&mut self, what: String) {
        let msg = format!("model disagrees at manager call {}: {what}", self.calls);
        if self.strict {
            panic!("{msg}");
        }
        if self.disagreements.len() < 32 {
            self.disagreements.push(msg);
        }
    }

    /// Takes `inner`'s new events, applies `Removed` ones as evictions of idle chunks not in
    /// `named`, checks `Stored` ones against `stored`; returns the evicted keys.
    fn absorb_events(&mut self, named: &[ChunkKey], stored: &[ChunkKey]) -> Vec<ChunkKey> {
        self.scratch.clear();
        self.inner.take_events(&mut self.scratch);
        let mut evicted = Vec::new();
        let mut stored_seen = Vec::new();
        let events = std::mem::take(&mut self.scratch);
        for e in &events {
            match *e {
                KvEvent::Removed {
                    key,
                    medium: Medium::Cpu,
                } => {
                    if !self.model.evictable(key, named) {
                        self.disagree(format!(
                            "{key:?} evicted but the model has it {:?} (named by the call: {})",
                            self.model.present.get(&key),
                            named.contains(&key)
                        ));
                    }
                    self.model.remove(key);
                    evicted.push(key);
                }
                KvEvent::Stored {
                    key,
                    medium: Medium::Cpu,
                } => stored_seen.push(key),
                other => self.disagree(format!("event {other:?} from a host pool")),
            }
        }
        if stored_seen != stored {
            self.disagree(format!(
                "Stored events {stored_seen:?}, the model expects {stored:?}"
            ));
        }
        self.events.extend_from_slice(&events);
        self.scratch = events;
        evicted
    }
}

impl<M: OffloadManager> OffloadManager for Lockstep<M> {
    fn lookup(&mut self, key: ChunkKey, request: RequestId) -> LookupResult {
        self.calls += 1;
        let got = self.inner.lookup(key, request);
        let want = self.model.lookup(key);
        if got != want {
            self.disagree(format!("lookup {key:?}: pool {got:?}, model {want:?}"));
        }
        got
    }

    fn prepare_load(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        slots: &mut Vec<SlotId>,
    ) -> Result<(), CoreError> {
        self.calls += 1;
        let start = slots.len();
        let got = self.inner.prepare_load(keys, request, slots);
        let ok = keys
            .iter()
            .all(|k| self.model.present.get(k).is_some_and(|e| !e.writing));
        match (&got, ok) {
            (Ok(()), true) => {
                for (k, s) in keys.iter().zip(&slots[start..]) {
                    let e = self.model.present.get_mut(k).expect("checked present");
                    e.readers += 1;
                    if e.slot != s.0 {
                        let slot = e.slot;
                        self.disagree(format!(
                            "prepare_load {k:?}: pool slot {}, model slot {slot}",
                            s.0
                        ));
                    }
                }
            }
            (Err(_), false) => {}
            (got, want) => self.disagree(format!(
                "prepare_load {keys:?}: pool {got:?}, model ok={want}"
            )),
        }
        got
    }

    fn complete_load(&mut self, keys: &[ChunkKey]) {
        self.calls += 1;
        self.inner.complete_load(keys);
        for k in keys {
            match self.model.present.get_mut(k) {
                Some(e) if e.readers > 0 => e.readers -= 1,
                other => {
                    let other = other.copied();
                    self.disagree(format!("complete_load {k:?} without a pin: {other:?}"));
                }
            }
        }
    }

    fn touch(&mut self, keys: &[ChunkKey], request: RequestId) {
        self.calls += 1;
        self.inner.touch(keys, request);
        for &k in keys.iter().rev() {
            self.model.make_most_recent(k);
        }
    }

    fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        out: &mut PreparedStore,
    ) -> Result<(), CoreError> {
        self.calls += 1;
        let mut new: Vec<ChunkKey> = Vec::new();
        for &k in keys {
            if !self.model.present.contains_key(&k) && !new.contains(&k) {
                new.push(k);
            }
        }
        let free =
            self.model.slot_count as usize - self.model.present.len() - self.model.held.len();
        let to_evict = new.len().saturating_sub(free);
        let candidates: Vec<ChunkKey> = self
            .model
            .recency
            .iter()
            .copied()
            .filter(|&k| self.model.evictable(k, keys))
            .collect();
        let fits = to_evict <= candidates.len();
        let got = self.inner.prepare_store(keys, request, out);
        let evicted = self.absorb_events(keys, &[]);
        match (&got, fits) {
            (Err(_), false) => {
                if !evicted.is_empty() {
                    self.disagree(format!("a failed prepare_store evicted {evicted:?}"));
                }
                return got;
            }
            (Ok(()), true) => {}
            (got, fits) => {
                let got = got.clone();
                self.disagree(format!(
                    "prepare_store of {} keys ({} new, {free} free, {} evictable): pool {got:?}, \
                     model fits={fits}",
                    keys.len(),
                    new.len(),
                    candidates.len()
                ));
                return got;
            }
        }
        if out.keys != new {
            self.disagree(format!(
                "prepare_store returned {:?}, the model expects {new:?}",
                out.keys
            ));
        }
        if evicted.len() != to_evict {
            self.disagree(format!(
                "prepare_store evicted {} chunks, the model expects {to_evict}",
                evicted.len()
            ));
        }
        if self.model.exact_lru {
            let want: BTreeSet<ChunkKey> = candidates[..to_evict].iter().copied().collect();
            let got_set: BTreeSet<ChunkKey> = evicted.iter().copied().collect();
            if want != got_set {
                self.disagree(format!(
                    "LRU victims {got_set:?}, the model expects {want:?}"
                ));
            }
        }
        let used: BTreeSet<u32> = self.model.present.values().map(|e| e.slot).collect();
        for (k, s) in out.keys.clone().iter().zip(out.slots.clone()) {
            if s.0 >= self.model.slot_count
                || used.contains(&s.0)
                || self.model.held.contains_key(&s.0)
            {
                self.disagree(format!(
                    "prepare_store gave {k:?} slot {}, out of range or held by another chunk",
                    s.0
                ));
            }
            self.model.present.insert(
                *k,
                Entry {
                    writing: true,
                    readers: 0,
                    slot: s.0,
                },
            );
            self.model.recency.push(*k);
        }
        got
    }

    fn complete_store(&mut self, keys: &[ChunkKey], success: bool) {
        self.calls += 1;
        self.inner.complete_store(keys, success);
        let mut stored = Vec::new();
        for &k in keys {
            let Some(e) = self.model.present.get_mut(&k) else {
                continue;
            };
            if !e.writing {
                continue;
            }
            if success {
                e.writing = false;
                stored.push(k);
            } else {
                self.model.remove(k);
            }
        }
        self.absorb_events(&[], &stored);
    }

    fn on_request_finished(&mut self, request: RequestId) {
        self.calls += 1;
        self.inner.on_request_finished(request);
    }

    fn reset(&mut self) {
        self.calls += 1;
        self.inner.reset();
        self.scratch.clear();
        self.inner.take_events(&mut self.scratch);
        let removed: BTreeSet<ChunkKey> = self
            .scratch
            .iter()
            .filter_map(|e| match *e {
                KvEvent::Removed { key, .. } => Some(key),
                _ => None,
            })
            .collect();
        let ready: BTreeSet<ChunkKey> = self
            .model
            .present
            .iter()
            .filter(|(_, e)| !e.writing)
            .map(|(k, _)| *k)
            .collect();
        if removed != ready {
            self.disagree(format!(
                "reset removed {} chunks, the model had {} ready",
                removed.len(),
                ready.len()
            ));
        }
        self.events.append(&mut self.scratch);
        for e in self.model.present.values() {
            let holds = u32::from(e.writing) + e.readers;
            if holds > 0 {
                *self.model.held.entry(e.slot).or_insert(0) += holds;
            }
        }
        self.model.present.clear();
        self.model.recency.clear();
    }

    fn release_held(&mut self, slots: &[SlotId]) {
        self.calls += 1;
        self.inner.release_held(slots);
        for s in slots {
            match self.model.held.get_mut(&s.0) {
                Some(n) => {
                    *n -= 1;
                    if *n == 0 {
                        self.model.held.remove(&s.0);
                    }
                }
                None => self.disagree(format!("release_held of slot {}, not held", s.0)),
            }
        }
    }

    fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        self.absorb_events(&[], &[]);
        out.append(&mut self.events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::{EvictionPolicy, HostPool, PoolConfig};

    const R: RequestId = RequestId(1);

    fn key(n: u64) -> ChunkKey {
        ChunkKey::new(
            u128::from(n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1) << 64 | u128::from(n),
            0,
        )
    }

    fn pool(slots: u32) -> HostPool {
        HostPool::with_strictness(
            PoolConfig {
                slot_count: slots,
                policy: EvictionPolicy::Lru,
                reuse_threshold: 0,
                events: true,
            },
            true,
        )
        .expect("pool")
    }

    #[test]
    fn agrees_with_the_host_pool_on_a_fill_evict_cycle() {
        let mut m = Lockstep::new(pool(2), RefModel::new(2, true), true);
        let mut out = PreparedStore::default();
        m.prepare_store(&[key(1), key(2)], R, &mut out).unwrap();
        assert_eq!(m.lookup(key(1), R), LookupResult::Pending);
        m.complete_store(&[key(1), key(2)], true);
        m.touch(&[key(1)], R);
        m.prepare_store(&[key(3)], R, &mut out).unwrap();
        assert_eq!(m.lookup(key(2), R), LookupResult::Miss, "LRU victim");
        assert_eq!(m.lookup(key(1), R), LookupResult::Hit);
        assert!(m.disagreements().is_empty());
        assert_eq!(m.model().len(), 2);
    }

    /// A manager whose `complete_load` forgets to unpin: the model sees the next store fail
    /// where it expects room (and the pin count never returns to 0).
    struct ForgetsUnpin(HostPool);

    impl OffloadManager for ForgetsUnpin {
        fn lookup(&mut self, k: ChunkKey, r: RequestId) -> LookupResult {
            self.0.lookup(k, r)
        }
        fn prepare_load(
            &mut self,
            k: &[ChunkKey],
            r: RequestId,
            s: &mut Vec<SlotId>,
        ) -> Result<(), CoreError> {
            self.0.prepare_load(k, r, s)
        }
        fn complete_load(&mut self, _: &[ChunkKey]) {}
        fn touch(&mut self, k: &[ChunkKey], r: RequestId) {
            self.0.touch(k, r);
        }
        fn prepare_store(
            &mut self,
            k: &[ChunkKey],
            r: RequestId,
            o: &mut PreparedStore,
        ) -> Result<(), CoreError> {
            self.0.prepare_store(k, r, o)
        }
        fn complete_store(&mut self, k: &[ChunkKey], s: bool) {
            self.0.complete_store(k, s);
        }
        fn on_request_finished(&mut self, r: RequestId) {
            self.0.on_request_finished(r);
        }
        fn reset(&mut self) {
            self.0.reset();
        }
        fn release_held(&mut self, slots: &[SlotId]) {
            self.0.release_held(slots);
        }
        fn take_events(&mut self, o: &mut Vec<KvEvent>) {
            self.0.take_events(o);
        }
    }

    #[test]
    fn catches_a_pin_that_is_never_dropped() {
        let mut m = Lockstep::new(ForgetsUnpin(pool(1)), RefModel::new(1, true), false);
        let mut out = PreparedStore::default();
        let mut slots = Vec::new();
        m.prepare_store(&[key(1)], R, &mut out).unwrap();
        m.complete_store(&[key(1)], true);
        m.prepare_load(&[key(1)], R, &mut slots).unwrap();
        m.complete_load(&[key(1)]);
        assert!(m.disagreements().is_empty());
        assert!(m.prepare_store(&[key(2)], R, &mut out).is_err());
        assert_eq!(m.disagreements().len(), 1, "{:?}", m.disagreements());
        assert!(m.disagreements()[0].contains("fits=true"));
    }
}
