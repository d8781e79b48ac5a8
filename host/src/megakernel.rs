//! The megakernels from the host (kernels/src/megakernel/): their parameter blocks, counters
//! and launches — the forward (`mok_sm90_forward`, `mok_sm90_forward_ranks`) and the backward
//! (`mok_sm90_backward`, `mok_sm90_backward_ranks`), one crate-private pass type for both. A
//! layer switches them on with
//! [`UnfusedLayer::set_forward_megakernel`](crate::unfused::UnfusedLayer::set_forward_megakernel)
//! and [`UnfusedLayer::set_backward_megakernel`](crate::unfused::UnfusedLayer::set_backward_megakernel)
//! (or the `EpLayer` methods of the same names); a pass reads the same engine plans (tile lists,
//! tensor maps) as the engine path and writes the same buffers, so each pass reads what the other
//! wrote whichever way it ran.

use std::time::Duration;

use mok_kernels::comm::params::ERROR_WORDS;
use mok_kernels::gemm_layout::{ENGINE_SMEM_BYTES, ENGINE_THREADS, GemmParams, weight_gradient_tiles};
use mok_kernels::megakernel_layout::{
    BACKWARD_QUEUE_WORDS, BackwardParams, ForwardParams, ForwardPlans, NO_FAULT, PassInputs, SwigluBackwardRows,
    WORK_ALL, backward_counter_words, first_compute_block, forward_counter_words, rank_pairs,
};

use crate::MoeConfig;
use crate::driver::{DeviceBuffer, Gpu, KernelArg, LaunchShape};
use crate::error::{MokError, Result};
use crate::gemm::{
    EnginePlan, GATE_UP_GATHERING_KERNEL, GROUP_MAPS_PLANS_KERNEL, PlanSet, WGRAD_GATHERING_KERNEL, engine_error,
    plain_bytes,
};

/// The forward megakernel's entry point on one GPU.
pub const FORWARD_KERNEL: &str = "mok_sm90_forward";
/// Its entry point hosting every expert-parallel rank of a pass (virtual ranks on one GPU).
pub const FORWARD_RANKS_KERNEL: &str = "mok_sm90_forward_ranks";

/// How a megakernel pass (forward or backward) is laid out on the GPU. Results do not depend on
/// any of it.
#[derive(Clone, Debug, PartialEq)]
pub struct MegakernelOptions {
    /// Blocks, of each rank's share of the launch, that only move rows (the dispatch or the dy
    /// gather, and the combine; every other block also computes); `None`:
    /// [`DEFAULT_COMM_BLOCKS`], except the one-GPU backward of experts at most
    /// [`MAX_NARROW_INTERMEDIATE`] wide, which takes [`NARROW_BACKWARD_COMM_BLOCKS`] when they are at
    /// most an eighth of its blocks.
    pub comm_blocks: Option<u32>,
    /// Blocks of the whole launch; `None`: as many 2-block clusters as can be resident at once.
    /// Must be co-resident (at most that many) and leave every rank at least one compute pair.
    pub blocks: Option<u32>,
    /// How long a wait on the dispatched (or, backward, gathered) rows may take before it is
    /// reported as [`MokError::Timeout`]; the waits downstream of it get up to 1.875× that
    /// (`megakernel_layout::downstream_deadline`), so the wait reported first is the one on the
    /// counter that never completed. At most [`crate::config::MAX_WAIT_NS`] (about 36 years; a
    /// longer one is that). It is a deadline, not a switch: zero does not turn the waits off but
    /// makes every wait that is not met at its first poll a reported timeout.
    pub timeout: Duration,
    /// With several ranks in one launch (virtual ranks on one GPU): `true`, every compute block
    /// takes every rank's GEMM tiles from their counters, rank after rank within each phase, so
    /// the GPU works through one rank's tiles at a time as a GPU running one rank would (its L2
    /// holds one rank's weights and rows, docs/PERF.md); `false`, a rank's tiles run on its own
    /// run of the grid, the same SM share for its dispatch, GEMMs and combine. The routed weight
    /// gradients are shared across ranks either way (when every rank has the same tile counts).
    /// With `true` the compute blocks' spare producer warps (the dispatch, the gather, SwiGLU
    /// backward chunks) and the consumers' SwiGLU backward chunks follow the same walk over
    /// every rank's queues; the comm blocks' row work and every combine stay on the rank's own
    /// blocks. The bits are the same either way. Ignored with one rank per launch.
    pub share_rank_tiles: bool,
    /// Where the backward computes the slot-weight gradients (d_topk_weights, a dot of dy with
    /// the forward's f32 down-projection row per routed slot): `Some(true)`, the compute blocks'
    /// spare producer warps take them after their SwiGLU chunks, under the GEMM phases.
    /// `Some(false)`: across ranks the dx combine, after the weight gradients; on one GPU the
    /// gather, beside its copy of the same dy rows. `None`: early where the routed experts
    /// average at least [`EARLY_SLOT_WEIGHT_GRADIENTS_MIN_ROWS`] rows. The bits are the same
    /// either way.
    pub early_slot_weight_gradients: Option<bool>,
    /// Whether the backward keeps row totals (`BackwardParams::row_totals`): each weight
    /// gradient's producer reads one total at its phase's first tile and, when every row is
    /// there, waits on none of the phase's M tiles. `Some(false)`: every weight-gradient group
    /// waits on its M tiles' counts. `None`: totals where the routed experts average at least
    /// [`ROW_TOTALS_MIN_ROWS`] rows. The bits are the same either way.
    pub row_totals: Option<bool>,
}

impl Default for MegakernelOptions {
    fn default() -> Self {
        Self {
            comm_blocks: None,
            blocks: None,
            timeout: Duration::from_secs(5),
            share_rank_tiles: true,
            early_slot_weight_gradients: None,
            row_totals: None,
        }
    }
}

/// The routed experts' average rows (global tokens · k ÷ experts) from which the backward
/// megakernel computes the slot-weight gradients early by default, one GPU and across ranks
/// ([`MegakernelOptions::early_slot_weight_gradients`]). Early, their reads (dy and the forward's
/// f32 down-projection rows, T·k·H·4 bytes) run beside the GEMM phases instead of in the gather
/// (one GPU), which the down dgrad's tiles wait for, or after the weight gradients (across
/// ranks). Measured on an H100 (docs/PERF.md, "The slot-weight gradients apart from the
/// gather"): at qwen T = 32768 (640 rows an expert) early took 1.0–1.4 ms off forward +
/// backward at P = 8 in three calls and 1.3 ms on one GPU; at T = 8192 (kimi 171 rows, qwen 160,
/// glm 256) it added up to 1.3 ms or stayed level. The threshold sits between them.
pub const EARLY_SLOT_WEIGHT_GRADIENTS_MIN_ROWS: usize = 512;

/// The routed experts' average rows in a pass of `c` (all ranks' tokens · k ÷ experts): what
/// the rules of [`early_slot_weight_gradients`] and [`row_totals`] read.
pub(crate) fn average_rows_per_expert(c: &MoeConfig) -> usize {
    c.tokens_per_rank * c.ep_ranks * c.top_k / c.num_experts.max(1)
}

/// Whether a backward megakernel with `options` computes its slot-weight gradients early for
/// routed experts averaging `rows_per_expert` rows
/// ([`MegakernelOptions::early_slot_weight_gradients`]).
pub(crate) fn early_slot_weight_gradients(options: &MegakernelOptions, rows_per_expert: usize) -> bool {
    options.early_slot_weight_gradients.unwrap_or(rows_per_expert >= EARLY_SLOT_WEIGHT_GRADIENTS_MIN_ROWS)
}

/// The routed experts' average rows from which the backward megakernel keeps row totals by
/// default, one GPU and across ranks ([`MegakernelOptions::row_totals`]). Measured on an H100
/// (docs/PERF.md, "The weight gradients' waits timed inside the producer; row totals instead"):
/// at qwen T = 32768 (640 rows an expert) the totals took the backward from 42.6–43.4 to
/// 36.9–37.0 ms at P = 8 and from 35.7–35.9 to 34.6–34.7 on one GPU; at kimi T = 8192 (171
/// rows) they cost 8–9 ms at P = 8 and up to 9 ms of some one-GPU passes. The totals themselves
/// are not the cost: kimi's ranks backward with its weight gradients' waits removed loses the
/// same (why those waits help there is not located).
pub const ROW_TOTALS_MIN_ROWS: usize = 512;

/// Whether a backward megakernel with `options` keeps row totals for routed experts averaging
/// `rows_per_expert` rows ([`MegakernelOptions::row_totals`]).
pub(crate) fn row_totals(options: &MegakernelOptions, rows_per_expert: usize) -> bool {
    options.row_totals.unwrap_or(rows_per_expert >= ROW_TOTALS_MIN_ROWS)
}

/// The comm blocks used when the options name none: 0, every block dispatches, computes and
/// combines. On one GPU the forward measured fastest with 0 of 0, 2, 4, 8 and 16 comm blocks on
/// the frontier shapes, the backward too on kimi and glm; across ranks (P = 8) 4 per rank in
/// both passes measured slower than 0, and in the backward alone 2 per rank −1 % to +4 % and 4
/// per rank 3–8 % slower (docs/PERF.md). The one exception: [`NARROW_BACKWARD_COMM_BLOCKS`].
pub const DEFAULT_COMM_BLOCKS: u32 = 0;

/// Routed experts at most this wide (intermediate columns) run the one-GPU backward with
/// [`NARROW_BACKWARD_COMM_BLOCKS`] when the options name no comm blocks. The dx combine reads
/// T·k·H f32 values against the backward GEMMs' 12·T·k·H·I FLOPs, so its share of the pass
/// grows as I shrinks; with no comm block it is the last work of every compute block, after
/// the weight gradients, where comm blocks run it under them. Measured (docs/PERF.md, "The comm
/// blocks swept at T = 32768 and in the backward" and "The one-GPU backward's comm blocks chosen
/// by the experts' width", H100 calls): qwen (I = 1024) 2–12 % faster backwards with 4 comm
/// blocks, kimi and glm (I = 2048) up to 2.7 % slower.
pub const MAX_NARROW_INTERMEDIATE: usize = 1024;

/// The one-GPU backward's comm blocks for experts at most [`MAX_NARROW_INTERMEDIATE`] wide.
pub const NARROW_BACKWARD_COMM_BLOCKS: u32 = 4;

/// The options a one-GPU backward pass of routed experts `intermediate` wide, averaging
/// `rows_per_expert` rows, runs with on a GPU holding `resident` blocks at once: `options`,
/// except that where they name no comm blocks it takes [`NARROW_BACKWARD_COMM_BLOCKS`] when the
/// experts are at most [`MAX_NARROW_INTERMEDIATE`] wide and those are at most an eighth of the
/// launch's blocks (a small grid keeps its compute blocks), else [`DEFAULT_COMM_BLOCKS`]; and
/// where they leave the slot-weight gradients' placement or the row totals open, the rules of
/// [`early_slot_weight_gradients`] and [`row_totals`]. Results do not depend on any of these
/// choices.
pub(crate) fn one_gpu_backward_options(
    options: &MegakernelOptions,
    intermediate: usize,
    rows_per_expert: usize,
    resident: u32,
) -> MegakernelOptions {
    let mut chosen = options.clone();
    if options.comm_blocks.is_none() {
        let blocks = options.blocks.unwrap_or(resident);
        let narrow = intermediate <= MAX_NARROW_INTERMEDIATE && 8 * NARROW_BACKWARD_COMM_BLOCKS <= blocks;
        chosen.comm_blocks = Some(if narrow { NARROW_BACKWARD_COMM_BLOCKS } else { DEFAULT_COMM_BLOCKS });
    }
    chosen.early_slot_weight_gradients = Some(early_slot_weight_gradients(options, rows_per_expert));
    chosen.row_totals = Some(row_totals(options, rows_per_expert));
    chosen
}

/// Faults a test can inject into the next passes of one rank (feature `testing`; set per pass:
/// `set_forward_megakernel_faults`, `set_backward_megakernel_faults`): an M tile whose rows are
/// copied but never published, and one whose intermediate-width rows are stored but never
/// counted. (Across ranks, a rank whose pushes never arrive is the exchange's `Silence::Push`,
/// which both megakernels honour too.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MegakernelFaults {
    /// The comm side never publishes this M tile's rows (forward: dispatched x; backward:
    /// gathered dy).
    pub silent_rows_tile: Option<u32>,
    /// The compute side never counts this M tile's intermediate-width parts (forward: the
    /// gate/up tiles' hidden rows, so its down tiles wait; backward: the down dgrad's d_gate and
    /// d_up, so its gate/up dgrad and weight-gradient tiles wait).
    pub silent_hidden_tile: Option<u32>,
}

/// Which work a megakernel pass does (set with `UnfusedLayer::set_forward_megakernel_work` or
/// `set_backward_megakernel_work`, feature `testing`; the benchmark's overlap measurement). Only
/// [`MegakernelWork::ALL`] computes the layer; the others time one side of the pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MegakernelWork(pub(crate) u32);

impl MegakernelWork {
    /// A real pass.
    pub const ALL: Self = Self(WORK_ALL);
    /// Only the row moving: the dispatch (backward: the dy gather with the slot-weight
    /// gradients) copies, and the combine runs without waiting for GEMM tiles, summing whatever
    /// the rows hold.
    pub const COMM_ONLY: Self =
        Self(mok_kernels::megakernel_layout::WORK_COPY_ROWS | mok_kernels::megakernel_layout::WORK_COMBINE);
    /// Only the GEMM tiles, on rows left in place by an earlier pass (the dispatch or gather
    /// publishes without copying; no combine).
    pub const COMPUTE_ONLY: Self =
        Self(mok_kernels::megakernel_layout::WORK_GEMMS | mok_kernels::megakernel_layout::WORK_WEIGHT_GRADS);
    /// Nothing but the hand-out of the first queue: the schedule and an empty launch.
    pub const NONE: Self = Self(0);
    /// The backward without its weight-gradient tiles (the rest as in a real pass): the
    /// benchmark's share of the weight gradients.
    pub const WITHOUT_WEIGHT_GRADS: Self = Self(WORK_ALL & !mok_kernels::megakernel_layout::WORK_WEIGHT_GRADS);
    /// The backward's weight-gradient tiles alone, on the rows and data gradients an earlier
    /// pass left (the gather publishes without copying; no data-gradient tile, no combine).
    pub const WEIGHT_GRADS_ONLY: Self = Self(mok_kernels::megakernel_layout::WORK_WEIGHT_GRADS);
}

