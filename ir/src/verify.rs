//! The verifier: checks every structural invariant and every op's type rule, and reports all
//! violations, each naming the node or value it is about.

use crate::text::ValueNames;
use crate::{Def, Graph, NodeId, Op, Placement};

/// One violation. `at` is the printed form of the offending value or node (`%12 = matmul`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    pub at: String,
    pub message: String,
}

impl std::fmt::Display for VerifyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.at, self.message)
    }
}

/// All violations, one per line when displayed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct VerifyErrors(pub Vec<VerifyError>);

impl std::fmt::Display for VerifyErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the graph is invalid ({} errors)", self.0.len())?;
        for e in &self.0 {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

/// Checks `graph`; `Ok` when it is well formed.
pub fn verify(graph: &Graph) -> Result<(), VerifyErrors> {
    let names = crate::text::ValueNames::new(graph);
    let mut errors = Vec::new();
    let mut err = |at: String, message: String| errors.push(VerifyError { at, message });
    let mut defined = check_declarations(graph, &names, &mut err);
    check_values(graph, &names, &mut err);
    check_nodes(graph, &names, &mut defined, &mut err);
    check_outputs_and_updates(graph, &names, &defined, &mut err);
    check_waits(graph, &names, &mut err);
    check_placed_outputs_and_updates(graph, &names, &mut err);
    check_fusions(graph, &mut err);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(VerifyErrors(errors))
    }
}

/// Inputs, parameters and states are defined as what they are listed as; returns which values
/// they define.
fn check_declarations(graph: &Graph, names: &ValueNames, err: &mut impl FnMut(String, String)) -> Vec<bool> {
    let mut defined = vec![false; graph.num_values()];
    for (i, &v) in graph.inputs().iter().enumerate() {
        if graph.value(v).def != Def::Input(i) {
            err(names.get(v), format!("is listed as input {i} but is not defined as one"));
        }
        defined[v.index()] = true;
    }
    for (i, &v) in graph.params().iter().enumerate() {
        if graph.value(v).def != Def::Param(i) {
            err(names.get(v), format!("is listed as parameter {i} but is not defined as one"));
        }
        if !graph.ty(v).dtype.is_float() {
            err(names.get(v), format!("parameters must be floating point, got {}", graph.ty(v).dtype));
        }
        defined[v.index()] = true;
    }
    for (i, &v) in graph.states().iter().enumerate() {
        if graph.value(v).def != Def::State(i) {
            err(names.get(v), format!("is listed as state {i} but is not defined as one"));
        }
        defined[v.index()] = true;
    }
    defined
}

/// Names are unique; placements match the mesh and divide the dims they shard.
fn check_values(graph: &Graph, names: &ValueNames, err: &mut impl FnMut(String, String)) {
    let mut seen_names = std::collections::BTreeMap::new();
    for (id, value) in graph.values() {
        if let Some(name) = &value.name {
            if let Some(prev) = seen_names.insert(name.clone(), id) {
                err(names.get(id), format!("reuses the name of {}", names.get(prev)));
            }
        }
        if value.placements.len() != graph.mesh.axes.len() {
            err(
                names.get(id),
                format!("has {} placements for a mesh of {} axes", value.placements.len(), graph.mesh.axes.len()),
            );
            continue;
        }
        // Axes sharding one dim nest in mesh-axis order: each divides what the ones before left.
        let mut local = value.ty.shape.clone();
        for (p, axis) in value.placements.iter().zip(&graph.mesh.axes) {
            if let Placement::Shard(d) = p {
                match local.get_mut(*d) {
                    None => err(
                        names.get(id),
                        format!("is sharded on dim {d} over {}, but has rank {}", axis.name, value.ty.rank()),
                    ),
                    Some(size) if *size % axis.size.max(1) != 0 || axis.size == 0 => {
                        let block = if *size == value.ty.shape[*d] {
                            String::new()
                        } else {
                            format!(" (its block under the mesh axes before, of {})", value.ty.shape[*d])
                        };
                        err(
                            names.get(id),
                            format!(
                                "dim {d} of size {size}{block} is not divisible by mesh axis {} of size {}",
                                axis.name, axis.size
                            ),
                        )
                    }
                    Some(size) => *size /= axis.size,
                }
            }
        }
    }
}

