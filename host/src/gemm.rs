//! Host side of the sm_90a tensor-core GEMM engine (`kernels/src/gemm/engine.rs`): builds the
//! tensor maps and the parameter block once ([`EnginePlan`]), then launches as often as wanted
//! without touching the host again.
//!
//! Every plan works on device-written group offsets: `row_offsets[G+1]` (first row of each
//! group) and, for row-grouped variants, `tile_offsets[2(G+1)]` (tiles of [`TILE_M`] rows, and
//! which groups have an odd tile count), made on the device by [`tile_offsets`]. The host never
//! learns the group sizes.

use half::bf16;
use mok_kernels::comm::params::ERROR_WORDS;
use mok_kernels::gemm_layout::{
    ENGINE_SMEM_BYTES, ENGINE_THREADS, GROUP_MAP_SLOTS, GROUP_MAP_SMEM_BYTES, GROUP_MAP_WARPS, GemmParams,
    TENSOR_MAP_BYTES, TILE_M, TILE_N, Variant, cluster_blocks,
};

use crate::driver::{DeviceBuffer, DeviceSlice, Gpu, KernelArg, LaunchShape, check_aligned};
use crate::error::{MokError, Result};
use crate::tensor_map::TensorMap;

/// Kernels of the engine (sm_90a only).
pub const ENGINE_KERNELS: [&str; 6] = [
    "mok_sm90_gemm_gate_up",
    "mok_sm90_gemm_rows_nt",
    "mok_sm90_gemm_rows_nt_bf16",
    "mok_sm90_gemm_rows_nn",
    "mok_sm90_gemm_wgrad",
    GROUP_MAPS_KERNEL,
];

/// The gate/up kernel whose producer gathers its rows through the routing layout
/// ([`EnginePlan::gate_up_gathering`]).
pub const GATE_UP_GATHERING_KERNEL: &str = "mok_sm90_gemm_gate_up_gathering";

/// The weight gradient whose producer gathers B's rows through the routing layout
/// ([`EnginePlan::wgrad_gathering`]).
pub const WGRAD_GATHERING_KERNEL: &str = "mok_sm90_gemm_wgrad_gathering";

/// Writes the per-group tensor maps (`GemmParams::group_maps`) before each engine launch.
const GROUP_MAPS_KERNEL: &str = "mok_sm90_group_maps";
/// The same for several plans in one launch (a megakernel pass's plans).
pub(crate) const GROUP_MAPS_PLANS_KERNEL: &str = "mok_sm90_group_maps_plans";
/// Writes the row-grouped plans' tile offsets ([`tile_offsets`]).
const TILE_OFFSETS_KERNEL: &str = "mok_tile_offsets";

/// Whether `gpu` can run the engine: an sm_90 GPU (Hopper) whose loaded PTX has every engine
/// kernel (a PTX given through `MOK_PTX` may predate some).
pub fn engine_available(gpu: &Gpu) -> bool {
    gpu.compute_capability().0 == 9
        && ENGINE_KERNELS.iter().chain(&[TILE_OFFSETS_KERNEL]).all(|kernel| gpu.has_kernel(kernel))
}

/// `[2 · (groups + 1)]` tile offsets (tiles of `TILE_M` rows, then the count of groups with an
/// odd tile count before each; `GemmParams::tile_offsets`) from `[groups + 1]` row offsets,
/// computed on the device, ordered on the stream after whatever wrote the row offsets.
pub fn tile_offsets<'r>(
    gpu: &Gpu,
    row_offsets: impl Into<DeviceSlice<'r, u32>>,
    groups: usize,
) -> Result<DeviceBuffer<u32>> {
    group_count(groups)?;
    let tiles = DeviceBuffer::alloc(gpu, 2 * (groups + 1))?;
    tile_offsets_into(gpu, row_offsets, groups, &tiles)?;
    Ok(tiles)
}

/// As [`tile_offsets`], into an existing `[2 · (groups + 1)]` buffer (a plan built for it stays
/// valid: its address does not change).
pub fn tile_offsets_into<'r>(
    gpu: &Gpu,
    row_offsets: impl Into<DeviceSlice<'r, u32>>,
    groups: usize,
    tiles: &DeviceBuffer<u32>,
) -> Result<()> {
    let group_count = group_count(groups)?;
    let row_offsets = row_offsets.into();
    check_len("row_offsets", row_offsets.len(), groups + 1)?;
    check_len("tile_offsets", tiles.len(), 2 * (groups + 1))?;
    // SAFETY: the arguments are the kernel's parameters, in order and type (its entry point in
    // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
    unsafe {
        gpu.launch(
            TILE_OFFSETS_KERNEL,
            LaunchShape::linear(1, 32),
            &[
                KernelArg::Ptr(row_offsets.device_ptr()),
                KernelArg::U32(group_count),
                KernelArg::U32(TILE_M),
                KernelArg::Ptr(tiles.device_ptr()),
            ],
        )
    }
}

/// `groups` as the kernel's 32-bit count, refused where it or the `2 · (groups + 1)` offsets
/// would not fit in 32 bits.
fn group_count(groups: usize) -> Result<u32> {
    u32::try_from(groups).ok().filter(|&g| g < u32::MAX / 2).ok_or_else(|| MokError::InvalidInput {
        tensor: "groups",
        problem: format!("{groups} groups: the tile offsets are counted in 32 bits"),
    })
}

fn check_len(tensor: &'static str, actual: usize, expected: usize) -> Result<()> {
    if actual >= expected {
        Ok(())
    } else {
        Err(MokError::InvalidInput { tensor, problem: format!("has {actual} elements, needs at least {expected}") })
    }
}

fn check_width(field: &'static str, value: usize) -> Result<()> {
    if value > 0 && value.is_multiple_of(8) {
        Ok(())
    } else {
        Err(MokError::InvalidInput {
            tensor: field,
            problem: format!("width {value} must be a positive multiple of 8 (16-byte rows for TMA)"),
        })
    }
}

/// Row groups of a row-grouped product: device offsets and the row capacity of the buffers.
pub struct RowGroups<'a> {
    /// `[groups + 1]` first row of each group (a layer's routing layout, or a ring's offsets in
    /// the symmetric heap).
    pub row_offsets: DeviceSlice<'a, u32>,
    /// `[2 · (groups + 1)]` tile offsets of the groups (from [`tile_offsets`], or written by the
    /// exchange's schedule for a ring).
    pub tile_offsets: DeviceSlice<'a, u32>,
    /// Groups.
    pub groups: usize,
    /// Rows the row buffers hold (an upper bound on `row_offsets[groups]`).
    pub capacity: usize,
}

