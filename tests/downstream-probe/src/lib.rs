//! Uses mok and cudarc's driver API side by side, so a build proves they compile together.

/// mok's embedded Hopper PTX and the CUDA version cudarc's bindings were generated for.
pub fn versions() -> (usize, i32) {
    (mok::PTX_SM90A.len(), cudarc::driver::sys::CUDA_VERSION as i32)
}
