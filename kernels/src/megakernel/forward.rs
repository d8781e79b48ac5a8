//! The forward megakernel on sm_90a: one persistent launch per pass, after the device-side
//! schedule (routing layout — across ranks also the exchange's counts, ring offsets and ring
//! map — engine tile offsets, group maps).
//!
//! A launch hosts one rank (`mok_sm90_forward`, a single GPU) or P ranks (`mok_sm90_forward_ranks`:
//! virtual ranks on one GPU, each holding a contiguous run of the launch's 2-block clusters, or
//! one rank per GPU). Within its rank warps take part in the [`dispatch`] (token rows into
//! expert order, 16-row chunks of the M tiles from the rank's queue, each chunk counted): every
//! warp of blocks `0 .. comm_blocks` of the rank (the comm role, 0 or more), which then
//! [`combine`] the rank's tokens; and the three spare warps of each compute block's producer
//! warpgroup (where the compute blocks share every hosted rank's tiles, every hosted rank's
//! rows, in the walk's rank order). The rank's blocks from the next whole pair on are the compute role, in 2-block
//! clusters: from the start of the launch they run every gate/up + SwiGLU tile as soon as its
//! rows have landed and every down tile as soon as all gate/up tiles of its rows are stored
//! (the engine's phases with [`ForwardHandover`] hooks), then their consumer warps combine.
//! With virtual ranks (`ForwardParams::tile_ranks`) every compute block of the launch takes
//! every rank's tiles, rank after rank within each phase, as one GPU running one rank would.
//! Across ranks each down tile's epilogue pushes its rows straight into their token owners'
//! slot buffers and raises each row's flag (`gemm::hooks::RowScatter`: the push combine). With
//! a shared expert the dispatch also copies the rank's token rows for it, and the compute blocks
//! run its gate/up tiles before the routed ones and its down tiles before the routed downs.
//! On one GPU with `ForwardParams::gather_in_producer` the routed gate/up tiles gather their
//! rows from x in their producer warp instead (`gemm::gather`), and the dispatch copies only the
//! shared expert's rows.
//! Work is taken in the order dispatch, shared gate/up, gate/up, shared down, down, combine
//! from counters, so a wait is always on work a running block already holds
//! (docs/ARCHITECTURE.md). Every result is the
//! standalone path's bits: the rows are the same copies, each GEMM tile the same K loop, each
//! token's sum the same order.

use crate::comm::RankView;
use crate::gemm::engine::{rank_slot, run_forward_phases};
use crate::gemm::hooks::ForwardHandover;
use crate::gemm_layout::{ENGINE_THREADS, GemmParams};
use crate::megakernel_layout::{
    ForwardParams, ForwardPlans, PassInputs, WORK_COMBINE, WORK_GEMMS, first_compute_block, rank_of_pair, rank_pairs,
};
use crate::ptx::memory::{ld_shared_u32, st_shared_u32};
use crate::ptx::{sreg, sync};

use super::comm::{combine, dispatch, in_walk_order, rank_view};

/// The combine, by a whole warp, unless the pass leaves it out (a benchmark's compute side).
///
/// # Safety
/// As [`forward`]; `view` is the rank's; all 32 lanes call it.
#[inline(always)]
unsafe fn combine_if_asked(f: &ForwardParams, pass: &PassInputs, view: Option<&RankView>) {
    if f.work & WORK_COMBINE != 0 {
        // SAFETY: caller contract.
        unsafe { combine(f, pass, view) };
    }
}

