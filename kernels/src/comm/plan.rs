//! The device-side schedule, step by step (device only; the index math is
//! [`super::schedule`]'s).
//!
//! Per pass, on every rank (the standalone kernels run them in this order, a kernel boundary
//! apart; a persistent kernel calls the same functions):
//! 1. the single-rank routing layout of the rank's own slots: [`rank_chunk_warp`] (one warp per
//!    64-token chunk, 32 slots at a time), then the routing scan and place kernels
//!    (`crate::entry::route`);
//! 2. [`prepare_tokens`]: the slot-addressed map the combine sum uses;
//! 3. [`publish`]: a release store of the pass's epoch — "my inputs and layout are ready";
//! 4. [`schedule_block`]: wait (bounded) for every rank's epoch, read every rank's per-expert
//!    counts for this rank's experts, place the segments with prefix sums, check capacity;
//! 5. [`ring_map_rows`]: the inverse map, ring row → (source rank, source slot);
//! 6. (consumer side) [`wait_tiles`]: bounded wait until each M tile's rows have landed.

use super::error::{self, ERROR_CAPACITY};
use super::params::ERROR_WORDS;
use super::schedule::{epoch_reached, owner_offsets, ring_segment, rows_in_tile};
use super::wait::wait_until;
use super::{Pass, RankView};
use crate::gemm_layout::TILE_M;
use crate::layout::{self, NO_ROW, RouteError};
use crate::ptx::collective::{lanemask_lt, match_any_u32};
use crate::ptx::memory::{
    atom_cas_acq_rel_gpu_u32, fence_acq_rel_sys, ld_shared_u32, st_release_sys_u32, st_shared_u32,
};
use crate::ptx::{signal, sreg, sync};
use crate::tiles::{GEMM_TILE_M, engine_tile_offsets};

/// Key of a slot without a row in [`rank_chunk_warp`].
const NO_KEY: u32 = u32::MAX;

/// Step 1, warp-collective: ranks one chunk's `slots` slots (whole tokens of `k`), giving the
/// same values as [`layout::rank_chunk`] — `ranks[i]` = earlier slots of the chunk, in
/// (token, slot) order, routed to the same expert; `counters` (a shared-memory array of
/// `num_experts` zeroed u32) end as the chunk's per-expert counts — but 32 slots per step instead
/// of one: the lanes of a step are grouped by expert (`match.any`), each slot's rank is the
/// expert's count before the step plus its peers on lower lanes, and the highest peer adds the
/// group's size. A bad id (out of range, or repeated within its token) is dropped, and the first
/// such slot of the chunk is reported in `error` (`[code, slot, id, 0]`) unless another chunk
/// reported first.
///
/// # Safety
/// `ids` and `ranks` hold `slots` entries; `counters` is this block's shared memory with
/// `num_experts` words, zeroed and not used by other warps; `error` has 4 words. All 32 lanes
/// call it in uniform control flow.
pub unsafe fn rank_chunk_warp(
    ids: *const i32,
    slots: usize,
    k: usize,
    num_experts: u32,
    counters: u32,
    ranks: *mut u32,
    first_slot: u32,
    error: *mut u32,
) {
    let lane = sreg::lane_id() as usize;
    let mut reported = false;
    let mut round = 0;
    while round < slots {
        let i = round + lane;
        let (mut key, mut problem) = (NO_KEY, None);
        if i < slots {
            let token = i / k * k;
            // SAFETY: the token's slots lie inside the chunk.
            let token_ids = unsafe { core::slice::from_raw_parts(ids.add(token), k) };
            let slot = i - token;
            let id = token_ids[slot];
            match layout::slot_has_row(token_ids, slot, num_experts) {
                Some(expert) => key = expert,
                None if id == -1 => {}
                None => {
                    let code = if layout::routed_expert(id, num_experts).is_some() {
                        layout::ROUTE_ERROR_DUPLICATE_ID
                    } else {
                        layout::ROUTE_ERROR_ID_OUT_OF_RANGE
                    };
                    problem = Some(RouteError { code, slot_index: first_slot + i as u32, id });
                }
            }
        }
        // SAFETY: all 32 lanes, in uniform control flow (caller contract; `round` is uniform).
        let peers = unsafe { match_any_u32(key) };
        let below = (peers & lanemask_lt()).count_ones();
        let mut base = 0;
        if key != NO_KEY {
            // SAFETY: key < num_experts: a word of the counters.
            base = unsafe { ld_shared_u32(counters + 4 * key) };
            // SAFETY: i < slots.
            unsafe { *ranks.add(i) = base + below };
        } else if i < slots {
            // SAFETY: i < slots. Dropped slots rank 0, as in the sequential ranking.
            unsafe { *ranks.add(i) = 0 };
        }
        // Every lane has read its expert's count before the highest peer moves it on.
        // SAFETY: all 32 lanes, in uniform control flow (as above).
        unsafe { signal::warp_sync() };
        if key != NO_KEY && peers >> lane == 1 {
            // SAFETY: as above.
            unsafe { st_shared_u32(counters + 4 * key, base + peers.count_ones()) };
        }
        // SAFETY: as above.
        unsafe { signal::warp_sync() };
        // SAFETY: all 32 lanes, in uniform control flow (as for `match_any_u32`).
        let bad = unsafe { sync::ballot(problem.is_some()) };
        if bad != 0 && !reported {
            reported = true;
            if lane == bad.trailing_zeros() as usize
                && let Some(found) = problem
            {
                // SAFETY: `error` has 4 words; the CAS makes the first reporter win.
                unsafe {
                    if atom_cas_acq_rel_gpu_u32(error, 0, found.code) == 0 {
                        *error.add(1) = found.slot_index;
                        *error.add(2) = found.id as u32;
                    }
                }
            }
        }
        round += 32;
    }
}

