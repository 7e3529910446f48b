//! Benchmark: bf16 matrix products on the CPU's bf16 instructions (`matmul_bf16`, AVX512-BF16)
//! against the portable path (widen both operands to f32, the f32 GEMM, round the result) and
//! against the f32 GEMM alone, in the same run, on the shapes of a GPT-2 small step (4096
//! tokens, hidden 768: the projections, their weight gradients, attention's batched products).
//! Prints a Markdown table of median milliseconds per call, or with `json` one JSON line per
//! shape, which `benches/matmul_bf16.sh` sets PyTorch's bf16 `torch.matmul` beside.
//!
//!     cargo bench --bench matmul_bf16 [-- small]   (small: the fixture models' shapes;
//!                                                 threads: RAYON_NUM_THREADS, default all cores)

use std::time::{Duration, Instant};

use autotp_kernels::{AlignedBuf, DType, Kernel, MatMulDims};

const REPEATS: usize = 11;

fn dims(batch: usize, m: usize, k: usize, n: usize, transpose_lhs: bool, transpose_rhs: bool) -> MatMulDims {
    MatMulDims {
        batch: vec![batch],
        lhs_batch: vec![batch],
        rhs_batch: vec![if transpose_lhs { batch } else { 1 }],
        m,
        k,
        n,
        transpose_lhs,
        transpose_rhs,
        lhs_layout: None,
        rhs_layout: None,
    }
}

/// `len` elements of `dtype` in [-0.5, 0.5).
fn random(len: usize, dtype: DType, seed: u32) -> AlignedBuf {
    let values: Vec<f32> = (0..len as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed) >> 9) as f32 / (1 << 23) as f32 - 0.5)
        .collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    if dtype == DType::F32 {
        return AlignedBuf::from_bytes(&bytes);
    }
    let mut out = AlignedBuf::zeroed(len * 2);
    let cast = Kernel::Cast { from: DType::F32, to: dtype };
    cast.run(&[&bytes], &mut [out.as_mut_slice()]).unwrap();
    out
}

fn median(mut call: impl FnMut()) -> f64 {
    call();
    let mut times: Vec<Duration> = (0..REPEATS)
        .map(|_| {
            let start = Instant::now();
            call();
            start.elapsed()
        })
        .collect();
    times.sort();
    times[REPEATS / 2].as_secs_f64() * 1e3
}

fn main() {
    let numel = |batch: &[usize], rows: usize, cols: usize| batch.iter().product::<usize>() * rows * cols;
    let small = std::env::args().any(|a| a == "small");
    let json = std::env::args().any(|a| a == "json");
    let tiny_shapes = [
        ("tiny gpt2 mlp up", dims(1, 256, 64, 256, false, false)),
        ("tiny gpt2 lm head", dims(1, 256, 64, 1000, false, true)),
        ("tiny gpt2 mlp down", dims(1, 256, 256, 64, false, false)),
        ("tiny gpt2 weight gradient", dims(1, 64, 256, 256, true, false)),
        ("gpt2-512 mlp up", dims(1, 1024, 512, 2048, false, false)),
        ("gpt2-512 weight gradient", dims(1, 512, 1024, 2048, true, false)),
    ];
    let shapes = [
        ("qkv projection", dims(1, 4096, 768, 2304, false, false)),
        ("mlp up", dims(1, 4096, 768, 3072, false, false)),
        ("mlp down", dims(1, 4096, 3072, 768, false, false)),
        ("mlp down, input gradient", dims(1, 4096, 768, 3072, false, true)),
        ("mlp up, weight gradient", dims(1, 768, 4096, 3072, true, false)),
        ("attention scores (48 heads x batch)", dims(48, 512, 64, 512, false, true)),
    ];
    if !json {
        println!("native bf16 instructions: {}", autotp_kernels::matmul_bf16::native());
        println!("| product | m x k x n | bf16 native ms | bf16 widened to f32 ms | f32 ms | widened / native |");
        println!("|---|---|---|---|---|---|");
    }
    for (name, d) in if small { tiny_shapes.to_vec() } else { shapes.to_vec() } {
        let (a, b, c) = (numel(&d.lhs_batch, d.m, d.k), numel(&d.rhs_batch, d.k, d.n), numel(&d.batch, d.m, d.n));
        let (lhs, rhs) = (random(a, DType::BF16, 1), random(b, DType::BF16, 2));
        let mut out = AlignedBuf::zeroed(c * 2);
        let native = Kernel::MatMul { dtype: DType::BF16, dims: d.clone() };
        let native_ms = median(|| native.run(&[lhs.as_slice(), rhs.as_slice()], &mut [out.as_mut_slice()]).unwrap());
        // The portable path, step by step: what `matmul` runs without the instructions.
        let f32_gemm = Kernel::MatMul { dtype: DType::F32, dims: d.clone() };
        let (widen, narrow) =
            (Kernel::Cast { from: DType::BF16, to: DType::F32 }, Kernel::Cast { from: DType::F32, to: DType::BF16 });
        let (mut wide_lhs, mut wide_rhs, mut wide_out) =
            (AlignedBuf::zeroed(a * 4), AlignedBuf::zeroed(b * 4), AlignedBuf::zeroed(c * 4));
        let widened_ms = median(|| {
            widen.run(&[lhs.as_slice()], &mut [wide_lhs.as_mut_slice()]).unwrap();
            widen.run(&[rhs.as_slice()], &mut [wide_rhs.as_mut_slice()]).unwrap();
            f32_gemm.run(&[wide_lhs.as_slice(), wide_rhs.as_slice()], &mut [wide_out.as_mut_slice()]).unwrap();
            narrow.run(&[wide_out.as_slice()], &mut [out.as_mut_slice()]).unwrap();
        });
        let (lhs32, rhs32) = (random(a, DType::F32, 1), random(b, DType::F32, 2));
        let f32_ms =
            median(|| f32_gemm.run(&[lhs32.as_slice(), rhs32.as_slice()], &mut [wide_out.as_mut_slice()]).unwrap());
        if json {
            println!(
                "{{\"name\": \"{name}\", \"batch\": {}, \"m\": {}, \"k\": {}, \"n\": {}, \"transpose_lhs\": {}, \
                 \"transpose_rhs\": {}, \"rhs_batched\": {}, \"native_ms\": {native_ms}, \"widened_ms\": {widened_ms}, \
                 \"f32_ms\": {f32_ms}, \"native\": {}}}",
                d.batch[0],
                d.m,
                d.k,
                d.n,
                d.transpose_lhs,
                d.transpose_rhs,
                d.rhs_batch[0] > 1,
                autotp_kernels::matmul_bf16::native()
            );
            continue;
        }
        println!(
            "| {name} | {} x {} x {} | {native_ms:.2} | {widened_ms:.2} | {f32_ms:.2} | {:.2} |",
            if d.batch[0] > 1 { format!("{} x {}", d.batch[0], d.m) } else { d.m.to_string() },
            d.k,
            d.n,
            widened_ms / native_ms
        );
    }
}
