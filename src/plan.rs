//! `autotp plan`: the parallel layout to compile, chosen before a GPU-hour is spent.
//!
//! It searches tp x pp x dp x ZeRO stage x micro-batch (gradient accumulation follows from the
//! global batch) x recomputation for `--devices` devices, and prints the fastest layouts that
//! fit `--memory-per-device`, why the others were refused, and the `autotp compile` flags of
//! the best.
//!
//! **Memory and work come from the compiler.** The model is imported shapes-only (its weights
//! need not exist) and cut to its first layer and to its first two ([`autotp_passes::depth`]);
//! each cut is compiled for every tp, micro-batch and recomputation searched (one rank of tp,
//! no dp, no pipeline). Every transformer layer has the same shapes, so the difference of the
//! two cuts is one layer's exact bytes (parameters, gradients, optimizer state, intermediate
//! values), GEMM FLOPs and tp traffic, and the rest is the embedding and head. The values'
//! lifetimes in each compiled program give the peaks of its forward, backward and optimizer
//! step apart ([`phase_peaks`]). A layout's stage of `n` layers then holds `n` layers' states,
//! ZeRO's shards of them over dp (stages 1 and 2 the optimizer state, 3 the gradients and
//! parameters, plus those gathered at once: up to DeepSpeed's 1e9), and the largest of: its
//! forward peak for the micro-batches in flight (1F1B: `min(pp - s, micro-batches)` on stage
//! `s`) with the gradients accumulated so far; its backward peak; its optimizer step's; plus
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
//! ([`PipelineModel`]). `benches/plan_memory.sh` compiles every layout that fits and prints
//! predicted against compiled peaks; where they differ most, it is the arena's placement over
//! the live peak (long pipelines) and the data-parallel staging of a stage. `--verify N`
//! compiles the best N layouts whole for their exact peaks.
//!
//! **Time is a cost model** ([`Device`]): GEMM FLOPs at the device's rate (less for GEMMs of
//! few rows), other kernels' bytes at its memory bandwidth, a dispatch time per instruction,
//! tp's collectives per micro-batch over the node's link (NVLink, shared memory), the
//! pipeline's (micro-batches + stages - 1) slots of its slowest stage and its activation sends,
//! and the data-parallel reduction (ZeRO 3: the gathers of every micro-batch too) over the
//! node's link or InfiniBand when the dp group spans nodes, less what overlaps the last
//! micro-batch's backward. CPU ranks share the machine's cores: their step is the work of all
//! ranks at the machine's rate. The CPU figures are fitted to `benches/plan.sh`'s measured
//! steps of gpt2-512; the GPU figures are the parts' data sheets, not yet measured.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autotp_frontend::ImportOptions;
use autotp_kernels::Kernel;
use autotp_program::{Instruction, Program};
use clap::{Args, Parser};

use autotp_compiler::flags::parse_bytes;
use autotp_compiler::summary::grouped;
use autotp_compiler::{CompileFlags, Weights};

use crate::compile::compile as compile_with;

#[derive(Args)]
pub struct PlanArgs {
    /// The ONNX model (its weights may be absent).
    model: PathBuf,
    /// Devices to lay the model out on.
    #[arg(long)]
    devices: usize,
    /// Memory of each device: bytes, or with a unit (80GiB, 141GB).
    #[arg(long, value_parser = parse_bytes)]
    memory_per_device: u64,
    /// Sequences per optimizer step, all devices together [default: --devices].
    #[arg(long)]
    global_batch: Option<usize>,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    seq_len: usize,
    /// The device the cost model times: h100, h200 (bf16 tensor cores, NVLink in nodes of 8,
    /// InfiniBand between them) or cpu (ranks sharing this machine's cores).
    #[arg(long, default_value = "h100", value_parser = ["h100", "h200", "cpu"])]
    device: String,
    /// How many of the fastest layouts that fit to print.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// f32, bf16 or fp16 [default: bf16 on GPUs, f32 on cpu].
    #[arg(long, value_parser = ["f32", "bf16", "fp16"])]
    precision: Option<String>,
    /// The micro-batch sizes to try.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    micro_batches: Vec<usize>,
    /// The recomputations to try.
    #[arg(long, value_delimiter = ',', default_value = "none,selective,full", value_parser = ["none", "elementwise", "selective", "full"])]
    recompute: Vec<String>,
    /// Devices per node: tp stays inside one; a dp group wider than one crosses InfiniBand
    /// [default: 8 on GPUs, --devices on cpu].
    #[arg(long)]
    devices_per_node: Option<usize>,
    /// Link bandwidths in GB/s per device: inside a node (NVLink; cpu: shared memory) and
    /// between nodes (InfiniBand) [defaults: the device's].
    #[arg(long)]
    node_link_gbps: Option<f64>,
    #[arg(long)]
    network_gbps: Option<f64>,
    /// Compile the fastest N layouts that fit in full (shapes-only) and show their exact
    /// per-device peak beside the prediction; one the compiler refuses or that does not fit
    /// after all is refused, and the next is compiled in its place (up to 4N + 8 compiles).
    /// Slow for large models with many micro-batches (the 70B model: about a minute a layout).
    #[arg(long, default_value_t = 0)]
    verify: usize,
    /// Write every layout considered, with its figures or why it was refused, as JSON.
    #[arg(long, value_name = "FILE.json")]
    json: Option<PathBuf>,
}

