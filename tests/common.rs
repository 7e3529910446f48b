//! Helpers shared by the end-to-end tests.

use std::path::{Path, PathBuf};

use autotp_ir::{DType, Tensor, TensorType};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(arch: &str, file: &str) -> PathBuf {
    repo().join("tests/fixtures").join(arch).join(file)
}

/// Import options binding the fixtures' symbolic batch and sequence dims.
pub fn bound() -> autotp_frontend::ImportOptions {
    autotp_frontend::ImportOptions { batch: Some(8), seq_len: Some(32), ..Default::default() }
}

/// This test process's scratch root, `$TMPDIR/autotp-tests/PID`. The first call removes the
/// roots of earlier test processes that have ended, so runs do not pile up scratch.
fn scratch_root() -> &'static Path {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let all = std::env::temp_dir().join("autotp-tests");
        for entry in std::fs::read_dir(&all).into_iter().flatten().flatten() {
            let pid = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok());
            if pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let root = all.join(std::process::id().to_string());
        std::fs::create_dir_all(&root).unwrap();
        root
    })
}

/// A fresh, empty scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = scratch_root().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A path for one test's scratch file (not created).
pub fn scratch_file(name: &str) -> PathBuf {
    scratch_root().join(name)
}

/// Runs the `autotp` binary with `args` (paths as strings).
pub fn autotp<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_autotp")).args(args).output().unwrap()
}

/// `autotp train` of the tiny exported Llama (tests/fixtures/hf_export) at sequence 16, `args`
/// added.
pub fn train_hf_export(args: &[&str]) -> std::process::Output {
    let model = fixture("hf_export", "model.onnx");
    let base = ["train", model.to_str().unwrap_or_default(), "--seq-len", "16"];
    autotp(&[&base[..], args].concat())
}

/// Asserts that a run succeeded and returns its stdout.
pub fn success(out: std::process::Output) -> String {
    assert!(out.status.success(), "autotp failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts that a run failed cleanly (no panic) and returns its stderr.
pub fn failure(out: std::process::Output) -> String {
    assert!(!out.status.success(), "autotp succeeded:\n{}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// The plan of `autotp compile ARGS` (the model and flags, without `-o`), shapes-only and cut
/// to `layers` layers, compiled in this process.
pub fn compile_shapes(args: &[String], layers: usize) -> autotp_program::plan::TrainingPlan {
    let flags = autotp_compiler::CompileFlags::parse_args(args).unwrap();
    let options = autotp_compiler::CompileOptions::from_flags(&flags).unwrap();
    autotp_compiler::compile(&options, autotp_compiler::Weights::ShapesOnly { layers: Some((0..layers).collect()) })
        .unwrap()
        .plan
}

/// Runs `plan` to step `steps` over the committed tokens, writing `metrics` (`extra` added);
/// asserts it succeeded and returns what it printed on stderr (its progress and measurements).
pub fn run_plan(plan: &Path, metrics: &Path, steps: usize, extra: &[&str]) -> String {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let steps = steps.to_string();
    let args = [
        &["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", &steps][..],
        &["--metrics-out", metrics.to_str().unwrap()],
        extra,
    ]
    .concat();
    let out = autotp(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    success(out);
    stderr
}

/// The `(step, loss)` of every line of a metrics file.
pub fn losses(metrics: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

pub const ARCHES: [&str; 5] = ["gpt2", "llama", "bert", "gpt_neox", "qwen2"];

pub fn read_npy(path: &Path) -> Tensor {
    let t = autotp_runtime::npy::read(path).unwrap_or_else(|e| panic!("{e}"));
    Tensor::from_pod(t.dtype, t.shape, &t.data)
}

/// Deterministic pseudo-random values in [-1, 1) (floats) or {0, 1} (others).
pub fn random_tensor(ty: &TensorType, seed: u64) -> Tensor {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let values: Vec<f64> = (0..ty.numel())
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
            if ty.dtype.is_float() {
                unit * 2.0 - 1.0
            } else {
                (unit * 2.0).floor()
            }
        })
        .collect();
    let bytes: Vec<u8> = values.iter().flat_map(|&v| autotp_ir::scalar_bytes(ty.dtype, v)).collect();
    Tensor::from_pod(ty.dtype, ty.shape.clone(), &bytes)
}

/// Largest |a - b| over all elements, and the largest |b|.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> (f64, f64) {
    assert_eq!(a.ty, b.ty, "compared tensors differ in type");
    assert!(a.dtype() != DType::Bool || a == b);
    let (va, vb) = (a.to_f64_vec(), b.to_f64_vec());
    let diff = va.iter().zip(&vb).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    let scale = vb.iter().fold(0f64, |m, y| m.max(y.abs()));
    (diff, scale)
}

/// The pid of the autotp process that Open MPI started as rank `rank` of the job marked
/// `marker` (its environment has `AUTOTP_TEST_JOB=marker`), if it runs.
pub fn rank_pid(marker: &str, rank: usize) -> Option<u32> {
    let wanted = format!("OMPI_COMM_WORLD_RANK={rank}");
    let marked = format!("AUTOTP_TEST_JOB={marker}");
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let is_autotp = cmdline.split(|&b| b == 0).next().is_some_and(|exe| exe.ends_with(b"autotp"));
        let ours = environ.split(|&b| b == 0).any(|v| v == marked.as_bytes());
        if is_autotp && ours && environ.split(|&b| b == 0).any(|v| v == wanted.as_bytes()) {
            return Some(pid);
        }
    }
    None
}
