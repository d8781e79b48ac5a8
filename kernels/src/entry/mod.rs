//! The `extern "ptx-kernel"` entry points, one file per family: each is a thin wrapper that states
//! its launch contract (block size, shared memory, parameters) and calls the device code.

pub mod exchange;
pub mod fill;
pub mod gemm;
#[cfg(mok_arch = "sm_90a")]
pub mod gemm_sm90;
#[cfg(mok_arch = "sm_90a")]
pub mod probe_sm90;
pub mod route;
pub mod rows;
