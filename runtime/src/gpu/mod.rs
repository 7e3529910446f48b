//! A program on a GPU: the host's side of it, written once over the [`Gpu`] interface.
//!
//! An [`crate::Executor`] on a GPU holds the program's arena as one device allocation,
//! uploads constants, parameters and each step's inputs, runs the program's stream schedule
//! through [`GpuDevice`] (a [`Device`]), applies the step's updates on the device and downloads
//! the outputs. What runs where:
//! - a generated kernel is the plan's kernel entry ([`Entry::Kernel`]) over its buffers' device
//!   addresses, one row per block;
//! - an optimizer step is the multi-tensor entry ([`Entry::OptimizerStep`]) over a table of
//!   chunks built once at load in device memory (the same chunks as the CPU's) and the step's
//!   scalars where the arena keeps them: the kernel computes the learning rate's and bias
//!   corrections' constants itself, so the host reads nothing back inside a step. An offloaded
//!   optimizer's tensors (states in the host pool) are updated by the host instead, with the
//!   CPU's kernel, their gradients downloaded and new parameters uploaded in groups that
//!   overlap the update (`offload`);
//! - a matmul is a cuBLAS batched GEMM ([`gemm::GemmCall`], its pointer arrays made at load),
//!   where the GPU has cuBLAS and the operands a cuBLAS form;
//! - a byte copy (a reshape's) is a device-to-device copy;
//! - a builtin kernel with a GPU form (`Instruction::Kernel`'s `gpu`, chosen by codegen) runs
//!   as that form's entries of the plan's PTX: expand, transpose, slice, pad, concat and
//!   split as movement kernels ([`Entry::Movement`]), a gather or scatter-add (the embedding and
//!   its gradient) as an [`Entry::Indexed`] kernel ([`autotp_llvm::indexed`]), a top-k or
//!   scatter-elements (a mixture of experts' routing) as an [`Entry::Axis`] kernel
//!   ([`autotp_llvm::axis`]), a grouped expert GEMM as an [`Entry::Grouped`] kernel
//!   ([`autotp_llvm::grouped`]); an index out of range lands in fault words after the arena, read
//!   when the streams are synchronised and reported as the CPU's kernel reports it;
//! - other builtin kernels (and those matmuls) run on the host: their inputs are
//!   downloaded when the compute stream reaches them, their outputs uploaded in stream order;
//! - collectives run on the device where every rank of their group has NCCL and a GPU of its
//!   own: when the program loads, the ranks of each group share a record (NCCL or not, process,
//!   device) through the host communicator, and, where NCCL serves them all, the group's first
//!   rank makes a communicator id for the others to join (`bootstrap`). Each collective
//!   is then its [`collectives::device_steps`] (NCCL calls, and 2-D copies where a rank's block
//!   is strided) on the collectives stream, overlapping compute until its wait; a shard slice
//!   is a 2-D copy on any path. A failing rank aborts the communicators, and a wait on the
//!   device past `--comm-timeout` does too (`watchdog`);
//! - pipeline messages run on NCCL where both ends of their link (one direction between two
//!   stages) can, each link a communicator of two ranks (`bootstrap`): a send copies its
//!   bytes to a staging buffer of its own on the peer stream, and NCCL sends them from there on
//!   [`Stream::Transfer`], which nothing waits for, so a stage's compute never waits for its
//!   peer to receive; a receive runs on the compute stream between two timed events, whose
//!   interval the run's clock counts as waiting (the stages' idle shares);
//! - other groups and links (ranks sharing one GPU, which NCCL refuses, or without the
//!   library) go through host memory and the rank's communicator in their stream's order,
//!   without overlap; `run` says which path each mesh axis and link took.
//!
//! [`Gpu`] is what a device provides: memory, copies, launches, GEMMs, streams and events. The
//! CUDA driver ([`cuda::CudaGpu`]) is one; [`emulated::Emulator`] is another, which runs on the host with the same
//! kernels compiled for x86 and streams that run nothing until the host needs a result (then
//! only what that result depends on): a missing event or synchronisation in this module reads
//! stale bytes there, so the host logic is tested without a GPU.

pub mod collectives;
pub mod cuda;
pub mod emulated;
mod emulated_nccl;
pub mod gemm;
mod graph;
mod nccl;
mod offload;
mod watchdog;

use graph::StepGraph;
pub use nccl::{bootstrap, CommPath, Link, Paths};

use std::sync::Arc;

use autotp_kernels::grouped::GroupedKernel;
use autotp_kernels::indexed::{IndexedKernel, IndexedOp};
use autotp_kernels::{AlignedBuf, DType, Kernel};
use autotp_program::gpu::GpuForm;

use crate::clock::RankClock;
use crate::comm::Communicator;
use crate::streams::{Device, Stream};
use crate::RuntimeError;
use autotp_program::{Instruction, Program, Region};
use collectives::{Copy2d, DeviceStep, NcclCall};
use gemm::GemmCall;
pub use gemm::{round_to_tf32, GemmMath};

/// A new allocation holding `bytes`.
fn upload_new(gpu: &mut dyn Gpu, bytes: &[u8]) -> Result<u64, RuntimeError> {
    let address = gpu.alloc(bytes.len())?;
    gpu.upload(Stream::Compute, address, bytes)?;
    Ok(address)
}

/// An optimizer step's chunk table as bytes.
fn table_bytes(chunks: &[autotp_kernels::optim::TensorUpdate]) -> &[u8] {
    // SAFETY: `TensorUpdate` is `repr(C)` plain data (integers and addresses), no padding.
    unsafe { std::slice::from_raw_parts(chunks.as_ptr() as *const u8, std::mem::size_of_val(chunks)) }
}

/// Which GPU a rank runs on.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GpuKind {
    /// GPU `ordinal` of the CUDA driver (after `CUDA_VISIBLE_DEVICES`).
    Cuda { ordinal: usize, math: GemmMath },
    /// The [`emulated::Emulator`] (tests of the host side).
    Emulated { math: GemmMath },
}

