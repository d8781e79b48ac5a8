//! Device-side building blocks used by the entry points: activation math, thread indexing,
//! and the tile engine of the unfused GEMMs.

pub mod gemm;
pub mod math;
