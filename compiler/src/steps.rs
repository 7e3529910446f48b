//! The compile as data: a list of named [`Step`]s over the graphs of a [`CompileState`] (one
//! graph, or one per pipeline stage once the split has run), run by one manager that verifies
//! every graph after each step, times it, and shows it (`--dump-ir DIR` writes
//! `NN-name[.stageS].ir`, `--print-after NAME` prints it; both take their names from the list,
//! as rustc's `-Zdump-mir` does). [`steps`] turns the options into the list:
//!
//! | step | on | what it does |
//! |---|---|---|
//! | `recognize`, `peephole`, `unmerge-heads`, `dce` | the model | the simplification every import gets ([`PassManager::simplify_passes`]) |
//! | `attention`, `dce` | the model | with `--attention fused`: attention as one op |
//! | `loss` | the model | attaches the loss |
//! | `split-fused`, `expand-norms` | the model | under `--tp`: fused projections per part, split norms as arithmetic |
//! | `precision` | the model | mixed precision's casts (`--precision bf16|fp16`) |
//! | `autodiff`, `precision-accumulation`, `accumulate` | the model | gradients, their type, micro-batches (without a pipeline) |
//! | `pipeline` | the model -> stages | the pipeline split (`--pp`), gradients per stage |
//! | `optimize`, `dce`, `zero` | each stage | the optimizer update; data parallelism and ZeRO (`--dp`, without `--tp`) |
//! | `autotp` | each stage | tensor parallelism (`--tp`), with data parallelism and ZeRO |
//! | `fusion` or `recompute` | each stage | generated kernels' groups, with what `--recompute` recomputes |
//! | `lower` | each stage -> a program | codegen: kernels, the memory plan |
//!
//! The validation step ([`Purpose::Evaluate`]) runs the same list without `autodiff`,
//! `optimize`, gradient accumulation's types and recomputation; its pipeline runs the forward
//! chunks alone, on the training step's cuts, and its sharding steps place each parameter as
//! the training programs do.
//!
//! Tests: tests/compile.rs (dumps, names, refusals), tests/golden (passes alone),
//! tests/validation.rs (the validation step on every layout).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use autotp_ir::{Graph, Placement};
use autotp_passes::accumulate::Accumulate;
use autotp_passes::autodiff::Autodiff;
use autotp_passes::autotp::AutoTp;
use autotp_passes::optimize::{NonFinite, Optimize, StageNorm};
use autotp_passes::pipeline::{bubble_fraction, stage_idle_fractions, Pipeline};
use autotp_passes::recompute::Recompute;
use autotp_passes::zero::Zero;
use autotp_passes::{Pass, PassError, PassManager};
use autotp_program::plan::{PipelineConfig, RecomputeSummary};
use autotp_program::step::{SequenceOrder, StepInput};
use autotp_program::Program;

use crate::compile::Weights;
use crate::flags::{AttentionFlag, OffloadFlag, Precision};
use crate::recompute::{choose_recompute, Recomputation};
use crate::{CompileError, CompileOptions};

/// The compile between steps.
pub struct CompileState {
    /// The model's graph, or each pipeline stage's once the split has run.
    pub graphs: Vec<Graph>,
    /// Each stage's part in the clipping norm (from the split).
    pub norms: Vec<Option<StageNorm>>,
    /// The pipeline's description for the plan (from the split).
    pub pipeline: Option<PipelineConfig>,
    /// What each stage recomputes, and what it saves and costs (from `fusion` or `recompute`).
    pub recompute: Option<RecomputeSummary>,
    /// Per stage, each weight the tensor-parallel split placed and why (with `--explain-tp`).
    pub tp_explanations: Vec<Vec<TpExplanation>>,
    /// Each stage's program (from `lower`).
    pub programs: Vec<Program>,
    /// The order the token inputs hold each sequence in (from `cp-balance`).
    pub sequence_order: SequenceOrder,
}

/// One weight as tensor parallelism placed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpExplanation {
    pub weight: String,
    /// `shard(0)`, `replicate`, ...
    pub placement: String,
    pub reason: String,
}

