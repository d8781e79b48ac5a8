//! The single-rank layer: routing layout, workspace, forward and backward, the optional GEMM
//! engine for the routed experts.

use half::bf16;

use crate::config::MoeConfig;
use crate::driver::{
    DeviceBuffer, DeviceSlice, DeviceSliceMut, Gpu, KernelArg, LaunchShape, PlacedViews, check_aligned,
};
use crate::error::{MokError, Result};
use crate::gemm::{self as engine, EnginePlan};
use crate::megakernel::{
    BACKWARD_KERNEL, BackwardBuffers, BackwardMegakernel, ErrorRecord, FORWARD_KERNEL, ForwardMegakernel,
    MegakernelOptions, PassBuffers, SharedPassBuffers, average_rows_per_expert, checked_geometry,
    one_gpu_backward_options, plan_addresses, resident_blocks,
};
#[cfg(feature = "testing")]
use crate::megakernel::{MegakernelFaults, MegakernelWork};

use super::kept::Kept;
use super::*;
use KernelArg::{Ptr, U32};

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

/// Gradients produced by [`UnfusedLayer::backward`], on the device.
pub struct DeviceGrads {
    /// `[T, H]` bf16.
    pub dx: DeviceBuffer<bf16>,
    /// `[T, k]` f32 (0 for dropped slots).
    pub d_topk_weights: DeviceBuffer<f32>,
    /// `[E/P, I, H]` bf16. The three routed weight gradients are allocated by the first backward
    /// that leaves its gradients in the layer ([`WeightGradTarget::Layer`]); empty until then
    /// (a caller that passes its own buffers never pays for them: 3 · E · I · H bf16).
    pub dw_gate: DeviceBuffer<bf16>,
    /// `[E/P, I, H]` bf16 (allocated as `dw_gate`).
    pub dw_up: DeviceBuffer<bf16>,
    /// `[E/P, H, I]` bf16 (allocated as `dw_gate`).
    pub dw_down: DeviceBuffer<bf16>,
    /// Shared expert `(dws_gate [Is,H], dws_up [Is,H], dws_down [H,Is])`, bf16.
    pub shared: Option<[DeviceBuffer<bf16>; 3]>,
}

/// The unfused layer of one rank (P = 1: every expert is local) with its workspace. Every
/// method that takes a `Gpu` refuses one other than the handle the layer was built with
/// (`InvalidInput` naming `gpu`): another handle's stream would not order the layer's work.
pub struct UnfusedLayer {
    config: MoeConfig,
    /// The handle the layer was built with: every call must pass it (its stream orders the
    /// layer's copies and kernels; [`Gpu::require_same_handle`]).
    gpu: Gpu,
    /// The views found on the layer's GPU: steps over the same buffers ask the driver nothing.
    placed: PlacedViews,
    routing: RoutingBuffers,
    gathered_x: DeviceBuffer<bf16>,
    routed: ExpertCompute,
    shared: Option<(ExpertCompute, DeviceBuffer<u32>)>,
    y: DeviceBuffer<bf16>,
    grads: DeviceGrads,
    /// The routed experts' GEMMs on the tensor-core engine instead of the `mma.sync` kernels
    /// ([`UnfusedLayer::set_gemm_engine`]).
    engine: Option<EngineExperts>,
    /// The forward as one persistent launch ([`UnfusedLayer::set_forward_megakernel`]): its
    /// options, and the passes built for the engine's current plans and the ones before, keyed
    /// by the plans' parameter blocks.
    megakernel: Option<(MegakernelOptions, KeptPasses<ForwardMegakernel>)>,
    /// The backward as one persistent launch ([`UnfusedLayer::set_backward_megakernel`]): its
    /// options, and the passes as the forward's.
    backward_megakernel: Option<(MegakernelOptions, KeptPasses<BackwardMegakernel>)>,
    /// Where every forward and every backward megakernel pass records its first failure, from
    /// the first pass of each on (kept when passes are rebuilt or dropped, so a failure waits
    /// for [`UnfusedLayer::check_device_errors`]). Never replaced, and declared after the passes,
    /// which hold their addresses and so are dropped first.
    megakernel_records: [Option<ErrorRecord>; 2],
    /// Tokens of the last forward (at most `config.tokens_per_rank`, the capacity).
    tokens: usize,
    /// The shared expert's engine plans inside the megakernels (built with their passes), for
    /// its current weights and the ones before.
    shared_engine: Kept<[u64; 3], SharedEnginePlans>,
    /// Whether the shared expert's copy of the token rows holds the last forward's x (its
    /// megakernel copied it), so a backward megakernel need not copy it again.
    shared_x_from_forward: bool,
    /// The routed gate/up (engine path or forward megakernel) gathers its rows from x in its
    /// producers ([`UnfusedLayer::set_gather_in_producers`]) instead of reading `gathered_x`.
    gather_forward: bool,
    /// The gate and up weight gradients (engine path or backward megakernel) gather their rows
    /// from x in their producers instead of reading `gathered_x`.
    gather_weight_gradients: bool,
    /// Whether `gathered_x` holds the last forward's rows (a forward whose gate/up gathered
    /// them itself left it stale: the backward fills it before its weight gradients read it).
    x_rows_gathered: bool,
    /// Whether a forward has been enqueued whole since the layer was built and since its routing
    /// was last replaced (`route`): a backward reads the forward's routing layout and rows.
    forward_ran: bool,
}

/// Megakernel passes, kept by the parameter-block addresses of the plans each was built over
/// ([`plan_addresses`]).
type KeptPasses<P> = Kept<Vec<u64>, P>;

/// Drops the passes built over any plan at the addresses `stale` (plans about to be freed).
fn drop_passes_over<P>(passes: &mut Option<(MegakernelOptions, KeptPasses<P>)>, stale: &[u64]) {
    if let Some((_, passes)) = passes {
        passes.remove_if(|key| key.iter().any(|plan| stale.contains(plan)));
    }
}

/// The routed experts' GEMMs on the sm_90a tensor-core engine ([`crate::gemm`]) — the same
/// products as the `mma.sync` kernels, bit for bit as measured: plans built for the layer's own
/// buffers and the expert weights (and gradient target) of a call, built again when a call
/// passes other ones, unless they are the ones before ([`Kept`]).
struct EngineExperts {
    /// `[2 · (E + 1)]` the engine's tile offsets, written on the device in each forward and
    /// backward before the engine's GEMMs.
    tile_offsets: DeviceBuffer<u32>,
    /// The forward and data-gradient plans, by the (gate, up, down) weight addresses.
    weights: Kept<[u64; 3], WeightPlans>,
    /// The down, gate and up weight gradients, by the (dw_gate, dw_up, dw_down) addresses and
    /// whether they add into f32: the gate and up over the layer's gathered rows, or, with
    /// [`UnfusedLayer::set_gather_in_producer`], gathering the token rows in their producers.
    /// The engine path and the backward megakernel run the same plans.
    wgrad: Kept<([u64; 3], bool), Vec<EnginePlan>>,
}

/// The plans that read one set of expert weights.
struct WeightPlans {
    /// Gate/up with SwiGLU (keeping the pre-activations for backward) over the layer's gathered
    /// rows or, with [`UnfusedLayer::set_gather_in_producer`], gathering its rows from x in its
    /// producers; down. The engine path and the forward megakernel run the same plans.
    forward: Vec<EnginePlan>,
    /// Down dgrad (into d_hidden); gate/up dgrad (two K segments). The backward megakernel runs
    /// them too, with the SwiGLU backward between them.
    dgrad: Vec<EnginePlan>,
}

impl EngineExperts {
    /// The current weights' forward plans (none before the first call).
    fn forward(&self) -> &[EnginePlan] {
        self.weights.current().map_or(&[], |p| &p.forward)
    }

