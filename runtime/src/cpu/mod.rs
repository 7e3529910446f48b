//! The CPU as a device: one arena per program (per rank), parameters and constants loaded
//! once, then instructions run in program order: builtin kernels (multi-threaded with rayon
//! inside), generated kernels and attention's generated passes (JIT-compiled by `autotp-llvm`
//! when the program loads, their rows split over the rank's rayon pool), optimizer steps (the
//! multi-tensor kernel over chunks, or tile by tile through an NVMe state file), collectives
//! through the rank's communicator (the asynchronous ones on its communication thread,
//! [`comm_thread`]) and pipeline messages.

mod comm_thread;

use std::sync::Arc;

use autotp_kernels::attention::{AttentionFunction, AttentionTarget};
use autotp_kernels::optim::OptimizerKernel;
use autotp_kernels::AlignedBuf;
use autotp_kernels::Kernel;
use autotp_llvm::CpuKernel;
use autotp_program::{Instruction, Program, Region};

use crate::clock::RankClock;
use crate::comm::Communicator;
use crate::executor::next_seq;
use crate::non_finite::NonFiniteTrace;
use crate::optimizer_step::{optimizer_chunks, push_chunks, tensor_update, Bases};
use crate::streams::{Device, Stream};
use crate::trace::{Span, TraceClock};
use crate::RuntimeError;
use comm_thread::{CommThread, Job};

/// The CPU as a [`Device`]: the compute and peer streams are the thread that runs the
/// program (a send hands over a copy of its bytes before it returns, so it completes at once);
/// the collectives stream is the rank's communication thread.
pub(crate) struct CpuDevice {
    /// Runs the asynchronous collectives, when the program starts any. Declared first so it is
    /// dropped (its thread joined) before the arena it writes into.
    pub(crate) comm_thread: Option<CommThread>,
    /// The entry points of `program.kernels`, compiled for this machine.
    pub(crate) generated: Vec<GeneratedKernel>,
    /// The multi-tensor step of each update rule the program's optimizer steps apply.
    pub(crate) optimizer_steps: Vec<(OptimizerKernel, CpuKernel)>,
    /// The generated passes of each attention instruction that has them, by instruction.
    pub(crate) attention: std::collections::BTreeMap<usize, AttentionRun>,
    pub(crate) arena: AlignedBuf,
    /// The parameter shards in a file (`--offload-param nvme`). Declared before the host pool,
    /// whose pages its I/O thread reads into, so that it is dropped (the thread joined) first.
    pub(crate) param_file: Option<crate::param_file::ParamFile>,
    /// Offloaded optimizer states (`--offload-optimizer cpu`) and parameter shards
    /// (`--offload-param`), outside the arena; empty when the states are in `state_file`.
    pub(crate) host_pool: crate::param_file::Pages,
    /// The offloaded optimizer states in a file (`--offload-optimizer nvme`).
    pub(crate) state_file: Option<crate::nvme::StateFile>,
    /// This rank and its communicator, for programs on a mesh.
    pub(crate) rank: Option<(usize, Arc<dyn Communicator>)>,
    /// Collectives issued so far on each mesh axis (their sequence numbers).
    pub(crate) issued: Vec<u64>,
    /// Time spent in each instruction over all runs, when profiling.
    pub(crate) profile: Option<Vec<std::time::Duration>>,
    /// The timeline of the runs since tracing began, when tracing ([`crate::trace`]).
    pub(crate) trace: Option<(TraceClock, Vec<Span>)>,
    /// The clock of the run under way.
    pub(crate) clock: Option<RankClock>,
    /// Where infs and NaNs first appeared, while watching for them ([`crate::non_finite`]).
    pub(crate) non_finite: Option<NonFiniteTrace>,
}

/// An event of the CPU device: complete when recorded (compute and peer streams), or when the
/// communication thread has finished its first `n` jobs.
pub(crate) enum CpuEvent {
    Done,
    CollectivesFinished(u64),
}