/// The whole pass of one rank, by every thread of the rank's `block`-th block (see the module
/// docs).
///
/// `rank()` names the rank: its parameter block `params` and its inputs `pass`. The compute
/// blocks call it again where each GEMM phase starts (the first rank of its walk) and for the
/// combine after the phases, so that no register holds the rank across the phases, where the
/// consumers' accumulators leave no room: on one GPU both are the kernel's arguments (ptxas
/// reads them from the constant bank); across ranks the rank is computed, and
/// [`shared_rank_of_block`] keeps it in shared memory. `hosted(q)` names the launch's rank q
/// the same way (launch order): across ranks the spare warps dispatch every hosted rank's rows
/// where the compute blocks share every rank's tiles ([`in_walk_order`]).
///
/// # Safety
/// `rank()` returns the same `(params, pass)` at every call, `params` pointing at the rank's
/// valid [`ForwardParams`] and `pass` holding its inputs; `hosted(q)` likewise for every
/// launch index q below the parameter blocks' `tile_ranks` (only read across ranks); `plans`,
/// if given (one GPU only), are the four plan blocks `params` points at, in phase order; the
/// counters hold an entry per engine M tile the plans' groups can have; `rows_dispatched`,
/// `gate_up_stored`, `down_stored`, `combine_next`, `dispatch_next` (and across
/// ranks every rank's `slot_ready`) zeroed and both plans' group maps cut (tile counters zeroed)
/// on the stream before the launch; the grid is co-resident (at most the clusters that fit at
/// once); the rank holds more than `first_compute_block` blocks, [`ENGINE_THREADS`] threads
/// each, pair-aligned. `RANKS` (the launch hosts ranks) exactly when `exchange` is the rank's
/// valid exchange parameter block. `params` is element `launch_index` of the launch's array of
/// parameter blocks; with `tile_ranks` > 1 that array holds that many ranks, every one with
/// the same `tile_ranks` and the same phases (a shared expert on all or none), and their blocks
/// are the whole grid. Every thread of every block calls it, a cluster's two blocks with the
/// same `params` and `block` 2q and 2q + 1.
#[inline(always)]
pub unsafe fn forward<const RANKS: bool>(
    rank: impl Fn() -> (*const ForwardParams, PassInputs) + Copy,
    hosted: impl Fn(u32) -> (*const ForwardParams, PassInputs) + Copy,
    plans: Option<&ForwardPlans>,
    block: u32,
) {
    crate::ptx::declare_block_threads::<ENGINE_THREADS>();
    crate::ptx::declare_cluster_blocks::<2>();
    let (params, pass) = rank();
    // SAFETY: caller contract; read-only for the whole launch (fields read where used).
    let f = unsafe { &*params };
    // SAFETY: caller contract.
    let view = unsafe { rank_view::<RANKS, _>(f) };
    if block < f.comm_blocks {
        // SAFETY: caller contract; every warp is whole.
        unsafe {
            dispatch(f, &pass, view.as_ref(), false);
            combine_if_asked(f, &pass, view.as_ref());
        }
    } else if block >= first_compute_block(f.comm_blocks) {
        // SAFETY: caller contract; every warp is whole. Both blocks of this cluster come here
        // with every thread (`first_compute_block` is even; `f` is the pair's), as
        // `run_forward_phases` asks.
        unsafe {
            if f.work & WORK_GEMMS == 0 {
                dispatch(f, &pass, view.as_ref(), false);
                combine_if_asked(f, &pass, view.as_ref());
                return;
            }
            // Phases: the shared expert's gate/up, the routed gate/up, the shared down, the
            // routed down (`run_forward_phases`, numbered as `ForwardHandover`'s phases); each
            // plan is read where its phase starts, from the parameter block of rank q of the
            // launch (the blocks are an array in launch order; q is this rank unless the
            // launch's compute blocks share every rank's tiles). Valid for the whole launch
            // (caller contract; the closures run inside this unsafe block).
            // With `plans` (one GPU) the plan is read from the kernel argument, the phase (a
            // constant at every call) picking a field of it; a pass without a shared expert
            // still says so through its parameter block's null plan address.
            let plan = move |phase: u32, rank: *const ForwardParams| {
                let f = &*rank;
                let in_global = (match phase {
                    ForwardHandover::SHARED_GATE_UP => f.shared_gate_up,
                    ForwardHandover::GATE_UP => f.gate_up,
                    ForwardHandover::SHARED_DOWN => f.shared_down,
                    _ => f.down,
                }) as *const GemmParams;
                match plans {
                    // The phases are 0–3; the clamp leaves the index no bounds check to fail.
                    Some(by_value) if !in_global.is_null() => {
                        &by_value.plans[phase.min(3) as usize] as *const GemmParams
                    }
                    _ => in_global,
                }
            };
            // Across ranks the spare warps follow the compute blocks' walk over the hosted ranks.
            let spare_warps = || {
                if RANKS {
                    in_walk_order!(rank, hosted, |f, pass, until_routed| {
                        dispatch(f, &pass, rank_view::<true, _>(f).as_ref(), until_routed)
                    })
                } else {
                    dispatch(f, &pass, rank_view::<RANKS, _>(f).as_ref(), false)
                }
            };
            // x only where a gathering gate/up reads it (one GPU); across ranks the dispatch
            // pulls the rows.
            let x = if RANKS { 0 } else { pass.x };
            let hooks = move |phase, rank| ForwardHandover::<RANKS>::new(rank, phase, x);
            // The ranks whose tiles this block runs, as a walk over their parameter blocks (one
            // pointer live across the phases): this rank's alone, or every rank of the launch.
            // Each phase reads its first rank again (`rank`'s docs).
            let first_rank = move || {
                let (params, _) = rank();
                let f = &*params;
                if RANKS && f.tile_ranks > 1 { params.sub(f.launch_index as usize) } else { params }
            };
            let next_rank = move |rank: *const ForwardParams| {
                let f = &*rank;
                (RANKS && f.launch_index + 1 < f.tile_ranks).then(|| rank.add(1))
            };
            if run_forward_phases(plan, hooks, spare_warps, (first_rank, next_rank)).is_some() {
                // Across ranks the rank read again (`rank`'s docs); on one GPU `f`, `pass` and
                // `view` are the kernel's arguments, which hold no register.
                if RANKS {
                    let (params, pass) = rank();
                    let f = &*params;
                    combine_if_asked(f, &pass, rank_view::<RANKS, _>(f).as_ref());
                } else {
                    combine_if_asked(f, &pass, view.as_ref());
                }
            }
        }
    }
    // Otherwise the idle partner of an odd comm block count.
}

