//! `shard`: places a training step on a device mesh. Given the mesh and the placements of some
//! graph inputs, parameters and states (the seeds: a batch sharded over `dp`, weights split over
//! `tp`, optimizer state sharded by ZeRO), it gives every value a placement by each op's
//! sharding rule ([`autotp_ir::sharding::axis_rule`]) and inserts the collectives
//! ([`autotp_ir::sharding::reshard`]) wherever an op needs an operand in another placement.
//! Outputs end replicated; each update ends in its target's placement.
//!
//! Data parallelism needs nothing else (the `zero` pass seeds it): with the batch sharded, weight gradients come out of the
//! backward as partial sums, and the optimizer, whose state is replicated, asks for them
//! replicated: one all-reduce per gradient (ZeRO stage 0).
//!
//! Optimizer state without a seed of its own is placed like its parameter. A value computed
//! whole and then sliced is sliced earlier where that gives the same block
//! ([`crate::sink_slices`]).
//!
//! A mean loss over sharded positions is not the sum of the ranks' means, so `cross_entropy` and
//! `nll_loss` with mean reduction (and no class weights) first become a sum divided by the
//! number of counted positions, which the rules then reduce exactly.
//!
//! Input phase: a training step (after `optimize`) on one device. Output: the same step on the
//! mesh; with a one-rank mesh, the graph is unchanged apart from the mesh. Tests:
//! tests/golden/shard_*.ir and tests/sharding.rs (the sharded step, run by the SPMD reference
//! evaluator, against the single-device step).

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::sharding::{axis_rule, computes_block, reshard};
use autotp_ir::{
    BinaryOp, Collective, Def, Graph, Mesh, NodeId, Op, Placement, ReduceOp, Reduction, Rewriter, Tensor, UnaryOp,
    ValueId,
};

use crate::{Pass, PassError};

const PASS: &str = "shard";

pub struct Shard {
    pub mesh: Mesh,
    /// Placements of graph inputs, parameters and states, by name; the rest are replicated.
    pub seeds: BTreeMap<String, Vec<Placement>>,
    /// ZeRO stage 3: parameters sharded over this mesh axis are gathered whole on it before
    /// every use but their own update, anew for each use (the forward's copy is released and the
    /// backward gathers again).
    pub gather_params_on: Option<usize>,
    /// Reduce-scatter a gradient into its shard where it is made (ZeRO stage 2 and 3), rather
    /// than at the optimizer, after the whole backward (stage 1 keeps full gradients).
    pub scatter_early: bool,
    /// With `scatter_early`, a gradient that the step sums over this many micro-batches
    /// (`accumulate`'s or the pipeline's running sums, `s_k = s_(k-1) + g_k`) is scattered term
    /// by term: each micro-batch's gradient goes to its shard where it is made and the running
    /// sum is a sum of shards, as DeepSpeed's stages 2 and 3 reduce-scatter every micro-batch.
    /// No rank then holds a whole gradient beyond the micro-batch that makes it. 0 or 1: the
    /// step is one micro-batch.
    pub micro_batches: usize,
    /// Gradient all-reduces are merged into buckets of up to this many elements
    /// (`--reduce-bucket-size`); 0 reduces each gradient on its own.
    pub bucket_elements: usize,
    /// Gradient reductions over the data-parallel axis in this type (`--comm-dtype`, as
    /// DeepSpeed's `communication_data_type`): cast to it before, back after. `None` reduces
    /// each gradient in its own type.
    pub reduce_dtype: Option<autotp_ir::DType>,
    /// Megatron's sequence parallelism on a tensor-parallel axis: partial sums of hidden states
    /// are reduce-scattered over the sequence rather than all-reduced, so the residual stream,
    /// norms and elementwise ops between the blocks run on each rank's tokens and the
    /// column-parallel GEMMs gather them.
    pub sequence_parallel: Option<SequenceParallel>,
}

impl Shard {
    /// Placements from `seeds` alone on `mesh`: no ZeRO gathers or early scatters, each
    /// gradient reduced on its own in its own type, no sequence parallelism.
    pub fn seeded(mesh: Mesh, seeds: BTreeMap<String, Vec<Placement>>) -> Shard {
        Shard {
            mesh,
            seeds,
            gather_params_on: None,
            scatter_early: false,
            micro_batches: 1,
            bucket_elements: 0,
            reduce_dtype: None,
            sequence_parallel: None,
        }
    }
}

/// Where sequence parallelism splits ([`Shard::sequence_parallel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequenceParallel {
    /// The mesh axis (tensor parallelism's).
    pub axis: usize,
    /// Tokens per sequence: a hidden state is a `[batch, seq_len, features]` value.
    pub seq_len: usize,
}

/// The sequence dim of a value sequence parallelism splits.
pub const SEQUENCE_DIM: usize = 1;

