//! The client worker: one thread that owns the outgoing connection to every peer, answers lookup
//! batches with one HAVE per peer, and runs load jobs with one GET per peer and batch, reading
//! DATA payloads straight into the reserved host slots and verifying each checksum before the
//! chunk counts.
//!
//! GETs are pipelined one ahead, so at most two requests are in flight per peer: the next batch's
//! GET goes out before the current batch's answer is read, and while the last answer of a job
//! arrives, the first GET of the next queued load job goes out too, if that GET is for the same
//! peer (which of its chunks are published here is predicted; the local copies wait for its
//! turn). The peer answers requests in order, so it streams on without waiting a round trip
//! between batches and jobs. A job that stops before reading an answer sent ahead for it, or
//! whose first batch turned out other than predicted, drops that connection.
//!
//! A peer that fails (name resolution, connect, handshake, timeout, bad frame, closed
//! mid-transfer) is marked down and skipped until a backoff that doubles with each consecutive
//! failure has passed; then its name is resolved again and it is reconnected, which also covers
//! a peer that restarted or moved.
//!
//! Who the peers are comes from the [`PeerDirectory`], read again before every command; each key
//! is asked of (and pushed to) its owners among them only ([`owners`], rendezvous hashing), so a
//! lookup costs at most `owners` HAVE keys per key, however many members there are.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use offload_core::tier::{FailedKey, SlotMemory, TierChunk, TierCompletion, TierFailure};
use offload_core::{ChunkKey, JobId};

use crate::config::P2pConfig;
use crate::conn::Conn;
use crate::directory::{member_id, owners, PeerDirectory};
use crate::error::P2pError;
use crate::frame::{decode_data_prefix, Frame, FrameError, FrameKind, DATA_PREFIX_BYTES};
use crate::handshake;
use crate::peer::PeerAddr;
use crate::shared::{broken, lock, log, Shared};
use crate::stats::{add, PeerStatus};
use crate::worker::{copy_local, published, Control, Work};

/// Bytes of a payload received before they are hashed (small enough to stay in cache).
pub(crate) const HASH_PIECE_BYTES: usize = 256 * 1024;
/// Bytes read at a time when a payload is discarded.
const DISCARD_PIECE_BYTES: usize = 1 << 20;
/// The most keys in a GET sent ahead of its turn. The peer reads its next request only after it
/// has sent the current answer, so a GET sent ahead must fit in the socket buffers while the
/// peer is blocked sending to us: 1024 keys (12 KiB) fit in Linux's default send buffer (16 KiB)
/// alone. Larger batches wait their turn; they are long enough that a round trip hardly counts.
const AHEAD_KEYS_MAX: usize = 1024;

#[cfg(feature = "nixl")]
#[path = "client_nixl.rs"]
mod nixl_fetch;

/// A job for the client worker.
#[derive(Debug)]
pub(crate) enum ClientCommand {
    /// Ask the keys' owners which of these keys they hold.
    Lookup(Vec<ChunkKey>),
    /// Load these chunks (local copies first, then peers).
    Load(Work),
    /// Push these chunks, just published here, to their keys' owners (best effort).
    Push(Vec<ChunkKey>),
}

/// The peers' answer to one lookup batch.
#[derive(Debug)]
pub(crate) struct LookupAnswer {
    /// The keys asked.
    pub(crate) keys: Vec<ChunkKey>,
    /// For each key, the first peer (slot) that holds it.
    pub(crate) holders: Vec<Option<u16>>,
}

/// A GET sent ahead of its turn on a peer's connection: the first batch of a queued load job.
struct Ahead {
    job: JobId,
    keys: Vec<ChunkKey>,
}

/// One peer slot: a member of the directory, or a former one (kept until its slot is reused,
/// with no connection).
struct Peer {
    /// The peer as the directory names it.
    name: PeerAddr,
    /// Its identity for rendezvous hashing.
    id: u64,
    /// Whether it is in the current member set.
    member: bool,
    /// The address of the current (or last) connection; unspecified before the first.
    addr: SocketAddr,
    conn: Option<Conn>,
    /// The GET sent ahead on `conn` for a queued job, if any (gone with the connection).
    ahead: Option<Ahead>,
    failures: u32,
    retry_at: Option<Instant>,
    /// When the connection last carried a request.
    used_at: Instant,
    /// NIXL state of the current connection.
    #[cfg(feature = "nixl")]
    nixl: nixl_fetch::PeerNixl,
}

/// Why a fetch from one peer stopped early.
enum Stop {
    /// The job was cancelled or the tier is shutting down; the peer is fine.
    Cancelled,
    /// The peer failed.
    Failed(P2pError),
    /// The job stopped while a NIXL READ into its slots was under way, and NIXL still called
    /// the READ active after the stop grace: the job is parked until NIXL ends it.
    #[cfg(feature = "nixl")]
    Stuck(crate::nixl::StuckRead),
}

