//! A [`Gpu`] on the host, for testing [`super::GpuDevice`] without a GPU.
//!
//! Device memory is host memory (a device address is a host address); the program's kernels
//! are the same kernel IR compiled for x86 (launched over all their rows, as a grid of one block
//! per row would run them), fused attention's passes and the top-ks and scatter-elements the
//! same descriptions compiled for x86, gathers, scatter-adds and grouped expert GEMMs their
//! builtin kernels (`autotp_llvm::grouped` tests the latter's GPU form against it). Streams are
//! lazy: an operation is queued and runs only when the host needs its result (a download, a
//! synchronisation), and then only the operations that result depends on by stream order and
//! events, in that order. So a result read without the wait or synchronisation that
//! orders it after its producer comes out stale, as it may on a GPU, but deterministically.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use autotp_kernels::AlignedBuf;
use autotp_llvm::CpuKernel;

use autotp_kernels::grouped::GroupedKernel;
use autotp_kernels::indexed::IndexedKernel;
use autotp_kernels::{DType, Kernel};

use super::collectives::{Copy2d, NcclCall};
use super::emulated_nccl::{self, Group};
use super::gemm::GemmCall;
use super::{round_to_tf32, Entry, GemmMath, GemmOperands, Gpu, GpuEvent, NcclAborter, NcclId, NcclReach};
use crate::streams::Stream;
use crate::RuntimeError;
use autotp_program::Program;

type Work = Arc<dyn Fn() -> Result<(), RuntimeError> + Send + Sync>;

#[derive(Clone)]
enum Op {
    Run(Work),
    /// A point-to-point receive: before it waits for its message, the sends issued before it
    /// (on [`Stream::Transfer`], up to this event) run, as they would meanwhile on a GPU.
    Receive {
        sends_before: usize,
        work: Work,
    },
    Signal(usize),
    WaitFor(usize),
}

/// An event: when it completed (if it has), and the stream it was recorded on.
#[derive(Clone, Copy)]
struct Event {
    done: Option<std::time::Instant>,
    stream: Stream,
}

/// The emulated GPU (see the module doc).
pub struct Emulator {
    allocations: Vec<AlignedBuf>,
    kernels: Vec<CpuKernel>,
    optimizer_steps: Vec<CpuKernel>,
    movement: Vec<CpuKernel>,
    /// The program's gathers and scatter-adds, run by their builtin kernels.
    indexed: Vec<IndexedKernel>,
    /// The program's grouped expert GEMMs, run by their builtin kernels.
    grouped: Vec<GroupedKernel>,
    /// Fused attention's passes, compiled for x86 from the GPU's descriptions.
    attention: Vec<CpuKernel>,
    /// Top-ks and scatter-elements, the GPU's code compiled for x86.
    axis: Vec<CpuKernel>,
    queues: [VecDeque<Op>; Stream::ALL.len()],
    events: Vec<Event>,
    /// What ran on it, shared with whoever asks (the emulator itself moves into an executor).
    pub counts: Arc<Counts>,
    math: GemmMath,
    /// This emulated device's identity (its process and a count).
    uuid: [u8; 16],
    /// The graph being captured, and those captured (see [`Capture`]).
    capturing: Option<Capture>,
    graphs: Vec<Capture>,
    /// The communicators joined: the group, this GPU's rank in it, and its calls run so far
    /// (a call takes its number when it runs, so a replayed graph's calls are numbered anew).
    communicators: Vec<(Arc<Group>, usize, Arc<std::sync::atomic::AtomicU64>)>,
    /// Host memory pinned by [`Gpu::pin_host`]: (address, bytes).
    pinned: Vec<(usize, usize)>,
}

/// A captured graph: each stream's operations, their events numbered from 0 in the capture, and
/// the stream each of those events is recorded on. Replaying it queues the operations again
/// with fresh events. The rules of CUDA's stream capture are enforced, so the device's capture
/// is tested here: a stream other than the compute stream joins by waiting on a captured event
/// before anything else, an event from before the capture is never waited on, and nothing is
/// copied from or to the host.
#[derive(Clone, Default)]
struct Capture {
    ops: [Vec<Op>; Stream::ALL.len()],
    events: Vec<Stream>,
}

