//! bf16 matrix products on the CPU's bf16 dot-product instruction (AVX512-BF16's `vdpbf16ps`,
//! on Intel Cooper Lake and Sapphire Rapids and on AMD Zen 4): each instruction multiplies 16
//! pairs of bf16 elements exactly and adds both products into 16 f32 sums, twice the
//! multiply-adds of an f32 FMA per instruction and half its operand bytes. The sums stay in f32
//! over the whole `k` and are rounded to bf16 once, so a product is within one bf16 ulp of the
//! f32 GEMM on the same (bf16) inputs that CPUs without the instruction run ([`gemm()`] returns
//! `false` there); the instruction treats subnormal inputs and sums as zero.
//!
//! Layout (as oneDNN's and llamafile's bf16 kernels): both operands are packed so the
//! instruction reads consecutive elements of `k` in pairs. The rhs in panels of [`NR`] columns:
//! for each pair of rows `2q, 2q + 1`, the 32 columns' pairs (one 64-byte vector per 16
//! columns). The lhs in blocks of [`MR`] rows: for each pair, each row's two elements (one
//! 32-bit word, broadcast). A [`MR`] x [`NR`] tile of sums lives in 16 vector registers through
//! the whole `k`; tiles are independent, so the pool's threads take blocks of them and the result
//! does not depend on how many threads there are. Odd `k` and the edges of `m` and `n` are
//! padded with zeros when packing.

use rayon::prelude::*;

use crate::matmul::MatMulDims;

/// Rows of a tile (broadcast lhs words).
pub const MR: usize = 8;
/// Columns of a tile (two vectors of 16 sums).
pub const NR: usize = 32;
/// Row blocks of [`MR`] in one task of the pool.
const BLOCKS_PER_TASK: usize = 8;
/// Multiply-adds below which a product runs on the calling thread.
const TINY: usize = 1 << 22;

/// Whether this CPU has the bf16 dot-product instructions and the active level
/// ([`crate::isa::IsaLevel::active`]) allows AVX-512 (checked once).
pub fn native() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static NATIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *NATIVE.get_or_init(|| {
            crate::isa::IsaLevel::active() >= crate::isa::IsaLevel::V4 && is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `out = lhs x rhs` for every batch of `d`, on bf16 bits, with the bf16 instructions; `false`
/// (nothing written) when the CPU has none. Lengths are the caller's to check.
pub(crate) fn gemm(d: &MatMulDims, lhs: &[u16], rhs: &[u16], out: &mut [u16]) -> bool {
    if !native() {
        return false;
    }
    // Batches of an untransposed lhs against one rhs are one tall product (the rhs packed
    // once): a linear layer over `[batch, seq, features]`.
    let batches = crate::shape::numel(&d.batch);
    if batches > 1
        && crate::shape::numel(&d.rhs_batch) == 1
        && crate::shape::numel(&d.lhs_batch) == batches
        && !d.transpose_lhs
        && d.lhs_layout.is_none()
        && d.rhs_layout.is_none()
    {
        let flat = MatMulDims { batch: vec![], lhs_batch: vec![], rhs_batch: vec![], m: batches * d.m, ..d.clone() };
        return gemm(&flat, lhs, rhs, out);
    }
    let mn = d.m * d.n;
    if mn == 0 {
        return true;
    }
    let ((lrs, lcs), (rrs, rcs)) = d.operand_strides();
    let offsets = d.batch_offsets();
    let sequential = offsets.len() * mn * d.k <= TINY;
    let product = |dst: &mut [u16], &(l, r): &(usize, usize), parallel: bool| {
        let a = Operand { data: lhs, offset: l, rows: lrs, cols: lcs };
        let b = Operand { data: rhs, offset: r, rows: rrs, cols: rcs };
        product(a, b, d.m, d.n, d.k, dst, parallel);
    };
    if sequential {
        out.chunks_mut(mn).zip(&offsets).for_each(|(dst, o)| product(dst, o, false));
    } else if offsets.len() >= rayon::current_num_threads() {
        out.par_chunks_mut(mn).zip(offsets.par_iter()).for_each(|(dst, o)| product(dst, o, false));
    } else {
        out.chunks_mut(mn).zip(&offsets).for_each(|(dst, o)| product(dst, o, true));
    }
    true
}

/// A matrix operand read through strides (elements) from `offset` in `data`.
#[derive(Clone, Copy)]
struct Operand<'a> {
    data: &'a [u16],
    offset: usize,
    rows: isize,
    cols: isize,
}

impl Operand<'_> {
    fn at(&self, i: usize, j: usize) -> u16 {
        self.data[(self.offset as isize + i as isize * self.rows + j as isize * self.cols) as usize]
    }
}

