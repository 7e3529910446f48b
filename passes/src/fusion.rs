//! `fusion`: groups the step's elementwise and row-reduction ops into generated kernels.
//! Input: any verified graph (the last pass of `compile`, after sharding and the pipeline).
//! Output: the same computation with its nodes reordered and fusion groups marked
//! ([`autotp_ir::Fusion`], printed as `fusion "fN" { ... }` blocks), which codegen lowers to
//! one generated kernel each. Tests: tests/golden/fusion_*.ir, tests/kernels.rs (every fused
//! group of the fixtures' steps against its unfused ops).
//!
//! Legality is one question asked of the kernel builder: a group is legal exactly when
//! [`autotp_kernelgen::build`] builds it, which enforces XLA's rules (one iteration space;
//! a max reduction's input is loaded, never recomputed; an expensive value is not recomputed by
//! several stages). Benefit is greedy producer-consumer fusion: nodes are scheduled in a
//! topological order that, after each node, takes next a ready node that joins the open group
//! (it reads a value the group makes, or an activation the group reads, and the group stays
//! legal), else the ready node that came first. Constants move to the front (they are data).
//! Optimizer updates wait until nothing else is ready; then the updates that apply one rule
//! (the same op, hyperparameters, lr and step, dtype) form one group, which codegen runs as one
//! multi-tensor step updating every parameter and state in place (tests/golden/fusion_optimizer.ir).
//! First, a transpose of the last two dims feeding a matmul becomes the matmul's transpose flag
//! (no materialised transpose in front of a GEMM), for operands held whole on every rank, a
//! cast after a reshape moves before it (so it fuses into the kernel making the reshaped value),
//! a widening cast before a reshape moves after it, and a 16-bit value widened to f32 for
//! several kernels gets a cast per reader (each kernel widens it as it loads). After the schedule, a group whose results one later group alone
//! reads joins it where that keeps memory down (`sink_into_readers`: the labels' one-hot goes
//! into the softmax gradient's kernel, a cast of the logits into the cross-entropy's).
//! Nodes that cannot be in a kernel (matmuls, data movement, collectives, sends and receives)
//! keep their relative order, so collectives are issued in the same order on every rank and
//! pipeline messages in the order the schedule set.

use autotp_ir::lower;
use autotp_ir::{Def, Graph, NodeId, Op, Rewriter, ValueId};

use crate::{Pass, PassError};

/// The most nodes one group takes (long chains compile slowly and gain little more).
const MAX_GROUP: usize = 48;

/// The pass, with what it recomputes ([`crate::recompute`]: after the GEMM rewrites, before
/// the scheduling).
#[derive(Clone, Copy, Debug, Default)]
pub struct Fusion {
    pub recompute: crate::recompute::Recompute,
}

impl Pass for Fusion {
    fn name(&self) -> &'static str {
        "fusion"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        *graph = crate::peephole::rewrite(graph, crate::peephole::Rules::Gemm);
        if let Some(moved) = casts_before_reshapes(graph) {
            *graph = moved;
        }
        if let Some(moved) = widening_casts_after_reshapes(graph) {
            *graph = moved;
        }
        if let Some(copied) = widening_casts_per_reader(graph) {
            *graph = copied;
        }
        let (recomputed, earliest) = crate::recompute::recompute(graph, self.recompute);
        *graph = recomputed;
        let (order, groups) = schedule(graph, &earliest);
        let (order, groups) = sink_into_readers(graph, order, groups);
        let mut rewriter = Rewriter::new(graph, |_| true);
        for &n in &order {
            rewriter.copy_node(n);
        }
        let mut fused = rewriter.finish();
        let mut at = 0;
        for (g, len) in groups.into_iter().enumerate() {
            if len > 1 {
                fused.add_fusion(format!("f{g}"), at..at + len);
            }
            at += len;
        }
        *graph = fused;
        Ok(())
    }
}