impl GpuKind {
    /// Opens the GPU with `program`'s kernels loaded.
    pub fn open(self, program: &Program) -> Result<Box<dyn Gpu>, RuntimeError> {
        Ok(match self {
            GpuKind::Cuda { ordinal, math } => Box::new(cuda::CudaGpu::open(ordinal, program, math)?),
            GpuKind::Emulated { math } => Box::new(emulated::Emulator::new(program, math)?),
        })
    }
}

/// A kernel entry of the program's module.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// `Program::kernels[i]`: arguments are its buffers' addresses; one row per block.
    Kernel(usize),
    /// The `i`th of `Program::optimizer_kernels()`: arguments are the chunk table's address,
    /// the number of chunks and the step's scalars' addresses; one chunk per block.
    OptimizerStep(usize),
    /// `GpuKernels::movement[i]` (the program's `gpu_kernels`): as `Kernel`.
    Movement(usize),
    /// `GpuKernels::indexed[i]`: arguments are its `a`, `b` and `out` buffers, the fault
    /// words, the launch's tag and the rank's first row ([`autotp_llvm::indexed`]); one index
    /// row per block.
    Indexed(usize),
    /// `GpuKernels::attention[i]`: arguments are the instruction's buffers, the pass's table and
    /// scratch, and the number of units ([`autotp_llvm::attention`]); a thread per unit.
    Attention(usize),
    /// `GpuKernels::axis[i]`: arguments are the instruction's buffers, the fault words and the
    /// launch's tag where it faults, and the number of items ([`autotp_llvm::axis`]); a thread
    /// per item.
    Axis(usize),
    /// `GpuKernels::grouped[i]`: arguments are the instruction's buffers, the fault words, the
    /// launch's tag, the rank's first expert and the number of items
    /// ([`autotp_llvm::grouped`]); a thread per item.
    Grouped(usize),
}

/// An NCCL communicator's unique id (`ncclUniqueId`): 128 bytes that one rank makes and the
/// others receive through the host communicator.
pub type NcclId = [u8; 128];

/// Which ranks a GPU's NCCL can join in one communicator (never two on one device).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum NcclReach {
    /// The GPU has no NCCL (the library is missing).
    Unavailable,
    /// Ranks that are threads of this process (the emulated GPU's).
    Process,
    /// Ranks anywhere (NCCL itself).
    Anywhere,
}

/// Aborts the communicators a GPU has joined, from any thread, even while another thread waits
/// on them (`ncclCommAbort`): their waiting and later calls fail.
pub type NcclAborter = Box<dyn Fn() + Send + Sync>;

/// An event recorded by a [`Gpu`]: a handle the GPU gave out, valid until its next
/// [`Gpu::synchronize`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GpuEvent(pub usize);

/// What a GPU provides to [`GpuDevice`]. Addresses are device addresses; every operation on a
/// stream runs after those issued on it before, and after the events it was told to wait for.
pub trait Gpu: Send {
    /// A zeroed allocation of `bytes`; it lives as long as the `Gpu`.
    fn alloc(&mut self, bytes: usize) -> Result<u64, RuntimeError>;

    /// Copies `bytes` to `address` in `stream`'s order. The host bytes may be reused at once,
    /// unless they are pinned ([`Gpu::pin_host`]): then the copy reads them when the stream
    /// reaches it, and they must not change before.
    fn upload(&mut self, stream: Stream, address: u64, bytes: &[u8]) -> Result<(), RuntimeError>;

    /// Page-locks `len` host bytes at `address` (`cuMemHostRegister`), which must live longer
    /// than the `Gpu`: copies from and to them run at the bus's full speed, and uploads from them
    /// run in their stream's order without a copy on the host (see [`Gpu::upload`]).
    fn pin_host(&mut self, address: usize, len: usize) -> Result<(), RuntimeError>;

    /// Copies `into.len()` bytes at `address` once `stream` has reached this point, and returns
    /// when they are in `into`.
    fn download(&mut self, stream: Stream, address: u64, into: &mut [u8]) -> Result<(), RuntimeError>;

    /// Copies `len` bytes from `from` to `to` (not overlapping) in `stream`'s order.
    fn copy(&mut self, stream: Stream, from: u64, to: u64, len: usize) -> Result<(), RuntimeError>;

    /// Sets `len` bytes at `address` to zero in `stream`'s order.
    fn zero(&mut self, stream: Stream, address: u64, len: usize) -> Result<(), RuntimeError>;

    /// Launches `entry` on `rows` rows (blocks) with these arguments.
    fn launch(&mut self, stream: Stream, entry: Entry, rows: usize, args: &[u64]) -> Result<(), RuntimeError>;

    /// Runs `call` in `stream`'s order on `operands`, where the GPU has a GEMM library;
    /// `Ok(false)` where it has none (the device then runs the matmul on the host).
    fn gemm(&mut self, stream: Stream, call: &GemmCall, operands: &GemmOperands) -> Result<bool, RuntimeError>;

    fn record(&mut self, stream: Stream) -> Result<GpuEvent, RuntimeError>;
    fn wait(&mut self, stream: Stream, event: GpuEvent) -> Result<(), RuntimeError>;

    /// An event as [`Gpu::record`] records it, which also keeps the time it completes at, for
    /// [`Gpu::elapsed`].
    fn record_timed(&mut self, stream: Stream) -> Result<GpuEvent, RuntimeError>;

    /// The time from timed event `start` to timed event `end`, once `end` has completed (this
    /// waits for it).
    fn elapsed(&mut self, start: GpuEvent, end: GpuEvent) -> Result<std::time::Duration, RuntimeError>;

    /// Returns once every stream has run everything issued on it; events recorded before are
    /// released.
    fn synchronize(&mut self) -> Result<(), RuntimeError>;

    /// Bytes of device memory free and in total (the driver's figures).
    fn memory(&mut self) -> Result<(usize, usize), RuntimeError>;

    /// Copies `copy`'s rows in `stream`'s order.
    fn copy_2d(&mut self, stream: Stream, copy: &Copy2d) -> Result<(), RuntimeError>;

    /// Which ranks this GPU's NCCL can join.
    fn nccl_reach(&mut self) -> NcclReach;

