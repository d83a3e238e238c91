//! The crate's error type, with a kind that callers branch on.

use thiserror::Error;

/// What kind of failure an error is, for callers that branch on it.
///
/// Non-exhaustive: the kinds grow with the failures callers learn to branch on (peer gone,
/// corrupt, unsupported); a caller treats an unknown kind as not retryable.
///
/// ```compile_fail
/// // Outside offload-core a match needs a `_` arm:
/// fn f(x: offload_core::ErrorKind) {
///     match x {
///         offload_core::ErrorKind::Transient => {}
///         offload_core::ErrorKind::NoSpace => {}
///         offload_core::ErrorKind::Invalid => {}
///         offload_core::ErrorKind::Invariant => {}
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// May succeed if tried again later (for example, every slot is in use right now).
    Transient,
    /// No space: the pool or tier is full of chunks that cannot be evicted.
    NoSpace,
    /// The input or configuration is invalid; retrying will not help.
    Invalid,
    /// A broken invariant of the lifecycle contract (a bookkeeping bug).
    Invariant,
}

/// Errors of offload-core.
///
/// Non-exhaustive: new failures get new variants; branch on [`CoreError::kind`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CoreError {
    /// A configuration value is out of range; names the setting.
    #[error("invalid config `{key}`: {reason}")]
    InvalidConfig {
        /// The setting that was wrong.
        key: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// Not enough evictable slots for the chunks of a store.
    #[error("host pool full: {needed} slots needed, {evictable} evictable")]
    NoSpace {
        /// Slots the call needed.
        needed: usize,
        /// Slots that could have been freed.
        evictable: usize,
    },
    /// A key was not in a state that allows the operation.
    #[error("chunk {hash:#x}/{group} is not {expected}")]
    BadKeyState {
        /// The key's hash.
        hash: u128,
        /// The key's group.
        group: u32,
        /// The state the operation needed.
        expected: &'static str,
    },
    /// A lifecycle invariant was broken (bookkeeping); the request's offload is dropped.
    #[error("lifecycle invariant broken: {0}")]
    Invariant(String),
}

impl CoreError {
    /// The kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            CoreError::InvalidConfig { .. } => ErrorKind::Invalid,
            CoreError::NoSpace { .. } => ErrorKind::NoSpace,
            CoreError::BadKeyState { .. } | CoreError::Invariant(_) => ErrorKind::Invariant,
        }
    }
}
