//! Inputs on the device: a rank's routed tokens, the routed experts' and the shared expert's
//! weights, and random weights generated on the device.

use half::bf16;

use crate::config::MoeConfig;
use crate::driver::{DeviceBuffer, DeviceSlice, Gpu, check_aligned};
use crate::error::{MokError, Result};
use crate::problem::{ExpertWeights, RoutedTokens, SharedExpertWeights};

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

    /// Random weights generated on the device, uniform in ±`scale` (the kernel
    /// `mok_fill_random_bf16`; feature `testing`).
    #[cfg(feature = "testing")]
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

/// Borrowed views of one rank's routed tokens (a caller's memory, or a [`DeviceTokens`]).
#[derive(Clone, Copy)]
pub struct TokensView<'a> {
    /// `[T, H]`.
    pub x: DeviceSlice<'a, bf16>,
    /// `[T, k]` (-1: a dropped slot).
    pub topk_ids: DeviceSlice<'a, i32>,
    /// `[T, k]`.
    pub topk_weights: DeviceSlice<'a, f32>,
}

impl TokensView<'_> {
    /// Each view's address, with its name.
    pub(crate) fn named_addresses(&self) -> [(&'static str, u64); 3] {
        [
            ("x", self.x.device_ptr()),
            ("topk_ids", self.topk_ids.device_ptr()),
            ("topk_weights", self.topk_weights.device_ptr()),
        ]
    }

    /// The first of x `[T, H]`, the top-k ids and weights `[T, k]` whose length is not that of
    /// `tokens` tokens: `(tensor, length, expected)`.
    pub(crate) fn wrong_length(
        &self,
        tokens: usize,
        hidden: usize,
        top_k: usize,
    ) -> Option<(&'static str, usize, usize)> {
        [
            ("x", self.x.len(), tokens * hidden),
            ("topk_ids", self.topk_ids.len(), tokens * top_k),
            ("topk_weights", self.topk_weights.len(), tokens * top_k),
        ]
        .into_iter()
        .find(|&(_, len, expected)| len != expected)
    }
}

impl<'a> From<&'a DeviceTokens> for TokensView<'a> {
    fn from(t: &'a DeviceTokens) -> Self {
        Self { x: (&t.x).into(), topk_ids: (&t.topk_ids).into(), topk_weights: (&t.topk_weights).into() }
    }
}

/// Every view's address with its name: the tokens' (if given), each rank's experts' and the
/// shared expert's (if given).
pub(crate) fn named_view_addresses(
    tokens: Option<TokensView<'_>>,
    experts: &[ExpertsView<'_>],
    shared: Option<SharedExpertView<'_>>,
) -> Vec<(&'static str, u64)> {
    let tokens = tokens.iter().flat_map(|t| t.named_addresses());
    let experts = experts.iter().flat_map(|e| e.named_addresses());
    tokens.chain(experts).chain(shared.iter().flat_map(|s| s.named_addresses())).collect()
}

/// Borrowed views of the routed experts' weights (layout of [`DeviceExperts`]).
#[derive(Clone, Copy)]
pub struct ExpertsView<'a> {
    /// `[E/P, I, H]`.
    pub w_gate: DeviceSlice<'a, bf16>,
    /// `[E/P, I, H]`.
    pub w_up: DeviceSlice<'a, bf16>,
    /// `[E/P, H, I]`.
    pub w_down: DeviceSlice<'a, bf16>,
}

impl ExpertsView<'_> {
    /// Each view's address, with its name.
    pub(crate) fn named_addresses(&self) -> [(&'static str, u64); 3] {
        [("w_gate", self.w_gate.device_ptr()), ("w_up", self.w_up.device_ptr()), ("w_down", self.w_down.device_ptr())]
    }
}

impl<'a> From<&'a DeviceExperts> for ExpertsView<'a> {
    fn from(e: &'a DeviceExperts) -> Self {
        Self { w_gate: (&e.w_gate).into(), w_up: (&e.w_up).into(), w_down: (&e.w_down).into() }
    }
}

/// Borrowed views of the shared expert's weights (layout of [`DeviceSharedExpert`]).
#[derive(Clone, Copy)]
pub struct SharedExpertView<'a> {
    /// `[Is, H]`.
    pub ws_gate: DeviceSlice<'a, bf16>,
    /// `[Is, H]`.
    pub ws_up: DeviceSlice<'a, bf16>,
    /// `[H, Is]`.
    pub ws_down: DeviceSlice<'a, bf16>,
}

impl SharedExpertView<'_> {
    /// Each view's address, with its name.
    pub(crate) fn named_addresses(&self) -> [(&'static str, u64); 3] {
        [
            ("ws_gate", self.ws_gate.device_ptr()),
            ("ws_up", self.ws_up.device_ptr()),
            ("ws_down", self.ws_down.device_ptr()),
        ]
    }

    /// Checks the three views against a shared expert of `intermediate` (Is) columns of rows
    /// of `hidden` (H): their lengths (the kernels read them whole, unchecked) and their 16-byte
    /// alignment (TMA and vector loads).
    pub(crate) fn check(&self, intermediate: usize, hidden: usize) -> Result<()> {
        let views = [("ws_gate", self.ws_gate), ("ws_up", self.ws_up), ("ws_down", self.ws_down)];
        for (tensor, view) in views {
            if view.len() != intermediate * hidden {
                return Err(MokError::InvalidInput {
                    tensor,
                    problem: format!(
                        "device buffer has {} elements, expected {} (shared_intermediate · hidden)",
                        view.len(),
                        intermediate * hidden
                    ),
                });
            }
        }
        for (tensor, view) in views {
            check_aligned(tensor, view.device_ptr(), 16)?;
        }
        Ok(())
    }
}

impl<'a> From<&'a DeviceSharedExpert> for SharedExpertView<'a> {
    fn from(e: &'a DeviceSharedExpert) -> Self {
        Self { ws_gate: (&e.ws_gate).into(), ws_up: (&e.ws_up).into(), ws_down: (&e.ws_down).into() }
    }
}

/// `count` bf16 uniform in ±`scale`, generated on the device from `seed` (feature `testing`).
#[cfg(feature = "testing")]
pub fn random_bf16(gpu: &Gpu, count: usize, seed: u64, scale: f32) -> Result<DeviceBuffer<bf16>> {
    use super::kernels::{ROW_KERNEL_THREADS, grid_stride_blocks};
    use crate::driver::{KernelArg, LaunchShape};
    use KernelArg::{F32, Ptr, U64};

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
