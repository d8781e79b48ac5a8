//! The row movers (device only): warp-level loops over the ring rows a caller hands them.
//!
//! - [`pull_rows`]: forward dispatch (x rows, copied) and backward reverse-combine (dy rows,
//!   scaled by the slot weight and rounded to bf16, exactly as the single-rank gather does),
//!   read through the peer mapping from the token owner and written into this rank's ring; each
//!   row then adds 1 to its M tile's counter (local, `.gpu` release).
//! - [`push_rows`]: forward combine and backward reverse-dispatch: this rank's f32 result rows
//!   are written into the token owner's `[T·k][H]` slot buffer at the row's slot; each row then
//!   adds 1 to the owner's counter of (token tile, this rank) (`.sys` release across GPUs).
//! - [`pull_rows_bulk`], [`push_rows_bulk`]: the same moves through the copy engine
//!   (`cp.async.bulk` global → shared → global, one thread per block driving it), for the unscaled
//!   directions.
//!
//! Vector path: each lane moves 16-byte vectors, four in flight per lane, strided by 32 lanes so
//! a warp's accesses are contiguous. Rows are independent and each has one writer, so the result
//! does not depend on which warp moved which row.

use super::error::{self, ERROR_TIMEOUT};
use super::params::{BULK_HEADER_BYTES, BULK_STAGE_BYTES, BULK_STAGES, ERROR_WORDS};
use super::schedule::tile_of_row;
use super::wait::signal;
use super::{Pass, RankView};
use crate::layout::ROUTE_CHUNK_TOKENS;
use crate::num::{bf16x2_hi, bf16x2_lo};
use crate::ptx::convert::f32x2_to_bf16x2;
use crate::ptx::memory::{fence_proxy_async_global, ld_global_v4, st_global_v4};
use crate::ptx::{bulk, mbarrier, signal as warp, sreg, sync};
use crate::tiles::GEMM_TILE_M;

/// Copies `vectors` 16-byte vectors from `src` to `dst`; lane `lane` of the warp moves vectors
/// `lane, lane + 32, ...`.
///
/// # Safety
/// Both ranges must hold `vectors` 16-byte aligned vectors (global memory, possibly peer-mapped).
#[inline(always)]
pub unsafe fn warp_copy(src: *const u32, dst: *mut u32, vectors: usize, lane: usize) {
    let mut v = lane;
    while v + 96 < vectors {
        // SAFETY: v + 96 < vectors, so all four vectors lie in `src` (caller contract).
        let (a, b, c, d) = unsafe {
            (
                ld_global_v4(src.add(v * 4)),
                ld_global_v4(src.add((v + 32) * 4)),
                ld_global_v4(src.add((v + 64) * 4)),
                ld_global_v4(src.add((v + 96) * 4)),
            )
        };
        // SAFETY: v + 96 < vectors, so all four vectors lie in `dst` (caller contract).
        unsafe {
            st_global_v4(dst.add(v * 4), a);
            st_global_v4(dst.add((v + 32) * 4), b);
            st_global_v4(dst.add((v + 64) * 4), c);
            st_global_v4(dst.add((v + 96) * 4), d);
        }
        v += 128;
    }
    while v < vectors {
        // SAFETY: v < vectors, so the vector lies in both ranges (caller contract).
        unsafe { st_global_v4(dst.add(v * 4), ld_global_v4(src.add(v * 4))) };
        v += 32;
    }
}

