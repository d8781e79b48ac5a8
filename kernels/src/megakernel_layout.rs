//! The parameter block of the forward megakernel (`mok_sm90_forward` on one GPU,
//! `mok_sm90_forward_ranks` across ranks; see `kernels/src/megakernel/`), shared by host and
//! device, and the arithmetic both sides use to size and check its counters.

use crate::gemm_layout::{GemmParams, TILE_M};
use crate::tiles::group_of_tile;

/// A `silent_*` field's value that injects no fault.
pub const NO_FAULT: u32 = u32::MAX;

/// What one rank's forward pass computes and the counters its roles hand work over through:
/// everything that stays the same from pass to pass (the per-pass values — the token rows, the
/// slot weights and the shared expert's rows — are [`PassInputs`]: kernel arguments on one GPU,
/// so a pass needs no upload and a captured CUDA graph replays it as it is; across ranks fixed
/// heap addresses, written once). Written by the host into device memory once, read by every
/// block of the rank. All pointers are device addresses.
///
/// The counters are per engine M tile (128 rows, numbered over all groups by the engine's tile
/// offsets, `GemmParams::tile_offsets`): the one tile vocabulary of the dispatch, the gate/up
/// GEMM, the down GEMM and the combine.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ForwardParams {
    /// The gate/up engine plan's `GemmParams` (A = `rows`, out = hidden bf16 rows).
    pub gate_up: u64,
    /// The down engine plan's `GemmParams` (A = hidden rows, out = `down_rows`).
    pub down: u64,
    /// `[R]` u32: the slot `t·k + j` each expert-ordered row holds (one GPU: the routing
    /// layout's `row_source`; across ranks the ring map's `ring_source_slot`, a slot of the row's
    /// token owner).
    pub row_source: u64,
    /// `[T·k]` u32: where the combine finds each slot's row, `layout::NO_ROW` when dropped (one
    /// GPU: the row in `down_rows`, `slot_row`; across ranks the slot itself, `slot_self`,
    /// addressing the slot buffer).
    pub slot_row: u64,
    /// `[cap][H]` bf16: the dispatched rows in expert order (the gate/up GEMM's A).
    pub rows: u64,
    /// `[cap][H]` f32: the down projection's rows (the down GEMM's output on one GPU; across
    /// ranks not written, see `exchange`).
    pub down_rows: u64,
    /// `[T][H]` bf16: the layer output.
    pub y: u64,
    /// `[M tiles]` u32: the dispatch chunks of that M tile copied into `rows` this pass (each
    /// counted by its warp with a release; all there at [`row_chunks_complete`]); cleared in
    /// stream order before the pass.
    pub rows_dispatched: u64,
    /// `[M tiles]` u32: the gate/up tile parts stored per M tile (one per N tile and consumer
    /// warpgroup with rows); cleared in stream order before the pass.
    pub gate_up_stored: u64,
    /// `[M tiles]` u32: the same for the down tiles (on one GPU the combine waits on it);
    /// cleared before the pass.
    pub down_stored: u64,
    /// One u32: the next token of the combine to hand out; cleared before the pass.
    pub combine_next: u64,
    /// One u32: the next dispatch chunk to hand out ([`ROW_CHUNKS_PER_M_TILE`] per M tile,
    /// the shared expert's first); cleared before the pass.
    pub dispatch_next: u64,
    /// `comm::params::ERROR_WORDS` u32: the pass's first failure (`comm::error` format); with
    /// ranks, the rank's record in the symmetric heap.
    pub error: u64,
    /// With expert-parallel ranks, this rank's `comm::params::ExchangeParams` (the symmetric heap:
    /// where the dispatch reads the token owners' rows and where the down tiles' epilogues push
    /// the finished rows: the owners' `combine_slots`, flagged in their `slot_ready`; `down_rows`
    /// is then not written); 0 on a single GPU, where the rows come from the pass's x and the
    /// combine reads `down_rows` in place.
    pub exchange: u64,
    /// How long a wait on the dispatch may take, in `%globaltimer` nanoseconds (waits further
    /// downstream get longer: [`downstream_deadline`]).
    pub timeout_ns: u64,
    /// The shared expert's gate/up engine plan (`GemmParams`: one group holding the pass's T
    /// tokens, A = `shared_x`, out = its hidden rows and pre-activations), or 0 when the pass
    /// has no shared expert (then every `shared_*` field is unused).
    pub shared_gate_up: u64,
    /// The shared expert's down plan (A = its hidden rows, out = the f32 rows the combine adds
    /// first: `PassInputs::shared_rows`).
    pub shared_down: u64,
    /// `[cap][H]` bf16: the token rows copied for the shared gate/up (x is a per-pass input and
    /// its tensor map needs a fixed address).
    pub shared_x: u64,
    /// `[shared M tiles]` u32: the dispatch chunks of that tile's token rows copied into
    /// `shared_x` (complete at [`row_chunks_complete`]); cleared before the pass.
    pub shared_dispatched: u64,
    /// `[shared M tiles]` u32: the shared gate/up parts stored per M tile; cleared before the
    /// pass.
    pub shared_gate_up_stored: u64,
    /// `[shared M tiles]` u32: the shared down parts stored per M tile; cleared before the pass.
    pub shared_down_stored: u64,
    /// Slots per token k, at most [`MAX_COMBINE_SLOTS`].
    pub top_k: u32,
    /// Hidden width H (a multiple of 8).
    pub hidden: u32,
    /// Blocks `0 .. comm_blocks` of the rank only move rows (dispatch, then the combine); the
    /// others (from the next whole pair on) dispatch on their spare producer warps, run the
    /// GEMM tiles (across ranks the down tiles push their rows), then combine. 0: every block
    /// computes.
    pub comm_blocks: u32,
    /// Fault injection (tests): an M tile whose rows are gathered but never published, or
    /// [`NO_FAULT`].
    pub silent_rows_tile: u32,
    /// Fault injection (tests): an M tile whose gate/up parts are stored but never counted, or
    /// [`NO_FAULT`].
    pub silent_hidden_tile: u32,
    /// Which work the pass does ([`WORK_ALL`] in a real pass): the benchmark's overlap
    /// measurement times the launch with only the row moving ([`WORK_COPY_ROWS`] |
    /// [`WORK_COMBINE`]) and with only the GEMMs (rows already in place).
    pub work: u32,
    /// The rank these parameters act as (0 on a single GPU).
    pub rank: u32,
    /// Fault injection across ranks (tests): anything but [`NO_FAULT`] makes this rank's down
    /// tiles push their rows but never raise their `slot_ready` flags.
    pub silent_push: u32,
    /// Its place among the ranks the launch hosts (0 on a single GPU; the launch's parameter
    /// blocks are an array in this order).
    pub launch_index: u32,
    /// Ranks whose GEMM tiles the launch's compute blocks share: 1, a rank's tiles run on its
    /// own compute blocks; P (every rank hosted by one launch: virtual ranks on one GPU), every
    /// compute block takes every rank's tiles from their counters, phase by phase, rank after
    /// rank, so the launch works through one rank's tiles at a time — the walk, and the L2
    /// working set, of one GPU running one rank. The compute blocks' spare warps then dispatch
    /// every rank's rows in the same order (`megakernel::comm::in_walk_order!`); the comm
    /// blocks' dispatch and the combine stay on the rank's own blocks. Each tile is still
    /// computed whole by one block, so the bits do not depend on it.
    pub tile_ranks: u32,
    /// One GPU only, nonzero: the routed gate/up tiles' producers gather their rows from the
    /// pass's x through `row_source` (`gemm::gather`), so the dispatch copies no routed row
    /// (only the shared expert's) and `rows` is not written; 0: the rows are dispatched into
    /// `rows` (always across ranks).
    pub gather_in_producer: u32,
    /// Unused (keeps the block free of padding).
    pub reserved: u32,
}

