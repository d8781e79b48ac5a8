//! Tensor maps cut at group ends, made on the device before every engine launch.
//!
//! The engine's groups are contiguous row ranges whose bounds only the device knows. A map over
//! the whole buffer would let a ragged tile's copy read the next group's rows; a map whose base
//! is the group's first row and whose row count is the group's size makes the copy engine fill
//! every row past the group's end with zeros instead. One warp per group copies the host-encoded
//! whole-buffer map into shared memory, replaces those two fields there and publishes the result
//! to `GemmParams::group_maps` with a release of the tensor-map proxy (the engine acquires it).

use crate::gemm_layout::{GROUP_MAP_SLOTS, GROUP_MAP_WARPS, GemmParams, TENSOR_MAP_BYTES};
use crate::ptx::memory::st_shared_u32;
use crate::ptx::signal::warp_sync;
use crate::ptx::{smem, sreg, tensormap};

/// Writes `p.group_maps[g][slot]` for every group `g` and every slot with a map; one warp per
/// group, `GROUP_MAP_WARPS` warps per block, any grid size. Also zeroes the engine's tile counter.
///
/// # Safety
/// `params` is a valid [`GemmParams`]: `row_offsets` holds `groups + 1` nondecreasing entries
/// within the buffers of `cut_bases`, `group_maps` has room for `groups · GROUP_MAP_SLOTS` maps
/// and is 128-byte aligned; `tile_counter` is a device `u32` no engine launch is reading;
/// block size `32 · GROUP_MAP_WARPS`, `GROUP_MAP_SMEM_BYTES` of dynamic shared memory.
#[inline(always)]
pub unsafe fn write_group_maps(params: *const GemmParams) {
    // SAFETY: caller contract; read-only.
    let p = unsafe { &*params };
    let (thread, lane) = (sreg::thread_idx_x(), sreg::thread_idx_x() % 32);
    let warp = thread / 32;
    let first_group = sreg::block_idx_x() * GROUP_MAP_WARPS + warp;
    let stride = sreg::grid_dim_x() * GROUP_MAP_WARPS;
    let offsets = p.row_offsets as *const u32;
    if first_group == 0 && lane == 0 {
        // SAFETY: tile_counter is the plan's own u32 (host contract); the engine launch that
        // reads it starts after this kernel ends (same stream).
        unsafe { *(p.tile_counter as *mut u32) = 0 };
    }
    let mut group = first_group;
    // Uniform per warp: the whole warp takes part in the collective copy below.
    while group < p.groups {
        // SAFETY: group + 1 ≤ groups.
        let (begin, end) = unsafe { (*offsets.add(group as usize), *offsets.add(group as usize + 1)) };
        for slot in 0..GROUP_MAP_SLOTS {
            let base_map = p.cut_maps[slot as usize];
            if base_map == 0 {
                continue;
            }
            let staged = smem::dynamic_smem_base() + (warp * GROUP_MAP_SLOTS + slot) * TENSOR_MAP_BYTES;
            // SAFETY: 32 lanes × 4 bytes = the 128-byte map, inside this warp's staging slot.
            unsafe { st_shared_u32(staged + 4 * lane, *(base_map as *const u32).add(lane as usize)) };
            // SAFETY: all 32 lanes (the block is whole warps: caller contract), in warp-uniform flow.
            unsafe { warp_sync() };
            if lane == 0 {
                let pitch = p.cut_pitches[slot as usize] as u64;
                // SAFETY: the staged map is complete (warp_sync above); the group's first row is
                // 16-byte aligned (pitches are multiples of 16 bytes). An empty group keeps one
                // row: its map is never used, but a row count of 0 is not a valid map.
                unsafe {
                    tensormap::replace_global_address(staged, p.cut_bases[slot as usize] + begin as u64 * pitch);
                    tensormap::replace_rows(staged, (end - begin).max(1));
                }
            }
            // SAFETY: as above.
            unsafe { warp_sync() };
            // SAFETY: whole warp, uniform flow; the destination slot is inside group_maps.
            unsafe { tensormap::copy_to_global_release(p.group_map(group, slot), staged) };
        }
        group += stride;
    }
}
