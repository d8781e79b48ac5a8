//! The expert computation over caller-placed rows: gate/up with SwiGLU, down, their backward and
//! the weight gradients, for any set of row groups (routed experts, the shared expert, a ring).

use half::bf16;
use mok_kernels::tiles as kc;

use crate::config::MoeConfig;
use crate::driver::{DeviceBuffer, DeviceSlice, Gpu, KernelArg, LaunchShape};
use crate::error::{MokError, Result};

use super::kept::Kept;
use super::*;
use KernelArg::{F32, Ptr, U32};

/// Rows of one expert group set (routed experts, or the shared expert over all tokens).
pub(super) struct ExpertRows {
    /// `[R][H]` bf16 input rows (routed: gathered x; shared: x itself, not owned).
    pub(super) gate: DeviceBuffer<f32>,
    pub(super) up: DeviceBuffer<f32>,
    pub(super) hidden: DeviceBuffer<bf16>,
    /// `[R][H]` f32 output rows.
    pub(super) out: DeviceBuffer<f32>,
    pub(super) d_rows: DeviceBuffer<bf16>,
    pub(super) d_hidden: DeviceBuffer<f32>,
    pub(super) d_gate: DeviceBuffer<bf16>,
    pub(super) d_up: DeviceBuffer<bf16>,
    pub(super) d_in: DeviceBuffer<f32>,
}

impl ExpertRows {
    fn alloc(gpu: &Gpu, rows: usize, hidden: usize, inter: usize, with_d_rows: bool) -> Result<Self> {
        Ok(Self {
            gate: DeviceBuffer::alloc(gpu, rows * inter)?,
            up: DeviceBuffer::alloc(gpu, rows * inter)?,
            hidden: DeviceBuffer::alloc(gpu, rows * inter)?,
            out: DeviceBuffer::alloc(gpu, rows * hidden)?,
            d_rows: DeviceBuffer::alloc(gpu, if with_d_rows { rows * hidden } else { 0 })?,
            d_hidden: DeviceBuffer::alloc(gpu, rows * inter)?,
            d_gate: DeviceBuffer::alloc(gpu, rows * inter)?,
            d_up: DeviceBuffer::alloc(gpu, rows * inter)?,
            d_in: DeviceBuffer::alloc(gpu, rows * hidden)?,
        })
    }

    /// Sets every byte of every row buffer to `byte` (0 once at creation; NaN bytes to poison).
    fn fill(&mut self, byte: u8) -> Result<()> {
        self.gate.fill_bytes(byte)?;
        self.up.fill_bytes(byte)?;
        self.hidden.fill_bytes(byte)?;
        self.out.fill_bytes(byte)?;
        self.d_rows.fill_bytes(byte)?;
        self.d_hidden.fill_bytes(byte)?;
        self.d_gate.fill_bytes(byte)?;
        self.d_up.fill_bytes(byte)?;
        self.d_in.fill_bytes(byte)
    }
}

/// The expert computation of one set of groups — gate/up GEMM with SwiGLU, down GEMM, their
/// backward and the weight gradients — over rows the caller provides and places: the unfused
/// layer's routed experts (rows gathered in expert order) and shared expert (all tokens), and
/// the expert-parallel exchange's receive ring (rows dispatched from every rank). Each output row
/// depends only on its input row, and each weight gradient reduces over a group's rows in order
/// from the group's first row, so the same rows in the same order give the same bits wherever
/// the group starts.
pub struct ExpertCompute {
    pub(super) rows: ExpertRows,
    hidden: usize,
    inter: usize,
    limit: f32,
    capacity: usize,
}

/// Which rows the grouped GEMMs walk (device addresses; the offsets may be device-written).
#[derive(Clone, Copy, Debug)]
pub struct RowGroups {
    /// `[G+1]` u32: first row of each group; the last entry is the row count.
    pub row_offsets: u64,
    /// `[G+1]` u32: first GEMM M tile of each group (`GEMM_TILE_M` rows per tile).
    pub tile_offsets: u64,
    /// Groups G.
    pub groups: usize,
    /// Upper bound on the row count (sizes the grids; at most the workspace's capacity).
    pub rows_upper_bound: usize,
    /// Address of the row count (a u32 on the device, usually `row_offsets + 4·G`).
    pub row_count: u64,
}

impl RowGroups {
    /// One group holding every token (the shared expert): `offsets` = `[0, T, 0, tiles]`.
    pub fn all_tokens(offsets: &DeviceBuffer<u32>, tokens: usize) -> Self {
        Self {
            row_offsets: offsets.device_ptr(),
            tile_offsets: offsets.device_ptr() + 8,
            groups: 1,
            rows_upper_bound: tokens,
            row_count: offsets.device_ptr() + 4,
        }
    }

    fn check(&self, capacity: usize) -> Result<()> {
        if self.rows_upper_bound > capacity {
            return Err(MokError::InvalidInput {
                tensor: "expert rows",
                problem: format!(
                    "row groups may hold {} rows but the workspace was sized for {capacity}",
                    self.rows_upper_bound
                ),
            });
        }
        Ok(())
    }
}

