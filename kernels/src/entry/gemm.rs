//! Grouped GEMM entry points of the unfused path, one per product the layer needs.
//!
//! Row-grouped kernels put M tiles on grid x (an upper bound from the host; surplus blocks
//! exit after reading the device-written offsets) and N tiles on grid y. All use 128 threads
//! and `GEMM_SMEM_BYTES` of dynamic shared memory. Each output element is written by exactly
//! one thread, and each block reduces over K in a fixed order, so results do not depend on
//! the grid or on scheduling.

use crate::device::gemm::{
    self, Accumulators, KSegment, TileOperand, for_each_output_pair, grouped_row_tile, tile_columns,
};
use crate::device::math;
use crate::ptx::convert::f32x2_to_bf16x2;
use crate::ptx::sreg;
use crate::tiles::{GEMM_TILE_M, GEMM_TILE_N};

/// Forward gate/up projection with SwiGLU fused: for each group g's rows,
/// `gate = rows · w_gate[g]ᵀ`, `up = rows · w_up[g]ᵀ` (f32 accumulators), then
/// `hidden = bf16(silu(min(gate, L)) · clamp(up, -L, L))`. The raw pre-activations are kept in
/// f32 for the backward pass. `limit` is +inf for no clamp.
///
/// # Safety
/// `rows` is `[R][hidden]`, `w_gate`/`w_up` are `[G][inter][hidden]`, outputs `[R][inter]`,
/// offsets `[G+1]`; `hidden`, `inter` multiples of 8.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_gemm_gate_up_swiglu(
    rows: *const u16,
    row_offsets: *const u32,
    tile_offsets: *const u32,
    num_groups: u32,
    w_gate: *const u16,
    w_up: *const u16,
    hidden: u32,
    inter: u32,
    limit: f32,
    gate_out: *mut f32,
    up_out: *mut f32,
    hidden_out: *mut u16,
) {
    // SAFETY: offsets hold num_groups + 1 entries (caller contract).
    let Some(tile) = (unsafe { grouped_row_tile(row_offsets, tile_offsets, num_groups, sreg::block_idx_x()) }) else {
        return;
    };
    let n0 = sreg::block_idx_y() * GEMM_TILE_N;
    let (h, i) = (hidden as usize, inter as usize);
    let columns = tile_columns(n0, inter);
    let weight_offset = tile.group as usize * i * h + n0 as usize * h;
    let a = TileOperand {
        // SAFETY: first_row < R, inside `rows`.
        origin: unsafe { rows.add(tile.first_row as usize * h) },
        pitch: h,
        rows: tile.rows,
        k_contiguous: true,
    };
    let gate_b = TileOperand {
        // SAFETY: group < G and n0 < inter, inside `w_gate`.
        origin: unsafe { w_gate.add(weight_offset) },
        pitch: h,
        rows: columns,
        k_contiguous: true,
    };
    // SAFETY: as `gate_b`, inside `w_up`.
    let up_b = TileOperand { origin: unsafe { w_up.add(weight_offset) }, pitch: h, rows: columns, k_contiguous: true };
    // One accumulator set at a time keeps register pressure at the single-GEMM level: the
    // gate tile goes to `gate_out`, then the up tile is formed and the epilogue re-reads the
    // gate values this same thread just wrote (visible to it without a fence).
    let mut acc: Accumulators = [0.0; 32];
    // SAFETY: the whole block with `GEMM_SMEM_BYTES` of shared memory (launch contract); the
    // operands lie inside the tensors, origins and pitches multiples of 8 (hidden, inter).
    unsafe { gemm::accumulate(&mut acc, &KSegment { a, b: gate_b, depth: hidden }) };
    // SAFETY: the tile's rows and columns lie inside `gate_out` `[R][inter]`; `columns` is even.
    unsafe { store_f32_tile(&acc, gate_out, tile.first_row, tile.rows, n0, columns, inter) };
    acc = [0.0; 32];
    // SAFETY: as for the gate tile.
    unsafe { gemm::accumulate(&mut acc, &KSegment { a, b: up_b, depth: hidden }) };
    for_each_output_pair(|index, row, col| {
        if row >= tile.rows || col >= columns {
            return;
        }
        let out = (tile.first_row + row) as usize * i + (n0 + col) as usize;
        let (u0, u1) = (acc[index], acc[index + 1]);
        // SAFETY: (row, col) is in the tile's valid region, so inside `[R][inter]`; col is even
        // and inter a multiple of 8, so the bf16 pair store is 4-byte aligned.
        unsafe {
            let (g0, g1) = (*gate_out.add(out), *gate_out.add(out + 1));
            let (cg0, cu0) = math::clamp_gate_up(g0, u0, limit);
            let (cg1, cu1) = math::clamp_gate_up(g1, u1, limit);
            *up_out.add(out) = u0;
            *up_out.add(out + 1) = u1;
            *(hidden_out.add(out) as *mut u32) = f32x2_to_bf16x2(math::swiglu(cg0, cu0), math::swiglu(cg1, cu1));
        }
    });
}

