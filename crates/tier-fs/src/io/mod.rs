//! The I/O engines under the disk tier: one interface, two implementations (io_uring, and plain
//! `pread`/`pwrite` on a small thread pool where io_uring is missing or forbidden).
//!
//! Buffer ownership (after tokio-uring): an [`IoOp`] owns its [`AlignedBuf`] from `submit` until
//! its [`IoCompletion`] is reaped, which hands the buffer back. Nothing the kernel may still write
//! is ever freed early: an engine that is dropped with operations in flight waits for them.
//! An operation may also carry a [`SlotSpan`], memory it does not own (a host slot) that it
//! writes from or reads into after its buffer: whoever created the span promises (that is why
//! [`SlotSpan::new`] is `unsafe`) that nothing else touches that memory and that it stays
//! allocated until the operation's completion is reaped.

use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;

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
    /// Bytes to move (at most `buf.capacity()`, plus `span.len()` with a span; for O_DIRECT
    /// files a multiple of the alignment).
    pub len: usize,
    /// The buffer, owned by the operation while it is in flight.
    pub buf: AlignedBuf,
    /// Memory after the buffer (a vectored operation): the first `len - span.len()` bytes move
    /// through `buf`, the next `span.len()` through the span. `None`: only `buf`.
    pub span: Option<SlotSpan>,
}

impl IoOp {
    /// Bytes that move through `buf` (`len` less the span's length).
    pub fn buf_len(&self) -> usize {
        self.len
            .saturating_sub(self.span.as_ref().map_or(0, SlotSpan::len))
    }
}

/// Memory an operation moves bytes from (write) or into (read) without owning it: a host slot,
/// for zero-copy transfers.
#[derive(Debug)]
pub struct SlotSpan {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the creator of a span promised (`SlotSpan::new`) that the operation carrying it has
// exclusive use of the memory until its completion is reaped, so the thread that runs the
// operation may use it, like a `&mut [u8]` moved there.
unsafe impl Send for SlotSpan {}

impl SlotSpan {
    /// A span of `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes, and nothing else may read or
    /// write that memory (nor free it) from the submission of the operation carrying the span
    /// until that operation's completion is reaped (or the engine is dropped, which waits).
    pub unsafe fn new(ptr: NonNull<u8>, len: usize) -> SlotSpan {
        SlotSpan { ptr, len }
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the span is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
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
    /// The most operations the engine runs at once (a thread pool's threads, the kernel's
    /// completion queue); more in flight only wait in the engine.
    fn parallel_max(&self) -> usize;
}