/// A megakernel pass of a layer: the parameter blocks (one per rank, fixed for the layer's
/// buffers and plans; on one GPU they name the layer's [`ErrorRecord`]), the pass counters and
/// the launch geometry, for the
/// forward ([`ForwardMegakernel`], 2 plans) or the backward ([`BackwardMegakernel`], 5 plans).
pub(crate) struct MegakernelPass<P> {
    /// The entry points: one GPU, and every rank in one launch.
    kernels: [&'static str; 2],
    host: Vec<P>,
    params: DeviceBuffer<u8>,
    /// With ranks, every rank's [`PassInputs`] (fixed heap addresses), written once.
    inputs: Option<DeviceBuffer<u8>>,
    /// Per rank: three `[M tiles]` counters, the queue words (two forward, three backward) and
    /// the shared expert's counters (see each pass's parameter block), cleared together (one
    /// memset) before each pass.
    pass_counters: DeviceBuffer<u32>,
    blocks: u32,
    /// The plans each rank's parameter block points at (their parameter blocks' addresses).
    built_for: Vec<Vec<u64>>,
    /// Those plans, whose group maps one launch cuts before each pass.
    plan_set: PlanSet,
}

/// The forward megakernel's pass.
pub(crate) type ForwardMegakernel = MegakernelPass<ForwardParams>;
/// The backward megakernel's pass.
pub(crate) type BackwardMegakernel = MegakernelPass<BackwardParams>;

/// What the shared pass code sets in a megakernel's parameter block.
pub(crate) trait PassParams: Copy {
    fn comm_blocks(&self) -> u32;
    /// The work of the pass.
    fn work(&self) -> u32;
    /// The work of the pass (test and benchmark hooks only).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    fn set_work(&mut self, work: u32);
    /// The fault injections of [`MegakernelFaults`] ([`NO_FAULT`] for none; tests only).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    fn set_silent_tiles(&mut self, rows_tile: u32, hidden_tile: u32);
    fn silent_push(&mut self) -> &mut u32;
    /// Whether the one-GPU entry point takes the forward's token rows after the pass inputs
    /// (the backward's: its weight gradients may gather them).
    const TAKES_TOKEN_ROWS: bool;
}

/// Both parameter blocks name these fields alike.
macro_rules! pass_params {
    ($(($params:ty, $rows:expr)),*) => {$(
        impl PassParams for $params {
            fn comm_blocks(&self) -> u32 {
                self.comm_blocks
            }
            fn work(&self) -> u32 {
                self.work
            }
            fn set_work(&mut self, work: u32) {
                self.work = work;
            }
            fn set_silent_tiles(&mut self, rows_tile: u32, hidden_tile: u32) {
                (self.silent_rows_tile, self.silent_hidden_tile) = (rows_tile, hidden_tile);
            }
            fn silent_push(&mut self) -> &mut u32 {
                &mut self.silent_push
            }
            const TAKES_TOKEN_ROWS: bool = $rows;
        }
    )*};
}
pass_params!((ForwardParams, false), (BackwardParams, true));

/// Where one rank's parameter block points, from the shared pass set-up.
struct RankSlot {
    /// The rank's pass counters and the bytes of one `[M tiles]` counter.
    counters: u64,
    tile_words: u64,
    /// The rank's `ExchangeParams` (0 on one GPU), its number and its error record.
    exchange: u64,
    rank: u32,
    error: u64,
    /// The rank's run of the grid: first block and blocks.
    first_block: u32,
    blocks: u32,
}

/// The layer buffers a pass reads and writes, besides the plans', for one rank.
pub(crate) struct PassBuffers {
    /// `[R]` the slot each expert-ordered row holds (with ranks: the ring map's source slots).
    pub row_source: u64,
    /// `[T·k]` the row of each slot (with ranks: the slot itself, `slot_self`, addressing the
    /// slot buffer).
    pub slot_row: u64,
    /// `[cap][H]` bf16 dispatched rows (the gate/up plan's A); unread when the gate/up plan
    /// gathers its rows (then the layer's empty copy).
    pub rows: u64,
    /// `[cap][H]` f32 down rows (the down plan's output on one GPU; across ranks the down tiles
    /// push into the owners' slot buffers instead and this is not written).
    pub down_rows: u64,
    /// `[T][H]` bf16 output.
    pub y: u64,
    /// k, H.
    pub top_k: u32,
    pub hidden: u32,
    /// With expert-parallel ranks: the rank's place in the symmetric heap.
    pub rank: Option<RankPass>,
    /// With a shared expert run inside the pass: its buffers (its plans come after the routed
    /// ones).
    pub shared: Option<SharedPassBuffers>,
}

/// The buffers of a shared expert run inside a forward pass, besides its plans'.
pub(crate) struct SharedPassBuffers {
    /// `[cap][H]` bf16: where the dispatch copies the pass's token rows (the shared gate/up's A).
    pub x_rows: u64,
}

/// One rank's part of a pass across ranks.
pub(crate) struct RankPass {
    /// The rank's `ExchangeParams` on this GPU.
    pub exchange: u64,
    pub rank: u32,
    /// The rank's error record in the heap.
    pub error: u64,
    /// The rank's inputs (heap addresses, and its shared expert's rows).
    pub inputs: PassInputs,
}

/// Blocks of a launch of the megakernel entry `kernel` that can be resident on `gpu` at once
/// (whole 2-block clusters, at most one block per SM).
pub(crate) fn resident_blocks(gpu: &Gpu, kernel: &'static str) -> Result<u32> {
    gpu.set_max_dynamic_smem(kernel, ENGINE_SMEM_BYTES)?;
    let clusters = gpu.max_active_clusters(kernel, ENGINE_THREADS, ENGINE_SMEM_BYTES, 2)?;
    Ok((2 * clusters).min(gpu.multiprocessors().next_multiple_of(2)))
}

/// The launch's `(blocks, comm blocks per rank)` for `options` when `resident` blocks fit at once
/// and the launch hosts `ranks` ranks, or why that geometry cannot run: every block resident,
/// whole pairs, and each rank's share (whole pairs, sizes differing by at most one) holding its
/// comm blocks and a compute pair.
pub(crate) fn checked_geometry(resident: u32, options: &MegakernelOptions, ranks: u32) -> Result<(u32, u32)> {
    let blocks = options.blocks.unwrap_or(resident);
    let comm_blocks = options.comm_blocks.unwrap_or(DEFAULT_COMM_BLOCKS);
    if blocks > resident || !blocks.is_multiple_of(2) {
        return Err(MokError::InvalidInput {
            tensor: "megakernel blocks",
            problem: format!(
                "{blocks}: the pass needs every block resident at once, in 2-block clusters (at most {resident} here, even)"
            ),
        });
    }
    // The smallest rank's share of the grid.
    let rank_blocks = 2 * (blocks / 2 / ranks.max(1));
    // Compared before rounding, which would overflow near `u32::MAX`.
    if comm_blocks >= rank_blocks || first_compute_block(comm_blocks) + 2 > rank_blocks {
        return Err(MokError::InvalidInput {
            tensor: "megakernel comm blocks",
            problem: format!(
                "{comm_blocks} comm blocks per rank with {rank_blocks} blocks for the smallest of {ranks} ranks \
                 ({blocks} in all): the comm blocks, rounded up to a pair, must leave every rank a compute pair"
            ),
        });
    }
    Ok((blocks, comm_blocks))
}

/// The checks and the allocations shared by both passes' constructors: one rank without ranks
/// (one GPU) or every rank's buffers with their heap places, the entry point loaded, the
/// geometry resident; then the counters and, per rank, what its parameter block points at
/// (`make`; on one GPU with `error_record`'s address, without ranks' records in the heap).
#[allow(clippy::too_many_arguments)]
fn build_pass<P: PassParams>(
    gpu: &Gpu,
    kernels: [&'static str; 2],
    plans: &[&[&EnginePlan]],
    ranks_of: &[Option<&RankPass>],
    options: &MegakernelOptions,
    error_record: Option<&ErrorRecord>,
    words_per_m_tiles: fn(usize) -> usize,
    make: impl Fn(usize, RankSlot, u32, u64) -> P,
) -> Result<MegakernelPass<P>> {
    let with_ranks = ranks_of.first().is_some_and(Option::is_some);
    if with_ranks == error_record.is_some() {
        return Err(MokError::InvalidInput {
            tensor: "megakernel",
            problem: "a pass on one GPU records its failures in the layer's error record, a pass over ranks in \
                      the heap's"
                .into(),
        });
    }
    let kernel = kernels[with_ranks as usize];
    if plans.len() != ranks_of.len()
        || ranks_of.is_empty()
        || ranks_of.iter().any(|r| r.is_some() != with_ranks)
        || (!with_ranks && ranks_of.len() != 1)
    {
        return Err(MokError::InvalidInput {
            tensor: "megakernel",
            problem: format!("{} plan sets for {} ranks' buffers", plans.len(), ranks_of.len()),
        });
    }
    if let Some(missing) = [kernel, GROUP_MAPS_PLANS_KERNEL].into_iter().find(|k| !gpu.has_kernel(k)) {
        return Err(MokError::InvalidInput {
            tensor: "megakernel",
            problem: format!("the loaded PTX has no {missing} (it needs sm_90a)"),
        });
    }
    let ranks = ranks_of.len() as u32;
    let (blocks, comm_blocks) = checked_geometry(resident_blocks(gpu, kernel)?, options, ranks)?;
    let m_tiles = plans.iter().flat_map(|set| set.iter()).map(|p| p.max_m_tiles()).max().unwrap_or(0).max(1);
    let words = words_per_m_tiles(m_tiles);
    let pass_counters = DeviceBuffer::from_slice(gpu, &vec![0u32; words * ranks as usize])?;
    let timeout_ns = crate::config::wait_ns(options.timeout);
    let host: Vec<P> = ranks_of
        .iter()
        .enumerate()
        .map(|(r, place)| {
            let (exchange, rank, error) = match (place, error_record) {
                (Some(rank), _) => (rank.exchange, rank.rank, rank.error),
                (None, Some(record)) => (0, 0, record.address()),
                (None, None) => unreachable!("checked above: a pass without ranks is given a record"),
            };
            // The rank's run of the grid (whole pairs, `rank_pairs`).
            let (first_pair, pairs) = rank_pairs(blocks / 2, ranks, r as u32);
            let slot = RankSlot {
                counters: pass_counters.device_ptr() + 4 * (r * words) as u64,
                tile_words: 4 * m_tiles as u64,
                exchange,
                rank,
                error,
                first_block: 2 * first_pair,
                blocks: 2 * pairs,
            };
            make(r, slot, comm_blocks, timeout_ns)
        })
        .collect();
    // SAFETY: both parameter blocks are repr(C) plain data without padding (sizes asserted in
    // megakernel_layout).
    let params = DeviceBuffer::from_slice(gpu, &unsafe { blocks_bytes(&host) })?;
    let inputs = if with_ranks {
        let inputs: Vec<PassInputs> = ranks_of.iter().filter_map(|r| r.map(|r| r.inputs)).collect();
        // SAFETY: PassInputs is repr(C) plain data, three u64 and two u32 (32 bytes, asserted
        // in megakernel_layout): no padding.
        Some(DeviceBuffer::from_slice(gpu, &unsafe { blocks_bytes(&inputs) })?)
    } else {
        None
    };
    Ok(MegakernelPass {
        kernels,
        host,
        params,
        inputs,
        pass_counters,
        blocks,
        built_for: plans.iter().map(|set| plan_addresses(set)).collect(),
        plan_set: PlanSet::new(gpu, plans.iter().flat_map(|set| set.iter().copied()))?,
    })
}

impl ForwardMegakernel {
    /// The pass of one rank (`buffers.len() == 1`, a single GPU or one rank per GPU) or of
    /// every virtual rank in one launch; `plans[r]` are rank r's gate/up and down plans, then,
    /// when `buffers[r].shared` is given, its shared expert's gate/up and down plans. On one
    /// GPU the pass records its failures in `error_record` (over ranks: `None`, the heap's),
    /// which must outlive every launch of the pass.
    pub(crate) fn new(
        gpu: &Gpu,
        plans: &[&[&EnginePlan]],
        buffers: &[PassBuffers],
        options: &MegakernelOptions,
        error_record: Option<&ErrorRecord>,
    ) -> Result<Self> {
        // Per rank, whether its routed gate/up gathers its rows (its `gather_in_producer`).
        let gathers: Vec<bool> = plans
            .iter()
            .zip(buffers)
            .map(|(set, b)| {
                let kernels: Vec<&str> = set.iter().map(|p| p.kernel()).collect();
                forward_plan_kernels(&kernels, b.shared.is_some(), b.rank.is_some())
            })
            .collect::<Result<_>>()?;
        let ranks_of: Vec<Option<&RankPass>> = buffers.iter().map(|b| b.rank.as_ref()).collect();
        let tile_ranks = shared_tile_ranks(&ranks_of, plans, options);
        let kernels = [FORWARD_KERNEL, FORWARD_RANKS_KERNEL];
        let words = forward_counter_words;
        build_pass(gpu, kernels, plans, &ranks_of, options, error_record, words, |r, at, comm_blocks, timeout_ns| {
            let (set, b, counters, tile_words) = (plans[r], &buffers[r], at.counters, at.tile_words);
            // After the routed counters and the two queue words: the shared expert's three.
            let shared_counters = counters + 3 * tile_words + 8;
            let shared = |i: usize| if b.shared.is_some() { set[i].params_ptr() } else { 0 };
            let shared_counter = |i: u64| if b.shared.is_some() { shared_counters + i * tile_words } else { 0 };
            ForwardParams {
                gate_up: set[0].params_ptr(),
                down: set[1].params_ptr(),
                row_source: b.row_source,
                slot_row: b.slot_row,
                rows: b.rows,
                down_rows: b.down_rows,
                y: b.y,
                rows_dispatched: counters,
                gate_up_stored: counters + tile_words,
                down_stored: counters + 2 * tile_words,
                combine_next: counters + 3 * tile_words,
                dispatch_next: counters + 3 * tile_words + 4,
                error: at.error,
                timeout_ns,
                exchange: at.exchange,
                shared_gate_up: shared(2),
                shared_down: shared(3),
                shared_x: b.shared.as_ref().map_or(0, |s| s.x_rows),
                shared_dispatched: shared_counter(0),
                shared_gate_up_stored: shared_counter(1),
                shared_down_stored: shared_counter(2),
                top_k: b.top_k,
                hidden: b.hidden,
                comm_blocks,
                silent_rows_tile: NO_FAULT,
                silent_hidden_tile: NO_FAULT,
                work: WORK_ALL,
                rank: at.rank,
                silent_push: NO_FAULT,
                launch_index: r as u32,
                tile_ranks,
                // One GPU only (checked above).
                gather_in_producer: u32::from(gathers[r]),
                reserved: 0,
            }
        })
    }
}

/// The parameter-block addresses of `plans`, in order: what a pass is built for (a one-GPU
/// layer keeps its passes by them).
pub(crate) fn plan_addresses(plans: &[&EnginePlan]) -> Vec<u64> {
    plans.iter().map(|plan| plan.params_ptr()).collect()
}

impl<P: PassParams> MegakernelPass<P> {
    /// Whether this pass was built for these plans (one set per rank), by their parameter
    /// blocks' addresses. A plan set dropped and built again may land at the same addresses and
    /// match; that is sound, as the pass reads every plan through those blocks at run time and
    /// its other buffers are the layer's own, fixed while the pass lives (a new shared expert's
    /// plans drop the passes; so does switching the gathering, which changes the plans' kind,
    /// the pass's `gather_in_producer` taken from them, and the gathered copy `PassBuffers::rows`
    /// names).
    pub(crate) fn built_for(&self, plans: &[&[&EnginePlan]]) -> bool {
        self.built_for.len() == plans.len()
            && self
                .built_for
                .iter()
                .zip(plans)
                .all(|(b, p)| b.iter().copied().eq(p.iter().map(|plan| plan.params_ptr())))
    }

    /// Whether the passes copy the rows (a real pass; not when a benchmark's work mask leaves
    /// them out).
    pub(crate) fn copies_rows(&self) -> bool {
        self.host.iter().all(|p| p.work() & mok_kernels::megakernel_layout::WORK_COPY_ROWS != 0)
    }

    /// Blocks of the launch, and of them the comm blocks (of each rank).
    pub(crate) fn geometry(&self) -> (u32, u32) {
        (self.blocks, self.host[0].comm_blocks())
    }

    /// Uploads the parameter blocks again after a hook changed them.
    fn upload_params(&mut self) -> Result<()> {
        // SAFETY: as in `build_pass`.
        self.params.upload(&unsafe { blocks_bytes(&self.host) })
    }

    /// Sets the work of the following passes (benchmarks).
    #[cfg(feature = "testing")]
    pub(crate) fn set_work(&mut self, work: MegakernelWork) -> Result<()> {
        for rank in &mut self.host {
            rank.set_work(work.0);
        }
        self.upload_params()
    }

    /// Sets the faults of `rank` for the following passes (tests).
    #[cfg(feature = "testing")]
    pub(crate) fn set_faults(&mut self, rank: usize, faults: MegakernelFaults) -> Result<()> {
        let ranks = self.host.len();
        let Some(params) = self.host.get_mut(rank) else {
            return Err(MokError::InvalidInput {
                tensor: "rank",
                problem: format!("rank {rank} is not below the pass's {ranks} ranks"),
            });
        };
        params.set_silent_tiles(
            faults.silent_rows_tile.unwrap_or(NO_FAULT),
            faults.silent_hidden_tile.unwrap_or(NO_FAULT),
        );
        self.upload_params()
    }

    /// Which local ranks push their rows but never flag them (the exchange's `Silence::Push`
    /// fault; all `false` in a real run): the parameter blocks are uploaded again only when this
    /// changes.
    pub(crate) fn set_silent_pushes(&mut self, silent: &[bool]) -> Result<()> {
        let mut changed = false;
        for (params, &silent) in self.host.iter_mut().zip(silent) {
            let value = if silent { 1 } else { NO_FAULT };
            changed |= *params.silent_push() != value;
            *params.silent_push() = value;
        }
        if changed { self.upload_params() } else { Ok(()) }
    }

    /// Checks the plans and enqueues what precedes every pass: cuts every plan's group maps
    /// (zeroing their tile counters), all in one launch, and clears the pass counters.
    fn prepare_pass(&mut self, gpu: &Gpu, plans: &[&[&EnginePlan]]) -> Result<()> {
        if !self.built_for(plans) {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: "built for other engine plans".into(),
            });
        }
        // SAFETY: the set holds exactly these plans (checked above), alive for the call.
        unsafe { self.plan_set.cut_group_maps(gpu) }?;
        self.pass_counters.fill_bytes(0)
    }

