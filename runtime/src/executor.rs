//! The executor: a program loaded on a device (the CPU, or a GPU through [`crate::gpu`]). On
//! the CPU: one arena per program (per rank), parameters and constants loaded once,
//! then instructions run in order: builtin kernels (multi-threaded with rayon inside), generated
//! kernels (JIT-compiled by `autotp-llvm` when the executor is built; their rows split over the
//! rank's rayon pool) and collectives through the rank's communicator.

use std::borrow::Cow;
use std::sync::{mpsc, Arc, Condvar, Mutex};

use autotp_kernels::AlignedBuf;

use autotp_kernels::optim::OptimizerKernel;
use autotp_llvm::CpuKernel;

use crate::clock::{Clock, RankClock, RunTime};
use autotp_program::{Collective, CollectiveOp};

use crate::comm::Communicator;
use crate::gpu::{Gpu, GpuDevice};
use crate::streams::{Device, Stream, StreamSchedule};
use crate::RuntimeError;
use autotp_program::{Instruction, Program, Region};

/// An asynchronous collective handed to a rank's communication thread: raw pointers into the
/// rank's arena.
struct Job {
    op: CollectiveOp,
    seq: u64,
    input: (usize, usize),
    output: (usize, usize),
}

// SAFETY: the pointers address the executor's arena, which outlives every job (a run
// synchronises the thread before it returns, and the thread is joined before the arena is
// freed), and the stream schedule orders every other access to these regions before the job
// or after its completion (`StreamSchedule::check`).
unsafe impl Send for Job {}

/// How far a communication thread has got: jobs finished, and the first failure not yet
/// reported to a waiter.
#[derive(Default)]
struct Progress {
    finished: u64,
    error: Option<RuntimeError>,
    failed: bool,
}

