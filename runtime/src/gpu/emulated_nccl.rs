//! NCCL for emulated GPUs: communicators among the [`super::emulated::Emulator`]s of one
//! process (ranks as threads), so that the GPU device's NCCL path (its bootstrap, the device
//! steps of [`super::collectives`], the stream order of its calls) is tested without a GPU.
//!
//! A communicator is a [`Group`] in a process-wide registry under its unique id. A rank's call
//! runs when its stream reaches it: it posts the call under its number (the rank's count of
//! calls on the communicator) and waits until every rank posted that number; the last to post
//! performs the call for all of them (device memory is host memory), reading every input
//! before writing any output, and sums in rank order as the threads' communicator does
//! ([`crate::comm`]), so results are the CPU's bit for bit. A rank that aborts its communicators
//! makes the others' waiting and later calls fail instead of hanging, as `ncclCommAbort` does.
//!
//! Point-to-point calls (pipeline messages) meet through a mailbox instead: a send leaves a copy
//! of its bytes under its number (the sender's count of sends to that peer) and returns; the
//! receive of the same number waits for it. A send that returns before its receive is posted is
//! more than NCCL promises, so the GPU device never relies on it: its NCCL sends run on a stream
//! of their own that nothing else waits for ([`crate::streams::Stream::Transfer`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use super::collectives::NcclCall;
use super::NcclId;
use crate::RuntimeError;

/// One communicator (see the module doc).
pub(crate) struct Group {
    ranks: usize,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    /// Ranks that joined so far.
    joined: usize,
    /// Calls posted and not yet performed, by number: each rank's call, when posted.
    posted: BTreeMap<u64, Vec<Option<NcclCall>>>,
    /// Calls performed, by number: the ranks that have not yet returned from them.
    performed: BTreeMap<u64, usize>,
    /// Point-to-point messages sent and not yet received: by (sender, receiver, number).
    mail: BTreeMap<(usize, usize, u64), Vec<u8>>,
    aborted: bool,
}

const POLL: Duration = Duration::from_millis(50);

/// Every communicator made in this process, by id (an id names one communicator for good).
fn registry() -> &'static Mutex<BTreeMap<NcclId, std::sync::Weak<Group>>> {
    static GROUPS: OnceLock<Mutex<BTreeMap<NcclId, std::sync::Weak<Group>>>> = OnceLock::new();
    GROUPS.get_or_init(Default::default)
}

/// A new unique id: this process's id and a count, the rest zero.
pub(crate) fn new_id() -> NcclId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let mut id = [0u8; 128];
    id[..4].copy_from_slice(&std::process::id().to_le_bytes());
    id[4..12].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    id
}

/// Joins communicator `id` of `ranks` ranks (made by the first to join).
pub(crate) fn join(id: &NcclId, ranks: usize) -> Result<Arc<Group>, RuntimeError> {
    if id[..4] != std::process::id().to_le_bytes() {
        return Err(RuntimeError::Comm("the emulated NCCL joins ranks of one process only".into()));
    }
    let mut groups = registry().lock().expect("the registry");
    let group = match groups.get(id) {
        Some(made) => made.upgrade().ok_or_else(|| RuntimeError::Comm("an NCCL id of a closed communicator".into()))?,
        None => {
            let group = Arc::new(Group { ranks, state: Mutex::default(), wake: Condvar::new() });
            groups.insert(*id, Arc::downgrade(&group));
            group
        }
    };
    let mut state = group.state.lock().expect("the group");
    if group.ranks != ranks || state.joined == ranks {
        return Err(RuntimeError::Comm(format!(
            "an NCCL communicator of {} ranks joined as one of {ranks}, or by more ranks than it has",
            group.ranks
        )));
    }
    state.joined += 1;
    drop(state);
    Ok(group)
}

impl Group {
    pub(crate) fn ranks(&self) -> usize {
        self.ranks
    }

    /// Makes every waiting and later call fail.
    pub(crate) fn abort(&self) {
        self.state.lock().expect("the group").aborted = true;
        self.wake.notify_all();
    }

    /// Rank `rank`'s `number`th point-to-point call to or from its peer (see the module doc):
    /// a send returns once its bytes are posted, a receive once they are in its buffer.
    ///
    /// # Safety
    /// The call's buffer is valid host memory of its length, untouched by others meanwhile.
    pub(crate) unsafe fn exchange(&self, rank: usize, number: u64, call: NcclCall) -> Result<(), RuntimeError> {
        let mut state = self.state.lock().expect("the group");
        match call {
            NcclCall::Send { send, bytes, peer } => {
                // SAFETY: the caller's buffer, of this length.
                let message = unsafe { std::slice::from_raw_parts(send as *const u8, bytes) }.to_vec();
                state.mail.insert((rank, peer, number), message);
                self.wake.notify_all();
                Ok(())
            }
            NcclCall::Recv { recv, bytes, peer } => loop {
                if let Some(message) = state.mail.remove(&(peer, rank, number)) {
                    if message.len() != bytes {
                        return Err(RuntimeError::Comm(format!(
                            "rank {rank} receives {bytes} bytes from rank {peer}, which sent {}",
                            message.len()
                        )));
                    }
                    // SAFETY: the caller's buffer, of this length.
                    unsafe { std::ptr::copy_nonoverlapping(message.as_ptr(), recv as *mut u8, bytes) };
                    return Ok(());
                }
                if state.aborted {
                    return Err(RuntimeError::PeerFailed);
                }
                state = self.wake.wait_timeout(state, POLL).expect("the group").0;
            },
            other => Err(RuntimeError::Comm(format!("NCCL {other:?} is not a point-to-point call"))),
        }
    }