/// Like [`warp_copy`] for bf16 rows, each element `bf16(weight · x)` — the same arithmetic as
/// the single-rank gather of scaled dy (`mok_gather_rows`), so the bits match.
///
/// # Safety
/// As [`warp_copy`].
#[inline(always)]
pub unsafe fn warp_copy_scaled_bf16(src: *const u32, dst: *mut u32, vectors: usize, lane: usize, weight: f32) {
    let scale = |mut vector: [u32; 4]| {
        for pair in vector.iter_mut() {
            *pair = f32x2_to_bf16x2(weight * bf16x2_lo(*pair), weight * bf16x2_hi(*pair));
        }
        vector
    };
    let mut v = lane;
    while v + 32 < vectors {
        // SAFETY: v + 32 < vectors, so both vectors lie in `src` (caller contract).
        let (a, b) = unsafe { (ld_global_v4(src.add(v * 4)), ld_global_v4(src.add((v + 32) * 4))) };
        // SAFETY: v + 32 < vectors, so both vectors lie in `dst` (caller contract).
        unsafe {
            st_global_v4(dst.add(v * 4), scale(a));
            st_global_v4(dst.add((v + 32) * 4), scale(b));
        }
        v += 64;
    }
    while v < vectors {
        // SAFETY: v < vectors, so the vector lies in both ranges (caller contract).
        unsafe { st_global_v4(dst.add(v * 4), scale(ld_global_v4(src.add(v * 4)))) };
        v += 32;
    }
}

/// This rank's error state, the same in every lane (lane 0 reads, the warp shares it), so the
/// warp leaves or stays together.
///
/// # Safety
/// The view's error record is valid; all 32 lanes call it, in warp-uniform control flow (a
/// [`sync::shfl_idx_u32`]).
#[inline(always)]
unsafe fn warp_has_error(view: &RankView, lane: usize) -> bool {
    // SAFETY: caller contract.
    let mine = if lane == 0 { unsafe { error::has_error(view.error()) as u32 } } else { 0 };
    // SAFETY: all 32 lanes (caller contract; lane 0's branch above rejoins).
    unsafe { sync::shfl_idx_u32(mine, 0) != 0 }
}

/// Ring rows of this rank and the source of a row.
struct Ring {
    total: u32,
    source_rank: *const u32,
    source_slot: *const u32,
    row_offsets: *const u32,
    tile_offsets: *const u32,
}

impl Ring {
    /// # Safety
    /// The schedule and ring-map steps have run for this rank.
    unsafe fn of(view: &RankView) -> Self {
        let r = &view.params.regions;
        let row_offsets: *const u32 = view.local(r.ring_row_offsets);
        Self {
            // SAFETY: the last of L + 1 offsets is the row count.
            total: unsafe { *row_offsets.add(view.params.local_experts as usize) },
            source_rank: view.local(r.ring_source_rank),
            source_slot: view.local(r.ring_source_slot),
            row_offsets,
            tile_offsets: view.local(r.ring_tile_offsets),
        }
    }

    /// `(source rank, source slot)` of `row`.
    ///
    /// # Safety
    /// `row < total`.
    #[inline(always)]
    unsafe fn source(&self, row: u32) -> (u32, u32) {
        // SAFETY: caller contract.
        unsafe { (*self.source_rank.add(row as usize), *self.source_slot.add(row as usize)) }
    }

    /// The M tile of `row`.
    ///
    /// # Safety
    /// `local` is the rank's local expert count.
    #[inline(always)]
    unsafe fn tile(&self, row: u32, local: usize) -> u32 {
        // SAFETY: the schedule wrote L + 1 offsets of each kind.
        let (rows, tiles) = unsafe {
            (
                core::slice::from_raw_parts(self.row_offsets, local + 1),
                core::slice::from_raw_parts(self.tile_offsets, local + 1),
            )
        };
        tile_of_row(rows, tiles, row, GEMM_TILE_M).unwrap_or(0)
    }
}

