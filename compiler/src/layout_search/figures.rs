//! What a compiled cut of the model holds and does ([`Figures`]: bytes by category, the peaks
//! of its forward, backward and optimizer step, GEMM FLOPs, traffic), and the per-layer model
//! of a layout's stages built from cuts of 1 and 2 layers ([`Model`], [`PipelineModel`]).

use std::collections::BTreeMap;

use autotp_kernels::grouped::GroupedForm;
use autotp_kernels::Kernel;
use autotp_program::{Instruction, Program};

/// What one compiled cut of the model holds and does (one rank, one micro-batch).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Figures {
    pub(super) params: f64,
    pub(super) grads: f64,
    pub(super) optimizer: f64,
    /// Intermediate values live at the forward's peak (up to the loss).
    pub(super) forward: f64,
    /// Intermediate values live at the backward's peak, less the gradients (which the memory
    /// plan counts among them).
    pub(super) backward: f64,
    /// Intermediate values live at the optimizer step's peak, less the gradients.
    pub(super) optimizer_transient: f64,
    /// Intermediate values live at their peak before the optimizer step (through the forwards
    /// and backwards of all micro-batches), less the gradients.
    pub(super) before_optimizer: f64,
    /// The rest of the arena: the step's inputs (a pipeline stage's received activations and
    /// gradients among them, a buffer per micro-batch), constants and alignment.
    pub(super) inputs: f64,
    pub(super) gemm_flops: f64,
    /// The sum over GEMMs of their FLOPs per output row: a GEMM of few rows runs below the
    /// device's rate ([`super::device::Device::gemm_half_rows`]).
    pub(super) gemm_flops_per_row: f64,
    pub(super) other_bytes: f64,
    /// Bytes sent per micro-batch by the collectives inside the step on axes other than cp:
    /// tp's.
    pub(super) tp_bytes: f64,
    /// Bytes sent per micro-batch over the context-parallel axis: the keys' and values'
    /// gathers and their gradients' scatters, or the ring's shifts.
    pub(super) cp_bytes: f64,
    /// The collectives behind `cp_bytes`, each a latency on the step's path.
    pub(super) cp_exchanges: f64,
    /// Bytes sent once a step by the all-reduces over the context-parallel axis (the weights'
    /// gradients, summed over cp as over dp).
    pub(super) cp_reduce_bytes: f64,
    /// Bytes sent per micro-batch by expert parallelism's all-to-alls over the dp axis (a cut
    /// compiled with `--ep`); the data-parallel reductions are the search's own model.
    pub(super) ep_bytes: f64,
    /// Instructions the program runs (each costs the device's dispatch time).
    pub(super) instructions: f64,
    /// The largest host staging one of its collectives needs.
    pub(super) staging: f64,
    /// The bytes of its largest parameter (on a rank of tp): ZeRO 3 gathers it whole at its use,
    /// past `stage3_max_live_parameters` if need be. [`Figures::combine`] keeps the larger.
    pub(super) largest_param: f64,
}

