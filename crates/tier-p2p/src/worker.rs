//! What the tier hands its worker threads ([`Work`], [`Control`]), and the local worker: it
//! publishes `Store` jobs into the published-chunk store and serves `Load` jobs whose chunks are
//! all published here, so neither waits behind the network.

use std::collections::{HashMap, HashSet};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use offload_core::tier::{FailedKey, SlotMemory, TierChunk, TierCompletion, TierFailure};
use offload_core::{ChunkKey, JobId};

use crate::shared::{lock, log, Shared};
use crate::stats::add;
use crate::store::{checksum, PublishedChunk, TooLarge};

/// One accepted job on its way to a worker.
#[derive(Debug)]
pub(crate) struct Work {
    /// The job.
    pub(crate) id: JobId,
    /// `(key, slot, len)` as submitted (validated).
    pub(crate) chunks: Vec<TierChunk>,
    /// When the job must be complete (loads: submission + `fetch_deadline`).
    pub(crate) deadline: Instant,
    /// For each chunk, the peer (index into the configured peers) that a lookup said holds it.
    pub(crate) hints: Vec<Option<u16>>,
}

/// Cancellation and shutdown, as the workers see them, and the client's open sockets (so that
/// shutdown wakes a worker blocked on a stalled peer at once, instead of at its deadline).
#[derive(Debug, Default)]
pub(crate) struct Control {
    cancelled: Mutex<HashSet<JobId>>,
    /// Jobs whose NIXL READ outlived the stop grace: they complete only when NIXL ends it, and
    /// neither `drain` nor a worker's exit completes them before (their slots stay theirs).
    quarantined: Mutex<HashSet<JobId>>,
    shutting_down: AtomicBool,
    /// Push commands queued for the client worker and not yet done.
    pushes_queued: AtomicUsize,
    /// Peers in the member set, as of the client worker's last look at the directory.
    member_count: AtomicUsize,
    sockets: Mutex<HashMap<usize, TcpStream>>,
}

impl Control {
    /// Records the size of the member set.
    pub(crate) fn set_member_count(&self, count: usize) {
        self.member_count.store(count, Ordering::SeqCst);
    }

    /// Whether some member does not own every key (with `owners` owners per key, 0: all):
    /// only then must a publish push its chunks, since otherwise every lookup asks every
    /// member, this one included.
    pub(crate) fn push_needed(&self, owners: usize) -> bool {
        owners != 0 && self.member_count.load(Ordering::SeqCst) > owners
    }

    /// Counts a push command about to be queued, unless `max` are queued already.
    pub(crate) fn start_push(&self, max: usize) -> bool {
        let queued = self.pushes_queued.fetch_add(1, Ordering::SeqCst);
        if queued < max {
            return true;
        }
        self.pushes_queued.fetch_sub(1, Ordering::SeqCst);
        false
    }

    /// Counts a push command done (or not queued after all).
    pub(crate) fn end_push(&self) {
        self.pushes_queued.fetch_sub(1, Ordering::SeqCst);
    }

    /// Asks job `id` to stop early.
    pub(crate) fn cancel(&self, id: JobId) {
        lock(&self.cancelled).insert(id);
    }

    /// Forgets `id` (it completed).
    pub(crate) fn forget(&self, id: JobId) {
        lock(&self.cancelled).remove(&id);
    }

    /// Marks job `id` quarantined (its NIXL READ is stuck), or not any more.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn set_quarantined(&self, id: JobId, quarantined: bool) {
        let mut set = lock(&self.quarantined);
        if quarantined {
            set.insert(id);
        } else {
            set.remove(&id);
        }
    }

    /// Whether job `id` is quarantined.
    pub(crate) fn quarantined(&self, id: JobId) -> bool {
        lock(&self.quarantined).contains(&id)
    }

    /// Asks every job to stop early, and closes the client's sockets.
    pub(crate) fn shut_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        for socket in lock(&self.sockets).values() {
            // Already closed is fine.
            let _ = socket.shutdown(Shutdown::Both);
        }
    }

    /// Remembers the socket of the client's connection to peer `peer`.
    pub(crate) fn register(&self, peer: usize, socket: TcpStream) {
        if self.shutting_down() {
            let _ = socket.shutdown(Shutdown::Both);
        }
        lock(&self.sockets).insert(peer, socket);
    }

    /// Forgets the socket of peer `peer` (its connection was dropped).
    pub(crate) fn unregister(&self, peer: usize) {
        lock(&self.sockets).remove(&peer);
    }

    /// Whether the tier is shutting down.
    pub(crate) fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Whether job `id` should stop.
    pub(crate) fn stopped(&self, id: JobId) -> bool {
        self.shutting_down.load(Ordering::SeqCst) || lock(&self.cancelled).contains(&id)
    }
}

