//! The GPU device's host side (`autotp_runtime::gpu`) on the emulated GPU, against the CPU
//! executor: the same plan, the same inputs, bit-identical losses and weights. The emulator's
//! streams run nothing until a result is needed, so an upload, launch or copy ordered wrongly
//! by the device shows here as a different number.

use autotp_kernels::DType;
use autotp_runtime::gpu::emulated::Emulator;
use autotp_runtime::gpu::GpuExecutor;
use autotp_runtime::plan::PlanFile;
use autotp_runtime::{Executor, HostTensor, Program};

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

#[test]
fn a_plan_on_the_emulated_gpu_trains_like_the_cpu() {
    let dir = scratch("emulated-gpu");
    for (arch, kernels) in [("gpt2", "generated"), ("llama", "generated"), ("gpt2", "builtin")] {
        let plan_path = dir.join(format!("{arch}-{kernels}.atp"));
        let model = fixture(arch, "model.onnx");
        success(autotp(&[
            "compile",
            model.to_str().unwrap(),
            "--seq-len",
            "16",
            "--micro-batch",
            "4",
            "--kernels",
            kernels,
            "-o",
            plan_path.to_str().unwrap(),
        ]));
        let file = PlanFile::open(&plan_path).unwrap();
        let program = file.plan.stages[0].clone();
        let mut cpu = Executor::new(program.clone()).unwrap();
        let emulator = Emulator::new(&program).unwrap();
        let mut gpu = GpuExecutor::new(program.clone(), emulator).unwrap();
        for (name, bytes) in file.weights() {
            cpu.load_slot(&name, bytes).unwrap();
            gpu.load_slot(&name, bytes).unwrap();
        }
        for step in 1..=3 {
            let inputs = feeds(&program, step);
            let expected = cpu.run(&inputs).unwrap();
            let got = gpu.run(&inputs).unwrap();
            assert_eq!(got, expected, "{arch} ({kernels} kernels) step {step}: outputs");
        }
        for slot in program.params.iter().chain(&program.states) {
            let on_gpu = gpu.read_slot(&slot.name).unwrap();
            assert!(
                on_gpu == cpu.read_slot(&slot.name).unwrap(),
                "{arch} ({kernels} kernels): {} after 3 steps",
                slot.name
            );
        }
    }
}
