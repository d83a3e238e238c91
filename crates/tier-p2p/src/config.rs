//! Configuration of the peer tier ([`P2pConfig`]) and the namespace identity two peers must share
//! ([`Namespace`]), with the checks that refuse unsafe or out-of-range settings.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use offload_core::NamespaceId;

use crate::error::P2pError;
use crate::frame::{DATA_PREFIX_BYTES, FRAME_BODY_BYTES_MIN, KEY_BYTES, NAMESPACE_BYTES_MAX};
use crate::peer::PeerAddr;

/// What makes a key mean the same bytes on two instances: the KV layout's
/// [`NamespaceId`] (model, dtype, tokens per chunk, parallel layout, the one namespace type every
/// tier uses), the bytes of one engine block, and the seed of the prefix hash. Peers with
/// different namespaces refuse each other, because the same key would name different bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Namespace {
    bytes: Vec<u8>,
}

impl Namespace {
    /// The namespace of the chunks of `id`, with `block_bytes` bytes per engine block and
    /// prefix-hash seed `hash_seed`. Its bytes (sent in HELLO, bound into the HMAC) are
    /// `model="{model}" layout="{dtype} {tokens_per_chunk} tokens/chunk {parallel_layout}
    /// {block_bytes} bytes/block" hash_seed={hash_seed:#018x}` (one line; both strings
    /// quoted and escaped as Rust's `Debug` writes them).
    pub fn new(id: &NamespaceId, block_bytes: u64, hash_seed: u64) -> Self {
        let layout = format!(
            "{} {} tokens/chunk {} {} bytes/block",
            id.dtype, id.tokens_per_chunk, id.parallel_layout, block_bytes
        );
        let text = format!(
            "model={:?} layout={layout:?} hash_seed={hash_seed:#018x}",
            id.model
        );
        Self {
            bytes: text.into_bytes(),
        }
    }

    /// The canonical bytes sent in HELLO and bound into the HMAC.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Namespace({})", String::from_utf8_lossy(&self.bytes))
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.bytes))
    }
}

