//! The gathering producer: the producer warpgroup's four warps ([`GATHER_WARPS`]) fill each
//! stage with rows read through an index — row `r` of the plan is row `row_source[r] / top_k`
//! of `x`, the token of the routing layout's slot — so no gathered copy of the rows is written
//! first. The lanes place the 16-byte chunks themselves in the 128B-swizzle layout a TMA box
//! would have (`cp.async`, zero-filled past the group's rows and past the row width); thread 0
//! takes the tiles and loads the other operand by TMA as [`produce`](super::producer::produce)
//! does. The consumers fence the async proxy after each `full` wait (the chunks arrive through
//! the generic proxy; `wgmma` reads through the async one).
//!
//! In a kernel whose hooks may gather ([`TileHooks::MAY_GATHER_ROWS`]) a stage's `full` barrier
//! expects [`full_arrivals`]: thread 0's, after it added the TMA bytes (`expect_tx`), and one
//! per gathering thread, made by the hardware once that thread's copies of the stage have landed
//! (`cp.async.mbarrier.arrive.noinc`). So the phase completes only when every copy and every TMA
//! byte has landed, and the threads need not meet at each stage. A stage produced by thread 0
//! alone (a TMA-only phase of a persistent kernel, a stage without copies) carries all the
//! arrivals in thread 0's one `mbarrier.arrive` with that count, so gathering and TMA-only phases
//! share the ring.
//!
//! Gate/up (one K segment) gathers A, K-major: a tile's 128 rows of 64 K
//! values per stage. In a pair nothing of A is shared: an M-pair's blocks gather their own rows
//! (as they load them without a gather), an N-pair's block with columns gathers all of the
//! tile's rows, and one without columns (an odd N tile count; its consumers skip the tile)
//! gathers none; the weight tile is loaded as without a gather, half by each block into both
//! for an M-pair. The weight gradient gathers B, N-major: per stage 64 rows (its K) of the
//! tile's 256 columns, four 64-wide blocks; A (the output gradient's rows) stays a TMA copy, cut
//! at the group's end for its last K block.

use crate::gemm_layout::{
    A_TILE_BYTES, B_TILE_BYTES, BLOCK_64_BYTES, GATHERED_ROWS_PER_LANE, GemmParams, NO_TILE, TILE_K, TILE_M, Variant,
    gathered_a_chunk, gathered_a_copy, gathered_b_chunk, gathered_b_copy, is_wgrad,
};
use crate::ptx::memory::{atom_add_relaxed_gpu_u32, ld_volatile_shared_u32, st_shared_u32};
use crate::ptx::{cp_async, mbarrier, sreg, sync, tensormap, tma};

use super::hooks::{RowGather, TileHooks, carries_m_tile};
use super::producer::{load_weights, name_in_copyless_stage, name_tile, name_work, receive_tile};
use super::ring::{Ring, Walk};
use super::source::*;

/// Lanes of a gathering warp.
pub(super) const GATHER_LANES: u32 = 32;

/// The named barrier at which the gathering warps meet (0 is the block's, 1 and 2 the
/// consumer warpgroups' epilogues).
const GATHER_BARRIER: u32 = 3;

/// Warps that gather: the whole producer warpgroup. One warp's copies keep too few rows in
/// flight to feed the MMAs (docs/PERF.md, "The token rows gathered in the GEMM producers");
/// the standalone gathering kernels' other producer warps are idle, and the one-GPU
/// megakernels' spare warps join once their row moving is done.
pub(super) const GATHER_WARPS: u32 = 4;

/// The threads that gather: the producer warpgroup's ([`GATHER_WARPS`]), and this thread's
/// index among them. Thread 0 leads: it takes the tiles, issues the TMA copies and makes each
/// stage's one `full` arrival.
#[derive(Clone, Copy)]
pub(super) struct Gatherers {
    pub(super) thread: u32,
}

