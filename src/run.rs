//! `autotp run PLAN.atp`: trains a compiled plan over a token file, with a progress bar (step,
//! loss, tokens/s), a line per `--log-every` steps, metrics as JSON lines, checkpoints
//! (`--save`, `--save-every`, `--keep-last`) and `--resume`. `--steps N` is the step the run
//! ends at: a run resumed from step k does steps k+1..=N. SIGTERM or SIGUSR1 stops the run
//! after the step it is in, with a checkpoint and exit status 75 (`autotp_train::preemption`).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autotp_program::mesh::CommBytes;
use autotp_program::plan::{PlanFile, TrainingPlan};
use autotp_runtime::clock::Clock;
use autotp_runtime::comm::MpiComm;
use autotp_runtime::cuda::DeviceKind;
use autotp_runtime::gpu::{GemmMath, GpuKind};
use autotp_train::checkpoint::Checkpoint;
use autotp_train::data::TokenDtype;
use autotp_train::dataset::{Split, TrainingData};
use autotp_train::preemption;
use autotp_train::tensorboard::EventWriter;
use autotp_train::trainer::{EvalMetrics, Measured, NanPolicy, StepMetrics, Trainer};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

/// How to train: shared by `run` and `train`.
#[derive(Args)]
pub struct RunFlags {
    /// The training data: a raw token file (little-endian u16, or --data-dtype u32: the
    /// contract's windows in order), a Megatron-LM indexed dataset's prefix (PREFIX.bin +
    /// PREFIX.idx, `autotp data prepare`: samples over its documents shuffled by the seed, epoch
    /// after epoch), or a weighted blend of prefixes ("0.3 A 0.7 B", as Megatron's --data-path).
    #[arg(long, value_name = "FILE|PREFIX|\"W1 PREFIX1 W2 PREFIX2 ...\"")]
    data: PathBuf,
    #[arg(long, default_value = "u16")]
    data_dtype: String,
    /// Train, validation and test parts of each Megatron dataset's documents, in order
    /// (Megatron's --split, e.g. 969,30,1); training reads the first [default: all of it].
    #[arg(long, value_name = "TRAIN,VALID,TEST")]
    split: Option<String>,
    /// Train until this optimizer step (counted from the start of training, resumed or not).
    #[arg(long)]
    steps: usize,
    /// Compute the validation loss and perplexity every N steps and after the last: the plan's
    /// evaluation step (the forward pass on the training layout; no gradient, no optimizer
    /// state touched) on the first --eval-iters global batches of the validation data.
    #[arg(long, value_name = "N")]
    eval_every: Option<usize>,
    /// Global batches per validation.
    #[arg(long, value_name = "K", default_value_t = 10, requires = "eval_every")]
    eval_iters: usize,
    /// The validation data, as --data names it [default: the --split's validation part of
    /// --data].
    #[arg(long, value_name = "FILE|PREFIX|\"W1 PREFIX1 ...\"", requires = "eval_every")]
    eval_data: Option<PathBuf>,
    /// Append one JSON object per step (step, loss, lr, step_seconds, tokens_per_second[,
    /// grad_norm, loss_scale, eval_loss, eval_perplexity]); a fresh run truncates the file, a
    /// resumed one appends.
    #[arg(long, value_name = "FILE.jsonl")]
    pub metrics_out: Option<PathBuf>,
    /// Write TensorBoard event files under this directory (`tensorboard --logdir DIR`): per
    /// step train/{loss, lr, grad_norm, loss_scale, tokens_per_second, step_seconds},
    /// validation/{loss, perplexity} and memory/{device_bytes, host_rss_bytes}.
    #[arg(long, value_name = "DIR")]
    tensorboard: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of the --trace-steps (open it in ui.perfetto.dev): a
    /// process per rank, a thread per stream, a span per kernel, GEMM, collective, pipeline send
    /// and receive, optimizer step and wait. CPU ranks.
    #[arg(long, value_name = "FILE.json")]
    trace: Option<PathBuf>,
    /// The steps --trace records: FIRST-LAST or one step.
    #[arg(long, value_name = "FIRST-LAST", default_value = "2-3", requires = "trace")]
    trace_steps: String,
    /// Save checkpoints under this directory: at the end, and every --save-every steps.
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    #[arg(long, value_name = "K", requires = "save")]
    save_every: Option<usize>,
    /// Keep only the newest N checkpoints under --save.
    #[arg(long, value_name = "N", requires = "save")]
    keep_last: Option<usize>,
    /// Resume from a checkpoint: a --save directory (its latest) or one step directory.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Skip checking the plan's and the resumed checkpoint's tensors (and the manifest) against
    /// the CRC-32C they were written with, which reads every byte once when they load.
    #[arg(long)]
    no_verify: bool,
    /// Seed of the run's random numbers (a resumed run keeps its checkpoint's).
    #[arg(long)]
    seed: Option<u64>,
    /// Print a line every N steps (the first and last step always print).
    #[arg(long, value_name = "N", default_value_t = 1)]
    log_every: usize,
    /// Time every instruction and print, at the end, rank 0's time per step by op and its
    /// slowest instructions. The run's first step (loading libraries, warming caches) is left
    /// out where it runs more than one.
    #[arg(long)]
    profile: bool,
    /// Pin each rank's kernel threads to cores of their own (as DeepSpeed's
    /// --bind_cores_to_rank): steadier timings on a machine the run has to itself.
    #[arg(long)]
    bind_cores: bool,
    /// How the pipeline stages' idle shares are timed: wall (real time) or cpu (each stage by its
    /// own thread's CPU time, a message arriving when its sender's clock said it was sent: the
    /// bubble with a core per stage, on a machine with fewer cores; one kernel thread per stage,
    /// stages of one rank; steadiest with the whole run on one core, `taskset -c 0`).
    #[arg(long, default_value = "wall")]
    clock: String,
    /// In a job of processes (mpirun, srun, --launch): seconds one collective or pipeline
    /// message may wait for the other ranks before the job ends, naming the rank that waited
    /// (a rank that stopped or hangs would block the others forever). On GPUs with NCCL: seconds
    /// one wait on the device may last before the communicators are aborted. Raise it for
    /// models whose pipeline stages (or steps, on GPUs) take longer than this.
    #[arg(long, value_name = "SECONDS", default_value_t = 25.0)]
    pub comm_timeout: f64,
    /// Where the ranks run: cpu (threads or processes of this machine) or cuda (one GPU per
    /// rank; without a CUDA driver the run stops at once, naming the missing library).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// With --device cuda: f32 matmuls on the TF32 tensor cores (operands rounded to 10
    /// mantissa bits, sums in f32), as PyTorch's `allow_tf32`. Off by default: an f32 plan then
    /// trains on the GPU the model it trains on the CPU.
    #[arg(long)]
    tf32: bool,
    /// With --device cuda: every step after the first runs as one CUDA graph, captured from the
    /// second (no launch costs, as torch.compile's mode="reduce-overhead"). Refused, naming the
    /// instruction, for a plan whose step needs the host (host kernels, host-memory
    /// communication, pipeline messages, an offloaded optimizer).
    #[arg(long)]
    cuda_graph: bool,
    /// What a step whose loss or gradients hold an inf or a NaN does: stop (end the run, naming
    /// the step, the first parameter whose gradient is not finite and the op that first made
    /// an inf or a NaN; the state stays as before the step) or skip (keep the state, count the
    /// step, and go on, as mixed precision does). Both need a plan that checks its gradients,
    /// as every plan does unless compiled with --no-finite-check (such a plan stops on a loss
    /// that is not finite). fp16 plans always skip and lower their loss scale.
    #[arg(long, default_value = "stop", value_parser = ["stop", "skip"])]
    nan_policy: String,
}