/// Pull mover, warp-collective: this warp moves ring rows `warp, warp + warps, ...` of `pass`
/// (forward: x; backward: dy scaled by the slot weight) from their token owners into this rank's
/// ring and counts each row on its M tile.
///
/// # Safety
/// The schedule and ring-map steps have run; every source rank has published the pass's inputs.
/// All 32 lanes call it in uniform control flow.
pub unsafe fn pull_rows(view: &RankView, pass: Pass, warp: u32, warps: u32) {
    let lane = sreg::lane_id() as usize;
    // SAFETY: caller contract: the record; all 32 lanes, at the function's start.
    if unsafe { warp_has_error(view, lane) } {
        return;
    }
    let p = view.params;
    let r = &p.regions;
    // SAFETY: caller contract.
    let ring = unsafe { Ring::of(view) };
    let (source_region, ring_region, counter_region) = match pass {
        Pass::Forward => (r.x, r.ring_x, r.tile_ready),
        Pass::Backward => (r.dy, r.ring_dy, r.dy_tile_ready),
    };
    let h = p.hidden as usize;
    let vectors = h / 8;
    let (ring_rows, counters): (*mut u16, *mut u32) = (view.local(ring_region), view.local(counter_region));
    let mut row = warp;
    while row < ring.total {
        // SAFETY: row < total; the source slot names a token of the source (T·k slots); rows are
        // 16-byte aligned (H % 8 == 0, regions 256-byte aligned).
        unsafe {
            let (source, slot) = ring.source(row);
            let token = (slot / p.top_k) as usize;
            let src = view.peer::<u16>(source_region, source).add(token * h) as *const u32;
            let dst = ring_rows.add(row as usize * h) as *mut u32;
            match pass {
                Pass::Forward => warp_copy(src, dst, vectors, lane),
                Pass::Backward => {
                    let weight = *view.peer::<f32>(r.topk_weights, source).add(slot as usize);
                    warp_copy_scaled_bf16(src, dst, vectors, lane, weight)
                }
            }
        }
        // SAFETY: all 32 lanes, in uniform control flow (caller contract; `row` is uniform).
        unsafe { warp::warp_sync() };
        if lane == 0 {
            // SAFETY: the tile index is below max_tiles for a ring within capacity.
            unsafe { signal(counters.add(ring.tile(row, p.local_experts as usize) as usize), 1, false) };
        }
        row += warps;
    }
}

/// The token owner's combine counter for `slot`'s token tile, as pushed by this rank.
#[inline(always)]
fn arrival_index(view: &RankView, slot: u32) -> usize {
    let token_tile = slot / view.params.top_k / ROUTE_CHUNK_TOKENS;
    (token_tile * view.params.world + view.rank) as usize
}

/// The slot buffer and arrival counters a push of `pass` writes.
fn push_regions(view: &RankView, pass: Pass) -> (u64, u64) {
    let r = &view.params.regions;
    match pass {
        Pass::Forward => (r.combine_slots, r.combine_arrived),
        Pass::Backward => (r.dx_slots, r.dx_arrived),
    }
}

/// Push mover, warp-collective: this warp writes ring rows `warp, warp + warps, ...` of
/// `rows` (`[ring rows][H]` f32: the down projection's output in forward, the gate/up dgrad's in
/// backward) into the token owners' slot buffers of `pass`, then signals each row.
///
/// # Safety
/// The schedule and ring-map steps have run and `rows` holds the ring's rows. All 32 lanes call
/// it in uniform control flow.
pub unsafe fn push_rows(view: &RankView, pass: Pass, rows: *const f32, warp: u32, warps: u32) {
    let lane = sreg::lane_id() as usize;
    // SAFETY: caller contract: the record; all 32 lanes, at the function's start.
    if unsafe { warp_has_error(view, lane) } {
        return;
    }
    let p = view.params;
    // SAFETY: caller contract.
    let ring = unsafe { Ring::of(view) };
    let (slot_region, counter_region) = push_regions(view, pass);
    let h = p.hidden as usize;
    let mut row = warp;
    while row < ring.total {
        // SAFETY: row < total.
        let (source, slot) = unsafe { ring.source(row) };
        // SAFETY: `rows` holds ring row `row` (caller contract); the slot is below T·k on its
        // owner; f32 rows are 16-byte aligned (H % 8 == 0, regions 256-byte aligned).
        unsafe {
            let src = rows.add(row as usize * h) as *const u32;
            let dst = view.peer::<f32>(slot_region, source).add(slot as usize * h) as *mut u32;
            warp_copy(src, dst, h / 4, lane);
        }
        // SAFETY: all 32 lanes, in uniform control flow (caller contract; `row` is uniform).
        unsafe { warp::warp_sync() };
        if lane == 0 {
            let counter = view.peer::<u32>(counter_region, source);
            // SAFETY: the index is below chunks·P on the owner.
            unsafe { signal(counter.add(arrival_index(view, slot)), 1, view.sys()) };
        }
        row += warps;
    }
}

