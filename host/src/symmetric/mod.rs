//! The symmetric heap: P ranks, each owning one identically laid-out slice of device memory, and
//! a table of every slice's base address as this process sees it. A kernel addresses region `R`
//! of rank `r` as `bases[r] + R` (`mok_kernels::comm::params::ExchangeParams::map`).
//!
//! Backends:
//! - [`SymmetricHeap::virtual_ranks`]: all P slices in one allocation on one GPU, one process —
//!   what the benchmarks and every one-GPU test except `tests/gpu_processes.rs` use;
//! - [`SymmetricHeap::vmm_peers`]: one process driving several GPUs; rank r's slice is physical
//!   memory on GPU r (`cuMemCreate`), mapped once into the process's address space and made
//!   readable and writable by every GPU (`cuMemSetAccess`), so each GPU reaches its peers' slices
//!   over NVLink at the same addresses;
//! - [`SymmetricHeap::multi_process`]: one process per GPU; each exports its slice as a shareable
//!   handle (a POSIX fd within a node, a fabric handle across the nodes of an NVLink domain such
//!   as NVL72), the records are all-gathered (through NCCL with the `nccl` feature, see
//!   `bootstrap`, or through files, [`rendezvous::FileRendezvous`]) and every process imports
//!   and maps its peers' slices.
//!
//! NVLink multicast is never used. `multi_process` with POSIX-fd handles has run with two to four
//! processes sharing one GPU (`tests/gpu_processes.rs`); nothing has run on several GPUs yet
//! (`vmm_peers`, fabric handles, NCCL's all-gather); their pure parts — environment, handle
//! table — are unit-tested.

#[cfg(feature = "nccl")]
pub mod bootstrap;
pub mod handles;
// The launch's nonce and the NCCL id file (the `nccl` bootstrap); compiled and tested without it.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) mod id_file;
pub mod launch_env;
pub mod rendezvous;

pub use launch_env::{LaunchEnv, Launcher};

use crate::driver::vmm::{self, ExportedHandle, ShareableKind, VmmMapping};
use crate::driver::{DeviceBuffer, Gpu};
use crate::error::{MokError, Result};
use handles::HandleRecord;

/// Where the slices live (held for their `Drop`: the memory lives as long as the heap).
enum Storage {
    /// One allocation holding every rank's slice.
    Virtual { _memory: DeviceBuffer<u8> },
    /// One mapping per rank (this process's own and the imported ones).
    Mapped { _mappings: Vec<VmmMapping> },
}

/// What a multi-process heap is asked for: the bytes of each rank's slice and a digest of the
/// layout the rank's layer will give them (`Exchange::heap_request`), which every rank must
/// share. A `layout` of 0 states none: then only the bytes are compared across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeapRequest {
    /// Bytes of each rank's slice (rounded up to the mapping granularity when allocated).
    pub bytes_per_rank: u64,
    /// A digest of the layout (never 0 when stated).
    pub layout: u64,
}

impl HeapRequest {
    /// `bytes_per_rank` with the layout that `description` names (any text that differs
    /// whenever the layout does): its 64-bit FNV-1a digest, 0 moved to 1.
    pub fn described(bytes_per_rank: u64, description: &str) -> Self {
        Self { bytes_per_rank, layout: id_file::digest(description).max(1) }
    }
}

/// P identically laid-out slices and the peer table.
pub struct SymmetricHeap {
    bytes_per_rank: u64,
    /// The layout every rank's heap was asked for ([`HeapRequest::layout`]; 0: none stated).
    layout: u64,
    bases: Vec<u64>,
    local_ranks: Vec<usize>,
    /// The handles the heap was built with, which run kernels on it: a layer must use one
    /// ([`SymmetricHeap::built_on`]), and a mapped heap synchronises them before it unmaps.
    gpus: Vec<Gpu>,
    storage: Storage,
}

/// Alignment of each slice (2 MiB: the VMM granularity on current GPUs, and more than any region
/// needs).
pub const SLICE_ALIGN: u64 = 2 << 20;

/// Each rank's slice rounded up to [`SLICE_ALIGN`], and `world` of them in bytes; a size past
/// the address space is an `InvalidInput`.
fn slice_stride(bytes_per_rank: u64, world: usize) -> Result<(u64, usize)> {
    let stride = bytes_per_rank.div_ceil(SLICE_ALIGN).checked_mul(SLICE_ALIGN);
    let total = stride.and_then(|stride| stride.checked_mul(world as u64)).and_then(|t| usize::try_from(t).ok());
    match (stride, total) {
        (Some(stride), Some(total)) => Ok((stride, total)),
        _ => Err(MokError::InvalidInput {
            tensor: "symmetric heap",
            problem: format!("{world} slices of {bytes_per_rank} bytes overflow the address space"),
        }),
    }
}

