//! `autotp`: tensor parallelism found from dataflow (`--tp N`, with `--dp M` alongside).
//!
//! The pass finds Megatron's pattern in every block without looking at names: a *row-parallel*
//! weight is one whose matmul result (plus its bias) is added back into the residual stream; a
//! *column-parallel* weight is one whose matmul reads a normalised hidden state and whose result
//! reaches a row-parallel matmul before the next normalisation (of all its features: a per-head
//! norm is inside the block). Column weights are split on their output features, row weights
//! on their input features (through the `transpose` an export puts on `[out, in]` weights). Everything else follows from the sharding rules: the
//! heads split with the projections, attention runs per head, the row matmul gives partial
//! sums that one all-reduce completes. Parameters that the rules would otherwise slice on every
//! step (biases of column layers, say) are split too, until none is.
//!
//! Experts' weights looked up by expert (a batched-experts mixture) count as weights, on either
//! side of their batched matmul, and a row result may pass through the routing scale, the sum
//! over a token's experts and a post-norm on its way back.
//!
//! Correctness never rests on the pattern match: [`Shard`] places every value by the ops' rules
//! and inserts whatever collective a layout needs. The match only decides what is split; where a
//! split cannot hold inside a block, the forward pass would need an all-gather there. A
//! key/value projection with fewer heads than tp (multi-query and grouped-query attention) is
//! then replicated, its gradient summed over tp, as DeepSpeed AutoTP does; any other such split
//! is refused with the value and why (tp not dividing the heads, a norm over split features),
//! or, with `replicate_unsplittable` (`--tp-replicate-unsplittable`), the split weights of the
//! block that computes the value stay whole on every rank, as DeepSpeed AutoTP leaves the
//! layers it does not know: the rest of the model still splits, and the block's row-parallel
//! projection reads each rank's slice of its replicated input.
//! The token embedding, the LM head and the cross-entropy split over the vocabulary
//! ([`crate::vocab`]).
//!
//! Input phase: a training step (after `optimize`). Output: the step on the mesh `[dp, tp]`.
//! Tests: tests/golden/autotp_*.ir, tests/parallel.rs.

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::{BinaryOp, Collective, Graph, Mesh, NodeId, Op, Placement, ValueId};

use crate::shard::{forward_values, Shard};
use crate::{Pass, PassError};

const PASS: &str = "autotp";

pub struct AutoTp {
    pub tp: usize,
    /// Data-parallel ranks beside the tensor-parallel ones (1 for none).
    pub dp: usize,
    /// Context-parallel ranks (1 for none): each sequence split over them
    /// ([`crate::zero::batch_placement`]).
    pub cp: usize,
    /// ZeRO over the data-parallel ranks.
    pub zero: crate::zero::ZeroConfig,
    /// Graph inputs sharded over `dp` on their batch dim.
    pub batch_inputs: Vec<String>,
    /// Keep a block whose split does not hold replicated (`--tp-replicate-unsplittable`), as
    /// DeepSpeed AutoTP leaves the layers it does not know, instead of refusing the layout.
    pub replicate_unsplittable: bool,
    /// Parameters' placements decided elsewhere, over ZeRO's ([`crate::zero::Zero`]'s field).
    pub param_placements: BTreeMap<String, Vec<Placement>>,
    /// Megatron's sequence parallelism (`--sequence-parallel`): the tokens per sequence, whose
    /// hidden states between the blocks are split over tp ([`crate::shard::SequenceParallel`]).
    pub sequence_parallel: Option<usize>,
    /// Expert-parallel ranks (1 for none): the experts' tables split by expert over dp or an
    /// `ep` axis as well ([`crate::zero::Zero::ep`]).
    pub ep: usize,
}

/// Why a weight got its placement, for `--explain-tp`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Explained {
    pub weight: String,
    pub placement: Placement,
    pub reason: String,
}

fn invalid(message: String) -> PassError {
    PassError::Invalid { pass: PASS, message }
}

/// A column-parallel weight's place in its block.
struct Column {
    /// Its output features.
    features: usize,
    /// The products of two activations its result reaches in the block: attention's scores and
    /// their use (or the fused attention), shared by the query, key and value projections, none
    /// for an MLP's.
    activation_products: BTreeSet<usize>,
    /// The heads its result is reshaped into, where a reshape says: 1 where the reshape keeps
    /// the features whole and inserts a unit heads dim (a key shared by every query head, as
    /// multi-query attention's and latent attention's rotary key).
    heads: Option<usize>,
}

/// A matmul of the forward pass with a weight operand: a parameter (possibly transposed), or
/// experts' weights looked up by expert, on either side.
struct WeightUse {
    node: usize,
    param: ValueId,
    /// The matmul's other operand.
    activation: ValueId,
    /// The parameter dims that are the matmul's output and input features.
    out_dim: usize,
    in_dim: Option<usize>,
}

/// Sequence parallelism's hidden states are `[batch, seq, features]`; a projection that
/// computes on flattened tokens (GPT-2's `addmm` on `[batch * seq, features]`) adds its bias
/// before the reshape back. The bias is added after the reshape instead, so that the partial
/// sum of a row-parallel projection reaches a hidden state's shape before anything needs it
/// whole, and is reduce-scattered over tokens there: `reshape(x + b)` becomes
/// `reshape(x) + b` where `b` runs along the last dim, which the reshape keeps.
fn bias_adds_after_reshapes(graph: &Graph, seq_len: usize) -> Result<Graph, PassError> {
    let consumers = graph.consumers();
    let sunk: BTreeMap<NodeId, (ValueId, ValueId)> =
        graph.nodes().filter_map(|(id, node)| Some((id, sinkable_bias(graph, &consumers, node, seq_len)?))).collect();
    // The adds moved after their reshapes.
    let moved: BTreeSet<ValueId> = sunk.keys().map(|&id| graph.node(id).inputs[0]).collect();
    let mut rw = autotp_ir::Rewriter::new(graph, |_| true);
    for (id, node) in graph.nodes() {
        if node.outputs.iter().any(|o| moved.contains(o)) {
            continue;
        }
        let Some(&(x, bias)) = sunk.get(&id) else {
            rw.copy_node(id);
            continue;
        };
        let (x, bias) = (rw.map(x), rw.map(bias));
        let g = rw.graph();
        let reshaped = crate::add_op(PASS, g, node.op.clone(), vec![x])?;
        let added = crate::add_op(PASS, g, Op::Binary(BinaryOp::Add), vec![reshaped, bias])?;
        rw.set(node.outputs[0], added);
    }
    Ok(rw.finish())
}

