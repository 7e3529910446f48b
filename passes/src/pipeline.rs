//! Pipeline stages (`--pp P`): where the forward pass is cut ([`partition`]); the stage
//! graphs and their schedule are built on the cuts in [`schedule`].
//!
//! A cut can go between two forward nodes (in graph order) where exactly one activation crosses
//! it: the hidden state between blocks (and inside a pre-norm block, after its first residual
//! add). Only values computed from the batch count: those from constants and parameters alone
//! (position ids, rotary tables, causal masks, a weight's transpose) a stage computes itself,
//! and a parameter used on two stages (tied embeddings) is held by both.
//!
//! The stages are balanced by a cost model of time and memory. Time is a forward node's cost
//! and that of the backward nodes its gradient rule makes ([`Autodiff::differentiate`] says
//! which), each [`time_cost`]: `2mnk` per matmul, and elsewhere [`ELEMENT_FLOPS`] per element
//! read or written, whichever are more, since those ops are bound by memory traffic. Memory is
//! a stage's parameters with their gradients and optimizer states, and its activations times
//! the micro-batches the schedule keeps in flight on it. The cuts make the slowest stage as
//! fast as it can be and, among those, the fullest stage as small as it can be (when one
//! stage, such as a large LM head, sets the pace, the other cuts move to even out memory). Or
//! the cuts go where the user names them: a cut named `PREFIX` goes right before the first
//! forward use of a parameter whose name starts with `PREFIX` (`model.layers.2` cuts before
//! the third layer).
//!
//! As in Megatron, a model whose parameters are numbered layers (`model.layers.0`, ...,
//! [`numbered_layers`]) is cut into at most as many stages as it has layers, the embedding
//! riding on the first stage and the head on the last; the cuts themselves may fall inside a
//! layer where that balances the stages better.
//!
//! Tests: tests/pipeline.rs.

use autotp_ir::{Def, Graph, Op, ValueId};

use crate::autodiff::Autodiff;
use crate::PassError;

pub mod schedule;
mod step_graph;

pub use schedule::{
    bubble_fraction, chunks_in_flight, stage_idle_fractions, Chunk, ChunkCosts, ChunksInFlight, Pipeline,
    PipelineBackward, PipelineSchedule, Work, PIPE_IN, PIPE_OUT,
};

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
    /// Each stage's forward and backward time per micro-batch by the cost model ([`time_cost`]),
    /// which the cuts balance.
    pub time: Vec<u64>,
    /// Each stage's work per micro-batch by part, from its differentiated graph (set by
    /// [`Pipeline::run`]; empty from [`partition`] alone).
    pub chunk_costs: Vec<ChunkCosts>,
    /// Each stage's memory as the cost model estimates it, in bytes (parameters with their
    /// gradients and optimizer states, activations of the micro-batches in flight).
    pub memory: Vec<u64>,
    /// Each stage's parameters, by name (a parameter used on two stages is on both).
    pub params: Vec<Vec<String>>,
}

/// A model's repeated layers, as its parameter names number them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumberedLayers {
    /// What the numbers follow (`model.layers`).
    pub prefix: String,
    /// The layer numbers, in increasing order.
    pub numbers: Vec<u64>,
}

impl NumberedLayers {
    /// The layer number of the parameter `name` (`PREFIX.N.rest`), if it is in a layer.
    pub fn number_of(&self, name: &str) -> Option<u64> {
        let rest = name.strip_prefix(&self.prefix)?.strip_prefix('.')?;
        rest.split('.').next()?.parse().ok()
    }
}

/// The layers of a model whose parameters are named `PREFIX.N.rest` (the first all-digit part
/// of a dotted name is the layer number): the prefix with the most numbers (the first in name
/// order among equals; `layers.N` and `norms.N` of one model number the same layers). None
/// when no parameter name has a number.
pub fn numbered_layers(graph: &Graph) -> Option<NumberedLayers> {
    let mut numbers: std::collections::BTreeMap<String, std::collections::BTreeSet<u64>> = Default::default();
    for &param in graph.params() {
        let Some(name) = graph.name_of(param) else { continue };
        let parts: Vec<&str> = name.split('.').collect();
        let numbered = parts.iter().enumerate().skip(1).find_map(|(i, part)| Some((i, part.parse::<u64>().ok()?)));
        if let Some((i, number)) = numbered {
            numbers.entry(parts[..i].join(".")).or_default().insert(number);
        }
    }
    let most = numbers.values().map(|n| n.len()).max()?;
    let (prefix, numbers) = numbers.into_iter().find(|(_, n)| n.len() == most)?;
    Some(NumberedLayers { prefix, numbers: numbers.into_iter().collect() })
}