impl CpuDevice {
    /// Allocates `program`'s arena (constants written), compiles its kernels for this CPU and
    /// starts the communication thread when it starts collectives.
    pub(crate) fn load(
        program: &Program,
        rank: Option<(usize, Arc<dyn Communicator>)>,
    ) -> Result<CpuDevice, RuntimeError> {
        let mut arena = AlignedBuf::zeroed(program.memory.arena_bytes);
        advise_huge_pages(arena.as_mut_slice());
        for c in &program.constants {
            arena.as_mut_slice()[c.region.offset..c.region.end()].copy_from_slice(&c.bytes);
        }
        let has_starts = program.instructions.iter().any(|i| matches!(i, Instruction::CollectiveStart { .. }));
        let comm_thread = match (&rank, has_starts) {
            (Some((r, comm)), true) => Some(CommThread::spawn(*r, comm.clone())),
            _ => None,
        };
        let issued = vec![0; program.mesh.len()];
        let step_kinds = program.optimizer_kernels();
        let attention_functions = attention_functions(program);
        let functions: Vec<autotp_llvm::Function> = (program.kernels.iter().map(autotp_llvm::Function::Kernel))
            .chain(step_kinds.iter().map(autotp_llvm::Function::OptimizerStep))
            .chain(attention_functions.iter().map(|(_, f)| autotp_llvm::Function::Attention(f)))
            .collect();
        let mut entries = if functions.is_empty() {
            Vec::new()
        } else {
            autotp_llvm::compile_cpu_functions(&functions).map_err(|e| RuntimeError::KernelCompile(e.to_string()))?
        };
        let attention_entries = entries.split_off(program.kernels.len() + step_kinds.len());
        let mut attention: std::collections::BTreeMap<usize, AttentionRun> = Default::default();
        for ((index, function), entry) in attention_functions.into_iter().zip(attention_entries) {
            let run = attention.entry(index).or_insert_with(|| AttentionRun {
                passes: vec![],
                table: function.table(),
                delta: vec![0.0; function.dims.query_rows()],
            });
            run.passes.push(AttentionPass::new(&function, entry));
        }
        let optimizer_steps = step_kinds.into_iter().zip(entries.split_off(program.kernels.len())).collect();
        let generated = entries
            .into_iter()
            .zip(&program.kernels)
            .map(|(entry, k)| GeneratedKernel { entry, outer: k.outer, rows_per_task: rows_per_task(k) })
            .collect();
        let host_pool = crate::param_file::Pages::zeroed(program.memory.host_pool_bytes)?;
        Ok(CpuDevice {
            comm_thread,
            generated,
            optimizer_steps,
            attention,
            arena,
            param_file: None,
            host_pool,
            state_file: None,
            rank,
            issued,
            profile: None,
            trace: None,
            non_finite: None,
            clock: None,
        })
    }

    /// Where the arena and the host pool start.
    pub(crate) fn bases(&mut self) -> Bases {
        Bases {
            arena: self.arena.as_mut_slice().as_mut_ptr() as usize,
            host_pool: self.host_pool.as_mut_slice().as_mut_ptr() as usize,
        }
    }

    /// The bytes of `region` (validated to lie in the arena or the host pool).
    pub(crate) fn bytes(&self, region: &Region) -> &[u8] {
        match region.in_host_pool() {
            true => &self.host_pool.as_slice()[region.offset - autotp_program::HOST_POOL..][..region.len],
            false => &self.arena.as_slice()[region.offset..region.end()],
        }
    }

    pub(crate) fn bytes_mut(&mut self, region: &Region) -> &mut [u8] {
        match region.in_host_pool() {
            true => &mut self.host_pool.as_mut_slice()[region.offset - autotp_program::HOST_POOL..][..region.len],
            false => &mut self.arena.as_mut_slice()[region.offset..region.end()],
        }
    }

    /// Adds the time since `started` to instruction `index`'s, when profiling, and its span
    /// on `stream`, when tracing (a started collective's is its communication thread's).
    fn profiled(&mut self, program: &Program, index: usize, stream: Stream, started: Option<std::time::Instant>) {
        let Some(started) = started else { return };
        if let Some(profile) = self.profile.as_mut() {
            profile[index] += started.elapsed();
        }
        let instruction = &program.instructions[index];
        let handed_off = matches!(instruction, Instruction::CollectiveStart { .. } | Instruction::Wait { .. });
        if let Some((clock, spans)) = self.trace.as_mut().filter(|_| !handed_off) {
            spans.push(clock.instruction(stream, instruction, started, std::time::Instant::now()));
        }
    }

