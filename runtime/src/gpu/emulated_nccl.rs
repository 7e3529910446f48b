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
        | NcclCall::ReduceScatter { count, dtype, .. } => (count, dtype),
    };
    let mut sends = Vec::with_capacity(n);
    for call in calls {
        let (send, bytes) = match (*call, calls[0]) {
            (NcclCall::AllReduce { send, count: c, dtype: d, .. }, NcclCall::AllReduce { .. })
            | (NcclCall::AllGather { send, count: c, dtype: d, .. }, NcclCall::AllGather { .. })
                if (c, d) == (count, dtype) =>
            {
                (send, c * d.size())
            }
            (NcclCall::ReduceScatter { send, count: c, dtype: d, .. }, NcclCall::ReduceScatter { .. })
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
        NcclCall::ReduceScatter { .. } => Vec::new(),
    };
    for (rank, call) in calls.iter().enumerate() {
        match *call {
            NcclCall::AllReduce { recv, .. } | NcclCall::AllGather { recv, .. } => write(recv, &whole),
            NcclCall::ReduceScatter { recv, .. } => {
                let blocks: Vec<Vec<u8>> = sends.iter().map(|s| s[rank * block..(rank + 1) * block].to_vec()).collect();
                write(recv, &sum(dtype, &blocks)?);
            }
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
}
