//! SwiGLU and its derivative in f32, with the optional clamp (BRIEF §2).

use crate::ptx::convert::exp2_approx;

/// `1 / (1 + e^-x)`, with e^-x as 2^(-x·log2 e) (the hardware's exponential).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp2_approx(-x * core::f32::consts::LOG2_E))
}

/// Applies the SwiGLU clamp: gate = min(gate, L), up = clamp(up, -L, L). `limit` is +inf when
/// the layer has none, which makes both no-ops.
#[inline(always)]
pub fn clamp_gate_up(gate: f32, up: f32, limit: f32) -> (f32, f32) {
    (gate.min(limit), up.max(-limit).min(limit))
}

/// `silu(gate) * up` of already clamped inputs.
#[inline(always)]
pub fn swiglu(gate: f32, up: f32) -> f32 {
    gate * sigmoid(gate) * up
}

/// Gradients (d gate, d up) of `silu(min(g, L)) * clamp(u, -L, L)` at the raw pre-activations
/// `(gate, up)`; clamped elements get exactly zero.
#[inline(always)]
pub fn swiglu_backward(gate: f32, up: f32, d_hidden: f32, limit: f32) -> (f32, f32) {
    let (g, u) = clamp_gate_up(gate, up, limit);
    let s = sigmoid(g);
    let silu = g * s;
    let d_silu = s * (1.0 + g * (1.0 - s));
    let d_gate = if gate > limit { 0.0 } else { d_hidden * u * d_silu };
    let d_up = if up > limit || up < -limit { 0.0 } else { d_hidden * silu };
    (d_gate, d_up)
}