/// Settings of a [`P2pTier`](crate::P2pTier). Every queue, table, wait and frame has a limit here.
#[derive(Clone)]
pub struct P2pConfig {
    /// Where this instance serves its published chunks. Port 0 picks a free port (see
    /// [`P2pTier::local_addr`](crate::P2pTier::local_addr)). Without `secret` it must be a
    /// loopback address.
    pub listen: SocketAddr,
    /// The peers (a static directory, [`StaticPeers`](crate::StaticPeers)): IP literals or DNS
    /// names, each resolved at every connect. This instance's own address may be listed (it is
    /// recognised and left out), so every instance can share one list.
    pub peers: Vec<PeerAddr>,
    /// Instead of `peers`: a DNS name whose every address is a peer at its port
    /// ([`DnsPeers`](crate::DnsPeers)), re-resolved every `dns_refresh`.
    pub peers_dns: Option<PeerAddr>,
    /// How often `peers_dns` is resolved again.
    pub dns_refresh: Duration,
    /// Instead of `peers` and `peers_dns` (feature `etcd`): etcd client URLs; the members are
    /// those registered under `etcd_prefix` (`EtcdPeers`), this instance
    /// among them, registered as `advertise`, else as `listen` (which then needs a fixed port).
    pub etcd_endpoints: Vec<String>,
    /// The etcd key prefix of this group's members.
    pub etcd_prefix: String,
    /// The registration's lease time to live (a dead member leaves after it).
    pub etcd_lease_ttl: Duration,
    /// How peers name this instance, when that is not `listen` (a DNS name, or the address
    /// behind a NAT): a member equal to it or to the bound address is this instance.
    pub advertise: Option<PeerAddr>,
    /// How many members own each key (1 to 3): lookups ask only a key's owners, and a publish
    /// also pushes the chunk to them. 0: every member owns every key (lookups ask all members,
    /// nothing is pushed), the reference that owner lookups are measured against.
    pub owners: usize,
    /// Most members taken from the directory (more are ignored, with a log line).
    pub members_max: usize,
    /// The namespace identity; peers must have the same.
    pub namespace: Namespace,
    /// Shared secret for the HMAC challenge and response; `None` means no authentication, which
    /// is allowed on loopback only.
    pub secret: Option<Vec<u8>>,
    /// Bytes of published chunks this instance keeps to serve; least recently used go first.
    pub published_bytes_max: usize,
    /// How long a lookup may answer `Retry` before it answers `Miss`.
    pub lookup_deadline: Duration,
    /// How long a peer's answer to a lookup is reused. An answer is always returned at least once,
    /// so 0 means "ask again on every new lookup".
    pub lookup_cache_ttl: Duration,
    /// Most keys the lookup table tracks (pending and answered).
    pub lookup_entries_max: usize,
    /// Deadline of a TCP connect.
    pub connect_deadline: Duration,
    /// Deadline of the whole handshake.
    pub handshake_deadline: Duration,
    /// Deadline of one load job, from its submission to its last byte.
    pub fetch_deadline: Duration,
    /// A served connection idle (or stalled inside a frame) for this long is closed.
    pub idle_timeout: Duration,
    /// First wait before a peer that failed is tried again; doubles on each failure.
    pub backoff_initial: Duration,
    /// Longest wait before a failed peer is tried again.
    pub backoff_max: Duration,
    /// Most connections the server handles at once; more are refused with an ERROR frame.
    pub connections_max: usize,
    /// Most jobs accepted and not yet completed; more are refused as `Busy`.
    pub jobs_in_flight_max: usize,
    /// Most keys in one HAVE or GET request (longer lists are split).
    pub keys_per_request_max: usize,
    /// Largest frame body accepted from a peer (a DATA frame holds one chunk plus 20 bytes). A
    /// server accepts only requests, so it holds its incoming frames to the size of a HELLO or
    /// of a request of `keys_per_request_max` keys, whichever is larger.
    pub frame_body_bytes_max: usize,
    /// With the `nixl` feature: move fetched bytes by NIXL READ when the NIXL library loads at
    /// run time and the peer offers it (else, and without the feature, over the TCP stream).
    pub nixl: bool,
}

impl fmt::Debug for P2pConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("P2pConfig")
            .field("listen", &self.listen)
            .field("peers", &self.peers)
            .field("peers_dns", &self.peers_dns)
            .field("etcd_endpoints", &self.etcd_endpoints)
            .field("etcd_prefix", &self.etcd_prefix)
            .field("advertise", &self.advertise)
            .field("owners", &self.owners)
            .field("namespace", &self.namespace)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("published_bytes_max", &self.published_bytes_max)
            .field("lookup_deadline", &self.lookup_deadline)
            .field("lookup_cache_ttl", &self.lookup_cache_ttl)
            .field("fetch_deadline", &self.fetch_deadline)
            .field("frame_body_bytes_max", &self.frame_body_bytes_max)
            .field("nixl", &self.nixl)
            .finish_non_exhaustive()
    }
}