/// Shared-memory plan of a bulk-mover block: mbarrier `i` at `base + 8i`, stage `i` at
/// `base + BULK_HEADER_BYTES + i·BULK_STAGE_BYTES`.
struct BulkStages {
    base: u32,
    /// Bit i: the parity the next wait on barrier i expects.
    phases: u32,
}

impl BulkStages {
    /// Initialises the barriers. Called by the one driving thread.
    ///
    /// # Safety
    /// The block has `BULK_SMEM_BYTES` of dynamic shared memory that nothing else uses.
    unsafe fn init() -> Self {
        let base = crate::ptx::smem::dynamic_smem_base();
        for i in 0..BULK_STAGES {
            // SAFETY: 8-byte slots inside the header.
            unsafe { mbarrier::init(base + 8 * i, 1) };
        }
        mbarrier::fence_mbarrier_init();
        Self { base, phases: 0 }
    }

    fn bar(&self, i: u32) -> u32 {
        self.base + 8 * i
    }

    fn stage(&self, i: u32) -> u32 {
        self.base + BULK_HEADER_BYTES + i * BULK_STAGE_BYTES
    }

    /// Copies `bytes` (a multiple of 16) from `src` to `dst` through the stages: up to
    /// `BULK_STAGES` loads in flight, each piece stored as soon as it lands. Returns `false`
    /// when a load did not complete by `deadline_ns`. On return every store has been issued and
    /// has finished reading shared memory; call [`finish_writes`] before publishing.
    ///
    /// # Safety
    /// Both ranges valid and 16-byte aligned, global memory (possibly peer-mapped).
    unsafe fn copy(&mut self, src: *const u8, dst: *mut u8, bytes: u32, deadline_ns: u64) -> bool {
        let pieces = bytes.div_ceil(BULK_STAGE_BYTES);
        let mut first = 0;
        while first < pieces {
            let batch = (pieces - first).min(BULK_STAGES);
            for i in 0..batch {
                let offset = (first + i) * BULK_STAGE_BYTES;
                let len = (bytes - offset).min(BULK_STAGE_BYTES);
                // SAFETY: the piece lies inside both ranges; the stage holds BULK_STAGE_BYTES.
                unsafe {
                    mbarrier::arrive_expect_tx(self.bar(i), len);
                    bulk::global_to_shared(self.stage(i), src.add(offset as usize), len, self.bar(i));
                }
            }
            for i in 0..batch {
                let offset = (first + i) * BULK_STAGE_BYTES;
                let len = (bytes - offset).min(BULK_STAGE_BYTES);
                // SAFETY: an initialised barrier of this block.
                if !unsafe { mbarrier::wait_parity_until(self.bar(i), (self.phases >> i) & 1, deadline_ns) } {
                    return false;
                }
                self.phases ^= 1 << i;
                // SAFETY: the piece landed (the barrier's transaction count completed).
                unsafe { bulk::shared_to_global(dst.add(offset as usize), self.stage(i), len) };
            }
            bulk::commit_group();
            // The next batch overwrites the stages: wait until the stores have read them.
            bulk::wait_group_read_all();
            first += batch;
        }
        true
    }
}

/// Waits until this thread's bulk stores are performed and orders them (async proxy) before the
/// generic-proxy release that publishes them.
#[inline(always)]
fn finish_writes() {
    bulk::wait_group_all();
    fence_proxy_async_global();
}

