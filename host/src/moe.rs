//! [`MoeLayer`]: the layer a training framework calls — borrowed device views in and out, the
//! caller's stream (open the [`Gpu`] with `Gpu::on_stream`), the fastest correct backend this GPU
//! has, a forward that returns the pass its backward consumes, and weight gradients written
//! fresh or added into the caller's f32 main gradients. Nothing in a forward or a backward
//! synchronises with the host: device-side problems (a bad id found on the device, a wait that
//! timed out) are recorded and reported by [`MoeLayer::check`], which does synchronise — call it
//! where the training loop synchronises anyway (once per step, or before reading the loss).

use half::bf16;

use crate::config::MoeConfig;
use crate::driver::{DeviceSlice, DeviceSliceMut, Gpu};
use crate::error::{MokError, Result};
use crate::gemm::engine_available;
use crate::megakernel::MegakernelOptions;
use crate::unfused::{ExpertsView, SharedExpertView, TokensView, UnfusedLayer, WeightGradTarget};

/// How the layer runs. Every backend gives the same bits (tested); they differ in speed and in
/// the GPUs they need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The forward as one persistent launch over the tensor-core engine (sm_90a); the backward
    /// on the engine's kernels.
    Megakernel,
    /// The routed experts' GEMMs on the tensor-core engine (sm_90a), as separate launches.
    Engine,
    /// Portable `mma.sync` kernels (any supported GPU): the oracle.
    MmaSync,
}

impl Backend {
    /// The fastest correct backend `gpu` has: on one GPU the engine path (measured faster than
    /// the megakernel there, docs/PERF.md), else `mma.sync`.
    pub fn fastest_on(gpu: &Gpu) -> Backend {
        if engine_available(gpu) { Backend::Engine } else { Backend::MmaSync }
    }
}

/// How a [`MoeLayer`] is built.
#[derive(Clone, Debug, Default)]
pub struct LayerOptions {
    /// `None`: [`Backend::fastest_on`] the GPU; `Some`: that backend, or an error where the GPU
    /// lacks it (tests compare backends this way).
    pub backend: Option<Backend>,
    /// The megakernel's geometry and wait deadline ([`Backend::Megakernel`] only).
    pub megakernel: MegakernelOptions,
}

/// What a forward reads: one rank's tokens, the routed experts' weights and, when the config
/// has one, the shared expert's. All borrowed; they must stay allocated and unchanged until the
/// backward has been enqueued (the backward reads them again) and the stream has run it.
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
        let (t, e) = (&self.tokens, &self.experts);
        let [s0, s1, s2] =
            self.shared.map_or([0; 3], |s| [s.ws_gate.device_ptr(), s.ws_up.device_ptr(), s.ws_down.device_ptr()]);
        [
            t.x.device_ptr(),
            t.topk_ids.device_ptr(),
            t.topk_weights.device_ptr(),
            e.w_gate.device_ptr(),
            e.w_up.device_ptr(),
            e.w_down.device_ptr(),
            s0,
            s1,
            s2,
        ]
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

/// The MoE layer of one GPU holding every expert (P = 1) with its workspace, sized for up to
/// `config.tokens_per_rank` tokens: each forward may take any T from 1 to that (read from the
/// length of x), and its backward the same T.
pub struct MoeLayer {
    layer: UnfusedLayer,
    backend: Backend,
    /// Forwards enqueued so far: a [`PassToken`] names the forward it came from.
    passes: u64,
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
    pass: u64,
}

impl MoeLayer {
    /// Validates `config` and allocates the workspace on `gpu` (its stream is the layer's). P > 1
    /// is an error here: the expert-parallel layer is `ep::EpLayer` until the megakernel spans
    /// ranks.
    pub fn new(gpu: &Gpu, config: MoeConfig, options: LayerOptions) -> Result<Self> {
        config.validate()?;
        if config.ep_ranks != 1 {
            return Err(MokError::InvalidConfig {
                field: "ep_ranks",
                value: config.ep_ranks.to_string(),
                rule: "MoeLayer holds every expert on one GPU (P = 1); P > 1 runs on ep::EpLayer".into(),
            });
        }
        let backend = options.backend.unwrap_or_else(|| Backend::fastest_on(gpu));
        let mut layer = UnfusedLayer::new(gpu, config)?;
        match backend {
            Backend::MmaSync => {}
            Backend::Engine => layer.set_gemm_engine(gpu, true)?,
            Backend::Megakernel => layer.set_forward_megakernel(gpu, Some(options.megakernel))?,
        }
        Ok(Self { layer, backend, passes: 0 })
    }

