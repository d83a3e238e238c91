//! [`UringEngine`]: the io_uring I/O engine (one submission queue entry per operation, many
//! operations per `io_uring_enter`), and [`UringEngine::probe`], which tells whether io_uring
//! works on this machine.
//!
//! Ownership: an accepted [`IoOp`] lives in the engine's slab, indexed by the entry's
//! `user_data`, until its completion is reaped; only then is its buffer handed back. Operations
//! the kernel holds are never freed early: `Drop` waits for their completions.

use std::collections::VecDeque;
use std::io;

use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};

use super::sync::{check_batch, op_name};
use super::{IoCompletion, IoEngine, IoOp, OpKind};

/// The two vectors of an operation with a slot span (its buffer, then the span), boxed so that
/// their address stays put while the kernel may read them.
struct IoVecs([libc::iovec; 2]);

// SAFETY: the vectors only point into the operation's own buffer and span, which the operation
// (and so the engine holding it) may use from any thread; they are never dereferenced here.
unsafe impl Send for IoVecs {}

/// `user_data` of the probe's NOP.
const PROBE_USER_DATA: u64 = 0x6b76_7469_6572; // "kvtier"

/// Runs operations through an io_uring instance.
///
/// At most `cq_entries` operations are handed to the kernel at once (so the completion queue
/// cannot overflow); further accepted operations wait in a pending queue and are pushed as
/// completions are reaped. The engine holds at most
/// [`OPS_IN_FLIGHT_MAX`](super::sync::OPS_IN_FLIGHT_MAX) operations (submitted
/// and not yet reaped); `submit` refuses (with `WouldBlock`) a batch that would exceed it.
pub struct UringEngine {
    ring: IoUring,
    /// In-flight operations; the index is the entry's `user_data`.
    slots: Vec<Option<IoOp>>,
    /// The vectors of the vectored operations in `slots`, same index (kept until the
    /// completion is reaped).
    iovs: Vec<Option<Box<IoVecs>>>,
    /// Free indices of `slots`.
    free: Vec<usize>,
    /// Accepted operations not yet pushed to the submission queue.
    pending: VecDeque<usize>,
    /// Operations pushed to the submission queue whose completion is not reaped yet.
    in_kernel: usize,
    /// Limit of `in_kernel`: the completion queue's size.
    in_kernel_max: usize,
    /// Submitted and not yet reaped (`pending.len() + in_kernel`).
    ops_in_flight: usize,
}

impl UringEngine {
    /// Creates an io_uring with `entries` submission queue entries (a power of two is best; the
    /// kernel rounds up and caps it).
    pub fn new(entries: u32) -> io::Result<UringEngine> {
        let ring = IoUring::new(entries).map_err(|err| {
            io::Error::new(
                err.kind(),
                format!("io_uring_setup with {entries} entries: {err}"),
            )
        })?;
        let in_kernel_max = ring.params().cq_entries() as usize;
        Ok(UringEngine {
            ring,
            slots: Vec::new(),
            iovs: Vec::new(),
            free: Vec::new(),
            pending: VecDeque::new(),
            in_kernel: 0,
            in_kernel_max,
            ops_in_flight: 0,
        })
    }