/// What the cost model knows of a device.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Device {
    pub name: String,
    /// Dense GEMM FLOP/s a training step reaches (f32 on cpu, 16-bit tensor cores on GPUs).
    pub gemm_flops: f64,
    /// The output rows at which a GEMM runs at half that rate (a GEMM of `m` rows runs at
    /// `m / (m + gemm_half_rows)` of it).
    pub gemm_half_rows: f64,
    /// Bytes per second other kernels stream.
    pub memory_bandwidth: f64,
    /// Bytes per second per device inside a node, and between nodes.
    pub node_link: f64,
    pub network: f64,
    /// Seconds each collective or message costs besides its bytes.
    pub latency: f64,
    /// Seconds each instruction costs besides its work (a kernel launch; on CPU ranks the
    /// dispatch to the thread pool and its synchronisation).
    pub instruction_seconds: f64,
    /// Cores the ranks share (cpu); 0: each rank has its own device.
    pub shared_cores: usize,
}

impl Device {
    fn named(name: &str) -> Device {
        let gpu = |gemm: f64, hbm: f64| Device {
            name: name.to_string(),
            // About half of the dense bf16 peak (989 TFLOP/s): what large training GEMMs reach.
            gemm_flops: gemm,
            gemm_half_rows: 128.0,
            memory_bandwidth: hbm,
            // NVLink 4: 450 GB/s each way; InfiniBand NDR: 400 Gb/s per GPU.
            node_link: 450e9,
            network: 50e9,
            latency: 10e-6,
            instruction_seconds: 4e-6,
            shared_cores: 0,
        };
        match name {
            "h100" => gpu(500e12, 3.35e12 * 0.8),
            "h200" => gpu(500e12, 4.8e12 * 0.8),
            _ => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                Device {
                    name: "cpu".into(),
                    // Per core: AVX-512 f32 GEMMs, and what elementwise kernels stream (from
                    // cache, mostly). Fitted to benches/plan.sh's measured steps.
                    gemm_flops: 200e9 * cores as f64,
                    gemm_half_rows: 64.0,
                    memory_bandwidth: 20e9 * cores as f64,
                    node_link: 20e9,
                    network: 20e9,
                    latency: 20e-6,
                    instruction_seconds: 3e-6,
                    shared_cores: cores,
                }
            }
        }
    }
}

/// A layout: the mesh and the step's shape.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Layout {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    pub zero: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub recompute: String,
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
}

/// A layout's predicted step.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Prediction {
    pub step_seconds: f64,
    pub compute_seconds: f64,
    pub tp_seconds: f64,
    pub pipeline_seconds: f64,
    pub dp_seconds: f64,
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

/// What one compiled cut of the model holds and does (one rank, one micro-batch).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
struct Figures {
    params: f64,
    grads: f64,
    optimizer: f64,
    /// Intermediate values live at the forward's peak (up to the loss).
    forward: f64,
    /// Intermediate values live at the backward's peak, less the gradients (which the memory
    /// plan counts among them).
    backward: f64,
    /// Intermediate values live at the optimizer step's peak, less the gradients.
    optimizer_transient: f64,
    /// Intermediate values live at their peak before the optimizer step (through the forwards
    /// and backwards of all micro-batches), less the gradients.
    before_optimizer: f64,
    /// The rest of the arena: the step's inputs (a pipeline stage's received activations and
    /// gradients among them, a buffer per micro-batch), constants and alignment.
    inputs: f64,
    gemm_flops: f64,
    /// The sum over GEMMs of their FLOPs per output row: a GEMM of few rows runs below the
    /// device's rate ([`Device::gemm_half_rows`]).
    gemm_flops_per_row: f64,
    other_bytes: f64,
    tp_bytes: f64,
    /// Instructions the program runs (each costs the device's dispatch time).
    instructions: f64,
    /// The largest host staging one of its collectives needs.
    staging: f64,
}

