//! The crate's error type, [`P2pError`], with a kind ([`P2pErrorKind`]) that callers branch on.
//! Socket errors are translated here, in one place, and always carry the peer and the operation.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use thiserror::Error;

use crate::frame::FrameError;

/// What kind of failure an error is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum P2pErrorKind {
    /// May succeed later (a deadline passed, a thread or socket could not be had right now).
    Transient,
    /// The peer closed the connection, reset it, or cannot be reached.
    PeerGone,
    /// The peer sent bytes that do not decode or do not verify.
    Corrupt,
    /// The peer refused us, or we refused it (version, namespace, shared secret, busy).
    Refused,
    /// A setting or an argument is wrong; retrying will not help.
    Invalid,
}

/// Errors of the peer tier.
#[derive(Debug, Error)]
pub enum P2pError {
    /// A configuration value is out of range or unsafe; names the setting.
    #[error("invalid config `{field}`: {reason}")]
    Config {
        /// The setting that was wrong.
        field: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// A socket call failed.
    #[error("{op} {peer}: {source}")]
    Io {
        /// The operation (`"connect"`, `"read GET reply"`, ...).
        op: &'static str,
        /// The remote (or, for `bind`, the local) address.
        peer: SocketAddr,
        /// The kernel's error.
        source: io::Error,
    },
    /// A wait passed its deadline.
    #[error("{op} {peer}: no progress within {after:?}")]
    Timeout {
        /// The operation that waited.
        op: &'static str,
        /// The remote address.
        peer: SocketAddr,
        /// The deadline it had.
        after: Duration,
    },
    /// The peer closed the connection in the middle of an operation.
    #[error("{op} {peer}: connection closed by peer")]
    Closed {
        /// The operation.
        op: &'static str,
        /// The remote address.
        peer: SocketAddr,
    },
    /// The peer sent a frame that does not decode, or one that does not fit the protocol state.
    #[error("{op} {peer}: bad frame: {source}")]
    Frame {
        /// The operation.
        op: &'static str,
        /// The remote address.
        peer: SocketAddr,
        /// What was wrong with it.
        source: FrameError,
    },
    /// The handshake failed: version, namespace or shared secret do not match, or the peer is
    /// busy. `reason` says which, and whether it was us or the peer that refused.
    #[error("handshake with {peer} refused: {reason}")]
    Refused {
        /// The remote address.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The peer answered a request with an ERROR frame.
    #[error("{op} {peer}: peer answered error: {message}")]
    Remote {
        /// The operation.
        op: &'static str,
        /// The remote address.
        peer: SocketAddr,
        /// The peer's message.
        message: String,
    },
    /// A peer's name did not resolve (or resolved to no address); the peer counts as down.
    #[error("resolve {peer}: {source}")]
    Resolve {
        /// The peer as configured (`host:port`).
        peer: String,
        /// The resolver's error.
        source: io::Error,
    },
    /// A background thread could not be started.
    #[error("could not start thread {name}: {source}")]
    Spawn {
        /// The thread's name.
        name: String,
        /// The kernel's error.
        source: io::Error,
    },
}

impl P2pError {
    /// An I/O error of `op` with `peer`, translated: a timeout becomes [`P2pError::Timeout`], an
    /// end of stream or reset becomes [`P2pError::Closed`].
    pub fn io(op: &'static str, peer: SocketAddr, source: io::Error, after: Duration) -> Self {
        match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                P2pError::Timeout { op, peer, after }
            }
            io::ErrorKind::UnexpectedEof => P2pError::Closed { op, peer },
            _ => P2pError::Io { op, peer, source },
        }
    }

    /// The kind of this error.
    pub fn kind(&self) -> P2pErrorKind {
        match self {
            P2pError::Config { .. } => P2pErrorKind::Invalid,
            P2pError::Io { source, .. } => io_kind(source),
            P2pError::Timeout { .. } | P2pError::Spawn { .. } => P2pErrorKind::Transient,
            P2pError::Closed { .. } | P2pError::Resolve { .. } => P2pErrorKind::PeerGone,
            P2pError::Frame { .. } => P2pErrorKind::Corrupt,
            P2pError::Refused { .. } | P2pError::Remote { .. } => P2pErrorKind::Refused,
        }
    }
}

/// The kind of a socket error.
fn io_kind(error: &io::Error) -> P2pErrorKind {
    match error.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted => {
            P2pErrorKind::Transient
        }
        io::ErrorKind::InvalidInput | io::ErrorKind::AddrNotAvailable => P2pErrorKind::Invalid,
        _ => P2pErrorKind::PeerGone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 9))
    }

    #[test]
    fn io_errors_translate_to_kinds() {
        let after = Duration::from_millis(5);
        let timeout = P2pError::io("read", peer(), io::ErrorKind::WouldBlock.into(), after);
        assert_eq!(timeout.kind(), P2pErrorKind::Transient);
        assert!(timeout.to_string().contains("127.0.0.1:9"), "{timeout}");
        let eof = P2pError::io("read", peer(), io::ErrorKind::UnexpectedEof.into(), after);
        assert_eq!(eof.kind(), P2pErrorKind::PeerGone);
        let reset = P2pError::io("read", peer(), io::ErrorKind::ConnectionReset.into(), after);
        assert_eq!(reset.kind(), P2pErrorKind::PeerGone);
        assert!(reset.to_string().starts_with("read 127.0.0.1:9"), "{reset}");
    }
}
