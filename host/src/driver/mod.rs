//! A small safe API over cudarc's raw driver bindings (`cudarc::driver::{sys, result}`): the
//! only module of mok-host that calls the CUDA driver.
//!
//! - [`Gpu`]: one device's primary context, a stream, and the loaded kernels;
//! - [`DeviceBuffer`]: a typed allocation with upload, download and fill;
//! - [`Gpu::launch`]: a checked launch (the launch result, and with `MOK_SYNC_LAUNCHES=1` also
//!   each kernel's execution, with its name in the error);
//! - [`GpuTimer`]: event-based timing;
//! - raw-address copies and fills (`memory`), CUDA virtual memory and shareable handles
//!   ([`vmm`]) for the symmetric heaps of the expert-parallel exchange.
//!
//! cudarc loads `libcuda` lazily and panics on first use when it is missing, so [`probe`] looks
//! for the library first and turns its absence into [`MokError::NoDriver`].

mod buffer;
mod gpu;
mod memory;
pub mod vmm;

pub use buffer::{DeviceBuffer, live_device_buffers};
pub use gpu::{Gpu, GpuTimer, KernelArg, Kernels, LaunchShape};

use cudarc::driver::result::DriverError;

use crate::error::MokError;

/// Whether a CUDA driver can be loaded on this machine, without panicking when it cannot.
pub fn probe() -> Result<(), MokError> {
    // SAFETY: only tries to open the driver library with libloading; no CUDA call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(MokError::NoDriver("libcuda.so could not be loaded (no NVIDIA driver on this machine)".into()));
    }
    cudarc::driver::result::init().map_err(|e| cuda_error("cuInit", e))?;
    let count = cudarc::driver::result::device::get_count().map_err(|e| cuda_error("cuDeviceGetCount", e))?;
    if count == 0 {
        return Err(MokError::NoDriver("the driver reports no CUDA device".into()));
    }
    Ok(())
}

/// Converts a driver error into [`MokError::Cuda`] naming the call.
pub fn cuda_error(call: impl Into<String>, error: DriverError) -> MokError {
    let name = error.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let text = error.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    MokError::Cuda { call: call.into(), message: format!("{name}: {text}") }
}
