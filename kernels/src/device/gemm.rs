//! The tile engine of the unfused path: one block computes a 64×64 f32 tile of `A · Bᵀ` with
//! `mma.sync.m16n8k16` (bf16 in, f32 accumulate).
//!
//! Deliberately simple and correct — it is the GPU oracle for shapes too large for the CPU and
//! the "separate kernels" baseline. Four warps split the tile 2×2 (32×32 each); K advances in
//! steps of 32 through one shared-memory stage per operand, with the next step's global loads
//! issued into registers before the current step's MMAs (a two-deep software pipeline).
//!
//! Operands are addressed as `A(m, k)` and `B(n, k)`; each is stored either K-contiguous
//! (`[rows][K]`, as activations and `nn.Linear` weights are) or K-outer (`[K][rows]`, as a
//! weight read transposed in dgrad, or activations reduced over rows in wgrad). Both land in
//! shared memory K-contiguous, so the fragment loads are one code path.
//!
//! Every `pub fn` here is block-collective: all 128 threads call it in uniform control flow.

use crate::ptx::memory::{ld_global_v4, ld_shared_u32, st_shared_u16, st_shared_v4};
use crate::ptx::mma::mma_m16n8k16_bf16_f32;
use crate::ptx::{smem, sreg, sync};
use crate::tiles::{GEMM_SMEM_BYTES, GEMM_SMEM_PITCH, GEMM_TILE_K, GEMM_TILE_M, GEMM_TILE_N};

const SMEM_PITCH: u32 = GEMM_SMEM_PITCH;
/// Bytes of one operand's stage.
const OPERAND_STAGE_BYTES: u32 = GEMM_SMEM_BYTES / 2;
/// 16-byte vectors per operand stage, and per thread (128 threads).
const VECTORS_PER_THREAD: u32 = GEMM_TILE_M * GEMM_TILE_K / 8 / 128;

/// One operand of a tile: where element (row 0, k 0) of the tile lives and how to step.
#[derive(Clone, Copy)]
pub struct TileOperand {
    /// Address of element (row 0, k 0) of this tile.
    pub origin: *const u16,
    /// Elements between consecutive rows (K-contiguous) or consecutive k (K-outer).
    pub pitch: usize,
    /// Rows of the tile that exist (the rest read as zero), ≤ 64.
    pub rows: u32,
    /// `true`: `[rows][K]`; `false`: `[K][rows]`.
    pub k_contiguous: bool,
}

/// A segment of the K loop: `A(m, k)·B(n, k)` for k in `0..depth`.
#[derive(Clone, Copy)]
pub struct KSegment {
    /// A side (the tile's M rows).
    pub a: TileOperand,
    /// B side (the tile's N rows).
    pub b: TileOperand,
    /// K extent (a multiple of 8 when the operand is K-contiguous; any value otherwise).
    pub depth: u32,
}

/// The 32 f32 accumulators a thread owns: `[m16 block (2)][n8 block (4)][4]`, laid out as the
/// `mma` C fragment (see [`crate::ptx::mma`]).
pub type Accumulators = [f32; 32];

/// Loads the 16-byte vectors this thread stages for one operand at k offset `k0`.
///
/// # Safety
/// `op`'s `rows` × `depth` elements at `origin` and `pitch` are readable global memory; `origin`
/// is 16-byte aligned and `pitch` a multiple of 8; `depth` is a multiple of 8 for a K-contiguous
/// operand, `rows` for a K-outer one (each vector lies inside the operand).
#[inline(always)]
unsafe fn load_stage(op: &TileOperand, k0: u32, depth: u32, thread: u32) -> [[u32; 4]; VECTORS_PER_THREAD as usize] {
    let mut staged = [[0u32; 4]; VECTORS_PER_THREAD as usize];
    for (p, slot) in staged.iter_mut().enumerate() {
        let v = thread + 128 * p as u32;
        let (row, k) = if op.k_contiguous { (v / 4, (v % 4) * 8) } else { ((v % 8) * 8, v / 8) };
        // K-contiguous vectors hold 8 k of one row (depth is a multiple of 8); K-outer vectors
        // hold 8 rows of one k (`rows` is then a multiple of 8: an output width).
        if row < op.rows && k0 + k < depth {
            let offset = if op.k_contiguous {
                row as usize * op.pitch + (k0 + k) as usize
            } else {
                (k0 + k) as usize * op.pitch + row as usize
            };
            // SAFETY: (row, k) is inside the operand (checked above), and so is its vector; it is
            // 16-byte aligned (caller contract: `origin` aligned, `pitch` a multiple of 8).
            *slot = unsafe { ld_global_v4(op.origin.add(offset) as *const u32) };
        }
    }
    staged
}

