//! Routing-layout kernels: rank slots per chunk, scan counts, place slots.
//! See [`crate::layout`] for the algorithm; these entry points run its steps in parallel.

use crate::device::{store_chunk_counters, zero_chunk_counters};
use crate::layout::{self, NO_ROW};
use crate::ptx::{smem, sreg, sync};
use crate::tiles::{GEMM_TILE_M, engine_group_counts, span_sums, warp_lane_span, write_span_prefix};

/// Step 1. One block per chunk of `ROUTE_CHUNK_TOKENS` tokens (`RANK_CHUNK_THREADS` threads;
/// its first warp ranks), dynamic shared memory for `num_experts` u32 counters: writes
/// `chunk_counts[chunk][e]` and `slot_rank[t·k + j]` ([`crate::layout::rank_chunk`]'s values,
/// 32 slots per step: [`crate::comm::plan::rank_chunk_warp`]); a bad id is dropped and the first
/// one seen by any block is recorded in `error` (`[code, slot, id, 0]`, code 0 = none). The
/// routing layout of the single-rank layer and the exchange's schedule both start with it.
///
/// # Safety
/// Pointers must cover `[T·k]` ids and ranks, `[chunks·E]` counts and 4 error words.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_route_rank_chunks(
    topk_ids: *const i32,
    tokens: u32,
    top_k: u32,
    num_experts: u32,
    chunk_counts: *mut u32,
    slot_rank: *mut u32,
    error: *mut u32,
) {
    // SAFETY: caller contract; every thread of the block runs this kernel to here.
    unsafe { rank_chunks_block(topk_ids, tokens, top_k, num_experts, chunk_counts, slot_rank, error) };
}

/// The body of [`mok_route_rank_chunks`] for the block of chunk `blockIdx.x` (the exchange's
/// per-rank launch runs it too).
///
/// # Safety
/// As [`mok_route_rank_chunks`]; every thread of the block calls it in uniform control flow.
#[inline(always)]
pub(crate) unsafe fn rank_chunks_block(
    topk_ids: *const i32,
    tokens: u32,
    top_k: u32,
    num_experts: u32,
    chunk_counts: *mut u32,
    slot_rank: *mut u32,
    error: *mut u32,
) {
    let chunk = sreg::block_idx_x();
    let thread = sreg::thread_idx_x();
    let counters = smem::dynamic_smem_base();
    // SAFETY: the launch gives `num_experts` u32 of dynamic shared memory for the counters; the
    // whole block calls it (caller contract).
    unsafe { zero_chunk_counters(counters, num_experts) };
    let first_token = chunk * layout::ROUTE_CHUNK_TOKENS;
    let chunk_tokens = (tokens - first_token).min(layout::ROUTE_CHUNK_TOKENS);
    let first_slot = first_token * top_k;
    if thread < 32 {
        // SAFETY: the chunk's slots lie inside [T·k]; the counters are this block's, zeroed;
        // the first warp is whole and calls uniformly.
        unsafe {
            crate::comm::plan::rank_chunk_warp(
                topk_ids.add(first_slot as usize),
                (chunk_tokens * top_k) as usize,
                top_k as usize,
                num_experts,
                counters,
                slot_rank.add(first_slot as usize),
                first_slot,
                error,
            )
        };
    }
    // SAFETY: chunk < chunks, so its row of `chunk_counts` exists; the whole block reaches it
    // (caller contract; the first warp's branch above rejoins).
    unsafe { store_chunk_counters(counters, num_experts, chunk, chunk_counts) };
}

/// Step 2. One block: each thread scans whole expert columns of `chunk_counts` in place into
/// chunk bases, then the first warp prefixes the totals into `row_offsets[E+1]` and
/// `tile_offsets[E+1]` (tiles of `GEMM_TILE_M` rows). `expert_counts[E]` gets the totals.
///
/// # Safety
/// Pointers must cover `[chunks·E]`, `[E]`, `[E+1]` and `[E+1]` u32; the launch is one block
/// of 32 to 1024 threads (its first warp whole: the prefix's shuffles name every lane).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_route_scan(
    chunk_counts: *mut u32,
    num_chunks: u32,
    num_experts: u32,
    expert_counts: *mut u32,
    row_offsets: *mut u32,
    tile_offsets: *mut u32,
) {
    // SAFETY: caller contract (one block with a whole first warp); every thread of the block
    // runs this kernel to here.
    unsafe { scan_block(chunk_counts, num_chunks, num_experts, expert_counts, row_offsets, tile_offsets) };
}

