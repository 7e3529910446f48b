//! Sinking `shard_slice`s toward where their data is made, part of the `shard` pass.
//!
//! Placement runs forward: a value computed replicated (a one-hot of the labels, an expanded
//! gradient, a scatter-add into an embedding table) is sliced where a consumer needs one block of
//! it, after every rank computed all of it. Slicing earlier gives the same values and keeps
//! each rank's work and memory to its block. (Ops that can make just a block, such as the
//! scatter-add of an embedding's gradient, are placed so by `shard` itself.) A `shard_slice`
//! of a value that has no other use moves:
//! - above an elementwise producer, onto the operands that are not broadcast along the dim;
//! - above a collective on another mesh axis that does not touch the dim (a data-parallel
//!   reduction of a gradient the tensor-parallel ranks each need one block of).
//!
//! Repeated until nothing moves, so a slice travels up a chain (`cast(equal(iota, labels))`
//! becomes `cast(equal(shard_slice(iota), labels))`).
//!
//! Tests: tests/golden/autotp_vocab.ir, tests/sharding.rs.

use std::collections::BTreeMap;

use autotp_ir::{Collective, Def, Graph, NodeId, Op, Placement, Rewriter, ValueId};

use crate::PassError;

/// A `shard_slice` (node `slice`, on mesh axis `axis` and output dim `dim`) that moves above
/// `producer`, onto its operands at these positions, sliced on these dims.
struct Sink {
    slice: usize,
    producer: usize,
    axis: usize,
    dim: usize,
    operands: Vec<(usize, usize)>,
}

/// Where a slice of `producer`'s output on `dim` (over mesh axis `axis`) can go instead: onto
/// these operands (position, dim), for an elementwise op (the operands not broadcast along
/// `dim`) or a reduction or gather over another axis that leaves `dim` alone; `None` for other
/// ops. Shared with the `shard` pass's search for values it can make as blocks.
pub(crate) fn operands_along(
    graph: &Graph,
    producer: &autotp_ir::Node,
    axis: &str,
    dim: usize,
) -> Option<Vec<(usize, usize)>> {
    let out = graph.ty(producer.outputs[0]);
    match &producer.op {
        Op::Unary(_) | Op::Binary(_) | Op::Cast { .. } | Op::Select => Some(
            producer
                .inputs
                .iter()
                .enumerate()
                .filter_map(|(i, &v)| {
                    let t = graph.ty(v);
                    let d = dim.checked_sub(out.rank() - t.rank())?;
                    (t.shape[d] == out.shape[dim]).then_some((i, d))
                })
                .collect(),
        ),
        Op::Collective { kind, axis: other, start: false } if other != axis => {
            // Two slices on different axes would only trade places.
            let keeps_dim = match kind {
                Collective::AllReduce => true,
                Collective::AllGather { dim: d }
                | Collective::ReduceScatter { dim: d }
                | Collective::RingShift { dim: d } => *d != dim,
                Collective::AllToAll { split, concat } => *split != dim && *concat != dim,
                Collective::ShardSlice { .. } => false,
            };
            keeps_dim.then(|| vec![(0, dim)])
        }
        _ => None,
    }
}

fn find_sinks(graph: &Graph) -> Vec<Sink> {
    let uses = graph.use_counts();
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let mut sinks: Vec<Sink> = Vec::new();
    let mut taken = std::collections::BTreeSet::new();
    for (s, node) in nodes.iter().enumerate() {
        let Op::Collective { kind: Collective::ShardSlice { dim }, axis, start: false } = &node.op else { continue };
        let Some(a) = graph.mesh.axes.iter().position(|x| &x.name == axis) else { continue };
        let y = node.inputs[0];
        let Def::Node(p, 0) = graph.value(y).def else { continue };
        let producer = nodes[p.index()];
        if uses[y.index()] != 1 || producer.outputs.len() != 1 || !taken.insert(p.index()) {
            continue;
        }
        let replicated_here = |v: ValueId| graph.value(v).placements[a] == Placement::Replicate;
        if !producer.inputs.iter().all(|&v| replicated_here(v)) {
            continue;
        }
        // A dim another axis already shards cannot be cut again (see `Placer::reshard`).
        let free = |v: ValueId, d: usize| !graph.value(v).placements.contains(&Placement::Shard(d));
        let Some(operands) = operands_along(graph, producer, axis, *dim) else { continue };
        if operands.is_empty() || !operands.iter().all(|&(i, d)| free(producer.inputs[i], d)) {
            continue;
        }
        sinks.push(Sink { slice: s, producer: p.index(), axis: a, dim: *dim, operands });
    }
    sinks
}

/// Moves every `shard_slice` that can move, until none can.
pub(crate) fn sink_slices(graph: &Graph) -> Result<Graph, PassError> {
    let mut graph = graph.clone();
    loop {
        let sinks = find_sinks(&graph);
        if sinks.is_empty() {
            return Ok(graph);
        }
        graph = apply(&graph, &sinks)?;
    }
}

fn apply(graph: &Graph, sinks: &[Sink]) -> Result<Graph, PassError> {
    let at_producer: BTreeMap<usize, &Sink> = sinks.iter().map(|s| (s.producer, s)).collect();
    let at_slice: BTreeMap<usize, &Sink> = sinks.iter().map(|s| (s.slice, s)).collect();
    let mut rw = Rewriter::new(graph, |_| true);
    for (id, node) in graph.nodes() {
        if let Some(sink) = at_slice.get(&id.index()) {
            // The producer (earlier) now makes the block from sliced operands.
            let made = rw.map(graph.node(NodeId(sink.producer as u32)).outputs[0]);
            rw.set(node.outputs[0], made);
            continue;
        }
        let Some(sink) = at_producer.get(&id.index()) else {
            rw.copy_node(id);
            continue;
        };
        let axis = graph.mesh.axes[sink.axis].name.clone();
        let mut inputs: Vec<ValueId> = node.inputs.iter().map(|&v| rw.map(v)).collect();
        for &(i, d) in &sink.operands {
            let g = rw.graph();
            let mut placements = g.value(inputs[i]).placements.clone();
            placements[sink.axis] = Placement::Shard(d);
            let op = Op::Collective { kind: Collective::ShardSlice { dim: d }, axis: axis.clone(), start: false };
            let sliced = crate::add_op("shard", g, op, vec![inputs[i]])?;
            g.value_mut(sliced).placements = placements;
            inputs[i] = sliced;
        }
        let out = node.outputs[0];
        let g = rw.graph();
        let new = g.add_node_typed(node.op.clone(), inputs, vec![graph.ty(out).clone()]);
        let made = g.node(new).outputs[0];
        let mut placements = graph.value(out).placements.clone();
        placements[sink.axis] = Placement::Shard(sink.dim);
        g.value_mut(made).placements = placements;
        g.value_mut(made).name = graph.value(out).name.clone();
        rw.set(out, made);
    }
    Ok(rw.finish())
}
