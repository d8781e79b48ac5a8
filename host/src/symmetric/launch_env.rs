//! Rank, world size and local rank from the launcher's environment: torchrun (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`), an `srun` step (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` or else
//! `SLURM_NTASKS`, `SLURM_LOCALID`), or a single process when neither is set. Slurm's variables
//! count only inside a step (`SLURM_STEP_ID` set, as `srun` sets it): an `sbatch` script's batch
//! step, or an `salloc` shell, is one process whatever the allocation's task count.

use crate::error::{MokError, Result};

/// Which launcher the environment came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// `torchrun` / `torch.distributed.run`.
    Torchrun,
    /// `srun`.
    Slurm,
    /// No launcher variables: one rank.
    Single,
}

/// This process's place among the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank.
    pub rank: usize,
    /// Ranks in total.
    pub world: usize,
    /// Rank within this node (picks the GPU).
    pub local_rank: usize,
    /// Where the values came from.
    pub launcher: Launcher,
}

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `get` (the process environment in [`Self::from_env`]; a map
    /// in tests). torchrun's variables win when both launchers' are present (torchrun under
    /// Slurm sets both, and its own are the per-process ones).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let number = |name: &'static str| -> Result<Option<usize>> {
            match get(name) {
                None => Ok(None),
                Some(text) => text.trim().parse::<usize>().map(Some).map_err(|_| MokError::InvalidConfig {
                    field: name,
                    value: text.clone(),
                    rule: "must be a non-negative integer (set by the launcher)".into(),
                }),
            }
        };
        let (names, launcher) = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            (("RANK", "WORLD_SIZE", "LOCAL_RANK"), Launcher::Torchrun)
        } else if in_slurm_step(&get) {
            // The step's own task count: `srun --preserve-env` leaves SLURM_NTASKS the allocation's.
            let world = if get("SLURM_STEP_NUM_TASKS").is_some() { "SLURM_STEP_NUM_TASKS" } else { "SLURM_NTASKS" };
            (("SLURM_PROCID", world, "SLURM_LOCALID"), Launcher::Slurm)
        } else {
            return Ok(Self { rank: 0, world: 1, local_rank: 0, launcher: Launcher::Single });
        };
        let missing = |name: &'static str| MokError::InvalidConfig {
            field: name,
            value: "unset".into(),
            rule: format!("the launcher set {} but not {name}", if name == names.0 { names.1 } else { names.0 }),
        };
        let rank = number(names.0)?.ok_or_else(|| missing(names.0))?;
        let world = number(names.1)?.ok_or_else(|| missing(names.1))?;
        let local_rank = match number(names.2)? {
            Some(local) => local,
            // One process: its local rank can only be 0.
            None if world == 1 => 0,
            None => return Err(missing(names.2)),
        };
        if world == 0 || rank >= world {
            return Err(MokError::InvalidConfig {
                field: names.0,
                value: rank.to_string(),
                rule: format!("must be below {} = {world}", names.1),
            });
        }
        if local_rank > rank {
            return Err(MokError::InvalidConfig {
                field: names.2,
                value: local_rank.to_string(),
                rule: format!("a local rank cannot exceed the global rank {rank}"),
            });
        }
        Ok(Self { rank, world, local_rank, launcher })
    }
}

/// Whether the variables are an `srun` step's (`SLURM_STEP_ID`, or its older spelling
/// `SLURM_STEPID`), not a batch script's or an allocation shell's.
fn in_slurm_step(get: impl Fn(&str) -> Option<String>) -> bool {
    get("SLURM_STEP_ID").is_some() || get("SLURM_STEPID").is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        LaunchEnv::from_vars(|name| map.get(name).cloned())
    }

    #[test]
    fn torchrun_slurm_and_single() {
        assert_eq!(
            env(&[("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")]).unwrap(),
            LaunchEnv { rank: 5, world: 8, local_rank: 1, launcher: Launcher::Torchrun }
        );
        assert_eq!(
            env(&[("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "3")])
                .unwrap(),
            LaunchEnv { rank: 3, world: 4, local_rank: 3, launcher: Launcher::Slurm }
        );
        // The step's task count wins over the allocation's (srun --preserve-env).
        let preserved = [
            ("SLURM_STEPID", "1"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_LOCALID", "1"),
        ];
        assert_eq!(env(&preserved).unwrap().world, 2);
        // An sbatch script's batch step or an salloc shell: the allocation's variables, no step.
        let batch = env(&[("SLURM_JOB_ID", "7"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8")]).unwrap();
        assert_eq!(batch, LaunchEnv { rank: 0, world: 1, local_rank: 0, launcher: Launcher::Single });
        assert_eq!(env(&[]).unwrap(), LaunchEnv { rank: 0, world: 1, local_rank: 0, launcher: Launcher::Single });
        // torchrun inside a Slurm allocation: torchrun's per-process values win.
        let both = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
        ])
        .unwrap();
        assert_eq!((both.rank, both.launcher), (2, Launcher::Torchrun));
        assert_eq!(env(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap().local_rank, 0);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let field = |pairs: &[(&str, &str)]| match env(pairs) {
            Err(MokError::InvalidConfig { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        };
        assert_eq!(field(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]), "RANK");
        assert_eq!(field(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]), "RANK");
        assert_eq!(field(&[("RANK", "1"), ("WORLD_SIZE", "2")]), "LOCAL_RANK");
        assert_eq!(field(&[("WORLD_SIZE", "2")]), "RANK");
        let step = ("SLURM_STEP_ID", "0");
        assert_eq!(
            field(&[step, ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "-2"), ("SLURM_LOCALID", "0")]),
            "SLURM_NTASKS"
        );
        assert_eq!(
            field(&[step, ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "2")]),
            "SLURM_LOCALID"
        );
        assert_eq!(field(&[step, ("SLURM_NTASKS", "4")]), "SLURM_PROCID");
    }
}
