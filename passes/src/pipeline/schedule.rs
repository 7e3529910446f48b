//! The pipeline's stage graphs (`--pp P --schedule 1f1b|gpipe|zb-h1 --virtual-stages V`): one
//! step graph per stage (rank of the pipeline), running the step's `M` micro-batches
//! (`--grad-accum M`) in the schedule's order and passing activations and their gradients to
//! the neighbouring stages with `send`/`recv`.
//!
//! With `V` virtual stages (Megatron's interleaved pipeline) the model is cut into `P * V`
//! chunks and rank `r` holds chunks `r, r + P, ...`; everything below is per chunk (virtual
//! stage), and one rank's step graph holds its `V` chunks' copies, interleaved in the schedule's
//! order. [`PipelineSchedule::order`] gives each rank's order; [`stage_idle_fractions`] runs
//! the orders against the chunks' costs (it is also the proof that no order waits forever).
//!
//! Built from the imported graph with its `loss` (before autodiff):
//! 1. [`partition`] cuts the forward pass; stage `s` gets a forward graph of its
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

use super::step_graph::{chunk_costs, chunk_parts, ModelChunk, Part, StepGraph};
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
    /// micro-batches' activations. With virtual stages ([`Pipeline::virtual_stages`] `V`),
    /// Megatron's interleaved 1F1B: each rank runs its `V` model chunks in turn, groups of `P`
    /// micro-batches at a time, `2(P - 1 - s) + (V - 1)P` forward chunks ahead.
    OneFOneB,
    /// Every forward, then every backward: `M` micro-batches' activations held.
    GPipe,
    /// Zero-bubble ZB-H1 (Qi et al., 2024): the backward split into `B`, the input's gradient
    /// (sent at once), and `W`, the weights' gradients, which stage `s` defers by `s`
    /// micro-batches to fill the time it would wait; every stage holds at most `P`
    /// micro-batches' activations (1F1B's first stage's count) and the bubble falls from
    /// `(P - 1)(F + B + W)` to `(P - 1)(F + B - W)`.
    ZeroBubbleH1,
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

/// What a scheduled chunk runs of its micro-batch.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Work {
    Forward,
    /// The whole backward, sending the input's gradient as [`PipelineBackward`] says.
    Backward,
    /// [`PipelineSchedule::ZeroBubbleH1`]'s `B`: the input's gradient, then its send.
    InputGradient,
    /// [`PipelineSchedule::ZeroBubbleH1`]'s `W`: the weights' gradients, which frees the
    /// micro-batch's activations.
    WeightGradients,
}

/// One rank's part of micro-batch `micro_batch` on its model chunk `model_chunk` (virtual
/// stage `model_chunk * P + rank`; always 0 without virtual stages).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub work: Work,
    pub model_chunk: usize,
    pub micro_batch: usize,
}

impl Chunk {
    fn new(work: Work, model_chunk: usize, micro_batch: usize) -> Chunk {
        Chunk { work, model_chunk, micro_batch }
    }
}

impl PipelineSchedule {
    pub fn parse(name: &str) -> Option<PipelineSchedule> {
        match name {
            "1f1b" => Some(PipelineSchedule::OneFOneB),
            "gpipe" => Some(PipelineSchedule::GPipe),
            "zb-h1" => Some(PipelineSchedule::ZeroBubbleH1),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::OneFOneB => "1f1b",
            PipelineSchedule::GPipe => "gpipe",
            PipelineSchedule::ZeroBubbleH1 => "zb-h1",
        }
    }

