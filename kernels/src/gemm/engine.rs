//! A persistent, warp-specialised grouped GEMM for Hopper (sm_90a).
//!
//! Block = 384 threads: warpgroup 0 is the producer (its first warp fills a ring of
//! [`STAGES`] shared-memory stages with TMA tensor copies), warpgroups 1 and 2 are consumers
//! (each owns 64 rows of the 128 × 128 block tile and issues `wgmma.m64n128k16`). Stages are
//! handed over through two mbarriers each: `full` (the producer's copies have landed) and
//! `empty` (every consumer warp has finished reading). While the consumers run a tile's
//! epilogue, the producer is already loading the next tile's stages.
//!
//! Blocks walk the flat tile list `blockIdx.x, blockIdx.x + gridDim.x, ...`; the list comes from
//! device-written group offsets, so the host never learns the group sizes. Tiles that would
//! read past the end of their group (a ragged last M tile, or the last K block of a weight
//! gradient) are loaded by the producer warp with ordinary loads and zero fill instead of TMA:
//! rows of a neighbouring group are never read. Each output element is produced by one thread
//! of one tile with a K loop in fixed order: results do not depend on the grid size.
//!
//! Variants ([`Variant`]):
//! - `GATE_UP`: `rows[R][H] · [w_gate; w_up][g]ᵀ` with SwiGLU in registers → hidden bf16 (and
//!   optionally the f32 pre-activations). B tile = 64 gate rows + 64 up rows of the same columns.
//! - `ROWS_NT`: `rows[R][K] · w[g][N][K]ᵀ` → f32 rows (down projection).
//! - `ROWS_NN`: `a[R][K] · w[g][K][N]` (+ a second segment) → f32 rows (data gradients).
//! - `WGRAD`: `Σ_{r in g} a[r][M]ᵀ b[r][N]` → `[G][M][N]` bf16, or added into f32.

use crate::device::math;
use crate::gemm_layout::{
    GemmParams, OPERAND_TILE_BYTES, SHORT_BOX_ROWS, STAGE_BYTES, STAGES, TILE_K, TILE_M, TILE_N, smem_descriptor,
    split_row_tile, swizzled_chunk_offset,
};
use crate::ptx::convert::f32x2_to_bf16x2;
use crate::ptx::memory::{fence_proxy_async_shared_cta, ld_global_v4, st_shared_v4};
use crate::ptx::{mbarrier, smem, sreg, sync, tma, wgmma};

/// Which product an engine instance computes.
pub struct Variant;

impl Variant {
    /// Forward gate/up with SwiGLU.
    pub const GATE_UP: u32 = 0;
    /// Row-grouped `A · Bᵀ` (K-major weights), f32 out.
    pub const ROWS_NT: u32 = 1;
    /// Row-grouped `A · B` (N-major weights, up to two K segments), f32 out.
    pub const ROWS_NN: u32 = 2;
    /// Per-group weight gradient, rows reduced in order.
    pub const WGRAD: u32 = 3;
}

/// Half of a 128-wide operand tile: 64 rows of 128 bytes.
const HALF_TILE_BYTES: u32 = OPERAND_TILE_BYTES / 2;

/// Shared-memory addresses of the ring.
#[derive(Clone, Copy)]
struct Ring {
    base: u32,
    bars: u32,
}

impl Ring {
    fn new() -> Self {
        // The window is 1024-aligned by its declaration; round up anyway so a change there
        // cannot silently break the swizzle (the host adds 1 KiB of slack).
        let base = (smem::dynamic_smem_base() + 1023) & !1023;
        Ring { base, bars: base + STAGES * STAGE_BYTES }
    }
    fn a_tile(self, stage: u32) -> u32 {
        self.base + stage * STAGE_BYTES
    }
    fn b_tile(self, stage: u32) -> u32 {
        self.a_tile(stage) + OPERAND_TILE_BYTES
    }
    fn full(self, stage: u32) -> u32 {
        self.bars + stage * 8
    }
    fn empty(self, stage: u32) -> u32 {
        self.bars + (STAGES + stage) * 8
    }
}

