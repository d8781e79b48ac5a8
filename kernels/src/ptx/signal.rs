//! Instructions the exchange's signalling needs beyond [`super::memory`]: the warp barrier that
//! orders a warp's row writes before one lane publishes them (PTX ISA §9.7.13.2 `bar.warp.sync`),
//! and the back-off of a polling thread (§9.7.13.11 `nanosleep`).

use core::arch::asm;

/// `bar.warp.sync 0xffffffff`: every lane of the warp arrives, and memory accesses made by the
/// lanes before it are ordered before accesses made after it by any lane of the warp (PTX ISA:
/// "guarantees memory ordering among threads participating in the barrier"). A lane that then
/// performs a release therefore publishes the whole warp's earlier writes (cumulativity).
///
/// # Safety
/// All 32 lanes of the warp (the member mask names them all) execute this same call, in
/// warp-uniform control flow; a lane of the mask that does not makes it undefined.
#[inline(always)]
pub unsafe fn warp_sync() {
    // SAFETY: caller contract.
    unsafe { asm!("bar.warp.sync 0xffffffff;", options(nostack)) };
}

/// `nanosleep.u32 ns`: suspends the thread for about `ns` nanoseconds (the hardware picks a
/// value in `[0, 2·ns]`), so a thread polling a counter leaves issue slots to the warps that
/// move data on the same SM.
#[inline(always)]
pub fn nanosleep(ns: u32) {
    // SAFETY: no memory operands.
    unsafe { asm!("nanosleep.u32 {n};", n = in(reg32) ns, options(nostack, nomem)) };
}
