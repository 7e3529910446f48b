//! The layout search (`autotp plan`): the parallel layout to compile, chosen before a GPU-hour
//! is spent.
//!
//! It searches tp x pp x dp x ZeRO stage x micro-batch (gradient accumulation follows from the
//! global batch) x recomputation x pipeline schedule (1F1B, ZB-H1, interleaved 1F1B with 2 or 4
//! model chunks per stage) x sequence parallelism (with tp; its cuts are compiled with it, so
//! a layer's activations and traffic are its own) x context parallelism (cp 1, 2, 4, 8 at a
//! micro-batch of 1, in its all-gather form and around its ring, `--cp-comm-type p2p`;
//! compiled with it likewise) x expert parallelism (for a
//! mixture of experts, ep = dp: a cut compiled over ep ranks gives a rank's experts, its
//! padded work for every pair that may reach it and its all-to-alls; its difference from the
//! cut without ep is the other ranks' experts, which ZeRO does not shard and dp does not
//! reduce, [`figures::ExpertShare`]) for `--devices` devices, and returns every layout considered:
//! those that fit `--memory-per-device`, fastest first, with the `autotp compile` flags of each,
//! and why the others were refused. The CLI prints them.
//!
//! **Memory and work come from the compiler.** The model is imported shapes-only (its weights
//! need not exist) and cut to one layer and to two ([`autotp_passes::depth`]); each cut is
//! compiled for every tp, micro-batch and recomputation searched (one rank of tp, no dp, no
//! pipeline). Layers of one kind have the same shapes, so the difference of the two cuts is one
//! layer's exact bytes (parameters, gradients, optimizer state, intermediate values), GEMM
//! FLOPs and tp traffic, and the rest is the embedding and head. A model of several kinds of
//! layer (dense layers before a mixture of experts) is cut from layers of the kind with experts,
//! and each other kind is measured beside one of them ([`kinds`]). The values'
//! lifetimes in each compiled program give the peaks of its forward, backward and optimizer
//! step apart ([`figures::phase_peaks`]). A layout's stage of `n` layers then holds `n` layers' states,
//! ZeRO's shards of them over dp (stages 1 and 2 the optimizer state, 3 the gradients and
//! parameters, plus those gathered at once: up to DeepSpeed's 1e9), and the largest of: its
//! forward peak for the micro-batches in flight (1F1B: `min(pp - s, micro-batches)` on stage
//! `s`; ZB-H1 and interleaving hold more, [`Layout::in_flight`]) with the gradients accumulated so far; its backward peak; its optimizer step's; plus
//! its collectives' staging, from cuts compiled with dp 2 at the layout's ZeRO stage.
//!
//! A pipeline's stages are not slices of the one-stage program (a first stage under tp keeps
//! its embedding whole, each micro-batch's gradients are added into sums, activations wait for
//! the later stages' backwards), so pipelined layouts take their parameters, gradients, states
//! and intermediate values from a cut of 2 stages of 1 and of 2 layers each, compiled at the
//! layout's tp, micro-batch and recomputation over 3 micro-batches (1 when nothing
//! accumulates): a stage's first layer and rest from its end of the cut, its further layers
//! from the difference, a middle stage as the first without the embedding, and each
//! micro-batch in flight beyond the cut's adds a layer's saved activations
//! ([`figures::PipelineModel`]). `benches/plan_memory.sh` compiles every layout that fits and prints
//! predicted against compiled peaks; where they differ most, it is the arena's placement over
//! the live peak (long pipelines) and the data-parallel staging of a stage. `--verify N`
//! compiles the best N layouts whole for their exact peaks.
//!
//! **Time is a cost model** ([`device::Device`]): GEMM FLOPs at the device's rate (less for GEMMs of
//! few rows), other kernels' bytes at its memory bandwidth, a dispatch time per instruction,
//! tp's collectives per micro-batch over the node's link (NVLink, shared memory), cp's gathers
//! of keys and values and scatters of their gradients (or the ring's shifts, on the step's path
//! too: their overlap with the rounds is not modelled) per micro-batch, a latency each, and its
//! reduction of the weights' gradients per step over the link its group spans, the
//! pipeline's (micro-batches + stages - 1) slots of its slowest stage (the fill and drain
//! divided by the model chunks interleaved, a third of it under ZB-H1: [`Layout::bubble_slots`])
//! and its activation sends (once per model chunk),
//! and the data-parallel reduction (ZeRO 3: the gathers of every micro-batch too) over the
//! node's link or InfiniBand when the dp group spans nodes, less what overlaps the last
//! micro-batch's backward. CPU ranks share the machine's cores: their step is the work of all
//! ranks at the machine's rate. The CPU figures are fitted to `benches/plan.sh`'s measured
//! steps of gpt2-512; the GPU figures are the parts' data sheets, not yet measured.

