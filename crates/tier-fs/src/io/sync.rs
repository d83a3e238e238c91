//! [`SyncEngine`]: the fallback I/O engine, plain `pread`/`pwrite` on a small pool of threads,
//! for machines where io_uring is missing or forbidden (seccomp, `kernel.io_uring_disabled`).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use super::{IoCompletion, IoEngine, IoOp, OpKind, SlotSpan};

/// Most operations a [`SyncEngine`] holds at once (submitted and not yet reaped).
pub const OPS_IN_FLIGHT_MAX: usize = 4096;

/// Most worker threads a [`SyncEngine`] may have.
pub const THREADS_MAX: usize = 64;

/// Runs each operation as one `pread`/`pwrite` on a pool of threads; completions come back over a
/// channel.
///
/// A short read or write is reported as its count, never looped here. Both queues are bounded by
/// [`OPS_IN_FLIGHT_MAX`]: `submit` refuses (with `WouldBlock`) a batch that would exceed it.
/// Dropping the engine abandons operations no worker has started (their buffers are freed: no
/// thread touches them) and joins the workers, which finish the operations they are running.
pub struct SyncEngine {
    /// Operations for the workers; `None` only while dropping.
    jobs: Option<Sender<IoOp>>,
    /// Finished operations from the workers.
    done: Receiver<IoCompletion>,
    workers: Vec<JoinHandle<()>>,
    /// Set on drop: workers skip operations they have not started.
    shutdown: Arc<AtomicBool>,
    /// Completions made on the caller's thread (operations no worker could take).
    local: Vec<IoCompletion>,
    /// Submitted and not yet reaped.
    ops_in_flight: usize,
}

impl SyncEngine {
    /// Starts `threads` worker threads (1 ..= [`THREADS_MAX`]).
    pub fn new(threads: usize) -> io::Result<SyncEngine> {
        if threads == 0 || threads > THREADS_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("sync engine: {threads} threads, expected 1..={THREADS_MAX}"),
            ));
        }
        // Both channels hold at most `ops_in_flight <= OPS_IN_FLIGHT_MAX` items, so sends into
        // them never block.
        let (jobs_tx, jobs_rx) = crossbeam_channel::bounded::<IoOp>(OPS_IN_FLIGHT_MAX);
        let (done_tx, done_rx) = crossbeam_channel::bounded::<IoCompletion>(OPS_IN_FLIGHT_MAX);
        let shutdown = Arc::new(AtomicBool::new(false));
        let mut engine = SyncEngine {
            jobs: Some(jobs_tx),
            done: done_rx,
            workers: Vec::with_capacity(threads),
            shutdown: Arc::clone(&shutdown),
            local: Vec::new(),
            ops_in_flight: 0,
        };
        for index in 0..threads {
            let jobs = jobs_rx.clone();
            let done = done_tx.clone();
            let shutdown = Arc::clone(&shutdown);
            let worker = std::thread::Builder::new()
                .name(format!("kvtier-io-{index}"))
                .spawn(move || worker_loop(&jobs, &done, &shutdown))
                .map_err(|err| {
                    io::Error::new(err.kind(), format!("sync engine: spawning worker: {err}"))
                })?;
            // On an early return above, dropping `engine` stops and joins the workers so far.
            engine.workers.push(worker);
        }
        Ok(engine)
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    fn take(&mut self, completion: IoCompletion, out: &mut Vec<IoCompletion>) {
        debug_assert!(self.ops_in_flight > 0, "completion with nothing in flight");
        self.ops_in_flight -= 1;
        out.push(completion);
    }
}

