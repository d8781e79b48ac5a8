//! Tile geometry of the grouped GEMMs and the device-side lookup from a flat tile index to its
//! group (expert), shared by the host (grid sizes) and the device (tile scheduling).

/// Rows (M) per GEMM block tile of the unfused path.
pub const GEMM_TILE_M: u32 = 64;
/// Columns (N) per GEMM block tile.
pub const GEMM_TILE_N: u32 = 64;
/// Depth (K) per shared-memory stage.
pub const GEMM_TILE_K: u32 = 32;
/// Threads per GEMM block: four warps, each owning a 32×32 quarter of the tile.
pub const GEMM_THREADS: u32 = 128;

/// Shared-memory row pitch of a GEMM stage in bf16: `GEMM_TILE_K` + 8 padding, so the fragment
/// loads of a warp (8 rows × 4 words) hit 32 distinct banks and rows stay 16-byte aligned.
pub const GEMM_SMEM_PITCH: u32 = GEMM_TILE_K + 8;
/// Dynamic shared memory of a GEMM block: one A and one B stage of 64 rows.
pub const GEMM_SMEM_BYTES: u32 = 2 * GEMM_TILE_M * GEMM_SMEM_PITCH * 2;

/// `ceil(n / d)`.
#[inline(always)]
pub const fn div_ceil(n: u32, d: u32) -> u32 {
    n.div_ceil(d)
}

/// Upper bound on the M tiles of a grouped GEMM over `total_rows` rows split into
/// `num_groups` groups: every group can leave one ragged tile.
#[inline]
pub const fn max_m_tiles(total_rows: u32, num_groups: u32) -> u32 {
    div_ceil(total_rows, GEMM_TILE_M) + num_groups
}

/// The group that owns flat tile `tile`, given `tile_offsets[0..=G]` (exclusive prefix sums of
/// the groups' tile counts), or `None` when `tile` is past the last tile.
///
/// Empty groups have equal neighbouring offsets; the search returns the last group whose offset
/// is `<= tile`, which skips them.
#[inline]
pub fn group_of_tile(tile_offsets: &[u32], tile: u32) -> Option<usize> {
    let groups = tile_offsets.len().checked_sub(1)?;
    if tile >= tile_offsets[groups] {
        return None;
    }
    // Binary search over 0..groups for the count of offsets <= tile.
    let (mut lo, mut hi) = (0usize, groups);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if tile_offsets[mid] <= tile { lo = mid + 1 } else { hi = mid }
    }
    Some(lo - 1)
}

/// The sm_90 engine's tile offsets for tiles of `tile_m` rows, from `row_offsets[0..=G]`:
/// `tile_offsets[0..=G]` the first tile of each group, then `tile_offsets[G+1..=2G+1]` the
/// number of groups before each whose tile count is odd (from which the engine counts its pairs
/// of blocks). `tile_offsets` holds `2 · (G + 1)` words: the exclusive prefix of
/// [`engine_group_counts`]. (`mok_tile_offsets` computes the same words with a warp:
/// [`warp_lane_span`], [`span_sums`], [`write_span_prefix`].)
pub fn engine_tile_offsets(row_offsets: &[u32], tile_m: u32, tile_offsets: &mut [u32]) {
    let groups = row_offsets.len() - 1;
    let (first_tiles, odd_before) = tile_offsets.split_at_mut(groups + 1);
    write_prefix(groups, (first_tiles, odd_before), |g| engine_group_counts(row_offsets, g, tile_m));
}

/// The exclusive prefix of the two counts `item(i)` over `items` items, then their totals:
/// `out.0[0..=items]` and `out.1[0..=items]` (one thread; a warp splits it into
/// [`span_sums`] and [`write_span_prefix`] per lane).
#[inline(always)]
pub fn write_prefix(items: usize, out: (&mut [u32], &mut [u32]), item: impl Fn(usize) -> (u32, u32)) {
    let (a, b) = out;
    (a[items], b[items]) = write_span_prefix(0, (0, 0), (&mut a[..items], &mut b[..items]), item);
}

/// Group `g`'s M tiles of height `tile_m`, and 1 if that count is odd: the two counts whose
/// exclusive prefix [`engine_tile_offsets`] writes.
#[inline(always)]
pub fn engine_group_counts(row_offsets: &[u32], g: usize, tile_m: u32) -> (u32, u32) {
    let tiles = (row_offsets[g + 1] - row_offsets[g]).div_ceil(tile_m);
    (tiles, tiles % 2)
}

/// The items `first..end` that lane `lane` of a warp takes when the warp prefixes `items`
/// together: runs of `⌈items / 32⌉` in lane order, so the lanes' exclusive prefix over their
/// runs' sums is each run's base.
#[inline(always)]
pub fn warp_lane_span(items: usize, lane: usize) -> (usize, usize) {
    let per = items.div_ceil(32);
    let first = (lane * per).min(items);
    (first, (first + per).min(items))
}

/// The sums of the two counts `item(i)` over items `first..end` (a lane's part of a warp's
/// prefix). Only loads where `item` loads: their latencies overlap.
#[inline(always)]
pub fn span_sums((first, end): (usize, usize), item: impl Fn(usize) -> (u32, u32)) -> (u32, u32) {
    let mut sums = (0u32, 0u32);
    for i in first..end {
        let (a, b) = item(i);
        sums = (sums.0 + a, sums.1 + b);
    }
    sums
}