impl CompileState {
    /// Whether the graphs are pipeline stages (the split has run).
    pub fn pipelined(&self) -> bool {
        self.pipeline.is_some()
    }

    pub fn new(graph: Graph) -> CompileState {
        CompileState {
            graphs: vec![graph],
            norms: vec![None],
            pipeline: None,
            recompute: None,
            tp_explanations: Vec::new(),
            programs: Vec::new(),
            sequence_order: SequenceOrder::Natural,
        }
    }
}

/// One named step of the compile.
pub trait Step {
    /// The name `--print-after` and `--dump-ir` use.
    fn name(&self) -> &'static str;
    fn run(&self, state: &mut CompileState) -> Result<(), CompileError>;
    /// Whether the step rewrites the graphs, which are then verified and shown (every step
    /// but `lower`, which reads them).
    fn rewrites_graphs(&self) -> bool {
        true
    }
}

/// A graph pass, run on every graph.
struct GraphPass(Box<dyn Pass>);

impl Step for GraphPass {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn run(&self, state: &mut CompileState) -> Result<(), CompileError> {
        for graph in &mut state.graphs {
            self.0.run(graph)?;
        }
        Ok(())
    }
}

/// The optimizer update, with each stage's part in the clipping norm.
struct OptimizeStep {
    optimizer: autotp_passes::optimize::Optimizer,
    grad_clip: Option<f64>,
    nonfinite: NonFinite,
}

impl Step for OptimizeStep {
    fn name(&self) -> &'static str {
        "optimize"
    }

    fn run(&self, state: &mut CompileState) -> Result<(), CompileError> {
        for (graph, norm) in state.graphs.iter_mut().zip(&state.norms) {
            let optimize = Optimize {
                optimizer: self.optimizer.clone(),
                grad_clip: self.grad_clip,
                stage: norm.clone(),
                nonfinite: self.nonfinite,
            };
            optimize.run(graph)?;
        }
        Ok(())
    }
}

/// The pipeline split: the model's graph becomes one graph per stage.
struct PipelineSplit(Pipeline);

impl Step for PipelineSplit {
    fn name(&self) -> &'static str {
        "pipeline"
    }

    fn run(&self, state: &mut CompileState) -> Result<(), CompileError> {
        let pipeline = &self.0;
        let [graph] = &state.graphs[..] else { unreachable!("the split runs once, on the model") };
        let (stages, graphs) = pipeline.run(graph)?;
        tracing::debug!(boundaries = ?stages.boundaries, "pipeline cuts");
        let (p, v, m, schedule) = (pipeline.stages, pipeline.virtual_stages, pipeline.micro_batches, pipeline.schedule);
        let stage_idle = stage_idle_fractions(schedule, pipeline.backward, &stages.chunk_costs, p, m).map_err(|e| {
            autotp_passes::PassError::Invalid {
                pass: "pipeline",
                message: format!("the {} schedule: {e}", schedule.name()),
            }
        })?;
        state.pipeline = Some(PipelineConfig {
            schedule: schedule.name().to_string(),
            backward: pipeline.backward.name().to_string(),
            virtual_stages: v,
            stage_flops: pipeline.rank_flops(&stages),
            in_flight: pipeline.in_flight(),
            bubble_fraction: bubble_fraction(p, v, m),
            stage_idle,
        });
        // A parameter two stages hold counts in the clipping norm on the first.
        let params = pipeline.rank_params(&stages);
        state.norms = (0..p)
            .map(|s| {
                Some(StageNorm {
                    stage: s,
                    stages: p,
                    counted_elsewhere: params[s]
                        .iter()
                        .filter(|param| params[..s].iter().any(|earlier| earlier.contains(param)))
                        .cloned()
                        .collect(),
                })
            })
            .collect();
        state.graphs = graphs;
        Ok(())
    }
}