    /// Checks that io_uring works here: the ring can be set up (not ENOSYS, nor EPERM from a
    /// seccomp profile or `kernel.io_uring_disabled`), supports READ and WRITE, and runs one NOP
    /// from submission to completion. The error says what failed.
    pub fn probe() -> Result<(), String> {
        let mut ring = IoUring::new(2).map_err(|err| {
            format!(
                "io_uring_setup failed: {err} (kernel without io_uring, \
                 kernel.io_uring_disabled, or a seccomp profile that forbids it)"
            )
        })?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe).map_err(|err| {
            format!("io_uring opcode probe failed: {err} (kernel older than 5.6)")
        })?;
        for (code, name) in [
            (opcode::Read::CODE, "READ"),
            (opcode::Write::CODE, "WRITE"),
            (opcode::Readv::CODE, "READV"),
            (opcode::Writev::CODE, "WRITEV"),
        ] {
            if !probe.is_supported(code) {
                return Err(format!("io_uring does not support IORING_OP_{name}"));
            }
        }
        let nop = opcode::Nop::new().build().user_data(PROBE_USER_DATA);
        // SAFETY: a NOP references no memory or file.
        unsafe { ring.submission().push(&nop) }
            .map_err(|_| "io_uring probe: submission queue full".to_string())?;
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(format!("io_uring_enter for a NOP failed: {err}")),
            }
        }
        let cqe = ring
            .completion()
            .next()
            .ok_or_else(|| "io_uring probe: no completion for the NOP".to_string())?;
        if cqe.user_data() != PROBE_USER_DATA || cqe.result() < 0 {
            return Err(format!(
                "io_uring probe: NOP completed with user_data {:#x}, result {}",
                cqe.user_data(),
                cqe.result()
            ));
        }
        Ok(())
    }

    /// Completion queue entries: the most operations handed to the kernel at once.
    pub fn kernel_ops_max(&self) -> usize {
        self.in_kernel_max
    }

    /// Puts an accepted operation into the slab and returns its index.
    fn insert(&mut self, op: IoOp) -> usize {
        if let Some(index) = self.free.pop() {
            debug_assert!(self.slots[index].is_none());
            self.slots[index] = Some(op);
            return index;
        }
        self.slots.push(Some(op));
        self.iovs.push(None);
        self.slots.len() - 1
    }

    /// Pushes pending operations into the submission queue while it and the completion queue
    /// have room. Returns how many were pushed.
    fn push_pending(&mut self) -> usize {
        let mut sq = self.ring.submission();
        let mut pushed = 0;
        while self.in_kernel < self.in_kernel_max && !sq.is_full() {
            let Some(&index) = self.pending.front() else {
                break;
            };
            let Some(op) = self.slots.get_mut(index).and_then(Option::as_mut) else {
                broken_invariant(&format!("pending operation {index} has no slot"));
            };
            let entry = sqe_for(op, index, &mut self.iovs[index]);
            // SAFETY: the entry points into `op.buf` for `op.buf_len() <= capacity` bytes
            // (checked at submit), or, for an op with a slot span, to the boxed vectors in
            // `iovs[index]` (the buffer's first `buf_len()` bytes, then the span, whose creator
            // promised it to the op until its completion is reaped); the box is only dropped
            // when that completion is reaped or the engine is dropped after waiting. Once pushed, the op (and so its heap buffer) stays in `slots[index]` until
            // the entry's completion is reaped: only `take_slot`, called for that completion,
            // takes it out, and `Drop` waits for every pushed entry's completion (or leaks the
            // buffers). Moving or growing the slab moves only the AlignedBuf handle, never the
            // heap memory the kernel uses. The fd is the caller's to keep open until then (the
            // kernel holds its own file reference once the entry is issued).
            if unsafe { sq.push(&entry) }.is_err() {
                break;
            }
            self.pending.pop_front();
            self.in_kernel += 1;
            pushed += 1;
        }
        pushed
    }

    /// Pushes what can be pushed and tells the kernel. A busy kernel (EAGAIN, EBUSY) or a signal
    /// leaves the entries queued for the next call.
    fn flush(&mut self) -> io::Result<()> {
        loop {
            let pushed = self.push_pending();
            if self.ring.submission().is_empty() {
                return Ok(());
            }
            let submitted = match self.ring.submit() {
                Ok(n) => n,
                Err(err) if is_retry_later(&err) => return Ok(()),
                Err(err) => return Err(enter_error("submit", &err)),
            };
            let more = !self.pending.is_empty() && self.in_kernel < self.in_kernel_max;
            if !more || (pushed == 0 && submitted == 0) {
                return Ok(());
            }
        }
    }

    /// Moves every completion in the completion queue into `out`; returns how many.
    fn drain(&mut self, out: &mut Vec<IoCompletion>) -> usize {
        let mut reaped = 0;
        for cqe in self.ring.completion() {
            let op = take_slot(&mut self.slots, &cqe);
            self.iovs[slot_index(&cqe)] = None;
            self.free.push(slot_index(&cqe));
            self.in_kernel -= 1;
            self.ops_in_flight -= 1;
            out.push(complete(op, cqe.result()));
            reaped += 1;
        }
        reaped
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn submit(&mut self, ops: Vec<IoOp>) -> Result<(), (io::Error, Vec<IoOp>)> {
        if let Err(err) = check_batch(&ops, self.ops_in_flight, u32::MAX as usize) {
            return Err((err, ops));
        }
        for op in ops {
            let index = self.insert(op);
            self.pending.push_back(index);
            self.ops_in_flight += 1;
        }
        // Every op is accepted (owned by the slab) from here; if telling the kernel fails, they
        // stay queued and the next `reap` retries and reports the error.
        let _ = self.flush();
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<IoCompletion>, min: usize) -> io::Result<()> {
        let mut reaped = 0;
        loop {
            self.flush()?;
            reaped += self.drain(out);
            if reaped >= min || self.ops_in_flight == 0 {
                return Ok(());
            }
            let want = (min - reaped).min(self.in_kernel);
            if want == 0 {
                // Only pending ops, and the kernel refused them for now: try again.
                continue;
            }
            match self.ring.submit_and_wait(want) {
                Ok(_) => {}
                Err(err) if is_retry_later(&err) => {}
                Err(err) => return Err(enter_error("wait", &err)),
            }
        }
    }

    fn parallel_max(&self) -> usize {
        self.in_kernel_max
    }

    fn in_flight(&self) -> usize {
        self.ops_in_flight
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // Never pushed: the kernel never saw these buffers.
        for index in self.pending.drain(..) {
            self.slots[index] = None;
        }
        while self.in_kernel > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(err) if is_retry_later(&err) => {}
                Err(err) => {
                    // The kernel may still write these buffers and we cannot learn when. Our own
                    // buffers can be leaked; a zero-copy op's span is the caller's host slot,
                    // which will be reused or freed after we return, so that is a memory-safety
                    // break (design.md section 4): abort rather than let the kernel write into it.
                    if self.slots.iter().flatten().any(|op| op.span.is_some()) {
                        broken_invariant(&format!(
                            "io_uring_enter failed ({err}) with zero-copy operations in the \
                             kernel; their host slots cannot be handed back"
                        ));
                    }
                    for op in self.slots.drain(..).flatten() {
                        std::mem::forget(op);
                    }
                    return;
                }
            }
            for cqe in self.ring.completion() {
                drop(take_slot(&mut self.slots, &cqe));
                self.in_kernel -= 1;
            }
        }
    }
}

