//! The GPU device's host side (`autotp_runtime::gpu`) on the emulated GPU, against the CPU
//! executor: the same plan, the same inputs, bit-identical losses and weights, on one device
//! and on a mesh (ranks as threads and as MPI processes). The emulator's
//! streams run nothing until a result is needed, so an upload, launch or copy ordered wrongly
//! by the device shows here as a different number.

use std::sync::atomic::Ordering;

use autotp_kernels::{DType, Kernel};
use autotp_program::gpu::GpuForm;
use autotp_program::plan::PlanFile;
use autotp_program::{Instruction, Program};
use autotp_runtime::gpu::emulated::Emulator;
use autotp_runtime::gpu::GemmMath;
use autotp_runtime::{Executor, HostTensor};

use crate::common::{autotp, fixture, scratch, success};

/// Deterministic token ids below `vocab`.
fn tokens(shape: &[usize], vocab: i64, seed: i64) -> HostTensor {
    let n: usize = shape.iter().product();
    let ids: Vec<u8> = (0..n as i64).flat_map(|i| ((i * 7919 + seed * 104_729) % vocab).to_le_bytes()).collect();
    HostTensor { dtype: DType::I64, shape: shape.to_vec(), data: ids }
}

fn feeds(program: &Program, step: usize) -> Vec<HostTensor> {
    let scalar = |v: f32| HostTensor { dtype: DType::F32, shape: vec![], data: v.to_le_bytes().to_vec() };
    (program.inputs.iter())
        .map(|slot| match slot.name.as_str() {
            "input_ids" => tokens(&slot.shape, 1000, step as i64),
            "labels" => tokens(&slot.shape, 1000, step as i64 + 1),
            "lr" => scalar(2e-3),
            "step" => scalar(step as f32),
            other => panic!("unexpected input {other}"),
        })
        .collect()
}

/// `autotp compile MODEL --seq-len 16 FLAGS -o PLAN`, attention unfused unless FLAGS choose:
/// the emulated GPU runs fused attention as a GPU's passes cut it (a thread per row), which
/// sums in another order than the CPU's vectors, so only unfused plans train bit for bit alike
/// on both (fused attention on the emulated GPU is tested within 1e-5: `tests/attention.rs`).
fn compile(model: &std::path::Path, plan: &std::path::Path, flags: &[&str]) {
    let attention: &[&str] = if flags.contains(&"--attention") { &[] } else { &["--attention", "unfused"] };
    let args = [&["compile", model.to_str().unwrap(), "--seq-len", "16"][..], attention, flags];
    success(autotp(&[&args.concat()[..], &["-o", plan.to_str().unwrap()]].concat()));
}

/// The first stage of the plan at `plan_path`, loaded with its weights on the CPU and on an
/// emulated GPU, with the emulator's counts.
fn on_cpu_and_emulated_gpu(
    plan_path: &std::path::Path,
) -> (Program, Executor, Executor, std::sync::Arc<autotp_runtime::gpu::emulated::Counts>) {
    let file = PlanFile::open(plan_path).unwrap();
    let program = file.plan.stages[0].clone();
    let mut cpu = Executor::new(program.clone()).unwrap();
    let emulator = Emulator::new(&program, GemmMath::F32).unwrap();
    let counts = emulator.counts.clone();
    let mut gpu = Executor::on_gpu(program.clone(), Box::new(emulator), None).unwrap();
    for (name, bytes) in file.weights() {
        cpu.load_slot(&name, bytes).unwrap();
        gpu.load_slot(&name, bytes).unwrap();
    }
    (program, cpu, gpu, counts)
}

