//! What a persistent kernel adds around each engine tile: a bounded wait before the producer
//! loads a tile's rows, and a signal once a consumer warpgroup's output of the tile is visible.
//!
//! The standalone GEMM kernels run with [`Standalone`], whose hooks are empty, so they compile
//! to the same code as an engine without hooks. [`Counters`] is the hand-over of the
//! megakernel: per engine M tile (the one tile vocabulary: the tile offsets' 128-row tiles,
//! counted over all groups), a `rows_landed` flag that the comm side sets to the pass's epoch
//! once every row of that tile is in place, and a `tiles_stored` count that each consumer
//! warpgroup bumps once its part of the tile's output is visible. The counts are cleared in
//! stream order before the pass (only this GPU's blocks add to them), so a tile of `r` rows with
//! `n` N tiles is complete at `n · ⌈r / 64⌉`.

use crate::comm::error::{
    self, ERROR_TIMEOUT, WAIT_ENGINE_TILE_DISPATCHED, WAIT_ENGINE_TILE_DOWN_DGRAD, WAIT_ENGINE_TILE_GATHERED,
    WAIT_ENGINE_TILE_HIDDEN, WAIT_ENGINE_TILE_ROWS, WAIT_SHARED_TILE_DISPATCHED, WAIT_SHARED_TILE_DOWN_DGRAD,
    WAIT_SHARED_TILE_GATHERED, WAIT_SHARED_TILE_HIDDEN,
};
use crate::comm::params::{ExchangeParams, HeapRegions};
use crate::comm::schedule::epoch_reached;
use crate::comm::wait::{load_acquire, signal, wait_until};
use crate::gemm_layout::{GemmParams, TILE_M, TILE_N, TileCounters, Variant, is_wgrad};
use crate::megakernel_layout::{
    BackwardParams, ForwardParams, NO_FAULT, WORK_GEMMS, WORK_WEIGHT_GRADS, down_dgrad_complete, downstream_deadline,
    first_compute_block, gathered_total_complete, parts_per_m_tile, rank_of_pair, row_chunks_complete,
    swiglu_total_complete, weight_gradient_walk,
};
use crate::ptx::bulk;
use crate::ptx::memory::fence_proxy_async_global;

use super::source::{UNKNOWN_M_TILE, Work, tile_offset};

/// The two places a persistent kernel hooks into a tile.
pub trait TileHooks: Copy {
    /// The producer thread of each block (both blocks of a pair), before the first copy of the
    /// rows of tile `work` (row-grouped variants only). May wait, bounded.
    ///
    /// # Safety
    /// `p` is the launch's valid parameter block and `work` one of its tiles.
    unsafe fn before_rows(&self, p: &GemmParams, work: &Work);

    /// The producer thread of each block, once, at its first tile of a weight-gradient phase:
    /// whether the rows of every tile of the phase are there already (the thread acquired what
    /// says so and fenced the async proxy, which orders all its later copies). Then the
    /// producer skips [`Self::before_rows`] for the whole phase: one acquire and one fence per
    /// block, not one per tile. Never waits. By default `false`: every tile waits as it comes.
    ///
    /// # Safety
    /// Called by the producer thread of a launch whose hooks these are, as
    /// [`Self::before_rows`].
    #[inline(always)]
    unsafe fn phase_ready(&self) -> bool {
        false
    }

    /// The leader thread (thread 0) of consumer warpgroup `wg`, after it committed the last
    /// store of its part of tile `work` (row-grouped variants only).
    ///
    /// # Safety
    /// As [`Self::before_rows`]; called by the thread that issued the tile's bulk stores.
    unsafe fn after_store(&self, p: &GemmParams, work: &Work, wg: u32);

    /// A weight gradient on a persistent kernel's ring (`Variant::WGRAD_IN_PAIR`): this block's
    /// walk over the phase's `tiles` tiles, `(first, stride)`: it takes `first + i · stride`
    /// while below `tiles` (a fixed stride, as the standalone weight gradient walks: its tiles
    /// are a few K blocks long, and an atomic hand-out per tile measured 5–15 % slower,
    /// docs/PERF.md v13). By default the block's index and the grid's size.
    #[inline(always)]
    fn weight_tile_walk(&self, _tiles: u32) -> (u32, u32) {
        (crate::ptx::sreg::block_idx_x(), crate::ptx::sreg::grid_dim_x())
    }

    /// Where the consumers store a row-grouped f32 tile's rows themselves instead of through
    /// the output map ([`RowScatter`]: across ranks, straight into the token owners' slot
    /// buffers). By default `None`: through the map.
    ///
    /// # Safety
    /// As [`Self::before_rows`], for every consumer thread.
    #[inline(always)]
    unsafe fn row_scatter(&self) -> Option<RowScatter> {
        None
    }

    /// Whether the producer hands out none of the phase's tiles (it names [`NO_TILE`] at once:
    /// a benchmark's phase left out). By default it hands out every tile.
    ///
    /// [`NO_TILE`]: crate::gemm_layout::NO_TILE
    #[inline(always)]
    fn takes_no_tiles(&self) -> bool {
        false
    }

    /// Where the producer warpgroup gathers the token rows from (the gate/up's A, the gate and up
    /// weight gradients' B), with per-thread copies instead of TMA boxes of the operand's map
    /// ([`super::gather`]). By default `None`: TMA boxes.
    #[inline(always)]
    fn row_gather(&self) -> Option<RowGather> {
        None
    }

