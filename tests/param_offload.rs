//! Parameter offload (`--offload-param cpu`, DeepSpeed's `offload_param`): ZeRO-3's parameter
//! shards live in host memory outside the arena, read by their gathers and updated there by
//! the optimizer. Training is bit-identical to keeping them in the arena, under dp, tp and pp,
//! with the optimizer offloaded too and in bf16, validation included; the arena shrinks by exactly the shards'
//! bytes; the bytes read from them per step are their gathers' inputs; checkpoints resume
//! bit-identically; `--deepspeed` maps `offload_param`; what is not implemented is refused.

use crate::common::{autotp, failure, fixture, repo, scratch};
use crate::offload::{compile, run};

/// The number on the summary's memory table row `what` (the first line of `what`, spaces and a
/// number; not `parameters: N in ...`).
fn memory_row(summary: &str, what: &str) -> usize {
    let row = |l: &&str| l.strip_prefix(what).is_some_and(|rest| rest.starts_with("  "));
    let line = summary.lines().map(str::trim_start).find(row).unwrap_or_else(|| panic!("{what}: {summary}"));
    line[what.len()..].split_whitespace().next().unwrap().replace(',', "").parse().unwrap()
}

#[test]
fn offloaded_parameters_train_bit_identically_in_a_smaller_arena() {
    let dir = scratch("param-offload");
    let layouts: [&[&str]; 5] = [
        &["--micro-batch", "4", "--dp", "2", "--zero", "3"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "3", "--precision", "bf16"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "3", "--offload-optimizer", "cpu"],
        &["--micro-batch", "8", "--dp", "2", "--tp", "2", "--zero", "3"],
        &["--micro-batch", "2", "--dp", "2", "--pp", "2", "--grad-accum", "2", "--zero", "3"],
    ];
    for layout in layouts {
        let (kept, offloaded) = (dir.join("kept.atp"), dir.join("offloaded.atp"));
        let kept_summary = compile(&kept, layout);
        let summary = compile(&offloaded, &[layout, &["--offload-param", "cpu"]].concat());
        let (a, b) = (dir.join("kept.jsonl"), dir.join("offloaded.jsonl"));
        // Validation reads the offloaded shards too.
        let tokens = repo().join("tests/fixtures/train/tokens.bin");
        let validate = ["--eval-every", "10", "--eval-iters", "1", "--eval-data", tokens.to_str().unwrap()];
        let (kept_metrics, offloaded_metrics) = (run(&kept, &a, 30, &validate), run(&offloaded, &b, 30, &validate));
        assert!(offloaded_metrics.iter().any(|m| m.get("eval_loss").is_some()));
        assert_eq!(kept_metrics, offloaded_metrics, "{layout:?}");
        if layout.contains(&"--pp") {
            assert!(summary.contains("parameter offload (stage 1): "), "{summary}");
            continue;
        }
        let shards = memory_row(&summary, "parameters offloaded (host pool)");
        assert!(shards > 0, "{summary}");
        // Parameters ZeRO-3 keeps whole (too small to divide) stay in the arena.
        assert_eq!(memory_row(&kept_summary, "parameters"), memory_row(&summary, "parameters") + shards, "{summary}");
        assert_eq!(
            memory_row(&kept_summary, "total arena") - memory_row(&summary, "total arena"),
            shards,
            "{layout:?}"
        );
        println!("{layout:?}: {shards} bytes of shards offloaded, 30 steps bit-identical");
    }
}

/// At dp 2 each gather sends the rank's shard once: the bytes read from the offloaded shards per
/// step are the all-gathers' bytes sent.
#[test]
fn offloaded_parameters_are_read_by_their_gathers() {
    let dir = scratch("param-offload-fetch");
    let summary =
        compile(&dir.join("p.atp"), &["--micro-batch", "4", "--dp", "2", "--zero", "3", "--offload-param", "cpu"]);
    let line = summary.lines().find(|l| l.contains("parameter offload: ")).unwrap_or_else(|| panic!("{summary}"));
    let read: usize =
        line.split("; ").last().unwrap().split_whitespace().next().unwrap().replace(',', "").parse().unwrap();
    let comm = summary.lines().find(|l| l.contains("communication per rank per step")).unwrap();
    let gathered: usize =
        comm.split("all-gather ").nth(1).unwrap().split(';').next().unwrap().replace(',', "").parse().unwrap();
    assert_eq!(read, gathered, "{summary}");
    assert!(line.contains("instead of"), "{line}");
}

