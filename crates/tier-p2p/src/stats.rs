//! Counters the tier's threads update and the snapshot callers read
//! ([`P2pStats`]), plus each peer's connection state ([`PeerStatus`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::peer::PeerAddr;

/// A snapshot of the tier's counters (all since creation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct P2pStats {
    /// Chunks published now.
    pub published_chunks: u64,
    /// Bytes published now.
    pub published_bytes: u64,
    /// Published chunks evicted to make room.
    pub evictions: u64,
    /// HAVE requests sent (one per peer and lookup batch).
    pub have_requests: u64,
    /// Keys sent to peers in HAVE requests (one per key and peer).
    pub lookup_keys_asked: u64,
    /// The most peers any one key was asked about in one lookup (its HAVE fan-out): at most
    /// `owners` with a directory, every other member with `owners = 0`.
    pub lookup_peers_per_key_max: u64,
    /// Lookups answered `Hit` from a peer's reply.
    pub lookup_hits: u64,
    /// Lookups answered `Miss` from the peers' replies.
    pub lookup_misses: u64,
    /// Lookups answered `Miss` because the replies did not come within `lookup_deadline`.
    pub lookup_timeouts: u64,
    /// Chunks fetched from peers and verified.
    pub chunks_fetched: u64,
    /// Bytes fetched from peers and verified.
    pub bytes_fetched: u64,
    /// Of `chunks_fetched`, those whose bytes came by NIXL READ (feature `nixl`).
    pub chunks_fetched_nixl: u64,
    /// Chunks this instance's server offered for a NIXL READ (feature `nixl`).
    pub chunks_offered_nixl: u64,
    /// NIXL READs whose job stopped (cancel, shutdown, deadline) and that NIXL still called
    /// active after the stop grace: their jobs' slots are quarantined (the job completes only
    /// when NIXL ends the READ, so the host pool never reuses a slot a NIC may still write).
    pub nixl_reads_quarantined: u64,
    /// Of `nixl_reads_quarantined`, those that NIXL ended later (their jobs then completed).
    pub nixl_reads_unquarantined: u64,
    /// Chunks pushed to their keys' owners after a publish (PUT answered as stored).
    pub chunks_pushed: u64,
    /// Pushes that failed or were refused, or not sent because the queue was full.
    pub push_failures: u64,
    /// Chunks of push batches still queued at shutdown, skipped (pushes are best effort), so
    /// that a shutdown waits for at most the push under way, not every queued one.
    pub pushes_skipped_at_shutdown: u64,
    /// Chunks peers pushed here (PUT) and this instance stored.
    pub chunks_received: u64,
    /// Chunks this instance's server sent.
    pub chunks_served: u64,
    /// Bytes this instance's server sent.
    pub bytes_served: u64,
    /// Chunks whose bytes did not match their checksum (never loaded).
    pub checksum_mismatches: u64,
    /// Of `checksum_mismatches`, those on a connection with a shared secret: chunks whose keyed
    /// tag did not verify (a peer or the path altered them, or a peer without the session key).
    pub mac_failures: u64,
    /// Keys of load jobs that failed.
    pub load_keys_failed: u64,
    /// Times a peer was marked down after a failure.
    pub peer_failures: u64,
    /// Handshakes refused, by either side (version, namespace, secret).
    pub handshakes_refused: u64,
    /// Connections the server refused because `connections_max` were open.
    pub connections_refused_busy: u64,
    /// Served connections closed because of a malformed or oversized frame.
    pub frames_rejected: u64,
    /// Bookkeeping invariants broken at the I/O edge (a chunk then fails, never loaded wrong;
    /// the tier's job book refusing a completion): only without strict invariants (release
    /// builds); strict mode (debug builds) panics.
    pub invariant_failures: u64,
}

