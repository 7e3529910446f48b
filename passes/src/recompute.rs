//! Activation recomputation (`--recompute selective`): Megatron's selective recomputation of
//! core attention. The attention scores, their scaling and mask, the softmax and its 16-bit
//! copy are the largest activations a transformer layer keeps for its backward (`5as/h` of
//! Korthikanti et al.'s `sbh(34 + 5as/h)` bytes per layer) and among the cheapest to make again.
//! Each is recomputed in the backward from what is kept anyway (the queries and keys, which
//! the gradient of the score product needs), so the forward's copy dies after the forward's last
//! use.
//!
//! A core attention block is found from dataflow: a softmax whose probabilities (or their cast)
//! a matmul reads (the product with the values), walked back through elementwise ops, casts
//! and reshapes (scaling, masks, biases) to the matmul that made the scores. Its nodes are
//! cloned, in order, right before the first node after the probabilities' matmul that reads one
//! of their values (the backward); those nodes read the clones instead. The clones run the same
//! ops on the same inputs, so the gradients are bit-identical to the stored ones.
//!
//! It runs inside `fusion`, after its GEMM rewrites (whose e-graph would merge a clone with its
//! original) and before its scheduling, which keeps matmuls in order, so a clone's score product
//! stays where it was put and the rest of the clone after it. Any graph: one step, micro-batches
//! of `accumulate`, the chunks of a pipeline stage, on any mesh (core attention is split by
//! heads, with no communication inside). Tests: tests/recompute.rs.

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::{Def, Graph, NodeId, Op, ValueId};

/// What `--recompute` recomputes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Nothing: every activation the backward reads is kept.
    #[default]
    None,
    /// Core attention (Megatron's `--recompute-activations`).
    Selective,
}

/// One core attention block: its nodes in graph order (the score product first) and the
/// product of the probabilities with the values, which reads them last in the forward.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttentionBlock {
    pub nodes: Vec<NodeId>,
    pub probabilities_matmul: NodeId,
}

/// The most elementwise ops between the score product and the softmax.
const MAX_CHAIN: usize = 12;

/// The core attention blocks of `graph` whose values its backward reads.
pub fn attention_blocks(graph: &Graph) -> Vec<AttentionBlock> {
    let mut consumers: Vec<Vec<NodeId>> = vec![Vec::new(); graph.num_values()];
    for (id, node) in graph.nodes() {
        for &v in &node.inputs {
            consumers[v.index()].push(id);
        }
    }
    let producer = |v: ValueId| match graph.value(v).def {
        Def::Node(n, _) => Some(n),
        _ => None,
    };
    let is_constant = |v: ValueId| producer(v).is_some_and(|n| matches!(graph.node(n).op, Op::Constant { .. }));
    let mut blocks = Vec::new();
    for (softmax, node) in graph.nodes() {
        if !matches!(node.op, Op::Softmax { .. }) {
            continue;
        }
        // The probabilities, or their cast, read by a matmul.
        let probabilities = node.outputs[0];
        let mut after = Vec::new();
        let mut product = None;
        for &c in &consumers[probabilities.index()] {
            match &graph.node(c).op {
                Op::MatMul { .. } => product = product.or(Some(c)),
                Op::Cast { .. } => {
                    let cast_out = graph.node(c).outputs[0];
                    if let Some(&m) =
                        consumers[cast_out.index()].iter().find(|&&m| matches!(graph.node(m).op, Op::MatMul { .. }))
                    {
                        product = product.or(Some(m));
                        after.push(c);
                    }
                }
                _ => {}
            }
        }
        let Some(product) = product else { continue };
        // Back from the softmax's input to the score product.
        let mut chain = Vec::new();
        let mut v = node.inputs[0];
        let scores = loop {
            let Some(p) = producer(v) else { break None };
            let op = &graph.node(p).op;
            if matches!(op, Op::MatMul { .. }) {
                break Some(p);
            }
            if chain.len() == MAX_CHAIN
                || !matches!(op, Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Cast { .. } | Op::Reshape { .. })
            {
                break None;
            }
            chain.push(p);
            // Follow the largest computed input (the scores, not a mask or a bias).
            let inputs = &graph.node(p).inputs;
            let Some(&next) = inputs.iter().filter(|&&i| !is_constant(i)).max_by_key(|&&i| graph.ty(i).numel()) else {
                break None;
            };
            v = next;
        };
        let Some(scores) = scores else { continue };
        // The score product reads activations, not weights.
        if graph.node(scores).inputs.iter().any(|i| graph.params().contains(i)) {
            continue;
        }
        let mut nodes: Vec<NodeId> = std::iter::once(scores).chain(chain).chain([softmax]).chain(after).collect();
        nodes.sort();
        nodes.dedup();
        let inside: BTreeSet<NodeId> = nodes.iter().copied().collect();
        let read_later = nodes.iter().any(|&n| {
            graph
                .node(n)
                .outputs
                .iter()
                .any(|o| consumers[o.index()].iter().any(|&c| !inside.contains(&c) && c.index() > product.index()))
        });
        if read_later {
            blocks.push(AttentionBlock { nodes, probabilities_matmul: product });
        }
    }
    blocks
}

