//! The client worker's NIXL path (feature `nixl`): for each batch of a load job, NIXL_GET over
//! the peer's TCP connection, a NIXL READ of the offered chunks straight into the job's host
//! slots, NIXL_DONE, then the checksum of every chunk before it counts. A peer that offers no
//! NIXL, or a READ that NIXL refuses, makes this connection use the TCP GET instead.
//!
//! A READ whose job stops (cancel, shutdown, deadline) is released only once NIXL says it is
//! over (see `settle.rs`). One that NIXL still calls active after the stop grace parks its job:
//! the job's slots are quarantined (it completes only when NIXL ends the READ, checked between
//! commands; if that never happens, never), so the host pool cannot hand out a slot that a NIC
//! may still write.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use offload_core::tier::{FailedKey, TierChunk, TierCompletion};
use offload_core::{JobId, SlotId};

use super::{Client, Stop};
use crate::error::P2pError;
use crate::frame::{Frame, FrameError, FrameKind, NixlChunk};
use crate::nixl::{ReadEnd, ReadPair, StuckRead};
use crate::shared::log;
use crate::stats::add;
use crate::worker::Work;

/// Most keys in one NIXL_GET, so that an offer (metadata grows with its chunks) stays small.
const NIXL_KEYS_PER_REQUEST: usize = 64;

/// How often the client worker checks its parked jobs' READs while it waits for commands.
pub(super) const PARKED_CHECK: Duration = Duration::from_millis(10);

/// A load job parked behind a READ that outlived the stop grace.
#[derive(Debug)]
pub(super) struct Parked {
    job: JobId,
    /// The job's keys not loaded (all of them fail when it completes).
    failed: Vec<FailedKey>,
    read: StuckRead,
    peer: SocketAddr,
    since: Instant,
}

/// NIXL state of one peer's current connection.
#[derive(Debug, Default)]
pub(super) struct PeerNixl {
    /// The peer said it has no NIXL, or NIXL failed with it: use TCP until reconnected.
    off: bool,
    /// The peer agent's name, once its metadata was loaded.
    agent: Option<String>,
}

impl Client {
    /// Whether the NIXL path can serve the pending chunks of `work` from peer `p`: a plane here,
    /// the peer not known to lack one, and stable slot addresses for every pending chunk.
    pub(super) fn nixl_usable(&self, p: usize, work: &Work, done: &[bool]) -> bool {
        self.shared.nixl.get().is_some()
            && !self.peers[p].nixl.off
            && work
                .chunks
                .iter()
                .zip(done)
                .filter(|(_, &d)| !d)
                .all(|(&TierChunk { slot, .. }, _)| self.memory.slot_ptr(slot).is_some())
    }

    /// Forgets peer `p`'s NIXL state (its connection is going away).
    pub(super) fn forget_nixl(&mut self, p: usize) {
        let state = std::mem::take(&mut self.peers[p].nixl);
        if let (Some(plane), Some(agent)) = (self.shared.nixl.get(), state.agent) {
            plane.forget(&agent);
        }
    }