/// Inputs of [`ExpertCompute::backward`].
pub struct ExpertBackward<'a> {
    /// `[R][H]` bf16: the forward's input rows.
    pub input_rows: u64,
    /// `[R][H]` bf16: gradient of the output rows (dy scaled by the slot weight).
    pub d_out_rows: u64,
    /// `(w_gate, w_up, w_down)` as in [`ExpertCompute::forward`].
    pub weights: [DeviceSlice<'a, bf16>; 3],
    /// Device addresses of `(dw_gate [G, I, H], dw_up [G, I, H], dw_down [G, H, I])`: bf16,
    /// written; or f32, added into, with `accumulate_f32`.
    pub weight_grads: [u64; 3],
    /// Add the weight gradients into f32 buffers (`+=`, one rounding per element) instead of
    /// writing bf16.
    pub accumulate_f32: bool,
}

fn row_grid(rows_upper_bound: usize, groups: usize, n: usize) -> (u32, u32, u32) {
    let m_tiles = mok_kernels::tiles::max_m_tiles(rows_upper_bound as u32, groups as u32);
    (m_tiles, (n as u32).div_ceil(kc::GEMM_TILE_N), 1)
}

fn gemm_shape(grid: (u32, u32, u32)) -> LaunchShape {
    LaunchShape { grid, threads: kc::GEMM_THREADS, smem_bytes: kc::GEMM_SMEM_BYTES }
}

/// [`MoeConfig::validate`]'s rules for the widths and the limit (checked by it, on a config of
/// these widths), and rows the device indexes in 32 bits whose f32 buffers fit in `usize`
/// bytes: [`ExpertCompute::new`] is public, so a caller may reach it without a validated config.
fn check_rows_shape(capacity: usize, hidden: usize, inter: usize, swiglu_limit: Option<f32>) -> Result<()> {
    MoeConfig { swiglu_limit, ..MoeConfig::new(1, hidden, inter, 1, 1) }.validate()?;
    if capacity > i32::MAX as usize || capacity.checked_mul(hidden.max(inter) * 4).is_none() {
        return Err(MokError::InvalidConfig {
            field: "capacity",
            value: capacity.to_string(),
            rule: "rows are indexed in 32 bits on the device: at most i32::MAX, and their f32 bytes must fit in usize"
                .into(),
        });
    }
    Ok(())
}

impl ExpertCompute {
    /// Workspace for up to `capacity` rows of width `hidden` through an intermediate of width
    /// `inter`. `with_d_rows`: also a `[capacity][H]` bf16 buffer for the caller to gather the
    /// output gradient into ([`Self::d_rows`]). The widths and the limit follow
    /// [`MoeConfig::validate`]'s rules (`InvalidConfig` otherwise).
    pub fn new(
        gpu: &Gpu,
        capacity: usize,
        hidden: usize,
        inter: usize,
        swiglu_limit: Option<f32>,
        with_d_rows: bool,
    ) -> Result<Self> {
        check_rows_shape(capacity, hidden, inter, swiglu_limit)?;
        let mut rows = ExpertRows::alloc(gpu, capacity, hidden, inter, with_d_rows)?;
        // Zeroed once: the row buffers are only ever read where a pass wrote them (the NaN-poison
        // tests prove it), but some are written by TMA bulk stores, which compute-sanitizer's
        // initcheck may not count as initialising; zeros make its runs on a fresh layer clean.
        rows.fill(0)?;
        Ok(Self { rows, hidden, inter, limit: swiglu_limit.unwrap_or(f32::INFINITY), capacity })
    }

    /// `[R][H]` f32 output rows of the last forward.
    pub fn out_rows(&self) -> &DeviceBuffer<f32> {
        &self.rows.out
    }

