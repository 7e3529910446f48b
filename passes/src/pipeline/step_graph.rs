//! One pipeline rank's step graph (step 3 and 4 of [`schedule`](super::schedule)'s recipe):
//! [`StepGraph`] copies each of the rank's differentiated model chunks' nodes once per
//! micro-batch chunk, in the order the schedule runs them, sending and receiving activations
//! and their gradients, summing each micro-batch's parameter gradients as they are made, and at
//! the end exchanging the gradient sums of parameters several ranks hold.
//!
//! Messages cross the cut after virtual stage `v` (from rank `v % P` to rank `(v + 1) % P`).
//! Their tags: micro-batch `i`'s activation `2 (c M + i)` and its gradient one more, `c = v / P`
//! being the sending rank's model chunk; then one per shared parameter's gradient sum.

use std::collections::BTreeMap;

use autotp_ir::Message::{self, Activation, Gradient, SharedGradient};
use autotp_ir::{BinaryOp, DType, Graph, Node, Op, Tensor, TensorType, ValueId};

use super::schedule::{Pipeline, PipelineBackward, PIPE_IN, PIPE_OUT};
use super::{invalid, needed_by, time_cost, ChunkCosts};
use crate::accumulate::{count_labels, counted_loss, micro_batch};
use crate::autodiff::GRAD_PREFIX;
use crate::loss::LOSS;
use crate::PassError;

const PASS: &str = super::PASS;

/// One of a rank's model chunks: virtual stage `virtual_stage`'s differentiated graph `d` and
/// the part each of its nodes runs in.
pub(super) struct ModelChunk<'a> {
    pub virtual_stage: usize,
    pub d: &'a Graph,
    pub parts: &'a [Part],
}

/// A rank's step graph as it is built, chunk by chunk.
pub(super) struct StepGraph<'a> {
    pipeline: &'a Pipeline,
    rank: usize,
    chunks: Vec<ChunkGraph<'a>>,
    g: Graph,
    loss_scale: Option<ValueId>,
    /// The step's count of labels that count, for a mean loss with an ignored label.
    counted_total: Option<ValueId>,
    loss_sum: Option<ValueId>,
}

/// One model chunk of the step graph: values of its differentiated graph `d` map to values of
/// the step graph through one map per micro-batch.
struct ChunkGraph<'a> {
    virtual_stage: usize,
    /// The last virtual stage: its output is the loss.
    last: bool,
    d: &'a Graph,
    nodes: Vec<&'a Node>,
    /// The part each node of `d` runs in.
    parts: &'a [Part],
    /// The chunk's output in `d` (the loss on the last virtual stage).
    output: ValueId,
    /// The input of `d` holding the output's gradient.
    cotangent: ValueId,
    pipe_in: Option<ValueId>,
    pipe_in_grad: Option<ValueId>,
    /// The parameters' gradient outputs of `d`, and the gradients (indices into them) each
    /// value of `d` is.
    grads: Vec<(String, ValueId)>,
    grads_of: BTreeMap<ValueId, Vec<usize>>,
    /// Inputs and parameters of `d` that every micro-batch shares.
    outer: Vec<Option<ValueId>>,
    /// Batch inputs of `d` and the whole step's input in the step graph each micro-batch
    /// slices.
    batch: Vec<(ValueId, ValueId)>,
    /// A mean loss with an ignored label: its labels in `d` and the ignored index.
    counted: Option<(ValueId, i64)>,
    /// Each micro-batch's weight in the mean loss (the last stage).
    weights: Vec<Option<ValueId>>,
    /// Each micro-batch's values from its forward chunk until its backward is done.
    pending: Vec<Option<InFlight>>,
    /// The running sum of each of `grads`.
    sums: Vec<Option<ValueId>>,
}

/// A micro-batch's values in the step graph (by value of `d`), and which of the chunk's
/// gradients its backward has added into their sums so far.
type InFlight = (Vec<Option<ValueId>>, Vec<bool>);

