//! Warpgroup matrix multiply-accumulate (PTX ISA §9.7.15 `wgmma`), sm_90a.
//!
//! Operands come from shared memory through 64-bit matrix descriptors
//! ([`crate::gemm_layout::smem_descriptor`]); the engine's one shape is `m64n256k16`, whose
//! accumulators are 128 f32 registers per thread, laid out like the `mma.m16n8` C fragment
//! repeated over 32 n8 blocks:
//! register `4·j + 2·h + c` of thread (warp w, lane l) holds row `16·w + l/4 + 8·h`, column
//! `8·j + 2·(l % 4) + c`.
//!
//! The MMAs are asynchronous: an `issue_*` call returns while the tensor cores still own the
//! accumulator registers, and only a wait ([`wait_keep_one_n256`], [`wait_all_n256`]) hands
//! them back. Both take the accumulators as in-out register operands,
//! which pins them to the same registers
//! from issue to wait and orders every use after the wait — the compiler has no other way to
//! know the registers are in flight.

use core::arch::asm;

/// The 128 accumulator registers of an `m64n256` f32 tile, as a PTX vector operand.
macro_rules! accumulators {
    () => {
        "{{{d0}, {d1}, {d2}, {d3}, {d4}, {d5}, {d6}, {d7}, {d8}, {d9}, {d10}, {d11}, {d12}, {d13}, {d14}, {d15}, {d16}, {d17}, {d18}, {d19}, {d20}, {d21}, {d22}, {d23}, {d24}, {d25}, {d26}, {d27}, {d28}, {d29}, {d30}, {d31}, {d32}, {d33}, {d34}, {d35}, {d36}, {d37}, {d38}, {d39}, {d40}, {d41}, {d42}, {d43}, {d44}, {d45}, {d46}, {d47}, {d48}, {d49}, {d50}, {d51}, {d52}, {d53}, {d54}, {d55}, {d56}, {d57}, {d58}, {d59}, {d60}, {d61}, {d62}, {d63}, {d64}, {d65}, {d66}, {d67}, {d68}, {d69}, {d70}, {d71}, {d72}, {d73}, {d74}, {d75}, {d76}, {d77}, {d78}, {d79}, {d80}, {d81}, {d82}, {d83}, {d84}, {d85}, {d86}, {d87}, {d88}, {d89}, {d90}, {d91}, {d92}, {d93}, {d94}, {d95}, {d96}, {d97}, {d98}, {d99}, {d100}, {d101}, {d102}, {d103}, {d104}, {d105}, {d106}, {d107}, {d108}, {d109}, {d110}, {d111}, {d112}, {d113}, {d114}, {d115}, {d116}, {d117}, {d118}, {d119}, {d120}, {d121}, {d122}, {d123}, {d124}, {d125}, {d126}, {d127}}}"
    };
}

