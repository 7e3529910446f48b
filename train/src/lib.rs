//! autotp-train: training a plan, step after step, on the runtime's devices and ranks.
//!
//! - [`trainer`]: [`trainer::Trainer`] loads a plan on this process's ranks (CPU threads or
//!   GPUs; with MPI, one rank per process), feeds each step its batch, learning rate, step
//!   number and loss scale, runs the ranks, moves the loss scaler, and saves and resumes
//!   checkpoints (each rank's blocks; resuming under another layout of the same training).
//! - [`checkpoint`]: checkpoint directories (safetensors + JSON manifest, written atomically,
//!   as DeepSpeed lays them out).
//! - [`data`]: the training token stream and its windows (the data contract).
//! - [`dataset`]: what `--data` names: a raw token file, or Megatron indexed datasets (a
//!   prefix, a weighted blend), their `--split`, samples shuffled by the seed epoch by epoch.
//! - [`indexed`]: Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), written by
//!   `autotp data prepare`.
//! - [`preemption`]: SIGTERM and SIGUSR1 as a request to checkpoint and stop after the step.
//! - [`tensorboard`]: TensorBoard event files of the steps' scalars (`run --tensorboard`).
//! - [`trace`]: the ranks' timelines as a Chrome/Perfetto trace (`run --trace`).
//!
//! Invariant: a resumed run is bit-identical to an uninterrupted one (a step depends only on
//! the state before it, the step number and the data).

pub mod checkpoint;
pub mod data;
pub mod dataset;
pub mod indexed;
pub mod preemption;
pub mod tensorboard;
pub mod trace;
pub mod trainer;

use std::path::PathBuf;

use autotp_program::ProgramError;
use autotp_runtime::RuntimeError;

/// Why training cannot start or go on.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Program(#[from] ProgramError),
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    /// Training cannot go on (an fp16 loss scale at its floor).
    #[error("{0}")]
    Training(String),
    /// A step's loss or gradients were not finite (`--nan-policy stop`).
    #[error("step {step}: {message}")]
    NonFinite { step: usize, message: String },
}

impl TrainError {
    /// The plan cannot be trained as it is (a [`ProgramError::Plan`]: "the training plan ...").
    pub(crate) fn plan(message: String) -> TrainError {
        TrainError::Program(ProgramError::Plan(message))
    }
}
