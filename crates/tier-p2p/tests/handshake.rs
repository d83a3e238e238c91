//! The handshake and the server's defences, between real instances and against peers played by
//! hand: a matching secret connects; a wrong secret, a wrong namespace, a secret on one side only
//! and another protocol version are refused (by the server and by the client); malformed and
//! oversized frames close only their connection; a busy server refuses extra connections.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use offload_core::tier::{SlotMemory, Tier, TierLookup};
use offload_core::JobId;
use tier_p2p::frame::{Frame, FrameKind, HEADER_BYTES, PROTOCOL_VERSION};
use tier_p2p::{Namespace, P2pConfig, P2pTier};

use common::Raw;

const BYTES: u32 = 64 * 1024;
const WAIT: Duration = Duration::from_secs(5);
const SECRET: &[u8] = b"correct horse battery staple";

fn memory() -> Arc<dyn SlotMemory> {
    Arc::new(tier_testkit::VecSlotMemory::new(4, BYTES as usize))
}

/// A publisher with chunks 0 and 1, configured by `edit`.
fn publisher(edit: impl FnOnce(&mut P2pConfig)) -> P2pTier {
    let mut config = common::config(Vec::new());
    edit(&mut config);
    let memory = memory();
    let mut tier = P2pTier::new(config, Arc::clone(&memory)).expect("publisher starts");
    common::publish(&mut tier, &memory, 2, BYTES);
    tier
}

/// A fetcher whose only peer is `peer`, configured by `edit`.
fn fetcher(peer: SocketAddr, edit: impl FnOnce(&mut P2pConfig)) -> P2pTier {
    let mut config = common::config(vec![peer]);
    config.lookup_deadline = Duration::from_secs(2);
    edit(&mut config);
    P2pTier::new(config, memory()).expect("fetcher starts")
}

/// The fetcher's lookup of chunk 0 settles as a miss, and its peer's last error contains `why`.
fn expect_refused(fetcher: &mut P2pTier, why: &str) {
    assert_eq!(
        common::settle(fetcher, common::key(0), WAIT),
        TierLookup::Miss,
        "a refused peer answers nothing"
    );
    let status = &fetcher.peer_status()[0];
    let error = status.last_error.clone().unwrap_or_default();
    assert!(!status.connected, "{status:?}");
    assert!(
        error.contains(why),
        "expected {why:?} in the peer error: {error}"
    );
    assert!(fetcher.stats().handshakes_refused >= 1);
}

fn server_refusals(tier: &P2pTier) -> u64 {
    tier.stats().handshakes_refused
}

#[test]
fn matching_secret_connects_and_loads() {
    let mut a = publisher(|c| c.secret = Some(SECRET.to_vec()));
    let mut b = fetcher(a.local_addr(), |c| c.secret = Some(SECRET.to_vec()));
    assert_eq!(
        common::settle(&mut b, common::key(0), WAIT),
        TierLookup::Hit
    );
    common::submit_load(&mut b, JobId(1), &[0, 1], 0, BYTES);
    let done = common::wait(&mut b, JobId(1), WAIT);
    assert!(done.is_success(), "{done:?}");
    assert_eq!(server_refusals(&a), 0);
    assert_eq!(b.stats().handshakes_refused, 0);
    a.shutdown();
}

#[test]
fn wrong_secret_is_refused_by_the_server() {
    let a = publisher(|c| c.secret = Some(SECRET.to_vec()));
    let mut b = fetcher(a.local_addr(), |c| {
        c.secret = Some(b"a different secret!!".to_vec())
    });
    expect_refused(&mut b, "the client's HMAC proof does not verify");
    common::eventually("server counts the refusal", WAIT, || {
        server_refusals(&a) >= 1
    });
}

#[test]
fn wrong_namespace_is_refused_by_the_server() {
    let a = publisher(|_| {});
    let mut b = fetcher(a.local_addr(), |c| {
        c.namespace = Namespace::new(
            &common::namespace_id("another-model", "bfloat16"),
            4096,
            0x5EED,
        )
    });
    expect_refused(&mut b, "namespace mismatch");
    common::eventually("server counts the refusal", WAIT, || {
        server_refusals(&a) >= 1
    });
}

