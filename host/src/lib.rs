//! mok's host side: loads the kernels' PTX, checks every CUDA call, validates configurations and
//! drives the MoE layer forward and backward; plus the f64 CPU reference of the layer.
//!
//! Layers, from the bottom: [`driver`] (a small safe API over cudarc's raw driver bindings),
//! [`config`] and [`problem`] (what a layer is, validated), [`unfused`] (the first GPU path:
//! one simple kernel per step), [`reference`](mod@reference) (the CPU oracle); for expert parallelism,
//! [`symmetric`] (the symmetric heap across ranks), [`exchange`] (the device-side schedule and
//! row movers) and [`ep`] (the layer over P ranks).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

/// The cudarc mok is built on, so a caller names the same types (e.g. its `CudaStream`).
pub use cudarc;

pub mod config;
pub mod driver;
pub mod ep;
pub mod error;
pub mod exchange;
#[cfg(test)]
mod gather_ring_model;
pub mod gemm;
pub mod layout;
pub mod megakernel;
pub mod moe;
pub mod problem;
pub mod random;
pub mod reference;
pub mod shapes;
pub mod symmetric;
pub mod tensor_map;
#[cfg(feature = "testing")]
pub mod testing;
pub mod unfused;

pub use config::MoeConfig;
pub use error::{MokError, Result};
pub use moe::MoeLayer;