impl SequenceParallel {
    /// Whether `ty` is a hidden state (`[batch, seq_len, features]`, floating point) whose
    /// tokens divide over `ranks`.
    pub fn holds_tokens(&self, ty: &autotp_ir::TensorType, ranks: usize) -> bool {
        ty.rank() == 3
            && ty.dtype.is_float()
            && ty.shape[SEQUENCE_DIM] == self.seq_len
            && self.seq_len.is_multiple_of(ranks)
    }

    /// Whether gathering dim `dim` of `ty` gathers tokens: a dim of the sequence's length, not
    /// the features (a hidden state's tokens; a replicated key or value projection computed on
    /// each rank's tokens, `[batch, heads, seq, head_dim]`).
    pub fn gathers_tokens(&self, ty: &autotp_ir::TensorType, dim: usize) -> bool {
        dim + 1 < ty.rank() && ty.shape[dim] == self.seq_len
    }
}

/// Values the loss depends on (the forward pass and the loss), or on a pipeline stage the
/// activations it sends on.
pub(crate) fn forward_values(graph: &Graph) -> Vec<bool> {
    let mut needed = vec![false; graph.num_values()];
    for (name, v) in graph.outputs() {
        if name == crate::loss::LOSS {
            needed[v.index()] = true;
        }
    }
    let nodes: Vec<_> = graph.nodes().collect();
    for (_, node) in nodes.into_iter().rev() {
        let sends_activation = matches!(node.op, Op::Send { message: autotp_ir::Message::Activation, .. });
        if sends_activation || node.outputs.iter().any(|o| needed[o.index()]) {
            for v in &node.inputs {
                needed[v.index()] = true;
            }
        }
    }
    needed
}

fn invalid(message: String) -> PassError {
    PassError::Invalid { pass: PASS, message }
}

fn add(g: &mut Graph, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
    crate::add_op(PASS, g, op, inputs)
}

/// Rewrites mean-reduced class losses into sum / count.
fn mean_losses_as_sums(graph: &Graph) -> Result<Graph, PassError> {
    let mut rw = Rewriter::new(graph, |_| true);
    for (id, node) in graph.nodes() {
        let (ignore_index, is_ce) = match node.op {
            Op::CrossEntropy { ignore_index, reduction: Reduction::Mean } if node.inputs.len() == 2 => {
                (ignore_index, true)
            }
            Op::NllLoss { ignore_index, reduction: Reduction::Mean } if node.inputs.len() == 2 => (ignore_index, false),
            _ => {
                rw.copy_node(id);
                continue;
            }
        };
        let (scores, labels) = (rw.map(node.inputs[0]), rw.map(node.inputs[1]));
        let g = rw.graph();
        let dtype = g.ty(scores).dtype;
        let op = if is_ce {
            Op::CrossEntropy { ignore_index, reduction: Reduction::Sum }
        } else {
            Op::NllLoss { ignore_index, reduction: Reduction::Sum }
        };
        let summed = g.add_node(op, vec![scores, labels], node.outputs.len()).map_err(invalid)?;
        let outputs = g.node(summed).outputs.clone();
        let count = match ignore_index {
            None => {
                let n = g.ty(labels).numel() as f64;
                add(g, Op::Constant { value: Tensor::full(dtype, vec![], n) }, vec![])?
            }
            Some(ignored) => {
                let label_dtype = g.ty(labels).dtype;
                let ignored =
                    add(g, Op::Constant { value: Tensor::full(label_dtype, vec![], ignored as f64) }, vec![])?;
                let is_ignored = add(g, Op::Binary(BinaryOp::Equal), vec![labels, ignored])?;
                let counted = add(g, Op::Unary(UnaryOp::Not), vec![is_ignored])?;
                let counted = add(g, Op::Cast { to: dtype }, vec![counted])?;
                let axes = (0..g.ty(counted).rank()).collect();
                add(g, Op::Reduce { op: ReduceOp::Sum, axes, keep_dims: false }, vec![counted])?
            }
        };
        let mean = add(g, Op::Binary(BinaryOp::Div), vec![outputs[0], count])?;
        rw.set(node.outputs[0], mean);
        if let (Some(&old), Some(&new)) = (node.outputs.get(1), outputs.get(1)) {
            rw.set(old, new);
        }
    }
    Ok(rw.finish())
}

/// Builds the sharded graph: reshards operands as the rules ask, places outputs.
struct Placer<'g> {
    rw: Rewriter<'g>,
    mesh: Mesh,
    /// (value, axis, placement) -> the value resharded, so consumers share one collective.
    resharded: BTreeMap<(ValueId, usize, Placement), ValueId>,
    /// The backward's own gathers of tokens, likewise ([`Placer::sequence_parallel`]).
    regathered: BTreeMap<(ValueId, usize, Placement), ValueId>,
    /// New node outputs -> the source values they place.
    origin: BTreeMap<ValueId, ValueId>,
    /// See [`Shard::gather_params_on`].
    gather_params_on: Option<usize>,
    /// See [`Shard::sequence_parallel`]: a backward node gathers the tokens it reads anew
    /// (sharing the gathers of other backward nodes), so the forward's gathered copy is not
    /// held for it, as Megatron gathers a column-parallel GEMM's input again for its weight's
    /// gradient.
    sequence_parallel: Option<SequenceParallel>,
    /// Whether the node being placed is in the backward (after the loss).
    in_backward: bool,
}

