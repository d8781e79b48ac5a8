//! NCCL bootstrap of a multi-process symmetric heap (feature `nccl`): one communicator over the
//! launcher's ranks, used once to all-gather the handle records.
//!
//! The NCCL unique id travels out of band: rank 0 creates it and writes it as hex to a file
//! beside the path `MOK_NCCL_ID_FILE` names, its name ending in a digest of the launch's nonce
//! (written to a temporary name, then renamed, so a reader never sees half an id; each launch
//! its own file, so launches given one path do not meet; removed once every rank has joined);
//! the other ranks poll for the file, up to a timeout. Any shared filesystem path works (a node-local `/tmp` path for one node). The
//! launch must be named (`MOK_RUN_ID`, torchrun's `--rdzv-id` or `--standalone`, or Slurm's job),
//! or a rank could read an earlier launch's id, and `NCCL_NVLS_ENABLE=0` must be set: mok never
//! uses NVLink multicast, and NCCL would create multicast objects on NVSwitch systems.
//!
//! Every wait for the other ranks has the deadline given to [`NcclBootstrap::new`]: the id file's,
//! the communicator's initialisation and each all-gather. The communicator is nonblocking
//! (`blocking = 0` in its config; `NCCL_COMM_BLOCKING` other than 0 is refused, since it would
//! override that), so mok polls NCCL's state instead of sitting in a call: a rank that dies
//! before joining, or never calls the all-gather, ends the others' waits with
//! [`MokError::Timeout`] after `ncclCommAbort`, instead of leaving them to the launcher. The abort
//! itself is NCCL's blocking call (it joins NCCL's threads and frees its memory) and has no
//! deadline of mok's.
//! Not yet run: needs several GPUs.

use std::cell::Cell;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cuda_sys;
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::handles::to_hex;
use super::id_file::{
    check_nvls_off, deadline_after, path_for_run, poll_until, read_when_present, unique_run_nonce, write_atomically,
};
use super::launch_env::LaunchEnv;
use crate::driver::{DeviceBuffer, Gpu};
use crate::error::{MokError, Result};

/// Environment variable naming the unique-id file.
pub const ID_FILE_VAR: &str = "MOK_NCCL_ID_FILE";

/// An NCCL communicator over every rank, on one GPU's stream; nonblocking, every wait bounded.
pub struct NcclBootstrap {
    /// Null once aborted (a wait expired): NCCL owns nothing of it then.
    comm: Cell<nccl_sys::ncclComm_t>,
    world: usize,
    rank: usize,
    timeout: Duration,
}

fn nccl_error(call: &str, error: nccl::NcclError) -> MokError {
    MokError::Cuda { call: call.into(), message: format!("{error:?}") }
}

/// `NCCL_COMM_BLOCKING` unset or 0: a 1 would make the communicator blocking whatever its config
/// says, and its initialisation wait without a deadline.
fn check_nonblocking_allowed(get: impl Fn(&str) -> Option<String>) -> Result<()> {
    match get("NCCL_COMM_BLOCKING") {
        None => Ok(()),
        Some(value) if value.trim() == "0" => Ok(()),
        Some(value) => Err(MokError::InvalidConfig {
            field: "NCCL_COMM_BLOCKING",
            value,
            rule: "must be unset or 0: mok's communicator is nonblocking so that its waits have a deadline".into(),
        }),
    }
}

fn nccl_result(call: &str, result: nccl_sys::ncclResult_t) -> Result<()> {
    match result {
        nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress => Ok(()),
        other => Err(MokError::Cuda { call: call.into(), message: format!("{other:?}") }),
    }
}

/// `ncclConfig_t` as NCCL 2.17 laid it out, the first version with every field mok sets (NCCL
/// reads a config by its `size` and `version`, so a later library takes this one and gives the
/// fields it lacks their defaults). Only `blocking` is set; the rest are NCCL's "undefined".
#[repr(C)]
struct CommConfigV2_17 {
    size: usize,
    magic: core::ffi::c_uint,
    version: core::ffi::c_uint,
    blocking: core::ffi::c_int,
    cga_cluster_size: core::ffi::c_int,
    min_ctas: core::ffi::c_int,
    max_ctas: core::ffi::c_int,
    net_name: *const core::ffi::c_char,
}

impl CommConfigV2_17 {
    /// `NCCL_CONFIG_INITIALIZER` of NCCL 2.17 with `blocking = 0`.
    fn nonblocking() -> Self {
        const UNDEFINED_INT: core::ffi::c_int = core::ffi::c_int::MIN;
        Self {
            size: core::mem::size_of::<Self>(),
            magic: 0xcafe_beef,
            // NCCL_VERSION(2, 17, 0).
            version: 2 * 10_000 + 17 * 100,
            blocking: 0,
            cga_cluster_size: UNDEFINED_INT,
            min_ctas: UNDEFINED_INT,
            max_ctas: UNDEFINED_INT,
            net_name: core::ptr::null(),
        }
    }
}

