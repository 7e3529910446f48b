//! [`LocalComm`] connects ranks that are threads of one process (the default on one machine):
//! for each collective, the ranks of a group (those that differ only in their
//! coordinate on the collective's mesh axis) meet at a rendezvous, each deposits its input, and
//! each computes its own output from all inputs in coordinate order, so every rank reduces in
//! the same order and gets bit-identical results (the same order as the SPMD reference
//! evaluator). A rank that fails calls [`Communicator::abort`], and ranks waiting in a
//! collective return an error instead of hanging. Pipeline messages go through one first-in
//! first-out mailbox per ordered pair of ranks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use autotp_kernels::Kernel;

use super::{
    all_to_all_sent, filled_lengths, pack_pieces, place_pieces, slice_for, sum, unexpected_message, Collective,
    CollectiveOp, CommBytes, Communicator, Topology,
};
use crate::RuntimeError;

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
    /// The buffers of rounds done, for the next deposits (a step runs the same sizes every
    /// time, so after the first no deposit allocates).
    spare: Vec<Vec<u8>>,
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
    topology: Topology,
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
            topology: Topology::new(stages, sizes),
            mail: Mutex::new(Mailboxes::new()),
            mail_wake: Condvar::new(),
            groups,
            sent,
            staging_peak,
            aborted: AtomicBool::new(false),
        })
    }

    fn aborted(&self) -> RuntimeError {
        RuntimeError::PeerFailed
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
        let mut buffer = round.spare.pop().unwrap_or_default();
        buffer.clear();
        buffer.extend_from_slice(input);
        round.deposited[coord] = Some(buffer);
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
            // Every member dropped its handle on the inputs before leaving.
            if let Some(Ok(buffers)) = round.inputs.take().map(Arc::try_unwrap) {
                round.spare.extend(buffers);
            }
            round.generation += 1;
            group.wake.notify_all();
        }
    }
}

impl Communicator for LocalComm {
    fn topology(&self) -> &Topology {
        &self.topology
    }

    fn collective(
        &self,
        rank: usize,
        op: &CollectiveOp,
        seq: u64,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), RuntimeError> {
        let CollectiveOp { kind, axis, dtype, ref shape } = *op;
        let n = self.topology.sizes[axis];
        let coord = self.topology.coordinates(rank)[axis];
        let kernel_error = |source| RuntimeError::Kernel { label: kind.name().into(), source };
        if kind.output_shape(shape, n).is_none() {
            return Err(RuntimeError::Comm(format!("{} of {shape:?} over {n} ranks", kind.name())));
        }
        if let Collective::ShardSlice { dim } = kind {
            return slice_for(dtype, shape, dim, coord, n, input, output).map_err(kernel_error);
        }
        // An all-to-all sends what its pieces hold ([`filled_lengths`]); the others read it here.
        let filled = match kind {
            Collective::AllToAll { split, .. } if shape[..split].iter().product::<usize>() == 1 => {
                Some(filled_lengths(dtype, n, input))
            }
            Collective::AllToAll { split, .. } => {
                let mut packed = vec![0u8; input.len()];
                pack_pieces(dtype, shape, split, n, input, &mut packed).map_err(kernel_error)?;
                Some(filled_lengths(dtype, n, &packed))
            }
            _ => None,
        };
        self.staging_peak[rank].fetch_max(kind.staging_bytes(input.len()), Ordering::SeqCst);
        let group = &self.groups[&(axis, self.topology.group_leader(rank, axis))];
        let inputs = self.rendezvous(group, coord, seq, input)?;
        match &filled {
            Some(filled) => self.sent[rank].lock().expect("counters").count_sent(kind, all_to_all_sent(filled, coord)),
            None => self.sent[rank].lock().expect("counters").count(kind, input.len(), n),
        }
        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        let result = match kind {
            Collective::AllGather { dim } => {
                let concat = Kernel::Concat { dtype, shapes: vec![shape.to_vec(); n], axis: dim };
                concat.run(&refs, &mut [output]).map_err(kernel_error)
            }
            Collective::AllReduce => sum(dtype, shape, &refs, output).map_err(kernel_error),
            Collective::ReduceScatter { dim } => {
                // Only this rank's slice of the sum: the slice of every input, added.
                let mut part_shape = shape.to_vec();
                part_shape[dim] /= n;
                if shape[..dim].iter().product::<usize>() == 1 {
                    let span = coord * output.len()..(coord + 1) * output.len();
                    let parts: Vec<&[u8]> = refs.iter().map(|input| &input[span.clone()]).collect();
                    sum(dtype, &part_shape, &parts, output).map_err(kernel_error)
                } else {
                    let mut parts = vec![vec![0u8; output.len()]; n];
                    for (part, input) in parts.iter_mut().zip(&refs) {
                        slice_for(dtype, shape, dim, coord, n, input, part).map_err(kernel_error)?;
                    }
                    let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
                    sum(dtype, &part_shape, &parts, output).map_err(kernel_error)
                }
            }
            Collective::AllToAll { split, concat } => {
                let mut pieces = vec![vec![0u8; input.len() / n]; n];
                for (piece, input) in pieces.iter_mut().zip(&refs) {
                    slice_for(dtype, shape, split, coord, n, input, piece).map_err(kernel_error)?;
                }
                let pieces: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
                place_pieces(dtype, shape, (split, concat), &pieces, output).map_err(kernel_error)
            }
            Collective::RingShift { .. } => {
                output.copy_from_slice(refs[(coord + n - 1) % n]);
                Ok(())
            }
            Collective::ShardSlice { .. } => unreachable!("handled above"),
        };
        drop(refs);
        drop(inputs);
        self.depart(group);
        result
    }

    fn send(&self, rank: usize, to: usize, tag: u64, bytes: &[u8], sent_at: Duration) -> Result<(), RuntimeError> {
        let peer = self.topology.on_stage(rank, to)?;
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

    fn recv(&self, rank: usize, from: usize, tag: u64, output: &mut [u8]) -> Result<Duration, RuntimeError> {
        let peer = self.topology.on_stage(rank, from)?;
        let mut mail = self.mail.lock().expect("mailboxes");
        loop {
            if let Some(message) = mail.get_mut(&(peer, rank)).and_then(|mailbox| mailbox.queue.pop_front()) {
                drop(mail);
                let Message { tag: sent, bytes, sent_at } = message;
                if sent != tag || bytes.len() != output.len() {
                    return Err(unexpected_message(rank, from, (tag, output.len()), (sent, bytes.len())));
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

    fn abort(&self, _rank: usize, _why: &RuntimeError) {
        self.aborted.store(true, Ordering::SeqCst);
        for g in self.groups.values() {
            g.wake.notify_all();
        }
        self.mail_wake.notify_all();
    }

    fn bytes_sent(&self, rank: usize) -> CommBytes {
        self.sent[rank].lock().expect("counters").clone()
    }

    fn staging_peak(&self, rank: usize) -> usize {
        self.staging_peak[rank].load(Ordering::SeqCst)
    }

    fn reset_counts(&self) {
        for s in &self.sent {
            *s.lock().expect("counters") = CommBytes::default();
        }
    }
}
