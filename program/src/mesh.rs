//! The device mesh and what moves along it, defined once for the IR (which places values and
//! inserts collectives) and for programs (whose slots carry placements and whose instructions
//! run collectives): [`MeshAxis`], [`Placement`], [`Collective`] and the [`CollectiveOp`] a
//! program states, with the bytes each moves ([`CommBytes`]).

use autotp_kernels::DType;
use serde::{Deserialize, Serialize};

/// The name of the data-parallel mesh axis: batch inputs (and pipeline messages laid out like
/// them) are split along their dim 0 over it.
pub const DATA_AXIS: &str = "dp";

/// The name of the expert-parallel mesh axis, where there are fewer expert-parallel ranks than
/// data-parallel ones (`--ep` below `--dp`): the data-parallel ranks are then `dp / ep` groups
/// (the `dp` axis: Megatron's expert-data-parallel size) of `ep` ranks (this axis), batch inputs
/// split along their dim 0 over both, and the experts split over this one.
pub const EXPERT_AXIS: &str = "ep";

/// The axis of `mesh` the experts are split over (`--ep`): `ep` where it is an axis, else `dp`
/// (`--ep` = `--dp`).
pub fn expert_axis(mesh: &[MeshAxis]) -> Option<usize> {
    let axis_of = |name: &str| mesh.iter().position(|a| a.name == name);
    axis_of(EXPERT_AXIS).or_else(|| axis_of(DATA_AXIS))
}

/// The name of the context-parallel mesh axis: batch inputs are split along their dim 1 (the
/// sequence) over it.
pub const CONTEXT_AXIS: &str = "cp";

/// A named mesh axis and its number of ranks.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshAxis {
    pub name: String,
    pub size: usize,
}

/// How a value is laid out along one mesh axis (the DTensor / GSPMD model).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Placement {
    /// Every rank of the axis holds the whole value.
    Replicate,
    /// Each rank holds one contiguous slice along this tensor dimension.
    Shard(usize),
    /// Each rank holds a partial sum; the value is the sum over the axis.
    PartialSum,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Replicate => f.write_str("replicate"),
            Placement::Shard(d) => write!(f, "shard({d})"),
            Placement::PartialSum => f.write_str("partial(sum)"),
        }
    }
}

/// The collectives, as resharding steps along one mesh axis.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Collective {
    /// partial(sum) -> replicate: every rank gets the sum.
    AllReduce,
    /// shard(dim) -> replicate: every rank gets the concatenation.
    AllGather { dim: usize },
    /// partial(sum) -> shard(dim): each rank gets its slice of the sum.
    ReduceScatter { dim: usize },
    /// replicate -> shard(dim): each rank keeps its own slice; no communication.
    ShardSlice { dim: usize },
    /// shard(concat) -> shard(split): each rank cuts its block along `split` into one piece per
    /// rank, sends piece j to rank j, and concatenates the pieces it gets along `concat`, in
    /// rank order (MPI's and torch's all-to-all with equal pieces; `split != concat`).
    AllToAll { split: usize, concat: usize },
    /// shard(dim) -> shard(dim): each rank sends its block to the next rank along the axis and
    /// takes the previous one's (the last sends to the first): one step of a ring. Unlike the
    /// others it changes the global value, which rolls by one block along `dim`; a
    /// context-parallel ring's rounds pass keys and values on with it (`passes::cp_ring`).
    RingShift { dim: usize },
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather { .. } => "all_gather",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::ShardSlice { .. } => "shard_slice",
            Collective::AllToAll { .. } => "all_to_all",
            Collective::RingShift { .. } => "ring_shift",
        }
    }

    /// The tensor dims it shards or gathers, by attribute name (`dim`; `split` and `concat`).
    pub fn dims(self) -> Vec<(&'static str, usize)> {
        match self {
            Collective::AllReduce => vec![],
            Collective::AllGather { dim }
            | Collective::ReduceScatter { dim }
            | Collective::ShardSlice { dim }
            | Collective::RingShift { dim } => vec![("dim", dim)],
            Collective::AllToAll { split, concat } => vec![("split", split), ("concat", concat)],
        }
    }

    /// The placement on the axis it takes, and the one it gives.
    pub fn transition(self) -> (Placement, Placement) {
        use Placement::{PartialSum, Replicate, Shard};
        match self {
            Collective::AllReduce => (PartialSum, Replicate),
            Collective::AllGather { dim } => (Shard(dim), Replicate),
            Collective::ReduceScatter { dim } => (PartialSum, Shard(dim)),
            Collective::ShardSlice { dim } => (Replicate, Shard(dim)),
            Collective::AllToAll { split, concat } => (Shard(concat), Shard(split)),
            Collective::RingShift { dim } => (Shard(dim), Shard(dim)),
        }
    }

    /// The local output shape for a local input `shape` over `n` ranks, if it is valid.
    pub fn output_shape(self, shape: &[usize], n: usize) -> Option<Vec<usize>> {
        let mut out = shape.to_vec();
        match self {
            Collective::AllReduce => {}
            Collective::RingShift { dim } => {
                out.get(dim)?;
            }
            Collective::AllGather { dim } => *out.get_mut(dim)? *= n,
            Collective::ReduceScatter { dim } | Collective::ShardSlice { dim } => {
                let d = out.get_mut(dim)?;
                if n == 0 || *d % n != 0 {
                    return None;
                }
                *d /= n;
            }
            Collective::AllToAll { split, concat } => {
                if split == concat || concat >= out.len() || n == 0 || *out.get(split)? % n != 0 {
                    return None;
                }
                out[split] /= n;
                out[concat] *= n;
            }
        }
        Some(out)
    }

    /// Bytes of host buffers one rank stages for an input of `bytes` when ranks are threads of
    /// one process: its deposited copy, plus the sum for reductions (and the full sum a
    /// reduce-scatter slices).
    pub fn staging_bytes(self, bytes: usize) -> usize {
        match self {
            Collective::AllReduce => 2 * bytes,
            Collective::AllGather { .. } => bytes,
            Collective::ReduceScatter { .. } => 3 * bytes,
            Collective::ShardSlice { .. } => 0,
            // The deposited copy, and the pieces this rank takes from every one.
            Collective::AllToAll { .. } => 2 * bytes,
            Collective::RingShift { .. } => bytes,
        }
    }

    /// Bytes one rank sends for an input of `bytes` over `n` ranks, with ring algorithms:
    /// all-reduce 2(n-1)/n of the buffer, all-gather (n-1) shards, reduce-scatter (n-1)/n;
    /// all-to-all (n-1)/n (every piece but its own, each sent once); a ring shift its block
    /// (none on one rank).
    pub fn bytes_sent(self, bytes: usize, n: usize) -> usize {
        let n1 = n.saturating_sub(1);
        match self {
            Collective::RingShift { .. } => bytes.min(n1 * bytes),
            Collective::AllReduce => 2 * n1 * bytes / n.max(1),
            Collective::AllGather { .. } => n1 * bytes,
            Collective::ReduceScatter { .. } | Collective::AllToAll { .. } => n1 * bytes / n.max(1),
            Collective::ShardSlice { .. } => 0,
        }
    }
}

