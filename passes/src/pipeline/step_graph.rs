//! One pipeline stage's step graph (step 3 and 4 of [`schedule`](super::schedule)'s recipe):
//! [`StepGraph`] copies the differentiated stage graph's nodes once per micro-batch chunk, in
//! the order the schedule runs them, sending and receiving activations and their gradients,
//! summing each micro-batch's parameter gradients as they are made, and at the end exchanging
//! the gradient sums of parameters several stages hold.

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

/// A stage's step graph as it is built, chunk by chunk. `d` is the differentiated stage
/// graph; values of `d` map to values of the step graph `g` through one map per micro-batch.
pub(super) struct StepGraph<'a> {
    pipeline: &'a Pipeline,
    /// The stage.
    s: usize,
    last: bool,
    d: &'a Graph,
    nodes: Vec<&'a Node>,
    /// The part each node of `d` runs in.
    parts: &'a [Part],
    g: Graph,
    /// The stage's output in `d` (its loss on the last stage).
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
    /// Batch inputs of `d` and the whole step's input in `g` each micro-batch slices.
    batch: Vec<(ValueId, ValueId)>,
    loss_scale: Option<ValueId>,
    /// A mean loss with an ignored label: its labels in `d` and the ignored index, and the
    /// step's count of labels that count.
    counted: Option<(ValueId, i64)>,
    counted_total: Option<ValueId>,
    /// Each micro-batch's weight in the mean loss (the last stage) and its map.
    weights: Vec<Option<ValueId>>,
    maps: Vec<Vec<Option<ValueId>>>,
    loss_sum: Option<ValueId>,
    /// The running sum of each of `grads`.
    sums: Vec<Option<ValueId>>,
}

impl<'a> StepGraph<'a> {
    /// The step graph's inputs and parameters, before any chunk.
    pub(super) fn new(pipeline: &'a Pipeline, s: usize, d: &'a Graph, parts: &'a [Part]) -> Result<Self, PassError> {
        let m = pipeline.micro_batches;
        let last = s + 1 == pipeline.stages;
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

        let mut g = Graph::new(d.name.clone());
        let mut outer: Vec<Option<ValueId>> = vec![None; d.num_values()];
        let mut batch = Vec::new();
        for &i in d.inputs() {
            if Some(i) == pipe_in || i == cotangent {
                continue;
            }
            let name = d.name_of(i).unwrap_or("").to_string();
            let ty = d.ty(i).clone();
            if pipeline.batch_inputs.contains(&name) {
                if ty.rank() == 0 {
                    return Err(invalid(format!("batch input '{name}' {ty} has no batch dim")));
                }
                let mut shape = ty.shape.clone();
                shape.insert(1, m);
                batch.push((i, g.add_input(name, TensorType::new(ty.dtype, shape))));
            } else {
                outer[i.index()] = Some(g.add_input(name, ty));
            }
        }
        for &p in d.params() {
            outer[p.index()] = Some(g.add_param(d.name_of(p).unwrap_or(""), d.ty(p).clone()));
        }
        // Every stage unscales its gradients by it (`optimize`); the last starts its backward
        // from it.
        let loss_scale = pipeline.loss_scaling.then(|| {
            (g.inputs().iter().copied().find(|&v| g.name_of(v) == Some(crate::precision::LOSS_SCALE)))
                .unwrap_or_else(|| g.add_input(crate::precision::LOSS_SCALE, TensorType::scalar(DType::F32)))
        });
        // Micro-batch weights in the mean loss: counted labels over the step's, or 1 / M.
        let counted = if last { counted_loss(d) } else { None };
        let counted_total = match counted {
            Some((labels, ignored)) => {
                let whole = batch.iter().find(|(old, _)| *old == labels).map(|(_, new)| *new);
                let whole = whole.ok_or_else(|| invalid("the loss's labels are not a batch input".into()))?;
                Some(count_labels(PASS, &mut g, whole, ignored, d.ty(output).dtype)?)
            }
            None => None,
        };
        Ok(StepGraph {
            pipeline,
            s,
            last,
            d,
            nodes: d.nodes().map(|(_, n)| n).collect(),
            parts,
            g,
            output,
            cotangent,
            pipe_in,
            pipe_in_grad: find_output(&format!("{GRAD_PREFIX}{PIPE_IN}")),
            sums: vec![None; grads.len()],
            grads,
            grads_of,
            outer,
            batch,
            loss_scale,
            counted,
            counted_total,
            weights: vec![None; m],
            maps: Vec::new(),
            loss_sum: None,
        })
    }

    fn add(&mut self, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
        crate::add_op(PASS, &mut self.g, op, inputs)
    }

    /// `F(i)`: receive the activation, run the forward nodes on micro-batch `i`, and send the
    /// result (the last stage: add its weighted loss into the step's).
    pub(super) fn forward(&mut self, i: usize) -> Result<(), PassError> {
        let mut map = self.outer.clone();
        for &(old, new) in &self.batch {
            map[old.index()] = Some(micro_batch(PASS, &mut self.g, new, i)?);
        }
        if let Some(pipe_in) = self.pipe_in {
            let ty = self.d.ty(pipe_in).clone();
            let recv = Op::Recv { from: self.s - 1, tag: activation_tag(i), message: Activation, ty };
            map[pipe_in.index()] = Some(self.add(recv, vec![])?);
        }
        copy_nodes(&mut self.g, self.d, &self.nodes, self.parts, &[Part::Forward], &mut map);
        let out = map[self.output.index()].expect("computed");
        if self.last {
            let weight = self.loss_weight(&map)?;
            self.weights[i] = Some(weight);
            let weighted = self.add(Op::Binary(BinaryOp::Mul), vec![out, weight])?;
            self.loss_sum = Some(match self.loss_sum {
                Some(sum) => self.add(Op::Binary(BinaryOp::Add), vec![sum, weighted])?,
                None => weighted,
            });
        } else {
            send(&mut self.g, out, self.s + 1, activation_tag(i), Activation)?;
        }
        self.maps.push(map);
        debug_assert_eq!(self.maps.len(), i + 1);
        Ok(())
    }

