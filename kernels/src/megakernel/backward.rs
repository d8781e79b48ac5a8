//! The backward megakernel on sm_90a (`mok_sm90_backward`): one persistent launch per pass,
//! after the device-side schedule (the engine tile offsets of the forward's routing, every
//! plan's group maps, one memset of the pass counters).
//!
//! Warps take part in the [`gather`] (dy rows into expert order, scaled by the slot weight,
//! 16-row chunks of the M tiles from one queue, each chunk counted; the same warp also reduces
//! the slot-weight gradient `⟨dy[t], out[row]⟩` of each row it gathers): every warp of blocks
//! `0 .. comm_blocks`, which then only run the [`combine_dx`], and the three spare warps of
//! each compute block's producer warpgroup, which then take SwiGLU chunks. The blocks from the
//! next whole pair on are the compute role, in 2-block clusters: from the start of the launch,
//! the down projection's data gradient (d_hidden), the SwiGLU
//! backward ([`swiglu_backward_chunks`]: d_gate, d_up), the gate/up data gradient (dx rows) and
//! the three weight gradients, each as soon as what it reads is there (the engine's phases with
//! [`BackwardHandover`] hooks), then their consumer warps join the combine. Work is taken in the
//! order gather, down dgrad, SwiGLU chunks, gate/up dgrad, weight gradients, combine, so a wait
//! is always on work a running block already holds (docs/ARCHITECTURE.md). Every result is the
//! engine path's bits: the same scaled copies, the same dot products in the same order, each
//! GEMM tile the same K loop and the same epilogue arithmetic, the SwiGLU backward the same
//! function of the same f32 values, each token's sum the same order.

use crate::comm::RankView;
use crate::comm::error::{
    self, ERROR_TIMEOUT, WAIT_ENGINE_TILE_DOWN_DGRAD, WAIT_ENGINE_TILE_GATE_UP_DGRAD, WAIT_SHARED_TILE_DOWN_DGRAD,
    WAIT_SHARED_TILE_GATE_UP_DGRAD,
};
use crate::comm::wait::{signal, wait_until};
use crate::device::rows::{WarpSlots, dot_row, gather_scaled_row, gather_scaled_row_and_dot, swiglu_backward_octets};
use crate::gemm::engine::{params_copy_address, run_backward_phases};
use crate::gemm::hooks::{BackwardHandover, add_to_row_total, slot_row_complete};
use crate::gemm_layout::{ENGINE_THREADS, GemmParams, TILE_M, TILE_N};
use crate::layout::NO_ROW;
use crate::megakernel_layout::{
    BACKWARD_PLANS_COPIED, BackwardParams, PassInputs, RowChunk, SWIGLU_CHUNK_ROWS, SWIGLU_CHUNKS_PER_M_TILE,
    WORK_COMBINE, WORK_COPY_ROWS, WORK_GEMMS, WORK_WEIGHT_GRADS, downstream_deadline, first_compute_block,
    parts_per_m_tile,
};
use crate::ptx::memory::{atom_add_relaxed_gpu_u32, ld_relaxed_gpu_u32};
use crate::ptx::{signal as warp, sreg, sync};
use crate::tiles::group_of_tile;

use super::comm::{
    acquire_if_token_rows_pushed, claim_row_chunk, copy_token_rows, in_walk_order, plan_offsets, publish_chunk,
    rank_view, wait_for_pushes_slot_by_slot, wait_for_shared_tile, wait_for_token_rows,
};

