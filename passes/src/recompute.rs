//! Activation recomputation (`--recompute`): forward nodes cloned right before their backward
//! first reads them, so the forward's copies die after the forward's last use. The clones run
//! the same ops on the same inputs, so the gradients are bit-identical to the stored ones.
//!
//! - `selective`: Megatron's selective recomputation of core attention. The attention scores,
//!   their scaling and mask, the softmax and its 16-bit copy are the largest activations a
//!   transformer layer keeps for its backward (`5as/h` of Korthikanti et al.'s `sbh(34 + 5as/h)`
//!   bytes per layer) and among the cheapest to make again, from what is kept anyway (the
//!   queries and keys, which the gradient of the score product needs). A core attention block is
//!   found from dataflow: a softmax whose probabilities (or their cast) a matmul reads (the
//!   product with the values), walked back through elementwise ops, casts and reshapes
//!   (scaling, masks, biases) to the matmul that made the scores.
//! - `elementwise`: elementwise ops (activation functions, casts, bias adds, scalings) whose
//!   inputs the backward keeps anyway: their outputs are made again from them right before the
//!   backward first reads them, for one FLOP per element (as the min-cut rematerialization of
//!   `torch.compile` and Megatron's recomputed activation functions do). A GELU's output, which
//!   the next projection's weight gradient reads, is made again from its input, which the
//!   GELU's own gradient reads; a 16-bit copy from the f32 value it was cast from. The cheapest
//!   step of `auto`.
//! - `full`: Megatron's full recomputation: only each layer's input is kept, and the whole layer
//!   runs again before its backward (`--recompute-layers K`: the first K layers of each stage
//!   only, Megatron's block method). A layer is found from dataflow and parameter names: the
//!   forward is cut where at most one activation is live ([`crate::pipeline`]'s cuts), and the
//!   consecutive pieces whose nodes read the parameters of one numbered layer
//!   ([`crate::pipeline::numbered_layers`]) are that layer. Its collectives run again (tp's
//!   all-reduces; ZeRO-3 gathers its weights again, as DeepSpeed does), in the same order on
//!   every rank.
//!
//! It runs inside `fusion`, after its GEMM rewrites (whose e-graph would merge a clone with its
//! original) and before its scheduling, which is told not to start a clone before the node it
//! was put in front of (it would otherwise fuse a recomputed norm with the forward's). Any graph:
//! one step, micro-batches of `accumulate`, the chunks of a pipeline stage, on any mesh. Tests:
//! tests/recompute.rs.

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::{Def, Graph, NodeId, Op, ValueId};

/// What `--recompute` recomputes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Nothing: every activation the backward reads is kept.
    #[default]
    None,
    /// Elementwise ops whose inputs the backward keeps anyway.
    Elementwise,
    /// Core attention (Megatron's `--recompute-activations`).
    Selective,
    /// Whole layers from their inputs (Megatron's `--recompute-granularity full`): every layer,
    /// or the first `layers` of each stage.
    Full { layers: Option<usize> },
}

/// Forward nodes recomputed in the backward: cloned in order right before `at`, the first node
/// outside the forward that reads one of `redirected`; from `at` on, every read of a
/// redirected value takes its clone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub nodes: Vec<NodeId>,
    pub redirected: BTreeSet<ValueId>,
    pub at: NodeId,
    /// Backward nodes that read what the block keeps (a norm's gradient reads the layer's
    /// input): scheduled no earlier than the clones, not fused into the forward, where their
    /// outputs would live until the backward.
    pub held: BTreeSet<NodeId>,
    pub what: Recomputed,
}

/// What a [`Block`] is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recomputed {
    /// One elementwise op, with the elements it makes.
    Elementwise { elements: usize },
    /// Core attention, with the elements of its probabilities (`a s^2 b`).
    Attention { probability_elements: usize },
    /// A layer (by its number), from its input (what is kept of it).
    Layer { number: u64, input: Option<ValueId> },
}

