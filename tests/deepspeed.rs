//! `--deepspeed ds_config.json`: DeepSpeed's configuration keys become autotp's flags. Configs
//! built from DeepSpeed's documentation examples (its config-json and ZeRO pages) compile to the
//! very plan the equivalent flags make (same fingerprint); keys autotp does not implement are
//! listed in one warning; a flag that contradicts the file, an unknown scheduler and `"auto"` are
//! refused; DeepSpeed's warmup schedulers give its learning rates step for step.

use std::path::Path;

use crate::common::{autotp, failure, fixture, repo, scratch, success};

/// `compile` of the GPT-2 fixture at sequence 32 with `flags`: (stdout, stderr).
fn compile(plan: &Path, flags: &[&str]) -> (String, String) {
    let model = fixture("gpt2", "model.onnx");
    let args =
        [&["compile", model.to_str().unwrap(), "--seq-len", "32"][..], flags, &["-o", plan.to_str().unwrap()]].concat();
    let out = autotp(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (success(out), stderr)
}

fn fingerprint(summary: &str) -> String {
    summary
        .lines()
        .find_map(|l| l.trim().strip_prefix("fingerprint: "))
        .unwrap_or_else(|| panic!("{summary}"))
        .to_string()
}

/// Writes `config` to `dir/name` and returns its path as a string.
fn config(dir: &Path, name: &str, config: serde_json::Value) -> String {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    path.to_str().unwrap().to_string()
}

/// fp16 with DeepSpeed's dynamic loss scaling, Adam, gradient clipping, accumulation and ZeRO-2
/// with 5e8 buckets (the documentation's examples), over `--dp 2`; and bf16 with ZeRO-3, the
/// optimizer offloaded to NVMe and activation checkpointing: each the plan of the same flags.
#[test]
fn deepspeed_configs_compile_to_the_plans_of_their_flags() {
    let dir = scratch("deepspeed");
    let plan = dir.join("p.atp");
    let fp16 = config(
        &dir,
        "fp16.json",
        serde_json::json!({
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
            "fp16": {
                "enabled": true, "auto_cast": false, "loss_scale": 0, "initial_scale_power": 16,
                "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": false, "min_loss_scale": 1
            },
            "zero_optimization": {
                "stage": 2, "contiguous_gradients": true, "overlap_comm": true, "reduce_scatter": true,
                "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8
            },
            "wall_clock_breakdown": false
        }),
    );
    let (from_file, warned) = compile(&plan, &["--dp", "2", "--deepspeed", &fp16]);
    let (by_hand, _) = compile(
        &plan,
        &[
            "--dp",
            "2",
            "--micro-batch",
            "4",
            "--grad-accum",
            "2",
            "--global-batch",
            "16",
            "--grad-clip",
            "1",
            "--optimizer",
            "adamw",
            "--lr",
            "0.001",
            "--betas",
            "0.8,0.999",
            "--eps",
            "1e-8",
            "--weight-decay",
            "3e-7",
            "--precision",
            "fp16",
            "--zero",
            "2",
            "--reduce-bucket-size",
            "500000000",
        ],
    );
    assert_eq!(fingerprint(&from_file), fingerprint(&by_hand), "{from_file}");
    for key in [
        "fp16.auto_cast",
        "zero_optimization.overlap_comm",
        "zero_optimization.allgather_bucket_size",
        "wall_clock_breakdown",
    ] {
        assert!(warned.contains(key), "{key} is listed as ignored: {warned}");
    }
    assert_eq!(warned.matches("autotp does not implement").count(), 1, "one warning: {warned}");

    let states = dir.join("nvme");
    std::fs::create_dir_all(&states).unwrap();
    let bf16 = config(
        &dir,
        "bf16.json",
        serde_json::json!({
            "train_micro_batch_size_per_gpu": 4,
            "bf16": {"enabled": true},
            "zero_optimization": {
                "stage": 3, "sub_group_size": 1e9,
                "offload_optimizer": {"device": "nvme", "nvme_path": states.to_str().unwrap(), "pin_memory": true, "buffer_count": 4, "fast_init": false}
            },
            "activation_checkpointing": {
                "partition_activations": false, "cpu_checkpointing": false, "contiguous_memory_optimization": false,
                "number_checkpoints": null, "synchronize_checkpoint_boundary": false, "profile": false
            }
        }),
    );
    let (from_file, _) = compile(&plan, &["--dp", "2", "--deepspeed", &bf16]);
    let (by_hand, _) = compile(
        &plan,
        &[
            "--dp",
            "2",
            "--micro-batch",
            "4",
            "--precision",
            "bf16",
            "--zero",
            "3",
            "--offload-optimizer",
            "nvme",
            "--nvme-path",
            states.to_str().unwrap(),
            "--sub-group-size",
            "1000000000",
            "--buffer-count",
            "4",
            "--recompute",
            "full",
        ],
    );
    assert_eq!(fingerprint(&from_file), fingerprint(&by_hand), "{from_file}");
    assert!(from_file.contains("optimizer state on NVMe") && from_file.contains("recompute full"), "{from_file}");
}

/// A flag that contradicts the file, a scheduler autotp does not follow, and "auto" values are
/// refused, naming them; a flag that agrees is fine; `train` takes steps_per_print as
/// --log-every and WarmupLR's rates step for step.
#[test]
fn deepspeed_configs_refuse_contradictions_and_drive_train() {
    let dir = scratch("deepspeed-refusals");
    let plan = dir.join("p.atp");
    let zero2 = config(
        &dir,
        "z2.json",
        serde_json::json!({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}),
    );
    let model = fixture("gpt2", "model.onnx");
    let compile_args = |extra: &[&str]| -> Vec<String> {
        let head = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--dp", "2"];
        let tail = ["-o", plan.to_str().unwrap()];
        head.iter().chain(extra).chain(&tail).map(|s| s.to_string()).collect()
    };
    let refused = failure(autotp(&compile_args(&["--zero", "1", "--deepspeed", &zero2])));
    assert!(refused.contains("--zero 1 on the command line contradicts zero_optimization.stage = 2"), "{refused}");
    success(autotp(&compile_args(&["--zero=2", "--deepspeed", &zero2])));
    let scheduler = config(&dir, "s.json", serde_json::json!({"scheduler": {"type": "OneCycle", "params": {}}}));
    let refused = failure(autotp(&compile_args(&["--micro-batch", "4", "--deepspeed", &scheduler])));
    assert!(refused.contains("scheduler.type OneCycle") && refused.contains("WarmupCosineLR"), "{refused}");
    let auto = config(&dir, "a.json", serde_json::json!({"train_micro_batch_size_per_gpu": "auto"}));
    let refused = failure(autotp(&compile_args(&["--deepspeed", &auto])));
    assert!(refused.contains("train_micro_batch_size_per_gpu is \"auto\""), "{refused}");
    // A negative value reaches the flag's own check (not clap, as a flag named -1).
    let negative = config(&dir, "n.json", serde_json::json!({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}));
    let refused = failure(autotp(&compile_args(&["--micro-batch", "4", "--deepspeed", &negative])));
    assert!(refused.contains("--lr -1 is invalid: it must be a finite number of at least 0"), "{refused}");

    // WarmupLR, linear, with the optimizer's lr overridden by warmup_max_lr as DeepSpeed does:
    // DeepSpeed steps the scheduler after each optimizer step, so steps 1 and 2 both run at
    // warmup_min_lr, step 3 at 1/5 of the way.
    let every_two = config(
        &dir,
        "t.json",
        serde_json::json!({
            "train_micro_batch_size_per_gpu": 8,
            "steps_per_print": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {
                "warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 5, "warmup_type": "linear"
            }}
        }),
    );
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let metrics = dir.join("m.jsonl");
    let out = success(autotp(&[
        "train",
        model.to_str().unwrap(),
        "--seq-len",
        "32",
        "--deepspeed",
        &every_two,
        "--data",
        tokens.to_str().unwrap(),
        "--steps",
        "4",
        "--metrics-out",
        metrics.to_str().unwrap(),
    ]));
    let printed: Vec<&str> = out.lines().filter(|l| l.starts_with("step")).collect();
    assert_eq!(printed.len(), 3, "steps 1, 2 and 4: {out}");
    assert!(printed[1].contains(" 2/4") && printed[2].contains(" 4/4"), "{out}");
    let lrs: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"].as_f64().unwrap())
        .collect();
    let want = [0.0, 0.0, 0.0002, 0.0004];
    assert!(lrs.len() == 4 && lrs.iter().zip(want).all(|(got, want)| (got - want).abs() < 1e-12), "{lrs:?}");
}