/// Data parallelism and ZeRO on each stage; each stage's parameters placed as
/// `param_placements[stage]` says where it is given ([`Purpose::Evaluate`]).
struct DataParallel {
    zero: Zero,
    param_placements: Vec<BTreeMap<String, Vec<Placement>>>,
}

impl Step for DataParallel {
    fn name(&self) -> &'static str {
        self.zero.name()
    }

    fn run(&self, state: &mut CompileState) -> Result<(), CompileError> {
        for (s, graph) in state.graphs.iter_mut().enumerate() {
            let held = self.param_placements.get(s).cloned().unwrap_or_default();
            Zero { param_placements: held, batch_inputs: self.zero.batch_inputs.clone(), ..self.zero }.run(graph)?;
        }
        Ok(())
    }
}

/// Tensor parallelism on each stage (AutoTP's split, then `shard`); with `explain`
/// (`--explain-tp`), each weight's placement and why; each stage's parameters placed as
/// `param_placements[stage]` says where it is given ([`Purpose::Evaluate`]).
struct TensorParallel {
    autotp: AutoTp,
    explain: bool,
    param_placements: Vec<BTreeMap<String, Vec<Placement>>>,
}

impl Step for TensorParallel {
    fn name(&self) -> &'static str {
        "autotp"
    }

    fn run(&self, state: &mut CompileState) -> Result<(), CompileError> {
        state.tp_explanations.clear();
        for (s, graph) in state.graphs.iter_mut().enumerate() {
            let autotp = AutoTp {
                batch_inputs: self.autotp.batch_inputs.clone(),
                param_placements: self.param_placements.get(s).cloned().unwrap_or_default(),
                ..self.autotp
            };
            let (sharded, explained) = autotp.shard(graph)?;
            if !self.explain {
                *graph = sharded;
                continue;
            }
            let mut rows: Vec<TpExplanation> = explained
                .iter()
                .map(|e| TpExplanation {
                    weight: e.weight.clone(),
                    placement: e.placement.to_string(),
                    reason: e.reason.clone(),
                })
                .collect();
            for &p in graph.params() {
                let name = graph.name_of(p).unwrap_or("");
                if !explained.iter().any(|e| e.weight == name) {
                    rows.push(TpExplanation {
                        weight: name.to_string(),
                        placement: "replicate".into(),
                        reason: "not in a tensor-parallel block".into(),
                    });
                }
            }
            state.tp_explanations.push(rows);
            *graph = sharded;
        }
        Ok(())
    }
}

/// Megatron's load balance for context parallelism on every stage, or on none: each graph
/// rewritten to compute its sequences in the balanced order
/// ([`autotp_passes::context_balance`]). A training compile keeps the natural order where a
/// stage cannot take the balanced one, and says why; the validation step takes the order its
/// training step took (`required`).
struct ContextBalance {
    seq_len: usize,
    required: Option<SequenceOrder>,
}

impl Step for ContextBalance {
    fn name(&self) -> &'static str {
        "cp-balance"
    }

    fn run(&self, state: &mut CompileState) -> Result<(), CompileError> {
        if self.required == Some(SequenceOrder::Natural) {
            return Ok(());
        }
        let mut balanced = Vec::with_capacity(state.graphs.len());
        for graph in &state.graphs {
            match autotp_passes::context_balance::load_balance(graph, self.seq_len)? {
                Ok(graph) => balanced.push(graph),
                Err(why) if self.required.is_none() => {
                    tracing::warn!("context parallelism keeps each rank's tokens contiguous, not load-balanced: {why}");
                    return Ok(());
                }
                Err(why) => {
                    return Err(CompileError::Options(format!(
                        "the validation step cannot take the training step's load-balanced sequence order: {why}"
                    )))
                }
            }
        }
        let cp = state.graphs[0].mesh.axes.iter().find(|a| a.name == autotp_ir::CONTEXT_AXIS).map_or(1, |a| a.size);
        state.graphs = balanced;
        state.sequence_order = SequenceOrder::LoadBalanced { cp };
        Ok(())
    }
}