/// The submission queue entry for `op`, tagged with its slab index; a vectored op's vectors are
/// put into `iov` (which must stay until the completion is reaped).
fn sqe_for(op: &mut IoOp, index: usize, iov: &mut Option<Box<IoVecs>>) -> squeue::Entry {
    let fd = types::Fd(op.fd);
    // Fits: checked against u32::MAX at submit.
    let len = u32::try_from(op.len).unwrap_or(u32::MAX);
    if let Some(span) = &op.span {
        let vectors = iov.insert(Box::new(IoVecs([
            libc::iovec {
                iov_base: op.buf.as_mut_ptr().cast(),
                iov_len: op.buf_len(),
            },
            libc::iovec {
                iov_base: span.as_ptr().cast(),
                iov_len: span.len(),
            },
        ])));
        let at = vectors.0.as_ptr();
        let entry = match op.kind {
            OpKind::Read => opcode::Readv::new(fd, at, 2).offset(op.offset).build(),
            OpKind::Write => opcode::Writev::new(fd, at, 2).offset(op.offset).build(),
        };
        return entry.user_data(index as u64);
    }
    let entry = match op.kind {
        OpKind::Read => opcode::Read::new(fd, op.buf.as_mut_ptr(), len)
            .offset(op.offset)
            .build(),
        OpKind::Write => opcode::Write::new(fd, op.buf.as_ptr(), len)
            .offset(op.offset)
            .build(),
    };
    entry.user_data(index as u64)
}

