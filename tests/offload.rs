//! Optimizer offload (`--offload-optimizer cpu`): the optimizer's states (f32 masters, moments)
//! in a host pool outside the arena. The step is the same kernel on the same bytes (in place,
//! skipped whole on non-finite gradients, writing the 16-bit copies of the masters), so 30 steps
//! train bit-identically to keeping the states in the arena, with clipping and fp16's skipped
//! steps, under data, tensor and pipeline parallelism; the arena shrinks by exactly the states'
//! bytes; checkpoints resume bit-identically and hold what an in-arena run's hold.

use std::path::Path;

use crate::common::{autotp, failure, fixture, repo, run_plan, scratch, success};

/// Compiles the GPT-2 fixture at sequence length 32 with `flags`; the summary.
fn compile(plan: &Path, flags: &[&str]) -> String {
    let model = fixture("gpt2", "model.onnx");
    let args = [
        &["compile", model.to_str().unwrap(), "--seq-len", "32", "--lr", "2e-3", "--grad-clip", "1.0"][..],
        flags,
        &["-o", plan.to_str().unwrap()],
    ]
    .concat();
    success(autotp(&args))
}

/// Runs `plan` to step `steps` (`extra` added); every metric line without its timings.
fn run(plan: &Path, metrics: &Path, steps: usize, extra: &[&str]) -> Vec<serde_json::Value> {
    run_plan(plan, metrics, steps, extra);
    let lines = std::fs::read_to_string(metrics).unwrap();
    lines
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let fields = v.as_object_mut().unwrap();
            fields.retain(|k, _| !k.contains("seconds") && !k.contains("per_second"));
            v
        })
        .collect()
}

/// A summary's per-rank figure for `what` (the first such line).
fn figure(summary: &str, what: &str) -> usize {
    let line =
        summary.lines().map(str::trim_start).find(|l| l.starts_with(what)).unwrap_or_else(|| panic!("{summary}"));
    let rest = line[what.len()..].trim_start_matches(':');
    rest.split_whitespace().next().unwrap().replace(',', "").parse().unwrap()
}

/// 30 steps with the optimizer offloaded equal 30 steps without, metric for metric (loss, norm,
/// skipped steps, loss scale): bf16 on one rank, fp16 from a scale that overflows for its first
/// steps, dp 2 ZeRO 3, tp 2 with ZeRO 1 and pp 2. On one rank the arena shrinks by exactly the
/// optimizer state, which the summary shows in the host pool.
#[test]
fn offloaded_optimizer_trains_bit_identically() {
    let dir = scratch("offload-cpu");
    let layouts: [&[&str]; 5] = [
        &["--micro-batch", "8", "--precision", "bf16"],
        &["--micro-batch", "8", "--precision", "fp16", "--initial-scale-power", "24"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "3", "--precision", "bf16"],
        &["--micro-batch", "8", "--tp", "2", "--dp", "2", "--zero", "1"],
        &["--micro-batch", "4", "--pp", "2", "--grad-accum", "2", "--precision", "bf16"],
    ];
    for (l, layout) in layouts.iter().enumerate() {
        let (kept, offloaded) = (dir.join("kept.atp"), dir.join("offloaded.atp"));
        let kept_summary = compile(&kept, layout);
        let summary = compile(&offloaded, &[&layout[..], &["--offload-optimizer", "cpu"]].concat());
        let a = run(&kept, &dir.join("kept.jsonl"), 30, &[]);
        let b = run(&offloaded, &dir.join("offloaded.jsonl"), 30, &[]);
        assert_eq!(a, b, "{layout:?}");
        if l == 1 {
            let skipped = b.iter().filter(|m| m["skipped"] == true).count();
            assert!(skipped > 0, "fp16 from 2^24 skips its first steps");
        }
        if l <= 1 {
            // The step runs in place, guarded by the gradients' finiteness, and makes the 16-bit
            // copies itself: the selects after it are gone.
            let instructions = |summary: &str| figure(summary, "instructions");
            assert!(instructions(&summary) < instructions(&kept_summary), "{summary}");
            let states = figure(&kept_summary, "optimizer state");
            assert!(states > 0);
            assert_eq!(figure(&summary, "optimizer state"), 0, "{summary}");
            assert_eq!(figure(&summary, "optimizer state offloaded (host pool)"), states, "{summary}");
            assert_eq!(figure(&kept_summary, "total arena") - figure(&summary, "total arena"), states);
        }
    }
}

/// Where the optimizer step sets the activation peak (a small batch, bf16), the in-place step
/// lowers it: the new masters, moments and 16-bit parameters need no memory of their own.
#[test]
fn offloaded_optimizer_steps_in_place() {
    let dir = scratch("offload-cpu-in-place");
    let peak = |flags: &[&str]| {
        let summary =
            compile(&dir.join("p.atp"), &[&["--micro-batch", "4", "--precision", "bf16"][..], flags].concat());
        figure(&summary, "activations peak (with gradients)")
    };
    let (kept, offloaded) = (peak(&[]), peak(&["--offload-optimizer", "cpu"]));
    assert!(offloaded < kept, "activations peak {offloaded} offloaded, {kept} kept");
}

/// An offloaded run saved midway resumes bit-identically, and its checkpoint holds the states
/// an in-arena run's holds, byte for byte.
#[test]
fn offloaded_optimizer_checkpoints_resume_bit_identically() {
    let dir = scratch("offload-cpu-checkpoint");
    let flags = ["--micro-batch", "4", "--precision", "bf16", "--dp", "2", "--zero", "2"];
    let (kept, offloaded) = (dir.join("kept.atp"), dir.join("offloaded.atp"));
    compile(&kept, &flags);
    compile(&offloaded, &[&flags[..], &["--offload-optimizer", "cpu"]].concat());
    let whole = run(&offloaded, &dir.join("whole.jsonl"), 10, &[]);
    let (save, kept_save) = (dir.join("ck"), dir.join("kept-ck"));
    run(&offloaded, &dir.join("first.jsonl"), 5, &["--save", save.to_str().unwrap()]);
    let resumed = run(&offloaded, &dir.join("rest.jsonl"), 10, &["--resume", save.to_str().unwrap()]);
    assert_eq!(resumed, whole[5..], "resumed from step 5");
    run(&kept, &dir.join("kept.jsonl"), 5, &["--save", kept_save.to_str().unwrap()]);
    let (a, b) = (
        autotp_runtime::checkpoint::Checkpoint::open(&save).unwrap(),
        autotp_runtime::checkpoint::Checkpoint::open(&kept_save).unwrap(),
    );
    let states = a.states();
    assert!(states.iter().any(|t| t.name.starts_with("master.")), "the masters are saved");
    for t in states.iter().chain(&a.params()) {
        assert!(t.bytes == b.tensor(&t.name).unwrap().bytes, "'{}' after 5 steps", t.name);
    }
}

/// On a GPU the offloaded optimizer is refused when the plan loads, saying so.
#[test]
fn offloaded_optimizer_is_refused_on_a_gpu() {
    let dir = scratch("offload-cpu-gpu");
    let plan = dir.join("p.atp");
    compile(&plan, &["--micro-batch", "4", "--offload-optimizer", "cpu"]);
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
    command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "1"]);
    let refused = failure(command.args(["--device", "cuda"]).env("AUTOTP_GPU", "emulated").output().unwrap());
    assert!(refused.contains("--offload-optimizer"), "{refused}");
}
