//! Bounded waits and signals on exchange counters (device only).
//!
//! Protocol, in one place:
//! - a producer writes its payload with ordinary stores (or bulk copies, completed and fenced),
//!   the warp or block synchronises, and one thread adds to the counter with a **release**
//!   reduction ([`signal`]) at the scope that covers the consumer: `.gpu` when producer and
//!   consumer share a GPU (dispatch rows landing in the owner's own ring; every virtual rank),
//!   `.sys` when they may not (a push into another GPU's memory);
//! - the consumer polls the counter with **acquire** loads at the same scope ([`wait_until`])
//!   and only then reads the payload; other threads of its block read after a block barrier;
//! - every poll loop carries a `%globaltimer` deadline: on expiry the waiter returns the value it
//!   last saw and its caller writes an error record ([`super::error`]) and exits — never a hang,
//!   never a `trap`;
//! - counters that another rank adds to are never reset while ranks run: they grow by the rows of
//!   each pass, and the waiter keeps its own baseline (what it consumed before), so no reset can
//!   race with a fast peer's next signal. Counters only this rank adds to (its tile counters) are
//!   cleared in stream order before the pass. The one exception, the forward megakernel's
//!   `slot_ready` flags, which peers set: each rank clears its own in stream order before it
//!   publishes the pass, and a peer pushes only after its schedule has acquired that publish, so
//!   no push of the pass can land before the clearing;
//! - a wait may also stop early when an error record becomes non-zero (the waiter's own, or, in
//!   the megakernel's combine, the expert owner's). A record is read at the wait's scope (a
//!   wait at `.sys` may depend on a peer GPU's record), and written with a system-scope
//!   compare-and-swap ([`super::error::record`]), so the early stop also works across GPUs.

use super::error::has_error_at;
use crate::ptx::memory::{ld_acquire_gpu_u32, ld_acquire_sys_u32, red_add_release_gpu_u32, red_add_release_sys_u32};
use crate::ptx::{signal, sreg};

/// Polls without sleeping this many times before backing off (a signal that is about to land
/// is seen within a few hundred nanoseconds).
const SPIN_POLLS: u32 = 64;
/// Back-off between later polls, in nanoseconds.
const BACKOFF_NS: u32 = 256;

/// Acquire load of a counter at GPU (`sys == false`) or system scope.
///
/// # Safety
/// `counter` must be a valid, 4-byte aligned global address (local or peer-mapped).
#[inline(always)]
pub unsafe fn load_acquire(counter: *const u32, sys: bool) -> u32 {
    // SAFETY: caller contract.
    unsafe { if sys { ld_acquire_sys_u32(counter) } else { ld_acquire_gpu_u32(counter) } }
}

/// Adds `value` to `counter` with release semantics at GPU or system scope: every write this
/// thread made before, and every write ordered before it by a warp or block barrier, is visible
/// to a thread that acquires the new value.
///
/// # Safety
/// `counter` must be a valid, 4-byte aligned global address (local or peer-mapped).
#[inline(always)]
pub unsafe fn signal(counter: *mut u32, value: u32, sys: bool) {
    // SAFETY: caller contract.
    unsafe { if sys { red_add_release_sys_u32(counter, value) } else { red_add_release_gpu_u32(counter, value) } }
}

/// Polls `counter` until `ready(value)` holds, `timeout_ns` passes, or the error record `abort`
/// becomes non-zero (a wait it depends on already failed: stop early) — this rank's own, or the
/// record of the rank that would signal (read at the same scope as `counter`). `Ok(value)` when ready,
/// `Err(value last seen)` otherwise. Called by one thread; the value it acquired is visible to
/// its block after a block barrier.
///
/// # Safety
/// `counter` and `abort` must be valid, 4-byte aligned global addresses.
#[inline(always)]
pub unsafe fn wait_until(
    counter: *const u32,
    sys: bool,
    timeout_ns: u64,
    abort: *const u32,
    ready: impl Fn(u32) -> bool,
) -> Result<u32, u32> {
    let deadline = sreg::global_timer_ns().saturating_add(timeout_ns);
    let mut polls = 0u32;
    loop {
        // SAFETY: caller contract.
        let value = unsafe { load_acquire(counter, sys) };
        if ready(value) {
            return Ok(value);
        }
        // SAFETY: caller contract.
        if sreg::global_timer_ns() >= deadline || unsafe { has_error_at(abort, sys) } {
            return Err(value);
        }
        polls += 1;
        if polls > SPIN_POLLS {
            signal::nanosleep(BACKOFF_NS);
        }
    }
}