#[test]
fn a_plan_on_the_emulated_gpu_trains_like_the_cpu() {
    let dir = scratch("emulated-gpu");
    let plans = [("gpt2", "generated"), ("llama", "generated"), ("gptj", "generated"), ("mixtral", "generated")];
    for (arch, kernels) in plans.into_iter().chain([("gpt2", "builtin")]) {
        let plan_path = dir.join(format!("{arch}-{kernels}.atp"));
        let model = fixture(arch, "model.onnx");
        compile(&model, &plan_path, &["--micro-batch", "4", "--kernels", kernels]);
        let (program, mut cpu, mut gpu, counts) = on_cpu_and_emulated_gpu(&plan_path);
        let downloads_before = counts.downloads.load(Ordering::Relaxed);
        for step in 1..=3 {
            let inputs = feeds(&program, step);
            let expected = cpu.run(&inputs).unwrap();
            let got = gpu.run(&inputs).unwrap();
            assert_eq!(got, expected, "{arch} ({kernels} kernels) step {step}: outputs");
        }
        let matmuls = (program.instructions.iter())
            .filter(|i| matches!(i, Instruction::Kernel { kernel: Kernel::MatMul { .. }, .. }))
            .count();
        assert_eq!(counts.gemms.load(Ordering::Relaxed), 3 * matmuls, "{arch}: every matmul of 3 steps a GEMM call");
        let generated = (program.instructions.iter())
            .filter(|i| matches!(i, Instruction::Generated { .. } | Instruction::OptimizerStep { .. }))
            .count();
        let forms = (program.instructions.iter()).filter_map(|i| match i {
            Instruction::Kernel { gpu, .. } => gpu.as_ref(),
            _ => None,
        });
        let moved: usize = forms.clone().map(|f| if let GpuForm::Movement(runs) = f { runs.len() } else { 0 }).sum();
        assert!(moved >= 3, "{arch}: expand, concat and split run as movement kernels ({moved})");
        let indexed = forms.clone().filter(|f| matches!(f, GpuForm::Indexed(_))).count();
        assert!(indexed >= 2, "{arch}: the embedding's gather and scatter-add run on the GPU ({indexed})");
        let axis = forms.clone().filter(|f| matches!(f, GpuForm::Axis(_))).count();
        let grouped = forms.filter(|f| matches!(f, GpuForm::Grouped(_))).count();
        if arch == "mixtral" {
            assert!(axis >= 4, "{arch}: the routers' top-k and its gradient's scatter run on the GPU ({axis})");
            assert_eq!(grouped, 12, "{arch}: the experts' grouped GEMMs run on the GPU");
        }
        let launches = generated + moved + indexed + axis + grouped;
        assert_eq!(counts.launches.load(Ordering::Relaxed), 3 * launches, "{arch}: launches");
        // With generated kernels nothing inside a step waits for the host: it reads back its
        // outputs, and the gathers' fault words once the streams are done.
        let downloads = counts.downloads.load(Ordering::Relaxed) - downloads_before;
        if kernels == "generated" {
            assert_eq!(downloads, 3 * (program.outputs.len() + 1), "{arch}: downloads in 3 steps");
        }
        for slot in program.params.iter().chain(&program.states) {
            let on_gpu = gpu.read_slot(&slot.name).unwrap().unwrap();
            assert!(
                on_gpu == cpu.read_slot(&slot.name).unwrap().unwrap(),
                "{arch} ({kernels} kernels): {} after 3 steps",
                slot.name
            );
        }
    }
}

/// Every fixture's step stays on a GPU: in bf16 with fused attention, and in f32, no builtin
/// kernel of its plan runs on the host but matmuls, and every matmul has a cuBLAS call.
#[test]
fn every_fixtures_step_stays_on_the_gpu() {
    let dir = scratch("gpu-forms");
    let models = std::fs::read_dir(crate::common::repo().join("tests/fixtures")).unwrap();
    let mut models: Vec<_> = models.map(|e| e.unwrap().path().join("model.onnx")).filter(|m| m.exists()).collect();
    models.sort();
    assert!(models.len() >= 14, "{} fixtures", models.len());
    for model in &models {
        let arch = model.parent().unwrap().file_name().unwrap().to_string_lossy().into_owned();
        for (name, flags) in [("f32", &[][..]), ("bf16", &["--precision", "bf16", "--attention", "fused"][..])] {
            let plan = dir.join(format!("{arch}-{name}.atp"));
            compile(model, &plan, &[&["--micro-batch", "2"][..], flags].concat());
            let plan = PlanFile::open(&plan).unwrap().plan;
            // An f64 model (llama_f64) checks a model's semantics on the CPU; its kernels have
            // no GPU forms, nor mixed precision.
            if plan.params().iter().any(|(_, slot)| slot.dtype == DType::F64) {
                break;
            }
            let program = plan.stages.into_iter().next().unwrap();
            for instruction in &program.instructions {
                let Instruction::Kernel { kernel, gpu: None, label, .. } = instruction else { continue };
                let on_cublas = match kernel {
                    Kernel::MatMul { dtype, dims } => autotp_runtime::gpu::gemm::GemmCall::of(*dtype, dims).is_some(),
                    Kernel::Copy => true,
                    _ => false,
                };
                assert!(on_cublas, "{arch} {name}: {label} runs on the host");
            }
        }
    }
}

