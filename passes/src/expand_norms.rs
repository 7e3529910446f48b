//! `expand-norms`: a layer or RMS norm of a projection's output (OLMo 2's query and key norms,
//! over all heads at once) is written as the arithmetic it stands for, so that under tensor
//! parallelism the projection's features stay split: each rank sums the squares of its
//! features, one all-reduce completes the sum, and each rank normalises its own features. The
//! composite norm would need the features whole. Norms of the residual stream, of a block's
//! output on its way into it (Gemma 2's post-norms), and of a low-rank latent that another
//! projection reads (multi-head latent attention's `q_a_layernorm` and `kv_a_layernorm`, whose
//! down-projections stay whole on every rank) are left alone. A norm inside a block is
//! expanded too (BitNet's `attn_sub_norm` of the attention's output and `ffn_sub_norm` of the
//! gated unit, each before its row-parallel projection): made by attention or a product of
//! two activations, it reads the split features and feeds a projection.
//! Runs before autodiff, only under tensor parallelism. Tests: tests/golden/expand_norms*.ir.

use autotp_ir::{BinaryOp, Def, Graph, NodeId, Op, ReduceOp, Rewriter, Tensor, UnaryOp, ValueId};

use crate::{Pass, PassError};

const PASS: &str = "expand-norms";

pub struct ExpandNorms;

/// Whether `v` is a projection's output: a matmul with a parameter operand (or a view of
/// one), plus a bias parameter (not the residual stream: a sum of two activations).
fn is_projection(graph: &Graph, v: ValueId) -> bool {
    let Def::Node(n, 0) = graph.value(v).def else { return false };
    let node = graph.node(n);
    match node.op {
        Op::MatMul { .. } => node
            .inputs
            .iter()
            .any(|&i| (0..graph.ty(i).rank()).any(|d| crate::autotp::trace_param(graph, i, d).is_some())),
        Op::Binary(BinaryOp::Add) => {
            let [a, b] = [node.inputs[0], node.inputs[1]];
            let is_param = |v: ValueId| graph.params().contains(&v);
            (is_param(a) && is_projection(graph, b)) || (is_param(b) && is_projection(graph, a))
        }
        _ => false,
    }
}

/// Whether `v` is added to a value of its type that is not a parameter: a post-norm of a
/// block's output on its way into the residual stream (Gemma 2's), whose input is whole anyway.
fn feeds_residual(graph: &Graph, v: ValueId) -> bool {
    graph.nodes().any(|(_, n)| {
        matches!(n.op, Op::Binary(BinaryOp::Add))
            && n.inputs.contains(&v)
            && n.inputs.iter().any(|&o| o != v && !graph.params().contains(&o) && graph.ty(o) == graph.ty(v))
    })
}

/// Whether `v`, through reshapes, is the activation operand of a projection: the norm closes a
/// low-rank bottleneck (DeepSeek's latent attention), and its down-projection is replicated.
fn feeds_projection(graph: &Graph, consumers: &[Vec<NodeId>], v: ValueId) -> bool {
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        for n in consumers[v.index()].iter().map(|&c| graph.node(c)) {
            match n.op {
                Op::Reshape { .. } => stack.push(n.outputs[0]),
                Op::MatMul { .. } => {
                    let weight = n.inputs.iter().filter(|&&i| i != v);
                    if weight.into_iter().any(|&i| crate::autotp::trace_param(graph, i, 0).is_some()) {
                        return true;
                    }
                }
                _ => {}
            }
        }
    }
    false
}

