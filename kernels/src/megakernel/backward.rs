//! The backward megakernel on sm_90a (`mok_sm90_backward`): one persistent launch per pass,
//! after the device-side schedule (the engine tile offsets of the forward's routing, every
//! plan's group maps, one memset of the pass counters).
//!
//! Every block takes part in the [`gather`] (dy rows into expert order, scaled by the slot
//! weight, M tile by M tile from one queue, each tile published; the same warp also reduces the
//! slot-weight gradient `⟨dy[t], out[row]⟩` of each row it gathers). Blocks `0 .. comm_blocks`
//! then only run the [`combine_dx`]; the blocks from the next whole pair on are the compute
//! role, in 2-block clusters: the down projection's data gradient with the SwiGLU backward in its
//! epilogue (d_gate, d_up), the gate/up data gradient (dx rows) and the three weight gradients,
//! each tile as soon as what it reads is there (the engine's phases with [`BackwardHandover`]
//! hooks), then their consumer warps join the combine. Work is taken in the order gather, down
//! dgrad, gate/up dgrad, weight gradients, combine, so a wait is always on work a running block
//! already holds (docs/ARCHITECTURE.md). Every result is the engine path's bits: the same
//! scaled copies, the same dot products in the same order, each GEMM tile the same K loop and
//! the same epilogue arithmetic, each token's sum the same order.

use crate::comm::error::{self, ERROR_TIMEOUT, WAIT_ENGINE_TILE_DX};
use crate::comm::wait::wait_until;
use crate::device::rows::{combine_quads, gather_scaled_row_and_dot};
use crate::gemm::engine::run_backward_phases;
use crate::gemm::hooks::BackwardHandover;
use crate::gemm_layout::{ENGINE_THREADS, GemmParams, TILE_M, TILE_N};
use crate::layout::NO_ROW;
use crate::megakernel_layout::{
    BackwardParams, PassInputs, WORK_COMBINE, WORK_COPY_ROWS, WORK_GEMMS, downstream_deadline, first_compute_block,
};
use crate::ptx::memory::{atom_add_relaxed_gpu_u32, ld_shared_u32, st_release_gpu_u32, st_shared_u32};
use crate::ptx::{smem, sreg, sync};
use crate::tiles::group_of_tile;

use super::comm::stored_tile_of_row;

/// The gather, by every thread of a block: engine M tiles taken one at a time from
/// `gather_next`; each tile's rows are written in expert order (a warp per row) as
/// `bf16(w[t,j] · dy[t])`, and the warp's sum of `dy[t] · out[row]` (the forward's f32
/// down-projection row) is the slot's d_topk_weight; then, after a block barrier, thread 0
/// sets the tile's `rows_gathered` flag with a release. Waits for nothing. Returns once the
/// tiles are all handed out.
///
/// # Safety
/// `b` and `pass` are the pass's; the schedule was written before the launch; the block's first
/// 4 bytes of dynamic shared memory are free.
#[inline(always)]
pub unsafe fn gather(b: &BackwardParams, pass: &PassInputs) {
    // SAFETY: caller contract: the down-dgrad parameter block and the offsets it points at.
    unsafe {
        let p = &*(b.down_dgrad as *const GemmParams);
        let groups = p.groups as usize + 1;
        let tile_offsets = core::slice::from_raw_parts(p.tile_offsets as *const u32, groups);
        let row_offsets = core::slice::from_raw_parts(p.row_offsets as *const u32, groups);
        let m_tiles = tile_offsets[groups - 1];
        let (warp, warps, lane) = (sreg::thread_idx_x() / 32, sreg::block_dim_x() / 32, sreg::lane_id());
        let (dy, weights) = (pass.x as *const u16, pass.topk_weights as *const f32);
        let (row_source, out, d_rows) = (b.row_source as *const u32, b.down_rows as *const f32, b.d_rows as *mut u16);
        let h = b.hidden as usize;
        let copy = b.work & WORK_COPY_ROWS != 0;
        let handout = smem::dynamic_smem_base();
        loop {
            if sreg::thread_idx_x() == 0 {
                st_shared_u32(handout, atom_add_relaxed_gpu_u32(b.gather_next as *mut u32, 1));
            }
            sync::block_barrier();
            let tile = ld_shared_u32(handout);
            if tile >= m_tiles {
                return;
            }
            let g = group_of_tile(tile_offsets, tile).unwrap_or(0);
            let first = row_offsets[g] + (tile - tile_offsets[g]) * TILE_M;
            let end = (first + TILE_M).min(row_offsets[g + 1]);
            let mut row = if copy { first + warp } else { end };
            while row < end {
                let slot = *row_source.add(row as usize);
                let token = (slot / b.top_k) as usize;
                let r = row as usize;
                let partial = gather_scaled_row_and_dot(
                    dy.add(token * h),
                    out.add(r * h),
                    d_rows.add(r * h),
                    *weights.add(slot as usize),
                    b.hidden,
                    lane,
                );
                let total = sync::warp_sum_f32(partial);
                if lane == 0 {
                    *(b.d_topk_weights as *mut f32).add(slot as usize) = total;
                }
                row += warps;
            }
            // Every thread's rows of the tile are written (and the hand-out read) before thread 0
            // publishes them (barrier, then release at GPU scope) and takes the next tile.
            sync::block_barrier();
            if sreg::thread_idx_x() == 0 && tile != b.silent_rows_tile {
                st_release_gpu_u32((b.rows_gathered as *mut u32).add(tile as usize), 1);
            }
        }
    }
}