mod cuts;
mod device;
mod figures;
mod kinds;
mod predict;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use autotp_frontend::ImportOptions;
use autotp_passes::expert_dispatch::ExpertCapacity;
use autotp_passes::pipeline::NumberedLayers;

pub use device::Device;
pub use figures::Model;
pub use predict::{Considered, Layout, MemoryFigures, Prediction};

use crate::summary::grouped;
use crate::{CompileError, CompileFlags, CompileOptions, Weights};
use cuts::{at_depth, divisors, layout_args, pipeline_cut, pipeline_cuts, search_cut, staging_cut, Cut};
use figures::{ExpertShare, Figures, PipelineModel};
use kinds::LayerKinds;

/// What to search: the `autotp plan` flags.
#[derive(Clone, Debug)]
pub struct SearchRequest {
    /// The ONNX model (its weights may be absent).
    pub model: PathBuf,
    pub devices: usize,
    pub memory_per_device: u64,
    /// Sequences per optimizer step [default: `devices`].
    pub global_batch: Option<usize>,
    pub seq_len: usize,
    /// `h100`, `h200` or `cpu`.
    pub device: String,
    /// `f32`, `bf16` or `fp16` [default: bf16 on GPUs, f32 on cpu].
    pub precision: Option<String>,
    pub micro_batches: Vec<usize>,
    pub recompute: Vec<String>,
    /// [default: 8 on GPUs, `devices` on cpu].
    pub devices_per_node: Option<usize>,
    pub node_link_gbps: Option<f64>,
    pub network_gbps: Option<f64>,
    /// Layouts to compile whole for their exact peak.
    pub verify: usize,
    /// `--moe-expert-capacity-factor`, in every layout searched (it changes the model, so
    /// the search does not choose it).
    pub moe_expert_capacity_factor: Option<f64>,
}

/// Every layout considered, and what the search knows of the model and the devices.
pub struct SearchResult {
    pub device: Device,
    pub precision: String,
    pub global_batch: usize,
    pub per_node: usize,
    pub layers: usize,
    /// The model's kinds of layer (more than one where, say, dense layers precede a mixture
    /// of experts): each kind's count of layers and its first layer's number, in order.
    pub layer_kinds: Vec<(usize, u64)>,
    pub parameters: usize,
    /// Every layout, with its prediction or why it was refused.
    pub considered: Vec<Considered>,
    /// The layouts that fit (indices into `considered`), fastest first.
    pub fitting: Vec<usize>,
    /// The per-layer model of each tp, micro-batch, recomputation and ZeRO stage, by name.
    pub models: BTreeMap<String, Model>,
    /// Cuts of the model compiled, and the seconds the search took.
    pub compiled_cuts: usize,
    pub search_seconds: f64,
    /// With `verify`: layouts compiled whole, those that fit, and the seconds it took.
    pub verify_tried: usize,
    pub verified: usize,
    pub verify_seconds: f64,
}