impl P2pConfig {
    /// Loopback on a free port, no peers, no secret, and the default limits.
    pub fn new(namespace: Namespace) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            peers: Vec::new(),
            peers_dns: None,
            dns_refresh: Duration::from_secs(5),
            etcd_endpoints: Vec::new(),
            etcd_prefix: "/kvtier/p2p/members/".to_owned(),
            etcd_lease_ttl: Duration::from_secs(10),
            advertise: None,
            owners: 2,
            members_max: 1024,
            namespace,
            secret: None,
            published_bytes_max: 256 << 20,
            lookup_deadline: Duration::from_millis(500),
            lookup_cache_ttl: Duration::from_secs(1),
            lookup_entries_max: 1 << 16,
            connect_deadline: Duration::from_millis(500),
            handshake_deadline: Duration::from_secs(1),
            fetch_deadline: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            connections_max: 64,
            jobs_in_flight_max: 256,
            keys_per_request_max: 4096,
            frame_body_bytes_max: (64 << 20) + DATA_PREFIX_BYTES,
            nixl: true,
        }
    }

    /// The address this instance registers in etcd: `advertise`, else `listen` if it names a
    /// fixed address and port.
    pub fn etcd_member(&self) -> Result<PeerAddr, P2pError> {
        if let Some(advertise) = &self.advertise {
            return Ok(advertise.clone());
        }
        if self.listen.port() == 0 || self.listen.ip().is_unspecified() {
            return Err(P2pError::Config {
                field: "advertise",
                reason: format!(
                    "needed with `etcd_endpoints` unless `listen` ({}) has a fixed address and \
                     port: it is what peers find in etcd",
                    self.listen
                ),
            });
        }
        Ok(PeerAddr::Ip(self.listen))
    }

    fn validate_etcd(&self) -> Result<(), P2pError> {
        if !self.peers.is_empty() || self.peers_dns.is_some() {
            return config(
                "etcd_endpoints",
                "set together with `peers` or `peers_dns`; pick one".to_owned(),
            );
        }
        if !cfg!(feature = "etcd") {
            return config(
                "etcd_endpoints",
                "this build has no etcd directory (tier-p2p's `etcd` feature)".to_owned(),
            );
        }
        self.etcd_member()?;
        if self.etcd_prefix.is_empty() {
            return config("etcd_prefix", "is empty".to_owned());
        }
        if self.etcd_lease_ttl < Duration::from_secs(1) {
            return config("etcd_lease_ttl", "must be at least 1 s".to_owned());
        }
        Ok(())
    }

    /// Checks every setting against the others and against the host pool's slot size.
    pub fn validate(&self, slot_bytes: usize) -> Result<(), P2pError> {
        if !self.listen.ip().is_loopback() && self.secret.is_none() {
            return config(
                "listen",
                format!(
                    "{} is not a loopback address; serving beyond loopback requires `secret`",
                    self.listen
                ),
            );
        }
        if self.secret.is_none() {
            // Without a secret nothing authenticates the stream: talk to loopback peers only.
            if let Some(peer) = self.peers.iter().find(|p| !p.is_loopback()) {
                return config(
                    "peers",
                    format!(
                        "{peer} is not a loopback address; peers beyond loopback require `secret`"
                    ),
                );
            }
            if let Some(peer) = self.peers_dns.as_ref().filter(|p| !p.is_loopback()) {
                return config(
                    "peers_dns",
                    format!(
                        "{peer} is not a loopback address; peers beyond loopback require `secret`"
                    ),
                );
            }
        }
        if self.secret.as_ref().is_some_and(|s| s.len() < 16) {
            return config("secret", "must be at least 16 bytes".to_owned());
        }
        if self.namespace.as_bytes().len() > NAMESPACE_BYTES_MAX {
            return config(
                "namespace",
                format!("longer than {NAMESPACE_BYTES_MAX} bytes"),
            );
        }
        if self.owners > 3 {
            return config(
                "owners",
                format!("{} outside 0..=3 (0: all members)", self.owners),
            );
        }
        if !(1..=u16::MAX as usize).contains(&self.members_max) {
            return config(
                "members_max",
                format!("{} outside 1..={}", self.members_max, u16::MAX),
            );
        }
        if self.peers.len() > self.members_max {
            return config(
                "peers",
                format!("more than `members_max` ({}) peers", self.members_max),
            );
        }
        if self.peers_dns.is_some() && !self.peers.is_empty() {
            return config(
                "peers_dns",
                "set together with `peers`; pick one".to_owned(),
            );
        }
        if !self.etcd_endpoints.is_empty() {
            self.validate_etcd()?;
        }
        let positive: [(&'static str, usize); 5] = [
            ("published_bytes_max", self.published_bytes_max),
            ("lookup_entries_max", self.lookup_entries_max),
            ("connections_max", self.connections_max),
            ("jobs_in_flight_max", self.jobs_in_flight_max),
            ("keys_per_request_max", self.keys_per_request_max),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, value)| *value == 0) {
            return config(field, "must be at least 1".to_owned());
        }
        self.validate_waits()?;
        self.validate_frames(slot_bytes)
    }

    fn validate_waits(&self) -> Result<(), P2pError> {
        let waits: [(&'static str, Duration); 8] = [
            ("dns_refresh", self.dns_refresh),
            ("lookup_deadline", self.lookup_deadline),
            ("connect_deadline", self.connect_deadline),
            ("handshake_deadline", self.handshake_deadline),
            ("fetch_deadline", self.fetch_deadline),
            ("idle_timeout", self.idle_timeout),
            ("backoff_initial", self.backoff_initial),
            ("backoff_max", self.backoff_max),
        ];
        if let Some((field, _)) = waits.iter().find(|(_, wait)| wait.is_zero()) {
            return config(field, "must be longer than zero".to_owned());
        }
        if self.backoff_max < self.backoff_initial {
            return config("backoff_max", "shorter than `backoff_initial`".to_owned());
        }
        Ok(())
    }

    fn validate_frames(&self, slot_bytes: usize) -> Result<(), P2pError> {
        let body_max = self.frame_body_bytes_max;
        if !(FRAME_BODY_BYTES_MIN..=u32::MAX as usize).contains(&body_max) {
            return config(
                "frame_body_bytes_max",
                format!("{body_max} outside {FRAME_BODY_BYTES_MIN}..={}", u32::MAX),
            );
        }
        if slot_bytes.saturating_add(DATA_PREFIX_BYTES) > body_max {
            return config(
                "frame_body_bytes_max",
                format!(
                    "{body_max} cannot hold a chunk of {slot_bytes} bytes plus {DATA_PREFIX_BYTES}"
                ),
            );
        }
        let request_bytes = self.keys_per_request_max.saturating_mul(KEY_BYTES) + 4;
        if request_bytes > body_max {
            return config(
                "keys_per_request_max",
                format!(
                    "a request of {} keys exceeds `frame_body_bytes_max`",
                    self.keys_per_request_max
                ),
            );
        }
        Ok(())
    }
}

