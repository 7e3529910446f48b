//! Communication between ranks, behind one interface, [`Communicator`], that the executor
//! runs its collectives and pipeline messages through:
//!
//! - [`LocalComm`] (`local.rs`): ranks as threads of one process, the default;
//! - [`MpiComm`] (`mpi.rs`): one rank per process, over MPI (Open MPI's library, loaded when a
//!   run is started by an MPI launcher; `mpi_library.rs`).
//!
//! Both place ranks the same way ([`Topology`]): with pipeline stages, the world is `stages`
//! copies of the mesh (rank = stage x mesh size + mesh rank, the mesh row-major, its last axis
//! fastest); a collective groups the ranks of a stage that differ only in their coordinate on
//! its mesh axis, and a pipeline message goes between the same mesh position of two stages.
//! Both count the bytes each rank would send with ring algorithms ([`CommBytes`]), whatever
//! algorithm actually runs, so measured and planned communication compare.

use std::time::Duration;

use autotp_kernels::DType;
use serde::{Deserialize, Serialize};

use crate::RuntimeError;

mod local;
mod mpi;
mod mpi_library;

pub use local::LocalComm;
pub use mpi::{MpiComm, MpiError};

/// A collective along one mesh axis (see `autotp_ir::Collective`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// partial sums -> the sum on every rank.
    AllReduce,
    /// shards along `dim` -> their concatenation on every rank.
    AllGather { dim: usize },
    /// partial sums -> each rank's slice along `dim` of the sum.
    ReduceScatter { dim: usize },
    /// whole value -> each rank's slice along `dim` (no communication).
    ShardSlice { dim: usize },
}

impl CollectiveKind {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather { .. } => "all_gather",
            CollectiveKind::ReduceScatter { .. } => "reduce_scatter",
            CollectiveKind::ShardSlice { .. } => "shard_slice",
        }
    }

    /// The local output shape for a local input `shape` over `n` ranks, if it is valid.
    pub fn output_shape(self, shape: &[usize], n: usize) -> Option<Vec<usize>> {
        let mut out = shape.to_vec();
        match self {
            CollectiveKind::AllReduce => {}
            CollectiveKind::AllGather { dim } => *out.get_mut(dim)? *= n,
            CollectiveKind::ReduceScatter { dim } | CollectiveKind::ShardSlice { dim } => {
                let d = out.get_mut(dim)?;
                if n == 0 || *d % n != 0 {
                    return None;
                }
                *d /= n;
            }
        }
        Some(out)
    }

    /// Bytes of host buffers one rank stages for an input of `bytes` in [`LocalComm`]: its
    /// deposited copy, plus the sum for reductions (and the full sum a reduce-scatter slices).
    pub fn staging_bytes(self, bytes: usize) -> usize {
        match self {
            CollectiveKind::AllReduce => 2 * bytes,
            CollectiveKind::AllGather { .. } => bytes,
            CollectiveKind::ReduceScatter { .. } => 3 * bytes,
            CollectiveKind::ShardSlice { .. } => 0,
        }
    }

    /// Bytes one rank sends for an input of `bytes` over `n` ranks, with ring algorithms:
    /// all-reduce 2(n-1)/n of the buffer, all-gather (n-1) shards, reduce-scatter (n-1)/n.
    pub fn bytes_sent(self, bytes: usize, n: usize) -> usize {
        let n1 = n.saturating_sub(1);
        match self {
            CollectiveKind::AllReduce => 2 * n1 * bytes / n.max(1),
            CollectiveKind::AllGather { .. } => n1 * bytes,
            CollectiveKind::ReduceScatter { .. } => n1 * bytes / n.max(1),
            CollectiveKind::ShardSlice { .. } => 0,
        }
    }
}