impl RowGroups<'_> {
    /// The offset buffers have the lengths the engine reads.
    fn check(&self) -> Result<()> {
        check_len("row_offsets", self.row_offsets.len(), self.groups + 1)?;
        check_len("tile_offsets", self.tile_offsets.len(), 2 * (self.groups + 1))
    }
}

/// How the blocks of a row-grouped plan pair up (`GemmParams::m_pairs`). Results are the same
/// either way — each tile is computed whole by one block, in fixed K order — only the speed
/// differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pairing {
    /// M-pairs where a group has two 128-row M tiles for them (the blocks split the loading of
    /// the weight tile they share), N-pairs for a group's odd last M tile.
    MAndN,
    /// Every M tile N-paired (the blocks share its rows and take two neighbouring N tiles).
    NOnly,
}

/// `rows_nt` plans with at least this K pair by M and N, shorter ones by N only (measured,
/// docs/PERF.md v18 and v19): the down projections (K = the expert width, 1024–3072 at the
/// frontier shapes) ran 1–3 % faster as N-pairs, the dense 8 × [8192 × 7168] · [7168 × 4096]
/// case 3 % faster as M-pairs.
pub const ROWS_NT_M_PAIRS_MIN_K: usize = 4096;

impl Pairing {
    /// The plans' default, measured (docs/PERF.md v18, v19): M-pairs where the weight tile is the
    /// larger stream (gate/up, data gradients), and for `rows_nt` (and its bf16 twin) with
    /// K ≥ [`ROWS_NT_M_PAIRS_MIN_K`]; N-pairs only for `rows_nt` with a shorter K (the down
    /// projection).
    fn default_for(variant: u32, k: usize) -> Self {
        let rows_nt = variant == Variant::ROWS_NT || variant == Variant::ROWS_NT_BF16;
        if rows_nt && k < ROWS_NT_M_PAIRS_MIN_K { Pairing::NOnly } else { Pairing::MAndN }
    }

    fn m_pairs(self) -> u32 {
        u32::from(self == Pairing::MAndN)
    }
}