    fn shape(&self) -> LaunchShape {
        LaunchShape { grid: (self.blocks, 1, 1), threads: ENGINE_THREADS, smem_bytes: ENGINE_SMEM_BYTES }
    }

    /// Enqueues one pass on one GPU of `tokens` tokens (at most the layer's capacity): cuts
    /// every plan's group maps (zeroing their tile counters), clears the pass counters, then the
    /// megakernel.
    ///
    /// # Safety
    /// `rows` `[T][H]` bf16 (x forward, dy backward), `topk_weights` `[T·k]` f32 and
    /// `shared_rows` `[T][H]` f32 (the shared expert's output or dx rows; 0 for none) must be
    /// live allocations that stay allocated until the stream has run the pass: the kernel reads
    /// them unchecked; so must `token_rows`, the forward's x `[T][H]` bf16, for a backward
    /// whose weight gradients gather (otherwise unread, and a forward ignores it); and the
    /// [`ErrorRecord`] the pass was built with, whose address its parameter block holds.
    pub(crate) unsafe fn launch(
        &mut self,
        gpu: &Gpu,
        plans: &[&EnginePlan],
        (rows, topk_weights, shared_rows, tokens): (u64, u64, u64, u32),
        token_rows: u64,
    ) -> Result<()> {
        if self.inputs.is_some() {
            return Err(MokError::InvalidInput { tensor: "megakernel", problem: "built for ranks".into() });
        }
        self.prepare_pass(gpu, &[plans])?;
        // The forward's entry point takes its four plans by value after its parameter block, in
        // phase order (`ForwardPlans`): the shared gate/up, the gate/up, the shared down, the
        // down; the plans arrive as gate/up, down, then the shared expert's two, if any.
        let forward_plans = (!P::TAKES_TOKEN_ROWS).then(|| {
            let plan = |i: usize| plans.get(i).map_or_else(GemmParams::default, |p| *p.host_params());
            ForwardPlans { plans: [plan(2), plan(0), plan(3), plan(1)] }
        });
        // SAFETY: `ForwardPlans` is repr(C) plain data without padding (four 184-byte plans).
        let plan_bytes = forward_plans.as_ref().map(|p| unsafe { plain_bytes(p) });
        let args = [
            KernelArg::Ptr(self.params.device_ptr()),
            KernelArg::Ptr(rows),
            KernelArg::Ptr(topk_weights),
            KernelArg::Ptr(shared_rows),
            KernelArg::U32(tokens),
            KernelArg::Ptr(token_rows),
        ];
        let forward_args;
        // The backward's entry point takes the token rows last; the forward's ends before them.
        let args = match plan_bytes {
            Some(bytes) => {
                forward_args = [args[0], KernelArg::Bytes(bytes), args[1], args[2], args[3], args[4]];
                &forward_args[..]
            }
            None => &args[..],
        };
        // SAFETY: `mok_sm90_forward`'s and `mok_sm90_backward`'s parameters in order and type;
        // the parameter block points at the layer's live buffers and the plans' parameter blocks
        // (checked above), its counters hold an entry per M tile the plans' groups can have,
        // cleared above on the stream; the grid is co-resident (checked when built); the caller
        // keeps the rows, the weights and the shared rows alive until the stream has run the
        // pass.
        unsafe { gpu.launch(self.kernels[0], self.shape(), args) }
    }

    /// Enqueues one pass of every rank in one launch, after what the caller enqueued before it
    /// (the forward: the exchange's schedule, with every rank's `slot_ready` cleared before its
    /// publish; the backward: every rank's `slot_ready` cleared): cuts every plan's group maps,
    /// clears the pass counters, then the megakernel.
    pub(crate) fn launch_ranks(&mut self, gpu: &Gpu, plans: &[&[&EnginePlan]]) -> Result<()> {
        let Some(inputs) = &self.inputs else {
            return Err(MokError::InvalidInput { tensor: "megakernel", problem: "built for one GPU".into() });
        };
        let inputs = inputs.device_ptr();
        self.prepare_pass(gpu, plans)?;
        let args =
            [KernelArg::Ptr(self.params.device_ptr()), KernelArg::Ptr(inputs), KernelArg::U32(self.host.len() as u32)];
        // SAFETY: `mok_sm90_forward_ranks`'s and `mok_sm90_backward_ranks`' parameters in order
        // and type; each rank's parameter block points at the layer's live buffers, its heap
        // slice and the plans' parameter blocks (checked above); the inputs are one block per
        // rank; the counters are cleared above on the stream, and the `slot_ready` flags by the
        // caller; the grid is co-resident and gives every rank a compute pair (checked when
        // built).
        unsafe { gpu.launch(self.kernels[1], self.shape(), &args) }
    }
}

/// Where the passes of one GPU record their first failure (across ranks, each rank's record
/// lies in the heap and the exchange reads it). A layer keeps one per pass kind for its life and
/// gives it to every pass it builds, so a failure stays recorded until a check reads it, even
/// when the pass that failed has since been replaced (other weights, another gradient target)
/// or dropped; and a record left set stops the next pass's waits at once.
pub(crate) struct ErrorRecord {
    words: DeviceBuffer<u32>,
}

impl ErrorRecord {
    /// A cleared record.
    pub(crate) fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Self { words: DeviceBuffer::from_slice(gpu, &[0u32; ERROR_WORDS])? })
    }

    /// The record `slot` keeps, made (cleared) the first time.
    pub(crate) fn kept<'a>(slot: &'a mut Option<Self>, gpu: &Gpu) -> Result<&'a Self> {
        match slot {
            Some(record) => Ok(record),
            empty => Ok(empty.insert(Self::new(gpu)?)),
        }
    }

    fn address(&self) -> u64 {
        self.words.device_ptr()
    }

    /// Waits for the stream (the download does) and reports the first failure recorded since
    /// the last check, clearing it so the next pass starts clean.
    pub(crate) fn check(&mut self) -> Result<()> {
        let words = self.words.download()?;
        match engine_error(&words, None) {
            None => Ok(()),
            Some(error) => {
                self.words.upload(&[0; ERROR_WORDS])?;
                Err(error)
            }
        }
    }
}

/// The backward megakernel's entry point on one GPU.
pub const BACKWARD_KERNEL: &str = "mok_sm90_backward";
/// Its entry point hosting the expert-parallel ranks a process drives (every virtual rank on one
/// GPU, or its one rank across processes).
pub const BACKWARD_RANKS_KERNEL: &str = "mok_sm90_backward_ranks";

/// The kernels of a backward pass's plans, in [`BackwardParams`] order: the down dgrad (into
/// d_hidden), the gate/up dgrad, then the down, gate and up weight gradients.
const BACKWARD_PLAN_KERNELS: [&str; 5] = [
    "mok_sm90_gemm_rows_nn",
    "mok_sm90_gemm_rows_nn",
    "mok_sm90_gemm_wgrad",
    "mok_sm90_gemm_wgrad",
    "mok_sm90_gemm_wgrad",
];

/// Checks one rank's forward plans by kernel (the routed gate/up and down, then the shared
/// expert's when `with_shared`) and says whether the routed gate/up gathers its token rows in
/// its producers (one GPU only; the shared expert's reads its copy of x).
fn forward_plan_kernels(kernels: &[&str], with_shared: bool, over_ranks: bool) -> Result<bool> {
    const KERNELS: [&str; 2] = ["mok_sm90_gemm_gate_up", "mok_sm90_gemm_rows_nt"];
    let expected = if with_shared { 4 } else { 2 };
    let gathers = kernels.first() == Some(&GATE_UP_GATHERING_KERNEL);
    let pair = |n: usize| if n == 0 && gathers { [GATE_UP_GATHERING_KERNEL, KERNELS[1]] } else { KERNELS };
    if kernels.len() != expected || kernels.chunks(2).enumerate().any(|(n, kernels)| kernels != pair(n)) {
        return Err(MokError::InvalidInput {
            tensor: "megakernel",
            problem: format!("runs a gate/up and an f32 down plan (and the same for a shared expert), not {kernels:?}"),
        });
    }
    refuse_gathering_over_ranks(gathers, over_ranks)?;
    Ok(gathers)
}

/// Checks one rank's backward plans by kernel ([`BACKWARD_PLAN_KERNELS`], then the shared
/// expert's five when `with_shared`) and says whether the routed gate and up weight gradients
/// gather their token rows in their producers (both or neither; one GPU only; the shared
/// expert's read its copy of x).
fn backward_plan_kernels(kernels: &[&str], with_shared: bool, over_ranks: bool) -> Result<bool> {
    let expected = if with_shared { 10 } else { 5 };
    if kernels.len() != expected {
        return Err(MokError::InvalidInput {
            tensor: "megakernel",
            problem: format!("the backward runs {expected} plans here, not {}", kernels.len()),
        });
    }
    let gathers = kernels[3] == WGRAD_GATHERING_KERNEL;
    refuse_gathering_over_ranks(gathers, over_ranks)?;
    for (n, given) in kernels.chunks(5).enumerate() {
        let mut wanted = BACKWARD_PLAN_KERNELS;
        if n == 0 && gathers {
            wanted[3..].fill(WGRAD_GATHERING_KERNEL);
        }
        if let Some((expected, given)) = wanted.iter().zip(given).find(|(expected, given)| expected != given) {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: format!("the backward runs a {expected} plan where it was given {given}"),
            });
        }
    }
    Ok(gathers)
}

/// Refuses plans that gather their token rows in their producers in a pass over ranks: there
/// the rows are pulled from their owners into the ring, whose copy the plans read.
fn refuse_gathering_over_ranks(gathers: bool, over_ranks: bool) -> Result<()> {
    if gathers && over_ranks {
        return Err(MokError::InvalidInput {
            tensor: "gather_in_producer",
            problem: "the megakernels gather in their producers on one GPU only".into(),
        });
    }
    Ok(())
}

/// The layer buffers a backward pass reads and writes, besides its plans', for one rank.
pub(crate) struct BackwardBuffers {
    /// `[R]` the slot each expert-ordered row holds (with ranks: the ring map's source slots).
    pub row_source: u64,
    /// `[T·k]` the row of each slot (with ranks: `slot_self`, addressing the slot buffers).
    pub slot_row: u64,
    /// `[cap][H]` f32: the forward's down rows (one GPU: read for d_topk_weights).
    pub down_rows: u64,
    /// `[cap][H]` bf16: the gathered, scaled dy rows (the down dgrad's A).
    pub d_rows: u64,
    /// `[cap][H]` f32: the gate/up dgrad's output rows.
    pub d_in_rows: u64,
    /// `[T][H]` bf16 dx.
    pub dx: u64,
    /// `[T·k]` f32 d_topk_weights.
    pub d_topk_weights: u64,
    /// k, H.
    pub top_k: u32,
    pub hidden: u32,
    /// With expert-parallel ranks: the rank's place in the symmetric heap (its inputs: dy, the
    /// slot weights, its shared expert's dx rows).
    pub rank: Option<RankPass>,
    /// The routed experts' rows of the SwiGLU step between the two data gradients.
    pub swiglu: SwigluBackwardRows,
    /// With a shared expert run inside the pass (its plans come after the routed ones, in the
    /// same order): its rows.
    pub shared: Option<SharedBackwardRows>,
}

