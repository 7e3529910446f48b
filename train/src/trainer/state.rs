//! The trainer's tensors as the model has them: each rank's block of a global tensor loaded
//! and read back, checkpoints saved by each rank's blocks and resumed (under another layout of
//! the same training too), and the model's parameters and states in model shape for `export`
//! and `verify`.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use autotp_kernels::shape::{extract_block, insert_block, shard_block};
use autotp_kernels::{DType, Kernel};
use autotp_program::tensor_file::TensorRef;
use autotp_program::{Placement, ProgramError, Slot};
use autotp_runtime::RuntimeError;

use super::Trainer;
use crate::checkpoint::{self, Checkpoint, DataPosition, Manifest, RngState};
use crate::dataset::TrainingData;
use crate::TrainError;

impl Trainer {
    /// The parameter or state `name` as `rank`'s stage holds it (each stage holding one places
    /// it its own way: a tied embedding's two uses).
    pub(super) fn held_by(&self, rank: usize, name: &str) -> Option<&Slot> {
        let program = self.rank_program(rank);
        program.params.iter().chain(&program.states).find(|s| s.name == name)
    }

    /// Rank `rank`'s block of a global tensor for `slot`.
    pub(super) fn block<'a>(&self, slot: &Slot, rank: usize, global: &'a [u8]) -> Cow<'a, [u8]> {
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
    pub(super) fn stored_shape(&self, slot: &Slot) -> Vec<usize> {
        self.training.weight_shapes.get(&slot.name).cloned().unwrap_or_else(|| slot.global_shape.clone())
    }

    /// Loads a parameter or state from its global bytes: each rank takes its block.
    pub(super) fn load_global(&mut self, slot: &Slot, global: &[u8]) -> Result<(), TrainError> {
        let expected = slot.global_shape.iter().product::<usize>() * slot.dtype.size();
        if global.len() != expected || slot.placements.contains(&Placement::PartialSum) {
            return Err(
                ProgramError::WrongSize { what: format!("'{}'", slot.name), expected, got: global.len() }.into()
            );
        }
        for rank in self.local_ranks() {
            // Each stage holding it places it its own way (a tied embedding's two uses).
            let Some(own) = self.held_by(rank, &slot.name) else { continue };
            if own.global_shape != slot.global_shape || own.placements.contains(&Placement::PartialSum) {
                return Err(TrainError::plan(format!("stages hold '{}' in different shapes", slot.name)));
            }
            let block = self.block(own, rank, global).into_owned();
            self.ranks[rank - self.first_rank].load_slot(&slot.name, &block)?;
        }
        Ok(())
    }

    /// The global bytes of a parameter or state, reassembled from the blocks of the first stage
    /// holding it. Only a trainer that runs every rank has them all.
    pub(super) fn read_global(&self, slot: &Slot) -> Result<Cow<'_, [u8]>, TrainError> {
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
            return Ok(local(first)?);
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

    /// Restores parameters, optimizer state, step and RNG state from `checkpoint`, which must
    /// come from this same compiled plan.
    pub fn resume(&mut self, checkpoint: &Checkpoint) -> Result<(), TrainError> {
        let m = &checkpoint.manifest;
        if m.plan_fingerprint != self.fingerprint && !self.same_training(checkpoint) {
            return Err(TrainError::Checkpoint {
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
        let error = |message: String| TrainError::Checkpoint { path: checkpoint.dir.clone(), message };
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
                    return Err(TrainError::plan(format!(
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
    pub(super) fn same_training(&self, checkpoint: &Checkpoint) -> bool {
        checkpoint.manifest.model.name == self.model.name && self.difference(checkpoint).is_empty()
    }

    /// Why `checkpoint` does not fit, for the refusal message: the first tensor that differs,
    /// or the training settings that do.
    pub(super) fn difference(&self, checkpoint: &Checkpoint) -> String {
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

    /// The current parameters (global tensors), by name.
    pub fn params(&self) -> Result<Vec<SlotBytes<'_>>, TrainError> {
        self.param_slots().into_iter().map(|s| Ok((s.clone(), self.read_global(&s)?))).collect()
    }

    /// The current optimizer states (global tensors), by name.
    pub fn states(&self) -> Result<Vec<SlotBytes<'_>>, TrainError> {
        self.first_held(|p| &p.states).into_iter().map(|s| Ok((s.clone(), self.read_global(&s)?))).collect()
    }

    /// The current parameters as the model has them: global tensors in their weight files'
    /// shapes, parts joined into their weights.
    pub fn model_params(&self) -> Result<Vec<checkpoint::StoredTensor<'_>>, TrainError> {
        Ok(self.model_tensors(self.params()?))
    }

    /// The current optimizer states as [`Trainer::model_params`] gives the parameters.
    pub fn model_states(&self) -> Result<Vec<checkpoint::StoredTensor<'_>>, TrainError> {
        Ok(self.model_tensors(self.states()?))
    }

    pub(super) fn model_tensors<'a>(&self, tensors: Vec<(Slot, Cow<'a, [u8]>)>) -> Vec<checkpoint::StoredTensor<'a>> {
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
        data: &TrainingData,
        train_steps: usize,
        keep_last: Option<usize>,
    ) -> Result<PathBuf, TrainError> {
        let manifest = Manifest {
            format: checkpoint::FORMAT.to_string(),
            step: self.completed,
            plan_fingerprint: self.fingerprint.clone(),
            model: self.model.clone(),
            training: self.training.clone(),
            train_steps,
            data: DataPosition {
                path: data.path(),
                dtype: data.dtype_name().to_string(),
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
            checksum: None,
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
    fn rank_blocks(&self, rank: usize) -> Result<(String, Vec<RankBlock<'_>>), TrainError> {
        let exec = self.executor(rank).expect("a rank of this process");
        let blocks = (self.owned_blocks(rank).into_iter())
            .map(|(slot, offsets)| Ok((slot, offsets, exec.read_slot(&slot.name).expect("a slot of the program")?)))
            .collect::<Result<Vec<_>, TrainError>>()?;
        Ok((rank_file_name(rank), blocks))
    }

    /// Saves each rank's blocks of parameters and states to its own file. In a job of
    /// processes each writes its own, and rank 0 makes them a checkpoint once all are written.
    fn save_shards(&self, dir: &Path, manifest: &Manifest, keep_last: Option<usize>) -> Result<PathBuf, TrainError> {
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
        let step = manifest.step;
        let staging = if job.rank() == 0 {
            checkpoint::stage(dir, step, job_id).map_err(|e| checkpoint::abandoned(dir, None, step, e))?
        } else {
            checkpoint::staging_dir(dir, step, job_id)
        };
        job.barrier()?;
        let (file, blocks) = self.rank_blocks(job.rank())?;
        // A rank that cannot write its file ends the job (its error ends it through MPI).
        checkpoint::write_file(&staging, &file, &saved_blocks(&blocks))
            .map_err(|e| checkpoint::abandoned(dir, Some(&staging), step, e))?;
        checkpoint::stop_if_asked(job.rank(), step);
        if job.rank() == 0 {
            checkpoint::crash_if_asked(step, &staging);
        }
        job.barrier()?;
        let target = if job.rank() == 0 {
            checkpoint::commit(dir, &staging, &checkpoint::with_layout(manifest, params, &layout), keep_last)
                .map_err(|e| checkpoint::abandoned(dir, Some(&staging), step, e))?
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

/// Initial weights (f32, as models are exported) in a slot's type: rounded to nearest for a
/// 16-bit parameter of a mixed-precision plan; as they are where they already fit.
pub(super) fn in_slot_type<'a>(slot: &Slot, weights: &'a [u8]) -> Result<Cow<'a, [u8]>, TrainError> {
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