/// The seed of a fresh run without `--seed`.
pub const DEFAULT_SEED: u64 = 0;

impl RunFlags {
    /// The GPU to train on (`--device cuda`), checked to be there before anything is loaded;
    /// `None` for the CPU. The process's local rank picks the GPU. `AUTOTP_GPU=emulated`
    /// (tests) runs on the emulated GPU instead.
    pub fn gpu(&self) -> Result<Option<GpuKind>> {
        let math = if self.tf32 { GemmMath::Tf32 } else { GemmMath::F32 };
        match DeviceKind::parse(&self.device) {
            Some(DeviceKind::Cpu) if self.tf32 => bail!("--tf32 needs --device cuda (the CPU has no TF32)"),
            Some(DeviceKind::Cpu) if self.cuda_graph => bail!("--cuda-graph needs --device cuda"),
            Some(DeviceKind::Cuda) if self.cuda_graph && self.profile => {
                bail!("--profile times each instruction between CUDA events, which a CUDA graph's replay has not: drop --cuda-graph to profile")
            }
            Some(DeviceKind::Cpu) => Ok(None),
            Some(DeviceKind::Cuda) if std::env::var("AUTOTP_GPU").as_deref() == Ok("emulated") => {
                Ok(Some(GpuKind::Emulated { math }))
            }
            Some(DeviceKind::Cuda) => {
                autotp_runtime::cuda::probe()?;
                let ordinal = autotp_runtime::launch::discover()?.local_rank;
                Ok(Some(GpuKind::Cuda { ordinal, math }))
            }
            None => bail!("--device {} is not a device: cpu or cuda", self.device),
        }
    }

    /// Loads `plan` for this run: on the GPU `gpu` names or the CPU, as a process of `job` or
    /// all ranks here, with its optimizer state's or parameters' files under `nvme_path`
    /// (`run --nvme-path`) rather than where the plan says.
    pub fn trainer(
        &self,
        mut plan: TrainingPlan,
        weights: &BTreeMap<String, &[u8]>,
        job: Option<&Arc<MpiComm>>,
        gpu: Option<GpuKind>,
        nvme_path: Option<&Path>,
    ) -> Result<Trainer> {
        if let Some(path) = nvme_path {
            let training = &mut plan.training;
            if training.nvme.is_none() && training.nvme_params.is_none() {
                bail!(
                    "--nvme-path: the plan keeps nothing in files (compile it with --offload-optimizer nvme or \
                     --offload-param nvme)"
                );
            }
            let path = std::path::absolute(path).with_context(|| format!("--nvme-path {}", path.display()))?;
            if let Some(nvme) = training.nvme.as_mut() {
                nvme.path = path.clone();
            }
            if let Some(settings) = training.nvme_params.as_mut() {
                settings.path = path;
            }
        }
        let seed = self.seed();
        let mut trainer = match (job, gpu) {
            (Some(job), Some(gpu)) => Trainer::for_process_on_gpu(plan, weights, seed, job.clone(), gpu)?,
            (Some(job), None) => Trainer::for_process(plan, weights, seed, job.clone())?,
            (None, Some(gpu)) => Trainer::on_gpu(plan, weights, seed, gpu)?,
            (None, None) => Trainer::new(plan, weights, seed)?,
        };
        if self.comm_timeout > 0.0 && self.comm_timeout.is_finite() {
            trainer.set_comm_timeout(std::time::Duration::from_secs_f64(self.comm_timeout));
        }
        if self.cuda_graph {
            trainer.use_cuda_graph()?;
        }
        let policy = if self.nan_policy == "skip" { NanPolicy::Skip } else { NanPolicy::Stop };
        trainer.set_nan_policy(policy).context("--nan-policy skip")?;
        Ok(trainer)
    }

