//! [`P2pTier`]: the peer tier behind the [`Tier`] trait. It owns the server, the local worker
//! (publishing and local loads), the client worker (peer lookups and fetches), the lookup table
//! and the ledger of accepted jobs; `lookup`, `submit` and `poll` only touch channels and tables,
//! never a socket.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use offload_core::event::Medium;
use offload_core::tier::{
    SlotMemory, SubmitError, Tier, TierChunk, TierCompletion, TierFailure, TierJob, TierLookup,
    TierOp,
};
use offload_core::{Booked, ChunkKey, JobBook, JobId, RequestId};

use crate::client::{Client, ClientCommand, LookupAnswer};
use crate::config::P2pConfig;
use crate::directory::{DnsPeers, PeerDirectory, StaticPeers};
use crate::error::P2pError;
use crate::handshake::Identity;
use crate::lookup::{Found, LookupTable};
use crate::server::Server;
use crate::shared::{lock, log, spawn, Shared};
use crate::stats::{add, Counters, P2pStats, PeerStatus};
use crate::store::PublishedStore;
use crate::worker::{published, run_local, Control, LocalCommand, Work};

/// How long `drain` waits for a completion before it checks that the workers are alive.
const DRAIN_CHECK: Duration = Duration::from_millis(100);
/// Lookup batches that may wait for the client worker.
const LOOKUP_BATCHES_MAX: usize = 64;
/// Push commands (one per store job) that may wait for the client worker; more are not pushed.
const PUSH_BATCHES_MAX: usize = 64;

/// Which worker runs a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Local,
    Client,
}

/// The etcd directory that `config` names (checked by `validate`).
#[cfg(feature = "etcd")]
fn etcd_directory(config: &P2pConfig) -> Result<Box<dyn PeerDirectory>, P2pError> {
    let mut etcd = crate::etcd::EtcdPeersConfig::new(
        config.etcd_endpoints.clone(),
        config.etcd_prefix.clone(),
        Some(config.etcd_member()?),
    );
    etcd.lease_ttl = config.etcd_lease_ttl;
    etcd.call_deadline = config.connect_deadline.max(Duration::from_secs(1));
    Ok(Box::new(crate::etcd::EtcdPeers::start(etcd)?))
}

/// Without the feature `validate` refuses `etcd_endpoints`, so this is never reached.
#[cfg(not(feature = "etcd"))]
fn etcd_directory(_: &P2pConfig) -> Result<Box<dyn PeerDirectory>, P2pError> {
    Err(P2pError::Config {
        field: "etcd_endpoints",
        reason: "this build has no etcd directory (tier-p2p's `etcd` feature)".to_owned(),
    })
}

/// What the tier keeps about an accepted job not yet completed (its keys are in the book).
#[derive(Debug)]
struct Held {
    op: TierOp,
    route: Route,
}

/// A worker thread and the sending end of its queue.
struct Worker<C> {
    commands: Option<Sender<C>>,
    thread: Option<JoinHandle<()>>,
}

impl<C> Worker<C> {
    /// Closes the queue and joins the thread.
    fn stop(&mut self, name: &str) {
        self.commands = None;
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                log(format_args!("{name} worker panicked"));
            }
        }
    }

    fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

/// The peer tier: serves this instance's published chunks to peers and loads chunks that peers
/// published.
///
/// * `Store` (a cascade from the host pool) **publishes**: each slot is copied into the tier's
///   own bounded store (LRU, `published_bytes_max`), with its xxh3 checksum, and served from
///   there. Not from the slots: the host pool reuses a slot once its chunk is evicted, without
///   telling secondary tiers, so serving slots in place could send a peer another chunk's bytes.
///   After a successful store, the chunks are also pushed to their keys' owners among the
///   peers (best effort, off the job's path), so that lookups that ask only owners find them.
/// * `lookup` answers `Hit` at once for a key published here; otherwise it asks the key's
///   owners among the current members (at most `owners` peers; one HAVE per owner per `poll`),
///   answering `Retry` until they reply, then `Hit` or `Miss`, and `Miss` after
///   `lookup_deadline`. Answers are reused for `lookup_cache_ttl`.
/// * `Load` copies chunks published here, and fetches the others from peers (one GET per peer
///   for all the job's missing chunks, the peer a lookup named first) straight into the slots,
///   verifying each checksum. The job fails the keys not loaded by `fetch_deadline` after
///   submission.
///
/// Dropping the tier shuts it down.
pub struct P2pTier {
    shared: Arc<Shared>,
    control: Arc<Control>,
    slot_count: u32,
    slot_bytes: usize,
    server: Server,
    local: Worker<LocalCommand>,
    client: Worker<ClientCommand>,
    done: Receiver<TierCompletion>,
    answers: Receiver<LookupAnswer>,
    held: JobBook<Held>,
    ready: Vec<TierCompletion>,
    lookups: LookupTable,
    status: Arc<Mutex<Vec<Option<PeerStatus>>>>,
    /// No directory could ever name a peer (an empty static list): every lookup misses at once.
    no_peers: bool,
    /// The directory is the static list, so the member count the client reported at start is
    /// exact (a push that it says is not needed is not queued).
    static_members: bool,
    shut_down: bool,
}