/// `out` (`m x n`, row-major) = `a` (`m x k`) x `b` (`k x n`); tiles over the pool when
/// `parallel`.
fn product(a: Operand, b: Operand, m: usize, n: usize, k: usize, out: &mut [u16], parallel: bool) {
    let pairs = k.div_ceil(2);
    let (blocks, panels) = (m.div_ceil(MR), n.div_ceil(NR));
    // Panel p, pair q: the 32 columns' (row 2q, row 2q + 1) elements.
    let mut packed_b = vec![0u16; panels * pairs * NR * 2];
    let pack_b = |(p, panel): (usize, &mut [u16])| {
        let columns = NR.min(n - p * NR);
        if b.cols == 1 {
            // Rows of `b` are contiguous: interleave two of them.
            for q in 0..pairs {
                let row = |r: usize| &b.data[(b.offset as isize + r as isize * b.rows) as usize + p * NR..][..columns];
                let out = &mut panel[q * NR * 2..][..columns * 2];
                let first = row(2 * q);
                if 2 * q + 1 < k {
                    for ((pair, &x), &y) in out.chunks_exact_mut(2).zip(first).zip(row(2 * q + 1)) {
                        (pair[0], pair[1]) = (x, y);
                    }
                } else {
                    for (pair, &x) in out.chunks_exact_mut(2).zip(first) {
                        pair[0] = x;
                    }
                }
            }
            return;
        }
        for q in 0..pairs {
            for j in 0..NR.min(n - p * NR) {
                for t in 0..2.min(k - 2 * q) {
                    panel[(q * NR + j) * 2 + t] = b.at(2 * q + t, p * NR + j);
                }
            }
        }
    };
    // Block r, pair q: each of its rows' (column 2q, column 2q + 1) elements.
    let mut packed_a = vec![0u16; blocks * pairs * MR * 2];
    let pack_a = |(r, block): (usize, &mut [u16])| {
        if a.cols == 1 {
            // Rows of `a` are contiguous: each row's pairs are its words, in order.
            for i in 0..MR.min(m - r * MR) {
                let row = &a.data[(a.offset as isize + (r * MR + i) as isize * a.rows) as usize..][..k];
                for (q, pair) in row.chunks(2).enumerate() {
                    block[(q * MR + i) * 2..][..pair.len()].copy_from_slice(pair);
                }
            }
            return;
        }
        for q in 0..pairs {
            for i in 0..MR.min(m - r * MR) {
                for t in 0..2.min(k - 2 * q) {
                    block[(q * MR + i) * 2 + t] = a.at(r * MR + i, 2 * q + t);
                }
            }
        }
    };
    if parallel {
        packed_b.par_chunks_mut(pairs * NR * 2).enumerate().for_each(pack_b);
        packed_a.par_chunks_mut(pairs * MR * 2).enumerate().for_each(pack_a);
    } else {
        packed_b.chunks_mut(pairs * NR * 2).enumerate().for_each(pack_b);
        packed_a.chunks_mut(pairs * MR * 2).enumerate().for_each(pack_a);
    }
    // A task: up to BLOCKS_PER_TASK row blocks (whole rows of `out`) against every panel, each
    // panel against all the task's blocks in turn (the blocks stay in cache; each panel is
    // read once per task).
    let rows_per_task = BLOCKS_PER_TASK * MR;
    let task = |(t, rows): (usize, &mut [u16])| {
        let mut sums = [0f32; MR * NR];
        for p in 0..panels {
            let panel = &packed_b[p * pairs * NR * 2..(p + 1) * pairs * NR * 2];
            for r in t * BLOCKS_PER_TASK..((t + 1) * BLOCKS_PER_TASK).min(blocks) {
                let block = &packed_a[r * pairs * MR * 2..(r + 1) * pairs * MR * 2];
                // SAFETY: `native()` checked the instructions; the slices hold `pairs` pairs.
                unsafe { tile(pairs, block, panel, &mut sums) };
                let first_row = r * MR - t * rows_per_task;
                for i in 0..MR.min(m - r * MR) {
                    let row = &mut rows[(first_row + i) * n..(first_row + i + 1) * n];
                    for j in 0..NR.min(n - p * NR) {
                        row[p * NR + j] = crate::scalar::f32_to_bf16(sums[i * NR + j]);
                    }
                }
            }
        }
    };
    if parallel {
        out.par_chunks_mut(rows_per_task * n).enumerate().for_each(task);
    } else {
        out.chunks_mut(rows_per_task * n).enumerate().for_each(task);
    }
}

