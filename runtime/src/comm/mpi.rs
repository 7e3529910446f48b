//! [`MpiComm`]: one rank per process, over MPI (`mpirun`, `srun`, `autotp run --launch`).
//!
//! - **Groups**: at start every process splits `MPI_COMM_WORLD` once per mesh axis (color: the
//!   group's first rank, key: the coordinate on the axis), so a collective on an axis is one
//!   MPI collective on that axis's communicator. Pipeline messages go over `MPI_COMM_WORLD`.
//! - **Order**: a rank's compute thread and its communication thread both issue collectives;
//!   each axis runs them in the order of their sequence numbers (a turnstile per axis), the
//!   same order on every rank, as MPI requires.
//! - **Collectives**: all-reduce of f32, f64 and i64 is `MPI_Allreduce`; 16-bit floats (which
//!   MPI cannot add) are gathered and added in coordinate order, as [`super::LocalComm`] does.
//!   An all-gather along an outer dimension is `MPI_Allgather` into the output; along an inner
//!   one, into staging and then interleaved. A reduce-scatter is an all-reduce and the rank's
//!   slice: Open MPI 4.1's `MPI_Reduce_scatter_block` was 4-10x slower than its all-reduce on
//!   one machine (see the notes on measurements in the README). With groups of two ranks the
//!   sums are bit-identical to the in-process ones (a + b = b + a); larger groups may add in
//!   another order.
//! - **Asynchronous collectives** run on the executor's communication thread, blocked in MPI
//!   while the compute thread works: that thread is what makes them progress (Open MPI's
//!   non-blocking collectives advance only inside MPI calls).
//! - **Pipeline messages**: a send copies its bytes (the program may overwrite the region at
//!   once) and starts two `MPI_Isend`s, a header (tag, clock stamp, length) and the payload;
//!   the receiver checks the header before it takes the payload into its region. Completed
//!   sends are reaped on later calls and their buffers reused.
//! - **Failure**: a rank whose run fails prints why and calls `MPI_Abort`, which ends every
//!   process ([`MpiComm::abort_job`]; the panic hook does the same). A watchdog thread ends the
//!   job when one operation has waited longer than the timeout (`--comm-timeout`): a rank that
//!   stopped or hangs would otherwise block the others forever (MPI has no timeouts). Its one
//!   line names the ranks that do not answer its probes, and their hosts ([`Peers`]). A rank
//!   whose `MPI_Abort` does not end it within `ABORT_GRACE` (cut off from `mpirun`) exits.

use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use autotp_kernels::{DType, Kernel};

use super::mpi_library::{self, Handle, MpiLibrary, Status};
use super::peers::Peers;
use super::{
    all_to_all_sent, filled_lengths, pack_pieces, place_pieces, slice_for, sum, unexpected_message, Collective,
    CollectiveOp, CommBytes, Communicator, Topology,
};
use crate::RuntimeError;

#[derive(Debug, thiserror::Error)]
pub enum MpiError {
    #[error(transparent)]
    Load(#[from] mpi_library::LoadError),
    #[error("{call} failed: {message}")]
    Call { call: &'static str, message: String },
    #[error("MPI gives thread support level {provided}; autotp needs MPI_THREAD_MULTIPLE (3)")]
    ThreadLevel { provided: c_int },
    #[error("{launcher} started {launched} process(es), but MPI sees a world of {mpi}: {hint}")]
    WorldMismatch { launcher: &'static str, launched: usize, mpi: usize, hint: &'static str },
    #[error("the plan has {plan} ranks ({layout}), but the job has {world} processes: start {plan}")]
    PlanMismatch { plan: usize, layout: String, world: usize },
}

/// One mesh axis's communicator, as this rank sees it.
struct AxisGroup {
    comm: Handle,
    size: usize,
    coord: usize,
    /// The sequence number of the next collective to run on the axis.
    next: Mutex<u64>,
    turn: Condvar,
    /// Staging buffers, kept from one collective to the next (a step runs the same sizes every
    /// time): a sum to slice, and every rank's input.
    sum: Mutex<Vec<u8>>,
    gathered: Mutex<Vec<u8>>,
}

/// Sends in flight: their requests and the buffers they read.
#[derive(Default)]
struct Outbox {
    sends: Vec<([Handle; 2], [Vec<u8>; 2])>,
    spare: Vec<Vec<u8>>,
}

/// Operations waiting on other ranks, watched for the timeout.
struct Watch {
    /// (id, what, since when).
    waiting: Vec<(u64, Waiting, Instant)>,
    next_id: u64,
}

impl Watch {
    /// The operation waiting longest and for how long, as a probe's answer describes it.
    fn oldest(&self) -> Option<String> {
        let (_, what, since) = self.waiting.iter().min_by_key(|(_, _, since)| *since)?;
        Some(format!("{what} for {:.1} s", since.elapsed().as_secs_f64()))
    }
}

/// What a watched operation is, for the watchdog's message (described only if it fires, so
/// watching costs no formatting on the hot path).
#[derive(Clone, Copy)]
enum Waiting {
    Collective {
        rank: usize,
        kind: Collective,
        seq: u64,
        axis: usize,
    },
    Receive {
        rank: usize,
        tag: u64,
        from: usize,
    },
    Broadcast {
        root: usize,
    },
    Exchange,
    /// A barrier around a checkpoint write, which may take long on a slow disk: the watchdog
    /// ends it early only when it sees a rank on this node stopped or gone.
    Barrier,
}

impl std::fmt::Display for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Waiting::Collective { rank, kind, seq, axis } => {
                write!(f, "rank {rank}'s {} #{seq} on mesh axis {axis}", kind.name())
            }
            Waiting::Receive { rank, tag, from } => {
                write!(f, "rank {rank}'s receive of message {tag} from stage {from}")
            }
            Waiting::Broadcast { root } => write!(f, "a broadcast from rank {root}"),
            Waiting::Exchange => write!(f, "an exchange of every rank's figures"),
            Waiting::Barrier => write!(f, "a barrier around a checkpoint"),
        }
    }
}

