//! The training loop's engine: a loaded [`TrainingPlan`] that runs one optimizer step after
//! another over the token data, following the data contract (step s uses windows
//! (s*G + j) mod W), feeds the learning rate of its schedule, and saves and resumes
//! checkpoints. The command line adds the progress bar and the metrics file around it.
//!
//! A plan on a mesh runs one executor per rank, each rank a thread of this process connected by
//! a [`LocalComm`]; each rank loads its block of every weight and is fed its block of every
//! input, and checkpoints hold the reassembled global tensors. With pipeline stages, the ranks
//! of stage `s` run its program (rank = stage x mesh size + mesh rank), a parameter is loaded
//! on every stage that holds it, and the loss comes from the last stage.
//!
//! Determinism: a step's result depends only on the weights and states before it, the step
//! number and the data, so resuming from a checkpoint of step k and running to step n gives
//! bit-identical losses to an uninterrupted run (tests/checkpoint.rs checks it).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use autotp_kernels::DType;
use autotp_program::loss_scale::LossScaler;
use autotp_program::mesh::CommBytes;
use autotp_program::plan::{Evaluation, Labels, ModelSource, TrainingConfig, TrainingPlan};
use autotp_program::step::{StepInput, StepOutput};
use autotp_program::Slot;
use autotp_runtime::clock::{Clock, RunTime};
use autotp_runtime::comm::{Communicator, LocalComm, MpiComm, Topology};
use autotp_runtime::gpu::CommPath;
use autotp_runtime::gpu::GpuKind;
use autotp_runtime::{Executor, HostTensor, RuntimeError};

use crate::data::Batch;
use crate::dataset::TrainingData;
use crate::preemption::{Signal, Stop};
use crate::TrainError;

mod evaluate;
mod non_finite;
mod state;
mod timeline;

pub use evaluate::EvalMetrics;
use state::in_slot_type;
pub use state::SlotBytes;

/// What one step reported.
#[derive(Clone, Debug, PartialEq)]
pub struct StepMetrics {
    /// 1-based.
    pub step: usize,
    pub lr: f64,
    pub loss: f64,
    /// Every scalar output of the step (the loss, `grad_norm` when clipping), by name.
    pub scalars: Vec<(String, f64)>,
    /// Wall time.
    pub seconds: f64,
    /// Each rank's idle share of the step by the trainer's clock ([`Trainer::set_clock`]): the
    /// time it waited for other pipeline stages' messages or was done before the step was.
    pub idle: Vec<f64>,
    /// fp16: the loss scale the step ran with.
    pub loss_scale: Option<f64>,
    /// Whether its update was skipped for non-finite gradients (mixed precision).
    pub skipped: bool,
}

/// What a step does whose loss or gradients hold an inf or a NaN (`--nan-policy`), when no
/// loss scaler (fp16's, which skips such steps and lowers its scale) decides it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NanPolicy {
    /// Ends the run, naming the step, the first parameter whose gradient is not finite and
    /// the instruction that first made an inf or a NaN; the state stays as before the step.
    #[default]
    Stop,
    /// Skips the step's update, as mixed precision does: the step counts, the optimizer's
    /// step and the schedule do not move.
    Skip,
}

/// The program output that is 1 when a step's update was skipped (`passes::optimize::OVERFLOW`).
pub const OVERFLOW_OUTPUT: &str = StepOutput::Overflow.name();

/// What one rank actually held and sent ([`Trainer::measured`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Measured {
    /// Its arena (on a GPU, the device memory its program took) plus its largest host staging.
    pub peak: usize,
    /// Bytes sent since the trainer was made, by collective.
    pub sent: CommBytes,
    /// Whether NCCL carried every collective (then its staging is device scratch, in `peak`).
    pub nccl: bool,
}

pub struct Trainer {
    /// The executors of the ranks this process runs (ranks `first_rank..`), stage by stage:
    /// every rank, or (one rank per process) its own.
    ranks: Vec<Executor>,
    /// The plan's validation step, loaded at the first evaluation ([`Trainer::evaluate`]).
    evaluation: Evaluation,
    /// Its executors, as `ranks`: empty until the first evaluation.
    evaluators: Vec<Executor>,
    /// What the evaluators communicate on: rank threads have a communicator of their own, a
    /// process of a job shares the job's (see [`evaluate`]).
    evaluation_comm: Option<Arc<dyn Communicator>>,
    /// The GPUs the ranks run on, for the evaluators.
    gpu: Option<GpuKind>,
    first_rank: usize,
    topology: Topology,
    /// Every stage's program, for what the trainer reads of all of them (slots, outputs); the
    /// executors hold their own, with the constants.
    programs: Vec<autotp_program::Program>,
    /// Each rank's kernel threads, when this process runs several ranks: the machine's cores
    /// shared out, so ranks do not queue on one pool.
    pools: Vec<rayon::ThreadPool>,
    comm: Option<Arc<dyn Communicator>>,
    /// The job, when each rank is a process of its own.
    processes: Option<Arc<MpiComm>>,
    /// How the ranks time their steps.
    clock: Clock,
    training: TrainingConfig,
    model: ModelSource,
    fingerprint: String,
    loss_index: usize,
    completed: usize,
    /// Of the completed steps, those whose update was skipped (non-finite gradients).
    skipped: usize,
    /// fp16's loss scaler, as it stands.
    scaler: Option<LossScaler>,
    /// What a step whose loss or gradients are not finite does (without a loss scaler).
    nan_policy: NanPolicy,
    seed: u64,
}

