//! The compile-time report of a plan (`autotp compile` prints it, `--report FILE.json` writes
//! it): per rank, the bytes of parameters, gradients, optimizer state, peak activations,
//! communication staging buffers and the total peak; and the bytes each collective moves per
//! step. Every rank runs the same program on equal shards, so every rank's line is the same
//! today; the shape leaves room for ranks that differ (pipeline stages).

use serde::{Deserialize, Serialize};

use crate::comm::{CollectiveKind, CommBytes};
use crate::plan::TrainingPlan;
use crate::Instruction;

/// One rank's planned memory, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankReport {
    pub rank: usize,
    pub params_bytes: usize,
    /// Gradients of the trainable parameters as the optimizer receives them (on this rank).
    pub grads_bytes: usize,
    pub optimizer_bytes: usize,
    /// Intermediate values live at once at the peak (gradients and collective results among
    /// them).
    pub activations_peak_bytes: usize,
    /// The largest host staging the rank's collectives need at once.
    pub comm_buffer_bytes: usize,
    /// Everything the rank allocates: its arena plus the communication staging.
    pub peak_bytes: usize,
    /// Bytes this rank sends per step, by collective.
    pub comm_bytes_per_step: CommBytes,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub mesh: Vec<(String, usize)>,
    pub ranks: Vec<RankReport>,
    /// Bytes sent per step by all ranks together, by collective.
    pub comm_bytes_per_step: CommBytes,
}

/// The planned memory and communication of `plan`.
pub fn report(plan: &TrainingPlan) -> Report {
    report_of(&plan.program, &plan.training)
}

/// The planned memory and communication of a program trained as `training` says.
pub fn report_of(p: &crate::Program, training: &crate::plan::TrainingConfig) -> Report {
    let world: usize = p.mesh.iter().map(|a| a.size).product();
    let mut comm = CommBytes::default();
    let mut staging = 0;
    for instruction in &p.instructions {
        let (Instruction::Collective { op, input, .. } | Instruction::CollectiveStart { op, input, .. }) = instruction
        else {
            continue;
        };
        let n = p.mesh[op.axis].size;
        let bytes = op.kind.bytes_sent(input.len, n);
        match op.kind {
            CollectiveKind::AllReduce => comm.all_reduce += bytes,
            CollectiveKind::AllGather { .. } => comm.all_gather += bytes,
            CollectiveKind::ReduceScatter { .. } => comm.reduce_scatter += bytes,
            CollectiveKind::ShardSlice { .. } => {}
        }
        staging = staging.max(op.kind.staging_bytes(input.len));
    }
    // Gradients as the optimizer receives them; ZeRO stage 1 holds them whole until then.
    let grads_bytes = if training.zero_stage == 1 {
        p.params.iter().filter(|s| !training.frozen.contains(&s.name)).map(|s| s.region.len).sum()
    } else {
        p.memory.grads_bytes
    };
    let m = &p.memory;
    let rank = |rank| RankReport {
        rank,
        params_bytes: m.params_bytes,
        grads_bytes,
        optimizer_bytes: m.states_bytes,
        activations_peak_bytes: m.activations_peak_bytes,
        comm_buffer_bytes: staging,
        peak_bytes: m.arena_bytes + staging,
        comm_bytes_per_step: comm.clone(),
    };
    let total = CommBytes {
        all_reduce: comm.all_reduce * world,
        all_gather: comm.all_gather * world,
        reduce_scatter: comm.reduce_scatter * world,
    };
    Report {
        mesh: p.mesh.iter().map(|a| (a.name.clone(), a.size)).collect(),
        ranks: (0..world.max(1)).map(rank).collect(),
        comm_bytes_per_step: total,
    }
}