/// Context parallelism's ring on every stage, or on none ([`autotp_passes::cp_ring`]): a stage
/// that cannot take it keeps the all-gather, on every stage, and a warning says why.
struct RingAttention;

impl Step for RingAttention {
    fn name(&self) -> &'static str {
        "cp-ring"
    }

    fn run(&self, state: &mut CompileState) -> Result<(), CompileError> {
        let mut rings = Vec::with_capacity(state.graphs.len());
        for graph in &state.graphs {
            match autotp_passes::cp_ring::ring_attention(graph, state.sequence_order)? {
                Ok(graph) => rings.push(graph),
                Err(why) => {
                    tracing::warn!(
                        "context parallelism all-gathers attention's keys and values, not around a ring: {why}"
                    );
                    return Ok(());
                }
            }
        }
        state.graphs = rings;
        Ok(())
    }
}

/// Chooses each stage's recomputation (`--recompute`, `auto` under `--memory-cap`), records
/// what it saves and costs, and applies it: inside fusion's groups with generated kernels
/// (`fusion`), as a rewrite of the graph with builtin ones (`recompute`).
struct RecomputeAndFuse {
    recomputation: Recomputation,
    generated: bool,
}

impl Step for RecomputeAndFuse {
    fn name(&self) -> &'static str {
        if self.generated {
            "fusion"
        } else {
            "recompute"
        }
    }

    fn run(&self, state: &mut CompileState) -> Result<(), CompileError> {
        let pipelined = state.pipelined();
        let mut summary = self.recomputation.empty_summary();
        for (s, graph) in state.graphs.iter_mut().enumerate() {
            let recompute = choose_recompute(&self.recomputation, graph, pipelined.then_some(s), &mut summary)?;
            if self.generated {
                autotp_passes::fusion::Fusion { recompute }.run(graph)?;
            } else if recompute != Recompute::None {
                *graph = autotp_passes::recompute::recompute(graph, recompute).0;
            }
        }
        state.recompute = self.recomputation.rewrites().then_some(summary);
        Ok(())
    }
}

/// Codegen: each stage's graph becomes the program its ranks run.
struct Lower {
    options: autotp_codegen::LowerOptions,
    nvme_tile_elements: Option<usize>,
    /// `--offload-param nvme`'s buffers: (count, elements each).
    nvme_param_buffers: Option<(usize, usize)>,
    memory_cap: Option<u64>,
    /// How the summary names what each stage recomputes, for the memory cap's refusal.
    recompute_flag: &'static str,
}

impl Step for Lower {
    fn name(&self) -> &'static str {
        "lower"
    }

    fn rewrites_graphs(&self) -> bool {
        false
    }

    fn run(&self, state: &mut CompileState) -> Result<(), CompileError> {
        let pipelined = state.pipelined();
        for (s, graph) in state.graphs.iter().enumerate() {
            let program = autotp_codegen::lower_with(graph, &self.options)?;
            if let Some(tile_elements) = self.nvme_tile_elements {
                let stage = if pipelined { format!(" (stage {s})") } else { String::new() };
                autotp_program::offload::Layout::of(&program, tile_elements)
                    .map_err(|e| CompileError::Options(format!("--offload-optimizer nvme{stage}: {e}")))?;
            }
            if let Some((count, size)) = self.nvme_param_buffers {
                let stage = if pipelined { format!(" (stage {s})") } else { String::new() };
                autotp_program::param_file::ParamSwap::of(&program, count, size)
                    .map_err(|e| CompileError::Options(format!("--offload-param nvme{stage}: {e}")))?;
            }
            if let Some(cap) = self.memory_cap.filter(|&cap| program.memory.arena_bytes as u64 > cap) {
                let stage = if pipelined { format!("stage {s}") } else { "each rank".to_string() };
                let chosen = state.recompute.as_ref().and_then(|r| r.chosen.get(s).cloned());
                return Err(CompileError::Options(format!(
                    "{stage} needs {} bytes, over --memory-cap {cap} (with --recompute {}); --recompute auto \
                     recomputes activations until a plan fits",
                    program.memory.arena_bytes,
                    chosen.unwrap_or_else(|| self.recompute_flag.to_string())
                )));
            }
            state.programs.push(program);
        }
        Ok(())
    }
}

