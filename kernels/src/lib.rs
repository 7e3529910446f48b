//! autotp-kernels: the compute vocabulary shared by the IR and the runtime.
//!
//! - [`DType`] and the elementwise/reduction op kinds ([`UnaryOp`], [`BinaryOp`], [`ReduceOp`]).
//! - [`Kernel`]: one builtin kernel with static shapes, and `Kernel::run` over byte slices.
//! - [`attention`]: attention forward and backward without the scores (FlashAttention's algorithm).
//! - [`kir`]: the kernel IR of generated kernels (a loop nest the `autotp-llvm` crate lowers).
//! - [`indexed`]: gathers and scatter-adds in the form a GPU kernel runs them.
//! - [`isa`]: the x86-64 level autotp's own CPU code runs at (`AUTOTP_CPU_ISA` lowers it).
//! - [`AlignedBuf`]: the 64-byte aligned host buffer every producer of kernel outputs uses.
//!
//! The IR's reference evaluator (constant folding, test oracles) and the runtime's executor
//! both call these kernels, so each op's arithmetic is written once. Kernels never panic on
//! user data: an index out of range or an unsupported dtype is a [`KernelError`].
//! Kernels use rayon for data parallelism and the `gemm` crate for matrix products.

pub mod attention;
pub mod axis;
mod buffer;
mod dtype;
mod elementwise;
pub mod grouped;
pub mod indexed;
pub mod isa;
mod kernel;
pub mod kir;
pub mod kir_movement;
mod matmul;
pub mod matmul_bf16;
mod movement;
mod nn;
mod ops;
pub mod optim;
mod reduce;
mod scalar;
pub mod shape;

pub use attention::{AttentionDims, AttentionMask};
pub use buffer::{view, view_mut, AlignedBuf};
pub use dtype::DType;
pub use kernel::{IndexBlock, Kernel};
pub use matmul::{MatMulDims, OperandLayout};
pub use nn::ClassLossDims;
pub use ops::{BinaryOp, GeluApprox, ReduceOp, Reduction, ScatterReduction, UnaryOp};
pub use optim::{AdamWConfig, Optimizer, SgdConfig};
pub use shape::numel;

/// Why a kernel could not run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KernelError {
    #[error("{kernel}: index {index} is out of range for a dimension of size {bound}")]
    IndexOutOfRange { kernel: &'static str, index: i64, bound: usize },
    #[error("{kernel}: not supported for {what}")]
    Unsupported { kernel: &'static str, what: String },
    #[error("{kernel}: got {inputs} inputs and {outputs} outputs")]
    Arity { kernel: &'static str, inputs: usize, outputs: usize },
    #[error("{kernel}: a buffer does not match the kernel's shapes")]
    BufferSize { kernel: &'static str },
    #[error("an output buffer is not aligned for its element type")]
    Misaligned,
}

/// The bytes of one element of `dtype` holding `value` (rounded or truncated as a cast would).
pub fn scalar_bytes(dtype: DType, value: f64) -> Vec<u8> {
    match dtype {
        DType::F32 => (value as f32).to_le_bytes().to_vec(),
        DType::F64 => value.to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f64(value).to_le_bytes().to_vec(),
        DType::BF16 => half::bf16::from_f64(value).to_le_bytes().to_vec(),
        DType::I64 => (value as i64).to_le_bytes().to_vec(),
        DType::I32 => (value as i32).to_le_bytes().to_vec(),
        DType::I8 => (value as i8).to_le_bytes().to_vec(),
        DType::U8 => (value as u8).to_le_bytes().to_vec(),
        DType::Bool => vec![(value != 0.0) as u8],
    }
}