// The host writes this block byte for byte: twenty-one 8-byte fields, then twelve u32.
const _: () = assert!(size_of::<ForwardParams>() == 216);

/// The one-GPU forward megakernel's four plans, passed by value as a kernel argument (the
/// kernel parameter space, read through the constant cache, which the persistent kernel's
/// fences do not invalidate, where a plan in global memory is read through the L1 they
/// invalidate at every tile), in phase order: the shared expert's gate/up, the routed gate/up,
/// the shared expert's down, the routed down (`gemm::hooks::ForwardHandover`'s numbering). A
/// shared-expert plan is all zeros when the pass has none (`ForwardParams::shared_gate_up` is 0
/// then, which is what the kernel tests).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ForwardPlans {
    /// The plans, by phase.
    pub plans: [GemmParams; 4],
}

// Four 184-byte plans, well inside the 4352 bytes ptxas allows PTX ISA 8.0's kernel parameters.
const _: () = assert!(size_of::<ForwardPlans>() == 4 * 184);

/// Words of one rank's forward pass counters for plans of at most `m_tiles` M tiles: three per
/// M tile for the routed experts (dispatched, gate/up parts, down parts), the two queues
/// (combine, dispatch), then three per M tile for the shared expert.
pub const fn forward_counter_words(m_tiles: usize) -> usize {
    6 * m_tiles + 2
}

/// The per-pass inputs of a megakernel (the backward's are the same four: dy in `x`, the shared
/// expert's dx rows in `shared_rows`): kernel arguments after the parameter block on
/// a single GPU (`mok_sm90_forward`); with expert-parallel ranks (`mok_sm90_forward_ranks`),
/// where every input sits at a fixed address in the symmetric heap, one block per rank in device
/// memory, written once.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassInputs {
    /// `[T][H]` bf16 token rows: x (forward) or dy (backward).
    pub x: u64,
    /// `[T·k]` f32 slot weights.
    pub topk_weights: u64,
    /// `[T][H]` f32, the shared expert's rows added first in each token's sum (its output, or
    /// in the backward its dx rows); 0 for none.
    pub shared_rows: u64,
    /// Tokens T of this pass (at most the capacity the layer's buffers were sized for).
    pub tokens: u32,
    /// Keeps the block a whole number of 8-byte words (no implicit padding); 0.
    pub reserved: u32,
}

const _: () = assert!(size_of::<PassInputs>() == 32);