/// What the search reads off the model: its layers and where its parameters are.
struct ModelShape {
    numbered: NumberedLayers,
    layers: usize,
    parameters: usize,
    /// Of the parameters outside the layers, the share the token embedding holds.
    embedding_fraction: f64,
    /// The hidden size (the embedding table's width).
    hidden: usize,
    /// Of its lookups of experts' weights by a router's choices, the largest, for one sequence,
    /// and the experts it chooses among (`None` for a model without a mixture of experts, whose
    /// experts `--ep` splits).
    expert_gather: Option<(autotp_ir::TensorType, usize)>,
    /// Its layers' kinds, and those the cuts keep.
    kinds: LayerKinds,
}

impl ModelShape {
    fn of(request: &SearchRequest) -> Result<ModelShape, CompileError> {
        let options =
            ImportOptions { batch: Some(1), seq_len: Some(request.seq_len), shapes_only: true, ..Default::default() };
        let imported = autotp_frontend::import_onnx(&request.model, &options)?;
        let graph = &imported.graph;
        let layers = autotp_passes::depth::layer_count(graph);
        if layers < 2 {
            refuse!(
                "{}: autotp plan needs a model of numbered layers (parameters named PREFIX.N.*), at least 2; it has \
                 {layers}",
                request.model.display()
            );
        }
        let numbered = autotp_passes::pipeline::numbered_layers(graph).expect("counted above");
        let embeddings: Vec<String> = (autotp_passes::padding::embedding_tables(graph, &BTreeMap::new()).into_iter())
            .filter(|t| !t.tied)
            .map(|t| t.param)
            .collect();
        let is_embedding =
            |p: &autotp_ir::ValueId| graph.name_of(*p).is_some_and(|n| embeddings.iter().any(|e| e == n));
        let rest_elements: usize = (graph.params().iter())
            .filter(|&&p| graph.name_of(p).is_none_or(|n| numbered.number_of(n).is_none()))
            .map(|&p| graph.ty(p).numel())
            .sum();
        let embedding_elements: usize =
            graph.params().iter().filter(|p| is_embedding(p)).map(|&p| graph.ty(p).numel()).sum();
        let lookups = autotp_passes::expert_dispatch::routed_lookups(graph);
        let expert_layers: Vec<u64> =
            lookups.iter().filter_map(|l| numbered.number_of(graph.name_of(l.table)?)).collect();
        let expert_gather = (lookups.into_iter())
            .map(|l| (l.gathered, graph.ty(l.table).shape.first().copied().unwrap_or(1)))
            .max_by_key(|(t, _)| t.numel());
        Ok(ModelShape {
            layers,
            parameters: graph.params().iter().map(|&p| graph.ty(p).numel()).sum(),
            embedding_fraction: if rest_elements == 0 { 0.0 } else { embedding_elements as f64 / rest_elements as f64 },
            hidden: graph.params().iter().find(|p| is_embedding(p)).map_or(0, |&p| graph.ty(p).shape[1]),
            expert_gather,
            kinds: LayerKinds::of(graph, &numbered, &expert_layers),
            numbered,
        })
    }

    /// Why the compiler's graph of `sequences` sequences (a layout's micro-batch x dp) cannot
    /// hold what the model's lookups of experts gather, if it cannot: a batched-experts export
    /// gathers each (token, choice) pair's expert matrices, and the dispatch gathers them for
    /// its rows: room for every pair of the `ep` ranks' sequences on each (dropless), or with
    /// an expert capacity ([`ExpertCapacity`]) each expert's room for each sequence.
    fn experts_past_limits(&self, sequences: usize, ep: usize, capacity: Option<ExpertCapacity>) -> Option<String> {
        let (gathered, experts) = self.expert_gather.as_ref()?;
        let mut shape = gathered.shape.clone();
        let per_sequence = shape.first().copied()?;
        let (rows, over) = match capacity {
            Some(capacity) => {
                let choices = per_sequence / capacity.sequence.max(1);
                let rows = sequences.saturating_mul(experts * capacity.per_expert(choices, *experts));
                (rows, format!("each expert's room for each of {sequences} sequences (micro-batch x dp)"))
            }
            None => {
                let rows = per_sequence.saturating_mul(sequences).saturating_mul(ep);
                (rows, format!("over {} sequences (micro-batch x dp x ep)", sequences * ep))
            }
        };
        shape[0] = rows;
        let why = autotp_ir::TensorType::new(gathered.dtype, shape).check_limits().err()?;
        Some(format!(
            "the export gathers each (token, choice) pair's expert matrices, {over} at once in the compiler's graph: {why}"
        ))
    }
}

