//! A layout's predicted step ([`Prediction`]): its fullest device's memory by category, and
//! its time by the cost model (GEMMs at the device's rate, other kernels at its bandwidth,
//! dispatch per instruction, tp's collectives, the pipeline's slots and sends, the exposed
//! data-parallel reduction, an offloaded optimizer's step); or why it does not fit.

use crate::summary::grouped;

use super::cuts::{stage_layers, DP_STAGING_CAP};
use super::device::Device;
use super::figures::{Model, StageMemory};

/// A layout: the mesh and the step's shape.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Layout {
    pub tp: usize,
    /// Context-parallel ranks (`--cp`): each sequence split over them.
    pub cp: usize,
    /// How attention meets the other cp ranks' keys (`--cp-comm-type`): `all_gather`, or `p2p`
    /// (passed around a ring); `all_gather` without cp.
    pub cp_comm_type: String,
    pub pp: usize,
    pub dp: usize,
    /// Expert-parallel ranks (`--ep`): a mixture of experts' experts split over the dp ranks
    /// (ep = dp) or over each group of ep of them (a divisor of dp; 1 for none).
    pub ep: usize,
    pub zero: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub recompute: String,
    /// The pipeline's schedule (`1f1b` or `zb-h1`; `1f1b` without a pipeline).
    pub schedule: String,
    /// Model chunks per pipeline stage (`--virtual-stages`; interleaved 1F1B when above 1).
    pub virtual_stages: usize,
    /// Megatron's sequence parallelism with tp (`--sequence-parallel`).
    pub sequence_parallel: bool,
    /// The optimizer's states and step in host memory (`--offload-optimizer cpu`,
    /// ZeRO-Offload); searched on GPUs (on CPU ranks the host is the same memory).
    pub offload_optimizer: bool,
    /// ZeRO-3's parameter shards in host memory too (`--offload-param cpu`), each uploaded
    /// before its gathers; searched with the optimizer offloaded.
    pub offload_param: bool,
}

impl Layout {
    /// The micro-batches whose activations stage `s` holds at once: 1F1B's `min(pp - s, M)`;
    /// ZB-H1's `min(pp, M)` on every stage, and half a micro-batch more for each of the `s`
    /// weight-gradient chunks it defers (their output gradients wait for them; fitted to the
    /// compiled fixtures' peaks); interleaved 1F1B's model chunks in flight
    /// (`2(pp - 1 - s) + (V - 1)pp + 1`, at most `V M`) over `V`.
    pub(super) fn in_flight(&self, s: usize) -> f64 {
        let (pp, m, v) = (self.pp, self.grad_accum, self.virtual_stages);
        if pp == 1 {
            1.0
        } else if self.schedule == "zb-h1" {
            pp.min(m) as f64 + 0.5 * s.min(m) as f64
        } else if v > 1 {
            let chunks = if m == pp { v * m } else { (2 * (pp - 1 - s) + (v - 1) * pp + 1).min(v * m) };
            chunks as f64 / v as f64
        } else {
            (pp - s).min(m) as f64
        }
    }

    /// The pipeline's fill and drain, in slots of its slowest stage's micro-batch: `pp - 1`
    /// under 1F1B, `(pp - 1) / V` interleaved, and ZB-H1's `(pp - 1)(F + B - W)` with its
    /// forward, input-gradient and weight-gradient parts taken as equal, `(pp - 1) / 3`.
    pub(super) fn bubble_slots(&self) -> f64 {
        let fill = (self.pp - 1) as f64;
        if self.schedule == "zb-h1" {
            fill / 3.0
        } else {
            fill / self.virtual_stages as f64
        }
    }
}

/// One device's planned memory (its fullest stage), in bytes.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct MemoryFigures {
    pub params: f64,
    pub grads: f64,
    pub optimizer: f64,
    pub activations: f64,
    /// Host buffers the collectives stage through.
    pub staging: f64,
    pub peak: f64,
    /// The optimizer's states in host memory (`--offload-optimizer`), not in `peak`.
    pub host_optimizer: f64,
    /// The parameter shards in host memory (`--offload-param`), not in `peak`.
    pub host_params: f64,
}