/// A shared expert's rows inside a backward pass.
#[derive(Clone, Copy)]
pub(crate) struct SharedBackwardRows {
    /// `[cap][H]` bf16 where the gather copies dy for it.
    pub dy: u64,
    /// The rows of its SwiGLU step.
    pub swiglu: SwigluBackwardRows,
}

impl BackwardMegakernel {
    /// The pass of one rank (`buffers.len() == 1` without ranks: one GPU) or of every virtual
    /// rank in one launch; `plans[r]` are rank r's plans in [`BACKWARD_PLAN_KERNELS`] order, then,
    /// when `buffers[r].shared` is given, its shared expert's five in the same order. On one GPU
    /// the pass records its failures in `error_record` (over ranks: `None`, the heap's), which
    /// must outlive every launch of the pass. The slot-weight gradients run early only where
    /// `options.early_slot_weight_gradients` is `Some(true)`, and the pass keeps row totals only
    /// where `options.row_totals` is: the caller resolves the rules
    /// ([`early_slot_weight_gradients`], [`row_totals`]).
    pub(crate) fn new(
        gpu: &Gpu,
        plans: &[&[&EnginePlan]],
        buffers: &[BackwardBuffers],
        options: &MegakernelOptions,
        error_record: Option<&ErrorRecord>,
    ) -> Result<Self> {
        // Per rank, whether its gate and up weight gradients gather their rows.
        let mut gathers = Vec::with_capacity(plans.len());
        for (set, b) in plans.iter().zip(buffers) {
            let kernels: Vec<&str> = set.iter().map(|p| p.kernel()).collect();
            gathers.push(backward_plan_kernels(&kernels, b.shared.is_some(), b.rank.is_some())?);
            for experts in set.chunks(5) {
                // The down weight gradient (`[G][H][I]`) first, then gate and up (`[G][I][H]`):
                // each phase waits on what its own product reads.
                let dims = [2, 3, 4].map(|i| experts[i].output_dims());
                if dims[0].0 != b.hidden || dims[1].1 != b.hidden || dims[2].1 != b.hidden {
                    return Err(MokError::InvalidInput {
                        tensor: "megakernel",
                        problem: format!(
                            "weight-gradient plans of outputs {dims:?}: expected down [H][I], then gate and up [I][H] (H = {})",
                            b.hidden
                        ),
                    });
                }
            }
        }
        let ranks_of: Vec<Option<&RankPass>> = buffers.iter().map(|b| b.rank.as_ref()).collect();
        let with_ranks = ranks_of.first().is_some_and(Option::is_some);
        // Across ranks the launch's compute blocks walk every rank's routed weight-gradient
        // tiles as one list (the walk of one GPU: no rank's blocks idle while another's still
        // have tiles) when the lists line up: the same tile count per product on every rank.
        let wgrad_tiles = |set: &[&EnginePlan]| {
            [2, 3, 4].map(|i| {
                let (m, n) = set[i].output_dims();
                weight_gradient_tiles(set[i].groups(), m, n)
            })
        };
        let wgrad_ranks = if with_ranks && plans.iter().all(|set| wgrad_tiles(set) == wgrad_tiles(plans[0])) {
            plans.len() as u32
        } else {
            1
        };
        let tile_ranks = shared_tile_ranks(&ranks_of, plans, options);
        let kernels = [BACKWARD_KERNEL, BACKWARD_RANKS_KERNEL];
        let words = backward_counter_words;
        build_pass(gpu, kernels, plans, &ranks_of, options, error_record, words, |r, at, comm_blocks, timeout_ns| {
            let (p, b, counters, tile_words) = (plans[r], &buffers[r], at.counters, at.tile_words);
            // After the routed counters, the four queue words and the four row totals, a line
            // apart (`BACKWARD_QUEUE_WORDS`): the shared expert's three.
            let queues = counters + 3 * tile_words;
            let totals = queues + 4 * BACKWARD_QUEUE_WORDS;
            let shared_counters = totals + 4 * BACKWARD_QUEUE_WORDS;
            let with_shared = b.shared.is_some();
            let shared = |i: usize| if with_shared { p[5 + i].params_ptr() } else { 0 };
            let shared_counter = |i: u64| if with_shared { shared_counters + i * tile_words } else { 0 };
            BackwardParams {
                down_dgrad: p[0].params_ptr(),
                gate_up_dgrad: p[1].params_ptr(),
                wgrad: [p[2].params_ptr(), p[3].params_ptr(), p[4].params_ptr()],
                row_source: b.row_source,
                slot_row: b.slot_row,
                down_rows: b.down_rows,
                d_rows: b.d_rows,
                d_in_rows: b.d_in_rows,
                dx: b.dx,
                d_topk_weights: b.d_topk_weights,
                rows_gathered: counters,
                down_dgrad_stored: counters + tile_words,
                gate_up_dgrad_stored: counters + 2 * tile_words,
                gather_next: queues,
                combine_next: queues + 4,
                error: at.error,
                timeout_ns,
                top_k: b.top_k,
                hidden: b.hidden,
                comm_blocks,
                silent_rows_tile: NO_FAULT,
                silent_hidden_tile: NO_FAULT,
                work: WORK_ALL,
                rank: at.rank,
                launch_index: r as u32,
                exchange: at.exchange,
                silent_push: NO_FAULT,
                // On one GPU the kernel walks the whole grid (its own sreg reads).
                rank_first_block: if with_ranks { at.first_block } else { 0 },
                rank_blocks: at.blocks,
                wgrad_ranks,
                tile_ranks,
                // One GPU only (checked above).
                gather_in_producer: u32::from(gathers[r]),
                shared_down_dgrad: shared(0),
                shared_gate_up_dgrad: shared(1),
                shared_wgrad: [shared(2), shared(3), shared(4)],
                shared_dy: b.shared.map_or(0, |s| s.dy),
                shared_gathered: shared_counter(0),
                shared_down_dgrad_stored: shared_counter(1),
                shared_gate_up_dgrad_stored: shared_counter(2),
                swiglu: b.swiglu,
                shared_swiglu: b.shared.map(|s| s.swiglu).unwrap_or_default(),
                swiglu_next: queues + 8,
                dots_next: queues + 12,
                early_slot_weight_gradients: u32::from(options.early_slot_weight_gradients == Some(true)),
                reserved: 0,
                row_totals: if options.row_totals == Some(true) { totals } else { 0 },
            }
        })
    }
}

/// The ranks whose GEMM tiles a launch's compute blocks share (`tile_ranks` of the parameter
/// blocks): every rank of a launch hosting several when the options ask for it and the ranks
/// agree on the phases (a shared expert on all of them or on none: the kernel runs every rank's
/// phases in one order), else 1, each rank's tiles on its own blocks.
fn shared_tile_ranks(ranks_of: &[Option<&RankPass>], plans: &[&[&EnginePlan]], options: &MegakernelOptions) -> u32 {
    let with_ranks = ranks_of.first().is_some_and(Option::is_some);
    let same_phases = plans.iter().all(|set| set.len() == plans[0].len());
    if with_ranks && ranks_of.len() > 1 && options.share_rank_tiles && same_phases { ranks_of.len() as u32 } else { 1 }
}

/// `#[repr(C)]` blocks without padding (the parameter blocks, the pass inputs) as the bytes the
/// device reads.
///
/// # Safety
/// `T` is plain data without padding (every byte of a value initialised).
unsafe fn blocks_bytes<T: Copy>(blocks: &[T]) -> Vec<u8> {
    // SAFETY: caller contract.
    blocks.iter().flat_map(|b| unsafe { plain_bytes(b) }.to_vec()).collect()
}

#[cfg(test)]
mod plan_kernel_tests {
    use super::*;

    const GATE_UP: &str = "mok_sm90_gemm_gate_up";
    const DOWN: &str = "mok_sm90_gemm_rows_nt";
    const NN: &str = "mok_sm90_gemm_rows_nn";
    const WGRAD: &str = "mok_sm90_gemm_wgrad";

    fn refused_on(result: Result<bool>, tensor: &str) -> bool {
        matches!(result, Err(MokError::InvalidInput { tensor: t, .. }) if t == tensor)
    }

    #[test]
    fn a_forward_pass_takes_plain_or_gathering_routed_gate_up_plans_on_one_gpu() {
        assert!(!forward_plan_kernels(&[GATE_UP, DOWN], false, false).unwrap());
        assert!(!forward_plan_kernels(&[GATE_UP, DOWN, GATE_UP, DOWN], true, true).unwrap());
        assert!(forward_plan_kernels(&[GATE_UP_GATHERING_KERNEL, DOWN], false, false).unwrap());
        assert!(forward_plan_kernels(&[GATE_UP_GATHERING_KERNEL, DOWN, GATE_UP, DOWN], true, false).unwrap());
        // Gathering over ranks, a gathering shared expert, a missing or extra plan, plans out of order.
        assert!(refused_on(forward_plan_kernels(&[GATE_UP_GATHERING_KERNEL, DOWN], false, true), "gather_in_producer"));
        for wrong in [
            &[GATE_UP, DOWN, GATE_UP_GATHERING_KERNEL, DOWN][..],
            &[GATE_UP, DOWN, GATE_UP][..],
            &[DOWN, GATE_UP][..],
            &[GATE_UP][..],
        ] {
            assert!(refused_on(forward_plan_kernels(wrong, wrong.len() > 2, false), "megakernel"), "{wrong:?}");
        }
        assert!(refused_on(forward_plan_kernels(&[GATE_UP, DOWN], true, false), "megakernel"));
    }

    #[test]
    fn a_backward_pass_takes_gathering_gate_and_up_weight_gradients_both_or_neither() {
        let plain = [NN, NN, WGRAD, WGRAD, WGRAD];
        let gathering = [NN, NN, WGRAD, WGRAD_GATHERING_KERNEL, WGRAD_GATHERING_KERNEL];
        assert!(!backward_plan_kernels(&plain, false, false).unwrap());
        assert!(backward_plan_kernels(&gathering, false, false).unwrap());
        assert!(backward_plan_kernels(&[&gathering[..], &plain[..]].concat(), true, false).unwrap());
        assert!(!backward_plan_kernels(&[&plain[..], &plain[..]].concat(), true, true).unwrap());
        assert!(refused_on(backward_plan_kernels(&gathering, false, true), "gather_in_producer"));
        for wrong in [
            vec![NN, NN, WGRAD, WGRAD_GATHERING_KERNEL, WGRAD],
            vec![NN, NN, WGRAD, WGRAD, WGRAD_GATHERING_KERNEL],
            vec![NN, NN, WGRAD_GATHERING_KERNEL, WGRAD_GATHERING_KERNEL, WGRAD_GATHERING_KERNEL],
            [&plain[..], &gathering[..]].concat(),
            vec![NN, WGRAD, WGRAD, WGRAD, WGRAD],
        ] {
            assert!(refused_on(backward_plan_kernels(&wrong, wrong.len() > 5, false), "megakernel"), "{wrong:?}");
        }
        assert!(refused_on(backward_plan_kernels(&plain, true, false), "megakernel"));
    }
}

#[cfg(test)]
mod geometry_tests {
    use super::*;

    #[test]
    fn slot_weight_gradients_early_from_the_rows_per_expert_or_as_asked() {
        let options = |early| MegakernelOptions { early_slot_weight_gradients: early, ..Default::default() };
        // qwen (E 512, k 10) at T = 32768 (640 rows an expert) early, at T = 8192 (160) and
        // kimi (E 384, k 8) at T = 8192 (170) not.
        assert!(early_slot_weight_gradients(&options(None), 32768 * 10 / 512));
        assert!(!early_slot_weight_gradients(&options(None), 8192 * 10 / 512));
        assert!(!early_slot_weight_gradients(&options(None), 8192 * 8 / 384));
        assert!(!early_slot_weight_gradients(&options(None), EARLY_SLOT_WEIGHT_GRADIENTS_MIN_ROWS - 1));
        // The average counts every rank's tokens: qwen 32768 on one GPU and over eight ranks.
        let qwen = MoeConfig::new(32768, 4096, 1024, 512, 10);
        assert_eq!(average_rows_per_expert(&qwen), 640);
        assert_eq!(average_rows_per_expert(&MoeConfig { tokens_per_rank: 4096, ep_ranks: 8, ..qwen }), 640);
        assert!(early_slot_weight_gradients(&options(Some(true)), 1));
        assert!(!early_slot_weight_gradients(&options(Some(false)), 1 << 20));
    }

    #[test]
    fn every_rank_gets_its_comm_blocks_and_a_compute_pair() {
        let options = |comm_blocks, blocks| MegakernelOptions { comm_blocks, blocks, ..Default::default() };
        assert_eq!(checked_geometry(132, &options(None, None), 1).unwrap(), (132, DEFAULT_COMM_BLOCKS));
        // 66 pairs over 8 ranks: the smallest share is 8 pairs (16 blocks).
        assert_eq!(checked_geometry(132, &options(Some(14), None), 8).unwrap(), (132, 14));
        assert!(checked_geometry(132, &options(Some(15), None), 8).is_err());
        // One pair per rank, and no fewer pairs than ranks.
        assert_eq!(checked_geometry(132, &options(Some(0), Some(16)), 8).unwrap(), (16, 0));
        assert!(checked_geometry(132, &options(Some(0), Some(14)), 8).is_err());
        assert!(checked_geometry(132, &options(None, None), 67).is_err());
        // Resident and whole pairs only.
        assert!(checked_geometry(132, &options(None, Some(134)), 1).is_err());
        assert!(checked_geometry(132, &options(None, Some(9)), 1).is_err());
        // Comm-block counts near `u32::MAX` are refused, not wrapped.
        for comm in [u32::MAX, u32::MAX - 1, 1 << 31] {
            assert!(checked_geometry(132, &options(Some(comm), None), 1).is_err(), "{comm}");
        }
    }

