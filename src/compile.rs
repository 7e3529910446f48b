//! `autotp compile`: ONNX model -> training plan (`.atp`).
//!
//! Imports the model with batch and sequence bound, runs the training pipeline (recognize, dce,
//! loss, [split-fused], autodiff [accumulate] or with `--pp` the pipeline pass, then on each
//! stage optimize, dce, and zero or autotp for `--dp`/`--zero`/`--tp`), lowers each stage to the
//! program its ranks run, writes the plan with the initial weights, and prints a summary:
//! parameters, per-rank (per-stage) memory by category, instructions, communication.
//! `--dump-ir DIR` writes the IR before and after every pass; `--print-after PASS` prints it
//! after one; `--report FILE.json` writes the per-rank plan.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autotp_frontend::{ImportOptions, Model};
use autotp_ir::Graph;
use autotp_passes::accumulate::Accumulate;
use autotp_passes::autodiff::Autodiff;
use autotp_passes::autotp::AutoTp;
use autotp_passes::loss::{AttachLoss, LABELS, LOSS};
use autotp_passes::optimize::{NonFinite, Optimize, Optimizer, StageNorm};
use autotp_passes::peephole::{self, Peephole};
use autotp_passes::pipeline::{
    bubble_fraction, stage_idle_fractions, Backward as PipelineBackward, Pipeline, Schedule as PipelineSchedule,
};
use autotp_passes::recompute::{Recompute, Recomputed};
use autotp_passes::split_fused::SplitFused;
use autotp_passes::zero::{Prefetch, Zero, ZeroConfig};
use autotp_passes::{Pass, PassManager};
use autotp_program::loss_scale::{DeepSpeedScaler, LossScaler, TorchScaler};
use autotp_program::lr_schedule::LrSchedule;
use autotp_program::offload::NvmeOffload;
use autotp_program::plan::RecomputeSummary;
use autotp_program::plan::{Labels, ModelSource, PaddingRow, PipelineConfig, TrainingConfig, TrainingPlan, WeightPart};
use autotp_program::step::StepInput;
use clap::Args;

/// What to compile and how: shared by `compile` and `train`. The plan records them (less the
/// inspection flags), so `verify` can compile the same model for one device.
#[derive(Args, Clone, serde::Serialize, serde::Deserialize)]
pub struct CompileFlags {
    /// The ONNX model.
    pub model: PathBuf,
    /// Tokens per sequence (S).
    #[arg(long)]
    pub seq_len: usize,
    /// Sequences per rank per forward pass; the global batch is micro-batch x grad-accum x dp.
    #[arg(long)]
    pub micro_batch: usize,
    /// Micro-batches per optimizer step (gradient accumulation): each rank runs the forward and
    /// backward this many times per step, summing gradients, and reduces them once [default: 1,
    /// or what --global-batch implies]
    #[arg(long)]
    pub grad_accum: Option<usize>,
    /// Sequences per optimizer step, all ranks and micro-batches together (DeepSpeed's
    /// train_batch_size): sets --grad-accum to global-batch / (micro-batch x dp)
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Data-parallel ranks (CPU threads): the batch is split over them and gradients are
    /// all-reduced (ZeRO stage 0).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Tensor-parallel ranks: each block's weights are split Megatron-style (found from the
    /// dataflow); world size is dp x tp.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages: the model is cut into this many stages (the slowest as fast as it can
    /// be, then the fullest as small; or at --pp-cuts), each run by its own ranks; the step's
    /// --grad-accum micro-batches flow through them. World size is pp x dp x tp.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// The pipeline schedule: 1f1b (one forward, one backward: at most pp micro-batches in
    /// flight) or gpipe (all forwards, then all backwards).
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// When a pipeline stage's backward sends its input's gradient to the stage before: whole
    /// (after the whole backward, as Megatron and DeepSpeed do: the textbook 1F1B and GPipe) or
    /// split (as soon as it is made, then the weights' gradients: a shorter bubble, but the
    /// output's gradient is held longer).
    #[arg(long, default_value = "whole")]
    pub pp_backward: String,
    /// Where the pipeline stages start (pp - 1 of them): before the first use of a parameter
    /// whose name starts with each prefix, e.g. model.layers.2. Comma-separated or repeated.
    #[arg(long, value_name = "PREFIX", value_delimiter = ',')]
    pub pp_cuts: Vec<String>,
    /// ZeRO stage over the data-parallel ranks: 0 all-reduces gradients; 1 shards optimizer
    /// state; 2 also reduce-scatters gradients into shards; 3 also shards parameters.
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Merge gradient all-reduces into buckets of up to this many elements; 0 reduces each
    /// gradient on its own [default: 5e8].
    #[arg(long, value_name = "ELEMENTS")]
    pub reduce_bucket_size: Option<usize>,
    /// With --zero 3, parameters of fewer elements stay whole on every rank.
    #[arg(long, value_name = "ELEMENTS", default_value_t = 0)]
    pub param_persistence_threshold: usize,
    /// With --zero 3, elements of parameter gathers in flight at once [default: 5e7].
    #[arg(long, value_name = "ELEMENTS")]
    pub prefetch_bucket_size: Option<usize>,
    /// With --zero 3, elements of gathered parameters alive at once [default: 1e9].
    #[arg(long, value_name = "ELEMENTS")]
    pub max_live_params: Option<usize>,
    /// Print each weight the tensor-parallel split places, and why.
    #[arg(long)]
    explain_tp: bool,
    /// adamw or sgd.
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// constant; cosine (linear warmup over --warmup-steps, then cosine decay to --min-lr, as
    /// Hugging Face's get_cosine_schedule_with_warmup); or DeepSpeed's schedulers, step for
    /// step: warmup (WarmupLR: --warmup-min-lr to --lr over --warmup-steps, --warmup-type log
    /// or linear), warmup-decay (WarmupDecayLR: then linearly to 0 at --lr-decay-steps),
    /// warmup-cosine (WarmupCosineLR: --warmup-min-ratio to 1 of --lr, then a cosine to
    /// --cos-min-ratio at --lr-decay-steps).
    #[arg(long, default_value = "constant")]
    lr_schedule: String,
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    #[arg(long, default_value_t = 0.0)]
    min_lr: f64,
    /// The step at which the decay ends (default for cosine: the run's --steps; DeepSpeed's
    /// total_num_steps).
    #[arg(long)]
    lr_decay_steps: Option<usize>,
    /// DeepSpeed's warmup_min_lr (warmup, warmup-decay) [default: 0].
    #[arg(long)]
    #[serde(default)]
    warmup_min_lr: Option<f64>,
    /// DeepSpeed's warmup_type: log or linear (warmup, warmup-decay, warmup-cosine) [default: log].
    #[arg(long)]
    #[serde(default)]
    warmup_type: Option<String>,
    /// DeepSpeed's warmup_min_ratio (warmup-cosine) [default: 0].
    #[arg(long)]
    #[serde(default)]
    warmup_min_ratio: Option<f64>,
    /// DeepSpeed's cos_min_ratio (warmup-cosine) [default: 0.0001].
    #[arg(long)]
    #[serde(default)]
    cos_min_ratio: Option<f64>,
    /// AdamW betas: B1,B2.
    #[arg(long, default_value = "0.9,0.999")]
    betas: String,
    #[arg(long, default_value_t = 1e-8)]
    eps: f64,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0)]
    momentum: f64,
    #[arg(long)]
    nesterov: bool,
    /// Clip gradients to this global L2 norm.
    #[arg(long)]
    grad_clip: Option<f64>,
    /// Do not train the parameters whose (ONNX initializer) name this regular expression matches
    /// anywhere; anchor it with ^...$ for whole names. Repeatable.
    #[arg(long, value_name = "REGEX")]
    freeze: Vec<String>,
    /// An embedding table's padding row, which gets no gradient (PyTorch's
    /// `nn.Embedding(padding_idx)`, which ONNX exports drop): N or none for every table (a
    /// parameter read only by gathers), TABLE=N or TABLE=none for one. Default: a table's one
    /// row that is exactly zero at import. Repeatable.
    #[arg(long, value_name = "N|none|TABLE=N")]
    padding_idx: Vec<String>,
    /// Write the IR before the passes and after each one: DIR/00-import.ir, DIR/01-recognize.ir...
    #[arg(long, value_name = "DIR")]
    dump_ir: Option<PathBuf>,
    /// Print the IR after this pass (every time it runs). Repeatable.
    #[arg(long, value_name = "PASS")]
    print_after: Vec<String>,
    /// Write the per-rank memory and per-step communication plan as JSON.
    #[arg(long, value_name = "FILE.json")]
    pub report: Option<PathBuf>,
    /// Write every generated kernel's kernel IR (.kir) and optimised LLVM IR for this machine
    /// (.ll), and each stage's PTX module per GPU architecture (.ptx), into DIR.
    #[arg(long, value_name = "DIR")]
    dump_kernels: Option<PathBuf>,
    /// Which kernels run the ops: generated (LLVM, where a generated kernel computes the op)
    /// or builtin (the reference interpreter alone: the oracle to bisect a divergence against).
    #[arg(long, value_enum, default_value = "generated")]
    kernels: Kernels,
    /// The parameters' and activations' type: f32, or bf16/fp16 mixed precision (16-bit
    /// weights and activations, CUDA autocast's f32 ops, f32 master weights and moments in the
    /// optimizer, as DeepSpeed's bf16/fp16 modes).
    #[arg(long, value_enum, default_value = "f32")]
    #[serde(default)]
    pub precision: Precision,
    /// With --precision bf16/fp16: the type gradients are accumulated in over micro-batches
    /// (f32 by default).
    #[arg(long, value_enum, value_name = "f32|bf16|fp16")]
    #[serde(default)]
    pub grad_accum_dtype: Option<Precision>,
    /// The type gradients are reduced in over data-parallel ranks (DeepSpeed's
    /// communication_data_type): each rank's partial sum is cast to it, summed in it, and cast
    /// back. By default gradients are reduced in the type they are accumulated in (f32 under
    /// --precision bf16/fp16, as Megatron; DeepSpeed reduces bf16 gradients in bf16 unless
    /// told otherwise).
    #[arg(long, value_enum, value_name = "f32|bf16|fp16")]
    #[serde(default)]
    pub comm_dtype: Option<Precision>,
    /// With --precision fp16: whose dynamic loss scaling rules to follow: deepspeed
    /// (DynamicLossScaler: hysteresis, floor) or torch (torch.amp.GradScaler: back off on every
    /// overflow, grow every --loss-scale-window clean steps).
    #[arg(long, value_enum, default_value = "deepspeed")]
    #[serde(default)]
    pub loss_scaler: LossScalerKind,
    /// With --precision fp16: a fixed loss scale (DeepSpeed's `loss_scale` > 0); 0 scales
    /// dynamically.
    #[arg(long, default_value_t = 0.0)]
    #[serde(default)]
    pub loss_scale: f64,
    /// The first dynamic loss scale is 2^this (DeepSpeed's `initial_scale_power`).
    #[arg(long, default_value_t = 16)]
    #[serde(default = "sixteen")]
    pub initial_scale_power: u32,
    /// Clean steps after which the dynamic scale doubles (DeepSpeed's `loss_scale_window`,
    /// torch's `growth_interval`) [default: 1000 for deepspeed, 2000 for torch].
    #[arg(long)]
    #[serde(default)]
    pub loss_scale_window: Option<u64>,
    /// DeepSpeed's `hysteresis`: overflows the scale absorbs before it halves.
    #[arg(long, default_value_t = 2)]
    #[serde(default = "two")]
    pub hysteresis: u32,
    /// DeepSpeed's `consecutive_hysteresis`: every clean step refills the hysteresis.
    #[arg(long)]
    #[serde(default)]
    pub consecutive_hysteresis: bool,
    /// DeepSpeed's `min_loss_scale`: an overflow at this scale stops the run.
    #[arg(long, default_value_t = 1.0)]
    #[serde(default = "one_f64")]
    pub min_loss_scale: f64,
    /// Activations recomputed in the backward instead of kept: none; elementwise (activation
    /// functions, casts, bias adds whose inputs the backward keeps anyway: one FLOP per element);
    /// selective (core attention: the scores, softmax and their 16-bit copy, as Megatron's
    /// selective recomputation); full (every layer from its input, as Megatron's full
    /// recomputation); auto (the cheapest of those that fits each rank in --memory-cap).
    #[arg(long, value_enum, default_value = "none")]
    #[serde(default)]
    pub recompute: RecomputeFlag,
    /// Where the optimizer's states (f32 masters, moments) and its step live: in the arena
    /// (none), in host memory outside it (cpu, as DeepSpeed's ZeRO-Offload), or in files under
    /// --nvme-path streamed through the step in tiles (nvme, as ZeRO-Infinity); CPU ranks only
    /// so far.
    #[arg(long, value_enum, default_value = "none")]
    #[serde(default)]
    pub offload_optimizer: OffloadFlag,
    /// A DeepSpeed configuration (ds_config.json) whose keys become these flags: batch sizes,
    /// gradient_clipping, optimizer, fp16/bf16, communication_data_type, zero_optimization
    /// (stage, buckets, offload_optimizer), activation_checkpointing (--recompute full),
    /// tensor_parallel.autotp_size, pipeline.stages. A flag given too must agree; keys autotp
    /// does not implement are listed in a warning.
    #[arg(long, value_name = "ds_config.json")]
    #[serde(default)]
    pub deepspeed: Option<PathBuf>,
    /// With --offload-optimizer nvme: the directory of the optimizer state's files, one per
    /// rank, removed when the run ends (`autotp run --nvme-path` may name another).
    #[arg(long, value_name = "DIR")]
    #[serde(default)]
    pub nvme_path: Option<PathBuf>,
    /// With --offload-optimizer nvme: parameter elements per tile of optimizer state streamed
    /// through the step (DeepSpeed's sub_group_size) [default: 1e9].
    #[arg(long, value_name = "ELEMENTS", value_parser = parse_count)]
    #[serde(default)]
    pub sub_group_size: Option<u64>,
    /// With --offload-optimizer nvme: tiles in memory at once, so that reading the next,
    /// updating one and writing the last overlap (DeepSpeed's buffer_count) [default: 4].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    #[serde(default)]
    pub buffer_count: Option<u64>,
    /// With --recompute full: only the first K layers of each stage (Megatron's block method).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    #[serde(default)]
    pub recompute_layers: Option<u64>,
    /// The most bytes a rank's arena may take (parameters, optimizer state, activations,
    /// inputs): a plan above it is refused; --recompute auto recomputes until it fits. Bytes,
    /// with an optional unit: 8GiB, 512MiB, 2GB, 3e9.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    #[serde(default)]
    pub memory_cap: Option<u64>,
}

