//! mok's MoE layer as an op of burn's autodiff backend on CUDA: [`MokMoe::forward`] runs mok's
//! forward on the tensors' device memory and records a backward that runs mok's backward, giving
//! gradients to x, the top-k weights and the three routed weights (the router stays in burn; the
//! top-k ids come from it and carry no gradient).
//!
//! Backend: [`Backend`] = burn's autodiff over CubeCL's CUDA runtime in bf16
//! (`CubeBackend<CudaRuntime, bf16, i32, u8>`, without fusion: an op needs the tensors' buffers).
//! CubeCL and mok share the device's primary context, so a tensor's device address is valid for
//! mok. CubeCL's stream is private, so the op orders the two by synchronising: CubeCL's stream
//! before mok reads its tensors, mok's after it writes them (what that costs is measured by the
//! example's time per step).
//!
//! Ran on an H200: the GPU test against burn's own ops and the training example (docs/PERF.md,
//! "The burn integration's training step").

use std::sync::{Arc, Mutex};

use burn::tensor::{Int, Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::NoCheckpointing;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::ops::FloatTensorOps;
use burn_backend::{DType, FloatDType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use half::bf16;
use mok::driver::{DeviceSlice, DeviceSliceMut, Gpu};
use mok::moe::{LayerOptions, MoeGradients, MoeInputs, PassToken};
use mok::unfused::{ExpertsView, TokensView, WeightGradTarget, WeightGradViews};
use mok::{MoeConfig, MoeLayer, MokError};

/// The inner (non-autodiff) backend: CubeCL CUDA, bf16 floats, i32 ints.
pub type Inner = CubeBackend<CudaRuntime, bf16, i32, u8>;
/// The backend the op runs on.
pub type Backend = burn_autodiff::Autodiff<Inner>;

/// Errors of the op: mok's, or a tensor mok cannot take (not contiguous, wrong type or shape).
#[derive(Debug)]
pub enum Error {
    /// From mok.
    Mok(MokError),
    /// A tensor the op cannot use as it is.
    Tensor(String),
}

impl From<MokError> for Error {
    fn from(e: MokError) -> Self {
        Error::Mok(e)
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Mok(e) => write!(f, "mok: {e}"),
            Error::Tensor(what) => write!(f, "tensor: {what}"),
        }
    }
}

impl std::error::Error for Error {}

/// The mok side of the op: the GPU handle, the layer and the last forward's pass.
struct State {
    gpu: Gpu,
    layer: MoeLayer,
    pass: Option<PassToken>,
}

/// mok's MoE layer for burn: one per layer of the model (its workspace is sized for
/// `config.tokens_per_rank` tokens per call). Cheap to clone (shared state).
#[derive(Clone)]
pub struct MokMoe {
    state: Arc<Mutex<State>>,
    config: MoeConfig,
}

impl std::fmt::Debug for MokMoe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MokMoe").field("config", &self.config).finish()
    }
}

/// The device address of a contiguous CubeCL tensor's first element.
fn address(tensor: &CubeTensor<CudaRuntime>) -> Result<u64, Error> {
    if !tensor.is_contiguous() {
        return Err(Error::Tensor(format!("not contiguous (shape {:?})", tensor.meta.shape())));
    }
    let resource = tensor
        .client
        .get_resource(tensor.handle.clone())
        .map_err(|e| Error::Tensor(format!("no device resource: {e:?}")))?;
    Ok(resource.resource().ptr)
}

fn elements(tensor: &CubeTensor<CudaRuntime>) -> usize {
    tensor.meta.shape().num_elements()
}

/// A read view of `tensor` (which the caller keeps alive until the stream has run mok's work).
fn view<'a, T>(tensor: &'a CubeTensor<CudaRuntime>) -> Result<DeviceSlice<'a, T>, Error> {
    // SAFETY: the tensor's buffer, contiguous (checked), of its element count, alive while the
    // borrow of `tensor` lasts; mok's stream reads it after CubeCL's stream was synchronised.
    Ok(unsafe { DeviceSlice::from_raw_parts(address(tensor)?, elements(tensor)) })
}

/// A write view of `tensor` (a fresh buffer of the op's).
fn view_mut<'a, T>(tensor: &'a CubeTensor<CudaRuntime>) -> Result<DeviceSliceMut<'a, T>, Error> {
    // SAFETY: as `view`; the buffer is a fresh allocation of this op that nothing else uses
    // until the op returns it.
    Ok(unsafe { DeviceSliceMut::from_raw_parts(address(tensor)?, elements(tensor)) })
}