    /// Whether [`Self::row_gather`] can name rows for some phase: a persistent kernel's whole
    /// producer warpgroup then gathers in those phases (its first warp, and its spare warps
    /// once their row moving is done: `gather::GATHER_WARPS`); otherwise
    /// its first thread alone produces.
    const MAY_GATHER_ROWS: bool = false;

    /// Whether the hooks wait on or count per engine M tile: the producer then works each
    /// row-grouped tile's M tile out with the tile ([`Work::with_m_tile`], [`carries_m_tile`])
    /// and hands it to the consumers in the work slot, so a stored count does not look it up
    /// after its fence.
    const COUNTS_BY_M_TILE: bool = false;
}

/// Whether variant `V`'s tiles under hooks `H` carry their M tile ([`Work::with_m_tile`]) from
/// the producer to the consumers in the work slot: row-grouped tiles whose hooks count by it.
/// A weight gradient's tile has no M tile of its plan (its plan's tile offsets may be absent).
pub(super) const fn carries_m_tile<const V: u32, H: TileHooks>() -> bool {
    H::COUNTS_BY_M_TILE && !is_wgrad(V)
}

/// The rows a gathered operand is read from: row `r` of the plan is row
/// `row_source[r] / top_k` of `x` (the routing layout's slot `t · k + j` of the row names its
/// token `t`).
#[derive(Clone, Copy)]
pub struct RowGather {
    /// `[T][W]` bf16 rows, `pitch_bytes` apart (16-byte aligned; W is the plan's `k` for the
    /// gate/up's A, its `n` for the weight gradient's B).
    pub x: u64,
    /// `[rows]` u32: each plan row's slot `t · k + j` (`row_source` of the routing layout).
    pub row_source: *const u32,
    /// k of the routing (slots per token).
    pub top_k: u32,
    /// Bytes between two rows of `x`.
    pub pitch_bytes: u32,
}

impl RowGather {
    /// A one-GPU megakernel pass's rows when its `gather_in_producer` flag is set: the token
    /// rows `x` (`[T][hidden]` bf16, rows packed), in the order of the routing layout's
    /// `row_source` (each row's slot `t · k + j`).
    #[inline(always)]
    fn of_routing(gather_in_producer: u32, x: u64, row_source: u64, (top_k, hidden): (u32, u32)) -> Option<Self> {
        (gather_in_producer != 0).then_some(RowGather {
            x,
            row_source: row_source as *const u32,
            top_k,
            pitch_bytes: 2 * hidden,
        })
    }
}

/// The standalone kernels whose producer gathers the token rows ([`TileHooks::row_gather`]: the
/// gate/up's A, the weight gradient's B); no other hook.
#[derive(Clone, Copy)]
pub struct Gathering(pub RowGather);

impl TileHooks for Gathering {
    const MAY_GATHER_ROWS: bool = true;
    #[inline(always)]
    unsafe fn before_rows(&self, _: &GemmParams, _: &Work) {}
    #[inline(always)]
    unsafe fn after_store(&self, _: &GemmParams, _: &Work, _: u32) {}
    #[inline(always)]
    fn row_gather(&self) -> Option<RowGather> {
        Some(self.0)
    }
}

/// No hooks: the standalone GEMM kernels.
#[derive(Clone, Copy)]
pub struct Standalone;

impl TileHooks for Standalone {
    #[inline(always)]
    unsafe fn before_rows(&self, _: &GemmParams, _: &Work) {}
    #[inline(always)]
    unsafe fn after_store(&self, _: &GemmParams, _: &Work, _: u32) {}
}

/// The push combine fused into an f32 epilogue, across ranks: each row of the tile goes straight
/// from the consumers' registers into its token owner's slot buffer (`rows_region` of the
/// symmetric heap: the forward's `combine_slots`, the backward's `dx_slots`) at the row's slot,
/// and once a warp's rows of the tile are stored each row's `slot_ready` flag on its owner gets
/// 1 with a release. A slot's row is whole when its flag reaches the plan's N tiles
/// ([`slot_row_complete`]). No copy of the f32 rows is left on the expert owner.
#[derive(Clone, Copy)]
pub struct RowScatter {
    /// The rank's exchange parameter block (peer bases, regions, the signals' scope).
    pub exchange: *const ExchangeParams,
    /// Per plan row, its token owner (the ring map's `ring_source_rank`).
    pub owners: *const u32,
    /// Per plan row, the slot it holds on its owner (`row_source`: the ring map's slots).
    pub slots: *const u32,
    /// The slot buffer region the rows go to.
    pub rows_region: u64,
    /// This rank's error record: once it is set the flags stay down (its rows may be stale).
    pub error: *const u32,
    /// False for fault injection: this rank stores its rows but never raises their flags.
    pub raise_flags: bool,
}

