//! Optimizer offload (`--offload-optimizer cpu|nvme`): the optimizer's states (f32 masters,
//! moments) in a host pool outside the arena, or in a file per rank streamed through the step
//! in tiles. The step is the same kernel on the same bytes (in place, skipped whole on
//! non-finite gradients, writing the 16-bit copies of the masters), so 30 steps train
//! bit-identically to keeping the states in the arena, with clipping and fp16's skipped steps,
//! under data (ZeRO 1-3), tensor and pipeline parallelism; the arena shrinks by exactly the
//! states' bytes; checkpoints resume bit-identically and hold what an in-arena run's hold. With
//! `nvme`, the process's I/O counters show each step reading and writing 12 bytes per
//! parameter (f32 master and two moments) plus the tiles' padding to 4 KiB, and bad storage is a
//! clear error.

use std::path::Path;

use crate::common::{autotp, failure, fixture, repo, run_plan, scratch, success};

/// Compiles the GPT-2 fixture at sequence length 32 with `flags`; the summary.
pub(crate) fn compile(plan: &Path, flags: &[&str]) -> String {
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
pub(crate) fn run(plan: &Path, metrics: &Path, steps: usize, extra: &[&str]) -> Vec<serde_json::Value> {
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
            // The arena loses the states; the activations' peak may differ besides (the in-place
            // step sets it where the kept plan's peak lies elsewhere).
            let activations = |summary: &str| figure(summary, "activations peak (with gradients)") as i64;
            let arena_drop = figure(&kept_summary, "total arena") as i64 - figure(&summary, "total arena") as i64;
            let expected = states as i64 + activations(&kept_summary) - activations(&summary);
            // Up to the arena's rounding to its alignment.
            assert!((arena_drop - expected).abs() < 256, "{arena_drop} vs {expected}: {summary}");
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
        autotp_train::checkpoint::Checkpoint::open(&save).unwrap(),
        autotp_train::checkpoint::Checkpoint::open(&kept_save).unwrap(),
    );
    let states = a.states();
    assert!(states.iter().any(|t| t.name.starts_with("master.")), "the masters are saved");
    for t in states.iter().chain(&a.params()) {
        assert!(t.bytes == b.tensor(&t.name).unwrap().bytes, "'{}' after 5 steps", t.name);
    }
}

/// A model whose states' sizes are not multiples of the alignment (DeepSeek-V3's fixture) keeps
/// them in a host pool that holds their aligned regions, and trains as it does without offload.
#[test]
fn offloaded_optimizer_holds_unaligned_states() {
    let dir = scratch("offload-cpu-unaligned");
    let model = fixture("deepseek_v3", "model.onnx");
    let metrics = |plan: &Path, flags: &[&str]| {
        let args = [&["compile", model.to_str().unwrap(), "--seq-len", "16", "--micro-batch", "2"][..], flags];
        success(autotp(&[&args.concat()[..], &["-o", plan.to_str().unwrap()]].concat()));
        run(plan, &plan.with_extension("jsonl"), 3, &[])
    };
    let kept = metrics(&dir.join("kept.atp"), &[]);
    assert_eq!(metrics(&dir.join("offloaded.atp"), &["--offload-optimizer", "cpu"]), kept);
}

/// On a GPU the optimizer state in files is refused when the plan loads, saying so (a host pool
/// runs there: `tests/gpu.rs`).
#[test]
fn optimizer_state_on_nvme_is_refused_on_a_gpu() {
    let dir = scratch("offload-nvme-gpu");
    let plan = dir.join("p.atp");
    let files = nvme_dir("gpu");
    compile(&plan, &[&["--micro-batch", "4"][..], &nvme_flags(&files)].concat());
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
    command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "1"]);
    let refused = failure(command.args(["--device", "cuda"]).env("AUTOTP_GPU", "emulated").output().unwrap());
    assert!(refused.contains("optimizer state on NVMe runs on CPU ranks only so far"), "{refused}");
}

/// A directory for state files on the checkout's filesystem (the system's temporary directory
/// may be a tmpfs, which refuses direct I/O).
fn nvme_dir(name: &str) -> std::path::PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nvme-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The flags that put the optimizer state in files under `dir`, in tiles of 30,000 elements
/// (the GPT-2 fixture's 172,288 parameters make six) through two buffers.
fn nvme_flags(dir: &Path) -> Vec<&str> {
    let dir = dir.to_str().unwrap();
    vec!["--offload-optimizer", "nvme", "--nvme-path", dir, "--sub-group-size", "30000", "--buffer-count", "2"]
}