impl SymmetricHeap {
    /// (a) Virtual ranks: `world` slices of `bytes_per_rank` in one allocation on `gpu`, zeroed.
    /// Every rank is local to this process and to this GPU.
    pub fn virtual_ranks(gpu: &Gpu, world: usize, bytes_per_rank: u64) -> Result<Self> {
        crate::config::check_ep_ranks(world)?;
        let (stride, total) = slice_stride(bytes_per_rank, world)?;
        let mut buffer = DeviceBuffer::<u8>::alloc(gpu, total)?;
        buffer.fill_bytes(0)?;
        gpu.synchronize()?;
        let base = buffer.device_ptr();
        Ok(Self {
            bytes_per_rank: stride,
            layout: 0,
            bases: (0..world as u64).map(|r| base + r * stride).collect(),
            local_ranks: (0..world).collect(),
            gpus: vec![gpu.handle()],
            storage: Storage::Virtual { _memory: buffer },
        })
    }

    /// (b) One process, one GPU per rank: rank r's slice lives on device `ordinals[r]` and is
    /// mapped for every listed device. Fails when a pair of devices cannot reach each other.
    /// The slices are zeroed through `gpus[r]`, which must have been opened on `ordinals[r]`
    /// (refused otherwise).
    pub fn vmm_peers(gpus: &[&Gpu], ordinals: &[i32], bytes_per_rank: u64) -> Result<Self> {
        crate::config::check_ep_ranks(ordinals.len())?;
        if gpus.len() != ordinals.len() {
            return Err(MokError::InvalidInput {
                tensor: "symmetric heap",
                problem: format!("{} GPUs for {} ordinals", gpus.len(), ordinals.len()),
            });
        }
        for &a in ordinals {
            for &b in ordinals {
                if a != b && !vmm::can_access_peer(a, b)? {
                    return Err(MokError::InvalidConfig {
                        field: "ep_ranks",
                        value: ordinals.len().to_string(),
                        rule: format!("device {a} cannot access device {b}'s memory (no peer access)"),
                    });
                }
            }
        }
        for (rank, (gpu, &ordinal)) in gpus.iter().zip(ordinals).enumerate() {
            check_gpu_ordinal(gpu, ordinal).map_err(|problem| MokError::InvalidInput {
                tensor: "symmetric heap",
                problem: format!("rank {rank}: {problem}"),
            })?;
        }
        let mut mappings = Vec::with_capacity(ordinals.len());
        for &ordinal in ordinals {
            mappings.push(VmmMapping::allocate(ordinal, bytes_per_rank as usize, ShareableKind::Private, ordinals)?);
        }
        let bytes = mappings[0].bytes() as u64;
        for (gpu, mapping) in gpus.iter().zip(&mappings) {
            // SAFETY: the mapping is `bytes` long and this GPU may access it.
            unsafe { gpu.fill_device_bytes(mapping.device_ptr(), 0, bytes as usize)? };
            gpu.synchronize()?;
        }
        Ok(Self {
            bytes_per_rank: bytes,
            layout: 0,
            bases: mappings.iter().map(VmmMapping::device_ptr).collect(),
            local_ranks: (0..ordinals.len()).collect(),
            gpus: gpus.iter().map(|gpu| gpu.handle()).collect(),
            storage: Storage::Mapped { _mappings: mappings },
        })
    }