impl From<P2pError> for Stop {
    fn from(error: P2pError) -> Self {
        Stop::Failed(error)
    }
}

/// The client worker's state.
pub(crate) struct Client {
    /// NIXL registrations of the host slots, by slot index. Declared before `memory`, so they
    /// are dropped (deregistered) before the last handle to the memory can go.
    #[cfg(feature = "nixl")]
    slot_registrations: Vec<Option<nixl_sys::RegistrationHandle>>,
    shared: Arc<Shared>,
    memory: Arc<dyn SlotMemory>,
    control: Arc<Control>,
    directory: Box<dyn PeerDirectory>,
    /// How peers may name this instance (its bound address, `advertise`): never a member.
    self_names: Vec<PeerAddr>,
    /// Peer slots, by index (hints and sockets are by slot).
    peers: Vec<Peer>,
    /// Slot of each peer name.
    slots: HashMap<PeerAddr, usize>,
    /// The current members' slots and rendezvous ids, in the directory's (sorted) order.
    members: Vec<usize>,
    member_ids: Vec<u64>,
    /// Each slot's state, `None` for slots not in the member set.
    status: Arc<Mutex<Vec<Option<PeerStatus>>>>,
    scratch: Vec<u8>,
    /// Keys of the load under way whose bytes from some peer did not verify (the wrong length,
    /// a checksum or MAC mismatch): if no other peer supplies them they fail as `Corrupt`.
    corrupt: Vec<ChunkKey>,
    commands: Receiver<ClientCommand>,
    /// The command taken from `commands` ahead of its turn (to send its GET early), run next.
    next: Option<ClientCommand>,
    /// Load jobs parked behind a stuck NIXL READ (their slots quarantined), bounded by the
    /// tier's jobs in flight.
    #[cfg(feature = "nixl")]
    parked: Vec<nixl_fetch::Parked>,
}

impl Client {
    /// A client for the members of `directory` (less `self_names`) that runs `commands`,
    /// reporting the peers' state into `status`.
    pub(crate) fn new(
        shared: Arc<Shared>,
        memory: Arc<dyn SlotMemory>,
        control: Arc<Control>,
        directory: Box<dyn PeerDirectory>,
        self_names: Vec<PeerAddr>,
        status: Arc<Mutex<Vec<Option<PeerStatus>>>>,
        commands: Receiver<ClientCommand>,
    ) -> Self {
        let mut client = Self {
            #[cfg(feature = "nixl")]
            slot_registrations: Vec::new(),
            shared,
            memory,
            control,
            directory,
            self_names,
            peers: Vec::new(),
            slots: HashMap::new(),
            members: Vec::new(),
            member_ids: Vec::new(),
            status,
            scratch: Vec::new(),
            corrupt: Vec::new(),
            commands,
            next: None,
            #[cfg(feature = "nixl")]
            parked: Vec::new(),
        };
        client.refresh_members();
        client
    }

    /// Reads the directory's member set and updates the slots: new members get a slot (a former
    /// member's, if one is free), members that left are disconnected. Keeps slots at most
    /// `members_max` plus the slots of members that left and were not reused.
    fn refresh_members(&mut self) {
        let mut names = self.directory.members();
        names.retain(|name| !self.self_names.contains(name));
        names.sort();
        names.dedup();
        let members_max = self.shared.config.members_max;
        if names.len() > members_max {
            log(format_args!(
                "peer directory lists {} members; using the first {members_max} (`members_max`)",
                names.len()
            ));
            names.truncate(members_max);
        }
        let same = names.len() == self.members.len()
            && names
                .iter()
                .zip(&self.members)
                .all(|(name, &p)| self.peers[p].name == *name);
        if same {
            return;
        }
        for p in 0..self.peers.len() {
            self.peers[p].member = false;
        }
        let mut fresh = Vec::new();
        for name in &names {
            match self.slots.get(name) {
                Some(&p) => self.peers[p].member = true,
                None => fresh.push(name.clone()),
            }
        }
        let mut free: Vec<usize> = (0..self.peers.len())
            .filter(|&p| !self.peers[p].member)
            .collect();
        for p in &free {
            self.disconnect(*p);
        }
        free.reverse();
        for name in fresh {
            let peer = Peer::new(name.clone());
            let p = match free.pop() {
                Some(p) => {
                    self.slots.remove(&self.peers[p].name);
                    self.peers[p] = peer;
                    p
                }
                None => {
                    self.peers.push(peer);
                    self.peers.len() - 1
                }
            };
            self.slots.insert(name, p);
        }
        self.members = names
            .iter()
            .filter_map(|n| self.slots.get(n).copied())
            .collect();
        self.member_ids = self.members.iter().map(|&p| self.peers[p].id).collect();
        self.control.set_member_count(self.members.len());
        let mut status = lock(&self.status);
        status.clear();
        status.extend(self.peers.iter().map(|peer| {
            peer.member.then(|| PeerStatus {
                peer: peer.name.clone(),
                addr: None,
                connected: peer.conn.is_some(),
                consecutive_failures: peer.failures,
                last_error: None,
            })
        }));
    }

