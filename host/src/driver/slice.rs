//! Borrowed views of device memory: what mok's public layer takes from a caller — its own
//! [`DeviceBuffer`]s, a framework's cudarc `CudaSlice`s, or raw pointers — without copying or
//! owning it.

use std::marker::PhantomData;

use bytemuck::Pod;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::DeviceBuffer;
use crate::error::{MokError, Result};

/// A view `tensor` starting at device address `ptr` is `bytes`-aligned, as the kernels that read
/// or write it in `bytes`-byte units (vector loads, TMA) need; a view cut at an odd element
/// would fault on the device instead.
pub(crate) fn check_aligned(tensor: &'static str, ptr: u64, bytes: u64) -> Result<()> {
    if ptr.is_multiple_of(bytes) {
        Ok(())
    } else {
        Err(MokError::InvalidInput {
            tensor,
            problem: format!(
                "device address {ptr:#x} is not {bytes}-byte aligned (the kernels access it in {bytes}-byte units)"
            ),
        })
    }
}

/// `len` elements of `T` in device memory that someone else owns, borrowed for `'a` (read).
#[derive(Debug)]
pub struct DeviceSlice<'a, T> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a [T]>,
}

impl<T> Clone for DeviceSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DeviceSlice<'_, T> {}

/// `len` elements of `T` in device memory that someone else owns, borrowed for `'a` to be
/// written.
#[derive(Debug)]
pub struct DeviceSliceMut<'a, T> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T> DeviceSlice<'a, T> {
    /// A view of `len` elements at device address `ptr`.
    ///
    /// # Safety
    /// `ptr` is a device allocation of the GPU the view is used on, holding at least `len`
    /// elements of `T`, aligned for `T` (16 bytes for the rows mok reads as vectors), that stays
    /// allocated and is not written by anyone else for `'a` (mok's kernels read it on their
    /// stream until it has run what they enqueued).
    pub unsafe fn from_raw_parts(ptr: u64, len: usize) -> Self {
        Self { ptr, len, _borrow: PhantomData }
    }

    /// A view of a cudarc slice, for mok's kernels on `stream`. Stream order is what keeps the
    /// slice's memory valid for them: cudarc's events are not relied on.
    ///
    /// # Safety
    /// `stream` is the stream mok runs on (the `Gpu` opened on it with
    /// `mok::open_gpu_on_stream`), and the slice is freed on that stream too (cudarc frees a
    /// slice with `cuMemFreeAsync` on the stream it was allocated on: a free on another stream
    /// may run before mok's work on the memory has). Nothing but mok writes the slice from the
    /// view's creation until the stream has run mok's work that uses it (for a `MoeLayer` pass's
    /// inputs, until its backward has run): cudarc's read and write events, recorded when the
    /// view is made, do not cover work mok enqueues later.
    pub unsafe fn from_cudarc(slice: &'a CudaSlice<T>, stream: &CudaStream) -> Self {
        let (ptr, _record) = slice.device_ptr(stream);
        Self { ptr, len: slice.len(), _borrow: PhantomData }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The `len` elements from element `start` on, as a view of the same borrow (`None` past the
    /// end).
    pub fn sub(&self, start: usize, len: usize) -> Option<DeviceSlice<'a, T>> {
        (start.checked_add(len)? <= self.len).then(|| DeviceSlice {
            ptr: self.ptr + (start * size_of::<T>()) as u64,
            len,
            _borrow: PhantomData,
        })
    }
}

impl<'a, T> DeviceSliceMut<'a, T> {
    /// A writable view of `len` elements at device address `ptr`.
    ///
    /// # Safety
    /// As [`DeviceSlice::from_raw_parts`], and nothing else reads or writes it for `'a`.
    pub unsafe fn from_raw_parts(ptr: u64, len: usize) -> Self {
        Self { ptr, len, _borrow: PhantomData }
    }

    /// A writable view of a cudarc slice, on the stream mok runs on (see
    /// [`DeviceSlice::from_cudarc`]).
    ///
    /// # Safety
    /// As [`DeviceSlice::from_cudarc`], and nothing but mok reads or writes the slice until the
    /// stream has run mok's work that uses it.
    pub unsafe fn from_cudarc(slice: &'a mut CudaSlice<T>, stream: &CudaStream) -> Self {
        let len = slice.len();
        let (ptr, _record) = slice.device_ptr_mut(stream);
        Self { ptr, len, _borrow: PhantomData }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// A shorter-lived writable view of the same memory.
    pub fn reborrow(&mut self) -> DeviceSliceMut<'_, T> {
        DeviceSliceMut { ptr: self.ptr, len: self.len, _borrow: PhantomData }
    }

    /// A shorter-lived writable view of the `len` elements from element `start` on (`None` past
    /// the end).
    pub fn sub_mut(&mut self, start: usize, len: usize) -> Option<DeviceSliceMut<'_, T>> {
        (start.checked_add(len)? <= self.len).then(|| DeviceSliceMut {
            ptr: self.ptr + (start * size_of::<T>()) as u64,
            len,
            _borrow: PhantomData,
        })
    }
}

impl<'a, T: Pod> From<&'a DeviceBuffer<T>> for DeviceSlice<'a, T> {
    fn from(buffer: &'a DeviceBuffer<T>) -> Self {
        Self { ptr: buffer.device_ptr(), len: buffer.len(), _borrow: PhantomData }
    }
}

impl<'a, T: Pod> From<&'a mut DeviceBuffer<T>> for DeviceSliceMut<'a, T> {
    fn from(buffer: &'a mut DeviceBuffer<T>) -> Self {
        Self { ptr: buffer.device_ptr(), len: buffer.len(), _borrow: PhantomData }
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// Enqueues a copy of the buffer's first `dst.len()` elements into `dst` on the stream (a
    /// device-to-device copy; no host synchronisation). `dst` may not be longer than the buffer.
    pub fn copy_to(&self, dst: &mut DeviceSliceMut<'_, T>) -> crate::error::Result<()> {
        if dst.len() > self.len() {
            return Err(crate::error::MokError::InvalidInput {
                tensor: "copy destination",
                problem: format!("{} elements, the source has {}", dst.len(), self.len()),
            });
        }
        // SAFETY: `dst.len()` ≤ this buffer's length (checked above); `dst` is a mutable view of
        // that many elements, borrowed from a buffer whose freeing waits for the work using it.
        unsafe { self.copy_into_address(dst.device_ptr(), dst.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::check_aligned;
    use crate::error::MokError;

    #[test]
    fn misaligned_views_are_named_errors() {
        assert!(check_aligned("x", 0x7f00_0000_0100, 16).is_ok());
        match check_aligned("x", 0x7f00_0000_0102, 16) {
            Err(MokError::InvalidInput { tensor: "x", problem }) => assert!(problem.contains("16-byte"), "{problem}"),
            other => panic!("{other:?}"),
        }
        assert!(check_aligned("topk_ids", 0x1004, 4).is_ok());
        assert!(check_aligned("topk_ids", 0x1006, 4).is_err());
    }
}