impl Trainer {
    /// Loads `plan` with its initial `weights` (by parameter name), every rank a thread of this
    /// process; optimizer states start at zero and the step count at 0.
    pub fn new(plan: TrainingPlan, weights: &BTreeMap<String, &[u8]>, seed: u64) -> Result<Trainer, TrainError> {
        Trainer::build(plan, weights, seed, None, None)
    }

    /// Loads `plan` on GPUs (see [`autotp_runtime::gpu`]): every rank a thread of this process, each
    /// with its own streams and arena on the GPU `gpu` names.
    pub fn on_gpu(
        plan: TrainingPlan,
        weights: &BTreeMap<String, &[u8]>,
        seed: u64,
        gpu: GpuKind,
    ) -> Result<Trainer, TrainError> {
        Trainer::build(plan, weights, seed, None, Some(gpu))
    }

    /// Loads this process's rank of `plan` in a job over MPI: its stage's program and its
    /// blocks of the weights, nothing of the other ranks'.
    pub fn for_process(
        plan: TrainingPlan,
        weights: &BTreeMap<String, &[u8]>,
        seed: u64,
        job: Arc<MpiComm>,
    ) -> Result<Trainer, TrainError> {
        Trainer::build(plan, weights, seed, Some(job), None)
    }

    /// [`Trainer::for_process`] with the process's rank on a GPU.
    pub fn for_process_on_gpu(
        plan: TrainingPlan,
        weights: &BTreeMap<String, &[u8]>,
        seed: u64,
        job: Arc<MpiComm>,
        gpu: GpuKind,
    ) -> Result<Trainer, TrainError> {
        Trainer::build(plan, weights, seed, Some(job), Some(gpu))
    }

    fn build(
        plan: TrainingPlan,
        weights: &BTreeMap<String, &[u8]>,
        seed: u64,
        job: Option<Arc<MpiComm>>,
        gpu: Option<GpuKind>,
    ) -> Result<Trainer, TrainError> {
        plan.feeds()?;
        let loss_index = plan.loss_index()?;
        let t = &plan.training;
        for ids in plan.stages.iter().flat_map(|p| &p.inputs).filter(|s| s.name == StepInput::InputIds.name()) {
            if ids.global_shape != t.global_token_shape() {
                return Err(TrainError::plan(format!(
                    "feeds input_ids as {:?} on all ranks, but its global batch is {} x {} in {} micro-batches",
                    ids.global_shape, t.global_batch, t.seq_len, t.grad_accum
                )));
            }
        }
        let fingerprint = plan.fingerprint();
        let TrainingPlan { stages, evaluation, training, model } = plan;
        let sizes: Vec<usize> = stages[0].mesh.iter().map(|a| a.size).collect();
        let topology = Topology::new(stages.len(), &sizes);
        let programs: Vec<autotp_program::Program> =
            stages.iter().map(|p| autotp_program::Program { constants: Vec::new(), ..p.clone() }).collect();
        let comm = match &job {
            Some(job) => Some(job.clone() as Arc<dyn Communicator>),
            None if topology.world_size() <= 1 => None,
            None => Some(LocalComm::pipeline(stages.len(), &sizes) as Arc<dyn Communicator>),
        };
        let (mut ranks, first_rank) = load_ranks(stages, &topology, &job, gpu, &comm, None)?;
        if let Some(nvme) = &training.nvme {
            for (i, executor) in ranks.iter_mut().enumerate() {
                executor.offload_to_nvme(nvme, first_rank + i)?;
            }
        }
        if let Some(settings) = &training.nvme_params {
            for (i, executor) in ranks.iter_mut().enumerate() {
                executor.offload_params_to_nvme(settings, first_rank + i)?;
            }
        }
        // Several ranks here share the cores; a process of a job gets its share of the node's.
        let pools = match &job {
            Some(job) => rank_pools(1, job.kernel_threads())?,
            None if ranks.len() > 1 => rank_pools(ranks.len(), shared_cores(ranks.len()))?,
            None => Vec::new(),
        };
        let mut trainer = Trainer {
            ranks,
            evaluation,
            evaluators: Vec::new(),
            evaluation_comm: None,
            gpu,
            first_rank,
            topology,
            programs,
            pools,
            comm,
            processes: job,
            clock: Clock::Wall,
            training,
            model,
            fingerprint,
            loss_index,
            completed: 0,
            skipped: 0,
            scaler: None,
            nan_policy: NanPolicy::Stop,
            seed,
        };
        trainer.scaler = trainer.training.loss_scaler.clone();
        let initial = |name: &str| {
            weights.get(name).ok_or_else(|| TrainError::plan(format!("parameter '{name}' has no initial weights")))
        };
        for slot in trainer.param_slots() {
            trainer.load_global(&slot, &in_slot_type(&slot, initial(&slot.name)?)?)?;
        }
        // Mixed precision: each f32 master starts from its parameter's weights, unrounded.
        let masters = trainer.training.masters.clone();
        for slot in trainer.first_held(|p| &p.states) {
            if let Some(param) = masters.get(&slot.name) {
                trainer.load_global(&slot, &in_slot_type(&slot, initial(param)?)?)?;
            }
        }
        Ok(trainer)
    }

