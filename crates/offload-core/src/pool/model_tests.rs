//! Model-based property tests of the host pool: random operation sequences run in lockstep on the
//! pool and on a deliberately simple reference model (plain `Vec`s scanned linearly, for both LRU
//! and ARC), and every answer must agree: lookup results, prepared keys and slots, errors, events,
//! statistics, reference counts, recency order, ARC list sizes and target. After every step the
//! pool's own invariant check runs too.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use proptest::prelude::*;

use super::reuse::{ReuseTracker, WAYS};
use super::*;

const R: RequestId = RequestId(7);
/// Size of the key universe; small, so that keys repeat often.
const KEY_UNIVERSE: u8 = 24;

fn key(n: u8) -> ChunkKey {
    // Spread hashes, and use two groups with equal hashes to exercise the group in the key, and
    // two hashes with equal low halves to exercise the high half: keys 4i to 4i+3 share their
    // low 64 bits. (Not the mixer's own constants: that would make distinct keys share a
    // fingerprint, which real prefix hashes do with odds of 2^-64.)
    let low = u64::from(n / 4).wrapping_mul(0xD1B5_4A32_D192_ED03) + 1;
    let high = u64::from(n / 2 % 2) * 0xA5A5_5A5A_0F0F_F0F1;
    ChunkKey::new(u128::from(low) | (u128::from(high) << 64), u32::from(n % 2))
}

/// The reference model: the rules of design.md items 9-10 written as directly as possible.
struct Model {
    cap: u32,
    policy: EvictionPolicy,
    threshold: u32,
    /// Present keys: (reference count, slot).
    present: BTreeMap<ChunkKey, (i32, u32)>,
    /// LRU: the recency list; ARC: T1. Least recent first.
    main: Vec<ChunkKey>,
    /// ARC: T2, least recent first.
    t2: Vec<ChunkKey>,
    /// ARC ghosts, least recent first.
    b1: Vec<ChunkKey>,
    b2: Vec<ChunkKey>,
    target: u32,
    /// Free slots; the top is the last element.
    free: Vec<u32>,
    /// Slots held since a reset: slot -> holds.
    held: BTreeMap<u32, u32>,
    /// Per-bucket lookup counters, most recent first (same bucket function as the pool).
    counters: Vec<VecDeque<(ChunkKey, u32)>>,
    bucket_fn: ReuseTracker,
    events: Vec<KvEvent>,
    stats: Stats,
}

impl Model {
    fn new(cap: u32, policy: EvictionPolicy, threshold: u32) -> Self {
        let bucket_fn = ReuseTracker::new(cap);
        Self {
            cap,
            policy,
            threshold,
            present: BTreeMap::new(),
            main: Vec::new(),
            t2: Vec::new(),
            b1: Vec::new(),
            b2: Vec::new(),
            target: 0,
            free: (0..cap).rev().collect(),
            held: BTreeMap::new(),
            counters: vec![VecDeque::new(); bucket_fn.bucket_count()],
            bucket_fn,
            events: Vec::new(),
            stats: Stats::default(),
        }
    }

    fn bucket(&self, k: ChunkKey) -> usize {
        self.bucket_fn.bucket_of(mix(k))
    }

    fn count(&self, k: ChunkKey) -> u32 {
        self.counters[self.bucket(k)]
            .iter()
            .find(|e| e.0 == k)
            .map_or(0, |e| e.1)
    }

    fn lookup(&mut self, k: ChunkKey) -> LookupResult {
        self.stats.lookups += 1;
        if self.threshold > 1 {
            let b = self.bucket(k);
            let q = &mut self.counters[b];
            let count = match q.iter().position(|e| e.0 == k) {
                Some(i) => q.remove(i).unwrap().1 + 1,
                None => 1,
            };
            q.push_front((k, count));
            q.truncate(WAYS);
        }
        match self.present.get(&k) {
            None => LookupResult::Miss,
            Some(&(r, _)) => {
                self.stats.lookup_hits += 1;
                if r < 0 {
                    LookupResult::Pending
                } else {
                    LookupResult::Hit
                }
            }
        }
    }

