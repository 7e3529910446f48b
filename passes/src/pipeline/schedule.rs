//! The pipeline's stage graphs (`--pp P --schedule 1f1b|gpipe`): one step graph per stage,
//! running the step's `M` micro-batches (`--grad-accum M`) in the schedule's order and passing
//! activations and their gradients to the neighbouring stages with `send`/`recv`.
//!
//! Built from the imported graph with its `loss` (before autodiff):
//! 1. [`partition`](super::partition) cuts the forward pass; stage `s` gets a forward graph of its
//!    nodes, reading the activation crossing the cut before it as the input `pipe.in` and
//!    giving the one crossing the cut after it as the output `pipe.out` (the last stage gives
//!    the loss). Values computed from constants and parameters alone (position ids, masks) are
//!    recomputed where they are used, and a parameter used on two stages is held by both.
//! 2. Each stage graph is differentiated on its own: the gradient of its output is an input
//!    (what the next stage sends back; on the last stage, the micro-batch's weight in the mean
//!    loss), and `pipe.in` is differentiated too (what it sends to the stage before).
//! 3. The step graph of stage `s` repeats the stage's forward nodes for micro-batch `i`
//!    (`F(i)`: recv the activation, forward, send the result) and its backward nodes (`B(i)`:
//!    recv the gradient, the whole backward, send the input's gradient; or, with
//!    [`PipelineBackward::Split`], the input's gradient, its send, then the weights' gradients, so the
//!    stage before waits only for the first part) in the schedule's order, adding
//!    each micro-batch's parameter gradients into one sum as they are made. Each `F(i)`'s
//!    values that `B(i)` reads stay alive in between, so the memory planner holds one set of
//!    activations per micro-batch in flight: at most `P - s` on stage `s` under 1F1B, `M`
//!    under GPipe.
//! 4. Parameters held by several stages (tied embeddings) exchange their gradient sums at the
//!    end of the step and add them in stage order, so every holder updates them identically.
//!
//! On a mesh (after `zero`/`autotp` place each stage), activations and their gradients travel
//! laid out like the batch (each data-parallel rank sends its rows to the same rank of the
//! next stage) and shared gradients whole (reduced before they are sent).
//!
//! The loss is the mean over the step as one device computes it: micro-batch `i` weighs
//! `1 / M`, or its share of the counted labels for a mean loss with an ignored index.
//!
//! Output: one differentiated graph per stage (`grad.<param>` outputs; the last stage's `loss`
//! first), ready for `optimize`. Tests: tests/golden/pipeline_*.ir, tests/pipeline.rs.

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::Message::{self, Activation, Gradient, SharedGradient};
use autotp_ir::{BinaryOp, DType, Def, Graph, Node, Op, Tensor, TensorType, ValueId};

use super::{activations, invalid, needed_by, partition, time_cost, Stages};
use crate::accumulate::{count_labels, counted_loss, micro_batch};
use crate::autodiff::{Autodiff, GRAD_PREFIX};
use crate::loss::LOSS;
use crate::{Pass, PassError};

const PASS: &str = super::PASS;

/// The input of a stage graph holding the activation the stage before sends.
pub const PIPE_IN: &str = "pipe.in";
/// The output of a stage graph holding the activation it sends to the stage after.
pub const PIPE_OUT: &str = "pipe.out";

/// The order the stages run their micro-batches' forward and backward chunks in.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PipelineSchedule {
    /// One forward, one backward (PipeDream-flush, Megatron's and DeepSpeed's default): stage `s`
    /// runs `P - 1 - s` forwards ahead, then alternates, so it holds at most `P - s`
    /// micro-batches' activations.
    OneFOneB,
    /// Every forward, then every backward: `M` micro-batches' activations held.
    GPipe,
}

/// When a backward chunk sends its input's gradient to the stage before.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PipelineBackward {
    /// As soon as it is made, before the weights' gradients (zero-bubble pipelines' B/W split
    /// inside one chunk): the stage before starts its backward sooner, which shortens the bubble
    /// below (P-1)/(M+P-1); the output's gradient is held until the weights' gradients are made.
    Split,
    /// When the whole backward is done, as Megatron's and DeepSpeed's 1F1B and GPipe do; the
    /// backward runs in the differentiated graph's order, which frees each layer's output
    /// gradient sooner.
    Whole,
}