/// The gather, by a whole warp: row chunks
/// ([`row_chunk`](crate::megakernel_layout::row_chunk): 16 rows) taken one at a time from
/// `gather_next` — the shared expert's M tiles first (its dy copy), then the routed ones, 8
/// chunk numbers per M tile. Each of the chunk's rows is written in
/// expert order as `bf16(w[t,j] · dy[t])`, and the warp's sum of `dy[t] · out[row]` (the
/// forward's f32 down-projection row) is the slot's d_topk_weight (unless the pass computes
/// those apart, `early_slot_weight_gradients`: [`slot_weight_gradients`]); then, after a warp
/// barrier, lane 0 adds 1 to the tile's `rows_gathered` count with a release (complete at
/// [`row_chunks_complete`](crate::megakernel_layout::row_chunks_complete)). Across ranks
/// (`view`) each row pulls its token owner's dy and slot weight through the peer mapping and is
/// only scaled (the owner computes the slot-weight gradients). A chunk past a short tile's rows
/// neither writes nor counts. Waits for nothing. Returns once the chunks are all handed out.
///
/// Comm blocks run it on every warp; compute blocks on their producer warpgroup's spare warps,
/// alongside the GEMM phases, so the first down-dgrad tiles wait for their own rows only. With
/// `until_routed` the warp returns after its first routed chunk (or when the queue is spent):
/// the shared expert's chunks of every hosted rank first ([`in_walk_order`]).
///
/// # Safety
/// `b` and `pass` are the pass's; the schedule was written before the launch; `view` is the
/// rank's view across ranks (`RANKS`), else `None`; all 32 lanes call it.
#[inline(always)]
pub unsafe fn gather<const RANKS: bool>(
    b: &BackwardParams,
    pass: &PassInputs,
    view: Option<&RankView>,
    until_routed: bool,
) {
    // SAFETY: caller contract: the down-dgrad parameter block and the offsets it points at; all
    // 32 lanes, which take the same chunks (the claim is broadcast) and, where they sum (no
    // `RANKS`, so `copy` is warp-uniform), the same rows: every lane reaches each
    // `shfl_idx_u32`, `warp_sum_f32` and `publish_chunk`.
    unsafe {
        let lane = sreg::lane_id();
        // Across ranks a rank whose error record is set (its schedule failed) copies nothing:
        // the waits on its tiles then stop at once.
        let copy = b.work & WORK_COPY_ROWS != 0 && !(RANKS && error::has_error(b.error as *const u32));
        // A rank that copies nothing because of its error publishes nothing either.
        let publish = copy == (b.work & WORK_COPY_ROWS != 0);
        // On one GPU the slot-weight gradients are computed here unless the pass computes them
        // apart ([`slot_weight_gradients`]).
        let apart = b.early_slot_weight_gradients != 0;
        loop {
            // With a shared expert the queue starts with its M tiles (its phases run first).
            let with_shared = b.shared_down_dgrad != 0;
            let (tile, first, end) = match claim_row_chunk(b.gather_next, b.down_dgrad, with_shared, pass.tokens, lane)
            {
                RowChunk::Spent => return,
                RowChunk::Shared { tile, first, end } => {
                    // The shared expert's rows are the pass's own dy rows, in order.
                    if first < end {
                        copy_token_rows(b.shared_dy, pass.x, b.hidden, first..end, copy, lane);
                        let total = b.row_total(2);
                        publish_gathered_chunk(
                            b.shared_gathered as *mut u32,
                            tile,
                            (total, end - first),
                            publish,
                            lane,
                        );
                    }
                    continue;
                }
                RowChunk::Routed { tile, first, end } => (tile, first, end),
            };
            if first >= end {
                if until_routed {
                    return;
                }
                continue;
            }
            let (dy, weights) = (pass.x as *const u16, pass.topk_weights as *const f32);
            let (row_source, out, d_rows) =
                (b.row_source as *const u32, b.down_rows as *const f32, b.d_rows as *mut u16);
            let h = b.hidden as usize;
            let source_rank: *const u32 =
                view.map_or(core::ptr::null(), |v| v.local(v.params.regions.ring_source_rank));
            let mut row = if copy { first } else { end };
            while row < end {
                let slot = *row_source.add(row as usize);
                let token = (slot / b.top_k) as usize;
                let r = row as usize;
                match view {
                    // Across ranks: the token owner's dy and slot weight, through the peer
                    // mapping; the owner computes the slot-weight gradients.
                    Some(v) if RANKS => {
                        let owner = *source_rank.add(r);
                        let regions = &v.params.regions;
                        let owner_dy = v.peer::<u16>(regions.dy, owner).add(token * h);
                        let weight = *v.peer::<f32>(regions.topk_weights, owner).add(slot as usize);
                        gather_scaled_row(owner_dy, d_rows.add(r * h), weight, b.hidden, lane);
                    }
                    // On one GPU with the slot-weight gradients apart: the copy alone.
                    _ if apart => gather_scaled_row(
                        dy.add(token * h),
                        d_rows.add(r * h),
                        *weights.add(slot as usize),
                        b.hidden,
                        lane,
                    ),
                    _ => {
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
                    }
                }
                row += 1;
            }
            let (total, rows) = (b.row_total(0), end - first);
            let publish = publish && tile != b.silent_rows_tile;
            publish_gathered_chunk(b.rows_gathered as *mut u32, tile, (total, rows), publish, lane);
            if until_routed {
                return;
            }
        }
    }
}