/// `--recompute`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum RecomputeFlag {
    #[default]
    None,
    Elementwise,
    Selective,
    Full,
    Auto,
}

/// `--offload-optimizer`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum OffloadFlag {
    #[default]
    None,
    Cpu,
    Nvme,
}

/// A count as flags take it: an integer, or a decimal that is one (`1e9`).
pub fn parse_count(text: &str) -> std::result::Result<u64, String> {
    let value: f64 = text.trim().parse().map_err(|_| format!("'{text}' is not a number"))?;
    if !(value >= 1.0 && value.fract() == 0.0 && value < 2f64.powi(63)) {
        return Err(format!("'{text}' is not a positive whole number"));
    }
    Ok(value as u64)
}

/// Where the plan keeps its optimizer state in files (`--offload-optimizer nvme`), checked
/// against the flags that only it takes.
fn nvme_offload(flags: &CompileFlags) -> Result<Option<NvmeOffload>> {
    if flags.offload_optimizer != OffloadFlag::Nvme {
        let given = [
            ("--nvme-path", flags.nvme_path.is_some()),
            ("--sub-group-size", flags.sub_group_size.is_some()),
            ("--buffer-count", flags.buffer_count.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
            bail!("{flag} applies to --offload-optimizer nvme");
        }
        return Ok(None);
    }
    if flags.kernels != Kernels::Generated {
        bail!("--offload-optimizer nvme streams the state through the generated multi-tensor step: it needs --kernels generated");
    }
    let path = flags.nvme_path.as_ref().context(
        "--offload-optimizer nvme keeps the optimizer state in files under --nvme-path DIR, which is missing",
    )?;
    Ok(Some(NvmeOffload {
        path: std::path::absolute(path).with_context(|| format!("--nvme-path {}", path.display()))?,
        tile_elements: flags.sub_group_size.map_or(autotp_program::offload::DEFAULT_TILE_ELEMENTS, |n| n as usize),
        buffer_count: flags.buffer_count.map_or(autotp_program::offload::DEFAULT_BUFFER_COUNT, |n| n as usize),
    }))
}

/// A byte count as flags take it: an integer or a decimal (`3e9`, `1.5`) with an optional unit
/// (B; kB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024).
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("'{other}' is not a unit of bytes (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")),
    };
    let value: f64 = number.trim().parse().map_err(|_| format!("'{text}' is not a number of bytes"))?;
    let bytes = value * scale;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("'{text}' is not a positive number of bytes"));
    }
    Ok(bytes.round() as u64)
}

fn sixteen() -> u32 {
    16
}

fn two() -> u32 {
    2
}

fn one_f64() -> f64 {
    1.0
}

/// `--loss-scaler`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum LossScalerKind {
    #[default]
    Deepspeed,
    Torch,
}

/// `--precision`, `--grad-accum-dtype`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum Precision {
    #[default]
    F32,
    Bf16,
    Fp16,
}

impl Precision {
    pub fn dtype(self) -> autotp_ir::DType {
        match self {
            Precision::F32 => autotp_ir::DType::F32,
            Precision::Bf16 => autotp_ir::DType::BF16,
            Precision::Fp16 => autotp_ir::DType::F16,
        }
    }
}

/// `--kernels`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
enum Kernels {
    Generated,
    Builtin,
}