    /// The seed for a fresh run (`--seed`, default [`DEFAULT_SEED`]).
    pub fn seed(&self) -> u64 {
        self.seed.unwrap_or(DEFAULT_SEED)
    }
}

#[derive(Args)]
pub struct RunArgs {
    /// The compiled plan (autotp compile -o PLAN.atp).
    plan: PathBuf,
    #[command(flatten)]
    flags: RunFlags,
    /// Run the plan's ranks as N processes on this machine, started with Open MPI's mpirun
    /// (as `mpirun -n N autotp run ...` would); N is the plan's rank count.
    #[arg(long, value_name = "N")]
    launch: Option<usize>,
    /// Where a plan compiled with --offload-optimizer nvme keeps its optimizer state's files,
    /// instead of the directory it was compiled with.
    #[arg(long, value_name = "DIR")]
    nvme_path: Option<PathBuf>,
}

/// How `autotp run` or `autotp train` ended, which makes the process's exit status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Every step up to `--steps` trained.
    Completed,
    /// A signal stopped the run after a step and its checkpoint ([`preemption`]).
    Preempted,
    /// `--launch` started the job's processes, which ended with this status.
    Launched(std::process::ExitStatus),
}

impl Ending {
    pub fn exit_code(self) -> ExitCode {
        match self {
            Ending::Completed => ExitCode::SUCCESS,
            Ending::Preempted => ExitCode::from(preemption::PREEMPTED_EXIT_CODE),
            Ending::Launched(status) if status.success() => ExitCode::SUCCESS,
            Ending::Launched(status) => ExitCode::from(status.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(1)),
        }
    }
}

/// `autotp run`.
pub fn run(args: &RunArgs) -> Result<Ending> {
    let gpu = args.flags.gpu()?;
    if let Some(metrics) = &args.flags.metrics_out {
        crate::refuse_overwrite(metrics, &args.plan, "the plan being run")?;
    }
    if let Some(processes) = args.launch {
        return crate::job::launch(processes).map(Ending::Launched);
    }
    let started = Instant::now();
    let file = PlanFile::open_checked(&args.plan, !args.flags.no_verify)?;
    let job = crate::job::start(&file.plan, args.flags.comm_timeout)?;
    crate::job::run_in(job.as_ref(), || {
        let weights = file.weights();
        let mut trainer =
            args.flags.trainer(file.plan.clone(), &weights, job.as_ref(), gpu, args.nvme_path.as_deref())?;
        drop(weights);
        drop(file);
        tracing::info!(seconds = started.elapsed().as_secs_f64(), plan = %args.plan.display(), "plan loaded");
        train(&mut trainer, &args.flags)
    })
}

/// Fault injection for tests: `AUTOTP_PANIC_AT=RANK:STEP` makes the process running rank RANK
/// panic before step STEP.
const PANIC_VARIABLE: &str = "AUTOTP_PANIC_AT";

fn panic_at() -> Result<Option<(usize, usize)>> {
    let Ok(value) = std::env::var(PANIC_VARIABLE) else { return Ok(None) };
    let parsed = value.split_once(':').and_then(|(r, s)| Some((r.parse().ok()?, s.parse().ok()?)));
    parsed.map(Some).with_context(|| format!("{PANIC_VARIABLE}={value} is not RANK:STEP"))
}

fn open_metrics(path: &Path, append: bool) -> Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.create(true).write(true);
    if append {
        options.append(true);
    } else {
        options.truncate(true);
    }
    options.open(path).with_context(|| format!("cannot write {}", path.display()))
}

fn metrics_record(m: &StepMetrics, tokens_per_second: f64, eval: Option<&EvalMetrics>) -> serde_json::Value {
    let mut record = serde_json::Map::new();
    record.insert("step".into(), m.step.into());
    record.insert("loss".into(), m.loss.into());
    for (name, value) in &m.scalars {
        record.entry(name.clone()).or_insert((*value).into());
    }
    record.insert("lr".into(), m.lr.into());
    if let Some(scale) = m.loss_scale {
        record.insert("loss_scale".into(), scale.into());
    }
    if m.scalars.iter().any(|(name, _)| name == autotp_program::step::StepOutput::Overflow.name()) {
        record.insert("skipped".into(), m.skipped.into());
    }
    record.insert("step_seconds".into(), m.seconds.into());
    record.insert("tokens_per_second".into(), tokens_per_second.into());
    if let Some(eval) = eval {
        record.insert("eval_loss".into(), eval.loss.into());
        record.insert("eval_perplexity".into(), eval.perplexity().into());
    }
    serde_json::Value::Object(record)
}