impl P2pTier {
    /// Checks `config`, binds the server and starts the worker threads, with the directory the
    /// config names: [`DnsPeers`] of `peers_dns`, else [`StaticPeers`] of `peers`.
    pub fn new(config: P2pConfig, memory: Arc<dyn SlotMemory>) -> Result<Self, P2pError> {
        config.validate(memory.slot_bytes())?;
        let etcd = !config.etcd_endpoints.is_empty();
        let no_peers = config.peers.is_empty() && config.peers_dns.is_none() && !etcd;
        let directory: Box<dyn PeerDirectory> = match &config.peers_dns {
            _ if etcd => etcd_directory(&config)?,
            Some(name) => Box::new(DnsPeers::start(
                name.clone(),
                config.dns_refresh,
                config.connect_deadline,
            )?),
            None => Box::new(StaticPeers::new(config.peers.clone())),
        };
        let static_members = config.peers_dns.is_none() && !etcd;
        Self::start(config, memory, directory, no_peers, static_members)
    }

    /// As [`P2pTier::new`], with the members given by `directory` (`peers`, `peers_dns` and
    /// `etcd_endpoints` must be unset).
    pub fn with_directory(
        config: P2pConfig,
        memory: Arc<dyn SlotMemory>,
        directory: Box<dyn PeerDirectory>,
    ) -> Result<Self, P2pError> {
        config.validate(memory.slot_bytes())?;
        if !config.peers.is_empty()
            || config.peers_dns.is_some()
            || !config.etcd_endpoints.is_empty()
        {
            return Err(P2pError::Config {
                field: "peers",
                reason: "set together with a directory; pick one".to_owned(),
            });
        }
        Self::start(config, memory, directory, false, false)
    }

    fn start(
        config: P2pConfig,
        memory: Arc<dyn SlotMemory>,
        directory: Box<dyn PeerDirectory>,
        no_peers: bool,
        static_members: bool,
    ) -> Result<Self, P2pError> {
        let slot_bytes = memory.slot_bytes();
        let shared = Arc::new(Shared {
            identity: Identity::new(config.namespace.as_bytes().to_vec(), config.secret.clone()),
            store: Mutex::new(PublishedStore::new(config.published_bytes_max)),
            counters: Counters::default(),
            strict: std::sync::atomic::AtomicBool::new(offload_core::invariant::STRICT_DEFAULT),
            #[cfg(feature = "nixl")]
            nixl: crate::nixl::LazyPlane::new(config.nixl),
            config,
        });
        let config = &shared.config;
        let server = Server::start(Arc::clone(&shared))?;
        let port = server.addr().port();
        let control = Arc::new(Control::default());
        let status = Arc::new(Mutex::new(Vec::new()));
        let mut self_names = vec![server.addr().into()];
        self_names.extend(config.advertise.clone());
        // Every completion belongs to an accepted job, of which there are at most
        // `jobs_in_flight_max`; every answer to a queued lookup batch.
        let (done_tx, done) = unbounded();
        let (answers_tx, answers) = unbounded();
        let (local_tx, local_rx) = bounded(config.jobs_in_flight_max);
        let (client_tx, client_rx) =
            bounded(config.jobs_in_flight_max + LOOKUP_BATCHES_MAX + PUSH_BATCHES_MAX);
        let local_thread = {
            let (shared, memory, control) = (
                Arc::clone(&shared),
                Arc::clone(&memory),
                Arc::clone(&control),
            );
            let done_tx = done_tx.clone();
            spawn(format!("p2p-local-{port}"), move || {
                run_local(&shared, &*memory, &control, &local_rx, &done_tx);
            })?
        };
        let client = Client::new(
            Arc::clone(&shared),
            Arc::clone(&memory),
            Arc::clone(&control),
            directory,
            self_names,
            Arc::clone(&status),
            client_rx,
        );
        let client_thread = spawn(format!("p2p-client-{port}"), move || {
            client.run(&done_tx, &answers_tx);
        });
        let client_thread = match client_thread {
            Ok(thread) => thread,
            Err(error) => {
                drop(local_tx);
                let _ = local_thread.join();
                return Err(error);
            }
        };
        let lookups = LookupTable::new(
            config.lookup_deadline,
            config.lookup_cache_ttl,
            config.lookup_entries_max,
        );
        Ok(Self {
            control,
            slot_count: memory.slot_count(),
            slot_bytes,
            server,
            local: Worker {
                commands: Some(local_tx),
                thread: Some(local_thread),
            },
            client: Worker {
                commands: Some(client_tx),
                thread: Some(client_thread),
            },
            done,
            answers,
            held: JobBook::new(config.jobs_in_flight_max),
            ready: Vec::new(),
            lookups,
            status,
            no_peers,
            static_members,
            shut_down: false,
            shared,
        })
    }