/// The live counters behind [`P2pStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) evictions: AtomicU64,
    pub(crate) have_requests: AtomicU64,
    pub(crate) lookup_keys_asked: AtomicU64,
    pub(crate) lookup_peers_per_key_max: AtomicU64,
    pub(crate) lookup_hits: AtomicU64,
    pub(crate) lookup_misses: AtomicU64,
    pub(crate) lookup_timeouts: AtomicU64,
    pub(crate) chunks_fetched: AtomicU64,
    pub(crate) bytes_fetched: AtomicU64,
    pub(crate) chunks_fetched_nixl: AtomicU64,
    pub(crate) chunks_offered_nixl: AtomicU64,
    pub(crate) nixl_reads_quarantined: AtomicU64,
    pub(crate) nixl_reads_unquarantined: AtomicU64,
    pub(crate) chunks_pushed: AtomicU64,
    pub(crate) push_failures: AtomicU64,
    pub(crate) pushes_skipped_at_shutdown: AtomicU64,
    pub(crate) chunks_received: AtomicU64,
    pub(crate) chunks_served: AtomicU64,
    pub(crate) bytes_served: AtomicU64,
    pub(crate) checksum_mismatches: AtomicU64,
    pub(crate) mac_failures: AtomicU64,
    pub(crate) load_keys_failed: AtomicU64,
    pub(crate) peer_failures: AtomicU64,
    pub(crate) handshakes_refused: AtomicU64,
    pub(crate) connections_refused_busy: AtomicU64,
    pub(crate) frames_rejected: AtomicU64,
    pub(crate) invariant_failures: AtomicU64,
}

/// Adds `n` to a counter.
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    /// Counts a chunk that failed its tag (`keyed`: on a connection with a shared secret).
    pub(crate) fn tag_failed(&self, keyed: bool) {
        add(&self.checksum_mismatches, 1);
        if keyed {
            add(&self.mac_failures, 1);
        }
    }

    /// A snapshot, with the store's current size.
    pub(crate) fn snapshot(&self, published_chunks: u64, published_bytes: u64) -> P2pStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        P2pStats {
            published_chunks,
            published_bytes,
            evictions: get(&self.evictions),
            have_requests: get(&self.have_requests),
            lookup_keys_asked: get(&self.lookup_keys_asked),
            lookup_peers_per_key_max: get(&self.lookup_peers_per_key_max),
            lookup_hits: get(&self.lookup_hits),
            lookup_misses: get(&self.lookup_misses),
            lookup_timeouts: get(&self.lookup_timeouts),
            chunks_fetched: get(&self.chunks_fetched),
            bytes_fetched: get(&self.bytes_fetched),
            chunks_fetched_nixl: get(&self.chunks_fetched_nixl),
            chunks_offered_nixl: get(&self.chunks_offered_nixl),
            nixl_reads_quarantined: get(&self.nixl_reads_quarantined),
            nixl_reads_unquarantined: get(&self.nixl_reads_unquarantined),
            chunks_pushed: get(&self.chunks_pushed),
            push_failures: get(&self.push_failures),
            pushes_skipped_at_shutdown: get(&self.pushes_skipped_at_shutdown),
            chunks_received: get(&self.chunks_received),
            chunks_served: get(&self.chunks_served),
            bytes_served: get(&self.bytes_served),
            checksum_mismatches: get(&self.checksum_mismatches),
            mac_failures: get(&self.mac_failures),
            load_keys_failed: get(&self.load_keys_failed),
            peer_failures: get(&self.peer_failures),
            handshakes_refused: get(&self.handshakes_refused),
            connections_refused_busy: get(&self.connections_refused_busy),
            frames_rejected: get(&self.frames_rejected),
            invariant_failures: get(&self.invariant_failures),
        }
    }
}

/// One current member as the client side sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerStatus {
    /// The peer as the directory names it.
    pub peer: PeerAddr,
    /// The address it was last connected at (resolved from `peer`), if ever.
    pub addr: Option<SocketAddr>,
    /// Whether a handshaken connection is open now.
    pub connected: bool,
    /// Failures since the last success (0 when healthy); it is retried after a backoff that
    /// doubles with each.
    pub consecutive_failures: u32,
    /// The last error, naming the operation (kept after recovery, for diagnosis).
    pub last_error: Option<String>,
}
