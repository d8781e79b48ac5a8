//! A persistent, warp-specialised grouped GEMM for Hopper (sm_90a).
//!
//! Block = 384 threads: warpgroup 0 is the producer (its first thread fills a ring of
//! [`STAGES`] shared-memory stages with TMA tensor copies), warpgroups 1 and 2 are consumers
//! (each owns 64 rows of the 128 × 256 block tile and issues `wgmma.m64n256k16`; `setmaxnreg`
//! moves registers from the producer to them). Stages are handed over through two mbarriers
//! each: `full` (the producer's copies have landed) and `empty` (every consumer warp has finished
//! reading). While the consumers run a tile's epilogue, the producer is already loading the next
//! tile's stages; the epilogue itself leaves through shared memory and TMA stores that drain
//! while the next tile's MMAs run.
//!
//! The flat tile list comes from device-written group offsets, so the host never learns the
//! group sizes. Row-grouped variants run in 2-block clusters (pairs, see [`pair_tile`]): the
//! first block's producer takes the next entry of the list from a device counter and hands it
//! to its partner's producer through a mailbox barrier; weight gradients run alone and walk
//! `blockIdx.x, blockIdx.x + gridDim.x, ...`. Each producer names the tile to its consumers in
//! a shared slot of the tile's first stage, published by that stage's `full` arrival; a tile without K blocks (an empty group's weight gradient) gets a stage without
//! copies, and [`NO_TILE`] ends the walk. A group's M tiles are walked in bands, M fastest
//! ([`banded_row_tile`]), so blocks that take neighbouring tiles at the same moment read the same
//! weight tile and all but the first find it in L2; a band is cut into blocks of a few N tiles,
//! which bounds the panels a large group keeps in L2 at once. Every stage of a tile
//! with K blocks is whole TMA copies: a tile that would read past the end of its group (a ragged last M tile, or the
//! last K block of a weight gradient) is loaded through a tensor map cut at that group's last
//! row ([`group_maps`](super::group_maps), rewritten on the device before each launch), so the
//! copy engine fills those rows with zeros and rows of a neighbouring group are never read (the
//! output rows are stored through a cut map the same way, so they are never written).
//! Each output element is produced by one thread of one tile with a K loop in fixed order:
//! results do not depend on the grid size.
//!
//! Variants ([`Variant`]):
//! - `GATE_UP`: `rows[R][H] · [w_gate; w_up][g]ᵀ` with SwiGLU in registers → hidden bf16 (and
//!   optionally the f32 pre-activations). B tile = 128 gate rows + 128 up rows of the same columns.
//! - `ROWS_NT`: `rows[R][K] · w[g][N][K]ᵀ` → f32 rows (down projection); `ROWS_NT_BF16` the same
//!   → bf16 rows (a plain grouped GEMM with the output type of `torch._grouped_mm`).
//! - `ROWS_NN`: `a[R][K] · w[g][K][N]` (+ a second segment) → f32 rows (data gradients).
//! - `WGRAD`: `Σ_{r in g} a[r][M]ᵀ b[r][N]` → `[G][M][N]` bf16, or added into f32.

use crate::device::math;
use crate::gemm_layout::{
    A_TILE_BYTES, B_TILE_BYTES, BLOCK_64_BYTES, CONSUMER_REGISTERS, ENGINE_THREADS, GemmParams, NO_TILE,
    PAIRED_CONSUMER_REGISTERS, PAIRED_PRODUCER_REGISTERS, PRODUCER_REGISTERS, PairTile, STAGE_BYTES, STAGES,
    STAGING_BOXES, STAGING_BYTES_PER_WARPGROUP, TILE_K, TILE_M, TILE_N, cluster_blocks, pair_entries_list_before,
    pair_tile, smem_descriptor, swizzled_chunk_offset,
};
use crate::ptx::convert::f32x2_to_bf16x2;
use crate::ptx::memory::{
    atom_add_relaxed_gpu_u32, fence_proxy_async_shared_cta, ld_shared_u32, st_shared_u32, st_shared_v2,
};
use crate::ptx::{bulk, cluster, mbarrier, smem, sreg, sync, tensormap, tma, wgmma};

pub use crate::gemm_layout::Variant;

/// The gate (first) or up (second) half of a SwiGLU B tile: 128 rows of 128 bytes.
const B_HALF_BYTES: u32 = B_TILE_BYTES / 2;

/// Shared-memory addresses of the ring, the output staging and the barriers.
#[derive(Clone, Copy)]
struct Ring {
    base: u32,
    staging: u32,
    bars: u32,
}

