//! `expert-dispatch`: a mixture of experts' per-pair computation moved into the layout expert
//! parallelism exchanges by all-to-all (`--ep N`), on the global graph, before autodiff.
//!
//! A batched-experts export looks each (token, choice) pair's expert weights up by expert
//! (`gather {axis = 0}` of an `[E, ..]` parameter by the router's top-k indices, `[P]` pairs)
//! and computes every pair's MLP row by row. With `n` ranks holding `E/n` experts each, the
//! pairs are split by their tokens (batch-major) over the sources `[outer, n, inner]`
//! ([`DispatchLayout`]: the ep ranks, and inside each the context-parallel parts of its
//! sequence), `P_s` each, and each source sends each pair to the rank of its group holding its
//! expert:
//!
//! - `dest = expert / (E/n)` and each pair's `slot` among the pairs its source sends to the
//!   same destination (an exclusive running count of a one-hot), so `pos = dest * P_s + slot`
//!   is its row in its source's send buffer `[n_dst * P_s, ..]`; dropless, as Megatron's
//!   default: a destination's block has room for every pair its source holds.
//! - Every per-pair value entering the computation (the tokens' hidden states, the experts'
//!   ids, a routing weight) is scattered into the send buffers, `[outer, n_src, inner, n_dst *
//!   P_s, ..]`, and read in the destinations' order, `[outer, n_dst, inner, n_src, P_s, ..]`
//!   ([`EXPERT_EXCHANGE`]) flattened to `Q = n * P` rows: over the mesh axis that splits the
//!   sources' dim 1 this transpose is one all-to-all among the ranks of the same outer group
//!   and inner part.
//! - The computation runs unchanged on the `Q` rows (padding rows are zeros, with expert 0);
//!   each value leaving it goes back to its pairs by the reverse transpose and a gather at
//!   `pos`.
//!
//! The rewrite is exact: every pair's row is computed by the same ops on the same numbers, and
//! no padding row is read back. Autodiff then differentiates the scatters, transposes and
//! gathers as it does any other op.
//!
//! With an expert capacity ([`ExpertCapacity`], `--moe-expert-capacity-factor`) each expert
//! takes at most `C` of each sequence's pairs, the first in token order ([`DropPolicy`]'s
//! `Position`) or those of the largest routing weights (`Probability`), and the model changes
//! on purpose: a pair past its expert's room is dropped (its result reads as zeros). The slot
//! is then the pair's count among its sequence's earlier pairs of the same expert (or its
//! token's rank for the expert by weight, [`Room::ranks_by_weight`]), and a
//! destination's block holds each of its experts' room for each of the source's sequences,
//! `pos = dest * room + (sequence * E/n + expert % (E/n)) * C + slot`: `room = sequences x E/n
//! x C` rows in place of `P_s`, about `F / n` of them. A dropped pair is scattered past the
//! buffer's end (cut off) and reads zeros back. On one rank (`drop_in_place`) nothing moves:
//! the values leaving the computation read zeros for the dropped pairs.
//!
//! The computation is found from dataflow: it starts at the expert lookups and takes each op
//! that keeps rows apart along dim 0 (elementwise ops, GEMMs batched or with rows on dim 0,
//! reshapes, slices, reductions and softmaxes that keep dim 0), reading per-pair values or
//! values with no pair dim; it ends where an op mixes pairs (the sum over a token's choices).
//!
//! Tests: tests/golden/expert_dispatch*.ir, tests/expert_parallel.rs (capacities: `capacity_case`
//! and the layouts' curves), tests/train.rs (against PyTorch's curves of both policies).

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::sharding::EXPERT_EXCHANGE;
use autotp_ir::{BinaryOp, DType, Def, Graph, NodeId, Op, ReduceOp, Rewriter, Tensor, ValueId};

use crate::{Pass, PassError};

/// Moves every mixture of experts' per-pair computation into the dispatched layout.
pub struct DispatchExperts {
    pub layout: DispatchLayout,
    /// Each expert's room for a sequence's pairs; `None`: dropless.
    pub capacity: Option<ExpertCapacity>,
}

impl DispatchExperts {
    /// Over `ranks` expert-parallel ranks that are all the data ranks (`--ep` = `--dp`, no
    /// `--cp`), dropless.
    pub fn over(ranks: usize) -> DispatchExperts {
        DispatchExperts { layout: DispatchLayout { ranks, outer: 1, inner: 1 }, capacity: None }
    }

    /// The flag that asked for the dispatch, for messages.
    fn flag(&self) -> String {
        match self.capacity {
            Some(capacity) if self.layout.ranks < 2 => format!("--moe-expert-capacity-factor {}", capacity.factor),
            _ => format!("--ep {}", self.layout.ranks),
        }
    }
}

/// Megatron's `--moe-expert-capacity-factor` with its drop policies, counted per sequence:
/// each expert takes at most `ceil(factor x S x k / E)` of a sequence's `S x k` (token,
/// choice) pairs (Megatron's `get_capacity` of a rank's tokens; never fewer than 1 nor more
/// than `S`, the most a sequence can route to one expert), chosen by `policy`; a
/// pair past its expert's capacity is dropped: its expert's result reads as zeros and nothing
/// flows back through it. Counted per sequence, the same pairs drop on one device and in
/// every layout that keeps sequences whole (Megatron counts a rank's micro-batch, so its drops
/// change with the layout).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ExpertCapacity {
    /// Tokens per sequence.
    pub sequence: usize,
    pub factor: f64,
    pub policy: DropPolicy,
}

/// Which of a sequence's pairs an expert keeps when more are routed to it than its room.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum DropPolicy {
    /// The first in token order (Megatron's and DeepSpeed's `position`).
    #[default]
    Position,
    /// Those of the largest routing weights, the weights the router multiplies the experts'
    /// results by; equal weights keep token order (Megatron's `probs`, its default).
    Probability,
}

