//! Warp collectives the exchange's slot ranking uses beyond [`super::sync`]: grouping lanes by
//! value (PTX ISA §9.7.13.8 `match.sync`) and the lane masks of §10 (`%lanemask_lt`).
//!
//! Like every warp collective, call them in uniform control flow with all 32 lanes.

use core::arch::asm;

use super::sync::FULL_WARP;

/// `match.any.sync.b32`: the mask of lanes whose `value` equals this lane's.
///
/// # Safety
/// All 32 lanes of the warp (its member mask is [`FULL_WARP`]) execute this same call, in
/// warp-uniform control flow; a lane of the mask that does not makes it undefined.
#[inline(always)]
pub unsafe fn match_any_u32(value: u32) -> u32 {
    let peers: u32;
    // SAFETY: caller contract: the whole warp, which `FULL_WARP` names.
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
