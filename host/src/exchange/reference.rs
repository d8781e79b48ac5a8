//! The schedule on the CPU, written directly from its definition (not from the device's
//! counting and prefix sums), so the GPU tests compare two independent implementations.
//!
//! Definition: owner r's ring holds, for each of its experts e = r·L + le in order, every
//! (source rank s, token t, slot j) with `topk_ids_s[t, j] == e` (a slot with a row: valid and
//! not a repeat within the token), ordered by (s, t) — the global token order. Each expert's rows
//! start a new GEMM M tile.

use mok_kernels::layout::slot_has_row;
use mok_kernels::tiles::GEMM_TILE_M;

use crate::error::{MokError, Result};

/// One expert owner's schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerSchedule {
    /// `[P][L]`: rows source rank s sends to local expert le, at `s·L + le`.
    pub counts: Vec<u32>,
    /// `[L+1]` first ring row of each local expert; the last entry is the row count.
    pub row_offsets: Vec<u32>,
    /// `[L+1]` first M tile of each local expert.
    pub tile_offsets: Vec<u32>,
    /// `[L·P+1]` first ring row of segment (le, s) at `le·P + s`; the row count last.
    pub recv_base: Vec<u32>,
    /// `(source rank, source slot t·k+j)` of each ring row.
    pub ring_source: Vec<(u32, u32)>,
}

/// Every owner's schedule for the ranks' `topk_ids` (`[T·k]` each, the same length on every rank)
/// over `num_experts` experts. Errors: no rank, `k == 0`, a rank's ids not a whole number of
/// tokens or of another length than rank 0's, or experts not divisible by the ranks.
pub fn reference_schedule(topk_ids: &[&[i32]], k: usize, num_experts: usize) -> Result<Vec<OwnerSchedule>> {
    let world = topk_ids.len();
    let bad = |problem: String| Err(MokError::InvalidInput { tensor: "topk_ids", problem });
    if world == 0 {
        return bad("no rank's ids given".into());
    }
    if k == 0 {
        return bad("top_k is 0".into());
    }
    if num_experts == 0 || num_experts > crate::config::MAX_EXPERTS || !num_experts.is_multiple_of(world) {
        return bad(format!(
            "{num_experts} experts cannot be split evenly over {world} ranks (1..={} experts)",
            crate::config::MAX_EXPERTS
        ));
    }
    for (rank, ids) in topk_ids.iter().enumerate() {
        if !ids.len().is_multiple_of(k) || ids.len() != topk_ids[0].len() {
            return bad(format!(
                "rank {rank} has {} ids: not a whole number of tokens of k = {k}, or not rank 0's {}",
                ids.len(),
                topk_ids[0].len()
            ));
        }
    }
    let local = num_experts / world;
    Ok((0..world)
        .map(|owner| {
            let mut counts = vec![0u32; world * local];
            let mut row_offsets = Vec::with_capacity(local + 1);
            let mut tile_offsets = Vec::with_capacity(local + 1);
            let mut recv_base = Vec::with_capacity(local * world + 1);
            let mut ring_source = Vec::new();
            let mut tiles = 0u32;
            for le in 0..local {
                let expert = (owner * local + le) as u32;
                row_offsets.push(ring_source.len() as u32);
                tile_offsets.push(tiles);
                let first = ring_source.len();
                for (source, ids) in topk_ids.iter().enumerate() {
                    recv_base.push(ring_source.len() as u32);
                    for (token, token_ids) in ids.chunks_exact(k).enumerate() {
                        for slot in 0..k {
                            if slot_has_row(token_ids, slot, num_experts as u32) == Some(expert) {
                                ring_source.push((source as u32, (token * k + slot) as u32));
                                counts[source * local + le] += 1;
                            }
                        }
                    }
                }
                tiles += ((ring_source.len() - first) as u32).div_ceil(GEMM_TILE_M);
            }
            row_offsets.push(ring_source.len() as u32);
            tile_offsets.push(tiles);
            recv_base.push(ring_source.len() as u32);
            OwnerSchedule { counts, row_offsets, tile_offsets, recv_base, ring_source }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use mok_kernels::comm::schedule::owner_offsets;

    #[test]
    fn definition_matches_the_prefix_sum_offsets() {
        // 2 ranks, 2 tokens each, k = 2, E = 4 (L = 2); a dropped slot and a repeated id.
        let r0 = [0, 3, 2, -1];
        let r1 = [3, 3, 1, 0];
        let schedules = reference_schedule(&[&r0, &r1], 2, 4).unwrap();
        let owner0 = &schedules[0];
        assert_eq!(owner0.ring_source, vec![(0, 0), (1, 3), (1, 2)]);
        assert_eq!(owner0.counts, vec![1, 0, 1, 1]);
        assert_eq!(owner0.row_offsets, vec![0, 2, 3]);
        assert_eq!(owner0.recv_base, vec![0, 1, 2, 2, 3]);
        assert_eq!(schedules[1].ring_source, vec![(0, 2), (0, 1), (1, 0)]);
        // The device's prefix sums over the same counts give the same offsets.
        for s in &schedules {
            let (mut rows, mut tiles, mut base) = (vec![0; 3], vec![0; 3], vec![0; 5]);
            owner_offsets(&s.counts, 2, 2, GEMM_TILE_M, &mut rows, &mut tiles, &mut base);
            assert_eq!((rows, tiles, base), (s.row_offsets.clone(), s.tile_offsets.clone(), s.recv_base.clone()));
        }
    }
}
