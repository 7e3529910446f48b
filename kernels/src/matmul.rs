//! Batched matrix multiplication with numpy batch broadcasting and transpose flags. f32 and
//! f64 go through the `gemm` crate; half types are widened to f32; integers use a plain loop.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::scalar::{narrow, widen, with_num_type, Num};
use crate::shape::{broadcast_strides, numel, strides};
use crate::{view, view_mut, DType, KernelError};

/// The geometry of one batched matmul: `out[b] = op(lhs[b]) x op(rhs[b])` where `op`
/// transposes the last two dims when the flag is set.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MatMulDims {
    /// Batch dims of the output.
    pub batch: Vec<usize>,
    /// Batch dims of each operand, padded with leading 1s to the output's batch rank.
    pub lhs_batch: Vec<usize>,
    pub rhs_batch: Vec<usize>,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub transpose_lhs: bool,
    pub transpose_rhs: bool,
}

impl MatMulDims {
    fn batch_offsets(&self) -> Vec<(usize, usize)> {
        let count = numel(&self.batch);
        let ls = broadcast_strides(&self.lhs_batch, &self.batch);
        let rs = broadcast_strides(&self.rhs_batch, &self.batch);
        let out_strides = strides(&self.batch);
        (0..count)
            .map(|b| {
                let (mut l, mut r) = (0, 0);
                for d in 0..self.batch.len() {
                    let idx = (b / out_strides[d]) % self.batch[d];
                    l += idx * ls[d];
                    r += idx * rs[d];
                }
                (l * self.m * self.k, r * self.k * self.n)
            })
            .collect()
    }

    /// (row stride, column stride) of the lhs and rhs as `m x k` and `k x n` matrices.
    fn operand_strides(&self) -> ((isize, isize), (isize, isize)) {
        let (m, k, n) = (self.m as isize, self.k as isize, self.n as isize);
        let lhs = if self.transpose_lhs { (1, m) } else { (k, 1) };
        let rhs = if self.transpose_rhs { (1, k) } else { (n, 1) };
        (lhs, rhs)
    }
}

trait GemmElem: Num {
    fn gemm(d: &MatMulDims, lhs: &[Self], rhs: &[Self], out: &mut [Self]);
}

fn gemm_crate<T: Num + Default>(d: &MatMulDims, lhs: &[T], rhs: &[T], out: &mut [T], one: T) {
    // One rhs for every batch and an untransposed lhs: the lhs batches are one tall matrix
    // (`[batch x m, k]`), so one GEMM of `batch x m` rows does them all (a linear layer over
    // `[batch, seq, features]`), which parallelises and blocks far better than `batch` small ones.
    let batches = numel(&d.batch);
    if batches > 1 && numel(&d.rhs_batch) == 1 && numel(&d.lhs_batch) == batches && !d.transpose_lhs {
        let flat = MatMulDims { batch: vec![], lhs_batch: vec![], rhs_batch: vec![], m: batches * d.m, ..d.clone() };
        return gemm_crate(&flat, lhs, rhs, out, one);
    }
    let offsets = d.batch_offsets();
    let ((lrs, lcs), (rrs, rcs)) = d.operand_strides();
    let mn = d.m * d.n;
    if mn == 0 {
        return;
    }
    // Rows `rows` of one product, into `dst` (those rows of the output).
    let run = |(l, r): (usize, usize), rows: std::ops::Range<usize>, dst: &mut [T], parallelism: gemm::Parallelism| {
        let l = (l as isize + rows.start as isize * lrs) as usize;
        // SAFETY: the offsets and strides stay inside `lhs`, `rhs` and `dst`, whose lengths the
        // caller checked against the dims; `rows` lies within `0..m`.
        unsafe {
            gemm::gemm(
                rows.len(),
                d.n,
                d.k,
                dst.as_mut_ptr(),
                1,
                d.n as isize,
                false,
                lhs.as_ptr().add(l),
                lcs,
                lrs,
                rhs.as_ptr().add(r),
                rcs,
                rrs,
                T::default(),
                one,
                false,
                false,
                false,
                parallelism,
            )
        }
    };
    let threads = rayon::current_num_threads();
    if offsets.len() * d.m * d.n * d.k <= TINY_GEMMS {
        // Waking the pool costs more than the whole product.
        for (dst, &o) in out.chunks_mut(mn).zip(&offsets) {
            run(o, 0..d.m, dst, gemm::Parallelism::None);
        }
    } else if offsets.len() >= threads && offsets.len() > 1 {
        out.par_chunks_mut(mn)
            .zip(offsets.par_iter())
            .for_each(|(dst, &o)| run(o, 0..d.m, dst, gemm::Parallelism::None));
    } else if d.m * d.n * d.k <= SMALL_GEMM && d.m >= 2 * ROW_BLOCK && threads > 1 {
        // Small products: whole blocks of rows per thread, each a sequential GEMM (the
        // library's own threading costs more than it saves at this size).
        let rows = d.m.div_ceil(threads).next_multiple_of(ROW_BLOCK);
        for (dst, &o) in out.chunks_mut(mn).zip(&offsets) {
            dst.par_chunks_mut(rows * d.n).enumerate().for_each(|(i, block)| {
                let start = i * rows;
                run(o, start..(start + rows).min(d.m), block, gemm::Parallelism::None)
            });
        }
    } else {
        for (dst, &o) in out.chunks_mut(mn).zip(&offsets) {
            run(o, 0..d.m, dst, gemm::Parallelism::Rayon(threads));
        }
    }
}

