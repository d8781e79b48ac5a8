//! Host-side tensors of one MoE layer problem (one rank's inputs, weights and gradients), and
//! their validation against a [`MoeConfig`].

use half::bf16;

use crate::config::MoeConfig;
use crate::error::{MokError, Result};

/// Routed experts' weights of one rank, `nn.Linear` layout (out, in), row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertWeights {
    /// `[E/P, I, H]`.
    pub w_gate: Vec<bf16>,
    /// `[E/P, I, H]`.
    pub w_up: Vec<bf16>,
    /// `[E/P, H, I]`.
    pub w_down: Vec<bf16>,
}

/// Shared expert's weights, `nn.Linear` layout.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedExpertWeights {
    /// `[Is, H]`.
    pub ws_gate: Vec<bf16>,
    /// `[Is, H]`.
    pub ws_up: Vec<bf16>,
    /// `[H, Is]`.
    pub ws_down: Vec<bf16>,
}

/// One rank's forward inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutedTokens {
    /// `[T, H]`.
    pub x: Vec<bf16>,
    /// `[T, k]`, each in `[0, E)` and distinct within a row, or -1 for a dropped slot.
    pub topk_ids: Vec<i32>,
    /// `[T, k]`.
    pub topk_weights: Vec<f32>,
}

/// Gradients of everything the layer reads, in f32 as computed (the GPU path rounds the bf16
/// ones to bf16; the CPU reference keeps them in full precision).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerGrads {
    /// `[T, H]`.
    pub dx: Vec<f32>,
    /// `[T, k]`; exactly 0 for dropped slots.
    pub d_topk_weights: Vec<f32>,
    /// `[E/P, I, H]`.
    pub dw_gate: Vec<f32>,
    /// `[E/P, I, H]`.
    pub dw_up: Vec<f32>,
    /// `[E/P, H, I]`.
    pub dw_down: Vec<f32>,
    /// Shared expert gradients `(dws_gate [Is,H], dws_up [Is,H], dws_down [H,Is])`.
    pub shared: Option<(Vec<f32>, Vec<f32>, Vec<f32>)>,
}

fn expect_len(tensor: &'static str, actual: usize, expected: usize, shape: &str) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(MokError::InvalidInput { tensor, problem: format!("has {actual} elements, expected {expected} ({shape})") })
    }
}

impl ExpertWeights {
    /// Checks the three tensors' sizes against `config`.
    pub fn validate(&self, config: &MoeConfig) -> Result<()> {
        config.validate()?;
        let (el, h, i) = (config.local_experts(), config.hidden, config.intermediate);
        expect_len("w_gate", self.w_gate.len(), el * i * h, "[E/P, I, H]")?;
        expect_len("w_up", self.w_up.len(), el * i * h, "[E/P, I, H]")?;
        expect_len("w_down", self.w_down.len(), el * h * i, "[E/P, H, I]")
    }
}

impl SharedExpertWeights {
    /// Checks sizes against `config`, which must declare a shared expert.
    pub fn validate(&self, config: &MoeConfig) -> Result<()> {
        config.validate()?;
        let Some(is) = config.shared_intermediate else {
            return Err(MokError::InvalidInput {
                tensor: "shared expert",
                problem: "weights given but config.shared_intermediate is None".into(),
            });
        };
        let h = config.hidden;
        expect_len("ws_gate", self.ws_gate.len(), is * h, "[Is, H]")?;
        expect_len("ws_up", self.ws_up.len(), is * h, "[Is, H]")?;
        expect_len("ws_down", self.ws_down.len(), h * is, "[H, Is]")
    }
}

impl RoutedTokens {
    /// Checks sizes, id range and duplicate ids within a token. Values are not checked: a NaN
    /// or infinite x or top-k weight propagates into y and the gradients (an accumulated f32
    /// weight gradient included) as IEEE arithmetic does, as in the PyTorch layer.
    pub fn validate(&self, config: &MoeConfig) -> Result<()> {
        config.validate()?;
        let (t, h, k) = (config.tokens_per_rank, config.hidden, config.top_k);
        expect_len("x", self.x.len(), t * h, "[T, H]")?;
        expect_len("topk_ids", self.topk_ids.len(), t * k, "[T, k]")?;
        expect_len("topk_weights", self.topk_weights.len(), t * k, "[T, k]")?;
        validate_topk_ids(&self.topk_ids, config.num_experts, k)
    }
}

/// Ids must be -1 or in `[0, num_experts)`, and distinct within each token's row of `k`; the ids
/// must be whole rows of `k > 0`.
pub fn validate_topk_ids(topk_ids: &[i32], num_experts: usize, k: usize) -> Result<()> {
    if k == 0 || !topk_ids.len().is_multiple_of(k) {
        return Err(MokError::InvalidInput {
            tensor: "topk_ids",
            problem: format!("{} ids are not a whole number of rows of k = {k} (k must be at least 1)", topk_ids.len()),
        });
    }
    for (token, row) in topk_ids.chunks_exact(k).enumerate() {
        for (slot, &id) in row.iter().enumerate() {
            if id < -1 || id >= num_experts as i32 {
                return Err(MokError::InvalidInput {
                    tensor: "topk_ids",
                    problem: format!(
                        "token {token} slot {slot} has expert id {id}, outside [0, {num_experts}) and not -1 (dropped)"
                    ),
                });
            }
            if id >= 0 && row[..slot].contains(&id) {
                return Err(MokError::InvalidInput {
                    tensor: "topk_ids",
                    problem: format!("token {token} names expert {id} twice (slot {slot} repeats an earlier slot)"),
                });
            }
        }
    }
    Ok(())
}
