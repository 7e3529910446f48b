//! The grouped expert GEMM: a mixture of experts' per-pair products with the experts' weights
//! read where they lie, computed as one GEMM per expert over the pairs routed to it.
//!
//! A batched-experts export computes each (token, choice) pair's product with its expert's
//! matrix as `matmul(gather(W, ids), x)` (or with the gathered matrix on the right), and the
//! matrices' gradient sums the pairs' outer products into their experts' rows:
//! `scatter_add(ids, matmul(dy, x, transpose))`. As written, the gather copies a whole matrix
//! per pair, the products are matrix-vector ones, and the outer products exist as a
//! `[pairs, rows, cols]` tensor. Here ([`GroupedForm`]):
//!
//! - **gathered**: `out[q] = W[ids[q]] x v[q]` (or `v[q] x W[ids[q]]`), where each pair's
//!   other operand `v[q]` is a vector: the pairs of expert `e` are stacked into a `[r, k]`
//!   matrix and multiplied by `W[e]`, read in place through strides, in one GEMM;
//! - **scattered**: `out[e] = sum over q with ids[q] = e of u[q] v[q]^T`: the pairs' vectors
//!   stacked into `U [r, m]` and `V [r, n]`, and `out[e] = U^T V`, one GEMM summing over the
//!   pairs.
//!
//! A pair whose vector is all zeros (bit for bit; in the scattered form, either vector) is
//! skipped and its product is zero: what the product is wherever the weights are finite. So
//! expert parallelism's padding rows (zeros, sized for the worst routing) cost nothing, and
//! the work is the routing's. Pairs are stacked in their order, so the sums run over each
//! expert's pairs in the order the unfused kernels add them. With an [`IndexBlock`], the table
//! (or result) is one rank's block of experts: pairs of another rank's experts give zeros
//! (gathered) or are skipped (scattered), as the gather and scatter-add do. Every GEMM is
//! [`crate::matmul`]'s, so every float dtype the matmul kernel takes works here too.
//!
//! Codegen chooses it (`codegen/src/in_place.rs`) unless `--no-moe-grouped-gemm`; a GPU runs
//! it as a [`GroupedKernel`]. Tests below compare it with the gather, matmul and scatter-add
//! kernels it replaces.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::movement::{resolved_indices, Rows};
use crate::{AlignedBuf, DType, IndexBlock, KernelError, MatMulDims, OperandLayout};

/// Which of a [`GroupedDims`]' forms: where the experts' table is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupedForm {
    /// `[table, ids, rhs] -> [out]`: `out[q] = op(table[ids[q]]) x op(rhs[q])`, each `rhs[q]`
    /// a column (`n == 1`).
    GatheredLhs,
    /// `[table, ids, lhs] -> [out]`: `out[q] = op(lhs[q]) x op(table[ids[q]])`, each `lhs[q]`
    /// a row (`m == 1`).
    GatheredRhs,
    /// `[ids, lhs, rhs] -> [out]`: `out[e] = sum over q with ids[q] = e of op(lhs[q]) x
    /// op(rhs[q])`, each an outer product (`k == 1`).
    Scattered,
}

/// The geometry of a grouped expert GEMM.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupedDims {
    /// One pair's product: `batch = [pairs]`, both operands `[pairs, ..]` (the table's side as
    /// the gathered matrices it stands for), contiguous.
    pub pair: MatMulDims,
    pub form: GroupedForm,
    /// The experts (rows of the table, or of the result) this kernel holds.
    pub experts: usize,
    /// When they are one rank's block of a table split over a mesh axis.
    pub block: Option<IndexBlock>,
}

impl GroupedDims {
    /// The pairs: the per-pair product's one batch dim.
    pub fn pairs(&self) -> usize {
        self.pair.batch.first().copied().unwrap_or(0)
    }

