//! The row-moving work of the forward megakernel: the dispatch (token rows into expert order,
//! 16-row chunks of the engine M tiles from a shared queue, each counted with a release) and the
//! combine (each token's slots summed in fixed order once they are all there).
//!
//! On one GPU ([`ForwardParams::exchange`] = 0) the dispatch reads the pass's x and the combine
//! reads the down rows in place. Across ranks the dispatch pulls from the token owners' x
//! through the symmetric heap's peer mapping (the ring map says which rank and slot each ring
//! row holds) and the combine reads the slot buffer the expert owners' down tiles pushed into
//! from their epilogues (`gemm::hooks::RowScatter`): the same rows summed in the same order, so
//! the bits do not depend on P.

use crate::comm::RankView;
use crate::comm::error::{self, ERROR_TIMEOUT, WAIT_ENGINE_TILE_OUTPUT, WAIT_SHARED_TILE_OUTPUT, WAIT_SLOT_READY};
use crate::comm::params::ExchangeParams;
use crate::comm::schedule::tile_and_rows_of_row;
use crate::comm::wait::{signal, wait_until};
use crate::device::rows::{WarpSlots, copy_row};
use crate::gemm::hooks::slot_row_complete;
use crate::gemm_layout::{GemmParams, TILE_M, TILE_N};
use crate::layout::NO_ROW;
use crate::megakernel_layout::{
    BackwardParams, ForwardParams, PassInputs, RowChunk, WORK_COPY_ROWS, WORK_GEMMS, downstream_deadline,
    parts_per_m_tile, row_chunk,
};
use crate::ptx::memory::{
    atom_add_relaxed_gpu_u32, fence_acq_rel_gpu, fence_acq_rel_sys, ld_relaxed_gpu_u32, ld_relaxed_sys_u32,
};
use crate::ptx::{signal as warp, sreg, sync};

/// A pass's parameter block as the ranks see it: its rank and its exchange parameter block.
pub trait RankParams {
    /// The address of the rank's `ExchangeParams` (0 on one GPU).
    fn exchange(&self) -> u64;
    /// The rank this parameter block belongs to.
    fn rank(&self) -> u32;
}

/// Both passes' parameter blocks name their rank and exchange block by the same fields.
macro_rules! rank_params {
    ($($params:ty),*) => {$(
        impl RankParams for $params {
            #[inline(always)]
            fn exchange(&self) -> u64 {
                self.exchange
            }
            #[inline(always)]
            fn rank(&self) -> u32 {
                self.rank
            }
        }
    )*};
}
rank_params!(ForwardParams, BackwardParams);

/// The rank's view of the symmetric heap across ranks (`RANKS`), else `None`. Decided by `RANKS`,
/// not by `p.exchange()`: the ranks' code then holds no one-GPU branch (the spare warps' dispatch,
/// a called function of 72 registers, spilled with it).
///
/// # Safety
/// With `RANKS`, `p.exchange()` points at the rank's valid `ExchangeParams` for the whole launch.
#[inline(always)]
pub unsafe fn rank_view<const RANKS: bool, P: RankParams>(p: &P) -> Option<RankView<'_>> {
    // SAFETY: caller contract. Said to the compiler too: a view built from an address it cannot
    // see is non-null would keep every `None` branch.
    RANKS.then(|| unsafe {
        core::hint::assert_unchecked(p.exchange() != 0);
        RankView::from_raw(p.exchange() as *const ExchangeParams, p.rank())
    })
}

