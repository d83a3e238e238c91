//! Peer trust with a shared secret: a man in the middle (a loopback proxy) that swaps a DATA
//! payload for other bytes and rewrites the unkeyed xxh3 to match, flips one payload bit, or
//! flips one tag bit cannot get them loaded (the keyed tag fails, the key fails,
//! `mac_failures` counts it); the same proxy passing bytes
//! through loads normally; and nothing of the namespace goes out in HELLO before the other side
//! proved the secret.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use offload_core::tier::{FailedKey, SlotMemory, Tier, TierFailure, TierJob, TierLookup, TierOp};
use offload_core::JobId;
use tier_p2p::frame::{Frame, FrameKind, DATA_PREFIX_BYTES, HEADER_BYTES, KEY_BYTES};
use tier_p2p::{P2pConfig, P2pTier};

use common::Raw;

const BYTES: u32 = 64 * 1024;
const WAIT: Duration = Duration::from_secs(10);
const SECRET: &[u8] = b"correct horse battery staple";

fn memory() -> Arc<dyn SlotMemory> {
    Arc::new(tier_testkit::VecSlotMemory::new(4, BYTES as usize))
}

fn with_secret(config: &mut P2pConfig) {
    config.secret = Some(SECRET.to_vec());
    config.fetch_deadline = Duration::from_secs(2);
}

/// What the proxy does to each DATA frame it relays.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tamper {
    /// Nothing: an honest path.
    None,
    /// Inverts the payload and rewrites the checksum field to the xxh3 of the new bytes (what
    /// any path attacker can do to an unkeyed checksum).
    ForgeXxh3,
    /// Flips one bit of the payload, leaving the tag as sent.
    Payload,
    /// Flips one bit of the tag, leaving the payload as sent.
    Tag,
}

/// Relays the server's frames to the client, tampering with every DATA frame as `tamper` says.
fn relay_frames(mut from: TcpStream, mut to: TcpStream, tamper: Tamper) {
    loop {
        let mut header = [0u8; HEADER_BYTES];
        if from.read_exact(&mut header).is_err() {
            break;
        }
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let mut body = vec![0u8; len];
        if from.read_exact(&mut body).is_err() {
            break;
        }
        if header[4] == FrameKind::Data as u8 && len > DATA_PREFIX_BYTES {
            let (prefix, payload) = body.split_at_mut(DATA_PREFIX_BYTES);
            match tamper {
                Tamper::None => {}
                Tamper::ForgeXxh3 => {
                    for byte in payload.iter_mut() {
                        *byte = !*byte;
                    }
                    let forged = xxhash_rust::xxh3::xxh3_64(payload);
                    prefix[KEY_BYTES..].copy_from_slice(&forged.to_le_bytes());
                }
                Tamper::Payload => payload[payload.len() / 2] ^= 0x04,
                Tamper::Tag => prefix[KEY_BYTES + 3] ^= 0x20,
            }
        }
        if to.write_all(&header).is_err() || to.write_all(&body).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// A loopback proxy to `upstream` (every connection it accepts); returns its address.
fn proxy(upstream: SocketAddr, tamper: Tamper) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
    let addr = listener.local_addr().expect("proxy address");
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(upstream) else {
                return;
            };
            let (mut c_read, mut s_write) = (
                client.try_clone().expect("clone"),
                server.try_clone().expect("clone"),
            );
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_read, &mut s_write);
                let _ = s_write.shutdown(std::net::Shutdown::Both);
            });
            std::thread::spawn(move || relay_frames(server, client, tamper));
        }
    });
    addr
}

/// A publisher of chunks 0 and 1 with the secret, and a fetcher with the secret whose only peer
/// is a proxy to it.
fn through_proxy(tamper: Tamper) -> (P2pTier, P2pTier, Arc<dyn SlotMemory>) {
    let mut config = common::config(Vec::new());
    with_secret(&mut config);
    let published = memory();
    let mut a = P2pTier::new(config, Arc::clone(&published)).expect("publisher starts");
    common::publish(&mut a, &published, 2, BYTES);
    let mut config = common::config(vec![proxy(a.local_addr(), tamper)]);
    with_secret(&mut config);
    let fetched = memory();
    let b = P2pTier::new(config, Arc::clone(&fetched)).expect("fetcher starts");
    (a, b, fetched)
}

/// Loads chunks 0 and 1 through a proxy that tampers as `tamper` says, with a secret: both keys
/// fail, nothing counts as fetched, and each failure counts as a MAC failure.
fn tampered_chunks_fail_their_keys(tamper: Tamper) {
    let (mut a, mut b, memory) = through_proxy(tamper);
    assert_eq!(
        common::settle(&mut b, common::key(0), WAIT),
        TierLookup::Hit
    );
    common::submit_load(&mut b, JobId(1), &[0, 1], 0, BYTES);
    let done = common::wait(&mut b, JobId(1), WAIT);
    let stats = b.stats();
    assert_eq!(
        done.failed,
        vec![
            FailedKey::new(common::key(0), TierFailure::Corrupt),
            FailedKey::new(common::key(1), TierFailure::Corrupt)
        ],
        "{tamper:?}: tampered chunks must fail their keys ({stats:?})"
    );
    assert_eq!(stats.chunks_fetched, 0, "{tamper:?}: {stats:?}");
    assert!(stats.mac_failures >= 2, "{tamper:?}: {stats:?}");
    assert!(
        stats.checksum_mismatches >= stats.mac_failures,
        "{tamper:?}: {stats:?}"
    );
    if tamper != Tamper::Tag {
        // The tampered bytes are in the slot (received in place) but the key failed: never
        // served.
        assert!(tier_testkit::first_mismatch(
            &*memory,
            offload_core::SlotId(0),
            BYTES as usize,
            common::seed(0)
        )
        .is_some());
    }
    a.shutdown();
    b.shutdown();
}

