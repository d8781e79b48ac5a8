//! # mok
//!
//! A deterministic mixture-of-experts layer for training, written entirely in Rust: kernels
//! compiled to PTX by rustc's NVPTX backend (crate `mok-kernels`), driven by a host crate over
//! the CUDA driver API (crate `mok-host`). This facade embeds the PTX for sm_90a (Hopper) and
//! sm_100a (Blackwell) and ptxas's cubin of each — shipped in `src/ptx/`, so a build needs
//! stable Rust alone — and re-exports the host API.
//!
//! ```no_run
//! use mok::driver::DeviceBuffer;
//! use mok::moe::{LayerOptions, MoeGradients, MoeInputs};
//! use mok::unfused::{DeviceExperts, DeviceTokens, WeightGradTarget, WeightGradViews};
//! use mok::{MoeConfig, MoeLayer, open_gpu, problem::{ExpertWeights, RoutedTokens}};
//! # fn main() -> mok::Result<()> {
//! let gpu = open_gpu(0)?;                         // or mok::open_gpu_on_stream(stream) for a framework's stream
//! let config = MoeConfig::new(4096, 7168, 2048, 384, 8);
//! config.validate()?;                             // errors name the field, the value and the rule
//! let (t, h, i, e, k) = (4096, 7168, 2048, 384, 8);
//! // A framework's device memory in practice (views of cudarc slices or raw pointers work too).
//! let zeros = |n| vec![half::bf16::ZERO; n];
//! let weights = ExpertWeights { w_gate: zeros(e * i * h), w_up: zeros(e * i * h), w_down: zeros(e * h * i) };
//! let experts = DeviceExperts::upload(&gpu, &config, &weights)?;
//! let ids: Vec<i32> = (0..t * k).map(|s| ((s / k * 7 + s % k) % e) as i32).collect();
//! let routed = RoutedTokens { x: zeros(t * h), topk_ids: ids, topk_weights: vec![0.125; t * k] };
//! let tokens = DeviceTokens::upload(&gpu, &config, &routed)?;
//! let (mut y, dy, mut dx) = (DeviceBuffer::alloc(&gpu, t * h)?, DeviceBuffer::alloc(&gpu, t * h)?, DeviceBuffer::alloc(&gpu, t * h)?);
//! let mut d_topk = DeviceBuffer::<f32>::alloc(&gpu, t * k)?;
//! // f32 main gradients, accumulated over micro-batches (`+=`).
//! let mut main: Vec<DeviceBuffer<f32>> = (0..3).map(|_| DeviceBuffer::alloc(&gpu, e * i * h)).collect::<Result<_, _>>()?;
//! for g in &mut main { g.fill_bytes(0)?; }
//!
//! let mut layer = MoeLayer::new(&gpu, config, LayerOptions::default())?;   // this GPU's default backend
//! let inputs = MoeInputs { tokens: (&tokens).into(), experts: (&experts).into(), shared: None };
//! let pass = layer.forward(&gpu, &inputs, (&mut y).into())?;               // no host sync
//! let [dw_gate, dw_up, dw_down] = &mut main[..] else { unreachable!() };
//! let weight_grads = WeightGradViews { dw_gate: dw_gate.into(), dw_up: dw_up.into(), dw_down: dw_down.into(), shared: None };
//! let grads = MoeGradients { dx: (&mut dx).into(), d_topk_weights: (&mut d_topk).into(), weights: WeightGradTarget::AccumulateF32(weight_grads) };
//! pass.backward(&gpu, &inputs, (&dy).into(), grads)?;                      // consumes the pass
//! layer.check()?;                                 // the one synchronising call: device-side errors
//! # Ok(()) }
//! ```
//!
//! One process per GPU (launched by torchrun or srun), each holding one expert-parallel rank:
//!
//! ```no_run
//! use std::time::Duration;
//! use mok::driver::vmm::ShareableKind;
//! use mok::exchange::{Exchange, ExchangeOptions};
//! use mok::moe::{Backend, LayerOptions};
//! use mok::symmetric::{LaunchEnv, SymmetricHeap, rendezvous::FileRendezvous};
//! use mok::{MoeConfig, MoeLayer, open_gpu};
//! # fn main() -> mok::Result<()> {
//! let env = LaunchEnv::from_env()?;               // rank, world, local rank from the launcher
//! let gpu = open_gpu(env.local_rank)?;
//! let config = MoeConfig { ep_ranks: env.world, ..MoeConfig::new(4096, 7168, 2048, 384, 8) };
//! // Each rank's slice of the symmetric heap, exported and mapped by every other rank; the
//! // handle records go round through files here (NCCL: `symmetric::bootstrap`, feature `nccl`).
//! let request = Exchange::heap_request(&config, &ExchangeOptions::default())?;
//! let mut rendezvous = FileRendezvous::new("/tmp/mok-rendezvous", &env, Duration::from_secs(120))?;
//! let heap = SymmetricHeap::multi_process(&gpu, &env, env.local_rank as i32, request, ShareableKind::PosixFd,
//!     &mut |mine| rendezvous.all_gather(mine))?;
//! // Every process on the same backend (the default is chosen per GPU).
//! let options = LayerOptions { backend: Some(Backend::Megakernel), ..LayerOptions::default() };
//! let mut layer = MoeLayer::with_heap(&gpu, config, options, heap)?;
//! // Then forward and backward as above, over this rank's share: its T tokens, its E/P experts;
//! // after `check()` reports an error, every process builds its layer again.
//! # let _ = &mut layer;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