/// The bit that marks an event recorded while capturing (numbered in its capture).
const CAPTURED: usize = 1 << 40;

/// Work issued to an [`Emulator`] so far.
#[derive(Debug, Default)]
pub struct Counts {
    /// Kernel launches (generated kernels and optimizer steps).
    pub launches: AtomicUsize,
    /// GEMMs (matmuls that would run on cuBLAS).
    pub gemms: AtomicUsize,
    /// Copies to the host (each waits for its stream).
    pub downloads: AtomicUsize,
}

impl Emulator {
    /// An emulated GPU holding `program`'s kernels (compiled for this CPU), its f32 GEMMs
    /// multiplying as `math` says.
    pub fn new(program: &Program, math: GemmMath) -> Result<Emulator, RuntimeError> {
        let steps = program.optimizer_kernels();
        let movement = &program.gpu_kernels.movement;
        let functions: Vec<autotp_llvm::Function> = (program.kernels.iter().map(autotp_llvm::Function::Kernel))
            .chain(steps.iter().map(autotp_llvm::Function::OptimizerStep))
            .chain(movement.iter().map(autotp_llvm::Function::Kernel))
            .chain(program.gpu_kernels.attention.iter().map(autotp_llvm::Function::Attention))
            .chain(program.gpu_kernels.axis.iter().map(autotp_llvm::Function::Axis))
            .collect();
        let mut kernels = match functions.is_empty() {
            true => Vec::new(),
            false => autotp_llvm::compile_cpu_functions(&functions)
                .map_err(|e| RuntimeError::KernelCompile(e.to_string()))?,
        };
        let axis = kernels.split_off(kernels.len() - program.gpu_kernels.axis.len());
        let attention = kernels.split_off(program.kernels.len() + steps.len() + movement.len());
        let movement = kernels.split_off(program.kernels.len() + steps.len());
        let optimizer_steps = kernels.split_off(program.kernels.len());
        Ok(Emulator {
            allocations: Vec::new(),
            kernels,
            optimizer_steps,
            movement,
            indexed: program.gpu_kernels.indexed.clone(),
            grouped: program.gpu_kernels.grouped.clone(),
            attention,
            axis,
            queues: Default::default(),
            events: Vec::new(),
            counts: Arc::default(),
            math,
            uuid: {
                static DEVICES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let mut uuid = [0u8; 16];
                uuid[..4].copy_from_slice(&std::process::id().to_le_bytes());
                uuid[8..].copy_from_slice(&DEVICES.fetch_add(1, Ordering::Relaxed).to_le_bytes());
                uuid
            },
            communicators: Vec::new(),
            pinned: Vec::new(),
            capturing: None,
            graphs: Vec::new(),
        })
    }

    /// Bytes allocated so far.
    pub fn allocated(&self) -> usize {
        self.allocations.iter().map(AlignedBuf::len).sum()
    }

    /// Checks that `[address, address + len)` lies in one allocation.
    fn check(&self, address: u64, len: usize) -> Result<(), RuntimeError> {
        let inside = self.allocations.iter().any(|a| {
            let start = a.as_slice().as_ptr() as u64;
            address >= start && address + len as u64 <= start + a.len() as u64
        });
        match inside {
            true => Ok(()),
            false => Err(RuntimeError::Device(format!("emulated GPU: {len} bytes at {address:#x} are not allocated"))),
        }
    }

    fn queue(&mut self, stream: Stream, work: Work) -> Result<(), RuntimeError> {
        self.push(stream, Op::Run(work))
    }

    /// Queues `op` on `stream`, or records it in the capture under way.
    fn push(&mut self, stream: Stream, op: Op) -> Result<(), RuntimeError> {
        match &mut self.capturing {
            None => self.queues[stream as usize].push_back(op),
            Some(capture) => {
                let ops = &mut capture.ops[stream as usize];
                if stream != Stream::Compute && ops.is_empty() && !matches!(op, Op::WaitFor(_)) {
                    return Err(RuntimeError::Device(format!(
                        "emulated GPU: the {} stream is used in a capture before it waits on a captured event",
                        stream.name()
                    )));
                }
                ops.push(op);
            }
        }
        Ok(())
    }

