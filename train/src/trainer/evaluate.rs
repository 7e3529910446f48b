//! Validation (`run --eval-every N --eval-iters K`): the plan's evaluation step
//! ([`Evaluation`]) on the first K global batches of the validation data, with the parameters
//! the training step holds now.
//!
//! The evaluation programs are compiled for the training step's layout, so each rank's
//! evaluation program holds the same blocks of the same parameters as its training program:
//! before each evaluation every rank copies its blocks across (its own memory, no
//! communication). Nothing flows back: no gradient is made, no optimizer state, loss scale or
//! step count is touched, and a training run with evaluations is bit-identical to one without
//! (tests/validation.rs checks it). The batches are the same ones at every evaluation, so the losses of
//! one run compare with each other (Megatron's validation iterator moves on instead).

use std::sync::Arc;
use std::time::Instant;

use autotp_program::plan::Evaluation;
use autotp_runtime::comm::{Communicator, LocalComm};

use super::{load_ranks, scalar_value, Programs, StepInputs, Trainer};
use crate::dataset::TrainingData;
use crate::TrainError;

/// What one evaluation measured.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalMetrics {
    /// The mean of the batches' mean losses.
    pub loss: f64,
    /// Global batches evaluated.
    pub batches: usize,
    pub seconds: f64,
}

impl EvalMetrics {
    /// `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

impl Trainer {
    /// The validation loss of the current parameters over the first `batches` global batches of
    /// `data` (the training step's batch size and sequence length). The evaluation programs
    /// load at the first call.
    pub fn evaluate(&mut self, data: &TrainingData, batches: usize) -> Result<EvalMetrics, TrainError> {
        let programs = match &self.evaluation {
            Evaluation::Programs(programs) => programs,
            Evaluation::Refused(why) => return Err(TrainError::plan(format!("has no validation step: {why}"))),
        };
        self.check_windows(data, "validation data")?;
        let t = &self.training;
        if batches == 0 {
            return Err(TrainError::plan("evaluates at least one batch (--eval-iters 0)".into()));
        }
        let loss_index = (programs.last().expect("checked when the plan loaded").outputs.iter())
            .position(|slot| slot.name == t.loss_output)
            .expect("checked when the plan loaded");
        if self.evaluators.is_empty() {
            self.load_evaluators(programs.clone())?;
        }
        let job = self.processes.is_some();
        for (training, evaluation) in self.ranks.iter().zip(&mut self.evaluators) {
            let names: Vec<String> = evaluation.program().params.iter().map(|slot| slot.name.clone()).collect();
            for name in names {
                let missing =
                    || TrainError::plan(format!("'s training program lacks '{name}', which its validation reads"));
                let bytes = training.read_slot(&name).ok_or_else(missing)??;
                evaluation.load_slot(&name, &bytes)?;
            }
            if job {
                evaluation.continue_collectives(training.collectives_issued())?;
            }
        }
        let start = Instant::now();
        let mut total = 0.0;
        for b in 0..batches {
            let batch = data.batch(b, self.training.global_batch);
            let loss_scale = self.scaler.as_ref().map(|s| s.scale());
            let inputs = StepInputs { batch: &batch, lr: 0.0, step: self.completed + 1, loss_scale };
            let feeds = self.rank_feeds(self.evaluation.programs(), &inputs);
            let outputs = self.run_ranks(Programs::Evaluation, &feeds)?;
            let mut loss = outputs.map_or(0.0, |outputs| scalar_value(&outputs[loss_index]));
            if let Some(job) = &self.processes {
                let mut bytes = loss.to_le_bytes().to_vec();
                job.broadcast(self.reporting_rank(), &mut bytes)?;
                loss = f64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
            }
            total += loss;
        }
        if job {
            for (training, evaluation) in self.ranks.iter_mut().zip(&self.evaluators) {
                training.continue_collectives(evaluation.collectives_issued())?;
            }
        }
        let loss = total / batches as f64;
        Ok(EvalMetrics { loss, batches, seconds: start.elapsed().as_secs_f64() })
    }

    /// Loads the evaluation `programs` on this process's ranks. Rank threads get a
    /// communicator of their own. A process of a job shares the job's, its evaluation and
    /// training programs taking turns: each continues the sequence numbers of the other's
    /// collectives, from the evaluation program's load on (a GPU joins its NCCL communicators
    /// then).
    fn load_evaluators(&mut self, programs: Vec<autotp_program::Program>) -> Result<(), TrainError> {
        let comm = match (&self.processes, &self.comm) {
            (Some(_), comm) => comm.clone(),
            (None, Some(_)) => {
                let sizes: Vec<usize> = programs[0].mesh.iter().map(|a| a.size).collect();
                Some(LocalComm::pipeline(programs.len(), &sizes) as Arc<dyn Communicator>)
            }
            (None, None) => None,
        };
        let continuing = self.processes.as_ref().map(|_| self.ranks[0].collectives_issued().to_vec());
        let (evaluators, _) =
            load_ranks(programs, &self.topology, &self.processes, self.gpu, &comm, continuing.as_deref())?;
        if continuing.is_some() {
            self.ranks[0].continue_collectives(evaluators[0].collectives_issued())?;
        }
        self.evaluators = evaluators;
        self.evaluation_comm = comm;
        Ok(())
    }
}
