//! The executor: a program loaded on a device, the CPU ([`crate::cpu`]) or a GPU
//! ([`crate::gpu`]). It validates the program for its rank, makes its stream schedule, loads
//! parameters and inputs, drives the schedule on the device, applies the step's updates and
//! returns the outputs.

use std::borrow::Cow;
use std::sync::Arc;

use autotp_program::{Collective, CollectiveOp, Instruction, Program};

use crate::clock::{Clock, RankClock, RunTime};
use crate::comm::Communicator;
use crate::cpu::{copy_in_parallel, CpuDevice};
use crate::gpu::{Gpu, GpuDevice};
use crate::non_finite::NonFiniteTrace;
use crate::streams::{Stream, StreamSchedule};
use crate::RuntimeError;

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
    Gpu(Box<GpuDevice>),
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
        let device = CpuDevice::load(&program, rank)?;
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
        let issued = vec![0; program.mesh.len()];
        Executor::on_gpu_continuing(program, gpu, rank, issued)
    }

    /// [`Executor::on_gpu`] continuing another executor's collectives on the same communicator
    /// ([`Executor::continue_collectives`]) from the load on: joining NCCL communicators at
    /// load takes collectives of their own.
    pub fn on_gpu_continuing(
        program: Program,
        gpu: Box<dyn Gpu>,
        rank: Option<(usize, Arc<dyn Communicator>)>,
        issued: Vec<u64>,
    ) -> Result<Executor, RuntimeError> {
        let (program, schedule) = Executor::prepare(program, &rank)?;
        let device = Backend::Gpu(Box::new(GpuDevice::load(&program, gpu, rank, issued)?));
        Ok(Executor { program, schedule, device, clock: Clock::Wall, last_run: RunTime::default() })
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Times every instruction from now on ([`Executor::profile`]); refused on a GPU whose
    /// steps run as a CUDA graph.
    pub fn enable_profile(&mut self) -> Result<(), RuntimeError> {
        let instructions = self.program.instructions.len();
        match &mut self.device {
            Backend::Cpu(cpu) => cpu.profile = Some(vec![std::time::Duration::ZERO; instructions]),
            Backend::Gpu(gpu) => gpu.enable_profile(instructions)?,
        }
        Ok(())
    }

    /// Checks every instruction's float outputs for infs and NaNs from the next run on, until
    /// [`Executor::take_non_finite`] ([`crate::non_finite`]); `false` on a GPU whose steps run
    /// as a CUDA graph, which the host cannot look inside.
    pub fn watch_non_finite(&mut self) -> bool {
        match &mut self.device {
            Backend::Cpu(cpu) => cpu.non_finite = Some(NonFiniteTrace::default()),
            Backend::Gpu(gpu) if gpu.steps_one_by_one() => gpu.non_finite = Some(NonFiniteTrace::default()),
            Backend::Gpu(_) => return false,
        }
        true
    }

    /// What the runs since [`Executor::watch_non_finite`] found; watching stops.
    pub fn take_non_finite(&mut self) -> Option<NonFiniteTrace> {
        match &mut self.device {
            Backend::Cpu(cpu) => cpu.non_finite.take(),
            Backend::Gpu(gpu) => gpu.non_finite.take(),
        }
    }

    /// Records a timeline of every run from now on ([`Executor::take_trace`]); CPU ranks only.
    pub fn enable_trace(&mut self, clock: crate::trace::TraceClock) -> Result<(), RuntimeError> {
        match &mut self.device {
            Backend::Cpu(cpu) => {
                cpu.trace = Some((clock, Vec::new()));
                Ok(())
            }
            Backend::Gpu(_) => Err(RuntimeError::Device(
                "--trace records CPU ranks' timelines; on GPUs use Nsight Systems (nsys profile autotp run ...) or \
                 --profile"
                    .into(),
            )),
        }
    }

    /// Stops recording the timeline; the spans recorded stay until taken.
    pub fn disable_trace(&mut self) -> Vec<crate::trace::Span> {
        let spans = self.take_trace();
        if let Backend::Cpu(cpu) = &mut self.device {
            cpu.trace = None;
        }
        spans
    }

    /// The spans recorded since tracing began or the last call.
    pub fn take_trace(&mut self) -> Vec<crate::trace::Span> {
        match &mut self.device {
            Backend::Cpu(cpu) => cpu.take_spans(),
            Backend::Gpu(_) => Vec::new(),
        }
    }

    /// The time spent in each instruction (in program order) since profiling was enabled. On
    /// the CPU, on the thread that runs the program (a started collective counts only its
    /// hand-off); on a GPU, on the device, from when the instruction's stream reaches it
    /// (after the waits that order it) to when its work ends.
    pub fn profile(&self) -> Option<&[std::time::Duration]> {
        match &self.device {
            Backend::Cpu(cpu) => cpu.profile.as_deref(),
            Backend::Gpu(gpu) => gpu.profile.as_deref(),
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

    /// Collectives this rank has issued on each mesh axis: the sequence numbers its next ones
    /// take on the communicator.
    pub fn collectives_issued(&self) -> &[u64] {
        match &self.device {
            Backend::Cpu(cpu) => &cpu.issued,
            Backend::Gpu(gpu) => &gpu.issued,
        }
    }

    /// Continues another executor's collectives on the same communicator (the rank's
    /// validation program between its training steps): its next collectives take the sequence
    /// numbers after `issued` ([`Executor::collectives_issued`]).
    pub fn continue_collectives(&mut self, issued: &[u64]) -> Result<(), RuntimeError> {
        let own = match &mut self.device {
            Backend::Cpu(cpu) => &mut cpu.issued,
            Backend::Gpu(gpu) => &mut gpu.issued,
        };
        if own.len() != issued.len() {
            return Err(RuntimeError::InvalidProgram(format!(
                "a program on {} mesh axes cannot continue the collectives of one on {}",
                own.len(),
                issued.len()
            )));
        }
        own.copy_from_slice(issued);
        Ok(())
    }

    /// The bytes `sent` says this rank's host communicator sent, corrected for the device: less
    /// what the NCCL bootstrap sent through it, plus what its NCCL collectives sent.
    pub fn comm_sent(&self, sent: autotp_program::mesh::CommBytes) -> autotp_program::mesh::CommBytes {
        match &self.device {
            Backend::Cpu(_) => sent,
            Backend::Gpu(gpu) => sent.minus(&gpu.bootstrap_sent).plus(&gpu.nccl_sent),
        }
    }

    /// Bounds how long a wait on a GPU may last while NCCL collectives are in flight (see
    /// `gpu::watchdog`); nothing elsewhere (host communicators have timeouts of their own).
    pub fn set_comm_timeout(&mut self, timeout: std::time::Duration) {
        if let Backend::Gpu(gpu) = &mut self.device {
            gpu.set_comm_timeout(timeout);
        }
    }

    /// Runs every step after the first as a CUDA graph captured from the second
    /// (`--cuda-graph`); refused, naming why, for a program whose steps need the host.
    pub fn use_cuda_graph(&mut self) -> Result<(), RuntimeError> {
        match &mut self.device {
            Backend::Gpu(gpu) => gpu.use_graph(),
            Backend::Cpu(_) => Err(RuntimeError::InvalidProgram("--cuda-graph needs --device cuda".into())),
        }
    }

    /// How each mesh axis's collectives travel (on a GPU; empty on the CPU or without a mesh).
    pub fn axis_paths(&self) -> &[crate::gpu::CommPath] {
        match &self.device {
            Backend::Cpu(_) => &[],
            Backend::Gpu(gpu) => &gpu.paths,
        }
    }

    /// How each pipeline link's messages travel (on a GPU; empty on the CPU or without stages).
    pub fn link_paths(&self) -> &[(crate::gpu::Link, crate::gpu::CommPath)] {
        match &self.device {
            Backend::Cpu(_) => &[],
            Backend::Gpu(gpu) => &gpu.links,
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
        // Parameter shards in the pool (`--offload-param cpu`) are placed before the states and
        // stay in memory.
        let states = self.program.states.iter().filter(|s| s.region.in_host_pool());
        let kept = states.map(|s| s.region.offset - autotp_program::HOST_POOL).min().unwrap_or(0);
        let mut pool = crate::param_file::Pages::zeroed(kept)?;
        pool.as_mut_slice().copy_from_slice(&cpu.host_pool.as_slice()[..kept]);
        cpu.host_pool = pool;
        cpu.state_file = Some(file);
        Ok(())
    }

    /// Moves the parameter shards at the end of the host pool into a file under
    /// `settings.path`, named for `rank` (see [`crate::param_file`]); on the CPU only. A plan
    /// that keeps every shard in host memory (all within `--max-in-cpu`) makes no file.
    pub fn offload_params_to_nvme(
        &mut self,
        settings: &autotp_program::param_file::NvmeParams,
        rank: usize,
    ) -> Result<(), RuntimeError> {
        let Backend::Cpu(cpu) = &mut self.device else {
            return Err(RuntimeError::InvalidProgram("parameters on NVMe run on CPU ranks only so far".into()));
        };
        if cpu.param_file.is_some() {
            return Err(RuntimeError::InvalidProgram("the parameters are in a file already".into()));
        }
        cpu.param_file = crate::param_file::ParamFile::create(&self.program, settings, rank, &mut cpu.host_pool)?;
        Ok(())
    }

    /// Where the parameter file stands, when parameter shards are on NVMe.
    pub fn param_file_status(&self) -> Option<crate::param_file::ParamFileStatus<'_>> {
        match &self.device {
            Backend::Cpu(cpu) => cpu.param_file.as_ref().map(crate::param_file::ParamFile::status),
            Backend::Gpu(_) => None,
        }
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
            Backend::Cpu(cpu) => match (&cpu.state_file, cpu.param_file.as_ref().and_then(|f| f.read(&slot.region))) {
                (_, Some(shard)) => shard.map(Cow::Owned),
                (Some(file), None) if in_state_file(&self.program, slot) => file.read(&slot.region).map(Cow::Owned),
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
            Backend::Cpu(cpu) => {
                match (&cpu.state_file, cpu.param_file.as_ref().and_then(|f| f.write(&slot.region, bytes))) {
                    (_, Some(written)) => written,
                    (Some(file), None) if in_state_file(&self.program, slot) => file.write(&slot.region, bytes),
                    _ => {
                        copy_in_parallel(cpu.bytes_mut(&slot.region), bytes);
                        Ok(())
                    }
                }
            }
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
                let mut result = crate::streams::drive(cpu.as_mut(), &self.program, &self.schedule);
                if let Some(file) = cpu.param_file.as_mut() {
                    // Written back before anyone reads a shard from the file between runs.
                    result = result.and(file.drain());
                }
                let clock = cpu.clock.take().expect("set for the run");
                result?;
                let bases = cpu.bases();
                for (k, u) in self.program.updates.iter().enumerate() {
                    if let Some(file) = cpu.param_file.as_mut().filter(|f| f.writes_update(k)) {
                        // SAFETY: `from` is validated in the arena or the host pool's memory.
                        file.write_update(k, unsafe { std::slice::from_raw_parts(bases.at(&u.from), u.from.len) })?;
                        continue;
                    }
                    // SAFETY: validated in the arena or the host pool; `from` and `to` are equal
                    // or disjoint.
                    unsafe { std::ptr::copy(bases.at(&u.from), bases.at(&u.to), u.from.len) };
                }
                if let Some(file) = cpu.param_file.as_mut() {
                    file.drain()?;
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
                let result = gpu.step(&self.program, &self.schedule);
                let clock = gpu.clock.take().expect("set for the run");
                result?;
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

/// Whether `slot` is an optimizer state in the host pool: in the state file when the optimizer
/// is on NVMe (parameters in the pool stay in memory).
fn in_state_file(program: &Program, slot: &autotp_program::Slot) -> bool {
    slot.region.in_host_pool() && program.states.iter().any(|s| s.region == slot.region)
}
