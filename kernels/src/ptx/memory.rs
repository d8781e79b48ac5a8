//! Scoped memory operations (PTX ISA §8 memory consistency model, §9.7.8 `ld`/`st`,
//! §9.7.13.5 `atom`, §9.7.13.6 `red`, §9.7.13.4 `fence`/`membar`).
//!
//! Every hand-over between blocks or GPUs goes through one of these:
//! - a producer writes its payload with ordinary stores, then publishes with a `release`
//!   store/add to a counter at the scope that covers the consumer (`cta` within a block,
//!   `gpu` between blocks of one GPU, `sys` between GPUs of one node over NVLink);
//! - the consumer polls the counter with an `acquire` load at the same scope and only then
//!   reads the payload.
//!
//! Functions are generated per scope so the scope is in the name: `ld_acquire_gpu_u32`, ...

use core::arch::asm;

macro_rules! scoped_ops {
    ($scope:literal, $ld_acquire:ident, $ld_relaxed:ident, $st_release:ident, $st_relaxed:ident,
     $atom_add_relaxed:ident, $atom_add_acq_rel:ident, $red_add_release:ident,
     $atom_cas_acq_rel:ident, $ld_acquire_u64:ident, $st_release_u64:ident) => {
        #[doc = concat!("`ld.acquire.", $scope, ".global.u32`: later reads of this thread see what the releasing writer wrote before its release.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 4-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $ld_acquire(ptr: *const u32) -> u32 {
            let value: u32;
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("ld.acquire.", $scope, ".global.u32 {v}, [{p}];"),
                     v = out(reg32) value, p = in(reg64) ptr, options(nostack));
            }
            value
        }

        #[doc = concat!("`ld.relaxed.", $scope, ".global.u32`: a coherent read at this scope, no ordering.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 4-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $ld_relaxed(ptr: *const u32) -> u32 {
            let value: u32;
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("ld.relaxed.", $scope, ".global.u32 {v}, [{p}];"),
                     v = out(reg32) value, p = in(reg64) ptr, options(nostack));
            }
            value
        }

        #[doc = concat!("`st.release.", $scope, ".global.u32`: publishes every earlier write of this thread.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 4-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $st_release(ptr: *mut u32, value: u32) {
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("st.release.", $scope, ".global.u32 [{p}], {v};"),
                     p = in(reg64) ptr, v = in(reg32) value, options(nostack));
            }
        }

        #[doc = concat!("`st.relaxed.", $scope, ".global.u32`.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 4-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $st_relaxed(ptr: *mut u32, value: u32) {
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("st.relaxed.", $scope, ".global.u32 [{p}], {v};"),
                     p = in(reg64) ptr, v = in(reg32) value, options(nostack));
            }
        }

        #[doc = concat!("`atom.relaxed.", $scope, ".global.add.u32`: returns the old value. Integer, so the final value does not depend on arrival order.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 4-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $atom_add_relaxed(ptr: *mut u32, value: u32) -> u32 {
            let old: u32;
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("atom.relaxed.", $scope, ".global.add.u32 {o}, [{p}], {v};"),
                     o = out(reg32) old, p = in(reg64) ptr, v = in(reg32) value, options(nostack));
            }
            old
        }

        #[doc = concat!("`atom.acq_rel.", $scope, ".global.add.u32`: returns the old value.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 4-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $atom_add_acq_rel(ptr: *mut u32, value: u32) -> u32 {
            let old: u32;
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("atom.acq_rel.", $scope, ".global.add.u32 {o}, [{p}], {v};"),
                     o = out(reg32) old, p = in(reg64) ptr, v = in(reg32) value, options(nostack));
            }
            old
        }

        #[doc = concat!("`red.release.", $scope, ".global.add.u32`: a signal (no return value) that publishes this thread's earlier writes.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 4-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $red_add_release(ptr: *mut u32, value: u32) {
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("red.release.", $scope, ".global.add.u32 [{p}], {v};"),
                     p = in(reg64) ptr, v = in(reg32) value, options(nostack));
            }
        }

        #[doc = concat!("`atom.acq_rel.", $scope, ".global.cas.b32`: returns the old value.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 4-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $atom_cas_acq_rel(ptr: *mut u32, expected: u32, new: u32) -> u32 {
            let old: u32;
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("atom.acq_rel.", $scope, ".global.cas.b32 {o}, [{p}], {e}, {n};"),
                     o = out(reg32) old, p = in(reg64) ptr, e = in(reg32) expected,
                     n = in(reg32) new, options(nostack));
            }
            old
        }

        #[doc = concat!("`ld.acquire.", $scope, ".global.u64`.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 8-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $ld_acquire_u64(ptr: *const u64) -> u64 {
            let value: u64;
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("ld.acquire.", $scope, ".global.u64 {v}, [{p}];"),
                     v = out(reg64) value, p = in(reg64) ptr, options(nostack));
            }
            value
        }

        #[doc = concat!("`st.release.", $scope, ".global.u64`.")]
        ///
        /// # Safety
        /// `ptr` must be a valid, 8-byte aligned global address.
        #[inline(always)]
        pub unsafe fn $st_release_u64(ptr: *mut u64, value: u64) {
            // SAFETY: caller guarantees a valid aligned global address.
            unsafe {
                asm!(concat!("st.release.", $scope, ".global.u64 [{p}], {v};"),
                     p = in(reg64) ptr, v = in(reg64) value, options(nostack));
            }
        }
    };
}