/// Sequence parallelism gathers a hidden state again for the backward rather than hold the
/// forward's gathered copy ([`crate::shard::Shard::sequence_parallel`]). A backward node that
/// reads the forward's reshape of a hidden state (GPT-2's weight gradients read the flattened
/// tokens) would hold it all the same: it reads a reshape of its own instead, made in the
/// backward from the hidden state, one per forward reshape.
fn reshapes_for_the_backward(graph: &Graph, seq_len: usize) -> Result<Graph, PassError> {
    let forward = forward_values(graph);
    // The forward reshape making `v` and the hidden state it reshapes.
    let reshaped_tokens = |v: ValueId| -> Option<(&Op, ValueId)> {
        let autotp_ir::Def::Node(reshape, 0) = graph.value(v).def else { return None };
        let reshape = graph.node(reshape);
        let tokens = *reshape.inputs.first()?;
        let ty = graph.ty(tokens);
        let hidden_state = ty.rank() == 3 && ty.shape[1] == seq_len && ty.dtype.is_float();
        (matches!(reshape.op, Op::Reshape { .. }) && forward[v.index()] && hidden_state)
            .then_some((&reshape.op, tokens))
    };
    let mut rw = autotp_ir::Rewriter::new(graph, |_| true);
    let mut copies: BTreeMap<ValueId, ValueId> = BTreeMap::new();
    for (id, node) in graph.nodes() {
        let backward = !node.outputs.iter().any(|o| forward[o.index()]);
        if !backward || !node.inputs.iter().any(|&v| reshaped_tokens(v).is_some()) {
            rw.copy_node(id);
            continue;
        }
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &v in &node.inputs {
            let input = match (reshaped_tokens(v), copies.get(&v)) {
                (None, _) => rw.map(v),
                (Some(_), Some(&copy)) => copy,
                (Some((reshape, tokens)), None) => {
                    let tokens = rw.map(tokens);
                    let copy = crate::add_op(PASS, rw.graph(), reshape.clone(), vec![tokens])?;
                    copies.insert(v, copy);
                    copy
                }
            };
            inputs.push(input);
        }
        let types = node.outputs.iter().map(|&o| graph.ty(o).clone()).collect();
        let g = rw.graph();
        let new = g.add_node_typed(node.op.clone(), inputs, types);
        let outputs = g.node(new).outputs.clone();
        for (&old, new) in node.outputs.iter().zip(outputs) {
            rw.graph().value_mut(new).name = graph.value(old).name.clone();
            rw.set(old, new);
        }
    }
    Ok(rw.finish())
}

/// `(x, b)` when `node` reshapes `x + b` (its only use) into a hidden state, `b` running along
/// the last dim ([`bias_adds_after_reshapes`]).
fn sinkable_bias(
    graph: &Graph,
    consumers: &[Vec<NodeId>],
    node: &autotp_ir::Node,
    seq_len: usize,
) -> Option<(ValueId, ValueId)> {
    let (Op::Reshape { .. }, &[sum]) = (&node.op, &node.inputs[..]) else { return None };
    let autotp_ir::Def::Node(add, 0) = graph.value(sum).def else { return None };
    let add = graph.node(add);
    let (Op::Binary(BinaryOp::Add), &[x, bias]) = (&add.op, &add.inputs[..]) else { return None };
    let (from, to, bias_ty) = (graph.ty(sum), graph.ty(node.outputs[0]), graph.ty(bias));
    let hidden_state = to.rank() == 3 && to.shape[1] == seq_len;
    let along_features =
        bias_ty.rank() == 1 && from.shape.last() == to.shape.last() && to.shape.last() == Some(&bias_ty.shape[0]);
    (consumers[sum.index()].len() == 1 && hidden_state && along_features).then_some((x, bias))
}

