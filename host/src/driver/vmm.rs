//! CUDA virtual memory management (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`) and shareable
//! handles (`cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle`): the raw driver
//! calls behind the multi-GPU symmetric heaps. NVLink multicast objects (`cuMulticast*`) are
//! deliberately absent: multicast stays off on the machines mok runs on.
//!
//! Not yet run on a GPU: the machines available so far have one GPU (see `docs/ARCHITECTURE.md`).

use std::ffi::c_void;

use cudarc::driver::sys;

use super::cuda_error;
use crate::error::{MokError, Result};

/// How an allocation may be shared with other processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareableKind {
    /// Only this process maps it (one process driving several GPUs).
    Private,
    /// A POSIX file descriptor (processes of one node).
    PosixFd,
    /// A fabric handle (processes on several nodes of one NVLink domain, e.g. NVL72).
    Fabric,
}

impl ShareableKind {
    fn handle_type(self) -> sys::CUmemAllocationHandleType {
        match self {
            ShareableKind::Private => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            ShareableKind::PosixFd => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ShareableKind::Fabric => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        }
    }
}

/// An exported allocation, as the OS or the fabric names it in the exporting process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportedHandle {
    /// A file descriptor of the exporting process (another process must duplicate it, e.g. with
    /// `pidfd_getfd`, before importing).
    PosixFd(i32),
    /// A fabric handle, valid as it is in any process of the NVLink domain.
    Fabric([u8; 64]),
}

impl ExportedHandle {
    /// The kind of sharing the handle is for.
    pub fn kind(&self) -> ShareableKind {
        match self {
            ExportedHandle::PosixFd(_) => ShareableKind::PosixFd,
            ExportedHandle::Fabric(_) => ShareableKind::Fabric,
        }
    }
}

fn check(call: &str, result: sys::CUresult) -> Result<()> {
    result.result().map_err(|e| cuda_error(call, e))
}

/// `{ type: DEVICE, id: ordinal }`. The C struct is `{ enum type; int id; }` in every CUDA
/// version, but CUDA 13's bindings wrap `id` in an anonymous union, so the field's Rust name
/// depends on the version cudarc was built for: the id is written by its offset instead.
fn device_location(ordinal: i32) -> sys::CUmemLocation {
    const _: () = assert!(size_of::<sys::CUmemLocation>() == 8 && size_of::<sys::CUmemLocationType>() == 4);
    // SAFETY: all-zero is a valid CUmemLocation (type 0 = INVALID, id 0).
    let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    // SAFETY: the struct is 8 bytes, the 4-byte enum first (asserted above), so `id` is the i32
    // at offset 4, inside `location` and 4-byte aligned.
    unsafe { (&mut location as *mut sys::CUmemLocation).cast::<i32>().add(1).write(ordinal) };
    location
}

fn allocation_prop(ordinal: i32, kind: ShareableKind) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is the C API's "no flags" value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = kind.handle_type();
    prop.location = device_location(ordinal);
    prop
}

/// The recommended allocation granularity on device `ordinal` for handles of `kind`.
pub fn granularity(ordinal: i32, kind: ShareableKind) -> Result<usize> {
    let prop = allocation_prop(ordinal, kind);
    let mut bytes = 0usize;
    // SAFETY: valid out-pointer and property struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut bytes,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    Ok(bytes.max(1))
}

/// Whether device `from` can map device `to`'s memory (NVLink or PCIe peer access).
pub fn can_access_peer(from: i32, to: i32) -> Result<bool> {
    let (mut a, mut b) = (0, 0);
    let mut can = 0;
    // SAFETY: valid out-pointers; ordinals are checked by the driver.
    unsafe {
        check("cuDeviceGet", sys::cuDeviceGet(&mut a, from))?;
        check("cuDeviceGet", sys::cuDeviceGet(&mut b, to))?;
        check("cuDeviceCanAccessPeer", sys::cuDeviceCanAccessPeer(&mut can, a, b))?;
    }
    Ok(can != 0)
}

/// Physical memory mapped at a reserved virtual range of this process, readable and writable by
/// a set of devices. Unmapped, freed and released on drop.
pub struct VmmMapping {
    handle: sys::CUmemGenericAllocationHandle,
    address: sys::CUdeviceptr,
    bytes: usize,
}

impl VmmMapping {
    /// Allocates `bytes` (rounded up to the granularity) on device `ordinal`, shareable as `kind`,
    /// maps it and grants `access` (device ordinals, the owner included) read and write.
    pub fn allocate(ordinal: i32, bytes: usize, kind: ShareableKind, access: &[i32]) -> Result<Self> {
        let grain = granularity(ordinal, kind)?;
        let bytes = bytes.div_ceil(grain).max(1).checked_mul(grain).ok_or_else(|| MokError::InvalidInput {
            tensor: "symmetric heap",
            problem: format!("{bytes} bytes rounded up to the {grain}-byte granularity overflow the address space"),
        })?;
        let prop = allocation_prop(ordinal, kind);
        let mut handle = 0;
        // SAFETY: valid out-pointer and property struct.
        check(&format!("cuMemCreate({bytes} bytes on device {ordinal})"), unsafe {
            sys::cuMemCreate(&mut handle, bytes, &prop, 0)
        })?;
        Self::map(handle, bytes, grain, access)
    }