impl Placer<'_> {
    /// `v` (a new-graph value) in placement `to` along mesh axis `a`.
    fn reshard(&mut self, v: ValueId, a: usize, to: Placement) -> Result<ValueId, PassError> {
        // One dim is never sharded by two axes (the blocks would not nest as each axis's
        // collectives assume): gather it on the other axis first.
        let mut v = v;
        if let Placement::Shard(d) = to {
            for b in (0..self.mesh.axes.len()).filter(|&b| b != a) {
                if self.rw.graph().value(v).placements[b] == Placement::Shard(d) {
                    v = self.reshard(v, b, Placement::Replicate)?;
                }
            }
        }
        let from = self.rw.graph().value(v).placements[a];
        if from == to {
            return Ok(v);
        }
        let fresh = self.gather_params_on.is_some() && self.rw.graph().params().contains(&v);
        let regathered = self.in_backward
            && from == Placement::Shard(SEQUENCE_DIM)
            && to == Placement::Replicate
            && self
                .sequence_parallel
                .is_some_and(|sp| sp.axis == a && sp.holds_tokens(self.rw.graph().ty(v), self.mesh.axes[a].size));
        let cache = if regathered { &self.regathered } else { &self.resharded };
        if let Some(&done) = cache.get(&(v, a, to)).filter(|_| !fresh) {
            return Ok(done);
        }
        let axis = self.mesh.axes[a].name.clone();
        let steps = crate::context_parallel::exchange(&axis, from, to)
            .or_else(|| reshard(from, to))
            .ok_or_else(|| invalid(format!("no collective takes a value from {from} to {to} on mesh axis {axis}")))?;
        let mut current = v;
        for kind in steps {
            let g = self.rw.graph();
            let mut placements = g.value(current).placements.clone();
            let next = add(g, Op::Collective { kind, axis: axis.clone(), start: false }, vec![current])?;
            placements[a] = kind.transition().1;
            g.value_mut(next).placements = placements;
            current = next;
        }
        let cache = if regathered { &mut self.regathered } else { &mut self.resharded };
        cache.insert((v, a, to), current);
        Ok(current)
    }

    /// `v` in `placements` on every axis.
    fn reshard_all(&mut self, v: ValueId, placements: &[Placement]) -> Result<ValueId, PassError> {
        let mut current = v;
        for (a, &p) in placements.iter().enumerate() {
            current = self.reshard(current, a, p)?;
        }
        Ok(current)
    }
}

impl Pass for Shard {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        if !graph.mesh.axes.is_empty() {
            return Err(invalid("the graph is already on a mesh".into()));
        }
        if let Some(axis) = self.mesh.axes.iter().find(|a| a.size == 0) {
            return Err(invalid(format!("mesh axis {} has size 0", axis.name)));
        }
        let mut source = mean_losses_as_sums(graph)?;
        source.mesh = self.mesh.clone();
        let replicated = self.mesh.replicated();
        let ids: Vec<ValueId> = source.values().map(|(id, _)| id).collect();
        for id in ids {
            source.value_mut(id).placements = replicated.clone();
        }
        let named: Vec<ValueId> =
            source.inputs().iter().chain(source.params()).chain(source.states()).copied().collect();
        for (name, placements) in &self.seeds {
            let v = named
                .iter()
                .copied()
                .find(|&v| source.name_of(v) == Some(name.as_str()))
                .ok_or_else(|| invalid(format!("the graph has no input, parameter or state '{name}' to place")))?;
            if placements.len() != self.mesh.axes.len() {
                return Err(invalid(format!(
                    "'{name}' has {} placements for a mesh of {} axes",
                    placements.len(),
                    self.mesh.axes.len()
                )));
            }
            for (axis, p) in self.mesh.axes.iter().zip(placements) {
                if let Placement::Shard(d) = p {
                    let shape = &source.ty(v).shape;
                    if shape.get(*d).is_none_or(|&s| s % axis.size != 0) {
                        return Err(invalid(format!(
                            "'{name}' {} cannot be sharded on dim {d} over mesh axis {} of size {}",
                            source.ty(v),
                            axis.name,
                            axis.size
                        )));
                    }
                }
            }
            source.value_mut(v).placements = placements.clone();
        }
        // Optimizer state without a seed of its own lives like its parameter (a split weight's
        // moments split with it); ZeRO seeds states explicitly.
        let mut follow = Vec::new();
        for (_, node) in source.nodes() {
            let Some((param, states)) = crate::optimize::trained_by(&source, node) else { continue };
            for state in states {
                let seeded = source.name_of(state).is_some_and(|n| self.seeds.contains_key(n));
                if source.states().contains(&state) && !seeded {
                    follow.push((state, source.value(param).placements.clone()));
                }
            }
        }
        for (state, placements) in follow {
            source.value_mut(state).placements = placements;
        }