/// One block tile of work.
#[derive(Clone, Copy)]
struct Work {
    group: u32,
    /// Row-grouped: first row of the tile; weight gradient: first output row (M).
    m0: u32,
    /// Row-grouped: valid rows (≤ 128). Weight gradient: output rows M (for bounds).
    rows: u32,
    /// First output column.
    n0: u32,
    /// Weight gradient: the group's rows `[row_begin, row_end)` (the K range).
    row_begin: u32,
    row_end: u32,
    /// K blocks of segment 1, and of segments 1 + 2.
    k_blocks_1: u32,
    k_blocks: u32,
}

#[inline(always)]
fn n_tiles<const V: u32>(p: &GemmParams) -> u32 {
    // The SwiGLU tile produces 64 hidden columns (64 gate + 64 up accumulators).
    if V == Variant::GATE_UP { p.n.div_ceil(TILE_N / 2) } else { p.n.div_ceil(TILE_N) }
}

/// Number of tiles of the launch (from device-written offsets for row-grouped variants).
#[inline(always)]
unsafe fn tile_count<const V: u32>(p: &GemmParams) -> u32 {
    if V == Variant::WGRAD {
        p.groups * p.m.div_ceil(TILE_M) * p.n.div_ceil(TILE_N)
    } else {
        // SAFETY: tile_offsets holds groups + 1 entries (host contract).
        unsafe { *(p.tile_offsets as *const u32).add(p.groups as usize) * n_tiles::<V>(p) }
    }
}

#[inline(always)]
unsafe fn work_of<const V: u32>(p: &GemmParams, tile: u32) -> Work {
    let offsets = p.row_offsets as *const u32;
    if V == Variant::WGRAD {
        let (m_tiles, nt) = (p.m.div_ceil(TILE_M), p.n.div_ceil(TILE_N));
        let group = tile / (m_tiles * nt);
        let within = tile % (m_tiles * nt);
        // SAFETY: group < groups.
        let (row_begin, row_end) = unsafe { (*offsets.add(group as usize), *offsets.add(group as usize + 1)) };
        let k_blocks = (row_end - row_begin).div_ceil(TILE_K);
        return Work {
            group,
            m0: within / nt * TILE_M,
            rows: p.m,
            n0: within % nt * TILE_N,
            row_begin,
            row_end,
            k_blocks_1: k_blocks,
            k_blocks,
        };
    }
    let nt = n_tiles::<V>(p);
    let (m_tile, n_tile) = split_row_tile(tile, nt);
    // SAFETY: tile_offsets holds groups + 1 entries.
    let tiles = unsafe { core::slice::from_raw_parts(p.tile_offsets as *const u32, p.groups as usize + 1) };
    let group = crate::tiles::group_of_tile(tiles, m_tile).unwrap_or(0) as u32;
    // SAFETY: group < groups.
    let (begin, end) = unsafe { (*offsets.add(group as usize), *offsets.add(group as usize + 1)) };
    let m0 = begin + (m_tile - tiles[group as usize]) * TILE_M;
    let n_width = if V == Variant::GATE_UP { TILE_N / 2 } else { TILE_N };
    let k_blocks_1 = p.k.div_ceil(TILE_K);
    Work {
        group,
        m0,
        rows: (end - m0).min(TILE_M),
        n0: n_tile * n_width,
        row_begin: begin,
        row_end: end,
        k_blocks_1,
        k_blocks: k_blocks_1 + p.k2.div_ceil(TILE_K),
    }
}