    /// Whether the geometry is one this kernel computes: one batch dim that both operands
    /// share, contiguous operands, and a vector on the pairs' side.
    pub fn is_valid(&self) -> bool {
        let d = &self.pair;
        let vectors = match self.form {
            GroupedForm::GatheredLhs => d.n == 1,
            GroupedForm::GatheredRhs => d.m == 1,
            GroupedForm::Scattered => d.k == 1,
        };
        d.batch.len() == 1
            && d.lhs_batch == d.batch
            && d.rhs_batch == d.batch
            && d.lhs_layout.is_none()
            && d.rhs_layout.is_none()
            && vectors
    }

    /// The elements of one expert's matrix: the table's (gathered) or the result's (scattered).
    pub fn matrix(&self) -> usize {
        let d = &self.pair;
        match self.form {
            GroupedForm::GatheredLhs => d.m * d.k,
            GroupedForm::GatheredRhs => d.k * d.n,
            GroupedForm::Scattered => d.m * d.n,
        }
    }

    /// The gathered forms' elements of one pair's product: `m` (table on the left) or `n`.
    pub fn width(&self) -> usize {
        self.matrix() / self.pair.k.max(1)
    }

    /// The gathered forms' expert matrix read in place as the `k x width` factor of a pair's
    /// product (`out[q]` as a row is `v[q]^T op(W)^T` where the table is the lhs, `v[q]^T op(W)`
    /// where it is the rhs): the element strides `(row, column)` of factor element `(kk, r)`
    /// within the expert's matrix.
    pub fn factor_strides(&self) -> (usize, usize) {
        let d = &self.pair;
        match (self.form, d.transpose_lhs, d.transpose_rhs) {
            (GroupedForm::GatheredLhs, false, _) => (1, d.k),
            (GroupedForm::GatheredLhs, true, _) => (d.m, 1),
            (_, _, false) => (d.n, 1),
            (_, _, true) => (1, d.k),
        }
    }

    /// Byte lengths of the inputs and the output, in the order the kernel takes them.
    pub fn buffer_bytes(&self, dtype: DType, index_dtype: DType) -> (Vec<usize>, usize) {
        let (d, size, pairs) = (&self.pair, dtype.size(), self.pairs());
        let table = self.experts * self.matrix() * size;
        let ids = pairs * index_dtype.size();
        let (lhs, rhs, out) = (pairs * d.m * d.k * size, pairs * d.k * d.n * size, pairs * d.m * d.n * size);
        match self.form {
            GroupedForm::GatheredLhs => (vec![table, ids, rhs], out),
            GroupedForm::GatheredRhs => (vec![table, ids, lhs], out),
            GroupedForm::Scattered => (vec![ids, lhs, rhs], table),
        }
    }

    fn rows(&self) -> Rows {
        match self.block {
            Some(b) => Rows { start: b.start, len: self.experts, global_len: b.global_len },
            None => Rows { start: 0, len: self.experts, global_len: self.experts },
        }
    }
}

/// The grouped GEMM as a GPU runs it (`autotp_llvm::grouped` emits it, and describes its work
/// items and fault words): a thread per output element, each summing its products in order.
/// The builtin kernel it stands for is `Kernel::GroupedMatMul` of the same fields.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupedKernel {
    /// f32, f64, bf16 or f16 (16-bit values multiplied and summed in f32).
    pub dtype: DType,
    /// i64 or i32.
    pub index_dtype: DType,
    /// The block's start is the launch's (ranks of one plan share the kernel).
    pub dims: GroupedDims,
}

impl GroupedKernel {
    /// The GPU form of a builtin `kernel`, where it has one.
    pub fn of(kernel: &crate::Kernel) -> Option<GroupedKernel> {
        let crate::Kernel::GroupedMatMul { dtype, index_dtype, dims } = kernel else { return None };
        let supported = matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
            && matches!(index_dtype, DType::I64 | DType::I32)
            && dims.is_valid();
        let mut dims = (**dims).clone();
        if let Some(block) = &mut dims.block {
            block.start = 0;
        }
        supported.then_some(GroupedKernel { dtype: *dtype, index_dtype: *index_dtype, dims })
    }