impl ExpertCapacity {
    /// Why `factor` is no capacity factor, if it is not: one that is not a positive number.
    pub fn factor_refused(factor: f64) -> Option<String> {
        (!(factor.is_finite() && factor > 0.0))
            .then(|| format!("--moe-expert-capacity-factor {factor} must be a positive number"))
    }

    /// Each expert's room for one sequence's pairs, where tokens choose `choices` of `experts`.
    pub fn per_expert(&self, choices: usize, experts: usize) -> usize {
        let room = (self.factor * (self.sequence * choices) as f64 / experts.max(1) as f64).ceil();
        (room as usize).clamp(1, self.sequence.max(1))
    }
}

fn invalid(message: String) -> PassError {
    PassError::Invalid { pass: "expert-dispatch", message }
}

/// One mixture of experts: the router's choices (`ids`, i64 `[P]`), its experts' count, and
/// the per-pair computation's nodes.
struct Mixture {
    ids: ValueId,
    /// Every lookup's ids: `ids` or a copy of it (gpt-oss's exports look up each table by its
    /// own reshape of the choices).
    aliases: BTreeSet<ValueId>,
    experts: usize,
    /// The experts each token chooses: the router's top-k.
    choices: usize,
    /// The tables looked up, for messages.
    tables: Vec<String>,
    region: BTreeSet<NodeId>,
    /// The routing weights that multiply the pairs' results inside the computation (a value
    /// of `P` elements in pair order, before any reshape to `[P, 1]`), if it has one.
    weights: Option<ValueId>,
}

/// The pairs' count of a per-pair value: its dim 0.
fn leading(graph: &Graph, v: ValueId) -> Option<usize> {
    graph.ty(v).shape.first().copied()
}

/// Whether `v`, made outside a mixture's computation, is one of its per-pair inputs: a value
/// (not a parameter) with a dim 0 of `pairs`.
fn is_pair_value(graph: &Graph, v: ValueId, pairs: usize) -> bool {
    leading(graph, v) == Some(pairs) && !graph.params().contains(&v)
}

/// The top-k whose indices `v` is, through the ops that copy them unchanged: reshapes,
/// broadcasts to the same element count, and one-input concatenations.
fn top_k_choosing(graph: &Graph, mut v: ValueId) -> Option<NodeId> {
    loop {
        let Def::Node(n, output) = graph.value(v).def else { return None };
        let node = graph.node(n);
        match &node.op {
            Op::Reshape { .. } => {}
            Op::Expand { .. } if graph.ty(node.inputs[0]).numel() == graph.ty(v).numel() => {}
            Op::Concat { .. } if node.inputs.len() == 1 => {}
            Op::TopK { .. } => return (output == 1).then_some(n),
            _ => return None,
        }
        v = node.inputs[0];
    }
}

/// The expert lookups of `graph`, by the top-k whose choices they look up with: `gather
/// {axis = 0}` of a parameter by rank-1 top-k indices.
fn lookups(graph: &Graph) -> BTreeMap<NodeId, Vec<NodeId>> {
    let mut found: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for (id, node) in graph.nodes() {
        let (Op::Gather { axis: 0 }, [table, ids]) = (&node.op, &node.inputs[..]) else { continue };
        let param = graph.params().contains(&table_param(graph, *table));
        if let Some(top_k) = top_k_choosing(graph, *ids).filter(|_| param && graph.ty(*ids).rank() == 1) {
            found.entry(top_k).or_default().push(id);
        }
    }
    found
}

/// A lookup of experts' weights by a router's choices: the table (a parameter) and what it
/// gathers, a row per (token, choice) pair.
pub struct RoutedLookup {
    pub table: ValueId,
    pub gathered: autotp_ir::TensorType,
}

/// The lookups `graph` makes of experts' weights by a router's choices (a mixture of experts
/// that `--ep` can split; none for a dense model): the planner's question, asked of the
/// imported model, in graph order.
pub fn routed_lookups(graph: &Graph) -> Vec<RoutedLookup> {
    let mut nodes: Vec<NodeId> = lookups(graph).into_values().flatten().collect();
    nodes.sort();
    (nodes.into_iter().map(|n| graph.node(n)))
        .map(|node| RoutedLookup {
            table: table_param(graph, node.inputs[0]),
            gathered: graph.ty(node.outputs[0]).clone(),
        })
        .collect()
}

/// Whether `node` computes each row along dim 0 (of `pairs` rows) from the same row of its
/// per-pair inputs alone; `per_pair(v)` says which inputs are per-pair.
fn keeps_rows(graph: &Graph, node: &autotp_ir::Node, pairs: usize, per_pair: &dyn Fn(ValueId) -> bool) -> bool {
    let rank_of = |v: ValueId| graph.ty(v).rank();
    let out_rank = node.outputs.first().map_or(0, |&o| rank_of(o));
    if out_rank == 0 || node.outputs.iter().any(|&o| leading(graph, o) != Some(pairs)) {
        return false;
    }
    // Each input is per-pair (dim 0 aligned with the output's), or has no pair dim: lower rank
    // (broadcast over dim 0) or dim 0 of 1.
    let aligned = |v: ValueId| {
        if per_pair(v) {
            rank_of(v) == out_rank
        } else {
            rank_of(v) < out_rank || leading(graph, v) == Some(1)
        }
    };
    match &node.op {
        Op::Unary(_) | Op::Cast { .. } | Op::Gelu { .. } | Op::Binary(_) | Op::Select => {
            node.inputs.iter().all(|&v| aligned(v))
        }
        Op::MatMul { transpose_lhs, .. } if out_rank == 2 => {
            // [P, K] x [K, N]: rows of the lhs, a weight on the right.
            let (lhs, rhs) = (node.inputs[0], node.inputs[1]);
            !transpose_lhs && per_pair(lhs) && !per_pair(rhs)
        }
        Op::MatMul { .. } => node.inputs.iter().all(|&v| aligned(v)),
        Op::Reshape { shape } => shape.first() == Some(&pairs),
        Op::Expand { shape } => shape.first() == Some(&pairs) && aligned(node.inputs[0]),
        Op::Slice { starts, ends, steps } => starts[0] == 0 && ends[0] == pairs as i64 && steps[0] == 1,
        Op::Transpose { perm } => perm[0] == 0,
        Op::Reduce { axes, .. } => !axes.contains(&0),
        Op::Softmax { axis } | Op::LogSoftmax { axis } | Op::Split { axis, .. } => *axis != 0,
        Op::Concat { axis } => *axis != 0 && node.inputs.iter().all(|&v| aligned(v)),
        _ => false,
    }
}