    /// The spans recorded since the last call (the communication thread's included), when
    /// tracing.
    pub(crate) fn take_spans(&mut self) -> Vec<Span> {
        let Some((clock, spans)) = self.trace.as_mut() else { return Vec::new() };
        let mut taken = std::mem::take(spans);
        for (name, label, start, end) in self.comm_thread.iter().flat_map(CommThread::take_spans) {
            taken.push(clock.span(Stream::Collectives, name.to_string(), "collective", label, start, end));
        }
        taken.sort_by_key(|span| span.start_ns);
        taken
    }

    /// The compiled multi-tensor step of `optimizer` over `dtype`.
    fn optimizer_entry(&self, optimizer: &autotp_kernels::Optimizer, dtype: autotp_kernels::DType) -> CpuKernel {
        let (_, entry) = (self.optimizer_steps.iter())
            .find(|(kind, _)| kind.optimizer == *optimizer && kind.dtype == dtype)
            .expect("every optimizer step's kernel is compiled at load");
        *entry
    }

    fn communicator(&self, label: &str, what: &str) -> Result<(usize, Arc<dyn Communicator>), RuntimeError> {
        let (rank, comm) = self
            .rank
            .as_ref()
            .ok_or_else(|| RuntimeError::InvalidProgram(format!("{label}: {what} needs a communicator")))?;
        Ok((*rank, comm.clone()))
    }
}

impl Device for CpuDevice {
    type Event = CpuEvent;