    /// The device's identity: ranks whose GPUs share one cannot share a communicator.
    fn device_uuid(&mut self) -> Result<[u8; 16], RuntimeError>;

    /// A new communicator's id (where [`Gpu::nccl_reach`] allows NCCL).
    fn nccl_id(&mut self) -> Result<NcclId, RuntimeError>;

    /// Joins communicator `id` as `rank` of `ranks` (every rank of it calls this at once, as
    /// `ncclCommInitRank`); returns the communicator's handle for [`Gpu::nccl`].
    fn nccl_join(&mut self, id: &NcclId, ranks: usize, rank: usize) -> Result<usize, RuntimeError>;

    /// Issues `call` on communicator `comm` in `stream`'s order.
    fn nccl(&mut self, stream: Stream, comm: usize, call: &NcclCall) -> Result<(), RuntimeError>;

    /// What aborts the communicators joined so far.
    fn nccl_aborter(&mut self) -> NcclAborter;

    /// Starts capturing a graph (`cuStreamBeginCapture`): what is issued from now on is recorded,
    /// not run. Other streams join the capture when they wait on an event recorded in it;
    /// nothing may be copied from or to the host meanwhile.
    fn begin_capture(&mut self) -> Result<(), RuntimeError>;

    /// Ends the capture, the streams that joined it joined back into the compute stream first,
    /// and returns the graph's handle, ready to run.
    fn end_capture(&mut self) -> Result<usize, RuntimeError>;

    /// Runs captured graph `graph` on the compute stream (`cuGraphLaunch`).
    fn replay(&mut self, graph: usize) -> Result<(), RuntimeError>;
}

/// Where a [`GemmCall`]'s operands lie on the device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmOperands {
    /// The lhs, rhs and output regions: (address, bytes).
    pub lhs: (u64, usize),
    pub rhs: (u64, usize),
    pub out: (u64, usize),
    /// Device arrays of each product's `A`, `B` and `C` addresses (cuBLAS's batched form),
    /// made when the program loads.
    pub pointers: [u64; 3],
}

/// An optimizer step's chunk table in device memory.
struct ChunkTable {
    address: u64,
    chunks: usize,
    /// The step's update rule: its index in `Program::optimizer_kernels()` (its entry).
    rule: usize,
    /// Its tensors whose states are in the host pool, which the host updates.
    offloaded: Option<offload::OffloadedStep>,
}

/// What an instruction needs on the device, made when the program loads.
enum Prepared {
    Nothing,
    /// Movement kernels (`GpuKernels::movement` entries) with their rows and buffers' addresses.
    Movement(Vec<(usize, usize, Vec<u64>)>),
    OptimizerStep(ChunkTable),
    Gemm(Box<(GemmCall, GemmOperands)>),
    Indexed(IndexedLaunch),
    /// Fused attention's passes: each entry with the blocks it launches and its arguments (the
    /// last the units).
    Attention(Vec<(usize, usize, Vec<u64>)>),
    /// A kernel of a thread per item (top-k, scatter-elements, a grouped expert GEMM): its
    /// entry and arguments (the last the items).
    Items(Entry, Vec<u64>),
    /// A collective on the device: its steps, and the NCCL communicator of its mesh axis (none
    /// for a shard slice, which meets no one).
    Collective {
        steps: Vec<DeviceStep>,
        nccl: Option<usize>,
        /// An input in the host pool (an offloaded parameter shard) and the device buffer it
        /// is uploaded to first, which the steps read.
        fetched: Option<(Region, u64)>,
    },
    /// A pipeline send over NCCL: the staging buffer its bytes are copied to (NCCL sends from
    /// there on [`Stream::Transfer`]), and its link's communicator.
    Send {
        staging: u64,
        comm: usize,
    },
    /// A pipeline receive over NCCL, on its link's communicator.
    Recv {
        comm: usize,
    },
}

/// A gather's or scatter-add's launch ([`Entry::Indexed`]).
struct IndexedLaunch {
    entry: usize,
    rows: usize,
    /// The `a`, `b` and `out` buffers' addresses.
    buffers: [u64; 3],
    /// A scatter-add's output, zeroed before the launch.
    zero: Option<(u64, usize)>,
    /// 1 + its index in [`GpuDevice::fault_sources`].
    tag: u64,
    /// The global index of the first row this rank's kernel holds.
    start: u64,
}

/// Bytes after the arena for the indexed kernels' fault words (an index and a tag, i64 each).
const FAULT_BYTES: usize = 16;