fn empty(like: &CubeTensor<CudaRuntime>, shape: Shape, dtype: DType) -> CubeTensor<CudaRuntime> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// Waits for CubeCL's stream of `tensor`'s device.
fn sync_cubecl(tensor: &CubeTensor<CudaRuntime>) -> Result<(), Error> {
    burn_cubecl::cubecl::future::block_on(tensor.client.sync()).map_err(|e| Error::Tensor(format!("sync: {e:?}")))
}

/// The op's inputs, as inner tensors (their handles keep the buffers alive for the backward).
#[derive(Clone, Debug)]
struct Saved {
    x: CubeTensor<CudaRuntime>,
    ids: CubeTensor<CudaRuntime>,
    /// The top-k weights in f32 (mok's type).
    weights: CubeTensor<CudaRuntime>,
    w_gate: CubeTensor<CudaRuntime>,
    w_up: CubeTensor<CudaRuntime>,
    w_down: CubeTensor<CudaRuntime>,
}

impl Saved {
    fn inputs(&self) -> Result<(TokensView<'_>, ExpertsView<'_>), Error> {
        Ok((
            TokensView { x: view(&self.x)?, topk_ids: view(&self.ids)?, topk_weights: view(&self.weights)? },
            ExpertsView { w_gate: view(&self.w_gate)?, w_up: view(&self.w_up)?, w_down: view(&self.w_down)? },
        ))
    }
}

#[derive(Debug)]
struct MokBackward;

impl Backward<Inner, 5> for MokBackward {
    type State = (MokMoe, Saved);

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let (moe, saved) = ops.state;
        let dy = grads.consume::<Inner>(&ops.node);
        let outputs = moe.run_backward(&saved, dy).unwrap_or_else(|e| panic!("mok backward: {e}"));
        for (parent, grad) in ops.parents.into_iter().zip(outputs) {
            if let Some(node) = parent {
                grads.register::<Inner>(node.id, grad);
            }
        }
    }
}