impl Ring {
    fn new() -> Self {
        // The window is 1024-aligned by its declaration; round up anyway so a change there
        // cannot silently break the swizzle (the host adds 1 KiB of slack).
        let base = (smem::dynamic_smem_base() + 1023) & !1023;
        let staging = base + STAGES * STAGE_BYTES;
        Ring { base, staging, bars: staging + 2 * STAGING_BYTES_PER_WARPGROUP }
    }
    fn a_tile(self, stage: u32) -> u32 {
        self.base + stage * STAGE_BYTES
    }
    fn b_tile(self, stage: u32) -> u32 {
        self.a_tile(stage) + A_TILE_BYTES
    }
    fn full(self, stage: u32) -> u32 {
        self.bars + stage * 8
    }
    fn empty(self, stage: u32) -> u32 {
        self.bars + (STAGES + stage) * 8
    }
    /// The tile whose first K block a stage holds (or [`NO_TILE`]), written by the producer (the
    /// partner's, through [`cluster::st_async_u32`], in a pair's second block) before the
    /// stage's `full` arrival, which publishes it to the consumers.
    fn tile_slot(self, stage: u32) -> u32 {
        self.bars + (2 * STAGES + stage) * 8
    }
    /// The second block of a pair learns the tile of a stage's slot through this barrier: the
    /// first block's producer writes the slot remotely ([`cluster::st_async_u32`]), which
    /// completes its 4 bytes here.
    fn mail(self, stage: u32) -> u32 {
        self.bars + (3 * STAGES + stage) * 8
    }
    /// Consumer warpgroup `wg`'s output staging (1024-byte aligned).
    fn staging(self, wg: u32) -> u32 {
        self.staging + wg * STAGING_BYTES_PER_WARPGROUP
    }
    /// The next (stage, phase) of the ring walk.
    fn advance(self, stage: &mut u32, phase: &mut u32) {
        *stage += 1;
        if *stage == STAGES {
            *stage = 0;
            *phase ^= 1;
        }
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
    /// False for the second block of an N-pair whose N tile is past the last (odd tile count).
    has_columns: bool,
    /// An M-pair's tile: the two blocks take 128 rows each of one 256-row entry and split the
    /// loading of the weight tile they share; otherwise (an N-pair) they share the rows.
    shares_weights: bool,
    /// The group's rows `[row_begin, row_end)` (the weight gradient's K range).
    row_begin: u32,
    row_end: u32,
    /// K blocks of segment 1, and of segments 1 + 2.
    k_blocks_1: u32,
    k_blocks: u32,
}

#[inline(always)]
fn n_tiles<const V: u32>(p: &GemmParams) -> u32 {
    // The SwiGLU tile produces 128 hidden columns (128 gate + 128 up accumulator columns).
    if V == Variant::GATE_UP { p.n.div_ceil(TILE_N / 2) } else { p.n.div_ceil(TILE_N) }
}

/// Number of tiles of the launch (from device-written offsets for row-grouped variants).
#[inline(always)]
unsafe fn tile_count<const V: u32>(p: &GemmParams) -> u32 {
    if V == Variant::WGRAD {
        p.groups * p.m.div_ceil(TILE_M) * p.n.div_ceil(TILE_N)
    } else {
        // The whole list: the entries before a group past the last (see [`pair_tile`]).
        // SAFETY: the list functions read i < 2 · (groups + 1) (caller contract of tile_count).
        let offset = |i| unsafe { tile_offset(p, i) };
        pair_entries_list_before(p.groups, p.groups, n_tiles::<V>(p), p.m_pairs != 0, &offset)
    }
}

/// Row-grouped variants: `tile_offsets[i]` (the list functions of `gemm_layout` read only
/// `i < 2 · (groups + 1)`).
///
/// # Safety
/// `i < 2 · (groups + 1)`, the length of the tile offsets (the host checks it: `RowGroups::check`).
#[inline(always)]
unsafe fn tile_offset(p: &GemmParams, i: u32) -> u32 {
    // SAFETY: caller contract.
    unsafe { *(p.tile_offsets as *const u32).add(i as usize) }
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
            has_columns: true,
            shares_weights: false,
            row_begin,
            row_end,
            k_blocks_1: k_blocks,
            k_blocks,
        };
    }
    let nt = n_tiles::<V>(p);
    // SAFETY: pair_tile reads tile offsets i < 2 · (groups + 1) and row offsets of groups below
    // `groups` (host contract: the buffers' lengths).
    let offset = |i| unsafe { tile_offset(p, i) };
    // SAFETY: as above.
    let row_offset = |g: u32| unsafe { *offsets.add(g as usize) };
    let PairTile { group, m0, n_tile, shares_weights } =
        pair_tile(tile, pair_rank::<V>(), p.groups, nt, p.m_pairs != 0, &offset, &row_offset);
    // SAFETY: group < groups.
    let (begin, end) = unsafe { (*offsets.add(group as usize), *offsets.add(group as usize + 1)) };
    let n_width = if V == Variant::GATE_UP { TILE_N / 2 } else { TILE_N };
    let k_blocks_1 = p.k.div_ceil(TILE_K);
    Work {
        group,
        m0,
        rows: (end - m0).min(TILE_M),
        n0: n_tile * n_width,
        has_columns: n_tile < nt,
        shares_weights,
        row_begin: begin,
        row_end: end,
        k_blocks_1,
        k_blocks: k_blocks_1 + p.k2.div_ceil(TILE_K),
    }
}

