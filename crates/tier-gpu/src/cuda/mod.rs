//! The CUDA path (feature `cuda`): [`CudaTransferEngine`] moves chunks between the engine's KV
//! cache in device memory and a [`PinnedHostPool`] over one CUDA stream per direction, with
//! completion events; [`available`] says, without panicking, whether a CUDA driver and device are
//! present; [`StreamEvent`] records a [`ComputeEvent`] on a compute stream given by its raw
//! handle (the inference engine's, e.g. PyTorch's current stream).
//!
//! cudarc is built with dynamic loading: nothing here needs a CUDA toolkit to build, and the
//! driver library is looked up at run time. cudarc panics on first use when the library is
//! missing, so every entry point checks [`available`] before the first driver call.
//!
//! Architecture invariant: memory that a copy may still write belongs to its job until the job's
//! completion is reported; dropping the engine synchronises its streams first.

mod driver;
mod engine;
mod event;
mod pinned;
mod queue;

use std::sync::OnceLock;

use cudarc::driver::sys;

pub use driver::DeviceBuffer;
pub use engine::{ComputeEvent, CopyMethod, CudaEngineConfig, CudaTransferEngine};
pub use event::StreamEvent;
pub use pinned::{PinnedHostPool, REGISTER_PIECE_BYTES_DEFAULT};

/// A CUDA event handle (`CUevent`), as the engine's compute stream records it; see
/// [`CudaTransferEngine::submit_after`].
pub type CudaEvent = sys::CUevent;

/// Whether the CUDA driver library loads, initialises and sees at least one device; the error
/// says which step failed. Never panics; the answer is computed once per process.
pub fn available() -> Result<(), String> {
    static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
    ANSWER.get_or_init(probe).clone()
}

fn probe() -> Result<(), String> {
    // First guard: try to open the library ourselves (cudarc's own candidate names, among them
    // libcuda.so and libcuda.so.1) before any cudarc call that would panic without it.
    // SAFETY: only dlopen()s candidate names of the driver library, whose initialisers are
    // meant to run in any process that loads it.
    if !unsafe { sys::is_culib_present() } {
        let mut names = cudarc::get_lib_name_candidates("cuda");
        names.sort_unstable();
        names.dedup();
        return Err(format!(
            "the CUDA driver library could not be loaded (libcuda.so.1, libcuda.so and {} other \
             names tried; is the NVIDIA driver installed and on the loader path?)",
            names.len().saturating_sub(2)
        ));
    }
    // Second guard: a driver too old for a symbol, or a stub library, makes cudarc panic or
    // fail; catch both.
    let outcome = std::panic::catch_unwind(|| -> Result<i32, String> {
        let mut count = 0;
        // SAFETY: the library loads; cuInit takes no pointer, cuDeviceGetCount writes one int.
        unsafe {
            driver::check(sys::cuInit(0), || "cuInit(0)".into()).map_err(|f| f.to_string())?;
            driver::check(sys::cuDeviceGetCount(&mut count), || {
                "cuDeviceGetCount".into()
            })
            .map_err(|f| f.to_string())?;
        }
        Ok(count)
    });
    match outcome {
        Ok(Ok(count)) if count > 0 => Ok(()),
        Ok(Ok(_)) => Err("the CUDA driver loaded but reports no device".into()),
        Ok(Err(reason)) => Err(format!("the CUDA driver failed to initialise: {reason}")),
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(format!("the CUDA driver library is unusable: {message}"))
        }
    }
}