impl Figures {
    fn of(program: &Program) -> Figures {
        let m = &program.memory;
        let peaks = phase_peaks(program);
        let (mut gemm_flops, mut gemm_flops_per_row, mut other_bytes, mut tp_bytes) = (0.0, 0.0, 0.0, 0.0);
        let mut staging = 0usize;
        for instruction in &program.instructions {
            match instruction {
                Instruction::Collective { op, input, .. } | Instruction::CollectiveStart { op, input, .. } => {
                    tp_bytes += op.kind.bytes_sent(input.len, program.mesh[op.axis].size) as f64;
                    staging = staging.max(op.kind.staging_bytes(input.len));
                }
                Instruction::Kernel { kernel: Kernel::MatMul { dims, .. }, .. } => {
                    let batch: usize = dims.batch.iter().product();
                    let flops = 2.0 * (batch * dims.m * dims.k * dims.n) as f64;
                    gemm_flops += flops;
                    gemm_flops_per_row += flops / dims.m.max(1) as f64;
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
            instructions: program.instructions.len() as f64,
            staging: staging as f64,
        }
    }

    fn combine(a: Figures, b: Figures, f: impl Fn(f64, f64) -> f64) -> Figures {
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
            instructions: f(a.instructions, b.instructions),
            staging: f(a.staging, b.staging),
        }
    }
}

/// A model per layer and the rest, at one micro-batch size, from its cuts of 1 and 2 layers.
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct Model {
    layer: Figures,
    rest: Figures,
    /// What the backward's peak held beyond the forward's in the 2-layer cut (the head's
    /// gradients of the logits; gradients made): added to a stage's forward peak, it bounds its
    /// backward's when the saved activations of many layers outweigh the cut's.
    backward_extra: f64,
    /// Of `rest`: the bytes of parameters (and their gradients and states) on the first
    /// stage (the token embedding); the others are on the last.
    embedding_fraction: f64,
    /// The bytes of one micro-batch's activation between two layers (the hidden state a
    /// pipeline stage sends).
    boundary: f64,
    /// Bytes per parameter element.
    param_bytes: f64,
    /// The communication staging of a stage: tp's collectives (the largest, from the 2-layer
    /// cut) and, with dp, the data-parallel reductions' (from cuts of dp 2, per layer and the
    /// rest; up to three buckets of DeepSpeed's 5e8 elements).
    tp_staging: f64,
    dp_staging: Option<(Figures, Figures)>,
    /// With pp: the memory of its stages, from cuts of 2 stages.
    pipeline: Option<PipelineModel>,
}

/// The memory of pipeline stages, from the compiler's plans of a cut of 2 stages of 1 and of 2
/// layers each ([`pipeline_cut`]: with 3 micro-batches the first stage holds 2 in flight, the
/// last one). They differ from slices of the one-stage program: the first holds the embedding
/// (whole under tp) and its gradient's temporaries, a tied embedding is held and its gradient
/// exchanged on both ends, each micro-batch's gradients are added into sums. More micro-batches
/// in flight add a layer's saved activations each.
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct PipelineModel {
    /// The first stage with 1 layer, and what each further layer adds.
    first: Figures,
    first_layer: Figures,
    /// The last stage with 1 layer, and what each further layer adds.
    last: Figures,
    last_layer: Figures,
    /// One micro-batch's saved activations of a layer: what a layer adds on the first stage
    /// (2 in flight) beyond what it adds on the last (1), else a layer's forward peak in the
    /// one-stage cut.
    layer_saved: f64,
    /// The cut's micro-batches.
    micro_batches: f64,
}

/// What a pipeline stage holds (one rank, dp 1, no ZeRO): parameters, gradients, optimizer
/// states, its intermediate values at the peak less the gradients, and its inputs.
#[derive(Clone, Copy, Debug)]
struct StageMemory {
    params: f64,
    grads: f64,
    optimizer: f64,
    activations: f64,
    inputs: f64,
}

impl PipelineModel {
    /// Stage `s` of `pp` with `layers` layers, `in_flight` micro-batches and `micro_batches`
    /// in the step.
    fn stage(&self, layers: usize, s: usize, pp: usize, in_flight: f64, micro_batches: f64) -> StageMemory {
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
        memory
    }
}

impl Model {
    /// One micro-batch through a stage of `layers` layers, the first and/or the last.
    fn stage(&self, layers: usize, first: bool, last: bool) -> Figures {
        let share = (if first { self.embedding_fraction } else { 0.0 })
            + (if last { 1.0 - self.embedding_fraction } else { 0.0 });
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
            instructions: n * layer.instructions + work * rest.instructions,
            staging: n * layer.staging + rest.staging,
        }
    }
}

/// A compiled cut of the model: its layout (one stage) and the layers kept.
type Cut = (Layout, usize);

/// The largest staging of the data-parallel reductions the planner assumes: three copies (a
/// reduce-scatter's) of DeepSpeed's 5e8-element f32 bucket.
const DP_STAGING_CAP: f64 = 3.0 * 5e8 * 4.0;

/// The cut compiled for a layout's memory and work: its tp, micro-batch and recomputation on
/// one stage, without dp.
fn search_cut(layout: &Layout) -> Layout {
    Layout { pp: 1, dp: 1, zero: 0, grad_accum: 1, ..layout.clone() }
}

/// The cut compiled for a pipelined layout's stages: 2 stages at its tp, micro-batch and
/// recomputation, over one micro-batch (nothing accumulated) or, for a layout that accumulates,
/// [`PIPELINE_CUT_MICRO_BATCHES`] (with 3, the first stage runs a forward after a backward: the
/// steady state, where the gradients summed so far live beside the micro-batches in flight).
/// Other counts of micro-batches differ by those in flight ([`PipelineModel::stage`]): one cut
/// serves every pp, dp and ZeRO stage. None for a model of fewer than 4 layers (the cut keeps up
/// to 2 a stage), whose stages are then slices of the one-stage cuts.
fn pipeline_cut(layout: &Layout, layers: usize) -> Option<Layout> {
    (layout.pp > 1 && layers >= 4).then(|| Layout {
        pp: 2,
        dp: 1,
        zero: 0,
        grad_accum: if layout.grad_accum == 1 { 1 } else { PIPELINE_CUT_MICRO_BATCHES },
        ..layout.clone()
    })
}