/// One collective as a program states it: what, along which mesh axis, over a local input of
/// `shape`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveOp {
    pub kind: CollectiveKind,
    pub axis: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// Bytes sent by one rank, by collective, since the last reset.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommBytes {
    pub all_reduce: usize,
    pub all_gather: usize,
    pub reduce_scatter: usize,
    /// Sent to other pipeline stages (activations, their gradients, shared weights' gradients).
    #[serde(default)]
    pub send: usize,
}

/// Where ranks sit: `stages` pipeline stages, each a mesh of these axis sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// The mesh of each pipeline stage.
    pub sizes: Vec<usize>,
    pub stages: usize,
}

impl Topology {
    pub fn new(stages: usize, sizes: &[usize]) -> Topology {
        Topology { sizes: sizes.to_vec(), stages }
    }

    pub fn world_size(&self) -> usize {
        self.stages * self.stage_size()
    }

    /// Ranks per pipeline stage (the mesh's).
    pub fn stage_size(&self) -> usize {
        self.sizes.iter().product()
    }

    /// The pipeline stage of a rank.
    pub fn stage(&self, rank: usize) -> usize {
        rank / self.stage_size()
    }

    /// A rank's coordinate on every mesh axis (within its stage).
    pub fn coordinates(&self, mut rank: usize) -> Vec<usize> {
        let mut coords = vec![0; self.sizes.len()];
        for (a, &size) in self.sizes.iter().enumerate().rev() {
            coords[a] = rank % size;
            rank /= size;
        }
        coords
    }

    /// Ranks between neighbours of a group along `axis`.
    pub fn stride(&self, axis: usize) -> usize {
        self.sizes[axis + 1..].iter().product()
    }

    /// The first rank of `rank`'s group along `axis` (the one with coordinate 0 on it).
    pub fn group_leader(&self, rank: usize, axis: usize) -> usize {
        rank - self.coordinates(rank)[axis] * self.stride(axis)
    }

    /// The rank at `rank`'s mesh position on pipeline stage `stage`.
    pub fn on_stage(&self, rank: usize, stage: usize) -> Result<usize, RuntimeError> {
        if stage >= self.stages {
            return Err(RuntimeError::Comm(format!("pipeline stage {stage} does not exist ({} stages)", self.stages)));
        }
        Ok(stage * self.stage_size() + rank % self.stage_size())
    }
}

/// What the executor needs of a communication backend. `rank` is always a rank the backend
/// serves from this process (every rank for [`LocalComm`], its own for [`MpiComm`]).
pub trait Communicator: Send + Sync {
    fn topology(&self) -> &Topology;

    /// Runs `op` for `rank`: `input` is the rank's local input, `output` receives its result.
    /// `seq` numbers the collectives a rank issues on `op.axis` (from 0, in program order,
    /// without `shard_slice`, which meets no one): a backend runs them in that order, so a
    /// collective a rank's communication thread runs and one its compute thread runs never mix.
    fn collective(
        &self,
        rank: usize,
        op: &CollectiveOp,
        seq: u64,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), RuntimeError>;

    /// Hands a copy of `bytes` from `rank` to its mesh position on stage `to` without waiting
    /// for the receiver, stamped with the sender's clock reading `sent_at`.
    fn send(&self, rank: usize, to: usize, tag: u64, bytes: &[u8], sent_at: Duration) -> Result<(), RuntimeError>;

    /// Waits for the next message to `rank` from its mesh position on stage `from`, which must
    /// carry `tag` and fill `output`; returns the sender's clock reading when it sent it.
    fn recv(&self, rank: usize, from: usize, tag: u64, output: &mut [u8]) -> Result<Duration, RuntimeError>;

    /// `rank` failed with `why`: every waiting and future operation of the other ranks fails
    /// (threads), or the job ends (processes: the failing one prints `why` and ends them all).
    fn abort(&self, rank: usize, why: &RuntimeError);

    /// The bytes `rank` sent since the last [`Communicator::reset_counts`].
    fn bytes_sent(&self, rank: usize) -> CommBytes;