/// Copies tile rows `[first, end)` (fewer than 8) × 64 K values of a K-major operand into a
/// swizzled tile with ordinary loads (zero past `k_len`); `src` points at row `first`.
/// Producer-warp collective.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn load_tail_rows_k_major(
    tile: u32,
    src: *const u16,
    pitch: u32,
    first: u32,
    end: u32,
    k0: u32,
    k_len: u32,
    lane: u32,
) {
    let mut q = lane;
    while q < (end - first) * 8 {
        let (r, c) = (q / 8, q % 8);
        let k = k0 + c * 8;
        let mut v = [0u32; 4];
        if k < k_len {
            // SAFETY: row first + r < end belongs to the group, k + 8 ≤ K (K % 8 == 0); aligned.
            v = unsafe { ld_global_v4(src.add(r as usize * pitch as usize + k as usize) as *const u32) };
        }
        // SAFETY: inside the stage's operand tile (row < 128).
        unsafe { st_shared_v4(tile + swizzled_chunk_offset(first + r, c), v) };
        q += 32;
    }
}

/// Completes a K block of an operand reduced over rows (weight gradient) from row `first` on:
/// rows `[first, k_rows)` are copied with ordinary loads (`src` points at row 0 of the block),
/// rows `[k_rows, 64)` are zeroed — they must add nothing to the sum, and stale shared memory
/// could hold NaN. 128 M/N values from column `c0` (two 64-wide halves), zero past `width`.
/// Producer-warp collective.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn finish_rows_mn_major(
    tile: u32,
    src: *const u16,
    pitch: u32,
    first: u32,
    k_rows: u32,
    c0: u32,
    width: u32,
    lane: u32,
) {
    let per_half = (TILE_K - first) * 8;
    let mut q = lane;
    while q < 2 * per_half {
        let (half, within) = (q / per_half, q % per_half);
        let (r, c) = (first + within / 8, within % 8);
        let col = c0 + half * 64 + c * 8;
        let mut v = [0u32; 4];
        if r < k_rows && col < width {
            // SAFETY: row r of the group, col + 8 ≤ width (width % 8 == 0); 16-byte aligned.
            v = unsafe { ld_global_v4(src.add(r as usize * pitch as usize + col as usize) as *const u32) };
        }
        // SAFETY: inside the stage's operand tile.
        unsafe { st_shared_v4(tile + half * HALF_TILE_BYTES + swizzled_chunk_offset(r, c), v) };
        q += 32;
    }
}

