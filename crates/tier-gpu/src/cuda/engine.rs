//! [`CudaTransferEngine`]: the [`TransferEngine`] over CUDA streams. One stream per direction
//! (stores device-to-host, loads host-to-device, so they overlap); each job first waits on the
//! engine's compute event, then issues its coalesced runs (one `cuMemcpyBatchAsync`, or one async
//! copy per run), then records a completion event that `poll` queries front to back.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUevent};
use offload_core::{Job, JobId, JobKind};

use super::driver::{check, create_event, Context, DriverFailure};
use super::pinned::{split_at_pieces, PinnedHostPool};
use super::queue::{lane, EventState, Look, Queues};
use crate::plan::{CopyRun, KvLayout};
use crate::{TransferDone, TransferEngine, TransferError};

/// Copies handed to the driver in one `cuMemcpyBatchAsync` call at most.
const BATCH_COPIES_MAX: usize = 4096;

/// How a job's coalesced runs are handed to the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMethod {
    /// [`CopyMethod::Batch`] where the driver has `cuMemcpyBatchAsync` (CUDA 12.8 and later),
    /// else [`CopyMethod::PerRun`].
    Auto,
    /// One `cuMemcpyDtoHAsync` / `cuMemcpyHtoDAsync` per run.
    PerRun,
    /// One `cuMemcpyBatchAsync` per job (per 4096 runs), source access in stream order, so the
    /// copies still start only after the compute event the job waits on.
    Batch,
}

/// Settings of a [`CudaTransferEngine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaEngineConfig {
    /// The device whose memory the layout's regions point into (its primary context is used).
    pub device_ordinal: u32,
    /// Jobs accepted and not yet reported by `poll`, both directions together; one more is
    /// refused with [`TransferError::Busy`]. One completion event is created per job.
    pub jobs_in_flight_max: usize,
    /// How runs are issued.
    pub copy_method: CopyMethod,
}

impl Default for CudaEngineConfig {
    fn default() -> Self {
        Self {
            device_ordinal: 0,
            jobs_in_flight_max: 64,
            copy_method: CopyMethod::Auto,
        }
    }
}

/// Moves chunks between the engine's KV cache in device memory and a [`PinnedHostPool`].
///
/// Ownership: the engine blocks and host slots a job names belong to the job until its completion
/// is reported (by `poll`, after `wait` or `drain`); a job that failed is reported only once its
/// stream has passed it (or the context is dead), so the GPU never writes memory that was handed
/// back. Dropping the engine synchronises both streams before it releases the pool.
///
/// Errors: a job whose wait, copies or completion event fail reports `success: false`. An error
/// that leaves the context unusable (a sticky error, a lost device) also marks the engine failed:
/// every later submit is refused with [`TransferError::Unavailable`], and jobs in flight complete
/// with failure.
pub struct CudaTransferEngine {
    layout: KvLayout,
    pool: Arc<PinnedHostPool>,
    /// Store stream, load stream (index: [`lane`]); null until created.
    streams: [sys::CUstream; 2],
    queues: Queues<CUevent>,
    method: CopyMethod,
    /// Why the engine refuses work, once a fatal driver error was seen.
    failed: Option<String>,
    runs: Vec<CopyRun>,
    pieces: Vec<CopyRun>,
    batch: BatchArgs,
    ctx: Context,
}

// SAFETY: the raw handles (streams, events, the context) are process-wide driver handles usable
// from any thread; every method pushes the engine's context on the calling thread first, and the
// engine is not `Sync`, so one thread at a time uses them.
unsafe impl Send for CudaTransferEngine {}