#[test]
fn offloaded_parameters_resume_bit_identically() {
    let dir = scratch("param-offload-resume");
    let plan = dir.join("p.atp");
    compile(&plan, &["--micro-batch", "4", "--dp", "2", "--zero", "3", "--offload-param", "cpu"]);
    let (straight, first, rest, ckpt) =
        (dir.join("straight.jsonl"), dir.join("first.jsonl"), dir.join("rest.jsonl"), dir.join("ckpt"));
    for f in [&straight, &first, &rest] {
        let _ = std::fs::remove_file(f);
    }
    let _ = std::fs::remove_dir_all(&ckpt);
    let straight = run(&plan, &straight, 10, &[]);
    run(&plan, &first, 5, &["--save", ckpt.to_str().unwrap()]);
    assert_eq!(run(&plan, &rest, 10, &["--resume", ckpt.to_str().unwrap()]), straight[5..]);
}

#[test]
fn deepspeed_maps_offload_param() {
    let dir = scratch("param-offload-deepspeed");
    let config = dir.join("ds.json");
    let ds = serde_json::json!({
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": true, "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}
        }
    });
    std::fs::write(&config, ds.to_string()).unwrap();
    let plan = dir.join("p.atp");
    let from_file = compile(&plan, &["--dp", "2", "--deepspeed", config.to_str().unwrap()]);
    assert!(from_file.contains("parameter offload: "), "{from_file}");
    let by_hand = compile(&plan, &["--dp", "2", "--micro-batch", "4", "--zero", "3", "--offload-param", "cpu"]);
    let fingerprint = |summary: &str| {
        let line = summary.lines().find_map(|l| l.trim().strip_prefix("fingerprint: "));
        line.unwrap_or_else(|| panic!("{summary}")).to_string()
    };
    assert_eq!(fingerprint(&from_file), fingerprint(&by_hand));
    let nvme = dir.join("nvme.json");
    let ds = serde_json::json!({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}});
    std::fs::write(&nvme, ds.to_string()).unwrap();
    let model = fixture("gpt2", "model.onnx");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4", "--dp", "2"];
    let err = failure(autotp(&[&args[..], &["--deepspeed", nvme.to_str().unwrap(), "-o", "/dev/null"]].concat()));
    assert!(
        err.contains("--offload-param nvme: autotp keeps offloaded parameters in host memory only so far"),
        "{err}"
    );
}

#[test]
fn what_parameter_offload_does_not_do_is_refused() {
    let dir = scratch("param-offload-refused");
    let model = fixture("gpt2", "model.onnx");
    let compile_failing = |flags: &[&str]| {
        let args = [&["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4"][..], flags];
        failure(autotp(&[&args.concat()[..], &["-o", "/dev/null"]].concat()))
    };
    let cases: [(&[&str], &str); 3] = [
        (
            &["--dp", "2", "--zero", "2", "--offload-param", "cpu"],
            "--offload-param cpu offloads ZeRO-3's parameter shards: it needs --zero 3",
        ),
        (
            &["--dp", "2", "--zero", "3", "--offload-param", "nvme"],
            "--offload-param nvme: autotp keeps offloaded parameters in host memory only so far",
        ),
        (
            &[
                "--dp",
                "2",
                "--zero",
                "3",
                "--offload-param",
                "cpu",
                "--offload-optimizer",
                "nvme",
                "--nvme-path",
                "/tmp",
            ],
            "--offload-param cpu with --offload-optimizer nvme",
        ),
    ];
    for (flags, want) in cases {
        let err = compile_failing(flags);
        assert!(err.contains(want), "{flags:?}: {err}");
    }
    // GPU ranks do not fetch offloaded parameters yet: the plan is refused when it loads.
    let plan = dir.join("p.atp");
    compile(&plan, &["--micro-batch", "4", "--dp", "2", "--zero", "3", "--offload-param", "cpu"]);
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
    command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "1"]);
    let refused = failure(command.args(["--device", "cuda"]).env("AUTOTP_GPU", "emulated").output().unwrap());
    assert!(refused.contains("which GPU ranks do not fetch yet"), "{refused}");
}