impl PipelineBackward {
    pub fn parse(name: &str) -> Option<PipelineBackward> {
        match name {
            "split" => Some(PipelineBackward::Split),
            "whole" => Some(PipelineBackward::Whole),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PipelineBackward::Split => "split",
            PipelineBackward::Whole => "whole",
        }
    }
}

/// One stage's part of micro-batch `i`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Chunk {
    Forward(usize),
    PipelineBackward(usize),
}

impl PipelineSchedule {
    pub fn parse(name: &str) -> Option<PipelineSchedule> {
        match name {
            "1f1b" => Some(PipelineSchedule::OneFOneB),
            "gpipe" => Some(PipelineSchedule::GPipe),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::OneFOneB => "1f1b",
            PipelineSchedule::GPipe => "gpipe",
        }
    }

    /// The chunks stage `stage` of `stages` runs, in order, for `micro_batches`.
    pub fn order(self, stage: usize, stages: usize, micro_batches: usize) -> Vec<Chunk> {
        let m = micro_batches;
        match self {
            PipelineSchedule::GPipe => (0..m).map(Chunk::Forward).chain((0..m).map(Chunk::PipelineBackward)).collect(),
            PipelineSchedule::OneFOneB => {
                let warmup = (stages - 1 - stage).min(m);
                let mut order: Vec<Chunk> = (0..warmup).map(Chunk::Forward).collect();
                for i in 0..m - warmup {
                    order.push(Chunk::Forward(warmup + i));
                    order.push(Chunk::PipelineBackward(i));
                }
                order.extend((m - warmup..m).map(Chunk::PipelineBackward));
                order
            }
        }
    }

    /// The most micro-batches whose activations stage `stage` holds at once.
    pub fn in_flight(self, stage: usize, stages: usize, micro_batches: usize) -> usize {
        match self {
            PipelineSchedule::GPipe => micro_batches,
            PipelineSchedule::OneFOneB => (stages - stage).min(micro_batches),
        }
    }
}

/// The fraction of a step a stage idles when every stage's forward and backward chunks take
/// equal times: `(P - 1) / (M + P - 1)`, for 1F1B and GPipe alike.
pub fn bubble_fraction(stages: usize, micro_batches: usize) -> f64 {
    (stages - 1) as f64 / (micro_batches + stages - 1) as f64
}

/// A stage's work per micro-batch by the partition's cost model ([`time_cost`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ChunkCosts {
    pub forward: u64,
    /// The backward nodes the gradient sent to the stage before needs (none on the first).
    pub input_gradient: u64,
    /// The rest of the backward: the weights' gradients.
    pub weight_gradients: u64,
}

impl ChunkCosts {
    pub fn total(&self) -> u64 {
        self.forward + self.backward()
    }

    fn backward(&self) -> u64 {
        self.input_gradient + self.weight_gradients
    }
}

/// Each stage's idle fraction of a step when its chunks take time in proportion to their
/// costs. The step is one micro-batch's way through the pipeline (every stage's forward, then
/// every input gradient back to the first stage and its backward) plus `M - 1` micro-batches
/// at the pace of the slowest stage (1F1B: its whole chunks; GPipe: its forwards, then its
/// backwards); stage `s` works `M` times its chunks of it. With equal stages and
/// [`PipelineBackward::Whole`], this is [`bubble_fraction`]; [`PipelineBackward::Split`] shortens the way back
/// to the input gradients' part of each backward.
pub fn stage_idle_fractions(
    schedule: PipelineSchedule,
    backward: PipelineBackward,
    costs: &[ChunkCosts],
    micro_batches: usize,
) -> Vec<f64> {
    let slowest = |cost: fn(&ChunkCosts) -> u64| costs.iter().map(cost).max().unwrap_or(0);
    let through: u64 = match backward {
        PipelineBackward::Whole => costs.iter().map(ChunkCosts::total).sum(),
        PipelineBackward::Split => {
            costs.iter().map(|c| c.forward + c.input_gradient).sum::<u64>()
                + costs.first().map_or(0, |first| first.weight_gradients)
        }
    };
    let rest = micro_batches.saturating_sub(1) as u64;
    let step = through
        + rest
            * match schedule {
                PipelineSchedule::OneFOneB => slowest(ChunkCosts::total),
                PipelineSchedule::GPipe => slowest(|c| c.forward) + slowest(ChunkCosts::backward),
            };
    let share = |c: &ChunkCosts| micro_batches as f64 * c.total() as f64 / step as f64;
    costs.iter().map(|c| if step > 0 { 1.0 - share(c) } else { 0.0 }).collect()
}