    /// The builtin kernel computing the same for the rank whose experts start at `start`.
    pub fn builtin(&self, start: usize) -> crate::Kernel {
        let mut dims = self.dims.clone();
        if let Some(block) = &mut dims.block {
            block.start = start;
        }
        crate::Kernel::GroupedMatMul { dtype: self.dtype, index_dtype: self.index_dtype, dims: Box::new(dims) }
    }

    /// The first expert a rank's `kernel` holds (0 without a block).
    pub fn start(kernel: &crate::Kernel) -> usize {
        match kernel {
            crate::Kernel::GroupedMatMul { dims, .. } => dims.block.map_or(0, |b| b.start),
            _ => 0,
        }
    }

    /// Its work items, one per thread: an element `(q, r)` of a pair's product (gathered), an
    /// element `(e, i, j)` of an expert's sum (scattered).
    pub fn items(&self) -> usize {
        let d = &self.dims;
        match d.form {
            GroupedForm::GatheredLhs | GroupedForm::GatheredRhs => d.pairs() * d.width(),
            GroupedForm::Scattered => d.experts * d.matrix(),
        }
    }

    /// The ids' bound: the experts of the whole table (negative ids count back from it).
    pub fn global_experts(&self) -> usize {
        self.dims.rows().global_len
    }

    /// The byte lengths of its buffers: the builtin kernel's inputs, then its output.
    pub fn buffer_bytes(&self) -> Vec<usize> {
        let (mut buffers, out) = self.dims.buffer_bytes(self.dtype, self.index_dtype);
        buffers.push(out);
        buffers
    }
}

fn is_zero(bytes: &[u8]) -> bool {
    bytes.iter().all(|&b| b == 0)
}

/// The pairs of each held expert, in pair order, among those `counts` keeps.
fn pairs_by_expert(ids: &[usize], rows: Rows, counts: impl Fn(usize) -> bool) -> Vec<Vec<usize>> {
    let mut groups = vec![Vec::new(); rows.len];
    for (q, &id) in ids.iter().enumerate() {
        if let Some(local) = rows.local(id).filter(|_| counts(q)) {
            groups[local].push(q);
        }
    }
    groups
}

/// The `piece`-byte pieces of `from` at `pairs`, one after another, in an aligned buffer.
fn stacked(from: &[u8], piece: usize, pairs: &[usize]) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(pairs.len() * piece);
    for (to, &q) in buf.as_mut_slice().chunks_exact_mut(piece.max(1)).zip(pairs) {
        to.copy_from_slice(&from[q * piece..][..piece]);
    }
    buf
}

