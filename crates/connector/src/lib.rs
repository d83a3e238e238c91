//! kvtier's connector: the tiering manager and the engine-facing API. Placeholder until its issue
//! lands; it re-exports the core so engines can depend on this crate alone.

pub use offload_core as core;