/// [`publish_chunk`] for the gather, then lane 0 adds the chunk's `rows` to its expert set's
/// gathered-row total `total` with a release ([`BackwardParams::row_totals`]): the down
/// weight gradient reads the total once per phase instead of every M tile's count.
///
/// # Safety
/// As [`publish_chunk`]; `total` is null or a valid, 4-byte aligned global address.
#[inline(always)]
unsafe fn publish_gathered_chunk(
    counts: *mut u32,
    tile: u32,
    (total, rows): (*mut u32, u32),
    publish: bool,
    lane: u32,
) {
    // SAFETY: caller contract.
    unsafe {
        publish_chunk(counts, tile, publish, lane);
        if lane == 0 && publish {
            add_to_row_total(total, rows);
        }
    }
}

/// The SwiGLU backward between the two data gradients, by a whole warp of a compute block: the
/// producer warpgroup's spare warps from the start of the engine phases (`spare_warp`: few
/// registers, one group of loads in flight), under the down dgrad's MMAs, and the consumer
/// warps after their down-dgrad tiles, before their gate/up-dgrad tiles (two in flight);
/// chunks of [`SWIGLU_CHUNK_ROWS`] rows taken one at a time from `swiglu_next` — the shared
/// expert's M tiles first, then the routed ones, [`SWIGLU_CHUNKS_PER_M_TILE`] per M tile. Lane
/// 0 waits (bounded, acquire) until every down-dgrad part of the chunk's M tile is stored, the
/// warp writes the chunk's d_gate and d_up from d_hidden and the saved pre-activations
/// ([`swiglu_backward_octets`]: the bits of `mok_swiglu_backward`), then lane 0 adds 1 to the
/// tile's `down_dgrad_stored` with a release, so the tile is complete for the gate/up data and
/// weight gradients at `down_dgrad_complete`. A chunk past a short tile's rows does nothing.
/// The down data gradient runs as a plain GEMM with a TMA-store epilogue, whose stores drain
/// under the next tile's MMAs; the SwiGLU backward in its epilogue (loads, math and 4-byte
/// stores in both consumer warpgroups, no MMA meanwhile) cost ~4 ms of kimi 8192's backward
/// (docs/PERF.md). With `until_routed` the warp takes the shared expert's chunks only, returning
/// once they are all handed out (a routed chunk waits on a routed down-dgrad tile, which the
/// walk across ranks computes after every rank's shared ones).
///
/// # Safety
/// As [`gather`]; all 32 lanes call it; `b.swiglu` (and `b.shared_swiglu` with a shared expert)
/// are the pass's rows.
#[inline(always)]
pub unsafe fn swiglu_backward_chunks(b: &BackwardParams, pass: &PassInputs, spare_warp: bool, until_routed: bool) {
    if b.work & WORK_GEMMS == 0 {
        return;
    }
    // SAFETY: caller contract: the plans, their offsets and the rows; all 32 lanes, which run
    // the loop in step (the claim is broadcast), so every lane reaches each `shfl_idx_u32` and
    // `warp_sync`.
    unsafe {
        let (lane, error) = (sreg::lane_id(), b.error as *mut u32);
        loop {
            if until_routed {
                // The first round takes shared chunks only: a routed chunk waits on a routed
                // down-dgrad tile, which the walk computes after every rank's shared ones.
                // Peeked before claiming (relaxed: a stale value only lets one routed chunk
                // through, which then returns below).
                let shared_tiles = if b.shared_down_dgrad != 0 { pass.tokens.div_ceil(TILE_M) } else { 0 };
                let next = if lane == 0 { ld_relaxed_gpu_u32(b.swiglu_next as *const u32) } else { 0 };
                if sync::shfl_idx_u32(next, 0) >= shared_tiles * SWIGLU_CHUNKS_PER_M_TILE {
                    return;
                }
            }
            let claimed = if lane == 0 { atom_add_relaxed_gpu_u32(b.swiglu_next as *mut u32, 1) } else { 0 };
            let claimed = sync::shfl_idx_u32(claimed, 0);
            // Read at every claim, not held across the chunk (as `claim_row_chunk`).
            let (tile_offsets, row_offsets) = plan_offsets(b.down_dgrad);
            let m_tiles = tile_offsets[tile_offsets.len() - 1];
            let shared_tiles = if b.shared_down_dgrad != 0 { pass.tokens.div_ceil(TILE_M) } else { 0 };
            let (tile, chunk) = (claimed / SWIGLU_CHUNKS_PER_M_TILE, claimed % SWIGLU_CHUNKS_PER_M_TILE);
            if tile >= shared_tiles + m_tiles {
                return;
            }
            // The tile's rows [first, end) and the expert set's plan, rows and counts.
            let (shared, tile) = if tile < shared_tiles { (true, tile) } else { (false, tile - shared_tiles) };
            let (first, end, plan, rows, stored, code) = if shared {
                let first = tile * TILE_M;
                let plan = &*(b.shared_down_dgrad as *const GemmParams);
                let stored = b.shared_down_dgrad_stored as *mut u32;
                (first, (first + TILE_M).min(pass.tokens), plan, &b.shared_swiglu, stored, WAIT_SHARED_TILE_DOWN_DGRAD)
            } else {
                let g = group_of_tile(tile_offsets, tile).unwrap_or(0);
                let first = row_offsets[g] + (tile - tile_offsets[g]) * TILE_M;
                let end = (first + TILE_M).min(row_offsets[g + 1]);
                let plan = &*(b.down_dgrad as *const GemmParams);
                (first, end, plan, &b.swiglu, b.down_dgrad_stored as *mut u32, WAIT_ENGINE_TILE_DOWN_DGRAD)
            };
            let total = b.row_total(if shared { 3 } else { 1 });
            let chunk_first = first + chunk * SWIGLU_CHUNK_ROWS;
            let chunk_end = (chunk_first + SWIGLU_CHUNK_ROWS).min(end);
            let counter = stored.add(tile as usize);
            // A chunk without rows neither waits nor counts (`down_dgrad_complete`).
            if chunk_first < chunk_end {
                if lane == 0 {
                    let expected = parts_per_m_tile(plan.n.div_ceil(TILE_N), end - first);
                    let timeout_ns = downstream_deadline(b.timeout_ns, 1);
                    if let Err(seen) = wait_until(counter, false, timeout_ns, error, |v| v >= expected) {
                        error::record(error, [ERROR_TIMEOUT, code, b.rank, tile, expected, seen, b.rank, 0]);
                    }
                }
                // Lane 0 acquired the tile's d_hidden; the warp barrier passes that on to every lane.
                warp::warp_sync();
                let width = rows.width as usize;
                let elements = (chunk_first as usize * width, chunk_end as usize * width);
                if spare_warp {
                    swiglu_backward_octets::<1>(rows, elements, lane);
                } else {
                    swiglu_backward_octets::<2>(rows, elements, lane);
                }
                // Every lane's stores before lane 0's releases: the tile's count, then the set's
                // SwiGLU row total (`BackwardParams::row_totals`).
                warp::warp_sync();
                if lane == 0 {
                    signal(counter, 1, false);
                    add_to_row_total(total, chunk_end - chunk_first);
                }
            }
            if until_routed && !shared {
                return;
            }
        }
    }
}