/// A program's instructions on a [`Gpu`] (see the module doc).
pub struct GpuDevice {
    /// Locked only to read a slot through a shared reference; the executor's runs use it
    /// through `&mut`.
    gpu: std::sync::Mutex<Box<dyn Gpu>>,
    /// The arena's device address.
    base: u64,
    /// An offloaded optimizer's states, in host memory (ZeRO-Offload; `offload`).
    host_pool: AlignedBuf,
    /// What each instruction (by index) had made for it at load.
    prepared: Vec<Prepared>,
    /// This rank and its communicator, for programs on a mesh.
    rank: Option<(usize, Arc<dyn Communicator>)>,
    /// Collectives issued so far on each mesh axis (their sequence numbers).
    pub(crate) issued: Vec<u64>,
    /// The clock of the run under way (pipeline messages are stamped with it).
    pub(crate) clock: Option<RankClock>,
    /// Device memory the program took when it loaded, by the driver's count of free memory
    /// before and after (the arena, chunk tables, GEMM pointer arrays, the allocator's rounding).
    pub(crate) held_bytes: usize,
    /// The fault words of the indexed kernels (after the arena), and per tag (from 1) the
    /// instruction's label, kernel name and index bound they report an out-of-range index with.
    fault: u64,
    fault_sources: Vec<(String, &'static str, usize)>,
    /// How each mesh axis's collectives travel (empty without a mesh), and each pipeline link's
    /// messages.
    pub(crate) paths: Vec<CommPath>,
    pub(crate) links: Vec<(Link, CommPath)>,
    /// The timed events around each receive over NCCL in the run under way: the time between
    /// them is the compute stream's wait, which the run's clock counts.
    receive_waits: Vec<(GpuEvent, GpuEvent)>,
    /// `--profile`: each instruction's device time so far (from when its stream reaches it to
    /// when its work ends), and the timed events around the instructions of the run under way.
    pub(crate) profile: Option<Vec<std::time::Duration>>,
    timed: Vec<(usize, GpuEvent, GpuEvent)>,
    /// Where infs and NaNs first appeared, while watching for them ([`crate::non_finite`]).
    pub(crate) non_finite: Option<crate::non_finite::NonFiniteTrace>,
    /// Aborts the NCCL communicators joined, when a rank fails.
    aborter: Option<Arc<NcclAborter>>,
    /// Aborts them when a wait on the device lasts past `--comm-timeout` (once it is set).
    watchdog: Option<watchdog::Watchdog>,
    /// Whether steps run as a CUDA graph (`--cuda-graph`), and why they cannot: the first
    /// instruction that needs the host.
    graph: StepGraph,
    capture_blocker: Option<String>,
    /// The bytes this rank's NCCL collectives sent, counted as [`autotp_program::mesh::CommBytes`] counts them, and
    /// those its host communicator sent while the communicators were made.
    pub(crate) nccl_sent: autotp_program::mesh::CommBytes,
    pub(crate) bootstrap_sent: autotp_program::mesh::CommBytes,
}

impl GpuDevice {
    /// Allocates `program`'s arena on `gpu`, uploads its constants and builds its optimizer
    /// steps' chunk tables. `gpu` holds the program's kernels; `program` is validated.
    pub(crate) fn load(
        program: &Program,
        mut gpu: Box<dyn Gpu>,
        rank: Option<(usize, Arc<dyn Communicator>)>,
        mut issued: Vec<u64>,
    ) -> Result<GpuDevice, RuntimeError> {
        if program.memory.nvme_params_bytes > 0 {
            return Err(RuntimeError::Plan(format!(
                "keeps {} bytes of parameters in files (--offload-param nvme), which GPU ranks do not fetch yet: \
                 run it on CPU ranks (--device cpu), or compile with --offload-param cpu",
                program.memory.nvme_params_bytes
            )));
        }
        if let Some(reader) = offload::offloaded_param_reader(program) {
            return Err(RuntimeError::Plan(format!(
                "{reader} reads parameters offloaded to host memory (--offload-param), which GPU ranks fetch only \
                 for their gathers and update only in the host's optimizer step"
            )));
        }
        let (free_before, _) = gpu.memory()?;
        let arena_bytes = program.memory.arena_bytes.next_multiple_of(8);
        let base = gpu.alloc(arena_bytes + FAULT_BYTES)?;
        let fault = base + arena_bytes as u64;
        let mut fault_sources = Vec::new();
        for c in &program.constants {
            gpu.upload(Stream::Compute, base + c.region.offset as u64, &c.bytes)?;
        }
        let gpu_kernels = &program.gpu_kernels;
        let rules = program.optimizer_kernels();
        if issued.len() != program.mesh.len() {
            return Err(RuntimeError::InvalidProgram(format!(
                "a program on {} mesh axes cannot continue the collectives of one on {}",
                program.mesh.len(),
                issued.len()
            )));
        }
        let (mut paths, mut links, mut bootstrap_sent, mut coordinates) =
            (Vec::new(), Vec::new(), Default::default(), Vec::new());
        if let Some((rank, comm)) = &rank {
            let before = comm.bytes_sent(*rank);
            let stage_links = pipeline_links(program, comm.topology().stage(*rank))?;
            let made = bootstrap(gpu.as_mut(), &program.mesh, &stage_links, *rank, comm.as_ref(), &mut issued)?;
            (paths, links) = (made.axes, made.links);
            bootstrap_sent = comm.bytes_sent(*rank).minus(&before);
            coordinates = comm.topology().coordinates(*rank);
        }
        let link_comm = |link: Link| match links.iter().find(|(l, _)| *l == link) {
            Some((_, CommPath::Nccl { comm })) => Some(*comm),
            _ => None,
        };
        let stage = rank.as_ref().map(|(rank, comm)| comm.topology().stage(*rank));
        // The scratch of the strided collectives on the device: they all run on the collectives
        // stream, one after another.
        let scratch_bytes = (program.instructions.iter())
            .filter_map(|i| match i {
                Instruction::Collective { op, .. } | Instruction::CollectiveStart { op, .. } => {
                    Some(op.device_scratch_bytes(program.mesh[op.axis].size))
                }
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let on_nccl = |path: &CommPath| matches!(path, CommPath::Nccl { .. });
        let uses_nccl = paths.iter().chain(links.iter().map(|(_, path)| path)).any(on_nccl);
        // Offloaded parameter shards are uploaded here before NCCL gathers them.
        let fetch_bytes = (program.instructions.iter())
            .filter_map(|i| match i {
                Instruction::Collective { input, .. } | Instruction::CollectiveStart { input, .. } => Some(input),
                _ => None,
            })
            .filter(|input| input.in_host_pool())
            .map(|input| input.len)
            .max()
            .unwrap_or(0);
        let fetch = match paths.iter().any(on_nccl) && fetch_bytes > 0 {
            true => gpu.alloc(fetch_bytes)?,
            false => 0,
        };
        let scratch = match paths.iter().any(on_nccl) && scratch_bytes > 0 {
            true => gpu.alloc(scratch_bytes)?,
            false => 0,
        };
        let mut prepared = Vec::with_capacity(program.instructions.len());
        for instruction in &program.instructions {
            prepared.push(match instruction {
                Instruction::Kernel { inputs, outputs, gpu: Some(GpuForm::Movement(moves)), .. } => {
                    let at = |r: &Region| base + r.offset as u64;
                    let runs = (moves.iter())
                        .map(|run| {
                            let buffers = (run.inputs.iter().map(|&i| at(&inputs[i])))
                                .chain(run.outputs.iter().map(|&o| at(&outputs[o])));
                            (run.kernel, gpu_kernels.movement[run.kernel].outer, buffers.collect())
                        })
                        .collect();
                    Prepared::Movement(runs)
                }
                Instruction::OptimizerStep { optimizer, dtype, tensors, label, .. } => {
                    // The device updates the tensors it holds whole; the host, those offloaded.
                    let resident = tensors.iter().filter(|t| !offload::offloaded(t));
                    if resident.clone().any(|t| t.copy.is_some()) {
                        return Err(RuntimeError::InvalidProgram(format!(
                            "{label}: a tensor updated on the GPU asks for a 16-bit copy"
                        )));
                    }
                    let chunks = crate::optimizer_step::optimizer_chunks(
                        *dtype,
                        resident,
                        crate::optimizer_step::Bases { arena: base as usize, host_pool: 0 },
                    );
                    let address = upload_new(gpu.as_mut(), table_bytes(&chunks))?;
                    let rule = (rules.iter())
                        .position(|k| k.optimizer == *optimizer && k.dtype == *dtype)
                        .expect("the step's rule is among the program's");
                    let offloaded = match tensors.iter().any(offload::offloaded) {
                        true => {
                            let kind =
                                autotp_kernels::optim::OptimizerKernel { optimizer: optimizer.clone(), dtype: *dtype };
                            let kernel =
                                autotp_llvm::compile_cpu_functions(&[autotp_llvm::Function::OptimizerStep(&kind)])
                                    .map_err(|e| RuntimeError::KernelCompile(e.to_string()))?
                                    .remove(0);
                            let group = offload::GROUP_ELEMENTS;
                            Some(offload::OffloadedStep::new(gpu.as_mut(), *dtype, tensors, kernel, group)?)
                        }
                        false => None,
                    };
                    Prepared::OptimizerStep(ChunkTable { address, chunks: chunks.len(), rule, offloaded })
                }
                Instruction::Kernel { kernel, inputs, outputs, label, gpu: Some(GpuForm::Indexed(entry)) } => {
                    let entry = *entry;
                    let shape = &gpu_kernels.indexed[entry];
                    let at = |r: &Region| base + r.offset as u64;
                    fault_sources.push((label.clone(), kernel.name(), shape.global));
                    Prepared::Indexed(IndexedLaunch {
                        entry,
                        rows: shape.rows(),
                        buffers: [at(&inputs[0]), at(&inputs[1]), at(&outputs[0])],
                        zero: (shape.op == IndexedOp::ScatterAdd).then(|| (at(&outputs[0]), outputs[0].len)),
                        tag: fault_sources.len() as u64,
                        start: IndexedKernel::start(kernel) as u64,
                    })
                }
                Instruction::Kernel { inputs, outputs, gpu: Some(GpuForm::Attention(passes)), .. } => {
                    let at = |r: &Region| base + r.offset as u64;
                    let buffers: Vec<u64> = inputs.iter().chain(outputs).map(at).collect();
                    // The passes of one kernel share its shapes: one table and one scratch.
                    let first = &gpu_kernels.attention[passes[0]];
                    let table: Vec<u8> = first.table().iter().flat_map(|x| x.to_le_bytes()).collect();
                    let table = upload_new(gpu.as_mut(), &table)?;
                    let scratch = gpu.alloc(first.dims.query_rows() * 4)?;
                    let launches = (passes.iter())
                        .map(|&entry| {
                            let function = &gpu_kernels.attention[entry];
                            let mut args = buffers.clone();
                            args.extend([table, scratch, function.units() as u64]);
                            let threads = function.units() * function.threads_per_unit();
                            (entry, threads.div_ceil(autotp_llvm::nvptx::BLOCK as usize), args)
                        })
                        .collect();
                    Prepared::Attention(launches)
                }
                Instruction::Collective { op, input, output, label }
                | Instruction::CollectiveStart { op, input, output, label }
                    if !coordinates.is_empty() =>
                {
                    let nccl = match paths.get(op.axis) {
                        Some(CommPath::Nccl { comm }) => Some(*comm),
                        _ => None,
                    };
                    let shard_slice = matches!(op.kind, autotp_program::mesh::Collective::ShardSlice { .. });
                    match nccl.is_some() || shard_slice {
                        true => {
                            let fetched = input.in_host_pool().then_some((*input, fetch));
                            let at = collectives::Operands {
                                input: fetched.map_or(base + input.offset as u64, |(_, to)| to),
                                output: base + output.offset as u64,
                                scratch,
                            };
                            let n = program.mesh[op.axis].size;
                            let steps =
                                collectives::device_steps(op, n, coordinates[op.axis], at).ok_or_else(|| {
                                    RuntimeError::InvalidProgram(format!(
                                        "{label}: {} of {:?} over {n} ranks",
                                        op.kind.name(),
                                        op.shape
                                    ))
                                })?;
                            Prepared::Collective { steps, nccl: nccl.filter(|_| !shard_slice), fetched }
                        }
                        false => Prepared::Nothing,
                    }
                }
                Instruction::Send { input, to, .. } => match stage.and_then(|from| link_comm(Link { from, to: *to })) {
                    Some(comm) => Prepared::Send { staging: gpu.alloc(input.len)?, comm },
                    None => Prepared::Nothing,
                },
                Instruction::Recv { from, .. } => match stage.and_then(|to| link_comm(Link { from: *from, to })) {
                    Some(comm) => Prepared::Recv { comm },
                    None => Prepared::Nothing,
                },
                Instruction::Kernel { kernel, inputs, outputs, label, gpu: Some(GpuForm::Axis(entry)) } => {
                    let form = &gpu_kernels.axis[*entry];
                    let mut args: Vec<u64> = inputs.iter().chain(outputs).map(|r| base + r.offset as u64).collect();
                    if form.faults() {
                        fault_sources.push((label.clone(), kernel.name(), form.out_len));
                        args.extend([fault, fault_sources.len() as u64]);
                    }
                    args.push(form.items() as u64);
                    Prepared::Items(Entry::Axis(*entry), args)
                }
                Instruction::Kernel { kernel, inputs, outputs, label, gpu: Some(GpuForm::Grouped(entry)) } => {
                    let form = &gpu_kernels.grouped[*entry];
                    let mut args: Vec<u64> = inputs.iter().chain(outputs).map(|r| base + r.offset as u64).collect();
                    fault_sources.push((label.clone(), kernel.name(), form.global_experts()));
                    args.extend([fault, fault_sources.len() as u64, GroupedKernel::start(kernel) as u64]);
                    args.push(form.items() as u64);
                    Prepared::Items(Entry::Grouped(*entry), args)
                }
                Instruction::Kernel { kernel: Kernel::MatMul { dtype, dims }, inputs, outputs, .. } => {
                    match GemmCall::of(*dtype, dims) {
                        Some(call) => {
                            let at = |r: &Region| (base + r.offset as u64, r.len);
                            let (lhs, rhs, out) = (at(&inputs[0]), at(&inputs[1]), at(&outputs[0]));
                            let size = dtype.size() as u64;
                            let mut pointers = [0; 3];
                            for (which, start) in [rhs.0, lhs.0, out.0].into_iter().enumerate() {
                                let list: Vec<u8> = (call.products.iter())
                                    .flat_map(|p| (start + p[which] as u64 * size).to_le_bytes())
                                    .collect();
                                pointers[which] = upload_new(gpu.as_mut(), &list)?;
                            }
                            Prepared::Gemm(Box::new((call, GemmOperands { lhs, rhs, out, pointers })))
                        }
                        None => Prepared::Nothing,
                    }
                }
                _ => Prepared::Nothing,
            });
        }
        gpu.synchronize()?;
        let (free_after, _) = gpu.memory()?;
        let held_bytes = free_before.saturating_sub(free_after);
        let aborter = uses_nccl.then(|| Arc::new(gpu.nccl_aborter()));
        let capture_blocker = graph::capture_blocker(program, &prepared, &paths);
        Ok(GpuDevice {
            gpu: std::sync::Mutex::new(gpu),
            base,
            host_pool: AlignedBuf::zeroed(program.memory.host_pool_bytes),
            prepared,
            rank,
            issued,
            clock: None,
            held_bytes,
            fault,
            fault_sources,
            paths,
            links,
            receive_waits: Vec::new(),
            profile: None,
            non_finite: None,
            timed: Vec::new(),
            aborter,
            watchdog: None,
            graph: StepGraph::Off,
            capture_blocker,
            nccl_sent: Default::default(),
            bootstrap_sent,
        })
    }

    fn communicator(&self, label: &str) -> Result<(usize, Arc<dyn Communicator>), RuntimeError> {
        let (rank, comm) = (self.rank.as_ref())
            .ok_or_else(|| RuntimeError::InvalidProgram(format!("{label}: communication needs a communicator")))?;
        Ok((*rank, comm.clone()))
    }

    fn gpu(&mut self) -> &mut dyn Gpu {
        self.gpu.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()).as_mut()
    }

    fn address(&self, region: &Region) -> u64 {
        self.base + region.offset as u64
    }

    /// Copies `bytes` into `region` in the compute stream's order.
    pub(crate) fn upload_region(&mut self, region: &Region, bytes: &[u8]) -> Result<(), RuntimeError> {
        if region.in_host_pool() {
            let at = region.offset - autotp_program::HOST_POOL;
            self.host_pool.as_mut_slice()[at..at + region.len].copy_from_slice(bytes);
            return Ok(());
        }
        let address = self.address(region);
        self.gpu().upload(Stream::Compute, address, bytes)
    }

    /// The bytes of `region` once `stream` has reached this point.
    pub(crate) fn download_region(&self, stream: Stream, region: &Region) -> Result<Vec<u8>, RuntimeError> {
        if region.in_host_pool() {
            let at = region.offset - autotp_program::HOST_POOL;
            return Ok(self.host_pool.as_slice()[at..at + region.len].to_vec());
        }
        let mut bytes = vec![0; region.len];
        let mut gpu = self.gpu.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        self.waiting(|| gpu.download(stream, self.address(region), &mut bytes))?;
        Ok(bytes)
    }

    /// Runs `wait`, a wait on the device, under the NCCL watchdog where there is one.
    fn waiting<T>(&self, wait: impl FnOnce() -> Result<T, RuntimeError>) -> Result<T, RuntimeError> {
        match &self.watchdog {
            Some(watchdog) => watchdog.waiting(wait),
            None => wait(),
        }
    }

    /// Starts the NCCL watchdog (see [`watchdog`]) with `timeout`, where the device uses NCCL.
    pub(crate) fn set_comm_timeout(&mut self, timeout: std::time::Duration) {
        self.watchdog = self.aborter.clone().map(|abort| watchdog::Watchdog::start(abort, timeout));
    }

    /// Applies a step's updates (device-to-device copies) in the compute stream's order.
    pub(crate) fn apply_updates(&mut self, updates: &[autotp_program::Update]) -> Result<(), RuntimeError> {
        for u in updates {
            let (from, to) = (self.address(&u.from), self.address(&u.to));
            if from != to {
                self.gpu().copy(Stream::Compute, from, to, u.from.len)?;
            }
        }
        Ok(())
    }
}

impl Device for GpuDevice {
    type Event = GpuEvent;