/// 30 steps with the optimizer state in files equal 30 steps with it in the arena, metric for
/// metric, on one rank (bf16; fp16 skipping its first steps), under ZeRO 1, 2 and 3, tp 2 x dp 2
/// in f32 and pp 2 with accumulation; the runs leave no file behind.
#[test]
fn nvme_offload_trains_bit_identically() {
    let dir = scratch("offload-nvme");
    let states = nvme_dir("identical");
    let layouts: [&[&str]; 7] = [
        &["--micro-batch", "8", "--precision", "bf16"],
        &["--micro-batch", "8", "--precision", "fp16", "--initial-scale-power", "24"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "1", "--precision", "fp16"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "2", "--precision", "bf16"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "3", "--precision", "bf16"],
        &["--micro-batch", "8", "--tp", "2", "--dp", "2", "--zero", "1"],
        &["--micro-batch", "4", "--pp", "2", "--grad-accum", "2", "--precision", "bf16"],
    ];
    for (l, layout) in layouts.iter().enumerate() {
        let (kept, offloaded) = (dir.join("kept.atp"), dir.join("nvme.atp"));
        compile(&kept, layout);
        let summary = compile(&offloaded, &[&layout[..], &nvme_flags(&states)].concat());
        assert!(summary.contains("optimizer state on NVMe under"), "{summary}");
        let a = run(&kept, &dir.join("kept.jsonl"), 30, &[]);
        let b = run(&offloaded, &dir.join("nvme.jsonl"), 30, &[]);
        assert_eq!(a, b, "{layout:?}");
        if l == 1 {
            assert!(b.iter().any(|m| m["skipped"] == true), "fp16 from 2^24 skips its first steps");
        }
        let left: Vec<_> = std::fs::read_dir(&states).unwrap().collect();
        assert!(left.is_empty(), "{layout:?} left {left:?}");
    }
}