/// Between two looks at NCCL's or the stream's state.
const POLL_INTERVAL: Duration = Duration::from_millis(1);

/// Whether the communicator is idle (its last call finished); an error if that call failed.
///
/// # Safety
/// `comm` is a live communicator (not destroyed or aborted).
unsafe fn comm_idle(comm: nccl_sys::ncclComm_t, call: &str) -> Result<bool> {
    // Written as a plain integer, not cudarc's enum: a code a later NCCL adds must not become an
    // invalid enum value.
    const SUCCESS: u32 = nccl_sys::ncclResult_t::ncclSuccess as u32;
    const IN_PROGRESS: u32 = nccl_sys::ncclResult_t::ncclInProgress as u32;
    let mut state: u32 = SUCCESS;
    // SAFETY: `comm` is live (the caller's promise); `state` is a 4-byte integer, as NCCL's C
    // enum is, and outlives the call.
    let asked = unsafe { nccl_sys::ncclCommGetAsyncError(comm, (&mut state as *mut u32).cast()) };
    nccl_result("ncclCommGetAsyncError", asked)?;
    match state {
        SUCCESS => Ok(true),
        IN_PROGRESS => Ok(false),
        code => Err(MokError::Cuda { call: call.into(), message: format!("ncclResult_t {code}") }),
    }
}

/// Whether `stream` has run all its work; an error if it failed.
fn stream_idle(stream: cuda_sys::CUstream) -> Result<bool> {
    // SAFETY: a query of a live stream (the caller's GPU's, alive while the caller holds it).
    match unsafe { cuda_sys::cuStreamQuery(stream) } {
        cuda_sys::CUresult::CUDA_SUCCESS => Ok(true),
        cuda_sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(MokError::Cuda { call: "cuStreamQuery".into(), message: format!("{other:?}") }),
    }
}

/// A look for [`poll_until`] from a yes/no state.
fn found(idle: Result<bool>) -> Result<Option<()>> {
    idle.map(|idle| idle.then_some(()))
}

