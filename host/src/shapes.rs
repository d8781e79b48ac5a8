//! The frontier shapes of BRIEF §3 and the layer's cost model (FLOPs, minimum bytes) used by
//! the demo, the benchmarks and docs/PERF.md.

use crate::config::MoeConfig;

/// One named MoE layer shape (per-rank T is chosen by the caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrontierShape {
    /// Short name (`kimi`, `glm`, `qwen`, `deepseek`).
    pub name: &'static str,
    /// Model name in the brief.
    pub model: &'static str,
    /// Experts E.
    pub experts: usize,
    /// Hidden H.
    pub hidden: usize,
    /// Intermediate I.
    pub intermediate: usize,
    /// Top-k.
    pub top_k: usize,
}

/// The four frontier shapes, from MoK's test suite.
pub const FRONTIER_SHAPES: [FrontierShape; 4] = [
    FrontierShape { name: "kimi", model: "kimi-k2.7", experts: 384, hidden: 7168, intermediate: 2048, top_k: 8 },
    FrontierShape { name: "glm", model: "glm-5.2", experts: 256, hidden: 6144, intermediate: 2048, top_k: 8 },
    FrontierShape { name: "qwen", model: "qwen3.5-397b", experts: 512, hidden: 4096, intermediate: 1024, top_k: 10 },
    FrontierShape {
        name: "deepseek",
        model: "deepseek-v4-pro",
        experts: 384,
        hidden: 7168,
        intermediate: 3072,
        top_k: 6,
    },
];

impl FrontierShape {
    /// Looks a shape up by short or model name.
    pub fn by_name(name: &str) -> Option<Self> {
        FRONTIER_SHAPES.iter().copied().find(|s| s.name == name || s.model == name)
    }

    /// A single-rank config with `tokens` tokens and no shared expert.
    pub fn config(&self, tokens: usize) -> MoeConfig {
        MoeConfig::new(tokens, self.hidden, self.intermediate, self.experts, self.top_k)
    }
}

/// Forward FLOPs, MoK's count: `6 · H · (T·k·I + T·Is)` (three GEMMs of 2·H·I per row), with
/// every slot counted as routed. Backward is twice this.
pub fn forward_flops(config: &MoeConfig) -> f64 {
    let (t, h, i, k) =
        (config.tokens_per_rank as f64, config.hidden as f64, config.intermediate as f64, config.top_k as f64);
    let shared = config.shared_intermediate.unwrap_or(0) as f64;
    6.0 * h * (t * k * i + t * shared)
}

/// The fewest bytes a forward pass must move through device memory: every weight read once
/// (bf16), x read once and y written once. Activations in between are not counted (a fused
/// kernel can keep them on chip).
pub fn forward_min_bytes(config: &MoeConfig) -> f64 {
    let (t, h, i) = (config.tokens_per_rank as f64, config.hidden as f64, config.intermediate as f64);
    let experts = config.local_experts() as f64;
    let shared = config.shared_intermediate.unwrap_or(0) as f64;
    2.0 * (3.0 * h * i * experts + 3.0 * h * shared) + 2.0 * 2.0 * t * h
}

/// Backward minimum bytes: weights read once, weight gradients written once (bf16), x, dy read
/// and dx written.
pub fn backward_min_bytes(config: &MoeConfig) -> f64 {
    let (t, h) = (config.tokens_per_rank as f64, config.hidden as f64);
    2.0 * (forward_min_bytes(config) - 4.0 * t * h) + 3.0 * 2.0 * t * h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kimi_numbers_match_the_brief() {
        let kimi = FrontierShape::by_name("kimi").unwrap().config(8192);
        // BRIEF §4: 5.77 TFLOP forward, 33.8 GB of routed weights.
        assert!((forward_flops(&kimi) / 1e12 - 5.77).abs() < 0.01);
        assert!((forward_min_bytes(&kimi) / 1e9 - 33.9).abs() < 0.2);
        assert_eq!(FrontierShape::by_name("deepseek-v4-pro").unwrap().intermediate, 3072);
        assert!(FrontierShape::by_name("nope").is_none());
    }
}
