//! Who the peers are now ([`PeerDirectory`]: [`StaticPeers`], [`DnsPeers`]) and which of them
//! own a key ([`owners`], rendezvous hashing).
//!
//! Rendezvous (highest-random-weight) hashing: each member gets a weight for each key, a hash of
//! the key and the member's name; a key's owners are the `n` members of highest weight. Every
//! instance that sees the same members picks the same owners, with no coordination, and a
//! member that joins or leaves changes the owners of only the keys it owns (there, or before).

use std::net::SocketAddr;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use offload_core::ChunkKey;

use crate::error::P2pError;
use crate::peer::PeerAddr;
use crate::shared::{lock, log, spawn};

/// The source of the current member set.
///
/// `members` is called by the tier's client worker before each lookup batch, load and push, and
/// must answer at once from what it already knows (no network I/O or name resolution on the
/// caller's thread: a directory that learns members from the network does so on its own
/// thread). It returns at most `members_max` members (more are ignored); this instance may be
/// among them (it is recognised and left out).
pub trait PeerDirectory: Send {
    /// The members now.
    fn members(&self) -> Vec<PeerAddr>;
}

/// A fixed list: the configured `peers`.
#[derive(Clone, Debug)]
pub struct StaticPeers {
    peers: Vec<PeerAddr>,
}

impl StaticPeers {
    /// The directory of exactly `peers`.
    pub fn new(peers: Vec<PeerAddr>) -> Self {
        Self { peers }
    }
}

impl PeerDirectory for StaticPeers {
    fn members(&self) -> Vec<PeerAddr> {
        self.peers.clone()
    }
}

/// Every address a DNS name resolves to (a headless service, a round-robin record), each at the
/// name's port, re-resolved every `interval` on a background thread. Until the first resolution
/// succeeds the set is empty; a failed re-resolution keeps the last good set (and logs).
pub struct DnsPeers {
    members: Arc<Mutex<Vec<PeerAddr>>>,
    /// Dropping it wakes and ends the resolver thread.
    _stop: mpsc::Sender<()>,
}

impl DnsPeers {
    /// Starts resolving `name` now and every `interval`; each resolution may take up to
    /// `resolve_timeout`.
    pub fn start(
        name: PeerAddr,
        interval: Duration,
        resolve_timeout: Duration,
    ) -> Result<Self, P2pError> {
        let members = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = mpsc::channel::<()>();
        let shared = Arc::clone(&members);
        spawn(format!("p2p-dns-{name}"), move || loop {
            match name.resolve(resolve_timeout) {
                Ok(addrs) => *lock(&shared) = member_set(addrs),
                Err(error) => log(format_args!(
                    "peer directory: resolving {name} failed ({error}); keeping the last members"
                )),
            }
            match stopped.recv_timeout(interval) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            }
        })?;
        Ok(Self {
            members,
            _stop: stop,
        })
    }
}

impl PeerDirectory for DnsPeers {
    fn members(&self) -> Vec<PeerAddr> {
        lock(&self.members).clone()
    }
}

/// Resolved addresses as a member set: sorted, without duplicates.
fn member_set(mut addrs: Vec<SocketAddr>) -> Vec<PeerAddr> {
    addrs.sort();
    addrs.dedup();
    addrs.into_iter().map(PeerAddr::Ip).collect()
}

/// A member's identity for hashing: its address as text (every instance must name a member the
/// same way for them to agree on owners).
pub fn member_id(member: &PeerAddr) -> u64 {
    twox_hash::XxHash3_64::oneshot(member.to_string().as_bytes())
}

/// The weight of member `id` for `key`.
fn weight(key: ChunkKey, id: u64) -> u64 {
    let mut bytes = [0u8; 20];
    bytes[..16].copy_from_slice(&key.hash.to_le_bytes());
    bytes[16..].copy_from_slice(&key.group.to_le_bytes());
    twox_hash::XxHash3_64::oneshot_with_seed(id, &bytes)
}

