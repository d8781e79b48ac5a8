//! [`MoeLayer`]: the layer a training framework calls — borrowed device views in and out, the
//! caller's stream (open the [`Gpu`] with the facade's `mok::open_gpu_on_stream`), the fastest
//! correct backend this GPU has, a forward that returns the pass its backward consumes, and
//! weight gradients written fresh or added into the caller's f32 main gradients; one GPU
//! holding every expert, P expert-parallel virtual ranks on it, or one rank per process over a
//! multi-process heap ([`MoeLayer::with_heap`]). Nothing in a forward or a backward
//! synchronises with the host: device-side problems (a bad id found on the device, a wait that
//! timed out) are recorded and reported by [`MoeLayer::check`], which does synchronise — call it
//! where the training loop synchronises anyway (once per step, or before reading the loss).

use half::bf16;

use crate::config::MoeConfig;
use crate::driver::{DeviceSlice, DeviceSliceMut, Gpu, PlacedViews, check_aligned};
use crate::ep::{EpGradTargets, EpLayer};
use crate::error::{MokError, Result};
use crate::exchange::ExchangeOptions;
use crate::gemm::engine_available;
use crate::megakernel::{
    BACKWARD_RANKS_KERNEL, FORWARD_KERNEL, FORWARD_RANKS_KERNEL, MegakernelOptions, checked_geometry, resident_blocks,
};
use crate::symmetric::SymmetricHeap;
use crate::unfused::{ExpertsView, SharedExpertView, TokensView, UnfusedLayer, WeightGradTarget, WeightGradViews};

/// How the layer runs. Every backend gives the same bits (tested); they differ in speed and in
/// the GPUs they need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The megakernels over the tensor-core engine (sm_90a): the forward and the backward each
    /// as one persistent launch — on one GPU, over virtual ranks one launch hosting every rank,
    /// and with one process per rank one launch hosting that rank.
    Megakernel,
    /// One GPU only: the forward megakernel, the backward on the engine's separate launches
    /// (sm_90a). The forward saves what that backward reads.
    ForwardMegakernel,
    /// The routed experts' GEMMs on the tensor-core engine (sm_90a), as separate launches.
    Engine,
    /// Portable `mma.sync` kernels (any supported GPU): the oracle.
    MmaSync,
}

impl Backend {
    /// The default backend `gpu` has for one GPU holding every expert: the forward megakernel
    /// before the engine path's backward where its default geometry fits (one launch per forward
    /// after the schedule; on the H200 its training step level with the engine path's, within
    /// 0.6 %, its forward 0.997–1.014× the engine path's; the backward megakernel behind the
    /// engine path's backward: docs/PERF.md), else the engine path, else `mma.sync`.
    pub fn fastest_on(gpu: &Gpu) -> Backend {
        let forward_fits = gpu.has_kernel(FORWARD_KERNEL)
            && resident_blocks(gpu, FORWARD_KERNEL)
                .and_then(|resident| checked_geometry(resident, &MegakernelOptions::default(), 1))
                .is_ok();
        match (engine_available(gpu), forward_fits) {
            (true, true) => Backend::ForwardMegakernel,
            (true, false) => Backend::Engine,
            _ => Backend::MmaSync,
        }
    }

    /// The fastest correct backend `gpu` has for a layer over `ranks` expert-parallel ranks: for
    /// P > 1 the megakernels (at P = 8 the forward 3.2× and forward + backward 4.1× the separate
    /// launches, docs/PERF.md) where their default geometry gives every rank a compute pair, else
    /// `mma.sync`; for P = 1 [`Self::fastest_on`].
    pub fn fastest_for(gpu: &Gpu, ranks: usize) -> Backend {
        if ranks == 1 { Self::fastest_on(gpu) } else { Self::fastest_hosting(gpu, ranks) }
    }

    /// The fastest correct backend of a layer over ranks whose launch hosts `hosted` of them on
    /// `gpu` (every rank for virtual ranks, one per process per GPU).
    fn fastest_hosting(gpu: &Gpu, hosted: usize) -> Backend {
        // Both megakernels must fit the ranks the launch hosts.
        let fits = |kernel| {
            gpu.has_kernel(kernel)
                && resident_blocks(gpu, kernel)
                    .and_then(|resident| checked_geometry(resident, &MegakernelOptions::default(), hosted as u32))
                    .is_ok()
        };
        if engine_available(gpu) && fits(FORWARD_RANKS_KERNEL) && fits(BACKWARD_RANKS_KERNEL) {
            Backend::Megakernel
        } else {
            Backend::MmaSync
        }
    }
}

/// How a [`MoeLayer`] is built.
#[derive(Clone, Debug, Default)]
pub struct LayerOptions {
    /// `None`: [`Backend::fastest_for`] the GPU and the config's ranks (for
    /// [`MoeLayer::with_heap`], the fastest hosting the ranks this process drives), except that
    /// with `gather_in_producer` on one GPU the engine path replaces the forward megakernel
    /// (gathering its rows, the forward megakernel measured behind it); `Some`:
    /// that backend, or an error where the GPU lacks it (tests compare backends this way).
    pub backend: Option<Backend>,
    /// The megakernels' geometry and wait deadline ([`Backend::Megakernel`],
    /// [`Backend::ForwardMegakernel`]); over ranks its
    /// `timeout` also bounds the exchange's waits, whatever the backend.
    pub megakernel: MegakernelOptions,
    /// Over ranks: the rows each rank's receive ring holds (`ExchangeOptions::capacity_rows`).
    /// `None`: the worst case, every slot of every rank routed to one rank, which does not fit
    /// the largest shapes; a smaller ring that a pass overflows is reported by
    /// [`MoeLayer::check`] as `MokError::Capacity` with the rows needed; `Some(0)` is refused.
    /// Ignored on one GPU.
    pub ring_rows: Option<usize>,
    /// One GPU, on [`Backend::Engine`], [`Backend::ForwardMegakernel`] or
    /// [`Backend::Megakernel`]: the routed gate/up and the gate and up weight gradients read
    /// the token rows from x in their
    /// producers instead of from a gathered copy
    /// ([`UnfusedLayer::set_gather_in_producer`](crate::unfused::UnfusedLayer::set_gather_in_producer)):
    /// the same bits, T · k · H bf16 less written and read per forward; on the H200 the
    /// engine path's forward is about even with it (0.2 ms slower to 0.4 ms faster across
    /// calls) and its backward slower (the gathering weight gradients take 1.25–1.33× the
    /// plain ones' time: docs/PERF.md), and the layer holds no
    /// gathered copy (T · k · H bf16 less). Refused over ranks (the rows are pulled from their
    /// owners) and on `mma.sync`. Not racecheck-clean: compute-sanitizer's racecheck reports
    /// each gathering thread's copy into a stage against its own earlier copy there, an order it
    /// does not follow through the ring's barriers (memcheck and synccheck are clean;
    /// docs/TESTING.md).
    pub gather_in_producer: bool,
}

