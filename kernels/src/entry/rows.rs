//! Row-wise kernels of the unfused path: gather into expert order, combine back in slot order,
//! the slot-weight gradient (alone, or with the backward's gather) and the SwiGLU backward. The
//! row kernels loop over a count the device holds (`row_count`, written by the routing kernels),
//! so the host never needs it; the slot kernels over T · k slots, one warp each.

use crate::device::grid_thread;
use crate::device::math;
use crate::device::rows::{combine_quads, dot8, gather_scaled_row_and_dot, scale_bf16x8};
use crate::layout::NO_ROW;
use crate::ptx::convert::f32_to_bf16;
use crate::ptx::memory::{ld_global_v4, st_global_v4};
use crate::ptx::sync;

/// `out[r] = src[token(r)]`, or `bf16(weight(r) · src[token(r)])` when `topk_weights` is
/// non-null, for rows `r < *row_count`, where row r holds slot `row_source[r] = t·k + j`.
/// Forward: gather x into expert order; backward: dy gathered and scaled by its slot weight.
///
/// # Safety
/// `src` `[T][width]` bf16, `row_source` `[*row_count]`, `topk_weights` `[T·k]` or null,
/// `out` `[*row_count][width]`; `width % 8 == 0`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_gather_rows(
    src: *const u16,
    row_source: *const u32,
    top_k: u32,
    topk_weights: *const f32,
    row_count: *const u32,
    width: u32,
    out: *mut u16,
) {
    let vectors_per_row = (width / 8) as usize;
    // SAFETY: written by the routing kernels earlier in the stream.
    let total = unsafe { *row_count } as usize * vectors_per_row;
    let (mut v, stride) = grid_thread();
    while v < total {
        let (row, chunk) = (v / vectors_per_row, v % vectors_per_row);
        // SAFETY: row < row_count; the source slot names a token < T; 16-byte aligned rows.
        unsafe {
            let slot = *row_source.add(row) as usize;
            let token = slot / top_k as usize;
            let mut vector = ld_global_v4(src.add(token * width as usize + chunk * 8) as *const u32);
            if !topk_weights.is_null() {
                vector = scale_bf16x8(*topk_weights.add(slot), vector);
            }
            st_global_v4(out.add(row * width as usize + chunk * 8) as *mut u32, vector);
        }
        v += stride;
    }
}

/// `out[t] = bf16(base[t] + Σ_j w[t,j] · rows[slot_row[t,j]])` in f32, the base (shared expert)
/// first, then slots j = 0..k in order; dropped slots skipped; `w` = 1 when `topk_weights` is
/// null (the dx combine), and the base is 0 when `base` is null. One thread per 4 columns.
///
/// # Safety
/// `slot_row` `[T·k]`, `topk_weights` `[T·k]` or null, `rows` `[R][width]` f32, `base`
/// `[T][width]` f32 or null, `out` `[T][width]` bf16; `width % 4 == 0`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_combine_slots(
    slot_row: *const u32,
    topk_weights: *const f32,
    rows: *const f32,
    base: *const f32,
    tokens: u32,
    top_k: u32,
    width: u32,
    out: *mut u16,
) {
    let quads_per_row = (width / 4) as usize;
    let total = tokens as usize * quads_per_row;
    let (mut q, stride) = grid_thread();
    while q < total {
        let (token, column) = (q / quads_per_row, q % quads_per_row * 4);
        // SAFETY: token < T, column + 4 ≤ width; the tensors as documented.
        unsafe { combine_quads::<1>(slot_row, topk_weights, rows, base, token, (column, 0), top_k, width, out) };
        q += stride;
    }
}

/// `d_topk_weights[t·k+j] = <dy[t], rows[slot_row[t·k+j]]>` in f32 (0 for dropped slots).
/// One warp per slot; each lane sums a fixed strided subset of columns in order, then a fixed
/// butterfly sums the lanes, so the result is deterministic.
///
/// # Safety
/// `dy` `[T][width]` bf16, `rows` `[R][width]` f32, `slot_row` and `out` `[T·k]`;
/// `width % 8 == 0`; blocks of whole warps (a multiple of 32 threads).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_topk_weight_grad(
    dy: *const u16,
    rows: *const f32,
    slot_row: *const u32,
    tokens: u32,
    top_k: u32,
    width: u32,
    out: *mut f32,
) {
    let w = width as usize;
    let dot = |_, token: usize, row: u32, lane: usize| {
        let mut partial = 0.0f32;
        let mut column = lane * 8;
        while column < w {
            // SAFETY: token < T, row < R, column + 8 ≤ width, 16-byte aligned.
            let (g, lo, hi) = unsafe {
                (
                    ld_global_v4(dy.add(token * w + column) as *const u32),
                    ld_global_v4(rows.add(row as usize * w + column) as *const u32),
                    ld_global_v4(rows.add(row as usize * w + column + 4) as *const u32),
                )
            };
            partial = dot8(partial, g, lo, hi);
            column += 32 * 8;
        }
        partial
    };
    // SAFETY: caller contract (`slot_row` and `out` `[T·k]`, blocks of whole warps).
    unsafe { for_each_slot_by_warp(slot_row, (tokens, top_k), out, dot) }
}