impl CudaTransferEngine {
    /// Creates an engine over the device memory described by `layout` (region bases are device
    /// pointers on device `config.device_ordinal`) and the registered host `pool`, whose size must
    /// be the layout's pool size. Creates one stream per direction and `jobs_in_flight_max`
    /// completion events.
    ///
    /// # Safety
    ///
    /// Every region of `layout` must be device memory of that device, valid for the engine's whole
    /// lifetime, and the caller must follow the [`TransferEngine`] ownership contract: the engine
    /// blocks and slots a job names are neither written nor freed by anyone else until its
    /// completion has been reported.
    pub unsafe fn new(
        layout: KvLayout,
        pool: Arc<PinnedHostPool>,
        config: CudaEngineConfig,
    ) -> Result<Self, TransferError> {
        if layout.pool_bytes() != pool.len() as u64 {
            return Err(TransferError::Unavailable(format!(
                "layout needs a host pool of {} bytes, the pinned pool has {}",
                layout.pool_bytes(),
                pool.len()
            )));
        }
        if config.jobs_in_flight_max == 0 {
            return Err(TransferError::Unavailable(
                "jobs_in_flight_max must be at least 1".into(),
            ));
        }
        let ctx = Context::retain(config.device_ordinal)?;
        let method = choose_method(config.copy_method, batch_copy_supported())
            .map_err(TransferError::Unavailable)?;
        let mut engine = Self {
            layout,
            pool,
            streams: [std::ptr::null_mut(); 2],
            queues: Queues::new(),
            method,
            failed: None,
            runs: Vec::new(),
            pieces: Vec::new(),
            batch: BatchArgs::default(),
            ctx,
        };
        // On error, dropping `engine` destroys whatever was created.
        engine.create_handles(config.jobs_in_flight_max)?;
        Ok(engine)
    }

    fn create_handles(&mut self, events: usize) -> Result<(), DriverFailure> {
        let _entered = self.ctx.enter()?;
        for (i, stream) in self.streams.iter_mut().enumerate() {
            // SAFETY: the context is current; the call writes the new handle into `stream`.
            unsafe {
                check(
                    sys::cuStreamCreate(stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                    || format!("cuStreamCreate(lane {i}, non-blocking)"),
                )?;
            }
        }
        for i in 0..events {
            let event = create_event(|| format!("event {i} of {events}"))?;
            self.queues.add_event(event);
        }
        Ok(())
    }

    /// How runs are issued (never [`CopyMethod::Auto`]: what `Auto` resolved to).
    pub fn copy_method(&self) -> CopyMethod {
        self.method
    }

    /// The device ordinal.
    pub fn device_ordinal(&self) -> u32 {
        self.ctx.ordinal()
    }

    /// Why the engine refuses work, if a fatal driver error was seen.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Jobs accepted and not yet reported by `poll`.
    pub fn jobs_in_flight(&self) -> usize {
        self.queues.in_flight()
    }

    /// Accepts `job`: its stream first waits for `wait_event` (the event the engine recorded on its
    /// compute stream after the kernels that write a store's source blocks, or that last read a
    /// load's destination blocks), then copies, then records the job's completion event. Refuses
    /// the job, without side effects, when it does not fit the layout, when `jobs_in_flight_max`
    /// jobs are in flight, or when the engine failed. A wait on an invalid event fails the job
    /// (nothing is copied) without failing the engine.
    ///
    /// # Safety
    ///
    /// `wait_event`, if given, must be a live CUDA event handle (of any context on this device) or
    /// null; the engine uses it only during this call.
    pub unsafe fn submit_after(
        &mut self,
        job: &Job,
        wait_event: Option<CUevent>,
    ) -> Result<(), TransferError> {
        if let Some(reason) = &self.failed {
            return Err(TransferError::Unavailable(reason.clone()));
        }
        debug_assert!(
            !self.queues.is_pending(job.id),
            "job {:?} submitted while in flight",
            job.id
        );
        let in_flight = self.queues.in_flight();
        if in_flight >= self.queues.capacity() {
            return Err(TransferError::Busy { in_flight });
        }
        self.layout
            .plan(&job.transfers, &mut self.runs)
            .map_err(|source| TransferError::Plan {
                job: job.id,
                source,
            })?;
        split_at_pieces(&self.runs, self.pool.piece_bytes() as u64, &mut self.pieces);
        let entered = match self.ctx.enter() {
            Ok(entered) => entered,
            Err(failure) => return Err(mark_failed(&mut self.failed, failure)),
        };
        let Some(event) = self.queues.take_event() else {
            return Err(TransferError::Busy { in_flight });
        };
        let lane = lane(job.kind);
        let stream = self.streams[lane];
        let mut fatal = None;
        let mut enqueued_ok = true;
        if let Some(wait) = wait_event {
            // SAFETY: `stream` is this engine's live stream; the caller guarantees `wait` is a
            // live event handle or null (which the driver rejects with an error).
            let code = unsafe { sys::cuStreamWaitEvent(stream, wait, 0) };
            // A failed wait fails this job only (nothing is copied): the event is the caller's.
            // Should the context itself be dead, the event record below finds out.
            enqueued_ok = check(code, || format!("cuStreamWaitEvent({wait:?})")).is_ok();
        }
        if enqueued_ok {
            let host = HostBase(self.pool.as_ptr());
            let issued = match self.method {
                CopyMethod::Batch => {
                    enqueue_batch(job.kind, &self.pieces, host, stream, &mut self.batch)
                }
                CopyMethod::PerRun | CopyMethod::Auto => {
                    enqueue_per_run(job.kind, &self.pieces, host, stream)
                }
            };
            if let Err(failure) = issued {
                enqueued_ok = false;
                if failure.is_fatal() {
                    fatal = Some(failure);
                }
            }
        }
        // SAFETY: `event` and `stream` are this engine's live handles, in its (current) context.
        let code = unsafe { sys::cuEventRecord(event, stream) };
        let recorded = match check(code, || format!("cuEventRecord(lane {lane})")) {
            Ok(()) => true,
            Err(failure) => {
                // No event marks the end of this job's copies: wait for them here, so that the
                // job's memory is not handed back while a copy may still write it. (If this fails
                // too, the context is dead and runs nothing more.)
                // SAFETY: `stream` is this engine's live stream.
                let _ = unsafe { sys::cuStreamSynchronize(stream) };
                if failure.is_fatal() {
                    fatal.get_or_insert(failure);
                }
                false
            }
        };
        self.queues
            .push(job.id, job.kind, event, recorded, enqueued_ok);
        drop(entered);
        if let Some(failure) = fatal {
            mark_failed(&mut self.failed, failure);
        }
        Ok(())
    }
}

/// A CUDA event the engine's compute stream recorded, as a job's dependency
/// ([`TransferEngine::Dependency`]): the job's copies start after it.
#[derive(Clone, Copy, Debug)]
pub struct ComputeEvent(CUevent);

// SAFETY: a CUDA event handle may be used from any thread; the engine only passes it to
// cuStreamWaitEvent during a submit.
unsafe impl Send for ComputeEvent {}

impl ComputeEvent {
    /// Wraps an event recorded on the engine's compute stream.
    ///
    /// # Safety
    ///
    /// `event` must stay a live CUDA event handle (of any context on this device) until every
    /// submit given this dependency has returned.
    pub unsafe fn new(event: CUevent) -> Self {
        Self(event)
    }
}

/// Marks an engine failed (the first reason wins) and returns the refusal to give.
fn mark_failed(failed: &mut Option<String>, failure: DriverFailure) -> TransferError {
    let reason = failed.get_or_insert_with(|| failure.to_string());
    TransferError::Unavailable(reason.clone())
}

impl TransferEngine for CudaTransferEngine {
    type Dependency = ComputeEvent;