impl Gatherers {
    #[inline(always)]
    fn lane(self) -> u32 {
        self.thread % GATHER_LANES
    }
    #[inline(always)]
    fn warp(self) -> u32 {
        self.thread / GATHER_LANES
    }
    #[inline(always)]
    fn leads(self) -> bool {
        self.thread == 0
    }
    /// Every gathering thread meets here (named barrier [`GATHER_BARRIER`]), which also orders
    /// their shared-memory accesses before whatever follows in any of them. The unaligned
    /// barrier: thread 0 reaches a meeting from work it did alone (taking a tile, or the phases
    /// it produced by itself), so its warp may arrive divergent.
    ///
    /// # Safety
    /// Every gathering thread calls it, once per meeting.
    #[inline(always)]
    pub(super) unsafe fn meet(self) {
        // SAFETY: caller contract.
        unsafe { sync::named_barrier_unaligned(GATHER_BARRIER, GATHER_LANES * GATHER_WARPS) }
    }
}

/// Tokens each lane position holds ([`GATHERED_ROWS_PER_LANE`]): for a gate/up tile, of rows
/// `lane / 2 + 16j`; for a weight gradient's stage, of K rows `(lane / 2) % 8 + 8j`.
const TOKENS_PER_LANE: usize = GATHERED_ROWS_PER_LANE as usize;

/// Of those, the tokens each gathering warp's lane copies: warp `w`'s are `j` from `2w`.
const TOKENS_PER_WARP: usize = TOKENS_PER_LANE / GATHER_WARPS as usize;
const _: () = assert!(TOKENS_PER_WARP == 2, "each_token spells out two calls");

/// Warp-wide copies per gate/up stage per token ([`gathered_a_chunk`]): a row's 4 sectors.
const A_COPIES_PER_TOKEN: u32 = TILE_M * 8 / GATHER_LANES / GATHERED_ROWS_PER_LANE;

/// Warp-wide copies per weight-gradient B stage per token ([`gathered_b_chunk`]).
const B_COPIES_PER_TOKEN: u32 = TILE_K * 32 / GATHER_LANES / GATHERED_ROWS_PER_LANE;

/// A row slot without a token: past the group's end, its chunks are zeros.
const NO_TOKEN: u32 = u32::MAX;

/// The arrivals a stage's `full` phase expects in a kernel whose hooks may gather
/// (`may_gather_rows`, [`TileHooks::MAY_GATHER_ROWS`]): thread 0's and one per gathering thread
/// (whose copies' landing makes it); one otherwise, thread 0's alone. The producer of a
/// stage without gathered copies makes them all at once.
pub(super) const fn full_arrivals(may_gather_rows: bool) -> u32 {
    if may_gather_rows { 1 + GATHER_LANES * GATHER_WARPS } else { 1 }
}

impl RowGather {
    /// The slot of plan row `row`, looked up once per tile (gate/up) or stage (weight
    /// gradient) by the lane that copies the row. A lane loads all its rows' slots before it
    /// uses any ([`token`](Self::token)): a use right after each load would wait out one load's
    /// latency per row, in series, on the producer's path.
    ///
    /// # Safety
    /// `row` has a `row_source` entry (a row of the launch's groups).
    #[inline(always)]
    unsafe fn slot(&self, row: u32) -> u32 {
        // SAFETY: caller contract.
        unsafe { *self.row_source.add(row as usize) }
    }

    /// The token of a looked-up slot, or [`NO_TOKEN`] for a row the copies skip (`has_token`
    /// false: past the group's end, or not gathered), whose slot was loaded from a stand-in row.
    #[inline(always)]
    fn token(&self, slot: u32, has_token: bool) -> u32 {
        if has_token { slot / self.top_k } else { NO_TOKEN }
    }

    /// Where token `token`'s row of `x` starts (an address only for a token, not [`NO_TOKEN`]).
    #[inline(always)]
    fn row_start(&self, token: u32) -> u64 {
        self.x + token as u64 * self.pitch_bytes as u64
    }
}