/// `cast(reshape(x))` as `reshape(cast(x))` where nothing else reads the reshape and only
/// matmuls read the cast: the cast then joins the kernel that makes `x` (a norm's output cast
/// to 16 bits, reshaped for the matmul that reads it), where it would otherwise be a kernel of
/// its own. (A cast that a kernel reads joins that kernel already.) Both orders give the same
/// bytes: a reshape moves none. `None` when there is no such cast.
fn casts_before_reshapes(graph: &Graph) -> Option<Graph> {
    let mut readers: Vec<Vec<&Op>> = vec![Vec::new(); graph.num_values()];
    for (_, node) in graph.nodes() {
        node.inputs.iter().for_each(|v| readers[v.index()].push(&node.op));
    }
    let outputs: Vec<ValueId> = graph.outputs().iter().map(|(_, v)| *v).collect();
    let sunk = |node: &autotp_ir::Node| -> Option<NodeId> {
        let (Op::Cast { .. }, [reshaped]) = (&node.op, &node.inputs[..]) else { return None };
        let Def::Node(reshape, _) = graph.value(*reshaped).def else { return None };
        let only_here = readers[reshaped.index()].len() == 1 && !outputs.contains(reshaped);
        let into_matmuls = !outputs.contains(&node.outputs[0])
            && readers[node.outputs[0].index()].iter().all(|op| matches!(op, Op::MatMul { .. }));
        (matches!(graph.node(reshape).op, Op::Reshape { .. }) && only_here && into_matmuls).then_some(reshape)
    };
    swap_cast_and_reshape(graph, sunk)
}

/// `reshape(cast(x))` as `cast(reshape(x))` where `x` is 16-bit, the cast widens it to f32 and
/// only the reshape reads the cast: the widening then sits beside the kernels that read the
/// reshaped value, which each take a copy of it ([`widening_casts_per_reader`]: a bf16 GEMM's
/// result that the backward's elementwise kernels and a bias gradient read), where it would
/// otherwise be a kernel of its own storing the value in f32. `None` when there is no such cast.
fn widening_casts_after_reshapes(graph: &Graph) -> Option<Graph> {
    use autotp_ir::DType;
    let consumers = graph.consumers();
    let outputs: Vec<ValueId> = graph.outputs().iter().map(|(_, v)| *v).collect();
    // The cast before the reshape `node`, where it moves after it.
    let widened = |node: &autotp_ir::Node| -> Option<NodeId> {
        let (Op::Reshape { .. }, [wide]) = (&node.op, &node.inputs[..]) else { return None };
        let Def::Node(cast, _) = graph.value(*wide).def else { return None };
        let (Op::Cast { to: DType::F32 }, [narrow]) = (&graph.node(cast).op, &graph.node(cast).inputs[..]) else {
            return None;
        };
        let sixteen_bits = matches!(graph.ty(*narrow).dtype, DType::BF16 | DType::F16);
        (sixteen_bits && consumers[wide.index()].len() == 1 && !outputs.contains(wide)).then_some(cast)
    };
    swap_cast_and_reshape(graph, widened)
}

/// Each `outer(inner(x))`, where `matched` pairs node `outer` with the node `inner` (a cast and a
/// reshape, either way round) whose value only it reads, as `inner(outer(x))`: the first of the
/// new pair has `x`'s placements where it keeps `x`'s shape (else the outer's), the second the
/// outer's type, placements and name. `None` when nothing matches.
fn swap_cast_and_reshape(graph: &Graph, matched: impl Fn(&autotp_ir::Node) -> Option<NodeId>) -> Option<Graph> {
    let moved: Vec<NodeId> = graph.nodes().filter_map(|(_, node)| matched(node)).collect();
    if moved.is_empty() {
        return None;
    }
    let mut rewriter = Rewriter::new(graph, |_| true);
    for (id, node) in graph.nodes() {
        if moved.contains(&id) {
            continue;
        }
        let Some(inner) = matched(node) else {
            rewriter.copy_node(id);
            continue;
        };
        let x = graph.node(inner).inputs[0];
        let (old_x, out) = (graph.value(x), graph.value(node.outputs[0]));
        let dtype = if matches!(node.op, Op::Cast { .. }) { out.ty.dtype } else { old_x.ty.dtype };
        let shape = if matches!(node.op, Op::Reshape { .. }) { &out.ty.shape } else { &old_x.ty.shape };
        let placements = if *shape == old_x.ty.shape { &old_x.placements } else { &out.placements };
        let first_type = autotp_ir::TensorType::new(dtype, shape.clone());
        let new_x = rewriter.map(x);
        let g = rewriter.graph();
        let first = g.add_node_typed(node.op.clone(), vec![new_x], vec![first_type]);
        let first = g.node(first).outputs[0];
        g.value_mut(first).placements = placements.clone();
        let second = g.add_node_typed(graph.node(inner).op.clone(), vec![first], vec![out.ty.clone()]);
        let second = g.node(second).outputs[0];
        (g.value_mut(second).placements, g.value_mut(second).name) = (out.placements.clone(), out.name.clone());
        rewriter.set(node.outputs[0], second);
    }
    Some(rewriter.finish())
}

