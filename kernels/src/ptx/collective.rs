//! Warp collectives the exchange's slot ranking uses beyond [`super::sync`]: grouping lanes by
//! value (PTX ISA §9.7.13.8 `match.sync`) and the lane masks of §10 (`%lanemask_lt`).
//!
//! Like every warp collective, call them in uniform control flow with all 32 lanes.

use core::arch::asm;

use super::sync::FULL_WARP;

/// `match.any.sync.b32`: the mask of lanes whose `value` equals this lane's.
#[inline(always)]
pub fn match_any_u32(value: u32) -> u32 {
    let peers: u32;
    // SAFETY: all lanes participate (FULL_WARP), uniform control flow (caller contract).
    unsafe {
        asm!("match.any.sync.b32 {p}, {v}, {full};",
             p = out(reg32) peers, v = in(reg32) value, full = in(reg32) FULL_WARP, options(nomem, nostack));
    }
    peers
}

/// `%lanemask_lt`: bits of the lanes below this one.
#[inline(always)]
pub fn lanemask_lt() -> u32 {
    let mask: u32;
    // SAFETY: reading a special register has no side effects.
    unsafe { asm!("mov.u32 {m}, %lanemask_lt;", m = out(reg32) mask, options(pure, nomem, nostack)) };
    mask
}