/// The body of [`mok_route_scan`] (one block).
///
/// # Safety
/// As [`mok_route_scan`]; every thread of the block calls it in uniform control flow, and the
/// block has at least one whole warp.
#[inline(always)]
pub(crate) unsafe fn scan_block(
    chunk_counts: *mut u32,
    num_chunks: u32,
    num_experts: u32,
    expert_counts: *mut u32,
    row_offsets: *mut u32,
    tile_offsets: *mut u32,
) {
    let (experts, chunks) = (num_experts as usize, num_chunks as usize);
    // SAFETY: sizes from the caller contract.
    let matrix = unsafe { core::slice::from_raw_parts_mut(chunk_counts, chunks * experts) };
    let mut e = sreg::thread_idx_x() as usize;
    while e < experts {
        let total = layout::scan_expert_column(matrix, e, experts, chunks);
        // SAFETY: e < E.
        unsafe { *expert_counts.add(e) = total };
        e += sreg::block_dim_x() as usize;
    }
    // SAFETY: every thread of the block, in uniform control flow (caller contract).
    unsafe { sync::block_barrier() };
    let thread = sreg::thread_idx_x() as usize;
    if thread < 32 {
        // The first warp prefixes the totals: each lane sums a run of experts, the warp
        // prefixes the lanes' sums, each lane writes its run (a serial prefix over E = 384 by one
        // thread was most of this kernel's time). The same integer sums as `expert_offsets`.
        // SAFETY: sizes from the caller contract; the whole warp reaches the sums (the branch
        // is per warp); each lane writes its own run's words, lane 0 also the totals.
        unsafe {
            let counts = core::slice::from_raw_parts(expert_counts, experts);
            let item = |e| layout::expert_rows_and_tiles(counts, e, GEMM_TILE_M);
            warp_pair_prefix(experts, thread, item, (row_offsets, tile_offsets));
        }
    }
}

/// The exclusive prefix of the two counts `item(i)` over `items` items, then their totals, by
/// the calling warp — the words of the serial `tiles::write_prefix`: lane `lane` sums its run
/// ([`warp_lane_span`]), the warp prefixes the lanes' sums, each lane writes its run's prefixes
/// to `out.0[i]` and `out.1[i]`, and lane 0 the totals to `out.0[items]` and `out.1[items]`.
///
/// # Safety
/// All 32 lanes call it in warp-uniform control flow, `lane` being their lane; `out.0` and
/// `out.1` hold `items + 1` words each, which no other thread touches meanwhile.
#[inline(always)]
unsafe fn warp_pair_prefix(
    items: usize,
    lane: usize,
    item: impl Fn(usize) -> (u32, u32) + Copy,
    out: (*mut u32, *mut u32),
) {
    let (first, end) = warp_lane_span(items, lane);
    let (a, b) = span_sums((first, end), item);
    // SAFETY: caller contract: the whole warp.
    let ((a_before, a_total), (b_before, b_total)) =
        unsafe { (sync::warp_exclusive_sum_u32(a), sync::warp_exclusive_sum_u32(b)) };
    // SAFETY: `warp_lane_span` keeps the run `first..end` inside `items`, which `out` covers
    // (caller contract); the lanes' runs are disjoint, so each lane's slices are its own.
    let run = unsafe {
        (
            core::slice::from_raw_parts_mut(out.0.add(first), end - first),
            core::slice::from_raw_parts_mut(out.1.add(first), end - first),
        )
    };
    write_span_prefix(first, (a_before, b_before), run, item);
    if lane == 0 {
        // SAFETY: `out` holds `items + 1` words each (caller contract).
        unsafe { (*out.0.add(items), *out.1.add(items)) = (a_total, b_total) };
    }
}