/// Searches the layouts `request` allows (see the module docs).
pub fn search(request: &SearchRequest) -> Result<SearchResult, CompileError> {
    let started = Instant::now();
    if request.devices == 0 || request.seq_len == 0 {
        refuse!("--devices, --seq-len and --top must be at least 1");
    }
    if request.micro_batches.is_empty() || request.micro_batches.contains(&0) {
        refuse!("--micro-batches must be at least 1");
    }
    if let Some(why) = request.moe_expert_capacity_factor.and_then(ExpertCapacity::factor_refused) {
        refuse!("{why}");
    }
    let gpu = request.device != "cpu";
    let precision = request.precision.clone().unwrap_or_else(|| if gpu { "bf16" } else { "f32" }.to_string());
    let mut device = Device::named(&request.device);
    if let Some(gbps) = request.node_link_gbps {
        device.node_link = gbps * 1e9;
    }
    if let Some(gbps) = request.network_gbps {
        device.network = gbps * 1e9;
    }
    let per_node = request.devices_per_node.unwrap_or(if gpu { 8 } else { request.devices }).max(1);
    let global_batch = request.global_batch.unwrap_or(request.devices);
    let shape = ModelShape::of(request)?;
    let (mut considered, wanted) = enumerate_layouts(request, &shape, per_node, global_batch);
    let cuts = compile_cuts(request, &precision, &shape.numbered, &wanted);
    let others_on_stages: BTreeMap<(usize, usize), Vec<Vec<usize>>> = (considered.iter())
        .map(|c| (c.layout.pp, c.layout.virtual_stages))
        .map(|(pp, v)| ((pp, v), shape.kinds.others_on_stages(pp, v)))
        .collect();
    let activation_bytes = if precision == "f32" { 4 } else { 2 };
    let smallest_micro_batch = *request.micro_batches.iter().min().expect("checked above");
    let mut models: BTreeMap<String, Model> = BTreeMap::new();
    for c in considered.iter_mut().filter(|c| c.refused.is_none()) {
        match model_of(&cuts, &c.layout, &shape, smallest_micro_batch, activation_bytes, request.seq_len) {
            Err(e) => c.refused = Some(first_line(&e)),
            Ok(model) => {
                let cp = match c.layout.cp_comm_type.as_str() {
                    "p2p" => format!("{} p2p", c.layout.cp),
                    _ => c.layout.cp.to_string(),
                };
                let key = format!(
                    "tp {} cp {cp} ep {} micro-batch {} recompute {} zero {}",
                    c.layout.tp, c.layout.ep, c.layout.micro_batch, c.layout.recompute, c.layout.zero
                );
                let memory = request.memory_per_device as f64;
                let others = &others_on_stages[&(c.layout.pp, c.layout.virtual_stages)];
                match predict::predict(&model, &c.layout, shape.layers, others, &device, per_node, memory) {
                    Ok(p) => {
                        let cuts = pipeline_cuts(&shape.numbered, c.layout.pp * c.layout.virtual_stages, shape.layers);
                        c.compile_args = Some(layout_args(request, &precision, &c.layout, &cuts));
                        c.prediction = Some(p);
                    }
                    Err(why) => c.refused = Some(why),
                }
                models.insert(key, model);
            }
        }
    }
    let mut order: Vec<usize> = (0..considered.len()).filter(|&i| considered[i].prediction.is_some()).collect();
    order.sort_by(|&a, &b| {
        let (pa, pb) =
            (considered[a].prediction.as_ref().expect("fits"), considered[b].prediction.as_ref().expect("fits"));
        pa.step_seconds.total_cmp(&pb.step_seconds).then(pa.memory.peak.total_cmp(&pb.memory.peak))
    });
    let search_seconds = started.elapsed().as_secs_f64();
    let (verified, verify_tried) = verify_best(request, &order, &mut considered)?;
    let fitting = order.into_iter().filter(|&i| considered[i].prediction.is_some()).collect();
    Ok(SearchResult {
        device,
        precision,
        global_batch,
        per_node,
        layers: shape.layers,
        layer_kinds: (shape.kinds.summary().into_iter())
            .map(|(count, first)| (count, shape.numbered.numbers[first]))
            .collect(),
        parameters: shape.parameters,
        considered,
        fitting,
        models,
        compiled_cuts: cuts.len(),
        search_seconds,
        verify_tried,
        verified,
        verify_seconds: started.elapsed().as_secs_f64() - search_seconds,
    })
}

