//! The `Tier` conformance suite against the object tier, over object_store's in-memory backend
//! and its local-file-system backend (each case in a fresh temporary directory). The test
//! configuration's multipart threshold lies inside the suite's slot size, so full chunks go
//! through multipart uploads and partial ones through single puts.

mod common;

/// Over object_store's in-memory backend.
mod memory {
    tier_testkit::tier_conformance_tests!(|memory| {
        let store = tier_obj::Backend::Memory.open().expect("memory store");
        Box::new(super::common::tier(super::common::config(), store, memory))
    });
}

/// Over object_store's local-file-system backend.
mod local {
    tier_testkit::tier_conformance_tests!(|memory| {
        Box::new(super::common::OwnedDirTier::new(memory))
    });
}