/// The producer warp's first lane: takes tiles (from the counter, or by stride for weight
/// gradients), names each in its first stage's slot and fills its stages in K-block order. A
/// stage with copies is whole TMA copies (rows past a group's end arrive as zeros through the
/// group's own map); a tile without K blocks, and the final [`NO_TILE`], get one stage completed
/// by a plain arrival.
///
/// In a pair (row-grouped variants), the first block's producer takes each tile from the counter
/// and names it in both blocks' slots; the second block's producer reads it from its slot when
/// the stage's mailbox completes. Then, per stage, an M-pair's producers each load their own
/// rows and half of the shared weight tile into both blocks, and an N-pair's each load one
/// 64-row half of the shared rows into both blocks and their own weight tile: a stage is `full`
/// in a block when everything meant for it has landed there, and `empty` when both blocks'
/// consumers have released it (16 arrivals), because the partner's producer writes into it too.
#[inline(always)]
unsafe fn produce<const V: u32>(p: &GemmParams, ring: Ring) {
    // SAFETY: the offsets in `p` hold groups + 1 (rows) and 2 · (groups + 1) (tiles) entries
    // (host contract of `run`).
    let total = unsafe { tile_count::<V>(p) };
    let counter = p.tile_counter as *mut u32;
    let rank = pair_rank::<V>();
    let (mut stage, mut phase) = (0u32, 0u32);
    // Bit s: the parity of stage s's mailbox (a pair's second block).
    let mut mail_phases = 0u32;
    let mut taken = 0u32;
    loop {
        // Row-grouped tiles are long (a whole K loop over the hidden or intermediate width):
        // handing them out in list order keeps neighbours in time (see `tile_counter`). A weight
        // gradient's tiles are a few K blocks (a group's rows) and neighbours already share
        // nothing but A columns; there the fixed stride avoids an atomic round trip per tile.
        let tile = if V == Variant::WGRAD {
            sreg::block_idx_x() + taken * sreg::grid_dim_x()
        } else if rank == 0 {
            // SAFETY: the plan's counter, zeroed before the launch (host contract).
            unsafe { atom_add_relaxed_gpu_u32(counter, 1) }
        } else {
            // SAFETY: initialised barrier of this block; the partner names every tile.
            unsafe { receive_tile(ring, stage, &mut mail_phases) }
        };
        taken += 1;
        if tile >= total {
            // Tell the consumers (and the partner) through the next stage.
            name_in_copyless_stage::<V>(ring, stage, phase, NO_TILE);
            return;
        }
        // SAFETY: tile < total.
        let w = unsafe { work_of::<V>(p, tile) };
        let g = w.group as i32;
        if w.k_blocks == 0 {
            // A weight gradient of an empty group: no copies, but the consumers still learn the
            // tile (they store its zeros).
            name_in_copyless_stage::<V>(ring, stage, phase, tile);
            ring.advance(&mut stage, &mut phase);
            continue;
        }
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
        // Row-grouped, what lands in each block per stage: the A halves (64 rows) with rows (a
        // half wholly past the group's end is not loaded: no warpgroup reads it) and the weight
        // tile. An M-pair's blocks each load their own rows and one half of the shared weight
        // tile into both blocks; an N-pair's blocks each load one A half into both blocks and
        // their own weight tile (none for a second block without columns).
        let a_halves = if V == Variant::WGRAD { 2 } else { w.rows.div_ceil(64) };
        let stage_bytes = if V == Variant::WGRAD {
            STAGE_BYTES
        } else {
            a_halves * (A_TILE_BYTES / 2) + if w.has_columns { B_TILE_BYTES } else { 0 }
        };
        for kb in 0..w.k_blocks {
            // Wait until the consumers released this stage (a fresh barrier passes parity 1).
            // SAFETY: initialised barrier of this block.
            unsafe { mbarrier::wait_parity(ring.empty(stage), phase ^ 1) };
            let (a_tile, b_tile, full) = (ring.a_tile(stage), ring.b_tile(stage), ring.full(stage));
            // SAFETY: maps and tiles valid; the barrier expects what lands in this block.
            unsafe {
                if kb == 0 {
                    name_tile::<V>(ring, stage, tile);
                }
                mbarrier::arrive_expect_tx(full, stage_bytes);
                if V == Variant::WGRAD {
                    // K runs over the group's rows; the last block may end inside the group.
                    let row = w.row_begin + kb * TILE_K;
                    let tail = row + TILE_K > w.row_end;
                    let (map_a, map_b, r) =
                        if tail { (cut_0, cut_1, row - w.row_begin) } else { (p.map_a, p.map_b, row) };
                    let r = r as i32;
                    // M-major A: two 64-wide blocks; N-major B: four.
                    for block in 0..TILE_M / 64 {
                        tma::load_2d(a_tile + block * BLOCK_64_BYTES, map_a, (w.m0 + 64 * block) as i32, r, full);
                    }
                    for block in 0..TILE_N / 64 {
                        tma::load_2d(b_tile + block * BLOCK_64_BYTES, map_b, (w.n0 + 64 * block) as i32, r, full);
                    }
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
                    if w.shares_weights {
                        for half in 0..a_halves {
                            let r = (row + 64 * half) as i32;
                            tma::load_2d(a_tile + half * BLOCK_64_BYTES, map_a, k0, r, full);
                        }
                        load_weights::<V>(b_tile, (map_b, p.map_b2), k0, w.n0, g, full, Some(rank));
                    } else {
                        if rank < a_halves {
                            let half = a_tile + rank * BLOCK_64_BYTES;
                            tma::load_2d_multicast(half, map_a, k0, (row + 64 * rank) as i32, full, PAIR_MASK);
                        }
                        if w.has_columns {
                            load_weights::<V>(b_tile, (map_b, p.map_b2), k0, w.n0, g, full, None);
                        }
                    }
                }
            }
            ring.advance(&mut stage, &mut phase);
        }
    }
}