        // Place once to learn which partial sums some consumer needs whole, then again reducing
        // those right where they are made, so every consumer shares the one reduction (a
        // gradient feeding both a weight's update and the next layer's backward).
        let (first, origin) = place(&source, &self.mesh, None, self.gather_params_on, None)?;
        let scatter = self.scatter_early.then_some(self.micro_batches.max(1));
        let eager = reductions(&first, &origin, scatter, self.sequence_parallel);
        let hints = Hints { eager, blocks: blocks(&first, &origin) };
        let (placed, _) = place(&source, &self.mesh, Some(&hints), self.gather_params_on, self.sequence_parallel)?;
        let placed = crate::sink_slices::sink_slices(&placed)?;
        let mut bucketed = bucket_reductions(&placed, self.bucket_elements)?;
        if let Some(dtype) = self.reduce_dtype {
            bucketed = reduce_gradients_in(&bucketed, dtype)?;
        }
        crate::context_parallel::check_attention_split(&bucketed).map_err(invalid)?;
        let result = overlap_reductions(&bucketed)?;
        *graph = result;
        Ok(())
    }
}

/// What a first placement learned, for the final one. Keys are (source value, mesh axis).
#[derive(Default)]
struct Hints {
    /// The placement a partial sum is reduced to as soon as it is made ([`reductions`]).
    eager: BTreeMap<(ValueId, usize), Placement>,
    /// The dim whose block a value's op computes directly, rather than computing the value
    /// whole for a consumer that slices it ([`blocks`]).
    blocks: BTreeMap<(ValueId, usize), usize>,
}