/// The gathering producer's walk over the launch's tiles from `walk` (a fresh ring in a
/// standalone kernel, where the previous phase left it in a persistent one); the producer
/// warpgroup's [`GATHER_WARPS`] warps call it (`thread` the index among them), in uniform
/// control flow. Returns, as [`produce`](super::producer::produce) does, where
/// the walk stands after the stage that carried [`NO_TILE`]; thread 0's is the walk (only it
/// tracks the mailboxes). Of the hooks it uses what a weight gradient on a persistent kernel's
/// ring needs (`Variant::WGRAD_IN_PAIR`: its tile walk, and thread 0's bounded wait for a
/// group's A rows at the group's first tile, [`TileHooks::before_rows`]) and whether the phase
/// takes tiles; a gate/up's gathered rows are the pass's input, so it waits for nothing.
///
/// # Safety
/// As [`produce`](super::producer::produce) from `walk` for a variant with a gathered operand
/// (gate/up: A, `[T][p.k]`; a weight gradient: B, `[T][p.n]`), whose `full` barriers were
/// initialised for one arrival; `rows` describes a live bf16 tensor of that width and a
/// `row_source` entry, below `T · top_k`, for every row of the launch's groups; every gathering
/// thread calls it with the same arguments.
#[inline(always)]
pub(super) unsafe fn produce_gathering<const V: u32, H: TileHooks>(
    p: &GemmParams,
    ring: Ring,
    (rows, hooks): (RowGather, H),
    thread: u32,
    walk: Walk,
) -> Walk {
    let gatherers = Gatherers { thread };
    // Not a `const` assertion: `run` instantiates this for every variant, behind a `row_gather`
    // that only the gathering hooks return.
    // Gate/up (one K segment) and the weight gradients only: the downs have no gathered
    // operand, and a second K segment would need its own rows and maps.
    if !(V == Variant::GATE_UP || is_wgrad(V)) {
        crate::ptx::trap();
    }
    // SAFETY: the offsets in `p` hold groups + 1 (rows) and 2 · (groups + 1) (tiles) entries
    // (caller contract).
    let total = if hooks.takes_no_tiles() { 0 } else { unsafe { tile_count::<V>(p) } };
    let rank = pair_rank::<V>();
    let Walk { mut stage, mut phase, mut mail_phases } = walk;
    let mut taken = 0u32;
    // The group of the walk's previous tile (`work_of_after`).
    let mut previous_group = None;
    // As in `produce`: a persistent kernel's weight gradient walks a fixed stride, and waits for
    // a group's rows at its first tile of the group.
    let (walk_first, walk_stride) = if V == Variant::WGRAD_IN_PAIR { hooks.weight_tile_walk(total) } else { (0, 0) };
    let mut ready_group = u32::MAX;
    // The leader's, as in `produce`: whether every tile of the phase is ready.
    let (mut phase_asked, mut phase_ready) = (false, false);
    loop {
        let tile = if V == Variant::WGRAD {
            // The standalone weight gradient's fixed stride (see `produce`).
            sreg::block_idx_x() + taken * sreg::grid_dim_x()
        } else if V == Variant::WGRAD_IN_PAIR {
            walk_first + taken * walk_stride
        } else {
            // Thread 0 takes the tile (the pair's first block from the counter, the second from
            // its mailbox) and hands it to the other gathering threads.
            let mut named = 0;
            if gatherers.leads() {
                named = if rank == 0 {
                    // SAFETY: the plan's counter, zeroed before the launch (caller contract).
                    unsafe { atom_add_relaxed_gpu_u32(p.tile_counter as *mut u32, 1) }
                } else {
                    // SAFETY: initialised barrier of this block; the partner names every tile.
                    unsafe { receive_tile::<V>(ring, stage, &mut mail_phases) }
                };
            }
            // Through shared memory: written before the meeting, read after it, and the threads
            // meet again before thread 0 can write the next tile (a tile's stages end without a
            // meeting: `finish_stage`).
            // SAFETY: every gathering thread is here (caller contract; all take the same
            // iterations, the loop ending only on the handed-out tile).
            unsafe {
                if gatherers.leads() {
                    st_shared_u32(ring.handout::<V>(), named);
                }
                gatherers.meet();
                let tile = ld_volatile_shared_u32(ring.handout::<V>());
                gatherers.meet();
                tile
            }
        };
        taken += 1;
        if tile >= total {
            // SAFETY: as below for a stage, without copies.
            unsafe { copyless_stage::<V>(ring, (stage, phase), (NO_TILE, None), gatherers) };
            ring.advance::<V>(&mut stage, &mut phase);
            return Walk { stage, phase, mail_phases };
        }
        // SAFETY: tile < total.
        // The search for the tile's group starts at the previous tile's (this walk's tiles rise).
        let w = unsafe { work_of_after::<V>(p, tile, previous_group) };
        previous_group = Some(w.group);
        // SAFETY: as above.
        let w = if carries_m_tile::<V, H>() { unsafe { w.with_m_tile(p) } } else { w };
        if is_wgrad(V) && w.k_blocks == 0 {
            // An empty group's weight gradient: its consumers store the tile's zeros.
            // SAFETY: as below for a stage, without copies.
            unsafe { copyless_stage::<V>(ring, (stage, phase), (tile, Some(&w)), gatherers) };
            ring.advance::<V>(&mut stage, &mut phase);
            continue;
        }
        if V == Variant::WGRAD_IN_PAIR && w.group != ready_group {
            if gatherers.leads() && !phase_ready {
                if !phase_asked {
                    phase_asked = true;
                    // SAFETY: the producer's leader, at the phase's first tile.
                    phase_ready = unsafe { hooks.phase_ready() };
                }
                if !phase_ready {
                    // A's rows (the data gradient's) may still be on their way: thread 0, which
                    // copies them, waits (bounded) and fences; B, the token rows, is an input.
                    // SAFETY: `w` is a tile of this launch (the hooks' contract).
                    unsafe { hooks.before_rows(p, &w) };
                }
            }
            ready_group = w.group;
        }
        // Each warp copies the rows of its share of a lane's 8 tokens (`TOKENS_PER_WARP`).
        let walk = (&mut stage, &mut phase);
        // SAFETY: caller contract (maps, rows, barriers); `w` a tile of the launch.
        unsafe {
            if is_wgrad(V) {
                gather_weight_gradient_tile::<V>(p, ring, rows, (tile, &w), walk, gatherers)
            } else {
                gather_row_tile::<V>(p, ring, rows, (tile, &w), walk, gatherers)
            }
        }
    }
}