/// Stores staged vectors into the operand's shared stage as `[row][k]` bf16.
///
/// # Safety
/// `thread` < 128; `stage` is a 16-byte aligned shared address of this block with
/// `OPERAND_STAGE_BYTES` bytes that nothing else uses meanwhile (the block's other threads may
/// store their own vectors of it).
#[inline(always)]
unsafe fn store_stage(op: &TileOperand, stage: u32, staged: &[[u32; 4]; VECTORS_PER_THREAD as usize], thread: u32) {
    for (p, vector) in staged.iter().enumerate() {
        let v = thread + 128 * p as u32;
        if op.k_contiguous {
            let (row, k) = (v / 4, (v % 4) * 8);
            // SAFETY: row < 64, k < 32: inside the stage (caller contract); 16-byte aligned (pitch
            // 80 bytes).
            unsafe { st_shared_v4(stage + (row * SMEM_PITCH + k) * 2, *vector) };
        } else {
            let (row, k) = ((v % 8) * 8, v / 8);
            for i in 0..8u32 {
                let half = (vector[(i / 2) as usize] >> ((i % 2) * 16)) as u16;
                // SAFETY: row + i < 64, k < 32: inside the stage (caller contract).
                unsafe { st_shared_u16(stage + ((row + i) * SMEM_PITCH + k) * 2, half) };
            }
        }
    }
}

/// `acc += Σ_k A(m, k) B(n, k)` over one K segment. Block-collective.
///
/// # Safety
/// All 128 threads of the block call it in uniform control flow, and the block has
/// `GEMM_SMEM_BYTES` of dynamic shared memory that nothing else uses meanwhile. Each operand's
/// `rows` (≤ 64) × `depth` elements at `origin` and `pitch` are readable global memory; `origin`
/// is 16-byte aligned and `pitch` a multiple of 8; `depth` is a multiple of 8 for a K-contiguous
/// operand, `rows` for a K-outer one.
#[inline(always)]
pub unsafe fn accumulate(acc: &mut Accumulators, segment: &KSegment) {
    let thread = sreg::thread_idx_x();
    let lane = thread % 32;
    let warp = thread / 32;
    let (group, quad) = (lane / 4, lane % 4);
    let (warp_m, warp_n) = (warp / 2, warp % 2);
    let a_stage = smem::dynamic_smem_base();
    let b_stage = a_stage + OPERAND_STAGE_BYTES;
    let k_steps = segment.depth.div_ceil(GEMM_TILE_K);
    if k_steps == 0 {
        return;
    }

    // SAFETY: the operand is readable as `load_stage` asks (caller contract).
    let mut a_regs = unsafe { load_stage(&segment.a, 0, segment.depth, thread) };
    // SAFETY: as above.
    let mut b_regs = unsafe { load_stage(&segment.b, 0, segment.depth, thread) };
    // SAFETY: `thread` < 128 (a block of 128); the stages are the block's `GEMM_SMEM_BYTES` of
    // dynamic shared memory, which nothing else uses (caller contract).
    unsafe {
        store_stage(&segment.a, a_stage, &a_regs, thread);
        store_stage(&segment.b, b_stage, &b_regs, thread);
    }
    // SAFETY: all 128 threads, in uniform control flow (caller contract).
    unsafe { sync::block_barrier() };

    for step in 0..k_steps {
        let has_next = step + 1 < k_steps;
        if has_next {
            let k0 = (step + 1) * GEMM_TILE_K;
            // SAFETY: as above.
            a_regs = unsafe { load_stage(&segment.a, k0, segment.depth, thread) };
            // SAFETY: as above.
            b_regs = unsafe { load_stage(&segment.b, k0, segment.depth, thread) };
        }
        for kk in 0..(GEMM_TILE_K / 16) {
            let col = kk * 16 + quad * 2;
            let mut a_frag = [[0u32; 4]; 2];
            for (mi, frag) in a_frag.iter_mut().enumerate() {
                let row = warp_m * 32 + mi as u32 * 16 + group;
                let at = |r: u32, c: u32| a_stage + (r * SMEM_PITCH + c) * 2;
                // SAFETY: rows < 64 and columns < 32 of this block's A stage.
                *frag = unsafe {
                    [
                        ld_shared_u32(at(row, col)),
                        ld_shared_u32(at(row + 8, col)),
                        ld_shared_u32(at(row, col + 8)),
                        ld_shared_u32(at(row + 8, col + 8)),
                    ]
                };
            }
            for ni in 0..4u32 {
                let row = warp_n * 32 + ni * 8 + group;
                let at = |c: u32| b_stage + (row * SMEM_PITCH + c) * 2;
                // SAFETY: rows < 64 and columns < 32 of this block's B stage.
                let b_frag = unsafe { [ld_shared_u32(at(col)), ld_shared_u32(at(col + 8))] };
                for mi in 0..2usize {
                    let base = (mi * 4 + ni as usize) * 4;
                    let mut c = [acc[base], acc[base + 1], acc[base + 2], acc[base + 3]];
                    mma_m16n8k16_bf16_f32(&mut c, a_frag[mi], b_frag);
                    acc[base..base + 4].copy_from_slice(&c);
                }
            }
        }
        // SAFETY: as above; every thread takes the same number of steps.
        unsafe { sync::block_barrier() };
        if has_next {
            // SAFETY: as above; the barrier just passed ended every read of the stages.
            unsafe {
                store_stage(&segment.a, a_stage, &a_regs, thread);
                store_stage(&segment.b, b_stage, &b_regs, thread);
            }
            // SAFETY: as above.
            unsafe { sync::block_barrier() };
        }
    }
}

