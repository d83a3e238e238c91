//! The `Tier` conformance suite against the peer tier, in two shapes.
//!
//! * `single`: one instance without peers. `Store` publishes into its own store and `Load`
//!   copies from there: the job bookkeeping (exactly one completion, cancel, drain, shutdown,
//!   refusals) without the network.
//! * `pair`: two instances over the same host pool, where `Store` goes to the publisher and
//!   `lookup`/`Load` go to the fetcher, whose only peer is the publisher. Every round trip of the
//!   suite then crosses TCP: HAVE for lookups, GET/DATA for loads, verified by checksum. The
//!   fetcher reuses no answer (`lookup_cache_ttl` 0), so a key stored after a `Miss` is found.

mod common;

use std::sync::Arc;

use offload_core::event::Medium;
use offload_core::tier::{
    SlotMemory, SubmitError, Tier, TierCompletion, TierJob, TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobId, RequestId};
use tier_p2p::P2pTier;

/// One instance without peers.
fn single(memory: Arc<dyn SlotMemory>) -> Box<dyn Tier> {
    Box::new(P2pTier::new(common::config(Vec::new()), memory).expect("tier starts"))
}

/// A publisher and a fetcher that reaches it over loopback TCP, seen as one tier.
struct Pair {
    publisher: P2pTier,
    fetcher: P2pTier,
}

fn pair(memory: Arc<dyn SlotMemory>) -> Box<dyn Tier> {
    let publisher =
        P2pTier::new(common::config(Vec::new()), Arc::clone(&memory)).expect("publisher starts");
    let peers = vec![publisher.local_addr()];
    let fetcher = P2pTier::new(common::config(peers), memory).expect("fetcher starts");
    Box::new(Pair { publisher, fetcher })
}

impl Tier for Pair {
    fn name(&self) -> &str {
        "p2p-pair"
    }

    fn medium(&self) -> Medium {
        Medium::Peer
    }

    fn lookup(&mut self, key: ChunkKey) -> TierLookup {
        self.fetcher.lookup(key)
    }

    fn touch(&mut self, keys: &[ChunkKey]) {
        self.publisher.touch(keys);
        self.fetcher.touch(keys);
    }

    fn submit(&mut self, job: TierJob) -> Result<(), SubmitError> {
        match job.op {
            TierOp::Store => self.publisher.submit(job),
            TierOp::Load => self.fetcher.submit(job),
        }
    }

    fn poll(&mut self, out: &mut Vec<TierCompletion>) {
        self.publisher.poll(out);
        self.fetcher.poll(out);
    }

    fn cancel(&mut self, id: JobId) {
        self.publisher.cancel(id);
        self.fetcher.cancel(id);
    }

    fn drain(&mut self) {
        self.publisher.drain();
        self.fetcher.drain();
    }

    fn on_request_finished(&mut self, request: RequestId) {
        self.publisher.on_request_finished(request);
        self.fetcher.on_request_finished(request);
    }

    fn shutdown(&mut self) {
        self.fetcher.shutdown();
        self.publisher.shutdown();
    }
}

mod single_instance {
    tier_testkit::tier_conformance_tests!(super::single);
}

mod pair_over_tcp {
    tier_testkit::tier_conformance_tests!(super::pair);
}

/// The pair really fetches over TCP: after a suite-like round trip, the fetcher's counters show
/// chunks fetched and the publisher's show them served.
#[test]
fn pair_round_trip_crosses_the_network() {
    let memory: Arc<dyn SlotMemory> = Arc::new(tier_testkit::VecSlotMemory::new(8, 4096));
    let mut publisher =
        P2pTier::new(common::config(Vec::new()), Arc::clone(&memory)).expect("publisher");
    let mut fetcher = P2pTier::new(
        common::config(vec![publisher.local_addr()]),
        Arc::clone(&memory),
    )
    .expect("fetcher");
    common::publish(&mut publisher, &memory, 2, 4096);
    assert_eq!(
        common::settle(
            &mut fetcher,
            common::key(0),
            std::time::Duration::from_secs(5)
        ),
        TierLookup::Hit
    );
    common::submit_load(&mut fetcher, JobId(1), &[0, 1], 4, 4096);
    let done = common::wait(&mut fetcher, JobId(1), std::time::Duration::from_secs(5));
    assert!(done.is_success(), "{done:?}");
    common::expect_loaded(&*memory, &[0, 1], 4, 4096);
    assert_eq!(fetcher.stats().chunks_fetched, 2);
    assert_eq!(publisher.stats().chunks_served, 2);
    assert!(fetcher.stats().lookup_keys_asked >= 1);
}