#[derive(Args)]
pub struct CompileArgs {
    #[command(flatten)]
    flags: CompileFlags,
    /// The plan to write. Without it, nothing is written and the model's weights are not read
    /// (they may be absent: external-data files missing, or exported with
    /// `export_params=False`): the summary and `--report` show the plan's memory and
    /// communication.
    #[arg(short, long, value_name = "OUT.atp", required_unless_present = "report")]
    output: Option<PathBuf>,
}

impl CompileFlags {
    /// The flags as the plan records them: what decides the step, without the inspection
    /// flags (dumps, prints, reports), which change nothing.
    fn recorded(&self) -> serde_json::Value {
        let mut flags = self.clone();
        (flags.dump_ir, flags.print_after, flags.report, flags.dump_kernels) = (None, vec![], None, None);
        flags.explain_tp = false;
        serde_json::to_value(&flags).expect("flags serialise")
    }

    /// The same model, optimizer and global batch on one device: every parallel flag reset,
    /// one micro-batch of the whole global batch.
    pub fn single_device(&self, global_batch: usize) -> CompileFlags {
        let mut flags = self.clone();
        (flags.dp, flags.tp, flags.pp, flags.zero) = (1, 1, 1, 0);
        (flags.micro_batch, flags.grad_accum, flags.global_batch) = (global_batch, None, None);
        flags.pp_cuts.clear();
        (flags.reduce_bucket_size, flags.prefetch_bucket_size, flags.max_live_params) = (None, None, None);
        flags.comm_dtype = None;
        flags.param_persistence_threshold = 0;
        flags
    }

    /// Flags a plan recorded ([`TrainingConfig::compile_flags`]).
    pub fn from_recorded(value: &serde_json::Value) -> Result<CompileFlags> {
        serde_json::from_value(value.clone()).context("the plan's recorded compile flags do not parse")
    }
}

/// A compiled plan with the imported model, whose weights it starts from.
pub struct Compiled {
    pub plan: TrainingPlan,
    pub model: Model,
    /// The initial weights of parameters that are parts of a model weight.
    pub part_weights: BTreeMap<String, Vec<u8>>,
}

impl Compiled {
    /// The initial weights by parameter name (slices of the memory-mapped model).
    pub fn weights(&self) -> BTreeMap<String, &[u8]> {
        let parts = self.part_weights.iter().map(|(name, bytes)| (name.clone(), &bytes[..]));
        self.model.weights.iter().map(|(name, t)| (name.clone(), t.bytes())).chain(parts).collect()
    }
}

/// The loss scaler of an fp16 plan, in its initial state; `None` for other precisions (which
/// refuse the loss-scaling flags).
fn loss_scaler(flags: &CompileFlags) -> Result<Option<LossScaler>> {
    if flags.precision != Precision::Fp16 {
        let given = [
            ("--loss-scaler", flags.loss_scaler != LossScalerKind::Deepspeed),
            ("--loss-scale", flags.loss_scale != 0.0),
            ("--initial-scale-power", flags.initial_scale_power != 16),
            ("--loss-scale-window", flags.loss_scale_window.is_some()),
            ("--hysteresis", flags.hysteresis != 2),
            ("--consecutive-hysteresis", flags.consecutive_hysteresis),
            ("--min-loss-scale", flags.min_loss_scale != 1.0),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
            bail!("{flag} applies to --precision fp16 (only fp16 scales the loss)");
        }
        return Ok(None);
    }
    if !(flags.loss_scale >= 0.0 && flags.loss_scale.is_finite()) {
        bail!("--loss-scale {} must be a finite number, 0 for dynamic scaling", flags.loss_scale);
    }
    if flags.loss_scale > 0.0 {
        return Ok(Some(LossScaler::Static { scale: flags.loss_scale }));
    }
    if flags.loss_scale_window == Some(0) || flags.hysteresis == 0 || flags.initial_scale_power > 120 {
        bail!("--loss-scale-window and --hysteresis must be at least 1, --initial-scale-power at most 120");
    }
    Ok(Some(match flags.loss_scaler {
        LossScalerKind::Deepspeed => LossScaler::DeepSpeed(DeepSpeedScaler::new(
            flags.initial_scale_power,
            flags.loss_scale_window.unwrap_or(1000),
            flags.hysteresis,
            flags.consecutive_hysteresis,
            flags.min_loss_scale,
        )),
        LossScalerKind::Torch => LossScaler::Torch(TorchScaler {
            scale: 2f64.powi(flags.initial_scale_power as i32),
            growth_interval: flags.loss_scale_window.unwrap_or(2000),
            ..TorchScaler::torch_defaults()
        }),
    }))
}

/// Refuses a model whose gathers with indices known at import read past their table: a
/// position embedding shorter than `--seq-len`, which would otherwise fail at the first step.
fn check_constant_gathers(graph: &autotp_ir::Graph, flags: &CompileFlags) -> Result<()> {
    for (id, node) in graph.nodes() {
        let autotp_ir::Op::Gather { axis } = node.op else { continue };
        let autotp_ir::Def::Node(made_by, _) = graph.value(node.inputs[1]).def else { continue };
        let autotp_ir::Op::Constant { value } = &graph.node(made_by).op else { continue };
        let size = graph.ty(node.inputs[0]).shape[axis] as i64;
        let Some(index) = value.to_i64_vec().into_iter().find(|&i| i >= size || i < -size) else { continue };
        let table = match graph.name_of(node.inputs[0]) {
            Some(name) => format!("'{name}'"),
            None => "its input".to_string(),
        };
        bail!(
            "--seq-len {}: the model reads entry {index} of {table} (dim {axis} of size {size}; gather, node {}); \
             a position table that long allows --seq-len {size} at most",
            flags.seq_len,
            id.index()
        );
    }
    Ok(())
}

/// `flag`'s `value` if it is a finite number of at least 0, as `torch.optim` requires of a
/// learning rate, eps, weight decay and momentum.
fn non_negative(flag: &str, value: f64) -> Result<f64> {
    if !(value.is_finite() && value >= 0.0) {
        bail!("{flag} {value} is invalid: it must be a finite number of at least 0");
    }
    Ok(value)
}

fn optimizer(flags: &CompileFlags) -> Result<(Optimizer, String)> {
    non_negative("--lr", flags.lr)?;
    non_negative("--weight-decay", flags.weight_decay)?;
    if let Some(clip) = flags.grad_clip {
        if !(clip.is_finite() && clip > 0.0) {
            bail!("--grad-clip {clip} is invalid: it must be a finite norm above 0 (leave it out not to clip)");
        }
    }
    Ok(match flags.optimizer.as_str() {
        "adamw" => {
            let betas: Vec<f64> = flags
                .betas
                .split(',')
                .map(|b| b.trim().parse::<f64>())
                .collect::<Result<_, _>>()
                .with_context(|| format!("--betas '{}' must be B1,B2", flags.betas))?;
            let [beta1, beta2] = betas[..] else { bail!("--betas '{}' must be two numbers, B1,B2", flags.betas) };
            if !betas.iter().all(|b| (0.0..1.0).contains(b)) {
                bail!("--betas {beta1},{beta2} is invalid: each must be at least 0 and below 1");
            }
            let (eps, weight_decay) = (non_negative("--eps", flags.eps)?, flags.weight_decay);
            let description = format!("adamw(betas={beta1},{beta2} eps={eps:e} weight_decay={weight_decay})");
            (Optimizer::AdamW { beta1, beta2, eps, weight_decay }, description)
        }
        "sgd" => {
            let (momentum, weight_decay, nesterov) =
                (non_negative("--momentum", flags.momentum)?, flags.weight_decay, flags.nesterov);
            if nesterov && momentum == 0.0 {
                bail!("--nesterov needs a --momentum above 0");
            }
            let description = format!("sgd(momentum={momentum} nesterov={nesterov} weight_decay={weight_decay})");
            (Optimizer::Sgd { momentum, weight_decay, nesterov }, description)
        }
        other => bail!("--optimizer '{other}' is not one of adamw, sgd"),
    })
}

