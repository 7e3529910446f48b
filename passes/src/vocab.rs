//! Vocabulary parallelism, part of `autotp`: the token embedding, the LM head and the
//! cross-entropy split over the vocabulary (Megatron's `VocabParallelEmbedding`, its
//! column-parallel output layer and `vocab_parallel_cross_entropy`), so no rank holds a whole
//! `[V, H]` table or a whole `[tokens, V]` logits tensor.
//!
//! Found from dataflow, as the blocks are: the loss's `cross_entropy` reads scores `[N, V]`
//! made (through reshapes) by a matmul with a parameter, the LM head, split on its `V` dim.
//! Every lookup (`gather` on axis 0) of a parameter with `V` rows by indices read from a graph
//! input is a token embedding (the head's own weight when they are tied), split on its rows.
//!
//! The sharding rules do the rest, with one rewrite here. A lookup in a split table gives
//! partial sums (each rank its rows, zeros for the others'), completed by one all-reduce; its
//! gradient, a scatter-add, computes each rank's rows only; the head's matmul gives logits
//! split over `V`. The cross-entropy, and the softmax its gradient takes of the same scores,
//! become ops whose rules keep `V` split: the row maximum as the maximum of each rank's block
//! maxima (an all-gather of `tp` numbers per row), `log(sum(exp(scores - max)))` as a partial
//! sum (an all-reduce of one number per row), the label's score picked with a one-hot whose
//! comparison runs on each rank's block of the class indices, and the softmax as
//! `exp(scores - max - lse)` from the same values.
//!
//! Tests: tests/golden/autotp_vocab.ir, tests/parallel.rs.

use std::collections::BTreeMap;

use autotp_ir::{BinaryOp, DType, Def, Graph, NodeId, Op, ReduceOp, Reduction, Rewriter, Tensor, UnaryOp, ValueId};

use crate::PassError;

/// What the vocabulary split found in a training step.
pub(crate) struct VocabSplit {
    /// The `cross_entropy` nodes whose classes are the vocabulary (one per micro-batch).
    pub losses: Vec<NodeId>,
    pub vocab: usize,
    /// The LM head's weight and its vocabulary dim.
    pub head: (ValueId, usize),
    /// Token embedding tables (split on dim 0); the head's weight among them when tied.
    pub embeddings: Vec<ValueId>,
}

fn producer(graph: &Graph, v: ValueId) -> Option<&autotp_ir::Node> {
    match graph.value(v).def {
        Def::Node(n, _) => Some(graph.node(n)),
        _ => None,
    }
}

/// `v` with the nodes it was made by that `peel` accepts peeled off.
fn source(graph: &Graph, mut v: ValueId, peel: fn(&Op) -> bool) -> ValueId {
    while let Some(node) = producer(graph, v).filter(|n| peel(&n.op)) {
        v = node.inputs[0];
    }
    v
}

fn reshape(op: &Op) -> bool {
    matches!(op, Op::Reshape { .. })
}

/// The ops between a lookup's ids and the step's input: reshapes, and the slice `accumulate`
/// and the pipeline take each micro-batch's ids by.
fn reshape_or_slice(op: &Op) -> bool {
    matches!(op, Op::Reshape { .. } | Op::Slice { .. })
}

/// The LM head of a `[N, V]` cross-entropy's scores: (weight, its vocabulary dim).
fn head_of(graph: &Graph, ce: &autotp_ir::Node) -> Option<(ValueId, usize)> {
    let scores = graph.ty(ce.inputs[0]);
    if ce.inputs.len() != 2 || scores.rank() != 2 {
        return None;
    }
    let matmul = producer(graph, source(graph, ce.inputs[0], reshape))?;
    let Op::MatMul { transpose_rhs, .. } = matmul.op else { return None };
    let weight = matmul.inputs[1];
    let out_dim = if transpose_rhs { graph.ty(weight).rank() - 2 } else { graph.ty(weight).rank() - 1 };
    let head = crate::autotp::trace_param(graph, weight, out_dim)?;
    (graph.ty(head.0).shape[head.1] == scores.shape[1]).then_some(head)
}

/// Finds the LM head and embeddings of the step's (unweighted, `[N, V]`) cross-entropies, all
/// made with one head.
pub(crate) fn find(graph: &Graph) -> Option<VocabSplit> {
    let losses: Vec<NodeId> =
        graph.nodes().filter(|(_, n)| matches!(n.op, Op::CrossEntropy { .. })).map(|(id, _)| id).collect();
    let heads: Vec<Option<(ValueId, usize)>> = losses.iter().map(|&id| head_of(graph, graph.node(id))).collect();
    let head = (*heads.first()?)?;
    if heads.iter().any(|&h| h != Some(head)) {
        return None;
    }
    let vocab = graph.ty(head.0).shape[head.1];
    let mut embeddings = Vec::new();
    for (_, n) in graph.nodes() {
        let (Op::Gather { axis: 0 }, [table, ids]) = (&n.op, &n.inputs[..]) else { continue };
        let by_input = graph.inputs().contains(&source(graph, *ids, reshape_or_slice));
        let vocab_rows = graph.params().contains(table) && graph.ty(*table).shape[0] == vocab;
        if by_input && vocab_rows && !embeddings.contains(table) {
            embeddings.push(*table);
        }
    }
    Some(VocabSplit { losses, vocab, head, embeddings })
}

fn add(g: &mut Graph, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
    crate::add_op("autotp", g, op, inputs)
}

fn constant(g: &mut Graph, dtype: DType, value: f64) -> Result<ValueId, PassError> {
    add(g, Op::Constant { value: Tensor::full(dtype, vec![], value) }, vec![])
}