impl<'a> StepGraph<'a> {
    /// The step graph's inputs and parameters (each once, by name, over the rank's model
    /// chunks), before any chunk.
    pub(super) fn new(pipeline: &'a Pipeline, rank: usize, chunks: Vec<ModelChunk<'a>>) -> Result<Self, PassError> {
        let m = pipeline.micro_batches;
        let virtual_count = pipeline.stages * pipeline.virtual_stages;
        let mut g = Graph::new(chunks[0].d.name.clone());
        let mut declared: BTreeMap<String, ValueId> = BTreeMap::new();
        let mut built = Vec::new();
        for chunk in &chunks {
            let d = chunk.d;
            let last = chunk.virtual_stage + 1 == virtual_count;
            let output_name = if last { LOSS } else { PIPE_OUT };
            let find_output = |name: &str| d.outputs().iter().find(|(n, _)| n == name).map(|(_, v)| *v);
            let output = find_output(output_name).expect("the stage's output");
            let input_named = |name: &str| d.inputs().iter().copied().find(|&v| d.name_of(v) == Some(name));
            let cotangent = input_named(&format!("{GRAD_PREFIX}{output_name}")).expect("added by differentiate");
            let pipe_in = input_named(PIPE_IN);
            let grads: Vec<(String, ValueId)> = d
                .outputs()
                .iter()
                .filter(|(n, _)| n.starts_with(GRAD_PREFIX) && n[GRAD_PREFIX.len()..] != *PIPE_IN)
                .cloned()
                .collect();
            let mut grads_of: BTreeMap<ValueId, Vec<usize>> = BTreeMap::new();
            for (k, (_, value)) in grads.iter().enumerate() {
                grads_of.entry(*value).or_default().push(k);
            }
            let mut outer: Vec<Option<ValueId>> = vec![None; d.num_values()];
            let mut batch = Vec::new();
            for &i in d.inputs() {
                if Some(i) == pipe_in || i == cotangent {
                    continue;
                }
                let name = d.name_of(i).unwrap_or("").to_string();
                let ty = d.ty(i).clone();
                let is_batch = pipeline.batch_inputs.contains(&name);
                if is_batch && ty.rank() == 0 {
                    return Err(invalid(format!("batch input '{name}' {ty} has no batch dim")));
                }
                let value = *declared.entry(name.clone()).or_insert_with(|| {
                    let mut ty = ty.clone();
                    if is_batch {
                        ty.shape.insert(1, m);
                    }
                    g.add_input(name, ty)
                });
                if is_batch {
                    batch.push((i, value));
                } else {
                    outer[i.index()] = Some(value);
                }
            }
            built.push(ChunkGraph {
                virtual_stage: chunk.virtual_stage,
                last,
                d,
                nodes: d.nodes().map(|(_, n)| n).collect(),
                parts: chunk.parts,
                output,
                cotangent,
                pipe_in,
                pipe_in_grad: find_output(&format!("{GRAD_PREFIX}{PIPE_IN}")),
                sums: vec![None; grads.len()],
                grads,
                grads_of,
                outer,
                batch,
                counted: if last { counted_loss(d) } else { None },
                weights: vec![None; m],
                pending: vec![None; m],
            });
        }
        let mut params: BTreeMap<String, ValueId> = BTreeMap::new();
        for chunk in &mut built {
            for &p in chunk.d.params() {
                let name = chunk.d.name_of(p).unwrap_or("").to_string();
                let ty = chunk.d.ty(p).clone();
                let value = *params.entry(name.clone()).or_insert_with(|| g.add_param(name, ty));
                chunk.outer[p.index()] = Some(value);
            }
        }
        // Every stage unscales its gradients by it (`optimize`); the last starts its backward
        // from it.
        let loss_scale = pipeline.loss_scaling.then(|| {
            (g.inputs().iter().copied().find(|&v| g.name_of(v) == Some(crate::precision::LOSS_SCALE)))
                .unwrap_or_else(|| g.add_input(crate::precision::LOSS_SCALE, TensorType::scalar(DType::F32)))
        });
        // Micro-batch weights in the mean loss: counted labels over the step's, or 1 / M.
        let mut counted_total = None;
        if let Some(chunk) = built.iter().find(|c| c.counted.is_some()) {
            let (labels, ignored) = chunk.counted.expect("found");
            let whole = chunk.batch.iter().find(|(old, _)| *old == labels).map(|(_, new)| *new);
            let whole = whole.ok_or_else(|| invalid("the loss's labels are not a batch input".into()))?;
            counted_total = Some(count_labels(PASS, &mut g, whole, ignored, chunk.d.ty(chunk.output).dtype)?);
        }
        Ok(StepGraph { pipeline, rank, chunks: built, g, loss_scale, counted_total, loss_sum: None })
    }

