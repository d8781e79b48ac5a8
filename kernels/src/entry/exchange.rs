//! Standalone kernels of the expert-parallel exchange: thin entry points over
//! [`crate::comm`]'s block- and warp-level steps, one launch per step and rank. Every kernel
//! takes the parameter block (device memory, see [`ExchangeParams`]) and the rank it acts as, so
//! the same PTX serves virtual ranks (P ranks in one GPU, one launch each) and real ones.
//!
//! Why one launch per step: on one GPU the virtual ranks' steps run a kernel boundary apart, so
//! every wait a kernel does is on a signal an earlier launch already gave, and no block can wait
//! on a block that is not resident. The waits are still real and bounded: a rank that never
//! signals is reported, not waited on forever.

use crate::comm::params::ExchangeParams;
use crate::comm::{Pass, RankView, combine, movers, plan};
use crate::device::grid_thread;
use crate::ptx::{smem, sreg};

/// This warp's index in the grid, and the grid's warp count (blocks are whole warps).
#[inline(always)]
fn grid_warp() -> (u32, u32) {
    let warps_per_block = sreg::block_dim_x() / 32;
    (sreg::block_idx_x() * warps_per_block + sreg::thread_idx_x() / 32, sreg::grid_dim_x() * warps_per_block)
}

/// Step 2 of the schedule (grid-stride over T·k slots): the slot-addressed map.
///
/// # Safety
/// `params` is a parameter block built by the host for this heap; `rank < world`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_prepare_tokens(params: *const ExchangeParams, rank: u32) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    unsafe { plan::prepare_tokens(&RankView::from_raw(params, rank), first, stride) };
}

/// Step 3 (one thread): publishes `epoch` — this rank's inputs and routing layout are ready.
///
/// # Safety
/// As [`mok_ep_prepare_tokens`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_publish(params: *const ExchangeParams, rank: u32, epoch: u32) {
    if sreg::block_idx_x() == 0 && sreg::thread_idx_x() == 0 {
        // SAFETY: caller contract.
        unsafe { plan::publish(&RankView::from_raw(params, rank), epoch) };
    }
}

/// Step 4 (one block, 4 bytes of dynamic shared memory): the exchange of counts and the ring
/// offsets of `rank`'s experts, with the capacity check.
///
/// # Safety
/// As [`mok_ep_prepare_tokens`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_schedule(params: *const ExchangeParams, rank: u32, epoch: u32) {
    // SAFETY: caller contract; the launch gives 4 bytes of shared memory.
    unsafe { plan::schedule_block(&RankView::from_raw(params, rank), epoch, smem::dynamic_smem_base()) };
}

/// Step 5 (grid-stride over ring rows): the inverse map, ring row → source rank and slot.
///
/// # Safety
/// As [`mok_ep_prepare_tokens`]; [`mok_ep_schedule`] ran before for this rank.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_ring_map(params: *const ExchangeParams, rank: u32) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    unsafe { plan::ring_map_rows(&RankView::from_raw(params, rank), first, stride) };
}

/// Pull mover (blocks of whole warps, 4 bytes of dynamic shared memory): `pass` 0 dispatches x
/// rows into `rank`'s ring, 1 pulls dy rows scaled by their slot weight. Waits first (bounded)
/// until every rank has published `epoch`.
///
/// # Safety
/// As [`mok_ep_ring_map`]; [`mok_ep_ring_map`] ran before for this rank.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_pull(params: *const ExchangeParams, rank: u32, pass: u32, epoch: u32) {
    // SAFETY: caller contract.
    let view = unsafe { RankView::from_raw(params, rank) };
    // SAFETY: uniform call; the launch gives 4 bytes of shared memory.
    if !unsafe { plan::wait_all_published(&view, epoch, smem::dynamic_smem_base()) } {
        return;
    }
    let (warp, warps) = grid_warp();
    // SAFETY: caller contract; whole warps.
    unsafe { movers::pull_rows(&view, Pass::from_arg(pass), warp, warps) };
}

