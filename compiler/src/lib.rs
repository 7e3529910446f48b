//! autotp-compiler: the compile driver as a library. The CLI's `compile`, `train`, `plan` and
//! `verify`, the benches and the tests all compile through it.
//!
//! - [`flags`]: [`CompileFlags`], the compile command's flags as given (plans record them);
//!   [`deepspeed`]: a DeepSpeed configuration as those flags.
//! - [`options`]: [`CompileOptions::from_flags`], every refusal of the flags made in one place,
//!   and what they decide, typed.
//! - [`steps`]: the compile as a list of named steps (graph passes, the pipeline split,
//!   per-stage passes, tensor parallelism, fusion, lowering) run by one manager that verifies,
//!   times and shows each (`--dump-ir`, `--print-after` take their names from the list).
//! - [`compile()`](compile::compile): import, the model's refusals, the steps, the plan.
//! - [`recompute`]: what each stage recomputes (`--recompute`, `auto` under a memory cap).
//! - [`summary`]: the compile summary's text.
//!
//! The crate reads models and writes `--dump-ir` files; it runs nothing (no runtime, no
//! device): plans are data that the runtime executes.

/// Returns a [`CompileError::Options`] with the formatted message.
macro_rules! refuse {
    ($($arg:tt)*) => {
        return Err($crate::CompileError::Options(format!($($arg)*)))
    };
}

pub mod compile;
pub mod deepspeed;
pub mod flags;
pub mod layout_search;
pub mod options;
pub mod recompute;
pub mod steps;
pub mod summary;

use std::path::PathBuf;

pub use compile::{compile, Compiled, Weights};
pub use flags::CompileFlags;
pub use options::CompileOptions;

/// Why a model cannot be compiled as asked.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// A flag's value or a combination of flags autotp refuses, or a model they do not fit;
    /// the message names the flags.
    #[error("{0}")]
    Options(String),
    #[error(transparent)]
    Import(#[from] autotp_frontend::FrontendError),
    #[error(transparent)]
    Pass(#[from] autotp_passes::PassError),
    #[error(transparent)]
    Codegen(#[from] autotp_codegen::CodegenError),
    #[error(transparent)]
    Program(#[from] autotp_program::ProgramError),
    /// A DeepSpeed configuration autotp refuses (`--deepspeed`).
    #[error("--deepspeed {}: {message}", path.display())]
    DeepSpeed { path: PathBuf, message: String },
    #[error("{flag}: cannot {action} {path}: {source}")]
    Io { flag: &'static str, action: &'static str, path: PathBuf, source: std::io::Error },
}

/// A [`CompileError::Options`] with `message`.
pub(crate) fn refused(message: impl Into<String>) -> CompileError {
    CompileError::Options(message.into())
}

/// An error and its causes on one line, as the CLI prints them; a cause the message already
/// ends with is not repeated (library errors often repeat their cause in their message).
pub fn render_error(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let text = e.to_string();
        if !message.ends_with(&text) {
            message = format!("{message}: {text}");
        }
        cause = e.source();
    }
    message
}