    fn add(&mut self, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
        crate::add_op(PASS, &mut self.g, op, inputs)
    }

    /// The rank holding virtual stage `v`.
    fn rank_of(&self, v: usize) -> usize {
        v % self.pipeline.stages
    }

    /// The tags of micro-batch `i`'s messages across the cut after virtual stage `v`: its
    /// activation's and its gradient's.
    fn tags(&self, v: usize, i: usize) -> (u64, u64) {
        let sender_chunk = v / self.pipeline.stages;
        let activation = 2 * (sender_chunk * self.pipeline.micro_batches + i) as u64;
        (activation, activation + 1)
    }

    /// `F(i)` on model chunk `c`: receive the activation, run the forward nodes on micro-batch
    /// `i`, and send the result (the last stage: add its weighted loss into the step's).
    pub(super) fn forward(&mut self, c: usize, i: usize) -> Result<(), PassError> {
        let chunk = &self.chunks[c];
        let (v, d) = (chunk.virtual_stage, chunk.d);
        let mut map = chunk.outer.clone();
        for &(old, new) in &chunk.batch {
            map[old.index()] = Some(micro_batch(PASS, &mut self.g, new, i)?);
        }
        if let Some(pipe_in) = chunk.pipe_in {
            let ty = d.ty(pipe_in).clone();
            let recv = Op::Recv { from: self.rank_of(v - 1), tag: self.tags(v - 1, i).0, message: Activation, ty };
            map[pipe_in.index()] = Some(self.add(recv, vec![])?);
        }
        let chunk = &self.chunks[c];
        copy_nodes(&mut self.g, d, &chunk.nodes, chunk.parts, &[Part::Forward], &mut map);
        let out = map[chunk.output.index()].expect("computed");
        if chunk.last {
            let weight = self.loss_weight(c, &map)?;
            self.chunks[c].weights[i] = Some(weight);
            let weighted = self.add(Op::Binary(BinaryOp::Mul), vec![out, weight])?;
            self.loss_sum = Some(match self.loss_sum {
                Some(sum) => self.add(Op::Binary(BinaryOp::Add), vec![sum, weighted])?,
                None => weighted,
            });
        } else {
            let (to, tag) = (self.rank_of(v + 1), self.tags(v, i).0);
            send(&mut self.g, out, to, tag, Activation)?;
        }
        let chunk = &mut self.chunks[c];
        chunk.pending[i] = Some((map, vec![false; chunk.grads.len()]));
        Ok(())
    }

    /// A micro-batch's weight in the step's mean loss: its share of the labels that count, or
    /// `1 / M`.
    fn loss_weight(&mut self, c: usize, map: &[Option<ValueId>]) -> Result<ValueId, PassError> {
        let chunk = &self.chunks[c];
        let loss_dtype = chunk.d.ty(chunk.output).dtype;
        match (chunk.counted, self.counted_total) {
            (Some((labels, ignored)), Some(total)) => {
                let labels = map[labels.index()].expect("sliced");
                let count = count_labels(PASS, &mut self.g, labels, ignored, loss_dtype)?;
                self.add(Op::Binary(BinaryOp::Div), vec![count, total])
            }
            _ => {
                let value = Tensor::full(loss_dtype, vec![], 1.0 / self.pipeline.micro_batches as f64);
                self.add(Op::Constant { value }, vec![])
            }
        }
    }