/// Records a bulk copy that did not land in time.
///
/// # Safety
/// The view's error record is valid.
unsafe fn record_bulk_timeout(view: &RankView, row: u32) {
    let mut words = [0u32; ERROR_WORDS];
    words[error::WORD_CODE] = ERROR_TIMEOUT;
    words[error::WORD_WAITED_FOR] = error::WAIT_BULK_COPY;
    words[error::WORD_PEER] = view.rank;
    words[error::WORD_INDEX] = row;
    words[error::WORD_RANK] = view.rank;
    // SAFETY: caller contract.
    unsafe { error::record(view.error(), words) };
}

/// Bulk pull mover (forward dispatch), driven by thread 0 of the block: rows
/// `block, block + blocks, ...` of the ring.
///
/// # Safety
/// As [`pull_rows`]; the block has `BULK_SMEM_BYTES` of dynamic shared memory. Only thread 0
/// does anything.
pub unsafe fn pull_rows_bulk(view: &RankView, block: u32, blocks: u32) {
    if sreg::thread_idx_x() != 0 {
        return;
    }
    let p = view.params;
    // SAFETY: caller contract.
    if unsafe { error::has_error(view.error()) } {
        return;
    }
    // SAFETY: caller contract.
    let (ring, mut stages) = unsafe { (Ring::of(view), BulkStages::init()) };
    let h = p.hidden as usize;
    let (ring_rows, counters): (*mut u16, *mut u32) = (view.local(p.regions.ring_x), view.local(p.regions.tile_ready));
    let mut row = block;
    while row < ring.total {
        // SAFETY: as in `pull_rows`.
        let copied = unsafe {
            let (source, slot) = ring.source(row);
            let token = (slot / p.top_k) as usize;
            let src = view.peer::<u16>(p.regions.x, source).add(token * h) as *const u8;
            let dst = ring_rows.add(row as usize * h) as *mut u8;
            stages.copy(src, dst, (h * 2) as u32, sreg::global_timer_ns().saturating_add(p.timeout_ns))
        };
        if !copied {
            // SAFETY: this rank's record.
            unsafe { record_bulk_timeout(view, row) };
            return;
        }
        finish_writes();
        // SAFETY: as in `pull_rows`.
        unsafe { signal(counters.add(ring.tile(row, p.local_experts as usize) as usize), 1, false) };
        row += blocks;
    }
}

/// Bulk push mover (forward combine or reverse-dispatch), driven by thread 0 of the block.
///
/// # Safety
/// As [`push_rows`]; the block has `BULK_SMEM_BYTES` of dynamic shared memory.
pub unsafe fn push_rows_bulk(view: &RankView, pass: Pass, rows: *const f32, block: u32, blocks: u32) {
    if sreg::thread_idx_x() != 0 {
        return;
    }
    let p = view.params;
    // SAFETY: caller contract.
    if unsafe { error::has_error(view.error()) } {
        return;
    }
    // SAFETY: caller contract.
    let (ring, mut stages) = unsafe { (Ring::of(view), BulkStages::init()) };
    let (slot_region, counter_region) = push_regions(view, pass);
    let h = p.hidden as usize;
    let mut row = block;
    while row < ring.total {
        // SAFETY: row < total.
        let (source, slot) = unsafe { ring.source(row) };
        // SAFETY: both ranges valid and 16-byte aligned, as for the row copy in `push_rows`.
        let copied = unsafe {
            let src = rows.add(row as usize * h) as *const u8;
            let dst = view.peer::<f32>(slot_region, source).add(slot as usize * h) as *mut u8;
            stages.copy(src, dst, (h * 4) as u32, sreg::global_timer_ns().saturating_add(p.timeout_ns))
        };
        if !copied {
            // SAFETY: this rank's record.
            unsafe { record_bulk_timeout(view, row) };
            return;
        }
        finish_writes();
        let counter = view.peer::<u32>(counter_region, source);
        // SAFETY: as in `push_rows`.
        unsafe { signal(counter.add(arrival_index(view, slot)), 1, view.sys()) };
        row += blocks;
    }
}
