//! Row arithmetic shared by the row kernels and the megakernel's comm side, so both give the
//! same bits.

use crate::device::math;
use crate::layout::NO_ROW;
use crate::megakernel_layout::SwigluBackwardRows;
use crate::num::{bf16x2_hi, bf16x2_lo};
use crate::ptx::convert::f32x2_to_bf16x2;
use crate::ptx::memory::{ld_global_v4, st_global_v4};
use crate::ptx::sync::shfl_idx_u32;

/// Slots whose rows are loaded together before any is added (the loads are independent; the
/// sums stay in slot order).
const SLOTS_IN_FLIGHT: usize = 4;

/// Columns `column + q·stride .. + 4` (for each `q < Q` whose columns are below `width`) of
/// token `token`'s combined row: `out[t] = bf16(base[t] + Σ_j w[t,j] · rows[slot_row[t,j]])` in
/// f32, the base (shared expert) first, then slots j = 0..k in order; dropped slots skipped; `w`
/// = 1 when `topk_weights` is null (the dx combine), and the base is 0 when `base` is null. The
/// rows of [`SLOTS_IN_FLIGHT`] slots and `Q` column groups are loaded before they are added, so
/// a thread keeps that many loads in flight; the additions, and so the bits, do not depend on
/// `Q`.
///
/// # Safety
/// `slot_row` `[T·k]`, `topk_weights` `[T·k]` or null, `rows` `[R][width]` f32 (every row a slot
/// of the token names is written and visible to this thread), `base` `[T][width]` f32 or null,
/// `out` `[T][width]` bf16; `token < T`, `column % 4 == 0`, `stride % 4 == 0`,
/// `column + 4 ≤ width`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn combine_quads<const Q: usize>(
    slot_row: *const u32,
    topk_weights: *const f32,
    rows: *const f32,
    base: *const f32,
    token: usize,
    columns: (usize, usize),
    top_k: u32,
    width: u32,
    out: *mut u16,
) {
    let slot = |j: usize| {
        let slot = token * top_k as usize + j;
        // SAFETY: slot < T·k (caller contract).
        let row = unsafe { *slot_row.add(slot) };
        if row == NO_ROW || topk_weights.is_null() {
            return (row, 1.0);
        }
        // SAFETY: as above.
        (row, unsafe { *topk_weights.add(slot) })
    };
    // SAFETY: caller contract.
    unsafe { combine_quads_of::<Q, SLOTS_IN_FLIGHT>(slot, rows, base, token, columns, top_k, width, out) };
}

/// [`combine_quads`] with each slot's row and weight from `slot(j)` (`NO_ROW` for a dropped
/// slot, whose weight is not used), `B` slots' rows loaded before any is added. The same
/// additions in the same order for every `B` and `Q`, so the same bits.
///
/// # Safety
/// As [`combine_quads`], with `slot(j)` for `j < k` the row of slot j of the token (or `NO_ROW`)
/// and its weight, except that columns at or past `width` are skipped (`column + 4 ≤ width` is
/// not required). `slot` is called in the same order, with the same `j`, on every thread that
/// calls this with the same `token` and `top_k`, whatever its columns: it may be a warp-wide
/// shuffle when the whole warp calls this together for one token.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn combine_quads_of<const Q: usize, const B: usize>(
    slot: impl Fn(usize) -> (u32, f32),
    rows: *const f32,
    base: *const f32,
    token: usize,
    (column, stride): (usize, usize),
    top_k: u32,
    width: u32,
    out: *mut u16,
) {
    let w = width as usize;
    let k = top_k as usize;
    let inside = |q: usize| column + q * stride + 4 <= w;
    let mut acc = [[0.0f32; 4]; Q];
    if !base.is_null() {
        for (q, a) in acc.iter_mut().enumerate() {
            if inside(q) {
                // SAFETY: token < T, the columns inside the row.
                let v = unsafe { ld_global_v4(base.add(token * w + column + q * stride) as *const u32) };
                *a = v.map(f32::from_bits);
            }
        }
    }
    let mut first = 0;
    while first < k {
        let mut weights = [0.0f32; B];
        let mut landed = [false; B];
        let mut values = [[[0u32; 4]; Q]; B];
        for b in 0..B {
            if first + b >= k {
                continue;
            }
            let (row, weight) = slot(first + b);
            if row == NO_ROW {
                continue;
            }
            landed[b] = true;
            weights[b] = weight;
            for (q, v) in values[b].iter_mut().enumerate() {
                if inside(q) {
                    // SAFETY: row < R; the columns inside the row.
                    *v = unsafe { ld_global_v4(rows.add(row as usize * w + column + q * stride) as *const u32) };
                }
            }
        }
        for b in 0..B {
            if landed[b] {
                for (a, v) in acc.iter_mut().zip(&values[b]) {
                    a[0] += weights[b] * f32::from_bits(v[0]);
                    a[1] += weights[b] * f32::from_bits(v[1]);
                    a[2] += weights[b] * f32::from_bits(v[2]);
                    a[3] += weights[b] * f32::from_bits(v[3]);
                }
            }
        }
        first += B;
    }
    for (q, a) in acc.iter().enumerate() {
        if inside(q) {
            // SAFETY: token < T, the columns inside the row; 8-byte aligned (column % 4 == 0).
            unsafe {
                let at = out.add(token * w + column + q * stride) as *mut u32;
                *at = f32x2_to_bf16x2(a[0], a[1]);
                *at.add(1) = f32x2_to_bf16x2(a[2], a[3]);
            }
        }
    }
}