/// Loads the weight tile of K block `k0`, columns `n0`, group `g` into `b_tile`: all of it
/// (`half: None`), or half `h` of it into both blocks of the pair (`Some(h)`). Every map box is
/// half the tile's 256 rows (K-major) or a 64-wide block (N-major), so both ways fill the same
/// layout. `maps.1` is the up projection's map (gate/up only).
///
/// # Safety
/// As [`tma::load_3d`] (and [`tma::load_3d_multicast`] for a half) for every box.
#[inline(always)]
unsafe fn load_weights<const V: u32>(
    b_tile: u32,
    maps: (u64, u64),
    k0: i32,
    n0: u32,
    g: i32,
    full: u32,
    half: Option<u32>,
) {
    let halves = match half {
        Some(h) => h..h + 1,
        None => 0..2,
    };
    for h in halves {
        let dst = b_tile + h * B_HALF_BYTES;
        // SAFETY: caller contract.
        unsafe {
            let load = |dst: u32, map: u64, c0: i32, c1: i32| {
                if half.is_some() {
                    tma::load_3d_multicast(dst, map, c0, c1, g, full, PAIR_MASK)
                } else {
                    tma::load_3d(dst, map, c0, c1, g, full)
                }
            };
            match V {
                // Half 0: the 128 gate rows; half 1: the 128 up rows of the same hidden columns.
                Variant::GATE_UP => load(dst, if h == 0 { maps.0 } else { maps.1 }, k0, n0 as i32),
                // K-major: 128 of the 256 N rows per box.
                Variant::ROWS_NT | Variant::ROWS_NT_BF16 => load(dst, maps.0, k0, (n0 + h * TILE_N / 2) as i32),
                // N-major: two 64-wide N blocks per half.
                _ => {
                    for block in 0..2 {
                        let n = (n0 + h * TILE_N / 2 + 64 * block) as i32;
                        load(dst + block * BLOCK_64_BYTES, maps.0, n, k0);
                    }
                }
            }
        }
    }
}

/// Both blocks of a pair (cluster ranks 0 and 1): the multicast mask of what they share (the
/// weight tile of an M-pair, the rows of an N-pair).
const PAIR_MASK: u16 = 0b11;