/// The dx combine, by a whole warp (comm blocks after their gather, compute blocks' consumer
/// warps after their GEMM phases): tokens taken one at a time from `combine_next`; each lane
/// waits (bounded, acquire) until the gate/up dgrad tile holding each routed slot's row is
/// stored, then the warp sums `dx[t] = bf16(shared_dx[t] + Σ_j d_in[row(t,j)])` with
/// [`combine_quads`] (the shared term first, slots in order: the bits of `mok_combine_slots`).
/// A dropped slot's d_topk_weight is written here, as 0.
///
/// # Safety
/// As [`gather`]; all 32 lanes call it.
#[inline(always)]
pub unsafe fn combine_dx(b: &BackwardParams, pass: &PassInputs) {
    if b.work & WORK_COMBINE == 0 {
        return;
    }
    // SAFETY: caller contract.
    unsafe {
        let p = &*(b.gate_up_dgrad as *const GemmParams);
        let n_tiles = p.n.div_ceil(TILE_N);
        let lane = sreg::lane_id();
        let (slot_row, error) = (b.slot_row as *const u32, b.error as *mut u32);
        loop {
            let claimed = if lane == 0 { atom_add_relaxed_gpu_u32(b.combine_next as *mut u32, 1) } else { 0 };
            let token = sync::shfl_idx_u32(claimed, 0);
            if token >= pass.tokens {
                return;
            }
            for j in 0..b.top_k {
                let slot = token * b.top_k + j;
                let row = *slot_row.add(slot as usize);
                if row == NO_ROW {
                    if lane == 0 {
                        *(b.d_topk_weights as *mut f32).add(slot as usize) = 0.0;
                    }
                    continue;
                }
                if b.work & WORK_GEMMS == 0 {
                    continue;
                }
                let (tile, expected) = stored_tile_of_row(p, row, n_tiles);
                let counter = (b.gate_up_dgrad_stored as *const u32).add(tile as usize);
                let timeout_ns = downstream_deadline(b.timeout_ns, 2);
                if let Err(seen) = wait_until(counter, false, timeout_ns, error, |v| v >= expected) {
                    error::record(error, [ERROR_TIMEOUT, WAIT_ENGINE_TILE_DX, 0, tile, expected, seen, 0, 0]);
                }
            }
            let mut column = 4 * lane;
            while column < b.hidden {
                combine_quads::<2>(
                    slot_row,
                    core::ptr::null(),
                    b.d_in_rows as *const f32,
                    pass.shared_rows as *const f32,
                    token as usize,
                    (column as usize, 4 * 32),
                    b.top_k,
                    b.hidden,
                    b.dx as *mut u16,
                );
                column += 2 * 4 * 32;
            }
        }
    }
}

/// The whole backward pass of one rank by every thread of its `block`-th block (see the module
/// docs).
///
/// # Safety
/// `params` points at the rank's valid [`BackwardParams`] and `pass` holds its inputs (dy, the
/// slot weights, the shared expert's dx rows or 0, T); the forward of the same routing ran
/// before on the stream (its down rows, pre-activations, hidden rows and gathered rows are what
/// this pass reads); the counters hold an entry per engine M tile the plans' groups can have,
/// zeroed with the queues, and every plan's group maps cut (tile counters zeroed) on the stream
/// before the launch; the grid is co-resident; the rank holds more than `first_compute_block`
/// blocks, [`ENGINE_THREADS`] threads each, pair-aligned.
#[inline(always)]
pub unsafe fn backward(params: *const BackwardParams, pass: PassInputs, block: u32) {
    crate::ptx::declare_block_threads::<ENGINE_THREADS>();
    crate::ptx::declare_cluster_blocks::<2>();
    // SAFETY: caller contract; read-only for the whole launch.
    let b = unsafe { &*params };
    if block < b.comm_blocks {
        // SAFETY: caller contract.
        unsafe {
            gather(b, &pass);
            combine_dx(b, &pass);
        }
    } else if block >= first_compute_block(b.comm_blocks) {
        // SAFETY: caller contract; the gather's shared word is free before the engine carves
        // the ring, and read by every thread before the gather returns.
        unsafe {
            gather(b, &pass);
            if b.work & WORK_GEMMS == 0 {
                combine_dx(b, &pass);
                return;
            }
            let phases = run_backward_phases(
                (b.down_dgrad as *const GemmParams, BackwardHandover::<{ BackwardHandover::DOWN_DGRAD }>::new(params)),
                (
                    b.gate_up_dgrad as *const GemmParams,
                    BackwardHandover::<{ BackwardHandover::GATE_UP_DGRAD }>::new(params),
                ),
                b.wgrad.map(|p| p as *const GemmParams),
                (
                    BackwardHandover::<{ BackwardHandover::WGRAD_DOWN }>::new(params),
                    BackwardHandover::<{ BackwardHandover::WGRAD_GATE_UP }>::new(params),
                ),
            );
            if phases.is_some() {
                combine_dx(b, &pass);
            }
        }
    }
    // Otherwise the idle partner of an odd comm block count.
}