impl NcclBootstrap {
    /// Joins the communicator of `env`'s ranks on `gpu`, finding the unique id through the file
    /// beside `MOK_NCCL_ID_FILE`'s path, waiting at most `timeout` for rank 0 to write it and as long
    /// again for every rank to join (the module documentation says what it needs). Needs NCCL
    /// 2.14 or later (`ncclCommInitRankConfig`).
    pub fn new(gpu: &Gpu, env: &LaunchEnv, timeout: Duration) -> Result<Self> {
        let get = |name: &str| std::env::var(name).ok();
        check_nvls_off(get)?;
        check_nonblocking_allowed(get)?;
        // The run's nonce keeps a file left by an earlier run from being read as this run's id.
        let nonce = unique_run_nonce(get)?;
        let path = std::env::var_os(ID_FILE_VAR).map(PathBuf::from).ok_or_else(|| MokError::InvalidConfig {
            field: ID_FILE_VAR,
            value: "unset".into(),
            rule: "must name a path every rank can read (rank 0 writes the NCCL unique id to a file beside it, \
                   named by the launch)"
                .into(),
        })?;
        // SAFETY: only asks whether the library can be loaded (cudarc's loader; no NCCL call).
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err(MokError::Cuda {
                call: "loading libnccl".into(),
                message: "NCCL not found: cudarc looks for libnccl.so (and .so.12, .11, ...), not only .so.2 — \
                          link libnccl.so -> libnccl.so.2 in a directory on LD_LIBRARY_PATH"
                    .into(),
            });
        }
        let path = path_for_run(&path, &nonce);
        let id = if env.rank == 0 {
            let id = nccl::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            write_atomically(&path, format!("{nonce}\n{}", to_hex(&bytes)))?;
            id
        } else {
            let bytes = read_when_present(&path, &nonce, timeout)?;
            let mut internal = [0 as core::ffi::c_char; 128];
            if bytes.len() != internal.len() {
                return Err(MokError::InvalidInput {
                    tensor: ID_FILE_VAR,
                    problem: format!("{} holds {} bytes, an NCCL unique id has 128", path.display(), bytes.len()),
                });
            }
            for (slot, byte) in internal.iter_mut().zip(bytes) {
                *slot = byte as core::ffi::c_char;
            }
            nccl_sys::ncclUniqueId { internal }
        };
        gpu.synchronize()?;
        let deadline = deadline_after(Instant::now(), timeout);
        let mut comm = std::ptr::null_mut();
        let mut config = CommConfigV2_17::nonblocking();
        // SAFETY: `comm` is an out-pointer; the id is the one rank 0 made; `config` is a complete
        // config of the version it names, alive for the call (NCCL copies it); this thread's
        // current context is `gpu`'s (bound by `synchronize`).
        let started = unsafe {
            nccl_sys::ncclCommInitRankConfig(
                &mut comm,
                env.world as i32,
                id,
                env.rank as i32,
                (&mut config as *mut CommConfigV2_17).cast(),
            )
        };
        if let Err(error) = nccl_result("ncclCommInitRankConfig", started) {
            // A failed initialisation may still have made the communicator: release it.
            if !comm.is_null() {
                // SAFETY: the communicator NCCL returned, never used after this.
                unsafe {
                    let _ = nccl::comm_abort(comm);
                }
            }
            return Err(error);
        }
        let bootstrap = Self { comm: Cell::new(comm), world: env.world, rank: env.rank, timeout };
        // SAFETY: the communicator was just created and is live until `abort` or `drop`.
        bootstrap.wait(
            "ncclCommInitRankConfig",
            deadline,
            || found(unsafe { comm_idle(comm, "ncclCommInitRankConfig") }),
            || format!("every one of the {} ranks to join the NCCL communicator", env.world),
        )?;
        if env.rank == 0 {
            // Every rank read the id before it joined, and the initialisation finishes once all
            // have: the launch's file is no longer needed (a failed removal leaves one small file).
            let _ = std::fs::remove_file(&path);
        }
        Ok(bootstrap)
    }

    /// Waits on `look` until `deadline`; on expiry aborts the communicator (NCCL stops its
    /// kernels and threads) and returns a timeout naming `waited_for()`. A failed look aborts too.
    fn wait(
        &self,
        call: &str,
        deadline: Instant,
        look: impl FnMut() -> Result<Option<()>>,
        waited_for: impl FnOnce() -> String,
    ) -> Result<()> {
        match poll_until(deadline, POLL_INTERVAL, look) {
            Ok(Some(())) => Ok(()),
            Ok(None) => {
                self.abort();
                Err(MokError::Timeout {
                    rank: Some(self.rank),
                    peer: None,
                    waited_for: waited_for(),
                    detail: format!("{call} had not finished after {:?}; the communicator was aborted", self.timeout),
                })
            }
            Err(error) => {
                self.abort();
                Err(error)
            }
        }
    }

    fn abort(&self) {
        let comm = self.comm.replace(std::ptr::null_mut());
        if !comm.is_null() {
            // SAFETY: a live communicator, never used again (the cell now holds null).
            unsafe {
                let _ = nccl::comm_abort(comm);
            }
        }
    }

    fn live_comm(&self) -> Result<nccl_sys::ncclComm_t> {
        let comm = self.comm.get();
        if comm.is_null() {
            return Err(MokError::InvalidConfig {
                field: "NcclBootstrap",
                value: "aborted".into(),
                rule: "a wait of this communicator expired and it was aborted; join a new one".into(),
            });
        }
        Ok(comm)
    }

    /// All-gathers `mine` (the same length on every rank, checked first by an all-gather of the
    /// lengths): every rank's bytes, in rank order. Waits at most the timeout given to
    /// [`Self::new`] for every rank's part; on expiry the communicator is aborted and this and
    /// every later call return an error.
    pub fn all_gather_bytes(&self, gpu: &Gpu, mine: &[u8]) -> Result<Vec<u8>> {
        let lengths = self.all_gather_equal_lengths(gpu, &(mine.len() as u64).to_le_bytes())?;
        let lengths: Vec<u64> =
            lengths.chunks_exact(8).map(|bytes| u64::from_le_bytes(bytes.try_into().expect("8 bytes"))).collect();
        if let Some(rank) = lengths.iter().position(|&length| length != mine.len() as u64) {
            return Err(MokError::InvalidInput {
                tensor: "all_gather_bytes",
                problem: format!(
                    "rank {} gave {} bytes and rank {rank} {}: every rank must give the same length",
                    self.rank,
                    mine.len(),
                    lengths[rank]
                ),
            });
        }
        self.all_gather_equal_lengths(gpu, mine)
    }

    /// The all-gather itself, for a length every rank gives (NCCL's precondition: unequal
    /// counts would read or write past the buffers of the ranks with the shorter one).
    fn all_gather_equal_lengths(&self, gpu: &Gpu, mine: &[u8]) -> Result<Vec<u8>> {
        let comm = self.live_comm()?;
        let send = DeviceBuffer::from_slice(gpu, mine)?;
        let receive = DeviceBuffer::<u8>::alloc(gpu, mine.len() * self.world)?;
        let stream = gpu.inner().stream;
        let deadline = deadline_after(Instant::now(), self.timeout);
        // SAFETY: both buffers live until the stream has finished the all-gather (waited for
        // below) or, when the wait expires, forever (leaked below); `comm` is live.
        let enqueued = unsafe {
            nccl_sys::ncclAllGather(
                send.device_ptr() as *const core::ffi::c_void,
                receive.device_ptr() as *mut core::ffi::c_void,
                mine.len(),
                nccl_sys::ncclDataType_t::ncclUint8,
                comm,
                stream as nccl_sys::cudaStream_t,
            )
        };
        // Done once NCCL has enqueued it (the communicator idle) and the stream has run it.
        // SAFETY: `comm` stays live until `wait` aborts it, after its last look.
        let done = || found(Ok(unsafe { comm_idle(comm, "ncclAllGather")? } && stream_idle(stream)?));
        let finished = nccl_result("ncclAllGather", enqueued).and_then(|()| {
            self.wait("ncclAllGather", deadline, done, || {
                format!("every one of the {} ranks' part of the NCCL all-gather", self.world)
            })
        });
        if let Err(error) = finished {
            // After the abort NCCL's kernels stop; one that has not left the stream in a while
            // may still write the buffers, which then must outlive it (a failed stream has
            // nothing left to run).
            let patience = deadline_after(Instant::now(), self.timeout.min(Duration::from_secs(10)));
            let drained = poll_until(patience, POLL_INTERVAL, || found(Ok(stream_idle(stream).unwrap_or(true))));
            if !matches!(drained, Ok(Some(()))) {
                std::mem::forget(send);
                std::mem::forget(receive);
            }
            return Err(error);
        }
        receive.download()
    }
}