/// A 16-bit value widened to f32 that several kernels read (a bf16 model's logits, which the
/// loss and its gradient's softmax both read) is widened again in each of those kernels from
/// the 16-bit value, instead of stored in f32 once: a copy of the cast per reader, where every
/// reader can take it in its kernel (else the f32 value is stored anyway, and stays the one).
/// Widening is exact, so the results are the same bytes. `None` when there is no such cast.
fn widening_casts_per_reader(graph: &Graph) -> Option<Graph> {
    use autotp_ir::DType;
    let consumers = graph.consumers();
    let outputs: Vec<ValueId> = graph.outputs().iter().map(|(_, v)| *v).collect();
    // For each such cast, the readers that take their own copy.
    let mut copies: std::collections::BTreeMap<NodeId, Vec<NodeId>> = Default::default();
    for (id, node) in graph.nodes() {
        let (Op::Cast { to: DType::F32 }, [x]) = (&node.op, &node.inputs[..]) else { continue };
        let widened = node.outputs[0];
        let readers = &consumers[widened.index()];
        if !matches!(graph.ty(*x).dtype, DType::BF16 | DType::F16) || readers.len() < 2 || outputs.contains(&widened) {
            continue;
        }
        let takes = |r: NodeId| {
            autotp_kernelgen::try_build(graph, &[id, r], &graph.node(r).outputs).is_some()
                || autotp_kernelgen::cross_entropy(graph, &[id, r]).is_some()
        };
        if readers.iter().all(|&r| takes(r)) {
            copies.insert(id, readers.clone());
        }
    }
    if copies.is_empty() {
        return None;
    }
    // For each reader, the casts it takes a copy of.
    let mut takes: std::collections::BTreeMap<NodeId, Vec<NodeId>> = Default::default();
    for (&cast, readers) in &copies {
        for &reader in readers {
            takes.entry(reader).or_default().push(cast);
        }
    }
    let mut rewriter = Rewriter::new(graph, |_| true);
    for (id, _) in graph.nodes() {
        if let Some(casts) = takes.get(&id) {
            for &cast in casts {
                let original = graph.node(cast);
                let widened = graph.value(original.outputs[0]);
                let input = rewriter.map(original.inputs[0]);
                let g = rewriter.graph();
                let copy = g.add_node_typed(original.op.clone(), vec![input], vec![widened.ty.clone()]);
                let copy = g.node(copy).outputs[0];
                g.value_mut(copy).placements = widened.placements.clone();
                rewriter.set(original.outputs[0], copy);
            }
        }
        if !copies.contains_key(&id) {
            rewriter.copy_node(id);
        }
    }
    Some(rewriter.finish().without_dead_code())
}

/// Each group whose results only one later group reads joins that group, where the two are one
/// kernel and the activations the move keeps alive longer are at most a quarter of the bytes of
/// its results, which are then never stored (results updated in place, or regions reused, make
/// the saving smaller than those bytes, so the margin keeps the peak from growing): a one-hot
/// of the labels is made in the kernel that subtracts it from the softmax, and a bf16 model's
/// logits widened where the cross-entropy reads them, instead of stored in f32 between two
/// kernels. Moving a group later is always in order: what it reads is made
/// before it, and nothing between it and the group that reads its results reads them.
fn sink_into_readers(graph: &Graph, order: Vec<NodeId>, groups: Vec<usize>) -> (Vec<NodeId>, Vec<usize>) {
    let consumers = graph.consumers();
    let leaves = leaves(graph);
    let mut spans: Vec<Vec<NodeId>> = Vec::with_capacity(groups.len());
    let mut at = 0;
    for len in groups {
        spans.push(order[at..at + len].to_vec());
        at += len;
    }
    // A generated kernel (or the two of a cross-entropy reading a cast of its scores).
    let kernel = |span: &[NodeId]| {
        span.iter().all(|&n| !matches!(graph.node(n).op, Op::Constant { .. }) && !is_update(graph, n))
            && (autotp_kernelgen::try_build(graph, span, &group_outputs(graph, span, &consumers, &leaves)).is_some()
                || autotp_kernelgen::cross_entropy(graph, span).is_some())
    };
    let bytes = |v: ValueId| graph.ty(v).numel() * graph.ty(v).dtype.size();
    let mut g = 0;
    while g < spans.len() {
        let results: Vec<ValueId> = spans[g].iter().flat_map(|&n| graph.node(n).outputs.iter().copied()).collect();
        let readers: Vec<NodeId> = (results.iter())
            .flat_map(|v| consumers[v.index()].iter().copied())
            .filter(|r| !spans[g].contains(r))
            .collect();
        let target = readers.first().and_then(|r| spans.iter().position(|s| s.contains(r)));
        let sinkable = |h: usize| {
            let mut merged = spans[g].clone();
            merged.extend(&spans[h]);
            // Activations that nothing at or after the reading group reads, which would now
            // live until it.
            let mut inputs: Vec<ValueId> =
                spans[g].iter().flat_map(|&n| graph.node(n).inputs.iter().copied()).collect();
            inputs.sort();
            inputs.dedup();
            let extended: usize = (inputs.into_iter())
                .filter(|v| matches!(graph.value(*v).def, Def::Node(p, _) if !matches!(graph.node(p).op, Op::Constant { .. })))
                .filter(|v| !leaves[v.index()] && !results.contains(v))
                .filter(|v| {
                    consumers[v.index()]
                        .iter()
                        .filter(|c| !spans[g].contains(c))
                        .all(|c| spans.iter().position(|s| s.contains(c)).is_some_and(|at| at < h))
                })
                .map(bytes)
                .sum();
            let freed: usize = results.iter().copied().map(bytes).sum();
            h > g
                && results.iter().all(|v| !leaves[v.index()])
                && readers.iter().all(|r| spans[h].contains(r))
                && merged.len() <= MAX_GROUP
                && 4 * extended <= freed
                && kernel(&spans[g])
                && kernel(&merged)
        };
        match target.filter(|&h| sinkable(h)) {
            Some(h) => {
                let moved = spans.remove(g);
                spans[h - 1].splice(0..0, moved);
            }
            None => g += 1,
        }
    }
    let groups = spans.iter().map(Vec::len).collect();
    (spans.into_iter().flatten().collect(), groups)
}

