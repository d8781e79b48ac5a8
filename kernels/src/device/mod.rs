//! Device-side building blocks used by the entry points: activation math, thread indexing,
//! and the tile engine of the unfused GEMMs.

pub mod gemm;
pub mod math;

use crate::ptx::sreg;

/// This thread's index in a 1-D grid and the grid's thread count, for grid-stride loops.
#[inline(always)]
pub fn grid_thread() -> (usize, usize) {
    let threads = (sreg::block_dim_x() * sreg::grid_dim_x()) as usize;
    ((sreg::block_idx_x() * sreg::block_dim_x() + sreg::thread_idx_x()) as usize, threads)
}
