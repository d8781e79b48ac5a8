//! Entry points of the sm_90a tensor-core GEMM engine (see [`crate::gemm::engine`]): 384
//! threads, `gemm_layout::ENGINE_SMEM_BYTES` of dynamic shared memory, a persistent grid (one
//! block per SM is typical), one pointer to a [`GemmParams`] in device memory.

use crate::gemm::engine::{Variant, run};
use crate::gemm::group_maps::write_group_maps;
use crate::gemm::hooks::{Counters, Gathering, RowGather, Standalone};
use crate::gemm_layout::{GemmParams, TileCounters};

/// Forward gate/up projection with SwiGLU fused.
///
/// # Safety
/// `params` valid for the `GATE_UP` variant, its `tile_counter` zeroed by `mok_sm90_group_maps`
/// on the same stream since the last engine launch with these params.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_gemm_gate_up(params: *const GemmParams) {
    // SAFETY: caller contract; every thread of every block runs this kernel to here.
    unsafe { run::<{ Variant::GATE_UP }, _>(params, Standalone) }
}

/// [`mok_sm90_gemm_gate_up`] with the rows read through the routing layout instead of a
/// gathered copy: row `r` of the plan is row `row_source[r] / top_k` of `x` (`[T][H]` bf16 rows
/// `pitch_bytes` apart), gathered by the producer warp into each stage (`gemm::gather`). The
/// plan's A map is unused.
///
/// # Safety
/// As [`mok_sm90_gemm_gate_up`]; `x` a live `[T][H]` bf16 tensor with 16-byte aligned rows
/// `pitch_bytes` apart (H the plan's `k`), `row_source` a live `[rows]` u32 array with, for
/// every row of the plan's groups, an entry below `T · top_k`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_gemm_gate_up_gathering(
    params: *const GemmParams,
    x: u64,
    row_source: *const u32,
    top_k: u32,
    pitch_bytes: u32,
) {
    let rows = RowGather { x, row_source, top_k, pitch_bytes };
    // SAFETY: caller contract; every thread of every block runs this kernel to here.
    unsafe { run::<{ Variant::GATE_UP }, _>(params, Gathering(rows)) }
}

/// Row-grouped `A · Bᵀ`, f32 out (down projection).
///
/// # Safety
/// `params` valid for the `ROWS_NT` variant, its `tile_counter` zeroed by `mok_sm90_group_maps`
/// on the same stream since the last engine launch with these params.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_gemm_rows_nt(params: *const GemmParams) {
    // SAFETY: caller contract; every thread of every block runs this kernel to here.
    unsafe { run::<{ Variant::ROWS_NT }, _>(params, Standalone) }
}

/// Row-grouped `A · Bᵀ`, bf16 out.
///
/// # Safety
/// `params` valid for the `ROWS_NT_BF16` variant, its `tile_counter` zeroed by
/// `mok_sm90_group_maps` on the same stream since the last engine launch with these params.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_gemm_rows_nt_bf16(params: *const GemmParams) {
    // SAFETY: caller contract; every thread of every block runs this kernel to here.
    unsafe { run::<{ Variant::ROWS_NT_BF16 }, _>(params, Standalone) }
}

/// Row-grouped `A · B` with N-major weights, up to two K segments, f32 out (data gradients).
///
/// # Safety
/// `params` valid for the `ROWS_NN` variant, its `tile_counter` zeroed by `mok_sm90_group_maps`
/// on the same stream since the last engine launch with these params.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_gemm_rows_nn(params: *const GemmParams) {
    // SAFETY: caller contract; every thread of every block runs this kernel to here.
    unsafe { run::<{ Variant::ROWS_NN }, _>(params, Standalone) }
}

/// Per-group weight gradient, rows reduced in order, no split-K.
///
/// # Safety
/// `params` valid for the `WGRAD` variant, its `tile_counter` zeroed by `mok_sm90_group_maps`
/// on the same stream since the last engine launch with these params.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_gemm_wgrad(params: *const GemmParams) {
    // SAFETY: caller contract; every thread of every block runs this kernel to here.
    unsafe { run::<{ Variant::WGRAD }, _>(params, Standalone) }
}

/// [`mok_sm90_gemm_wgrad`] with B's rows read through the routing layout instead of a gathered
/// copy: K row `r` of a group is row `row_source[r] / top_k` of `x` (`[T][N]` bf16 rows
/// `pitch_bytes` apart), gathered by the producer warp into each stage (`gemm::gather`): the
/// gate and up weight gradients over the tokens. The plan's B map is unused.
///
/// # Safety
/// As [`mok_sm90_gemm_wgrad`]; `x` a live `[T][N]` bf16 tensor with 16-byte aligned rows
/// `pitch_bytes` apart (N the plan's `n`), `row_source` a live `[rows]` u32 array with, for
/// every row of the plan's groups, an entry below `T · top_k`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_gemm_wgrad_gathering(
    params: *const GemmParams,
    x: u64,
    row_source: *const u32,
    top_k: u32,
    pitch_bytes: u32,
) {
    let rows = RowGather { x, row_source, top_k, pitch_bytes };
    // SAFETY: caller contract; every thread of every block runs this kernel to here.
    unsafe { run::<{ Variant::WGRAD }, _>(params, Gathering(rows)) }
}

