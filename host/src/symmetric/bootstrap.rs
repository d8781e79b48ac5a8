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
//! Only the wait for the id file has mok's deadline: `ncclCommInitRank` and the all-gather wait
//! as long as NCCL does, so a rank that dies before joining leaves the others waiting until the
//! launcher ends them (torchrun stops every worker when one fails; give `srun` `--kill-on-bad-exit`).
//! The file rendezvous (`MOK_RENDEZVOUS_DIR`), whose every wait is bounded, has no such wait.
//! Not yet run: needs several GPUs.

use std::path::PathBuf;
use std::time::Duration;

use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::handles::to_hex;
use super::id_file::{check_nvls_off, path_for_run, read_when_present, unique_run_nonce, write_atomically};
use super::launch_env::LaunchEnv;
use crate::driver::{DeviceBuffer, Gpu};
use crate::error::{MokError, Result};

/// Environment variable naming the unique-id file.
pub const ID_FILE_VAR: &str = "MOK_NCCL_ID_FILE";

/// An NCCL communicator over every rank, on one GPU's stream.
pub struct NcclBootstrap {
    comm: nccl_sys::ncclComm_t,
    world: usize,
}

fn nccl_error(call: &str, error: nccl::NcclError) -> MokError {
    MokError::Cuda { call: call.into(), message: format!("{error:?}") }
}

impl NcclBootstrap {
    /// Joins the communicator of `env`'s ranks on `gpu`, finding the unique id through the file
    /// beside `MOK_NCCL_ID_FILE`'s path, waiting at most `timeout` for rank 0 to write it (the
    /// module documentation says what it needs and which waits have no deadline).
    pub fn new(gpu: &Gpu, env: &LaunchEnv, timeout: Duration) -> Result<Self> {
        let get = |name: &str| std::env::var(name).ok();
        check_nvls_off(get)?;
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
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is an out-pointer; the id is the one rank 0 made; this thread's current
        // context is `gpu`'s (bound by `synchronize`).
        unsafe { nccl::comm_init_rank(&mut comm, env.world as i32, id, env.rank as i32) }
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        if env.rank == 0 {
            // Every rank read the id before it joined, and the initialisation returns once all
            // have: the launch's file is no longer needed (a failed removal leaves one small file).
            let _ = std::fs::remove_file(&path);
        }
        Ok(Self { comm, world: env.world })
    }

    /// All-gathers `mine` (the same length on every rank): every rank's bytes, in rank order.
    pub fn all_gather_bytes(&self, gpu: &Gpu, mine: &[u8]) -> Result<Vec<u8>> {
        let send = DeviceBuffer::from_slice(gpu, mine)?;
        let receive = DeviceBuffer::<u8>::alloc(gpu, mine.len() * self.world)?;
        let stream = gpu.inner().stream as nccl_sys::cudaStream_t;
        // SAFETY: both buffers live until the download below synchronises the stream.
        unsafe {
            nccl::all_gather(
                send.device_ptr() as *const core::ffi::c_void,
                receive.device_ptr() as *mut core::ffi::c_void,
                mine.len(),
                nccl_sys::ncclDataType_t::ncclUint8,
                self.comm,
                stream,
            )
        }
        .map_err(|e| nccl_error("ncclAllGather", e))?;
        receive.download()
    }
}

impl Drop for NcclBootstrap {
    fn drop(&mut self) {
        // SAFETY: the communicator was created in `new` and is not used after this.
        unsafe {
            let _ = nccl::comm_destroy(self.comm);
        }
    }
}
