//! autotp-ir: the intermediate representation every stage of autotp shares.
//!
//! - [`Graph`]: values and nodes in arenas with typed ids ([`ValueId`], [`NodeId`]), static
//!   [`TensorType`]s, a device [`Mesh`] and one [`Placement`] per value and mesh axis.
//! - [`Op`]: the closed set of operations, each with typed attributes and a shape rule
//!   (`shape_rules.rs`, by op family).
//! - [`mod@verify`]: checks every invariant and reports all violations.
//! - [`text`]: the deterministic text format; `text::parse(&text::print(g)) == g`.
//! - [`eval`]: the reference evaluator (constant folding, test oracles) over [`Tensor`]s.
//! - [`lower::kernel_for`]: the builtin kernel that computes an op; codegen uses it too.
//! - [`sharding`]: local shapes, every op's sharding rule, resharding by collectives.
//! - [`spmd`]: the reference evaluator over a mesh (every rank in one process).
//!
//! Invariants: a verified graph defines every value exactly once, before its uses; every node's
//! output types are what its op's rule infers from its inputs; parameters are floating point.
//! The crate does no I/O, holds no kernel IR (generated kernels are `autotp-kernelgen`'s) and
//! pulls in no protobuf, LLVM or CUDA.

pub mod eval;
mod graph;
pub mod lower;
mod op;
mod shape_rules;
pub mod sharding;
pub mod spmd;
mod tensor;
pub mod text;
mod types;
mod verify;

pub use autotp_kernels::shape::broadcast_shapes;
pub use autotp_kernels::{
    scalar_bytes, AlignedBuf, AttentionMask, BinaryOp, DType, GeluApprox, ReduceOp, Reduction, ScatterReduction,
    UnaryOp,
};
pub use autotp_program::mesh::Collective;
pub use graph::{Def, Fusion, Graph, Node, NodeId, Rewriter, Value, ValueId};
pub use op::{slice_len, Message, Op};
pub use tensor::Tensor;
pub use types::{Mesh, MeshAxis, Placement, TensorType, CONTEXT_AXIS, DATA_AXIS, EXPERT_AXIS};
pub use verify::{verify, VerifyError, VerifyErrors};