/// The pipeline pass: an imported graph with a `loss` output -> one graph per stage.
pub struct Pipeline {
    pub stages: usize,
    /// Parameter-name prefixes to cut before (`--pp-cuts`), or empty to balance by the cost
    /// model.
    pub cuts: Vec<String>,
    /// Micro-batches per step (`M`).
    pub micro_batches: usize,
    pub schedule: PipelineSchedule,
    pub backward: PipelineBackward,
    /// Graph inputs with a batch dim 0 (become `[rows, M, ...]`).
    pub batch_inputs: Vec<String>,
    /// Parameters that get no gradient (`--freeze`).
    pub frozen: BTreeSet<String>,
    /// Embedding tables' padding rows ([`Autodiff::padding_rows`]).
    pub padding_rows: BTreeMap<String, usize>,
    /// Mixed precision: the type each micro-batch's gradients are cast to before they are
    /// summed (`--grad-accum-dtype`), where it is not theirs.
    pub grad_dtype: Option<DType>,
    /// fp16 loss scaling: the last stage's backward starts from the micro-batch's weight times
    /// the input [`crate::precision::LOSS_SCALE`].
    pub loss_scaling: bool,
}

impl Pipeline {
    /// The cuts and the stage graphs; `Stages::params` lists the parameters each stage graph
    /// holds (those it recomputes a value from included).
    pub fn run(&self, graph: &Graph) -> Result<(Stages, Vec<Graph>), PassError> {
        if self.micro_batches == 0 {
            return Err(invalid("--grad-accum (the micro-batches the pipeline interleaves) must be at least 1".into()));
        }
        let mut stages = partition(graph, self.stages, &self.cuts, &self.in_flight())?;
        let activation = activations(graph);
        let mut differentiated = Vec::new();
        for s in 0..self.stages {
            let forward = forward_graph(graph, &stages, s, &activation)?;
            differentiated.push(self.differentiate(s, forward)?);
        }
        let parts: Vec<Vec<Part>> =
            differentiated.iter().enumerate().map(|(s, d)| chunk_parts(d, self.last(s))).collect();
        stages.chunk_costs = differentiated.iter().zip(&parts).map(|(d, parts)| chunk_costs(d, parts)).collect();
        stages.params = differentiated
            .iter()
            .map(|d| {
                let mut names: Vec<String> =
                    d.params().iter().filter_map(|&p| d.name_of(p)).map(str::to_string).collect();
                names.sort();
                names
            })
            .collect();
        // The stages holding each trained parameter.
        let mut holders: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (s, d) in differentiated.iter().enumerate() {
            for (name, _) in d.outputs() {
                if let Some(param) = name.strip_prefix(GRAD_PREFIX) {
                    if param != PIPE_IN {
                        holders.entry(param.to_string()).or_default().push(s);
                    }
                }
            }
        }
        let shared: Vec<String> = holders.iter().filter(|(_, h)| h.len() > 1).map(|(p, _)| p.clone()).collect();
        let mut graphs = Vec::new();
        for (s, d) in differentiated.iter().enumerate() {
            let step = self.step_graph(s, d, &parts[s], &holders, &shared)?;
            autotp_ir::verify(&step).map_err(|errors| PassError::Verify { pass: PASS, errors })?;
            graphs.push(step);
        }
        Ok((stages, graphs))
    }

    /// The most micro-batches whose activations each stage holds at once.
    pub fn in_flight(&self) -> Vec<usize> {
        (0..self.stages).map(|s| self.schedule.in_flight(s, self.stages, self.micro_batches)).collect()
    }

    fn last(&self, s: usize) -> bool {
        s + 1 == self.stages
    }

    /// Stage `s`'s forward graph with its backward: the gradient of its output is the input
    /// `grad.<output>`, and `pipe.in` gets a gradient output too.
    fn differentiate(&self, s: usize, mut g: Graph) -> Result<Graph, PassError> {
        let output = if self.last(s) { LOSS } else { PIPE_OUT };
        let value = g.outputs().iter().find(|(n, _)| n == output).map(|(_, v)| *v).expect("the stage's output");
        let cotangent = format!("{GRAD_PREFIX}{output}");
        g.add_input(cotangent.clone(), g.ty(value).clone());
        let mut autodiff = Autodiff::new(output);
        autodiff.frozen = self.frozen.clone();
        autodiff.padding_rows = self.padding_rows.clone();
        autodiff.cotangent = Some(cotangent);
        if s > 0 {
            autodiff.wrt_inputs = vec![PIPE_IN.to_string()];
        }
        autodiff.run(&mut g)?;
        Ok(g)
    }