/// Where a weight gradient goes.
pub enum WgradOut<'a> {
    /// Written as bf16 `[G][M][N]`.
    Bf16(DeviceSlice<'a, bf16>),
    /// Added into caller-owned f32 `[G][M][N]` (gradient accumulation across micro-batches).
    AccumulateF32(DeviceSlice<'a, f32>),
}

/// Where the output rows of [`EnginePlan::rows_nt`] go.
#[derive(Clone, Copy)]
pub enum RowsOut<'a> {
    /// f32 `[cap][n]`: the down projection (the combine sums f32 expert outputs).
    F32(&'a DeviceBuffer<f32>),
    /// bf16 `[cap][n]`, each element rounded once from its f32 sum (what `torch._grouped_mm`
    /// returns).
    Bf16(&'a DeviceBuffer<bf16>),
}

/// One prepared engine launch: the parameter block and tensor maps live on the device.
pub struct EnginePlan {
    kernel: &'static str,
    /// The parameter block as uploaded (kept to change the pairing).
    host_params: GemmParams,
    /// Blocks per cluster of the kernel (2: row-grouped variants run in pairs).
    cluster_blocks: u32,
    /// The persistent grid: one block per SM, or for clustered kernels as many whole clusters
    /// as can be resident at once (fewer than SMs / 2 where a GPC's SMs do not pair up).
    resident_blocks: u32,
    params: DeviceBuffer<u8>,
    groups: u32,
    /// Row-grouped plans: the most engine M tiles their groups can hold (row capacity / 128 +
    /// groups), the size a [`TileReadiness`] must have for [`Self::launch_counted`].
    max_m_tiles: usize,
    /// Row-grouped plans: the rows their groups can hold (`RowGroups::capacity`).
    row_capacity: usize,
    /// The width of the rows the plan's producer gathers from tokens given at each launch
    /// ([`Self::launch_gathering`]) rather than reading a rows buffer (gate/up: H, its K; the
    /// gate and up weight gradients: H, their N); `None` for a plan that reads its buffers.
    gather_width: Option<usize>,
    _maps: Vec<TensorMap>,
    _group_maps: DeviceBuffer<u64>,
    _tile_counter: DeviceBuffer<u32>,
}

impl EnginePlan {
    /// `cut`: the tensors whose rows are grouped (slot 0: A; slot 1: the second A or the weight
    /// gradient's B; slot 2: the output rows) as (index of their whole-buffer map in `maps`,
    /// buffer address, row pitch in bytes); the device cuts those maps at group ends before each
    /// launch.
    fn new(
        gpu: &Gpu,
        kernel: &'static str,
        variant: u32,
        mut params: GemmParams,
        maps: Vec<TensorMap>,
        cut: [Option<(usize, u64, usize)>; GROUP_MAP_SLOTS as usize],
    ) -> Result<Self> {
        gpu.set_max_dynamic_smem(kernel, ENGINE_SMEM_BYTES)?;
        let cluster_blocks = cluster_blocks(variant);
        let resident_blocks = if cluster_blocks > 1 {
            let clusters = gpu.max_active_clusters(kernel, ENGINE_THREADS, ENGINE_SMEM_BYTES, cluster_blocks)?;
            (clusters * cluster_blocks).min(gpu.multiprocessors().next_multiple_of(cluster_blocks))
        } else {
            gpu.multiprocessors()
        };
        let groups = params.groups;
        let map_words = (TENSOR_MAP_BYTES / 8) as usize;
        let mut group_maps = DeviceBuffer::<u64>::alloc(gpu, (groups.max(1) * GROUP_MAP_SLOTS) as usize * map_words)?;
        // The group-map kernel publishes each map with atomic exchanges, which read the old
        // words: zero them once so no launch reads memory nothing has written (initcheck).
        group_maps.fill_bytes(0)?;
        params.group_maps = group_maps.device_ptr();
        let tile_counter = DeviceBuffer::<u32>::alloc(gpu, 1)?;
        params.tile_counter = tile_counter.device_ptr();
        for (slot, operand) in cut.iter().enumerate() {
            if let Some((map, base, pitch_bytes)) = operand {
                params.cut_maps[slot] = maps[*map].device_ptr();
                params.cut_bases[slot] = *base;
                params.cut_pitches[slot] = u32::try_from(*pitch_bytes).map_err(|_| MokError::InvalidInput {
                    tensor: "operand",
                    problem: format!("row pitch {pitch_bytes} bytes does not fit in 32 bits"),
                })?;
            }
        }
        Ok(Self {
            kernel,
            host_params: params,
            cluster_blocks,
            resident_blocks,
            params: DeviceBuffer::from_slice(gpu, params_bytes(&params))?,
            groups,
            max_m_tiles: 0,
            row_capacity: 0,
            gather_width: None,
            _maps: maps,
            _group_maps: group_maps,
            _tile_counter: tile_counter,
        })
    }

    /// Sets how the blocks of a row-grouped plan pair up (each plan starts with the measured
    /// default, see [`Pairing`]). The results do not change. Weight-gradient plans run their
    /// blocks alone: an error.
    pub fn set_pairing(&mut self, gpu: &Gpu, pairing: Pairing) -> Result<()> {
        if self.cluster_blocks == 1 {
            return Err(MokError::InvalidInput {
                tensor: "pairing",
                problem: format!("{} runs its blocks alone; only row-grouped plans pair them", self.kernel),
            });
        }
        self.host_params.m_pairs = pairing.m_pairs();
        self.params = DeviceBuffer::from_slice(gpu, params_bytes(&self.host_params))?;
        Ok(())
    }

    /// Enqueues the launch with the persistent grid: one block per SM, or as many whole
    /// clusters as fit at once ([`EnginePlan::resident_blocks`]).
    ///
    /// A plan holds one set of per-group maps and one tile counter, both rewritten by the
    /// group-map kernel that precedes every engine launch: launch a plan from one thread at a
    /// time, on its GPU's single stream (two interleaved launches of the same plan would let the
    /// second engine find the counter already spent and compute nothing). Use one plan per
    /// concurrent product.
    ///
    /// # Safety
    /// Every buffer the plan was built over — the rows, the weights, the outputs, the row and
    /// tile offsets — is still allocated at the size the plan checked when the stream runs the
    /// launch: the plan keeps their addresses, not borrows of them.
    pub unsafe fn launch(&self, gpu: &Gpu) -> Result<()> {
        // SAFETY: caller contract.
        unsafe { self.launch_with_blocks(gpu, self.resident_blocks) }
    }

    /// The device address of the plan's parameter block (a persistent kernel that runs this
    /// plan's tiles reads it).
    pub(crate) fn params_ptr(&self) -> u64 {
        self.params.device_ptr()
    }

    /// The plan's parameter block as uploaded (its device copy's bytes).
    pub(crate) fn host_params(&self) -> &GemmParams {
        &self.host_params
    }

    /// The kernel the plan launches.
    pub(crate) fn kernel(&self) -> &'static str {
        self.kernel
    }

    /// `(M, N)` of a weight-gradient plan's `[G][M][N]` output (row-grouped plans: `(0, N)`).
    pub(crate) fn output_dims(&self) -> (u32, u32) {
        (self.host_params.m, self.host_params.n)
    }

    /// Row-grouped plans: the most engine M tiles their groups can hold (rows / 128 + groups).
    pub(crate) fn max_m_tiles(&self) -> usize {
        self.max_m_tiles
    }

    /// The blocks [`EnginePlan::launch`] starts: one per SM, or for the paired (clustered)
    /// variants twice the clusters that can be resident at once (from the driver's occupancy
    /// query when the plan was built).
    pub fn resident_blocks(&self) -> u32 {
        self.resident_blocks
    }

    /// Groups of the plan.
    pub(crate) fn groups(&self) -> u32 {
        self.groups
    }

    /// Enqueues `mok_sm90_group_maps` for this plan: the group bounds may have changed since the
    /// last launch (they are device-written), so the maps are cut again, on the same stream,
    /// before the engine reads them. The same kernel zeroes the engine's tile counter.
    pub(crate) fn cut_group_maps(&self, gpu: &Gpu) -> Result<()> {
        let maps_shape = LaunchShape {
            grid: (self.groups.div_ceil(GROUP_MAP_WARPS).max(1), 1, 1),
            threads: 32 * GROUP_MAP_WARPS,
            smem_bytes: GROUP_MAP_SMEM_BYTES,
        };
        // SAFETY: the group-map kernel's one parameter, this plan's live parameter block.
        unsafe { gpu.launch(GROUP_MAPS_KERNEL, maps_shape, &[KernelArg::Ptr(self.params.device_ptr())]) }
    }

    /// Enqueues the launch with `blocks` persistent blocks, rounded up to whole clusters (pairs,
    /// for the row-grouped variants); results do not depend on it.
    ///
    /// # Safety
    /// As [`Self::launch`].
    pub unsafe fn launch_with_blocks(&self, gpu: &Gpu, blocks: u32) -> Result<()> {
        if self.gather_width.is_some() {
            return Err(MokError::InvalidInput {
                tensor: "plan",
                problem: format!("{} gathers its rows from tokens: launch it with launch_gathering", self.kernel),
            });
        }
        // SAFETY: the kernel's one parameter, this plan's parameter block, whose every address is a
        // live allocation of the size it documents (caller contract).
        unsafe { self.enqueue(gpu, blocks, &[KernelArg::Ptr(self.params.device_ptr())]) }
    }

    /// Cuts the group maps, then launches the plan's kernel with `args` on `blocks` persistent
    /// blocks, rounded up to whole clusters.
    ///
    /// # Safety
    /// `args` are the plan's kernel's parameters, in order and type, and valid for it.
    unsafe fn enqueue(&self, gpu: &Gpu, blocks: u32, args: &[KernelArg<'_>]) -> Result<()> {
        let blocks = blocks.max(1).next_multiple_of(self.cluster_blocks);
        self.cut_group_maps(gpu)?;
        let shape = LaunchShape { grid: (blocks, 1, 1), threads: ENGINE_THREADS, smem_bytes: ENGINE_SMEM_BYTES };
        // SAFETY: caller contract.
        unsafe { gpu.launch(self.kernel, shape, args) }
    }

    /// Enqueues a plan built by [`EnginePlan::gate_up_gathering`] or
    /// [`EnginePlan::wgrad_gathering`] with the persistent grid: its producers read row `r` of
    /// the groups as row `row_source[r] / top_k` of `x` (`[T][h]` bf16 tokens; `row_source` the
    /// routing layout's slot `t · top_k + j` of each row).
    ///
    /// # Safety
    /// As [`Self::launch`]; `row_source` holds, for every row of the groups' device-written
    /// offsets, a slot below `T · top_k` (as the routing layout writes it, on the same stream
    /// before the launch), and `x` stays allocated until the stream has run the launch.
    pub unsafe fn launch_gathering(
        &self,
        gpu: &Gpu,
        x: DeviceSlice<'_, bf16>,
        row_source: DeviceSlice<'_, u32>,
        top_k: usize,
    ) -> Result<()> {
        // SAFETY: caller contract.
        unsafe { self.launch_gathering_with_blocks(gpu, (x, row_source, top_k), self.resident_blocks) }
    }

    /// As [`Self::launch_gathering`] with `blocks` persistent blocks, rounded up to whole
    /// clusters; results do not depend on it.
    ///
    /// # Safety
    /// As [`Self::launch_gathering`].
    pub unsafe fn launch_gathering_with_blocks(
        &self,
        gpu: &Gpu,
        (x, row_source, top_k): (DeviceSlice<'_, bf16>, DeviceSlice<'_, u32>, usize),
        blocks: u32,
    ) -> Result<()> {
        let Some(h) = self.gather_width else {
            return Err(MokError::InvalidInput {
                tensor: "plan",
                problem: format!("{} reads a rows buffer: launch it with launch", self.kernel),
            });
        };
        if x.is_empty() || !x.len().is_multiple_of(h) {
            return Err(MokError::InvalidInput {
                tensor: "x",
                problem: format!("{} elements: needs whole rows of {h}", x.len()),
            });
        }
        check_aligned("x", x.device_ptr(), 16)?;
        check_len("row_source", row_source.len(), self.row_capacity)?;
        let top_k = u32::try_from(top_k).ok().filter(|&k| k > 0).ok_or_else(|| MokError::InvalidInput {
            tensor: "top_k",
            problem: format!("{top_k}: must be in 1..=u32::MAX"),
        })?;
        let args = [
            KernelArg::Ptr(self.params.device_ptr()),
            KernelArg::Ptr(x.device_ptr()),
            KernelArg::Ptr(row_source.device_ptr()),
            KernelArg::U32(top_k),
            KernelArg::U32((2 * h) as u32),
        ];
        // SAFETY: the gathering kernel's parameters in order and type (kernels/src/entry/gemm_sm90.rs):
        // the plan's live block (caller contract), x checked above (whole 16-byte aligned rows
        // of h, alive by the caller's contract), row_source as long as the plan's row capacity
        // with slots below T · top_k (caller contract).
        unsafe { self.enqueue(gpu, blocks, &args) }
    }

    /// As [`Self::launch`], through the hooked kernel of the plan's variant (gate/up and the
    /// `f32` down projection): each block's producer waits, bounded, until `readiness` says the
    /// rows of a tile's M tile landed, and each consumer warpgroup counts its stored part of the
    /// tile there. The persistent forward's hand-over, here launched on its own (the rows
    /// already in place, or not, as a test sets them). A failed wait is read back with
    /// [`TileReadiness::check`].
    ///
    /// # Safety
    /// As [`Self::launch`].
    pub unsafe fn launch_counted(&self, gpu: &Gpu, readiness: &TileReadiness) -> Result<()> {
        let kernel = match self.kernel {
            "mok_sm90_gemm_gate_up" => "mok_sm90_gemm_gate_up_counted",
            "mok_sm90_gemm_rows_nt" => "mok_sm90_gemm_rows_nt_counted",
            other => {
                return Err(MokError::InvalidInput {
                    tensor: "plan",
                    problem: format!("{other} has no hooked kernel (gate/up and the f32 down projection have)"),
                });
            }
        };
        if readiness.rows_landed.len() < self.max_m_tiles || readiness.tiles_stored.len() < self.max_m_tiles {
            return Err(MokError::InvalidInput {
                tensor: "readiness",
                problem: format!(
                    "counters for {} M tiles; the plan's groups can hold {} (rows / 128 + groups)",
                    readiness.rows_landed.len().min(readiness.tiles_stored.len()),
                    self.max_m_tiles
                ),
            });
        }
        gpu.set_max_dynamic_smem(kernel, ENGINE_SMEM_BYTES)?;
        self.cut_group_maps(gpu)?;
        let shape =
            LaunchShape { grid: (self.resident_blocks, 1, 1), threads: ENGINE_THREADS, smem_bytes: ENGINE_SMEM_BYTES };
        let args = [KernelArg::Ptr(self.params.device_ptr()), KernelArg::Ptr(readiness.block.device_ptr())];
        // SAFETY: the hooked kernel's parameters (the plan's block, whose addresses are live by the
        // caller's contract, and a `TileCounters` block); `readiness` holds an entry for every
        // engine M tile the plan's groups can have (checked above) and its buffers are freed only
        // after the stream's work (cuMemFree waits).
        unsafe { gpu.launch(kernel, shape, &args) }
    }

    /// Forward gate/up with SwiGLU: `hidden = swiglu(rows·w_gate[g]ᵀ, rows·w_up[g]ᵀ)` per group,
    /// optionally keeping the f32 pre-activations. `rows` `[cap][h]`, weights `[G][i][h]`,
    /// outputs `[cap][i]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gate_up<'r, 'w>(
        gpu: &Gpu,
        rows: impl Into<DeviceSlice<'r, bf16>>,
        groups: &RowGroups<'_>,
        w_gate: impl Into<DeviceSlice<'w, bf16>>,
        w_up: impl Into<DeviceSlice<'w, bf16>>,
        (h, i): (usize, usize),
        swiglu_limit: Option<f32>,
        hidden_out: &DeviceBuffer<bf16>,
        pre_activations: Option<(&DeviceBuffer<f32>, &DeviceBuffer<f32>)>,
    ) -> Result<Self> {
        let weights = (w_gate.into(), w_up.into());
        Self::gate_up_from(gpu, Some(rows.into()), groups, weights, (h, i), swiglu_limit, hidden_out, pre_activations)
    }

    /// [`EnginePlan::gate_up`] without a rows buffer: each launch
    /// ([`EnginePlan::launch_gathering`]) names the tokens, and the kernel's producers gather
    /// row `r` of the groups as row `row_source[r] / top_k` of them into each stage (no
    /// gathered copy is written). The same bits as [`EnginePlan::gate_up`] over the gathered
    /// rows. `groups.capacity` bounds the rows, as for the outputs.
    #[allow(clippy::too_many_arguments)]
    pub fn gate_up_gathering<'w>(
        gpu: &Gpu,
        groups: &RowGroups<'_>,
        w_gate: impl Into<DeviceSlice<'w, bf16>>,
        w_up: impl Into<DeviceSlice<'w, bf16>>,
        (h, i): (usize, usize),
        swiglu_limit: Option<f32>,
        hidden_out: &DeviceBuffer<bf16>,
        pre_activations: Option<(&DeviceBuffer<f32>, &DeviceBuffer<f32>)>,
    ) -> Result<Self> {
        let weights = (w_gate.into(), w_up.into());
        Self::gate_up_from(gpu, None, groups, weights, (h, i), swiglu_limit, hidden_out, pre_activations)
    }

    /// [`EnginePlan::gate_up`] over `rows`, or gathering them (`None`).
    #[allow(clippy::too_many_arguments)]
    fn gate_up_from(
        gpu: &Gpu,
        rows: Option<DeviceSlice<'_, bf16>>,
        groups: &RowGroups<'_>,
        (w_gate, w_up): (DeviceSlice<'_, bf16>, DeviceSlice<'_, bf16>),
        (h, i): (usize, usize),
        swiglu_limit: Option<f32>,
        hidden_out: &DeviceBuffer<bf16>,
        pre_activations: Option<(&DeviceBuffer<f32>, &DeviceBuffer<f32>)>,
    ) -> Result<Self> {
        check_width("hidden", h)?;
        check_width("intermediate", i)?;
        groups.check()?;
        let g = groups.groups;
        if let Some(rows) = rows {
            check_len("rows", rows.len(), groups.capacity * h)?;
        }
        check_len("w_gate", w_gate.len(), g * i * h)?;
        check_len("w_up", w_up.len(), g * i * h)?;
        check_len("hidden_out", hidden_out.len(), groups.capacity * i)?;
        let mut maps = vec![
            weight_map_k_major(gpu, w_gate, h, i, g, TILE_N / 2)?,
            weight_map_k_major(gpu, w_up, h, i, g, TILE_N / 2)?,
            store_map_bf16(gpu, hidden_out, i, groups.capacity)?,
        ];
        if let Some(rows) = rows {
            maps.push(rows_map(gpu, rows, h, groups.capacity)?);
        }
        let (out1, out2) = match pre_activations {
            Some((gate, up)) => {
                check_len("gate_out", gate.len(), groups.capacity * i)?;
                check_len("up_out", up.len(), groups.capacity * i)?;
                (gate.device_ptr(), up.device_ptr())
            }
            None => (0, 0),
        };
        let params = GemmParams {
            map_a: maps.get(3).map_or(0, TensorMap::device_ptr),
            map_b: maps[0].device_ptr(),
            map_b2: maps[1].device_ptr(),
            map_out: maps[2].device_ptr(),
            row_offsets: groups.row_offsets.device_ptr(),
            tile_offsets: groups.tile_offsets.device_ptr(),
            m_pairs: Pairing::default_for(Variant::GATE_UP, h).m_pairs(),
            out0: hidden_out.device_ptr(),
            out1,
            out2,
            groups: g as u32,
            n: i as u32,
            k: h as u32,
            swiglu_limit: swiglu_limit.unwrap_or(f32::INFINITY),
            ..GemmParams::default()
        };
        // A gathering producer reads no rows map: nothing to cut for A.
        let cut = [rows.map(|rows| (3, rows.device_ptr(), 2 * h)), None, Some((2, hidden_out.device_ptr(), 2 * i))];
        let kernel = if rows.is_some() { "mok_sm90_gemm_gate_up" } else { GATE_UP_GATHERING_KERNEL };
        let mut plan = Self::new(gpu, kernel, Variant::GATE_UP, params, maps, cut)?.with_row_capacity(groups);
        plan.gather_width = rows.is_none().then_some(h);
        Ok(plan)
    }

    /// Records the most M tiles `groups` can hold (see `max_m_tiles`).
    fn with_row_capacity(mut self, groups: &RowGroups<'_>) -> Self {
        self.max_m_tiles = groups.capacity.div_ceil(TILE_M as usize) + groups.groups;
        self.row_capacity = groups.capacity;
        self
    }

    /// Row-grouped `out[r] = rows[r] · w[g]ᵀ` (f32 or bf16 rows): `rows` `[cap][k]`, `w`
    /// `[G][n][k]`, `out` `[cap][n]`. The down projection (f32).
    pub fn rows_nt<'w>(
        gpu: &Gpu,
        rows: &DeviceBuffer<bf16>,
        groups: &RowGroups<'_>,
        w: impl Into<DeviceSlice<'w, bf16>>,
        (n, k): (usize, usize),
        out: RowsOut<'_>,
    ) -> Result<Self> {
        check_width("n", n)?;
        check_width("k", k)?;
        groups.check()?;
        let g = groups.groups;
        check_len("rows", rows.len(), groups.capacity * k)?;
        let w = w.into();
        check_len("w", w.len(), g * n * k)?;
        // (address, length, bytes per element, store map, kernel) of the output rows.
        let (out_ptr, out_len, out_bytes, out_map, kernel, variant) = match out {
            RowsOut::F32(b) => (
                b.device_ptr(),
                b.len(),
                4,
                store_map_f32(gpu, b, n, groups.capacity)?,
                "mok_sm90_gemm_rows_nt",
                Variant::ROWS_NT,
            ),
            RowsOut::Bf16(b) => (
                b.device_ptr(),
                b.len(),
                2,
                store_map_bf16(gpu, b, n, groups.capacity)?,
                "mok_sm90_gemm_rows_nt_bf16",
                Variant::ROWS_NT_BF16,
            ),
        };
        check_len("out", out_len, groups.capacity * n)?;
        let maps = vec![
            rows_map(gpu, rows.into(), k, groups.capacity)?,
            weight_map_k_major(gpu, w, k, n, g, TILE_N / 2)?,
            out_map,
        ];
        let params = GemmParams {
            map_a: maps[0].device_ptr(),
            map_b: maps[1].device_ptr(),
            map_out: maps[2].device_ptr(),
            row_offsets: groups.row_offsets.device_ptr(),
            tile_offsets: groups.tile_offsets.device_ptr(),
            m_pairs: Pairing::default_for(variant, k).m_pairs(),
            out0: out_ptr,
            groups: g as u32,
            n: n as u32,
            k: k as u32,
            ..GemmParams::default()
        };
        let cut = [Some((0, rows.device_ptr(), 2 * k)), None, Some((2, out_ptr, out_bytes * n))];
        Ok(Self::new(gpu, kernel, variant, params, maps, cut)?.with_row_capacity(groups))
    }

    /// Row-grouped data gradient `out[r] = a1[r] · w1[g] (+ a2[r] · w2[g])` (f32), weights read
    /// N-major: `a` `[cap][k]`, `w` `[G][k][n]`, `out` `[cap][n]`. Both segments share `k`.
    pub fn rows_nn(
        gpu: &Gpu,
        first: (DeviceSlice<'_, bf16>, DeviceSlice<'_, bf16>),
        second: Option<(DeviceSlice<'_, bf16>, DeviceSlice<'_, bf16>)>,
        groups: &RowGroups<'_>,
        (n, k): (usize, usize),
        out: &DeviceBuffer<f32>,
    ) -> Result<Self> {
        check_width("n", n)?;
        check_width("k", k)?;
        groups.check()?;
        let g = groups.groups;
        let mut maps = Vec::new();
        let mut cut = [None, None, None];
        for (segment, (a, w)) in std::iter::once(first).chain(second).enumerate() {
            check_len("a", a.len(), groups.capacity * k)?;
            check_len("w", w.len(), g * k * n)?;
            cut[segment] = Some((maps.len(), a.device_ptr(), 2 * k));
            maps.push(rows_map(gpu, a, k, groups.capacity)?);
            maps.push(TensorMap::bf16(
                gpu,
                w.device_ptr(),
                &[n as u64, k as u64, g as u64],
                &[2 * n as u64, 2 * (k * n) as u64],
                &[64, 64, 1],
            )?);
        }
        check_len("out", out.len(), groups.capacity * n)?;
        // Maps per segment: rows, then weights; then the output's.
        let second_maps = second.map(|_| (maps[2].device_ptr(), maps[3].device_ptr()));
        cut[2] = Some((maps.len(), out.device_ptr(), 4 * n));
        maps.push(store_map_f32(gpu, out, n, groups.capacity)?);
        let params = GemmParams {
            map_a: maps[0].device_ptr(),
            map_b: maps[1].device_ptr(),
            map_a2: second_maps.map_or(0, |s| s.0),
            map_b2: second_maps.map_or(0, |s| s.1),
            map_out: maps[maps.len() - 1].device_ptr(),
            row_offsets: groups.row_offsets.device_ptr(),
            tile_offsets: groups.tile_offsets.device_ptr(),
            m_pairs: Pairing::default_for(Variant::ROWS_NN, k).m_pairs(),
            out0: out.device_ptr(),
            groups: g as u32,
            n: n as u32,
            k: k as u32,
            k2: if second.is_some() { k as u32 } else { 0 },
            ..GemmParams::default()
        };
        Ok(Self::new(gpu, "mok_sm90_gemm_rows_nn", Variant::ROWS_NN, params, maps, cut)?.with_row_capacity(groups))
    }

    /// Weight gradient per group, `dw[g] = Σ_{r in g} a[r]ᵀ b[r]`, reducing the group's rows
    /// in order (no split-K): `a` `[cap][m]`, `b` `[cap][n]`, output `[G][m][n]`.
    pub fn wgrad<'a>(
        gpu: &Gpu,
        a: impl Into<DeviceSlice<'a, bf16>>,
        b: impl Into<DeviceSlice<'a, bf16>>,
        row_offsets: impl Into<DeviceSlice<'a, u32>>,
        (groups, capacity): (usize, usize),
        (m, n): (usize, usize),
        out: WgradOut<'_>,
    ) -> Result<Self> {
        Self::wgrad_from(gpu, (a.into(), Some(b.into())), row_offsets.into(), (groups, capacity), (m, n), out)
    }

    /// [`EnginePlan::wgrad`] without a `b` buffer: each launch ([`EnginePlan::launch_gathering`])
    /// names the tokens, and the kernel's producers gather K row `r` of a group (b's row `r`) as
    /// row `row_source[r] / top_k` of them (`[T][n]`) into each stage — the gate and up weight
    /// gradients over the tokens, with no gathered copy. The same bits as
    /// [`EnginePlan::wgrad`] over the gathered rows.
    pub fn wgrad_gathering<'a>(
        gpu: &Gpu,
        a: impl Into<DeviceSlice<'a, bf16>>,
        row_offsets: impl Into<DeviceSlice<'a, u32>>,
        (groups, capacity): (usize, usize),
        (m, n): (usize, usize),
        out: WgradOut<'_>,
    ) -> Result<Self> {
        Self::wgrad_from(gpu, (a.into(), None), row_offsets.into(), (groups, capacity), (m, n), out)
    }

    /// [`EnginePlan::wgrad`] over `b`, or gathering it (`None`).
    fn wgrad_from(
        gpu: &Gpu,
        (a, b): (DeviceSlice<'_, bf16>, Option<DeviceSlice<'_, bf16>>),
        row_offsets: DeviceSlice<'_, u32>,
        (groups, capacity): (usize, usize),
        (m, n): (usize, usize),
        out: WgradOut<'_>,
    ) -> Result<Self> {
        check_width("m", m)?;
        check_width("n", n)?;
        check_len("a", a.len(), capacity * m)?;
        if let Some(b) = b {
            check_len("b", b.len(), capacity * n)?;
        }
        check_len("row_offsets", row_offsets.len(), groups + 1)?;
        let rows = capacity.max(1) as u64;
        let mut maps = vec![TensorMap::bf16(gpu, a.device_ptr(), &[m as u64, rows], &[2 * m as u64], &[64, 64])?];
        // The epilogue's TMA stores: `[G][M][N]` in boxes of 64 rows × 128 bytes.
        let out_dims = [n as u64, m as u64, groups.max(1) as u64];
        let (out0, out1, out_map) = match out {
            WgradOut::Bf16(buffer) => {
                check_len("dw", buffer.len(), groups * m * n)?;
                let pitches = [2 * n as u64, 2 * (m * n) as u64];
                (buffer.device_ptr(), 0, TensorMap::bf16(gpu, buffer.device_ptr(), &out_dims, &pitches, &[64, 64, 1])?)
            }
            WgradOut::AccumulateF32(buffer) => {
                check_len("dw", buffer.len(), groups * m * n)?;
                let pitches = [4 * n as u64, 4 * (m * n) as u64];
                (0, buffer.device_ptr(), TensorMap::f32(gpu, buffer.device_ptr(), &out_dims, &pitches, &[32, 64, 1])?)
            }
        };
        maps.push(out_map);
        if let Some(b) = b {
            maps.push(TensorMap::bf16(gpu, b.device_ptr(), &[n as u64, rows], &[2 * n as u64], &[64, 64])?);
        }
        let params = GemmParams {
            map_a: maps[0].device_ptr(),
            map_b: maps.get(2).map_or(0, TensorMap::device_ptr),
            map_out: maps[1].device_ptr(),
            row_offsets: row_offsets.device_ptr(),
            out0,
            out1,
            groups: groups as u32,
            n: n as u32,
            m: m as u32,
            ..GemmParams::default()
        };
        // A group's last K block reads its rows through maps cut at the group's end (a gathering
        // producer zero-fills b's rows past the end itself).
        let cut = [Some((0, a.device_ptr(), 2 * m)), b.map(|b| (2, b.device_ptr(), 2 * n)), None];
        let kernel = if b.is_some() { "mok_sm90_gemm_wgrad" } else { WGRAD_GATHERING_KERNEL };
        let mut plan = Self::new(gpu, kernel, Variant::WGRAD, params, maps, cut)?;
        plan.row_capacity = capacity;
        plan.gather_width = b.is_none().then_some(n);
        Ok(plan)
    }

    /// Whether the plan gathers its rows from tokens given at launch
    /// ([`EnginePlan::launch_gathering`]).
    pub fn gathers_rows(&self) -> bool {
        self.gather_width.is_some()
    }
}

