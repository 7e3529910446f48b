//! Parameter offload (`--offload-param cpu|nvme`, DeepSpeed's `offload_param`): ZeRO-3's
//! parameter shards live in host memory outside the arena, or in files, read by their gathers
//! and updated by the optimizer. Training is bit-identical to keeping them in the arena (cpu)
//! and to keeping them in host memory (nvme), under dp, tp and pp, with the optimizer
//! offloaded too (to host memory or, beside shards in host memory, to files) and in bf16 and
//! fp16, validation included; the arena shrinks by exactly the
//! shards' bytes; the bytes read from them per step are their gathers' inputs, and the bytes a
//! step moves through the files are the compile-time schedule's; checkpoints resume
//! bit-identically; `--deepspeed` maps `offload_param`; what is not implemented is refused.

use std::path::Path;

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
    let states = scratch("param-offload-optimizer-files");
    let optimizer_nvme = ["--offload-optimizer", "nvme", "--nvme-path", states.to_str().unwrap()];
    let layouts: [&[&str]; 7] = [
        &["--micro-batch", "4", "--dp", "2", "--zero", "3"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "3", "--precision", "bf16"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "3", "--offload-optimizer", "cpu"],
        &[&["--micro-batch", "4", "--dp", "2", "--zero", "3"][..], &optimizer_nvme].concat(),
        &[&["--micro-batch", "4", "--dp", "2", "--zero", "3", "--precision", "bf16"][..], &optimizer_nvme].concat(),
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
    resumes_bit_identically(&dir, &plan);
}

/// Asserts that `plan`'s 10 steps equal 5 steps saved and 5 resumed, metric for metric (files
/// under `dir`).
fn resumes_bit_identically(dir: &Path, plan: &Path) {
    let (straight, first, rest, ckpt) =
        (dir.join("straight.jsonl"), dir.join("first.jsonl"), dir.join("rest.jsonl"), dir.join("ckpt"));
    for f in [&straight, &first, &rest] {
        let _ = std::fs::remove_file(f);
    }
    let _ = std::fs::remove_dir_all(&ckpt);
    let straight = run(plan, &straight, 10, &[]);
    run(plan, &first, 5, &["--save", ckpt.to_str().unwrap()]);
    assert_eq!(run(plan, &rest, 10, &["--resume", ckpt.to_str().unwrap()]), straight[5..]);
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
    // offload_param to NVMe with DeepSpeed's buffer settings and its default prefetch bucket
    // (which starts more gathers than 3 buffers hold: the prefetch waits for them).
    let nvme_dir = scratch("param-offload-deepspeed-files");
    let nvme = dir.join("nvme.json");
    let ds = serde_json::json!({
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme", "nvme_path": nvme_dir, "buffer_count": 3, "buffer_size": 1e6, "max_in_cpu": 0
            }
        }
    });
    std::fs::write(&nvme, ds.to_string()).unwrap();
    let from_file = compile(&plan, &["--dp", "2", "--deepspeed", nvme.to_str().unwrap()]);
    assert!(from_file.contains("--buffer-count 3"), "{from_file}");
    let nvme = in_files(&nvme_dir, 0);
    let nvme: Vec<&str> = nvme.iter().map(String::as_str).collect();
    let zero3 = ["--dp", "2", "--zero", "3", "--buffer-count", "3", "--micro-batch", "4"];
    let by_hand = compile(&plan, &[&zero3[..], &nvme].concat());
    assert_eq!(fingerprint(&from_file), fingerprint(&by_hand));
}

/// ZeRO-3 at dp 2, gathering one shard at a time.
const ZERO3: [&str; 6] = ["--dp", "2", "--zero", "3", "--prefetch-bucket-size", "1"];

/// Shards in files under `files`, all but the first `max_in_cpu` elements' (`--max-in-cpu`).
fn in_files(files: &Path, max_in_cpu: usize) -> Vec<String> {
    let flags = ["--offload-param", "nvme", "--buffer-size", "1e6", "--max-in-cpu"].map(String::from);
    flags.into_iter().chain([max_in_cpu.to_string(), "--nvme-path".into(), files.display().to_string()]).collect()
}

/// What a run's "parameters on NVMe, rank R" line says.
#[derive(Debug, PartialEq)]
struct Moved {
    file_bytes: usize,
    read_per_step: usize,
    written_per_step: usize,
    planned_read: usize,
    planned_written: usize,
}

fn moved(stderr: &str, rank: usize) -> Moved {
    let prefix = format!("parameters on NVMe, rank {rank}: ");
    let line = stderr.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("{stderr}"));
    let numbers: Vec<usize> = (line.split(|c: char| !c.is_ascii_digit() && c != ','))
        .filter_map(|n| n.replace(',', "").parse().ok())
        .collect();
    // Shards, bytes, shards in memory, their bytes, read, written, planned read and written.
    let [_, file_bytes, _, _, read_per_step, written_per_step, planned_read, planned_written] = numbers[..8] else {
        panic!("{line}")
    };
    Moved { file_bytes, read_per_step, written_per_step, planned_read, planned_written }
}