/// One [`MR`] x [`NR`] tile of f32 sums over `pairs` pairs of `k`, from a packed lhs block and
/// rhs panel, into `sums` (row-major).
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `block` holds `pairs * MR * 2` elements and `panel`
/// `pairs * NR * 2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile(pairs: usize, block: &[u16], panel: &[u16], sums: &mut [f32; MR * NR]) {
    use std::arch::x86_64::*;
    debug_assert!(block.len() >= pairs * MR * 2 && panel.len() >= pairs * NR * 2);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (a, b) = (block.as_ptr(), panel.as_ptr());
    for q in 0..pairs {
        // SAFETY: in bounds (the caller's lengths); unaligned loads.
        let (b0, b1) = unsafe {
            let at = b.add(q * NR * 2);
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.add(32).cast())),
            )
        };
        for (i, row) in acc.iter_mut().enumerate() {
            // SAFETY: in bounds; the row's pair is one (unaligned) 32-bit word.
            let pair = unsafe { a.add((q * MR + i) * 2).cast::<i32>().read_unaligned() };
            let pair = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
            row[0] = _mm512_dpbf16_ps(row[0], pair, b0);
            row[1] = _mm512_dpbf16_ps(row[1], pair, b1);
        }
    }
    for (i, row) in acc.iter().enumerate() {
        // SAFETY: `sums` holds MR rows of NR.
        unsafe {
            _mm512_storeu_ps(sums.as_mut_ptr().add(i * NR), row[0]);
            _mm512_storeu_ps(sums.as_mut_ptr().add(i * NR + 16), row[1]);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile(_: usize, _: &[u16], _: &[u16], _: &mut [f32; MR * NR]) {
    unreachable!("native() is false off x86-64")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::OperandLayout;
    use crate::shape::numel;

    fn bf16s(len: usize, seed: u32) -> Vec<u16> {
        (0..len as u32)
            .map(|i| {
                let x = ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0;
                crate::scalar::f32_to_bf16(x)
            })
            .collect()
    }

    fn f32s(x: &[u16]) -> Vec<f32> {
        x.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect()
    }

    /// Per output element of the product of the same bf16 inputs: the exact sum (in f64) and
    /// the sum of the terms' magnitudes.
    fn exact(d: &MatMulDims, lhs: &[u16], rhs: &[u16]) -> Vec<(f64, f64)> {
        let (lhs, rhs) = (f32s(lhs), f32s(rhs));
        let ((lrs, lcs), (rrs, rcs)) = d.operand_strides();
        let mut out = Vec::new();
        for (l, r) in d.batch_offsets() {
            for i in 0..d.m {
                for j in 0..d.n {
                    let (mut sum, mut magnitude) = (0f64, 0f64);
                    for p in 0..d.k {
                        let a = lhs[(l as isize + i as isize * lrs + p as isize * lcs) as usize] as f64;
                        let b = rhs[(r as isize + p as isize * rrs + j as isize * rcs) as usize] as f64;
                        (sum, magnitude) = (sum + a * b, magnitude + (a * b).abs());
                    }
                    out.push((sum, magnitude));
                }
            }
        }
        out
    }

    fn dims(batch: usize, m: usize, k: usize, n: usize, transpose_lhs: bool, transpose_rhs: bool) -> MatMulDims {
        MatMulDims {
            batch: vec![batch],
            lhs_batch: vec![batch],
            rhs_batch: vec![1],
            m,
            k,
            n,
            transpose_lhs,
            transpose_rhs,
            lhs_layout: None,
            rhs_layout: None,
        }
    }

    /// Every shape class (edges of m and n, odd k, transposes, a broadcast rhs, strided
    /// operands, a product large enough for the pool) is the exact product but for one bf16
    /// rounding and f32 sums (`k` roundings of 2^-24 of the terms' magnitudes), and the same on
    /// one thread as on the pool.
    #[test]
    fn products_are_the_exact_product_but_for_f32_sums_and_one_rounding() {
        if !native() {
            eprintln!("this CPU has no AVX512-BF16: the f32 fallback runs instead (tests/kernels.rs covers it)");
            return;
        }
        let mut cases = vec![
            dims(1, 1, 1, 1, false, false),
            dims(2, 7, 5, 33, false, false),
            dims(3, 17, 64, 40, true, false),
            dims(1, 9, 31, 65, false, true),
            dims(1, 256, 384, 160, true, true),
            dims(4, 64, 256, 96, false, false),
        ];
        let mut strided = dims(2, 12, 16, 12, false, true);
        strided.batch = vec![2, 3];
        strided.lhs_batch = vec![2, 3];
        strided.rhs_batch = vec![2, 3];
        // [b, s, h, d] read as [b, h, s, d] (attention's q k^T): s 12, h 3, d 16.
        let layout = OperandLayout { batch: vec![12 * 3 * 16, 16], rows: 3 * 16, cols: 1 };
        strided.lhs_layout = Some(layout.clone());
        strided.rhs_layout = Some(layout);
        cases.push(strided);
        for d in cases {
            let lhs = bf16s(numel(&d.lhs_batch) * d.m * d.k, 1);
            let rhs = bf16s(numel(&d.rhs_batch) * d.k * d.n, 2);
            let mut out = vec![0u16; numel(&d.batch) * d.m * d.n];
            assert!(gemm(&d, &lhs, &rhs, &mut out));
            for (&got, (sum, magnitude)) in out.iter().zip(exact(&d, &lhs, &rhs)) {
                let got = f32::from_bits((got as u32) << 16) as f64;
                let ulp = if sum == 0.0 { 0.0 } else { 2f64.powi(sum.abs().log2().floor() as i32 - 7) };
                let bound = ulp + d.k as f64 * 2f64.powi(-24) * magnitude;
                assert!((got - sum).abs() <= bound, "{d:?}: {got} against the exact {sum} (bound {bound})");
            }
            let mut one_thread = vec![0u16; out.len()];
            let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            pool.install(|| gemm(&d, &lhs, &rhs, &mut one_thread));
            assert_eq!(out, one_thread, "{d:?}: thread count changed the result");
        }
    }
}
