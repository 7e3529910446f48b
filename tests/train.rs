//! Single-rank training through `autotp train` against PyTorch's loss curves
//! (tests/fixtures/make_training_fixtures.py): 30 AdamW steps (lr 2e-3, betas 0.9/0.95, eps 1e-8,
//! weight decay 0.01), global batch 8, sequence 32, the contract's data windows and loss. The
//! contract's tolerance: 1e-5 relative at step 1, 1e-3 at every step.

use std::process::Command;

use crate::common::{failure, fixture, repo};

/// Runs `autotp train` on an architecture's logits export over the committed token file.
fn autotp_train(arch: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(["train", fixture(arch, "model.onnx").to_str().unwrap(), "--seq-len", "32"])
        .args(["--data", repo().join("tests/fixtures/train/tokens.bin").to_str().unwrap()])
        .args(args)
        .output()
        .unwrap()
}

fn train_matches_pytorch(arch: &str) {
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join(format!("tests/fixtures/train/{arch}_adamw.json"))).unwrap(),
    )
    .unwrap();
    let want: Vec<f64> = reference["losses"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let metrics = std::env::temp_dir().join(format!("autotp-train-{}-{arch}.jsonl", std::process::id()));
    let out = autotp_train(
        arch,
        &["--micro-batch", "8", "--steps", "30", "--lr", "2e-3", "--betas", "0.9,0.95", "--eps", "1e-8"]
            .into_iter()
            .chain(["--weight-decay", "0.01", "--metrics-out", metrics.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{arch}: {}", String::from_utf8_lossy(&out.stderr));
    let got: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(got.len(), want.len(), "{arch}: {} metric lines", got.len());
    let relative: Vec<f64> = got.iter().zip(&want).map(|(g, w)| (g - w).abs() / w.abs()).collect();
    assert!(relative[0] <= 1e-5, "{arch}: step 1 loss {} vs torch {} ({:.2e} relative)", got[0], want[0], relative[0]);
    let (worst_step, worst) =
        relative.iter().enumerate().fold((0, 0f64), |acc, (i, &r)| if r > acc.1 { (i, r) } else { acc });
    assert!(
        worst <= 1e-3,
        "{arch}: step {} loss {} vs torch {} ({worst:.2e} relative)",
        worst_step + 1,
        got[worst_step],
        want[worst_step]
    );
    assert!(got[29] < got[0], "{arch}: the loss did not fall ({} -> {})", got[0], got[29]);
    println!(
        "{arch}: 30 steps, loss {:.6} -> {:.6}, step 1 {:.2e}, worst {worst:.2e} relative to torch",
        got[0], got[29], relative[0]
    );
}

#[test]
fn gpt2_trains_like_pytorch() {
    train_matches_pytorch("gpt2");
}

#[test]
fn llama_trains_like_pytorch() {
    train_matches_pytorch("llama");
}

#[test]
fn bad_training_input() {
    let model = fixture("gpt2", "model.onnx");
    let short = std::env::temp_dir().join(format!("autotp-short-{}.bin", std::process::id()));
    std::fs::write(&short, [1u8, 0, 2, 0, 3, 0]).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(["train", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "2", "--steps", "1"])
        .args(["--data", short.to_str().unwrap()])
        .output()
        .unwrap();
    let err = failure(out);
    assert!(err.contains("holds 3 tokens, fewer than one window of seq-len + 1 = 33"), "{err}");
    let one_step = ["--micro-batch", "2", "--steps", "1"];
    let err = failure(autotp_train("gpt2", &[&one_step[..], &["--data-dtype", "u8"]].concat()));
    assert!(err.contains("unknown token dtype 'u8' (expected u16 or u32)"), "{err}");
    let err = failure(autotp_train("gpt2", &[&one_step[..], &["--optimizer", "lion"]].concat()));
    assert!(err.contains("--optimizer 'lion' is not one of adamw, sgd"), "{err}");
}

#[test]
fn cosine_schedule_follows_hugging_face() {
    let metrics = std::env::temp_dir().join(format!("autotp-train-cosine-{}.jsonl", std::process::id()));
    let metrics_path = metrics.to_str().unwrap();
    let schedule =
        ["--micro-batch", "2", "--steps", "6", "--lr", "1e-2", "--lr-schedule", "cosine", "--warmup-steps", "2"];
    let out = autotp_train("gpt2", &[&schedule[..], &["--metrics-out", metrics_path]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lrs: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"].as_f64().unwrap())
        .collect();
    let expected: Vec<f64> = (0..6)
        .map(|s| {
            if s < 2 {
                1e-2 * s as f64 / 2.0
            } else {
                1e-2 * 0.5 * (1.0 + (std::f64::consts::PI * (s - 2) as f64 / 4.0).cos())
            }
        })
        .collect();
    for (got, want) in lrs.iter().zip(&expected) {
        assert!((got - want).abs() < 1e-12, "lr {got} != {want} ({lrs:?})");
    }
    let stderr = failure(autotp_train("gpt2", &["--micro-batch", "2", "--steps", "1", "--lr-schedule", "linear"]));
    assert!(stderr.contains("--lr-schedule 'linear' is not one of constant, cosine"), "{stderr}");
}

/// `run --profile` prints rank 0's time per step by op (every instruction counted once) and
/// its slowest instructions.
#[test]
fn profile_lists_time_by_op() {
    let out = autotp_train("gpt2", &["--micro-batch", "4", "--steps", "2", "--profile", "-o", "/dev/null"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(stdout.contains("profile of rank 0, 2 steps"), "{stdout}");
    let rows: Vec<(&str, usize)> = stdout
        .lines()
        .filter(|l| l.trim_end().ends_with('%'))
        .map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            (fields[0], fields[1].parse().unwrap())
        })
        .collect();
    assert!(rows.contains(&("matmul", 39)) && rows.contains(&("multi_tensor_adamw", 1)), "{stdout}");
    assert!(stdout.contains("slowest instructions") && stdout.contains("node "), "{stdout}");
}

/// `train` takes every compile flag: `--report` writes the plan's per-rank report.
#[test]
fn train_writes_the_report() {
    let report = crate::common::scratch("train-report").join("report.json");
    let out = autotp_train("gpt2", &["--micro-batch", "4", "--steps", "1", "--report", report.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(json["ranks"][0]["params_bytes"].as_u64(), Some(4 * 172_288), "{json}");
}