/// What one rank's backward pass (`mok_sm90_backward`) computes and the counters its roles hand
/// work over through, as [`ForwardParams`] is for the forward: written by the host once per
/// layer buffers and plans, read by every block. The per-pass values are a [`PassInputs`]
/// (`x` = dy, `shared_rows` = the shared expert's f32 dx rows, the first term of each token's dx
/// sum). Counters are per engine M tile, cleared in stream order before the pass.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BackwardParams {
    /// The down projection's data-gradient plan (`Variant::ROWS_NN`, one K segment: A =
    /// `d_rows`, out = the f32 `d_hidden` rows of [`BackwardParams::swiglu`]).
    pub down_dgrad: u64,
    /// The gate/up data-gradient plan (`Variant::ROWS_NN`, two K segments
    /// `[d_gate d_up]·[W_gate; W_up]`, out = `d_in_rows`).
    pub gate_up_dgrad: u64,
    /// The weight-gradient plans, in this order: down (`d_rowsᵀ·hidden`), gate (`d_gateᵀ·rows`),
    /// up (`d_upᵀ·rows`); run as `Variant::WGRAD_IN_PAIR`.
    pub wgrad: [u64; 3],
    /// `[R]` u32: the slot `t·k + j` each expert-ordered row holds.
    pub row_source: u64,
    /// `[T·k]` u32: each slot's row, `layout::NO_ROW` when dropped.
    pub slot_row: u64,
    /// `[cap][H]` f32: the forward's down-projection rows (read for d_topk_weights).
    pub down_rows: u64,
    /// `[cap][H]` bf16: dy gathered into expert order and scaled by the slot weight (written).
    pub d_rows: u64,
    /// `[cap][H]` f32: the gate/up data gradient's rows (the dx combine's slot terms; one GPU
    /// only).
    pub d_in_rows: u64,
    /// `[T][H]` bf16: dx.
    pub dx: u64,
    /// `[T·k]` f32: d_topk_weights (0 for a dropped slot).
    pub d_topk_weights: u64,
    /// `[M tiles]` u32: the gather's row chunks of that M tile written into `d_rows` this pass
    /// (their d_topk_weights too), each counted by its warp with a release; all there at
    /// [`row_chunks_complete`].
    pub rows_gathered: u64,
    /// `[M tiles]` u32: per M tile, the down-dgrad tile parts stored (d_hidden), then one more
    /// per SwiGLU-backward chunk written (d_gate and d_up): complete at [`down_dgrad_complete`].
    pub down_dgrad_stored: u64,
    /// `[M tiles]` u32: the gate/up dgrad tile parts stored per M tile (`d_in_rows`).
    pub gate_up_dgrad_stored: u64,
    /// One u32: the next row chunk of the gather to hand out ([`ROW_CHUNKS_PER_M_TILE`] per M
    /// tile, the shared expert's first).
    pub gather_next: u64,
    /// One u32: the next token of the dx combine to hand out.
    pub combine_next: u64,
    /// `comm::params::ERROR_WORDS` u32: the pass's first failure (`comm::error` format).
    pub error: u64,
    /// How long a wait on the gather may take, in `%globaltimer` nanoseconds (waits further
    /// downstream get longer: [`downstream_deadline`]).
    pub timeout_ns: u64,
    /// Slots per token k, at most [`MAX_COMBINE_SLOTS`].
    pub top_k: u32,
    /// Hidden width H (a multiple of 8).
    pub hidden: u32,
    /// Blocks `0 .. comm_blocks` only move rows (the gather with d_topk_weights, then the dx
    /// combine); the others (from the next whole pair on) gather, run the GEMM tiles, then
    /// combine. 0: every block computes.
    pub comm_blocks: u32,
    /// Fault injection (tests): an M tile whose dy rows are gathered but never published, or
    /// [`NO_FAULT`].
    pub silent_rows_tile: u32,
    /// Fault injection (tests): an M tile whose down-dgrad parts are stored but never counted,
    /// or [`NO_FAULT`].
    pub silent_hidden_tile: u32,
    /// Which work the pass does ([`WORK_ALL`] in a real pass; see [`ForwardParams::work`]).
    pub work: u32,
    /// The rank these parameters act as (0 on a single GPU).
    pub rank: u32,
    /// Its place among the ranks the launch hosts (0 on a single GPU; the launch's parameter
    /// blocks are an array in this order).
    pub launch_index: u32,
    /// Across ranks (`mok_sm90_backward_ranks`), this rank's `comm::params::ExchangeParams`:
    /// where the gather pulls the token owners' dy and slot weights, where the gate/up dgrad
    /// tiles' epilogues push the dx rows (the owners' `dx_slots`, flagged in their
    /// `slot_ready`; `d_in_rows` is then not written) and where the owner's
    /// combine finds its forward slot rows (`combine_slots`, for d_topk_weights); 0 on one GPU.
    pub exchange: u64,
    /// Fault injection across ranks (tests): anything but [`NO_FAULT`] makes this rank's gate/up
    /// dgrad tiles push their dx rows but never flag them.
    pub silent_push: u32,
    /// Across ranks: the first block of the launch that this rank holds, and how many it
    /// holds (its shared expert's weight-gradient tiles, and with `wgrad_ranks` 1 its routed
    /// ones, walk its own compute blocks); 0 and the grid on one GPU.
    pub rank_first_block: u32,
    /// ... and the blocks it holds.
    pub rank_blocks: u32,
    /// Ranks whose routed weight-gradient tiles the launch's compute blocks share: 1, each rank
    /// walks its own on its own blocks; P (every rank hosted by one launch, the same comm blocks
    /// and the same tile count per rank), every compute block of the launch walks the ranks'
    /// tile lists one after the other, phase by phase, as one list — the walk of one GPU
    /// (`weight_gradient_walk`). Each tile is still computed whole by one block, so the bits
    /// do not depend on it.
    pub wgrad_ranks: u32,
    /// Ranks whose data-gradient tiles (the shared expert's and the routed ones) the launch's
    /// compute blocks share, as [`ForwardParams::tile_ranks`]; the compute blocks' gather and
    /// SwiGLU backward chunks then follow the same walk over every rank's queues, the comm
    /// blocks' gather and the combine stay on the rank's own blocks.
    pub tile_ranks: u32,
    /// One GPU only, nonzero: the routed gate and up weight gradients' producers gather B, the
    /// token rows, from the forward's x through `row_source` (`gemm::gather`; x is a kernel
    /// argument): their plans have no map of a gathered copy; 0: they read the copy their maps
    /// name (always across ranks).
    pub gather_in_producer: u32,
    /// The shared expert's down data-gradient plan (A = `shared_dy`, one group of the pass's T
    /// tokens; out = the f32 `d_hidden` of [`BackwardParams::shared_swiglu`]), or 0 when the pass
    /// has no shared expert (then every `shared_*` field is unused).
    pub shared_down_dgrad: u64,
    /// Its gate/up data-gradient plan (out = its f32 dx rows: `PassInputs::shared_rows`, the
    /// first term of each token's dx sum).
    pub shared_gate_up_dgrad: u64,
    /// Its weight-gradient plans, in the order of [`BackwardParams::wgrad`] (down: `dyᵀ·hidden`,
    /// gate and up: `d_gateᵀ·x`, `d_upᵀ·x`, over every token in order).
    pub shared_wgrad: [u64; 3],
    /// `[cap][H]` bf16: dy copied for the shared expert (dy is a per-pass input, and a plan's
    /// tensor maps need a fixed address).
    pub shared_dy: u64,
    /// `[shared M tiles]` u32: the row chunks of that tile's dy rows copied into `shared_dy`
    /// (complete at [`row_chunks_complete`]).
    pub shared_gathered: u64,
    /// `[shared M tiles]` u32: the shared down-dgrad parts stored per M tile.
    pub shared_down_dgrad_stored: u64,
    /// `[shared M tiles]` u32: the shared gate/up-dgrad parts stored per M tile.
    pub shared_gate_up_dgrad_stored: u64,
    /// The rows the SwiGLU backward reads and writes between the two data gradients: the
    /// routed experts'.
    pub swiglu: SwigluBackwardRows,
    /// ... and the shared expert's (unused without one).
    pub shared_swiglu: SwigluBackwardRows,
    /// One u32: the next SwiGLU-backward chunk to hand out (the shared expert's M tiles' chunks
    /// first, then the routed ones', [`SWIGLU_CHUNKS_PER_M_TILE`] per M tile).
    pub swiglu_next: u64,
    /// One u32: the next of this rank's tokens whose slot-weight gradients to compute
    /// (`megakernel::backward::slot_weight_gradients`; on one GPU only with
    /// `early_slot_weight_gradients`).
    pub dots_next: u64,
    /// Nonzero: the compute blocks' spare producer warps take the slot-weight gradients' queue
    /// (`dots_next`) after their SwiGLU chunks, under the GEMM phases, and the dx combine what
    /// is left. 0: across ranks only the dx combine takes it, after the weight gradients; on one
    /// GPU the gather computes them. The bits are the same either way
    /// (`MegakernelOptions::early_slot_weight_gradients` says when each pays).
    pub early_slot_weight_gradients: u32,
    /// Zero: pads the block to whole 8-byte words.
    pub reserved: u32,
    /// `[4]` u32, per expert set (the routed experts', then the shared expert's): the rows the
    /// gather published this pass, then the rows of the down-dgrad parts stored plus the rows of
    /// the SwiGLU chunks written. Each chunk or part adds its rows with a release after its M
    /// tile's count, so a total is complete ([`gathered_total_complete`],
    /// [`swiglu_total_complete`]) exactly when every M tile's count of that kind is. A weight
    /// gradient's producer reads its total once per phase and, when it is complete, waits on no
    /// M tile of the phase. 0: the pass keeps no totals and every weight-gradient tile waits on
    /// its M tiles' counts (`MegakernelOptions::row_totals` says where each pays).
    pub row_totals: u64,
}

