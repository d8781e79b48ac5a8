//! The gathering producer: the producer warpgroup's first warp fills each stage's A tile with
//! rows read through an index — row `r` of the plan is row `row_source[r] / top_k` of `x`, the
//! token of the routing layout's slot — so no gathered copy of the rows is written first. The
//! lanes place the 16-byte chunks themselves in the 128B-swizzle layout a TMA box would have
//! (`cp.async`, zero-filled past the group's rows and past K), and the stage's `full` barrier
//! counts each lane's copies as one arrival; lane 0 takes the tiles and loads the weight tiles
//! by TMA as [`produce`](super::producer::produce) does. The consumers fence the async proxy
//! after each `full` wait (the chunks arrive through the generic proxy; `wgmma` reads through the
//! async one).
//!
//! In a pair nothing of A is shared: an M-pair's blocks gather their own rows (as they load them
//! without a gather), an N-pair's block with columns gathers all of the tile's rows, and one
//! without columns (an odd N tile count; its consumers skip the tile) gathers none. The weight
//! tile is loaded as without a gather, half by each block into both for an M-pair.

use crate::gemm_layout::{B_TILE_BYTES, GemmParams, NO_TILE, TILE_K, TILE_M, Variant, swizzled_chunk_offset};
use crate::ptx::memory::atom_add_relaxed_gpu_u32;
use crate::ptx::{cp_async, mbarrier, sync};

use super::hooks::RowGather;
use super::producer::{load_weights, name_tile, receive_tile};
use super::ring::{Ring, Walk};
use super::source::*;

/// Lanes of the gathering warp: each stage's `full` barrier expects one arrival from each (its
/// copies have landed) besides the first lane's arrival with the weight tile's bytes.
pub(super) const GATHER_LANES: u32 = 32;

/// Rows of an A tile each lane gathers: rows `lane + 32 · j`.
const ROWS_PER_LANE: usize = (TILE_M / GATHER_LANES) as usize;