    /// The tensor-core engine's forward plans over `rows` (`[capacity][H]` bf16 in group order)
    /// and this workspace: gate/up + SwiGLU into the hidden rows, keeping the f32
    /// pre-activations the backward reads, then the down projection into the f32 out rows —
    /// what [`Self::forward`] computes, bit for bit. With `rows` `None` the gate/up has no rows
    /// buffer: its producers gather each row from the tokens given at launch
    /// ([`crate::gemm::EnginePlan::gate_up_gathering`]), into the same outputs, bit for bit.
    pub(crate) fn engine_forward_plans(
        &self,
        gpu: &Gpu,
        rows: Option<DeviceSlice<'_, bf16>>,
        groups: &crate::gemm::RowGroups<'_>,
        [w_gate, w_up, w_down]: [DeviceSlice<'_, bf16>; 3],
    ) -> Result<(crate::gemm::EnginePlan, crate::gemm::EnginePlan)> {
        use crate::gemm::{EnginePlan, RowsOut};
        let (h, i, r) = (self.hidden, self.inter, &self.rows);
        let limit = self.limit.is_finite().then_some(self.limit);
        let saved = Some((&r.gate, &r.up));
        let gate_up = match rows {
            Some(rows) => EnginePlan::gate_up(gpu, rows, groups, w_gate, w_up, (h, i), limit, &r.hidden, saved)?,
            None => EnginePlan::gate_up_gathering(gpu, groups, w_gate, w_up, (h, i), limit, &r.hidden, saved)?,
        };
        Ok((gate_up, EnginePlan::rows_nt(gpu, &r.hidden, groups, w_down, (h, i), RowsOut::F32(&r.out))?))
    }

    /// The backward megakernel's five engine plans over `groups` of `d_rows` (`[R][H]` bf16, the
    /// gathered dy rows scaled by their slot weights), `input_rows` (`[R][H]` bf16, the forward's
    /// rows, or `None` for weight gradients that gather them) and this workspace:
    /// [`Self::engine_down_dgrad_plan`], [`Self::engine_gate_up_dgrad_plan`], then
    /// [`Self::engine_wgrad_plans`] — in
    /// `BackwardParams` order (the megakernel runs the SwiGLU backward between the two data
    /// gradients, over [`Self::swiglu_backward_rows`]).
    ///
    /// # Safety
    /// As [`Self::engine_wgrad_plans`].
    pub(crate) unsafe fn engine_backward_plans(
        &self,
        gpu: &Gpu,
        (d_rows, input_rows): (DeviceSlice<'_, bf16>, Option<DeviceSlice<'_, bf16>>),
        groups: &crate::gemm::RowGroups<'_>,
        [w_gate, w_up, w_down]: [DeviceSlice<'_, bf16>; 3],
        targets: ([u64; 3], bool),
    ) -> Result<[crate::gemm::EnginePlan; 5]> {
        // SAFETY: caller contract.
        let [down, gate, up] = unsafe { self.engine_wgrad_plans(gpu, (d_rows, input_rows), groups, targets) }?;
        Ok([
            self.engine_down_dgrad_plan(gpu, d_rows, groups, w_down)?,
            self.engine_gate_up_dgrad_plan(gpu, groups, [w_gate, w_up])?,
            down,
            gate,
            up,
        ])
    }

    /// The down projection's data gradient over `groups` of `d_rows`: `d_rows · W_down` into
    /// this workspace's f32 `d_hidden` rows.
    pub(crate) fn engine_down_dgrad_plan(
        &self,
        gpu: &Gpu,
        d_rows: DeviceSlice<'_, bf16>,
        groups: &crate::gemm::RowGroups<'_>,
        w_down: DeviceSlice<'_, bf16>,
    ) -> Result<crate::gemm::EnginePlan> {
        crate::gemm::EnginePlan::rows_nn(
            gpu,
            (d_rows, w_down),
            None,
            groups,
            (self.inter, self.hidden),
            &self.rows.d_hidden,
        )
    }

    /// Where the backward megakernel's SwiGLU step reads and writes this workspace's rows: the
    /// saved pre-activations and `d_hidden` in, `d_gate` and `d_up` out (what
    /// `mok_swiglu_backward` reads and writes).
    pub(crate) fn swiglu_backward_rows(&self) -> mok_kernels::megakernel_layout::SwigluBackwardRows {
        let r = &self.rows;
        mok_kernels::megakernel_layout::SwigluBackwardRows {
            gate: r.gate.device_ptr(),
            up: r.up.device_ptr(),
            d_hidden: r.d_hidden.device_ptr(),
            d_gate: r.d_gate.device_ptr(),
            d_up: r.d_up.device_ptr(),
            width: self.inter as u32,
            limit: self.limit,
        }
    }

    /// The gate/up data gradient over `groups`: `[d_gate d_up]·[W_gate; W_up]` into this
    /// workspace's f32 input-row gradients.
    pub(crate) fn engine_gate_up_dgrad_plan(
        &self,
        gpu: &Gpu,
        groups: &crate::gemm::RowGroups<'_>,
        [w_gate, w_up]: [DeviceSlice<'_, bf16>; 2],
    ) -> Result<crate::gemm::EnginePlan> {
        let r = &self.rows;
        crate::gemm::EnginePlan::rows_nn(
            gpu,
            ((&r.d_gate).into(), w_gate),
            Some(((&r.d_up).into(), w_up)),
            groups,
            (self.hidden, self.inter),
            &r.d_in,
        )
    }

    /// The down, gate and up weight gradients over `groups` — `d_rowsᵀ·hidden`, `d_gateᵀ·input_rows`,
    /// `d_upᵀ·input_rows` — into `dw` = `[dw_gate, dw_up, dw_down]` (device addresses of
    /// `[G, I, H]`, `[G, I, H]`, `[G, H, I]`), bf16 or, with `accumulate_f32`, added into f32.
    /// With `input_rows` `None` the gate and up weight gradients have no rows buffer: their
    /// producers gather each K row from the tokens given at launch
    /// ([`crate::gemm::EnginePlan::wgrad_gathering`]), into the same gradients, bit for bit.
    ///
    /// # Safety
    /// `dw` are live allocations of those lengths (of f32 with `accumulate_f32`, else bf16) for
    /// as long as the plans are launched.
    pub(crate) unsafe fn engine_wgrad_plans(
        &self,
        gpu: &Gpu,
        (d_rows, input_rows): (DeviceSlice<'_, bf16>, Option<DeviceSlice<'_, bf16>>),
        groups: &crate::gemm::RowGroups<'_>,
        (dw, accumulate_f32): ([u64; 3], bool),
    ) -> Result<[crate::gemm::EnginePlan; 3]> {
        use crate::gemm::EnginePlan;
        let (h, i, r) = (self.hidden, self.inter, &self.rows);
        let g = groups.groups;
        // SAFETY: caller contract (each gradient holds G · I · H elements).
        let out = |address| unsafe { wgrad_target(address, g * i * h, accumulate_f32) };
        let shape = (g, groups.capacity);
        // The gate and up weight gradients: `a` against the input rows, or gathering them.
        let input_wgrad = |a: &DeviceBuffer<bf16>, dw| match input_rows {
            Some(rows) => EnginePlan::wgrad(gpu, a, rows, groups.row_offsets, shape, (i, h), out(dw)),
            None => EnginePlan::wgrad_gathering(gpu, a, groups.row_offsets, shape, (i, h), out(dw)),
        };
        Ok([
            EnginePlan::wgrad(gpu, d_rows, &r.hidden, groups.row_offsets, shape, (h, i), out(dw[2]))?,
            input_wgrad(&r.d_gate, dw[0])?,
            input_wgrad(&r.d_up, dw[1])?,
        ])
    }

    /// `[R][H]` f32 input-row gradients of the last backward.
    pub fn d_in_rows(&self) -> &DeviceBuffer<f32> {
        &self.rows.d_in
    }

    /// `[R][H]` bf16 output-gradient rows (allocated when built `with_d_rows`).
    pub fn d_rows(&self) -> &DeviceBuffer<bf16> {
        &self.rows.d_rows
    }

    /// Fills the workspace with NaN bytes (feature `testing`).
    #[cfg(feature = "testing")]
    pub fn poison(&mut self) -> Result<()> {
        self.rows.fill(0xff)
    }

    /// Enqueues gate/up with SwiGLU, then down, over `groups` of `input_rows` (`[R][H]` bf16)
    /// with `weights` = `(w_gate [G, I, H], w_up [G, I, H], w_down [G, H, I])`; the f32 output
    /// rows land in [`Self::out_rows`], the saved pre-activations in this workspace.
    ///
    /// # Safety
    /// The kernels read and write through raw device addresses that nothing here can check:
    /// `input_rows` must be a live `[R][H]` bf16 allocation and `groups`' offsets and row count
    /// live u32 arrays as [`RowGroups`] documents, holding at most `rows_upper_bound` rows in
    /// groups that fit the weights' G, and all of it must stay allocated until the stream has
    /// run these launches.
    pub unsafe fn forward(
        &self,
        gpu: &Gpu,
        groups: &RowGroups,
        input_rows: u64,
        weights: [DeviceSlice<'_, bf16>; 3],
    ) -> Result<()> {
        groups.check(self.capacity)?;
        let (h, inter) = (self.hidden, self.inter);
        let rows = &self.rows;
        // SAFETY: the arguments are `mok_gemm_gate_up_swiglu`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_gemm_gate_up_swiglu",
                gemm_shape(row_grid(groups.rows_upper_bound, groups.groups, inter)),
                &[
                    Ptr(input_rows),
                    Ptr(groups.row_offsets),
                    Ptr(groups.tile_offsets),
                    U32(groups.groups as u32),
                    Ptr(weights[0].device_ptr()),
                    Ptr(weights[1].device_ptr()),
                    U32(h as u32),
                    U32(inter as u32),
                    F32(self.limit),
                    Ptr(rows.gate.device_ptr()),
                    Ptr(rows.up.device_ptr()),
                    Ptr(rows.hidden.device_ptr()),
                ],
            )
        }?;
        // SAFETY: the arguments are `mok_gemm_rows_nt`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_gemm_rows_nt",
                gemm_shape(row_grid(groups.rows_upper_bound, groups.groups, h)),
                &[
                    Ptr(rows.hidden.device_ptr()),
                    Ptr(groups.row_offsets),
                    Ptr(groups.tile_offsets),
                    U32(groups.groups as u32),
                    Ptr(weights[2].device_ptr()),
                    U32(h as u32),
                    U32(inter as u32),
                    Ptr(rows.out.device_ptr()),
                ],
            )
        }
    }

