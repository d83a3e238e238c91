//! Thin wrappers over the CUDA driver calls of the CUDA path: driver errors translated in one
//! place ([`DriverFailure`]), the device's primary context (retained for a value's lifetime and
//! pushed around each call), and [`DeviceBuffer`], a device allocation for tests and benchmarks.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;

use cudarc::driver::sys::{self, CUresult};

use crate::TransferError;

/// A failed driver call: what was being done, and the driver's code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DriverFailure {
    /// The call and its arguments (addresses, offsets, sizes).
    pub(crate) op: String,
    /// The driver's answer.
    pub(crate) code: CUresult,
}

impl DriverFailure {
    /// Whether the error leaves the context unusable (a sticky error, a lost device, a torn-down
    /// driver) rather than rejecting one call's arguments. Unknown codes count as fatal.
    pub(crate) fn is_fatal(&self) -> bool {
        is_fatal(self.code)
    }
}

impl fmt::Display for DriverFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {:?}", self.op, self.code)
    }
}

impl From<DriverFailure> for TransferError {
    fn from(failure: DriverFailure) -> Self {
        TransferError::Unavailable(failure.to_string())
    }
}

/// See [`DriverFailure::is_fatal`]. Only errors that reject the arguments of one call are
/// recoverable; everything else (illegal address, launch failure, ECC, a destroyed context, a
/// deinitialised driver, codes this build does not know) poisons the context.
pub(crate) fn is_fatal(code: CUresult) -> bool {
    use sys::cudaError_enum as E;
    !matches!(
        code,
        E::CUDA_SUCCESS
            | E::CUDA_ERROR_NOT_READY
            | E::CUDA_ERROR_INVALID_VALUE
            | E::CUDA_ERROR_OUT_OF_MEMORY
            | E::CUDA_ERROR_NOT_SUPPORTED
            | E::CUDA_ERROR_NOT_PERMITTED
            | E::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
            | E::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    )
}

/// Turns a driver result into `Ok` or a [`DriverFailure`] naming the operation.
pub(crate) fn check(code: CUresult, op: impl FnOnce() -> String) -> Result<(), DriverFailure> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverFailure { op: op(), code })
    }
}

/// Creates an event without timing in the current context; `what` names it in the error.
/// The caller must have made a context current (see [`Context::enter`]).
pub(crate) fn create_event(what: impl FnOnce() -> String) -> Result<sys::CUevent, DriverFailure> {
    let mut event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: the caller made a context current; the call writes the new handle into `event`.
    unsafe {
        check(
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            ),
            || format!("cuEventCreate({}, disable timing)", what()),
        )?;
    }
    Ok(event)
}

/// A device's primary context (the one PyTorch and most engines use), retained while the value
/// lives. Every call that needs a context pushes it with [`Context::enter`] and pops it after, so
/// whatever the calling thread had current is left as it was.
pub(crate) struct Context {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    ordinal: u32,
}

// SAFETY: a CUcontext is a process-wide driver handle usable from any thread; this type only
// pushes it on the calling thread for the duration of a call and releases it once, on drop.
unsafe impl Send for Context {}
// SAFETY: as above; `&self` methods only push and pop the handle on the calling thread.
unsafe impl Sync for Context {}