    /// Pipeline stages.
    pub fn stages(&self) -> usize {
        self.programs.len()
    }

    /// Ranks per stage.
    pub fn stage_size(&self) -> usize {
        self.topology.stage_size()
    }

    /// The job over MPI this process is a rank of, if it is one.
    pub fn processes(&self) -> Option<&Arc<MpiComm>> {
        self.processes.as_ref()
    }

    /// The ranks this process runs.
    pub fn local_ranks(&self) -> std::ops::Range<usize> {
        self.first_rank..self.first_rank + self.ranks.len()
    }

    /// Whether this process prints progress and writes metrics: rank 0's.
    pub fn reports(&self) -> bool {
        self.first_rank == 0
    }

    fn executor(&self, rank: usize) -> Option<&Executor> {
        self.ranks.get(rank.checked_sub(self.first_rank)?)
    }

    /// Every slot of the stages' `list` (parameters or states) once: the slot of the first
    /// stage holding it.
    fn first_held(&self, list: impl Fn(&autotp_program::Program) -> &[Slot]) -> Vec<Slot> {
        let mut seen = std::collections::BTreeSet::new();
        let mut slots = Vec::new();
        for program in &self.programs {
            for slot in list(program) {
                if seen.insert(slot.name.clone()) {
                    slots.push(slot.clone());
                }
            }
        }
        slots
    }

    fn param_slots(&self) -> Vec<Slot> {
        self.first_held(|p| &p.params)
    }

    /// Parameters, then states.
    fn model_slots(&self) -> Vec<Slot> {
        [self.param_slots(), self.first_held(|p| &p.states)].concat()
    }

    /// The program of pipeline stage `stage`.
    pub fn stage_program(&self, stage: usize) -> &autotp_program::Program {
        &self.programs[stage]
    }

    /// The rank's coordinates on the mesh.
    fn coordinates(&self, rank: usize) -> Vec<usize> {
        if self.topology.world_size() <= 1 {
            return Vec::new();
        }
        self.topology.coordinates(rank)
    }

    pub fn training(&self) -> &TrainingConfig {
        &self.training
    }

    /// The program of stage 0 (the only one without a pipeline).
    pub fn program(&self) -> &autotp_program::Program {
        &self.programs[0]
    }

    /// The program `rank` runs.
    pub fn rank_program(&self, rank: usize) -> &autotp_program::Program {
        &self.programs[self.topology.stage(rank)]
    }

    /// Times the ranks' steps by `clock` from now on (see [`autotp_runtime::clock`]). The CPU clock
    /// times pipeline stages of one rank each, and gives each rank one kernel thread.
    pub fn set_clock(&mut self, clock: Clock) -> Result<(), TrainError> {
        if clock == Clock::Cpu {
            if self.stages() < 2 || self.stage_size() > 1 {
                return Err(TrainError::plan(format!(
                    "has {} stage(s) of {} rank(s), and the cpu clock times pipeline stages of one rank each \
                     (it does not see the waits of collectives)",
                    self.stages(),
                    self.stage_size()
                )));
            }
            self.pools = rank_pools(self.ranks.len(), 1)?;
        }
        for rank in &mut self.ranks {
            rank.set_clock(clock);
        }
        self.clock = clock;
        Ok(())
    }