    /// Enqueues the SwiGLU backward: `d_hidden` and the saved pre-activations → `d_gate`, `d_up`
    /// (bf16), for the rows of `groups`.
    pub(super) fn swiglu_backward(&self, gpu: &Gpu, groups: &RowGroups) -> Result<()> {
        let rows = &self.rows;
        let inter = self.inter;
        // SAFETY: the arguments are `mok_swiglu_backward`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_swiglu_backward",
                LaunchShape::linear(grid_stride_blocks(gpu, groups.rows_upper_bound * inter), ROW_KERNEL_THREADS),
                &[
                    Ptr(rows.gate.device_ptr()),
                    Ptr(rows.up.device_ptr()),
                    Ptr(rows.d_hidden.device_ptr()),
                    Ptr(groups.row_count),
                    U32(inter as u32),
                    F32(self.limit),
                    Ptr(rows.d_gate.device_ptr()),
                    Ptr(rows.d_up.device_ptr()),
                ],
            )
        }
    }

    /// Enqueues the backward of [`Self::forward`] (same groups and inputs, the forward's saved
    /// rows): down dgrad, SwiGLU backward, gate/up dgrad into [`Self::d_in_rows`] (f32), then the
    /// three weight gradients (bf16), each reducing over a group's rows in order from its first.
    ///
    /// # Safety
    /// As [`Self::forward`] for `groups` and `args.input_rows`; besides, `args.d_out_rows` must
    /// be a live `[R][H]` bf16 allocation and `args.weight_grads` live `[G, I, H]`, `[G, I, H]`
    /// and `[G, H, I]` allocations (bf16, or f32 with `accumulate_f32`), all of it allocated
    /// until the stream has run these launches, and nothing else may write the gradients
    /// meanwhile.
    pub unsafe fn backward(&self, gpu: &Gpu, groups: &RowGroups, args: ExpertBackward<'_>) -> Result<()> {
        groups.check(self.capacity)?;
        let rows = &self.rows;
        let (h, inter) = (self.hidden, self.inter);
        let [w_gate, w_up, w_down] = args.weights;
        // SAFETY: the arguments are `mok_gemm_rows_nn`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_gemm_rows_nn",
                gemm_shape(row_grid(groups.rows_upper_bound, groups.groups, inter)),
                &[
                    Ptr(args.d_out_rows),
                    Ptr(w_down.device_ptr()),
                    U32(h as u32),
                    Ptr(0),
                    Ptr(0),
                    U32(0),
                    Ptr(groups.row_offsets),
                    Ptr(groups.tile_offsets),
                    U32(groups.groups as u32),
                    U32(inter as u32),
                    Ptr(rows.d_hidden.device_ptr()),
                ],
            )
        }?;
        self.swiglu_backward(gpu, groups)?;
        // SAFETY: the arguments are `mok_gemm_rows_nn`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_gemm_rows_nn",
                gemm_shape(row_grid(groups.rows_upper_bound, groups.groups, h)),
                &[
                    Ptr(rows.d_gate.device_ptr()),
                    Ptr(w_gate.device_ptr()),
                    U32(inter as u32),
                    Ptr(rows.d_up.device_ptr()),
                    Ptr(w_up.device_ptr()),
                    U32(inter as u32),
                    Ptr(groups.row_offsets),
                    Ptr(groups.tile_offsets),
                    U32(groups.groups as u32),
                    U32(h as u32),
                    Ptr(rows.d_in.device_ptr()),
                ],
            )
        }?;
        let wgrad = |a: u64, b: u64, m: usize, n: usize, out: u64| {
            let tiles = (m as u32).div_ceil(kc::GEMM_TILE_M) * (n as u32).div_ceil(kc::GEMM_TILE_N);
            // SAFETY: the arguments are `mok_gemm_wgrad`'s parameters, in order and type (its entry point in
            // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
            unsafe {
                gpu.launch(
                    "mok_gemm_wgrad",
                    gemm_shape((tiles * groups.groups as u32, 1, 1)),
                    &[
                        Ptr(a),
                        Ptr(b),
                        Ptr(groups.row_offsets),
                        U32(m as u32),
                        U32(n as u32),
                        // The kernel writes bf16 unless that pointer is null; then it adds into f32.
                        Ptr(if args.accumulate_f32 { 0 } else { out }),
                        Ptr(if args.accumulate_f32 { out } else { 0 }),
                    ],
                )
            }
        };
        let [dw_gate, dw_up, dw_down] = args.weight_grads;
        wgrad(args.d_out_rows, rows.hidden.device_ptr(), h, inter, dw_down)?;
        wgrad(rows.d_gate.device_ptr(), args.input_rows, inter, h, dw_gate)?;
        wgrad(rows.d_up.device_ptr(), args.input_rows, inter, h, dw_up)
    }
}