/// A rank's communication thread: the collectives stream of the CPU device. It runs the
/// collectives the rank starts, in order.
struct CommThread {
    jobs: mpsc::Sender<Job>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
    /// Jobs handed to the thread so far.
    started: u64,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl CommThread {
    fn spawn(rank: usize, comm: Arc<dyn Communicator>) -> CommThread {
        let (jobs, queue) = mpsc::channel::<Job>();
        let progress = Arc::new((Mutex::new(Progress::default()), Condvar::new()));
        let reported = progress.clone();
        let handle = std::thread::Builder::new()
            .name(format!("autotp-comm-{rank}"))
            .spawn(move || {
                for job in queue {
                    // SAFETY: see `Job`: the regions stay valid and untouched until completion.
                    let input = unsafe { std::slice::from_raw_parts(job.input.0 as *const u8, job.input.1) };
                    let output = unsafe { std::slice::from_raw_parts_mut(job.output.0 as *mut u8, job.output.1) };
                    let result = comm.collective(rank, &job.op, job.seq, input, output);
                    if let Err(e) = &result {
                        comm.abort(rank, e);
                    }
                    let (state, changed) = &*reported;
                    let mut state = state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                    state.finished += 1;
                    if let Err(e) = result {
                        if !state.failed {
                            state.failed = true;
                            state.error = Some(e);
                        }
                    }
                    changed.notify_all();
                }
            })
            .expect("a communication thread starts");
        CommThread { jobs, progress, started: 0, handle: Some(handle) }
    }

    fn start(&mut self, job: Job) -> Result<(), RuntimeError> {
        self.jobs.send(job).map_err(|_| RuntimeError::Comm("the communication thread stopped".into()))?;
        self.started += 1;
        Ok(())
    }

    /// Blocks until the first `jobs` jobs have finished; fails if one of them failed.
    fn wait_for(&self, jobs: u64) -> Result<(), RuntimeError> {
        let (state, changed) = &*self.progress;
        let mut state = state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        while state.finished < jobs {
            state = changed.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        match (state.error.take(), state.failed) {
            (Some(e), _) => Err(e),
            (None, true) => Err(RuntimeError::Comm("an earlier collective of this rank failed".into())),
            (None, false) => Ok(()),
        }
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        let (closed, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.jobs, closed));
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// A host tensor handed to or returned by the executor.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub dtype: autotp_kernels::DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// What [`Executor::watch_activations`] fills the activations with: no f32, f16 or bf16 a
/// step computes is likely to leave these bytes (as f32 words, a NaN with a payload).
pub const CANARY: u64 = 0x7FA5_C35A_7FB6_E10F;

/// A loaded program with its arena.
pub struct Executor {
    program: Program,
    /// Where each instruction runs (checked race-free when the program loads).
    schedule: StreamSchedule,
    device: Backend,
    /// How runs are timed.
    clock: Clock,
    /// What the last run took, with its waits for other pipeline stages.
    last_run: RunTime,
}

/// The device an executor runs its program on.
enum Backend {
    Cpu(Box<CpuDevice>),
    Gpu(GpuDevice),
}

/// The CPU as a [`Device`]: the compute and peer streams are the thread that runs the
/// program (a send hands over a copy of its bytes before it returns, so it completes at once);
/// the collectives stream is the rank's communication thread.
struct CpuDevice {
    /// Runs the asynchronous collectives, when the program starts any. Declared first so it is
    /// dropped (its thread joined) before the arena it writes into.
    comm_thread: Option<CommThread>,
    /// The entry points of `program.kernels`, compiled for this machine.
    generated: Vec<GeneratedKernel>,
    /// The multi-tensor step of each update rule the program's optimizer steps apply.
    optimizer_steps: Vec<(OptimizerKernel, CpuKernel)>,
    arena: AlignedBuf,
    /// Offloaded optimizer states (`--offload-optimizer cpu`), outside the arena; empty when
    /// they are in `state_file`.
    host_pool: AlignedBuf,
    /// The offloaded optimizer states in a file (`--offload-optimizer nvme`).
    state_file: Option<crate::nvme::StateFile>,
    /// This rank and its communicator, for programs on a mesh.
    rank: Option<(usize, Arc<dyn Communicator>)>,
    /// Collectives issued so far on each mesh axis (their sequence numbers).
    issued: Vec<u64>,
    /// Time spent in each instruction over all runs, when profiling.
    profile: Option<Vec<std::time::Duration>>,
    /// The clock of the run under way.
    clock: Option<RankClock>,
}

/// An event of the CPU device: complete when recorded (compute and peer streams), or when the
/// communication thread has finished its first `n` jobs.
enum CpuEvent {
    Done,
    CollectivesFinished(u64),
}

impl Executor {
    /// Validates a one-device program and allocates its arena; constants are written now.
    pub fn new(program: Program) -> Result<Executor, RuntimeError> {
        Executor::build(program, None)
    }

    /// Loads a program on a mesh (or a pipeline stage's) as rank `rank` of `comm`.
    pub fn for_rank(program: Program, rank: usize, comm: Arc<dyn Communicator>) -> Result<Executor, RuntimeError> {
        Executor::build(program, Some((rank, comm)))
    }

    /// Checks `program` for `rank` (on a mesh, or `None` for one device), places its kernels'
    /// blocks at the rank's coordinates and makes its stream schedule.
    fn prepare(
        mut program: Program,
        rank: &Option<(usize, Arc<dyn Communicator>)>,
    ) -> Result<(Program, StreamSchedule), RuntimeError> {
        let sizes: Vec<usize> = program.mesh.iter().map(|a| a.size).collect();
        match rank {
            None if sizes.iter().any(|&n| n > 1) => {
                return Err(RuntimeError::InvalidProgram("a program on a mesh needs a rank and a communicator".into()))
            }
            Some((r, comm)) => {
                let topology = comm.topology();
                if sizes.iter().product::<usize>() != topology.stage_size() || *r >= topology.world_size() {
                    return Err(RuntimeError::InvalidProgram(format!(
                        "rank {r} of a {}-rank communicator cannot run a program on mesh {sizes:?}",
                        topology.world_size()
                    )));
                }
            }
            None => {}
        }
        program.validate()?;
        let schedule = StreamSchedule::of(&program)?;
        if let Some((r, comm)) = rank {
            // Kernels that serve one block of a split table start at this rank's block.
            let coords = comm.topology().coordinates(*r);
            for instruction in &mut program.instructions {
                if let Instruction::Kernel { kernel, .. } = instruction {
                    kernel.place_blocks(&coords);
                }
            }
        }
        Ok((program, schedule))
    }

    fn build(program: Program, rank: Option<(usize, Arc<dyn Communicator>)>) -> Result<Executor, RuntimeError> {
        let (program, schedule) = Executor::prepare(program, &rank)?;
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
        let functions: Vec<autotp_llvm::Function> = (program.kernels.iter().map(autotp_llvm::Function::Kernel))
            .chain(step_kinds.iter().map(autotp_llvm::Function::OptimizerStep))
            .collect();
        let mut entries = if functions.is_empty() {
            Vec::new()
        } else {
            autotp_llvm::compile_cpu_functions(&functions).map_err(|e| RuntimeError::KernelCompile(e.to_string()))?
        };
        let optimizer_steps = step_kinds.into_iter().zip(entries.split_off(program.kernels.len())).collect();
        let generated = entries
            .into_iter()
            .zip(&program.kernels)
            .map(|(entry, k)| GeneratedKernel { entry, outer: k.outer, rows_per_task: rows_per_task(k) })
            .collect();
        let host_pool = AlignedBuf::zeroed(program.memory.host_pool_bytes);
        let device = CpuDevice {
            comm_thread,
            generated,
            optimizer_steps,
            arena,
            host_pool,
            state_file: None,
            rank,
            issued,
            profile: None,
            clock: None,
        };
        Ok(Executor {
            program,
            schedule,
            device: Backend::Cpu(Box::new(device)),
            clock: Clock::Wall,
            last_run: RunTime::default(),
        })
    }

    /// Loads a program on a GPU (see [`crate::gpu`]): its arena in device memory, constants
    /// uploaded; `gpu` holds the program's kernels. `rank` as [`Executor::for_rank`] for a
    /// program on a mesh (its communication staged through host memory), `None` for one device.
    pub fn on_gpu(
        program: Program,
        gpu: Box<dyn Gpu>,
        rank: Option<(usize, Arc<dyn Communicator>)>,
    ) -> Result<Executor, RuntimeError> {
        if program.memory.host_pool_bytes > 0 {
            return Err(RuntimeError::InvalidProgram(
                "the plan offloads its optimizer (--offload-optimizer), which runs on CPU ranks only so far".into(),
            ));
        }
        let (program, schedule) = Executor::prepare(program, &rank)?;
        let device = Backend::Gpu(GpuDevice::load(&program, gpu, rank)?);
        Ok(Executor { program, schedule, device, clock: Clock::Wall, last_run: RunTime::default() })
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Times every instruction from now on ([`Executor::profile`]); on the CPU only (a GPU's
    /// instructions run after the host has issued them).
    pub fn enable_profile(&mut self) {
        if let Backend::Cpu(cpu) = &mut self.device {
            cpu.profile = Some(vec![std::time::Duration::ZERO; self.program.instructions.len()]);
        }
    }

    /// The time spent in each instruction (in program order) since profiling was enabled: on
    /// the thread that runs the program (a started collective counts only its hand-off).
    pub fn profile(&self) -> Option<&[std::time::Duration]> {
        match &self.device {
            Backend::Cpu(cpu) => cpu.profile.as_deref(),
            Backend::Gpu(_) => None,
        }
    }

    /// Times runs from now on by `clock` (see [`crate::clock`]).
    pub fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
    }

    /// What the last run took by this executor's clock, and how much of it was spent waiting on
    /// other pipeline stages' sends.
    pub fn last_run(&self) -> RunTime {
        self.last_run
    }

    /// Bytes of the arena this executor allocated; on a GPU, the device memory its program
    /// took when it loaded, as the driver counts it.
    pub fn arena_bytes(&self) -> usize {
        match &self.device {
            Backend::Cpu(cpu) => cpu.arena.len(),
            Backend::Gpu(gpu) => gpu.held_bytes,
        }
    }

    /// Fills the arena's activations with [`CANARY`] so that [`Executor::touched_activation_bytes`]
    /// counts what later runs write there (on the CPU; a GPU's are not watched).
    pub fn watch_activations(&mut self) {
        let start = self.program.activations_start();
        if let Backend::Cpu(cpu) = &mut self.device {
            for word in cpu.arena.as_mut_slice()[start..].chunks_mut(8) {
                word.copy_from_slice(&CANARY.to_le_bytes()[..word.len()]);
            }
        }
    }

    /// Bytes of the arena's activations written since [`Executor::watch_activations`] (8-byte
    /// words that no longer hold the canary): the activation memory the runs took, which the
    /// plan's peak says, plus what its placement leaves unused between values.
    pub fn touched_activation_bytes(&self) -> Option<usize> {
        let start = self.program.activations_start();
        match &self.device {
            Backend::Cpu(cpu) => {
                let words = cpu.arena.as_slice()[start..].chunks(8);
                Some(words.filter(|w| **w != CANARY.to_le_bytes()[..w.len()]).map(<[u8]>::len).sum())
            }
            Backend::Gpu(_) => None,
        }
    }

    /// Moves the offloaded optimizer state (the host pool) into a file under `nvme.path`,
    /// named for `rank` (see [`crate::nvme`]); on the CPU only.
    pub fn offload_to_nvme(
        &mut self,
        nvme: &autotp_program::offload::NvmeOffload,
        rank: usize,
    ) -> Result<(), RuntimeError> {
        let Backend::Cpu(cpu) = &mut self.device else {
            return Err(RuntimeError::InvalidProgram("optimizer state on NVMe runs on CPU ranks only so far".into()));
        };
        if self.program.memory.host_pool_bytes == 0 || cpu.state_file.is_some() {
            return Err(RuntimeError::InvalidProgram(
                "the plan keeps no optimizer state outside the arena to put on NVMe".into(),
            ));
        }
        let file = crate::nvme::StateFile::create(&self.program, nvme, rank, cpu.host_pool.as_slice())?;
        cpu.host_pool = AlignedBuf::zeroed(0);
        cpu.state_file = Some(file);
        Ok(())
    }

    /// Where the optimizer state's file stands, when the state is on NVMe.
    pub fn nvme_status(&self) -> Option<crate::nvme::NvmeStatus<'_>> {
        match &self.device {
            Backend::Cpu(cpu) => cpu.state_file.as_ref().map(crate::nvme::StateFile::status),
            Backend::Gpu(_) => None,
        }
    }

    /// The current bytes of a parameter or state (downloaded from a GPU).
    pub fn read_slot(&self, name: &str) -> Option<Result<Cow<'_, [u8]>, RuntimeError>> {
        let slot = self.program.params.iter().chain(&self.program.states).find(|s| s.name == name)?;
        Some(match &self.device {
            Backend::Cpu(cpu) => match &cpu.state_file {
                Some(file) if slot.region.in_host_pool() => file.read(&slot.region).map(Cow::Owned),
                _ => Ok(Cow::Borrowed(cpu.bytes(&slot.region))),
            },
            Backend::Gpu(gpu) => gpu.download_region(Stream::Compute, &slot.region).map(Cow::Owned),
        })
    }

    /// Loads the bytes of a parameter (from a weights file or an initializer) or of an optimizer
    /// state (from a checkpoint).
    pub fn load_slot(&mut self, name: &str, bytes: &[u8]) -> Result<(), RuntimeError> {
        let slot = self
            .program
            .params
            .iter()
            .chain(&self.program.states)
            .find(|s| s.name == name)
            .ok_or_else(|| RuntimeError::UnknownParam(name.to_string()))?;
        if bytes.len() != slot.region.len {
            return Err(RuntimeError::WrongSize {
                what: format!("'{name}'"),
                expected: slot.region.len,
                got: bytes.len(),
            });
        }
        match &mut self.device {
            Backend::Cpu(cpu) => match &cpu.state_file {
                Some(file) if slot.region.in_host_pool() => file.write(&slot.region, bytes),
                _ => {
                    copy_in_parallel(cpu.bytes_mut(&slot.region), bytes);
                    Ok(())
                }
            },
            Backend::Gpu(gpu) => gpu.upload_region(&slot.region, bytes),
        }
    }

    /// Runs the program on `inputs` (in the program's input order) and returns its outputs.
    pub fn run(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>, RuntimeError> {
        check_inputs(&self.program, inputs)?;
        let outputs = match &mut self.device {
            Backend::Cpu(cpu) => {
                for (slot, t) in self.program.inputs.iter().zip(inputs) {
                    cpu.arena.as_mut_slice()[slot.region.offset..slot.region.end()].copy_from_slice(&t.data);
                }
                cpu.clock = Some(RankClock::start(self.clock)?);
                let result = crate::streams::drive(cpu.as_mut(), &self.program, &self.schedule);
                let clock = cpu.clock.take().expect("set for the run");
                result?;
                let bases = cpu.bases();
                for u in &self.program.updates {
                    // SAFETY: validated in the arena or the host pool; `from` and `to` are equal
                    // or disjoint.
                    unsafe { std::ptr::copy(bases.at(&u.from), bases.at(&u.to), u.from.len) };
                }
                self.last_run = clock.finish()?;
                let arena = cpu.arena.as_slice();
                (self.program.outputs.iter()).map(|s| arena[s.region.offset..s.region.end()].to_vec()).collect()
            }
            Backend::Gpu(gpu) => {
                for (slot, t) in self.program.inputs.iter().zip(inputs) {
                    gpu.upload_region(&slot.region, &t.data)?;
                }
                gpu.clock = Some(RankClock::start(self.clock)?);
                let result = crate::streams::drive(gpu, &self.program, &self.schedule);
                let clock = gpu.clock.take().expect("set for the run");
                result?;
                gpu.apply_updates(&self.program.updates)?;
                let outputs = (self.program.outputs.iter())
                    .map(|s| gpu.download_region(Stream::Compute, &s.region))
                    .collect::<Result<Vec<_>, _>>()?;
                self.last_run = clock.finish()?;
                outputs
            }
        };
        Ok((self.program.outputs.iter())
            .zip(outputs)
            .map(|(s, data)| HostTensor { dtype: s.dtype, shape: s.shape.clone(), data })
            .collect())
    }
}

impl CpuDevice {
    /// Where the arena and the host pool start.
    fn bases(&mut self) -> Bases {
        Bases {
            arena: self.arena.as_mut_slice().as_mut_ptr() as usize,
            host_pool: self.host_pool.as_mut_slice().as_mut_ptr() as usize,
        }
    }

    /// The bytes of `region` (validated to lie in the arena or the host pool).
    fn bytes(&self, region: &Region) -> &[u8] {
        match region.in_host_pool() {
            true => &self.host_pool.as_slice()[region.offset - autotp_program::HOST_POOL..][..region.len],
            false => &self.arena.as_slice()[region.offset..region.end()],
        }
    }

    fn bytes_mut(&mut self, region: &Region) -> &mut [u8] {
        match region.in_host_pool() {
            true => &mut self.host_pool.as_mut_slice()[region.offset - autotp_program::HOST_POOL..][..region.len],
            false => &mut self.arena.as_mut_slice()[region.offset..region.end()],
        }
    }

    /// Adds the time since `started` to instruction `index`'s, when profiling.
    fn profiled(&mut self, index: usize, started: Option<std::time::Instant>) {
        if let (Some(started), Some(profile)) = (started, self.profile.as_mut()) {
            profile[index] += started.elapsed();
        }
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

    fn launch(&mut self, program: &Program, index: usize, _stream: Stream) -> Result<(), RuntimeError> {
        let instruction = &program.instructions[index];
        let started = self.profile.is_some().then(std::time::Instant::now);
        let bases = self.bases();
        // SAFETY: `Program::validate` checked every region is inside the arena and that an
        // instruction's outputs overlap neither its inputs nor each other, so these slices
        // are disjoint where one is mutable. Inputs may alias each other (shared reads). A
        // collective in flight on the communication thread touches none of them (the stream
        // schedule is checked race-free).
        let region = |r: &Region| unsafe { std::slice::from_raw_parts(bases.at(r), r.len) };
        let region_mut = |r: &Region| unsafe { std::slice::from_raw_parts_mut(bases.at(r), r.len) };
        match instruction {
            Instruction::Kernel { kernel, inputs, outputs, label } => {
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
                })?;
            }
            // Its start's completion is what the schedule waits for before it.
            Instruction::Wait { .. } => {}
            Instruction::Send { input, to, tag, label } => {
                let (rank, comm) = self.communicator(label, "a send")?;
                let now = self.clock.as_mut().expect("set for the run").now()?;
                comm.send(rank, *to, *tag, region(input), now)?;
            }
            // A guarded step whose guard is false (non-finite gradients) leaves everything as is.
            Instruction::OptimizerStep { guard: Some(guard), .. } if region(guard)[0] == 0 => {}
            Instruction::OptimizerStep { optimizer, dtype, scalars, tensors, label, .. } => {
                let scalars: Vec<&[u8]> = scalars.iter().map(region).collect();
                let constants = autotp_kernels::optim::constants(optimizer, *dtype, &scalars)
                    .map_err(|source| RuntimeError::Kernel { label: label.clone(), source })?;
                let (_, entry) = self
                    .optimizer_steps
                    .iter()
                    .find(|(kind, _)| kind.optimizer == *optimizer && kind.dtype == *dtype)
                    .expect("every optimizer step's kernel is compiled at load");
                let (entry, dtype) = (*entry, *dtype);
                // The kernel loads its constants as `dtype`, so they need `dtype`'s alignment.
                let constants = AlignedBuf::from_bytes(&constants);
                match self.state_file.as_mut().filter(|f| f.layout().tiles(index).is_some()) {
                    None => {
                        // SAFETY: `validate` checked every tensor's regions (in the arena, of one
                        // size) and that outputs alias nothing but, exactly, their own inputs.
                        unsafe { run_chunks(entry, &constants, &optimizer_chunks(dtype, tensors, bases)) };
                        copy_masters(dtype, tensors, bases, label)?;
                    }
                    Some(file) => {
                        // Tensors with no state in the file update in the arena; the others,
                        // tile by tile, in the file's buffers.
                        let resident = || tensors.iter().filter(|t| !t.inputs.iter().any(Region::in_host_pool));
                        // SAFETY: as above; `Layout::of` checked that the file's states are
                        // updated in place and touched by nothing else.
                        unsafe { run_chunks(entry, &constants, &optimizer_chunks(dtype, resident(), bases)) };
                        copy_masters(dtype, resident(), bases, label)?;
                        file.step(index, |tile, buffer| {
                            // SAFETY: as above; the tile's pieces lie in `buffer` (its layout).
                            unsafe { update_tile(entry, dtype, &constants, tensors, bases, tile, buffer, label) }
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
        self.profiled(index, started);
        Ok(())
    }

    fn record(&mut self, stream: Stream) -> Result<CpuEvent, RuntimeError> {
        Ok(match (stream, &self.comm_thread) {
            (Stream::Collectives, Some(thread)) => CpuEvent::CollectivesFinished(thread.started),
            _ => CpuEvent::Done,
        })
    }

    fn wait(&mut self, _stream: Stream, event: &CpuEvent) -> Result<(), RuntimeError> {
        match (event, &self.comm_thread) {
            (CpuEvent::CollectivesFinished(jobs), Some(thread)) => thread.wait_for(*jobs),
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

/// Checks that `inputs` are the program's inputs, in order, by dtype and shape.
pub(crate) fn check_inputs(program: &Program, inputs: &[HostTensor]) -> Result<(), RuntimeError> {
    if inputs.len() != program.inputs.len() {
        return Err(RuntimeError::InputCount { expected: program.inputs.len(), got: inputs.len() });
    }
    for (slot, t) in program.inputs.iter().zip(inputs) {
        if t.dtype != slot.dtype || t.shape != slot.shape {
            return Err(RuntimeError::InputType {
                name: slot.name.clone(),
                expected: format!("{}{:?}", slot.dtype, slot.shape),
                got: format!("{}{:?}", t.dtype, t.shape),
            });
        }
    }
    Ok(())
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

/// Buffers handed to the pool's threads.
struct Buffers<'a>(&'a [*mut u8]);

// SAFETY: each task runs distinct rows (or chunks), and a generated kernel's rows write
// disjoint elements of its outputs (it is how codegen builds them; `validate` bounds every
// access).
unsafe impl Sync for Buffers<'_> {}

/// A generated kernel compiled for this machine, and how its rows split into tasks (decided
/// once, when the program loads).
struct GeneratedKernel {
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
fn copy_in_parallel(dst: &mut [u8], src: &[u8]) {
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

/// Elements of one chunk of an optimizer step (one task of the pool).
const OPTIMIZER_CHUNK_ELEMENTS: usize = 16_384;

/// Where a rank's memories start: regions resolve to addresses in the arena or, for those in
/// the host pool ([`autotp_program::HOST_POOL`]), in the pool.
#[derive(Clone, Copy)]
pub(crate) struct Bases {
    pub arena: usize,
    pub host_pool: usize,
}

impl Bases {
    /// The address of `region` (nothing is dereferenced: a GPU's device addresses work too).
    pub fn at(&self, region: &Region) -> *mut u8 {
        if region.in_host_pool() {
            self.host_pool.wrapping_add(region.offset - autotp_program::HOST_POOL) as *mut u8
        } else {
            self.arena.wrapping_add(region.offset) as *mut u8
        }
    }
}

/// The whole of tensor `t`'s update, for memories at `bases`.
fn tensor_update(
    dtype: autotp_kernels::DType,
    t: &autotp_program::OptimizerTensor,
    bases: Bases,
) -> autotp_kernels::optim::TensorUpdate {
    let at = |r: &Region| bases.at(r);
    let mut states = [std::ptr::null(); 2];
    let mut states_out = [std::ptr::null_mut(); 2];
    for (k, (input, output)) in t.inputs[2..].iter().zip(&t.outputs[1..]).enumerate() {
        states[k] = at(input) as *const u8;
        states_out[k] = at(output);
    }
    autotp_kernels::optim::TensorUpdate {
        len: t.inputs[0].len / dtype.size(),
        param: at(&t.inputs[0]),
        grad: at(&t.inputs[1]),
        states,
        param_out: at(&t.outputs[0]),
        states_out,
    }
}

/// `update`'s elements `range` in chunks of at most [`OPTIMIZER_CHUNK_ELEMENTS`], appended to
/// `chunks`.
fn push_chunks(
    dtype: autotp_kernels::DType,
    update: &autotp_kernels::optim::TensorUpdate,
    range: std::ops::Range<usize>,
    chunks: &mut Vec<autotp_kernels::optim::TensorUpdate>,
) {
    for start in range.clone().step_by(OPTIMIZER_CHUNK_ELEMENTS) {
        let end = (start + OPTIMIZER_CHUNK_ELEMENTS).min(range.end);
        // SAFETY: the range lies within the tensor; `part` only offsets the addresses.
        chunks.push(unsafe { update.part(dtype, start..end) });
    }
}

/// An optimizer step's tensors cut into chunks of at most [`OPTIMIZER_CHUNK_ELEMENTS`], for
/// memories at `bases` (the CPU's, or a GPU's device addresses: nothing is dereferenced).
pub(crate) fn optimizer_chunks<'a>(
    dtype: autotp_kernels::DType,
    tensors: impl IntoIterator<Item = &'a autotp_program::OptimizerTensor>,
    bases: Bases,
) -> Vec<autotp_kernels::optim::TensorUpdate> {
    let mut chunks = Vec::new();
    for t in tensors {
        let whole = tensor_update(dtype, t, bases);
        push_chunks(dtype, &whole, 0..whole.len, &mut chunks);
    }
    chunks
}

/// Runs the generated multi-tensor kernel `entry` over `chunks` on the current rayon pool,
/// with the step's `constants` ([`autotp_kernels::optim::constants`], aligned for its dtype).
///
/// # Safety
/// `entry` is the compiled step of the chunks' update rule and dtype; the chunks' memory is
/// valid, aliases as [`Instruction::OptimizerStep`] allows, and no one else touches it
/// meanwhile.
unsafe fn run_chunks(entry: CpuKernel, constants: &AlignedBuf, chunks: &[autotp_kernels::optim::TensorUpdate]) {
    use rayon::prelude::*;
    let args = [chunks.as_ptr() as *mut u8, constants.as_slice().as_ptr() as *mut u8];
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
/// As [`run_chunks`]; `tile` is laid out in `buffer` as [`crate::nvme::Layout`] says.
#[allow(clippy::too_many_arguments)]
unsafe fn update_tile(
    entry: CpuKernel,
    dtype: autotp_kernels::DType,
    constants: &AlignedBuf,
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
    unsafe { run_chunks(entry, constants, &chunks) };
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
        // SAFETY: validated: the copy's region lies in the arena, apart from the master.
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
fn cast_master(
    from: autotp_kernels::DType,
    to: autotp_kernels::DType,
    master: &[u8],
    out: &mut [u8],
    label: &str,
) -> Result<(), RuntimeError> {
    let cast = autotp_kernels::Kernel::Cast { from, to };
    cast.run(&[master], &mut [out]).map_err(|source| RuntimeError::Kernel { label: label.to_string(), source })
}

/// The sequence number of the next collective on `op`'s axis (`shard_slice` meets no one and
/// takes none).
pub(crate) fn next_seq(issued: &mut [u64], op: &CollectiveOp) -> u64 {
    if let Collective::ShardSlice { .. } = op.kind {
        return 0;
    }
    let seq = issued[op.axis];
    issued[op.axis] += 1;
    seq
}