    fn prepare_load(&mut self, keys: &[ChunkKey], slots: &mut Vec<SlotId>) -> Result<(), ()> {
        if keys
            .iter()
            .any(|k| self.present.get(k).is_none_or(|e| e.0 < 0))
        {
            return Err(());
        }
        for k in keys {
            let e = self.present.get_mut(k).unwrap();
            e.0 += 1;
            slots.push(SlotId(e.1));
        }
        Ok(())
    }

    fn complete_load(&mut self, keys: &[ChunkKey]) {
        for k in keys {
            self.present.get_mut(k).unwrap().0 -= 1;
        }
    }

    fn touch(&mut self, keys: &[ChunkKey]) {
        for &k in keys.iter().rev() {
            if let Some(i) = self.main.iter().position(|&x| x == k) {
                self.main.remove(i);
                match self.policy {
                    EvictionPolicy::Lru => self.main.push(k),
                    EvictionPolicy::Arc => self.t2.push(k),
                }
            } else if let Some(i) = self.t2.iter().position(|&x| x == k) {
                self.t2.remove(i);
                self.t2.push(k);
            } else if self.b1.contains(&k) {
                let (b1, b2) = (self.b1.len() as u32, self.b2.len() as u32);
                let delta = (b2 / b1).max(1);
                self.target = (self.target + delta).min(self.cap);
            } else if self.b2.contains(&k) {
                let (b1, b2) = (self.b1.len() as u32, self.b2.len() as u32);
                let delta = (b1 / b2).max(1);
                self.target = self.target.saturating_sub(delta);
            }
        }
    }

    fn evictable(&self, k: ChunkKey, named: &[ChunkKey], chosen: &[ChunkKey]) -> bool {
        self.present[&k].0 == 0 && !named.contains(&k) && !chosen.contains(&k)
    }

    fn first_evictable(
        &self,
        list: &[ChunkKey],
        named: &[ChunkKey],
        chosen: &[ChunkKey],
    ) -> Option<ChunkKey> {
        list.iter()
            .copied()
            .find(|&k| self.evictable(k, named, chosen))
    }

    fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        out: &mut PreparedStore,
    ) -> Result<(), CoreError> {
        out.clear();
        let mut new = Vec::new();
        for &k in keys {
            if self.present.contains_key(&k) || new.contains(&k) {
                continue;
            }
            if self.threshold > 1 && self.count(k) < self.threshold {
                continue;
            }
            new.push(k);
        }
        let to_evict = new.len().saturating_sub(self.free.len());
        let evictable = self
            .present
            .keys()
            .filter(|&&k| self.evictable(k, keys, &[]))
            .count();
        if to_evict > evictable {
            self.stats.allocation_failures += 1;
            return Err(CoreError::NoSpace {
                needed: new.len(),
                evictable: self.free.len() + evictable,
            });
        }
        // Choose the victims first, as the policy sees the lists before any change.
        let mut victims: Vec<ChunkKey> = Vec::new();
        let (mut t1_len, mut t2_len) = (self.main.len() as u32, self.t2.len() as u32);
        while victims.len() < to_evict {
            let v = match self.policy {
                EvictionPolicy::Lru => self.first_evictable(&self.main, keys, &victims),
                EvictionPolicy::Arc => {
                    let from_t1 = t1_len > 0 && (t2_len == 0 || t1_len >= self.target);
                    let (a, b) = if from_t1 {
                        (&self.main, &self.t2)
                    } else {
                        (&self.t2, &self.main)
                    };
                    let v = self
                        .first_evictable(a, keys, &victims)
                        .or_else(|| self.first_evictable(b, keys, &victims))
                        .unwrap();
                    if self.main.contains(&v) {
                        t1_len -= 1;
                    } else {
                        t2_len -= 1;
                    }
                    Some(v)
                }
            };
            victims.push(v.unwrap());
        }
        for &v in &victims {
            self.evict(v);
        }
        for &k in &new {
            let slot = self.free.pop().unwrap();
            self.present.insert(k, (-1, slot));
            self.b1.retain(|&x| x != k);
            self.b2.retain(|&x| x != k);
            self.main.push(k);
            out.keys.push(k);
            out.slots.push(SlotId(slot));
        }
        Ok(())
    }

    fn evict(&mut self, v: ChunkKey) {
        let (_, slot) = self.present.remove(&v).unwrap();
        self.free.push(slot);
        self.stats.evictions += 1;
        self.events.push(KvEvent::Removed {
            key: v,
            medium: Medium::Cpu,
        });
        let from_t1 = self.main.contains(&v);
        self.main.retain(|&x| x != v);
        self.t2.retain(|&x| x != v);
        if self.policy == EvictionPolicy::Lru {
            return;
        }
        if (self.b1.len() + self.b2.len()) as u32 >= self.cap {
            let t1 = self.main.len() as u32;
            let b1 = self.b1.len() as u32;
            if !self.b1.is_empty() && (t1 + b1 >= self.cap || self.b2.is_empty()) {
                self.b1.remove(0);
            } else {
                self.b2.remove(0);
            }
        }
        if from_t1 {
            self.b1.push(v);
        } else {
            self.b2.push(v);
        }
    }

    fn complete_store(&mut self, keys: &[ChunkKey], success: bool) {
        for &k in keys {
            let Some(&(r, slot)) = self.present.get(&k) else {
                continue;
            };
            if r != -1 {
                continue;
            }
            if success {
                self.present.get_mut(&k).unwrap().0 = 0;
                self.stats.chunks_stored += 1;
                self.events.push(KvEvent::Stored {
                    key: k,
                    medium: Medium::Cpu,
                });
            } else {
                self.present.remove(&k);
                self.main.retain(|&x| x != k);
                self.t2.retain(|&x| x != k);
                self.free.push(slot);
            }
        }
    }

    fn reset(&mut self) {
        let mut ready: Vec<(u32, ChunkKey)> = self
            .present
            .iter()
            .filter(|e| e.1 .0 >= 0)
            .map(|(&k, &(_, s))| (s, k))
            .collect();
        ready.sort();
        for (_, k) in ready {
            self.events.push(KvEvent::Removed {
                key: k,
                medium: Medium::Cpu,
            });
        }
        // A slot being written or read stays held: one hold per writer or reader.
        for &(refc, slot) in self.present.values() {
            if refc != 0 {
                *self.held.entry(slot).or_insert(0) += refc.unsigned_abs();
            }
        }
        let fresh = Model::new(self.cap, self.policy, self.threshold);
        let (events, stats, held) = (
            std::mem::take(&mut self.events),
            self.stats,
            std::mem::take(&mut self.held),
        );
        let free = fresh
            .free
            .iter()
            .copied()
            .filter(|s| !held.contains_key(s))
            .collect();
        *self = Model {
            events,
            stats,
            held,
            free,
            ..fresh
        };
    }

    fn release_held(&mut self, slots: &[SlotId]) {
        for s in slots {
            let holds = self
                .held
                .get_mut(&s.0)
                .expect("only held slots are released");
            *holds -= 1;
            if *holds == 0 {
                self.held.remove(&s.0);
                self.free.push(s.0);
            }
        }
    }

    fn recency(&self) -> Vec<ChunkKey> {
        self.main.iter().chain(&self.t2).copied().collect()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Lookup(u8),
    PrepareStore(Vec<u8>),
    /// Completes the outstanding store batch with this index (modulo their number).
    CompleteStore(usize, bool),
    /// Completes arbitrary keys (absent, ready or pending).
    CompleteStoreKeys(Vec<u8>, bool),
    PrepareLoad(Vec<u8>),
    /// Completes the outstanding load with this index (modulo their number).
    CompleteLoad(usize),
    Touch(Vec<u8>),
    /// The engines' usual pair: touch these keys, then store those from this index on (modulo
    /// the length plus one), with the key at the given position of that suffix (if any, modulo
    /// its length) replaced by another: what the pool remembers of the touch must never stand
    /// in for a key the touch did not see.
    TouchThenStore(Vec<u8>, usize, Option<(usize, u8)>),
    /// Resets with jobs possibly in flight (their completions are then dropped; their slots
    /// stay held).
    Reset,
    /// A job in flight at a reset ends (this index, modulo their number): its holds end.
    EndStale(usize),
}

fn keys_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0..KEY_UNIVERSE, 0..6)
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..KEY_UNIVERSE).prop_map(Op::Lookup),
        6 => keys_strategy().prop_map(Op::PrepareStore),
        5 => (any::<usize>(), prop::bool::weighted(0.85)).prop_map(|(i, ok)| Op::CompleteStore(i, ok)),
        1 => (keys_strategy(), any::<bool>()).prop_map(|(k, ok)| Op::CompleteStoreKeys(k, ok)),
        3 => keys_strategy().prop_map(Op::PrepareLoad),
        3 => any::<usize>().prop_map(Op::CompleteLoad),
        4 => keys_strategy().prop_map(Op::Touch),
        4 => touch_then_store_strategy(keys_strategy()),
        1 => Just(Op::Reset),
        2 => any::<usize>().prop_map(Op::EndStale),
    ]
}