    fn launch(&mut self, program: &Program, index: usize, stream: Stream) -> Result<(), RuntimeError> {
        let before = self.profile.is_some().then(|| self.gpu().record_timed(stream)).transpose()?;
        let mut watch = self.non_finite.take();
        // Downloaded in the stream's order: after the work that wrote them.
        let non_finite = |device: &GpuDevice, region: &Region, dtype: DType| {
            Ok(dtype.first_non_finite(&device.download_region(stream, region)?).is_some())
        };
        if let Some(watch) = watch.as_mut() {
            watch.before(program, index, |region, dtype| non_finite(self, region, dtype))?;
        }
        self.launch_instruction(program, index, stream).map_err(|e| match e {
            RuntimeError::Device(message) => RuntimeError::Device(format!(
                "instruction {index} ({}): {message}",
                program.instructions[index].label()
            )),
            other => other,
        })?;
        if let Some(watch) = watch.as_mut() {
            watch.after(program, index, |region, dtype| non_finite(self, region, dtype))?;
        }
        self.non_finite = watch;
        if let Some(before) = before {
            let after = self.gpu().record_timed(stream)?;
            self.timed.push((index, before, after));
        }
        Ok(())
    }

    fn record(&mut self, stream: Stream) -> Result<GpuEvent, RuntimeError> {
        self.gpu().record(stream)
    }