/// A token id past the vocabulary stops the step on the GPU as on the CPU, naming the
/// embedding's gather and the index: the GPU's gather reports it through its fault words once
/// the streams are done, and the next step runs clean.
#[test]
fn an_index_out_of_range_on_the_gpu_is_the_cpu_kernels_error() {
    let dir = scratch("emulated-gpu-index");
    let plan_path = dir.join("gpt2.atp");
    compile(&fixture("gpt2", "model.onnx"), &plan_path, &["--micro-batch", "2"]);
    let file = PlanFile::open(&plan_path).unwrap();
    let program = file.plan.stages[0].clone();
    let mut cpu = Executor::new(program.clone()).unwrap();
    let mut gpu =
        Executor::on_gpu(program.clone(), Box::new(Emulator::new(&program, GemmMath::F32).unwrap()), None).unwrap();
    for (name, bytes) in file.weights() {
        cpu.load_slot(&name, bytes).unwrap();
        gpu.load_slot(&name, bytes).unwrap();
    }
    let mut inputs = feeds(&program, 1);
    let ids = program.inputs.iter().position(|slot| slot.name == "input_ids").unwrap();
    inputs[ids].data[8..16].copy_from_slice(&5000i64.to_le_bytes());
    let on_cpu = cpu.run(&inputs).unwrap_err().to_string();
    let on_gpu = gpu.run(&inputs).unwrap_err().to_string();
    assert!(on_cpu.contains("gather: index 5000 is out of range for a dimension of size 1000"), "{on_cpu}");
    assert_eq!(on_gpu, on_cpu);
    let clean = feeds(&program, 2);
    assert!(gpu.run(&clean).is_ok(), "the fault words are cleared once reported");
}

/// `run --device cuda` end to end on the emulated GPU (`AUTOTP_GPU=emulated`): the same losses
/// as the CPU, and checkpoints that move between the devices, resumed bit-identically.
#[test]
fn runs_on_the_emulated_gpu_and_checkpoints_move_between_devices() {
    let dir = scratch("emulated-gpu-run");
    let model = fixture("llama", "model.onnx");
    let plan = dir.join("llama.atp");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    compile(&model, &plan, &["--micro-batch", "4"]);
    let run = |device: &str, steps: &str, metrics: &str, save: Option<&str>, resume: Option<&str>| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
        command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", steps]);
        command.args(["--device", device, "--metrics-out", dir.join(metrics).to_str().unwrap()]);
        if let Some(save) = save {
            command.args(["--save", dir.join(save).to_str().unwrap()]);
        }
        if let Some(resume) = resume {
            command.args(["--resume", dir.join(resume).to_str().unwrap()]);
        }
        success(command.env("AUTOTP_GPU", "emulated").output().unwrap());
        crate::common::losses(&dir.join(metrics))
    };
    let cpu = run("cpu", "8", "cpu.jsonl", None, None);
    assert_eq!(run("cuda", "8", "gpu.jsonl", None, None), cpu, "8 steps on the emulated GPU");
    run("cuda", "4", "gpu-first.jsonl", Some("from-gpu"), None);
    assert_eq!(
        run("cpu", "8", "cpu-rest.jsonl", None, Some("from-gpu")),
        cpu[4..],
        "GPU checkpoint resumed on the CPU"
    );
    run("cpu", "4", "cpu-first.jsonl", Some("from-cpu"), None);
    assert_eq!(
        run("cuda", "8", "gpu-rest.jsonl", None, Some("from-cpu")),
        cpu[4..],
        "CPU checkpoint resumed on the GPU"
    );
}

