//! Row arithmetic shared by the row kernels and the megakernel's comm side, so both give the
//! same bits.

use crate::layout::NO_ROW;
use crate::ptx::convert::f32x2_to_bf16x2;
use crate::ptx::memory::ld_global_v4;

/// Columns `column .. column + 4` of token `token`'s combined row:
/// `out[t] = bf16(base[t] + Σ_j w[t,j] · rows[slot_row[t,j]])` in f32, the base (shared expert)
/// first, then slots j = 0..k in order; dropped slots skipped; `w` = 1 when `topk_weights` is
/// null (the dx combine), and the base is 0 when `base` is null.
///
/// # Safety
/// `slot_row` `[T·k]`, `topk_weights` `[T·k]` or null, `rows` `[R][width]` f32 (every row a slot
/// of the token names is written and visible to this thread), `base` `[T][width]` f32 or null,
/// `out` `[T][width]` bf16; `token < T`, `column % 4 == 0`, `column + 4 ≤ width`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn combine_quad(
    slot_row: *const u32,
    topk_weights: *const f32,
    rows: *const f32,
    base: *const f32,
    token: usize,
    column: usize,
    top_k: u32,
    width: u32,
    out: *mut u16,
) {
    let w = width as usize;
    let (mut a0, mut a1, mut a2, mut a3) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
    if !base.is_null() {
        // SAFETY: token < T, column + 4 ≤ width.
        let v = unsafe { ld_global_v4(base.add(token * w + column) as *const u32) };
        (a0, a1, a2, a3) = (f32::from_bits(v[0]), f32::from_bits(v[1]), f32::from_bits(v[2]), f32::from_bits(v[3]));
    }
    for j in 0..top_k as usize {
        let slot = token * top_k as usize + j;
        // SAFETY: slot < T·k.
        let row = unsafe { *slot_row.add(slot) };
        if row == NO_ROW {
            continue;
        }
        // SAFETY: slot < T·k; row < R.
        let weight = if topk_weights.is_null() { 1.0 } else { unsafe { *topk_weights.add(slot) } };
        let v = unsafe { ld_global_v4(rows.add(row as usize * w + column) as *const u32) };
        a0 += weight * f32::from_bits(v[0]);
        a1 += weight * f32::from_bits(v[1]);
        a2 += weight * f32::from_bits(v[2]);
        a3 += weight * f32::from_bits(v[3]);
    }
    // SAFETY: token < T, column + 4 ≤ width; 8-byte aligned (column % 4 == 0).
    unsafe {
        let at = out.add(token * w + column) as *mut u32;
        *at = f32x2_to_bf16x2(a0, a1);
        *at.add(1) = f32x2_to_bf16x2(a2, a3);
    }
}
