//! Lowering of one op, with its input and output types, to the builtin kernel that computes
//! it. The reference evaluator and codegen both use this, so they run identical kernels.

use autotp_kernels::{AdamWConfig, ClassLossDims, IndexBlock, Kernel, MatMulDims, Optimizer, SgdConfig};

use crate::sharding::local_type;
use crate::{Graph, Node, Op, Placement, TensorType};

/// The kernel of `node` on one rank of `graph`'s mesh (built from the node's local types), or
/// `None` for constants and collectives. A gather whose table, or a scatter-add whose result,
/// is split along the indexed axis gets an [`IndexBlock`] with start 0: each rank sets its own
/// with [`Kernel::place_blocks`].
pub fn node_kernel(graph: &Graph, node: &Node) -> Option<Kernel> {
    let local = |v: &crate::ValueId| local_type(&graph.mesh, graph.ty(*v), &graph.value(*v).placements);
    let inputs: Vec<TensorType> = node.inputs.iter().map(local).collect();
    let outputs: Vec<TensorType> = node.outputs.iter().map(local).collect();
    let mut kernel = kernel_for(&node.op, &inputs.iter().collect::<Vec<_>>(), &outputs.iter().collect::<Vec<_>>())?;
    let split = match (&node.op, &mut kernel) {
        (Op::Gather { axis }, Kernel::Gather { block, .. }) => Some((node.inputs[0], *axis, block)),
        (Op::ScatterAdd { axis, .. }, Kernel::ScatterAdd { block, .. }) => Some((node.outputs[0], *axis, block)),
        _ => None,
    };
    if let Some((table, axis, block)) = split {
        let on = graph.value(table).placements.iter().position(|p| *p == Placement::Shard(axis));
        *block = on.map(|mesh_axis| IndexBlock { mesh_axis, start: 0, global_len: graph.ty(table).shape[axis] });
    }
    Some(kernel)
}

/// The update rule of an optimizer op (`adamw`, `sgd`), `None` for other ops.
pub fn optimizer_of(op: &Op) -> Option<Optimizer> {
    match op {
        Op::AdamW { beta1, beta2, eps, weight_decay } => {
            Some(Optimizer::AdamW(AdamWConfig { beta1: *beta1, beta2: *beta2, eps: *eps, weight_decay: *weight_decay }))
        }
        Op::Sgd { momentum, weight_decay, nesterov } => {
            Some(Optimizer::Sgd(SgdConfig { momentum: *momentum, weight_decay: *weight_decay, nesterov: *nesterov }))
        }
        _ => None,
    }
}

/// The update rule that `nodes` apply together as one multi-tensor optimizer step: when they
/// are all the same optimizer op, with the same hyperparameters, scalar inputs (learning rate,
/// step) and element type.
pub fn multi_tensor_optimizer(graph: &Graph, nodes: &[crate::NodeId]) -> Option<Optimizer> {
    let first = graph.node(*nodes.first()?);
    let optimizer = optimizer_of(&first.op)?;
    let scalars = |n: &Node| n.inputs.get(2 + optimizer.num_states()..).map(<[_]>::to_vec);
    // (Checked, not assumed: the verifier asks this of graphs that may name missing values.)
    let dtype = |n: &Node| n.inputs.first().filter(|p| p.index() < graph.num_values()).map(|&p| graph.ty(p).dtype);
    let same = nodes
        .iter()
        .map(|&n| graph.node(n))
        .all(|n| n.op == first.op && scalars(n).is_some() && scalars(n) == scalars(first) && dtype(n) == dtype(first));
    same.then_some(optimizer)
}

fn product(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// `shape` as `[outer, len, inner]` around `axis`.
fn around_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (product(&shape[..axis]), shape[axis], product(&shape[axis + 1..]))
}

