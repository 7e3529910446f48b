//! autotp-kernelgen: the generated kernels' description, made from the IR. The IR knows no
//! kernels; this crate, beside codegen, turns IR nodes into kernel IR ([`autotp_kernels::kir`])
//! that `autotp-llvm` lowers for every target.
//!
//! - [`group`]: a group of nodes (a fusion group, or one node) as one kernel, or the
//!   [`Refusal`] saying why not. The `fusion` pass asks it whether a group is legal (a group
//!   is legal exactly when it builds), and codegen asks it for the kernel, so the two cannot
//!   drift apart.
//! - [`mod@cross_entropy`]: a cross-entropy loss as its two kernels (per row, then the loss).
//! - [`index_rewrite`]: equality saturation (egg) over the kernels' index arithmetic, which
//!   codegen runs on every kernel before it stores it.
//! - [`split`]: a whole-tensor reduction as two kernels (partial sums over rows, then their
//!   total), so that it fills a GPU and a CPU's threads.

pub mod cross_entropy;
pub mod group;
pub mod index_rewrite;
pub mod split;

pub use cross_entropy::cross_entropy;
pub use group::{broadcast_index, build, strided_index, try_build, Built, Refusal, MAX_BUFFERS};
