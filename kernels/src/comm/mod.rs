//! The expert-parallel exchange: the symmetric heap's layout, the device-side schedule, the row
//! movers and the counter signalling between ranks.
//!
//! Host and device: [`params`] (heap layout, parameter block), [`schedule`] (where every row
//! lands; index math), [`error`] (the error record's words).
//! Device only: `wait` (bounded waits, release signals), `plan` (publish, schedule and
//! ring-map steps), `movers` (pull dispatch and reverse-combine, push combine and
//! reverse-dispatch, with 16-byte vectors or bulk copies), `combine` (the token owner's fixed
//! order sum of its slots). Each is a block- or warp-level function a persistent kernel can call
//! on the work it was given; `crate::entry::exchange` wraps them as standalone kernels.
//!
//! Directions (MoK's choice): forward dispatch **pulls** (the expert owner reads the token
//! owner's x), forward combine **pushes** (the expert owner writes each (token, slot) result into
//! the token owner's slot buffer); backward reverse-combine pulls dy, reverse-dispatch pushes dx
//! contributions. A pull needs only a local "rows landed" signal for the compute that follows on
//! the same GPU; a push carries its own data, so the one remote signal per row travels with it.

pub mod error;
pub mod params;
pub mod schedule;

#[cfg(target_arch = "nvptx64")]
pub mod combine;
#[cfg(target_arch = "nvptx64")]
pub mod movers;
#[cfg(target_arch = "nvptx64")]
pub mod plan;
#[cfg(target_arch = "nvptx64")]
pub mod wait;

/// Which pass a mover or a combine serves: it picks the regions and counters.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Pass {
    /// Forward: pull x into `ring_x`, push combine rows into `combine_slots`.
    Forward,
    /// Backward: pull scaled dy into `ring_dy`, push dx rows into `dx_slots`.
    Backward,
}

impl Pass {
    /// The pass named by a kernel argument (0 forward, anything else backward).
    #[inline(always)]
    pub const fn from_arg(arg: u32) -> Self {
        if arg == 0 { Pass::Forward } else { Pass::Backward }
    }
}

/// One rank's view of the heap inside a kernel: the parameter block and which rank this is.
#[cfg(target_arch = "nvptx64")]
#[derive(Clone, Copy)]
pub struct RankView<'a> {
    /// The parameter block (device memory).
    pub params: &'a params::ExchangeParams,
    /// This rank.
    pub rank: u32,
}

#[cfg(target_arch = "nvptx64")]
impl<'a> RankView<'a> {
    /// The view of rank `rank` through the parameter block at `params`.
    ///
    /// # Safety
    /// `params` points at a parameter block the host built, read-only for `'a` (the launch);
    /// `rank < world`.
    #[inline(always)]
    pub unsafe fn from_raw(params: *const params::ExchangeParams, rank: u32) -> Self {
        // SAFETY: caller contract.
        RankView { params: unsafe { &*params }, rank }
    }
}

#[cfg(target_arch = "nvptx64")]
impl RankView<'_> {
    /// `region` in this rank's slice.
    #[inline(always)]
    pub fn local<T>(&self, region: u64) -> *mut T {
        self.params.map(region, self.rank) as *mut T
    }

    /// `region` in `peer`'s slice.
    #[inline(always)]
    pub fn peer<T>(&self, region: u64, peer: u32) -> *mut T {
        self.params.map(region, peer) as *mut T
    }

    /// This rank's error record.
    #[inline(always)]
    pub fn error(&self) -> *mut u32 {
        self.local(self.params.regions.error)
    }

    /// Scope of signals that may cross GPUs.
    #[inline(always)]
    pub fn sys(&self) -> bool {
        self.params.sys_scope != 0
    }

    /// Records a timeout of a wait on `counter_index` of kind `waited_for`, signalled by `peer`.
    ///
    /// # Safety
    /// The view's error record must be valid (it is, for a parameter block the host built).
    #[inline(always)]
    pub unsafe fn record_timeout(
        &self,
        waited_for: u32,
        peer: u32,
        counter_index: u32,
        expected: u32,
        seen: u32,
        epoch: u32,
    ) {
        // SAFETY: caller contract.
        unsafe {
            error::record(
                self.error(),
                [error::ERROR_TIMEOUT, waited_for, peer, counter_index, expected, seen, self.rank, epoch],
            )
        }
    }
}