/// Multiply-adds (of all the batch's products) below which they run on the calling thread.
const TINY_GEMMS: usize = 1 << 20;
/// Multiply-adds below which a GEMM splits its rows over the threads itself.
const SMALL_GEMM: usize = 1 << 22;
/// Rows per block when it does (a multiple of the kernels' register tile).
const ROW_BLOCK: usize = 16;

impl GemmElem for f32 {
    fn gemm(d: &MatMulDims, lhs: &[f32], rhs: &[f32], out: &mut [f32]) {
        gemm_crate(d, lhs, rhs, out, 1.0)
    }
}

impl GemmElem for f64 {
    fn gemm(d: &MatMulDims, lhs: &[f64], rhs: &[f64], out: &mut [f64]) {
        gemm_crate(d, lhs, rhs, out, 1.0)
    }
}

fn naive<T: Num>(d: &MatMulDims, lhs: &[T], rhs: &[T], out: &mut [T]) {
    let ((lrs, lcs), (rrs, rcs)) = d.operand_strides();
    let (lrs, lcs, rrs, rcs) = (lrs as usize, lcs as usize, rrs as usize, rcs as usize);
    for ((l, r), dst) in d.batch_offsets().into_iter().zip(out.chunks_mut((d.m * d.n).max(1))) {
        for i in 0..d.m {
            for j in 0..d.n {
                let mut acc = T::zero();
                for p in 0..d.k {
                    acc = acc.add(lhs[l + i * lrs + p * lcs].mul(rhs[r + p * rrs + j * rcs]));
                }
                dst[i * d.n + j] = acc;
            }
        }
    }
}

pub(crate) fn matmul(dtype: DType, d: &MatMulDims, lhs: &[u8], rhs: &[u8], out: &mut [u8]) -> Result<(), KernelError> {
    let expect = |batch: &[usize], rows: usize, cols: usize| numel(batch) * rows * cols * dtype.size();
    if lhs.len() != expect(&d.lhs_batch, d.m, d.k)
        || rhs.len() != expect(&d.rhs_batch, d.k, d.n)
        || out.len() != expect(&d.batch, d.m, d.n)
    {
        return Err(KernelError::BufferSize { kernel: "matmul" });
    }
    match dtype {
        DType::F32 => f32::gemm(d, &view(lhs), &view(rhs), view_mut(out)?),
        DType::F64 => f64::gemm(d, &view(lhs), &view(rhs), view_mut(out)?),
        DType::F16 | DType::BF16 => {
            let mut result = vec![0f32; out.len() / 2];
            f32::gemm(d, &widen(dtype, lhs), &widen(dtype, rhs), &mut result);
            narrow(dtype, &result, out)?;
        }
        _ => with_num_type!(dtype, T => naive::<T>(d, &view(lhs), &view(rhs), view_mut(out)?),
            _ => return Err(KernelError::Unsupported { kernel: "matmul", what: format!("{dtype}") })),
    }
    Ok(())
}