impl AutoTp {
    /// The weights to split: (parameter, placement on tp, reason), and each column-parallel
    /// weight's place in its block.
    fn plan(&self, graph: &Graph) -> (Vec<Explained>, BTreeMap<String, Column>) {
        let forward = forward_values(graph);
        let producer: BTreeMap<ValueId, usize> =
            graph.nodes().flat_map(|(id, n)| n.outputs.iter().map(move |&o| (o, id.index()))).collect();
        let mut users: BTreeMap<ValueId, Vec<usize>> = BTreeMap::new();
        for (id, node) in graph.nodes() {
            for &v in &node.inputs {
                users.entry(v).or_default().push(id.index());
            }
        }
        let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
        let is_param = |v: ValueId| graph.params().contains(&v);
        let is_norm = |n: usize| matches!(nodes[n].op, Op::LayerNorm { .. } | Op::RmsNorm { .. });
        // A node of the forward pass (a pipeline stage's send has no output, and is not).
        let in_forward = |n: usize| nodes[n].outputs.first().is_some_and(|o| forward[o.index()]);

        let mut uses = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let Op::MatMul { transpose_lhs, transpose_rhs } = node.op else { continue };
            if !forward[node.outputs[0].index()] {
                continue;
            }
            let (lhs, rhs) = (node.inputs[0], node.inputs[1]);
            // x @ W: W is [k, n] (or [n, k] with transpose_rhs), a parameter or a view of one,
            // or a batch of experts' weights looked up by expert.
            let rank = graph.ty(rhs).rank();
            let (operand, activation, out_dim, in_dim) = if rank == 2 || looks_up_weights(graph, rhs) {
                let (n, k) = if transpose_rhs { (rank - 2, rank - 1) } else { (rank - 1, rank - 2) };
                (rhs, lhs, n, k)
            } else if looks_up_weights(graph, lhs) {
                // W_e @ x, the experts' weights [m, k] on the left (a batched-experts export).
                let rank = graph.ty(lhs).rank();
                let (m, k) = if transpose_lhs { (rank - 1, rank - 2) } else { (rank - 2, rank - 1) };
                (lhs, rhs, m, k)
            } else {
                continue;
            };
            if let Some((param, out_dim)) = trace_param(graph, operand, out_dim) {
                let in_dim = trace_param(graph, operand, in_dim).map(|(_, d)| d);
                uses.push(WeightUse { node: i, param, activation, out_dim, in_dim });
            }
        }
        // Whether `a` is computed before `v` and feeds it: the block's input, for a value that
        // the block computes from it.
        let feeds = |a: ValueId, v: ValueId| {
            let mut stack = vec![v];
            let mut seen = BTreeSet::new();
            while let Some(v) = stack.pop() {
                if v == a {
                    return true;
                }
                if let Some(&p) = producer.get(&v) {
                    stack.extend(nodes[p].inputs.iter().copied().filter(|&i| seen.insert(i)));
                }
            }
            false
        };
        // Row-parallel: the result (plus biases, through reshapes and casts, through the routing weights'
        // scaling and the sum over a token's experts, beside another branch's result, through a
        // post-norm) is added to the residual stream: the value of its type that the block
        // read. What else it is added to is a bias (a parameter, or experts' biases looked up
        // by expert, as gpt-oss's) or a parallel branch (a shared expert, a parallel MLP).
        let residual_of = |u: &WeightUse| -> Option<ValueId> {
            let mut v = nodes[u.node].outputs[0];
            for _ in 0..12 {
                // Its one consumer in the forward pass (the backward may read it too).
                let consumers: Vec<usize> =
                    users.get(&v).into_iter().flatten().copied().filter(|&c| in_forward(c)).collect();
                let [c] = consumers[..] else { return None };
                match nodes[c].op {
                    // A cast of mixed precision: a 16-bit result joins an f32 residual stream.
                    Op::Reshape { .. } | Op::Cast { .. } | Op::Reduce { op: autotp_ir::ReduceOp::Sum, .. } => {}
                    // Expert parallelism's pairs on their way back from their experts' ranks.
                    Op::Transpose { .. } | Op::GatherElements { .. } if nodes[c].inputs[0] == v => {}
                    // A norm of the block's output before the residual add (Gemma 2's
                    // post-norms): the partial sums are reduced before it.
                    Op::LayerNorm { .. } | Op::RmsNorm { .. } if nodes[c].inputs[0] == v => {}
                    Op::Binary(BinaryOp::Mul) if nodes[c].inputs[0] != nodes[c].inputs[1] => {}
                    Op::Binary(BinaryOp::Add) => {
                        let other = if nodes[c].inputs[0] == v { nodes[c].inputs[1] } else { nodes[c].inputs[0] };
                        let same_type =
                            graph.ty(other) == graph.ty(nodes[c].outputs[0]) && graph.ty(other) == graph.ty(v);
                        if !is_param(other) && same_type && feeds(other, v) {
                            return Some(other);
                        }
                    }
                    _ => return None,
                }
                v = nodes[c].outputs[0];
            }
            None
        };
        let mut rows = BTreeSet::new();
        let mut residuals = BTreeSet::new();
        for u in &uses {
            if let Some(residual) = residual_of(u) {
                rows.insert(u.node);
                residuals.insert(residual);
            }
        }
        // A projection whose result (plus its bias) is the residual stream itself (ELECTRA's
        // and RemBERT's embedding projections, which post-norm blocks add back to) keeps its
        // features whole.
        let makes_residual = |u: &WeightUse| {
            let out = nodes[u.node].outputs[0];
            residuals.contains(&out)
                || users.get(&out).into_iter().flatten().any(|&c| {
                    matches!(nodes[c].op, Op::Binary(BinaryOp::Add))
                        && nodes[c].inputs.iter().any(|&i| is_param(i))
                        && residuals.contains(&nodes[c].outputs[0])
                })
        };
        // Column-parallel: reads a norm's output and reaches a row matmul before another norm.
        // A norm over fewer elements than the projection's features is a per-head norm (Qwen 3's
        // and LFM2's query and key norms), inside the block.
        let ends_block = |c: usize, features: usize| match nodes[c].op {
            Op::LayerNorm { axis, .. } | Op::RmsNorm { axis, .. } => {
                graph.ty(nodes[c].inputs[0]).shape[axis..].iter().product::<usize>() >= features
            }
            _ => false,
        };
        let reaches_row = |start: ValueId, features: usize| {
            let mut stack = vec![start];
            let mut seen = BTreeSet::new();
            while let Some(v) = stack.pop() {
                for &c in users.get(&v).into_iter().flatten() {
                    if rows.contains(&c) {
                        return true;
                    }
                    if ends_block(c, features) || !seen.insert(c) || !in_forward(c) {
                        continue;
                    }
                    // Not through indices (a router's choice of experts reaches the experts'
                    // matmuls only as which weights they read).
                    stack.extend(nodes[c].outputs.iter().copied().filter(|&o| graph.ty(o).dtype.is_float()));
                }
            }
            false
        };
        // The products of two activations (attention's scores and their use) a value reaches
        // within its block.
        let activation_products = |start: ValueId| {
            let mut stack = vec![start];
            let mut seen = BTreeSet::new();
            let mut products = BTreeSet::new();
            while let Some(v) = stack.pop() {
                for &c in users.get(&v).into_iter().flatten() {
                    if rows.contains(&c) || is_norm(c) || !seen.insert(c) || !in_forward(c) {
                        continue;
                    }
                    let of_weights = nodes[c].inputs.iter().any(|&i| trace_param(graph, i, 0).is_some());
                    let product = match nodes[c].op {
                        Op::MatMul { .. } => !of_weights,
                        Op::Attention { .. } => true,
                        _ => false,
                    };
                    if product {
                        products.insert(c);
                    }
                    stack.extend(nodes[c].outputs.iter().copied());
                }
            }
            products
        };
        let mut plan = Vec::new();
        let mut columns = BTreeMap::new();
        let mut planned = BTreeSet::new();
        let mut unsplit = Vec::new();
        for u in &uses {
            let name = graph.name_of(u.param).unwrap_or("").to_string();
            // The activation operand, through reshapes and broadcasts (each token's copy for
            // each of its experts, sent to its expert's rank under expert parallelism), is a
            // norm's output.
            let mut activation = u.activation;
            while let Some(&p) = producer.get(&activation) {
                match nodes[p].op {
                    Op::Reshape { .. } | Op::Expand { .. } | Op::Cast { .. } | Op::Transpose { .. } => {
                        activation = nodes[p].inputs[0]
                    }
                    Op::ScatterElements { .. } => activation = nodes[p].inputs[1],
                    _ => break,
                }
            }
            let reads_norm = producer.get(&activation).is_some_and(|&p| is_norm(p));
            let (placement, reason) = if rows.contains(&u.node) {
                let Some(in_dim) = u.in_dim else { continue };
                (Placement::Shard(in_dim), "row-parallel: its matmul result returns to the residual stream")
            } else if reads_norm
                && !makes_residual(u)
                && reaches_row(nodes[u.node].outputs[0], graph.ty(u.param).shape[u.out_dim])
            {
                let column = Column {
                    features: graph.ty(u.param).shape[u.out_dim],
                    activation_products: activation_products(nodes[u.node].outputs[0]),
                    heads: heads_made(graph, &users, &nodes, nodes[u.node].outputs[0]),
                };
                columns.insert(name.clone(), column);
                (
                    Placement::Shard(u.out_dim),
                    "column-parallel: reads a normalised hidden state and feeds a row-parallel matmul",
                )
            } else {
                if reads_norm {
                    unsplit.push(u);
                }
                continue;
            };
            if planned.insert(u.param) {
                plan.push(Explained { weight: name, placement, reason: reason.into() });
            }
        }
        // A down-projection whose normalised output a column-parallel matmul reads (latent
        // attention's q_a_proj and kv_a_proj): replicated, said so.
        let through_reshapes = |mut v: ValueId| -> Vec<usize> {
            loop {
                let readers = users.get(&v).cloned().unwrap_or_default();
                match readers[..] {
                    [r] if matches!(nodes[r].op, Op::Reshape { .. }) => v = nodes[r].outputs[0],
                    _ => return readers,
                }
            }
        };
        let column_nodes: BTreeSet<usize> = uses
            .iter()
            .filter(|w| columns.contains_key(graph.name_of(w.param).unwrap_or("")))
            .map(|w| w.node)
            .collect();
        for u in unsplit {
            let latent = through_reshapes(nodes[u.node].outputs[0])
                .into_iter()
                .any(|n| is_norm(n) && through_reshapes(nodes[n].outputs[0]).iter().any(|m| column_nodes.contains(m)));
            if latent && planned.insert(u.param) {
                plan.push(Explained {
                    weight: graph.name_of(u.param).unwrap_or("").to_string(),
                    placement: Placement::Replicate,
                    reason: "low-rank down-projection (latent attention): replicated; the split up-projection \
                             reads its normalised output"
                        .into(),
                });
            }
        }
        (plan, columns)
    }

    fn mesh(&self) -> Mesh {
        crate::zero::mesh(self.dp, self.ep, self.cp, self.tp)
    }

    /// Splits the planned weights, then the parameters the rules slice, until none is sliced;
    /// returns the sharded graph and why each weight is placed as it is.
    pub fn shard(&self, graph: &Graph) -> Result<(Graph, Vec<Explained>), PassError> {
        if self.tp < 2 {
            return Err(invalid(format!("--tp {} needs at least 2 ranks", self.tp)));
        }
        let mesh = self.mesh();
        let tp_axis = mesh.axes.len() - 1;
        let (planned, columns) = self.plan(graph);
        let vocab = crate::vocab::find(graph);
        let vocab_weights = vocab.as_ref().map(|split| vocab_explained(graph, split)).unwrap_or_default();
        // A pipeline stage may hold only the LM head, split over the vocabulary.
        if planned.is_empty() && vocab_weights.is_empty() {
            return Err(invalid(
                "found no column- and row-parallel weights and no vocabulary to split (no Megatron block)".into(),
            ));
        }
        let vocab_names: BTreeSet<String> = vocab_weights.iter().map(|e| e.weight.clone()).collect();
        let planned = [planned, vocab_weights].concat();
        for e in &planned {
            let ty = graph.ty(param_by_name(graph, &e.weight));
            if let Placement::Shard(d) = e.placement {
                if !ty.shape[d].is_multiple_of(self.tp) {
                    let hint = if vocab_names.contains(&e.weight) {
                        "; pad the vocabulary to a multiple of tp (Megatron's --make-vocab-size-divisible-by)"
                    } else {
                        ""
                    };
                    return Err(invalid(format!(
                        "cannot split weight '{}' {ty} over tp={}: dim {d} of size {} is not divisible ({}){hint}",
                        e.weight, self.tp, ty.shape[d], e.reason
                    )));
                }
            }
        }
        let mut split_step = match &vocab {
            Some(split) => crate::vocab::split_cross_entropy(graph, split, self.tp)?,
            None => graph.clone(),
        };
        if let Some(seq_len) = self.sequence_parallel {
            split_step = bias_adds_after_reshapes(&split_step, seq_len)?;
            split_step = reshapes_for_the_backward(&split_step, seq_len)?;
        }
        let graph = &split_step;
        let experts = crate::zero::experts_on(graph, &mesh, self.ep);
        let seeds_for = |explained: &[Explained]| {
            let mut seeds: BTreeMap<String, Vec<Placement>> = BTreeMap::new();
            for name in crate::present_inputs(graph, &self.batch_inputs) {
                seeds.insert(name.clone(), crate::zero::batch_placement(&mesh, crate::zero::input_rank(graph, name)));
            }
            for e in explained {
                let mut p = mesh.replicated();
                p[tp_axis] = e.placement;
                seeds.insert(e.weight.clone(), p);
            }
            if let Some(experts) = &experts {
                experts.seed(&mesh, &mut seeds);
            }
            if self.dp > 1 {
                crate::zero::seed(graph, &mesh, self.zero, &mut seeds);
            }
            seeds.extend(self.param_placements.clone());
            seeds
        };
        let (gather_params_on, scatter_early) =
            if self.dp > 1 { crate::zero::shard_options(self.zero.stage, &mesh) } else { (Vec::new(), false) };
        let sequence_parallel =
            self.sequence_parallel.map(|seq_len| crate::shard::SequenceParallel { axis: tp_axis, seq_len });
        // Key/value projections with fewer heads than ranks are replicated (found when their
        // split does not hold); parameters the rules would slice follow their consumers.
        let mut replicated: Vec<Explained> = Vec::new();
        let mut followers: Vec<Explained> = Vec::new();
        // Each round replicates a weight or adds followers: a bound on the rounds, not a limit.
        for _ in 0..4 * (planned.len() + 2) {
            let explained: Vec<Explained> = planned
                .iter()
                .filter(|e| !replicated.iter().any(|r| r.weight == e.weight))
                .chain(&replicated)
                .chain(&followers)
                .cloned()
                .collect();
            let mut sharded = graph.clone();
            Shard {
                mesh: mesh.clone(),
                seeds: seeds_for(&explained),
                gather_params_on: gather_params_on.clone(),
                scatter_early,
                micro_batches: self.zero.micro_batches,
                bucket_elements: self.zero.reduce_bucket_elements,
                reduce_dtype: self.zero.comm_dtype,
                sequence_parallel,
                experts: experts.clone(),
            }
            .run(&mut sharded)?;
            let sliced = sliced_params(&sharded, tp_axis);
            // A weight replicated with its block stays whole, however the rules would slice it.
            let sliced: Vec<(String, Placement)> =
                sliced.into_iter().filter(|(w, _)| !replicated.iter().any(|r| &r.weight == w)).collect();
            if !sliced.is_empty() {
                let (consumers, forward) = (graph.consumers(), forward_values(graph));
                followers.extend(sliced.into_iter().map(|(weight, placement)| Explained {
                    reason: follower_reason(graph, &consumers, &forward, &weight),
                    weight,
                    placement,
                }));
                continue;
            }
            let Some(gather) = forward_gather(&sharded, self.tp, sequence_parallel) else {
                if self.dp > 1 && self.zero.stage == 3 {
                    sharded = crate::zero::schedule_prefetch(&sharded, self.zero.prefetch)?;
                }
                return Ok((sharded, explained));
            };
            match key_value_to_replicate(&gather, &columns, self.tp) {
                Some((weight, heads)) => {
                    replicated.push(Explained {
                        weight,
                        placement: Placement::Replicate,
                        reason: format!(
                            "key/value projection with {heads} head{} for tp={} ranks: replicated; every rank \
                             computes it whole and its gradient is summed over tp (as DeepSpeed AutoTP and \
                             BigCode's Megatron)",
                            if heads == 1 { "" } else { "s" },
                            self.tp
                        ),
                    });
                    followers.clear();
                }
                // The block's weights, planned and followers, stay whole on every rank.
                None if self.replicate_unsplittable => {
                    let block: Vec<&String> =
                        gather.block.iter().filter(|w| !replicated.iter().any(|r| &r.weight == *w)).collect();
                    if block.is_empty() {
                        return Err(invalid(refusal(gather, &explained)));
                    }
                    replicated.extend(block.into_iter().map(|weight| Explained {
                        weight: weight.clone(),
                        placement: Placement::Replicate,
                        reason: format!(
                            "replicated with its block (--tp-replicate-unsplittable): the block cannot be split: {}",
                            gather.need
                        ),
                    }));
                    followers.clear();
                }
                None => {
                    let hint = "; --tp-replicate-unsplittable keeps such a block whole on every rank instead";
                    return Err(invalid(format!("{}{hint}", refusal(gather, &explained))));
                }
            }
        }
        Err(invalid("the weight placements did not settle".into()))
    }
}