impl IoEngine for SyncEngine {
    fn name(&self) -> &'static str {
        "sync"
    }

    fn submit(&mut self, ops: Vec<IoOp>) -> Result<(), (io::Error, Vec<IoOp>)> {
        if let Err(err) = check_batch(&ops, self.ops_in_flight, usize::MAX) {
            return Err((err, ops));
        }
        let Some(jobs) = &self.jobs else {
            let err = io::Error::other("sync engine: submit while shutting down");
            return Err((err, ops));
        };
        let mut ops = ops.into_iter();
        while let Some(op) = ops.next() {
            // Never full (see `new`); disconnected only if every worker is gone.
            if let Err(err) = jobs.try_send(op) {
                // Earlier ops of this batch are queued already: this op and the rest complete with
                // the error, so the batch still completes exactly once per op.
                let error = format!("sync engine cannot queue it: {err}");
                let failed = std::iter::once(err.into_inner()).chain(ops.by_ref());
                for op in failed {
                    self.local.push(unqueued(op, &error));
                    self.ops_in_flight += 1;
                }
                return Ok(());
            }
            self.ops_in_flight += 1;
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<IoCompletion>, min: usize) -> io::Result<()> {
        let mut reaped = 0;
        for completion in std::mem::take(&mut self.local) {
            self.take(completion, out);
            reaped += 1;
        }
        while let Ok(completion) = self.done.try_recv() {
            self.take(completion, out);
            reaped += 1;
        }
        while reaped < min && self.ops_in_flight > 0 {
            let completion = self.done.recv().map_err(|_| {
                io::Error::other(format!(
                    "sync engine: all workers exited with {} operations in flight",
                    self.ops_in_flight
                ))
            })?;
            self.take(completion, out);
            reaped += 1;
        }
        Ok(())
    }

    fn parallel_max(&self) -> usize {
        self.threads()
    }

    fn in_flight(&self) -> usize {
        self.ops_in_flight
    }
}

impl Drop for SyncEngine {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::Release);
        // Disconnecting the job queue ends each worker's loop once the queue is empty.
        self.jobs = None;
        for worker in self.workers.drain(..) {
            // A worker that panicked has nothing left to wait for.
            let _ = worker.join();
        }
    }
}

/// Checks a batch before any of it is queued: each operation's length against its buffer (and
/// `len_max`), its offset against `off_t`, and the batch size against [`OPS_IN_FLIGHT_MAX`].
pub(crate) fn check_batch(ops: &[IoOp], ops_in_flight: usize, len_max: usize) -> io::Result<()> {
    if ops.len() > OPS_IN_FLIGHT_MAX - ops_in_flight.min(OPS_IN_FLIGHT_MAX) {
        return Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!(
                "{} operations would exceed {OPS_IN_FLIGHT_MAX} in flight ({ops_in_flight} now)",
                ops.len()
            ),
        ));
    }
    ops.iter().try_for_each(|op| check_op(op, len_max))
}

fn check_op(op: &IoOp, len_max: usize) -> io::Result<()> {
    let what = op_name(op.kind);
    let span_len = op.span.as_ref().map_or(0, |s| s.len());
    if op.len < span_len || op.buf_len() > op.buf.capacity() || op.len > len_max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{what} of {} bytes at offset {} (tag {}): shorter than its slot span of \
                 {span_len} bytes, or exceeds the buffer capacity {} (plus the span) or the \
                 engine's limit {len_max}",
                op.len,
                op.offset,
                op.tag,
                op.buf.capacity()
            ),
        ));
    }
    if libc::off_t::try_from(op.offset).is_err() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{what} of {} bytes at offset {} (tag {}): offset beyond off_t",
                op.len, op.offset, op.tag
            ),
        ));
    }
    Ok(())
}

/// `"read"` or `"write"`, for messages.
pub(crate) fn op_name(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Read => "read",
        OpKind::Write => "write",
    }
}

/// The completion of an operation that never reached a worker.
fn unqueued(op: IoOp, error: &str) -> IoCompletion {
    let IoOp {
        tag,
        kind,
        offset,
        mut buf,
        ..
    } = op;
    if kind == OpKind::Read {
        buf.clear();
    }
    let what = op_name(kind);
    IoCompletion {
        tag,
        result: Err(io::Error::other(format!(
            "{what} at offset {offset}: {error}"
        ))),
        buf,
    }
}

fn worker_loop(jobs: &Receiver<IoOp>, done: &Sender<IoCompletion>, shutdown: &AtomicBool) {
    while let Ok(op) = jobs.recv() {
        if shutdown.load(Ordering::Acquire) {
            // The engine is being dropped: nobody will reap this; the buffer is freed here.
            continue;
        }
        let completion = run(op);
        if done.send(completion).is_err() {
            return;
        }
    }
}