    /// The current weights' data-gradient plans.
    fn dgrad(&self) -> &[EnginePlan] {
        self.weights.current().map_or(&[], |p| &p.dgrad)
    }

    /// The current target's weight-gradient plans.
    fn wgrad(&self) -> &[EnginePlan] {
        self.wgrad.current().map_or(&[], Vec::as_slice)
    }
}

/// Where a backward puts the weight gradients (every routed weight, and the shared expert's).
pub enum WeightGradTarget<'a> {
    /// Fresh bf16 gradients in the layer's own [`DeviceGrads`] (its routed weight gradients are
    /// allocated by the first backward given this target).
    Layer,
    /// Fresh bf16 gradients in the caller's buffers.
    Bf16(WeightGradViews<'a, bf16>),
    /// Added into the caller's f32 buffers (`+=`, one rounding per element): a training loop's
    /// main gradients, accumulated over micro-batches.
    AccumulateF32(WeightGradViews<'a, f32>),
}

impl WeightGradTarget<'_> {
    /// The caller's views, named (none for [`WeightGradTarget::Layer`]).
    pub(crate) fn view_addresses(&self) -> Vec<(&'static str, u64)> {
        fn of<T>(views: &WeightGradViews<'_, T>) -> Vec<(&'static str, u64)> {
            let mut named = vec![
                ("dw_gate", views.dw_gate.device_ptr()),
                ("dw_up", views.dw_up.device_ptr()),
                ("dw_down", views.dw_down.device_ptr()),
            ];
            if let Some([g, u, d]) = &views.shared {
                named.extend([("dws_gate", g.device_ptr()), ("dws_up", u.device_ptr()), ("dws_down", d.device_ptr())]);
            }
            named
        }
        match self {
            WeightGradTarget::Layer => Vec::new(),
            WeightGradTarget::Bf16(views) => of(views),
            WeightGradTarget::AccumulateF32(views) => of(views),
        }
    }
}

/// A caller's weight-gradient buffers, in the weights' layouts: the layer's own experts
/// (`[E/P, ...]`; through `MoeLayer` over P virtual ranks all E experts, `[E, ...]`).
pub struct WeightGradViews<'a, T> {
    /// `[E/P, I, H]`.
    pub dw_gate: DeviceSliceMut<'a, T>,
    /// `[E/P, I, H]`.
    pub dw_up: DeviceSliceMut<'a, T>,
    /// `[E/P, H, I]`.
    pub dw_down: DeviceSliceMut<'a, T>,
    /// The shared expert's `(dws_gate [Is, H], dws_up [Is, H], dws_down [H, Is])`, when the layer
    /// has one.
    pub shared: Option<[DeviceSliceMut<'a, T>; 3]>,
}

/// A checked [`WeightGradTarget`]: addresses and the mode.
struct GradAddresses {
    routed: [u64; 3],
    shared: Option<[u64; 3]>,
    accumulate_f32: bool,
}

impl UnfusedLayer {
    /// Validates `config` and allocates the workspace for it.
    pub fn new(gpu: &Gpu, config: MoeConfig) -> Result<Self> {
        Self::with_gathered_copy(gpu, config, true)
    }

