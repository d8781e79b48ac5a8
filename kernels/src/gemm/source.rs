//! The tile source: which tile a block computes next and what that tile is. Row-grouped
//! variants walk a device-written list (from the engine's tile offsets), taken from a per-plan
//! counter by a pair's first block; weight gradients walk `blockIdx.x + i·gridDim.x`.

use crate::gemm_layout::{
    GemmParams, PairTile, TILE_K, TILE_M, TILE_N, Variant, WORK_SLOT_WORDS, cluster_blocks, is_wgrad,
    pair_entries_list_before, pair_group_from, pair_tile, pair_tile_in_group, weight_gradient_tiles,
};
use crate::ptx::sreg;

/// One block tile of work (what a [`TileHooks`](super::hooks::TileHooks) hook is told).
#[derive(Clone, Copy)]
pub struct Work {
    pub(super) group: u32,
    /// Row-grouped: first row of the tile; weight gradient: first output row (M).
    pub(super) m0: u32,
    /// Row-grouped: valid rows (≤ 128). Weight gradient: output rows M (for bounds).
    pub(super) rows: u32,
    /// First output column.
    pub(super) n0: u32,
    /// False for the second block of an N-pair whose N tile is past the last (odd tile count).
    pub(super) has_columns: bool,
    /// An M-pair's tile: the two blocks take 128 rows each of one 256-row entry and split the
    /// loading of the weight tile they share; otherwise (an N-pair) they share the rows.
    pub(super) shares_weights: bool,
    /// The group's rows `[row_begin, row_end)` (the weight gradient's K range).
    pub(super) row_begin: u32,
    pub(super) row_end: u32,
    /// K blocks of segment 1, and of segments 1 + 2.
    pub(super) k_blocks_1: u32,
    pub(super) k_blocks: u32,
    /// The engine M tile holding the tile's rows (the index of the hooks' counters), where the
    /// producer worked it out ([`Work::with_m_tile`]); otherwise [`UNKNOWN_M_TILE`].
    pub(super) m_tile: u32,
}

/// [`Work::m_tile`] not worked out with the tile.
pub(super) const UNKNOWN_M_TILE: u32 = u32::MAX;

/// Whether `variant`'s consumers read each tile's [`Work`] from the stage's work slot, where
/// the producer wrote it, rather than looking it up themselves ([`work_of`]). Every variant
/// does but the standalone weight gradient: its lookup is a division and two loads that stay in
/// L1 (no acquire or async-proxy fence invalidates it there), and the nine words read from the
/// slot would stay live across its K loop, where the lookup's are recomputed (spilled, measured
/// in ptxas' report).
pub(super) const fn uses_work_slot(variant: u32) -> bool {
    variant != Variant::WGRAD
}

impl Work {
    /// `self` with its [`Work::m_tile`] worked out: the group's first M tile, plus the tile's
    /// place in the group.
    ///
    /// # Safety
    /// `self.group` is a group of `p`, whose tile offsets were written before the launch.
    #[inline(always)]
    pub(super) unsafe fn with_m_tile(self, p: &GemmParams) -> Work {
        // SAFETY: caller contract.
        let first = unsafe { tile_offset(p, self.group) };
        Work { m_tile: first + (self.m0 - self.row_begin) / TILE_M, ..self }
    }

    /// The work slot's words ([`Ring::work_slot`](super::ring::Ring::work_slot)): the fields in
    /// order, the two flags in one word, then padding.
    #[inline(always)]
    pub(super) fn packed(&self) -> [u32; WORK_SLOT_WORDS as usize] {
        let flags = self.has_columns as u32 | (self.shares_weights as u32) << 1;
        let (w, f) = (self, flags);
        [w.group, w.m0, w.rows, w.n0, w.row_begin, w.row_end, w.k_blocks_1, w.k_blocks, f, w.m_tile, 0, 0]
    }

    /// The inverse of [`Work::packed`].
    #[inline(always)]
    pub(super) fn unpacked(words: [u32; WORK_SLOT_WORDS as usize]) -> Work {
        let [group, m0, rows, n0, row_begin, row_end, k_blocks_1, k_blocks, flags, m_tile, ..] = words;
        Work {
            group,
            m0,
            rows,
            n0,
            has_columns: flags & 1 != 0,
            shares_weights: flags & 2 != 0,
            row_begin,
            row_end,
            k_blocks_1,
            k_blocks,
            m_tile,
        }
    }
}

#[inline(always)]
pub(super) fn n_tiles<const V: u32>(p: &GemmParams) -> u32 {
    // The SwiGLU tile produces 128 hidden columns (128 gate + 128 up accumulator columns).
    if V == Variant::GATE_UP { p.n.div_ceil(TILE_N / 2) } else { p.n.div_ceil(TILE_N) }
}

