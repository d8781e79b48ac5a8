//! Tensor memory accelerator copies (PTX ISA §9.7.9.27 `cp.async.bulk.tensor`), sm_90.
//!
//! A tensor map (`CUtensorMap`, 128 bytes, built on the host by `cuTensorMapEncodeTiled`) lives
//! in device global memory — rustc has no `__grid_constant__` parameters — and is passed as its
//! generic address. Boxes land in shared memory in the map's swizzle layout and complete on an
//! mbarrier. Coordinates are in elements, innermost first; out-of-bounds elements read as zero.

use core::arch::asm;

/// `cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes`.
///
/// # Safety
/// `tensor_map` points at a valid 64-byte aligned tensor map in global memory; `dst` is a
/// 1024-byte aligned shared address (128B swizzle) with room for the box; `bar` expects the bytes.
#[inline(always)]
pub unsafe fn load_2d(dst: u32, tensor_map: u64, c0: i32, c1: i32, bar: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{d}], [{m}, {{{c0}, {c1}}}], [{b}];",
             d = in(reg32) dst, m = in(reg64) tensor_map, c0 = in(reg32) c0, c1 = in(reg32) c1, b = in(reg32) bar,
             options(nostack));
    }
}

/// `cp.async.bulk.tensor.3d...`: as [`load_2d`] with a third (outermost) coordinate.
///
/// # Safety
/// As [`load_2d`].
#[inline(always)]
pub unsafe fn load_3d(dst: u32, tensor_map: u64, c0: i32, c1: i32, c2: i32, bar: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{d}], [{m}, {{{c0}, {c1}, {c2}}}], [{b}];",
             d = in(reg32) dst, m = in(reg64) tensor_map, c0 = in(reg32) c0, c1 = in(reg32) c1, c2 = in(reg32) c2,
             b = in(reg32) bar, options(nostack));
    }
}

/// `prefetch.tensormap`: pulls a tensor map into the descriptor cache ahead of first use.
///
/// # Safety
/// `tensor_map` points at a valid tensor map in global memory.
#[inline(always)]
pub unsafe fn prefetch_map(tensor_map: u64) {
    // SAFETY: caller contract.
    unsafe { asm!("prefetch.tensormap [{m}];", m = in(reg64) tensor_map, options(nostack)) };
}

/// `cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group`: writes a box from shared memory
/// (in the map's swizzle layout) to the tensor; elements outside the tensor are not written.
/// Completes with the thread's bulk groups ([`super::bulk::commit_group`], then a wait).
///
/// # Safety
/// `tensor_map` is a valid map in global memory; `src` a 1024-byte aligned shared address holding
/// the box, written before and made visible to the async proxy (`fence.proxy.async`); it must stay
/// untouched until a `wait_group.read` covers this copy.
#[inline(always)]
pub unsafe fn store_3d(tensor_map: u64, c0: i32, c1: i32, c2: i32, src: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [{m}, {{{c0}, {c1}, {c2}}}], [{s}];",
             m = in(reg64) tensor_map, c0 = in(reg32) c0, c1 = in(reg32) c1, c2 = in(reg32) c2, s = in(reg32) src,
             options(nostack));
    }
}

/// `cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group`: like [`store_3d`],
/// but each element is added to what the tensor holds (one rounding per element, as `+=`).
///
/// # Safety
/// As [`store_3d`]; no other agent writes the box's elements during the copy.
#[inline(always)]
pub unsafe fn reduce_add_3d(tensor_map: u64, c0: i32, c1: i32, c2: i32, src: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [{m}, {{{c0}, {c1}, {c2}}}], [{s}];",
             m = in(reg64) tensor_map, c0 = in(reg32) c0, c1 = in(reg32) c1, c2 = in(reg32) c2, s = in(reg32) src,
             options(nostack));
    }
}

/// `cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group`: [`store_3d`] for 2-D maps.
///
/// # Safety
/// As [`store_3d`].
#[inline(always)]
pub unsafe fn store_2d(tensor_map: u64, c0: i32, c1: i32, src: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [{m}, {{{c0}, {c1}}}], [{s}];",
             m = in(reg64) tensor_map, c0 = in(reg32) c0, c1 = in(reg32) c1, s = in(reg32) src, options(nostack));
    }
}

/// `cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster`:
/// [`load_2d`] delivered to the same shared offset `dst` in every block of the cluster named in
/// `block_mask`, each completing the bytes on its barrier at offset `bar`.
///
/// # Safety
/// As [`load_2d`], in every block of the mask: `dst` is free there and its barrier at `bar`
/// expects the bytes.
#[inline(always)]
pub unsafe fn load_2d_multicast(dst: u32, tensor_map: u64, c0: i32, c1: i32, bar: u32, block_mask: u16) {
    // SAFETY: caller contract.
    unsafe {
        asm!("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [{d}], [{m}, {{{c0}, {c1}}}], [{b}], {k};",
             d = in(reg32) dst, m = in(reg64) tensor_map, c0 = in(reg32) c0, c1 = in(reg32) c1,
             b = in(reg32) bar, k = in(reg16) block_mask, options(nostack));
    }
}

/// `cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster`:
/// [`load_3d`] delivered to the same shared offset `dst` in every block of the cluster named in
/// `block_mask`, each completing the bytes on its barrier at offset `bar`.
///
/// # Safety
/// As [`load_3d`], in every block of the mask: `dst` is free there and its barrier at `bar`
/// expects the bytes.
#[inline(always)]
pub unsafe fn load_3d_multicast(dst: u32, tensor_map: u64, c0: i32, c1: i32, c2: i32, bar: u32, block_mask: u16) {
    // SAFETY: caller contract.
    unsafe {
        asm!("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [{d}], [{m}, {{{c0}, {c1}, {c2}}}], [{b}], {k};",
             d = in(reg32) dst, m = in(reg64) tensor_map, c0 = in(reg32) c0, c1 = in(reg32) c1, c2 = in(reg32) c2,
             b = in(reg32) bar, k = in(reg16) block_mask, options(nostack));
    }
}
