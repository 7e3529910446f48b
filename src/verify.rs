//! `autotp verify PLAN.atp --data TOKENS.bin [--steps K] [--tolerance T]`: runs a plan and the
//! single-device program of the same model (compiled again from the flags the plan recorded,
//! every parallel flag reset, one micro-batch of the global batch) on the same batches, and
//! prints each step's two losses and their relative difference.
//!
//! After step 1 it compares every parameter's gradient, gathered from its shards. The gradient
//! is not kept after the optimizer step, so it is read from what the step made of it:
//! - AdamW's first moment after step 1 is `(1 - beta1) * gradient`;
//! - SGD's momentum buffer after step 1 is `gradient + weight_decay * p`;
//! - without momentum, the parameter moved by `-lr` times that. Its f32 rounding is relative to
//!   the parameter, so that comparison allows for it and says so.
//!
//! Parameters are taken in the order the single-device program makes their gradients (nearest
//! the loss first), so the first one beyond tolerance is where the plan first went wrong.
//! verify names it, with the instruction (and IR node) that made its gradient. The exit status is 0 within tolerance (step 1's loss and every
//! gradient within `--tolerance`, later losses within 1e-3, the training contract), 1
//! otherwise.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use autotp_kernels::Kernel;
use autotp_program::plan::PlanFile;
use autotp_program::{Instruction, Program, Region};
use autotp_train::data::TokenDtype;
use autotp_train::dataset::TrainingData;
use autotp_train::trainer::Trainer;
use clap::Args;

use autotp_compiler::flags::Precision;
use autotp_compiler::{CompileFlags, Compiled, Weights};

use crate::compile::compile;

#[derive(Args)]
pub struct VerifyArgs {
    /// The plan to check (`autotp compile ... -o PLAN.atp`).
    pub plan: PathBuf,
    /// Token file (u16 or u32 little-endian ids).
    #[arg(long)]
    pub data: PathBuf,
    #[arg(long, default_value = "u16")]
    pub data_dtype: String,
    /// Steps to run on both.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Largest relative difference allowed at step 1: of the loss, and of each gradient (its
    /// largest elementwise difference over its largest magnitude). Default: 1e-5 for an f32
    /// plan; for a 16-bit one, whose gradients carry the rounding of 16-bit activations summed
    /// in another order, 1e-2 (fp16, 11 bits) or 3e-2 (bf16, 8 bits).
    #[arg(long)]
    pub tolerance: Option<f64>,
}

/// `--tolerance` by default: by the precision the plan was compiled with.
fn default_tolerance(precision: Precision) -> f64 {
    match precision {
        Precision::F32 => 1e-5,
        Precision::Fp16 => 1e-2,
        Precision::Bf16 => 3e-2,
    }
}

/// Later steps' losses may drift as far as the training contract allows.
const LATER_STEPS: f64 = 1e-3;

/// Gradients smaller than this share of the model's largest are compared against that share:
/// below it, a gradient is the rounding noise of terms that cancel.
const SMALL_GRADIENTS: f64 = 1e-3;

/// The largest magnitude in `v` (0 when empty).
fn largest(v: &[f64]) -> f64 {
    v.iter().fold(0f64, |m, x| m.max(x.abs()))
}

/// What step 1 made of one parameter's gradient on each side, as f64, and the relative
/// difference that f32 rounding alone can reach in it.
struct GradientEvidence {
    param: String,
    plan: Vec<f64>,
    single: Vec<f64>,
    rounding: f64,
}