/// The slot-weight gradients of the rank's tokens, where the pass computes them apart from the
/// gather (across ranks always: the gather pulls another rank's dy; on one GPU with
/// `early_slot_weight_gradients`), by a whole warp: tokens taken one at a time from
/// `dots_next`, each routed slot's `d_topk_weights[t·k+j] = ⟨dy[t], F(t,j)⟩`, `F(t,j)` the
/// forward's f32 down-projection row of the slot (across ranks `combine_slots[t·k+j]`, still in
/// place: the dx rows land in their own slot buffer; on one GPU `down_rows[row(t,j)]`); the
/// bits of the one-GPU gather's dot product. A dropped slot's is 0. They wait on nothing, so
/// the compute blocks' spare warps take them after their SwiGLU chunks, under the GEMM phases
/// (where the pass asks for them early), and [`combine_dx`] takes what is left first. Without
/// the comm side's work (`WORK_COPY_ROWS` and `WORK_COMBINE` both off: a side timed alone) it
/// computes nothing.
///
/// # Safety
/// As [`combine_dx`]: `view` is the rank's view across ranks (`RANKS`), else `None`; all 32
/// lanes call it.
#[inline(always)]
pub unsafe fn slot_weight_gradients<const RANKS: bool>(b: &BackwardParams, pass: &PassInputs, view: Option<&RankView>) {
    if b.work & (WORK_COPY_ROWS | WORK_COMBINE) == 0 {
        return;
    }
    // SAFETY: caller contract; all 32 lanes take the same tokens (the claim is broadcast), so
    // every lane reaches each shuffle and `warp_sum_f32`.
    unsafe {
        let lane = sreg::lane_id();
        // Across ranks the forward rows by slot, on one GPU by row (expert order).
        let (forward_rows, by_slot) = match view {
            Some(v) if RANKS => (v.local::<f32>(v.params.regions.combine_slots) as *const f32, true),
            _ => (b.down_rows as *const f32, false),
        };
        let (slot_row, h) = (b.slot_row as *const u32, b.hidden as usize);
        loop {
            let claimed = if lane == 0 { atom_add_relaxed_gpu_u32(b.dots_next as *mut u32, 1) } else { 0 };
            let token = sync::shfl_idx_u32(claimed, 0);
            if token >= pass.tokens {
                return;
            }
            let slots = WarpSlots::load(slot_row, core::ptr::null(), token, b.top_k, lane);
            let dy = (pass.x as *const u16).add(token as usize * h);
            for j in 0..b.top_k {
                let slot = (token * b.top_k + j) as usize;
                let row = slots.row(j);
                let total = if row == NO_ROW {
                    0.0
                } else {
                    let at = if by_slot { slot } else { row as usize };
                    sync::warp_sum_f32(dot_row(dy, forward_rows.add(at * h), b.hidden, lane))
                };
                if lane == 0 {
                    *(b.d_topk_weights as *mut f32).add(slot) = total;
                }
            }
        }
    }
}