scoped_ops!(
    "cta",
    ld_acquire_cta_u32,
    ld_relaxed_cta_u32,
    st_release_cta_u32,
    st_relaxed_cta_u32,
    atom_add_relaxed_cta_u32,
    atom_add_acq_rel_cta_u32,
    red_add_release_cta_u32,
    atom_cas_acq_rel_cta_u32,
    ld_acquire_cta_u64,
    st_release_cta_u64
);
scoped_ops!(
    "gpu",
    ld_acquire_gpu_u32,
    ld_relaxed_gpu_u32,
    st_release_gpu_u32,
    st_relaxed_gpu_u32,
    atom_add_relaxed_gpu_u32,
    atom_add_acq_rel_gpu_u32,
    red_add_release_gpu_u32,
    atom_cas_acq_rel_gpu_u32,
    ld_acquire_gpu_u64,
    st_release_gpu_u64
);
scoped_ops!(
    "sys",
    ld_acquire_sys_u32,
    ld_relaxed_sys_u32,
    st_release_sys_u32,
    st_relaxed_sys_u32,
    atom_add_relaxed_sys_u32,
    atom_add_acq_rel_sys_u32,
    red_add_release_sys_u32,
    atom_cas_acq_rel_sys_u32,
    ld_acquire_sys_u64,
    st_release_sys_u64
);

/// `atom.shared::cta.add.u32` on a 32-bit shared-memory address; returns the old value.
///
/// # Safety
/// `smem_addr` must be a valid, 4-byte aligned shared-memory address of this block.
#[inline(always)]
pub unsafe fn atom_add_shared_u32(smem_addr: u32, value: u32) -> u32 {
    let old: u32;
    // SAFETY: caller guarantees a valid shared address.
    unsafe {
        asm!("atom.shared::cta.add.u32 {o}, [{a}], {v};",
             o = out(reg32) old, a = in(reg32) smem_addr, v = in(reg32) value, options(nostack));
    }
    old
}

/// `fence.acq_rel.gpu`: orders this thread's memory operations at GPU scope.
#[inline(always)]
pub fn fence_acq_rel_gpu() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.acq_rel.gpu;", options(nostack)) };
}

/// `fence.acq_rel.sys`: orders this thread's memory operations at system scope (peer GPUs).
#[inline(always)]
pub fn fence_acq_rel_sys() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.acq_rel.sys;", options(nostack)) };
}

/// `fence.sc.gpu`: sequentially consistent fence at GPU scope.
#[inline(always)]
pub fn fence_sc_gpu() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.sc.gpu;", options(nostack)) };
}

/// `fence.proxy.async.shared::cta`: makes this thread's generic-proxy writes to shared memory
/// visible to the async proxy (TMA, wgmma operands) — needed after `st.shared` and before a
/// barrier that hands the buffer to the tensor cores or the copy engine.
#[inline(always)]
pub fn fence_proxy_async_shared_cta() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) };
}

/// `fence.proxy.async.global`: the same between the generic and async proxies for global memory
/// (e.g. a TMA load of rows another block wrote with ordinary stores).
#[inline(always)]
pub fn fence_proxy_async_global() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.proxy.async.global;", options(nostack)) };
}

/// 16-byte global load (`ld.global.v4.u32`), the unit of row copies.
///
/// # Safety
/// `ptr` must be a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn ld_global_v4(ptr: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: caller guarantees a valid aligned global address.
    unsafe {
        asm!("ld.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg64) ptr, options(nostack, readonly));
    }
    [a, b, c, d]
}

/// 16-byte global store (`st.global.v4.u32`).
///
/// # Safety
/// `ptr` must be a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn st_global_v4(ptr: *mut u32, value: [u32; 4]) {
    // SAFETY: caller guarantees a valid aligned global address.
    unsafe {
        asm!("st.global.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
             p = in(reg64) ptr, a = in(reg32) value[0], b = in(reg32) value[1],
             c = in(reg32) value[2], d = in(reg32) value[3], options(nostack));
    }
}

