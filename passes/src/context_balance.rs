//! Megatron's load balance for context parallelism (`--cp N`, attention over all-gathered keys
//! and values), part of the `cp-balance` compile step. Under a causal mask a query late in the
//! sequence meets more keys than an early one: with contiguous blocks the last of N ranks does
//! about 2N-1 times the first's attention work. The sequence is cut into 2N chunks instead, and
//! rank r holds chunks r and 2N-1-r ([`SequenceOrder::LoadBalanced`]).
//!
//! The graph computes its sequences in that order: the trainer feeds the token inputs arranged
//! so, each rank's contiguous block is then its two chunks, and every collective, block and
//! checkpoint stays as it is. This pass, on the placed graph, makes right what the order
//! changes:
//! - a position table (a value no step input reaches, sliced over cp along a dim of the
//!   sequence's length: rotary tables, learned positions' indices) is arranged in the order
//!   before its slice; one that is the same all along the dim is left alone;
//! - attention's query runs (2N of them, from the `attention` pass) get their chunks' first
//!   positions in the order;
//! - keys and values all-gathered over cp are put back in position order for attention, and
//!   their gradients in the balanced order before they are reduced over cp.
//!
//! The rest of the graph does not see the order: what runs on sequence shards over cp
//! (elementwise ops, norms, projections, lookups) treats each position alike, and a sum over
//! the sequence does not depend on it. A graph in which something else would see it (a value
//! of the sequence all-gathered over cp for anything but attention: a model that shifts its
//! labels itself, a convolution over time) keeps the natural order, and [`load_balance`] says
//! why.
//!
//! Tests: tests/golden/context_balance.ir, tests/context_parallel.rs.

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::{Collective, Def, Graph, NodeId, Op, Placement, Rewriter, Tensor, ValueId, CONTEXT_AXIS};
use autotp_program::step::SequenceOrder;

use crate::PassError;

/// The graph rewritten to compute its sequences of `seq_len` in the load-balanced order of its
/// cp axis, or why it keeps the natural order (`Err`: the graph is then right as it is). A
/// graph without a cp axis is returned as it is.
pub fn load_balance(graph: &Graph, seq_len: usize) -> Result<Result<Graph, String>, PassError> {
    let Some(axis) = graph.mesh.axes.iter().position(|a| a.name == CONTEXT_AXIS) else {
        return Ok(Ok(graph.clone()));
    };
    let cp = graph.mesh.axes[axis].size;
    let order = SequenceOrder::LoadBalanced { cp };
    let Some(positions) = order.positions(seq_len) else {
        return Ok(Err(format!("the sequence of {seq_len} tokens does not cut into 2 x cp = {} chunks", 2 * cp)));
    };
    let chunk_order = order.positions(2 * cp).expect("2 cp chunks of one");
    let rewrites = match Rewrites::find(graph, axis, seq_len, &positions, &chunk_order) {
        Ok(rewrites) => rewrites,
        Err(why) => return Ok(Err(why)),
    };
    let mut in_position_order = vec![0; seq_len];
    for (slot, &p) in positions.iter().enumerate() {
        in_position_order[p] = slot;
    }
    rewrites.apply(graph, &positions, &in_position_order).map(Ok)
}

/// [`load_balance`] as a pass that refuses a graph it cannot balance (for golden files; the
/// compile keeps such a graph in the natural order and says why).
pub struct LoadBalance {
    pub seq_len: usize,
}

impl crate::Pass for LoadBalance {
    fn name(&self) -> &'static str {
        "cp-balance"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        *graph =
            load_balance(graph, self.seq_len)?.map_err(|message| PassError::Invalid { pass: "cp-balance", message })?;
        Ok(())
    }
}

/// What the order changes in one graph.
struct Rewrites {
    /// `shard_slice` nodes over cp whose operand is arranged first: the gather's index (a
    /// slot's position) along the slice's dim.
    arranged_slices: BTreeMap<NodeId, (usize, Vec<usize>)>,
    /// Keys and values gathered over cp, by the node that makes them: the value and its
    /// sequence dim, put back in position order.
    gathered_keys: BTreeMap<NodeId, (ValueId, usize)>,
    /// Attention backwards whose key and value gradients are arranged in the order.
    key_gradients: BTreeSet<NodeId>,
}