/// The steps `--trace-steps` names (`FIRST-LAST` or one step, 1-based), within the steps this
/// run trains (after `first`, up to `steps`).
fn trace_steps(text: &str, first: usize, steps: usize) -> Result<std::ops::RangeInclusive<usize>> {
    let parse = |s: &str| s.trim().parse::<usize>().ok().filter(|&n| n > 0);
    let range = match text.split_once('-') {
        Some((a, b)) => parse(a).zip(parse(b)).filter(|(a, b)| a <= b),
        None => parse(text).map(|n| (n, n)),
    };
    let (a, b) = range.with_context(|| format!("--trace-steps '{text}' is not FIRST-LAST or a step (1-based)"))?;
    if a <= first || a > steps {
        bail!("--trace-steps {a}-{b}: this run trains steps {}-{steps}", first + 1);
    }
    Ok(a..=b.min(steps))
}

/// A step's scalars for TensorBoard, by tag.
fn tensorboard_scalars(
    m: &StepMetrics,
    tokens_per_second: f64,
    eval: Option<&EvalMetrics>,
) -> Vec<(&'static str, f64)> {
    let mut scalars = vec![("train/loss", m.loss), ("train/lr", m.lr)];
    if let Some((_, norm)) =
        m.scalars.iter().find(|(name, _)| name == autotp_program::step::StepOutput::GradNorm.name())
    {
        scalars.push(("train/grad_norm", *norm));
    }
    scalars.extend(m.loss_scale.map(|scale| ("train/loss_scale", scale)));
    scalars.extend([("train/tokens_per_second", tokens_per_second), ("train/step_seconds", m.seconds)]);
    if let Some(eval) = eval {
        scalars.extend([("validation/loss", eval.loss), ("validation/perplexity", eval.perplexity())]);
    }
    scalars
}

/// This process's resident memory (`/proc/self/statm`), where the system says.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

/// Resumes `trainer` from the checkpoint in `dir` and opens the data (whose sample order
/// follows the seed the checkpoint restores), warning where this run's data or seed differs
/// from the checkpoint's.
fn resume(trainer: &mut Trainer, flags: &RunFlags, dir: &Path) -> Result<TrainingData> {
    let checkpoint = Checkpoint::open_checked(dir, !flags.no_verify)?;
    trainer.resume(&checkpoint)?;
    let data = open_data(flags, trainer)?;
    let saved = &checkpoint.manifest.data;
    if saved.tokens != data.tokens() {
        tracing::warn!(
            "resuming on different data: the checkpoint was trained on {} ({} tokens), this run reads {} ({} tokens)",
            saved.path.display(),
            saved.tokens,
            data.path().display(),
            data.tokens()
        );
    }
    if flags.seed.is_some_and(|s| s != trainer.seed()) {
        tracing::warn!("--seed is ignored: the checkpoint's seed {} continues", trainer.seed());
    }
    if trainer.reports() {
        let relaid = if checkpoint.manifest.plan_fingerprint == trainer.fingerprint() {
            String::new()
        } else {
            " (written by another parallel layout of this training: each rank read its block of every tensor)"
                .to_string()
        };
        eprintln!("resumed from {} at step {}{relaid}", checkpoint.dir.display(), trainer.completed_steps());
    }
    Ok(data)
}

/// The training data `--data` names, its samples in the order of the trainer's seed.
fn open_data(flags: &RunFlags, trainer: &Trainer) -> Result<TrainingData> {
    let split = flags.split.as_deref().map(Split::parse).transpose()?;
    open_part(flags, trainer, &flags.data, split, 0)
}

/// The data `spec` names (as `--data`), part `part` of `split` for Megatron datasets, in the
/// sample order of the trainer's seed.
fn open_part(
    flags: &RunFlags,
    trainer: &Trainer,
    spec: &Path,
    split: Option<Split>,
    part: usize,
) -> Result<TrainingData> {
    let dtype = TokenDtype::parse(&flags.data_dtype)?;
    let (seq_len, seed) = (trainer.training().seq_len, trainer.seed());
    Ok(TrainingData::open(&spec.to_string_lossy(), dtype, seq_len, seed, split, part)?)
}

/// The validation data of `--eval-every`: `--eval-data`, else the `--split`'s validation part
/// of `--data`.
fn open_eval_data(flags: &RunFlags, trainer: &Trainer) -> Result<Option<TrainingData>> {
    let Some(every) = flags.eval_every else { return Ok(None) };
    if every == 0 || flags.eval_iters == 0 {
        bail!("--eval-every and --eval-iters must be at least 1");
    }
    let data = match &flags.eval_data {
        Some(spec) => {
            open_part(flags, trainer, spec, None, 0).with_context(|| format!("--eval-data {}", spec.display()))?
        }
        None => {
            let split = flags.split.as_deref().map(Split::parse).transpose()?;
            if !split.is_some_and(|s| s.weights[1] > 0.0) {
                bail!(
                    "--eval-every needs validation data: --eval-data, or --split with a validation part of --data's \
                     documents (969,30,1)"
                );
            }
            open_part(flags, trainer, &flags.data, split, 1).context("the --split's validation part")?
        }
    };
    Ok(Some(data))
}