/// The forward nodes (positions in graph order): those with an output the loss depends on,
/// or (on a stage) the activation sent to the next stage.
pub(crate) fn forward_nodes(graph: &Graph) -> Vec<usize> {
    let outputs = graph.outputs().iter().filter(|(name, _)| name == crate::loss::LOSS || name == PIPE_OUT);
    let mut roots: Vec<ValueId> = outputs.map(|(_, v)| *v).collect();
    for (_, node) in graph.nodes() {
        if let Op::Send { message: autotp_ir::Message::Activation, .. } = node.op {
            roots.extend(&node.inputs);
        }
    }
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let needed = needed_by(&nodes, graph.num_values(), &roots, |_| true);
    (0..nodes.len()).filter(|&i| needed[i]).collect()
}

/// The nodes (by position, among those `eligible`) that computing `roots` needs.
pub(crate) fn needed_by(
    nodes: &[&autotp_ir::Node],
    values: usize,
    roots: &[ValueId],
    eligible: impl Fn(usize) -> bool,
) -> Vec<bool> {
    let mut needed = vec![false; values];
    for root in roots {
        needed[root.index()] = true;
    }
    let mut chosen = vec![false; nodes.len()];
    for (i, node) in nodes.iter().enumerate().rev() {
        if eligible(i) && node.outputs.iter().any(|o| needed[o.index()]) {
            chosen[i] = true;
            for v in &node.inputs {
                needed[v.index()] = true;
            }
        }
    }
    chosen
}

/// Which values are activations: those computed from the batch (graph inputs with dims, or on
/// a stage the activations received). The rest (from constants and parameters alone) a stage
/// computes itself.
pub(crate) fn activations(graph: &Graph) -> Vec<bool> {
    let mut activation = vec![false; graph.num_values()];
    for &v in graph.inputs() {
        activation[v.index()] = graph.ty(v).rank() > 0;
    }
    for (_, node) in graph.nodes() {
        let received = matches!(node.op, Op::Recv { message: autotp_ir::Message::Activation, .. });
        let any = received || node.inputs.iter().any(|v| activation[v.index()]);
        for o in &node.outputs {
            activation[o.index()] = any;
        }
    }
    activation
}

/// For each forward position `k` (an index into `forward`, positions of `nodes`) where at most
/// one `counted` value made before it is read at or after it: `k` and those values (none or
/// one). The cuts of the forward pass where one activation, or none, crosses.
pub(crate) fn single_activation_cuts(
    nodes: &[&autotp_ir::Node],
    forward: &[usize],
    counted: &[bool],
) -> Vec<(usize, Vec<ValueId>)> {
    // Last forward position using each value.
    let mut last_use = vec![None; counted.len()];
    for (k, &i) in forward.iter().enumerate() {
        for v in &nodes[i].inputs {
            last_use[v.index()] = Some(k);
        }
    }
    let mut cuts = Vec::new();
    let mut live: Vec<ValueId> = Vec::new();
    for (k, &i) in forward.iter().enumerate() {
        live.retain(|v| last_use[v.index()].is_some_and(|last| last >= k));
        if live.len() <= 1 {
            cuts.push((k, live.clone()));
        }
        for &o in &nodes[i].outputs {
            if counted[o.index()] && last_use[o.index()].is_some_and(|last| last > k) {
                live.push(o);
            }
        }
    }
    cuts
}

impl Stages {
    /// Positions in `forward` of stage `s`'s nodes.
    pub fn range(&self, s: usize) -> std::ops::Range<usize> {
        self.starts[s]..self.starts.get(s + 1).copied().unwrap_or(self.forward.len())
    }
}