    /// `B(i)` on model chunk `c`: [`StepGraph::input_gradient`] and
    /// [`StepGraph::weight_gradients`], the send between them or after both as
    /// [`PipelineBackward`] says.
    pub(super) fn backward(&mut self, c: usize, i: usize) -> Result<(), PassError> {
        match self.pipeline.backward {
            PipelineBackward::Split => {
                self.input_gradient(c, i)?;
                self.weight_gradients(c, i)
            }
            // In the differentiated graph's order, which frees each layer's output gradient
            // once both of its gradients are made.
            PipelineBackward::Whole => {
                self.backward_parts(c, i, &[Part::InputGradient, Part::WeightGradients])?;
                self.send_input_gradient(c, i)?;
                self.finish_backward(c, i)
            }
        }
    }

    /// Zero-bubble's `B(i)`: receive the output's gradient (the last stage: start from the
    /// micro-batch's weight), make the input's gradient and send it to the stage before.
    pub(super) fn input_gradient(&mut self, c: usize, i: usize) -> Result<(), PassError> {
        self.backward_parts(c, i, &[Part::InputGradient])?;
        self.send_input_gradient(c, i)
    }

    /// Zero-bubble's `W(i)`: the rest of the backward, the weights' gradients, each added into
    /// its sum as soon as it is made, so that one micro-batch's gradients are not all alive
    /// beside the sums; the micro-batch's values are dropped after it.
    pub(super) fn weight_gradients(&mut self, c: usize, i: usize) -> Result<(), PassError> {
        self.backward_parts(c, i, &[Part::WeightGradients])?;
        self.finish_backward(c, i)
    }

    /// Runs micro-batch `i`'s backward nodes in `wanted` parts on model chunk `c`, receiving
    /// the output's gradient first if it is not yet there.
    fn backward_parts(&mut self, c: usize, i: usize, wanted: &[Part]) -> Result<(), PassError> {
        let (mut map, mut added) = self.chunks[c].pending[i].take().expect("the forward chunk comes first");
        let chunk = &self.chunks[c];
        let (v, d) = (chunk.virtual_stage, chunk.d);
        if map[chunk.cotangent.index()].is_none() {
            let cotangent = chunk.cotangent;
            map[cotangent.index()] = Some(if chunk.last {
                let weight = chunk.weights[i].expect("the forward chunk comes first");
                match self.loss_scale {
                    Some(scale) => self.add(Op::Binary(BinaryOp::Mul), vec![weight, scale])?,
                    None => weight,
                }
            } else {
                let ty = d.ty(cotangent).clone();
                let recv = Op::Recv { from: self.rank_of(v + 1), tag: self.tags(v, i).1, message: Gradient, ty };
                self.add(recv, vec![])?
            });
        }
        let chunk = &mut self.chunks[c];
        let mut sums = Accumulator {
            grads_of: &chunk.grads_of,
            grad_dtype: self.pipeline.grad_dtype,
            added: &mut added,
            sums: &mut chunk.sums,
        };
        let mut accumulate = |g: &mut Graph, map: &[Option<ValueId>], old: ValueId| sums.add(g, map, old);
        copy_nodes_then(&mut self.g, d, &chunk.nodes, chunk.parts, wanted, &mut map, &mut accumulate)?;
        chunk.pending[i] = Some((map, added));
        Ok(())
    }

    /// Sends micro-batch `i`'s input gradient of model chunk `c` to the stage before (none on
    /// the first virtual stage).
    fn send_input_gradient(&mut self, c: usize, i: usize) -> Result<(), PassError> {
        let chunk = &self.chunks[c];
        let Some(pipe_in_grad) = chunk.pipe_in_grad else { return Ok(()) };
        let (map, _) = chunk.pending[i].as_ref().expect("the backward is under way");
        let grad = map[pipe_in_grad.index()].expect("computed");
        let v = chunk.virtual_stage;
        let (to, tag) = (self.rank_of(v - 1), self.tags(v - 1, i).1);
        send(&mut self.g, grad, to, tag, Gradient)
    }

    /// Adds the gradients no backward node makes (of inputs, constants) and drops micro-batch
    /// `i`'s values: the compiler no longer needs them either.
    fn finish_backward(&mut self, c: usize, i: usize) -> Result<(), PassError> {
        let chunk = &mut self.chunks[c];
        let (map, mut added) = chunk.pending[i].take().expect("the backward is under way");
        let mut sums = Accumulator {
            grads_of: &chunk.grads_of,
            grad_dtype: self.pipeline.grad_dtype,
            added: &mut added,
            sums: &mut chunk.sums,
        };
        for (_, value) in &chunk.grads {
            sums.add(&mut self.g, &map, *value)?;
        }
        Ok(())
    }