impl Rewrites {
    fn find(
        graph: &Graph,
        axis: usize,
        seq_len: usize,
        positions: &[usize],
        chunk_order: &[usize],
    ) -> Result<Rewrites, String> {
        let cp_name = &graph.mesh.axes[axis].name;
        let consumers = graph.consumers();
        let reaches_input = reaches_step_input(graph);
        let carries = carries_sequence(graph, axis);
        let named = |v: ValueId| match (graph.name_of(v), graph.value(v).def) {
            (Some(name), _) => format!("%{name}"),
            (None, Def::Node(n, _)) => format!("the {} of node {}", graph.node(n).op.name(), n.index()),
            (None, _) => "a value".to_string(),
        };
        let mut rewrites = Rewrites {
            arranged_slices: BTreeMap::new(),
            gathered_keys: BTreeMap::new(),
            key_gradients: BTreeSet::new(),
        };
        for (id, node) in graph.nodes() {
            let Op::Collective { kind, axis: on, start } = &node.op else { continue };
            if on != cp_name {
                continue;
            }
            let x = node.inputs[0];
            match *kind {
                Collective::ShardSlice { dim } => {
                    if reaches_input[x.index()] || uniform_along(graph, x, dim, 0) {
                        continue;
                    }
                    let rows = graph.ty(x).shape[dim];
                    let index = if starts_only(graph, &consumers, node.outputs[0]) && rows == chunk_order.len() {
                        chunk_order.to_vec()
                    } else if rows == seq_len {
                        positions.to_vec()
                    } else {
                        return Err(format!(
                            "{} (node {}) slices {} over cp along a dim of {rows}, which is not a sequence of {seq_len}",
                            node.op.name(),
                            id.index(),
                            named(x)
                        ));
                    };
                    rewrites.arranged_slices.insert(id, (dim, index));
                }
                Collective::AllGather { dim } => {
                    let (maker, gathered) = match start {
                        true => match waited(graph, &consumers, node.outputs[0]) {
                            Some(wait) => (wait, graph.node(wait).outputs[0]),
                            None => return Err(format!("all_gather_start (node {}) has no wait", id.index())),
                        },
                        false => (id, node.outputs[0]),
                    };
                    let keys = read_as_keys(graph, &consumers, gathered) && graph.ty(gathered).shape[dim] == seq_len;
                    if keys && carries[x.index()] {
                        rewrites.gathered_keys.insert(maker, (gathered, dim));
                    } else if carries[x.index()] {
                        let reader = consumers[gathered.index()].first().map(|&n| graph.node(n).op.name());
                        return Err(format!(
                            "all_gather (node {}) gathers {} over cp for {}, which would see the sequence in the \
                             balanced order",
                            id.index(),
                            named(x),
                            reader.unwrap_or_else(|| "an output".into())
                        ));
                    }
                }
                Collective::AllToAll { .. } | Collective::RingShift { .. } => {
                    return Err(format!("{} (node {}) exchanges {} over cp", node.op.name(), id.index(), named(x)));
                }
                Collective::AllReduce | Collective::ReduceScatter { .. } => {}
            }
        }
        for (id, node) in graph.nodes() {
            let (Op::Attention { mask, .. } | Op::AttentionGrad { mask, .. }) = &node.op else { continue };
            if graph.value(node.inputs[0]).placements[axis] == Placement::Replicate {
                continue;
            }
            let key_maker = |v: ValueId| match graph.value(v).def {
                Def::Node(n, _) => rewrites.gathered_keys.get(&n).is_some_and(|&(g, _)| g == v),
                _ => false,
            };
            if !key_maker(node.inputs[1]) || !key_maker(node.inputs[2]) {
                return Err(format!(
                    "{} (node {}) reads keys and values not all-gathered over cp",
                    node.op.name(),
                    id.index()
                ));
            }
            if mask.is_positional() && !starts_arranged(graph, &rewrites, node) {
                return Err(format!(
                    "{} (node {}) has a positional mask but no query runs taken from their chunks",
                    node.op.name(),
                    id.index()
                ));
            }
            if matches!(node.op, Op::AttentionGrad { .. }) {
                rewrites.key_gradients.insert(id);
            }
        }
        Ok(rewrites)
    }