    /// The most host staging memory `rank`'s collectives held at once.
    fn staging_peak(&self, rank: usize) -> usize;

    fn reset_counts(&self);
}

impl CommBytes {
    /// Counts `op` over a group of `n` ranks for an input of `bytes`.
    pub fn count(&mut self, kind: CollectiveKind, bytes: usize, n: usize) {
        let sent = kind.bytes_sent(bytes, n);
        match kind {
            CollectiveKind::AllReduce => self.all_reduce += sent,
            CollectiveKind::AllGather { .. } => self.all_gather += sent,
            CollectiveKind::ReduceScatter { .. } => self.reduce_scatter += sent,
            CollectiveKind::ShardSlice { .. } => {}
        }
    }
}

/// The slice `kind` leaves to the rank at `coord` for a `shard_slice`, or a reduce-scatter's
/// slice of the sum: `input` of `shape` cut along `dim` into `n` equal parts.
pub(crate) fn slice_for(
    dtype: DType,
    shape: &[usize],
    dim: usize,
    coord: usize,
    n: usize,
    input: &[u8],
    output: &mut [u8],
) -> Result<(), autotp_kernels::KernelError> {
    let mut out = shape.to_vec();
    out[dim] /= n;
    let mut starts = vec![0; shape.len()];
    starts[dim] = coord * out[dim];
    let slice =
        autotp_kernels::Kernel::Slice { dtype, shape: shape.to_vec(), starts, steps: vec![1; shape.len()], out };
    slice.run(&[input], &mut [output])
}

/// The error of a pipeline message that is not the one the receiver's program expects.
pub(crate) fn unexpected_message(
    rank: usize,
    from: usize,
    (tag, len): (u64, usize),
    (sent, sent_len): (u64, usize),
) -> RuntimeError {
    RuntimeError::Comm(format!(
        "rank {rank} expected message {tag} of {len} bytes from stage {from}, got message {sent} of {sent_len} bytes"
    ))
}

/// `output = inputs[0] + inputs[1] + ...`, in that order for every element (so every rank that
/// sums the same inputs gets the same bits). f32 and f64 are added in place, in chunks on the
/// current rayon pool; other dtypes (and unaligned buffers) through the builtin add kernel.
pub(crate) fn sum(
    dtype: DType,
    shape: &[usize],
    inputs: &[&[u8]],
    output: &mut [u8],
) -> Result<(), autotp_kernels::KernelError> {
    fn add_in_order<T: bytemuck::Pod + std::ops::AddAssign + Send + Sync>(inputs: &[&[u8]], output: &mut [u8]) -> bool {
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 14;
        let Ok(inputs) = inputs.iter().map(|i| bytemuck::try_cast_slice::<u8, T>(i)).collect::<Result<Vec<_>, _>>()
        else {
            return false;
        };
        let Ok(output) = bytemuck::try_cast_slice_mut::<u8, T>(output) else { return false };
        output.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
            let span = c * CHUNK..c * CHUNK + out.len();
            out.copy_from_slice(&inputs[0][span.clone()]);
            for input in &inputs[1..] {
                for (o, &x) in out.iter_mut().zip(&input[span.clone()]) {
                    *o += x;
                }
            }
        });
        true
    }
    let added = match dtype {
        DType::F32 => add_in_order::<f32>(inputs, output),
        DType::F64 => add_in_order::<f64>(inputs, output),
        _ => false,
    };
    if added {
        return Ok(());
    }
    output.copy_from_slice(inputs[0]);
    let add = autotp_kernels::Kernel::Binary {
        op: autotp_kernels::BinaryOp::Add,
        dtype,
        lhs: shape.to_vec(),
        rhs: shape.to_vec(),
        out: shape.to_vec(),
    };
    let mut scratch = vec![0u8; output.len()];
    for input in &inputs[1..] {
        add.run(&[output, input], &mut [&mut scratch])?;
        output.copy_from_slice(&scratch);
    }
    Ok(())
}
