//! Barriers and warp collectives (PTX ISA §9.7.13 `bar`, §9.7.9 `shfl.sync`, `vote.sync`).
//!
//! All of these must be reached in uniform control flow by the threads they name: keep calls
//! out of data-dependent branches.

use core::arch::asm;

/// Mask of all 32 lanes, for the `.sync` warp collectives.
pub const FULL_WARP: u32 = 0xffff_ffff;

/// `bar.sync 0`: block-wide barrier; also orders shared and global memory among the block's
/// threads (a CTA-scope fence is implied).
///
/// # Safety
/// Every thread of the block executes this same call, in block-uniform control flow: `bar.sync`
/// is `.aligned`, so one reached divergently, or not by every thread, is undefined.
#[inline(always)]
pub unsafe fn block_barrier() {
    // SAFETY: caller contract.
    unsafe { asm!("bar.sync 0;", options(nostack)) };
}

/// `shfl.sync.bfly.b32`: value of lane `lane ^ lane_mask`.
///
/// # Safety
/// All 32 lanes of the warp (its member mask is [`FULL_WARP`]) execute this same call, in
/// warp-uniform control flow; a lane of the mask that does not makes it undefined.
#[inline(always)]
pub unsafe fn shfl_xor_u32(value: u32, lane_mask: u32) -> u32 {
    let out: u32;
    // SAFETY: caller contract: the whole warp, which `FULL_WARP` names.
    unsafe {
        asm!("shfl.sync.bfly.b32 {o}, {v}, {m}, 31, {full};",
             o = out(reg32) out, v = in(reg32) value, m = in(reg32) lane_mask,
             full = in(reg32) FULL_WARP, options(nomem, nostack));
    }
    out
}

/// [`shfl_xor_u32`] for f32.
///
/// # Safety
/// As [`shfl_xor_u32`].
#[inline(always)]
pub unsafe fn shfl_xor_f32(value: f32, lane_mask: u32) -> f32 {
    // SAFETY: caller contract.
    f32::from_bits(unsafe { shfl_xor_u32(value.to_bits(), lane_mask) })
}

/// `value`, through an `asm` the compiler treats as having effects: what a loop computes from
/// it is computed again in each iteration, not hoisted out and kept (for a warp whose register
/// budget, after `setmaxnreg.dec`, cannot hold the hoisted values, which ptxas then spills).
#[inline(always)]
pub fn opaque_u32(value: u32) -> u32 {
    let out: u32;
    // SAFETY: a register move; no memory, no other effect.
    unsafe { asm!("mov.b32 {o}, {v};", o = out(reg32) out, v = in(reg32) value, options(nomem, nostack)) };
    out
}

/// `shfl.sync.idx.b32`: value of lane `src_lane`.
///
/// # Safety
/// As [`shfl_xor_u32`]: all 32 lanes execute this same call, in warp-uniform control flow.
#[inline(always)]
pub unsafe fn shfl_idx_u32(value: u32, src_lane: u32) -> u32 {
    let out: u32;
    // SAFETY: caller contract: the whole warp, which `FULL_WARP` names.
    unsafe {
        asm!("shfl.sync.idx.b32 {o}, {v}, {l}, 31, {full};",
             o = out(reg32) out, v = in(reg32) value, l = in(reg32) src_lane,
             full = in(reg32) FULL_WARP, options(nomem, nostack));
    }
    out
}

/// Exclusive prefix sum of `value` over the warp's lanes in lane order (lane 0 gets 0), and the
/// warp's total: five `shfl.sync.idx` scan steps (Hillis–Steele) and one broadcast of lane 31's
/// sum; integer sums, so the same words as a serial sum in lane order.
///
/// # Safety
/// As [`shfl_xor_u32`]: all 32 lanes execute this same call, in warp-uniform control flow.
#[inline(always)]
pub unsafe fn warp_exclusive_sum_u32(value: u32) -> (u32, u32) {
    let lane = super::sreg::lane_id();
    let mut inclusive = value;
    let mut distance = 1;
    while distance < 32 {
        // SAFETY: caller contract: every lane takes this step.
        let below = unsafe { shfl_idx_u32(inclusive, lane.saturating_sub(distance)) };
        if lane >= distance {
            inclusive = inclusive.wrapping_add(below);
        }
        distance *= 2;
    }
    // SAFETY: as above.
    let total = unsafe { shfl_idx_u32(inclusive, 31) };
    (inclusive.wrapping_sub(value), total)
}