/// Runs `trainer` to step `flags.steps` over the data, resuming and saving as asked.
pub fn train(trainer: &mut Trainer, flags: &RunFlags) -> Result<Ending> {
    if flags.save_every == Some(0) || flags.log_every == 0 {
        bail!("--save-every and --log-every must be at least 1");
    }
    preemption::watch().context("cannot install the handlers of SIGTERM and SIGUSR1")?;
    if let Some(metrics) = &flags.metrics_out {
        crate::refuse_overwrite(metrics, &flags.data, "the token file being trained on")?;
    }
    let data = match &flags.resume {
        Some(dir) => resume(trainer, flags, dir)?,
        None => open_data(flags, trainer)?,
    };
    let eval_data = open_eval_data(flags, trainer)?;
    let first = trainer.completed_steps();
    let traced = match &flags.trace {
        Some(path) => Some((path, trace_steps(&flags.trace_steps, first, flags.steps)?)),
        None => None,
    };
    if first >= flags.steps {
        if trainer.reports() {
            println!("already at step {first}, at or past --steps {}: nothing to train", flags.steps);
        }
        return Ok(Ending::Completed);
    }
    // In a job of processes, rank 0 alone prints and writes metrics.
    let reports = trainer.reports();
    let mut metrics = match &flags.metrics_out {
        Some(path) if reports => Some(open_metrics(path, flags.resume.is_some())?),
        _ => None,
    };
    let mut events = match &flags.tensorboard {
        Some(dir) if reports => Some(EventWriter::create(dir)?),
        _ => None,
    };
    // The profiled steps: from the run's second, where it has one, so that one-time costs
    // (cuBLAS loading its kernels on a GPU's first GEMM, page faults) stay out of the table.
    let profile_from = flags.profile.then(|| if flags.steps > first + 1 { first + 1 } else { first });
    let mut profiled_seconds = 0.0;
    if DeviceKind::parse(&flags.device) == Some(DeviceKind::Cuda) && reports {
        warn_of_thread_per_row_attention(trainer);
    }
    if let Some(line) = trainer.communication().filter(|_| reports) {
        eprintln!("{line}");
    }
    let clock =
        Clock::parse(&flags.clock).with_context(|| format!("--clock '{}' is not one of wall, cpu", flags.clock))?;
    trainer.set_clock(clock).with_context(|| format!("--clock {}", clock.name()))?;
    if flags.bind_cores {
        trainer.bind_cores()?;
    }
    let bar = if reports { ProgressBar::new(flags.steps as u64) } else { ProgressBar::hidden() };
    let bar = bar.with_position(first as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed_precise}, eta {eta}]")
            .expect("a valid template"),
    );
    let tokens_per_step = trainer.tokens_per_step();
    trainer.watch_activations();
    let io_before = ProcessIo::now();
    let start = Instant::now();
    // Per step, each rank's share of the step spent idle: waiting for another stage, or done
    // before the others.
    let mut idle_shares: Vec<Vec<f64>> = Vec::new();
    let panic_at = panic_at()?;
    let (mut last, mut ending) = (first, Ending::Completed);
    for step in first..flags.steps {
        if let Some((rank, at)) = panic_at {
            if at == step + 1 && trainer.local_ranks().contains(&rank) {
                panic!("{PANIC_VARIABLE} asked rank {rank} to panic at step {at}");
            }
        }
        if traced.as_ref().is_some_and(|(_, steps)| *steps.start() == step + 1) {
            trainer.start_trace().context("--trace")?;
        }
        if profile_from == Some(step) {
            trainer.enable_profile()?;
        }
        let m = trainer.step(&data, flags.steps)?;
        if profile_from.is_some_and(|from| step >= from) {
            profiled_seconds += m.seconds;
        }
        if let Some((path, steps)) = traced.as_ref().filter(|(_, steps)| *steps.end() == m.step) {
            let ranks = trainer.finish_trace()?;
            if reports {
                let trace = autotp_train::trace::chrome_trace(&ranks).to_string();
                std::fs::write(path, trace).with_context(|| format!("cannot write --trace {}", path.display()))?;
                bar.suspend(|| eprintln!("wrote {} (steps {}-{})", path.display(), steps.start(), steps.end()));
            }
        }
        idle_shares.push(m.idle.clone());
        let tokens_per_second = ((m.step - first) * tokens_per_step) as f64 / start.elapsed().as_secs_f64();
        bar.set_message(format!("loss {:.4} | {:.0} tokens/s", m.loss, tokens_per_second));
        bar.inc(1);
        if reports && (m.step == first + 1 || m.step == flags.steps || m.step % flags.log_every == 0) {
            let scale = m.loss_scale.map(|s| format!(" loss-scale {s}")).unwrap_or_default();
            let skipped = match trainer.skipped_steps() {
                0 => String::new(),
                n => format!(" ({n} skipped{})", if m.skipped { ", this one too" } else { "" }),
            };
            bar.suspend(|| {
                println!(
                    "step {:>6}/{} loss {:.6} lr {:.3e} {:>8.1} ms {:>9.0} tokens/s{scale}{skipped}",
                    m.step,
                    flags.steps,
                    m.loss,
                    m.lr,
                    m.seconds * 1e3,
                    tokens_per_second
                )
            });
        }
        let evaluated = match (&eval_data, flags.eval_every) {
            (Some(data), Some(every)) if m.step % every == 0 || m.step == flags.steps => {
                let eval = trainer.evaluate(data, flags.eval_iters)?;
                if reports {
                    bar.suspend(|| {
                        println!(
                            "validation at step {}: loss {:.6} perplexity {:.3} ({} batches, {:.1} ms)",
                            m.step,
                            eval.loss,
                            eval.perplexity(),
                            eval.batches,
                            eval.seconds * 1e3
                        )
                    });
                }
                Some(eval)
            }
            _ => None,
        };
        if let Some(file) = &mut metrics {
            writeln!(file, "{}", metrics_record(&m, tokens_per_second, evaluated.as_ref()))
                .context("cannot write metrics")?;
        }
        if let Some(events) = &mut events {
            let memory = [("memory/device_bytes", trainer.local_arena_bytes() as f64)];
            let rss = resident_bytes().map(|b| ("memory/host_rss_bytes", b as f64));
            let scalars = tensorboard_scalars(&m, tokens_per_second, evaluated.as_ref());
            events.scalars(m.step as u64, &[&scalars[..], &memory, rss.as_slice()].concat())?;
        }
        last = m.step;
        // Every process takes part in the agreement, at the same steps.
        let stop = if m.step < flags.steps { trainer.agree_to_stop(preemption::requested())? } else { None };
        let scheduled = m.step == flags.steps || flags.save_every.is_some_and(|k| m.step % k == 0);
        if let Some(dir) = flags.save.as_ref().filter(|_| scheduled || stop.is_some()) {
            let saved = trainer.save(dir, &data, flags.steps, flags.keep_last)?;
            if reports {
                bar.suspend(|| eprintln!("saved {}", saved.display()));
            }
        }
        if let Some(stop) = stop {
            if reports {
                let resume = match &flags.save {
                    Some(dir) => format!("continue with --resume {}", dir.display()),
                    None => "no --save, so no checkpoint".to_string(),
                };
                bar.suspend(|| eprintln!("{stop}: stopped after step {last}; {resume}"));
            }
            ending = Ending::Preempted;
            break;
        }
    }
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    let io = io_before.zip(ProcessIo::now()).map(|(before, after)| after.since(&before));
    let steps = last - first;
    // Every process of a job takes part in gathering the measured figures.
    // On a GPU the device's own count is worth comparing with the plan even for one rank.
    let on_gpu = DeviceKind::parse(&flags.device) == Some(DeviceKind::Cuda);
    let measured = if trainer.world_size() > 1 || on_gpu { Some(trainer.measured()?) } else { None };
    if !reports {
        return Ok(ending);
    }
    eprintln!(
        "trained steps {}..={last} in {seconds:.2} s: {:.1} ms per step, {:.0} tokens/s",
        first + 1,
        seconds * 1e3 / steps as f64,
        (steps * tokens_per_step) as f64 / seconds
    );
    if trainer.skipped_steps() > 0 || trainer.loss_scale().is_some() {
        let scale = trainer.loss_scale().map(|s| format!("; loss scale now {s}")).unwrap_or_default();
        eprintln!("skipped steps (non-finite gradients): {}{scale}", trainer.skipped_steps());
    }
    if let Some(measured) = measured {
        eprint!("{}", measured_against_plan(trainer, &measured, steps));
    }
    eprint!("{}", activations_against_plan(&trainer.touched_activations()));
    eprint!("{}", nvme_against_counters(trainer, io, steps));
    if let Some(pipeline) = &trainer.training().pipeline {
        eprint!("{}", bubble_table(pipeline, trainer.stage_size(), clock, &median_per_rank(&idle_shares)));
    }
    // The first rank of every pipeline stage (rank 0 without a pipeline).
    for stage in 0..trainer.stages() {
        let rank = stage * trainer.stage_size();
        if let Some(times) = trainer.profile(rank) {
            let profiled = (profile_from.unwrap_or(first) + 1)..=last;
            print!("{}", profile_table(rank, trainer.rank_program(rank), times, profiled, profiled_seconds));
        }
    }
    Ok(ending)
}