/// What a forward reads: the tokens (one GPU: T of them; over P ranks all P · T), every routed
/// expert's weights and, when the config has one, the shared expert's. All borrowed; they must
/// stay allocated and unchanged until the backward has been enqueued (the backward reads them
/// again; over ranks it reads the forward's copy of the tokens in the layer) and the stream has
/// run it. They must be memory of the layer's GPU, as must every output and gradient view:
/// lengths and alignment are checked, and so is the device the driver reports a view's memory
/// on (the first time the layer sees each address), an `InvalidInput` naming the view.
#[derive(Clone, Copy)]
pub struct MoeInputs<'a> {
    /// x `[T, H]`, top-k ids and weights `[T, k]`.
    pub tokens: TokensView<'a>,
    /// The routed experts' weights.
    pub experts: ExpertsView<'a>,
    /// The shared expert's weights.
    pub shared: Option<SharedExpertView<'a>>,
}

impl MoeInputs<'_> {
    fn addresses(&self) -> [u64; 9] {
        self.named_addresses().map(|(_, address)| address)
    }

    /// The lengths of x, the top-k ids and the top-k weights (they set the pass's T).
    fn token_lengths(&self) -> [usize; 3] {
        [self.tokens.x.len(), self.tokens.topk_ids.len(), self.tokens.topk_weights.len()]
    }

    /// Every view's address (0 for an absent shared expert's), with its name.
    fn named_addresses(&self) -> [(&'static str, u64); 9] {
        let [x, ids, weights] = self.tokens.named_addresses();
        let [gate, up, down] = self.experts.named_addresses();
        let [s0, s1, s2] =
            self.shared.map_or([("ws_gate", 0), ("ws_up", 0), ("ws_down", 0)], |shared| shared.named_addresses());
        [x, ids, weights, gate, up, down, s0, s1, s2]
    }
}

/// Where a backward writes: the input gradients, and the weight gradients' [`WeightGradTarget`].
pub struct MoeGradients<'a> {
    /// `[T, H]` bf16.
    pub dx: DeviceSliceMut<'a, bf16>,
    /// `[T, k]` f32 (exactly 0 for dropped slots).
    pub d_topk_weights: DeviceSliceMut<'a, f32>,
    /// Every routed weight's and the shared expert's gradient: fresh bf16 (into the caller's
    /// buffers or the layer's own) or added into the caller's f32 buffers.
    pub weights: WeightGradTarget<'a>,
}

/// The MoE layer with its workspace.
///
/// - **One GPU holding every expert** (`config.ep_ranks` = 1), sized for up to
///   `config.tokens_per_rank` tokens: each forward may take any T from 1 to that (read from the
///   length of x), and its backward the same T.
/// - **P expert-parallel virtual ranks on this GPU** (`config.ep_ranks` = P > 1; rank r holds
///   experts r·E/P .. and tokens r·T .. of the views): the views are the whole problem, exactly
///   P · T tokens (`config.tokens_per_rank` = T per rank) and all E experts, as for one GPU; the
///   layer copies each rank's share into its symmetric heap, runs the exchange (and, on
///   [`Backend::Megakernel`], one launch for every rank), and copies y, dx and d_topk_weights back.
///   y, dx, d_topk_weights and the routed weight gradients are the one-GPU layer's bits. The
///   shared expert's weight gradient is a sum over ranks, so at P > 1 it must be added into f32
///   ([`WeightGradTarget::AccumulateF32`]: each rank adds its tokens' part, in rank order —
///   deterministic, but not the one-GPU bits) or left in the layer ([`WeightGradTarget::Layer`]:
///   the layer's own buffers, which `MoeLayer` does not hand out — a backward whose weight
///   gradients are not wanted, such as frozen experts).
pub struct MoeLayer {
    layer: Layer,
    backend: Backend,
    /// Forwards enqueued so far: a [`PassToken`] names the forward it came from.
    passes: u64,
    /// A handle of the GPU the layer was built on: every call must come with it (its stream
    /// orders the layer's work), and [`MoeLayer::check`] waits on it.
    gpu: Gpu,
    /// This layer among every `MoeLayer` of the process: a [`PassToken`] names it.
    id: u64,
    /// A check reported a failed pass across processes: the layer must be rebuilt.
    failed: bool,
    /// The views found on this layer's GPU: steps over the same buffers ask the driver nothing.
    placed: PlacedViews,
}

/// Source of [`MoeLayer`]'s ids.
static NEXT_LAYER_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// What runs a [`MoeLayer`].
enum Layer {
    Single(Box<UnfusedLayer>),
    /// Ranks: virtual ranks on one GPU, or this process's rank of several.
    Ranks(Box<EpLayer>),
}

/// A forward that has been enqueued, holding the layer until its backward: only
/// [`ForwardPass::backward`] can run a backward, and it consumes the pass, so a backward without
/// its forward, or two backwards of one forward, do not compile. Dropping the pass (inference)
/// releases the layer.
#[must_use = "a forward's pass is what its backward consumes; drop it for inference"]
pub struct ForwardPass<'l> {
    layer: &'l mut MoeLayer,
    token: PassToken,
}

/// A forward that has been enqueued, as an owned value ([`MoeLayer::forward_token`]) for a
/// framework that keeps a backward's state in its own graph, where a borrow of the layer cannot
/// live: [`MoeLayer::backward`] consumes it and refuses a token of any pass but the layer's last
/// forward (the workspace holds only that one). Neither `Clone` nor `Copy`.
#[must_use = "a forward's token is what its backward consumes; drop it for inference"]
#[derive(Debug)]
pub struct PassToken {
    inputs: [u64; 9],
    /// The lengths of the forward's x, top-k ids and top-k weights views: with the same
    /// addresses, longer views would pass the backward's checks and leave dx's tail unwritten.
    token_lengths: [usize; 3],
    pass: u64,
    /// The layer whose forward it is ([`MoeLayer`]'s id).
    layer: u64,
}

