//! The etcd peer directory (Cargo feature `etcd`): [`EtcdPeers`]. Each instance registers its
//! address under a key prefix with a lease it keeps alive, and watches the prefix; the member
//! set is what the prefix holds. An instance that stops revokes its lease (it leaves at once);
//! one that dies leaves when its lease expires. A lost etcd keeps the last known members (and is
//! logged); the directory reconnects, registers again and reads the prefix afresh.
//!
//! All etcd work happens on the directory's own thread (a single-threaded tokio runtime), so
//! [`PeerDirectory::members`] answers at once from what it last saw.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, KeyValue, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, WatchOptions, WatchStream,
};
use tokio::sync::watch;

use crate::directory::PeerDirectory;
use crate::error::P2pError;
use crate::peer::PeerAddr;
use crate::shared::{lock, log, spawn};

/// Most members kept from the prefix; more keys are ignored (and logged).
const KEYS_MAX: usize = 4096;

/// Where the directory lives in etcd and how it keeps its registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdPeersConfig {
    /// etcd client URLs, like `http://10.0.0.5:2379`.
    pub endpoints: Vec<String>,
    /// The key prefix of this cluster's members, like `/kvtier/p2p/cluster-a/members/`. Each
    /// member is the key `prefix + address`, with the address as its value.
    pub prefix: String,
    /// This instance's address as peers should reach it (registered), or `None` to only watch.
    pub member: Option<PeerAddr>,
    /// The lease's time to live: a member that dies leaves this long after its last keep-alive
    /// (whole seconds, at least 1; etcd may raise it to its own minimum). Keep-alives go every
    /// third of it.
    pub lease_ttl: Duration,
    /// Deadline of each etcd call (connect, grant, put, get, watch, revoke), and how long
    /// keep-alives may go unanswered beyond the lease's time to live before etcd counts as lost.
    pub call_deadline: Duration,
    /// The pause after etcd was lost before the directory reconnects.
    pub retry_after: Duration,
}

impl EtcdPeersConfig {
    /// A config with the defaults: lease 10 s, calls 5 s, retry after 1 s.
    pub fn new(endpoints: Vec<String>, prefix: String, member: Option<PeerAddr>) -> Self {
        Self {
            endpoints,
            prefix,
            member,
            lease_ttl: Duration::from_secs(10),
            call_deadline: Duration::from_secs(5),
            retry_after: Duration::from_secs(1),
        }
    }

    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<(), P2pError> {
        let bad = |field: &'static str, reason: &str| {
            Err(P2pError::Config {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.endpoints.is_empty() {
            return bad(
                "etcd_endpoints",
                "is empty; name at least one etcd client URL",
            );
        }
        if let Some(e) = self.endpoints.iter().find(|e| !e.contains(':')) {
            return bad(
                "etcd_endpoints",
                &format!("{e:?} is not a URL or host:port of an etcd client endpoint"),
            );
        }
        if self.prefix.is_empty() {
            return bad(
                "etcd_prefix",
                "is empty; every cluster needs its own prefix",
            );
        }
        if self.lease_ttl < Duration::from_secs(1) {
            return bad("etcd_lease_ttl", "must be at least 1 s");
        }
        if self.call_deadline.is_zero() {
            return bad("etcd_call_deadline", "must be more than 0");
        }
        if self.retry_after.is_zero() {
            return bad("etcd_retry_after", "must be more than 0");
        }
        Ok(())
    }

    /// The lease TTL in whole seconds (rounded up).
    fn ttl_secs(&self) -> i64 {
        let secs = self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0);
        i64::try_from(secs).unwrap_or(i64::MAX)
    }
}

/// What the directory's thread shares with its owner.
#[derive(Debug, Default)]
struct Seen {
    /// The members by etcd key.
    members: Mutex<BTreeMap<Vec<u8>, PeerAddr>>,
    /// Sessions with etcd that ended in a failure (etcd lost).
    sessions_lost: AtomicU64,
    /// Sessions that registered and read the prefix.
    sessions_started: AtomicU64,
}

/// The members registered under an etcd prefix, kept current by a watch on the directory's
/// own thread. Dropping it revokes this instance's lease (it leaves at once) and ends the thread.
pub struct EtcdPeers {
    seen: Arc<Seen>,
    stop: Option<watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for EtcdPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdPeers")
            .field("members", &self.members())
            .finish_non_exhaustive()
    }
}