/// Per value, whether it leaves the step (an output, or an update's target or value).
fn leaves(graph: &Graph) -> Vec<bool> {
    let mut leaves = vec![false; graph.num_values()];
    for (_, v) in graph.outputs() {
        leaves[v.index()] = true;
    }
    for (t, v) in graph.updates() {
        leaves[t.index()] = true;
        leaves[v.index()] = true;
    }
    leaves
}

/// Whether `node` is an optimizer update (those form the multi-tensor steps).
fn is_update(graph: &Graph, node: NodeId) -> bool {
    lower::optimizer_of(&graph.node(node).op).is_some()
}

/// Whether a kernel can compute `node` at all (alone).
fn fusible(graph: &Graph, node: NodeId) -> bool {
    !matches!(graph.node(node).op, Op::Constant { .. })
        && autotp_kernelgen::try_build(graph, &[node], &graph.node(node).outputs).is_some()
}

/// The values of `group` that something outside it reads (or that leave the graph).
fn group_outputs(graph: &Graph, group: &[NodeId], consumers: &[Vec<NodeId>], leaves: &[bool]) -> Vec<ValueId> {
    group
        .iter()
        .flat_map(|&n| graph.node(n).outputs.iter().copied())
        .filter(|v| leaves[v.index()] || consumers[v.index()].iter().any(|c| !group.contains(c)))
        .collect()
}

