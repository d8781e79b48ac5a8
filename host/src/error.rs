//! The typed error of every fallible mok call.

use thiserror::Error;

/// Everything that can go wrong in mok, by cause.
#[derive(Debug, Error)]
pub enum MokError {
    /// A configuration value is out of its valid range: a `MoeConfig` field, a layer or exchange
    /// option, or an environment variable the multi-process bootstrap reads; names it, its value
    /// and the rule.
    #[error("invalid configuration: {field} = {value}: {rule}")]
    InvalidConfig {
        /// The `MoeConfig` field, option or environment variable.
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
        "unsupported GPU {name} (compute capability {major}.{minor}): mok ships PTX for sm_90a (compute capability 9.0) and sm_100a (10.0)"
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
    /// A bounded wait expired (a peer never signalled, or signalled too little): names what was
    /// waited for, on which rank, from which rank, and the value expected and seen.
    #[error("timed out{}: waited for {waited_for}{}; {detail}", on_rank(.rank), from_rank(.peer))]
    Timeout {
        /// The rank that waited, when the wait belongs to one.
        rank: Option<usize>,
        /// The rank that should have signalled, when known.
        peer: Option<usize>,
        /// The counter or flag waited for.
        waited_for: String,
        /// Which counter entry, the value expected and the value seen.
        detail: String,
    },
    /// A device buffer sized at setup cannot hold what a pass routed to it (never a trap: the
    /// pass reports the size it needs).
    #[error(
        "capacity exceeded on rank {rank}: {what} needs {needed} rows but holds {capacity}; rebuild it with at least {needed}"
    )]
    Capacity {
        /// The buffer.
        what: &'static str,
        /// The rank whose buffer overflowed.
        rank: usize,
        /// Rows the pass needs.
        needed: usize,
        /// Rows the buffer holds.
        capacity: usize,
    },
}

fn on_rank(rank: &Option<usize>) -> String {
    rank.map(|r| format!(" on rank {r}")).unwrap_or_default()
}

fn from_rank(peer: &Option<usize>) -> String {
    peer.map(|p| format!(" from rank {p}")).unwrap_or_default()
}

/// Result alias of mok's host API.
pub type Result<T, E = MokError> = core::result::Result<T, E>;