impl EtcdPeers {
    /// Checks `config` and starts the directory's thread, which connects, registers
    /// `config.member` (if any) and watches the prefix. Returns at once: until the first read of
    /// the prefix the member set is empty, and an unreachable etcd is retried (and logged), not
    /// an error.
    pub fn start(config: EtcdPeersConfig) -> Result<Self, P2pError> {
        config.validate()?;
        let seen = Arc::new(Seen::default());
        let (stop, stopped) = watch::channel(false);
        let thread = {
            let seen = Arc::clone(&seen);
            spawn("p2p-etcd".to_owned(), move || run(&config, &seen, stopped))?
        };
        Ok(Self {
            seen,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Sessions with etcd that were lost (etcd unreachable, a stream closed, the lease gone).
    pub fn sessions_lost(&self) -> u64 {
        self.seen.sessions_lost.load(Ordering::SeqCst)
    }

    /// Sessions that registered (if a member) and read the prefix: 1 after the first
    /// connection, one more after each reconnection.
    pub fn sessions_started(&self) -> u64 {
        self.seen.sessions_started.load(Ordering::SeqCst)
    }
}

impl PeerDirectory for EtcdPeers {
    fn members(&self) -> Vec<PeerAddr> {
        let mut members: Vec<PeerAddr> = lock(&self.seen.members).values().cloned().collect();
        members.sort();
        members.dedup();
        members
    }
}

impl Drop for EtcdPeers {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            // The thread may be gone already.
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                log("etcd peer directory thread panicked");
            }
        }
    }
}

/// The directory's thread: sessions with etcd until stopped, a pause between them.
fn run(config: &EtcdPeersConfig, seen: &Seen, mut stop: watch::Receiver<bool>) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            log(format_args!(
                "etcd peer directory: cannot start its runtime ({e}); no members from etcd"
            ));
            return;
        }
    };
    runtime.block_on(async {
        loop {
            match session(config, seen, &mut stop).await {
                Ok(()) => return,
                Err(reason) => {
                    seen.sessions_lost.fetch_add(1, Ordering::SeqCst);
                    log(format_args!(
                        "etcd peer directory: etcd {:?} lost ({reason}); keeping the last {} \
                         members, retrying in {:?}",
                        config.endpoints,
                        lock(&seen.members).len(),
                        config.retry_after
                    ));
                }
            }
            tokio::select! {
                () = tokio::time::sleep(config.retry_after) => {}
                _ = stop.changed() => return,
            }
        }
    });
}

/// Runs `future` within `deadline`; the error names `what`.
async fn within<T, E: std::fmt::Display>(
    deadline: Duration,
    what: &str,
    future: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(deadline, future).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {deadline:?}")),
    }
}

/// This instance's registration: its lease and what keeps it alive.
struct Lease {
    id: i64,
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
    /// When etcd last confirmed the lease.
    confirmed: Instant,
}

