//! An all-gather through files in a directory every process can read: the exchange of a
//! multi-process heap's handle records ([`super::SymmetricHeap::multi_process`]) without NCCL — a
//! node-local path for the processes of one node, a shared filesystem across nodes. It is what
//! runs processes sharing one GPU, where NCCL refuses two ranks on one device.
//!
//! Each round every rank writes its bytes under a temporary name and renames the file into place,
//! so a file that exists is whole, then reads every rank's file of the round, waiting up to a
//! timeout. A rank writes round n + 1 only after reading every file of round n, so once it has
//! read every file of round n + 1 nobody reads round n again and it removes its own; the last
//! round's files stay. File names carry the launch's nonce (`MOK_RUN_ID`, the launcher's run and
//! rendezvous, or job and step, variables), so files an earlier launch left are not read as this
//! one's; without a variable that names the run (a plain torchrun launch names every run `none`),
//! set `MOK_RUN_ID` or give each launch a fresh directory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::id_file::{deadline_after, digest, io_error, poll_until, run_nonce, write_atomically};
use super::launch_env::LaunchEnv;
use crate::error::{MokError, Result};

/// One rank's side of the file all-gather.
pub struct FileRendezvous {
    dir: PathBuf,
    /// The launch's nonce, hashed into a file-name prefix.
    prefix: String,
    rank: usize,
    world: usize,
    round: u32,
    timeout: Duration,
}

impl FileRendezvous {
    /// `env`'s rank of `env.world` over `dir` (created when missing), each wait for a peer's
    /// file bounded by `timeout`. The nonce comes from the process environment.
    pub fn new(dir: impl Into<PathBuf>, env: &LaunchEnv, timeout: Duration) -> Result<Self> {
        Self::with_nonce(dir, env, timeout, &run_nonce(|name| std::env::var(name).ok()))
    }

    /// [`Self::new`] with the nonce given (tests).
    fn with_nonce(dir: impl Into<PathBuf>, env: &LaunchEnv, timeout: Duration, nonce: &str) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| io_error(format!("create {}", dir.display()), e))?;
        Ok(Self {
            dir,
            prefix: format!("mok-{:016x}", digest(nonce)),
            rank: env.rank,
            world: env.world,
            round: 0,
            timeout,
        })
    }

    fn path(&self, round: u32, rank: usize) -> PathBuf {
        self.dir.join(format!("{}-{round}-{rank}", self.prefix))
    }

    /// Every rank's `mine` (the same length on every rank), in rank order.
    pub fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
        write_atomically(&self.path(self.round, self.rank), mine)?;
        let start = Instant::now();
        let mut all = Vec::with_capacity(mine.len() * self.world);
        for rank in 0..self.world {
            let path = self.path(self.round, rank);
            let bytes = wait_for_file(&path, start, self.timeout).map_err(|detail| MokError::Timeout {
                rank: Some(self.rank),
                peer: Some(rank),
                waited_for: format!("rank {rank}'s all-gather file {} (round {})", path.display(), self.round),
                detail,
            })?;
            if bytes.len() != mine.len() {
                return Err(MokError::InvalidInput {
                    tensor: "all-gather",
                    problem: format!(
                        "rank {rank} gave {} bytes in round {}, this rank {}: every rank must give the same length",
                        bytes.len(),
                        self.round,
                        mine.len()
                    ),
                });
            }
            all.extend(bytes);
        }
        // Every rank has read the round before: its own file can go.
        if let Some(before) = self.round.checked_sub(1) {
            let _ = std::fs::remove_file(self.path(before, self.rank));
        }
        self.round += 1;
        Ok(all)
    }
}

/// The file's bytes once it exists, polling until `timeout` after `start`; `Err` says why not.
fn wait_for_file(path: &Path, start: Instant, timeout: Duration) -> std::result::Result<Vec<u8>, String> {
    let look = || match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read it: {e}")),
    };
    poll_until(deadline_after(start, timeout), Duration::from_millis(2), look)?
        .ok_or_else(|| format!("not written after {timeout:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symmetric::Launcher;

    fn env(rank: usize, world: usize) -> LaunchEnv {
        LaunchEnv { rank, world, local_rank: rank, launcher: Launcher::Torchrun }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mok-rendezvous-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn ranks_on_threads_gather_every_round_in_rank_order_and_leave_only_the_last() {
        let dir = scratch("rounds");
        let world = 4;
        let gathered: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let dir = dir.clone();
                    s.spawn(move || {
                        let mut rendezvous =
                            FileRendezvous::with_nonce(dir, &env(rank, world), Duration::from_secs(20), "run a")
                                .unwrap();
                        // Ranks start their rounds at different moments.
                        std::thread::sleep(Duration::from_millis(5 * rank as u64));
                        (0..3u8).map(|round| rendezvous.all_gather(&[rank as u8, round, 7]).unwrap()).collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, rounds) in gathered.iter().enumerate() {
            for (round, all) in rounds.iter().enumerate() {
                let want: Vec<u8> = (0..world as u8).flat_map(|r| [r, round as u8, 7]).collect();
                assert_eq!(all, &want, "rank {rank}, round {round}");
            }
        }
        let mut left: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left.len(), world, "only the last round's files stay: {left:?}");
        assert!(left.iter().all(|name| name.contains("-2-")), "{left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_rank_is_a_timeout_naming_it_and_another_launchs_files_are_not_read() {
        let dir = scratch("missing");
        // An earlier launch's rank 1 left its round-0 file in the same directory.
        let mut earlier = FileRendezvous::with_nonce(&dir, &env(1, 2), Duration::from_millis(50), "run a").unwrap();
        let _ = earlier.all_gather(&[9, 9]);
        let mut rank0 = FileRendezvous::with_nonce(&dir, &env(0, 2), Duration::from_millis(100), "run b").unwrap();
        let start = Instant::now();
        match rank0.all_gather(&[1, 2]) {
            Err(MokError::Timeout { rank: Some(0), peer: Some(1), waited_for, detail }) => {
                assert!(waited_for.contains("round 0") && detail.contains("not written"), "{waited_for}: {detail}");
            }
            other => panic!("expected a timeout naming rank 1, got {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(5));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ranks_giving_different_lengths_are_refused() {
        let dir = scratch("lengths");
        let results: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let dir = dir.clone();
                    s.spawn(move || {
                        let mut r =
                            FileRendezvous::with_nonce(dir, &env(rank, 2), Duration::from_secs(20), "run").unwrap();
                        r.all_gather(&vec![0u8; 3 + rank])
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for result in results {
            assert!(matches!(result, Err(MokError::InvalidInput { tensor: "all-gather", .. })), "{result:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