/// The dims of a (batched) matmul of `lhs` by `rhs` giving `out`, the operands' batch dims
/// padded on the left with ones to the result's.
fn matmul_dims(lhs: &[usize], rhs: &[usize], out: &[usize], transpose_lhs: bool, transpose_rhs: bool) -> MatMulDims {
    let batch = out[..out.len() - 2].to_vec();
    let pad = |s: &[usize]| {
        let mut b = vec![1; batch.len() - (s.len() - 2)];
        b.extend(&s[..s.len() - 2]);
        b
    };
    let k = if transpose_lhs { lhs[lhs.len() - 2] } else { lhs[lhs.len() - 1] };
    MatMulDims {
        lhs_batch: pad(lhs),
        rhs_batch: pad(rhs),
        m: out[out.len() - 2],
        n: out[out.len() - 1],
        k,
        batch,
        transpose_lhs,
        transpose_rhs,
        lhs_layout: None,
        rhs_layout: None,
    }
}

/// The kernel for `op`, or `None` for ops that are not kernels: constants (data written at load
/// time), collectives and pipeline sends and receives (communication, run by the runtime's
/// comm). The kernel's shapes come
/// from the types given, so passing a rank's local types gives the rank's local kernel. The
/// types must satisfy the op's rule (the verifier's job).
pub fn kernel_for(op: &Op, inputs: &[&TensorType], outputs: &[&TensorType]) -> Option<Kernel> {
    let in0 = inputs.first();
    let dtype = in0.map(|t| t.dtype).unwrap_or(outputs[0].dtype);
    let shape = || in0.map(|t| t.shape.clone()).unwrap_or_default();
    let out_shape = || outputs[0].shape.clone();
    Some(match op {
        Op::Constant { .. } | Op::Collective { .. } | Op::Send { .. } | Op::Recv { .. } => return None,
        // Codegen makes a wait alias its collective's result; evaluators copy it.
        Op::Wait => Kernel::Copy,
        Op::Unary(op) => Kernel::Unary { op: *op, dtype },
        Op::Binary(op) => {
            Kernel::Binary { op: *op, dtype, lhs: shape(), rhs: inputs[1].shape.clone(), out: out_shape() }
        }
        Op::Select => Kernel::Select {
            dtype: inputs[1].dtype,
            cond: shape(),
            x: inputs[1].shape.clone(),
            y: inputs[2].shape.clone(),
            out: out_shape(),
        },
        Op::Cast { to } => Kernel::Cast { from: dtype, to: *to },
        Op::Reduce { op, axes, .. } => Kernel::Reduce { op: *op, dtype, shape: shape(), axes: axes.clone() },
        Op::MatMul { transpose_lhs, transpose_rhs } => Kernel::MatMul {
            dtype,
            dims: matmul_dims(&inputs[0].shape, &inputs[1].shape, &outputs[0].shape, *transpose_lhs, *transpose_rhs),
        },
        Op::Reshape { .. } => Kernel::Copy,
        Op::Transpose { perm } => Kernel::Transpose { dtype, shape: shape(), perm: perm.clone() },
        Op::Slice { starts, steps, .. } => {
            Kernel::Slice { dtype, shape: shape(), starts: starts.clone(), steps: steps.clone(), out: out_shape() }
        }
        Op::Concat { axis } => {
            Kernel::Concat { dtype, shapes: inputs.iter().map(|t| t.shape.clone()).collect(), axis: *axis }
        }
        Op::Split { axis, .. } => Kernel::Split {
            dtype,
            shape: shape(),
            axis: *axis,
            sizes: outputs.iter().map(|t| t.shape[*axis]).collect(),
        },
        Op::Expand { .. } => Kernel::Expand { dtype, shape: shape(), out: out_shape() },
        Op::Gather { axis } => {
            Kernel::Gather { dtype, index_dtype: inputs[1].dtype, data: shape(), axis: *axis, block: None }
        }
        Op::ScatterAdd { axis, .. } => Kernel::ScatterAdd {
            dtype: inputs[1].dtype,
            index_dtype: inputs[0].dtype,
            out: out_shape(),
            axis: *axis,
            block: None,
        },
        Op::AdamW { .. } | Op::Sgd { .. } => match optimizer_of(op)? {
            Optimizer::AdamW(config) => Kernel::AdamW { dtype, config },
            Optimizer::Sgd(config) => Kernel::Sgd { dtype, config },
        },
        Op::GatherNd => {
            Kernel::GatherNd { dtype, index_dtype: inputs[1].dtype, data: shape(), indices: inputs[1].shape.clone() }
        }
        Op::ScatterNd { reduction } => Kernel::ScatterNd {
            dtype,
            index_dtype: inputs[1].dtype,
            data: shape(),
            indices: inputs[1].shape.clone(),
            reduction: *reduction,
        },
        Op::ScatterElements { axis, .. } => Kernel::ScatterElements {
            dtype: inputs[1].dtype,
            index_dtype: inputs[0].dtype,
            updates: inputs[1].shape.clone(),
            out: out_shape(),
            axis: *axis,
        },
        Op::TopK { axis, k, largest } => {
            let (outer, len, inner) = around_axis(&shape(), *axis);
            Kernel::TopK { dtype, outer, len, inner, k: *k, largest: *largest }
        }
        Op::GatherElements { axis } => Kernel::GatherElements {
            dtype,
            index_dtype: inputs[1].dtype,
            data: shape(),
            indices: inputs[1].shape.clone(),
            axis: *axis,
        },
        Op::Pad { begin, value, .. } => {
            Kernel::Pad { dtype, shape: shape(), begin: begin.clone(), out: out_shape(), value: *value }
        }
        Op::Triangle { upper, k } => Kernel::Triangle { dtype, shape: shape(), k: *k, upper: *upper },
        Op::CumSum { axis, exclusive, reverse } => {
            let (outer, len, inner) = around_axis(&shape(), *axis);
            Kernel::CumSum { dtype, outer, len, inner, exclusive: *exclusive, reverse: *reverse }
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let (outer, len, inner) = around_axis(&shape(), *axis);
            Kernel::Softmax { dtype, outer, len, inner, log: matches!(op, Op::LogSoftmax { .. }) }
        }
        Op::Attention { scale, mask, kv_block } | Op::AttentionGrad { scale, mask, kv_block } => {
            let operands = crate::shape_rules::attention_operands(matches!(op, Op::Attention { .. }), inputs);
            let dims = crate::shape_rules::attention_dims(inputs[0], inputs[1], inputs[2], operands, *kv_block).ok()?;
            let (scale, mask) = (*scale, *mask);
            match op {
                Op::Attention { .. } => Kernel::Attention { dtype, dims, scale, mask, generated: false },
                _ => Kernel::AttentionGrad { dtype, dims, scale, mask, generated: false },
            }
        }
        Op::LayerNorm { axis, eps } => {
            Kernel::LayerNorm { dtype, cols: product(&shape()[*axis..]), eps: *eps, bias: inputs.len() == 3 }
        }
        Op::RmsNorm { axis, eps } => Kernel::RmsNorm { dtype, cols: product(&shape()[*axis..]), eps: *eps },
        Op::Gelu { approx } => Kernel::Gelu { dtype, approx: *approx },
        Op::CrossEntropy { ignore_index, reduction } | Op::NllLoss { ignore_index, reduction } => {
            let s = shape();
            let dims = ClassLossDims {
                n: s[0],
                classes: s[1],
                inner: product(&s[2..]),
                ignore_index: *ignore_index,
                reduction: *reduction,
            };
            let (label_dtype, weighted) = (inputs[1].dtype, inputs.len() == 3);
            match op {
                Op::CrossEntropy { .. } => {
                    Kernel::CrossEntropy { dtype, label_dtype, dims, weighted, log_prob: outputs.len() == 2 }
                }
                _ => Kernel::NllLoss { dtype, label_dtype, dims, weighted },
            }
        }
    })
}
