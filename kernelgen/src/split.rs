//! Whole-tensor reductions split across rows, so that a GPU runs them on many blocks and a CPU
//! on all its threads: a kernel of one row (`outer == 1`, a sum over a whole gradient for the
//! overflow test or the clipping norm) becomes two kernels.
//!
//! 1. *Partials*: the row cut into `chunks` rows of `inner / chunks` elements. Its `Reduce`
//!    stages fold each chunk as before, its `Map` stages store as before, and a `Row` stage
//!    stores accumulator `k` of chunk `c` at `partials[k * chunks + c]` (an f32 scratch buffer,
//!    its last output).
//! 2. *Total*: one row of `chunks`: `Reduce` stage `k` folds `partials[k * chunks ..]` with
//!    the original fold (a sum of sums, a max of maxima), and the original `Row` stages run on
//!    those accumulators.
//!
//! Both kernels take every buffer of the original (the total's inputs add the scratch buffer
//! after them), so each writes only what its stages store. The sums are the same terms added
//! in another order: the result agrees with the unsplit kernel to rounding (Higham's bound,
//! which `tests/kernels.rs` checks), and a max is exact.
//!
//! Split only where it is exact to do so: every address of the inner variable is a plain
//! stride (`inner * stride`, which becomes `row * chunk * stride + inner * stride`), no
//! expression reads the loop variables themselves, the reductions read no accumulator, and the
//! `Map` stages read neither accumulators nor outputs. Tests: unit tests below,
//! `tests/kernels.rs` (numerics).

use autotp_kernels::kir::{Buffer, Expr, Index, Kernel, Stage, Store, Term, Var};
use autotp_kernels::DType;

/// Rows with fewer elements are not worth splitting.
pub const SPLIT_ELEMENTS: usize = 1 << 20;

/// The most chunks a row is cut into, and the fewest worth it (a GPU's multiprocessors).
const MAX_CHUNKS: usize = 1024;
const MIN_CHUNKS: usize = 128;

/// `kernel` as its partials and its total kernels (see the module doc), or `None` where it is
/// not a whole-tensor reduction over more than [`SPLIT_ELEMENTS`] that splits exactly.
pub fn split_whole_reduction(kernel: &Kernel) -> Option<[Kernel; 2]> {
    let reductions = kernel.stages.iter().filter(|s| matches!(s, Stage::Reduce { .. })).count();
    if kernel.outer != 1 || kernel.inner <= SPLIT_ELEMENTS || reductions == 0 {
        return None;
    }
    let chunks = (MIN_CHUNKS..=MAX_CHUNKS).rev().find(|c| kernel.inner.is_multiple_of(*c))?;
    let chunk = kernel.inner / chunks;
    let outputs = kernel.buffers.len();
    let mut partial_stages = Vec::new();
    let mut row_stages = Vec::new();
    let mut folds = Vec::new();
    for stage in &kernel.stages {
        match stage {
            Stage::Reduce { fold, exprs, value } => {
                let exprs = split_exprs(exprs, kernel.num_inputs, chunk)?;
                partial_stages.push(Stage::Reduce { fold: *fold, exprs, value: *value });
                folds.push(*fold);
            }
            Stage::Map { exprs, stores } => {
                let exprs = split_exprs(exprs, kernel.num_inputs, chunk)?;
                let stores = (stores.iter())
                    .map(|s| Some(Store { buffer: s.buffer, index: split_index(&s.index, chunk)?, value: s.value }))
                    .collect::<Option<Vec<_>>>()?;
                partial_stages.push(Stage::Map { exprs, stores });
            }
            Stage::Row { exprs, stores } => {
                if exprs.iter().any(reads_loop_variables) {
                    return None;
                }
                let stores = stores.iter().map(|s| Store { buffer: s.buffer + 1, ..s.clone() }).collect();
                row_stages.push(Stage::Row { exprs: exprs.clone(), stores });
            }
        }
    }
    let scratch = Buffer { dtype: DType::F32, len: reductions * chunks };
    let row = |k: usize| Index { base: k * chunks, terms: vec![plain(Var::Outer, 1)] };
    partial_stages.push(Stage::Row {
        exprs: (0..reductions).map(Expr::Acc).collect(),
        stores: (0..reductions).map(|k| Store { buffer: outputs, index: row(k), value: k as u32 }).collect(),
    });
    let partials = Kernel {
        name: format!("{}.partials", kernel.name),
        buffers: kernel.buffers.iter().copied().chain([scratch]).collect(),
        num_inputs: kernel.num_inputs,
        outer: chunks,
        inner: chunk,
        stages: partial_stages,
    };
    let mut total_stages: Vec<Stage> = (folds.iter().enumerate())
        .map(|(k, &fold)| {
            let index = Index { base: k * chunks, terms: vec![plain(Var::Inner, 1)] };
            Stage::Reduce { fold, exprs: vec![Expr::Load { buffer: kernel.num_inputs, index }], value: 0 }
        })
        .collect();
    total_stages.extend(row_stages);
    let mut buffers = kernel.buffers.clone();
    buffers.insert(kernel.num_inputs, scratch);
    let total = Kernel {
        name: format!("{}.total", kernel.name),
        buffers,
        num_inputs: kernel.num_inputs + 1,
        outer: 1,
        inner: chunks,
        stages: total_stages,
    };
    Some([partials, total])
}