/// Number of tiles of the launch (from device-written offsets for row-grouped variants).
///
/// # Safety
/// Row-grouped variants: `p.tile_offsets` holds `2 · (groups + 1)` u32 written by the layout
/// (host contract of `run`); weight gradients read nothing.
#[inline(always)]
pub(super) unsafe fn tile_count<const V: u32>(p: &GemmParams) -> u32 {
    if is_wgrad(V) {
        weight_gradient_tiles(p.groups, p.m, p.n)
    } else {
        // The whole list: the entries before a group past the last (see [`pair_tile`]).
        // SAFETY: the list functions read i < 2 · (groups + 1) (caller contract of tile_count).
        let offset = |i| unsafe { tile_offset(p, i) };
        pair_entries_list_before(p.groups, p.groups, n_tiles::<V>(p), p.m_pairs != 0, &offset)
    }
}

/// Row-grouped variants: `tile_offsets[i]` (the list functions of `gemm_layout` read only
/// `i < 2 · (groups + 1)`).
///
/// # Safety
/// `i < 2 · (groups + 1)`, the length of the tile offsets (the host checks it: `RowGroups::check`).
#[inline(always)]
pub(super) unsafe fn tile_offset(p: &GemmParams, i: u32) -> u32 {
    // SAFETY: caller contract.
    unsafe { *(p.tile_offsets as *const u32).add(i as usize) }
}

/// What tile `tile` of the launch is: its group, rows, columns and K blocks.
///
/// # Safety
/// `tile < tile_count::<V>(p)` (so its group is below `groups`); `p.row_offsets` holds
/// `groups + 1` u32 and, row-grouped, `p.tile_offsets` as [`tile_count`] requires.
#[inline(always)]
pub(super) unsafe fn work_of<const V: u32>(p: &GemmParams, tile: u32) -> Work {
    // SAFETY: caller contract.
    unsafe { work_of_after::<V>(p, tile, None) }
}

/// [`work_of`], a row-grouped tile's group searched from `after`, the group of an earlier tile
/// of the same list (`gemm_layout::pair_group_from`: a producer's walk takes its tiles in
/// increasing order), or over all groups (`None`).
///
/// # Safety
/// As [`work_of`]; `after` is `None` or the group of a tile of this list at or before `tile`.
#[inline(always)]
pub(super) unsafe fn work_of_after<const V: u32>(p: &GemmParams, tile: u32, after: Option<u32>) -> Work {
    let offsets = p.row_offsets as *const u32;
    if is_wgrad(V) {
        let (m_tiles, nt) = (p.m.div_ceil(TILE_M), p.n.div_ceil(TILE_N));
        let group = tile / (m_tiles * nt);
        let within = tile % (m_tiles * nt);
        // SAFETY: group < groups.
        let (row_begin, row_end) = unsafe { (*offsets.add(group as usize), *offsets.add(group as usize + 1)) };
        let k_blocks = (row_end - row_begin).div_ceil(TILE_K);
        return Work {
            group,
            m0: within / nt * TILE_M,
            rows: p.m,
            n0: within % nt * TILE_N,
            has_columns: true,
            shares_weights: false,
            row_begin,
            row_end,
            k_blocks_1: k_blocks,
            k_blocks,
            m_tile: UNKNOWN_M_TILE,
        };
    }
    let nt = n_tiles::<V>(p);
    // SAFETY: pair_tile reads tile offsets i < 2 · (groups + 1) and row offsets of groups below
    // `groups` (host contract: the buffers' lengths).
    let offset = |i| unsafe { tile_offset(p, i) };
    // SAFETY: as above.
    let row_offset = |g: u32| unsafe { *offsets.add(g as usize) };
    let (groups, m_pairs) = (p.groups, p.m_pairs != 0);
    let PairTile { group, m0, n_tile, shares_weights } = match after {
        None => pair_tile(tile, pair_rank::<V>(), groups, nt, m_pairs, &offset, &row_offset),
        Some(from) => {
            let group = pair_group_from(tile, from, groups, nt, m_pairs, &offset);
            pair_tile_in_group(tile, group, pair_rank::<V>(), (groups, nt, m_pairs), &offset, &row_offset)
        }
    };
    // SAFETY: group < groups.
    let (begin, end) = unsafe { (*offsets.add(group as usize), *offsets.add(group as usize + 1)) };
    let n_width = if V == Variant::GATE_UP { TILE_N / 2 } else { TILE_N };
    let k_blocks_1 = p.k.div_ceil(TILE_K);
    Work {
        group,
        m0,
        rows: (end - m0).min(TILE_M),
        n0: n_tile * n_width,
        has_columns: n_tile < nt,
        shares_weights,
        row_begin: begin,
        row_end: end,
        k_blocks_1,
        k_blocks: k_blocks_1 + p.k2.div_ceil(TILE_K),
        m_tile: UNKNOWN_M_TILE,
    }
}

/// Both blocks of a pair (cluster ranks 0 and 1): the multicast mask of what they share (the
/// weight tile of an M-pair, the rows of an N-pair).
pub(super) const PAIR_MASK: u16 = 0b11;

/// This block's rank in its pair (0 for variants that run alone).
#[inline(always)]
pub(super) fn pair_rank<const V: u32>() -> u32 {
    if cluster_blocks(V) > 1 { sreg::cluster_rank() } else { 0 }
}