/// The mixtures of `graph`: each group of lookups by the same choices, with the computation
/// that follows them pair by pair.
fn mixtures(graph: &Graph) -> Result<Vec<Mixture>, PassError> {
    let mut found = Vec::new();
    for (top_k, nodes) in lookups(graph) {
        // `lookups` keys each group by its top-k: its `k`.
        let choices = match graph.node(top_k).op {
            Op::TopK { k, .. } => k,
            _ => 0,
        };
        let ids = graph.node(nodes[0]).inputs[1];
        let pairs = graph.ty(ids).shape[0];
        let experts = graph.ty(graph.node(nodes[0]).inputs[0]).shape[0];
        let tables: Vec<String> = nodes
            .iter()
            .map(|&n| graph.name_of(table_param(graph, graph.node(n).inputs[0])).unwrap_or("?").to_string())
            .collect();
        let mismatched = |&n: &NodeId| {
            let node = graph.node(n);
            graph.ty(node.inputs[0]).shape[0] != experts || graph.ty(node.inputs[1]).shape[0] != pairs
        };
        if let Some(other) = nodes.iter().position(mismatched) {
            return Err(invalid(format!(
                "the expert lookups by one router's choices differ in their experts or pairs: {} {} by {} and {} {} by {}",
                tables[0],
                graph.ty(graph.node(nodes[0]).inputs[0]),
                graph.ty(ids),
                tables[other],
                graph.ty(graph.node(nodes[other]).inputs[0]),
                graph.ty(graph.node(nodes[other]).inputs[1]),
            )));
        }
        let aliases = nodes.iter().map(|&n| graph.node(n).inputs[1]).collect();
        let mut region: BTreeSet<NodeId> = nodes.iter().copied().collect();
        let mut values: BTreeSet<ValueId> = nodes.iter().map(|&n| graph.node(n).outputs[0]).collect();
        for (id, node) in graph.nodes() {
            if region.contains(&id) || !node.inputs.iter().any(|v| values.contains(v)) {
                continue;
            }
            let per_pair = |v: ValueId| values.contains(&v) || is_pair_value(graph, v, pairs);
            if keeps_rows(graph, node, pairs, &per_pair) {
                region.insert(id);
                values.extend(node.outputs.iter().copied());
            }
        }
        let weights = routing_weights(graph, &region, &values, pairs);
        found.push(Mixture { ids, aliases, experts, choices, tables, region, weights });
    }
    Ok(found)
}

/// The routing weights of a mixture's computation: the one float per-pair value from outside
/// it that multiplies a value inside, followed back through its reshapes (a router's `[T, k]`
/// weights reshaped to `[P, 1]`); `None` when there is no such value, or several.
fn routing_weights(
    graph: &Graph,
    region: &BTreeSet<NodeId>,
    values: &BTreeSet<ValueId>,
    pairs: usize,
) -> Option<ValueId> {
    let mut found = BTreeSet::new();
    for &n in region {
        let node = graph.node(n);
        if node.op != Op::Binary(BinaryOp::Mul) || !node.inputs.iter().any(|v| values.contains(v)) {
            continue;
        }
        for &v in &node.inputs {
            let ty = graph.ty(v);
            if !values.contains(&v) && ty.dtype.is_float() && ty.numel() == pairs && is_pair_value(graph, v, pairs) {
                found.insert(v);
            }
        }
    }
    let [weights] = found.into_iter().collect::<Vec<_>>()[..] else { return None };
    let mut source = weights;
    while let Def::Node(n, _) = graph.value(source).def {
        let node = graph.node(n);
        match node.op {
            Op::Reshape { .. } if graph.ty(node.inputs[0]).numel() == pairs => source = node.inputs[0],
            _ => break,
        }
    }
    Some(source)
}

/// How the pairs' sources lie around the expert-parallel ranks: every data rank holds its own
/// block of the pairs (batch-major, then by sequence), `P / (outer x ranks x inner)` each, and
/// exchanges with the `ranks` sources of its group, which differ only in their expert-parallel
/// coordinate.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DispatchLayout {
    /// Expert-parallel ranks (`--ep`): each holds `1/ranks` of every mixture's experts.
    pub ranks: usize,
    /// Groups of expert-parallel ranks outside them (`--dp / --ep`, Megatron's expert-data-parallel
    /// size): each group holds every expert and exchanges among its own ranks.
    pub outer: usize,
    /// Ranks inside each expert-parallel rank's block of the batch (`--cp`): each holds its own
    /// part of a sequence and exchanges with the ranks of the same part.
    pub inner: usize,
}

impl DispatchLayout {
    /// The pairs' blocks: `[outer, ranks, inner]`.
    fn sources(&self) -> [usize; 3] {
        [self.outer, self.ranks, self.inner]
    }

    fn source_count(&self) -> usize {
        self.outer * self.ranks * self.inner
    }
}

