//! The compile flags validated into [`CompileOptions`]: every refusal of a flag, or of a
//! combination of flags, that needs no model is made here, before anything is read, with a
//! message naming the flags. What the validation decides (the optimizer, the learning-rate
//! schedule, the micro-batches, ZeRO's and the pipeline's settings, the loss scaler, the
//! offload files) is kept typed for the compile steps.

use autotp_passes::optimize::Optimizer;
use autotp_passes::pipeline::{PipelineBackward, PipelineSchedule};
use autotp_passes::zero::{Prefetch, ZeroConfig};
use autotp_program::loss_scale::{DeepSpeedScaler, LossScaler, TorchScaler};
use autotp_program::lr_schedule::LrSchedule;
use autotp_program::offload::NvmeOffload;
use autotp_program::param_file::NvmeParams;

use crate::flags::{CompileFlags, Kernels, LossScalerKind, OffloadFlag, Precision, RecomputeFlag};
use crate::{refused, CompileError};

/// A compile's validated settings: the flags as given (the plan records them) and what they
/// decide.
#[derive(Clone)]
pub struct CompileOptions {
    pub flags: CompileFlags,
    pub optimizer: Optimizer,
    /// The optimizer and its hyperparameters, for people (the plan's summary).
    pub optimizer_description: String,
    pub lr_schedule: LrSchedule,
    /// Micro-batches per optimizer step on each rank.
    pub grad_accum: usize,
    /// Sequences per optimizer step, all ranks and micro-batches together.
    pub global_batch: usize,
    pub pipeline_schedule: PipelineSchedule,
    pub pipeline_backward: PipelineBackward,
    pub zero: ZeroConfig,
    /// fp16's loss scaler in its initial state.
    pub loss_scaler: Option<LossScaler>,
    pub nvme: Option<NvmeOffload>,
    pub nvme_params: Option<NvmeParams>,
}