/// Why the LM head and the embeddings of a vocabulary split are placed as they are.
fn vocab_explained(graph: &Graph, split: &crate::vocab::VocabSplit) -> Vec<Explained> {
    let name = |v: ValueId| graph.name_of(v).unwrap_or("").to_string();
    let tied = if split.embeddings.contains(&split.head.0) { " (tied: also the token embedding)" } else { "" };
    let mut entries = vec![Explained {
        weight: name(split.head.0),
        placement: Placement::Shard(split.head.1),
        reason: format!("vocabulary-parallel LM head: its matmul makes the cross-entropy's scores{tied}"),
    }];
    for &table in split.embeddings.iter().filter(|&&t| t != split.head.0) {
        entries.push(Explained {
            weight: name(table),
            placement: Placement::Shard(0),
            reason: "vocabulary-parallel embedding: looked up by token ids".into(),
        });
    }
    entries
}

fn param_by_name(graph: &Graph, name: &str) -> ValueId {
    *graph.params().iter().find(|&&p| graph.name_of(p) == Some(name)).expect("planned from the graph's parameters")
}

/// Why a parameter that the rules would slice is split: what its first reader past its views
/// (in the forward pass: `forward`, by [`forward_values`]) does with it.
fn follower_reason(graph: &Graph, consumers: &[Vec<NodeId>], forward: &[bool], name: &str) -> String {
    let mut v = param_by_name(graph, name);
    let reader = loop {
        let in_forward = |c: &&NodeId| graph.node(**c).outputs.first().is_some_and(|o| forward[o.index()]);
        let [c] = consumers[v.index()].iter().filter(in_forward).copied().collect::<Vec<_>>()[..] else { break None };
        let node = graph.node(c);
        match node.op {
            Op::Reshape { .. } | Op::Expand { .. } | Op::Transpose { .. } | Op::Cast { .. } => v = node.outputs[0],
            _ => break Some(&node.op),
        }
    };
    let what = match reader {
        Some(Op::Concat { .. }) => "per-head logits joined to the split heads' attention scores (attention sinks)",
        Some(Op::Split { .. }) => "per-channel taps of split channels (a depthwise convolution)",
        Some(Op::Binary(BinaryOp::Add)) => "a bias of split features",
        Some(Op::Gather { .. }) => "experts' biases of split features, looked up by expert",
        Some(Op::LayerNorm { .. } | Op::RmsNorm { .. }) => "a norm's scale over split features",
        Some(Op::Binary(BinaryOp::Mul)) if scales_normalised(graph, consumers, v) => {
            "the scale of a norm over split features, expanded so that its sums are completed over tp"
        }
        _ => "read with split values",
    };
    format!("follows its consumer: {what}, split with them rather than sliced every step")
}