/// The dispatch of one mixture's pairs: where each pair goes, and the values moved so far.
struct Dispatch {
    layout: DispatchLayout,
    pairs: usize,
    /// Rows of a source's send buffer for each destination: its pairs (`P_s`, dropless), or
    /// with a capacity, each of the destination's experts' room for each of its sequences.
    room: usize,
    /// Each pair's row in its source's send buffer, i64 `[outer, n, inner, P_s, 1]`; with a
    /// capacity, a dropped pair's is the row past the buffer's end, which the send cuts off.
    position: ValueId,
    /// With a capacity: the rows the pairs read their results back from (a dropped pair's is
    /// row 0) and whether each pair is kept, bool `[outer, n, inner, P_s, 1]`.
    capacity: Option<(ValueId, ValueId)>,
    /// Positions broadcast to `[outer, n, inner, P_s, width]`, by (width, whether the send's).
    positions: BTreeMap<(usize, bool), ValueId>,
    /// Per-pair values (new ids) in the dispatched layout, by their undispatched value.
    dispatched: BTreeMap<ValueId, ValueId>,
}

fn add(g: &mut Graph, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
    crate::add_op("expert-dispatch", g, op, inputs)
}

fn constant(g: &mut Graph, value: Tensor) -> Result<ValueId, PassError> {
    add(g, Op::Constant { value }, vec![])
}

fn scalar(g: &mut Graph, value: i64) -> Result<ValueId, PassError> {
    constant(g, Tensor::from_i64(vec![], &[value]))
}

fn binary(g: &mut Graph, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
    add(g, Op::Binary(op), vec![a, b])
}

/// Each element's count of the equal elements before it along `axis` of `ids` (i64, a last
/// dim of 1), among `0..classes`: an exclusive running count of a one-hot, counted in f32
/// (exact below 2^24).
fn slots(g: &mut Graph, ids: ValueId, classes: usize, axis: usize) -> Result<ValueId, PassError> {
    let class_seq = constant(g, Tensor::from_i64(vec![classes], &(0..classes as i64).collect::<Vec<_>>()))?;
    let one_hot = binary(g, BinaryOp::Equal, ids, class_seq)?;
    let one_hot = add(g, Op::Cast { to: DType::F32 }, vec![one_hot])?;
    let before = add(g, Op::CumSum { axis, exclusive: true, reverse: false }, vec![one_hot])?;
    let own = binary(g, BinaryOp::Mul, before, one_hot)?;
    let last = g.ty(own).rank() - 1;
    let slot = add(g, Op::Reduce { op: ReduceOp::Sum, axes: vec![last], keep_dims: true }, vec![own])?;
    add(g, Op::Cast { to: DType::I64 }, vec![slot])
}

impl Dispatch {
    /// The positions of the pairs chosen by `ids` (new id, i64 `[P]`) among `experts`: dropless,
    /// or within `room` ([`Room`]).
    fn new(
        g: &mut Graph,
        ids: ValueId,
        weights: Option<ValueId>,
        experts: usize,
        layout: DispatchLayout,
        room: Option<Room>,
    ) -> Result<Dispatch, PassError> {
        let pairs = g.ty(ids).shape[0];
        let (n, per_source) = (layout.ranks, pairs / layout.source_count());
        let Some(room) = room else {
            let ids = add(g, Op::Reshape { shape: [&layout.sources()[..], &[per_source, 1]].concat() }, vec![ids])?;
            let block = scalar(g, (experts / n) as i64)?;
            let dest = binary(g, BinaryOp::Div, ids, block)?;
            let slot = slots(g, dest, n, 3)?;
            let stride = scalar(g, per_source as i64)?;
            let start = binary(g, BinaryOp::Mul, dest, stride)?;
            let position = binary(g, BinaryOp::Add, start, slot)?;
            let (positions, dispatched) = (BTreeMap::new(), BTreeMap::new());
            return Ok(Dispatch { layout, pairs, room: per_source, position, capacity: None, positions, dispatched });
        };
        // `[outer, n, inner, sequences, S x k, 1]`: a pair's slot among its sequence's pairs of
        // the same expert, its row `((sequence x E/n) + expert % (E/n)) x C + slot` in its
        // destination's block.
        let sequences = per_source / room.per_sequence;
        let by_sequence = [&layout.sources()[..], &[sequences, room.per_sequence, 1]].concat();
        let ranked = match room.policy {
            DropPolicy::Position => None,
            DropPolicy::Probability => Some(room.ranks_by_weight(g, ids, weights, experts)?),
        };
        let ids = add(g, Op::Reshape { shape: by_sequence.clone() }, vec![ids])?;
        let slot = match ranked {
            None => slots(g, ids, experts, 4)?,
            Some(ranked) => add(g, Op::Reshape { shape: by_sequence }, vec![ranked])?,
        };
        let per_expert = scalar(g, room.per_expert as i64)?;
        let kept = binary(g, BinaryOp::Less, slot, per_expert)?;
        let block = scalar(g, (experts / n) as i64)?;
        let dest = binary(g, BinaryOp::Div, ids, block)?;
        let first_of_dest = binary(g, BinaryOp::Mul, dest, block)?;
        let own_expert = binary(g, BinaryOp::Sub, ids, first_of_dest)?;
        let experts_per_rank = (experts / n) as i64;
        let sequence_start: Vec<i64> = (0..sequences as i64).map(|s| s * experts_per_rank).collect();
        let sequence_start = constant(g, Tensor::from_i64(vec![sequences, 1, 1], &sequence_start))?;
        let expert_block = binary(g, BinaryOp::Add, sequence_start, own_expert)?;
        let expert_start = binary(g, BinaryOp::Mul, expert_block, per_expert)?;
        let row = binary(g, BinaryOp::Add, expert_start, slot)?;
        let room_rows = sequences * experts / n * room.per_expert;
        let stride = scalar(g, room_rows as i64)?;
        let start = binary(g, BinaryOp::Mul, dest, stride)?;
        let position = binary(g, BinaryOp::Add, start, row)?;
        let (past_end, first_row) = (scalar(g, (n * room_rows) as i64)?, scalar(g, 0)?);
        let sent = add(g, Op::Select, vec![kept, position, past_end])?;
        let back = add(g, Op::Select, vec![kept, position, first_row])?;
        let by_pair = [&layout.sources()[..], &[per_source, 1]].concat();
        let [sent, back, kept] = [sent, back, kept].map(|v| add(g, Op::Reshape { shape: by_pair.clone() }, vec![v]));
        Ok(Dispatch {
            layout,
            pairs,
            room: room_rows,
            position: sent?,
            capacity: Some((back?, kept?)),
            positions: BTreeMap::new(),
            dispatched: BTreeMap::new(),
        })
    }