/// One core attention block: its nodes in graph order (the score product first) and the
/// product of the probabilities with the values, which reads them last in the forward.
struct AttentionBlock {
    nodes: Vec<NodeId>,
    probabilities_matmul: NodeId,
}

/// The most elementwise ops between the score product and the softmax.
const MAX_CHAIN: usize = 12;

/// The core attention blocks of `graph` whose values its backward reads.
fn attention_blocks(graph: &Graph, consumers: &[Vec<NodeId>]) -> Vec<AttentionBlock> {
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
fn probability_elements(graph: &Graph, block: &AttentionBlock) -> usize {
    (block.nodes.iter())
        .find(|&&n| matches!(graph.node(n).op, Op::Softmax { .. }))
        .map_or(0, |&n| graph.ty(graph.node(n).outputs[0]).numel())
}

/// The FLOPs of recomputing `blocks` once: `2mnk` per matmul, none for collectives and
/// reshapes, one per element otherwise.
pub fn flops(graph: &Graph, blocks: &[Block]) -> u64 {
    let mut total = 0u64;
    for &n in blocks.iter().flat_map(|b| &b.nodes) {
        let node = graph.node(n);
        let out = graph.ty(node.outputs[0]);
        total += match node.op {
            Op::Collective { .. } | Op::Wait | Op::Reshape { .. } => 0,
            _ => crate::pipeline::matmul_flops(graph, node).unwrap_or(out.numel() as u64),
        };
    }
    total
}

/// What `mode` recomputes in `graph`.
pub fn blocks(graph: &Graph, mode: Recompute) -> Vec<Block> {
    match mode {
        Recompute::None => Vec::new(),
        Recompute::Selective => {
            let consumers = graph.consumers();
            attention_blocks(graph, &consumers).iter().map(|block| attention_block(graph, block, &consumers)).collect()
        }
        Recompute::Elementwise => elementwise_blocks(graph),
        Recompute::Full { layers } => layer_blocks(graph, layers),
    }
}

/// The forward's elementwise ops whose output the backward reads, each made again (with the
/// elementwise ops and reshapes it is made of) from values the backward keeps anyway:
/// parameters, the batch, constants, or values a backward node at or after the first one
/// reading the output reads too. A block reading what another redirects stays as it is (its
/// clone would read the original, keeping it alive).
fn elementwise_blocks(graph: &Graph) -> Vec<Block> {
    let consumers = graph.consumers();
    let mut is_forward = vec![false; graph.num_nodes()];
    for i in crate::pipeline::forward_nodes(graph) {
        is_forward[i] = true;
    }
    let producer = |v: ValueId| match graph.value(v).def {
        Def::Node(n, _) => Some(n),
        _ => None,
    };
    let is_data = |v: ValueId| producer(v).is_none_or(|n| matches!(graph.node(n).op, Op::Constant { .. }));
    let elementwise =
        |op: &Op| matches!(op, Op::Unary(_) | Op::Binary(_) | Op::Gelu { .. } | Op::Cast { .. } | Op::Select);
    let mut candidates: Vec<Block> = Vec::new();
    for (id, node) in graph.nodes() {
        let recomputable = elementwise(&node.op) || matches!(node.op, Op::Reshape { .. });
        if !is_forward[id.index()] || !recomputable || node.outputs.len() != 1 {
            continue;
        }
        let output = node.outputs[0];
        let Some(&at) = consumers[output.index()].iter().filter(|c| !is_forward[c.index()]).min() else { continue };
        let kept = |v: ValueId| is_data(v) || consumers[v.index()].iter().any(|&c| !is_forward[c.index()] && c >= at);
        // Back from the output through elementwise ops and reshapes to kept values.
        let mut nodes = BTreeSet::from([id]);
        let mut open = vec![id];
        let mut complete = true;
        while let Some(n) = open.pop() {
            for &v in &graph.node(n).inputs {
                if kept(v) {
                    continue;
                }
                match producer(v).filter(|&p| is_forward[p.index()]) {
                    Some(p) if elementwise(&graph.node(p).op) || matches!(graph.node(p).op, Op::Reshape { .. }) => {
                        if nodes.insert(p) {
                            open.push(p);
                        }
                    }
                    _ => complete = false,
                }
            }
            if !complete || nodes.len() > MAX_CHAIN {
                complete = false;
                break;
            }
        }
        // A reshape of a kept value is its bytes: nothing to save.
        let computes = nodes.iter().any(|&n| elementwise(&graph.node(n).op));
        if !complete || !computes || graph.ty(output).numel() < 2 {
            continue;
        }
        let what = Recomputed::Elementwise { elements: graph.ty(output).numel() };
        let nodes = nodes.into_iter().collect();
        candidates.push(Block { nodes, redirected: BTreeSet::from([output]), at, held: BTreeSet::new(), what });
    }
    let redirected: BTreeSet<ValueId> = candidates.iter().flat_map(|b| b.redirected.iter().copied()).collect();
    candidates.retain(|b| {
        let made: BTreeSet<ValueId> = b.nodes.iter().flat_map(|&n| graph.node(n).outputs.iter().copied()).collect();
        let mut reads = b.nodes.iter().flat_map(|&n| graph.node(n).inputs.iter());
        !reads.any(|v| redirected.contains(v) && !made.contains(v))
    });
    candidates
}

/// `graph` with what `mode` recomputes recomputed, and per node of the result the earliest
/// position (in the result's order) a schedule may run it at: a clone's is the block's first.
pub fn recompute(graph: &Graph, mode: Recompute) -> (Graph, Vec<usize>) {
    apply(graph, &blocks(graph, mode))
}

/// A core attention block as a [`Block`]: every value it makes redirected, from the first node
/// after the probabilities' matmul that reads one of them.
fn attention_block(graph: &Graph, block: &AttentionBlock, consumers: &[Vec<NodeId>]) -> Block {
    let inside: BTreeSet<NodeId> = block.nodes.iter().copied().collect();
    let redirected: BTreeSet<ValueId> =
        block.nodes.iter().flat_map(|&n| graph.node(n).outputs.iter().copied()).collect();
    let at = (redirected.iter().flat_map(|v| &consumers[v.index()]))
        .filter(|&&c| c > block.probabilities_matmul && !inside.contains(&c))
        .min()
        .copied()
        .expect("a block is recomputed for a later read");
    let what = Recomputed::Attention { probability_elements: probability_elements(graph, block) };
    Block { nodes: block.nodes.clone(), redirected, at, held: BTreeSet::new(), what }
}

/// The layers of `graph`'s forward passes (one per micro-batch and layer), each recomputed from
/// its input before its backward; `first`: only those of the first `first` layer numbers.
fn layer_blocks(graph: &Graph, first: Option<usize>) -> Vec<Block> {
    let Some(numbered) = crate::pipeline::numbered_layers(graph) else { return Vec::new() };
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let activation = crate::pipeline::activations(graph);
    let forward = crate::pipeline::forward_nodes(graph);
    let mut is_forward = vec![false; nodes.len()];
    for &i in &forward {
        is_forward[i] = true;
    }
    // The layer of each value computed from one layer's parameters alone, and of each forward
    // node that computes on activations with them.
    let mut layer_of: Vec<Option<u64>> = vec![None; graph.num_values()];
    for &p in graph.params() {
        layer_of[p.index()] = graph.name_of(p).and_then(|name| numbered.number_of(name));
    }
    let mut node_layer: Vec<Option<u64>> = vec![None; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        let layer = node.inputs.iter().find_map(|v| layer_of[v.index()]);
        if node.inputs.iter().any(|v| activation[v.index()]) {
            node_layer[i] = layer;
        } else {
            for o in &node.outputs {
                layer_of[o.index()] = layer;
            }
        }
    }
    // Cuts: forward positions before which at most one activation is live. Those computed from
    // the batch without parameters (a micro-batch's slice of the labels, a mask) do not count:
    // a clone reads them as they are; nor do scalars (a micro-batch's loss, kept for the sum
    // after the last).
    let mut weighted = vec![false; graph.num_values()];
    for &p in graph.params() {
        weighted[p.index()] = true;
    }
    let mut computed = vec![false; graph.num_values()];
    for (_, node) in graph.nodes() {
        let received = matches!(node.op, Op::Recv { .. });
        let any = received || node.inputs.iter().any(|v| weighted[v.index()]);
        for &o in &node.outputs {
            weighted[o.index()] = any;
            computed[o.index()] = any && activation[o.index()] && graph.ty(o).rank() > 0;
        }
    }
    let mut cuts: Vec<usize> =
        crate::pipeline::single_activation_cuts(&nodes, &forward, &computed).into_iter().map(|(k, _)| k).collect();
    cuts.push(forward.len());
    // Layers: runs of pieces between cuts whose nodes use one layer's parameters, and the
    // pieces between them that compute on activations without parameters and pass no messages
    // (a residual add after tp's all-reduce), or compute on parameters alone (ZeRO-3's waits).
    struct Layer {
        number: u64,
        start: usize,
        end: usize,
    }
    let plain = |i: usize| {
        let inputs = &nodes[i].inputs;
        !matches!(nodes[i].op, Op::Send { .. } | Op::Recv { .. })
            && (!inputs.iter().any(|v| activation[v.index()])
                || !inputs.iter().any(|v| weighted[v.index()] && !activation[v.index()]))
    };
    let mut layers: Vec<Layer> = Vec::new();
    let mut open: Option<Layer> = None;
    for pair in cuts.windows(2) {
        let (start, end) = (pair[0], pair[1]);
        let numbers: BTreeSet<u64> = forward[start..end].iter().filter_map(|&i| node_layer[i]).collect();
        let single = (numbers.len() == 1).then(|| *numbers.first().unwrap());
        match (&mut open, single) {
            (Some(layer), Some(number)) if layer.number == number => layer.end = end,
            (Some(_), None) if numbers.is_empty() && forward[start..end].iter().all(|&i| plain(i)) => {}
            (_, single) => {
                layers.extend(open.take());
                open = single.map(|number| Layer { number, start, end });
            }
        }
    }
    layers.extend(open);
    let mut numbers: Vec<u64> = layers.iter().map(|l| l.number).collect();
    numbers.sort();
    numbers.dedup();
    numbers.truncate(first.unwrap_or(usize::MAX));
    let consumers = graph.consumers();
    layers
        .iter()
        .filter(|layer| numbers.contains(&layer.number))
        .filter_map(|layer| {
            let block: Vec<usize> = forward[layer.start..layer.end].to_vec();
            let inside: BTreeSet<NodeId> = block.iter().map(|&i| NodeId(i as u32)).collect();
            let read_outside_forward = |v: ValueId, forward: bool| {
                consumers[v.index()].iter().any(|c| is_forward[c.index()] == forward && !inside.contains(c))
            };
            // What the backward reads of the layer, but not what later forward nodes read too
            // (the layer's output, which the next layer keeps, a rotary table made here).
            let redirected: BTreeSet<ValueId> = (block.iter().flat_map(|&i| nodes[i].outputs.iter().copied()))
                .filter(|&v| read_outside_forward(v, false) && !read_outside_forward(v, true))
                .collect();
            let at = (redirected.iter().flat_map(|v| &consumers[v.index()]))
                .filter(|c| !is_forward[c.index()])
                .min()
                .copied()?;
            if at.index() <= *block.last()? {
                return None;
            }
            // The layer's nodes that computing the redirected values needs; a wait's need is the
            // collective's operand (the clone runs it synchronously).
            let mut needed: BTreeSet<ValueId> = redirected.clone();
            let mut clones = Vec::new();
            for &i in block.iter().rev() {
                let node = nodes[i];
                // Constants are data; a received activation is kept (receiving it again would
                // take the next message).
                let kept = matches!(node.op, Op::Constant { .. } | Op::Recv { .. });
                if kept || !node.outputs.iter().any(|o| needed.contains(o)) {
                    continue;
                }
                clones.push(NodeId(i as u32));
                needed.extend(match node.op {
                    Op::Wait => collective_start(graph, node).inputs.clone(),
                    _ => node.inputs.clone(),
                });
            }
            clones.reverse();
            // What is kept of the layer: the largest activation its clones read but do not make.
            let made: BTreeSet<ValueId> = clones.iter().flat_map(|&n| graph.node(n).outputs.iter().copied()).collect();
            let kept: BTreeSet<ValueId> = (clones.iter().flat_map(|&n| graph.node(n).inputs.iter().copied()))
                .filter(|v| activation[v.index()] && !made.contains(v))
                .collect();
            let input = kept.iter().copied().max_by_key(|&v| (graph.ty(v).numel(), std::cmp::Reverse(v)));
            let held = (kept.iter().flat_map(|v| &consumers[v.index()]))
                .filter(|c| !is_forward[c.index()] && **c > at)
                .copied()
                .collect();
            let what = Recomputed::Layer { number: layer.number, input };
            Some(Block { nodes: clones, redirected, at, held, what })
        })
        .collect()
}

/// The start of the asynchronous collective a wait completes.
fn collective_start<'g>(graph: &'g Graph, wait: &autotp_ir::Node) -> &'g autotp_ir::Node {
    let Def::Node(start, _) = graph.value(wait.inputs[0]).def else { unreachable!("a wait reads a start") };
    graph.node(start)
}

