//! Gradient reductions merged into buckets (DeepSpeed's `reduce_bucket_size`, `--reduce-bucket-size`),
//! part of the [`crate::shard`] pass: [`bucket_reductions`].
//!
//! Tests: tests/golden/zero_*.ir, tests/parallel.rs.

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::{Collective, Graph, Op, Placement, Rewriter, ValueId};

use crate::shard::{add, invalid};
use crate::PassError;

/// Merges gradient reductions into buckets of up to `bucket_elements` (DeepSpeed's reduce
/// buckets): a run of all-reduces, or of reduce-scatters, on one axis of values partial there
/// and whole on every other axis, whose results are first needed after the run, becomes one
/// collective of their concatenation, split and reshaped back. An all-reduce bucket concatenates
/// the flattened values; a reduce-scatter bucket first lays each value out as `[n, numel / n]`
/// (its scattered dim moved to the front), so row `r` of the concatenation is rank `r`'s shard
/// of every member. Fewer, bigger collectives; the same bytes.
///
/// An attention backward's key and value gradients stay reduced alone: context parallelism's
/// ring ([`crate::cp_ring`]) takes their reduce-scatters' place.
///
/// A bucket holds one micro-batch's gradients: it closes before a reduction whose result is
/// summed into the same value as a member's (the same parameter's gradient of the next
/// micro-batch, scattered term by term), as DeepSpeed flushes its bucket at the end of each
/// backward; otherwise every micro-batch's whole gradients would wait for the last one's.
pub(crate) fn bucket_reductions(graph: &Graph, bucket_elements: usize) -> Result<Graph, PassError> {
    if bucket_elements == 0 {
        return Ok(graph.clone());
    }
    let buckets = reduction_buckets(graph, bucket_elements);
    if buckets.is_empty() {
        return Ok(graph.clone());
    }
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    // The last member's position -> its bucket; other members are dropped where they were.
    let emit_at: BTreeMap<usize, &Vec<(usize, usize)>> =
        buckets.iter().map(|members| (members.last().expect("two or more").0, members)).collect();
    let merged: BTreeSet<usize> = buckets.iter().flatten().map(|&(i, _)| i).collect();
    let mut rw = Rewriter::new(graph, |_| true);
    for (i, node) in nodes.iter().enumerate() {
        if !merged.contains(&i) {
            rw.copy_node(autotp_ir::NodeId(i as u32));
        } else if let Some(members) = emit_at.get(&i) {
            emit_bucket(&mut rw, graph, &nodes, node, members)?;
        }
    }
    Ok(rw.finish())
}

/// The buckets of [`bucket_reductions`], each two or more members (node index, first use of
/// the result) in graph order.
fn reduction_buckets(graph: &Graph, bucket_elements: usize) -> Vec<Vec<(usize, usize)>> {
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let first_use = |v: ValueId, after: usize| {
        nodes.iter().enumerate().skip(after + 1).find(|(_, n)| n.inputs.contains(&v)).map_or(usize::MAX, |(i, _)| i)
    };
    let consumers = graph.consumers();
    // Where a reduction's result ends up: followed through its only consumer while that makes
    // one value of its shape (a running sum's adds, a weight, the mean's division).
    let summed_into = |mut v: ValueId| {
        while let [only] = consumers[v.index()][..] {
            let node = graph.node(only);
            match node.outputs[..] {
                [out] if graph.ty(out).shape == graph.ty(v).shape => v = out,
                _ => break,
            }
        }
        v
    };
    /// The bucket being filled: its collective (reduce-scatter or all-reduce), axis, dtype,
    /// elements, and members (node index, first use of the result).
    struct Open {
        scatter: bool,
        axis: String,
        dtype: autotp_ir::DType,
        elements: usize,
        members: Vec<(usize, usize)>,
        /// Where the members' results are summed into ([`summed_into`]).
        sums: BTreeSet<ValueId>,
    }
    let mut buckets: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut open: Option<Open> = None;
    for (i, node) in nodes.iter().enumerate() {
        let (scatter, axis) = match &node.op {
            Op::Collective { kind: Collective::AllReduce, axis, start: false } => (false, axis),
            Op::Collective { kind: Collective::ReduceScatter { .. }, axis, start: false } => (true, axis),
            _ => continue,
        };
        let input = node.inputs[0];
        let value = graph.value(input);
        let a = graph.mesh.axes.iter().position(|x| x.name == *axis).expect("verified axis");
        // A gradient, partial on the axis and whole on the others; not a scalar (the loss, whose
        // reduction waiting for the gradients' would make the whole backward part of the forward).
        let whole_elsewhere = value.placements.iter().enumerate().all(|(b, p)| b == a || *p == Placement::Replicate)
            && value.ty.numel() > 1
            && !attention_key_gradient(graph, input);
        let elements = value.ty.numel();
        let used = first_use(node.outputs[0], i);
        let sum = summed_into(node.outputs[0]);
        let fits = |b: &Open| {
            b.scatter == scatter
                && b.axis == *axis
                && b.dtype == value.ty.dtype
                && b.elements + elements <= bucket_elements
                && b.members.iter().all(|&(_, member_used)| member_used > i)
                && !b.sums.contains(&sum)
        };
        match open.as_mut() {
            Some(bucket) if whole_elsewhere && fits(bucket) => {
                bucket.elements += elements;
                bucket.members.push((i, used));
                bucket.sums.insert(sum);
            }
            _ => {
                buckets.extend(open.take().map(|b| b.members));
                if whole_elsewhere && elements <= bucket_elements {
                    let dtype = value.ty.dtype;
                    let (members, sums) = (vec![(i, used)], BTreeSet::from([sum]));
                    open = Some(Open { scatter, axis: axis.clone(), dtype, elements, members, sums });
                }
            }
        }
    }
    buckets.extend(open.map(|b| b.members));
    buckets.retain(|members| members.len() > 1);
    buckets
}

