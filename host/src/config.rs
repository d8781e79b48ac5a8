//! The MoE layer's configuration, validated before anything runs.

use crate::error::{MokError, Result};

/// Shape of one MoE layer on one expert-parallel rank (BRIEF §2).
///
/// `tokens_per_rank` tokens of width `hidden` are routed to `top_k` of `num_experts` experts of
/// intermediate width `intermediate`; experts are split evenly over `ep_ranks` ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Tokens held by each rank (T ≥ 1, the same on every rank).
    pub tokens_per_rank: usize,
    /// Model width H.
    pub hidden: usize,
    /// Routed experts' intermediate width I.
    pub intermediate: usize,
    /// Experts in total, E (E % P == 0).
    pub num_experts: usize,
    /// Slots per token, k (1 ≤ k ≤ E).
    pub top_k: usize,
    /// Expert-parallel degree P (≥ 1).
    pub ep_ranks: usize,
    /// Shared expert's intermediate width Is, or `None` for no shared expert.
    pub shared_intermediate: Option<usize>,
    /// Optional SwiGLU clamp L > 0: gate = min(gate, L), up = clamp(up, -L, L).
    pub swiglu_limit: Option<f32>,
}

/// Row widths (H, I, Is) must be multiples of this many bf16 elements, so every row starts on a
/// 16-byte boundary: the kernels move rows with 16-byte vector loads and stores, and Hopper's
/// tensor-memory-accelerator descriptors require 16-byte multiples for row strides.
pub const ROW_ALIGN_ELEMS: usize = 8;

/// Most experts a layer may have: the routing kernel counts a token chunk's slots per expert in
/// shared memory (4 bytes each, 32 KiB).
pub const MAX_EXPERTS: usize = 8192;

/// Largest k accepted: the routing kernel checks a token's ids for duplicates in O(k²) steps,
/// and the megakernels' combines hold a token's slots two per lane.
pub const MAX_TOP_K: usize = 64;
const _: () = assert!(MAX_TOP_K <= mok_kernels::megakernel_layout::MAX_COMBINE_SLOTS as usize);
/// The widest hidden, intermediate or shared-expert width: far above any model's, and low
/// enough that a row's bytes, its bulk copies' byte counts (32-bit on the device) and the
/// unfused GEMMs' `grid.y` (64 columns per block, at most 65 535) never overflow.
pub const MAX_WIDTH: usize = 1 << 20;

impl MoeConfig {
    /// A config with no shared expert and no SwiGLU limit, on one rank.
    pub fn new(tokens_per_rank: usize, hidden: usize, intermediate: usize, num_experts: usize, top_k: usize) -> Self {
        Self {
            tokens_per_rank,
            hidden,
            intermediate,
            num_experts,
            top_k,
            ep_ranks: 1,
            shared_intermediate: None,
            swiglu_limit: None,
        }
    }

    /// Experts per rank, E / P.
    pub fn local_experts(&self) -> usize {
        // 0 for ep_ranks = 0, which `validate` rejects: callers may ask before validating.
        self.num_experts.checked_div(self.ep_ranks).unwrap_or(0)
    }

    /// Routing slots per rank, T · k (an upper bound on the rows any expert group can hold).
    pub fn slots_per_rank(&self) -> usize {
        self.tokens_per_rank.saturating_mul(self.top_k)
    }