/// Whether `v` is made inside a block from split features: by attention (fused, or a matmul
/// of two activations: the probabilities times the values), by a product of two activations
/// (a gated unit), or by reshapes, transposes, concats and sums of such values (a linear
/// attention's chunks). A residual sum adds a projection's output to the stream, and an
/// embedding is a gather: neither is. The patterns are shallow; the search stops at a depth of
/// `depth` nodes (a residual stream's chain of sums is as deep as the model).
fn made_inside_block(graph: &Graph, v: ValueId, depth: usize) -> bool {
    let is_activation = |v: ValueId| {
        !graph.params().contains(&v)
            && !matches!(graph.value(v).def, Def::Node(n, _) if matches!(graph.node(n).op, Op::Constant { .. }))
            && (0..graph.ty(v).rank()).all(|d| crate::autotp::trace_param(graph, v, d).is_none())
    };
    let Def::Node(n, _) = graph.value(v).def else { return false };
    let node = graph.node(n);
    let inside = |i: &ValueId| depth > 0 && made_inside_block(graph, *i, depth - 1);
    match node.op {
        Op::Reshape { .. } | Op::Transpose { .. } => inside(&node.inputs[0]),
        Op::Concat { .. } | Op::Binary(BinaryOp::Add) => node.inputs.iter().all(inside),
        Op::Attention { .. } => true,
        Op::MatMul { .. } | Op::Binary(BinaryOp::Mul) => node.inputs.iter().all(|&i| is_activation(i)),
        _ => false,
    }
}

impl Pass for ExpandNorms {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let consumers = graph.consumers();
        let expand: Vec<bool> = graph
            .nodes()
            .map(|(_, n)| {
                if !matches!(n.op, Op::LayerNorm { .. } | Op::RmsNorm { .. }) {
                    return false;
                }
                let feeds = feeds_projection(graph, &consumers, n.outputs[0]);
                let of_projection = is_projection(graph, n.inputs[0]) && !feeds_residual(graph, n.outputs[0]) && !feeds;
                let inside_block = feeds && made_inside_block(graph, n.inputs[0], 16);
                of_projection || inside_block
            })
            .collect();
        if !expand.contains(&true) {
            return Ok(());
        }
        let source = graph.clone();
        let mut rw = Rewriter::new(&source, |_| true);
        for (id, node) in source.nodes() {
            if !expand[id.index()] {
                rw.copy_node(id);
                continue;
            }
            let (axis, eps, centre) = match node.op {
                Op::LayerNorm { axis, eps } => (axis, eps, true),
                Op::RmsNorm { axis, eps } => (axis, eps, false),
                _ => unreachable!("only norms expand"),
            };
            let inputs: Vec<ValueId> = node.inputs.iter().map(|&v| rw.map(v)).collect();
            let ty = source.ty(node.inputs[0]).clone();
            let axes: Vec<usize> = (axis..ty.rank()).collect();
            let count: usize = ty.shape[axis..].iter().product();
            let g = rw.graph();
            let scalar = |g: &mut Graph, value: f64| {
                add(g, Op::Constant { value: Tensor::full(ty.dtype, vec![], value) }, vec![])
            };
            let mean = |g: &mut Graph, v: ValueId| -> Result<ValueId, PassError> {
                let sum = add(g, Op::Reduce { op: ReduceOp::Sum, axes: axes.clone(), keep_dims: true }, vec![v])?;
                let n = scalar(g, count as f64)?;
                add(g, Op::Binary(BinaryOp::Div), vec![sum, n])
            };
            let mut x = inputs[0];
            if centre {
                let m = mean(g, x)?;
                x = add(g, Op::Binary(BinaryOp::Sub), vec![x, m])?;
            }
            let square = add(g, Op::Binary(BinaryOp::Mul), vec![x, x])?;
            let variance = mean(g, square)?;
            let eps = scalar(g, eps)?;
            let shifted = add(g, Op::Binary(BinaryOp::Add), vec![variance, eps])?;
            let inverse = add(g, Op::Unary(UnaryOp::Rsqrt), vec![shifted])?;
            let normalised = add(g, Op::Binary(BinaryOp::Mul), vec![x, inverse])?;
            let mut y = add(g, Op::Binary(BinaryOp::Mul), vec![normalised, inputs[1]])?;
            if let Some(&bias) = inputs.get(2) {
                y = add(g, Op::Binary(BinaryOp::Add), vec![y, bias])?;
            }
            rw.set(node.outputs[0], y);
        }
        *graph = rw.finish();
        Ok(())
    }
}

fn add(g: &mut Graph, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
    crate::add_op(PASS, g, op, inputs)
}