/// Every node's inputs are defined before it, its outputs once by it, with the types and
/// placements its op's rules give.
fn check_nodes(graph: &Graph, names: &ValueNames, defined: &mut [bool], err: &mut impl FnMut(String, String)) {
    let placements_ok = graph.values().all(|(_, v)| v.placements.len() == graph.mesh.axes.len());
    for (id, node) in graph.nodes() {
        // Named only for a message: most nodes have none.
        let at = || names.node(graph, id);
        let mut inputs_ok = true;
        for (i, v) in node.inputs.iter().enumerate() {
            if v.index() >= graph.num_values() {
                err(at(), format!("input {i} refers to a value that does not exist"));
                inputs_ok = false;
            } else if !defined[v.index()] {
                err(at(), format!("input {i} ({}) is used before it is defined", names.get(*v)));
                inputs_ok = false;
            }
        }
        for (i, &o) in node.outputs.iter().enumerate() {
            if graph.value(o).def != Def::Node(id, i) {
                err(at(), format!("output {i} ({}) is not defined by this node", names.get(o)));
            }
            if defined[o.index()] {
                err(at(), format!("output {i} ({}) is defined twice", names.get(o)));
            }
            defined[o.index()] = true;
        }
        if !inputs_ok {
            continue;
        }
        let types: Vec<_> = node.inputs.iter().map(|&v| graph.ty(v)).collect();
        match node.op.infer(&types, node.outputs.len()) {
            Err(message) => err(at(), message),
            Ok(expected) => {
                let mut types_ok = true;
                for (i, (want, &o)) in expected.iter().zip(&node.outputs).enumerate() {
                    if graph.ty(o) != want {
                        err(at(), format!("output {i} has type {} but the op produces {want}", graph.ty(o)));
                        types_ok = false;
                    }
                }
                if types_ok && placements_ok {
                    check_placements(graph, node, &at, &mut *err);
                }
            }
        }
    }
}

/// Outputs and updates refer to defined values; an update sets a parameter or state once, with
/// its type.
fn check_outputs_and_updates(
    graph: &Graph,
    names: &ValueNames,
    defined: &[bool],
    err: &mut impl FnMut(String, String),
) {
    for (name, v) in graph.outputs() {
        if v.index() >= graph.num_values() || !defined[v.index()] {
            err(format!("output \"{name}\""), "refers to a value that is not defined".into());
        }
    }
    let mut updated = std::collections::BTreeSet::new();
    for (target, value) in graph.updates() {
        if target.index() >= graph.num_values() || value.index() >= graph.num_values() || !defined[value.index()] {
            err("an update".into(), "refers to a value that is not defined".into());
            continue;
        }
        let at = format!("update {}", names.get(*target));
        if !matches!(graph.value(*target).def, Def::Param(_) | Def::State(_)) {
            err(at.clone(), "can only update a parameter or a state".into());
        }
        if graph.ty(*target) != graph.ty(*value) {
            err(
                at.clone(),
                format!(
                    "takes {} ({}), which is not its type {}",
                    names.get(*value),
                    graph.ty(*value),
                    graph.ty(*target)
                ),
            );
        }
        if !updated.insert(*target) {
            err(at, "is updated twice".into());
        }
    }
}

/// Outputs are replicated, and an update's value is placed like its target.
fn check_placed_outputs_and_updates(graph: &Graph, names: &ValueNames, err: &mut impl FnMut(String, String)) {
    for (name, v) in graph.outputs() {
        if v.index() < graph.num_values() && graph.value(*v).placements.iter().any(|p| *p != Placement::Replicate) {
            err(format!("output \"{name}\""), "must be replicated on every mesh axis".into());
        }
    }
    for (target, value) in graph.updates() {
        if value.index() < graph.num_values()
            && target.index() < graph.num_values()
            && graph.value(*target).placements != graph.value(*value).placements
        {
            err(format!("update {}", names.get(*target)), "takes a value placed differently from it".into());
        }
    }
}