/// Places every value of `source` (already seeded) by the rules, resharding operands as needed.
/// Without `hints` (the discovery pass) every consumer states its own need, none reusing
/// another's reduction. Returns the placed graph and, for its node outputs, the source values
/// they place.
fn place(
    source: &Graph,
    mesh: &Mesh,
    hints: Option<&Hints>,
    gather_params_on: Option<usize>,
    sequence_parallel: Option<SequenceParallel>,
) -> Result<(Graph, BTreeMap<ValueId, ValueId>), PassError> {
    let no_hints = Hints::default();
    let discovering = hints.is_none();
    let Hints { eager, blocks } = hints.unwrap_or(&no_hints);
    let replicated = mesh.replicated();
    let mut placer = Placer {
        rw: Rewriter::new(source, |_| true),
        mesh: mesh.clone(),
        resharded: BTreeMap::new(),
        regathered: BTreeMap::new(),
        origin: BTreeMap::new(),
        gather_params_on,
        sequence_parallel,
        in_backward: false,
    };
    let forward = forward_values(source);
    // The parameters a node makes the update of and reads itself (an optimizer, or the select
    // that keeps a 16-bit parameter on a skipped step): it takes them as they are held.
    let mut updated_by: BTreeMap<NodeId, Vec<ValueId>> = BTreeMap::new();
    for &(target, value) in source.updates() {
        if let Def::Node(n, _) = source.value(value).def {
            if source.params().contains(&target) && source.node(n).inputs.contains(&target) {
                updated_by.entry(n).or_default().push(target);
            }
        }
    }
    for (id, node) in source.nodes() {
        placer.in_backward = !node.outputs.iter().any(|o| forward[o.index()]);
        let mut inputs: Vec<ValueId> = node.inputs.iter().map(|&v| placer.rw.map(v)).collect();
        if let Some(z) = gather_params_on.filter(|_| !matches!(node.op, Op::AdamW { .. } | Op::Sgd { .. })) {
            let own = updated_by.get(&id).map_or(&[][..], Vec::as_slice);
            for (v, old) in inputs.iter_mut().zip(&node.inputs) {
                let g = placer.rw.graph();
                if g.params().contains(v)
                    && matches!(g.value(*v).placements[z], Placement::Shard(_))
                    && !own.contains(old)
                {
                    *v = placer.reshard(*v, z, Placement::Replicate)?;
                }
            }
        }
        let mut out_placements = vec![replicated.clone(); node.outputs.len()];
        for (a, axis) in mesh.axes.iter().enumerate() {
            // A partial sum that was already reduced for another consumer is used reduced:
            // a linear op could take it partial, but that would reduce it a second time
            // later (clipped gradients feed both the norm and the optimizer).
            for v in inputs.iter_mut().filter(|_| !discovering) {
                if let Some(&reduced) = placer.resharded.get(&(*v, a, Placement::Replicate)) {
                    if placer.rw.graph().value(*v).placements[a] == Placement::PartialSum {
                        *v = reduced;
                    }
                }
            }
            // An embedding's gradient (a scatter-add into the table, or just its block of a
            // vocabulary-parallel table) reads whole what sequence parallelism split by tokens,
            // as Megatron gathers the embedding output's gradient: gathering the tokens'
            // gradients moves fewer bytes than reducing the table.
            let block = node.outputs.first().is_some_and(|o| blocks.contains_key(&(*o, a)));
            let into_table = block || matches!(node.op, Op::ScatterAdd { .. });
            if let Some(sp) = sequence_parallel.filter(|sp| sp.axis == a && into_table) {
                for v in inputs.iter_mut() {
                    let g = placer.rw.graph();
                    if g.value(*v).placements[a] == Placement::Shard(SEQUENCE_DIM)
                        && sp.holds_tokens(g.ty(*v), axis.size)
                    {
                        *v = placer.reshard(*v, a, Placement::Replicate)?;
                    }
                }
            }
            let g = placer.rw.graph();
            let types: Vec<_> = inputs.iter().map(|&v| g.ty(v).clone()).collect();
            let current: Vec<Placement> = inputs.iter().map(|&v| g.value(v).placements[a]).collect();
            let type_refs: Vec<_> = types.iter().collect();
            let out_types: Vec<_> = node.outputs.iter().map(|&o| source.ty(o)).collect();
            let rule = axis_rule(&node.op, &type_refs, &out_types, &current, axis);
            for (i, &want) in rule.inputs.iter().enumerate() {
                inputs[i] = placer.reshard(inputs[i], a, want)?;
            }
            for ((o, p), old) in out_placements.iter_mut().zip(rule.outputs).zip(&node.outputs) {
                o[a] = match blocks.get(&(*old, a)) {
                    Some(&d)
                        if p == Placement::Replicate
                            && !o.contains(&Placement::Shard(d))
                            && computes_block(&node.op, &type_refs, &out_types, d) =>
                    {
                        Placement::Shard(d)
                    }
                    _ => p,
                };
            }
        }
        let g = placer.rw.graph();
        let types = node.outputs.iter().map(|&o| source.ty(o).clone()).collect();
        let new = g.add_node_typed(node.op.clone(), inputs, types);
        let outs = g.node(new).outputs.clone();
        for (&new, placements) in outs.iter().zip(out_placements) {
            g.value_mut(new).placements = placements;
        }
        let ulysses = crate::context_parallel::ulysses_outputs(&node.op, &outs, placer.rw.graph());
        for (&old, new) in node.outputs.iter().zip(outs) {
            placer.rw.graph().value_mut(new).name = source.value(old).name.clone();
            placer.origin.insert(new, old);
            let mut placed = new;
            if let Some(&(a, tokens, heads)) = ulysses.get(&new) {
                placed = placer.reshard(new, a, Placement::Shard(tokens))?;
                // A consumer that takes it by heads (the backward's `out`) takes this one.
                placer.resharded.insert((placed, a, Placement::Shard(heads)), new);
            }
            for a in 0..mesh.axes.len() {
                if let Some(&target) = eager.get(&(old, a)) {
                    if placer.rw.graph().value(placed).placements[a] == Placement::PartialSum {
                        placed = placer.reshard(placed, a, target)?;
                    }
                }
            }
            placer.rw.set(old, placed);
        }
    }
    let mut outputs = Vec::new();
    for (name, v) in source.outputs() {
        let mapped = placer.rw.map(*v);
        outputs.push((name.clone(), placer.reshard_all(mapped, &replicated)?));
    }
    for (target, value) in source.updates() {
        let mapped = placer.rw.map(*value);
        let placed = placer.reshard_all(mapped, &source.value(*target).placements)?;
        placer.rw.set(*value, placed);
    }
    let origin = std::mem::take(&mut placer.origin);
    let mut result = placer.rw.finish_without_outputs();
    for (name, v) in outputs {
        result.add_output(name, v);
    }
    Ok((result, origin))
}