/// A bf16 step reads and writes its f32 masters and two moments, 12 bytes per parameter, plus
/// each tile's padding to 4 KiB, as the process's own I/O counters count it (direct I/O: the
/// page cache is not in the way), and no more than the plan said.
#[test]
fn nvme_steps_move_twelve_bytes_per_parameter_each_way() {
    let dir = scratch("offload-nvme-io");
    let states = nvme_dir("io");
    let plan = dir.join("p.atp");
    let summary = compile(&plan, &[&["--micro-batch", "8", "--precision", "bf16"][..], &nvme_flags(&states)].concat());
    let parameters = figure(&summary, "parameters");
    let planned: usize = summary
        .lines()
        .find_map(|l| l.split_once(" bytes read and ")?.0.rsplit_once("; ")?.1.replace(',', "").parse().ok())
        .unwrap_or_else(|| panic!("{summary}"));
    // The data's pages in the page cache before the counters start.
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    std::fs::read(&tokens).unwrap();
    let steps = 10;
    let out =
        autotp(&["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", &steps.to_string()]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    success(out);
    let line =
        stderr.lines().find(|l| l.starts_with("optimizer state on NVMe, rank 0")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(line.contains("(direct I/O)"), "{line}");
    assert!(line.contains("(12 bytes per parameter + "), "{line}");
    let padding: usize = line
        .split_once("bytes per parameter + ")
        .unwrap()
        .1
        .split_once(' ')
        .unwrap()
        .0
        .replace(',', "")
        .parse()
        .unwrap();
    assert_eq!(planned, 12 * parameters + padding, "{summary}\n{line}");
    assert!(padding < 6 * 4096, "six tiles pad at most a block each: {padding}");
    let counters =
        stderr.lines().find(|l| l.starts_with("this process's I/O counters")).unwrap_or_else(|| panic!("{stderr}"));
    let numbers: Vec<usize> = counters
        .split(|c: char| !(c.is_ascii_digit() || c == ','))
        .filter_map(|n| n.replace(',', "").parse().ok())
        .collect();
    // [steps, read_bytes, write_bytes, the files' read, the files' written]
    let [counted_steps, read, written, files_read, files_written] = numbers[..] else { panic!("{counters}") };
    assert_eq!([counted_steps, files_read, files_written], [steps, steps * planned, steps * planned], "{counters}");
    // The kernel's counters are the whole process's: beside the files' bytes, a page or a few
    // that something else wrote while the steps ran (seen once in CI: 4,096 more written).
    let slack = 16 * 4096;
    for (label, counted) in [("read_bytes", read), ("write_bytes", written)] {
        assert!((steps * planned..=steps * planned + slack).contains(&counted), "{label}: {counters}");
    }
}

/// An NVMe run saved midway resumes bit-identically, from its own checkpoint and from an
/// in-memory offloaded run's (the same programs); a run that dies midway leaves its last
/// checkpoint valid, and resuming from it continues bit-identically.
#[test]
fn nvme_checkpoints_resume_bit_identically() {
    let dir = scratch("offload-nvme-checkpoint");
    let states = nvme_dir("checkpoint");
    let flags = ["--micro-batch", "4", "--precision", "bf16", "--dp", "2", "--zero", "2"];
    let (host, offloaded) = (dir.join("host.atp"), dir.join("nvme.atp"));
    compile(&host, &[&flags[..], &["--offload-optimizer", "cpu"]].concat());
    compile(&offloaded, &[&flags[..], &nvme_flags(&states)].concat());
    let whole = run(&offloaded, &dir.join("whole.jsonl"), 10, &[]);
    let (save, host_save) = (dir.join("ck"), dir.join("host-ck"));
    run(&offloaded, &dir.join("first.jsonl"), 5, &["--save", save.to_str().unwrap()]);
    let resumed = run(&offloaded, &dir.join("rest.jsonl"), 10, &["--resume", save.to_str().unwrap()]);
    assert_eq!(resumed, whole[5..], "resumed from step 5");
    run(&host, &dir.join("host.jsonl"), 5, &["--save", host_save.to_str().unwrap()]);
    let from_host = run(&offloaded, &dir.join("from-host.jsonl"), 10, &["--resume", host_save.to_str().unwrap()]);
    assert_eq!(from_host, whole[5..], "resumed from the host pool's checkpoint");

    let crashed = dir.join("crashed");
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(["run", offloaded.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "10"])
        .args(["--save", crashed.to_str().unwrap(), "--save-every", "3"])
        .env("AUTOTP_PANIC_AT", "0:8")
        .output()
        .unwrap();
    assert!(!out.status.success(), "the run dies before step 8");
    let after_crash = run(&offloaded, &dir.join("after-crash.jsonl"), 10, &["--resume", crashed.to_str().unwrap()]);
    assert_eq!(after_crash, whole[6..], "resumed from step 6, the last checkpoint before the crash");
}

/// Bad storage and flags are clear errors: a missing directory, a file that no longer holds
/// its tiles (short read), an allocation the system refuses, and flags that need `nvme` or that
/// `nvme` needs.
#[test]
fn nvme_offload_errors_are_clear() {
    let dir = scratch("offload-nvme-errors");
    let states = nvme_dir("errors");
    let model = fixture("gpt2", "model.onnx");
    let output = dir.join("x.atp");
    let compile_fails = |flags: &[&str]| {
        let args = [
            &["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4"][..],
            flags,
            &["-o", output.to_str().unwrap()],
        ]
        .concat();
        failure(autotp(&args))
    };
    let refused = compile_fails(&["--offload-optimizer", "nvme"]);
    assert!(refused.contains("--nvme-path DIR, which is missing"), "{refused}");
    let refused = compile_fails(&["--sub-group-size", "1e6"]);
    assert!(refused.contains("--sub-group-size applies to --offload-optimizer nvme"), "{refused}");
    let refused = compile_fails(&[&nvme_flags(&states)[..], &["--kernels", "builtin"]].concat());
    assert!(refused.contains("needs --kernels generated"), "{refused}");

    let plan = dir.join("p.atp");
    compile(&plan, &[&["--micro-batch", "4", "--precision", "bf16"][..], &nvme_flags(&states)].concat());
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let run_args = ["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "2"];
    let missing = dir.join("no-such-dir");
    let refused = failure(autotp(&[&run_args[..], &["--nvme-path", missing.to_str().unwrap()]].concat()));
    assert!(
        refused.contains("no-such-dir: no such directory: --nvme-path must name an existing directory"),
        "{refused}"
    );
    let in_memory = dir.join("cpu.atp");
    compile(&in_memory, &["--micro-batch", "4", "--offload-optimizer", "cpu"]);
    let refused = failure(autotp(&[
        "run",
        in_memory.to_str().unwrap(),
        "--data",
        tokens.to_str().unwrap(),
        "--steps",
        "1",
        "--nvme-path",
        states.to_str().unwrap(),
    ]));
    assert!(refused.contains("--nvme-path: the plan keeps nothing in files"), "{refused}");

    // A file size limit below the state's 2 MB: the allocation is refused when the plan loads
    // (as a full disk refuses it), naming the file.
    let script = "trap '' XFSZ; ulimit -f 256; exec \"$0\" \"$@\"";
    let out = std::process::Command::new("sh")
        .args(["-c", script, env!("CARGO_BIN_EXE_autotp")])
        .args(run_args)
        .output()
        .unwrap();
    let refused = failure(out);
    assert!(refused.contains("cannot allocate the offloaded bytes in"), "{refused}");
    assert!(refused.contains(states.to_str().unwrap()), "{refused}");

    // The file cut short under a running trainer: the next step's read says so.
    let file = autotp_program::plan::PlanFile::open(&plan).unwrap();
    let mut trainer = autotp_train::trainer::Trainer::new(file.plan.clone(), &file.weights(), 0).unwrap();
    let data = autotp_train::dataset::TrainingData::Stream(
        autotp_train::data::TokenData::open(&tokens, autotp_train::data::TokenDtype::U16, 32).unwrap(),
    );
    trainer.step(&data, 3).unwrap();
    let state_file = std::fs::read_dir(&states).unwrap().next().unwrap().unwrap().path();
    std::fs::OpenOptions::new().write(true).open(&state_file).unwrap().set_len(4096).unwrap();
    let error = trainer.step(&data, 3).unwrap_err().to_string();
    assert!(error.contains("short read of offloaded state"), "{error}");
    assert!(error.contains(state_file.to_str().unwrap()), "{error}");
    drop(trainer);
    assert!(!state_file.exists(), "the trainer removes its file");
}
