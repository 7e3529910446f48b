//! The `autotp` command line: import models, print their IR, run them, compile and run training
//! plans, export trained weights.
//!
//!     autotp import MODEL.onnx --batch 4 --seq-len 32 [-o OUT.ir]
//!     autotp infer MODEL.onnx --input input_ids=ids.npy --output-dir out/
//!     autotp compile MODEL.onnx --seq-len 32 --micro-batch 8 [optimizer flags] -o PLAN.atp
//!     autotp run PLAN.atp --data tokens.bin --steps 30 [--save DIR] [--resume DIR]
//!     autotp train MODEL.onnx [compile flags] [run flags]
//!     autotp export CKPT_DIR -o OUT.onnx [--safetensors OUT.safetensors] [--hf DIR]
//!     autotp data prepare INPUT... --tokenizer tokenizer.json -o PREFIX
//!     autotp generate MODEL.onnx [--checkpoint CKPT] --tokenizer tokenizer.json --prompt TEXT

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autotp_frontend::{ImportOptions, Model};
use autotp_runtime::{Executor, HostTensor};
use clap::{Args, Parser, Subcommand};

mod bench_comm;
mod compile;
mod data;
mod deepspeed;
mod export;
mod generate;
mod job;
mod plan;
mod run;
mod train;
mod verify;

#[derive(Parser)]
#[command(
    name = "autotp",
    version,
    about = "A compiler for distributed training: ONNX in, parallel training programs out"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Import a model and print (or write) its IR.
    Import {
        /// The ONNX model.
        model: PathBuf,
        #[command(flatten)]
        shapes: ShapeFlags,
        /// Write the IR here instead of printing it.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Run the simplify passes (pattern recognition) after import.
        #[arg(long)]
        simplify: bool,
    },
    /// Run a model's forward pass on CPU and write every graph output as DIR/NAME.npy.
    Infer {
        /// The ONNX model.
        model: PathBuf,
        /// An input: NAME=FILE.npy (repeat for each input). Batch and sequence come from the
        /// inputs' shapes.
        #[arg(long = "input", value_name = "NAME=FILE.npy", required = true)]
        inputs: Vec<String>,
        /// Directory for the outputs.
        #[arg(long, value_name = "DIR")]
        output_dir: PathBuf,
    },
    /// Compile a model into a training plan (.atp) and print its summary.
    Compile(Box<compile::CompileArgs>),
    /// Choose a parallel layout for N devices: the fastest that fit, by the compiler's memory
    /// plans of the model's first layers and a cost model (weights not needed).
    Plan(Box<plan::PlanArgs>),
    /// Train a compiled plan on CPU over a token file.
    Run(Box<run::RunArgs>),
    /// Compile and run in one go.
    Train(Box<train::TrainArgs>),
    /// Write a checkpoint's weights into the original ONNX model, a safetensors file and/or a
    /// Hugging Face model directory.
    Export(export::ExportArgs),
    /// Print a continuation of a prompt by a model (or a checkpoint of it): greedy, or sampled
    /// with --temperature and --top-k.
    Generate(generate::GenerateArgs),
    /// Prepare training data: `data prepare` tokenizes text into a Megatron-LM indexed dataset.
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Run a plan and the one-device program of its model side by side: losses per step,
    /// gradients at step 1, the first parameter that differs (exit status 1 when one does).
    Verify(verify::VerifyArgs),
    /// Check and time the collectives of the communication backend (under mpirun: MPI, beside
    /// plain MPI_Allreduce; alone: --ranks N threads), and how an all-reduce overlaps compute.
    BenchComm(bench_comm::BenchCommArgs),
}

#[derive(Args)]
struct ShapeFlags {
    /// Size of every input's symbolic dim 0.
    #[arg(long)]
    batch: Option<usize>,
    /// Size of every input's symbolic dim 1.
    #[arg(long)]
    seq_len: Option<usize>,
    /// The full shape of one input: NAME=D0,D1,... (repeatable).
    #[arg(long = "input-shape", value_name = "NAME=D0,D1,...")]
    input_shapes: Vec<String>,
}

impl ShapeFlags {
    fn options(&self) -> Result<ImportOptions> {
        let mut input_shapes = BTreeMap::new();
        for spec in &self.input_shapes {
            let (name, dims) =
                spec.split_once('=').with_context(|| format!("--input-shape '{spec}' must be NAME=D0,D1,..."))?;
            let dims = dims
                .split(',')
                .map(|d| {
                    d.trim()
                        .parse::<usize>()
                        .with_context(|| format!("--input-shape '{spec}': '{d}' is not a dimension"))
                })
                .collect::<Result<Vec<_>>>()?;
            input_shapes.insert(name.to_string(), dims);
        }
        Ok(ImportOptions { batch: self.batch, seq_len: self.seq_len, input_shapes, shapes_only: false })
    }
}

fn import(path: &Path, options: &ImportOptions) -> Result<Model> {
    let start = Instant::now();
    let model = autotp_frontend::import_onnx(path, options)?;
    tracing::info!(
        nodes = model.graph.num_nodes(),
        params = model.weights.len(),
        seconds = start.elapsed().as_secs_f64(),
        "imported {}",
        path.display()
    );
    Ok(model)
}

fn run_import(model: &Path, shapes: &ShapeFlags, output: Option<&Path>, simplify: bool) -> Result<()> {
    let mut imported = import(model, &shapes.options()?)?;
    if simplify {
        autotp_passes::PassManager::simplify_pipeline().run(&mut imported.graph)?;
    }
    let text = autotp_ir::text::print(&imported.graph);
    match output {
        Some(path) => std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?,
        None => print!("{text}"),
    }
    Ok(())
}