    /// The backend this layer runs.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &MoeConfig {
        self.layer.config()
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
        if y.len() != inputs.tokens.x.len() {
            return Err(MokError::InvalidInput {
                tensor: "y",
                problem: format!("output view has {} elements, x has {}", y.len(), inputs.tokens.x.len()),
            });
        }
        self.layer.forward_views(gpu, inputs.tokens, inputs.experts, inputs.shared)?;
        self.layer.y().copy_to(&mut y)?;
        self.passes += 1;
        Ok(PassToken { inputs: inputs.addresses(), pass: self.passes })
    }

    /// Enqueues the backward of the forward that gave `token` (the layer's last), for output
    /// gradient `dy` `[T, H]` bf16: `inputs` must be the forward's views; the gradients go to
    /// `grads`.
    pub fn backward(
        &mut self,
        gpu: &Gpu,
        token: PassToken,
        inputs: &MoeInputs<'_>,
        dy: DeviceSlice<'_, bf16>,
        mut grads: MoeGradients<'_>,
    ) -> Result<()> {
        if token.pass != self.passes {
            return Err(MokError::InvalidInput {
                tensor: "pass token",
                problem: format!(
                    "from forward {} of this layer, whose last is {}: the workspace holds only the last pass",
                    token.pass, self.passes
                ),
            });
        }
        if inputs.addresses() != token.inputs {
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
        let layer = &mut self.layer;
        layer.backward_views(gpu, (inputs.tokens, inputs.experts, inputs.shared), dy, grads.weights)?;
        layer.grads().dx.copy_to(&mut grads.dx)?;
        layer.grads().d_topk_weights.copy_to(&mut grads.d_topk_weights)
    }

    /// Waits for the stream and reports the first device-side problem of the passes since the
    /// last check (an id out of range or repeated, found on the device; a megakernel wait that
    /// timed out), clearing it.
    pub fn check(&mut self) -> Result<()> {
        self.layer.check_device_errors()
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

/// Device bytes a [`MoeLayer`] for `config` on `backend` allocates, all of it — workspace,
/// routing buffers, its own gradients, and (engine and megakernel) the plans' parameter blocks,
/// tensor maps and counters, which the first forward and backward make — counted as mok
/// requests them (each allocation at least 16 bytes; the driver rounds each up a little more).
/// The caller's own buffers (inputs, outputs, gradient targets) are not included.
pub fn workspace_bytes(config: &MoeConfig, backend: Backend) -> Result<usize> {
    config.validate()?;
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
    let mut total = routing + buffer(2 * slots * h) + expert_rows(slots, i, true);
    if let Some(is) = c.shared_intermediate {
        total += expert_rows(t, is, false) + buffer(16) + 3 * buffer(2 * is * h);
    }
    // y and dx (bf16), d_topk_weights (f32), the three routed weight gradients (bf16).
    total += 2 * buffer(2 * t * h) + buffer(4 * slots) + 3 * buffer(2 * e * i * h);
    if backend != Backend::MmaSync {
        use mok_kernels::gemm_layout::{GROUP_MAP_SLOTS, TENSOR_MAP_BYTES};
        let params = size_of::<mok_kernels::gemm_layout::GemmParams>();
        let group_maps = buffer(e.max(1) * GROUP_MAP_SLOTS as usize * TENSOR_MAP_BYTES as usize);
        // gate/up 4 maps, down 3, the two dgrads 3 and 5, three weight gradients 3 each.
        let plans = [4, 3, 3, 5, 3, 3, 3];
        total += buffer(4 * 2 * (e + 1));
        total +=
            plans.iter().map(|maps| buffer(params) + maps * TENSOR_MAP_BYTES as usize + group_maps + 16).sum::<usize>();
        if backend == Backend::Megakernel {
            let m_tiles = slots.div_ceil(mok_kernels::gemm_layout::TILE_M as usize) + e;
            let forward = size_of::<mok_kernels::megakernel_layout::ForwardParams>();
            total += buffer(forward)
                + buffer(4 * crate::megakernel::counter_words(m_tiles))
                + buffer(4 * mok_kernels::comm::params::ERROR_WORDS);
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_bytes_follow_the_config_and_the_backend() {
        let config = MoeConfig { shared_intermediate: Some(256), ..MoeConfig::new(400, 512, 256, 32, 8) };
        let [mma, engine, mega] =
            [Backend::MmaSync, Backend::Engine, Backend::Megakernel].map(|b| workspace_bytes(&config, b).unwrap());
        assert!(mma < engine && engine < mega, "{mma} {engine} {mega}");
        // The three routed weight gradients alone: 3 · E · I · H bf16.
        assert!(mma > 3 * 2 * 32 * 256 * 512);
        let more = MoeConfig { tokens_per_rank: 800, ..config.clone() };
        assert!(workspace_bytes(&more, Backend::Engine).unwrap() > engine);
        let bad = MoeConfig { hidden: 60, ..config };
        assert!(matches!(workspace_bytes(&bad, Backend::Engine), Err(MokError::InvalidConfig { field: "hidden", .. })));
    }
}
