//! The out-of-band file through which rank 0 hands the NCCL unique id to the other ranks
//! (`bootstrap`): written atomically (a temporary name, then a rename, so a reader never sees half
//! an id), named and headed by the launch's nonce, so a file an earlier or another launch left is
//! not read as this one's. Plain file handling and the bootstrap's environment checks, tested on
//! the CPU whatever the features; the launch's nonce and the atomic write serve the file
//! rendezvous too (`rendezvous`).

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

/// The variable a launch without a launcher's unique run name sets to one (any text every rank
/// of the launch shares and no other launch does).
pub const RUN_ID_VAR: &str = "MOK_RUN_ID";

/// The variables whose values tell one launch from another on every rank: mok's own, torchrun's
/// run id (`none` unless `--rdzv-id` or `--standalone` names the run) and Slurm's job.
const UNIQUE_RUN_VARS: [&str; 3] = [RUN_ID_VAR, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"];

/// A value of one of [`UNIQUE_RUN_VARS`] that names a run (set, and not torchrun's `none`).
fn names_a_run(value: &str) -> bool {
    !value.is_empty() && value != "none"
}

/// What names this launch on every rank: `MOK_RUN_ID`, the launcher's run and rendezvous
/// (torchrun) or job and step (Slurm) variables, read through `get`; empty parts when unset
/// (without a part that names the run, [`unique_run_nonce`], a file an earlier launch left at
/// the same path is read as this one's).
pub(crate) fn run_nonce(get: impl Fn(&str) -> Option<String>) -> String {
    [RUN_ID_VAR, "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID"]
        .iter()
        .map(|name| get(name).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("/")
}

/// [`run_nonce`], refused when no part of it names the run: a plain torchrun launch (its run id
/// `none`, the same address and port every time) would read an earlier launch's file.
pub(crate) fn unique_run_nonce(get: impl Fn(&str) -> Option<String>) -> Result<String> {
    if !UNIQUE_RUN_VARS.iter().any(|name| get(name).is_some_and(|value| names_a_run(&value))) {
        return Err(MokError::InvalidConfig {
            field: RUN_ID_VAR,
            value: "unset".into(),
            rule: "must name this launch on every rank when the launcher does not (torchrun without \
                   --rdzv-id or --standalone names every run `none`; Slurm's SLURM_JOB_ID does): a file an \
                   earlier launch left would otherwise be read as this one's"
                .into(),
        });
    }
    Ok(run_nonce(get))
}

/// `path` with the digest of `nonce` appended to its file name: each launch's own file, so two
/// launches given the same path do not overwrite each other's.
pub(crate) fn path_for_run(path: &Path, nonce: &str) -> std::path::PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".{:016x}", digest(nonce)));
    path.with_file_name(name)
}

/// FNV-1a, 64 bits: a file-name-safe digest of a nonce (not a security measure).
pub(crate) fn digest(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3))
}

/// `timeout` after `start`, as an instant: a timeout past what an `Instant` can hold (such as
/// `Duration::MAX`, "wait as long as it takes") is capped at about 136 years instead of
/// overflowing.
pub(crate) fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    const LONGEST: Duration = Duration::from_secs(1 << 32);
    start.checked_add(timeout).or_else(|| start.checked_add(LONGEST)).unwrap_or(start)
}