/// The shared expert's workspace for `config` (none without a shared expert): its expert
/// computation over one group holding every token, that group's offsets `[0, T, 0, tiles]`, and
/// its three bf16 weight gradients `(dws_gate [Is, H], dws_up [Is, H], dws_down [H, Is])`.
/// The shared expert's forward over `tokens` rows at device address `x`, in its `workspace`
/// (from [`shared_expert_workspace`]): returns the address of its `[T][H]` f32 output rows, the
/// first term of every token's sum.
///
/// # Safety
/// `x` must be a live `[tokens][H]` bf16 allocation until the stream has run the forward
/// ([`ExpertCompute::forward`]'s contract for its input rows).
pub(crate) unsafe fn shared_expert_forward(
    gpu: &Gpu,
    (compute, offsets): &(ExpertCompute, DeviceBuffer<u32>),
    tokens: usize,
    x: u64,
    weights: super::SharedExpertView<'_>,
) -> Result<u64> {
    // SAFETY: `x` as the caller guarantees; the offsets are the workspace's own `[0, T, 0,
    // tiles]` buffer, which lives as long as `compute`.
    unsafe {
        compute.forward(
            gpu,
            &RowGroups::all_tokens(offsets, tokens),
            x,
            [weights.ws_gate, weights.ws_up, weights.ws_down],
        )
    }?;
    Ok(compute.out_rows().device_ptr())
}

