//! Editing tensor maps on the device (PTX ISA §9.7.9.28 `tensormap.replace`,
//! `tensormap.cp_fenceproxy`, §9.7.12.4 `fence.proxy.tensormap`), sm_90a.
//!
//! The engine's row groups come from device-written offsets, so a map that ends exactly at a
//! group's last row (TMA then zero-fills past it instead of reading the next group) can only be
//! made on the device: a warp copies a host-encoded map into shared memory, replaces its base
//! address and row count, and copies it to global memory with a release fence of the tensor-map
//! proxy; the kernel that uses it acquires it before its first copy.

use core::arch::asm;

/// Bytes of a tensor map (`CUtensorMap`).
pub const TENSOR_MAP_BYTES: u32 = 128;

/// `tensormap.replace.tile.global_address.shared::cta.b1024.b64`: sets the map's base address.
///
/// # Safety
/// `map` is the shared address of a 128-byte aligned tensor map; `address` is 16-byte aligned.
#[inline(always)]
pub unsafe fn replace_global_address(map: u32, address: u64) {
    // SAFETY: caller contract.
    unsafe {
        asm!("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [{m}], {a};",
             m = in(reg32) map, a = in(reg64) address, options(nostack));
    }
}

/// `tensormap.replace.tile.global_dim.shared::cta.b1024.b32`: sets the extent of dimension 1
/// (the rows of a 2-D map; dimension 0 is innermost).
///
/// # Safety
/// `map` is the shared address of a 128-byte aligned tensor map of rank ≥ 2; `extent` ≥ 1.
#[inline(always)]
pub unsafe fn replace_rows(map: u32, extent: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [{m}], 1, {e};",
             m = in(reg32) map, e = in(reg32) extent, options(nostack));
    }
}

/// `tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned`:
/// copies a map from shared to global memory and releases it to the tensor-map proxy at GPU
/// scope. Warp-collective.
///
/// # Safety
/// All 32 lanes call it in uniform flow; `dst` is a 128-byte aligned global map slot, `src` the
/// shared map, written (and made visible to the warp) before the call.
#[inline(always)]
pub unsafe fn copy_to_global_release(dst: u64, src: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [{d}], [{s}], 128;",
             d = in(reg64) dst, s = in(reg32) src, options(nostack));
    }
}

/// `fence.proxy.tensormap::generic.acquire.gpu`: makes a map written through
/// [`copy_to_global_release`] visible to this thread's tensor copies.
///
/// # Safety
/// `map` is the generic address of a 128-byte tensor map in global memory.
#[inline(always)]
pub unsafe fn acquire(map: u64) {
    // SAFETY: caller contract.
    unsafe { asm!("fence.proxy.tensormap::generic.acquire.gpu [{m}], 128;", m = in(reg64) map, options(nostack)) };
}
