//! The MoE layer over P expert-parallel ranks: the exchange ([`crate::exchange`]) composed with
//! the unfused expert compute ([`crate::unfused::ExpertCompute`]). Each rank's experts run on
//! the rows its ring received — the same rows, in the same order, that a single rank holding
//! every expert would give them — so every output and gradient of the routed path has the bits
//! of the P = 1 run.
//!
//! The shared expert runs on each rank over its own tokens, as in a real deployment; its output
//! and dx contributions per token are P-independent too. Its weight gradient is each rank's
//! partial sum over its own tokens: the cross-rank reduction of replicated weights belongs to the
//! data-parallel all-reduce, outside the layer.
//!
//! Runs the ranks a process drives on its GPU: every rank for virtual ranks (every rank's
//! launches on that GPU's stream, tested), or one rank per process over a multi-process heap
//! ([`EpLayer::with_heap`]; run with processes sharing one GPU, not yet on several GPUs).
//!
//! The forward can instead run as the forward megakernel ([`EpLayer::set_forward_megakernel`]):
//! after the schedule, ONE persistent launch hosts every rank this process drives (every virtual
//! rank, or the process's one rank) — each rank on its own run of the
//! grid's 2-block clusters — pulling its ring's rows from the token owners, running its experts'
//! gate/up and down tiles on the tensor-core engine as their rows land, each down tile's
//! epilogue pushing its rows straight into their token owners' slot buffers, and combining its
//! own tokens. It writes what the separate path writes and either backward reads (the ring
//! rows, the pre-activations, the hidden rows, the slot buffer, y); the ring's f32 down rows
//! are not written (both backwards read the slot buffer). The backward can run as the backward
//! megakernel ([`EpLayer::set_backward_megakernel`]; across processes after an on-device wait
//! for every rank's published dy): one launch pulls dy from the token owners, runs each ring's
//! data- and weight-gradient tiles (the gate/up dgrad's epilogue pushing the dx rows to their
//! owners) and combines them there.

use half::bf16;

use crate::config::MoeConfig;
use crate::driver::DeviceSlice;
use crate::driver::{DeviceBuffer, Gpu, KernelArg, LaunchShape, PlacedViews, check_aligned};
use crate::error::{MokError, Result};
use crate::exchange::{Exchange, ExchangeOptions, Silence};
use crate::gemm::{self as engine, EnginePlan};
use crate::megakernel::{
    BACKWARD_RANKS_KERNEL, BackwardBuffers, BackwardMegakernel, FORWARD_RANKS_KERNEL, ForwardMegakernel,
    MegakernelOptions, PassBuffers, RankPass, SharedPassBuffers, average_rows_per_expert, checked_geometry,
    early_slot_weight_gradients, resident_blocks, row_totals,
};
#[cfg(feature = "testing")]
use crate::megakernel::{MegakernelFaults, MegakernelWork};
use crate::problem::RoutedTokens;
use crate::symmetric::SymmetricHeap;
use crate::unfused::{
    DeviceExperts, DeviceSharedExpert, ExpertBackward, ExpertCompute, ExpertsView, ROW_KERNEL_THREADS, RowGroups,
    SharedEnginePlans, SharedExpertView, TokensView, backward_pass_plans, forward_pass_plans, grid_stride_blocks,
    named_view_addresses, nan_filled, shared_expert_forward, shared_expert_workspace,
};
use mok_kernels::megakernel_layout::PassInputs;

use KernelArg::{Ptr, U32};

/// One rank's compute workspace and outputs.
struct RankState {
    routed: ExpertCompute,
    shared: Option<(ExpertCompute, DeviceBuffer<u32>)>,
    y: DeviceBuffer<bf16>,
    dx: DeviceBuffer<bf16>,
    d_topk_weights: DeviceBuffer<f32>,
    dw: [DeviceBuffer<bf16>; 3],
    dws: Option<[DeviceBuffer<bf16>; 3]>,
}

/// One rank's outputs of the last forward and backward.
pub struct EpRankOutputs<'a> {
    /// `[T, H]` bf16.
    pub y: &'a DeviceBuffer<bf16>,
    /// `[T, H]` bf16.
    pub dx: &'a DeviceBuffer<bf16>,
    /// `[T, k]` f32.
    pub d_topk_weights: &'a DeviceBuffer<f32>,
    /// `(dw_gate [L, I, H], dw_up [L, I, H], dw_down [L, H, I])` of this rank's experts, bf16:
    /// empty until a backward has left its gradients in the layer (no target).
    pub dw: [&'a DeviceBuffer<bf16>; 3],
    /// Shared expert weight gradients over this rank's tokens only, bf16.
    pub dws: Option<[&'a DeviceBuffer<bf16>; 3]>,
}

/// Where a backward over ranks writes the weight gradients (device addresses, checked by the
/// caller against the layouts): per local rank `[dw_gate, dw_up, dw_down]` of its `[E/P, ...]`
/// experts and the shared expert's three (empty without one), in bf16 or, when
/// `accumulate_f32`, added into f32.
pub(crate) struct EpGradTargets {
    pub routed: Vec<[u64; 3]>,
    pub shared: Vec<[u64; 3]>,
    pub accumulate_f32: bool,
}

/// A failed allocation of a layer over `ranks` virtual ranks, with what sizes most of it: every
/// rank's receive ring and its expert workspace hold the ring's capacity in rows, by default the
/// worst case (every slot of every rank landing on one rank), which `ExchangeOptions::
/// capacity_rows` lowers. Other errors pass unchanged.
fn out_of_memory_hint(error: MokError, ranks: usize, capacity_rows: Option<usize>) -> MokError {
    match error {
        MokError::Cuda { call, message } if message.contains("OUT_OF_MEMORY") && capacity_rows.is_none() => {
            MokError::Cuda {
                call: format!(
                    "{call} (for {ranks} virtual ranks on one GPU, each rank's ring and expert workspace are sized for the \
                     worst case, every slot on one rank; ExchangeOptions::capacity_rows, or LayerOptions::ring_rows \
                     through MoeLayer, sets a smaller ring)"
                ),
                message,
            }
        }
        other => other,
    }
}

/// Each rank's forward megakernel plans: its gate/up and down plans, then its shared expert's
/// (when `shared` has one per rank).
fn forward_plan_sets<'a>(
    routed: &'a [(EnginePlan, EnginePlan)],
    shared: &'a [SharedEnginePlans],
) -> Vec<Vec<&'a EnginePlan>> {
    routed.iter().enumerate().map(|(r, (g, d))| forward_pass_plans([g, d], shared.get(r))).collect()
}

/// Each rank's backward megakernel plans: its five, then its shared expert's five (when
/// `shared` has backward plans for it).
fn backward_plan_sets<'a>(routed: &'a [[EnginePlan; 5]], shared: &'a [SharedEnginePlans]) -> Vec<Vec<&'a EnginePlan>> {
    routed.iter().enumerate().map(|(r, plans)| backward_pass_plans(plans.each_ref(), shared.get(r))).collect()
}

/// What one rank's backward megakernel plans were built for: the routed weights, the routed
/// gradient target and whether it accumulates into f32, and with a shared expert its weights
/// and gradient target.
type BackwardKey = ([u64; 3], [u64; 3], bool, Option<([u64; 3], [u64; 3])>);