impl Figures {
    pub(super) fn of(program: &Program) -> Figures {
        let m = &program.memory;
        let peaks = phase_peaks(program);
        let (mut gemm_flops, mut gemm_flops_per_row, mut other_bytes, mut tp_bytes) = (0.0, 0.0, 0.0, 0.0);
        let (mut cp_bytes, mut cp_exchanges, mut cp_reduce_bytes, mut ep_bytes) = (0.0, 0.0, 0.0, 0.0);
        let mut staging = 0usize;
        for instruction in &program.instructions {
            match instruction {
                Instruction::Collective { op, input, .. } | Instruction::CollectiveStart { op, input, .. } => {
                    let axis = &program.mesh[op.axis];
                    let sent = op.kind.bytes_sent(input.len, axis.size) as f64;
                    use autotp_program::mesh::{Collective, CONTEXT_AXIS, DATA_AXIS, EXPERT_AXIS};
                    match (axis.name.as_str(), op.kind) {
                        (CONTEXT_AXIS, Collective::AllReduce) => cp_reduce_bytes += sent,
                        (CONTEXT_AXIS, _) => {
                            cp_bytes += sent;
                            // A shard's slice sends nothing.
                            cp_exchanges += if sent > 0.0 { 1.0 } else { 0.0 };
                        }
                        (DATA_AXIS | EXPERT_AXIS, Collective::AllToAll { .. }) => ep_bytes += sent,
                        (DATA_AXIS | EXPERT_AXIS, _) => {}
                        _ => tp_bytes += sent,
                    }
                    staging = staging.max(op.kind.staging_bytes(input.len));
                }
                Instruction::Kernel { kernel: Kernel::MatMul { dims, .. }, .. } => {
                    let batch: usize = dims.batch.iter().product();
                    let flops = 2.0 * (batch * dims.m * dims.k * dims.n) as f64;
                    gemm_flops += flops;
                    gemm_flops_per_row += flops / dims.m.max(1) as f64;
                }
                // Timed at the room, every pair's product (as the all-to-alls are): one GEMM
                // per expert, of its share of the pairs' rows (gathered) or of the matrix's
                // rows (scattered).
                Instruction::Kernel { kernel: Kernel::GroupedMatMul { dims, .. }, .. } => {
                    let (d, pairs) = (&dims.pair, dims.pairs());
                    let flops = 2.0 * (pairs * d.m * d.k * d.n) as f64;
                    let rows = match dims.form {
                        GroupedForm::Scattered => d.m,
                        GroupedForm::GatheredLhs | GroupedForm::GatheredRhs => pairs / dims.experts.max(1),
                    };
                    gemm_flops += flops;
                    gemm_flops_per_row += flops / rows.max(1) as f64;
                }
                Instruction::Kernel { inputs, outputs, .. } | Instruction::Generated { inputs, outputs, .. } => {
                    other_bytes += inputs.iter().chain(outputs).map(|r| r.len as f64).sum::<f64>();
                }
                _ => {}
            }
        }
        Figures {
            params: m.params_bytes as f64,
            grads: m.grads_bytes as f64,
            optimizer: (m.states_bytes + m.host_pool_bytes) as f64,
            forward: peaks.forward,
            backward: (peaks.backward - m.grads_bytes as f64).max(0.0),
            optimizer_transient: (peaks.optimizer - m.grads_bytes as f64).max(0.0),
            before_optimizer: (peaks.forward.max(peaks.backward) - m.grads_bytes as f64).max(0.0),
            inputs: m.arena_bytes.saturating_sub(m.params_bytes + m.states_bytes + m.activations_peak_bytes) as f64,
            gemm_flops,
            gemm_flops_per_row,
            other_bytes,
            tp_bytes,
            cp_bytes,
            cp_exchanges,
            cp_reduce_bytes,
            ep_bytes,
            instructions: program.instructions.len() as f64,
            staging: staging as f64,
            largest_param: program.params.iter().map(|p| p.region.len).max().unwrap_or(0) as f64,
        }
    }

    pub(super) fn combine(a: Figures, b: Figures, f: impl Fn(f64, f64) -> f64) -> Figures {
        Figures {
            params: f(a.params, b.params),
            grads: f(a.grads, b.grads),
            optimizer: f(a.optimizer, b.optimizer),
            forward: f(a.forward, b.forward),
            backward: f(a.backward, b.backward),
            optimizer_transient: f(a.optimizer_transient, b.optimizer_transient),
            before_optimizer: f(a.before_optimizer, b.before_optimizer),
            inputs: f(a.inputs, b.inputs),
            gemm_flops: f(a.gemm_flops, b.gemm_flops),
            gemm_flops_per_row: f(a.gemm_flops_per_row, b.gemm_flops_per_row),
            other_bytes: f(a.other_bytes, b.other_bytes),
            tp_bytes: f(a.tp_bytes, b.tp_bytes),
            cp_bytes: f(a.cp_bytes, b.cp_bytes),
            cp_exchanges: f(a.cp_exchanges, b.cp_exchanges),
            cp_reduce_bytes: f(a.cp_reduce_bytes, b.cp_reduce_bytes),
            ep_bytes: f(a.ep_bytes, b.ep_bytes),
            instructions: f(a.instructions, b.instructions),
            staging: f(a.staging, b.staging),
            largest_param: a.largest_param.max(b.largest_param),
        }
    }
}

