//! Copies and fills at raw device addresses, ordered on a GPU's stream: for memory a
//! [`DeviceBuffer`](super::DeviceBuffer) does not own, such as a region of a symmetric heap.

use bytemuck::Pod;
use cudarc::driver::result;

use super::cuda_error;
use super::gpu::Gpu;
use crate::error::Result;

impl Gpu {
    /// Copies `data` to device address `dst` and waits for the copy (so `data` may go).
    ///
    /// # Safety
    /// `dst` must be a device allocation (or mapping) of this process with room for `data`.
    pub unsafe fn copy_to_device<T: Pod>(&self, dst: u64, data: &[T]) -> Result<()> {
        let inner = self.inner();
        inner.bind_to_wait("an upload")?;
        // SAFETY: caller contract for `dst`; `data` outlives the call, which synchronises.
        unsafe {
            result::memcpy_htod_async(dst, data, inner.stream).map_err(|e| cuda_error("cuMemcpyHtoDAsync", e))?;
            result::stream::synchronize(inner.stream).map_err(|e| cuda_error("cuStreamSynchronize (copy_to_device)", e))
        }
    }

    /// Copies `len` elements from device address `src` after all earlier work on the stream.
    ///
    /// # Safety
    /// `src` must be a device allocation (or mapping) of this process holding `len` elements.
    pub unsafe fn copy_from_device<T: Pod>(&self, src: u64, len: usize) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); len];
        let inner = self.inner();
        inner.bind_to_wait("a download")?;
        // SAFETY: caller contract for `src`; `out` is synchronised before it is used.
        unsafe {
            result::memcpy_dtoh_async(&mut out, src, inner.stream).map_err(|e| cuda_error("cuMemcpyDtoHAsync", e))?;
            result::stream::synchronize(inner.stream)
                .map_err(|e| cuda_error("cuStreamSynchronize (copy_from_device)", e))?;
        }
        Ok(out)
    }

    /// Enqueues a device-to-device copy of `bytes` bytes.
    ///
    /// # Safety
    /// Both ranges must be device memory (or mappings) this GPU can access.
    pub unsafe fn copy_device_to_device(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let inner = self.inner();
        inner.bind()?;
        // SAFETY: caller contract.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, inner.stream) }
            .map_err(|e| cuda_error("cuMemcpyDtoDAsync", e))
    }

    /// Enqueues setting `bytes` bytes at `dst` to `byte`.
    ///
    /// # Safety
    /// The range must be device memory (or a mapping) this GPU can access.
    pub unsafe fn fill_device_bytes(&self, dst: u64, byte: u8, bytes: usize) -> Result<()> {
        let inner = self.inner();
        inner.bind()?;
        // SAFETY: caller contract.
        unsafe { result::memset_d8_async(dst, byte, bytes, inner.stream) }.map_err(|e| cuda_error("cuMemsetD8Async", e))
    }
}