/// The dx combine, by a whole warp (comm blocks after their gather, compute blocks' consumer
/// warps after their GEMM phases): tokens taken one at a time from `combine_next`; the warp
/// waits (bounded, acquire) until each routed slot's row is there — on one GPU until the gate/up
/// dgrad tiles holding them are stored ([`wait_for_token_rows`]), across ranks until each slot's
/// `slot_ready` flag says every gate/up dgrad tile of its row has pushed its part from its
/// epilogue ([`acquire_if_token_rows_pushed`], else [`wait_for_pushes_slot_by_slot`];
/// [`slot_row_complete`]) — then the warp sums `dx[t] =
/// bf16(shared_dx[t] + Σ_j d_in[row(t,j)])` with [`WarpSlots::combine_row`], the slots' rows
/// held in lanes (the shared term first, slots in order: the bits of
/// `mok_combine_slots`). Where the slot-weight gradients are computed apart from the gather
/// (across ranks; on one GPU with `early_slot_weight_gradients`), the warp first takes what is
/// left of their queue ([`slot_weight_gradients`]); otherwise (on one GPU) a dropped slot's
/// d_topk_weight is written here, as 0, the gather writing the others.
///
/// Across ranks a wait stops early when the owner's error record is set (the owner names the
/// cause), and once this rank's own record is set its combine waits for nothing more.
///
/// # Safety
/// As [`gather`], with `b.top_k ≤`
/// [`MAX_COMBINE_SLOTS`](crate::megakernel_layout::MAX_COMBINE_SLOTS); all 32 lanes call it.
#[inline(always)]
pub unsafe fn combine_dx<const RANKS: bool>(b: &BackwardParams, pass: &PassInputs, view: Option<&RankView>) {
    if b.work & WORK_COMBINE == 0 {
        return;
    }
    // SAFETY: caller contract; all 32 lanes, which take the same tokens and slots (the claim is
    // broadcast; the per-lane waits rejoin), so every lane reaches each shuffle, ballot and
    // `warp_sum_f32`.
    unsafe {
        // The slot-weight gradients' queue first, where it is in use: whatever the spare warps
        // left (all of it where they ran none, as across ranks without early ones).
        let apart = RANKS || b.early_slot_weight_gradients != 0;
        if apart {
            slot_weight_gradients::<RANKS>(b, pass, view);
        }
        let p = &*(b.gate_up_dgrad as *const GemmParams);
        let lane = sreg::lane_id();
        let (slot_row, error) = (b.slot_row as *const u32, b.error as *mut u32);
        loop {
            let claimed = if lane == 0 { atom_add_relaxed_gpu_u32(b.combine_next as *mut u32, 1) } else { 0 };
            let token = sync::shfl_idx_u32(claimed, 0);
            if token >= pass.tokens {
                return;
            }
            let slots = WarpSlots::load(slot_row, core::ptr::null(), token, b.top_k, lane);
            match view {
                Some(v) if RANKS => {
                    let regions = &v.params.regions;
                    // Without GEMMs (the comm side timed alone) no tile pushes: sum the slots as
                    // they are.
                    let flags = v.local::<u32>(regions.slot_ready).add((token * b.top_k) as usize);
                    if b.work & WORK_GEMMS != 0
                        && !acquire_if_token_rows_pushed(&slots, flags, slot_row_complete(p.n), b.top_k, v.sys())
                    {
                        wait_for_pushes_slot_by_slot(
                            v,
                            (slot_row, token, b.top_k),
                            (&p.n, &b.timeout_ns, 3),
                            (error, &b.rank),
                        );
                    }
                }
                _ => {
                    // A dropped slot's d_topk_weight, by the lane holding the slot, where the
                    // gather computes the others (apart, the queue above wrote every slot's).
                    if !apart {
                        for half in 0..2 {
                            let j = lane + 32 * half as u32;
                            if j < b.top_k && slots.own_row(half) == NO_ROW {
                                *(b.d_topk_weights as *mut f32).add((token * b.top_k + j) as usize) = 0.0;
                            }
                        }
                    }
                    if b.work & WORK_GEMMS != 0 {
                        wait_for_token_rows(
                            &slots,
                            (p, b.gate_up_dgrad_stored as *const u32),
                            b.top_k,
                            (downstream_deadline(b.timeout_ns, 3), error),
                            WAIT_ENGINE_TILE_GATE_UP_DGRAD,
                        );
                    }
                }
            }
            if b.shared_down_dgrad != 0 && b.work & WORK_GEMMS != 0 && !(RANKS && error::has_error(error)) {
                let shared = (b.shared_gate_up_dgrad_stored as *const u32, b.shared_gate_up_dgrad as *const GemmParams);
                wait_for_shared_tile(
                    shared,
                    (token, pass.tokens),
                    (downstream_deadline(b.timeout_ns, 3), error, b.rank),
                    WAIT_SHARED_TILE_GATE_UP_DGRAD,
                );
            }
            // Across ranks the owners pushed the dx rows into this rank's slot buffer.
            let rows = match view {
                Some(v) if RANKS => v.local::<f32>(v.params.regions.dx_slots) as *const f32,
                _ => b.d_in_rows as *const f32,
            };
            slots.combine_row((rows, pass.shared_rows as *const f32), token, b.top_k, b.hidden, b.dx as *mut u16, lane);
        }
    }
}

