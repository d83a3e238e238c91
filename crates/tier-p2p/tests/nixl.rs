//! The NIXL data plane, when it can run: two instances in this process, host to host over NIXL's
//! UCX backend; B loads chunks that A published, the bytes moved by NIXL READ into B's slots and
//! verified by checksum; and the TCP fallbacks (NIXL off on either side). Without the `nixl`
//! feature or the NIXL library (see `tier_p2p::nixl::LIB_DIR_ENV`), the one test here says
//! loudly that these checks did not run.

mod common;

#[test]
fn nixl_tests_ran_or_report_why_not() {
    match why_not() {
        Ok(()) => run_checks(),
        Err(reason) => {
            // Written to the process's stderr directly, not through eprintln!, so that the test
            // harness's output capture does not hide it from the CI log.
            use std::io::Write;
            let line = "==================================================================";
            let _ = writeln!(
                std::io::stderr(),
                "\n{line}\nNIXL tests NOT RUN: {reason}\n{line}"
            );
        }
    }
}

#[cfg(feature = "nixl")]
fn run_checks() {
    eprintln!("NIXL available: running tier-p2p's NIXL data-plane checks");
    checks::fetch_over_nixl_lands_verified_bytes_in_the_slots();
    checks::fetcher_with_nixl_off_uses_tcp();
    checks::server_with_nixl_off_makes_the_fetcher_fall_back_to_tcp();
    checks::a_mismatched_length_is_not_loaded_and_the_rest_is();
}

/// Never called: without the feature, `why_not` always says why not.
#[cfg(not(feature = "nixl"))]
fn run_checks() {}

#[cfg(not(feature = "nixl"))]
fn why_not() -> Result<(), String> {
    Err("tier-p2p built without the `nixl` feature".into())
}

#[cfg(feature = "nixl")]
fn why_not() -> Result<(), String> {
    tier_p2p::nixl::available()
}

#[cfg(feature = "nixl")]
mod checks {
    use std::sync::Arc;
    use std::time::Duration;

    use offload_core::tier::{SlotMemory, Tier};
    use offload_core::JobId;
    use tier_p2p::bench::FlatSlotMemory;
    use tier_p2p::P2pTier;

    use super::common;

    const LEN: u32 = 256 * 1024 + 3;
    const DEADLINE: Duration = Duration::from_secs(20);

    struct Pair {
        a: P2pTier,
        b: P2pTier,
        b_memory: Arc<dyn SlotMemory>,
    }

    /// A publishes `count` chunks; B (with stable slot addresses) has A as its peer.
    fn pair(count: u64, a_nixl: bool, b_nixl: bool) -> Pair {
        let a_memory: Arc<dyn SlotMemory> =
            Arc::new(FlatSlotMemory::new(count as u32, LEN as usize));
        let mut a_config = common::config(Vec::new());
        a_config.nixl = a_nixl;
        let mut a = P2pTier::new(a_config, Arc::clone(&a_memory)).expect("instance A");
        common::publish(&mut a, &a_memory, count, LEN);
        let b_memory: Arc<dyn SlotMemory> =
            Arc::new(FlatSlotMemory::new(count as u32, LEN as usize));
        let mut b_config = common::config(vec![a.local_addr()]);
        b_config.nixl = b_nixl;
        b_config.fetch_deadline = DEADLINE;
        let b = P2pTier::new(b_config, Arc::clone(&b_memory)).expect("instance B");
        Pair { a, b, b_memory }
    }

    fn load(pair: &mut Pair, id: u64, indices: &[u64]) {
        common::submit_load(&mut pair.b, JobId(id), indices, 0, LEN);
        let done = common::wait(&mut pair.b, JobId(id), DEADLINE);
        assert!(done.is_success(), "load {id} failed keys {:?}", done.failed);
        common::expect_loaded(&*pair.b_memory, indices, 0, LEN);
    }

    pub fn fetch_over_nixl_lands_verified_bytes_in_the_slots() {
        let mut pair = pair(6, true, true);
        load(&mut pair, 1, &[0, 1, 2, 3, 4, 5]);
        let (a, b) = (pair.a.stats(), pair.b.stats());
        assert_eq!(b.chunks_fetched, 6, "{b:?}");
        assert_eq!(
            b.chunks_fetched_nixl, 6,
            "bytes did not move by NIXL: {b:?}"
        );
        assert_eq!(a.chunks_offered_nixl, 6, "{a:?}");
        assert_eq!(
            a.chunks_served, 0,
            "nothing should go over the TCP stream: {a:?}"
        );
        assert_eq!(b.checksum_mismatches, 0);
        // A second load of other slots' worth reuses the registrations and the loaded metadata.
        load(&mut pair, 2, &[5, 4, 3]);
        assert_eq!(pair.b.stats().chunks_fetched_nixl, 9);
        pair.a.shutdown();
        pair.b.shutdown();
    }

    pub fn fetcher_with_nixl_off_uses_tcp() {
        let mut pair = pair(3, true, false);
        load(&mut pair, 1, &[0, 1, 2]);
        let (a, b) = (pair.a.stats(), pair.b.stats());
        assert_eq!(b.chunks_fetched, 3);
        assert_eq!(b.chunks_fetched_nixl, 0, "{b:?}");
        assert_eq!(a.chunks_served, 3, "{a:?}");
        pair.a.shutdown();
        pair.b.shutdown();
    }

    pub fn server_with_nixl_off_makes_the_fetcher_fall_back_to_tcp() {
        let mut pair = pair(3, false, true);
        load(&mut pair, 1, &[2, 0, 1]);
        let (a, b) = (pair.a.stats(), pair.b.stats());
        assert_eq!(b.chunks_fetched, 3);
        assert_eq!(b.chunks_fetched_nixl, 0, "{b:?}");
        assert_eq!(a.chunks_offered_nixl, 0, "{a:?}");
        assert_eq!(a.chunks_served, 3, "{a:?}");
        assert_eq!(b.peer_failures, 0, "the fallback is not a failure: {b:?}");
        pair.a.shutdown();
        pair.b.shutdown();
    }

    pub fn a_mismatched_length_is_not_loaded_and_the_rest_is() {
        let mut pair = pair(3, true, true);
        // Ask for chunk 1 with a shorter length than A published: the offer's length differs,
        // so it is not READ; chunks 0 and 2 are.
        let id = JobId(7);
        let chunks = vec![
            (common::key(0), offload_core::SlotId(0), LEN),
            (common::key(1), offload_core::SlotId(1), LEN - 1),
            (common::key(2), offload_core::SlotId(2), LEN),
        ];
        pair.b
            .submit(offload_core::tier::TierJob {
                id,
                request: None,
                op: offload_core::tier::TierOp::Load,
                chunks,
            })
            .expect("load accepted");
        let done = common::wait(&mut pair.b, id, DEADLINE);
        assert_eq!(done.failed, vec![common::key(1)]);
        let b = pair.b.stats();
        assert_eq!(b.chunks_fetched_nixl, 2, "{b:?}");
        for i in [0u64, 2] {
            common::expect_loaded(&*pair.b_memory, &[i], i as u32, LEN);
        }
        pair.a.shutdown();
        pair.b.shutdown();
    }
}