/// Which partial sums to reduce where they are made, and to what, from a first placement.
///
/// With `scatter` (`Some(micro-batches summed per step)`), a reduce-scatter's input (a gradient
/// on its way to a ZeRO shard) is traced back through shape-keeping linear ops to where the
/// partial sum is made, and scattered there: the gradient goes straight to its shard, and what
/// else reads it (the clipping norm) reads the shard. A sum over micro-batches is followed down
/// its running sums (the left operands of `micro-batches - 1` adds of two partial sums) and each
/// term is scattered where it is made instead (the scatter is linear: the shards add up to the
/// sum's shard).
/// An all-reduce's input is traced back through any linear op; unless that reaches a value
/// scattered already, the root is all-reduced once instead when it is no bigger than the
/// reductions it replaces (one all-reduce of a layer's input gradient, not one per use); under
/// `sequence_parallel`, a hidden state's is reduce-scattered over its tokens instead.
///
/// On the context-parallel axis, attention's key and value gradients are reduce-scattered where
/// they are made ([`crate::context_parallel::key_value_gradients`]).
fn reductions(
    placed: &Graph,
    origin: &BTreeMap<ValueId, ValueId>,
    scatter: Option<usize>,
    sequence_parallel: Option<SequenceParallel>,
) -> BTreeMap<(ValueId, usize), Placement> {
    let axis_of = |name: &str| placed.mesh.axes.iter().position(|a| a.name == name);
    let partial = |v: ValueId, a: usize| placed.value(v).placements[a] == Placement::PartialSum;
    // The chain of values from `v` back to where its partial sum is made, through single-output
    // ops with one partial input (keeping the shape and the dims' order when `same_shape`), and
    // not back through a widening cast: the sum is taken in the wider type (mixed precision's
    // f32 reductions).
    let trace = |v: ValueId, a: usize, same_shape: bool| {
        let mut chain = vec![v];
        while let autotp_ir::Def::Node(p, _) = placed.value(*chain.last().expect("not empty")).def {
            let producer = placed.node(p);
            let partial_inputs: Vec<ValueId> = producer.inputs.iter().copied().filter(|&i| partial(i, a)).collect();
            let (&[only], 1) = (&partial_inputs[..], producer.outputs.len()) else { break };
            if matches!(producer.op, Op::Cast { to } if autotp_ir::sharding::widens(placed.ty(only).dtype, to)) {
                break;
            }
            // A scatter's dim must mean the same at the root: not through a transpose (of a
            // square gradient, whose shape it keeps).
            if same_shape
                && (placed.ty(only).shape != placed.ty(v).shape || matches!(producer.op, Op::Transpose { .. }))
            {
                break;
            }
            chain.push(only);
        }
        chain
    };
    let collectives: Vec<(ValueId, usize, Placement)> = placed
        .nodes()
        .filter_map(|(_, node)| {
            let Op::Collective { kind, axis, .. } = &node.op else { return None };
            let target = match kind {
                autotp_ir::Collective::AllReduce => Placement::Replicate,
                autotp_ir::Collective::ReduceScatter { dim } => Placement::Shard(*dim),
                _ => return None,
            };
            Some((node.inputs[0], axis_of(axis)?, target))
        })
        .collect();
    let mut eager: BTreeMap<(ValueId, usize), Placement> = BTreeMap::new();
    let mut scattered = BTreeSet::new();
    for (gradient, a, keys) in crate::context_parallel::key_value_gradients(placed) {
        eager.insert((gradient, a), keys);
        scattered.insert((gradient, a));
    }
    // The two partial operands of an add of `v`'s shape, when `v` is one.
    let partial_terms = |v: ValueId, a: usize| {
        let autotp_ir::Def::Node(p, _) = placed.value(v).def else { return None };
        let node = placed.node(p);
        let same = |t: ValueId| partial(t, a) && placed.ty(t).shape == placed.ty(v).shape;
        match (&node.op, &node.inputs[..]) {
            (Op::Binary(BinaryOp::Add), &[sum, term]) if same(sum) && same(term) => Some((sum, term)),
            _ => None,
        }
    };
    for &(v, a, target) in collectives.iter() {
        let (Placement::Shard(_), Some(micro_batches)) = (target, scatter) else { continue };
        let mut root = *trace(v, a, true).last().expect("not empty");
        let mut roots = Vec::new();
        for _ in 1..micro_batches {
            let Some((sum, term)) = partial_terms(root, a) else { break };
            scattered.insert((root, a));
            roots.push(*trace(term, a, true).last().expect("not empty"));
            root = *trace(sum, a, true).last().expect("not empty");
        }
        roots.push(root);
        for root in roots {
            scattered.insert((root, a));
            eager.insert((root, a), target);
        }
    }
    // (root, axis) -> (bytes all-reduced from it, the all-reduced values)
    let mut replaced: BTreeMap<(ValueId, usize), (usize, Vec<ValueId>)> = BTreeMap::new();
    for &(v, a, target) in &collectives {
        if target != Placement::Replicate {
            continue;
        }
        let chain = trace(v, a, false);
        if chain.iter().any(|&c| scattered.contains(&(c, a))) {
            continue;
        }
        let entry = replaced.entry((*chain.last().expect("not empty"), a)).or_default();
        entry.0 += placed.ty(v).size_bytes();
        entry.1.push(v);
    }
    for ((root, a), (bytes, reduced)) in replaced {
        // Sequence parallelism: a hidden state is scattered over its tokens instead, at the
        // value nearest the root on each reduced value's way back that is one (the root, or the
        // reshape of a flattened root), so the values reduced from one root share a scatter.
        let holds_tokens = |v: ValueId| {
            sequence_parallel.is_some_and(|sp| sp.axis == a && sp.holds_tokens(placed.ty(v), placed.mesh.axes[a].size))
        };
        let scattered_at: Vec<Option<ValueId>> =
            reduced.iter().map(|&v| trace(v, a, false).into_iter().rev().find(|&c| holds_tokens(c))).collect();
        if scattered_at.iter().any(Option::is_some) {
            for (&v, at) in reduced.iter().zip(scattered_at) {
                match at {
                    Some(at) => eager.insert((at, a), Placement::Shard(SEQUENCE_DIM)),
                    None => eager.insert((v, a), Placement::Replicate),
                };
            }
            continue;
        }
        let chosen = if placed.ty(root).size_bytes() <= bytes { vec![root] } else { reduced };
        for v in chosen {
            eager.insert((v, a), Placement::Replicate);
        }
    }
    eager.into_iter().filter_map(|((v, a), target)| origin.get(&v).map(|&o| ((o, a), target))).collect()
}