/// This block's rank in its pair (0 for variants that run alone).
#[inline(always)]
fn pair_rank<const V: u32>() -> u32 {
    if cluster_blocks(V) > 1 { sreg::cluster_rank() } else { 0 }
}

/// Names `value` (a tile, or [`NO_TILE`]) in `stage`'s tile slot, once the stage is free: a block
/// that runs alone writes its own slot; a pair's first block writes both blocks' slots, the
/// partner's through its mailbox; a pair's second block already has it there.
///
/// # Safety
/// The stage is free in this block (its `empty` phase passed), so it is free in the partner too
/// (the same barrier counts both blocks' consumers).
#[inline(always)]
unsafe fn name_tile<const V: u32>(ring: Ring, stage: u32, value: u32) {
    if pair_rank::<V>() != 0 {
        return;
    }
    // SAFETY: caller contract; the partner's barriers and slots live until the final cluster
    // barrier.
    unsafe {
        st_shared_u32(ring.tile_slot(stage), value);
        if cluster_blocks(V) > 1 {
            let (slot, mail) =
                (cluster::map_to_rank(ring.tile_slot(stage), 1), cluster::map_to_rank(ring.mail(stage), 1));
            cluster::st_async_u32(slot, value, mail);
        }
    }
}

/// A pair's second block: the tile its partner named in `stage`'s slot (the mailbox completes
/// when the remote store has landed).
///
/// # Safety
/// The block is a pair's second block, and `stage` is where the next tile starts.
#[inline(always)]
unsafe fn receive_tile(ring: Ring, stage: u32, mail_phases: &mut u32) -> u32 {
    let mail = ring.mail(stage);
    // SAFETY: initialised barrier of this block; the partner's remote store completes its bytes.
    unsafe {
        mbarrier::arrive_expect_tx(mail, 4);
        cluster::wait_parity_acquire_cluster(mail, (*mail_phases >> stage) & 1);
    }
    *mail_phases ^= 1 << stage;
    // SAFETY: the slot was written before the mailbox completed.
    unsafe { ld_shared_u32(ring.tile_slot(stage)) }
}

/// Waits for `stage` to be free, names `value` (a tile, or [`NO_TILE`]) in its tile slot and
/// completes its `full` phase with a plain arrival: a stage without copies that only names.
#[inline(always)]
fn name_in_copyless_stage<const V: u32>(ring: Ring, stage: u32, phase: u32, value: u32) {
    // SAFETY: initialised barriers of this block (the producer thread); the slot is free once the
    // stage is, and the arrival publishes it.
    unsafe {
        mbarrier::wait_parity(ring.empty(stage), phase ^ 1);
        name_tile::<V>(ring, stage, value);
        mbarrier::arrive(ring.full(stage));
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
            smem_descriptor(a_tile + wg * BLOCK_64_BYTES + k * 16 * 128, BLOCK_64_BYTES, 1024)
        } else {
            // K-major: this warpgroup's 64 rows; a K slice is 32 bytes into each 128-byte row.
            smem_descriptor(a_tile + wg * BLOCK_64_BYTES + k * 32, 16, 1024)
        };
        *db = if V == Variant::GATE_UP || V == Variant::ROWS_NT || V == Variant::ROWS_NT_BF16 {
            smem_descriptor(b_tile + k * 32, 16, 1024)
        } else {
            // N-major: four 64-wide N blocks, 16 K rows per slice.
            smem_descriptor(b_tile + k * 16 * 128, BLOCK_64_BYTES, 1024)
        };
    }
    (a, b)
}

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
fn for_each_pair_in(first: u32, end: u32, thread_in_wg: u32, mut visit: impl FnMut(usize, u32, u32)) {
    let (warp, lane) = (thread_in_wg / 32, thread_in_wg % 32);
    for_each_n8_block!(J => {
        if first <= J && J < end {
            let col = 8 * J + 2 * (lane % 4);
            visit((4 * J) as usize, warp * 16 + lane / 4, col);
            visit((4 * J + 2) as usize, warp * 16 + lane / 4 + 8, col);
        }
    });
}

/// n8 blocks of a consumer's accumulator tile.
const N8_BLOCKS: u32 = TILE_N / 8;
/// Accumulators per consumer thread.
const ACCUMULATORS: usize = (64 * TILE_N / 128) as usize;

/// Where a staged epilogue's boxes go: the whole-buffer output map and the coordinates of the
/// warpgroup's first output row and column, plus the group index for 3-D maps.
#[derive(Clone, Copy)]
struct OutputBox {
    map: u64,
    col0: u32,
    row0: u32,
    /// `Some(group)` for the weight gradient's `[G][M][N]` map; `None` for 2-D row maps.
    group: Option<u32>,
}