/// Bulk-copy pull mover for forward dispatch (blocks of 32 threads,
/// [`crate::comm::params::BULK_SMEM_BYTES`] of dynamic shared memory).
///
/// # Safety
/// As [`mok_ep_pull`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_pull_bulk(params: *const ExchangeParams, rank: u32, epoch: u32) {
    // SAFETY: caller contract.
    let view = unsafe { RankView::from_raw(params, rank) };
    // The publish wait uses the first word of the mbarrier header before the barriers exist.
    // SAFETY: uniform call; the header is this block's shared memory.
    if !unsafe { plan::wait_all_published(&view, epoch, smem::dynamic_smem_base()) } {
        return;
    }
    // SAFETY: caller contract; the shared memory is sized for the bulk stages.
    unsafe { movers::pull_rows_bulk(&view, sreg::block_idx_x(), sreg::grid_dim_x()) };
}

/// Push mover (blocks of whole warps): `pass` 0 pushes forward-combine rows, 1 reverse-dispatch
/// rows, from `rows` (`[ring rows][H]` f32 on `rank`) into the token owners' slot buffers.
///
/// # Safety
/// As [`mok_ep_ring_map`]; `rows` holds the ring's result rows.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_push(params: *const ExchangeParams, rank: u32, pass: u32, rows: *const f32) {
    let (warp, warps) = grid_warp();
    // SAFETY: caller contract; whole warps.
    unsafe { movers::push_rows(&RankView::from_raw(params, rank), Pass::from_arg(pass), rows, warp, warps) };
}

/// Bulk-copy push mover (blocks of 32 threads, [`crate::comm::params::BULK_SMEM_BYTES`] of dynamic shared
/// memory).
///
/// # Safety
/// As [`mok_ep_push`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_push_bulk(
    params: *const ExchangeParams,
    rank: u32,
    pass: u32,
    rows: *const f32,
) {
    // SAFETY: caller contract.
    unsafe {
        movers::push_rows_bulk(
            &RankView::from_raw(params, rank),
            Pass::from_arg(pass),
            rows,
            sreg::block_idx_x(),
            sreg::grid_dim_x(),
        )
    };
}

/// Bounded wait until every M tile of `rank`'s ring (pass 0: x, 1: dy) has all its rows
/// (grid-stride over tiles): the check a compute warp makes before loading a tile.
///
/// # Safety
/// As [`mok_ep_ring_map`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_wait_tiles(params: *const ExchangeParams, rank: u32, pass: u32, epoch: u32) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    unsafe { plan::wait_tiles(&RankView::from_raw(params, rank), Pass::from_arg(pass), epoch, first, stride) };
}

/// The token owner's wait (grid-stride, one thread per (token tile, expert owner)): bounded wait
/// until each owner's rows of each tile have arrived for `pass` (0 forward combine, 1 dx), then
/// the baselines advance. A timeout names the owner, the tile and the rows expected and seen.
///
/// # Safety
/// As [`mok_ep_prepare_tokens`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_wait_arrivals(
    params: *const ExchangeParams,
    rank: u32,
    pass: u32,
    epoch: u32,
) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    let view = unsafe { RankView::from_raw(params, rank) };
    let pairs = (view.params.chunks * view.params.world) as usize;
    let mut pair = first;
    while pair < pairs {
        let (chunk, owner) = ((pair / view.params.world as usize) as u32, (pair % view.params.world as usize) as u32);
        // SAFETY: chunk < chunks, owner < world.
        if !unsafe { combine::wait_arrivals(&view, Pass::from_arg(pass), epoch, chunk, owner) } {
            return;
        }
        pair += stride;
    }
}

/// The token owner's combine (grid-stride over `T · H/4` quads), after
/// [`mok_ep_wait_arrivals`]: `out = bf16(base + Σ_j w_j · slot_j)` (pass 0, forward, weights from
/// `topk_weights`) or `bf16(base + Σ_j slot_j)` (pass 1, dx). `base` is `[T][H]` f32 or null;
/// `out` `[T][H]` bf16.
///
/// # Safety
/// As [`mok_ep_prepare_tokens`]; pointers as documented.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_combine(
    params: *const ExchangeParams,
    rank: u32,
    pass: u32,
    base: *const f32,
    out: *mut u16,
) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    unsafe { combine::sum_slots(&RankView::from_raw(params, rank), Pass::from_arg(pass), base, out, first, stride) };
}