/// Runs one operation as a single `pread`/`pwrite` (retried only on EINTR).
fn run(op: IoOp) -> IoCompletion {
    let IoOp {
        tag,
        kind,
        fd,
        offset,
        len,
        mut buf,
        span,
    } = op;
    // Checked by `check_op` before the op was queued.
    let offset = libc::off_t::try_from(offset).unwrap_or(libc::off_t::MAX);
    let buf_len = len - span.as_ref().map_or(0, SlotSpan::len);
    debug_assert!(buf_len <= buf.capacity());
    let result = loop {
        let n = match (kind, &span) {
            (_, Some(span)) => {
                let iov = [
                    libc::iovec {
                        iov_base: buf.as_mut_ptr().cast(),
                        iov_len: buf_len,
                    },
                    libc::iovec {
                        iov_base: span.as_ptr().cast(),
                        iov_len: span.len(),
                    },
                ];
                // SAFETY: the first vector is inside the buffer (`buf_len <= capacity()`), owned
                // by this thread for the call; the second is the span, which its creator
                // promised is valid and used by this operation alone until its completion is
                // reaped (after this call). `fd` as below.
                unsafe {
                    if kind == OpKind::Read {
                        libc::preadv(fd, iov.as_ptr(), 2, offset)
                    } else {
                        libc::pwritev(fd, iov.as_ptr(), 2, offset)
                    }
                }
            }
            // SAFETY: the buffer is valid for writes of `capacity() >= len` bytes and is owned by
            // this thread for the call (the op was moved here); `fd` is the caller's to keep open
            // until the completion is reaped (an invalid fd only yields EBADF).
            (OpKind::Read, None) => unsafe {
                libc::pread(fd, buf.as_mut_ptr().cast(), len, offset)
            },
            // SAFETY: the buffer is valid for reads of `capacity() >= len` initialized bytes and
            // is owned by this thread for the call; `fd` as above.
            (OpKind::Write, None) => unsafe { libc::pwrite(fd, buf.as_ptr().cast(), len, offset) },
        };
        match usize::try_from(n) {
            Ok(n) => break Ok(n),
            Err(_) => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    break Err(err);
                }
            }
        }
    };
    if kind == OpKind::Read {
        buf.set_len((*result.as_ref().unwrap_or(&0)).min(buf_len));
    }
    IoCompletion { tag, result, buf }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::AlignedBuf;

    #[test]
    fn thread_count_is_checked() {
        for threads in [0, THREADS_MAX + 1] {
            let err = SyncEngine::new(threads).err().expect("refused");
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        }
        let engine = SyncEngine::new(2).expect("two threads");
        assert_eq!(engine.threads(), 2);
    }

    #[test]
    fn check_op_names_operation_and_offset() {
        let op = IoOp {
            tag: 1,
            kind: OpKind::Write,
            fd: -1,
            offset: 12_288,
            len: 4097,
            buf: AlignedBuf::with_capacity(4096),
            span: None,
        };
        let message = check_op(&op, usize::MAX).unwrap_err().to_string();
        assert!(message.contains("write"), "{message}");
        assert!(message.contains("12288"), "{message}");
        let op = IoOp {
            offset: u64::MAX,
            len: 1,
            ..op
        };
        let message = check_op(&op, usize::MAX).unwrap_err().to_string();
        assert!(message.contains("off_t"), "{message}");
    }

    #[test]
    fn unqueued_op_completes_with_error_and_buffer() {
        let mut buf = AlignedBuf::with_capacity(4096);
        buf.set_len(10);
        let op = IoOp {
            tag: 9,
            kind: OpKind::Read,
            fd: -1,
            offset: 4096,
            len: 4096,
            buf,
            span: None,
        };
        let completion = unqueued(op, "workers gone");
        assert_eq!(completion.tag, 9);
        let message = completion.result.unwrap_err().to_string();
        assert!(message.contains("read at offset 4096"), "{message}");
        assert_eq!(completion.buf.len(), 0);
        assert_eq!(completion.buf.capacity(), 4096);
    }
}
