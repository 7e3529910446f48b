//! Activation recomputation (`--recompute selective`): core attention recomputed in the
//! backward trains bit-identically to keeping it (the same kernels on the same inputs), under
//! every layout and precision, and lowers the planned activation peak by what the attention
//! scores and probabilities took.

use std::path::Path;

use crate::common::{autotp, fixture, losses, repo, scratch, success};

/// Compiles `arch` at sequence length 128 with `flags`; the summary.
fn compile(arch: &str, plan: &Path, flags: &[&str]) -> String {
    let model = fixture(arch, "model.onnx");
    let args = [
        &["compile", model.to_str().unwrap(), "--seq-len", "128", "--lr", "2e-3"][..],
        flags,
        &["-o", plan.to_str().unwrap()],
    ]
    .concat();
    success(autotp(&args))
}

fn train(plan: &Path, metrics: &Path, save: &Path) -> Vec<(u64, f64)> {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    success(autotp(&[
        "run",
        plan.to_str().unwrap(),
        "--data",
        tokens.to_str().unwrap(),
        "--steps",
        "6",
        "--metrics-out",
        metrics.to_str().unwrap(),
        "--save",
        save.to_str().unwrap(),
    ]));
    losses(metrics)
}

/// The recompute lines of a summary: (blocks, with, without) per stage.
fn recompute_lines(summary: &str) -> Vec<(usize, usize, usize)> {
    let number = |s: &str| s.trim_matches(|c: char| !c.is_ascii_digit()).replace(',', "").parse::<usize>().unwrap();
    summary
        .lines()
        .filter(|l| l.contains("recompute selective:"))
        .map(|l| {
            let blocks = number(l.split(" attention blocks").next().unwrap().rsplit(' ').next().unwrap());
            let with = number(l.split("activations peak ").nth(1).unwrap().split(' ').next().unwrap());
            let without = number(l.split("without: ").nth(1).unwrap().split(", ").next().unwrap());
            (blocks, with, without)
        })
        .collect()
}

/// GPT-2 and Llama, f32 and bf16, one rank and tp 2, dp 2 ZeRO 3, pp 2: six steps with
/// core attention recomputed give the same losses and the same final weights, bit for bit, as
/// keeping it, with a lower planned activation peak where a stage holds attention.
#[test]
fn selective_recomputation_trains_bit_identically_with_less_memory() {
    let dir = scratch("recompute");
    let layouts: [&[&str]; 4] = [
        &["--micro-batch", "8"],
        &["--micro-batch", "8", "--tp", "2"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "3"],
        &["--micro-batch", "4", "--pp", "2", "--grad-accum", "2"],
    ];
    for arch in ["gpt2", "llama"] {
        for precision in ["f32", "bf16"] {
            for (l, layout) in layouts.iter().enumerate() {
                let flags = [&["--precision", precision][..], layout].concat();
                let label = format!("{arch} {precision} {layout:?}");
                let (kept, again) = (dir.join("kept.atp"), dir.join("again.atp"));
                compile(arch, &kept, &flags);
                let summary = compile(arch, &again, &[&flags[..], &["--recompute", "selective"]].concat());
                let lines = recompute_lines(&summary);
                assert_eq!(lines.len(), if l == 3 { 2 } else { 1 }, "{label}: a line per stage\n{summary}");
                let blocks: usize = lines.iter().map(|l| l.0).sum();
                assert_eq!(blocks, 2 * if l == 3 { 2 } else { 1 }, "{label}: a block per layer and micro-batch");
                for &(blocks, with, without) in &lines {
                    assert!(blocks == 0 || with < without, "{label}: peak {with} with, {without} without");
                }
                let (ck_kept, ck_again) = (dir.join(format!("ck-kept-{l}")), dir.join(format!("ck-again-{l}")));
                let a = train(&kept, &dir.join("kept.jsonl"), &ck_kept);
                let b = train(&again, &dir.join("again.jsonl"), &ck_again);
                assert_eq!(a, b, "{label}: losses");
                let (a, b) = (
                    autotp_runtime::checkpoint::Checkpoint::open(&ck_kept).unwrap(),
                    autotp_runtime::checkpoint::Checkpoint::open(&ck_again).unwrap(),
                );
                for t in a.params() {
                    assert!(t.bytes == b.tensor(&t.name).unwrap().bytes, "{label}: '{}' after 6 steps", t.name);
                }
            }
        }
    }
}
