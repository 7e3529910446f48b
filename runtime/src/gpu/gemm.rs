//! A matmul as cuBLAS computes it: one column-major batched GEMM call.
//!
//! The program's matmul is row-major: `C[m, n] = L[m, k] R[k, n]` per batch, each operand
//! read through (row, column) element strides (its transpose flag and any layout read in place;
//! `MatMulDims::operand_strides`), `C` contiguous. cuBLAS is column-major, and a row-major
//! `C` is the column-major `C^T[n, m]` with leading dimension `n`, so the call computes
//! `C^T = R^T L^T`: cuBLAS's `A` is the rhs transposed (`n x k`) and its `B` the lhs
//! transposed (`k x m`), each read through the strides of the operand it transposes. An
//! operand with a unit row stride is column-major (operation N, leading dimension its column
//! stride), one with a unit column stride row-major (operation T, leading dimension its row
//! stride); one with neither has no cuBLAS form and its matmul stays on the host. The products of a batch are given by offsets (broadcast
//! batch dims repeat an operand), or, when one rhs serves every batch of an untransposed,
//! contiguous lhs, as one product of `batch x m` rows (as the CPU kernel does).
//!
//! Which cuBLAS entry runs a call is its [`GemmLayout`]: one product is a plain GEMM, products
//! at uniform offsets a strided batch (PyTorch's `mm` and `bmm`), others the batched form over
//! pointer arrays, whose kernels cuBLAS tunes for many small matrices.
//!
//! How f32 products are multiplied, in f32 or on TF32 tensor cores (`--tf32`), is a
//! [`GemmMath`]; [`round_to_tf32`] is the rounding the emulated GPU applies for the latter.

use autotp_kernels::{DType, MatMulDims};

/// One cuBLAS `gemmBatched` call (column-major, see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmCall {
    pub dtype: DType,
    /// cuBLAS's m, n, k: rows and columns of its `C`, and the contraction.
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Whether cuBLAS transposes its `A` (the rhs) and its `B` (the lhs).
    pub transpose_a: bool,
    pub transpose_b: bool,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    /// Per product, the element offsets of `A` (in the rhs), `B` (in the lhs) and `C` (in the
    /// output).
    pub products: Vec<[usize; 3]>,
    /// The matmul the call computes, as the builtin kernel has it (the emulated GPU runs this).
    pub dims: MatMulDims,
}

/// How a call's products lie, which picks its cuBLAS entry (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmLayout {
    /// One product: `gemm`.
    One,
    /// Products at uniform element strides of `A`, `B` and `C`: `gemmStridedBatched`.
    Strided([i64; 3]),
    /// Anything else: `gemmBatched` over the pointer arrays.
    Pointers,
}

/// cuBLAS's form of a `r x c` operand whose element `(i, j)` lies at `i * rows + j * cols`
/// (`strides = (rows, cols)`): (transposed, leading dimension), where it has one. Column-major
/// storage (unit row stride) is used as is; row-major storage (unit column stride) is the
/// column-major `c x r` transpose, which cuBLAS transposes back.
fn operand(strides: (isize, isize), r: usize, c: usize) -> Option<(bool, usize)> {
    let (rs, cs) = (usize::try_from(strides.0).ok()?, usize::try_from(strides.1).ok()?);
    if rs == 1 || r == 1 {
        let ld = if c == 1 { r.max(1) } else { cs };
        if ld >= r.max(1) {
            return Some((false, ld));
        }
    }
    if cs == 1 || c == 1 {
        let ld = if r == 1 { c.max(1) } else { rs };
        if ld >= c.max(1) {
            return Some((true, ld));
        }
    }
    None
}

impl GemmCall {
    /// The call computing the matmul `dims` of `dtype` (f32 or f64), or `None` where cuBLAS
    /// cannot (another dtype, an operand without a unit stride, an empty product).
    pub fn of(dtype: DType, dims: &MatMulDims) -> Option<GemmCall> {
        if !matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
            || dims.m == 0
            || dims.n == 0
            || dims.k == 0
        {
            return None;
        }
        let batches: usize = dims.batch.iter().product();
        let flat = batches > 1
            && dims.rhs_batch.iter().product::<usize>() == 1
            && dims.lhs_batch.iter().product::<usize>() == batches
            && !dims.transpose_lhs
            && dims.lhs_layout.is_none()
            && dims.rhs_layout.is_none();
        let (rows, offsets) = match flat {
            true => (batches * dims.m, vec![(0, 0)]),
            false => (dims.m, dims.batch_offsets()),
        };
        let (lhs, rhs) = dims.operand_strides();
        // cuBLAS's A is the rhs as `n x k` (the rhs transposed), its B the lhs as `k x rows`.
        let (transpose_a, lda) = operand((rhs.1, rhs.0), dims.n, dims.k)?;
        let (transpose_b, ldb) = operand((lhs.1, lhs.0), dims.k, rows)?;
        let products = offsets.iter().enumerate().map(|(p, &(l, r))| [r, l, p * dims.m * dims.n]).collect::<Vec<_>>();
        Some(GemmCall {
            dtype,
            m: dims.n,
            n: rows,
            k: dims.k,
            transpose_a,
            transpose_b,
            lda,
            ldb,
            ldc: dims.n,
            products,
            dims: dims.clone(),
        })
    }

