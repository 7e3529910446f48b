//! Fused attention (`compile --attention fused`): every attention the compile finds runs as one
//! op that never stores the scores, and trains the model the exported matmuls and softmax
//! train (1e-5 relative at step 1, 1e-3 over 30 steps), alone and under tensor and data
//! parallelism, in f32 and bf16, on the CPU and the emulated GPU, while the activations it keeps
//! grow linearly with the sequence.

use std::path::Path;

use crate::common::{autotp, fixture, losses, run_plan, scratch, success};

/// Compiles `arch` with `flags`; the summary.
fn compile(arch: &str, seq_len: usize, plan: &Path, flags: &[&str]) -> String {
    let model = fixture(arch, "model.onnx");
    let seq_len = seq_len.to_string();
    let args = [
        &["compile", model.to_str().unwrap(), "--seq-len", &seq_len, "--micro-batch", "4", "--lr", "2e-3"][..],
        flags,
        &["-o", plan.to_str().unwrap()],
    ]
    .concat();
    success(autotp(&args))
}

fn train(plan: &Path, metrics: &Path) -> Vec<f64> {
    run_plan(plan, metrics, 30, &[]);
    losses(metrics).into_iter().map(|(_, loss)| loss).collect()
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

#[test]
fn fused_attention_trains_like_the_unfused_graph() {
    let dir = scratch("attention-curves");
    // Llama's and Qwen2's key/value heads are repeated for their query heads (grouped-query
    // attention): the fused op reads them unrepeated, split over tp with the query heads.
    let cases: [(&str, &[&str], usize); 8] = [
        ("gpt2", &[], 2),
        ("gpt2", &["--kernels", "builtin"], 2),
        ("llama", &[], 2),
        ("qwen2", &["--tp", "2"], 2),
        ("bloom", &["--tp", "2"], 2),
        ("falcon_mqa", &["--tp", "2"], 2),
        ("mixtral", &["--dp", "2", "--zero", "3"], 2),
        ("gpt_neox", &["--tp", "2", "--dp", "2"], 2),
    ];
    for (arch, flags, layers) in cases {
        let label = format!("{arch} {flags:?}");
        let (unfused, fused) = (dir.join("unfused.atp"), dir.join("fused.atp"));
        compile(arch, 32, &unfused, &[flags, &["--attention", "unfused"]].concat());
        let summary = compile(arch, 32, &fused, flags);
        assert!(
            summary.contains(&format!(" attention {layers},"))
                && summary.contains(&format!(" attention_grad {layers},")),
            "{label}: every layer's attention is fused\n{summary}"
        );
        let want = train(&unfused, &dir.join("unfused.jsonl"));
        let got = train(&fused, &dir.join("fused.jsonl"));
        assert_eq!(got.len(), 30, "{label}");
        assert!(relative(got[0], want[0]) <= 1e-5, "{label}: step 1 {} against {}", got[0], want[0]);
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(relative(*g, *w) <= 1e-3, "{label}: step {} {g} against {w}", step + 1);
        }
    }
}

/// bf16 with fused attention (f32 inside the op, as SDPA under autocast) stays within 1e-2 of
/// the f32 curve.
#[test]
fn fused_attention_in_bf16_follows_f32() {
    let dir = scratch("attention-bf16");
    for arch in ["gpt2", "qwen2"] {
        let (f32_plan, bf16_plan) = (dir.join("f32.atp"), dir.join("bf16.atp"));
        compile(arch, 32, &f32_plan, &["--attention", "fused"]);
        compile(arch, 32, &bf16_plan, &["--attention", "fused", "--precision", "bf16"]);
        let want = train(&f32_plan, &dir.join("f32.jsonl"));
        let got = train(&bf16_plan, &dir.join("bf16.jsonl"));
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(relative(*g, *w) <= 1e-2, "{arch}: step {} bf16 {g} against f32 {w}", step + 1);
        }
    }
}

/// The planned activation peak: twice the sequence, twice the activations with fused
/// attention; more than that with the `[Sq, Sk]` scores and probabilities kept.
#[test]
fn fused_attention_activations_grow_linearly_with_the_sequence() {
    let dir = scratch("attention-memory");
    let peak = |seq_len: usize, mode: &str| {
        let summary = compile("gpt2", seq_len, &dir.join("plan.atp"), &["--attention", mode]);
        let line = summary.lines().find(|l| l.trim_start().starts_with("activations peak")).unwrap();
        line.split_whitespace().nth(4).unwrap().replace(',', "").parse::<f64>().unwrap()
    };
    let (fused_64, fused_128) = (peak(64, "fused"), peak(128, "fused"));
    let (unfused_64, unfused_128) = (peak(64, "unfused"), peak(128, "unfused"));
    assert!(fused_128 / fused_64 <= 2.001, "fused: {fused_64} -> {fused_128}");
    assert!(unfused_128 / unfused_64 > 2.1, "unfused: {unfused_64} -> {unfused_128}");
    assert!(fused_128 < unfused_128, "{fused_128} against {unfused_128}");
}

/// On the (emulated) GPU a fused attention runs as the plan's GPU passes (a thread per row, one
/// lane wide; `dk` and `dv` apart), which the emulator runs as the same descriptions compiled
/// for x86: the curve stays the CPU's (its passes are cut otherwise, so sums differ in order).
#[test]
fn fused_attention_runs_its_gpu_passes_on_the_emulated_gpu() {
    let dir = scratch("attention-gpu");
    for arch in ["llama", "falcon_mqa"] {
        let plan = dir.join(format!("{arch}.atp"));
        compile(arch, 32, &plan, &["--attention", "fused"]);
        let program = autotp_program::plan::PlanFile::open(&plan).unwrap().plan.stages[0].clone();
        let passes: usize = (program.instructions.iter())
            .map(|i| match i {
                autotp_program::Instruction::Kernel {
                    gpu: Some(autotp_program::gpu::GpuForm::Attention(p)), ..
                } => p.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(passes, 2 * 4, "{arch}: forward, dq, dk and dv of 2 layers run on the GPU");
        let want = train(&plan, &dir.join("cpu.jsonl"));
        let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
        let metrics = dir.join("gpu.jsonl");
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
        command.args(["run", plan.to_str().unwrap(), "--device", "cuda", "--data", tokens.to_str().unwrap()]);
        command.args(["--steps", "30", "--metrics-out", metrics.to_str().unwrap()]);
        success(command.env("AUTOTP_GPU", "emulated").output().unwrap());
        let got: Vec<f64> = losses(&metrics).into_iter().map(|(_, loss)| loss).collect();
        assert_eq!(got.len(), want.len(), "{arch}");
        assert!(relative(got[0], want[0]) <= 1e-5, "{arch}: step 1 {} against {}", got[0], want[0]);
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(relative(*g, *w) <= 1e-3, "{arch}: step {} {g} against {w}", step + 1);
        }
    }
}