/// A token's slots as a warp holds them for its combine: lane j holds slot j's row and weight
/// in `[0]` and slot 32 + j's in `[1]` (`NO_ROW` for a dropped slot or one past k; weight 1
/// without weights). Every lane reads any slot with a shuffle, so a combine's loads wait on no
/// memory read of their addresses, and each lane can work on its own slots side by side.
#[derive(Clone, Copy)]
pub struct WarpSlots {
    rows: [u32; 2],
    weights: [f32; 2],
}

// Two slots per lane of a warp.
const _: () = assert!(crate::megakernel_layout::MAX_COMBINE_SLOTS == 2 * 32);

impl WarpSlots {
    /// The slots of `token`, lane `lane`'s two.
    ///
    /// # Safety
    /// `slot_row` `[T·k]`, `topk_weights` `[T·k]` or null; `token < T`; `top_k ≤`
    /// [`MAX_COMBINE_SLOTS`](crate::megakernel_layout::MAX_COMBINE_SLOTS).
    #[inline(always)]
    pub unsafe fn load(slot_row: *const u32, topk_weights: *const f32, token: u32, top_k: u32, lane: u32) -> Self {
        let mut slots = WarpSlots { rows: [NO_ROW; 2], weights: [1.0; 2] };
        for half in 0..2 {
            let j = lane + 32 * half as u32;
            if j < top_k {
                let slot = token as usize * top_k as usize + j as usize;
                // SAFETY: slot < T·k (caller contract).
                let row = unsafe { *slot_row.add(slot) };
                slots.rows[half] = row;
                if row != NO_ROW && !topk_weights.is_null() {
                    // SAFETY: as above.
                    slots.weights[half] = unsafe { *topk_weights.add(slot) };
                }
            }
        }
        slots
    }

    /// The row of this lane's slot `lane + 32 · half` (`half` 0 or 1).
    #[inline(always)]
    pub fn own_row(&self, half: usize) -> u32 {
        self.rows[half]
    }

    /// Slot `j`'s row, for every lane.
    ///
    /// # Safety
    /// As [`Self::slot`].
    #[inline(always)]
    pub unsafe fn row(&self, j: u32) -> u32 {
        let row = if j < 32 { self.rows[0] } else { self.rows[1] };
        // SAFETY: caller contract.
        unsafe { shfl_idx_u32(row, j % 32) }
    }

