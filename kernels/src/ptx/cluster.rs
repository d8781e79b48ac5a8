//! Thread-block clusters (PTX ISA §9.7.13.3 `barrier.cluster`, §9.7.9.16 `mapa`, §9.7.9.12
//! `st.async`), sm_90: the blocks of a cluster run at the same time on one GPC and can reach each
//! other's shared memory and mbarriers through `shared::cluster` addresses.

use core::arch::asm;

/// `barrier.cluster.arrive.release` + `barrier.cluster.wait.acquire`: every non-exited thread
/// of every block of the cluster meets here; shared-memory writes before it (barrier
/// initialisation included) are visible cluster-wide after it.
///
/// # Safety
/// Every thread of every block of the cluster makes this call equally often, each thread's n-th
/// meeting the others' n-th (a thread that has exited no longer counts). Not `.aligned`: a warp
/// may reach it divergently. A running thread that skips it stalls the cluster for ever, and
/// unmatched calls pair the wrong phases, voiding what callers rely on (the partner's barriers
/// initialised, the partner not yet exited).
#[inline(always)]
pub unsafe fn cluster_sync() {
    // SAFETY: caller contract.
    unsafe { asm!("barrier.cluster.arrive.release;", "barrier.cluster.wait.acquire;", options(nostack)) };
}

/// `mapa.shared::cluster.u32`: the address, in the shared::cluster window, of the variable at
/// shared address `local` in the block of cluster rank `rank`.
#[inline(always)]
pub fn map_to_rank(local: u32, rank: u32) -> u32 {
    let remote: u32;
    // SAFETY: address arithmetic only.
    unsafe {
        asm!("mapa.shared::cluster.u32 {r}, {l}, {k};", r = out(reg32) remote, l = in(reg32) local,
             k = in(reg32) rank, options(pure, nomem, nostack));
    }
    remote
}

/// `mbarrier.arrive.shared::cluster.b64` (default `.release.cta` semantics): one arrival on a
/// barrier of (possibly) another block of the cluster. Enough to say "this stage has been read":
/// the reads (wgmma operand fetches) were waited for, nothing was written that the other block
/// must see. A `.release.cluster` arrival here cost the engine a third of its speed (PERF.md v12).
///
/// # Safety
/// `remote_bar` is a [`map_to_rank`] address of an initialised barrier of a block that has not
/// exited.
#[inline(always)]
pub unsafe fn arrive_remote(remote_bar: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("mbarrier.arrive.shared::cluster.b64 _, [{b}];", b = in(reg32) remote_bar, options(nostack));
    }
}

/// `st.async.shared::cluster.mbarrier::complete_tx::bytes.b32`: stores `value` at `remote_addr`
/// (a [`map_to_rank`] address in another block of the cluster) and completes 4 transaction bytes
/// on the barrier at `remote_bar` in that block once the store is visible there.
///
/// # Safety
/// Both addresses are [`map_to_rank`] addresses in one block that has not exited; the barrier
/// is initialised and expects the 4 bytes in its current phase (or will, before it completes).
#[inline(always)]
pub unsafe fn st_async_u32(remote_addr: u32, value: u32, remote_bar: u32) {
    // SAFETY: caller contract.
    unsafe {
        asm!("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [{a}], {v}, [{b}];",
             a = in(reg32) remote_addr, v = in(reg32) value, b = in(reg32) remote_bar, options(nostack));
    }
}

/// Waits for the phase with `parity` of this block's barrier `bar`, acquiring at cluster scope:
/// for a barrier completed by another block's [`st_async_u32`].
///
/// # Safety
/// `bar` is an initialised barrier of this block, and some agent completes the phase.
#[inline(always)]
pub unsafe fn wait_parity_acquire_cluster(bar: u32, parity: u32) {
    loop {
        let done: u32;
        // SAFETY: caller contract.
        unsafe {
            asm!("{{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [{b}], {ph}; selp.u32 {d}, 1, 0, p; }}",
                 d = out(reg32) done, b = in(reg32) bar, ph = in(reg32) parity, options(nostack));
        }
        if done != 0 {
            return;
        }
    }
}