    /// [`Self::new`], with the gathered copy of the token rows or without it (`gathered_copy`:
    /// for a layer whose producers will gather the rows, [`Self::set_gather_in_producer`],
    /// which never holds it; a pass that reads the copy allocates it first).
    pub(crate) fn with_gathered_copy(gpu: &Gpu, config: MoeConfig, gathered_copy: bool) -> Result<Self> {
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
            // Zeroed once: the routing keeps the first bad id until a check reports it.
            error: {
                let mut record = DeviceBuffer::alloc(gpu, 4)?;
                record.fill_bytes(0)?;
                record
            },
        };
        // The shared expert is one group holding every token.
        let (shared, shared_grads) = shared_expert_workspace(gpu, &config)?.unzip();
        // NaN bytes, as `poison` leaves it: no pass reads a row it did not write.
        let gathered_x = nan_filled(gpu, if gathered_copy { slots * h } else { 0 })?;
        Ok(Self {
            gpu: gpu.handle(),
            placed: PlacedViews::default(),
            routing,
            gathered_x,
            routed: ExpertCompute::new(gpu, slots, h, i, config.swiglu_limit, true)?,
            shared,
            y: DeviceBuffer::alloc(gpu, t * h)?,
            engine: None,
            megakernel: None,
            backward_megakernel: None,
            megakernel_records: [None, None],
            tokens: t,
            shared_engine: Kept::new(),
            shared_x_from_forward: false,
            gather_forward: false,
            gather_weight_gradients: false,
            x_rows_gathered: false,
            forward_ran: false,
            grads: DeviceGrads {
                dx: DeviceBuffer::alloc(gpu, t * h)?,
                d_topk_weights: DeviceBuffer::alloc(gpu, slots)?,
                // Empty until a backward leaves its gradients in the layer (`grad_addresses`).
                dw_gate: DeviceBuffer::alloc(gpu, 0)?,
                dw_up: DeviceBuffer::alloc(gpu, 0)?,
                dw_down: DeviceBuffer::alloc(gpu, 0)?,
                shared: shared_grads,
            },
            config,
        })
    }

    /// The configuration this layer was built for.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The routing layout of the last forward (read it after the stream has run the pass).
    pub fn routing(&self) -> &RoutingBuffers {
        &self.routing
    }

    /// `[T·k][H]` bf16: the last pass's x rows in expert order (the first `total` rows valid),
    /// written by the forward, or, while the gate/up alone gathers its rows
    /// ([`Self::set_gather_in_producers`]), by the backward (between the two it holds the
    /// previous pass's rows or NaN bytes); empty while the gate/up and the weight gradients all
    /// gather, and in a layer built without it before its first pass that reads it.
    pub fn gathered_rows(&self) -> &DeviceBuffer<bf16> {
        &self.gathered_x
    }

    /// `[T, H]` bf16 output of the last forward (its first T rows, T the pass's token count).
    pub fn y(&self) -> &DeviceBuffer<bf16> {
        &self.y
    }

    /// Gradients of the last backward that targeted the layer's own buffers (dx and
    /// d_topk_weights always land here).
    pub fn grads(&self) -> &DeviceGrads {
        &self.grads
    }

    /// Runs the routed experts' GEMMs on the tensor-core engine (`on`) or on the `mma.sync`
    /// kernels (the default). Every output and gradient is meant to be bitwise the same either
    /// way (the engine's kernels measured equal to the `mma.sync` ones, and
    /// `gemm_engine_path_is_bitwise_the_mma_sync_path` asserts it for the layer); the shared
    /// expert stays on the `mma.sync` kernels. The engine needs an sm_90 GPU (Hopper) and every
    /// engine kernel in the loaded PTX: otherwise an error, and the layer is unchanged.
    /// Switching it off also switches off both megakernels and the producers' gathering (they
    /// are the engine's) and allocates the gathered copy the `mma.sync` kernels read. Its plans
    /// hold the addresses of this layer's buffers: do not replace the buffers behind
    /// [`Self::routing`], [`Self::gathered_rows`] or [`Self::grads`] while it is on.
    pub fn set_gemm_engine(&mut self, gpu: &Gpu, on: bool) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        if !on {
            // Both megakernels run on the engine's plans, and the producers' gathers are the
            // engine's: the `mma.sync` kernels read the gathered copy.
            self.fit_gathered_copy(gpu, false)?;
            self.gather_forward = false;
            self.gather_weight_gradients = false;
            self.engine = None;
            self.megakernel = None;
            self.backward_megakernel = None;
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
                weights: Kept::new(),
                wgrad: Kept::new(),
            });
        }
        Ok(())
    }

    /// Runs the forward as one persistent launch after the schedule (`Some(options)`: the
    /// forward megakernel, sm_90a; it needs the tensor-core engine and switches it on), or as
    /// separate launches (`None`). Both give the same bits; the backward is unchanged and reads
    /// what either forward saved. Errors, leaving the layer unchanged, when this GPU or the
    /// loaded PTX cannot run it or the options' geometry cannot be resident.
    pub fn set_forward_megakernel(&mut self, gpu: &Gpu, options: Option<MegakernelOptions>) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        let Some(options) = options else {
            self.megakernel = None;
            return Ok(());
        };
        if !gpu.has_kernel(FORWARD_KERNEL) || gpu.compute_capability().0 != 9 {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: format!(
                    "needs an sm_90 GPU and {FORWARD_KERNEL} in the loaded PTX (this GPU is sm_{}{})",
                    gpu.compute_capability().0,
                    gpu.compute_capability().1
                ),
            });
        }
        checked_geometry(resident_blocks(gpu, FORWARD_KERNEL)?, &options, 1)?;
        self.set_gemm_engine(gpu, true)?;
        self.megakernel = Some((options, Kept::new()));
        Ok(())
    }

    /// Runs the backward as one persistent launch (`Some(options)`: the backward megakernel,
    /// sm_90a, the shared expert's backward inside the same launch; it needs the tensor-core
    /// engine and switches it on), or as separate launches (`None`). Both give the same bits.
    /// Errors, leaving the layer unchanged, when this GPU or the loaded PTX cannot run it or the
    /// options' geometry cannot be resident.
    pub fn set_backward_megakernel(&mut self, gpu: &Gpu, options: Option<MegakernelOptions>) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        let Some(options) = options else {
            self.backward_megakernel = None;
            return Ok(());
        };
        if !gpu.has_kernel(BACKWARD_KERNEL) || gpu.compute_capability().0 != 9 {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: format!(
                    "needs an sm_90 GPU and {BACKWARD_KERNEL} in the loaded PTX (this GPU is sm_{}{})",
                    gpu.compute_capability().0,
                    gpu.compute_capability().1
                ),
            });
        }
        checked_geometry(resident_blocks(gpu, BACKWARD_KERNEL)?, &options, 1)?;
        self.set_gemm_engine(gpu, true)?;
        self.backward_megakernel = Some((options, Kept::new()));
        Ok(())
    }

    /// Whether the backward runs as the megakernel.
    pub fn uses_backward_megakernel(&self) -> bool {
        self.backward_megakernel.is_some()
    }

    /// The last backward megakernel pass's (blocks, comm blocks), once a backward has built it.
    pub fn backward_megakernel_geometry(&self) -> Option<(u32, u32)> {
        self.backward_megakernel.as_ref().and_then(|(_, passes)| passes.current()).map(BackwardMegakernel::geometry)
    }

    /// Faults for the following backward megakernel passes (feature `testing`; the pass must
    /// exist: run a backward first): an M tile whose dy rows are never published, one whose
    /// down-dgrad parts are never counted. They are the current pass's, the one built for the
    /// last backward's buffers: a pass kept for other buffers keeps its own (as do the work
    /// masks).
    #[cfg(feature = "testing")]
    pub fn set_backward_megakernel_faults(&mut self, faults: MegakernelFaults) -> Result<()> {
        let pass = self.backward_megakernel.as_mut().and_then(|(_, passes)| passes.current_mut());
        let Some(pass) = pass else {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: "no backward megakernel pass yet (switch it on and run a backward)".into(),
            });
        };
        pass.set_faults(0, faults)
    }

    /// The work of the following backward megakernel passes (feature `testing`: the benchmark's
    /// overlap measurement; [`MegakernelWork::COMM_ONLY`] is the gather with the slot-weight
    /// gradients and the dx combine, [`MegakernelWork::COMPUTE_ONLY`] the GEMM tiles). The pass
    /// must exist.
    #[cfg(feature = "testing")]
    pub fn set_backward_megakernel_work(&mut self, work: MegakernelWork) -> Result<()> {
        let pass = self.backward_megakernel.as_mut().and_then(|(_, passes)| passes.current_mut());
        let Some(pass) = pass else {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: "no backward megakernel pass yet (switch it on and run a backward)".into(),
            });
        };
        pass.set_work(work)
    }

    /// Builds the backward megakernel pass for the engine's current plans (when it is on), with
    /// the shared expert's backward plans inside it when `with_shared`.
    fn prepare_backward_megakernel(&mut self, gpu: &Gpu, with_shared: bool) -> Result<()> {
        let (Some((options, passes)), Some(engine)) = (self.backward_megakernel.as_mut(), self.engine.as_ref()) else {
            return Ok(());
        };
        let shared_engine = self.shared_engine.current().filter(|_| with_shared);
        let plans = backward_pass_plans(backward_plans(engine), shared_engine);
        let key = plan_addresses(&plans);
        let c = &self.config;
        let rows = &self.routed.rows;
        let buffers = BackwardBuffers {
            row_source: self.routing.row_source.device_ptr(),
            slot_row: self.routing.slot_row.device_ptr(),
            down_rows: rows.out.device_ptr(),
            d_rows: rows.d_rows.device_ptr(),
            d_in_rows: rows.d_in.device_ptr(),
            dx: self.grads.dx.device_ptr(),
            d_topk_weights: self.grads.d_topk_weights.device_ptr(),
            top_k: c.top_k as u32,
            hidden: c.hidden as u32,
            rank: None,
            swiglu: self.routed.swiglu_backward_rows(),
            shared: shared_engine.and_then(SharedEnginePlans::backward_pass_rows),
        };
        let record = &mut self.megakernel_records[1];
        passes.select(key, || {
            let record = ErrorRecord::kept(record, gpu)?;
            let resident = resident_blocks(gpu, BACKWARD_KERNEL)?;
            let options = one_gpu_backward_options(options, c.intermediate, average_rows_per_expert(c), resident);
            BackwardMegakernel::new(gpu, &[&plans], &[buffers], &options, Some(record))
        })
    }

    /// Whether the forward runs as the megakernel.
    pub fn uses_forward_megakernel(&self) -> bool {
        self.megakernel.is_some()
    }

    /// The last megakernel pass's (blocks, comm blocks), once a forward has built it.
    pub fn forward_megakernel_geometry(&self) -> Option<(u32, u32)> {
        self.megakernel.as_ref().and_then(|(_, passes)| passes.current()).map(ForwardMegakernel::geometry)
    }

    /// Faults for the following megakernel passes (feature `testing`; the pass must exist: run
    /// a forward first). A tile whose rows are never published is refused while the gate/up
    /// gathers its rows ([`Self::set_gather_in_producer`]): no routed row is published then.
    /// They are the current pass's, the one built for the last forward's buffers: a pass kept
    /// for other buffers keeps its own (as do the work masks).
    #[cfg(feature = "testing")]
    pub fn set_forward_megakernel_faults(&mut self, faults: MegakernelFaults) -> Result<()> {
        if self.gather_forward && faults.silent_rows_tile.is_some() {
            return Err(MokError::InvalidInput {
                tensor: "faults",
                problem: "no routed row is published while the gate/up gathers its rows: a silent rows tile \
                          would inject nothing"
                    .into(),
            });
        }
        self.built_megakernel()?.set_faults(0, faults)
    }

    /// The work of the following megakernel passes (feature `testing`: the benchmark's overlap
    /// measurement; only [`MegakernelWork::ALL`] computes the layer). The pass must exist.
    #[cfg(feature = "testing")]
    pub fn set_forward_megakernel_work(&mut self, work: MegakernelWork) -> Result<()> {
        self.built_megakernel()?.set_work(work)
    }

    /// The megakernel pass, once a forward has built it (for the test hooks).
    #[cfg(feature = "testing")]
    fn built_megakernel(&mut self) -> Result<&mut ForwardMegakernel> {
        self.megakernel.as_mut().and_then(|(_, passes)| passes.current_mut()).ok_or_else(|| MokError::InvalidInput {
            tensor: "megakernel",
            problem: "no megakernel pass yet (switch it on and run a forward)".into(),
        })
    }

    /// Builds the shared expert's engine plans for `shared` (when a megakernel is on and the
    /// layer has a shared expert): on first use, and again for other weights.
    fn prepare_shared_engine(&mut self, gpu: &Gpu, shared: Option<SharedExpertView<'_>>) -> Result<()> {
        if self.megakernel.is_none() && self.backward_megakernel.is_none() {
            return Ok(());
        }
        if let (Some(weights), Some(workspace)) = (shared, &self.shared) {
            let key = SharedEnginePlans::key(weights);
            if self.shared_engine.current().is_some_and(|s| s.built_for(weights)) {
                return Ok(());
            }
            if let Some(dropped) = self.shared_engine.dropped_by(&key) {
                // Plans for a third set of weights drop the oldest, whose plans and buffers (x
                // and dy copies) the passes built over it read: those passes go first.
                let stale = dropped.plan_addresses();
                drop_passes_over(&mut self.megakernel, &stale);
                drop_passes_over(&mut self.backward_megakernel, &stale);
            }
            // The other set's copy of the token rows does not hold the last forward's x.
            self.shared_x_from_forward = false;
            self.shared_engine.select(key, || SharedEnginePlans::new(gpu, workspace, weights))?;
        }
        Ok(())
    }

    /// Builds the megakernel pass for the engine's current plans (when it is on), with the
    /// shared expert's plans for `shared` inside it.
    fn prepare_megakernel(&mut self, gpu: &Gpu, shared: Option<SharedExpertView<'_>>) -> Result<()> {
        self.prepare_shared_engine(gpu, shared)?;
        let (Some((options, passes)), Some(engine)) = (self.megakernel.as_mut(), self.engine.as_ref()) else {
            return Ok(());
        };
        let shared_engine = self.shared_engine.current().filter(|_| shared.is_some());
        let plans = forward_pass_plans([&engine.forward()[0], &engine.forward()[1]], shared_engine);
        let key = plan_addresses(&plans);
        let c = &self.config;
        let buffers = PassBuffers {
            row_source: self.routing.row_source.device_ptr(),
            slot_row: self.routing.slot_row.device_ptr(),
            rows: self.gathered_x.device_ptr(),
            down_rows: self.routed.rows.out.device_ptr(),
            y: self.y.device_ptr(),
            top_k: c.top_k as u32,
            hidden: c.hidden as u32,
            rank: None,
            shared: shared_engine.map(|s| SharedPassBuffers { x_rows: s.x_rows() }),
        };
        let record = &mut self.megakernel_records[0];
        passes.select(key, || {
            let record = ErrorRecord::kept(record, gpu)?;
            ForwardMegakernel::new(gpu, &[&plans], &[buffers], options, Some(record))
        })
    }

    /// Whether the routed experts' GEMMs run on the tensor-core engine.
    pub fn uses_gemm_engine(&self) -> bool {
        self.engine.is_some()
    }

    /// Makes the routed gate/up and the gate and up weight gradients gather their token rows
    /// from x in their producers (`on`) or read them from a gathered copy (the default):
    /// [`Self::set_gather_in_producers`] with `on` for both passes.
    pub fn set_gather_in_producer(&mut self, gpu: &Gpu, on: bool) -> Result<()> {
        self.set_gather_in_producers(gpu, on, on)
    }

    /// Makes the routed gate/up (`forward`) and the gate and up weight gradients
    /// (`weight_gradients`) gather their token rows from x in their producers, or read them from
    /// a gathered copy: on the engine path `mok_sm90_gemm_gate_up_gathering` and
    /// `mok_sm90_gemm_wgrad_gathering`, in the forward megakernel its gate/up tiles, whose
    /// dispatch then copies no routed row, and in the backward megakernel its gate and up
    /// weight-gradient tiles. With both the layer holds no gathered copy of the rows (T · k · H
    /// bf16 less to hold, and to write and read per forward; [`Self::gathered_rows`] is then
    /// empty); with the forward alone the backward writes the copy before its weight gradients
    /// read it. A change that needs the copy again allocates it (an error there, such as out
    /// of memory, leaves the layer as it was). Every output and gradient is the same bits in
    /// each form; on the H200 the gathering gate/up takes 1.06–1.10× the plain one's time and
    /// the gathering weight gradients 1.25–1.33×, and gathering in either form made forward +
    /// backward slower than the plain engine path (docs/PERF.md). Gathering needs the engine on
    /// and the kernels in the loaded PTX (otherwise an error, and the layer is unchanged), and
    /// switching the engine off switches it off.
    pub fn set_gather_in_producers(&mut self, gpu: &Gpu, forward: bool, weight_gradients: bool) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        if (forward, weight_gradients) == (self.gather_forward, self.gather_weight_gradients) {
            return Ok(());
        }
        if forward || weight_gradients {
            if self.engine.is_none() {
                return Err(MokError::InvalidInput {
                    tensor: "gather_in_producer",
                    problem: "gathering in the producer is the tensor-core engine's: switch the engine on first".into(),
                });
            }
            let kernels =
                [(forward, engine::GATE_UP_GATHERING_KERNEL), (weight_gradients, engine::WGRAD_GATHERING_KERNEL)];
            for (_, kernel) in kernels.into_iter().filter(|&(needed, _)| needed) {
                if !gpu.has_kernel(kernel) {
                    return Err(MokError::InvalidInput {
                        tensor: "gather_in_producer",
                        problem: format!("the loaded PTX has no {kernel}"),
                    });
                }
            }
        }
        // Before anything changes: allocating the copy may fail.
        self.fit_gathered_copy(gpu, forward && weight_gradients)?;
        self.gather_forward = forward;
        self.gather_weight_gradients = weight_gradients;
        // The plans are built again, with or without the gathering gate/up and weight gradients,
        // and so are the passes, whose producers gather or not and whose dispatch writes the copy
        // (plans built again may land at the old addresses, which alone would keep a pass).
        if let Some(engine) = self.engine.as_mut() {
            engine.weights = Kept::new();
            engine.wgrad = Kept::new();
        }
        if let Some((_, passes)) = self.megakernel.as_mut() {
            *passes = Kept::new();
        }
        if let Some((_, passes)) = self.backward_megakernel.as_mut() {
            *passes = Kept::new();
        }
        Ok(())
    }

    /// Makes the gathered copy of the token rows (`[T·k][H]` bf16, NaN bytes as `poison` leaves
    /// it) what passes read with `gathering` in every producer that reads rows or not: allocated
    /// unless they all gather, freed (an empty buffer) while they do. A change of size comes with
    /// a change of `gathering` ([`Self::set_gather_in_producers`], [`Self::set_gemm_engine`],
    /// which then drop every plan and pass built over the old copy) or is the first pass's
    /// allocation in a layer built without it, before any plan over it exists; so no plan holds
    /// a freed copy.
    fn fit_gathered_copy(&mut self, gpu: &Gpu, gathering: bool) -> Result<()> {
        let c = &self.config;
        let len = if gathering { 0 } else { c.tokens_per_rank * c.top_k * c.hidden };
        if self.gathered_x.len() != len {
            self.gathered_x = nan_filled(gpu, len)?;
            self.x_rows_gathered = false;
        }
        Ok(())
    }

    /// Whether the gate/up and the weight gradients all gather their rows, so no pass reads the
    /// gathered copy and the layer holds none.
    fn every_producer_gathers(&self) -> bool {
        self.gather_forward && self.gather_weight_gradients
    }

    /// Whether the routed gate/up (engine path or forward megakernel) gathers its rows in its
    /// producers ([`Self::set_gather_in_producers`]).
    pub fn gathers_in_producer(&self) -> bool {
        self.gather_forward
    }

    /// Whether the gate and up weight gradients gather their rows in their producers
    /// ([`Self::set_gather_in_producers`]).
    pub fn weight_gradients_gather_in_producer(&self) -> bool {
        self.gather_weight_gradients
    }

    /// Makes the engine's plans for `experts` current (when the engine is on): built on first
    /// use and for other weights, kept for the weights before ([`Kept`]).
    fn prepare_engine_plans(&mut self, gpu: &Gpu, experts: ExpertsView<'_>) -> Result<()> {
        let Some(EngineExperts { tile_offsets, weights, .. }) = self.engine.as_mut() else { return Ok(()) };
        let key = [experts.w_gate.device_ptr(), experts.w_up.device_ptr(), experts.w_down.device_ptr()];
        let (c, routing, routed) = (&self.config, &self.routing, &self.routed);
        // Gathering, the gate/up reads x itself: there is no gathered copy to build it over.
        let rows = (!self.gather_forward).then(|| (&self.gathered_x).into());
        weights.select(key, || {
            let groups = engine_row_groups(c, routing, tile_offsets);
            let (gate_up, down) =
                routed.engine_forward_plans(gpu, rows, &groups, [experts.w_gate, experts.w_up, experts.w_down])?;
            let dgrad = vec![
                routed.engine_down_dgrad_plan(gpu, (&routed.rows.d_rows).into(), &groups, experts.w_down)?,
                routed.engine_gate_up_dgrad_plan(gpu, &groups, [experts.w_gate, experts.w_up])?,
            ];
            Ok(WeightPlans { forward: vec![gate_up, down], dgrad })
        })
    }

    /// Makes the engine's weight-gradient plans for `target` current (when the engine is on):
    /// built on first use and for another target, kept for the target before ([`Kept`]).
    fn prepare_wgrad_plans(&mut self, gpu: &Gpu, target: &GradAddresses) -> Result<()> {
        let Some(EngineExperts { tile_offsets, wgrad, .. }) = self.engine.as_mut() else { return Ok(()) };
        let (c, routing, routed) = (&self.config, &self.routing, &self.routed);
        // Gathering, the gate and up weight gradients read x themselves.
        let input_rows = (!self.gather_weight_gradients).then(|| (&self.gathered_x).into());
        wgrad.select((target.routed, target.accumulate_f32), || {
            let groups = engine_row_groups(c, routing, tile_offsets);
            let rows = (routed.d_rows().into(), input_rows);
            // SAFETY: `target` was checked against the gradients' lengths for this call and lives
            // for it; the plans keep the addresses and run only for a call with this same target
            // (kept as the previous target's otherwise, never launched for another).
            let target = (target.routed, target.accumulate_f32);
            Ok(unsafe { routed.engine_wgrad_plans(gpu, rows, &groups, target) }?.into())
        })
    }

    /// Checks `target` against the config and resolves it to addresses.
    fn grad_addresses(&mut self, gpu: &Gpu, target: WeightGradTarget<'_>) -> Result<GradAddresses> {
        let c = &self.config;
        let (h, i, e) = (c.hidden, c.intermediate, c.local_experts());
        let shared_len = c.shared_intermediate.map(|is| is * h);
        fn check<T>(tensor: &'static str, view: &DeviceSliceMut<'_, T>, expected: usize) -> Result<u64> {
            if view.len() != expected {
                return Err(MokError::InvalidInput {
                    tensor,
                    problem: format!("gradient view has {} elements, expected {expected}", view.len()),
                });
            }
            // Written by TMA stores (or reduce-adds).
            check_aligned(tensor, view.device_ptr(), 16)?;
            Ok(view.device_ptr())
        }
        fn resolve<T>(
            views: &WeightGradViews<'_, T>,
            (routed, shared_len): (usize, Option<usize>),
            accumulate_f32: bool,
        ) -> Result<GradAddresses> {
            let routed = [
                check("dw_gate", &views.dw_gate, routed)?,
                check("dw_up", &views.dw_up, routed)?,
                check("dw_down", &views.dw_down, routed)?,
            ];
            let shared = match (&views.shared, shared_len) {
                (Some([g, u, d]), Some(n)) => {
                    Some([check("dws_gate", g, n)?, check("dws_up", u, n)?, check("dws_down", d, n)?])
                }
                (None, None) => None,
                (Some(_), None) => {
                    return Err(MokError::InvalidInput {
                        tensor: "shared expert gradients",
                        problem: "given, but the layer has no shared expert".into(),
                    });
                }
                (None, Some(_)) => {
                    return Err(MokError::InvalidInput {
                        tensor: "shared expert gradients",
                        problem: "the layer has a shared expert: its three gradient views are needed".into(),
                    });
                }
            };
            Ok(GradAddresses { routed, shared, accumulate_f32 })
        }
        let sizes = (e * i * h, shared_len);
        match target {
            WeightGradTarget::Layer => {
                let g = &mut self.grads;
                if [&g.dw_gate, &g.dw_up, &g.dw_down].iter().any(|b| b.is_empty()) {
                    // The first backward into the layer's own gradients allocates them, filled
                    // with NaN bytes as `poison` would have (the kernels write every element).
                    // All three or none: a failed allocation leaves every one of them empty.
                    let (gate, up, down) =
                        (nan_filled(gpu, e * i * h)?, nan_filled(gpu, e * i * h)?, nan_filled(gpu, e * h * i)?);
                    (g.dw_gate, g.dw_up, g.dw_down) = (gate, up, down);
                }
                let g = &self.grads;
                Ok(GradAddresses {
                    routed: [g.dw_gate.device_ptr(), g.dw_up.device_ptr(), g.dw_down.device_ptr()],
                    shared: g.shared.as_ref().map(|s| [s[0].device_ptr(), s[1].device_ptr(), s[2].device_ptr()]),
                    accumulate_f32: false,
                })
            }
            WeightGradTarget::Bf16(views) => resolve(&views, sizes, false),
            WeightGradTarget::AccumulateF32(views) => resolve(&views, sizes, true),
        }
    }

    /// Fills every output and intermediate with NaN bytes (the routing's slot and row indices
    /// with `0xee` bytes, out of range), so a test sees any element a kernel failed to write
    /// (feature `testing`).
    #[cfg(feature = "testing")]
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
        tokens: TokensView<'_>,
        experts: ExpertsView<'_>,
        shared: Option<SharedExpertView<'_>>,
    ) -> Result<usize> {
        let c = &self.config;
        let (capacity, h, i, e, k) = (c.tokens_per_rank, c.hidden, c.intermediate, c.local_experts(), c.top_k);
        // T of this pass, from x: any count from 1 to the capacity the layer was built for.
        let x_len = tokens.x.len();
        let t = x_len / h;
        if !x_len.is_multiple_of(h) || t == 0 || t > capacity {
            return Err(MokError::InvalidInput {
                tensor: "x",
                problem: format!("device buffer has {x_len} elements: not T·{h} for a T in 1..={capacity}"),
            });
        }
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
        if let Some((tensor, actual, expected)) = tokens.wrong_length(t, h, k) {
            expect(tensor, actual, expected)?;
        }
        expect("w_gate", experts.w_gate.len(), e * i * h)?;
        expect("w_up", experts.w_up.len(), e * i * h)?;
        expect("w_down", experts.w_down.len(), e * h * i)?;
        // Rows are read as 16-byte vectors and through TMA: a view cut at an odd element (a
        // `sub` of a caller's buffer) would fault on the device instead.
        for (tensor, ptr) in [
            ("x", tokens.x.device_ptr()),
            ("w_gate", experts.w_gate.device_ptr()),
            ("w_up", experts.w_up.device_ptr()),
            ("w_down", experts.w_down.device_ptr()),
        ] {
            check_aligned(tensor, ptr, 16)?;
        }
        check_aligned("topk_ids", tokens.topk_ids.device_ptr(), 4)?;
        check_aligned("topk_weights", tokens.topk_weights.device_ptr(), 4)?;
        match (c.shared_intermediate, shared) {
            (Some(is), Some(s)) => {
                s.check(is, h)?;
                Ok(t)
            }
            (None, None) => Ok(t),
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

    /// Points the shared expert's one group at the pass's `t` tokens: `[0, T, 0, tiles]`, its two
    /// changing words set on the stream (no upload, so a captured graph records them). Written in
    /// every pass, even for the T of the last one: a captured graph replays its own T's words
    /// whatever passes ran in between, so no host-side record of what the words hold is sound.
    fn set_shared_offsets(&mut self, t: usize) -> Result<()> {
        if let Some((_, offsets)) = &mut self.shared {
            let tiles = (t as u32).div_ceil(mok_kernels::tiles::GEMM_TILE_M);
            offsets.fill_u32_at(1, t as u32)?;
            offsets.fill_u32_at(3, tiles)?;
        }
        Ok(())
    }

    fn row_count_ptr(&self) -> u64 {
        self.routing.row_offsets.device_ptr() + 4 * self.config.num_experts as u64
    }

    /// Enqueues the routing kernels: layout of `topk_ids` into the routing buffers.
    pub fn route(&mut self, gpu: &Gpu, topk_ids: DeviceSlice<'_, i32>) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        self.placed.require_here(gpu, &[("topk_ids", topk_ids.device_ptr())])?;
        // The routing layout a backward reads is rewritten: the last forward no longer counts.
        self.forward_ran = false;
        let c = &self.config;
        let (k, e) = (c.top_k as u32, c.num_experts as u32);
        let t = topk_ids.len() / c.top_k;
        if !topk_ids.len().is_multiple_of(c.top_k) || t == 0 || t > c.tokens_per_rank {
            return Err(MokError::InvalidInput {
                tensor: "topk_ids",
                problem: format!("{} ids: not T·{k} for a T in 1..={}", topk_ids.len(), c.tokens_per_rank),
            });
        }
        let t = t as u32;
        let chunks = mok_kernels::layout::chunk_count(t);
        // The routing error record is not cleared here: a bad id of an unchecked pass stays
        // recorded (the first one) until `check_device_errors` reports and clears it.
        let r = &mut self.routing;
        // SAFETY: the arguments are `mok_route_rank_chunks`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
        unsafe {
            gpu.launch(
                "mok_route_rank_chunks",
                LaunchShape { grid: (chunks, 1, 1), threads: RANK_CHUNK_THREADS, smem_bytes: 4 * e },
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
        self.forward_views(gpu, tokens.into(), experts.into(), shared.map(Into::into))
    }

    /// [`Self::forward`] over borrowed views (a caller's device memory): the views must stay
    /// allocated and unchanged until the stream has run the pass, and the backward must get
    /// the same ones.
    pub fn forward_views(
        &mut self,
        gpu: &Gpu,
        tokens: TokensView<'_>,
        experts: ExpertsView<'_>,
        shared: Option<SharedExpertView<'_>>,
    ) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        // A forward that fails part way (or not at all) leaves no pass a backward could read.
        self.forward_ran = false;
        self.placed.require_here(gpu, &named_view_addresses(Some(tokens), &[experts], shared))?;
        self.enqueue_forward(gpu, tokens, experts, shared)?;
        self.forward_ran = true;
        Ok(())
    }

    /// The body of [`Self::forward_views`].
    fn enqueue_forward(
        &mut self,
        gpu: &Gpu,
        tokens: TokensView<'_>,
        experts: ExpertsView<'_>,
        shared: Option<SharedExpertView<'_>>,
    ) -> Result<()> {
        let t = self.check_inputs(tokens, experts, shared)?;
        // Before any launch: building plans uploads their parameter blocks (over the copy).
        self.fit_gathered_copy(gpu, self.every_producer_gathers())?;
        self.prepare_engine_plans(gpu, experts)?;
        self.prepare_megakernel(gpu, shared)?;
        self.tokens = t;
        // Until this forward's megakernel has copied x for the shared expert, the copy is stale.
        self.shared_x_from_forward = false;
        self.set_shared_offsets(t)?;
        self.route(gpu, tokens.topk_ids)?;
        if self.megakernel.is_some() {
            // The pass dispatches the rows into `gathered_x` itself, unless its gate/up gathers
            // them in its producers.
            self.x_rows_gathered = !self.gather_forward;
            self.forward_megakernel(gpu, tokens, shared)?;
            // The pass copied x for the shared expert (unless a test's work mask left the row
            // copies out).
            self.shared_x_from_forward = shared.is_some()
                && self
                    .megakernel
                    .as_ref()
                    .and_then(|(_, passes)| passes.current())
                    .is_some_and(ForwardMegakernel::copies_rows);
            return Ok(());
        }
        let c = self.config.clone();
        let (h, e, k) = (c.hidden, c.num_experts, c.top_k);
        let slots = t * k;
        let count = self.row_count_ptr();
        // The engine's gate/up that gathers its own rows, when it is on: no copy written here.
        let gathers_in_producer = self.gather_forward;
        self.x_rows_gathered = !gathers_in_producer;
        if !gathers_in_producer {
            self.gather_x_rows(gpu, tokens.x)?;
        }
        let r = &self.routing;
        let groups = RowGroups {
            row_offsets: r.row_offsets.device_ptr(),
            tile_offsets: r.tile_offsets.device_ptr(),
            groups: e,
            rows_upper_bound: slots,
            row_count: count,
        };
        if let Some(state) = &self.engine {
            engine::tile_offsets_into(gpu, &self.routing.row_offsets, e, &state.tile_offsets)?;
            for plan in state.forward() {
                if plan.gathers_rows() {
                    // SAFETY: as below; x is this pass's checked `[T][H]` view and the routing
                    // layout's `row_source` was written by this forward's routing, on the stream,
                    // with a slot below T · k for every row of the groups.
                    unsafe { plan.launch_gathering(gpu, tokens.x, (&self.routing.row_source).into(), k) }?
                } else {
                    // SAFETY: the plans were built over this layer's buffers and this call's weight and
                    // gradient addresses (built, or swapped back, for exactly these addresses, whose
                    // lengths were checked for this call), all alive until the stream has run the pass.
                    unsafe { plan.launch(gpu) }?
                }
            }
        } else {
            // SAFETY: the gathered rows and `groups` are this layer's buffers, sized for its
            // T · k rows, which the workspace was built for.
            unsafe {
                self.routed.forward(
                    gpu,
                    &groups,
                    self.gathered_x.device_ptr(),
                    [experts.w_gate, experts.w_up, experts.w_down],
                )
            }?;
        }
        let shared_out = self.shared_forward(gpu, tokens, shared)?;
        let r = &self.routing;
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

    /// Enqueues `mok_gather_rows` of the pass's tokens into `gathered_x`: each routed slot's
    /// token row at the slot's row of the routing layout (the rows the routed experts' gate/up
    /// and weight gradients read).
    fn gather_x_rows(&self, gpu: &Gpu, x: DeviceSlice<'_, bf16>) -> Result<()> {
        let (h, k) = (self.config.hidden, self.config.top_k);
        let slots = self.tokens * k;
        // SAFETY: the arguments are `mok_gather_rows`'s parameters, in order and type (its entry point in
        // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents
        // (x a checked `[T][H]` view of the pass, the routing layout written by its forward).
        unsafe {
            gpu.launch(
                "mok_gather_rows",
                LaunchShape::linear(grid_stride_blocks(gpu, slots * h / 8), ROW_KERNEL_THREADS),
                &[
                    Ptr(x.device_ptr()),
                    Ptr(self.routing.row_source.device_ptr()),
                    U32(k as u32),
                    Ptr(0),
                    Ptr(self.row_count_ptr()),
                    U32(h as u32),
                    Ptr(self.gathered_x.device_ptr()),
                ],
            )
        }
    }

    /// Enqueues the shared expert's forward over the pass's tokens (when the layer has one and
    /// weights were given) and returns the address of its f32 rows, the first term of every
    /// token's sum (0 for none).
    fn shared_forward(&self, gpu: &Gpu, tokens: TokensView<'_>, shared: Option<SharedExpertView<'_>>) -> Result<u64> {
        let (Some(weights), Some(workspace)) = (shared, &self.shared) else { return Ok(0) };
        // SAFETY: `tokens.x` is a checked `[T][H]` view that outlives the enqueued work (the
        // layer's contract for the inputs of a pass).
        unsafe { shared_expert_forward(gpu, workspace, self.tokens, tokens.x.device_ptr(), weights) }
    }

    /// The forward after routing, as the megakernel: the engine's tile offsets, the shared
    /// expert (its rows are the first term of every token's sum), then one pass.
    fn forward_megakernel(
        &mut self,
        gpu: &Gpu,
        tokens: TokensView<'_>,
        shared: Option<SharedExpertView<'_>>,
    ) -> Result<()> {
        let t = self.tokens;
        // The shared expert runs inside the launch: its group's tile offsets for this T, and its
        // output rows as the first term of each token's sum.
        let mut shared_out = 0;
        if let (Some(_), Some(engine), Some((compute, offsets))) =
            (shared, self.shared_engine.current_mut(), &self.shared)
        {
            // Every pass, as the offsets they derive from (`set_shared_offsets`).
            engine.write_tile_offsets(gpu, offsets)?;
            shared_out = compute.out_rows().device_ptr();
        }
        let (Some(engine), Some(pass)) =
            (&self.engine, self.megakernel.as_mut().and_then(|(_, passes)| passes.current_mut()))
        else {
            return Err(MokError::InvalidInput { tensor: "megakernel", problem: "not prepared".into() });
        };
        engine::tile_offsets_into(gpu, &self.routing.row_offsets, self.config.num_experts, &engine.tile_offsets)?;
        let shared_engine = self.shared_engine.current().filter(|_| shared.is_some());
        let plans = forward_pass_plans([&engine.forward()[0], &engine.forward()[1]], shared_engine);
        // SAFETY: x and the slot weights are checked views of this pass (`[T][H]`, `[T·k]`), the
        // shared rows the workspace's own; a view's memory stays allocated until the stream has
        // run the work using it (mok's buffers wait for it when freed; other memory by its view
        // constructor's contract).
        unsafe {
            let inputs = (tokens.x.device_ptr(), tokens.topk_weights.device_ptr(), shared_out, t as u32);
            pass.launch(gpu, &plans, inputs, 0)
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
        let views = (tokens.into(), experts.into(), shared.map(Into::into));
        self.backward_views(gpu, views, dy.into(), WeightGradTarget::Layer)
    }

    /// [`Self::backward`] over borrowed views (the forward's), with the weight gradients going
    /// to `target`: the layer's own bf16 [`DeviceGrads`], a caller's bf16 buffers, or added into a
    /// caller's f32 buffers. dx and d_topk_weights land in the layer's `grads`.
    pub fn backward_views(
        &mut self,
        gpu: &Gpu,
        (tokens, experts, shared): (TokensView<'_>, ExpertsView<'_>, Option<SharedExpertView<'_>>),
        dy: DeviceSlice<'_, bf16>,
        target: WeightGradTarget<'_>,
    ) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        if !self.forward_ran {
            return Err(MokError::InvalidInput {
                tensor: "backward",
                problem: "no whole forward has run on this layer: a backward differentiates the last forward".into(),
            });
        }
        let t = self.check_inputs(tokens, experts, shared)?;
        // The forward's views again (kept: no driver call) and the backward's own.
        let mut views = named_view_addresses(Some(tokens), &[experts], shared);
        views.push(("dy", dy.device_ptr()));
        views.extend(target.view_addresses());
        self.placed.require_here(gpu, &views)?;
        if t != self.tokens {
            return Err(MokError::InvalidInput {
                tensor: "x",
                problem: format!(
                    "{t} tokens, but the last forward had {}: a backward reads its forward's pass",
                    self.tokens
                ),
            });
        }
        let c = self.config.clone();
        let (h, e, k) = (c.hidden, c.num_experts, c.top_k);
        if dy.len() != t * h {
            return Err(MokError::InvalidInput {
                tensor: "dy",
                problem: format!("device buffer has {} elements, expected {}", dy.len(), t * h),
            });
        }
        check_aligned("dy", dy.device_ptr(), 16)?;
        let target = self.grad_addresses(gpu, target)?;
        // The copy the plans are built over (a layer built without it that does not gather).
        self.fit_gathered_copy(gpu, self.every_producer_gathers())?;
        self.prepare_engine_plans(gpu, experts)?;
        self.prepare_wgrad_plans(gpu, &target)?;
        // A forward whose gate/up gathered its rows itself wrote no copy: weight gradients that
        // do not gather (the gate/up gathering alone, or gathering switched off since) read it,
        // written here. Weight gradients that gather read x themselves (the plans prepared
        // above, which the engine path and the backward megakernel run).
        let megakernel_backward = self.backward_megakernel.is_some() && self.engine.is_some();
        if !self.x_rows_gathered && !self.gather_weight_gradients {
            self.gather_x_rows(gpu, tokens.x)?;
            self.x_rows_gathered = true;
        }
        if megakernel_backward {
            return self.backward_megakernel_pass(gpu, (tokens, shared), dy, &target);
        }
        let slots = t * k;
        let count = self.row_count_ptr();
        let r = &self.routing;
        if self.engine.is_some() {
            // SAFETY: the arguments are `mok_gather_dy_and_topk_weight_grad`'s parameters, in order
            // and type (its entry point in kernels/src/entry/), and every pointer is a live
            // allocation of the sizes it documents; blocks of `ROW_KERNEL_THREADS` (256) are whole
            // warps, as its warp sums need.
            unsafe {
                gpu.launch(
                    "mok_gather_dy_and_topk_weight_grad",
                    LaunchShape::linear(grid_stride_blocks(gpu, slots * 32), ROW_KERNEL_THREADS),
                    &[
                        Ptr(dy.device_ptr()),
                        Ptr(self.routed.rows.out.device_ptr()),
                        Ptr(r.slot_row.device_ptr()),
                        Ptr(tokens.topk_weights.device_ptr()),
                        U32(t as u32),
                        U32(k as u32),
                        U32(h as u32),
                        Ptr(self.routed.rows.d_rows.device_ptr()),
                        Ptr(self.grads.d_topk_weights.device_ptr()),
                    ],
                )
            }?;
        } else {
            // The mma.sync path, the oracle: the gather and the slot-weight gradients apart.
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
            // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents; blocks of
            // `ROW_KERNEL_THREADS` (256) are whole warps, as its warp sums need.
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
        }
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
            // SAFETY: the plans were built over this layer's buffers and this call's weight and gradient
            // addresses (built, or swapped back, for exactly these addresses, whose lengths were
            // checked for this call), all alive until the stream has run the pass.
            unsafe { state.dgrad()[0].launch(gpu) }?;
            self.routed.swiglu_backward(gpu, &groups)?;
            // SAFETY: the plans were built over this layer's buffers and this call's weight and gradient
            // addresses (built, or swapped back, for exactly these addresses, whose lengths were
            // checked for this call), all alive until the stream has run the pass.
            unsafe { state.dgrad()[1].launch(gpu) }?;
            for plan in state.wgrad() {
                if plan.gathers_rows() {
                    // SAFETY: as below; x is this pass's checked `[T][H]` view (the forward's) and
                    // the routing layout's `row_source` holds its forward's slots, a slot below
                    // T · k for every row of the groups.
                    unsafe { plan.launch_gathering(gpu, tokens.x, (&self.routing.row_source).into(), k) }?
                } else {
                    // SAFETY: the plans were built over this layer's buffers and this call's weight and
                    // gradient addresses (built, or swapped back, for exactly these addresses, whose
                    // lengths were checked for this call), all alive until the stream has run the pass.
                    unsafe { plan.launch(gpu) }?
                }
            }
        } else {
            // SAFETY: the gathered rows, the output-gradient rows and `groups` are this layer's
            // buffers; the gradient addresses come from views checked against the config
            // (`GradAddresses`) that outlive the enqueued work.
            unsafe {
                self.routed.backward(
                    gpu,
                    &groups,
                    ExpertBackward {
                        input_rows: self.gathered_x.device_ptr(),
                        d_out_rows: self.routed.rows.d_rows.device_ptr(),
                        weights: [experts.w_gate, experts.w_up, experts.w_down],
                        weight_grads: target.routed,
                        accumulate_f32: target.accumulate_f32,
                    },
                )
            }?;
        }
        let shared_dx = self.shared_backward(gpu, (tokens, shared), dy, &target)?;
        let r = &self.routing;
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

    /// The backward after the checks, as the megakernel: the engine's tile offsets of the
    /// forward's routing, the shared expert's backward (its dx rows are the first term of each
    /// token's dx sum), then one launch for the routed experts' whole backward.
    fn backward_megakernel_pass(
        &mut self,
        gpu: &Gpu,
        (tokens, shared): (TokensView<'_>, Option<SharedExpertView<'_>>),
        dy: DeviceSlice<'_, bf16>,
        target: &GradAddresses,
    ) -> Result<()> {
        let t = self.tokens;
        let e = self.config.num_experts;
        // The shared expert's backward runs inside the launch: its rows of this pass's x (copied
        // unless the forward megakernel did), its group's tile offsets, its plans for `target`.
        self.prepare_shared_engine(gpu, shared)?;
        let mut shared_dx = 0;
        if let (Some(weights), Some(engine), Some(workspace)) = (shared, self.shared_engine.current_mut(), &self.shared)
        {
            if !self.shared_x_from_forward {
                // SAFETY: x holds T rows of H bf16 (checked against the config), alive for the pass.
                unsafe { engine.copy_x(tokens.x.device_ptr(), t) }?;
                self.shared_x_from_forward = true;
            }
            engine.write_tile_offsets(gpu, &workspace.1)?;
            let grads = target.shared.expect("checked against the config");
            let x_rows = engine.x_rows();
            let grads = (grads, target.accumulate_f32);
            if let Some(stale) = engine.backward_plans_dropped_by(x_rows, grads) {
                // The passes built over the plans of the oldest target are dropped with them.
                drop_passes_over(&mut self.backward_megakernel, &stale);
            }
            // SAFETY: the copy of x has the capacity's rows; `target` was checked against the
            // gradients' lengths for this call and lives for it (plans are built for any other
            // target; those of the one before are kept).
            unsafe { engine.prepare_backward(gpu, workspace, weights, x_rows, grads) }?;
            shared_dx = workspace.0.d_in_rows().device_ptr();
        }
        self.prepare_backward_megakernel(gpu, shared.is_some())?;
        let (Some(engine), Some(pass)) =
            (&self.engine, self.backward_megakernel.as_mut().and_then(|(_, passes)| passes.current_mut()))
        else {
            unreachable!("prepared above");
        };
        engine::tile_offsets_into(gpu, &self.routing.row_offsets, e, &engine.tile_offsets)?;
        let plans =
            backward_pass_plans(backward_plans(engine), self.shared_engine.current().filter(|_| shared.is_some()));
        // SAFETY: dy, x and the slot weights are checked views of this pass (`[T][H]`, `[T][H]`,
        // `[T·k]`; x, as every input of a backward, the forward's by the layer's contract), the
        // shared dx rows the workspace's own;
        // views are borrowed from buffers whose freeing waits for the work using them.
        unsafe {
            let inputs = (dy.device_ptr(), tokens.topk_weights.device_ptr(), shared_dx, t as u32);
            pass.launch(gpu, &plans, inputs, tokens.x.device_ptr())
        }
    }

    /// The shared expert's backward (when the layer has one): its weight gradients into
    /// `target`, and the address of its f32 dx rows (0 without a shared expert).
    fn shared_backward(
        &self,
        gpu: &Gpu,
        (tokens, shared): (TokensView<'_>, Option<SharedExpertView<'_>>),
        dy: DeviceSlice<'_, bf16>,
        target: &GradAddresses,
    ) -> Result<u64> {
        let (Some(weights), Some((compute, offsets))) = (shared, &self.shared) else { return Ok(0) };
        let grads = target.shared.expect("checked against the config");
        // SAFETY: `tokens.x` and `dy` are checked `[T][H]` views and `grads` comes from checked
        // views (`GradAddresses`), all outliving the enqueued work; the offsets are the
        // workspace's own.
        unsafe {
            compute.backward(
                gpu,
                &RowGroups::all_tokens(offsets, self.tokens),
                ExpertBackward {
                    input_rows: tokens.x.device_ptr(),
                    // The shared expert's output is added unscaled, so its output gradient is dy.
                    d_out_rows: dy.device_ptr(),
                    weights: [weights.ws_gate, weights.ws_up, weights.ws_down],
                    weight_grads: grads,
                    accumulate_f32: target.accumulate_f32,
                },
            )
        }?;
        Ok(compute.d_in_rows().device_ptr())
    }

    /// Waits for the stream and reports the first problem of the passes since the last check: a
    /// routing problem the kernels found in `topk_ids` (the first id out of range or repeated in
    /// a token: that slot was dropped), or else, with the megakernels, the first wait of their
    /// last passes that timed out (`MokError::Timeout`, the forward's first). Every record is
    /// read and cleared by the check, so the next pass starts clean (a megakernel record left
    /// set would stop the next pass's waits at once); only the first problem is reported (a
    /// timeout behind a routing problem is usually its consequence).
    pub fn check_device_errors(&mut self) -> Result<()> {
        let words = self.routing.error.download()?;
        // Both megakernel records are read (and cleared), the forward's reported first.
        let [forward, backward] =
            self.megakernel_records.each_mut().map(|record| record.as_mut().map_or(Ok(()), ErrorRecord::check));
        if words[0] == 0 {
            return forward.and(backward);
        }
        self.routing.error.fill_bytes(0)?;
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

/// The routed experts' row groups as the engine's plans read them: the routing layout's row
/// offsets and the engine's tile offsets, every slot of `config` as the capacity.
fn engine_row_groups<'a>(
    config: &MoeConfig,
    routing: &'a RoutingBuffers,
    tile_offsets: &'a DeviceBuffer<u32>,
) -> engine::RowGroups<'a> {
    engine::RowGroups {
        row_offsets: (&routing.row_offsets).into(),
        tile_offsets: tile_offsets.into(),
        groups: config.num_experts,
        capacity: config.tokens_per_rank * config.top_k,
    }
}

/// The engine plans of a backward megakernel pass, in `BackwardParams` order: the down dgrad,
/// the gate/up dgrad, the down, gate and up weight gradients.
fn backward_plans(engine: &EngineExperts) -> [&EnginePlan; 5] {
    [&engine.dgrad()[0], &engine.dgrad()[1], &engine.wgrad()[0], &engine.wgrad()[1], &engine.wgrad()[2]]
}

/// A new bf16 buffer of `len` elements filled with NaN bytes: a layer's own weight gradients,
/// allocated by their first backward (an element the kernels failed to write shows).
pub(crate) fn nan_filled(gpu: &Gpu, len: usize) -> Result<DeviceBuffer<bf16>> {
    let mut buffer = DeviceBuffer::alloc(gpu, len)?;
    buffer.fill_bytes(0xff)?;
    Ok(buffer)
}