/// Runs `asm!` with `$template` and the 128 accumulators of `$acc` bound as `d0..d127` (in-out
/// `.f32` registers), followed by any further operands.
macro_rules! asm_with_accumulators {
    ($acc:expr, [$($template:expr),* $(,)?], $($operands:tt)*) => {
        asm!(
            $($template,)*
            d0 = inout(reg32) $acc[0],
            d1 = inout(reg32) $acc[1],
            d2 = inout(reg32) $acc[2],
            d3 = inout(reg32) $acc[3],
            d4 = inout(reg32) $acc[4],
            d5 = inout(reg32) $acc[5],
            d6 = inout(reg32) $acc[6],
            d7 = inout(reg32) $acc[7],
            d8 = inout(reg32) $acc[8],
            d9 = inout(reg32) $acc[9],
            d10 = inout(reg32) $acc[10],
            d11 = inout(reg32) $acc[11],
            d12 = inout(reg32) $acc[12],
            d13 = inout(reg32) $acc[13],
            d14 = inout(reg32) $acc[14],
            d15 = inout(reg32) $acc[15],
            d16 = inout(reg32) $acc[16],
            d17 = inout(reg32) $acc[17],
            d18 = inout(reg32) $acc[18],
            d19 = inout(reg32) $acc[19],
            d20 = inout(reg32) $acc[20],
            d21 = inout(reg32) $acc[21],
            d22 = inout(reg32) $acc[22],
            d23 = inout(reg32) $acc[23],
            d24 = inout(reg32) $acc[24],
            d25 = inout(reg32) $acc[25],
            d26 = inout(reg32) $acc[26],
            d27 = inout(reg32) $acc[27],
            d28 = inout(reg32) $acc[28],
            d29 = inout(reg32) $acc[29],
            d30 = inout(reg32) $acc[30],
            d31 = inout(reg32) $acc[31],
            d32 = inout(reg32) $acc[32],
            d33 = inout(reg32) $acc[33],
            d34 = inout(reg32) $acc[34],
            d35 = inout(reg32) $acc[35],
            d36 = inout(reg32) $acc[36],
            d37 = inout(reg32) $acc[37],
            d38 = inout(reg32) $acc[38],
            d39 = inout(reg32) $acc[39],
            d40 = inout(reg32) $acc[40],
            d41 = inout(reg32) $acc[41],
            d42 = inout(reg32) $acc[42],
            d43 = inout(reg32) $acc[43],
            d44 = inout(reg32) $acc[44],
            d45 = inout(reg32) $acc[45],
            d46 = inout(reg32) $acc[46],
            d47 = inout(reg32) $acc[47],
            d48 = inout(reg32) $acc[48],
            d49 = inout(reg32) $acc[49],
            d50 = inout(reg32) $acc[50],
            d51 = inout(reg32) $acc[51],
            d52 = inout(reg32) $acc[52],
            d53 = inout(reg32) $acc[53],
            d54 = inout(reg32) $acc[54],
            d55 = inout(reg32) $acc[55],
            d56 = inout(reg32) $acc[56],
            d57 = inout(reg32) $acc[57],
            d58 = inout(reg32) $acc[58],
            d59 = inout(reg32) $acc[59],
            d60 = inout(reg32) $acc[60],
            d61 = inout(reg32) $acc[61],
            d62 = inout(reg32) $acc[62],
            d63 = inout(reg32) $acc[63],
            d64 = inout(reg32) $acc[64],
            d65 = inout(reg32) $acc[65],
            d66 = inout(reg32) $acc[66],
            d67 = inout(reg32) $acc[67],
            d68 = inout(reg32) $acc[68],
            d69 = inout(reg32) $acc[69],
            d70 = inout(reg32) $acc[70],
            d71 = inout(reg32) $acc[71],
            d72 = inout(reg32) $acc[72],
            d73 = inout(reg32) $acc[73],
            d74 = inout(reg32) $acc[74],
            d75 = inout(reg32) $acc[75],
            d76 = inout(reg32) $acc[76],
            d77 = inout(reg32) $acc[77],
            d78 = inout(reg32) $acc[78],
            d79 = inout(reg32) $acc[79],
            d80 = inout(reg32) $acc[80],
            d81 = inout(reg32) $acc[81],
            d82 = inout(reg32) $acc[82],
            d83 = inout(reg32) $acc[83],
            d84 = inout(reg32) $acc[84],
            d85 = inout(reg32) $acc[85],
            d86 = inout(reg32) $acc[86],
            d87 = inout(reg32) $acc[87],
            d88 = inout(reg32) $acc[88],
            d89 = inout(reg32) $acc[89],
            d90 = inout(reg32) $acc[90],
            d91 = inout(reg32) $acc[91],
            d92 = inout(reg32) $acc[92],
            d93 = inout(reg32) $acc[93],
            d94 = inout(reg32) $acc[94],
            d95 = inout(reg32) $acc[95],
            d96 = inout(reg32) $acc[96],
            d97 = inout(reg32) $acc[97],
            d98 = inout(reg32) $acc[98],
            d99 = inout(reg32) $acc[99],
            d100 = inout(reg32) $acc[100],
            d101 = inout(reg32) $acc[101],
            d102 = inout(reg32) $acc[102],
            d103 = inout(reg32) $acc[103],
            d104 = inout(reg32) $acc[104],
            d105 = inout(reg32) $acc[105],
            d106 = inout(reg32) $acc[106],
            d107 = inout(reg32) $acc[107],
            d108 = inout(reg32) $acc[108],
            d109 = inout(reg32) $acc[109],
            d110 = inout(reg32) $acc[110],
            d111 = inout(reg32) $acc[111],
            d112 = inout(reg32) $acc[112],
            d113 = inout(reg32) $acc[113],
            d114 = inout(reg32) $acc[114],
            d115 = inout(reg32) $acc[115],
            d116 = inout(reg32) $acc[116],
            d117 = inout(reg32) $acc[117],
            d118 = inout(reg32) $acc[118],
            d119 = inout(reg32) $acc[119],
            d120 = inout(reg32) $acc[120],
            d121 = inout(reg32) $acc[121],
            d122 = inout(reg32) $acc[122],
            d123 = inout(reg32) $acc[123],
            d124 = inout(reg32) $acc[124],
            d125 = inout(reg32) $acc[125],
            d126 = inout(reg32) $acc[126],
            d127 = inout(reg32) $acc[127],
            $($operands)*
        )
    };
}