#[allow(clippy::type_complexity)]
pub(crate) fn shared_expert_workspace(
    gpu: &Gpu,
    config: &MoeConfig,
) -> Result<Option<((ExpertCompute, DeviceBuffer<u32>), [DeviceBuffer<bf16>; 3])>> {
    let Some(is) = config.shared_intermediate else {
        return Ok(None);
    };
    let (t, h) = (config.tokens_per_rank, config.hidden);
    let tiles = (t as u32).div_ceil(kc::GEMM_TILE_M);
    let offsets = DeviceBuffer::from_slice(gpu, &[0, t as u32, 0, tiles])?;
    let compute = ExpertCompute::new(gpu, t, h, is, config.swiglu_limit, false)?;
    let grads =
        [DeviceBuffer::alloc(gpu, is * h)?, DeviceBuffer::alloc(gpu, is * h)?, DeviceBuffer::alloc(gpu, h * is)?];
    Ok(Some(((compute, offsets), grads)))
}

/// A forward megakernel pass's plans for one rank: its routed gate/up and down plans, then, with
/// `shared`, the shared expert's two (the order `ForwardMegakernel::new` reads them in).
pub(crate) fn forward_pass_plans<'a>(
    routed: [&'a crate::gemm::EnginePlan; 2],
    shared: Option<&'a SharedEnginePlans>,
) -> Vec<&'a crate::gemm::EnginePlan> {
    let mut plans = routed.to_vec();
    plans.extend(shared.map(SharedEnginePlans::plans).into_iter().flatten());
    plans
}

/// A backward megakernel pass's plans for one rank: its routed five, then, with `shared` and
/// once its backward plans are built, the shared expert's five (the order
/// `BackwardMegakernel::new` reads them in).
pub(crate) fn backward_pass_plans<'a>(
    routed: [&'a crate::gemm::EnginePlan; 5],
    shared: Option<&'a SharedEnginePlans>,
) -> Vec<&'a crate::gemm::EnginePlan> {
    let mut plans = routed.to_vec();
    plans.extend(shared.and_then(SharedEnginePlans::backward_plans).into_iter().flatten());
    plans
}

/// The shared expert on the tensor-core engine inside a forward megakernel's launch: the rows
/// it reads (the pass's token rows, which the megakernel's dispatch copies there — x is a
/// per-pass input, and a plan's tensor maps need fixed addresses), its one group's engine tile
/// offsets, and its gate/up and down plans over its [`ExpertCompute`] workspace — the buffers
/// its `mma.sync` forward writes, bit for bit, so its backward reads the same either way.
pub(crate) struct SharedEnginePlans {
    x_rows: DeviceBuffer<bf16>,
    /// `[4]` the engine tile offsets of the group `[0, T]`, written on the device in each pass (one
    /// GPU) or when T changes (over ranks, where it never does).
    tile_offsets: DeviceBuffer<u32>,
    /// The T those offsets were last written for by [`Self::set_tokens`] (0: not yet; over ranks,
    /// where T never changes; a one-GPU layer writes them in every pass instead).
    tile_offsets_tokens: usize,
    /// Gate/up with SwiGLU (keeping the pre-activations), down.
    plans: [crate::gemm::EnginePlan; 2],
    /// The weight addresses (gate, up, down) the plans were built for.
    built_for: [u64; 3],
    /// The `[cap][H]` bf16 dy rows the backward megakernel's gather fills, once a backward
    /// asked for them (every set of backward plans reads them).
    dy_rows: Option<DeviceBuffer<bf16>>,
    /// The backward megakernel's plans for the current gradient target and the one before,
    /// keyed by (input rows, gradient addresses `[dws_gate, dws_up, dws_down]`, accumulate into
    /// f32).
    backward: Kept<(u64, [u64; 3], bool), SharedBackwardPlans>,
    /// Hidden width H.
    hidden: usize,
}

