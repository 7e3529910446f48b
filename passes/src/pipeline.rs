//! Pipeline stages (`--pp P`): where the forward pass is cut ([`partition`]); the stage
//! graphs and their schedule are built on the cuts in [`schedule`].
//!
//! A cut can go between two forward nodes (in graph order) where exactly one activation crosses
//! it: the hidden state between blocks (and inside a pre-norm block, after its first residual
//! add). Only values computed from the batch count: those from constants and parameters alone
//! (position ids, rotary tables, causal masks, a weight's transpose) a stage computes itself,
//! and a parameter used on two stages (tied embeddings) is held by both.
//!
//! The stages are balanced by a cost model (FLOPs: `2mnk` per matmul, one per element read or
//! written elsewhere, whichever are more), choosing the cuts that minimise the most expensive stage, or placed where the
//! user names them: a cut named `PREFIX` goes right before the first forward use of a
//! parameter whose name starts with `PREFIX` (`model.layers.2` cuts before the third layer).
//!
//! Tests: tests/pipeline.rs.

use autotp_ir::{Def, Graph, Op, ValueId};

use crate::PassError;

pub mod schedule;

pub use schedule::{bubble_fraction, Chunk, Pipeline, Schedule, PIPE_IN, PIPE_OUT};

const PASS: &str = "pipeline";

fn invalid(message: String) -> PassError {
    PassError::Invalid { pass: PASS, message }
}

/// The forward pass cut into stages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stages {
    /// Node positions (in graph order) of the forward nodes; stage `s` runs
    /// `forward[starts[s]..starts[s + 1]]` (the last stage to the end).
    pub forward: Vec<usize>,
    pub starts: Vec<usize>,
    /// The activation crossing each cut (`P - 1` of them), sent from stage `s` to `s + 1`.
    pub boundaries: Vec<ValueId>,
    /// Each stage's forward cost in FLOPs.
    pub flops: Vec<u64>,
    /// Each stage's parameters, by name (a parameter used on two stages is on both).
    pub params: Vec<Vec<String>>,
}

/// The forward nodes (positions in graph order): those with an output the loss depends on.
fn forward_nodes(graph: &Graph) -> Vec<usize> {
    let mut needed = vec![false; graph.num_values()];
    for (name, v) in graph.outputs() {
        if name == crate::loss::LOSS {
            needed[v.index()] = true;
        }
    }
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let mut forward = Vec::new();
    for (i, node) in nodes.iter().enumerate().rev() {
        if node.outputs.iter().any(|o| needed[o.index()]) {
            forward.push(i);
            for v in &node.inputs {
                needed[v.index()] = true;
            }
        }
    }
    forward.reverse();
    forward
}

/// Which values are activations: those computed from the batch (graph inputs with dims). The
/// rest (from constants and parameters alone) a stage computes itself.
fn activations(graph: &Graph) -> Vec<bool> {
    let mut activation = vec![false; graph.num_values()];
    for &v in graph.inputs() {
        activation[v.index()] = graph.ty(v).rank() > 0;
    }
    for (_, node) in graph.nodes() {
        let any = node.inputs.iter().any(|v| activation[v.index()]);
        for o in &node.outputs {
            activation[o.index()] = any;
        }
    }
    activation
}

impl Stages {
    /// Positions in `forward` of stage `s`'s nodes.
    pub fn range(&self, s: usize) -> std::ops::Range<usize> {
        self.starts[s]..self.starts.get(s + 1).copied().unwrap_or(self.forward.len())
    }
}

/// A node's cost in FLOPs.
fn flops(graph: &Graph, node: &autotp_ir::Node) -> u64 {
    let out = graph.ty(node.outputs[0]);
    match node.op {
        Op::MatMul { transpose_lhs, .. } => {
            let lhs = &graph.ty(node.inputs[0]).shape;
            let k = if transpose_lhs { lhs[lhs.len() - 2] } else { lhs[lhs.len() - 1] };
            2 * (out.numel() * k) as u64
        }
        Op::Constant { .. } | Op::Reshape { .. } => 0,
        // Reductions (a loss over its scores) read more than they write.
        _ => {
            let elements = |values: &[ValueId]| values.iter().map(|&v| graph.ty(v).numel() as u64).sum::<u64>();
            elements(&node.inputs).max(elements(&node.outputs))
        }
    }
}