/// A row-grouped tile's stages: A gathered by every gathering thread, each warp the rows of its
/// [`TOKENS_PER_WARP`] tokens per lane, the weight tile by thread 0's TMA.
///
/// # Safety
/// As [`produce_gathering`], for its tile `tile` (`w`) at its walk's `(stage, phase)`.
#[inline(always)]
unsafe fn gather_row_tile<const V: u32>(
    p: &GemmParams,
    ring: Ring,
    rows: RowGather,
    (tile, w): (u32, &Work),
    (stage, phase): (&mut u32, &mut u32),
    gatherers: Gatherers,
) {
    let (lane, first_token) = (gatherers.lane(), gatherers.warp() * TOKENS_PER_WARP as u32);
    let rank = pair_rank::<V>();
    // The rows this block gathers: none without columns (the consumers skip the tile), else
    // the tile's rows in whole 64-row halves (a half wholly past the group's end is read by no
    // warpgroup).
    let gathered = if w.has_columns { w.rows.div_ceil(64) * 64 } else { 0 };
    // The tokens of this lane's rows lane / 2 + 16j (j from first_token), NO_TOKEN past the
    // group's end or from `gathered` on (zeros). Every slot is loaded before any is used; a row
    // without a token loads the tile's first row's slot (every tile has a row: `pair_tile`) and
    // ignores it.
    let row_of = |jj: usize| gathered_a_chunk(A_COPIES_PER_TOKEN * (first_token + jj as u32), lane).0;
    let has_token = |r: u32| r < gathered && r < w.rows;
    let mut slots = [0; TOKENS_PER_WARP];
    for (jj, slot) in slots.iter_mut().enumerate() {
        let r = row_of(jj);
        // SAFETY: row m0 + r (r < rows) or m0 is a row of the launch's groups (caller contract).
        *slot = unsafe { rows.slot(w.m0 + if has_token(r) { r } else { 0 }) };
    }
    let mut tokens = [NO_TOKEN; TOKENS_PER_WARP];
    for (jj, token) in tokens.iter_mut().enumerate() {
        *token = rows.token(slots[jj], has_token(row_of(jj)));
    }
    let b_bytes = if w.has_columns { B_TILE_BYTES } else { 0 };
    for kb in 0..w.k_blocks {
        // Every gathering thread writes into the stage: each waits until the consumers released
        // it (a fresh barrier passes parity 1).
        // SAFETY: initialised barrier of this block.
        unsafe { mbarrier::wait_parity(ring.empty::<V>(*stage), *phase ^ 1) };
        let (a_tile, full) = (ring.a_tile(*stage), ring.full(*stage));
        let k0 = kb * TILE_K;
        if gatherers.leads() {
            // SAFETY: the stage is free; the barrier is told the weight tile's bytes in this
            // block (an M-pair's partner loads the other half into it) before any lands; thread
            // 0's arrival, made after this in `finish_stage`, keeps the phase open; maps valid.
            unsafe {
                if kb == 0 {
                    name_tile::<V>(ring, *stage, tile);
                    name_work::<V>(ring, *stage, &w);
                }
                mbarrier::expect_tx(full, b_bytes);
                let (maps, b_tile, g) = ((p.map_b, p.map_b2), ring.b_tile(*stage), w.group as i32);
                if w.shares_weights {
                    load_weights::<V>(b_tile, maps, k0 as i32, w.n0, g, full, Some(rank));
                } else if w.has_columns {
                    load_weights::<V>(b_tile, maps, k0 as i32, w.n0, g, full, None);
                }
            }
        }
        // The stage's 64 K values of a row are 8 consecutive chunks in `x`, those below K
        // present (K a multiple of 8).
        let present_chunks = p.k.saturating_sub(k0).div_ceil(8);
        // Each copy's addresses are computed again at each stage from an opaque lane and token:
        // hoisted out of the K loop, the 32 copies' places and the rows' sources overflow the
        // producer's registers and spill.
        let lane = sync::opaque_u32(lane);
        // Rows from `gathered` on (read by no warpgroup) get zeros like rows past the group's
        // end, which spares a branch per row.
        let copy_row = |j: u32, token: u32| {
            let token = sync::opaque_u32(token);
            // SAFETY: copy s places chunk 2s + lane % 2 of row lane / 2 + 16j < 128 of this
            // stage's A tile, free since the `empty` wait; its present chunks lie inside the
            // token's row of `x` (`present_chunks` of the stage's span from column k0).
            unsafe {
                copy_token_chunks(&rows, (token, k0), (a_tile, present_chunks), A_COPIES_PER_TOKEN, |s| {
                    gathered_a_copy(j, s, lane)
                })
            };
        };
        const { assert!(TOKENS_PER_LANE == 8 && A_COPIES_PER_TOKEN == 4) };
        each_token(tokens, first_token, copy_row);
        // SAFETY: every gathering thread, at this stage of its walk.
        unsafe { finish_stage(full, gatherers) };
        ring.advance::<V>(stage, phase);
    }
}

