//! Per-thread asynchronous copies into shared memory (PTX ISA §9.7.9.25 `cp.async`), sm_80+:
//! each thread copies up to 16 bytes into shared memory, and an mbarrier counts the landing of a
//! thread's copies as one of its expected arrivals. What the engine uses where a tile's rows are
//! not one TMA box: rows chosen through an index (a gather), each 16-byte chunk placed by the
//! thread itself.
//!
//! The copies write shared memory through the generic proxy: a reader through the async proxy
//! (`wgmma`, TMA stores) must see them ordered by `fence.proxy.async.shared::cta` after it has
//! observed their completion.

use core::arch::asm;

/// `cp.async.cg.shared::cta.global [dst], [src], 16, ignore_src`: copies 16 bytes from global
/// `src` to shared `dst`, or, when `present` is false, writes 16 zeros there and reads nothing
/// (the `ignore-src` predicate: a plain predicated `LDGSTS`, where a register source size
/// costs a handful of instructions per copy); `.cg` caches in L2 only (the rows are read once
/// per tile by this block, from L2 by the others).
///
/// # Safety
/// `dst` a 16-byte aligned shared address of this block with 16 bytes of room that nothing
/// reads or writes until the copy is known complete; `src` a 16-byte aligned global address,
/// 16 bytes readable when `present` (a mapped address otherwise).
#[inline(always)]
pub unsafe fn copy_16_or_zeros(dst: u32, src: u64, present: bool) {
    // SAFETY: caller contract.
    unsafe {
        asm!("{{ .reg .pred zeros;",
             "setp.eq.u32 zeros, {p}, 0;",
             "cp.async.cg.shared::cta.global [{d}], [{s}], 16, zeros; }}",
             d = in(reg32) dst, s = in(reg64) src, p = in(reg32) present as u32, options(nostack));
    }
}

/// `cp.async.mbarrier.arrive.noinc.shared::cta.b64 [bar]`: one of the arrivals `bar`'s current
/// phase expects, made once every `cp.async` this thread issued before it has landed (`.noinc`:
/// the barrier's `init` count includes this thread's arrival). The phase then cannot complete
/// before those copies land, and a thread that observes it complete sees their bytes.
///
/// # Safety
/// `bar` an initialised barrier of this block whose current phase still expects this arrival.
#[inline(always)]
pub unsafe fn arrive_when_landed(bar: u32) {
    // SAFETY: caller contract.
    unsafe { asm!("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [{b}];", b = in(reg32) bar, options(nostack)) };
}
