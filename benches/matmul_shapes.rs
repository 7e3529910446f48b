//! Benchmark, autotp's side: every matmul a training plan's step calls, as the step calls it
//! (transposed operands, batched attention products, weight gradients), timed with the
//! kernel the executor runs, on the same threads (`RAYON_NUM_THREADS`, default all cores).
//! Prints one JSON line per distinct shape: its dims, how many times a step calls it, and the
//! median seconds of one call. `benches/matmul_shapes.sh` times the same shapes with PyTorch
//! and prints the table.
//!
//!     cargo bench --bench matmul_shapes -- MODEL_NAME PLAN.atp [MODEL_NAME PLAN.atp ...]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use autotp_kernels::{AlignedBuf, DType, Kernel, MatMulDims};
use autotp_program::plan::PlanFile;
use autotp_program::Instruction;

/// Repetitions of each shape (the median is reported), after one warm-up call.
const REPEATS: usize = 21;

fn seconds(dims: &MatMulDims) -> f64 {
    let numel = |batch: &[usize], rows: usize, cols: usize| batch.iter().product::<usize>() * rows * cols;
    let random = |len: usize, seed: u32| {
        let mut buf = AlignedBuf::zeroed(len * 4);
        for (i, chunk) in buf.as_mut_slice().chunks_mut(4).enumerate() {
            let x = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 9) as f32 / (1 << 23) as f32 - 0.5;
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        buf
    };
    let lhs = random(numel(&dims.lhs_batch, dims.m, dims.k), 1);
    let rhs = random(numel(&dims.rhs_batch, dims.k, dims.n), 2);
    let mut out = AlignedBuf::zeroed(numel(&dims.batch, dims.m, dims.n) * 4);
    let kernel = Kernel::MatMul { dtype: DType::F32, dims: dims.clone() };
    let mut call = || {
        let start = Instant::now();
        kernel.run(&[lhs.as_slice(), rhs.as_slice()], &mut [out.as_mut_slice()]).expect("a planned matmul runs");
        start.elapsed()
    };
    call();
    let mut times: Vec<Duration> = (0..REPEATS).map(|_| call()).collect();
    times.sort();
    times[REPEATS / 2].as_secs_f64()
}

fn list(v: &[usize]) -> String {
    format!("[{}]", v.iter().map(usize::to_string).collect::<Vec<_>>().join(","))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    for pair in args.chunks(2) {
        let [model, path] = pair else { panic!("arguments: MODEL_NAME PLAN.atp pairs") };
        let plan = PlanFile::open(std::path::Path::new(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        // Each distinct shape of the step, and how many times the step calls it.
        let mut calls: BTreeMap<String, (MatMulDims, usize)> = BTreeMap::new();
        for program in &plan.plan.stages {
            for instruction in &program.instructions {
                if let Instruction::Kernel { kernel: Kernel::MatMul { dtype: DType::F32, dims }, .. } = instruction {
                    calls.entry(format!("{dims:?}")).or_insert((dims.clone(), 0)).1 += 1;
                }
            }
        }
        for (dims, count) in calls.values() {
            println!(
                "{{\"model\":\"{model}\",\"batch\":{},\"lhs_batch\":{},\"rhs_batch\":{},\"m\":{},\"k\":{},\"n\":{},\
                 \"transpose_lhs\":{},\"transpose_rhs\":{},\"count\":{count},\"seconds\":{:e}}}",
                list(&dims.batch),
                list(&dims.lhs_batch),
                list(&dims.rhs_batch),
                dims.m,
                dims.k,
                dims.n,
                dims.transpose_lhs,
                dims.transpose_rhs,
                seconds(dims)
            );
        }
    }
}