    /// Refuses a host copy while capturing (a graph cannot hold one from pageable memory).
    fn no_capture(&self, what: &str) -> Result<(), RuntimeError> {
        match self.capturing {
            Some(_) => Err(RuntimeError::Device(format!("emulated GPU: {what} while capturing a graph"))),
            None => Ok(()),
        }
    }

    /// Runs the next operation of `stream`, or, when it waits for an event not yet complete,
    /// the next of the stream that event was recorded on.
    fn run_next(&mut self, stream: Stream, depth: usize) -> Result<(), RuntimeError> {
        if depth > Stream::ALL.len() {
            return Err(RuntimeError::Device("emulated GPU: the streams wait for each other (deadlock)".into()));
        }
        if let Some(Op::WaitFor(event)) = self.queues[stream as usize].front() {
            let Event { done, stream: recorded_on } = self.events[*event];
            if done.is_none() {
                return self.run_next(recorded_on, depth + 1);
            }
        }
        match self.queues[stream as usize].pop_front() {
            Some(Op::Run(work)) => work(),
            Some(Op::Receive { sends_before, work }) => {
                // Those sends wait on nothing after this receive in its stream's order.
                while self.events[sends_before].done.is_none() {
                    self.run_next(Stream::Transfer, 0)?;
                }
                work()
            }
            Some(Op::Signal(event)) => {
                self.events[event].done = Some(std::time::Instant::now());
                Ok(())
            }
            Some(Op::WaitFor(_)) => Ok(()),
            None => Err(RuntimeError::Device(format!(
                "emulated GPU: the {} stream waits for an event that is never reached",
                stream.name()
            ))),
        }
    }

    /// A gather or scatter-add ([`Entry::Indexed`]): its builtin kernel over the device
    /// buffers; an index out of range goes to the fault words, as on a GPU.
    fn launch_indexed(&mut self, stream: Stream, entry: usize, args: &[u64]) -> Result<(), RuntimeError> {
        let shape = (self.indexed.get(entry).cloned())
            .ok_or_else(|| RuntimeError::Device(format!("emulated GPU: no indexed entry {entry}")))?;
        let &[a, b, out, fault, tag, start] = args else {
            return Err(RuntimeError::Device("emulated GPU: an indexed kernel takes 6 arguments".into()));
        };
        let [a_len, b_len, out_len] = shape.buffer_bytes();
        self.launch_builtin(
            stream,
            shape.builtin(start as usize),
            &[(a, a_len), (b, b_len), (out, out_len)],
            [fault, tag],
        )
    }

    fn launch_grouped(&mut self, stream: Stream, entry: usize, args: &[u64]) -> Result<(), RuntimeError> {
        let form = (self.grouped.get(entry).cloned())
            .ok_or_else(|| RuntimeError::Device(format!("emulated GPU: no grouped entry {entry}")))?;
        let &[a, b, c, out, fault, tag, start, items] = args else {
            return Err(RuntimeError::Device("emulated GPU: a grouped kernel takes 8 arguments".into()));
        };
        if items as usize != form.items() {
            return Err(RuntimeError::Device(format!(
                "emulated GPU: grouped entry {entry} has {} items",
                form.items()
            )));
        }
        let buffers: Vec<(u64, usize)> = [a, b, c, out].into_iter().zip(form.buffer_bytes()).collect();
        self.launch_builtin(stream, form.builtin(start as usize), &buffers, [fault, tag])
    }