impl RowScatter {
    /// The scatter of rank `rank` of a pass (`exchange`: its `ExchangeParams`; `row_source`:
    /// the ring map's slot of each plan row) into the owners' `rows_region` (picked from the
    /// heap's regions), flags raised unless `silent_push` is set; `error`: the rank's record.
    ///
    /// # Safety
    /// `exchange` points at the rank's valid `ExchangeParams` for the whole launch.
    #[inline(always)]
    unsafe fn of_rank(
        (exchange, rank, row_source): (u64, u32, u64),
        rows_region: impl Fn(&HeapRegions) -> u64,
        (error, silent_push): (u64, u32),
    ) -> Self {
        let exchange = exchange as *const ExchangeParams;
        // SAFETY: caller contract.
        let e = unsafe { &*exchange };
        RowScatter {
            exchange,
            owners: e.map(e.regions.ring_source_rank, rank) as *const u32,
            slots: row_source as *const u32,
            rows_region: rows_region(&e.regions),
            error: error as *const u32,
            raise_flags: silent_push == NO_FAULT,
        }
    }
}

/// The `slot_ready` value at which a slot's row, pushed by a [`RowScatter`] epilogue of a plan
/// with `n` output columns, is whole: one raise per N tile.
#[inline(always)]
pub const fn slot_row_complete(n: u32) -> u32 {
    n.div_ceil(TILE_N)
}

/// Readiness counters per engine M tile (see the module docs), from a [`TileCounters`] block in
/// device memory.
#[derive(Clone, Copy)]
pub struct Counters {
    counters: *const TileCounters,
}

impl Counters {
    /// # Safety
    /// `counters` points at a valid [`TileCounters`] for the whole launch.
    #[inline(always)]
    pub unsafe fn new(counters: *const TileCounters) -> Self {
        Self { counters }
    }
}

/// The engine M tile (over all groups) that row-grouped tile `work` starts.
///
/// # Safety
/// `work` is a row-grouped tile of `p` (its group's tile offset is readable).
#[inline(always)]
unsafe fn m_tile(p: &GemmParams, work: &Work) -> u32 {
    if work.m_tile != UNKNOWN_M_TILE {
        return work.m_tile;
    }
    // SAFETY: group < groups (caller contract).
    unsafe { work.with_m_tile(p).m_tile }
}

impl TileHooks for Counters {
    const COUNTS_BY_M_TILE: bool = true;

    #[inline(always)]
    unsafe fn before_rows(&self, p: &GemmParams, work: &Work) {
        // SAFETY: caller contract of `new` and of the hook.
        unsafe {
            let c = &*self.counters;
            let ready = Ready::Epoch { flags: c.rows_landed as *const u32, epoch: c.epoch };
            wait_for_rows(p, work, ready, c.error as *mut u32, c.timeout_ns, c.epoch);
        }
    }

    #[inline(always)]
    unsafe fn after_store(&self, p: &GemmParams, work: &Work, _wg: u32) {
        // SAFETY: caller contract of `new` and of the hook.
        unsafe { count_stored(p, work, (*self.counters).tiles_stored as *mut u32, NO_FAULT) }
    }
}

/// What a tile's rows are ready by: an epoch flag per M tile (rows placed by the comm side; the
/// standalone hooked kernels), a row-chunk count (the megakernels' dispatch and gather,
/// complete at [`row_chunks_complete`]), or the
/// stored-part count per M tile of the GEMM phase that wrote them, complete at
/// [`parts_per_m_tile`]`(n_tiles, rows)` (or, for the backward's d_gate and d_up rows, at
/// [`down_dgrad_complete`]: after the SwiGLU backward's chunks too).
#[derive(Clone, Copy)]
enum Ready {
    /// `flags[m tile]` reaches `epoch` (wrapping).
    Epoch { flags: *const u32, epoch: u32 },
    /// `counts[m tile]` reaches the parts of a GEMM with `n_tiles` N tiles; `code` names the
    /// count in a record.
    Stored { counts: *const u32, n_tiles: u32, code: u32 },
    /// `counts[m tile]` (the backward's `down_dgrad_stored`) reaches [`down_dgrad_complete`].
    SwigluDone { counts: *const u32, n_tiles: u32, code: u32 },
    /// `counts[m tile]` (the forward's `rows_dispatched`, `shared_dispatched`, the backward's
    /// `rows_gathered`, `shared_gathered`) reaches [`row_chunks_complete`]: every row chunk of
    /// the tile moved.
    RowChunks { counts: *const u32, code: u32 },
}

/// Bounded wait of the producer thread until the rows of `work`'s M tile are ready, then the
/// async-proxy fence that orders them before the TMA copies that read them. A failed wait
/// records itself (first failure of the launch wins) in the exchange's record format and the
/// tile then runs on whatever the rows hold: the pass is reported failed, nothing waits forever.
///
/// # Safety
/// `work` is a row-grouped tile of `p`; the counters hold an entry per M tile of the launch and
/// `error` is `ERROR_WORDS` u32.
#[inline(always)]
unsafe fn wait_for_rows(p: &GemmParams, work: &Work, ready: Ready, error: *mut u32, timeout_ns: u64, epoch: u32) {
    // SAFETY: caller contract.
    unsafe {
        let tile = m_tile(p, work);
        let (counter, expected, code) = match ready {
            Ready::Epoch { flags, epoch } => (flags.add(tile as usize), epoch, WAIT_ENGINE_TILE_ROWS),
            Ready::Stored { counts, n_tiles, code } => {
                (counts.add(tile as usize), parts_per_m_tile(n_tiles, work.rows), code)
            }
            Ready::SwigluDone { counts, n_tiles, code } => {
                (counts.add(tile as usize), down_dgrad_complete(n_tiles, work.rows), code)
            }
            Ready::RowChunks { counts, code } => (counts.add(tile as usize), row_chunks_complete(work.rows), code),
        };
        let waited = match ready {
            Ready::Epoch { .. } => wait_until(counter, false, timeout_ns, error, |v| epoch_reached(v, expected)),
            Ready::Stored { .. } | Ready::SwigluDone { .. } | Ready::RowChunks { .. } => {
                wait_until(counter, false, timeout_ns, error, |v| v >= expected)
            }
        };
        // The rows are read by the TMA copies that follow, through the async proxy: order the
        // acquired writes (generic stores of the comm side, or fenced bulk stores) before them.
        fence_proxy_async_global();
        if let Err(seen) = waited {
            error::record(error, [ERROR_TIMEOUT, code, 0, tile, expected, seen, 0, epoch]);
        }
    }
}