/// Writes an f32 accumulator tile to `out[(first_row + row) * width + n0 + col]`.
///
/// # Safety
/// Elements `(first_row + row) * width + n0 + col` of `out` are writable for every `row < rows`
/// and `col < columns`; `columns` is even (a pair's second column is not checked).
#[inline(always)]
unsafe fn store_f32_tile(
    acc: &Accumulators,
    out: *mut f32,
    first_row: u32,
    rows: u32,
    n0: u32,
    columns: u32,
    width: u32,
) {
    for_each_output_pair(|index, row, col| {
        if row < rows && col < columns {
            let at = (first_row + row) as usize * width as usize + (n0 + col) as usize;
            // SAFETY: row < rows and col + 1 < columns (even): inside the output (caller contract).
            unsafe {
                *out.add(at) = acc[index];
                *out.add(at + 1) = acc[index + 1];
            }
        }
    });
}

/// Row-grouped `out[R][n] = rows[R][k] · b[g][n][k]ᵀ` (f32 out): the down projection
/// (`rows` = hidden activations, `b` = `w_down`).
///
/// # Safety
/// `rows` is `[R][k]`, `b` is `[G][n][k]`, `out` is `[R][n]`, offsets `[G+1]`; `n`, `k`
/// multiples of 8.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_gemm_rows_nt(
    rows: *const u16,
    row_offsets: *const u32,
    tile_offsets: *const u32,
    num_groups: u32,
    b: *const u16,
    n: u32,
    k: u32,
    out: *mut f32,
) {
    // SAFETY: offsets hold num_groups + 1 entries.
    let Some(tile) = (unsafe { grouped_row_tile(row_offsets, tile_offsets, num_groups, sreg::block_idx_x()) }) else {
        return;
    };
    let n0 = sreg::block_idx_y() * GEMM_TILE_N;
    let columns = tile_columns(n0, n);
    let (nn, kk) = (n as usize, k as usize);
    let a = TileOperand {
        // SAFETY: first_row < R, inside `rows`.
        origin: unsafe { rows.add(tile.first_row as usize * kk) },
        pitch: kk,
        rows: tile.rows,
        k_contiguous: true,
    };
    let b = TileOperand {
        // SAFETY: group < G and n0 < n, inside `b`.
        origin: unsafe { b.add(tile.group as usize * nn * kk + n0 as usize * kk) },
        pitch: kk,
        rows: columns,
        k_contiguous: true,
    };
    let mut acc: Accumulators = [0.0; 32];
    // SAFETY: the whole block with `GEMM_SMEM_BYTES` of shared memory (launch contract); the
    // operands lie inside the tensors, origins and pitches multiples of 8 (n, k).
    unsafe { gemm::accumulate(&mut acc, &KSegment { a, b, depth: k }) };
    // SAFETY: the tile's rows and columns lie inside `out` `[R][n]`; `columns` is even.
    unsafe { store_f32_tile(&acc, out, tile.first_row, tile.rows, n0, columns, n) };
}

