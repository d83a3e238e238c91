//! A lifecycle checker around any [`OffloadManager`]: it forwards every call, logs it, and reports
//! each contract violation it can observe (design.md section 4): a `lookup`, `prepare_load`,
//! `prepare_store` or `touch` for a request after its `on_request_finished`; `on_request_finished`
//! twice; completing a store that was not prepared or a load that was not pinned. In strict mode a
//! violation panics with the request and the call; otherwise it is counted and recorded.

use std::collections::{BTreeMap, BTreeSet};

use offload_core::{
    ChunkKey, CoreError, KvEvent, LookupResult, OffloadManager, PreparedStore, RequestId, SlotId,
};

/// One forwarded call, as the log records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ManagerCall {
    /// `lookup` of one key.
    Lookup {
        /// For this request.
        request: RequestId,
        /// The key.
        key: ChunkKey,
        /// What the manager answered.
        result: LookupResult,
    },
    /// `prepare_load`.
    PrepareLoad {
        /// For this request.
        request: RequestId,
        /// Keys asked for.
        keys: usize,
        /// Whether it succeeded.
        ok: bool,
    },
    /// `complete_load`.
    CompleteLoad {
        /// Keys unpinned.
        keys: usize,
    },
    /// `touch`.
    Touch {
        /// For this request.
        request: RequestId,
        /// Keys touched.
        keys: usize,
    },
    /// `prepare_store`.
    PrepareStore {
        /// For this request.
        request: RequestId,
        /// Keys offered.
        keys: usize,
        /// Keys that got a slot.
        prepared: usize,
        /// Whether it succeeded.
        ok: bool,
    },
    /// `complete_store`.
    CompleteStore {
        /// Keys completed.
        keys: usize,
        /// Whether the store succeeded.
        success: bool,
    },
    /// `on_request_finished`.
    RequestFinished {
        /// The request.
        request: RequestId,
    },
    /// `reset`.
    Reset,
}

impl ManagerCall {
    /// The request the call names, if any.
    pub fn request(&self) -> Option<RequestId> {
        match *self {
            ManagerCall::Lookup { request, .. }
            | ManagerCall::PrepareLoad { request, .. }
            | ManagerCall::Touch { request, .. }
            | ManagerCall::PrepareStore { request, .. }
            | ManagerCall::RequestFinished { request } => Some(request),
            ManagerCall::CompleteLoad { .. }
            | ManagerCall::CompleteStore { .. }
            | ManagerCall::Reset => None,
        }
    }
}

/// Most violation messages kept (the count keeps growing).
pub const VIOLATIONS_KEPT_MAX: usize = 64;

/// The checking wrapper.
pub struct CheckedManager<M> {
    inner: M,
    strict: bool,
    finished: BTreeSet<RequestId>,
    pending_stores: BTreeMap<ChunkKey, RequestId>,
    pins: BTreeMap<ChunkKey, u32>,
    log: Vec<ManagerCall>,
    log_max: usize,
    log_dropped: u64,
    violations: Vec<String>,
    violation_count: u64,
}

impl<M: OffloadManager> CheckedManager<M> {
    /// Wraps `inner`; `strict` makes violations panic; the log keeps at most `log_max` calls.
    pub fn new(inner: M, strict: bool, log_max: usize) -> Self {
        Self {
            inner,
            strict,
            finished: BTreeSet::new(),
            pending_stores: BTreeMap::new(),
            pins: BTreeMap::new(),
            log: Vec::new(),
            log_max,
            log_dropped: 0,
            violations: Vec::new(),
            violation_count: 0,
        }
    }

    /// The wrapped manager.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The wrapped manager, for direct calls that bypass the checks.
    pub fn inner_mut(&mut self) -> &mut M {
        &mut self.inner
    }

    /// Calls forwarded so far, in order (the first `log_max`).
    pub fn log(&self) -> &[ManagerCall] {
        &self.log
    }

    /// Calls not logged because the log was full.
    pub fn log_dropped(&self) -> u64 {
        self.log_dropped
    }

    /// Index in the log of the first call matching `pred`.
    pub fn first_index(&self, pred: impl Fn(&ManagerCall) -> bool) -> Option<usize> {
        self.log.iter().position(pred)
    }

    /// Index in the log of the last call matching `pred`.
    pub fn last_index(&self, pred: impl Fn(&ManagerCall) -> bool) -> Option<usize> {
        self.log.iter().rposition(pred)
    }