/// A consumer warpgroup's leader after its last store of `work`: waits for the bulk stores to
/// complete (not only to have read their staging), fences the async proxy so those writes are
/// ordered before the release, and adds 1 to `counts[m tile]` — unless the tile is
/// `silent_tile` (fault injection: a tile that never completes).
///
/// # Safety
/// `work` is a row-grouped tile of `p`; `counts` holds an entry per M tile of the launch.
#[inline(always)]
unsafe fn count_stored(p: &GemmParams, work: &Work, counts: *mut u32, silent_tile: u32) {
    bulk::wait_group_all();
    fence_proxy_async_global();
    // SAFETY: caller contract.
    unsafe {
        let tile = m_tile(p, work);
        if tile != silent_tile {
            signal(counts.add(tile as usize), 1, false);
        }
    }
}

/// The forward megakernel's hand-over around its GEMM phases, read from the pass's
/// [`ForwardParams`] where used (a pointer, so the producer keeps no counter addresses in its few
/// registers). [`ForwardHandover::GATE_UP`]: a tile waits until its rows' `rows_dispatched`
/// count says every dispatch chunk of its M tile is copied ([`row_chunks_complete`]) and
/// counts its parts in `gate_up_stored` (except `silent_hidden_tile`, fault injection);
/// [`ForwardHandover::DOWN`]: a tile waits until `gate_up_stored` says every gate/up part of its
/// rows is stored and, on one GPU, counts its parts in `down_stored`. The shared expert's two phases
/// ([`ForwardHandover::SHARED_GATE_UP`], [`ForwardHandover::SHARED_DOWN`]) do the same with
/// `shared_dispatched`, `shared_gate_up_stored` and `shared_down_stored`.
///
/// `RANKS`: the launch hosts ranks (`mok_sm90_forward_ranks`); there the down phase's rows leave
/// through [`RowScatter`] into their token owners' `combine_slots`. The hooks are those of the
/// tile's rank, whichever block of the launch runs the tile (`ForwardParams::tile_ranks`).
///
/// On one GPU with [`ForwardParams::gather_in_producer`] the routed gate/up's producers gather
/// their rows from the pass's x ([`TileHooks::row_gather`]) and wait for nothing: nothing is
/// dispatched for them.
#[derive(Clone, Copy)]
pub struct ForwardHandover<const RANKS: bool> {
    params: *const ForwardParams,
    /// Which of the phases below (a runtime value: the phases share one inlined engine loop).
    phase: u32,
    /// The pass's token rows x (`PassInputs::x`; one GPU), where a gathering gate/up reads.
    x: u64,
}

impl ForwardHandover<false> {
    /// The shared expert's gate/up phase (the phases are numbered in the order the megakernel
    /// runs them, `engine::run_forward_phases`).
    pub const SHARED_GATE_UP: u32 = 0;
    /// The gate/up phase.
    pub const GATE_UP: u32 = 1;
    /// The shared expert's down phase.
    pub const SHARED_DOWN: u32 = 2;
    /// The down phase.
    pub const DOWN: u32 = 3;
}

impl<const RANKS: bool> ForwardHandover<RANKS> {
    /// The hand-over of `phase` (one of the constants above), for a pass over the token rows
    /// `x` (read only by a gathering gate/up, on one GPU).
    ///
    /// # Safety
    /// `params` points at the pass's valid [`ForwardParams`] for the whole launch; with `RANKS`
    /// its `exchange` is the rank's valid parameter block; without, and with its
    /// `gather_in_producer` set, `x` is the pass's live `[T][H]` bf16 rows, T the tokens its
    /// routing layout was written for.
    #[inline(always)]
    pub unsafe fn new(params: *const ForwardParams, phase: u32, x: u64) -> Self {
        Self { params, phase, x }
    }
}

impl<const RANKS: bool> TileHooks for ForwardHandover<RANKS> {
    const COUNTS_BY_M_TILE: bool = true;

    // Only on one GPU (across ranks the dispatch pulls every row).
    const MAY_GATHER_ROWS: bool = !RANKS;
    #[inline(always)]
    fn row_gather(&self) -> Option<RowGather> {
        if RANKS || self.phase != ForwardHandover::GATE_UP {
            return None;
        }
        // SAFETY: the pass's parameter block (constructor's contract).
        let f = unsafe { &*self.params };
        RowGather::of_routing(f.gather_in_producer, self.x, f.row_source, (f.top_k, f.hidden))
    }