fn config(field: &'static str, reason: String) -> Result<(), P2pError> {
    Err(P2pError::Config { field, reason })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::P2pErrorKind;

    fn base() -> P2pConfig {
        P2pConfig::new(Namespace::new(&id("m"), 2048, 1))
    }

    fn id(model: &str) -> NamespaceId {
        NamespaceId {
            model: model.into(),
            dtype: "bfloat16".into(),
            tokens_per_chunk: 256,
            parallel_layout: "tp2-rank1".into(),
        }
    }

    /// The handshake's namespace bytes for a known `NamespaceId` are pinned: a change here is
    /// a protocol change (peers of the two builds would refuse each other).
    #[test]
    fn namespace_bytes_are_pinned() {
        let ns = Namespace::new(&id("meta-llama/Llama-3.1-8B"), 131_072, 0x5EED);
        assert_eq!(
            std::str::from_utf8(ns.as_bytes()).expect("utf-8"),
            "model=\"meta-llama/Llama-3.1-8B\" layout=\"bfloat16 256 tokens/chunk tp2-rank1 \
             131072 bytes/block\" hash_seed=0x0000000000005eed"
        );
        let quoted = Namespace::new(&id("a\"b"), 1, 0);
        assert_eq!(
            quoted.as_bytes(),
            b"model=\"a\\\"b\" layout=\"bfloat16 256 tokens/chunk tp2-rank1 1 bytes/block\" \
              hash_seed=0x0000000000000000"
        );
        assert_ne!(
            ns,
            Namespace::new(&id("meta-llama/Llama-3.1-8B"), 131_072, 0x5EEE)
        );
        assert_ne!(
            ns,
            Namespace::new(&id("meta-llama/Llama-3.1-8B"), 65_536, 0x5EED)
        );
    }

    fn field_of(result: Result<(), P2pError>) -> &'static str {
        match result {
            Err(P2pError::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        base().validate(4 << 20).expect("defaults");
    }

    #[test]
    fn non_loopback_peers_need_a_secret() {
        for peer in ["10.0.0.7:7070", "[2001:db8::1]:7070", "node-b.cluster:7070"] {
            let mut config = base();
            config.peers = vec![
                "127.0.0.1:7070".parse().expect("peer"),
                peer.parse().expect("peer"),
            ];
            let error = config
                .validate(1024)
                .expect_err("a remote peer without a secret");
            let text = error.to_string();
            assert_eq!(field_of(Err(error)), "peers", "{peer}");
            assert!(text.contains("`secret`"), "{text}");
            let shown = peer.parse::<PeerAddr>().expect("peer").to_string();
            assert!(text.contains(&shown), "{text} names {shown}");
            config.secret = Some(vec![7; 32]);
            config.validate(1024).expect("allowed with a secret");
        }
        let mut config = base();
        config.peers = vec![
            "127.0.0.1:7070".parse().expect("peer"),
            "[::1]:7070".parse().expect("peer"),
            "localhost:7070".parse().expect("peer"),
        ];
        config
            .validate(1024)
            .expect("loopback peers need no secret");
        let mut config = base();
        config.peers_dns = Some("peers.svc:7070".parse().expect("name"));
        assert_eq!(field_of(config.validate(1024)), "peers_dns");
        config.secret = Some(vec![7; 32]);
        config.validate(1024).expect("allowed with a secret");
    }

    #[test]
    fn non_loopback_listen_needs_a_secret() {
        let mut config = base();
        config.listen = SocketAddr::from(([0, 0, 0, 0], 0));
        let error = config.validate(1024).expect_err("refused");
        assert_eq!(error.kind(), P2pErrorKind::Invalid);
        assert!(error.to_string().contains("`listen`"), "{error}");
        assert!(error.to_string().contains("`secret`"), "{error}");
        config.secret = Some(vec![7; 32]);
        config.validate(1024).expect("allowed with a secret");
    }

    #[test]
    fn limits_are_checked() {
        let mut config = base();
        config.frame_body_bytes_max = 1 << 20;
        assert_eq!(field_of(config.validate(1 << 20)), "frame_body_bytes_max");
        let mut config = base();
        config.jobs_in_flight_max = 0;
        assert_eq!(field_of(config.validate(1024)), "jobs_in_flight_max");
        let mut config = base();
        config.fetch_deadline = Duration::ZERO;
        assert_eq!(field_of(config.validate(1024)), "fetch_deadline");
        let mut config = base();
        config.secret = Some(b"short".to_vec());
        assert_eq!(field_of(config.validate(1024)), "secret");
        let mut config = base();
        config.owners = 4;
        assert_eq!(field_of(config.validate(1024)), "owners");
        let mut config = base();
        config.owners = 0;
        assert!(config.validate(1024).is_ok(), "owners 0 means all members");
        let mut config = base();
        config.etcd_endpoints = vec!["http://127.0.0.1:2379".to_owned()];
        config.peers = vec!["127.0.0.1:7000".parse().expect("addr")];
        assert_eq!(field_of(config.validate(1024)), "etcd_endpoints");
        let mut config = base();
        config.etcd_endpoints = vec!["http://127.0.0.1:2379".to_owned()];
        if cfg!(feature = "etcd") {
            // listen is 127.0.0.1:0: peers could not reach what would be registered.
            assert_eq!(field_of(config.validate(1024)), "advertise");
            config.listen = "127.0.0.1:7071".parse().expect("addr");
            assert!(config.validate(1024).is_ok());
            config.etcd_lease_ttl = Duration::from_millis(500);
            assert_eq!(field_of(config.validate(1024)), "etcd_lease_ttl");
        } else {
            assert_eq!(field_of(config.validate(1024)), "etcd_endpoints");
        }
        let mut config = base();
        config.peers_dns = Some("peers.local:7071".parse().expect("name"));
        config.peers = vec![config.listen.into()];
        assert_eq!(field_of(config.validate(1024)), "peers_dns");
    }

    #[test]
    fn debug_redacts_the_secret() {
        let mut config = base();
        config.secret = Some(b"0123456789abcdef-secret".to_vec());
        let text = format!("{config:?}");
        assert!(!text.contains("secret\""), "{text}");
        assert!(text.contains("<redacted>"), "{text}");
        assert!(!text.contains("0123456789abcdef"), "{text}");
    }
}