/// Row work of a launch hosting ranks (the dispatch, the backward's gather and SwiGLU chunks),
/// by a whole warp of a compute block, in the compute walk's order. Where every compute block
/// takes every hosted rank's GEMM tiles (`tile_ranks` > 1: rank after rank in launch order
/// within each phase), the warp works on every hosted rank's queue in that order too: first each
/// rank's shared-expert units (the work, given `until_routed`, returns after the first routed
/// unit it takes of the rank), then each rank's routed units. The rows the walk needs first are
/// then moved first, by every block's warps, as on one GPU; were each block to work on its own
/// rank's queue only, the first rank's tiles, which every compute block takes first, would wait
/// on that rank's blocks alone. Otherwise (each rank's tiles on its own blocks, or one hosted
/// rank) the block's own rank's queue. A unit waits only on its own rank's counters, whichever
/// block's warp takes it, so the work order's argument holds (docs/ARCHITECTURE.md). Units that
/// wait (the SwiGLU chunks) take no routed unit in the first round: given `until_routed` they
/// return before claiming once the rank's shared units are handed out.
///
/// `in_walk_order!(rank, hosted, |p, pass, until_routed| work)`: `rank()` gives the block's
/// `(*const params, PassInputs)`, `hosted(q)` the launch's rank q's (launch order); `work` runs
/// with `p` a rank's parameter block (`&ForwardParams` or `&BackwardParams`), `pass` its inputs
/// and `until_routed`. A macro, not a generic function: written as one, the spare warps' code
/// spilled 116 bytes where this spills 20 (ptxas).
///
/// # Safety
/// Expands to unsafe operations, for an unsafe block whose caller guarantees: every q below
/// `tile_ranks` names a valid parameter block, inputs and exchange block of the launch; all 32
/// lanes run it.
macro_rules! in_walk_order {
    ($rank:expr, $hosted:expr, |$p:ident, $pass:ident, $until_routed:ident| $work:expr) => {{
        let ranks = (*$rank().0).tile_ranks;
        if ranks <= 1 {
            let (params, $pass) = $rank();
            let $p = &*params;
            let $until_routed = false;
            $work;
        } else {
            // One counter over both rounds (the spare warps' registers are few): steps
            // 0 .. ranks take each rank's shared units, steps ranks .. 2 · ranks its routed ones.
            let mut step = 0;
            while step < 2 * ranks {
                let (params, $pass) = $hosted(if step < ranks { step } else { step - ranks });
                let $p = &*params;
                let $until_routed = step < ranks;
                $work;
                step += 1;
            }
        }
    }};
}
pub(super) use in_walk_order;

/// The engine M tile holding `row` of a plan's groups, and the parts that complete it.
///
/// # Safety
/// `p` is a row-grouped plan's parameter block whose offsets were written before the launch;
/// `row` is below its row count.
#[inline(always)]
unsafe fn stored_tile_of_row(p: &GemmParams, row: u32, n_tiles: u32) -> (u32, u32) {
    let groups = p.groups as usize + 1;
    // SAFETY: caller contract: the plan's G + 1 offsets of each kind.
    let (row_offsets, tile_offsets) = unsafe {
        (
            core::slice::from_raw_parts(p.row_offsets as *const u32, groups),
            core::slice::from_raw_parts(p.tile_offsets as *const u32, groups),
        )
    };
    // A row below the row count lies in a group, so the lookup finds it.
    let (tile, rows) = tile_and_rows_of_row(row_offsets, tile_offsets, row, TILE_M).unwrap_or((0, 0));
    (tile, parts_per_m_tile(n_tiles, rows))
}

/// Slots whose counts a lane reads before it compares any ([`acquire_if_counts_reached`]).
const POLLS_IN_FLIGHT: u32 = 8;

/// By a whole warp: whether every slot's count has reached its value, and if so an acquire of
/// them all. `count(j)` is slot j's count and the value that completes it (`None`: nothing to
/// wait for); every lane reads every slot's count (relaxed at GPU or `sys` scope, up to
/// [`POLLS_IN_FLIGHT`] reads in flight), and when all are complete — the same decision on
/// every lane — one acquire fence per lane at that scope makes what their releases published
/// visible to it (relaxed reads that see the release, then the fence: the acquire pattern, each
/// lane for itself). `false`: some count is short, nothing acquired.
///
/// # Safety
/// Every count given is valid at that scope; all 32 lanes call it with the same arguments, in
/// warp-uniform control flow, and `count` may shuffle (it is called for every `j < top_k`, in
/// order, on every lane).
#[inline(always)]
unsafe fn acquire_if_counts_reached(top_k: u32, sys: bool, count: impl Fn(u32) -> Option<(*const u32, u32)>) -> bool {
    let mut reached_all = true;
    let mut first = 0;
    while first < top_k {
        let mut seen = [0u32; POLLS_IN_FLIGHT as usize];
        let mut expected = [0u32; POLLS_IN_FLIGHT as usize];
        for b in 0..POLLS_IN_FLIGHT {
            if first + b < top_k {
                if let Some((counter, value)) = count(first + b) {
                    expected[b as usize] = value;
                    // SAFETY: a valid count (caller contract).
                    seen[b as usize] =
                        unsafe { if sys { ld_relaxed_sys_u32(counter) } else { ld_relaxed_gpu_u32(counter) } };
                }
            }
        }
        for b in 0..POLLS_IN_FLIGHT as usize {
            reached_all &= seen[b] >= expected[b];
        }
        first += POLLS_IN_FLIGHT;
    }
    // Their reads may have seen different counts.
    // SAFETY: all 32 lanes (caller contract).
    if unsafe { sync::ballot(!reached_all) } != 0 {
        return false;
    }
    if sys {
        fence_acq_rel_sys()
    } else {
        fence_acq_rel_gpu()
    }
    true
}