    /// Stage `s`'s step: the chunks of every micro-batch in schedule order, each node of `d`
    /// in its part.
    fn step_graph(
        &self,
        s: usize,
        d: &Graph,
        parts: &[Part],
        holders: &BTreeMap<String, Vec<usize>>,
        shared: &[String],
    ) -> Result<Graph, PassError> {
        let m = self.micro_batches;
        let last = self.last(s);
        let output_name = if last { LOSS } else { PIPE_OUT };
        let find_output = |name: &str| d.outputs().iter().find(|(n, _)| n == name).map(|(_, v)| *v);
        let output = find_output(output_name).expect("the stage's output");
        let cotangent_name = format!("{GRAD_PREFIX}{output_name}");
        let input_named = |name: &str| d.inputs().iter().copied().find(|&v| d.name_of(v) == Some(name));
        let cotangent = input_named(&cotangent_name).expect("added by differentiate");
        let pipe_in = input_named(PIPE_IN);
        let pipe_in_grad = find_output(&format!("{GRAD_PREFIX}{PIPE_IN}"));
        let grads: Vec<(String, ValueId)> = d
            .outputs()
            .iter()
            .filter(|(n, _)| n.starts_with(GRAD_PREFIX) && n[GRAD_PREFIX.len()..] != *PIPE_IN)
            .cloned()
            .collect();
        let nodes: Vec<&Node> = d.nodes().map(|(_, n)| n).collect();

        let mut g = Graph::new(d.name.clone());
        let mut outer: Vec<Option<ValueId>> = vec![None; d.num_values()];
        let mut batch = Vec::new();
        for &i in d.inputs() {
            if Some(i) == pipe_in || i == cotangent {
                continue;
            }
            let name = d.name_of(i).unwrap_or("").to_string();
            let ty = d.ty(i).clone();
            if self.batch_inputs.contains(&name) {
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
        let add = |g: &mut Graph, op: Op, inputs: Vec<ValueId>| crate::add_op(PASS, g, op, inputs);
        // Every stage unscales its gradients by it (`optimize`); the last starts its backward
        // from it.
        let loss_scale = match self.loss_scaling {
            true => Some(
                (g.inputs().iter().copied().find(|&v| g.name_of(v) == Some(crate::precision::LOSS_SCALE)))
                    .unwrap_or_else(|| g.add_input(crate::precision::LOSS_SCALE, TensorType::scalar(DType::F32))),
            ),
            false => None,
        };
        let loss_dtype = d.ty(output).dtype;
        // Micro-batch weights in the mean loss: counted labels over the step's, or 1 / M.
        let counted = if last { counted_loss(d) } else { None };
        let total = match counted {
            Some((labels, ignored)) => {
                let whole = batch.iter().find(|(old, _)| *old == labels).map(|(_, new)| *new);
                let whole = whole.ok_or_else(|| invalid("the loss's labels are not a batch input".into()))?;
                Some(count_labels(PASS, &mut g, whole, ignored, loss_dtype)?)
            }
            None => None,
        };
        let mut weights: Vec<Option<ValueId>> = vec![None; m];
        let mut maps: Vec<Vec<Option<ValueId>>> = Vec::new();
        let mut loss_sum: Option<ValueId> = None;
        let mut sums: Vec<Option<ValueId>> = vec![None; grads.len()];
        // The gradients (indices into `grads`) each value of the differentiated graph is.
        let mut grads_of: BTreeMap<ValueId, Vec<usize>> = BTreeMap::new();
        for (k, (_, value)) in grads.iter().enumerate() {
            grads_of.entry(*value).or_default().push(k);
        }
        let order = self.schedule.order(s, self.stages, m);
        for chunk in order {
            match chunk {
                Chunk::Forward(i) => {
                    let mut map = outer.clone();
                    for &(old, new) in &batch {
                        map[old.index()] = Some(micro_batch(PASS, &mut g, new, i)?);
                    }
                    if let Some(pipe_in) = pipe_in {
                        let ty = d.ty(pipe_in).clone();
                        let received = add(
                            &mut g,
                            Op::Recv { from: s - 1, tag: activation_tag(i), message: Activation, ty },
                            vec![],
                        )?;
                        map[pipe_in.index()] = Some(received);
                    }
                    copy_nodes(&mut g, d, &nodes, parts, &[Part::Forward], &mut map);
                    let out = map[output.index()].expect("computed");
                    if last {
                        let weight = match (counted, total) {
                            (Some((labels, ignored)), Some(total)) => {
                                let labels = map[labels.index()].expect("sliced");
                                let count = count_labels(PASS, &mut g, labels, ignored, loss_dtype)?;
                                add(&mut g, Op::Binary(BinaryOp::Div), vec![count, total])?
                            }
                            _ => {
                                let value = Tensor::full(loss_dtype, vec![], 1.0 / m as f64);
                                add(&mut g, Op::Constant { value }, vec![])?
                            }
                        };
                        weights[i] = Some(weight);
                        let weighted = add(&mut g, Op::Binary(BinaryOp::Mul), vec![out, weight])?;
                        loss_sum = Some(match loss_sum {
                            Some(sum) => add(&mut g, Op::Binary(BinaryOp::Add), vec![sum, weighted])?,
                            None => weighted,
                        });
                    } else {
                        send(&mut g, out, s + 1, activation_tag(i), Activation)?;
                    }
                    maps.push(map);
                    debug_assert_eq!(maps.len(), i + 1);
                }
                Chunk::PipelineBackward(i) => {
                    let map = &mut maps[i];
                    map[cotangent.index()] = Some(if last {
                        let weight = weights[i].expect("the forward chunk comes first");
                        match loss_scale {
                            Some(scale) => add(&mut g, Op::Binary(BinaryOp::Mul), vec![weight, scale])?,
                            None => weight,
                        }
                    } else {
                        let ty = d.ty(cotangent).clone();
                        add(&mut g, Op::Recv { from: s + 1, tag: gradient_tag(i), message: Gradient, ty }, vec![])?
                    });
                    let (before_send, after_send): (&[Part], &[Part]) = match self.backward {
                        PipelineBackward::Split => (&[Part::InputGradient], &[Part::WeightGradients]),
                        // In the differentiated graph's order, which frees each layer's output
                        // gradient once both of its gradients are made.
                        PipelineBackward::Whole => (&[Part::InputGradient, Part::WeightGradients], &[]),
                    };
                    // Each gradient is added into its sum as soon as it is made, so that one
                    // micro-batch's gradients are not all alive beside the sums.
                    let mut added = vec![false; grads.len()];
                    let mut accumulate = |g: &mut Graph, map: &[Option<ValueId>], old: ValueId| {
                        for &k in grads_of.get(&old).into_iter().flatten() {
                            if added[k] {
                                continue;
                            }
                            added[k] = true;
                            let mut grad = map[old.index()].expect("computed");
                            if let Some(dtype) = self.grad_dtype.filter(|&d| d != g.ty(grad).dtype) {
                                grad = add(g, Op::Cast { to: dtype }, vec![grad])?;
                            }
                            sums[k] = Some(match sums[k] {
                                Some(acc) => add(g, Op::Binary(BinaryOp::Add), vec![acc, grad])?,
                                None => grad,
                            });
                        }
                        Ok::<(), PassError>(())
                    };
                    copy_nodes_then(&mut g, d, &nodes, parts, before_send, map, &mut accumulate)?;
                    if let Some(pipe_in_grad) = pipe_in_grad {
                        let grad = map[pipe_in_grad.index()].expect("computed");
                        send(&mut g, grad, s - 1, gradient_tag(i), Gradient)?;
                    }
                    copy_nodes_then(&mut g, d, &nodes, parts, after_send, map, &mut accumulate)?;
                    // Gradients no backward node makes (inputs, constants).
                    for (_, value) in &grads {
                        accumulate(&mut g, map, *value)?;
                    }
                    // This micro-batch's values are no longer needed by the compiler either.
                    map.clear();
                }
            }
        }
        let mut sums: Vec<ValueId> = sums.into_iter().map(|v| v.expect("at least one micro-batch")).collect();
        // Shared parameters: send this stage's sum to the other holders, then add every holder's
        // in stage order.
        let tag_of = |name: &str| shared_tag(m, shared.iter().position(|p| p == name).expect("a shared parameter"));
        for ((name, _), &sum) in grads.iter().zip(&sums) {
            let param = &name[GRAD_PREFIX.len()..];
            for &other in holders[param].iter().filter(|&&h| h != s) {
                send(&mut g, sum, other, tag_of(param), SharedGradient)?;
            }
        }
        for ((name, _), sum) in grads.iter().zip(sums.iter_mut()) {
            let param = &name[GRAD_PREFIX.len()..];
            if holders[param].len() < 2 {
                continue;
            }
            let mut total: Option<ValueId> = None;
            for &h in &holders[param] {
                let part = if h == s {
                    *sum
                } else {
                    let ty = g.ty(*sum).clone();
                    add(&mut g, Op::Recv { from: h, tag: tag_of(param), message: SharedGradient, ty }, vec![])?
                };
                total = Some(match total {
                    Some(t) => add(&mut g, Op::Binary(BinaryOp::Add), vec![t, part])?,
                    None => part,
                });
            }
            *sum = total.expect("two holders");
        }
        if let Some(loss) = loss_sum {
            g.add_output(LOSS, loss);
        }
        for ((name, _), sum) in grads.iter().zip(sums) {
            g.add_output(name.clone(), sum);
        }
        Ok(g)
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
enum Part {
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
fn chunk_parts(d: &Graph, last: bool) -> Vec<Part> {
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
fn chunk_costs(d: &Graph, parts: &[Part]) -> ChunkCosts {
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

/// Stage `s`'s forward graph: its nodes, reading the activation crossing the cut before it as
/// `pipe.in` and giving the one crossing the cut after it as `pipe.out` (the last stage: the
/// loss).
fn forward_graph(old: &Graph, stages: &Stages, s: usize, activation: &[bool]) -> Result<Graph, PassError> {
    let mut stage =
        StageBuilder { old, s, activation, g: Graph::new(old.name.clone()), map: vec![None; old.num_values()] };
    if s > 0 {
        let boundary = stages.boundaries[s - 1];
        stage.map[boundary.index()] = Some(stage.g.add_input(PIPE_IN, old.ty(boundary).clone()));
    }
    let nodes: Vec<&Node> = old.nodes().map(|(_, n)| n).collect();
    for &i in &stages.forward[stages.range(s)] {
        stage.copy(nodes[i])?;
    }
    let (name, value) = match stages.boundaries.get(s) {
        Some(&boundary) => (PIPE_OUT, boundary),
        None => (LOSS, old.outputs().iter().find(|(n, _)| n == LOSS).map(|(_, v)| *v).expect("partition found it")),
    };
    let out = stage.resolve(value)?;
    stage.g.add_output(name, out);
    // A node placed before the cut that only a later stage needs (a weight's transpose for the
    // head) is that stage's to compute.
    Ok(stage.g.without_dead_code())
}

/// Copies nodes of the whole forward graph into one stage's.
struct StageBuilder<'a> {
    old: &'a Graph,
    s: usize,
    activation: &'a [bool],
    g: Graph,
    map: Vec<Option<ValueId>>,
}

impl StageBuilder<'_> {
    fn copy(&mut self, node: &Node) -> Result<(), PassError> {
        let inputs = node.inputs.iter().map(|&v| self.resolve(v)).collect::<Result<Vec<_>, _>>()?;
        let types = node.outputs.iter().map(|&o| self.old.ty(o).clone()).collect();
        let new = self.g.add_node_typed(node.op.clone(), inputs, types);
        for (&o, &n) in node.outputs.iter().zip(&self.g.node(new).outputs) {
            self.map[o.index()] = Some(n);
        }
        Ok(())
    }

    /// `v` in the stage graph: inputs and parameters are declared where first used, values of
    /// constants and parameters alone recomputed; another stage's activation is an error (only
    /// the one crossing the cut comes in).
    fn resolve(&mut self, v: ValueId) -> Result<ValueId, PassError> {
        if let Some(new) = self.map[v.index()] {
            return Ok(new);
        }
        let (old, s) = (self.old, self.s);
        let name = || old.name_of(v).unwrap_or("").to_string();
        let new = match old.value(v).def {
            Def::Input(_) => self.g.add_input(name(), old.ty(v).clone()),
            Def::Param(_) => self.g.add_param(name(), old.ty(v).clone()),
            Def::State(_) => {
                return Err(invalid(format!(
                    "state '{}' in the forward pass: the pipeline runs before optimize",
                    name()
                )))
            }
            Def::Node(node, _) => {
                let node = old.node(node);
                if self.activation[v.index()] {
                    return Err(invalid(format!(
                        "stage {s} reads a {} result from a stage before the one before it: only one activation may \
                         cross each cut",
                        node.op.name()
                    )));
                }
                self.copy(node)?;
                return Ok(self.map[v.index()].expect("just copied"));
            }
        };
        self.map[v.index()] = Some(new);
        Ok(new)
    }
}