impl BackwardParams {
    /// Row total `index` of [`Self::row_totals`] (0 the routed experts' gathered rows, 1 their
    /// SwiGLU rows, 2 and 3 the shared expert's), or null where the pass keeps none.
    #[inline(always)]
    pub fn row_total(&self, index: usize) -> *mut u32 {
        if self.row_totals == 0 { core::ptr::null_mut() } else { (self.row_totals as *mut u32).wrapping_add(index) }
    }
}

/// One expert set's rows of the backward's SwiGLU step, all `[cap][width]` in expert order:
/// the forward's f32 gate and up pre-activations and the down data gradient's f32 `d_hidden`
/// (read), `d_gate` and `d_up` bf16 (written; zero where the forward's clamp was active).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SwigluBackwardRows {
    /// f32 gate pre-activations (read).
    pub gate: u64,
    /// f32 up pre-activations (read).
    pub up: u64,
    /// f32 hidden-row gradients, the down data gradient's output (read).
    pub d_hidden: u64,
    /// bf16 gate gradients (written).
    pub d_gate: u64,
    /// bf16 up gradients (written).
    pub d_up: u64,
    /// The intermediate width (I, or the shared expert's; a multiple of 8).
    pub width: u32,
    /// The forward's SwiGLU limit (+∞: none).
    pub limit: f32,
}