fn lr_schedule(flags: &CompileFlags) -> Result<LrSchedule> {
    let kind = flags.lr_schedule.as_str();
    let deepspeed = matches!(kind, "warmup" | "warmup-decay" | "warmup-cosine");
    let given = [
        ("--warmup-min-lr", flags.warmup_min_lr.is_some(), matches!(kind, "warmup" | "warmup-decay")),
        ("--warmup-type", flags.warmup_type.is_some(), deepspeed),
        ("--warmup-min-ratio", flags.warmup_min_ratio.is_some(), kind == "warmup-cosine"),
        ("--cos-min-ratio", flags.cos_min_ratio.is_some(), kind == "warmup-cosine"),
    ];
    if let Some((flag, ..)) = given.iter().find(|(_, given, applies)| *given && !applies) {
        bail!("{flag} does not apply to --lr-schedule {kind}");
    }
    non_negative("--min-lr", flags.min_lr)?;
    let ratios = [("--warmup-min-ratio", flags.warmup_min_ratio), ("--cos-min-ratio", flags.cos_min_ratio)];
    for (flag, value) in [("--warmup-min-lr", flags.warmup_min_lr)].into_iter().chain(ratios) {
        value.map(|v| non_negative(flag, v)).transpose()?;
    }
    let log_warmup = match flags.warmup_type.as_deref() {
        None | Some("log") => true,
        Some("linear") => false,
        Some(other) => bail!("--warmup-type '{other}' is not one of log, linear"),
    };
    let total_steps = || {
        flags
            .lr_decay_steps
            .with_context(|| format!("--lr-schedule {kind} decays to --lr-decay-steps, which is missing"))
    };
    Ok(match kind {
        "constant" => LrSchedule::Constant { lr: flags.lr },
        "cosine" => LrSchedule::WarmupCosine {
            lr: flags.lr,
            warmup_steps: flags.warmup_steps,
            decay_steps: flags.lr_decay_steps,
            min_lr: flags.min_lr,
        },
        "warmup" | "warmup-decay" => LrSchedule::DeepSpeedWarmup {
            min_lr: flags.warmup_min_lr.unwrap_or(0.0),
            max_lr: flags.lr,
            warmup_steps: flags.warmup_steps,
            log_warmup,
            total_steps: if kind == "warmup-decay" { Some(total_steps()?) } else { None },
        },
        "warmup-cosine" => LrSchedule::DeepSpeedWarmupCosine {
            lr: flags.lr,
            total_steps: total_steps()?,
            warmup_min_ratio: flags.warmup_min_ratio.unwrap_or(0.0),
            warmup_steps: flags.warmup_steps,
            cos_min_ratio: flags.cos_min_ratio.unwrap_or(1e-4),
            log_warmup,
        },
        other => bail!("--lr-schedule '{other}' is not one of constant, cosine, warmup, warmup-decay, warmup-cosine"),
    })
}

/// The embedding tables' padding rows: `--padding-idx`, else each table's one zero row.
fn padding_rows(flags: &CompileFlags, model: &autotp_frontend::Model) -> Result<Vec<PaddingRow>> {
    use autotp_passes::padding::{choose_padding_rows, embedding_tables, PaddingFlag};
    let parsed: Vec<PaddingFlag> =
        flags.padding_idx.iter().map(|f| f.parse()).collect::<Result<_, String>>().map_err(anyhow::Error::msg)?;
    let tables = embedding_tables(&model.graph, &model.weights);
    let (rows, ambiguous) = choose_padding_rows(&tables, &parsed).map_err(anyhow::Error::msg)?;
    for table in ambiguous {
        tracing::warn!(
            "embedding table '{}' has {} rows of zeros ({:?}...): none is taken as its padding row; \
             set --padding-idx {}=N if one is",
            table.param,
            table.zero_rows.len(),
            &table.zero_rows[..table.zero_rows.len().min(4)],
            table.param
        );
    }
    Ok(rows.into_iter().map(|r| PaddingRow { table: r.table, row: r.row, detected: r.detected }).collect())
}

/// The parameters `--freeze` names; each expression must match at least one.
/// Micro-batches per step: `--grad-accum`, or what `--global-batch` implies; contradictory or
/// indivisible batch flags are refused.
fn grad_accum(flags: &CompileFlags) -> Result<usize> {
    let per_micro_batch = flags.micro_batch * flags.dp;
    let Some(global) = flags.global_batch else { return Ok(flags.grad_accum.unwrap_or(1)) };
    let parts = format!("micro-batch {} x dp {} = {per_micro_batch}", flags.micro_batch, flags.dp);
    if global == 0 || global % per_micro_batch != 0 {
        bail!("--global-batch {global} is not a multiple of {parts} sequences per micro-batch");
    }
    let implied = global / per_micro_batch;
    match flags.grad_accum {
        Some(a) if a != implied => bail!(
            "--global-batch {global} contradicts --grad-accum {a}: {parts} sequences per micro-batch \
             x {a} micro-batches is {}",
            per_micro_batch * a
        ),
        _ => Ok(implied),
    }
}

fn frozen(flags: &CompileFlags, graph: &Graph) -> Result<BTreeSet<String>> {
    let params: Vec<&str> = graph.params().iter().filter_map(|&p| graph.name_of(p)).collect();
    let mut frozen = BTreeSet::new();
    for pattern in &flags.freeze {
        let regex = regex::Regex::new(pattern).with_context(|| format!("--freeze '{pattern}' is not a valid regex"))?;
        let matched: Vec<&str> = params.iter().copied().filter(|p| regex.is_match(p)).collect();
        if matched.is_empty() {
            let some: Vec<&str> = params.iter().copied().take(6).collect();
            bail!(
                "--freeze '{pattern}' matches no parameter of the model (its {} parameters include {})",
                params.len(),
                some.join(", ")
            );
        }
        frozen.extend(matched.into_iter().map(str::to_string));
    }
    if !params.is_empty() && frozen.len() == params.len() {
        bail!("--freeze leaves nothing to train: it matches all {} parameters", params.len());
    }
    Ok(frozen)
}

/// Writes the graph to DIR/NN-name.ir (DIR/NN-name.stageS.ir for a pipeline stage's) and prints
/// it after the `--print-after` passes.
struct IrObserver<'a> {
    dump_dir: Option<&'a Path>,
    print_after: &'a [String],
    /// The pipeline stage whose graph is observed, once the pipeline pass has cut them.
    stage: Option<usize>,
    error: Option<anyhow::Error>,
}

impl IrObserver<'_> {
    fn observe(&mut self, index: usize, pass: &str, graph: &Graph) {
        let stage = self.stage.map(|s| format!(".stage{s}")).unwrap_or_default();
        if self.print_after.iter().any(|p| p == pass) {
            let of_stage = self.stage.map(|s| format!(", stage {s}")).unwrap_or_default();
            println!("# IR after pass {index} ({pass}{of_stage})");
            print!("{}", autotp_ir::text::print(graph));
        }
        if let (Some(dir), None) = (self.dump_dir, &self.error) {
            let path = dir.join(format!("{index:02}-{pass}{stage}.ir"));
            if let Err(e) = std::fs::write(&path, autotp_ir::text::print(graph)) {
                self.error = Some(anyhow::Error::new(e).context(format!("--dump-ir: cannot write {}", path.display())));
            }
        }
    }
}

pub fn compile(flags: &CompileFlags) -> Result<Compiled> {
    compile_with(flags, Weights::Read)
}

/// Whether a compile reads the model's weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weights {
    /// Into the plan: it can be written and trained.
    Read,
    /// Not at all: the model is imported shapes-only ([`ImportOptions::shapes_only`]), for the
    /// memory and communication report (`compile --report` without `-o`, `autotp plan`); with
    /// `layers`, cut to its first layers ([`autotp_passes::depth`]). No PTX is made.
    ShapesOnly { layers: Option<usize> },
}

/// A shapes-only import for a cut of the model: `autotp plan` compiles hundreds of cuts of one
/// model at a few batch sizes, so each is imported once per process.
fn imported_for_cuts(path: &Path, options: &ImportOptions) -> Result<autotp_frontend::Model> {
    type Imports = BTreeMap<(PathBuf, Option<usize>, Option<usize>), autotp_frontend::Model>;
    static IMPORTS: std::sync::OnceLock<std::sync::Mutex<Imports>> = std::sync::OnceLock::new();
    let imports = IMPORTS.get_or_init(Default::default);
    let key = (path.to_path_buf(), options.batch, options.seq_len);
    if let Some(model) = imports.lock().expect("imports").get(&key) {
        return Ok(model.clone());
    }
    let model = autotp_frontend::import_onnx(path, options)?;
    imports.lock().expect("imports").insert(key, model.clone());
    Ok(model)
}

