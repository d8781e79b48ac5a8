//! A persistent, warp-specialised grouped GEMM for Hopper (sm_90a).
//!
//! Block = 384 threads: warpgroup 0 is the producer (its first thread fills a ring of
//! [`STAGES`] shared-memory stages with TMA tensor copies), warpgroups 1 and 2 are consumers
//! (each owns 64 rows of the 128 × 128 block tile and issues `wgmma.m64n128k16`). Stages are
//! handed over through two mbarriers each: `full` (the producer's copies have landed) and
//! `empty` (every consumer warp has finished reading). While the consumers run a tile's
//! epilogue, the producer is already loading the next tile's stages.
//!
//! Blocks walk the flat tile list `blockIdx.x, blockIdx.x + gridDim.x, ...`; the list comes from
//! device-written group offsets, so the host never learns the group sizes. Every stage is whole
//! TMA copies: a tile that would read past the end of its group (a ragged last M tile, or the
//! last K block of a weight gradient) is loaded through a tensor map cut at that group's last
//! row ([`group_maps`](super::group_maps), rewritten on the device before each launch), so the
//! copy engine fills those rows with zeros and rows of a neighbouring group are never read.
//! Each output element is produced by one thread of one tile with a K loop in fixed order:
//! results do not depend on the grid size.
//!
//! Variants ([`Variant`]):
//! - `GATE_UP`: `rows[R][H] · [w_gate; w_up][g]ᵀ` with SwiGLU in registers → hidden bf16 (and
//!   optionally the f32 pre-activations). B tile = 64 gate rows + 64 up rows of the same columns.
//! - `ROWS_NT`: `rows[R][K] · w[g][N][K]ᵀ` → f32 rows (down projection).
//! - `ROWS_NN`: `a[R][K] · w[g][K][N]` (+ a second segment) → f32 rows (data gradients).
//! - `WGRAD`: `Σ_{r in g} a[r][M]ᵀ b[r][N]` → `[G][M][N]` bf16, or added into f32.

use crate::device::math;
use crate::gemm_layout::{
    GemmParams, OPERAND_TILE_BYTES, STAGE_BYTES, STAGES, TILE_K, TILE_M, TILE_N, smem_descriptor, split_row_tile,
};
use crate::ptx::convert::f32x2_to_bf16x2;
use crate::ptx::{mbarrier, smem, sreg, sync, tensormap, tma, wgmma};

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

/// The producer warp's first lane: fills stages in the same tile and K-block order the
/// consumers use. Every stage is whole TMA copies (`STAGE_BYTES` each, rows past a group's end
/// arrive as zeros through the group's own map).
#[inline(always)]
unsafe fn produce<const V: u32>(p: &GemmParams, ring: Ring) {
    // SAFETY: the offsets in `p` hold groups + 1 entries (host contract of `run`).
    let total = unsafe { tile_count::<V>(p) };
    let (mut stage, mut phase) = (0u32, 0u32);
    let mut tile = sreg::block_idx_x();
    while tile < total {
        // SAFETY: tile < total.
        let w = unsafe { work_of::<V>(p, tile) };
        let g = w.group as i32;
        // Maps cut at this group's end: for a ragged row tile (A, and the second A), for the
        // last K block of a weight gradient (A and B). They were written by the group-map kernel
        // through the tensor-map proxy; acquire them before the first copy.
        let cut = if V == Variant::WGRAD { !(w.row_end - w.row_begin).is_multiple_of(TILE_K) } else { w.rows < TILE_M };
        let (cut_0, cut_1) = (p.group_map(w.group, 0), p.group_map(w.group, 1));
        if cut {
            // SAFETY: group < groups; the group-map kernel ran before this launch (host contract).
            unsafe {
                tensormap::acquire(cut_0);
                if p.cut_maps[1] != 0 {
                    tensormap::acquire(cut_1);
                }
            }
        }
        for kb in 0..w.k_blocks {
            // Wait until both consumers released this stage (a fresh barrier passes parity 1).
            // SAFETY: initialised barrier of this block.
            unsafe { mbarrier::wait_parity(ring.empty(stage), phase ^ 1) };
            let (a_tile, b_tile, full) = (ring.a_tile(stage), ring.b_tile(stage), ring.full(stage));
            // SAFETY: maps and tiles valid; the barrier expects the whole stage.
            unsafe {
                mbarrier::arrive_expect_tx(full, STAGE_BYTES);
                if V == Variant::WGRAD {
                    // K runs over the group's rows; the last block may end inside the group.
                    let row = w.row_begin + kb * TILE_K;
                    let tail = row + TILE_K > w.row_end;
                    let (map_a, map_b, r) =
                        if tail { (cut_0, cut_1, row - w.row_begin) } else { (p.map_a, p.map_b, row) };
                    let r = r as i32;
                    tma::load_2d(a_tile, map_a, w.m0 as i32, r, full);
                    tma::load_2d(a_tile + HALF_TILE_BYTES, map_a, (w.m0 + 64) as i32, r, full);
                    tma::load_2d(b_tile, map_b, w.n0 as i32, r, full);
                    tma::load_2d(b_tile + HALF_TILE_BYTES, map_b, (w.n0 + 64) as i32, r, full);
                } else {
                    let second = kb >= w.k_blocks_1;
                    let k0 = (if second { (kb - w.k_blocks_1) * TILE_K } else { kb * TILE_K }) as i32;
                    let map_b = if second { p.map_b2 } else { p.map_b };
                    let (map_a, row) = match (w.rows < TILE_M, second) {
                        (false, false) => (p.map_a, w.m0),
                        (false, true) => (p.map_a2, w.m0),
                        (true, false) => (cut_0, w.m0 - w.row_begin),
                        (true, true) => (cut_1, w.m0 - w.row_begin),
                    };
                    tma::load_2d(a_tile, map_a, k0, row as i32, full);
                    match V {
                        Variant::GATE_UP => {
                            tma::load_3d(b_tile, p.map_b, k0, w.n0 as i32, g, full);
                            tma::load_3d(b_tile + HALF_TILE_BYTES, p.map_b2, k0, w.n0 as i32, g, full);
                        }
                        Variant::ROWS_NT => tma::load_3d(b_tile, map_b, k0, w.n0 as i32, g, full),
                        _ => {
                            tma::load_3d(b_tile, map_b, w.n0 as i32, k0, g, full);
                            tma::load_3d(b_tile + HALF_TILE_BYTES, map_b, (w.n0 + 64) as i32, k0, g, full);
                        }
                    }
                }
            }
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
                mbarrier::init(ring.full(s), 1);
                mbarrier::init(ring.empty(s), 8);
            }
        }
        mbarrier::fence_mbarrier_init();
    }
    sync::block_barrier();
    let warpgroup = thread / 128;
    if warpgroup == 0 {
        if thread == 0 {
            // SAFETY: one producer thread.
            unsafe { produce::<V>(&p, ring) };
        }
    } else {
        // SAFETY: a whole consumer warpgroup.
        unsafe { consume::<V>(&p, ring, warpgroup - 1, thread % 128) };
    }
}