/// What the model tells the steps: its parameters that get no gradient (`--freeze`) and its
/// embedding tables' padding rows.
pub struct ModelFacts {
    pub frozen: std::collections::BTreeSet<String>,
    pub padding_rows: std::collections::BTreeMap<String, usize>,
}

/// What a compile's programs do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// One optimizer step: forward, backward, update.
    Train,
    /// The validation step: the training step's forward and loss on the same layout (the
    /// same stages and parameter blocks), no gradient and no optimizer state. Each stage holds
    /// its parameters as the training programs place them (`param_placements[stage]`, by
    /// name; ZeRO-3 finds what it shards from the optimizer, which this step lacks).
    /// The token inputs are in the training step's `sequence_order`.
    Evaluate { param_placements: Vec<BTreeMap<String, Vec<Placement>>>, sequence_order: SequenceOrder },
}

/// The compile's steps for `options`, in order.
pub fn steps(options: &CompileOptions, model: &ModelFacts, weights: &Weights, purpose: Purpose) -> Vec<Box<dyn Step>> {
    let flags = &options.flags;
    let weights_read = *weights == Weights::Read;
    let train = purpose == Purpose::Train;
    let (param_placements, required_order) = match purpose {
        Purpose::Train => (Vec::new(), None),
        Purpose::Evaluate { param_placements, sequence_order } => (param_placements, Some(sequence_order)),
    };
    let batch_inputs = vec![StepInput::InputIds.name().to_string(), StepInput::Labels.name().to_string()];
    let mut autodiff = Autodiff::new(autotp_passes::loss::LOSS);
    autodiff.frozen = model.frozen.clone();
    autodiff.padding_rows = model.padding_rows.clone();
    let pass = |p: Box<dyn Pass>| -> Box<dyn Step> { Box::new(GraphPass(p)) };
    let mut steps: Vec<Box<dyn Step>> = PassManager::simplify_passes().into_iter().map(pass).collect();
    if flags.attention == AttentionFlag::Fused {
        steps.push(pass(Box::new(autotp_passes::attention::FuseAttention {
            tensor_parallel: flags.tp,
            // Ulysses' attention sees the whole sequence: its queries start at 0.
            context_parallel: if flags.cp_comm_type == "a2a" { 1 } else { flags.cp },
            load_balanced: options.cp_load_balance(),
        })));
        steps.push(pass(Box::new(autotp_passes::dce::Dce)));
    }
    steps.push(pass(Box::new(autotp_passes::loss::AttachLoss)));
    let capacity = (flags.moe_expert_capacity_factor).map(|factor| autotp_passes::expert_dispatch::ExpertCapacity {
        sequence: flags.seq_len,
        factor,
        policy: flags.moe_token_drop_policy.policy(),
    });
    if flags.ep > 1 || capacity.is_some() {
        // The experts' ranks are groups of the data-parallel ranks; each sends its own part of
        // a context-parallel sequence. A capacity alone lays the pairs out by expert, each rank
        // its own source and destination.
        let layout = autotp_passes::expert_dispatch::DispatchLayout {
            ranks: flags.ep,
            outer: flags.dp / flags.ep,
            inner: flags.cp,
        };
        steps.push(pass(Box::new(autotp_passes::expert_dispatch::DispatchExperts { layout, capacity })));
    }
    if flags.tp > 1 {
        steps.push(pass(Box::new(autotp_passes::split_fused::SplitFused)));
        steps.push(pass(Box::new(autotp_passes::expand_norms::ExpandNorms)));
    }
    let mixed = options.mixed_precision();
    let loss_scaling = flags.precision == Precision::Fp16;
    if mixed {
        steps.push(pass(Box::new(autotp_passes::precision::Precision { half: flags.precision.dtype(), loss_scaling })));
        if loss_scaling {
            autodiff.cotangent = Some(autotp_passes::precision::LOSS_SCALE.into());
        }
    }
    if flags.pp > 1 {
        steps.push(Box::new(PipelineSplit(Pipeline {
            stages: flags.pp,
            virtual_stages: flags.virtual_stages,
            cuts: flags.pp_cuts.clone(),
            micro_batches: options.grad_accum,
            schedule: options.pipeline_schedule,
            backward: options.pipeline_backward,
            batch_inputs: batch_inputs.clone(),
            frozen: model.frozen.clone(),
            padding_rows: model.padding_rows.clone(),
            grad_dtype: options.grad_accum_dtype(),
            loss_scaling,
            forward_only: !train,
        })));
    } else {
        if train {
            steps.push(pass(Box::new(autodiff)));
        }
        if let Some(dtype) = options.grad_accum_dtype().filter(|_| train) {
            steps.push(pass(Box::new(autotp_passes::precision::GradAccumulation { dtype })));
        }
        if options.grad_accum > 1 {
            steps.push(pass(Box::new(Accumulate {
                micro_batches: options.grad_accum,
                batch_inputs: batch_inputs.clone(),
            })));
        }
    }
    // A checked step keeps the state as it was when a gradient is not finite: the trainer then
    // stops the run or skips the step (`--nan-policy`), or lowers fp16's loss scale.
    let nonfinite = match flags.precision {
        Precision::F32 if flags.no_finite_check => NonFinite::Apply,
        Precision::F32 | Precision::Bf16 => NonFinite::Skip,
        Precision::Fp16 => NonFinite::SkipScaled,
    };
    if train {
        steps.push(Box::new(OptimizeStep {
            optimizer: options.optimizer.clone(),
            grad_clip: flags.grad_clip,
            nonfinite,
        }));
    }
    steps.push(pass(Box::new(autotp_passes::dce::Dce)));
    if (flags.dp > 1 || flags.cp > 1) && flags.tp == 1 {
        let zero = Zero {
            dp: flags.dp,
            cp: flags.cp,
            config: options.zero,
            batch_inputs: batch_inputs.clone(),
            param_placements: BTreeMap::new(),
            ep: flags.ep,
        };
        steps.push(Box::new(DataParallel { zero, param_placements: param_placements.clone() }));
    }
    if flags.tp > 1 {
        let autotp = AutoTp {
            tp: flags.tp,
            dp: flags.dp,
            cp: flags.cp,
            zero: options.zero,
            batch_inputs,
            replicate_unsplittable: flags.tp_replicate_unsplittable,
            param_placements: BTreeMap::new(),
            sequence_parallel: flags.sequence_parallel.then_some(flags.seq_len),
            ep: flags.ep,
        };
        steps.push(Box::new(TensorParallel { autotp, explain: flags.explain_tp, param_placements }));
    }
    if options.cp_load_balance() {
        steps.push(Box::new(ContextBalance { seq_len: flags.seq_len, required: required_order }));
    }
    if options.cp_ring() {
        steps.push(Box::new(RingAttention));
    }
    let generated = options.kernels() == autotp_codegen::KernelChoice::Generated;
    let offload_optimizer = train && flags.offload_optimizer != OffloadFlag::None;
    let offload_params = flags.offload_param != OffloadFlag::None;
    // The evaluation step keeps its copy of the parameters in host memory.
    let max_params_in_cpu = options.nvme_params.as_ref().filter(|_| train).map(|n| n.max_in_cpu);
    let measure = autotp_codegen::LowerOptions {
        kernels: options.kernels(),
        gpu_kernels: false,
        grouped_experts: flags.moe_grouped_gemm,
        ptx: false,
        offload_optimizer,
        offload_params,
        max_params_in_cpu,
    };
    // The evaluation step keeps no activation for a backward: nothing to recompute.
    // A cut of the model compiled for the layout search is not printed: it skips the summary's
    // activation peak without recomputation (a second fusion and lowering of the step).
    let peak_without = !matches!(weights, Weights::ShapesOnly { layers: Some(_) });
    let recomputation =
        if train { Recomputation::new(options, measure, peak_without) } else { Recomputation::none(measure) };
    if generated || recomputation.rewrites() {
        steps.push(Box::new(RecomputeAndFuse { recomputation, generated }));
    }
    // The GPU forms and PTX are for the plan file: a shapes-only compile makes none. A plan of
    // builtin kernels carries the GPU forms (the emulated GPU runs them) but no PTX.
    let lower = autotp_codegen::LowerOptions {
        kernels: options.kernels(),
        gpu_kernels: weights_read,
        grouped_experts: flags.moe_grouped_gemm,
        ptx: generated && weights_read,
        offload_optimizer,
        offload_params,
        max_params_in_cpu,
    };
    steps.push(Box::new(Lower {
        options: lower,
        nvme_tile_elements: options.nvme.as_ref().map(|n| n.tile_elements).filter(|_| train),
        nvme_param_buffers: options.nvme_params.as_ref().map(|n| (n.buffer_count, n.buffer_size)).filter(|_| train),
        memory_cap: flags.memory_cap.filter(|_| train),
        recompute_flag: flags.recompute.name(),
    }));
    steps
}

