//! The unfused GPU path: the layer as a sequence of simple kernels on one stream.
//!
//! It is the GPU oracle for shapes too large for the CPU reference and the "separate kernels"
//! baseline the megakernel is measured against. Every step reads device memory written by the
//! previous one; the host enqueues the whole pass without waiting (the only host read is the
//! routing error word, in [`UnfusedLayer::check_device_errors`], after the pass).
//!
//! Forward: route (rank chunks → scan → place) → gather x rows into expert order → gate/up GEMM
//! with SwiGLU → down GEMM (f32 rows) → shared expert (same two GEMMs over all tokens) →
//! combine (shared term first, then slots in order, f32, one bf16 rounding).
//!
//! Backward (reusing the forward's saved rows): gather dy scaled by the slot weight → slot-weight
//! gradient → down dgrad → SwiGLU backward → gate/up dgrad (two K segments, one accumulator)
//! → weight gradients per expert (rows reduced in order) → shared expert → dx combine.

use half::bf16;
use mok_kernels::tiles as kc;

use crate::config::MoeConfig;
use crate::driver::{DeviceBuffer, Gpu, KernelArg, LaunchShape};
use crate::error::{MokError, Result};
use crate::gemm::{self as engine, EnginePlan, RowsOut, WgradOut};
use crate::problem::{ExpertWeights, RoutedTokens, SharedExpertWeights};

use KernelArg::{F32, Ptr, U32, U64};

/// Every kernel the unfused path launches (and `Gpu::new` must load).
pub const KERNEL_NAMES: &[&str] = &[
    "mok_route_rank_chunks",
    "mok_route_scan",
    "mok_route_place",
    "mok_gather_rows",
    "mok_gemm_gate_up_swiglu",
    "mok_gemm_rows_nt",
    "mok_gemm_rows_nn",
    "mok_gemm_wgrad",
    "mok_combine_slots",
    "mok_topk_weight_grad",
    "mok_swiglu_backward",
    "mok_fill_u32",
    "mok_fill_random_bf16",
];

pub(crate) const ROW_KERNEL_THREADS: u32 = 256;

/// One rank's routed tokens on the device.
pub struct DeviceTokens {
    /// `[T, H]`.
    pub x: DeviceBuffer<bf16>,
    /// `[T, k]`.
    pub topk_ids: DeviceBuffer<i32>,
    /// `[T, k]`.
    pub topk_weights: DeviceBuffer<f32>,
}

impl DeviceTokens {
    /// Uploads host tokens after validating them (sizes, id range, duplicates).
    pub fn upload(gpu: &Gpu, config: &MoeConfig, tokens: &RoutedTokens) -> Result<Self> {
        tokens.validate(config)?;
        Ok(Self {
            x: DeviceBuffer::from_slice(gpu, &tokens.x)?,
            topk_ids: DeviceBuffer::from_slice(gpu, &tokens.topk_ids)?,
            topk_weights: DeviceBuffer::from_slice(gpu, &tokens.topk_weights)?,
        })
    }
}

/// Routed expert weights on the device (`nn.Linear` layout, like [`ExpertWeights`]).
pub struct DeviceExperts {
    /// `[E/P, I, H]`.
    pub w_gate: DeviceBuffer<bf16>,
    /// `[E/P, I, H]`.
    pub w_up: DeviceBuffer<bf16>,
    /// `[E/P, H, I]`.
    pub w_down: DeviceBuffer<bf16>,
}

impl DeviceExperts {
    /// Uploads host weights after checking their sizes.
    pub fn upload(gpu: &Gpu, config: &MoeConfig, weights: &ExpertWeights) -> Result<Self> {
        weights.validate(config)?;
        Ok(Self {
            w_gate: DeviceBuffer::from_slice(gpu, &weights.w_gate)?,
            w_up: DeviceBuffer::from_slice(gpu, &weights.w_up)?,
            w_down: DeviceBuffer::from_slice(gpu, &weights.w_down)?,
        })
    }

    /// Random weights generated on the device, uniform in ±`scale` (see [`fill_random_bf16`]).
    pub fn random(gpu: &Gpu, config: &MoeConfig, seed: u64, scale: f32) -> Result<Self> {
        let n = config.local_experts() * config.intermediate * config.hidden;
        Ok(Self {
            w_gate: random_bf16(gpu, n, seed, scale)?,
            w_up: random_bf16(gpu, n, seed ^ 1, scale)?,
            w_down: random_bf16(gpu, n, seed ^ 2, scale)?,
        })
    }

    /// Copies the weights back to the host (for the CPU reference).
    pub fn download(&self) -> Result<ExpertWeights> {
        Ok(ExpertWeights {
            w_gate: self.w_gate.download()?,
            w_up: self.w_up.download()?,
            w_down: self.w_down.download()?,
        })
    }
}