    /// Queues `kernel` over `buffers` (its inputs, then its one output) in place of a GPU form
    /// that reports an index out of range in the fault words `[fault, tag]` say.
    fn launch_builtin(
        &mut self,
        stream: Stream,
        kernel: Kernel,
        buffers: &[(u64, usize)],
        [fault, tag]: [u64; 2],
    ) -> Result<(), RuntimeError> {
        for &(address, len) in buffers.iter().chain(&[(fault, 16)]) {
            self.check(address, len)?;
        }
        let Some((&(out, out_len), inputs)) = buffers.split_last() else {
            return Err(RuntimeError::Device("emulated GPU: a builtin kernel without buffers".into()));
        };
        let inputs = inputs.to_vec();
        self.counts.launches.fetch_add(1, Ordering::Relaxed);
        self.queue(
            stream,
            Arc::new(move || {
                // SAFETY: checked to lie in allocations; the device's regions of one
                // instruction, whose output overlaps none of its inputs.
                let ins: Vec<&[u8]> = inputs
                    .iter()
                    .map(|&(at, len)| unsafe { std::slice::from_raw_parts(at as *const u8, len) })
                    .collect();
                let out = unsafe { std::slice::from_raw_parts_mut(out as *mut u8, out_len) };
                match kernel.run(&ins, &mut [out]) {
                    Ok(()) => Ok(()),
                    Err(autotp_kernels::KernelError::IndexOutOfRange { index, .. }) => {
                        let words = fault as *mut i64;
                        // SAFETY: checked: 16 bytes of an allocation, 8-aligned after the arena.
                        unsafe {
                            if *words.add(1) == 0 {
                                *words = index;
                                *words.add(1) = tag as i64;
                            }
                        }
                        Ok(())
                    }
                    Err(e) => Err(RuntimeError::Device(format!("emulated GPU: {e}"))),
                }
            }),
        )
    }

    /// When recorded event `event` completed, running its stream up to it first.
    fn reached(&mut self, event: usize) -> Result<std::time::Instant, RuntimeError> {
        loop {
            if let Some(at) = self.events[event].done {
                return Ok(at);
            }
            self.run_next(self.events[event].stream, 0)?;
        }
    }

    fn drain(&mut self, stream: Stream) -> Result<(), RuntimeError> {
        while !self.queues[stream as usize].is_empty() {
            self.run_next(stream, 0)?;
        }
        Ok(())
    }
}

impl Gpu for Emulator {
    fn alloc(&mut self, bytes: usize) -> Result<u64, RuntimeError> {
        let buffer = AlignedBuf::zeroed(bytes.max(1));
        let address = buffer.as_slice().as_ptr() as u64;
        self.allocations.push(buffer);
        Ok(address)
    }

    /// From pinned memory the copy reads the host bytes when it runs, as a GPU's does, so bytes
    /// changed before their stream reaches the copy arrive changed here too.
    fn upload(&mut self, stream: Stream, address: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.no_capture("an upload from the host")?;
        self.check(address, bytes.len())?;
        let (from, len) = (bytes.as_ptr() as usize, bytes.len());
        let pinned = self.pinned.iter().any(|&(start, pinned)| from >= start && from + len <= start + pinned);
        let copied = (!pinned).then(|| bytes.to_vec());
        // SAFETY: checked to lie in an allocation, which lives as long as the emulator; pinned
        // host memory outlives it too (`Gpu::pin_host`).
        self.queue(
            stream,
            Arc::new(move || {
                let from = copied.as_ref().map_or(from as *const u8, |c| c.as_ptr());
                unsafe { std::ptr::copy_nonoverlapping(from, address as *mut u8, len) };
                Ok(())
            }),
        )
    }

    fn pin_host(&mut self, address: usize, len: usize) -> Result<(), RuntimeError> {
        self.pinned.push((address, len));
        Ok(())
    }

    fn download(&mut self, stream: Stream, address: u64, into: &mut [u8]) -> Result<(), RuntimeError> {
        self.no_capture("a download to the host")?;
        self.check(address, into.len())?;
        self.counts.downloads.fetch_add(1, Ordering::Relaxed);
        self.drain(stream)?;
        // SAFETY: checked to lie in an allocation; nothing else runs meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(address as *const u8, into.as_mut_ptr(), into.len()) };
        Ok(())
    }

    fn zero(&mut self, stream: Stream, address: u64, len: usize) -> Result<(), RuntimeError> {
        self.check(address, len)?;
        // SAFETY: checked to lie in an allocation.
        self.queue(
            stream,
            Arc::new(move || {
                unsafe { std::ptr::write_bytes(address as *mut u8, 0, len) };
                Ok(())
            }),
        )
    }