/// [`mok_sm90_gemm_gate_up`] inside a persistent pass: before loading a tile's rows the producer
/// waits (bounded) until `counters.rows_landed` of its M tile reaches the pass's epoch, and each
/// consumer warpgroup bumps `counters.tiles_stored` once its part of the output is visible. Not
/// yet run on a GPU: assembled by ptxas only, the first piece of the forward megakernel.
///
/// # Safety
/// As [`mok_sm90_gemm_gate_up`]; `counters` a valid [`TileCounters`] whose arrays hold one
/// entry per engine M tile of the launch.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_gemm_gate_up_counted(
    params: *const GemmParams,
    counters: *const TileCounters,
) {
    // SAFETY: caller contract; every thread of every block runs this kernel to here.
    unsafe { run::<{ Variant::GATE_UP }, _>(params, Counters::new(counters)) }
}

/// [`mok_sm90_gemm_rows_nt`] with the hand-over of [`mok_sm90_gemm_gate_up_counted`] (the down
/// projection waits for the hidden rows its gate/up tiles stored). Not yet run on a GPU.
///
/// # Safety
/// As [`mok_sm90_gemm_gate_up_counted`], for the `ROWS_NT` variant.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_gemm_rows_nt_counted(
    params: *const GemmParams,
    counters: *const TileCounters,
) {
    // SAFETY: caller contract; every thread of every block runs this kernel to here.
    unsafe { run::<{ Variant::ROWS_NT }, _>(params, Counters::new(counters)) }
}

/// Rewrites `GemmParams::group_maps` from the device-written row offsets; launched before each
/// engine launch on the same stream. `GROUP_MAP_WARPS · 32` threads,
/// `GROUP_MAP_SMEM_BYTES` of dynamic shared memory, any grid.
///
/// # Safety
/// As [`write_group_maps`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_group_maps(params: *const GemmParams) {
    // SAFETY: caller contract.
    unsafe { write_group_maps(params) }
}

/// [`mok_sm90_group_maps`] for several plans in one launch (a megakernel pass's plans, of every
/// rank): block row `blockIdx.y` cuts the maps of plan `plans[blockIdx.y]`; the grid's x extent
/// covers the plan with the most groups (the others' extra blocks find no group). One launch
/// instead of one per plan: the schedule before a pass is mostly launch latency.
///
/// # Safety
/// `plans` holds `gridDim.y` addresses of parameter blocks, each valid as for
/// [`write_group_maps`]; no two are the same plan.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_group_maps_plans(plans: *const u64) {
    // SAFETY: caller contract: blockIdx.y < gridDim.y entries.
    unsafe { write_group_maps(*plans.add(crate::ptx::sreg::block_idx_y() as usize) as *const GemmParams) }
}

/// The forward megakernel (`crate::megakernel::forward`): dispatch, gate/up + SwiGLU, down and
/// combine in one persistent launch. 384 threads, `gemm_layout::ENGINE_SMEM_BYTES` of dynamic
/// shared memory, 2-block clusters, a co-resident grid. `plans` are the four plans by value
/// (`megakernel_layout::ForwardPlans`: the bytes of the blocks `params` points at, read from
/// the constant bank instead). `x` `[T][H]` bf16, `topk_weights` `[T·k]` f32, `shared_rows`
/// `[T][H]` f32 (or null) and the token count `tokens` are the pass's inputs
/// (`megakernel_layout::PassInputs`).
///
/// # Safety
/// As [`crate::megakernel::forward::forward`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_forward(
    params: *const crate::megakernel_layout::ForwardParams,
    plans: crate::megakernel_layout::ForwardPlans,
    x: *const u16,
    topk_weights: *const f32,
    shared_rows: *const f32,
    tokens: u32,
) {
    let pass = crate::megakernel_layout::PassInputs {
        x: x as u64,
        topk_weights: topk_weights as u64,
        shared_rows: shared_rows as u64,
        tokens,
        reserved: 0,
    };
    // SAFETY: caller contract; every thread runs this kernel to here, a cluster's two blocks with
    // indices 2q and 2q + 1.
    unsafe {
        crate::megakernel::forward::forward::<false>(
            move || (params, pass),
            move |_| (params, pass),
            Some(&plans),
            crate::ptx::sreg::block_idx_x(),
        )
    }
}

