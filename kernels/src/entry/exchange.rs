//! Standalone kernels of the expert-parallel exchange: thin entry points over
//! [`crate::comm`]'s block- and warp-level steps, one launch per step. Every kernel takes the
//! parameter block (device memory, see [`ExchangeParams`]) and `first_rank`: the blocks of grid
//! row `blockIdx.y` act as rank `first_rank + blockIdx.y`, so one launch can run a step for
//! every virtual rank of a GPU (a grid `P` rows high: the host does so for the schedule's
//! steps) or for one rank (one row: the movers, launched per rank). The x dimension is each
//! rank's own grid.
//!
//! Why one launch per step: the steps run a kernel boundary apart, so every wait a kernel does
//! is on a signal an earlier launch already gave, and no block can wait on a block that is not
//! resident. Within a step no rank reads what another rank writes in the same step. The waits
//! are still real and bounded: a rank that never signals is reported, not waited on forever.

use crate::comm::params::{CLEAR_SLOT_READY, ExchangeParams};
use crate::comm::{Pass, RankView, combine, movers, plan};
use crate::device::grid_thread;
use crate::ptx::{smem, sreg};

/// The rank this block acts as: `first_rank` plus its grid row.
#[inline(always)]
fn acting_rank(first_rank: u32) -> u32 {
    first_rank + sreg::block_idx_y()
}

/// The exchange's view for this block ([`acting_rank`]).
///
/// # Safety
/// `params` is a parameter block built by the host for this heap and the acting rank `< world`.
#[inline(always)]
unsafe fn view(params: *const ExchangeParams, first_rank: u32) -> RankView<'static> {
    // SAFETY: caller contract.
    unsafe { RankView::from_raw(params, acting_rank(first_rank)) }
}

/// This warp's index in the grid, and the grid's warp count (blocks are whole warps).
#[inline(always)]
fn grid_warp() -> (u32, u32) {
    let warps_per_block = sreg::block_dim_x() / 32;
    (sreg::block_idx_x() * warps_per_block + sreg::thread_idx_x() / 32, sreg::grid_dim_x() * warps_per_block)
}

/// Before a pass (grid-stride over T·k slots): zeroes the acting rank's signals named in `what`
/// ([`CLEAR_SLOT_READY`]; see `HeapRegions::slot_ready` for when its flags may be cleared).
///
/// # Safety
/// As [`mok_ep_prepare_tokens`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_clear_signals(params: *const ExchangeParams, first_rank: u32, what: u32) {
    // SAFETY: caller contract.
    let view = unsafe { view(params, first_rank) };
    let r = &view.params.regions;
    let (first, stride) = grid_thread();
    if what & CLEAR_SLOT_READY != 0 {
        let slots = (view.params.tokens * view.params.top_k) as usize;
        let flags: *mut u32 = view.local(r.slot_ready);
        let mut slot = first;
        while slot < slots {
            // SAFETY: slot < T·k, the region's length.
            unsafe { *flags.add(slot) = 0 };
            slot += stride;
        }
    }
}

/// Step 1a of the schedule: the routing layout's chunk ranking of the acting rank's own slots
/// (`mok_route_rank_chunks` over its heap regions: one block per chunk, `RANK_CHUNK_THREADS`
/// threads, `4 · E` bytes of dynamic shared memory).
///
/// # Safety
/// As [`mok_ep_prepare_tokens`]; the grid is `chunks` blocks wide.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_route_chunks(params: *const ExchangeParams, first_rank: u32) {
    // SAFETY: caller contract.
    let view = unsafe { view(params, first_rank) };
    let (p, r) = (view.params, &view.params.regions);
    // SAFETY: the regions hold what the kernel documents for this shape (`HeapRegions::new`);
    // every thread of the block runs this kernel to here.
    unsafe {
        super::route::rank_chunks_block(
            view.local(r.topk_ids),
            p.tokens,
            p.top_k,
            p.num_experts,
            view.local(r.chunk_counts),
            view.local(r.slot_rank),
            view.local(r.route_error),
        )
    };
}

/// Step 1b (one block of 32 to 1024 threads per rank): the routing layout's scan
/// (`mok_route_scan` over the acting rank's heap regions).
///
/// # Safety
/// As [`mok_ep_route_chunks`]' parameters, after it; one block per rank, each of 32 to 1024
/// threads (its first warp whole: the prefix's shuffles name every lane).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_route_scan(params: *const ExchangeParams, first_rank: u32) {
    // SAFETY: caller contract.
    let view = unsafe { view(params, first_rank) };
    let (p, r) = (view.params, &view.params.regions);
    // SAFETY: as in `mok_ep_route_chunks`; one block with a whole first warp (caller
    // contract), every thread of which runs this kernel to here.
    unsafe {
        super::route::scan_block(
            view.local(r.chunk_counts),
            p.chunks,
            p.num_experts,
            view.local(r.expert_counts),
            view.local(r.row_offsets),
            view.local(r.tile_offsets),
        )
    };
}

/// Step 1c (one thread per token): the routing layout's slot placement (`mok_route_place` over
/// the acting rank's heap regions).
///
/// # Safety
/// As [`mok_ep_route_chunks`], after [`mok_ep_route_scan`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_route_place(params: *const ExchangeParams, first_rank: u32) {
    // SAFETY: caller contract.
    let view = unsafe { view(params, first_rank) };
    let (p, r) = (view.params, &view.params.regions);
    // SAFETY: as in `mok_ep_route_chunks`.
    unsafe {
        super::route::place_slots(
            view.local(r.topk_ids),
            view.local(r.slot_rank),
            view.local(r.chunk_counts),
            view.local(r.row_offsets),
            p.tokens,
            p.top_k,
            p.num_experts,
            view.local(r.slot_row),
            view.local(r.row_source),
        )
    };
}