impl MokMoe {
    /// A layer for `config` (P = 1, no shared expert here: a shared expert runs in burn) on CUDA
    /// device `ordinal`, on mok's fastest backend there.
    pub fn new(ordinal: usize, config: MoeConfig) -> Result<Self, Error> {
        if config.shared_intermediate.is_some() {
            return Err(Error::Mok(MokError::InvalidConfig {
                field: "shared_intermediate",
                value: format!("{:?}", config.shared_intermediate),
                rule: "mok-burn runs the routed experts; give the shared expert to a burn MLP".into(),
            }));
        }
        let gpu = mok::open_gpu(ordinal)?;
        let layer = MoeLayer::new(&gpu, config.clone(), LayerOptions::default())?;
        Ok(Self { state: Arc::new(Mutex::new(State { gpu, layer, pass: None })), config })
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// y `[T, H]` of x `[T, H]`, the top-k ids and weights `[T, k]` (from burn's router) and the
    /// routed weights `w_gate`, `w_up` `[E, I, H]`, `w_down` `[E, H, I]`, all bf16 but the ids.
    /// Records the backward on burn's graph.
    pub fn forward(
        &self,
        x: Tensor<Backend, 2>,
        topk_ids: Tensor<Backend, 2, Int>,
        topk_weights: Tensor<Backend, 2>,
        (w_gate, w_up, w_down): (Tensor<Backend, 3>, Tensor<Backend, 3>, Tensor<Backend, 3>),
    ) -> Result<Tensor<Backend, 2>, Error> {
        let [x, w] = [x, topk_weights].map(|t| t.into_primitive().tensor());
        let [g, u, d] = [w_gate, w_up, w_down].map(|t| t.into_primitive().tensor());
        let ids = topk_ids.into_primitive();
        let nodes = [&x, &w, &g, &u, &d].map(|p| p.node.clone());
        // CubeCL allocates small rows pitched (a [T, 2] tensor's rows padded for alignment):
        // mok reads compact rows, so each input is made contiguous (a no-op when it is).
        let [x, w, g, u, d] = [x, w, g, u, d].map(|p| into_contiguous(p.primitive));
        let weights = into_contiguous(Inner::float_cast(w, FloatDType::F32));
        let ids = into_contiguous(ids);
        let saved = Saved { x, ids, weights, w_gate: g, w_up: u, w_down: d };
        let y = self.run_forward(&saved)?;
        let out = match MokBackward.prepare::<NoCheckpointing>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((self.clone(), saved), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }

    fn run_forward(&self, saved: &Saved) -> Result<CubeTensor<CudaRuntime>, Error> {
        let y = empty(&saved.x, saved.x.meta.shape().clone(), DType::BF16);
        let mut state = self.state.lock().map_err(|_| Error::Tensor("layer state poisoned".into()))?;
        let State { gpu, layer, pass } = &mut *state;
        sync_cubecl(&saved.x)?;
        let (tokens, experts) = saved.inputs()?;
        let inputs = MoeInputs { tokens, experts, shared: None };
        *pass = Some(layer.forward_token(gpu, &inputs, view_mut(&y)?)?);
        gpu.synchronize()?;
        Ok(y)
    }

    /// dx, d_topk_weights (bf16, burn's float type), dw_gate, dw_up, dw_down, in the order of
    /// the forward's parents.
    fn run_backward(&self, saved: &Saved, dy: CubeTensor<CudaRuntime>) -> Result<[CubeTensor<CudaRuntime>; 5], Error> {
        let dy = into_contiguous(dy);
        let dx = empty(&saved.x, saved.x.meta.shape().clone(), DType::BF16);
        let d_weights = empty(&saved.x, saved.weights.meta.shape().clone(), DType::F32);
        let dw = [&saved.w_gate, &saved.w_up, &saved.w_down].map(|w| empty(w, w.meta.shape().clone(), DType::BF16));
        let mut state = self.state.lock().map_err(|_| Error::Tensor("layer state poisoned".into()))?;
        let State { gpu, layer, pass } = &mut *state;
        let token = pass.take().ok_or_else(|| Error::Tensor("a backward without its forward".into()))?;
        sync_cubecl(&dy)?;
        let (tokens, experts) = saved.inputs()?;
        let inputs = MoeInputs { tokens, experts, shared: None };
        let weights = WeightGradViews {
            dw_gate: view_mut(&dw[0])?,
            dw_up: view_mut(&dw[1])?,
            dw_down: view_mut(&dw[2])?,
            shared: None,
        };
        let grads = MoeGradients {
            dx: view_mut(&dx)?,
            d_topk_weights: view_mut(&d_weights)?,
            weights: WeightGradTarget::Bf16(weights),
        };
        layer.backward(gpu, token, &inputs, view(&dy)?, grads)?;
        gpu.synchronize()?;
        layer.check()?;
        drop(state);
        let d_weights = Inner::float_cast(d_weights, FloatDType::BF16);
        let [g, u, d] = dw;
        Ok([dx, d_weights, g, u, d])
    }
}

/// The same layer written in burn's own tensor ops (the comparison of the tests and the example):
/// for each slot j, every token's expert weights gathered (`select`), batched matmuls, SwiGLU,
/// and the slot-weighted sum. Any backend; no dropped slots (every id a valid expert).
pub fn moe_in_burn_ops<B: burn::tensor::backend::Backend>(
    x: Tensor<B, 2>,
    topk_ids: Tensor<B, 2, Int>,
    topk_weights: Tensor<B, 2>,
    (w_gate, w_up, w_down): (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>),
) -> Tensor<B, 2> {
    let [t, k] = topk_ids.dims();
    let h = x.dims()[1];
    let mut y = Tensor::<B, 2>::zeros([t, h], &x.device());
    for j in 0..k {
        let e = topk_ids.clone().slice([0..t, j..j + 1]).reshape([t]);
        let g = w_gate.clone().select(0, e.clone());
        let u = w_up.clone().select(0, e.clone());
        let d = w_down.clone().select(0, e);
        let rows = x.clone().unsqueeze_dim::<3>(1);
        let hidden =
            burn::tensor::activation::silu(rows.clone().matmul(g.swap_dims(1, 2))) * rows.matmul(u.swap_dims(1, 2));
        y = y + hidden.matmul(d.swap_dims(1, 2)).reshape([t, h]) * topk_weights.clone().slice([0..t, j..j + 1]);
    }
    y
}

/// A bf16 tensor of `Backend` from f32 `data` in row-major `shape`.
pub fn bf16_tensor<const D: usize>(
    data: Vec<f32>,
    shape: [usize; D],
    device: &burn::backend::cuda::CudaDevice,
) -> Tensor<Backend, D> {
    let data: Vec<bf16> = data.into_iter().map(bf16::from_f32).collect();
    Tensor::from_data(burn::tensor::TensorData::new(data, shape), device)
}

/// `n` deterministic values in ±`scale` from `seed` (a counter hash: the tests and the example
/// need no RNG crate).
pub fn deterministic_values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z ^= z >> 31;
            z = z.wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 29;
            scale * ((z >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_expert_is_refused_before_any_gpu_work() {
        let config = MoeConfig { shared_intermediate: Some(64), ..MoeConfig::new(8, 64, 64, 4, 2) };
        assert!(matches!(
            MokMoe::new(0, config),
            Err(Error::Mok(MokError::InvalidConfig { field: "shared_intermediate", .. }))
        ));
    }
}
