//! Runs the `Tier` conformance suite against `FakeTier` in several configurations: no delay,
//! completion delays, out-of-order completions, `Retry` lookups, and a small bounded queue.

use std::collections::BTreeMap;

use offload_core::JobId;
use tier_testkit::{FakeTierConfig, FaultPlan};

/// A `FakeTierConfig` builder for the configurations below.
fn config(delay: u32, retries: u32, in_flight_max: usize) -> FakeTierConfig {
    FakeTierConfig {
        completion_delay_polls: delay,
        lookup_retry_count: retries,
        jobs_in_flight_max: in_flight_max,
        ..FakeTierConfig::default()
    }
}

mod no_delay {
    tier_testkit::tier_conformance_tests!(|memory| {
        Box::new(tier_testkit::FakeTier::new(
            memory,
            tier_testkit::FakeTierConfig::default(),
        ))
    });
}

mod completion_delay {
    tier_testkit::tier_conformance_tests!(|memory| {
        Box::new(tier_testkit::FakeTier::new(
            memory,
            super::config(5, 0, 1024),
        ))
    });
}

mod retry_lookups {
    tier_testkit::tier_conformance_tests!(|memory| {
        Box::new(tier_testkit::FakeTier::new(
            memory,
            super::config(1, 3, 1024),
        ))
    });
}

mod bounded_queue {
    tier_testkit::tier_conformance_tests!(|memory| {
        Box::new(tier_testkit::FakeTier::new(memory, super::config(2, 1, 3)))
    });
}

/// Even job ids complete long after odd ones, so completions arrive out of submission order.
fn out_of_order_config() -> FakeTierConfig {
    let job_delay_polls: BTreeMap<JobId, u32> = (0..4096u64)
        .filter(|id| id % 2 == 0)
        .map(|id| (JobId(id), 7))
        .collect();
    FakeTierConfig {
        faults: FaultPlan {
            job_delay_polls,
            ..FaultPlan::default()
        },
        ..FakeTierConfig::default()
    }
}

mod out_of_order {
    tier_testkit::tier_conformance_tests!(|memory| {
        Box::new(tier_testkit::FakeTier::new(
            memory,
            super::out_of_order_config(),
        ))
    });
}

mod small_config {
    use std::time::Duration;

    use tier_testkit::conformance::{vec_memory, SuiteConfig};

    const SMALL: SuiteConfig = SuiteConfig {
        slot_count: 24,
        slot_bytes: 16,
        deadline: Duration::from_secs(5),
        new_memory: vec_memory,
    };

    tier_testkit::tier_conformance_tests!(
        |memory| Box::new(tier_testkit::FakeTier::new(
            memory,
            super::config(1, 1, 1024)
        )),
        SMALL
    );
}

#[test]
fn run_all_passes_for_the_fake() {
    tier_testkit::conformance::run_all(|memory| {
        Box::new(tier_testkit::FakeTier::new(memory, config(3, 2, 8)))
    });
}
