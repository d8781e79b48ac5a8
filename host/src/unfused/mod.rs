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

mod expert_compute;
mod kept;
mod kernels;
mod layer;
mod tensors;

pub use expert_compute::{ExpertBackward, ExpertCompute, RowGroups};
pub(crate) use expert_compute::{
    SharedEnginePlans, backward_pass_plans, forward_pass_plans, shared_expert_forward, shared_expert_workspace,
};
pub use kernels::KERNEL_NAMES;
pub(crate) use kernels::{RANK_CHUNK_THREADS, ROW_KERNEL_THREADS, grid_stride_blocks};
pub(crate) use layer::nan_filled;
pub use layer::{DeviceGrads, RoutedBackward, RoutingBuffers, UnfusedLayer, WeightGradTarget, WeightGradViews};
pub(crate) use tensors::named_view_addresses;
#[cfg(feature = "testing")]
pub use tensors::random_bf16;
pub use tensors::{DeviceExperts, DeviceSharedExpert, DeviceTokens, ExpertsView, SharedExpertView, TokensView};