/// A model per layer and the rest, at one micro-batch size, from its cuts of 1 and 2 layers
/// (of the modelled kind, [`super::kinds`]), and each other kind of layer's difference.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Model {
    pub(super) layer: Figures,
    pub(super) rest: Figures,
    /// What the backward's peak held beyond the forward's in the 2-layer cut (the head's
    /// gradients of the logits; gradients made): added to a stage's forward peak, it bounds its
    /// backward's when the saved activations of many layers outweigh the cut's.
    pub(super) backward_extra: f64,
    /// Of `rest`: the bytes of parameters (and their gradients and states) on the first
    /// stage (the token embedding); the others are on the last.
    pub(super) embedding_fraction: f64,
    /// The bytes of one micro-batch's activation between two layers (the hidden state a
    /// pipeline stage sends).
    pub(super) boundary: f64,
    /// Bytes per parameter element.
    pub(super) param_bytes: f64,
    /// The communication staging of a stage: tp's collectives (the largest, from the 2-layer
    /// cut) and, with dp, the data-parallel reductions' (from cuts of dp 2, per layer and the
    /// rest; up to three buckets of DeepSpeed's 5e8 elements).
    pub(super) tp_staging: f64,
    pub(super) dp_staging: Option<(Figures, Figures)>,
    /// With pp: the memory of its stages, from cuts of 2 stages.
    pub(super) pipeline: Option<PipelineModel>,
    /// With ep: a layer's experts, which ZeRO does not shard and dp does not reduce.
    pub(super) experts: ExpertShare,
    /// What a layer of each kind other than the modelled one holds and does beyond a modelled
    /// layer (a dense layer before a mixture of experts: less), in
    /// [`super::kinds::LayerKinds::others`]' order; none for a model of one kind.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) other_kinds: Vec<Figures>,
}

/// A layer's experts under expert parallelism, in parameter bytes (zero without): the rank's
/// own and the other ranks', from the layer's cuts with and without `--ep`; their gradients
/// and optimizer states are the layer's per parameter byte.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ExpertShare {
    pub(super) own: f64,
    pub(super) others: f64,
    pub(super) grads_per_param: f64,
    pub(super) optimizer_per_param: f64,
}

/// A stage's own experts: their parameters', gradients' and optimizer states' bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct StageExperts {
    pub(super) params: f64,
    pub(super) grads: f64,
    pub(super) optimizer: f64,
}

impl ExpertShare {
    /// The experts of `n` layers, `params` bytes each, with their gradients and states.
    fn bytes(&self, n: usize, params: f64) -> StageExperts {
        let params = n as f64 * params;
        StageExperts { params, grads: params * self.grads_per_param, optimizer: params * self.optimizer_per_param }
    }

    /// The rank's experts on a stage of `n` layers.
    pub(super) fn on_stage(&self, n: usize) -> StageExperts {
        self.bytes(n, self.own)
    }

    /// `held` (a stage of `n` layers, every expert) less the other ranks' experts.
    pub(super) fn without_others(&self, n: usize, held: StageMemory) -> StageMemory {
        let others = self.bytes(n, self.others);
        StageMemory {
            params: held.params - others.params,
            grads: held.grads - others.grads,
            optimizer: held.optimizer - others.optimizer,
            ..held
        }
    }
}

/// The memory of pipeline stages, from the compiler's plans of a cut of 2 stages of 1 and of 2
/// layers each ([`super::cuts::pipeline_cut`]: with 3 micro-batches the first stage holds 2 in flight, the
/// last one). They differ from slices of the one-stage program: the first holds the embedding
/// (whole under tp) and its gradient's temporaries, a tied embedding is held and its gradient
/// exchanged on both ends, each micro-batch's gradients are added into sums. More micro-batches
/// in flight add a layer's saved activations each.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct PipelineModel {
    /// The first stage with 1 layer, and what each further layer adds.
    pub(super) first: Figures,
    pub(super) first_layer: Figures,
    /// The last stage with 1 layer, and what each further layer adds.
    pub(super) last: Figures,
    pub(super) last_layer: Figures,
    /// One micro-batch's saved activations of a layer: what a layer adds on the first stage
    /// (2 in flight) beyond what it adds on the last (1), else a layer's forward peak in the
    /// one-stage cut.
    pub(super) layer_saved: f64,
    /// The cut's micro-batches.
    pub(super) micro_batches: f64,
}

/// What a pipeline stage holds (one rank, dp 1, no ZeRO): parameters, gradients, optimizer
/// states, its intermediate values at the peak less the gradients, and its inputs.
#[derive(Clone, Copy, Debug)]
pub struct StageMemory {
    pub(super) params: f64,
    pub(super) grads: f64,
    pub(super) optimizer: f64,
    pub(super) activations: f64,
    pub(super) inputs: f64,
}