/// The producer warp: fills stages in the same tile and K-block order the consumers use.
#[inline(always)]
unsafe fn produce<const V: u32>(p: &GemmParams, ring: Ring, lane: u32) {
    // SAFETY: the offsets in `p` hold groups + 1 entries (host contract of `run`).
    let total = unsafe { tile_count::<V>(p) };
    let (mut stage, mut phase) = (0u32, 0u32);
    let mut tile = sreg::block_idx_x();
    while tile < total {
        // SAFETY: tile < total.
        let w = unsafe { work_of::<V>(p, tile) };
        for kb in 0..w.k_blocks {
            // Wait until both consumers released this stage (a fresh barrier passes parity 1).
            // SAFETY: initialised barrier of this block.
            unsafe { mbarrier::wait_parity(ring.empty(stage), phase ^ 1) };
            let (a_tile, b_tile, full) = (ring.a_tile(stage), ring.b_tile(stage), ring.full(stage));
            let tma_bytes: u32;
            if V == Variant::WGRAD {
                let row = w.row_begin + kb * TILE_K;
                let k_rows = (w.row_end - row).min(TILE_K);
                if k_rows == TILE_K {
                    tma_bytes = STAGE_BYTES;
                    if lane == 0 {
                        // SAFETY: maps and tiles valid; the barrier expects the bytes below.
                        unsafe {
                            mbarrier::expect_tx(full, tma_bytes);
                            tma::load_2d(a_tile, p.map_a, w.m0 as i32, row as i32, full);
                            tma::load_2d(a_tile + HALF_TILE_BYTES, p.map_a, (w.m0 + 64) as i32, row as i32, full);
                            tma::load_2d(b_tile, p.map_b, w.n0 as i32, row as i32, full);
                            tma::load_2d(b_tile + HALF_TILE_BYTES, p.map_b, (w.n0 + 64) as i32, row as i32, full);
                        }
                    }
                } else {
                    // The group's last rows: TMA boxes of 64/32/16/8 K rows for the rows rounded
                    // down to 8 (1024-byte aligned in each half), ordinary loads for the rest and
                    // zeros after — never the next group's rows.
                    let boxed = k_rows & !7;
                    tma_bytes = boxed * 128 * 4;
                    if lane == 0 && boxed > 0 {
                        // SAFETY: maps and tiles valid; the barrier expects `tma_bytes`.
                        unsafe {
                            mbarrier::expect_tx(full, tma_bytes);
                            let (a_short, b_short) = (&p.map_a_short, &p.map_a2_short);
                            let mut at = 0u32;
                            let mut short_boxes = |index: usize| {
                                let height = SHORT_BOX_ROWS[index];
                                if boxed & height != 0 {
                                    let r = (row + at) as i32;
                                    for half in 0..2u32 {
                                        let offset = half * HALF_TILE_BYTES + at * 128;
                                        tma::load_2d(
                                            a_tile + offset,
                                            a_short[index],
                                            (w.m0 + half * 64) as i32,
                                            r,
                                            full,
                                        );
                                        tma::load_2d(
                                            b_tile + offset,
                                            b_short[index],
                                            (w.n0 + half * 64) as i32,
                                            r,
                                            full,
                                        );
                                    }
                                    at += height;
                                }
                            };
                            short_boxes(0);
                            short_boxes(1);
                            short_boxes(2);
                            short_boxes(3);
                        }
                    }
                    // SAFETY: rows [row, row + k_rows) belong to the group.
                    unsafe {
                        let a = (p.a_rows as *const u16).add(row as usize * p.a_pitch as usize);
                        let b = (p.b_rows as *const u16).add(row as usize * p.b_pitch as usize);
                        finish_rows_mn_major(a_tile, a, p.a_pitch, boxed, k_rows, w.m0, p.m, lane);
                        finish_rows_mn_major(b_tile, b, p.b_pitch, boxed, k_rows, w.n0, p.n, lane);
                    }
                }
            } else {
                let second = kb >= w.k_blocks_1;
                let k0 = if second { (kb - w.k_blocks_1) * TILE_K } else { kb * TILE_K };
                let (map_a, map_b) = if second { (p.map_a2, p.map_b2) } else { (p.map_a, p.map_b) };
                let ragged = w.rows < TILE_M;
                // A ragged tile: TMA boxes of 64/32/16/8 rows for its rows rounded down to 8
                // (each lands on a 1024-byte boundary, so the swizzle pattern holds), ordinary
                // loads for the last < 8 rows.
                let boxed_rows = if ragged { w.rows & !7 } else { TILE_M };
                let b_bytes = OPERAND_TILE_BYTES;
                tma_bytes = boxed_rows * 128 + b_bytes;
                if lane == 0 {
                    // SAFETY: maps and tiles valid; the barrier expects `tma_bytes`.
                    unsafe {
                        mbarrier::expect_tx(full, tma_bytes);
                        if !ragged {
                            tma::load_2d(a_tile, map_a, k0 as i32, w.m0 as i32, full);
                        } else {
                            let short = if second { &p.map_a2_short } else { &p.map_a_short };
                            let mut at = 0u32;
                            // Spelled out with constant indices: a loop would put the maps
                            // in local memory.
                            let mut short_box = |map: u64, height: u32| {
                                if boxed_rows & height != 0 {
                                    tma::load_2d(a_tile + at * 128, map, k0 as i32, (w.m0 + at) as i32, full);
                                    at += height;
                                }
                            };
                            short_box(short[0], SHORT_BOX_ROWS[0]);
                            short_box(short[1], SHORT_BOX_ROWS[1]);
                            short_box(short[2], SHORT_BOX_ROWS[2]);
                            short_box(short[3], SHORT_BOX_ROWS[3]);
                        }
                        let g = w.group as i32;
                        match V {
                            Variant::GATE_UP => {
                                tma::load_3d(b_tile, p.map_b, k0 as i32, w.n0 as i32, g, full);
                                tma::load_3d(b_tile + HALF_TILE_BYTES, p.map_b2, k0 as i32, w.n0 as i32, g, full);
                            }
                            Variant::ROWS_NT => tma::load_3d(b_tile, map_b, k0 as i32, w.n0 as i32, g, full),
                            _ => {
                                tma::load_3d(b_tile, map_b, w.n0 as i32, k0 as i32, g, full);
                                tma::load_3d(b_tile + HALF_TILE_BYTES, map_b, (w.n0 + 64) as i32, k0 as i32, g, full);
                            }
                        }
                    }
                }
                if boxed_rows < w.rows {
                    let (rows_ptr, k_len) = if second { (p.a2_rows, p.k2) } else { (p.a_rows, p.k) };
                    // SAFETY: rows [boxed_rows, rows) of the tile belong to its group.
                    unsafe {
                        let src = (rows_ptr as *const u16).add((w.m0 + boxed_rows) as usize * p.a_pitch as usize);
                        load_tail_rows_k_major(a_tile, src, p.a_pitch, boxed_rows, w.rows, k0, k_len, lane);
                    }
                }
            }
            if tma_bytes < STAGE_BYTES {
                // Ordinary stores feed the tensor cores (async proxy): fence before arriving.
                fence_proxy_async_shared_cta();
            }
            // Every lane arrives after its own stores (32 arrivals per phase); the copy engine's
            // bytes were announced with expect_tx before the copies were issued.
            // SAFETY: initialised barrier.
            unsafe { mbarrier::arrive(full) };
            stage += 1;
            if stage == STAGES {
                stage = 0;
                phase ^= 1;
            }
        }
        tile += sreg::grid_dim_x();
    }
}

