//! Special registers (PTX ISA §10): thread and block coordinates, lane id, clocks.

use core::arch::asm;

macro_rules! sreg_u32 {
    ($(#[$doc:meta] $name:ident => $reg:literal;)*) => {$(
        #[$doc]
        #[inline(always)]
        pub fn $name() -> u32 {
            let value: u32;
            // SAFETY: reading a special register has no side effects.
            unsafe {
                asm!(concat!("mov.u32 {v}, ", $reg, ";"), v = out(reg32) value,
                     options(pure, nomem, nostack));
            }
            value
        }
    )*};
}

sreg_u32! {
    /// `%tid.x`: thread index within the block.
    thread_idx_x => "%tid.x";
    /// `%tid.y`.
    thread_idx_y => "%tid.y";
    /// `%ntid.x`: threads per block along x.
    block_dim_x => "%ntid.x";
    /// `%ctaid.x`: block index within the grid.
    block_idx_x => "%ctaid.x";
    /// `%ctaid.y`.
    block_idx_y => "%ctaid.y";
    /// `%ctaid.z`.
    block_idx_z => "%ctaid.z";
    /// `%nctaid.x`: blocks in the grid along x.
    grid_dim_x => "%nctaid.x";
    /// `%nctaid.y`.
    grid_dim_y => "%nctaid.y";
    /// `%laneid`: lane within the warp, 0..32.
    lane_id => "%laneid";
    /// `%smid`: the SM this block runs on (diagnostics only: it may change between launches).
    sm_id => "%smid";
    /// `%cluster_ctarank`: this block's rank in its cluster (0 without clusters).
    cluster_rank => "%cluster_ctarank";
}

/// `%globaltimer`: nanoseconds, common to all SMs of a GPU (coarse: updates every ~1 us on
/// some parts). Used for bounded waits, never for results.
#[inline(always)]
pub fn global_timer_ns() -> u64 {
    let value: u64;
    // SAFETY: reading a special register has no side effects. Not `pure`: it changes.
    unsafe { asm!("mov.u64 {v}, %globaltimer;", v = out(reg64) value, options(nomem, nostack)) };
    value
}

/// `%clock64`: this SM's cycle counter.
#[inline(always)]
pub fn clock64() -> u64 {
    let value: u64;
    // SAFETY: reading a special register has no side effects.
    unsafe { asm!("mov.u64 {v}, %clock64;", v = out(reg64) value, options(nomem, nostack)) };
    value
}
