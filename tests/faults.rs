//! Faults a long run meets: a scheduler's preempting signal (a checkpoint after the step, exit
//! status 75, a bit-identical resume), as threads of one process, as MPI processes that
//! received it on one rank only, and through `--launch`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use autotp_train::checkpoint::Checkpoint;

use crate::common::{autotp, fixture, losses, rank_pid, repo, scratch, success};

const PREEMPTED: i32 = autotp_train::preemption::PREEMPTED_EXIT_CODE as i32;

/// Compiles the GPT-2 fixture at dp 2 into `dir`.
fn compile_dp2(dir: &Path) -> PathBuf {
    let plan = dir.join("dp2.atp");
    let model = fixture("gpt2", "model.onnx");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4", "--dp", "2"];
    success(autotp(&[&args[..], &["--lr", "2e-3", "-o", plan.to_str().unwrap()]].concat()));
    plan
}

/// `run PLAN --data tokens.bin --steps STEPS --metrics-out METRICS` and `extra`.
fn run_args(plan: &Path, steps: usize, metrics: &Path, extra: &[&str]) -> Vec<String> {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let steps = steps.to_string();
    let args = ["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", &steps];
    let metrics = ["--log-every", "1000", "--metrics-out", metrics.to_str().unwrap()];
    [&args[..], &metrics, extra].concat().iter().map(|s| s.to_string()).collect()
}

/// Starts a run of `args` that would go on for long, with `env`, its stderr in `stderr`.
fn start(args: &[String], env: &[(&str, &str)], stderr: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(stderr).unwrap())
        .spawn()
        .unwrap()
}