/// The shared expert's five plans inside the backward megakernel (`BackwardParams` order: the
/// down dgrad, the gate/up dgrad, the down, gate and up weight gradients), over the dy rows of
/// [`SharedEnginePlans`].
pub(crate) struct SharedBackwardPlans {
    plans: [crate::gemm::EnginePlan; 5],
    /// The workspace's rows of the megakernel's SwiGLU step.
    swiglu: mok_kernels::megakernel_layout::SwigluBackwardRows,
}

impl SharedEnginePlans {
    /// The plans of the shared expert `workspace` (from [`shared_expert_workspace`]) for
    /// `weights`.
    pub(crate) fn new(
        gpu: &Gpu,
        (compute, offsets): &(ExpertCompute, DeviceBuffer<u32>),
        weights: super::SharedExpertView<'_>,
    ) -> Result<Self> {
        let mut x_rows = DeviceBuffer::alloc(gpu, compute.capacity * compute.hidden)?;
        // Read only where a pass copied rows (zeroed once for initcheck, as the workspace).
        x_rows.fill_bytes(0)?;
        let mut tile_offsets = DeviceBuffer::alloc(gpu, 4)?;
        tile_offsets.fill_bytes(0)?;
        let groups = crate::gemm::RowGroups {
            row_offsets: offsets.into(),
            tile_offsets: (&tile_offsets).into(),
            groups: 1,
            capacity: compute.capacity,
        };
        let (gate_up, down) = compute.engine_forward_plans(
            gpu,
            Some((&x_rows).into()),
            &groups,
            [weights.ws_gate, weights.ws_up, weights.ws_down],
        )?;
        Ok(Self {
            x_rows,
            tile_offsets,
            tile_offsets_tokens: 0,
            plans: [gate_up, down],
            built_for: Self::key(weights),
            dy_rows: None,
            backward: Kept::new(),
            hidden: compute.hidden,
        })
    }

    /// The weight addresses plans for `weights` are built for (the key a one-GPU layer keeps
    /// its two sets by).
    pub(crate) fn key(weights: super::SharedExpertView<'_>) -> [u64; 3] {
        [weights.ws_gate.device_ptr(), weights.ws_up.device_ptr(), weights.ws_down.device_ptr()]
    }

    /// Whether the plans were built for these weights.
    pub(crate) fn built_for(&self, weights: super::SharedExpertView<'_>) -> bool {
        self.built_for == Self::key(weights)
    }

    /// The gate/up and down plans.
    pub(crate) fn plans(&self) -> [&crate::gemm::EnginePlan; 2] {
        [&self.plans[0], &self.plans[1]]
    }

    /// `[cap][H]` bf16 rows the dispatch copies the tokens into.
    pub(crate) fn x_rows(&self) -> u64 {
        self.x_rows.device_ptr()
    }

    /// Makes the backward plans for these input rows and gradients current (built when neither
    /// they nor the ones before are; a third target's plans drop the oldest's):
    /// over `input_rows` (`[cap][H]` bf16, this pass's token rows: [`Self::x_rows`] once a
    /// forward megakernel or [`Self::copy_x`] filled it, or a fixed copy elsewhere), `weights`
    /// (those of [`Self::new`]) and the gradient target `(dws [gate, up, down], accumulate)`.
    ///
    /// # Safety
    /// `input_rows` holds `[cap][H]` bf16 and the gradient addresses `[Is][H]`, `[Is][H]`,
    /// `[H][Is]` elements (f32 when accumulating, else bf16), alive for as long as the plans are
    /// launched.
    pub(crate) unsafe fn prepare_backward(
        &mut self,
        gpu: &Gpu,
        (compute, offsets): &(ExpertCompute, DeviceBuffer<u32>),
        weights: super::SharedExpertView<'_>,
        input_rows: u64,
        (grads, accumulate_f32): ([u64; 3], bool),
    ) -> Result<()> {
        let key = (input_rows, grads, accumulate_f32);
        let rows = compute.capacity * compute.hidden;
        let dy_rows = match &mut self.dy_rows {
            Some(dy_rows) => dy_rows,
            empty => {
                let mut dy_rows = DeviceBuffer::alloc(gpu, rows)?;
                dy_rows.fill_bytes(0)?;
                empty.insert(dy_rows)
            }
        };
        let groups = crate::gemm::RowGroups {
            row_offsets: offsets.into(),
            tile_offsets: (&self.tile_offsets).into(),
            groups: 1,
            capacity: compute.capacity,
        };
        self.backward.select(key, || {
            // SAFETY: caller contract (the input rows and the gradient targets).
            let plans = unsafe {
                compute.engine_backward_plans(
                    gpu,
                    ((&*dy_rows).into(), Some(DeviceSlice::from_raw_parts(input_rows, rows))),
                    &groups,
                    [weights.ws_gate, weights.ws_up, weights.ws_down],
                    (grads, accumulate_f32),
                )
            }?;
            Ok(SharedBackwardPlans { plans, swiglu: compute.swiglu_backward_rows() })
        })
    }

