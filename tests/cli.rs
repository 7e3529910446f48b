//! The command line on bad input: a non-zero exit, one clear line naming the problem, and
//! never a panic.

use std::path::{Path, PathBuf};
use std::process::Command;

use autotp_frontend::onnx::proto;
use prost::Message;

use crate::common::fixture;

fn temp_dir(name: &str) -> PathBuf {
    let dir = crate::common::scratch_file(&format!("cli-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the CLI; asserts it failed cleanly and returns its stderr.
fn fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_autotp")).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "autotp {args:?} succeeded");
    assert!(!stderr.contains("panicked"), "autotp {args:?} panicked:\n{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "expected one line of error, got:\n{stderr}");
    stderr
}

fn tensor_type(elem: proto::tensor_proto::DataType, dims: &[i64]) -> Option<proto::TypeProto> {
    use proto::tensor_shape_proto::{dimension::Value, Dimension};
    let dim = dims.iter().map(|&d| Dimension { value: Some(Value::DimValue(d)), ..Default::default() }).collect();
    Some(proto::TypeProto {
        value: Some(proto::type_proto::Value::TensorType(proto::type_proto::Tensor {
            elem_type: elem as i32,
            shape: Some(proto::TensorShapeProto { dim }),
        })),
        ..Default::default()
    })
}

/// A one-node model `y = op_type(a, b)` over f32 inputs of the given shapes.
fn write_model(dir: &Path, op_type: &str, a: &[i64], b: &[i64]) -> PathBuf {
    use proto::tensor_proto::DataType::Float;
    let input = |name: &str, dims: &[i64]| proto::ValueInfoProto {
        name: name.into(),
        r#type: tensor_type(Float, dims),
        ..Default::default()
    };
    let model = proto::ModelProto {
        ir_version: 8,
        opset_import: vec![proto::OperatorSetIdProto { domain: String::new(), version: 17 }],
        graph: Some(proto::GraphProto {
            name: "tiny".into(),
            node: vec![proto::NodeProto {
                op_type: op_type.into(),
                name: format!("the_{op_type}"),
                input: vec!["a".into(), "b".into()],
                output: vec!["y".into()],
                ..Default::default()
            }],
            input: vec![input("a", a), input("b", b)],
            output: vec![proto::ValueInfoProto { name: "y".into(), ..Default::default() }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let path = dir.join(format!("{op_type}.onnx"));
    std::fs::write(&path, model.encode_to_vec()).unwrap();
    path
}

#[test]
fn unsupported_op() {
    let dir = temp_dir("unsupported");
    let model = write_model(&dir, "Det", &[2, 2], &[2, 2]);
    let err = fails(&["import", model.to_str().unwrap()]);
    assert!(err.contains("unsupported op Det (node 'the_Det', opset 17)"), "{err}");
}

#[test]
fn shape_mismatch_inside_the_graph() {
    let dir = temp_dir("mismatch");
    let model = write_model(&dir, "Add", &[2, 3], &[4]);
    let err = fails(&["import", model.to_str().unwrap()]);
    assert!(err.contains("Add node 'the_Add': shapes [2, 3] and [4] do not broadcast"), "{err}");
}

#[test]
fn truncated_and_random_files() {
    let dir = temp_dir("garbage");
    let whole = std::fs::read(fixture("gpt2", "model.onnx")).unwrap();
    let truncated = dir.join("truncated.onnx");
    std::fs::write(&truncated, &whole[..whole.len() / 2]).unwrap();
    let err = fails(&["import", truncated.to_str().unwrap(), "--batch", "4", "--seq-len", "32"]);
    assert!(err.contains("truncated.onnx is not a valid ONNX model"), "{err}");

    let random = dir.join("random.onnx");
    let mut state = 12345u64;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            (state >> 56) as u8
        })
        .collect();
    std::fs::write(&random, noise).unwrap();
    let err = fails(&["import", random.to_str().unwrap()]);
    assert!(err.contains("random.onnx is not a valid ONNX model"), "{err}");

    let err = fails(&["import", dir.join("missing.onnx").to_str().unwrap()]);
    assert!(err.contains("cannot read") && err.contains("missing.onnx"), "{err}");
    assert_eq!(err.matches("No such file").count(), 1, "the cause is said once: {err}");
}

#[test]
fn unbound_symbolic_dims() {
    let err = fails(&["import", fixture("gpt2", "model.onnx").to_str().unwrap()]);
    assert!(err.contains("input 'input_ids': dim 0 is symbolic ('batch'); give it with --batch"), "{err}");
}

#[test]
fn bad_infer_inputs() {
    let dir = temp_dir("infer");
    let model = fixture("gpt2", "model.onnx");
    let model = model.to_str().unwrap();
    let out = dir.join("out");
    let out = out.to_str().unwrap();

    let ids = fixture("gpt2", "input_ids.npy");
    let err = fails(&["infer", model, "--input", &format!("tokens={}", ids.display()), "--output-dir", out]);
    assert!(err.contains("the model needs input 'input_ids'"), "{err}");

    let write = |name: &str, t: autotp_runtime::HostTensor| {
        let path = dir.join(name);
        autotp_runtime::npy::write(&path, &t).unwrap();
        format!("input_ids={}", path.display())
    };
    let flat = write(
        "flat.npy",
        autotp_runtime::HostTensor { dtype: autotp_ir::DType::I64, shape: vec![8], data: vec![0; 64] },
    );
    let err = fails(&["infer", model, "--input", &flat, "--output-dir", out]);
    assert!(err.contains("input 'input_ids': is given with 1 dims [8], the model declares 2"), "{err}");

    let floats = write(
        "floats.npy",
        autotp_runtime::HostTensor { dtype: autotp_ir::DType::F32, shape: vec![2, 4], data: vec![0; 32] },
    );
    let err = fails(&["infer", model, "--input", &floats, "--output-dir", out]);
    assert!(err.contains("input 'input_ids': the file holds f32, the model takes i64"), "{err}");

    let too_big = write(
        "big.npy",
        autotp_runtime::HostTensor {
            dtype: autotp_ir::DType::I64,
            shape: vec![1, 2],
            data: [5000i64, 1].iter().flat_map(|v| v.to_le_bytes()).collect(),
        },
    );
    let err = fails(&["infer", model, "--input", &too_big, "--output-dir", out]);
    assert!(err.contains("index 5000 is out of range for a dimension of size 1000"), "{err}");

    let err = fails(&["infer", model, "--input", "input_ids=/nonexistent.npy", "--output-dir", out]);
    assert!(err.contains("/nonexistent.npy"), "{err}");
}

#[test]
fn corrupted_models_never_panic() {
    // Every prefix length and a sweep of flipped bytes of a real model: each import either
    // succeeds or returns an error; none may panic.
    let whole = std::fs::read(fixture("gpt2", "model.onnx")).unwrap();
    let path = fixture("gpt2", "model.onnx");
    let options = autotp_frontend::ImportOptions { batch: Some(2), seq_len: Some(8), ..Default::default() };
    let mut variants: Vec<Vec<u8>> = (1..64).map(|i| whole[..whole.len() * i / 64].to_vec()).collect();
    let mut state = 99u64;
    for _ in 0..64 {
        let mut flipped = whole.clone();
        for _ in 0..8 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let at = (state >> 33) as usize % flipped.len();
            flipped[at] ^= (state >> 25) as u8 | 1;
        }
        variants.push(flipped);
    }
    for (i, bytes) in variants.into_iter().enumerate() {
        let result = std::panic::catch_unwind(|| {
            let _ = autotp_frontend::onnx::import_bytes(bytes::Bytes::from(bytes), &path, &options);
        });
        assert!(result.is_ok(), "variant {i} panicked");
    }
}

#[test]
fn infer_writes_pytorch_matching_logits() {
    // The acceptance check, through the command line: `autotp infer` on each architecture's
    // export writes DIR/logits.npy within 1e-4 (relative to the reference's max) of PyTorch.
    for arch in crate::common::ARCHES {
        let dir = temp_dir(&format!("infer-{arch}"));
        let ids = fixture(arch, "input_ids.npy");
        let out = Command::new(env!("CARGO_BIN_EXE_autotp"))
            .args(["infer", fixture(arch, "model.onnx").to_str().unwrap()])
            .args(["--input", &format!("input_ids={}", ids.display()), "--output-dir", dir.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{arch}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("logits: f32[4, 32, 1000]"), "{arch}");
        let got = crate::common::read_npy(&dir.join("logits.npy"));
        let want = crate::common::read_npy(&fixture(arch, "logits.npy"));
        let (diff, scale) = crate::common::max_abs_diff(&got, &want);
        assert!(diff <= 1e-4 * scale, "{arch}: max |autotp - torch| = {diff}, reference max {scale}");
    }
}

/// A launch that does not fit the plan is refused before anything starts: a world size other
/// than the plan's ranks (both numbers named), torchrun (CPU ranks as processes run over MPI),
/// a launcher's partial variables. SLURM's variables alone (a batch script in an allocation)
/// are not a launch.
#[test]
fn launches_that_do_not_fit_the_plan_are_refused() {
    let dir = temp_dir("launched");
    let plan = dir.join("gpt2.atp");
    let model = fixture("gpt2", "model.onnx");
    let compile = Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(["compile", model.to_str().unwrap(), "--seq-len", "8", "--micro-batch", "2", "-o"])
        .arg(&plan)
        .output()
        .unwrap();
    assert!(compile.status.success(), "{}", String::from_utf8_lossy(&compile.stderr));
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    let run = |vars: &[(&str, &str)]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_autotp"));
        command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "1"]);
        for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID"]
        {
            command.env_remove(var);
        }
        command.envs(vars.iter().copied()).output().unwrap()
    };
    let out = run(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    assert!(err.contains("Open MPI started 2 processes, but the plan has 1 ranks"), "{err}");
    let out = run(&[("RANK", "1"), ("WORLD_SIZE", "2")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("torchrun started this process as rank 1 of 2") && err.contains("mpirun -n 2"), "{err}");
    let err = String::from_utf8_lossy(&run(&[("RANK", "0")]).stderr).into_owned();
    assert!(err.contains("torchrun sets RANK but not WORLD_SIZE"), "{err}");
    let out = run(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The binary links nothing of MPI: where Open MPI's library is missing, a single process runs,
/// and a job of processes is refused naming the library and how to install it.
#[test]
fn a_job_without_mpi_names_what_is_missing() {
    let linked = Command::new("ldd").arg(env!("CARGO_BIN_EXE_autotp")).output().unwrap();
    let linked = String::from_utf8_lossy(&linked.stdout);
    assert!(!linked.contains("libmpi"), "{linked}");
    let dir = temp_dir("without-mpi");
    let plan = dir.join("dp2.atp");
    let model = fixture("gpt2", "model.onnx");
    let compile = Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(["compile", model.to_str().unwrap(), "--seq-len", "8", "--micro-batch", "2", "--dp", "2", "-o"])
        .arg(&plan)
        .output()
        .unwrap();
    assert!(compile.status.success(), "{}", String::from_utf8_lossy(&compile.stderr));
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    let out = Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "1"])
        .envs([
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("AUTOTP_MPI_LIBRARY", "libmpi-missing.so"),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    assert!(err.contains("cannot load Open MPI's library (libmpi-missing.so)") && err.contains("openmpi-bin"), "{err}");
}

/// The binary links nothing of CUDA: without a driver, `--device cuda` stops before loading
/// anything, with one line naming the library, and no panic.
#[test]
fn a_cuda_run_without_a_driver_names_the_library() {
    let linked = Command::new("ldd").arg(env!("CARGO_BIN_EXE_autotp")).output().unwrap();
    let linked = String::from_utf8_lossy(&linked.stdout);
    assert!(!linked.contains("libcuda") && !linked.contains("libnccl") && !linked.contains("libcublas"), "{linked}");
    let model = fixture("gpt2", "model.onnx");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    let dir = temp_dir("without-cuda");
    let commands: [Vec<String>; 2] = [
        ["run", "no-plan-needed.atp"].map(String::from).to_vec(),
        ["train", model.to_str().unwrap(), "--seq-len", "8", "--micro-batch", "2"].map(String::from).to_vec(),
    ];
    for command in commands {
        let out = Command::new(env!("CARGO_BIN_EXE_autotp"))
            .args(&command)
            .args(["--data", tokens.to_str().unwrap(), "--steps", "1", "--device", "cuda"])
            .current_dir(&dir)
            .env("AUTOTP_CUDA_DRIVER", "libcuda-missing.so.1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && !err.contains("panicked"), "{command:?}: {err}");
        assert!(err.contains("no CUDA driver found: libcuda-missing.so.1 could not be loaded ("), "{command:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{command:?}: {err}");
    }
}

/// Optimizer and schedule values `torch.optim` refuses (a learning rate, eps, weight decay or
/// momentum below 0, betas outside [0, 1), Nesterov without momentum), and values that are not
/// finite, are refused by `compile`, naming the flag.
#[test]
fn optimizer_values_pytorch_refuses_are_refused() {
    let model = fixture("gpt2", "model.onnx");
    let out = temp_dir("optimizer-values").join("plan.atp");
    let cases: [(&[&str], &str); 10] = [
        (&["--lr=-1"], "--lr -1 is invalid: it must be a finite number of at least 0"),
        (&["--lr", "nan"], "--lr NaN is invalid"),
        (&["--lr", "inf"], "--lr inf is invalid"),
        (&["--betas", "0.9,1.0"], "--betas 0.9,1 is invalid: each must be at least 0 and below 1"),
        (&["--betas=-0.1,0.999"], "--betas -0.1,0.999 is invalid"),
        (&["--eps=-1e-8"], "--eps -0.00000001 is invalid"),
        (&["--weight-decay=-0.1"], "--weight-decay -0.1 is invalid"),
        (&["--grad-clip", "0"], "--grad-clip 0 is invalid: it must be a finite norm above 0"),
        (&["--optimizer", "sgd", "--nesterov"], "--nesterov needs a --momentum above 0"),
        (&["--lr-schedule", "cosine", "--min-lr=-1e-5"], "--min-lr -0.00001 is invalid"),
    ];
    for (flags, expected) in cases {
        let args = [&["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "2"][..], flags];
        let err = fails(&[&args.concat()[..], &["-o", out.to_str().unwrap()]].concat());
        assert!(err.contains(expected), "{flags:?}: {err}");
    }
    assert!(!out.exists(), "a refused plan is not written");
}

/// A sequence longer than the model's position table is refused when the plan is compiled, not
/// at its first step.
#[test]
fn a_sequence_longer_than_the_position_table_is_refused() {
    let model = fixture("gpt2", "model.onnx");
    let out = temp_dir("seq-len").join("plan.atp");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "129", "--micro-batch", "2"];
    let err = fails(&[&args[..], &["-o", out.to_str().unwrap()]].concat());
    assert!(
        err.contains("--seq-len 129: the model reads entry 128 of 'm.transformer.wpe.weight' (dim 0 of size 128"),
        "{err}"
    );
    assert!(err.contains("allows --seq-len 128 at most"), "{err}");
}

/// A command never writes over a file it reads: the model (`compile -o`, `--report`,
/// `train --metrics-out`), the plan or the token file (`run --metrics-out`). Each is refused
/// before anything is written, and the file is as it was.
#[test]
fn outputs_never_overwrite_inputs() {
    let dir = temp_dir("overwrite");
    let model = dir.join("model.onnx");
    std::fs::copy(fixture("gpt2", "model.onnx"), &model).unwrap();
    let tokens = dir.join("tokens.bin");
    std::fs::copy(crate::common::repo().join("tests/fixtures/train/tokens.bin"), &tokens).unwrap();
    let plan = dir.join("plan.atp");
    let (m, t, p) = (model.to_str().unwrap(), tokens.to_str().unwrap(), plan.to_str().unwrap());
    let contract = ["--seq-len", "32", "--micro-batch", "2"];
    let compiled = Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args([&["compile", m][..], &contract, &["-o", p]].concat())
        .output()
        .unwrap();
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));
    let kept: Vec<(PathBuf, Vec<u8>)> =
        [&model, &tokens, &plan].iter().map(|f| (f.to_path_buf(), std::fs::read(f).unwrap())).collect();
    let cases: [(Vec<&str>, &str); 5] = [
        ([&["compile", m][..], &contract, &["-o", m]].concat(), "model.onnx is the model being compiled"),
        ([&["compile", m][..], &contract, &["--report", m]].concat(), "model.onnx is the model being compiled"),
        (
            vec!["run", p, "--data", t, "--steps", "1", "--metrics-out", t],
            "tokens.bin is the token file being trained on",
        ),
        (vec!["run", p, "--data", t, "--steps", "1", "--metrics-out", p], "plan.atp is the plan being run"),
        (
            [&["train", m][..], &contract, &["--data", t, "--steps", "1", "--metrics-out", m]].concat(),
            "model.onnx is the model being trained",
        ),
    ];
    for (args, expected) in cases {
        let err = fails(&args);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
    for (file, bytes) in kept {
        assert_eq!(std::fs::read(&file).unwrap(), bytes, "{} changed", file.display());
    }
}

/// A command whose output is cut short (`autotp compile ... | head -1`) ends quietly, killed by
/// SIGPIPE as other command-line tools are: no panic from a failed print.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let model = fixture("gpt2", "model.onnx");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4", "-o", "/dev/null"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}: {stderr}", out.status);
}

/// A model whose initializer names its external data outside the model's folder (a path up
/// through `..`, an absolute one, a symbolic link out) is refused with one line naming the
/// tensor and the location, before anything is read (CVE-2022-25882's rule, as ONNX applies
/// it); data inside the folder still loads.
#[test]
fn external_data_outside_the_model_folder() {
    let dir = temp_dir("external-data");
    let secret = dir.join("secret.bin");
    std::fs::write(&secret, 1.5f32.to_le_bytes()).unwrap();
    let folder = dir.join("model");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("inside.bin"), 2.5f32.to_le_bytes()).unwrap();
    let _ = std::fs::remove_file(folder.join("link.bin"));
    std::os::unix::fs::symlink(&secret, folder.join("link.bin")).unwrap();
    let model_with = |location: &str| {
        use proto::tensor_proto::DataType::Float;
        let entry = |key: &str, value: &str| proto::StringStringEntryProto { key: key.into(), value: value.into() };
        let weight = proto::TensorProto {
            name: "w".into(),
            dims: vec![1],
            data_type: Float as i32,
            data_location: proto::tensor_proto::DataLocation::External as i32,
            external_data: vec![entry("location", location), entry("offset", "0"), entry("length", "4")],
            ..Default::default()
        };
        let model = proto::ModelProto {
            ir_version: 8,
            opset_import: vec![proto::OperatorSetIdProto { domain: String::new(), version: 17 }],
            graph: Some(proto::GraphProto {
                name: "external".into(),
                node: vec![proto::NodeProto {
                    op_type: "Add".into(),
                    name: "the_Add".into(),
                    input: vec!["a".into(), "w".into()],
                    output: vec!["y".into()],
                    ..Default::default()
                }],
                initializer: vec![weight],
                input: vec![proto::ValueInfoProto {
                    name: "a".into(),
                    r#type: tensor_type(Float, &[1]),
                    ..Default::default()
                }],
                output: vec![proto::ValueInfoProto { name: "y".into(), ..Default::default() }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let path = folder.join("model.onnx");
        std::fs::write(&path, model.encode_to_vec()).unwrap();
        path
    };
    let climbing = "../../../../../../../../etc/passwd";
    let absolute = secret.to_str().unwrap().to_string();
    for (location, why) in
        [(climbing, "climbs out of"), (absolute.as_str(), "is an absolute path"), ("link.bin", "resolves to")]
    {
        let model = model_with(location);
        let err = fails(&["import", model.to_str().unwrap()]);
        assert!(err.contains("'w'"), "{err}");
        assert!(err.contains(&format!("external data location '{location}' {why}")), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    let model = model_with("inside.bin");
    let out = Command::new(env!("CARGO_BIN_EXE_autotp")).args(["import", model.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