    /// Fetches the pending chunks of `work` from peer `p` by NIXL READ, in batches. Returns
    /// `true` when NIXL served the whole job (chunks the peer does not hold stay not done),
    /// `false` when the rest should go over TCP.
    pub(super) fn fetch_nixl(
        &mut self,
        p: usize,
        work: &Work,
        done: &mut [bool],
    ) -> Result<bool, Stop> {
        let pending: Vec<usize> = (0..work.chunks.len()).filter(|&i| !done[i]).collect();
        for batch in pending.chunks(NIXL_KEYS_PER_REQUEST) {
            if !self.nixl_batch(p, work, batch, done)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// One NIXL_GET, READ, NIXL_DONE and verification; `false`: fall back to TCP.
    fn nixl_batch(
        &mut self,
        p: usize,
        work: &Work,
        batch: &[usize],
        done: &mut [bool],
    ) -> Result<bool, Stop> {
        let shared = Arc::clone(&self.shared);
        let Some(plane) = shared.nixl.get() else {
            return Ok(false);
        };
        let keys = batch.iter().map(|&i| work.chunks[i].key).collect();
        let conn = self.conn(p);
        conn.set_deadline(work.deadline);
        conn.send(&Frame::NixlGet(keys), "send NIXL_GET")?;
        let (connection, metadata, offered) = self.recv_offer(p)?;
        if connection.is_empty() {
            log(format_args!(
                "peer {} offers no NIXL data plane; fetching over TCP",
                self.peers[p].addr
            ));
            self.peers[p].nixl.off = true;
            return Ok(false);
        }
        let loaded = plane
            .load_metadata(&connection)
            .and_then(|_| plane.load_metadata(&metadata));
        let agent = match loaded {
            Ok(agent) => agent,
            Err(reason) => return self.nixl_fallback(p, &reason),
        };
        self.peers[p].nixl.agent = Some(agent.clone());
        let (reads, targets) = self.plan_reads(p, work, batch, &offered)?;
        if !reads.is_empty() {
            let control = Arc::clone(&self.control);
            let id = work.id;
            match plane.read(&agent, &reads, work.deadline, &|| control.stopped(id)) {
                Ok(()) => {}
                Err(ReadEnd::Stopped) if control.stopped(id) => return Err(Stop::Cancelled),
                Err(ReadEnd::Stopped) => {
                    return Err(Stop::Failed(P2pError::Timeout {
                        op: "NIXL READ",
                        peer: self.peers[p].addr,
                        after: shared.config.fetch_deadline,
                    }))
                }
                Err(ReadEnd::Failed(reason)) => return self.nixl_fallback(p, &reason),
                Err(ReadEnd::Stuck(read)) => return Err(Stop::Stuck(read)),
            }
        }
        // Drop the peer's metadata after each batch, so that what this agent holds about a peer
        // stays bounded by one offer (each offer brings its connection metadata again).
        self.forget_nixl(p);
        self.conn(p).send(&Frame::NixlDone, "send NIXL_DONE")?;
        for (i, sum) in targets {
            self.verify_nixl(p, work, i, sum, done);
        }
        Ok(true)
    }

    /// Receives the NIXL_OFFER answering a NIXL_GET (its metadata copied out).
    #[allow(clippy::type_complexity)]
    fn recv_offer(&mut self, p: usize) -> Result<(Vec<u8>, Vec<u8>, Vec<NixlChunk>), Stop> {
        let op = "receive NIXL_OFFER";
        let peer = self.peers[p].addr;
        match self.conn(p).recv(op)? {
            Frame::NixlOffer {
                connection,
                metadata,
                chunks,
            } => Ok((connection.to_vec(), metadata.to_vec(), chunks)),
            Frame::Error(message) => Err(Stop::Failed(P2pError::Remote { op, peer, message })),
            other => Err(Stop::Failed(P2pError::Frame {
                op,
                peer,
                source: FrameError::Unexpected {
                    expected: "NIXL_OFFER",
                    found: other.kind(),
                },
            })),
        }
    }

    /// The READs for the offered chunks of `batch` (into registered slots), and for each the
    /// chunk index and the checksum to verify. An offer for a key not asked is a protocol error.
    #[allow(clippy::type_complexity)]
    fn plan_reads(
        &mut self,
        p: usize,
        work: &Work,
        batch: &[usize],
        offered: &[NixlChunk],
    ) -> Result<(Vec<ReadPair>, Vec<(usize, u64)>), Stop> {
        let mut claimed = vec![false; batch.len()];
        let (mut reads, mut targets) = (Vec::new(), Vec::new());
        for chunk in offered {
            let Some(b) =
                (0..batch.len()).find(|&b| !claimed[b] && work.chunks[batch[b]].key == chunk.key)
            else {
                return Err(Stop::Failed(P2pError::Frame {
                    op: "receive NIXL_OFFER",
                    peer: self.peers[p].addr,
                    source: FrameError::Malformed {
                        kind: FrameKind::NixlOffer,
                        reason: format!("offer for unrequested key {:?}", chunk.key),
                    },
                }));
            };
            claimed[b] = true;
            let i = batch[b];
            let TierChunk { key, slot, len } = work.chunks[i];
            if chunk.len != len {
                log(format_args!(
                    "peer {} offers {key:?} with {} bytes, expected {len}; not loaded",
                    self.peers[p].addr, chunk.len
                ));
                continue;
            }
            let Some(local) = self.registered_slot(slot) else {
                continue;
            };
            reads.push(ReadPair {
                local,
                remote: chunk.addr,
                len: len as usize,
            });
            targets.push((i, chunk.checksum));
        }
        Ok((reads, targets))
    }

    /// The address of `slot`, registered with NIXL (once per slot); `None` if it has no stable
    /// address or cannot be registered.
    fn registered_slot(&mut self, slot: SlotId) -> Option<usize> {
        let plane = self.shared.nixl.get()?;
        let addr = self.memory.slot_ptr(slot)?.as_ptr() as usize;
        let index = slot.0 as usize;
        if self.slot_registrations.len() <= index {
            self.slot_registrations.resize_with(index + 1, || None);
        }
        if self.slot_registrations[index].is_none() {
            match plane.register(addr, self.memory.slot_bytes()) {
                Ok(handle) => self.slot_registrations[index] = Some(handle),
                Err(reason) => {
                    log(format_args!("slot {}: {reason}", slot.0));
                    return None;
                }
            }
        }
        Some(addr)
    }

    /// Checks chunk `i` (just READ into its slot) against `sum`; marks it done if it matches.
    fn verify_nixl(&mut self, p: usize, work: &Work, i: usize, sum: u64, done: &mut [bool]) {
        let TierChunk { key, slot, len } = work.chunks[i];
        let Some(ptr) = self.memory.slot_ptr(slot) else {
            return;
        };
        // SAFETY: the job owns `slot` from submit until its completion is polled (the `Tier`
        // contract), the READ into it has completed, and `len <= slot_bytes` was checked at
        // submit; `slot_ptr` points at `slot_bytes` contiguous bytes.
        let bytes = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len as usize) };
        let auth = self.conn(p).chunk_auth().clone();
        let keyed = auth.is_keyed();
        if auth.tag(FrameKind::NixlOffer, key, bytes) != sum {
            self.shared.counters.tag_failed(keyed);
            log(format_args!(
                "peer {} sent {key:?} by NIXL with a checksum or MAC mismatch; not loaded",
                self.peers[p].addr
            ));
            self.corrupt.push(key);
            return;
        }
        done[i] = true;
        add(&self.shared.counters.chunks_fetched, 1);
        add(&self.shared.counters.chunks_fetched_nixl, 1);
        add(&self.shared.counters.bytes_fetched, u64::from(len));
    }