    #[test]
    fn the_one_gpu_backward_takes_comm_blocks_only_for_narrow_experts_on_large_grids() {
        let options = |comm_blocks, blocks| MegakernelOptions { comm_blocks, blocks, ..Default::default() };
        let chosen = |o: &MegakernelOptions, intermediate, resident| {
            one_gpu_backward_options(o, intermediate, 160, resident).comm_blocks.unwrap()
        };
        // qwen's width, the widest narrow one, on a whole H200, and the test shapes' narrowest.
        assert_eq!(chosen(&options(None, None), 1024, 132), NARROW_BACKWARD_COMM_BLOCKS);
        assert_eq!(chosen(&options(None, None), 40, 132), NARROW_BACKWARD_COMM_BLOCKS);
        // kimi's and deepseek's widths, and one past the bound.
        for wide in [2048, 3072, MAX_NARROW_INTERMEDIATE + 1] {
            assert_eq!(chosen(&options(None, None), wide, 132), DEFAULT_COMM_BLOCKS, "{wide}");
        }
        // A small grid, named or resident, keeps its compute blocks.
        assert_eq!(chosen(&options(None, Some(30)), 1024, 132), DEFAULT_COMM_BLOCKS);
        assert_eq!(chosen(&options(None, Some(32)), 1024, 132), NARROW_BACKWARD_COMM_BLOCKS);
        assert_eq!(chosen(&options(None, None), 1024, 16), DEFAULT_COMM_BLOCKS);
        // A count the options name is kept, and every choice is a geometry the pass can run.
        assert_eq!(chosen(&options(Some(2), None), 1024, 132), 2);
        assert_eq!(chosen(&options(Some(0), None), 1024, 132), 0);
        for blocks in (2..=132).step_by(2) {
            let o = one_gpu_backward_options(&options(None, Some(blocks)), 1024, 160, 132);
            assert!(checked_geometry(132, &o, 1).is_ok(), "{blocks} blocks");
            // A GPU holding only `blocks` at once, the options naming none.
            let o = one_gpu_backward_options(&options(None, None), 1024, 160, blocks);
            assert!(checked_geometry(blocks, &o, 1).is_ok(), "{blocks} resident");
        }
        // The slot-weight gradients' placement: the rule where the options leave it open.
        let early =
            |o: &MegakernelOptions, rows| one_gpu_backward_options(o, 1024, rows, 132).early_slot_weight_gradients;
        assert_eq!(early(&options(None, None), 32768 * 10 / 512), Some(true));
        assert_eq!(early(&options(None, None), 8192 * 8 / 384), Some(false));
        let forced = |on| MegakernelOptions { early_slot_weight_gradients: Some(on), ..options(None, None) };
        assert_eq!(early(&forced(false), 1 << 20), Some(false));
        assert_eq!(early(&forced(true), 1), Some(true));
        // The row totals: the rule where the options leave them open, else as named.
        let totals = |o: &MegakernelOptions, rows| one_gpu_backward_options(o, 1024, rows, 132).row_totals;
        assert_eq!(totals(&options(None, None), 32768 * 10 / 512), Some(true));
        assert_eq!(totals(&options(None, None), 8192 * 8 / 384), Some(false));
        assert_eq!(totals(&options(None, None), ROW_TOTALS_MIN_ROWS - 1), Some(false));
        let named = |on| MegakernelOptions { row_totals: Some(on), ..options(None, None) };
        assert_eq!(totals(&named(false), 1 << 20), Some(false));
        assert_eq!(totals(&named(true), 1), Some(true));
        // Everything else about the options is kept.
        let timed = MegakernelOptions { timeout: std::time::Duration::from_millis(7), ..options(None, Some(64)) };
        let o = one_gpu_backward_options(&timed, 1024, 160, 132);
        assert_eq!((o.blocks, o.timeout, o.share_rank_tiles), (timed.blocks, timed.timeout, timed.share_rank_tiles));
    }
}

#[cfg(test)]
pub(crate) mod work_order_model {
    //! CPU models of the megakernels' work orders, run over many random geometries, routings,
    //! rank counts and interleavings. Agents stand for blocks: a comm block, or a compute pair
    //! whose producer holds the next GEMM tile (waiting on its inputs) while its consumers
    //! finish the current one (its rows loaded, so it completes without waiting). Each unit waits
    //! only on the counters its kernel wait reads. The property checked is the one
    //! docs/ARCHITECTURE.md argues: whatever the interleaving, every unit completes (no state
    //! where every unfinished agent waits); and the order matters (taking a later queue early
    //! can deadlock).

    /// Deterministic xorshift for the interleavings (the gathering ring model's too).
    pub(crate) struct Rng(pub(crate) u64);
    impl Rng {
        pub(crate) fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// A block's place in the model: its rank, its index among the rank's compute blocks and
    /// their count (the weight gradients' fixed stride), and what it took of each queue.
    #[derive(Clone, Copy, Default)]
    pub(super) struct Who {
        pub(super) rank: usize,
        pub(super) compute: (usize, usize),
        pub(super) taken: [usize; 32],
    }

    /// The counters and queues of a model.
    pub(super) trait World {
        type Unit: Copy;
        /// The next unit of queue `q` for `who`, `None` when spent (for it).
        fn take(&mut self, who: &mut Who, q: usize) -> Option<Self::Unit>;
        /// Whether `unit`'s inputs are ready (what its wait in the kernel reads).
        fn ready(&self, unit: Self::Unit) -> bool;
        fn finish(&mut self, unit: Self::Unit);
        /// GEMM tiles are pipelined (producer ahead of consumers); row work runs on the whole
        /// block.
        fn pipelined(unit: Self::Unit) -> bool;
    }

    pub(super) struct Agent<U> {
        who: Who,
        /// The queues it takes from, in order.
        queues: Vec<usize>,
        phase: usize,
        /// The producer's next tile (loaded once ready) and the consumers' current one.
        next: Option<U>,
        current: Option<U>,
        done: bool,
    }

    impl<U: Copy> Agent<U> {
        pub(super) fn new(who: Who, queues: Vec<usize>) -> Self {
            Agent { who, queues, phase: 0, next: None, current: None, done: false }
        }

        pub(super) fn done(&self) -> bool {
            self.done
        }

        /// One step; `true` if anything changed.
        pub(super) fn step<W: World<Unit = U>>(&mut self, world: &mut W, rng: &mut Rng) -> bool {
            if self.done {
                return false;
            }
            if let Some(unit) = self.current
                && rng.below(2) == 0
            {
                world.finish(unit);
                self.current = None;
                return true;
            }
            if let Some(unit) = self.next {
                if world.ready(unit) && self.current.is_none() {
                    if W::pipelined(unit) {
                        self.current = Some(unit);
                    } else {
                        world.finish(unit);
                    }
                    self.next = None;
                    return true;
                }
                return false;
            }
            while self.phase < self.queues.len() {
                if let Some(unit) = world.take(&mut self.who, self.queues[self.phase]) {
                    self.next = Some(unit);
                    return true;
                }
                self.phase += 1;
            }
            if self.current.is_none() {
                self.done = true;
                return true;
            }
            false
        }
    }

    /// Steps random agents until all are done; panics with `what` when every agent is stuck.
    pub(super) fn run_to_completion<W: World>(world: &mut W, agents: &mut [Agent<W::Unit>], rng: &mut Rng, what: &str) {
        let mut idle_rounds = 0;
        while agents.iter().any(|a| !a.done()) {
            let i = rng.below(agents.len());
            if agents[i].step(world, rng) {
                idle_rounds = 0;
            } else {
                idle_rounds += 1;
                // Every agent stuck for long: try each once deterministically before calling it a deadlock.
                if idle_rounds > 10_000 {
                    let progress = (0..agents.len()).any(|j| (0..4).any(|_| agents[j].step(world, rng)));
                    assert!(progress, "{what}: deadlock");
                    idle_rounds = 0;
                }
            }
        }
    }

    /// Steps one agent alone 100 times: how many steps changed anything.
    pub(super) fn lone_progress<W: World>(world: &mut W, agent: &mut Agent<W::Unit>, rng: &mut Rng) -> usize {
        (0..100).filter(|_| agent.step(world, rng)).count()
    }

    /// The backward megakernel's final cluster barrier in the models: a compute block's three
    /// spare producer warps leave (their last unit), the block arrives, and its consumers go on
    /// to the combine only once both blocks of its pair and their spare warps are there.
    pub(super) struct FinalBarrier {
        /// Per compute block: its spare warps at the barrier, and whether the block arrived.
        left: Vec<usize>,
        arrived: Vec<bool>,
    }

    impl FinalBarrier {
        pub(super) fn new(compute_blocks: usize) -> Self {
            Self { left: vec![0; compute_blocks], arrived: vec![false; compute_blocks] }
        }

        /// An agent of compute block `block` taking its barrier unit (`spare`: a spare warp's
        /// leaving; else the block's arrival), once per agent (`taken` its count for the unit):
        /// `false` once taken. A block arrives as it takes the unit (its last tile may still be
        /// finishing, which always completes).
        pub(super) fn take(&mut self, taken: &mut usize, block: usize, spare: bool) -> bool {
            if *taken > 0 {
                return false;
            }
            *taken = 1;
            if !spare {
                self.arrived[block] = true;
            }
            true
        }

        /// A spare warp of `block` has left.
        pub(super) fn leave(&mut self, block: usize) {
            self.left[block] += 1;
        }

        /// Whether `block` may pass: its pair's blocks arrived, and their spare warps all left.
        pub(super) fn open(&self, block: usize) -> bool {
            [block & !1, block | 1].iter().all(|&b| self.arrived[b] && self.left[b] == 3)
        }
    }

    mod forward {
        //! The forward: each rank's comm blocks and the spare producer warps of its compute
        //! blocks (an agent each, three per block) take dispatch tiles (the shared expert's
        //! copies first; with the tiles shared across ranks the spare warps take every rank's,
        //! rank after rank, as the compute pairs do); its compute pairs take the shared expert's gate/up tiles, the routed
        //! gate/up tiles, the shared down tiles, the routed down tiles, and combine tokens from
        //! the rank's queues in that order (comm blocks: the combine). A token's combine waits
        //! on its shared-expert tile and on the down tiles of its slots' rows on their owners
        //! (across ranks those tiles push the rows and raise their flags from the epilogue, so
        //! the wait is the same on one GPU and across ranks).

        use super::*;

        /// A unit of work of rank `.0`.
        #[derive(Clone, Copy, PartialEq, Debug)]
        enum Unit {
            SharedDispatch(usize, usize),
            SharedGateUp(usize, usize),
            SharedDown(usize, usize),
            Dispatch(usize, usize),
            /// (rank, M tile, the compute pair that took it)
            GateUp(usize, usize, usize),
            Down(usize, usize),
            Combine(usize, usize),
            /// A spare warp of (compute pair) joining its gate/up's gathering.
            Join(usize),
        }

        const DISPATCH: usize = 0;
        const GATE_UP: usize = 1;
        const DOWN: usize = 2;
        const COMBINE: usize = 3;
        /// The shared expert's: its row copies (the head of the dispatch queue in the kernel),
        /// its gate/up and its down tiles.
        const SHARED_DISPATCH: usize = 4;
        const SHARED_GATE_UP: usize = 5;
        const SHARED_DOWN: usize = 6;
        /// A spare warp's join of its pair's gathering (one unit per warp, after its dispatch).
        const JOIN: usize = 7;
        /// Every queue a compute pair's producer and consumers take, in the kernel's order.
        const COMPUTE_ORDER: [usize; 5] = [SHARED_GATE_UP, GATE_UP, SHARED_DOWN, DOWN, COMBINE];

        /// Queue `q` of rank `r` (`tile_ranks` > 1: a compute pair takes every rank's tiles);
        /// a plain queue number is the taker's own rank's.
        const fn of_rank(q: usize, r: usize) -> usize {
            8 * (r + 1) + q
        }

        /// The compute order when the launch's compute pairs share every rank's GEMM tiles:
        /// each phase rank after rank, then the own rank's combine.
        fn shared_compute_order(ranks: usize) -> Vec<usize> {
            let phases = [SHARED_GATE_UP, GATE_UP, SHARED_DOWN, DOWN];
            let mut order: Vec<usize> = phases.iter().flat_map(|&q| (0..ranks).map(move |r| of_rank(q, r))).collect();
            order.push(COMBINE);
            order
        }
        /// What a compute block's spare producer warps take, alongside.
        const SPARE_ORDER: [usize; 2] = [SHARED_DISPATCH, DISPATCH];

        /// The spare warps' order when the compute pairs share every rank's GEMM tiles: every
        /// rank's shared-expert copies, then every rank's routed rows, in the walk's rank order
        /// (`megakernel::comm::in_walk_order!`; its one routed chunk per rank in the first round
        /// is work that waits for nothing, taken early).
        fn shared_spare_order(ranks: usize) -> Vec<usize> {
            [SHARED_DISPATCH, DISPATCH].iter().flat_map(|&q| (0..ranks).map(move |r| of_rank(q, r))).collect()
        }

        /// One rank's counters and queues.
        #[derive(Default)]
        struct Rank {
            /// Per M tile of the rank's ring: dispatched, gate/up tiles stored, down tiles stored.
            dispatched: Vec<bool>,
            gate_up_done: Vec<usize>,
            down_done: Vec<usize>,
            /// Per ring row: its M tile, its token owner and token.
            rows: Vec<(usize, usize, usize)>,
            /// Per token of the rank: the (owner, ring row) of each of its slots.
            slots: Vec<Vec<(usize, usize)>>,
            /// Per M tile of the shared expert (empty without one): copied, gate/up and down
            /// tiles stored; token t lies in tile t · tiles / tokens.
            shared_dispatched: Vec<bool>,
            shared_gate_up_done: Vec<usize>,
            shared_down_done: Vec<usize>,
            next: [usize; 7],
            combined: usize,
        }

        impl Rank {
            fn shared_tile(&self, token: usize) -> usize {
                token * self.shared_dispatched.len() / self.slots.len()
            }
        }

        struct Forward {
            ranks: Vec<Rank>,
            /// N tiles per M tile of each GEMM.
            n_gate_up: usize,
            n_down: usize,
            /// One GPU: the gate/up gathers its rows in its producers (`gather_in_producer`),
            /// so nothing routed is dispatched, and its tiles wait only for their pair's six
            /// spare warps to join the gathering (once the shared expert's copies are handed
            /// out); per compute pair, the spare warps joined.
            gathering: bool,
            joined: Vec<usize>,
        }

        impl World for Forward {
            type Unit = Unit;

            fn take(&mut self, who: &mut Who, q: usize) -> Option<Unit> {
                if q == JOIN {
                    if who.taken[q] > 0 {
                        return None;
                    }
                    who.taken[q] = 1;
                    return Some(Unit::Join(who.compute.0));
                }
                let (q, rank) = if q >= 8 { (q % 8, q / 8 - 1) } else { (q, who.rank) };
                let (n_gate_up, n_down) = (self.n_gate_up, self.n_down);
                let r = &mut self.ranks[rank];
                let m_tiles = r.dispatched.len();
                let shared_tiles = r.shared_dispatched.len();
                let len = [
                    if self.gathering { 0 } else { m_tiles },
                    m_tiles * n_gate_up,
                    m_tiles * n_down,
                    r.slots.len(),
                    shared_tiles,
                    shared_tiles * n_gate_up,
                    shared_tiles * n_down,
                ][q];
                let i = r.next[q];
                if i >= len {
                    return None;
                }
                r.next[q] += 1;
                Some(match q {
                    DISPATCH => Unit::Dispatch(rank, i),
                    GATE_UP => Unit::GateUp(rank, i / n_gate_up, who.compute.0),
                    DOWN => Unit::Down(rank, i / n_down),
                    COMBINE => Unit::Combine(rank, i),
                    SHARED_DISPATCH => Unit::SharedDispatch(rank, i),
                    SHARED_GATE_UP => Unit::SharedGateUp(rank, i / n_gate_up),
                    _ => Unit::SharedDown(rank, i / n_down),
                })
            }

