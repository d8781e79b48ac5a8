//! TMA tensor maps (`CUtensorMap`) built on the host with `cuTensorMapEncodeTiled` and kept in
//! device memory: rustc has no `__grid_constant__` kernel parameters, so kernels receive the
//! map's device address.

use half::bf16;

use crate::driver::{DeviceBuffer, Gpu};
use crate::error::{MokError, Result};

/// A bf16 or f32 tensor map with 128-byte swizzle and zero fill out of bounds, in device memory.
pub struct TensorMap {
    storage: DeviceBuffer<u64>,
    element_bytes: usize,
    box_dims: Vec<u32>,
}

impl TensorMap {
    /// A map over the tensor at device address `base` with `dims` (innermost first, elements),
    /// `pitches` (bytes between consecutive indices of dims 1.. , so `dims.len() - 1` entries)
    /// and box `box_dims` (innermost box dimension: 64 elements = the 128-byte swizzle row).
    pub fn bf16(gpu: &Gpu, base: u64, dims: &[u64], pitches: &[u64], box_dims: &[u32]) -> Result<Self> {
        use cudarc::driver::sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
        Self::encode(gpu, (CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, size_of::<bf16>()), base, dims, pitches, box_dims)
    }

    /// As [`TensorMap::bf16`] for f32 elements (innermost box dimension: 32 elements).
    pub fn f32(gpu: &Gpu, base: u64, dims: &[u64], pitches: &[u64], box_dims: &[u32]) -> Result<Self> {
        use cudarc::driver::sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
        Self::encode(gpu, (CU_TENSOR_MAP_DATA_TYPE_FLOAT32, size_of::<f32>()), base, dims, pitches, box_dims)
    }

    fn encode(
        gpu: &Gpu,
        (data_type, element_bytes): (cudarc::driver::sys::CUtensorMapDataType, usize),
        base: u64,
        dims: &[u64],
        pitches: &[u64],
        box_dims: &[u32],
    ) -> Result<Self> {
        let rank = dims.len();
        let bad = |problem: String| Err(MokError::InvalidInput { tensor: "tensor map", problem });
        if !(1..=5).contains(&rank) || pitches.len() + 1 != rank || box_dims.len() != rank {
            return bad(format!("rank {rank} with {} pitches and {} box dims", pitches.len(), box_dims.len()));
        }
        if !base.is_multiple_of(16) || pitches.iter().any(|p| !p.is_multiple_of(16)) {
            return bad(format!("base {base:#x} and pitches {pitches:?} must be multiples of 16 bytes"));
        }
        if dims.contains(&0) || box_dims.iter().any(|&b| b == 0 || b > 256) {
            return bad(format!("dims {dims:?} must be ≥ 1 and box {box_dims:?} within 1..=256"));
        }
        if box_dims[0] as usize * element_bytes > 128 {
            return bad(format!("inner box {} elements exceeds the 128-byte swizzle span", box_dims[0]));
        }
        let mut map = cudarc::driver::sys::CUtensorMap { opaque: [0; 16] };
        let element_strides = vec![1u32; rank];
        use cudarc::driver::sys::*;
        // SAFETY: every array has `rank` (pitches: rank - 1) entries as checked above; `map` is a
        // writable 128-byte tensor map; the call only encodes, it does not touch device memory.
        let status = unsafe {
            cuTensorMapEncodeTiled(
                &mut map,
                data_type,
                rank as u32,
                base as *mut core::ffi::c_void,
                dims.as_ptr(),
                pitches.as_ptr(),
                box_dims.as_ptr(),
                element_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        status.result().map_err(|e| {
            crate::driver::cuda_error(format!("cuTensorMapEncodeTiled(dims {dims:?}, box {box_dims:?})"), e)
        })?;
        Ok(Self { storage: DeviceBuffer::from_slice(gpu, &map.opaque)?, element_bytes, box_dims: box_dims.to_vec() })
    }

    /// Bytes of one element (2 for bf16, 4 for f32).
    pub fn element_bytes(&self) -> usize {
        self.element_bytes
    }

    /// The box one copy moves, innermost dimension first (elements).
    pub fn box_dims(&self) -> &[u32] {
        &self.box_dims
    }

    /// Device address of the map (64-byte aligned: device allocations are 256-byte aligned).
    pub fn device_ptr(&self) -> u64 {
        self.storage.device_ptr()
    }
}
