//! Number conversions (PTX ISA §9.7.9.21 `cvt`).

use core::arch::asm;

/// f32 → bf16 bits, round to nearest even (`cvt.rn.bf16.f32`), NaN stays NaN.
#[inline(always)]
pub fn f32_to_bf16(value: f32) -> u16 {
    let out: u16;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rn.bf16.f32 {o}, {v};", o = out(reg16) out, v = in(reg32) value,
             options(pure, nomem, nostack));
    }
    out
}

/// Two f32 → packed bf16x2 (`cvt.rn.bf16x2.f32`): `lo` in bits 0..16, `hi` in bits 16..32,
/// which is the memory order of two consecutive bf16 elements.
#[inline(always)]
pub fn f32x2_to_bf16x2(lo: f32, hi: f32) -> u32 {
    let out: u32;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {o}, {h}, {l};", o = out(reg32) out, h = in(reg32) hi,
             l = in(reg32) lo, options(pure, nomem, nostack));
    }
    out
}

/// `ex2.approx.ftz.f32`: 2^x (max relative error 2^-22 for the normal range).
#[inline(always)]
pub fn exp2_approx(value: f32) -> f32 {
    let out: f32;
    // SAFETY: register-only.
    unsafe {
        asm!("ex2.approx.ftz.f32 {o}, {v};", o = out(reg32) out, v = in(reg32) value,
             options(pure, nomem, nostack));
    }
    out
}