/// Step 2, grid-stride over this rank's slots (`first`, `stride` in threads):
/// `slot_self[i] = i` where the slot has a row, `NO_ROW` where it was dropped.
///
/// # Safety
/// `view` must describe a heap the host laid out for these parameters.
pub unsafe fn prepare_tokens(view: &RankView, first: usize, stride: usize) {
    let p = view.params;
    let slots = p.tokens as usize * p.top_k as usize;
    let slot_row: *const u32 = view.local(p.regions.slot_row);
    let slot_self: *mut u32 = view.local(p.regions.slot_self);
    let mut i = first;
    while i < slots {
        // SAFETY: i < T·k, both regions hold T·k words.
        unsafe { *slot_self.add(i) = if *slot_row.add(i) == NO_ROW { NO_ROW } else { i as u32 } };
        i += stride;
    }
}

/// Step 3, one thread: publishes `epoch` in this rank's flag. The system-scope fence first makes
/// the earlier kernels' writes (inputs, layout) part of what the release publishes to peers.
///
/// # Safety
/// As [`prepare_tokens`].
pub unsafe fn publish(view: &RankView, epoch: u32) {
    fence_acq_rel_sys();
    // SAFETY: the flag is word 0 of this rank's `published` region.
    unsafe { st_release_sys_u32(view.local(view.params.regions.published), epoch) };
}

/// Block-collective: every rank's publish flag has reached `epoch`. Threads split the ranks and
/// wait (bounded); a timeout is recorded naming the rank. `flag` is 4 bytes of this block's
/// shared memory. Returns `false` (in every thread) when any wait failed or the rank's record
/// already holds an error.
///
/// # Safety
/// As [`prepare_tokens`]; all threads of the block call it in uniform control flow.
pub unsafe fn wait_all_published(view: &RankView, epoch: u32, flag: u32) -> bool {
    let p = view.params;
    let (thread, threads) = (crate::ptx::sreg::thread_idx_x(), crate::ptx::sreg::block_dim_x());
    if thread == 0 {
        // SAFETY: `flag` is this block's shared word; the record is this rank's.
        unsafe { st_shared_u32(flag, error::has_error(view.error()) as u32) };
    }
    // SAFETY: every thread of the block, in uniform control flow (caller contract).
    unsafe { sync::block_barrier() };
    // SAFETY: this block's shared word, written before the barrier.
    let mut peer = if unsafe { ld_shared_u32(flag) } == 0 { thread } else { p.world };
    // Every thread has read the flag before a timed-out wait below may set it (racecheck
    // reported that write-after-read when a peer was silent).
    // SAFETY: as above.
    unsafe { sync::block_barrier() };
    while peer < p.world {
        let published: *const u32 = view.peer(p.regions.published, peer);
        // SAFETY: the peer's flag and this rank's record are valid heap words.
        let waited =
            unsafe { wait_until(published, view.sys(), p.timeout_ns, view.error(), |v| epoch_reached(v, epoch)) };
        if let Err(seen) = waited {
            // SAFETY: as above; `flag` is this block's shared word.
            unsafe {
                view.record_timeout(error::WAIT_PEER_PUBLISHED, peer, 0, epoch, seen, epoch);
                st_shared_u32(flag, 1);
            }
        }
        peer += threads;
    }
    // SAFETY: as above.
    unsafe { sync::block_barrier() };
    // SAFETY: this block's shared word, written before the barrier.
    let ok = unsafe { ld_shared_u32(flag) } == 0;
    // Every thread has read the flag before any thread can reuse it.
    // SAFETY: as above.
    unsafe { sync::block_barrier() };
    ok
}