/// A job for the local worker.
#[derive(Debug)]
pub(crate) enum LocalCommand {
    /// Publish every chunk.
    Store(Work),
    /// Copy every chunk from the published store into its slot.
    Load(Work),
}

/// The local worker's loop; returns when the tier drops its sender.
pub(crate) fn run_local(
    shared: &Shared,
    memory: &dyn SlotMemory,
    control: &Control,
    commands: &Receiver<LocalCommand>,
    done: &Sender<TierCompletion>,
) {
    for command in commands {
        let completion = match command {
            LocalCommand::Store(work) => publish(shared, memory, control, &work),
            LocalCommand::Load(work) => {
                let failed = work
                    .chunks
                    .iter()
                    .filter_map(|&chunk| {
                        let copied = if control.stopped(work.id) {
                            Err(TierFailure::Cancelled)
                        } else {
                            copy_local(shared, memory, chunk)
                        };
                        copied.err().map(|kind| FailedKey::new(chunk.key, kind))
                    })
                    .collect();
                TierCompletion {
                    id: work.id,
                    failed,
                }
            }
        };
        if done.send(completion).is_err() {
            return;
        }
    }
}

/// Publishes a store job's chunks: copies each slot into the store with its checksum (and, with
/// a secret, its digest for keyed tags).
fn publish(
    shared: &Shared,
    memory: &dyn SlotMemory,
    control: &Control,
    work: &Work,
) -> TierCompletion {
    let mut failed = Vec::new();
    for &TierChunk { key, slot, len } in &work.chunks {
        if control.stopped(work.id) {
            failed.push(FailedKey::new(key, TierFailure::Cancelled));
            continue;
        }
        {
            let mut store = lock(&shared.store);
            if store.contains(key) {
                store.touch(&[key]);
                continue;
            }
        }
        let mut bytes = vec![0u8; len as usize].into_boxed_slice();
        memory.read_slot(slot, 0, &mut bytes);
        let sum = checksum(&bytes);
        let chunk = PublishedChunk::new(bytes, sum);
        if let Some(hash_key) = &shared.identity.hash_key {
            // Keyed tags bind the digest: hash once here, not on every send.
            chunk.digest(hash_key);
        }
        match lock(&shared.store).insert(key, chunk) {
            Ok(evicted) => add(&shared.counters.evictions, evicted as u64),
            Err(TooLarge) => {
                log(format_args!(
                    "cannot publish {key:?}: {len} bytes exceed `published_bytes_max` {}",
                    shared.config.published_bytes_max
                ));
                failed.push(FailedKey::new(key, TierFailure::Io));
            }
        }
    }
    TierCompletion {
        id: work.id,
        failed,
    }
}

/// Copies a published chunk into its slot after verifying it; `Missing` if it is not published
/// here, `Corrupt` if it has another length or fails its checksum (then it is removed:
/// quarantined).
pub(crate) fn copy_local(
    shared: &Shared,
    memory: &dyn SlotMemory,
    TierChunk { key, slot, len }: TierChunk,
) -> Result<(), TierFailure> {
    let Some(chunk) = lock(&shared.store).get(key) else {
        return Err(TierFailure::Missing);
    };
    if chunk.bytes.len() != len as usize {
        return Err(TierFailure::Corrupt);
    }
    if checksum(&chunk.bytes) != chunk.checksum {
        add(&shared.counters.checksum_mismatches, 1);
        log(format_args!(
            "published copy of {key:?} fails its checksum; removing it"
        ));
        lock(&shared.store).remove(key);
        return Err(TierFailure::Corrupt);
    }
    memory.write_slot(slot, 0, &chunk.bytes);
    Ok(())
}

/// Whether a key is published here (for routing a load to the local worker, and for predicting
/// which chunks of a queued load the client will ask its peers for).
pub(crate) fn published(shared: &Arc<Shared>, key: ChunkKey) -> bool {
    lock(&shared.store).contains(key)
}