/// The slot loop of the kernels that give each slot `t·k + j` its own warp: for every slot of
/// this warp (grid-stride over T·k), `partial(slot, token, row, lane)` for a routed slot (row `row`),
/// 0 for a dropped one; then the lanes' partials summed by the fixed butterfly and the sum stored
/// in `out[slot]` by lane 0. Every result is the same whichever warp takes a slot.
///
/// # Safety
/// `slot_row` and `out` are `[T·k]`; the launch's blocks are whole warps (a multiple of 32
/// threads); `partial` is sound for every routed slot's token and row.
#[inline(always)]
unsafe fn for_each_slot_by_warp(
    slot_row: *const u32,
    (tokens, top_k): (u32, u32),
    out: *mut f32,
    mut partial: impl FnMut(usize, usize, u32, usize) -> f32,
) {
    let (thread, threads) = grid_thread();
    let lane = thread % 32;
    let (mut slot, warps) = (thread / 32, threads / 32);
    let slots = tokens as usize * top_k as usize;
    // Every lane of a warp runs the same number of iterations (the slot is warp-uniform).
    while slot < slots {
        let token = slot / top_k as usize;
        // SAFETY: slot < T·k.
        let row = unsafe { *slot_row.add(slot) };
        let value = if row == NO_ROW { 0.0 } else { partial(slot, token, row, lane) };
        // SAFETY: all 32 lanes (blocks of whole warps: caller contract), in the same iteration
        // (the slot is warp-uniform); the `row` branch above rejoins.
        let total = unsafe { sync::warp_sum_f32(value) };
        if lane == 0 {
            // SAFETY: slot < T·k.
            unsafe { *out.add(slot) = total };
        }
        slot += warps;
    }
}

/// The backward's dy gather and slot-weight gradients in one pass, one warp per slot (the
/// engine path's; the `mma.sync` path keeps the two kernels, its oracle): for a routed slot
/// `t·k + j` in row r, `d_rows[r] = bf16(topk_weights[slot] · dy[t])` — the bits of
/// [`mok_gather_rows`] — and `out[slot] = ⟨dy[t], rows[r]⟩` — the bits of
/// [`mok_topk_weight_grad`] (the same lane partials in the same order, then the same butterfly);
/// a dropped slot's gradient is 0. Each slot's dy row is read once instead of twice.
///
/// # Safety
/// `dy` `[T][width]` bf16, `rows` `[R][width]` f32, `slot_row`, `topk_weights` and `out` `[T·k]`,
/// `d_rows` `[R][width]` bf16, each 16-byte aligned; `width % 8 == 0`; every routed slot's row
/// is below R and no two slots share a row (the routing layout's `slot_row`: each row is written
/// by one warp); blocks of whole warps (a multiple of 32 threads).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn mok_gather_dy_and_topk_weight_grad(
    dy: *const u16,
    rows: *const f32,
    slot_row: *const u32,
    topk_weights: *const f32,
    tokens: u32,
    top_k: u32,
    width: u32,
    d_rows: *mut u16,
    out: *mut f32,
) {
    let w = width as usize;
    let gather_and_dot = |slot: usize, token: usize, row: u32, lane: usize| {
        // SAFETY: slot < T·k, token < T, row < R and this slot's alone (caller contract); every
        // row 16-byte aligned (aligned bases, width % 8 == 0).
        unsafe {
            gather_scaled_row_and_dot(
                dy.add(token * w),
                rows.add(row as usize * w),
                d_rows.add(row as usize * w),
                *topk_weights.add(slot),
                width,
                lane as u32,
            )
        }
    };
    // SAFETY: caller contract (`slot_row`, `topk_weights` and `out` `[T·k]`, blocks of whole
    // warps).
    unsafe { for_each_slot_by_warp(slot_row, (tokens, top_k), out, gather_and_dot) }
}

/// SwiGLU backward over `[*row_count][width]`: from the f32 pre-activations and the f32 hidden
/// gradient, `d_gate` and `d_up` in bf16 (zero where the clamp was active).
///
/// # Safety
/// All tensors `[*row_count][width]`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_swiglu_backward(
    gate: *const f32,
    up: *const f32,
    d_hidden: *const f32,
    row_count: *const u32,
    width: u32,
    limit: f32,
    d_gate: *mut u16,
    d_up: *mut u16,
) {
    // SAFETY: written by the routing kernels (or the host, for the shared expert).
    let total = unsafe { *row_count } as usize * width as usize;
    let (mut e, stride) = grid_thread();
    while e < total {
        // SAFETY: e < rows · width.
        unsafe {
            let (dg, du) = math::swiglu_backward(*gate.add(e), *up.add(e), *d_hidden.add(e), limit);
            *d_gate.add(e) = f32_to_bf16(dg);
            *d_up.add(e) = f32_to_bf16(du);
        }
        e += stride;
    }
}