/// Descriptors of the four 16-deep K slices of a stage for consumer warpgroup `wg`.
#[inline(always)]
fn stage_descriptors<const V: u32>(ring: Ring, stage: u32, wg: u32) -> ([u64; 4], [u64; 4]) {
    let (a_tile, b_tile) = (ring.a_tile(stage), ring.b_tile(stage));
    let mut a = [0u64; 4];
    let mut b = [0u64; 4];
    for (k, (da, db)) in a.iter_mut().zip(b.iter_mut()).enumerate() {
        let k = k as u32;
        *da = if V == Variant::WGRAD {
            // M-major: this warpgroup's 64 M values are one 64-wide half; 16 K rows per slice.
            smem_descriptor(a_tile + wg * HALF_TILE_BYTES + k * 16 * 128, HALF_TILE_BYTES, 1024)
        } else {
            // K-major: this warpgroup's 64 rows; a K slice is 32 bytes into each 128-byte row.
            smem_descriptor(a_tile + wg * HALF_TILE_BYTES + k * 32, 16, 1024)
        };
        *db = if V == Variant::GATE_UP || V == Variant::ROWS_NT {
            smem_descriptor(b_tile + k * 32, 16, 1024)
        } else {
            // N-major: two 64-wide N halves, 16 K rows per slice.
            smem_descriptor(b_tile + k * 16 * 128, HALF_TILE_BYTES, 1024)
        };
    }
    (a, b)
}