/// The refusal of a one-GPU backend (the engine's separate launches, or the forward megakernel
/// with them) for a layer over `ranks` ranks.
fn over_ranks_refused(backend: Backend, ranks: usize) -> MokError {
    MokError::InvalidConfig {
        field: "ep_ranks",
        value: ranks.to_string(),
        rule: format!("over ranks the layer runs the megakernel or mma.sync, not {backend:?} (one GPU only)"),
    }
}

/// Refuses gathering the rows in the producers where no producer gathers: on `mma.sync`, and
/// over ranks (the rows are pulled from their owners).
fn refuse_gathering(backend: Backend, ranks: usize) -> Result<()> {
    if ranks > 1 || backend == Backend::MmaSync {
        return Err(MokError::InvalidInput {
            tensor: "gather_in_producer",
            problem: format!(
                "the gate/up and the weight gradients gather their rows in their producers on one GPU with the \
                 engine or the megakernels, not on {backend:?} with {ranks} ranks"
            ),
        });
    }
    Ok(())
}

/// The exchange options a layer over ranks gets from `options`: the megakernel's deadline bounds
/// the exchange's waits too, and `ring_rows` sizes the receive rings.
fn exchange_options(options: &LayerOptions) -> ExchangeOptions {
    ExchangeOptions { timeout: options.megakernel.timeout, capacity_rows: options.ring_rows, ..Default::default() }
}

impl MoeLayer {
    /// Validates `config` and allocates the workspace on `gpu` (its stream is the layer's: every
    /// later call takes this same `Gpu`, and refuses another).
    pub fn new(gpu: &Gpu, config: MoeConfig, options: LayerOptions) -> Result<Self> {
        config.validate()?;
        let backend = options.backend.unwrap_or_else(|| match Backend::fastest_for(gpu, config.ep_ranks) {
            Backend::ForwardMegakernel if options.gather_in_producer => Backend::Engine,
            fastest => fastest,
        });
        if options.gather_in_producer {
            refuse_gathering(backend, config.ep_ranks)?;
        }
        if config.ep_ranks > 1 {
            if matches!(backend, Backend::Engine | Backend::ForwardMegakernel) {
                return Err(over_ranks_refused(backend, config.ep_ranks));
            }
            let exchange = exchange_options(&options);
            let mut layer = EpLayer::new_virtual(gpu, config, exchange)?;
            if backend == Backend::Megakernel {
                layer.set_forward_megakernel(gpu, Some(options.megakernel.clone()))?;
                layer.set_backward_megakernel(gpu, Some(options.megakernel))?;
            }
            return Ok(Self::around(Layer::Ranks(Box::new(layer)), backend, gpu));
        }
        // A layer whose producers will gather the token rows never holds their gathered copy.
        let mut layer = UnfusedLayer::with_gathered_copy(gpu, config, !options.gather_in_producer)?;
        match backend {
            Backend::MmaSync => {}
            Backend::Engine => layer.set_gemm_engine(gpu, true)?,
            Backend::ForwardMegakernel => layer.set_forward_megakernel(gpu, Some(options.megakernel.clone()))?,
            Backend::Megakernel => {
                layer.set_forward_megakernel(gpu, Some(options.megakernel.clone()))?;
                layer.set_backward_megakernel(gpu, Some(options.megakernel))?;
            }
        }
        if options.gather_in_producer {
            layer.set_gather_in_producer(gpu, true)?;
        }
        Ok(Self::around(Layer::Single(Box::new(layer)), backend, gpu))
    }

    /// The layer for the ranks of `heap` that this process drives, all on `gpu` (with one process
    /// per GPU, `symmetric::SymmetricHeap::multi_process`: its one rank). The views are then that
    /// rank's share: T tokens and its E/P experts (`[E/P, ...]` weights and gradients); the
    /// shared expert's f32 gradient gets this rank's tokens' part (the data-parallel all-reduce
    /// sums the ranks). Backends as for virtual ranks; every process must run the same one (pass
    /// it in `options`: the default is chosen per GPU, and ranks on different backends wait on
    /// each other until their deadlines). [`Self::check`] reports this rank's errors and its
    /// peers' (a peer's failure voids the pass on every rank); after it reports one, every
    /// rank's layer must be rebuilt (a reset across processes is collective). Built for
    /// one process per GPU; run with two to four processes sharing one GPU
    /// (`tests/gpu_processes.rs`), not yet on several GPUs (no multi-GPU machine has been lent).
    pub fn with_heap(gpu: &Gpu, config: MoeConfig, options: LayerOptions, heap: SymmetricHeap) -> Result<Self> {
        config.validate()?;
        if options.gather_in_producer {
            return Err(MokError::InvalidInput {
                tensor: "gather_in_producer",
                problem: "over ranks the rows are pulled from their owners, not gathered in the producers".into(),
            });
        }
        let backend = options.backend.unwrap_or_else(|| Backend::fastest_hosting(gpu, heap.local_ranks().len()));
        if matches!(backend, Backend::Engine | Backend::ForwardMegakernel) {
            return Err(over_ranks_refused(backend, config.ep_ranks));
        }
        let exchange = exchange_options(&options);
        let mut layer = EpLayer::with_heap(gpu, config, exchange, heap)?;
        if backend == Backend::Megakernel {
            layer.set_forward_megakernel(gpu, Some(options.megakernel.clone()))?;
            layer.set_backward_megakernel(gpu, Some(options.megakernel))?;
        }
        Ok(Self::around(Layer::Ranks(Box::new(layer)), backend, gpu))
    }

    /// The layer over `layer`, built on `gpu`.
    fn around(layer: Layer, backend: Backend, gpu: &Gpu) -> Self {
        let id = NEXT_LAYER_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self { layer, backend, passes: 0, gpu: gpu.handle(), id, failed: false, placed: PlacedViews::default() }
    }

