//! Single-primitive test kernels for sm_90a, so a broken building block of the GEMM engine is
//! found by name: a TMA tensor load (through an mbarrier), a TMA tensor store, an mbarrier ring between a producer
//! and a consumer warp, and one wgmma K block in each operand major-ness the engine uses.

use crate::gemm_layout::{smem_descriptor, swizzled_chunk_offset};
use crate::ptx::memory::{fence_proxy_async_shared_cta, ld_global_v4, ld_shared_u32, st_shared_u32, st_shared_v4};
use crate::ptx::{bulk, mbarrier, smem, sreg, sync, tma, wgmma};

/// One block of 32 threads: TMA-loads the `[box_rows][64]` bf16 box at `(c0, c1)` of the 2-D
/// map into shared memory, waits on an mbarrier, and copies the raw (swizzled) shared bytes to
/// `out` (`box_rows · 128` bytes).
///
/// # Safety
/// `map` a valid 2-D bf16 tensor map with a 64 × `box_rows` box and 128B swizzle; `out` sized.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_probe_tma_load(map: u64, c0: i32, c1: i32, box_rows: u32, out: *mut u32) {
    let base = (smem::dynamic_smem_base() + 1023) & !1023;
    let bar = base + box_rows * 128;
    let lane = sreg::thread_idx_x();
    if lane == 0 {
        // SAFETY: this block's shared memory; the barrier expects the box's bytes.
        unsafe {
            mbarrier::init(bar, 1);
            mbarrier::fence_mbarrier_init();
            mbarrier::arrive_expect_tx(bar, box_rows * 128);
            tma::load_2d(base, map, c0, c1, bar);
        }
    }
    // Only the lane that initialised the barrier waits on it (racecheck reports the other lanes'
    // polls of a barrier their own warp wrote as a warp-level hazard); the block barrier then
    // orders the landed box before every lane's reads.
    if lane == 0 {
        // SAFETY: initialised barrier; phase 0 completes when the box has landed.
        unsafe { mbarrier::wait_parity(bar, 0) };
    }
    // SAFETY: every thread of the block reaches it (the lane-0 branches above rejoin).
    unsafe { sync::block_barrier() };
    let mut word = lane;
    while word < box_rows * 32 {
        // SAFETY: inside the box and `out`.
        unsafe { *out.add(word as usize) = ld_shared_u32(base + word * 4) };
        word += 32;
    }
}

/// One block of 32 threads: copies `box_rows · 32` words from `values` into shared memory as
/// they are (a 128B-swizzled box), then TMA-stores the box to `(c0, c1)` of the 2-D map and waits
/// for the store to complete. The store is the only write the box's global bytes get, so a tool
/// that does not count TMA stores as initialising memory shows it on the next read.
///
/// # Safety
/// `map` a valid 2-D bf16 tensor map with a 64 × `box_rows` box and 128B swizzle; `values` sized.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_probe_tma_store(map: u64, c0: i32, c1: i32, box_rows: u32, values: *const u32) {
    let base = (smem::dynamic_smem_base() + 1023) & !1023;
    let lane = sreg::thread_idx_x();
    let mut word = lane;
    while word < box_rows * 32 {
        // SAFETY: inside the box and `values`.
        unsafe { st_shared_u32(base + word * 4, *values.add(word as usize)) };
        word += 32;
    }
    // The generic-proxy writes of every lane, then the async proxy that the store reads through.
    fence_proxy_async_shared_cta();
    // SAFETY: every thread of the block reaches it (nothing above returns early).
    unsafe { sync::block_barrier() };
    if lane == 0 {
        // SAFETY: the box was written and published above; the map's bounds clip the store.
        unsafe { tma::store_2d(map, c0, c1, base) };
        bulk::commit_group();
        bulk::wait_group_all();
    }
}

/// Two warps pass `rounds` values through a ring of `stages` one-word slots guarded by full and
/// empty mbarriers; the consumer writes what it received to `out[round]`.
///
/// # Safety
/// 64 threads; `out` has `rounds` words; `stages` ≤ 16.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_probe_mbarrier_ring(stages: u32, rounds: u32, out: *mut u32) {
    let base = (smem::dynamic_smem_base() + 1023) & !1023;
    let slot = |s: u32| base + s * 4;
    let full = |s: u32| base + 64 + s * 8;
    let empty = |s: u32| base + 64 + 128 + s * 8;
    let thread = sreg::thread_idx_x();
    if thread == 0 {
        for s in 0..stages {
            // SAFETY: fresh barriers in this block's shared memory.
            unsafe {
                mbarrier::init(full(s), 1);
                mbarrier::init(empty(s), 1);
            }
        }
        mbarrier::fence_mbarrier_init();
    }
    // SAFETY: every thread of the block reaches it (thread 0's branch above rejoins).
    unsafe { sync::block_barrier() };
    let (mut stage, mut phase) = (0u32, 0u32);
    for round in 0..rounds {
        if thread == 0 {
            // SAFETY: initialised barriers; the slot is released before it is rewritten.
            unsafe {
                mbarrier::wait_parity(empty(stage), phase ^ 1);
                st_shared_u32(slot(stage), round.wrapping_mul(2_654_435_761) ^ 0x5a5a);
                mbarrier::arrive(full(stage));
            }
        } else if thread == 32 {
            // SAFETY: as above.
            unsafe {
                mbarrier::wait_parity(full(stage), phase);
                *out.add(round as usize) = ld_shared_u32(slot(stage));
                mbarrier::arrive(empty(stage));
            }
        }
        stage += 1;
        if stage == stages {
            stage = 0;
            phase ^= 1;
        }
    }
}