    /// Checks every field; the error names the first bad field, its value and the rule.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: String, rule: &str| -> Result<()> {
            Err(MokError::InvalidConfig { field, value, rule: rule.to_string() })
        };
        if self.tokens_per_rank == 0 {
            return bad("tokens_per_rank", "0".into(), "must be at least 1");
        }
        if self.tokens_per_rank > i32::MAX as usize / self.top_k.max(1) {
            return bad(
                "tokens_per_rank",
                self.tokens_per_rank.to_string(),
                "tokens_per_rank * top_k must fit in i32 (row indices are 32-bit on the device)",
            );
        }
        check_ep_ranks(self.ep_ranks)?;
        if self.num_experts == 0 {
            return bad("num_experts", "0".into(), "must be at least 1");
        }
        if !self.num_experts.is_multiple_of(self.ep_ranks) {
            return bad(
                "num_experts",
                self.num_experts.to_string(),
                &format!("must be a multiple of ep_ranks = {} (experts are split evenly over ranks)", self.ep_ranks),
            );
        }
        if self.num_experts > MAX_EXPERTS {
            return bad(
                "num_experts",
                self.num_experts.to_string(),
                &format!(
                    "must be at most {MAX_EXPERTS} (the routing kernel keeps one counter per expert in 32 KiB of shared memory)"
                ),
            );
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            return bad(
                "top_k",
                self.top_k.to_string(),
                &format!("must be in 1..={} (num_experts; ids within a token are distinct)", self.num_experts),
            );
        }
        if self.top_k > MAX_TOP_K {
            return bad("top_k", self.top_k.to_string(), &format!("must be at most {MAX_TOP_K}"));
        }
        let row_rule = format!(
            "must be a positive multiple of {ROW_ALIGN_ELEMS}: rows are moved as 16-byte vectors (8 bf16) and TMA needs 16-byte row strides"
        );
        if self.hidden == 0 || !self.hidden.is_multiple_of(ROW_ALIGN_ELEMS) {
            return bad("hidden", self.hidden.to_string(), &row_rule);
        }
        if self.intermediate == 0 || !self.intermediate.is_multiple_of(ROW_ALIGN_ELEMS) {
            return bad("intermediate", self.intermediate.to_string(), &row_rule);
        }
        if let Some(is) = self.shared_intermediate
            && (is == 0 || !is.is_multiple_of(ROW_ALIGN_ELEMS))
        {
            return bad("shared_intermediate", is.to_string(), &row_rule);
        }
        let width_rule = format!("must be at most {MAX_WIDTH} (row byte counts are 32-bit on the device)");
        for (field, width) in [
            ("hidden", self.hidden),
            ("intermediate", self.intermediate),
            ("shared_intermediate", self.shared_intermediate.unwrap_or(0)),
        ] {
            if width > MAX_WIDTH {
                return bad(field, width.to_string(), &width_rule);
            }
        }
        // The routing layout's per-chunk expert counts are indexed in 32 bits on the device.
        let chunks = self.tokens_per_rank.div_ceil(mok_kernels::layout::ROUTE_CHUNK_TOKENS as usize);
        if chunks.checked_mul(self.num_experts).is_none_or(|n| n > 1 << 32) {
            return bad(
                "tokens_per_rank",
                self.tokens_per_rank.to_string(),
                &format!(
                    "its {chunks} routing chunks of {} tokens times num_experts = {} must be at most 2^32 (the \
                     routing's per-chunk expert counts are indexed in 32 bits on the device)",
                    mok_kernels::layout::ROUTE_CHUNK_TOKENS,
                    self.num_experts
                ),
            );
        }
        if let Some(limit) = self.swiglu_limit
            && !(limit.is_finite() && limit > 0.0)
        {
            return bad("swiglu_limit", limit.to_string(), "must be finite and > 0 (or None for no clamp)");
        }
        // Every tensor's element count must be a number: rows are indexed in 32 bits on the
        // device, and the host computes byte sizes in usize.
        let (t, h, i, k) = (self.tokens_per_rank, self.hidden, self.intermediate, self.top_k);
        let product = |factors: &[usize]| factors.iter().try_fold(1usize, |n, &f| n.checked_mul(f));
        if product(&[self.ep_ranks, t, k, h.max(i), 4]).is_none()
            || product(&[t, h]).is_none_or(|n| n > i64::MAX as usize / 4)
        {
            return bad(
                "tokens_per_rank",
                t.to_string(),
                "ep_ranks * tokens_per_rank * top_k * max(hidden, intermediate) f32 bytes must fit in usize",
            );
        }
        if product(&[self.local_experts(), i, h, 4]).is_none() {
            return bad(
                "intermediate",
                i.to_string(),
                "local experts * intermediate * hidden f32 bytes (a weight gradient) must fit in usize",
            );
        }
        if let Some(is) = self.shared_intermediate
            && product(&[is, h, 4]).is_none()
        {
            return bad(
                "shared_intermediate",
                is.to_string(),
                "shared_intermediate * hidden f32 bytes must fit in usize",
            );
        }
        Ok(())
    }
}

/// The longest wait the kernels are given, in nanoseconds (2^60: about 36 years). A longer
/// timeout is this one: the device adds a wait's deadline, up to twice it, to `%globaltimer`, and
/// that sum must not wrap.
pub const MAX_WAIT_NS: u64 = 1 << 60;

/// `timeout` as the kernels' wait deadline in nanoseconds, at most [`MAX_WAIT_NS`].
pub fn wait_ns(timeout: std::time::Duration) -> u64 {
    timeout.as_nanos().min(MAX_WAIT_NS as u128) as u64
}

