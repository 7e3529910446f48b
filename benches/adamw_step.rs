//! Benchmark: the optimizer step an offloaded optimizer runs on the CPU (`--offload-optimizer
//! cpu`): AdamW over f32 parameters, moments and gradients as one multi-tensor generated kernel
//! (SIMD, on the rayon pool), the step `fusion` makes of a training step's updates. Prints one
//! JSON line per size: the median time of the step instruction alone (the executor's profile)
//! over repetitions; `benches/adamw_step.sh` sets PyTorch's `AdamW(fused=True)` beside it.
//!
//!     cargo bench --bench adamw_step -- [TENSORS ELEMENTS | sizes=N,N,...] [cpu | nvme=DIR,TILE,BUFFERS]
//!
//! (default 16 x 1,048,576 = 16.8M parameters, states in the arena; `sizes=` lists each
//! parameter's elements, a real model's layout). `cpu` puts the moments in
//! the host pool (`--offload-optimizer cpu`); `nvme=DIR,TILE,BUFFERS` in a file under DIR,
//! streamed in tiles of TILE elements through BUFFERS buffers (`--offload-optimizer nvme`):
//! with one buffer nothing overlaps the update, with more the reads and writes of other tiles
//! do.

use std::time::Duration;

use autotp_codegen::{lower_with, KernelChoice, LowerOptions};
use autotp_passes::Pass;
use autotp_program::Instruction;
use autotp_runtime::{Executor, HostTensor};

const REPEATS: usize = 21;

/// A step of AdamW over parameters of `sizes` f32 elements. The gradients are parameters too,
/// held in the arena from run to run as PyTorch's `.grad` tensors are: as inputs, each run
/// would first copy them in, through the caches the step's data could still be in.
fn step_graph(sizes: &[usize]) -> String {
    let mut text = String::from("graph \"adamw\" {\n  input %lr : f32[]\n  input %step : f32[]\n");
    for (t, n) in sizes.iter().enumerate() {
        text += &format!("  param %g{t} : f32[{n}]\n");
    }
    for (t, n) in sizes.iter().enumerate() {
        text += &format!("  param %p{t} : f32[{n}]\n");
    }
    for (t, n) in sizes.iter().enumerate() {
        text += &format!("  state %m{t} : f32[{n}]\n  state %v{t} : f32[{n}]\n");
    }
    for (t, n) in sizes.iter().enumerate() {
        text += &format!(
            "  %{a}, %{b}, %{c} = adamw %p{t}, %g{t}, %m{t}, %v{t}, %lr, %step {{beta1 = 0.9, beta2 = 0.999, \
             eps = 1e-8, weight_decay = 0.01}} : f32[{n}], f32[{n}], f32[{n}]\n",
            a = 3 * t,
            b = 3 * t + 1,
            c = 3 * t + 2
        );
    }
    for t in 0..sizes.len() {
        text +=
            &format!("  update %p{t} = %{}\n  update %m{t} = %{}\n  update %v{t} = %{}\n", 3 * t, 3 * t + 1, 3 * t + 2);
    }
    text + "}\n"
}

/// `nvme=DIR,TILE,BUFFERS`.
fn nvme_offload(arg: &str) -> Option<autotp_program::offload::NvmeOffload> {
    let [dir, tile, buffers] = arg.strip_prefix("nvme=")?.split(',').collect::<Vec<_>>()[..] else {
        panic!("{arg}: expected nvme=DIR,TILE,BUFFERS")
    };
    Some(autotp_program::offload::NvmeOffload {
        path: dir.into(),
        tile_elements: tile.parse().expect("TILE elements"),
        buffer_count: buffers.parse().expect("BUFFERS"),
    })
}

fn main() {
    let words: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<usize> = words.iter().filter_map(|a| a.parse().ok()).collect();
    let listed = words.iter().find_map(|w| w.strip_prefix("sizes="));
    let sizes: Vec<usize> = match (listed, &args[..]) {
        (Some(list), _) => list.split(',').map(|n| n.parse().expect("sizes=N,N,...: element counts")).collect(),
        (None, &[tensors, elements]) => vec![elements; tensors],
        _ => vec![1 << 20; 16],
    };
    let nvme = words.iter().find_map(|w| nvme_offload(w));
    let offload = nvme.is_some() || words.iter().any(|w| w == "cpu");
    let mut graph = autotp_ir::text::parse(&step_graph(&sizes)).expect("a valid graph");
    autotp_passes::fusion::Fusion::default().run(&mut graph).expect("fusion");
    let options = LowerOptions { kernels: KernelChoice::Generated, offload_optimizer: offload, ..Default::default() };
    let program = lower_with(&graph, &options).unwrap();
    assert!(
        program.instructions.iter().filter(|i| matches!(i, Instruction::OptimizerStep { .. })).count() == 1,
        "one multi-tensor step"
    );
    let inputs: Vec<HostTensor> = program
        .inputs
        .iter()
        .map(|s| {
            let value: f32 = if s.name == "lr" { 1e-3 } else { 1.0 };
            let data = std::iter::repeat_n(value.to_le_bytes(), s.numel()).flatten().collect();
            HostTensor { dtype: s.dtype, shape: s.shape.clone(), data }
        })
        .collect();
    // As benches/adamw_step.py's tensors: parameters 0.5, gradients 1e-2, moments zero.
    let filled: Vec<(String, f32, usize)> = program
        .params
        .iter()
        .map(|s| (s.name.clone(), if s.name.starts_with('g') { 1e-2 } else { 0.5 }, s.numel()))
        .collect();
    let mut executor = Executor::new(program).unwrap();
    for (name, value, numel) in filled {
        let bytes: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), numel).flatten().collect();
        executor.load_slot(&name, &bytes).unwrap();
    }
    if let Some(nvme) = &nvme {
        executor.offload_to_nvme(nvme, 0).unwrap();
    }
    executor.run(&inputs).unwrap();
    executor.enable_profile().unwrap();
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
    let states = match &nvme {
        Some(nvme) => format!("nvme tiles {} buffers {}", nvme.tile_elements, nvme.buffer_count),
        None if offload => "cpu".to_string(),
        None => "arena".to_string(),
    };
    println!(
        "{{\"impl\": \"autotp\", \"states\": \"{states}\", \"tensors\": {}, \"parameters\": {}, \
         \"threads\": {}, \"seconds\": {}}}",
        sizes.len(),
        sizes.iter().sum::<usize>(),
        rayon::current_num_threads(),
        times[REPEATS / 2]
    );
}