    fn copy(&mut self, stream: Stream, from: u64, to: u64, len: usize) -> Result<(), RuntimeError> {
        self.check(from, len)?;
        self.check(to, len)?;
        // SAFETY: both checked to lie in allocations.
        self.queue(
            stream,
            Arc::new(move || {
                unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len) };
                Ok(())
            }),
        )
    }

    fn launch(&mut self, stream: Stream, entry: Entry, rows: usize, args: &[u64]) -> Result<(), RuntimeError> {
        let (function, buffers, rows) = match entry {
            Entry::Indexed(i) => return self.launch_indexed(stream, i, args),
            Entry::Grouped(i) => return self.launch_grouped(stream, i, args),
            // The x86 form takes the same buffers and runs the units it is given (the last
            // argument) as rows.
            Entry::Attention(i) => match args.split_last() {
                Some((units, buffers)) => (self.attention.get(i).copied(), buffers.to_vec(), *units as usize),
                None => return Err(RuntimeError::Device("emulated GPU: an attention pass takes its units".into())),
            },
            // The x86 form takes the same words and runs the items it is given (the last).
            Entry::Axis(i) => match args.split_last() {
                Some((items, words)) => (self.axis.get(i).copied(), words.to_vec(), *items as usize),
                None => return Err(RuntimeError::Device("emulated GPU: an axis kernel takes its items".into())),
            },
            Entry::Kernel(i) => (self.kernels.get(i).copied(), args.to_vec(), rows),
            Entry::Movement(i) => (self.movement.get(i).copied(), args.to_vec(), rows),
            // The x86 form takes [table, scalars...] and runs the chunks it is given as rows.
            Entry::OptimizerStep(i) => match args {
                [table, chunks, scalars @ ..] => {
                    let buffers = std::iter::once(*table).chain(scalars.iter().copied()).collect();
                    (self.optimizer_steps.get(i).copied(), buffers, *chunks as usize)
                }
                _ => return Err(RuntimeError::Device("emulated GPU: an optimizer step takes its table".into())),
            },
        };
        let function = function.ok_or_else(|| RuntimeError::Device(format!("emulated GPU: no entry {entry:?}")))?;
        self.counts.launches.fetch_add(1, Ordering::Relaxed);
        self.queue(
            stream,
            Arc::new(move || {
                let buffers: Vec<*mut u8> = buffers.iter().map(|&a| a as *mut u8).collect();
                // SAFETY: the device passes the regions of a validated program in its arena (each
                // kernel's accesses are bounded by `kir::Kernel::check`) or its chunk tables.
                unsafe { function.run(&buffers, 0..rows) };
                Ok(())
            }),
        )
    }

    /// Runs the builtin matmul the call stands for (`GemmCall::dims`; the call's own numbers are
    /// checked against it by `gemm`'s tests), so results stay those of the CPU bit for bit.
    fn gemm(&mut self, stream: Stream, call: &GemmCall, operands: &GemmOperands) -> Result<bool, RuntimeError> {
        for (address, len) in [operands.lhs, operands.rhs, operands.out] {
            self.check(address, len)?;
        }
        for (which, &pointers) in operands.pointers.iter().enumerate() {
            self.check(pointers, call.products.len() * 8)
                .map_err(|e| RuntimeError::Device(format!("emulated GPU: the GEMM's pointer array {which}: {e}")))?;
        }
        let kernel = Kernel::MatMul { dtype: call.dtype, dims: call.dims.clone() };
        let (lhs, rhs, out) = (operands.lhs, operands.rhs, operands.out);
        let tf32 = self.math == GemmMath::Tf32 && call.dtype == DType::F32;
        self.counts.gemms.fetch_add(1, Ordering::Relaxed);
        self.queue(
            stream,
            Arc::new(move || {
                // SAFETY: checked to lie in allocations; the device's regions of one instruction,
                // whose output overlaps neither input (`Program::validate`).
                let (lhs, rhs, out) = unsafe {
                    (
                        std::slice::from_raw_parts(lhs.0 as *const u8, lhs.1),
                        std::slice::from_raw_parts(rhs.0 as *const u8, rhs.1),
                        std::slice::from_raw_parts_mut(out.0 as *mut u8, out.1),
                    )
                };
                let rounded;
                let (lhs, rhs) = match tf32 {
                    true => {
                        rounded = [lhs, rhs].map(tf32_operand);
                        (rounded[0].as_slice(), rounded[1].as_slice())
                    }
                    false => (lhs, rhs),
                };
                kernel
                    .run(&[lhs, rhs], &mut [out])
                    .map_err(|source| RuntimeError::Kernel { label: "emulated GEMM".into(), source })
            }),
        )?;
        Ok(true)
    }

    fn record(&mut self, stream: Stream) -> Result<GpuEvent, RuntimeError> {
        if let Some(capture) = &mut self.capturing {
            let event = capture.events.len();
            capture.events.push(stream);
            self.push(stream, Op::Signal(event))?;
            return Ok(GpuEvent(CAPTURED | event));
        }
        let event = self.events.len();
        self.events.push(Event { done: None, stream });
        self.queues[stream as usize].push_back(Op::Signal(event));
        Ok(GpuEvent(event))
    }

    fn wait(&mut self, stream: Stream, event: GpuEvent) -> Result<(), RuntimeError> {
        if let Some(capture) = &self.capturing {
            let captured = event.0 & !CAPTURED;
            if event.0 & CAPTURED == 0 || captured >= capture.events.len() {
                return Err(RuntimeError::Device(
                    "emulated GPU: a capture waits on an event recorded outside it".into(),
                ));
            }
            return self.push(stream, Op::WaitFor(captured));
        }
        if event.0 >= self.events.len() {
            return Err(RuntimeError::Device(format!("emulated GPU: event {} was never recorded", event.0)));
        }
        self.queues[stream as usize].push_back(Op::WaitFor(event.0));
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), RuntimeError> {
        self.no_capture("a synchronisation")?;
        for stream in Stream::ALL {
            self.drain(stream)?;
        }
        self.events.clear();
        Ok(())
    }

    /// What the emulator holds, out of no limit.
    fn memory(&mut self) -> Result<(usize, usize), RuntimeError> {
        Ok((usize::MAX - self.allocated(), usize::MAX))
    }

    fn copy_2d(&mut self, stream: Stream, copy: &Copy2d) -> Result<(), RuntimeError> {
        let Copy2d { from, from_pitch, to, to_pitch, width, rows } = *copy;
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let span = |pitch: usize| (rows - 1) * pitch + width;
        self.check(from, span(from_pitch))?;
        self.check(to, span(to_pitch))?;
        self.queue(
            stream,
            Arc::new(move || {
                for row in 0..rows {
                    // SAFETY: checked: every row lies in an allocation.
                    unsafe {
                        std::ptr::copy(
                            (from as *const u8).add(row * from_pitch),
                            (to as *mut u8).add(row * to_pitch),
                            width,
                        )
                    };
                }
                Ok(())
            }),
        )
    }

    fn nccl_reach(&mut self) -> NcclReach {
        NcclReach::Process
    }

    fn device_uuid(&mut self) -> Result<[u8; 16], RuntimeError> {
        Ok(self.uuid)
    }

    fn nccl_id(&mut self) -> Result<NcclId, RuntimeError> {
        Ok(emulated_nccl::new_id())
    }

    fn nccl_join(&mut self, id: &NcclId, ranks: usize, rank: usize) -> Result<usize, RuntimeError> {
        let group = emulated_nccl::join(id, ranks)?;
        self.communicators.push((group, rank, Arc::default()));
        Ok(self.communicators.len() - 1)
    }

    fn nccl(&mut self, stream: Stream, comm: usize, call: &NcclCall) -> Result<(), RuntimeError> {
        let (group, ..) = (self.communicators.get(comm))
            .ok_or_else(|| RuntimeError::Device(format!("emulated GPU: no NCCL communicator {comm}")))?;
        for (address, len) in call.buffers(group.ranks()) {
            self.check(address, len)?;
        }
        let (group, rank, calls) = &self.communicators[comm];
        let (group, rank, calls, call) = (group.clone(), *rank, calls.clone(), *call);
        let point_to_point = matches!(call, NcclCall::Send { .. } | NcclCall::Recv { .. });
        let work: Work = Arc::new(move || {
            let number = calls.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the buffers are checked to lie in allocations; the device gives a call's
            // buffers to nothing else on other streams until the call's event.
            match point_to_point {
                true => unsafe { group.exchange(rank, number, call) },
                false => unsafe { group.call(rank, number, call) },
            }
        });
        if !matches!(call, NcclCall::Recv { .. }) {
            return self.queue(stream, work);
        }
        self.no_capture("a point-to-point receive")?;
        let sends_before = self.record(Stream::Transfer)?.0;
        self.push(stream, Op::Receive { sends_before, work })
    }

    fn record_timed(&mut self, stream: Stream) -> Result<GpuEvent, RuntimeError> {
        self.record(stream)
    }

    fn elapsed(&mut self, start: GpuEvent, end: GpuEvent) -> Result<std::time::Duration, RuntimeError> {
        if start.0.max(end.0) >= self.events.len() {
            return Err(RuntimeError::Device("emulated GPU: the elapsed time of an event never recorded".into()));
        }
        let from = self.reached(start.0)?;
        Ok(self.reached(end.0)?.saturating_duration_since(from))
    }

    fn begin_capture(&mut self) -> Result<(), RuntimeError> {
        self.no_capture("a second capture")?;
        self.capturing = Some(Capture::default());
        Ok(())
    }

    fn end_capture(&mut self) -> Result<usize, RuntimeError> {
        for stream in [Stream::Collectives, Stream::Peer, Stream::Transfer] {
            let joined = self.capturing.as_ref().is_some_and(|c| !c.ops[stream as usize].is_empty());
            if joined {
                let event = self.record(stream)?;
                self.wait(Stream::Compute, event)?;
            }
        }
        let capture =
            (self.capturing.take()).ok_or_else(|| RuntimeError::Device("emulated GPU: no capture under way".into()))?;
        self.graphs.push(capture);
        Ok(self.graphs.len() - 1)
    }

    fn replay(&mut self, graph: usize) -> Result<(), RuntimeError> {
        self.no_capture("a replay")?;
        let graph = (self.graphs.get(graph).cloned())
            .ok_or_else(|| RuntimeError::Device(format!("emulated GPU: no graph {graph}")))?;
        let first = self.events.len();
        self.events.extend(graph.events.iter().map(|&stream| Event { done: None, stream }));
        for (queue, ops) in self.queues.iter_mut().zip(graph.ops) {
            queue.extend(ops.into_iter().map(|op| match op {
                Op::Signal(event) => Op::Signal(first + event),
                Op::WaitFor(event) => Op::WaitFor(first + event),
                run => run,
            }));
        }
        Ok(())
    }

    fn nccl_aborter(&mut self) -> NcclAborter {
        let groups: Vec<Arc<Group>> = self.communicators.iter().map(|(group, ..)| group.clone()).collect();
        Box::new(move || groups.iter().for_each(|group| group.abort()))
    }
}