/// One GPU, by a whole warp: a combine's bounded wait until the M tiles holding the routed rows
/// of the token in `slots` are stored (`stored`: the per-M-tile counts of the GEMM whose rows the
/// combine sums, `plan` that GEMM's parameter block); the rows are then visible to every lane.
///
/// Each lane finds the counter and the parts that complete it for its own slots (the searches
/// of all slots side by side), then every lane reads every slot's counter (relaxed, up to
/// [`POLLS_IN_FLIGHT`] reads in flight). When all have reached their parts, one acquire fence
/// per lane makes every row visible to it — a token whose rows are stored costs a few round
/// trips, not one search and one acquire per slot. Otherwise (a tile still running) every lane
/// waits slot by slot with acquire polls, for at most `deadline_ns` each, and a failed wait
/// records `code` with the tile, the parts expected and the count seen.
///
/// # Safety
/// `plan` is a row-grouped plan's parameter block whose offsets were written before the launch,
/// every routed row of `slots` below its row count; `stored` holds a count per M tile of it;
/// `error` is the rank's record; `top_k ≤`
/// [`MAX_COMBINE_SLOTS`](crate::megakernel_layout::MAX_COMBINE_SLOTS); all 32 lanes call it with
/// the same arguments.
#[inline(always)]
pub(super) unsafe fn wait_for_token_rows(
    slots: &WarpSlots,
    (plan, stored): (&GemmParams, *const u32),
    top_k: u32,
    (deadline_ns, error): (u64, *mut u32),
    code: u32,
) {
    // The tile of a slot without a row: nothing to wait for.
    const NO_COUNT: u32 = u32::MAX;
    let n_tiles = plan.n.div_ceil(TILE_N);
    // This lane's slots' M tiles and parts.
    let mut tiles = [NO_COUNT; 2];
    let mut parts = [0u32; 2];
    for half in 0..2 {
        let row = slots.own_row(half);
        if row != NO_ROW {
            // SAFETY: caller contract: a routed row below the plan's row count.
            (tiles[half], parts[half]) = unsafe { stored_tile_of_row(plan, row, n_tiles) };
        }
    }
    // Slot j's tile and parts, for every lane (warp-uniform j).
    let wanted = |j: u32| {
        let half = (j >= 32) as usize;
        // SAFETY: all 32 lanes, the same j (caller contract: warp-uniform calls).
        unsafe { (sync::shfl_idx_u32(tiles[half], j % 32), sync::shfl_idx_u32(parts[half], j % 32)) }
    };
    let count = |j: u32| {
        let (tile, tile_parts) = wanted(j);
        // SAFETY: a count per M tile of the plan (caller contract).
        (tile != NO_COUNT).then(|| (unsafe { stored.add(tile as usize) }, tile_parts))
    };
    // SAFETY: caller contract (the whole warp; `wanted` shuffles for every j in order).
    if unsafe { acquire_if_counts_reached(top_k, false, count) } {
        return;
    }
    for j in 0..top_k {
        let (tile, expected) = wanted(j);
        if tile == NO_COUNT {
            continue;
        }
        // SAFETY: as above; `error` the rank's record.
        unsafe {
            if let Err(seen) = wait_until(stored.add(tile as usize), false, deadline_ns, error, |v| v >= expected) {
                error::record(error, [ERROR_TIMEOUT, code, 0, tile, expected, seen, 0, 0]);
            }
        }
    }
}