/// Shows the graphs after the steps `--print-after` names (on standard output, as each step
/// finishes, so a later step's failure does not hide them) and writes them under `--dump-ir`.
pub struct Observer<'a> {
    pub dump_dir: Option<&'a Path>,
    pub print_after: &'a [String],
}

impl Observer<'_> {
    fn observe(&mut self, index: usize, step: &str, state: &CompileState) -> Result<(), CompileError> {
        for (s, graph) in state.graphs.iter().enumerate() {
            let stage = state.pipelined().then_some(s);
            if self.print_after.iter().any(|p| p == step) {
                let of_stage = stage.map(|s| format!(", stage {s}")).unwrap_or_default();
                println!("# IR after pass {index} ({step}{of_stage})");
                print!("{}", autotp_ir::text::print(graph));
            }
            if let Some(dir) = self.dump_dir {
                let suffix = stage.map(|s| format!(".stage{s}")).unwrap_or_default();
                let path = dir.join(format!("{index:02}-{step}{suffix}.ir"));
                std::fs::write(&path, autotp_ir::text::print(graph)).map_err(|source| CompileError::Io {
                    flag: "--dump-ir",
                    action: "write",
                    path: path.clone(),
                    source,
                })?;
            }
        }
        Ok(())
    }
}

/// Runs `steps` over `state` (see the module docs); returns each step's seconds.
pub fn run_steps(
    steps: &[Box<dyn Step>],
    state: &mut CompileState,
    observer: &mut Observer,
) -> Result<Vec<(&'static str, f64)>, CompileError> {
    let shown: Vec<&str> = steps.iter().filter(|s| s.rewrites_graphs()).map(|s| s.name()).collect();
    if let Some(unknown) = observer.print_after.iter().find(|p| !shown.contains(&p.as_str())) {
        return Err(CompileError::Options(format!(
            "--print-after '{unknown}': no such pass (the pipeline runs {})",
            shown.join(", ")
        )));
    }
    if let Some(dir) = observer.dump_dir {
        std::fs::create_dir_all(dir).map_err(|source| CompileError::Io {
            flag: "--dump-ir",
            action: "create",
            path: dir.to_path_buf(),
            source,
        })?;
    }
    observer.observe(0, "import", state)?;
    let mut seconds = Vec::with_capacity(steps.len());
    for (i, step) in steps.iter().enumerate() {
        let start = Instant::now();
        step.run(state)?;
        if step.rewrites_graphs() {
            for graph in &state.graphs {
                autotp_ir::verify(graph).map_err(|errors| PassError::Verify { pass: step.name(), errors })?;
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        tracing::debug!(step = step.name(), seconds = elapsed, "compile step");
        seconds.push((step.name(), elapsed));
        if step.rewrites_graphs() {
            observer.observe(i + 1, step.name(), state)?;
        }
    }
    Ok(seconds)
}
