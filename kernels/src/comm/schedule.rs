//! The expert-parallel schedule: where every (source rank, token, slot) row lands in its expert
//! owner's receive ring, and the index math the movers use to walk it. Pure functions, compiled
//! for the host (CPU tests, the host's reference) and the device (the schedule kernels).
//!
//! Each source rank s first lays out its own slots with the single-rank routing layout
//! ([`crate::layout`]): per expert e, `expert_counts_s[e]` rows in token order starting at
//! `row_offsets_s[e]`, with `row_source_s` naming each row's slot. The owner r of local experts
//! `le = 0..L` (global `e = r·L + le`) reads `counts[s][le] = expert_counts_s[r·L + le]` from
//! every rank and places the segments with prefix sums, experts outer and source ranks inner:
//!
//! ```text
//! ring rows:  | e=rL+0: s=0 | s=1 | ... | s=P-1 | e=rL+1: s=0 | ... |
//! ```
//!
//! Inside a segment rows keep the source's token order, so an expert's rows are ordered by
//! global token index (rank, token) — the rows and the order a single rank holding every expert
//! would have, which is what makes the layer's results independent of P. Nothing depends on the
//! arrival order of atomics. Each expert's rows also own whole GEMM M tiles (`tile_offsets`): a
//! tile never mixes two experts, so one counter per tile says when a tile's rows have landed.

use crate::layout::slot_has_row;
use crate::tiles::group_of_tile;

/// The rank that owns expert `expert` when each rank holds `local_experts` experts.
#[inline(always)]
pub const fn owner_of_expert(expert: u32, local_experts: u32) -> u32 {
    expert / local_experts
}

/// The owner's offsets from the exchanged counts. `counts` is `[P][L]` row-major
/// (`counts[s·L + le]`); writes `row_offsets[L+1]` (first ring row of each local expert, total
/// last), `tile_offsets[L+1]` (first M tile of height `tile_m`), `recv_base[L·P+1]` (first ring
/// row of segment `(le, s)` at `le·P + s`, total last). Returns the ring's row count.
pub fn owner_offsets(
    counts: &[u32],
    world: usize,
    local: usize,
    tile_m: u32,
    row_offsets: &mut [u32],
    tile_offsets: &mut [u32],
    recv_base: &mut [u32],
) -> u32 {
    let (mut rows, mut tiles) = (0u32, 0u32);
    for le in 0..local {
        row_offsets[le] = rows;
        tile_offsets[le] = tiles;
        let mut expert_rows = 0u32;
        for s in 0..world {
            recv_base[le * world + s] = rows + expert_rows;
            expert_rows += counts[s * local + le];
        }
        rows += expert_rows;
        tiles += expert_rows.div_ceil(tile_m);
    }
    row_offsets[local] = rows;
    tile_offsets[local] = tiles;
    recv_base[local * world] = rows;
    rows
}

/// The segment `le·P + s` holding ring row `row` and the row's position in it, or `None` past
/// the last row. Empty segments are skipped (binary search, as for tiles).
#[inline]
pub fn ring_segment(recv_base: &[u32], row: u32) -> Option<(usize, u32)> {
    let segment = group_of_tile(recv_base, row)?;
    Some((segment, row - recv_base[segment]))
}

/// The M tile that holds ring row `row`: its expert's first tile plus the row's tile within the
/// expert. `None` past the last row.
#[inline]
pub fn tile_of_row(row_offsets: &[u32], tile_offsets: &[u32], row: u32, tile_m: u32) -> Option<u32> {
    let expert = group_of_tile(row_offsets, row)?;
    Some(tile_offsets[expert] + (row - row_offsets[expert]) / tile_m)
}

/// Rows of M tile `tile` (≤ `tile_m`), or `None` past the last tile.
#[inline]
pub fn rows_in_tile(row_offsets: &[u32], tile_offsets: &[u32], tile: u32, tile_m: u32) -> Option<u32> {
    let expert = group_of_tile(tile_offsets, tile)?;
    let first = row_offsets[expert] + (tile - tile_offsets[expert]) * tile_m;
    Some((row_offsets[expert + 1] - first).min(tile_m))
}

/// The M tile holding row `row` and that tile's rows: [`tile_of_row`] and [`rows_in_tile`] of
/// it, from one search (the row's group is the tile's). `None` past the last row.
#[inline]
pub fn tile_and_rows_of_row(row_offsets: &[u32], tile_offsets: &[u32], row: u32, tile_m: u32) -> Option<(u32, u32)> {
    let group = group_of_tile(row_offsets, row)?;
    let tile_in_group = (row - row_offsets[group]) / tile_m;
    let first = row_offsets[group] + tile_in_group * tile_m;
    Some((tile_offsets[group] + tile_in_group, (row_offsets[group + 1] - first).min(tile_m)))
}

/// Rows that the token tile `ids` (whole tokens of `k` slots) sends to rank `rank`: the rows
/// whose combine results `rank` pushes back, i.e. what the token owner waits for from it.
#[inline]
pub fn chunk_rows_for_rank(ids: &[i32], k: usize, num_experts: u32, local_experts: u32, rank: u32) -> u32 {
    let mut rows = 0;
    for token in ids.chunks_exact(k) {
        for slot in 0..k {
            if let Some(expert) = slot_has_row(token, slot, num_experts)
                && owner_of_expert(expert, local_experts) == rank
            {
                rows += 1;
            }
        }
    }
    rows
}