/// `--tf32` reaches the GEMMs: the emulated GPU rounds their operands as the tensor cores do,
/// so the losses move off the CPU's (f32) but stay within 1e-2; on the CPU the flag is refused.
#[test]
fn tf32_rounds_the_gemm_operands_and_is_refused_on_the_cpu() {
    let dir = scratch("emulated-gpu-tf32");
    let plan = dir.join("gpt2.atp");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    compile(&fixture("gpt2", "model.onnx"), &plan, &["--micro-batch", "4"]);
    let run = |extra: &[&str], metrics: &str| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
        command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "5"]);
        command.args(["--metrics-out", dir.join(metrics).to_str().unwrap()]).args(extra);
        command.env("AUTOTP_GPU", "emulated").output().unwrap()
    };
    success(run(&["--device", "cpu"], "cpu.jsonl"));
    success(run(&["--device", "cuda", "--tf32"], "tf32.jsonl"));
    let (cpu, tf32) = (crate::common::losses(&dir.join("cpu.jsonl")), crate::common::losses(&dir.join("tf32.jsonl")));
    assert_ne!(cpu, tf32, "TF32 GEMMs round their operands");
    for ((step, a), (_, b)) in cpu.iter().zip(&tf32) {
        assert!(((a - b) / a).abs() < 1e-2, "step {step}: f32 {a}, tf32 {b}");
    }
    let refused = run(&["--device", "cpu", "--tf32"], "refused.jsonl");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--tf32 needs --device cuda"));
}

/// bf16 and fp16 plans (16-bit kernels, 16-bit GEMMs, fp16's loss scale) on the emulated GPU
/// train as on the CPU, bit for bit.
#[test]
fn mixed_precision_plans_on_the_emulated_gpu_train_like_the_cpu() {
    let dir = scratch("emulated-gpu-mixed");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    for precision in ["bf16", "fp16"] {
        let plan = dir.join(format!("{precision}.atp"));
        compile(&fixture("gpt2", "model.onnx"), &plan, &["--micro-batch", "4", "--precision", precision]);
        let run = |device: &str| {
            let metrics = dir.join(format!("{precision}-{device}.jsonl"));
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
            command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "5"]);
            command.args(["--device", device, "--metrics-out", metrics.to_str().unwrap()]);
            success(command.env("AUTOTP_GPU", "emulated").output().unwrap());
            crate::common::losses(&metrics)
        };
        assert_eq!(run("cuda"), run("cpu"), "{precision} on the emulated GPU");
    }
}

