//! The `Tier` trait: the pluggable backend interface that tier-gpu, tier-fs and tier-p2p implement,
//! with its contract, and the [`SlotMemory`] view of the host pool that tiers read and write.

use std::ptr::NonNull;

use serde::{Deserialize, Serialize};

use crate::event::Medium;
use crate::key::{ChunkKey, JobId, RequestId, SlotId};

/// The host pool's bytes as tiers see them: `slot_count` rows of `slot_bytes` each.
///
/// Implementations own the memory (a pinned allocation in tier-gpu, a plain buffer in tests) and
/// do whatever synchronisation they need; the ownership rules of [`Tier`] guarantee that no two
/// in-flight jobs write the same slot and that no slot is written while it is read.
pub trait SlotMemory: Send + Sync {
    /// Bytes per slot.
    fn slot_bytes(&self) -> usize;
    /// Number of slots.
    fn slot_count(&self) -> u32;
    /// Copies `dst.len()` bytes of `slot`, from `offset`, into `dst`.
    ///
    /// Panics if the range is outside the slot (a caller bug, never input data).
    fn read_slot(&self, slot: SlotId, offset: usize, dst: &mut [u8]);
    /// Copies `src` into `slot` at `offset`.
    ///
    /// Panics if the range is outside the slot (a caller bug, never input data).
    fn write_slot(&self, slot: SlotId, offset: usize, src: &[u8]);
    /// The slot's first byte, for zero-copy I/O (io_uring, RDMA registration), if the memory has a
    /// stable address. Dereferencing it is the caller's `unsafe` business and must follow the
    /// ownership rules of [`Tier`].
    fn slot_ptr(&self, _slot: SlotId) -> Option<NonNull<u8>> {
        None
    }
}

/// What a tier job does to its chunks.
///
/// Exhaustive on purpose, like [`TierLookup`]: a tier must act on every operation and the
/// manager on every answer, so a new one should break their build rather than reach a `_` arm.
///
/// ```
/// use offload_core::tier::{TierLookup, TierOp};
/// fn f(op: TierOp, answer: TierLookup) {
///     match op {
///         TierOp::Store | TierOp::Load => {}
///     }
///     match answer {
///         TierLookup::Hit | TierLookup::Miss | TierLookup::Retry => {}
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TierOp {
    /// Copy each chunk's host slot into the tier (a cascade).
    Store,
    /// Copy each chunk from the tier into its host slot (a promotion).
    Load,
}

/// One chunk of a [`TierJob`]: its key, its host slot, and how many payload bytes it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TierChunk {
    /// The chunk.
    pub key: ChunkKey,
    /// Its host slot: read by a store, written by a load.
    pub slot: SlotId,
    /// Payload bytes, at most the slot size (a partial chunk is shorter than a slot). A load
    /// fills exactly this many bytes of the slot.
    pub len: u32,
}

impl TierChunk {
    /// A chunk of `len` payload bytes in `slot`.
    pub const fn new(key: ChunkKey, slot: SlotId, len: u32) -> Self {
        Self { key, slot, len }
    }
}

/// One job submitted to a tier: the same operation on a set of chunks, each with its host slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierJob {
    /// Unique, growing id chosen by the caller.
    pub id: JobId,
    /// The request this job serves (for per-request tiers), if any.
    pub request: Option<RequestId>,
    /// Direction.
    pub op: TierOp,
    /// The chunks, each with its host slot and payload length.
    pub chunks: Vec<TierChunk>,
}

/// Why one key of a job failed. Whatever the kind, a failed load means the engine recomputes;
/// the kind only tells metrics and logs what went wrong.
///
/// Non-exhaustive: a tier may need a kind not listed yet, and a caller outside offload-core
/// counts a kind it does not know as "other".
///
/// ```compile_fail
/// // Outside offload-core a match needs a `_` arm:
/// fn f(x: offload_core::tier::TierFailure) {
///     match x {
///         offload_core::tier::TierFailure::Missing => {}
///         offload_core::tier::TierFailure::Corrupt => {}
///         offload_core::tier::TierFailure::Cancelled => {}
///         offload_core::tier::TierFailure::TierDown => {}
///         offload_core::tier::TierFailure::Timeout => {}
///         offload_core::tier::TierFailure::Io => {}
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TierFailure {
    /// The tier does not hold the chunk (never stored, evicted, no peer has it).
    Missing,
    /// The bytes did not verify (checksum, header, stored length, torn record); a tier that
    /// keeps the copy quarantines it.
    Corrupt,
    /// The job was cancelled (cancel, drain, reset, shutdown) before the key was transferred.
    Cancelled,
    /// The tier cannot serve now: shut down, its worker gone, no peer reachable.
    TierDown,
    /// A deadline passed before the key was transferred.
    Timeout,
    /// The tier's storage or transport failed this key: an I/O error, no space, a short write.
    Io,
}

