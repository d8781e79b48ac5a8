//! The routing layout: where each (token, slot) row of a pass lives in expert order.
//!
//! Rows are grouped by expert; inside an expert they are ordered by token (and a token routes
//! to an expert at most once, so (expert, token) names a row, and the slot follows). Placement
//! is computed by counting and prefix sums, never by the arrival order of atomics, so the layout
//! is a pure function of `topk_ids` and every later reduction over rows has a fixed order.
//!
//! The computation is split in three data-parallel steps, each a function here that the device
//! kernels call per block or thread and the host composes in `mok-host` for its reference:
//! 1. [`rank_chunk`]: tokens are cut in chunks of [`ROUTE_CHUNK_TOKENS`]; inside a chunk, each
//!    slot gets its rank among the chunk's slots of the same expert, and the chunk gets its
//!    per-expert counts;
//! 2. [`scan_expert_column`] turns each expert's counts over chunks into chunk bases (exclusive
//!    prefix sums) and its total; [`expert_offsets`] prefixes the totals over experts;
//! 3. [`slot_position`]: a slot's row = its expert's offset + its chunk's base + its rank.

use crate::tiles::write_prefix;

/// Tokens per routing chunk: one block ranks one chunk sequentially (k·64 shared-memory
/// increments), and the chunk-count matrix stays small (T/64 × E).
pub const ROUTE_CHUNK_TOKENS: u32 = 64;

/// `slot_row` value of a dropped slot (id -1): it has no row.
pub const NO_ROW: u32 = u32::MAX;

/// Error code: an id outside `[-1, E)`; args are the flat slot index and the id.
pub const ROUTE_ERROR_ID_OUT_OF_RANGE: u32 = 1;
/// Error code: a token names the same expert twice; args are the flat slot index and the id.
pub const ROUTE_ERROR_DUPLICATE_ID: u32 = 2;

/// A problem found in `topk_ids` while ranking; the offending slot is treated as dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteError {
    /// [`ROUTE_ERROR_ID_OUT_OF_RANGE`] or [`ROUTE_ERROR_DUPLICATE_ID`].
    pub code: u32,
    /// Flat slot index `token * k + slot` within the ranked ids.
    pub slot_index: u32,
    /// The id found there.
    pub id: i32,
}

/// Number of routing chunks for `tokens` tokens.
#[inline(always)]
pub const fn chunk_count(tokens: u32) -> u32 {
    tokens.div_ceil(ROUTE_CHUNK_TOKENS)
}

/// The expert a slot is routed to, or `None` for a dropped or invalid slot (invalid ones are
/// reported by [`rank_chunk`]).
#[inline(always)]
pub fn routed_expert(id: i32, num_experts: u32) -> Option<u32> {
    if id >= 0 && (id as u32) < num_experts { Some(id as u32) } else { None }
}

/// Ranks the slots of one chunk: `ids` holds whole tokens (`ids.len() % k == 0`), `counts` has
/// one zeroed entry per expert and ends with the chunk's per-expert counts, `ranks[i]` gets the
/// number of earlier slots of the chunk routed to the same expert (unspecified for dropped
/// slots). Returns the first problem seen (its slot index relative to `ids`).
pub fn rank_chunk(
    ids: &[i32],
    k: usize,
    num_experts: u32,
    counts: &mut [u32],
    ranks: &mut [u32],
) -> Option<RouteError> {
    let mut first_error = None;
    let tokens = ids.chunks_exact(k).zip(ranks.chunks_exact_mut(k));
    for (token, (token_ids, token_ranks)) in tokens.enumerate() {
        for slot in 0..k {
            let id = token_ids[slot];
            let slot_index = (token * k + slot) as u32;
            token_ranks[slot] = 0;
            let Some(expert) = routed_expert(id, num_experts) else {
                if id != -1 && first_error.is_none() {
                    first_error = Some(RouteError { code: ROUTE_ERROR_ID_OUT_OF_RANGE, slot_index, id });
                }
                continue;
            };
            if token_ids[..slot].contains(&id) {
                // A second row for the same (expert, token) would break the ordering contract;
                // report it and drop the repeat.
                if first_error.is_none() {
                    first_error = Some(RouteError { code: ROUTE_ERROR_DUPLICATE_ID, slot_index, id });
                }
                continue;
            }
            token_ranks[slot] = counts[expert as usize];
            counts[expert as usize] += 1;
        }
    }
    first_error
}

/// Whether slot `slot` of a token's `token_ids` gets a row: a valid id not repeated earlier in
/// the token. Matches the rule of [`rank_chunk`].
#[inline]
pub fn slot_has_row(token_ids: &[i32], slot: usize, num_experts: u32) -> Option<u32> {
    let id = token_ids[slot];
    let expert = routed_expert(id, num_experts)?;
    if token_ids[..slot].contains(&id) { None } else { Some(expert) }
}