/// The whole backward pass of one rank by every thread of its `block`-th block (see the module
/// docs).
///
/// `rank()` names the rank: its parameter block `params` and its inputs `pass`, as in
/// [`forward`](super::forward::forward). Across ranks the compute blocks call it again where
/// the work beside the phases starts (the spare warps' gather and SwiGLU chunks, the
/// consumers' SwiGLU chunks) and for the combine after the phases, so that neither the phases
/// nor that work hold the rank's parameter block, inputs and view in registers (ptxas spilled
/// them; the spare warps have few); on one GPU both are the kernel's arguments. `hosted(q)`
/// names the launch's rank q the same way (launch order): across ranks, with the data-gradient
/// tiles shared, the spare warps' gather and SwiGLU chunks and the consumers' SwiGLU chunks
/// take every hosted rank's units in the walk's order ([`in_walk_order`]).
///
/// # Safety
/// `hosted(q)` is as `rank()` for every launch index q below the parameter blocks'
/// `tile_ranks` (only read across ranks).
/// `rank()` returns the same `(params, pass)` at every call, `params` pointing at the rank's
/// valid [`BackwardParams`] and `pass` holding its inputs (dy, the slot weights, the shared
/// expert's dx rows or 0, T); the forward of the same routing ran
/// before on the stream (its down rows, pre-activations, hidden rows and gathered rows are what
/// this pass reads); the counters hold an entry per engine M tile the plans' groups can have,
/// zeroed with the queues, and every plan's group maps cut (tile counters zeroed) on the stream
/// before the launch; the grid is co-resident; the rank holds more than `first_compute_block`
/// blocks, [`ENGINE_THREADS`] threads each, pair-aligned. `params` is element
/// `launch_index` of the launch's array of parameter blocks; with `wgrad_ranks` > 1 that array
/// holds that many ranks, every one with the same comm blocks, weight-gradient tile counts and
/// `wgrad_ranks`, and their blocks are the whole grid. Every thread of every block calls it, a
/// cluster's two blocks with the same `params` and `block` 2q and 2q + 1. `x`: on one GPU with
/// `gather_in_producer` set, the forward's live `[T][H]` bf16 token rows (the gate and up
/// weight gradients gather B from them); otherwise unused (0 across ranks). `RANKS` (the launch
/// hosts ranks) exactly when `exchange` is the rank's valid exchange parameter block.
#[inline(always)]
pub unsafe fn backward<const RANKS: bool>(
    rank: impl Fn() -> (*const BackwardParams, PassInputs) + Copy,
    hosted: impl Fn(u32) -> (*const BackwardParams, PassInputs) + Copy,
    block: u32,
    x: u64,
) {
    crate::ptx::declare_block_threads::<ENGINE_THREADS>();
    crate::ptx::declare_cluster_blocks::<2>();
    let (params, pass) = rank();
    // SAFETY: caller contract; read-only for the whole launch.
    let b = unsafe { &*params };
    // SAFETY: caller contract: `exchange` is the rank's valid parameter block across ranks.
    let view = unsafe { rank_view::<RANKS, _>(b) };
    if block < b.comm_blocks {
        // SAFETY: caller contract; every warp is whole.
        unsafe {
            gather::<RANKS>(b, &pass, view.as_ref(), false);
            combine_dx::<RANKS>(b, &pass, view.as_ref());
        }
    } else if block >= first_compute_block(b.comm_blocks) {
        // SAFETY: caller contract; every warp is whole. Both blocks of this cluster come here
        // with every thread (`first_compute_block` is even; `b` is the pair's), as
        // `run_backward_phases` asks.
        unsafe {
            if b.work & (WORK_GEMMS | WORK_WEIGHT_GRADS) == 0 {
                gather::<RANKS>(b, &pass, view.as_ref(), false);
                combine_dx::<RANKS>(b, &pass, view.as_ref());
                return;
            }
            // Where a launch hosts one rank and shares nothing across ranks (one GPU; one rank
            // per process and GPU), the block reads a shared-memory copy of its parameter block
            // and routed plans from here on (on one GPU every role; across ranks the phases'
            // plans and hooks): after each acquire and proxy fence a global field comes back
            // from L2, the copy's do not (docs/PERF.md, "The parameter block and plans in shared
            // memory"). The copy is whole only after `run_backward_phases`' first cluster
            // barrier, so the fields the phases take are read here, from global memory. Blocks
            // that read several ranks' blocks (tiles or weight gradients shared across ranks:
            // more than the carve holds), and a later rank's own blocks (the phases index the
            // blocks from the first by launch index), stay in global memory.
            let (launch_index, tile_ranks, wgrad_ranks) =
                if RANKS { (b.launch_index, b.tile_ranks, b.wgrad_ranks) } else { (0, 1, 1) };
            let copied = tile_ranks == 1 && wgrad_ranks == 1 && launch_index == 0;
            let (params, first_params) = if copied {
                let copy = params_to_shared(params);
                (copy, copy)
            } else {
                (params, params.sub(launch_index as usize))
            };
            let b = &*params;
            // The rank where the work beside or after the phases starts: across ranks read
            // again (`rank`'s docs); on one GPU the kernel's arguments, as above. The phases'
            // plans and hooks keep the first rank's parameter block: read again per phase, the
            // consumers held its field addresses instead, and spilled more.
            let this_rank = move || if RANKS { rank_and_view::<RANKS>(rank) } else { (b, pass, view) };
            // The phases in `run_backward_phases`' order (numbered as `BackwardHandover`'s);
            // each plan is read where its phase starts, from the parameter block of rank q of
            // the launch (the blocks are an array in launch order; q is this rank but in the
            // data gradients and weight gradients shared across ranks). Valid for the whole
            // launch (caller contract; the closures run inside this unsafe block).
            let plan = move |phase: u32, q: u32| {
                let b = &*first_params.add(q as usize);
                (match phase {
                    BackwardHandover::SHARED_DOWN_DGRAD => b.shared_down_dgrad,
                    BackwardHandover::DOWN_DGRAD => b.down_dgrad,
                    BackwardHandover::SHARED_GATE_UP_DGRAD => b.shared_gate_up_dgrad,
                    BackwardHandover::GATE_UP_DGRAD => b.gate_up_dgrad,
                    BackwardHandover::WGRAD_DOWN => b.wgrad[0],
                    BackwardHandover::WGRAD_GATE => b.wgrad[1],
                    BackwardHandover::WGRAD_UP => b.wgrad[2],
                    BackwardHandover::SHARED_WGRAD_DOWN => b.shared_wgrad[0],
                    BackwardHandover::SHARED_WGRAD_GATE => b.shared_wgrad[1],
                    _ => b.shared_wgrad[2],
                }) as *const GemmParams
            };
            // x only where a gathering weight gradient reads it (one GPU).
            let x = if RANKS { 0 } else { x };
            let hooks = move |phase, q: u32| BackwardHandover::<RANKS>::new(first_params.add(q as usize), phase, x);
            // The spare producer warps gather, then take SwiGLU chunks; the consumer warps take
            // SwiGLU chunks between their two data gradients.
            // Across ranks both follow the compute blocks' walk over the hosted ranks.
            let spare_warps = || {
                if RANKS {
                    in_walk_order!(rank, hosted, |b, pass, until_routed| {
                        gather::<RANKS>(b, &pass, rank_view::<RANKS, _>(b).as_ref(), until_routed)
                    });
                    in_walk_order!(rank, hosted, |b, pass, until_routed| {
                        swiglu_backward_chunks(b, &pass, true, until_routed)
                    });
                    // Then the slot-weight gradients where the pass asks for them early; they
                    // wait on nothing: of every rank whose tiles this block walks (its own where
                    // each rank has its blocks).
                    let ranks = (*rank().0).tile_ranks;
                    let mut q = 0;
                    while q < ranks.max(1) {
                        let (params, pass) = if ranks > 1 { hosted(q) } else { rank() };
                        let b = &*params;
                        if b.early_slot_weight_gradients != 0 {
                            slot_weight_gradients::<RANKS>(b, &pass, rank_view::<RANKS, _>(b).as_ref());
                        }
                        q += 1;
                    }
                } else {
                    let (b, pass, view) = this_rank();
                    gather::<RANKS>(b, &pass, view.as_ref(), false);
                    swiglu_backward_chunks(b, &pass, true, false);
                    if b.early_slot_weight_gradients != 0 {
                        slot_weight_gradients::<RANKS>(b, &pass, view.as_ref());
                    }
                }
            };
            let between_dgrads = || {
                if RANKS {
                    in_walk_order!(rank, hosted, |b, pass, until_routed| {
                        swiglu_backward_chunks(b, &pass, false, until_routed)
                    });
                } else {
                    let (b, pass, _) = this_rank();
                    swiglu_backward_chunks(b, &pass, false, false);
                }
            };
            let phases = run_backward_phases(
                plan,
                hooks,
                (spare_warps, between_dgrads),
                launch_index,
                (tile_ranks, wgrad_ranks),
            );
            if phases.is_some() {
                let (b, pass, view) = this_rank();
                combine_dx::<RANKS>(b, &pass, view.as_ref());
            }
        }
    }
    // Otherwise the idle partner of an odd comm block count.
}