/// A set of plans whose group maps are cut together, in one launch ([`PlanSet::cut_group_maps`])
/// before a pass that runs all of them (a megakernel's plans, of every rank it hosts).
pub(crate) struct PlanSet {
    /// The plans' parameter-block addresses.
    params: DeviceBuffer<u64>,
    /// Groups of the plan with the most.
    max_groups: u32,
}

impl PlanSet {
    /// The set of `plans` (distinct plans; at most 65 535).
    pub(crate) fn new<'a>(gpu: &Gpu, plans: impl IntoIterator<Item = &'a EnginePlan>) -> Result<Self> {
        let plans: Vec<&EnginePlan> = plans.into_iter().collect();
        if plans.is_empty() || plans.len() > u16::MAX as usize {
            return Err(MokError::InvalidInput {
                tensor: "engine plans",
                problem: format!("{} plans in one set (1 to 65535)", plans.len()),
            });
        }
        let addresses: Vec<u64> = plans.iter().map(|p| p.params_ptr()).collect();
        Ok(Self {
            params: DeviceBuffer::from_slice(gpu, &addresses)?,
            max_groups: plans.iter().map(|p| p.groups()).max().unwrap_or(1),
        })
    }

    /// Enqueues `mok_sm90_group_maps_plans` over the set: every plan's maps cut again for the
    /// device-written group bounds, and its tile counter zeroed, as [`EnginePlan::cut_group_maps`]
    /// does for one plan.
    ///
    /// # Safety
    /// Every plan of the set is still alive (the set keeps their addresses, not borrows).
    pub(crate) unsafe fn cut_group_maps(&self, gpu: &Gpu) -> Result<()> {
        let shape = LaunchShape {
            grid: (self.max_groups.div_ceil(GROUP_MAP_WARPS).max(1), self.params.len() as u32, 1),
            threads: 32 * GROUP_MAP_WARPS,
            smem_bytes: GROUP_MAP_SMEM_BYTES,
        };
        // SAFETY: the kernel's one parameter: `gridDim.y` addresses of live, distinct parameter
        // blocks (caller contract).
        unsafe { gpu.launch(GROUP_MAPS_PLANS_KERNEL, shape, &[KernelArg::Ptr(self.params.device_ptr())]) }
    }
}