/// Shared-expert weights on the device.
pub struct DeviceSharedExpert {
    /// `[Is, H]`.
    pub ws_gate: DeviceBuffer<bf16>,
    /// `[Is, H]`.
    pub ws_up: DeviceBuffer<bf16>,
    /// `[H, Is]`.
    pub ws_down: DeviceBuffer<bf16>,
}

impl DeviceSharedExpert {
    /// Uploads host weights after checking their sizes.
    pub fn upload(gpu: &Gpu, config: &MoeConfig, weights: &SharedExpertWeights) -> Result<Self> {
        weights.validate(config)?;
        Ok(Self {
            ws_gate: DeviceBuffer::from_slice(gpu, &weights.ws_gate)?,
            ws_up: DeviceBuffer::from_slice(gpu, &weights.ws_up)?,
            ws_down: DeviceBuffer::from_slice(gpu, &weights.ws_down)?,
        })
    }

    /// Copies the weights back to the host.
    pub fn download(&self) -> Result<SharedExpertWeights> {
        Ok(SharedExpertWeights {
            ws_gate: self.ws_gate.download()?,
            ws_up: self.ws_up.download()?,
            ws_down: self.ws_down.download()?,
        })
    }
}

/// `count` bf16 uniform in ±`scale`, generated on the device from `seed`.
pub fn random_bf16(gpu: &Gpu, count: usize, seed: u64, scale: f32) -> Result<DeviceBuffer<bf16>> {
    let buffer = DeviceBuffer::alloc(gpu, count)?;
    let blocks = grid_stride_blocks(gpu, count);
    // SAFETY: the arguments are `mok_fill_random_bf16`'s parameters, in order and type (its entry point in
    // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
    unsafe {
        gpu.launch(
            "mok_fill_random_bf16",
            LaunchShape::linear(blocks, ROW_KERNEL_THREADS),
            &[Ptr(buffer.device_ptr()), U64(count as u64), U64(seed), F32(scale)],
        )
    }?;
    Ok(buffer)
}

/// Blocks for a grid-stride kernel over `work` items: enough to fill the GPU, no more.
pub(crate) fn grid_stride_blocks(gpu: &Gpu, work: usize) -> u32 {
    let needed = work.div_ceil(ROW_KERNEL_THREADS as usize).max(1);
    needed.min(gpu.multiprocessors() as usize * 8) as u32
}

/// Routing layout of a pass, on the device (see `mok_kernels::layout`).
pub struct RoutingBuffers {
    chunk_counts: DeviceBuffer<u32>,
    slot_rank: DeviceBuffer<u32>,
    /// `[E]` rows per expert.
    pub expert_counts: DeviceBuffer<u32>,
    /// `[E+1]` first row of each expert; the last entry is the total.
    pub row_offsets: DeviceBuffer<u32>,
    /// `[E+1]` first GEMM M tile of each expert.
    pub tile_offsets: DeviceBuffer<u32>,
    /// `[T·k]` row of each slot, `u32::MAX` when dropped.
    pub slot_row: DeviceBuffer<u32>,
    /// `[T·k]` (first `total` entries valid) slot `t·k + j` of each row.
    pub row_source: DeviceBuffer<u32>,
    /// `[4]` first routing error: code, slot, id (code 0: none).
    error: DeviceBuffer<u32>,
}

/// Rows of one expert group set (routed experts, or the shared expert over all tokens).
struct ExpertRows {
    /// `[R][H]` bf16 input rows (routed: gathered x; shared: x itself, not owned).
    gate: DeviceBuffer<f32>,
    up: DeviceBuffer<f32>,
    hidden: DeviceBuffer<bf16>,
    /// `[R][H]` f32 output rows.
    out: DeviceBuffer<f32>,
    d_rows: DeviceBuffer<bf16>,
    d_hidden: DeviceBuffer<f32>,
    d_gate: DeviceBuffer<bf16>,
    d_up: DeviceBuffer<bf16>,
    d_in: DeviceBuffer<f32>,
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

    fn poison(&mut self) -> Result<()> {
        self.gate.fill_bytes(0xff)?;
        self.up.fill_bytes(0xff)?;
        self.hidden.fill_bytes(0xff)?;
        self.out.fill_bytes(0xff)?;
        self.d_rows.fill_bytes(0xff)?;
        self.d_hidden.fill_bytes(0xff)?;
        self.d_gate.fill_bytes(0xff)?;
        self.d_up.fill_bytes(0xff)?;
        self.d_in.fill_bytes(0xff)
    }
}