    /// (c) One process per GPU: allocates this rank's slice of `request.bytes_per_rank` on `gpu`
    /// (device `ordinal`), exports it as `kind`, exchanges the records with `all_gather` (this
    /// rank's bytes in, every rank's bytes in rank order out: `bootstrap::NcclBootstrap::all_gather_bytes`
    /// with the `nccl` feature) and imports every peer's slice. Ranks whose requests differ (in
    /// bytes or layout) are refused, on every rank, and so is a `gpu` not opened on `ordinal`.
    pub fn multi_process(
        gpu: &Gpu,
        env: &LaunchEnv,
        ordinal: i32,
        request: HeapRequest,
        kind: ShareableKind,
        all_gather: &mut dyn FnMut(&[u8]) -> Result<Vec<u8>>,
    ) -> Result<Self> {
        crate::config::check_ep_ranks(env.world)?;
        if env.rank >= env.world {
            return Err(MokError::InvalidInput {
                tensor: "launch env",
                problem: format!("rank {} of a world of {}", env.rank, env.world),
            });
        }
        if kind == ShareableKind::Private {
            return Err(MokError::InvalidInput {
                tensor: "symmetric heap",
                problem: "a heap shared between processes needs a POSIX-fd or fabric handle".into(),
            });
        }
        check_gpu_ordinal(gpu, ordinal)
            .map_err(|problem| MokError::InvalidInput { tensor: "symmetric heap", problem })?;
        let bytes_per_rank = request.bytes_per_rank;
        let own = VmmMapping::allocate(ordinal, bytes_per_rank as usize, kind, &[ordinal])?;
        // SAFETY: the mapping is `bytes()` long and this GPU may access it.
        unsafe { gpu.fill_device_bytes(own.device_ptr(), 0, own.bytes())? };
        gpu.synchronize()?;
        if kind == ShareableKind::PosixFd {
            allow_handle_duplication()?;
        }
        // Closed when this returns, on every path: an exported descriptor left open would keep
        // this rank's whole slice allocated for the process's life.
        let exported = ExportedDescriptor(own.export(kind)?);
        let record = HandleRecord {
            rank: env.rank as u32,
            pid: std::process::id(),
            space: handles::process_space(),
            bytes: own.bytes() as u64,
            requested: bytes_per_rank,
            layout: request.layout,
            handle: exported.0,
        };
        let table = HandleRecord::decode_table(&all_gather(&record.to_bytes())?, env.world)?;
        let mut mappings = Vec::with_capacity(env.world);
        let mut own = Some(own);
        for peer in &table {
            if peer.rank as usize == env.rank {
                mappings.push(own.take().expect("own slice is used once"));
                continue;
            }
            let handle = match peer.handle {
                ExportedHandle::PosixFd(fd) => ExportedHandle::PosixFd(duplicate_peer_fd(peer.pid, fd)?),
                fabric => fabric,
            };
            // A driver error here is most often a pair of GPUs without peer access: say whose
            // slice it was and what the import needs.
            let imported = VmmMapping::import(&handle, peer.bytes as usize, &[ordinal]).map_err(|error| match error {
                MokError::Cuda { call, message } => MokError::Cuda {
                    call: format!(
                        "{call} (importing rank {}'s slice on device {ordinal}, which must reach that rank's GPU by \
                         NVLink or PCIe peer access)",
                        peer.rank
                    ),
                    message,
                },
                other => other,
            });
            // The import holds its own reference: the duplicated descriptor would only keep the
            // peer's memory alive after the heap is dropped.
            close_descriptor(&handle);
            mappings.push(imported?);
        }
        // Every peer has duplicated this process's descriptor once every process got here (a
        // second all-gather as the barrier); then it can be closed (`exported`, dropped on
        // return), so dropping the heap frees the memory. Every process must also have imported
        // before any frees: the caller keeps the heap for the job's lifetime and tears it down
        // after a barrier.
        all_gather(&[1])?;
        drop(exported);
        Ok(Self {
            bytes_per_rank: table[0].bytes,
            layout: request.layout,
            bases: mappings.iter().map(VmmMapping::device_ptr).collect(),
            local_ranks: vec![env.rank],
            gpus: vec![gpu.handle()],
            storage: Storage::Mapped { _mappings: mappings },
        })
    }

    /// Ranks in the heap.
    pub fn world(&self) -> usize {
        self.bases.len()
    }

    /// Bytes of each rank's slice.
    pub fn bytes_per_rank(&self) -> u64 {
        self.bytes_per_rank
    }

    /// The layout every rank's heap was asked for ([`HeapRequest::layout`]; 0: none stated, as
    /// for heaps of one process).
    pub fn layout(&self) -> u64 {
        self.layout
    }

    /// Each rank's slice base as this process sees it (the kernels' peer table).
    pub fn bases(&self) -> &[u64] {
        &self.bases
    }

    /// `map(offset, rank)`: the address of byte `offset` of `rank`'s slice.
    pub(crate) fn map(&self, offset: u64, rank: usize) -> u64 {
        self.bases[rank] + offset
    }

    /// The ranks this process drives (all of them for virtual ranks and one-process VMM).
    pub fn local_ranks(&self) -> &[usize] {
        &self.local_ranks
    }

    /// Whether every rank is on one GPU (signals may then use GPU scope).
    pub fn single_gpu(&self) -> bool {
        matches!(self.storage, Storage::Virtual { .. })
    }

