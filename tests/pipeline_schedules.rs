//! Megatron's interleaved pipeline (`--virtual-stages`) and the zero-bubble ZB-H1 schedule
//! (`--schedule zb-h1`) train the 4-layer fixtures as one rank does, alone and with tensor and
//! data parallelism (ZeRO 1 to 3, sequence parallelism); an interleaved run resumes bit-identically and under a plain pipeline; the
//! compile summary and `run` report the interleaved bubble; what the schedules cannot run is
//! refused.

use std::path::Path;

use crate::common::{autotp, failure, fixture, losses, run_plan, scratch, success};
use crate::parallel::{train_model, within_contract};

/// 30 AdamW steps of a global batch of 8 under each layout, against one rank (the contract:
/// 1e-5 relative at step 1, 1e-3 at every step).
#[test]
fn interleaved_and_zero_bubble_pipelines_train_like_one_rank() {
    let dir = scratch("pipeline-schedules");
    let layouts: &[(usize, &[&str])] = &[
        (2, &["--pp", "2", "--virtual-stages", "2", "--grad-accum", "4"]),
        (4, &["--pp", "2", "--virtual-stages", "2", "--grad-accum", "2"]),
        (2, &["--pp", "2", "--virtual-stages", "2", "--grad-accum", "4", "--tp", "2"]),
        (1, &["--pp", "2", "--virtual-stages", "2", "--grad-accum", "4", "--dp", "2", "--zero", "1"]),
        (2, &["--pp", "2", "--schedule", "zb-h1", "--grad-accum", "4"]),
        (1, &["--pp", "4", "--schedule", "zb-h1", "--grad-accum", "8"]),
        (2, &["--pp", "2", "--schedule", "zb-h1", "--grad-accum", "2", "--tp", "2", "--dp", "2", "--zero", "1"]),
        (1, &["--pp", "2", "--virtual-stages", "2", "--grad-accum", "4", "--dp", "2", "--zero", "3"]),
        (2, &["--pp", "2", "--virtual-stages", "2", "--grad-accum", "2", "--tp", "2", "--dp", "2", "--zero", "2"]),
        (1, &["--pp", "2", "--schedule", "zb-h1", "--grad-accum", "4", "--dp", "2", "--zero", "3"]),
        (2, &["--pp", "2", "--virtual-stages", "2", "--grad-accum", "4", "--tp", "2", "--sequence-parallel"]),
    ];
    for arch in ["gpt2", "llama"] {
        let single = train_model(&dir, arch, "model_4_layers.onnx", 8, &[]);
        for &(micro_batch, flags) in layouts {
            let got = train_model(&dir, arch, "model_4_layers.onnx", micro_batch, flags);
            let label = format!("{arch} micro-batch {micro_batch} {}", flags.join(" "));
            let (first, worst) = within_contract(&label, &got, &single);
            println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Compiles the 4-layer GPT-2 fixture at sequence 32 with `layout`.
fn compile(dir: &Path, name: &str, layout: &[&str]) -> std::path::PathBuf {
    let plan = dir.join(format!("{name}.atp"));
    let model = fixture("gpt2", "model_4_layers.onnx");
    let args = [&["compile", s(&model), "--seq-len", "32", "--lr", "2e-3"][..], layout, &["-o", s(&plan)]].concat();
    success(autotp(&args));
    plan
}

/// Each rank holds its model chunks' parameters, a checkpoint of them resumes bit-identically,
/// and it resumes under a plain pipeline (another layout) within 1e-5.
#[test]
fn an_interleaved_pipeline_resumes_bit_identically_and_under_another_layout() {
    let dir = scratch("pipeline-interleaved-resume");
    let interleaved = compile(
        &dir,
        "interleaved",
        &["--micro-batch", "2", "--pp", "2", "--virtual-stages", "2", "--grad-accum", "4"],
    );
    let plain = compile(&dir, "plain", &["--micro-batch", "2", "--pp", "2", "--grad-accum", "4"]);
    let (straight, first, rest, relaid) =
        (dir.join("straight.jsonl"), dir.join("first.jsonl"), dir.join("rest.jsonl"), dir.join("relaid.jsonl"));
    let ckpt = dir.join("ckpt");
    for file in [&straight, &first, &rest, &relaid] {
        let _ = std::fs::remove_file(file);
    }
    let _ = std::fs::remove_dir_all(&ckpt);
    run_plan(&interleaved, &straight, 10, &[]);
    run_plan(&interleaved, &first, 5, &["--save", s(&ckpt)]);
    run_plan(&interleaved, &rest, 10, &["--resume", s(&ckpt)]);
    let (straight, rest) = (losses(&straight), losses(&rest));
    assert_eq!(rest.len(), 5);
    for ((step, want), (_, got)) in straight[5..].iter().zip(&rest) {
        assert_eq!(got.to_bits(), want.to_bits(), "step {step}: resumed {got} != straight {want}");
    }
    let log = run_plan(&plain, &relaid, 10, &["--resume", s(&ckpt)]);
    assert!(log.contains("written by another parallel layout"), "{log}");
    let relaid = losses(&relaid);
    let worst = straight[5..].iter().zip(&relaid).map(|((_, a), (_, b))| ((a - b) / a).abs()).fold(0.0, f64::max);
    assert!(worst <= 1e-5, "interleaved -> plain pipeline: {worst:.2e} relative");
}

/// The summary names the model chunks and the interleaved bubble (P-1)/(V*M+P-1); `run`
/// measures each stage's idle share beside it; the interleaved plan's bubble is below the plain
/// one's.
#[test]
fn the_interleaved_bubble_is_reported_and_measured() {
    let dir = scratch("pipeline-interleaved-bubble");
    let model = fixture("gpt2", "model_4_layers.onnx");
    let plan = dir.join("interleaved.atp");
    let summary = success(autotp(&[
        "compile",
        s(&model),
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--pp",
        "2",
        "--virtual-stages",
        "2",
        "--grad-accum",
        "4",
        "-o",
        s(&plan),
    ]));
    // (P-1)/(V*M+P-1) = 1/9.
    assert!(
        summary.contains("pipeline: 2 stages x 2 model chunks per stage (interleaved), 1f1b schedule (whole backward) over 4 micro-batches; bubble (P-1)/(V*M+P-1) = 11.1% of a step"),
        "{summary}"
    );
    let log = run_plan(&plan, &dir.join("metrics.jsonl"), 3, &["--clock", "cpu"]);
    assert!(log.contains("(P-1)/(V*M+P-1)"), "{log}");
    let measured: Vec<f64> = log
        .lines()
        .filter(|l| l.split_whitespace().next().is_some_and(|first| first.parse::<usize>().is_ok()))
        .filter_map(|l| l.split_whitespace().nth(2)?.strip_suffix('%')?.parse().ok())
        .collect();
    assert_eq!(measured.len(), 2, "{log}");
    assert!(measured.iter().all(|share| (0.0..100.0).contains(share)), "{log}");
}

#[test]
fn impossible_schedules_are_refused() {
    let model = fixture("gpt2", "model_4_layers.onnx");
    let compile = |extra: &[&str]| {
        let args = [&["compile", s(&model), "--seq-len", "32", "--micro-batch", "2", "-o", "/dev/null"][..], extra];
        failure(autotp(&args.concat()))
    };
    let cases: &[(&[&str], &str)] = &[
        (&["--virtual-stages", "2"], "--virtual-stages place pipeline stages: they need --pp 2 or more"),
        (&["--pp", "2", "--virtual-stages", "2", "--grad-accum", "3"], "--grad-accum 3 must be a multiple of --pp 2"),
        (
            &["--pp", "2", "--virtual-stages", "2", "--grad-accum", "4", "--schedule", "gpipe"],
            "--schedule gpipe has no interleaved form",
        ),
        (
            &["--pp", "2", "--virtual-stages", "4", "--grad-accum", "4"],
            "cuts the model into 8 chunks, more than its 4 layers",
        ),
        (&["--pp", "2", "--schedule", "zb-h1", "--pp-backward", "whole"], "--pp-backward whole contradicts it"),
        (&["--pp", "2", "--schedule", "zb-h2"], "--schedule 'zb-h2' is not one of 1f1b, gpipe, zb-h1"),
    ];
    for (flags, want) in cases {
        let err = compile(flags);
        assert!(err.contains(want), "{flags:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{flags:?}: {err}");
    }
}

/// Interleaved pp 2 x dp 2 ZeRO 3 as four MPI processes trains bit-identically to rank threads.
#[test]
fn an_interleaved_pipeline_runs_as_processes_like_threads() {
    let dir = scratch("pipeline-interleaved-processes");
    let plan = compile(
        &dir,
        "interleaved-dp2",
        &["--micro-batch", "2", "--pp", "2", "--virtual-stages", "2", "--grad-accum", "4", "--dp", "2", "--zero", "3"],
    );
    let (threads, processes) = (dir.join("threads.jsonl"), dir.join("processes.jsonl"));
    for file in [&threads, &processes] {
        let _ = std::fs::remove_file(file);
    }
    run_plan(&plan, &threads, 10, &[]);
    run_plan(&plan, &processes, 10, &["--launch", "4"]);
    let (threads, processes) = (losses(&threads), losses(&processes));
    assert_eq!(threads.len(), 10);
    assert_eq!(processes, threads);
}

/// Megatron's flag names (`--tensor-model-parallel-size`, `--virtual-pipeline-model-parallel-size`,
/// ...) compile the plan autotp's names compile.
#[test]
fn megatrons_flag_names_compile_the_same_plan() {
    let model = fixture("gpt2", "model_4_layers.onnx");
    let fingerprint = |flags: &[&str]| {
        let args = [&["compile", s(&model)][..], flags, &["--sequence-parallel", "-o", "/dev/null"]].concat();
        let summary = success(autotp(&args));
        let line = summary.lines().find_map(|l| l.trim().strip_prefix("fingerprint: "));
        line.unwrap_or_else(|| panic!("{summary}")).to_string()
    };
    let megatron = fingerprint(&[
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--virtual-pipeline-model-parallel-size",
        "2",
    ]);
    let autotp_names = fingerprint(&[
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--global-batch",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--virtual-stages",
        "2",
    ]);
    assert_eq!(megatron, autotp_names);
}
