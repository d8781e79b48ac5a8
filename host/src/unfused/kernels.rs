//! The kernels the unfused path launches, and the grid of its row kernels.

use crate::driver::Gpu;

/// Every kernel the unfused path launches (and `Gpu::new` must load).
pub const KERNEL_NAMES: &[&str] = &[
    "mok_route_rank_chunks",
    "mok_route_scan",
    "mok_route_place",
    "mok_gather_rows",
    "mok_gemm_gate_up_swiglu",
    "mok_gemm_rows_nt",
    "mok_gemm_rows_nn",
    "mok_gemm_wgrad",
    "mok_combine_slots",
    "mok_topk_weight_grad",
    "mok_gather_dy_and_topk_weight_grad",
    "mok_swiglu_backward",
    "mok_fill_u32",
    "mok_fill_random_bf16",
    "mok_add_partials_f32",
];

pub(crate) const ROW_KERNEL_THREADS: u32 = 256;

/// Threads of `mok_route_rank_chunks` (its first warp ranks a chunk; every thread clears and
/// stores the chunk's counters): the routing layout's and the exchange's schedule's first step.
pub(crate) const RANK_CHUNK_THREADS: u32 = 128;

/// Blocks for a grid-stride kernel over `work` items: enough to fill the GPU, no more.
pub(crate) fn grid_stride_blocks(gpu: &Gpu, work: usize) -> u32 {
    let needed = work.div_ceil(ROW_KERNEL_THREADS as usize).max(1);
    needed.min(gpu.multiprocessors() as usize * 8) as u32
}
