//! Validation (`run --eval-every N --eval-iters K`): the plan's evaluation step computes the
//! loss the training step computes for the same weights and batch on every layout, and never
//! changes training.

use std::path::Path;

use crate::common::{autotp, failure, fixture, scratch, success, train_hf_export};

/// Each metrics line's step, training loss and validation loss (where there was one).
fn records(metrics: &Path) -> Vec<(u64, f64, Option<f64>)> {
    let text = std::fs::read_to_string(metrics).expect("the metrics file");
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
            let eval = v.get("eval_loss").and_then(serde_json::Value::as_f64);
            if let Some(loss) = eval {
                let perplexity = v["eval_perplexity"].as_f64().expect("a perplexity beside the loss");
                assert!((perplexity - loss.exp()).abs() <= 1e-9 * perplexity, "{line}");
            }
            (v["step"].as_u64().expect("step"), v["loss"].as_f64().expect("loss"), eval)
        })
        .collect()
}

/// `autotp train` of the tiny exported Llama on its Megatron corpus, global batch 4; returns the
/// metrics and what it printed.
fn train(dir: &Path, name: &str, layout: &[&str], extra: &[&str]) -> (Vec<(u64, f64, Option<f64>)>, String) {
    let corpus = fixture("hf_export", "corpus_megatron");
    let metrics = dir.join(format!("{name}.jsonl"));
    let data = ["--data", corpus.to_str().unwrap_or_default(), "--metrics-out", metrics.to_str().unwrap_or_default()];
    let stdout = success(train_hf_export(&[&data[..], layout, extra].concat()));
    (records(&metrics), stdout)
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// With the learning rate 0 the weights stay the initial ones, and the validation data is the
/// training data: every validation of batch 0 gives step 1's training loss (batch 0, initial
/// weights), on one rank, under ZeRO-3, tensor, context (all-gathered and around the ring) and
/// pipeline parallelism and their products.
#[test]
fn validation_computes_the_training_steps_loss_on_every_layout() {
    let dir = scratch("validation-layouts");
    let corpus = fixture("hf_export", "corpus_megatron");
    let corpus = corpus.to_str().unwrap_or_default();
    let layouts: [&[&str]; 10] = [
        &["--micro-batch", "4"],
        &["--micro-batch", "2", "--dp", "2", "--zero", "3"],
        &["--micro-batch", "4", "--tp", "2"],
        &["--micro-batch", "2", "--tp", "2", "--dp", "2", "--zero", "2"],
        &["--micro-batch", "2", "--pp", "2", "--grad-accum", "2"],
        &["--micro-batch", "1", "--pp", "2", "--dp", "2", "--zero", "3", "--grad-accum", "2"],
        &["--micro-batch", "2", "--grad-accum", "2", "--precision", "bf16"],
        // Context parallelism's load balance: the evaluation step's tokens in the same order.
        &["--micro-batch", "1", "--cp", "2", "--grad-accum", "4"],
        &["--micro-batch", "1", "--cp", "2", "--dp", "2", "--zero", "1", "--grad-accum", "2"],
        // Its ring: the evaluation step's attention around the ring too.
        &["--micro-batch", "1", "--cp", "2", "--cp-comm-type", "p2p", "--grad-accum", "4"],
    ];
    let eval = ["--lr", "0", "--steps", "2", "--eval-every", "1", "--eval-iters", "1", "--eval-data", corpus];
    let mut first_losses = Vec::new();
    for (i, layout) in layouts.iter().enumerate() {
        let (records, stdout) = train(&dir, &format!("layout{i}"), layout, &eval);
        assert!(stdout.contains("validation at step 2: loss"), "{stdout}");
        let step1 = records[0].1;
        let tolerance = if layout.contains(&"bf16") { 1e-3 } else { 1e-6 };
        for (step, _, validation) in &records {
            let validation = validation.unwrap_or_else(|| panic!("{layout:?}: no validation at step {step}"));
            assert!(
                relative(validation, step1) <= tolerance,
                "{layout:?} step {step}: validation {validation} against step 1's loss {step1}"
            );
        }
        first_losses.push(step1);
    }
    for (layout, loss) in layouts.iter().zip(&first_losses) {
        assert!(relative(*loss, first_losses[0]) <= 1e-3, "{layout:?}: {loss} against one rank's {}", first_losses[0]);
    }
}

/// Validating every other step on the `--split`'s validation part changes no training loss by
/// a bit; the validation loss falls as the model trains.
#[test]
fn validation_leaves_training_bit_identical() {
    let dir = scratch("validation-untouched");
    let layout = ["--micro-batch", "1", "--pp", "2", "--tp", "2", "--grad-accum", "2", "--lr", "3e-3"];
    let split = ["--steps", "6", "--split", "80,20,0"];
    let (plain, _) = train(&dir, "plain", &layout, &split);
    let (validated, stdout) = train(&dir, "validated", &layout, &[&split[..], &["--eval-every", "2"]].concat());
    let losses = |records: &[(u64, f64, Option<f64>)]| records.iter().map(|r| r.1).collect::<Vec<f64>>();
    assert_eq!(losses(&validated), losses(&plain), "validation changed training");
    let evaluated: Vec<(u64, f64)> = validated.iter().filter_map(|&(step, _, eval)| Some((step, eval?))).collect();
    assert_eq!(evaluated.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 4, 6], "{stdout}");
    assert!(evaluated[2].1 < evaluated[0].1, "the validation loss falls: {evaluated:?}");
    assert!(plain.iter().all(|r| r.2.is_none()));
}