/// Values a consumer slices that their op could make as just the block, from a first
/// placement: from each `shard_slice` (or `reduce_scatter`: the discovery placement reduces
/// nothing early, so a block of a gradient is often scattered there), up through collectives on
/// other axes and elementwise ops (along the operand that is not broadcast on the sliced dim)
/// to an op that computes blocks
/// ([`autotp_ir::sharding::computes_block`]; the scatter-add of a vocabulary-parallel
/// embedding's gradient, whose clipped copy the optimizer slices).
fn blocks(placed: &Graph, origin: &BTreeMap<ValueId, ValueId>) -> BTreeMap<(ValueId, usize), usize> {
    let mut found = BTreeMap::new();
    for (_, node) in placed.nodes() {
        let (Op::Collective { kind: Collective::ShardSlice { dim }, axis, .. }
        | Op::Collective { kind: Collective::ReduceScatter { dim }, axis, .. }) = &node.op
        else {
            continue;
        };
        let Some(a) = placed.mesh.axes.iter().position(|x| &x.name == axis) else { continue };
        let (mut v, mut d) = (node.inputs[0], *dim);
        while let autotp_ir::Def::Node(p, 0) = placed.value(v).def {
            let producer = placed.node(p);
            let types: Vec<_> = producer.inputs.iter().map(|&i| placed.ty(i)).collect();
            let out = placed.ty(v);
            if computes_block(&producer.op, &types, &[out], d) {
                if let Some(&o) = origin.get(&v) {
                    found.insert((o, a), d);
                }
                break;
            }
            let Some(operands) = crate::sink_slices::operands_along(placed, producer, axis, d) else { break };
            let Some(&(i, e)) = operands.first() else { break };
            (v, d) = (producer.inputs[i], e);
        }
    }
    found
}

/// Each gradient reduction over the data-parallel axis (a non-scalar float all-reduce or
/// reduce-scatter there; the loss's sums are scalars) done in `dtype`: every rank casts its
/// partial sum to `dtype`, the collective sums those, and the sum is cast back.
fn reduce_gradients_in(graph: &Graph, dtype: autotp_ir::DType) -> Result<Graph, PassError> {
    let mut rw = Rewriter::new(graph, |_| true);
    for (id, node) in graph.nodes() {
        let reduction = matches!(
            &node.op,
            Op::Collective { kind: Collective::AllReduce | Collective::ReduceScatter { .. }, axis, start: false }
                if axis == autotp_ir::DATA_AXIS
        );
        let value = node.inputs.first().map(|&v| graph.value(v)).filter(|_| reduction);
        let Some(value) = value.filter(|v| v.ty.dtype != dtype && v.ty.dtype.is_float() && v.ty.numel() > 1) else {
            rw.copy_node(id);
            continue;
        };
        let out = node.outputs[0];
        let input = rw.map(node.inputs[0]);
        let g = rw.graph();
        // A partial sum widened from `dtype` is reduced as it was made (exactly the same bytes).
        let widened_from = match g.value(input).def {
            Def::Node(cast, _) if matches!(g.node(cast).op, Op::Cast { .. }) => Some(g.node(cast).inputs[0]),
            _ => None,
        };
        let narrow = match widened_from.filter(|&v| g.ty(v).dtype == dtype) {
            Some(narrow) => narrow,
            None => {
                let narrow = add(g, Op::Cast { to: dtype }, vec![input])?;
                g.value_mut(narrow).placements = value.placements.clone();
                narrow
            }
        };
        let reduced = add(g, node.op.clone(), vec![narrow])?;
        g.value_mut(reduced).placements = graph.value(out).placements.clone();
        let wide = add(g, Op::Cast { to: value.ty.dtype }, vec![reduced])?;
        g.value_mut(wide).placements = graph.value(out).placements.clone();
        rw.set(out, wide);
    }
    Ok(rw.finish())
}

/// The most reductions [`overlap_reductions`] keeps in flight on one mesh axis.
const REDUCTIONS_IN_FLIGHT: usize = 4;