/// Every layout of tp x pp x dp x ZeRO x micro-batch x recomputation, those refused at once
/// with why, and the cuts the others need compiled.
fn enumerate_layouts(
    request: &SearchRequest,
    shape: &ModelShape,
    per_node: usize,
    global_batch: usize,
) -> (Vec<Considered>, Vec<Cut>) {
    let layers = shape.layers;
    let mut considered: Vec<Considered> = Vec::new();
    let mut wanted: Vec<Cut> = Vec::new();
    let mut seen: std::collections::BTreeSet<Cut> = Default::default();
    let smallest_micro_batch = *request.micro_batches.iter().min().expect("checked by the caller");
    // The drop policy changes which pairs drop, not the rows: the search sizes by position
    // (`probs` adds its ranking's `[sequences, S, k, E]` temporaries, which it leaves out).
    let capacity = (request.moe_expert_capacity_factor).map(|factor| ExpertCapacity {
        sequence: request.seq_len,
        factor,
        policy: Default::default(),
    });
    // ZeRO-Offload frees a GPU's memory (the optimizer; with ZeRO-3 its parameter shards too);
    // CPU ranks' host is the memory they run in. (optimizer, parameters)
    let offloads: &[(bool, bool)] =
        if request.device == "cpu" { &[(false, false)] } else { &[(false, false), (true, false), (true, true)] };
    for (tp, cp, cp_comm_type) in divisors(request.devices).into_iter().flat_map(|tp| {
        context_parallel_sizes(request, tp).into_iter().flat_map(move |cp| {
            let forms: &[&str] = if cp > 1 { &["all_gather", "p2p"] } else { &["all_gather"] };
            forms.iter().map(move |&form| (tp, cp, form))
        })
    }) {
        for (pp, dp, ep) in divisors(request.devices / (tp * cp)).into_iter().flat_map(|pp| {
            let dp = request.devices / (tp * cp * pp);
            expert_parallel_sizes(shape, dp).into_iter().map(move |ep| (pp, dp, ep))
        }) {
            for zero in 0..=3 {
                for &micro_batch in &request.micro_batches {
                    for recompute in &request.recompute {
                        for (((schedule, virtual_stages), sequence_parallel), (offload_optimizer, offload_param)) in
                            pipeline_schedules(pp, layers)
                                .into_iter()
                                .flat_map(|s| [false, true].map(|sp| (s, sp)))
                                .filter(|&(_, sp)| !sp || (tp > 1 && cp == 1))
                                .flat_map(|s| offloads.iter().map(move |&offload| (s, offload)))
                                .filter(|&(_, (_, param))| !param || zero == 3)
                        {
                            let mut layout = Layout {
                                tp,
                                cp,
                                cp_comm_type: cp_comm_type.to_string(),
                                pp,
                                dp,
                                ep,
                                zero,
                                micro_batch,
                                grad_accum: 0,
                                recompute: recompute.clone(),
                                schedule: schedule.to_string(),
                                virtual_stages,
                                sequence_parallel,
                                offload_optimizer,
                                offload_param,
                            };
                            let grad_accum = global_batch / (dp * micro_batch).max(1);
                            let refused = if tp > per_node {
                                Some(format!("tp {tp} is more than a node's {per_node} devices"))
                            } else if pp > layers {
                                Some(format!("pp {pp} is more stages than the model's {layers} layers"))
                            } else if cp > 1 && micro_batch > 1 {
                                Some(format!(
                                    "cp {cp} splits one sequence at a time: it needs micro-batch 1, not {micro_batch}"
                                ))
                            } else if zero > 0 && dp < 2 {
                                Some(format!("ZeRO {zero} needs dp 2 or more"))
                            } else if !global_batch.is_multiple_of(dp * micro_batch) {
                                Some(format!(
                                "the global batch {global_batch} is not a multiple of dp {dp} x micro-batch {micro_batch}"
                            ))
                            } else if virtual_stages > 1 && (!grad_accum.is_multiple_of(pp) || grad_accum == pp) {
                                Some(format!(
                                    "interleaving {virtual_stages} model chunks needs micro-batches ({grad_accum}) a \
                                     multiple of pp {pp} and more than it (with as many, every forward runs first)"
                                ))
                            } else if sequence_parallel && !request.seq_len.is_multiple_of(tp) {
                                Some(format!(
                                    "sequence parallelism splits each sequence's {} tokens over tp {tp}: they do not \
                                     divide",
                                    request.seq_len
                                ))
                            } else if let Some(why) = shape.experts_past_limits(micro_batch * dp, ep, capacity) {
                                Some(why)
                            } else if ep > 1 && !shape.kinds.measured() {
                                Some(format!(
                                    "ep {ep}: the search measures a layer of experts from cuts of one and of two such \
                                     layers, and this model has one (compile the layout for its memory)"
                                ))
                            } else if schedule == "zb-h1" && *recompute != "none" {
                                Some(format!(
                                    "ZB-H1 holds each deferred weight-gradient chunk's recomputed layers, which the \
                                     search does not model: --recompute {recompute} is searched under 1F1B"
                                ))
                            } else {
                                None
                            };
                            if refused.is_none() {
                                layout.grad_accum = global_batch / (dp * micro_batch);
                                // With ep, the cut without it too: their difference is the
                                // other ranks' experts.
                                let needed = [
                                    Some(search_cut(&layout)),
                                    (ep > 1).then(|| search_cut(&Layout { ep: 1, ..layout.clone() })),
                                    staging_cut(&layout, smallest_micro_batch),
                                    pipeline_cut(&layout, &shape.kinds),
                                ];
                                // Each at 1 and 2 layers a stage; the layout's own cut beside
                                // each other kind of layer too.
                                let cuts = needed.into_iter().flatten().flat_map(|cut| {
                                    [1, 2].into_iter().filter_map(move |depth| at_depth(&shape.kinds, &cut, depth))
                                });
                                let beside =
                                    shape.kinds.other_cuts().into_iter().map(|layers| (search_cut(&layout), layers));
                                for cut in cuts.chain(beside) {
                                    if seen.insert(cut.clone()) {
                                        wanted.push(cut);
                                    }
                                }
                            }
                            considered.push(Considered {
                                layout,
                                prediction: None,
                                refused,
                                compile_args: None,
                                compiled_peak: None,
                            });
                        }
                    }
                }
            }
        }
    }
    (considered, wanted)
}