    fn launch(&mut self, program: &Program, index: usize, stream: Stream) -> Result<(), RuntimeError> {
        let instruction = &program.instructions[index];
        let started = (self.profile.is_some() || self.trace.is_some()).then(std::time::Instant::now);
        let bases = self.bases();
        // SAFETY: `Program::validate` checked every region is inside the arena and that an
        // instruction's outputs overlap neither its inputs nor each other, so these slices
        // are disjoint where one is mutable. Inputs may alias each other (shared reads). A
        // collective in flight on the communication thread touches none of them (the stream
        // schedule is checked race-free).
        let region = |r: &Region| unsafe { std::slice::from_raw_parts(bases.at(r), r.len) };
        let region_mut = |r: &Region| unsafe { std::slice::from_raw_parts_mut(bases.at(r), r.len) };
        if let Some(file) = self.param_file.as_mut() {
            file.before(index)?;
        }
        if let Some(watch) = self.non_finite.as_mut() {
            watch.before(program, index, |r, dtype| Ok(dtype.first_non_finite(region(r)).is_some()))?;
        }
        match instruction {
            Instruction::Kernel { inputs, outputs, .. } if self.attention.contains_key(&index) => {
                let run = self.attention.get_mut(&index).expect("checked");
                let mut buffers: Vec<*mut u8> = inputs.iter().chain(outputs).map(|r| bases.at(r)).collect();
                buffers.extend([run.table.as_ptr() as *mut u8, run.delta.as_mut_ptr() as *mut u8]);
                for pass in &run.passes {
                    // SAFETY: `validate` checked the regions against the kernel's buffer sizes
                    // (`Kernel::check_buffers`), which are what its passes address; the scratch
                    // has a value per query row.
                    unsafe { pass.run(&buffers) };
                }
            }
            Instruction::Kernel { kernel, inputs, outputs, label, .. } => {
                let ins: Vec<&[u8]> = inputs.iter().map(region).collect();
                let mut outs: Vec<&mut [u8]> = outputs.iter().map(region_mut).collect();
                kernel.run(&ins, &mut outs).map_err(|source| RuntimeError::Kernel { label: label.clone(), source })?;
            }
            Instruction::Generated { kernel, inputs, outputs, .. } => {
                let buffers: Vec<*mut u8> = inputs.iter().chain(outputs).map(|r| bases.at(r)).collect();
                // SAFETY: `validate` checked the kernel (every access in bounds of its
                // buffers) and that these regions have its buffers' sizes and alignment and
                // outputs that overlap nothing else this instruction touches.
                unsafe { self.generated[*kernel].run(&buffers) };
            }
            Instruction::Collective { op, input, output, label } => {
                let (rank, comm) = self.communicator(label, "a collective")?;
                let seq = next_seq(&mut self.issued, op);
                comm.collective(rank, op, seq, region(input), region_mut(output))?;
            }
            Instruction::CollectiveStart { op, input, output, label } => {
                self.communicator(label, "a collective")?;
                let seq = next_seq(&mut self.issued, op);
                let thread = self.comm_thread.as_mut().expect("a program that starts collectives has the thread");
                // SAFETY: the regions lie in the arena (validated); see `Job`.
                thread.start(Job {
                    op: op.clone(),
                    seq,
                    input: (bases.at(input) as usize, input.len),
                    output: (bases.at(output) as usize, output.len),
                    traced: self.trace.is_some().then(|| label.clone()),
                })?;
            }
            // Its start's completion is what the schedule waits for before it.
            Instruction::Wait { .. } => {}
            Instruction::Send { input, to, tag, label } => {
                let (rank, comm) = self.communicator(label, "a send")?;
                let now = self.clock.as_mut().expect("set for the run").now()?;
                comm.send(rank, *to, *tag, region(input), now)?;
            }
            // A guarded step whose guard is false (non-finite gradients) leaves everything as is
            // (its shards in a file move as planned).
            Instruction::OptimizerStep { guard: Some(guard), .. } if region(guard)[0] == 0 => {
                if let Some(file) = self.param_file.as_mut() {
                    file.update_tensors(index, |_| Ok(()))?;
                }
            }
            Instruction::OptimizerStep { optimizer, dtype, scalars, tensors, label, .. }
                if self.param_file.as_ref().is_some_and(|f| f.swaps(index).is_some()) =>
            {
                let scalars: Vec<*mut u8> = scalars.iter().map(|r| bases.at(r)).collect();
                let entry = self.optimizer_entry(optimizer, *dtype);
                let file = self.param_file.as_mut().expect("checked");
                let mut in_file = vec![false; tensors.len()];
                for &(t, ..) in file.swaps(index).map_or(&[][..], |s| &s.tensors) {
                    in_file[t] = true;
                }
                let in_memory = || tensors.iter().zip(&in_file).filter(|(_, &f)| !f).map(|(t, _)| t);
                // SAFETY: as the step below.
                unsafe { run_chunks(entry, &scalars, &optimizer_chunks(*dtype, in_memory(), bases)) };
                copy_masters(*dtype, in_memory(), bases, label)?;
                file.update_tensors(index, |t| {
                    // SAFETY: as the step below; the tensor's shard is in memory between its
                    // swaps before and after this update.
                    unsafe { run_chunks(entry, &scalars, &optimizer_chunks(*dtype, [&tensors[t]], bases)) };
                    copy_masters(*dtype, [&tensors[t]], bases, label)
                })?;
            }
            Instruction::OptimizerStep { optimizer, dtype, scalars, tensors, label, .. } => {
                // The kernel reads its scalars, of `dtype`, where the arena keeps them (aligned).
                let scalars: Vec<*mut u8> = scalars.iter().map(|r| bases.at(r)).collect();
                let (entry, dtype) = (self.optimizer_entry(optimizer, *dtype), *dtype);
                match self.state_file.as_mut().filter(|f| f.layout().tiles(index).is_some()) {
                    None => {
                        // SAFETY: `validate` checked every tensor's regions (in the arena, of one
                        // size) and that outputs alias nothing but, exactly, their own inputs.
                        unsafe { run_chunks(entry, &scalars, &optimizer_chunks(dtype, tensors, bases)) };
                        copy_masters(dtype, tensors, bases, label)?;
                    }
                    Some(file) => {
                        // Tensors with no state in the file update in the arena; the others,
                        // tile by tile, in the file's buffers.
                        let resident = || tensors.iter().filter(|t| !t.inputs.iter().any(Region::in_host_pool));
                        // SAFETY: as above; `Layout::of` checked that the file's states are
                        // updated in place and touched by nothing else.
                        unsafe { run_chunks(entry, &scalars, &optimizer_chunks(dtype, resident(), bases)) };
                        copy_masters(dtype, resident(), bases, label)?;
                        file.step(index, |tile, buffer| {
                            // SAFETY: as above; the tile's pieces lie in `buffer` (its layout).
                            unsafe { update_tile(entry, dtype, &scalars, tensors, bases, tile, buffer, label) }
                        })?;
                    }
                }
            }
            Instruction::Recv { output, from, tag, label } => {
                let (rank, comm) = self.communicator(label, "a recv")?;
                let waiting = std::time::Instant::now();
                let sent_at = comm.recv(rank, *from, *tag, region_mut(output))?;
                self.clock.as_mut().expect("set for the run").received(sent_at, waiting.elapsed())?;
            }
        }
        if let Some(file) = self.param_file.as_mut() {
            file.after(index)?;
        }
        if let Some(watch) = self.non_finite.as_mut() {
            watch.after(program, index, |r, dtype| Ok(dtype.first_non_finite(region(r)).is_some()))?;
        }
        self.profiled(program, index, stream, started);
        Ok(())
    }

