//! `autotp train`: compiles a model into a single-rank training step (simplify, loss, autodiff,
//! optimize) and runs it on CPU over the token data, following the training contract:
//! global batch G = micro-batch (one rank, no accumulation yet); step s uses the contract's
//! windows; a model with its own `loss` output and a `labels` input gets labels = input_ids
//! (the Hugging Face convention), otherwise labels are the next tokens.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autotp_frontend::ImportOptions;
use autotp_passes::autodiff::Autodiff;
use autotp_passes::loss::AttachLoss;
use autotp_passes::optimize::{Optimize, Optimizer};
use autotp_passes::{Pass, PassManager};
use autotp_runtime::data::{TokenData, TokenDtype};
use autotp_runtime::schedule::Schedule;
use autotp_runtime::{Executor, HostTensor};
use clap::Args;

#[derive(Args)]
pub struct TrainArgs {
    /// The ONNX model.
    model: PathBuf,
    /// Tokens per sequence (S).
    #[arg(long)]
    seq_len: usize,
    /// Sequences per step (the global batch on one rank).
    #[arg(long)]
    micro_batch: usize,
    /// Token stream: little-endian u16 (or --data-dtype u32).
    #[arg(long)]
    data: PathBuf,
    #[arg(long, default_value = "u16")]
    data_dtype: String,
    #[arg(long)]
    steps: usize,
    /// adamw or sgd.
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// constant, or cosine (linear warmup over --warmup-steps, then cosine decay to --min-lr at
    /// the last step, as Hugging Face's get_cosine_schedule_with_warmup).
    #[arg(long, default_value = "constant")]
    lr_schedule: String,
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    #[arg(long, default_value_t = 0.0)]
    min_lr: f64,
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
    /// Write one JSON object per step (step, loss, lr[, grad_norm]).
    #[arg(long)]
    metrics_out: Option<PathBuf>,
}

fn optimizer(args: &TrainArgs) -> Result<Optimizer> {
    Ok(match args.optimizer.as_str() {
        "adamw" => {
            let betas: Vec<f64> = args
                .betas
                .split(',')
                .map(|b| b.trim().parse::<f64>())
                .collect::<Result<_, _>>()
                .with_context(|| format!("--betas '{}' must be B1,B2", args.betas))?;
            let [beta1, beta2] = betas[..] else { bail!("--betas '{}' must be two numbers, B1,B2", args.betas) };
            Optimizer::AdamW { beta1, beta2, eps: args.eps, weight_decay: args.weight_decay }
        }
        "sgd" => Optimizer::Sgd { momentum: args.momentum, weight_decay: args.weight_decay, nesterov: args.nesterov },
        other => bail!("--optimizer '{other}' is not one of adamw, sgd"),
    })
}

fn i64_tensor(shape: Vec<usize>, values: &[i64]) -> HostTensor {
    HostTensor { dtype: autotp_ir::DType::I64, shape, data: values.iter().flat_map(|v| v.to_le_bytes()).collect() }
}

fn f32_value(t: &HostTensor) -> f64 {
    f32::from_le_bytes(t.data[..4].try_into().expect("a scalar f32")) as f64
}

fn schedule(args: &TrainArgs) -> Result<Schedule> {
    Ok(match args.lr_schedule.as_str() {
        "constant" => Schedule::Constant { lr: args.lr },
        "cosine" => Schedule::WarmupCosine {
            lr: args.lr,
            warmup_steps: args.warmup_steps,
            total_steps: args.steps,
            min_lr: args.min_lr,
        },
        other => bail!("--lr-schedule '{other}' is not one of constant, cosine"),
    })
}