/// A weight-gradient tile's stages (its group's rows, 64 per stage): B gathered by every
/// gathering thread, each warp the K rows of its [`TOKENS_PER_WARP`] tokens per lane, A by
/// thread 0's TMA (through the map cut at the group's end for a last K block that ends inside
/// the group).
///
/// # Safety
/// As [`produce_gathering`], for its tile `tile` (`w`, with K blocks) at its walk's
/// `(stage, phase)`.
#[inline(always)]
unsafe fn gather_weight_gradient_tile<const V: u32>(
    p: &GemmParams,
    ring: Ring,
    rows: RowGather,
    (tile, w): (u32, &Work),
    (stage, phase): (&mut u32, &mut u32),
    gatherers: Gatherers,
) {
    let (lane, first_token) = (gatherers.lane(), gatherers.warp() * TOKENS_PER_WARP as u32);
    let cut_a = p.group_map(w.group, 0);
    if gatherers.leads() && !(w.row_end - w.row_begin).is_multiple_of(TILE_K) {
        // The A map cut at this group's end, written by the group-map kernel through the
        // tensor-map proxy: thread 0, which copies through it, acquires it before the first copy.
        // SAFETY: group < groups; the group-map kernel ran before this launch (caller contract).
        unsafe { tensormap::acquire(cut_a) };
    }
    // The stage's chunks from column n0 on that exist (N a multiple of 8).
    let present_chunks = p.n.saturating_sub(w.n0).div_ceil(8);
    // This lane's K rows (lane / 2) % 8 + 8j of stage `kb` (j from first_token), present
    // below the group's end (so none from stage `k_blocks` on).
    let row_of = |kb: u32, jj: usize| {
        w.row_begin + kb * TILE_K + gathered_b_chunk(B_COPIES_PER_TOKEN * (first_token + jj as u32), lane).0
    };
    let has_token = |row: u32| row < w.row_end;
    // Their slots, loaded and not used: a row past the group's end loads the group's first
    // row's slot (the group has rows: k_blocks > 0) and ignores it.
    let stage_slots = |kb: u32| {
        let mut slots = [0; TOKENS_PER_WARP];
        for (jj, slot) in slots.iter_mut().enumerate() {
            let row = row_of(kb, jj);
            // SAFETY: a row below the group's end, or its first, is a row of the launch's groups.
            *slot = unsafe { rows.slot(if has_token(row) { row } else { w.row_begin }) };
        }
        slots
    };
    // Each stage's slots are loads that its copies' addresses depend on: they are loaded two
    // stages ahead, so their latency is not paid on the producer's path at each stage.
    let mut ahead = [stage_slots(0), stage_slots(1)];
    for kb in 0..w.k_blocks {
        let row = w.row_begin + kb * TILE_K;
        let slots = ahead[0];
        ahead = [ahead[1], stage_slots(kb + 2)];
        // SAFETY: initialised barrier of this block.
        unsafe { mbarrier::wait_parity(ring.empty::<V>(*stage), *phase ^ 1) };
        let (a_tile, b_tile, full) = (ring.a_tile(*stage), ring.b_tile(*stage), ring.full(*stage));
        if gatherers.leads() {
            // SAFETY: the stage is free; the barrier is told A's bytes before any lands, and
            // thread 0's arrival, made after this in `finish_stage`, keeps the phase open; maps
            // valid (the cut one acquired above when this block is a group's partial last one).
            unsafe {
                if kb == 0 {
                    name_tile::<V>(ring, *stage, tile);
                    name_work::<V>(ring, *stage, &w);
                }
                mbarrier::expect_tx(full, A_TILE_BYTES);
                let tail = row + TILE_K > w.row_end;
                let (map_a, r) = if tail { (cut_a, row - w.row_begin) } else { (p.map_a, row) };
                // M-major A: two 64-wide blocks.
                for block in 0..TILE_M / 64 {
                    tma::load_2d(a_tile + block * BLOCK_64_BYTES, map_a, (w.m0 + 64 * block) as i32, r as i32, full);
                }
            }
        }
        // The slots' first use, after the wait.
        let mut tokens = [NO_TOKEN; TOKENS_PER_WARP];
        for (jj, token) in tokens.iter_mut().enumerate() {
            *token = rows.token(slots[jj], has_token(row_of(kb, jj)));
        }
        // The copies of token j's K row (constant j, as for the gate/up's rows), from an opaque
        // lane (as for the gate/up's).
        let lane = sync::opaque_u32(lane);
        let copy_row = |j: u32, token: u32| {
            // SAFETY: copy i places a chunk of K row (lane / 2) % 8 + 8j < 64 of this stage's B
            // tile (one of its column blocks), free since the `empty` wait; its present chunks
            // lie inside the token's row of `x` (`present_chunks` of the tile's columns from n0).
            unsafe {
                copy_token_chunks(&rows, (token, w.n0), (b_tile, present_chunks), B_COPIES_PER_TOKEN, |i| {
                    gathered_b_copy(j, i, lane)
                })
            };
        };
        const { assert!(TOKENS_PER_LANE == 8 && B_COPIES_PER_TOKEN == 8) };
        each_token(tokens, first_token, copy_row);
        // SAFETY: every gathering thread, at this stage of its walk.
        unsafe { finish_stage(full, gatherers) };
        ring.advance::<V>(stage, phase);
    }
}