/// [`compile`], with or without the model's weights.
pub fn compile_with(flags: &CompileFlags, weights: Weights) -> Result<Compiled> {
    let (optimizer, optimizer_description) = optimizer(flags)?;
    let schedule = lr_schedule(flags)?;
    if flags.seq_len == 0
        || flags.micro_batch == 0
        || flags.dp == 0
        || flags.tp == 0
        || flags.pp == 0
        || flags.grad_accum == Some(0)
    {
        bail!("--seq-len, --micro-batch, --grad-accum, --dp, --tp and --pp must be at least 1");
    }
    let grad_accum = grad_accum(flags)?;
    let pipeline_schedule = PipelineSchedule::parse(&flags.schedule)
        .with_context(|| format!("--schedule '{}' is not one of 1f1b, gpipe", flags.schedule))?;
    let pipeline_backward = PipelineBackward::parse(&flags.pp_backward)
        .with_context(|| format!("--pp-backward '{}' is not one of split, whole", flags.pp_backward))?;
    if flags.pp == 1
        && (!flags.pp_cuts.is_empty()
            || pipeline_schedule != PipelineSchedule::OneFOneB
            || pipeline_backward != PipelineBackward::Whole)
    {
        bail!("--pp-cuts, --schedule and --pp-backward place pipeline stages: they need --pp 2 or more");
    }
    if flags.explain_tp && flags.tp < 2 {
        bail!("--explain-tp needs --tp 2 or more");
    }
    if let (Some(k), false) = (flags.recompute_layers, flags.recompute == RecomputeFlag::Full) {
        bail!(
            "--recompute-layers {k} chooses the layers of --recompute full, not --recompute {}",
            recompute_flag_name(flags.recompute)
        );
    }
    if flags.zero > 3 {
        bail!("--zero {} is not a ZeRO stage (0, 1, 2 or 3)", flags.zero);
    }
    let stage3 = [
        ("--param-persistence-threshold", flags.param_persistence_threshold > 0),
        ("--prefetch-bucket-size", flags.prefetch_bucket_size.is_some()),
        ("--max-live-params", flags.max_live_params.is_some()),
    ];
    if let Some((flag, _)) = stage3.iter().find(|(_, given)| *given && flags.zero != 3) {
        bail!("{flag} applies to --zero 3");
    }
    let defaults = Prefetch::default();
    let prefetch = Prefetch {
        bucket_elements: flags.prefetch_bucket_size.unwrap_or(defaults.bucket_elements),
        max_live_elements: flags.max_live_params.unwrap_or(defaults.max_live_elements),
    };
    if flags.comm_dtype.is_some() && flags.dp < 2 {
        bail!("--comm-dtype is the type of data-parallel gradient reductions: it needs --dp 2 or more");
    }
    if flags.reduce_bucket_size.is_some() && flags.dp < 2 {
        bail!("--reduce-bucket-size buckets data-parallel gradient reductions: it needs --dp 2 or more");
    }
    let zero = ZeroConfig {
        stage: flags.zero,
        persistence_threshold: flags.param_persistence_threshold,
        prefetch,
        // DeepSpeed's reduce_bucket_size default.
        reduce_bucket_elements: flags.reduce_bucket_size.unwrap_or(500_000_000),
        comm_dtype: flags.comm_dtype.map(Precision::dtype),
        micro_batches: grad_accum,
    };
    if flags.zero > 0 && flags.dp < 2 {
        bail!("--zero {} shards over data-parallel ranks: it needs --dp 2 or more", flags.zero);
    }
    let nvme = nvme_offload(flags)?;
    let start = Instant::now();
    // The graph is imported for one micro-batch of every rank; `accumulate` or the pipeline
    // repeat it.
    let micro_batch_rows = flags.micro_batch * flags.dp;
    let global_batch = micro_batch_rows * grad_accum;
    let options = ImportOptions {
        batch: Some(micro_batch_rows),
        seq_len: Some(flags.seq_len),
        shapes_only: weights != Weights::Read,
        ..Default::default()
    };
    let mut model = match weights {
        Weights::ShapesOnly { layers: Some(layers) } => {
            let mut model = imported_for_cuts(&flags.model, &options)?;
            model.graph = autotp_passes::depth::keep_layers(&model.graph, layers)?;
            model
        }
        _ => autotp_frontend::import_onnx(&flags.model, &options)?,
    };
    check_constant_gathers(&model.graph, flags)?;
    // The model's parameter shapes, which the passes may split.
    let model_shapes: BTreeMap<String, Vec<usize>> = (model.graph.params().iter())
        .filter_map(|&p| Some((model.graph.name_of(p)?.to_string(), model.graph.ty(p).shape.clone())))
        .collect();
    let mut frozen = frozen(flags, &model.graph)?;
    let padding_rows = padding_rows(flags, &model)?;
    let own_loss = model.graph.outputs().iter().any(|(n, _)| n == LOSS);
    let batch_inputs = vec![StepInput::InputIds.name().to_string(), LABELS.to_string()];
    let mut autodiff = Autodiff::new(LOSS);
    autodiff.frozen = frozen.clone();
    autodiff.padding_rows = padding_rows.iter().map(|p| (p.table.clone(), p.row)).collect();
    // Before the pipeline cuts the graph...
    let mut front: Vec<Box<dyn Pass>> = vec![
        Box::new(autotp_passes::recognize::Recognize),
        Box::new(Peephole { rules: peephole::Rules::Algebraic }),
        Box::new(autotp_passes::unmerge_heads::UnmergeHeads),
        Box::new(autotp_passes::dce::Dce),
        Box::new(AttachLoss),
    ];
    if flags.tp > 1 {
        front.push(Box::new(SplitFused));
        front.push(Box::new(autotp_passes::expand_norms::ExpandNorms));
    }
    let pipelined = flags.pp > 1;
    let mixed = flags.precision != Precision::F32;
    if mixed {
        let loss_scaling = flags.precision == Precision::Fp16;
        front.push(Box::new(autotp_passes::precision::Precision { half: flags.precision.dtype(), loss_scaling }));
        if loss_scaling {
            autodiff.cotangent = Some(autotp_passes::precision::LOSS_SCALE.into());
        }
    }
    if !mixed && flags.grad_accum_dtype.is_some() {
        bail!("--grad-accum-dtype applies to --precision bf16 or fp16 (f32 gradients are accumulated in f32)");
    }
    if !pipelined {
        front.push(Box::new(autodiff));
        if mixed {
            let dtype = flags.grad_accum_dtype.unwrap_or(Precision::F32).dtype();
            front.push(Box::new(autotp_passes::precision::GradAccumulation { dtype }));
        }
        if grad_accum > 1 {
            front.push(Box::new(Accumulate { micro_batches: grad_accum, batch_inputs: batch_inputs.clone() }));
        }
    }
    // ...and after, on each stage.
    let back = |stage: Option<StageNorm>| {
        let nonfinite = match flags.precision {
            Precision::F32 => NonFinite::Apply,
            Precision::Bf16 => NonFinite::Skip,
            Precision::Fp16 => NonFinite::SkipScaled,
        };
        let optimize = Optimize { optimizer: optimizer.clone(), grad_clip: flags.grad_clip, stage, nonfinite };
        let mut back: Vec<Box<dyn Pass>> = vec![Box::new(optimize), Box::new(autotp_passes::dce::Dce)];
        if flags.dp > 1 && flags.tp == 1 {
            back.push(Box::new(Zero { dp: flags.dp, config: zero, batch_inputs: batch_inputs.clone() }));
        }
        PassManager::new(back)
    };
    let front = PassManager::new(front);
    let mut names = front.pass_names();
    if pipelined {
        names.push("pipeline");
    }
    names.extend(back(None).pass_names());
    if flags.tp > 1 {
        names.push("autotp");
    }
    let generated = matches!(flags.kernels, Kernels::Generated);
    if generated {
        names.push("fusion");
    }
    if let Some(unknown) = flags.print_after.iter().find(|p| !names.contains(&p.as_str())) {
        bail!("--print-after '{unknown}': no such pass (the pipeline runs {})", names.join(", "));
    }
    let mut observer =
        IrObserver { dump_dir: flags.dump_ir.as_deref(), print_after: &flags.print_after, stage: None, error: None };
    if let Some(dir) = observer.dump_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("--dump-ir: cannot create {}", dir.display()))?;
    }
    observer.observe(0, "import", &model.graph);
    front.run_observed(&mut model.graph, &mut |i, pass, graph| observer.observe(i, pass, graph))?;
    let mut index = front.pass_names().len();
    let (graphs, norms, pipeline) = if pipelined {
        let pipeline = Pipeline {
            stages: flags.pp,
            cuts: flags.pp_cuts.clone(),
            micro_batches: grad_accum,
            schedule: pipeline_schedule,
            backward: pipeline_backward,
            batch_inputs: batch_inputs.clone(),
            frozen: frozen.clone(),
            padding_rows: padding_rows.iter().map(|p| (p.table.clone(), p.row)).collect(),
            grad_dtype: mixed.then(|| flags.grad_accum_dtype.unwrap_or(Precision::F32).dtype()),
            loss_scaling: flags.precision == Precision::Fp16,
        };
        let (graphs, norms, config) = cut_pipeline(&pipeline, &model.graph)?;
        index += 1;
        for (s, graph) in graphs.iter().enumerate() {
            observer.stage = Some(s);
            observer.observe(index, "pipeline", graph);
        }
        (graphs, norms.into_iter().map(Some).collect(), Some(config))
    } else {
        let name = model.graph.name.clone();
        (vec![std::mem::replace(&mut model.graph, Graph::new(name))], vec![None], None)
    };
    let mut programs = Vec::new();
    let mut weight_shapes = BTreeMap::new();
    let (mut weight_parts, mut part_weights) = (BTreeMap::new(), BTreeMap::new());
    let mut masters = BTreeMap::new();
    let mut recomputed = RecomputeSummary {
        mode: recompute_flag_name(flags.recompute).to_string(),
        chosen: Vec::new(),
        layer_inputs: Vec::new(),
        layers: Vec::new(),
        memory_cap: flags.memory_cap,
        blocks: Vec::new(),
        flops: Vec::new(),
        activations_peak_without: Vec::new(),
        probability_elements: Vec::new(),
    };
    for (s, (mut graph, norm)) in graphs.into_iter().zip(norms).enumerate() {
        observer.stage = pipelined.then_some(s);
        back(norm).run_observed(&mut graph, &mut |i, pass, graph| observer.observe(index + i, pass, graph))?;
        if flags.tp > 1 {
            let autotp = AutoTp { tp: flags.tp, dp: flags.dp, zero, batch_inputs: batch_inputs.clone() };
            let (sharded, explained) = autotp.shard(&graph)?;
            autotp_ir::verify(&sharded)
                .map_err(|errors| autotp_passes::PassError::Verify { pass: "autotp", errors })?;
            let autotp_index = names.iter().position(|&n| n == "autotp").map_or(0, |i| i + 1);
            observer.observe(autotp_index, "autotp", &sharded);
            if flags.explain_tp {
                explain_tp(flags.tp, &graph, &explained);
            }
            graph = sharded;
        }
        let kernels = match flags.kernels {
            Kernels::Generated => autotp_codegen::KernelChoice::Generated,
            Kernels::Builtin => autotp_codegen::KernelChoice::Builtin,
        };
        let offload_optimizer = flags.offload_optimizer != OffloadFlag::None;
        let options = autotp_codegen::LowerOptions { kernels, ptx: false, offload_optimizer };
        let recompute = match flags.recompute {
            RecomputeFlag::None => Recompute::None,
            RecomputeFlag::Elementwise => Recompute::Elementwise,
            RecomputeFlag::Selective => Recompute::Selective,
            RecomputeFlag::Full => Recompute::Full { layers: flags.recompute_layers.map(|k| k as usize) },
            RecomputeFlag::Auto => {
                let cap = flags.memory_cap.context("--recompute auto chooses by --memory-cap, which is missing")?;
                fitting_recompute(&graph, generated, &options, cap, pipelined.then_some(s))?
            }
        };
        if flags.recompute != RecomputeFlag::None {
            // What it recomputes, and the activation peak without it (lowered for its memory
            // plan alone).
            let mut kept = graph.clone();
            if generated {
                autotp_passes::fusion::Fusion::default().run(&mut kept)?;
            }
            // Found as fusion finds them, before its schedule (which may move a backward
            // node that reads only forward values into the forward).
            let blocks = autotp_passes::recompute::blocks(&graph, recompute);
            recomputed.chosen.push(recompute_name(recompute));
            recomputed.blocks.push(blocks.len());
            recomputed.flops.push(autotp_passes::recompute::flops(&graph, &blocks));
            let attention = autotp_passes::recompute::blocks(&graph, Recompute::Selective);
            let elements = attention.first().map_or(0, |b| match b.what {
                Recomputed::Attention { probability_elements } => probability_elements,
                Recomputed::Layer { .. } | Recomputed::Elementwise { .. } => 0,
            });
            recomputed.probability_elements.push(elements);
            let input = blocks.first().and_then(|b| match b.what {
                Recomputed::Layer { input, .. } => input,
                Recomputed::Attention { .. } | Recomputed::Elementwise { .. } => None,
            });
            let numbers: BTreeSet<u64> = (blocks.iter())
                .filter_map(|b| match b.what {
                    Recomputed::Layer { number, .. } => Some(number),
                    Recomputed::Attention { .. } | Recomputed::Elementwise { .. } => None,
                })
                .collect();
            recomputed.layers.push(numbers.len());
            recomputed.layer_inputs.push(input.map_or((0, 0), |v| (graph.ty(v).numel(), graph.ty(v).size_bytes())));
            let peak = autotp_codegen::lower_with(&kept, &options)?.memory.activations_peak_bytes;
            recomputed.activations_peak_without.push(peak);
        }
        if generated {
            autotp_passes::fusion::Fusion { recompute }.run(&mut graph)?;
            autotp_ir::verify(&graph).map_err(|errors| autotp_passes::PassError::Verify { pass: "fusion", errors })?;
            observer.observe(names.len(), "fusion", &graph);
        } else if recompute != Recompute::None {
            graph = autotp_passes::recompute::recompute(&graph, recompute).0;
        }
        for &p in graph.params() {
            let Some(name) = graph.name_of(p) else { continue };
            if let Some(shape) = model_shapes.get(name).filter(|&shape| shape != &graph.ty(p).shape) {
                weight_shapes.insert(name.to_string(), shape.clone());
            }
            if !model_shapes.contains_key(name) {
                if let Some((part, bytes)) = weight_part(&model, &model_shapes, name, &graph.ty(p).shape) {
                    if let Some(bytes) = bytes {
                        part_weights.insert(name.to_string(), bytes);
                    }
                    weight_parts.insert(name.to_string(), part);
                }
            }
        }
        for &state in graph.states() {
            let Some(name) = graph.name_of(state) else { continue };
            if let Some(param) = name.strip_prefix(autotp_passes::optimize::MASTER_PREFIX) {
                masters.insert(name.to_string(), param.to_string());
            }
            // A parameter's states (its master, its moments: `<kind>.<parameter>`) are stored
            // in its model shape too, so a checkpoint reads the same under any layout.
            let of_param = weight_shapes.iter().find(|(param, shape)| {
                name.strip_suffix(param.as_str()).is_some_and(|prefix| prefix.ends_with('.'))
                    && shape.iter().product::<usize>() == graph.ty(state).numel()
            });
            if let Some((_, shape)) = of_param {
                weight_shapes.insert(name.to_string(), shape.clone());
            }
        }
        // PTX is for the plan file: a shapes-only compile writes none.
        let ptx = generated && weights == Weights::Read;
        let options = autotp_codegen::LowerOptions { kernels, ptx, offload_optimizer };
        let program = autotp_codegen::lower_with(&graph, &options)?;
        if let Some(nvme) = &nvme {
            let stage = if pipelined { format!(" (stage {s})") } else { String::new() };
            autotp_program::offload::Layout::of(&program, nvme.tile_elements)
                .map_err(|e| anyhow::anyhow!("--offload-optimizer nvme{stage}: {e}"))?;
        }
        if let Some(cap) = flags.memory_cap.filter(|&cap| program.memory.arena_bytes as u64 > cap) {
            let stage = if pipelined { format!("stage {s}") } else { "each rank".to_string() };
            bail!(
                "{stage} needs {} bytes, over --memory-cap {cap} (with --recompute {}); --recompute auto recomputes \
                 activations until a plan fits",
                program.memory.arena_bytes,
                recompute_name(recompute)
            );
        }
        programs.push(program);
    }
    if let Some(error) = observer.error {
        return Err(error);
    }
    // A frozen fused weight's parts are frozen.
    let frozen_parts: Vec<String> =
        weight_parts.iter().filter(|(_, part)| frozen.contains(&part.weight)).map(|(name, _)| name.clone()).collect();
    frozen.extend(frozen_parts);
    let path = std::fs::canonicalize(&flags.model).unwrap_or_else(|_| flags.model.clone());
    let plan = TrainingPlan {
        stages: programs,
        training: TrainingConfig {
            seq_len: flags.seq_len,
            micro_batch: flags.micro_batch,
            global_batch,
            labels: if own_loss { Labels::InputIds } else { Labels::NextTokens },
            loss_output: LOSS.to_string(),
            optimizer: optimizer_description,
            schedule,
            grad_clip: flags.grad_clip,
            frozen: frozen.into_iter().collect(),
            padding_rows,
            compile_flags: Some(flags.recorded()),
            zero_stage: flags.zero,
            grad_accum,
            weight_shapes,
            weight_parts,
            pipeline,
            masters,
            grad_accum_dtype: mixed.then(|| flags.grad_accum_dtype.unwrap_or(Precision::F32).dtype()),
            loss_scaler: loss_scaler(flags)?,
            recompute: (flags.recompute != RecomputeFlag::None).then_some(recomputed),
            nvme,
        },
        model: ModelSource { name: model.graph.name.clone(), path },
    };
    plan.feeds()?;
    tracing::info!(seconds = start.elapsed().as_secs_f64(), "compiled {}", flags.model.display());
    Ok(Compiled { plan, model, part_weights })
}

