//! Benchmark: the optimizer step an offloaded optimizer runs on the CPU (`--offload-optimizer
//! cpu`): AdamW over f32 parameters, moments and gradients as one multi-tensor generated kernel
//! (SIMD, on the rayon pool), the step `fusion` makes of a training step's updates. Prints one
//! JSON line per size: the median time of the step instruction alone (the executor's profile)
//! over repetitions; `benches/adamw_step.sh` sets PyTorch's `AdamW(fused=True)` beside it.
//!
//!     cargo bench --bench adamw_step -- [TENSORS ELEMENTS]   (default 16 x 1,048,576 = 16.8M)

use std::time::Duration;

use autotp_codegen::{lower_with, KernelChoice, LowerOptions};
use autotp_passes::Pass;
use autotp_runtime::{Executor, HostTensor, Instruction};

const REPEATS: usize = 21;

/// A step of AdamW over `tensors` parameters of `elements` f32 each, its gradients as inputs.
fn step_graph(tensors: usize, elements: usize) -> String {
    let mut text = String::from("graph \"adamw\" {\n  input %lr : f32[]\n  input %step : f32[]\n");
    for t in 0..tensors {
        text += &format!("  input %g{t} : f32[{elements}]\n");
    }
    for t in 0..tensors {
        text += &format!("  param %p{t} : f32[{elements}]\n");
    }
    for t in 0..tensors {
        text += &format!("  state %m{t} : f32[{elements}]\n  state %v{t} : f32[{elements}]\n");
    }
    for t in 0..tensors {
        text += &format!(
            "  %{a}, %{b}, %{c} = adamw %p{t}, %g{t}, %m{t}, %v{t}, %lr, %step {{beta1 = 0.9, beta2 = 0.999, \
             eps = 1e-8, weight_decay = 0.01}} : f32[{elements}], f32[{elements}], f32[{elements}]\n",
            a = 3 * t,
            b = 3 * t + 1,
            c = 3 * t + 2
        );
    }
    for t in 0..tensors {
        text +=
            &format!("  update %p{t} = %{}\n  update %m{t} = %{}\n  update %v{t} = %{}\n", 3 * t, 3 * t + 1, 3 * t + 2);
    }
    text + "}\n"
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (tensors, elements) = match args[..] {
        [t, e] => (t, e),
        _ => (16, 1 << 20),
    };
    let mut graph = autotp_ir::text::parse(&step_graph(tensors, elements)).expect("a valid graph");
    autotp_passes::fusion::Fusion::default().run(&mut graph).expect("fusion");
    let program = lower_with(&graph, &LowerOptions { kernels: KernelChoice::Generated, ..Default::default() }).unwrap();
    assert!(
        program.instructions.iter().filter(|i| matches!(i, Instruction::OptimizerStep { .. })).count() == 1,
        "one multi-tensor step"
    );
    let inputs: Vec<HostTensor> = program
        .inputs
        .iter()
        .map(|s| {
            let value: f32 = if s.name == "lr" {
                1e-3
            } else if s.name == "step" {
                1.0
            } else {
                1e-2
            };
            let data = std::iter::repeat_n(value.to_le_bytes(), s.numel()).flatten().collect();
            HostTensor { dtype: s.dtype, shape: s.shape.clone(), data }
        })
        .collect();
    let mut executor = Executor::new(program).unwrap();
    executor.run(&inputs).unwrap();
    executor.enable_profile();
    let mut before = Duration::ZERO;
    let mut times: Vec<f64> = (0..REPEATS)
        .map(|_| {
            executor.run(&inputs).unwrap();
            let total: Duration = executor.profile().expect("profiling").iter().sum();
            let run = total - before;
            before = total;
            run.as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    println!(
        "{{\"impl\": \"autotp\", \"tensors\": {tensors}, \"elements\": {elements}, \"threads\": {}, \"seconds\": {}}}",
        rayon::current_num_threads(),
        times[REPEATS / 2]
    );
}