    fn apply(&self, graph: &Graph, positions: &[usize], in_position_order: &[usize]) -> Result<Graph, PassError> {
        let mut rw = Rewriter::new(graph, |_| true);
        let mut indices = Indices::default();
        for (id, node) in graph.nodes() {
            if let Some((dim, index)) = self.arranged_slices.get(&id) {
                let x = node.inputs[0];
                let arranged = gathered_along(&mut rw, &mut indices, x, *dim, index)?;
                let out = node.outputs[0];
                let g = rw.graph();
                let new = g.add_node_typed(node.op.clone(), vec![arranged], vec![graph.ty(out).clone()]);
                let made = g.node(new).outputs[0];
                g.value_mut(made).placements = graph.value(out).placements.clone();
                rw.set(out, made);
                continue;
            }
            rw.copy_node(id);
            if let Some(&(keys, dim)) = self.gathered_keys.get(&id) {
                let in_order = gathered_along(&mut rw, &mut indices, keys, dim, in_position_order)?;
                rw.set(keys, in_order);
            }
            if self.key_gradients.contains(&id) {
                for &gradient in &node.outputs[1..3] {
                    let dim = graph.ty(gradient).rank() - 2;
                    let arranged = gathered_along(&mut rw, &mut indices, gradient, dim, positions)?;
                    rw.set(gradient, arranged);
                }
            }
        }
        Ok(rw.finish())
    }
}

/// The index constants made so far, each once.
#[derive(Default)]
struct Indices(BTreeMap<Vec<usize>, ValueId>);

/// `old` (already mapped) gathered along `dim` at `index`, placed as `old` is.
fn gathered_along(
    rw: &mut Rewriter,
    indices: &mut Indices,
    old: ValueId,
    dim: usize,
    index: &[usize],
) -> Result<ValueId, PassError> {
    let placements = rw.old().value(old).placements.clone();
    let x = rw.map(old);
    let g = rw.graph();
    let index = match indices.0.get(index) {
        Some(&made) => made,
        None => {
            let values: Vec<i64> = index.iter().map(|&i| i as i64).collect();
            let value = Tensor::from_i64(vec![values.len()], &values);
            let made = crate::add_op("cp-balance", g, Op::Constant { value }, vec![])?;
            indices.0.insert(index.to_vec(), made);
            made
        }
    };
    let gathered = crate::add_op("cp-balance", g, Op::Gather { axis: dim }, vec![x, index])?;
    g.value_mut(gathered).placements = placements;
    Ok(gathered)
}

/// Whether each value depends on a step input (tokens, or what a pipeline stage receives).
fn reaches_step_input(graph: &Graph) -> Vec<bool> {
    let mut reaches = vec![false; graph.num_values()];
    for &input in graph.inputs() {
        reaches[input.index()] = true;
    }
    for (_, node) in graph.nodes() {
        if node.inputs.iter().any(|v| reaches[v.index()]) || matches!(node.op, Op::Recv { .. }) {
            for out in &node.outputs {
                reaches[out.index()] = true;
            }
        }
    }
    reaches
}

/// Whether `v` is read only as attention's query runs (their first positions).
fn starts_only(graph: &Graph, consumers: &[Vec<NodeId>], v: ValueId) -> bool {
    let readers = &consumers[v.index()];
    !readers.is_empty()
        && readers.iter().all(|&n| {
            let node = graph.node(n);
            matches!(node.op, Op::Attention { .. } | Op::AttentionGrad { .. }) && node.inputs.last() == Some(&v)
        })
}