    fn submit_after(
        &mut self,
        job: &Job,
        after: Option<ComputeEvent>,
    ) -> Result<(), TransferError> {
        // SAFETY: a `ComputeEvent` is a live event handle by its constructor's contract.
        unsafe { CudaTransferEngine::submit_after(self, job, after.map(|e| e.0)) }
    }

    fn poll(&mut self, out: &mut Vec<TransferDone>) {
        let entered = self.ctx.enter();
        let failed = &mut self.failed;
        self.queues.poll(|e, how| observe(e, how, failed), out);
        if let Err(failure) = entered {
            mark_failed(&mut self.failed, failure);
        }
    }

    fn wait(&mut self, job: JobId) {
        let entered = self.ctx.enter();
        let failed = &mut self.failed;
        self.queues.wait(job, |e, how| observe(e, how, failed));
        if let Err(failure) = entered {
            mark_failed(&mut self.failed, failure);
        }
    }

    fn drain(&mut self) {
        let entered = self.ctx.enter();
        let failed = &mut self.failed;
        self.queues.drain(|e, how| observe(e, how, failed));
        if let Err(failure) = entered {
            mark_failed(&mut self.failed, failure);
        }
    }
    fn drain_until(&mut self, deadline: std::time::Instant) -> bool {
        let entered = self.ctx.enter();
        let failed = &mut self.failed;
        let drained = self
            .queues
            .drain_until(deadline, |e, how| observe(e, how, failed));
        if let Err(failure) = entered {
            mark_failed(&mut self.failed, failure);
        }
        drained
    }
}

impl Drop for CudaTransferEngine {
    fn drop(&mut self) {
        let entered = self.ctx.enter();
        // Memory the GPU may still write belongs to the jobs in flight: let the streams pass them
        // before the pool (and the caller's device memory) can go away.
        for &stream in self.streams.iter().filter(|s| !s.is_null()) {
            // SAFETY: a live stream of this engine. An error means the context is dead, and a dead
            // context runs no more copies.
            let _ = unsafe { sys::cuStreamSynchronize(stream) };
        }
        for event in self.queues.events() {
            // SAFETY: every event was created by this engine and is destroyed once, here; the
            // streams that record them are idle.
            let _ = unsafe { sys::cuEventDestroy_v2(event) };
        }
        for &stream in self.streams.iter().filter(|s| !s.is_null()) {
            // SAFETY: a live, idle stream of this engine, destroyed once.
            let _ = unsafe { sys::cuStreamDestroy_v2(stream) };
        }
        drop(entered);
    }
}

/// Looks at one of the engine's events and records a fatal error in `failed`.
fn observe(event: CUevent, how: Look, failed: &mut Option<String>) -> EventState {
    // SAFETY: `event` is one of this engine's events, alive until the engine drops.
    let code = unsafe {
        match how {
            Look::Query => sys::cuEventQuery(event),
            Look::Block => sys::cuEventSynchronize(event),
        }
    };
    let state = event_state(code, how);
    if let EventState::Failed(failure) = &state {
        if failure.is_fatal() {
            failed.get_or_insert_with(|| failure.to_string());
        }
    }
    state
}

/// Translates an event query's answer.
fn event_state(code: sys::CUresult, how: Look) -> EventState {
    match code {
        sys::CUresult::CUDA_SUCCESS => EventState::Complete,
        sys::CUresult::CUDA_ERROR_NOT_READY => EventState::NotReady,
        code => EventState::Failed(DriverFailure {
            op: match how {
                Look::Query => "cuEventQuery(job completion)".into(),
                Look::Block => "cuEventSynchronize(job completion)".into(),
            },
            code,
        }),
    }
}

/// Picks the copy method given whether the driver has `cuMemcpyBatchAsync`.
fn choose_method(requested: CopyMethod, has_batch: bool) -> Result<CopyMethod, String> {
    match (requested, has_batch) {
        (CopyMethod::Auto | CopyMethod::Batch, true) => Ok(CopyMethod::Batch),
        (CopyMethod::Auto | CopyMethod::PerRun, _) => Ok(CopyMethod::PerRun),
        (CopyMethod::Batch, false) => Err(
            "copy method Batch needs cuMemcpyBatchAsync (a CUDA 12.8 or newer driver); \
             this driver does not export it"
                .into(),
        ),
    }
}

/// Whether the loaded driver exports `cuMemcpyBatchAsync`.
fn batch_copy_supported() -> bool {
    if super::available().is_err() {
        return false;
    }
    // SAFETY: the driver library loads (checked above, so `culib` does not panic); looking a
    // symbol up runs no code of the library.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync")
            .is_ok()
    }
}

