//! The out-of-band file through which rank 0 hands the NCCL unique id to the other ranks
//! (`bootstrap`): written atomically (a temporary name, then a rename, so a reader never sees half
//! an id), with the launch's nonce on its first line, so a file an earlier run left at the same
//! path is not read as this run's. Plain file handling, tested on the CPU whatever the features;
//! the launch's nonce and the atomic write serve the file rendezvous too (`rendezvous`).

use std::path::Path;
use std::time::{Duration, Instant};

use super::handles::from_hex;
use crate::error::{MokError, Result};

/// A filesystem error as mok's error, naming what was attempted.
pub(crate) fn io_error(what: String, error: std::io::Error) -> MokError {
    MokError::Cuda { call: what, message: error.to_string() }
}

/// Writes `contents` to `path` through a temporary file and a rename, so a reader finds the
/// whole file or none.
pub(crate) fn write_atomically(path: &Path, contents: impl AsRef<[u8]>) -> Result<()> {
    let temporary = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&temporary, contents).map_err(|e| io_error(format!("write {}", temporary.display()), e))?;
    std::fs::rename(&temporary, path).map_err(|e| io_error(format!("rename to {}", path.display()), e))
}

/// What names this launch on every rank: the launcher's run and rendezvous (torchrun) or job and
/// step (Slurm) variables, read through `get`; empty parts when unset (with none set, a reused
/// file is not detected).
pub(crate) fn run_nonce(get: impl Fn(&str) -> Option<String>) -> String {
    ["TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID"]
        .iter()
        .map(|name| get(name).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("/")
}

/// Rank 0's id (hex after the nonce line) once the file at `path` holds it for this run's
/// `nonce`, polling up to `timeout`.
pub(crate) fn read_when_present(path: &Path, nonce: &str, timeout: Duration) -> Result<Vec<u8>> {
    let start = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && let Some((written, hex)) = text.split_once('\n')
            && written == nonce
        {
            return from_hex(hex);
        }
        if start.elapsed() > timeout {
            return Err(MokError::Timeout {
                waited_for: format!("rank 0 to write this run's NCCL unique id to {}", path.display()),
                rank: None,
                peer: Some(0),
                detail: format!("nothing for nonce {nonce:?} after {timeout:?}"),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symmetric::handles::to_hex;

    #[test]
    fn only_this_runs_id_is_read() {
        let dir = std::env::temp_dir().join(format!("mok-id-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("nccl-id");
        let vars = |run: &'static str| move |name: &str| (name == "TORCHELASTIC_RUN_ID").then(|| run.to_string());
        let (this_run, last_run) = (run_nonce(vars("b")), run_nonce(vars("a")));
        assert_ne!(this_run, last_run);
        // A file an earlier run left: not read as this run's, the wait times out.
        write_atomically(&path, format!("{last_run}\n{}", to_hex(&[1, 2, 3]))).unwrap();
        let stale = read_when_present(&path, &this_run, Duration::from_millis(60));
        assert!(matches!(stale, Err(MokError::Timeout { peer: Some(0), .. })), "{stale:?}");
        // This run's file: read.
        write_atomically(&path, format!("{this_run}\n{}", to_hex(&[7, 8, 9]))).unwrap();
        assert_eq!(read_when_present(&path, &this_run, Duration::from_millis(60)).unwrap(), vec![7, 8, 9]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