impl PipelineModel {
    /// Stage `s` of `pp` with `layers` layers (`other` what those of other kinds hold beyond
    /// modelled ones, [`Model::other_layers`]), `in_flight` micro-batches and `micro_batches` in
    /// the step.
    pub(super) fn stage(
        &self,
        layers: usize,
        other: Figures,
        s: usize,
        pp: usize,
        in_flight: f64,
        micro_batches: f64,
    ) -> StageMemory {
        let n = layers as f64;
        let last = s + 1 == pp;
        let (one, more, cut_in_flight) = if last {
            (&self.last, &self.last_layer, 1.0)
        } else {
            (&self.first, &self.first_layer, self.micro_batches.min(2.0))
        };
        let at = |one: f64, more: f64| one + (n - 1.0) * more;
        let mut memory = StageMemory {
            params: at(one.params, more.params),
            grads: at(one.grads, more.grads),
            optimizer: at(one.optimizer, more.optimizer),
            activations: at(one.before_optimizer, more.before_optimizer),
            // Each micro-batch's inputs have their own buffers.
            inputs: one.inputs * micro_batches / self.micro_batches,
        };
        if s > 0 && !last {
            // A middle stage: the first stage's layers without its embedding.
            memory = StageMemory {
                params: n * more.params,
                grads: n * more.grads,
                optimizer: n * more.optimizer,
                activations: n * more.before_optimizer,
                inputs: memory.inputs,
            };
        }
        // Each micro-batch in flight beyond the cut's keeps its saved activations.
        memory.activations = (memory.activations + (in_flight - cut_in_flight) * n * self.layer_saved).max(0.0);
        StageMemory {
            params: memory.params + other.params,
            grads: memory.grads + other.grads,
            optimizer: memory.optimizer + other.optimizer,
            activations: (memory.activations + other.before_optimizer).max(0.0),
            inputs: memory.inputs,
        }
    }
}

impl Model {
    /// The part of the rest's parameters (and their gradients and states) on a stage: the
    /// embedding's on the first, the others on the last.
    pub(super) fn rest_share(&self, first: bool, last: bool) -> f64 {
        (if first { self.embedding_fraction } else { 0.0 }) + (if last { 1.0 - self.embedding_fraction } else { 0.0 })
    }

    /// What the layers of other kinds on a stage (`others[k]` of kind `k`) hold and do beyond as
    /// many modelled layers.
    pub(super) fn other_layers(&self, others: &[usize]) -> Figures {
        (self.other_kinds.iter().zip(others))
            .fold(Figures::default(), |sum, (kind, &count)| Figures::combine(sum, *kind, |s, k| s + count as f64 * k))
    }

    /// One micro-batch through a stage of `layers` layers, the first stage and/or the last;
    /// `other` what those of other kinds hold and do beyond modelled ones ([`Self::other_layers`]).
    pub(super) fn stage(&self, layers: usize, other: Figures, first: bool, last: bool) -> Figures {
        Figures::combine(self.modelled_stage(layers, first, last), other, |m, o| m + o)
    }

    /// [`Self::stage`] with every layer of the modelled kind.
    fn modelled_stage(&self, layers: usize, first: bool, last: bool) -> Figures {
        let share = self.rest_share(first, last);
        // Activations, work and traffic of the rest belong to the head's stage (the
        // embedding's gather is a small part); its parameters split by where they are read.
        let work = if last { 1.0 } else { 0.0 };
        let n = layers as f64;
        let (layer, rest) = (&self.layer, &self.rest);
        Figures {
            params: n * layer.params + share * rest.params,
            grads: n * layer.grads + share * rest.grads,
            optimizer: n * layer.optimizer + share * rest.optimizer,
            forward: n * layer.forward + work * rest.forward,
            backward: n * layer.backward + work * rest.backward,
            optimizer_transient: n * layer.optimizer_transient + share * rest.optimizer_transient,
            before_optimizer: n * layer.before_optimizer + work * rest.before_optimizer,
            inputs: n * layer.inputs + rest.inputs,
            gemm_flops: n * layer.gemm_flops + work * rest.gemm_flops,
            gemm_flops_per_row: n * layer.gemm_flops_per_row + work * rest.gemm_flops_per_row,
            other_bytes: n * layer.other_bytes + work * rest.other_bytes,
            tp_bytes: n * layer.tp_bytes + work * rest.tp_bytes,
            cp_bytes: n * layer.cp_bytes + work * rest.cp_bytes,
            cp_exchanges: n * layer.cp_exchanges + work * rest.cp_exchanges,
            // The gradients reduced are the stage's parameters'.
            cp_reduce_bytes: n * layer.cp_reduce_bytes + share * rest.cp_reduce_bytes,
            ep_bytes: n * layer.ep_bytes + work * rest.ep_bytes,
            instructions: n * layer.instructions + work * rest.instructions,
            staging: n * layer.staging + rest.staging,
            largest_param: layer.largest_param.max(rest.largest_param),
        }
    }
}

