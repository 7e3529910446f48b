//! `--nan-policy stop`: a step whose loss or gradients are not finite ends the run with what
//! a user needs to find why: the step, the first parameter whose gradient is not finite and
//! the instruction (IR node or fusion) that first wrote an inf or a NaN, found by running the
//! step again with every output checked ([`autotp_runtime::non_finite`]). The plan's check of
//! its gradients kept the update back, so the replay starts from the same state, and the state
//! after the error is the one before the step. A plan that does not check (f32 compiled with
//! `--no-finite-check`) stops on a loss that is not finite, its update applied.

use autotp_runtime::non_finite::NonFiniteTrace;
use autotp_runtime::HostTensor;
use serde::{Deserialize, Serialize};

use super::{Programs, Trainer};
use crate::TrainError;

impl Trainer {
    /// The error that ends the run at `step` (1-based), whose loss was `loss` and whose
    /// gradients were not all finite when `gradients_non_finite`; `feeds` are the step's.
    pub(super) fn stop_on_non_finite(
        &mut self,
        step: usize,
        loss: f64,
        gradients_non_finite: bool,
        feeds: &[Vec<HostTensor>],
    ) -> TrainError {
        if !self.checks_gradients() {
            return TrainError::NonFinite {
                step,
                message: format!(
                    "the loss is {loss}; the plan does not check its gradients (compiled with --no-finite-check), so \
                     the step's update was applied (compile it without that flag to keep the state and find the op \
                     that made the first inf or NaN)"
                ),
            };
        }
        if !gradients_non_finite {
            return TrainError::NonFinite {
                step,
                message: format!("the loss is {loss} while every gradient is finite; the update was applied"),
            };
        }
        // The update was kept back: the step did not happen.
        self.completed -= 1;
        let found = match self.replay_watched(feeds) {
            Ok(found) => found,
            Err(e) => return e,
        };
        let mut message = format!("the loss is {loss} and the gradients are not all finite");
        let first_gradient = |trace: &NonFiniteTrace| trace.gradients.first().map(|(_, name)| name.clone());
        match found.iter().find_map(|(rank, trace)| Some((rank, first_gradient(trace)?, trace.gradients.len()))) {
            Some((rank, first, count)) => {
                message += &format!(
                    "; the first parameter whose gradient is not finite is '{first}' (rank {rank}, {count} of its \
                 parameters' gradients are not)"
                )
            }
            None if found.is_empty() => {}
            None => message += "; every parameter's gradient was finite on the replay (a non-deterministic fault?)",
        }
        match found.iter().find_map(|(rank, trace)| Some((rank, trace.first.as_ref()?))) {
            Some((rank, (index, label))) => {
                let stage = self.topology.stage(*rank);
                message += &format!(
                    "; the first inf or NaN was written by {label} (instruction {index} of stage {stage}'s program, rank \
                     {rank})"
                );
            }
            None if found.is_empty() => {
                message += "; the parameter and the op that made it are named without --cuda-graph (resume the last checkpoint without it)"
            }
            None => {}
        }
        message += &format!(
            "; the parameters and optimizer states are those after step {} (--nan-policy skip skips such steps)",
            step - 1
        );
        TrainError::NonFinite { step, message }
    }

    /// Runs the step of `feeds` again on every rank with each instruction's outputs checked,
    /// and returns what each rank found, by rank (every rank of a job of processes); empty
    /// when the ranks' steps run as CUDA graphs, which the host cannot look inside.
    fn replay_watched(&mut self, feeds: &[Vec<HostTensor>]) -> Result<Vec<(usize, NonFiniteTrace)>, TrainError> {
        let watching: Vec<bool> = self.ranks.iter_mut().map(|executor| executor.watch_non_finite()).collect();
        if watching.contains(&false) {
            return Ok(Vec::new());
        }
        self.run_ranks(Programs::Training, feeds)?;
        let first = self.first_rank;
        let local: Vec<(usize, NonFiniteTrace)> = (self.ranks.iter_mut().enumerate())
            .filter_map(|(i, executor)| Some((first + i, executor.take_non_finite()?)))
            .collect();
        let Some(job) = &self.processes else { return Ok(local) };
        let own: Vec<RankTrace> = local.into_iter().map(RankTrace::from).collect();
        let json = serde_json::to_vec(&own).expect("a trace serializes");
        let mut found = Vec::new();
        for chunk in super::all_gather_bytes(job, json)? {
            let traces: Vec<RankTrace> = serde_json::from_slice(&chunk)
                .map_err(|e| TrainError::Training(format!("a rank's non-finite trace did not parse: {e}")))?;
            found.extend(
                traces.into_iter().map(|t| (t.rank, NonFiniteTrace { first: t.first, gradients: t.gradients })),
            );
        }
        Ok(found)
    }
}

/// A rank's [`NonFiniteTrace`] as the processes of a job exchange it.
#[derive(Serialize, Deserialize)]
struct RankTrace {
    rank: usize,
    first: Option<(usize, String)>,
    gradients: Vec<(usize, String)>,
}

impl From<(usize, NonFiniteTrace)> for RankTrace {
    fn from((rank, trace): (usize, NonFiniteTrace)) -> RankTrace {
        RankTrace { rank, first: trace.first, gradients: trace.gradients }
    }
}
