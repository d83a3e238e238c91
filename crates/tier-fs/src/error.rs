//! The crate's error type, [`FsError`], with a kind ([`FsErrorKind`]) that callers branch on.
//! Kernel errors are translated here, in one place, and always carry the operation, path and
//! offset.

use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// What kind of failure an error is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsErrorKind {
    /// A setting or the on-disk namespace does not fit; retrying will not help.
    Invalid,
    /// May succeed later (interrupted, would block).
    Transient,
    /// The file system is full (ENOSPC, EDQUOT).
    NoSpace,
    /// Data on disk does not verify.
    Corrupt,
    /// The kernel or file system refuses a feature (EINVAL for O_DIRECT, io_uring forbidden).
    Unsupported,
    /// Anything else (EIO, permissions, a dead worker).
    Fatal,
}

/// Errors of the disk tier.
#[derive(Debug, Error)]
pub enum FsError {
    /// A configuration value is out of range; names the setting.
    #[error("invalid config `{field}`: {reason}")]
    Config {
        /// The setting that was wrong.
        field: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// The namespace directory holds chunks of another layout (or format).
    #[error(
        "namespace config {path:?}: `{field}` is {found:?} on disk but {expected:?} configured"
    )]
    NamespaceMismatch {
        /// The namespace config file.
        path: PathBuf,
        /// The field that differs.
        field: &'static str,
        /// The configured value.
        expected: String,
        /// The value on disk.
        found: String,
    },
    /// A system call failed.
    #[error("{op} {path:?} at offset {offset}: {source}")]
    Io {
        /// The operation (`"open"`, `"write"`, `"rename"`, ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The byte offset in the file (0 where not applicable).
        offset: u64,
        /// The kernel's error.
        source: io::Error,
    },
    /// A file's contents do not verify.
    #[error("corrupt {path:?} at offset {offset}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Where the problem is.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A requested engine is not available here.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The background worker could not be started or died.
    #[error("tier-fs worker: {0}")]
    Worker(String),
    /// The benchmark could not measure (a failed job, a short raw transfer).
    #[error("tier-fs bench: {0}")]
    Bench(String),
}

impl FsError {
    /// An I/O error of `op` on `path` at `offset`.
    pub fn io(op: &'static str, path: &Path, offset: u64, source: io::Error) -> Self {
        FsError::Io {
            op,
            path: path.to_owned(),
            offset,
            source,
        }
    }

    /// The kind of this error.
    pub fn kind(&self) -> FsErrorKind {
        match self {
            FsError::Config { .. } | FsError::NamespaceMismatch { .. } => FsErrorKind::Invalid,
            FsError::Io { source, .. } => io_kind(source),
            FsError::Corrupt { .. } => FsErrorKind::Corrupt,
            FsError::Unsupported(_) => FsErrorKind::Unsupported,
            FsError::Worker(_) | FsError::Bench(_) => FsErrorKind::Fatal,
        }
    }
}

/// The kind of a kernel error.
pub fn io_kind(error: &io::Error) -> FsErrorKind {
    match error.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => FsErrorKind::NoSpace,
        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => {
            FsErrorKind::Unsupported
        }
        Some(libc::EINTR) | Some(libc::EAGAIN) => FsErrorKind::Transient,
        _ => FsErrorKind::Fatal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_errno() {
        let e = FsError::io(
            "write",
            Path::new("/x"),
            4096,
            io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(e.kind(), FsErrorKind::NoSpace);
        let text = e.to_string();
        assert!(text.contains("write") && text.contains("/x") && text.contains("4096"));
        let e = FsError::io(
            "open",
            Path::new("/x"),
            0,
            io::Error::from_raw_os_error(libc::EINVAL),
        );
        assert_eq!(e.kind(), FsErrorKind::Unsupported);
        let e = FsError::io(
            "read",
            Path::new("/x"),
            0,
            io::Error::from_raw_os_error(libc::EIO),
        );
        assert_eq!(e.kind(), FsErrorKind::Fatal);
    }
}
