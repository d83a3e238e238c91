//! Peers by name and by directory: sixteen instances on loopback that ask only each key's
//! owners and still find (and fetch, verified) every chunk any of them published; a peer named
//! `localhost:PORT`; a peer whose name does not resolve is down without failing the others.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use offload_core::tier::{SlotMemory, Tier, TierChunk, TierJob, TierLookup, TierOp};
use offload_core::{JobId, SlotId};
use tier_p2p::{P2pConfig, P2pTier, PeerAddr};

const BYTES: u32 = 16 * 1024;
const WAIT: Duration = Duration::from_secs(10);
const INSTANCES: usize = 16;
const CHUNKS_EACH: u64 = 4;

fn memory(slots: u32) -> Arc<dyn SlotMemory> {
    Arc::new(tier_testkit::VecSlotMemory::new(slots, BYTES as usize))
}

/// Publishes chunks `first..first + count` from slots `0..count`.
fn publish_range(tier: &mut P2pTier, memory: &Arc<dyn SlotMemory>, first: u64, count: u64) {
    let chunks = (0..count)
        .map(|n| {
            let slot = SlotId(n as u32);
            let i = first + n;
            tier_testkit::fill_slot(&**memory, slot, BYTES as usize, common::seed(i));
            TierChunk::new(common::key(i), slot, BYTES)
        })
        .collect();
    let id = JobId(500 + first);
    tier.submit(TierJob {
        id,
        request: None,
        op: TierOp::Store,
        chunks,
    })
    .expect("publish accepted");
    let done = common::wait(tier, id, WAIT);
    assert!(done.is_success(), "publish failed keys {:?}", done.failed);
}

/// Free loopback addresses (bound, then released) for instances that must know each other's
/// address before they start.
fn free_addrs(count: usize) -> Vec<SocketAddr> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("addr"))
        .collect()
}

#[test]
fn sixteen_instances_ask_only_owners_and_find_each_others_chunks() {
    let addrs = free_addrs(INSTANCES);
    let mut tiers = Vec::new();
    for &listen in &addrs {
        // Every instance gets the same list, itself included (it is recognised and left out).
        let mut config = common::config(addrs.clone());
        config.listen = listen;
        config.owners = 2;
        let memory = memory(8);
        let tier = P2pTier::new(config, Arc::clone(&memory)).expect("tier starts");
        assert_eq!(tier.peer_status().len(), INSTANCES - 1, "itself left out");
        tiers.push((tier, memory));
    }
    for (i, (tier, memory)) in tiers.iter_mut().enumerate() {
        publish_range(tier, memory, i as u64 * CHUNKS_EACH, CHUNKS_EACH);
    }
    // Each chunk goes to its two owners among the other fifteen.
    let pushes = INSTANCES as u64 * CHUNKS_EACH * 2;
    common::eventually("every chunk pushed to its owners", WAIT, || {
        tiers
            .iter()
            .map(|(t, _)| t.stats().chunks_pushed)
            .sum::<u64>()
            == pushes
    });
    let received: u64 = tiers.iter().map(|(t, _)| t.stats().chunks_received).sum();
    assert_eq!(received, pushes);
    assert!(tiers.iter().all(|(t, _)| t.stats().push_failures == 0));

    let total = INSTANCES as u64 * CHUNKS_EACH;
    for (j, (tier, memory)) in tiers.iter_mut().enumerate() {
        let own = j as u64 * CHUNKS_EACH..(j as u64 + 1) * CHUNKS_EACH;
        let others: Vec<u64> = (0..total).filter(|i| !own.contains(i)).collect();
        let before = tier.stats();
        for &i in &others {
            let answer = tier.lookup(common::key(i));
            assert_ne!(answer, TierLookup::Miss, "instance {j}, chunk {i}");
        }
        let mut out = Vec::new();
        tier.poll(&mut out);
        for &i in &others {
            let answer = common::settle(tier, common::key(i), WAIT);
            assert_eq!(answer, TierLookup::Hit, "instance {j}, chunk {i}");
        }
        let after = tier.stats();
        let asked = after.lookup_keys_asked - before.lookup_keys_asked;
        let looked_up = others.len() as u64;
        // Only the keys not held here were asked (a pushed copy answers locally), each of at
        // most its 2 owners: not of the 15 peers.
        assert!(
            asked <= 2 * looked_up,
            "instance {j}: {asked} keys asked for {looked_up} lookups"
        );
        let haves = after.have_requests - before.have_requests;
        assert!(
            haves <= (INSTANCES as u64 - 1),
            "instance {j}: {haves} HAVEs (one per owner at most)"
        );
        // Load chunks the next instance published, straight from whoever holds them.
        let from = ((j + 1) % INSTANCES) as u64 * CHUNKS_EACH;
        let wanted: Vec<u64> = (from..from + CHUNKS_EACH).collect();
        let id = JobId(9000 + j as u64);
        common::submit_load(tier, id, &wanted, 4, BYTES);
        let done = common::wait(tier, id, WAIT);
        assert!(done.is_success(), "instance {j}: {done:?}");
        common::expect_loaded(&**memory, &wanted, 4, BYTES);
    }
    let asked: u64 = tiers.iter().map(|(t, _)| t.stats().lookup_keys_asked).sum();
    let lookups = (INSTANCES as u64) * (total - CHUNKS_EACH);
    assert!(
        asked <= 2 * lookups,
        "{asked} keys asked for {lookups} lookups"
    );
    assert!(tiers
        .iter()
        .all(|(t, _)| t.stats().checksum_mismatches == 0 && t.stats().peer_failures == 0));
}