/// One bucket's collective, in place of its last member `node`: the members laid out and
/// concatenated, reduced once, split and shaped back into each member's result.
fn emit_bucket(
    rw: &mut Rewriter,
    graph: &Graph,
    nodes: &[&autotp_ir::Node],
    node: &autotp_ir::Node,
    members: &[(usize, usize)],
) -> Result<(), PassError> {
    let Op::Collective { kind, axis, .. } = &node.op else { unreachable!("a reduction") };
    let a = graph.mesh.axes.iter().position(|x| &x.name == axis).expect("verified axis");
    let ranks = graph.mesh.axes[a].size;
    let scatter = matches!(kind, Collective::ReduceScatter { .. });
    let mut partial = graph.mesh.replicated();
    partial[a] = Placement::PartialSum;
    let mut reduced_placements = graph.mesh.replicated();
    if scatter {
        reduced_placements[a] = Placement::Shard(0);
    }
    let place = |g: &mut Graph, v: ValueId, p: &[Placement]| g.value_mut(v).placements = p.to_vec();
    // Each member laid out for the concatenation: flat, or [ranks, numel / ranks] with its
    // scattered dim in front; the permutation that brought it there.
    let mut laid_out = Vec::new();
    let mut fronts = Vec::new();
    for &(m, _) in members.iter() {
        let mut v = rw.map(nodes[m].inputs[0]);
        let g = rw.graph();
        let numel = g.ty(v).numel();
        let front = match nodes[m].op {
            Op::Collective { kind: Collective::ReduceScatter { dim }, .. } if dim != 0 => {
                let mut perm: Vec<usize> = (0..g.ty(v).rank()).filter(|&d| d != dim).collect();
                perm.insert(0, dim);
                v = add(g, Op::Transpose { perm: perm.clone() }, vec![v])?;
                place(g, v, &partial);
                Some(perm)
            }
            _ => None,
        };
        let shape = if scatter { vec![ranks, numel / ranks] } else { vec![numel] };
        let flat = add(g, Op::Reshape { shape }, vec![v])?;
        place(g, flat, &partial);
        laid_out.push(flat);
        fronts.push(front);
    }
    let along = usize::from(scatter);
    let g = rw.graph();
    let concat = add(g, Op::Concat { axis: along }, laid_out.clone())?;
    place(g, concat, &partial);
    let kind = if scatter { Collective::ReduceScatter { dim: 0 } } else { Collective::AllReduce };
    let reduced = add(g, Op::Collective { kind, axis: axis.clone(), start: false }, vec![concat])?;
    place(g, reduced, &reduced_placements);
    let sizes: Vec<usize> = laid_out.iter().map(|&f| g.ty(f).shape[along]).collect();
    let split = g.add_node(Op::Split { axis: along, sizes }, vec![reduced], laid_out.len()).map_err(invalid)?;
    let parts = g.node(split).outputs.clone();
    for ((&(m, _), part), front) in members.iter().zip(parts).zip(fronts) {
        let out = nodes[m].outputs[0];
        let g = rw.graph();
        place(g, part, &reduced_placements);
        let shape = graph.ty(out).shape.clone();
        let result = match front {
            Some(perm) => {
                let fronted: Vec<usize> = perm.iter().map(|&d| shape[d]).collect();
                let shaped = add(g, Op::Reshape { shape: fronted }, vec![part])?;
                place(g, shaped, &reduced_placements);
                add(g, Op::Transpose { perm: crate::inverse_permutation(&perm) }, vec![shaped])?
            }
            None => add(g, Op::Reshape { shape }, vec![part])?,
        };
        place(g, result, &graph.value(out).placements);
        rw.set(out, result);
    }
    Ok(())
}

/// Whether `v` is an attention backward's key or value gradient (arranged by a gather, in the
/// load-balanced order).
fn attention_key_gradient(graph: &Graph, v: ValueId) -> bool {
    let autotp_ir::Def::Node(n, output) = graph.value(v).def else { return false };
    let node = graph.node(n);
    match node.op {
        Op::AttentionGrad { .. } => output > 0,
        Op::Gather { .. } => attention_key_gradient(graph, node.inputs[0]),
        _ => false,
    }
}