impl CompileOptions {
    /// Validates `flags` (see the module docs).
    pub fn from_flags(flags: &CompileFlags) -> Result<CompileOptions, CompileError> {
        let (optimizer, optimizer_description) = optimizer(flags)?;
        let lr_schedule = lr_schedule(flags)?;
        if flags.seq_len == 0
            || flags.micro_batch == 0
            || flags.dp == 0
            || flags.cp == 0
            || flags.ep == 0
            || flags.tp == 0
            || flags.pp == 0
            || flags.grad_accum == Some(0)
        {
            refuse!("--seq-len, --micro-batch, --grad-accum, --dp, --cp, --ep, --tp and --pp must be at least 1");
        }
        expert_parallel(flags)?;
        let grad_accum = grad_accum(flags)?;
        let pipeline_schedule = PipelineSchedule::parse(&flags.schedule)
            .ok_or_else(|| refused(format!("--schedule '{}' is not one of 1f1b, gpipe, zb-h1", flags.schedule)))?;
        let zero_bubble = pipeline_schedule == PipelineSchedule::ZeroBubbleH1;
        let pipeline_backward = match &flags.pp_backward {
            None if zero_bubble => PipelineBackward::Split,
            None => PipelineBackward::Whole,
            Some(name) => PipelineBackward::parse(name)
                .ok_or_else(|| refused(format!("--pp-backward '{name}' is not one of split, whole")))?,
        };
        if zero_bubble && pipeline_backward == PipelineBackward::Whole {
            refuse!("--schedule zb-h1 runs the weights' gradients apart from the input's: --pp-backward whole contradicts it");
        }
        if flags.pp == 1
            && (!flags.pp_cuts.is_empty()
                || pipeline_schedule != PipelineSchedule::OneFOneB
                || pipeline_backward != PipelineBackward::Whole
                || flags.virtual_stages != 1)
        {
            refuse!(
                "--pp-cuts, --schedule, --pp-backward and --virtual-stages place pipeline stages: they need --pp 2 or \
                 more"
            );
        }
        if flags.explain_tp && flags.tp < 2 {
            refuse!("--explain-tp needs --tp 2 or more");
        }
        if flags.sequence_parallel && flags.tp < 2 {
            refuse!("--sequence-parallel splits tensor parallelism's hidden states by tokens: it needs --tp 2 or more");
        }
        if flags.sequence_parallel && !flags.seq_len.is_multiple_of(flags.tp) {
            refuse!(
                "--sequence-parallel splits each sequence's {} tokens over --tp {}: they must divide",
                flags.seq_len,
                flags.tp
            );
        }
        if !["all_gather", "p2p", "a2a"].contains(&flags.cp_comm_type.as_str()) {
            refuse!("--cp-comm-type '{}' is not one of all_gather, p2p, a2a", flags.cp_comm_type);
        }
        if flags.cp_comm_type == "a2a" && flags.tp > 1 {
            refuse!(
                "--cp-comm-type a2a splits attention's heads over cp: with --tp, which splits them too, use all_gather"
            );
        }
        if flags.cp > 1 {
            if !flags.seq_len.is_multiple_of(flags.cp) {
                refuse!("--cp {} splits each sequence's {} tokens: they must divide", flags.cp, flags.seq_len);
            }
            // A micro-batch of several sequences is flattened to rows of tokens (the loss,
            // projections' weight gradients), whose rows of one rank are then not one block.
            if flags.micro_batch > 1 {
                refuse!(
                    "--cp {} splits one sequence at a time over its ranks (a micro-batch of 1, as Megatron runs \
                     context parallelism), not --micro-batch {}: give --micro-batch 1 and more sequences per step \
                     with --grad-accum or --global-batch",
                    flags.cp,
                    flags.micro_batch
                );
            }
            if flags.sequence_parallel {
                refuse!(
                    "--sequence-parallel and --cp both split a sequence's tokens (over tp and over cp): autotp \
                     splits them over one of the two"
                );
            }
        }
        if let (Some(k), false) = (flags.recompute_layers, flags.recompute == RecomputeFlag::Full) {
            refuse!(
                "--recompute-layers {k} chooses the layers of --recompute full, not --recompute {}",
                flags.recompute.name()
            );
        }
        if flags.zero > 3 {
            refuse!("--zero {} is not a ZeRO stage (0, 1, 2 or 3)", flags.zero);
        }
        let stage3 = [
            ("--param-persistence-threshold", flags.param_persistence_threshold > 0),
            ("--prefetch-bucket-size", flags.prefetch_bucket_size.is_some()),
            ("--max-live-params", flags.max_live_params.is_some()),
        ];
        if let Some((flag, _)) = stage3.iter().find(|(_, given)| *given && flags.zero != 3) {
            refuse!("{flag} applies to --zero 3");
        }
        let defaults = Prefetch::default();
        let mut prefetch = Prefetch {
            bucket_elements: flags.prefetch_bucket_size.unwrap_or(defaults.bucket_elements),
            max_live_elements: flags.max_live_params.unwrap_or(defaults.max_live_elements),
            max_in_flight: defaults.max_in_flight,
        };
        if flags.comm_dtype.is_some() && flags.dp < 2 {
            refuse!("--comm-dtype is the type of data-parallel gradient reductions: it needs --dp 2 or more");
        }
        if flags.reduce_bucket_size.is_some() && flags.dp < 2 {
            refuse!("--reduce-bucket-size buckets data-parallel gradient reductions: it needs --dp 2 or more");
        }
        let nvme_params = nvme_params(flags)?;
        if let Some(nvme_params) = &nvme_params {
            prefetch.max_in_flight = nvme_params.buffer_count;
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
            refuse!("--zero {} shards over data-parallel ranks: it needs --dp 2 or more", flags.zero);
        }
        let nvme = nvme_offload(flags)?;
        match flags.offload_param {
            OffloadFlag::None => {}
            offload if flags.zero != 3 => refuse!(
                "--offload-param {} offloads ZeRO-3's parameter shards: it needs --zero 3 (and --dp 2 or more), as \
                 DeepSpeed's offload_param does",
                offload.name()
            ),
            OffloadFlag::Nvme if flags.offload_optimizer == OffloadFlag::Nvme => refuse!(
                "--offload-param nvme with --offload-optimizer nvme: the optimizer's files would hold the \
                 parameters' too, which autotp does not do yet; keep one of them in host memory (cpu)"
            ),
            OffloadFlag::Cpu | OffloadFlag::Nvme => {}
        }
        let mixed = flags.precision != Precision::F32;
        if mixed && flags.no_finite_check {
            refuse!(
                "--no-finite-check with --precision {}: a 16-bit step always checks its gradients, to skip those \
                 that overflow",
                flags.precision.name()
            );
        }
        if !mixed && flags.grad_accum_dtype.is_some() {
            refuse!("--grad-accum-dtype applies to --precision bf16 or fp16 (f32 gradients are accumulated in f32)");
        }
        if flags.recompute == RecomputeFlag::Auto && flags.memory_cap.is_none() {
            refuse!("--recompute auto chooses by --memory-cap, which is missing");
        }
        Ok(CompileOptions {
            flags: flags.clone(),
            optimizer,
            optimizer_description,
            lr_schedule,
            grad_accum,
            global_batch: flags.micro_batch * flags.dp * grad_accum,
            pipeline_schedule,
            pipeline_backward,
            zero,
            loss_scaler: loss_scaler(flags)?,
            nvme,
            nvme_params,
        })
    }