/// Fusions cover ordered, disjoint node ranges of kernel work; one holding optimizer updates is
/// one multi-tensor step.
fn check_fusions(graph: &Graph, err: &mut impl FnMut(String, String)) {
    let mut previous_end = 0;
    for fusion in graph.fusions() {
        let at = format!("fusion {}", fusion.name);
        if fusion.nodes.is_empty() || fusion.nodes.start < previous_end || fusion.nodes.end > graph.num_nodes() {
            err(at, format!("covers nodes {:?}, which are empty, out of order or past the graph", fusion.nodes));
            continue;
        }
        previous_end = fusion.nodes.end;
        let nodes: Vec<NodeId> = fusion.node_ids().collect();
        let updates = nodes.iter().any(|&n| matches!(graph.node(n).op, Op::AdamW { .. } | Op::Sgd { .. }));
        if updates && crate::lower::multi_tensor_optimizer(graph, &nodes).is_none() {
            err(
                at.clone(),
                "mixes optimizer updates with other ops, hyperparameters, scalars or dtypes (a multi-tensor step applies one rule)"
                    .into(),
            );
        }
        for id in fusion.node_ids() {
            let op = &graph.node(id).op;
            if matches!(op, Op::Constant { .. } | Op::Collective { .. } | Op::Wait | Op::Send { .. } | Op::Recv { .. })
            {
                err(at.clone(), format!("holds {}, which is not a kernel's work", op.name()));
            }
        }
    }
}

/// An asynchronous collective's result is used by exactly one `wait` (and nothing else); a
/// `wait` waits for an asynchronous collective.
fn check_waits(graph: &Graph, names: &ValueNames, err: &mut impl FnMut(String, String)) {
    // Counted here rather than with `use_counts`: an invalid graph may name values that do not
    // exist, and the verifier reports rather than panics.
    let mut uses = vec![0usize; graph.num_values()];
    let used = graph.nodes().flat_map(|(_, n)| n.inputs.iter()).chain(graph.outputs().iter().map(|(_, v)| v));
    for v in used.chain(graph.updates().iter().map(|(_, v)| v)) {
        if let Some(count) = uses.get_mut(v.index()) {
            *count += 1;
        }
    }
    let mut waited = vec![false; graph.num_values()];
    for (id, node) in graph.nodes() {
        if node.op != Op::Wait {
            continue;
        }
        let Some(&input) = node.inputs.first().filter(|v| v.index() < graph.num_values()) else { continue };
        let started = match graph.value(input).def {
            Def::Node(p, _) => matches!(graph.node(p).op, Op::Collective { start: true, .. }),
            _ => false,
        };
        if !started {
            err(
                names.node(graph, id),
                format!("waits for {}, which is not an asynchronous collective", names.get(input)),
            );
        }
        waited[input.index()] = true;
    }
    for (id, node) in graph.nodes() {
        if let (Op::Collective { start: true, .. }, Some(&out)) = (&node.op, node.outputs.first()) {
            if !waited[out.index()] || uses[out.index()] != 1 {
                err(names.node(graph, id), "must be used by exactly one wait and nothing else".into());
            }
        }
    }
}

/// Whether `node` casts a partial sum on mesh axis `a` to a narrower float type for reductions
/// over that axis alone to sum (`--comm-dtype`): each rank rounds its own part, deliberately,
/// so the reduction moves and sums the narrower type. No sharding rule makes this (it is not
/// the single-device program's cast of the sum); the `shard` pass asks for it.
fn rounds_before_reduction(graph: &Graph, node: &crate::Node, a: usize) -> bool {
    let (Op::Cast { to }, [input], [output]) = (&node.op, &node.inputs[..], &node.outputs[..]) else { return false };
    let partial = |v: crate::ValueId| graph.value(v).placements[a] == Placement::PartialSum;
    let from = graph.ty(*input).dtype;
    if !(from.is_float() && to.is_float() && to.size() < from.size() && partial(*input) && partial(*output)) {
        return false;
    }
    let axis = &graph.mesh.axes[a].name;
    let mut readers = graph.nodes().filter(|(_, n)| n.inputs.contains(output)).peekable();
    readers.peek().is_some()
        && readers.all(|(_, n)| {
            matches!(&n.op, Op::Collective { kind: crate::Collective::AllReduce | crate::Collective::ReduceScatter { .. }, axis: on, .. } if on == axis)
        })
}

