//! Communication between ranks. [`LocalComm`] connects ranks that are threads of one process
//! (the CPU device): for each collective, the ranks of a group (those that differ only in their
//! coordinate on the collective's mesh axis) meet at a rendezvous, each deposits its input, and
//! each computes its own output from all inputs in coordinate order, so every rank reduces in
//! the same order and gets bit-identical results (the same order as the SPMD reference
//! evaluator). It counts the bytes each rank would move with ring algorithms. A rank that fails
//! calls [`LocalComm::abort`], and ranks waiting in a collective return an error instead of
//! hanging.
//!
//! With pipeline stages, the world is `stages` copies of the mesh (rank = stage x mesh size +
//! mesh rank): collectives group ranks within a stage, and [`LocalComm::send`] /
//! [`LocalComm::recv`] pass values between the same mesh position of two stages, through one
//! first-in first-out mailbox per ordered pair of ranks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use autotp_kernels::{BinaryOp, DType, Kernel};
use serde::{Deserialize, Serialize};

use crate::RuntimeError;

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

/// One rendezvous round of a group.
#[derive(Default)]
struct Round {
    /// The sequence number of the round in progress, bumped when it completes: a rank joins only
    /// the round of its collective's number.
    generation: u64,
    deposited: Vec<Option<Vec<u8>>>,
    /// All inputs of the round once every member deposited.
    inputs: Option<Arc<Vec<Vec<u8>>>>,
    departed: usize,
}

struct Group {
    round: Mutex<Round>,
    wake: Condvar,
}

/// A value one rank sent another.
struct Message {
    tag: u64,
    bytes: Vec<u8>,
    /// The sender's clock when it sent it (see `crate::clock`).
    sent_at: Duration,
}

/// Messages from one rank to another, in send order, and the buffers of messages already
/// received, which later sends reuse (a step sends the same sizes every time, so after the
/// first step no message allocates).
#[derive(Default)]
struct Mailbox {
    queue: std::collections::VecDeque<Message>,
    spare: Vec<Vec<u8>>,
}

/// (from rank, to rank) -> their mailbox.
type Mailboxes = BTreeMap<(usize, usize), Mailbox>;

/// Ranks as threads of one process.
pub struct LocalComm {
    /// The mesh of each pipeline stage.
    sizes: Vec<usize>,
    stages: usize,
    mail: Mutex<Mailboxes>,
    mail_wake: Condvar,
    /// (axis, first rank of the group) -> the group.
    groups: BTreeMap<(usize, usize), Group>,
    sent: Vec<Mutex<CommBytes>>,
    /// The most staging memory each rank held at once.
    staging_peak: Vec<AtomicUsize>,
    aborted: AtomicBool,
}

const POLL: Duration = Duration::from_millis(50);

impl LocalComm {
    /// A communicator for a mesh with these axis sizes (ranks row-major, last axis fastest).
    pub fn new(sizes: &[usize]) -> Arc<LocalComm> {
        LocalComm::pipeline(1, sizes)
    }

