//! The compile command's flags as the user gives them ([`CompileFlags`], parsed by clap in the
//! CLI, read from a plan that recorded them, or written by the layout search as a command line),
//! and the small parsers they share. [`crate::CompileOptions`] validates them.

use std::path::PathBuf;

use clap::Args;

use crate::CompileError;

/// What to compile and how: shared by `compile` and `train`. The plan records them (less the
/// inspection flags), so `verify` can compile the same model for one device.
#[derive(Args, Clone, serde::Serialize, serde::Deserialize)]
pub struct CompileFlags {
    /// The ONNX model.
    pub model: PathBuf,
    /// Tokens per sequence (S). Megatron's name, --seq-length, is taken too (as are its
    /// --micro-batch-size, --global-batch-size, --tensor-model-parallel-size,
    /// --pipeline-model-parallel-size and --virtual-pipeline-model-parallel-size).
    #[arg(long, visible_alias = "seq-length")]
    pub seq_len: usize,
    /// Sequences per rank per forward pass; the global batch is micro-batch x grad-accum x dp.
    #[arg(long, visible_alias = "micro-batch-size")]
    pub micro_batch: usize,
    /// Micro-batches per optimizer step (gradient accumulation): each rank runs the forward and
    /// backward this many times per step, summing gradients, and reduces them once [default: 1,
    /// or what --global-batch implies]
    #[arg(long)]
    pub grad_accum: Option<usize>,
    /// Sequences per optimizer step, all ranks and micro-batches together (DeepSpeed's
    /// train_batch_size): sets --grad-accum to global-batch / (micro-batch x dp)
    #[arg(long, visible_alias = "global-batch-size")]
    pub global_batch: Option<usize>,
    /// Megatron's sequence parallelism with --tp: the hidden states between the blocks (the
    /// residual stream, norms, elementwise ops) are split over the tp ranks by tokens; each
    /// all-reduce of a block's output becomes a reduce-scatter, and an all-gather precedes the
    /// column-parallel GEMMs. Needs --tp 2 or more and --seq-len divisible by it.
    #[arg(long)]
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Data-parallel ranks (CPU threads): the batch is split over them and gradients are
    /// all-reduced (ZeRO stage 0).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Context-parallel ranks (Megatron's --context-parallel-size): each sequence is split over
    /// them, every op runs on its rank's tokens, and attention computes its rank's queries over
    /// keys and values all-gathered from the others (their gradients reduce-scattered back).
    /// Weight gradients are summed over them as over dp. World size is pp x dp x cp x tp.
    /// Needs --seq-len divisible by it.
    #[arg(long, visible_alias = "context-parallel-size", default_value_t = 1)]
    #[serde(default = "one")]
    pub cp: usize,
    /// How --cp's attention meets the other ranks' tokens (Megatron's --cp-comm-type):
    /// all_gather (each rank's queries over the keys and values all-gathered), p2p (a ring:
    /// the keys and values passed from rank to rank a block at a time, so that a rank holds
    /// two blocks of them rather than all; the exchange overlaps the rounds' attention) or a2a
    /// (DeepSpeed-Ulysses: the queries, keys and values exchanged all-to-all so that each rank
    /// attends over the whole sequence for 1/cp of the heads, whose causal work is then even;
    /// needs heads cp divides, and no --tp).
    #[arg(long, default_value = "all_gather")]
    #[serde(default = "all_gather")]
    pub cp_comm_type: String,
    /// Keeps each --cp rank's tokens one contiguous block of the sequence. By default
    /// all_gather's and p2p's ranks hold Megatron's load balance instead: the sequence in 2 x cp chunks,
    /// rank r holding chunks r and 2cp-1-r, so that causal attention gives each the same work
    /// (the trainer feeds the tokens in that order; needs --seq-len divisible by 2 x cp).
    #[arg(long)]
    #[serde(default)]
    pub cp_contiguous: bool,
    /// Expert-parallel ranks for a mixture of experts (Megatron's
    /// --expert-model-parallel-size): each holds 1/ep of every layer's experts, and each
    /// (token, choice) pair is sent by all-to-all to the rank of its expert and back,
    /// dropless. The ranks are data-parallel for the rest of the model: needs --dp equal to it
    /// (combines with --tp, whose ranks split each expert, --pp and ZeRO).
    #[arg(long, visible_alias = "expert-model-parallel-size", default_value_t = 1)]
    #[serde(default = "one")]
    pub ep: usize,
    /// Bounds each expert's pairs, as Megatron's --moe-expert-capacity-factor does: of each
    /// sequence's S x k (token, choice) pairs an expert takes at most ceil(F x S x k / E), the
    /// first in token order (Megatron's `position` drop policy); the pairs past it are dropped
    /// (their expert's result is zero). The all-to-alls and the experts' buffers shrink from
    /// room for every pair a rank holds (dropless, the default) to the capacity: ep / F times
    /// less. Counted per sequence, one device drops the same pairs as every layout (Megatron
    /// counts a rank's micro-batch). Not with --cp, which splits sequences.
    #[arg(long, value_name = "F")]
    #[serde(default)]
    pub moe_expert_capacity_factor: Option<f64>,
    /// Which pairs a capacity drops: `position`, each expert's last in token order (DeepSpeed's
    /// and Megatron's `position`), or `probs`, those of the smallest routing weights (Megatron's
    /// `probs`, its default: the weights the router multiplies the experts' results by; equal
    /// weights keep token order).
    #[arg(long, value_enum, default_value = "position")]
    #[serde(default)]
    pub moe_token_drop_policy: TokenDropPolicy,
    /// Megatron's --moe-pad-expert-input-to-capacity, accepted beside a capacity: autotp's
    /// experts always take their whole room (static shapes).
    #[arg(long, hide = true)]
    #[serde(default)]
    pub moe_pad_expert_input_to_capacity: bool,
    /// Megatron's --moe-token-dispatcher-type, accepted as `alltoall`: the dispatch autotp has.
    #[arg(long, hide = true, value_parser = ["alltoall"])]
    #[serde(skip)]
    pub moe_token_dispatcher_type: Option<String>,
    /// Tensor-parallel ranks: each block's weights are split Megatron-style (found from the
    /// dataflow); world size is dp x tp.
    #[arg(long, visible_alias = "tensor-model-parallel-size", default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages: the model is cut into this many stages (the slowest as fast as it can
    /// be, then the fullest as small; or at --pp-cuts), each run by its own ranks; the step's
    /// --grad-accum micro-batches flow through them. World size is pp x dp x tp.
    #[arg(long, visible_alias = "pipeline-model-parallel-size", default_value_t = 1)]
    pub pp: usize,
    /// Model chunks per pipeline rank (Megatron's virtual pipeline stages): the model is cut
    /// into pp x V chunks and rank r holds chunks r, r + pp, ...; the interleaved 1F1B
    /// schedule runs them, and the bubble falls to (pp-1)/(V x M) of the ideal step. Needs
    /// --schedule 1f1b and --grad-accum a multiple of --pp.
    #[arg(long, visible_alias = "virtual-pipeline-model-parallel-size", value_name = "V", default_value_t = 1)]
    #[serde(default = "one")]
    pub virtual_stages: usize,
    /// The pipeline schedule: 1f1b (one forward, one backward: at most pp micro-batches in
    /// flight; interleaved with --virtual-stages), gpipe (all forwards, then all backwards) or
    /// zb-h1 (zero-bubble H1: the weights' gradients apart from the input's, deferred to fill
    /// the bubble; pp micro-batches in flight on every stage; needs --pp-backward split).
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// When a pipeline stage's backward sends its input's gradient to the stage before: whole
    /// (after the whole backward, as Megatron and DeepSpeed do: the textbook 1F1B and GPipe) or
    /// split (as soon as it is made, then the weights' gradients: a shorter bubble, but the
    /// output's gradient is held longer). Default: whole, split under --schedule zb-h1.
    #[arg(long)]
    pub pp_backward: Option<String>,
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
    /// With --zero 3, elements of gathered parameters alive at once beyond which nothing is
    /// gathered ahead of its use (a parameter is gathered at its use whatever its size) [default:
    /// 1e9].
    #[arg(long, value_name = "ELEMENTS")]
    pub max_live_params: Option<usize>,
    /// Print each weight the tensor-parallel split places, and why.
    #[arg(long)]
    pub explain_tp: bool,
    /// Keep the blocks whose split does not hold (a state-space mixer's unequal projection,
    /// heads tp does not divide) replicated, each rank computing them whole, as DeepSpeed
    /// AutoTP leaves the layers it does not know, instead of refusing the layout;
    /// --explain-tp names their weights and why.
    #[arg(long)]
    #[serde(default)]
    pub tp_replicate_unsplittable: bool,
    /// Copy the initial weights into the plan, a self-contained file to ship, instead of naming
    /// them where the model keeps them (its file, its external data) with each file's size and
    /// checksum.
    #[arg(long)]
    #[serde(default)]
    pub embed_weights: bool,
    /// adamw or sgd.
    #[arg(long, default_value = "adamw")]
    pub optimizer: String,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// constant; cosine (linear warmup over --warmup-steps, then cosine decay to --min-lr, as
    /// Hugging Face's get_cosine_schedule_with_warmup); or DeepSpeed's schedulers, step for
    /// step: warmup (WarmupLR: --warmup-min-lr to --lr over --warmup-steps, --warmup-type log
    /// or linear), warmup-decay (WarmupDecayLR: then linearly to 0 at --lr-decay-steps),
    /// warmup-cosine (WarmupCosineLR: --warmup-min-ratio to 1 of --lr, then a cosine to
    /// --cos-min-ratio at --lr-decay-steps).
    #[arg(long, default_value = "constant")]
    pub lr_schedule: String,
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: usize,
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f64,
    /// The step at which the decay ends (default for cosine: the run's --steps; DeepSpeed's
    /// total_num_steps).
    #[arg(long)]
    pub lr_decay_steps: Option<usize>,
    /// DeepSpeed's warmup_min_lr (warmup, warmup-decay) [default: 0].
    #[arg(long)]
    #[serde(default)]
    pub warmup_min_lr: Option<f64>,
    /// DeepSpeed's warmup_type: log or linear (warmup, warmup-decay, warmup-cosine) [default: log].
    #[arg(long)]
    #[serde(default)]
    pub warmup_type: Option<String>,
    /// DeepSpeed's warmup_min_ratio (warmup-cosine) [default: 0].
    #[arg(long)]
    #[serde(default)]
    pub warmup_min_ratio: Option<f64>,
    /// DeepSpeed's cos_min_ratio (warmup-cosine) [default: 0.0001].
    #[arg(long)]
    #[serde(default)]
    pub cos_min_ratio: Option<f64>,
    /// AdamW betas: B1,B2.
    #[arg(long, default_value = "0.9,0.999")]
    pub betas: String,
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f64,
    #[arg(long)]
    pub nesterov: bool,
    /// Clip gradients to this global L2 norm.
    #[arg(long)]
    pub grad_clip: Option<f64>,
    /// Do not check an f32 step's gradients. By default every step checks them (whether their
    /// sum is finite, DeepSpeed's overflow test, inside the optimizer's own step) and keeps the
    /// parameters and optimizer states as they were when one is not; `run --nan-policy` then
    /// ends the run naming the parameter and the op that made the first inf or NaN, or skips
    /// the step. Without the check a non-finite loss still stops the run, its update applied.
    /// bf16 and fp16 steps always check.
    #[arg(long, conflicts_with = "finite_check")]
    #[serde(default)]
    pub no_finite_check: bool,
    /// The default since 2026-11-29 (see --no-finite-check); accepted for the scripts that
    /// give it.
    #[arg(long, hide = true)]
    #[serde(default)]
    pub finite_check: bool,
    /// Do not train the parameters whose (ONNX initializer) name this regular expression matches
    /// anywhere; anchor it with ^...$ for whole names. Repeatable.
    #[arg(long, value_name = "REGEX")]
    pub freeze: Vec<String>,
    /// An embedding table's padding row, which gets no gradient (PyTorch's
    /// `nn.Embedding(padding_idx)`, which ONNX exports drop; a tied LM head still trains the
    /// row): N or none for every table (a parameter read by gathers), TABLE=N or TABLE=none
    /// for one. Default: the rows the model's metadata records (`autotp.padding_idx`, the same
    /// spellings comma-separated), else the one row of zeros at import of a table not tied to
    /// the LM head. Repeatable; overrides the metadata.
    #[arg(long, value_name = "N|none|TABLE=N")]
    pub padding_idx: Vec<String>,
    /// Write the IR before the passes and after each one: DIR/00-import.ir, DIR/01-recognize.ir...
    #[arg(long, value_name = "DIR")]
    pub dump_ir: Option<PathBuf>,
    /// Print the IR after this pass (every time it runs). Repeatable.
    #[arg(long, value_name = "PASS")]
    pub print_after: Vec<String>,
    /// Write the per-rank memory and per-step communication plan as JSON.
    #[arg(long, value_name = "FILE.json")]
    pub report: Option<PathBuf>,
    /// Write every generated kernel's kernel IR (.kir) and optimised LLVM IR for this machine
    /// (.ll), and each stage's PTX module per GPU architecture (.ptx), into DIR.
    #[arg(long, value_name = "DIR")]
    pub dump_kernels: Option<PathBuf>,
    /// Which kernels run the ops: generated (LLVM, where a generated kernel computes the op)
    /// or builtin (the reference interpreter alone: the oracle to bisect a divergence against).
    #[arg(long, value_enum, default_value = "generated")]
    pub kernels: Kernels,
    /// How attention runs: `fused` computes each attention the compile finds in the model
    /// (q k^T, scale, causal/sliding-window/additive masks, softmax, @ v) as one op that never
    /// stores the scores (FlashAttention-2's algorithm: activations linear in the sequence);
    /// `unfused` keeps the exported matmuls and softmax.
    #[arg(long, value_enum, default_value = "fused")]
    #[serde(default)]
    pub attention: AttentionFlag,
    /// A mixture of experts' per-pair products run as grouped GEMMs (the default, Megatron's
    /// --moe-grouped-gemm): one per expert over the pairs routed to it, its weights read where
    /// they lie and the padding pairs skipped. `--no-moe-grouped-gemm` keeps the export's form:
    /// a weight matrix gathered per pair and batched matrix-vector products.
    #[arg(long = "no-moe-grouped-gemm", action = clap::ArgAction::SetFalse, overrides_with = "moe_grouped_gemm_spelled")]
    #[serde(default = "yes")]
    pub moe_grouped_gemm: bool,
    /// Megatron's `--moe-grouped-gemm`, accepted: it names the default.
    #[arg(long = "moe-grouped-gemm", hide = true, overrides_with = "moe_grouped_gemm")]
    #[serde(skip)]
    pub moe_grouped_gemm_spelled: bool,
    /// The parameters' and activations' type: f32 (the model's own: an f64 export trains in
    /// f64), or bf16/fp16 mixed precision of an f32 model (16-bit weights and activations, CUDA
    /// autocast's f32 ops, f32 master weights and moments in the optimizer, as DeepSpeed's
    /// bf16/fp16 modes).
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
    /// Where ZeRO-3's parameter shards live (DeepSpeed's offload_param): in the arena (none), in
    /// host memory outside it (cpu), read by their gathers and updated there, so the arena
    /// holds only the gathered parameters in flight, or in files under --nvme-path (nvme), each
    /// shard fetched ahead of its uses and released after, at most --buffer-count in memory;
    /// needs --zero 3. GPU ranks upload host memory's shards before their gathers and update
    /// them in the host's optimizer step; nvme is CPU ranks only so far (a GPU plan refuses it
    /// at load).
    #[arg(long, value_enum, default_value = "none")]
    #[serde(default)]
    pub offload_param: OffloadFlag,
    /// A DeepSpeed configuration (ds_config.json) whose keys become these flags: batch sizes,
    /// gradient_clipping, optimizer, fp16/bf16, communication_data_type, zero_optimization
    /// (stage, buckets, offload_optimizer, offload_param), activation_checkpointing (--recompute full),
    /// tensor_parallel.autotp_size, pipeline.stages. A flag given too must agree; keys autotp
    /// does not implement are listed in a warning.
    #[arg(long, value_name = "ds_config.json")]
    #[serde(default)]
    pub deepspeed: Option<PathBuf>,
    /// With --offload-optimizer nvme or --offload-param nvme: the directory of the optimizer
    /// state's or the parameters' files, one per rank, removed when the run ends (`autotp run
    /// --nvme-path` may name another).
    #[arg(long, value_name = "DIR")]
    #[serde(default)]
    pub nvme_path: Option<PathBuf>,
    /// With --offload-optimizer nvme: parameter elements per tile of optimizer state streamed
    /// through the step (DeepSpeed's sub_group_size) [default: 1e9].
    #[arg(long, value_name = "ELEMENTS", value_parser = parse_count)]
    #[serde(default)]
    pub sub_group_size: Option<u64>,
    /// With --offload-optimizer nvme: tiles in memory at once, so that reading the next,
    /// updating one and writing the last overlap [default: 4]; with --offload-param nvme:
    /// parameter shards in memory at once, fetched ahead of their uses [default: 5]
    /// (DeepSpeed's buffer_count).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    #[serde(default)]
    pub buffer_count: Option<u64>,
    /// With --offload-param nvme: the most elements of one rank's shard of a parameter
    /// (DeepSpeed's buffer_size) [default: 1e8].
    #[arg(long, value_name = "ELEMENTS", value_parser = parse_count)]
    #[serde(default)]
    pub buffer_size: Option<u64>,
    /// With --offload-param nvme: parameter elements each rank keeps in host memory instead,
    /// the first in parameter order (DeepSpeed's max_in_cpu) [default: 1e9].
    #[arg(long, value_name = "ELEMENTS", value_parser = parse_count_or_zero)]
    #[serde(default)]
    pub max_in_cpu: Option<u64>,
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

impl RecomputeFlag {
    /// The value as the user spells it.
    pub fn name(self) -> &'static str {
        match self {
            RecomputeFlag::None => "none",
            RecomputeFlag::Elementwise => "elementwise",
            RecomputeFlag::Selective => "selective",
            RecomputeFlag::Full => "full",
            RecomputeFlag::Auto => "auto",
        }
    }
}