/// The gathering producer's walk over the launch's tiles, from a fresh ring; the whole first warp
/// of the producer warpgroup calls it (`lane` its lane), in uniform control flow.
///
/// # Safety
/// As [`produce`](super::producer::produce) for a standalone row-grouped kernel of a variant
/// whose A is K-major rows in one K segment (gate/up, the downs), whose `full` barriers were
/// initialised for `1 + GATHER_LANES` arrivals; `rows` describes a live `[T][p.k]` bf16 tensor and
/// a `row_source` entry, below `T · top_k`, for every row of the launch's groups; every lane of
/// the warp calls it with the same arguments.
#[inline(always)]
pub(super) unsafe fn produce_gathered<const V: u32>(p: &GemmParams, ring: Ring, rows: RowGather, lane: u32) {
    // Not a `const` assertion: `run` instantiates this for every variant, behind a `row_gather`
    // that only the gathering kernels' hooks return.
    if !(V == Variant::GATE_UP || V == Variant::ROWS_NT || V == Variant::ROWS_NT_BF16) {
        crate::ptx::trap();
    }
    // SAFETY: the offsets in `p` hold groups + 1 (rows) and 2 · (groups + 1) (tiles) entries
    // (caller contract).
    let total = unsafe { tile_count::<V>(p) };
    let rank = pair_rank::<V>();
    let Walk { mut stage, mut phase, mut mail_phases } = Walk::START;
    loop {
        // Lane 0 takes the tile (the pair's first block from the counter, the second from its
        // mailbox) and hands it to the warp.
        let mut taken = 0;
        if lane == 0 {
            taken = if rank == 0 {
                // SAFETY: the plan's counter, zeroed before the launch (caller contract).
                unsafe { atom_add_relaxed_gpu_u32(p.tile_counter as *mut u32, 1) }
            } else {
                // SAFETY: initialised barrier of this block; the partner names every tile.
                unsafe { receive_tile::<V>(ring, stage, &mut mail_phases) }
            };
        }
        // SAFETY: the whole warp is here (caller contract; every lane takes the same iterations,
        // the loop ending only on the broadcast tile).
        let tile = unsafe { sync::shfl_idx_u32(taken, 0) };
        if tile >= total {
            // SAFETY: as below for a stage, without copies.
            unsafe { copyless_stage::<V>(ring, (stage, phase), NO_TILE, lane) };
            return;
        }
        // SAFETY: tile < total.
        let w = unsafe { work_of::<V>(p, tile) };
        // The rows this block gathers: none without columns (the consumers skip the tile), else
        // the tile's rows in whole 64-row halves (a half wholly past the group's end is read by
        // no warpgroup).
        let gathered = if w.has_columns { w.rows.div_ceil(64) * 64 } else { 0 };
        // Each lane's rows' first bytes in `x`; 0 for a row past the group's end (zeros).
        let mut sources = [0u64; ROWS_PER_LANE];
        for (j, source) in sources.iter_mut().enumerate() {
            let r = lane + GATHER_LANES * j as u32;
            if r < gathered && r < w.rows {
                // SAFETY: row m0 + r is a row of the launch's groups (r < rows), which has a
                // `row_source` entry (caller contract).
                let slot = unsafe { *rows.row_source.add((w.m0 + r) as usize) };
                *source = rows.x + (slot / rows.top_k) as u64 * rows.pitch_bytes as u64;
            }
        }
        let b_bytes = if w.has_columns { B_TILE_BYTES } else { 0 };
        for kb in 0..w.k_blocks {
            // Every lane writes into the stage: each waits until the consumers released it (a
            // fresh barrier passes parity 1).
            // SAFETY: initialised barrier of this block.
            unsafe { mbarrier::wait_parity(ring.empty::<V>(stage), phase ^ 1) };
            let (a_tile, full) = (ring.a_tile(stage), ring.full(stage));
            let k0 = kb * TILE_K;
            if lane == 0 {
                // SAFETY: the stage is free; the barrier expects the weight tile's bytes in this
                // block (an M-pair's partner loads the other half into it); maps valid.
                unsafe {
                    if kb == 0 {
                        name_tile::<V>(ring, stage, tile);
                    }
                    mbarrier::arrive_expect_tx(full, b_bytes);
                    let maps = (p.map_b, p.map_b2);
                    if w.shares_weights {
                        load_weights::<V>(ring.b_tile(stage), maps, k0 as i32, w.n0, w.group as i32, full, Some(rank));
                    } else if w.has_columns {
                        load_weights::<V>(ring.b_tile(stage), maps, k0 as i32, w.n0, w.group as i32, full, None);
                    }
                }
            }
            for (j, &source) in sources.iter().enumerate() {
                let r = lane + GATHER_LANES * j as u32;
                if r >= gathered {
                    continue;
                }
                for chunk in 0..8 {
                    let column = k0 + 8 * chunk;
                    let present = source != 0 && column < p.k;
                    let (src, bytes) = if present { (source + 2 * column as u64, 16) } else { (rows.x, 0) };
                    // SAFETY: the chunk's place in this stage's A tile (row r < 128), free since
                    // the `empty` wait; a present chunk is inside row `source` of `x` (column < K,
                    // K a multiple of 8), an absent one reads nothing.
                    unsafe { cp_async::copy_16_zero_filled(a_tile + swizzled_chunk_offset(r, chunk), src, bytes) };
                }
            }
            // SAFETY: the stage's current phase expects this lane's arrival (caller contract).
            unsafe { cp_async::arrive_on_completion(full) };
            ring.advance::<V>(&mut stage, &mut phase);
        }
    }
}

/// A stage without copies (the final [`NO_TILE`]): every lane waits until it is free, lane 0
/// names `value` in its slot and arrives, every lane arrives as after its copies.
///
/// # Safety
/// As [`produce_gathered`], at its walk's `(stage, phase)`.
#[inline(always)]
unsafe fn copyless_stage<const V: u32>(ring: Ring, (stage, phase): (u32, u32), value: u32, lane: u32) {
    // SAFETY: initialised barriers of this block (caller contract); the slot is free once the
    // stage is, and lane 0's arrival publishes it.
    unsafe {
        mbarrier::wait_parity(ring.empty::<V>(stage), phase ^ 1);
        if lane == 0 {
            name_tile::<V>(ring, stage, value);
            mbarrier::arrive(ring.full(stage));
        }
        cp_async::arrive_on_completion(ring.full(stage));
    }
}