    /// The chunks rank `stage` of `stages` runs, in order, for `micro_batches`, each rank
    /// holding `virtual_stages` model chunks (only [`PipelineSchedule::OneFOneB`] interleaves
    /// more than one; `Pipeline::run` refuses the others, and `M` not a multiple of `P`).
    pub fn order(self, stage: usize, stages: usize, virtual_stages: usize, micro_batches: usize) -> Vec<Chunk> {
        let m = micro_batches;
        let forward = |i| Chunk::new(Work::Forward, 0, i);
        let backward = |i| Chunk::new(Work::Backward, 0, i);
        match self {
            PipelineSchedule::OneFOneB if virtual_stages > 1 => interleaved(stage, stages, virtual_stages, m),
            PipelineSchedule::GPipe => (0..m).map(forward).chain((0..m).map(backward)).collect(),
            PipelineSchedule::OneFOneB => {
                let warmup = (stages - 1 - stage).min(m);
                let mut order: Vec<Chunk> = (0..warmup).map(forward).collect();
                for i in 0..m - warmup {
                    order.push(forward(warmup + i));
                    order.push(backward(i));
                }
                order.extend((m - warmup..m).map(backward));
                order
            }
            PipelineSchedule::ZeroBubbleH1 => {
                let (input, weights) =
                    (|i| Chunk::new(Work::InputGradient, 0, i), |i| Chunk::new(Work::WeightGradients, 0, i));
                let warmup = (stages - stage).min(m);
                let mut order: Vec<Chunk> = (0..warmup).map(forward).collect();
                let (mut f, mut b, mut w) = (warmup, 0, 0);
                // Stage `s` defers its first `s` W's: the gradient goes back sooner.
                while f < m && b < stage {
                    order.extend([input(b), forward(f)]);
                    (b, f) = (b + 1, f + 1);
                }
                while f < m {
                    order.extend([input(b), weights(w), forward(f)]);
                    (b, w, f) = (b + 1, w + 1, f + 1);
                }
                while b < m {
                    order.extend([input(b), weights(w)]);
                    (b, w) = (b + 1, w + 1);
                }
                order.extend((w..m).map(weights));
                order
            }
        }
    }

    /// The most micro-batches whose activations stage `stage` holds at once (with virtual
    /// stages, the most model chunks' activations over `V`, rounded up).
    pub fn in_flight(self, stage: usize, stages: usize, virtual_stages: usize, micro_batches: usize) -> usize {
        let held = chunks_in_flight(&self.order(stage, stages, virtual_stages, micro_batches), virtual_stages);
        held.total.div_ceil(virtual_stages)
    }
}

/// Megatron's interleaved 1F1B for rank `stage` (`forward_backward_pipelining_with_interleaving`):
/// the `V * M` forward chunks in groups of `P` micro-batches per model chunk (chunk 0 of
/// micro-batches 0..P, chunk 1 of the same, ..., then the next `P` micro-batches), the backward
/// chunks in the same order with the model chunks reversed; `2(P - 1 - s) + (V - 1)P` forwards
/// ahead (all of them when `M = P`), then one forward, one backward.
fn interleaved(stage: usize, stages: usize, virtual_stages: usize, micro_batches: usize) -> Vec<Chunk> {
    let (p, v) = (stages, virtual_stages);
    let total = v * micro_batches;
    let chunk_of = |k: usize, forward: bool| {
        let chunk = (k % (p * v)) / p;
        if forward {
            chunk
        } else {
            v - 1 - chunk
        }
    };
    let micro_of = |k: usize| (k / (p * v)) * p + k % p;
    let forward = |k| Chunk::new(Work::Forward, chunk_of(k, true), micro_of(k));
    let backward = |k| Chunk::new(Work::Backward, chunk_of(k, false), micro_of(k));
    let warmup = if micro_batches == p { total } else { (2 * (p - 1 - stage) + (v - 1) * p).min(total) };
    let mut order: Vec<Chunk> = (0..warmup).map(forward).collect();
    for k in 0..total - warmup {
        order.push(forward(warmup + k));
        order.push(backward(k));
    }
    order.extend((total - warmup..total).map(backward));
    order
}

/// The activations a rank's `order` holds at its fullest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunksInFlight {
    /// The most forward chunks alive at once (each a micro-batch's activations of one model
    /// chunk).
    pub total: usize,
    /// The most alive at once of each model chunk.
    pub per_model_chunk: Vec<usize>,
}

/// How many forward chunks of `order` are alive (run, their backward not finished) at most.
pub fn chunks_in_flight(order: &[Chunk], virtual_stages: usize) -> ChunksInFlight {
    let mut alive = vec![0usize; virtual_stages];
    let mut most = ChunksInFlight { total: 0, per_model_chunk: vec![0; virtual_stages] };
    for chunk in order {
        let held = &mut alive[chunk.model_chunk];
        match chunk.work {
            Work::Forward => *held += 1,
            Work::Backward | Work::WeightGradients => *held -= 1,
            Work::InputGradient => {}
        }
        most.per_model_chunk[chunk.model_chunk] = most.per_model_chunk[chunk.model_chunk].max(*held);
        most.total = most.total.max(alive.iter().sum());
    }
    most
}