/// One 64-deep K block of `m64n256k16` MMAs with the given transpose flags (0: K-major, 1:
/// M/N-major) for A and B.
macro_rules! issue_k64 {
    ($(#[$doc:meta])* $name:ident, $trans_a:literal, $trans_b:literal) => {
        $(#[$doc])*
        ///
        /// Issues one 64-deep K block — `wgmma.fence`, four MMAs of this shape (descriptors
        /// `a[i]`, `b[i]` for K slice i), `commit_group` — and returns while the tensor cores
        /// still write `acc`. Follow with a wait ([`wait_keep_one_n256`], [`wait_all_n256`]) on the
        /// same `acc` before reading it. `accumulate == false` makes the first MMA overwrite `acc`.
        ///
        /// # Safety
        /// Warpgroup-collective (128 consecutive threads starting at a multiple of 128, uniform
        /// flow); the descriptors must describe initialised shared memory that stays untouched
        /// until a wait covers this group.
        #[inline(always)]
        pub unsafe fn $name(acc: &mut [f32; 128], a: [u64; 4], b: [u64; 4], accumulate: bool) {
            // SAFETY: caller contract.
            unsafe {
                asm_with_accumulators!(acc, [
                    "{{",
                    ".reg .pred p, q;",
                    "setp.ne.u32 p, {scale}, 0;",
                    "setp.eq.u32 q, {scale}, {scale};",
                    "wgmma.fence.sync.aligned;",
                    concat!("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 ", accumulators!(), ", {a0}, {b0}, p, 1, 1, ", $trans_a, ", ", $trans_b, ";"),
                    concat!("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 ", accumulators!(), ", {a1}, {b1}, q, 1, 1, ", $trans_a, ", ", $trans_b, ";"),
                    concat!("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 ", accumulators!(), ", {a2}, {b2}, q, 1, 1, ", $trans_a, ", ", $trans_b, ";"),
                    concat!("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 ", accumulators!(), ", {a3}, {b3}, q, 1, 1, ", $trans_a, ", ", $trans_b, ";"),
                    "wgmma.commit_group.sync.aligned;",
                    "}}",
                ],
                    a0 = in(reg64) a[0], b0 = in(reg64) b[0], a1 = in(reg64) a[1], b1 = in(reg64) b[1],
                    a2 = in(reg64) a[2], b2 = in(reg64) b[2], a3 = in(reg64) a[3], b3 = in(reg64) b[3],
                    scale = in(reg32) accumulate as u32,
                    options(nostack),
                );
            }
        }
    };
}

issue_k64!(
    /// `A` K-major, `B` K-major (forward: activations × `nn.Linear` weights).
    issue_k64_m64n256_kk, 0, 0
);
issue_k64!(
    /// `A` K-major, `B` N-major (dgrad: the weight read transposed).
    issue_k64_m64n256_kn, 0, 1
);
issue_k64!(
    /// `A` M-major, `B` N-major (wgrad: both operands reduced over rows).
    issue_k64_m64n256_mn, 1, 1
);

/// `wgmma.wait_group.sync.aligned N` with the accumulators as in-out operands, so the compiler
/// keeps them in place and orders every later read after the wait.
macro_rules! wait_group {
    ($(#[$doc:meta])* $name:ident, $pending:literal) => {
        $(#[$doc])*
        #[inline(always)]
        pub fn $name(acc: &mut [f32; 128]) {
            // SAFETY: register-only; warpgroup-collective like the MMAs it waits for.
            unsafe {
                asm_with_accumulators!(acc, [
                    concat!("wgmma.wait_group.sync.aligned ", $pending, ";"),
                    // Names the accumulators so they are operands of the wait (a PTX comment).
                    concat!("// ", accumulators!()),
                ], options(nostack));
            }
        }
    };
}

wait_group!(
    /// `wgmma.wait_group 1` for `m64n256` accumulators: every committed group but the newest
    /// has completed.
    wait_keep_one_n256, 1
);
wait_group!(
    /// `wgmma.wait_group 0` for `m64n256` accumulators: every committed group has completed.
    wait_all_n256, 0
);