pub fn run(args: &TrainArgs) -> Result<()> {
    let optimizer = optimizer(args)?;
    let schedule = schedule(args)?;
    let dtype = TokenDtype::parse(&args.data_dtype)?;
    let data = TokenData::open(&args.data, dtype, args.seq_len)?;
    let options = ImportOptions { batch: Some(args.micro_batch), seq_len: Some(args.seq_len), ..Default::default() };
    let mut model = autotp_frontend::import_onnx(&args.model, &options)?;
    let own_loss = model.graph.outputs().iter().any(|(n, _)| n == autotp_passes::loss::LOSS);
    let passes: Vec<Box<dyn Pass>> = vec![
        Box::new(autotp_passes::recognize::Recognize),
        Box::new(autotp_passes::dce::Dce),
        Box::new(AttachLoss),
        Box::new(Autodiff { loss: autotp_passes::loss::LOSS.into() }),
        Box::new(Optimize { optimizer, grad_clip: args.grad_clip }),
        Box::new(autotp_passes::dce::Dce),
    ];
    PassManager::new(passes).run(&mut model.graph)?;
    let program = autotp_codegen::lower(&model.graph)?;
    let mut feeds = Vec::new();
    for slot in &program.inputs {
        match slot.name.as_str() {
            "input_ids" | "labels" | "lr" | "step" => feeds.push(slot.name.clone()),
            other => bail!("the model input '{other}' cannot be fed by the trainer (it feeds input_ids and labels)"),
        }
    }
    let mut exec = Executor::new(program)?;
    for (name, t) in &model.weights {
        exec.load_param(name, t.bytes())?;
    }
    let memory = &exec.program().memory;
    eprintln!(
        "training {} on {} ({} tokens, {} windows): {} parameters bytes, {} optimizer-state bytes, {} activation peak bytes",
        args.model.display(),
        args.data.display(),
        data.tokens(),
        data.windows(),
        memory.params_bytes,
        memory.states_bytes,
        memory.activations_peak_bytes
    );
    let mut metrics = match &args.metrics_out {
        Some(path) => Some(std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?),
        None => None,
    };
    let outputs: Vec<String> = exec.program().outputs.iter().map(|s| s.name.clone()).collect();
    let loss_index =
        outputs.iter().position(|n| n == autotp_passes::loss::LOSS).expect("the loss pass made a loss output");
    let shape = vec![args.micro_batch, args.seq_len];
    let start = Instant::now();
    for step in 0..args.steps {
        let batch = data.batch(step, args.micro_batch);
        let lr = schedule.lr(step);
        let labels = if own_loss { &batch.input_ids } else { &batch.labels };
        let feed: Vec<HostTensor> = feeds
            .iter()
            .map(|name| match name.as_str() {
                "input_ids" => i64_tensor(shape.clone(), &batch.input_ids),
                "labels" => i64_tensor(shape.clone(), labels),
                "lr" => HostTensor {
                    dtype: autotp_ir::DType::F32,
                    shape: vec![],
                    data: (args.lr as f32).to_le_bytes().to_vec(),
                },
                _ => HostTensor {
                    dtype: autotp_ir::DType::F32,
                    shape: vec![],
                    data: ((step + 1) as f32).to_le_bytes().to_vec(),
                },
            })
            .collect();
        let result = exec.run(&feed).with_context(|| format!("step {}", step + 1))?;
        let mut record = serde_json::Map::new();
        record.insert("step".into(), (step + 1).into());
        for (name, t) in outputs.iter().zip(&result) {
            record.insert(name.clone(), f32_value(t).into());
        }
        record.insert("lr".into(), lr.into());
        let loss = f32_value(&result[loss_index]);
        let tokens_per_s = ((step + 1) * args.micro_batch * args.seq_len) as f64 / start.elapsed().as_secs_f64();
        println!("step {:>5}/{} loss {loss:.6} ({tokens_per_s:.0} tokens/s)", step + 1, args.steps);
        if let Some(file) = &mut metrics {
            writeln!(file, "{}", serde_json::Value::Object(record)).context("cannot write metrics")?;
        }
    }
    Ok(())
}
