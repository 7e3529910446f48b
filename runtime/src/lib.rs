//! autotp-runtime: the Program format and its execution.
//!
//! - [`Program`]: slots (inputs, outputs, parameters), constants and instructions over one
//!   arena at planned offsets, with its [`MemoryPlan`]. It never refers to the IR.
//! - [`Executor`]: runs a program on the CPU with the builtin kernels.
//! - [`npy`]: reading and writing `.npy` files for inputs and outputs.
//! - [`nvme`]: optimizer state in files, streamed through the step in tiles (`--offload-optimizer nvme`).
//! - [`data`]: the training token stream and its windows (the data contract).
//! - [`schedule`]: learning-rate schedules (constant; linear warmup then cosine).
//! - [`plan`]: the compiled training plan and its `.atp` file.
//! - [`trainer`]: one training step after another over the token data; checkpoints.
//! - [`checkpoint`]: checkpoint directories (safetensors + JSON manifest, written atomically).
//! - [`tensor_file`]: reading and atomically writing safetensors files.
//! - [`comm`]: collectives between ranks (`LocalComm`: ranks as threads, byte counts).
//! - [`gpu`]: a program on a GPU, the host's side (over the `Gpu` interface; an emulator for tests).
//! - [`cuda`]: finding the CUDA driver and its GPUs (loaded at run time, never linked).
//! - [`clock`]: how a rank times its run (wall time, or its own CPU time: `autotp run --clock`).
//! - [`report`]: a plan's per-rank memory and per-step communication.
//! - [`streams`]: a program's instructions on a device's streams, ordered by events.
//! - [`profile`]: where a run's step time went, by op (`autotp run --profile`).
//! - [`affinity`]: pinning threads to the cores this process may use (`autotp run --bind-cores`).
//! - [`launch`]: this process's rank, world size and local rank, from its launcher's variables.
//! - [`rendezvous`]: rank 0's bytes (NCCL's unique id) shared with every rank over TCP.
//!
//! This is the only crate that allocates device memory or starts rank threads.

use std::path::PathBuf;

pub mod affinity;
pub mod checkpoint;
pub mod clock;
pub mod comm;
pub mod cuda;
pub mod data;
mod executor;
pub mod gpu;
pub mod launch;
pub mod loss_scale;
pub mod npy;
pub mod nvme;
pub mod plan;
pub mod profile;
mod program;
pub mod rendezvous;
pub mod report;
pub mod schedule;
pub mod streams;
pub mod tensor_file;
pub mod trainer;

pub use executor::{Executor, HostTensor};
pub use program::{
    ConstantData, Instruction, MemoryPlan, MeshAxis, OptimizerTensor, Program, PtxModule, Region, Slot, SlotPlacement,
    Update, HOST_POOL,
};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("invalid program: {0}")]
    InvalidProgram(String),
    /// Training cannot go on (an fp16 loss scale at its floor).
    #[error("{0}")]
    Training(String),
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
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("the training plan {0}")]
    Plan(String),
    #[error(transparent)]
    Data(#[from] data::DataError),
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
