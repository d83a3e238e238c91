//! Test kit for tiers: placeholder.
