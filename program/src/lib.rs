//! autotp-program: what codegen produces and the runtime executes, and its file.
//!
//! - [`Program`] (`program.rs`): one rank's step as instructions over one arena of bytes at
//!   planned offsets (builtin kernels, generated kernels, GEMMs, collectives, pipeline sends,
//!   optimizer steps), its slots, constants and [`MemoryPlan`]; [`Program::validate`] proves
//!   every region in bounds and every instruction's operands apart before anything runs.
//! - [`gpu`]: the builtin kernels a GPU runs as entries of the plan's PTX, chosen at compile
//!   time.
//! - [`mesh`]: the device mesh, placements and collectives, defined once for the IR and for
//!   programs.
//! - [`step`]: the step's inputs and outputs that the trainer feeds and reads.
//! - [`plan`]: the compiled training plan (a program per pipeline stage and how to train it)
//!   and its `.atp` file; [`tensor_file`]: the safetensors files plans and checkpoints use;
//!   [`weight_files`]: the model's files a plan reads its initial weights from;
//!   [`folder_paths`]: the paths those files and checkpoints name, kept inside their folder.
//! - What a plan tells the trainer: [`lr_schedule`] (learning-rate schedules), [`loss_scale`]
//!   (fp16 loss scalers and their rules), [`offload`] (the optimizer state's file layout).
//! - [`report`]: a plan's per-rank memory and per-step communication, read off its programs.
//!
//! Invariants: a Program never refers to the IR, names no device and carries no machine code
//! (its generated kernels are kernel IR, checked in bounds by `kir::Kernel::check`, and PTX); a
//! plan read from a file is validated (fingerprint, regions, feeds) before it is returned. This
//! crate depends on `autotp-kernels` alone among autotp's crates.

pub mod folder_paths;
pub mod gpu;
pub mod loss_scale;
pub mod lr_schedule;
pub mod mesh;
pub mod offload;
pub mod param_file;
pub mod plan;
mod program;
pub mod report;
pub mod step;
pub mod tensor_file;
pub mod weight_files;

use std::path::PathBuf;

pub use mesh::{Collective, CollectiveOp, MeshAxis, Placement};
pub use program::{
    ConstantData, Instruction, MemoryPlan, OptimizerTensor, Program, PtxModule, Region, Slot, Update, HOST_POOL,
};

/// Why a program or plan is refused, or its file cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error("invalid program: {0}")]
    InvalidProgram(String),
    #[error("the training plan {0}")]
    Plan(String),
    #[error("{what} has {got} bytes, expected {expected}")]
    WrongSize { what: String, expected: usize, got: usize },
    #[error("cannot {action} {path}: {source}")]
    Io { action: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
}