    /// Whether `on_request_finished` was delivered for `request`.
    pub fn is_finished(&self, request: RequestId) -> bool {
        self.finished.contains(&request)
    }

    /// Violations seen (non-strict mode; strict mode panics at the first).
    pub fn violation_count(&self) -> u64 {
        self.violation_count
    }

    /// The first violation messages.
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Stores prepared and not completed, and loads pinned and not completed: both must be zero
    /// once every job was acknowledged.
    pub fn outstanding(&self) -> (usize, u32) {
        (self.pending_stores.len(), self.pins.values().sum())
    }

    fn record(&mut self, call: ManagerCall) {
        if self.log.len() < self.log_max {
            self.log.push(call);
        } else {
            self.log_dropped += 1;
        }
    }

    fn violation(&mut self, what: String) {
        if self.strict {
            panic!("kvtier manager contract violated: {what}");
        }
        self.violation_count += 1;
        if self.violations.len() < VIOLATIONS_KEPT_MAX {
            self.violations.push(what);
        }
    }

    fn check_live(&mut self, request: RequestId, call: &str) {
        if self.finished.contains(&request) {
            self.violation(format!(
                "{call} for request {} after its on_request_finished",
                request.0
            ));
        }
    }
}

impl<M: OffloadManager> OffloadManager for CheckedManager<M> {
    fn lookup(&mut self, key: ChunkKey, request: RequestId) -> LookupResult {
        self.check_live(request, "lookup");
        let result = self.inner.lookup(key, request);
        self.record(ManagerCall::Lookup {
            request,
            key,
            result,
        });
        result
    }

    fn prepare_load(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        slots: &mut Vec<SlotId>,
    ) -> Result<(), CoreError> {
        self.check_live(request, "prepare_load");
        let result = self.inner.prepare_load(keys, request, slots);
        if result.is_ok() {
            for k in keys {
                *self.pins.entry(*k).or_insert(0) += 1;
            }
        }
        self.record(ManagerCall::PrepareLoad {
            request,
            keys: keys.len(),
            ok: result.is_ok(),
        });
        result
    }

    fn complete_load(&mut self, keys: &[ChunkKey]) {
        for k in keys {
            match self.pins.get_mut(k) {
                Some(n) if *n > 1 => *n -= 1,
                Some(_) => {
                    self.pins.remove(k);
                }
                None => self.violation(format!(
                    "complete_load of chunk {:#x} that no prepare_load pinned",
                    k.hash
                )),
            }
        }
        self.inner.complete_load(keys);
        self.record(ManagerCall::CompleteLoad { keys: keys.len() });
    }

    fn touch(&mut self, keys: &[ChunkKey], request: RequestId) {
        self.check_live(request, "touch");
        self.inner.touch(keys, request);
        self.record(ManagerCall::Touch {
            request,
            keys: keys.len(),
        });
    }

    fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        out: &mut PreparedStore,
    ) -> Result<(), CoreError> {
        self.check_live(request, "prepare_store");
        let result = self.inner.prepare_store(keys, request, out);
        if result.is_ok() {
            for k in &out.keys {
                if self.pending_stores.insert(*k, request).is_some() {
                    self.violation(format!(
                        "prepare_store for request {} returned chunk {:#x}, already being stored",
                        request.0, k.hash
                    ));
                }
            }
        }
        self.record(ManagerCall::PrepareStore {
            request,
            keys: keys.len(),
            prepared: if result.is_ok() { out.keys.len() } else { 0 },
            ok: result.is_ok(),
        });
        result
    }

    fn complete_store(&mut self, keys: &[ChunkKey], success: bool) {
        for k in keys {
            if self.pending_stores.remove(k).is_none() {
                self.violation(format!(
                    "complete_store of chunk {:#x} that no prepare_store returned",
                    k.hash
                ));
            }
        }
        self.inner.complete_store(keys, success);
        self.record(ManagerCall::CompleteStore {
            keys: keys.len(),
            success,
        });
    }

    fn on_request_finished(&mut self, request: RequestId) {
        if !self.finished.insert(request) {
            self.violation(format!(
                "on_request_finished for request {} twice",
                request.0
            ));
        }
        self.inner.on_request_finished(request);
        self.record(ManagerCall::RequestFinished { request });
    }

    fn reset(&mut self) {
        self.pending_stores.clear();
        self.pins.clear();
        self.inner.reset();
        self.record(ManagerCall::Reset);
    }

    fn release_held(&mut self, slots: &[SlotId]) {
        self.inner.release_held(slots);
    }

    fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        self.inner.take_events(out);
    }
}