/// What reading or writing one element costs an op other than a matmul, in the time a matmul
/// takes for a FLOP. On the CPU ranks one core ran the uniform fixture's training step (16 x 64
/// tokens, `autotp run --profile`, one kernel thread) with its 818 MFLOP of matmuls in 14.6 ms
/// (56 GFLOP/s) and its other ops' 47.9 M elements in 66.9 ms (0.72 G elements/s): an element
/// cost about 78 FLOPs there. 32 is a round figure below that; it already cuts that fixture's
/// equal layers evenly (counting an element as one FLOP put the cuts of 4 stages before layer
/// norms, and stages the model called equal took 76 to 104 ms of CPU time per step).
pub const ELEMENT_FLOPS: u64 = 32;

/// A node's cost in FLOPs: `2mnk` for a matmul, one per element read or written (whichever are
/// more) elsewhere.
fn flops(graph: &Graph, node: &autotp_ir::Node) -> u64 {
    matmul_flops(graph, node).unwrap_or_else(|| elements(graph, node))
}

/// A node's time by the cost model, in matmul FLOPs: a matmul's FLOPs; elsewhere
/// [`ELEMENT_FLOPS`] per element read or written (whichever are more).
pub fn time_cost(graph: &Graph, node: &autotp_ir::Node) -> u64 {
    matmul_flops(graph, node).unwrap_or_else(|| ELEMENT_FLOPS * elements(graph, node))
}

/// `2mnk` when `node` is a matmul.
pub(crate) fn matmul_flops(graph: &Graph, node: &autotp_ir::Node) -> Option<u64> {
    let Op::MatMul { transpose_lhs, .. } = node.op else { return None };
    let lhs = &graph.ty(node.inputs[0]).shape;
    let k = if transpose_lhs { lhs[lhs.len() - 2] } else { lhs[lhs.len() - 1] };
    Some(2 * (graph.ty(node.outputs[0]).numel() * k) as u64)
}

/// The elements a node reads or writes, whichever are more (a reduction, such as a loss over
/// its scores, reads more than it writes); none for constants and reshapes.
fn elements(graph: &Graph, node: &autotp_ir::Node) -> u64 {
    if matches!(node.op, Op::Constant { .. } | Op::Reshape { .. }) {
        return 0;
    }
    let count = |values: &[ValueId]| values.iter().map(|&v| graph.ty(v).numel() as u64).sum::<u64>();
    count(&node.inputs).max(count(&node.outputs))
}

/// Each forward position's time: its node's and that of the backward nodes its gradient rule
/// makes (with respect to every parameter: a frozen one's few are counted too). `nodes` are
/// `graph`'s, in order.
fn forward_and_backward_times(
    graph: &Graph,
    nodes: &[&autotp_ir::Node],
    forward: &[usize],
) -> Result<Vec<u64>, PassError> {
    let (differentiated, origins) = Autodiff::new(crate::loss::LOSS).differentiate(graph)?;
    let mut backward = vec![0u64; graph.num_nodes()];
    for ((_, node), origin) in differentiated.nodes().zip(&origins) {
        if let Some(origin) = origin {
            backward[origin.index()] += time_cost(&differentiated, node);
        }
    }
    Ok(forward.iter().map(|&i| time_cost(graph, nodes[i]) + backward[i]).collect())
}