/// Chunks of an expert column whose counts [`scan_expert_column`] loads before it writes any of
/// their bases: the loads' latencies overlap (one after the other, a column of 128 chunks cost
/// ~50 µs at E = 384, the routing's longest step).
const SCAN_BATCH: usize = 8;

/// Replaces column `expert` of the chunk-count matrix (`[chunks][num_experts]`, row-major) by its
/// exclusive prefix sum over chunks (each chunk's base within the expert) and returns the
/// expert's total row count.
pub fn scan_expert_column(chunk_counts: &mut [u32], expert: usize, num_experts: usize, num_chunks: usize) -> u32 {
    let mut running = 0;
    let mut first = 0;
    while first < num_chunks {
        let mut counts = [0u32; SCAN_BATCH];
        for (i, count) in counts.iter_mut().enumerate() {
            if first + i < num_chunks {
                *count = chunk_counts[(first + i) * num_experts + expert];
            }
        }
        for (i, count) in counts.iter().enumerate() {
            if first + i < num_chunks {
                chunk_counts[(first + i) * num_experts + expert] = running;
                running += count;
            }
        }
        first += SCAN_BATCH;
    }
    running
}

/// Exclusive prefix sums over experts: `row_offsets[e]` is expert e's first row (with
/// `row_offsets[E]` the total), `tile_offsets[e]` its first M tile of height `tile_m`: the
/// exclusive prefix of [`expert_rows_and_tiles`]. (The routing's scan computes the same words
/// with a warp: `tiles::warp_lane_span`, `tiles::span_sums`, `tiles::write_span_prefix`.)
pub fn expert_offsets(counts: &[u32], row_offsets: &mut [u32], tile_offsets: &mut [u32], tile_m: u32) {
    write_prefix(counts.len(), (row_offsets, tile_offsets), |e| expert_rows_and_tiles(counts, e, tile_m));
}

/// Expert `e`'s rows and its M tiles of height `tile_m`: the two counts whose exclusive prefix
/// [`expert_offsets`] writes.
#[inline(always)]
pub fn expert_rows_and_tiles(counts: &[u32], e: usize, tile_m: u32) -> (u32, u32) {
    (counts[e], counts[e].div_ceil(tile_m))
}