/// The context-parallel sizes searched beside tensor parallelism of `tp`: 1, and 2, 4 and 8
/// where they divide the sequence and the devices left (a node's worth: the gathers of keys and
/// values are on every layer's path); only 1 with an expert capacity, which counts each
/// sequence's pairs on one rank.
fn context_parallel_sizes(request: &SearchRequest, tp: usize) -> Vec<usize> {
    if request.moe_expert_capacity_factor.is_some() {
        return vec![1];
    }
    let left = request.devices / tp;
    [1, 2, 4, 8].into_iter().filter(|&cp| left.is_multiple_of(cp) && request.seq_len.is_multiple_of(cp)).collect()
}

/// The expert-parallel sizes searched over `dp` ranks: 1, and for a mixture of experts every
/// divisor of `dp` from 2 (the experts split over groups of the dp ranks, Megatron's
/// expert-data-parallel size `dp / ep`; the compiler refuses a count of experts it does not
/// divide).
fn expert_parallel_sizes(shape: &ModelShape, dp: usize) -> Vec<usize> {
    if shape.expert_gather.is_some() {
        divisors(dp)
    } else {
        vec![1]
    }
}

/// The pipeline schedules searched for `pp` stages of a model of `layers` layers, with the
/// model chunks per stage: 1F1B; for a pipeline, ZB-H1 and Megatron's interleaved 1F1B with 2
/// and 4 chunks per stage where there are layers enough.
fn pipeline_schedules(pp: usize, layers: usize) -> Vec<(&'static str, usize)> {
    let mut schedules = vec![("1f1b", 1)];
    if pp > 1 {
        schedules.push(("zb-h1", 1));
        schedules.extend([2, 4].into_iter().filter(|v| pp * v <= layers).map(|v| ("1f1b", v)));
    }
    schedules
}

