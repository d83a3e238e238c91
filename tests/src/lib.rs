//! Cross-crate tests live in `tests/`; this library holds what several of them share:
//! [`FailingTier`], a tier wrapper that fails whole jobs on a condition.

use offload_core::event::Medium;
use offload_core::tier::{SubmitError, Tier, TierCompletion, TierJob, TierLookup};
use offload_core::{ChunkKey, JobId, RequestId};

/// Wraps a tier; a job for which `fails(job)` is true is accepted and completes with every key
/// failed (a disk that died, a peer gone), without reaching the inner tier. Lookups, touches and
/// everything else are forwarded, so lookups still answer as before.
pub struct FailingTier<T> {
    tier: T,
    fails: Box<dyn FnMut(&TierJob) -> bool + Send>,
    failed: Vec<TierCompletion>,
}

impl<T: Tier> FailingTier<T> {
    /// `tier`, failing the jobs that `fails` picks.
    pub fn new(tier: T, fails: impl FnMut(&TierJob) -> bool + Send + 'static) -> Self {
        Self {
            tier,
            fails: Box::new(fails),
            failed: Vec::new(),
        }
    }

    /// The wrapped tier.
    pub fn inner(&self) -> &T {
        &self.tier
    }
}

impl<T: Tier> Tier for FailingTier<T> {
    fn name(&self) -> &str {
        self.tier.name()
    }
    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        self.tier.take_evicted(out)
    }
    fn medium(&self) -> Medium {
        self.tier.medium()
    }
    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        self.tier.lookup(key)
    }
    fn touch(&mut self, keys: &[ChunkKey]) {
        self.tier.touch(keys);
    }
    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        if !(self.fails)(&job) {
            return self.tier.submit(job);
        }
        let keys = job.chunks.iter().map(|c| c.key);
        let kind = offload_core::tier::TierFailure::Io;
        self.failed
            .push(TierCompletion::all_failed(job.id, keys, kind));
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        self.tier.poll(out);
        out.append(&mut self.failed);
    }
    fn cancel(&mut self, id: JobId) {
        self.tier.cancel(id);
    }
    fn drain(&mut self) {
        self.tier.drain();
    }
    fn on_request_finished(&mut self, request: RequestId) {
        self.tier.on_request_finished(request);
    }
    fn shutdown(&mut self) {
        self.tier.shutdown();
    }
}