const _: () = assert!(size_of::<SwigluBackwardRows>() == 48);

/// Rows of one SwiGLU-backward chunk: a warp's unit of work. The hand-out numbers
/// [`SWIGLU_CHUNKS_PER_M_TILE`] per M tile; a chunk past a short tile's rows does nothing.
pub const SWIGLU_CHUNK_ROWS: u32 = 16;
/// Chunk numbers per 128-row M tile.
pub const SWIGLU_CHUNKS_PER_M_TILE: u32 = 128 / SWIGLU_CHUNK_ROWS;

/// The `down_dgrad_stored` count at which an M tile of `rows` rows has d_gate and d_up written,
/// the down dgrad having `n_tiles` N tiles: every stored part, then every chunk of the tile's
/// SwiGLU backward. A chunk counts only after it saw every part counted, and a chunk without
/// rows never counts, so the count cannot pass the parts before they are all stored.
pub const fn down_dgrad_complete(n_tiles: u32, rows: u32) -> u32 {
    parts_per_m_tile(n_tiles, rows) + rows.div_ceil(SWIGLU_CHUNK_ROWS)
}

// The host writes this block byte for byte: nineteen 8-byte words, eight u32, one 8-byte word,
// six u32, nine 8-byte words, two 48-byte `SwigluBackwardRows`, two 8-byte words, two u32, one
// 8-byte word.
const _: () = assert!(size_of::<BackwardParams>() == 416);

/// The routed plans the one-GPU backward megakernel copies into shared memory with its parameter
/// block (the two data gradients and the three weight gradients; the shared expert's stay in
/// global memory).
pub const BACKWARD_PLANS_COPIED: usize = 5;

// The copy fits the engine's carve for it, the plans 8-byte aligned after the block.
const _: () = assert!(
    size_of::<BackwardParams>() + BACKWARD_PLANS_COPIED * size_of::<crate::gemm_layout::GemmParams>()
        <= crate::gemm_layout::PARAMS_COPY_BYTES as usize
        && size_of::<BackwardParams>().is_multiple_of(8)
);

/// Words of one rank's backward pass counters for plans of at most `m_tiles` M tiles: three
/// per M tile for the routed experts (gathered, down-dgrad parts, gate/up-dgrad parts), the
/// four queues (gather, combine, the SwiGLU backward, the slot-weight gradients across ranks),
/// the four row totals ([`BackwardParams::row_totals`]), then three per M tile for the shared
/// expert. The queues start [`BACKWARD_QUEUE_WORDS`] words before the totals, and the totals as
/// many before the shared expert's counters, so neither shares a 128-byte L2 line with the
/// other: every chunk and part adds to a total, every claim to a queue.
pub const fn backward_counter_words(m_tiles: usize) -> usize {
    6 * m_tiles + 2 * BACKWARD_QUEUE_WORDS as usize
}

/// The words from the backward's first queue word to its row totals, and from the totals to
/// the shared expert's counters ([`backward_counter_words`]): one 128-byte line.
pub const BACKWARD_QUEUE_WORDS: u64 = 32;

/// Whether an expert set's gathered-row total ([`BackwardParams::row_totals`]) says every row
/// chunk of the set is published: its plan holds `rows` rows. Each chunk adds its own rows, so
/// the total reaches `rows` only with every chunk of every M tile counted.
pub const fn gathered_total_complete(total: u32, rows: u32) -> bool {
    total >= rows
}

/// Whether an expert set's SwiGLU row total ([`BackwardParams::row_totals`]) says every M tile
/// of the set has d_gate and d_up written: its plan holds `rows` rows, its down dgrad `n_tiles`
/// N tiles. Each down-dgrad part adds its rows (`n_tiles` times each row in all) and each
/// SwiGLU chunk its rows (once each), so the total reaches `(n_tiles + 1) · rows` only with
/// every part and chunk counted. Compared in 64 bits: where that product passes `u32::MAX` the
/// total never says complete and the per-tile waits decide.
pub const fn swiglu_total_complete(total: u32, n_tiles: u32, rows: u32) -> bool {
    total as u64 >= (n_tiles as u64 + 1) * rows as u64
}

