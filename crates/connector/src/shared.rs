//! [`SharedTier`]: a [`Tier`] behind a shared lock, so that whoever built it keeps a handle to it
//! after handing it to the [`crate::TieringManager`] (to inject faults mid-run, read a fake
//! tier's counters, or stop a peer), plus a log of the calls the manager made.

use std::sync::{Arc, Mutex, MutexGuard};

use offload_core::tier::{SubmitError, Tier, TierCompletion, TierJob, TierLookup, TierOp};
use offload_core::{ChunkKey, JobId, Medium, RequestId};

/// One call the manager made, as [`SharedTier`] logs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TierCall {
    /// A job was offered (`accepted`: `submit` returned `Ok`).
    Submit {
        /// The job.
        id: JobId,
        /// Its request.
        request: Option<RequestId>,
        /// Its direction.
        op: TierOp,
        /// Its keys.
        keys: Vec<ChunkKey>,
        /// Whether the tier accepted it.
        accepted: bool,
    },
    /// A completion was returned by `poll`.
    Completed {
        /// The job.
        id: JobId,
        /// Whether every key succeeded.
        success: bool,
    },
    /// `cancel`.
    Cancel(JobId),
    /// `on_request_finished`.
    Finished(RequestId),
    /// `drain`.
    Drain,
}

struct Inner<T> {
    tier: T,
    log: Vec<TierCall>,
    log_max: usize,
}

/// A tier shared between the manager and its builder. Clones are handles to the same tier.
pub struct SharedTier<T> {
    inner: Arc<Mutex<Inner<T>>>,
    name: String,
    medium: Medium,
}

impl<T> Clone for SharedTier<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            name: self.name.clone(),
            medium: self.medium,
        }
    }
}

impl<T: Tier> SharedTier<T> {
    /// Wraps `tier`, logging at most `log_max` calls.
    pub fn new(tier: T, log_max: usize) -> Self {
        let name = tier.name().to_owned();
        let medium = tier.medium();
        Self {
            inner: Arc::new(Mutex::new(Inner {
                tier,
                log: Vec::new(),
                log_max,
            })),
            name,
            medium,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the tier (between manager calls).
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        f(&mut self.lock().tier)
    }

    /// The calls logged so far.
    pub fn log(&self) -> Vec<TierCall> {
        self.lock().log.clone()
    }

    /// A boxed clone, to hand to the manager.
    pub fn boxed(&self) -> Box<dyn Tier>
    where
        T: 'static,
    {
        Box::new(self.clone())
    }
}

impl<T> Inner<T> {
    fn record(&mut self, call: TierCall) {
        if self.log.len() < self.log_max {
            self.log.push(call);
        }
    }
}

impl<T: Tier> Tier for SharedTier<T> {
    fn name(&self) -> &str {
        &self.name
    }
    fn medium(&self) -> Medium {
        self.medium
    }
    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        self.lock().tier.lookup(key)
    }
    fn touch(&mut self, keys: &[ChunkKey]) {
        self.lock().tier.touch(keys);
    }
    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        let mut inner = self.lock();
        let (id, request, op) = (job.id, job.request, job.op);
        let keys = job.chunks.iter().map(|c| c.key).collect();
        let result = inner.tier.submit(job);
        let accepted = result.is_ok();
        inner.record(TierCall::Submit {
            id,
            request,
            op,
            keys,
            accepted,
        });
        result
    }
    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        let mut inner = self.lock();
        let start = out.len();
        inner.tier.poll(out);
        for c in &out[start..] {
            let call = TierCall::Completed {
                id: c.id,
                success: c.is_success(),
            };
            inner.record(call);
        }
    }
    fn cancel(&mut self, id: JobId) {
        let mut inner = self.lock();
        inner.record(TierCall::Cancel(id));
        inner.tier.cancel(id);
    }
    fn drain(&mut self) {
        let mut inner = self.lock();
        inner.record(TierCall::Drain);
        inner.tier.drain();
    }
    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        self.lock().tier.take_evicted(out)
    }
    fn on_request_finished(&mut self, request: RequestId) {
        let mut inner = self.lock();
        inner.record(TierCall::Finished(request));
        inner.tier.on_request_finished(request);
    }
    fn shutdown(&mut self) {
        self.lock().tier.shutdown();
    }
}
