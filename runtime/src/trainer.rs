//! The training loop's engine: a loaded [`TrainingPlan`] that runs one optimizer step after
//! another over the token data, following the data contract (step s uses windows
//! (s*G + j) mod W), feeds the learning rate of its schedule, and saves and resumes
//! checkpoints. The command line adds the progress bar and the metrics file around it.
//!
//! Determinism: a step's result depends only on the weights and states before it, the step
//! number and the data, so resuming from a checkpoint of step k and running to step n gives
//! bit-identical losses to an uninterrupted run (tests/checkpoint.rs checks it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use autotp_kernels::DType;

use crate::checkpoint::{self, Checkpoint, DataPosition, Manifest, RngState};
use crate::data::TokenData;
use crate::plan::{Feed, Labels, ModelSource, TrainingConfig, TrainingPlan};
use crate::tensor_file::TensorRef;
use crate::{Executor, HostTensor, RuntimeError, Slot};

/// What one step reported.
#[derive(Clone, Debug, PartialEq)]
pub struct StepMetrics {
    /// 1-based.
    pub step: usize,
    pub lr: f64,
    pub loss: f64,
    /// Every scalar output of the step (the loss, `grad_norm` when clipping), by name.
    pub scalars: Vec<(String, f64)>,
    pub seconds: f64,
}

pub struct Trainer {
    exec: Executor,
    training: TrainingConfig,
    model: ModelSource,
    fingerprint: String,
    feeds: Vec<Feed>,
    loss_index: usize,
    completed: usize,
    seed: u64,
}

impl Trainer {
    /// Loads `plan` with its initial `weights` (by parameter name); optimizer states start at
    /// zero and the step count at 0.
    pub fn new(plan: TrainingPlan, weights: &BTreeMap<String, &[u8]>, seed: u64) -> Result<Trainer, RuntimeError> {
        let feeds = plan.feeds()?;
        let loss_index = plan.loss_index()?;
        let t = &plan.training;
        if t.global_batch != t.micro_batch {
            return Err(RuntimeError::Plan(format!(
                "has a global batch of {} but a micro-batch of {}: one rank without gradient accumulation needs them equal",
                t.global_batch, t.micro_batch
            )));
        }
        let fingerprint = plan.program.fingerprint();
        let TrainingPlan { program, training, model } = plan;
        let mut exec = Executor::new(program)?;
        let params: Vec<String> = exec.program().params.iter().map(|s| s.name.clone()).collect();
        for name in params {
            let bytes = weights
                .get(&name)
                .ok_or_else(|| RuntimeError::Plan(format!("parameter '{name}' has no initial weights")))?;
            exec.load_slot(&name, bytes)?;
        }
        Ok(Trainer { exec, training, model, fingerprint, feeds, loss_index, completed: 0, seed })
    }

    pub fn training(&self) -> &TrainingConfig {
        &self.training
    }

    pub fn program(&self) -> &crate::Program {
        self.exec.program()
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Optimizer steps done so far (after a resume, the checkpoint's).
    pub fn completed_steps(&self) -> usize {
        self.completed
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
        if m.plan_fingerprint != self.fingerprint {
            return Err(RuntimeError::Checkpoint {
                path: checkpoint.dir.clone(),
                message: format!(
                    "was written by another compiled plan (model '{}' from {}, fingerprint {}) than this one \
                     (model '{}' from {}, fingerprint {}){}; resume it with the plan it was trained with",
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
        let program = self.exec.program();
        let slots: Vec<Slot> = program.params.iter().chain(&program.states).cloned().collect();
        for slot in slots {
            let tensor = checkpoint.tensor(&slot.name).ok_or_else(|| RuntimeError::Checkpoint {
                path: checkpoint.dir.clone(),
                message: format!("has no tensor '{}'", slot.name),
            })?;
            if tensor.dtype != slot.dtype || tensor.shape != slot.shape {
                return Err(RuntimeError::Checkpoint {
                    path: checkpoint.dir.clone(),
                    message: format!(
                        "tensor '{}' is {}{:?}, the plan needs {}{:?}",
                        slot.name, tensor.dtype, tensor.shape, slot.dtype, slot.shape
                    ),
                });
            }
            self.exec.load_slot(&slot.name, tensor.bytes)?;
        }
        self.completed = m.step;
        self.seed = m.rng.seed;
        Ok(())
    }

    /// Why `checkpoint` does not fit, for the refusal message: the first tensor that differs,
    /// or the training settings that do.
    fn difference(&self, checkpoint: &Checkpoint) -> String {
        let program = self.exec.program();
        for slot in program.params.iter().chain(&program.states) {
            match checkpoint.tensor(&slot.name) {
                None => return format!(": the checkpoint has no tensor '{}'", slot.name),
                Some(t) if t.dtype != slot.dtype || t.shape != slot.shape => {
                    return format!(
                        ": its '{}' is {}{:?}, here it is {}{:?}",
                        slot.name, t.dtype, t.shape, slot.dtype, slot.shape
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
        if theirs.micro_batch != ours.micro_batch {
            differ.push(format!("micro-batch {} vs {}", theirs.micro_batch, ours.micro_batch));
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
        let lr = t.schedule.lr(step, train_steps);
        let tokens = vec![t.micro_batch, t.seq_len];
        let ids = |values: &[i64]| HostTensor {
            dtype: DType::I64,
            shape: tokens.clone(),
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let scalar = |v: f32| HostTensor { dtype: DType::F32, shape: vec![], data: v.to_le_bytes().to_vec() };
        let feed: Vec<HostTensor> = self
            .feeds
            .iter()
            .map(|feed| match feed {
                Feed::InputIds => ids(&batch.input_ids),
                Feed::Labels => match t.labels {
                    Labels::NextTokens => ids(&batch.labels),
                    Labels::InputIds => ids(&batch.input_ids),
                },
                Feed::Lr => scalar(lr as f32),
                Feed::Step => scalar((step + 1) as f32),
            })
            .collect();
        let start = Instant::now();
        let outputs = self.exec.run(&feed)?;
        let seconds = start.elapsed().as_secs_f64();
        self.completed += 1;
        let program = self.exec.program();
        let scalars: Vec<(String, f64)> = program
            .outputs
            .iter()
            .zip(&outputs)
            .filter(|(slot, _)| slot.numel() == 1 && slot.dtype == DType::F32)
            .map(|(slot, t)| (slot.name.clone(), f32::from_le_bytes(t.data[..4].try_into().expect("4 bytes")) as f64))
            .collect();
        let loss = f32::from_le_bytes(outputs[self.loss_index].data[..4].try_into().expect("a scalar f32 loss")) as f64;
        Ok(StepMetrics { step: step + 1, lr, loss, scalars, seconds })
    }

    /// The current parameters, by name.
    pub fn params(&self) -> Vec<TensorRef<'_>> {
        self.tensors(&self.exec.program().params)
    }

    fn tensors<'a>(&'a self, slots: &[Slot]) -> Vec<TensorRef<'a>> {
        slots
            .iter()
            .map(|s| TensorRef {
                name: s.name.clone(),
                dtype: s.dtype,
                shape: s.shape.clone(),
                bytes: self.exec.read_slot(&s.name).expect("a slot of the program"),
            })
            .collect()
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
        };
        let program = self.exec.program();
        checkpoint::save(dir, &manifest, &self.params(), &self.tensors(&program.states), keep_last)
    }
}

/// The first 12 hex digits of a fingerprint, enough to tell two apart in a message.
fn short(fingerprint: &str) -> &str {
    &fingerprint[..fingerprint.len().min(12)]
}
