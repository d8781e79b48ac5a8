//! The consumers' main loop: one warpgroup's `wgmma.m64n256k16` over a tile's stages, each stage
//! released once the MMAs reading it are done.

use crate::gemm_layout::{
    BLOCK_64_BYTES, TILE_N, Variant, cluster_blocks, is_wgrad, own_empty_arrivals, smem_descriptor,
};
use crate::ptx::memory::fence_proxy_async_shared_cta;
use crate::ptx::{cluster, mbarrier, wgmma};

use super::ring::Ring;
use super::source::*;

/// n8 blocks of a consumer's accumulator tile.
pub(super) const N8_BLOCKS: u32 = TILE_N / 8;
/// Accumulators per consumer thread.
pub(super) const ACCUMULATORS: usize = (64 * TILE_N / 128) as usize;

/// Descriptors of the four 16-deep K slices of a stage for consumer warpgroup `wg`.
#[inline(always)]
pub(super) fn stage_descriptors<const V: u32>(ring: Ring, stage: u32, wg: u32) -> ([u64; 4], [u64; 4]) {
    let (a_tile, b_tile) = (ring.a_tile(stage), ring.b_tile(stage));
    let mut a = [0u64; 4];
    let mut b = [0u64; 4];
    for (k, (da, db)) in a.iter_mut().zip(b.iter_mut()).enumerate() {
        let k = k as u32;
        *da = if is_wgrad(V) {
            // M-major: this warpgroup's 64 M values are one 64-wide half; 16 K rows per slice.
            smem_descriptor(a_tile + wg * BLOCK_64_BYTES + k * 16 * 128, BLOCK_64_BYTES, 1024)
        } else {
            // K-major: this warpgroup's 64 rows; a K slice is 32 bytes into each 128-byte row.
            smem_descriptor(a_tile + wg * BLOCK_64_BYTES + k * 32, 16, 1024)
        };
        *db = if V == Variant::GATE_UP || V == Variant::ROWS_NT || V == Variant::ROWS_NT_BF16 {
            smem_descriptor(b_tile + k * 32, 16, 1024)
        } else {
            // N-major: four 64-wide N blocks, 16 K rows per slice.
            smem_descriptor(b_tile + k * 16 * 128, BLOCK_64_BYTES, 1024)
        };
    }
    (a, b)
}

/// Hands a stage back to the producer(s): one arrival per consumer warp (8 per phase), once the
/// warp is done with the stage — its MMAs reading it have completed, or, on the paths without
/// MMAs, at once (only lane 0, the arriving lane, read the tile slot: see `consume`). In a pair, the warp also arrives on the partner's
/// barrier (its producer multicasts into this block's stage): 16 arrivals per phase there.
///
/// # Safety
/// The ring's barriers are initialised (`init_barriers`, in both blocks of a pair, the partner
/// staying until the final cluster barrier); each consumer warp calls it once per phase of
/// `stage`, after that phase's `full` wait and once done reading the stage (`thread_in_wg`: the
/// thread's index in its warpgroup).
#[inline(always)]
pub(super) unsafe fn release<const V: u32>(ring: Ring, stage: u32, thread_in_wg: u32) {
    if thread_in_wg % 32 == 0 {
        // SAFETY: initialised barriers of this block and of the partner, which stays until the
        // final cluster barrier (caller contract).
        unsafe {
            mbarrier::arrive(ring.empty::<V>(stage));
            if own_empty_arrivals(V) > 1 {
                mbarrier::arrive(ring.empty::<V>(stage));
            }
            if cluster_blocks(V) > 1 {
                cluster::arrive_remote(cluster::map_to_rank(ring.empty::<V>(stage), pair_rank::<V>() ^ 1));
            }
        }
    }
}

/// The MMAs of one tile over its `k_blocks` (> 0) stages, each stage released once the MMAs
/// reading it are done; leaves `stage` / `phase` at the tile's next stage. `fence_rows`: the
/// stages' rows were written by threads (a gathering producer's `cp.async`, the generic proxy),
/// so each `full` wait is followed by an async-proxy fence before the MMAs read them.
///
/// # Safety
/// The ring's barriers are initialised, as [`release`] requires; the whole consumer warpgroup
/// `wg` calls it in uniform control flow (the `wgmma`s are warpgroup-collective); `(stage,
/// phase)` is where the tile's first K block is, and the producer fills `k_blocks` stages from
/// there with the variant's tiles.
#[inline(always)]
pub(super) unsafe fn mainloop<const V: u32>(
    acc: &mut [f32; ACCUMULATORS],
    ring: Ring,
    (stage, phase): (&mut u32, &mut u32),
    (k_blocks, fence_rows): (u32, bool),
    wg: u32,
    thread_in_wg: u32,
) {
    // One K block stays in flight on the tensor cores while the next stage is awaited: a
    // stage is released once the wait for the *next* block's issue says it is done.
    let mut in_flight: Option<u32> = None;
    for kb in 0..k_blocks {
        // SAFETY: initialised barrier of this block.
        unsafe { mbarrier::wait_parity(ring.full(*stage), *phase) };
        if fence_rows {
            fence_proxy_async_shared_cta();
        }
        let (a, b) = stage_descriptors::<V>(ring, *stage, wg);
        let accumulate = kb > 0;
        // SAFETY: the stage is full; warpgroup-collective in uniform flow; `acc` is not read
        // before the wait below.
        unsafe {
            match V {
                Variant::GATE_UP | Variant::ROWS_NT | Variant::ROWS_NT_BF16 => {
                    wgmma::issue_k64_m64n256_kk(acc, a, b, accumulate)
                }
                Variant::ROWS_NN => wgmma::issue_k64_m64n256_kn(acc, a, b, accumulate),
                _ => wgmma::issue_k64_m64n256_mn(acc, a, b, accumulate),
            }
        }
        wgmma::wait_keep_one_n256(acc);
        if let Some(done) = in_flight {
            // SAFETY: the MMAs reading `done` have completed (the wait above); caller contract.
            unsafe { release::<V>(ring, done, thread_in_wg) };
        }
        in_flight = Some(*stage);
        ring.advance::<V>(stage, phase);
    }
    wgmma::wait_all_n256(acc);
    if let Some(done) = in_flight {
        // SAFETY: every MMA has completed (the wait above); caller contract.
        unsafe { release::<V>(ring, done, thread_in_wg) };
    }
}
