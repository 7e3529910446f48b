//! Benchmark: fused memory-bound kernels on tensors larger than the L3 cache, against a plain
//! copy of the same bytes in the same run, on the same threads (`RAYON_NUM_THREADS`, default all
//! cores). Each graph goes through the fusion pass, as `compile` runs it, so that a chain is one
//! kernel (checked). Each kernel's bandwidth counts the bytes it must read and write once (its
//! inputs and outputs); the copy's counts the bytes it reads and writes too (STREAM's
//! convention; 128 MiB copied, one memcpy per thread, past the L3 cache), so a ratio of 1 is a
//! kernel moving its bytes as fast as a copy moves its own. Prints the median over repetitions
//! and the ratio.
//!
//!     cargo bench --bench kernel_bandwidth

use std::time::{Duration, Instant};

use autotp_codegen::{lower_with, KernelChoice, LowerOptions};
use autotp_passes::Pass;
use autotp_program::Instruction;
use autotp_runtime::{Executor, HostTensor};
use rayon::prelude::*;

const REPEATS: usize = 15;

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64()
}

/// Bytes the copy copies.
const COPIED: usize = 128 << 20;

/// The bytes per second a parallel copy of [`COPIED`] bytes reads and writes (twice as many as
/// it copies), its median over repetitions.
fn copy_rate() -> f64 {
    let bytes = COPIED;
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(rayon::current_num_threads());
    let times = (0..REPEATS)
        .map(|_| {
            let start = Instant::now();
            dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
            start.elapsed()
        })
        .collect();
    std::hint::black_box(&dst);
    2.0 * bytes as f64 / median(times)
}

/// The median time of one run of `text`'s graph lowered with generated kernels, and the bytes
/// its inputs and outputs hold.
fn kernel_seconds(text: &str) -> (f64, usize) {
    let mut graph = autotp_ir::text::parse(text).expect("a valid graph");
    autotp_passes::fusion::Fusion::default().run(&mut graph).expect("fusion");
    let program = lower_with(&graph, &LowerOptions { kernels: KernelChoice::Generated, ..Default::default() }).unwrap();
    let generated = program.instructions.iter().filter(|i| matches!(i, Instruction::Generated { .. })).count();
    assert!(generated == program.instructions.len() && program.kernels.len() <= 2, "{text}");
    let inputs: Vec<HostTensor> = program
        .inputs
        .iter()
        .map(|s| HostTensor { dtype: s.dtype, shape: s.shape.clone(), data: vec![0u8; s.region.len] })
        .collect();
    let bytes = program.inputs.iter().chain(&program.outputs).map(|s| s.region.len).sum();
    let mut executor = Executor::new(program).unwrap();
    executor.run(&inputs).unwrap();
    // The instructions' own time (the executor's profile), not the feeding of inputs and the
    // copying out of outputs around them.
    let mut before = Duration::ZERO;
    executor.enable_profile().unwrap();
    let times = (0..REPEATS)
        .map(|_| {
            executor.run(&inputs).unwrap();
            let total: Duration = executor.profile().expect("profiling").iter().sum();
            let run = total - before;
            before = total;
            run
        })
        .collect();
    (median(times), bytes)
}

fn main() {
    // 4096 x 4096 f32 = 64 MiB per tensor, past this machine's L3.
    let cases = [
        (
            "elementwise chain (x * 0.5 + y, gelu)",
            "graph \"chain\" {\n  input %x : f32[4096,4096]\n  input %y : f32[4096,4096]\n  \
             %0 = constant splat<0.5> : f32[]\n  %1 = mul %x, %0 : f32[4096,4096]\n  \
             %2 = add %1, %y : f32[4096,4096]\n  %3 = gelu %2 {approx = tanh} : f32[4096,4096]\n  output \"z\" = %3\n}\n",
        ),
        (
            "softmax rows of 4096",
            "graph \"softmax\" {\n  input %x : f32[4096,4096]\n  %0 = softmax %x {axis = 1} : f32[4096,4096]\n  output \"y\" = %0\n}\n",
        ),
        (
            "layer_norm rows of 4096",
            "graph \"ln\" {\n  input %x : f32[4096,4096]\n  input %w : f32[4096]\n  input %b : f32[4096]\n  \
             %0 = layer_norm %x, %w, %b {axis = 1, eps = 1e-5} : f32[4096,4096]\n  output \"y\" = %0\n}\n",
        ),
        (
            "cross-entropy, 320 rows x 50257 classes",
            "graph \"ce\" {\n  input %x : f32[320,50257]\n  input %labels : i64[320]\n  \
             %0 = cross_entropy %x, %labels {ignore_index = none, reduction = mean} : f32[]\n  output \"loss\" = %0\n}\n",
        ),
    ];
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model =
        cpu.lines().find_map(|l| l.strip_prefix("model name")).map_or("", |m| m.trim_start_matches([' ', '\t', ':']));
    let isa = autotp_kernels::isa::IsaLevel::active();
    println!(
        "{model}, {} ({} f32 lanes), {} threads, median of {REPEATS} runs",
        isa.name(),
        isa.f32_lanes(),
        rayon::current_num_threads()
    );
    println!("{:<42} {:>10} {:>10} {:>10} {:>7}", "kernel", "MiB", "GB/s", "copy GB/s", "ratio");
    for (name, text) in cases {
        let (seconds, bytes) = kernel_seconds(text);
        let (rate, copy_rate) = (bytes as f64 / seconds / 1e9, copy_rate() / 1e9);
        println!(
            "{name:<42} {:>10.0} {rate:>10.1} {copy_rate:>10.1} {:>7.2}",
            bytes as f64 / (1 << 20) as f64,
            rate / copy_rate
        );
    }
}