/// 8-byte global store (`st.global.v2.u32`).
///
/// # Safety
/// `ptr` must be a valid, 8-byte aligned global address.
#[inline(always)]
pub unsafe fn st_global_v2(ptr: *mut u32, value: [u32; 2]) {
    // SAFETY: caller guarantees a valid aligned global address.
    unsafe {
        asm!("st.global.v2.u32 [{p}], {{{a}, {b}}};",
             p = in(reg64) ptr, a = in(reg32) value[0], b = in(reg32) value[1], options(nostack));
    }
}

/// 32-bit shared-memory load at a 32-bit shared address (`ld.shared.u32`).
///
/// # Safety
/// `smem_addr` must be a valid, 4-byte aligned shared address of this block.
#[inline(always)]
pub unsafe fn ld_shared_u32(smem_addr: u32) -> u32 {
    let value: u32;
    // SAFETY: caller guarantees a valid shared address.
    unsafe {
        asm!("ld.shared.u32 {v}, [{a}];", v = out(reg32) value, a = in(reg32) smem_addr,
             options(nostack, readonly));
    }
    value
}

/// 32-bit volatile shared-memory load (`ld.volatile.shared.u32`): exactly this word, never
/// merged by ptxas into a wider load of its neighbours (a widened load of a word that another
/// thread writes meanwhile is a race, even if the value goes unused).
///
/// # Safety
/// `smem_addr` is a valid, 4-byte aligned shared-memory address.
#[inline(always)]
pub unsafe fn ld_volatile_shared_u32(smem_addr: u32) -> u32 {
    let value: u32;
    // SAFETY: caller guarantees a valid shared address.
    unsafe {
        asm!("ld.volatile.shared.u32 {v}, [{a}];", v = out(reg32) value, a = in(reg32) smem_addr,
             options(nostack, readonly));
    }
    value
}

/// 32-bit shared-memory store (`st.shared.u32`).
///
/// # Safety
/// `smem_addr` must be a valid, 4-byte aligned shared address of this block.
#[inline(always)]
pub unsafe fn st_shared_u32(smem_addr: u32, value: u32) {
    // SAFETY: caller guarantees a valid shared address.
    unsafe {
        asm!("st.shared.u32 [{a}], {v};", a = in(reg32) smem_addr, v = in(reg32) value,
             options(nostack));
    }
}

/// 8-byte shared-memory store (`st.shared.v2.u32`).
///
/// # Safety
/// `smem_addr` is a valid, 8-byte aligned shared address.
#[inline(always)]
pub unsafe fn st_shared_v2(smem_addr: u32, value: [u32; 2]) {
    // SAFETY: caller guarantees a valid shared address.
    unsafe {
        asm!("st.shared.v2.u32 [{a}], {{{v0}, {v1}}};", a = in(reg32) smem_addr, v0 = in(reg32) value[0],
             v1 = in(reg32) value[1], options(nostack));
    }
}

/// 16-bit shared-memory store (`st.shared.u16`).
///
/// # Safety
/// `smem_addr` must be a valid, 2-byte aligned shared address of this block.
#[inline(always)]
pub unsafe fn st_shared_u16(smem_addr: u32, value: u16) {
    // SAFETY: caller guarantees a valid shared address.
    unsafe {
        asm!("st.shared.u16 [{a}], {v};", a = in(reg32) smem_addr, v = in(reg16) value,
             options(nostack));
    }
}

/// 16-byte shared-memory load (`ld.shared.v4.u32`).
///
/// # Safety
/// `smem_addr` must be a valid, 16-byte aligned shared address of this block.
#[inline(always)]
pub unsafe fn ld_shared_v4(smem_addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: caller guarantees a valid shared address.
    unsafe {
        asm!("ld.shared.v4.u32 {{{a}, {b}, {c}, {d}}}, [{s}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             s = in(reg32) smem_addr, options(nostack, readonly));
    }
    [a, b, c, d]
}

/// 16-byte shared-memory store (`st.shared.v4.u32`).
///
/// # Safety
/// `smem_addr` must be a valid, 16-byte aligned shared address of this block.
#[inline(always)]
pub unsafe fn st_shared_v4(smem_addr: u32, value: [u32; 4]) {
    // SAFETY: caller guarantees a valid shared address.
    unsafe {
        asm!("st.shared.v4.u32 [{s}], {{{a}, {b}, {c}, {d}}};",
             s = in(reg32) smem_addr, a = in(reg32) value[0], b = in(reg32) value[1],
             c = in(reg32) value[2], d = in(reg32) value[3], options(nostack));
    }
}