/// Dispatch, by a whole warp: row chunks ([`row_chunk`]: 16 rows) taken one at a time from
/// `dispatch_next` — the shared expert's M tiles first (its gate/up phase runs first), then the
/// routed ones, 8 chunk numbers per M tile in increasing order.
/// The warp copies each of the chunk's rows (in expert order) from x — on one GPU the pass's,
/// across ranks the token owner's through the peer mapping — then, after a warp barrier, lane 0
/// adds 1 to the tile's `rows_dispatched` count with a release; the tile's rows are there at
/// [`row_chunks_complete`](crate::megakernel_layout::row_chunks_complete). A chunk past a short tile's rows neither copies nor counts. Across
/// ranks a rank whose error record is set (its schedule failed) copies nothing: the waits on
/// its tiles then stop at once. Waits for nothing, so whatever waits on a dispatched tile waits
/// on work a running warp is already doing. Returns once the chunks are all handed out.
///
/// Comm blocks run it on every warp; compute blocks on their producer warpgroup's spare warps,
/// alongside the GEMM phases, so the first gate/up tiles wait for their own rows only, not for
/// the whole dispatch. With [`ForwardParams::gather_in_producer`] (one GPU) only the shared
/// expert's rows are copied: the routed gate/up reads x itself. With `until_routed` the warp
/// returns after its first routed chunk (or when the queue is spent): the shared expert's chunks
/// of every hosted rank first (`megakernel::forward`'s walk order across ranks).
///
/// # Safety
/// `f` and `pass` are the pass's; the schedule (routing layout, tile offsets) was written before
/// the launch; `view` is [`rank_view`]`(f)`; all 32 lanes call it.
#[inline(always)]
pub unsafe fn dispatch(f: &ForwardParams, pass: &PassInputs, view: Option<&RankView>, until_routed: bool) {
    // SAFETY: caller contract: the gate/up parameter block and the offsets it points at; all 32
    // lanes, which take the same chunks (the claim is broadcast), so every lane reaches each
    // `shfl_idx_u32` and `publish_chunk`.
    unsafe {
        let lane = sreg::lane_id();
        let copy = f.work & WORK_COPY_ROWS != 0 && !view.is_some_and(|_| error::has_error(f.error as *const u32));
        // A rank that copies nothing because of its error publishes nothing either.
        let publish = copy == (f.work & WORK_COPY_ROWS != 0);
        loop {
            let (tile, first, end) =
                match claim_row_chunk(f.dispatch_next, f.gate_up, f.shared_gate_up != 0, pass.tokens, lane) {
                    RowChunk::Spent => return,
                    RowChunk::Shared { tile, first, end } => {
                        // The shared expert's rows are the pass's own tokens, in order.
                        if first < end {
                            copy_token_rows(f.shared_x, pass.x, f.hidden, first..end, copy, lane);
                            publish_chunk(f.shared_dispatched as *mut u32, tile, publish, lane);
                        }
                        continue;
                    }
                    // The routed chunks follow the shared ones: with the gate/up gathering its own
                    // rows there is nothing more to copy.
                    // (One GPU only: across ranks nothing gathers, whatever the flag holds.)
                    RowChunk::Routed { .. } if f.gather_in_producer != 0 && view.is_none() => return,
                    RowChunk::Routed { tile, first, end } => (tile, first, end),
                };
            if first >= end {
                if until_routed {
                    return;
                }
                continue;
            }
            let (rows, row_source) = (f.rows as *mut u16, f.row_source as *const u32);
            let source_rank: *const u32 =
                view.map_or(core::ptr::null(), |v| v.local(v.params.regions.ring_source_rank));
            let mut row = if copy { first } else { end };
            while row < end {
                // The slot this row holds: on its token owner (`row_source` is the ring map's
                // source slots across ranks, the routing layout's slots on one GPU).
                let token = *row_source.add(row as usize) / f.top_k;
                let owner_x = match view {
                    None => pass.x as *const u16,
                    Some(v) => v.peer::<u16>(v.params.regions.x, *source_rank.add(row as usize)),
                };
                // Element offsets in usize: a ring of T · k rows of H passes 2³² elements at
                // kimi's H with T · k above 599 186 rows.
                let hidden = f.hidden as usize;
                let (src, dst) = (owner_x.add(token as usize * hidden), rows.add(row as usize * hidden));
                copy_row(src as *const u32, dst as *mut u32, f.hidden / 8, lane);
                row += 1;
            }
            publish_chunk(f.rows_dispatched as *mut u32, tile, publish && tile != f.silent_rows_tile, lane);
            if until_routed {
                return;
            }
        }
    }
}