/// Runs both programs; `Ok(true)` when they agree within tolerance.
pub fn run(args: &VerifyArgs) -> Result<bool> {
    if args.steps == 0 {
        anyhow::bail!("--steps must be at least 1");
    }
    let file = PlanFile::open(&args.plan)?;
    let recorded = file.plan.training.compile_flags.as_ref().with_context(|| {
        format!("{} was compiled before `autotp verify` existed: compile it again", args.plan.display())
    })?;
    let mut flags = CompileFlags::from_recorded(recorded)?.single_device(file.plan.training.global_batch);
    let tolerance = args.tolerance.unwrap_or(default_tolerance(flags.precision));
    flags.model = file.plan.model.path.clone();
    eprintln!("compiling {} for one device (micro-batch {})", flags.model.display(), flags.micro_batch);
    let reference = compile(&flags, Weights::Read)?;
    let seed = crate::run::DEFAULT_SEED;
    let mut plan = Trainer::new(file.plan.clone(), &file.weights(), seed)?;
    let mut single = Trainer::new(reference.plan.clone(), &reference.weights(), seed)?;
    let dtype = TokenDtype::parse(&args.data_dtype)?;
    let data = TrainingData::open(&args.data.to_string_lossy(), dtype, plan.training().seq_len, seed, None, 0)?;

    let before: Vec<(String, Vec<f64>)> = params(&single)?;
    let mut agree = true;
    println!("{:>5} {:>14} {:>14} {:>10}", "step", "plan loss", "one device", "relative");
    for step in 1..=args.steps {
        let (a, b) = (plan.step(&data, args.steps)?.loss, single.step(&data, args.steps)?.loss);
        let relative = (a - b).abs() / b.abs().max(f64::MIN_POSITIVE);
        let limit = if step == 1 { tolerance } else { LATER_STEPS };
        let mark = if relative <= limit { "" } else { "  <- beyond tolerance" };
        println!("{step:>5} {a:>14.8} {b:>14.8} {relative:>10.2e}{mark}");
        agree &= relative <= limit;
        if step == 1 {
            agree &= compare_gradients(&plan, &single, &before, &reference, tolerance)?;
        }
    }
    println!("{}", if agree { "the plan trains like one device" } else { "the plan differs from one device" });
    Ok(agree)
}

/// A global tensor's elements (the shards' layout does not matter: both sides are global).
fn values(dtype: autotp_ir::DType, bytes: &[u8]) -> Vec<f64> {
    let tensor = autotp_ir::Tensor::from_pod(dtype, vec![bytes.len() / dtype.size()], bytes);
    (0..tensor.numel()).map(|i| tensor.get_f64(i)).collect()
}

fn params(trainer: &Trainer) -> Result<Vec<(String, Vec<f64>)>> {
    Ok(trainer.model_params()?.into_iter().map(|t| (t.name, values(t.dtype, &t.bytes))).collect())
}

/// Each trained parameter's step-1 gradient evidence on both sides: AdamW's first moment or
/// SGD's momentum buffer (`gradient + weight_decay * p` at step 1), else (SGD without momentum)
/// the parameter's move, whose f32 rounding is relative to the parameter, not the move.
fn evidence(plan: &Trainer, single: &Trainer, before: &[(String, Vec<f64>)]) -> Result<Vec<GradientEvidence>> {
    let moments = |t: &Trainer| -> Result<Vec<(String, Vec<f64>)>> {
        Ok(t.model_states()?
            .into_iter()
            .filter_map(|t| {
                let param = t.name.strip_prefix("adamw.m.").or_else(|| t.name.strip_prefix("sgd.momentum."))?;
                Some((param.to_string(), values(t.dtype, &t.bytes)))
            })
            .collect())
    };
    let pair =
        |plan_side: Vec<(String, Vec<f64>)>, single_side: Vec<(String, Vec<f64>)>, rounding: &dyn Fn(&str) -> f64| {
            single_side
                .into_iter()
                .filter_map(|(param, single)| {
                    let plan = plan_side.iter().find(|(p, _)| *p == param)?.1.clone();
                    Some(GradientEvidence { rounding: rounding(&param), param, plan, single })
                })
                .collect::<Vec<_>>()
        };
    let single_moments = moments(single)?;
    if single_moments.iter().any(|(_, m)| m.iter().any(|&v| v != 0.0)) {
        return Ok(pair(moments(plan)?, single_moments, &|_| 0.0));
    }
    let moved = |t: &Trainer| -> Result<Vec<(String, Vec<f64>)>> {
        Ok(params(t)?
            .into_iter()
            .filter_map(|(name, now)| {
                let start = &before.iter().find(|(n, _)| *n == name)?.1;
                Some((name, now.iter().zip(start).map(|(a, b)| a - b).collect()))
            })
            .collect())
    };
    let single_moves = moved(single)?;
    let rounding = |param: &str| {
        let start = before.iter().find(|(n, _)| n == param).map_or(0.0, |(_, p)| largest(p));
        let step = single_moves.iter().find(|(n, _)| n == param).map_or(0.0, |(_, d)| largest(d));
        4.0 * f64::from(f32::EPSILON) * start / step.max(f64::MIN_POSITIVE)
    };
    Ok(pair(moved(plan)?, single_moves.clone(), &rounding))
}