    #[inline(always)]
    unsafe fn before_rows(&self, p: &GemmParams, work: &Work) {
        // SAFETY: the pass's counters (constructor's contract) and the hook's.
        unsafe {
            let f = &*self.params;
            // The SwiGLU tile writes 128 hidden columns.
            let hidden_n = |plan: u64| (*(plan as *const GemmParams)).n.div_ceil(TILE_N / 2);
            let ready = match self.phase {
                ForwardHandover::GATE_UP => {
                    Ready::RowChunks { counts: f.rows_dispatched as *const u32, code: WAIT_ENGINE_TILE_DISPATCHED }
                }
                ForwardHandover::SHARED_GATE_UP => {
                    Ready::RowChunks { counts: f.shared_dispatched as *const u32, code: WAIT_SHARED_TILE_DISPATCHED }
                }
                ForwardHandover::DOWN => Ready::Stored {
                    counts: f.gate_up_stored as *const u32,
                    n_tiles: hidden_n(f.gate_up),
                    code: WAIT_ENGINE_TILE_HIDDEN,
                },
                _ => Ready::Stored {
                    counts: f.shared_gate_up_stored as *const u32,
                    n_tiles: hidden_n(f.shared_gate_up),
                    code: WAIT_SHARED_TILE_HIDDEN,
                },
            };
            // A down tile's wait is downstream of its gate/up tiles' waits: a longer deadline, so
            // the failure reported first is the cause (`megakernel_layout::downstream_deadline`).
            let first = self.phase == ForwardHandover::GATE_UP || self.phase == ForwardHandover::SHARED_GATE_UP;
            let timeout_ns = if first { f.timeout_ns } else { downstream_deadline(f.timeout_ns, 1) };
            wait_for_rows(p, work, ready, f.error as *mut u32, timeout_ns, 0);
        }
    }

    #[inline(always)]
    unsafe fn row_scatter(&self) -> Option<RowScatter> {
        if !RANKS || self.phase != ForwardHandover::DOWN {
            return None;
        }
        // SAFETY: the pass's parameter block and, with ranks, its exchange's (constructor's
        // contract).
        unsafe {
            let f = &*self.params;
            let place = (f.exchange, f.rank, f.row_source);
            Some(RowScatter::of_rank(place, |r| r.combine_slots, (f.error, f.silent_push)))
        }
    }

    #[inline(always)]
    unsafe fn after_store(&self, p: &GemmParams, work: &Work, _wg: u32) {
        // SAFETY: as above.
        unsafe {
            let f = &*self.params;
            match self.phase {
                ForwardHandover::GATE_UP => count_stored(p, work, f.gate_up_stored as *mut u32, f.silent_hidden_tile),
                // Across ranks the rows went out through `RowScatter`, flagged per row, and
                // nothing waits on `down_stored`: no count.
                ForwardHandover::DOWN if RANKS => {}
                ForwardHandover::DOWN => count_stored(p, work, f.down_stored as *mut u32, NO_FAULT),
                ForwardHandover::SHARED_GATE_UP => count_stored(p, work, f.shared_gate_up_stored as *mut u32, NO_FAULT),
                _ => count_stored(p, work, f.shared_down_stored as *mut u32, NO_FAULT),
            }
        }
    }
}

/// The backward megakernel's hand-over around its GEMM phases, read from the pass's
/// [`BackwardParams`] where used:
/// - [`BackwardHandover::DOWN_DGRAD`] (the down projection's data gradient, d_hidden): a tile
///   waits until its M tile's `rows_gathered` count is complete ([`row_chunks_complete`]) and
///   counts its parts in `down_dgrad_stored`
///   (except `silent_hidden_tile`, fault injection); the SwiGLU backward's chunks of the M
///   tile wait for those parts and count in the same word (`megakernel::backward`);
/// - [`BackwardHandover::GATE_UP_DGRAD`]: a tile waits until `down_dgrad_stored` says its rows'
///   d_gate and d_up are written ([`down_dgrad_complete`]: its A) and counts its parts in
///   `gate_up_dgrad_stored`;
/// - [`BackwardHandover::WGRAD_DOWN`] (`d_rowsᵀ·hidden`): a tile of expert g waits until every
///   M tile of g is gathered; [`BackwardHandover::WGRAD_GATE`] and
///   [`BackwardHandover::WGRAD_UP`] (`d_gateᵀ·rows`, `d_upᵀ·rows`) until every M tile of g has
///   its d_gate and d_up. Nothing in the pass waits for a weight gradient, so those tiles count
///   nothing.
///
/// The shared expert's phases (`SHARED_*`) do the same over its one group with its counters
/// (`shared_gathered`, `shared_down_dgrad_stored`, `shared_gate_up_dgrad_stored`).
///
/// `RANKS`: the launch hosts several ranks (`mok_sm90_backward_ranks`). The hooks are those of
/// the tile's rank (its parameter block), whichever block runs the tile: with
/// `BackwardParams::tile_ranks` > 1 every compute block of the launch takes every rank's
/// data-gradient tiles, and with `BackwardParams::wgrad_ranks` > 1 it walks every rank's routed
/// weight-gradient tiles ([`weight_gradient_walk`]); otherwise a rank's tiles run on its own run
/// of the grid (`BackwardParams::rank_first_block`, `rank_blocks`). The shared expert's weight
/// gradients always walk the rank's own compute blocks.
///
/// On one GPU with [`BackwardParams::gather_in_producer`] the routed gate and up weight
/// gradients' producers gather B, the token rows, from the forward's x
/// ([`TileHooks::row_gather`]) instead of reading the gathered copy.
#[derive(Clone, Copy)]
pub struct BackwardHandover<const RANKS: bool> {
    params: *const BackwardParams,
    /// Which of the phases below (a runtime value, constant where each phase is called).
    phase: u32,
    /// The forward's token rows x (one GPU), where a gathering weight gradient reads B.
    x: u64,
}