/// The summary's lines on the optimizer state in files: per stage, its tiles, the buffers in
/// memory and the bytes each step reads and writes.
fn nvme_lines(plan: &TrainingPlan, nvme: &NvmeOffload) -> Vec<String> {
    let mut lines = vec![format!(
        "  optimizer state on NVMe under {}: tiles of at most {} elements, {} buffers",
        nvme.path.display(),
        grouped(nvme.tile_elements),
        nvme.buffer_count
    )];
    for (s, program) in plan.stages.iter().enumerate() {
        let Ok(layout) = autotp_program::offload::Layout::of(program, nvme.tile_elements) else { continue };
        let stage = if plan.stages.len() > 1 { format!("stage {s}: ") } else { String::new() };
        let buffers = layout.buffers(nvme.buffer_count);
        lines.push(format!(
            "    {stage}{} tiles, {} bytes in memory ({buffers} x {}); {} bytes read and {} written per step",
            layout.tiles,
            grouped(buffers * layout.tile_bytes),
            grouped(layout.tile_bytes),
            grouped(layout.file_bytes),
            grouped(layout.file_bytes),
        ));
    }
    lines
}

/// The summary's lines on recomputation: per stage what it recomputes, at what cost, and the
/// activation peak with and without it, beside Korthikanti et al.'s formulas.
fn recompute_lines(plan: &TrainingPlan, r: &RecomputeSummary) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(cap) = r.memory_cap {
        let largest = plan.stages.iter().map(|p| p.memory.arena_bytes).max().unwrap_or(0);
        lines.push(format!("  memory cap {} per rank: largest arena {}", grouped(cap as usize), grouped(largest)));
    }
    for (s, program) in plan.stages.iter().enumerate() {
        let (with, without) = (program.memory.activations_peak_bytes, r.activations_peak_without[s]);
        let stage = if plan.stages.len() > 1 { format!("stage {s}: ") } else { String::new() };
        let chosen = r.chosen.get(s).map_or(r.mode.as_str(), String::as_str);
        let blocks = r.blocks[s];
        let what = match chosen {
            "elementwise" => "elementwise ops",
            "selective" => "attention blocks",
            _ => "layers",
        };
        lines.push(format!(
            "  recompute {chosen}: {stage}{blocks} {what} per step, +{} FLOPs; activations peak {} (without: {}, {:+.1}%)",
            grouped(r.flops[s] as usize),
            grouped(with),
            grouped(without),
            100.0 * (with as f64 - without as f64) / without.max(1) as f64
        ));
        if blocks == 0 {
            continue;
        }
        let elements = r.probability_elements.get(s).copied().unwrap_or(0);
        let saved = without.saturating_sub(with);
        if let Some(&(sbh, bytes)) = r.layer_inputs.get(s).filter(|i| i.0 > 0) {
            let layers = r.layers.get(s).copied().unwrap_or(blocks).max(1);
            lines.push(format!(
                "    per layer: keeps its input, {} (Korthikanti et al. 2022: 2sbh = {} in 16-bit); the peak drops {} \
                 per layer recomputed (their sbh(34 + 5as/h) - 2sbh = {} in 16-bit, with dropout masks)",
                grouped(bytes),
                grouped(2 * sbh),
                grouped(saved / layers),
                grouped(34 * sbh + 5 * elements - 2 * sbh)
            ));
        } else if elements > 0 && chosen == "selective" {
            lines.push(format!(
                "    saved per attention block {}; Korthikanti et al. 2022: 5as^2b = {} per layer in 16-bit \
                 (scores 2, softmax 2, dropout mask 1 byte per probability; no dropout here)",
                grouped(saved / blocks),
                grouped(5 * elements)
            ));
        }
    }
    lines
}