/// `--offload-optimizer`, `--offload-param`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum OffloadFlag {
    #[default]
    None,
    Cpu,
    Nvme,
}

impl OffloadFlag {
    /// The value as the user spells it.
    pub fn name(self) -> &'static str {
        match self {
            OffloadFlag::None => "none",
            OffloadFlag::Cpu => "cpu",
            OffloadFlag::Nvme => "nvme",
        }
    }
}

/// A count as flags take it: an integer, or a decimal that is one (`1e9`).
pub fn parse_count(text: &str) -> std::result::Result<u64, String> {
    let value: f64 = text.trim().parse().map_err(|_| format!("'{text}' is not a number"))?;
    if !(value >= 1.0 && value.fract() == 0.0 && value < 2f64.powi(63)) {
        return Err(format!("'{text}' is not a positive whole number"));
    }
    Ok(value as u64)
}

/// As [`parse_count`], zero allowed.
pub fn parse_count_or_zero(text: &str) -> std::result::Result<u64, String> {
    match text.trim().parse::<f64>() {
        Ok(0.0) => Ok(0),
        _ => parse_count(text),
    }
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

/// Plans written before `--virtual-stages` ran one model chunk per stage.
fn all_gather() -> String {
    "all_gather".into()
}

fn yes() -> bool {
    true
}

fn one() -> usize {
    1
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
    /// The flag's value: `f32`, `bf16`, `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    pub fn dtype(self) -> autotp_ir::DType {
        match self {
            Precision::F32 => autotp_ir::DType::F32,
            Precision::Bf16 => autotp_ir::DType::BF16,
            Precision::Fp16 => autotp_ir::DType::F16,
        }
    }
}