    fn per_source(&self) -> usize {
        self.pairs / self.layout.source_count()
    }

    /// Rows of the dispatched layout: every destination's block of every source's buffer.
    fn rows(&self) -> usize {
        self.layout.ranks * self.room * self.layout.source_count()
    }

    /// `[outer, n, inner]` and then `rest`.
    fn blocks(&self, rest: &[usize]) -> Vec<usize> {
        [&self.layout.sources()[..], rest].concat()
    }

    /// The send buffers of every source with their destinations apart: `[outer, n_src, inner,
    /// n_dst, room, width]`.
    fn buffers_shape(&self, width: usize) -> Vec<usize> {
        self.blocks(&[self.layout.ranks, self.room, width])
    }

    /// The pairs' rows in the send buffers (`send`) or the rows they read back, broadcast to
    /// `width`.
    fn position_for(&mut self, g: &mut Graph, width: usize, send: bool) -> Result<ValueId, PassError> {
        // Dropless, the pairs read back from the rows they were sent to.
        let send = send || self.capacity.is_none();
        let position = match self.capacity {
            Some((back, _)) if !send => back,
            _ => self.position,
        };
        if width == 1 {
            return Ok(position);
        }
        if let Some(&p) = self.positions.get(&(width, send)) {
            return Ok(p);
        }
        let shape = self.blocks(&[self.per_source(), width]);
        let p = add(g, Op::Expand { shape }, vec![position])?;
        self.positions.insert((width, send), p);
        Ok(p)
    }

    /// `value` (new id, `[P, ..]`) in the dispatched layout, `[rows, ..]`.
    fn send(&mut self, g: &mut Graph, value: ValueId) -> Result<ValueId, PassError> {
        let (n, per_source, room) = (self.layout.ranks, self.per_source(), self.room);
        let ty = g.ty(value).clone();
        let rest = &ty.shape[1..];
        let width = rest.iter().product::<usize>();
        let float = ty.dtype.is_float();
        let mut rows = add(g, Op::Reshape { shape: self.blocks(&[per_source, width]) }, vec![value])?;
        if !float {
            // Indices travel as floats (exact below 2^24); scatters move floats.
            rows = add(g, Op::Cast { to: DType::F32 }, vec![rows])?;
        }
        let position = self.position_for(g, width, true)?;
        let mut buffers = if self.capacity.is_some() {
            // The dropped pairs land on the row past the end, cut off.
            let buffers = add(g, Op::ScatterElements { axis: 3, size: n * room + 1 }, vec![position, rows])?;
            let ends = self.blocks(&[n * room, width]).into_iter().map(|d| d as i64).collect();
            add(g, Op::Slice { starts: vec![0; 5], ends, steps: vec![1; 5] }, vec![buffers])?
        } else {
            add(g, Op::ScatterElements { axis: 3, size: n * room }, vec![position, rows])?
        };
        buffers = add(g, Op::Reshape { shape: self.buffers_shape(width) }, vec![buffers])?;
        let received = add(g, Op::Transpose { perm: EXPERT_EXCHANGE.to_vec() }, vec![buffers])?;
        let mut shape = vec![self.rows()];
        shape.extend(rest);
        let mut out = add(g, Op::Reshape { shape }, vec![received])?;
        if !float {
            out = add(g, Op::Cast { to: ty.dtype }, vec![out])?;
        }
        Ok(out)
    }

    /// `value` (new id, dispatched `[rows, ..]`) back at its pairs, `[P, ..]`; zeros for the
    /// dropped pairs.
    fn gather_back(&mut self, g: &mut Graph, value: ValueId) -> Result<ValueId, PassError> {
        let (n, room) = (self.layout.ranks, self.room);
        let ty = g.ty(value).clone();
        let rest = &ty.shape[1..];
        let width = rest.iter().product::<usize>();
        let rows = add(g, Op::Reshape { shape: self.buffers_shape(width) }, vec![value])?;
        let returned = add(g, Op::Transpose { perm: EXPERT_EXCHANGE.to_vec() }, vec![rows])?;
        let buffers = add(g, Op::Reshape { shape: self.blocks(&[n * room, width]) }, vec![returned])?;
        let position = self.position_for(g, width, false)?;
        let mut picked = add(g, Op::GatherElements { axis: 3 }, vec![buffers, position])?;
        if let Some((_, kept)) = self.capacity {
            let zero = constant(g, Tensor::from_f64_values(ty.dtype, vec![], &[0.0]))?;
            picked = add(g, Op::Select, vec![kept, picked, zero])?;
        }
        let mut shape = vec![self.pairs];
        shape.extend(rest);
        add(g, Op::Reshape { shape }, vec![picked])
    }
}

/// A capacity's room ([`ExpertCapacity`]) for one mixture: a sequence's pairs, and each
/// expert's room among them.
#[derive(Copy, Clone, Debug)]
struct Room {
    per_sequence: usize,
    per_expert: usize,
    /// The tokens' choices per pair of a sequence: `per_sequence / choices` tokens.
    choices: usize,
    policy: DropPolicy,
}

