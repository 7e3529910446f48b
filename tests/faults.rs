//! Faults a long run meets: a scheduler's preempting signal (a checkpoint after the step, exit
//! status 75, a bit-identical resume), as threads of one process, as MPI processes that
//! received it on one rank only, and through `--launch`; a full disk or a file-size limit at
//! a save (one line, the last checkpoint intact, nothing half-written) and at NVMe offload's
//! allocation; a gradient that is not finite (`--nan-policy`: the step, the parameter and the
//! op named, or the step skipped).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use autotp_kernels::DType;
use autotp_program::tensor_file::{self, TensorFile, TensorRef};
use autotp_train::checkpoint::Checkpoint;

use crate::common::{autotp, failure, fixture, losses, rank_pid, repo, scratch, success};

const PREEMPTED: i32 = autotp_train::preemption::PREEMPTED_EXIT_CODE as i32;

/// Compiles the GPT-2 fixture at dp 2 into `dir`.
fn compile_dp2(dir: &Path) -> PathBuf {
    compile_dp2_with(dir, "dp2", &[])
}

/// Compiles the GPT-2 fixture at dp 2 with `extra` flags into `dir`/`name`.atp.
fn compile_dp2_with(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let plan = dir.join(format!("{name}.atp"));
    let model = fixture("gpt2", "model.onnx");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4", "--dp", "2"];
    success(autotp(&[&args[..], extra, &["--lr", "2e-3", "-o", plan.to_str().unwrap()]].concat()));
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

/// A tmpfs mounted for a test (root only), unmounted when dropped.
struct SmallFilesystem {
    path: PathBuf,
}

impl SmallFilesystem {
    fn mount(path: &Path, size: &str) -> Result<SmallFilesystem, String> {
        std::fs::create_dir_all(path).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", path.to_str().unwrap()])
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        match out.status.success() {
            true => Ok(SmallFilesystem { path: path.to_path_buf() }),
            false => Err(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        }
    }
}

impl Drop for SmallFilesystem {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

/// `out` is of a run saving every 2 steps into `save` whose save of step 4 failed with `error`:
/// one line says so, naming the file and the intact checkpoint of step 2, nothing half-written
/// is left, and a resume of step 2 goes on bit-identically.
fn save_fails(plan: &Path, save: &Path, out: std::process::Output, error: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    println!("{stderr}");
    assert!(!out.status.success());
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    let kept = save.join("step-00000002");
    let want = format!(
        "error: checkpoint {}: step 4 not saved: cannot write {}/.tmp-step-00000004-",
        save.display(),
        save.display()
    );
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].starts_with(&want), "{stderr}");
    let intact = format!("rank-00000.safetensors: {error}; --resume takes {}, which is intact", kept.display());
    assert!(errors[0].ends_with(&intact), "{stderr}");
    let names: Vec<String> =
        std::fs::read_dir(save).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "a failed save left {names:?}");
    resumes_bit_identically(plan, save, 2, &[]);
}

#[test]
fn a_full_disk_stops_the_run_and_keeps_the_last_checkpoint() {
    let dir = scratch("faults-full-disk");
    let plan = compile_dp2(&dir);
    let metrics = dir.join("metrics.jsonl");
    let saving = |save: &Path| run_args(&plan, 6, &metrics, &["--save", save.to_str().unwrap(), "--save-every", "2"]);

    // A file-size limit (a quota's effect): the second run, resumed from step 2, cannot write.
    let save = dir.join("limited");
    success(autotp(&run_args(&plan, 2, &metrics, &["--save", save.to_str().unwrap()])));
    let resumed = [&saving(&save)[..], &["--resume".to_string(), save.to_str().unwrap().to_string()]].concat();
    let limited = "trap '' XFSZ; ulimit -f 1024; exec \"$0\" \"$@\"";
    let out = Command::new("sh").args(["-c", limited, env!("CARGO_BIN_EXE_autotp")]).args(&resumed).output().unwrap();
    save_fails(&plan, &save, out, "File too large (os error 27)");

    // A filesystem of 3 MiB: step 2's checkpoint (2.1 MB) fits, step 4's does not.
    let small = match SmallFilesystem::mount(&dir.join("small"), "3m") {
        Ok(small) => small,
        Err(why) => {
            println!("not tested on a full filesystem: a tmpfs cannot be mounted here ({why})");
            return;
        }
    };
    let save = small.path.join("save");
    save_fails(&plan, &save, autotp(&saving(&save)), "No space left on device (os error 28)");

    // NVMe offload's files are allocated whole before the first step: one that does not fit
    // stops the run there, naming it.
    std::fs::remove_dir_all(&save).unwrap();
    let nvme = small.path.join("nvme");
    std::fs::create_dir(&nvme).unwrap();
    let offloaded = dir.join("nvme.atp");
    let model = fixture("gpt2", "model.onnx");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4"];
    let offload = ["--offload-optimizer", "nvme", "--nvme-path", nvme.to_str().unwrap()];
    success(autotp(&[&args[..], &offload, &["-o", offloaded.to_str().unwrap()]].concat()));
    let filler = small.path.join("filler");
    std::fs::write(&filler, vec![0u8; 2 << 20]).unwrap();
    let stderr = failure(autotp(&run_args(&offloaded, 2, &metrics, &[])));
    let want = format!("cannot allocate the offloaded bytes in {}/", nvme.display());
    assert!(stderr.contains(&want) && stderr.contains("No space left on device"), "{stderr}");
}

