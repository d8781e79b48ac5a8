//! The forward megakernel on sm_90a: one persistent launch per pass, after the device-side
//! schedule (routing layout, engine tile offsets, group maps).
//!
//! Every block takes part in the [`dispatch`] (token rows into expert order, M tile by M tile
//! from a shared queue, each tile published). Blocks `0 .. comm_blocks` (the comm role, 0 or
//! more) then [`combine`]. The blocks from the next whole pair on are the compute role, in
//! 2-block clusters: once the dispatch queue is empty they run every gate/up + SwiGLU tile as
//! soon as its rows have landed and every down tile as soon as all gate/up tiles of its rows are
//! stored (the engine's phases with [`ForwardHandover`] hooks), then their consumer warps join
//! the combine. Work is taken in the order dispatch, gate/up, down, combine from counters, so a
//! wait is always on work a running block already holds (docs/ARCHITECTURE.md). Every result is the standalone path's bits: the rows are the same copies, each GEMM
//! tile the same K loop, each token's sum the same order.

use crate::gemm::engine::run_forward_phases;
use crate::gemm::hooks::ForwardHandover;
use crate::gemm_layout::{ENGINE_THREADS, GemmParams};
use crate::megakernel_layout::{ForwardParams, PassInputs, WORK_COMBINE, WORK_GEMMS, first_compute_block};
use crate::ptx::sreg;

use super::comm::{combine, dispatch};

/// The whole pass, by every thread of the launch (see the module docs).
///
/// # Safety
/// `params` points at a valid [`ForwardParams`] and `pass` holds this pass's inputs; the counters hold an entry per engine M tile
/// the plans' groups can have, `rows_dispatched`, `gate_up_stored`, `down_stored`, `combine_next` and `dispatch_next`
/// zeroed and
/// both plans' group maps cut (tile counters zeroed) on the stream before the launch; the grid
/// is co-resident (at most the clusters that fit at once), more than `first_compute_block`
/// blocks, [`ENGINE_THREADS`] threads each.
#[inline(always)]
pub unsafe fn forward(params: *const ForwardParams, pass: PassInputs) {
    crate::ptx::declare_block_threads::<ENGINE_THREADS>();
    crate::ptx::declare_cluster_blocks::<2>();
    // SAFETY: caller contract; read-only for the whole launch (fields read where used).
    let f = unsafe { &*params };
    let block = sreg::block_idx_x();
    if block < f.comm_blocks {
        // SAFETY: caller contract.
        unsafe {
            dispatch(f, &pass);
            if f.work & WORK_COMBINE != 0 {
                combine(f, &pass);
            }
        }
    } else if block >= first_compute_block(f.comm_blocks) {
        // SAFETY: caller contract; the consumer warps are whole warps; the dispatch's shared word
        // is free before the engine carves the ring, and read by every thread before dispatch
        // returns.
        unsafe {
            dispatch(f, &pass);
            if f.work & WORK_GEMMS == 0 {
                if f.work & WORK_COMBINE != 0 {
                    combine(f, &pass);
                }
                return;
            }
            let phases = (
                ForwardHandover::<{ ForwardHandover::GATE_UP }>::new(params),
                ForwardHandover::<{ ForwardHandover::DOWN }>::new(params),
            );
            if run_forward_phases(f.gate_up as *const GemmParams, phases.0, f.down as *const GemmParams, phases.1)
                .is_some()
                && f.work & WORK_COMBINE != 0
            {
                combine(&*params, &pass);
            }
        }
    }
    // Otherwise the idle partner of an odd comm block count.
}
