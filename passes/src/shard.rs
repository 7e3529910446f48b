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

use autotp_ir::sharding::{axis_rule, computes_block, reshard, type_within_outer_axes};
use autotp_ir::{
    BinaryOp, Collective, Def, Graph, Mesh, NodeId, Op, Placement, ReduceOp, Reduction, Rewriter, Tensor, UnaryOp,
    ValueId,
};

use crate::expert_dispatch::ExpertParallel;
use crate::{Pass, PassError};

const PASS: &str = "shard";

pub struct Shard {
    pub mesh: Mesh,
    /// Placements of graph inputs, parameters and states, by name; the rest are replicated.
    pub seeds: BTreeMap<String, Vec<Placement>>,
    /// ZeRO stage 3: parameters sharded over these mesh axes (the data-parallel ones) are
    /// gathered whole on them before every use but their own update, anew for each use (the
    /// forward's copy is released and the backward gathers again). Empty: none is gathered.
    pub gather_params_on: Vec<usize>,
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
    /// Expert parallelism on a data-parallel axis: its tables stay split by expert (ZeRO-3 never
    /// gathers them) and its pairs are exchanged to their experts' ranks.
    pub experts: Option<ExpertParallel>,
}

impl Shard {
    /// Placements from `seeds` alone on `mesh`: no ZeRO gathers or early scatters, each
    /// gradient reduced on its own in its own type, no sequence parallelism.
    pub fn seeded(mesh: Mesh, seeds: BTreeMap<String, Vec<Placement>>) -> Shard {
        Shard {
            mesh,
            seeds,
            gather_params_on: Vec::new(),
            scatter_early: false,
            micro_batches: 1,
            bucket_elements: 0,
            reduce_dtype: None,
            sequence_parallel: None,
            experts: None,
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

    /// Whether dim [`SEQUENCE_DIM`] of `ty` is the tokens (a hidden state, or a reshape of one
    /// that keeps its batch and tokens first).
    pub fn splits_tokens(&self, ty: &autotp_ir::TensorType) -> bool {
        ty.rank() > SEQUENCE_DIM && ty.shape[SEQUENCE_DIM] == self.seq_len
    }

    /// Whether reshaping `ty` (see [`Self::splits_tokens`]) to `shape` keeps its batch and
    /// tokens as its first two dims (splitting the features into heads does).
    pub fn keeps_tokens(&self, ty: &autotp_ir::TensorType, shape: &[usize]) -> bool {
        shape.len() > SEQUENCE_DIM && shape[0] == ty.shape[0] && shape[SEQUENCE_DIM] == self.seq_len
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

pub(crate) fn invalid(message: String) -> PassError {
    PassError::Invalid { pass: PASS, message }
}

pub(crate) fn add(g: &mut Graph, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
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
    gather_params_on: Vec<usize>,
    /// See [`Shard::sequence_parallel`]: a backward node gathers the tokens it reads anew
    /// (sharing the gathers of other backward nodes), so the forward's gathered copy is not
    /// held for it, as Megatron gathers a column-parallel GEMM's input again for its weight's
    /// gradient.
    sequence_parallel: Option<SequenceParallel>,
    /// Whether the node being placed is in the backward (after the loss).
    in_backward: bool,
    /// Expert parallelism's axis, where a value split one way is split another by an all-to-all.
    exchange_axis: Option<usize>,
}

impl Placer<'_> {
    /// `v` (a new-graph value) in placement `to` along mesh axis `a`.
    fn reshard(&mut self, v: ValueId, a: usize, to: Placement) -> Result<ValueId, PassError> {
        // Axes sharding one dim nest in mesh-axis order: an axis's collectives gather and
        // scatter within the blocks the axes before it left a rank, so a dim this axis splits
        // or gathers is first gathered on the later axes that split it too.
        let mut v = v;
        let from = self.rw.graph().value(v).placements[a];
        if from == to {
            return Ok(v);
        }
        for b in a + 1..self.mesh.axes.len() {
            if let Placement::Shard(d) = self.rw.graph().value(v).placements[b] {
                if from == Placement::Shard(d) || to == Placement::Shard(d) {
                    v = self.reshard(v, b, Placement::Replicate)?;
                }
            }
        }
        let fresh = !self.gather_params_on.is_empty() && self.rw.graph().params().contains(&v);
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
        let exchanges = axis == autotp_ir::CONTEXT_AXIS || self.exchange_axis == Some(a);
        let steps = crate::context_parallel::exchange(exchanges, from, to)
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
        let experts = self.experts.as_ref();
        let (first, origin) = place(&source, &self.mesh, None, &self.gather_params_on, None, experts)?;
        let scatter = self.scatter_early.then_some(self.micro_batches.max(1));
        let eager = reductions(&first, &origin, scatter, self.sequence_parallel);
        let hints = Hints { eager, blocks: blocks(&first, &origin) };
        let (placed, _) =
            place(&source, &self.mesh, Some(&hints), &self.gather_params_on, self.sequence_parallel, experts)?;
        let placed = crate::sink_slices::sink_slices(&placed)?;
        let mut bucketed = crate::reduction_buckets::bucket_reductions(&placed, self.bucket_elements)?;
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
    gather_params_on: &[usize],
    sequence_parallel: Option<SequenceParallel>,
    experts: Option<&ExpertParallel>,
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
        gather_params_on: gather_params_on.to_vec(),
        sequence_parallel,
        in_backward: false,
        exchange_axis: experts.map(|e| e.axis),
    };
    let dispatched = experts.map(|e| e.dispatched_ids(source)).unwrap_or_default();
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
        let optimizer = matches!(node.op, Op::AdamW { .. } | Op::Sgd { .. });
        for &z in gather_params_on.iter().filter(|_| !optimizer) {
            let own = updated_by.get(&id).map_or(&[][..], Vec::as_slice);
            for (v, old) in inputs.iter_mut().zip(&node.inputs) {
                let g = placer.rw.graph();
                // An experts' table split by expert over the gather's axis is the rank's own.
                let expert_table =
                    experts.is_some_and(|e| e.axis == z && e.tables.contains(g.name_of(*v).unwrap_or("")));
                if g.params().contains(v)
                    && matches!(g.value(*v).placements[z], Placement::Shard(_))
                    && !own.contains(old)
                    && !expert_table
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
            // A reshape that merges the tokens with the batch reads them whole, at every batch:
            // a batch of one could carry the split into `[tokens, ...]`, but what reads that (an
            // experts' per-pair vectors, beside ids and weights split by other rules) expects
            // tokens whole, as a larger batch has them.
            let merges_tokens = |sp: &SequenceParallel, ty: &autotp_ir::TensorType| match &node.op {
                Op::Reshape { shape } => sp.splits_tokens(ty) && !sp.keeps_tokens(ty, shape),
                _ => false,
            };
            if let Some(sp) = sequence_parallel.filter(|sp| sp.axis == a) {
                for v in inputs.iter_mut() {
                    let g = placer.rw.graph();
                    let ty = g.ty(*v);
                    let split = g.value(*v).placements[a] == Placement::Shard(SEQUENCE_DIM);
                    if split && ((into_table && sp.holds_tokens(ty, axis.size)) || merges_tokens(&sp, ty)) {
                        *v = placer.reshard(*v, a, Placement::Replicate)?;
                    }
                }
            }
            // The rule decides on the blocks the axes before this one left a rank (their
            // placements are settled: the inputs' by the reshards above, the outputs' by the
            // rules).
            let g = placer.rw.graph();
            let types: Vec<_> =
                inputs.iter().map(|&v| type_within_outer_axes(mesh, g.ty(v), &g.value(v).placements, a)).collect();
            let current: Vec<Placement> = inputs.iter().map(|&v| g.value(v).placements[a]).collect();
            let type_refs: Vec<_> = types.iter().collect();
            let out_types: Vec<_> = (node.outputs.iter().zip(&out_placements))
                .map(|(&o, placements)| type_within_outer_axes(mesh, source.ty(o), placements, a))
                .collect();
            let out_types: Vec<_> = out_types.iter().collect();
            let rule = experts
                .and_then(|e| e.rule(node, a, axis.size, &dispatched, source))
                .unwrap_or_else(|| axis_rule(&node.op, &type_refs, &out_types, &current, axis));
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
            // Scatters first: a reduction over another axis then sums the rank's block alone.
            let targets: Vec<(usize, Placement)> =
                (0..mesh.axes.len()).filter_map(|a| eager.get(&(old, a)).map(|&t| (a, t))).collect();
            let scatters = targets.iter().filter(|(_, t)| matches!(t, Placement::Shard(_)));
            for &(a, target) in scatters.chain(targets.iter().filter(|(_, t)| !matches!(t, Placement::Shard(_)))) {
                if placer.rw.graph().value(placed).placements[a] == Placement::PartialSum {
                    placed = placer.reshard(placed, a, target)?;
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
/// An all-reduce's input is traced back through any linear op but a scatter or slice over
/// another axis (the block it makes is smaller to reduce); unless that reaches a value
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
    // f32 reductions). `scattering`: the chain of a scatter, which goes back through the
    // scatters over other axes too (ZeRO over the two data axes, dp and ep, scatters a gradient
    // over both where it is made).
    let trace = |v: ValueId, a: usize, same_shape: bool, scattering: bool| {
        let mut chain = vec![v];
        while let autotp_ir::Def::Node(p, _) = placed.value(*chain.last().expect("not empty")).def {
            let producer = placed.node(p);
            let partial_inputs: Vec<ValueId> = producer.inputs.iter().copied().filter(|&i| partial(i, a)).collect();
            let (&[only], 1) = (&partial_inputs[..], producer.outputs.len()) else { break };
            if matches!(producer.op, Op::Cast { to } if autotp_ir::sharding::widens(placed.ty(only).dtype, to)) {
                break;
            }
            // Nor back past a scatter or slice over another axis (ZeRO's shard of a gradient
            // over dp, summed over cp too): reduced after it, a rank reduces its block alone.
            let scatter = match &producer.op {
                Op::Collective { kind: Collective::ReduceScatter { .. }, .. } => !scattering,
                Op::Collective { kind: Collective::ShardSlice { .. }, .. } => true,
                _ => false,
            };
            if scatter {
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
        let mut root = *trace(v, a, true, true).last().expect("not empty");
        let mut roots = Vec::new();
        for _ in 1..micro_batches {
            let Some((sum, term)) = partial_terms(root, a) else { break };
            scattered.insert((root, a));
            roots.push(*trace(term, a, true, true).last().expect("not empty"));
            root = *trace(sum, a, true, true).last().expect("not empty");
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
        let chain = trace(v, a, false, false);
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
            reduced.iter().map(|&v| trace(v, a, false, false).into_iter().rev().find(|&c| holds_tokens(c))).collect();
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
    hierarchical_reductions(placed, &mut eager);
    eager.into_iter().filter_map(|((v, a), target)| origin.get(&v).map(|&o| ((o, a), target))).collect()
}

/// A value all-reduced where it is made over more than one of the data axes (a weight's
/// gradient under ZeRO 0, over dp and cp, or over the groups of ep: dp and ep) is
/// reduce-scattered over all of them but one and all-reduced over that one on its block
/// (ep where it is one, else dp), and gathered back where it is read whole: `2 (N-1)/N` of its
/// bytes over the `N` ranks in all, what Megatron's one all-reduce over the dp x cp group (or
/// the data-parallel group) sends, where all-reducing over each axis in turn sends `2 (n-1)/n`
/// of them for each axis of `n`.
fn hierarchical_reductions(placed: &Graph, eager: &mut BTreeMap<(ValueId, usize), Placement>) {
    let axis_of = |name: &str| placed.mesh.axes.iter().position(|a| a.name == name);
    let data_axes: Vec<usize> = [autotp_ir::DATA_AXIS, autotp_ir::EXPERT_AXIS, autotp_ir::CONTEXT_AXIS]
        .iter()
        .filter_map(|name| axis_of(name))
        .collect();
    let reduced_over = |v: ValueId, eager: &BTreeMap<(ValueId, usize), Placement>| -> Vec<usize> {
        data_axes.iter().copied().filter(|&a| eager.get(&(v, a)) == Some(&Placement::Replicate)).collect()
    };
    let values: BTreeSet<ValueId> = eager.keys().map(|&(v, _)| v).collect();
    for v in values {
        let axes = reduced_over(v, eager);
        if axes.len() < 2 {
            continue;
        }
        // The all-reduce stays on ep where it is one, else on dp.
        let kept =
            axes.iter().copied().find(|&a| placed.mesh.axes[a].name == autotp_ir::EXPERT_AXIS).unwrap_or(axes[0]);
        let placements = &placed.value(v).placements;
        let mut local = autotp_ir::sharding::local_shape(&placed.mesh, &placed.ty(v).shape, placements);
        for a in axes.into_iter().filter(|&a| a != kept) {
            // A dim no other axis splits (tp's, say), which a rank's block (after the scatters
            // chosen here) divides.
            let n = placed.mesh.axes[a].size;
            let free =
                |d: usize| !placements.contains(&Placement::Shard(d)) && local[d].is_multiple_of(n) && local[d] >= n;
            if let Some(dim) = (0..local.len()).find(|&d| free(d)) {
                eager.insert((v, a), Placement::Shard(dim));
                local[dim] /= n;
            }
        }
    }
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

/// Each gradient reduction over the data-parallel axes (dp, and ep where it is an axis: a
/// non-scalar float all-reduce or reduce-scatter there; the loss's sums are scalars) done in
/// `dtype`: every rank casts its partial sum to `dtype`, the collective sums those, and the sum
/// is cast back.
fn reduce_gradients_in(graph: &Graph, dtype: autotp_ir::DType) -> Result<Graph, PassError> {
    let mut rw = Rewriter::new(graph, |_| true);
    for (id, node) in graph.nodes() {
        let reduction = matches!(
            &node.op,
            Op::Collective { kind: Collective::AllReduce | Collective::ReduceScatter { .. }, axis, start: false }
                if axis == autotp_ir::DATA_AXIS || axis == autotp_ir::EXPERT_AXIS
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