/// How many `--comm-timeout`s a barrier waits when no rank on this node is seen stopped or
/// gone: the other ranks may be writing large checkpoint files.
const BARRIER_TIMEOUTS: u32 = 20;
/// How long the watchdog waits for the answers to its probes: a quarter of the timeout, within
/// these bounds.
const PROBE_WAIT_MIN: Duration = Duration::from_millis(500);
const PROBE_WAIT_MAX: Duration = Duration::from_secs(2);
/// How long a rank that called `MPI_Abort` waits for it to end the process: a rank cut off from
/// `mpirun` would otherwise wait in it for as long as TCP retransmits.
const ABORT_GRACE: Duration = Duration::from_secs(5);

const HEADER_BYTES: usize = 24;
/// The MPI tag of pipeline messages (their own tags travel in the header).
const PIPELINE_TAG: c_int = 0;

/// The tag of a ring shift's message, on its axis's communicator.
const RING_TAG: c_int = 1;
/// The most elements one MPI call takes (its counts are C ints).
const MAX_COUNT: usize = 1 << 30;

/// This process's rank of a job over MPI.
pub struct MpiComm {
    lib: MpiLibrary,
    topology: Topology,
    rank: usize,
    /// This process's place among the job's processes on this node, and their number.
    local_rank: usize,
    local_size: usize,
    axes: Vec<AxisGroup>,
    sent: Mutex<CommBytes>,
    staging_peak: AtomicUsize,
    outbox: Mutex<Outbox>,
    watch: Arc<Mutex<Watch>>,
    timeout: Duration,
    /// Every rank's host, process id and probe address, to tell which rank stopped.
    peers: Peers,
}