/// The forward megakernel of every rank: each rank's engine plans over its ring (whose engine
/// tile offsets the schedule writes into the heap) and the pass (built at the first forward,
/// again for other weights).
struct EpMegakernel {
    options: MegakernelOptions,
    /// Per rank: the gate/up and down plans, and the weights they were built for.
    plans: Vec<(EnginePlan, EnginePlan)>,
    weights_built_for: Vec<[u64; 3]>,
    /// Per rank (none without a shared expert): its shared expert's plans inside the launch.
    shared: Vec<SharedEnginePlans>,
    pass: Option<ForwardMegakernel>,
}

/// The backward megakernel of every rank: each rank's five engine plans over its ring and the
/// pass (built at the first backward, again for other weights or gradient targets).
struct EpBackwardMegakernel {
    options: MegakernelOptions,
    /// Per rank: the plans, and the weights and gradient targets they were built for.
    plans: Vec<[EnginePlan; 5]>,
    built_for: Vec<BackwardKey>,
    /// Per rank (none without a shared expert): its shared expert's plans inside the launch.
    shared: Vec<SharedEnginePlans>,
    /// When every rank adds its shared expert's gradient into the same f32 buffers: per rank and
    /// weight (gate, up, down), a zeroed f32 partial its plans add into instead, summed into the
    /// target in rank order after the launch (the ranks run concurrently in it, so adding into
    /// the target directly would make the sum's order, and its bits, vary).
    shared_partials: Option<DeviceBuffer<f32>>,
    pass: Option<BackwardMegakernel>,
}

/// The layer over `config.ep_ranks` ranks, of which this process drives the heap's local ranks
/// on one GPU: every rank (virtual ranks, [`EpLayer::new_virtual`]) or one (one process per GPU,
/// [`EpLayer::with_heap`] over a multi-process heap). Per-rank arguments and results (weights,
/// gradient targets) are per local rank, in the heap's local order; methods taking a `rank`
/// take its global number and refuse one this process does not drive. Every method that takes
/// a `Gpu` refuses one other than the handle the layer was built with.
pub struct EpLayer {
    config: MoeConfig,
    /// The handle the layer was built with: every call must pass it (its stream orders the
    /// layer's copies and kernels; [`Gpu::require_same_handle`]).
    gpu: Gpu,
    exchange: Exchange,
    /// One per local rank, in the heap's local order.
    ranks: Vec<RankState>,
    megakernel: Option<EpMegakernel>,
    backward_megakernel: Option<EpBackwardMegakernel>,
    /// Whether a forward has been enqueued whole since the layer was built and since its tokens
    /// were last replaced (`upload_tokens`, `copy_tokens_from`): a backward reads the forward's
    /// routing and rows.
    forward_ran: std::cell::Cell<bool>,
    /// The views found on the layer's GPU: steps over the same buffers ask the driver nothing
    /// (a cell: the token copies take `&self`).
    placed: std::cell::RefCell<PlacedViews>,
}

impl EpLayer {
    /// Validates `config` and allocates the heap and every rank's workspace on `gpu`.
    pub fn new_virtual(gpu: &Gpu, config: MoeConfig, options: ExchangeOptions) -> Result<Self> {
        let (ranks, capacity) = (config.ep_ranks, options.capacity_rows);
        let exchange =
            Exchange::new_virtual(gpu, &config, options).map_err(|e| out_of_memory_hint(e, ranks, capacity))?;
        Self::over(gpu, config, exchange).map_err(|e| out_of_memory_hint(e, ranks, capacity))
    }

    /// The layer over an existing symmetric heap whose local ranks all live on `gpu` (virtual
    /// ranks, or one process per GPU: `SymmetricHeap::multi_process`), with a workspace per local
    /// rank. A heap with local ranks on several GPUs (`vmm_peers`) is refused: a layer drives one
    /// GPU. Built for one process per GPU; run with processes sharing one GPU, not yet on several.
    pub fn with_heap(gpu: &Gpu, config: MoeConfig, options: ExchangeOptions, heap: SymmetricHeap) -> Result<Self> {
        if !heap.built_on(gpu) {
            return Err(MokError::InvalidInput {
                tensor: "symmetric heap",
                problem: "built on another Gpu handle than the layer's: build both with the same one".into(),
            });
        }
        if heap.local_ranks().len() > 1 && !heap.single_gpu() {
            return Err(MokError::InvalidInput {
                tensor: "symmetric heap",
                problem: format!(
                    "{} local ranks on several GPUs: an EpLayer drives one GPU (one process per GPU, or virtual ranks)",
                    heap.local_ranks().len()
                ),
            });
        }
        let exchange = Exchange::with_heap(&[gpu], &config, options, heap)?;
        Self::over(gpu, config, exchange)
    }