/// `var * stride`.
fn plain(var: Var, stride: usize) -> Term {
    Term { var, div: 1, modulo: None, stride, offset: 0, wrap: None }
}

/// A reduction's or map's expressions over the chunked row, or `None` where one does not split
/// exactly (see the module doc).
fn split_exprs(exprs: &[Expr], num_inputs: usize, chunk: usize) -> Option<Vec<Expr>> {
    (exprs.iter())
        .map(|expr| match expr {
            Expr::Load { buffer, .. } if *buffer >= num_inputs => None,
            // A picked element's place is a value's, which the chunks cannot follow.
            Expr::Pick { .. } => None,
            Expr::Load { buffer, index } => Some(Expr::Load { buffer: *buffer, index: split_index(index, chunk)? }),
            Expr::Coord(index) => Some(Expr::Coord(split_index(index, chunk)?)),
            Expr::Acc(_) | Expr::Var(_) => None,
            other => Some(other.clone()),
        })
        .collect()
}

/// Whether `expr` depends on where in the loop nest it runs.
fn reads_loop_variables(expr: &Expr) -> bool {
    match expr {
        Expr::Var(_) => true,
        Expr::Load { index, .. } | Expr::Coord(index) => !index.terms.is_empty(),
        Expr::Pick { .. } => true,
        _ => false,
    }
}

/// `index` of the one-row kernel's position `inner` as a function of the chunked kernel's
/// `outer * chunk + inner`: the outer variable's terms (always 0 before) fold into the base,
/// and a plain inner term `inner * s` becomes `outer * (chunk * s) + inner * s`; `None` for any
/// other inner term.
fn split_index(index: &Index, chunk: usize) -> Option<Index> {
    let mut split = Index { base: index.base, terms: Vec::new() };
    for term in &index.terms {
        match term.var {
            Var::Outer => split.base += (term.offset % term.wrap.unwrap_or(usize::MAX)) * term.stride,
            Var::Inner => {
                let plain_term = term.div == 1 && term.modulo.is_none() && term.offset == 0 && term.wrap.is_none();
                if !plain_term {
                    return None;
                }
                split.terms.push(plain(Var::Outer, chunk * term.stride));
                split.terms.push(plain(Var::Inner, term.stride));
            }
        }
    }
    Some(split)
}

#[cfg(test)]
mod tests {
    use autotp_kernels::kir::{Buffer, Fold};
    use autotp_kernels::{BinaryOp, DType};

    use super::*;

