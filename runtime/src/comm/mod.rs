//! Communication between ranks, behind one interface, [`Communicator`], that the executor
//! runs its collectives and pipeline messages through:
//!
//! - [`LocalComm`] (`local.rs`): ranks as threads of one process, the default;
//! - [`MpiComm`] (`mpi.rs`): one rank per process, over MPI (Open MPI's library, loaded when a
//!   run is started by an MPI launcher; `mpi_library.rs`; which rank stopped a job: `peers.rs`).
//!
//! Both place ranks the same way ([`Topology`]): with pipeline stages, the world is `stages`
//! copies of the mesh (rank = stage x mesh size + mesh rank, the mesh row-major, its last axis
//! fastest); a collective groups the ranks of a stage that differ only in their coordinate on
//! its mesh axis, and a pipeline message goes between the same mesh position of two stages.
//! Both count the bytes each rank would send with ring algorithms ([`CommBytes`]), whatever
//! algorithm actually runs, so measured and planned communication compare; but an all-to-all
//! sends only its pieces' filled bytes ([`filled_lengths`]), and counts those: the plan's
//! figure is its room.

use std::time::Duration;

use autotp_kernels::DType;
use autotp_program::mesh::{Collective, CollectiveOp, CommBytes};

use crate::RuntimeError;

mod local;
mod mpi;
mod mpi_library;
mod peers;

pub use local::LocalComm;
pub use mpi::{MpiComm, MpiError};

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

/// An all-to-all's pieces of a block of `shape` (cut along `split` into `n`), one after the
/// other in `packed`: piece j is what goes to rank j.
pub(crate) fn pack_pieces(
    dtype: DType,
    shape: &[usize],
    split: usize,
    n: usize,
    input: &[u8],
    packed: &mut [u8],
) -> Result<(), autotp_kernels::KernelError> {
    let piece = input.len() / n;
    for (j, out) in packed.chunks_mut(piece).enumerate() {
        slice_for(dtype, shape, split, j, n, input, out)?;
    }
    Ok(())
}

/// How many bytes of each packed all-to-all piece (`packed`: `n` pieces one after the other)
/// hold data: up to its last element with a byte that is not zero. An all-to-all sends each
/// piece's filled bytes (after its length) and the receiver zeroes the rest, which gives
/// every rank the bytes the whole pieces would, bit for bit, while the bytes on the wire follow
/// what the pieces hold. Expert parallelism's send buffers have room for every pair of a rank
/// with each destination, filled from the front with the pairs the routing sends there and
/// zeros after (`passes/src/expert_dispatch.rs`), so their filled bytes are the routing's.
pub(crate) fn filled_lengths(dtype: DType, n: usize, packed: &[u8]) -> Vec<usize> {
    let element = dtype.size().max(1);
    packed
        .chunks(packed.len() / n.max(1))
        .map(|piece| piece.iter().rposition(|&b| b != 0).map_or(0, |last| (last / element + 1) * element))
        .collect()
}

/// The bytes a rank sends in an all-to-all whose pieces hold `filled` bytes
/// ([`filled_lengths`]): every piece's but its own (the 8-byte lengths sent ahead of them are
/// not counted, as no collective's headers are).
pub(crate) fn all_to_all_sent(filled: &[usize], coord: usize) -> usize {
    filled.iter().enumerate().filter(|&(j, _)| j != coord).map(|(_, &len)| len).sum()
}

/// An all-to-all's output: the `pieces` received (each a block of `shape` cut along `split`,
/// in rank order) concatenated along `concat`.
pub(crate) fn place_pieces(
    dtype: DType,
    shape: &[usize],
    (split, concat): (usize, usize),
    pieces: &[&[u8]],
    output: &mut [u8],
) -> Result<(), autotp_kernels::KernelError> {
    let mut piece = shape.to_vec();
    piece[split] /= pieces.len();
    autotp_kernels::Kernel::Concat { dtype, shapes: vec![piece; pieces.len()], axis: concat }.run(pieces, &mut [output])
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