/// The fraction of a step a stage idles when every stage's forward and backward chunks take
/// equal times: `(P - 1) / (V M + P - 1)` for 1F1B (interleaved over `V` virtual stages per
/// rank) and GPipe, the textbook bubble `(P - 1) / (V M)` of the ideal time as a share of the
/// step.
pub fn bubble_fraction(stages: usize, virtual_stages: usize, micro_batches: usize) -> f64 {
    (stages - 1) as f64 / (virtual_stages * micro_batches + stages - 1) as f64
}

/// A stage's work per micro-batch by the partition's cost model ([`super::time_cost`]).
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
        self.forward + self.input_gradient + self.weight_gradients
    }
}

/// Each rank's idle fraction of a step, by running the schedule's orders with each chunk
/// taking its cost's time and messages arriving as they are sent: the step ends when the last
/// rank finishes, and a rank idles while it waits for an activation or a gradient. `costs` are
/// each virtual stage's (`P * V` of them, virtual stage `c * P + r` being rank `r`'s model
/// chunk `c`). An error names the rank and chunk that would wait forever (no schedule here
/// does).
pub fn stage_idle_fractions(
    schedule: PipelineSchedule,
    backward: PipelineBackward,
    costs: &[ChunkCosts],
    stages: usize,
    micro_batches: usize,
) -> Result<Vec<f64>, String> {
    let virtual_stages = costs.len() / stages.max(1);
    let orders: Vec<Vec<Chunk>> =
        (0..stages).map(|r| schedule.order(r, stages, virtual_stages, micro_batches)).collect();
    let virtual_of = |rank: usize, chunk: &Chunk| chunk.model_chunk * stages + rank;
    // When each virtual stage's activation and input gradient of each micro-batch was sent.
    let (mut activation_sent, mut gradient_sent) =
        (vec![vec![None; micro_batches]; costs.len()], vec![vec![None; micro_batches]; costs.len()]);
    let mut clock = vec![0u64; stages];
    let mut next = vec![0usize; stages];
    let mut busy = vec![0u64; stages];
    loop {
        let mut progressed = false;
        for rank in 0..stages {
            while let Some(chunk) = orders[rank].get(next[rank]) {
                let stage = virtual_of(rank, chunk);
                let cost = costs[stage];
                let i = chunk.micro_batch;
                let ready = match chunk.work {
                    Work::Forward if stage == 0 => Some(0),
                    Work::Forward => activation_sent[stage - 1][i],
                    Work::Backward | Work::InputGradient if stage + 1 == costs.len() => Some(0),
                    Work::Backward | Work::InputGradient => gradient_sent[stage + 1][i],
                    Work::WeightGradients => Some(0),
                };
                let Some(ready) = ready else { break };
                let start = clock[rank].max(ready);
                let (sent, took) = match chunk.work {
                    Work::Forward => (start + cost.forward, cost.forward),
                    Work::InputGradient => (start + cost.input_gradient, cost.input_gradient),
                    Work::WeightGradients => (0, cost.weight_gradients),
                    Work::Backward => {
                        let whole = cost.input_gradient + cost.weight_gradients;
                        match backward {
                            PipelineBackward::Split => (start + cost.input_gradient, whole),
                            PipelineBackward::Whole => (start + whole, whole),
                        }
                    }
                };
                match chunk.work {
                    Work::Forward => activation_sent[stage][i] = Some(sent),
                    Work::Backward | Work::InputGradient => gradient_sent[stage][i] = Some(sent),
                    Work::WeightGradients => {}
                }
                clock[rank] = start + took;
                busy[rank] += took;
                next[rank] += 1;
                progressed = true;
            }
        }
        if (0..stages).all(|r| next[r] == orders[r].len()) {
            break;
        }
        if !progressed {
            let rank = (0..stages).find(|&r| next[r] < orders[r].len()).expect("one is waiting");
            return Err(format!("rank {rank} waits forever at {:?}", orders[rank][next[rank]]));
        }
    }
    let step = clock.iter().copied().max().unwrap_or(0);
    Ok(busy.iter().map(|&b| if step > 0 { 1.0 - b as f64 / step as f64 } else { 0.0 }).collect())
}

