//! Cross-entropy as generated kernels ([`cross_entropy`]): per row, the negative
//! log-likelihood of its label from two passes over the scores (their maximum, then the sum of
//! exponentials) and the label's score picked directly ([`autotp_kernels::kir::Expr::Pick`]);
//! then the rows' sums and the loss.

use autotp_ir::sharding::local_type;
use autotp_ir::{Graph, NodeId, Op, ValueId};
use autotp_kernels::kir::{self, Expr, ExprRef, Fold, Index, Stage, Store, Var};
use autotp_kernels::{BinaryOp, DType, UnaryOp};

/// A mean or summed cross-entropy over `[n, classes]` scores as two kernels: per row, the
/// negative log-likelihood of its label and whether it counts (`[n]` each, ignored labels give
/// 0 and do not count; a label outside the classes gives NaN, so a bad label cannot pass
/// silently), then their sums and the loss. `nodes` is the cross-entropy node, or a cast of
/// 16-bit scores to f32 and the cross-entropy reading it, whose kernels then read the 16-bit
/// scores and widen them as they load (a bf16 model's logits, never stored in f32). `None` for
/// other forms (weights, the log-probability output, classes not last, no reduction).
pub fn cross_entropy(graph: &Graph, nodes: &[NodeId]) -> Option<[kir::Kernel; 2]> {
    let (cast, node) = match nodes {
        [ce] => (None, graph.node(*ce)),
        [cast, ce] => (Some(graph.node(*cast)), graph.node(*ce)),
        _ => return None,
    };
    let Op::CrossEntropy { ignore_index, reduction } = node.op else { return None };
    let ty = |v: ValueId| local_type(&graph.mesh, graph.ty(v), &graph.value(v).placements);
    let (scores, labels) = (ty(node.inputs[0]), ty(node.inputs[1]));
    if node.inputs.len() != 2
        || node.outputs.len() != 1
        || scores.dtype != DType::F32
        || labels.dtype != DType::I64
        || scores.shape.len() != 2
        || reduction == autotp_ir::Reduction::None
    {
        return None;
    }
    // The scores as the kernels load them: f32, or the 16-bit values the cast widens.
    let loaded = match cast {
        None => DType::F32,
        Some(cast) => {
            let from = ty(cast.inputs[0]).dtype;
            let widens = matches!(cast.op, Op::Cast { to: DType::F32 }) && matches!(from, DType::BF16 | DType::F16);
            if !widens || cast.outputs[0] != node.inputs[0] {
                return None;
            }
            from
        }
    };
    let (n, classes) = (scores.shape[0], scores.shape[1]);
    if n == 0 || classes == 0 {
        return None;
    }
    let f32_buffer = |len| kir::Buffer { dtype: DType::F32, len };
    let row = Index::linear(Var::Outer, 1);
    let score = Expr::Load { buffer: 0, index: Index::row_major(classes) };
    let label = Expr::Load { buffer: 1, index: row.clone() };
    let rows = kir::Kernel {
        name: "cross_entropy_rows".into(),
        buffers: vec![
            kir::Buffer { dtype: loaded, len: n * classes },
            kir::Buffer { dtype: DType::I64, len: n },
            f32_buffer(n),
            f32_buffer(n),
        ],
        num_inputs: 2,
        outer: n,
        inner: classes,
        stages: vec![
            Stage::Reduce { fold: Fold::Max, exprs: vec![score.clone()], value: 0 },
            Stage::Reduce {
                fold: Fold::Sum,
                exprs: vec![score, Expr::Acc(0), Expr::Binary(BinaryOp::Sub, 0, 1), Expr::Unary(UnaryOp::Exp, 2)],
                value: 3,
            },
            // The label's score is picked (clamped into the row; a label outside it gives NaN).
            Stage::Row {
                exprs: vec![
                    label,
                    Expr::I64(ignore_index.unwrap_or(i64::MIN)),
                    Expr::Binary(BinaryOp::Equal, 0, 1),
                    Expr::Acc(1),
                    Expr::Unary(UnaryOp::Log, 3),
                    Expr::Acc(0),
                    Expr::Binary(BinaryOp::Add, 4, 5),
                    Expr::Pick { buffer: 0, index: Index::linear(Var::Outer, classes), offset: 0, bound: classes },
                    Expr::Binary(BinaryOp::Sub, 6, 7),
                    Expr::I64(0),
                    Expr::Binary(BinaryOp::Less, 0, 9),
                    Expr::I64(classes as i64),
                    Expr::Binary(BinaryOp::GreaterEqual, 0, 11),
                    Expr::Binary(BinaryOp::Or, 10, 12),
                    Expr::F32(f32::NAN),
                    Expr::Select(13, 14, 8),
                    Expr::F32(0.0),
                    Expr::Select(2, 16, 15),
                    Expr::F32(1.0),
                    Expr::Select(2, 16, 18),
                ],
                stores: vec![
                    Store { buffer: 2, index: row.clone(), value: 17 },
                    Store { buffer: 3, index: row, value: 19 },
                ],
            },
        ],
    };
    let all = Index::linear(Var::Inner, 1);
    let loss = match reduction {
        autotp_ir::Reduction::Mean => vec![Expr::Acc(0), Expr::Acc(1), Expr::Binary(BinaryOp::Div, 0, 1)],
        _ => vec![Expr::Acc(0)],
    };
    let value = (loss.len() - 1) as ExprRef;
    let total = kir::Kernel {
        name: "cross_entropy_total".into(),
        buffers: vec![f32_buffer(n), f32_buffer(n), f32_buffer(1)],
        num_inputs: 2,
        outer: 1,
        inner: n,
        stages: vec![
            Stage::Reduce { fold: Fold::Sum, exprs: vec![Expr::Load { buffer: 0, index: all.clone() }], value: 0 },
            Stage::Reduce { fold: Fold::Sum, exprs: vec![Expr::Load { buffer: 1, index: all }], value: 0 },
            Stage::Row { exprs: loss, stores: vec![Store { buffer: 2, index: Index::default(), value }] },
        ],
    };
    rows.check().ok()?;
    total.check().ok()?;
    Some([rows, total])
}