/// One collective as a program states it: what, along which mesh axis (its index), over a
/// local input of `shape`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveOp {
    pub kind: Collective,
    pub axis: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl CollectiveOp {
    /// The dims before `dim` (the rows of one rank's block, strided when more than one) and the
    /// bytes of one row from `dim` on.
    pub fn rows_along(&self, dim: usize) -> (usize, usize) {
        let outer = self.shape[..dim.min(self.shape.len())].iter().product();
        let row = self.shape[dim.min(self.shape.len())..].iter().product::<usize>() * self.dtype.size();
        (outer, row)
    }

    /// Bytes of device scratch it needs over `n` ranks on NCCL, which gathers and scatters
    /// contiguous blocks: a gather's or reduce-scatter's whole buffer where its blocks are
    /// strided (the runtime's `gpu::collectives`), else none.
    pub fn device_scratch_bytes(&self, n: usize) -> usize {
        let numel: usize = self.shape.iter().product();
        match self.kind {
            Collective::AllGather { dim } if self.rows_along(dim).0 > 1 => numel * n * self.dtype.size(),
            Collective::ReduceScatter { dim } if self.rows_along(dim).0 > 1 => numel * self.dtype.size(),
            // The pieces packed to send, and those received before they are placed.
            Collective::AllToAll { .. } => 2 * numel * self.dtype.size(),
            _ => 0,
        }
    }
}

/// Bytes sent by one rank, by collective (per step in a report, since the last reset in a
/// communicator).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommBytes {
    pub all_reduce: usize,
    pub all_gather: usize,
    pub reduce_scatter: usize,
    #[serde(default)]
    pub all_to_all: usize,
    /// Passed on around a ring (context parallelism's keys and values).
    #[serde(default)]
    pub ring_shift: usize,
    /// Sent to other pipeline stages (activations, their gradients, shared weights' gradients).
    #[serde(default)]
    pub send: usize,
}

impl CommBytes {
    /// These counts less `earlier`'s (each at least 0): what was sent since.
    pub fn minus(&self, earlier: &CommBytes) -> CommBytes {
        CommBytes {
            all_reduce: self.all_reduce.saturating_sub(earlier.all_reduce),
            all_gather: self.all_gather.saturating_sub(earlier.all_gather),
            reduce_scatter: self.reduce_scatter.saturating_sub(earlier.reduce_scatter),
            all_to_all: self.all_to_all.saturating_sub(earlier.all_to_all),
            ring_shift: self.ring_shift.saturating_sub(earlier.ring_shift),
            send: self.send.saturating_sub(earlier.send),
        }
    }

    /// These counts and `other`'s together.
    pub fn plus(&self, other: &CommBytes) -> CommBytes {
        CommBytes {
            all_reduce: self.all_reduce + other.all_reduce,
            all_gather: self.all_gather + other.all_gather,
            reduce_scatter: self.reduce_scatter + other.reduce_scatter,
            all_to_all: self.all_to_all + other.all_to_all,
            ring_shift: self.ring_shift + other.ring_shift,
            send: self.send + other.send,
        }
    }

    /// Every byte sent, collectives and pipeline messages.
    pub fn total(&self) -> usize {
        self.all_reduce + self.all_gather + self.reduce_scatter + self.all_to_all + self.ring_shift + self.send
    }

    /// Counts `kind` over a group of `n` ranks for an input of `bytes`.
    pub fn count(&mut self, kind: Collective, bytes: usize, n: usize) {
        self.count_sent(kind, kind.bytes_sent(bytes, n));
    }

    /// Counts `sent` bytes of `kind` (an all-to-all's that sends only its pieces' filled bytes).
    pub fn count_sent(&mut self, kind: Collective, sent: usize) {
        match kind {
            Collective::AllReduce => self.all_reduce += sent,
            Collective::AllGather { .. } => self.all_gather += sent,
            Collective::ReduceScatter { .. } => self.reduce_scatter += sent,
            Collective::AllToAll { .. } => self.all_to_all += sent,
            Collective::RingShift { .. } => self.ring_shift += sent,
            Collective::ShardSlice { .. } => {}
        }
    }
}
