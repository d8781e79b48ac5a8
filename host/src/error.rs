//! The typed error of every fallible mok call.

use thiserror::Error;

/// Everything that can go wrong in mok, by cause.
#[derive(Debug, Error)]
pub enum MokError {
    /// A configuration field is out of its valid range; names the field, its value and the rule.
    #[error("invalid MoE config: {field} = {value}: {rule}")]
    InvalidConfig {
        /// The `MoeConfig` field.
        field: &'static str,
        /// Its value as given.
        value: String,
        /// The rule it breaks, and why the rule exists.
        rule: String,
    },
    /// An input tensor does not match the configuration (length, range, duplicates).
    #[error("invalid input {tensor}: {problem}")]
    InvalidInput {
        /// Which tensor (`x`, `topk_ids`, `w_gate`, ...).
        tensor: &'static str,
        /// What is wrong, with the offending index and value.
        problem: String,
    },
    /// No CUDA driver could be loaded on this machine (the GPU path cannot run).
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// The GPU is not one the embedded PTX targets.
    #[error(
        "unsupported GPU {name} (compute capability {major}.{minor}): mok ships PTX for sm_90a (Hopper) and sm_100a (Blackwell)"
    )]
    UnsupportedGpu {
        /// Device name.
        name: String,
        /// Compute capability major.
        major: i32,
        /// Compute capability minor.
        minor: i32,
    },
    /// A CUDA driver call failed.
    #[error("CUDA call {call} failed: {message}")]
    Cuda {
        /// The driver call, with the kernel name for launches.
        call: String,
        /// The driver's error name and description.
        message: String,
    },
    /// A kernel reported a problem through mok's device error buffer.
    #[error("device-side error in {kernel}: {message}")]
    Device {
        /// The kernel (or pass) that reported it.
        kernel: &'static str,
        /// What the kernel saw.
        message: String,
    },
}

/// Result alias of mok's host API.
pub type Result<T, E = MokError> = core::result::Result<T, E>;