impl Room {
    /// Under [`DropPolicy::Probability`], each pair's slot in its expert's room for its
    /// sequence, i64 `[P]` (`ids`, new id, `P` elements in pair order): per sequence, each
    /// expert's tokens ranked by the weight of the pair that routes them to it (`weights`, new
    /// id), largest first, by a top-k over the tokens of `[sequences, S, E]` weights (`-inf`
    /// where a token does not choose the expert; equal weights keep token order); a pair's
    /// slot is its token's rank, or the room itself when the token is not among the first
    /// `room` for the expert.
    fn ranks_by_weight(
        &self,
        g: &mut Graph,
        ids: ValueId,
        weights: Option<ValueId>,
        experts: usize,
    ) -> Result<ValueId, PassError> {
        let Some(weights) = weights else {
            return Err(invalid(
                "--moe-token-drop-policy probs ranks each expert's pairs by their routing weights, and a mixture's \
                 computation multiplies its results by no one per-pair weight"
                    .into(),
            ));
        };
        let pairs = g.ty(ids).numel();
        let (sequences, tokens, k) = (pairs / self.per_sequence, self.per_sequence / self.choices, self.choices);
        let dtype = g.ty(weights).dtype;
        let by_choice = vec![sequences, tokens, k, 1];
        let ids = add(g, Op::Reshape { shape: by_choice.clone() }, vec![ids])?;
        let weights = add(g, Op::Reshape { shape: by_choice }, vec![weights])?;
        let class_seq = constant(g, Tensor::from_i64(vec![experts], &(0..experts as i64).collect::<Vec<_>>()))?;
        let chosen = binary(g, BinaryOp::Equal, ids, class_seq)?;
        let zero = constant(g, Tensor::from_f64_values(dtype, vec![], &[0.0]))?;
        let chosen_weights = add(g, Op::Select, vec![chosen, weights, zero])?;
        let by_expert =
            add(g, Op::Reduce { op: ReduceOp::Sum, axes: vec![2], keep_dims: false }, vec![chosen_weights])?;
        let chosen = add(g, Op::Cast { to: DType::F32 }, vec![chosen])?;
        let choices = add(g, Op::Reduce { op: ReduceOp::Sum, axes: vec![2], keep_dims: false }, vec![chosen])?;
        let none = constant(g, Tensor::from_f64_values(DType::F32, vec![], &[0.0]))?;
        let routed = binary(g, BinaryOp::Greater, choices, none)?;
        let unrouted = constant(g, Tensor::from_f64_values(dtype, vec![], &[f64::NEG_INFINITY]))?;
        let scores = add(g, Op::Select, vec![routed, by_expert, unrouted])?;
        let room = self.per_expert;
        let top = g
            .add_node(Op::TopK { axis: 1, k: room, largest: true }, vec![scores], 2)
            .map_err(|e| invalid(format!("topk of the routing weights: {e}")))?;
        let top = g.node(top).outputs[1];
        // Each kept token's rank + 1 at its place, 0 elsewhere: `[sequences, S, E]`.
        let ranks: Vec<f64> = (1..=room).map(|r| r as f64).collect();
        let ranks = constant(g, Tensor::from_f64_values(DType::F32, vec![1, room, 1], &ranks))?;
        let ranks = add(g, Op::Expand { shape: vec![sequences, room, experts] }, vec![ranks])?;
        let rank_of = add(g, Op::ScatterElements { axis: 1, size: tokens }, vec![top, ranks])?;
        let ids = add(g, Op::Reshape { shape: vec![sequences, tokens, k] }, vec![ids])?;
        let rank = add(g, Op::GatherElements { axis: 2 }, vec![rank_of, ids])?;
        // Rank 0 (not among the top) becomes the room itself: dropped.
        let kept = binary(g, BinaryOp::Greater, rank, none)?;
        let one = constant(g, Tensor::from_f64_values(DType::F32, vec![], &[1.0]))?;
        let slot = binary(g, BinaryOp::Sub, rank, one)?;
        let past = constant(g, Tensor::from_f64_values(DType::F32, vec![], &[room as f64]))?;
        let slot = add(g, Op::Select, vec![kept, slot, past])?;
        let slot = add(g, Op::Cast { to: DType::I64 }, vec![slot])?;
        add(g, Op::Reshape { shape: vec![pairs] }, vec![slot])
    }
}

/// A mixture's routing weights in the graph being rewritten, where a capacity ranks by them;
/// they must be made before the mixture's computation starts.
fn routing_weights_at(rw: &Rewriter, mixture: &Mixture, room: Option<Room>) -> Result<Option<ValueId>, PassError> {
    if room.is_none_or(|r| r.policy != DropPolicy::Probability) {
        return Ok(None);
    }
    let Some(weights) = mixture.weights else { return Ok(None) };
    rw.mapped(weights).map(Some).ok_or_else(|| {
        invalid(format!(
            "--moe-token-drop-policy probs ranks the pairs of the mixture routed by {} by their routing weights, \
             which the model computes after its experts' lookups",
            mixture.tables.join(", ")
        ))
    })
}

/// `op` with its attributes that name dim 0's length (`pairs`) naming `rows` instead.
fn with_rows(op: &Op, pairs: usize, rows: usize) -> Op {
    let mut op = op.clone();
    match &mut op {
        Op::Reshape { shape } | Op::Expand { shape } if shape.first() == Some(&pairs) => shape[0] = rows,
        Op::Slice { ends, .. } => ends[0] = rows as i64,
        _ => {}
    }
    op
}