    /// Whether context parallelism tries Megatron's load balance (all_gather or p2p attention,
    /// unless `--cp-contiguous`).
    pub fn cp_load_balance(&self) -> bool {
        let f = &self.flags;
        f.cp > 1 && f.cp_comm_type != "a2a" && !f.cp_contiguous
    }

    /// Whether context parallelism computes attention around a ring (`--cp-comm-type p2p`).
    pub fn cp_ring(&self) -> bool {
        self.flags.cp > 1 && self.flags.cp_comm_type == "p2p"
    }

    /// Whether the step computes in 16 bits (`--precision bf16|fp16`).
    pub fn mixed_precision(&self) -> bool {
        self.flags.precision != Precision::F32
    }

    /// The type gradients are accumulated and reduced in under mixed precision.
    pub fn grad_accum_dtype(&self) -> Option<autotp_ir::DType> {
        self.mixed_precision().then(|| self.flags.grad_accum_dtype.unwrap_or(Precision::F32).dtype())
    }

    /// Which kernels compute the ops.
    pub fn kernels(&self) -> autotp_codegen::KernelChoice {
        match self.flags.kernels {
            Kernels::Generated => autotp_codegen::KernelChoice::Generated,
            Kernels::Builtin => autotp_codegen::KernelChoice::Builtin,
        }
    }
}

/// Where the plan keeps its optimizer state in files (`--offload-optimizer nvme`), checked
/// against the flags that only it takes.
fn nvme_offload(flags: &CompileFlags) -> Result<Option<NvmeOffload>, CompileError> {
    if flags.offload_optimizer != OffloadFlag::Nvme {
        if flags.sub_group_size.is_some() {
            refuse!("--sub-group-size applies to --offload-optimizer nvme");
        }
        if flags.offload_param != OffloadFlag::Nvme {
            let given = [("--nvme-path", flags.nvme_path.is_some()), ("--buffer-count", flags.buffer_count.is_some())];
            if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
                refuse!("{flag} applies to --offload-optimizer nvme or --offload-param nvme");
            }
        }
        return Ok(None);
    }
    if flags.kernels != Kernels::Generated {
        refuse!("--offload-optimizer nvme streams the state through the generated multi-tensor step: it needs --kernels generated");
    }
    let path = flags.nvme_path.as_ref().ok_or_else(|| {
        refused("--offload-optimizer nvme keeps the optimizer state in files under --nvme-path DIR, which is missing")
    })?;
    Ok(Some(NvmeOffload {
        path: std::path::absolute(path).map_err(|e| refused(format!("--nvme-path {}: {e}", path.display())))?,
        tile_elements: flags.sub_group_size.map_or(autotp_program::offload::DEFAULT_TILE_ELEMENTS, |n| n as usize),
        buffer_count: flags.buffer_count.map_or(autotp_program::offload::DEFAULT_BUFFER_COUNT, |n| n as usize),
    }))
}