impl Drop for NcclBootstrap {
    fn drop(&mut self) {
        let comm = self.comm.replace(std::ptr::null_mut());
        if comm.is_null() {
            return;
        }
        // A nonblocking communicator finalises asynchronously; one that does not finish in time
        // is aborted instead of destroyed.
        let deadline = deadline_after(Instant::now(), self.timeout);
        // SAFETY: the communicator is live and used by nothing after this.
        unsafe {
            let finalized = nccl::comm_finalize(comm).is_ok()
                && matches!(
                    poll_until(deadline, POLL_INTERVAL, || found(comm_idle(comm, "ncclCommFinalize"))),
                    Ok(Some(()))
                );
            if finalized {
                let _ = nccl::comm_destroy(comm);
            } else {
                let _ = nccl::comm_abort(comm);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_laid_out_as_nccl_2_17_reads_it() {
        // NCCL copies `size` bytes and keeps its defaults past them: each field must sit where
        // nccl.h 2.17 puts it (size_t, 3 × unsigned/int, 3 × int, then a pointer).
        assert_eq!(core::mem::offset_of!(CommConfigV2_17, magic), 8);
        assert_eq!(core::mem::offset_of!(CommConfigV2_17, version), 12);
        assert_eq!(core::mem::offset_of!(CommConfigV2_17, blocking), 16);
        assert_eq!(core::mem::offset_of!(CommConfigV2_17, max_ctas), 28);
        assert_eq!(core::mem::offset_of!(CommConfigV2_17, net_name), 32);
        let config = CommConfigV2_17::nonblocking();
        assert_eq!(config.size, 40);
        assert_eq!((config.magic, config.version, config.blocking), (0xcafe_beef, 21_700, 0));
        // cudarc's own binding of a newer config starts the same way.
        assert_eq!(core::mem::offset_of!(nccl_sys::ncclConfig_t, blocking), 16);
        assert_eq!(core::mem::offset_of!(nccl_sys::ncclConfig_t, netName), 32);
    }

    #[test]
    fn a_blocking_communicator_is_refused() {
        let with = |value: Option<&'static str>| {
            move |name: &str| (name == "NCCL_COMM_BLOCKING").then_some(value).flatten().map(String::from)
        };
        assert!(check_nonblocking_allowed(with(None)).is_ok());
        assert!(check_nonblocking_allowed(with(Some("0"))).is_ok());
        for refused in ["1", "yes", ""] {
            assert!(matches!(
                check_nonblocking_allowed(with(Some(refused))),
                Err(MokError::InvalidConfig { field: "NCCL_COMM_BLOCKING", .. })
            ));
        }
    }
}