/// Whether `v` multiplies a normalised value: `x * rsqrt(...)`, what `expand-norms` writes
/// for a norm over split features (BitNet's sub-norms, OLMo 2's query and key norms).
fn scales_normalised(graph: &Graph, consumers: &[Vec<NodeId>], v: ValueId) -> bool {
    let made_by_rsqrt = |x: ValueId| {
        matches!(graph.value(x).def, autotp_ir::Def::Node(n, _)
            if matches!(graph.node(n).op, Op::Unary(autotp_ir::UnaryOp::Rsqrt)))
    };
    consumers[v.index()].iter().map(|&c| graph.node(c)).any(|mul| {
        mul.inputs.iter().filter(|&&x| x != v).any(|&x| match graph.value(x).def {
            autotp_ir::Def::Node(n, _) => {
                let normalised = graph.node(n);
                matches!(normalised.op, Op::Binary(BinaryOp::Mul))
                    && normalised.inputs.iter().any(|&i| made_by_rsqrt(i))
            }
            _ => false,
        })
    })
}

/// Parameters that a `shard_slice` on the tp axis cuts (directly or through a view), with the
/// placement they should have instead.
fn sliced_params(graph: &Graph, tp_axis: usize) -> Vec<(String, Placement)> {
    let mut found = BTreeMap::new();
    for (_, node) in graph.nodes() {
        let Op::Collective { kind: Collective::ShardSlice { dim }, axis, .. } = &node.op else { continue };
        if graph.mesh.axes[tp_axis].name != *axis {
            continue;
        }
        if let Some((param, dim)) = trace_param(graph, node.inputs[0], *dim) {
            found.insert(graph.name_of(param).unwrap_or("").to_string(), Placement::Shard(dim));
        }
    }
    found.into_iter().collect()
}

