//! Where this process stands in a multi-process job: its rank, the world size and its rank on
//! its node, read from the environment the launcher left.
//!
//! The launchers are tried in this order, the first whose variables are present deciding:
//! 1. an explicit override (`AUTOTP_RANK`, `AUTOTP_WORLD_SIZE`, `AUTOTP_LOCAL_RANK`, which
//!    `autotp run --launch` sets for the processes it starts);
//! 2. torchrun and DeepSpeed's launcher (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`);
//! 3. Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!    `OMPI_COMM_WORLD_LOCAL_RANK`);
//! 4. MPICH and Intel MPI's Hydra (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`);
//! 5. SLURM's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`) last: SLURM sets its
//!    variables inside every allocation, so a job started by another launcher in an allocation
//!    sees them too, describing the allocation rather than the job.
//!
//! Without any of them the process is a job of its own (rank 0 of 1). A launcher's variables
//! that are partly missing, not numbers, or inconsistent (a rank past the world size) are an
//! error naming the variable, never a guess. Tests: the unit tests below, one per launcher.

use std::collections::BTreeMap;

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobPlace {
    pub rank: usize,
    pub world_size: usize,
    /// The rank among this node's processes (which GPU a CUDA rank takes).
    pub local_rank: usize,
    /// Which launcher's variables said so, for messages.
    pub launcher: Launcher,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher: a job of one process.
    None,
    /// `AUTOTP_RANK` and its companions.
    Explicit,
    Torchrun,
    OpenMpi,
    Mpich,
    Slurm,
}

