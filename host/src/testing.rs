//! Test-only entry points (feature `testing`, enabled by the GPU tests): checked launchers of the
//! probe kernels that test the engine's primitives one at a time (`kernels/src/entry/probe_sm90.rs`).

use half::bf16;

use crate::driver::{DeviceBuffer, Gpu, KernelArg, LaunchShape};
use crate::error::{MokError, Result};
use crate::tensor_map::TensorMap;

fn bad(tensor: &'static str, problem: String) -> Result<()> {
    Err(MokError::InvalidInput { tensor, problem })
}

/// The rows of `map`'s box, once checked that it is the 2-D `[64, rows]` bf16 box the TMA probes
/// move and that `words` (named `tensor`) holds its `rows × 32` words.
fn box_rows_of(map: &TensorMap, (tensor, words): (&'static str, &DeviceBuffer<u32>)) -> Result<u32> {
    let &[inner, box_rows] = map.box_dims() else {
        return Err(MokError::InvalidInput {
            tensor: "tensor map",
            problem: format!("box {:?}: the probes move 2-D boxes", map.box_dims()),
        });
    };
    if map.element_bytes() != 2 || inner != 64 {
        return Err(MokError::InvalidInput {
            tensor: "tensor map",
            problem: format!(
                "box {:?} of {}-byte elements, expected [64, rows] bf16",
                map.box_dims(),
                map.element_bytes()
            ),
        });
    }
    if words.len() < box_rows as usize * 32 {
        return Err(MokError::InvalidInput {
            tensor,
            problem: format!("{} words for a box of {box_rows} rows of 32 words", words.len()),
        });
    }
    Ok(box_rows)
}

/// One TMA copy of `map`'s box at `(c0, c1)` into swizzled shared memory, copied word for word
/// to `out` (`box_rows × 32` words): `mok_probe_tma_load`. The map must be a 2-D bf16 map with a
/// 64-element inner box.
///
/// # Safety
/// The tensor `map` was encoded over must still be allocated with the dims the map names (a
/// map borrows nothing, and the copy reads through it unchecked).
pub unsafe fn probe_tma_load(gpu: &Gpu, map: &TensorMap, (c0, c1): (i32, i32), out: &DeviceBuffer<u32>) -> Result<()> {
    let box_rows = box_rows_of(map, ("out", out))?;
    let shape = LaunchShape { grid: (1, 1, 1), threads: 32, smem_bytes: box_rows * 128 + 1024 + 64 };
    let args = [
        KernelArg::Ptr(map.device_ptr()),
        KernelArg::U32(c0 as u32),
        KernelArg::U32(c1 as u32),
        KernelArg::U32(box_rows),
        KernelArg::Ptr(out.device_ptr()),
    ];
    // SAFETY: the probe's parameters in order and type; the map is a 2-D bf16 map with the box
    // the kernel expects (checked), `out` holds the box's words (checked), and shared memory
    // holds the box, the alignment slack and the barrier.
    unsafe { gpu.launch("mok_probe_tma_load", shape, &args) }
}

/// `values` (`box_rows × 32` words) put in shared memory as they are, then one TMA store of the
/// box to `map` at `(c0, c1)`: `mok_probe_tma_store`. The map must be a 2-D bf16 map with a
/// 64-element inner box (128B swizzle: shared chunk `c ^ (r % 8)` of row `r` lands at chunk `c`).
///
/// # Safety
/// The tensor `map` was encoded over must still be allocated with the dims the map names, and
/// nothing else may use the box's elements until the stream has run the store (the store
/// writes through the map unchecked).
pub unsafe fn probe_tma_store(
    gpu: &Gpu,
    map: &TensorMap,
    (c0, c1): (i32, i32),
    values: &DeviceBuffer<u32>,
) -> Result<()> {
    let box_rows = box_rows_of(map, ("values", values))?;
    let shape = LaunchShape { grid: (1, 1, 1), threads: 32, smem_bytes: box_rows * 128 + 1024 };
    let args = [
        KernelArg::Ptr(map.device_ptr()),
        KernelArg::U32(c0 as u32),
        KernelArg::U32(c1 as u32),
        KernelArg::U32(box_rows),
        KernelArg::Ptr(values.device_ptr()),
    ];
    // SAFETY: the probe's parameters in order and type; the map is a 2-D bf16 map with the box
    // the kernel expects (checked), `values` holds the box's words (checked), and shared memory
    // holds the box and the alignment slack.
    unsafe { gpu.launch("mok_probe_tma_store", shape, &args) }
}

/// Two warps hand `rounds` values through a ring of `stages` one-word slots guarded by full and
/// empty mbarriers; the consumer writes round r's value to `out[r]`: `mok_probe_mbarrier_ring`.
pub fn probe_mbarrier_ring(gpu: &Gpu, stages: u32, rounds: u32, out: &DeviceBuffer<u32>) -> Result<()> {
    if !(1..=16).contains(&stages) {
        return bad("stages", format!("{stages}: the probe's ring has 1..=16 stages"));
    }
    if out.len() < rounds as usize {
        return bad("out", format!("{} words for {rounds} rounds", out.len()));
    }
    let shape = LaunchShape { grid: (1, 1, 1), threads: 64, smem_bytes: 2048 };
    let args = [KernelArg::U32(stages), KernelArg::U32(rounds), KernelArg::Ptr(out.device_ptr())];
    // SAFETY: the probe's parameters in order and type; 64 threads, ≤ 16 stages and `out` of
    // `rounds` words (checked); 2 KiB of shared memory holds the slots and barriers.
    unsafe { gpu.launch("mok_probe_mbarrier_ring", shape, &args) }
}

/// One warpgroup's `wgmma.m64n256k16` × 4 over one 64-deep K block: `out[64][256] = A · B` with
/// A 4096 and B 16384 bf16 in `mode` 0 (both K-major), 1 (B N-major) or 2 (A M-major, B
/// N-major): `mok_probe_wgmma_tile`.
pub fn probe_wgmma_tile(
    gpu: &Gpu,
    a: &DeviceBuffer<bf16>,
    b: &DeviceBuffer<bf16>,
    mode: u32,
    out: &DeviceBuffer<f32>,
) -> Result<()> {
    if mode > 2 {
        return bad("mode", format!("{mode}: 0, 1 or 2"));
    }
    if a.len() < 64 * 64 || b.len() < 256 * 64 || out.len() < 64 * 256 {
        return bad(
            "a, b, out",
            format!("{}, {}, {} elements, expected 4096, 16384, 16384", a.len(), b.len(), out.len()),
        );
    }
    let shape = LaunchShape { grid: (1, 1, 1), threads: 128, smem_bytes: 8192 + 32768 + 1024 };
    let args = [
        KernelArg::Ptr(a.device_ptr()),
        KernelArg::Ptr(b.device_ptr()),
        KernelArg::U32(mode),
        KernelArg::Ptr(out.device_ptr()),
    ];
    // SAFETY: the probe's parameters in order and type; 128 threads, the operand and output
    // sizes it reads and writes (checked), and its 8 + 32 + 1 KiB of shared memory.
    unsafe { gpu.launch("mok_probe_wgmma_tile", shape, &args) }
}