/// As [`rank_of_block`], the rank given as a reader of the copy that thread 0 keeps in the ring's
/// slot for it ([`rank_slot`]) for the whole launch. The rank is computed (a division): held in
/// a register across the GEMM phases it does not fit beside the consumers' accumulators (ptxas
/// spilled it); read from shared memory where used, it holds none.
///
/// # Safety
/// Every thread of the block calls it, once, before anything else of the launch uses the slot
/// (it ends in a barrier of the whole block); nothing else writes the slot; the launch gives
/// the block [`ENGINE_SMEM_BYTES`](crate::gemm_layout::ENGINE_SMEM_BYTES) of dynamic shared
/// memory, which holds the slot.
#[inline(always)]
pub unsafe fn shared_rank_of_block(ranks: u32) -> (impl Fn() -> u32 + Copy, u32) {
    let (rank, block) = rank_of_block(ranks);
    // SAFETY: the slot lies in the launch's shared memory (the engine's carve), unused until
    // now (caller contract). Every thread of the block comes to the barrier (caller contract),
    // which orders thread 0's write before every thread's reads after it.
    unsafe {
        if sreg::thread_idx_x() == 0 {
            st_shared_u32(rank_slot(), rank);
        }
        sync::block_barrier();
    }
    // SAFETY: the slot holds the rank from the barrier above on, for the whole launch (caller
    // contract); the closure is only called after that barrier.
    (|| unsafe { ld_shared_u32(rank_slot()) }, block)
}

/// The rank a block of a launch hosting `ranks` ranks acts as, and its index among the rank's
/// blocks: ranks hold contiguous runs of whole pairs ([`rank_pairs`]).
#[inline(always)]
fn rank_of_block(ranks: u32) -> (u32, u32) {
    let pairs = sreg::grid_dim_x() / 2;
    let rank = rank_of_pair(sreg::block_idx_x() / 2, pairs, ranks);
    (rank, sreg::block_idx_x() - 2 * rank_pairs(pairs, ranks, rank).0)
}