    /// Pins each rank's kernel threads to cores of their own (rank r's threads to the r-th
    /// share of the cores this process may use; ranks wrap around when there are more ranks
    /// than cores), as DeepSpeed's `--bind_cores_to_rank` does; a process of a job, the share
    /// its place on the node gives it. A single rank pins the global kernel threads one per core.
    pub fn bind_cores(&self) -> Result<(), TrainError> {
        let cores = autotp_runtime::affinity::allowed_cores()
            .map_err(|e| TrainError::plan(format!("cannot read which cores this process may use: {e}")))?;
        let pin = |slot: usize| {
            let core = cores[slot % cores.len()];
            autotp_runtime::affinity::pin_current_thread(core)
                .map_err(|e| TrainError::plan(format!("cannot pin a kernel thread to core {core}: {e}")))
        };
        if self.pools.is_empty() {
            return rayon::broadcast(|ctx| pin(ctx.index())).into_iter().collect();
        }
        // A process of a job takes the share of its node's cores that its place on the node says.
        let first = self.processes.as_ref().map_or(0, |job| job.local_rank());
        self.pools
            .iter()
            .enumerate()
            .flat_map(|(rank, pool)| pool.broadcast(|ctx| pin((first + rank) * ctx.num_threads() + ctx.index())))
            .collect()
    }

    /// Times every instruction of every rank from now on ([`Trainer::profile`]); refused for
    /// GPU steps run as a CUDA graph.
    pub fn enable_profile(&mut self) -> Result<(), TrainError> {
        for rank in &mut self.ranks {
            rank.enable_profile()?;
        }
        Ok(())
    }

    /// The time `rank` spent in each of its program's instructions since profiling was enabled.
    pub fn profile(&self, rank: usize) -> Option<&[std::time::Duration]> {
        self.executor(rank)?.profile()
    }

    /// Ranks running the plan.
    pub fn world_size(&self) -> usize {
        self.topology.world_size()
    }

    /// The arenas of this process's ranks, training and validation programs together: their
    /// memory on the device.
    pub fn local_arena_bytes(&self) -> usize {
        self.ranks.iter().chain(&self.evaluators).map(Executor::arena_bytes).sum()
    }

    /// What each rank of the job actually allocated (its arena plus the most communication
    /// staging it held), the bytes it sent since the trainer was made, by collective, and
    /// whether NCCL carried its collectives and pipeline messages. In a job of processes, every process takes part
    /// (they exchange their figures).
    pub fn measured(&self) -> Result<Vec<Measured>, TrainError> {
        let local: Vec<Measured> = self
            .local_ranks()
            .map(|rank| {
                let executor = self.executor(rank).expect("a local rank");
                let arena = executor.arena_bytes();
                let mut paths = executor.axis_paths().iter().chain(executor.link_paths().iter().map(|(_, path)| path));
                let nccl = paths.clone().next().is_some() && paths.all(|p| matches!(p, CommPath::Nccl { .. }));
                match &self.comm {
                    Some(comm) => Measured {
                        peak: arena + comm.staging_peak(rank),
                        sent: executor.comm_sent(comm.bytes_sent(rank)),
                        nccl,
                    },
                    None => Measured { peak: arena, sent: CommBytes::default(), nccl },
                }
            })
            .collect();
        let Some(job) = &self.processes else { return Ok(local) };
        let [m] = &local[..] else { unreachable!("a process runs one rank") };
        let sent = &m.sent;
        let figures = [
            m.peak,
            sent.all_reduce,
            sent.all_gather,
            sent.reduce_scatter,
            sent.send,
            m.nccl as usize,
            sent.all_to_all,
            sent.ring_shift,
        ];
        let bytes: Vec<u8> = figures.iter().flat_map(|&f| (f as u64).to_le_bytes()).collect();
        let all = job.all_gather(&bytes)?;
        Ok(all
            .chunks(bytes.len())
            .map(|rank| {
                let f: Vec<usize> =
                    rank.chunks(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize).collect();
                let sent = CommBytes {
                    all_reduce: f[1],
                    all_gather: f[2],
                    reduce_scatter: f[3],
                    send: f[4],
                    all_to_all: f[6],
                    ring_shift: f[7],
                };
                Measured { peak: f[0], sent, nccl: f[5] == 1 }
            })
            .collect())
    }

    /// What a step whose loss or gradients are not finite does from now on. Skipping needs a
    /// plan that checks its gradients ([`Trainer::checks_gradients`]).
    pub fn set_nan_policy(&mut self, policy: NanPolicy) -> Result<(), TrainError> {
        if policy == NanPolicy::Skip && !self.checks_gradients() {
            return Err(TrainError::plan(
                "does not check its gradients (compiled with --no-finite-check), so it cannot skip a step whose \
                 gradients are not finite: compile it without that flag"
                    .into(),
            ));
        }
        self.nan_policy = policy;
        Ok(())
    }