impl Context {
    /// Initialises the driver (after checking that it can be loaded) and retains the primary
    /// context of device `ordinal`.
    pub(crate) fn retain(ordinal: u32) -> Result<Self, TransferError> {
        super::available().map_err(TransferError::Unavailable)?;
        let index = i32::try_from(ordinal).map_err(|_| {
            TransferError::Unavailable(format!("device ordinal {ordinal} is out of range"))
        })?;
        let mut device: sys::CUdevice = 0;
        // SAFETY: the driver library is loaded (checked by `available`); cuInit takes no pointer
        // and cuDeviceGet writes one integer into `device`, which lives across the call.
        unsafe {
            check(sys::cuInit(0), || "cuInit".into())?;
            check(sys::cuDeviceGet(&mut device, index), || {
                format!("cuDeviceGet({ordinal})")
            })?;
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `device` is a valid device handle; the call writes the context into `ctx`.
        unsafe {
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, device), || {
                format!("cuDevicePrimaryCtxRetain(device {ordinal})")
            })?;
        }
        Ok(Self {
            device,
            ctx,
            ordinal,
        })
    }

    /// The device ordinal.
    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Makes the context current on this thread until the guard drops.
    pub(crate) fn enter(&self) -> Result<Entered<'_>, DriverFailure> {
        // SAFETY: `self.ctx` is a retained primary context, valid until `self` drops, which the
        // guard's borrow outlives.
        unsafe {
            check(sys::cuCtxPushCurrent_v2(self.ctx), || {
                format!("cuCtxPushCurrent(device {})", self.ordinal)
            })?;
        }
        Ok(Entered {
            _ctx: self,
            _not_send: PhantomData,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `self.device` had its primary context retained once in `retain`; this is the
        // matching release. An error here (a torn-down driver at exit) leaves nothing to undo.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// A pushed context; popped on drop, on the thread that pushed it (the guard is not `Send`).
pub(crate) struct Entered<'a> {
    _ctx: &'a Context,
    _not_send: PhantomData<*const ()>,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `enter` pushed a context on this thread (the guard is not Send, so this runs on
        // the same thread); popping writes the popped handle into `popped`.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

/// A device allocation, for tests and benchmarks that need engine-side memory (the transfer
/// engine itself never allocates device memory: it copies into the engine's KV cache). Reads and
/// writes are synchronous and ordered only with the legacy default stream, so they must not race
/// with jobs in flight: drain the engine (or wait for the job) first.
pub struct DeviceBuffer {
    ctx: Context,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (uninitialised) on device `ordinal`.
    pub fn new(ordinal: u32, len: usize) -> Result<Self, TransferError> {
        let ctx = Context::retain(ordinal)?;
        let _entered = ctx.enter()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; the call writes the new pointer into `ptr`.
        unsafe {
            check(sys::cuMemAlloc_v2(&mut ptr, len), || {
                format!("cuMemAlloc({len} bytes on device {ordinal})")
            })?;
        }
        drop(_entered);
        Ok(Self { ctx, ptr, len })
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range(&self, offset: usize, len: usize) -> Result<u64, TransferError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.ptr + offset as u64),
            _ => Err(TransferError::Unavailable(format!(
                "range {offset}+{len} is outside a device buffer of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies `src` to the buffer at `offset` and waits until the bytes are on the device.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), TransferError> {
        let dst = self.range(offset, src.len())?;
        let _entered = self.ctx.enter()?;
        // SAFETY: `dst..dst+len` is inside this allocation (checked), `src` is a live host slice
        // for the whole call, and the legacy stream is synchronised before returning, so the
        // driver is done reading `src` when the borrow ends.
        unsafe {
            check(
                sys::cuMemcpyHtoDAsync_v2(
                    dst,
                    src.as_ptr().cast::<c_void>(),
                    src.len(),
                    std::ptr::null_mut(),
                ),
                || format!("cuMemcpyHtoDAsync(0x{dst:x}, {} bytes)", src.len()),
            )?;
            check(sys::cuStreamSynchronize(std::ptr::null_mut()), || {
                "cuStreamSynchronize(legacy stream)".into()
            })?;
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes of the buffer, from `offset`, into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransferError> {
        let src = self.range(offset, dst.len())?;
        let _entered = self.ctx.enter()?;
        // SAFETY: `src..src+len` is inside this allocation (checked); `dst` is a live, exclusive
        // host slice and cuMemcpyDtoH returns only once the copy is complete.
        unsafe {
            check(
                sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src, dst.len()),
                || format!("cuMemcpyDtoH(0x{src:x}, {} bytes)", dst.len()),
            )?;
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let entered = self.ctx.enter();
        // SAFETY: `self.ptr` came from cuMemAlloc in this context and is freed once. cuMemFree
        // synchronises with work that uses it only through the caller's contract (see the type's
        // documentation); an error (torn-down driver) leaves nothing to free.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        drop(entered);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::cudaError_enum as E;

    #[test]
    fn argument_errors_are_recoverable_and_context_errors_are_fatal() {
        for code in [
            E::CUDA_ERROR_INVALID_VALUE,
            E::CUDA_ERROR_OUT_OF_MEMORY,
            E::CUDA_ERROR_NOT_READY,
        ] {
            assert!(!is_fatal(code), "{code:?}");
        }
        for code in [
            E::CUDA_ERROR_ILLEGAL_ADDRESS,
            E::CUDA_ERROR_LAUNCH_FAILED,
            E::CUDA_ERROR_ECC_UNCORRECTABLE,
            E::CUDA_ERROR_CONTEXT_IS_DESTROYED,
            E::CUDA_ERROR_DEINITIALIZED,
            E::CUDA_ERROR_INVALID_HANDLE,
            E::CUDA_ERROR_UNKNOWN,
        ] {
            assert!(is_fatal(code), "{code:?}");
        }
    }

    #[test]
    fn failures_name_the_operation_and_the_code() {
        let failure = check(E::CUDA_ERROR_INVALID_VALUE, || {
            "cuMemcpy(0x10, 4 bytes)".into()
        })
        .expect_err("an error code is a failure");
        assert_eq!(
            failure.to_string(),
            "cuMemcpy(0x10, 4 bytes): CUDA_ERROR_INVALID_VALUE"
        );
        assert!(check(E::CUDA_SUCCESS, || unreachable!()).is_ok());
        let err: TransferError = failure.into();
        assert!(matches!(err, TransferError::Unavailable(m) if m.contains("cuMemcpy")));
    }
}