/// Step 3. One thread per token: for each slot with a row, `slot_row[t·k+j] = row` and
/// `row_source[row] = t·k+j`; dropped slots get `NO_ROW`.
///
/// # Safety
/// Pointers must cover `[T·k]` ids, ranks and slot rows, `[chunks·E]` bases, `[E+1]` offsets
/// and `[T·k]` row sources.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_route_place(
    topk_ids: *const i32,
    slot_rank: *const u32,
    chunk_bases: *const u32,
    row_offsets: *const u32,
    tokens: u32,
    top_k: u32,
    num_experts: u32,
    slot_row: *mut u32,
    row_source: *mut u32,
) {
    // SAFETY: caller contract.
    unsafe {
        place_slots(topk_ids, slot_rank, chunk_bases, row_offsets, tokens, top_k, num_experts, slot_row, row_source)
    };
}

/// The body of [`mok_route_place`] for the token of this thread in `blockIdx.x`.
///
/// # Safety
/// As [`mok_route_place`].
#[inline(always)]
pub(crate) unsafe fn place_slots(
    topk_ids: *const i32,
    slot_rank: *const u32,
    chunk_bases: *const u32,
    row_offsets: *const u32,
    tokens: u32,
    top_k: u32,
    num_experts: u32,
    slot_row: *mut u32,
    row_source: *mut u32,
) {
    let token = sreg::block_idx_x() * sreg::block_dim_x() + sreg::thread_idx_x();
    if token >= tokens {
        return;
    }
    let k = top_k as usize;
    let first = token as usize * k;
    // SAFETY: token < T, so its k ids are in bounds.
    let ids = unsafe { core::slice::from_raw_parts(topk_ids.add(first), k) };
    let chunk = token / layout::ROUTE_CHUNK_TOKENS;
    for slot in 0..k {
        let row = match layout::slot_has_row(ids, slot, num_experts) {
            // SAFETY: expert < E, chunk < chunks, slot index < T·k.
            Some(expert) => unsafe {
                layout::slot_position(
                    *row_offsets.add(expert as usize),
                    *chunk_bases.add((chunk * num_experts + expert) as usize),
                    *slot_rank.add(first + slot),
                )
            },
            None => NO_ROW,
        };
        // SAFETY: slot index < T·k; a row index < total rows ≤ T·k.
        unsafe {
            *slot_row.add(first + slot) = row;
            if row != NO_ROW {
                *row_source.add(row as usize) = (first + slot) as u32;
            }
        }
    }
}

/// The sm_90 engine's tile offsets ([`crate::tiles::engine_tile_offsets`]) for a tile height
/// of `tile_m` rows from row offsets (`[groups + 1]`) into `tile_offsets` (`[2 · (groups + 1)]`).
/// The first warp of block 0: each lane sums a run of groups, the warp prefixes the lanes' sums,
/// each lane writes its run (one thread over E = 384 groups took ~50 µs, on the critical path of
/// every pass); the same integer sums as the serial function.
///
/// # Safety
/// `row_offsets` holds `groups + 1` words, `tile_offsets` `2 · (groups + 1)`; the launch's
/// first block holds at least one whole warp.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_tile_offsets(
    row_offsets: *const u32,
    groups: u32,
    tile_m: u32,
    tile_offsets: *mut u32,
) {
    let lane = sreg::thread_idx_x() as usize;
    if lane >= 32 || sreg::block_idx_x() != 0 {
        return;
    }
    let groups = groups as usize;
    // SAFETY: lengths from the caller contract; the whole first warp reaches the sums (the
    // branch above is per warp); each lane writes its own run's words, lane 0 also the totals.
    unsafe {
        let rows = core::slice::from_raw_parts(row_offsets, groups + 1);
        let item = |g| engine_group_counts(rows, g, tile_m);
        warp_pair_prefix(groups, lane, item, (tile_offsets, tile_offsets.add(groups + 1)));
    }
}
