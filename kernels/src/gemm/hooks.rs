//! What a persistent kernel adds around each engine tile: a bounded wait before the producer
//! loads a tile's rows, and a signal once a consumer warpgroup's output of the tile is visible.
//!
//! The standalone GEMM kernels run with [`Standalone`], whose hooks are empty, so they compile
//! to exactly the code they had before the hooks existed. [`Counters`] is the hand-over of the
//! megakernel: per engine M tile (the one tile vocabulary: the tile offsets' 128-row tiles,
//! counted over all groups), a `rows_landed` flag that the comm side sets to the pass's epoch
//! once every row of that tile is in place, and a `tiles_stored` count that each consumer
//! warpgroup bumps once its part of the tile's output is visible. The counts are cleared in
//! stream order before the pass (only this GPU's blocks add to them), so a tile of `r` rows with
//! `n` N tiles is complete at `n · ⌈r / 64⌉`.

use crate::comm::error::{self, ERROR_TIMEOUT, WAIT_ENGINE_TILE_ROWS};
use crate::comm::schedule::epoch_reached;
use crate::comm::wait::{signal, wait_until};
use crate::gemm_layout::{GemmParams, TILE_M, TileCounters, Variant};
use crate::ptx::bulk;
use crate::ptx::memory::fence_proxy_async_global;

use super::source::{Work, tile_offset};

/// The two places a persistent kernel hooks into a tile.
pub trait TileHooks: Copy {
    /// The producer thread of each block (both blocks of a pair), before the first copy of the
    /// rows of tile `work` (row-grouped variants only). May wait, bounded.
    ///
    /// # Safety
    /// `p` is the launch's valid parameter block and `work` one of its tiles.
    unsafe fn before_rows(&self, p: &GemmParams, work: &Work);

    /// The leader thread (thread 0) of consumer warpgroup `wg`, after it committed the last
    /// store of its part of tile `work` (row-grouped variants only).
    ///
    /// # Safety
    /// As [`Self::before_rows`]; called by the thread that issued the tile's bulk stores.
    unsafe fn after_store(&self, p: &GemmParams, work: &Work, wg: u32);
}

/// No hooks: the standalone GEMM kernels.
#[derive(Clone, Copy)]
pub struct Standalone;

impl TileHooks for Standalone {
    #[inline(always)]
    unsafe fn before_rows(&self, _: &GemmParams, _: &Work) {}
    #[inline(always)]
    unsafe fn after_store(&self, _: &GemmParams, _: &Work, _: u32) {}
}

/// Readiness counters per engine M tile (see the module docs), from a [`TileCounters`] block in
/// device memory.
#[derive(Clone, Copy)]
pub struct Counters {
    counters: *const TileCounters,
}

impl Counters {
    /// # Safety
    /// `counters` points at a valid [`TileCounters`] for the whole launch.
    #[inline(always)]
    pub unsafe fn new(counters: *const TileCounters) -> Self {
        Self { counters }
    }
}

/// The engine M tile (over all groups) that row-grouped tile `work` starts.
///
/// # Safety
/// `work` is a row-grouped tile of `p` (its group's tile offset is readable).
#[inline(always)]
unsafe fn m_tile(p: &GemmParams, work: &Work) -> u32 {
    // SAFETY: group < groups (caller contract).
    unsafe { tile_offset(p, work.group) + (work.m0 - work.row_begin) / TILE_M }
}

impl TileHooks for Counters {
    #[inline(always)]
    unsafe fn before_rows(&self, p: &GemmParams, work: &Work) {
        // SAFETY: caller contract of `new` and of the hook.
        unsafe {
            let c = &*self.counters;
            let tile = m_tile(p, work);
            let flag = (c.rows_landed as *const u32).add(tile as usize);
            let error = c.error as *mut u32;
            let waited = wait_until(flag, false, c.timeout_ns, error, |v| epoch_reached(v, c.epoch));
            // The rows are read by the TMA copies that follow, through the async proxy: order the
            // acquired generic-proxy writes before them.
            fence_proxy_async_global();
            if let Err(seen) = waited {
                // The first failed wait of the launch records itself, in the exchange's record
                // format; the tile then runs on whatever the rows hold (the pass is reported
                // failed, and nothing waits forever).
                error::record(error, [ERROR_TIMEOUT, WAIT_ENGINE_TILE_ROWS, 0, tile, c.epoch, seen, 0, c.epoch]);
            }
        }
    }

    #[inline(always)]
    unsafe fn after_store(&self, p: &GemmParams, work: &Work, _wg: u32) {
        // The bulk stores must have completed (not only read their staging), and their writes,
        // made through the async proxy, must be ordered before the release that publishes them.
        bulk::wait_group_all();
        fence_proxy_async_global();
        // SAFETY: caller contract of `new` and of the hook.
        unsafe {
            let c = &*self.counters;
            let count = (c.tiles_stored as *mut u32).add(m_tile(p, work) as usize);
            signal(count, 1, false);
        }
    }
}

/// Whether variant `V` hands its tiles over (the weight gradient reduces over whole groups and
/// has no per-tile readiness).
#[inline(always)]
pub(super) const fn hooked(v: u32) -> bool {
    v != Variant::WGRAD
}