/// `--recompute`'s value as the user spells it.
fn recompute_flag_name(flag: RecomputeFlag) -> &'static str {
    match flag {
        RecomputeFlag::None => "none",
        RecomputeFlag::Elementwise => "elementwise",
        RecomputeFlag::Selective => "selective",
        RecomputeFlag::Full => "full",
        RecomputeFlag::Auto => "auto",
    }
}

/// How a plan's summary names what a stage recomputes.
fn recompute_name(recompute: Recompute) -> String {
    match recompute {
        Recompute::None => "none".into(),
        Recompute::Elementwise => "elementwise".into(),
        Recompute::Selective => "selective".into(),
        Recompute::Full { layers: None } => "full".into(),
        Recompute::Full { layers: Some(k) } => format!("full (first {k} layers)"),
    }
}

/// The cheapest recomputation that fits a rank of `graph` (a stage's step, sharded) in `cap`
/// bytes: none, elementwise ops, core attention, then whole layers, the first K of the stage
/// for the smallest K that fits. Refused, with the smallest reachable arena, when every layer recomputed does
/// not fit.
fn fitting_recompute(
    graph: &Graph,
    generated: bool,
    options: &autotp_codegen::LowerOptions,
    cap: u64,
    stage: Option<usize>,
) -> Result<Recompute> {
    let arena = |recompute: Recompute| -> Result<u64> {
        let mut graph = graph.clone();
        if generated {
            autotp_passes::fusion::Fusion { recompute }.run(&mut graph)?;
        } else {
            graph = autotp_passes::recompute::recompute(&graph, recompute).0;
        }
        Ok(autotp_codegen::lower_with(&graph, options)?.memory.arena_bytes as u64)
    };
    for recompute in [Recompute::None, Recompute::Elementwise, Recompute::Selective] {
        if arena(recompute)? <= cap {
            return Ok(recompute);
        }
    }
    let layers = autotp_passes::pipeline::numbered_layers(graph).map_or(0, |l| l.numbers.len());
    let full = arena(Recompute::Full { layers: None })?;
    if full > cap {
        let stage = stage.map_or("a rank".to_string(), |s| format!("stage {s}"));
        bail!(
            "--memory-cap {cap} cannot be met: {stage} needs at least {full} bytes, with every one of its {layers} \
             layers recomputed (--recompute full); raise the cap, or split the model further (--tp, --pp, --zero 3)"
        );
    }
    // The fewest layers that fit (more recomputed layers never need more memory).
    let (mut low, mut high) = (1, layers.max(1));
    while low < high {
        let middle = (low + high) / 2;
        if arena(Recompute::Full { layers: Some(middle) })? <= cap {
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    Ok(if low >= layers { Recompute::Full { layers: None } } else { Recompute::Full { layers: Some(low) } })
}

/// Where the parameter `name` of `shape` lies in a model weight, when it is one of the parts
/// `split-fused` made ([`autotp_passes::split_fused::part_name`]), and its initial bytes (when
/// the weights were read).
fn weight_part(
    model: &Model,
    model_shapes: &BTreeMap<String, Vec<usize>>,
    name: &str,
    shape: &[usize],
) -> Option<(WeightPart, Option<Vec<u8>>)> {
    let (weight, features) = autotp_passes::split_fused::parse_part_name(name)?;
    let weight_shape = model_shapes.get(weight)?.clone();
    let dim = (0..shape.len()).find(|&d| shape[d] != weight_shape[d])?;
    let mut offsets = vec![0; shape.len()];
    offsets[dim] = features.start;
    let bytes = model.weights.get(weight).map(|whole| {
        let size = whole.ty.dtype.size();
        let mut bytes = vec![0u8; shape.iter().product::<usize>() * size];
        autotp_kernels::shape::extract_block(&weight_shape, &offsets, shape, size, whole.bytes(), &mut bytes);
        bytes
    });
    let part = WeightPart { weight: weight.to_string(), dim, start: features.start, weight_shape };
    Some((part, bytes))
}

/// The pipeline's stage graphs, each stage's part in the clipping norm (a parameter two stages
/// hold counts on the first), and the plan's description of the pipeline.
fn cut_pipeline(pipeline: &Pipeline, graph: &Graph) -> Result<(Vec<Graph>, Vec<StageNorm>, PipelineConfig)> {
    let (stages, graphs) = pipeline.run(graph)?;
    tracing::debug!(boundaries = ?stages.boundaries, "pipeline cuts");
    let (p, m, schedule) = (pipeline.stages, pipeline.micro_batches, pipeline.schedule);
    let config = PipelineConfig {
        schedule: schedule.name().to_string(),
        backward: pipeline.backward.name().to_string(),
        stage_flops: stages.flops.clone(),
        in_flight: pipeline.in_flight(),
        bubble_fraction: bubble_fraction(p, m),
        stage_idle: stage_idle_fractions(schedule, pipeline.backward, &stages.chunk_costs, m),
    };
    let norms = (0..p)
        .map(|s| StageNorm {
            stage: s,
            stages: p,
            counted_elsewhere: stages.params[s]
                .iter()
                .filter(|param| stages.params[..s].iter().any(|earlier| earlier.contains(param)))
                .cloned()
                .collect(),
        })
        .collect();
    Ok((graphs, norms, config))
}

/// Prints each weight the tensor-parallel split placed, and why (`--explain-tp`).
fn explain_tp(tp: usize, graph: &Graph, explained: &[autotp_passes::autotp::Explained]) {
    println!("tensor-parallel placement (tp={tp}):");
    for e in explained {
        println!("  {:<50} {:<10} {}", e.weight, e.placement.to_string(), e.reason);
    }
    let split: BTreeSet<&str> = explained.iter().map(|e| e.weight.as_str()).collect();
    for &p in graph.params() {
        let name = graph.name_of(p).unwrap_or("");
        if !split.contains(name) {
            println!("  {name:<50} {:<10} not in a tensor-parallel block", "replicate");
        }
    }
}

/// `1234567` -> `1,234,567`.
pub(crate) fn grouped(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The plan's per-rank report ([`autotp_program::report::report`]), written as JSON to
/// `--report FILE.json` when the flags ask for it.
pub fn report(flags: &CompileFlags, plan: &TrainingPlan) -> Result<autotp_program::report::Report> {
    let report = autotp_program::report::report(plan);
    if let Some(path) = &flags.report {
        let json = serde_json::to_string_pretty(&report)?;
        autotp_program::tensor_file::write_atomic(path, json.as_bytes())?;
    }
    Ok(report)
}

/// The plan in a few lines: step shape, parameters, memory by category (rank 0's `report`; a
/// table by stage with a pipeline), kernels, communication.
pub fn summary(plan: &TrainingPlan, report: &autotp_program::report::Report) -> String {
    let p = &plan.stages[0];
    let rank = &report.ranks[0];
    let t = &plan.training;
    let params: Vec<&autotp_program::Slot> = plan.params().into_iter().map(|(_, slot)| slot).collect();
    let numel = |slots: &[&autotp_program::Slot]| slots.iter().map(|s| s.numel()).sum::<usize>();
    let frozen_slots: Vec<&autotp_program::Slot> =
        params.iter().copied().filter(|s| t.frozen.contains(&s.name)).collect();
    let total = numel(&params);
    let frozen = numel(&frozen_slots);
    let stage_size: usize = p.mesh.iter().map(|a| a.size).product();
    let mut layout = Vec::new();
    if plan.stages.len() > 1 {
        layout.push(format!("pp={}", plan.stages.len()));
    }
    layout.extend(p.mesh.iter().map(|a| format!("{}={}", a.name, a.size)));
    let mut lines = vec![
        format!("plan: {} ({})", plan.model.name, plan.model.path.display()),
        format!(
            "  step: {}micro-batch {} x seq-len {}{} = {} tokens; {}; lr {}{}",
            if layout.is_empty() {
                String::new()
            } else {
                format!("{} ({} ranks), ", layout.join(" x "), stage_size * plan.stages.len())
            },
            t.micro_batch,
            t.seq_len,
            if t.grad_accum > 1 { format!(" x {} micro-batches", t.grad_accum) } else { String::new() },
            t.global_batch * t.seq_len,
            t.optimizer,
            t.schedule,
            t.grad_clip.map(|c| format!("; grad-clip {c}")).unwrap_or_default()
        ),
        format!(
            "  parameters: {} in {} tensors ({} trainable, {} frozen in {} tensors)",
            grouped(total),
            params.len(),
            grouped(total - frozen),
            grouped(frozen),
            frozen_slots.len()
        ),
    ];
    for padding in &t.padding_rows {
        let why = if padding.detected { "its one zero row at import" } else { "--padding-idx" };
        lines.push(format!("  padding row: {} row {} gets no gradient ({why})", padding.table, padding.row));
    }
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    if let Some(pipeline) = &t.pipeline {
        lines.push(format!(
            "  pipeline: {} stages, {} schedule ({} backward) over {} micro-batches; bubble (P-1)/(M+P-1) = {:.1}% \
             of a step",
            plan.stages.len(),
            pipeline.schedule,
            pipeline.backward,
            t.grad_accum,
            100.0 * pipeline.bubble_fraction
        ));
        lines.push(format!(
            "  {:<6} {:>14} {:>7} {:>12} {:>14} {:>16} {:>14} {:>10} {:>14}",
            "stage",
            "forward FLOPs",
            "idle",
            "parameters",
            "optimizer",
            "activations peak",
            "arena",
            "in flight",
            "sent/step"
        ));
        for (s, (program, rank)) in plan.stages.iter().zip(report.ranks.iter().step_by(stage_size)).enumerate() {
            let m = &program.memory;
            lines.push(format!(
                "  {s:<6} {:>14} {:>6.1}% {:>12} {:>14} {:>16} {:>14} {:>10} {:>14}",
                grouped(pipeline.stage_flops.get(s).copied().unwrap_or(0) as usize),
                100.0 * pipeline.planned_idle(s),
                grouped(m.params_bytes),
                grouped(m.states_bytes + m.host_pool_bytes),
                grouped(m.activations_peak_bytes),
                grouped(m.arena_bytes),
                rank.micro_batches_in_flight,
                grouped(rank.comm_bytes_per_step.send)
            ));
        }
        lines.push(
            "  (bytes per rank of each stage; idle: the share of a step the schedule leaves the stage idle, \
             by the cost model)"
                .to_string(),
        );
    } else {
        let m = &p.memory;
        let offloaded_label = match t.nvme {
            Some(_) => "optimizer state offloaded (NVMe file)",
            None => "optimizer state offloaded (host pool)",
        };
        lines.push(format!("  {:<40} {:>15} {:>10}", "memory (per rank)", "bytes", "MiB"));
        for (what, bytes) in [
            ("parameters", m.params_bytes),
            ("optimizer state", m.states_bytes),
            (offloaded_label, m.host_pool_bytes),
            ("gradients (inside activations)", rank.grads_bytes),
            ("activations peak (with gradients)", m.activations_peak_bytes),
            ("inputs", m.inputs_bytes),
            ("constants", m.constants_bytes),
            ("total arena", m.arena_bytes),
        ] {
            lines.push(format!("  {what:<40} {:>15} {:>10.2}", grouped(bytes), mib(bytes)));
        }
    }
    if let Some(r) = &plan.training.recompute {
        lines.extend(recompute_lines(plan, r));
    }
    if let Some(nvme) = &plan.training.nvme {
        lines.extend(nvme_lines(plan, nvme));
    }
    let mut kernels: BTreeMap<String, usize> = BTreeMap::new();
    let instructions = plan.stages.iter().flat_map(|p| p.instructions.iter().map(move |i| (p, i)));
    for (program, instruction) in instructions {
        let name = match instruction {
            autotp_program::Instruction::Kernel { kernel, .. } => kernel.name().to_string(),
            autotp_program::Instruction::Generated { kernel, .. } => format!("gen.{}", program.kernels[*kernel].name),
            autotp_program::Instruction::Collective { op, .. } => op.kind.name().to_string(),
            autotp_program::Instruction::CollectiveStart { op, .. } => format!("{}_start", op.kind.name()),
            autotp_program::Instruction::Wait { .. } => "wait".to_string(),
            autotp_program::Instruction::Send { .. } => "send".to_string(),
            autotp_program::Instruction::Recv { .. } => "recv".to_string(),
            autotp_program::Instruction::OptimizerStep { optimizer, .. } => optimizer.multi_tensor_name(),
        };
        *kernels.entry(name).or_default() += 1;
    }
    let mut by_count: Vec<(String, usize)> = kernels.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let listed: Vec<String> = by_count.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let count: usize = plan.stages.iter().map(|p| p.instructions.len()).sum();
    lines.push(format!("  instructions: {count} ({})", listed.join(", ")));
    if !p.mesh.is_empty() {
        let c = &rank.comm_bytes_per_step;
        lines.push(format!(
            "  communication per rank per step (bytes sent): all-reduce {}, reduce-scatter {}, all-gather {}; staging {}; peak {}",
            grouped(c.all_reduce),
            grouped(c.reduce_scatter),
            grouped(c.all_gather),
            grouped(rank.comm_buffer_bytes),
            grouped(rank.peak_bytes)
        ));
    }
    lines.push(format!("  fingerprint: {}", plan.fingerprint()));
    lines.join("\n") + "\n"
}

/// `--dump-kernels DIR`: `[stageS-]kNNN-<name>.kir` and `.ll` per kernel, `[stageS-]<arch>.ptx`
/// per stage and GPU architecture.
fn dump_kernels(dir: &Path, plan: &autotp_program::plan::TrainingPlan) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("--dump-kernels: cannot create {}", dir.display()))?;
    let write = |name: String, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("--dump-kernels: cannot write {}", path.display()))
    };
    for (s, program) in plan.stages.iter().enumerate() {
        let stage = if plan.stages.len() > 1 { format!("stage{s}-") } else { String::new() };
        for (k, kernel) in program.kernels.iter().enumerate() {
            let name = format!("{stage}k{k:03}-{}", kernel.name);
            write(format!("{name}.kir"), &kernel.to_string())?;
            write(format!("{name}.ll"), &autotp_llvm::cpu::llvm_ir(kernel)?)?;
        }
        for module in &program.ptx {
            write(format!("{stage}{}.ptx", module.arch), &module.code)?;
        }
    }
    Ok(())
}

pub fn run(args: &CompileArgs) -> Result<()> {
    for destination in args.output.iter().chain(&args.flags.report) {
        crate::refuse_overwrite(destination, &args.flags.model, "the model being compiled")?;
    }
    let weights = if args.output.is_some() { Weights::Read } else { Weights::ShapesOnly { layers: None } };
    let compiled = compile_with(&args.flags, weights)?;
    if let Some(dir) = &args.flags.dump_kernels {
        dump_kernels(dir, &compiled.plan)?;
    }
    if let Some(output) = &args.output {
        autotp_program::plan::write(output, &compiled.plan, &compiled.weights())?;
    }
    let report = report(&args.flags, &compiled.plan)?;
    print!("{}", summary(&compiled.plan, &report));
    match &args.output {
        Some(output) => println!("wrote {}", output.display()),
        None => println!("no plan written (no -o): the model's weights were not read"),
    }
    Ok(())
}