/// The row of a slot: its expert's first row + its chunk's base in that expert + its rank.
#[inline(always)]
pub fn slot_position(expert_row_offset: u32, chunk_base: u32, rank_in_chunk: u32) -> u32 {
    expert_row_offset + chunk_base + rank_in_chunk
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiles::tests::warp_prefix_lane_by_lane;

    /// The whole layout on the CPU, composed from the step functions the kernels use.
    fn layout(ids: &[i32], tokens: usize, k: usize, experts: usize) -> (Vec<u32>, Vec<u32>) {
        let chunks = chunk_count(tokens as u32) as usize;
        let chunk_slots = ROUTE_CHUNK_TOKENS as usize * k;
        let mut chunk_counts = vec![0u32; chunks * experts];
        let mut ranks = vec![0u32; tokens * k];
        for c in 0..chunks {
            let range = c * chunk_slots..((c + 1) * chunk_slots).min(tokens * k);
            let counts = &mut chunk_counts[c * experts..(c + 1) * experts];
            assert!(rank_chunk(&ids[range.clone()], k, experts as u32, counts, &mut ranks[range]).is_none());
        }
        let totals: Vec<u32> =
            (0..experts).map(|e| scan_expert_column(&mut chunk_counts, e, experts, chunks)).collect();
        let mut row_offsets = vec![0; experts + 1];
        let mut tile_offsets = vec![0; experts + 1];
        expert_offsets(&totals, &mut row_offsets, &mut tile_offsets, 64);
        let mut slot_row = vec![NO_ROW; tokens * k];
        for t in 0..tokens {
            for j in 0..k {
                if let Some(e) = slot_has_row(&ids[t * k..(t + 1) * k], j, experts as u32) {
                    let c = t / ROUTE_CHUNK_TOKENS as usize;
                    let s = t * k + j;
                    slot_row[s] =
                        slot_position(row_offsets[e as usize], chunk_counts[c * experts + e as usize], ranks[s]);
                }
            }
        }
        (slot_row, row_offsets)
    }

    fn pseudo_random_ids(tokens: usize, k: usize, experts: usize, seed: u64) -> Vec<i32> {
        let mut state = seed;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut ids = Vec::new();
        for _ in 0..tokens {
            let mut row: Vec<i32> = Vec::new();
            while row.len() < k {
                let id = (next() % experts as u64) as i32;
                if !row.contains(&id) {
                    row.push(id);
                }
            }
            // Drop about one slot in eight.
            for id in row.iter_mut() {
                if next() % 8 == 0 {
                    *id = -1;
                }
            }
            ids.extend(row);
        }
        ids
    }

    #[test]
    fn rows_are_a_bijection_ordered_by_expert_then_token() {
        for &(tokens, k, experts) in &[(1, 1, 1), (1, 3, 5), (200, 4, 7), (130, 8, 64), (64, 2, 3)] {
            let ids = pseudo_random_ids(tokens, k, experts, 0x9e37_79b9_7f4a_7c15 ^ tokens as u64);
            let (slot_row, row_offsets) = layout(&ids, tokens, k, experts);
            let total = row_offsets[experts] as usize;
            assert_eq!(total, ids.iter().filter(|&&id| id >= 0).count());
            // Every row is taken by exactly one slot, and in (expert, token) order.
            let mut owner = vec![None; total];
            for (s, &row) in slot_row.iter().enumerate() {
                if ids[s] < 0 {
                    assert_eq!(row, NO_ROW);
                    continue;
                }
                assert!(owner[row as usize].is_none(), "row {row} taken twice");
                owner[row as usize] = Some((ids[s] as usize, s / k));
            }
            let order: Vec<(usize, usize)> = owner.into_iter().map(|o| o.expect("row left empty")).collect();
            assert!(order.windows(2).all(|w| w[0] < w[1]), "rows not in (expert, token) order");
            for e in 0..experts {
                for row in row_offsets[e]..row_offsets[e + 1] {
                    assert_eq!(order[row as usize].0, e);
                }
            }
        }
    }

    #[test]
    fn bad_ids_are_reported_with_their_slot() {
        let mut counts = [0u32; 4];
        let mut ranks = [0u32; 6];
        let error = rank_chunk(&[0, 1, 2, 2, 3, -1], 2, 4, &mut counts, &mut ranks).unwrap();
        assert_eq!(error, RouteError { code: ROUTE_ERROR_DUPLICATE_ID, slot_index: 3, id: 2 });
        assert_eq!(counts, [1, 1, 1, 1]);
        let mut counts = [0u32; 4];
        let error = rank_chunk(&[0, 7, 1, 2], 2, 4, &mut counts, &mut ranks[..4]).unwrap();
        assert_eq!(error, RouteError { code: ROUTE_ERROR_ID_OUT_OF_RANGE, slot_index: 1, id: 7 });
        let error = rank_chunk(&[0, -2], 2, 4, &mut [0; 4], &mut ranks[..2]).unwrap();
        assert_eq!(error.code, ROUTE_ERROR_ID_OUT_OF_RANGE);
    }

    #[test]
    fn the_warp_decomposition_gives_the_serial_expert_offsets() {
        // The routing scan's 32 lanes one after the other: each lane's sums, their exclusive
        // prefix, each lane's writes, then the totals.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for experts in [1, 2, 31, 32, 33, 160, 256, 384, 512, 1000] {
            let counts: Vec<u32> = (0..experts)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % 300) as u32 * u32::from(!state.is_multiple_of(4))
                })
                .collect();
            let (mut rows, mut tiles) = (vec![0; experts + 1], vec![0; experts + 1]);
            expert_offsets(&counts, &mut rows, &mut tiles, 128);
            // Written out here, apart from the pieces both of them use.
            let mut expected = (vec![0; experts + 1], vec![0; experts + 1]);
            for (e, &count) in counts.iter().enumerate() {
                expected.0[e + 1] = expected.0[e] + count;
                expected.1[e + 1] = expected.1[e] + count.div_ceil(128);
            }
            assert_eq!((&rows, &tiles), (&expected.0, &expected.1), "{experts} experts");
            let [warp_rows, warp_tiles] = warp_prefix_lane_by_lane(experts, |e| expert_rows_and_tiles(&counts, e, 128));
            assert_eq!((warp_rows, warp_tiles), (rows, tiles), "{experts} experts");
        }
    }

    #[test]
    fn a_column_scan_in_batches_is_the_running_sum() {
        // Column lengths around the batch, every column of a 3-expert matrix.
        for chunks in [0, 1, 7, 8, 9, 16, 17, 130] {
            let experts = 3;
            let matrix: Vec<u32> = (0..chunks * experts).map(|i| (i as u32 * 7919) % 13).collect();
            let mut scanned = matrix.clone();
            for e in 0..experts {
                let total = scan_expert_column(&mut scanned, e, experts, chunks);
                let mut running = 0;
                for c in 0..chunks {
                    assert_eq!(scanned[c * experts + e], running, "{chunks} chunks, expert {e}, chunk {c}");
                    running += matrix[c * experts + e];
                }
                assert_eq!(total, running);
            }
        }
    }

    #[test]
    fn offsets_count_tiles_per_expert() {
        let mut rows = [0; 5];
        let mut tiles = [0; 5];
        expert_offsets(&[0, 65, 64, 1], &mut rows, &mut tiles, 64);
        assert_eq!(rows, [0, 0, 65, 129, 130]);
        assert_eq!(tiles, [0, 0, 2, 3, 4]);
    }
}