/// Gradients produced by [`UnfusedLayer::backward`], on the device.
pub struct DeviceGrads {
    /// `[T, H]` bf16.
    pub dx: DeviceBuffer<bf16>,
    /// `[T, k]` f32 (0 for dropped slots).
    pub d_topk_weights: DeviceBuffer<f32>,
    /// `[E/P, I, H]` bf16.
    pub dw_gate: DeviceBuffer<bf16>,
    /// `[E/P, I, H]` bf16.
    pub dw_up: DeviceBuffer<bf16>,
    /// `[E/P, H, I]` bf16.
    pub dw_down: DeviceBuffer<bf16>,
    /// Shared expert `(dws_gate [Is,H], dws_up [Is,H], dws_down [H,Is])`, bf16.
    pub shared: Option<[DeviceBuffer<bf16>; 3]>,
}

/// The unfused layer of one rank (P = 1: every expert is local) with its workspace.
pub struct UnfusedLayer {
    config: MoeConfig,
    /// The routing layout of the last forward.
    pub routing: RoutingBuffers,
    /// `[T·k][H]` x gathered into expert order.
    pub gathered_x: DeviceBuffer<bf16>,
    routed: ExpertCompute,
    shared: Option<(ExpertCompute, DeviceBuffer<u32>)>,
    /// `[T, H]` output of the last forward.
    pub y: DeviceBuffer<bf16>,
    /// Gradients of the last backward.
    pub grads: DeviceGrads,
    /// The routed experts' GEMMs on the tensor-core engine instead of the `mma.sync` kernels
    /// ([`UnfusedLayer::set_gemm_engine`]).
    engine: Option<EngineExperts>,
}

/// The routed experts' GEMMs on the sm_90a tensor-core engine ([`crate::gemm`]) — the same
/// products as the `mma.sync` kernels, bit for bit as measured: plans built once for the layer's
/// own buffers and the expert weights of a call, built again when a call passes other weights.
struct EngineExperts {
    /// `[2 · (E + 1)]` the engine's tile offsets, written on the device in each forward and
    /// backward before the engine's GEMMs.
    tile_offsets: DeviceBuffer<u32>,
    /// The weight addresses (gate, up, down) the plans were built for; 0 before the first call.
    built_for: [u64; 3],
    /// Gate/up with SwiGLU (keeping the pre-activations for backward), down.
    forward: Vec<EnginePlan>,
    /// Down dgrad; gate/up dgrad (two K segments); the down, gate and up weight gradients.
    backward: Vec<EnginePlan>,
}

impl UnfusedLayer {
    /// Validates `config` and allocates the workspace for it.
    pub fn new(gpu: &Gpu, config: MoeConfig) -> Result<Self> {
        config.validate()?;
        if config.ep_ranks != 1 {
            return Err(MokError::InvalidConfig {
                field: "ep_ranks",
                value: config.ep_ranks.to_string(),
                rule: "the unfused path runs one rank holding every expert (P = 1)".into(),
            });
        }
        let (t, h, i, e, k) =
            (config.tokens_per_rank, config.hidden, config.intermediate, config.num_experts, config.top_k);
        let slots = t * k;
        let chunks = mok_kernels::layout::chunk_count(t as u32) as usize;
        let routing = RoutingBuffers {
            chunk_counts: DeviceBuffer::alloc(gpu, chunks * e)?,
            slot_rank: DeviceBuffer::alloc(gpu, slots)?,
            expert_counts: DeviceBuffer::alloc(gpu, e)?,
            row_offsets: DeviceBuffer::alloc(gpu, e + 1)?,
            tile_offsets: DeviceBuffer::alloc(gpu, e + 1)?,
            slot_row: DeviceBuffer::alloc(gpu, slots)?,
            row_source: DeviceBuffer::alloc(gpu, slots)?,
            error: DeviceBuffer::alloc(gpu, 4)?,
        };
        let shared = match config.shared_intermediate {
            Some(is) => {
                // The shared expert is one group holding every token: offsets [0, T].
                let tiles = (t as u32).div_ceil(kc::GEMM_TILE_M);
                let offsets = DeviceBuffer::from_slice(gpu, &[0, t as u32, 0, tiles])?;
                Some((ExpertCompute::new(gpu, t, h, is, config.swiglu_limit, false)?, offsets))
            }
            None => None,
        };
        let shared_grads = match config.shared_intermediate {
            Some(is) => Some([
                DeviceBuffer::alloc(gpu, is * h)?,
                DeviceBuffer::alloc(gpu, is * h)?,
                DeviceBuffer::alloc(gpu, h * is)?,
            ]),
            None => None,
        };
        Ok(Self {
            routing,
            gathered_x: DeviceBuffer::alloc(gpu, slots * h)?,
            routed: ExpertCompute::new(gpu, slots, h, i, config.swiglu_limit, true)?,
            shared,
            y: DeviceBuffer::alloc(gpu, t * h)?,
            engine: None,
            grads: DeviceGrads {
                dx: DeviceBuffer::alloc(gpu, t * h)?,
                d_topk_weights: DeviceBuffer::alloc(gpu, slots)?,
                dw_gate: DeviceBuffer::alloc(gpu, e * i * h)?,
                dw_up: DeviceBuffer::alloc(gpu, e * i * h)?,
                dw_down: DeviceBuffer::alloc(gpu, e * h * i)?,
                shared: shared_grads,
            },
            config,
        })
    }

