//! The interface between the scheduler-side state machine and whatever manages offloaded chunks:
//! the host pool alone ([`crate::HostPool`]) or the connector's tiering manager.

use crate::event::KvEvent;
use crate::key::{ChunkKey, LookupResult, RequestId, SlotId};
use crate::CoreError;

/// The result of a successful [`OffloadManager::prepare_store`]: the keys that were not present,
/// in the order given, each with the slot reserved for it. Reused across calls to avoid allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PreparedStore {
    /// Keys to write, a subset of the keys passed in, in their order.
    pub keys: Vec<ChunkKey>,
    /// `slots[i]` is the slot reserved (reference count -1) for `keys[i]`.
    pub slots: Vec<SlotId>,
}

impl PreparedStore {
    /// Empties both lists, keeping their capacity.
    pub fn clear(&mut self) {
        self.keys.clear();
        self.slots.clear();
    }
}

/// The chunk manager the scheduler drives (design.md section 4, items 9-12).
///
/// Calls carry the request they are made for, so that a manager with per-request state (the
/// tiering manager) can check the lifecycle: no `prepare_store` or `touch` for a request after its
/// `on_request_finished`.
pub trait OffloadManager {
    /// Answers for one key. `Pending` counts as a hit but defers the request; `Retry` defers it and
    /// lets the scan go on.
    fn lookup(&mut self, key: ChunkKey, request: RequestId) -> LookupResult;

    /// Pins ready chunks for reading (reference count +1) and returns their slots, in order.
    /// Fails without effect if any key is not ready.
    fn prepare_load(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        slots: &mut Vec<SlotId>,
    ) -> Result<(), CoreError>;

    /// Unpins chunks pinned by `prepare_load`.
    fn complete_load(&mut self, keys: &[ChunkKey]);

    /// Marks keys as recently used, walking them in reverse so the first prefix chunk is evicted last.
    fn touch(&mut self, keys: &[ChunkKey], request: RequestId);

    /// Reserves slots for the keys not yet present. Never evicts a key passed in the same call,
    /// fails atomically (nothing reserved, nothing evicted) when there is not enough room.
    fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        request: RequestId,
        out: &mut PreparedStore,
    ) -> Result<(), CoreError>;

    /// Ends stores: on success the chunks become ready (a `Stored` event); on failure their slots
    /// are freed. Completing an already-ready chunk does nothing.
    fn complete_store(&mut self, keys: &[ChunkKey], success: bool);

    /// The request finished and every store it will ever prepare was prepared. Called exactly once.
    fn on_request_finished(&mut self, request: RequestId);

    /// Drops every chunk, also those being written or read. The slot of a chunk being written or
    /// read is not freed but *held*, one hold per job in flight on it (its writer, each of its
    /// readers): a transfer in flight may still write it, so it is handed to no new key until
    /// [`OffloadManager::release_held`] ended every hold. The caller ends each hold once the job
    /// is over (acknowledged by every worker, reported by its tier), or at once for a job that
    /// was never sent.
    fn reset(&mut self);

    /// Ends one hold on each of `slots`, taken by a [`OffloadManager::reset`] for a job in flight
    /// then: call it once per slot of such a job, when that job is over. A slot whose last hold
    /// ends is free again. Ending a hold on a slot that is not held is a broken invariant.
    fn release_held(&mut self, slots: &[SlotId]);

    /// Moves the events gathered since the last call into `out`.
    fn take_events(&mut self, out: &mut Vec<KvEvent>);
}