    /// Imports an allocation another process exported (`handle` as this process may use it: a
    /// duplicated file descriptor, or the fabric handle) and maps it for `access`.
    pub fn import(handle: &ExportedHandle, bytes: usize, access: &[i32]) -> Result<Self> {
        // The range aligned as the exporter's allocation was (its kind's granularity on the
        // devices here), not left to the driver.
        let grain = access.first().map_or(Ok(1), |&ordinal| granularity(ordinal, handle.kind()))?;
        let mut generic = 0;
        match handle {
            ExportedHandle::PosixFd(fd) => {
                // SAFETY: for POSIX handles the driver takes the descriptor itself in the pointer.
                check("cuMemImportFromShareableHandle(posix fd)", unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut generic,
                        *fd as isize as *mut c_void,
                        ShareableKind::PosixFd.handle_type(),
                    )
                })?;
            }
            ExportedHandle::Fabric(data) => {
                let mut fabric = sys::CUmemFabricHandle { data: *data };
                // SAFETY: the pointer names a live 64-byte fabric handle.
                check("cuMemImportFromShareableHandle(fabric)", unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut generic,
                        &mut fabric as *mut sys::CUmemFabricHandle as *mut c_void,
                        ShareableKind::Fabric.handle_type(),
                    )
                })?;
            }
        }
        Self::map(generic, bytes, grain, access)
    }

    fn map(handle: sys::CUmemGenericAllocationHandle, bytes: usize, alignment: usize, access: &[i32]) -> Result<Self> {
        let mut address = 0;
        // SAFETY: reserves a fresh range; on failure the handle is released below.
        let reserved =
            check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut address, bytes, alignment, 0, 0) });
        if let Err(error) = reserved {
            // SAFETY: the handle was created or imported above and is not mapped.
            unsafe { sys::cuMemRelease(handle) };
            return Err(error);
        }
        // From here `Drop` undoes whatever succeeded (unmapping an unmapped range fails harmlessly).
        let mapping = Self { handle, address, bytes };
        // SAFETY: the range was just reserved with this size; the handle covers `bytes`.
        check("cuMemMap", unsafe { sys::cuMemMap(address, bytes, 0, handle, 0) })?;
        let descriptors: Vec<sys::CUmemAccessDesc> = access
            .iter()
            .map(|&ordinal| sys::CUmemAccessDesc {
                location: device_location(ordinal),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        if descriptors.is_empty() {
            return Err(MokError::InvalidInput {
                tensor: "symmetric heap",
                problem: "a mapping must be accessible by at least one device".into(),
            });
        }
        // SAFETY: the range is mapped; the descriptors live through the call.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(address, bytes, descriptors.as_ptr(), descriptors.len())
        })?;
        Ok(mapping)
    }

    /// Exports the allocation for other processes as `kind` (it must have been allocated
    /// shareable as that kind).
    pub fn export(&self, kind: ShareableKind) -> Result<ExportedHandle> {
        match kind {
            ShareableKind::Private => Err(MokError::InvalidInput {
                tensor: "symmetric heap",
                problem: "a private allocation cannot be exported".into(),
            }),
            ShareableKind::PosixFd => {
                let mut fd: i32 = -1;
                // SAFETY: the out-pointer names an int, as POSIX handles need.
                check("cuMemExportToShareableHandle(posix fd)", unsafe {
                    sys::cuMemExportToShareableHandle(
                        &mut fd as *mut i32 as *mut c_void,
                        self.handle,
                        kind.handle_type(),
                        0,
                    )
                })?;
                Ok(ExportedHandle::PosixFd(fd))
            }
            ShareableKind::Fabric => {
                let mut fabric = sys::CUmemFabricHandle { data: [0; 64] };
                // SAFETY: the out-pointer names a 64-byte fabric handle.
                check("cuMemExportToShareableHandle(fabric)", unsafe {
                    sys::cuMemExportToShareableHandle(
                        &mut fabric as *mut sys::CUmemFabricHandle as *mut c_void,
                        self.handle,
                        kind.handle_type(),
                        0,
                    )
                })?;
                Ok(ExportedHandle::Fabric(fabric.data))
            }
        }
    }

    /// The mapped address (valid in every context of this process).
    pub fn device_ptr(&self) -> u64 {
        self.address
    }

    /// Mapped bytes (the request rounded up to the granularity).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        // SAFETY: the range and handle belong to this mapping and nothing uses them after drop
        // (the heap that owns it synchronises its GPUs first, `SymmetricHeap`'s `Drop`). Errors
        // cannot be acted on here.
        unsafe {
            let _ = sys::cuMemUnmap(self.address, self.bytes);
            let _ = sys::cuMemAddressFree(self.address, self.bytes);
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}