// SAFETY: the handles are Open MPI's communicators, used under MPI_THREAD_MULTIPLE; each axis's
// collectives are serialized by its turnstile, the outbox by its lock.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl MpiComm {
    /// Initialises MPI for a job the launcher `launcher` started as `launched` processes, for a
    /// plan of `topology`; operations waiting longer than `timeout` end the job.
    pub fn init(
        topology: Topology,
        launcher: &'static str,
        launched: usize,
        timeout: Duration,
    ) -> Result<Arc<MpiComm>, MpiError> {
        // Open MPI busy-polls in blocking calls; with ranks sharing cores, the communication
        // thread polling would take the compute threads' time.
        if std::env::var_os("OMPI_MCA_mpi_yield_when_idle").is_none() {
            std::env::set_var("OMPI_MCA_mpi_yield_when_idle", "1");
        }
        let lib = MpiLibrary::load()?;
        let check = |call: &'static str, rc: c_int| -> Result<(), MpiError> {
            if rc == mpi_library::SUCCESS {
                Ok(())
            } else {
                Err(MpiError::Call { call, message: lib.error_string(rc) })
            }
        };
        let mut initialized: c_int = 0;
        check("MPI_Initialized", unsafe { (lib.MPI_Initialized)(&mut initialized) })?;
        if initialized == 0 {
            let mut provided: c_int = 0;
            let rc = unsafe {
                (lib.MPI_Init_thread)(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    mpi_library::THREAD_MULTIPLE,
                    &mut provided,
                )
            };
            check("MPI_Init_thread", rc)?;
            if provided < mpi_library::THREAD_MULTIPLE {
                return Err(MpiError::ThreadLevel { provided });
            }
        }
        let world = lib.comm_world;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        check("MPI_Comm_rank", unsafe { (lib.MPI_Comm_rank)(world, &mut rank) })?;
        check("MPI_Comm_size", unsafe { (lib.MPI_Comm_size)(world, &mut size) })?;
        let (rank, size) = (rank as usize, size as usize);
        if size != launched {
            let hint = if launcher == "SLURM" {
                "Open MPI needs srun's PMIx (srun --mpi=pmix), or start the job with mpirun"
            } else {
                "start the processes with mpirun (or autotp run --launch N)"
            };
            return Err(MpiError::WorldMismatch { launcher, launched, mpi: size, hint });
        }
        if size != topology.world_size() {
            let layout = format!("{} stage(s) of mesh {:?}", topology.stages, topology.sizes);
            return Err(MpiError::PlanMismatch { plan: topology.world_size(), layout, world: size });
        }
        let mut axes = Vec::new();
        for axis in 0..topology.sizes.len() {
            let coord = topology.coordinates(rank)[axis];
            let mut comm: Handle = std::ptr::null_mut();
            let color = topology.group_leader(rank, axis) as c_int;
            check("MPI_Comm_split", unsafe { (lib.MPI_Comm_split)(world, color, coord as c_int, &mut comm) })?;
            let size = topology.sizes[axis];
            axes.push(AxisGroup {
                comm,
                size,
                coord,
                next: Mutex::new(0),
                turn: Condvar::new(),
                sum: Mutex::default(),
                gathered: Mutex::default(),
            });
        }
        let mut node: Handle = std::ptr::null_mut();
        let rc = unsafe {
            (lib.MPI_Comm_split_type)(world, mpi_library::COMM_TYPE_SHARED, rank as c_int, lib.info_null, &mut node)
        };
        check("MPI_Comm_split_type", rc)?;
        let (mut local_rank, mut local_size): (c_int, c_int) = (0, 0);
        check("MPI_Comm_rank", unsafe { (lib.MPI_Comm_rank)(node, &mut local_rank) })?;
        check("MPI_Comm_size", unsafe { (lib.MPI_Comm_size)(node, &mut local_size) })?;
        let watch = Arc::new(Mutex::new(Watch { waiting: Vec::new(), next_id: 0 }));
        let mut comm = MpiComm {
            lib,
            topology,
            rank,
            local_rank: local_rank as usize,
            local_size: local_size.max(1) as usize,
            axes,
            sent: Mutex::new(CommBytes::default()),
            staging_peak: AtomicUsize::new(0),
            outbox: Mutex::new(Outbox::default()),
            watch,
            timeout,
            peers: Peers::from_records(&[], rank),
        };
        let watched = comm.watch.clone();
        let own = Peers::start(move || watched.lock().expect("watch").oldest())
            .map_err(|e| MpiError::Call { call: "a UDP socket for probes", message: e.to_string() })?;
        let mut all = vec![0u8; own.len() * size];
        comm.all_gather_bytes(comm.lib.comm_world, &own, &mut all)
            .map_err(|e| MpiError::Call { call: "MPI_Allgather", message: e.to_string() })?;
        comm.peers = Peers::from_records(&all, rank);
        let comm = Arc::new(comm);
        comm.start_watchdog();
        Ok(comm)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// This process's place among the job's processes on this node.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// This process's share of the node's cores for its kernel threads: the cores it is bound
    /// to when the launcher bound it (Open MPI binds up to two processes to a core each), else
    /// the cores it may use divided among the node's processes.
    pub fn kernel_threads(&self) -> usize {
        let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: sysconf reads a system constant.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
        if allowed < online {
            allowed
        } else {
            (allowed / self.local_size).max(1)
        }
    }

    /// Waits for every rank. A rank may be writing a large checkpoint, so the barrier waits
    /// `BARRIER_TIMEOUTS` timeouts unless a rank is seen stopped or gone or does not answer.
    pub fn barrier(&self) -> Result<(), RuntimeError> {
        let _watched = self.watched(Waiting::Barrier);
        self.call("MPI_Barrier", unsafe { (self.lib.MPI_Barrier)(self.lib.comm_world) })
    }

    /// Gives every rank `root`'s `bytes`.
    pub fn broadcast(&self, root: usize, bytes: &mut [u8]) -> Result<(), RuntimeError> {
        let _watched = self.watched(Waiting::Broadcast { root });
        for chunk in bytes.chunks_mut(MAX_COUNT) {
            let rc = unsafe {
                (self.lib.MPI_Bcast)(
                    chunk.as_mut_ptr().cast(),
                    chunk.len() as c_int,
                    self.lib.byte,
                    root as c_int,
                    self.lib.comm_world,
                )
            };
            self.call("MPI_Bcast", rc)?;
        }
        Ok(())
    }

    /// Every rank's `bytes` (of one length on all), in rank order.
    pub fn all_gather(&self, bytes: &[u8]) -> Result<Vec<u8>, RuntimeError> {
        let _watched = self.watched(Waiting::Exchange);
        let mut all = vec![0u8; bytes.len() * self.topology.world_size()];
        self.all_gather_bytes(self.lib.comm_world, bytes, &mut all)?;
        Ok(all)
    }

    /// Plain `MPI_Allreduce` of f32 sums (as bytes) over every rank, nothing around it: the
    /// baseline `autotp bench-comm` measures the backend against.
    pub fn raw_all_reduce(&self, input: &[u8], output: &mut [u8]) -> Result<(), RuntimeError> {
        if input.len() != output.len() || input.len() / 4 > MAX_COUNT {
            return Err(RuntimeError::Comm(format!("an all-reduce of {} bytes into {}", input.len(), output.len())));
        }
        let rc = unsafe {
            (self.lib.MPI_Allreduce)(
                input.as_ptr().cast(),
                output.as_mut_ptr().cast(),
                (input.len() / 4) as c_int,
                self.lib.float,
                self.lib.op_sum,
                self.lib.comm_world,
            )
        };
        self.call("MPI_Allreduce", rc)
    }

    /// Starts a plain `MPI_Iallreduce` of f32 sums over every rank; the buffers must stay put
    /// until [`MpiComm::raw_test`] says it is done (an experiment of `autotp bench-comm`).
    pub fn raw_start_all_reduce(&self, input: &[u8], output: &mut [u8]) -> Result<usize, RuntimeError> {
        let mut request: Handle = std::ptr::null_mut();
        let rc = unsafe {
            (self.lib.MPI_Iallreduce)(
                input.as_ptr().cast(),
                output.as_mut_ptr().cast(),
                (input.len() / 4) as c_int,
                self.lib.float,
                self.lib.op_sum,
                self.lib.comm_world,
                &mut request,
            )
        };
        self.call("MPI_Iallreduce", rc)?;
        Ok(request as usize)
    }

    /// Advances a request of [`MpiComm::raw_start_all_reduce`]; whether it is done.
    pub fn raw_test(&self, request: &mut usize) -> Result<bool, RuntimeError> {
        let mut handle = *request as Handle;
        let mut done: c_int = 0;
        let rc = unsafe { (self.lib.MPI_Test)(&mut handle, &mut done, std::ptr::null_mut()) };
        *request = handle as usize;
        self.call("MPI_Test", rc)?;
        Ok(done != 0)
    }

    /// Ends every process of the job: prints `why` as this rank's and calls `MPI_Abort`.
    pub fn abort_job(&self, why: &str) -> ! {
        eprintln!("autotp: rank {} of {}: {why}; ending the job", self.rank, self.topology.world_size());
        abort_world(&self.lib)
    }

    /// Ends the job, from the panic hook: makes a panicking rank end the job instead of
    /// unwinding into `MPI_Finalize` while the others wait for it.
    pub fn install_panic_hook(self: &Arc<MpiComm>) {
        let comm = self.clone();
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            comm.abort_job("panicked");
        }));
    }

    /// Finishes MPI after a run that succeeded (every send done first).
    pub fn finalize(&self) -> Result<(), RuntimeError> {
        self.reap(true)?;
        self.call("MPI_Finalize", unsafe { (self.lib.MPI_Finalize)() })
    }

    fn call(&self, call: &'static str, rc: c_int) -> Result<(), RuntimeError> {
        if rc == mpi_library::SUCCESS {
            Ok(())
        } else {
            Err(RuntimeError::Comm(format!("{call} failed: {}", self.lib.error_string(rc))))
        }
    }

    fn check_rank(&self, rank: usize) -> Result<(), RuntimeError> {
        if rank == self.rank {
            Ok(())
        } else {
            Err(RuntimeError::Comm(format!("process of rank {} asked to act as rank {rank}", self.rank)))
        }
    }

    /// Watches the operation `what` until the returned guard drops.
    fn watched(&self, what: Waiting) -> WatchGuard<'_> {
        let mut watch = self.watch.lock().expect("watch");
        let id = watch.next_id;
        watch.next_id += 1;
        watch.waiting.push((id, what, Instant::now()));
        WatchGuard { watch: &self.watch, id }
    }

    /// Starts the thread that ends the job when an operation waits past the timeout.
    fn start_watchdog(self: &Arc<MpiComm>) {
        let watch = self.watch.clone();
        let comm = Arc::downgrade(self);
        let timeout = self.timeout;
        std::thread::Builder::new()
            .name("autotp-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(100).min(timeout / 4));
                let Some(comm) = comm.upgrade() else { return };
                let stuck: Vec<(Waiting, Duration)> = {
                    let watch = watch.lock().expect("watch");
                    watch
                        .waiting
                        .iter()
                        .filter(|(_, _, since)| since.elapsed() > timeout)
                        .map(|(_, what, since)| (*what, since.elapsed()))
                        .collect()
                };
                if stuck.is_empty() {
                    continue;
                }
                let diagnosis = comm.peers.diagnose((timeout / 4).clamp(PROBE_WAIT_MIN, PROBE_WAIT_MAX));
                let overdue = stuck.into_iter().find(|(what, waited)| {
                    !matches!(what, Waiting::Barrier) || diagnosis.unresponsive || *waited > timeout * BARRIER_TIMEOUTS
                });
                if let Some((what, waited)) = overdue {
                    let waited = waited.as_secs_f64();
                    let cause = diagnosis.describe().unwrap_or_else(|| {
                        "a rank stopped, hangs or is far slower; if it is only slow, raise --comm-timeout".to_string()
                    });
                    comm.abort_job(&format!(
                        "{what} has waited {waited:.1} s for the other ranks (--comm-timeout {} s): {cause}",
                        timeout.as_secs_f64()
                    ));
                }
                // A barrier that may still end: probe again later, not at every tick.
                drop(comm);
                std::thread::sleep((timeout / 4).max(PROBE_WAIT_MIN * 2));
            })
            .expect("the watchdog thread starts");
    }

    /// Waits for this axis's turn `seq`, runs `f`, and opens the next turn.
    fn in_turn<T>(&self, axis: &AxisGroup, seq: u64, f: impl FnOnce() -> T) -> T {
        let mut next = axis.next.lock().expect("turnstile");
        while *next != seq {
            next = axis.turn.wait(next).expect("turnstile");
        }
        drop(next);
        let result = f();
        *axis.next.lock().expect("turnstile") += 1;
        axis.turn.notify_all();
        result
    }

    fn all_reduce(&self, comm: Handle, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<(), RuntimeError> {
        let mpi_type = match dtype {
            DType::F32 => self.lib.float,
            DType::F64 => self.lib.double,
            DType::I64 => self.lib.int64,
            _ => unreachable!("all_reduce_natively checked the dtype"),
        };
        let size = dtype.size();
        for (i, o) in input.chunks(MAX_COUNT * size).zip(output.chunks_mut(MAX_COUNT * size)) {
            let rc = unsafe {
                (self.lib.MPI_Allreduce)(
                    i.as_ptr().cast(),
                    o.as_mut_ptr().cast(),
                    (i.len() / size) as c_int,
                    mpi_type,
                    self.lib.op_sum,
                    comm,
                )
            };
            self.call("MPI_Allreduce", rc)?;
        }
        Ok(())
    }

    /// Every rank's `input`, concatenated in coordinate order into `output`.
    fn all_gather_bytes(&self, comm: Handle, input: &[u8], output: &mut [u8]) -> Result<(), RuntimeError> {
        if input.len() > i32::MAX as usize {
            return Err(RuntimeError::Comm(format!(
                "an all-gather of {} bytes per rank: the MPI backend gathers at most 2 GiB per rank in one call",
                input.len()
            )));
        }
        let rc = unsafe {
            (self.lib.MPI_Allgather)(
                input.as_ptr().cast(),
                input.len() as c_int,
                self.lib.byte,
                output.as_mut_ptr().cast(),
                input.len() as c_int,
                self.lib.byte,
                comm,
            )
        };
        self.call("MPI_Allgather", rc)
    }

    /// `MPI_Alltoall` of equal pieces over the `n` ranks of `comm`: piece j of `packed` to rank
    /// j, rank i's piece for this one into piece i of `received`.
    fn all_to_all_bytes(&self, comm: Handle, n: usize, packed: &[u8], received: &mut [u8]) -> Result<(), RuntimeError> {
        let piece = packed.len() / n;
        if piece > i32::MAX as usize {
            return Err(RuntimeError::Comm(format!(
                "an all-to-all of {piece} bytes per piece: the MPI backend sends at most 2 GiB per piece in one call"
            )));
        }
        // SAFETY: both buffers hold n pieces of `piece` bytes, as the call reads and writes.
        let rc = unsafe {
            (self.lib.MPI_Alltoall)(
                packed.as_ptr().cast(),
                piece as c_int,
                self.lib.byte,
                received.as_mut_ptr().cast(),
                piece as c_int,
                self.lib.byte,
                comm,
            )
        };
        self.call("MPI_Alltoall", rc)
    }

    /// An all-to-all over the `n` ranks of `comm` that sends only the `filled` bytes of each
    /// piece of `packed` ([`filled_lengths`]): the lengths first (`MPI_Alltoall`), then the
    /// pieces' filled bytes (`MPI_Alltoallv`), and the rest of each piece in `received` zeroed,
    /// so `received` is what [`MpiComm::all_to_all_bytes`] gives. Buffers of 2 GiB or more,
    /// whose offsets MPI's `int`s cannot hold, go whole by that.
    fn all_to_all_filled(
        &self,
        comm: Handle,
        n: usize,
        (packed, filled): (&[u8], &[usize]),
        received: &mut [u8],
    ) -> Result<(), RuntimeError> {
        if packed.len() > i32::MAX as usize {
            return self.all_to_all_bytes(comm, n, packed, received);
        }
        let piece = packed.len() / n;
        let lengths: Vec<u8> = filled.iter().flat_map(|&len| (len as u64).to_le_bytes()).collect();
        let mut incoming = vec![0u8; lengths.len()];
        self.all_to_all_bytes(comm, n, &lengths, &mut incoming)?;
        let incoming: Vec<usize> =
            incoming.chunks(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize).collect();
        if let Some(len) = incoming.iter().find(|&&len| len > piece) {
            return Err(RuntimeError::Comm(format!("an all-to-all piece of {len} bytes announced, over its {piece}")));
        }
        let ints = |lengths: &[usize]| lengths.iter().map(|&len| len as c_int).collect::<Vec<c_int>>();
        let (send_counts, receive_counts) = (ints(filled), ints(&incoming));
        let offsets: Vec<c_int> = (0..n).map(|j| (j * piece) as c_int).collect();
        // SAFETY: both buffers hold n pieces of `piece` bytes; every count is at most `piece`
        // and every offset the start of a piece, as the call reads and writes.
        let rc = unsafe {
            (self.lib.MPI_Alltoallv)(
                packed.as_ptr().cast(),
                send_counts.as_ptr(),
                offsets.as_ptr(),
                self.lib.byte,
                received.as_mut_ptr().cast(),
                receive_counts.as_ptr(),
                offsets.as_ptr(),
                self.lib.byte,
                comm,
            )
        };
        self.call("MPI_Alltoallv", rc)?;
        for (piece, &len) in received.chunks_mut(piece).zip(&incoming) {
            piece[len..].fill(0);
        }
        Ok(())
    }

    /// A ring shift on `comm` (of `n` ranks, this one `coord`): `input` to the next rank,
    /// the previous one's into `output` (of the same length).
    fn ring_shift_bytes(
        &self,
        comm: Handle,
        (n, coord): (usize, usize),
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), RuntimeError> {
        if input.len() > i32::MAX as usize {
            return Err(RuntimeError::Comm(format!(
                "a ring shift of {} bytes: the MPI backend sends at most 2 GiB in one call",
                input.len()
            )));
        }
        let (next, previous) = (((coord + 1) % n) as c_int, ((coord + n - 1) % n) as c_int);
        let mut request: Handle = std::ptr::null_mut();
        // SAFETY: `input` outlives the send, which completes (Waitall) before this returns;
        // `output` holds the `input.len()` bytes the receive writes.
        let rc = unsafe {
            (self.lib.MPI_Isend)(
                input.as_ptr().cast(),
                input.len() as c_int,
                self.lib.byte,
                next,
                RING_TAG,
                comm,
                &mut request,
            )
        };
        self.call("MPI_Isend", rc)?;
        let mut status = Status::default();
        let received = unsafe {
            (self.lib.MPI_Recv)(
                output.as_mut_ptr().cast(),
                output.len() as c_int,
                self.lib.byte,
                previous,
                RING_TAG,
                comm,
                &mut status,
            )
        };
        let mut sent = Status::default();
        let completed = unsafe { (self.lib.MPI_Waitall)(1, &mut request, &mut sent) };
        self.call("MPI_Recv", received)?;
        self.call("MPI_Waitall", completed)
    }

    /// Receives the next pipeline message from `peer` (of `buffer`'s length) into `buffer`.
    fn recv_bytes(&self, peer: c_int, buffer: &mut [u8]) -> Result<(), RuntimeError> {
        let mut status = Status::default();
        let rc = unsafe {
            (self.lib.MPI_Recv)(
                buffer.as_mut_ptr().cast(),
                buffer.len() as c_int,
                self.lib.byte,
                peer,
                PIPELINE_TAG,
                self.lib.comm_world,
                &mut status,
            )
        };
        self.call("MPI_Recv", rc)
    }

    /// Completes the sends that are done (all of them with `wait`), keeping their buffers.
    fn reap(&self, wait: bool) -> Result<(), RuntimeError> {
        let mut outbox = self.outbox.lock().expect("outbox");
        let Outbox { sends, spare } = &mut *outbox;
        let mut failure = None;
        sends.retain_mut(|(requests, buffers)| {
            let mut statuses = [Status::default(), Status::default()];
            let rc = if wait {
                unsafe { (self.lib.MPI_Waitall)(2, requests.as_mut_ptr(), statuses.as_mut_ptr()) }
            } else {
                let mut done: c_int = 0;
                let rc = unsafe { (self.lib.MPI_Testall)(2, requests.as_mut_ptr(), &mut done, statuses.as_mut_ptr()) };
                if rc == mpi_library::SUCCESS && done == 0 {
                    return true;
                }
                rc
            };
            if let Err(e) = self.call("MPI_Testall", rc) {
                failure.get_or_insert(e);
            }
            spare.extend(buffers.iter_mut().map(std::mem::take));
            false
        });
        failure.map_or(Ok(()), Err)
    }
}