    /// The slots of `key`'s owners among the current members.
    fn owners_of(&self, key: ChunkKey) -> impl Iterator<Item = usize> + '_ {
        let n = match self.shared.config.owners {
            0 => self.member_ids.len(),
            n => n,
        };
        owners(key, &self.member_ids, n)
            .into_iter()
            .map(|m| self.members[m])
    }

    /// The worker's loop; returns when the tier drops its sender.
    pub(crate) fn run(mut self, done: &Sender<TierCompletion>, answers: &Sender<LookupAnswer>) {
        loop {
            #[cfg(feature = "nixl")]
            if !self.unpark(done) {
                break;
            }
            let command = match self.next.take() {
                Some(command) => command,
                None => match self.next_command() {
                    Ok(Some(command)) => command,
                    Ok(None) => continue,
                    Err(()) => break,
                },
            };
            if !self.control.shutting_down() {
                self.refresh_members();
            }
            let sent = match command {
                ClientCommand::Lookup(keys) if self.control.shutting_down() => {
                    let holders = vec![None; keys.len()];
                    answers.send(LookupAnswer { keys, holders }).is_ok()
                }
                ClientCommand::Lookup(keys) => answers.send(self.lookup(keys)).is_ok(),
                ClientCommand::Load(work) => match self.load(&work) {
                    Some(completion) => done.send(completion).is_ok(),
                    // Parked behind a stuck NIXL READ: completed by `unpark`.
                    None => true,
                },
                ClientCommand::Push(keys) => {
                    if self.control.shutting_down() {
                        self.skip_push(keys.len());
                    } else {
                        self.push(&keys);
                    }
                    self.control.end_push();
                    true
                }
            };
            if !sent {
                break;
            }
        }
        for p in 0..self.peers.len() {
            self.disconnect(p);
        }
        #[cfg(feature = "nixl")]
        self.abandon_parked(done);
    }

    /// The next command: waits for one, or (with jobs parked behind stuck NIXL READs) for at
    /// most a short while, so that they are checked again (`Ok(None)`). `Err`: the tier is gone.
    fn next_command(&self) -> Result<Option<ClientCommand>, ()> {
        #[cfg(feature = "nixl")]
        if !self.parked.is_empty() {
            return match self.commands.recv_timeout(nixl_fetch::PARKED_CHECK) {
                Ok(command) => Ok(Some(command)),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => Ok(None),
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(()),
            };
        }
        self.commands.recv().map(Some).map_err(|_| ())
    }

    /// Asks the owners of `keys` which they hold: one HAVE per owner and batch (at most
    /// `keys_per_request_max` keys), the HAVEs of a round sent to every owner before any reply
    /// is read, all within `lookup_deadline`.
    fn lookup(&mut self, keys: Vec<ChunkKey>) -> LookupAnswer {
        let deadline = Instant::now() + self.shared.config.lookup_deadline;
        let mut holders = vec![None; keys.len()];
        // Peers asked about each key (its HAVE fan-out), for `lookup_peers_per_key_max`.
        let mut fan_out = vec![0u8; keys.len()];
        let mut asks: Vec<Vec<usize>> = vec![Vec::new(); self.peers.len()];
        for (i, &key) in keys.iter().enumerate() {
            for p in self.owners_of(key) {
                asks[p].push(i);
            }
        }
        let batch_max = self.shared.config.keys_per_request_max;
        let rounds = asks
            .iter()
            .map(|a| a.len().div_ceil(batch_max))
            .max()
            .unwrap_or(0);
        for round in 0..rounds {
            let mut asked = Vec::new();
            for (p, indexes) in asks.iter().enumerate() {
                let Some(batch) = indexes.chunks(batch_max).nth(round) else {
                    continue;
                };
                if !self.ready(p, deadline) {
                    continue;
                }
                let batch_keys: Vec<ChunkKey> = batch.iter().map(|&i| keys[i]).collect();
                let conn = self.conn(p);
                conn.set_deadline(deadline);
                match conn.send(&Frame::Have(batch_keys), "send HAVE") {
                    Ok(()) => asked.push((p, batch)),
                    Err(error) => self.fail(p, &error),
                }
            }
            let counters = &self.shared.counters;
            add(&counters.have_requests, asked.len() as u64);
            let asked_keys: usize = asked.iter().map(|(_, batch)| batch.len()).sum();
            add(&counters.lookup_keys_asked, asked_keys as u64);
            for &(_, batch) in &asked {
                for &i in batch {
                    fan_out[i] = fan_out[i].saturating_add(1);
                }
            }
            for (p, batch) in asked {
                match recv_have_reply(self.conn(p), batch.len()) {
                    Ok(held) => {
                        for (&i, _) in batch.iter().zip(&held).filter(|(_, &h)| h) {
                            // Fits: at most `members_max` (<= u16::MAX) slots are members.
                            holders[i] = holders[i].or(u16::try_from(p).ok());
                        }
                    }
                    Err(error) => self.fail(p, &error),
                }
            }
        }
        let widest = fan_out.iter().copied().max().unwrap_or(0);
        self.shared
            .counters
            .lookup_peers_per_key_max
            .fetch_max(u64::from(widest), std::sync::atomic::Ordering::Relaxed);
        LookupAnswer { keys, holders }
    }

    /// Skips a queued push batch at shutdown (best effort; each could take `fetch_deadline`):
    /// counted in `pushes_skipped_at_shutdown`, logged once.
    fn skip_push(&mut self, chunk_count: usize) {
        let before = self
            .shared
            .counters
            .pushes_skipped_at_shutdown
            .fetch_add(chunk_count as u64, std::sync::atomic::Ordering::Relaxed);
        if before == 0 {
            log("shutting down: skipping queued pushes (counted in pushes_skipped_at_shutdown)");
        }
    }

    /// Pushes the chunks of `keys` published here to their keys' owners (PUT, each answered by
    /// END), within `fetch_deadline`. Best effort: a failure is counted and logged, never
    /// retried; the chunk stays published here either way.
    fn push(&mut self, keys: &[ChunkKey]) {
        if !self.control.push_needed(self.shared.config.owners) {
            return;
        }
        let deadline = Instant::now() + self.shared.config.fetch_deadline;
        for &key in keys {
            let Some(chunk) = lock(&self.shared.store).get(key) else {
                continue;
            };
            let targets: Vec<usize> = self.owners_of(key).collect();
            for p in targets {
                if self.control.shutting_down() {
                    return;
                }
                if !self.ready(p, deadline) {
                    add(&self.shared.counters.push_failures, 1);
                    continue;
                }
                let conn = self.conn(p);
                conn.set_deadline(deadline);
                let tag = conn.chunk_auth().tag_of(FrameKind::Put, key, &chunk);
                let sent = conn
                    .send_chunk(FrameKind::Put, key, tag, &chunk.bytes, "send PUT")
                    .and_then(|()| recv_end_frame(conn, "receive PUT answer"));
                match sent {
                    Ok(1) => add(&self.shared.counters.chunks_pushed, 1),
                    Ok(_) => add(&self.shared.counters.push_failures, 1),
                    Err(error) => {
                        add(&self.shared.counters.push_failures, 1);
                        self.fail(p, &error);
                    }
                }
            }
        }
    }

    /// Runs a load job: local copies, then GETs to the peers (those a lookup named first) until
    /// every chunk is loaded, the job is cancelled, or its deadline passes.
    fn load(&mut self, work: &Work) -> Option<TierCompletion> {
        self.corrupt.clear();
        let mut done: Vec<bool> = work
            .chunks
            .iter()
            .map(|&chunk| copy_local(&self.shared, &*self.memory, chunk).is_ok())
            .collect();
        #[cfg(feature = "nixl")]
        let mut stuck = None;
        let order = self.peer_order(work, &done);
        let mut reached = false;
        for &p in &order {
            if done.iter().all(|&d| d) || self.control.stopped(work.id) {
                break;
            }
            if Instant::now() >= work.deadline || !self.ready(p, work.deadline) {
                continue;
            }
            match self.fetch(p, work, &mut done) {
                Ok(()) => reached = true,
                Err(Stop::Cancelled) => {
                    // The stream is mid-answer; drop it rather than read the rest.
                    self.disconnect(p);
                    break;
                }
                Err(Stop::Failed(error)) => self.fail(p, &error),
                #[cfg(feature = "nixl")]
                Err(Stop::Stuck(read)) => {
                    self.disconnect(p);
                    stuck = Some((p, read));
                    break;
                }
            }
        }
        // A GET sent ahead for this job and not read (it stopped or ran out of time first): its
        // answer is on the way, so that stream is of no more use.
        for p in 0..self.peers.len() {
            if self.peers[p]
                .ahead
                .as_ref()
                .is_some_and(|a| a.job == work.id)
            {
                self.disconnect(p);
            }
        }
        #[cfg(feature = "nixl")]
        if let Some((p, read)) = stuck {
            self.park(p, work, &done, read);
            return None;
        }
        let kind = self.failure_kind(work, !order.is_empty() && !reached);
        let failed: Vec<FailedKey> = work
            .chunks
            .iter()
            .zip(&done)
            .filter(|(_, &d)| !d)
            .map(
                |(&TierChunk { key, .. }, _)| match self.corrupt.contains(&key) {
                    true => FailedKey::new(key, TierFailure::Corrupt),
                    false => FailedKey::new(key, kind),
                },
            )
            .collect();
        Some(TierCompletion {
            id: work.id,
            failed,
        })
    }

    /// What the keys of `work` not loaded failed of: the job was cancelled (or the tier shut
    /// down), its deadline passed, no peer asked could be reached (`unreached`), or else no peer
    /// had them. A key whose bytes failed verification from one peer and then was not found
    /// elsewhere counts as one of these too (the corruption is counted in the tier's stats).
    pub(crate) fn failure_kind(&self, work: &Work, unreached: bool) -> TierFailure {
        if self.control.stopped(work.id) {
            TierFailure::Cancelled
        } else if Instant::now() >= work.deadline {
            TierFailure::Timeout
        } else if unreached {
            TierFailure::TierDown
        } else {
            TierFailure::Missing
        }
    }

    /// Peers in the order to try for `work`: those named by lookups for missing chunks (most
    /// named first), then the missing chunks' other owners (owning most first). Members that own
    /// none of them are not asked.
    fn peer_order(&self, work: &Work, done: &[bool]) -> Vec<usize> {
        let mut named = vec![0usize; self.peers.len()];
        let mut owning = vec![0usize; self.peers.len()];
        let missing = work.chunks.iter().zip(&work.hints).zip(done);
        for ((&TierChunk { key, .. }, hint), _) in missing.filter(|(_, &d)| !d) {
            if let Some(p) = hint.map(usize::from).filter(|&p| p < named.len()) {
                named[p] += 1;
            }
            for p in self.owners_of(key) {
                owning[p] += 1;
            }
        }
        let mut order: Vec<usize> = (0..self.peers.len())
            .filter(|&p| self.peers[p].member && (named[p] > 0 || owning[p] > 0))
            .collect();
        // Stable: ties keep the slot order.
        order.sort_by_key(|&p| std::cmp::Reverse((named[p], owning[p])));
        order
    }

    /// GETs the chunks of `work` not yet done from peer `p`, in batches, each batch's GET sent
    /// before the answer to the one before it is read (if it is small), the first one possibly
    /// already sent by [`Client::ask_ahead`].
    fn fetch(&mut self, p: usize, work: &Work, done: &mut [bool]) -> Result<(), Stop> {
        let ahead = self.peers[p].ahead.take();
        #[cfg(feature = "nixl")]
        if ahead.is_none() && self.nixl_usable(p, work, done) && self.fetch_nixl(p, work, done)? {
            return Ok(());
        }
        let batches = self.batches(work, done);
        let sent_ahead = ahead.map(|a| {
            a.job == work.id && batches.first().is_some_and(|b| a.keys == keys_of(work, b))
        });
        let mut asked = match sent_ahead {
            Some(true) => 1,
            Some(false) => {
                // A chunk was published or evicted here since the GET went ahead, so it asked
                // for other chunks than this batch: drop the stream that carries its answer.
                self.disconnect(p);
                if !self.ready(p, work.deadline) {
                    return Ok(());
                }
                0
            }
            None => 0,
        };
        self.conn(p).set_deadline(work.deadline);
        for (b, batch) in batches.iter().enumerate() {
            if asked == b {
                self.conn(p)
                    .send(&Frame::Get(keys_of(work, batch)), "send GET")?;
                asked += 1;
            }
            if let Some(next) = batches
                .get(asked)
                .filter(|n| asked == b + 1 && n.len() <= AHEAD_KEYS_MAX)
            {
                self.conn(p)
                    .send(&Frame::Get(keys_of(work, next)), "send GET")?;
                asked += 1;
            }
            let last = b + 1 == batches.len();
            let mut received = 0u32;
            // Where in `batch` the next DATA may be: answers come in request order.
            let mut from = 0usize;
            loop {
                if last {
                    self.ask_ahead(p)?;
                }
                let header = self.conn(p).recv_header("receive GET answer")?;
                if header.kind != FrameKind::Data {
                    let end = recv_end(self.conn(p), header)?;
                    if end != received {
                        return Err(Stop::Failed(
                            self.bad(p, format!("END says {end} DATA frames, {received} arrived")),
                        ));
                    }
                    break;
                }
                received += 1;
                self.receive_data(p, work, &batch[from..], header.body_len, done)
                    .map(|at| from += at + 1)?;
                if self.control.stopped(work.id) {
                    return Err(Stop::Cancelled);
                }
            }
        }
        Ok(())
    }

    /// The chunks of `work` not yet `done`, by index, in GET batches.
    fn batches(&self, work: &Work, done: &[bool]) -> Vec<Vec<usize>> {
        let pending: Vec<usize> = (0..work.chunks.len()).filter(|&i| !done[i]).collect();
        pending
            .chunks(self.shared.config.keys_per_request_max)
            .map(<[usize]>::to_vec)
            .collect()
    }

    /// While the last answer of a job streams in from peer `p`: takes the next command from the
    /// queue if there is one (once), and if it is a load job whose first GET would go to `p`,
    /// sends that GET now, so `p` goes on to it without waiting a round trip. Which of its chunks
    /// are left for the peers is predicted from what is published here: its local copies (a
    /// checksum and a copy each) wait for its turn, rather than hold up this job's stream. Not
    /// for a job that NIXL would fetch (that starts with a NIXL_GET), nor for a large first
    /// batch.
    fn ask_ahead(&mut self, p: usize) -> Result<(), P2pError> {
        if self.next.is_some() {
            return Ok(());
        }
        let Ok(command) = self.commands.try_recv() else {
            return Ok(());
        };
        let ahead = match &command {
            ClientCommand::Load(work) => {
                let local: Vec<bool> = work
                    .chunks
                    .iter()
                    .map(|&TierChunk { key, .. }| published(&self.shared, key))
                    .collect();
                self.first_get(p, work, &local)
            }
            ClientCommand::Lookup(_) | ClientCommand::Push(_) => None,
        };
        self.next = Some(command);
        if let Some(ahead) = ahead {
            self.conn(p)
                .send(&Frame::Get(ahead.keys.clone()), "send GET")?;
            self.peers[p].ahead = Some(ahead);
            self.peers[p].used_at = Instant::now();
        }
        Ok(())
    }

    /// The first GET of queued load job `work` (chunks published here: `done`), if it goes to
    /// peer `p` and may be sent ahead.
    fn first_get(&self, p: usize, work: &Work, done: &[bool]) -> Option<Ahead> {
        #[cfg(feature = "nixl")]
        if self.nixl_usable(p, work, done) {
            return None;
        }
        if self.control.stopped(work.id)
            || Instant::now() >= work.deadline
            || self.peer_order(work, done).first() != Some(&p)
        {
            return None;
        }
        let batches = self.batches(work, done);
        let first = batches.first().filter(|b| b.len() <= AHEAD_KEYS_MAX)?;
        Some(Ahead {
            job: work.id,
            keys: keys_of(work, first),
        })
    }

    /// Receives one DATA body (its header read) for one of `rest`'s chunks (the GET's chunks
    /// after the last one answered: answers come in request order, each key at most once): into
    /// the slot, then verified; returns its position in `rest`. A payload of the wrong length is
    /// read and dropped; its chunk stays not done. A DATA for a key not in `rest` (not asked,
    /// already answered, or out of order) is a protocol error of the peer.
    fn receive_data(
        &mut self,
        p: usize,
        work: &Work,
        rest: &[usize],
        body_len: usize,
        done: &mut [bool],
    ) -> Result<usize, Stop> {
        if body_len <= DATA_PREFIX_BYTES {
            return Err(Stop::Failed(
                self.bad(p, format!("DATA body of {body_len} bytes")),
            ));
        }
        let mut prefix = [0u8; DATA_PREFIX_BYTES];
        self.conn(p).read_exact(&mut prefix, "receive DATA")?;
        let (key, tag) = decode_data_prefix(&prefix);
        let payload_len = body_len - DATA_PREFIX_BYTES;
        let Some(at) = rest
            .iter()
            .position(|&i| work.chunks[i].key == key && !done[i])
        else {
            return Err(Stop::Failed(self.bad(
                p,
                format!("DATA for {key:?}, not among the keys still to answer in request order"),
            )));
        };
        let i = rest[at];
        let TierChunk { slot, len, .. } = work.chunks[i];
        let (slot_bytes, slot_count) = (self.memory.slot_bytes(), self.memory.slot_count());
        if len as usize > slot_bytes || slot.0 >= slot_count {
            // Submit checked both: the job's chunk no longer fits its slot. Nothing is written;
            // the payload is read past, and the chunk fails (recompute).
            broken(
                &self.shared,
                format_args!(
                    "p2p client: DATA of {key:?} for {len} bytes into slot {} (slot_count \
                     {slot_count}) of {slot_bytes} bytes",
                    slot.0
                ),
            );
            return self.discard(p, payload_len).map(|()| at);
        }
        if payload_len != len as usize {
            log(format_args!(
                "peer {} sent {key:?} with {payload_len} bytes, expected {len}; not loaded",
                self.peers[p].addr
            ));
            self.corrupt.push(key);
            return self.discard(p, payload_len).map(|()| at);
        }
        let verified = match self.memory.slot_ptr(slot) {
            Some(ptr) => {
                // SAFETY: the job owns `slot` from submit until its completion is polled (the
                // `Tier` contract), so nothing else reads or writes it now; `slot_ptr` points at
                // `slot_bytes` contiguous bytes and `len <= slot_bytes` was checked at submit.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len as usize) };
                receive_hashed(self.conn(p), key, dst)? == tag
            }
            None => {
                let mut scratch = std::mem::take(&mut self.scratch);
                scratch.resize(payload_len, 0);
                let received = receive_hashed(self.conn(p), key, &mut scratch);
                let verified = received.as_ref().is_ok_and(|&h| h == tag);
                if verified {
                    self.memory.write_slot(slot, 0, &scratch);
                }
                self.scratch = scratch;
                received?;
                verified
            }
        };
        if !verified {
            let keyed = self.conn(p).chunk_auth().is_keyed();
            self.shared.counters.tag_failed(keyed);
            log(format_args!(
                "peer {} sent {key:?} with a checksum or MAC mismatch; not loaded",
                self.peers[p].addr
            ));
            self.corrupt.push(key);
            return Ok(at);
        }
        done[i] = true;
        add(&self.shared.counters.chunks_fetched, 1);
        add(&self.shared.counters.bytes_fetched, u64::from(len));
        Ok(at)
    }

    /// Reads and drops `len` payload bytes.
    fn discard(&mut self, p: usize, mut len: usize) -> Result<(), Stop> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut result = Ok(());
        while len > 0 && result.is_ok() {
            let piece = len.min(DISCARD_PIECE_BYTES);
            scratch.resize(piece, 0);
            result = self
                .conn(p)
                .read_exact(&mut scratch, "discard DATA payload");
            len -= piece;
        }
        self.scratch = scratch;
        result.map_err(Stop::Failed)
    }

    /// A protocol violation by peer `p`.
    fn bad(&self, p: usize, reason: String) -> P2pError {
        P2pError::Frame {
            op: "receive GET answer",
            peer: self.peers[p].addr,
            source: FrameError::Malformed {
                kind: FrameKind::Data,
                reason,
            },
        }
    }

    /// Peer `p`'s connection; only called after [`Client::ready`] said it has one.
    fn conn(&mut self, p: usize) -> &mut Conn {
        match self.peers[p].conn.as_mut() {
            Some(conn) => conn,
            None => panic!("p2p client: peer {p} used without a connection (a bug)"),
        }
    }

    /// Whether peer `p` has a handshaken connection, connecting if it is not in backoff. A
    /// connection idle for half of `idle_timeout` is replaced first, since the peer's server
    /// may be about to close it (peers are expected to share `idle_timeout`).
    fn ready(&mut self, p: usize, deadline: Instant) -> bool {
        let now = Instant::now();
        let stale = self.shared.config.idle_timeout / 2;
        if self.peers[p].conn.is_some() && now.duration_since(self.peers[p].used_at) > stale {
            self.disconnect(p);
        }
        let shared = Arc::clone(&self.shared);
        let config = &shared.config;
        let peer = &mut self.peers[p];
        if peer.conn.is_some() {
            peer.used_at = now;
            return true;
        }
        if peer.retry_at.is_some_and(|at| now < at) || now >= deadline {
            return false;
        }
        let connected = connect(&peer.name, config, deadline).and_then(|mut conn| {
            let left = deadline.saturating_duration_since(Instant::now());
            let timeout = config
                .handshake_deadline
                .min(left)
                .max(Duration::from_millis(1));
            handshake::client(&mut conn, &shared.identity, timeout).map(|()| conn)
        });
        match connected {
            Ok(conn) => {
                if let Ok(socket) = conn.socket() {
                    self.control.register(p, socket);
                }
                let peer = &mut self.peers[p];
                peer.addr = conn.peer();
                peer.conn = Some(conn);
                peer.failures = 0;
                peer.retry_at = None;
                peer.used_at = Instant::now();
                self.report(p, None);
                true
            }
            Err(error) => {
                self.fail(p, &error);
                false
            }
        }
    }

    /// Drops peer `p`'s connection without counting a failure.
    fn disconnect(&mut self, p: usize) {
        self.close(p);
        self.report(p, None);
    }

    /// Closes peer `p`'s connection, if any, with everything that belongs to it (NIXL state, a
    /// GET sent ahead).
    fn close(&mut self, p: usize) {
        #[cfg(feature = "nixl")]
        self.forget_nixl(p);
        self.peers[p].ahead = None;
        if let Some(conn) = self.peers[p].conn.take() {
            conn.shutdown();
            self.control.unregister(p);
        }
    }

    /// Marks peer `p` down after `error`, until its backoff has passed.
    fn fail(&mut self, p: usize, error: &P2pError) {
        self.close(p);
        let config = &self.shared.config;
        let peer = &mut self.peers[p];
        peer.failures = peer.failures.saturating_add(1);
        let doublings = peer.failures.saturating_sub(1).min(20);
        let backoff = config
            .backoff_initial
            .saturating_mul(1 << doublings)
            .min(config.backoff_max);
        peer.retry_at = Some(Instant::now() + backoff);
        add(&self.shared.counters.peer_failures, 1);
        if matches!(error, P2pError::Refused { .. }) {
            add(&self.shared.counters.handshakes_refused, 1);
        }
        log(format_args!(
            "peer {} marked down ({} consecutive failures, retry in {backoff:?}): {error}",
            peer.name, peer.failures
        ));
        self.report(p, Some(error.to_string()));
    }

    /// Publishes peer `p`'s state.
    fn report(&self, p: usize, error: Option<String>) {
        let peer = &self.peers[p];
        let mut status = lock(&self.status);
        if let Some(Some(entry)) = status.get_mut(p) {
            entry.connected = peer.conn.is_some();
            if peer.conn.is_some() {
                entry.addr = Some(peer.addr);
            }
            entry.consecutive_failures = peer.failures;
            if error.is_some() {
                entry.last_error = error;
            }
        }
    }
}