/// An f32 operand's bytes with every element rounded to TF32 (what the tensor cores read).
fn tf32_operand(bytes: &[u8]) -> AlignedBuf {
    let mut rounded = AlignedBuf::from_bytes(bytes);
    for element in rounded.as_mut_slice().chunks_exact_mut(4) {
        let x = f32::from_le_bytes(element.try_into().expect("chunks of 4"));
        element.copy_from_slice(&round_to_tf32(x).to_le_bytes());
    }
    rounded
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upload from pinned memory reads it when its stream runs the copy, as a GPU's DMA
    /// does; from other memory, when it is issued.
    #[test]
    fn an_upload_from_pinned_memory_reads_it_when_the_stream_runs() -> Result<(), RuntimeError> {
        let mut gpu = Emulator::new(&Program::bare(vec![], vec![], 0), GemmMath::F32)?;
        let device = gpu.alloc(8)?;
        let (mut pinned, mut pageable) = (AlignedBuf::from_bytes(&[1; 4]), AlignedBuf::from_bytes(&[1; 4]));
        gpu.pin_host(pinned.as_mut_slice().as_mut_ptr() as usize, 4)?;
        gpu.upload(Stream::Compute, device, pinned.as_slice())?;
        gpu.upload(Stream::Compute, device + 4, pageable.as_slice())?;
        pinned.as_mut_slice().fill(2);
        pageable.as_mut_slice().fill(2);
        let mut back = [0u8; 8];
        gpu.download(Stream::Compute, device, &mut back)?;
        assert_eq!(back, [2, 2, 2, 2, 1, 1, 1, 1]);
        Ok(())
    }
}