impl Pass for DispatchExperts {
    fn name(&self) -> &'static str {
        "expert-dispatch"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let n = self.layout.ranks;
        if n < 2 && self.capacity.is_none() {
            return Ok(());
        }
        let flag = self.flag();
        let found = mixtures(graph)?;
        if found.is_empty() {
            return Err(invalid(format!(
                "{flag} is for a mixture of experts, and this model has none (no parameter looked up by a router's top-k choices)"
            )));
        }
        let mut rooms = Vec::with_capacity(found.len());
        for mixture in &found {
            let pairs = graph.ty(mixture.ids).shape[0];
            if !mixture.experts.is_multiple_of(n) {
                return Err(invalid(format!(
                    "--ep {n} must divide the experts ({}) of the mixture routed by {}",
                    mixture.experts,
                    mixture.tables.join(", ")
                )));
            }
            let sources = self.layout.source_count();
            if !pairs.is_multiple_of(sources) {
                return Err(invalid(format!(
                    "the (token, choice) pairs ({pairs}) of the mixture routed by {} do not split evenly over \
                     the {sources} ranks that dispatch them (data-parallel x context-parallel)",
                    mixture.tables.join(", ")
                )));
            }
            let room = self.capacity.map(|capacity| Room {
                per_sequence: capacity.sequence * mixture.choices,
                per_expert: capacity.per_expert(mixture.choices, mixture.experts),
                choices: mixture.choices,
                policy: capacity.policy,
            });
            if let Some(room) =
                room.filter(|r| r.per_sequence == 0 || !(pairs / sources).is_multiple_of(r.per_sequence))
            {
                return Err(invalid(format!(
                    "{flag} counts each sequence's pairs, and the {} (token, choice) pairs of each of the {sources} \
                     ranks that dispatch the mixture routed by {} are not whole sequences of {} tokens x {} choices",
                    pairs / sources,
                    mixture.tables.join(", "),
                    room.per_sequence / mixture.choices.max(1),
                    mixture.choices
                )));
            }
            rooms.push(room);
        }
        let region_of: BTreeMap<NodeId, usize> =
            found.iter().enumerate().flat_map(|(i, m)| m.region.iter().map(move |&n| (n, i))).collect();
        if n < 2 {
            // Here a capacity gives every mixture its room.
            let rooms: Vec<Room> = rooms.into_iter().flatten().collect();
            return drop_in_place(graph, &found, &rooms, &region_of);
        }
        let old = &*graph;
        let mut rw = Rewriter::new(old, |_| true);
        let mut dispatches: Vec<Option<Dispatch>> = found.iter().map(|_| None).collect();
        // Per-pair values inside a region, old id -> new dispatched id.
        let mut inside: BTreeMap<ValueId, ValueId> = BTreeMap::new();
        let consumers = old.consumers();
        let outputs: BTreeSet<ValueId> = old.outputs().iter().map(|(_, v)| *v).collect();
        for (id, node) in old.nodes() {
            let Some(&m) = region_of.get(&id) else {
                rw.copy_node(id);
                continue;
            };
            let mixture = &found[m];
            let pairs = old.ty(mixture.ids).shape[0];
            let dispatch = match &mut dispatches[m] {
                Some(dispatch) => dispatch,
                empty => {
                    let ids = rw.map(mixture.ids);
                    let weights = routing_weights_at(&rw, mixture, rooms[m])?;
                    empty.insert(Dispatch::new(rw.graph(), ids, weights, mixture.experts, self.layout, rooms[m])?)
                }
            };
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for &v in &node.inputs {
                let new = match inside.get(&v) {
                    Some(&d) => d,
                    None if is_pair_value(old, v, pairs) => {
                        let copy_of_ids = mixture.aliases.contains(&v);
                        let undispatched = rw.map(if copy_of_ids { mixture.ids } else { v });
                        match dispatch.dispatched.get(&undispatched) {
                            Some(&d) => d,
                            None => {
                                let d = dispatch.send(rw.graph(), undispatched)?;
                                dispatch.dispatched.insert(undispatched, d);
                                d
                            }
                        }
                    }
                    None => rw.map(v),
                };
                inputs.push(new);
            }
            let op = with_rows(&node.op, pairs, dispatch.rows());
            let g = rw.graph();
            let new = g
                .add_node(op, inputs, node.outputs.len())
                .map_err(|e| invalid(format!("{} in a mixture's computation: {e}", node.op.name())))?;
            let new_outputs = g.node(new).outputs.clone();
            for (&o, &d) in node.outputs.iter().zip(&new_outputs) {
                inside.insert(o, d);
                let leaves = outputs.contains(&o) || consumers[o.index()].iter().any(|c| region_of.get(c) != Some(&m));
                if leaves {
                    let back = dispatch.gather_back(rw.graph(), d)?;
                    rw.set(o, back);
                }
            }
        }
        *graph = rw.finish();
        Ok(())
    }
}

/// A capacity without expert parallelism: every mixture computes its pairs where they are, and
/// each value leaving it reads zeros for the pairs past their expert's room (the same pairs as
/// [`Dispatch`]'s, without the send buffers).
fn drop_in_place(
    graph: &mut Graph,
    found: &[Mixture],
    rooms: &[Room],
    region_of: &BTreeMap<NodeId, usize>,
) -> Result<(), PassError> {
    let old = &*graph;
    let mut rw = Rewriter::new(old, |_| true);
    let consumers = old.consumers();
    let outputs: BTreeSet<ValueId> = old.outputs().iter().map(|(_, v)| *v).collect();
    // Each mixture's kept pairs, bool `[P, 1]`, made at its first value that leaves it.
    let mut kept: Vec<Option<ValueId>> = vec![None; found.len()];
    for (id, node) in old.nodes() {
        rw.copy_node(id);
        let Some(&m) = region_of.get(&id) else { continue };
        let room = rooms[m];
        for &o in &node.outputs {
            let leaves = outputs.contains(&o) || consumers[o.index()].iter().any(|c| region_of.get(c) != Some(&m));
            if !leaves {
                continue;
            }
            let mixture = &found[m];
            let pairs = old.ty(mixture.ids).shape[0];
            let kept = match kept[m] {
                Some(kept) => kept,
                None => {
                    let ids = rw.map(mixture.ids);
                    let weights = routing_weights_at(&rw, mixture, Some(room))?;
                    let g = rw.graph();
                    let by_sequence = vec![pairs / room.per_sequence, room.per_sequence, 1];
                    let slot = match room.policy {
                        DropPolicy::Position => {
                            let ids = add(g, Op::Reshape { shape: by_sequence }, vec![ids])?;
                            slots(g, ids, mixture.experts, 1)?
                        }
                        DropPolicy::Probability => room.ranks_by_weight(g, ids, weights, mixture.experts)?,
                    };
                    let per_expert = scalar(g, room.per_expert as i64)?;
                    let within = binary(g, BinaryOp::Less, slot, per_expert)?;
                    *kept[m].insert(add(g, Op::Reshape { shape: vec![pairs, 1] }, vec![within])?)
                }
            };
            let value = rw.map(o);
            let g = rw.graph();
            let ty = g.ty(value).clone();
            let mut shape = vec![1; ty.rank().max(1)];
            shape[0] = pairs;
            let kept = if g.ty(kept).shape == shape { kept } else { add(g, Op::Reshape { shape }, vec![kept])? };
            let zero = constant(g, Tensor::from_f64_values(ty.dtype, vec![], &[0.0]))?;
            let masked = add(g, Op::Select, vec![kept, value, zero])?;
            rw.set(o, masked);
        }
    }
    *graph = rw.finish();
    Ok(())
}