/// The rule for an expert-parallel rank count (a config's `ep_ranks`, a heap's world): 1 to the
/// kernels' peer table's size.
pub(crate) fn check_ep_ranks(ranks: usize) -> Result<()> {
    let max = mok_kernels::comm::params::MAX_EP_RANKS;
    if ranks == 0 || ranks > max {
        return Err(MokError::InvalidConfig {
            field: "ep_ranks",
            value: ranks.to_string(),
            rule: format!("must be in 1..={max} (the kernels' peer table has {max} entries)"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_deadlines_are_capped_so_the_device_sums_do_not_wrap() {
        use std::time::Duration;
        assert_eq!(wait_ns(Duration::from_secs(5)), 5_000_000_000);
        assert_eq!(wait_ns(Duration::MAX), MAX_WAIT_NS);
        assert_eq!(wait_ns(Duration::from_secs(400 * 365 * 86_400)), MAX_WAIT_NS);
        // The longest downstream deadline plus a %globaltimer of the year 2400 still fits.
        let longest = mok_kernels::megakernel_layout::downstream_deadline(MAX_WAIT_NS, 31);
        let year_2400_ns = 430 * 365 * 86_400 * 1_000_000_000u64;
        assert!(longest.checked_add(year_2400_ns).is_some());
    }

    fn field_of(err: MokError) -> &'static str {
        match err {
            MokError::InvalidConfig { field, .. } => field,
            other => panic!("expected InvalidConfig, got {other}"),
        }
    }

    #[test]
    fn valid_config_passes() {
        let mut c = MoeConfig::new(7, 64, 32, 8, 2);
        c.ep_ranks = 4;
        c.shared_intermediate = Some(16);
        c.swiglu_limit = Some(7.0);
        c.validate().unwrap();
    }

    #[test]
    fn each_bad_field_is_named() {
        let base = MoeConfig::new(7, 64, 32, 8, 2);
        let cases: Vec<(MoeConfig, &str)> = vec![
            (MoeConfig { tokens_per_rank: 0, ..base.clone() }, "tokens_per_rank"),
            (MoeConfig { ep_ranks: 3, ..base.clone() }, "num_experts"),
            (MoeConfig { ep_ranks: 0, ..base.clone() }, "ep_ranks"),
            (MoeConfig { ep_ranks: 256, ..MoeConfig::new(7, 64, 32, 8192, 2) }, "ep_ranks"),
            (MoeConfig { top_k: 9, ..base.clone() }, "top_k"),
            (MoeConfig { top_k: 0, ..base.clone() }, "top_k"),
            (MoeConfig { hidden: 60, ..base.clone() }, "hidden"),
            (MoeConfig { intermediate: 12, ..base.clone() }, "intermediate"),
            (MoeConfig { shared_intermediate: Some(4), ..base.clone() }, "shared_intermediate"),
            (MoeConfig { swiglu_limit: Some(-1.0), ..base.clone() }, "swiglu_limit"),
            (MoeConfig { swiglu_limit: Some(f32::NAN), ..base.clone() }, "swiglu_limit"),
            (MoeConfig { hidden: MAX_WIDTH + 8, ..base.clone() }, "hidden"),
            (MoeConfig { intermediate: MAX_WIDTH + 8, ..base.clone() }, "intermediate"),
            (MoeConfig { shared_intermediate: Some(MAX_WIDTH + 8), ..base.clone() }, "shared_intermediate"),
            // 524 289 routing chunks of 8192 experts: past 2^32 per-chunk counts.
            (MoeConfig { tokens_per_rank: 64 * 524_289, ..MoeConfig::new(1, 64, 32, 8192, 1) }, "tokens_per_rank"),
        ];
        for (config, field) in cases {
            let err = config.validate().expect_err(field);
            let text = err.to_string();
            assert_eq!(field_of(err), field, "{text}");
        }
    }

    #[test]
    fn the_limits_themselves_pass() {
        MoeConfig::new(1, MAX_WIDTH, MAX_WIDTH, 8, 2).validate().unwrap();
        // 524 288 routing chunks of 8192 experts: exactly 2^32 per-chunk counts, the last index
        // 2^32 - 1.
        let mut most = MoeConfig::new(64 * 524_288, 64, 32, 8192, 1);
        most.validate().unwrap_or_else(|e| panic!("{e}"));
        most.tokens_per_rank += 1;
        assert_eq!(field_of(most.validate().unwrap_err()), "tokens_per_rank");
    }

    #[test]
    fn error_message_names_value_and_rule() {
        let text = MoeConfig::new(7, 60, 32, 8, 2).validate().unwrap_err().to_string();
        assert!(text.contains("hidden = 60") && text.contains("multiple of 8"), "{text}");
    }
}