/// Whether `v` is read only as attention's keys or values.
fn read_as_keys(graph: &Graph, consumers: &[Vec<NodeId>], v: ValueId) -> bool {
    let readers = &consumers[v.index()];
    !readers.is_empty()
        && readers.iter().all(|&n| {
            let node = graph.node(n);
            let reads = node.inputs.iter().enumerate().filter(|&(_, &x)| x == v).map(|(i, _)| i);
            matches!(node.op, Op::Attention { .. } | Op::AttentionGrad { .. })
                && reads.into_iter().all(|i| i == 1 || i == 2)
        })
}

/// Whether `node`'s query runs come from a slice this pass arranges.
fn starts_arranged(graph: &Graph, rewrites: &Rewrites, node: &autotp_ir::Node) -> bool {
    let Some(&starts) = node.inputs.last() else { return false };
    matches!(graph.value(starts).def, Def::Node(n, 0) if rewrites.arranged_slices.contains_key(&n))
}

/// The `wait` that finishes an asynchronous collective's `started` value.
fn waited(graph: &Graph, consumers: &[Vec<NodeId>], started: ValueId) -> Option<NodeId> {
    consumers[started.index()].iter().copied().find(|&n| graph.node(n).op == Op::Wait)
}

/// Whether each value holds the sequence along a dim, in the order the ranks hold it: the
/// inputs split over cp (the tokens, and what a pipeline stage receives) do, and so does what
/// is computed from them, but for a sum over the sequence (a partial sum over cp that no
/// attention makes: a weight's gradient, the loss).
fn carries_sequence(graph: &Graph, axis: usize) -> Vec<bool> {
    let split = |v: ValueId| matches!(graph.value(v).placements[axis], Placement::Shard(_));
    let mut carries = vec![false; graph.num_values()];
    for &input in graph.inputs() {
        carries[input.index()] = split(input);
    }
    for (_, node) in graph.nodes() {
        let received = matches!(node.op, Op::Recv { .. });
        let from_sequence = node.inputs.iter().any(|v| carries[v.index()]);
        for &out in &node.outputs {
            let summed = graph.value(out).placements[axis] == Placement::PartialSum
                && !matches!(node.op, Op::AttentionGrad { .. });
            carries[out.index()] = if received { split(out) } else { from_sequence && !summed };
        }
    }
    carries
}

/// Whether `v` is the same at every index along `dim`, as far as its producers show (a
/// constant, or what expands and combines such values elementwise); `depth` bounds the walk.
fn uniform_along(graph: &Graph, v: ValueId, dim: usize, depth: usize) -> bool {
    let ty = graph.ty(v);
    if ty.shape[dim] == 1 {
        return true;
    }
    let Def::Node(n, _) = graph.value(v).def else { return false };
    if depth > 32 {
        return false;
    }
    let node = graph.node(n);
    // An operand's dim aligned with `dim` under broadcasting: `None` where it has none.
    let aligned = |x: ValueId| dim.checked_sub(ty.rank() - graph.ty(x).rank());
    let operand_uniform = |x: ValueId| aligned(x).is_none_or(|d| uniform_along(graph, x, d, depth + 1));
    match &node.op {
        Op::Constant { value } => {
            let inner: usize = ty.shape[dim + 1..].iter().product();
            let along = ty.shape[dim];
            (0..value.numel()).all(|i| {
                let first = i - (i / inner % along) * inner;
                value.get_f64(i).to_bits() == value.get_f64(first).to_bits()
            })
        }
        Op::Collective { kind: Collective::ShardSlice { .. }, .. } => {
            uniform_along(graph, node.inputs[0], dim, depth + 1)
        }
        Op::Expand { .. } | Op::Unary(_) | Op::Binary(_) | Op::Cast { .. } | Op::Select => {
            node.inputs.iter().all(|&x| operand_uniform(x))
        }
        Op::Reshape { .. } => {
            let x = node.inputs[0];
            let before: usize = ty.shape[..dim].iter().product();
            let from = &graph.ty(x).shape;
            (0..from.len()).any(|e| {
                from[e] == ty.shape[dim]
                    && from[..e].iter().product::<usize>() == before
                    && uniform_along(graph, x, e, depth + 1)
            })
        }
        _ => false,
    }
}