/// The pipeline pass: an imported graph with a `loss` output -> one graph per stage.
pub struct Pipeline {
    /// Ranks along the pipeline (`P`).
    pub stages: usize,
    /// Model chunks per rank (`V`, `--virtual-stages`): the model is cut into `P * V` virtual
    /// stages and rank `r` holds `r, r + P, ...`, run by the interleaved 1F1B schedule.
    pub virtual_stages: usize,
    /// Parameter-name prefixes to cut before (`--pp-cuts`, `P * V - 1` of them), or empty to
    /// balance by the cost model.
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
    /// The cuts (of the `P * V` virtual stages) and each rank's step graph; `Stages::params`
    /// lists the parameters each virtual stage holds (those it recomputes a value from
    /// included), [`Pipeline::rank_params`] each rank's.
    pub fn run(&self, graph: &Graph) -> Result<(Stages, Vec<Graph>), PassError> {
        self.check()?;
        let virtual_count = self.stages * self.virtual_stages;
        if let Some(layers) = super::numbered_layers(graph).filter(|l| l.numbers.len() < virtual_count) {
            if self.virtual_stages > 1 {
                return Err(invalid(format!(
                    "--pp {} --virtual-stages {} cuts the model into {virtual_count} chunks, more than its {} layers \
                     ({}.*); use fewer virtual stages",
                    self.stages,
                    self.virtual_stages,
                    layers.numbers.len(),
                    layers.prefix
                )));
            }
        }
        let mut stages = partition(graph, virtual_count, &self.cuts, &self.chunks_in_flight())?;
        let activation = activations(graph);
        let mut differentiated = Vec::new();
        for v in 0..virtual_count {
            let forward = forward_graph(graph, &stages, v, &activation)?;
            differentiated.push(self.differentiate(v, forward)?);
        }
        let parts: Vec<Vec<Part>> =
            differentiated.iter().enumerate().map(|(v, d)| chunk_parts(d, self.last(v))).collect();
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
        // The ranks holding each trained parameter.
        let mut holders: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (v, d) in differentiated.iter().enumerate() {
            for (name, _) in d.outputs() {
                if let Some(param) = name.strip_prefix(GRAD_PREFIX) {
                    if param != PIPE_IN {
                        let ranks = holders.entry(param.to_string()).or_default();
                        let rank = v % self.stages;
                        if !ranks.contains(&rank) {
                            ranks.push(rank);
                        }
                    }
                }
            }
        }
        for ranks in holders.values_mut() {
            ranks.sort();
        }
        let shared: Vec<String> = holders.iter().filter(|(_, h)| h.len() > 1).map(|(p, _)| p.clone()).collect();
        let mut graphs = Vec::new();
        for rank in 0..self.stages {
            let chunks: Vec<ModelChunk> = (self.virtual_stages_of(rank))
                .map(|v| ModelChunk { virtual_stage: v, d: &differentiated[v], parts: &parts[v] })
                .collect();
            let step = self.step_graph(rank, chunks, &holders, &shared)?;
            autotp_ir::verify(&step).map_err(|errors| PassError::Verify { pass: PASS, errors })?;
            graphs.push(step);
        }
        Ok((stages, graphs))
    }

