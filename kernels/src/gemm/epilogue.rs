//! The epilogue: a warpgroup's accumulators leave through its shared-memory staging as TMA
//! stores (or reduce-adds), one staged pass at a time, with SwiGLU or the output conversion
//! applied in registers.

use crate::comm::error;
use crate::comm::wait::signal;
use crate::device::math;
use crate::gemm_layout::{
    BLOCK_64_BYTES, GemmParams, STAGE_BYTES, STAGES, STAGING_BYTES_PER_WARPGROUP, TILE_M, Variant, is_wgrad,
    staged_pair_address, staged_pair_base, staging_boxes, swizzled_chunk_offset,
};
use crate::ptx::convert::f32x2_to_bf16x2;
use crate::ptx::memory::{fence_proxy_async_shared_cta, st_global_v2, st_shared_u32, st_shared_v2};
use crate::ptx::{bulk, signal as warp, sreg, sync, tensormap, tma};

use super::hooks::RowScatter;
use super::mainloop::*;
use super::source::*;

/// Expands `$body` once per n8 block `$j` = 0..32 with `$j` a constant, so the accumulator
/// indices are compile-time constants and the array stays in registers (a rolled loop would put
/// it in local memory).
macro_rules! for_each_n8_block {
    ($j:ident => $body:block) => {
        for_each_n8_block!(@expand $j $body;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
    };
    (@expand $j:ident $body:block; $($value:literal)*) => {
        $({
            const $j: u32 = $value;
            $body
        })*
    };
}

/// Calls `visit(index, row, col)` for each pair of adjacent accumulators of this thread in the
/// first `BLOCKS` n8 blocks: `acc[index]`, `acc[index + 1]` are at warpgroup-tile row `row` < 64,
/// columns `col`, `col + 1`.
#[inline(always)]
pub(crate) fn for_each_pair<const BLOCKS: u32>(thread_in_wg: u32, visit: impl FnMut(usize, u32, u32)) {
    for_each_pair_in(0, BLOCKS, thread_in_wg, visit);
}

/// As [`for_each_pair`] for the n8 blocks `first..end` — pass constants: after inlining, a pass
/// over part of the tile then touches only that part's accumulators.
#[inline(always)]
pub(super) fn for_each_pair_in(first: u32, end: u32, thread_in_wg: u32, mut visit: impl FnMut(usize, u32, u32)) {
    let (warp, lane) = (thread_in_wg / 32, thread_in_wg % 32);
    for_each_n8_block!(J => {
        if first <= J && J < end {
            let col = 8 * J + 2 * (lane % 4);
            visit((4 * J) as usize, warp * 16 + lane / 4, col);
            visit((4 * J + 2) as usize, warp * 16 + lane / 4 + 8, col);
        }
    });
}

/// Where a staged epilogue's boxes go: the whole-buffer output map and the coordinates of the
/// warpgroup's first output row and column, plus the group index for 3-D maps.
#[derive(Clone, Copy)]
pub(super) struct OutputBox {
    pub(super) map: u64,
    pub(super) col0: u32,
    pub(super) row0: u32,
    /// `Some(group)` for the weight gradient's `[G][M][N]` map; `None` for 2-D row maps.
    pub(super) group: Option<u32>,
}

/// The epilogue: every variant's outputs go through this warpgroup's staging area
/// (`staging_boxes(V)` boxes) in the 128B-swizzled layout (conflict-free shared stores from the
/// accumulator fragment) and leave as TMA stores — full lines, clipped by the map at the
/// tensor's edges, and in flight while the next tile's MMAs run. A box is 64 rows × 128 bytes:
/// 64 bf16 or 32 f32 columns; a pass fills the staging (the SwiGLU pass its 128 hidden columns). Row tiles that end inside their group store through the output map cut at the
/// group's end, so no row of the next group is written.
///
/// An f32 row tile with a `scatter` ([`RowScatter`]: across ranks, the push combine) leaves
/// by [`scatter_rows`] instead.
///
/// # Safety
/// The whole consumer warpgroup `wg` calls it; `staging` is this warpgroup's staging; the maps
/// and outputs match the variant (host contract); a `scatter` is valid for `p` ([`RowScatter`]'s
/// regions hold every row's slot).
#[inline(always)]
pub(super) unsafe fn epilogue<const V: u32>(
    p: &GemmParams,
    w: &Work,
    acc: &[f32; ACCUMULATORS],
    staging: u32,
    (wg, thread_in_wg): (u32, u32),
    scatter: Option<RowScatter>,
) {
    if !is_wgrad(V)
        && V != Variant::GATE_UP
        && V != Variant::ROWS_NT_BF16
        && let Some(s) = scatter
    {
        // SAFETY: caller contract.
        unsafe { scatter_rows(p, w, acc, (wg, thread_in_wg), s) };
        return;
    }
    let out = if is_wgrad(V) {
        OutputBox { map: p.map_out, col0: w.n0, row0: w.m0 + wg * 64, group: Some(w.group) }
    } else if w.rows < TILE_M {
        let cut = p.group_map(w.group, OUTPUT_SLOT);
        if thread_in_wg == 0 {
            // SAFETY: written by the group-map kernel before this launch (host contract).
            unsafe { tensormap::acquire(cut) };
        }
        OutputBox { map: cut, col0: w.n0, row0: w.m0 - w.row_begin + wg * 64, group: None }
    } else {
        OutputBox { map: p.map_out, col0: w.n0, row0: w.m0 + wg * 64, group: None }
    };
    if V == Variant::GATE_UP {
        // Accumulator columns 0..128 are gate, 128..256 up (n8 block j + 16, index + 64), for
        // hidden columns n0 + col: one pass of 128 bf16 columns.
        const UP: usize = ACCUMULATORS / 2;
        let limit = p.swiglu_limit;
        // SAFETY: the whole warpgroup with its staging (caller contract); `out` is the variant's
        // output map or the group's cut map, acquired above by the storing thread.
        unsafe {
            staged_pass(staging, wg, thread_in_wg, 0, N8_BLOCKS / 2, out, true, false, false, |index| {
                let (cg0, cu0) = math::clamp_gate_up(acc[index], acc[index + UP], limit);
                let (cg1, cu1) = math::clamp_gate_up(acc[index + 1], acc[index + UP + 1], limit);
                [f32x2_to_bf16x2(math::swiglu(cg0, cu0), math::swiglu(cg1, cu1)), 0]
            })
        };
        if p.out1 != 0 {
            // SAFETY: as the caller's.
            unsafe { store_pre_activations(p, w, acc, wg, thread_in_wg) };
        }
    } else if (is_wgrad(V) && p.out1 == 0) || V == Variant::ROWS_NT_BF16 {
        // bf16 (weight gradient, or rows): 256 columns, 64 per box.
        let passes = const { 4 / staging_boxes(V) };
        let xor_addresses = V == Variant::WGRAD_IN_PAIR;
        for pass in 0..passes {
            let first = pass * N8_BLOCKS / passes;
            // SAFETY: as for the SwiGLU pass above.
            unsafe {
                staged_pass(
                    staging,
                    wg,
                    thread_in_wg,
                    first,
                    first + N8_BLOCKS / passes,
                    out,
                    true,
                    false,
                    xor_addresses,
                    |index| [f32x2_to_bf16x2(acc[index], acc[index + 1]), 0],
                )
            };
        }
    } else {
        // f32: 256 columns, 32 per box; the f32 weight gradient adds into its output.
        let add = is_wgrad(V);
        let passes = const { 8 / staging_boxes(V) };
        for pass in 0..passes {
            let first = pass * N8_BLOCKS / passes;
            // SAFETY: as for the SwiGLU pass above.
            unsafe {
                staged_pass(
                    staging,
                    wg,
                    thread_in_wg,
                    first,
                    first + N8_BLOCKS / passes,
                    out,
                    false,
                    add,
                    false,
                    |index| [acc[index].to_bits(), acc[index + 1].to_bits()],
                )
            };
        }
    }
}

/// An f32 row tile stored by its consumer threads straight from their accumulators into each
/// row's [`RowScatter`] destination (the token owner's slot buffer at the row's slot; rows past
/// `w.rows` and columns past `p.n` are not stored), then, after a warp barrier (every lane's
/// stores before the release), the first lane of each quad — the four lanes holding a row —
/// raises the row's `slot_ready` flag on its owner by 1 with a release at the heap's scope,
/// unless the fault injection or this rank's error record says otherwise. The quads' 8-byte
/// stores fill whole 32-byte sectors. Nothing goes through the staging, so the next tile's
/// epilogue never waits for these stores.
///
/// # Safety
/// `s` is valid for `p` (its regions hold every row's owner and slot, the slot buffers `p.n`
/// f32 per slot); the whole warpgroup calls it.
#[inline(always)]
unsafe fn scatter_rows(
    p: &GemmParams,
    w: &Work,
    acc: &[f32; ACCUMULATORS],
    (wg, thread_in_wg): (u32, u32),
    s: RowScatter,
) {
    // `%laneid` read here rather than derived from the thread index: fewer values held across
    // the phases (the backward's spills 60 → 48 bytes).
    let lane = sreg::lane_id();
    // This thread's two rows of the tile ([`for_each_pair`]: the upper one and 8 below).
    let first_row = wg * 64 + (thread_in_wg / 32) * 16 + lane / 4;
    // SAFETY: caller contract.
    let e = unsafe { &*s.exchange };
    // A rank whose record is set stores nothing more (its rows may be stale, and a peer may
    // still be reading its slot buffer of another pass), as the flags below: read once here,
    // beside the row words, so the loads overlap.
    // SAFETY: the record is valid (caller contract).
    let failed = unsafe { error::has_error(s.error) };
    // Where a row of the tile goes: its owner and slot (the owner's and slot's words are read
    // again for the flags, not held across the stores: the accumulators leave no registers).
    // A place outside the heap is never stored to, whatever the ring map holds: the owner a
    // rank, the slot one of its T·k, the row as wide as the heap's.
    let (slots, width_fits) = (e.tokens * e.top_k, p.n == e.hidden);
    // SAFETY: caller contract: the rows below `w.rows` are plan rows with an owner and a slot.
    let place = |r: u32| unsafe {
        if r >= w.rows || failed || !width_fits {
            return None;
        }
        let row = (w.m0 + r) as usize;
        let (owner, slot) = (*s.owners.add(row), *s.slots.add(row));
        (owner < e.world && slot < slots).then_some((owner, slot))
    };
    let destination = |r: u32| {
        place(r).map_or(core::ptr::null_mut(), |(owner, slot)| {
            // SAFETY: the owner's slot buffer holds `p.n` f32 per slot (checked above).
            unsafe { (e.map(s.rows_region, owner) as *mut f32).add(slot as usize * p.n as usize + w.n0 as usize) }
        })
    };
    // One row at a time (one destination register pair live), its n8 blocks inside the row (a
    // row's length is a multiple of 8: whole blocks). `half` is a constant after inlining, so
    // the accumulator indices are too.
    let column_blocks = (p.n - w.n0) / 8;
    let quad_column = 2 * (lane % 4);
    let store_row = |half: u32| {
        let row = destination(first_row + 8 * half);
        if row.is_null() {
            return;
        }
        for_each_n8_block!(J => {
            if J < column_blocks {
                let index = (4 * J + 2 * half) as usize;
                // SAFETY: inside the slot's row; 8-byte aligned (even column, even row length).
                unsafe {
                    let at = row.add((8 * J + quad_column) as usize) as *mut u32;
                    st_global_v2(at, [acc[index].to_bits(), acc[index + 1].to_bits()]);
                }
            }
        });
    };
    store_row(0);
    store_row(1);
    // SAFETY: all 32 lanes of the warp (the whole warpgroup calls this: caller contract).
    unsafe { warp::warp_sync() };
    // The row's flag, once per N tile; not once this rank's record is set (read again: it may
    // have been set during the tile).
    let raise = |r: u32| {
        if let Some((owner, slot)) = place(r) {
            // SAFETY: the owner's `slot_ready` holds a flag per slot.
            unsafe {
                let flag = (e.map(e.regions.slot_ready, owner) as *mut u32).add(slot as usize);
                signal(flag, 1, e.sys_scope != 0);
            }
        }
    };
    // SAFETY: the record is valid (caller contract).
    if lane % 4 == 0 && s.raise_flags && !unsafe { error::has_error(s.error) } {
        raise(first_row);
        raise(first_row + 8);
    }
}

/// The group-map slot of the output rows (see `GemmParams::cut_maps`).
pub(super) const OUTPUT_SLOT: u32 = 2;

/// One staged pass: waits for the staging to be free, stages the accumulator pairs of n8 blocks
/// `first..end` (`pair(index)` gives the bf16x2 word, or the two f32 words), publishes them and
/// has the leader store (or add, for `add`) its boxes at columns `out.col0 + 8 · first ..`.
/// Inline with constant block ranges, so only those accumulators are touched. `xor_addresses`
/// (bf16 only) computes each pair's staging address where it is stored instead of letting the
/// compiler hoist all 64 out of the tile loop: the weight gradient inside the backward
/// megakernel, whose consumers have no registers to spare for them (its weight gradients alone
/// 19.2 → 15.6 ms at kimi 8192), not the standalone kernels, which were slower with it (the
/// standalone weight gradient 9–16 %, docs/PERF.md).
///
/// # Safety
/// The whole consumer warpgroup `wg` calls it in uniform control flow; `staging` is its own
/// staging area (1024-aligned, used by nothing else) and holds the pass's boxes; `out.map` is a
/// valid (acquired) tensor map of the output with 64-row boxes of 128 bytes, 3-D with
/// `out.group`, over memory the tile may write (add into, for `add`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn staged_pass(
    staging: u32,
    wg: u32,
    thread_in_wg: u32,
    first: u32,
    end: u32,
    out: OutputBox,
    bf16: bool,
    add: bool,
    xor_addresses: bool,
    mut pair: impl FnMut(usize) -> [u32; 2],
) {
    // SAFETY: the whole consumer warpgroup `wg`, in uniform control flow (caller contract).
    unsafe { staging_free(wg, thread_in_wg) };
    let first_col = 8 * first;
    if xor_addresses && bf16 {
        // One instruction per pair (`staged_pair_address`: the staging area is 1024-aligned),
        // and no per-pair address register held across tiles.
        const { assert!(STAGING_BYTES_PER_WARPGROUP.is_multiple_of(1024) && (STAGES * STAGE_BYTES).is_multiple_of(1024)) };
        let s = staging + staged_pair_base(thread_in_wg);
        for_each_n8_block!(J => {
            if first <= J && J < end {
                let at = staged_pair_address(s, J - first);
                // SAFETY: inside this warpgroup's staging, 4-byte aligned.
                unsafe {
                    st_shared_u32(at, pair((4 * J) as usize)[0]);
                    st_shared_u32(at + 8 * 128, pair((4 * J + 2) as usize)[0]);
                }
            }
        });
    } else {
        for_each_pair_in(first, end, thread_in_wg, |index, row, col| {
            let c = col - first_col;
            let (box_index, byte) = if bf16 { (c / 64, (c % 64) * 2) } else { (c / 32, (c % 32) * 4) };
            let at = staging + box_index * BLOCK_64_BYTES + swizzled_chunk_offset(row, byte / 16) + byte % 16;
            let words = pair(index);
            // SAFETY: inside this warpgroup's staging; 4- (bf16) or 8-byte (f32) aligned.
            unsafe {
                if bf16 {
                    st_shared_u32(at, words[0]);
                } else {
                    st_shared_v2(at, words);
                }
            }
        });
    }
    fence_proxy_async_shared_cta();
    // SAFETY: the whole consumer warpgroup (128 threads) with its own id.
    unsafe { sync::named_barrier(1 + wg, 128) };
    if thread_in_wg == 0 {
        let box_cols = if bf16 { 64 } else { 32 };
        for b in 0..(end - first) * 8 / box_cols {
            let col = (out.col0 + first_col + b * box_cols) as i32;
            let src = staging + b * BLOCK_64_BYTES;
            // SAFETY: the box was published above; the map's bounds clip rows and columns.
            unsafe {
                match (out.group, add) {
                    (Some(g), false) => tma::store_3d(out.map, col, out.row0 as i32, g as i32, src),
                    (Some(g), true) => tma::reduce_add_3d(out.map, col, out.row0 as i32, g as i32, src),
                    (None, _) => tma::store_2d(out.map, col, out.row0 as i32, src),
                }
            }
        }
        bulk::commit_group();
    }
}