/// The nodes in their new order, and the lengths of the consecutive groups that cover it. No
/// node joins a group before every node before `earliest[node]` is scheduled (a recomputed
/// node waits for the backward it was put in; the lowest ready node is always the lowest not
/// yet scheduled, since the graph's order is topological).
fn schedule(graph: &Graph, earliest: &[usize]) -> (Vec<NodeId>, Vec<usize>) {
    let n = graph.num_nodes();
    let mut consumers: Vec<Vec<NodeId>> = vec![Vec::new(); graph.num_values()];
    let mut waiting = vec![0usize; n];
    for (id, node) in graph.nodes() {
        for &v in &node.inputs {
            if let Def::Node(..) = graph.value(v).def {
                consumers[v.index()].push(id);
                waiting[id.index()] += 1;
            }
        }
    }
    let leaves = leaves(graph);
    let fusible: Vec<bool> = graph.nodes().map(|(id, _)| fusible(graph, id)).collect();
    let updates: Vec<bool> = graph.nodes().map(|(_, n)| lower::optimizer_of(&n.op).is_some()).collect();

    let mut order: Vec<NodeId> =
        graph.nodes().filter(|(_, n)| matches!(n.op, Op::Constant { .. })).map(|(id, _)| id).collect();
    let mut groups: Vec<usize> = vec![1; order.len()];
    // Ready nodes, and ready optimizer updates held back until nothing else is ready.
    let mut ready = Ready::default();
    for (id, node) in graph.nodes() {
        if waiting[id.index()] == 0 && !matches!(node.op, Op::Constant { .. }) {
            ready.insert(id.index(), updates[id.index()]);
        }
    }
    let mut release = |id: NodeId, ready: &mut Ready| {
        for &v in &graph.node(id).outputs {
            for &c in &consumers[v.index()] {
                waiting[c.index()] -= 1;
                if waiting[c.index()] == 0 {
                    ready.insert(c.index(), updates[c.index()]);
                }
            }
        }
    };
    for &c in &order.clone() {
        release(c, &mut ready);
    }
    let mut group: Vec<NodeId> = Vec::new();
    loop {
        let Some(&first) = ready.nodes.iter().next() else {
            // Only optimizer updates are left: each set that applies one rule is one step.
            if ready.updates.is_empty() {
                break;
            }
            if !group.is_empty() {
                groups.push(group.len());
                group.clear();
            }
            for step in multi_tensor_steps(graph, std::mem::take(&mut ready.updates)) {
                groups.push(step.len());
                for &id in &step {
                    order.push(id);
                    release(id, &mut ready);
                }
            }
            continue;
        };
        // A ready node that joins the open group, if any (the earliest such).
        let joining = (!group.is_empty() && group.len() < MAX_GROUP)
            .then(|| {
                ready.nodes.iter().copied().find(|&c| {
                    let candidate = NodeId(c as u32);
                    fusible[c] && earliest[c] <= first && connected(graph, &group, candidate) && {
                        let mut grown = group.clone();
                        grown.push(candidate);
                        let outputs = group_outputs(graph, &grown, &consumers, &leaves);
                        autotp_kernelgen::build(graph, &grown, &outputs).is_ok()
                    }
                })
            })
            .flatten();
        let next = match joining {
            Some(c) => c,
            None => {
                if !group.is_empty() {
                    groups.push(group.len());
                    group.clear();
                }
                first
            }
        };
        ready.nodes.remove(&next);
        let id = NodeId(next as u32);
        order.push(id);
        if fusible[next] {
            group.push(id);
        } else {
            if !group.is_empty() {
                groups.push(group.len());
                group.clear();
            }
            groups.push(1);
        }
        release(id, &mut ready);
    }
    if !group.is_empty() {
        groups.push(group.len());
    }
    debug_assert_eq!(order.len(), n, "every node scheduled (the graph is acyclic)");
    (order, groups)
}

/// The nodes ready to be scheduled, optimizer updates apart.
#[derive(Default)]
struct Ready {
    nodes: std::collections::BTreeSet<usize>,
    updates: std::collections::BTreeSet<usize>,
}

impl Ready {
    fn insert(&mut self, node: usize, is_update: bool) {
        if is_update {
            self.updates.insert(node);
        } else {
            self.nodes.insert(node);
        }
    }
}

/// `updates` (optimizer nodes, all ready) as the multi-tensor steps that apply them: those
/// with the same rule, scalars and dtype together, in the order of their first node.
fn multi_tensor_steps(graph: &Graph, updates: std::collections::BTreeSet<usize>) -> Vec<Vec<NodeId>> {
    let mut steps: Vec<Vec<NodeId>> = Vec::new();
    for id in updates.into_iter().map(|n| NodeId(n as u32)) {
        let joins = steps.iter_mut().find(|step| lower::multi_tensor_optimizer(graph, &[step[0], id]).is_some());
        match joins {
            Some(step) => step.push(id),
            None => steps.push(vec![id]),
        }
    }
    steps
}

/// Whether `candidate` reads a value the group makes, or (but for a copy of a cast it has) an
/// activation (a value some node makes, not a constant) the group also reads. Sharing a parameter or an input is no
/// reason to join: it would hoist, say, the backward's transpose of a weight next to the
/// forward's, keeping its result alive through the whole step.
fn connected(graph: &Graph, group: &[NodeId], candidate: NodeId) -> bool {
    let activation = |v: &ValueId| matches!(graph.value(*v).def, Def::Node(n, _) if !matches!(graph.node(n).op, Op::Constant { .. }));
    // A copy of a cast the group has (`widening_casts_per_reader`) is its reader's kernel's to
    // take: the same input is no reason for it to join.
    let node = graph.node(candidate);
    let copy = matches!(node.op, Op::Cast { .. })
        && group.iter().any(|&g| graph.node(g).op == node.op && graph.node(g).inputs == node.inputs);
    let shares = !copy;
    graph.node(candidate).inputs.iter().any(|v| {
        group.iter().any(|&g| {
            graph.node(g).outputs.contains(v) || (shares && activation(v) && graph.node(g).inputs.contains(v))
        })
    })
}