/// The bytes of a parameter block, as the kernels read it.
fn params_bytes(params: &GemmParams) -> &[u8] {
    // SAFETY: GemmParams is repr(C) plain data (u64, u32, f32 fields, no padding: 18 u64 then 10
    // four-byte fields, 184 bytes, asserted in gemm_layout), so its bytes are initialised.
    unsafe { plain_bytes(params) }
}

/// The bytes of `value`, to upload a parameter block.
///
/// # Safety
/// `T` is `repr(C)` with no padding bytes (every byte initialised).
pub(crate) unsafe fn plain_bytes<T: Copy>(value: &T) -> &[u8] {
    // SAFETY: caller contract; the slice covers exactly `value`.
    unsafe { core::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) }
}

/// `[rows][k]` K-major activations: box of 64 K × 64 rows.
fn rows_map(gpu: &Gpu, rows: DeviceSlice<'_, bf16>, k: usize, capacity: usize) -> Result<TensorMap> {
    // 64-row boxes: each block of a pair loads one half of the shared 128-row A tile.
    TensorMap::bf16(gpu, rows.device_ptr(), &[k as u64, capacity.max(1) as u64], &[2 * k as u64], &[64, 64])
}

/// The epilogue's store map of `[rows][width]` bf16 outputs: boxes of 64 columns × 64 rows.
fn store_map_bf16(gpu: &Gpu, out: &DeviceBuffer<bf16>, width: usize, capacity: usize) -> Result<TensorMap> {
    TensorMap::bf16(gpu, out.device_ptr(), &[width as u64, capacity.max(1) as u64], &[2 * width as u64], &[64, 64])
}