/// Where the one-device program makes each parameter's gradient: the last instruction before
/// the optimizer's that writes the gradient's region (its index, which orders the backward,
/// and its label, `node N (op)` or a fusion's), by parameter.
fn gradient_makers(program: &Program) -> BTreeMap<String, (usize, String)> {
    let param_at = |r: &Region| program.params.iter().find(|s| s.region == *r).map(|s| s.name.clone());
    let mut gradients: Vec<(String, Region, usize)> = Vec::new();
    for (at, instruction) in program.instructions.iter().enumerate() {
        match instruction {
            Instruction::OptimizerStep { tensors, .. } => {
                gradients.extend(tensors.iter().filter_map(|t| Some((param_at(&t.inputs[0])?, t.inputs[1], at))));
            }
            Instruction::Kernel { kernel: Kernel::AdamW { .. } | Kernel::Sgd { .. }, inputs, .. } => {
                gradients.extend(param_at(&inputs[0]).map(|p| (p, inputs[1], at)));
            }
            _ => {}
        }
    }
    gradients
        .into_iter()
        .filter_map(|(param, grad, step)| {
            let overlaps = |r: &Region| r.offset < grad.end() && grad.offset < r.end();
            let (at, maker) = program.instructions[..step]
                .iter()
                .enumerate()
                .rev()
                .find(|(_, i)| i.regions().1.iter().any(overlaps))?;
            Some((param, (at, maker.label().to_string())))
        })
        .collect()
}

/// Prints each gradient's relative difference, in backward order, and names the first beyond
/// `tolerance`; `Ok(true)` when none is.
fn compare_gradients(
    plan: &Trainer,
    single: &Trainer,
    before: &[(String, Vec<f64>)],
    reference: &Compiled,
    tolerance: f64,
) -> Result<bool> {
    let makers = gradient_makers(&reference.plan.stages[0]);
    let mut compared = evidence(plan, single, before)?;
    if compared.is_empty() {
        anyhow::bail!("no trained parameter to compare");
    }
    // Backward order: the gradient made first (nearest the loss) first.
    compared.sort_by_key(|e| makers.get(&e.param).map_or(usize::MAX, |(at, _)| *at));
    let mut first_wrong = None;
    // A gradient that is zero but for rounding (attention's key bias: softmax ignores what it
    // adds to a whole row of scores) is compared against a floor of the model's gradients.
    let floor = SMALL_GRADIENTS * compared.iter().fold(0f64, |m, e| m.max(largest(&e.single)));
    for e in &compared {
        let scale = largest(&e.single).max(floor).max(f64::MIN_POSITIVE);
        let worst = e.plan.iter().zip(&e.single).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
        let relative = if e.plan.len() == e.single.len() { worst / scale } else { f64::INFINITY };
        if relative > tolerance.max(e.rounding) && first_wrong.is_none() {
            first_wrong = Some((e.param.clone(), relative));
        }
    }
    println!(
        "step 1: {} gradients compared (largest difference over largest magnitude, at least {SMALL_GRADIENTS:.0e} \
         of the model's largest gradient)",
        compared.len()
    );
    if compared.iter().any(|e| e.rounding > tolerance) {
        println!(
            "step 1: no optimizer state holds the gradients (SGD without momentum): they are read from the \
             parameters' moves, within the f32 rounding of the parameters"
        );
    }
    match first_wrong {
        None => {
            println!("step 1: every gradient within {tolerance:.0e}");
            Ok(true)
        }
        Some((param, relative)) => {
            let maker = makers
                .get(&param)
                .map(|(at, label)| format!(", made by {label} (instruction {at} of the one-device program)"))
                .unwrap_or_default();
            println!("step 1: first gradient beyond {tolerance:.0e}: {param} ({relative:.2e}){maker}");
            Ok(false)
        }
    }
}
