//! `autotp train MODEL.onnx [compile flags] [run flags]`: `compile` and `run` in one process;
//! the plan stays in memory (or is also written with `-o PLAN.atp`), and the weights come
//! straight from the memory-mapped model.

use std::path::PathBuf;

use anyhow::Result;
use autotp_runtime::trainer::Trainer;
use clap::Args;

use crate::compile::{self, CompileFlags};
use crate::run::{self, RunFlags};

#[derive(Args)]
pub struct TrainArgs {
    #[command(flatten)]
    compile: CompileFlags,
    #[command(flatten)]
    run: RunFlags,
    /// Also write the compiled plan here.
    #[arg(short, long, value_name = "PLAN.atp")]
    output: Option<PathBuf>,
}

pub fn run(args: &TrainArgs) -> Result<()> {
    let compiled = compile::compile(&args.compile)?;
    let weights = compiled.weights();
    if let Some(path) = &args.output {
        autotp_runtime::plan::write(path, &compiled.plan, &weights)?;
    }
    let report = compile::report(&args.compile, &compiled.plan)?;
    eprint!("{}", compile::summary(&compiled.plan, &report));
    let mut trainer = Trainer::new(compiled.plan.clone(), &weights, args.run.seed())?;
    // The trainer copied the weights into its arena; the model's memory map can go.
    drop(weights);
    drop(compiled);
    run::train(&mut trainer, &args.run)
}
