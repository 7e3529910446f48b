//! Generated attention against the builtin kernel, the oracle: both targets' cuts compiled for
//! x86, and the GPU's tensor-core passes on simulated blocks ([`crate::warp_simulator`]).

use autotp_kernels::attention::{AttentionDims, AttentionFunction, AttentionMask, AttentionTarget};
use autotp_kernels::{AlignedBuf, DType, Kernel};

use crate::{compile_cpu_functions, Function};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `x` as a buffer of `dtype` (rounded as the cast kernel rounds).
fn buffer(dtype: DType, x: &[f32]) -> AlignedBuf {
    let wide: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = AlignedBuf::zeroed(x.len() * dtype.size());
    Kernel::Cast { from: DType::F32, to: dtype }.run(&[&wide], &mut [out.as_mut_slice()]).unwrap();
    out
}

fn floats(dtype: DType, b: &AlignedBuf) -> Vec<f32> {
    let mut wide = AlignedBuf::zeroed(b.len() / dtype.size() * 4);
    Kernel::Cast { from: dtype, to: DType::F32 }.run(&[b.as_slice()], &mut [wide.as_mut_slice()]).unwrap();
    wide.as_slice().chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// How a test runs the generated functions.
#[derive(Clone, Copy, PartialEq)]
enum Runner {
    /// Compiled for x86, their units in two calls, as a thread pool splits them.
    Halves,
    /// A GPU's passes on simulated blocks (three, fewer than most passes' units), their warp
    /// operations included ([`crate::warp_simulator`]).
    SimulatedBlocks,
}

/// Runs `kernel` as the builtin and as the generated functions cut for `target`, run by
/// `runner`; both outputs.
fn both(
    kernel: &Kernel,
    target: AttentionTarget,
    inputs: &[AlignedBuf],
    output_bytes: &[usize],
    runner: Runner,
) -> [Vec<AlignedBuf>; 2] {
    let ins: Vec<&[u8]> = inputs.iter().map(|b| b.as_slice()).collect();
    let mut builtin: Vec<AlignedBuf> = output_bytes.iter().map(|&n| AlignedBuf::zeroed(n)).collect();
    let mut outs: Vec<&mut [u8]> = builtin.iter_mut().map(|b| b.as_mut_slice()).collect();
    kernel.run(&ins, &mut outs).unwrap();
    let functions = AttentionFunction::of(kernel, target).unwrap();
    let compiled: Vec<Function> = match runner {
        Runner::Halves => functions.iter().map(Function::Attention).collect(),
        Runner::SimulatedBlocks => functions.iter().map(Function::SimulatedAttention).collect(),
    };
    let entries = compile_cpu_functions(&compiled).unwrap();
    let mut generated: Vec<AlignedBuf> = output_bytes.iter().map(|&n| AlignedBuf::zeroed(n)).collect();
    let mut delta = vec![0f32; functions[0].dims.batch() * functions[0].dims.q_len];
    for (f, entry) in functions.iter().zip(entries) {
        let table = f.table();
        let mut pointers: Vec<*mut u8> = inputs.iter().map(|b| b.as_slice().as_ptr() as *mut u8).collect();
        pointers.extend(generated.iter_mut().map(|b| b.as_mut_slice().as_mut_ptr()));
        pointers.push(table.as_ptr() as *mut u8);
        pointers.push(delta.as_mut_ptr() as *mut u8);
        // SAFETY: the buffers have the kernel's sizes.
        unsafe {
            match runner {
                Runner::Halves => {
                    entry.run(&pointers, 0..f.units() / 2);
                    entry.run(&pointers, f.units() / 2..f.units());
                }
                Runner::SimulatedBlocks => {
                    crate::warp_simulator::launch_attention(entry, f, &pointers, f.units().min(3))
                }
            }
        }
    }
    [builtin, generated]
}

fn assert_close(label: &str, dtype: DType, want: &AlignedBuf, got: &AlignedBuf, tolerance: f32) {
    let (want, got) = (floats(dtype, want), floats(dtype, got));
    for (n, (w, g)) in want.iter().zip(&got).enumerate() {
        assert!(w == g || (w - g).abs() <= tolerance * w.abs().max(1.0), "{label}[{n}]: generated {g}, builtin {w}");
    }
}

/// The generated functions of both targets against the builtin kernel.
fn check(dtype: DType, dims: AttentionDims, mask: AttentionMask) {
    check_runs(dtype, dims, mask, &[(AttentionTarget::Cpu, Runner::Halves), (AttentionTarget::Gpu, Runner::Halves)]);
}

/// The forward and backward of attention `(dtype, dims, mask)` as the generated functions
/// of each `(target, runner)` compute them, against the builtin kernel: f32 within 2e-5 of
/// the f64 oracle, 16-bit results within a rounding (gradients on tensor cores within two:
/// `p` and `ds` are rounded too).
///
/// With [`AttentionDims::query_runs`], the runs start at [`run_starts`].
fn check_runs(dtype: DType, dims: AttentionDims, mask: AttentionMask, runs: &[(AttentionTarget, Runner)]) {
    let label = format!("{dtype} {mask:?} {dims:?}");
    let query_start = dims.query_runs.map(|runs| {
        let starts = run_starts(runs);
        let mut start = AlignedBuf::zeroed(8 * runs);
        start.as_mut_slice().copy_from_slice(&starts.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>());
        start
    });
    let [q, k, v, bias, out, lse] = dims.numels();
    let mut inputs: Vec<AlignedBuf> =
        [(q, 1), (k, 2), (v, 3)].iter().map(|&(n, seed)| buffer(dtype, &values(n, seed))).collect();
    if dims.bias.is_some() {
        inputs.push(buffer(dtype, &values(bias, 4)));
    }
    let forward_inputs = inputs.iter().cloned().chain(query_start.clone()).collect::<Vec<_>>();
    let scale = 0.37;
    let forward = Kernel::Attention { dtype, dims: dims.clone(), scale, mask, generated: true };
    let backward = Kernel::AttentionGrad { dtype, dims: dims.clone(), scale, mask, generated: true };
    for &(target, runner) in runs {
        let label = format!("{label} {target:?}");
        let tolerance = match (dtype, runner) {
            (DType::F32, _) => 2e-5,
            (_, Runner::Halves) => 1e-2,
            (_, Runner::SimulatedBlocks) => 2e-2,
        };
        let mut inputs = inputs.clone();
        let [builtin, generated] = both(&forward, target, &forward_inputs, &[out * dtype.size(), lse * 4], runner);
        assert_close(&format!("{label} out"), dtype, &builtin[0], &generated[0], 1e-2_f32.min(tolerance));
        assert_close(&format!("{label} lse"), DType::F32, &builtin[1], &generated[1], 2e-5);
        inputs.extend(builtin);
        inputs.push(buffer(dtype, &values(out, 5)));
        inputs.extend(query_start.clone());
        let grads = [q * dtype.size(), k * dtype.size(), v * dtype.size()];
        let [builtin, generated] = both(&backward, target, &inputs, &grads, runner);
        for (name, (want, got)) in ["dq", "dk", "dv"].iter().zip(builtin.iter().zip(&generated)) {
            assert_close(&format!("{label} {name}"), dtype, want, got, tolerance);
        }
    }
}

fn dims(kv_lead: &[usize], len: usize, head_dim: usize, value_dim: usize, bias: Option<Vec<usize>>) -> AttentionDims {
    let kv_lead = kv_lead.to_vec();
    AttentionDims {
        lead: vec![2, 3],
        kv_lead,
        q_len: len,
        kv_len: len,
        head_dim,
        value_dim,
        bias,
        query_runs: None,
        key_blocks: None,
    }
}

/// Where [`check_runs`]' runs of queries start ([`AttentionDims::query_runs`]): one at 45;
/// several out of order (a load-balanced context-parallel rank's, and more), 58, 29 or 12, 58,
/// 29; four with some before every key (-20, 58, -3, 80).
fn run_starts(runs: usize) -> Vec<i64> {
    match runs {
        1 => vec![45],
        // A ring's: positions relative to a block of keys, some before every key.
        4 => vec![-20, 58, -3, 80],
        _ => (0..runs).map(|r| ((runs - r) * 29 % 75) as i64).collect(),
    }
}

/// A context-parallel rank's queries: 30 of them from position 45 over 90 keys, so that the
/// first keys are seen by every query, the last by none, and a window ends inside the run; on
/// both targets' cuts, a GPU's threads per row and its tensor-core tiles.
#[test]
fn queries_from_a_position_match_the_builtin_kernel() {
    let at = |head_dim, bias: Option<Vec<usize>>| AttentionDims {
        q_len: 30,
        kv_len: 90,
        query_runs: Some(1),
        ..dims(&[2, 1], 30, head_dim, head_dim, bias)
    };
    for mask in [AttentionMask::Causal, AttentionMask::SlidingWindow { window: 20 }, AttentionMask::None] {
        check(DType::F32, at(16, Some(vec![1, 3, 30, 90])), mask);
        let simulated = [(AttentionTarget::Gpu, Runner::SimulatedBlocks)];
        check_runs(DType::BF16, at(32, None), mask, &simulated);
    }
}

/// Queries in runs of 15 (two or three, as a load-balanced context-parallel rank's) at
/// positions out of order over 90 keys, in units of rows that stay in one run; the tensor
/// cores' tiles take one run, so 16-bit operands that would take them run a thread per row.
#[test]
fn queries_in_runs_match_the_builtin_kernel() {
    for runs in [2, 3, 4] {
        let at = |head_dim, bias: Option<Vec<usize>>| AttentionDims {
            q_len: 15 * runs,
            kv_len: 90,
            query_runs: Some(runs),
            ..dims(&[2, 1], 15 * runs, head_dim, head_dim, bias)
        };
        for mask in [AttentionMask::Causal, AttentionMask::SlidingWindow { window: 20 }, AttentionMask::None] {
            check(DType::F32, at(16, Some(vec![1, 3, 15 * runs, 90])), mask);
            check(DType::F32, at(12, None), mask);
        }
        let simulated = [(AttentionTarget::Gpu, Runner::SimulatedBlocks)];
        check_runs(DType::BF16, at(32, None), AttentionMask::Causal, &simulated);
        let kernel = |runs| Kernel::Attention {
            dtype: DType::BF16,
            dims: AttentionDims { query_runs: Some(runs), ..at(32, None) },
            scale: 1.0,
            mask: AttentionMask::Causal,
            generated: true,
        };
        let on_gpu = |runs| AttentionFunction::of(&kernel(runs), AttentionTarget::Gpu).unwrap()[0].tensor_cores;
        assert!(on_gpu(1) && !on_gpu(runs));
    }
}

#[test]
fn generated_attention_matches_the_builtin_kernel() {
    for mask in [AttentionMask::None, AttentionMask::Causal, AttentionMask::SlidingWindow { window: 5 }] {
        check(DType::F32, dims(&[2, 3], 36, 64, 64, None), mask);
        check(DType::F32, dims(&[2, 1], 37, 32, 16, None), mask);
    }
    // Units of 4, 2 and 1 rows (36, 22, 37 and 19); one key/value head for three query
    // heads; per-head and per-batch biases; head dims not a multiple of the vector width.
    check(DType::F32, dims(&[2, 1], 22, 16, 8, Some(vec![1, 3, 22, 22])), AttentionMask::Causal);
    check(DType::F32, dims(&[1, 3], 19, 12, 4, Some(vec![2, 1, 1, 19])), AttentionMask::None);
    check(DType::F32, dims(&[2, 3], 9, 3, 5, None), AttentionMask::Causal);
    for dtype in [DType::BF16, DType::F16] {
        check(dtype, dims(&[2, 1], 32, 32, 32, None), AttentionMask::Causal);
    }
}

/// The GPU's tensor-core forward as the emulated GPU runs it: tiles of 128 queries, the last
/// of a head short (150 = 128 + 22), every mask, shared key/value heads and a bias.
#[test]
fn tensor_core_tiles_match_the_builtin_kernel() {
    let forward = |dtype, dims: &AttentionDims| {
        let kernel =
            Kernel::Attention { dtype, dims: dims.clone(), scale: 0.3, mask: AttentionMask::Causal, generated: true };
        AttentionFunction::of(&kernel, AttentionTarget::Gpu).unwrap().remove(0)
    };
    let short = dims(&[2, 1], 150, 16, 16, None);
    let tiles = forward(DType::BF16, &short);
    assert!(tiles.tensor_cores);
    assert_eq!((tiles.units(), tiles.threads_per_unit()), (2 * 3 * 2, 256));
    assert!(!forward(DType::F32, &short).tensor_cores, "f32 has no m16n8k16");
    assert!(!forward(DType::BF16, &dims(&[2, 1], 150, 24, 24, None)).tensor_cores, "24 is no multiple of 16");
    for mask in [AttentionMask::None, AttentionMask::Causal, AttentionMask::SlidingWindow { window: 40 }] {
        check(DType::BF16, short.clone(), mask);
    }
    check(DType::F16, dims(&[2, 3], 130, 32, 32, Some(vec![1, 3, 130, 130])), AttentionMask::Causal);
}

/// The passes that run a thread per row (f32, and 16-bit heads tensor cores do not take) as a
/// GPU runs them: 150 rows of 6 heads on three blocks of 256 threads, so that threads take a
/// second row, shared key/value heads, a sliding window and a bias.
#[test]
fn simulated_thread_per_row_passes_match_the_builtin_kernel() {
    let cases = [
        (DType::F32, dims(&[2, 1], 150, 32, 16, None), AttentionMask::Causal),
        (DType::F32, dims(&[2, 3], 150, 8, 8, Some(vec![1, 3, 150, 150])), AttentionMask::SlidingWindow { window: 7 }),
        (DType::BF16, dims(&[2, 1], 150, 24, 24, None), AttentionMask::Causal),
    ];
    for (dtype, dims, mask) in cases {
        let backward = Kernel::AttentionGrad { dtype, dims: dims.clone(), scale: 0.37, mask, generated: true };
        let passes = AttentionFunction::of(&backward, AttentionTarget::Gpu).unwrap();
        assert!(passes.iter().all(|f| !f.tensor_cores), "{dims:?}");
        assert!(passes[0].units() > 3 * 256, "{dims:?}: dq's threads take a second row");
        check_runs(dtype, dims, mask, &[(AttentionTarget::Gpu, Runner::SimulatedBlocks)]);
    }
}

/// The tensor-core passes as a GPU runs them, their warps' `mma`, `ldmatrix`, shuffles and
/// barriers simulated on host threads ([`crate::warp_simulator`]), on fewer blocks than
/// units: two query heads sharing a key/value head, tiles of 150 rows (the second short)
/// and 64 keys (the third short), an fp16 bias under a sliding window, and heads of 96 (one
/// stage of shared memory; the others copy the next tile while working on this one).
#[test]
fn simulated_tensor_core_passes_match_the_builtin_kernel() {
    let cases = [
        (DType::BF16, AttentionDims { lead: vec![1, 2], kv_lead: vec![1, 1], ..dims(&[], 150, 32, 32, None) }),
        (
            DType::F16,
            AttentionDims { lead: vec![1, 2], kv_lead: vec![1, 2], ..dims(&[], 40, 16, 16, Some(vec![1, 2, 40, 40])) },
        ),
        // Heads of 96: one stage of shared memory (two would pass 48 KiB), dk and dv apart.
        (DType::BF16, AttentionDims { lead: vec![1, 1], kv_lead: vec![1, 1], ..dims(&[], 70, 96, 96, None) }),
    ];
    for (dtype, dims) in cases {
        let mask = if dims.bias.is_some() { AttentionMask::SlidingWindow { window: 9 } } else { AttentionMask::Causal };
        let backward = Kernel::AttentionGrad { dtype, dims: dims.clone(), scale: 0.37, mask, generated: true };
        let passes = AttentionFunction::of(&backward, AttentionTarget::Gpu).unwrap();
        assert!(passes.iter().all(|f| f.tensor_cores), "{dims:?}");
        check_runs(dtype, dims, mask, &[(AttentionTarget::Gpu, Runner::SimulatedBlocks)]);
    }
}