    fn wait(&mut self, stream: Stream, event: &GpuEvent) -> Result<(), RuntimeError> {
        self.gpu().wait(stream, *event)
    }

    /// Also reports an index out of range that an indexed kernel met (see
    /// [`autotp_llvm::indexed`]), as the CPU's kernel would have, and clears it.
    ///
    /// The compute stream's waits for messages over NCCL are added to the run's clock.
    fn synchronize(&mut self) -> Result<(), RuntimeError> {
        let gpu = self.gpu.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
        let receive_waits = std::mem::take(&mut self.receive_waits);
        let timed = std::mem::take(&mut self.timed);
        let profile = &mut self.profile;
        let mut finish = || -> Result<std::time::Duration, RuntimeError> {
            let mut waited = std::time::Duration::ZERO;
            for &(before, after) in &receive_waits {
                waited += gpu.elapsed(before, after)?;
            }
            if let Some(times) = profile.as_mut() {
                for &(index, before, after) in &timed {
                    times[index] += gpu.elapsed(before, after)?;
                }
            }
            gpu.synchronize()?;
            Ok(waited)
        };
        let waited = match &self.watchdog {
            Some(watchdog) => watchdog.waiting(finish)?,
            None => finish()?,
        };
        if let Some(clock) = &mut self.clock {
            clock.waited_on_device(waited);
        }
        if self.fault_sources.is_empty() {
            return Ok(());
        }
        let mut words = [0u8; FAULT_BYTES];
        let fault = self.fault;
        self.gpu().download(Stream::Compute, fault, &mut words)?;
        let [index, tag] = [0, 8].map(|at| i64::from_le_bytes(words[at..at + 8].try_into().expect("8 bytes")));
        if tag == 0 {
            return Ok(());
        }
        self.gpu().upload(Stream::Compute, fault, &[0; FAULT_BYTES])?;
        let (label, kernel, bound) =
            usize::try_from(tag - 1).ok().and_then(|source| self.fault_sources.get(source)).ok_or_else(|| {
                RuntimeError::Device(format!("an indexed kernel reported fault tag {tag}, which none has"))
            })?;
        Err(RuntimeError::Kernel {
            label: label.clone(),
            source: autotp_kernels::KernelError::IndexOutOfRange { kernel, index, bound: *bound },
        })
    }