fn run_infer(model: &Path, inputs: &[String], output_dir: &Path) -> Result<()> {
    let mut given = BTreeMap::new();
    for spec in inputs {
        let (name, file) = spec.split_once('=').with_context(|| format!("--input '{spec}' must be NAME=FILE.npy"))?;
        let tensor = autotp_runtime::npy::read(Path::new(file))?;
        given.insert(name.to_string(), tensor);
    }
    let expected = autotp_frontend::onnx::input_names(model)?;
    if let Some(missing) = expected.iter().find(|n| !given.contains_key(*n)) {
        bail!("the model needs input '{missing}': give it with --input {missing}=FILE.npy");
    }
    if let Some(extra) = given.keys().find(|n| !expected.contains(n)) {
        bail!("--input {extra}: the model has no such input (it takes {})", expected.join(", "));
    }
    let options = ImportOptions {
        input_shapes: given.iter().map(|(name, t)| (name.clone(), t.shape.clone())).collect(),
        ..ImportOptions::default()
    };
    let mut executor = forward_executor(model, &options)?;
    let mut feed = Vec::new();
    for slot in &executor.program().inputs {
        let t = given.remove(&slot.name).expect("every model input was checked to be given");
        if t.dtype != slot.dtype {
            bail!("input '{}': the file holds {}, the model takes {}", slot.name, t.dtype, slot.dtype);
        }
        feed.push(t);
    }
    let start = Instant::now();
    let outputs = executor.run(&feed)?;
    tracing::info!(seconds = start.elapsed().as_secs_f64(), "forward pass");
    std::fs::create_dir_all(output_dir).with_context(|| format!("cannot create {}", output_dir.display()))?;
    for (slot, tensor) in executor.program().outputs.iter().zip(&outputs) {
        let path = output_dir.join(format!("{}.npy", sanitize(&slot.name)));
        autotp_runtime::npy::write(&path, tensor)?;
        println!("{}: {}{:?} {} -> {}", slot.name, tensor.dtype, tensor.shape, summary(tensor), path.display());
    }
    Ok(())
}

/// The model's forward pass at the shapes `options` bind, simplified, lowered and loaded with
/// the model's weights, ready to run (`infer`, `generate`).
pub(crate) fn forward_executor(model: &Path, options: &ImportOptions) -> Result<Executor> {
    let mut imported = import(model, options)?;
    autotp_passes::PassManager::simplify_pipeline().run(&mut imported.graph)?;
    let mut executor = Executor::new(autotp_codegen::lower(&imported.graph)?)?;
    for (name, tensor) in &imported.weights {
        executor.load_slot(name, tensor.bytes())?;
    }
    Ok(executor)
}

/// Keeps an output name usable as a file name.
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.' { c } else { '_' }).collect()
}

/// `mean=... max|x|=...` of a float tensor, for a one-line summary.
fn summary(t: &HostTensor) -> String {
    let values: Vec<f64> = match t.dtype {
        autotp_ir::DType::F32 => t.data.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        autotp_ir::DType::F64 => t.data.chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
        _ => return String::new(),
    };
    if values.is_empty() {
        return String::new();
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let max = values.iter().fold(0f64, |m, v| m.max(v.abs()));
    format!("mean={mean:.6} max|x|={max:.6}")
}

/// Refuses to write `destination` over `kept` (an input the command reads): the same existing
/// file, by any path. `what` says what `kept` is.
pub(crate) fn refuse_overwrite(destination: &Path, kept: &Path, what: &str) -> Result<()> {
    if let (Ok(a), Ok(b)) = (destination.canonicalize(), kept.canonicalize()) {
        if a == b {
            bail!("{} is {what}: write to another file", destination.display());
        }
    }
    Ok(())
}

/// The error and its causes on one line ([`autotp_compiler::render_error`]).
pub(crate) fn render(error: &anyhow::Error) -> String {
    autotp_compiler::render_error(error.as_ref())
}

/// Lets a closed standard output (`autotp plan ... | head`) end the process quietly, as it
/// ends other command-line tools, instead of `println!` panicking on the write. Only for the
/// commands that talk to no other process: Rust ignores SIGPIPE so that a socket whose peer
/// died (a rank of a job) fails with an error the job reports, which those commands keep.
fn quiet_on_closed_stdout() {
    // SAFETY: restores the default disposition of one signal before any thread is started.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("AUTOTP_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = autotp_kernels::isa::IsaLevel::configured() {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let args = match deepspeed::expand(std::env::args_os().collect()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {}", render(&e));
            return ExitCode::FAILURE;
        }
    };
    let cli = Cli::parse_from(args);
    if matches!(cli.command, Command::Import { .. } | Command::Compile(_) | Command::Plan(_) | Command::Verify(_)) {
        quiet_on_closed_stdout();
    }
    let result = match &cli.command {
        Command::Import { model, shapes, output, simplify } => run_import(model, shapes, output.as_deref(), *simplify),
        Command::Infer { model, inputs, output_dir } => run_infer(model, inputs, output_dir),
        Command::Compile(args) => compile::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Run(args) => match run::run(args) {
            Ok(ending) => return ending.exit_code(),
            Err(e) => Err(e),
        },
        Command::Train(args) => match train::run(args) {
            Ok(ending) => return ending.exit_code(),
            Err(e) => Err(e),
        },
        Command::Export(args) => export::run(args),
        Command::Data(command) => data::run(command),
        Command::Generate(args) => generate::run(args),
        Command::BenchComm(args) => bench_comm::run(args),
        Command::Verify(args) => match verify::run(args) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::from(1),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", render(&e));
            ExitCode::FAILURE
        }
    }
}