/// By a whole warp, when `copy`: the pass's own token rows `tokens` (a shared-expert chunk: its
/// rows are the tokens, in order) into `dst` from `src`, both `[T][hidden]` bf16.
///
/// # Safety
/// `src` and `dst` are 16-byte aligned `[T][hidden]` bf16 rows holding every token of `tokens`;
/// all 32 lanes call it.
#[inline(always)]
pub(super) unsafe fn copy_token_rows(
    dst: u64,
    src: u64,
    hidden: u32,
    tokens: core::ops::Range<u32>,
    copy: bool,
    lane: u32,
) {
    let mut token = if copy { tokens.start } else { tokens.end };
    while token < tokens.end {
        // In usize: T · H may pass 2³² elements.
        let offset = token as usize * hidden as usize;
        // SAFETY: caller contract: the token's row lies in both.
        unsafe {
            let (from, to) = ((src as *const u16).add(offset), (dst as *mut u16).add(offset));
            copy_row(from as *const u32, to as *mut u32, hidden / 8, lane);
        }
        token += 1;
    }
}

/// By a whole warp: the next chunk of a row queue ([`row_chunk`]: the dispatch's, the backward's
/// gather's); lane 0 claims it from the queue's counter `next`, the claim is broadcast. The
/// plan's offsets (`plan`: the first GEMM that reads the rows) and the shared expert's tiles
/// (`with_shared`) are read here, at every claim: held across the copies they did not fit the
/// spare producer warps' 72 registers (ptxas spilled them).
///
/// # Safety
/// `next` is the queue's counter, `plan` a row-grouped plan's parameter block whose offsets were
/// written before the launch, `tokens` the pass's T; all 32 lanes call it.
#[inline(always)]
pub(super) unsafe fn claim_row_chunk(next: u64, plan: u64, with_shared: bool, tokens: u32, lane: u32) -> RowChunk {
    // SAFETY: caller contract; all 32 lanes reach the shuffle.
    unsafe {
        let claimed = if lane == 0 { atom_add_relaxed_gpu_u32(next as *mut u32, 1) } else { 0 };
        let claimed = sync::shfl_idx_u32(claimed, 0);
        let (tile_offsets, row_offsets) = plan_offsets(plan);
        let shared_tiles = if with_shared { tokens.div_ceil(TILE_M) } else { 0 };
        row_chunk(claimed, shared_tiles, tokens, tile_offsets, row_offsets)
    }
}

/// A row-grouped plan's `(tile_offsets, row_offsets)`, `groups + 1` entries each. Read where a
/// chunk is claimed, not held across it: the spare producer warps' 72 registers have no room.
///
/// # Safety
/// `plan` is a row-grouped plan's parameter block whose offsets were written before the launch
/// and stay for `'a`.
#[inline(always)]
pub(super) unsafe fn plan_offsets<'a>(plan: u64) -> (&'a [u32], &'a [u32]) {
    // SAFETY: caller contract.
    unsafe {
        let p = &*(plan as *const GemmParams);
        let groups = p.groups as usize + 1;
        (
            core::slice::from_raw_parts(p.tile_offsets as *const u32, groups),
            core::slice::from_raw_parts(p.row_offsets as *const u32, groups),
        )
    }
}

/// After a warp moved a row chunk of M tile `tile` (dispatch, or the backward's gather): a warp barrier (every lane's stores
/// before lane 0's release), then lane 0 adds 1 to `counts[tile]` with a release at GPU scope
/// when `publish`.
///
/// # Safety
/// `counts` holds an entry per M tile of the pass; all 32 lanes call it.
#[inline(always)]
pub(super) unsafe fn publish_chunk(counts: *mut u32, tile: u32, publish: bool, lane: u32) {
    // SAFETY: all 32 lanes (caller contract).
    unsafe { warp::warp_sync() };
    if lane == 0 && publish {
        // SAFETY: caller contract.
        unsafe { signal(counts.add(tile as usize), 1, false) };
    }
}