/// The epilogue: every variant's outputs go through this warpgroup's staging area
/// ([`STAGING_BOXES`] boxes) in the 128B-swizzled layout (conflict-free shared stores from the
/// accumulator fragment) and leave as TMA stores — full lines, clipped by the map at the
/// tensor's edges, and in flight while the next tile's MMAs run. A box is 64 rows × 128 bytes:
/// 64 bf16 or 32 f32 columns; a pass fills the staging (the SwiGLU pass its 128 hidden columns). Row tiles that end inside their group store through the output map cut at the
/// group's end, so no row of the next group is written.
///
/// # Safety
/// `staging` is this warpgroup's staging; the maps and outputs match the variant (host contract).
#[inline(always)]
unsafe fn epilogue<const V: u32>(
    p: &GemmParams,
    w: &Work,
    acc: &[f32; ACCUMULATORS],
    staging: u32,
    wg: u32,
    thread_in_wg: u32,
) {
    let out = if V == Variant::WGRAD {
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
        staged_pass(staging, wg, thread_in_wg, 0, N8_BLOCKS / 2, out, true, false, |index| {
            let (cg0, cu0) = math::clamp_gate_up(acc[index], acc[index + UP], limit);
            let (cg1, cu1) = math::clamp_gate_up(acc[index + 1], acc[index + UP + 1], limit);
            [f32x2_to_bf16x2(math::swiglu(cg0, cu0), math::swiglu(cg1, cu1)), 0]
        });
        if p.out1 != 0 {
            // SAFETY: as the caller's.
            unsafe { store_pre_activations(p, w, acc, wg, thread_in_wg) };
        }
    } else if (V == Variant::WGRAD && p.out1 == 0) || V == Variant::ROWS_NT_BF16 {
        // bf16 (weight gradient, or rows): 256 columns, 64 per box.
        const PASSES: u32 = 4 / STAGING_BOXES;
        for pass in 0..PASSES {
            let first = pass * N8_BLOCKS / PASSES;
            staged_pass(staging, wg, thread_in_wg, first, first + N8_BLOCKS / PASSES, out, true, false, |index| {
                [f32x2_to_bf16x2(acc[index], acc[index + 1]), 0]
            });
        }
    } else {
        // f32: 256 columns, 32 per box; the f32 weight gradient adds into its output.
        let add = V == Variant::WGRAD;
        const PASSES: u32 = 8 / STAGING_BOXES;
        for pass in 0..PASSES {
            let first = pass * N8_BLOCKS / PASSES;
            staged_pass(staging, wg, thread_in_wg, first, first + N8_BLOCKS / PASSES, out, false, add, |index| {
                [acc[index].to_bits(), acc[index + 1].to_bits()]
            });
        }
    }
}

/// The group-map slot of the output rows (see `GemmParams::cut_maps`).
const OUTPUT_SLOT: u32 = 2;