/// Cuts the forward pass of `graph` (a differentiated graph or a training step with a `loss`
/// output) into `stages`, at the parameter prefixes `named` (`stages - 1` of them, in forward
/// order) or, when none are named, where the slowest stage is fastest and then the fullest
/// stage smallest, stage `s` holding the activations of `in_flight[s]` micro-batches.
pub fn partition(graph: &Graph, stages: usize, named: &[String], in_flight: &[usize]) -> Result<Stages, PassError> {
    if stages == 0 {
        return Err(invalid("--pp must be at least 1".into()));
    }
    assert_eq!(in_flight.len(), stages, "one in-flight count per stage");
    if let Some(layers) = numbered_layers(graph).filter(|layers| layers.numbers.len() < stages) {
        let (first, last) = (layers.numbers[0], layers.numbers[layers.numbers.len() - 1]);
        return Err(invalid(format!(
            "--pp {stages} asks for more stages than the model has layers ({count}: {prefix}.{first} to \
             {prefix}.{last}); use --pp {count} or fewer",
            count = layers.numbers.len(),
            prefix = layers.prefix
        )));
    }
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let forward = forward_nodes(graph);
    if forward.is_empty() {
        return Err(invalid(format!("the graph has no '{}' output to cut the forward pass of", crate::loss::LOSS)));
    }
    let activation = activations(graph);
    // Candidate cuts: before forward position k, exactly one activation crosses.
    let mut boundary_at: Vec<Option<ValueId>> = vec![None; forward.len()];
    for (k, live) in single_activation_cuts(&nodes, &forward, &activation) {
        if let [only] = live[..] {
            boundary_at[k] = Some(only);
        }
    }
    let cost: Vec<u64> = forward.iter().map(|&i| flops(graph, nodes[i])).collect();
    let time = forward_and_backward_times(graph, &nodes, &forward)?;
    let activation_bytes: Vec<u64> = forward
        .iter()
        .map(|&i| {
            let outputs = nodes[i].outputs.iter().filter(|o| activation[o.index()]);
            outputs.map(|&o| graph.ty(o).size_bytes() as u64).sum()
        })
        .collect();
    let params: Vec<Vec<(ValueId, u64)>> = forward
        .iter()
        .map(|&i| {
            let inputs = nodes[i].inputs.iter().filter(|&&v| matches!(graph.value(v).def, Def::Param(_)));
            inputs.map(|&v| (v, graph.ty(v).size_bytes() as u64)).collect()
        })
        .collect();
    let candidates: Vec<usize> = (1..forward.len()).filter(|&k| boundary_at[k].is_some()).collect();
    let uses_param: Vec<bool> = params.iter().map(|p| !p.is_empty()).collect();
    let costs = Costs { time: &time, activation_bytes: &activation_bytes, params: &params, in_flight };
    let cuts = if named.is_empty() {
        balanced_cuts(&costs, &uses_param, &candidates, stages)?
    } else {
        named_cuts(graph, &nodes, &forward, &boundary_at, stages, named)?
    };
    let mut starts = vec![0];
    starts.extend(&cuts);
    let boundaries = cuts.iter().map(|&k| boundary_at[k].expect("a candidate")).collect();
    let mut result = Stages {
        forward,
        starts,
        boundaries,
        flops: Vec::new(),
        time: Vec::new(),
        chunk_costs: Vec::new(),
        memory: Vec::new(),
        params: Vec::new(),
    };
    result.flops = (0..stages).map(|s| cost[result.range(s)].iter().sum()).collect();
    result.time = (0..stages).map(|s| time[result.range(s)].iter().sum()).collect();
    result.memory = (0..stages).map(|s| costs.memory(s, result.range(s))).collect();
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

/// Bytes a trained parameter costs its stage: the weight, its gradient and AdamW's two moments.
const PARAM_COPIES: u64 = 4;

/// What the balanced cuts weigh, per forward position.
struct Costs<'a> {
    /// Forward and backward time ([`time_cost`]).
    time: &'a [u64],
    /// Bytes of the activations computed (what the backward may keep, per micro-batch).
    activation_bytes: &'a [u64],
    /// The parameters used, with their bytes.
    params: &'a [Vec<(ValueId, u64)>],
    /// Micro-batches each stage holds in flight under the schedule.
    in_flight: &'a [usize],
}

impl Costs<'_> {
    /// Stage `s`'s estimated memory if it runs forward positions `range`.
    fn memory(&self, s: usize, range: std::ops::Range<usize>) -> u64 {
        let end = range.end;
        self.memory_of(s, self.footprints(range.start, &[end])[0])
    }

    /// Stage `s`'s estimated memory from the footprint of its positions: its parameters with
    /// their gradients and optimizer states, and its activations for every micro-batch in flight.
    fn memory_of(&self, s: usize, footprint: Footprint) -> u64 {
        PARAM_COPIES * footprint.param_bytes + self.in_flight[s] as u64 * footprint.activation_bytes
    }

    /// The footprints of the runs of positions from `start` to each of `ends` (increasing), in
    /// one sweep.
    fn footprints(&self, start: usize, ends: &[usize]) -> Vec<Footprint> {
        let mut seen = std::collections::BTreeSet::new();
        let mut run = Footprint::default();
        let mut footprints = Vec::with_capacity(ends.len());
        let mut k = start;
        for &end in ends {
            for position in k..end {
                for &(param, bytes) in &self.params[position] {
                    if seen.insert(param) {
                        run.param_bytes += bytes;
                    }
                }
                run.activation_bytes += self.activation_bytes[position];
            }
            k = k.max(end);
            footprints.push(run);
        }
        footprints
    }
}

