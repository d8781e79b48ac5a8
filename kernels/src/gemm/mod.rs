//! The sm_90 tensor-core grouped GEMM engine: persistent, warp-specialised, TMA + mbarrier ring
//! + wgmma. See [`engine`].

mod ring;
mod source;
mod producer;
mod mainloop;
mod epilogue;

pub mod engine;
pub mod group_maps;
