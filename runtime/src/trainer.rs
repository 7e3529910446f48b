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

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use autotp_kernels::shape::{extract_block, insert_block, shard_block};
use autotp_kernels::{DType, Kernel};

use crate::checkpoint::{self, Checkpoint, DataPosition, Manifest, RngState};
use crate::clock::{Clock, RunTime};
use autotp_program::mesh::CommBytes;

use crate::comm::{Communicator, LocalComm, MpiComm, Topology};
use crate::data::TokenData;
use crate::gpu::GpuKind;
use crate::{Executor, HostTensor, RuntimeError};
use autotp_program::loss_scale::LossScaler;
use autotp_program::plan::{Labels, ModelSource, TrainingConfig, TrainingPlan};
use autotp_program::step::{StepInput, StepOutput};
use autotp_program::tensor_file::TensorRef;
use autotp_program::{Placement, Slot};

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

/// The program output that is 1 when a step's update was skipped (`passes::optimize::OVERFLOW`).
pub const OVERFLOW_OUTPUT: &str = StepOutput::Overflow.name();

pub struct Trainer {
    /// The executors of the ranks this process runs (ranks `first_rank..`), stage by stage:
    /// every rank, or (one rank per process) its own.
    ranks: Vec<Executor>,
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
    /// What feeds each stage's inputs.
    feeds: Vec<Vec<StepInput>>,
    loss_index: usize,
    completed: usize,
    /// Of the completed steps, those whose update was skipped (non-finite gradients).
    skipped: usize,
    /// fp16's loss scaler, as it stands.
    scaler: Option<LossScaler>,
    seed: u64,
}

impl Trainer {
    /// Loads `plan` with its initial `weights` (by parameter name), every rank a thread of this
    /// process; optimizer states start at zero and the step count at 0.
    pub fn new(plan: TrainingPlan, weights: &BTreeMap<String, &[u8]>, seed: u64) -> Result<Trainer, RuntimeError> {
        Trainer::build(plan, weights, seed, None, None)
    }

    /// Loads `plan` on GPUs (see [`crate::gpu`]): every rank a thread of this process, each
    /// with its own streams and arena on the GPU `gpu` names.
    pub fn on_gpu(
        plan: TrainingPlan,
        weights: &BTreeMap<String, &[u8]>,
        seed: u64,
        gpu: GpuKind,
    ) -> Result<Trainer, RuntimeError> {
        Trainer::build(plan, weights, seed, None, Some(gpu))
    }

    /// Loads this process's rank of `plan` in a job over MPI: its stage's program and its
    /// blocks of the weights, nothing of the other ranks'.
    pub fn for_process(
        plan: TrainingPlan,
        weights: &BTreeMap<String, &[u8]>,
        seed: u64,
        job: Arc<MpiComm>,
    ) -> Result<Trainer, RuntimeError> {
        Trainer::build(plan, weights, seed, Some(job), None)
    }

    /// [`Trainer::for_process`] with the process's rank on a GPU.
    pub fn for_process_on_gpu(
        plan: TrainingPlan,
        weights: &BTreeMap<String, &[u8]>,
        seed: u64,
        job: Arc<MpiComm>,
        gpu: GpuKind,
    ) -> Result<Trainer, RuntimeError> {
        Trainer::build(plan, weights, seed, Some(job), Some(gpu))
    }