impl TierFailure {
    /// Every kind, in declaration order.
    pub const ALL: [TierFailure; 6] = [
        TierFailure::Missing,
        TierFailure::Corrupt,
        TierFailure::Cancelled,
        TierFailure::TierDown,
        TierFailure::Timeout,
        TierFailure::Io,
    ];

    /// A short lower-case name for logs and metric labels (`"missing"`, `"tier_down"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            TierFailure::Missing => "missing",
            TierFailure::Corrupt => "corrupt",
            TierFailure::Cancelled => "cancelled",
            TierFailure::TierDown => "tier_down",
            TierFailure::Timeout => "timeout",
            TierFailure::Io => "io",
        }
    }
}

/// One failed key of a [`TierCompletion`] and why it failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FailedKey {
    /// The key.
    pub key: ChunkKey,
    /// Why.
    pub kind: TierFailure,
}

impl FailedKey {
    /// `key` failed because of `kind`.
    pub const fn new(key: ChunkKey, kind: TierFailure) -> Self {
        Self { key, kind }
    }
}

/// The single completion of a [`TierJob`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCompletion {
    /// The job.
    pub id: JobId,
    /// Keys that failed, each with its reason (empty on full success), each key at most once and
    /// only keys the job names. For a load, a failed key's slot holds no valid data and must not
    /// be served; keys not listed were transferred and verified.
    pub failed: Vec<FailedKey>,
}

impl TierCompletion {
    /// Every chunk of job `id` succeeded.
    pub fn success(id: JobId) -> Self {
        Self {
            id,
            failed: Vec::new(),
        }
    }

    /// Every key in `keys` of job `id` failed for the same reason.
    pub fn all_failed(
        id: JobId,
        keys: impl IntoIterator<Item = ChunkKey>,
        kind: TierFailure,
    ) -> Self {
        Self {
            id,
            failed: keys
                .into_iter()
                .map(|key| FailedKey { key, kind })
                .collect(),
        }
    }

    /// Whether every chunk of the job succeeded.
    pub fn is_success(&self) -> bool {
        self.failed.is_empty()
    }

    /// The failed keys, in the order reported.
    pub fn failed_keys(&self) -> impl Iterator<Item = ChunkKey> + '_ {
        self.failed.iter().map(|f| f.key)
    }

    /// Why `key` failed, or `None` if it did not.
    pub fn failure_of(&self, key: ChunkKey) -> Option<TierFailure> {
        self.failed.iter().find(|f| f.key == key).map(|f| f.kind)
    }
}

/// A secondary tier's answer for one key. Lookups never block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TierLookup {
    /// The tier holds the chunk and a load of it is expected to succeed.
    Hit,
    /// The tier does not hold the chunk.
    Miss,
    /// Not known yet (an asynchronous probe is under way); ask again later. A tier gives up after
    /// its own deadline and answers `Miss`.
    Retry,
}

/// Why a tier refused a job at submission (it then never completes, since it was not accepted).
///
/// Non-exhaustive: a tier may gain reasons to refuse (a third party's tier is built against
/// this enum, the manager matches it); a caller treats an unknown refusal like
/// [`SubmitError::Invalid`], final for that job.
///
/// ```compile_fail
/// // Outside offload-core a match needs a `_` arm:
/// fn f(x: offload_core::tier::SubmitError) {
///     match x {
///         offload_core::tier::SubmitError::Busy { .. } => {}
///         offload_core::tier::SubmitError::ShutDown => {}
///         offload_core::tier::SubmitError::Invalid(_) => {}
///     }
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The tier's bounded queue is full; submit again later.
    #[error("tier queue full ({in_flight} jobs in flight)")]
    Busy {
        /// Jobs in flight at the time.
        in_flight: usize,
    },
    /// The tier was shut down.
    #[error("tier is shut down")]
    ShutDown,
    /// The job is malformed (duplicate id, slot out of range, length over the slot size).
    #[error("invalid job: {0}")]
    Invalid(String),
}