/// Cuts the forward pass of `graph` (a differentiated graph or a training step with a `loss`
/// output) into `stages`, at the parameter prefixes `named` (`stages - 1` of them, in forward
/// order) or, when none are named, where the stages' costs are most even.
pub fn partition(graph: &Graph, stages: usize, named: &[String]) -> Result<Stages, PassError> {
    if stages == 0 {
        return Err(invalid("--pp must be at least 1".into()));
    }
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let forward = forward_nodes(graph);
    if forward.is_empty() {
        return Err(invalid(format!("the graph has no '{}' output to cut the forward pass of", crate::loss::LOSS)));
    }
    let activation = activations(graph);
    // Last forward position using each value.
    let mut last_use = vec![None; graph.num_values()];
    for (k, &i) in forward.iter().enumerate() {
        for v in &nodes[i].inputs {
            last_use[v.index()] = Some(k);
        }
    }
    // Candidate cuts: before forward position k, exactly one activation crosses.
    let mut boundary_at: Vec<Option<ValueId>> = vec![None; forward.len()];
    let mut live: Vec<ValueId> = Vec::new();
    for (k, &i) in forward.iter().enumerate() {
        live.retain(|v| last_use[v.index()].is_some_and(|last| last >= k));
        if let [only] = live[..] {
            boundary_at[k] = Some(only);
        }
        for &o in &nodes[i].outputs {
            if activation[o.index()] && last_use[o.index()].is_some_and(|last| last > k) {
                live.push(o);
            }
        }
    }
    let cost: Vec<u64> = forward.iter().map(|&i| flops(graph, nodes[i])).collect();
    let candidates: Vec<usize> = (1..forward.len()).filter(|&k| boundary_at[k].is_some()).collect();
    let uses_param: Vec<bool> =
        forward.iter().map(|&i| nodes[i].inputs.iter().any(|&v| matches!(graph.value(v).def, Def::Param(_)))).collect();
    let cuts = if named.is_empty() {
        balanced_cuts(&cost, &uses_param, &candidates, stages)?
    } else {
        named_cuts(graph, &nodes, &forward, &boundary_at, stages, named)?
    };
    let mut starts = vec![0];
    starts.extend(&cuts);
    let boundaries = cuts.iter().map(|&k| boundary_at[k].expect("a candidate")).collect();
    let mut result = Stages { forward, starts, boundaries, flops: Vec::new(), params: Vec::new() };
    result.flops = (0..stages).map(|s| cost[result.range(s)].iter().sum()).collect();
    result.params = (0..stages)
        .map(|s| {
            let mut names: Vec<String> = result.forward[result.range(s)]
                .iter()
                .flat_map(|&i| nodes[i].inputs.iter())
                .filter(|&&v| matches!(graph.value(v).def, Def::Param(_)))
                .map(|&v| graph.name_of(v).unwrap_or("").to_string())
                .collect();
            names.sort();
            names.dedup();
            names
        })
        .collect();
    Ok(result)
}

/// The `stages - 1` candidate cuts minimising the most expensive stage (dynamic programming
/// over the candidates, which are few: one per block boundary), each stage holding a
/// parameter (a stage of the loss alone would have nothing to train).
fn balanced_cuts(
    cost: &[u64],
    uses_param: &[bool],
    candidates: &[usize],
    stages: usize,
) -> Result<Vec<usize>, PassError> {
    if stages - 1 > candidates.len() {
        return Err(invalid(format!(
            "--pp {stages} needs {} cuts, but the forward pass has only {} places where one activation \
             crosses (about one per layer)",
            stages - 1,
            candidates.len()
        )));
    }
    let mut prefix = vec![0u64; cost.len() + 1];
    let mut param_uses = vec![0usize; cost.len() + 1];
    for (k, c) in cost.iter().enumerate() {
        prefix[k + 1] = prefix[k] + c;
        param_uses[k + 1] = param_uses[k] + uses_param[k] as usize;
    }
    // Positions a stage may start at: 0 and every candidate; the last stage ends at the end.
    let mut points = vec![0];
    points.extend(candidates);
    let end = cost.len();
    // best[s][j]: the least maximum stage cost covering [0, points[j]) with s stages, and the
    // start of the last of them.
    let n = points.len();
    let mut best = vec![vec![(u64::MAX, 0usize); n + 1]; stages + 1];
    best[0][0] = (0, 0);
    let position = |j: usize| if j == n { end } else { points[j] };
    for s in 1..=stages {
        for j in 1..=n {
            for i in 0..j {
                let (before, _) = best[s - 1][i];
                if before == u64::MAX || param_uses[position(j)] == param_uses[position(i)] {
                    continue;
                }
                let stage = prefix[position(j)] - prefix[position(i)];
                let worst = before.max(stage);
                if worst < best[s][j].0 {
                    best[s][j] = (worst, i);
                }
            }
        }
    }
    if best[stages][n].0 == u64::MAX {
        return Err(invalid(format!(
            "--pp {stages}: the forward pass cannot be cut into {stages} stages that each hold parameters"
        )));
    }
    let mut cuts = Vec::new();
    let mut j = n;
    for s in (1..=stages).rev() {
        let i = best[s][j].1;
        if s > 1 {
            cuts.push(points[i]);
        }
        j = i;
    }
    cuts.reverse();
    Ok(cuts)
}

/// The cuts the user named: each right before the first forward use of a parameter whose
/// name starts with the given prefix.
fn named_cuts(
    graph: &Graph,
    nodes: &[&autotp_ir::Node],
    forward: &[usize],
    boundary_at: &[Option<ValueId>],
    stages: usize,
    named: &[String],
) -> Result<Vec<usize>, PassError> {
    if named.len() != stages - 1 {
        return Err(invalid(format!("--pp {stages} needs {} --pp-cuts, got {}", stages - 1, named.len())));
    }
    let mut cuts = Vec::new();
    for prefix in named {
        let uses_prefix = |k: usize| {
            nodes[forward[k]].inputs.iter().any(|&v| {
                matches!(graph.value(v).def, Def::Param(_)) && graph.name_of(v).is_some_and(|n| n.starts_with(prefix))
            })
        };
        let first = (0..forward.len()).find(|&k| uses_prefix(k)).ok_or_else(|| {
            invalid(format!(
                "--pp-cuts '{prefix}': no parameter of the forward pass is named so (a prefix such as a layer's)"
            ))
        })?;
        // The nearest boundary at or before the first use.
        let cut = (1..=first).rev().find(|&k| boundary_at[k].is_some()).ok_or_else(|| {
            invalid(format!("--pp-cuts '{prefix}': no single activation crosses before its first use"))
        })?;
        if cuts.last().is_some_and(|&previous| previous >= cut) {
            return Err(invalid(format!(
                "--pp-cuts '{prefix}' does not come after the cut before it in the forward pass"
            )));
        }
        cuts.push(cut);
    }
    Ok(cuts)
}