/// `vote.sync.ballot.b32`: bit i set when lane i's `predicate` is true.
///
/// # Safety
/// As [`shfl_xor_u32`]: all 32 lanes execute this same call, in warp-uniform control flow.
#[inline(always)]
pub unsafe fn ballot(predicate: bool) -> u32 {
    let out: u32;
    // SAFETY: caller contract: the whole warp, which `FULL_WARP` names.
    unsafe {
        asm!("{{ .reg .pred p; setp.ne.u32 p, {v}, 0; vote.sync.ballot.b32 {o}, p, {full}; }}",
             o = out(reg32) out, v = in(reg32) predicate as u32, full = in(reg32) FULL_WARP,
             options(nomem, nostack));
    }
    out
}

/// Sum over the 32 lanes by a fixed butterfly: every lane gets the same bits, and the order of
/// additions depends only on lane ids, so the result is deterministic.
///
/// # Safety
/// As [`shfl_xor_u32`]: all 32 lanes execute this same call, in warp-uniform control flow.
#[inline(always)]
pub unsafe fn warp_sum_f32(mut value: f32) -> f32 {
    let mut mask = 16;
    while mask > 0 {
        // SAFETY: caller contract; every lane takes the same five steps.
        value += unsafe { shfl_xor_f32(value, mask) };
        mask >>= 1;
    }
    value
}

/// `setmaxnreg.dec.sync.aligned.u32 N` (PTX ISA §9.7.19.5, sm_90a): this warpgroup gives
/// registers back to the block's pool, keeping `N` per thread (ptxas allocates the code after it
/// within `N`).
///
/// # Safety
/// Every warp of the warpgroup executes this same call, in warpgroup-uniform control flow; each
/// holds at least `N` registers per thread before it; the warpgroup's warps synchronise between
/// two `setmaxnreg`. PTX leaves any other use undefined.
#[inline(always)]
pub unsafe fn release_registers<const N: u32>() {
    // SAFETY: caller contract.
    unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const N, options(nostack)) };
}

/// `setmaxnreg.inc.sync.aligned.u32 N`: this warpgroup takes registers from the block's pool,
/// up to `N` per thread; it waits until another warpgroup has released enough (forever if the
/// pool cannot supply them).
///
/// # Safety
/// As [`release_registers`], but each warp holds at most `N` registers per thread before it.
#[inline(always)]
pub unsafe fn claim_registers<const N: u32>() {
    // SAFETY: caller contract.
    unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const N, options(nostack)) };
}

/// `bar.sync id, threads`: a barrier among `threads` threads (a multiple of 32) of the block that
/// use the same `id` (1..16; 0 is [`block_barrier`]'s). Orders their shared-memory accesses.
///
/// # Safety
/// Exactly `threads` threads, in whole warps, reach it with this `id`, in warp-uniform flow.
#[inline(always)]
pub unsafe fn named_barrier(id: u32, threads: u32) {
    // SAFETY: caller contract.
    unsafe { asm!("bar.sync {i}, {n};", i = in(reg32) id, n = in(reg32) threads, options(nostack)) };
}

/// `barrier.sync id, threads` (not `.aligned`): [`named_barrier`] for threads that may reach it
/// from divergent paths of their warp, such as a warp whose lane 0 ran a role alone before it.
/// The aligned form needs every lane of a warp at the same instruction together; a warp that
/// reconverges only at the barrier breaks that (compute-sanitizer's synccheck reports it).
///
/// # Safety
/// Exactly `threads` threads (a multiple of 32) reach it with this `id`, each once per use.
#[inline(always)]
pub unsafe fn named_barrier_unaligned(id: u32, threads: u32) {
    // SAFETY: caller contract.
    unsafe { asm!("barrier.sync {i}, {n};", i = in(reg32) id, n = in(reg32) threads, options(nostack)) };
}