/// Plans on a mesh or in pipeline stages on emulated GPUs (one per rank): the CPU ranks' losses,
/// bit for bit, as threads of one process, whose collectives and pipeline messages run on the
/// emulated NCCL (its sums in the CPU's rank order; strided blocks through 2-D copies; each
/// stage-to-stage direction a communicator of its own), and as MPI processes, which the emulated
/// NCCL cannot join, through host memory. `run` says which, its measured communication is the
/// planned, and it measures the stages' idle shares on NCCL's path too.
#[test]
fn parallel_plans_on_emulated_gpus_train_like_cpu_ranks() {
    let dir = scratch("emulated-gpu-mesh");
    let model = fixture("gpt2", "model.onnx");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    let layouts: [&[&str]; 5] = [
        &["--dp", "2", "--zero", "3"],
        &["--tp", "2"],
        &["--pp", "2", "--grad-accum", "2"],
        &["--tp", "2", "--dp", "2", "--zero", "3"],
        &["--pp", "2", "--dp", "2", "--zero", "1", "--grad-accum", "4", "--grad-clip", "0.5"],
    ];
    for (l, layout) in layouts.iter().enumerate() {
        let plan = dir.join(format!("layout-{l}.atp"));
        compile(&model, &plan, &[&["--micro-batch", "4"][..], layout].concat());
        let run = |device: &str, processes: Option<&str>| {
            let metrics = dir.join(format!("layout-{l}-{device}-{}.jsonl", processes.unwrap_or("threads")));
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
            command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "6"]);
            command.args(["--device", device, "--metrics-out", metrics.to_str().unwrap()]);
            if let Some(n) = processes {
                command.args(["--launch", n]);
            }
            let out = command.env("AUTOTP_GPU", "emulated").output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            success(out);
            (crate::common::losses(&metrics), stderr)
        };
        let (cpu, _) = run("cpu", None);
        let (threads, said) = run("cuda", None);
        assert_eq!(threads, cpu, "{layout:?}: ranks as threads on emulated GPUs");
        let mesh_axes = layout.iter().filter(|f| ["--dp", "--tp"].contains(f)).count();
        // A pipeline of two stages: the first rank's links to the second stage and back.
        let links = 2 * usize::from(layout.contains(&"--pp"));
        assert_eq!(said.matches(" over NCCL").count(), mesh_axes + links, "{layout:?}:\n{said}");
        if links > 0 {
            assert!(said.contains("pipeline stage 0 to 1 over NCCL; pipeline stage 1 to 0 over NCCL"), "{said}");
            assert!(said.contains("bubble      (stage "), "{said}");
        }
        // Planned and measured bytes per step agree (the last two columns of each rank's row).
        let rows: Vec<Vec<&str>> = (said.lines())
            .skip_while(|l| !l.contains("planned comm/step"))
            .skip(1)
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .take_while(|f| f.len() == 5)
            .collect();
        assert!(!rows.is_empty() && rows.iter().all(|f| f[3] == f[4]), "{layout:?}:\n{said}");
        if l == 1 || l == 2 {
            let (processes, said) = run("cuda", Some("2"));
            assert_eq!(processes, cpu, "{layout:?}: ranks as MPI processes on emulated GPUs");
            let path = if l == 1 { "tp" } else { "pipeline stage 0 to 1" };
            let why = "through host memory (the emulated NCCL joins threads of one process only)";
            assert!(said.contains(&format!("{path} {why}")), "{said}");
        }
    }
}

/// A rank's fault on its device in a data-parallel job over the emulated NCCL ends the run
/// cleanly: a token past the vocabulary in the second rank's half of step 2 is reported with
/// the index named, within seconds.
#[test]
fn a_device_fault_ends_a_job_over_nccl() {
    let dir = scratch("emulated-gpu-abort");
    let plan = dir.join("dp2.atp");
    compile(&fixture("gpt2", "model.onnx"), &plan, &["--micro-batch", "4", "--dp", "2", "--zero", "2"]);
    let mut tokens = std::fs::read(crate::common::repo().join("tests/fixtures/train/tokens.bin")).unwrap();
    // Step 2 reads windows 8..16 of 16 tokens; the second rank's half starts at window 12.
    let at = 13 * 16 + 5;
    tokens[2 * at..2 * at + 2].copy_from_slice(&5000u16.to_le_bytes());
    let data = dir.join("tokens.bin");
    std::fs::write(&data, tokens).unwrap();
    let started = std::time::Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(["run", plan.to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "3", "--device", "cuda"])
        .env("AUTOTP_GPU", "emulated")
        .output()
        .unwrap();
    let stderr = crate::common::failure(out);
    assert!(stderr.contains("index 5000 is out of range"), "{stderr}");
    assert!(started.elapsed() < std::time::Duration::from_secs(60), "took {:?}", started.elapsed());
}

