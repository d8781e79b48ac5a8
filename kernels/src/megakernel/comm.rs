//! The row-moving work of the forward megakernel on one GPU: the dispatch (token rows into
//! expert order, one engine M tile at a time from a shared queue, each published with a
//! release) and the combine (each token's slots summed in fixed order once the down tiles
//! holding them are stored).

use crate::comm::error::{self, ERROR_TIMEOUT, WAIT_ENGINE_TILE_OUTPUT};
use crate::comm::schedule::{rows_in_tile, tile_of_row};
use crate::comm::wait::wait_until;
use crate::device::rows::{combine_quads, copy_row};
use crate::gemm_layout::{GemmParams, TILE_M, TILE_N};
use crate::layout::NO_ROW;
use crate::megakernel_layout::{
    ForwardParams, PassInputs, WORK_COPY_ROWS, WORK_GEMMS, downstream_deadline, parts_per_m_tile,
};
use crate::ptx::memory::{atom_add_relaxed_gpu_u32, ld_shared_u32, st_release_gpu_u32, st_shared_u32};
use crate::ptx::{smem, sreg, sync};
use crate::tiles::group_of_tile;

/// Dispatch, by every thread of a block: engine M tiles taken one at a time from
/// `dispatch_next` (shared by every block that dispatches, so the tiles go out in increasing
/// order); each tile's rows are copied from x in expert order (a warp per row), then, after a
/// block barrier, thread 0 sets the tile's `rows_dispatched` flag with a release.
/// Waits for nothing, so whatever waits on a dispatched tile waits on work a running block is
/// already doing. Returns once the tiles are all handed out (the block has finished its own).
///
/// # Safety
/// `f` and `pass` are the pass's; the schedule (routing layout, tile offsets) was written before
/// the launch; the block's first 4 bytes of dynamic shared memory are free (the hand-out).
#[inline(always)]
pub unsafe fn dispatch(f: &ForwardParams, pass: &PassInputs) {
    // SAFETY: caller contract: the gate/up parameter block and the offsets it points at.
    unsafe {
        let p = &*(f.gate_up as *const GemmParams);
        let groups = p.groups as usize + 1;
        let tile_offsets = core::slice::from_raw_parts(p.tile_offsets as *const u32, groups);
        let row_offsets = core::slice::from_raw_parts(p.row_offsets as *const u32, groups);
        let m_tiles = tile_offsets[groups - 1];
        let (warp, warps, lane) = (sreg::thread_idx_x() / 32, sreg::block_dim_x() / 32, sreg::lane_id());
        let (x, rows, row_source) = (pass.x as *const u16, f.rows as *mut u16, f.row_source as *const u32);
        let handout = smem::dynamic_smem_base();
        loop {
            if sreg::thread_idx_x() == 0 {
                st_shared_u32(handout, atom_add_relaxed_gpu_u32(f.dispatch_next as *mut u32, 1));
            }
            sync::block_barrier();
            let tile = ld_shared_u32(handout);
            if tile >= m_tiles {
                return;
            }
            // tile < m_tiles: a group holds it.
            let g = group_of_tile(tile_offsets, tile).unwrap_or(0);
            let first = row_offsets[g] + (tile - tile_offsets[g]) * TILE_M;
            let end = (first + TILE_M).min(row_offsets[g + 1]);
            let mut row = if f.work & WORK_COPY_ROWS != 0 { first + warp } else { end };
            while row < end {
                let token = *row_source.add(row as usize) / f.top_k;
                let (src, dst) = (x.add((token * f.hidden) as usize), rows.add((row * f.hidden) as usize));
                copy_row(src as *const u32, dst as *mut u32, f.hidden / 8, lane);
                row += warps;
            }
            // Every thread's rows of the tile are written (and the hand-out read) before thread 0
            // publishes them and takes the next tile; the release orders the rows (barrier, then
            // release at GPU scope) for the acquiring producer.
            sync::block_barrier();
            if sreg::thread_idx_x() == 0 && tile != f.silent_rows_tile {
                st_release_gpu_u32((f.rows_dispatched as *mut u32).add(tile as usize), 1);
            }
        }
    }
}

/// The combine, by warp `warp` of a block's `warps` working warps (comm blocks after their
/// dispatch, compute blocks' consumer warps after their GEMM phases): tokens taken one at a time
/// from `combine_next`; each lane waits (bounded, acquire) until every down tile holding one of
/// the token's slots is stored, then the warp sums the token's row 4 columns per lane with
/// [`combine_quads`] — the shared term first, slots in order — the same arithmetic, and so the
/// same bits, as `mok_combine_slots`.
///
/// # Safety
/// As [`dispatch`]; the caller's warp is whole (all 32 lanes call this).
#[inline(always)]
pub unsafe fn combine(f: &ForwardParams, pass: &PassInputs) {
    // SAFETY: caller contract.
    unsafe {
        let down = &*(f.down as *const GemmParams);
        let groups = down.groups as usize + 1;
        let tile_offsets = core::slice::from_raw_parts(down.tile_offsets as *const u32, groups);
        let row_offsets = core::slice::from_raw_parts(down.row_offsets as *const u32, groups);
        let n_tiles = down.n.div_ceil(TILE_N);
        let lane = sreg::lane_id();
        let (slot_row, error) = (f.slot_row as *const u32, f.error as *mut u32);
        loop {
            let claimed = if lane == 0 { atom_add_relaxed_gpu_u32(f.combine_next as *mut u32, 1) } else { 0 };
            let token = sync::shfl_idx_u32(claimed, 0);
            if token >= pass.tokens {
                return;
            }
            for j in 0..if f.work & WORK_GEMMS != 0 { f.top_k } else { 0 } {
                let row = *slot_row.add((token * f.top_k + j) as usize);
                if row == NO_ROW {
                    continue;
                }
                // A routed slot's row is below the row count, so both lookups find its group.
                let tile = tile_of_row(row_offsets, tile_offsets, row, TILE_M).unwrap_or(0);
                let expected =
                    parts_per_m_tile(n_tiles, rows_in_tile(row_offsets, tile_offsets, tile, TILE_M).unwrap_or(0));
                let counter = (f.down_stored as *const u32).add(tile as usize);
                let timeout_ns = downstream_deadline(f.timeout_ns, 2);
                if let Err(seen) = wait_until(counter, false, timeout_ns, error, |v| v >= expected) {
                    error::record(error, [ERROR_TIMEOUT, WAIT_ENGINE_TILE_OUTPUT, 0, tile, expected, seen, 0, 0]);
                }
            }
            let (weights, rows, base) =
                (pass.topk_weights as *const f32, f.down_rows as *const f32, pass.shared_rows as *const f32);
            // Two groups of 4 columns per lane per step (more loads in flight).
            let mut column = 4 * lane;
            while column < f.hidden {
                let columns = (column as usize, 4 * 32);
                combine_quads::<2>(
                    slot_row,
                    weights,
                    rows,
                    base,
                    token as usize,
                    columns,
                    f.top_k,
                    f.hidden,
                    f.y as *mut u16,
                );
                column += 2 * 4 * 32;
            }
        }
    }
}