    fn record(&mut self, stream: Stream) -> Result<CpuEvent, RuntimeError> {
        Ok(match (stream, &self.comm_thread) {
            (Stream::Collectives, Some(thread)) => CpuEvent::CollectivesFinished(thread.started),
            _ => CpuEvent::Done,
        })
    }

    fn wait(&mut self, stream: Stream, event: &CpuEvent) -> Result<(), RuntimeError> {
        match (event, &self.comm_thread) {
            (CpuEvent::CollectivesFinished(jobs), Some(thread)) => {
                let started = std::time::Instant::now();
                let waited = thread.wait_for(*jobs);
                if let Some((clock, spans)) = self.trace.as_mut() {
                    let label = format!("{stream:?} waits for collective {jobs}").to_lowercase();
                    spans.push(clock.span(stream, "wait".into(), "wait", label, started, std::time::Instant::now()));
                }
                waited
            }
            _ => Ok(()),
        }
    }

    fn synchronize(&mut self) -> Result<(), RuntimeError> {
        match &self.comm_thread {
            Some(thread) => thread.wait_for(thread.started),
            None => Ok(()),
        }
    }

    fn abort(&mut self, error: &RuntimeError) {
        // Collectives still in flight write into the arena: stop the others, then wait.
        if let Some((rank, comm)) = &self.rank {
            comm.abort(*rank, error);
        }
        if let Some(thread) = &self.comm_thread {
            let _ = thread.wait_for(thread.started);
        }
    }
}

/// Rows of a generated kernel per parallel task: about 16K elements of work each, so small
/// kernels run on the calling thread and large ones spread over the pool.
fn rows_per_task(kernel: &autotp_kernels::kir::Kernel) -> usize {
    let passes = kernel.stages.len().max(1);
    let rows = (16_384 / (kernel.inner * passes).max(1)).max(1);
    if autotp_llvm::cpu::lanes_on_outer(kernel) {
        // Rows are the vector lanes and each inner step reads a run of them: whole vectors,
        // and runs of whole cache lines (64 f32 rows = 4 lines).
        rows.next_multiple_of(64)
    } else {
        rows
    }
}

/// The generated attention functions of `program`'s attention instructions that codegen gave
/// to generated code, with their instructions' indices.
fn attention_functions(program: &Program) -> Vec<(usize, AttentionFunction)> {
    let mut functions = Vec::new();
    for (index, instruction) in program.instructions.iter().enumerate() {
        let Instruction::Kernel { kernel, .. } = instruction else { continue };
        let generated =
            matches!(kernel, Kernel::Attention { generated: true, .. } | Kernel::AttentionGrad { generated: true, .. });
        if let Some(passes) = generated.then(|| AttentionFunction::of(kernel, AttentionTarget::Cpu)).flatten() {
            functions.extend(passes.into_iter().map(|f| (index, f)));
        }
    }
    functions
}

/// An attention instruction's generated passes, run in order, their table
/// ([`AttentionFunction::table`], the same for every pass of a kernel) and their scratch
/// (`dout . out` per query row, from the backward's first pass for its second).
pub(crate) struct AttentionRun {
    passes: Vec<AttentionPass>,
    table: Vec<i64>,
    delta: Vec<f32>,
}

/// One generated pass of an attention and how its units of rows split into tasks.
pub(crate) struct AttentionPass {
    entry: CpuKernel,
    units: usize,
    units_per_task: usize,
}

impl AttentionPass {
    fn new(function: &AttentionFunction, entry: CpuKernel) -> AttentionPass {
        // A unit's rows meet every key (or query) of their head: about 64K multiply-adds per task.
        let dims = &function.dims;
        let per_unit = function.unit_rows * dims.kv_len.max(dims.q_len) * (dims.head_dim + dims.value_dim);
        AttentionPass { entry, units: function.units(), units_per_task: (65_536 / per_unit).max(1) }
    }