/// One warpgroup computes `out[64][256] = A · B` for one 64-deep K block with the engine's
/// `wgmma.m64n256k16` ×4, operands staged into swizzled shared memory by ordinary stores:
/// - `mode 0`: A `[64 m][64 k]`, B `[256 n][64 k]` (both K-major);
/// - `mode 1`: A K-major, B `[64 k][256 n]` (N-major);
/// - `mode 2`: A `[64 k][64 m]` (M-major), B N-major.
///
/// # Safety
/// 128 threads; `a` 4096 bf16, `b` 16384 bf16, `out` 16384 f32; 8 + 32 + 1 KiB of dynamic
/// shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mok_probe_wgmma_tile(a: *const u16, b: *const u16, mode: u32, out: *mut f32) {
    let base = (smem::dynamic_smem_base() + 1023) & !1023;
    let (a_tile, b_tile) = (base, base + 8192);
    let thread = sreg::thread_idx_x();
    // Stage A: 64 rows of 128 bytes (rows are m when K-major, k when M-major).
    let mut q = thread;
    while q < 64 * 8 {
        let (r, c) = (q / 8, q % 8);
        // SAFETY: inside `a` and the A tile.
        unsafe {
            st_shared_v4(
                a_tile + swizzled_chunk_offset(r, c),
                ld_global_v4(a.add((r * 64 + c * 8) as usize) as *const u32),
            )
        };
        q += 128;
    }
    // Stage B: K-major = 256 rows (n) of 64 k; N-major = four 64-wide n blocks of 64 k rows.
    let mut q = thread;
    while q < 256 * 8 {
        let (r, c) = (q / 8, q % 8);
        // SAFETY: inside `b` and the B tile.
        unsafe {
            if mode == 0 {
                st_shared_v4(
                    b_tile + swizzled_chunk_offset(r, c),
                    ld_global_v4(b.add((r * 64 + c * 8) as usize) as *const u32),
                );
            } else {
                let (block, k) = (r / 64, r % 64);
                let src = b.add((k * 256 + block * 64 + c * 8) as usize) as *const u32;
                st_shared_v4(b_tile + block * 8192 + swizzled_chunk_offset(k, c), ld_global_v4(src));
            }
        }
        q += 128;
    }
    crate::ptx::memory::fence_proxy_async_shared_cta();
    // SAFETY: every thread of the block reaches it (nothing above returns early).
    unsafe { sync::block_barrier() };
    let mut da = [0u64; 4];
    let mut db = [0u64; 4];
    for k in 0..4u32 {
        da[k as usize] = if mode == 2 {
            smem_descriptor(a_tile + k * 2048, 8192, 1024)
        } else {
            smem_descriptor(a_tile + k * 32, 16, 1024)
        };
        db[k as usize] = if mode == 0 {
            smem_descriptor(b_tile + k * 32, 16, 1024)
        } else {
            smem_descriptor(b_tile + k * 2048, 8192, 1024)
        };
    }
    let mut acc = [0.0f32; 128];
    // SAFETY: a whole warpgroup in uniform flow; operands staged and fenced above.
    unsafe {
        match mode {
            0 => wgmma::issue_k64_m64n256_kk(&mut acc, da, db, false),
            1 => wgmma::issue_k64_m64n256_kn(&mut acc, da, db, false),
            _ => wgmma::issue_k64_m64n256_mn(&mut acc, da, db, false),
        }
    }
    wgmma::wait_all_n256(&mut acc);
    // Constant accumulator indices (a runtime loop would put `acc` in local memory).
    crate::gemm::engine::for_each_pair::<32>(thread, |index, row, col| {
        // SAFETY: row < 64, col + 1 < 256.
        unsafe {
            *out.add((row * 256 + col) as usize) = acc[index];
            *out.add((row * 256 + col + 1) as usize) = acc[index + 1];
        }
    });
}