/// The storage bytes this process read and wrote, from Linux's per-process I/O counters
/// (`/proc/self/io`): with direct I/O, exactly what went to and from the disk.
#[derive(Clone, Copy, Debug)]
struct ProcessIo {
    read_bytes: u64,
    write_bytes: u64,
}

impl ProcessIo {
    /// The counters now; `None` where the system has none.
    fn now() -> Option<ProcessIo> {
        let text = std::fs::read_to_string("/proc/self/io").ok()?;
        let field = |name: &str| {
            text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(": ")?.trim().parse::<u64>().ok())
        };
        Some(ProcessIo { read_bytes: field("read_bytes")?, write_bytes: field("write_bytes")? })
    }

    fn since(&self, before: &ProcessIo) -> ProcessIo {
        ProcessIo {
            read_bytes: self.read_bytes.saturating_sub(before.read_bytes),
            write_bytes: self.write_bytes.saturating_sub(before.write_bytes),
        }
    }
}

/// Per rank here whose optimizer state or parameters are in a file: its layout, and the bytes
/// its steps moved per step; then the process's I/O counters over the run beside them.
fn nvme_against_counters(trainer: &Trainer, io: Option<ProcessIo>, steps: usize) -> String {
    use autotp_compiler::summary::grouped;
    let (files, param_files) = (trainer.nvme_status(), trainer.param_file_status());
    if files.is_empty() && param_files.is_empty() {
        return String::new();
    }
    let mut out = String::new();
    let (mut read, mut written) = (0, 0);
    let per_step = |bytes: u64| grouped((bytes / steps.max(1) as u64) as usize);
    let how =
        |direct: bool| if direct { "direct I/O" } else { "through the page cache: the filesystem refuses O_DIRECT" };
    for (rank, file) in &param_files {
        let swap = file.swap;
        out += &format!(
            "parameters on NVMe, rank {rank}: {} shards, {} bytes; at most {} in memory ({} bytes); the steps read {} \
             and wrote {} bytes per step, planned {} and {} ({})\n",
            swap.params.len(),
            grouped(swap.file_bytes),
            swap.peak_params,
            grouped(swap.peak_bytes),
            per_step(file.read),
            per_step(file.written),
            grouped(swap.read_bytes),
            grouped(swap.written_bytes),
            how(file.direct),
        );
        (read, written) = (read + file.read, written + file.written);
    }
    for (rank, file) in &files {
        let layout = file.layout;
        let per_parameter = layout.state_bytes as f64 / layout.elements.max(1) as f64;
        out += &format!(
            "optimizer state on NVMe, rank {rank}: {} bytes in {} tiles ({per_parameter:.0} bytes per parameter + {} \
             of padding to 4 KiB), {} buffers of {} bytes; the steps read {} and wrote {} bytes per step ({})\n",
            grouped(layout.file_bytes),
            layout.tiles,
            grouped(layout.file_bytes - layout.state_bytes),
            file.buffers,
            grouped(layout.tile_bytes),
            per_step(file.read),
            per_step(file.written),
            how(file.direct),
        );
        (read, written) = (read + file.read, written + file.written);
    }
    if let Some(io) = io {
        out += &format!(
            "this process's I/O counters over {steps} steps: read_bytes {}, write_bytes {} (the steps' files: {} and {})\n",
            grouped(io.read_bytes as usize),
            grouped(io.write_bytes as usize),
            grouped(read as usize),
            grouped(written as usize)
        );
    }
    out
}