/// [`ForwardParams::work`]: the dispatch copies the rows (without it, it only publishes them:
/// the rows of an earlier pass are in place).
pub const WORK_COPY_ROWS: u32 = 1;
/// [`ForwardParams::work`]: the compute blocks run the GEMM tiles — in the backward the data
/// gradients' (without it, the combine does not wait for them and sums whatever the rows hold).
pub const WORK_GEMMS: u32 = 2;
/// [`ForwardParams::work`]: the combine runs.
pub const WORK_COMBINE: u32 = 4;
/// Everything: a real pass.
pub const WORK_ALL: u32 = WORK_COPY_ROWS | WORK_GEMMS | WORK_COMBINE | WORK_WEIGHT_GRADS;
/// [`BackwardParams::work`]: the weight-gradient tiles run (without it the backward's compute
/// blocks take none: the benchmark times the data gradients alone; with it but without
/// [`WORK_GEMMS`], they run alone on the data gradients an earlier pass left, their waits on
/// the data gradients skipped).
pub const WORK_WEIGHT_GRADS: u32 = 8;

/// The first block after the comm blocks that starts a compute pair (compute blocks run in
/// 2-block clusters, so a comm count that is odd leaves the last comm block's partner idle).
pub const fn first_compute_block(comm_blocks: u32) -> u32 {
    comm_blocks.next_multiple_of(2)
}

/// The compute pairs of rank `rank` when a launch of `pairs` 2-block clusters hosts `ranks`
/// ranks: `(first pair, pairs)`, contiguous, sizes differing by at most one (rank r holds pairs
/// ⌈r·pairs/P⌉ .. ⌈(r+1)·pairs/P⌉). Every rank holds at least one when `pairs ≥ ranks`.
pub const fn rank_pairs(pairs: u32, ranks: u32, rank: u32) -> (u32, u32) {
    let first = (rank * pairs).div_ceil(ranks);
    let end = ((rank + 1) * pairs).div_ceil(ranks);
    (first, end - first)
}

/// The rank whose pairs hold pair `pair` (the inverse of [`rank_pairs`]).
pub const fn rank_of_pair(pair: u32, pairs: u32, ranks: u32) -> u32 {
    // The last rank r with ⌈r·pairs/P⌉ ≤ pair, i.e. r·pairs ≤ pair·P: r = ⌊pair·P / pairs⌋
    // (exact, since ⌈a/P⌉ ≤ pair ⇔ a ≤ pair·P).
    (pair * ranks) / pairs
}

/// The weight-gradient tiles a compute block walks (`(first, stride)`: it takes
/// `first + i · stride` while below the list's length), for rank `list`'s list of `tiles` tiles
/// when the launch's `compute_blocks` compute blocks walk `lists` ranks' equal lists one after
/// the other and this block is compute block `block` of the launch: list `q` starts at tile
/// `q · tiles` of the walk, and block `b` takes the walk's tiles `b, b + compute_blocks, …`.
pub const fn weight_gradient_walk(block: u32, compute_blocks: u32, list: u32, tiles: u32) -> (u32, u32) {
    let offset = ((list as u64 * tiles as u64) % compute_blocks as u64) as u32;
    ((block + compute_blocks - offset) % compute_blocks, compute_blocks)
}

/// Rows of one row chunk: a warp's unit of the megakernels' row moving — the forward's
/// dispatch, the backward's gather. The hand-out numbers [`ROW_CHUNKS_PER_M_TILE`] per M tile;
/// a chunk past a short tile's rows does nothing.
pub const ROW_CHUNK_ROWS: u32 = 16;
/// Chunk numbers per 128-row M tile.
pub const ROW_CHUNKS_PER_M_TILE: u32 = 128 / ROW_CHUNK_ROWS;

/// The count (`rows_dispatched`, `shared_dispatched` forward; `rows_gathered`,
/// `shared_gathered` backward) at which an M tile of `rows` rows has every row moved: one per
/// row chunk with rows.
pub const fn row_chunks_complete(rows: u32) -> u32 {
    rows.div_ceil(ROW_CHUNK_ROWS)
}

/// What row chunk number `claimed` of a dispatch or gather queue covers: the queue holds
/// [`ROW_CHUNKS_PER_M_TILE`] numbers per M tile, the shared expert's `shared_tiles` M tiles
/// first (its rows are the pass's `tokens` token rows in order), then the routed experts' M
/// tiles (`tile_offsets` and `row_offsets`: a plan's `G + 1` engine tile offsets and row offsets).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RowChunk {
    /// Past the queue's end: every chunk is handed out.
    Spent,
    /// Token rows of the shared expert's M tile.
    Shared {
        /// The shared expert's M tile.
        tile: u32,
        /// The chunk's first token row.
        first: u32,
        /// One past its last (`first` or less past the tile's rows: an empty chunk).
        end: u32,
    },
    /// Rows of the routed experts' M tile.
    Routed {
        /// The M tile, numbered over all groups by the engine's tile offsets.
        tile: u32,
        /// The chunk's first row (of the plan's rows, expert order).
        first: u32,
        /// One past its last (`first` or less past the tile's rows: an empty chunk).
        end: u32,
    },
}