    /// Slot `j`'s row and weight, for every lane.
    ///
    /// # Safety
    /// All 32 lanes call it with the same `j <`
    /// [`MAX_COMBINE_SLOTS`](crate::megakernel_layout::MAX_COMBINE_SLOTS), in warp-uniform
    /// control flow.
    #[inline(always)]
    pub unsafe fn slot(&self, j: u32) -> (u32, f32) {
        let weight = if j < 32 { self.weights[0] } else { self.weights[1] };
        // SAFETY: caller contract.
        unsafe { (self.row(j), f32::from_bits(shfl_idx_u32(weight.to_bits(), j % 32))) }
    }
    /// By a whole warp: `out[token] = bf16(base[token] + Σ_j weight_j · rows[row_j])` over
    /// these `top_k` slots, `width` columns — [`combine_quads_of`] two groups of 4 columns per
    /// lane per step, 4 slots' rows loaded together (8 loads in flight per lane), their rows and
    /// weights shuffled from the lanes holding them; the shared term first, slots in order, so
    /// the bits of `combine_quads`. Every lane takes every step (the shuffles need the whole
    /// warp); a lane's columns past the row are skipped inside. The sizes and pointers come by
    /// value: read from a parameter block in global memory inside the loop, every store to `out`
    /// would make the compiler load them again.
    ///
    /// # Safety
    /// As [`combine_quads_of`] for these slots (loaded for `token` and `top_k`); all 32 lanes
    /// call it with the same arguments, in warp-uniform control flow.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn combine_row(
        &self,
        (rows, base): (*const f32, *const f32),
        token: u32,
        top_k: u32,
        width: u32,
        out: *mut u16,
        lane: u32,
    ) {
        let mut first_column = 0;
        while first_column < width {
            let columns = ((first_column + 4 * lane) as usize, 4 * 32);
            // SAFETY: caller contract; `slot` shuffles with the same j on every lane.
            unsafe {
                combine_quads_of::<2, 4>(
                    |j| self.slot(j as u32),
                    rows,
                    base,
                    token as usize,
                    columns,
                    top_k,
                    width,
                    out,
                )
            };
            first_column += 2 * 4 * 32;
        }
    }
}

/// Vectors of 16 bytes a lane loads before it stores any (memory-level parallelism of a copy).
const VECTORS_IN_FLIGHT: usize = 8;

/// Copies one row of `vectors` 16-byte vectors from `src` to `dst`, by the 32 lanes of a warp
/// (lane `lane` takes vectors `lane, lane + 32, ...`), [`VECTORS_IN_FLIGHT`] loads in flight per
/// lane.
///
/// The lane counts the vectors left from its next one and steps its pointers: 32-bit counts
/// that cannot wrap, compared with constants, and no 64-bit index beside the pointers (the
/// megakernels' spare producer warps copy with 72 registers).
///
/// # Safety
/// `src` and `dst` are 16-byte aligned global rows of at least `vectors` · 16 bytes.
#[inline(always)]
pub unsafe fn copy_row(src: *const u32, dst: *mut u32, vectors: u32, lane: u32) {
    const STEP: u32 = 32 * VECTORS_IN_FLIGHT as u32;
    let mut first = lane;
    while first < vectors {
        // Vectors from the lane's next one to the row's end.
        let left = vectors - first;
        let mut buffer = [[0u32; 4]; VECTORS_IN_FLIGHT];
        for (u, b) in buffer.iter_mut().enumerate() {
            if 32 * (u as u32) < left {
                // SAFETY: the vector lies below `vectors` (caller contract).
                *b = unsafe { ld_global_v4(src.add(4 * (first as usize + 32 * u))) };
            }
        }
        for (u, b) in buffer.iter().enumerate() {
            if 32 * (u as u32) < left {
                // SAFETY: as above.
                unsafe { st_global_v4(dst.add(4 * (first as usize + 32 * u)), *b) };
            }
        }
        if left <= STEP {
            return;
        }
        first += STEP;
    }
}

/// 8 bf16 (4 words) scaled by `weight` in f32 and rounded back to bf16: the backward gather's
/// `bf16(w · dy)`.
#[inline(always)]
pub fn scale_bf16x8(weight: f32, mut vector: [u32; 4]) -> [u32; 4] {
    for pair in vector.iter_mut() {
        *pair = f32x2_to_bf16x2(weight * bf16x2_lo(*pair), weight * bf16x2_hi(*pair));
    }
    vector
}

/// `partial` plus the products of 8 bf16 columns (`g`, 4 words) with 8 f32 columns (`lo`,
/// `hi`), added one at a time in column order: one lane's step of the slot-weight gradient
/// `⟨dy[t], out[row]⟩`.
#[inline(always)]
pub fn dot8(mut partial: f32, g: [u32; 4], lo: [u32; 4], hi: [u32; 4]) -> f32 {
    // Columns in order: pair p of g holds columns 2p (low) and 2p + 1 (high).
    let f = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
    for p in 0..4 {
        partial += bf16x2_lo(g[p]) * f32::from_bits(f[2 * p]);
        partial += bf16x2_hi(g[p]) * f32::from_bits(f[2 * p + 1]);
    }
    partial
}