/// What a rank on the (emulated) GPU holds is what the plan reports, within 2%: the device's
/// count of its free memory before and after the program loads, against the planned peak.
#[test]
fn device_memory_is_the_planned_memory() {
    let dir = scratch("emulated-gpu-memory");
    let model = fixture("gpt2", "model.onnx");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    for (l, layout) in [&[][..], &["--tp", "2"][..], &["--dp", "2", "--zero", "3"][..]].iter().enumerate() {
        let plan = dir.join(format!("memory-{l}.atp"));
        compile(&model, &plan, &[&["--micro-batch", "4"][..], layout].concat());
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
            .args([
                "run",
                plan.to_str().unwrap(),
                "--data",
                tokens.to_str().unwrap(),
                "--steps",
                "1",
                "--device",
                "cuda",
            ])
            .env("AUTOTP_GPU", "emulated")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let rows: Vec<(f64, f64)> = (stderr.lines())
            .skip_while(|l| !l.contains("planned peak"))
            .skip(1)
            .map_while(|l| {
                let fields: Vec<f64> = l.split_whitespace().filter_map(|f| f.parse().ok()).collect();
                (fields.len() == 5).then(|| (fields[1], fields[2]))
            })
            .collect();
        assert_eq!(rows.len(), if l == 0 { 1 } else { 2 }, "{layout:?}: a row per rank\n{stderr}");
        for (planned, measured) in rows {
            assert!(
                measured >= planned && measured <= planned * 1.02,
                "{layout:?}: planned {planned}, held {measured}"
            );
        }
    }
}

/// `bench-comm --device cuda` checks every collective on NCCL, here 3 ranks on emulated GPUs
/// over the emulated NCCL (and one rank, as on a one-GPU machine), and times them.
#[test]
fn bench_comm_checks_nccl_collectives_on_emulated_gpus() {
    for ranks in ["3", "1"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
            .args(["bench-comm", "--device", "cuda", "--ranks", ranks, "--sizes", "3", "--iters", "2"])
            .env("AUTOTP_GPU", "emulated")
            .output()
            .unwrap();
        let out = success(out);
        for row in ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ring_shift"] {
            assert!(out.lines().any(|l| l.starts_with(row) && l.contains(" nccl ")), "{ranks} ranks, {row}: {out}");
        }
    }
}

/// `--offload-optimizer cpu` on emulated GPUs (ZeRO-Offload): the GPU computes the gradients
/// and the host updates the offloaded states with the CPU's kernel, so the losses are the CPU
/// ranks' bit for bit: f32 (states offloaded, parameters on the GPU), bf16 (f32 masters
/// offloaded, their bf16 copies uploaded, the step guarded against non-finite gradients), and
/// dp 2 with ZeRO-2 over the emulated NCCL; and with ZeRO-3's parameter shards in host memory
/// too (`--offload-param cpu`: each uploaded before NCCL gathers it, updated in the pool, a
/// bf16 model's copies cast there). A checkpoint written on the GPU resumes on the CPU.
#[test]
fn an_offloaded_optimizer_on_the_emulated_gpu_trains_like_the_cpu() {
    let dir = scratch("emulated-gpu-offload");
    let model = fixture("gpt2", "model.onnx");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    let zero3_params = ["--dp", "2", "--zero", "3", "--offload-param", "cpu"];
    let layouts: [&[&str]; 5] = [
        &[],
        &["--precision", "bf16"],
        &["--dp", "2", "--zero", "2"],
        &zero3_params,
        &[&zero3_params[..], &["--precision", "bf16"]].concat(),
    ];
    for (l, layout) in layouts.iter().enumerate() {
        let plan = dir.join(format!("offload-{l}.atp"));
        compile(&model, &plan, &[&["--micro-batch", "4", "--offload-optimizer", "cpu"][..], layout].concat());
        let run = |device: &str, steps: &str, name: &str, extra: &[&str]| {
            let metrics = dir.join(format!("offload-{l}-{name}.jsonl"));
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
            command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", steps]);
            command.args(["--device", device, "--metrics-out", metrics.to_str().unwrap()]).args(extra);
            success(command.env("AUTOTP_GPU", "emulated").output().unwrap());
            crate::common::losses(&metrics)
        };
        let cpu = run("cpu", "6", "cpu", &[]);
        assert_eq!(run("cuda", "6", "cuda", &[]), cpu, "{layout:?}: offloaded on the emulated GPU");
        let save = dir.join(format!("offload-{l}-save"));
        run("cuda", "3", "first", &["--save", save.to_str().unwrap()]);
        let resumed = run("cpu", "6", "resumed", &["--resume", save.to_str().unwrap()]);
        assert_eq!(resumed, cpu[3..], "{layout:?}: resumed on the CPU from the GPU's checkpoint");
    }
}