    /// The address this instance serves on (with the port chosen when `listen` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &P2pConfig {
        &self.shared.config
    }

    /// Test seam: whether a broken invariant panics (default
    /// [`offload_core::invariant::STRICT_DEFAULT`], on in debug builds) or is counted in
    /// [`P2pStats::invariant_failures`] and fails its chunk.
    #[doc(hidden)]
    pub fn set_strict_invariants(&self, strict: bool) {
        self.shared
            .strict
            .store(strict, std::sync::atomic::Ordering::Relaxed);
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> P2pStats {
        let store = lock(&self.shared.store);
        self.shared
            .counters
            .snapshot(store.len() as u64, store.bytes() as u64)
    }

    /// Each current member's connection state (as of the client worker's last look at the
    /// directory), in slot order (the configured order, for a static list that never changed).
    pub fn peer_status(&self) -> Vec<PeerStatus> {
        lock(&self.status).iter().flatten().cloned().collect()
    }

    /// Whether `key` is published here (servable to peers now).
    pub fn is_published(&self, key: ChunkKey) -> bool {
        published(&self.shared, key)
    }

    /// Moves answers from the client worker into the lookup table.
    fn take_answers(&mut self) {
        let now = Instant::now();
        while let Ok(answer) = self.answers.try_recv() {
            self.lookups.record(&answer.keys, &answer.holders, now);
        }
    }

    /// Sends the queued lookup keys to the client worker as one batch.
    fn flush_lookups(&mut self) {
        let keys = self.lookups.take_queued();
        if keys.is_empty() {
            return;
        }
        let Some(commands) = &self.client.commands else {
            return;
        };
        match commands.try_send(ClientCommand::Lookup(keys)) {
            Ok(()) => {}
            // They stay pending and become misses at their deadline.
            Err(TrySendError::Full(ClientCommand::Lookup(keys)))
            | Err(TrySendError::Disconnected(ClientCommand::Lookup(keys))) => {
                self.lookups.requeue(keys)
            }
            Err(_) => {}
        }
    }

    /// Records a completion from a worker.
    fn complete(&mut self, completion: TierCompletion) {
        match self.held.complete(&completion) {
            Ok(held) => self.finish(completion, held),
            Err(e) => crate::shared::broken(&self.shared, format_args!("p2p tier: {e}")),
        }
    }

    /// Hands out the completion of a job taken out of the book.
    fn finish(&mut self, completion: TierCompletion, held: Booked<Held>) {
        self.control.forget(completion.id);
        if held.value.op == TierOp::Store {
            let failed: Vec<ChunkKey> = completion.failed_keys().collect();
            let mut published = held.keys;
            published.retain(|k| !failed.contains(k));
            // The manager emits `Stored` for these once this completion is handed out; from
            // then on their eviction is reported (`take_evicted`).
            lock(&self.shared.store).announce(&published);
            self.push(published, &[]);
        }
        if held.value.op == TierOp::Load {
            add(
                &self.shared.counters.load_keys_failed,
                completion.failed.len() as u64,
            );
            for key in completion.failed_keys() {
                self.lookups.forget(key);
            }
        }
        self.ready.push(completion);
    }

    /// Queues a push of the chunks just published (`keys` less `failed`) to their owners; when
    /// the client's queue is full they are not pushed (counted as push failures).
    fn push(&self, mut keys: Vec<ChunkKey>, failed: &[ChunkKey]) {
        keys.retain(|k| !failed.contains(k));
        if keys.is_empty()
            || self.no_peers
            || self.control.shutting_down()
            || (self.static_members && !self.control.push_needed(self.shared.config.owners))
        {
            return;
        }
        let Some(commands) = &self.client.commands else {
            return;
        };
        let count = keys.len() as u64;
        if !self.control.start_push(PUSH_BATCHES_MAX) {
            add(&self.shared.counters.push_failures, count);
            return;
        }
        if commands.try_send(ClientCommand::Push(keys)).is_err() {
            self.control.end_push();
            add(&self.shared.counters.push_failures, count);
        }
    }

    /// Takes every completion the workers queued.
    fn collect(&mut self) {
        while let Ok(completion) = self.done.try_recv() {
            self.complete(completion);
        }
    }

    /// Fails the jobs of a worker that is gone (after collecting what it sent before it went).
    fn fail_orphans(&mut self) {
        let local_gone = self.local.is_finished();
        let client_gone = self.client.is_finished();
        if !local_gone && !client_gone {
            return;
        }
        self.collect();
        let control = &self.control;
        let orphans = self
            .held
            .fail_where(TierFailure::TierDown, |id, h| match h.value.route {
                Route::Local => local_gone,
                // A quarantined job's slots stay its own (see `drain`).
                Route::Client => client_gone && !control.quarantined(id),
            });
        for (completion, held) in orphans {
            log(format_args!(
                "job {}: its worker is gone; failing it",
                completion.id.0
            ));
            self.finish(completion, held);
        }
    }

    /// Why `job` is malformed, if it is.
    fn invalid(&self, job: &TierJob) -> Option<String> {
        if self.held.contains(job.id) {
            return Some(format!("duplicate in-flight job id {}", job.id.0));
        }
        let mut keys = HashSet::new();
        let mut slots = HashSet::new();
        for &TierChunk { key, slot, len } in &job.chunks {
            if slot.0 >= self.slot_count {
                return Some(format!(
                    "slot {} out of range ({} slots)",
                    slot.0, self.slot_count
                ));
            }
            if len == 0 || len as usize > self.slot_bytes {
                return Some(format!(
                    "chunk {key:?} has length {len}, outside 1..={}",
                    self.slot_bytes
                ));
            }
            if !keys.insert(key) {
                return Some(format!("key {key:?} named twice"));
            }
            if job.op == TierOp::Load && !slots.insert(slot) {
                return Some(format!("load writes slot {} twice", slot.0));
            }
        }
        None
    }

    /// Hands an accepted job to its worker; gives it back if the queue refuses it.
    fn dispatch(&mut self, job: TierJob) -> Result<Route, SubmitError> {
        let deadline = Instant::now() + self.shared.config.fetch_deadline;
        let hints = job
            .chunks
            .iter()
            .map(|c| self.lookups.holder(c.key))
            .collect();
        let work = Work {
            id: job.id,
            chunks: job.chunks,
            deadline,
            hints,
        };
        let all_local = work.chunks.iter().all(|c| published(&self.shared, c.key));
        let in_flight = self.held.len();
        let refused = |full: bool| {
            if full {
                SubmitError::Busy { in_flight }
            } else {
                log("a worker is gone; refusing submissions");
                SubmitError::ShutDown
            }
        };
        if job.op == TierOp::Load && !all_local {
            let sender = self.client.commands.as_ref().ok_or(SubmitError::ShutDown)?;
            let command = ClientCommand::Load(work);
            sender.try_send(command).map_err(|e| refused(e.is_full()))?;
            return Ok(Route::Client);
        }
        let command = match job.op {
            TierOp::Store => LocalCommand::Store(work),
            TierOp::Load => LocalCommand::Load(work),
        };
        let sender = self.local.commands.as_ref().ok_or(SubmitError::ShutDown)?;
        sender.try_send(command).map_err(|e| refused(e.is_full()))?;
        Ok(Route::Local)
    }
}