/// Row steps (8 columns per lane each) a lane of [`gather_scaled_row_and_dot`] loads before it
/// adds or stores any.
const STEPS_IN_FLIGHT: usize = 4;

/// The backward gather of one slot's row by a warp: `dst = bf16(weight · dy)` (the bits of
/// `mok_gather_rows`), and the lane's partial of `⟨dy, out⟩` over its columns `8·lane + 256·i`
/// in order (the bits of `mok_topk_weight_grad`'s lane partial; `sync::warp_sum_f32` of the
/// partials is the slot-weight gradient). [`STEPS_IN_FLIGHT`] steps' loads are issued before
/// they are used; the order of the additions does not depend on it.
///
/// # Safety
/// `dy` `[width]` bf16, `out` `[width]` f32, `dst` `[width]` bf16, all 16-byte aligned;
/// `width % 8 == 0`.
#[inline(always)]
pub unsafe fn gather_scaled_row_and_dot(
    dy: *const u16,
    out: *const f32,
    dst: *mut u16,
    weight: f32,
    width: u32,
    lane: u32,
) -> f32 {
    let w = width as usize;
    let mut partial = 0.0f32;
    let mut column = 8 * lane as usize;
    while column < w {
        let mut g = [[0u32; 4]; STEPS_IN_FLIGHT];
        let mut f = [[[0u32; 4]; 2]; STEPS_IN_FLIGHT];
        for s in 0..STEPS_IN_FLIGHT {
            let c = column + 256 * s;
            if c < w {
                // SAFETY: c + 8 ≤ width (caller contract: width % 8 == 0).
                unsafe {
                    g[s] = ld_global_v4(dy.add(c) as *const u32);
                    f[s] = [ld_global_v4(out.add(c) as *const u32), ld_global_v4(out.add(c + 4) as *const u32)];
                }
            }
        }
        for s in 0..STEPS_IN_FLIGHT {
            let c = column + 256 * s;
            if c < w {
                partial = dot8(partial, g[s], f[s][0], f[s][1]);
                // SAFETY: as above.
                unsafe { st_global_v4(dst.add(c) as *mut u32, scale_bf16x8(weight, g[s])) };
            }
        }
        column += 256 * STEPS_IN_FLIGHT;
    }
    partial
}

/// The backward gather of one slot's row by a warp without its dot product (across ranks the
/// token owner computes the slot-weight gradient): `dst = bf16(weight · dy)`, the bits of
/// `mok_gather_rows`, [`STEPS_IN_FLIGHT`] loads in flight per lane.
///
/// # Safety
/// `dy` and `dst` are `[width]` bf16, 16-byte aligned; `width % 8 == 0`.
#[inline(always)]
pub unsafe fn gather_scaled_row(dy: *const u16, dst: *mut u16, weight: f32, width: u32, lane: u32) {
    let w = width as usize;
    let mut column = 8 * lane as usize;
    while column < w {
        let mut g = [[0u32; 4]; STEPS_IN_FLIGHT];
        for (s, v) in g.iter_mut().enumerate() {
            let c = column + 256 * s;
            if c < w {
                // SAFETY: c + 8 ≤ width (caller contract).
                *v = unsafe { ld_global_v4(dy.add(c) as *const u32) };
            }
        }
        for (s, v) in g.iter().enumerate() {
            let c = column + 256 * s;
            if c < w {
                // SAFETY: as above.
                unsafe { st_global_v4(dst.add(c) as *mut u32, scale_bf16x8(weight, *v)) };
            }
        }
        column += 256 * STEPS_IN_FLIGHT;
    }
}