/// See [`RowChunk`].
#[inline(always)]
pub fn row_chunk(claimed: u32, shared_tiles: u32, tokens: u32, tile_offsets: &[u32], row_offsets: &[u32]) -> RowChunk {
    let (tile, chunk) = (claimed / ROW_CHUNKS_PER_M_TILE, claimed % ROW_CHUNKS_PER_M_TILE);
    let m_tiles = tile_offsets[tile_offsets.len() - 1];
    if tile < shared_tiles {
        let first = tile * TILE_M + chunk * ROW_CHUNK_ROWS;
        let end = (first + ROW_CHUNK_ROWS).min((tile + 1) * TILE_M).min(tokens);
        return RowChunk::Shared { tile, first, end };
    }
    if tile - shared_tiles >= m_tiles {
        return RowChunk::Spent;
    }
    let tile = tile - shared_tiles;
    // tile < m_tiles: a group holds it.
    let g = group_of_tile(tile_offsets, tile).unwrap_or(0);
    let tile_first = row_offsets[g] + (tile - tile_offsets[g]) * TILE_M;
    let first = tile_first + chunk * ROW_CHUNK_ROWS;
    let end = (first + ROW_CHUNK_ROWS).min(tile_first + TILE_M).min(row_offsets[g + 1]);
    RowChunk::Routed { tile, first, end }
}

/// Most slots per token the megakernels' combines take: a warp holds a token's slots two per
/// lane (`device::rows::WarpSlots`). The layer's `MAX_TOP_K` is at most this.
pub const MAX_COMBINE_SLOTS: u32 = 64;

/// Stored parts that complete an M tile of `rows` rows in a GEMM of `n_tiles` N tiles: each N
/// tile's consumer warpgroups with rows (64 each) count once.
pub const fn parts_per_m_tile(n_tiles: u32, rows: u32) -> u32 {
    n_tiles * rows.div_ceil(64)
}