fn touch_then_store_strategy(keys: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Op> {
    (
        keys,
        any::<usize>(),
        prop::option::weighted(0.3, (any::<usize>(), 0..KEY_UNIVERSE)),
    )
        .prop_map(|(k, from, swap)| Op::TouchThenStore(k, from, swap))
}

fn keys_of(ns: &[u8]) -> Vec<ChunkKey> {
    ns.iter().map(|&n| key(n)).collect()
}

/// Runs `ops` on a pool and the model in lockstep, comparing everything after each step.
fn run_lockstep(
    cap: u32,
    policy: EvictionPolicy,
    threshold: u32,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let cfg = PoolConfig {
        slot_count: cap,
        policy,
        reuse_threshold: threshold,
        events: true,
    };
    let mut pool = HostPool::with_strictness(cfg, true).unwrap();
    let mut model = Model::new(cap, policy, threshold);
    let mut stores: Vec<(Vec<ChunkKey>, Vec<SlotId>)> = Vec::new();
    let mut loads: Vec<(Vec<ChunkKey>, Vec<SlotId>)> = Vec::new();
    let mut stale: Vec<Vec<SlotId>> = Vec::new();
    let (mut out, mut model_out) = (PreparedStore::default(), PreparedStore::default());
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Lookup(n) => {
                let k = key(*n);
                prop_assert_eq!(pool.lookup(k, R), model.lookup(k), "step {}", step);
            }
            Op::PrepareStore(_) | Op::TouchThenStore(..) => {
                let keys = match op {
                    Op::TouchThenStore(ns, from, swap) => {
                        let touched = keys_of(ns);
                        pool.touch(&touched, R);
                        model.touch(&touched);
                        let mut keys = touched[from % (touched.len() + 1)..].to_vec();
                        if let (Some((at, n)), false) = (swap, keys.is_empty()) {
                            let at = at % keys.len();
                            keys[at] = key(*n);
                        }
                        keys
                    }
                    Op::PrepareStore(ns) => keys_of(ns),
                    _ => unreachable!(),
                };
                let got = pool.prepare_store(&keys, R, &mut out);
                let want = model.prepare_store(&keys, &mut model_out);
                prop_assert_eq!(&got, &want, "step {}: {:?}", step, op);
                prop_assert_eq!(&out, &model_out, "step {}", step);
                if got.is_ok() && !out.keys.is_empty() {
                    stores.push((out.keys.clone(), out.slots.clone()));
                }
            }
            Op::CompleteStore(i, ok) => {
                if !stores.is_empty() {
                    let (batch, _) = stores.remove(i % stores.len());
                    pool.complete_store(&batch, *ok);
                    model.complete_store(&batch, *ok);
                }
            }
            Op::CompleteStoreKeys(ns, ok) => {
                let keys = keys_of(ns);
                pool.complete_store(&keys, *ok);
                model.complete_store(&keys, *ok);
            }
            Op::PrepareLoad(ns) => {
                let keys = keys_of(ns);
                let (mut got_slots, mut want_slots) = (vec![SlotId(1)], vec![SlotId(1)]);
                let got = pool.prepare_load(&keys, R, &mut got_slots);
                let want = model.prepare_load(&keys, &mut want_slots);
                prop_assert_eq!(got.is_ok(), want.is_ok(), "step {}: {:?}", step, op);
                prop_assert_eq!(&got_slots, &want_slots, "step {}", step);
                if got.is_ok() {
                    loads.push((keys, got_slots[1..].to_vec()));
                }
            }
            Op::CompleteLoad(i) => {
                if !loads.is_empty() {
                    let (batch, _) = loads.remove(i % loads.len());
                    pool.complete_load(&batch);
                    model.complete_load(&batch);
                }
            }
            Op::Touch(ns) => {
                let keys = keys_of(ns);
                pool.touch(&keys, R);
                model.touch(&keys);
            }
            Op::Reset => {
                // Jobs in flight are dropped with the chunks (the scheduler ignores completions
                // of jobs older than a reset, so they never reach the pool), but their slots stay
                // held until each job ends.
                // A store batch writes only its keys still pending in their slots (others were
                // completed by `CompleteStoreKeys`), each once.
                let mut writing = BTreeSet::new();
                for (keys, slots) in stores.drain(..) {
                    let mine: Vec<SlotId> = keys
                        .iter()
                        .zip(slots)
                        .filter(|&(&k, s)| {
                            pool.ref_count(k) == Some(-1)
                                && pool.slot_of(k) == Some(s)
                                && writing.insert(s)
                        })
                        .map(|(_, s)| s)
                        .collect();
                    stale.push(mine);
                }
                stale.extend(loads.drain(..).map(|(_, slots)| slots));
                pool.reset();
                model.reset();
            }
            Op::EndStale(i) => {
                if !stale.is_empty() {
                    let slots = stale.remove(i % stale.len());
                    pool.release_held(&slots);
                    model.release_held(&slots);
                }
            }
        }
        if let Err(e) = pool.check_invariants() {
            return Err(TestCaseError::fail(format!("step {step} ({op:?}): {e}")));
        }
        let mut events = Vec::new();
        pool.take_events(&mut events);
        prop_assert_eq!(&events, &model.events, "step {}: {:?}", step, op);
        model.events.clear();
        prop_assert_eq!(pool.stats(), model.stats, "step {}", step);
        prop_assert_eq!(pool.keys_by_recency(), model.recency(), "step {}", step);
        prop_assert_eq!(pool.len(), model.present.len());
        prop_assert_eq!(pool.free_slot_count() as usize, model.free.len());
        prop_assert_eq!(pool.held_slot_count(), model.held.len(), "step {}", step);
        for n in 0..KEY_UNIVERSE {
            let k = key(n);
            let want = model.present.get(&k);
            prop_assert_eq!(
                pool.ref_count(k),
                want.map(|e| e.0),
                "step {} key {}",
                step,
                n
            );
            prop_assert_eq!(pool.slot_of(k), want.map(|e| SlotId(e.1)), "step {}", step);
            prop_assert_eq!(pool.lookup_count(k), model.count(k), "step {}", step);
        }
        if policy == EvictionPolicy::Arc {
            let lens = [
                model.main.len(),
                model.t2.len(),
                model.b1.len(),
                model.b2.len(),
            ]
            .map(|l| l as u32);
            prop_assert_eq!(pool.arc_list_lens(), Some(lens), "step {}", step);
            prop_assert_eq!(pool.arc_target(), Some(model.target), "step {}", step);
        }
    }
    Ok(())
}

