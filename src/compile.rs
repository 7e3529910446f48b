//! `autotp compile`: ONNX model -> training plan (`.atp`), through the compiler library
//! ([`autotp_compiler`]): the flags, validated; the compile; then what the command prints and
//! writes: `--explain-tp`'s table, `--dump-kernels`' files, the plan, `--report`'s JSON and the
//! summary.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use autotp_compiler::{CompileFlags, CompileOptions, Compiled, Weights};
use autotp_program::plan::TrainingPlan;
use clap::Args;

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

/// Compiles as `flags` say, printing `--explain-tp`'s table.
pub fn compile(flags: &CompileFlags, weights: Weights) -> Result<Compiled> {
    let compiled = autotp_compiler::compile(&CompileOptions::from_flags(flags)?, weights)?;
    if flags.explain_tp {
        for stage in &compiled.tp_explanations {
            println!("tensor-parallel placement (tp={}):", flags.tp);
            for e in stage {
                println!("  {:<50} {:<10} {}", e.weight, e.placement, e.reason);
            }
        }
        if flags.sequence_parallel {
            println!(
                "sequence parallelism: the hidden states between the blocks (the residual stream, and the norms and \
                 biases on it) run on each rank's {} of the {} tokens of a sequence; partial sums of hidden states are \
                 reduce-scattered over the tokens, gathered before each column-parallel GEMM, and gathered again in \
                 the backward; the replicated weights they use get their gradients all-reduced over tp",
                flags.seq_len / flags.tp,
                flags.seq_len
            );
        }
    }
    Ok(compiled)
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

/// `--dump-kernels DIR`: `[stageS-]kNNN-<name>.kir` and `.ll` per kernel, `[stageS-]<arch>.ptx`
/// per stage and GPU architecture.
fn dump_kernels(dir: &Path, plan: &TrainingPlan) -> Result<()> {
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
    let compiled = compile(&args.flags, weights)?;
    if let Some(dir) = &args.flags.dump_kernels {
        dump_kernels(dir, &compiled.plan)?;
    }
    let named = compiled.weight_references();
    if let Some(output) = &args.output {
        autotp_program::plan::write(output, &compiled.plan, &compiled.weights(), &named)?;
    }
    let report = report(&args.flags, &compiled.plan)?;
    print!("{}", autotp_compiler::summary::summary(&compiled.plan, &report));
    let files: std::collections::BTreeSet<String> = named.values().map(|r| r.file.display().to_string()).collect();
    match &args.output {
        Some(output) if !named.is_empty() => println!(
            "wrote {} (it reads {} of its initial weights from {}, checked by size and CRC-32C when it loads; \
             --embed-weights copies them into the plan)",
            output.display(),
            named.len(),
            files.into_iter().collect::<Vec<_>>().join(", ")
        ),
        Some(output) => println!("wrote {}", output.display()),
        None => println!("no plan written (no -o): the model's weights were not read"),
    }
    Ok(())
}
