//! The one place a broken bookkeeping invariant is handled (design.md section 4, last paragraph):
//! in strict mode (tests, simulators, debug builds) it panics; otherwise it returns, and the caller
//! drops the request's offload and counts it, and the engine recomputes.

/// Whether broken bookkeeping invariants panic by default: on in debug builds.
pub const STRICT_DEFAULT: bool = cfg!(debug_assertions);

/// Reports a broken bookkeeping invariant. Panics when `strict`; otherwise returns, and the caller
/// must drop the affected state and count the failure.
#[track_caller]
pub fn broken(strict: bool, what: std::fmt::Arguments<'_>) {
    if strict {
        panic!("kvtier lifecycle invariant broken: {what}");
    }
}