            fn ready(&self, unit: Unit) -> bool {
                match unit {
                    Unit::Dispatch(..) | Unit::SharedDispatch(..) | Unit::Join(_) => true,
                    Unit::SharedGateUp(r, m) => self.ranks[r].shared_dispatched[m],
                    Unit::SharedDown(r, m) => self.ranks[r].shared_gate_up_done[m] == self.n_gate_up,
                    Unit::GateUp(r, m, pair) => {
                        if self.gathering {
                            self.joined[pair] == 6
                        } else {
                            self.ranks[r].dispatched[m]
                        }
                    }
                    Unit::Down(r, m) => self.ranks[r].gate_up_done[m] == self.n_gate_up,
                    Unit::Combine(r, t) => {
                        let rank = &self.ranks[r];
                        let shared_ready = rank.shared_dispatched.is_empty()
                            || rank.shared_down_done[rank.shared_tile(t)] == self.n_down;
                        shared_ready
                            && rank.slots[t].iter().all(|&(owner, row)| {
                                let o = &self.ranks[owner];
                                o.down_done[o.rows[row].0] == self.n_down
                            })
                    }
                }
            }

            fn finish(&mut self, unit: Unit) {
                match unit {
                    Unit::Dispatch(r, m) => self.ranks[r].dispatched[m] = true,
                    Unit::GateUp(r, m, _) => self.ranks[r].gate_up_done[m] += 1,
                    Unit::Join(pair) => self.joined[pair] += 1,
                    Unit::Down(r, m) => self.ranks[r].down_done[m] += 1,
                    Unit::Combine(r, _) => self.ranks[r].combined += 1,
                    Unit::SharedDispatch(r, m) => self.ranks[r].shared_dispatched[m] = true,
                    Unit::SharedGateUp(r, m) => self.ranks[r].shared_gate_up_done[m] += 1,
                    Unit::SharedDown(r, m) => self.ranks[r].shared_down_done[m] += 1,
                }
            }

            fn pipelined(unit: Unit) -> bool {
                matches!(unit, Unit::GateUp(..) | Unit::Down(..) | Unit::SharedGateUp(..) | Unit::SharedDown(..))
            }
        }

        /// A random pass: `ranks` ranks, each with its own M tiles and tokens; every slot of a
        /// token lands in a row of a random owner's ring; with a shared expert (or not) of a
        /// random number of M tiles per rank.
        fn random_world(rng: &mut Rng, ranks: usize) -> Forward {
            let mut world = Forward {
                ranks: (0..ranks).map(|_| Rank::default()).collect(),
                n_gate_up: 1 + rng.below(4),
                n_down: 1 + rng.below(4),
                gathering: false,
                joined: Vec::new(),
            };
            let m_tiles: Vec<usize> = (0..ranks).map(|_| 1 + rng.below(12)).collect();
            for (r, &m) in m_tiles.iter().enumerate() {
                let rank = &mut world.ranks[r];
                rank.dispatched = vec![false; m];
                rank.gate_up_done = vec![0; m];
                rank.down_done = vec![0; m];
            }
            for s in 0..ranks {
                let tokens = 1 + rng.below(20);
                for t in 0..tokens {
                    let k = 1 + rng.below(4);
                    let slots = (0..k)
                        .map(|_| {
                            let owner = rng.below(ranks);
                            let tile = rng.below(m_tiles[owner]);
                            let o = &mut world.ranks[owner];
                            o.rows.push((tile, s, t));
                            (owner, o.rows.len() - 1)
                        })
                        .collect();
                    world.ranks[s].slots.push(slots);
                }
            }
            if rng.below(2) == 0 {
                for rank in &mut world.ranks {
                    let tiles = 1 + rng.below(rank.slots.len());
                    (rank.shared_dispatched, rank.shared_gate_up_done, rank.shared_down_done) =
                        (vec![false; tiles], vec![0; tiles], vec![0; tiles]);
                }
            }
            world
        }

        fn rank(rank: usize) -> Who {
            Who { rank, ..Who::default() }
        }

        #[test]
        fn every_geometry_and_interleaving_completes() {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            for case in 0..600 {
                // One GPU or 1–8 ranks in one launch, half of those with the GEMM tiles shared
                // across ranks.
                let ranks = if case % 3 != 0 { 1 + rng.below(8) } else { 1 };
                let share_tiles = case % 2 == 0;
                let mut world = random_world(&mut rng, ranks);
                // On one GPU, the cases numbered a multiple of 4 with the gate/up gathering its rows.
                world.gathering = ranks == 1 && case % 4 == 0;
                let (comm_blocks, pairs) = (rng.below(4), 1 + rng.below(4));
                let compute_order = if share_tiles { shared_compute_order(ranks) } else { COMPUTE_ORDER.to_vec() };
                let mut agents = Vec::new();
                world.joined = vec![0; ranks * pairs];
                // Gathering, the spare warps join their pair's gate/up after the dispatch.
                let spare_dispatch = if share_tiles { shared_spare_order(ranks) } else { SPARE_ORDER.to_vec() };
                let spare_order = [&spare_dispatch[..], if world.gathering { &[JOIN] } else { &[] }].concat();
                for r in 0..ranks {
                    agents.extend(
                        (0..comm_blocks).map(|_| Agent::new(rank(r), vec![SHARED_DISPATCH, DISPATCH, COMBINE])),
                    );
                    let pair = |p: usize| Who { rank: r, compute: (r * pairs + p, ranks * pairs), ..Who::default() };
                    agents.extend((0..pairs).map(|p| Agent::new(pair(p), compute_order.clone())));
                    // Each block of a pair has three spare warps: the dispatch, on their own.
                    agents.extend((0..3 * 2 * pairs).map(|w| Agent::new(pair(w / 6), spare_order.clone())));
                }
                let what = format!(
                    "case {case}: {ranks} ranks, {comm_blocks} comm blocks and {pairs} pairs each, tiles shared \
                     across ranks: {share_tiles}, gathering: {}",
                    world.gathering
                );
                run_to_completion(&mut world, &mut agents, &mut rng, &what);
                for (r, rank) in world.ranks.iter().enumerate() {
                    assert!(
                        world.gathering || rank.dispatched.iter().all(|&d| d),
                        "case {case} rank {r}: a tile never dispatched"
                    );
                    assert!(rank.gate_up_done.iter().all(|&n| n == world.n_gate_up), "case {case} rank {r}");
                    assert!(rank.down_done.iter().all(|&n| n == world.n_down), "case {case} rank {r}");
                    assert!(rank.shared_down_done.iter().all(|&n| n == world.n_down), "case {case} rank {r}");
                    assert_eq!(rank.combined, rank.slots.len(), "case {case} rank {r}");
                }
                let joined = if world.gathering { 6 } else { 0 };
                assert!(
                    world.joined.iter().all(|&n| n == joined),
                    "case {case}: spare warps joined {:?}",
                    world.joined
                );
            }
        }

        /// One rank with one M tile, one row and one token, the counters and queue positions
        /// given.
        fn one_tile_world(gate_up_done: usize, down_done: usize, next: [usize; 7]) -> Forward {
            Forward {
                ranks: vec![Rank {
                    dispatched: vec![true],
                    gate_up_done: vec![gate_up_done],
                    down_done: vec![down_done],
                    rows: vec![(0, 0, 0)],
                    slots: vec![vec![(0, 0)]],
                    next,
                    combined: 0,
                    ..Rank::default()
                }],
                n_gate_up: 1,
                n_down: 1,
                gathering: false,
                joined: vec![0],
            }
        }

        #[test]
        fn taking_a_later_queue_early_can_deadlock() {
            // The order matters: an agent that took a down tile before the gate/up queue was
            // spent could wait on gate/up work nobody holds. One pair whose producer takes the
            // down tile of an M tile first waits forever: the only agent, and its wait is on work
            // not yet taken.
            let mut world = one_tile_world(0, 0, [1, 0, 0, 0, 0, 0, 0]);
            let mut wrong = Agent::new(rank(0), vec![DOWN, GATE_UP, COMBINE]);
            let progress = lone_progress(&mut world, &mut wrong, &mut Rng(7));
            assert_eq!(progress, 1, "only the take of the down tile happens; then it waits forever");
            assert!(!wrong.done() && world.ranks[0].down_done[0] == 0);
        }

        #[test]
        fn a_combine_before_the_down_queue_is_spent_can_deadlock() {
            // The combine must come after the down tiles: a rank's only agent that combines
            // first waits for the down tile of its own row (across ranks: the tile whose
            // epilogue pushes the row), which only it would run.
            let mut world = one_tile_world(1, 0, [1, 1, 0, 0, 0, 0, 0]);
            let mut wrong = Agent::new(rank(0), vec![COMBINE, DOWN]);
            let progress = lone_progress(&mut world, &mut wrong, &mut Rng(9));
            assert_eq!(progress, 1, "only the take of the combine token happens; then it waits forever");
            assert!(!wrong.done() && world.ranks[0].combined == 0);
        }
    }

    mod backward {
        //! The backward (one GPU): comm blocks and the compute blocks' spare producer warps (an
        //! agent each, three per block) take gather tiles, the spare warps then SwiGLU-backward
        //! chunks; compute blocks take down-dgrad tiles, SwiGLU-backward chunks, gate/up-dgrad
        //! tiles, then their own fixed-stride share of each of the three weight gradients'
        //! tiles, then meet their pair's blocks and spare warps at the final cluster barrier,
        //! then combine tokens. A down-dgrad tile waits on its M
        //! tile's gather, a SwiGLU chunk on its M tile's down-dgrad parts, a gate/up-dgrad tile
        //! on its M tile's SwiGLU chunks, the down weight gradient of expert g on every gather of
        //! g, the gate and up weight gradients on every SwiGLU chunk of g, a combine token on
        //! the gate/up-dgrad parts of its slots' M tiles. With a
        //! shared expert (a second expert set: one expert over the tokens' own M tiles, its own
        //! counters) its gather tiles come first in the gather queue, each of its data gradients
        //! before the routed one, its weight gradients after the routed ones, and a combine token
        //! also waits on its shared M tile. When the routed gate and up weight gradients gather
        //! their rows in the producers (one GPU, `gather_in_producer`), all four producer warps
        //! produce their stages: a block's spare warps join once their gather and SwiGLU queues
        //! are spent (a unit each), and its gate and up weight-gradient tiles also wait for all
        //! three to have joined. Where the slot-weight gradients run apart from the gather
        //! (`early_slot_weight_gradients`), the spare warps take their tokens after the SwiGLU
        //! chunks and every combine agent takes what is left before its tokens; they wait on
        //! nothing.

        use super::*;

        /// The queues of expert set `set` (0 routed, 1 shared): gather, down dgrad, SwiGLU
        /// backward, gate/up dgrad, the three weight gradients; then the combine.
        const fn gather(set: usize) -> usize {
            7 * set
        }
        const fn down_dgrad(set: usize) -> usize {
            7 * set + 1
        }
        const fn swiglu(set: usize) -> usize {
            7 * set + 2
        }
        const fn gate_up_dgrad(set: usize) -> usize {
            7 * set + 3
        }
        const fn wgrad(set: usize, w: usize) -> usize {
            7 * set + 4 + w
        }
        const COMBINE: usize = 14;
        /// A spare warp's join of its block's gathering (one unit per warp).
        const JOIN: usize = 15;
        /// The final cluster barrier: a spare warp's arrival (its last unit), a compute block's
        /// arrival and wait (before its consumers' combine).
        const SPARE_LEAVES: usize = 16;
        const BARRIER: usize = 17;
        /// The slot-weight gradients apart from the gather (a token each).
        const DOTS: usize = 18;
        const ROUTED: usize = 0;
        const SHARED: usize = 1;

        #[derive(Clone, Copy, Debug)]
        enum Unit {
            /// (expert set, M tile)
            Gather(usize, usize),
            DownDgrad(usize, usize),
            Swiglu(usize, usize),
            GateUpDgrad(usize, usize),
            /// (expert set, which weight gradient, expert, the compute block that took it)
            Wgrad(usize, usize, usize, usize),
            Combine(usize),
            /// A spare warp of (compute block) joining its gathering.
            Join(usize),
            /// A spare warp of (compute block) arriving at the final cluster barrier.
            SpareLeaves(usize),
            /// (Compute block) at the final cluster barrier: its pair's blocks and spare warps.
            Barrier(usize),
            /// A token's slot-weight gradients, apart from the gather.
            Dots(usize),
        }

        /// One expert set's counters.
        #[derive(Clone, Default)]
        struct Set {
            /// Per M tile: its expert; gathered; parts stored by each data gradient, and SwiGLU
            /// chunks written.
            expert_of_tile: Vec<usize>,
            gathered: Vec<bool>,
            down_dgrad: Vec<usize>,
            swiglu: Vec<usize>,
            gate_up_dgrad: Vec<usize>,
            experts: usize,
            /// Weight-gradient tiles per expert (each of the three products), and done per
            /// product.
            wgrad_tiles: usize,
            wgrad_done: [usize; 3],
        }

        impl Set {
            fn new(expert_of_tile: Vec<usize>, experts: usize, wgrad_tiles: usize) -> Self {
                let m = expert_of_tile.len();
                Set {
                    expert_of_tile,
                    gathered: vec![false; m],
                    down_dgrad: vec![0; m],
                    swiglu: vec![0; m],
                    gate_up_dgrad: vec![0; m],
                    experts,
                    wgrad_tiles,
                    wgrad_done: [0; 3],
                }
            }
        }

        struct Backward {
            /// The routed experts, and the shared expert (empty set without one).
            sets: [Set; 2],
            n_down_dgrad: usize,
            /// SwiGLU chunks per M tile.
            n_chunks: usize,
            n_gate_up_dgrad: usize,
            /// Per token: the routed M tiles of its slots, and its shared M tile.
            tokens: Vec<(Vec<usize>, usize)>,
            combined: usize,
            /// Per token: how often its slot-weight gradients were computed apart from the gather.
            dots: Vec<usize>,
            /// The shared queues (every gather, data gradient and SwiGLU chunk, the combine, the
            /// slot-weight gradients): next index.
            next: [usize; 19],
            /// Whether the routed gate and up weight gradients gather their rows (then each
            /// waits for its block's spare warps), and per compute block the spare warps joined.
            gathering: bool,
            joined: Vec<usize>,
            /// The final cluster barrier.
            barrier: FinalBarrier,
        }

