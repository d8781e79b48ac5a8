//! The producer: one thread per block that takes tiles from the [`source`](super::source), names
//! each in its first stage's slot and fills the ring with TMA copies in K-block order.

use crate::gemm_layout::{
    A_TILE_BYTES, B_TILE_BYTES, BLOCK_64_BYTES, GemmParams, NO_TILE, STAGE_BYTES, TILE_K, TILE_M, TILE_N, Variant,
    cluster_blocks, is_wgrad,
};
use crate::ptx::memory::{atom_add_relaxed_gpu_u32, ld_shared_u32, st_shared_u32, st_shared_v4};
use crate::ptx::{cluster, mbarrier, sreg, tensormap, tma};

use super::gather::full_arrivals;
use super::hooks::{TileHooks, carries_m_tile, hooked};
use super::ring::{Ring, Walk};
use super::source::*;

/// The gate (first) or up (second) half of a SwiGLU B tile: 128 rows of 128 bytes.
pub(super) const B_HALF_BYTES: u32 = B_TILE_BYTES / 2;

/// The producer warp's first lane: takes tiles (from the counter, or by stride for weight
/// gradients), names each in its first stage's slot and fills its stages in K-block order. A
/// stage with copies is whole TMA copies (rows past a group's end arrive as zeros through the
/// group's own map); a tile without K blocks, and the final [`NO_TILE`], get one stage completed
/// by a plain arrival. Each stage's arrival counts for all the arrivals its `full` phase expects
/// ([`full_arrivals`]: in a kernel whose hooks may gather, the gathering threads' too).
///
/// In a pair (row-grouped variants), the first block's producer takes each tile from the counter
/// and names it in both blocks' slots; the second block's producer reads it from its slot when
/// the stage's mailbox completes. Then, per stage, an M-pair's producers each load their own
/// rows and half of the shared weight tile into both blocks, and an N-pair's each load one
/// 64-row half of the shared rows into both blocks and their own weight tile: a stage is `full`
/// in a block when everything meant for it has landed there, and `empty` when both blocks'
/// consumers have released it (16 arrivals), because the partner's producer writes into it too.
///
/// Starts at `walk` and returns where the walk stands after the stage that carried [`NO_TILE`]
/// (the next phase of a persistent kernel starts there).
///
/// # Safety
/// Called by one thread of the block (the producer), in a block set up as
/// [`consume`](super::engine::consume) requires (ring barriers initialised, in both blocks of a
/// pair); `p` is a valid parameter block of variant `V` (offsets, maps and group maps as the host
/// contract of `run` states, its tile counter zeroed before the launch), whose consumers run
/// `consume` from the same `walk`; the hooks' contracts hold.
#[inline(always)]
pub(super) unsafe fn produce<const V: u32, H: TileHooks>(p: &GemmParams, ring: Ring, hooks: H, walk: Walk) -> Walk {
    // SAFETY: the offsets in `p` hold groups + 1 (rows) and 2 · (groups + 1) (tiles) entries
    // (host contract of `run`).
    let total = if hooks.takes_no_tiles() { 0 } else { unsafe { tile_count::<V>(p) } };
    let counter = p.tile_counter as *mut u32;
    let rank = pair_rank::<V>();
    let Walk { mut stage, mut phase, mut mail_phases } = walk;
    let full_arrivals = const { full_arrivals(H::MAY_GATHER_ROWS) };
    let mut taken = 0u32;
    // The group of the walk's previous tile (`work_of_after`).
    let mut previous_group = None;
    // A weight gradient's tiles of one group read the same rows: the producer waits for them
    // at the group's first tile of this phase only (the proxy fence after that wait orders
    // every later copy too). On its stride walk a block meets each group in a run of about
    // (tiles per group) / (stride) tiles: kimi's down weight gradient, 448 / 132.
    let mut ready_group = u32::MAX;
    // A weight gradient asks at its first tile whether every tile of the phase is ready
    // (`TileHooks::phase_ready`); if so, no tile of the phase waits.
    let (mut phase_asked, mut phase_ready) = (false, false);
    // A weight gradient's fixed-stride walk, worked out once per phase.
    let (walk_first, walk_stride) = if V == Variant::WGRAD_IN_PAIR { hooks.weight_tile_walk(total) } else { (0, 0) };
    loop {
        // Row-grouped tiles are long (a whole K loop over the hidden or intermediate width):
        // handing them out in list order keeps neighbours in time (see `tile_counter`). A weight
        // gradient's tiles are a few K blocks (a group's rows) and neighbours already share
        // nothing but A columns; there the fixed stride avoids an atomic round trip per tile.
        let tile = if V == Variant::WGRAD {
            sreg::block_idx_x() + taken * sreg::grid_dim_x()
        } else if V == Variant::WGRAD_IN_PAIR {
            walk_first + taken * walk_stride
        } else if rank == 0 {
            // SAFETY: the plan's counter, zeroed before the launch (host contract).
            unsafe { atom_add_relaxed_gpu_u32(counter, 1) }
        } else {
            // SAFETY: initialised barrier of this block; the partner names every tile.
            unsafe { receive_tile::<V>(ring, stage, &mut mail_phases) }
        };
        taken += 1;
        if tile >= total {
            // Tell the consumers (and the partner) through the next stage.
            // SAFETY: caller contract: initialised barriers, the producer thread at its walk.
            unsafe { name_in_copyless_stage::<V>(ring, stage, phase, NO_TILE, full_arrivals, None) };
            ring.advance::<V>(&mut stage, &mut phase);
            return Walk { stage, phase, mail_phases };
        }
        // SAFETY: tile < total.
        // The search for the tile's group starts at the previous tile's (this walk's tiles rise).
        let w = unsafe { work_of_after::<V>(p, tile, previous_group) };
        previous_group = Some(w.group);
        // SAFETY: as above.
        let w = if carries_m_tile::<V, H>() { unsafe { w.with_m_tile(p) } } else { w };
        let g = w.group as i32;
        if w.k_blocks == 0 {
            // A weight gradient of an empty group: no copies, but the consumers still learn the
            // tile (they store its zeros).
            // SAFETY: as for the `NO_TILE` stage above.
            unsafe { name_in_copyless_stage::<V>(ring, stage, phase, tile, full_arrivals, Some(&w)) };
            ring.advance::<V>(&mut stage, &mut phase);
            continue;
        }
        // Maps cut at this group's end: for a ragged row tile (A, and the second A), for the
        // last K block of a weight gradient (A and B). They were written by the group-map kernel
        // through the tensor-map proxy; acquire them before the first copy.
        let cut = if is_wgrad(V) { !(w.row_end - w.row_begin).is_multiple_of(TILE_K) } else { w.rows < TILE_M };
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
        let a_halves = if is_wgrad(V) { 2 } else { w.rows.div_ceil(64) };
        let stage_bytes = if is_wgrad(V) {
            STAGE_BYTES
        } else {
            a_halves * (A_TILE_BYTES / 2) + if w.has_columns { B_TILE_BYTES } else { 0 }
        };
        if hooked(V) && !phase_ready && !(V == Variant::WGRAD_IN_PAIR && w.group == ready_group) {
            if V == Variant::WGRAD_IN_PAIR && !phase_asked {
                phase_asked = true;
                // SAFETY: the producer thread, at the phase's first tile.
                phase_ready = unsafe { hooks.phase_ready() };
            }
            if !phase_ready {
                // A persistent kernel's rows may still be on their way: wait (bounded) until they
                // landed.
                // SAFETY: `w` is a tile of this launch.
                unsafe { hooks.before_rows(p, &w) };
            }
            ready_group = w.group;
        }
        for kb in 0..w.k_blocks {
            // Wait until the consumers released this stage (a fresh barrier passes parity 1).
            // SAFETY: initialised barrier of this block.
            unsafe { mbarrier::wait_parity(ring.empty::<V>(stage), phase ^ 1) };
            let (a_tile, b_tile, full) = (ring.a_tile(stage), ring.b_tile(stage), ring.full(stage));
            // SAFETY: maps and tiles valid; the barrier expects what lands in this block.
            unsafe {
                if kb == 0 {
                    name_tile::<V>(ring, stage, tile);
                    name_work::<V>(ring, stage, &w);
                }
                if full_arrivals == 1 {
                    mbarrier::arrive_expect_tx(full, stage_bytes);
                } else {
                    // The gathering threads' arrivals too (a ring that gathering phases share).
                    mbarrier::expect_tx(full, stage_bytes);
                    mbarrier::arrive_count(full, full_arrivals);
                }
                if is_wgrad(V) {
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
            ring.advance::<V>(&mut stage, &mut phase);
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
pub(super) unsafe fn load_weights<const V: u32>(
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

/// Names `value` (a tile, or [`NO_TILE`]) in `stage`'s tile slot, once the stage is free: a block
/// that runs alone writes its own slot; a pair's first block writes both blocks' slots, the
/// partner's through its mailbox; a pair's second block already has it there.
///
/// # Safety
/// The stage is free in this block (its `empty` phase passed), so it is free in the partner too
/// (the same barrier counts both blocks' consumers).
#[inline(always)]
pub(super) unsafe fn name_tile<const V: u32>(ring: Ring, stage: u32, value: u32) {
    if pair_rank::<V>() != 0 {
        return;
    }
    // SAFETY: caller contract; the partner's barriers and slots live until the final cluster
    // barrier.
    unsafe {
        st_shared_u32(ring.tile_slot::<V>(stage), value);
        if cluster_blocks(V) > 1 {
            let (slot, mail) =
                (cluster::map_to_rank(ring.tile_slot::<V>(stage), 1), cluster::map_to_rank(ring.mail::<V>(stage), 1));
            cluster::st_async_u32(slot, value, mail);
        }
    }
}

/// Writes a tile's [`Work`] into `stage`'s work slot in this block (each block its own: a
/// pair's blocks differ in rows or columns), for its consumers to read after the stage's `full`
/// phase instead of looking the tile up again ([`uses_work_slot`]; otherwise nothing).
///
/// # Safety
/// The stage is free in this block (its `empty` phase passed) and its `full` arrival by this
/// thread, or by one ordered after this thread's store, follows.
#[inline(always)]
pub(super) unsafe fn name_work<const V: u32>(ring: Ring, stage: u32, work: &Work) {
    if !uses_work_slot(V) {
        return;
    }
    let [a, b, c, d, e, f, g, h, i, j, k, l] = work.packed();
    let slot = ring.work_slot::<V>(stage);
    // SAFETY: caller contract; the slot is 16-byte aligned in this block's ring.
    unsafe {
        st_shared_v4(slot, [a, b, c, d]);
        st_shared_v4(slot + 16, [e, f, g, h]);
        st_shared_v4(slot + 32, [i, j, k, l]);
    }
}

/// A pair's second block: the tile its partner named in `stage`'s slot (the mailbox completes
/// when the remote store has landed).
///
/// # Safety
/// The block is a pair's second block, and `stage` is where the next tile starts.
#[inline(always)]
pub(super) unsafe fn receive_tile<const V: u32>(ring: Ring, stage: u32, mail_phases: &mut u32) -> u32 {
    let mail = ring.mail::<V>(stage);
    // SAFETY: initialised barrier of this block; the partner's remote store completes its bytes.
    unsafe {
        mbarrier::arrive_expect_tx(mail, 4);
        cluster::wait_parity_acquire_cluster(mail, (*mail_phases >> stage) & 1);
    }
    *mail_phases ^= 1 << stage;
    // SAFETY: the slot was written before the mailbox completed.
    unsafe { ld_shared_u32(ring.tile_slot::<V>(stage)) }
}

/// Waits for `stage` to be free, names `value` (a tile, or [`NO_TILE`]) in its tile slot (and
/// the tile's `work`, if any, in its work slot) and completes its `full` phase with `arrivals`
/// arrivals, all the phase expects ([`full_arrivals`]): a stage without copies that only names.
///
/// # Safety
/// The ring's barriers are initialised (`init_barriers`, in both blocks of a pair, the partner
/// staying until the final cluster barrier); called by the block's producer thread at its walk's
/// `(stage, phase)`.
#[inline(always)]
pub(super) unsafe fn name_in_copyless_stage<const V: u32>(
    ring: Ring,
    stage: u32,
    phase: u32,
    value: u32,
    arrivals: u32,
    work: Option<&Work>,
) {
    // SAFETY: initialised barriers of this block (the producer thread, caller contract); the slot
    // is free once the stage is, and the arrival publishes it.
    unsafe {
        mbarrier::wait_parity(ring.empty::<V>(stage), phase ^ 1);
        name_tile::<V>(ring, stage, value);
        if let Some(work) = work {
            name_work::<V>(ring, stage, work);
        }
        if arrivals == 1 {
            mbarrier::arrive(ring.full(stage));
        } else {
            mbarrier::arrive_count(ring.full(stage), arrivals);
        }
    }
}
