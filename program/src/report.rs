//! The compile-time report of a plan (`autotp compile` prints it, `--report FILE.json` writes
//! it): per rank, the bytes of parameters, gradients, optimizer state, peak activations,
//! communication staging buffers and the total peak; and the bytes each collective moves per
//! step (pipeline sends included). The ranks of one stage run the same program on equal shards,
//! so their lines are the same; pipeline stages differ.

use serde::{Deserialize, Serialize};

use crate::mesh::CommBytes;
use crate::plan::TrainingPlan;
use crate::Instruction;

/// One rank's planned memory, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankReport {
    pub rank: usize,
    /// Its pipeline stage (0 without a pipeline).
    #[serde(default)]
    pub stage: usize,
    pub params_bytes: usize,
    /// Gradients of the trainable parameters as the optimizer receives them (on this rank).
    pub grads_bytes: usize,
    /// Optimizer states in the arena (none when offloaded).
    pub optimizer_bytes: usize,
    /// Optimizer states offloaded outside the arena (`--offload-optimizer`): to host memory,
    /// or to a file.
    #[serde(default)]
    pub offloaded_optimizer_bytes: usize,
    /// With the optimizer state in a file (`--offload-optimizer nvme`): the host memory of the
    /// buffers its tiles stream through, and the bytes each step reads (and as many writes).
    #[serde(default)]
    pub nvme_buffer_bytes: usize,
    #[serde(default)]
    pub nvme_bytes_per_step: usize,
    /// Intermediate values live at once at the peak (gradients and collective results among
    /// them).
    pub activations_peak_bytes: usize,
    /// The largest host staging the rank's collectives need at once.
    pub comm_buffer_bytes: usize,
    /// The device memory NCCL's path needs instead (GPUs): the scratch of its strided
    /// collectives, and a staging copy of each pipeline message it sends.
    #[serde(default)]
    pub nccl_scratch_bytes: usize,
    /// Everything the rank allocates on its device: its arena plus the communication staging
    /// (offloaded optimizer states apart).
    pub peak_bytes: usize,
    /// Bytes this rank sends per step, by collective.
    pub comm_bytes_per_step: CommBytes,
    /// The most micro-batches whose activations it holds at once (its pipeline schedule's).
    #[serde(default)]
    pub micro_batches_in_flight: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub mesh: Vec<(String, usize)>,
    pub ranks: Vec<RankReport>,
    /// Bytes sent per step by all ranks together, by collective.
    pub comm_bytes_per_step: CommBytes,
    /// The pipeline schedule and its bubble, when there are several stages.
    #[serde(default)]
    pub pipeline: Option<crate::plan::PipelineConfig>,
}

/// The planned memory and communication of `plan`.
pub fn report(plan: &TrainingPlan) -> Report {
    let stages: Vec<&crate::Program> = plan.stages.iter().collect();
    report_of(&stages, &plan.training)
}

/// The planned memory and communication of the stages' programs trained as `training` says.
pub fn report_of(stages: &[&crate::Program], training: &crate::plan::TrainingConfig) -> Report {
    let mesh = &stages[0].mesh;
    let stage_size: usize = mesh.iter().map(|a| a.size).product();
    let mut ranks = Vec::new();
    let mut total = CommBytes::default();
    for (stage, p) in stages.iter().enumerate() {
        let mut comm = CommBytes::default();
        let (mut staging, mut scratch, mut sends_staging) = (0, 0, 0);
        for instruction in &p.instructions {
            match instruction {
                Instruction::Collective { op, input, .. } | Instruction::CollectiveStart { op, input, .. } => {
                    let n = p.mesh[op.axis].size;
                    comm.count(op.kind, input.len, n);
                    staging = staging.max(op.kind.staging_bytes(input.len));
                    scratch = scratch.max(op.device_scratch_bytes(n));
                }
                Instruction::Send { input, .. } => {
                    comm.send += input.len;
                    sends_staging += input.len;
                }
                _ => {}
            }
        }
        scratch += sends_staging;
        // Gradients as the optimizer receives them; ZeRO stage 1 holds them whole until then.
        let grads_bytes = if training.zero_stage == 1 {
            let trained = p.params.iter().filter(|s| !training.frozen.contains(&s.name));
            trained.map(|s| s.numel() * training.grad_accum_dtype.unwrap_or(s.dtype).size()).sum()
        } else {
            p.memory.grads_bytes
        };
        let in_flight = match &training.pipeline {
            Some(pipeline) => pipeline.in_flight.get(stage).copied().unwrap_or(0),
            None => 1,
        };
        let m = &p.memory;
        let nvme = training.nvme.as_ref().and_then(|nvme| {
            let layout = crate::offload::Layout::of(p, nvme.tile_elements).ok()?;
            Some((layout.buffers(nvme.buffer_count) * layout.tile_bytes, layout.file_bytes))
        });
        let (nvme_buffer_bytes, nvme_bytes_per_step) = nvme.unwrap_or_default();
        for rank in stage * stage_size..(stage + 1) * stage_size {
            ranks.push(RankReport {
                rank,
                stage,
                params_bytes: m.params_bytes,
                grads_bytes,
                optimizer_bytes: m.states_bytes,
                offloaded_optimizer_bytes: m.host_pool_bytes,
                nvme_buffer_bytes,
                nvme_bytes_per_step,
                activations_peak_bytes: m.activations_peak_bytes,
                comm_buffer_bytes: staging,
                nccl_scratch_bytes: scratch,
                peak_bytes: m.arena_bytes + staging,
                comm_bytes_per_step: comm.clone(),
                micro_batches_in_flight: in_flight,
            });
        }
        total.all_reduce += comm.all_reduce * stage_size;
        total.all_gather += comm.all_gather * stage_size;
        total.reduce_scatter += comm.reduce_scatter * stage_size;
        total.all_to_all += comm.all_to_all * stage_size;
        total.ring_shift += comm.ring_shift * stage_size;
        total.send += comm.send * stage_size;
    }
    Report {
        mesh: mesh.iter().map(|a| (a.name.clone(), a.size)).collect(),
        ranks,
        comm_bytes_per_step: total,
        pipeline: training.pipeline.clone(),
    }
}