/// `--attention`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum AttentionFlag {
    #[default]
    Fused,
    Unfused,
}

/// `--moe-token-drop-policy`: which pairs past an expert's capacity are dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum TokenDropPolicy {
    /// The pairs after the first `capacity` of an expert's in token order.
    #[default]
    Position,
    /// The pairs after the `capacity` of an expert's largest routing weights.
    Probs,
}

impl TokenDropPolicy {
    /// The expert-dispatch pass's policy.
    pub fn policy(self) -> autotp_passes::expert_dispatch::DropPolicy {
        match self {
            TokenDropPolicy::Position => autotp_passes::expert_dispatch::DropPolicy::Position,
            TokenDropPolicy::Probs => autotp_passes::expert_dispatch::DropPolicy::Probability,
        }
    }
}

/// `--kernels`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum Kernels {
    Generated,
    Builtin,
}

impl CompileFlags {
    /// The flags as the plan records them: what decides the step, without the inspection
    /// flags (dumps, prints, reports), which change nothing.
    pub fn recorded(&self) -> serde_json::Value {
        let mut flags = self.clone();
        (flags.dump_ir, flags.print_after, flags.report, flags.dump_kernels) = (None, vec![], None, None);
        (flags.explain_tp, flags.embed_weights) = (false, false);
        serde_json::to_value(&flags).expect("flags serialise")
    }