    /// NIXL failed with peer `p` for `reason`: tell the peer we are done with its offer, and
    /// use TCP on this connection from now on.
    fn nixl_fallback(&mut self, p: usize, reason: &str) -> Result<bool, Stop> {
        log(format_args!(
            "NIXL with peer {} failed, fetching over TCP: {reason}",
            self.peers[p].addr
        ));
        self.peers[p].nixl.off = true;
        self.conn(p).send(&Frame::NixlDone, "send NIXL_DONE")?;
        Ok(false)
    }

    /// Parks `work` behind its stuck READ from peer `p`: its slots stay the job's (quarantined)
    /// until NIXL ends the READ. Counted and logged.
    pub(super) fn park(&mut self, p: usize, work: &Work, done: &[bool], read: StuckRead) {
        let kind = self.failure_kind(work, false);
        let failed: Vec<FailedKey> = work
            .chunks
            .iter()
            .zip(done)
            .filter(|(_, &d)| !d)
            .map(|(&TierChunk { key, .. }, _)| FailedKey::new(key, kind))
            .collect();
        let slots: Vec<u32> = work
            .chunks
            .iter()
            .zip(done)
            .filter(|(_, &d)| !d)
            .map(|(&TierChunk { slot, .. }, _)| slot.0)
            .collect();
        add(&self.shared.counters.nixl_reads_quarantined, 1);
        self.control.set_quarantined(work.id, true);
        let peer = self.peers[p].addr;
        log(format_args!(
            "job {}: NIXL READ from peer {peer} still active {:?} after the job stopped; \
             slots {slots:?} quarantined until NIXL ends it",
            work.id.0,
            crate::nixl::STOP_GRACE
        ));
        self.parked.push(Parked {
            job: work.id,
            failed,
            read,
            peer,
            since: Instant::now(),
        });
    }

    /// Completes the parked jobs whose READ NIXL has ended (releasing it); `false` if the tier
    /// is gone.
    pub(super) fn unpark(&mut self, done: &Sender<TierCompletion>) -> bool {
        let Some(plane) = self.shared.nixl.get() else {
            return true;
        };
        let mut i = 0;
        while i < self.parked.len() {
            if !plane.ended(&self.parked[i].read) {
                i += 1;
                continue;
            }
            let parked = self.parked.swap_remove(i);
            // Over: dropping the request releases it in NIXL.
            drop(parked.read);
            add(&self.shared.counters.nixl_reads_unquarantined, 1);
            self.control.set_quarantined(parked.job, false);
            log(format_args!(
                "job {}: NIXL READ from peer {} ended {:?} after it was quarantined; slots freed",
                parked.job.0,
                parked.peer,
                parked.since.elapsed()
            ));
            let completion = TierCompletion {
                id: parked.job,
                failed: parked.failed,
            };
            if done.send(completion).is_err() {
                return false;
            }
        }
        true
    }

    /// At the worker's exit: completes the parked jobs whose READ ended; the others stay
    /// uncompleted, and their READs, slot registrations and the slot memory are leaked on
    /// purpose, so that nothing a NIC may still write is ever freed or released.
    pub(super) fn abandon_parked(&mut self, done: &Sender<TierCompletion>) {
        // A `false` (the tier is gone) loses nothing: its completions go with it.
        let _ = self.unpark(done);
        if self.parked.is_empty() {
            return;
        }
        for parked in self.parked.drain(..) {
            log(format_args!(
                "job {}: NIXL READ from peer {} still active at shutdown; its slots stay \
                 quarantined and the request is never released",
                parked.job.0, parked.peer
            ));
            parked.read.abandon();
        }
        std::mem::forget(std::mem::take(&mut self.slot_registrations));
        std::mem::forget(Arc::clone(&self.memory));
    }
}