fn instance(
    peers: Vec<PeerAddr>,
    edit: impl FnOnce(&mut P2pConfig),
) -> (P2pTier, Arc<dyn SlotMemory>) {
    let mut config = common::config(Vec::new());
    config.peers = peers;
    edit(&mut config);
    let memory = memory(8);
    let tier = P2pTier::new(config, Arc::clone(&memory)).expect("tier starts");
    (tier, memory)
}

#[test]
fn a_peer_named_localhost_is_found_and_fetched_from() {
    let (mut a, a_memory) = instance(Vec::new(), |_| {});
    publish_range(&mut a, &a_memory, 0, 2);
    let name: PeerAddr = format!("localhost:{}", a.local_addr().port())
        .parse()
        .expect("host:port");
    assert!(matches!(name, PeerAddr::Name { .. }));
    let (mut b, memory) = instance(vec![name], |_| {});
    assert_eq!(
        common::settle(&mut b, common::key(1), WAIT),
        TierLookup::Hit
    );
    common::submit_load(&mut b, JobId(1), &[0, 1], 2, BYTES);
    let done = common::wait(&mut b, JobId(1), WAIT);
    assert!(done.is_success(), "{done:?}");
    common::expect_loaded(&*memory, &[0, 1], 2, BYTES);
    let status = &b.peer_status()[0];
    assert!(status.connected, "{status:?}");
    assert!(
        status.addr.is_some_and(|addr| addr.ip().is_loopback()),
        "{status:?}"
    );
}

#[test]
fn a_name_that_does_not_resolve_is_a_down_peer_not_a_failure() {
    // A peer name other than localhost may resolve beyond loopback: it needs a secret.
    let secret = |c: &mut P2pConfig| c.secret = Some(b"a shared secret, 16+ bytes".to_vec());
    let (mut a, a_memory) = instance(Vec::new(), secret);
    publish_range(&mut a, &a_memory, 0, 2);
    let unknown: PeerAddr = "no-such-peer.invalid:7071".parse().expect("host:port");
    let known: PeerAddr = format!("localhost:{}", a.local_addr().port())
        .parse()
        .expect("host:port");
    // Two members, two owners: every key is asked of both.
    let (mut b, memory) = instance(vec![unknown.clone(), known.clone()], |c| {
        c.owners = 2;
        secret(c);
    });
    assert_eq!(
        common::settle(&mut b, common::key(0), WAIT),
        TierLookup::Hit
    );
    common::submit_load(&mut b, JobId(1), &[0, 1], 2, BYTES);
    let done = common::wait(&mut b, JobId(1), WAIT);
    assert!(done.is_success(), "{done:?}");
    common::expect_loaded(&*memory, &[0, 1], 2, BYTES);
    let status = b.peer_status();
    let down = status.iter().find(|s| s.peer == unknown).expect("listed");
    assert!(
        !down.connected && down.consecutive_failures >= 1,
        "{down:?}"
    );
    let error = down.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains("resolve no-such-peer.invalid:7071"),
        "{error}"
    );
    let up = status.iter().find(|s| s.peer == known).expect("listed");
    assert!(up.connected, "{up:?}");
    assert!(b.stats().peer_failures >= 1);
}