/// The activation bytes each rank's runs wrote, against the plan's activation peak: what the
/// placement of values in the arena adds to the peak (first fit leaves gaps), measured.
fn activations_against_plan(touched: &[(usize, usize, usize)]) -> String {
    let mut out = String::new();
    for &(rank, written, peak) in touched {
        out += &format!(
            "activations of rank {rank}: {} bytes written in the arena, plan's peak {} ({:+.1}%)\n",
            autotp_compiler::summary::grouped(written),
            autotp_compiler::summary::grouped(peak),
            100.0 * (written as f64 - peak as f64) / peak.max(1) as f64
        );
    }
    out
}

/// The fewest keys over which a thread per query row makes fused attention much slower on a
/// GPU than the unfused products on cuBLAS.
const THREAD_PER_ROW_ATTENTION_KEYS: usize = 256;

/// Warns where a GPU runs fused attention a thread per query row over long rows.
fn warn_of_thread_per_row_attention(trainer: &Trainer) {
    let keys = (0..trainer.stages())
        .filter_map(|stage| {
            trainer.rank_program(stage * trainer.stage_size()).gpu_kernels.thread_per_row_attention_keys()
        })
        .max();
    if let Some(keys) = keys.filter(|&keys| keys >= THREAD_PER_ROW_ATTENTION_KEYS) {
        tracing::warn!(
            "fused attention runs a GPU thread per query row over {keys} keys (f32, or several query runs: \
             no tensor-core form), slow on long rows: on an H200, GPT-2 124M's f32 step (8 x 1024) took \
             1389 ms with it, 193 ms compiled with --attention unfused"
        );
    }
}

/// The slowest instructions a profile lists.
const PROFILE_SLOWEST: usize = 20;

/// A rank's time per step by op over the profiled `steps`, and its slowest instructions.
fn profile_table(
    rank: usize,
    program: &autotp_program::Program,
    times: &[std::time::Duration],
    steps: std::ops::RangeInclusive<usize>,
    seconds: f64,
) -> String {
    let count = steps.clone().count().max(1) as f64;
    let per_step = |d: std::time::Duration| d.as_secs_f64() * 1e3 / count;
    let step_ms = seconds * 1e3 / count;
    let rows = autotp_runtime::profile::by_op(program, times);
    let width = rows.iter().map(|row| row.op.len()).max().unwrap_or(0).max(20);
    let which = match steps.start() == steps.end() {
        true => format!("step {}", steps.start()),
        false => format!("steps {}-{}", steps.start(), steps.end()),
    };
    let mut out = format!("profile of rank {rank}, {which} ({step_ms:.2} ms per step):\n");
    out += &format!("  {:<width$} {:>12} {:>12} {:>8}\n", "op", "instructions", "ms per step", "share");
    for row in rows {
        let ms = per_step(row.total);
        let share = 100.0 * ms / step_ms;
        out += &format!("  {:<width$} {:>12} {:>12.3} {:>7.1}%\n", row.op, row.instructions, ms, share);
    }
    out += "  slowest instructions (ms per step):\n";
    for (label, time) in autotp_runtime::profile::slowest(program, times, PROFILE_SLOWEST) {
        out += &format!("    {:>8.3}  {label}\n", per_step(time));
    }
    out
}