/// The forward megakernel hosting `ranks` expert-parallel ranks in one launch: `params` and
/// `inputs` hold one block per rank; each rank runs on its own contiguous run of the grid's
/// 2-block clusters (`megakernel_layout::rank_pairs`), as [`mok_sm90_forward`] does on one GPU.
///
/// # Safety
/// As [`crate::megakernel::forward::forward`] for every rank; `ranks` ≥ 1 blocks at `params`
/// and at `inputs`; the grid holds at least `ranks` pairs, and every rank's share is large
/// enough for its comm blocks and a compute pair.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_forward_ranks(
    params: *const crate::megakernel_layout::ForwardParams,
    inputs: *const crate::megakernel_layout::PassInputs,
    ranks: u32,
) {
    // SAFETY: caller contract: rank < ranks. Every thread runs this kernel to here, first
    // thing, and nothing else of it writes the rank's slot; a cluster's two blocks act as the
    // same rank's 2q and 2q + 1 (ranks hold whole pairs). `rank()` reads the slot, so it gives
    // the same parameter block and inputs at every call.
    unsafe {
        let (own_rank, block) = crate::megakernel::forward::shared_rank_of_block(ranks);
        let rank = move || {
            let index = own_rank() as usize;
            (params.add(index), *inputs.add(index))
        };
        // Rank q of the launch, for q below the blocks' `tile_ranks` (at most `ranks`).
        let hosted = move |q: u32| (params.add(q as usize), *inputs.add(q as usize));
        crate::megakernel::forward::forward::<true>(rank, hosted, None, block)
    }
}

/// The backward megakernel on one GPU: the whole backward pass of the routed experts (gather,
/// slot-weight gradients, both data gradients with the SwiGLU backward between them, the three
/// weight gradients, the dx combine) in one launch. The pass's inputs are arguments, as in
/// [`mok_sm90_forward`]: dy, the slot weights, the shared expert's f32 dx rows (null for none)
/// and T; then the forward's token rows x, which the gate and up weight gradients read when
/// they gather B in their producers (`BackwardParams::gather_in_producer`; null otherwise).
///
/// # Safety
/// As [`crate::megakernel::backward::backward`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_backward(
    params: *const crate::megakernel_layout::BackwardParams,
    dy: *const u16,
    topk_weights: *const f32,
    shared_dx: *const f32,
    tokens: u32,
    x: *const u16,
) {
    let pass = crate::megakernel_layout::PassInputs {
        x: dy as u64,
        topk_weights: topk_weights as u64,
        shared_rows: shared_dx as u64,
        tokens,
        reserved: 0,
    };
    // SAFETY: caller contract; every thread runs this kernel to here, a cluster's two blocks with
    // indices 2q and 2q + 1.
    unsafe {
        crate::megakernel::backward::backward::<false>(
            move || (params, pass),
            move |_| (params, pass),
            crate::ptx::sreg::block_idx_x(),
            x as u64,
        )
    }
}

/// The backward megakernel hosting `ranks` expert-parallel ranks in one launch (every virtual
/// rank on one GPU, or a process's one rank): `params` and `inputs` hold one block per rank (dy, the slot weights, the shared
/// expert's dx rows, T); each rank runs on its own contiguous run of the grid's 2-block clusters,
/// as in [`mok_sm90_forward_ranks`].
///
/// # Safety
/// As [`crate::megakernel::backward::backward`] for every rank; `ranks` ≥ 1 blocks at `params`
/// and at `inputs`; the grid holds at least `ranks` pairs and every rank's share is large enough
/// for its comm blocks and a compute pair; every rank's `slot_ready` flags cleared before the
/// launch, and, with ranks in other processes, every rank's dy and clearing published and that
/// publish waited for on this stream before the launch (`mok_ep_wait_published`).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_sm90_backward_ranks(
    params: *const crate::megakernel_layout::BackwardParams,
    inputs: *const crate::megakernel_layout::PassInputs,
    ranks: u32,
) {
    // SAFETY: caller contract: rank < ranks. Every thread runs this kernel to here, first
    // thing, and nothing else of it writes the rank's slot (no phase of the backward touches
    // it: `gemm::engine::rank_slot`); a cluster's two blocks act as the same rank's 2q and
    // 2q + 1 (ranks hold whole pairs). `rank()` reads the slot, so it gives the same parameter
    // block and inputs at every call.
    unsafe {
        let (own_rank, block) = crate::megakernel::forward::shared_rank_of_block(ranks);
        let rank = move || {
            let index = own_rank() as usize;
            (params.add(index), *inputs.add(index))
        };
        // Rank q of the launch, for q below the blocks' `tile_ranks` (at most `ranks`).
        let hosted = move |q: u32| (params.add(q as usize), *inputs.add(q as usize));
        crate::megakernel::backward::backward::<true>(rank, hosted, block, 0)
    }
}
