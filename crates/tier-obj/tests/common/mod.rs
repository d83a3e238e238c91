//! Helpers shared by the object tier's tests: configurations and tiers over the in-memory and
//! local-file-system backends.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{SlotMemory, Tier, TierChunk, TierCompletion, TierJob, TierOp};
use offload_core::{ChunkKey, JobId, SlotId};
use tier_obj::object_store::ObjectStore;
use tier_obj::{NamespaceId, ObjTier, ObjTierConfig};

/// The namespace every test uses.
pub fn namespace() -> NamespaceId {
    NamespaceId {
        model: "test-model".to_owned(),
        dtype: "bfloat16".to_owned(),
        tokens_per_chunk: 256,
        parallel_layout: "tp1".to_owned(),
    }
}

/// A test configuration: short deadlines, and a multipart threshold the suite's 16 KiB slots
/// cross, so that both upload paths run.
pub fn config() -> ObjTierConfig {
    ObjTierConfig {
        request_deadline: Duration::from_secs(10),
        list_deadline: Duration::from_secs(10),
        multipart_threshold_bytes: 12 * 1024,
        part_bytes: 8 * 1024,
        jobs_in_flight_max: 16,
        requests_in_flight_max: 8,
        ..ObjTierConfig::new("kvtier-test", namespace())
    }
}

/// A tier over `store` with `config`.
pub fn tier(
    config: ObjTierConfig,
    store: Arc<dyn ObjectStore>,
    memory: Arc<dyn SlotMemory>,
) -> ObjTier {
    ObjTier::start(config, store, memory).expect("object tier starts")
}

/// A tier that owns the temporary directory its local store lives in (removed after the tier).
pub struct OwnedDirTier {
    pub tier: ObjTier,
    _dir: tempfile::TempDir,
}

impl OwnedDirTier {
    pub fn new(memory: Arc<dyn SlotMemory>) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let backend = tier_obj::Backend::Local {
            root: dir.path().to_path_buf(),
        };
        let store = backend.open().expect("local store opens");
        Self {
            tier: tier(config(), store, memory),
            _dir: dir,
        }
    }
}

impl Tier for OwnedDirTier {
    fn name(&self) -> &str {
        self.tier.name()
    }
    fn medium(&self) -> offload_core::event::Medium {
        self.tier.medium()
    }
    fn lookup(&mut self, key: offload_core::ChunkKey) -> offload_core::tier::TierLookup {
        self.tier.lookup(key)
    }
    fn touch(&mut self, keys: &[offload_core::ChunkKey]) {
        self.tier.touch(keys)
    }
    fn submit(
        &mut self,
        job: offload_core::tier::TierJob,
    ) -> Result<(), offload_core::tier::SubmitError> {
        self.tier.submit(job)
    }
    fn poll(&mut self, out: &mut Vec<offload_core::tier::TierCompletion>) {
        self.tier.poll(out)
    }
    fn cancel(&mut self, id: offload_core::JobId) {
        self.tier.cancel(id)
    }
    fn drain(&mut self) {
        self.tier.drain()
    }
    fn on_request_finished(&mut self, request: offload_core::RequestId) {
        self.tier.on_request_finished(request)
    }
    fn shutdown(&mut self) {
        self.tier.shutdown()
    }
}

/// A job of `op` on `chunks`, for no request.
pub fn job(id: u64, op: TierOp, chunks: Vec<(ChunkKey, SlotId, u32)>) -> TierJob {
    TierJob {
        id: JobId(id),
        request: None,
        op,
        chunks: chunks
            .into_iter()
            .map(|(key, slot, len)| TierChunk::new(key, slot, len))
            .collect(),
    }
}

/// Polls until `id` completes (`within` at most).
pub fn wait(tier: &mut dyn Tier, id: u64, within: Duration) -> TierCompletion {
    wait_all(tier, &[id], within).remove(0)
}

/// Polls until every job of `ids` completed (`within` at most); their completions in `ids` order.
pub fn wait_all(tier: &mut dyn Tier, ids: &[u64], within: Duration) -> Vec<TierCompletion> {
    let until = Instant::now() + within;
    let mut out = Vec::new();
    loop {
        tier.poll(&mut out);
        if ids.iter().all(|&id| out.iter().any(|c| c.id == JobId(id))) {
            assert_eq!(out.len(), ids.len(), "unexpected completions: {out:?}");
            out.sort_by_key(|c| ids.iter().position(|&id| c.id == JobId(id)));
            return out;
        }
        assert!(
            Instant::now() < until,
            "jobs {ids:?} did not complete within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}