/// Makes each all-reduce and reduce-scatter that has work to overlap asynchronous: it starts
/// where it was (as soon as its input is made) and is waited for just before its result is first
/// needed, so a gradient's reduction runs while the backward goes on. Reshapes of a result still
/// in flight move down with its wait. One needed right away stays synchronous.
///
/// A reduction holds its input until it is waited for, so at most [`REDUCTIONS_IN_FLIGHT`] are
/// in flight on an axis: starting one more first waits for the oldest (collectives on one
/// communicator complete in order, so it has had the time of the later ones' work). Without the
/// bound a gradient made early in the backward (the LM head's) would stay whole until the end of
/// it, where its reduced shard is first read.
fn overlap_reductions(graph: &Graph) -> Result<Graph, PassError> {
    struct InFlight {
        result: ValueId,
        started: ValueId,
        /// Reshape nodes of the result, emitted after the wait.
        deferred: Vec<usize>,
    }
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let is_view = |n: &autotp_ir::Node| matches!(n.op, Op::Reshape { .. });
    // Whether `v` is needed by the node right after `i` (through reshapes).
    let needed_next = |v: ValueId, i: usize| nodes.get(i + 1).is_some_and(|n| n.inputs.contains(&v) && !is_view(n));
    let mut rw = Rewriter::new(graph, |_| true);
    let mut flights: Vec<Option<InFlight>> = Vec::new();
    let mut started_on: BTreeMap<String, std::collections::VecDeque<usize>> = BTreeMap::new();
    // Old value (a result in flight or a deferred reshape of one) -> its flight.
    let mut pending: BTreeMap<ValueId, usize> = BTreeMap::new();
    let land = |rw: &mut Rewriter, flight: InFlight| -> Result<(), PassError> {
        let g = rw.graph();
        let placements = g.value(flight.started).placements.clone();
        let ready = add(g, Op::Wait, vec![flight.started])?;
        g.value_mut(ready).placements = placements;
        rw.set(flight.result, ready);
        for n in flight.deferred {
            rw.copy_node(autotp_ir::NodeId(n as u32));
        }
        Ok(())
    };
    for (i, node) in nodes.iter().enumerate() {
        if let Some(&f) = node.inputs.first().filter(|_| is_view(node)).and_then(|v| pending.get(v)) {
            if let Some(flight) = flights[f].as_mut() {
                flight.deferred.push(i);
                pending.insert(node.outputs[0], f);
                continue;
            }
        }
        for v in &node.inputs {
            if let Some(f) = pending.remove(v) {
                if let Some(flight) = flights[f].take() {
                    land(&mut rw, flight)?;
                }
            }
        }
        let reduction = matches!(
            node.op,
            Op::Collective {
                kind: autotp_ir::Collective::AllReduce | autotp_ir::Collective::ReduceScatter { .. },
                start: false,
                ..
            }
        );
        if reduction && !needed_next(node.outputs[0], i) {
            let out = node.outputs[0];
            let Op::Collective { kind, axis, .. } = &node.op else { unreachable!("a reduction") };
            // This axis's flights in start order (those landed since at their first use dropped).
            let on_axis = started_on.entry(axis.clone()).or_default();
            on_axis.retain(|&f| flights[f].is_some());
            if on_axis.len() >= REDUCTIONS_IN_FLIGHT {
                let oldest = on_axis.pop_front().expect("in flight");
                land(&mut rw, flights[oldest].take().expect("in flight"))?;
            }
            on_axis.push_back(flights.len());
            let input = rw.map(node.inputs[0]);
            let g = rw.graph();
            let started = add(g, Op::Collective { kind: *kind, axis: axis.clone(), start: true }, vec![input])?;
            g.value_mut(started).placements = graph.value(out).placements.clone();
            pending.insert(out, flights.len());
            flights.push(Some(InFlight { result: out, started, deferred: Vec::new() }));
        } else {
            rw.copy_node(autotp_ir::NodeId(i as u32));
        }
    }
    for flight in flights.into_iter().flatten() {
        land(&mut rw, flight)?;
    }
    Ok(rw.finish())
}

/// Merges gradient reductions into buckets of up to `bucket_elements` (DeepSpeed's reduce
/// buckets): a run of all-reduces, or of reduce-scatters, on one axis of values partial there
/// and whole on every other axis, whose results are first needed after the run, becomes one
/// collective of their concatenation, split and reshaped back. An all-reduce bucket concatenates
/// the flattened values; a reduce-scatter bucket first lays each value out as `[n, numel / n]`
/// (its scattered dim moved to the front), so row `r` of the concatenation is rank `r`'s shard
/// of every member. Fewer, bigger collectives; the same bytes.
///
/// A bucket holds one micro-batch's gradients: it closes before a reduction whose result is
/// summed into the same value as a member's (the same parameter's gradient of the next
/// micro-batch, scattered term by term), as DeepSpeed flushes its bucket at the end of each
/// backward; otherwise every micro-batch's whole gradients would wait for the last one's.
fn bucket_reductions(graph: &Graph, bucket_elements: usize) -> Result<Graph, PassError> {
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
            && value.ty.numel() > 1;
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