impl BackwardHandover<false> {
    /// The shared expert's down data gradient (the phases are numbered in the order the
    /// megakernel runs them, `engine::run_backward_phases`).
    pub const SHARED_DOWN_DGRAD: u32 = 0;
    /// The down projection's data gradient.
    pub const DOWN_DGRAD: u32 = 1;
    /// The shared expert's gate/up data gradient.
    pub const SHARED_GATE_UP_DGRAD: u32 = 2;
    /// The gate/up data gradient.
    pub const GATE_UP_DGRAD: u32 = 3;
    /// The down weight gradient.
    pub const WGRAD_DOWN: u32 = 4;
    /// The gate weight gradient.
    pub const WGRAD_GATE: u32 = 5;
    /// The up weight gradient.
    pub const WGRAD_UP: u32 = 6;
    /// The shared expert's down weight gradient.
    pub const SHARED_WGRAD_DOWN: u32 = 7;
    /// The shared expert's gate weight gradient.
    pub const SHARED_WGRAD_GATE: u32 = 8;
    /// The shared expert's up weight gradient.
    pub const SHARED_WGRAD_UP: u32 = 9;
    /// Phases in all.
    pub const PHASES: u32 = 10;
}

impl<const RANKS: bool> BackwardHandover<RANKS> {
    /// The hand-over of `phase` (one of the constants above), for a pass whose forward read
    /// the token rows `x` (read only by a gathering weight gradient, on one GPU).
    ///
    /// # Safety
    /// `params` points at the pass's valid [`BackwardParams`] for the whole launch; without
    /// `RANKS`, and with its `gather_in_producer` set, `x` is the forward's live `[T][H]` bf16
    /// rows, T the tokens its routing layout was written for.
    #[inline(always)]
    pub unsafe fn new(params: *const BackwardParams, phase: u32, x: u64) -> Self {
        Self { params, phase, x }
    }

    /// Whether this is one of the shared expert's phases.
    #[inline(always)]
    fn shared(&self) -> bool {
        matches!(
            self.phase,
            BackwardHandover::SHARED_DOWN_DGRAD
                | BackwardHandover::SHARED_GATE_UP_DGRAD
                | BackwardHandover::SHARED_WGRAD_DOWN
                | BackwardHandover::SHARED_WGRAD_GATE
                | BackwardHandover::SHARED_WGRAD_UP
        )
    }
}

/// Adds `rows` to a row total ([`BackwardParams::row_total`]) with a release, after the counts
/// it stands for; nothing where the pass keeps no totals (`total` null).
///
/// # Safety
/// `total` is null or a valid, 4-byte aligned global address.
#[inline(always)]
pub(crate) unsafe fn add_to_row_total(total: *mut u32, rows: u32) {
    if !total.is_null() {
        // SAFETY: caller contract.
        unsafe { signal(total, rows, false) };
    }
}

/// The counters of one expert set's backward (the routed experts', or the shared expert's): its
/// down-dgrad plan (whose offsets and N tiles describe the M tiles), its gathered counts, its
/// two stored counts and its two row totals ([`BackwardParams::row_totals`]), with the codes a
/// failed wait records.
#[derive(Clone, Copy)]
struct BackwardCounters {
    down_dgrad: *const GemmParams,
    gathered: *const u32,
    gathered_total: *mut u32,
    swiglu_total: *mut u32,
    down_dgrad_stored: *mut u32,
    gate_up_dgrad_stored: *mut u32,
    gathered_code: u32,
    down_dgrad_code: u32,
}

impl BackwardCounters {
    #[inline(always)]
    fn of(b: &BackwardParams, shared: bool) -> Self {
        if shared {
            Self {
                down_dgrad: b.shared_down_dgrad as *const GemmParams,
                gathered: b.shared_gathered as *const u32,
                gathered_total: b.row_total(2),
                swiglu_total: b.row_total(3),
                down_dgrad_stored: b.shared_down_dgrad_stored as *mut u32,
                gate_up_dgrad_stored: b.shared_gate_up_dgrad_stored as *mut u32,
                gathered_code: WAIT_SHARED_TILE_GATHERED,
                down_dgrad_code: WAIT_SHARED_TILE_DOWN_DGRAD,
            }
        } else {
            Self {
                down_dgrad: b.down_dgrad as *const GemmParams,
                gathered: b.rows_gathered as *const u32,
                gathered_total: b.row_total(0),
                swiglu_total: b.row_total(1),
                down_dgrad_stored: b.down_dgrad_stored as *mut u32,
                gate_up_dgrad_stored: b.gate_up_dgrad_stored as *mut u32,
                gathered_code: WAIT_ENGINE_TILE_GATHERED,
                down_dgrad_code: WAIT_ENGINE_TILE_DOWN_DGRAD,
            }
        }
    }