/// Across ranks, by a whole warp: whether every routed slot of the token in `slots` already has
/// its whole row in this rank's slot buffer (`flags[j]`, slot j's `slot_ready` flag, at least
/// `whole`), and if so, an acquire of them all. Every lane reads every routed slot's flag
/// (relaxed at the waits' scope, `sys` or GPU, up to [`POLLS_IN_FLIGHT`] reads in flight); when
/// all are whole, one acquire fence per lane at that scope makes every row visible to it and it
/// returns `true`. `false`: a row is still coming (nothing acquired).
///
/// # Safety
/// `flags` holds the token's k flags (valid at that scope); `top_k ≤`
/// [`MAX_COMBINE_SLOTS`](crate::megakernel_layout::MAX_COMBINE_SLOTS); all 32 lanes call it
/// with the same arguments, in warp-uniform control flow.
#[inline(always)]
pub(super) unsafe fn acquire_if_token_rows_pushed(
    slots: &WarpSlots,
    flags: *const u32,
    whole: u32,
    top_k: u32,
    sys: bool,
) -> bool {
    let count = |j: u32| {
        // SAFETY: all 32 lanes, the same j (caller contract); the token's flags.
        (unsafe { slots.row(j) } != NO_ROW).then(|| (unsafe { flags.add(j as usize) }, whole))
    };
    // SAFETY: caller contract.
    unsafe { acquire_if_counts_reached(top_k, sys, count) }
}

/// Across ranks, lane by lane: a combine's bounded wait until every routed slot of token `token`
/// has its whole row in this rank's slot buffer (its `slot_ready` flag at the N tiles of the GEMM
/// whose rows the combine sums, `plan_n` columns: `slot_row_complete`), for when
/// [`acquire_if_token_rows_pushed`] found a row still coming. Each lane polls each slot's flag
/// with acquire loads for at most `downstream_deadline(timeout_ns, depth)`. A wait stops early
/// when the slot's expert owner's error record is set (it will not push: its record names the
/// cause, and this one records nothing), and is skipped once this rank's own record is set (its
/// sum is void, and one silent owner then costs one deadline, not one per slot); a failed wait
/// records `WAIT_SLOT_READY` with the owner, the slot, the flag's expected and seen values and
/// `rank`. The plan's width, the timeout and the rank are references, read where used: taken as
/// values, held across the waits, they made `mok_sm90_forward_ranks` spill 384 bytes.
///
/// # Safety
/// `view` is the rank's; `slot_row` the pass's `[T·k]` slot rows, `token < T`; `error` the
/// rank's record. The lanes need not be converged (no shuffle in here).
#[inline(always)]
pub(super) unsafe fn wait_for_pushes_slot_by_slot(
    view: &RankView,
    (slot_row, token, top_k): (*const u32, u32, u32),
    (plan_n, timeout_ns, depth): (&u32, &u64, u32),
    (error, rank): (*mut u32, &u32),
) {
    // SAFETY: caller contract.
    unsafe {
        // Lane by lane (the lanes may leave their waits apart): no shuffle in here.
        for j in 0..top_k {
            let slot = token * top_k + j;
            // Once this rank has failed its sum is void: no more waiting (each wait would run to
            // its deadline on a silent owner).
            if *slot_row.add(slot as usize) == NO_ROW || error::has_error(error) {
                continue;
            }
            let regions = &view.params.regions;
            let owner = *view.local::<u32>(regions.topk_ids).add(slot as usize) / view.params.local_experts;
            let owner_error = view.peer::<u32>(regions.error, owner);
            let flag = view.local::<u32>(regions.slot_ready).add(slot as usize);
            let (timeout_ns, whole) = (downstream_deadline(*timeout_ns, depth), slot_row_complete(*plan_n));
            if let Err(seen) = wait_until(flag, view.sys(), timeout_ns, owner_error, |x| x >= whole)
                && !error::has_error_at(owner_error, view.sys())
            {
                error::record(error, [ERROR_TIMEOUT, WAIT_SLOT_READY, owner, slot, whole, seen, *rank, 0]);
            }
        }
    }
}

/// A combine's bounded wait (acquire, for at most `deadline_ns`: the caller's
/// `downstream_deadline`) until the shared expert's tiles of `token`'s M tile are all stored
/// (`stored`: the counts of the shared expert's last GEMM before the combine, and that GEMM's
/// plan, whose N tiles complete a tile): its rows are the first term of the token's sum. A
/// failed wait records `code`.
///
/// # Safety
/// The counts and the plan are the pass's (the shared expert's); `token` < `tokens`, the
/// pass's T; `error` is the rank's record.
#[inline(always)]
pub(super) unsafe fn wait_for_shared_tile(
    (stored, plan): (*const u32, *const GemmParams),
    (token, tokens): (u32, u32),
    (deadline_ns, error, rank): (u64, *mut u32, u32),
    code: u32,
) {
    let tile = token / TILE_M;
    // SAFETY: caller contract.
    unsafe {
        let n_tiles = (*plan).n.div_ceil(TILE_N);
        let expected = parts_per_m_tile(n_tiles, (tokens - tile * TILE_M).min(TILE_M));
        let counter = stored.add(tile as usize);
        if let Err(seen) = wait_until(counter, false, deadline_ns, error, |v| v >= expected) {
            error::record(error, [ERROR_TIMEOUT, code, rank, tile, expected, seen, rank, 0]);
        }
    }
}

