//! Opening segment files with or without O_DIRECT, allocating their blocks ahead of the writes,
//! the start-up probe that decides whether a root directory takes O_DIRECT, and the one-line
//! warnings the tier prints.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::error::FsError;
use crate::format::ALIGN;
use crate::io::AlignedBuf;
use crate::layout::Layout;
use crate::stats::{add, StatsCell};

/// Permission bits of new segment files: the owner only (KV bytes can reveal prompts).
pub(crate) const FILE_MODE: u32 = 0o600;

/// Prints a warning (unless `quiet`) and counts it.
pub(crate) fn warn(stats: &StatsCell, quiet: bool, message: &str) {
    add(&stats.warnings, 1);
    if !quiet {
        tracing::warn!(target: "kvtier::tier_fs", "{message}");
    }
}

/// Whether `error` is EINVAL (what O_DIRECT refusal and misalignment look like).
pub(crate) fn is_einval(error: &io::Error) -> bool {
    error.raw_os_error() == Some(libc::EINVAL)
}

fn direct_flag(direct: bool) -> i32 {
    if direct {
        libc::O_DIRECT
    } else {
        0
    }
}

/// Creates a new file (O_EXCL) for writing and reading, with O_DIRECT if `direct`.
pub(crate) fn create_for_write(path: &Path, direct: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(direct_flag(direct))
        .open(path)
}

/// Creates an unnamed file in directory `dir` (`O_TMPFILE`) for writing and reading, with
/// O_DIRECT if `direct`: invisible to every reader until [`link_unnamed`] names it, and freed by
/// the kernel if the process dies first. Fails (`EOPNOTSUPP`, `EISDIR`, `EINVAL`) where the
/// kernel or the file system has no unnamed files.
pub(crate) fn create_unnamed(dir: &Path, direct: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_TMPFILE | direct_flag(direct))
        .open(dir)
}

/// Gives a file from [`create_unnamed`] the name `path` (which must not exist), through
/// `/proc/self/fd` (`linkat` with `AT_EMPTY_PATH` would need `CAP_DAC_READ_SEARCH`).
pub(crate) fn link_unnamed(file: &File, path: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    let invalid = |_| io::Error::from(io::ErrorKind::InvalidInput);
    let from = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).map_err(invalid)?;
    let to = CString::new(path.as_os_str().as_bytes()).map_err(invalid)?;
    // SAFETY: both are NUL-terminated strings that outlive the call; no other memory is passed.
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reopens a segment this instance appends, buffered, keeping its contents (after EINVAL).
pub(crate) fn reopen_buffered_for_write(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).write(true).open(path)
}

/// Opens a segment file for reading, with O_DIRECT if `direct`.
pub(crate) fn open_for_read(path: &Path, direct: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(direct_flag(direct))
        .open(path)
}

/// Whether the namespace directory takes O_DIRECT: creates a temporary file with O_DIRECT,
/// writes and reads back one aligned block, and removes it. `Ok(Err(reason))` means O_DIRECT is
/// refused there (EINVAL, or data that does not read back); `Err` means the directory is unusable.
pub(crate) fn probe_direct(layout: &Layout) -> Result<Result<(), String>, FsError> {
    let path = layout.temp_path_in_dir("direct-probe");
    let result = probe_at(&path);
    // The probe file is ours alone; a failure to remove it is swept at the next start.
    let _ = fs::remove_file(&path);
    result
}

fn probe_at(path: &Path) -> Result<Result<(), String>, FsError> {
    let file = match OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if is_einval(&e) => return Ok(Err(format!("open {path:?} with O_DIRECT: {e}"))),
        Err(e) => return Err(FsError::io("create", path, 0, e)),
    };
    let mut out =
        AlignedBuf::try_with_capacity(ALIGN).map_err(|e| FsError::io("alloc", path, 0, e))?;
    for (i, byte) in out.as_full_mut_slice().iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    out.set_len(ALIGN);
    match file.write_at(out.as_slice(), 0) {
        Ok(n) if n == ALIGN => {}
        Ok(n) => {
            return Ok(Err(format!(
                "O_DIRECT write to {path:?} moved {n} of {ALIGN} bytes"
            )))
        }
        Err(e) if is_einval(&e) => return Ok(Err(format!("O_DIRECT write to {path:?}: {e}"))),
        Err(e) => return Err(FsError::io("write", path, 0, e)),
    }
    let mut back =
        AlignedBuf::try_with_capacity(ALIGN).map_err(|e| FsError::io("alloc", path, 0, e))?;
    back.set_len(ALIGN);
    match file.read_at(back.as_mut_slice(), 0) {
        Ok(n) if n == ALIGN => {}
        Ok(n) => {
            return Ok(Err(format!(
                "O_DIRECT read of {path:?} returned {n} of {ALIGN} bytes"
            )))
        }
        Err(e) if is_einval(&e) => return Ok(Err(format!("O_DIRECT read of {path:?}: {e}"))),
        Err(e) => return Err(FsError::io("read", path, 0, e)),
    }
    if back.as_slice() != out.as_slice() {
        return Ok(Err(format!(
            "O_DIRECT read of {path:?} returned other bytes than written"
        )));
    }
    Ok(Ok(()))
}

/// Allocates `len` bytes of `file` at `offset` and extends its size to cover them
/// (`fallocate` mode 0; the new range reads as zeros).
pub(crate) fn allocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Err(io::Error::from_raw_os_error(libc::EFBIG));
    };
    loop {
        // SAFETY: plain syscall on a descriptor this `File` owns; no memory is passed.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, len) };
        if rc == 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Whether `error` says the file system cannot `fallocate` at all.
pub(crate) fn is_unsupported(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NamespaceId;

    #[test]
    fn probe_leaves_no_file_behind() {
        let dir = tempfile::tempdir().unwrap();
        let ns = NamespaceId {
            model: "m".into(),
            dtype: "d".into(),
            tokens_per_chunk: 1,
            parallel_layout: "p".into(),
        };
        let layout = Layout::new(dir.path(), &ns);
        fs::create_dir_all(layout.dir()).unwrap();
        // ext4 and tmpfs both take O_DIRECT; either answer is fine, an error is not.
        let answer = probe_direct(&layout).unwrap();
        if let Err(reason) = answer {
            eprintln!("O_DIRECT refused in {:?}: {reason}", dir.path());
        }
        assert_eq!(fs::read_dir(layout.dir()).unwrap().count(), 0);
    }
}