fn reduce(g: &mut Graph, op: ReduceOp, x: ValueId, axes: Vec<usize>, keep_dims: bool) -> Result<ValueId, PassError> {
    add(g, Op::Reduce { op, axes, keep_dims }, vec![x])
}

fn binary(g: &mut Graph, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
    add(g, Op::Binary(op), vec![a, b])
}

/// The shifted scores `z = scores - max` and `lse = log(sum(exp(z)))` per row, `[N, 1]`.
struct LogSumExp {
    shifted: ValueId,
    lse: ValueId,
}

/// Rewrites the loss's cross-entropies (and the softmax of their scores in the gradient) into
/// ops that keep the vocabulary split over `tp` ranks.
pub(crate) fn split_cross_entropy(graph: &Graph, split: &VocabSplit, tp: usize) -> Result<Graph, PassError> {
    let mut rw = Rewriter::new(graph, |_| true);
    // Scores -> their shifted values and log-sum-exp, once their cross-entropy is rewritten.
    let mut made: BTreeMap<ValueId, LogSumExp> = BTreeMap::new();
    for (id, node) in graph.nodes() {
        let of_split_scores = node.inputs.first().and_then(|scores| made.get(scores));
        if let (Op::Softmax { axis: 1 }, Some(lse)) = (&node.op, of_split_scores) {
            let g = rw.graph();
            let logp = binary(g, BinaryOp::Sub, lse.shifted, lse.lse)?;
            let p = add(g, Op::Unary(UnaryOp::Exp), vec![logp])?;
            rw.set(node.outputs[0], p);
        } else if split.losses.contains(&id) {
            let lse = split_one(&mut rw, node, split.vocab, tp)?;
            made.insert(node.inputs[0], lse);
        } else {
            rw.copy_node(id);
        }
    }
    Ok(rw.finish())
}

/// Rewrites one cross-entropy node; returns its scores' shifted values and log-sum-exp.
fn split_one(rw: &mut Rewriter, ce: &autotp_ir::Node, vocab: usize, tp: usize) -> Result<LogSumExp, PassError> {
    let Op::CrossEntropy { ignore_index, reduction } = ce.op else { unreachable!("found as a cross_entropy") };
    let (s, l) = (rw.map(ce.inputs[0]), rw.map(ce.inputs[1]));
    let g = rw.graph();
    let n = g.ty(s).shape[0];
    let dtype = g.ty(s).dtype;
    let label_dtype = g.ty(l).dtype;
    // The row maximum: each rank's block maximum, then the maximum of those.
    let blocks = add(g, Op::Reshape { shape: vec![n, tp, vocab / tp] }, vec![s])?;
    let block_max = reduce(g, ReduceOp::Max, blocks, vec![2], false)?;
    let max = reduce(g, ReduceOp::Max, block_max, vec![1], true)?;
    let shifted = binary(g, BinaryOp::Sub, s, max)?;
    let e = add(g, Op::Unary(UnaryOp::Exp), vec![shifted])?;
    let sum = reduce(g, ReduceOp::Sum, e, vec![1], true)?;
    let lse = add(g, Op::Unary(UnaryOp::Log), vec![sum])?;
    // Labels to pick with (ignored positions point at class 0 and are masked below).
    let valid = match ignore_index {
        Some(ignored) => {
            let ignored = constant(g, label_dtype, ignored as f64)?;
            let is_ignored = binary(g, BinaryOp::Equal, l, ignored)?;
            Some(add(g, Op::Unary(UnaryOp::Not), vec![is_ignored])?)
        }
        None => None,
    };
    let safe = match valid {
        Some(valid) => {
            let zero = constant(g, label_dtype, 0.0)?;
            add(g, Op::Select, vec![valid, l, zero])?
        }
        None => l,
    };
    let column = add(g, Op::Reshape { shape: vec![n, 1] }, vec![safe])?;
    let classes: Vec<i64> = (0..vocab as i64).collect();
    let mut iota = add(g, Op::Constant { value: Tensor::from_i64(vec![1, vocab], &classes) }, vec![])?;
    if label_dtype != DType::I64 {
        iota = add(g, Op::Cast { to: label_dtype }, vec![iota])?;
    }
    let hot = binary(g, BinaryOp::Equal, iota, column)?;
    let onehot = add(g, Op::Cast { to: dtype }, vec![hot])?;
    let at_label = binary(g, BinaryOp::Mul, shifted, onehot)?;
    let picked = reduce(g, ReduceOp::Sum, at_label, vec![1], true)?;
    let mut nll = binary(g, BinaryOp::Sub, lse, picked)?;
    let counted = match valid {
        Some(valid) => {
            let valid = add(g, Op::Reshape { shape: vec![n, 1] }, vec![valid])?;
            let counted = add(g, Op::Cast { to: dtype }, vec![valid])?;
            nll = binary(g, BinaryOp::Mul, nll, counted)?;
            Some(counted)
        }
        None => None,
    };
    let loss = match reduction {
        Reduction::None => add(g, Op::Reshape { shape: vec![n] }, vec![nll])?,
        Reduction::Sum => reduce(g, ReduceOp::Sum, nll, vec![0, 1], false)?,
        Reduction::Mean => {
            let total = reduce(g, ReduceOp::Sum, nll, vec![0, 1], false)?;
            let count = match counted {
                Some(counted) => reduce(g, ReduceOp::Sum, counted, vec![0, 1], false)?,
                None => constant(g, dtype, n as f64)?,
            };
            binary(g, BinaryOp::Div, total, count)?
        }
    };
    rw.set(ce.outputs[0], loss);
    if let Some(&log_probs) = ce.outputs.get(1) {
        let lp = binary(rw.graph(), BinaryOp::Sub, shifted, lse)?;
        rw.set(log_probs, lp);
    }
    Ok(LogSumExp { shifted, lse })
}