/// What a run of forward positions holds (a parameter used twice counted once).
#[derive(Copy, Clone, Default)]
struct Footprint {
    param_bytes: u64,
    activation_bytes: u64,
}

/// The `stages - 1` candidate cuts that make the slowest stage as fast as it can be (by
/// forward and backward time) and, among those, the fullest stage (by estimated memory) as
/// small as it can be, each stage holding a parameter (a stage of the loss alone would have
/// nothing to train).
/// Both are the same dynamic programme over the candidates, which are few (one per block
/// boundary): first the least slowest-stage cost, then the least fullest-stage memory over the
/// stages within it.
fn balanced_cuts(
    costs: &Costs,
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
    let end = costs.time.len();
    let mut prefix = vec![0u64; end + 1];
    let mut param_uses = vec![0usize; end + 1];
    for k in 0..end {
        prefix[k + 1] = prefix[k] + costs.time[k];
        param_uses[k + 1] = param_uses[k] + uses_param[k] as usize;
    }
    // Where a stage may start: 0 and every candidate; the last stage ends at the end.
    let mut points = vec![0];
    points.extend(candidates);
    points.push(end);
    let time = |_: usize, i: usize, j: usize| prefix[points[j]] - prefix[points[i]];
    let slowest = least_worst_stage(&points, &param_uses, stages, time, |_, _, _| true)
        .map(|(worst, _)| worst)
        .ok_or_else(|| {
            invalid(format!(
                "--pp {stages}: the forward pass cannot be cut into {stages} stages that each hold parameters"
            ))
        })?;
    // footprints[i][j - i - 1]: stage over points i..j.
    let footprints: Vec<Vec<Footprint>> =
        (0..points.len()).map(|i| costs.footprints(points[i], &points[i + 1..])).collect();
    let memory = |s: usize, i: usize, j: usize| costs.memory_of(s, footprints[i][j - i - 1]);
    let fits = |_: usize, i: usize, j: usize| time(0, i, j) <= slowest;
    let (_, cuts) = least_worst_stage(&points, &param_uses, stages, memory, fits).expect("the fastest cuts fit");
    Ok(cuts.into_iter().map(|j| points[j]).collect())
}

/// Cuts `points[0]..points[last]` into `stages` consecutive stages, each starting at a point and
/// using a parameter, stage `s` over points `i..j` allowed when `allowed(s, i, j)`, so that the
/// largest `weight(s, i, j)` of a stage is least: that weight and the cuts (indices into
/// `points`), or `None` when no cutting is allowed.
fn least_worst_stage(
    points: &[usize],
    param_uses: &[usize],
    stages: usize,
    weight: impl Fn(usize, usize, usize) -> u64,
    allowed: impl Fn(usize, usize, usize) -> bool,
) -> Option<(u64, Vec<usize>)> {
    let last = points.len() - 1;
    // best[s][j]: the least worst weight of stages 0..s covering points 0..j, and where the
    // last of them starts.
    let mut best: Vec<Vec<Option<(u64, usize)>>> = vec![vec![None; last + 1]; stages + 1];
    best[0][0] = Some((0, 0));
    for s in 1..=stages {
        for j in 1..=last {
            for i in 0..j {
                let Some((before, _)) = best[s - 1][i] else { continue };
                if param_uses[points[j]] == param_uses[points[i]] || !allowed(s - 1, i, j) {
                    continue;
                }
                let worst = before.max(weight(s - 1, i, j));
                if best[s][j].is_none_or(|(current, _)| worst < current) {
                    best[s][j] = Some((worst, i));
                }
            }
        }
    }
    let (worst, _) = best[stages][last]?;
    let mut cuts = Vec::new();
    let mut j = last;
    for s in (1..=stages).rev() {
        let (_, i) = best[s][j].expect("on the best path");
        if s > 1 {
            cuts.push(i);
        }
        j = i;
    }
    cuts.reverse();
    Some((worst, cuts))
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