/// A lane's `copies` chunk copies of one token's row into a stage's tile: copy `c` reads byte
/// `byte` of the token's row of `x` from column `first_column` on and writes `tile + place`
/// (`(byte, place) = chunk(c)`), zeros for a chunk not present (no token, or chunk
/// `present_chunks` or later of the span).
///
/// # Safety
/// Every `tile + place` lies in a stage tile this thread may write (free since its `empty`
/// wait); for a token (not [`NO_TOKEN`]), every present chunk lies inside its row of `x`.
#[inline(always)]
unsafe fn copy_token_chunks(
    rows: &RowGather,
    (token, first_column): (u32, u32),
    (tile, present_chunks): (u32, u32),
    copies: u32,
    chunk: impl Fn(u32) -> (u32, u32),
) {
    let row_source = rows.row_start(token) + 2 * first_column as u64;
    for c in 0..copies {
        let (byte, place) = chunk(c);
        let present = token != NO_TOKEN && byte / 16 < present_chunks;
        // A chunk not present is zeros, read from nowhere (any valid address).
        let src = if present { row_source + byte as u64 } else { rows.x };
        // SAFETY: caller contract.
        unsafe { cp_async::copy_16_or_zeros(tile + place, src, present) };
    }
}

/// `copy_row(first + jj, tokens[jj])` for each of a warp's [`TOKENS_PER_WARP`] tokens, each
/// call spelled out: a loop over the array, even with a constant trip count, put it in local
/// memory in the megakernels.
#[inline(always)]
fn each_token(tokens: [u32; TOKENS_PER_WARP], first: u32, mut copy_row: impl FnMut(u32, u32)) {
    copy_row(first, tokens[0]);
    copy_row(first + 1, tokens[1]);
}