/// Whether `node` is an expert lookup by dispatched ids (or its gradient's scatter into the
/// table), placed as expert parallelism runs it on mesh axis `a`: the table, the ids and the
/// result split alike on their first dim, the ids by destination (the exchanged buffers'
/// dim 1, [`crate::sharding::dispatched_by`]).
fn looks_up_its_own_experts(
    graph: &Graph,
    node: &crate::Node,
    a: usize,
    current: &[Placement],
    actual: &[Placement],
) -> bool {
    let ids = match (&node.op, &node.inputs[..]) {
        (Op::Gather { axis: 0 }, [_, ids]) | (Op::ScatterAdd { axis: 0, .. }, [ids, _]) => *ids,
        _ => return false,
    };
    let by_destination = crate::sharding::dispatched_by(graph, ids)
        .is_some_and(|exchanged| graph.value(exchanged).placements[a] == Placement::Shard(1));
    let split = Placement::Shard(0);
    by_destination && current.iter().chain(actual).all(|p| *p == split)
}

/// Whether a node's output placements are its rule's, or a block the op computes directly
/// where the rule gives a replicated output ([`crate::sharding::computes_block`]).
fn outputs_follow(
    rule: &[Placement],
    actual: &[Placement],
    op: &crate::Op,
    types: &[&crate::TensorType],
    out_types: &[&crate::TensorType],
) -> bool {
    rule.len() == actual.len()
        && rule.iter().zip(actual).all(|(r, a)| match (r, a) {
            (Placement::Replicate, Placement::Shard(d)) => crate::sharding::computes_block(op, types, out_types, *d),
            _ => r == a,
        })
}

fn check_placements(graph: &Graph, node: &crate::Node, at: &dyn Fn() -> String, err: &mut impl FnMut(String, String)) {
    if let Op::Collective { axis, .. } = &node.op {
        if !graph.mesh.axes.iter().any(|a| &a.name == axis) {
            err(at(), format!("names mesh axis '{axis}', which the mesh does not have"));
            return;
        }
    }
    for (a, axis) in graph.mesh.axes.iter().enumerate() {
        let current: Vec<Placement> = node.inputs.iter().map(|&v| graph.value(v).placements[a]).collect();
        let actual: Vec<Placement> = node.outputs.iter().map(|&v| graph.value(v).placements[a]).collect();
        if looks_up_its_own_experts(graph, node, a, &current, &actual) {
            continue;
        }
        let within = |v: &crate::ValueId| {
            crate::sharding::type_within_outer_axes(&graph.mesh, graph.ty(*v), &graph.value(*v).placements, a)
        };
        let (types, out_types): (Vec<_>, Vec<_>) =
            (node.inputs.iter().map(within).collect(), node.outputs.iter().map(within).collect());
        let (types, out_types): (Vec<_>, Vec<_>) = (types.iter().collect(), out_types.iter().collect());
        let rule = crate::sharding::axis_rule(&node.op, &types, &out_types, &current, axis);
        if rule.inputs != current && rounds_before_reduction(graph, node, a) {
            continue;
        }
        if rule.inputs != current {
            let show: Vec<String> = rule.inputs.iter().map(|p| p.to_string()).collect();
            err(at(), format!("needs its inputs as [{}] on mesh axis {}", show.join(", "), axis.name));
        } else if !outputs_follow(&rule.outputs, &actual, &node.op, &types, &out_types) {
            let show: Vec<String> = rule.outputs.iter().map(|p| p.to_string()).collect();
            err(at(), format!("gives [{}] on mesh axis {}, not what its outputs say", show.join(", "), axis.name));
        }
    }
}