/// Calls `visit(index, row, col)` for every pair of horizontally adjacent outputs this thread
/// owns, in a fixed order: the pair is accumulators `index` and `index + 1`, at tile row
/// `row` < 64 and columns `col`, `col + 1` (col even). The mapping is the same for every
/// [`Accumulators`] of the block, so one visit can combine several (gate and up).
#[inline(always)]
pub fn for_each_output_pair(mut visit: impl FnMut(usize, u32, u32)) {
    let thread = sreg::thread_idx_x();
    let lane = thread % 32;
    let warp = thread / 32;
    let (group, quad) = (lane / 4, lane % 4);
    let (warp_m, warp_n) = (warp / 2, warp % 2);
    for mi in 0..2u32 {
        for ni in 0..4u32 {
            let base = ((mi * 4 + ni) * 4) as usize;
            let col = warp_n * 32 + ni * 8 + quad * 2;
            for half in 0..2u32 {
                let row = warp_m * 32 + mi * 16 + group + half * 8;
                visit(base + 2 * half as usize, row, col);
            }
        }
    }
}

/// Where one M tile of a grouped GEMM lies: its group, its first row and its valid rows.
#[derive(Clone, Copy)]
pub struct GroupedRowTile {
    /// Group (expert) index.
    pub group: u32,
    /// First row of the tile in the row-ordered buffers.
    pub first_row: u32,
    /// Rows that belong to the group (≤ 64).
    pub rows: u32,
}

/// Maps flat M-tile `tile` to its group through the device-written offsets, or `None` when the
/// tile is past the last group's last tile (the grid is sized by an upper bound).
///
/// # Safety
/// `row_offsets` and `tile_offsets` must hold `num_groups + 1` entries.
#[inline(always)]
pub unsafe fn grouped_row_tile(
    row_offsets: *const u32,
    tile_offsets: *const u32,
    num_groups: u32,
    tile: u32,
) -> Option<GroupedRowTile> {
    // SAFETY: caller contract.
    let tiles = unsafe { core::slice::from_raw_parts(tile_offsets, num_groups as usize + 1) };
    let group = crate::tiles::group_of_tile(tiles, tile)? as u32;
    // SAFETY: group < num_groups.
    let (group_begin, group_end) = unsafe { (*row_offsets.add(group as usize), *row_offsets.add(group as usize + 1)) };
    let first_row = group_begin + (tile - tiles[group as usize]) * GEMM_TILE_M;
    Some(GroupedRowTile { group, first_row, rows: (group_end - first_row).min(GEMM_TILE_M) })
}

/// Columns of an N tile that exist, for an output of width `n`.
#[inline(always)]
pub fn tile_columns(n0: u32, n: u32) -> u32 {
    (n - n0).min(GEMM_TILE_N)
}