/// The micro-batches a pipeline cut of an accumulating layout runs.
const PIPELINE_CUT_MICRO_BATCHES: usize = 3;

/// The cut compiled for a data-parallel layout's staging: dp 2 at its ZeRO stage, with and
/// without accumulation (reductions bucket differently), at the smallest micro-batch.
fn staging_cut(layout: &Layout, micro_batch: usize) -> Option<Layout> {
    let accumulates = layout.grad_accum > 1 || layout.pp > 1;
    (layout.dp > 1).then(|| Layout {
        tp: layout.tp,
        pp: 1,
        dp: 2,
        zero: layout.zero,
        micro_batch,
        grad_accum: if accumulates { 2 } else { 1 },
        recompute: "none".into(),
    })
}

/// `autotp compile` flags parsed as the command line would (the proxies' and the printed ones).
#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    flags: CompileFlags,
}

fn compile_flags(args: &[String]) -> Result<CompileFlags> {
    let argv = std::iter::once("autotp-compile".to_string()).chain(args.iter().cloned());
    Ok(Flags::try_parse_from(argv).context("the planner's compile flags")?.flags)
}

/// The `autotp compile` arguments of a layout.
fn layout_args(args: &PlanArgs, precision: &str, layout: &Layout, cuts: &[String]) -> Vec<String> {
    let mut out = vec![args.model.display().to_string()];
    let mut flag = |name: &str, value: String| out.extend([format!("--{name}"), value]);
    flag("seq-len", args.seq_len.to_string());
    flag("micro-batch", layout.micro_batch.to_string());
    flag("grad-accum", layout.grad_accum.to_string());
    for (name, value) in [("tp", layout.tp), ("pp", layout.pp), ("dp", layout.dp)] {
        if value > 1 {
            flag(name, value.to_string());
        }
    }
    if layout.zero > 0 {
        flag("zero", layout.zero.to_string());
    }
    if precision != "f32" {
        flag("precision", precision.to_string());
    }
    if layout.recompute != "none" {
        flag("recompute", layout.recompute.clone());
    }
    if !cuts.is_empty() {
        flag("pp-cuts", cuts.join(","));
    }
    out
}

/// Layers per pipeline stage: as even as can be, the extra ones on the middle stages (the
/// first holds the embedding, the last the head).
fn stage_layers(layers: usize, pp: usize) -> Vec<usize> {
    let mut counts = vec![layers / pp; pp];
    let order: Vec<usize> = if pp > 2 { (1..pp - 1).chain([0, pp - 1]).collect() } else { (0..pp).collect() };
    for &s in order.iter().cycle().take(layers % pp) {
        counts[s] += 1;
    }
    counts
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|&d| n.is_multiple_of(d)).collect()
}