/// The figures of each stage of every wanted cut, compiled on the machine's cores; a cut the
/// compiler refuses gives its reason.
fn compile_cuts(
    request: &SearchRequest,
    precision: &str,
    numbered: &NumberedLayers,
    jobs: &[Cut],
) -> BTreeMap<Cut, Result<Vec<Figures>, String>> {
    let cuts: Mutex<BTreeMap<Cut, Result<Vec<Figures>, String>>> = Mutex::default();
    let next = Mutex::new(0usize);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let job = {
                    let mut next = next.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                    let Some(job) = jobs.get(*next).cloned() else { return };
                    *next += 1;
                    job
                };
                // An equal share of the layers kept on each stage.
                let (layout, layers) = &job;
                let depth = layers.len() / layout.pp;
                let stage_cuts: Vec<String> = (1..layout.pp)
                    .map(|s| format!("{}.{}", numbered.prefix, numbered.numbers[layers[s * depth]]))
                    .collect();
                let figures =
                    compile_layout(&layout_args(request, precision, layout, &stage_cuts), Some(layers.clone()))
                        .map(|plan| plan.stages.iter().map(Figures::of).collect())
                        .map_err(|e| crate::render_error(&e));
                cuts.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(job, figures);
            });
        }
    });
    cuts.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The plan of `autotp compile ARGS`, shapes-only, cut to the layers at positions `layers` when
/// given.
fn compile_layout(
    args: &[String],
    layers: Option<Vec<usize>>,
) -> Result<autotp_program::plan::TrainingPlan, CompileError> {
    let options = CompileOptions::from_flags(&CompileFlags::parse_args(args)?)?;
    Ok(crate::compile(&options, Weights::ShapesOnly { layers })?.plan)
}

