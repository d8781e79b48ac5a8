//! The f64 CPU reference of the MoE layer (BRIEF §2): the oracle every GPU result is checked
//! against.
//!
//! Everything is accumulated in f64 from the inputs' exact values, so the reference's own rounding
//! error (~1e-15 relative) is far below the bf16/f32 error of any GPU path. The one deliberate
//! rounding is the spec's bf16 rounding of the SwiGLU output before the down projection, switched
//! by [`ReferenceOptions::round_hidden_to_bf16`].
//!
//! The math is generic over the element type of inputs and weights ([`Element`]): the normal
//! entry points [`forward`] and [`backward`] read bf16 problems, and the finite-difference tests
//! run the same code on f64 problems through [`forward_generic`] / [`backward_generic`].
//!
//! Weights are never copied to f64 as a whole (the frontier shapes have ~5.6e9 routed weight
//! elements); each weight row is converted into a small buffer when it is used, and reused for a
//! block of token rows.
//!
//! Parallel work (rayon) is split so that every output element is produced by exactly one task,
//! with a summation order fixed by the data alone: the results are bitwise identical across runs
//! and thread counts.
//!
//! The reference runs one rank holding all experts (P = 1); [`forward`] and [`backward`] reject
//! `ep_ranks > 1`.

mod backward;
mod forward;
mod math;
#[cfg(test)]
mod tests;

use half::bf16;

use crate::config::MoeConfig;
use crate::error::{MokError, Result};
use crate::problem::{ExpertWeights, LayerGrads, RoutedTokens, SharedExpertWeights, validate_topk_ids};

pub use math::round_to_bf16;

/// An input or weight element type the reference can read: its exact value as f64.
pub trait Element: Copy + Send + Sync + 'static {
    /// The element's value, exactly (every implementor is a subset of f64).
    fn to_f64(self) -> f64;
}

impl Element for bf16 {
    #[inline]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Element for f32 {
    #[inline]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Element for f64 {
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
}

/// Switches of the reference's arithmetic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReferenceOptions {
    /// Round the SwiGLU output (hidden activation) to bf16 before the down projection, as the
    /// spec and the GPU do. Use `true` to compare with the GPU; `false` for finite differences
    /// (rounding is not differentiable). When `true`, backward treats the rounding as the
    /// identity (straight-through) but uses the rounded hidden for `F_e`, `dW_down` and
    /// `d_topk_weights`.
    pub round_hidden_to_bf16: bool,
}

impl ReferenceOptions {
    /// What the GPU computes: hidden rounded to bf16.
    pub const MATCH_GPU: Self = Self { round_hidden_to_bf16: true };
    /// Pure f64 math, differentiable: for finite-difference checks.
    pub const EXACT: Self = Self { round_hidden_to_bf16: false };
}

/// Forward results and the intermediates backward and tests need, all f64, unrounded except for
/// the optional bf16 rounding of `hidden`.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceForward {
    /// `[T, H]`: `S(x[t]) + sum_j w[t,j] F_{e[t,j]}(x[t])`, shared term first then slots in order.
    pub y: Vec<f64>,
    /// `[T, k, H]`: `F_e(x[t])` of each slot; exactly 0 for dropped slots.
    pub slot_outputs: Vec<f64>,
    /// `[T, k, I]`: `W_gate_e x[t]` before clamping; 0 for dropped slots.
    pub gate_pre: Vec<f64>,
    /// `[T, k, I]`: `W_up_e x[t]` before clamping; 0 for dropped slots.
    pub up_pre: Vec<f64>,
    /// `[T, k, I]`: `silu(gate) * up` after clamping (and after bf16 rounding if enabled); 0 for
    /// dropped slots.
    pub hidden: Vec<f64>,
    /// `[T, H]`: the shared expert's output `S(x[t])`, if the layer has one.
    pub shared_out: Option<Vec<f64>>,
}

/// Gradients of the shared expert's weights.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceSharedGrads {
    /// `[Is, H]`.
    pub dws_gate: Vec<f64>,
    /// `[Is, H]`.
    pub dws_up: Vec<f64>,
    /// `[H, Is]`.
    pub dws_down: Vec<f64>,
}

/// Gradients of everything the layer reads, in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceGrads {
    /// `[T, H]`.
    pub dx: Vec<f64>,
    /// `[T, k]`: `<dy[t], F_e(x[t])>`; exactly 0 for dropped slots.
    pub d_topk_weights: Vec<f64>,
    /// `[E/P, I, H]`; exactly 0 for experts without tokens.
    pub dw_gate: Vec<f64>,
    /// `[E/P, I, H]`; exactly 0 for experts without tokens.
    pub dw_up: Vec<f64>,
    /// `[E/P, H, I]`; exactly 0 for experts without tokens.
    pub dw_down: Vec<f64>,
    /// The shared expert's weight gradients, if the layer has one.
    pub shared: Option<ReferenceSharedGrads>,
}