    /// The configuration this layer was built for.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// Runs the routed experts' GEMMs on the tensor-core engine (`on`) or on the `mma.sync`
    /// kernels (the default). Every output and gradient is meant to be bitwise the same either
    /// way (the engine's kernels measured equal to the `mma.sync` ones, and
    /// `gemm_engine_path_is_bitwise_the_mma_sync_path` asserts it for the layer); the shared
    /// expert stays on the `mma.sync` kernels. The engine needs an sm_90 GPU (Hopper) and every
    /// engine kernel in the loaded PTX: otherwise an error, and the layer is unchanged. Its plans
    /// hold the addresses of this layer's buffers: do not replace the layer's public buffers
    /// (`routing`, `gathered_x`, `grads`) while it is on.
    pub fn set_gemm_engine(&mut self, gpu: &Gpu, on: bool) -> Result<()> {
        if !on {
            self.engine = None;
            return Ok(());
        }
        if !engine::engine_available(gpu) {
            return Err(MokError::UnsupportedGpu {
                name: gpu.name().to_string(),
                major: gpu.compute_capability().0,
                minor: gpu.compute_capability().1,
            });
        }
        if self.engine.is_none() {
            let e = self.config.num_experts;
            self.engine = Some(EngineExperts {
                tile_offsets: DeviceBuffer::alloc(gpu, 2 * (e + 1))?,
                built_for: [0; 3],
                forward: Vec::new(),
                backward: Vec::new(),
            });
        }
        Ok(())
    }

    /// Whether the routed experts' GEMMs run on the tensor-core engine.
    pub fn uses_gemm_engine(&self) -> bool {
        self.engine.is_some()
    }

    /// Builds the engine's plans for `experts` (when the engine is on): on first use, and again
    /// for other weights.
    fn prepare_engine_plans(&mut self, gpu: &Gpu, experts: &DeviceExperts) -> Result<()> {
        let Some(state) = self.engine.as_mut() else { return Ok(()) };
        let key = [experts.w_gate.device_ptr(), experts.w_up.device_ptr(), experts.w_down.device_ptr()];
        if state.built_for != key {
            let c = &self.config;
            let (h, i, e, slots) = (c.hidden, c.intermediate, c.num_experts, c.tokens_per_rank * c.top_k);
            let groups = engine::RowGroups {
                row_offsets: &self.routing.row_offsets,
                tile_offsets: &state.tile_offsets,
                groups: e,
                capacity: slots,
            };
            let rows = &self.routed.rows;
            let x = &self.gathered_x;
            let (gate_up, down) = (
                EnginePlan::gate_up(
                    gpu,
                    x,
                    &groups,
                    &experts.w_gate,
                    &experts.w_up,
                    (h, i),
                    c.swiglu_limit,
                    &rows.hidden,
                    Some((&rows.gate, &rows.up)),
                )?,
                EnginePlan::rows_nt(gpu, &rows.hidden, &groups, &experts.w_down, (h, i), RowsOut::F32(&rows.out))?,
            );
            let g = &self.grads;
            let wgrad =
                |a, b, (m, n), out| EnginePlan::wgrad(gpu, a, b, &self.routing.row_offsets, (e, slots), (m, n), out);
            state.backward = vec![
                EnginePlan::rows_nn(gpu, (&rows.d_rows, &experts.w_down), None, &groups, (i, h), &rows.d_hidden)?,
                EnginePlan::rows_nn(
                    gpu,
                    (&rows.d_gate, &experts.w_gate),
                    Some((&rows.d_up, &experts.w_up)),
                    &groups,
                    (h, i),
                    &rows.d_in,
                )?,
                wgrad(&rows.d_rows, &rows.hidden, (h, i), WgradOut::Bf16(&g.dw_down))?,
                wgrad(&rows.d_gate, x, (i, h), WgradOut::Bf16(&g.dw_gate))?,
                wgrad(&rows.d_up, x, (i, h), WgradOut::Bf16(&g.dw_up))?,
            ];
            state.forward = vec![gate_up, down];
            state.built_for = key;
        }
        Ok(())
    }