    /// Down-dgrad parts that complete an M tile: the plan's N tiles (of I) per 64 rows.
    ///
    /// # Safety
    /// The down-dgrad plan is the pass's valid parameter block.
    #[inline(always)]
    unsafe fn down_dgrad_n_tiles(&self) -> u32 {
        // SAFETY: caller contract.
        unsafe { (*self.down_dgrad).n.div_ceil(TILE_N) }
    }
}

impl<const RANKS: bool> TileHooks for BackwardHandover<RANKS> {
    const COUNTS_BY_M_TILE: bool = true;

    // Only on one GPU (across ranks the rows are the ring's).
    const MAY_GATHER_ROWS: bool = !RANKS;

    #[inline(always)]
    fn row_gather(&self) -> Option<RowGather> {
        if RANKS || !(self.phase == BackwardHandover::WGRAD_GATE || self.phase == BackwardHandover::WGRAD_UP) {
            return None;
        }
        // SAFETY: the pass's parameter block (constructor's contract).
        let b = unsafe { &*self.params };
        RowGather::of_routing(b.gather_in_producer, self.x, b.row_source, (b.top_k, b.hidden))
    }

    #[inline(always)]
    unsafe fn before_rows(&self, p: &GemmParams, work: &Work) {
        // SAFETY: the pass's counters (constructor's contract) and the hook's.
        unsafe {
            let b = &*self.params;
            let error = b.error as *mut u32;
            let c = BackwardCounters::of(b, self.shared());
            match self.phase {
                BackwardHandover::SHARED_DOWN_DGRAD | BackwardHandover::DOWN_DGRAD => {
                    let ready = Ready::RowChunks { counts: c.gathered, code: c.gathered_code };
                    wait_for_rows(p, work, ready, error, b.timeout_ns, 0);
                }
                BackwardHandover::SHARED_GATE_UP_DGRAD | BackwardHandover::GATE_UP_DGRAD => {
                    let ready = Ready::SwigluDone {
                        counts: c.down_dgrad_stored as *const u32,
                        n_tiles: c.down_dgrad_n_tiles(),
                        code: c.down_dgrad_code,
                    };
                    wait_for_rows(p, work, ready, error, downstream_deadline(b.timeout_ns, 2), 0);
                }
                phase => {
                    let gathered =
                        phase == BackwardHandover::WGRAD_DOWN || phase == BackwardHandover::SHARED_WGRAD_DOWN;
                    if gathered || b.work & WORK_GEMMS != 0 {
                        wait_for_group(b, &c, work.group, gathered);
                    } else {
                        // The weight gradients alone (a benchmark): no data-gradient tile runs
                        // to count, so read what an earlier pass left.
                        fence_proxy_async_global();
                    }
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn phase_ready(&self) -> bool {
        // The weight gradients only: their phases start once the data gradients' tiles are all
        // taken, when their rows are often all there. Checked once at the phase's first tile, so
        // a phase that starts early waits per tile as without totals and pays one more acquire. The
        // per-tile waits cost ~5.5 ms of qwen 32768's backward across ranks (the down weight
        // gradient's) and ~1 ms on one GPU (the gate and up weight gradients'), though none found
        // its count short (docs/PERF.md, "The weight gradients' waits timed inside the producer").
        let gathered = self.phase == BackwardHandover::WGRAD_DOWN || self.phase == BackwardHandover::SHARED_WGRAD_DOWN;
        let swiglu = self.phase == BackwardHandover::WGRAD_GATE
            || self.phase == BackwardHandover::WGRAD_UP
            || self.phase == BackwardHandover::SHARED_WGRAD_GATE
            || self.phase == BackwardHandover::SHARED_WGRAD_UP;
        // SAFETY: the pass's counters (constructor's contract) and the hook's.
        unsafe {
            let b = &*self.params;
            // The weight gradients alone (a benchmark) wait on the gathered rows only; a pass
            // without totals waits per tile.
            if b.row_totals == 0 || !(gathered || (swiglu && b.work & WORK_GEMMS != 0)) {
                return false;
            }
            let c = BackwardCounters::of(b, self.shared());
            let p = &*c.down_dgrad;
            let offsets = p.row_offsets as *const u32;
            let rows = *offsets.add(p.groups as usize) - *offsets;
            let ready = if gathered {
                gathered_total_complete(load_acquire(c.gathered_total, false), rows)
            } else {
                swiglu_total_complete(load_acquire(c.swiglu_total, false), c.down_dgrad_n_tiles(), rows)
            };
            if ready {
                fence_proxy_async_global();
            }
            ready
        }
    }

    #[inline(always)]
    fn weight_tile_walk(&self, tiles: u32) -> (u32, u32) {
        // The compute blocks: every block of the rank from its first compute pair on (of every
        // rank, in the routed weight gradients shared across ranks).
        // SAFETY: the pass's parameter block (constructor's contract).
        let b = unsafe { &*self.params };
        let first = first_compute_block(b.comm_blocks);
        if b.work & WORK_WEIGHT_GRADS == 0 {
            // No weight-gradient tile for this block (a benchmark's data gradients alone).
            return (u32::MAX, 1);
        }
        if RANKS && b.wgrad_ranks > 1 && !self.shared() {
            // Every compute block of the launch walks the routed lists of all its ranks, this
            // parameter block's rank's after those before it: the walking block's place among
            // the launch's compute blocks (every rank has `first` non-compute blocks ahead of
            // its compute pairs; the walking block's rank need not be this one).
            let (block, grid) = (crate::ptx::sreg::block_idx_x(), crate::ptx::sreg::grid_dim_x());
            let walker = rank_of_pair(block / 2, grid / 2, b.wgrad_ranks);
            let compute_blocks = grid - b.wgrad_ranks * first;
            weight_gradient_walk(block - (walker + 1) * first, compute_blocks, b.launch_index, tiles)
        } else if RANKS {
            (crate::ptx::sreg::block_idx_x() - b.rank_first_block - first, b.rank_blocks - first)
        } else {
            (crate::ptx::sreg::block_idx_x() - first, crate::ptx::sreg::grid_dim_x() - first)
        }
    }

    #[inline(always)]
    fn takes_no_tiles(&self) -> bool {
        // The weight gradients alone (a benchmark): the data gradients' phases take no tile.
        // SAFETY: the pass's parameter block (constructor's contract).
        let b = unsafe { &*self.params };
        b.work & WORK_GEMMS == 0
            && matches!(
                self.phase,
                BackwardHandover::SHARED_DOWN_DGRAD
                    | BackwardHandover::DOWN_DGRAD
                    | BackwardHandover::SHARED_GATE_UP_DGRAD
                    | BackwardHandover::GATE_UP_DGRAD
            )
    }

    #[inline(always)]
    unsafe fn row_scatter(&self) -> Option<RowScatter> {
        if !RANKS || self.phase != BackwardHandover::GATE_UP_DGRAD {
            return None;
        }
        // SAFETY: the pass's parameter block and, across ranks, its exchange's (constructor's
        // contract).
        unsafe {
            let b = &*self.params;
            let place = (b.exchange, b.rank, b.row_source);
            Some(RowScatter::of_rank(place, |r| r.dx_slots, (b.error, b.silent_push)))
        }
    }

    #[inline(always)]
    unsafe fn after_store(&self, p: &GemmParams, work: &Work, wg: u32) {
        // SAFETY: as above.
        unsafe {
            let b = &*self.params;
            let c = BackwardCounters::of(b, self.shared());
            match self.phase {
                BackwardHandover::DOWN_DGRAD | BackwardHandover::SHARED_DOWN_DGRAD => {
                    let silent = if self.shared() { NO_FAULT } else { b.silent_hidden_tile };
                    count_stored(p, work, c.down_dgrad_stored, silent);
                    if m_tile(p, work) != silent {
                        // The part's rows (this warpgroup's half of the M tile) to the set's
                        // SwiGLU row total, after its count.
                        add_to_row_total(c.swiglu_total, (work.rows - wg * 64).min(64));
                    }
                }
                BackwardHandover::SHARED_GATE_UP_DGRAD | BackwardHandover::GATE_UP_DGRAD => {
                    count_stored(p, work, c.gate_up_dgrad_stored, NO_FAULT)
                }
                _ => {}
            }
        }
    }
}

/// The producer of a weight-gradient tile of expert `group` (of the expert set `c` describes):
/// bounded waits until every M tile of the group is gathered (`gathered`: the down weight
/// gradient reads the dy rows) or has its d_gate and d_up written ([`down_dgrad_complete`]: the
/// gate and up weight gradients read them), then the async-proxy fence before the TMA copies. A failed
/// wait records itself like [`wait_for_rows`]' and the tile runs on what the rows hold.
///
/// # Safety
/// `b` is the pass's and `c` one of its expert sets; `group` < its plans' groups.
#[inline(always)]
unsafe fn wait_for_group(b: &BackwardParams, c: &BackwardCounters, group: u32, gathered: bool) {
    // SAFETY: caller contract: the down-dgrad plan's offsets hold G + 1 entries of each kind.
    unsafe {
        let p = &*c.down_dgrad;
        let (first_tile, end_tile) = (tile_offset(p, group), tile_offset(p, group + 1));
        let offsets = p.row_offsets as *const u32;
        let (row_begin, row_end) = (*offsets.add(group as usize), *offsets.add(group as usize + 1));
        let error = b.error as *mut u32;
        let n_tiles = c.down_dgrad_n_tiles();
        for tile in first_tile..end_tile {
            let rows = (row_end - (row_begin + (tile - first_tile) * TILE_M)).min(TILE_M);
            let (counter, expected, code, timeout_ns) = if gathered {
                (c.gathered.add(tile as usize), row_chunks_complete(rows), c.gathered_code, b.timeout_ns)
            } else {
                (
                    (c.down_dgrad_stored as *const u32).add(tile as usize),
                    down_dgrad_complete(n_tiles, rows),
                    c.down_dgrad_code,
                    downstream_deadline(b.timeout_ns, 2),
                )
            };
            if let Err(seen) = wait_until(counter, false, timeout_ns, error, |v| v >= expected) {
                error::record(error, [ERROR_TIMEOUT, code, 0, tile, expected, seen, 0, 0]);
            }
        }
        fence_proxy_async_global();
    }
}

/// Whether variant `V` calls its hooks (the standalone weight gradient reduces over whole groups
/// and has no per-tile readiness; inside the backward megakernel, [`Variant::WGRAD_IN_PAIR`],
/// its tiles wait for their group's rows).
#[inline(always)]
pub(super) const fn hooked(v: u32) -> bool {
    v != Variant::WGRAD
}
