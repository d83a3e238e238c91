//! The I/O engines under the disk tier: one interface, two implementations (io_uring, and plain
//! `pread`/`pwrite` on a small thread pool where io_uring is missing or forbidden).
//!
//! Buffer ownership (after tokio-uring): an [`IoOp`] owns its [`AlignedBuf`] from `submit` until
//! its [`IoCompletion`] is reaped, which hands the buffer back. Nothing the kernel may still write
//! is ever freed early: an engine that is dropped with operations in flight waits for them.

use std::io;
use std::os::fd::RawFd;

pub mod buf;
pub mod sync;
pub mod uring;

pub use buf::AlignedBuf;

/// What an operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Write `len` bytes of the buffer at `offset`.
    Write,
    /// Read `len` bytes into the buffer at `offset`.
    Read,
}

/// One positioned read or write. The file descriptor must stay open until the completion is reaped.
#[derive(Debug)]
pub struct IoOp {
    /// Caller's tag, returned in the completion.
    pub tag: u64,
    /// Read or write.
    pub kind: OpKind,
    /// The file.
    pub fd: RawFd,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to move (at most `buf.capacity()`; for O_DIRECT files a multiple of the alignment).
    pub len: usize,
    /// The buffer, owned by the operation while it is in flight.
    pub buf: AlignedBuf,
}

/// The single completion of an [`IoOp`].
#[derive(Debug)]
pub struct IoCompletion {
    /// The operation's tag.
    pub tag: u64,
    /// Bytes moved, or the error (EINVAL from O_DIRECT misalignment arrives here). A short count
    /// is not an error at this level; callers treat it as one (or loop).
    pub result: io::Result<usize>,
    /// The buffer, handed back. For a read, `buf.len()` is set to the bytes read.
    pub buf: AlignedBuf,
}

/// An engine that runs positioned reads and writes asynchronously.
pub trait IoEngine: Send {
    /// A short name for logs (`"io_uring"`, `"sync"`).
    fn name(&self) -> &'static str;
    /// Queues operations (many per call: one submission for a whole job where the engine can).
    /// On error, none of `ops` was queued and their buffers are returned.
    fn submit(&mut self, ops: Vec<IoOp>) -> Result<(), (io::Error, Vec<IoOp>)>;
    /// Moves finished operations into `out`, waiting until at least `min` are available (0: do not
    /// wait). Returns when `min` are available or nothing is in flight.
    fn reap(&mut self, out: &mut Vec<IoCompletion>, min: usize) -> io::Result<()>;
    /// Operations submitted and not yet reaped.
    fn in_flight(&self) -> usize;
}