/// Step 2 of the schedule (grid-stride over T·k slots): the slot-addressed map.
///
/// # Safety
/// `params` is a parameter block built by the host for this heap; every acting rank
/// (`first_rank + blockIdx.y`) is `< world`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_prepare_tokens(params: *const ExchangeParams, first_rank: u32) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    unsafe { plan::prepare_tokens(&view(params, first_rank), first, stride) };
}

/// Step 3 (one thread): publishes `epoch` — this rank's inputs and routing layout are ready.
///
/// # Safety
/// As [`mok_ep_prepare_tokens`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_publish(params: *const ExchangeParams, first_rank: u32, epoch: u32) {
    if sreg::block_idx_x() == 0 && sreg::thread_idx_x() == 0 {
        // SAFETY: caller contract.
        unsafe { plan::publish(&view(params, first_rank), epoch) };
    }
}

/// Waits (one block per rank, 4 bytes of dynamic shared memory, bounded) until every rank has
/// published `epoch`. With the ranks in separate processes, a launch that reads the peers'
/// inputs without waiting itself needs this first on its stream: the backward megakernel, whose
/// pull reads the owners' dy and whose pushes need the owners' flags cleared, both done before
/// their publish. A timeout is recorded in the rank's error record, naming the silent rank.
///
/// # Safety
/// As [`mok_ep_prepare_tokens`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_wait_published(params: *const ExchangeParams, first_rank: u32, epoch: u32) {
    // SAFETY: caller contract; every thread of the block calls it (uniform); the launch gives 4
    // bytes of shared memory. A failed wait is in the error record, which the host reads.
    unsafe { plan::wait_all_published(&view(params, first_rank), epoch, smem::dynamic_smem_base()) };
}

/// Step 4 (one block, 4 bytes of dynamic shared memory): the exchange of counts and the ring
/// offsets of `rank`'s experts, with the capacity check.
///
/// # Safety
/// As [`mok_ep_prepare_tokens`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_schedule(params: *const ExchangeParams, first_rank: u32, epoch: u32) {
    // SAFETY: caller contract; the launch gives 4 bytes of shared memory.
    unsafe { plan::schedule_block(&view(params, first_rank), epoch, smem::dynamic_smem_base()) };
}

/// Step 5 (grid-stride over ring rows): the inverse map, ring row → source rank and slot.
///
/// # Safety
/// As [`mok_ep_prepare_tokens`]; [`mok_ep_schedule`] ran before for this rank.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_ring_map(params: *const ExchangeParams, first_rank: u32) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    unsafe { plan::ring_map_rows(&view(params, first_rank), first, stride) };
}

/// Pull mover (blocks of whole warps, 4 bytes of dynamic shared memory): `pass` 0 dispatches x
/// rows into `rank`'s ring, 1 pulls dy rows scaled by their slot weight. Waits first (bounded)
/// until every rank has published `epoch`.
///
/// # Safety
/// As [`mok_ep_ring_map`]; [`mok_ep_ring_map`] ran before for this rank.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_pull(params: *const ExchangeParams, first_rank: u32, pass: u32, epoch: u32) {
    // SAFETY: caller contract.
    let view = unsafe { view(params, first_rank) };
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
pub unsafe extern "ptx-kernel" fn mok_ep_pull_bulk(params: *const ExchangeParams, first_rank: u32, epoch: u32) {
    // SAFETY: caller contract.
    let view = unsafe { view(params, first_rank) };
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
pub unsafe extern "ptx-kernel" fn mok_ep_push(
    params: *const ExchangeParams,
    first_rank: u32,
    pass: u32,
    rows: *const f32,
) {
    let (warp, warps) = grid_warp();
    // SAFETY: caller contract; whole warps.
    unsafe { movers::push_rows(&view(params, first_rank), Pass::from_arg(pass), rows, warp, warps) };
}

/// Bulk-copy push mover (blocks of 32 threads, [`crate::comm::params::BULK_SMEM_BYTES`] of dynamic shared
/// memory).
///
/// # Safety
/// As [`mok_ep_push`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_ep_push_bulk(
    params: *const ExchangeParams,
    first_rank: u32,
    pass: u32,
    rows: *const f32,
) {
    // SAFETY: caller contract.
    unsafe {
        movers::push_rows_bulk(
            &view(params, first_rank),
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
pub unsafe extern "ptx-kernel" fn mok_ep_wait_tiles(
    params: *const ExchangeParams,
    first_rank: u32,
    pass: u32,
    epoch: u32,
) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    unsafe { plan::wait_tiles(&view(params, first_rank), Pass::from_arg(pass), epoch, first, stride) };
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
    first_rank: u32,
    pass: u32,
    epoch: u32,
) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    let view = unsafe { view(params, first_rank) };
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
    first_rank: u32,
    pass: u32,
    base: *const f32,
    out: *mut u16,
) {
    let (first, stride) = grid_thread();
    // SAFETY: caller contract.
    unsafe { combine::sum_slots(&view(params, first_rank), Pass::from_arg(pass), base, out, first, stride) };
}
