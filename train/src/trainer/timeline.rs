//! Recording the ranks' timelines for `run --trace` ([`autotp_runtime::trace`]): started before
//! the first traced step, collected after the last; in a job of processes, rank 0 receives
//! every rank's.

use autotp_runtime::trace::TraceClock;

use super::Trainer;
use crate::trace::{spans_from_json, spans_to_json, RankTrace};
use crate::TrainError;

impl Trainer {
    /// Records every local rank's timeline from the next step on (CPU ranks).
    pub fn start_trace(&mut self) -> Result<(), TrainError> {
        let clock = TraceClock::now();
        for executor in &mut self.ranks {
            executor.enable_trace(clock)?;
        }
        Ok(())
    }

    /// Stops recording and returns the timelines: this process's ranks', or in a job of
    /// processes every rank's (each process takes part).
    pub fn finish_trace(&mut self) -> Result<Vec<RankTrace>, TrainError> {
        let local: Vec<RankTrace> = (self.first_rank..)
            .zip(&mut self.ranks)
            .map(|(rank, executor)| RankTrace {
                rank,
                stage: self.topology.stage(rank),
                spans: executor.disable_trace(),
            })
            .collect();
        let Some(job) = &self.processes else { return Ok(local) };
        let [own] = &local[..] else { unreachable!("a process runs one rank") };
        (super::all_gather_bytes(job, spans_to_json(own))?.iter())
            .map(|chunk| {
                spans_from_json(chunk).ok_or_else(|| TrainError::Training("a rank's trace did not parse".into()))
            })
            .collect()
    }
}