/// A layout's predicted step.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Prediction {
    pub step_seconds: f64,
    pub compute_seconds: f64,
    pub tp_seconds: f64,
    /// Context parallelism's gathers of keys and values and scatters of their gradients, per
    /// step (the weights' gradients' reduction over cp is in `dp_seconds`).
    pub cp_seconds: f64,
    /// Expert parallelism's all-to-alls of the (token, choice) pairs to their experts' ranks
    /// and back, per step.
    pub ep_seconds: f64,
    pub pipeline_seconds: f64,
    pub dp_seconds: f64,
    /// The offloaded optimizer step: its gradients down and parameters up over the host link,
    /// or its update at the host's bandwidth, whichever is longer (they overlap, group by
    /// group); and the uploads of offloaded parameter shards before their gathers.
    pub offload_seconds: f64,
    pub bubble_fraction: f64,
    pub memory: MemoryFigures,
    /// Bytes one device sends per step (tp, dp and pipeline together).
    pub comm_bytes: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Considered {
    pub layout: Layout,
    pub prediction: Option<Prediction>,
    pub refused: Option<String>,
    /// The `autotp compile` arguments of a layout that fits (less `-o`).
    pub compile_args: Option<Vec<String>>,
    /// With `--verify`: the compiled plan's largest per-device peak, in bytes.
    pub compiled_peak: Option<f64>,
}

/// The all-to-alls of one layer's mixture per micro-batch (each costs the device's latency):
/// the hidden states, the experts' ids and the routing weights there and the results back, and
/// the backward's gradients the other way (Mixtral's export: 7).
const EP_EXCHANGES_PER_LAYER: f64 = 7.0;