    /// Runs all units on the current rayon pool over `buffers` (the instruction's inputs, then
    /// outputs, then the table and the scratch).
    ///
    /// # Safety
    /// The buffers must have the sizes of the attention kernel the pass was made from, and its
    /// outputs must overlap nothing else.
    unsafe fn run(&self, buffers: &[*mut u8]) {
        use rayon::prelude::*;
        let shared = Buffers(buffers);
        let (units, per_task, entry) = (self.units, self.units_per_task, self.entry);
        (0..units.div_ceil(per_task)).into_par_iter().for_each(|t| {
            let buffers = &shared;
            unsafe { entry.run(buffers.0, t * per_task..((t + 1) * per_task).min(units)) };
        });
    }
}

/// Buffers handed to the pool's threads.
struct Buffers<'a>(&'a [*mut u8]);

// SAFETY: each task runs distinct rows (or chunks), and a generated kernel's rows write
// disjoint elements of its outputs (it is how codegen builds them; `validate` bounds every
// access).
unsafe impl Sync for Buffers<'_> {}

/// A generated kernel compiled for this machine, and how its rows split into tasks (decided
/// once, when the program loads).
pub(crate) struct GeneratedKernel {
    entry: CpuKernel,
    outer: usize,
    rows_per_task: usize,
}

impl GeneratedKernel {
    /// Runs all rows, split into tasks on the current rayon pool.
    ///
    /// # Safety
    /// As [`CpuKernel::run`].
    unsafe fn run(&self, buffers: &[*mut u8]) {
        use rayon::prelude::*;
        let (outer, per_task, entry) = (self.outer, self.rows_per_task, self.entry);
        if outer <= per_task {
            unsafe { entry.run(buffers, 0..outer) };
            return;
        }
        let shared = Buffers(buffers);
        (0..outer.div_ceil(per_task)).into_par_iter().for_each(|t| {
            let rows = t * per_task..((t + 1) * per_task).min(outer);
            let buffers = &shared;
            unsafe { entry.run(buffers.0, rows) };
        });
    }
}

/// `dst.copy_from_slice(src)` in pieces of 4 MiB on the pool: loading a plan's weights from a
/// memory-mapped file into fresh arena pages is page faults on both sides, which the cores
/// take in parallel.
pub(crate) fn copy_in_parallel(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    const PIECE: usize = 4 << 20;
    dst.par_chunks_mut(PIECE).zip(src.par_chunks(PIECE)).for_each(|(d, s)| d.copy_from_slice(s));
}