fn policy_strategy() -> impl Strategy<Value = EvictionPolicy> {
    prop_oneof![Just(EvictionPolicy::Lru), Just(EvictionPolicy::Arc)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn pool_agrees_with_model(
        cap in 1u32..10,
        policy in policy_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..120),
    ) {
        run_lockstep(cap, policy, 0, &ops)?;
    }

    #[test]
    fn pool_agrees_with_model_with_reuse_threshold(
        cap in 1u32..20,
        policy in policy_strategy(),
        threshold in 2u32..4,
        ops in prop::collection::vec(op_strategy(), 1..120),
    ) {
        run_lockstep(cap, policy, threshold, &ops)?;
    }

    #[test]
    fn large_calls_agree_with_model(
        cap in 8u32..40,
        policy in policy_strategy(),
        ops in prop::collection::vec(
            prop_oneof![
                3 => prop::collection::vec(0..KEY_UNIVERSE, 10..40).prop_map(Op::PrepareStore),
                3 => (any::<usize>(), any::<bool>()).prop_map(|(i, ok)| Op::CompleteStore(i, ok)),
                2 => prop::collection::vec(0..KEY_UNIVERSE, 10..40).prop_map(Op::Touch),
                3 => touch_then_store_strategy(prop::collection::vec(0..KEY_UNIVERSE, 10..40)),
                1 => prop::collection::vec(0..KEY_UNIVERSE, 1..4).prop_map(Op::PrepareLoad),
                1 => any::<usize>().prop_map(Op::CompleteLoad),
            ],
            1..60,
        ),
    ) {
        run_lockstep(cap, policy, 0, &ops)?;
    }
}