/// The exclusive prefix of the two counts `item(i)` for items `first ..first + out.0.len()`,
/// starting from `before` (the sums over the items before `first`): `out.0[j]` and `out.1[j]`
/// are item `first + j`'s (the two slices as long). Returns the sums after the last of them.
#[inline(always)]
pub fn write_span_prefix(
    first: usize,
    mut before: (u32, u32),
    out: (&mut [u32], &mut [u32]),
    item: impl Fn(usize) -> (u32, u32),
) -> (u32, u32) {
    for (j, (a_out, b_out)) in out.0.iter_mut().zip(out.1.iter_mut()).enumerate() {
        (*a_out, *b_out) = before;
        let (a, b) = item(first + j);
        before = (before.0 + a, before.1 + b);
    }
    before
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn engine_tile_offsets_count_tiles_and_odd_groups() {
        // Rows per group: 300 (3 tiles), 0, 128 (1), 129 (2), 1 (1), tile height 128.
        let rows = [0, 300, 300, 428, 557, 558];
        let mut offsets = [u32::MAX; 12];
        engine_tile_offsets(&rows, 128, &mut offsets);
        assert_eq!(offsets, [0, 3, 3, 4, 6, 7, 0, 1, 1, 2, 2, 3]);
    }

    /// A warp's prefix of the two counts `item(i)` over `items` items (the decomposition of
    /// `mok_route_scan` and `mok_tile_offsets`), its 32 lanes run one after the other: each
    /// lane's sums, their exclusive prefix, each lane's writes, lane 0's totals at `[items]`.
    pub(crate) fn warp_prefix_lane_by_lane(items: usize, item: impl Fn(usize) -> (u32, u32) + Copy) -> [Vec<u32>; 2] {
        let mut out = [vec![u32::MAX; items + 1], vec![u32::MAX; items + 1]];
        let mut before = (0, 0);
        for lane in 0..32 {
            let (first, end) = warp_lane_span(items, lane);
            let sums = span_sums((first, end), item);
            let [a, b] = &mut out;
            let after = write_span_prefix(first, before, (&mut a[first..end], &mut b[first..end]), item);
            before = (before.0 + sums.0, before.1 + sums.1);
            assert_eq!(after, before, "a lane's writes end where its sums say");
        }
        (out[0][items], out[1][items]) = before;
        out
    }

    /// `mok_tile_offsets`' words, from [`warp_prefix_lane_by_lane`].
    fn warp_engine_tile_offsets(row_offsets: &[u32], tile_m: u32) -> Vec<u32> {
        let groups = row_offsets.len() - 1;
        warp_prefix_lane_by_lane(groups, |g| engine_group_counts(row_offsets, g, tile_m)).concat()
    }

    #[test]
    fn the_warp_decomposition_gives_the_serial_tile_offsets() {
        // Group counts around the lane count and the frontier shapes' expert counts, groups of
        // 0 to 700 rows.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for groups in [0, 1, 2, 5, 31, 32, 33, 63, 64, 65, 160, 256, 384, 512, 1000] {
            let mut rows = vec![0u32];
            for _ in 0..groups {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let last = *rows.last().unwrap();
                rows.push(last + (state % 701) as u32 * u32::from(!state.is_multiple_of(5)));
            }
            for tile_m in [64, 128] {
                let mut serial = vec![u32::MAX; 2 * (groups + 1)];
                engine_tile_offsets(&rows, tile_m, &mut serial);
                // Written out here, apart from the pieces both of them use.
                let (mut expected, mut tiles, mut odd) = (vec![0; 2 * (groups + 1)], 0, 0);
                for g in 0..=groups {
                    (expected[g], expected[groups + 1 + g]) = (tiles, odd);
                    if g < groups {
                        let group = (rows[g + 1] - rows[g]).div_ceil(tile_m);
                        tiles += group;
                        odd += group % 2;
                    }
                }
                assert_eq!(serial, expected, "{groups} groups, tile_m {tile_m}");
                assert_eq!(warp_engine_tile_offsets(&rows, tile_m), expected, "{groups} groups, tile_m {tile_m}");
            }
        }
        // Every lane's span, together, covers the items once, in order.
        for items in [0, 1, 31, 32, 33, 384, 1000] {
            let spans: Vec<_> = (0..32).map(|lane| warp_lane_span(items, lane)).collect();
            assert_eq!(spans[0].0, 0);
            assert_eq!(spans[31].1, items);
            assert!(spans.windows(2).all(|w| w[0].1 == w[1].0 && w[0].0 <= w[0].1), "{items}: {spans:?}");
        }
    }

    #[test]
    fn group_lookup_skips_empty_groups() {
        // Group sizes in tiles: 2, 0, 3, 0, 0, 1.
        let offsets = [0, 2, 2, 5, 5, 5, 6];
        let expected = [0, 0, 2, 2, 2, 5];
        for (tile, &group) in expected.iter().enumerate() {
            assert_eq!(group_of_tile(&offsets, tile as u32), Some(group), "tile {tile}");
        }
        assert_eq!(group_of_tile(&offsets, 6), None);
        assert_eq!(group_of_tile(&[0, 0, 0], 0), None);
        assert_eq!(group_of_tile(&[], 0), None);
    }

    #[test]
    fn max_tiles_bounds_every_split() {
        // Any split of 130 rows into 3 groups needs at most ceil(130/64) + 3 tiles.
        for a in 0..=130u32 {
            let b = (130 - a) / 2;
            let c = 130 - a - b;
            let tiles: u32 = [a, b, c].iter().map(|&r| div_ceil(r, GEMM_TILE_M)).sum();
            assert!(tiles <= max_m_tiles(130, 3));
        }
    }
}
