//! kvtier's developer tasks as a library, so that their checks (above all the layering check)
//! also run as ordinary tests. The `xtask` binary (`cargo xtask ...`) is a thin front end.

#![forbid(unsafe_code)]

pub mod ci;
pub mod features;
pub mod gpu;
pub mod layering;
pub mod sim;

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

/// An xtask failure: what was being done and why it did not work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    message: String,
}

impl Error {
    /// An error carrying `message`, which should name what was being done and what went wrong.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// The workspace root: the directory above the `xtask` crate.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// The `cargo` to run: the one that started us (`$CARGO`), else `cargo` from `PATH`.
pub fn cargo() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"))
}
