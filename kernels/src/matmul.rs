//! Batched matrix multiplication with numpy batch broadcasting and transpose flags. f32 and
//! f64 go through the `gemm` crate; bf16 runs on the CPU's bf16 instructions where it has them
//! ([`crate::matmul_bf16`]); other half types, and bf16 elsewhere, are widened to f32 (rounded
//! once at the end); integers use a plain loop.

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
    /// Where the lhs's elements lie when it is read in place as a permutation of a stored
    /// tensor (a transpose no one materialises); `None`: contiguous.
    #[serde(default)]
    pub lhs_layout: Option<OperandLayout>,
    #[serde(default)]
    pub rhs_layout: Option<OperandLayout>,
}

/// Element strides of an operand as the matmul reads it (before its transpose flag): one per
/// output batch dim (0 where the operand broadcasts), then its last two dims.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OperandLayout {
    pub batch: Vec<usize>,
    pub rows: usize,
    pub cols: usize,
}

impl MatMulDims {
    /// Element strides of each batch dim of an operand of `batch` dims and `matrix` elements
    /// per batch.
    fn batch_strides(&self, batch: &[usize], matrix: usize, layout: &Option<OperandLayout>) -> Vec<usize> {
        match layout {
            Some(l) => l.batch.clone(),
            None => broadcast_strides(batch, &self.batch).iter().map(|s| s * matrix).collect(),
        }
    }

    /// The element offset of each output batch's lhs and rhs.
    pub fn batch_offsets(&self) -> Vec<(usize, usize)> {
        let count = numel(&self.batch);
        let ls = self.batch_strides(&self.lhs_batch, self.m * self.k, &self.lhs_layout);
        let rs = self.batch_strides(&self.rhs_batch, self.k * self.n, &self.rhs_layout);
        let out_strides = strides(&self.batch);
        (0..count)
            .map(|b| {
                let (mut l, mut r) = (0, 0);
                for d in 0..self.batch.len() {
                    let idx = (b / out_strides[d]) % self.batch[d];
                    l += idx * ls[d];
                    r += idx * rs[d];
                }
                (l, r)
            })
            .collect()
    }

    /// (row stride, column stride) of the lhs and rhs as `m x k` and `k x n` matrices.
    pub fn operand_strides(&self) -> ((isize, isize), (isize, isize)) {
        let (m, k, n) = (self.m as isize, self.k as isize, self.n as isize);
        // The stored operand's (row, column) strides (contiguous: `cols` and 1), then swapped
        // by the transpose flag.
        let stored = |layout: &Option<OperandLayout>, cols: isize| {
            layout.as_ref().map_or((cols, 1), |l| (l.rows as isize, l.cols as isize))
        };
        let (lr, lc) = stored(&self.lhs_layout, if self.transpose_lhs { m } else { k });
        let (rr, rc) = stored(&self.rhs_layout, if self.transpose_rhs { k } else { n });
        let lhs = if self.transpose_lhs { (lc, lr) } else { (lr, lc) };
        let rhs = if self.transpose_rhs { (rc, rr) } else { (rr, rc) };
        (lhs, rhs)
    }

    /// Whether each operand's reads stay inside its `batch x rows x cols` elements.
    pub fn layouts_in_bounds(&self) -> bool {
        let fits = |layout: &Option<OperandLayout>, batch: &[usize], rows: usize, cols: usize| match layout {
            None => true,
            Some(l) => {
                let len = numel(batch) * rows * cols;
                let last = self.batch.iter().zip(&l.batch).map(|(&b, &s)| b.saturating_sub(1) * s).sum::<usize>()
                    + rows.saturating_sub(1) * l.rows
                    + cols.saturating_sub(1) * l.cols;
                l.batch.len() == self.batch.len() && (len == 0 || last < len)
            }
        };
        let (lr, lc) = if self.transpose_lhs { (self.k, self.m) } else { (self.m, self.k) };
        let (rr, rc) = if self.transpose_rhs { (self.n, self.k) } else { (self.k, self.n) };
        fits(&self.lhs_layout, &self.lhs_batch, lr, lc) && fits(&self.rhs_layout, &self.rhs_batch, rr, rc)
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
    if batches > 1
        && numel(&d.rhs_batch) == 1
        && numel(&d.lhs_batch) == batches
        && !d.transpose_lhs
        && d.lhs_layout.is_none()
        && d.rhs_layout.is_none()
    {
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
            let native = dtype == DType::BF16 && crate::matmul_bf16::gemm(d, &view(lhs), &view(rhs), view_mut(out)?);
            if native {
                return Ok(());
            }
            let mut result = vec![0f32; out.len() / 2];
            f32::gemm(d, &widen(dtype, lhs), &widen(dtype, rhs), &mut result);
            narrow(dtype, &result, out)?;
        }
        _ => with_num_type!(dtype, T => naive::<T>(d, &view(lhs), &view(rhs), view_mut(out)?),
            _ => return Err(KernelError::Unsupported { kernel: "matmul", what: format!("{dtype}") })),
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `len` values in [-1, 1), spread by a hash of the index and `seed`.
    pub(crate) fn floats(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    fn bytes(x: &[f32]) -> Vec<u8> {
        x.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn run(d: &MatMulDims, lhs: &[f32], rhs: &[f32]) -> Vec<f32> {
        let mut out = vec![0u8; numel(&d.batch) * d.m * d.n * 4];
        let kernel = crate::Kernel::MatMul { dtype: DType::F32, dims: d.clone() };
        kernel.run(&[&bytes(lhs), &bytes(rhs)], &mut [&mut out]).unwrap();
        out.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    /// Attention's `q k^T` with q and k stored `[b, s, h, d]` and read as `[b, h, s, d]`
    /// through strides equals the product of the materialised transposes, bit for bit, for
    /// every transpose flag and for a small (one thread) and a larger (split) product.
    #[test]
    fn operands_read_through_strides_match_materialised_transposes() {
        for (b, s, h, dh) in [(2, 5, 3, 4), (2, 128, 2, 64)] {
            let q = floats(b * s * h * dh, 1);
            let k = floats(b * s * h * dh, 2);
            // [b, s, h, d] -> [b, h, s, d]
            let heads = |x: &[f32]| {
                let mut y = vec![0.0; x.len()];
                for (i, v) in x.iter().enumerate() {
                    let (bi, si, hi, di) = (i / (s * h * dh), i / (h * dh) % s, i / dh % h, i % dh);
                    y[((bi * h + hi) * s + si) * dh + di] = *v;
                }
                y
            };
            let layout = OperandLayout { batch: vec![s * h * dh, dh], rows: h * dh, cols: 1 };
            let dims = |transpose_rhs: bool, strided: bool| MatMulDims {
                batch: vec![b, h],
                lhs_batch: vec![b, h],
                rhs_batch: vec![b, h],
                m: s,
                k: dh,
                n: s,
                transpose_lhs: false,
                transpose_rhs,
                lhs_layout: strided.then(|| layout.clone()),
                rhs_layout: (strided && transpose_rhs).then(|| layout.clone()),
            };
            let want = run(&dims(true, false), &heads(&q), &heads(&k));
            let got = run(&dims(true, true), &q, &k);
            assert_eq!(want, got, "q k^T, s = {s}");
            assert!(dims(true, true).layouts_in_bounds());
            let mut outside = dims(true, true);
            outside.lhs_layout = Some(OperandLayout { batch: vec![s * h * dh, dh], rows: h * dh + 1, cols: 1 });
            assert!(!outside.layouts_in_bounds());
        }
    }
}
