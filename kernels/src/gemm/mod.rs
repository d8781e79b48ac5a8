//! The sm_90 tensor-core grouped GEMM engine: persistent, warp-specialised, TMA + mbarrier ring
//! + wgmma. See [`engine`].

mod epilogue;
mod gather;
pub mod hooks;
mod mainloop;
mod producer;
mod ring;
pub mod source;

pub mod engine;
pub mod group_maps;