impl Peer {
    /// A new member `name`, not connected.
    fn new(name: PeerAddr) -> Self {
        Self {
            id: member_id(&name),
            addr: SocketAddr::from(([0, 0, 0, 0], name.port())),
            name,
            member: true,
            conn: None,
            ahead: None,
            failures: 0,
            retry_at: None,
            used_at: Instant::now(),
            #[cfg(feature = "nixl")]
            nixl: nixl_fetch::PeerNixl::default(),
        }
    }
}

/// Resolves `name` (now: a moved peer is found again) and connects to the first of its
/// addresses that accepts, each try within `connect_deadline` and all before `deadline`.
fn connect(name: &PeerAddr, config: &P2pConfig, deadline: Instant) -> Result<Conn, P2pError> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let addrs = name
        .resolve(config.connect_deadline.min(left()))
        .map_err(|source| P2pError::Resolve {
            peer: name.to_string(),
            source,
        })?;
    let mut last = None;
    for addr in addrs {
        let timeout = config.connect_deadline.min(left());
        if timeout.is_zero() {
            break;
        }
        match Conn::connect(addr, timeout, config.frame_body_bytes_max) {
            Ok(conn) => return Ok(conn),
            Err(error) => last = Some(error),
        }
    }
    Err(last.unwrap_or_else(|| P2pError::Resolve {
        peer: name.to_string(),
        source: std::io::Error::new(std::io::ErrorKind::TimedOut, "no time left to connect"),
    }))
}