/// Row-grouped data gradient, f32 out:
/// `out[R][n] = a1[R][k1] · b1[g][k1][n] (+ a2[R][k2] · b2[g][k2][n] when a2 is non-null)`.
/// The weights are read transposed (`[K][N]` storage). One call covers the down projection's
/// dgrad (one segment) and the gate/up dgrad (two segments summed in the same accumulators).
///
/// # Safety
/// `a1` `[R][k1]`, `b1` `[G][k1][n]`, likewise for segment 2 if present; `out` `[R][n]`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_gemm_rows_nn(
    a1: *const u16,
    b1: *const u16,
    k1: u32,
    a2: *const u16,
    b2: *const u16,
    k2: u32,
    row_offsets: *const u32,
    tile_offsets: *const u32,
    num_groups: u32,
    n: u32,
    out: *mut f32,
) {
    // SAFETY: offsets hold num_groups + 1 entries.
    let Some(tile) = (unsafe { grouped_row_tile(row_offsets, tile_offsets, num_groups, sreg::block_idx_x()) }) else {
        return;
    };
    let n0 = sreg::block_idx_y() * GEMM_TILE_N;
    let columns = tile_columns(n0, n);
    let mut acc: Accumulators = [0.0; 32];
    let segment = |a: *const u16, b: *const u16, k: u32| {
        let kk = k as usize;
        KSegment {
            a: TileOperand {
                // SAFETY: first_row < R, inside `a` `[R][k]`.
                origin: unsafe { a.add(tile.first_row as usize * kk) },
                pitch: kk,
                rows: tile.rows,
                k_contiguous: true,
            },
            b: TileOperand {
                // SAFETY: group < G and n0 < n, inside `b` `[G][k][n]`.
                origin: unsafe { b.add(tile.group as usize * kk * n as usize + n0 as usize) },
                pitch: n as usize,
                rows: columns,
                k_contiguous: false,
            },
            depth: k,
        }
    };
    // SAFETY: the whole block with `GEMM_SMEM_BYTES` of shared memory (launch contract); the
    // operands lie inside the tensors, origins and pitches multiples of 8 (the layer's widths).
    unsafe { gemm::accumulate(&mut acc, &segment(a1, b1, k1)) };
    if !a2.is_null() {
        // SAFETY: as for segment 1 (segment 2 is present).
        unsafe { gemm::accumulate(&mut acc, &segment(a2, b2, k2)) };
    }
    // SAFETY: the tile's rows and columns lie inside `out` `[R][n]`; `columns` is even.
    unsafe { store_f32_tile(&acc, out, tile.first_row, tile.rows, n0, columns, n) };
}

/// Weight gradient per group, reducing over the group's rows in order:
/// `dw[g][m][n] = Σ_{r in group g} a[r][m] · b[r][n]`. Grid x = `G · ceil(m/64) · ceil(n/64)`.
/// Writes bf16 into `out_bf16`, or, when that is null, adds into the caller's f32 `out_f32`.
/// A group with no rows gets exact zeros (or adds nothing).
///
/// # Safety
/// `a` `[R][m]`, `b` `[R][n]`, outputs `[G][m][n]`, offsets `[G+1]`; `m`, `n` multiples of 8.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_gemm_wgrad(
    a: *const u16,
    b: *const u16,
    row_offsets: *const u32,
    m: u32,
    n: u32,
    out_bf16: *mut u16,
    out_f32: *mut f32,
) {
    let (m_tiles, n_tiles) = (m.div_ceil(GEMM_TILE_M), n.div_ceil(GEMM_TILE_N));
    let flat = sreg::block_idx_x();
    let group = flat / (m_tiles * n_tiles);
    let m0 = (flat / n_tiles) % m_tiles * GEMM_TILE_M;
    let n0 = flat % n_tiles * GEMM_TILE_N;
    // SAFETY: group < G by the grid size.
    let (begin, end) = unsafe { (*row_offsets.add(group as usize), *row_offsets.add(group as usize + 1)) };
    let (mm, nn) = (m as usize, n as usize);
    let (m_rows, n_rows) = (tile_columns(m0, m), tile_columns(n0, n));
    // The origins: row `begin` and columns m0 / n0 are inside the tensors (when the group is
    // empty the segment has depth 0 and nothing is read).
    let segment = KSegment {
        a: TileOperand {
            // SAFETY: row `begin`, column m0 < m of `a` (see above).
            origin: unsafe { a.add(begin as usize * mm + m0 as usize) },
            pitch: mm,
            rows: m_rows,
            k_contiguous: false,
        },
        b: TileOperand {
            // SAFETY: row `begin`, column n0 < n of `b` (see above).
            origin: unsafe { b.add(begin as usize * nn + n0 as usize) },
            pitch: nn,
            rows: n_rows,
            k_contiguous: false,
        },
        depth: end - begin,
    };
    let mut acc: Accumulators = [0.0; 32];
    // SAFETY: the whole block with `GEMM_SMEM_BYTES` of shared memory (launch contract); the
    // group's rows of both operands lie inside them, origins and pitches multiples of 8 (m, n).
    unsafe { gemm::accumulate(&mut acc, &segment) };
    let group_base = group as usize * mm * nn;
    for_each_output_pair(|index, row, col| {
        if row >= m_rows || col >= n_rows {
            return;
        }
        let at = group_base + (m0 + row) as usize * nn + (n0 + col) as usize;
        // SAFETY: inside `[G][m][n]`; the pair is 4-byte aligned (col even, n % 8 == 0).
        unsafe {
            if !out_bf16.is_null() {
                *(out_bf16.add(at) as *mut u32) = f32x2_to_bf16x2(acc[index], acc[index + 1]);
            } else {
                *out_f32.add(at) += acc[index];
                *out_f32.add(at + 1) += acc[index + 1];
            }
        }
    });
}