    /// Whether each step checks its gradients and keeps the state when one is not finite
    /// (the step's `overflow` output): every plan but an f32 one compiled with
    /// `--no-finite-check`.
    pub fn checks_gradients(&self) -> bool {
        self.stage_program(self.stages() - 1).outputs.iter().any(|slot| slot.name == OVERFLOW_OUTPUT)
    }

    /// Whether to stop after this step because a signal asked ([`crate::preemption`]), agreed
    /// by every process of a job; `local` is this process's own request.
    pub fn agree_to_stop(&self, local: Option<Signal>) -> Result<Option<Stop>, TrainError> {
        let Some(job) = &self.processes else {
            return Ok(local.map(|signal| Stop { signal, rank: None }));
        };
        let signal = local.map_or(0, |s| u8::try_from(s.0).unwrap_or(u8::MAX));
        let all = job.all_gather(&[signal])?;
        let first = all.iter().position(|&s| s != 0);
        Ok(first.map(|rank| Stop { signal: Signal(all[rank] as libc::c_int), rank: Some(rank) }))
    }

    /// How long a wait on a GPU may last while NCCL collectives are in flight before the
    /// communicators are aborted ([`Executor::set_comm_timeout`]).
    pub fn set_comm_timeout(&mut self, timeout: std::time::Duration) {
        for executor in &mut self.ranks {
            executor.set_comm_timeout(timeout);
        }
    }

    /// Runs every rank's steps after the first as a CUDA graph ([`Executor::use_cuda_graph`]).
    pub fn use_cuda_graph(&mut self) -> Result<(), TrainError> {
        for executor in &mut self.ranks {
            executor.use_cuda_graph()?;
        }
        Ok(())
    }

    /// How the first rank here communicates on each mesh axis and pipeline link, on GPUs: one
    /// line, `None` on CPU ranks or without a mesh or stages.
    pub fn communication(&self) -> Option<String> {
        let executor = self.ranks.first()?;
        let mesh = &executor.program().mesh;
        let said = |what: String, path: &CommPath| match path {
            CommPath::Nccl { .. } => format!("{what} over NCCL"),
            CommPath::Host { why } => format!("{what} through host memory ({why})"),
        };
        let axes = (mesh.iter().zip(executor.axis_paths())).map(|(axis, path)| said(axis.name.clone(), path));
        let links = (executor.link_paths().iter())
            .map(|(link, path)| said(format!("pipeline stage {} to {}", link.from, link.to), path));
        let paths: Vec<String> = axes.chain(links).collect();
        match paths.is_empty() {
            true => None,
            false => Some(format!("GPU communication: {}", paths.join("; "))),
        }
    }

    /// Starts watching what this process's ranks write into their arenas' activations (CPU
    /// ranks; see [`Executor::watch_activations`]).
    pub fn watch_activations(&mut self) {
        for exec in &mut self.ranks {
            exec.watch_activations();
        }
    }

