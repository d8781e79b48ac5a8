//! The sm_90 tensor-core grouped GEMM engine: persistent, warp-specialised, TMA + mbarrier ring
//! + wgmma. See [`engine`].

pub mod engine;
pub mod group_maps;