    /// The same model, optimizer and global batch on one device: every parallel flag reset,
    /// one micro-batch of the whole global batch.
    pub fn single_device(&self, global_batch: usize) -> CompileFlags {
        let mut flags = self.clone();
        (flags.dp, flags.cp, flags.tp, flags.pp, flags.zero, flags.ep) = (1, 1, 1, 1, 0, 1);
        flags.cp_comm_type = all_gather();
        flags.cp_contiguous = false;
        flags.sequence_parallel = false;
        (flags.micro_batch, flags.grad_accum, flags.global_batch) = (global_batch, None, None);
        flags.pp_cuts.clear();
        (flags.schedule, flags.pp_backward, flags.virtual_stages) = ("1f1b".to_string(), None, 1);
        (flags.reduce_bucket_size, flags.prefetch_bucket_size, flags.max_live_params) = (None, None, None);
        flags.comm_dtype = None;
        flags.param_persistence_threshold = 0;
        flags
    }

    /// Flags a plan recorded ([`autotp_program::plan::TrainingConfig::compile_flags`]).
    pub fn from_recorded(value: &serde_json::Value) -> Result<CompileFlags, CompileError> {
        serde_json::from_value(value.clone())
            .map_err(|e| CompileError::Options(format!("the plan's recorded compile flags do not parse: {e}")))
    }

    /// Flags from a command line's words after `autotp compile` (the layout search writes
    /// layouts so), with the command line's defaults.
    pub fn parse_args(args: &[String]) -> Result<CompileFlags, CompileError> {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            flags: CompileFlags,
        }
        let argv = std::iter::once("autotp-compile".to_string()).chain(args.iter().cloned());
        <Command as clap::Parser>::try_parse_from(argv)
            .map(|c| c.flags)
            .map_err(|e| CompileError::Options(format!("compile flags {}: {e}", args.join(" "))))
    }
}