/// `--cuda-graph` on the emulated GPU, which enforces CUDA's capture rules: the first step runs
/// as usual, the second is captured and replayed, and every later step is the replay alone (the
/// host issues no launch); the outputs and weights are the CPU's bit for bit. Over the emulated
/// NCCL too (dp 2 ZeRO-3, tp 2: collectives on the collectives stream, joined back into the
/// capture), and in bf16; refused for a plan whose step needs the host, naming the instruction.
#[test]
fn steps_replay_as_a_cuda_graph_on_the_emulated_gpu() {
    let dir = scratch("emulated-gpu-graph");
    for arch in ["gpt2", "llama", "mixtral"] {
        let plan_path = dir.join(format!("{arch}.atp"));
        compile(&fixture(arch, "model.onnx"), &plan_path, &["--micro-batch", "4"]);
        let (program, mut cpu, mut gpu, counts) = on_cpu_and_emulated_gpu(&plan_path);
        gpu.use_cuda_graph().unwrap();
        let mut issued = Vec::new();
        for step in 1..=4 {
            let inputs = feeds(&program, step);
            assert_eq!(gpu.run(&inputs).unwrap(), cpu.run(&inputs).unwrap(), "{arch} step {step}");
            issued.push(counts.launches.load(Ordering::Relaxed) + counts.gemms.load(Ordering::Relaxed));
        }
        assert!(
            issued[0] > 0 && issued[1] == 2 * issued[0],
            "{arch}: the first two steps issue everything: {issued:?}"
        );
        assert_eq!(issued[3], issued[1], "{arch}: replays issue nothing: {issued:?}");
        for slot in program.params.iter().chain(&program.states) {
            let on_gpu = gpu.read_slot(&slot.name).unwrap().unwrap();
            assert!(on_gpu == cpu.read_slot(&slot.name).unwrap().unwrap(), "{arch}: {} after 4 steps", slot.name);
        }
    }

    let model = fixture("gpt2", "model.onnx");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    let run = |plan: &std::path::Path, device: &str, extra: &[&str]| {
        let metrics =
            dir.join(format!("{}-{device}-{}.jsonl", plan.file_stem().unwrap().to_string_lossy(), extra.len()));
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
        command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "5"]);
        command.args(["--device", device, "--metrics-out", metrics.to_str().unwrap()]).args(extra);
        let out = command.env("AUTOTP_GPU", "emulated").output().unwrap();
        (
            out.status.success().then(|| crate::common::losses(&metrics)),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let layouts =
        [("dp2", &["--dp", "2", "--zero", "3"][..]), ("tp2", &["--tp", "2"]), ("bf16", &["--precision", "bf16"])];
    for (name, layout) in layouts {
        let plan = dir.join(format!("{name}.atp"));
        compile(&model, &plan, &[&["--micro-batch", "4"][..], layout].concat());
        let (cpu, _) = run(&plan, "cpu", &[]);
        let (graph, stderr) = run(&plan, "cuda", &["--cuda-graph"]);
        assert_eq!(graph, cpu, "{name} with --cuda-graph:\n{stderr}");
    }
    let plan = dir.join("offload.atp");
    compile(&model, &plan, &["--micro-batch", "4", "--offload-optimizer", "cpu"]);
    let (refused, stderr) = run(&plan, "cuda", &["--cuda-graph"]);
    assert!(refused.is_none(), "{stderr}");
    assert!(stderr.contains("--cuda-graph: a step cannot be one CUDA graph: instruction"), "{stderr}");
    assert!(stderr.contains("updates offloaded optimizer state on the host"), "{stderr}");
    let plan = dir.join("pp2.atp");
    compile(&model, &plan, &["--micro-batch", "4", "--pp", "2", "--grad-accum", "2"]);
    let (refused, stderr) = run(&plan, "cuda", &["--cuda-graph"]);
    assert!(refused.is_none(), "{stderr}");
    assert!(stderr.contains("is a pipeline message over NCCL, whose wait is timed"), "{stderr}");
}

