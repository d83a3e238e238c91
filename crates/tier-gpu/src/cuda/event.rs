//! [`StreamEvent`]: a [`ComputeEvent`] recorded on a stream the transfer engine does not own,
//! given as a raw handle: the inference engine's compute stream (for PyTorch,
//! `torch.cuda.current_stream().cuda_stream`). It is how an embedding that only knows its
//! compute stream makes the engine's jobs wait for the kernels enqueued on it so far.

use cudarc::driver::sys::{self, CUevent};

use super::driver::{check, create_event, Context};
use super::engine::ComputeEvent;
use crate::TransferError;

/// One CUDA event in a device's primary context (the context PyTorch uses), recorded again at
/// each [`StreamEvent::record`].
///
/// Every record is a later point than the one before, also when the stream changes: before
/// recording on a stream other than the last one, that stream is first made to wait for the
/// event's previous record. So a job still holding the dependency of an earlier record (queued
/// behind a busy engine) waits at least as long as it was meant to, never less.
pub struct StreamEvent {
    event: CUevent,
    /// The stream of the last record; `None` before the first.
    last_stream: Option<usize>,
    ctx: Context,
}

// SAFETY: the event and the context are process-wide driver handles usable from any thread;
// `record` pushes the context on the calling thread first, and `&mut self` keeps one thread at a
// time on it.
unsafe impl Send for StreamEvent {}

impl StreamEvent {
    /// An event (without timing) in the primary context of device `device_ordinal`. Fails with
    /// [`TransferError::Unavailable`] naming the missing driver, the device or the call.
    pub fn new(device_ordinal: u32) -> Result<Self, TransferError> {
        let ctx = Context::retain(device_ordinal)?;
        let entered = ctx.enter()?;
        let event = create_event(|| format!("compute event on device {device_ordinal}"))?;
        drop(entered);
        Ok(Self {
            event,
            last_stream: None,
            ctx,
        })
    }

    /// Records the event on `stream` after the work enqueued on it so far, and returns it as the
    /// dependency of jobs that must start after that work. Refuses a stream that is capturing a
    /// CUDA graph (a record there would become a graph node, not a point in time).
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of this device's primary context, or 0 (the legacy default
    /// stream). The returned dependency refers to this event: `self` must outlive every submit
    /// given it (drop the engine, or the worker that queues jobs with their dependencies, first).
    pub unsafe fn record(&mut self, stream: usize) -> Result<ComputeEvent, TransferError> {
        let handle = stream as sys::CUstream;
        let _entered = self.ctx.enter()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `handle` is a live stream or the legacy stream (the caller's promise); the call
        // writes one enum into `status`.
        unsafe {
            check(sys::cuStreamIsCapturing(handle, &mut status), || {
                format!("cuStreamIsCapturing(stream 0x{stream:x})")
            })?;
        }
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(TransferError::Unavailable(format!(
                "stream 0x{stream:x} is capturing a CUDA graph ({status:?}): no compute event \
                 can be recorded on it"
            )));
        }
        if needs_wait_before_record(self.last_stream, stream) {
            // SAFETY: both handles are live (the event is ours, the stream the caller's).
            unsafe {
                check(sys::cuStreamWaitEvent(handle, self.event, 0), || {
                    format!("cuStreamWaitEvent(stream 0x{stream:x}, previous compute event)")
                })?;
            }
        }
        // SAFETY: as above.
        unsafe {
            check(sys::cuEventRecord(self.event, handle), || {
                format!("cuEventRecord(compute event, stream 0x{stream:x})")
            })?;
        }
        self.last_stream = Some(stream);
        // SAFETY: the event lives as long as `self`, which the caller keeps alive past every
        // submit given this dependency.
        Ok(unsafe { ComputeEvent::new(self.event) })
    }
}

/// Whether a record on `stream` must first wait for the event's previous record (made on
/// `last`), so that the new record is not an earlier point than the old one.
fn needs_wait_before_record(last: Option<usize>, stream: usize) -> bool {
    last.is_some_and(|last| last != stream)
}

impl Drop for StreamEvent {
    fn drop(&mut self) {
        let entered = self.ctx.enter();
        // SAFETY: the event was created by `new` and is destroyed once; a stream still waiting
        // on it keeps what it needs (the driver releases the event once that wait is done).
        let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
        drop(entered);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_on_another_stream_waits_for_the_previous_one_first() {
        assert!(!needs_wait_before_record(None, 0), "first record");
        assert!(
            !needs_wait_before_record(Some(0x10), 0x10),
            "same stream: stream order"
        );
        assert!(needs_wait_before_record(Some(0x10), 0x20), "another stream");
        assert!(
            needs_wait_before_record(Some(0x10), 0),
            "the legacy stream is another"
        );
    }

    #[test]
    fn without_a_driver_the_error_names_it() {
        if crate::cuda::available().is_ok() {
            eprintln!("NOTE: a CUDA driver is present: the missing-driver error is NOT CHECKED");
            return;
        }
        let err = StreamEvent::new(0)
            .err()
            .expect("no event without a driver")
            .to_string();
        assert!(err.contains("CUDA driver"), "{err}");
    }
}