/// Each rank's median over the steps of a per-step, per-rank measure: one slow step (the
/// machine busy elsewhere) moves it little.
fn median_per_rank(per_step: &[Vec<f64>]) -> Vec<f64> {
    let ranks = per_step.first().map_or(0, Vec::len);
    (0..ranks)
        .map(|rank| {
            let mut values: Vec<f64> = per_step.iter().map(|step| step[rank]).collect();
            values.sort_by(f64::total_cmp);
            let mid = values.len() / 2;
            if values.len() % 2 == 1 {
                values[mid]
            } else {
                (values[mid - 1] + values[mid]) / 2.0
            }
        })
        .collect()
}

/// Each pipeline stage's measured idle share of a step (the step's time less the time the stage
/// ran its program but for waiting on the stages beside it; the median over steps, the mean over
/// the stage's ranks), beside the plan's; then the measured bubble, the busiest stage's idle
/// share, beside the equal stages' bubble ((P-1)/(V*M+P-1) with V model chunks per stage).
fn bubble_table(
    pipeline: &autotp_program::plan::PipelineConfig,
    stage_size: usize,
    clock: Clock,
    idle: &[f64],
) -> String {
    let mut out = format!(
        "pipeline ({} schedule, {} backward): idle share of a step per stage (median over steps, {} clock), \
         measured against the plan for these stages' costs and the textbook bubble of equal stages\n",
        pipeline.schedule,
        pipeline.backward,
        clock.name()
    );
    out += &format!(
        "{:>6} {:>14} {:>12} {:>14} {:>16}\n",
        "stage",
        "forward FLOPs",
        "measured",
        "these stages",
        pipeline.bubble_formula()
    );
    let equal = 100.0 * pipeline.bubble_fraction;
    let mut planned = Vec::new();
    let mut measured = Vec::new();
    for (stage, ranks) in idle.chunks(stage_size).enumerate() {
        measured.push(ranks.iter().sum::<f64>() / ranks.len() as f64);
        planned.push(100.0 * pipeline.planned_idle(stage));
        out += &format!(
            "{stage:>6} {:>14} {:>11.1}% {:>13.1}% {equal:>15.1}%\n",
            pipeline.stage_flops.get(stage).copied().unwrap_or(0),
            100.0 * measured[stage],
            planned[stage]
        );
    }
    let all = measured.iter().sum::<f64>() / measured.len().max(1) as f64;
    let all_planned = planned.iter().sum::<f64>() / planned.len().max(1) as f64;
    out += &format!("{:>6} {:>14} {:>11.1}% {all_planned:>13.1}% {equal:>15.1}%\n", "all", "", 100.0 * all);
    if let Some((busiest, busiest_idle)) = measured.iter().copied().enumerate().min_by(|a, b| a.1.total_cmp(&b.1)) {
        out += &format!(
            "{:>6} {:>14} {:>11.1}% {:>13.1}% {equal:>15.1}%\n",
            "bubble",
            format!("(stage {busiest})"),
            100.0 * busiest_idle,
            planned[busiest]
        );
        out += "(bubble: the idle share of the busiest stage, the one every other waits for: the pipeline's fill and \
                drain; the others' idle beyond it is their imbalance)\n";
    }
    out
}

/// Each rank's planned and measured peak memory and communication per step. A rank whose
/// collectives NCCL carried is planned with the device scratch of its strided collectives in
/// place of the host staging it never holds. An all-to-all sends only what its pieces hold
/// (expert parallelism: the pairs the routing sends), so each rank that plans one gets a line
/// of its measured bytes beside the plan's room.
fn measured_against_plan(trainer: &Trainer, measured: &[Measured], steps: usize) -> String {
    let programs: Vec<&autotp_program::Program> = (0..trainer.stages()).map(|s| trainer.stage_program(s)).collect();
    let planned = autotp_program::report::report_of(&programs, trainer.training());
    let mut out = format!(
        "{:>5} {:>16} {:>16} {:>22} {:>22}\n",
        "rank", "planned peak", "measured peak", "planned comm/step", "measured comm/step"
    );
    for (rank, Measured { peak, sent, nccl }) in measured.iter().enumerate() {
        let plan = &planned.ranks[rank];
        let total = CommBytes::total;
        let planned_peak = match nccl {
            true => plan.peak_bytes - plan.comm_buffer_bytes + plan.nccl_scratch_bytes,
            false => plan.peak_bytes,
        };
        out += &format!(
            "{rank:>5} {:>16} {:>16} {:>22} {:>22}\n",
            planned_peak,
            peak,
            total(&plan.comm_bytes_per_step),
            total(sent) / steps.max(1)
        );
    }
    for (rank, Measured { sent, .. }) in measured.iter().enumerate() {
        let room = planned.ranks[rank].comm_bytes_per_step.all_to_all;
        if room > 0 {
            let per_step = sent.all_to_all / steps.max(1);
            out += &format!(
                "all-to-all of rank {rank}: {} bytes sent per step, {:.1}% of the plan's room for every pair ({})\n",
                autotp_compiler::summary::grouped(per_step),
                100.0 * per_step as f64 / room as f64,
                autotp_compiler::summary::grouped(room)
            );
        }
    }
    out
}