    fn build(
        plan: TrainingPlan,
        weights: &BTreeMap<String, &[u8]>,
        seed: u64,
        job: Option<Arc<MpiComm>>,
        gpu: Option<GpuKind>,
    ) -> Result<Trainer, RuntimeError> {
        let feeds = plan.feeds()?;
        let loss_index = plan.loss_index()?;
        let t = &plan.training;
        for ids in plan.stages.iter().flat_map(|p| &p.inputs).filter(|s| s.name == StepInput::InputIds.name()) {
            if ids.global_shape != t.global_token_shape() {
                return Err(RuntimeError::Plan(format!(
                    "feeds input_ids as {:?} on all ranks, but its global batch is {} x {} in {} micro-batches",
                    ids.global_shape, t.global_batch, t.seq_len, t.grad_accum
                )));
            }
        }
        let fingerprint = plan.fingerprint();
        let TrainingPlan { stages, training, model } = plan;
        let sizes: Vec<usize> = stages[0].mesh.iter().map(|a| a.size).collect();
        let topology = Topology::new(stages.len(), &sizes);
        let programs: Vec<autotp_program::Program> =
            stages.iter().map(|p| autotp_program::Program { constants: Vec::new(), ..p.clone() }).collect();
        let load = |program: autotp_program::Program, rank: Option<(usize, Arc<dyn Communicator>)>| match gpu {
            Some(kind) => {
                let device = kind.open(&program)?;
                Executor::on_gpu(program, device, rank)
            }
            None => match rank {
                Some((r, comm)) => Executor::for_rank(program, r, comm),
                None => Executor::new(program),
            },
        };
        let (mut ranks, first_rank, comm): (Vec<Executor>, usize, Option<Arc<dyn Communicator>>) = match &job {
            Some(job) => {
                let rank = job.rank();
                let comm: Arc<dyn Communicator> = job.clone();
                let program = stages.into_iter().nth(topology.stage(rank)).expect("a stage per rank");
                (vec![load(program, Some((rank, comm.clone())))?], rank, Some(comm))
            }
            None if topology.world_size() <= 1 => {
                let program = stages.into_iter().next().expect("one program");
                (vec![load(program, None)?], 0, None)
            }
            None => {
                let comm: Arc<dyn Communicator> = LocalComm::pipeline(stages.len(), &sizes);
                let ranks = (0..topology.world_size())
                    .map(|r| load(stages[topology.stage(r)].clone(), Some((r, comm.clone()))))
                    .collect::<Result<Vec<_>, _>>()?;
                (ranks, 0, Some(comm))
            }
        };
        if let Some(nvme) = &training.nvme {
            for (i, executor) in ranks.iter_mut().enumerate() {
                executor.offload_to_nvme(nvme, first_rank + i)?;
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
            feeds,
            loss_index,
            completed: 0,
            skipped: 0,
            scaler: None,
            seed,
        };
        trainer.scaler = trainer.training.loss_scaler.clone();
        let initial = |name: &str| {
            weights.get(name).ok_or_else(|| RuntimeError::Plan(format!("parameter '{name}' has no initial weights")))
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

    /// The parameter or state `name` as `rank`'s stage holds it (each stage holding one places
    /// it its own way: a tied embedding's two uses).
    fn held_by(&self, rank: usize, name: &str) -> Option<&Slot> {
        let program = self.rank_program(rank);
        program.params.iter().chain(&program.states).find(|s| s.name == name)
    }

    /// Rank `rank`'s block of a global tensor for `slot`.
    fn block<'a>(&self, slot: &Slot, rank: usize, global: &'a [u8]) -> Cow<'a, [u8]> {
        let cuts = slot.cuts(&self.program().mesh, &self.coordinates(rank));
        if cuts.is_empty() {
            return Cow::Borrowed(global);
        }
        let (offsets, extent) = shard_block(&slot.global_shape, &cuts);
        let mut block = vec![0u8; slot.region.len];
        extract_block(&slot.global_shape, &offsets, &extent, slot.dtype.size(), global, &mut block);
        Cow::Owned(block)
    }

    /// The shape a parameter or state has in weight files (see `TrainingConfig::weight_shapes`).
    fn stored_shape(&self, slot: &Slot) -> Vec<usize> {
        self.training.weight_shapes.get(&slot.name).cloned().unwrap_or_else(|| slot.global_shape.clone())
    }

    /// Loads a parameter or state from its global bytes: each rank takes its block.
    fn load_global(&mut self, slot: &Slot, global: &[u8]) -> Result<(), RuntimeError> {
        let expected = slot.global_shape.iter().product::<usize>() * slot.dtype.size();
        if global.len() != expected || slot.placements.contains(&Placement::PartialSum) {
            return Err(RuntimeError::WrongSize { what: format!("'{}'", slot.name), expected, got: global.len() });
        }
        for rank in self.local_ranks() {
            // Each stage holding it places it its own way (a tied embedding's two uses).
            let Some(own) = self.held_by(rank, &slot.name) else { continue };
            if own.global_shape != slot.global_shape || own.placements.contains(&Placement::PartialSum) {
                return Err(RuntimeError::Plan(format!("stages hold '{}' in different shapes", slot.name)));
            }
            let block = self.block(own, rank, global).into_owned();
            self.ranks[rank - self.first_rank].load_slot(&slot.name, &block)?;
        }
        Ok(())
    }

    /// The global bytes of a parameter or state, reassembled from the blocks of the first stage
    /// holding it. Only a trainer that runs every rank has them all.
    fn read_global(&self, slot: &Slot) -> Result<Cow<'_, [u8]>, RuntimeError> {
        assert!(self.processes.is_none(), "a process of a job holds only its own rank's blocks");
        // Which ranks hold it is the programs' to say: reading a slot may copy it off a GPU.
        let holds = |r: usize| {
            let program = self.ranks[r].program();
            program.params.iter().chain(&program.states).any(|s| s.name == slot.name)
        };
        let first = (0..self.ranks.len()).find(|&r| holds(r));
        let first = first.expect("a slot of a stage") / self.stage_size() * self.stage_size();
        let local = |rank: usize| self.ranks[rank].read_slot(&slot.name).expect("a slot of the stage");
        if slot.is_replicated() {
            return local(first);
        }
        let size = slot.dtype.size();
        let mut global = vec![0u8; slot.global_shape.iter().product::<usize>() * size];
        for rank in first..first + self.stage_size() {
            let cuts = slot.cuts(&self.program().mesh, &self.coordinates(rank));
            let (offsets, extent) = shard_block(&slot.global_shape, &cuts);
            insert_block(&slot.global_shape, &offsets, &extent, size, &local(rank)?, &mut global);
        }
        Ok(Cow::Owned(global))
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

    /// Times the ranks' steps by `clock` from now on (see [`crate::clock`]). The CPU clock
    /// times pipeline stages of one rank each, and gives each rank one kernel thread.
    pub fn set_clock(&mut self, clock: Clock) -> Result<(), RuntimeError> {
        if clock == Clock::Cpu {
            if self.stages() < 2 || self.stage_size() > 1 {
                return Err(RuntimeError::Plan(format!(
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
    pub fn bind_cores(&self) -> Result<(), RuntimeError> {
        let cores = crate::affinity::allowed_cores()
            .map_err(|e| RuntimeError::Plan(format!("cannot read which cores this process may use: {e}")))?;
        let pin = |slot: usize| {
            let core = cores[slot % cores.len()];
            crate::affinity::pin_current_thread(core)
                .map_err(|e| RuntimeError::Plan(format!("cannot pin a kernel thread to core {core}: {e}")))
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

    /// Times every instruction of every rank from now on ([`Trainer::profile`]).
    pub fn enable_profile(&mut self) {
        for rank in &mut self.ranks {
            rank.enable_profile();
        }
    }

    /// The time `rank` spent in each of its program's instructions since profiling was enabled.
    pub fn profile(&self, rank: usize) -> Option<&[std::time::Duration]> {
        self.executor(rank)?.profile()
    }

    /// Ranks running the plan.
    pub fn world_size(&self) -> usize {
        self.topology.world_size()
    }

    /// What each rank of the job actually allocated (its arena plus the most communication
    /// staging it held) and the bytes it sent since the trainer was made, by collective. In a
    /// job of processes, every process takes part (they exchange their figures).
    pub fn measured(&self) -> Result<Vec<(usize, CommBytes)>, RuntimeError> {
        let local: Vec<(usize, CommBytes)> = self
            .local_ranks()
            .map(|rank| {
                let arena = self.executor(rank).expect("a local rank").arena_bytes();
                match &self.comm {
                    Some(comm) => (arena + comm.staging_peak(rank), comm.bytes_sent(rank)),
                    None => (arena, CommBytes::default()),
                }
            })
            .collect();
        let Some(job) = &self.processes else { return Ok(local) };
        let [(peak, sent)] = &local[..] else { unreachable!("a process runs one rank") };
        let figures = [*peak, sent.all_reduce, sent.all_gather, sent.reduce_scatter, sent.send];
        let bytes: Vec<u8> = figures.iter().flat_map(|&f| (f as u64).to_le_bytes()).collect();
        let all = job.all_gather(&bytes)?;
        Ok(all
            .chunks(bytes.len())
            .map(|rank| {
                let f: Vec<usize> =
                    rank.chunks(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize).collect();
                let sent = CommBytes { all_reduce: f[1], all_gather: f[2], reduce_scatter: f[3], send: f[4] };
                (f[0], sent)
            })
            .collect())
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

    /// Restores parameters, optimizer state, step and RNG state from `checkpoint`, which must
    /// come from this same compiled plan.
    pub fn resume(&mut self, checkpoint: &Checkpoint) -> Result<(), RuntimeError> {
        let m = &checkpoint.manifest;
        if m.plan_fingerprint != self.fingerprint && !self.same_training(checkpoint) {
            return Err(RuntimeError::Checkpoint {
                path: checkpoint.dir.clone(),
                message: format!(
                    "was written by another compiled plan (model '{}' from {}, fingerprint {}) than this one \
                     (model '{}' from {}, fingerprint {}){}; resume it with the plan it was trained with, or \
                     with another parallel layout of the same training",
                    m.model.name,
                    m.model.path.display(),
                    short(&m.plan_fingerprint),
                    self.model.name,
                    self.model.path.display(),
                    short(&self.fingerprint),
                    self.difference(checkpoint)
                ),
            });
        }
        let error = |message: String| RuntimeError::Checkpoint { path: checkpoint.dir.clone(), message };
        for slot in self.model_slots() {
            let (dtype, stored) =
                checkpoint.stored_type(&slot.name).ok_or_else(|| error(format!("has no tensor '{}'", slot.name)))?;
            let shape = self.stored_shape(&slot);
            if dtype != slot.dtype || stored != shape {
                return Err(error(format!(
                    "tensor '{}' is {dtype}{stored:?}, the plan needs {}{shape:?}",
                    slot.name, slot.dtype
                )));
            }
            // Each rank reads its own block (each stage holding it in its own placement).
            for rank in self.local_ranks() {
                let Some(own) = self.held_by(rank, &slot.name) else { continue };
                if own.placements.contains(&Placement::PartialSum) {
                    return Err(RuntimeError::Plan(format!(
                        "holds '{}' as partial sums, which cannot be loaded",
                        own.name
                    )));
                }
                let (offsets, extent) =
                    shard_block(&own.global_shape, &own.cuts(&self.program().mesh, &self.coordinates(rank)));
                let mut block = vec![0u8; own.region.len];
                checkpoint
                    .read_block(&own.name, &own.global_shape, &offsets, &extent, &mut block)
                    .ok_or_else(|| error(format!("does not hold all of rank {rank}'s block of '{}'", slot.name)))?;
                self.ranks[rank - self.first_rank].load_slot(&slot.name, &block)?;
            }
        }
        self.completed = m.step;
        self.skipped = m.skipped_steps;
        if self.scaler.is_some() {
            self.scaler = Some(m.loss_scaler.clone().ok_or_else(|| error("holds no loss scaler state".into()))?);
        }
        self.seed = m.rng.seed;
        Ok(())
    }

    /// Whether `checkpoint` was written by another layout of this training: the same model
    /// (every parameter and state there, of its type and global shape), sequence length, global
    /// batch, optimizer, clipping, schedule and frozen parameters. Its tensors are stored whole
    /// (each rank's block at its place), so this plan's ranks read their own blocks of them, as
    /// DeepSpeed's universal checkpoints let a run change its parallel layout.
    fn same_training(&self, checkpoint: &Checkpoint) -> bool {
        checkpoint.manifest.model.name == self.model.name && self.difference(checkpoint).is_empty()
    }

    /// Why `checkpoint` does not fit, for the refusal message: the first tensor that differs,
    /// or the training settings that do.
    fn difference(&self, checkpoint: &Checkpoint) -> String {
        for slot in &self.model_slots() {
            match checkpoint.stored_type(&slot.name) {
                None => return format!(": the checkpoint has no tensor '{}'", slot.name),
                Some((dtype, shape)) if dtype != slot.dtype || shape != self.stored_shape(slot) => {
                    return format!(
                        ": its '{}' is {dtype}{shape:?}, here it is {}{:?}",
                        slot.name,
                        slot.dtype,
                        self.stored_shape(slot)
                    )
                }
                Some(_) => {}
            }
        }
        let (theirs, ours) = (&checkpoint.manifest.training, &self.training);
        let mut differ = Vec::new();
        if theirs.seq_len != ours.seq_len {
            differ.push(format!("seq-len {} vs {}", theirs.seq_len, ours.seq_len));
        }
        if theirs.global_batch != ours.global_batch {
            differ.push(format!("global batch {} vs {}", theirs.global_batch, ours.global_batch));
        }
        if theirs.schedule != ours.schedule {
            differ.push(format!("lr schedule {} vs {}", theirs.schedule, ours.schedule));
        }
        if theirs.optimizer != ours.optimizer {
            differ.push(format!("optimizer {} vs {}", theirs.optimizer, ours.optimizer));
        }
        if theirs.grad_clip != ours.grad_clip {
            differ.push(format!("grad-clip {:?} vs {:?}", theirs.grad_clip, ours.grad_clip));
        }
        if theirs.frozen != ours.frozen {
            differ.push("frozen parameters".to_string());
        }
        if differ.is_empty() {
            String::new()
        } else {
            format!(": {}", differ.join(", "))
        }
    }

    /// Runs the next optimizer step. `train_steps` is the run's length, for schedules that decay
    /// over the run.
    pub fn step(&mut self, data: &TokenData, train_steps: usize) -> Result<StepMetrics, RuntimeError> {
        let t = &self.training;
        if data.seq_len() != t.seq_len {
            return Err(RuntimeError::Plan(format!(
                "was compiled for sequences of {} tokens; the data was cut into windows of {}",
                t.seq_len,
                data.seq_len()
            )));
        }
        let step = self.completed;
        let batch = data.batch(step, t.global_batch);
        // A skipped step moves neither AdamW's step nor the schedule (as DeepSpeed).
        let optimizer_step = step - self.skipped;
        let lr = t.schedule.lr(optimizer_step, train_steps);
        let loss_scale = self.scaler.as_ref().map(LossScaler::scale);
        let tokens = t.global_token_shape();
        let ids = |values: &[i64]| HostTensor {
            dtype: DType::I64,
            shape: tokens.clone(),
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let scalar = |v: f32| HostTensor { dtype: DType::F32, shape: vec![], data: v.to_le_bytes().to_vec() };
        let global = |feed: &StepInput| match feed {
            StepInput::InputIds => ids(&batch.input_ids),
            StepInput::Labels => match t.labels {
                Labels::NextTokens => ids(&batch.labels),
                Labels::InputIds => ids(&batch.input_ids),
            },
            StepInput::Lr => scalar(lr as f32),
            StepInput::Step => scalar((optimizer_step + 1) as f32),
            StepInput::LossScale => scalar(loss_scale.expect("a loss scale input has a scaler") as f32),
        };
        let global: Vec<Vec<HostTensor>> = self.feeds.iter().map(|feeds| feeds.iter().map(global).collect()).collect();
        let feeds: Vec<Vec<HostTensor>> = self
            .local_ranks()
            .map(|rank| {
                let stage = self.topology.stage(rank);
                self.rank_program(rank)
                    .inputs
                    .iter()
                    .zip(&global[stage])
                    .map(|(slot, g)| HostTensor {
                        dtype: g.dtype,
                        shape: slot.shape.clone(),
                        data: self.block(slot, rank, &g.data).into_owned(),
                    })
                    .collect()
            })
            .collect();
        let start = Instant::now();
        let outputs = self.run_ranks(&feeds)?;
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
        let scalar_outputs: Vec<usize> = (0..program.outputs.len())
            .filter(|&i| program.outputs[i].numel() == 1 && program.outputs[i].dtype == DType::F32)
            .collect();
        let mut values: Vec<f64> = match &outputs {
            Some(outputs) => {
                let value = |i: usize| f32::from_le_bytes(outputs[i].data[..4].try_into().expect("4 bytes")) as f64;
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
        self.skipped += skipped as usize;
        if let Some(scaler) = &mut self.scaler {
            scaler.update(skipped).map_err(|e| RuntimeError::Training(format!("step {}: {e}", step + 1)))?;
        }
        Ok(StepMetrics { step: step + 1, lr, loss: values[0], scalars, seconds, idle, loss_scale, skipped })
    }

    /// The rank whose outputs a step reports: the last stage's first (outputs are replicated
    /// over the mesh).
    fn reporting_rank(&self) -> usize {
        self.world_size() - self.stage_size()
    }

    /// Runs this process's ranks on their feeds (each a thread when there are several); returns
    /// the outputs of the reporting rank, if it is one of them. A failing rank aborts the
    /// others' communication.
    fn run_ranks(&mut self, feeds: &[Vec<HostTensor>]) -> Result<Option<Vec<HostTensor>>, RuntimeError> {
        let reporting = self.reporting_rank();
        if let [only] = &mut self.ranks[..] {
            let outputs = match self.pools.first() {
                Some(pool) => pool.install(|| only.run(&feeds[0]))?,
                None => only.run(&feeds[0])?,
            };
            return Ok((self.first_rank == reporting).then_some(outputs));
        }
        let comm = self.comm.clone().expect("several ranks have a communicator");
        let results: Vec<Result<Vec<HostTensor>, RuntimeError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .ranks
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

    /// The current parameters (global tensors), by name.
    pub fn params(&self) -> Result<Vec<SlotBytes<'_>>, RuntimeError> {
        self.param_slots().into_iter().map(|s| Ok((s.clone(), self.read_global(&s)?))).collect()
    }

    /// Each rank here whose optimizer state is in a file (`--offload-optimizer nvme`), and
    /// where its file stands.
    pub fn nvme_status(&self) -> Vec<(usize, crate::nvme::NvmeStatus<'_>)> {
        (self.ranks.iter().enumerate()).filter_map(|(i, e)| Some((self.first_rank + i, e.nvme_status()?))).collect()
    }

    /// The current optimizer states (global tensors), by name.
    pub fn states(&self) -> Result<Vec<SlotBytes<'_>>, RuntimeError> {
        self.first_held(|p| &p.states).into_iter().map(|s| Ok((s.clone(), self.read_global(&s)?))).collect()
    }

    /// The current parameters as the model has them: global tensors in their weight files'
    /// shapes, parts joined into their weights.
    pub fn model_params(&self) -> Result<Vec<checkpoint::StoredTensor<'_>>, RuntimeError> {
        Ok(self.model_tensors(self.params()?))
    }

    /// The current optimizer states as [`Trainer::model_params`] gives the parameters.
    pub fn model_states(&self) -> Result<Vec<checkpoint::StoredTensor<'_>>, RuntimeError> {
        Ok(self.model_tensors(self.states()?))
    }

    fn model_tensors<'a>(&self, tensors: Vec<(Slot, Cow<'a, [u8]>)>) -> Vec<checkpoint::StoredTensor<'a>> {
        let stored = tensors
            .into_iter()
            .map(|(slot, bytes)| checkpoint::StoredTensor {
                shape: self.stored_shape(&slot),
                name: slot.name,
                dtype: slot.dtype,
                bytes,
            })
            .collect();
        checkpoint::join_parts(&self.training, stored)
    }

    /// Saves a checkpoint of the current state under `dir` (see [`checkpoint`]).
    pub fn save(
        &self,
        dir: &Path,
        data: &TokenData,
        train_steps: usize,
        keep_last: Option<usize>,
    ) -> Result<PathBuf, RuntimeError> {
        let manifest = Manifest {
            format: checkpoint::FORMAT.to_string(),
            step: self.completed,
            plan_fingerprint: self.fingerprint.clone(),
            model: self.model.clone(),
            training: self.training.clone(),
            train_steps,
            data: DataPosition {
                path: data.path().to_path_buf(),
                dtype: data.dtype().name().to_string(),
                tokens: data.tokens(),
                windows: data.windows(),
                next_window: (self.completed * self.training.global_batch) % data.windows(),
            },
            rng: RngState { seed: self.seed },
            files: BTreeMap::new(),
            params: Vec::new(),
            shapes: BTreeMap::new(),
            blocks: BTreeMap::new(),
            loss_scaler: self.scaler.clone(),
            skipped_steps: self.skipped,
        };
        if self.world_size() > 1 {
            return self.save_shards(dir, &manifest, keep_last);
        }
        let (params, states) = (self.params()?, self.states()?);
        let (mut params, states) = (refs(&params), refs(&states));
        for t in &mut params {
            if let Some(shape) = self.training.weight_shapes.get(&t.name) {
                t.shape = shape.clone();
            }
        }
        checkpoint::save(dir, &manifest, &params, &states, keep_last)
    }
}

impl Trainer {
    /// The slots `rank` writes to its checkpoint file, with their offsets in the global tensor:
    /// the blocks of its stage's parameters and states that it owns. A block replicated over a
    /// mesh axis is owned by that axis's rank 0, a slot two stages hold (tied embeddings) by
    /// the first.
    fn owned_blocks(&self, rank: usize) -> Vec<(&Slot, Vec<usize>)> {
        let stage = self.topology.stage(rank);
        let first_stage =
            |name: &str| self.programs.iter().position(|p| p.params.iter().chain(&p.states).any(|s| s.name == name));
        let coords = self.coordinates(rank);
        let program = &self.programs[stage];
        program
            .params
            .iter()
            .chain(&program.states)
            .filter(|slot| {
                first_stage(&slot.name) == Some(stage)
                    && slot.placements.iter().zip(&coords).all(|(p, &c)| *p != Placement::Replicate || c == 0)
            })
            .map(|slot| (slot, shard_block(&slot.global_shape, &slot.cuts(&program.mesh, &coords)).0))
            .collect()
    }

    /// `rank`'s checkpoint file name and the bytes of the blocks it owns (downloaded from a
    /// GPU), with their offsets in the global tensors.
    fn rank_blocks(&self, rank: usize) -> Result<(String, Vec<RankBlock<'_>>), RuntimeError> {
        let exec = self.executor(rank).expect("a rank of this process");
        let blocks = (self.owned_blocks(rank).into_iter())
            .map(|(slot, offsets)| Ok((slot, offsets, exec.read_slot(&slot.name).expect("a slot of the program")?)))
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        Ok((rank_file_name(rank), blocks))
    }

    /// Saves each rank's blocks of parameters and states to its own file. In a job of
    /// processes each writes its own, and rank 0 makes them a checkpoint once all are written.
    fn save_shards(&self, dir: &Path, manifest: &Manifest, keep_last: Option<usize>) -> Result<PathBuf, RuntimeError> {
        // The model's parameters: a weight trained in parts once.
        let mut params: Vec<String> = Vec::new();
        for slot in self.param_slots() {
            let name = self.training.part_of(&slot.name).map_or(slot.name, |(weight, _)| weight);
            if !params.contains(&name) {
                params.push(name);
            }
        }
        let Some(job) = &self.processes else {
            let blocks = self.local_ranks().map(|rank| self.rank_blocks(rank)).collect::<Result<Vec<_>, _>>()?;
            let files = blocks.iter().map(|(file, blocks)| (file.clone(), saved_blocks(blocks))).collect();
            return checkpoint::save_files(dir, manifest, params, files, keep_last);
        };
        let layout: Vec<checkpoint::FileLayout> = (0..self.world_size())
            .map(|rank| {
                let blocks = self.owned_blocks(rank);
                let tensors = blocks
                    .into_iter()
                    .map(|(slot, offsets)| (slot.name.clone(), Some((offsets, slot.global_shape.clone()))))
                    .collect();
                (rank_file_name(rank), tensors)
            })
            .collect();
        // Rank 0 prepares the staging directory, named after its process id.
        let mut id = (std::process::id() as u64).to_le_bytes();
        job.broadcast(0, &mut id)?;
        let job_id = u64::from_le_bytes(id);
        let staging = if job.rank() == 0 {
            checkpoint::stage(dir, manifest.step, job_id)?
        } else {
            checkpoint::staging_dir(dir, manifest.step, job_id)
        };
        job.barrier()?;
        let (file, blocks) = self.rank_blocks(job.rank())?;
        checkpoint::write_file(&staging, &file, &saved_blocks(&blocks))?;
        checkpoint::stop_if_asked(job.rank(), manifest.step);
        if job.rank() == 0 {
            checkpoint::crash_if_asked(manifest.step, &staging);
        }
        job.barrier()?;
        let target = if job.rank() == 0 {
            checkpoint::commit(dir, &staging, &checkpoint::with_layout(manifest, params, &layout), keep_last)?
        } else {
            dir.join(checkpoint::step_dir_name(manifest.step))
        };
        job.barrier()?;
        Ok(target)
    }
}

/// The checkpoint file of a rank's blocks.
/// A parameter's or state's slot and its current bytes (global, or one rank's block).
pub type SlotBytes<'a> = (Slot, Cow<'a, [u8]>);

/// A block a rank saves: its slot, its offsets in the global tensor, its bytes.
type RankBlock<'a> = (&'a Slot, Vec<usize>, Cow<'a, [u8]>);

/// Blocks of [`Trainer::rank_blocks`] as a checkpoint file's contents.
fn saved_blocks<'a>(blocks: &'a [RankBlock<'_>]) -> Vec<checkpoint::SavedBlock<'a>> {
    (blocks.iter())
        .map(|(slot, offsets, bytes)| checkpoint::SavedBlock {
            tensor: TensorRef { name: slot.name.clone(), dtype: slot.dtype, shape: slot.shape.clone(), bytes },
            offsets: Some((offsets.clone(), slot.global_shape.clone())),
        })
        .collect()
}

fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Kernel threads per rank when `ranks` ranks share the available cores (at least one each).
fn shared_cores(ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks).max(1)
}

/// A kernel thread pool of `threads` threads per rank.
fn rank_pools(ranks: usize, threads: usize) -> Result<Vec<rayon::ThreadPool>, RuntimeError> {
    (0..ranks)
        .map(|rank| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(move |i| format!("autotp-rank{rank}-{i}"))
                .build()
                .map_err(|e| RuntimeError::Plan(format!("cannot start rank {rank}'s kernel threads: {e}")))
        })
        .collect()
}

/// Borrows global tensors as the checkpoint writer takes them.
fn refs<'a>(tensors: &'a [(Slot, Cow<'_, [u8]>)]) -> Vec<TensorRef<'a>> {
    tensors
        .iter()
        .map(|(s, bytes)| TensorRef { name: s.name.clone(), dtype: s.dtype, shape: s.global_shape.clone(), bytes })
        .collect()
}

/// The first 12 hex digits of a fingerprint, enough to tell two apart in a message.
fn short(fingerprint: &str) -> &str {
    &fingerprint[..fingerprint.len().min(12)]
}

/// Little-endian f64s.
fn f64s(bytes: &[u8]) -> Vec<f64> {
    bytes.chunks(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
}

/// Initial weights (f32, as models are exported) in a slot's type: rounded to nearest for a
/// 16-bit parameter of a mixed-precision plan; as they are where they already fit.
fn in_slot_type<'a>(slot: &Slot, weights: &'a [u8]) -> Result<Cow<'a, [u8]>, RuntimeError> {
    let elements = slot.global_shape.iter().product::<usize>();
    if slot.dtype == DType::F32 || weights.len() != elements * DType::F32.size() {
        return Ok(Cow::Borrowed(weights));
    }
    let mut converted = vec![0u8; elements * slot.dtype.size()];
    Kernel::Cast { from: DType::F32, to: slot.dtype }
        .run(&[weights], &mut [&mut converted])
        .map_err(|source| RuntimeError::Kernel { label: format!("initial weights of '{}'", slot.name), source })?;
    Ok(Cow::Owned(converted))
}
