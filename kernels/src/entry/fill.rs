//! Buffer fills: poisoning, clearing, and device-side random data for tests and benchmarks
//! (generating frontier-size weights on the host would dominate a test's time).

use crate::device::grid_thread;
use crate::num::random_uniform;
use crate::ptx::convert::f32_to_bf16;

/// Fills `count` u32 words with `value` (poisoning and clearing device buffers).
///
/// # Safety
/// `dst` must hold `count` words.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_fill_u32(dst: *mut u32, count: u64, value: u32) {
    let (mut i, stride) = grid_thread();
    while (i as u64) < count {
        // SAFETY: i < count.
        unsafe { *dst.add(i) = value };
        i += stride;
    }
}

/// `dst[i] = bf16(scale · u(seed, i))` with `u` uniform in [-1, 1) ([`random_uniform`]): the
/// same values the host computes for the same seed, whatever the grid.
///
/// # Safety
/// `dst` must hold `count` bf16.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_fill_random_bf16(dst: *mut u16, count: u64, seed: u64, scale: f32) {
    let (mut i, stride) = grid_thread();
    while (i as u64) < count {
        // SAFETY: i < count.
        unsafe { *dst.add(i) = f32_to_bf16(scale * random_uniform(seed, i as u64)) };
        i += stride;
    }
}

/// `dst[i] += partials[0·stride + i] + partials[1·stride + i] + …` over `parts` partials, added
/// one at a time in part order (each add one f32 rounding): a sum whose order does not depend on
/// which part finished first — the ranks' shared-expert weight gradients, computed concurrently
/// inside one launch, added into the one gradient they share in rank order.
///
/// # Safety
/// `dst` holds `len` f32 and `partials` `parts` runs of `len` f32, `stride` apart; they do not
/// overlap.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_add_partials_f32(
    dst: *mut f32,
    partials: *const f32,
    stride: u64,
    parts: u32,
    len: u64,
) {
    let (mut i, step) = grid_thread();
    while (i as u64) < len {
        // SAFETY: i < len, and each part's run holds len (caller contract).
        unsafe {
            let mut sum = *dst.add(i);
            for part in 0..parts as usize {
                sum += *partials.add(part * stride as usize + i);
            }
            *dst.add(i) = sum;
        }
        i += step;
    }
}
