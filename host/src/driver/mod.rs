//! A small safe API over cudarc's raw driver bindings (`cudarc::driver::{sys, result}`): the
//! only module of mok-host that calls the CUDA driver.
//!
//! - [`Gpu`]: one device's primary context, a stream, and the loaded kernels;
//! - [`DeviceBuffer`]: a typed allocation with upload, download and fill;
//! - `Gpu::launch` (crate-private and `unsafe`: it reads a positional argument list): a checked
//!   launch (the launch result, and with `MOK_SYNC_LAUNCHES=1` also each kernel's execution,
//!   with its name in the error);
//! - [`GpuTimer`]: event-based timing;
//! - raw-address copies and fills (`memory`), CUDA virtual memory and shareable handles
//!   ([`vmm`]) for the symmetric heaps of the expert-parallel exchange.
//!
//! cudarc loads `libcuda` lazily and panics on first use when it is missing, so [`probe`] looks
//! for the library first and turns its absence into [`MokError::NoDriver`].

mod buffer;
mod gpu;
mod graph;
mod memory;
mod slice;
pub mod vmm;

pub use buffer::{DeviceBuffer, live_device_buffers};
pub(crate) use gpu::PlacedViews;
pub use gpu::{Gpu, GpuTimer, KernelArg, KernelImage, Kernels, LaunchShape, LoadedKernels};
pub use graph::CapturedGraph;
pub(crate) use slice::check_aligned;
pub use slice::{DeviceSlice, DeviceSliceMut};

use cudarc::driver::result::DriverError;

use crate::error::MokError;

/// Whether a CUDA driver can be loaded on this machine, without panicking when it cannot.
pub fn probe() -> Result<(), MokError> {
    if !driver_library_present() {
        return Err(MokError::NoDriver("libcuda.so could not be loaded (no NVIDIA driver on this machine)".into()));
    }
    cudarc::driver::result::init().map_err(|e| cuda_error("cuInit", e))?;
    let count = cudarc::driver::result::device::get_count().map_err(|e| cuda_error("cuDeviceGetCount", e))?;
    if count == 0 {
        return Err(MokError::NoDriver("the driver reports no CUDA device".into()));
    }
    Ok(())
}

/// Whether the CUDA driver library can be opened: `libcuda.so` or the driver package's
/// `libcuda.so.1` (some installs have only the versioned name), `nvcuda.dll` on Windows. cudarc's
/// own check (`is_culib_present`) exists only when cudarc loads the library at run time; in a
/// graph where another crate makes cudarc link it (candle: `dynamic-linking`) this one still
/// compiles, and is then trivially true.
fn driver_library_present() -> bool {
    use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
    let plain = ["cuda", "nvcuda"].map(|name| format!("{DLL_PREFIX}{name}{DLL_SUFFIX}"));
    let versioned = format!("{DLL_PREFIX}cuda{DLL_SUFFIX}.1");
    plain.into_iter().chain([versioned]).any(|name| {
        // SAFETY: opening the NVIDIA driver library runs only its initialisers, which have no
        // preconditions; no CUDA call is made and the handle is closed at once.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

/// Converts a driver error into [`MokError::Cuda`] naming the call.
pub fn cuda_error(call: impl Into<String>, error: DriverError) -> MokError {
    let name = error.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let text = error.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    MokError::Cuda { call: call.into(), message: format!("{name}: {text}") }
}