    /// Fills every output and intermediate with NaN bytes, so a test sees any element a kernel
    /// failed to write.
    pub fn poison(&mut self) -> Result<()> {
        self.gathered_x.fill_bytes(0xff)?;
        self.routed.poison()?;
        if let Some((rows, _)) = &mut self.shared {
            rows.poison()?;
        }
        self.y.fill_bytes(0xff)?;
        self.routing.slot_row.fill_bytes(0xee)?;
        self.routing.row_source.fill_bytes(0xee)?;
        let g = &mut self.grads;
        for buffer in [&mut g.dx, &mut g.dw_gate, &mut g.dw_up, &mut g.dw_down] {
            buffer.fill_bytes(0xff)?;
        }
        g.d_topk_weights.fill_bytes(0xff)?;
        if let Some(shared) = &mut g.shared {
            for buffer in shared.iter_mut() {
                buffer.fill_bytes(0xff)?;
            }
        }
        Ok(())
    }

    fn check_inputs(
        &self,
        tokens: &DeviceTokens,
        experts: &DeviceExperts,
        shared: Option<&DeviceSharedExpert>,
    ) -> Result<()> {
        let c = &self.config;
        let (t, h, i, e, k) = (c.tokens_per_rank, c.hidden, c.intermediate, c.local_experts(), c.top_k);
        let expect = |tensor: &'static str, actual: usize, expected: usize| {
            if actual == expected {
                Ok(())
            } else {
                Err(MokError::InvalidInput {
                    tensor,
                    problem: format!("device buffer has {actual} elements, expected {expected}"),
                })
            }
        };
        expect("x", tokens.x.len(), t * h)?;
        expect("topk_ids", tokens.topk_ids.len(), t * k)?;
        expect("topk_weights", tokens.topk_weights.len(), t * k)?;
        expect("w_gate", experts.w_gate.len(), e * i * h)?;
        expect("w_up", experts.w_up.len(), e * i * h)?;
        expect("w_down", experts.w_down.len(), e * h * i)?;
        match (c.shared_intermediate, shared) {
            (Some(is), Some(s)) => {
                expect("ws_gate", s.ws_gate.len(), is * h)?;
                expect("ws_up", s.ws_up.len(), is * h)?;
                expect("ws_down", s.ws_down.len(), h * is)
            }
            (None, None) => Ok(()),
            (Some(_), None) => Err(MokError::InvalidInput {
                tensor: "shared expert",
                problem: "config has shared_intermediate but no shared weights were given".into(),
            }),
            (None, Some(_)) => Err(MokError::InvalidInput {
                tensor: "shared expert",
                problem: "shared weights given but config.shared_intermediate is None".into(),
            }),
        }
    }

    fn row_count_ptr(&self) -> u64 {
        self.routing.row_offsets.device_ptr() + 4 * self.config.num_experts as u64
    }

    /// Enqueues the routing kernels: layout of `topk_ids` into the routing buffers.
    pub fn route(&mut self, gpu: &Gpu, topk_ids: &DeviceBuffer<i32>) -> Result<()> {
        let c = &self.config;
        let (t, k, e) = (c.tokens_per_rank as u32, c.top_k as u32, c.num_experts as u32);
        let chunks = mok_kernels::layout::chunk_count(t);
        let r = &mut self.routing;
        r.error.fill_bytes(0)?;
        // SAFETY: the arguments are `mok_route_rank_chunks`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_route_rank_chunks",
                LaunchShape { grid: (chunks, 1, 1), threads: ROW_KERNEL_THREADS, smem_bytes: 4 * e },
                &[
                    Ptr(topk_ids.device_ptr()),
                    U32(t),
                    U32(k),
                    U32(e),
                    Ptr(r.chunk_counts.device_ptr()),
                    Ptr(r.slot_rank.device_ptr()),
                    Ptr(r.error.device_ptr()),
                ],
            )
        }?;
        // SAFETY: the arguments are `mok_route_scan`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_route_scan",
                LaunchShape::linear(1, 1024),
                &[
                    Ptr(r.chunk_counts.device_ptr()),
                    U32(chunks),
                    U32(e),
                    Ptr(r.expert_counts.device_ptr()),
                    Ptr(r.row_offsets.device_ptr()),
                    Ptr(r.tile_offsets.device_ptr()),
                ],
            )
        }?;
        // SAFETY: the arguments are `mok_route_place`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_route_place",
                LaunchShape::linear(t.div_ceil(ROW_KERNEL_THREADS), ROW_KERNEL_THREADS),
                &[
                    Ptr(topk_ids.device_ptr()),
                    Ptr(r.slot_rank.device_ptr()),
                    Ptr(r.chunk_counts.device_ptr()),
                    Ptr(r.row_offsets.device_ptr()),
                    U32(t),
                    U32(k),
                    U32(e),
                    Ptr(r.slot_row.device_ptr()),
                    Ptr(r.row_source.device_ptr()),
                ],
            )
        }
    }

    /// Enqueues the forward pass; `self.y` holds the output once the stream reaches it.
    pub fn forward(
        &mut self,
        gpu: &Gpu,
        tokens: &DeviceTokens,
        experts: &DeviceExperts,
        shared: Option<&DeviceSharedExpert>,
    ) -> Result<()> {
        self.check_inputs(tokens, experts, shared)?;
        // Before any launch: building plans uploads their parameter blocks.
        self.prepare_engine_plans(gpu, experts)?;
        self.route(gpu, &tokens.topk_ids)?;
        let c = self.config.clone();
        let (t, h, e, k) = (c.tokens_per_rank, c.hidden, c.num_experts, c.top_k);
        let slots = t * k;
        let count = self.row_count_ptr();
        let r = &self.routing;
        // SAFETY: the arguments are `mok_gather_rows`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_gather_rows",
                LaunchShape::linear(grid_stride_blocks(gpu, slots * h / 8), ROW_KERNEL_THREADS),
                &[
                    Ptr(tokens.x.device_ptr()),
                    Ptr(r.row_source.device_ptr()),
                    U32(k as u32),
                    Ptr(0),
                    Ptr(count),
                    U32(h as u32),
                    Ptr(self.gathered_x.device_ptr()),
                ],
            )
        }?;
        let groups = RowGroups {
            row_offsets: r.row_offsets.device_ptr(),
            tile_offsets: r.tile_offsets.device_ptr(),
            groups: e,
            rows_upper_bound: slots,
            row_count: count,
        };
        if let Some(state) = &self.engine {
            engine::tile_offsets_into(gpu, &self.routing.row_offsets, e, &state.tile_offsets)?;
            for plan in &state.forward {
                plan.launch(gpu)?;
            }
        } else {
            self.routed.forward(
                gpu,
                &groups,
                self.gathered_x.device_ptr(),
                [&experts.w_gate, &experts.w_up, &experts.w_down],
            )?;
        }
        let r = &self.routing;
        let mut shared_out = 0;
        if let (Some(weights), Some((compute, offsets))) = (shared, &self.shared) {
            compute.forward(
                gpu,
                &RowGroups::all_tokens(offsets, t),
                tokens.x.device_ptr(),
                [&weights.ws_gate, &weights.ws_up, &weights.ws_down],
            )?;
            shared_out = compute.out_rows().device_ptr();
        }
        // SAFETY: the arguments are `mok_combine_slots`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_combine_slots",
                LaunchShape::linear(grid_stride_blocks(gpu, t * h / 4), ROW_KERNEL_THREADS),
                &[
                    Ptr(r.slot_row.device_ptr()),
                    Ptr(tokens.topk_weights.device_ptr()),
                    Ptr(self.routed.rows.out.device_ptr()),
                    Ptr(shared_out),
                    U32(t as u32),
                    U32(k as u32),
                    U32(h as u32),
                    Ptr(self.y.device_ptr()),
                ],
            )
        }
    }

    /// Enqueues the backward pass of the last forward (same inputs) for output gradient `dy`;
    /// the gradients land in `self.grads`.
    pub fn backward(
        &mut self,
        gpu: &Gpu,
        tokens: &DeviceTokens,
        experts: &DeviceExperts,
        shared: Option<&DeviceSharedExpert>,
        dy: &DeviceBuffer<bf16>,
    ) -> Result<()> {
        self.check_inputs(tokens, experts, shared)?;
        let c = self.config.clone();
        let (t, h, e, k) = (c.tokens_per_rank, c.hidden, c.num_experts, c.top_k);
        if dy.len() != t * h {
            return Err(MokError::InvalidInput {
                tensor: "dy",
                problem: format!("device buffer has {} elements, expected {}", dy.len(), t * h),
            });
        }
        self.prepare_engine_plans(gpu, experts)?;
        let slots = t * k;
        let count = self.row_count_ptr();
        let r = &self.routing;
        // SAFETY: the arguments are `mok_gather_rows`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_gather_rows",
                LaunchShape::linear(grid_stride_blocks(gpu, slots * h / 8), ROW_KERNEL_THREADS),
                &[
                    Ptr(dy.device_ptr()),
                    Ptr(r.row_source.device_ptr()),
                    U32(k as u32),
                    Ptr(tokens.topk_weights.device_ptr()),
                    Ptr(count),
                    U32(h as u32),
                    Ptr(self.routed.rows.d_rows.device_ptr()),
                ],
            )
        }?;
        // SAFETY: the arguments are `mok_topk_weight_grad`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_topk_weight_grad",
                LaunchShape::linear(grid_stride_blocks(gpu, slots * 32), ROW_KERNEL_THREADS),
                &[
                    Ptr(dy.device_ptr()),
                    Ptr(self.routed.rows.out.device_ptr()),
                    Ptr(r.slot_row.device_ptr()),
                    U32(t as u32),
                    U32(k as u32),
                    U32(h as u32),
                    Ptr(self.grads.d_topk_weights.device_ptr()),
                ],
            )
        }?;
        let groups = RowGroups {
            row_offsets: r.row_offsets.device_ptr(),
            tile_offsets: r.tile_offsets.device_ptr(),
            groups: e,
            rows_upper_bound: slots,
            row_count: count,
        };
        if let Some(state) = &self.engine {
            // This routing's tile offsets again: the forward may have run with the engine off.
            engine::tile_offsets_into(gpu, &self.routing.row_offsets, e, &state.tile_offsets)?;
            state.backward[0].launch(gpu)?;
            self.routed.swiglu_backward(gpu, &groups)?;
            for plan in &state.backward[1..] {
                plan.launch(gpu)?;
            }
        } else {
            self.routed.backward(
                gpu,
                &groups,
                ExpertBackward {
                    input_rows: self.gathered_x.device_ptr(),
                    d_out_rows: self.routed.rows.d_rows.device_ptr(),
                    weights: [&experts.w_gate, &experts.w_up, &experts.w_down],
                    weight_grads: [
                        self.grads.dw_gate.device_ptr(),
                        self.grads.dw_up.device_ptr(),
                        self.grads.dw_down.device_ptr(),
                    ],
                },
            )?;
        }
        let r = &self.routing;
        let mut shared_dx = 0;
        if let (Some(weights), Some((compute, offsets))) = (shared, &self.shared) {
            let grads = self.grads.shared.as_ref().expect("allocated with the config");
            compute.backward(
                gpu,
                &RowGroups::all_tokens(offsets, t),
                ExpertBackward {
                    input_rows: tokens.x.device_ptr(),
                    // The shared expert's output is added unscaled, so its output gradient is dy.
                    d_out_rows: dy.device_ptr(),
                    weights: [&weights.ws_gate, &weights.ws_up, &weights.ws_down],
                    weight_grads: [grads[0].device_ptr(), grads[1].device_ptr(), grads[2].device_ptr()],
                },
            )?;
            shared_dx = compute.d_in_rows().device_ptr();
        }
        // SAFETY: the arguments are `mok_combine_slots`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_combine_slots",
                LaunchShape::linear(grid_stride_blocks(gpu, t * h / 4), ROW_KERNEL_THREADS),
                &[
                    Ptr(r.slot_row.device_ptr()),
                    Ptr(0),
                    Ptr(self.routed.rows.d_in.device_ptr()),
                    Ptr(shared_dx),
                    U32(t as u32),
                    U32(k as u32),
                    U32(h as u32),
                    Ptr(self.grads.dx.device_ptr()),
                ],
            )
        }
    }

    /// Waits for the stream and reports a routing problem the kernels found in `topk_ids`
    /// (an id out of range or repeated in a token: that slot was dropped).
    pub fn check_device_errors(&self) -> Result<()> {
        let words = self.routing.error.download()?;
        let k = self.config.top_k as u32;
        let describe = |what: &str| {
            format!(
                "token {} slot {} has expert id {}: {what}; the slot was dropped",
                words[1] / k,
                words[1] % k,
                words[2] as i32
            )
        };
        match words[0] {
            0 => Ok(()),
            mok_kernels::layout::ROUTE_ERROR_ID_OUT_OF_RANGE => Err(MokError::Device {
                kernel: "mok_route_rank_chunks",
                message: describe(&format!("outside [0, {}) and not -1", self.config.num_experts)),
            }),
            mok_kernels::layout::ROUTE_ERROR_DUPLICATE_ID => Err(MokError::Device {
                kernel: "mok_route_rank_chunks",
                message: describe("repeats an earlier slot of the token"),
            }),
            code => {
                Err(MokError::Device { kernel: "mok_route_rank_chunks", message: format!("unknown error code {code}") })
            }
        }
    }

    /// Saved forward intermediates of the routed experts, in row order:
    /// `(gate pre-activations f32, up pre-activations f32, hidden bf16, down output f32)`.
    pub fn routed_intermediates(
        &self,
    ) -> (&DeviceBuffer<f32>, &DeviceBuffer<f32>, &DeviceBuffer<bf16>, &DeviceBuffer<f32>) {
        let r = &self.routed.rows;
        (&r.gate, &r.up, &r.hidden, &r.out)
    }

    /// Saved backward intermediates of the routed experts, in row order: `(d_rows bf16 [R,H]
    /// (dy scaled by the slot weight), d_hidden f32 [R,I], d_gate bf16 [R,I], d_up bf16 [R,I],
    /// d_in f32 [R,H] (the rows' data gradient))`. The GEMM engine tests feed them to the
    /// tensor-core kernels and compare.
    pub fn routed_backward_intermediates(&self) -> RoutedBackward<'_> {
        let r = &self.routed.rows;
        RoutedBackward { d_rows: &r.d_rows, d_hidden: &r.d_hidden, d_gate: &r.d_gate, d_up: &r.d_up, d_in: &r.d_in }
    }
}