/// Receives an END frame (a PUT's answer) and returns its count.
fn recv_end_frame(conn: &mut Conn, op: &'static str) -> Result<u32, P2pError> {
    let header = conn.recv_header(op)?;
    recv_end(conn, header)
}

/// Receives a HAVE_REPLY of `count` flags.
fn recv_have_reply(conn: &mut Conn, count: usize) -> Result<Vec<bool>, P2pError> {
    let peer = conn.peer();
    let op = "receive HAVE reply";
    match conn.recv(op)? {
        Frame::HaveReply(held) if held.len() == count => Ok(held),
        Frame::HaveReply(held) => Err(P2pError::Frame {
            op,
            peer,
            source: FrameError::Malformed {
                kind: FrameKind::HaveReply,
                reason: format!("{} flags for {count} keys", held.len()),
            },
        }),
        Frame::Error(message) => Err(P2pError::Remote { op, peer, message }),
        other => Err(P2pError::Frame {
            op,
            peer,
            source: FrameError::Unexpected {
                expected: "HAVE_REPLY",
                found: other.kind(),
            },
        }),
    }
}

/// Receives the body of a non-DATA frame in a GET answer: END's count, or the error it is.
fn recv_end(conn: &mut Conn, header: crate::frame::FrameHeader) -> Result<u32, P2pError> {
    let peer = conn.peer();
    let op = "receive GET answer";
    match conn.recv_body(header, op)? {
        Frame::End { sent } => Ok(sent),
        Frame::Error(message) => Err(P2pError::Remote { op, peer, message }),
        other => Err(P2pError::Frame {
            op,
            peer,
            source: FrameError::Unexpected {
                expected: "DATA or END",
                found: other.kind(),
            },
        }),
    }
}

/// Fills `dst` from the stream piece by piece, hashing each piece while it is still in cache;
/// returns the tag of all of `dst` as DATA for `key` on this connection (the xxh3-64 of it, or
/// with a secret the keyed BLAKE3 under the session key: [`crate::auth::ChunkAuth`]).
fn receive_hashed(conn: &mut Conn, key: ChunkKey, dst: &mut [u8]) -> Result<u64, P2pError> {
    let mut hasher = conn.chunk_auth().hasher(FrameKind::Data, key);
    for piece in dst.chunks_mut(HASH_PIECE_BYTES) {
        conn.read_exact(piece, "receive DATA payload")?;
        hasher.update(piece);
    }
    Ok(hasher.finish())
}

/// The keys of the chunks of `work` at `indexes`.
fn keys_of(work: &Work, indexes: &[usize]) -> Vec<ChunkKey> {
    indexes.iter().map(|&i| work.chunks[i].key).collect()
}