    /// `gpu` is the handle the layer was built with, and the layer may run a pass.
    fn check_call(&self, gpu: &Gpu) -> Result<()> {
        self.gpu.require_same_handle(gpu)?;
        if self.failed {
            return Err(MokError::InvalidInput {
                tensor: "layer",
                problem: "a pass across processes failed (MoeLayer::check reported it): rebuild the layer, on every \
                          process"
                    .into(),
            });
        }
        Ok(())
    }

    /// The backend this layer runs.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &MoeConfig {
        match &self.layer {
            Layer::Single(layer) => layer.config(),
            Layer::Ranks(layer) => layer.config(),
        }
    }

    /// Enqueues the forward of `inputs` on the layer's stream and writes y `[T, H]` bf16 into
    /// `y`. Returns the pass, which the backward consumes.
    pub fn forward<'l>(
        &'l mut self,
        gpu: &Gpu,
        inputs: &MoeInputs<'_>,
        y: DeviceSliceMut<'_, bf16>,
    ) -> Result<ForwardPass<'l>> {
        let token = self.forward_token(gpu, inputs, y)?;
        Ok(ForwardPass { layer: self, token })
    }

    /// [`Self::forward`], returning the pass as an owned [`PassToken`] instead of a borrow of the
    /// layer.
    pub fn forward_token(
        &mut self,
        gpu: &Gpu,
        inputs: &MoeInputs<'_>,
        mut y: DeviceSliceMut<'_, bf16>,
    ) -> Result<PassToken> {
        self.check_call(gpu)?;
        if y.len() != inputs.tokens.x.len() {
            return Err(MokError::InvalidInput {
                tensor: "y",
                problem: format!("output view has {} elements, x has {}", y.len(), inputs.tokens.x.len()),
            });
        }
        let views: Vec<(&'static str, u64)> =
            inputs.named_addresses().into_iter().chain([("y", y.device_ptr())]).collect();
        self.placed.require_here(&self.gpu, &views)?;
        // From here on the workspace (and over ranks the heap's copy of the tokens) may change,
        // so the token of the last forward no longer names what the layer holds, even if this
        // forward fails.
        self.passes += 1;
        match &mut self.layer {
            Layer::Single(layer) => {
                layer.forward_views(gpu, inputs.tokens, inputs.experts, inputs.shared)?;
                layer.y().copy_to(&mut y)?;
            }
            Layer::Ranks(layer) => {
                let locals = layer.local_ranks().to_vec();
                let shares = RankShares::of(layer.config(), locals.len());
                shares.check_tokens(&inputs.tokens)?;
                let experts = shares.experts(&inputs.experts)?;
                for (part, &rank) in locals.iter().enumerate() {
                    layer.copy_tokens_from(gpu, rank, shares.tokens(&inputs.tokens, part)?)?;
                }
                layer.forward_views(gpu, &experts, inputs.shared)?;
                for (part, &rank) in locals.iter().enumerate() {
                    layer.outputs(rank)?.y.copy_to(&mut sub_mut(&mut y, "y", shares.rows(part))?)?;
                }
            }
        }
        Ok(PassToken {
            inputs: inputs.addresses(),
            token_lengths: inputs.token_lengths(),
            pass: self.passes,
            layer: self.id,
        })
    }

    /// Enqueues the backward of the forward that gave `token` (the layer's last), for output
    /// gradient `dy` `[T, H]` bf16: `inputs` must be the forward's views; the gradients go to
    /// `grads`. The token is consumed whatever the outcome: after an error (a view of the wrong
    /// length, say) the forward must run again before a backward.
    pub fn backward(
        &mut self,
        gpu: &Gpu,
        token: PassToken,
        inputs: &MoeInputs<'_>,
        dy: DeviceSlice<'_, bf16>,
        mut grads: MoeGradients<'_>,
    ) -> Result<()> {
        self.check_call(gpu)?;
        if token.layer != self.id {
            return Err(MokError::InvalidInput {
                tensor: "pass token",
                problem: "from another layer's forward: a backward runs on the layer whose forward gave the token"
                    .into(),
            });
        }
        if token.pass != self.passes {
            return Err(MokError::InvalidInput {
                tensor: "pass token",
                problem: format!(
                    "from forward {} of this layer, whose last is {}: the workspace holds only the last pass",
                    token.pass, self.passes
                ),
            });
        }
        if inputs.addresses() != token.inputs || inputs.token_lengths() != token.token_lengths {
            return Err(MokError::InvalidInput {
                tensor: "backward inputs",
                problem: "not the views the forward read (the backward reads the forward's inputs again)".into(),
            });
        }
        for (tensor, got, expected) in [
            ("dx", grads.dx.len(), inputs.tokens.x.len()),
            ("d_topk_weights", grads.d_topk_weights.len(), inputs.tokens.topk_weights.len()),
            ("dy", dy.len(), inputs.tokens.x.len()),
        ] {
            if got != expected {
                return Err(MokError::InvalidInput {
                    tensor,
                    problem: format!("view has {got} elements, expected {expected} (the forward's T)"),
                });
            }
        }
        // The inputs were checked by the forward (the same addresses); the gradients' views here.
        let mut views = vec![("dy", dy.device_ptr()), ("dx", grads.dx.device_ptr())];
        views.push(("d_topk_weights", grads.d_topk_weights.device_ptr()));
        views.extend(grads.weights.view_addresses());
        self.placed.require_here(&self.gpu, &views)?;
        match &mut self.layer {
            Layer::Single(layer) => {
                layer.backward_views(gpu, (inputs.tokens, inputs.experts, inputs.shared), dy, grads.weights)?;
                layer.grads().dx.copy_to(&mut grads.dx)?;
                layer.grads().d_topk_weights.copy_to(&mut grads.d_topk_weights)
            }
            Layer::Ranks(layer) => {
                let locals = layer.local_ranks().to_vec();
                let shares = RankShares::of(layer.config(), locals.len());
                let experts = shares.experts(&inputs.experts)?;
                let targets = shares.grad_targets(&grads.weights, inputs.shared.is_some())?;
                for (part, &rank) in locals.iter().enumerate() {
                    let (start, len) = shares.rows(part);
                    layer.copy_dy_from(gpu, rank, dy.sub(start, len).ok_or_else(|| too_short("dy"))?)?;
                }
                // SAFETY: the targets are sub-ranges of `grads.weights`, views whose lengths
                // `grad_targets` checked against every rank's layout; a view's memory stays
                // allocated until the stream has run the work using it (mok's buffers wait for it
                // when freed, driver/buffer.rs; other memory by its view constructor's contract).
                unsafe { layer.backward_views(gpu, &experts, inputs.shared, targets.as_ref()) }?;
                for (part, &rank) in locals.iter().enumerate() {
                    let out = layer.outputs(rank)?;
                    out.dx.copy_to(&mut sub_mut(&mut grads.dx, "dx", shares.rows(part))?)?;
                    let slots = shares.slots(part);
                    out.d_topk_weights.copy_to(&mut sub_mut(&mut grads.d_topk_weights, "d_topk_weights", slots)?)?;
                }
                Ok(())
            }
        }
    }

    /// Waits for the stream and reports the first device-side problem of the passes since the
    /// last check (an id out of range or repeated, found on the device; a megakernel wait that
    /// timed out; across ranks also a ring too small or a rank that never signalled). A problem
    /// voids the last forward: its pass token is refused, and the next forward starts anew. One
    /// GPU: every record is cleared and the first problem reported (a timeout behind a bad id is
    /// usually its consequence), and the next pass starts clean. Virtual ranks: every record and
    /// counter is cleared, and the next pass starts clean. Across
    /// processes the peers' records are read too, nothing is cleared, and every process must
    /// rebuild its layer (until then this one refuses its passes).
    pub fn check(&mut self) -> Result<()> {
        match &mut self.layer {
            Layer::Single(layer) => {
                let checked = layer.check_device_errors();
                if checked.is_err() {
                    // As over ranks: a pass with a problem is not one to differentiate.
                    self.passes += 1;
                }
                checked
            }
            Layer::Ranks(layer) => {
                let gpu = &self.gpu;
                let checked = layer.check_errors(gpu);
                if checked.is_err() {
                    // The failed pass's state is void: its token goes.
                    self.passes += 1;
                    // Virtual ranks are all idle after the check's synchronise: clear the records
                    // and counters so the next pass starts clean. The error reported is the
                    // pass's (a reset that fails too, after a device fault, would only hide it).
                    // Across processes a reset is collective (every rank, between barriers):
                    // the layer cannot do it alone, so the ranks rebuild their layers.
                    if layer.exchange().heap().single_gpu() {
                        let _ = layer.exchange_mut().reset(&[gpu]);
                    } else {
                        self.failed = true;
                    }
                }
                checked
            }
        }
    }
}