/// Waits until `metrics` holds `steps` lines (the run is training), then sends `signal` to
/// `pid`; returns the run's exit status and its stderr.
fn preempt(mut run: Child, metrics: &Path, steps: usize, signal: &str, pid: u32, stderr: &Path) -> (i32, String) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(metrics).map_or(0, |m| m.lines().count()) < steps {
        if let Some(status) = run.try_wait().unwrap() {
            panic!("the run ended before step {steps} ({status}): {}", std::fs::read_to_string(stderr).unwrap());
        }
        assert!(Instant::now() < deadline, "no step {steps} within 120 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(Command::new("kill").args([signal, &pid.to_string()]).status().unwrap().success());
    let signalled = Instant::now();
    let status = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break status;
        }
        if signalled.elapsed() > Duration::from_secs(60) {
            let _ = run.kill();
            panic!("the run still goes 60 s after {signal}: {}", std::fs::read_to_string(stderr).unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(stderr).unwrap();
    println!("after {signal}, the run ended with {status}:\n{stderr}");
    (status.code().unwrap_or(-1), stderr)
}

/// The step the run stopped after, from its line "...: stopped after step K; ...".
fn stopped_after(stderr: &str, who: &str) -> usize {
    let line = stderr.lines().find(|l| l.starts_with(who) && l.contains(": stopped after step "));
    let line = line.unwrap_or_else(|| panic!("no line '{who}: stopped after step' in:\n{stderr}"));
    let step = line.split("stopped after step ").nth(1).and_then(|rest| rest.split(';').next());
    step.and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no step in '{line}'"))
}

/// The checkpoint under `save` is of step `step`; resuming it for two more steps gives the
/// losses of a run that was never stopped.
fn resumes_bit_identically(plan: &Path, save: &Path, step: usize, extra: &[&str]) {
    let dir = save.parent().unwrap();
    assert_eq!(Checkpoint::open(save).unwrap().manifest.step, step);
    let (straight, resumed) = (dir.join("straight.jsonl"), dir.join("resumed.jsonl"));
    success(autotp(&run_args(plan, step + 2, &straight, &[])));
    let resume = [&["--resume", save.to_str().unwrap()][..], extra].concat();
    success(autotp(&run_args(plan, step + 2, &resumed, &resume)));
    let (straight, resumed) = (losses(&straight), losses(&resumed));
    assert_eq!(resumed.len(), 2);
    for ((step, want), (_, got)) in straight[step..].iter().zip(&resumed) {
        assert_eq!(got.to_bits(), want.to_bits(), "step {step}: resumed loss {got} != straight {want}");
    }
}

#[test]
fn sigterm_checkpoints_after_the_step_and_resumes_bit_identically() {
    let dir = scratch("faults-sigterm");
    let plan = compile_dp2(&dir);
    let (save, metrics, stderr) = (dir.join("save"), dir.join("metrics.jsonl"), dir.join("stderr.txt"));
    let run = start(&run_args(&plan, 100_000, &metrics, &["--save", save.to_str().unwrap()]), &[], &stderr);
    let pid = run.id();
    let (code, stderr) = preempt(run, &metrics, 3, "-TERM", pid, &stderr);
    assert_eq!(code, PREEMPTED, "{stderr}");
    let step = stopped_after(&stderr, "SIGTERM received");
    assert!(stderr.contains(&format!("continue with --resume {}", save.display())), "{stderr}");
    // Every step it reports it trained; its metrics end at the step it stopped after.
    assert_eq!(losses(&metrics).last().map(|(s, _)| *s as usize), Some(step));
    resumes_bit_identically(&plan, &save, step, &[]);

    // Without --save: it stops all the same, and says nothing was saved.
    let metrics = dir.join("unsaved.jsonl");
    let stderr = dir.join("unsaved.txt");
    let run = start(&run_args(&plan, 100_000, &metrics, &[]), &[], &stderr);
    let pid = run.id();
    let (code, stderr) = preempt(run, &metrics, 2, "-USR1", pid, &stderr);
    assert_eq!(code, PREEMPTED, "{stderr}");
    assert!(stderr.contains("SIGUSR1 received: stopped after step") && stderr.contains("no --save"), "{stderr}");
}

/// A signal that reaches one process of a job stops all of them after the same step; a
/// SIGTERM to `--launch`'s process reaches every rank (as SIGUSR1, which mpirun forwards).
#[test]
fn a_signal_to_one_process_stops_the_whole_job() {
    let dir = scratch("faults-processes");
    let plan = compile_dp2(&dir);
    let mpi = [("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")];

    let (save, metrics, stderr) = (dir.join("save"), dir.join("metrics.jsonl"), dir.join("stderr.txt"));
    let args = run_args(&plan, 100_000, &metrics, &["--save", save.to_str().unwrap()]);
    let exe = env!("CARGO_BIN_EXE_autotp");
    let run = Command::new("mpirun")
        .args(["-n", "2", exe])
        .args(&args)
        .envs(mpi)
        .env("AUTOTP_TEST_JOB", "faults-one-rank")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let (code, stderr) = preempt_rank_1(run, &metrics, &stderr);
    assert_eq!(code, PREEMPTED, "{stderr}");
    let step = stopped_after(&stderr, "SIGTERM reached rank 1");
    resumes_bit_identically(&plan, &save, step, &["--launch", "2"]);

    let (save, metrics, stderr) = (dir.join("launched"), dir.join("launched.jsonl"), dir.join("launched.txt"));
    let args = run_args(&plan, 100_000, &metrics, &["--save", save.to_str().unwrap(), "--launch", "2"]);
    let run = start(&args, &[], &stderr);
    let pid = run.id();
    let (code, stderr) = preempt(run, &metrics, 3, "-TERM", pid, &stderr);
    assert_eq!(code, PREEMPTED, "{stderr}");
    let step = stopped_after(&stderr, "SIGUSR1 reached rank 0");
    assert_eq!(Checkpoint::open(&save).unwrap().manifest.step, step);
}

/// [`preempt`] with SIGTERM to the process of rank 1 of the job marked `faults-one-rank`.
fn preempt_rank_1(run: Child, metrics: &Path, stderr: &Path) -> (i32, String) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let pid = loop {
        if let Some(pid) = rank_pid("faults-one-rank", 1) {
            break pid;
        }
        assert!(Instant::now() < deadline, "no process of rank 1 within 120 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    preempt(run, metrics, 3, "-TERM", pid, stderr)
}