    /// The evaluation step's graph: the loss alone (the last stage), after the forward chunks.
    pub(super) fn finish_forward(mut self) -> Graph {
        if let Some(loss) = self.loss_sum {
            self.g.add_output(LOSS, loss);
        }
        self.g
    }

    /// The step graph: the loss, and each parameter's gradient summed over the micro-batches
    /// and the rank's model chunks (for a parameter several ranks hold, over their sums too,
    /// added in rank order).
    pub(super) fn finish(
        mut self,
        holders: &BTreeMap<String, Vec<usize>>,
        shared: &[String],
    ) -> Result<Graph, PassError> {
        let first_shared_tag = 2 * (self.pipeline.virtual_stages * self.pipeline.micro_batches) as u64;
        let tag_of =
            |name: &str| first_shared_tag + shared.iter().position(|p| p == name).expect("a shared parameter") as u64;
        // This rank's sum of each parameter's gradient, over its model chunks in order.
        let mut local: Vec<(String, ValueId)> = Vec::new();
        for c in 0..self.chunks.len() {
            for k in 0..self.chunks[c].grads.len() {
                let name = self.chunks[c].grads[k].0.clone();
                let sum = self.chunks[c].sums[k].expect("at least one micro-batch");
                match local.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, total)) => *total = self.add(Op::Binary(BinaryOp::Add), vec![*total, sum])?,
                    None => local.push((name, sum)),
                }
            }
        }
        // Shared parameters: send this rank's sum to the other holders, then add every
        // holder's in rank order.
        for (name, sum) in &local {
            let param = &name[GRAD_PREFIX.len()..];
            for &other in holders[param].iter().filter(|&&h| h != self.rank) {
                send(&mut self.g, *sum, other, tag_of(param), SharedGradient)?;
            }
        }
        let mut totals = Vec::with_capacity(local.len());
        for (name, sum) in &local {
            let param = &name[GRAD_PREFIX.len()..];
            if holders[param].len() < 2 {
                totals.push(*sum);
                continue;
            }
            let mut total: Option<ValueId> = None;
            for &h in &holders[param] {
                let part = if h == self.rank {
                    *sum
                } else {
                    let ty = self.g.ty(*sum).clone();
                    self.add(Op::Recv { from: h, tag: tag_of(param), message: SharedGradient, ty }, vec![])?
                };
                total = Some(match total {
                    Some(t) => self.add(Op::Binary(BinaryOp::Add), vec![t, part])?,
                    None => part,
                });
            }
            totals.push(total.expect("two holders"));
        }
        if let Some(loss) = self.loss_sum {
            self.g.add_output(LOSS, loss);
        }
        for ((name, _), total) in local.into_iter().zip(totals) {
            self.g.add_output(name, total);
        }
        Ok(self.g)
    }
}

/// Adds one micro-batch's parameter gradients into their sums, each once.
struct Accumulator<'a> {
    grads_of: &'a BTreeMap<ValueId, Vec<usize>>,
    grad_dtype: Option<DType>,
    added: &'a mut [bool],
    sums: &'a mut [Option<ValueId>],
}

impl Accumulator<'_> {
    /// Adds the gradients the value `old` of the differentiated graph is, if not yet added.
    fn add(&mut self, g: &mut Graph, map: &[Option<ValueId>], old: ValueId) -> Result<(), PassError> {
        for &k in self.grads_of.get(&old).into_iter().flatten() {
            if self.added[k] {
                continue;
            }
            self.added[k] = true;
            let mut grad = map[old.index()].expect("computed");
            if let Some(dtype) = self.grad_dtype.filter(|&d| d != g.ty(grad).dtype) {
                grad = crate::add_op(PASS, g, Op::Cast { to: dtype }, vec![grad])?;
            }
            self.sums[k] = Some(match self.sums[k] {
                Some(acc) => crate::add_op(PASS, g, Op::Binary(BinaryOp::Add), vec![acc, grad])?,
                None => grad,
            });
        }
        Ok(())
    }
}