    /// For each of this process's ranks watched since [`Trainer::watch_activations`]: its rank,
    /// the activation bytes its runs wrote, and the plan's activation peak.
    pub fn touched_activations(&self) -> Vec<(usize, usize, usize)> {
        (self.local_ranks().zip(&self.ranks))
            .filter_map(|(rank, exec)| {
                let touched = exec.touched_activation_bytes()?;
                Some((rank, touched, exec.program().memory.activations_peak_bytes))
            })
            .collect()
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Optimizer steps done so far (after a resume, the checkpoint's).
    pub fn completed_steps(&self) -> usize {
        self.completed
    }

    /// Of the completed steps, those whose update was skipped for non-finite gradients.
    pub fn skipped_steps(&self) -> usize {
        self.skipped
    }

    /// fp16's loss scale for the next step.
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(LossScaler::scale)
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Tokens of one optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.training.global_batch * self.training.seq_len
    }

    /// Runs the next optimizer step. `train_steps` is the run's length, for schedules that decay
    /// over the run.
    pub fn step(&mut self, data: &TrainingData, train_steps: usize) -> Result<StepMetrics, TrainError> {
        self.check_windows(data, "data")?;
        let t = &self.training;
        let step = self.completed;
        let batch = data.batch(step, t.global_batch);
        // A skipped step moves neither AdamW's step nor the schedule (as DeepSpeed).
        let optimizer_step = step - self.skipped;
        let lr = t.schedule.lr(optimizer_step, train_steps);
        let loss_scale = self.scaler.as_ref().map(LossScaler::scale);
        let inputs = StepInputs { batch: &batch, lr, step: optimizer_step + 1, loss_scale };
        let feeds = self.rank_feeds(&self.programs, &inputs);
        let start = Instant::now();
        let outputs = self.run_ranks(Programs::Training, &feeds)?;
        let seconds = start.elapsed().as_secs_f64();
        self.completed += 1;
        let runs: Vec<RunTime> = self.ranks.iter().map(Executor::last_run).collect();
        // The step ends when its last rank does: by the wall clock when the trainer saw them all
        // finish (a rank thread starts a little after the first), by the CPU clock at the latest
        // rank's reading.
        let length = match self.clock {
            Clock::Wall => seconds,
            Clock::Cpu => runs.iter().map(|r| r.length.as_secs_f64()).fold(0.0, f64::max),
        };
        let mut idle: Vec<f64> =
            runs.iter().map(|r| 1.0 - r.busy().as_secs_f64() / length.max(f64::MIN_POSITIVE)).collect();
        // The loss and the step's other scalars, from the last stage's first rank.
        let program = self.stage_program(self.stages() - 1);
        let scalar_outputs: Vec<usize> =
            (0..program.outputs.len()).filter(|&i| program.outputs[i].is_float_scalar()).collect();
        let mut values: Vec<f64> = match &outputs {
            Some(outputs) => {
                let value = |i: usize| scalar_value(&outputs[i]);
                std::iter::once(self.loss_index).chain(scalar_outputs.iter().copied()).map(value).collect()
            }
            None => vec![0.0; 1 + scalar_outputs.len()],
        };
        if let Some(job) = &self.processes {
            let mut bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            job.broadcast(self.reporting_rank(), &mut bytes)?;
            values = f64s(&bytes);
            idle = f64s(&job.all_gather(&idle[0].to_le_bytes())?);
        }
        let scalars: Vec<(String, f64)> =
            scalar_outputs.iter().zip(&values[1..]).map(|(&i, &v)| (program.outputs[i].name.clone(), v)).collect();
        let skipped = scalars.iter().any(|(name, v)| name == OVERFLOW_OUTPUT && *v != 0.0);
        if self.scaler.is_none() && self.nan_policy == NanPolicy::Stop && (skipped || !values[0].is_finite()) {
            return Err(self.stop_on_non_finite(step + 1, values[0], skipped, &feeds));
        }
        self.skipped += skipped as usize;
        if let Some(scaler) = &mut self.scaler {
            scaler.update(skipped).map_err(|e| TrainError::Training(format!("step {}: {e}", step + 1)))?;
        }
        Ok(StepMetrics { step: step + 1, lr, loss: values[0], scalars, seconds, idle, loss_scale, skipped })
    }

    /// The rank whose outputs a step reports: the last stage's first (outputs are replicated
    /// over the mesh).
    fn reporting_rank(&self) -> usize {
        self.world_size() - self.stage_size()
    }

    /// Refuses `data` (`what` names it) cut into windows of another length than the plan's.
    fn check_windows(&self, data: &TrainingData, what: &str) -> Result<(), TrainError> {
        let seq_len = self.training.seq_len;
        if data.seq_len() == seq_len {
            return Ok(());
        }
        Err(TrainError::plan(format!(
            "was compiled for sequences of {seq_len} tokens; the {what} was cut into windows of {}",
            data.seq_len()
        )))
    }

    /// Each local rank's block of every input of its stage's program among `programs` (the
    /// training or the evaluation step's), from the step's global `inputs`.
    fn rank_feeds(&self, programs: &[autotp_program::Program], inputs: &StepInputs) -> Vec<Vec<HostTensor>> {
        let t = &self.training;
        let tokens = t.global_token_shape();
        // Each sequence in the plan's order (context parallelism's load balance).
        let ids = |values: &[i64]| HostTensor {
            dtype: DType::I64,
            shape: tokens.clone(),
            data: (t.sequence_order.arrange(values, t.seq_len))
                .expect("the order was checked when the plan was loaded")
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        };
        // A scalar in the type its input has: f32, or f64 in an f64 model's optimizer.
        let scalar = |v: f64, dtype: DType| HostTensor {
            dtype,
            shape: vec![],
            data: if dtype == DType::F64 { v.to_le_bytes().to_vec() } else { (v as f32).to_le_bytes().to_vec() },
        };
        let global = |feed: StepInput, dtype: DType| match feed {
            StepInput::InputIds => ids(&inputs.batch.input_ids),
            StepInput::Labels => match t.labels {
                Labels::NextTokens => ids(&inputs.batch.labels),
                Labels::InputIds => ids(&inputs.batch.input_ids),
            },
            StepInput::Lr => scalar(inputs.lr, dtype),
            StepInput::Step => scalar(inputs.step as f64, dtype),
            StepInput::LossScale => scalar(inputs.loss_scale.expect("a loss scale input has a scaler"), dtype),
        };
        let fed: std::collections::BTreeSet<(StepInput, DType)> = (programs.iter().flat_map(|p| &p.inputs))
            .filter_map(|slot| StepInput::from_name(&slot.name).map(|feed| (feed, slot.dtype)))
            .collect();
        let globals: BTreeMap<(StepInput, DType), HostTensor> =
            fed.into_iter().map(|(feed, dtype)| ((feed, dtype), global(feed, dtype))).collect();
        self.local_ranks()
            .map(|rank| {
                (programs[self.topology.stage(rank)].inputs.iter())
                    .map(|slot| {
                        let feed = StepInput::from_name(&slot.name).expect("checked when the plan was loaded");
                        let g = &globals[&(feed, slot.dtype)];
                        HostTensor {
                            dtype: g.dtype,
                            shape: slot.shape.clone(),
                            data: self.block(slot, rank, &g.data).into_owned(),
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Runs this process's ranks of `programs` on their feeds (each a thread when there are
    /// several); returns the outputs of the reporting rank, if it is one of them. A failing
    /// rank aborts the others' communication.
    fn run_ranks(
        &mut self,
        programs: Programs,
        feeds: &[Vec<HostTensor>],
    ) -> Result<Option<Vec<HostTensor>>, RuntimeError> {
        let reporting = self.reporting_rank();
        let (executors, comm) = match programs {
            Programs::Training => (&mut self.ranks, &self.comm),
            Programs::Evaluation => (&mut self.evaluators, &self.evaluation_comm),
        };
        if let [only] = &mut executors[..] {
            let outputs = match self.pools.first() {
                Some(pool) => pool.install(|| only.run(&feeds[0]))?,
                None => only.run(&feeds[0])?,
            };
            return Ok((self.first_rank == reporting).then_some(outputs));
        }
        let comm = comm.clone().expect("several ranks have a communicator");
        let results: Vec<Result<Vec<HostTensor>, RuntimeError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = executors
                .iter_mut()
                .zip(feeds)
                .zip(&self.pools)
                .enumerate()
                .map(|(rank, ((exec, feed), pool))| {
                    let comm = comm.clone();
                    scope.spawn(move || {
                        let result = pool.install(|| exec.run(feed));
                        if let Err(e) = &result {
                            comm.abort(rank, e);
                        }
                        result
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a rank thread panicked")).collect()
        });
        // Report the rank that failed, not the others that stopped because of it.
        let (mut outputs, mut failure, mut stopped) = (None, None, None);
        for (rank, result) in results.into_iter().enumerate() {
            match result {
                Ok(out) if rank == reporting => outputs = Some(out),
                Ok(_) => {}
                Err(e @ RuntimeError::PeerFailed) => {
                    stopped.get_or_insert(e);
                }
                Err(e) => {
                    failure.get_or_insert(RuntimeError::Rank { rank, source: Box::new(e) });
                }
            }
        }
        match failure.or(stopped) {
            Some(e) => Err(e),
            None => Ok(Some(outputs.expect("the reporting rank returned outputs"))),
        }
    }

    /// Each rank here whose parameter shards are in a file (`--offload-param nvme`), and
    /// where its file stands.
    pub fn param_file_status(&self) -> Vec<(usize, autotp_runtime::param_file::ParamFileStatus<'_>)> {
        (self.ranks.iter().enumerate())
            .filter_map(|(i, e)| Some((self.first_rank + i, e.param_file_status()?)))
            .collect()
    }

    /// Each rank here whose optimizer state is in a file (`--offload-optimizer nvme`), and
    /// where its file stands.
    pub fn nvme_status(&self) -> Vec<(usize, autotp_runtime::nvme::NvmeStatus<'_>)> {
        (self.ranks.iter().enumerate()).filter_map(|(i, e)| Some((self.first_rank + i, e.nvme_status()?))).collect()
    }
}

/// The step's global inputs besides the parameters.
struct StepInputs<'a> {
    batch: &'a Batch,
    lr: f64,
    /// The optimizer step, 1-based.
    step: usize,
    loss_scale: Option<f64>,
}

/// Which of the plan's programs the ranks run.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Programs {
    Training,
    Evaluation,
}

/// Every rank's `bytes` in a job of processes, in rank order; the ranks' lengths may differ
/// (two all-gathers: the lengths, then the bytes padded to the longest).
fn all_gather_bytes(job: &MpiComm, mut bytes: Vec<u8>) -> Result<Vec<Vec<u8>>, TrainError> {
    let lengths = job.all_gather(&(bytes.len() as u64).to_le_bytes())?;
    let lengths: Vec<usize> =
        (lengths.chunks_exact(8)).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize).collect();
    let longest = lengths.iter().copied().max().unwrap_or(0);
    if longest == 0 {
        return Ok(vec![Vec::new(); lengths.len()]);
    }
    bytes.resize(longest, 0);
    let all = job.all_gather(&bytes)?;
    Ok(all.chunks(longest).zip(lengths).map(|(chunk, length)| chunk[..length].to_vec()).collect())
}

/// Loads the executors of the ranks this process runs of the `stages` (every rank here, or in a
/// job of processes its own) on `comm`; returns them and the first one's rank. A GPU rank of a
/// job loading beside another program on the job's communicator continues its collectives
/// from `continuing`. A rank that
/// fails to load aborts the others' communication, and its own error is the one returned.
fn load_ranks(
    stages: Vec<autotp_program::Program>,
    topology: &Topology,
    job: &Option<Arc<MpiComm>>,
    gpu: Option<GpuKind>,
    comm: &Option<Arc<dyn Communicator>>,
    continuing: Option<&[u64]>,
) -> Result<(Vec<Executor>, usize), TrainError> {
    let load = |program: autotp_program::Program, rank: Option<(usize, Arc<dyn Communicator>)>| match gpu {
        Some(kind) => {
            let device = kind.open(&program)?;
            let issued = continuing.map_or_else(|| vec![0; program.mesh.len()], <[u64]>::to_vec);
            Executor::on_gpu_continuing(program, device, rank, issued)
        }
        None => {
            let mut executor = match rank {
                Some((r, comm)) => Executor::for_rank(program, r, comm)?,
                None => Executor::new(program)?,
            };
            if let Some(issued) = continuing {
                executor.continue_collectives(issued)?;
            }
            Ok(executor)
        }
    };
    match (job, comm) {
        (Some(job), Some(comm)) => {
            let rank = job.rank();
            let program = stages.into_iter().nth(topology.stage(rank)).expect("a stage per rank");
            Ok((vec![load(program, Some((rank, comm.clone())))?], rank))
        }
        (None, Some(comm)) => {
            let load_rank = |r: usize| {
                let loaded = load(stages[topology.stage(r)].clone(), Some((r, comm.clone())));
                if let Err(e) = &loaded {
                    comm.abort(r, e);
                }
                loaded
            };
            // GPU ranks load together: they decide how to communicate (and join NCCL
            // communicators) with each other as they load.
            let ranks: Vec<Result<Executor, RuntimeError>> = match gpu {
                Some(_) => std::thread::scope(|scope| {
                    let loads: Vec<_> = (0..topology.world_size()).map(|r| scope.spawn(move || load_rank(r))).collect();
                    loads.into_iter().map(|l| l.join().expect("a rank's load does not panic")).collect()
                }),
                None => (0..topology.world_size()).map(load_rank).collect(),
            };
            // A rank's own error before those it made the others see.
            let mut errors: Vec<RuntimeError> = Vec::new();
            let mut loaded = Vec::new();
            for rank in ranks {
                match rank {
                    Ok(executor) => loaded.push(executor),
                    Err(e) => errors.push(e),
                }
            }
            errors.sort_by_key(|e| matches!(e, RuntimeError::PeerFailed | RuntimeError::Comm(_)));
            match errors.into_iter().next() {
                Some(first) => Err(first.into()),
                None => Ok((loaded, 0)),
            }
        }
        (_, None) => {
            let program = stages.into_iter().next().expect("one program");
            Ok((vec![load(program, None)?], 0))
        }
    }
}

/// Kernel threads per rank when `ranks` ranks share the available cores (at least one each).
fn shared_cores(ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks).max(1)
}

/// A kernel thread pool of `threads` threads per rank.
fn rank_pools(ranks: usize, threads: usize) -> Result<Vec<rayon::ThreadPool>, TrainError> {
    (0..ranks)
        .map(|rank| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(move |i| format!("autotp-rank{rank}-{i}"))
                .build()
                .map_err(|e| TrainError::plan(format!("cannot start rank {rank}'s kernel threads: {e}")))
        })
        .collect()
}

/// A scalar f32 or f64 output's value.
fn scalar_value(tensor: &HostTensor) -> f64 {
    match tensor.dtype {
        DType::F64 => f64::from_le_bytes(tensor.data[..8].try_into().expect("a scalar f64 output")),
        _ => f32::from_le_bytes(tensor.data[..4].try_into().expect("a scalar f32 output")) as f64,
    }
}

/// Little-endian f64s.
fn f64s(bytes: &[u8]) -> Vec<f64> {
    bytes.chunks(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
}
