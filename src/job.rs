//! How `run` and `train` take their place in a job: alone (every rank a thread of this
//! process), or as one rank of a job of processes over MPI when a launcher started several
//! (`mpirun`, `srun`, or `autotp run --launch N`, which starts them with `mpirun`).
//!
//! In a job, every failure ends the whole job: an error is printed by the rank it happened on,
//! which then calls `MPI_Abort`; a panic does the same (the panic hook); an operation waiting
//! on the other ranks past `--comm-timeout` ends it from the watchdog.
//!
//! A preempting signal (`autotp_train::preemption`) reaches each process from the scheduler
//! (`srun --signal`) or from mpirun, which forwards SIGUSR1; `--launch` forwards its own
//! SIGTERM or SIGUSR1 to mpirun as SIGUSR1.

use std::ffi::OsString;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use autotp_program::plan::TrainingPlan;
use autotp_runtime::comm::{MpiComm, Topology};
use autotp_runtime::launch::{discover, Launcher};
use autotp_train::preemption;

/// The process's job for `plan`: `None` alone, else this rank's communicator, with MPI
/// initialised and the panic hook installed.
pub fn start(plan: &TrainingPlan, comm_timeout: f64) -> Result<Option<Arc<MpiComm>>> {
    let place = discover()?;
    if place.world_size == 1 {
        return Ok(None);
    }
    if place.launcher == Launcher::Slurm && std::env::var_os("SLURM_STEP_ID").is_none() {
        // A batch script inside an allocation sees SLURM's variables without being a task.
        tracing::warn!(
            "SLURM's variables describe {} tasks, but this is no srun task: running alone",
            place.world_size
        );
        return Ok(None);
    }
    let sizes: Vec<usize> = plan.stages[0].mesh.iter().map(|a| a.size).collect();
    let topology = Topology::new(plan.stages.len(), &sizes);
    if place.launcher == Launcher::Torchrun {
        bail!(
            "torchrun started this process as rank {} of {}: CPU ranks as processes run over MPI; start them with \
             mpirun -n {} (or autotp run --launch {})",
            place.rank,
            place.world_size,
            place.world_size,
            place.world_size
        );
    }
    if place.world_size != topology.world_size() {
        bail!(
            "{} started {} processes, but the plan has {} ranks ({} pipeline stage(s) of mesh {:?}): start {}",
            place.launcher.name(),
            place.world_size,
            topology.world_size(),
            topology.stages,
            topology.sizes,
            topology.world_size()
        );
    }
    if !(comm_timeout > 0.0 && comm_timeout.is_finite()) {
        bail!("--comm-timeout {comm_timeout} must be a positive number of seconds");
    }
    let job = MpiComm::init(topology, place.launcher.name(), place.world_size, Duration::from_secs_f64(comm_timeout))
        .context("cannot start the job's communication")?;
    job.install_panic_hook();
    Ok(Some(job))
}

/// Runs `body` as this process's part of `job`: when it fails, the job ends (this rank says
/// why); when it succeeds, MPI finishes.
pub fn run_in<T>(job: Option<&Arc<MpiComm>>, body: impl FnOnce() -> Result<T>) -> Result<T> {
    let result = body();
    let Some(job) = job else { return result };
    match result {
        Err(e) => job.abort_job(&crate::render(&e)),
        Ok(value) => {
            job.finalize()?;
            Ok(value)
        }
    }
}

/// `autotp run --launch N ...`: runs this same command as `N` processes on this machine under
/// Open MPI's `mpirun` (with `--oversubscribe` when they outnumber the cores), and returns its
/// exit status.
pub fn launch(processes: usize) -> Result<std::process::ExitStatus> {
    if processes == 0 {
        bail!("--launch 0: start at least one process");
    }
    let place = discover()?;
    if place.world_size > 1 && place.launcher != Launcher::Slurm {
        bail!("--launch inside a job that {} already started: leave out --launch", place.launcher.name());
    }
    let exe = std::env::current_exe().context("cannot find the autotp executable to launch")?;
    let mut args: Vec<OsString> = Vec::new();
    let mut given = std::env::args_os().skip(1);
    while let Some(arg) = given.next() {
        if arg == "--launch" {
            given.next();
        } else if !arg.to_string_lossy().starts_with("--launch=") {
            args.push(arg);
        }
    }
    let mut mpirun = std::process::Command::new("mpirun");
    mpirun.arg("-n").arg(processes.to_string());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if processes > cores {
        mpirun.arg("--oversubscribe");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        mpirun.arg("--allow-run-as-root");
    }
    mpirun.arg(exe).args(args);
    // A scheduler's SIGTERM or SIGUSR1 to this process reaches the ranks as SIGUSR1, which
    // mpirun forwards to each (a SIGTERM to mpirun itself would end the job after a second).
    preemption::watch().context("cannot install the handlers of SIGTERM and SIGUSR1")?;
    let mut job = mpirun.spawn().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => anyhow::anyhow!(
            "--launch starts the processes with Open MPI's mpirun, which is not installed \
             (Debian: apt-get install openmpi-bin)"
        ),
        _ => anyhow::anyhow!("cannot start mpirun: {e}"),
    })?;
    let mut forwarded = false;
    loop {
        if let Some(status) = job.try_wait().context("cannot wait for mpirun")? {
            return Ok(status);
        }
        if !forwarded && preemption::requested().is_some() {
            // SAFETY: kill only sends a signal to mpirun, a child of this process.
            unsafe { libc::kill(job.id() as libc::pid_t, libc::SIGUSR1) };
            forwarded = true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