/// A view of `len` elements from `start` of `view`, or an error naming it.
fn sub_mut<'v, T>(
    view: &'v mut DeviceSliceMut<'_, T>,
    tensor: &'static str,
    (start, len): (usize, usize),
) -> Result<DeviceSliceMut<'v, T>> {
    view.sub_mut(start, len).ok_or_else(|| too_short(tensor))
}

fn too_short(tensor: &'static str) -> MokError {
    MokError::InvalidInput { tensor, problem: "view shorter than the layer's local ranks' shares".into() }
}

/// How a layer's views split over the ranks it drives: the views hold the local ranks' shares
/// one after another, in local order (every rank for virtual ranks: the whole problem; one for
/// one process per GPU); part i holds tokens i·T .. and experts i·L ...
struct RankShares {
    /// The local ranks (parts of the views).
    ranks: usize,
    tokens: usize,
    hidden: usize,
    top_k: usize,
    /// Elements of one rank's `[L, I, H]` (and `[L, H, I]`) weights.
    expert_block: usize,
    /// The shared expert's `[Is, H]` elements, if any.
    shared: Option<usize>,
}

impl RankShares {
    fn of(c: &MoeConfig, local_ranks: usize) -> Self {
        Self {
            ranks: local_ranks,
            tokens: c.tokens_per_rank,
            hidden: c.hidden,
            top_k: c.top_k,
            expert_block: c.local_experts() * c.intermediate * c.hidden,
            shared: c.shared_intermediate.map(|is| is * c.hidden),
        }
    }

    /// `(first element, elements)` of rank `rank`'s rows of a `[P·T, H]` tensor.
    fn rows(&self, rank: usize) -> (usize, usize) {
        (rank * self.tokens * self.hidden, self.tokens * self.hidden)
    }

    /// The same for a `[P·T, k]` tensor.
    fn slots(&self, rank: usize) -> (usize, usize) {
        (rank * self.tokens * self.top_k, self.tokens * self.top_k)
    }

    /// Exactly P · T tokens (the heap is laid out for T per rank).
    fn check_tokens(&self, tokens: &TokensView<'_>) -> Result<()> {
        let t = self.ranks * self.tokens;
        match tokens.wrong_length(t, self.hidden, self.top_k) {
            None => Ok(()),
            Some((tensor, len, expected)) => Err(MokError::InvalidInput {
                tensor,
                problem: format!(
                    "{len} elements; a layer driving {} ranks takes exactly their {t} tokens ({} per rank): {expected}",
                    self.ranks, self.tokens
                ),
            }),
        }
    }

