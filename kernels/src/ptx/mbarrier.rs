//! Shared-memory transaction barriers (PTX ISA §9.7.13.15 `mbarrier`), sm_90.
//!
//! An mbarrier is 8 bytes of shared memory that completes a *phase* when its expected arrivals
//! have arrived and its expected transaction bytes (from TMA / bulk copies) have landed. Waiters
//! name the phase parity they wait for; the barrier then flips to the next phase. All addresses
//! here are 32-bit shared-state-space addresses (see [`super::smem`]).

use core::arch::asm;

/// `mbarrier.init.shared::cta.b64 [bar], count`: a fresh barrier expecting `count` arrivals per
/// phase. Follow with [`fence_mbarrier_init`] and a block barrier before other threads use it.
///
/// # Safety
/// `bar` must be an 8-byte aligned shared address no one else uses yet.
#[inline(always)]
pub unsafe fn init(bar: u32, count: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("mbarrier.init.shared::cta.b64 [{b}], {c};", b = in(reg32) bar, c = in(reg32) count, options(nostack))
    };
}

/// `fence.mbarrier_init.release.cluster`: makes barrier initialisation visible to the async
/// proxy (TMA completes transactions on it) and to other threads.
#[inline(always)]
pub fn fence_mbarrier_init() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) };
}

/// `mbarrier.arrive.expect_tx.shared::cta.b64`: one arrival, and `bytes` more transaction
/// bytes expected in the current phase (the producer calls this before issuing its copies).
///
/// # Safety
/// `bar` must be an initialised barrier of this block.
#[inline(always)]
pub unsafe fn arrive_expect_tx(bar: u32, bytes: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{b}], {n};", b = in(reg32) bar, n = in(reg32) bytes,
             options(nostack));
    }
}

/// `mbarrier.expect_tx.relaxed.cta.shared::cta.b64`: `bytes` more transaction bytes expected in
/// the current phase, without arriving (the thread arrives later, after its own stores).
///
/// # Safety
/// `bar` must be an initialised barrier of this block.
#[inline(always)]
pub unsafe fn expect_tx(bar: u32, bytes: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [{b}], {n};", b = in(reg32) bar, n = in(reg32) bytes,
             options(nostack));
    }
}

/// `mbarrier.arrive.shared::cta.b64 _, [bar], count`: `count` arrivals at once (release semantics
/// at CTA scope): a producer that stands for threads which did not arrive themselves.
///
/// # Safety
/// `bar` must be an initialised barrier of this block, its current phase awaiting at least
/// `count` arrivals.
#[inline(always)]
pub unsafe fn arrive_count(bar: u32, count: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("mbarrier.arrive.shared::cta.b64 _, [{b}], {n};", b = in(reg32) bar, n = in(reg32) count,
             options(nostack));
    }
}

/// `mbarrier.arrive.shared::cta.b64`: one arrival (release semantics at CTA scope).
///
/// # Safety
/// `bar` must be an initialised barrier of this block.
#[inline(always)]
pub unsafe fn arrive(bar: u32) {
    // SAFETY: caller contract.
    unsafe { asm!("mbarrier.arrive.shared::cta.b64 _, [{b}];", b = in(reg32) bar, options(nostack)) };
}

/// `mbarrier.try_wait.parity.shared::cta.b64`: whether the phase with `parity` has completed
/// (acquire at CTA scope: the completed transactions' data is visible after `true`). The
/// hardware may suspend the thread for a while before answering `false`.
///
/// # Safety
/// `bar` must be an initialised barrier of this block.
#[inline(always)]
pub unsafe fn try_wait_parity(bar: u32, parity: u32) -> bool {
    let done: u32;
    // SAFETY: caller contract.
    unsafe {
        asm!("{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {ph}; selp.u32 {d}, 1, 0, p; }}",
             d = out(reg32) done, b = in(reg32) bar, ph = in(reg32) parity, options(nostack));
    }
    done != 0
}

/// Spins on [`try_wait_parity`] until the phase completes.
///
/// # Safety
/// `bar` must be an initialised barrier of this block, and some agent must complete the phase.
#[inline(always)]
pub unsafe fn wait_parity(bar: u32, parity: u32) {
    // SAFETY: caller contract.
    while !unsafe { try_wait_parity(bar, parity) } {}
}

/// Waits like [`wait_parity`] but gives up at `%globaltimer` ≥ `deadline_ns`; returns whether
/// the phase completed. For waits whose completion depends on another block or GPU.
///
/// # Safety
/// `bar` must be an initialised barrier of this block.
#[inline(always)]
pub unsafe fn wait_parity_until(bar: u32, parity: u32, deadline_ns: u64) -> bool {
    loop {
        // SAFETY: caller contract.
        if unsafe { try_wait_parity(bar, parity) } {
            return true;
        }
        if super::sreg::global_timer_ns() >= deadline_ns {
            return false;
        }
    }
}