        impl World for Backward {
            type Unit = Unit;

            fn take(&mut self, who: &mut Who, q: usize) -> Option<Unit> {
                if q == JOIN {
                    // Once per spare warp, after its other queues.
                    if who.taken[q] > 0 {
                        return None;
                    }
                    who.taken[q] = 1;
                    return Some(Unit::Join(who.compute.0));
                }
                if q == SPARE_LEAVES || q == BARRIER {
                    // Once per agent, its last unit before any combine.
                    let (block, spare) = (who.compute.0, q == SPARE_LEAVES);
                    return self.barrier.take(&mut who.taken[q], block, spare).then_some(if spare {
                        Unit::SpareLeaves(block)
                    } else {
                        Unit::Barrier(block)
                    });
                }
                if q == COMBINE || q == DOTS {
                    let i = self.next[q];
                    if i >= self.tokens.len() {
                        return None;
                    }
                    self.next[q] += 1;
                    return Some(if q == DOTS { Unit::Dots(i) } else { Unit::Combine(i) });
                }
                let (set, kind) = (q / 7, q % 7);
                let s = &self.sets[set];
                let m_tiles = s.gathered.len();
                if kind >= 4 {
                    let (index, blocks) = who.compute;
                    let tile = index + who.taken[q] * blocks;
                    if tile >= s.experts * s.wgrad_tiles {
                        return None;
                    }
                    who.taken[q] += 1;
                    return Some(Unit::Wgrad(set, kind - 4, tile / s.wgrad_tiles, index));
                }
                let per_tile = [1, self.n_down_dgrad, self.n_chunks, self.n_gate_up_dgrad][kind];
                let i = self.next[q];
                if i >= m_tiles * per_tile {
                    return None;
                }
                self.next[q] += 1;
                let m = i / per_tile;
                Some(match kind {
                    0 => Unit::Gather(set, m),
                    1 => Unit::DownDgrad(set, m),
                    2 => Unit::Swiglu(set, m),
                    _ => Unit::GateUpDgrad(set, m),
                })
            }

            fn ready(&self, unit: Unit) -> bool {
                let (nd, nc, ng) = (self.n_down_dgrad, self.n_chunks, self.n_gate_up_dgrad);
                // Whether every M tile of expert g in `s` passes `done`.
                let all_of_expert = |s: &Set, g: usize, done: &dyn Fn(usize) -> bool| {
                    (0..s.expert_of_tile.len()).filter(|&m| s.expert_of_tile[m] == g).all(done)
                };
                match unit {
                    Unit::Gather(..) | Unit::Join(_) | Unit::SpareLeaves(_) | Unit::Dots(_) => true,
                    Unit::Barrier(block) => self.barrier.open(block),
                    Unit::DownDgrad(set, m) => self.sets[set].gathered[m],
                    Unit::Swiglu(set, m) => self.sets[set].down_dgrad[m] == nd,
                    Unit::GateUpDgrad(set, m) => self.sets[set].swiglu[m] == nc,
                    Unit::Wgrad(set, 0, g, _) => {
                        let s = &self.sets[set];
                        all_of_expert(s, g, &|m| s.gathered[m])
                    }
                    Unit::Wgrad(set, _, g, block) => {
                        let s = &self.sets[set];
                        // Gathering, the producer meets its three spare warps first.
                        let joined = !(self.gathering && set == ROUTED) || self.joined[block] == 3;
                        joined && all_of_expert(s, g, &|m| s.swiglu[m] == nc)
                    }
                    Unit::Combine(t) => {
                        let (slots, shared_tile) = &self.tokens[t];
                        let shared = &self.sets[SHARED];
                        slots.iter().all(|&m| self.sets[ROUTED].gate_up_dgrad[m] == ng)
                            && (shared.gathered.is_empty() || shared.gate_up_dgrad[*shared_tile] == ng)
                    }
                }
            }

            fn finish(&mut self, unit: Unit) {
                match unit {
                    Unit::Gather(set, m) => self.sets[set].gathered[m] = true,
                    Unit::DownDgrad(set, m) => self.sets[set].down_dgrad[m] += 1,
                    Unit::Swiglu(set, m) => self.sets[set].swiglu[m] += 1,
                    Unit::GateUpDgrad(set, m) => self.sets[set].gate_up_dgrad[m] += 1,
                    Unit::Wgrad(set, w, ..) => self.sets[set].wgrad_done[w] += 1,
                    Unit::Combine(_) => self.combined += 1,
                    Unit::Dots(t) => self.dots[t] += 1,
                    Unit::Join(block) => self.joined[block] += 1,
                    Unit::SpareLeaves(block) => self.barrier.leave(block),
                    Unit::Barrier(_) => {}
                }
            }

            fn pipelined(unit: Unit) -> bool {
                // A SwiGLU chunk runs on the consumers like a GEMM tile's epilogue, so the
                // producer may already hold (and wait on) the next unit, a gate/up-dgrad tile
                // after the last chunk, as in the kernel.
                !matches!(
                    unit,
                    Unit::Gather(..)
                        | Unit::Combine(_)
                        | Unit::Join(_)
                        | Unit::SpareLeaves(_)
                        | Unit::Barrier(_)
                        | Unit::Dots(_)
                )
            }
        }

        fn compute_block(index: usize, blocks: usize) -> Who {
            Who { compute: (index, blocks), ..Who::default() }
        }

        /// The queues of a compute block's producer and consumers, in the kernel's order.
        fn compute_queues(early: bool) -> Vec<usize> {
            let mut queues = vec![down_dgrad(SHARED), down_dgrad(ROUTED)];
            queues.extend([swiglu(SHARED), swiglu(ROUTED), gate_up_dgrad(SHARED), gate_up_dgrad(ROUTED)]);
            queues.extend((0..3).map(|w| wgrad(ROUTED, w)).chain((0..3).map(|w| wgrad(SHARED, w))));
            queues.push(BARRIER);
            queues.extend(combine_queues(early));
            queues
        }

        /// The combine's queues: what is left of the slot-weight gradients where they run apart,
        /// then the tokens.
        fn combine_queues(early: bool) -> Vec<usize> {
            if early { vec![DOTS, COMBINE] } else { vec![COMBINE] }
        }

        /// The queues of a compute block's spare producer warps: gather, SwiGLU chunks, (early)
        /// the slot-weight gradients, (gathering) the join, then the final cluster barrier.
        fn spare_queues(gathering: bool, early: bool) -> Vec<usize> {
            let mut queues = vec![gather(SHARED), gather(ROUTED), swiglu(SHARED), swiglu(ROUTED)];
            if early {
                queues.push(DOTS);
            }
            if gathering {
                queues.push(JOIN);
            }
            queues.push(SPARE_LEAVES);
            queues
        }

        #[test]
        fn every_backward_geometry_and_interleaving_completes() {
            let mut rng = Rng(0x2545_f491_4f6c_dd1d);
            for case in 0..400 {
                let experts = 1 + rng.below(6);
                let m_tiles = 1 + rng.below(12);
                // Experts without an M tile are empty (their weight gradients wait for nothing).
                let expert_of_tile: Vec<usize> = (0..m_tiles).map(|_| rng.below(experts)).collect();
                let token_count = 1 + rng.below(20);
                // Half the cases with a shared expert of 1 to T M tiles (token t in tile
                // t · tiles / T).
                let shared_tiles = if case % 2 == 0 { 1 + rng.below(token_count) } else { 0 };
                let tokens = (0..token_count)
                    .map(|t| {
                        let slots = (0..1 + rng.below(4)).map(|_| rng.below(m_tiles)).collect();
                        (slots, t * shared_tiles / token_count)
                    })
                    .collect();
                let shared = if shared_tiles > 0 {
                    Set::new(vec![0; shared_tiles], 1, 1 + rng.below(5))
                } else {
                    Set::default()
                };
                let (comm_blocks, pairs) = (rng.below(4), 1 + rng.below(4));
                let compute_blocks = 2 * pairs;
                // Half the cases gathering, with and without a shared expert; half of each with
                // the slot-weight gradients apart from the gather.
                let gathering = (case / 2) % 2 == 0;
                let early = (case / 4) % 2 == 0;
                let mut world = Backward {
                    sets: [Set::new(expert_of_tile, experts, 1 + rng.below(5)), shared],
                    n_down_dgrad: 1 + rng.below(4),
                    n_chunks: 1 + rng.below(3),
                    n_gate_up_dgrad: 1 + rng.below(4),
                    tokens,
                    combined: 0,
                    dots: vec![0; token_count],
                    next: [0; 19],
                    gathering,
                    joined: vec![0; compute_blocks],
                    barrier: FinalBarrier::new(compute_blocks),
                };
                let mut agents: Vec<Agent<Unit>> = (0..comm_blocks)
                    .map(|_| {
                        let mut queues = vec![gather(SHARED), gather(ROUTED)];
                        queues.extend(combine_queues(early));
                        Agent::new(Who::default(), queues)
                    })
                    .collect();
                // Each block of a pair walks its own weight-gradient share: one agent per block;
                // its producer warpgroup's three spare warps gather, then take SwiGLU chunks, on
                // their own: three more.
                agents.extend(
                    (0..compute_blocks).map(|b| Agent::new(compute_block(b, compute_blocks), compute_queues(early))),
                );
                agents.extend(
                    (0..3 * compute_blocks)
                        .map(|w| Agent::new(compute_block(w / 3, compute_blocks), spare_queues(gathering, early))),
                );
                let what = format!(
                    "case {case}: {comm_blocks} comm blocks and {pairs} pairs, {shared_tiles} shared tiles, gathering: \
                     {gathering}, slot-weight gradients apart: {early}"
                );
                run_to_completion(&mut world, &mut agents, &mut rng, &what);
                for s in &world.sets {
                    assert!(s.gathered.iter().all(|&g| g), "case {case}");
                    assert!(s.down_dgrad.iter().all(|&n| n == world.n_down_dgrad), "case {case}");
                    assert!(s.swiglu.iter().all(|&n| n == world.n_chunks), "case {case}");
                    assert!(s.gate_up_dgrad.iter().all(|&n| n == world.n_gate_up_dgrad), "case {case}");
                    assert_eq!(s.wgrad_done, [s.experts * s.wgrad_tiles; 3], "case {case}");
                }
                assert_eq!(world.combined, world.tokens.len(), "case {case}");
                assert!(world.dots.iter().all(|&n| n == usize::from(early)), "case {case}: {:?}", world.dots);
                let joined = if gathering { 3 } else { 0 };
                assert!(
                    world.joined.iter().all(|&n| n == joined),
                    "case {case}: spare warps joined {:?}",
                    world.joined
                );
            }
        }

        /// One routed M tile of one expert and one token, gathered (its gather queue spent),
        /// with `n_chunks` SwiGLU chunks; a lone block's wrong order is then tried on it.
        fn one_gathered_tile_world(n_chunks: usize) -> Backward {
            let mut routed = Set::new(vec![0], 1, 1);
            routed.gathered[0] = true;
            let mut world = Backward {
                sets: [routed, Set::default()],
                n_down_dgrad: 1,
                n_chunks,
                n_gate_up_dgrad: 1,
                tokens: vec![(vec![0], 0)],
                combined: 0,
                dots: vec![0; 1],
                next: [0; 19],
                gathering: false,
                joined: vec![0; 1],
                barrier: FinalBarrier::new(2),
            };
            world.next[gather(ROUTED)] = 1;
            world
        }

        #[test]
        fn a_weight_gradient_taken_before_the_data_gradients_can_deadlock() {
            // A lone block that takes a gate weight-gradient tile before the down-dgrad queue
            // waits for down-dgrad parts that only it would compute.
            let mut world = one_gathered_tile_world(1);
            let queues = vec![wgrad(ROUTED, 1), down_dgrad(ROUTED), swiglu(ROUTED), gate_up_dgrad(ROUTED), COMBINE];
            let mut wrong = Agent::new(compute_block(0, 1), queues);
            let progress = lone_progress(&mut world, &mut wrong, &mut Rng(11));
            assert_eq!(progress, 1, "only the take of the weight-gradient tile happens; then it waits forever");
            assert!(!wrong.done() && world.sets[ROUTED].down_dgrad[0] == 0);
        }

        #[test]
        fn a_gate_up_tile_taken_before_the_swiglu_chunks_can_deadlock() {
            // A lone block whose consumers took a gate/up-dgrad tile before running the SwiGLU
            // chunks waits for chunks that only it would write.
            let mut world = one_gathered_tile_world(2);
            world.sets[ROUTED].down_dgrad[0] = 1;
            world.next[down_dgrad(ROUTED)] = 1;
            let queues = vec![gate_up_dgrad(ROUTED), swiglu(ROUTED), COMBINE];
            let mut wrong = Agent::new(compute_block(0, 1), queues);
            let progress = lone_progress(&mut world, &mut wrong, &mut Rng(13));
            assert_eq!(progress, 1, "only the take of the gate/up tile happens; then it waits forever");
            assert!(!wrong.done() && world.sets[ROUTED].swiglu[0] == 0);
        }
    }

    mod backward_ranks {
        //! The backward across ranks in one launch: each rank's comm blocks and its compute
        //! blocks' spare producer warps (an agent each) take gather tiles (the shared
        //! expert's first), the spare warps then SwiGLU chunks (the shared expert's
        //! first); its compute blocks take the shared expert's and then the routed down-dgrad
        //! tiles, SwiGLU chunks, then the shared and the routed gate/up-dgrad tiles — from
        //! their own rank's queues, or, with the tiles shared across ranks, each from every
        //! rank's queue, rank after rank (the spare warps' gather and both roles' SwiGLU chunks
        //! too; the comm blocks keep their own rank's gather); then every compute block of
        //! the launch walks the routed weight-gradient tiles of every rank, product by product,
        //! rank after rank (`weight_gradient_walk`, the kernel's own function); then it meets
        //! its pair's blocks and spare warps at the final cluster barrier and combines its
        //! rank's tokens. A tile of rank q waits on rank q's counters; a combine token on the
        //! gate/up-dgrad parts of its slots' M tiles on their owners (whose epilogues push the
        //! rows) and on its own rank's shared gate/up-dgrad tile. (The shared expert's weight
        //! gradients, on the rank's own blocks after the routed ones, are `backward`'s.) The
        //! slot-weight gradients (a token each, waiting on nothing) are taken by every combine
        //! agent of the rank before its tokens and, where the pass takes them early, by the spare
        //! warps after their SwiGLU chunks (every walked rank's in the walk's order).

        use super::*;
        use mok_kernels::megakernel_layout::weight_gradient_walk;