impl ReferenceGrads {
    /// The same gradients rounded to f32, in the layout the GPU path returns.
    pub fn to_layer_grads(&self) -> LayerGrads {
        let f32s = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
        LayerGrads {
            dx: f32s(&self.dx),
            d_topk_weights: f32s(&self.d_topk_weights),
            dw_gate: f32s(&self.dw_gate),
            dw_up: f32s(&self.dw_up),
            dw_down: f32s(&self.dw_down),
            shared: self.shared.as_ref().map(|s| (f32s(&s.dws_gate), f32s(&s.dws_up), f32s(&s.dws_down))),
        }
    }
}

/// The shared expert's weights of a [`Problem`], `nn.Linear` layout.
#[derive(Clone, Copy, Debug)]
pub struct SharedSlices<'a, E: Element> {
    /// `[Is, H]`.
    pub ws_gate: &'a [E],
    /// `[Is, H]`.
    pub ws_up: &'a [E],
    /// `[H, Is]`.
    pub ws_down: &'a [E],
}

/// One layer problem with inputs and weights of element type `E`, borrowed; the input of
/// [`forward_generic`] and [`backward_generic`]. Layouts as in [`RoutedTokens`] and
/// [`ExpertWeights`]; ids address local experts.
#[derive(Clone, Copy, Debug)]
pub struct Problem<'a, E: Element> {
    /// `[T, H]`.
    pub x: &'a [E],
    /// `[T, k]`, each in `[0, E/P)` and distinct within a row, or -1 for a dropped slot.
    pub topk_ids: &'a [i32],
    /// `[T, k]`, f64 so finite differences can perturb them finely.
    pub topk_weights: &'a [f64],
    /// `[E/P, I, H]`.
    pub w_gate: &'a [E],
    /// `[E/P, I, H]`.
    pub w_up: &'a [E],
    /// `[E/P, H, I]`.
    pub w_down: &'a [E],
    /// The shared expert, present iff `config.shared_intermediate` is `Some`.
    pub shared: Option<SharedSlices<'a, E>>,
}

/// `config.validate()` plus the reference's own limit: one rank holding every expert.
fn validate_config(config: &MoeConfig) -> Result<()> {
    config.validate()?;
    if config.ep_ranks != 1 {
        return Err(MokError::InvalidConfig {
            field: "ep_ranks",
            value: config.ep_ranks.to_string(),
            rule: "the CPU reference runs one rank holding all experts (ep_ranks = 1)".into(),
        });
    }
    Ok(())
}

fn expect_len(tensor: &'static str, actual: usize, expected: usize, shape: &str) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(MokError::InvalidInput { tensor, problem: format!("has {actual} elements, expected {expected} ({shape})") })
    }
}

/// Shared weights must be given exactly when the config declares a shared expert.
fn check_shared_presence(config: &MoeConfig, given: bool) -> Result<()> {
    match (config.shared_intermediate, given) {
        (Some(is), false) => Err(MokError::InvalidInput {
            tensor: "shared expert",
            problem: format!("config.shared_intermediate is Some({is}) but no shared weights were given"),
        }),
        (None, true) => Err(MokError::InvalidInput {
            tensor: "shared expert",
            problem: "weights given but config.shared_intermediate is None".into(),
        }),
        _ => Ok(()),
    }
}

/// Checks a generic problem against `config`: every length, id range and duplicates.
fn validate_problem<E: Element>(config: &MoeConfig, p: &Problem<'_, E>) -> Result<()> {
    validate_config(config)?;
    let (t, h, i, k) = (config.tokens_per_rank, config.hidden, config.intermediate, config.top_k);
    let el = config.local_experts();
    expect_len("x", p.x.len(), t * h, "[T, H]")?;
    expect_len("topk_ids", p.topk_ids.len(), t * k, "[T, k]")?;
    expect_len("topk_weights", p.topk_weights.len(), t * k, "[T, k]")?;
    expect_len("w_gate", p.w_gate.len(), el * i * h, "[E/P, I, H]")?;
    expect_len("w_up", p.w_up.len(), el * i * h, "[E/P, I, H]")?;
    expect_len("w_down", p.w_down.len(), el * h * i, "[E/P, H, I]")?;
    check_shared_presence(config, p.shared.is_some())?;
    if let (Some(s), Some(is)) = (&p.shared, config.shared_intermediate) {
        expect_len("ws_gate", s.ws_gate.len(), is * h, "[Is, H]")?;
        expect_len("ws_up", s.ws_up.len(), is * h, "[Is, H]")?;
        expect_len("ws_down", s.ws_down.len(), h * is, "[H, Is]")?;
    }
    validate_topk_ids(p.topk_ids, el, k)
}