/// `rank()`'s parameter block, inputs and view (see [`rank_view`]), read again.
///
/// # Safety
/// As [`backward`]'s `rank`: `rank()` returns a valid parameter block, read-only for the whole
/// launch, whose `exchange` is valid with `RANKS`.
#[inline(always)]
unsafe fn rank_and_view<'a, const RANKS: bool>(
    rank: impl Fn() -> (*const BackwardParams, PassInputs),
) -> (&'a BackwardParams, PassInputs, Option<RankView<'a>>) {
    let (params, pass) = rank();
    // SAFETY: caller contract.
    unsafe {
        let b = &*params;
        (b, pass, rank_view::<RANKS, _>(b))
    }
}

/// Copies a rank's parameter block and its [`BACKWARD_PLANS_COPIED`] routed plans into
/// this block's shared memory ([`params_copy_address`]), the copy's plan addresses pointing at
/// the plans' copies, and returns the copy (a generic address). After every L1 invalidation (each
/// acquire and proxy fence of the pass) a field read from global memory goes back to L2; read
/// from the copy it does not. The shared expert's plans stay where they are.
///
/// # Safety
/// `params` is the rank's valid [`BackwardParams`], whose routed plans are valid; every
/// thread of the block calls it, and none reads the copy before a barrier of the whole block
/// that follows (`run_backward_phases`' first cluster barrier).
#[inline(always)]
unsafe fn params_to_shared(params: *const BackwardParams) -> *const BackwardParams {
    const BLOCK_WORDS: usize = size_of::<BackwardParams>() / 4;
    const PLAN_WORDS: usize = size_of::<GemmParams>() / 4;
    let copy = crate::ptx::smem::shared_to_generic(params_copy_address()) as *mut u32;
    let thread = sreg::thread_idx_x() as usize;
    // SAFETY: caller contract for the sources; the copy's carve holds the block and the plans
    // (`megakernel_layout` checks the sizes), 8-byte aligned; one warp writes it, then its lane 0
    // the plan addresses, after the warp barrier.
    unsafe {
        if thread < 32 {
            let b = &*params;
            let plans = [b.down_dgrad, b.gate_up_dgrad, b.wgrad[0], b.wgrad[1], b.wgrad[2]];
            let mut i = thread;
            while i < BLOCK_WORDS {
                *copy.add(i) = *(params as *const u32).add(i);
                i += 32;
            }
            let mut j = 0;
            while j < BACKWARD_PLANS_COPIED {
                let (source, target) = (plans[j] as *const u32, copy.add(BLOCK_WORDS + j * PLAN_WORDS));
                let mut i = thread;
                while i < PLAN_WORDS {
                    *target.add(i) = *source.add(i);
                    i += 32;
                }
                j += 1;
            }
            warp::warp_sync();
            if thread == 0 {
                let copied = &mut *(copy as *mut BackwardParams);
                let plan_copy = |j: usize| copy.add(BLOCK_WORDS + j * PLAN_WORDS) as u64;
                copied.down_dgrad = plan_copy(0);
                copied.gate_up_dgrad = plan_copy(1);
                copied.wgrad = [plan_copy(2), plan_copy(3), plan_copy(4)];
            }
        }
    }
    copy as *const BackwardParams
}