/// The end of a stage with copies, by every gathering thread: each binds its copies to the
/// stage's `full` phase (its expected arrival, made once they land), and thread 0 makes its own
/// arrival, after its `expect_tx` of the stage's TMA bytes. No meeting: the phase counts every
/// thread, and each waits on the stage's `empty` before writing it again.
///
/// # Safety
/// `full` is the stage's initialised barrier, expecting [`full_arrivals`]`(true)`, its current
/// phase awaiting these arrivals; every gathering thread calls it once per stage with copies.
#[inline(always)]
unsafe fn finish_stage(full: u32, gatherers: Gatherers) {
    // SAFETY: caller contract: the phase awaits each thread's arrival and thread 0's.
    unsafe {
        cp_async::arrive_when_landed(full);
        if gatherers.leads() {
            mbarrier::arrive(full);
        }
    }
}

/// A stage without copies (the final [`NO_TILE`], an empty group's weight gradient): every
/// gathering thread waits until it is free, they meet, then thread 0 names `value` in its slot
/// and makes every arrival the phase expects, as the single-thread producer does. The others
/// add nothing, but they must walk each stage together: a thread that skipped the wait could
/// run a whole ring ahead through copy-less stages, where the `empty` parity it waits for next
/// is that of a phase two rounds back, and pass at once into a stage the consumers still read;
/// and without the meeting thread 0 could run two rounds ahead of a slow thread, whose wait
/// would then never pass (both shown by the CPU model in `host/src/gather_ring_model.rs`).
///
/// # Safety
/// As [`produce_gathering`], at its walk's `(stage, phase)`: every gathering thread calls it, in
/// uniform control flow.
#[inline(always)]
unsafe fn copyless_stage<const V: u32>(
    ring: Ring,
    (stage, phase): (u32, u32),
    (value, work): (u32, Option<&Work>),
    gatherers: Gatherers,
) {
    // SAFETY: initialised barriers of this block (caller contract), every thread at its walk;
    // the meeting has every gathering thread (caller contract).
    unsafe {
        mbarrier::wait_parity(ring.empty::<V>(stage), phase ^ 1);
        gatherers.meet();
        if gatherers.leads() {
            name_in_copyless_stage::<V>(ring, stage, phase, value, const { full_arrivals(true) }, work);
        }
    }
}
