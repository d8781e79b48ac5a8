//! Warp-level tensor-core instructions (PTX ISA §9.7.14.5 `mma.sync`).

use core::arch::asm;

/// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`: `acc += A(16×16) · B(16×8)`.
///
/// Fragment layout (lane = 4·group + t, group = lane / 4, t = lane % 4):
/// - `a[0]` = A[group][2t..2t+2], `a[1]` = A[group+8][2t..], `a[2]` = A[group][2t+8..],
///   `a[3]` = A[group+8][2t+8..] (bf16 pairs, low half = lower column);
/// - `b[0]` = B[2t..2t+2][group] (k pair, low half = lower k), `b[1]` = B[2t+8..][group];
/// - `acc[0..2]` = C[group][2t..2t+2], `acc[2..4]` = C[group+8][2t..2t+2].
#[inline(always)]
pub fn mma_m16n8k16_bf16_f32(acc: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
    // SAFETY: register-only; all 32 lanes execute it together (warp-collective, uniform flow).
    unsafe {
        asm!("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 \
              {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, \
              {{{d0}, {d1}, {d2}, {d3}}};",
             d0 = inout(reg32) acc[0], d1 = inout(reg32) acc[1],
             d2 = inout(reg32) acc[2], d3 = inout(reg32) acc[3],
             a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
             b0 = in(reg32) b[0], b1 = in(reg32) b[1], options(pure, nomem, nostack));
    }
}