    /// A micro-batch's weight in the step's mean loss: its share of the labels that count, or
    /// `1 / M`.
    fn loss_weight(&mut self, map: &[Option<ValueId>]) -> Result<ValueId, PassError> {
        let loss_dtype = self.d.ty(self.output).dtype;
        match (self.counted, self.counted_total) {
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

    /// `B(i)`: receive the output's gradient (the last stage: start from the micro-batch's
    /// weight), run the backward nodes, send the input's gradient, and add each parameter
    /// gradient into its sum as soon as it is made, so that one micro-batch's gradients are not
    /// all alive beside the sums.
    pub(super) fn backward(&mut self, i: usize) -> Result<(), PassError> {
        let mut map = std::mem::take(&mut self.maps[i]);
        map[self.cotangent.index()] = Some(if self.last {
            let weight = self.weights[i].expect("the forward chunk comes first");
            match self.loss_scale {
                Some(scale) => self.add(Op::Binary(BinaryOp::Mul), vec![weight, scale])?,
                None => weight,
            }
        } else {
            let ty = self.d.ty(self.cotangent).clone();
            self.add(Op::Recv { from: self.s + 1, tag: gradient_tag(i), message: Gradient, ty }, vec![])?
        });
        let (before_send, after_send): (&[Part], &[Part]) = match self.pipeline.backward {
            PipelineBackward::Split => (&[Part::InputGradient], &[Part::WeightGradients]),
            // In the differentiated graph's order, which frees each layer's output gradient
            // once both of its gradients are made.
            PipelineBackward::Whole => (&[Part::InputGradient, Part::WeightGradients], &[]),
        };
        let mut sums = Accumulator {
            grads_of: &self.grads_of,
            grad_dtype: self.pipeline.grad_dtype,
            added: vec![false; self.grads.len()],
            sums: &mut self.sums,
        };
        let mut accumulate = |g: &mut Graph, map: &[Option<ValueId>], old: ValueId| sums.add(g, map, old);
        copy_nodes_then(&mut self.g, self.d, &self.nodes, self.parts, before_send, &mut map, &mut accumulate)?;
        if let Some(pipe_in_grad) = self.pipe_in_grad {
            let grad = map[pipe_in_grad.index()].expect("computed");
            send(&mut self.g, grad, self.s - 1, gradient_tag(i), Gradient)?;
        }
        copy_nodes_then(&mut self.g, self.d, &self.nodes, self.parts, after_send, &mut map, &mut accumulate)?;
        // Gradients no backward node makes (inputs, constants).
        for (_, value) in &self.grads {
            accumulate(&mut self.g, &map, *value)?;
        }
        // `map` (this micro-batch's values) drops here: the compiler no longer needs them either.
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
    /// (for a parameter several stages hold, over their sums too, added in stage order).
    pub(super) fn finish(
        mut self,
        holders: &BTreeMap<String, Vec<usize>>,
        shared: &[String],
    ) -> Result<Graph, PassError> {
        let m = self.pipeline.micro_batches;
        let sums: Vec<ValueId> = self.sums.iter().map(|v| v.expect("at least one micro-batch")).collect();
        // Shared parameters: send this stage's sum to the other holders, then add every holder's
        // in stage order.
        let tag_of = |name: &str| shared_tag(m, shared.iter().position(|p| p == name).expect("a shared parameter"));
        for ((name, _), &sum) in self.grads.iter().zip(&sums) {
            let param = &name[GRAD_PREFIX.len()..];
            for &other in holders[param].iter().filter(|&&h| h != self.s) {
                send(&mut self.g, sum, other, tag_of(param), SharedGradient)?;
            }
        }
        let mut totals = Vec::with_capacity(sums.len());
        for ((name, _), &sum) in self.grads.iter().zip(&sums) {
            let param = &name[GRAD_PREFIX.len()..];
            if holders[param].len() < 2 {
                totals.push(sum);
                continue;
            }
            let mut total: Option<ValueId> = None;
            for &h in &holders[param] {
                let part = if h == self.s {
                    sum
                } else {
                    let ty = self.g.ty(sum).clone();
                    let recv = Op::Recv { from: h, tag: tag_of(param), message: SharedGradient, ty };
                    crate::add_op(PASS, &mut self.g, recv, vec![])?
                };
                total = Some(match total {
                    Some(t) => crate::add_op(PASS, &mut self.g, Op::Binary(BinaryOp::Add), vec![t, part])?,
                    None => part,
                });
            }
            totals.push(total.expect("two holders"));
        }
        if let Some(loss) = self.loss_sum {
            self.g.add_output(LOSS, loss);
        }
        for ((name, _), total) in self.grads.iter().zip(totals) {
            self.g.add_output(name.clone(), total);
        }
        Ok(self.g)
    }
}

/// Adds one micro-batch's parameter gradients into their sums, each once.
struct Accumulator<'a> {
    grads_of: &'a BTreeMap<ValueId, Vec<usize>>,
    grad_dtype: Option<DType>,
    added: Vec<bool>,
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

/// Tags of the messages between stages: micro-batch `i`'s activation and its gradient, then
/// one per shared parameter's gradient.
fn activation_tag(i: usize) -> u64 {
    2 * i as u64
}

fn gradient_tag(i: usize) -> u64 {
    2 * i as u64 + 1
}

fn shared_tag(micro_batches: usize, index: usize) -> u64 {
    (2 * micro_batches + index) as u64
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