/// The pool's first byte; every run's host range lies inside the pool (the planner checks slots
/// against the layout, whose pool size equals the pinned pool's).
#[derive(Clone, Copy)]
struct HostBase(*mut u8);

impl HostBase {
    fn at(self, offset: u64) -> *mut u8 {
        self.0.wrapping_add(offset as usize)
    }
}

/// Enqueues one async copy per run on `stream`.
fn enqueue_per_run(
    kind: JobKind,
    runs: &[CopyRun],
    host: HostBase,
    stream: sys::CUstream,
) -> Result<(), DriverFailure> {
    for run in runs {
        let len = run.len as usize;
        let host_ptr = host.at(run.host_offset);
        // SAFETY: the host range is inside the registered pool (see `HostBase`) and belongs to
        // this job until its completion event is reaped; the device range is an engine block
        // range inside a region the caller of `new` vouched for.
        let code = unsafe {
            match kind {
                JobKind::Store => sys::cuMemcpyDtoHAsync_v2(
                    host_ptr.cast::<c_void>(),
                    run.engine_addr,
                    len,
                    stream,
                ),
                JobKind::Load => sys::cuMemcpyHtoDAsync_v2(
                    run.engine_addr,
                    host_ptr.cast_const().cast::<c_void>(),
                    len,
                    stream,
                ),
            }
        };
        check(code, || {
            format!(
                "cuMemcpy{}Async(device 0x{:x}, host pool offset {}, {len} bytes)",
                if kind == JobKind::Store {
                    "DtoH"
                } else {
                    "HtoD"
                },
                run.engine_addr,
                run.host_offset
            )
        })?;
    }
    Ok(())
}