/// A layout's per-layer model, from the cuts compiled for it.
fn model_of(
    cuts: &BTreeMap<Cut, Result<Vec<Figures>, String>>,
    layout: &Layout,
    shape: &ModelShape,
    smallest_micro_batch: usize,
    activation_bytes: usize,
    seq_len: usize,
) -> Result<Model, String> {
    let stage_of = |cut: &Cut, stage: usize| -> Result<Figures, String> {
        cuts[cut].as_ref().map(|stages| stages[stage]).map_err(Clone::clone)
    };
    // A cut's stage: per layer, the rest, and its figures with 1 and 2 layers a stage.
    let split = |cut: &Layout, stage: usize| -> Result<(Figures, Figures, Figures, Figures), String> {
        let depth = |depth: usize| {
            let cut = (at_depth(&shape.kinds, cut, depth))
                .ok_or_else(|| format!("the model has no {} layers of a kind to cut", depth * cut.pp))?;
            stage_of(&cut, stage)
        };
        let (one, two) = (depth(1)?, depth(2)?);
        let layer = Figures::combine(two, one, |a, b| a - b);
        Ok((layer, Figures::combine(one, layer, |a, b| a - b), one, two))
    };
    let search = search_cut(layout);
    let (layer, rest, _, two) = split(&search, 0)?;
    let other_kinds = (shape.kinds.other_cuts().into_iter())
        .map(|layers| Ok(Figures::combine(stage_of(&(search.clone(), layers), 0)?, two, |a, b| a - b)))
        .collect::<Result<Vec<Figures>, String>>()?;
    let dp_staging = match staging_cut(layout, smallest_micro_batch) {
        Some(cut) => split(&cut, 0).map(|(layer, rest, _, _)| Some((layer, rest)))?,
        None => None,
    };
    let pipeline = match pipeline_cut(layout, &shape.kinds) {
        None => None,
        Some(cut) => {
            let (first_layer, _, first, _) = split(&cut, 0)?;
            let (last_layer, _, last, _) = split(&cut, 1)?;
            Some(PipelineModel {
                first,
                first_layer,
                last,
                last_layer,
                layer_saved: match first_layer.before_optimizer - last_layer.before_optimizer {
                    saved if cut.grad_accum >= 2 && saved > 0.0 => saved,
                    _ => layer.forward,
                },
                micro_batches: cut.grad_accum as f64,
            })
        }
    };
    let experts = match layout.ep {
        1 => ExpertShare::default(),
        ep => {
            let (whole, _, _, _) = split(&search_cut(&Layout { ep: 1, ..layout.clone() }), 0)?;
            let others = whole.params - layer.params;
            ExpertShare {
                own: others / (ep - 1) as f64,
                others,
                grads_per_param: whole.grads / whole.params,
                optimizer_per_param: whole.optimizer / whole.params,
            }
        }
    };
    let boundary_per_sequence = (seq_len * shape.hidden * activation_bytes) as f64;
    Ok(Model {
        layer,
        rest,
        backward_extra: (two.backward + two.grads - two.forward).max(0.0),
        embedding_fraction: shape.embedding_fraction,
        // A rank sends its tokens' share of the hidden state.
        boundary: boundary_per_sequence * layout.micro_batch as f64 / layout.cp as f64,
        param_bytes: activation_bytes as f64,
        tp_staging: two.staging,
        dp_staging,
        pipeline,
        experts,
        other_kinds,
    })
}

/// Compiles the fastest layouts whole (shapes-only) until `request.verify` fit, or four times
/// as many (and 8) were tried: a layout the compiler refuses, or whose compiled peak does not
/// fit, is refused. Returns (verified, tried).
fn verify_best(
    request: &SearchRequest,
    order: &[usize],
    considered: &mut [Considered],
) -> Result<(usize, usize), CompileError> {
    let (mut verified, mut tried) = (0, 0);
    for &i in order {
        if verified == request.verify || tried == 4 * request.verify + 8 {
            break;
        }
        tried += 1;
        let c = &mut considered[i];
        let args = c.compile_args.as_ref().expect("a layout that fits has its flags");
        match compile_layout(args, None) {
            Err(e) => c.refused = Some(format!("the compiler refuses it: {}", first_line(&crate::render_error(&e)))),
            Ok(plan) => {
                let report = autotp_program::report::report(&plan);
                let peak = report.ranks.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
                c.compiled_peak = Some(peak as f64);
                if peak as u64 > request.memory_per_device {
                    c.refused = Some(format!(
                        "out of memory when compiled: {} bytes per device, over {}",
                        grouped(peak),
                        grouped(request.memory_per_device as usize)
                    ));
                } else {
                    verified += 1;
                }
            }
        }
        if c.refused.is_some() {
            c.prediction = None;
        }
    }
    Ok((verified, tried))
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().to_string()
}