    /// `total = sum(x)`, `y = x * 2` over one row of `n` f32, and `any = (total - total) == 0`.
    fn sum_and_scale(n: usize) -> Kernel {
        let at = |stride: usize| Index { base: 0, terms: vec![plain(Var::Inner, stride)] };
        let scalar = Index { base: 0, terms: vec![plain(Var::Outer, 1)] };
        Kernel {
            name: "sum".into(),
            buffers: vec![
                Buffer { dtype: DType::F32, len: n },
                Buffer { dtype: DType::F32, len: 1 },
                Buffer { dtype: DType::F32, len: n },
                Buffer { dtype: DType::Bool, len: 1 },
            ],
            num_inputs: 1,
            outer: 1,
            inner: n,
            stages: vec![
                Stage::Reduce { fold: Fold::Sum, exprs: vec![Expr::Load { buffer: 0, index: at(1) }], value: 0 },
                Stage::Row {
                    exprs: vec![
                        Expr::Acc(0),
                        Expr::Binary(BinaryOp::Sub, 0, 0),
                        Expr::F32(0.0),
                        Expr::Binary(BinaryOp::Equal, 1, 2),
                    ],
                    stores: vec![
                        Store { buffer: 1, index: scalar.clone(), value: 0 },
                        Store { buffer: 3, index: scalar, value: 3 },
                    ],
                },
                Stage::Map {
                    exprs: vec![
                        Expr::Load { buffer: 0, index: at(1) },
                        Expr::F32(2.0),
                        Expr::Binary(BinaryOp::Mul, 0, 1),
                    ],
                    stores: vec![Store { buffer: 2, index: at(1), value: 2 }],
                },
            ],
        }
    }

    #[test]
    fn a_whole_tensor_sum_becomes_partials_and_a_total() {
        let n = 3 * (1 << 20);
        let [partials, total] = split_whole_reduction(&sum_and_scale(n)).expect("splits");
        partials.check().unwrap();
        total.check().unwrap();
        assert_eq!((partials.outer, partials.inner), (1024, n / 1024));
        assert_eq!((total.outer, total.inner, total.num_inputs), (1, 1024, 2));
        assert_eq!(partials.buffers.last(), Some(&Buffer { dtype: DType::F32, len: 1024 }));
        assert_eq!(total.buffers[1], Buffer { dtype: DType::F32, len: 1024 });
        let Stage::Map { stores, .. } = &partials.stages[1] else { panic!("{:?}", partials.stages) };
        assert_eq!(stores[0].index.terms, [plain(Var::Outer, n / 1024), plain(Var::Inner, 1)]);
        let Stage::Row { stores, .. } = &total.stages[1] else { panic!("{:?}", total.stages) };
        assert_eq!(stores.iter().map(|s| s.buffer).collect::<Vec<_>>(), [2, 4], "outputs after the scratch input");
    }

    #[test]
    fn only_whole_tensor_reductions_that_split_exactly_are_split() {
        assert!(split_whole_reduction(&sum_and_scale(1 << 20)).is_none(), "small enough for one block");
        assert!(split_whole_reduction(&sum_and_scale(2_097_157)).is_none(), "no divisor in 128..=1024");
        let mut rows = sum_and_scale(3 << 20);
        rows.outer = 2;
        assert!(split_whole_reduction(&rows).is_none(), "already rows");
        let mut strided = sum_and_scale(3 << 20);
        let Stage::Reduce { exprs, .. } = &mut strided.stages[0] else { unreachable!() };
        exprs[0] = Expr::Load {
            buffer: 0,
            index: Index { base: 0, terms: vec![Term { modulo: Some(7), ..plain(Var::Inner, 1) }] },
        };
        assert!(split_whole_reduction(&strided).is_none(), "a modulo does not split");
        let mut reads_acc = sum_and_scale(3 << 20);
        let Stage::Map { exprs, .. } = &mut reads_acc.stages[2] else { unreachable!() };
        exprs[1] = Expr::Acc(0);
        assert!(split_whole_reduction(&reads_acc).is_none(), "a map reading the sum needs it whole");
    }
}