/// See [`UnfusedLayer::routed_backward_intermediates`].
pub struct RoutedBackward<'a> {
    /// `[R, H]` bf16: dy gathered and scaled by the slot weight.
    pub d_rows: &'a DeviceBuffer<bf16>,
    /// `[R, I]` f32.
    pub d_hidden: &'a DeviceBuffer<f32>,
    /// `[R, I]` bf16.
    pub d_gate: &'a DeviceBuffer<bf16>,
    /// `[R, I]` bf16.
    pub d_up: &'a DeviceBuffer<bf16>,
    /// `[R, H]` f32.
    pub d_in: &'a DeviceBuffer<f32>,
}

/// The expert computation of one set of groups — gate/up GEMM with SwiGLU, down GEMM, their
/// backward and the weight gradients — over rows the caller provides and places: the unfused
/// layer's routed experts (rows gathered in expert order) and shared expert (all tokens), and
/// the expert-parallel exchange's receive ring (rows dispatched from every rank). Each output row
/// depends only on its input row, and each weight gradient reduces over a group's rows in order
/// from the group's first row, so the same rows in the same order give the same bits wherever
/// the group starts.
pub struct ExpertCompute {
    rows: ExpertRows,
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
    pub weights: [&'a DeviceBuffer<bf16>; 3],
    /// Device addresses of `(dw_gate [G, I, H], dw_up [G, I, H], dw_down [G, H, I])` bf16.
    pub weight_grads: [u64; 3],
}

fn row_grid(rows_upper_bound: usize, groups: usize, n: usize) -> (u32, u32, u32) {
    let m_tiles = mok_kernels::tiles::max_m_tiles(rows_upper_bound as u32, groups as u32);
    (m_tiles, (n as u32).div_ceil(kc::GEMM_TILE_N), 1)
}

fn gemm_shape(grid: (u32, u32, u32)) -> LaunchShape {
    LaunchShape { grid, threads: kc::GEMM_THREADS, smem_bytes: kc::GEMM_SMEM_BYTES }
}

impl ExpertCompute {
    /// Workspace for up to `capacity` rows of width `hidden` through an intermediate of width
    /// `inter`. `with_d_rows`: also a `[capacity][H]` bf16 buffer for the caller to gather the
    /// output gradient into ([`Self::d_rows`]).
    pub fn new(
        gpu: &Gpu,
        capacity: usize,
        hidden: usize,
        inter: usize,
        swiglu_limit: Option<f32>,
        with_d_rows: bool,
    ) -> Result<Self> {
        Ok(Self {
            rows: ExpertRows::alloc(gpu, capacity, hidden, inter, with_d_rows)?,
            hidden,
            inter,
            limit: swiglu_limit.unwrap_or(f32::INFINITY),
            capacity,
        })
    }