    /// Evaluates the call as cuBLAS defines it, in f64 (the reference of the tests).
    /// Which cuBLAS entry computes the call.
    pub fn layout(&self) -> GemmLayout {
        let offset = |p: usize, which: usize| self.products[p][which] as i64;
        match self.products.len() {
            0 | 1 => GemmLayout::One,
            count => {
                let strides = [0, 1, 2].map(|which| offset(1, which) - offset(0, which));
                let uniform =
                    (2..count).all(|p| (0..3).all(|which| offset(p, which) - offset(p - 1, which) == strides[which]));
                match uniform {
                    true => GemmLayout::Strided(strides),
                    false => GemmLayout::Pointers,
                }
            }
        }
    }

    pub fn evaluate(&self, rhs: &[f64], lhs: &[f64], out: &mut [f64]) {
        let at = |x: &[f64], offset: usize, trans: bool, ld: usize, i: usize, j: usize| match trans {
            false => x[offset + i + j * ld],
            true => x[offset + j + i * ld],
        };
        for &[a, b, c] in &self.products {
            for j in 0..self.n {
                for i in 0..self.m {
                    let sum: f64 = (0..self.k)
                        .map(|p| {
                            at(rhs, a, self.transpose_a, self.lda, i, p) * at(lhs, b, self.transpose_b, self.ldb, p, j)
                        })
                        .sum();
                    out[c + i + j * self.ldc] = sum;
                }
            }
        }
    }
}

/// How f32 GEMMs multiply.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum GemmMath {
    /// In f32, as on the CPU (cuBLAS's `CUBLAS_DEFAULT_MATH`): the default, so that an f32 plan
    /// trains the same model on a GPU as on the CPU.
    #[default]
    F32,
    /// On TF32 tensor cores (`--tf32`, PyTorch's `allow_tf32`): each operand rounded to 10
    /// mantissa bits (to nearest, ties away from zero, as `cvt.rna.tf32.f32`), products summed
    /// in f32.
    Tf32,
}