/// The epilogue's store map of `[rows][width]` f32 outputs: boxes of 32 columns × 64 rows.
fn store_map_f32(gpu: &Gpu, out: &DeviceBuffer<f32>, width: usize, capacity: usize) -> Result<TensorMap> {
    TensorMap::f32(gpu, out.device_ptr(), &[width as u64, capacity.max(1) as u64], &[4 * width as u64], &[32, 64])
}

/// `[G][n][k]` K-major weights as a 3-D map (columns past a group's `n` read as zero, never the
/// next group's): box of 64 K × `box_rows` × 1.
fn weight_map_k_major(
    gpu: &Gpu,
    w: DeviceSlice<'_, bf16>,
    k: usize,
    n: usize,
    g: usize,
    box_rows: u32,
) -> Result<TensorMap> {
    TensorMap::bf16(
        gpu,
        w.device_ptr(),
        &[k as u64, n as u64, g as u64],
        &[2 * k as u64, 2 * (n * k) as u64],
        &[64, box_rows, 1],
    )
}

/// The readiness counters of a hooked engine launch ([`EnginePlan::launch_counted`]): per engine
/// M tile (128 rows, numbered over all groups by the tile offsets) a `rows_landed` epoch flag and
/// a `tiles_stored` count, the first-error words, and the `TileCounters` block the kernel reads.
pub struct TileReadiness {
    /// `[m_tiles]` u32.
    pub rows_landed: DeviceBuffer<u32>,
    /// `[m_tiles]` u32.
    pub tiles_stored: DeviceBuffer<u32>,
    error: DeviceBuffer<u32>,
    block: DeviceBuffer<u8>,
    epoch: u32,
}