/// Step 4, block-collective (one block per rank): waits for every rank's epoch, gathers the
/// per-expert counts of this rank's experts from every rank into `peer_counts`, then one thread
/// computes the ring offsets and checks capacity (an error record with the rows needed, never a
/// trap). The counts were published by each rank's release and acquired by one thread of this
/// block; the block barrier orders that acquire before every thread's reads.
///
/// # Safety
/// As [`wait_all_published`].
pub unsafe fn schedule_block(view: &RankView, epoch: u32, flag: u32) {
    // SAFETY: caller contract.
    if !unsafe { wait_all_published(view, epoch, flag) } {
        return;
    }
    let p = view.params;
    let (world, local) = (p.world as usize, p.local_experts as usize);
    let (thread, threads) = (crate::ptx::sreg::thread_idx_x() as usize, crate::ptx::sreg::block_dim_x() as usize);
    let peer_counts: *mut u32 = view.local(p.regions.peer_counts);
    let mut i = thread;
    while i < world * local {
        let (source, expert) = (i / local, i % local);
        let counts: *const u32 = view.peer(p.regions.expert_counts, source as u32);
        // SAFETY: i < P·L; the source's counts hold E words and rank·L + expert < E.
        unsafe { *peer_counts.add(i) = *counts.add(view.rank as usize * local + expert) };
        i += threads;
    }
    // SAFETY: every thread of the block, in uniform control flow (caller contract; the wait
    // above answers alike in every thread).
    unsafe { sync::block_barrier() };
    if thread == 0 {
        // SAFETY: the regions hold P·L, L+1, L+1, L·P+1 and 2·(L+1) words; only this thread
        // writes them.
        let total = unsafe {
            let ring_row_offsets = core::slice::from_raw_parts_mut(view.local(p.regions.ring_row_offsets), local + 1);
            let total = owner_offsets(
                core::slice::from_raw_parts(peer_counts, world * local),
                world,
                local,
                GEMM_TILE_M,
                ring_row_offsets,
                core::slice::from_raw_parts_mut(view.local(p.regions.ring_tile_offsets), local + 1),
                core::slice::from_raw_parts_mut(view.local(p.regions.recv_base), local * world + 1),
            );
            // The one tile vocabulary: the megakernels' plans read these, no launch between.
            engine_tile_offsets(
                ring_row_offsets,
                TILE_M,
                core::slice::from_raw_parts_mut(view.local(p.regions.ring_engine_tile_offsets), 2 * (local + 1)),
            );
            total
        };
        if total > p.capacity {
            // An empty ring for the rest of the pass: movers and GEMMs that read these offsets
            // then touch nothing past the capacity. The record keeps the size that was needed.
            // SAFETY: as above.
            unsafe {
                for i in 0..=local {
                    *view.local::<u32>(p.regions.ring_row_offsets).add(i) = 0;
                    *view.local::<u32>(p.regions.ring_tile_offsets).add(i) = 0;
                }
                for i in 0..2 * (local + 1) {
                    *view.local::<u32>(p.regions.ring_engine_tile_offsets).add(i) = 0;
                }
                for i in 0..=local * world {
                    *view.local::<u32>(p.regions.recv_base).add(i) = 0;
                }
            }
            let mut words = [0u32; ERROR_WORDS];
            words[error::WORD_CODE] = ERROR_CAPACITY;
            words[error::WORD_PEER] = view.rank;
            words[error::WORD_EXPECTED] = total;
            words[error::WORD_SEEN] = p.capacity;
            words[error::WORD_RANK] = view.rank;
            words[error::WORD_EPOCH] = epoch;
            // SAFETY: this rank's record.
            unsafe { error::record(view.error(), words) };
        }
    }
}