#[test]
fn secret_on_one_side_only_is_refused_both_ways() {
    let a = publisher(|c| c.secret = Some(SECRET.to_vec()));
    let mut b = fetcher(a.local_addr(), |_| {});
    expect_refused(
        &mut b,
        "the server requires a shared secret and the client has none",
    );
    let c = publisher(|_| {});
    let mut d = fetcher(c.local_addr(), |c| c.secret = Some(SECRET.to_vec()));
    expect_refused(
        &mut d,
        "the client requires a shared secret and the server has none",
    );
    common::eventually("servers count the refusals", WAIT, || {
        server_refusals(&a) >= 1 && server_refusals(&c) >= 1
    });
}

/// A fake server that answers one connection's HELLO with `namespace` (and a secret flag), then,
/// if the client sends AUTH, answers with a bogus proof. Returns the ERROR messages it received.
fn fake_server(namespace: Vec<u8>, secret: bool) -> (SocketAddr, JoinHandle<Vec<String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let thread = std::thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        let mut raw = Raw::new(stream);
        assert!(
            matches!(raw.recv(), Ok(Frame::Hello(_))),
            "client opens with HELLO"
        );
        raw.send(&Raw::hello(&namespace, secret));
        let mut errors = Vec::new();
        match raw.recv() {
            Ok(Frame::Auth(_)) => raw.send(&Frame::Auth([0x5A; 32])),
            Ok(Frame::Error(message)) => errors.push(message),
            other => panic!("unexpected {other:?}"),
        }
        errors.extend(raw.errors_until_closed());
        errors
    });
    (addr, thread)
}

#[test]
fn client_refuses_a_server_with_a_wrong_proof() {
    let (addr, server) = fake_server(common::namespace().as_bytes().to_vec(), true);
    let mut b = fetcher(addr, |c| {
        c.secret = Some(SECRET.to_vec());
        c.backoff_initial = Duration::from_secs(5);
        c.backoff_max = Duration::from_secs(5);
    });
    expect_refused(
        &mut b,
        "we refused it: the server's HMAC proof does not verify",
    );
    let errors = server.join().expect("fake server");
    assert!(
        errors.iter().any(|e| e.contains("HMAC")),
        "the client tells the server why: {errors:?}"
    );
}

#[test]
fn client_refuses_a_server_of_another_namespace() {
    let other = Namespace::new(&common::namespace_id("test-model", "fp8"), 4096, 0x5EED);
    let (addr, server) = fake_server(other.as_bytes().to_vec(), false);
    let mut b = fetcher(addr, |c| {
        c.backoff_initial = Duration::from_secs(5);
        c.backoff_max = Duration::from_secs(5);
    });
    expect_refused(&mut b, "we refused it: namespace mismatch");
    let errors = server.join().expect("fake server");
    assert!(
        errors.iter().any(|e| e.contains("namespace mismatch")),
        "the client tells the server why: {errors:?}"
    );
}

#[test]
fn server_refuses_another_protocol_version() {
    let a = publisher(|_| {});
    let mut raw = Raw::connect(a.local_addr());
    let mut hello = Vec::new();
    Raw::hello(common::namespace().as_bytes(), false).encode(&mut hello);
    // The version follows the 4-byte magic.
    hello[HEADER_BYTES + 4..HEADER_BYTES + 6]
        .copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    raw.send_bytes(&hello);
    let errors = raw.errors_until_closed();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("protocol version mismatch")),
        "{errors:?}"
    );
    common::eventually("server counts the refusal", WAIT, || {
        server_refusals(&a) >= 1
    });
}

/// A HELLO of protocol version 4, the last one with 64-bit keys.
fn version_4_hello() -> Vec<u8> {
    hello_of_version(4)
}

/// A HELLO of protocol `version`.
fn hello_of_version(version: u16) -> Vec<u8> {
    let mut hello = Vec::new();
    Raw::hello(common::namespace().as_bytes(), false).encode(&mut hello);
    // The version follows the 4-byte magic.
    hello[HEADER_BYTES + 4..HEADER_BYTES + 6].copy_from_slice(&version.to_le_bytes());
    hello
}

#[test]
fn server_refuses_a_version_5_peer_whose_keyed_tags_differ() {
    assert_eq!(PROTOCOL_VERSION, 6, "this test names the versions");
    let a = publisher(|_| {});
    let mut raw = Raw::connect(a.local_addr());
    raw.send_bytes(&hello_of_version(5));
    let errors = raw.errors_until_closed();
    assert!(
        errors.iter().any(|e| e.contains(
            "protocol version mismatch: peer speaks 5, we speak 6 (version 5 keys chunk tags"
        )),
        "{errors:?}"
    );
    common::eventually("server counts the refusal", WAIT, || {
        server_refusals(&a) >= 1
    });
}

