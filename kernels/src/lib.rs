//! mok's GPU kernels, written in Rust and compiled to PTX by rustc's NVPTX backend.
//!
//! The crate builds for two kinds of target:
//! - `nvptx64-nvidia-cuda` (by the `mok` facade's build script): every `extern "ptx-kernel"`
//!   entry point in `entry`, with the PTX wrappers of `ptx` underneath (device-only modules);
//! - the host (as a plain `no_std` rlib): only the pure logic — routing layout, tile and index
//!   math, number formats — which `mok-host` reuses so that the CPU and the GPU agree by
//!   construction, and which is unit-tested here on the CPU.
#![cfg_attr(not(test), no_std)]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, asm_experimental_arch))]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod comm;
pub mod gemm_layout;
pub mod layout;
pub mod megakernel_layout;
pub mod num;
pub mod tiles;

#[cfg(target_arch = "nvptx64")]
pub mod ptx;

#[cfg(target_arch = "nvptx64")]
pub mod device;

#[cfg(all(target_arch = "nvptx64", mok_arch = "sm_90a"))]
pub mod gemm;

#[cfg(all(target_arch = "nvptx64", mok_arch = "sm_90a"))]
pub mod megakernel;

#[cfg(target_arch = "nvptx64")]
pub mod entry;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // NOTES: kernels report recoverable problems through error buffers; a panic here is a bug
    // (an index the bounds checks caught), so stop the grid loudly.
    ptx::trap()
}