/// The indexes (into `ids`) of the `n` members of highest weight for `key`, highest first.
/// Ties (equal weights) go to the smaller id, so the answer does not depend on order.
pub fn owners(key: ChunkKey, ids: &[u64], n: usize) -> Vec<usize> {
    let mut top: Vec<(u64, u64, usize)> = Vec::with_capacity(n + 1);
    for (i, &id) in ids.iter().enumerate() {
        let entry = (weight(key, id), u64::MAX - id, i);
        if top.len() == n && top.last().is_some_and(|last| *last >= entry) {
            continue;
        }
        let at = top.partition_point(|t| *t > entry);
        top.insert(at, entry);
        top.truncate(n);
    }
    top.into_iter().map(|(_, _, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn members(count: u16) -> Vec<PeerAddr> {
        (0..count)
            .map(|i| PeerAddr::Ip(SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8], 7071))))
            .collect()
    }

    fn owner_names(key: ChunkKey, members: &[PeerAddr], n: usize) -> Vec<PeerAddr> {
        let ids: Vec<u64> = members.iter().map(member_id).collect();
        let mut names: Vec<PeerAddr> = owners(key, &ids, n)
            .into_iter()
            .map(|i| members[i].clone())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn owners_are_distinct_ordered_and_independent_of_member_order() {
        let set = members(16);
        let mut reversed = set.clone();
        reversed.reverse();
        for k in 0..1000 {
            let key = ChunkKey::new(k * 0x9E37_79B9, (k % 3) as u32);
            let a = owner_names(key, &set, 3);
            assert_eq!(a.len(), 3);
            assert_eq!(a, owner_names(key, &reversed, 3));
            let mut dedup = a.clone();
            dedup.dedup();
            assert_eq!(dedup, a);
        }
        assert!(owners(ChunkKey::new(1, 0), &[], 2).is_empty());
        assert_eq!(owners(ChunkKey::new(1, 0), &[7], 2), vec![0]);
    }

    #[test]
    fn owners_spread_evenly() {
        let set = members(16);
        let ids: Vec<u64> = set.iter().map(member_id).collect();
        let mut load = vec![0usize; set.len()];
        let keys = 16_000u64;
        for k in 0..keys {
            for i in owners(ChunkKey::new(u128::from(k), 0), &ids, 2) {
                load[i] += 1;
            }
        }
        // 2000 each on average.
        assert!(load.iter().all(|&l| (1600..=2400).contains(&l)), "{load:?}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Adding one member to N changes the owners only of keys that the new member now owns
        /// (it replaces exactly one old owner there), which is about `n / (N + 1)` of the keys.
        /// Removing a member is the same change read backwards.
        #[test]
        fn one_member_joining_moves_only_its_keys(count in 3u16..40, n in 1usize..=3, salt in any::<u64>()) {
            let before: Vec<u64> = members(count).iter().map(member_id).collect();
            let joined = member_id(&PeerAddr::Ip(SocketAddr::from(([10, 9, 9, 9], 7071))));
            let mut after = before.clone();
            after.push(joined);
            let owned = |ids: &[u64], key| {
                let mut o: Vec<u64> = owners(key, ids, n).into_iter().map(|i| ids[i]).collect();
                o.sort_unstable();
                o
            };
            let keys = 3000u64;
            let mut moved = 0u64;
            for k in 0..keys {
                let key = ChunkKey::new(u128::from(k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt) << 64 | u128::from(k), 0);
                let old = owned(&before, key);
                let new = owned(&after, key);
                if old == new {
                    prop_assert!(!new.contains(&joined));
                    continue;
                }
                moved += 1;
                prop_assert!(new.contains(&joined), "a key moved without involving the new member");
                let kept = old.iter().filter(|o| new.contains(o)).count();
                prop_assert_eq!(kept, n.min(count as usize) - 1, "more than one owner replaced");
            }
            let expected = keys as f64 * n as f64 / (f64::from(count) + 1.0);
            let moved = moved as f64;
            prop_assert!(moved > expected * 0.5 && moved < expected * 1.5,
                "moved {} keys, expected about {}", moved, expected);
        }
    }

    #[test]
    fn dns_peers_resolves_localhost_in_the_background() {
        let name: PeerAddr = "localhost:7071".parse().expect("name");
        let dns = DnsPeers::start(name, Duration::from_millis(20), Duration::from_secs(2))
            .expect("starts");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let found = loop {
            let found = dns.members();
            if !found.is_empty() || std::time::Instant::now() > deadline {
                break found;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(!found.is_empty(), "localhost did not resolve within 5 s");
        assert!(found.iter().all(|m| m
            .ip()
            .is_some_and(|a| a.ip().is_loopback() && a.port() == 7071)));
    }
}