#[test]
fn server_refuses_a_version_4_peer_with_64_bit_keys() {
    assert_eq!(PROTOCOL_VERSION, 6, "this test names the versions");
    let a = publisher(|_| {});
    let mut raw = Raw::connect(a.local_addr());
    raw.send_bytes(&version_4_hello());
    let errors = raw.errors_until_closed();
    assert!(
        errors.iter().any(|e| e.contains(
            "protocol version mismatch: peer speaks 4, we speak 6 (versions before 5 have 64-bit chunk keys"
        )),
        "{errors:?}"
    );
    common::eventually("server counts the refusal", WAIT, || {
        server_refusals(&a) >= 1
    });
}

#[test]
fn client_refuses_a_version_4_server() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = std::thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        let mut raw = Raw::new(stream);
        assert!(
            matches!(raw.recv(), Ok(Frame::Hello(_))),
            "client opens with HELLO"
        );
        raw.send_bytes(&version_4_hello());
        raw.errors_until_closed()
    });
    let mut b = fetcher(addr, |c| {
        c.backoff_initial = Duration::from_secs(5);
        c.backoff_max = Duration::from_secs(5);
    });
    expect_refused(&mut b, "peer speaks 4, we speak 6");
    let errors = server.join().expect("fake server");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("peer speaks 4, we speak 6")),
        "the client tells the server why: {errors:?}"
    );
}

/// Connects and handshakes by hand (no secret).
fn handshaken(addr: SocketAddr) -> Raw {
    let mut raw = Raw::connect(addr);
    raw.send(&Raw::hello(common::namespace().as_bytes(), false));
    assert!(
        matches!(raw.recv(), Ok(Frame::Hello(_))),
        "server answers HELLO"
    );
    raw
}

#[test]
fn malformed_and_oversized_frames_close_only_their_connection() {
    let mut a = publisher(|_| {});
    // An oversized length after the handshake.
    let mut raw = handshaken(a.local_addr());
    let mut header = u32::MAX.to_le_bytes().to_vec();
    header.push(FrameKind::Get as u8);
    raw.send_bytes(&header);
    let errors = raw.errors_until_closed();
    assert!(
        errors.iter().any(|e| e.contains("exceeds the maximum")),
        "{errors:?}"
    );
    // A GET whose key count does not match its body.
    let mut raw = handshaken(a.local_addr());
    let mut get = Vec::new();
    Frame::Get(vec![common::key(0)]).encode(&mut get);
    get[HEADER_BYTES..HEADER_BYTES + 4].copy_from_slice(&3u32.to_le_bytes());
    raw.send_bytes(&get);
    let errors = raw.errors_until_closed();
    assert!(errors.iter().any(|e| e.contains("malformed")), "{errors:?}");
    // Not the protocol at all, before any handshake.
    let mut raw = Raw::connect(a.local_addr());
    raw.send_bytes(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    raw.errors_until_closed();
    common::eventually("server counts the rejected frames", WAIT, || {
        a.stats().frames_rejected >= 3
    });
    // The server still serves a well-behaved peer.
    let mut b = fetcher(a.local_addr(), |_| {});
    assert_eq!(
        common::settle(&mut b, common::key(1), WAIT),
        TierLookup::Hit
    );
    common::submit_load(&mut b, JobId(1), &[1], 0, BYTES);
    assert!(common::wait(&mut b, JobId(1), WAIT).is_success());
    a.shutdown();
}

#[test]
fn busy_server_refuses_connections_beyond_its_limit() {
    let a = publisher(|c| c.connections_max = 1);
    let _first = handshaken(a.local_addr());
    let mut second = Raw::connect(a.local_addr());
    let errors = second.errors_until_closed();
    assert!(
        errors.iter().any(|e| e.contains("server busy")),
        "{errors:?}"
    );
    assert_eq!(a.stats().connections_refused_busy, 1);
}

#[test]
fn non_loopback_listen_without_secret_is_refused() {
    let mut config = common::config(Vec::new());
    config.listen = SocketAddr::from(([0, 0, 0, 0], 0));
    let error = match P2pTier::new(config, memory()) {
        Ok(_) => panic!("a non-loopback listener without a secret must be refused"),
        Err(error) => error,
    };
    assert_eq!(error.kind(), tier_p2p::P2pErrorKind::Invalid);
    let text = error.to_string();
    assert!(
        text.contains("`listen`") && text.contains("`secret`"),
        "{text}"
    );
}