    /// Rank `rank`'s call number `number` (see the module doc); returns once it is performed.
    ///
    /// # Safety
    /// The call's buffers are valid host memory for its counts, and nothing else touches them
    /// until every rank's call of this number has returned.
    pub(crate) unsafe fn call(&self, rank: usize, number: u64, call: NcclCall) -> Result<(), RuntimeError> {
        let mut state = self.state.lock().expect("the group");
        let slots = state.posted.entry(number).or_insert_with(|| vec![None; self.ranks]);
        slots[rank] = Some(call);
        if slots.iter().all(Option::is_some) {
            let calls: Vec<NcclCall> = slots.iter().map(|c| c.expect("all posted")).collect();
            state.posted.remove(&number);
            // SAFETY: every rank's buffers, as the caller promises for its own.
            unsafe { perform(&calls)? };
            state.performed.insert(number, self.ranks);
            self.wake.notify_all();
        }
        loop {
            if let Some(left) = state.performed.get_mut(&number) {
                *left -= 1;
                if *left == 0 {
                    state.performed.remove(&number);
                }
                return Ok(());
            }
            if state.aborted {
                return Err(RuntimeError::PeerFailed);
            }
            state = self.wake.wait_timeout(state, POLL).expect("the group").0;
        }
    }
}

/// Performs one call of every rank (`calls[r]` is rank `r`'s), as NCCL defines it.
///
/// # Safety
/// As [`Group::call`], for every rank's buffers.
unsafe fn perform(calls: &[NcclCall]) -> Result<(), RuntimeError> {
    let n = calls.len();
    let mismatch = || RuntimeError::Comm(format!("NCCL ranks issued different calls: {calls:?}"));
    // SAFETY (of both): the caller's buffers, of these lengths.
    let read = |address: u64, bytes: usize| unsafe { std::slice::from_raw_parts(address as *const u8, bytes).to_vec() };
    let write = |address: u64, bytes: &[u8]| unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), address as *mut u8, bytes.len())
    };
    let sum = |dtype, inputs: &[Vec<u8>]| -> Result<Vec<u8>, RuntimeError> {
        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        let mut total = vec![0u8; inputs[0].len()];
        let elements = total.len() / autotp_kernels::DType::size(dtype);
        crate::comm::sum(dtype, &[elements], &refs, &mut total)
            .map_err(|source| RuntimeError::Kernel { label: "NCCL sum".into(), source })?;
        Ok(total)
    };
    // Every rank's send buffer, of one call's kind, count and type (checked).
    let (count, dtype) = match calls[0] {
        NcclCall::AllReduce { count, dtype, .. }
        | NcclCall::AllGather { count, dtype, .. }
        | NcclCall::ReduceScatter { count, dtype, .. }
        | NcclCall::AllToAll { count, dtype, .. }
        | NcclCall::RingShift { count, dtype, .. } => (count, dtype),
        NcclCall::Send { .. } | NcclCall::Recv { .. } => return Err(mismatch()),
    };
    let mut sends = Vec::with_capacity(n);
    for call in calls {
        let (send, bytes) = match (*call, calls[0]) {
            (NcclCall::AllReduce { send, count: c, dtype: d, .. }, NcclCall::AllReduce { .. })
            | (NcclCall::AllGather { send, count: c, dtype: d, .. }, NcclCall::AllGather { .. })
            | (NcclCall::RingShift { send, count: c, dtype: d, .. }, NcclCall::RingShift { .. })
                if (c, d) == (count, dtype) =>
            {
                (send, c * d.size())
            }
            (NcclCall::ReduceScatter { send, count: c, dtype: d, .. }, NcclCall::ReduceScatter { .. })
            | (NcclCall::AllToAll { send, count: c, dtype: d, .. }, NcclCall::AllToAll { .. })
                if (c, d) == (count, dtype) =>
            {
                (send, n * c * d.size())
            }
            _ => return Err(mismatch()),
        };
        sends.push(read(send, bytes));
    }
    let block = count * dtype.size();
    let whole = match calls[0] {
        NcclCall::AllReduce { .. } => sum(dtype, &sends)?,
        NcclCall::AllGather { .. } => sends.concat(),
        NcclCall::ReduceScatter { .. }
        | NcclCall::AllToAll { .. }
        | NcclCall::RingShift { .. }
        | NcclCall::Send { .. }
        | NcclCall::Recv { .. } => Vec::new(),
    };
    for (rank, call) in calls.iter().enumerate() {
        match *call {
            NcclCall::AllReduce { recv, .. } | NcclCall::AllGather { recv, .. } => write(recv, &whole),
            NcclCall::ReduceScatter { recv, .. } => {
                let blocks: Vec<Vec<u8>> = sends.iter().map(|s| s[rank * block..(rank + 1) * block].to_vec()).collect();
                write(recv, &sum(dtype, &blocks)?);
            }
            NcclCall::AllToAll { recv, .. } => {
                let pieces: Vec<&[u8]> = sends.iter().map(|s| &s[rank * block..(rank + 1) * block]).collect();
                write(recv, &pieces.concat());
            }
            NcclCall::RingShift { recv, previous, .. } => {
                let from = sends.get(previous).ok_or_else(mismatch)?;
                write(recv, from);
            }
            NcclCall::Send { .. } | NcclCall::Recv { .. } => return Err(mismatch()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use autotp_kernels::DType;

    use super::*;

    /// Two ranks' all-reduce sums in rank order; when one rank aborts instead of making its
    /// next call, the other's call fails rather than waiting for ever.
    #[test]
    fn calls_meet_and_an_abort_ends_the_wait() {
        let id = new_id();
        let groups = [join(&id, 2).unwrap(), join(&id, 2).unwrap()];
        assert!(join(&id, 2).is_err(), "a third rank of two");
        let sends = [[1.5f32, 2.0], [0.25, -1.0]];
        let mut recvs = [[0f32; 2]; 2];
        std::thread::scope(|scope| {
            for (rank, (group, (send, recv))) in groups.iter().zip(sends.iter().zip(recvs.iter_mut())).enumerate() {
                scope.spawn(move || {
                    let call = NcclCall::AllReduce {
                        send: send.as_ptr() as u64,
                        recv: recv.as_mut_ptr() as u64,
                        count: 2,
                        dtype: DType::F32,
                    };
                    // SAFETY: both buffers live until the scope ends.
                    unsafe { group.call(rank, 0, call) }.unwrap();
                });
            }
        });
        assert_eq!(recvs, [[1.75, 1.0]; 2]);

        let waiting = std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let call = NcclCall::AllReduce {
                    send: sends[0].as_ptr() as u64,
                    recv: recvs[0].as_mut_ptr() as u64,
                    count: 2,
                    dtype: DType::F32,
                };
                // SAFETY: as above.
                unsafe { groups[0].call(0, 1, call) }
            });
            std::thread::sleep(Duration::from_millis(100));
            groups[1].abort();
            waiter.join().unwrap()
        });
        assert!(matches!(waiting, Err(RuntimeError::PeerFailed)), "{waiting:?}");
    }

    /// A send posts its bytes and returns before the receive exists; receives take messages by
    /// number, whatever order they are sent in; a receive of another length fails; a waiting
    /// receive ends when the sender aborts.
    #[test]
    fn point_to_point_messages_meet_by_number() -> Result<(), RuntimeError> {
        let id = new_id();
        let (sender, receiver) = (join(&id, 2)?, join(&id, 2)?);
        let messages = [[1u8, 2, 3], [4, 5, 6]];
        let send = |number: u64| {
            let message = &messages[number as usize % 2];
            let call = NcclCall::Send { send: message.as_ptr() as u64, bytes: 3, peer: 1 };
            // SAFETY: `messages` outlives the call, which copies it.
            unsafe { sender.exchange(0, number, call) }
        };
        send(1)?;
        send(0)?;
        let mut into = [[0u8; 3]; 2];
        for (number, buffer) in into.iter_mut().enumerate() {
            let call = NcclCall::Recv { recv: buffer.as_mut_ptr() as u64, bytes: 3, peer: 0 };
            // SAFETY: `buffer` lives through the call.
            unsafe { receiver.exchange(1, number as u64, call) }?;
        }
        assert_eq!(into, messages);

        send(2)?;
        let mut short = [0u8; 2];
        let call = NcclCall::Recv { recv: short.as_mut_ptr() as u64, bytes: 2, peer: 0 };
        // SAFETY: as above.
        let wrong = unsafe { receiver.exchange(1, 2, call) };
        assert!(matches!(&wrong, Err(RuntimeError::Comm(m)) if m.contains("which sent 3")), "{wrong:?}");

        let waiting = std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let mut buffer = [0u8; 3];
                let call = NcclCall::Recv { recv: buffer.as_mut_ptr() as u64, bytes: 3, peer: 0 };
                // SAFETY: as above.
                unsafe { receiver.exchange(1, 3, call) }
            });
            std::thread::sleep(Duration::from_millis(100));
            sender.abort();
            waiter.join()
        });
        assert!(matches!(waiting, Ok(Err(RuntimeError::PeerFailed))), "{waiting:?}");
        Ok(())
    }
}