    /// Whether `gpu` is the handle this heap was built with (for a heap over several GPUs, one
    /// of them): a layer over the heap must launch on the stream its slices were zeroed on.
    pub fn built_on(&self, gpu: &Gpu) -> bool {
        self.gpus.iter().any(|own| own.is_same_handle(gpu))
    }
}

impl Drop for SymmetricHeap {
    /// Unmapping memory that a queued kernel still reads or writes is undefined: the heap's own
    /// GPUs finish their work first (errors cannot be acted on here; the next call reports
    /// them). A virtual heap's one allocation is freed by `cuMemFree`, which waits itself.
    fn drop(&mut self) {
        if let Storage::Mapped { .. } = self.storage {
            for gpu in &self.gpus {
                let _ = gpu.synchronize();
            }
        }
    }
}

/// `Err(why)` unless `gpu` was opened on device `ordinal`: a slice allocated and mapped for one
/// device and zeroed through another's stream would fail in the driver, not with a message
/// naming the mismatch.
fn check_gpu_ordinal(gpu: &Gpu, ordinal: i32) -> std::result::Result<(), String> {
    if usize::try_from(ordinal).ok() == Some(gpu.ordinal()) {
        Ok(())
    } else {
        Err(format!("device ordinal {ordinal}, but the GPU handle is device {}", gpu.ordinal()))
    }
}

/// Lets any process of this user duplicate this process's file descriptors with `pidfd_getfd`
/// (Yama's `ptrace_scope = 1` otherwise allows it only to ancestors, and ranks are siblings).
fn allow_handle_duplication() -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        const PR_SET_PTRACER: libc::c_int = 0x5961_6d61;
        const PR_SET_PTRACER_ANY: libc::c_ulong = libc::c_ulong::MAX;
        // SAFETY: prctl with integer arguments; failure (no Yama) leaves ptrace rules unchanged.
        let _ = unsafe { libc::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) };
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    Err(MokError::NoDriver("POSIX-fd handles need Linux (pidfd_getfd)".into()))
}

/// This process's exported handle, its descriptor closed when dropped.
struct ExportedDescriptor(ExportedHandle);

impl Drop for ExportedDescriptor {
    fn drop(&mut self) {
        close_descriptor(&self.0);
    }
}

/// Closes a POSIX-fd handle's descriptor (a fabric handle has none).
fn close_descriptor(handle: &ExportedHandle) {
    if let ExportedHandle::PosixFd(fd) = *handle {
        #[cfg(unix)]
        // SAFETY: the descriptor is this process's (exported or duplicated here) and nothing
        // uses it after this call.
        unsafe {
            libc::close(fd);
        }
        #[cfg(not(unix))]
        let _ = fd;
    }
}

/// Duplicates file descriptor `fd` of process `pid` into this process (`pidfd_open` +
/// `pidfd_getfd`, Linux 5.6+).
fn duplicate_peer_fd(pid: u32, fd: i32) -> Result<i32> {
    #[cfg(target_os = "linux")]
    {
        let os_error = |call: &str| MokError::Cuda {
            call: format!("{call}(pid {pid}, fd {fd})"),
            message: format!(
                "{} (peer handles need Linux 5.6+ and permission to duplicate the peer's descriptors)",
                std::io::Error::last_os_error()
            ),
        };
        // SAFETY: plain syscalls with integer arguments; the returned descriptors are checked.
        unsafe {
            let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0 as libc::c_long);
            if pidfd < 0 {
                return Err(os_error("pidfd_open"));
            }
            let local = libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd as libc::c_long, 0 as libc::c_long);
            libc::close(pidfd as libc::c_int);
            if local < 0 {
                return Err(os_error("pidfd_getfd"));
            }
            Ok(local as i32)
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (pid, fd);
        Err(MokError::NoDriver("POSIX-fd handles need Linux (pidfd_getfd)".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_past_the_address_space_are_refused_not_wrapped() {
        assert_eq!(slice_stride(1, 4).unwrap(), (SLICE_ALIGN, 4 * SLICE_ALIGN as usize));
        assert_eq!(slice_stride(SLICE_ALIGN + 1, 2).unwrap(), (2 * SLICE_ALIGN, 4 * SLICE_ALIGN as usize));
        for (bytes, world) in [(u64::MAX, 1), (1 << 60, 16), (u64::MAX - SLICE_ALIGN, 2)] {
            assert!(
                matches!(slice_stride(bytes, world), Err(MokError::InvalidInput { tensor: "symmetric heap", .. })),
                "{bytes} × {world}"
            );
        }
    }
}