impl<M: ::connector::AsTiering> ::connector::AsTiering for CheckedManager<M> {
    fn tiering(&self) -> &::connector::TieringManager {
        self.inner.tiering()
    }
    fn tiering_mut(&mut self) -> &mut ::connector::TieringManager {
        self.inner.tiering_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manager that accepts everything: every key is a hit and gets slot 0.
    struct Accepting;

    impl OffloadManager for Accepting {
        fn lookup(&mut self, _: ChunkKey, _: RequestId) -> LookupResult {
            LookupResult::Hit
        }
        fn prepare_load(
            &mut self,
            keys: &[ChunkKey],
            _: RequestId,
            slots: &mut Vec<SlotId>,
        ) -> Result<(), CoreError> {
            slots.extend(keys.iter().map(|_| SlotId(0)));
            Ok(())
        }
        fn complete_load(&mut self, _: &[ChunkKey]) {}
        fn touch(&mut self, _: &[ChunkKey], _: RequestId) {}
        fn prepare_store(
            &mut self,
            keys: &[ChunkKey],
            _: RequestId,
            out: &mut PreparedStore,
        ) -> Result<(), CoreError> {
            out.clear();
            out.keys.extend_from_slice(keys);
            out.slots.extend(keys.iter().map(|_| SlotId(0)));
            Ok(())
        }
        fn complete_store(&mut self, _: &[ChunkKey], _: bool) {}
        fn on_request_finished(&mut self, _: RequestId) {}
        fn reset(&mut self) {}
        fn release_held(&mut self, _: &[SlotId]) {}
        fn take_events(&mut self, _: &mut Vec<KvEvent>) {}
    }

    const K: ChunkKey = ChunkKey::new(1, 0);
    const R: RequestId = RequestId(7);

    #[test]
    fn ordered_lifecycle_is_clean_and_logged() {
        let mut m = CheckedManager::new(Accepting, true, 100);
        let mut out = PreparedStore::default();
        m.prepare_store(&[K], R, &mut out).unwrap();
        m.complete_store(&[K], true);
        m.on_request_finished(R);
        m.complete_load(&[]);
        assert!(m.is_finished(R));
        let store = m.first_index(
            |c| matches!(c, ManagerCall::PrepareStore { request, .. } if *request == R),
        );
        let fin = m.first_index(|c| *c == ManagerCall::RequestFinished { request: R });
        assert!(
            store < fin,
            "prepare_store(req 7) before on_request_finished(req 7)"
        );
        assert_eq!(m.outstanding(), (0, 0));
        assert_eq!(m.log()[0].request(), Some(R));
    }

    #[test]
    fn store_after_finish_panics_in_strict_mode_naming_the_request() {
        let result = std::panic::catch_unwind(|| {
            let mut m = CheckedManager::new(Accepting, true, 100);
            m.on_request_finished(R);
            let mut out = PreparedStore::default();
            let _ = m.prepare_store(&[K], R, &mut out);
        });
        let payload = result.expect_err("a store after the finish must panic");
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(
            msg.contains("prepare_store for request 7 after its on_request_finished"),
            "{msg}"
        );
    }

    #[test]
    fn lax_mode_counts_each_violation() {
        let mut m = CheckedManager::new(Accepting, false, 1);
        m.on_request_finished(R);
        m.on_request_finished(R);
        m.touch(&[K], R);
        let _ = m.lookup(K, R);
        let mut slots = Vec::new();
        let _ = m.prepare_load(&[K], R, &mut slots);
        m.complete_store(&[K], true);
        m.complete_load(&[K]);
        m.complete_load(&[K]);
        assert_eq!(m.violation_count(), 6, "{:?}", m.violations());
        assert!(m.violations()[0].contains("twice"));
        assert_eq!(m.log().len(), 1);
        assert_eq!(m.log_dropped(), 7);
    }

    #[test]
    fn reset_clears_outstanding_work() {
        let mut m = CheckedManager::new(Accepting, true, 10);
        let mut out = PreparedStore::default();
        m.prepare_store(&[K], R, &mut out).unwrap();
        let mut slots = Vec::new();
        m.prepare_load(&[ChunkKey::new(2, 0)], RequestId(8), &mut slots)
            .unwrap();
        assert_eq!(m.outstanding(), (1, 1));
        m.reset();
        assert_eq!(m.outstanding(), (0, 0));
    }
}