/// The combine, by a whole warp (comm blocks after their dispatch, compute blocks' consumer
/// warps after their GEMM phases): tokens taken one at a time from `combine_next`; the warp
/// waits (bounded, acquire) until every slot of the token is there — on one GPU until the down
/// tiles holding them are stored ([`wait_for_token_rows`]), across ranks until each slot's
/// `slot_ready` flag says every down tile of its row has pushed its part
/// ([`acquire_if_token_rows_pushed`], else [`wait_for_pushes_slot_by_slot`];
/// [`slot_row_complete`]) — then the warp sums the token's row 4 columns per lane with
/// [`WarpSlots::combine_row`], the slots' rows and weights held in lanes — the shared term
/// first, slots in order — the same arithmetic, and so the same bits, as `mok_combine_slots`.
///
/// Across ranks a wait stops early when the owner's error record is set (it will not push); it
/// then records nothing itself, so the owner's record names the cause. Once this rank's own
/// record is set, its combine waits for nothing more (one silent owner costs one deadline, not
/// one per slot).
///
/// # Safety
/// As [`dispatch`], with `f.top_k ≤`
/// [`MAX_COMBINE_SLOTS`](crate::megakernel_layout::MAX_COMBINE_SLOTS); the caller's warp is
/// whole (all 32 lanes call this).
#[inline(always)]
pub unsafe fn combine(f: &ForwardParams, pass: &PassInputs, view: Option<&RankView>) {
    // SAFETY: caller contract; all 32 lanes, which take the same tokens (the claim is broadcast;
    // the per-lane waits rejoin), so every lane reaches each shuffle and ballot.
    unsafe {
        let down = &*(f.down as *const GemmParams);
        let lane = sreg::lane_id();
        let (slot_row, error) = (f.slot_row as *const u32, f.error as *mut u32);
        loop {
            let claimed = if lane == 0 { atom_add_relaxed_gpu_u32(f.combine_next as *mut u32, 1) } else { 0 };
            let token = sync::shfl_idx_u32(claimed, 0);
            if token >= pass.tokens {
                return;
            }
            let slots = WarpSlots::load(slot_row, pass.topk_weights as *const f32, token, f.top_k, lane);
            // Without GEMMs (the comm side timed alone) the combine sums the rows as they are:
            // the pushes are the down tiles' epilogues.
            match view {
                None if f.work & WORK_GEMMS != 0 => wait_for_token_rows(
                    &slots,
                    (down, f.down_stored as *const u32),
                    f.top_k,
                    (downstream_deadline(f.timeout_ns, 2), error),
                    WAIT_ENGINE_TILE_OUTPUT,
                ),
                None => {}
                Some(_) if f.work & WORK_GEMMS == 0 => {}
                Some(v)
                    if acquire_if_token_rows_pushed(
                        &slots,
                        v.local::<u32>(v.params.regions.slot_ready).add((token * f.top_k) as usize),
                        slot_row_complete(down.n),
                        f.top_k,
                        v.sys(),
                    ) => {}
                Some(v) => wait_for_pushes_slot_by_slot(
                    v,
                    (slot_row, token, f.top_k),
                    (&down.n, &f.timeout_ns, 2),
                    (error, &f.rank),
                ),
            }
            if f.shared_gate_up != 0 && f.work & WORK_GEMMS != 0 && !(view.is_some() && error::has_error(error)) {
                let shared = (f.shared_down_stored as *const u32, f.shared_down as *const GemmParams);
                wait_for_shared_tile(
                    shared,
                    (token, pass.tokens),
                    (downstream_deadline(f.timeout_ns, 2), error, f.rank),
                    WAIT_SHARED_TILE_OUTPUT,
                );
            }
            let rows = match view {
                None => f.down_rows as *const f32,
                Some(v) => v.local::<f32>(v.params.regions.combine_slots),
            };
            slots.combine_row((rows, pass.shared_rows as *const f32), token, f.top_k, f.hidden, f.y as *mut u16, lane);
        }
    }
}
