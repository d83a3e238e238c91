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

    /// Drops every chunk, also those being written or read. The caller guarantees that no slot is
    /// handed to a new job before every older job finished (workers finish jobs older than
    /// `ConnectorMeta::reset_before` before they touch any slot).
    fn reset(&mut self);

    /// Moves the events gathered since the last call into `out`.
    fn take_events(&mut self, out: &mut Vec<KvEvent>);
}