/// The deadline of a wait `depth` hand-overs downstream of the dispatch (1: a down tile waiting
/// for its gate/up tiles; 2: the combine waiting for down tiles): `timeout · (2 − 2^-depth)`,
/// longer than every wait upstream of it, so when a counter never completes the failure
/// recorded first is the wait on that counter, not one that waits behind it — and every failure
/// is still reported within twice the deadline.
pub const fn downstream_deadline(timeout_ns: u64, depth: u32) -> u64 {
    timeout_ns + (timeout_ns - (timeout_ns >> depth))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_chunks_cover_every_row_once_and_complete_each_tile_and_total() {
        // Ragged groups (empty ones too), with and without a shared expert: every row of every
        // M tile lies in exactly one chunk of that tile, and the chunks with rows of a tile
        // number row_chunks_complete(its rows), what its waiters expect.
        let cases: [&[u32]; 4] = [&[0, 0, 5, 5, 300, 301], &[0, 128, 256], &[0, 1], &[0, 0, 0]];
        for row_offsets in cases {
            let groups = row_offsets.len() - 1;
            let mut tile_offsets = [0u32; 16];
            crate::tiles::engine_tile_offsets(row_offsets, TILE_M, &mut tile_offsets[..2 * (groups + 1)]);
            let tile_offsets = &tile_offsets[..groups + 1];
            let m_tiles = tile_offsets[groups];
            for (shared_tiles, tokens) in [(0, 0), (3, 300), (1, 1)] {
                let rows = row_offsets[groups] as usize;
                let (mut routed_seen, mut shared_seen) = (vec![0u32; rows], vec![0u32; tokens as usize]);
                let (mut routed_counts, mut shared_counts) =
                    (vec![0u32; m_tiles as usize], vec![0u32; shared_tiles as usize]);
                // The gathered-row totals, as the chunks add their rows.
                let (mut routed_total, mut shared_total) = (0u32, 0u32);
                let mut claimed = 0;
                loop {
                    match row_chunk(claimed, shared_tiles, tokens, tile_offsets, row_offsets) {
                        RowChunk::Spent => break,
                        RowChunk::Shared { tile, first, end } => {
                            if first < end {
                                shared_counts[tile as usize] += 1;
                                assert!(!gathered_total_complete(shared_total, tokens), "complete before a chunk");
                                shared_total += end - first;
                            }
                            (first..end).for_each(|t| shared_seen[t as usize] += 1);
                        }
                        RowChunk::Routed { tile, first, end } => {
                            if first < end {
                                routed_counts[tile as usize] += 1;
                                let rows = row_offsets[groups] - row_offsets[0];
                                assert!(!gathered_total_complete(routed_total, rows), "complete before a chunk");
                                routed_total += end - first;
                            }
                            for r in first..end {
                                routed_seen[r as usize] += 1;
                                let g = crate::tiles::group_of_tile(tile_offsets, tile).unwrap();
                                assert_eq!(
                                    (r - row_offsets[g]) / TILE_M,
                                    tile - tile_offsets[g],
                                    "row {r} in tile {tile}"
                                );
                            }
                        }
                    }
                    claimed += 1;
                }
                assert_eq!(claimed, (shared_tiles + m_tiles) * ROW_CHUNKS_PER_M_TILE);
                assert!(routed_seen.iter().all(|&n| n == 1) && shared_seen.iter().all(|&n| n == 1));
                // Every chunk published: each set's total says so, as every M tile's count does.
                assert!(gathered_total_complete(routed_total, row_offsets[groups] - row_offsets[0]));
                assert!(gathered_total_complete(shared_total, tokens));
                for g in 0..groups {
                    for t in tile_offsets[g]..tile_offsets[g + 1] {
                        let first = row_offsets[g] + (t - tile_offsets[g]) * TILE_M;
                        let tile_rows = (row_offsets[g + 1] - first).min(TILE_M);
                        assert_eq!(
                            routed_counts[t as usize],
                            row_chunks_complete(tile_rows),
                            "{row_offsets:?} tile {t}"
                        );
                    }
                }
                for t in 0..shared_tiles {
                    let tile_rows = (tokens - t * TILE_M).min(TILE_M);
                    assert_eq!(shared_counts[t as usize], row_chunks_complete(tile_rows));
                }
            }
        }
    }

    #[test]
    fn the_swiglu_total_completes_with_the_last_part_or_chunk() {
        // An expert set's M tiles (ragged groups, empty ones too): each down-dgrad part (an N
        // tile × a 64-row half with rows, `parts_per_m_tile` of them per tile) adds its half's
        // rows, each SwiGLU chunk with rows its rows; the total is complete after the last one
        // counted and not before, in any order (here parts first, then chunks, and reversed).
        for (row_offsets, n_tiles) in [(&[0u32, 0, 5, 5, 300, 301][..], 4), (&[0, 128, 256][..], 1), (&[0, 1][..], 8)] {
            let groups = row_offsets.len() - 1;
            let rows = row_offsets[groups] - row_offsets[0];
            let mut units = Vec::new();
            for g in 0..groups {
                let mut first = row_offsets[g];
                while first < row_offsets[g + 1] {
                    let tile_rows = (row_offsets[g + 1] - first).min(TILE_M);
                    let mut parts = 0;
                    for _ in 0..n_tiles {
                        for half in 0..tile_rows.div_ceil(64) {
                            units.push((tile_rows - half * 64).min(64));
                            parts += 1;
                        }
                    }
                    assert_eq!(parts, parts_per_m_tile(n_tiles, tile_rows));
                    let chunks = tile_rows.div_ceil(SWIGLU_CHUNK_ROWS);
                    for c in 0..chunks {
                        units.push((tile_rows - c * SWIGLU_CHUNK_ROWS).min(SWIGLU_CHUNK_ROWS));
                    }
                    assert_eq!(parts + chunks, down_dgrad_complete(n_tiles, tile_rows));
                    first += tile_rows;
                }
            }
            for order in [false, true] {
                let mut total = 0u32;
                let walk: Vec<u32> = if order { units.iter().rev().copied().collect() } else { units.clone() };
                for unit in walk {
                    assert!(!swiglu_total_complete(total, n_tiles, rows), "{row_offsets:?}: complete early");
                    total += unit;
                }
                assert!(swiglu_total_complete(total, n_tiles, rows), "{row_offsets:?}");
            }
        }
        // Past u32 the total never says complete: the per-tile waits decide.
        assert!(!swiglu_total_complete(u32::MAX, 16, 1 << 28));
    }

    #[test]
    fn the_shared_weight_gradient_walk_takes_every_tile_of_every_list_once() {
        for (blocks, lists, tiles) in [(1, 1, 1), (7, 3, 10), (128, 8, 448), (16, 8, 3), (5, 2, 0), (130, 6, 1000)] {
            let mut taken = vec![0u32; (lists * tiles) as usize];
            for block in 0..blocks {
                let mut walked = 0;
                for list in 0..lists {
                    let (first, stride) = weight_gradient_walk(block, blocks, list, tiles);
                    assert_eq!(stride, blocks);
                    let mut tile = first;
                    while tile < tiles {
                        // The same tiles, in the same order, as one walk over the joined lists.
                        assert_eq!((list * tiles + tile) % blocks, block);
                        taken[(list * tiles + tile) as usize] += 1;
                        walked += 1;
                        tile += stride;
                    }
                }
                assert_eq!(walked, (lists * tiles).saturating_sub(block).div_ceil(blocks));
            }
            assert!(taken.iter().all(|&t| t == 1), "{blocks} blocks, {lists} lists of {tiles}");
        }
    }

    #[test]
    fn compute_pairs_start_after_the_comm_blocks() {
        assert_eq!(first_compute_block(0), 0);
        assert_eq!(first_compute_block(1), 2);
        assert_eq!(first_compute_block(2), 2);
        assert_eq!(first_compute_block(7), 8);
        assert_eq!(parts_per_m_tile(28, 128), 56);
        assert_eq!(parts_per_m_tile(28, 64), 28);
        assert_eq!(parts_per_m_tile(3, 65), 6);
        assert_eq!(
            [downstream_deadline(1000, 0), downstream_deadline(1000, 1), downstream_deadline(1000, 2)],
            [1000, 1500, 1750]
        );
    }

    #[test]
    fn ranks_take_contiguous_balanced_pairs() {
        for ranks in 1..=12u32 {
            for pairs in ranks..=70u32 {
                let mut next = 0;
                for rank in 0..ranks {
                    let (first, count) = rank_pairs(pairs, ranks, rank);
                    assert_eq!(first, next, "pairs {pairs} ranks {ranks} rank {rank}");
                    assert!(count == pairs / ranks || count == pairs / ranks + 1);
                    for pair in first..first + count {
                        assert_eq!(rank_of_pair(pair, pairs, ranks), rank, "pair {pair} of {pairs}, {ranks} ranks");
                    }
                    next = first + count;
                }
                assert_eq!(next, pairs);
            }
        }
    }
}