    /// The workspaces of the exchange's local ranks.
    fn over(gpu: &Gpu, config: MoeConfig, exchange: Exchange) -> Result<Self> {
        let capacity = exchange.shape().capacity as usize;
        let (t, h, i, k) = (config.tokens_per_rank, config.hidden, config.intermediate, config.top_k);
        let ranks = (0..exchange.heap().local_ranks().len())
            .map(|_| {
                let (shared, dws) = shared_expert_workspace(gpu, &config)?.unzip();
                Ok(RankState {
                    routed: ExpertCompute::new(gpu, capacity, h, i, config.swiglu_limit, false)?,
                    shared,
                    y: DeviceBuffer::alloc(gpu, t * h)?,
                    dx: DeviceBuffer::alloc(gpu, t * h)?,
                    d_topk_weights: DeviceBuffer::alloc(gpu, t * k)?,
                    // Empty until a backward leaves its gradients in the layer (`backward_views`
                    // without a target allocates them).
                    dw: [DeviceBuffer::alloc(gpu, 0)?, DeviceBuffer::alloc(gpu, 0)?, DeviceBuffer::alloc(gpu, 0)?],
                    dws,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            gpu: gpu.handle(),
            config,
            exchange,
            ranks,
            megakernel: None,
            backward_megakernel: None,
            forward_ran: Default::default(),
            placed: Default::default(),
        })
    }

    /// Runs the forward as the forward megakernel (`Some(options)`: one launch for every rank
    /// this process drives, after the schedule; sm_90a, the tensor-core engine) or as separate
    /// launches per rank and step (`None`, the default). Both give the same bits, and the
    /// backward reads what either saved. `options.comm_blocks` counts each rank's comm blocks;
    /// the grid (all resident at
    /// once) is split into contiguous runs of pairs, one per rank, each needing its comm blocks
    /// and a compute pair. Errors when this GPU or the loaded PTX cannot run it, or the geometry
    /// cannot hold every rank; the layer is then unchanged.
    pub fn set_forward_megakernel(&mut self, gpu: &Gpu, options: Option<MegakernelOptions>) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        let Some(options) = options else {
            self.megakernel = None;
            return Ok(());
        };
        self.check_megakernel(gpu, FORWARD_RANKS_KERNEL, &options)?;
        self.megakernel = Some(EpMegakernel {
            options,
            plans: Vec::new(),
            weights_built_for: Vec::new(),
            shared: Vec::new(),
            pass: None,
        });
        Ok(())
    }

    /// What switching a megakernel on needs, checked before the layer changes: this GPU and the
    /// loaded PTX run `kernel` and the engine, and `options`' geometry holds every local rank
    /// (it needs no weights: checked now, not at the first pass).
    fn check_megakernel(&self, gpu: &Gpu, kernel: &'static str, options: &MegakernelOptions) -> Result<()> {
        if !gpu.has_kernel(kernel) || !engine::engine_available(gpu) {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: format!(
                    "needs an sm_90 GPU, the engine kernels and {kernel} in the loaded PTX (this GPU is sm_{}{})",
                    gpu.compute_capability().0,
                    gpu.compute_capability().1
                ),
            });
        }
        checked_geometry(resident_blocks(gpu, kernel)?, options, self.ranks.len() as u32)?;
        Ok(())
    }

    /// Whether the forward runs as the megakernel.
    pub fn uses_forward_megakernel(&self) -> bool {
        self.megakernel.is_some()
    }

    /// Runs the backward as the backward megakernel (`Some(options)`: one launch for every rank
    /// this process drives — pull of dy from the token owners, the engine's data- and
    /// weight-gradient tiles on each rank's ring, push of the dx rows to the owners' slot
    /// buffers, the owners' dx combine and slot-weight gradients; sm_90a) or as the separate path
    /// (`None`, the
    /// default). It follows either forward. One launch hosts the ranks this process drives: every
    /// rank for virtual ranks, its one rank with one process per GPU (each backward then
    /// publishes a new epoch and waits on the device for every rank's before the launch, so its
    /// pull reads the owners' dy). Errors when this GPU, the loaded PTX or the geometry cannot
    /// run it; the layer is then unchanged.
    pub fn set_backward_megakernel(&mut self, gpu: &Gpu, options: Option<MegakernelOptions>) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        let Some(options) = options else {
            self.backward_megakernel = None;
            return Ok(());
        };
        self.check_megakernel(gpu, BACKWARD_RANKS_KERNEL, &options)?;
        self.backward_megakernel = Some(EpBackwardMegakernel {
            options,
            plans: Vec::new(),
            built_for: Vec::new(),
            shared: Vec::new(),
            shared_partials: None,
            pass: None,
        });
        Ok(())
    }

    /// Whether the backward runs as the megakernel.
    pub fn uses_backward_megakernel(&self) -> bool {
        self.backward_megakernel.is_some()
    }

    /// The backward megakernel pass's (blocks, comm blocks per rank), once a backward has built
    /// it.
    pub fn backward_megakernel_geometry(&self) -> Option<(u32, u32)> {
        self.backward_megakernel.as_ref().and_then(|m| m.pass.as_ref()).map(BackwardMegakernel::geometry)
    }

    /// Faults of `rank` for the following backward megakernel passes (feature `testing`; the
    /// pass must exist: run a backward first).
    #[cfg(feature = "testing")]
    pub fn set_backward_megakernel_faults(&mut self, rank: usize, faults: MegakernelFaults) -> Result<()> {
        let local = self.local_index(rank)?;
        let pass = self.backward_megakernel.as_mut().and_then(|m| m.pass.as_mut());
        let Some(pass) = pass else {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: "no backward megakernel pass yet (switch it on and run a backward)".into(),
            });
        };
        pass.set_faults(local, faults)
    }

    /// Builds every rank's backward plans (and its shared expert's for `shared`, into
    /// `shared_targets[local]`) and the backward megakernel pass over them (when it is on): on
    /// first use, and again for other weights or gradient targets. `targets[local]`:
    /// `([dw_gate, dw_up, dw_down] addresses, accumulate into f32)`.
    ///
    /// # Safety
    /// The targets are live allocations of the gradients' lengths (f32 when accumulating) until
    /// the stream has run every pass launched over these plans.
    unsafe fn prepare_backward_megakernel(
        &mut self,
        gpu: &Gpu,
        (experts, shared): (&[ExpertsView<'_>], Option<SharedExpertView<'_>>),
        targets: &[([u64; 3], bool)],
        shared_targets: &[[u64; 3]],
    ) -> Result<()> {
        let Some(m) = self.backward_megakernel.as_mut() else { return Ok(()) };
        let shared_key = shared.map(|w| [w.ws_gate.device_ptr(), w.ws_up.device_ptr(), w.ws_down.device_ptr()]);
        let keys: Vec<BackwardKey> = experts
            .iter()
            .zip(targets)
            .enumerate()
            .map(|(local, (w, &(dw, accumulate)))| {
                let shared = shared_key.zip(shared_targets.get(local).copied());
                ([w.w_gate.device_ptr(), w.w_up.device_ptr(), w.w_down.device_ptr()], dw, accumulate, shared)
            })
            .collect();
        if m.pass.is_some() && m.built_for == keys {
            return Ok(());
        }
        let c = &self.config;
        let r = *self.exchange.regions();
        let locals = self.exchange.heap().local_ranks();
        // Whatever fails below leaves no pass behind, so the next call rebuilds everything.
        (m.pass, m.built_for) = (None, Vec::new());
        // The shared expert's plans read the rank's dy through the gather's copy and its x in
        // place (a fixed heap address).
        let mut shared_plans = std::mem::take(&mut m.shared);
        if let Some(weights) = shared {
            shared_plans.retain(|s| s.built_for(weights));
            for (local, state) in self.ranks.iter().enumerate() {
                let Some(workspace) = &state.shared else { continue };
                if shared_plans.len() <= local {
                    shared_plans.push(SharedEnginePlans::new(gpu, workspace, weights)?);
                }
                let x = self.exchange.address(locals[local], r.x);
                let accumulate = targets[local].1;
                // SAFETY: the heap's x region of the rank holds T rows of H bf16 for the layer's
                // life; the gradient targets are the caller's contract.
                unsafe {
                    shared_plans[local].prepare_backward(
                        gpu,
                        workspace,
                        weights,
                        x,
                        (shared_targets[local], accumulate),
                    )
                }?;
            }
        } else {
            shared_plans.clear();
        }
        let Some(m) = self.backward_megakernel.as_ref() else { return Ok(()) };
        let mut plans = Vec::with_capacity(self.ranks.len());
        for (local, ((state, w), &rank)) in self.ranks.iter().zip(experts).zip(locals).enumerate() {
            let groups = self.ring_groups(rank);
            let rows = (self.ring_rows(rank, r.ring_dy), Some(self.ring_rows(rank, r.ring_x)));
            // SAFETY: caller contract for the targets.
            plans.push(unsafe {
                state.routed.engine_backward_plans(gpu, rows, &groups, [w.w_gate, w.w_up, w.w_down], targets[local])
            }?);
        }
        let buffers: Vec<BackwardBuffers> = self
            .ranks
            .iter()
            .zip(locals)
            .enumerate()
            .map(|(local, (state, &rank))| {
                let shared_rows = state.shared.as_ref().filter(|_| shared.is_some());
                let shared_rows = shared_rows.map_or(0, |(compute, _)| compute.d_in_rows().device_ptr());
                Ok(BackwardBuffers {
                    row_source: self.exchange.address(rank, r.ring_source_slot),
                    slot_row: self.exchange.address(rank, r.slot_self),
                    down_rows: state.routed.out_rows().device_ptr(),
                    d_rows: self.exchange.address(rank, r.ring_dy),
                    d_in_rows: state.routed.d_in_rows().device_ptr(),
                    dx: state.dx.device_ptr(),
                    d_topk_weights: state.d_topk_weights.device_ptr(),
                    top_k: c.top_k as u32,
                    hidden: c.hidden as u32,
                    rank: Some(self.rank_pass(rank, r.dy, shared_rows)?),
                    swiglu: state.routed.swiglu_backward_rows(),
                    shared: shared_plans.get(local).and_then(SharedEnginePlans::backward_pass_rows),
                })
            })
            .collect::<Result<_>>()?;
        let sets = backward_plan_sets(&plans, &shared_plans);
        let sets: Vec<&[&EnginePlan]> = sets.iter().map(Vec::as_slice).collect();
        // The slot-weight gradients' placement and the row totals, by the experts' average rows.
        let rows = average_rows_per_expert(c);
        let options = MegakernelOptions {
            early_slot_weight_gradients: Some(early_slot_weight_gradients(&m.options, rows)),
            row_totals: Some(row_totals(&m.options, rows)),
            ..m.options.clone()
        };
        let pass = BackwardMegakernel::new(gpu, &sets, &buffers, &options, None)?;
        if let Some(m) = self.backward_megakernel.as_mut() {
            (m.plans, m.built_for, m.shared, m.pass) = (plans, keys, shared_plans, Some(pass));
        }
        Ok(())
    }

    /// The megakernel pass's (blocks, comm blocks per rank), once a forward has built it.
    pub fn forward_megakernel_geometry(&self) -> Option<(u32, u32)> {
        self.megakernel.as_ref().and_then(|m| m.pass.as_ref()).map(ForwardMegakernel::geometry)
    }

    /// Faults of `rank` for the following megakernel passes (feature `testing`; the pass must
    /// exist: run a forward first).
    #[cfg(feature = "testing")]
    pub fn set_forward_megakernel_faults(&mut self, rank: usize, faults: MegakernelFaults) -> Result<()> {
        let local = self.local_index(rank)?;
        self.built_megakernel()?.set_faults(local, faults)
    }

    /// The work of the following megakernel passes (feature `testing`: the benchmark's overlap
    /// measurement). The pass must exist.
    #[cfg(feature = "testing")]
    pub fn set_forward_megakernel_work(&mut self, work: MegakernelWork) -> Result<()> {
        self.built_megakernel()?.set_work(work)
    }

    /// The work of the following backward megakernel passes (feature `testing`: the benchmark's
    /// overlap and weight-gradient measurements). The pass must exist: run a backward first.
    #[cfg(feature = "testing")]
    pub fn set_backward_megakernel_work(&mut self, work: MegakernelWork) -> Result<()> {
        let pass = self.backward_megakernel.as_mut().and_then(|m| m.pass.as_mut());
        let Some(pass) = pass else {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: "no backward megakernel pass yet (switch it on and run a backward)".into(),
            });
        };
        pass.set_work(work)
    }

    #[cfg(feature = "testing")]
    fn built_megakernel(&mut self) -> Result<&mut ForwardMegakernel> {
        self.megakernel.as_mut().and_then(|m| m.pass.as_mut()).ok_or_else(|| MokError::InvalidInput {
            tensor: "megakernel",
            problem: "no megakernel pass yet (switch it on and run a forward)".into(),
        })
    }

    /// Builds every rank's engine plans for `experts` (and its shared expert's for `shared`) and
    /// the megakernel pass over them (when the megakernel is on): on first use, and again for
    /// other weights.
    fn prepare_megakernel(
        &mut self,
        gpu: &Gpu,
        experts: &[ExpertsView<'_>],
        shared: Option<SharedExpertView<'_>>,
    ) -> Result<()> {
        let Some(m) = self.megakernel.as_ref() else { return Ok(()) };
        let keys: Vec<[u64; 3]> =
            experts.iter().map(|w| [w.w_gate.device_ptr(), w.w_up.device_ptr(), w.w_down.device_ptr()]).collect();
        let shared_current = match shared {
            Some(weights) => m.shared.len() == self.ranks.len() && m.shared.iter().all(|s| s.built_for(weights)),
            None => m.shared.is_empty(),
        };
        if m.pass.is_some() && m.weights_built_for == keys && shared_current {
            return Ok(());
        }
        let c = &self.config;
        let r = *self.exchange.regions();
        let locals = self.exchange.heap().local_ranks();
        let mut plans = Vec::with_capacity(self.ranks.len());
        let mut shared_plans = Vec::new();
        for ((state, w), &rank) in self.ranks.iter().zip(experts).zip(locals) {
            let groups = self.ring_groups(rank);
            let ring_x = self.ring_rows(rank, r.ring_x);
            plans.push(state.routed.engine_forward_plans(gpu, Some(ring_x), &groups, [w.w_gate, w.w_up, w.w_down])?);
            if let (Some(weights), Some(workspace)) = (shared, &state.shared) {
                shared_plans.push(SharedEnginePlans::new(gpu, workspace, weights)?);
            }
        }
        let buffers: Vec<PassBuffers> = self
            .ranks
            .iter()
            .zip(locals)
            .enumerate()
            .map(|(local, (state, &rank))| {
                let shared_rows = state.shared.as_ref().map_or(0, |(compute, _)| compute.out_rows().device_ptr());
                Ok(PassBuffers {
                    row_source: self.exchange.address(rank, r.ring_source_slot),
                    slot_row: self.exchange.address(rank, r.slot_self),
                    rows: self.exchange.address(rank, r.ring_x),
                    down_rows: state.routed.out_rows().device_ptr(),
                    y: state.y.device_ptr(),
                    top_k: c.top_k as u32,
                    hidden: c.hidden as u32,
                    rank: Some(self.rank_pass(rank, r.x, shared_rows)?),
                    shared: shared_plans.get(local).map(|s| SharedPassBuffers { x_rows: s.x_rows() }),
                })
            })
            .collect::<Result<_>>()?;
        let sets = forward_plan_sets(&plans, &shared_plans);
        let sets: Vec<&[&EnginePlan]> = sets.iter().map(Vec::as_slice).collect();
        let pass = ForwardMegakernel::new(gpu, &sets, &buffers, &m.options, None)?;
        if let Some(m) = self.megakernel.as_mut() {
            (m.plans, m.weights_built_for, m.shared, m.pass) = (plans, keys, shared_plans, Some(pass));
        }
        Ok(())
    }

    /// `region` of `rank`'s heap slice as its ring's `[capacity][H]` bf16 rows (`ring_x`,
    /// `ring_dy`), a view that lives as long as the layer (and so its heap).
    fn ring_rows(&self, rank: usize, region: u64) -> DeviceSlice<'_, bf16> {
        let rows = self.exchange.shape().capacity as usize * self.config.hidden;
        // SAFETY: the ring regions lie in `rank`'s slice of the heap with capacity × H elements,
        // and the heap lives as long as the layer, which the view borrows.
        unsafe { DeviceSlice::from_raw_parts(self.exchange.address(rank, region), rows) }
    }

    /// `rank`'s ring as the engine's row groups (its local experts over its ring row offsets),
    /// with the engine tile offsets the schedule writes into the heap.
    fn ring_groups(&self, rank: usize) -> engine::RowGroups<'_> {
        engine::RowGroups {
            row_offsets: self.exchange.ring_row_offsets(rank),
            tile_offsets: self.exchange.ring_engine_tile_offsets(rank),
            groups: self.config.local_experts(),
            capacity: self.exchange.shape().capacity as usize,
        }
    }

    /// `rank`'s place in the heap for a megakernel pass: its exchange parameter block and error
    /// record, and its inputs — the token rows in heap region `rows` (x forward, dy backward), its
    /// slot weights, and `shared_rows` (its shared expert's output or dx rows; 0 for none).
    fn rank_pass(&self, rank: usize, rows: u64, shared_rows: u64) -> Result<RankPass> {
        let r = self.exchange.regions();
        Ok(RankPass {
            exchange: self.exchange.params_address(rank)?,
            rank: rank as u32,
            error: self.exchange.address(rank, r.error),
            inputs: PassInputs {
                x: self.exchange.address(rank, rows),
                topk_weights: self.exchange.address(rank, r.topk_weights),
                shared_rows,
                tokens: self.config.tokens_per_rank as u32,
                reserved: 0,
            },
        })
    }

    /// The configuration (P = `ep_ranks`, T per rank).
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The exchange (its heap holds the rings and the schedule, for inspection).
    pub fn exchange(&self) -> &Exchange {
        &self.exchange
    }

    /// The exchange, mutably (fault injection in tests, reset after an error). A backward after
    /// a reset differentiates nothing the exchange still holds: run a forward first.
    pub fn exchange_mut(&mut self) -> &mut Exchange {
        &mut self.exchange
    }

    /// The global ranks this process drives, in local order (every rank for virtual ranks).
    pub fn local_ranks(&self) -> &[usize] {
        self.exchange.heap().local_ranks()
    }

    /// `rank`'s local index, or an error for a rank this process does not drive.
    fn local_index(&self, rank: usize) -> Result<usize> {
        self.exchange.check_rank(rank)?;
        self.local_ranks().iter().position(|&r| r == rank).ok_or_else(|| MokError::InvalidInput {
            tensor: "rank",
            problem: format!("rank {rank} is not driven by this process (its ranks: {:?})", self.local_ranks()),
        })
    }

    /// Uploads `rank`'s tokens (the next forward's: the last forward no longer counts as one a
    /// backward could differentiate).
    pub fn upload_tokens(&self, gpu: &Gpu, rank: usize, tokens: &RoutedTokens) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        self.local_index(rank)?;
        self.forward_ran.set(false);
        self.exchange.upload_tokens(gpu, rank, &self.config, tokens)
    }

    /// Uploads `rank`'s output gradient.
    pub fn upload_dy(&self, gpu: &Gpu, rank: usize, dy: &[bf16]) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        self.local_index(rank)?;
        self.exchange.upload_dy(gpu, rank, dy)
    }

    /// Copies `rank`'s tokens from device views (`[T, H]`, `[T, k]`, `[T, k]`) into its slice of
    /// the heap, ordered on the stream (the views must stay allocated until it has run). The ids
    /// are checked on the device by the routing kernels (a bad id is dropped and reported by
    /// [`Self::check_errors`]).
    pub fn copy_tokens_from(&self, gpu: &Gpu, rank: usize, tokens: TokensView<'_>) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        self.local_index(rank)?;
        // The next forward's tokens: the last forward no longer counts as one to differentiate.
        self.forward_ran.set(false);
        self.placed.borrow_mut().require_here(gpu, &tokens.named_addresses())?;
        let c = &self.config;
        let (t, h, k) = (c.tokens_per_rank, c.hidden, c.top_k);
        let r = *self.exchange.regions();
        if let Some((tensor, len, expected)) = tokens.wrong_length(t, h, k) {
            return Err(MokError::InvalidInput {
                tensor,
                problem: format!("rank {rank}'s view has {len} elements, expected {expected}"),
            });
        }
        // SAFETY: each region lies in `rank`'s slice with exactly the view's size (checked above);
        // the views are device memory the caller keeps until the stream has run the copies.
        unsafe {
            gpu.copy_device_to_device(self.exchange.address(rank, r.x), tokens.x.device_ptr(), 2 * t * h)?;
            gpu.copy_device_to_device(
                self.exchange.address(rank, r.topk_ids),
                tokens.topk_ids.device_ptr(),
                4 * t * k,
            )?;
            gpu.copy_device_to_device(
                self.exchange.address(rank, r.topk_weights),
                tokens.topk_weights.device_ptr(),
                4 * t * k,
            )
        }
    }

    /// Copies `rank`'s output gradient `[T, H]` from a device view into its slice of the heap,
    /// ordered on the stream.
    pub fn copy_dy_from(&self, gpu: &Gpu, rank: usize, dy: DeviceSlice<'_, bf16>) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        self.local_index(rank)?;
        self.placed.borrow_mut().require_here(gpu, &[("dy", dy.device_ptr())])?;
        let expected = self.config.tokens_per_rank * self.config.hidden;
        if dy.len() != expected {
            return Err(MokError::InvalidInput {
                tensor: "dy",
                problem: format!("rank {rank}'s view has {} elements, expected {expected}", dy.len()),
            });
        }
        // SAFETY: as in `copy_tokens_from`.
        unsafe {
            gpu.copy_device_to_device(
                self.exchange.address(rank, self.exchange.regions().dy),
                dy.device_ptr(),
                2 * expected,
            )
        }
    }

    /// `rank`'s outputs (`Err` for a rank ≥ P or one this process does not drive).
    pub fn outputs(&self, rank: usize) -> Result<EpRankOutputs<'_>> {
        let r = &self.ranks[self.local_index(rank)?];
        Ok(EpRankOutputs {
            y: &r.y,
            dx: &r.dx,
            d_topk_weights: &r.d_topk_weights,
            dw: [&r.dw[0], &r.dw[1], &r.dw[2]],
            dws: r.dws.as_ref().map(|d| [&d[0], &d[1], &d[2]]),
        })
    }

    /// Fills every output and workspace with NaN bytes (feature `testing`), the rows the
    /// exchange and the megakernel write into the heap too (each rank's rings and slot buffers),
    /// so a pass that left one of them unwritten cannot pass on the previous pass's rows.
    #[cfg(feature = "testing")]
    pub fn poison(&mut self, gpu: &Gpu) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        let r = *self.exchange.regions();
        let s = *self.exchange.shape();
        let (ring, slots) = (s.capacity as usize * s.hidden as usize, (s.tokens * s.top_k * s.hidden) as usize);
        for &rank in self.exchange.heap().local_ranks() {
            for (region, bytes) in
                [(r.ring_x, 2 * ring), (r.ring_dy, 2 * ring), (r.combine_slots, 4 * slots), (r.dx_slots, 4 * slots)]
            {
                // SAFETY: each region lies in `rank`'s slice of the heap with (at least) these bytes.
                unsafe { gpu.fill_device_bytes(self.exchange.address(rank, region), 0xff, bytes)? };
            }
        }
        for rank in &mut self.ranks {
            rank.routed.poison()?;
            if let Some((compute, _)) = &mut rank.shared {
                compute.poison()?;
            }
            for buffer in [&mut rank.y, &mut rank.dx] {
                buffer.fill_bytes(0xff)?;
            }
            rank.d_topk_weights.fill_bytes(0xff)?;
            for buffer in rank.dw.iter_mut().chain(rank.dws.iter_mut().flatten()) {
                buffer.fill_bytes(0xff)?;
            }
        }
        Ok(())
    }

    fn check_weights(&self, experts: &[ExpertsView<'_>], shared: Option<SharedExpertView<'_>>) -> Result<()> {
        let c = &self.config;
        if experts.len() != self.ranks.len() {
            return Err(MokError::InvalidInput {
                tensor: "experts",
                problem: format!(
                    "{} ranks' weights for the {} ranks this process drives",
                    experts.len(),
                    self.ranks.len()
                ),
            });
        }
        let per_rank = c.local_experts() * c.intermediate * c.hidden;
        for (weights, rank) in experts.iter().zip(self.local_ranks()) {
            for (name, view) in [("w_gate", weights.w_gate), ("w_up", weights.w_up), ("w_down", weights.w_down)] {
                let len = view.len();
                if len != per_rank {
                    return Err(MokError::InvalidInput {
                        tensor: name,
                        problem: format!("rank {rank}'s buffer has {len} elements, expected {per_rank} ([E/P, ...])"),
                    });
                }
                check_aligned(name, view.device_ptr(), 16)?;
            }
        }
        if shared.is_some() != c.shared_intermediate.is_some() {
            return Err(MokError::InvalidInput {
                tensor: "shared expert",
                problem: "shared weights must be given exactly when config.shared_intermediate is set".into(),
            });
        }
        if let (Some(s), Some(is)) = (shared, c.shared_intermediate) {
            s.check(is, c.hidden)?;
        }
        Ok(())
    }

    fn groups(&self, rank: usize) -> RowGroups {
        let r = self.exchange.regions();
        RowGroups {
            row_offsets: self.exchange.address(rank, r.ring_row_offsets),
            tile_offsets: self.exchange.address(rank, r.ring_tile_offsets),
            groups: self.config.local_experts(),
            rows_upper_bound: self.exchange.shape().capacity as usize,
            row_count: self.exchange.ring_row_count_ptr(rank),
        }
    }

    /// Enqueues the forward pass of every local rank (`experts[i]`: the experts of the `i`-th
    /// local rank, [`Self::local_ranks`]; the shared expert's weights are replicated);
    /// `outputs(r).y` holds the result.
    pub fn forward(&mut self, gpu: &Gpu, experts: &[DeviceExperts], shared: Option<&DeviceSharedExpert>) -> Result<()> {
        let experts: Vec<ExpertsView<'_>> = experts.iter().map(Into::into).collect();
        self.forward_views(gpu, &experts, shared.map(Into::into))
    }

    /// [`Self::forward`] over borrowed views of the weights (`experts[i]`: the `i`-th local
    /// rank's `[E/P, ...]`).
    pub fn forward_views(
        &mut self,
        gpu: &Gpu,
        experts: &[ExpertsView<'_>],
        shared: Option<SharedExpertView<'_>>,
    ) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        // A forward refused or failing part way leaves no pass a backward could read.
        self.forward_ran.set(false);
        self.check_weights(experts, shared)?;
        self.placed.get_mut().require_here(gpu, &named_view_addresses(None, experts, shared))?;
        if self.megakernel.is_some() {
            self.forward_megakernel(gpu, experts, shared)?;
            self.forward_ran.set(true);
            return Ok(());
        }
        let gpus = [gpu];
        self.exchange.schedule(&gpus)?;
        self.exchange.dispatch(&gpus)?;
        let r = *self.exchange.regions();
        let mut bases = Vec::with_capacity(self.ranks.len());
        for (local, (state, &rank)) in self.ranks.iter().zip(self.local_ranks()).enumerate() {
            let w = &experts[local];
            // SAFETY: the ring and the rank's group offsets are this layer's exchange buffers,
            // sized for the ring's capacity, which the workspace was built for; they live as long
            // as the layer.
            unsafe {
                state.routed.forward(
                    gpu,
                    &self.groups(rank),
                    self.exchange.address(rank, r.ring_x),
                    [w.w_gate, w.w_up, w.w_down],
                )
            }?;
            bases.push(self.shared_forward(gpu, local, shared)?);
        }
        let rows: Vec<u64> = self.ranks.iter().map(|s| s.routed.out_rows().device_ptr()).collect();
        let outs: Vec<u64> = self.ranks.iter().map(|s| s.y.device_ptr()).collect();
        // SAFETY: every rank's ring rows (its workspace's f32 output, sized for the ring), its
        // shared expert's rows (or 0) and its y are this layer's buffers.
        unsafe { self.exchange.combine(&gpus, &rows, &bases, &outs) }?;
        self.forward_ran.set(true);
        Ok(())
    }

    /// The backward as the megakernel: each rank's shared expert backward (its dx rows are the
    /// first term of the rank's dx sums), the engine tile offsets of every ring, every rank's
    /// `slot_ready` cleared (the dx pushes flag them), then one launch for every rank.
    ///
    /// # Safety
    /// As [`Self::backward_views`] for `target`.
    unsafe fn backward_megakernel_pass(
        &mut self,
        gpu: &Gpu,
        experts: &[ExpertsView<'_>],
        shared: Option<SharedExpertView<'_>>,
        target: Option<&EpGradTargets>,
    ) -> Result<()> {
        let accumulate_f32 = target.is_some_and(|t| t.accumulate_f32);
        let targets: Vec<([u64; 3], bool)> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(local, state)| {
                let own = [state.dw[0].device_ptr(), state.dw[1].device_ptr(), state.dw[2].device_ptr()];
                (target.map_or(own, |t| t.routed[local]), accumulate_f32)
            })
            .collect();
        // Each rank's shared expert runs inside the launch, into its own gradients or the
        // caller's; ranks that add into the same f32 buffers add into partials instead, summed
        // in rank order after the launch.
        let mut shared_targets: Vec<[u64; 3]> = self
            .ranks
            .iter()
            .enumerate()
            .filter_map(|(local, state)| {
                let dws = state.dws.as_ref()?;
                let own = [dws[0].device_ptr(), dws[1].device_ptr(), dws[2].device_ptr()];
                Some(target.map_or(own, |t| t.shared[local]))
            })
            .collect();
        let n = self.config.shared_intermediate.unwrap_or(0) * self.config.hidden;
        let bytes = (n * if accumulate_f32 { 4 } else { 2 }) as u64;
        // Two ranks' gradient ranges (any of the three weights of either) that overlap.
        let overlap = |a: &[u64; 3], b: &[u64; 3]| a.iter().any(|&x| b.iter().any(|&y| x < y + bytes && y < x + bytes));
        let any_overlap =
            shared_targets.iter().enumerate().any(|(i, a)| shared_targets[..i].iter().any(|b| overlap(a, b)));
        let summed_into = shared.filter(|_| any_overlap).map(|_| shared_targets[0]);
        if let Some(into) = summed_into {
            if !accumulate_f32 || shared_targets.iter().any(|t| *t != into) {
                return Err(MokError::InvalidInput {
                    tensor: "shared expert gradients",
                    problem: "ranks' gradient buffers overlap: either every rank adds into the same f32 buffers \
                              (summed in rank order) or every rank has its own"
                        .into(),
                });
            }
            let ranks = self.ranks.len();
            let m = self.backward_megakernel.as_mut().ok_or_else(|| MokError::InvalidInput {
                tensor: "megakernel",
                problem: "no backward megakernel".into(),
            })?;
            if m.shared_partials.is_none() {
                m.shared_partials = Some(DeviceBuffer::alloc(gpu, ranks * 3 * n)?);
            }
            let base = m.shared_partials.as_ref().map_or(0, DeviceBuffer::device_ptr);
            for (local, t) in shared_targets.iter_mut().enumerate() {
                *t = [0, 1, 2].map(|w| base + 4 * ((local * 3 + w) * n) as u64);
            }
        }
        // SAFETY: the targets are the layer's own gradients or the caller's, checked against the
        // layouts by the caller of `backward_views` and alive until the stream has run the pass;
        // a plan over another target is rebuilt before it is launched again. The pass is built
        // (and can fail) before anything is enqueued, so a call that fails there adds no
        // gradient anywhere (a launch that fails later, past the megakernel, may leave some of
        // the shared expert's three sums added and others not).
        unsafe { self.prepare_backward_megakernel(gpu, (experts, shared), &targets, &shared_targets) }?;
        let gpus = [gpu];
        let not_built = || MokError::InvalidInput { tensor: "megakernel", problem: "no backward pass built".into() };
        let m = self.backward_megakernel.as_mut().ok_or_else(not_built)?;
        for (s, state) in m.shared.iter_mut().zip(&self.ranks) {
            if let Some((_, offsets)) = &state.shared {
                s.set_tokens(gpu, offsets, self.config.tokens_per_rank)?;
            }
        }
        self.exchange.clear_slot_ready(&gpus)?;
        // Across processes each rank's launch pulls the owners' dy and pushes into their slot
        // flags, so every owner's dy upload and clearing must be published first: a new epoch,
        // then a bounded wait on the device for every rank's. (Virtual ranks need neither: every
        // rank's uploads and clearing precede the one launch on the one stream.)
        if !self.exchange.heap().single_gpu() {
            self.exchange.begin_backward(&gpus)?;
            self.exchange.wait_published(&gpus)?;
        }
        let sets = backward_plan_sets(&m.plans, &m.shared);
        let sets: Vec<&[&EnginePlan]> = sets.iter().map(Vec::as_slice).collect();
        if summed_into.is_some()
            && let Some(partials) = m.shared_partials.as_mut()
        {
            partials.fill_bytes(0)?;
        }
        let pass = m.pass.as_mut().ok_or_else(not_built)?;
        let silent: Vec<bool> =
            self.exchange.heap().local_ranks().iter().map(|&r| self.exchange.silent(r, Silence::Push)).collect();
        pass.set_silent_pushes(&silent)?;
        pass.launch_ranks(gpu, &sets)?;
        if let (Some(into), Some(partials)) = (summed_into, &m.shared_partials) {
            let n = self.config.shared_intermediate.unwrap_or(0) * self.config.hidden;
            let ranks = self.ranks.len();
            for (w, &dst) in into.iter().enumerate() {
                // SAFETY: `mok_add_partials_f32`'s parameters in order and type: the target holds
                // n f32 (checked by the caller of `backward_views`), the partials `ranks` runs of
                // n, 3n apart, in a buffer of ranks · 3 · n, not overlapping the target.
                unsafe {
                    gpu.launch(
                        "mok_add_partials_f32",
                        LaunchShape::linear(grid_stride_blocks(gpu, n), ROW_KERNEL_THREADS),
                        &[
                            Ptr(dst),
                            Ptr(partials.device_ptr() + 4 * (w * n) as u64),
                            KernelArg::U64(3 * n as u64),
                            U32(ranks as u32),
                            KernelArg::U64(n as u64),
                        ],
                    )
                }?;
            }
        }
        Ok(())
    }

    /// The `local`-th local rank's shared expert over its own tokens (when the layer has one);
    /// returns the address of its `[T][H]` f32 rows, the first term of the rank's combine (0
    /// without one).
    fn shared_forward(&self, gpu: &Gpu, local: usize, shared: Option<SharedExpertView<'_>>) -> Result<u64> {
        let rank = self.local_ranks()[local];
        let (Some(weights), Some(workspace)) = (shared, &self.ranks[local].shared) else { return Ok(0) };
        let x = self.exchange.address(rank, self.exchange.regions().x);
        // SAFETY: `x` is the rank's token rows in this layer's exchange buffers (`[T][H]` bf16),
        // which live as long as the layer.
        unsafe { shared_expert_forward(gpu, workspace, self.config.tokens_per_rank, x, weights) }
    }

    /// The `local`-th local rank's shared expert backward over its own tokens (when the layer has
    /// one): its output gradient is dy (the shared term is added unscaled), its weight gradients
    /// go to the rank's own buffers or the caller's target. Returns the address of its `[T][H]`
    /// f32 dx rows, the first term of the rank's dx sums (0 without one).
    ///
    /// # Safety
    /// As [`Self::backward_views`] for `target`.
    unsafe fn shared_backward(
        &self,
        gpu: &Gpu,
        local: usize,
        shared: Option<SharedExpertView<'_>>,
        target: Option<&EpGradTargets>,
    ) -> Result<u64> {
        let state = &self.ranks[local];
        let (Some(weights), Some((compute, offsets)), Some(dws)) = (shared, &state.shared, &state.dws) else {
            return Ok(0);
        };
        let rank = self.local_ranks()[local];
        let r = self.exchange.regions();
        let own = [dws[0].device_ptr(), dws[1].device_ptr(), dws[2].device_ptr()];
        // SAFETY: the rank's token and dy rows are this layer's exchange buffers and the
        // workspace's offsets its own; the gradients are the rank's own buffers or `target`'s,
        // live as the caller guarantees.
        unsafe {
            compute.backward(
                gpu,
                &RowGroups::all_tokens(offsets, self.config.tokens_per_rank),
                ExpertBackward {
                    input_rows: self.exchange.address(rank, r.x),
                    d_out_rows: self.exchange.address(rank, r.dy),
                    weights: [weights.ws_gate, weights.ws_up, weights.ws_down],
                    accumulate_f32: target.is_some_and(|t| t.accumulate_f32),
                    weight_grads: target.map_or(own, |t| t.shared[local]),
                },
            )
        }?;
        Ok(compute.d_in_rows().device_ptr())
    }

    /// The forward as the megakernel: every rank's `slot_ready` cleared, the schedule, each rank's shared
    /// expert (its rows are the first term of its tokens' sums) and the engine tile offsets of
    /// its ring, then one launch for every rank.
    fn forward_megakernel(
        &mut self,
        gpu: &Gpu,
        experts: &[ExpertsView<'_>],
        shared: Option<SharedExpertView<'_>>,
    ) -> Result<()> {
        self.prepare_megakernel(gpu, experts, shared)?;
        let gpus = [gpu];
        self.exchange.schedule_clearing_slot_ready(&gpus)?;
        let not_built =
            || MokError::InvalidInput { tensor: "megakernel", problem: "no pass built for this forward".into() };
        let m = self.megakernel.as_mut().ok_or_else(not_built)?;
        // Each rank's shared expert runs inside the launch, over its own T tokens.
        for (s, state) in m.shared.iter_mut().zip(&self.ranks) {
            if let Some((_, offsets)) = &state.shared {
                s.set_tokens(gpu, offsets, self.config.tokens_per_rank)?;
            }
        }
        let sets = forward_plan_sets(&m.plans, &m.shared);
        let sets: Vec<&[&EnginePlan]> = sets.iter().map(Vec::as_slice).collect();
        let pass = m.pass.as_mut().ok_or_else(not_built)?;
        let silent: Vec<bool> =
            self.exchange.heap().local_ranks().iter().map(|&r| self.exchange.silent(r, Silence::Push)).collect();
        pass.set_silent_pushes(&silent)?;
        pass.launch_ranks(gpu, &sets)
    }

    /// Enqueues the backward pass of the last forward, with every rank's dy uploaded
    /// ([`Self::upload_dy`]); gradients land in [`Self::outputs`]. It reads the dy last uploaded
    /// or copied for each rank, whenever that was: a step that uploads none differentiates the
    /// previous step's dy ([`MoeLayer`](crate::moe::MoeLayer) copies dy in every backward).
    pub fn backward(
        &mut self,
        gpu: &Gpu,
        experts: &[DeviceExperts],
        shared: Option<&DeviceSharedExpert>,
    ) -> Result<()> {
        let experts: Vec<ExpertsView<'_>> = experts.iter().map(Into::into).collect();
        // SAFETY: no target: the gradients go to the layer's own buffers.
        unsafe { self.backward_views(gpu, &experts, shared.map(Into::into), None) }
    }

    /// [`Self::backward`] over borrowed views of the weights, with the weight gradients going to
    /// `target` (`None`: each rank's own bf16 buffers, [`Self::outputs`]): per local rank its
    /// experts' three gradients and the shared expert's (device addresses), and whether they are
    /// added into f32 buffers (`+=`) or written fresh in bf16. A shared expert's target may be the
    /// same buffers for every rank only when they are added into (the ranks then add in local
    /// order).
    ///
    /// # Safety
    /// The kernels write through `target`'s addresses, which nothing here can check: each must
    /// be a live allocation of its gradient's layout (`[E/P, ...]` per rank, bf16, or f32 when
    /// `accumulate_f32`), left allocated and unwritten by anything else until the stream has run
    /// the pass.
    pub(crate) unsafe fn backward_views(
        &mut self,
        gpu: &Gpu,
        experts: &[ExpertsView<'_>],
        shared: Option<SharedExpertView<'_>>,
        target: Option<&EpGradTargets>,
    ) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        if !self.forward_ran.get() {
            return Err(MokError::InvalidInput {
                tensor: "backward",
                problem: "no whole forward has run on this layer: a backward differentiates the last forward".into(),
            });
        }
        self.check_weights(experts, shared)?;
        self.placed.get_mut().require_here(gpu, &named_view_addresses(None, experts, shared))?;
        if target.is_none() && self.ranks.iter().any(|state| state.dw[0].is_empty()) {
            // The first backward into the ranks' own gradients allocates them.
            let (h, i, l) = (self.config.hidden, self.config.intermediate, self.config.local_experts());
            for state in &mut self.ranks {
                state.dw = [nan_filled(gpu, l * i * h)?, nan_filled(gpu, l * i * h)?, nan_filled(gpu, l * h * i)?];
            }
        }
        if let Some(t) = target
            && (t.routed.len() != self.ranks.len() || (shared.is_some() && t.shared.len() != self.ranks.len()))
        {
            return Err(MokError::InvalidInput {
                tensor: "weight gradients",
                problem: format!("targets for {} ranks, the layer has {}", t.routed.len(), self.ranks.len()),
            });
        }
        if self.backward_megakernel.is_some() {
            // SAFETY: `target` as the caller guarantees.
            return unsafe { self.backward_megakernel_pass(gpu, experts, shared, target) };
        }
        let gpus = [gpu];
        self.exchange.begin_backward(&gpus)?;
        self.exchange.reverse_combine(&gpus)?;
        let r = *self.exchange.regions();
        let c = self.config.clone();
        let (t, k, h) = (c.tokens_per_rank, c.top_k, c.hidden);
        let mut bases = Vec::with_capacity(self.ranks.len());
        for (local, (state, &rank)) in self.ranks.iter().zip(self.local_ranks()).enumerate() {
            let at = |region| self.exchange.address(rank, region);
            // The slot-weight gradient on the token owner, from the f32 rows the forward combine
            // delivered to it: the same rows and order as the single-rank path.
            // SAFETY: the arguments are `mok_topk_weight_grad`'s parameters, in order and type (its entry point in
            // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents; blocks of
            // `ROW_KERNEL_THREADS` (256) are whole warps, as its warp sums need.
            unsafe {
                gpu.launch(
                    "mok_topk_weight_grad",
                    LaunchShape::linear(grid_stride_blocks(gpu, t * k * 32), ROW_KERNEL_THREADS),
                    &[
                        Ptr(at(r.dy)),
                        Ptr(at(r.combine_slots)),
                        Ptr(at(r.slot_self)),
                        U32(t as u32),
                        U32(k as u32),
                        U32(h as u32),
                        Ptr(state.d_topk_weights.device_ptr()),
                    ],
                )
            }?;
            let w = &experts[local];
            let accumulate_f32 = target.is_some_and(|t| t.accumulate_f32);
            let own = [state.dw[0].device_ptr(), state.dw[1].device_ptr(), state.dw[2].device_ptr()];
            // SAFETY: the ring's rows and the rank's group offsets are this layer's exchange
            // buffers, sized for the ring the workspace was built for; the gradients are the
            // rank's own buffers or `target`'s, live as the caller guarantees.
            unsafe {
                state.routed.backward(
                    gpu,
                    &self.groups(rank),
                    ExpertBackward {
                        input_rows: at(r.ring_x),
                        d_out_rows: at(r.ring_dy),
                        weights: [w.w_gate, w.w_up, w.w_down],
                        accumulate_f32,
                        weight_grads: target.map_or(own, |t| t.routed[local]),
                    },
                )
            }?;
            // SAFETY: `target` as the caller guarantees.
            bases.push(unsafe { self.shared_backward(gpu, local, shared, target) }?);
        }
        let rows: Vec<u64> = self.ranks.iter().map(|s| s.routed.d_in_rows().device_ptr()).collect();
        let outs: Vec<u64> = self.ranks.iter().map(|s| s.dx.device_ptr()).collect();
        // SAFETY: every rank's f32 dx rows (its workspace's, sized for the ring), its shared
        // expert's dx rows (or 0) and its dx are this layer's buffers.
        unsafe { self.exchange.reverse_dispatch(&gpus, &rows, &bases, &outs) }
    }

    /// Waits for the GPU and reports any device-side problem of the last passes (a timeout
    /// naming the counter and the silent rank, a ring too small with the size needed, a bad id);
    /// across processes from the peers' records too. The records stay set (a bad id too) until
    /// `exchange_mut().reset` (which `MoeLayer::check` makes after an error over virtual ranks);
    /// across processes every rank rebuilds its layer.
    pub fn check_errors(&self, gpu: &Gpu) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        self.exchange.check_errors(&[gpu])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_memory_layer_over_ranks_names_the_ring_capacity() {
        let oom = || MokError::Cuda {
            call: "cuMemAlloc(2113929216 bytes)".into(),
            message: "CUDA_ERROR_OUT_OF_MEMORY: out of memory".into(),
        };
        let hinted = out_of_memory_hint(oom(), 8, None).to_string();
        assert!(hinted.contains("capacity_rows") && hinted.contains("8 virtual ranks"), "{hinted}");
        assert!(hinted.contains("cuMemAlloc(2113929216 bytes)") && hinted.contains("OUT_OF_MEMORY"), "{hinted}");
        // A ring the caller sized, or another error, passes unchanged.
        assert_eq!(out_of_memory_hint(oom(), 8, Some(1000)).to_string(), oom().to_string());
        let other = MokError::Cuda { call: "cuLaunchKernel".into(), message: "CUDA_ERROR_INVALID_VALUE".into() };
        assert!(!out_of_memory_hint(other, 8, None).to_string().contains("capacity_rows"));
    }
}