    /// Rank `rank`'s rows of the whole problem's token views.
    fn tokens<'a>(&self, tokens: &TokensView<'a>, rank: usize) -> Result<TokensView<'a>> {
        let ((x0, xn), (s0, sn)) = (self.rows(rank), self.slots(rank));
        Ok(TokensView {
            x: tokens.x.sub(x0, xn).ok_or_else(|| too_short("x"))?,
            topk_ids: tokens.topk_ids.sub(s0, sn).ok_or_else(|| too_short("topk_ids"))?,
            topk_weights: tokens.topk_weights.sub(s0, sn).ok_or_else(|| too_short("topk_weights"))?,
        })
    }

    /// Each rank's `[E/P, ...]` experts of the whole `[E, ...]` weights.
    fn experts<'a>(&self, experts: &ExpertsView<'a>) -> Result<Vec<ExpertsView<'a>>> {
        let n = self.expert_block;
        for (tensor, len) in
            [("w_gate", experts.w_gate.len()), ("w_up", experts.w_up.len()), ("w_down", experts.w_down.len())]
        {
            if len != self.ranks * n {
                return Err(MokError::InvalidInput {
                    tensor,
                    problem: format!(
                        "{len} elements, expected {} (the E/P experts of each of the {} ranks these views hold)",
                        self.ranks * n,
                        self.ranks
                    ),
                });
            }
        }
        (0..self.ranks)
            .map(|r| {
                Ok(ExpertsView {
                    w_gate: experts.w_gate.sub(r * n, n).ok_or_else(|| too_short("w_gate"))?,
                    w_up: experts.w_up.sub(r * n, n).ok_or_else(|| too_short("w_up"))?,
                    w_down: experts.w_down.sub(r * n, n).ok_or_else(|| too_short("w_down"))?,
                })
            })
            .collect()
    }

    /// Each rank's gradient addresses for `target` (`None`: the layer's own buffers).
    fn grad_targets(&self, target: &WeightGradTarget<'_>, with_shared: bool) -> Result<Option<EpGradTargets>> {
        fn routed<T>(views: &WeightGradViews<'_, T>, shares: &RankShares) -> Result<Vec<[u64; 3]>> {
            let n = shares.expert_block;
            for (tensor, view) in [("dw_gate", &views.dw_gate), ("dw_up", &views.dw_up), ("dw_down", &views.dw_down)] {
                let len = view.len();
                if len != shares.ranks * n {
                    return Err(MokError::InvalidInput {
                        tensor,
                        problem: format!(
                            "gradient view has {len} elements, expected {} (the E/P experts of each of the {} \
                             ranks these views hold)",
                            shares.ranks * n,
                            shares.ranks
                        ),
                    });
                }
                check_aligned(tensor, view.device_ptr(), 16)?;
            }
            let bytes = (n * size_of::<T>()) as u64;
            Ok((0..shares.ranks as u64)
                .map(|r| {
                    [views.dw_gate.device_ptr(), views.dw_up.device_ptr(), views.dw_down.device_ptr()]
                        .map(|p| p + r * bytes)
                })
                .collect())
        }
        let shared_views = |shared: &Option<[DeviceSliceMut<'_, f32>; 3]>| -> Result<Vec<[u64; 3]>> {
            match (shared, self.shared) {
                (Some(views), Some(n)) => {
                    if views.iter().any(|v| v.len() != n) {
                        return Err(MokError::InvalidInput {
                            tensor: "shared expert gradients",
                            problem: format!("each view must have {n} elements"),
                        });
                    }
                    for view in views {
                        check_aligned("shared expert gradients", view.device_ptr(), 16)?;
                    }
                    let addresses = [views[0].device_ptr(), views[1].device_ptr(), views[2].device_ptr()];
                    Ok(vec![addresses; self.ranks])
                }
                (None, None) => Ok(Vec::new()),
                (Some(_), None) => Err(MokError::InvalidInput {
                    tensor: "shared expert gradients",
                    problem: "given, but the layer has no shared expert".into(),
                }),
                (None, Some(_)) => Err(MokError::InvalidInput {
                    tensor: "shared expert gradients",
                    problem: "missing: the layer has a shared expert".into(),
                }),
            }
        };
        Ok(match target {
            WeightGradTarget::Layer => None,
            WeightGradTarget::Bf16(views) => {
                if with_shared || views.shared.is_some() {
                    return Err(MokError::InvalidInput {
                        tensor: "shared expert gradients",
                        problem: format!(
                            "over {} ranks the shared expert's gradient is a sum over the ranks' tokens: add it into f32 \
                             (WeightGradTarget::AccumulateF32) or leave it in the layer (WeightGradTarget::Layer)",
                            self.ranks
                        ),
                    });
                }
                Some(EpGradTargets { routed: routed(views, self)?, shared: Vec::new(), accumulate_f32: false })
            }
            WeightGradTarget::AccumulateF32(views) => Some(EpGradTargets {
                routed: routed(views, self)?,
                shared: shared_views(&views.shared)?,
                accumulate_f32: true,
            }),
        })
    }
}

impl ForwardPass<'_> {
    /// Enqueues the backward of this pass for output gradient `dy` `[T, H]` bf16: `inputs` must
    /// be the forward's (the same views); the gradients go to `grads`.
    pub fn backward(
        self,
        gpu: &Gpu,
        inputs: &MoeInputs<'_>,
        dy: DeviceSlice<'_, bf16>,
        grads: MoeGradients<'_>,
    ) -> Result<()> {
        self.layer.backward(gpu, self.token, inputs, dy, grads)
    }
}

