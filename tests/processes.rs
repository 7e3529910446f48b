//! Ranks as processes over MPI (Open MPI's `mpirun`, started by `autotp run --launch N` or
//! directly, and an srun-style environment) against the same plans run as threads of one
//! process: the same 30-step loss curves, bit for bit where groups have two ranks (whose sums
//! do not depend on the order), within 1e-6 relative for a group of four; checkpoints that resume each other, and failures that end
//! the whole job within 30 s, naming the rank.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{autotp, fixture, losses, rank_pid, repo, scratch, success};

const ADAMW: [&str; 8] = ["--lr", "2e-3", "--betas", "0.9,0.95", "--eps", "1e-8", "--weight-decay", "0.01"];

/// Compiles the GPT-2 fixture with `parallel` flags into `dir`; returns the plan.
fn compile(dir: &Path, name: &str, micro_batch: usize, parallel: &[&str]) -> PathBuf {
    compile_model(dir, "gpt2", name, micro_batch, parallel)
}

/// Compiles fixture `arch` with `parallel` flags into `dir`; returns the plan.
fn compile_model(dir: &Path, arch: &str, name: &str, micro_batch: usize, parallel: &[&str]) -> PathBuf {
    let plan = dir.join(format!("{name}.atp"));
    let model = fixture(arch, "model.onnx");
    let micro = micro_batch.to_string();
    let mut args = vec!["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", &micro];
    args.extend(ADAMW);
    args.extend(parallel);
    args.extend(["-o", plan.to_str().unwrap()]);
    success(autotp(&args));
    plan
}