/// Shards in files train as shards in memory do (`--offload-param cpu`), step for step,
/// under dp, tp and pp, in bf16 and fp16 (whose skipped steps move the shards as planned),
/// with some kept in memory (`--max-in-cpu`); each step moves the bytes the schedule plans,
/// and writes back every shard in the file once.
#[test]
fn parameters_in_files_train_bit_identically() {
    let dir = scratch("param-nvme");
    let files = scratch("param-nvme-files");
    // (the layout, --buffer-count, --max-in-cpu)
    let layouts: [(&[&str], &str, usize); 5] = [
        (&["--micro-batch", "4"], "2", 0),
        (&["--micro-batch", "4", "--precision", "bf16", "--offload-optimizer", "cpu"], "3", 40000),
        (&["--micro-batch", "4", "--precision", "fp16", "--initial-scale-power", "24"], "4", 0),
        (&["--tp", "2", "--micro-batch", "8"], "2", 0),
        (&["--pp", "2", "--grad-accum", "2", "--micro-batch", "2"], "2", 0),
    ];
    for (layout, buffer_count, max_in_cpu) in layouts {
        let (kept, offloaded) = (dir.join("kept.atp"), dir.join("offloaded.atp"));
        let kept_summary = compile(&kept, &[&ZERO3[..], layout, &["--offload-param", "cpu"]].concat());
        let nvme = in_files(&files, max_in_cpu);
        let nvme: Vec<&str> = nvme.iter().map(String::as_str).collect();
        let summary = compile(&offloaded, &[&ZERO3[..], layout, &nvme, &["--buffer-count", buffer_count]].concat());
        let kept_metrics = run(&kept, &dir.join("kept.jsonl"), 30, &[]);
        let metrics = dir.join("offloaded.jsonl");
        let stderr = crate::common::run_plan(&offloaded, &metrics, 30, &[]);
        assert_eq!(kept_metrics, run(&offloaded, &metrics, 30, &[]), "{layout:?}");
        if layout.contains(&"fp16") {
            assert!(kept_metrics.iter().any(|m| m["skipped"] == true), "fp16 from 2^24 skips its first steps");
        }
        let moved = moved(&stderr, 0);
        assert_eq!((moved.read_per_step, moved.written_per_step), (moved.planned_read, moved.planned_written));
        if layout.contains(&"--pp") {
            assert!(summary.contains("parameter offload (stage 1): "), "{summary}");
            continue;
        }
        // Each shard is read by its forward's gather, its backward's and the step, less what
        // a use finds still in memory.
        assert_eq!(moved.written_per_step, moved.file_bytes, "{stderr}");
        assert!((2 * moved.file_bytes..=3 * moved.file_bytes).contains(&moved.read_per_step), "{moved:?}");
        let in_file = memory_row(&summary, "parameters offloaded (NVMe file)");
        let in_host = match max_in_cpu {
            0 => 0,
            _ => memory_row(&summary, "parameters offloaded (host pool)"),
        };
        assert_eq!(memory_row(&kept_summary, "parameters offloaded (host pool)"), in_host + in_file, "{summary}");
        assert_eq!(memory_row(&kept_summary, "total arena"), memory_row(&summary, "total arena"), "{layout:?}");
        println!("{layout:?}: {in_file} bytes of shards in the file; {moved:?}");
    }
    assert_eq!(std::fs::read_dir(&files).unwrap().count(), 0, "the runs removed their files");
}

/// With every shard within `--max-in-cpu` (by default DeepSpeed's 1e9 elements), `--offload-param
/// nvme` keeps them all in host memory: the run makes no file and trains as `cpu` does (it
/// stopped on "the plan keeps no parameter shard in a file" before 2026-11-30).
#[test]
fn parameters_within_max_in_cpu_stay_in_host_memory() {
    let dir = scratch("param-nvme-in-memory");
    let files = scratch("param-nvme-in-memory-files");
    let (kept, nvme) = (dir.join("kept.atp"), dir.join("nvme.atp"));
    compile(&kept, &[&ZERO3[..], &["--micro-batch", "4", "--offload-param", "cpu"]].concat());
    let flags = ["--micro-batch", "4", "--offload-param", "nvme", "--nvme-path", files.to_str().unwrap()];
    let summary = compile(&nvme, &[&ZERO3[..], &flags].concat());
    assert!(summary.contains("ZeRO-3 shards per rank, in host memory"), "{summary}");
    assert_eq!(run(&kept, &dir.join("kept.jsonl"), 3, &[]), run(&nvme, &dir.join("nvme.jsonl"), 3, &[]));
    assert_eq!(std::fs::read_dir(&files).unwrap().count(), 0, "no file");
}