/// A storage backend for chunks: the primary tier's worker side or a secondary tier.
///
/// # Contract
///
/// * **Exactly one completion.** Every job accepted by [`Tier::submit`] (it returned `Ok`)
///   produces exactly one [`TierCompletion`] from [`Tier::poll`], success or failure, also when it
///   was cancelled, drained or shut down. A job refused by `submit` produces none.
/// * **Non-blocking.** `lookup`, `submit` and `poll` never wait for I/O; completions are found by
///   polling. Every internal wait has a deadline, after which the job fails.
/// * **Buffer ownership.** From `submit` until its completion has been returned by `poll`, the job
///   owns the host slots it names: the tier may read them (store) or write them (load), and the
///   caller must neither reuse nor free them, even if it cancels the job or loses interest. Once
///   the completion is returned the tier holds no reference to them.
/// * **Cancel** is a request: the job still completes exactly once, with the keys not transferred
///   listed as failed ([`TierFailure::Cancelled`]). A load completion may list as failed only keys whose slots hold no valid data.
/// * **Drain** blocks until every accepted job has completed and its completion is queued for
///   `poll`; the tier stays usable afterwards. A tier may bound that wait by a deadline of its
///   configuration (a disk that stops answering): past it, `drain` returns with the jobs not
///   reported yet still in flight (their slots still theirs), reported by a later `poll` or at
///   shutdown, and the tier counts it. Callers that need every job reported poll until they are.
/// * **Shutdown** cancels and drains; after it, `submit` answers [`SubmitError::ShutDown`] and `poll`
///   still returns the remaining completions.
/// * **Integrity.** A load never reports success for bytes that differ from what was stored under
///   that key: a checksum mismatch, short read or torn copy is a failed key (the engine recomputes).
/// * **Failure kinds.** Each failed key carries a [`TierFailure`]: `Missing` (not held),
///   `Corrupt` (did not verify), `Cancelled` (cancel, drain, shutdown), `TierDown` (shut down,
///   unreachable), `Timeout` (a deadline passed), `Io` (storage or transport error). The kind
///   changes counters only: every failed key is a recompute.
/// * **Requests.** After [`Tier::on_request_finished`] for a request, no job or touch names it.
pub trait Tier: Send {
    /// A short name for logs and metrics (`"fs"`, `"p2p"`, ...).
    fn name(&self) -> &str;
    /// The medium reported in KV events.
    fn medium(&self) -> Medium;
    /// Answers for one key without blocking.
    fn lookup(&mut self, key: ChunkKey) -> TierLookup;
    /// Marks keys as recently used, in reverse order (the first prefix chunk is evicted last).
    fn touch(&mut self, keys: &[ChunkKey]);
    /// Accepts a job, or refuses it without side effects.
    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError>;
    /// Moves completions found since the last call into `out`, without blocking.
    fn poll(&mut self, out: &mut Vec<TierCompletion>);
    /// Asks an accepted job to stop early; it still completes exactly once.
    fn cancel(&mut self, id: JobId);
    /// Waits until every accepted job has completed (completions then wait in `poll`).
    fn drain(&mut self);
    /// The request finished: every store for it was submitted.
    fn on_request_finished(&mut self, request: RequestId);
    /// Cancels and drains everything; later submits are refused.
    fn shutdown(&mut self);
    /// Moves the keys this tier dropped by itself since the last call (evicted to stay under its
    /// capacity, or removed as unreadable), oldest first, into `out`, without blocking, and
    /// returns how many removals it dropped unreported because too many waited (its list is
    /// bounded). The tiering manager turns each key into a `Removed` KV event with this tier's
    /// medium. Default: the tier reports none.
    fn take_evicted(&mut self, _out: &mut Vec<ChunkKey>) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_answers_for_each_failed_key_and_its_kind() {
        let (a, b, c) = (
            ChunkKey::new(1, 0),
            ChunkKey::new(2, 0),
            ChunkKey::new(3, 1),
        );
        let done = TierCompletion::all_failed(JobId(7), [a, b], TierFailure::Timeout);
        assert!(!done.is_success());
        assert_eq!(done.failed_keys().collect::<Vec<_>>(), vec![a, b]);
        assert_eq!(done.failure_of(b), Some(TierFailure::Timeout));
        assert_eq!(done.failure_of(c), None);
        assert!(TierCompletion::success(JobId(8)).is_success());
        let names: Vec<&str> = TierFailure::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(
            names,
            [
                "missing",
                "corrupt",
                "cancelled",
                "tier_down",
                "timeout",
                "io"
            ]
        );
    }
}