impl TileReadiness {
    /// Counters for up to `m_tiles` engine M tiles (at most `rows / 128 + groups` for `rows`
    /// rows over `groups` groups), a wait deadline and the pass's `epoch` (≥ 1). Every flag and
    /// count starts at 0: no tile has landed.
    pub fn new(gpu: &Gpu, m_tiles: usize, timeout: std::time::Duration, epoch: u32) -> Result<Self> {
        if epoch == 0 {
            return Err(MokError::InvalidInput { tensor: "epoch", problem: "0: a fresh flag already holds it".into() });
        }
        let zeros = vec![0u32; m_tiles.max(1)];
        let rows_landed = DeviceBuffer::from_slice(gpu, &zeros)?;
        let tiles_stored = DeviceBuffer::from_slice(gpu, &zeros)?;
        let error = DeviceBuffer::from_slice(gpu, &[0u32; ERROR_WORDS])?;
        let counters = mok_kernels::gemm_layout::TileCounters {
            rows_landed: rows_landed.device_ptr(),
            tiles_stored: tiles_stored.device_ptr(),
            error: error.device_ptr(),
            timeout_ns: crate::config::wait_ns(timeout),
            epoch,
            reserved: 0,
        };
        // SAFETY: TileCounters is `repr(C)`: five u64 and two u32, no padding (40 bytes, asserted
        // in gemm_layout).
        let block = DeviceBuffer::from_slice(gpu, unsafe { plain_bytes(&counters) })?;
        Ok(Self { rows_landed, tiles_stored, error, block, epoch })
    }