    fn abort(&mut self, error: &RuntimeError) {
        if let Some(abort) = &self.aborter {
            abort();
        }
        if let Some((rank, comm)) = &self.rank {
            comm.abort(*rank, error);
        }
        self.receive_waits.clear();
        self.timed.clear();
        let _ = self.gpu().synchronize();
    }
}

impl GpuDevice {
    /// [`Device::launch`] without the instruction named in its errors.
    fn launch_instruction(&mut self, program: &Program, index: usize, stream: Stream) -> Result<(), RuntimeError> {
        match &program.instructions[index] {
            Instruction::Generated { kernel, inputs, outputs, .. } => {
                let args: Vec<u64> = inputs.iter().chain(outputs).map(|r| self.address(r)).collect();
                self.gpu().launch(stream, Entry::Kernel(*kernel), program.kernels[*kernel].outer, &args)
            }
            Instruction::Kernel { kernel, inputs, outputs, label, .. } => {
                if let (Kernel::Copy, [input], [output]) = (kernel, inputs.as_slice(), outputs.as_slice()) {
                    let (from, to) = (self.address(input), self.address(output));
                    return self.gpu().copy(stream, from, to, output.len);
                }
                let gpu = self.gpu.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
                match &self.prepared[index] {
                    Prepared::Movement(runs) => {
                        for (k, rows, buffers) in runs {
                            gpu.launch(stream, Entry::Movement(*k), *rows, buffers)?;
                        }
                        return Ok(());
                    }
                    Prepared::Gemm(gemm) if gpu.gemm(stream, &gemm.0, &gemm.1)? => return Ok(()),
                    Prepared::Attention(launches) => {
                        for (entry, blocks, args) in launches {
                            gpu.launch(stream, Entry::Attention(*entry), *blocks, args)?;
                        }
                        return Ok(());
                    }
                    Prepared::Items(entry, args) => {
                        let items = *args.last().expect("the items") as usize;
                        let blocks = items.div_ceil(autotp_llvm::nvptx::BLOCK as usize);
                        return gpu.launch(stream, *entry, blocks, args);
                    }
                    Prepared::Indexed(launch) => {
                        if let Some((address, len)) = launch.zero {
                            gpu.zero(stream, address, len)?;
                        }
                        let [a, b, out] = launch.buffers;
                        let args = [a, b, out, self.fault, launch.tag, launch.start];
                        return gpu.launch(stream, Entry::Indexed(launch.entry), launch.rows, &args);
                    }
                    _ => {}
                }
                // Kernels write typed elements: their host buffers are aligned, as the arena is.
                let ins = (inputs.iter())
                    .map(|r| Ok(AlignedBuf::from_bytes(&self.download_region(stream, r)?)))
                    .collect::<Result<Vec<_>, RuntimeError>>()?;
                let mut outs: Vec<AlignedBuf> = outputs.iter().map(|r| AlignedBuf::zeroed(r.len)).collect();
                let in_slices: Vec<&[u8]> = ins.iter().map(AlignedBuf::as_slice).collect();
                let mut out_slices: Vec<&mut [u8]> = outs.iter_mut().map(AlignedBuf::as_mut_slice).collect();
                kernel
                    .run(&in_slices, &mut out_slices)
                    .map_err(|source| RuntimeError::Kernel { label: label.clone(), source })?;
                for (region, bytes) in outputs.iter().zip(&outs) {
                    let address = self.address(region);
                    self.gpu().upload(stream, address, bytes.as_slice())?;
                }
                Ok(())
            }
            Instruction::OptimizerStep { scalars, guard, dtype, tensors, label, .. } => {
                let Prepared::OptimizerStep(table) = &self.prepared[index] else {
                    unreachable!("a table per optimizer step, made at load")
                };
                // A guarded step whose guard is false (non-finite gradients) leaves everything:
                // the kernel reads the guard on the device; the host's part of an offloaded
                // step needs it here.
                if let (Some(guard), Some(_)) = (guard, &table.offloaded) {
                    if self.download_region(stream, guard)?[0] == 0 {
                        return Ok(());
                    }
                }
                let gpu = self.gpu.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
                if table.chunks > 0 {
                    let mut args = vec![table.address, table.chunks as u64];
                    args.extend(scalars.iter().map(|r| self.base + r.offset as u64));
                    args.push(guard.as_ref().map_or(0, |r| self.base + r.offset as u64));
                    gpu.launch(stream, Entry::OptimizerStep(table.rule), table.chunks, &args)?;
                }
                let Some(offloaded) = &table.offloaded else { return Ok(()) };
                let mut values = Vec::with_capacity(scalars.len());
                for region in scalars {
                    let mut value = AlignedBuf::zeroed(region.len);
                    gpu.download(stream, self.base + region.offset as u64, value.as_mut_slice())?;
                    values.push(value);
                }
                let host_pool = self.host_pool.as_mut_slice();
                offloaded.run(&self.gpu, stream, self.base, host_pool, *dtype, tensors, &values, label)
            }
            Instruction::Wait { .. } => Ok(()),
            // Until NCCL, communication goes through host memory, in the stream's order: a
            // started collective is done by the time its launch returns.
            Instruction::Collective { op, input, .. } | Instruction::CollectiveStart { op, input, .. }
                if matches!(self.prepared[index], Prepared::Collective { .. }) =>
            {
                let Prepared::Collective { steps, nccl, fetched } = &self.prepared[index] else {
                    unreachable!("matched")
                };
                let gpu = self.gpu.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
                if let Some((region, to)) = fetched {
                    // From pageable memory: the driver takes the bytes before this returns.
                    let at = region.offset - autotp_program::HOST_POOL;
                    gpu.upload(stream, *to, &self.host_pool.as_slice()[at..at + region.len])?;
                }
                for step in steps {
                    match (step, nccl) {
                        (DeviceStep::Copy2d(copy), _) => gpu.copy_2d(stream, copy)?,
                        (DeviceStep::Nccl(call), Some(comm)) => gpu.nccl(stream, *comm, call)?,
                        (DeviceStep::Nccl(_), None) => unreachable!("a shard slice has no NCCL call"),
                    }
                }
                if nccl.is_some() {
                    self.nccl_sent.count(op.kind, input.len, program.mesh[op.axis].size);
                }
                Ok(())
            }
            Instruction::Collective { op, input, output, label }
            | Instruction::CollectiveStart { op, input, output, label } => {
                let (rank, comm) = self.communicator(label)?;
                let seq = crate::executor::next_seq(&mut self.issued, op);
                let sent = self.download_region(stream, input)?;
                let mut received = vec![0; output.len];
                comm.collective(rank, op, seq, &sent, &mut received)?;
                let address = self.address(output);
                self.gpu().upload(stream, address, &received)
            }
            Instruction::Send { input, .. } if matches!(self.prepared[index], Prepared::Send { .. }) => {
                let Prepared::Send { staging, comm } = self.prepared[index] else { unreachable!("matched") };
                let address = self.address(input);
                let gpu = self.gpu.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
                gpu.copy(stream, address, staging, input.len)?;
                let staged = gpu.record(stream)?;
                gpu.wait(Stream::Transfer, staged)?;
                gpu.nccl(Stream::Transfer, comm, &NcclCall::Send { send: staging, bytes: input.len, peer: 1 })?;
                self.nccl_sent.send += input.len;
                Ok(())
            }
            Instruction::Recv { output, .. } if matches!(self.prepared[index], Prepared::Recv { .. }) => {
                let Prepared::Recv { comm } = self.prepared[index] else { unreachable!("matched") };
                let address = self.address(output);
                let gpu = self.gpu.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
                let before = gpu.record_timed(stream)?;
                gpu.nccl(stream, comm, &NcclCall::Recv { recv: address, bytes: output.len, peer: 0 })?;
                let after = gpu.record_timed(stream)?;
                self.receive_waits.push((before, after));
                Ok(())
            }
            Instruction::Send { input, to, tag, label } => {
                let (rank, comm) = self.communicator(label)?;
                let bytes = self.download_region(stream, input)?;
                let now = self.clock.as_mut().expect("set for the run").now()?;
                comm.send(rank, *to, *tag, &bytes, now)
            }
            Instruction::Recv { output, from, tag, label } => {
                let (rank, comm) = self.communicator(label)?;
                let mut bytes = vec![0; output.len];
                let waiting = std::time::Instant::now();
                let sent_at = comm.recv(rank, *from, *tag, &mut bytes)?;
                self.clock.as_mut().expect("set for the run").received(sent_at, waiting.elapsed())?;
                let address = self.address(output);
                self.gpu().upload(stream, address, &bytes)
            }
        }
    }
}

/// The pipeline links (see [`Link`]) that `program`, on stage `stage`, sends or receives over;
/// refused where a message's tag is one of those that set links up.
fn pipeline_links(program: &Program, stage: usize) -> Result<Vec<Link>, RuntimeError> {
    let mut links = Vec::new();
    for instruction in &program.instructions {
        let (link, tag, label) = match instruction {
            Instruction::Send { to, tag, label, .. } => (Link { from: stage, to: *to }, *tag, label),
            Instruction::Recv { from, tag, label, .. } => (Link { from: *from, to: stage }, *tag, label),
            _ => continue,
        };
        if tag >= nccl::LINK_RECORD_TAG {
            return Err(RuntimeError::InvalidProgram(format!("{label}: message tag {tag} is reserved")));
        }
        links.push(link);
    }
    Ok(links)
}
