//! Scalar and vector helpers of the reference: f64 dot/axpy, SwiGLU with the optional clamp and
//! its derivative, exact bf16 rounding.

use super::Element;

/// Copies a weight row into an f64 buffer: weights are converted one row at a time, never as a
/// whole tensor.
#[inline]
pub(super) fn load_row<E: Element>(src: &[E], dst: &mut [f64]) {
    debug_assert_eq!(src.len(), dst.len());
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.to_f64();
    }
}

/// `sum_i a[i] * b[i]` with four interleaved partial sums (so the loop vectorises); the order is
/// fixed by the length alone, so results are reproducible.
#[inline]
pub(super) fn dot(a: &[f64], b: &[f64]) -> f64 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f64; 4];
    let (a4, a_rest) = a.split_at(a.len() - a.len() % 4);
    let (b4, b_rest) = b.split_at(a4.len());
    for (ca, cb) in a4.chunks_exact(4).zip(b4.chunks_exact(4)) {
        for lane in 0..4 {
            acc[lane] += ca[lane] * cb[lane];
        }
    }
    let mut sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (&x, &y) in a_rest.iter().zip(b_rest) {
        sum += x * y;
    }
    sum
}

/// `dst[i] += alpha * src[i]`.
#[inline]
pub(super) fn axpy(dst: &mut [f64], alpha: f64, src: &[f64]) {
    debug_assert_eq!(dst.len(), src.len());
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += alpha * s;
    }
}

#[inline]
fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

/// The clamped SwiGLU inputs: `gate = min(gate, L)`, `up = clamp(up, -L, L)`. Written with
/// comparisons (not `f64::min`) so a NaN pre-activation stays NaN and shows up in comparisons.
#[inline]
fn clamp(gate: f64, up: f64, limit: Option<f64>) -> (f64, f64) {
    match limit {
        None => (gate, up),
        Some(l) => {
            let gate = if gate > l { l } else { gate };
            let up = if up > l {
                l
            } else if up < -l {
                -l
            } else {
                up
            };
            (gate, up)
        }
    }
}

/// `silu(min(gate, L)) * clamp(up, -L, L)`, `silu(g) = g * sigmoid(g)`.
#[inline]
pub(super) fn swiglu(gate: f64, up: f64, limit: Option<f64>) -> f64 {
    let (g, u) = clamp(gate, up, limit);
    g * sigmoid(g) * u
}

/// Gradients of [`swiglu`] with respect to the pre-activations, given the hidden's gradient.
/// Clamped elements get exactly zero (strict inequalities: at `gate == L` the gradient passes).
#[inline]
pub(super) fn swiglu_grad(gate: f64, up: f64, d_hidden: f64, limit: Option<f64>) -> (f64, f64) {
    let (g, u) = clamp(gate, up, limit);
    let s = sigmoid(g);
    let silu = g * s;
    let dsilu = s * (1.0 + g * (1.0 - s));
    let gate_clamped = limit.is_some_and(|l| gate > l);
    let up_clamped = limit.is_some_and(|l| up.abs() > l);
    let d_gate = if gate_clamped { 0.0 } else { d_hidden * u * dsilu };
    let d_up = if up_clamped { 0.0 } else { d_hidden * silu };
    (d_gate, d_up)
}

/// `2^n` for `n` in f64's normal exponent range, exactly.
#[inline]
fn pow2(n: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&n));
    f64::from_bits(((n + 1023) as u64) << 52)
}

/// Rounds `v` to the nearest bf16 value (ties to even, overflow to ±infinity, bf16 subnormals
/// kept), returned as f64.
///
/// Written here rather than `half::bf16::from_f64`, which drops the low 32 bits of the f64
/// mantissa before rounding and so misrounds values just above a tie.
pub fn round_to_bf16(v: f64) -> f64 {
    if !v.is_finite() || v == 0.0 {
        return v;
    }
    // Exponent of |v| (f64 subnormals are far below bf16's range and take the subnormal ulp).
    let exp = ((v.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    // bf16 keeps 8 significant bits; below 2^-126 the ulp stays at the subnormal 2^-133.
    let ulp = pow2(exp.max(-126) - 7);
    // Scaling by a power of two and rounding to an integer are exact.
    let rounded = (v / ulp).round_ties_even() * ulp;
    // Anything that rounds to 2^128 or beyond has overflowed bf16's range.
    if rounded.abs() >= pow2(128) { f64::INFINITY.copysign(v) } else { rounded }
}