    /// `[R][H]` f32 output rows of the last forward.
    pub fn out_rows(&self) -> &DeviceBuffer<f32> {
        &self.rows.out
    }

    /// `[R][H]` f32 input-row gradients of the last backward.
    pub fn d_in_rows(&self) -> &DeviceBuffer<f32> {
        &self.rows.d_in
    }

    /// `[R][H]` bf16 output-gradient rows (allocated when built `with_d_rows`).
    pub fn d_rows(&self) -> &DeviceBuffer<bf16> {
        &self.rows.d_rows
    }

    /// Fills the workspace with NaN bytes.
    pub fn poison(&mut self) -> Result<()> {
        self.rows.poison()
    }

    /// Enqueues gate/up with SwiGLU, then down, over `groups` of `input_rows` (`[R][H]` bf16)
    /// with `weights` = `(w_gate [G, I, H], w_up [G, I, H], w_down [G, H, I])`; the f32 output
    /// rows land in [`Self::out_rows`], the saved pre-activations in this workspace.
    pub fn forward(
        &self,
        gpu: &Gpu,
        groups: &RowGroups,
        input_rows: u64,
        weights: [&DeviceBuffer<bf16>; 3],
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
    fn swiglu_backward(&self, gpu: &Gpu, groups: &RowGroups) -> Result<()> {
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
    pub fn backward(&self, gpu: &Gpu, groups: &RowGroups, args: ExpertBackward<'_>) -> Result<()> {
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
                    &[Ptr(a), Ptr(b), Ptr(groups.row_offsets), U32(m as u32), U32(n as u32), Ptr(out), Ptr(0)],
                )
            }
        };
        let [dw_gate, dw_up, dw_down] = args.weight_grads;
        wgrad(args.d_out_rows, rows.hidden.device_ptr(), h, inter, dw_down)?;
        wgrad(rows.d_gate.device_ptr(), args.input_rows, inter, h, dw_gate)?;
        wgrad(rows.d_up.device_ptr(), args.input_rows, inter, h, dw_up)
    }
}