/// A layout's memory and step time, or why it does not fit.
pub(super) fn predict(
    model: &Model,
    layout: &Layout,
    layers: usize,
    others_on_stages: &[Vec<usize>],
    device: &Device,
    per_node: usize,
    memory: f64,
) -> Result<Prediction, String> {
    let Layout { tp, cp, pp, dp, ep, zero, grad_accum, .. } = *layout;
    let counts = stage_layers(layers, pp);
    let dpf = dp as f64;
    // With fewer expert-parallel ranks than data-parallel ones, the dp ranks are groups of ep
    // (the compiler's mesh `[dp / ep, ep]`): ZeRO shards the dense parameters over all dp
    // ranks and a rank's experts over the groups, and the experts' gradients are summed over
    // the groups. Where ep = dp a rank's experts are its own alone.
    let groups = (ep > 1 && ep < dp).then_some((dp / ep) as f64);
    let expert_ways = groups.unwrap_or(1.0);
    let boundary = model.boundary;
    let mut worst = MemoryFigures::default();
    let mut slot = 0.0f64;
    let (mut tp_time, mut compute, mut dp_bytes_max, mut tp_bytes) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let mut expert_grads_max = 0.0f64;
    let (mut cp_time, mut cp_bytes, mut cp_reduce_bytes) = (0.0f64, 0.0f64, 0.0f64);
    let (mut ep_time, mut ep_bytes) = (0.0f64, 0.0f64);
    // The parameters ZeRO 3 gathers on the stage that gathers the most, and the experts' part.
    let (mut gathered_params, mut gathered_experts) = (0.0f64, 0.0f64);
    let (mut offload, mut fetch) = (0.0f64, 0.0f64);
    // CPU ranks share the machine's cores: a step takes the work of every rank at the
    // machine's rate (a pipeline's idle stages leave their cores to the others).
    let mut machine_seconds = 0.0f64;
    let ranks_per_stage = (tp * cp * dp) as f64;
    let node_groups =
        |size: usize, stride: usize| if size * stride <= per_node { device.node_link } else { device.network };
    for (s, &n) in counts.iter().enumerate() {
        let others = &others_on_stages[s];
        let other = model.other_layers(others);
        let figures = model.stage(n, other, s == 0, s == pp - 1);
        let in_flight = layout.in_flight(s);
        // The layers of other kinds (a mixture's dense layers) hold no experts.
        let expert_layers = n.saturating_sub(others.iter().sum());
        let experts = model.experts.on_stage(expert_layers);
        // A pipeline's stage from its cuts; without them, a slice of the one-stage cuts.
        let held = match model.pipeline {
            // The pipeline's cuts hold every expert (dp 1): a rank keeps its own.
            Some(pipeline) => {
                let stage = pipeline.stage(n, other, s, pp, in_flight, grad_accum as f64);
                model.experts.without_others(expert_layers, stage)
            }
            None => StageMemory {
                params: figures.params,
                grads: figures.grads,
                optimizer: figures.optimizer,
                activations: 0.0,
                inputs: 0.0,
            },
        };
        // What ZeRO leaves whole: a rank's own experts where ep = dp (split over dp already);
        // over groups of ep it shards them over the groups.
        let unsharded = |expert: f64| if groups.is_some() { 0.0 } else { expert };
        let zero_share = |total: f64, expert: f64| (total - expert) / dpf + expert / expert_ways;
        // From stage 1: the optimizer's part of what a rank holds.
        let stage_share = |total: f64, expert: f64| if zero >= 1 { zero_share(total, expert) } else { total };
        // ZeRO 3 gathers the parameters of the stage, up to `stage3_max_live_parameters` (1e9)
        // or its largest parameter (gathered at its use whatever the budget); a rank's experts
        // stay its own.
        let sharded_params = held.params - unsharded(experts.params);
        let gathered = sharded_params.min((1e9 * model.param_bytes).max(figures.largest_param));
        let shards = if zero == 3 { zero_share(held.params, experts.params) - unsharded(experts.params) } else { 0.0 };
        let host_params = if layout.offload_param { shards } else { 0.0 };
        let params = if zero == 3 { shards - host_params + gathered + unsharded(experts.params) } else { held.params };
        // autotp reduce-scatters each gradient once it is made whole (no buckets): under ZeRO 2
        // the whole gradients are live at the backward's end, ZeRO 3 (gathered layer by layer)
        // keeps shards.
        let grads = if zero == 3 { zero_share(held.grads, experts.grads) } else { held.grads };
        let sharded_optimizer = stage_share(held.optimizer, experts.optimizer);
        // ZeRO's optimizer steps (stages 1 to 3) run on the rank's shards; an offloaded step
        // runs in host memory, in place.
        let (optimizer, transient) = match layout.offload_optimizer {
            true => (0.0, 0.0),
            false if zero >= 1 => (sharded_optimizer, figures.optimizer_transient / dpf),
            false => (sharded_optimizer, figures.optimizer_transient),
        };
        let host_optimizer = if layout.offload_optimizer { sharded_optimizer } else { 0.0 };
        let intermediate = if model.pipeline.is_some() {
            // The cut (dp 1) sums whole gradients; from ZeRO 2 a stage sums their shards.
            let sums =
                if zero >= 2 && grad_accum > 1 { held.grads - zero_share(held.grads, experts.grads) } else { 0.0 };
            (grads + held.activations - sums).max(grads + transient)
        } else {
            // The peak of the forward (the micro-batches in flight), of the backward (the
            // gradients made, and the other micro-batches' saved activations), or of the
            // optimizer. With accumulation, the gradients summed so far live through the later
            // forwards and backwards (a backward's gradients are made beside them): whole at
            // ZeRO 0 and 1 (reduced once, at the step's end), shards from ZeRO 2 (each
            // micro-batch's gradients are reduce-scattered as they are made).
            let accumulated = match (grad_accum > 1, zero >= 2) {
                (false, _) => 0.0,
                (true, false) => held.grads,
                (true, true) => zero_share(held.grads, experts.grads),
            };
            let forward = in_flight * figures.forward + accumulated;
            let backward = (grads + figures.backward).max(figures.forward + model.backward_extra)
                + (in_flight - 1.0) * figures.forward
                + accumulated;
            forward.max(backward).max(grads + transient)
        };
        let activations = intermediate - grads;

        // The reductions of the stage's gradients: its layers' and its part of the rest's.
        let dp_staging = model.dp_staging.map_or(0.0, |(layer, rest)| {
            let bytes = n as f64 * layer.staging + model.rest_share(s == 0, s == pp - 1) * rest.staging;
            bytes.min(DP_STAGING_CAP.max(layer.staging + rest.staging))
        });
        let staging = model.tp_staging.max(dp_staging);
        let peak = params + optimizer + intermediate + held.inputs + staging;
        if peak > worst.peak {
            worst = MemoryFigures { params, grads, optimizer, activations, staging, peak, host_optimizer, host_params };
        }
        if layout.offload_optimizer {
            // The rank's shard: its gradients down and parameters up; the host reads and writes
            // the states and reads the gradients. Parameters in host memory are updated there,
            // not uploaded after the step.
            let moved = stage_share(held.grads, experts.grads)
                + if layout.offload_param { 0.0 } else { stage_share(held.params, experts.params) };
            let updated = 2.0 * sharded_optimizer + stage_share(held.grads, experts.grads);
            offload = offload.max((moved / device.host_link).max(updated / device.host_update_bandwidth));
        }
        if layout.offload_param {
            // Each of the step's gathers (a forward's and a backward's per micro-batch, less
            // the last forward's, kept) first uploads the rank's shards.
            let gathers = 2.0 * grad_accum as f64 - 1.0;
            fetch = fetch.max(gathers * host_params / device.host_link);
        }
        let work = (figures.gemm_flops + device.gemm_half_rows * figures.gemm_flops_per_row) / device.gemm_flops
            + figures.other_bytes / device.memory_bandwidth
            + figures.instructions * device.instruction_seconds;
        let tp_seconds =
            if tp > 1 { figures.tp_bytes / node_groups(tp, 1) + device.latency * 4.0 * n as f64 } else { 0.0 };
        // Each layer gathers its key and value and scatters their gradients over cp, or passes
        // them around the ring (on the step's path too: the rounds' overlap is not modelled).
        let cp_seconds =
            if cp > 1 { figures.cp_bytes / node_groups(cp, tp) + device.latency * figures.cp_exchanges } else { 0.0 };
        // Each layer's mixture sends its pairs to their experts' ranks and back, forward and
        // backward, over the ep ranks.
        let ep_seconds = if ep > 1 {
            figures.ep_bytes / node_groups(ep, tp * cp) + device.latency * EP_EXCHANGES_PER_LAYER * expert_layers as f64
        } else {
            0.0
        };
        // A middle stage receives and sends each micro-batch's activation and its gradient, once
        // per model chunk.
        let chunks = layout.virtual_stages as f64;
        let sends =
            if pp > 1 { chunks * (2.0 * boundary / node_groups(pp, tp * cp * dp) + 2.0 * device.latency) } else { 0.0 };
        let t = work + tp_seconds + cp_seconds + ep_seconds + sends;
        if t > slot {
            (slot, compute, tp_time, cp_time, ep_time) = (t, work, tp_seconds, cp_seconds, ep_seconds);
        }
        ep_bytes = ep_bytes.max(figures.ep_bytes);
        cp_bytes = cp_bytes.max(figures.cp_bytes);
        cp_reduce_bytes = cp_reduce_bytes.max(figures.cp_reduce_bytes);
        machine_seconds += ranks_per_stage * grad_accum as f64 * t;
        // The experts' gradients are summed on their own rank: nothing to reduce over dp, but
        // over the groups of ep.
        dp_bytes_max = dp_bytes_max.max(held.grads - experts.grads);
        expert_grads_max = expert_grads_max.max(experts.grads);
        tp_bytes = tp_bytes.max(figures.tp_bytes);
        if sharded_params > gathered_params {
            (gathered_params, gathered_experts) = (sharded_params, experts.params - unsharded(experts.params));
        }
    }
    if worst.peak > memory {
        return Err(format!(
            "out of memory: {} bytes per device, over {}",
            grouped(worst.peak as usize),
            grouped(memory as usize)
        ));
    }
    let micro_batches = grad_accum as f64;
    let slots = micro_batches + layout.bubble_slots();
    let bubble_fraction = layout.bubble_slots() / slots;
    let dp_link = node_groups(dp, tp * cp);
    let ring = 2.0 * (dpf - 1.0) / dpf;
    // Under cp the weights' gradients are summed over both axes, the later one on blocks: at
    // ZeRO 0 reduce-scattered over cp first (dp all-reduces 1/cp of them), from ZeRO 1 over dp
    // first (cp all-reduces the rank's shard).
    let (dp_share, cp_reduce_bytes) = match (cp > 1 && dp > 1, zero) {
        (false, _) => (1.0, cp_reduce_bytes),
        (true, 0) => (1.0 / cp as f64, cp_reduce_bytes),
        (true, _) => (1.0, cp_reduce_bytes / dpf),
    };
    let dp_volume = if dp > 1 {
        let gradient_bytes = dp_share * dp_bytes_max;
        // A dense parameter is gathered from all dp ranks (over ep, then over the groups), a
        // rank's experts from the groups.
        let gathered = (gathered_params - gathered_experts) * (dpf - 1.0) / dpf
            + gathered_experts * (expert_ways - 1.0) / expert_ways;
        let gathers = if zero == 3 { (2.0 * micro_batches - 1.0) * gathered } else { 0.0 };
        // From ZeRO 2 every micro-batch reduce-scatters its gradients.
        let reductions = if zero >= 2 { (micro_batches + 1.0) / 2.0 } else { 1.0 };
        // Over groups of ep a dense gradient is reduce-scattered over the groups and summed over
        // ep on its block (from ZeRO 1 scattered there too), its sum (or update) all-gathered
        // back: a ring over all dp ranks; the experts' over the groups alone.
        let expert_bytes = groups.map_or(0.0, |g| 2.0 * (g - 1.0) / g * expert_grads_max);
        reductions * (ring * gradient_bytes + expert_bytes) + gathers
    } else {
        0.0
    };
    // The weights' gradients are summed over cp too, over its own link.
    let cp_reduce_seconds =
        if cp > 1 { cp_reduce_bytes / node_groups(cp, tp) + device.latency * 2.0 * layers as f64 } else { 0.0 };
    let dp_seconds_total =
        dp_volume / dp_link + if dp > 1 { device.latency * 2.0 * layers as f64 } else { 0.0 } + cp_reduce_seconds;
    // The reduction of the last micro-batch's gradients overlaps its backward (two thirds of
    // it); from ZeRO 2, each micro-batch's overlaps its own.
    let overlapped = if zero >= 2 { micro_batches } else { 1.0 };
    let dp_seconds = (dp_seconds_total - overlapped * 2.0 / 3.0 * slot).max(0.0);
    let (pipeline_seconds, busy) = if device.shared_cores > 0 {
        (0.0, machine_seconds)
    } else {
        (slots * slot - micro_batches * slot, slots * slot)
    };
    // The uploads of offloaded shards share the host link with nothing else of the step, but
    // the gathers wait for them: counted in full.
    let offload = offload + fetch;
    let step_seconds = busy + dp_seconds + offload;
    Ok(Prediction {
        step_seconds,
        compute_seconds: if device.shared_cores > 0 { machine_seconds } else { micro_batches * compute },
        tp_seconds: micro_batches * tp_time,
        cp_seconds: micro_batches * cp_time,
        ep_seconds: micro_batches * ep_time,
        pipeline_seconds,
        dp_seconds,
        offload_seconds: offload,
        bubble_fraction,
        memory: worst,
        comm_bytes: micro_batches * (tp_bytes + cp_bytes + ep_bytes)
            + cp_reduce_bytes
            + dp_volume
            + if pp > 1 { 2.0 * layout.virtual_stages as f64 * micro_batches * boundary } else { 0.0 },
    })
}