/// Validates the bf16 problem with the [`crate::problem`] validators (so errors read the same as
/// the GPU path's) and returns the topk weights widened to f64.
fn validate_bf16(
    config: &MoeConfig,
    tokens: &RoutedTokens,
    experts: &ExpertWeights,
    shared: Option<&SharedExpertWeights>,
) -> Result<Vec<f64>> {
    validate_config(config)?;
    tokens.validate(config)?;
    experts.validate(config)?;
    check_shared_presence(config, shared.is_some())?;
    if let Some(s) = shared {
        s.validate(config)?;
    }
    Ok(tokens.topk_weights.iter().map(|&w| f64::from(w)).collect())
}

fn bf16_problem<'a>(
    tokens: &'a RoutedTokens,
    topk_weights: &'a [f64],
    experts: &'a ExpertWeights,
    shared: Option<&'a SharedExpertWeights>,
) -> Problem<'a, bf16> {
    Problem {
        x: &tokens.x,
        topk_ids: &tokens.topk_ids,
        topk_weights,
        w_gate: &experts.w_gate,
        w_up: &experts.w_up,
        w_down: &experts.w_down,
        shared: shared.map(|s| SharedSlices { ws_gate: &s.ws_gate, ws_up: &s.ws_up, ws_down: &s.ws_down }),
    }
}

/// The layer's forward pass on a bf16 problem, in f64. Validates the config (one rank only) and
/// every input first; shared weights must be given iff `config.shared_intermediate` is `Some`.
pub fn forward(
    config: &MoeConfig,
    tokens: &RoutedTokens,
    experts: &ExpertWeights,
    shared: Option<&SharedExpertWeights>,
    options: ReferenceOptions,
) -> Result<ReferenceForward> {
    let topk_weights = validate_bf16(config, tokens, experts, shared)?;
    forward_generic(config, &bf16_problem(tokens, &topk_weights, experts, shared), options)
}

/// The layer's forward and backward passes on a bf16 problem given `dy` `[T, H]`, in f64.
/// Validates like [`forward`], plus `dy`'s length.
pub fn backward(
    config: &MoeConfig,
    tokens: &RoutedTokens,
    experts: &ExpertWeights,
    shared: Option<&SharedExpertWeights>,
    dy: &[bf16],
    options: ReferenceOptions,
) -> Result<(ReferenceForward, ReferenceGrads)> {
    let topk_weights = validate_bf16(config, tokens, experts, shared)?;
    backward_generic(config, &bf16_problem(tokens, &topk_weights, experts, shared), dy, options)
}

/// [`forward`] on a problem of any element type (f64 for finite differences).
pub fn forward_generic<E: Element>(
    config: &MoeConfig,
    problem: &Problem<'_, E>,
    options: ReferenceOptions,
) -> Result<ReferenceForward> {
    validate_problem(config, problem)?;
    Ok(forward::run(config, problem, options).public)
}

/// [`backward`] on a problem of any element type (f64 for finite differences); `dy` `[T, H]` of
/// any element type too.
pub fn backward_generic<E: Element, D: Element>(
    config: &MoeConfig,
    problem: &Problem<'_, E>,
    dy: &[D],
    options: ReferenceOptions,
) -> Result<(ReferenceForward, ReferenceGrads)> {
    validate_problem(config, problem)?;
    expect_len("dy", dy.len(), config.tokens_per_rank * config.hidden, "[T, H]")?;
    let state = forward::run(config, problem, options);
    let grads = backward::run(config, problem, &state, dy);
    Ok((state.public, grads))
}

/// `||actual - expected||_2 / ||expected||_2`, accumulated in f64.
///
/// Returns 0 when both are all zeros, infinity when only `expected` is, and NaN whenever either
/// side holds a NaN (so a NaN never passes a `< tol` check).
///
/// # Panics
/// If the two have different lengths: comparing misaligned tensors is a bug in the caller.
pub fn relative_error(actual: impl IntoIterator<Item = f64>, expected: &[f64]) -> f64 {
    let mut actual = actual.into_iter();
    let (mut diff2, mut ref2) = (0.0f64, 0.0f64);
    for (index, &e) in expected.iter().enumerate() {
        let Some(a) = actual.next() else {
            panic!("relative_error: actual has {index} elements, expected has {}", expected.len());
        };
        diff2 += (a - e) * (a - e);
        ref2 += e * e;
    }
    assert!(actual.next().is_none(), "relative_error: actual is longer than expected ({})", expected.len());
    if diff2.is_nan() || ref2.is_nan() {
        return f64::NAN;
    }
    if ref2 == 0.0 {
        return if diff2 == 0.0 { 0.0 } else { f64::INFINITY };
    }
    diff2.sqrt() / ref2.sqrt()
}
