//! The routing layout on the CPU, composed from the same step functions the device kernels run
//! (`mok_kernels::layout`), so the two agree by construction and the GPU tests can demand
//! exact equality.

use mok_kernels::layout::{self, NO_ROW, RouteError};
use mok_kernels::tiles::GEMM_TILE_M;

use crate::error::{MokError, Result};

/// Where every slot's row lives, by expert then token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingLayout {
    /// `[E]` rows per expert.
    pub expert_counts: Vec<u32>,
    /// `[E+1]` first row per expert; the last entry is the total.
    pub row_offsets: Vec<u32>,
    /// `[E+1]` first GEMM M tile per expert.
    pub tile_offsets: Vec<u32>,
    /// `[T·k]` row of each slot, [`NO_ROW`] for dropped ones.
    pub slot_row: Vec<u32>,
    /// `[total]` slot `t·k + j` of each row.
    pub row_source: Vec<u32>,
    /// The first invalid id found (its slot was dropped), as the device reports it.
    pub first_error: Option<RouteError>,
}

impl RoutingLayout {
    /// Computes the layout of `topk_ids` (`[tokens, k]`) over `num_experts` experts. Invalid ids
    /// are dropped and the first is reported in `first_error`, as on the device; a `k` of 0, ids
    /// that are not whole tokens, or more than `u32` rows are errors.
    pub fn compute(topk_ids: &[i32], k: usize, num_experts: usize) -> Result<Self> {
        if num_experts > crate::config::MAX_EXPERTS {
            return Err(MokError::InvalidInput {
                tensor: "num_experts",
                problem: format!("{num_experts} experts, more than {}", crate::config::MAX_EXPERTS),
            });
        }
        if k == 0
            || k > crate::config::MAX_TOP_K
            || !topk_ids.len().is_multiple_of(k)
            || u32::try_from(topk_ids.len()).is_err()
        {
            return Err(MokError::InvalidInput {
                tensor: "topk_ids",
                problem: format!(
                    "{} ids are not a whole number of tokens of k = {k} (1..={}) below 2^32 slots",
                    topk_ids.len(),
                    crate::config::MAX_TOP_K
                ),
            });
        }
        let tokens = topk_ids.len() / k;
        let chunks = layout::chunk_count(tokens as u32) as usize;
        let chunk_slots = layout::ROUTE_CHUNK_TOKENS as usize * k;
        let mut chunk_counts = vec![0u32; chunks * num_experts];
        let mut ranks = vec![0u32; tokens * k];
        let mut first_error = None;
        for chunk in 0..chunks {
            let slots = chunk * chunk_slots..((chunk + 1) * chunk_slots).min(tokens * k);
            let counts = &mut chunk_counts[chunk * num_experts..(chunk + 1) * num_experts];
            let found =
                layout::rank_chunk(&topk_ids[slots.clone()], k, num_experts as u32, counts, &mut ranks[slots.clone()]);
            if first_error.is_none()
                && let Some(mut error) = found
            {
                error.slot_index += slots.start as u32;
                first_error = Some(error);
            }
        }
        let expert_counts: Vec<u32> =
            (0..num_experts).map(|e| layout::scan_expert_column(&mut chunk_counts, e, num_experts, chunks)).collect();
        let mut row_offsets = vec![0; num_experts + 1];
        let mut tile_offsets = vec![0; num_experts + 1];
        layout::expert_offsets(&expert_counts, &mut row_offsets, &mut tile_offsets, GEMM_TILE_M);
        let mut slot_row = vec![NO_ROW; tokens * k];
        let mut row_source = vec![0; row_offsets[num_experts] as usize];
        for token in 0..tokens {
            let ids = &topk_ids[token * k..(token + 1) * k];
            let chunk = token / layout::ROUTE_CHUNK_TOKENS as usize;
            for slot in 0..k {
                if let Some(expert) = layout::slot_has_row(ids, slot, num_experts as u32) {
                    let s = token * k + slot;
                    let row = layout::slot_position(
                        row_offsets[expert as usize],
                        chunk_counts[chunk * num_experts + expert as usize],
                        ranks[s],
                    );
                    slot_row[s] = row;
                    row_source[row as usize] = s as u32;
                }
            }
        }
        Ok(Self { expert_counts, row_offsets, tile_offsets, slot_row, row_source, first_error })
    }
}