/// A lane's partial of `⟨dy, out⟩` over its columns `8·lane + 256·i` in order: the same
/// additions as [`gather_scaled_row_and_dot`]'s (so `sync::warp_sum_f32` of the partials is the
/// same slot-weight gradient), without the gather. As there, [`STEPS_IN_FLIGHT`] steps' loads
/// are issued before they are used (the warps that run it apart from the gather read 12 bytes
/// a column from HBM and have nothing else to hide the latency under).
///
/// # Safety
/// `dy` `[width]` bf16, `out` `[width]` f32, 16-byte aligned; `width % 8 == 0`.
#[inline(always)]
pub unsafe fn dot_row(dy: *const u16, out: *const f32, width: u32, lane: u32) -> f32 {
    let w = width as usize;
    let mut partial = 0.0f32;
    let mut column = 8 * lane as usize;
    while column < w {
        let mut g = [[0u32; 4]; STEPS_IN_FLIGHT];
        let mut f = [[[0u32; 4]; 2]; STEPS_IN_FLIGHT];
        for s in 0..STEPS_IN_FLIGHT {
            let c = column + 256 * s;
            if c < w {
                // SAFETY: c + 8 ≤ width (caller contract: width % 8 == 0).
                unsafe {
                    g[s] = ld_global_v4(dy.add(c) as *const u32);
                    f[s] = [ld_global_v4(out.add(c) as *const u32), ld_global_v4(out.add(c + 4) as *const u32)];
                }
            }
        }
        for s in 0..STEPS_IN_FLIGHT {
            if column + 256 * s < w {
                partial = dot8(partial, g[s], f[s][0], f[s][1]);
            }
        }
        column += 256 * STEPS_IN_FLIGHT;
    }
    partial
}

/// The SwiGLU backward of the flattened elements `begin..end` of one expert set's rows by one
/// warp (`rows`: `[..][width]` each, `begin` and `end` multiples of 8): `d_gate`, `d_up` =
/// `bf16(math::swiglu_backward(gate, up, d_hidden, limit))` element by element, the bits of
/// `mok_swiglu_backward`. Each lane takes 8 consecutive elements (two 16-byte loads from each
/// f32 input, one 16-byte store to each output), and `IN_FLIGHT` (1 or 2) such groups are
/// loaded before any is computed, so a lane keeps 6 · `IN_FLIGHT` loads in flight: 2 where the
/// registers allow, 1 for warps with few (24 registers a group).
///
/// # Safety
/// `rows` holds valid `[..][width]` tensors covering `end` elements, 32-byte aligned (f32) and
/// 16-byte aligned (bf16); their inputs are written and visible to every lane.
#[inline(always)]
pub unsafe fn swiglu_backward_octets<const IN_FLIGHT: usize>(
    rows: &SwigluBackwardRows,
    (begin, end): (usize, usize),
    lane: u32,
) {
    const { assert!(IN_FLIGHT == 1 || IN_FLIGHT == 2) };
    const STEP: usize = 8 * 32;
    let (gate, up, d_hidden) = (rows.gate as *const u32, rows.up as *const u32, rows.d_hidden as *const u32);
    let (d_gate, d_up) = (rows.d_gate as *mut u32, rows.d_up as *mut u32);
    // Read once, like the pointers: `rows` may lie in global memory, which the stores below could
    // alias as far as the compiler knows.
    let limit = rows.limit;
    // SAFETY: caller contract: every octet below `end` is inside the tensors, aligned.
    let load = |e: usize| unsafe {
        let octet = |p: *const u32| {
            let (lo, hi) = (ld_global_v4(p.add(e)), ld_global_v4(p.add(e + 4)));
            [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
        };
        (octet(gate), octet(up), octet(d_hidden))
    };
    let store = |e: usize, (g, u, dh): ([u32; 8], [u32; 8], [u32; 8])| {
        let (mut dg, mut du) = ([0u32; 4], [0u32; 4]);
        for pair in 0..4 {
            let grads = |i: usize| {
                math::swiglu_backward(f32::from_bits(g[i]), f32::from_bits(u[i]), f32::from_bits(dh[i]), limit)
            };
            let ((g0, u0), (g1, u1)) = (grads(2 * pair), grads(2 * pair + 1));
            dg[pair] = f32x2_to_bf16x2(g0, g1);
            du[pair] = f32x2_to_bf16x2(u0, u1);
        }
        // SAFETY: as the loads (bf16: 8 elements are 16 bytes, at element e / 2 words).
        unsafe {
            st_global_v4(d_gate.add(e / 2), dg);
            st_global_v4(d_up.add(e / 2), du);
        }
    };
    let mut e = begin + 8 * lane as usize;
    if IN_FLIGHT == 1 {
        while e < end {
            store(e, load(e));
            e += STEP;
        }
        return;
    }
    while e < end {
        let second = e + STEP < end;
        let first_octets = load(e);
        let second_octets = if second { load(e + STEP) } else { first_octets };
        store(e, first_octets);
        if second {
            store(e + STEP, second_octets);
        }
        e += 2 * STEP;
    }
}