/// The elements of a block's attention probabilities (`a s^2 b` for heads `a`, sequence `s`,
/// batch `b`): its softmax's output.
pub fn probability_elements(graph: &Graph, block: &AttentionBlock) -> usize {
    (block.nodes.iter())
        .find(|&&n| matches!(graph.node(n).op, Op::Softmax { .. }))
        .map_or(0, |&n| graph.ty(graph.node(n).outputs[0]).numel())
}

/// The FLOPs of recomputing `blocks` once: `2mnk` per matmul, one per element otherwise.
pub fn flops(graph: &Graph, blocks: &[AttentionBlock]) -> u64 {
    let mut total = 0u64;
    for &n in blocks.iter().flat_map(|b| &b.nodes) {
        let node = graph.node(n);
        let out = graph.ty(node.outputs[0]);
        total += match node.op {
            Op::MatMul { transpose_lhs, .. } => {
                let lhs = graph.ty(node.inputs[0]);
                let k = lhs.shape[lhs.rank() - if transpose_lhs { 2 } else { 1 }];
                2 * out.numel() as u64 * k as u64
            }
            _ => out.numel() as u64,
        };
    }
    total
}

/// `graph` with every core attention block recomputed before its backward's first read.
pub fn recompute_attention(graph: &Graph) -> Graph {
    let blocks = attention_blocks(graph);
    if blocks.is_empty() {
        return graph.clone();
    }
    // Per block, the node before which it is recomputed: the first after the probabilities'
    // matmul that reads one of its values.
    let mut at: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
    for (b, block) in blocks.iter().enumerate() {
        let inside: BTreeSet<NodeId> = block.nodes.iter().copied().collect();
        let values: BTreeSet<ValueId> =
            block.nodes.iter().flat_map(|&n| graph.node(n).outputs.iter().copied()).collect();
        let first = graph
            .nodes()
            .filter(|(id, node)| {
                id.index() > block.probabilities_matmul.index()
                    && !inside.contains(id)
                    && node.inputs.iter().any(|i| values.contains(i))
            })
            .map(|(id, _)| id)
            .next()
            .expect("a block is recomputed for a later read");
        at.entry(first).or_default().push(b);
    }
    let mut rw = autotp_ir::Rewriter::new(graph, |_| true);
    // Old value -> its recomputed copy, which every read after the block's forward takes.
    let mut copies: BTreeMap<ValueId, ValueId> = BTreeMap::new();
    for (id, node) in graph.nodes() {
        for &b in at.get(&id).into_iter().flatten() {
            for &n in &blocks[b].nodes {
                let original = graph.node(n);
                let inputs =
                    original.inputs.iter().map(|i| copies.get(i).copied().unwrap_or_else(|| rw.map(*i))).collect();
                let types = original.outputs.iter().map(|&o| graph.ty(o).clone()).collect();
                let g = rw.graph();
                let clone = g.add_node_typed(original.op.clone(), inputs, types);
                for (&old, new) in original.outputs.iter().zip(g.node(clone).outputs.clone()) {
                    g.value_mut(new).placements = graph.value(old).placements.clone();
                    copies.insert(old, new);
                }
            }
        }
        if !node.inputs.iter().any(|i| copies.contains_key(i)) {
            rw.copy_node(id);
            continue;
        }
        let inputs = node.inputs.iter().map(|i| copies.get(i).copied().unwrap_or_else(|| rw.map(*i))).collect();
        let types = node.outputs.iter().map(|&o| graph.ty(o).clone()).collect();
        let g = rw.graph();
        let new = g.add_node_typed(node.op.clone(), inputs, types);
        let outputs = g.node(new).outputs.clone();
        for (&old, &new) in node.outputs.iter().zip(&outputs) {
            g.value_mut(new).name = graph.value(old).name.clone();
            g.value_mut(new).placements = graph.value(old).placements.clone();
        }
        for (&old, new) in node.outputs.iter().zip(outputs) {
            rw.set(old, new);
        }
    }
    rw.finish()
}