/// Under DeepSpeed's default prefetch bucket (5e7 elements: every gather of the fixture at
/// once), ZeRO-3's prefetch starts no more gathers than `--buffer-count` (each holds its shard
/// until its wait): the shards in files train as in host memory, bit for bit, at one buffer and
/// at DeepSpeed's 5 (refused before 2026-11-30: "needs 1 parameters from the file while 5 others
/// are in flight"), and each step moves the bytes the schedule plans.
#[test]
fn the_prefetch_starts_no_more_gathers_than_buffers() {
    let dir = scratch("param-nvme-buffers");
    let files = scratch("param-nvme-buffers-files");
    let layout = ["--dp", "2", "--zero", "3", "--micro-batch", "4"];
    let (kept, offloaded) = (dir.join("kept.atp"), dir.join("offloaded.atp"));
    compile(&kept, &[&layout[..], &["--offload-param", "cpu"]].concat());
    let kept_metrics = run(&kept, &dir.join("kept.jsonl"), 10, &[]);
    let nvme = in_files(&files, 0);
    let nvme: Vec<&str> = nvme.iter().map(String::as_str).collect();
    for (buffers, shards) in [("1", "1 shard,"), ("5", "5 shards,")] {
        let summary = compile(&offloaded, &[&layout[..], &nvme, &["--buffer-count", buffers]].concat());
        let at_most = format!("(at most {shards}");
        assert!(summary.contains(&at_most) && summary.contains(&format!("of --buffer-count {buffers})")), "{summary}");
        let metrics = dir.join(format!("offloaded-{buffers}.jsonl"));
        let stderr = crate::common::run_plan(&offloaded, &metrics, 10, &[]);
        assert_eq!(kept_metrics, run(&offloaded, &metrics, 10, &[]), "--buffer-count {buffers}");
        let moved = moved(&stderr, 0);
        assert_eq!((moved.read_per_step, moved.written_per_step), (moved.planned_read, moved.planned_written));
    }
}

#[test]
fn parameters_in_files_resume_bit_identically() {
    let dir = scratch("param-nvme-resume");
    let files = scratch("param-nvme-resume-files");
    let plan = dir.join("p.atp");
    let nvme = in_files(&files, 0);
    let nvme: Vec<&str> = nvme.iter().map(String::as_str).collect();
    compile(&plan, &[&ZERO3[..], &nvme, &["--buffer-count", "2", "--micro-batch", "4"]].concat());
    resumes_bit_identically(&dir, &plan);
}

#[test]
fn what_parameter_offload_does_not_do_is_refused() {
    let dir = scratch("param-offload-refused");
    let model = fixture("gpt2", "model.onnx");
    let compile_failing = |flags: &[&str]| {
        let args = [&["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4"][..], flags];
        failure(autotp(&[&args.concat()[..], &["-o", "/dev/null"]].concat()))
    };
    let cases: [(&[&str], &str); 5] = [
        (
            &["--dp", "2", "--zero", "2", "--offload-param", "cpu"],
            "--offload-param cpu offloads ZeRO-3's parameter shards: it needs --zero 3",
        ),
        (
            &["--dp", "2", "--zero", "3", "--offload-param", "nvme"],
            "--offload-param nvme keeps parameter shards in files under --nvme-path DIR, which is missing",
        ),
        (
            &["--dp", "2", "--zero", "3", "--offload-param", "nvme", "--nvme-path", "/tmp", "--buffer-size", "100", "--max-in-cpu", "0"],
            "--offload-param nvme: parameter 'm.transformer.wte.weight' has 32000 elements on each rank, more than --buffer-size 100",
        ),
        (
            &["--dp", "2", "--zero", "3", "--offload-param", "cpu", "--max-in-cpu", "0"],
            "--max-in-cpu applies to --offload-param nvme",
        ),
        (
            &[
                "--dp",
                "2",
                "--zero",
                "3",
                "--offload-param",
                "nvme",
                "--offload-optimizer",
                "nvme",
                "--nvme-path",
                "/tmp",
            ],
            "--offload-param nvme with --offload-optimizer nvme",
        ),
    ];
    for (flags, want) in cases {
        let err = compile_failing(flags);
        assert!(err.contains(want), "{flags:?}: {err}");
    }
    // GPU ranks do not fetch parameters from files yet: the plan is refused when it loads,
    // before any file is made. (Shards in host memory they fetch: tests/gpu.rs.)
    let plan = dir.join("p.atp");
    let files = scratch("param-offload-refused-files");
    let nvme = in_files(&files, 0);
    let nvme: Vec<&str> = nvme.iter().map(String::as_str).collect();
    compile(&plan, &[&ZERO3[..], &["--micro-batch", "4", "--buffer-count", "8"], &nvme].concat());
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
    command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "1"]);
    let refused = failure(command.args(["--device", "cuda"]).env("AUTOTP_GPU", "emulated").output().unwrap());
    assert!(refused.contains("(--offload-param nvme), which GPU ranks do not fetch yet"), "{refused}");
    assert_eq!(std::fs::read_dir(&files).unwrap().count(), 0);
}
