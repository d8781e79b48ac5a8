//! The dynamic shared-memory window (PTX ISA §5.1.5 `.shared`, `.extern` arrays).
//!
//! rustc has no `__shared__` statics, so every kernel carves its shared memory out of one
//! 1024-byte aligned extern array whose size the host sets at launch (1024 bytes is what
//! 128-byte-swizzled TMA tiles need).

use core::arch::{asm, global_asm};

global_asm!(".extern .shared .align 1024 .b8 mok_dynamic_smem[];");

/// The 32-bit shared-state-space address of the start of dynamic shared memory.
#[inline(always)]
pub fn dynamic_smem_base() -> u32 {
    let addr: u32;
    // SAFETY: takes the address of a symbol, no memory access.
    unsafe { asm!("mov.u32 {a}, mok_dynamic_smem;", a = out(reg32) addr, options(pure, nomem, nostack)) };
    addr
}

/// The generic address of a shared-memory address (`cvta.shared.u64`), for code that wants
/// ordinary Rust pointers into shared memory.
#[inline(always)]
pub fn shared_to_generic(smem_addr: u32) -> *mut u8 {
    let generic: u64;
    // SAFETY: address arithmetic only.
    unsafe {
        asm!("cvta.shared.u64 {g}, {s};", g = out(reg64) generic, s = in(reg64) smem_addr as u64,
             options(pure, nomem, nostack));
    }
    generic as *mut u8
}
