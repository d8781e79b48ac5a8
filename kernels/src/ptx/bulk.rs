//! Bulk asynchronous copies (PTX ISA §9.7.9.25 `cp.async.bulk`), sm_90: the copy engine moves
//! a contiguous run of bytes (a multiple of 16, 16-byte aligned at both ends) between global and
//! shared memory. Global addresses may be peer-mapped (another GPU's memory over NVLink).

use core::arch::asm;

/// `cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes`: global → shared; the
/// bytes count toward `bar`'s transaction count when they land.
///
/// # Safety
/// `dst` a 16-byte aligned shared address of this block with `bytes` room, `src` a 16-byte
/// aligned global address with `bytes` readable, `bytes % 16 == 0`, and `bar` expecting them.
#[inline(always)]
pub unsafe fn global_to_shared(dst: u32, src: *const u8, bytes: u32, bar: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{s}], {n}, [{b}];",
             d = in(reg32) dst, s = in(reg64) src, n = in(reg32) bytes, b = in(reg32) bar, options(nostack));
    }
}

/// `cp.async.bulk.global.shared::cta.bulk_group`: shared → global, tracked by this thread's
/// bulk groups ([`commit_group`], [`wait_group_read`], [`wait_group`]).
///
/// # Safety
/// As [`global_to_shared`], with the directions swapped; the shared source must have been
/// written before (and made visible to the async proxy with `fence.proxy.async.shared::cta`).
#[inline(always)]
pub unsafe fn shared_to_global(dst: *mut u8, src: u32, bytes: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("cp.async.bulk.global.shared::cta.bulk_group [{d}], [{s}], {n};",
             d = in(reg64) dst, s = in(reg32) src, n = in(reg32) bytes, options(nostack));
    }
}

/// `cp.async.bulk.commit_group`: closes the group of bulk stores issued so far by this thread.
#[inline(always)]
pub fn commit_group() {
    // SAFETY: no operands.
    unsafe { asm!("cp.async.bulk.commit_group;", options(nostack)) };
}

/// `cp.async.bulk.wait_group.read 0`: waits until every committed group has finished reading
/// its shared source (the buffer may then be reused).
#[inline(always)]
pub fn wait_group_read_all() {
    // SAFETY: no operands.
    unsafe { asm!("cp.async.bulk.wait_group.read 0;", options(nostack)) };
}

/// `cp.async.bulk.wait_group 0`: waits until every committed group is complete (its writes
/// are performed); publish them to other agents with a release after this.
#[inline(always)]
pub fn wait_group_all() {
    // SAFETY: no operands.
    unsafe { asm!("cp.async.bulk.wait_group 0;", options(nostack)) };
}
