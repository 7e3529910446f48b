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

use autotp_ir::{DType, Def, Graph, Node, ValueId};

use super::step_graph::{chunk_costs, chunk_parts, Part, StepGraph};
use super::{activations, invalid, partition, Stages};
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
    Backward(usize),
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
            PipelineSchedule::GPipe => (0..m).map(Chunk::Forward).chain((0..m).map(Chunk::Backward)).collect(),
            PipelineSchedule::OneFOneB => {
                let warmup = (stages - 1 - stage).min(m);
                let mut order: Vec<Chunk> = (0..warmup).map(Chunk::Forward).collect();
                for i in 0..m - warmup {
                    order.push(Chunk::Forward(warmup + i));
                    order.push(Chunk::Backward(i));
                }
                order.extend((m - warmup..m).map(Chunk::Backward));
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
    /// The evaluation step: every micro-batch's forward chunk in order, the loss and no
    /// gradient. The stages are cut as the training step's are (the cost model counts the
    /// backward), so each holds the same parameters.
    pub forward_only: bool,
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
        let mut step = StepGraph::new(self, s, d, parts)?;
        if self.forward_only {
            for i in 0..self.micro_batches {
                step.forward(i)?;
            }
            return Ok(step.finish_forward());
        }
        for chunk in self.schedule.order(s, self.stages, self.micro_batches) {
            match chunk {
                Chunk::Forward(i) => step.forward(i)?,
                Chunk::Backward(i) => step.backward(i)?,
            }
        }
        step.finish(holders, shared)
    }
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
