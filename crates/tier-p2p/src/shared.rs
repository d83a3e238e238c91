//! State shared by the tier and its threads ([`Shared`]), and the small helpers they all use:
//! locking that survives a poisoned mutex, log lines, and named thread spawning.

use std::fmt::Display;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use crate::config::P2pConfig;
use crate::error::P2pError;
use crate::handshake::Identity;
use crate::stats::Counters;
use crate::store::PublishedStore;

/// What the server, the workers and the tier share.
pub(crate) struct Shared {
    /// The validated configuration.
    pub(crate) config: P2pConfig,
    /// Our identity for handshakes.
    pub(crate) identity: Identity,
    /// The chunks we serve.
    pub(crate) store: Mutex<PublishedStore>,
    /// Counters.
    pub(crate) counters: Counters,
    /// A broken invariant panics ([`broken`]); [`offload_core::invariant::STRICT_DEFAULT`]
    /// (debug builds) unless a test sets it (`P2pTier::set_strict_invariants`).
    pub(crate) strict: AtomicBool,
    /// The NIXL data plane, made on first use when enabled and its library loads.
    #[cfg(feature = "nixl")]
    pub(crate) nixl: crate::nixl::LazyPlane,
}

/// Locks `mutex`. A panic while it was held cannot leave the store or the tables inconsistent
/// (every update is a single step), so a poisoned lock is used as is.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Logs one warning (target `kvtier::tier_p2p`) through `tracing`.
pub(crate) fn log(message: impl Display) {
    tracing::warn!(target: "kvtier::tier_p2p", "{message}");
}

/// Reports a broken invariant of the tier's threads (design.md section 4): panics in strict mode;
/// otherwise counts it (`P2pStats::invariant_failures`), logs it and returns, and the caller
/// fails what it concerns (a chunk: the engine recomputes it).
#[track_caller]
pub(crate) fn broken(shared: &Shared, what: std::fmt::Arguments<'_>) {
    crate::stats::add(&shared.counters.invariant_failures, 1);
    log(format_args!("broken invariant: {what}"));
    offload_core::invariant::broken(shared.strict.load(Ordering::Relaxed), what);
}

/// Starts a named thread.
pub(crate) fn spawn<F>(name: String, body: F) -> Result<JoinHandle<()>, P2pError>
where
    F: FnOnce() + Send + 'static,
{
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(body)
        .map_err(|source| P2pError::Spawn { name, source })
}