/// Whether `v` is rows of a parameter (or a view of one) looked up by index, through
/// transposes and reshapes: a mixture of experts' weights, gathered by expert.
fn looks_up_weights(graph: &Graph, mut v: ValueId) -> bool {
    for _ in 0..4 {
        let autotp_ir::Def::Node(n, 0) = graph.value(v).def else { return false };
        let node = graph.node(n);
        match node.op {
            Op::Gather { .. } => {
                let table = node.inputs[0];
                return (0..graph.ty(table).rank()).any(|d| trace_param(graph, table, d).is_some());
            }
            Op::Transpose { .. } | Op::Reshape { .. } | Op::Slice { .. } => v = node.inputs[0],
            _ => return false,
        }
    }
    false
}

/// The parameter `v` is a view of (through transposes, unit-dim reshapes, slices and splits
/// that keep `dim` whole, broadcasts that keep it, lookups of rows by index, gathers over other
/// mesh axes and their slices of other dims), and the parameter dim that `dim` of `v` is.
pub(crate) fn trace_param(graph: &Graph, mut v: ValueId, mut dim: usize) -> Option<(ValueId, usize)> {
    for _ in 0..4 {
        if graph.params().contains(&v) {
            return Some((v, dim));
        }
        let node = match graph.value(v).def {
            autotp_ir::Def::Node(n, 0) => graph.node(n),
            autotp_ir::Def::Node(n, _) if matches!(graph.node(n).op, Op::Split { .. }) => graph.node(n),
            _ => return None,
        };
        let input = *node.inputs.first()?;
        let (from, to) = (&graph.ty(input).shape, &graph.ty(v).shape);
        dim = match &node.op {
            // A part of a split keeps the dims it does not cut (a depthwise convolution's taps).
            Op::Split { axis, .. } if *axis != dim => dim,
            Op::Transpose { perm } => perm[dim],
            Op::Slice { starts, steps, .. } if starts[dim] == 0 && steps[dim] == 1 && from[dim] == to[dim] => dim,
            Op::Reshape { .. } => unit_reshape_dim(from, to, dim)?,
            // A broadcast keeps the dims it does not widen (gpt-oss's per-head sink logits,
            // broadcast over the batch and the queries).
            Op::Expand { .. } => {
                let d = dim.checked_sub(to.len() - from.len())?;
                (from[d] == to[dim]).then_some(d)?
            }
            // A copy gathered over another axis (a ZeRO-3 parameter) is still the parameter; so
            // is a block sliced over another axis along another dim (a broadcast parameter's
            // block of the batch, under groups of ep).
            Op::Collective { kind: Collective::AllGather { .. }, .. } => dim,
            Op::Collective { kind: Collective::ShardSlice { dim: sliced }, .. } if *sliced != dim => dim,
            // Rows looked up by index (a mixture of experts' weights, by expert): the other
            // dims are the parameter's.
            Op::Gather { axis } => {
                let index_rank = graph.ty(node.inputs[1]).rank();
                match dim {
                    d if d < *axis => d,
                    d if d >= axis + index_rank => d + 1 - index_rank,
                    _ => return None,
                }
            }
            _ => return None,
        };
        v = input;
    }
    None
}

