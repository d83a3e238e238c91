//! The etcd peer directory against a real etcd (Debian's `etcd-server`, binary `etcd`, or the
//! one `KVTIER_ETCD_BIN` names), started by the test on free loopback ports with a temporary data
//! directory: members register and see each other, a clean leave and a lease expiry are seen by
//! the watchers, a value that is not an address is ignored, tiers on the directory recompute
//! their peers and owners as members come and go, and a lost etcd keeps the last members until
//! it is back. Without etcd (or the `etcd` feature) the one test here prints "etcd tests NOT
//! RUN: <why>" and passes, unless `KVTIER_REQUIRE_ETCD=1` (set by .ci/run), when a missing etcd
//! fails it.
//!
//! That a membership change moves ownership minimally (only the keys the member owns, one owner
//! each) is property-tested on `owners` in the crate's unit tests (`directory.rs`).

mod common;

#[test]
fn etcd_tests_ran_or_report_why_not() {
    #[cfg(feature = "etcd")]
    let outcome = checks::start_etcd();
    #[cfg(not(feature = "etcd"))]
    let outcome: Result<(), String> = Err("tier-p2p built without the `etcd` feature".into());
    match outcome {
        #[cfg(feature = "etcd")]
        Ok(mut etcd) => checks::run(&mut etcd),
        #[cfg(not(feature = "etcd"))]
        Ok(()) => {}
        Err(reason) => {
            let required = std::env::var("KVTIER_REQUIRE_ETCD").is_ok_and(|v| v == "1");
            let built = cfg!(feature = "etcd");
            assert!(
                !(required && built),
                "KVTIER_REQUIRE_ETCD=1 but etcd tests NOT RUN: {reason}"
            );
            use std::io::Write;
            let line = "==================================================================";
            let _ = writeln!(
                std::io::stderr(),
                "\n{line}\netcd tests NOT RUN: {reason}\n{line}"
            );
        }
    }
}

#[cfg(feature = "etcd")]
mod checks {
    use std::collections::BTreeSet;
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use offload_core::tier::{SlotMemory, Tier, TierLookup};
    use tier_p2p::{EtcdPeers, EtcdPeersConfig, P2pTier, PeerAddr, PeerDirectory};

    use super::common;

    const WAIT: Duration = Duration::from_secs(20);
    /// The members' lease TTL (etcd 3.4's minimum, with its default election timeout).
    const TTL: Duration = Duration::from_secs(2);
    const BYTES: u32 = 16 * 1024;
    /// Chunks x publishes (the chance that z owns none of them is 2^-16).
    const KEYS: u64 = 16;

    /// An etcd server on loopback, killed when dropped.
    pub struct Etcd {
        binary: PathBuf,
        dir: PathBuf,
        client: SocketAddr,
        peer: SocketAddr,
        child: Option<Child>,
    }

    impl Etcd {
        fn url(&self) -> String {
            format!("http://{}", self.client)
        }