impl Launcher {
    pub fn name(self) -> &'static str {
        match self {
            Launcher::None => "no launcher",
            Launcher::Explicit => "AUTOTP_RANK",
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Mpich => "MPICH",
            Launcher::Slurm => "SLURM",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LaunchError {
    #[error("{launcher} sets {present} but not {missing}")]
    Missing { launcher: &'static str, present: &'static str, missing: &'static str },
    #[error("{variable}={value} is not a non-negative integer")]
    NotANumber { variable: &'static str, value: String },
    #[error("{launcher}: rank {rank} is not below the world size {world_size}")]
    RankOutsideWorld { launcher: &'static str, rank: usize, world_size: usize },
    #[error("{launcher}: the world size is 0")]
    EmptyWorld { launcher: &'static str },
}

/// One launcher's variables: rank, world size, local rank.
struct Variables {
    launcher: Launcher,
    rank: &'static str,
    world_size: &'static str,
    local_rank: &'static str,
}

const LAUNCHERS: [Variables; 5] = [
    Variables {
        launcher: Launcher::Explicit,
        rank: "AUTOTP_RANK",
        world_size: "AUTOTP_WORLD_SIZE",
        local_rank: "AUTOTP_LOCAL_RANK",
    },
    Variables { launcher: Launcher::Torchrun, rank: "RANK", world_size: "WORLD_SIZE", local_rank: "LOCAL_RANK" },
    Variables {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        world_size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    },
    Variables { launcher: Launcher::Mpich, rank: "PMI_RANK", world_size: "PMI_SIZE", local_rank: "MPI_LOCALRANKID" },
    Variables {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        world_size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
    },
];

/// This process's place, from its environment.
pub fn discover() -> Result<JobPlace, LaunchError> {
    discover_in(&std::env::vars().collect())
}

/// The place that the variables `env` describe (see the module doc for the order).
pub fn discover_in(env: &BTreeMap<String, String>) -> Result<JobPlace, LaunchError> {
    for vars in &LAUNCHERS {
        if !env.contains_key(vars.rank) && !env.contains_key(vars.world_size) {
            continue;
        }
        let launcher = vars.launcher.name();
        let number = |variable: &'static str, other: &'static str| -> Result<usize, LaunchError> {
            let value =
                env.get(variable).ok_or(LaunchError::Missing { launcher, present: other, missing: variable })?;
            value.trim().parse().map_err(|_| LaunchError::NotANumber { variable, value: value.clone() })
        };
        let rank = number(vars.rank, vars.world_size)?;
        let world_size = number(vars.world_size, vars.rank)?;
        // A launcher on one node may leave out the local rank: then it is the rank.
        let local_rank = if env.contains_key(vars.local_rank) { number(vars.local_rank, vars.rank)? } else { rank };
        if world_size == 0 {
            return Err(LaunchError::EmptyWorld { launcher });
        }
        if rank >= world_size {
            return Err(LaunchError::RankOutsideWorld { launcher, rank, world_size });
        }
        return Ok(JobPlace { rank, world_size, local_rank, launcher: vars.launcher });
    }
    Ok(JobPlace { rank: 0, world_size: 1, local_rank: 0, launcher: Launcher::None })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn place(rank: usize, world_size: usize, local_rank: usize, launcher: Launcher) -> JobPlace {
        JobPlace { rank, world_size, local_rank, launcher }
    }

    #[test]
    fn each_launcher_is_read() {
        assert_eq!(discover_in(&env(&[])), Ok(place(0, 1, 0, Launcher::None)));
        let torchrun = env(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("MASTER_PORT", "29500")]);
        assert_eq!(discover_in(&torchrun), Ok(place(3, 8, 1, Launcher::Torchrun)));
        let open_mpi =
            env(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1")]);
        assert_eq!(discover_in(&open_mpi), Ok(place(1, 2, 1, Launcher::OpenMpi)));
        let mpich = env(&[("PMI_RANK", "5"), ("PMI_SIZE", "6"), ("MPI_LOCALRANKID", "2")]);
        assert_eq!(discover_in(&mpich), Ok(place(5, 6, 2, Launcher::Mpich)));
        let slurm = env(&[("SLURM_PROCID", "7"), ("SLURM_NTASKS", "16"), ("SLURM_LOCALID", "3")]);
        assert_eq!(discover_in(&slurm), Ok(place(7, 16, 3, Launcher::Slurm)));
        let explicit = env(&[("AUTOTP_RANK", "0"), ("AUTOTP_WORLD_SIZE", "2"), ("AUTOTP_LOCAL_RANK", "0")]);
        assert_eq!(discover_in(&explicit), Ok(place(0, 2, 0, Launcher::Explicit)));
    }

    #[test]
    fn the_order_decides_between_launchers() {
        // torchrun inside a SLURM allocation: the allocation's variables describe one task.
        let both = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
        ]);
        assert_eq!(discover_in(&both), Ok(place(2, 4, 2, Launcher::Torchrun)));
        // mpirun inside an allocation.
        let both = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]);
        assert_eq!(discover_in(&both), Ok(place(1, 2, 1, Launcher::OpenMpi)));
        // The explicit override wins over everything.
        let all = env(&[("AUTOTP_RANK", "1"), ("AUTOTP_WORLD_SIZE", "3"), ("RANK", "0"), ("WORLD_SIZE", "8")]);
        assert_eq!(discover_in(&all), Ok(place(1, 3, 1, Launcher::Explicit)));
    }

    #[test]
    fn bad_variables_are_named() {
        let err = discover_in(&env(&[("RANK", "1")])).unwrap_err();
        assert_eq!(err.to_string(), "torchrun sets RANK but not WORLD_SIZE");
        let err = discover_in(&env(&[("OMPI_COMM_WORLD_SIZE", "2")])).unwrap_err();
        assert_eq!(err.to_string(), "Open MPI sets OMPI_COMM_WORLD_SIZE but not OMPI_COMM_WORLD_RANK");
        let err = discover_in(&env(&[("PMI_RANK", "one"), ("PMI_SIZE", "2")])).unwrap_err();
        assert_eq!(err.to_string(), "PMI_RANK=one is not a non-negative integer");
        let err = discover_in(&env(&[("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4")])).unwrap_err();
        assert_eq!(err.to_string(), "SLURM: rank 4 is not below the world size 4");
        let err = discover_in(&env(&[("RANK", "0"), ("WORLD_SIZE", "0")])).unwrap_err();
        assert_eq!(err.to_string(), "torchrun: the world size is 0");
    }
}