fn slot_index(cqe: &cqueue::Entry) -> usize {
    usize::try_from(cqe.user_data()).unwrap_or(usize::MAX)
}

/// Takes the operation a completion belongs to out of the slab. A completion for no operation
/// means the bookkeeping of buffers the kernel writes is wrong: abort.
fn take_slot(slots: &mut [Option<IoOp>], cqe: &cqueue::Entry) -> IoOp {
    match slots.get_mut(slot_index(cqe)).and_then(Option::take) {
        Some(op) => op,
        None => broken_invariant(&format!(
            "io_uring completion for unknown user_data {} (result {})",
            cqe.user_data(),
            cqe.result()
        )),
    }
}

/// Turns a completion's result into the op's [`IoCompletion`], handing the buffer back.
fn complete(op: IoOp, result: i32) -> IoCompletion {
    let IoOp {
        tag,
        kind,
        len,
        mut buf,
        span,
        ..
    } = op;
    let result = match usize::try_from(result) {
        Ok(n) if n > len => broken_invariant(&format!(
            "io_uring {} of {len} bytes completed with {n}",
            op_name(kind)
        )),
        Ok(n) => Ok(n),
        Err(_) => Err(io::Error::from_raw_os_error(-result)),
    };
    if kind == OpKind::Read {
        let buf_len = len - span.as_ref().map_or(0, super::SlotSpan::len);
        buf.set_len((*result.as_ref().unwrap_or(&0)).min(buf_len));
    }
    IoCompletion { tag, result, buf }
}

/// Errors of `io_uring_enter` after which the same call can simply be made again later.
fn is_retry_later(err: &io::Error) -> bool {
    err.kind() == io::ErrorKind::Interrupted
        || matches!(err.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY))
}

fn enter_error(what: &str, err: &io::Error) -> io::Error {
    io::Error::new(err.kind(), format!("io_uring_enter ({what}): {err}"))
}

/// A memory-safety invariant is broken (design.md section 4): abort, never unwind past buffers
/// the kernel may still write.
fn broken_invariant(message: &str) -> ! {
    tracing::error!(target: "kvtier::tier_fs", "broken invariant: {message}; aborting");
    // Also straight to stderr: the process ends next, and a logger may never get to write.
    eprintln!("kvtier tier-fs: broken invariant: {message}");
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_succeeds_unless_disabled() {
        match UringEngine::probe() {
            Ok(()) => {}
            Err(why) if std::env::var("KVTIER_NO_URING").as_deref() == Ok("1") => {
                eprintln!("io_uring unavailable (KVTIER_NO_URING=1): {why}");
            }
            Err(why) => panic!("io_uring probe failed (set KVTIER_NO_URING=1 to allow): {why}"),
        }
    }

    #[test]
    fn retry_later_errors() {
        assert!(is_retry_later(&io::Error::from_raw_os_error(libc::EINTR)));
        assert!(is_retry_later(&io::Error::from_raw_os_error(libc::EAGAIN)));
        assert!(is_retry_later(&io::Error::from_raw_os_error(libc::EBUSY)));
        assert!(!is_retry_later(&io::Error::from_raw_os_error(libc::EBADF)));
    }

    #[test]
    fn complete_maps_errors_and_read_lengths() {
        let op = |kind| IoOp {
            tag: 7,
            kind,
            fd: -1,
            offset: 0,
            len: 4096,
            buf: crate::io::AlignedBuf::with_capacity(4096),
            span: None,
        };
        let read = complete(op(OpKind::Read), 100);
        assert_eq!(read.tag, 7);
        assert_eq!(read.result.unwrap(), 100);
        assert_eq!(read.buf.len(), 100);
        let failed = complete(op(OpKind::Read), -libc::EINVAL);
        assert_eq!(
            failed.result.unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
        assert_eq!(failed.buf.len(), 0);
        let write = complete(op(OpKind::Write), 4096);
        assert_eq!(write.result.unwrap(), 4096);
    }
}
