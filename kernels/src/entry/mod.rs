pub mod fill;
pub mod gemm;
#[cfg(mok_arch = "sm_90a")]
pub mod gemm_sm90;
#[cfg(mok_arch = "sm_90a")]
pub mod probe_sm90;
pub mod route;
pub mod rows;