/// `x` rounded to TF32 (10 mantissa bits; to nearest, ties away from zero); infinities and
/// NaNs unchanged.
pub fn round_to_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    f32::from_bits(x.to_bits().wrapping_add(1 << 12) & !((1 << 13) - 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use autotp_kernels::{Kernel, OperandLayout};

    fn values(len: usize, seed: u64) -> Vec<f64> {
        (0..len as u64).map(|i| ((i * 2654435761 + seed * 97) % 1000) as f64 / 500.0 - 1.0).collect()
    }

    fn dims(
        batch: &[usize],
        lhs: &[usize],
        rhs: &[usize],
        (m, k, n): (usize, usize, usize),
        t: (bool, bool),
    ) -> MatMulDims {
        MatMulDims {
            batch: batch.to_vec(),
            lhs_batch: lhs.to_vec(),
            rhs_batch: rhs.to_vec(),
            m,
            k,
            n,
            transpose_lhs: t.0,
            transpose_rhs: t.1,
            lhs_layout: None,
            rhs_layout: None,
        }
    }

    /// Every call computes what the builtin kernel computes from the same operands: both
    /// transposes, broadcast batches, a flattened batch, operands read through strides, vectors.
    #[test]
    fn calls_compute_the_builtin_matmul() {
        let mut cases = Vec::new();
        for t in [(false, false), (true, false), (false, true), (true, true)] {
            cases.push(dims(&[], &[], &[], (5, 7, 3), t));
            cases.push(dims(&[2, 3], &[2, 3], &[2, 3], (4, 6, 5), t));
            cases.push(dims(&[2, 3], &[1, 3], &[2, 1], (4, 6, 5), t));
            cases.push(dims(&[4], &[4], &[1], (3, 5, 2), t));
            cases.push(dims(&[], &[], &[], (1, 7, 3), t));
            cases.push(dims(&[], &[], &[], (5, 7, 1), t));
            cases.push(dims(&[], &[], &[], (5, 1, 3), t));
        }
        // Attention's q k^T with q, k stored [b, s, h, d] and read as [b, h, s, d].
        let (b, s, h, d) = (2, 5, 3, 4);
        let layout = OperandLayout { batch: vec![s * h * d, d], rows: h * d, cols: 1 };
        let mut attention = dims(&[b, h], &[b, h], &[b, h], (s, d, s), (false, true));
        attention.lhs_layout = Some(layout.clone());
        attention.rhs_layout = Some(layout);
        cases.push(attention);
        for (c, dims) in cases.iter().enumerate() {
            let call = GemmCall::of(DType::F64, dims).unwrap_or_else(|| panic!("case {c}: no call for {dims:?}"));
            let count = |batch: &[usize], r: usize, c: usize| batch.iter().product::<usize>() * r * c;
            let (lhs_len, rhs_len) = match (&dims.lhs_layout, dims.batch.as_slice()) {
                (Some(_), [b, h]) => (b * h * dims.m * dims.k, b * h * dims.k * dims.n),
                _ => (count(&dims.lhs_batch, dims.m, dims.k), count(&dims.rhs_batch, dims.k, dims.n)),
            };
            let (lhs, rhs) = (values(lhs_len, 1), values(rhs_len, 2));
            let out_len = count(&dims.batch, dims.m, dims.n);
            let mut want = vec![0u8; out_len * 8];
            let bytes = |x: &[f64]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
            let kernel = Kernel::MatMul { dtype: DType::F64, dims: dims.clone() };
            kernel.run(&[&bytes(&lhs), &bytes(&rhs)], &mut [&mut want]).unwrap();
            let want: Vec<f64> = want.chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
            let mut got = vec![f64::NAN; out_len];
            call.evaluate(&rhs, &lhs, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-12 * w.abs().max(1.0), "case {c} ({dims:?}), element {i}: {g} against {w}");
            }
        }
    }

    #[test]
    fn layouts_pick_the_plain_strided_or_pointer_entry_and_keep_every_product() {
        let flat = dims(&[4], &[4], &[1], (3, 5, 2), (false, false));
        let full = dims(&[2, 3], &[2, 3], &[2, 3], (4, 6, 5), (false, true));
        let broadcast = dims(&[2, 3], &[1, 3], &[2, 1], (4, 6, 5), (false, false));
        let plain = dims(&[], &[], &[], (5, 7, 3), (true, false));
        let cases = [(flat, "one"), (full, "strided"), (broadcast, "pointers"), (plain, "one")];
        for (dims, want) in cases {
            let call = GemmCall::of(DType::F32, &dims).unwrap();
            let got = match call.layout() {
                GemmLayout::One => {
                    assert_eq!(call.products.len(), 1);
                    "one"
                }
                GemmLayout::Strided(strides) => {
                    for (p, product) in call.products.iter().enumerate() {
                        let at = |which: usize| call.products[0][which] as i64 + p as i64 * strides[which];
                        assert_eq!(product.map(|x| x as i64), [at(0), at(1), at(2)], "product {p} of {dims:?}");
                    }
                    "strided"
                }
                GemmLayout::Pointers => "pointers",
            };
            assert_eq!(got, want, "{dims:?}: {:?}", call.products);
        }
    }

    #[test]
    fn operands_without_a_unit_stride_and_integer_dtypes_stay_on_the_host() {
        let mut strided = dims(&[], &[], &[], (4, 4, 4), (false, false));
        strided.lhs_layout = Some(OperandLayout { batch: vec![], rows: 8, cols: 2 });
        assert_eq!(GemmCall::of(DType::F32, &strided), None);
        let plain = dims(&[], &[], &[], (4, 4, 4), (false, false));
        assert_eq!(GemmCall::of(DType::I64, &plain), None);
        assert!(GemmCall::of(DType::BF16, &plain).is_some(), "16-bit GEMMs go to cuBLAS");
    }

    #[test]
    fn tf32_rounds_to_ten_mantissa_bits_ties_away_from_zero() {
        let ulp = 2f32.powi(-10);
        assert_eq!(round_to_tf32(1.0 + ulp / 2.0), 1.0 + ulp, "a tie rounds away from zero");
        assert_eq!(round_to_tf32(-(1.0 + ulp / 2.0)), -(1.0 + ulp));
        assert_eq!(round_to_tf32(1.0 + ulp / 2.0 - 2f32.powi(-23)), 1.0, "below the tie");
        assert_eq!(round_to_tf32(1.0 + ulp), 1.0 + ulp, "representable values stay");
        assert_eq!(round_to_tf32(f32::MAX), f32::INFINITY, "past the largest TF32 value");
        assert_eq!(round_to_tf32(f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert!(round_to_tf32(f32::NAN).is_nan());
    }
}
