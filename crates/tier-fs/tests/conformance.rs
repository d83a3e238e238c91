//! The `Tier` conformance suite against the disk tier: with the io_uring engine, with the plain
//! syscall engine, and with shared-directory probing (lookups answer `Retry` before `Miss`).

mod common;

use std::sync::Arc;

use common::OwnedDirTier;
use offload_core::tier::{SlotMemory, Tier};
use tier_fs::EngineChoice;

/// A tier in its own directory; io_uring is replaced by the sync engine where it is unavailable
/// (the sentinel test below then says so).
fn make(memory: Arc<dyn SlotMemory>, engine: EngineChoice, shared: bool) -> Box<dyn Tier> {
    let engine = match engine {
        EngineChoice::Uring if !common::uring_available() => EngineChoice::Sync,
        other => other,
    };
    Box::new(OwnedDirTier::new(memory, |c| tier_fs::FsTierConfig {
        engine,
        shared_dir: shared,
        ..c
    }))
}

/// With io_uring (the sync engine where io_uring is unavailable; the sentinel below says so).
mod uring {
    tier_testkit::tier_conformance_tests!(|memory| super::make(
        memory,
        tier_fs::EngineChoice::Uring,
        false
    ));
}

/// With the plain-syscall engine.
mod sync {
    tier_testkit::tier_conformance_tests!(|memory| super::make(
        memory,
        tier_fs::EngineChoice::Sync,
        false
    ));
}

/// With the plain-syscall engine and shared-directory probes.
mod sync_shared_dir {
    tier_testkit::tier_conformance_tests!(|memory| super::make(
        memory,
        tier_fs::EngineChoice::Sync,
        true
    ));
}

#[test]
fn uring_conformance_ran_on_io_uring() {
    if !common::uring_available() {
        eprintln!(
            "WARNING: io_uring is unavailable here; the `uring` conformance cases ran on the \
             sync engine"
        );
    }
}