/// One session: connect, register, read the prefix, then follow the watch and keep the lease
/// alive until stopped (`Ok`, the lease revoked) or etcd is lost (`Err`, why).
async fn session(
    config: &EtcdPeersConfig,
    seen: &Seen,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), String> {
    let deadline = config.call_deadline;
    let options = ConnectOptions::new()
        .with_connect_timeout(deadline)
        .with_timeout(deadline)
        .with_keep_alive(deadline, deadline);
    let mut client = within(
        deadline,
        "connect",
        Client::connect(config.endpoints.clone(), Some(options)),
    )
    .await?;
    let mut lease = match &config.member {
        Some(member) => Some(register(&mut client, config, member).await?),
        None => None,
    };
    let prefix = config.prefix.as_bytes().to_vec();
    let got = within(
        deadline,
        "read the prefix",
        client.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = got.header().map_or(0, |h| h.revision());
    {
        let mut members = lock(&seen.members);
        members.clear();
        for kv in got.kvs() {
            insert(&mut members, config, kv);
        }
    }
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut events: WatchStream = within(
        deadline,
        "watch the prefix",
        client.watch(prefix, Some(options)),
    )
    .await?;
    seen.sessions_started.fetch_add(1, Ordering::SeqCst);
    let ttl = config.lease_ttl;
    let mut tick = tokio::time::interval((ttl / 3).max(Duration::from_millis(100)));
    loop {
        tokio::select! {
            _ = stop.changed() => {
                if let Some(lease) = &lease {
                    // Best effort: if etcd does not answer, the lease expires by itself.
                    if let Err(reason) =
                        within(deadline, "revoke the lease", client.lease_revoke(lease.id)).await
                    {
                        log(format_args!("etcd peer directory: {reason}"));
                    }
                }
                return Ok(());
            }
            message = events.message() => match message {
                Ok(Some(response)) => {
                    if response.canceled() {
                        return Err(format!("watch cancelled: {}", response.cancel_reason()));
                    }
                    let mut members = lock(&seen.members);
                    for event in response.events() {
                        let Some(kv) = event.kv() else { continue };
                        match event.event_type() {
                            EventType::Put => insert(&mut members, config, kv),
                            EventType::Delete => {
                                members.remove(kv.key());
                            }
                        }
                    }
                }
                Ok(None) => return Err("watch stream closed".to_owned()),
                Err(e) => return Err(format!("watch: {e}")),
            },
            answer = next_answer(&mut lease) => {
                match answer {
                    Ok(Some(response)) if response.ttl() > 0 => {
                        if let Some(lease) = &mut lease {
                            lease.confirmed = Instant::now();
                        }
                    }
                    Ok(Some(_)) => return Err("the lease expired".to_owned()),
                    Ok(None) => return Err("keep-alive stream closed".to_owned()),
                    Err(e) => return Err(format!("keep-alive: {e}")),
                }
            }
            _ = tick.tick() => {
                if let Some(lease) = &mut lease {
                    if lease.confirmed.elapsed() > ttl + deadline {
                        return Err(format!(
                            "no keep-alive answer for {:?}",
                            lease.confirmed.elapsed()
                        ));
                    }
                    within(deadline, "keep-alive", lease.keeper.keep_alive()).await?;
                }
            }
        }
    }
}

/// The next keep-alive answer; never resolves without a lease.
async fn next_answer(
    lease: &mut Option<Lease>,
) -> Result<Option<etcd_client::LeaseKeepAliveResponse>, etcd_client::Error> {
    match lease {
        Some(lease) => lease.answers.message().await,
        None => std::future::pending().await,
    }
}

/// Grants a lease, puts `prefix + member` under it and starts its keep-alive stream.
async fn register(
    client: &mut Client,
    config: &EtcdPeersConfig,
    member: &PeerAddr,
) -> Result<Lease, String> {
    let deadline = config.call_deadline;
    let grant = within(
        deadline,
        "grant a lease",
        client.lease_grant(config.ttl_secs(), None),
    )
    .await?;
    let id = grant.id();
    let key = format!("{}{member}", config.prefix);
    within(
        deadline,
        "register",
        client.put(
            key,
            member.to_string(),
            Some(PutOptions::new().with_lease(id)),
        ),
    )
    .await?;
    let (keeper, answers) =
        within(deadline, "start keep-alives", client.lease_keep_alive(id)).await?;
    Ok(Lease {
        id,
        keeper,
        answers,
        confirmed: Instant::now(),
    })
}

/// Adds the member that `kv` registers; a value that is not an address is logged and skipped.
fn insert(members: &mut BTreeMap<Vec<u8>, PeerAddr>, config: &EtcdPeersConfig, kv: &KeyValue) {
    let parsed = std::str::from_utf8(kv.value())
        .ok()
        .and_then(|text| text.parse::<PeerAddr>().ok());
    let Some(member) = parsed else {
        log(format_args!(
            "etcd peer directory: {:?} under {} holds {:?}, not a host:port; ignored",
            String::from_utf8_lossy(kv.key()),
            config.prefix,
            String::from_utf8_lossy(kv.value())
        ));
        return;
    };
    if members.len() >= KEYS_MAX && !members.contains_key(kv.key()) {
        log(format_args!(
            "etcd peer directory: more than {KEYS_MAX} members under {}; ignoring {member}",
            config.prefix
        ));
        return;
    }
    members.insert(kv.key().to_vec(), member);
}