/// Runs the planner.
pub fn run(args: &PlanArgs) -> Result<()> {
    let started = Instant::now();
    if args.devices == 0 || args.seq_len == 0 || args.top == 0 {
        bail!("--devices, --seq-len and --top must be at least 1");
    }
    if args.micro_batches.contains(&0) {
        bail!("--micro-batches must be at least 1");
    }
    let gpu = args.device != "cpu";
    let precision = args.precision.clone().unwrap_or_else(|| if gpu { "bf16" } else { "f32" }.to_string());
    let mut device = Device::named(&args.device);
    if let Some(gbps) = args.node_link_gbps {
        device.node_link = gbps * 1e9;
    }
    if let Some(gbps) = args.network_gbps {
        device.network = gbps * 1e9;
    }
    let per_node = args.devices_per_node.unwrap_or(if gpu { 8 } else { args.devices }).max(1);
    let global_batch = args.global_batch.unwrap_or(args.devices);

    let options =
        ImportOptions { batch: Some(1), seq_len: Some(args.seq_len), shapes_only: true, ..Default::default() };
    let imported = autotp_frontend::import_onnx(&args.model, &options)?;
    let graph = &imported.graph;
    let layers = autotp_passes::depth::layer_count(graph);
    if layers < 2 {
        bail!(
            "{}: autotp plan needs a model of numbered layers (parameters named PREFIX.N.*), at least 2; it has {layers}",
            args.model.display()
        );
    }
    let numbered = autotp_passes::pipeline::numbered_layers(graph).expect("counted above");
    let embeddings: Vec<String> =
        autotp_passes::padding::embedding_tables(graph, &BTreeMap::new()).into_iter().map(|t| t.param).collect();
    let param_count: usize = graph.params().iter().map(|&p| graph.ty(p).numel()).sum();
    let rest_elements: usize = (graph.params().iter())
        .filter(|&&p| graph.name_of(p).is_none_or(|n| numbered.number_of(n).is_none()))
        .map(|&p| graph.ty(p).numel())
        .sum();
    let embedding_elements: usize = (graph.params().iter())
        .filter(|&&p| graph.name_of(p).is_some_and(|n| embeddings.iter().any(|e| e == n)))
        .map(|&p| graph.ty(p).numel())
        .sum();
    let hidden = (graph.params().iter())
        .find(|&&p| graph.name_of(p).is_some_and(|n| embeddings.iter().any(|e| e == n)))
        .map_or(0, |&p| graph.ty(p).shape[1]);
    let activation_bytes = if precision == "f32" { 4 } else { 2 };
    let boundary_per_sequence = (args.seq_len * hidden * activation_bytes) as f64;
    let embedding_fraction = if rest_elements == 0 { 0.0 } else { embedding_elements as f64 / rest_elements as f64 };

    // Every layout, and the cuts each needs compiled.
    let mut layouts = Vec::new();
    for tp in divisors(args.devices) {
        for pp in divisors(args.devices / tp) {
            let dp = args.devices / (tp * pp);
            for zero in 0..=3 {
                for &micro_batch in &args.micro_batches {
                    for recompute in &args.recompute {
                        let layout =
                            Layout { tp, pp, dp, zero, micro_batch, grad_accum: 0, recompute: recompute.clone() };
                        layouts.push(layout);
                    }
                }
            }
        }
    }
    let mut considered: Vec<Considered> = Vec::new();
    let mut wanted: Vec<Layout> = Vec::new();
    let smallest_micro_batch = *args.micro_batches.iter().min().expect("clap requires one");
    for mut layout in layouts {
        let refused = if layout.tp > per_node {
            Some(format!("tp {} is more than a node's {per_node} devices", layout.tp))
        } else if layout.pp > layers {
            Some(format!("pp {} is more stages than the model's {layers} layers", layout.pp))
        } else if layout.zero > 0 && layout.dp < 2 {
            Some(format!("ZeRO {} needs dp 2 or more", layout.zero))
        } else if !global_batch.is_multiple_of(layout.dp * layout.micro_batch) {
            Some(format!(
                "the global batch {global_batch} is not a multiple of dp {} x micro-batch {}",
                layout.dp, layout.micro_batch
            ))
        } else {
            None
        };
        if refused.is_none() {
            layout.grad_accum = global_batch / (layout.dp * layout.micro_batch);
            let needed =
                [Some(search_cut(&layout)), staging_cut(&layout, smallest_micro_batch), pipeline_cut(&layout, layers)];
            for cut in needed.into_iter().flatten() {
                if !wanted.contains(&cut) {
                    wanted.push(cut);
                }
            }
        }
        considered.push(Considered { layout, prediction: None, refused, compile_args: None, compiled_peak: None });
    }

    // The cuts, compiled two at a time.
    let cuts: Mutex<BTreeMap<Cut, Result<Vec<Figures>, String>>> = Mutex::default();
    let jobs: Vec<Cut> = wanted.iter().flat_map(|cut| [1, 2].map(|depth| (cut.clone(), depth))).collect();
    let next = Mutex::new(0usize);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let job = {
                    let mut next = next.lock().expect("jobs");
                    let Some(job) = jobs.get(*next).cloned() else { return };
                    *next += 1;
                    job
                };
                // `depth` layers a stage.
                let (layout, depth) = &job;
                let stage_cuts: Vec<String> =
                    (1..layout.pp).map(|s| format!("{}.{}", numbered.prefix, numbered.numbers[s * depth])).collect();
                let figures = compile_flags(&layout_args(args, &precision, layout, &stage_cuts))
                    .and_then(|flags| compile_with(&flags, Weights::ShapesOnly { layers: Some(layout.pp * depth) }))
                    .map(|compiled| compiled.plan.stages.iter().map(Figures::of).collect())
                    .map_err(|e| format!("{e:#}"));
                cuts.lock().expect("cuts").insert(job, figures);
            });
        }
    });
    let cuts = cuts.into_inner().expect("cuts");
    let model_of = |layout: &Layout| -> Result<Model, String> {
        // A cut's stage: per layer, the rest, and its figures with 1 and 2 layers.
        let split = |cut: &Layout, stage: usize| -> Result<(Figures, Figures, Figures, Figures), String> {
            let stage_of = |depth: usize| cuts[&(cut.clone(), depth)].as_ref().map(|stages| stages[stage]);
            let (one, two) = (stage_of(1).map_err(Clone::clone)?, stage_of(2).map_err(Clone::clone)?);
            let layer = Figures::combine(two, one, |a, b| a - b);
            Ok((layer, Figures::combine(one, layer, |a, b| a - b), one, two))
        };
        let (layer, rest, _, two) = split(&search_cut(layout), 0)?;
        let dp_staging = match staging_cut(layout, smallest_micro_batch) {
            Some(cut) => split(&cut, 0).map(|(layer, rest, _, _)| Some((layer, rest)))?,
            None => None,
        };
        let pipeline = match pipeline_cut(layout, layers) {
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
        Ok(Model {
            layer,
            rest,
            backward_extra: (two.backward + two.grads - two.forward).max(0.0),
            embedding_fraction,
            boundary: boundary_per_sequence * layout.micro_batch as f64,
            param_bytes: activation_bytes as f64,
            tp_staging: two.staging,
            dp_staging,
            pipeline,
        })
    };

    let mut models: BTreeMap<String, Model> = BTreeMap::new();
    for c in considered.iter_mut().filter(|c| c.refused.is_none()) {
        match model_of(&c.layout) {
            Err(e) => c.refused = Some(first_line(&e)),
            Ok(model) => {
                let key = format!(
                    "tp {} micro-batch {} recompute {} zero {}",
                    c.layout.tp, c.layout.micro_batch, c.layout.recompute, c.layout.zero
                );
                models.insert(key, model);
                let p = predict(&model, &c.layout, layers, &device, per_node, args.memory_per_device as f64);
                match p {
                    Ok(p) => {
                        let cuts = pipeline_cuts(&numbered, c.layout.pp, layers);
                        c.compile_args = Some(layout_args(args, &precision, &c.layout, &cuts));
                        c.prediction = Some(p);
                    }
                    Err(why) => c.refused = Some(why),
                }
            }
        }
    }

    let mut order: Vec<usize> = (0..considered.len()).filter(|&i| considered[i].prediction.is_some()).collect();
    order.sort_by(|&a, &b| {
        let (pa, pb) =
            (considered[a].prediction.as_ref().expect("fits"), considered[b].prediction.as_ref().expect("fits"));
        pa.step_seconds.total_cmp(&pb.step_seconds).then(pa.memory.peak.total_cmp(&pb.memory.peak))
    });
    let searched = started.elapsed().as_secs_f64();
    // Compiles whole models until `--verify` fit, or four times as many (and 8) were tried.
    let (mut verified, mut tried) = (0, 0);
    for &i in &order {
        if verified == args.verify || tried == 4 * args.verify + 8 {
            break;
        }
        tried += 1;
        let c = &mut considered[i];
        let flags = compile_flags(c.compile_args.as_ref().expect("a layout that fits has its flags"))?;
        match compile_with(&flags, Weights::ShapesOnly { layers: None }) {
            Err(e) => c.refused = Some(format!("the compiler refuses it: {}", first_line(&format!("{e:#}")))),
            Ok(compiled) => {
                let report = autotp_program::report::report(&compiled.plan);
                let peak = report.ranks.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
                c.compiled_peak = Some(peak as f64);
                if peak as u64 > args.memory_per_device {
                    c.refused = Some(format!(
                        "out of memory when compiled: {} bytes per device, over {}",
                        grouped(peak),
                        grouped(args.memory_per_device as usize)
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
    let fitting: Vec<&Considered> = order.iter().map(|&i| &considered[i]).filter(|c| c.prediction.is_some()).collect();
    let tokens = (global_batch * args.seq_len) as f64;
    println!(
        "plan: {} ({} parameters, {layers} layers) on {} {} devices of {} bytes each ({per_node} per node); \
         global batch {global_batch} x seq-len {} = {tokens} tokens per step; {precision}",
        args.model.display(),
        grouped(param_count),
        args.devices,
        device.name,
        grouped(args.memory_per_device as usize),
        args.seq_len,
    );
    let compiled_cuts = cuts.len();
    println!(
        "searched {} layouts: {} fit, {} refused ({compiled_cuts} cuts of the model compiled in {searched:.1} s)",
        considered.len(),
        fitting.len(),
        considered.len() - fitting.len(),
    );
    if args.verify > 0 {
        println!(
            "verified {verified} by compiling {tried} whole in {:.1} s (column 'compiled')",
            started.elapsed().as_secs_f64() - searched
        );
    }
    // Memory columns in GiB, or MiB for small devices.
    let unit =
        if args.memory_per_device >= 1 << 30 { ("GiB", (1u64 << 30) as f64) } else { ("MiB", (1u64 << 20) as f64) };
    println!();
    println!(
        "{:>3} {:>3} {:>3} {:>4} {:>4} {:>3} {:>4} {:>9} {:>10} {:>12} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "#",
        "tp",
        "pp",
        "dp",
        "zero",
        "mb",
        "acc",
        "recompute",
        "step (ms)",
        "tokens/s",
        "bubble",
        "params",
        "grads",
        "optim",
        "activ",
        "staging",
        format!("peak {}", unit.0),
        "compiled",
        "comm MB"
    );
    for (i, c) in fitting.iter().take(args.top).enumerate() {
        let (l, p) = (&c.layout, c.prediction.as_ref().expect("fits"));
        println!(
            "{:>3} {:>3} {:>3} {:>4} {:>4} {:>3} {:>4} {:>9} {:>10.1} {:>12.0} {:>6.1}% {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9} {:>10.1}",
            i + 1,
            l.tp,
            l.pp,
            l.dp,
            l.zero,
            l.micro_batch,
            l.grad_accum,
            l.recompute,
            1e3 * p.step_seconds,
            tokens / p.step_seconds,
            100.0 * p.bubble_fraction,
            p.memory.params / unit.1,
            p.memory.grads / unit.1,
            p.memory.optimizer / unit.1,
            p.memory.activations / unit.1,
            p.memory.staging / unit.1,
            p.memory.peak / unit.1,
            c.compiled_peak.map_or("-".to_string(), |peak| format!("{:.2}", peak / unit.1)),
            p.comm_bytes / 1e6
        );
    }
    if let Some(best) = fitting.first() {
        let p = best.prediction.as_ref().expect("fits");
        println!();
        println!(
            "best: compute {:.4} s, tp {:.4} s, pipeline bubble and sends {:.4} s, dp (exposed) {:.4} s per step",
            p.compute_seconds, p.tp_seconds, p.pipeline_seconds, p.dp_seconds
        );
        let flags = best.compile_args.as_ref().expect("a layout that fits has its flags");
        println!("  autotp compile {} -o plan.atp", flags.join(" "));
    }
    // Refusals, by reason (numbers stripped), with a count and one example.
    let mut reasons: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for c in considered.iter() {
        if let Some(why) = &c.refused {
            let kind: String = why.chars().filter(|ch| !ch.is_ascii_digit() && !matches!(ch, '.' | ',')).collect();
            let entry = reasons.entry(kind).or_insert((0, why.clone()));
            entry.0 += 1;
        }
    }
    if !reasons.is_empty() {
        println!();
        println!("refused:");
        let mut reasons: Vec<(usize, String)> = reasons.into_values().collect();
        reasons.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for (count, example) in reasons {
            println!("  {count:>5} x {example}");
        }
    }
    if let Some(path) = &args.json {
        let json = serde_json::json!({"device": device, "layers": layers, "parameters": param_count,
            "global_batch": global_batch, "seq_len": args.seq_len, "precision": precision, "models": models, "layouts": considered});
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if fitting.is_empty() {
        // A failure to a script too, after the reasons above.
        bail!(
            "no layout of {} devices fits {} bytes per device ({} considered, all refused: above)",
            args.devices,
            grouped(args.memory_per_device as usize),
            considered.len()
        );
    }
    Ok(())
}

/// `--pp-cuts` that give each stage [`stage_layers`]'s layers.
fn pipeline_cuts(numbered: &autotp_passes::pipeline::NumberedLayers, pp: usize, layers: usize) -> Vec<String> {
    let counts = stage_layers(layers, pp);
    let mut first = 0;
    let mut cuts = Vec::new();
    for count in &counts[..pp - 1] {
        first += count;
        cuts.push(format!("{}.{}", numbered.prefix, numbered.numbers[first]));
    }
    cuts
}

/// A layout's memory and step time, or why it does not fit.
fn predict(
    model: &Model,
    layout: &Layout,
    layers: usize,
    device: &Device,
    per_node: usize,
    memory: f64,
) -> Result<Prediction, String> {
    let Layout { tp, pp, dp, zero, grad_accum, .. } = *layout;
    let counts = stage_layers(layers, pp);
    let dpf = dp as f64;
    let boundary = model.boundary;
    let mut worst = MemoryFigures::default();
    let mut slot = 0.0f64;
    let (mut tp_time, mut compute, mut dp_bytes_max, mut tp_bytes) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let mut gathered_params = 0.0f64;
    // CPU ranks share the machine's cores: a step takes the work of every rank at the
    // machine's rate (a pipeline's idle stages leave their cores to the others).
    let mut machine_seconds = 0.0f64;
    let ranks_per_stage = (tp * dp) as f64;
    let node_groups =
        |size: usize, stride: usize| if size * stride <= per_node { device.node_link } else { device.network };
    for (s, &n) in counts.iter().enumerate() {
        let figures = model.stage(n, s == 0, s == pp - 1);
        let in_flight = if pp == 1 { 1 } else { (pp - s).min(grad_accum) } as f64;
        // A pipeline's stage from its cuts; without them, a slice of the one-stage cuts.
        let held = match model.pipeline {
            Some(pipeline) => pipeline.stage(n, s, pp, in_flight, grad_accum as f64),
            None => StageMemory {
                params: figures.params,
                grads: figures.grads,
                optimizer: figures.optimizer,
                activations: 0.0,
                inputs: 0.0,
            },
        };
        // ZeRO 3 gathers the parameters of the stage, up to `stage3_max_live_parameters` (1e9).
        let gathered = held.params.min(1e9 * model.param_bytes);
        let params = if zero == 3 { held.params / dpf + gathered } else { held.params };
        // autotp reduce-scatters each gradient once it is made whole (no buckets): under ZeRO 2
        // the whole gradients are live at the backward's end, ZeRO 3 (gathered layer by layer)
        // keeps shards.
        let grads = if zero == 3 { held.grads / dpf } else { held.grads };
        let optimizer = if zero >= 1 { held.optimizer / dpf } else { held.optimizer };
        // ZeRO's optimizer steps (stages 1 to 3) run on the rank's shards.
        let transient = if zero >= 1 { figures.optimizer_transient / dpf } else { figures.optimizer_transient };
        let intermediate = if model.pipeline.is_some() {
            // The cut (dp 1) sums whole gradients; from ZeRO 2 a stage sums their shards.
            let sums = if zero >= 2 && grad_accum > 1 { held.grads * (1.0 - 1.0 / dpf) } else { 0.0 };
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
                (true, true) => held.grads / dpf,
            };
            let forward = in_flight * figures.forward + accumulated;
            let backward = (grads + figures.backward).max(figures.forward + model.backward_extra)
                + (in_flight - 1.0) * figures.forward
                + accumulated;
            forward.max(backward).max(grads + transient)
        };
        let activations = intermediate - grads;

        let dp_staging = model.dp_staging.map_or(0.0, |(layer, rest)| {
            let bytes = n as f64 * layer.staging + rest.staging;
            bytes.min(DP_STAGING_CAP.max(layer.staging + rest.staging))
        });
        let staging = model.tp_staging.max(dp_staging);
        let peak = params + optimizer + intermediate + held.inputs + staging;
        if peak > worst.peak {
            worst = MemoryFigures { params, grads, optimizer, activations, staging, peak };
        }
        let work = (figures.gemm_flops + device.gemm_half_rows * figures.gemm_flops_per_row) / device.gemm_flops
            + figures.other_bytes / device.memory_bandwidth
            + figures.instructions * device.instruction_seconds;
        let tp_seconds =
            if tp > 1 { figures.tp_bytes / node_groups(tp, 1) + device.latency * 4.0 * n as f64 } else { 0.0 };
        // A middle stage receives and sends each micro-batch's activation and its gradient.
        let sends = if pp > 1 { 2.0 * boundary / node_groups(pp, tp * dp) + 2.0 * device.latency } else { 0.0 };
        let t = work + tp_seconds + sends;
        if t > slot {
            (slot, compute, tp_time) = (t, work, tp_seconds);
        }
        machine_seconds += ranks_per_stage * grad_accum as f64 * t;
        dp_bytes_max = dp_bytes_max.max(held.grads);
        tp_bytes = tp_bytes.max(figures.tp_bytes);
        gathered_params = gathered_params.max(held.params);
    }
    if worst.peak > memory {
        return Err(format!(
            "out of memory: {} bytes per device, over {}",
            grouped(worst.peak as usize),
            grouped(memory as usize)
        ));
    }
    let micro_batches = grad_accum as f64;
    let slots = micro_batches + (pp - 1) as f64;
    let bubble_fraction = (pp - 1) as f64 / slots;
    let dp_link = node_groups(dp, tp);
    let ring = 2.0 * (dpf - 1.0) / dpf;
    let dp_volume = if dp > 1 {
        let gradient_bytes = dp_bytes_max;
        let gathers = if zero == 3 { (2.0 * micro_batches - 1.0) * gathered_params * (dpf - 1.0) / dpf } else { 0.0 };
        // From ZeRO 2 every micro-batch reduce-scatters its gradients.
        let reductions = if zero >= 2 { (micro_batches + 1.0) / 2.0 } else { 1.0 };
        reductions * ring * gradient_bytes + gathers
    } else {
        0.0
    };
    let dp_seconds_total = dp_volume / dp_link + if dp > 1 { device.latency * 2.0 * layers as f64 } else { 0.0 };
    // The reduction of the last micro-batch's gradients overlaps its backward (two thirds of
    // it); from ZeRO 2, each micro-batch's overlaps its own.
    let overlapped = if zero >= 2 { micro_batches } else { 1.0 };
    let dp_seconds = (dp_seconds_total - overlapped * 2.0 / 3.0 * slot).max(0.0);
    let (pipeline_seconds, busy) = if device.shared_cores > 0 {
        (0.0, machine_seconds)
    } else {
        (slots * slot - micro_batches * slot, slots * slot)
    };
    let step_seconds = busy + dp_seconds;
    Ok(Prediction {
        step_seconds,
        compute_seconds: if device.shared_cores > 0 { machine_seconds } else { micro_batches * compute },
        tp_seconds: micro_batches * tp_time,
        pipeline_seconds,
        dp_seconds,
        bubble_fraction,
        memory: worst,
        comm_bytes: micro_batches * tp_bytes + dp_volume + if pp > 1 { 2.0 * micro_batches * boundary } else { 0.0 },
    })
}

/// The most bytes of intermediate values live at once in a program's three phases: the
/// forward (up to the instruction that writes the loss), the backward (to the first optimizer
/// step) and the optimizer step. A value lives in its arena region from the instruction that writes it
/// to the last that reads it before another value is written over it (the memory plan reuses a
/// region only once its value is dead).
fn phase_peaks(program: &Program) -> Peaks {
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
struct Peaks {
    forward: f64,
    backward: f64,
    optimizer: f64,
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_get_their_share_of_layers() {
        assert_eq!(stage_layers(80, 8), vec![10; 8]);
        assert_eq!(stage_layers(10, 4), vec![2, 3, 3, 2]);
        assert_eq!(stage_layers(5, 2), vec![3, 2]);
        assert_eq!(stage_layers(4, 1), vec![4]);
    }
}