/// For a reshape that only adds or removes unit dims: the input dim of output dim `dim`.
fn unit_reshape_dim(input: &[usize], output: &[usize], dim: usize) -> Option<usize> {
    let non_unit = |s: &[usize]| s.iter().enumerate().filter(|(_, &d)| d != 1).map(|(i, _)| i).collect::<Vec<_>>();
    let (ins, outs) = (non_unit(input), non_unit(output));
    if ins.len() != outs.len() || ins.iter().zip(&outs).any(|(&a, &b)| input[a] != output[b]) {
        return None;
    }
    Some(ins[outs.iter().position(|&d| d == dim)?])
}

/// An all-gather the forward pass of a tensor-parallel block needs: a split that does not
/// hold.
struct ForwardGather {
    /// What is gathered, for which consumer, and why.
    message: String,
    /// The message without its "tp=N cannot split the blocks: ": the consumer's need and why.
    need: String,
    /// The split weights the gathered value is computed with, nearest first, with their
    /// sizes along their split dims.
    weights: Vec<(String, usize)>,
    /// The heads that a reshape consuming the gathered value makes of it.
    reshape_heads: Option<usize>,
    /// The gathered dim's size.
    gathered: usize,
    /// The split parameters of the block that computes the gathered value: those it is
    /// computed from within the values split over tp (back to the replicated values that
    /// enter the block).
    block: Vec<String>,
}

/// The first all-gather over tp that the forward pass needs, if any: the value it gathers,
/// its consumer and why (heads not divisible by tp, a reshape merging the split dim with
/// leading ones, or parts that do not line up with the ranks' blocks).
fn forward_gather(
    graph: &Graph,
    tp: usize,
    sequence_parallel: Option<crate::shard::SequenceParallel>,
) -> Option<ForwardGather> {
    let forward = forward_values(graph);
    for (_, node) in graph.nodes() {
        let Op::Collective { kind: Collective::AllGather { dim }, axis, .. } = &node.op else { continue };
        if axis != "tp" || !forward[node.outputs[0].index()] {
            continue;
        }
        // Sequence parallelism gathers each rank's tokens by design.
        if sequence_parallel.is_some_and(|sp| sp.gathers_tokens(graph.ty(node.inputs[0]), *dim)) {
            continue;
        }
        // Each rank's maximum of its block of the vocabulary (the split cross-entropy's row
        // maximum) is a statistic, not a split tensor.
        let block_maxima = matches!(graph.value(node.inputs[0]).def,
            autotp_ir::Def::Node(p, _) if matches!(graph.node(p).op, Op::Reduce { op: autotp_ir::ReduceOp::Max, .. }));
        if block_maxima {
            continue;
        }
        let input = node.inputs[0];
        let consumer_node = graph.nodes().find(|(_, n)| n.inputs.contains(&node.outputs[0]));
        let (consumer, result) = consumer_node
            .map(|(cid, n)| {
                (format!("{} (node {})", n.op.name(), cid.index()), n.outputs.first().map(|&o| graph.ty(o).to_string()))
            })
            .unwrap_or_else(|| ("an output".into(), None));
        let weights = split_weights_upstream(graph, input, Upstream::Everything);
        let computed_with =
            weights.first().map(|(w, _)| format!(" (computed with the split weight '{w}')")).unwrap_or_default();
        let into = result.map(|r| format!(" into {r}")).unwrap_or_default();
        let shape = &graph.ty(input).shape;
        let reshaped_to = consumer_node
            .filter(|(_, n)| matches!(n.op, Op::Reshape { .. }))
            .map(|(_, n)| graph.ty(n.outputs[0]).shape.clone());
        let heads_rule = "tp must divide the heads (and key/value heads) it splits";
        let normalises = consumer_node.is_some_and(|(_, n)| match n.op {
            Op::LayerNorm { axis, .. } | Op::RmsNorm { axis, .. } => *dim >= axis,
            _ => false,
        });
        let mut reshape_heads = None;
        let why = match (reshaped_to, shape[*dim].is_multiple_of(tp)) {
            _ if normalises => "the norm is over the split features (a norm over all heads, as OLMo 2's \
                                query and key norms): a norm is not split over tp yet"
                .to_string(),
            (_, false) => format!("its {} entries do not divide by tp={tp}: {heads_rule}", shape[*dim]),
            (Some(to), true) => match leading_dim_at(shape, &to, *dim) {
                None => "the reshape merges it with the dims before it (attention over [batch x heads, ...], as \
                         BLOOM's): a split is not followed through such a merge yet"
                    .to_string(),
                Some(made) => {
                    reshape_heads = Some(made);
                    if made.is_multiple_of(tp) {
                        unequal_parts()
                    } else {
                        format!("the reshape makes {made} heads of it, which tp={tp} does not divide: {heads_rule}")
                    }
                }
            },
            (None, true) => unequal_parts(),
        };
        let need = format!("{consumer} needs dim {dim} of {}{computed_with} whole{into}: {why}", graph.ty(input));
        let message = format!("tp={tp} cannot split the blocks: {need}");
        let block = split_weights_upstream(graph, input, Upstream::WithinBlock).into_iter().map(|(w, _)| w).collect();
        return Some(ForwardGather { message, need, weights, reshape_heads, gathered: shape[*dim], block });
    }
    None
}