#[test]
fn forged_payload_with_a_matching_xxh3_fails_its_keys() {
    tampered_chunks_fail_their_keys(Tamper::ForgeXxh3);
}

#[test]
fn one_flipped_payload_bit_under_the_sent_tag_fails_its_keys() {
    tampered_chunks_fail_their_keys(Tamper::Payload);
}

#[test]
fn one_flipped_tag_bit_over_the_sent_payload_fails_its_keys() {
    tampered_chunks_fail_their_keys(Tamper::Tag);
}

#[test]
fn honest_proxy_loads_with_a_secret() {
    let (mut a, mut b, memory) = through_proxy(Tamper::None);
    assert_eq!(
        common::settle(&mut b, common::key(0), WAIT),
        TierLookup::Hit
    );
    common::submit_load(&mut b, JobId(1), &[0, 1], 0, BYTES);
    let done = common::wait(&mut b, JobId(1), WAIT);
    assert!(done.is_success(), "{done:?}");
    common::expect_loaded(&*memory, &[0, 1], 0, BYTES);
    assert_eq!(b.stats().mac_failures, 0);
    a.shutdown();
    b.shutdown();
}

#[test]
fn hello_carries_no_namespace_with_a_secret() {
    // The server's HELLO, to a client that has not proven anything yet.
    let mut config = common::config(Vec::new());
    with_secret(&mut config);
    let mut a = P2pTier::new(config, memory()).expect("publisher starts");
    let mut raw = Raw::connect(a.local_addr());
    raw.send(&Raw::hello(b"", true));
    match raw.recv() {
        Ok(Frame::Hello(hello)) => {
            assert!(hello.secret_required);
            assert!(hello.namespace.is_empty(), "{hello:?}");
        }
        other => panic!("expected HELLO, got {other:?}"),
    }
    // The client's HELLO, to a server that has not proven anything yet.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut config = common::config(vec![listener.local_addr().expect("address")]);
    with_secret(&mut config);
    let mut b = P2pTier::new(config, memory()).expect("fetcher starts");
    listener.set_nonblocking(true).expect("nonblocking");
    let start = std::time::Instant::now();
    let stream = loop {
        let _ = b.lookup(common::key(0));
        b.poll(&mut Vec::new());
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(start.elapsed() < WAIT, "the fetcher never connected");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    stream.set_nonblocking(false).expect("blocking");
    let mut raw = Raw::new(stream);
    match raw.recv() {
        Ok(Frame::Hello(hello)) => {
            assert!(hello.secret_required);
            assert!(hello.namespace.is_empty(), "{hello:?}");
        }
        other => panic!("expected HELLO, got {other:?}"),
    }
    a.shutdown();
    b.shutdown();
}

#[test]
fn pushed_chunks_verify_with_a_secret_and_load_byte_identical() {
    // A pushes each chunk to its one owner among B and C (PUT, tagged over its digest); B then
    // loads all of them (its own pushed copies locally, the rest from A or C, which serves a
    // chunk it received by PUT) with every tag verified.
    let addrs: Vec<SocketAddr> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect::<Vec<_>>()
        .iter()
        .map(|l| l.local_addr().expect("address"))
        .collect();
    let mut tiers: Vec<(P2pTier, Arc<dyn SlotMemory>)> = addrs
        .iter()
        .map(|&listen| {
            let mut config = common::config(addrs.clone());
            config.listen = listen;
            config.owners = 1;
            with_secret(&mut config);
            let memory = memory();
            let tier = P2pTier::new(config, Arc::clone(&memory)).expect("tier starts");
            (tier, memory)
        })
        .collect();
    // Chunks no other test here loads: a push that reached another test's instance (a freed
    // port taken again) could not stand in for the bytes that test expects.
    let indices = [40, 41, 42, 43];
    let (a, published) = &mut tiers[0];
    let chunks = indices
        .iter()
        .enumerate()
        .map(|(n, &i)| {
            let slot = offload_core::SlotId(n as u32);
            tier_testkit::fill_slot(&**published, slot, BYTES as usize, common::seed(i));
            offload_core::tier::TierChunk::new(common::key(i), slot, BYTES)
        })
        .collect();
    a.submit(TierJob {
        id: JobId(7),
        request: None,
        op: TierOp::Store,
        chunks,
    })
    .expect("publish accepted");
    let done = common::wait(a, JobId(7), WAIT);
    assert!(done.is_success(), "{done:?}");
    common::eventually("every chunk pushed to its owner", WAIT, || {
        tiers[0].0.stats().chunks_pushed == 4
    });
    let received: u64 = tiers.iter().map(|(t, _)| t.stats().chunks_received).sum();
    assert_eq!(received, 4);
    assert_eq!(tiers[0].0.stats().push_failures, 0);
    let (b, fetched) = &mut tiers[1];
    for i in indices {
        assert_eq!(
            common::settle(b, common::key(i), WAIT),
            TierLookup::Hit,
            "chunk {i}"
        );
    }
    common::submit_load(b, JobId(1), &indices, 0, BYTES);
    let done = common::wait(b, JobId(1), WAIT);
    assert!(done.is_success(), "{done:?}");
    common::expect_loaded(&**fetched, &indices, 0, BYTES);
    for (tier, _) in &tiers {
        assert_eq!(tier.stats().mac_failures, 0);
    }
    for (tier, _) in &mut tiers {
        tier.shutdown();
    }
}