/// Reused argument arrays of `cuMemcpyBatchAsync`.
#[derive(Default)]
struct BatchArgs {
    dsts: Vec<sys::CUdeviceptr>,
    srcs: Vec<sys::CUdeviceptr>,
    sizes: Vec<usize>,
}

/// Enqueues the runs as `cuMemcpyBatchAsync` calls of at most [`BATCH_COPIES_MAX`] copies.
fn enqueue_batch(
    kind: JobKind,
    runs: &[CopyRun],
    host: HostBase,
    stream: sys::CUstream,
    args: &mut BatchArgs,
) -> Result<(), DriverFailure> {
    let no_hint = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
        id: 0,
    };
    for (group, runs) in runs.chunks(BATCH_COPIES_MAX).enumerate() {
        args.dsts.clear();
        args.srcs.clear();
        args.sizes.clear();
        for run in runs {
            let host_addr = host.at(run.host_offset) as sys::CUdeviceptr;
            let (dst, src) = match kind {
                JobKind::Store => (host_addr, run.engine_addr),
                JobKind::Load => (run.engine_addr, host_addr),
            };
            args.dsts.push(dst);
            args.srcs.push(src);
            args.sizes.push(run.len as usize);
        }
        // Source access in stream order: the copies read their sources only after the work
        // enqueued before them (the wait on the compute event).
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: no_hint,
            dstLocHint: no_hint,
            flags: 0,
        }];
        let mut attr_starts = [0usize];
        let mut fail_index = usize::MAX;
        // SAFETY: the three arrays hold `runs.len()` entries each and live across the call (the
        // driver copies them before returning); host addresses are inside the registered pool
        // and owned by this job until its completion is reaped (see `enqueue_per_run`); device
        // addresses are engine blocks in regions the caller of `new` vouched for.
        let code = unsafe {
            sys::cuMemcpyBatchAsync(
                args.dsts.as_mut_ptr(),
                args.srcs.as_mut_ptr(),
                args.sizes.as_mut_ptr(),
                runs.len(),
                attrs.as_mut_ptr(),
                attr_starts.as_mut_ptr(),
                attrs.len(),
                &mut fail_index,
                stream,
            )
        };
        check(code, || {
            format!(
                "cuMemcpyBatchAsync({} copies {}, group {group}, failing copy index {})",
                runs.len(),
                if kind == JobKind::Store {
                    "DtoH"
                } else {
                    "HtoD"
                },
                if fail_index == usize::MAX {
                    "none".to_string()
                } else {
                    fail_index.to_string()
                }
            )
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::cudaError_enum as E;

    #[test]
    fn auto_uses_batch_copies_only_where_the_driver_has_them() {
        assert_eq!(choose_method(CopyMethod::Auto, true), Ok(CopyMethod::Batch));
        assert_eq!(
            choose_method(CopyMethod::Auto, false),
            Ok(CopyMethod::PerRun)
        );
        assert_eq!(
            choose_method(CopyMethod::PerRun, true),
            Ok(CopyMethod::PerRun)
        );
        assert_eq!(
            choose_method(CopyMethod::Batch, true),
            Ok(CopyMethod::Batch)
        );
        let err = choose_method(CopyMethod::Batch, false).unwrap_err();
        assert!(err.contains("cuMemcpyBatchAsync"), "{err}");
    }

    #[test]
    fn event_answers_translate_to_complete_pending_or_failed() {
        assert_eq!(
            event_state(E::CUDA_SUCCESS, Look::Query),
            EventState::Complete
        );
        assert_eq!(
            event_state(E::CUDA_ERROR_NOT_READY, Look::Query),
            EventState::NotReady
        );
        let EventState::Failed(failure) = event_state(E::CUDA_ERROR_ILLEGAL_ADDRESS, Look::Block)
        else {
            panic!("an error is a failure");
        };
        assert!(failure.is_fatal());
        assert!(
            failure.to_string().contains("cuEventSynchronize"),
            "{failure}"
        );
    }

    #[test]
    fn default_config_bounds_jobs_and_picks_the_method_automatically() {
        let config = CudaEngineConfig::default();
        assert_eq!(config.copy_method, CopyMethod::Auto);
        assert!(config.jobs_in_flight_max > 0);
    }
}