/// Expands `$body` once per n8 block `$j` = 0..16 with `$j` a constant, so the accumulator
/// indices are compile-time constants and the array stays in registers (a rolled loop would put
/// it in local memory).
macro_rules! for_each_n8_block {
    ($j:ident => $body:block) => {
        for_each_n8_block!(@expand $j $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    };
    (@expand $j:ident $body:block; $($value:literal)*) => {
        $({
            const $j: u32 = $value;
            $body
        })*
    };
}

/// Calls `visit(index, row, col)` for each pair of adjacent accumulators of this thread:
/// `acc[index]`, `acc[index + 1]` are at warpgroup-tile row `row` < 64, columns `col`, `col + 1`.
#[inline(always)]
fn for_each_pair(thread_in_wg: u32, mut visit: impl FnMut(usize, u32, u32)) {
    let (warp, lane) = (thread_in_wg / 32, thread_in_wg % 32);
    for_each_n8_block!(J => {
        let col = 8 * J + 2 * (lane % 4);
        visit((4 * J) as usize, warp * 16 + lane / 4, col);
        visit((4 * J + 2) as usize, warp * 16 + lane / 4 + 8, col);
    });
}

#[inline(always)]
unsafe fn epilogue<const V: u32>(p: &GemmParams, w: &Work, acc: &[f32; 64], wg: u32, thread_in_wg: u32) {
    let wg_row0 = wg * 64;
    match V {
        Variant::GATE_UP => {
            let inter = p.n as usize;
            for_each_pair(thread_in_wg, |index, row, col| {
                // Accumulator columns 0..64 are gate, 64..128 up, for hidden columns n0 + col.
                let (r, c) = (wg_row0 + row, col);
                if c >= 64 || r >= w.rows || w.n0 + c >= p.n {
                    return;
                }
                let (g0, g1, u0, u1) = (acc[index], acc[index + 1], acc[index + 32], acc[index + 33]);
                let (cg0, cu0) = math::clamp_gate_up(g0, u0, p.swiglu_limit);
                let (cg1, cu1) = math::clamp_gate_up(g1, u1, p.swiglu_limit);
                let at = (w.m0 + r) as usize * inter + (w.n0 + c) as usize;
                // SAFETY: row and column inside the group's rows and [0, I); pairs 4-byte aligned.
                unsafe {
                    *((p.out0 as *mut u16).add(at) as *mut u32) =
                        f32x2_to_bf16x2(math::swiglu(cg0, cu0), math::swiglu(cg1, cu1));
                    if p.out1 != 0 {
                        *(p.out1 as *mut f32).add(at) = g0;
                        *(p.out1 as *mut f32).add(at + 1) = g1;
                        *(p.out2 as *mut f32).add(at) = u0;
                        *(p.out2 as *mut f32).add(at + 1) = u1;
                    }
                }
            });
        }
        Variant::ROWS_NT | Variant::ROWS_NN => {
            let n = p.n as usize;
            for_each_pair(thread_in_wg, |index, row, col| {
                let r = wg_row0 + row;
                if r >= w.rows || w.n0 + col >= p.n {
                    return;
                }
                let at = (w.m0 + r) as usize * n + (w.n0 + col) as usize;
                // SAFETY: inside the output rows; pair 8-byte aligned (col even, N % 8 == 0).
                unsafe {
                    *(p.out0 as *mut f32).add(at) = acc[index];
                    *(p.out0 as *mut f32).add(at + 1) = acc[index + 1];
                }
            });
        }
        _ => {
            let (m, n) = (p.m as usize, p.n as usize);
            let base = w.group as usize * m * n;
            for_each_pair(thread_in_wg, |index, row, col| {
                let (r, c) = (w.m0 + wg_row0 + row, w.n0 + col);
                if r >= p.m || c >= p.n {
                    return;
                }
                let at = base + r as usize * n + c as usize;
                // SAFETY: inside [G][M][N]; one writer per element.
                unsafe {
                    if p.out1 == 0 {
                        *((p.out0 as *mut u16).add(at) as *mut u32) = f32x2_to_bf16x2(acc[index], acc[index + 1]);
                    } else {
                        *(p.out1 as *mut f32).add(at) += acc[index];
                        *(p.out1 as *mut f32).add(at + 1) += acc[index + 1];
                    }
                }
            });
        }
    }
}

/// Hands a stage back to the producer: one arrival per consumer warp (8 per phase), after this
/// warp's MMAs reading it have completed.
#[inline(always)]
fn release(ring: Ring, stage: u32, thread_in_wg: u32) {
    if thread_in_wg % 32 == 0 {
        // SAFETY: initialised barrier of this block.
        unsafe { mbarrier::arrive(ring.empty(stage)) };
    }
}

/// A consumer warpgroup: MMAs over the stages, then the epilogue, tile after tile.
#[inline(always)]
unsafe fn consume<const V: u32>(p: &GemmParams, ring: Ring, wg: u32, thread_in_wg: u32) {
    // SAFETY: the offsets in `p` hold groups + 1 entries (host contract of `run`).
    let total = unsafe { tile_count::<V>(p) };
    let (mut stage, mut phase) = (0u32, 0u32);
    let mut tile = sreg::block_idx_x();
    while tile < total {
        // SAFETY: tile < total.
        let w = unsafe { work_of::<V>(p, tile) };
        let mut acc = [0.0f32; 64];
        // One K block stays in flight on the tensor cores while the next stage is awaited: a
        // stage is released once the wait for the *next* block's issue says it is done.
        let mut in_flight: Option<u32> = None;
        for kb in 0..w.k_blocks {
            // SAFETY: initialised barrier of this block.
            unsafe { mbarrier::wait_parity(ring.full(stage), phase) };
            let (a, b) = stage_descriptors::<V>(ring, stage, wg);
            let accumulate = kb > 0;
            // SAFETY: the stage is full; warpgroup-collective in uniform flow; `acc` is not read
            // before the wait below.
            unsafe {
                match V {
                    Variant::GATE_UP | Variant::ROWS_NT => wgmma::issue_k64_m64n128_kk(&mut acc, a, b, accumulate),
                    Variant::ROWS_NN => wgmma::issue_k64_m64n128_kn(&mut acc, a, b, accumulate),
                    _ => wgmma::issue_k64_m64n128_mn(&mut acc, a, b, accumulate),
                }
            }
            wgmma::wait_keep_one(&mut acc);
            if let Some(done) = in_flight {
                release(ring, done, thread_in_wg);
            }
            in_flight = Some(stage);
            stage += 1;
            if stage == STAGES {
                stage = 0;
                phase ^= 1;
            }
        }
        wgmma::wait_all(&mut acc);
        if let Some(done) = in_flight {
            release(ring, done, thread_in_wg);
        }
        // SAFETY: outputs sized by the host contract.
        unsafe { epilogue::<V>(p, &w, &acc, wg, thread_in_wg) };
        tile += sreg::grid_dim_x();
    }
}

/// The engine body shared by every entry point: [`ENGINE_THREADS`](crate::gemm_layout::ENGINE_THREADS)
/// threads, [`ENGINE_SMEM_BYTES`](crate::gemm_layout::ENGINE_SMEM_BYTES) of dynamic shared memory.
///
/// # Safety
/// `params` points at a valid [`GemmParams`] whose tensors match the variant's contract.
#[inline(always)]
pub unsafe fn run<const V: u32>(params: *const GemmParams) {
    // SAFETY: caller contract; the parameter block is read-only for the whole launch.
    let p = unsafe { *params };
    let ring = Ring::new();
    let thread = sreg::thread_idx_x();
    if thread == 0 {
        for s in 0..STAGES {
            // SAFETY: this block's barrier slots, initialised once before any use.
            unsafe {
                mbarrier::init(ring.full(s), 32);
                mbarrier::init(ring.empty(s), 8);
            }
        }
        mbarrier::fence_mbarrier_init();
    }
    sync::block_barrier();
    let warpgroup = thread / 128;
    if warpgroup == 0 {
        if thread < 32 {
            // SAFETY: the producer warp, in uniform flow within the warp.
            unsafe { produce::<V>(&p, ring, thread) };
        }
    } else {
        // SAFETY: a whole consumer warpgroup.
        unsafe { consume::<V>(&p, ring, warpgroup - 1, thread % 128) };
    }
}