/// The most bytes of intermediate values live at once in a program's three phases: the
/// forward (up to the instruction that writes the loss), the backward (to the first optimizer
/// step) and the optimizer step. A value lives in its arena region from the instruction that writes it
/// to the last that reads it before another value is written over it (the memory plan reuses a
/// region only once its value is dead).
pub(super) fn phase_peaks(program: &Program) -> Peaks {
    let start = program.activations_start();
    let steps = program.instructions.len();
    let optimizer =
        (program.instructions.iter()).position(|i| matches!(i, Instruction::OptimizerStep { .. })).unwrap_or(steps);
    let loss = program.outputs.iter().find(|s| s.name == autotp_passes::loss::LOSS).map(|s| s.region);
    let turn = (program.instructions.iter())
        .position(|i| loss.is_some_and(|loss| i.regions().1.contains(&loss)))
        .unwrap_or(optimizer);
    // Live values by offset: (end, written at, last read at).
    let mut live: BTreeMap<usize, (usize, usize, usize)> = BTreeMap::new();
    let mut lifetimes: Vec<(usize, usize, usize)> = Vec::new();
    let overlapping = |live: &BTreeMap<usize, (usize, usize, usize)>, r: &autotp_program::Region| -> Vec<usize> {
        live.range(..r.offset + r.len)
            .filter(|(&offset, &(end, ..))| end > r.offset && offset < r.offset + r.len)
            .map(|(&o, _)| o)
            .collect()
    };
    for (t, instruction) in program.instructions.iter().enumerate() {
        let (inputs, outputs) = instruction.regions();
        for r in inputs.iter().filter(|r| r.offset >= start && r.len > 0 && !r.in_host_pool()) {
            for offset in overlapping(&live, r) {
                live.get_mut(&offset).expect("found").2 = t;
            }
        }
        for r in outputs.iter().filter(|r| r.offset >= start && r.len > 0 && !r.in_host_pool()) {
            if inputs.contains(r) {
                continue;
            }
            for offset in overlapping(&live, r) {
                let (end, written, read) = live.remove(&offset).expect("found");
                lifetimes.push((written, read, end - offset));
            }
            live.insert(r.offset, (r.offset + r.len, t, t));
        }
    }
    // What the step's updates copy into the parameters and states lives to the end.
    for update in program.updates.iter().filter(|u| u.from.offset >= start && !u.from.in_host_pool()) {
        for offset in overlapping(&live, &update.from) {
            live.get_mut(&offset).expect("found").2 = steps.saturating_sub(1);
        }
    }
    lifetimes.extend(live.iter().map(|(&offset, &(end, written, read))| (written, read, end - offset)));
    let mut delta = vec![0i128; steps + 1];
    for (written, read, bytes) in lifetimes {
        delta[written] += bytes as i128;
        delta[read + 1] -= bytes as i128;
    }
    let mut peaks = Peaks::default();
    let mut now = 0i128;
    for (t, change) in delta.iter().take(steps).enumerate() {
        now += change;
        // A stage without the loss (a pipeline's first) runs forwards and backwards to the
        // optimizer's step: all of it is `forward`.
        let phase = if t >= optimizer {
            &mut peaks.optimizer
        } else if t <= turn {
            &mut peaks.forward
        } else {
            &mut peaks.backward
        };
        *phase = phase.max(now as f64);
    }
    peaks
}

/// [`phase_peaks`]'s bytes.
#[derive(Default)]
pub(super) struct Peaks {
    pub(super) forward: f64,
    pub(super) backward: f64,
    pub(super) optimizer: f64,
}