/// Expert parallelism's placement over a data-parallel mesh axis (`dp` where `--ep` equals
/// `--dp`, else the `ep` axis of each group of dp ranks, [`crate::zero::mesh`]): the experts'
/// tables split by expert over `axis`, each rank computing the pairs dispatched to its experts.
/// Set on [`crate::shard::Shard::experts`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpertParallel {
    pub axis: usize,
    /// The experts' tables (parameters looked up by expert), by name ([`expert_tables`]).
    pub tables: BTreeSet<String>,
}

/// The parameters a dispatched mixture looks its experts up in, by name: tables read (through
/// casts) by `gather {axis = 0}` with the dispatched experts' ids
/// ([`autotp_ir::sharding::dispatched_by`]).
pub fn expert_tables(graph: &Graph) -> BTreeSet<String> {
    let mut tables = BTreeSet::new();
    for (_, node) in graph.nodes() {
        let (Op::Gather { axis: 0 }, [table, ids]) = (&node.op, &node.inputs[..]) else { continue };
        let table = table_param(graph, *table);
        if autotp_ir::sharding::dispatched_by(graph, *ids).is_some() && graph.params().contains(&table) {
            tables.extend(graph.name_of(table).map(str::to_string));
        }
    }
    tables
}

/// The parameter `v` reads, through the casts (a 16-bit copy), slices and reshapes
/// (`split-fused`'s halves of a fused gate and up projection) that keep its experts on dim 0;
/// `v` itself when it reads none.
fn table_param(graph: &Graph, mut v: ValueId) -> ValueId {
    while let Def::Node(n, _) = graph.value(v).def {
        match graph.node(n).op {
            Op::Cast { .. } | Op::Slice { .. } | Op::Reshape { .. } => v = graph.node(n).inputs[0],
            _ => break,
        }
    }
    v
}

/// Whether `op` is the dispatch's change between the sources' and the destinations' order of
/// the send buffers ([`EXPERT_EXCHANGE`]).
fn is_exchange(op: &Op) -> bool {
    matches!(op, Op::Transpose { perm } if perm[..] == EXPERT_EXCHANGE)
}

impl ExpertParallel {
    /// Expert parallelism over mesh axis `axis` of `graph` (a training step whose mixtures are
    /// dispatched): its experts' tables; `None` for a step without any (a pipeline stage of
    /// dense layers).
    pub fn over(graph: &Graph, axis: usize) -> Option<ExpertParallel> {
        let tables = expert_tables(graph);
        (!tables.is_empty()).then_some(ExpertParallel { axis, tables })
    }

    /// Adds to `seeds` each experts' table split by expert over the expert axis, over what
    /// other axes do with it.
    pub fn seed(&self, mesh: &autotp_ir::Mesh, seeds: &mut BTreeMap<String, Vec<autotp_ir::Placement>>) {
        for table in &self.tables {
            let by_expert = seeds.entry(table.clone()).or_insert_with(|| mesh.replicated());
            by_expert[self.axis] = autotp_ir::Placement::Shard(0);
        }
    }

    /// The ids (in `source`, the graph being placed) of the dispatched pairs' experts: what the
    /// experts' lookups and their gradients index by.
    pub(crate) fn dispatched_ids(&self, source: &Graph) -> BTreeSet<ValueId> {
        source
            .nodes()
            .filter_map(|(_, node)| match (&node.op, &node.inputs[..]) {
                (Op::Gather { axis: 0 }, [table, ids]) => {
                    let name = source.name_of(table_param(source, *table));
                    name.is_some_and(|n| self.tables.contains(n)).then_some(*ids)
                }
                _ => None,
            })
            .collect()
    }

    /// The placement rule over the expert axis of `node` (in the graph being placed, whose
    /// `dispatched` ids [`ExpertParallel::dispatched_ids`] gives), where expert parallelism
    /// decides it; `None` leaves it to [`autotp_ir::sharding::axis_rule`]:
    ///
    /// - an expert lookup, and its gradient's scatter into the table, run on the rank's block
    ///   of experts: each rank's dispatched pairs all choose its own experts;
    /// - the change to the destinations' order (and back, and their gradients) takes the send
    ///   buffers split by destination: one all-to-all.
    pub(crate) fn rule(
        &self,
        node: &autotp_ir::Node,
        axis: usize,
        size: usize,
        dispatched: &BTreeSet<ValueId>,
        source: &Graph,
    ) -> Option<autotp_ir::sharding::AxisRule> {
        use autotp_ir::Placement::Shard;
        if axis != self.axis {
            return None;
        }
        let all =
            |inputs: usize| autotp_ir::sharding::AxisRule { inputs: vec![Shard(0); inputs], outputs: vec![Shard(0)] };
        match (&node.op, &node.inputs[..]) {
            (Op::Gather { axis: 0 }, [_, ids]) if dispatched.contains(ids) => Some(all(2)),
            (Op::ScatterAdd { axis: 0, .. }, [ids, _]) if dispatched.contains(ids) => Some(all(2)),
            (op, [buffers]) if is_exchange(op) && !dispatched.is_empty() => {
                let shape = &source.ty(*buffers).shape;
                (shape[1] == size && shape[3] == size)
                    .then(|| autotp_ir::sharding::AxisRule { inputs: vec![Shard(3)], outputs: vec![Shard(1)] })
            }
            _ => None,
        }
    }
}