/// Runs the grouped GEMM of `dims` (see [`GroupedForm`] for the buffers).
pub(crate) fn grouped_matmul(
    dtype: DType,
    index_dtype: DType,
    dims: &GroupedDims,
    inputs: &[&[u8]],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let (want_inputs, want_out) = dims.buffer_bytes(dtype, index_dtype);
    let lengths: Vec<usize> = inputs.iter().map(|b| b.len()).collect();
    if !dims.is_valid() || lengths != want_inputs || out.len() != want_out {
        return Err(KernelError::BufferSize { kernel: "grouped_matmul" });
    }
    let (d, size, rows) = (&dims.pair, dtype.size(), dims.rows());
    out.fill(0);
    match dims.form {
        GroupedForm::GatheredLhs | GroupedForm::GatheredRhs => {
            let [table, ids, vectors] = inputs else { unreachable!("three inputs, checked") };
            let ids = resolved_indices(index_dtype, ids, rows.global_len, "grouped_matmul")?;
            let (k, matrix, width) = (d.k, dims.matrix(), dims.width());
            let (vector, product) = (k * size, width * size);
            let (row_stride, col_stride) = dims.factor_strides();
            let groups = pairs_by_expert(&ids, rows, |q| !is_zero(&vectors[q * vector..][..vector]));
            // The experts' GEMMs side by side (each threaded itself where it is large), then
            // their rows put in place.
            let expert_products = |(e, pairs): (usize, &Vec<usize>)| -> Result<(usize, AlignedBuf), KernelError> {
                let stack = stacked(vectors, vector, pairs);
                let mut products = AlignedBuf::zeroed(pairs.len() * product);
                let gemm = MatMulDims {
                    batch: vec![],
                    lhs_batch: vec![],
                    rhs_batch: vec![],
                    m: pairs.len(),
                    k,
                    n: width,
                    transpose_lhs: false,
                    transpose_rhs: false,
                    lhs_layout: None,
                    rhs_layout: Some(OperandLayout { batch: vec![], rows: row_stride, cols: col_stride }),
                };
                let weights = &table[e * matrix * size..][..matrix * size];
                crate::matmul::matmul(dtype, &gemm, stack.as_slice(), weights, products.as_mut_slice())?;
                Ok((e, products))
            };
            let computed: Vec<Result<(usize, AlignedBuf), KernelError>> =
                groups.par_iter().enumerate().filter(|(_, pairs)| !pairs.is_empty()).map(expert_products).collect();
            for result in computed {
                let (e, products) = result?;
                for (row, &q) in products.as_slice().chunks_exact(product.max(1)).zip(&groups[e]) {
                    out[q * product..][..product].copy_from_slice(row);
                }
            }
        }
        GroupedForm::Scattered => {
            let [ids, lhs, rhs] = inputs else { unreachable!("three inputs, checked") };
            let ids = resolved_indices(index_dtype, ids, rows.global_len, "grouped_matmul")?;
            let (left, right) = (d.m * size, d.n * size);
            let counts = |q: usize| !is_zero(&lhs[q * left..][..left]) && !is_zero(&rhs[q * right..][..right]);
            let groups = pairs_by_expert(&ids, rows, counts);
            let matrix = dims.matrix() * size;
            // Each expert's sums are its own block of the result.
            out.par_chunks_mut(matrix.max(1)).zip(groups.par_iter()).try_for_each(|(sums, pairs)| {
                if pairs.is_empty() {
                    return Ok(());
                }
                let (u, v) = (stacked(lhs, left, pairs), stacked(rhs, right, pairs));
                // `U^T V`: U stored `[r, m]`, read transposed.
                let gemm = MatMulDims {
                    batch: vec![],
                    lhs_batch: vec![],
                    rhs_batch: vec![],
                    m: d.m,
                    k: pairs.len(),
                    n: d.n,
                    transpose_lhs: true,
                    transpose_rhs: false,
                    lhs_layout: None,
                    rhs_layout: None,
                };
                crate::matmul::matmul(dtype, &gemm, u.as_slice(), v.as_slice(), sums)
            })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::tests::floats;
    use crate::Kernel;

    fn bytes(x: &[f32]) -> AlignedBuf {
        AlignedBuf::from_bytes(bytemuck::cast_slice(x))
    }

    fn ids_bytes(ids: &[i64]) -> AlignedBuf {
        AlignedBuf::from_bytes(bytemuck::cast_slice(ids))
    }

    fn run(kernel: &Kernel, inputs: &[&AlignedBuf], out_len: usize) -> Result<Vec<f32>, KernelError> {
        let mut out = AlignedBuf::zeroed(out_len * 4);
        let ins: Vec<&[u8]> = inputs.iter().map(|b| b.as_slice()).collect();
        kernel.run(&ins, &mut [out.as_mut_slice()])?;
        Ok(bytemuck::cast_slice(out.as_slice()).to_vec())
    }

    fn pair_dims(pairs: usize, m: usize, k: usize, n: usize, transpose_lhs: bool, transpose_rhs: bool) -> MatMulDims {
        MatMulDims {
            batch: vec![pairs],
            lhs_batch: vec![pairs],
            rhs_batch: vec![pairs],
            m,
            k,
            n,
            transpose_lhs,
            transpose_rhs,
            lhs_layout: None,
            rhs_layout: None,
        }
    }

    /// Pairs of 4 experts, some with zero vectors (padding), some of experts outside a block.
    const IDS: [i64; 9] = [2, 0, 3, 2, 1, 0, 0, 3, 2];

    fn with_zero_rows(mut x: Vec<f32>, piece: usize) -> Vec<f32> {
        for q in [3, 6] {
            x[q * piece..][..piece].fill(0.0);
        }
        x
    }

    /// The gathered forms equal `matmul(gather(W, ids), v)`, and `matmul(v, gather(W, ids))`,
    /// bit for bit on every pair (zero vectors included), for both transposes of the table, with
    /// the whole table and with one rank's block of it.
    #[test]
    fn gathered_products_equal_gather_then_matmul() {
        let (pairs, experts) = (IDS.len(), 4);
        for (form, m, k, n) in [(GroupedForm::GatheredLhs, 24, 40, 1), (GroupedForm::GatheredRhs, 1, 40, 24)] {
            for transposed in [false, true] {
                for block in [None, Some(IndexBlock { mesh_axis: 0, start: 2, global_len: 4 })] {
                    let held = if block.is_some() { 2 } else { experts };
                    let lhs_side = form == GroupedForm::GatheredLhs;
                    let (t_lhs, t_rhs) = (lhs_side && transposed, !lhs_side && transposed);
                    let dims = pair_dims(pairs, m, k, n, t_lhs, t_rhs);
                    let matrix = if lhs_side { m * k } else { k * n };
                    let table = floats(held * matrix, 7);
                    let vectors = with_zero_rows(floats(pairs * k, 3), k);
                    let ids = ids_bytes(&IDS);
                    let gather = Kernel::Gather {
                        dtype: DType::F32,
                        index_dtype: DType::I64,
                        data: vec![held, matrix],
                        axis: 0,
                        block,
                    };
                    let gathered = run(&gather, &[&bytes(&table), &ids], pairs * matrix).unwrap();
                    let matmul = Kernel::MatMul { dtype: DType::F32, dims: dims.clone() };
                    let want = match lhs_side {
                        true => run(&matmul, &[&bytes(&gathered), &bytes(&vectors)], pairs * m * n),
                        false => run(&matmul, &[&bytes(&vectors), &bytes(&gathered)], pairs * m * n),
                    }
                    .unwrap();
                    let grouped = Kernel::GroupedMatMul {
                        dtype: DType::F32,
                        index_dtype: DType::I64,
                        dims: Box::new(GroupedDims { pair: dims, form, experts: held, block }),
                    };
                    let got = run(&grouped, &[&bytes(&table), &ids, &bytes(&vectors)], pairs * m * n).unwrap();
                    assert_eq!(got, want, "{form:?}, transposed {transposed}, block {block:?}");
                }
            }
        }
    }

    /// The scattered form equals `scatter_add(ids, matmul(u, v))` of the outer products, within
    /// f32 rounding (the sums run in the same order, the GEMM's one rounding per multiply-add),
    /// for both layouts of the vectors, with the whole result and one rank's block of it.
    #[test]
    fn scattered_products_equal_matmul_then_scatter_add() {
        let (pairs, experts, m, n) = (IDS.len(), 4, 24, 40);
        for (t_lhs, t_rhs) in [(false, true), (true, false)] {
            for block in [None, Some(IndexBlock { mesh_axis: 0, start: 2, global_len: 4 })] {
                let held = if block.is_some() { 2 } else { experts };
                let dims = pair_dims(pairs, m, 1, n, t_lhs, t_rhs);
                let u = with_zero_rows(floats(pairs * m, 5), m);
                let v = floats(pairs * n, 9);
                let ids = ids_bytes(&IDS);
                let matmul = Kernel::MatMul { dtype: DType::F32, dims: dims.clone() };
                let products = run(&matmul, &[&bytes(&u), &bytes(&v)], pairs * m * n).unwrap();
                let scatter = Kernel::ScatterAdd {
                    dtype: DType::F32,
                    index_dtype: DType::I64,
                    out: vec![held, m, n],
                    axis: 0,
                    block,
                };
                let want = run(&scatter, &[&ids, &bytes(&products)], held * m * n).unwrap();
                let grouped = Kernel::GroupedMatMul {
                    dtype: DType::F32,
                    index_dtype: DType::I64,
                    dims: Box::new(GroupedDims { pair: dims, form: GroupedForm::Scattered, experts: held, block }),
                };
                let got = run(&grouped, &[&ids, &bytes(&u), &bytes(&v)], held * m * n).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "element {i}: {g} vs {w}, block {block:?}");
                }
                // Expert 1 (of the whole table) has one pair: its product, exactly.
                if block.is_none() {
                    assert_eq!(got[m * n..2 * m * n], want[m * n..2 * m * n]);
                }
            }
        }
    }

    /// A pair whose vector is zeros does not read its expert's matrix: with that matrix NaN
    /// (expert 1, which only pair 3, zeroed, uses) its product is zeros, and the others' are
    /// finite; `gather` then `matmul` would have given it NaNs.
    #[test]
    fn pairs_with_zero_vectors_do_not_read_their_matrix() {
        let (m, k) = (3, 4);
        let ids: [i64; 4] = [0, 2, 0, 1];
        let mut table = floats(3 * m * k, 1);
        table[m * k..2 * m * k].fill(f32::NAN);
        let mut vectors = floats(4 * k, 2);
        vectors[3 * k..].fill(0.0);
        let dims = GroupedDims {
            pair: pair_dims(4, m, k, 1, false, false),
            form: GroupedForm::GatheredLhs,
            experts: 3,
            block: None,
        };
        let kernel = Kernel::GroupedMatMul { dtype: DType::F32, index_dtype: DType::I64, dims: Box::new(dims) };
        let got = run(&kernel, &[&bytes(&table), &ids_bytes(&ids), &bytes(&vectors)], 4 * m).unwrap();
        assert!(got[..3 * m].iter().all(|v| v.is_finite() && *v != 0.0), "{got:?}");
        assert_eq!(got[3 * m..], [0.0; 3]);
    }

    /// An id outside the table is an error naming the kernel, as the gather's is; a geometry
    /// without a vector on the pairs' side is refused.
    #[test]
    fn bad_ids_and_geometries_are_errors() {
        let dims = GroupedDims {
            pair: pair_dims(2, 3, 4, 1, false, false),
            form: GroupedForm::GatheredLhs,
            experts: 2,
            block: None,
        };
        let kernel = Kernel::GroupedMatMul { dtype: DType::F32, index_dtype: DType::I64, dims: Box::new(dims.clone()) };
        let (table, vectors) = (bytes(&floats(24, 1)), bytes(&floats(8, 2)));
        let err = run(&kernel, &[&table, &ids_bytes(&[0, 2]), &vectors], 6).unwrap_err();
        assert!(matches!(err, KernelError::IndexOutOfRange { kernel: "grouped_matmul", index: 2, bound: 2 }), "{err}");
        let wide = GroupedDims { pair: pair_dims(2, 3, 4, 2, false, false), ..dims };
        assert!(!wide.is_valid());
        let kernel = Kernel::GroupedMatMul { dtype: DType::F32, index_dtype: DType::I64, dims: Box::new(wide) };
        assert!(kernel.check_buffers(&[96, 16, 64], &[48]).is_err());
    }
}