/// Device bytes a [`MoeLayer`] for `config` on `backend` allocates at most (with
/// [`LayerOptions::gather_in_producer`] as `gather_in_producer`), all of it —
/// workspace, routing buffers, its own dx, d_topk_weights and shared-expert gradients, and
/// (engine and megakernel) the plans' parameter blocks, tensor maps and counters, which the
/// forwards and backwards make: the plans (and megakernel passes) of the current weights and of
/// the weights before them, and of the current weight-gradient target and the one before it, the
/// shared expert's too — counted as mok requests
/// them (each allocation at least 16 bytes; the driver rounds each up a little more). The
/// caller's own buffers (inputs, outputs, gradient targets) are not included, nor the routed
/// weight gradients a backward allocates in the layer the first time it is given
/// [`WeightGradTarget::Layer`] (3 · E · I · H bf16, 6 · E · I · H bytes, more); a caller that
/// passes its own gradient buffers never holds those. One GPU only: a config over ranks
/// (`ep_ranks` > 1) is an `InvalidConfig` (such a layer holds P ranks' workspaces and its
/// symmetric heap), and `gather_in_producer` on `mma.sync` an `InvalidInput`, as
/// [`MoeLayer::new`] refuses it.
pub fn workspace_bytes(config: &MoeConfig, backend: Backend, gather_in_producer: bool) -> Result<usize> {
    config.validate()?;
    if gather_in_producer {
        refuse_gathering(backend, config.ep_ranks)?;
    }
    if config.ep_ranks > 1 {
        return Err(MokError::InvalidConfig {
            field: "ep_ranks",
            value: config.ep_ranks.to_string(),
            rule: "workspace_bytes counts a one-GPU layer (P = 1); a layer over ranks holds P ranks' workspaces \
                   and its symmetric heap (exchange::Exchange::heap_bytes_per_rank per rank)"
                .into(),
        });
    }
    let c = config;
    let (t, h, i, e, k) = (c.tokens_per_rank, c.hidden, c.intermediate, c.local_experts(), c.top_k);
    let slots = t * k;
    let buffer = |bytes: usize| bytes.max(16);
    // One expert computation's rows (`ExpertRows::alloc`): gate, up f32; hidden bf16; out f32;
    // d_rows bf16 (routed only); d_hidden f32; d_gate, d_up bf16; d_in f32.
    let expert_rows = |rows: usize, inter: usize, with_d_rows: bool| {
        [4 * rows * inter, 4 * rows * inter, 2 * rows * inter, 4 * rows * h]
            .into_iter()
            .chain([if with_d_rows { 2 * rows * h } else { 0 }, 4 * rows * inter, 2 * rows * inter, 2 * rows * inter])
            .chain([4 * rows * h])
            .map(buffer)
            .sum::<usize>()
    };
    let chunks = mok_kernels::layout::chunk_count(t as u32) as usize;
    let routing = [4 * chunks * e, 4 * slots, 4 * e, 4 * (e + 1), 4 * (e + 1), 4 * slots, 4 * slots, 16]
        .map(buffer)
        .iter()
        .sum::<usize>();
    // The gathered copy of the token rows, which a layer whose producers gather them does not
    // hold (an empty buffer).
    let gathered_copy = if gather_in_producer { 0 } else { 2 * slots * h };
    let mut total = routing + buffer(gathered_copy) + expert_rows(slots, i, true);
    if let Some(is) = c.shared_intermediate {
        total += expert_rows(t, is, false) + buffer(16) + 3 * buffer(2 * is * h);
    }
    // y and dx (bf16), d_topk_weights (f32), the three routed weight gradients' empty buffers
    // (allocated only for `WeightGradTarget::Layer`).
    total += 2 * buffer(2 * t * h) + buffer(4 * slots) + 3 * buffer(0);
    if backend != Backend::MmaSync {
        use mok_kernels::gemm_layout::{GROUP_MAP_SLOTS, TENSOR_MAP_BYTES};
        let params = size_of::<mok_kernels::gemm_layout::GemmParams>();
        // gate/up 4 maps, down 3, the two dgrads 3 and 5 (the backward megakernel runs them
        // too), three weight gradients 3 each; every one twice (the previous weights' and
        // gradient target's plans are kept). Gathering, the gate/up and the gate and up weight
        // gradients have no map of the copy.
        let rows_map = usize::from(!gather_in_producer);
        let plans = [3 + rows_map, 3, 3, 5, 3, 2 + rows_map, 2 + rows_map].repeat(2);
        let plan_bytes = |maps: usize, groups: usize| {
            let group_maps = buffer(groups.max(1) * GROUP_MAP_SLOTS as usize * TENSOR_MAP_BYTES as usize);
            buffer(params) + maps * TENSOR_MAP_BYTES as usize + group_maps + 16
        };
        total += buffer(4 * 2 * (e + 1));
        total += plans.iter().map(|&maps| plan_bytes(maps, e)).sum::<usize>();
        // The most engine M tiles the passes' counters cover.
        let m_tiles = slots.div_ceil(mok_kernels::gemm_layout::TILE_M as usize) + e;
        if matches!(backend, Backend::Megakernel | Backend::ForwardMegakernel) {
            let forward = size_of::<mok_kernels::megakernel_layout::ForwardParams>();
            // The forward runs the shared expert inside its launch: its copy of the token rows,
            // its group's tile offsets and its gate/up (4 maps) and down (3) plans, one group;
            // for the shared expert's current weights and the ones before.
            let forward_plans = if c.shared_intermediate.is_some() {
                total += 2 * (buffer(2 * t * h) + buffer(16) + plan_bytes(4, 1) + plan_bytes(3, 1));
                4
            } else {
                2
            };
            // Each pass's parameter block, counters and plan list (its plans' group maps cut in
            // one launch), for the current plans and the ones before (both passes kept), and
            // the one error record the passes share.
            total += 2
                * (buffer(forward)
                    + buffer(4 * mok_kernels::megakernel_layout::forward_counter_words(m_tiles))
                    + buffer(8 * forward_plans))
                + buffer(4 * mok_kernels::comm::params::ERROR_WORDS);
        }
        if backend == Backend::Megakernel {
            let backward = size_of::<mok_kernels::megakernel_layout::BackwardParams>();
            // The backward runs the shared expert inside its launch too: its copy of dy and its
            // five plans (the down dgrad 3 maps, the gate/up dgrad 5, three weight gradients 3
            // each), one group, for the current gradient target and the one before; for both
            // sets of the shared expert's weights, as the forward's.
            let backward_plans = if c.shared_intermediate.is_some() {
                let plans = [3, 5, 3, 3, 3].map(|maps| plan_bytes(maps, 1)).iter().sum::<usize>();
                total += 2 * (buffer(2 * t * h) + 2 * plans);
                10
            } else {
                5
            };
            total += 2
                * (buffer(backward)
                    + buffer(4 * mok_kernels::megakernel_layout::backward_counter_words(m_tiles))
                    + buffer(8 * backward_plans))
                + buffer(4 * mok_kernels::comm::params::ERROR_WORDS);
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_shares_refuse_misaligned_gradient_views() {
        let c = MoeConfig { ep_ranks: 2, ..MoeConfig::new(10, 64, 32, 8, 2) };
        let shares = RankShares::of(&c, c.ep_ranks);
        let n = 2 * shares.expert_block;
        // SAFETY: views of made-up addresses that nothing dereferences (only checked).
        let view = |ptr, len| unsafe { DeviceSliceMut::<f32>::from_raw_parts(ptr, len) };
        let views = |gate| WeightGradViews {
            dw_gate: view(gate, n),
            dw_up: view(0x10_0000, n),
            dw_down: view(0x20_0000, n),
            shared: None,
        };
        let aligned = WeightGradTarget::AccumulateF32(views(0x1000));
        let targets = shares.grad_targets(&aligned, false).unwrap().expect("the caller's buffers");
        assert_eq!(targets.routed[1][0], 0x1000 + (4 * shares.expert_block) as u64);
        let misaligned = WeightGradTarget::AccumulateF32(views(0x1004));
        match shares.grad_targets(&misaligned, false) {
            Err(MokError::InvalidInput { tensor: "dw_gate", problem }) => {
                assert!(problem.contains("16-byte"), "{problem}")
            }
            other => panic!("expected the misaligned view refused, got {:?}", other.map(|t| t.is_some())),
        }
    }

    #[test]
    fn rank_shares_split_the_views_and_check_them() {
        let c = MoeConfig { ep_ranks: 4, shared_intermediate: Some(16), ..MoeConfig::new(10, 64, 32, 8, 2) };
        let shares = RankShares::of(&c, c.ep_ranks);
        assert_eq!((shares.rows(3), shares.slots(3)), ((3 * 10 * 64, 10 * 64), (3 * 10 * 2, 10 * 2)));
        // SAFETY: views of made-up addresses that nothing dereferences (only split and compared).
        let view = |ptr, len| unsafe { DeviceSlice::<bf16>::from_raw_parts(ptr, len) };
        let n = 2 * 32 * 64;
        let experts =
            ExpertsView { w_gate: view(0x1000, 4 * n), w_up: view(0x9000_0000, 4 * n), w_down: view(0x2000, 4 * n) };
        let per_rank = shares.experts(&experts).unwrap();
        assert_eq!(per_rank.len(), 4);
        assert_eq!(per_rank[2].w_up.device_ptr(), 0x9000_0000 + 2 * 2 * n as u64);
        assert!(per_rank.iter().all(|e| e.w_gate.len() == n && e.w_down.len() == n));
        let short = ExpertsView { w_gate: view(0x1000, 4 * n - 1), ..experts };
        assert!(matches!(shares.experts(&short), Err(MokError::InvalidInput { tensor: "w_gate", .. })));
        // SAFETY: as above.
        let tokens = |t: usize| unsafe {
            TokensView {
                x: DeviceSlice::from_raw_parts(0x4000, t * 64),
                topk_ids: DeviceSlice::from_raw_parts(0x8000, t * 2),
                topk_weights: DeviceSlice::from_raw_parts(0xc000, t * 2),
            }
        };
        assert!(shares.check_tokens(&tokens(40)).is_ok());
        assert!(matches!(shares.check_tokens(&tokens(39)), Err(MokError::InvalidInput { tensor: "x", .. })));
        assert_eq!(shares.tokens(&tokens(40), 1).unwrap().topk_weights.device_ptr(), 0xc000 + 4 * 20);
        assert!(shares.tokens(&tokens(30), 3).is_err());
        // Gradient targets: fresh bf16 shared gradients over ranks are refused; f32 ones are
        // every rank's same buffers, the routed ones each rank's block.
        // SAFETY: as above.
        let grads = |ptr: u64, len| unsafe { DeviceSliceMut::<f32>::from_raw_parts(ptr, len) };
        let f32_views = WeightGradViews {
            dw_gate: grads(0x10_0000, 4 * n),
            dw_up: grads(0x20_0000, 4 * n),
            dw_down: grads(0x30_0000, 4 * n),
            shared: Some([grads(0x40_0000, 16 * 64), grads(0x50_0000, 16 * 64), grads(0x60_0000, 16 * 64)]),
        };
        let targets = shares.grad_targets(&WeightGradTarget::AccumulateF32(f32_views), true).unwrap().unwrap();
        assert!(targets.accumulate_f32 && targets.shared.len() == 4 && targets.shared[3][0] == 0x40_0000);
        assert_eq!(targets.routed[1], [0x10_0000 + 4 * n as u64, 0x20_0000 + 4 * n as u64, 0x30_0000 + 4 * n as u64]);
        // SAFETY: as above.
        let bf16_grads = |ptr: u64| unsafe { DeviceSliceMut::<bf16>::from_raw_parts(ptr, 4 * n) };
        let bf16_views = |shared| WeightGradViews {
            dw_gate: bf16_grads(0x1_0000),
            dw_up: bf16_grads(0x2_0000),
            dw_down: bf16_grads(0x3_0000),
            shared,
        };
        assert!(matches!(
            shares.grad_targets(&WeightGradTarget::Bf16(bf16_views(None)), true),
            Err(MokError::InvalidInput { tensor: "shared expert gradients", .. })
        ));
        let fresh = shares.grad_targets(&WeightGradTarget::Bf16(bf16_views(None)), false).unwrap().unwrap();
        assert_eq!(fresh.routed[3][2], 0x3_0000 + 3 * 2 * n as u64);
        assert!(shares.grad_targets(&WeightGradTarget::Layer, true).unwrap().is_none());
    }

    #[test]
    fn workspace_bytes_follow_the_config_and_the_backend() {
        let config = MoeConfig { shared_intermediate: Some(256), ..MoeConfig::new(400, 512, 256, 32, 8) };
        let [mma, engine, forward, mega] =
            [Backend::MmaSync, Backend::Engine, Backend::ForwardMegakernel, Backend::Megakernel]
                .map(|b| workspace_bytes(&config, b, false).unwrap());
        assert!(mma < engine && engine < forward && forward < mega, "{mma} {engine} {forward} {mega}");
        // Gathering in the producers: no gathered copy (T · k · H bf16, at least) and three maps
        // fewer per kept plan set; refused on mma.sync.
        let copy = 2 * 400 * 8 * 512;
        for (backend, plain) in
            [(Backend::Engine, engine), (Backend::ForwardMegakernel, forward), (Backend::Megakernel, mega)]
        {
            let gathering = workspace_bytes(&config, backend, true).unwrap();
            assert!(gathering + copy <= plain && plain - gathering < copy + 4096, "{backend:?}: {gathering} {plain}");
        }
        assert!(matches!(
            workspace_bytes(&config, Backend::MmaSync, true),
            Err(MokError::InvalidInput { tensor: "gather_in_producer", .. })
        ));
        // A sanity bound: more than the three routed weight gradients' 3 · E · I · H bf16, which
        // it does not count (the rows of T · k = 3200 slots alone are larger here).
        assert!(mma > 3 * 2 * 32 * 256 * 512);
        let more = MoeConfig { tokens_per_rank: 800, ..config.clone() };
        assert!(workspace_bytes(&more, Backend::Engine, false).unwrap() > engine);
        let ranks = MoeConfig { ep_ranks: 2, tokens_per_rank: 200, ..config.clone() };
        assert!(matches!(
            workspace_bytes(&ranks, Backend::Megakernel, false),
            Err(MokError::InvalidConfig { field: "ep_ranks", .. })
        ));
        let bad = MoeConfig { hidden: 60, ..config };
        assert!(matches!(
            workspace_bytes(&bad, Backend::Engine, false),
            Err(MokError::InvalidConfig { field: "hidden", .. })
        ));
    }
}
