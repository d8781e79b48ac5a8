//! Typed device allocations.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytemuck::Pod;
use cudarc::driver::{result, sys};

use super::cuda_error;
use super::gpu::GpuInner;
use crate::driver::Gpu;
use crate::error::{MokError, Result};

/// Bytes of every [`DeviceBuffer`] of this process that is alive now, and how many there are:
/// a soak test reads them before and after to prove nothing leaks.
static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);
static LIVE_BUFFERS: AtomicU64 = AtomicU64::new(0);

/// `(buffers, bytes)` of the [`DeviceBuffer`]s alive in this process, over every GPU.
pub fn live_device_buffers() -> (u64, u64) {
    (LIVE_BUFFERS.load(Ordering::Relaxed), LIVE_BYTES.load(Ordering::Relaxed))
}

/// `len` elements of `T` in device memory, freed on drop. Copies are ordered on the GPU's
/// stream, so they are ordered with mok's kernels.
pub struct DeviceBuffer<T: Pod> {
    ptr: sys::CUdeviceptr,
    len: usize,
    gpu: Arc<GpuInner>,
    _element: PhantomData<T>,
}

impl<T: Pod> DeviceBuffer<T> {
    /// Allocates `len` elements (at least one byte is allocated so the pointer is never null).
    /// The contents are undefined: fill or upload before reading. A `len` whose bytes overflow
    /// `usize` is an `InvalidInput` (so every later `len · size_of::<T>()` fits).
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<Self> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| MokError::InvalidInput {
            tensor: "device buffer",
            problem: format!("{len} elements of {} bytes overflow the address space", size_of::<T>()),
        })?;
        let bytes = bytes.max(16);
        let inner = gpu.inner().clone();
        inner.bind()?;
        // SAFETY: plain allocation in the current context.
        let ptr =
            unsafe { result::malloc_sync(bytes) }.map_err(|e| cuda_error(format!("cuMemAlloc({bytes} bytes)"), e))?;
        LIVE_BUFFERS.fetch_add(1, Ordering::Relaxed);
        LIVE_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(Self { ptr, len, gpu: inner, _element: PhantomData })
    }

    /// Allocates and uploads `data`.
    pub fn from_slice(gpu: &Gpu, data: &[T]) -> Result<Self> {
        let mut buffer = Self::alloc(gpu, data.len())?;
        buffer.upload(data)?;
        Ok(buffer)
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address, for kernel arguments.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Copies `data` in (synchronously with respect to the host).
    pub fn upload(&mut self, data: &[T]) -> Result<()> {
        self.check_len("upload", data.len())?;
        self.gpu.bind_to_wait("an upload")?;
        // SAFETY: `data` has exactly `len` elements and the allocation holds that many; the
        // call returns after the copy, so `data` outlives it.
        unsafe {
            result::memcpy_htod_async(self.ptr, data, self.gpu.stream)
                .map_err(|e| cuda_error("cuMemcpyHtoDAsync", e))?;
            result::stream::synchronize(self.gpu.stream).map_err(|e| cuda_error("cuStreamSynchronize (upload)", e))
        }
    }

    /// Copies the contents out, after all earlier work on the stream.
    pub fn download(&self) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        self.gpu.bind_to_wait("a download")?;
        // SAFETY: `out` has `len` elements; the stream is synchronised before `out` is used.
        unsafe {
            result::memcpy_dtoh_async(&mut out, self.ptr, self.gpu.stream)
                .map_err(|e| cuda_error("cuMemcpyDtoHAsync", e))?;
            result::stream::synchronize(self.gpu.stream)
                .map_err(|e| cuda_error("cuStreamSynchronize (download)", e))?;
        }
        Ok(out)
    }

    /// Sets element `index` of a u32 buffer to `value`, ordered on the stream (a memset, so a
    /// captured graph replays it).
    pub(crate) fn fill_u32_at(&mut self, index: usize, value: u32) -> Result<()>
    where
        T: Copy,
    {
        if size_of::<T>() != 4 || index >= self.len {
            return Err(MokError::InvalidInput {
                tensor: "buffer word",
                problem: format!("index {index} of {} elements of {} bytes", self.len, size_of::<T>()),
            });
        }
        self.gpu.bind()?;
        // SAFETY: one 4-byte word inside this allocation.
        unsafe { sys::cuMemsetD32Async(self.ptr + 4 * index as u64, value, 1, self.gpu.stream) }
            .result()
            .map_err(|e| cuda_error("cuMemsetD32Async", e))
    }

    /// Enqueues a copy of the first `len` elements to device address `dst` on the stream.
    ///
    /// # Safety
    /// `len` is at most the buffer's length (`DeviceBuffer::copy_to` checks it), and `dst` holds
    /// `len` elements of `T` that stay allocated, and that nothing else writes, until the stream
    /// has run the copy.
    pub(crate) unsafe fn copy_into_address(&self, dst: u64, len: usize) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: `dst` and this allocation hold at least `len` elements (caller contract); the
        // copy is ordered on the stream with every kernel that reads or writes either.
        unsafe { result::memcpy_dtod_async(dst, self.ptr, len * size_of::<T>(), self.gpu.stream) }
            .map_err(|e| cuda_error("cuMemcpyDtoDAsync", e))
    }

    /// Enqueues a copy of `len` elements from device address `src` into the start of this
    /// buffer, on the stream.
    ///
    /// # Safety
    /// `src` holds `len` elements of `T` that stay allocated until the stream has run the copy.
    pub(crate) unsafe fn copy_from_address(&mut self, src: u64, len: usize) -> Result<()> {
        if len > self.len {
            return Err(MokError::InvalidInput {
                tensor: "device buffer",
                problem: format!("a copy of {len} elements into a buffer of {}", self.len),
            });
        }
        self.gpu.bind()?;
        // SAFETY: `src` holds `len` elements (caller contract) and this allocation at least as
        // many (checked); the copy is ordered on the stream with every kernel using either.
        unsafe { result::memcpy_dtod_async(self.ptr, src, len * size_of::<T>(), self.gpu.stream) }
            .map_err(|e| cuda_error("cuMemcpyDtoDAsync", e))
    }

    /// Sets every byte to `byte`, ordered on the stream (0xff poisons f32 and bf16 as NaN).
    pub fn fill_bytes(&mut self, byte: u8) -> Result<()> {
        if self.len == 0 {
            // An empty buffer (a layer's own weight gradients before their first use).
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: the range is this allocation.
        unsafe { result::memset_d8_async(self.ptr, byte, self.len * size_of::<T>(), self.gpu.stream) }
            .map_err(|e| cuda_error("cuMemsetD8Async", e))
    }

    fn check_len(&self, what: &str, len: usize) -> Result<()> {
        if len == self.len {
            Ok(())
        } else {
            Err(MokError::InvalidInput {
                tensor: "device buffer",
                problem: format!("{what} of {len} elements into a buffer of {}", self.len),
            })
        }
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc`; freeing waits for work using it (cuMemFree is
        // synchronous with respect to the device). A failure here cannot be acted on.
        unsafe {
            let _ = self.gpu.bind();
            let _ = result::free_sync(self.ptr);
        }
        LIVE_BUFFERS.fetch_sub(1, Ordering::Relaxed);
        LIVE_BYTES.fetch_sub((self.len * size_of::<T>()).max(16) as u64, Ordering::Relaxed);
    }
}
