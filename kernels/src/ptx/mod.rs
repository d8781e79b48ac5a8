//! Thin wrappers over single PTX instructions: the only module of mok that contains `asm!`.
//!
//! One `#[inline(always)]` function per instruction (family), grouped by what it touches:
//! [`sreg`] special registers, [`sync`] barriers and warp collectives, [`memory`] scoped loads,
//! stores, atomics and fences, [`smem`] the dynamic shared-memory window, [`mbarrier`]
//! transaction barriers, [`cluster`] thread-block clusters, [`bulk`] bulk async copies,
//! [`signal`] the warp barrier and back-off of the exchange's counter waits, [`collective`] lane
//! grouping for the exchange's slot ranking, [`convert`] number conversions, [`cp_async`]
//! per-thread copies into shared memory, [`mma`] warp-level
//! tensor-core instructions, [`tma`] tensor copies, [`tensormap`] device-side tensor-map edits,
//! [`wgmma`] warpgroup tensor-core instructions. Every memory-ordering decision of the kernels is
//! made by choosing one of the functions in [`memory`], so it is visible here.
//!
//! PTX ISA references are to the PTX ISA 8.x manual sections named in each doc comment.

pub mod bulk;
pub mod cluster;
pub mod collective;
pub mod convert;
pub mod cp_async;
pub mod mbarrier;
pub mod memory;
pub mod mma;
pub mod signal;
pub mod smem;
pub mod sreg;
pub mod sync;
pub mod tensormap;
pub mod tma;
pub mod wgmma;

/// Aborts the kernel (`trap`, PTX ISA §9.7.19.x). The host sees `CUDA_ERROR_ILLEGAL_INSTRUCTION`
/// / launch failure. Only used for bugs (a failed bounds check), never for input problems.
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` takes no operands and never returns.
    unsafe { core::arch::asm!("trap;", options(noreturn, nostack)) }
}

/// Declares that the enclosing kernel is always launched with `N` threads per block: a marker
/// comment in the PTX body, which the PTX builder (`kernels/ptx_builder.rs`) turns into the
/// entry's `.maxntid N, 1, 1` directive (rustc has no `__launch_bounds__`). ptxas then budgets
/// registers for `N` threads — which `setmaxnreg` needs: the block's register pool is what the
/// kernel was compiled for times `N`.
#[inline(always)]
pub fn declare_block_threads<const N: u32>() {
    // SAFETY: emits a PTX comment only; not `pure`, so it is kept in every kernel it is inlined into.
    unsafe { core::arch::asm!("// mok:maxntid {n}", n = const N, options(nomem, nostack, preserves_flags)) };
}

/// Declares that the enclosing kernel runs in clusters of `N` blocks (along x): a marker the PTX
/// builder turns into `.reqnctapercluster N, 1, 1`, so an ordinary launch forms the clusters
/// (the grid must be a multiple of `N`).
#[inline(always)]
pub fn declare_cluster_blocks<const N: u32>() {
    // SAFETY: emits a PTX comment only (kept: not `pure`).
    unsafe { core::arch::asm!("// mok:reqnctapercluster {n}", n = const N, options(nomem, nostack, preserves_flags)) };
}