    /// Refuses what the schedules cannot run.
    fn check(&self) -> Result<(), PassError> {
        let (p, v, m) = (self.stages, self.virtual_stages, self.micro_batches);
        if m == 0 {
            return Err(invalid("--grad-accum (the micro-batches the pipeline interleaves) must be at least 1".into()));
        }
        if v == 0 {
            return Err(invalid("--virtual-stages must be at least 1".into()));
        }
        if v > 1 && self.schedule != PipelineSchedule::OneFOneB {
            return Err(invalid(format!(
                "--virtual-stages {v} runs Megatron's interleaved 1F1B; --schedule {} has no interleaved form",
                self.schedule.name()
            )));
        }
        if v > 1 && (p < 2 || m % p != 0) {
            return Err(invalid(format!(
                "--virtual-stages {v} interleaves groups of --pp micro-batches: --grad-accum {m} must be a multiple \
                 of --pp {p} (and --pp at least 2), as in Megatron"
            )));
        }
        if self.schedule == PipelineSchedule::ZeroBubbleH1 && self.backward == PipelineBackward::Whole {
            return Err(invalid(
                "--schedule zb-h1 runs the weights' gradients apart from the input's: it needs --pp-backward split"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Each rank's order of chunks.
    pub fn order(&self, rank: usize) -> Vec<Chunk> {
        self.schedule.order(rank, self.stages, self.virtual_stages, self.micro_batches)
    }

    /// The most micro-batches whose activations each rank holds at once.
    pub fn in_flight(&self) -> Vec<usize> {
        (0..self.stages)
            .map(|r| self.schedule.in_flight(r, self.stages, self.virtual_stages, self.micro_batches))
            .collect()
    }

    /// The most micro-batches whose activations each virtual stage holds at once (the
    /// partition's memory model).
    fn chunks_in_flight(&self) -> Vec<usize> {
        let per_rank: Vec<ChunksInFlight> =
            (0..self.stages).map(|r| chunks_in_flight(&self.order(r), self.virtual_stages)).collect();
        (0..self.stages * self.virtual_stages)
            .map(|v| per_rank[v % self.stages].per_model_chunk[v / self.stages])
            .collect()
    }

    /// The parameters each rank holds: its virtual stages' (`stages.params`), in name order.
    pub fn rank_params(&self, stages: &Stages) -> Vec<Vec<String>> {
        (0..self.stages)
            .map(|rank| {
                let mut names: Vec<String> =
                    self.virtual_stages_of(rank).flat_map(|v| stages.params[v].iter().cloned()).collect();
                names.sort();
                names.dedup();
                names
            })
            .collect()
    }

    /// Each rank's forward FLOPs per micro-batch: its virtual stages' summed.
    pub fn rank_flops(&self, stages: &Stages) -> Vec<u64> {
        (0..self.stages).map(|rank| self.virtual_stages_of(rank).map(|v| stages.flops[v]).sum()).collect()
    }

    /// Rank `rank`'s virtual stages, in model-chunk order: `rank, rank + P, ...`.
    fn virtual_stages_of(&self, rank: usize) -> impl Iterator<Item = usize> {
        (rank..self.stages * self.virtual_stages).step_by(self.stages)
    }

    fn last(&self, v: usize) -> bool {
        v + 1 == self.stages * self.virtual_stages
    }

    /// Virtual stage `v`'s forward graph with its backward: the gradient of its output is the
    /// input `grad.<output>`, and `pipe.in` gets a gradient output too.
    fn differentiate(&self, v: usize, mut g: Graph) -> Result<Graph, PassError> {
        let output = if self.last(v) { LOSS } else { PIPE_OUT };
        let value = g.outputs().iter().find(|(n, _)| n == output).map(|(_, v)| *v).expect("the stage's output");
        let cotangent = format!("{GRAD_PREFIX}{output}");
        g.add_input(cotangent.clone(), g.ty(value).clone());
        let mut autodiff = Autodiff::new(output);
        autodiff.frozen = self.frozen.clone();
        autodiff.padding_rows = self.padding_rows.clone();
        autodiff.cotangent = Some(cotangent);
        if v > 0 {
            autodiff.wrt_inputs = vec![PIPE_IN.to_string()];
        }
        autodiff.run(&mut g)?;
        Ok(g)
    }

    /// Rank `rank`'s step: the chunks of every micro-batch on each of its model chunks in
    /// schedule order.
    fn step_graph(
        &self,
        rank: usize,
        chunks: Vec<ModelChunk>,
        holders: &BTreeMap<String, Vec<usize>>,
        shared: &[String],
    ) -> Result<Graph, PassError> {
        let mut step = StepGraph::new(self, rank, chunks)?;
        if self.forward_only {
            // Each micro-batch through the rank's model chunks in the training order of forwards.
            for chunk in self.order(rank).into_iter().filter(|c| c.work == Work::Forward) {
                step.forward(chunk.model_chunk, chunk.micro_batch)?;
            }
            return Ok(step.finish_forward());
        }
        for chunk in self.order(rank) {
            let (c, i) = (chunk.model_chunk, chunk.micro_batch);
            match chunk.work {
                Work::Forward => step.forward(c, i)?,
                Work::Backward => step.backward(c, i)?,
                Work::InputGradient => step.input_gradient(c, i)?,
                Work::WeightGradients => step.weight_gradients(c, i)?,
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