/// Waits until this warpgroup's staging is free again: its leader waits for the bulk stores that
/// read it, then the warpgroup meets at its named barrier.
///
/// # Safety
/// Every thread of consumer warpgroup `wg` (`thread_in_wg` its index there) calls it, in
/// warp-uniform control flow, and no other thread uses named barrier `1 + wg` meanwhile.
#[inline(always)]
pub(super) unsafe fn staging_free(wg: u32, thread_in_wg: u32) {
    if thread_in_wg == 0 {
        bulk::wait_group_read_all();
    }
    // SAFETY: exactly the warpgroup's 128 threads reach barrier `1 + wg` (caller contract).
    unsafe { sync::named_barrier(1 + wg, 128) };
}

/// The optional f32 gate and up pre-activations of the SwiGLU tile, stored from registers (only
/// when backward asks for them instead of recomputing).
///
/// # Safety
/// `out1`, `out2` are `[cap][I]` f32.
#[inline(always)]
pub(super) unsafe fn store_pre_activations(
    p: &GemmParams,
    w: &Work,
    acc: &[f32; ACCUMULATORS],
    wg: u32,
    thread_in_wg: u32,
) {
    const UP: usize = ACCUMULATORS / 2;
    // Read once: in a persistent kernel `p` is global memory, which the stores below could
    // alias as far as the compiler knows, so fields read inside the loop were loaded again
    // after every store (165 loads per tile in the forward megakernel's SASS).
    let (gate, up, n) = (p.out1 as *mut f32, p.out2 as *mut f32, p.n);
    for_each_pair::<{ N8_BLOCKS / 2 }>(thread_in_wg, |index, row, col| {
        let r = wg * 64 + row;
        if r >= w.rows || w.n0 + col >= n {
            return;
        }
        let at = (w.m0 + r) as usize * n as usize + (w.n0 + col) as usize;
        // SAFETY: row and column inside the group's rows and [0, I).
        unsafe {
            *gate.add(at) = acc[index];
            *gate.add(at + 1) = acc[index + 1];
            *up.add(at) = acc[index + UP];
            *up.add(at + 1) = acc[index + UP + 1];
        }
    });
}