    /// Clears the stored-part counts and the error words (the flags stay): before reusing the
    /// counters for another launch.
    pub fn reset(&mut self) -> Result<()> {
        self.tiles_stored.upload(&vec![0; self.tiles_stored.len()])?;
        self.error.upload(&[0; ERROR_WORDS])
    }

    /// Marks every M tile's rows as landed for this epoch (rows placed before the launch); the
    /// counts and errors are left as they are ([`Self::reset`] clears them).
    pub fn land_all(&mut self) -> Result<()> {
        let landed = vec![self.epoch; self.rows_landed.len()];
        self.rows_landed.upload(&landed)
    }

    /// Waits for the GPU and reports the launch's first failed wait, if any.
    pub fn check(&self, gpu: &Gpu) -> Result<()> {
        gpu.synchronize()?;
        match engine_error(&self.error.download()?, None) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// The error a hooked engine launch recorded in its `TileCounters::error` words (the exchange's
/// record format, `comm::error`), or `None` when the launch saw none. `rank`: the rank whose pass
/// it was, when there are several.
pub fn engine_error(words: &[u32], rank: Option<usize>) -> Option<MokError> {
    use mok_kernels::comm::error::{ERROR_NONE, ERROR_TIMEOUT, WORD_CODE};
    match words[WORD_CODE] {
        ERROR_NONE => None,
        ERROR_TIMEOUT => Some(crate::exchange::decode_timeout(rank, words)),
        other => Some(MokError::Device {
            kernel: "mok_sm90_gemm_*_counted",
            message: format!("unknown engine error record {other} ({words:?})"),
        }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tile_counter_records_decode_to_errors_naming_the_tile() {
        use mok_kernels::comm::error::{ERROR_TIMEOUT, WAIT_ENGINE_TILE_ROWS};
        // [code, waited for, peer, M tile, epoch expected, seen, rank, epoch], as the hook writes it.
        assert!(super::engine_error(&[0, 0, 0, 5, 3, 2, 0, 3], None).is_none());
        let record = [ERROR_TIMEOUT, WAIT_ENGINE_TILE_ROWS, 0, 17, 4, 3, 0, 4];
        let error = super::engine_error(&record, Some(2)).unwrap();
        match &error {
            MokError::Timeout { rank: Some(2), peer: None, detail, .. } => {
                assert!(
                    detail.contains("M tile 17") && detail.contains("epoch 4") && detail.contains("held 3"),
                    "{detail}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(super::engine_error(&[9, 0, 0, 0, 0, 0, 0, 0], None), Some(MokError::Device { .. })));
    }

    use super::*;

    #[test]
    fn default_pairing_follows_the_variant_and_k() {
        for variant in [Variant::ROWS_NT, Variant::ROWS_NT_BF16] {
            assert_eq!(Pairing::default_for(variant, ROWS_NT_M_PAIRS_MIN_K - 64), Pairing::NOnly);
            assert_eq!(Pairing::default_for(variant, ROWS_NT_M_PAIRS_MIN_K), Pairing::MAndN);
        }
        for variant in [Variant::GATE_UP, Variant::ROWS_NN] {
            assert_eq!(Pairing::default_for(variant, 1024), Pairing::MAndN);
        }
    }
}
