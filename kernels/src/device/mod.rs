//! Device-side building blocks used by the entry points: activation math, thread indexing,
//! row arithmetic and the tile engine of the unfused GEMMs.

pub mod gemm;
pub mod math;
pub mod rows;

use crate::ptx::sreg;

/// This thread's index in a 1-D grid and the grid's thread count, for grid-stride loops.
#[inline(always)]
pub fn grid_thread() -> (usize, usize) {
    let threads = (sreg::block_dim_x() * sreg::grid_dim_x()) as usize;
    ((sreg::block_idx_x() * sreg::block_dim_x() + sreg::thread_idx_x()) as usize, threads)
}

/// Zeroes the `num_experts` u32 counters of a routing chunk at shared address `counters`, then
/// a block barrier. Block-collective; the first step of both chunk-ranking kernels.
///
/// # Safety
/// `counters` is a 4-byte aligned shared address of this block with `num_experts` u32 that
/// nothing else uses meanwhile; every thread of the block calls it in uniform control flow.
#[inline(always)]
pub unsafe fn zero_chunk_counters(counters: u32, num_experts: u32) {
    let mut e = sreg::thread_idx_x();
    while e < num_experts {
        // SAFETY: e < E, inside the caller's `num_experts` u32 at `counters`.
        unsafe { crate::ptx::memory::st_shared_u32(counters + 4 * e, 0) };
        e += sreg::block_dim_x();
    }
    // SAFETY: every thread of the block, in uniform control flow (caller contract).
    unsafe { crate::ptx::sync::block_barrier() };
}

/// After the ranking: a block barrier, then the chunk's counters to row `chunk` of the
/// `[chunks][num_experts]` count matrix. Block-collective; the last step of both chunk-ranking
/// kernels.
///
/// # Safety
/// `chunk_counts` holds `(chunk + 1) · num_experts` words; `counters` as in
/// [`zero_chunk_counters`]; every thread of the block calls it in uniform control flow.
#[inline(always)]
pub unsafe fn store_chunk_counters(counters: u32, num_experts: u32, chunk: u32, chunk_counts: *mut u32) {
    // SAFETY: every thread of the block, in uniform control flow (caller contract).
    unsafe { crate::ptx::sync::block_barrier() };
    let mut e = sreg::thread_idx_x();
    while e < num_experts {
        // SAFETY: e < E inside this chunk's row (caller contract); shared counters as above.
        unsafe {
            *chunk_counts.add((chunk * num_experts + e) as usize) = crate::ptx::memory::ld_shared_u32(counters + 4 * e)
        };
        e += sreg::block_dim_x();
    }
}