#[cfg(feature = "testing")]
pub use mok_host::testing;

pub use mok_host::{
    MoeConfig, MoeLayer, MokError, Result, config, cudarc, driver, ep, error, exchange, gemm, layout, megakernel, moe,
    problem, random, reference, shapes, symmetric, tensor_map, unfused,
};
pub use mok_kernels as kernels;

/// PTX of every kernel for Hopper (sm_90a): the file shipped in `src/ptx/`, or a fresh build of
/// `kernels/` with `MOK_BUILD_KERNELS=1` (`build.rs`).
pub const PTX_SM90A: &str = include_str!(concat!(env!("OUT_DIR"), "/mok_sm90a.ptx"));
/// PTX of every kernel for Blackwell (sm_100a), from the same place as [`PTX_SM90A`]. Assembled
/// by ptxas in CI; not yet run on Blackwell hardware.
pub const PTX_SM100A: &str = include_str!(concat!(env!("OUT_DIR"), "/mok_sm100a.ptx"));
/// ptxas's cubin of [`PTX_SM90A`] (the pinned ptxas of `cargo xtask setup`): what an H100 or
/// H200 loads, with no JIT. Empty in a kernel build without `MOK_PTXAS` (`build.rs`).
pub const CUBIN_SM90A: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/mok_sm90a.cubin"));
/// ptxas's cubin of [`PTX_SM100A`], as [`CUBIN_SM90A`]; not yet run on Blackwell hardware.
pub const CUBIN_SM100A: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/mok_sm100a.cubin"));

/// mok's kernels for every architecture it ships.
pub const KERNEL_IMAGES: [driver::KernelImage<'static>; 2] = [
    driver::KernelImage { compute_capability: (9, 0), ptx: PTX_SM90A, cubin: CUBIN_SM90A },
    driver::KernelImage { compute_capability: (10, 0), ptx: PTX_SM100A, cubin: CUBIN_SM100A },
];

/// Opens GPU `ordinal` with mok's kernels loaded: the cubin for its architecture, or, where the
/// driver refuses it (a driver older than the CUDA 13.0 ptxas that made it may), the PTX through
/// the driver's JIT ([`driver::Gpu::loaded_kernels`] says which).
///
/// Fails with [`MokError::NoDriver`] on a machine without a CUDA driver and with
/// [`MokError::UnsupportedGpu`] on a GPU of any compute capability but 9.0 (H100, H200) and 10.0
/// (B200, GB200): the kernels are sm_90a and sm_100a code, which run on their own architecture
/// only.
///
/// With the feature `testing`, if the environment variable `MOK_PTX` names a file, that PTX is
/// loaded instead of the built-in kernels (a note goes to stderr): it lets one device call time
/// several builds of the kernels side by side. The file must target the GPU's architecture, or
/// the driver's JIT refuses it.
pub fn open_gpu(ordinal: usize) -> Result<driver::Gpu> {
    #[cfg(feature = "testing")]
    if let Some(path) = std::env::var_os("MOK_PTX") {
        let text = std::fs::read_to_string(&path).map_err(|e| MokError::InvalidInput {
            tensor: "MOK_PTX",
            problem: format!("cannot read PTX file {}: {e}", path.to_string_lossy()),
        })?;
        eprintln!("mok: MOK_PTX set: loading {} instead of the built-in kernels", path.to_string_lossy());
        let images = KERNEL_IMAGES.map(|image| driver::KernelImage { ptx: &text, cubin: &[], ..image });
        return driver::Gpu::new(ordinal, &images, unfused::KERNEL_NAMES);
    }
    driver::Gpu::new(ordinal, &KERNEL_IMAGES, unfused::KERNEL_NAMES)
}

/// As [`open_gpu`], with the built-in PTX alone, JIT-compiled by the driver (feature `testing`:
/// the tests that compare the cubin's bits with the PTX's).
#[cfg(feature = "testing")]
pub fn open_gpu_jit(ordinal: usize) -> Result<driver::Gpu> {
    let images = KERNEL_IMAGES.map(|image| driver::KernelImage { cubin: &[], ..image });
    driver::Gpu::new(ordinal, &images, unfused::KERNEL_NAMES)
}

/// As [`open_gpu`], with every kernel, copy and synchronisation on the caller's cudarc stream
/// (which must belong to its device's primary context, as `cudarc::driver::CudaContext::new`
/// makes it), so mok's work is ordered with the caller's. The GPU is the stream's device.
pub fn open_gpu_on_stream(stream: std::sync::Arc<cudarc::driver::CudaStream>) -> Result<driver::Gpu> {
    driver::Gpu::on_stream(stream, &KERNEL_IMAGES, unfused::KERNEL_NAMES)
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use super::*;

    #[test]
    fn unreadable_ptx_override_is_a_clear_error() {
        let missing = "/nonexistent/mok-override.ptx";
        // SAFETY: the only test of this crate's unit tests that touches the environment, and no
        // other thread of this test binary reads it.
        unsafe { std::env::set_var("MOK_PTX", missing) };
        let result = open_gpu(0);
        // SAFETY: as above.
        unsafe { std::env::remove_var("MOK_PTX") };
        let error = result.err().expect("a missing MOK_PTX file must fail before any driver call");
        assert!(matches!(error, MokError::InvalidInput { tensor: "MOK_PTX", .. }), "{error}");
        assert!(error.to_string().contains(missing), "{error}");
    }
}

/// The README's Rust examples, compiled as doctests (so the README cannot drift from the API).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeExamples;
