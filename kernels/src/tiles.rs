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

#[cfg(test)]
mod tests {
    use super::*;

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