/// One staged pass: waits for the staging to be free, stages the accumulator pairs of n8 blocks
/// `first..end` (`pair(index)` gives the bf16x2 word, or the two f32 words), publishes them and
/// has the leader store (or add, for `add`) its boxes at columns `out.col0 + 8 · first ..`.
/// Inline with constant block ranges, so only those accumulators are touched.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn staged_pass(
    staging: u32,
    wg: u32,
    thread_in_wg: u32,
    first: u32,
    end: u32,
    out: OutputBox,
    bf16: bool,
    add: bool,
    mut pair: impl FnMut(usize) -> [u32; 2],
) {
    staging_free(wg, thread_in_wg);
    let first_col = 8 * first;
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
#[inline(always)]
fn staging_free(wg: u32, thread_in_wg: u32) {
    if thread_in_wg == 0 {
        bulk::wait_group_read_all();
    }
    // SAFETY: the whole consumer warpgroup (128 threads) calls this with its own id.
    unsafe { sync::named_barrier(1 + wg, 128) };
}

/// The optional f32 gate and up pre-activations of the SwiGLU tile, stored from registers (only
/// when backward asks for them instead of recomputing).
///
/// # Safety
/// `out1`, `out2` are `[cap][I]` f32.
#[inline(always)]
unsafe fn store_pre_activations(p: &GemmParams, w: &Work, acc: &[f32; ACCUMULATORS], wg: u32, thread_in_wg: u32) {
    const UP: usize = ACCUMULATORS / 2;
    for_each_pair::<{ N8_BLOCKS / 2 }>(thread_in_wg, |index, row, col| {
        let r = wg * 64 + row;
        if r >= w.rows || w.n0 + col >= p.n {
            return;
        }
        let at = (w.m0 + r) as usize * p.n as usize + (w.n0 + col) as usize;
        // SAFETY: row and column inside the group's rows and [0, I).
        unsafe {
            *(p.out1 as *mut f32).add(at) = acc[index];
            *(p.out1 as *mut f32).add(at + 1) = acc[index + 1];
            *(p.out2 as *mut f32).add(at) = acc[index + UP];
            *(p.out2 as *mut f32).add(at + 1) = acc[index + UP + 1];
        }
    });
}

/// Hands a stage back to the producer(s): one arrival per consumer warp (8 per phase), once the
/// warp is done with the stage — its MMAs reading it have completed, or, on the paths without
/// MMAs, at once (only lane 0, the arriving lane, read the tile slot: see `consume`). In a pair, the warp also arrives on the partner's
/// barrier (its producer multicasts into this block's stage): 16 arrivals per phase there.
#[inline(always)]
fn release<const V: u32>(ring: Ring, stage: u32, thread_in_wg: u32) {
    if thread_in_wg % 32 == 0 {
        // SAFETY: initialised barriers of this block and of the partner, which stays until the
        // final cluster barrier.
        unsafe {
            mbarrier::arrive(ring.empty(stage));
            if cluster_blocks(V) > 1 {
                cluster::arrive_remote(cluster::map_to_rank(ring.empty(stage), pair_rank::<V>() ^ 1));
            }
        }
    }
}

/// A consumer warpgroup: MMAs over the stages, then the epilogue, tile after tile.
#[inline(always)]
unsafe fn consume<const V: u32>(p: &GemmParams, ring: Ring, wg: u32, thread_in_wg: u32) {
    let (mut stage, mut phase) = (0u32, 0u32);
    loop {
        // The producer names each tile in the stage holding its first K block (the waits in the
        // loops below pass again at once: the stage is not released before them).
        // Only lane 0 reads the slot and hands the tile to its warp in a register: lane 0 is the
        // lane that later arrives on `empty`, after which the producer may rewrite the slot, so
        // its read is ordered before that by program order. (Reads by the other lanes would not
        // be: nothing between them and lane 0's arrival orders memory, and racecheck reports
        // that write-after-read; a `bar.warp.sync` there is dropped by ptxas.)
        // SAFETY: initialised barrier of this block; the slot is published by the arrival.
        let tile = unsafe {
            mbarrier::wait_parity(ring.full(stage), phase);
            let slot = if thread_in_wg % 32 == 0 { ld_shared_u32(ring.tile_slot(stage)) } else { 0 };
            sync::shfl_idx_u32(slot, 0)
        };
        if tile == NO_TILE {
            break;
        }
        // SAFETY: the producer hands out only tiles < total.
        let w = unsafe { work_of::<V>(p, tile) };
        if V != Variant::WGRAD && (wg * 64 >= w.rows || !w.has_columns) {
            // A ragged tile with no rows in this warpgroup's half (a group's last ≤ 64 rows), or
            // a pair's second block without an N tile (an odd tile count):
            // skip the MMAs, so the other warpgroup has the tensor cores to itself, but keep
            // step with the ring — wait for each stage, then release it (a tile without K blocks
            // still has its one copy-less stage).
            for _ in 0..w.k_blocks.max(1) {
                // SAFETY: initialised barrier of this block.
                unsafe { mbarrier::wait_parity(ring.full(stage), phase) };
                release::<V>(ring, stage, thread_in_wg);
                ring.advance(&mut stage, &mut phase);
            }
            continue;
        }
        let mut acc = [0.0f32; ACCUMULATORS];
        if w.k_blocks == 0 {
            // An empty group's weight gradient: the tile's stage carried only its name.
            release::<V>(ring, stage, thread_in_wg);
            ring.advance(&mut stage, &mut phase);
        } else {
            // Only the path that issued MMAs waits for them: a zero-trip path reaching the wait
            // lets LLVM place the zeroing of `acc` inside the wgmma pipeline, and ptxas then
            // serialises every wgmma of the kernel (C7515).
            mainloop::<V>(&mut acc, ring, (&mut stage, &mut phase), w.k_blocks, wg, thread_in_wg);
        }
        // SAFETY: outputs sized by the host contract.
        unsafe { epilogue::<V>(p, &w, &acc, ring.staging(wg), wg, thread_in_wg) };
    }
    if thread_in_wg == 0 {
        // Shared memory must outlive the bulk stores that read it.
        bulk::wait_group_read_all();
    }
}

/// The MMAs of one tile over its `k_blocks` (> 0) stages, each stage released once the MMAs
/// reading it are done; leaves `stage` / `phase` at the tile's next stage.
#[inline(always)]
fn mainloop<const V: u32>(
    acc: &mut [f32; ACCUMULATORS],
    ring: Ring,
    (stage, phase): (&mut u32, &mut u32),
    k_blocks: u32,
    wg: u32,
    thread_in_wg: u32,
) {
    // One K block stays in flight on the tensor cores while the next stage is awaited: a
    // stage is released once the wait for the *next* block's issue says it is done.
    let mut in_flight: Option<u32> = None;
    for kb in 0..k_blocks {
        // SAFETY: initialised barrier of this block.
        unsafe { mbarrier::wait_parity(ring.full(*stage), *phase) };
        let (a, b) = stage_descriptors::<V>(ring, *stage, wg);
        let accumulate = kb > 0;
        // SAFETY: the stage is full; warpgroup-collective in uniform flow; `acc` is not read
        // before the wait below.
        unsafe {
            match V {
                Variant::GATE_UP | Variant::ROWS_NT | Variant::ROWS_NT_BF16 => {
                    wgmma::issue_k64_m64n256_kk(acc, a, b, accumulate)
                }
                Variant::ROWS_NN => wgmma::issue_k64_m64n256_kn(acc, a, b, accumulate),
                _ => wgmma::issue_k64_m64n256_mn(acc, a, b, accumulate),
            }
        }
        wgmma::wait_keep_one_n256(acc);
        if let Some(done) = in_flight {
            release::<V>(ring, done, thread_in_wg);
        }
        in_flight = Some(*stage);
        ring.advance(stage, phase);
    }
    wgmma::wait_all_n256(acc);
    if let Some(done) = in_flight {
        release::<V>(ring, done, thread_in_wg);
    }
}

/// The engine body shared by every entry point: [`ENGINE_THREADS`](crate::gemm_layout::ENGINE_THREADS)
/// threads, [`ENGINE_SMEM_BYTES`](crate::gemm_layout::ENGINE_SMEM_BYTES) of dynamic shared memory.
///
/// # Safety
/// `params` points at a valid [`GemmParams`] whose tensors match the variant's contract.
#[inline(always)]
pub unsafe fn run<const V: u32>(params: *const GemmParams) {
    // Register budgets below assume exactly this block size (`.maxntid`); row-grouped variants
    // run in pairs (`.reqnctapercluster 2`).
    crate::ptx::declare_block_threads::<ENGINE_THREADS>();
    let paired = cluster_blocks(V) > 1;
    if paired {
        crate::ptx::declare_cluster_blocks::<2>();
    }
    // SAFETY: caller contract; the parameter block is read-only for the whole launch. Fields are
    // read where used (not copied up front) so they do not hold registers across the main loop.
    let p = unsafe { *params };
    let ring = Ring::new();
    let thread = sreg::thread_idx_x();
    if thread == 0 {
        for s in 0..STAGES {
            // SAFETY: this block's barrier slots, initialised once before any use.
            unsafe {
                mbarrier::init(ring.full(s), 1);
                mbarrier::init(ring.empty(s), 8 * cluster_blocks(V));
                mbarrier::init(ring.mail(s), 1);
            }
        }
        mbarrier::fence_mbarrier_init();
    }
    // The partner multicasts into this block's stages and arrives on its barriers: both blocks'
    // barriers must be initialised before either starts.
    if paired {
        cluster::cluster_sync();
    } else {
        sync::block_barrier();
    }
    let warpgroup = thread / 128;
    if warpgroup == 0 {
        // The producer needs a handful of registers; the consumers' m64n256 accumulators need
        // 128 each. Warpgroup-uniform, as setmaxnreg requires.
        if paired {
            sync::release_registers::<PAIRED_PRODUCER_REGISTERS>();
        } else {
            sync::release_registers::<PRODUCER_REGISTERS>();
        }
        if thread == 0 {
            // SAFETY: one producer thread.
            unsafe { produce::<V>(&p, ring) };
        }
    } else {
        if paired {
            sync::claim_registers::<PAIRED_CONSUMER_REGISTERS>();
        } else {
            sync::claim_registers::<CONSUMER_REGISTERS>();
        }
        // SAFETY: a whole consumer warpgroup.
        unsafe { consume::<V>(&p, ring, warpgroup - 1, thread % 128) };
    }
    if paired {
        // No block may leave while its partner can still write into it or arrive on its
        // barriers.
        cluster::cluster_sync();
    }
}