/// Validation without validation data, or with 0 batches, is refused in one line.
#[test]
fn validation_needs_validation_data() {
    let dir = scratch("validation-refused");
    let corpus = fixture("hf_export", "corpus_megatron");
    let data = ["--micro-batch", "2", "--steps", "1", "--data", corpus.to_str().unwrap_or_default()];
    let refused = |extra: &[&str]| failure(train_hf_export(&[&data[..], extra].concat()));
    let err = refused(&["--eval-every", "1"]);
    assert!(err.contains("--eval-every needs validation data: --eval-data, or --split"), "{err}");
    let err = refused(&["--eval-every", "1", "--split", "100,0,0"]);
    assert!(err.contains("--eval-every needs validation data"), "{err}");
    let err = refused(&["--eval-every", "1", "--eval-iters", "0", "--split", "9,1"]);
    assert!(err.contains("--eval-iters must be at least 1"), "{err}");
    let missing = dir.join("missing");
    let err = refused(&["--eval-every", "1", "--eval-data", missing.to_str().unwrap_or_default()]);
    assert!(err.contains("--eval-data") && err.contains("missing"), "{err}");
}

/// Ranks as MPI processes and ranks on emulated GPUs (threads and processes) validate as rank
/// threads do (tp 2 x dp 2 ZeRO-3): the same validation losses.
#[test]
fn validation_runs_on_processes_and_gpus() {
    let dir = scratch("validation-devices");
    let model = fixture("hf_export", "model.onnx");
    let corpus = fixture("hf_export", "corpus_megatron");
    let plan = dir.join("plan.atp");
    let layout = ["--micro-batch", "2", "--tp", "2", "--dp", "2", "--zero", "3"];
    let compile = [&["compile", model.to_str().unwrap_or_default(), "--seq-len", "16"][..], &layout];
    success(autotp(&[&compile.concat()[..], &["-o", plan.to_str().unwrap_or_default()]].concat()));
    let run = |name: &str, extra: &[&str], gpu: bool| {
        let metrics = dir.join(format!("{name}.jsonl"));
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
        command.args(["run", plan.to_str().unwrap_or_default(), "--data", corpus.to_str().unwrap_or_default()]);
        command.args(["--split", "80,20,0", "--steps", "4", "--eval-every", "2", "--eval-iters", "2"]);
        command.args(["--metrics-out", metrics.to_str().unwrap_or_default()]).args(extra);
        if gpu {
            command.env("AUTOTP_GPU", "emulated");
        }
        success(command.output().expect("autotp runs"));
        records(&metrics).into_iter().filter_map(|(step, _, eval)| Some((step, eval?))).collect::<Vec<_>>()
    };
    let threads = run("threads", &[], false);
    assert_eq!(threads.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 4]);
    assert_eq!(run("processes", &["--launch", "4"], false), threads, "processes against threads");
    // GPU ranks of a job join their NCCL communicators through the job's when the validation
    // step loads, between training steps.
    for (name, extra) in [("gpu", &["--device", "cuda"][..]), ("gpu-processes", &["--device", "cuda", "--launch", "4"])]
    {
        let gpu = run(name, extra, true);
        assert_eq!(gpu.len(), threads.len(), "{name}");
        for ((_, on_gpu), (_, on_cpu)) in gpu.iter().zip(&threads) {
            assert!(
                relative(*on_gpu, *on_cpu) <= 1e-6,
                "{name}: the emulated GPU's {on_gpu} against the CPU's {on_cpu}"
            );
        }
    }
}

/// The README's main job in small (examples/kjv: its corpus, tokenizer and GPT, as run.sh runs
/// them): 60 steps on two ranks, the training and the validation loss both falling.
#[test]
fn the_main_jobs_example_learns_its_corpus() {
    let dir = scratch("validation-kjv");
    let example = crate::common::repo().join("examples/kjv");
    let prefix = dir.join("kjv");
    let path = |name: &str| example.join(name).display().to_string();
    success(autotp(&[
        "data",
        "prepare",
        &path("chapters.jsonl"),
        "--tokenizer",
        &path("tokenizer.json"),
        "-o",
        prefix.to_str().unwrap_or_default(),
    ]));
    let metrics = dir.join("kjv.jsonl");
    let mut args = vec!["train".to_string(), path("model.onnx")];
    args.extend(["--seq-len", "128", "--micro-batch", "8", "--dp", "2", "--steps", "60"].map(String::from));
    args.extend(
        ["--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", "10", "--min-lr", "3e-4", "--grad-clip", "1.0"]
            .map(String::from),
    );
    args.extend(["--data".into(), prefix.display().to_string(), "--split".into(), "95,5,0".into()]);
    args.extend(["--eval-every", "20", "--eval-iters", "4", "--metrics-out"].map(String::from));
    args.push(metrics.display().to_string());
    success(autotp(&args));
    let records = records(&metrics);
    let last_ten = records[50..].iter().map(|r| r.1).sum::<f64>() / 10.0;
    assert!(last_ten < records[0].1 - 2.0, "training loss {} -> {last_ten} over the last 10 steps", records[0].1);
    let validation: Vec<f64> = records.iter().filter_map(|r| r.2).collect();
    assert!(validation.len() == 3 && validation.windows(2).all(|w| w[1] < w[0]), "validation losses {validation:?}");
}