    /// The parameter-block addresses of the backward plans [`Self::prepare_backward`] for these
    /// input rows and gradients would drop, if any (a pass built over them must be dropped
    /// first).
    pub(crate) fn backward_plans_dropped_by(
        &self,
        input_rows: u64,
        (grads, accumulate_f32): ([u64; 3], bool),
    ) -> Option<Vec<u64>> {
        let dropped = self.backward.dropped_by(&(input_rows, grads, accumulate_f32))?;
        Some(dropped.plans.iter().map(crate::gemm::EnginePlan::params_ptr).collect())
    }

    /// The parameter-block addresses of every plan this set holds, forward and backward: the
    /// keys of the passes built over the set name some of them.
    pub(crate) fn plan_addresses(&self) -> Vec<u64> {
        let backward = self.backward.held().flat_map(|b| b.plans.iter());
        self.plans.iter().chain(backward).map(crate::gemm::EnginePlan::params_ptr).collect()
    }

    /// The backward plans ([`Self::prepare_backward`]).
    pub(crate) fn backward_plans(&self) -> Option<[&crate::gemm::EnginePlan; 5]> {
        self.backward.current().map(|b| b.plans.each_ref())
    }

    /// The backward megakernel's view of this shared expert ([`Self::prepare_backward`] built
    /// it): the dy rows its gather fills and the rows of its SwiGLU step.
    pub(crate) fn backward_pass_rows(&self) -> Option<crate::megakernel::SharedBackwardRows> {
        let dy = self.dy_rows.as_ref()?.device_ptr();
        self.backward.current().map(|b| crate::megakernel::SharedBackwardRows { dy, swiglu: b.swiglu })
    }

    /// Enqueues a copy of `tokens` rows of x (device address `x`, `[T][H]` bf16) into
    /// [`Self::x_rows`] (a backward after a forward that did not run the megakernel).
    ///
    /// # Safety
    /// `x` holds `tokens` rows of H bf16, alive until the stream has run the copy; `tokens` is at
    /// most the capacity.
    pub(crate) unsafe fn copy_x(&mut self, x: u64, tokens: usize) -> Result<()> {
        // SAFETY: caller contract.
        unsafe { self.x_rows.copy_from_address(x, tokens * self.hidden) }
    }

    /// Enqueues the engine tile offsets of `offsets` = `[0, T, ..]` when `tokens` (T) differs
    /// from the last call's, after whatever set those words on the stream: for a layer whose T
    /// never changes (over ranks), where a captured graph's replay leaves the same offsets.
    pub(crate) fn set_tokens(&mut self, gpu: &Gpu, offsets: &DeviceBuffer<u32>, tokens: usize) -> Result<()> {
        if self.tile_offsets_tokens != tokens {
            self.write_tile_offsets(gpu, offsets)?;
            self.tile_offsets_tokens = tokens;
        }
        Ok(())
    }

    /// Enqueues the engine tile offsets of `offsets` = `[0, T, ..]`, after whatever set those
    /// words on the stream: for a layer whose T changes from pass to pass, in every pass (a
    /// captured graph replays its own T's offsets whatever ran in between).
    pub(crate) fn write_tile_offsets(&self, gpu: &Gpu, offsets: &DeviceBuffer<u32>) -> Result<()> {
        crate::gemm::tile_offsets_into(gpu, offsets, 1, &self.tile_offsets)
    }
}

/// A weight gradient's output at device address `address` of `len` elements: added into f32
/// (`accumulate_f32`) or fresh bf16.
///
/// # Safety
/// `address` is a live allocation of `len` elements of that type for as long as a plan built on
/// it is launched.
unsafe fn wgrad_target(address: u64, len: usize, accumulate_f32: bool) -> crate::gemm::WgradOut<'static> {
    // SAFETY: caller contract.
    unsafe {
        if accumulate_f32 {
            crate::gemm::WgradOut::AccumulateF32(DeviceSlice::from_raw_parts(address, len))
        } else {
            crate::gemm::WgradOut::Bf16(DeviceSlice::from_raw_parts(address, len))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::check_rows_shape;
    use crate::error::MokError;

    #[test]
    fn a_bad_rows_shape_is_named_before_any_allocation() {
        check_rows_shape(4096, 7168, 2048, Some(7.0)).unwrap();
        let field =
            |shape: (usize, usize, usize, Option<f32>)| match check_rows_shape(shape.0, shape.1, shape.2, shape.3) {
                Err(MokError::InvalidConfig { field, .. }) => field,
                other => panic!("{shape:?}: expected InvalidConfig, got {other:?}"),
            };
        assert_eq!(field((8, 0, 64, None)), "hidden");
        assert_eq!(field((8, 60, 64, None)), "hidden");
        assert_eq!(field((8, 64, (1 << 20) + 8, None)), "intermediate");
        assert_eq!(field((8, 64, 64, Some(f32::NAN))), "swiglu_limit");
        assert_eq!(field((8, 64, 64, Some(0.0))), "swiglu_limit");
        assert_eq!(field((1 << 31, 64, 64, None)), "capacity");
        assert_eq!(field((usize::MAX, 64, 64, None)), "capacity");
    }
}