/// Appends `send value` to stage `to`.
fn send(g: &mut Graph, value: ValueId, to: usize, tag: u64, message: Message) -> Result<(), PassError> {
    g.add_node(Op::Send { to, tag, message }, vec![value], 0).map_err(|e| invalid(format!("send: {e}")))?;
    Ok(())
}

/// Which part of a micro-batch's chunks a node of the differentiated stage graph runs in.
#[derive(Copy, Clone, PartialEq, Eq)]
pub(super) enum Part {
    /// The forward chunk: what the stage's output needs.
    Forward,
    /// The part of the backward chunk the gradient sent to the stage before needs.
    InputGradient,
    /// The rest of the backward chunk.
    WeightGradients,
}

/// The part each node of the differentiated stage graph `d` runs in. The forward chunk: the
/// nodes the stage's output needs. The backward chunk: the nodes the gradient sent to the
/// stage before needs, and the rest (which [`PipelineBackward::Split`] runs after the send).
pub(super) fn chunk_parts(d: &Graph, last: bool) -> Vec<Part> {
    let nodes: Vec<&Node> = d.nodes().map(|(_, n)| n).collect();
    let output = |name: &str| d.outputs().iter().find(|(n, _)| n == name).map(|(_, v)| *v);
    let stage_output = output(if last { LOSS } else { PIPE_OUT }).expect("the stage's output");
    let pipe_in_grad = output(&format!("{GRAD_PREFIX}{PIPE_IN}"));
    let forward = needed_by(&nodes, d.num_values(), &[stage_output], |_| true);
    let input_gradient = needed_by(&nodes, d.num_values(), pipe_in_grad.as_slice(), |i| !forward[i]);
    let part = |i: usize| match (forward[i], input_gradient[i]) {
        (true, _) => Part::Forward,
        (false, true) => Part::InputGradient,
        (false, false) => Part::WeightGradients,
    };
    (0..nodes.len()).map(part).collect()
}

/// The differentiated stage graph's work per micro-batch, by part.
pub(super) fn chunk_costs(d: &Graph, parts: &[Part]) -> ChunkCosts {
    let mut costs = ChunkCosts::default();
    for ((_, node), part) in d.nodes().zip(parts) {
        let cost = time_cost(d, node);
        match part {
            Part::Forward => costs.forward += cost,
            Part::InputGradient => costs.input_gradient += cost,
            Part::WeightGradients => costs.weight_gradients += cost,
        }
    }
    costs
}

/// Copies the nodes of `d` in `wanted` parts through `map`, in graph order.
fn copy_nodes(g: &mut Graph, d: &Graph, nodes: &[&Node], parts: &[Part], wanted: &[Part], map: &mut [Option<ValueId>]) {
    let nothing = &mut |_: &mut Graph, _: &[Option<ValueId>], _: ValueId| Ok(());
    copy_nodes_then(g, d, nodes, parts, wanted, map, nothing).expect("nothing to fail");
}

/// [`copy_nodes`], calling `made` with each copied node's outputs (old ids) once it is copied.
fn copy_nodes_then(
    g: &mut Graph,
    d: &Graph,
    nodes: &[&Node],
    parts: &[Part],
    wanted: &[Part],
    map: &mut [Option<ValueId>],
    made: &mut impl FnMut(&mut Graph, &[Option<ValueId>], ValueId) -> Result<(), PassError>,
) -> Result<(), PassError> {
    for (node, _) in nodes.iter().zip(parts).filter(|(_, p)| wanted.contains(p)) {
        let inputs = node.inputs.iter().map(|v| map[v.index()].expect("defined before use")).collect();
        let types = node.outputs.iter().map(|&o| d.ty(o).clone()).collect();
        let new = g.add_node_typed(node.op.clone(), inputs, types);
        for (&o, &n) in node.outputs.iter().zip(&g.node(new).outputs) {
            map[o.index()] = Some(n);
        }
        for &o in &node.outputs {
            made(g, map, o)?;
        }
    }
    Ok(())
}