/// Step 5, grid-stride over ring rows: `ring_source_{rank,slot}[row]` = where the row comes from.
/// The source's layout is read through the peer mapping (acquired by the schedule step, which
/// ran before in stream order).
///
/// # Safety
/// As [`prepare_tokens`]; the schedule step has run for this epoch.
pub unsafe fn ring_map_rows(view: &RankView, first: usize, stride: usize) {
    let p = view.params;
    // SAFETY: this rank's record.
    if unsafe { error::has_error(view.error()) } {
        return;
    }
    let (world, local) = (p.world as usize, p.local_experts as usize);
    // SAFETY: the schedule step wrote L·P + 1 bases.
    let recv_base = unsafe { core::slice::from_raw_parts(view.local::<u32>(p.regions.recv_base), local * world + 1) };
    let total = recv_base[local * world] as usize;
    let (ring_rank, ring_slot): (*mut u32, *mut u32) =
        (view.local(p.regions.ring_source_rank), view.local(p.regions.ring_source_slot));
    let mut row = first;
    while row < total {
        if let Some((segment, position)) = ring_segment(recv_base, row as u32) {
            let (expert, source) = (segment / world, (segment % world) as u32);
            let global_expert = view.rank as usize * local + expert;
            let offsets: *const u32 = view.peer(p.regions.row_offsets, source);
            let row_source: *const u32 = view.peer(p.regions.row_source, source);
            // SAFETY: the source's layout has E+1 offsets and its expert's rows start there;
            // row < total ≤ capacity (the schedule checked).
            unsafe {
                let slot = *row_source.add((*offsets.add(global_expert) + position) as usize);
                *ring_rank.add(row) = source;
                *ring_slot.add(row) = slot;
            }
        }
        row += stride;
    }
}

/// Step 6, grid-stride over M tiles: bounded wait until each tile's rows have landed in the ring
/// of `pass` (the standalone stand-in for a compute warp that waits before loading its tile).
///
/// # Safety
/// As [`prepare_tokens`]; the tile counters were cleared before the pass's movers ran.
pub unsafe fn wait_tiles(view: &RankView, pass: Pass, epoch: u32, first: usize, stride: usize) {
    let p = view.params;
    // SAFETY: this rank's record.
    if unsafe { error::has_error(view.error()) } {
        return;
    }
    let local = p.local_experts as usize;
    // SAFETY: the schedule step wrote L + 1 offsets of each kind.
    let (rows, tiles) = unsafe {
        (
            core::slice::from_raw_parts(view.local::<u32>(p.regions.ring_row_offsets), local + 1),
            core::slice::from_raw_parts(view.local::<u32>(p.regions.ring_tile_offsets), local + 1),
        )
    };
    let (counter_region, waited_for) = match pass {
        Pass::Forward => (p.regions.tile_ready, error::WAIT_X_TILE_ROWS),
        Pass::Backward => (p.regions.dy_tile_ready, error::WAIT_DY_TILE_ROWS),
    };
    let counters: *const u32 = view.local(counter_region);
    let mut tile = first;
    while tile < tiles[local] as usize {
        let expected = rows_in_tile(rows, tiles, tile as u32, GEMM_TILE_M).unwrap_or(0);
        // SAFETY: tile < tiles ≤ max_tiles.
        let waited = unsafe { wait_until(counters.add(tile), false, p.timeout_ns, view.error(), |v| v >= expected) };
        if let Err(seen) = waited {
            // SAFETY: this rank's record.
            unsafe { view.record_timeout(waited_for, view.rank, tile as u32, expected, seen, epoch) };
            return;
        }
        tile += stride;
    }
}
