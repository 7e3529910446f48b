//! autotp-llvm: lowers the kernel IR ([`autotp_kernels::kir`]) through LLVM 19 (inkwell).
//!
//! One description, two targets (XLA's shared emitters): [`emit`] lowers a stage's expressions
//! and memory accesses to LLVM values of any vector width, and [`math`] gives the
//! transcendentals (exp, log, tanh, erf, sigmoid) as the project's own polynomials built from
//! those same operations, so every target computes them identically and none calls libm.
//! - [`cpu`]: x86-64. Each kernel becomes `void k(u8** buffers, i64 begin, i64 end)` running
//!   rows `begin..end` with explicit vectors of the host's width and a scalar tail; a plan's
//!   kernels are optimised at O3 for the host CPU, emitted as one object file, and loaded into
//!   the process-wide JIT ([`jit`]), which keeps them for the life of the process and reuses a
//!   kernel already compiled.
//! - [`nvptx`]: CUDA. A plan's kernels as one PTX module per GPU architecture (sm_80, sm_90),
//!   made when the plan is compiled: rows on blocks, the inner dimension on threads, row
//!   reductions with warp shuffles. The module also holds the optimizer steps and the builtin
//!   kernels' GPU forms: data movement, [`indexed`] gathers and scatter-adds, [`axis`]
//!   top-k and scatter-elements (a mixture of experts' routing) and [`grouped`] expert GEMMs.
//! - [`attention`]: fused attention's forward and backward passes for x86 and NVPTX, an online
//!   softmax over blocks of keys, never the scores matrix.
//! - [`optim`]: the multi-tensor optimizer step (AdamW, SGD) over a table of chunks, for both
//!   targets, bit-identical to the Rust kernels.
//!
//! Fast-math flags are never set: attention masks use -inf and NaN must propagate, so only
//! exact rewrites happen, and `fma` appears only where the polynomials ask for it.

pub mod attention;
pub mod attention_tiles;
pub mod axis;
pub mod cpu;
pub mod emit;
pub mod grouped;
pub mod indexed;
mod items;
pub mod jit;
mod lanes;
pub mod math;
pub mod nvptx;
pub mod optim;
pub mod warp_simulator;

pub use cpu::{compile_cpu, compile_cpu_functions, CpuKernel};

/// What the code generator makes one function of.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub enum Function<'a> {
    /// A kernel of the kernel IR.
    Kernel(&'a autotp_kernels::kir::Kernel),
    /// A multi-tensor optimizer step.
    OptimizerStep(&'a autotp_kernels::optim::OptimizerKernel),
    /// A pass of a fused attention (cut for x86, or for a GPU: the emulated GPU runs that here).
    Attention(&'a autotp_kernels::attention::AttentionFunction),
    /// A top-k or scatter-elements in a GPU's form (the emulated GPU runs it here).
    Axis(&'a autotp_kernels::axis::AxisKernel),
    /// A grouped expert GEMM in a GPU's form (tests compare it with the builtin kernel here).
    Grouped(&'a autotp_kernels::grouped::GroupedKernel),
    /// A kernel as one thread of a simulated GPU block runs its NVPTX form ([`warp_simulator`];
    /// tests).
    SimulatedKernel(&'a autotp_kernels::kir::Kernel),
    /// An attention pass as one thread of a simulated GPU block runs its NVPTX form
    /// ([`warp_simulator`]; tests).
    SimulatedAttention(&'a autotp_kernels::attention::AttentionFunction),
}

/// O3 without loop unrolling: the emitters already write vector loops, and unrolling their
/// constant trip counts (a row of 128 is 8 vector steps) multiplied code size and compile time
/// (a GPT-2 124M plan's softmax alone was 160 KB of IR) for no measured gain.
pub(crate) fn pass_options() -> inkwell::passes::PassBuilderOptions {
    let options = inkwell::passes::PassBuilderOptions::create();
    options.set_loop_unrolling(false);
    options
}

/// Why a kernel could not be generated or loaded.
#[derive(Debug, thiserror::Error)]
pub enum LlvmError {
    #[error(transparent)]
    Kir(#[from] autotp_kernels::kir::KirError),
    #[error("LLVM could not build kernel code: {0}")]
    Builder(#[from] inkwell::builder::BuilderError),
    #[error("LLVM {stage} failed: {message}")]
    Llvm { stage: &'static str, message: String },
}

impl LlvmError {
    pub(crate) fn llvm(stage: &'static str, message: impl ToString) -> LlvmError {
        LlvmError::Llvm { stage, message: message.to_string() }
    }
}