/// Why `gather` refuses the split, with how the split weights it names were placed (what
/// `--explain-tp` would have said of them).
fn refusal(gather: ForwardGather, explained: &[Explained]) -> String {
    let placed: Vec<String> = (gather.weights.iter())
        .filter_map(|(weight, _)| explained.iter().find(|e| &e.weight == weight))
        .map(|e| format!("'{}' {}, {}", e.weight, e.placement, e.reason))
        .collect();
    match placed.is_empty() {
        true => gather.message,
        false => format!("{} (the split weights: {})", gather.message, placed.join("; ")),
    }
}

/// The weight to replicate so that `gather` is not needed, and its heads: the nearest
/// column-parallel projection upstream, when its heads are fewer than tp and a wider
/// projection meets it in attention (the key/value projection of multi-query or grouped-query
/// attention, beside the query's). Its heads: those the reshape makes, or (a head split inside
/// itself) its features over the gathered dim.
fn key_value_to_replicate(
    gather: &ForwardGather,
    columns: &BTreeMap<String, Column>,
    tp: usize,
) -> Option<(String, usize)> {
    let (weight, column) = gather.weights.iter().find_map(|(w, _)| Some((w, columns.get(w)?)))?;
    let heads = gather.reshape_heads.or(column.heads).unwrap_or(column.features / gather.gathered.max(1));
    let beside_query = columns.values().any(|other| {
        other.features > column.features && !other.activation_products.is_disjoint(&column.activation_products)
    });
    (heads < tp && beside_query).then(|| (weight.clone(), heads))
}

/// The heads that the first reshape of a projection's result `v` (after a bias) makes of its
/// features (its last dim): 1 where it keeps them whole in a new last dim and inserts unit dims.
fn heads_made(
    graph: &Graph,
    users: &BTreeMap<ValueId, Vec<usize>>,
    nodes: &[&autotp_ir::Node],
    mut v: ValueId,
) -> Option<usize> {
    for _ in 0..2 {
        let [c] = users.get(&v).map(Vec::as_slice)? else { return None };
        match nodes[*c].op {
            Op::Binary(BinaryOp::Add) => v = nodes[*c].outputs[0],
            Op::Reshape { .. } => {
                let (from, to) = (&graph.ty(v).shape, &graph.ty(nodes[*c].outputs[0]).shape);
                let features = *from.last()?;
                if to.last() == Some(&features) && to.len() > from.len() {
                    return Some(1);
                }
                return leading_dim_at(from, to, from.len() - 1).filter(|&h| h < features);
            }
            _ => return None,
        }
    }
    None
}

/// The size of the output dim of a reshape from `from` to `to` that starts where dim `dim`
/// starts (the heads, when the reshape splits features into heads); `None` when the reshape
/// merges `dim` with earlier dims of more than one element.
fn leading_dim_at(from: &[usize], to: &[usize], dim: usize) -> Option<usize> {
    let before: usize = from[..dim].iter().product();
    (0..to.len()).find(|&j| to[..j].iter().product::<usize>() == before && to[j] > 1).map(|j| to[j])
}

fn unequal_parts() -> String {
    "its parts do not line up with the ranks' equal blocks".into()
}

/// How far back [`split_weights_upstream`] looks.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Upstream {
    /// Every value `v` is computed from.
    Everything,
    /// Only through values split over tp: the block that computes `v`, back to the replicated
    /// values that enter it.
    WithinBlock,
}

/// The tp-split parameters `v` is computed from, nearest first, and their sizes along their
/// split dims.
fn split_weights_upstream(graph: &Graph, v: ValueId, upstream: Upstream) -> Vec<(String, usize)> {
    let producer: BTreeMap<ValueId, &autotp_ir::Node> =
        graph.nodes().flat_map(|(_, n)| n.outputs.iter().map(move |&o| (o, n))).collect();
    let mut queue = std::collections::VecDeque::from([v]);
    let mut seen = BTreeSet::from([v]);
    let mut found = Vec::new();
    while let Some(v) = queue.pop_front() {
        let value = graph.value(v);
        // tp is the mesh's last axis.
        let split = value.placements.last().filter(|p| **p != Placement::Replicate);
        if upstream == Upstream::WithinBlock && split.is_none() {
            continue;
        }
        if let (true, Some(&Placement::Shard(d))) = (graph.params().contains(&v), split) {
            found.push((graph.name_of(v).unwrap_or("").to_string(), value.ty.shape[d]));
        }
        if let Some(n) = producer.get(&v) {
            queue.extend(n.inputs.iter().copied().filter(|i| seen.insert(*i)));
        }
    }
    found
}

impl Pass for AutoTp {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let (sharded, _) = self.shard(graph)?;
        *graph = sharded;
        Ok(())
    }
}