        fn spawn(&mut self) -> Result<(), String> {
            let client = format!("http://{}", self.client);
            let peer = format!("http://{}", self.peer);
            let log = std::fs::File::create(self.dir.join("etcd.log"))
                .map_err(|e| format!("create {}: {e}", self.dir.display()))?;
            let child = Command::new(&self.binary)
                .arg("--name=kvtier-test")
                .arg(format!("--data-dir={}", self.dir.join("data").display()))
                .arg(format!("--listen-client-urls={client}"))
                .arg(format!("--advertise-client-urls={client}"))
                .arg(format!("--listen-peer-urls={peer}"))
                .arg(format!("--initial-advertise-peer-urls={peer}"))
                .arg(format!("--initial-cluster=kvtier-test={peer}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .map_err(|e| format!("cannot run {}: {e}", self.binary.display()))?;
            self.child = Some(child);
            let start = Instant::now();
            while TcpStream::connect(self.client).is_err() {
                if start.elapsed() > WAIT {
                    return Err(format!(
                        "etcd did not listen on {} within {WAIT:?}; log: {}",
                        self.client,
                        self.log()
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        }

        fn kill(&mut self) {
            if let Some(mut child) = self.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }

        fn log(&self) -> String {
            std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
        }
    }

    impl Drop for Etcd {
        fn drop(&mut self) {
            self.kill();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn free_addr() -> SocketAddr {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
    }

    /// Starts etcd, or says why it cannot.
    pub fn start_etcd() -> Result<Etcd, String> {
        let binary = PathBuf::from(std::env::var_os("KVTIER_ETCD_BIN").unwrap_or("etcd".into()));
        let version = Command::new(&binary).arg("--version").output();
        match version {
            Ok(out) if out.status.success() => {}
            Ok(out) => return Err(format!("{} --version failed: {out:?}", binary.display())),
            Err(e) => {
                return Err(format!(
                    "no etcd binary ({}: {e}); install Debian's etcd-server or set KVTIER_ETCD_BIN",
                    binary.display()
                ))
            }
        }
        let dir = std::env::temp_dir().join(format!("kvtier-etcd-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let mut etcd = Etcd {
            binary,
            dir,
            client: free_addr(),
            peer: free_addr(),
            child: None,
        };
        etcd.spawn()?;
        Ok(etcd)
    }

    pub fn run(etcd: &mut Etcd) {
        eprintln!(
            "etcd at {}: running tier-p2p's etcd directory checks",
            etcd.url()
        );
        members_register_join_and_leave(etcd);
        tiers_follow_the_directory(etcd);
        a_lost_etcd_keeps_the_last_members(etcd);
    }

    fn config(etcd: &Etcd, prefix: &str, member: Option<&str>) -> EtcdPeersConfig {
        let mut config = EtcdPeersConfig::new(
            vec![etcd.url()],
            prefix.to_owned(),
            member.map(|m| m.parse().expect("member address")),
        );
        config.lease_ttl = TTL;
        config.call_deadline = Duration::from_secs(2);
        config.retry_after = Duration::from_millis(100);
        config
    }

    fn names(directory: &dyn PeerDirectory) -> BTreeSet<String> {
        directory
            .members()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    fn set(members: &[&str]) -> BTreeSet<String> {
        members.iter().map(|m| (*m).to_owned()).collect()
    }

    fn eventually_members(what: &str, directory: &dyn PeerDirectory, expected: &[&str]) {
        let expected = set(expected);
        let start = Instant::now();
        loop {
            let now = names(directory);
            if now == expected {
                return;
            }
            assert!(
                start.elapsed() < WAIT,
                "{what}: members {now:?}, expected {expected:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Runs `body` on a small tokio runtime with a client of `etcd` (for what a member would
    /// do without this crate: a lease left to expire, a malformed value).
    fn with_client<T>(
        etcd: &Etcd,
        body: impl AsyncFnOnce(&mut etcd_client::Client) -> Result<T, etcd_client::Error>,
    ) -> T {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let mut client = etcd_client::Client::connect([etcd.url()], None)
                .await
                .expect("connect to etcd");
            body(&mut client).await.expect("etcd call")
        })
    }

    /// The lease of `key` (`None` if absent).
    fn lease_of(etcd: &Etcd, key: &str) -> Option<i64> {
        let key = key.to_owned();
        with_client(etcd, async |client| {
            let got = client.get(key, None).await?;
            Ok(got.kvs().first().map(|kv| kv.lease()))
        })
    }

    fn members_register_join_and_leave(etcd: &Etcd) {
        let prefix = "/kvtier/test/join/";
        let watcher = EtcdPeers::start(config(etcd, prefix, None)).expect("watcher");
        let a = EtcdPeers::start(config(etcd, prefix, Some("127.0.0.1:1001"))).expect("a");
        let b = EtcdPeers::start(config(etcd, prefix, Some("127.0.0.1:1002"))).expect("b");
        let both = ["127.0.0.1:1001", "127.0.0.1:1002"];
        eventually_members("both registered, seen by the watcher", &watcher, &both);
        eventually_members("a sees both (itself included)", &a, &both);
        eventually_members("b sees both", &b, &both);
        let a_key = format!("{prefix}127.0.0.1:1001");
        let a_lease = lease_of(etcd, &a_key);
        let a_registered = Instant::now();
        // A clean leave revokes the lease: gone at once, not after the TTL.
        drop(b);
        eventually_members("b left", &watcher, &["127.0.0.1:1001"]);
        // A member that dies leaves when its lease expires: one registered with a 2 s lease
        // that nobody keeps alive.
        let key = format!("{prefix}127.0.0.1:1003");
        with_client(etcd, async |client| {
            let lease = client.lease_grant(2, None).await?;
            let options = etcd_client::PutOptions::new().with_lease(lease.id());
            client.put(key, "127.0.0.1:1003", Some(options)).await
        });
        eventually_members(
            "the unkept member joined",
            &watcher,
            &["127.0.0.1:1001", "127.0.0.1:1003"],
        );
        eventually_members("its lease expired", &watcher, &["127.0.0.1:1001"]);
        // a's own 2 s lease is kept alive: after three TTLs its key is still the one it
        // registered (same lease), and its session never broke.
        while a_registered.elapsed() < 3 * TTL {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(lease_of(etcd, &a_key), a_lease, "a's registration was lost");
        assert_eq!((a.sessions_started(), a.sessions_lost()), (1, 0));
        // A value that is not an address is ignored.
        let junk = format!("{prefix}junk");
        with_client(etcd, async |client| {
            client.put(junk, "not an address", None).await
        });
        let d = EtcdPeers::start(config(etcd, prefix, Some("127.0.0.1:1004"))).expect("d");
        eventually_members(
            "d joined; the junk value is not a member",
            &watcher,
            &["127.0.0.1:1001", "127.0.0.1:1004"],
        );
        eventually_members(
            "d read the prefix too",
            &d,
            &["127.0.0.1:1001", "127.0.0.1:1004"],
        );
        assert_eq!(watcher.sessions_lost(), 0);
    }

    fn memory() -> Arc<dyn SlotMemory> {
        Arc::new(tier_testkit::VecSlotMemory::new(
            KEYS as u32,
            BYTES as usize,
        ))
    }

    /// A tier listening on `listen`, its members from etcd (itself registered): by the
    /// config's `etcd_endpoints`, or (`by_hand`) an `EtcdPeers` given to `with_directory`.
    fn tier(
        etcd: &Etcd,
        prefix: &str,
        listen: SocketAddr,
        by_hand: bool,
    ) -> (P2pTier, Arc<dyn SlotMemory>) {
        let mut config = common::config(Vec::new());
        config.listen = listen;
        config.owners = 1;
        let memory = memory();
        let tier = if by_hand {
            let me = listen.to_string();
            let directory = EtcdPeers::start(self::config(etcd, prefix, Some(&me))).expect("dir");
            P2pTier::with_directory(config, Arc::clone(&memory), Box::new(directory))
        } else {
            config.etcd_endpoints = vec![etcd.url()];
            config.etcd_prefix = prefix.to_owned();
            config.etcd_lease_ttl = TTL;
            P2pTier::new(config, Arc::clone(&memory))
        };
        (tier.expect("tier starts"), memory)
    }

    fn peers(tier: &P2pTier) -> BTreeSet<String> {
        tier.peer_status()
            .iter()
            .map(|s| s.peer.to_string())
            .collect()
    }

    /// Looks `index` up on `tier` until it settles (each lookup also makes the client read the
    /// directory again).
    fn lookup(tier: &mut P2pTier, index: u64) -> TierLookup {
        common::settle(tier, common::key(index), WAIT)
    }

    fn tiers_follow_the_directory(etcd: &Etcd) {
        let prefix = "/kvtier/test/tiers/";
        let (x_addr, y_addr, z_addr) = (free_addr(), free_addr(), free_addr());
        let (mut x, x_memory) = tier(etcd, prefix, x_addr, true);
        let (mut y, _) = tier(etcd, prefix, y_addr, false);
        common::publish(&mut x, &x_memory, KEYS, BYTES);
        let start = Instant::now();
        while peers(&y) != set(&[&x_addr.to_string()]) {
            assert!(start.elapsed() < WAIT, "y's peers: {:?}", peers(&y));
            let _ = lookup(&mut y, 100);
        }
        // With one other member, y asks x for every key, and x holds 0..KEYS.
        for i in 0..KEYS {
            assert_eq!(lookup(&mut y, i), TierLookup::Hit, "key {i}");
        }
        // z joins. With owners = 1, y now asks each key's one owner among {x, z}: x's keys
        // still hit, z's keys miss (z holds none: x published before z joined).
        let (z, _) = tier(etcd, prefix, z_addr, false);
        let xz = set(&[&x_addr.to_string(), &z_addr.to_string()]);
        let start = Instant::now();
        while peers(&y) != xz {
            assert!(start.elapsed() < WAIT, "y's peers: {:?}", peers(&y));
            let _ = lookup(&mut y, 100);
        }
        let ids: Vec<u64> = [x_addr, z_addr]
            .iter()
            .map(|a| tier_p2p::member_id(&PeerAddr::Ip(*a)))
            .collect();
        let mut owned_by_z = 0;
        for i in 0..KEYS {
            let owner_is_x = tier_p2p::owners(common::key(i), &ids, 1) == vec![0];
            let expected = if owner_is_x {
                TierLookup::Hit
            } else {
                owned_by_z += 1;
                TierLookup::Miss
            };
            assert_eq!(lookup(&mut y, i), expected, "key {i} with members x and z");
        }
        assert!(owned_by_z > 0, "z owns none of {KEYS} keys; pick more");
        // z leaves (its tier shut down, its lease revoked): y's peers are x alone again, and
        // every key hits again.
        drop(z);
        let start = Instant::now();
        while peers(&y) != set(&[&x_addr.to_string()]) {
            assert!(start.elapsed() < WAIT, "y's peers: {:?}", peers(&y));
            let _ = lookup(&mut y, 100);
        }
        for i in 0..KEYS {
            assert_eq!(lookup(&mut y, i), TierLookup::Hit, "key {i} after z left");
        }
        y.shutdown();
        x.shutdown();
    }

    fn a_lost_etcd_keeps_the_last_members(etcd: &mut Etcd) {
        let prefix = "/kvtier/test/lost/";
        let watcher = EtcdPeers::start(config(etcd, prefix, None)).expect("watcher");
        let a = EtcdPeers::start(config(etcd, prefix, Some("127.0.0.1:2001"))).expect("a");
        eventually_members("a registered", &watcher, &["127.0.0.1:2001"]);
        let started = watcher.sessions_started();
        etcd.kill();
        common::eventually("the watcher noticed etcd is gone", WAIT, || {
            watcher.sessions_lost() >= 1 && a.sessions_lost() >= 1
        });
        assert_eq!(
            names(&watcher),
            set(&["127.0.0.1:2001"]),
            "the last members stay while etcd is gone"
        );
        etcd.spawn().expect("etcd restarts");
        common::eventually("the watcher reconnected", WAIT, || {
            watcher.sessions_started() > started
        });
        let b = EtcdPeers::start(config(etcd, prefix, Some("127.0.0.1:2002"))).expect("b");
        eventually_members(
            "after etcd came back, a is registered again and b joined",
            &watcher,
            &["127.0.0.1:2001", "127.0.0.1:2002"],
        );
        eventually_members(
            "a follows the prefix again",
            &a,
            &["127.0.0.1:2001", "127.0.0.1:2002"],
        );
        drop(b);
    }
}