/// Asks Linux to back `bytes` (not yet touched) with transparent huge pages, which this
/// system's default (`madvise` mode) gives only on request: a GiB arena then faults in 2 MiB at
/// a time when the weights are copied in (a 4 KiB fault per page otherwise), and kernels walk
/// it with fewer TLB misses. Only the 2 MiB-aligned part can get huge pages; a refusal (no
/// THP, `never` mode) costs nothing but the advice.
fn advise_huge_pages(bytes: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (bytes.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (bytes.as_ptr() as usize + bytes.len()) / HUGE * HUGE;
        if end > start {
            // SAFETY: the range lies inside `bytes`, memory this process owns; the advice
            // changes how it is backed, never its contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// Runs the generated multi-tensor kernel `entry` over `chunks` on the current rayon pool,
/// with the step's `scalars` (learning rate, step: one element of the chunks' dtype each). The
/// kernel's guard is null: a CPU rank reads a guarded step's guard itself and skips the step.
///
/// # Safety
/// `entry` is the compiled step of the chunks' update rule and dtype; the scalars and the
/// chunks' memory are valid and aligned, the chunks alias as [`Instruction::OptimizerStep`]
/// allows, and no one else touches them meanwhile.
pub(crate) unsafe fn run_chunks(entry: CpuKernel, scalars: &[*mut u8], chunks: &[autotp_kernels::optim::TensorUpdate]) {
    use rayon::prelude::*;
    let no_guard = std::ptr::null_mut();
    let args: Vec<*mut u8> =
        std::iter::once(chunks.as_ptr() as *mut u8).chain(scalars.iter().copied()).chain([no_guard]).collect();
    let shared = Buffers(&args);
    (0..chunks.len()).into_par_iter().for_each(|c| {
        let args = &shared;
        // SAFETY: chunks touch disjoint elements (outputs overlap nothing but their own
        // inputs, and the chunks of one tensor are disjoint ranges).
        unsafe { entry.run(args.0, c..c + 1) };
    });
}

/// One tile of an optimizer step whose states are in a file ([`crate::nvme`]): the pieces'
/// offloaded states in `buffer`, the rest (gradients, f32 parameters, 16-bit copies) in the
/// arena; then the 16-bit copies of the tile's new masters.
///
/// # Safety
/// As [`run_chunks`]; `tile` is laid out in `buffer` as [`autotp_program::offload::Layout`] says.
#[allow(clippy::too_many_arguments)]
unsafe fn update_tile(
    entry: CpuKernel,
    dtype: autotp_kernels::DType,
    scalars: &[*mut u8],
    tensors: &[autotp_program::OptimizerTensor],
    bases: Bases,
    tile: &autotp_program::offload::Tile,
    buffer: &mut [u8],
    label: &str,
) -> Result<(), RuntimeError> {
    let mut chunks = Vec::new();
    for piece in &tile.pieces {
        // SAFETY: the piece's elements lie within its tensor.
        let mut update =
            unsafe { tensor_update(dtype, &tensors[piece.tensor], bases).part(dtype, piece.elements.clone()) };
        for &(k, at) in &piece.offloaded {
            let p = buffer[at..].as_mut_ptr();
            match k {
                0 => (update.param, update.param_out) = (p, p),
                k => (update.states[k - 2], update.states_out[k - 2]) = (p, p),
            }
        }
        push_chunks(dtype, &update, 0..update.len, &mut chunks);
    }
    unsafe { run_chunks(entry, scalars, &chunks) };
    for piece in &tile.pieces {
        let t = &tensors[piece.tensor];
        let Some((copy, to)) = &t.copy else { continue };
        let elements = piece.elements.clone();
        let master: &[u8] = match piece.offloaded.iter().find(|(k, _)| *k == 0) {
            Some(&(_, at)) => &buffer[at..at + elements.len() * dtype.size()],
            // SAFETY: validated: the new parameter lies in the arena, apart from the copy.
            None => unsafe {
                let start = bases.at(&t.outputs[0]).add(elements.start * dtype.size());
                std::slice::from_raw_parts(start, elements.len() * dtype.size())
            },
        };
        // SAFETY: validated: the copy's region lies in the arena or (an offloaded parameter's)
        // the host pool's memory, apart from the master.
        let out = unsafe {
            std::slice::from_raw_parts_mut(bases.at(copy).add(elements.start * to.size()), elements.len() * to.size())
        };
        cast_master(dtype, *to, master, out, label)?;
    }
    Ok(())
}

/// The 16-bit copies an offloaded step makes of its new parameters ([`OptimizerTensor::copy`]),
/// with the cast kernel's rounding.
///
/// [`OptimizerTensor::copy`]: autotp_program::OptimizerTensor::copy
fn copy_masters<'a>(
    dtype: autotp_kernels::DType,
    tensors: impl IntoIterator<Item = &'a autotp_program::OptimizerTensor>,
    bases: Bases,
    label: &str,
) -> Result<(), RuntimeError> {
    for t in tensors {
        let Some((copy, to)) = &t.copy else { continue };
        // SAFETY: validated: the new parameter and its copy lie in the rank's memories, apart.
        let (master, out) = unsafe {
            let master = std::slice::from_raw_parts(bases.at(&t.outputs[0]), t.outputs[0].len);
            (master, std::slice::from_raw_parts_mut(bases.at(copy), copy.len))
        };
        cast_master(dtype, *to, master, out, label)?;
    }
    Ok(())
}

/// `master` (of `from`) cast to `to` into `out`, as the cast kernel rounds.
pub(crate) fn cast_master(
    from: autotp_kernels::DType,
    to: autotp_kernels::DType,
    master: &[u8],
    out: &mut [u8],
    label: &str,
) -> Result<(), RuntimeError> {
    let cast = autotp_kernels::Kernel::Cast { from, to };
    cast.run(&[master], &mut [out]).map_err(|source| RuntimeError::Kernel { label: label.to_string(), source })
}
