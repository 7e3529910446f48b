//! autotp-runtime: executes [`autotp_program::Program`]s on devices and between ranks (the
//! training loop over them is `autotp-train`).
//!
//! - [`Executor`]: runs a program on the CPU (builtin kernels, the plan's generated kernels
//!   JIT-compiled for this CPU at load).
//! - [`gpu`]: a program on a GPU, the host's side (over the `Gpu` interface; an emulator for
//!   tests); [`cuda`]: finding the CUDA driver and its GPUs (loaded at run time, never linked);
//!   [`streams`]: a program's instructions on a device's streams, ordered by events.
//! - [`comm`]: collectives between ranks (`LocalComm`: ranks as threads; `MpiComm`: processes);
//!   [`launch`]: this process's rank, world size and local rank, from its launcher's variables;
//!   [`rendezvous`]: rank 0's bytes (NCCL's unique id) shared with every rank over TCP.
//! - [`nvme`]: optimizer state in files, streamed through the step in tiles
//!   (`--offload-optimizer nvme`); [`param_file`]: parameter shards in files, fetched ahead of
//!   their uses (`--offload-param nvme`).
//! - [`npy`]: reading and writing `.npy` files for inputs and outputs; [`clock`]: how a rank
//!   times its run (`autotp run --clock`); [`profile`]: where a run's step time went, by op
//!   (`autotp run --profile`); [`trace`]: a timeline of a rank's streams (`autotp run --trace`);
//!   [`affinity`]: pinning threads to the cores this process may use
//!   (`autotp run --bind-cores`); [`non_finite`]: where a step's first inf or NaN came from
//!   (`--nan-policy stop`).
//!
//! This is the only crate that allocates device memory or starts rank threads. It selects no
//! kernel: it runs what the program names.

use std::path::PathBuf;

pub mod affinity;
pub mod clock;
pub mod comm;
mod cpu;
pub mod cuda;
mod executor;
pub mod gpu;
pub mod launch;
pub mod non_finite;
pub mod npy;
pub mod nvme;
mod optimizer_step;
pub mod param_file;
pub mod profile;
pub mod rendezvous;
pub mod streams;
pub mod trace;

pub use executor::{Executor, HostTensor};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Program(#[from] autotp_program::ProgramError),
    #[error("invalid program: {0}")]
    InvalidProgram(String),
    #[error("the program has no parameter or state '{0}'")]
    UnknownParam(String),
    #[error("{what} has {got} bytes, expected {expected}")]
    WrongSize { what: String, expected: usize, got: usize },
    #[error("the program takes {expected} inputs, got {got}")]
    InputCount { expected: usize, got: usize },
    #[error("input '{name}' must be {expected}, got {got}")]
    InputType { name: String, expected: String, got: String },
    #[error("{label}: {source}")]
    Kernel { label: String, source: autotp_kernels::KernelError },
    #[error("the program's generated kernels could not be compiled: {0}")]
    KernelCompile(String),
    #[error("{path}: {message}")]
    Npy { path: String, message: String },
    #[error("cannot {action} {path}: {source}")]
    Io { action: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("the training plan {0}")]
    Plan(String),
    #[error("{0}")]
    Device(String),
    #[error("communication: {0}")]
    Comm(String),
    /// Another rank of this process failed, so this one stopped (the other's error is the one
    /// to report).
    #[error("communication: another rank failed; this one stops")]
    PeerFailed,
    #[error("cannot read the thread's CPU time: {0}")]
    ThreadCpuTime(std::io::Error),
    #[error("rank {rank}: {source}")]
    Rank { rank: usize, source: Box<RuntimeError> },
}