/// `--profile` on a GPU times every instruction between timed events on its stream: a fused
/// attention plan reports device time for each of its attention passes and trains as
/// unprofiled; `run --profile` prints the time by op (bf16: the tensor-core passes); with a CUDA
/// graph it is refused either way round, and on the command line.
#[test]
fn a_gpu_profile_times_every_instruction_on_the_device() -> Result<(), Box<dyn std::error::Error>> {
    let dir = scratch("emulated-gpu-profile");
    let plan = dir.join("gpt2.atp");
    compile(&fixture("gpt2", "model.onnx"), &plan, &["--micro-batch", "4", "--attention", "fused"]);
    let (program, mut cpu, mut gpu, _) = on_cpu_and_emulated_gpu(&plan);
    gpu.enable_profile()?;
    for step in 1..=2 {
        let inputs = feeds(&program, step);
        assert_eq!(gpu.run(&inputs)?, cpu.run(&inputs)?, "step {step}");
    }
    let times = gpu.profile().ok_or("a GPU profile")?;
    assert_eq!(times.len(), program.instructions.len());
    let attention: Vec<_> = (program.instructions.iter().zip(times))
        .filter(|(i, _)| matches!(i, Instruction::Kernel { gpu: Some(GpuForm::Attention(_)), .. }))
        .collect();
    assert_eq!(attention.len(), 4, "two layers' forward and backward");
    for (instruction, time) in attention {
        assert!(!time.is_zero(), "{}: no device time", instruction.label());
    }
    let refused = gpu.use_cuda_graph().err().ok_or("a graph after --profile is refused")?;
    assert!(refused.to_string().contains("drop --cuda-graph to profile"), "{refused}");
    let (_, _, mut graph, _) = on_cpu_and_emulated_gpu(&plan);
    graph.use_cuda_graph()?;
    assert!(graph.enable_profile().is_err(), "--profile after a graph is refused");

    let bf16 = dir.join("bf16.atp");
    compile(
        &fixture("gpt2", "model.onnx"),
        &bf16,
        &["--micro-batch", "4", "--precision", "bf16", "--attention", "fused"],
    );
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    let run = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
            .args(["run", bf16.to_str().unwrap_or_default(), "--data", tokens.to_str().unwrap_or_default()])
            .args(["--steps", "2", "--device", "cuda", "--profile"])
            .args(extra)
            .env("AUTOTP_GPU", "emulated")
            .output()
    };
    let out = run(&[])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for op in ["attention", "attention_grad"] {
        let line =
            stdout.lines().find(|l| l.split_whitespace().next() == Some(op)).ok_or(format!("{op}:\n{stdout}"))?;
        let ms: f64 = line.split_whitespace().nth(2).ok_or("ms")?.parse()?;
        assert!(ms > 0.0, "{line}");
    }
    let out = run(&["--cuda-graph"])?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("drop --cuda-graph to profile"));
    Ok(())
}

/// `run --device cuda` warns where fused attention runs a thread per query row over long rows
/// (f32 at 256 keys), and not where its passes take the tensor cores (bf16) or the rows are
/// short.
#[test]
fn long_thread_per_row_attention_on_a_gpu_is_warned_of() {
    let dir = scratch("emulated-gpu-attention-warning");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    let warning = "fused attention runs a GPU thread per query row over";
    for (name, flags, warned) in [
        ("f32-256", &["--seq-len", "256"][..], true),
        ("bf16-256", &["--seq-len", "256", "--precision", "bf16"], false),
        ("f32-32", &["--seq-len", "32"], false),
    ] {
        let (model, plan) = (fixture("llama", "model.onnx"), dir.join(format!("{name}.atp")));
        let compile =
            [&["compile", model.to_str().unwrap(), "--micro-batch", "1", "-o", plan.to_str().unwrap()][..], flags];
        success(autotp(&compile.concat()));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
            .args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "1"])
            .args(["--device", "cuda"])
            .env("AUTOTP_GPU", "emulated")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {stderr}");
        assert_eq!(stderr.contains(warning), warned, "{name}: {stderr}");
    }
}