/// Sets element 0 of `tensor` to +inf in the checkpoint file `file` (its checksums written
/// anew, as a step that overflowed would have left it).
fn poison(file: &Path, tensor: &str) {
    let opened = TensorFile::open(file).unwrap();
    let mut tensors: Vec<(String, DType, Vec<usize>, Vec<u8>)> = opened
        .names()
        .map(|name| {
            let t = opened.get(name).unwrap();
            (t.name.clone(), t.dtype, t.shape.clone(), t.bytes.to_vec())
        })
        .collect();
    drop(opened);
    let poisoned = tensors.iter_mut().find(|t| t.0 == tensor).unwrap_or_else(|| panic!("no '{tensor}'"));
    poisoned.3[..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    let refs: Vec<TensorRef> = (tensors.iter())
        .map(|(name, dtype, shape, bytes)| TensorRef { name: name.clone(), dtype: *dtype, shape: shape.clone(), bytes })
        .collect();
    tensor_file::write(file, &refs, Default::default()).unwrap();
}

/// `--nan-policy stop` (the default) ends a step whose gradients are not finite with one line
/// naming the step, the first parameter whose gradient is not finite and the op that made the
/// first inf, as threads, as processes and on emulated GPUs; the checkpoint of the step before stays the state.
/// `--nan-policy skip` goes on, every such step's update kept back (on the emulated GPU too,
/// inside CUDA graph replays). A plan compiled with `--no-finite-check` stops on the loss and
/// says so, and cannot skip.
#[test]
fn a_non_finite_gradient_names_the_step_the_parameter_and_the_op() {
    let dir = scratch("faults-nan");
    let ir = dir.join("ir");
    let plan = compile_dp2_with(&dir, "checked", &["--dump-ir", ir.to_str().unwrap()]);
    let (save, metrics) = (dir.join("save"), dir.join("metrics.jsonl"));
    success(autotp(&run_args(&plan, 2, &metrics, &["--save", save.to_str().unwrap()])));
    let bias = "m.transformer.h.1.mlp.c_proj.bias";
    poison(&save.join("step-00000002/rank-00000.safetensors"), bias);

    let unchecked = compile_dp2_with(&dir, "unchecked", &["--no-finite-check"]);
    let resume = ["--resume", save.to_str().unwrap()];
    let stderr = failure(autotp(&run_args(&unchecked, 5, &dir.join("unchecked.jsonl"), &resume)));
    assert!(stderr.contains("step 3: the loss is NaN; the plan does not check its gradients"), "{stderr}");
    let skip = ["--resume", save.to_str().unwrap(), "--nan-policy", "skip"];
    let stderr = failure(autotp(&run_args(&unchecked, 5, &dir.join("unchecked.jsonl"), &skip)));
    assert!(stderr.contains("--nan-policy skip") && stderr.contains("compiled with --no-finite-check"), "{stderr}");
    let model = fixture("gpt2", "model.onnx");
    let half = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4", "--precision", "bf16"];
    let half = [&half[..], &["--no-finite-check", "-o", "/dev/null"]].concat();
    let stderr = failure(autotp(&half));
    assert!(stderr.contains("--no-finite-check with --precision bf16: a 16-bit step always checks"), "{stderr}");

    // Threads, processes, and the emulated GPU's ranks (whose replay downloads each output).
    for (launch, gpu) in [(&[][..], false), (&["--launch", "2"], false), (&["--device", "cuda"], true)] {
        let resume = [&["--resume", save.to_str().unwrap()][..], launch].concat();
        let mut run = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
        run.args(run_args(&plan, 5, &dir.join("stopped.jsonl"), &resume));
        if gpu {
            run.env("AUTOTP_GPU", "emulated");
        }
        let stderr = failure(run.output().unwrap());
        println!("{launch:?}:\n{stderr}");
        let line = stderr.lines().find(|l| l.contains("step 3: ")).unwrap_or_else(|| panic!("{stderr}"));
        assert!(line.contains("the loss is NaN and the gradients are not all finite"), "{line}");
        assert!(line.contains("the first parameter whose gradient is not finite is 'm.transformer."), "{line}");
        // The first inf is the poisoned bias's add, the node the instruction's label names.
        let node = line.split("the first inf or NaN was written by node ").nth(1).and_then(|r| r.split(' ').next());
        let node: u32 = node.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no node in {line}"));
        assert_eq!(node_reading(&ir, node), ("add".to_string(), bias.to_string()), "{line}");
        // The label names the node's value as the printed IR does: a line of the dump defines it.
        let value = line.split(&format!("node {node} (")).nth(1).and_then(|r| r.split(" = add)").next());
        let value = value.unwrap_or_else(|| panic!("no value in {line}"));
        let defined = format!("{value} = add ");
        assert!(last_dump(&ir).lines().any(|l| l.trim_start().starts_with(&defined) && l.contains(bias)), "{line}");
        assert!(line.contains("the parameters and optimizer states are those after step 2"), "{line}");
    }
    // Steps replayed as a CUDA graph cannot be looked inside: the line says how to find them.
    let graph = [&["--resume", save.to_str().unwrap()][..], &["--device", "cuda", "--cuda-graph"]].concat();
    let stderr = failure(on_emulated_gpu(&run_args(&plan, 5, &dir.join("graph.jsonl"), &graph)));
    assert!(stderr.contains("step 3: the loss is NaN and the gradients are not all finite"), "{stderr}");
    assert!(stderr.contains("the parameter and the op that made it are named without --cuda-graph"), "{stderr}");

    // Skipping: the run goes on; no update is applied, so every step is skipped and the bias
    // saved at the end is the poisoned one.
    let skipped = dir.join("skipped.jsonl");
    let resume = ["--resume", save.to_str().unwrap(), "--nan-policy", "skip", "--save", save.to_str().unwrap()];
    let stderr = success(autotp(&run_args(&plan, 5, &skipped, &resume)));
    assert!(stderr.is_empty() || !stderr.contains("error"), "{stderr}");
    let checkpoint = Checkpoint::open(&save).unwrap();
    assert_eq!((checkpoint.manifest.step, checkpoint.manifest.skipped_steps), (5, 3));
    let saved = checkpoint.tensor(bias).unwrap();
    assert_eq!(&saved.bytes[..4], &f32::INFINITY.to_le_bytes());

    // The same inside CUDA graph replays: the step kernel reads its guard on the device.
    let graph_save = dir.join("graph-save");
    let resume = ["--resume", save.to_str().unwrap(), "--nan-policy", "skip", "--save", graph_save.to_str().unwrap()];
    let skip_in_graph = [&resume[..], &["--device", "cuda", "--cuda-graph"]].concat();
    success(on_emulated_gpu(&run_args(&plan, 7, &dir.join("graph-skipped.jsonl"), &skip_in_graph)));
    let checkpoint = Checkpoint::open(&graph_save).unwrap();
    assert_eq!((checkpoint.manifest.step, checkpoint.manifest.skipped_steps), (7, 5));
    assert_eq!(&checkpoint.tensor(bias).unwrap().bytes[..4], &f32::INFINITY.to_le_bytes());
}

/// autotp with `args`, its GPUs emulated.
fn on_emulated_gpu(args: &[String]) -> std::process::Output {
    let mut run = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
    run.args(args).env("AUTOTP_GPU", "emulated").output().unwrap()
}

/// The op of node `index` of the graph `--dump-ir DIR` wrote last (the one codegen lowered),
/// and the parameter among its inputs.
fn node_reading(dir: &Path, index: u32) -> (String, String) {
    let graph = autotp_ir::text::parse(&last_dump(dir)).unwrap();
    let node = graph.node(autotp_ir::NodeId(index));
    let param = node.inputs.iter().find(|v| graph.params().contains(v)).and_then(|&v| graph.name_of(v));
    (node.op.name().to_string(), param.unwrap_or("none").to_string())
}

/// The text of the graph `--dump-ir DIR` wrote last.
fn last_dump(dir: &Path) -> String {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    std::fs::read_to_string(files.last().unwrap()).unwrap()
}