/// Calls `look` until it finds a value or fails, or `deadline` passes (then `Ok(None)`),
/// sleeping `interval` between looks: the setup's waits for the other processes (their files,
/// NCCL's state), once per setup, not per pass.
pub(crate) fn poll_until<T, E>(
    deadline: Instant,
    interval: Duration,
    mut look: impl FnMut() -> std::result::Result<Option<T>, E>,
) -> std::result::Result<Option<T>, E> {
    loop {
        if let Some(found) = look()? {
            return Ok(Some(found));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(interval);
    }
}

/// Rank 0's id (hex after the nonce line) once the file at `path` holds it for this run's
/// `nonce`, polling up to `timeout`.
pub(crate) fn read_when_present(path: &Path, nonce: &str, timeout: Duration) -> Result<Vec<u8>> {
    let look = || {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        match text.split_once('\n') {
            Some((written, hex)) if written == nonce => from_hex(hex).map(Some),
            _ => Ok(None),
        }
    };
    poll_until(deadline_after(Instant::now(), timeout), Duration::from_millis(20), look)?.ok_or_else(|| {
        MokError::Timeout {
            waited_for: format!("rank 0 to write this run's NCCL unique id to {}", path.display()),
            rank: None,
            peer: Some(0),
            detail: format!("nothing for nonce {nonce:?} after {timeout:?}"),
        }
    })
}

/// The variable that keeps NCCL from using NVLink SHARP, whose multicast objects mok never
/// creates nor lets a library create for it.
pub(crate) const NVLS_VAR: &str = "NCCL_NVLS_ENABLE";

/// Refuses to start NCCL (`bootstrap`, checked here whatever the features) unless `NCCL_NVLS_ENABLE=0` (read through `get`) is set in this
/// process: NCCL enables NVLink SHARP by default on NVSwitch systems and creates multicast
/// objects for it.
pub(crate) fn check_nvls_off(get: impl Fn(&str) -> Option<String>) -> Result<()> {
    match get(NVLS_VAR) {
        Some(value) if value.trim() == "0" => Ok(()),
        value => Err(MokError::InvalidConfig {
            field: NVLS_VAR,
            value: value.unwrap_or_else(|| "unset".into()),
            rule: "must be 0 in every rank's environment: mok never uses NVLink multicast, which NCCL \
                   would otherwise set up on NVSwitch systems"
                .into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symmetric::handles::to_hex;

    #[test]
    fn a_deadline_past_what_an_instant_holds_is_capped_not_a_panic() {
        let now = Instant::now();
        let endless = deadline_after(now, Duration::MAX);
        assert!(endless > now + Duration::from_secs(100 * 365 * 24 * 3600), "{:?}", endless - now);
        assert_eq!(deadline_after(now, Duration::from_secs(5)), now + Duration::from_secs(5));
        assert_eq!(deadline_after(now, Duration::ZERO), now);
    }

    #[test]
    fn a_wait_ends_at_its_deadline_or_on_the_first_failure() {
        let interval = Duration::from_millis(1);
        let started = Instant::now();
        let finished = poll_until(started + Duration::from_millis(30), interval, || Ok::<Option<()>, MokError>(None));
        assert!(finished.unwrap().is_none());
        assert!(started.elapsed() >= Duration::from_millis(30));
        let mut looks = 0;
        let finished = poll_until(started + Duration::from_secs(60), interval, || {
            looks += 1;
            Ok::<_, MokError>((looks >= 3).then_some(()))
        });
        assert!(matches!(finished, Ok(Some(()))));
        assert_eq!(looks, 3);
        let failed = poll_until(Instant::now() + Duration::from_secs(60), interval, || {
            Err::<Option<()>, _>(MokError::Cuda { call: "ncclAllGather".into(), message: "ncclRemoteError".into() })
        });
        assert!(matches!(failed, Err(MokError::Cuda { .. })));
    }

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

    #[test]
    fn nccl_starts_only_with_nvlink_sharp_off() {
        let with = |value: Option<&'static str>| {
            move |name: &str| (name == NVLS_VAR).then_some(value).flatten().map(String::from)
        };
        assert!(check_nvls_off(with(Some("0"))).is_ok());
        for refused in [None, Some("1"), Some(""), Some("2")] {
            assert!(
                matches!(check_nvls_off(with(refused)), Err(MokError::InvalidConfig { field: NVLS_VAR, .. })),
                "{refused:?}"
            );
        }
    }

    #[test]
    fn a_launch_must_be_named_and_gets_its_own_file() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
        };
        // A plain torchrun launch: run id `none`, the same address and port every time.
        let plain = vars(&[("TORCHELASTIC_RUN_ID", "none"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")]);
        assert!(matches!(unique_run_nonce(plain), Err(MokError::InvalidConfig { field: "MOK_RUN_ID", .. })));
        assert!(matches!(unique_run_nonce(vars(&[])), Err(MokError::InvalidConfig { field: "MOK_RUN_ID", .. })));
        for named in [
            vars(&[("TORCHELASTIC_RUN_ID", "none"), (RUN_ID_VAR, "job-17")]),
            vars(&[("TORCHELASTIC_RUN_ID", "5f0c")]),
            vars(&[("SLURM_JOB_ID", "4242"), ("SLURM_STEP_ID", "0")]),
        ] {
            assert!(unique_run_nonce(named).is_ok());
        }
        let (a, b) = (run_nonce(vars(&[(RUN_ID_VAR, "a")])), run_nonce(vars(&[(RUN_ID_VAR, "b")])));
        let path = Path::new("/shared/nccl-id");
        assert_ne!(path_for_run(path, &a), path_for_run(path, &b));
        assert_eq!(path_for_run(path, &a), path_for_run(path, &a));
        assert_eq!(path_for_run(path, &a).parent(), path.parent());
        assert!(path_for_run(path, &a).file_name().unwrap().to_string_lossy().starts_with("nccl-id."));
    }
}