impl Communicator for MpiComm {
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
        self.check_rank(rank)?;
        let CollectiveOp { kind, axis, dtype, ref shape } = *op;
        let group = self.axes.get(axis).ok_or_else(|| RuntimeError::Comm(format!("no mesh axis {axis}")))?;
        let (n, coord) = (group.size, group.coord);
        let kernel_error = |source| RuntimeError::Kernel { label: kind.name().into(), source };
        if kind.output_shape(shape, n).is_none() {
            return Err(RuntimeError::Comm(format!("{} of {shape:?} over {n} ranks", kind.name())));
        }
        if let Collective::ShardSlice { dim } = kind {
            return slice_for(dtype, shape, dim, coord, n, input, output).map_err(kernel_error);
        }
        let native = matches!(dtype, DType::F32 | DType::F64 | DType::I64);
        // Staging: a reduce-scatter's sum, an inner all-gather's chunks, a 16-bit reduction's
        // inputs and sum.
        let staging = match kind {
            Collective::AllReduce if native => 0,
            Collective::AllReduce => (n + 1) * input.len(),
            Collective::ReduceScatter { .. } if native => input.len(),
            Collective::ReduceScatter { .. } => (n + 1) * input.len(),
            Collective::AllGather { dim } if shape[..dim].iter().product::<usize>() == 1 => 0,
            Collective::AllGather { .. } => n * input.len(),
            Collective::ShardSlice { .. } => 0,
            // The pieces packed to send, and those received.
            Collective::AllToAll { .. } => 2 * input.len(),
            Collective::RingShift { .. } => 0,
        };
        self.staging_peak.fetch_max(staging, Ordering::SeqCst);
        let _watched = self.watched(Waiting::Collective { rank: self.rank, kind, seq, axis });
        // An all-to-all's bytes sent: what its pieces held.
        let mut sent = None;
        self.in_turn(group, seq, || -> Result<(), RuntimeError> {
            // A sum in coordinate order of every rank's input (16-bit floats).
            let mut gathered = group.gathered.lock().expect("staging");
            let gathered_sum = |gathered: &mut Vec<u8>, into: &mut [u8]| -> Result<(), RuntimeError> {
                let all = sized(gathered, n * input.len());
                self.all_gather_bytes(group.comm, input, all)?;
                let inputs: Vec<&[u8]> = all.chunks(input.len()).collect();
                sum(dtype, shape, &inputs, into).map_err(kernel_error)
            };
            match kind {
                Collective::AllReduce if native => self.all_reduce(group.comm, dtype, input, output),
                Collective::AllReduce => gathered_sum(&mut gathered, output),
                Collective::ReduceScatter { dim } => {
                    let mut total = group.sum.lock().expect("staging");
                    let total = sized(&mut total, input.len());
                    if native {
                        self.all_reduce(group.comm, dtype, input, total)?;
                    } else {
                        gathered_sum(&mut gathered, total)?;
                    }
                    slice_for(dtype, shape, dim, coord, n, total, output).map_err(kernel_error)
                }
                Collective::AllGather { dim } if shape[..dim].iter().product::<usize>() == 1 => {
                    self.all_gather_bytes(group.comm, input, output)
                }
                Collective::AllGather { dim } => {
                    let all = sized(&mut gathered, n * input.len());
                    self.all_gather_bytes(group.comm, input, all)?;
                    let chunks: Vec<&[u8]> = all.chunks(input.len()).collect();
                    let concat = Kernel::Concat { dtype, shapes: vec![shape.to_vec(); n], axis: dim };
                    concat.run(&chunks, &mut [output]).map_err(kernel_error)
                }
                Collective::AllToAll { split, concat } => {
                    let mut received = group.sum.lock().expect("staging");
                    let packed = sized(&mut gathered, input.len());
                    pack_pieces(dtype, shape, split, n, input, packed).map_err(kernel_error)?;
                    let received = sized(&mut received, input.len());
                    let filled = filled_lengths(dtype, n, packed);
                    self.all_to_all_filled(group.comm, n, (packed, &filled), received)?;
                    sent = Some(all_to_all_sent(&filled, coord));
                    let pieces: Vec<&[u8]> = received.chunks(input.len() / n).collect();
                    place_pieces(dtype, shape, (split, concat), &pieces, output).map_err(kernel_error)
                }
                Collective::RingShift { .. } => self.ring_shift_bytes(group.comm, (n, coord), input, output),
                Collective::ShardSlice { .. } => unreachable!("handled above"),
            }
        })?;
        match sent {
            Some(sent) => self.sent.lock().expect("counters").count_sent(kind, sent),
            None => self.sent.lock().expect("counters").count(kind, input.len(), n),
        }
        Ok(())
    }

    fn send(&self, rank: usize, to: usize, tag: u64, bytes: &[u8], sent_at: Duration) -> Result<(), RuntimeError> {
        self.check_rank(rank)?;
        let peer = self.topology.on_stage(rank, to)?;
        if bytes.len() > i32::MAX as usize {
            return Err(RuntimeError::Comm(format!("a pipeline message of {} bytes (at most 2 GiB)", bytes.len())));
        }
        self.reap(false)?;
        let mut outbox = self.outbox.lock().expect("outbox");
        let mut header = outbox.spare.pop().unwrap_or_default();
        header.clear();
        header.extend_from_slice(&tag.to_le_bytes());
        header.extend_from_slice(&(sent_at.as_nanos() as u64).to_le_bytes());
        header.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        let mut payload = outbox.spare.pop().unwrap_or_default();
        payload.clear();
        payload.extend_from_slice(bytes);
        let mut requests: [Handle; 2] = [std::ptr::null_mut(); 2];
        for (buffer, request) in [&header, &payload].into_iter().zip(&mut requests) {
            let rc = unsafe {
                (self.lib.MPI_Isend)(
                    buffer.as_ptr().cast(),
                    buffer.len() as c_int,
                    self.lib.byte,
                    peer as c_int,
                    PIPELINE_TAG,
                    self.lib.comm_world,
                    request,
                )
            };
            self.call("MPI_Isend", rc)?;
        }
        // The vectors move into the outbox; their heap buffers, which MPI reads, stay put.
        outbox.sends.push((requests, [header, payload]));
        self.sent.lock().expect("counters").send += bytes.len();
        Ok(())
    }

    fn recv(&self, rank: usize, from: usize, tag: u64, output: &mut [u8]) -> Result<Duration, RuntimeError> {
        self.check_rank(rank)?;
        let peer = self.topology.on_stage(rank, from)? as c_int;
        self.reap(false)?;
        let _watched = self.watched(Waiting::Receive { rank, tag, from });
        let mut header = [0u8; HEADER_BYTES];
        self.recv_bytes(peer, &mut header)?;
        let field = |i: usize| u64::from_le_bytes(header[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        let (sent, sent_at, len) = (field(0), Duration::from_nanos(field(1)), field(2) as usize);
        if sent != tag || len != output.len() {
            return Err(unexpected_message(rank, from, (tag, output.len()), (sent, len)));
        }
        self.recv_bytes(peer, output)?;
        Ok(sent_at)
    }

    /// Another process cannot be woken from here, and this one's communication thread may be
    /// blocked in MPI: the failing rank ends the whole job.
    fn abort(&self, rank: usize, why: &RuntimeError) {
        debug_assert_eq!(rank, self.rank);
        self.abort_job(&format!("failed: {why}"));
    }

    fn bytes_sent(&self, _rank: usize) -> CommBytes {
        self.sent.lock().expect("counters").clone()
    }

    fn staging_peak(&self, _rank: usize) -> usize {
        self.staging_peak.load(Ordering::SeqCst)
    }

    fn reset_counts(&self) {
        *self.sent.lock().expect("counters") = CommBytes::default();
    }
}

/// Removes its operation from the watch when dropped.
struct WatchGuard<'a> {
    watch: &'a Mutex<Watch>,
    id: u64,
}

impl Drop for WatchGuard<'_> {
    fn drop(&mut self) {
        self.watch.lock().expect("watch").waiting.retain(|(id, _, _)| *id != self.id);
    }
}

fn abort_world(lib: &MpiLibrary) -> ! {
    let _ = std::thread::Builder::new().name("autotp-abort".into()).spawn(|| {
        std::thread::sleep(ABORT_GRACE);
        // SAFETY: _exit ends the process at once, running nothing of Rust's or MPI's.
        unsafe { libc::_exit(1) }
    });
    // SAFETY: MPI is initialised (an MpiComm exists); MPI_Abort may be called from any thread.
    unsafe { (lib.MPI_Abort)(lib.comm_world, 1) };
    // MPI_Abort does not return; if it did, this process must still not go on.
    std::process::exit(1)
}

/// The first `len` bytes of `buffer`, grown to hold them.
fn sized(buffer: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if buffer.len() < len {
        buffer.resize(len, 0);
    }
    &mut buffer[..len]
}
