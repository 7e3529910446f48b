//! `autotp train MODEL.onnx [compile flags] [run flags]`: `compile` and `run` in one process;
//! the plan stays in memory (or is also written with `-o PLAN.atp`), and the weights come
//! straight from the memory-mapped model.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use autotp_compiler::{CompileFlags, Weights};

use crate::compile;
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

pub fn run(args: &TrainArgs) -> Result<run::Ending> {
    // Under a launcher every process compiles the same plan (compiling is deterministic); the
    // first alone writes and prints it.
    let gpu = args.run.gpu()?;
    let written = args.output.iter().chain(&args.compile.report).chain(&args.run.metrics_out);
    for destination in written {
        crate::refuse_overwrite(destination, &args.compile.model, "the model being trained")?;
    }
    let first = autotp_runtime::launch::discover()?.rank == 0;
    let compiled = compile::compile(&args.compile, Weights::Read)?;
    if let (Some(path), true) = (&args.output, first) {
        autotp_program::plan::write(path, &compiled.plan, &compiled.weights(), &compiled.weight_references())?;
    }
    if first {
        let report = compile::report(&args.compile, &compiled.plan)?;
        eprint!("{}", autotp_compiler::summary::summary(&compiled.plan, &report));
    }
    let job = crate::job::start(&compiled.plan, args.run.comm_timeout)?;
    crate::job::run_in(job.as_ref(), || {
        let weights = compiled.weights();
        let mut trainer = args.run.trainer(compiled.plan.clone(), &weights, job.as_ref(), gpu, None)?;
        // The trainer copied the weights into its arena; the model's memory map can go.
        drop(weights);
        drop(compiled);
        run::train(&mut trainer, &args.run)
    })
}