/// Where the plan keeps parameter shards in files (`--offload-param nvme`), checked against
/// the flags that only it takes.
fn nvme_params(flags: &CompileFlags) -> Result<Option<NvmeParams>, CompileError> {
    use autotp_program::param_file::{DEFAULT_BUFFER_COUNT, DEFAULT_BUFFER_SIZE, DEFAULT_MAX_IN_CPU};
    if flags.offload_param != OffloadFlag::Nvme {
        let given = [("--buffer-size", flags.buffer_size.is_some()), ("--max-in-cpu", flags.max_in_cpu.is_some())];
        if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
            refuse!("{flag} applies to --offload-param nvme");
        }
        return Ok(None);
    }
    let path = flags.nvme_path.as_ref().ok_or_else(|| {
        refused("--offload-param nvme keeps parameter shards in files under --nvme-path DIR, which is missing")
    })?;
    Ok(Some(NvmeParams {
        path: std::path::absolute(path).map_err(|e| refused(format!("--nvme-path {}: {e}", path.display())))?,
        buffer_count: flags.buffer_count.map_or(DEFAULT_BUFFER_COUNT, |n| n as usize),
        buffer_size: flags.buffer_size.map_or(DEFAULT_BUFFER_SIZE, |n| n as usize),
        max_in_cpu: flags.max_in_cpu.map_or(DEFAULT_MAX_IN_CPU, |n| n as usize),
    }))
}

/// The loss scaler of an fp16 plan, in its initial state; `None` for other precisions (which
/// refuse the loss-scaling flags).
fn loss_scaler(flags: &CompileFlags) -> Result<Option<LossScaler>, CompileError> {
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
            refuse!("{flag} applies to --precision fp16 (only fp16 scales the loss)");
        }
        return Ok(None);
    }
    if !(flags.loss_scale >= 0.0 && flags.loss_scale.is_finite()) {
        refuse!("--loss-scale {} must be a finite number, 0 for dynamic scaling", flags.loss_scale);
    }
    if flags.loss_scale > 0.0 {
        return Ok(Some(LossScaler::Static { scale: flags.loss_scale }));
    }
    if flags.loss_scale_window == Some(0) || flags.hysteresis == 0 || flags.initial_scale_power > 120 {
        refuse!("--loss-scale-window and --hysteresis must be at least 1, --initial-scale-power at most 120");
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

/// `flag`'s `value` if it is a finite number of at least 0, as `torch.optim` requires of a
/// learning rate, eps, weight decay and momentum.
fn non_negative(flag: &str, value: f64) -> Result<f64, CompileError> {
    if !(value.is_finite() && value >= 0.0) {
        refuse!("{flag} {value} is invalid: it must be a finite number of at least 0");
    }
    Ok(value)
}

fn optimizer(flags: &CompileFlags) -> Result<(Optimizer, String), CompileError> {
    non_negative("--lr", flags.lr)?;
    non_negative("--weight-decay", flags.weight_decay)?;
    if let Some(clip) = flags.grad_clip {
        if !(clip.is_finite() && clip > 0.0) {
            refuse!("--grad-clip {clip} is invalid: it must be a finite norm above 0 (leave it out not to clip)");
        }
    }
    Ok(match flags.optimizer.as_str() {
        "adamw" => {
            let betas: Vec<f64> = flags
                .betas
                .split(',')
                .map(|b| b.trim().parse::<f64>())
                .collect::<Result<_, _>>()
                .map_err(|e| refused(format!("--betas '{}' must be B1,B2: {e}", flags.betas)))?;
            let [beta1, beta2] = betas[..] else { refuse!("--betas '{}' must be two numbers, B1,B2", flags.betas) };
            if !betas.iter().all(|b| (0.0..1.0).contains(b)) {
                refuse!("--betas {beta1},{beta2} is invalid: each must be at least 0 and below 1");
            }
            let (eps, weight_decay) = (non_negative("--eps", flags.eps)?, flags.weight_decay);
            let description = format!("adamw(betas={beta1},{beta2} eps={eps:e} weight_decay={weight_decay})");
            (Optimizer::AdamW { beta1, beta2, eps, weight_decay }, description)
        }
        "sgd" => {
            let (momentum, weight_decay, nesterov) =
                (non_negative("--momentum", flags.momentum)?, flags.weight_decay, flags.nesterov);
            if nesterov && momentum == 0.0 {
                refuse!("--nesterov needs a --momentum above 0");
            }
            let description = format!("sgd(momentum={momentum} nesterov={nesterov} weight_decay={weight_decay})");
            (Optimizer::Sgd { momentum, weight_decay, nesterov }, description)
        }
        other => refuse!("--optimizer '{other}' is not one of adamw, sgd"),
    })
}

fn lr_schedule(flags: &CompileFlags) -> Result<LrSchedule, CompileError> {
    let kind = flags.lr_schedule.as_str();
    let deepspeed = matches!(kind, "warmup" | "warmup-decay" | "warmup-cosine");
    let given = [
        ("--warmup-min-lr", flags.warmup_min_lr.is_some(), matches!(kind, "warmup" | "warmup-decay")),
        ("--warmup-type", flags.warmup_type.is_some(), deepspeed),
        ("--warmup-min-ratio", flags.warmup_min_ratio.is_some(), kind == "warmup-cosine"),
        ("--cos-min-ratio", flags.cos_min_ratio.is_some(), kind == "warmup-cosine"),
    ];
    if let Some((flag, ..)) = given.iter().find(|(_, given, applies)| *given && !applies) {
        refuse!("{flag} does not apply to --lr-schedule {kind}");
    }
    non_negative("--min-lr", flags.min_lr)?;
    let ratios = [("--warmup-min-ratio", flags.warmup_min_ratio), ("--cos-min-ratio", flags.cos_min_ratio)];
    for (flag, value) in [("--warmup-min-lr", flags.warmup_min_lr)].into_iter().chain(ratios) {
        value.map(|v| non_negative(flag, v)).transpose()?;
    }
    let log_warmup = match flags.warmup_type.as_deref() {
        None | Some("log") => true,
        Some("linear") => false,
        Some(other) => refuse!("--warmup-type '{other}' is not one of log, linear"),
    };
    let total_steps = || {
        flags
            .lr_decay_steps
            .ok_or_else(|| refused(format!("--lr-schedule {kind} decays to --lr-decay-steps, which is missing")))
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
        other => refuse!("--lr-schedule '{other}' is not one of constant, cosine, warmup, warmup-decay, warmup-cosine"),
    })
}