impl Tier for P2pTier {
    fn name(&self) -> &str {
        "p2p"
    }

    fn medium(&self) -> Medium {
        Medium::Peer
    }

    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        if published(&self.shared, key) {
            return TierLookup::Hit;
        }
        if self.no_peers || self.shut_down {
            return TierLookup::Miss;
        }
        self.take_answers();
        let counters = &self.shared.counters;
        match self.lookups.lookup(key, Instant::now()) {
            Found::Hit => {
                add(&counters.lookup_hits, 1);
                TierLookup::Hit
            }
            Found::Miss | Found::Full => {
                add(&counters.lookup_misses, 1);
                TierLookup::Miss
            }
            Found::TimedOut => {
                add(&counters.lookup_timeouts, 1);
                TierLookup::Miss
            }
            Found::Retry => {
                if self.lookups.queued_len() >= self.shared.config.keys_per_request_max {
                    self.flush_lookups();
                }
                TierLookup::Retry
            }
        }
    }

    fn touch(&mut self, keys: &[ChunkKey]) {
        lock(&self.shared.store).touch(keys);
    }

    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        if self.shut_down {
            return Err(SubmitError::ShutDown);
        }
        if let Some(reason) = self.invalid(&job) {
            return Err(SubmitError::Invalid(reason));
        }
        self.held.check(&job)?;
        if job.chunks.is_empty() {
            self.ready.push(TierCompletion::success(job.id));
            return Ok(());
        }
        let (id, op) = (job.id, job.op);
        let keys = job.chunks.iter().map(|c| c.key).collect();
        let route = self.dispatch(job)?;
        // `check` passed and nothing was booked since: this cannot refuse.
        self.held.insert_keys(id, keys, Held { op, route })
    }

    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        self.take_answers();
        self.flush_lookups();
        self.collect();
        self.fail_orphans();
        out.append(&mut self.ready);
    }

    fn cancel(&mut self, id: JobId) {
        if self.held.cancel(id) {
            self.control.cancel(id);
        }
    }

    fn drain(&mut self) {
        // A quarantined job (its NIXL READ stuck) completes only when NIXL ends the READ: not
        // waited for.
        while self
            .held
            .iter()
            .any(|(id, _)| !self.control.quarantined(id))
        {
            match self.done.recv_timeout(DRAIN_CHECK) {
                Ok(completion) => self.complete(completion),
                Err(RecvTimeoutError::Timeout) => self.fail_orphans(),
                Err(RecvTimeoutError::Disconnected) => {
                    // Both workers are gone (their threads finished): fail what is left.
                    self.fail_orphans();
                    if !self.held.is_empty() {
                        log("workers gone with jobs in flight; failing them");
                        let control = &self.control;
                        let orphans = self
                            .held
                            .fail_where(TierFailure::TierDown, |id, _| !control.quarantined(id));
                        for (completion, held) in orphans {
                            self.finish(completion, held);
                        }
                    }
                }
            }
        }
    }

    /// The announced chunks (each a `Stored` event of this tier) that left the published store
    /// since the last call: evicted to stay under `published_bytes_max` (by a publish or a
    /// peer's push), or removed as corrupt. At most 65,536 wait; the oldest beyond are dropped
    /// and counted in the return value.
    fn take_evicted(&mut self, out: &mut Vec<ChunkKey>) -> u64 {
        lock(&self.shared.store).take_removed(out)
    }

    fn on_request_finished(&mut self, _request: RequestId) {
        // Published chunks are content-addressed and shared by every request: nothing to drop.
    }

    fn shutdown(&mut self) {
        if self.shut_down {
            return;
        }
        self.control.shut_down();
        self.drain();
        self.local.stop("local");
        self.client.stop("client");
        self.collect();
        self.server.stop();
        self.shut_down = true;
    }
}

impl Drop for P2pTier {
    fn drop(&mut self) {
        self.shutdown();
    }
}