/// `graph` with `blocks` recomputed (see [`recompute`]).
fn apply(graph: &Graph, blocks: &[Block]) -> (Graph, Vec<usize>) {
    if blocks.is_empty() {
        return (graph.clone(), vec![0; graph.num_nodes()]);
    }
    let mut at: BTreeMap<NodeId, Vec<&Block>> = BTreeMap::new();
    for block in blocks {
        at.entry(block.at).or_default().push(block);
    }
    let mut held: BTreeMap<NodeId, &Block> = BTreeMap::new();
    for block in blocks {
        held.extend(block.held.iter().map(|&n| (n, block)));
    }
    let mut rw = autotp_ir::Rewriter::new(graph, |_| true);
    let mut earliest = Vec::new();
    // The position of each block's first clone, once placed.
    let mut placed: BTreeMap<NodeId, usize> = BTreeMap::new();
    // Old value -> its recomputed copy, which every read from the block's `at` on takes.
    let mut copies: BTreeMap<ValueId, ValueId> = BTreeMap::new();
    for (id, node) in graph.nodes() {
        for block in at.get(&id).into_iter().flatten() {
            let first = rw.graph().num_nodes();
            let mut cloned: BTreeMap<ValueId, ValueId> = BTreeMap::new();
            for &n in &block.nodes {
                let original = graph.node(n);
                let (op, inputs) = match &original.op {
                    Op::Wait => {
                        let start = collective_start(graph, original);
                        let Op::Collective { kind, axis, .. } = &start.op else {
                            unreachable!("a wait completes a collective, not {}", start.op.name())
                        };
                        (Op::Collective { kind: *kind, axis: axis.clone(), start: false }, &start.inputs)
                    }
                    op => (op.clone(), &original.inputs),
                };
                let inputs = inputs.iter().map(|i| cloned.get(i).copied().unwrap_or_else(|| rw.map(*i))).collect();
                let types = original.outputs.iter().map(|&o| graph.ty(o).clone()).collect();
                let g = rw.graph();
                let clone = g.add_node_typed(op, inputs, types);
                for (&old, new) in original.outputs.iter().zip(g.node(clone).outputs.clone()) {
                    g.value_mut(new).placements = graph.value(old).placements.clone();
                    cloned.insert(old, new);
                }
            }
            let made = rw.graph().num_nodes() - first;
            earliest.extend(std::iter::repeat_n(first, made));
            placed.insert(block.at, first);
            copies.extend(cloned.into_iter().filter(|(old, _)| block.redirected.contains(old)));
        }
        earliest.push(held.get(&id).and_then(|b| placed.get(&b.at)).copied().unwrap_or(0));
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
    (rw.finish(), earliest)
}