    /// A communicator for `stages` pipeline stages, each a mesh with these axis sizes.
    pub fn pipeline(stages: usize, sizes: &[usize]) -> Arc<LocalComm> {
        let world: usize = stages * sizes.iter().product::<usize>();
        let mut groups = BTreeMap::new();
        for (axis, &size) in sizes.iter().enumerate() {
            let stride: usize = sizes[axis + 1..].iter().product();
            for rank in 0..world {
                if (rank / stride).is_multiple_of(size) {
                    let round = Round { deposited: vec![None; size], ..Round::default() };
                    groups.insert((axis, rank), Group { round: Mutex::new(round), wake: Condvar::new() });
                }
            }
        }
        let sent = (0..world).map(|_| Mutex::new(CommBytes::default())).collect();
        let staging_peak = (0..world).map(|_| AtomicUsize::new(0)).collect();
        Arc::new(LocalComm {
            sizes: sizes.to_vec(),
            stages,
            mail: Mutex::new(Mailboxes::new()),
            mail_wake: Condvar::new(),
            groups,
            sent,
            staging_peak,
            aborted: AtomicBool::new(false),
        })
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

    /// Makes every waiting and future collective fail: a rank failed.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for g in self.groups.values() {
            g.wake.notify_all();
        }
        self.mail_wake.notify_all();
    }

    /// The rank at `rank`'s mesh position on pipeline stage `stage`.
    fn on_stage(&self, rank: usize, stage: usize) -> Result<usize, RuntimeError> {
        if stage >= self.stages {
            return Err(RuntimeError::Comm(format!("pipeline stage {stage} does not exist ({} stages)", self.stages)));
        }
        Ok(stage * self.stage_size() + rank % self.stage_size())
    }

    /// Hands a copy of `bytes` from `rank` to its mesh position on stage `to` (does not wait),
    /// stamped with the sender's clock reading `sent_at`.
    pub fn send(&self, rank: usize, to: usize, tag: u64, bytes: &[u8], sent_at: Duration) -> Result<(), RuntimeError> {
        let peer = self.on_stage(rank, to)?;
        self.sent[rank].lock().expect("counters").send += bytes.len();
        let spare = self.mail.lock().expect("mailboxes").entry((rank, peer)).or_default().spare.pop();
        // The copy happens outside the lock, which the other ranks' sends and recvs need.
        let mut message = spare.unwrap_or_default();
        message.clear();
        message.extend_from_slice(bytes);
        let message = Message { tag, bytes: message, sent_at };
        self.mail.lock().expect("mailboxes").entry((rank, peer)).or_default().queue.push_back(message);
        self.mail_wake.notify_all();
        Ok(())
    }

    /// Waits for the next message to `rank` from its mesh position on stage `from`, which must
    /// carry `tag` and fill `output`; returns the sender's clock reading when it sent it.
    pub fn recv(&self, rank: usize, from: usize, tag: u64, output: &mut [u8]) -> Result<Duration, RuntimeError> {
        let peer = self.on_stage(rank, from)?;
        let mut mail = self.mail.lock().expect("mailboxes");
        loop {
            if let Some(message) = mail.get_mut(&(peer, rank)).and_then(|mailbox| mailbox.queue.pop_front()) {
                drop(mail);
                let Message { tag: sent, bytes, sent_at } = message;
                if sent != tag || bytes.len() != output.len() {
                    return Err(RuntimeError::Comm(format!(
                        "rank {rank} expected message {tag} of {} bytes from stage {from}, got message {sent} of {} bytes",
                        output.len(),
                        bytes.len()
                    )));
                }
                output.copy_from_slice(&bytes);
                self.mail.lock().expect("mailboxes").entry((peer, rank)).or_default().spare.push(bytes);
                return Ok(sent_at);
            }
            if self.aborted.load(Ordering::SeqCst) {
                return Err(self.aborted());
            }
            mail = self.mail_wake.wait_timeout(mail, POLL).expect("mailboxes").0;
        }
    }

    /// The bytes `rank` sent since the last [`LocalComm::reset_counts`].
    pub fn bytes_sent(&self, rank: usize) -> CommBytes {
        self.sent[rank].lock().expect("counters").clone()
    }

    /// The most host staging memory `rank`'s collectives held at once.
    pub fn staging_peak(&self, rank: usize) -> usize {
        self.staging_peak[rank].load(Ordering::SeqCst)
    }

    pub fn reset_counts(&self) {
        for s in &self.sent {
            *s.lock().expect("counters") = CommBytes::default();
        }
    }

    fn aborted(&self) -> RuntimeError {
        RuntimeError::Comm("another rank failed; this one stops".into())
    }

    /// Runs `op` for `rank`: `input` is the rank's local input, `output` receives its result.
    /// `seq` numbers the collectives a rank issues on `op.axis` (from 0, in program order,
    /// without `shard_slice`, which meets no one): the group runs them in that order, so a
    /// collective a rank's communication thread runs and one its compute thread runs never mix.
    pub fn collective(
        &self,
        rank: usize,
        op: &CollectiveOp,
        seq: u64,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), RuntimeError> {
        let CollectiveOp { kind, axis, dtype, ref shape } = *op;
        let n = self.sizes[axis];
        let coord = self.coordinates(rank)[axis];
        let stride: usize = self.sizes[axis + 1..].iter().product();
        let kernel_error = |source| RuntimeError::Kernel { label: kind.name().into(), source };
        let out_shape = kind
            .output_shape(shape, n)
            .ok_or_else(|| RuntimeError::Comm(format!("{} of {shape:?} over {n} ranks", kind.name())))?;
        if let CollectiveKind::ShardSlice { dim } = kind {
            let mut starts = vec![0; shape.len()];
            starts[dim] = coord * out_shape[dim];
            let slice =
                Kernel::Slice { dtype, shape: shape.to_vec(), starts, steps: vec![1; shape.len()], out: out_shape };
            return slice.run(&[input], &mut [output]).map_err(kernel_error);
        }
        self.staging_peak[rank].fetch_max(kind.staging_bytes(input.len()), Ordering::SeqCst);
        let group = &self.groups[&(axis, rank - coord * stride)];
        let inputs = self.rendezvous(group, coord, seq, input)?;
        {
            let mut sent = self.sent[rank].lock().expect("counters");
            let bytes = kind.bytes_sent(input.len(), n);
            match kind {
                CollectiveKind::AllReduce => sent.all_reduce += bytes,
                CollectiveKind::AllGather { .. } => sent.all_gather += bytes,
                CollectiveKind::ReduceScatter { .. } => sent.reduce_scatter += bytes,
                CollectiveKind::ShardSlice { .. } => {}
            }
        }
        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        let result = match kind {
            CollectiveKind::AllGather { dim } => {
                let concat = Kernel::Concat { dtype, shapes: vec![shape.to_vec(); n], axis: dim };
                concat.run(&refs, &mut [output]).map_err(kernel_error)
            }
            CollectiveKind::AllReduce => sum(dtype, shape, &refs, output).map_err(kernel_error),
            CollectiveKind::ReduceScatter { dim } => {
                let mut total = vec![0u8; input.len()];
                sum(dtype, shape, &refs, &mut total).map_err(kernel_error)?;
                let mut starts = vec![0; shape.len()];
                starts[dim] = coord * out_shape[dim];
                let slice =
                    Kernel::Slice { dtype, shape: shape.to_vec(), starts, steps: vec![1; shape.len()], out: out_shape };
                slice.run(&[&total], &mut [output]).map_err(kernel_error)
            }
            CollectiveKind::ShardSlice { .. } => unreachable!("handled above"),
        };
        self.depart(group);
        result
    }

    /// Deposits `input` as member `coord` and waits for the whole group; returns every input.
    fn rendezvous(
        &self,
        group: &Group,
        coord: usize,
        seq: u64,
        input: &[u8],
    ) -> Result<Arc<Vec<Vec<u8>>>, RuntimeError> {
        let mut round = group.round.lock().expect("group lock");
        // Wait for the rounds before this one to complete.
        while round.generation != seq || round.inputs.is_some() || round.deposited[coord].is_some() {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(self.aborted());
            }
            round = group.wake.wait_timeout(round, POLL).expect("group lock").0;
        }
        round.deposited[coord] = Some(input.to_vec());
        if round.deposited.iter().all(Option::is_some) {
            let all = round.deposited.iter_mut().map(|d| d.take().expect("all deposited")).collect();
            round.inputs = Some(Arc::new(all));
            group.wake.notify_all();
        }
        let generation = round.generation;
        loop {
            if let Some(inputs) = &round.inputs {
                if round.generation == generation {
                    return Ok(inputs.clone());
                }
            }
            if self.aborted.load(Ordering::SeqCst) {
                return Err(self.aborted());
            }
            round = group.wake.wait_timeout(round, POLL).expect("group lock").0;
        }
    }

    /// Leaves the round; the last member to leave opens the next one.
    fn depart(&self, group: &Group) {
        let mut round = group.round.lock().expect("group lock");
        round.departed += 1;
        if round.departed == round.deposited.len() {
            round.departed = 0;
            round.inputs = None;
            round.generation += 1;
            group.wake.notify_all();
        }
    }
}

/// `output = inputs[0] + inputs[1] + ...`, in that order.
fn sum(dtype: DType, shape: &[usize], inputs: &[&[u8]], output: &mut [u8]) -> Result<(), autotp_kernels::KernelError> {
    output.copy_from_slice(inputs[0]);
    let add =
        Kernel::Binary { op: BinaryOp::Add, dtype, lhs: shape.to_vec(), rhs: shape.to_vec(), out: shape.to_vec() };
    let mut scratch = vec![0u8; output.len()];
    for input in &inputs[1..] {
        add.run(&[output, input], &mut [&mut scratch])?;
        output.copy_from_slice(&scratch);
    }
    Ok(())
}