/// Micro-batches per step: `--grad-accum`, or what `--global-batch` implies; contradictory or
/// indivisible batch flags are refused.
fn grad_accum(flags: &CompileFlags) -> Result<usize, CompileError> {
    let per_micro_batch = flags.micro_batch * flags.dp;
    let Some(global) = flags.global_batch else { return Ok(flags.grad_accum.unwrap_or(1)) };
    let parts = format!("micro-batch {} x dp {} = {per_micro_batch}", flags.micro_batch, flags.dp);
    if global == 0 || global % per_micro_batch != 0 {
        refuse!("--global-batch {global} is not a multiple of {parts} sequences per micro-batch");
    }
    let implied = global / per_micro_batch;
    match flags.grad_accum {
        Some(a) if a != implied => refuse!(
            "--global-batch {global} contradicts --grad-accum {a}: {parts} sequences per micro-batch \
             x {a} micro-batches is {}",
            per_micro_batch * a
        ),
        _ => Ok(implied),
    }
}

/// Refuses the `--ep` layouts autotp does not build: expert parallelism splits the experts
/// over groups of the data-parallel ranks, so `--ep` must divide `--dp`.
fn expert_parallel(flags: &CompileFlags) -> Result<(), CompileError> {
    if flags.ep > 1 && !flags.dp.is_multiple_of(flags.ep) {
        refuse!(
            "--ep {} splits the experts over groups of {} data-parallel ranks: it must divide --dp {} \
             (Megatron's expert-data-parallel size is --dp / --ep)",
            flags.ep,
            flags.ep,
            flags.dp
        );
    }
    if flags.moe_pad_expert_input_to_capacity && flags.moe_expert_capacity_factor.is_none() {
        refuse!(
            "--moe-pad-expert-input-to-capacity pads each expert's pairs to its capacity: it needs \
             --moe-expert-capacity-factor, as Megatron's does"
        );
    }
    if let Some(factor) = flags.moe_expert_capacity_factor {
        if let Some(why) = autotp_passes::expert_dispatch::ExpertCapacity::factor_refused(factor) {
            refuse!("{why}");
        }
        if flags.cp > 1 {
            refuse!(
                "--moe-expert-capacity-factor counts each sequence's pairs per expert, and --cp {} splits each \
                 sequence over ranks: give one of them",
                flags.cp
            );
        }
    }
    Ok(())
}