        const GATHER: usize = 0;
        const DOWN_DGRAD: usize = 1;
        const SWIGLU: usize = 2;
        const GATE_UP_DGRAD: usize = 3;
        const COMBINE: usize = 4;
        /// The slot-weight gradients' queue (`dots_next`).
        const DOTS: usize = 9;
        /// The shared expert's queues: its gather, down dgrad, SwiGLU chunks, gate/up dgrad.
        const SHARED: usize = 5;
        /// The final cluster barrier: a spare warp's arrival (its last unit), a compute block's
        /// arrival and wait (before its consumers' combine).
        const SPARE_LEAVES: usize = 10;
        const BARRIER: usize = 11;
        /// Where those two count in `Who::taken`: `BARRIER_TAKEN + q`, past the weight-gradient
        /// queues' entries (`3 · P` of them, P ≤ 8).
        const BARRIER_TAKEN: usize = 20;
        /// Queue of product `w`'s tiles of rank `q` (P ≤ 8).
        const fn wgrad(w: usize, q: usize, ranks: usize) -> usize {
            16 + w * ranks + q
        }
        /// Queue `q` (below 16) of rank `r` (`tile_ranks` > 1: a compute block takes every
        /// rank's tiles); a plain queue number is the taker's own rank's.
        const fn of_rank(q: usize, r: usize) -> usize {
            64 * (r + 1) + q
        }

        #[derive(Clone, Copy, Debug)]
        enum Unit {
            /// (rank, expert set: 0 routed, 1 shared, M tile)
            Gather(usize, usize, usize),
            DownDgrad(usize, usize, usize),
            Swiglu(usize, usize, usize),
            GateUpDgrad(usize, usize, usize),
            /// (rank, product, expert)
            Wgrad(usize, usize, usize),
            /// (rank, token)
            Combine(usize, usize),
            /// (rank, token): its slot-weight gradients.
            Dots(usize, usize),
            /// A spare warp of (compute block, numbered across the launch) at the final cluster
            /// barrier.
            SpareLeaves(usize),
            /// (Compute block) at the final cluster barrier: its pair's blocks and spare warps.
            Barrier(usize),
        }

        /// One expert set's counters on one rank, per M tile: gathered; parts stored, SwiGLU
        /// chunks written.
        #[derive(Clone, Default)]
        struct Set {
            gathered: Vec<bool>,
            down_dgrad: Vec<usize>,
            swiglu: Vec<usize>,
            gate_up_dgrad: Vec<usize>,
        }

        impl Set {
            fn new(m_tiles: usize) -> Self {
                Set {
                    gathered: vec![false; m_tiles],
                    down_dgrad: vec![0; m_tiles],
                    swiglu: vec![0; m_tiles],
                    gate_up_dgrad: vec![0; m_tiles],
                }
            }
        }

        struct Rank {
            /// The routed experts' M tiles (each of one expert), and the shared expert's (empty
            /// without one; token t in tile t · tiles / tokens).
            expert_of_tile: Vec<usize>,
            sets: [Set; 2],
            /// Per token: its slots' (owner rank, M tile on the owner).
            tokens: Vec<Vec<(usize, usize)>>,
            wgrad_done: [usize; 3],
            combined: usize,
            /// Per token: how often its slot-weight gradients were computed.
            dots: Vec<usize>,
            /// Its own queues: next index (the routed ones, the combine, the shared ones, the
            /// slot-weight gradients).
            next: [usize; 10],
        }

        struct BackwardRanks {
            ranks: Vec<Rank>,
            experts: usize,
            /// Weight-gradient tiles per expert (each product), the same on every rank.
            wgrad_tiles: usize,
            n_down_dgrad: usize,
            n_chunks: usize,
            n_gate_up_dgrad: usize,
            /// The final cluster barrier (compute blocks numbered across the launch).
            barrier: FinalBarrier,
        }

        impl World for BackwardRanks {
            type Unit = Unit;

            fn take(&mut self, who: &mut Who, q: usize) -> Option<Unit> {
                let p = self.ranks.len();
                if q == SPARE_LEAVES || q == BARRIER {
                    // Once per agent, its last unit before any combine.
                    let (block, spare) = (who.compute.0, q == SPARE_LEAVES);
                    return self.barrier.take(&mut who.taken[BARRIER_TAKEN + q], block, spare).then_some(if spare {
                        Unit::SpareLeaves(block)
                    } else {
                        Unit::Barrier(block)
                    });
                }
                if (16..64).contains(&q) {
                    let (w, list) = ((q - 16) / p, (q - 16) % p);
                    let (block, blocks) = who.compute;
                    let tiles = (self.experts * self.wgrad_tiles) as u32;
                    let (first, stride) = weight_gradient_walk(block as u32, blocks as u32, list as u32, tiles);
                    let taken = &mut who.taken[q - 16];
                    let tile = first as usize + *taken * stride as usize;
                    if tile >= tiles as usize {
                        return None;
                    }
                    *taken += 1;
                    return Some(Unit::Wgrad(list, w, tile / self.wgrad_tiles));
                }
                let (q, r) = if q >= 64 { (q % 64, q / 64 - 1) } else { (q, who.rank) };
                let (n_down, n_chunks, n_gate_up) = (self.n_down_dgrad, self.n_chunks, self.n_gate_up_dgrad);
                let rank = &mut self.ranks[r];
                if q == DOTS {
                    let i = rank.next[q];
                    if i >= rank.tokens.len() {
                        return None;
                    }
                    rank.next[q] += 1;
                    return Some(Unit::Dots(r, i));
                }
                let (set, kind) = if q >= SHARED { (1, q - SHARED) } else { (0, q) };
                let m = rank.sets[set].gathered.len();
                let len = if kind == COMBINE { rank.tokens.len() } else { m * [1, n_down, n_chunks, n_gate_up][kind] };
                let i = rank.next[q];
                if i >= len {
                    return None;
                }
                rank.next[q] += 1;
                Some(match kind {
                    GATHER => Unit::Gather(r, set, i),
                    DOWN_DGRAD => Unit::DownDgrad(r, set, i / n_down),
                    SWIGLU => Unit::Swiglu(r, set, i / n_chunks),
                    GATE_UP_DGRAD => Unit::GateUpDgrad(r, set, i / n_gate_up),
                    _ => Unit::Combine(r, i),
                })
            }

            fn ready(&self, unit: Unit) -> bool {
                let (nd, nc, ng) = (self.n_down_dgrad, self.n_chunks, self.n_gate_up_dgrad);
                match unit {
                    Unit::Gather(..) | Unit::SpareLeaves(_) | Unit::Dots(..) => true,
                    Unit::Barrier(block) => self.barrier.open(block),
                    Unit::DownDgrad(r, set, m) => self.ranks[r].sets[set].gathered[m],
                    Unit::Swiglu(r, set, m) => self.ranks[r].sets[set].down_dgrad[m] == nd,
                    Unit::GateUpDgrad(r, set, m) => self.ranks[r].sets[set].swiglu[m] == nc,
                    Unit::Wgrad(r, w, g) => {
                        let rank = &self.ranks[r];
                        let routed = &rank.sets[0];
                        (0..rank.expert_of_tile.len())
                            .filter(|&m| rank.expert_of_tile[m] == g)
                            .all(|m| if w == 0 { routed.gathered[m] } else { routed.swiglu[m] == nc })
                    }
                    Unit::Combine(r, t) => {
                        let rank = &self.ranks[r];
                        let shared = &rank.sets[1];
                        let shared_ready = shared.gathered.is_empty()
                            || shared.gate_up_dgrad[t * shared.gathered.len() / rank.tokens.len()] == ng;
                        shared_ready
                            && rank.tokens[t].iter().all(|&(owner, m)| self.ranks[owner].sets[0].gate_up_dgrad[m] == ng)
                    }
                }
            }

            fn finish(&mut self, unit: Unit) {
                match unit {
                    Unit::Gather(r, set, m) => self.ranks[r].sets[set].gathered[m] = true,
                    Unit::DownDgrad(r, set, m) => self.ranks[r].sets[set].down_dgrad[m] += 1,
                    Unit::Swiglu(r, set, m) => self.ranks[r].sets[set].swiglu[m] += 1,
                    Unit::GateUpDgrad(r, set, m) => self.ranks[r].sets[set].gate_up_dgrad[m] += 1,
                    Unit::Wgrad(r, w, _) => self.ranks[r].wgrad_done[w] += 1,
                    Unit::Combine(r, _) => self.ranks[r].combined += 1,
                    Unit::Dots(r, t) => self.ranks[r].dots[t] += 1,
                    Unit::SpareLeaves(block) => self.barrier.leave(block),
                    Unit::Barrier(_) => {}
                }
            }

            fn pipelined(unit: Unit) -> bool {
                matches!(unit, Unit::DownDgrad(..) | Unit::Swiglu(..) | Unit::GateUpDgrad(..) | Unit::Wgrad(..))
            }
        }

        #[test]
        fn every_geometry_with_the_weight_gradients_walked_across_ranks_completes() {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            for case in 0..400 {
                // Half the cases with the data-gradient tiles shared across ranks too, and
                // (crossed with that) half with a shared expert.
                let share_tiles = case % 2 == 0;
                let with_shared = case % 4 < 2;
                // Crossed with both, half with the slot-weight gradients taken early.
                let early = case % 8 < 4;
                let ranks = 1 + rng.below(8);
                assert!(3 * ranks <= BARRIER_TAKEN + SPARE_LEAVES, "the barrier's `taken` entries stay apart");
                let experts = 1 + rng.below(4);
                let wgrad_tiles = 1 + rng.below(5);
                // Every rank's ring: 1 to 6 M tiles, each of one of its experts (an expert
                // without one is empty: its weight-gradient tiles wait for nothing).
                let rings: Vec<Vec<usize>> =
                    (0..ranks).map(|_| (0..1 + rng.below(6)).map(|_| rng.below(experts)).collect()).collect();
                let world_ranks = (0..ranks)
                    .map(|_| {
                        (0..1 + rng.below(8))
                            .map(|_| {
                                (0..1 + rng.below(3))
                                    .map(|_| {
                                        let owner = rng.below(ranks);
                                        (owner, rng.below(rings[owner].len()))
                                    })
                                    .collect()
                            })
                            .collect()
                    })
                    .collect::<Vec<Vec<Vec<(usize, usize)>>>>();
                let mut world = BackwardRanks {
                    ranks: rings
                        .iter()
                        .zip(world_ranks)
                        .map(|(ring, tokens)| {
                            // The shared expert: 1 to T M tiles over the rank's own tokens.
                            let shared_tiles = if with_shared { 1 + rng.below(tokens.len()) } else { 0 };
                            let token_count = tokens.len();
                            Rank {
                                expert_of_tile: ring.clone(),
                                sets: [Set::new(ring.len()), Set::new(shared_tiles)],
                                tokens,
                                wgrad_done: [0; 3],
                                combined: 0,
                                dots: vec![0; token_count],
                                next: [0; 10],
                            }
                        })
                        .collect(),
                    experts,
                    wgrad_tiles,
                    n_down_dgrad: 1 + rng.below(3),
                    n_chunks: 1 + rng.below(3),
                    n_gate_up_dgrad: 1 + rng.below(3),
                    barrier: FinalBarrier::new(0),
                };
                // The same comm blocks and 1 to 3 pairs per rank; compute blocks numbered
                // across the launch, rank by rank (the kernel's `weight_tile_walk`).
                let comm_blocks = rng.below(3);
                let pairs: Vec<usize> = (0..ranks).map(|_| 1 + rng.below(3)).collect();
                let launch_compute: usize = pairs.iter().map(|p| 2 * p).sum();
                world.barrier = FinalBarrier::new(launch_compute);
                // A data gradient's queues: the own rank's, or every rank's in turn.
                let walk = |q: usize| if share_tiles { (0..ranks).map(|r| of_rank(q, r)).collect() } else { vec![q] };
                let mut compute_queues = walk(SHARED + DOWN_DGRAD);
                compute_queues.extend(walk(DOWN_DGRAD));
                // The consumers' SwiGLU chunks: the shared expert's of every rank, then the
                // routed ones, rank after rank (`in_walk_order!`), or their own rank's.
                compute_queues.extend(walk(SHARED + SWIGLU));
                compute_queues.extend(walk(SWIGLU));
                compute_queues.extend(walk(SHARED + GATE_UP_DGRAD));
                compute_queues.extend(walk(GATE_UP_DGRAD));
                for w in 0..3 {
                    compute_queues.extend((0..ranks).map(|q| wgrad(w, q, ranks)));
                }
                compute_queues.extend([BARRIER, DOTS, COMBINE]);
                let mut agents = Vec::new();
                let mut index = 0;
                for (rank, &p) in pairs.iter().enumerate() {
                    let comm = Who { rank, ..Who::default() };
                    agents.extend(
                        (0..comm_blocks).map(|_| Agent::new(comm, vec![SHARED + GATHER, GATHER, DOTS, COMBINE])),
                    );
                    for _ in 0..2 * p {
                        let who = Who { rank, compute: (index, launch_compute), ..Who::default() };
                        agents.push(Agent::new(who, compute_queues.clone()));
                        // The block's three spare producer warps: the gather, then the SwiGLU
                        // chunks (the shared expert's first; with shared tiles every rank's in the
                        // walk's order), early the slot-weight gradients, then the final barrier.
                        let mut spare: Vec<usize> =
                            [SHARED + GATHER, GATHER, SHARED + SWIGLU, SWIGLU].iter().flat_map(|&q| walk(q)).collect();
                        if early {
                            spare.extend(walk(DOTS));
                        }
                        spare.push(SPARE_LEAVES);
                        agents.extend((0..3).map(|_| Agent::new(who, spare.clone())));
                        index += 1;
                    }
                }
                let what = format!(
                    "case {case}: {ranks} ranks, {comm_blocks} comm blocks, pairs {pairs:?}, data-gradient tiles \
                     shared across ranks: {share_tiles}, shared expert: {with_shared}, slot-weight gradients early: \
                     {early}"
                );
                run_to_completion(&mut world, &mut agents, &mut rng, &what);
                for (r, rank) in world.ranks.iter().enumerate() {
                    for set in &rank.sets {
                        assert!(set.gate_up_dgrad.iter().all(|&n| n == world.n_gate_up_dgrad), "{what}: rank {r}");
                    }
                    assert_eq!(rank.wgrad_done, [experts * wgrad_tiles; 3], "{what}: rank {r}: every tile once");
                    assert_eq!(rank.combined, rank.tokens.len(), "{what}: rank {r}");
                    assert!(
                        rank.dots.iter().all(|&n| n == 1),
                        "{what}: rank {r}: every token's slot-weight gradients once"
                    );
                }
            }
        }
    }
}