/// `autotp run PLAN` arguments to `steps` with metrics in `metrics`, and `extra`.
fn run_args(plan: &Path, steps: usize, metrics: &Path, extra: &[&str]) -> Vec<String> {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let mut args: Vec<String> = ["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(steps.to_string());
    args.extend(["--log-every".to_string(), "100".to_string(), "--metrics-out".to_string()]);
    args.push(metrics.to_str().unwrap().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn loss_curve(metrics: &Path) -> Vec<u64> {
    losses(metrics).into_iter().map(|(_, loss)| loss.to_bits()).collect()
}

/// Open MPI refuses to run as root unless told; the tests run as root in CI containers.
fn mpirun() -> Command {
    let mut command = Command::new("mpirun");
    command.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    command
}

#[test]
fn processes_train_like_threads() {
    let dir = scratch("processes");
    let layouts: &[(&str, &str, usize, &[&str])] = &[
        ("gpt2", "dp2-zero0", 4, &["--dp", "2", "--zero", "0"]),
        ("gpt2", "dp2-zero1", 4, &["--dp", "2", "--zero", "1"]),
        ("gpt2", "dp2-zero2", 4, &["--dp", "2", "--zero", "2"]),
        ("gpt2", "dp2-zero3", 4, &["--dp", "2", "--zero", "3"]),
        ("gpt2", "tp2", 8, &["--tp", "2"]),
        ("gpt2", "pp2", 2, &["--pp", "2", "--grad-accum", "4"]),
        ("gpt2", "tp2-dp2-zero3", 4, &["--tp", "2", "--dp", "2", "--zero", "3"]),
        ("llama", "tp2", 8, &["--tp", "2"]),
        ("llama", "pp2", 2, &["--pp", "2", "--grad-accum", "4"]),
        ("llama", "tp2-dp2-zero3", 4, &["--tp", "2", "--dp", "2", "--zero", "3"]),
        ("gpt2", "pp2-zb-h1", 2, &["--pp", "2", "--schedule", "zb-h1", "--grad-accum", "4"]),
        ("gpt2", "tp2-dp2-sequence-parallel", 4, &["--tp", "2", "--dp", "2", "--sequence-parallel"]),
        ("llama", "cp2-ring", 1, &["--cp", "2", "--cp-comm-type", "p2p", "--grad-accum", "4"]),
    ];
    for &(arch, layout, micro_batch, parallel) in layouts {
        let name = format!("{arch}-{layout}");
        let plan = compile_model(&dir, arch, &name, micro_batch, parallel);
        let threads = dir.join(format!("{name}-threads.jsonl"));
        success(autotp(&run_args(&plan, 30, &threads, &[])));
        let ranks = if layout.starts_with("tp2-dp2") { "4" } else { "2" };
        let processes = dir.join(format!("{name}-processes.jsonl"));
        let stdout = success(autotp(&run_args(&plan, 30, &processes, &["--launch", ranks])));
        assert_eq!(loss_curve(&processes), loss_curve(&threads), "{name}: processes against threads");
        assert_eq!(loss_curve(&threads).len(), 30);
        // Rank 0 alone prints: one first and one last step line.
        assert_eq!(stdout.matches("step      1/30").count(), 1, "{name}: {stdout}");
        println!("{name}: 30 steps as {ranks} processes, bit-identical to threads");
    }
}

/// A group of four ranks: MPI may add the four partial sums in another order than the threads'
/// coordinate order, so the curves agree within 1e-6 relative rather than bit for bit.
#[test]
fn a_group_of_four_processes_trains_like_threads() {
    let dir = scratch("processes-dp4");
    let plan = compile(&dir, "dp4-zero1", 2, &["--dp", "4", "--zero", "1"]);
    let threads = dir.join("threads.jsonl");
    success(autotp(&run_args(&plan, 30, &threads, &[])));
    let processes = dir.join("processes.jsonl");
    success(autotp(&run_args(&plan, 30, &processes, &["--launch", "4"])));
    let (threads, processes) = (losses(&threads), losses(&processes));
    assert_eq!(threads.len(), 30);
    assert_eq!(processes.len(), 30);
    for ((step, t), (_, p)) in threads.iter().zip(&processes) {
        assert!((t - p).abs() <= 1e-6 * t.abs(), "step {step}: threads {t}, processes {p}");
    }
}

/// Plain `mpirun -n 2 autotp run`, the same processes seen as srun tasks (SLURM's variables
/// instead of Open MPI's), and `mpirun -n 2 autotp train`.
#[test]
fn mpirun_and_srun_style_launches() {
    let dir = scratch("processes-launchers");
    let plan = compile(&dir, "dp2", 4, &["--dp", "2", "--zero", "2"]);
    let threads = dir.join("threads.jsonl");
    success(autotp(&run_args(&plan, 10, &threads, &[])));
    let exe = env!("CARGO_BIN_EXE_autotp");
    let mpi = dir.join("mpirun.jsonl");
    let out = mpirun().args(["-n", "2", exe]).args(run_args(&plan, 10, &mpi, &[])).output().unwrap();
    success(out);
    assert_eq!(loss_curve(&mpi), loss_curve(&threads));
    let slurm = dir.join("srun.jsonl");
    let script = format!(
        "export SLURM_PROCID=$OMPI_COMM_WORLD_RANK SLURM_NTASKS=$OMPI_COMM_WORLD_SIZE \
         SLURM_LOCALID=$OMPI_COMM_WORLD_LOCAL_RANK SLURM_STEP_ID=0; \
         unset OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK; exec {exe} \"$@\""
    );
    let out = mpirun().args(["-n", "2", "sh", "-c", &script, "sh"]).args(run_args(&plan, 10, &slurm, &[])).output();
    success(out.unwrap());
    assert_eq!(loss_curve(&slurm), loss_curve(&threads));
    // `train` (compile and run in one) under mpirun: every process compiles, each runs its rank.
    let model = fixture("gpt2", "model.onnx");
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let train = |metrics: &Path| -> Vec<String> {
        let mut args = vec!["train", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4"];
        args.extend(ADAMW);
        args.extend(["--dp", "2", "--zero", "2", "--data", tokens.to_str().unwrap(), "--steps", "10"]);
        args.extend(["--metrics-out", metrics.to_str().unwrap()]);
        args.iter().map(|a| a.to_string()).collect()
    };
    let trained = dir.join("train-mpirun.jsonl");
    success(mpirun().args(["-n", "2", exe]).args(train(&trained)).output().unwrap());
    assert_eq!(loss_curve(&trained), loss_curve(&threads));
}

/// A checkpoint saved by processes resumes as threads and the other way round, each continuing
/// the uninterrupted curve bit for bit.
#[test]
fn checkpoints_of_processes_and_threads_resume_each_other() {
    let dir = scratch("processes-checkpoints");
    let plan = compile(&dir, "tp2-dp2-zero3", 4, &["--tp", "2", "--dp", "2", "--zero", "3"]);
    let whole = dir.join("whole.jsonl");
    success(autotp(&run_args(&plan, 20, &whole, &[])));
    let whole = loss_curve(&whole);
    for (first, then) in [("--launch", ""), ("", "--launch")] {
        let save = dir.join(format!("save{first}"));
        let metrics = dir.join(format!("m{first}.jsonl"));
        let launch = |flag: &str| if flag.is_empty() { vec![] } else { vec!["--launch", "4"] };
        let mut extra = vec!["--save", save.to_str().unwrap()];
        extra.extend(launch(first));
        success(autotp(&run_args(&plan, 10, &metrics, &extra)));
        let mut extra = vec!["--resume", save.to_str().unwrap()];
        extra.extend(launch(then));
        success(autotp(&run_args(&plan, 20, &metrics, &extra)));
        assert_eq!(loss_curve(&metrics), whole, "saved with '{first}', resumed with '{then}'");
    }
}

/// Starts a long run of a dp 2 plan as 2 processes that saves every 2 steps (with `env` added
/// to its environment), waits for its first checkpoint, sends `signal` to the process of rank 1
/// (none: leaves the fault to `env`), and returns the job's status, its stderr, how long it took
/// to end after the first checkpoint (after its start, without a signal), and the checkpoint
/// directory.
fn faulted_run(
    name: &str,
    signal: Option<&str>,
    env: &[(&str, &str)],
    extra: &[&str],
) -> (std::process::ExitStatus, String, Duration, PathBuf) {
    let dir = scratch(&format!("processes-{name}"));
    let plan = compile(&dir, "dp2", 4, &["--dp", "2", "--zero", "1"]);
    let save = dir.join("save");
    let metrics = dir.join("metrics.jsonl");
    let mut flags = vec!["--save", save.to_str().unwrap(), "--save-every", "2", "--launch", "2"];
    flags.extend(extra);
    let stderr = dir.join("stderr.txt");
    // Marks the job's processes, to find rank 1's among the machine's.
    let marker = format!("{name}-{}", std::process::id());
    let mut job = Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(run_args(&plan, 100_000, &metrics, &flags))
        .env("AUTOTP_TEST_JOB", &marker)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    // A fault from `env` strikes on its own, maybe before this loop would see a checkpoint.
    while signal.is_some() && !save.join("latest").exists() {
        assert!(Instant::now() < deadline, "no checkpoint within 60 s");
        if let Some(status) = job.try_wait().unwrap() {
            panic!(
                "the job ended before its first checkpoint ({status}): {}",
                std::fs::read_to_string(&stderr).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let faulted = Instant::now();
    if let Some(signal) = signal {
        let pid = rank_pid(&marker, 1).expect("the process of rank 1");
        assert!(Command::new("kill").args([signal, &pid.to_string()]).status().unwrap().success());
    }
    let status = loop {
        if let Some(status) = job.try_wait().unwrap() {
            break status;
        }
        if faulted.elapsed() > Duration::from_secs(60) {
            let _ = job.kill();
            panic!("the job still runs 60 s after its fault: {}", std::fs::read_to_string(&stderr).unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = faulted.elapsed();
    let stderr = std::fs::read_to_string(&stderr).unwrap();
    println!("{name}: the job ended in {took:?} with {status}:\n{stderr}");
    (status, stderr, took, save)
}

/// The previous checkpoint of a job that failed loads, and a run resumes from it.
fn resumes(save: &Path) {
    let dir = save.parent().unwrap();
    let plan = dir.join("dp2.atp");
    let metrics = dir.join("resumed.jsonl");
    let checkpoint = autotp_train::checkpoint::Checkpoint::open(save).unwrap();
    let step = checkpoint.manifest.step;
    success(autotp(&run_args(&plan, step + 1, &metrics, &["--resume", save.to_str().unwrap()])));
    assert_eq!(losses(&metrics).len(), 1);
}

#[test]
fn a_killed_process_ends_the_job() {
    let (status, stderr, took, save) = faulted_run("sigkill", Some("-KILL"), &[], &[]);
    assert!(!status.success());
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(stderr.contains("rank 1"), "{stderr}");
    resumes(&save);
}

#[test]
fn a_panicking_process_ends_the_job() {
    let (status, stderr, took, save) = faulted_run("panic", None, &[("AUTOTP_PANIC_AT", "1:9")], &[]);
    assert!(!status.success());
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(stderr.contains("autotp: rank 1 of 2: panicked"), "{stderr}");
    resumes(&save);
}

#[test]
fn a_stopped_process_ends_the_job() {
    let (status, stderr, took, save) = faulted_run("sigstop", Some("-STOP"), &[], &["--comm-timeout", "5"]);
    assert!(!status.success());
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(stderr.contains("rank 1 (host ") && stderr.contains("is stopped"), "{stderr}");
    resumes(&save);
    // Stopped between writing its file and the barrier that commits the checkpoint: rank 0
    // waits in a barrier, which waits long for slow disks but not for a rank seen stopped.
    let stop = [("AUTOTP_STOP_DURING_CHECKPOINT", "1:4")];
    let (status, stderr, took, save) = faulted_run("sigstop-save", None, &stop, &["--comm-timeout", "5"]);
    assert!(!status.success());
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(stderr.contains("a barrier around a checkpoint") && stderr.contains("is stopped"), "{stderr}");
    assert_eq!(autotp_train::checkpoint::Checkpoint::open(&save).unwrap().manifest.step, 2);
    resumes(&save);
}

/// `bench-comm` checks every collective's result (all-to-all and ring shift included) on every
/// rank: as 2 MPI processes (and the bootstrap: rank 0's 128 random bytes reach both) and as 3
/// threads.
#[test]
fn bench_comm_checks_the_collectives() {
    let exe = env!("CARGO_BIN_EXE_autotp");
    let args = ["bench-comm", "--sizes", "1,3", "--iters", "2"];
    let out = success(mpirun().args(["-n", "2", exe]).args(args).output().unwrap());
    assert!(out.contains("bootstrap: rank 0's 128 bytes reached all 2 ranks through MPI"), "{out}");
    for row in
        ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ring_shift", "MPI_Allreduce", "overlap (mpi)"]
    {
        assert!(out.contains(row), "{row}: {out}");
    }
    let out = success(autotp(&["bench-comm", "--ranks", "3", "--sizes", "3", "--iters", "2"]));
    assert!(out.contains("overlap (threads)"), "{out}");
}