/// Whether an epoch flag holding `value` has reached epoch `target` (wrapping: epochs are u32
/// and may wrap in a long job; a peer may also already be one epoch ahead).
#[inline(always)]
pub const fn epoch_reached(value: u32, target: u32) -> bool {
    (value.wrapping_sub(target) as i32) >= 0
}

/// Whether a monotonic arrival counter holding `value` has grown by `expected` since the
/// waiter's baseline `base` (wrapping: the counter is never reset while ranks run).
#[inline(always)]
pub const fn arrivals_reached(value: u32, base: u32, expected: u32) -> bool {
    value.wrapping_sub(base) >= expected
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_put_segments_expert_major_then_rank() {
        // P = 3 source ranks, L = 2 local experts; counts[s][le].
        let counts = [2, 0, /* s1 */ 5, 1, /* s2 */ 0, 3];
        let (mut rows, mut tiles, mut base) = ([0; 3], [0; 3], [0; 7]);
        let total = owner_offsets(&counts, 3, 2, 4, &mut rows, &mut tiles, &mut base);
        assert_eq!(total, 11);
        assert_eq!(rows, [0, 7, 11]);
        assert_eq!(tiles, [0, 2, 3]);
        assert_eq!(base, [0, 2, 7, 7, 7, 8, 11]);
        // Row 6 is the 5th row from s1 for expert 0; row 7 the first of s1 for expert 1.
        assert_eq!(ring_segment(&base, 6), Some((1, 4)));
        assert_eq!(ring_segment(&base, 7), Some((4, 0)));
        assert_eq!(ring_segment(&base, 8), Some((5, 0)));
        assert_eq!(ring_segment(&base, 11), None);
        assert_eq!(tile_of_row(&rows, &tiles, 3, 4), Some(0));
        assert_eq!(tile_of_row(&rows, &tiles, 4, 4), Some(1));
        assert_eq!(tile_of_row(&rows, &tiles, 7, 4), Some(2));
        assert_eq!(rows_in_tile(&rows, &tiles, 0, 4), Some(4));
        assert_eq!(rows_in_tile(&rows, &tiles, 1, 4), Some(3));
        assert_eq!(rows_in_tile(&rows, &tiles, 2, 4), Some(4));
        assert_eq!(rows_in_tile(&rows, &tiles, 3, 4), None);
    }

    #[test]
    fn every_row_belongs_to_one_tile_and_tiles_sum_to_rows() {
        let counts = [3, 0, 64, 1, 0, 0, 65, 2, 7];
        let (world, local) = (3, 3);
        let (mut rows, mut tiles, mut base) = ([0; 4], [0; 4], [0; 10]);
        let total = owner_offsets(&counts, world, local, 64, &mut rows, &mut tiles, &mut base);
        let mut per_tile = vec![0u32; tiles[local] as usize];
        for row in 0..total {
            per_tile[tile_of_row(&rows, &tiles, row, 64).unwrap() as usize] += 1;
        }
        for (tile, &n) in per_tile.iter().enumerate() {
            assert_eq!(Some(n), rows_in_tile(&rows, &tiles, tile as u32, 64));
        }
    }

    #[test]
    fn one_search_finds_the_two_searches_tile_and_rows() {
        // Groups of 0 to 300 rows (empty ones among them), tiles of 1, 64 and 128 rows.
        let counts: Vec<u32> = (0..97u32).map(|g| (g * 37 + g * g * 11) % 301 * u32::from(g % 5 != 2)).collect();
        for tile_m in [1, 64, 128] {
            let groups = counts.len();
            let (mut rows, mut tiles, mut base) = (vec![0; groups + 1], vec![0; groups + 1], vec![0; groups + 1]);
            let total = owner_offsets(&counts, 1, groups, tile_m, &mut rows, &mut tiles, &mut base);
            for row in 0..total {
                let tile = tile_of_row(&rows, &tiles, row, tile_m).unwrap();
                let expected = (tile, rows_in_tile(&rows, &tiles, tile, tile_m).unwrap());
                assert_eq!(tile_and_rows_of_row(&rows, &tiles, row, tile_m), Some(expected), "row {row}");
            }
            assert_eq!(tile_and_rows_of_row(&rows, &tiles, total, tile_m), None);
        }
    }

    #[test]
    fn counters_compare_across_wrap() {
        assert!(epoch_reached(5, 5) && epoch_reached(6, 5) && !epoch_reached(4, 5));
        assert!(epoch_reached(1, u32::MAX) && !epoch_reached(u32::MAX, 1));
        assert!(arrivals_reached(10, 3, 7) && !arrivals_reached(9, 3, 7));
        assert!(arrivals_reached(2, u32::MAX - 1, 4) && !arrivals_reached(1, u32::MAX - 1, 4));
    }

    #[test]
    fn chunk_rows_count_by_owner() {
        // 2 tokens, k = 3, E = 4 on 2 ranks (L = 2); a dropped slot and a repeated id.
        let ids = [0, 3, -1, 2, 2, 1];
        assert_eq!(chunk_rows_for_rank(&ids, 3, 4, 2, 0), 2);
        assert_eq!(chunk_rows_for_rank(&ids, 3, 4, 2, 1), 2);
    }
}
