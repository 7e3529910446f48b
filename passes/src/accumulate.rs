//! `accumulate` (`--grad-accum A`): gradient accumulation inside one compiled step.
//!
//! The differentiated graph computes the loss and the gradients of one micro-batch. This pass
//! makes the step take `A` micro-batches: each batch input `[rows, ...]` becomes
//! `[rows, A, ...]` (the step's `rows x A` sequences, as the data loader lays them out), and
//! the forward and backward are repeated for micro-batch `i = [:, i]`, one after the other, each
//! micro-batch's gradients added into one accumulator per parameter as soon as they are made.
//! So one micro-batch's activations are alive at a time. The sharding passes see sums of
//! partial gradients: at ZeRO 0-1 they reduce the sums once per step, at ZeRO 2-3 they scatter
//! each micro-batch's gradients into shards as they are made and sum the shards
//! ([`crate::shard::Shard::micro_batches`]).
//!
//! The step's loss is the mean over every counted position of all micro-batches, as the
//! single-device step over the whole batch computes it: a mean cross-entropy (or NLL) that
//! ignores a label index weighs micro-batch `i` by its share of the step's counted labels; any
//! other loss by `1 / A`. Each micro-batch's loss and gradients are weighted as they are made,
//! before they are added (DeepSpeed divides each micro-batch's loss by the accumulation steps),
//! so every gradient term is used at the end of its own micro-batch: a reduce-scatter of it
//! (ZeRO 2 and 3 scatter each micro-batch's) is waited for there, not a micro-batch later.
//! With fp16's loss scaling (a `loss_scale` input, the backward's seed), each micro-batch's
//! backward starts from the scale times its weight instead, and the gradients are summed as
//! they are: DeepSpeed's order, which keeps the 16-bit gradients the size of the whole step's.
//!
//! Input phase: differentiated (`loss` and `grad.<param>` outputs). Output: the same, over `A`
//! micro-batches. Tests: tests/golden/accumulate.ir, tests/parallel.rs.

use autotp_ir::{BinaryOp, Graph, NodeId, Op, ReduceOp, Reduction, Tensor, TensorType, UnaryOp, ValueId};

use crate::autodiff::GRAD_PREFIX;
use crate::loss::LOSS;
use crate::{Pass, PassError};

const PASS: &str = "accumulate";

pub struct Accumulate {
    /// Micro-batches per step (`A`).
    pub micro_batches: usize,
    /// Graph inputs with a batch dim 0.
    pub batch_inputs: Vec<String>,
}

fn invalid(message: String) -> PassError {
    PassError::Invalid { pass: PASS, message }
}

fn add(g: &mut Graph, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
    crate::add_op(PASS, g, op, inputs)
}

/// Micro-batch `i` (`[:, i]`) of a batch input laid out `[rows, A, ...]`, as `[rows, ...]`.
pub(crate) fn micro_batch(pass: &'static str, g: &mut Graph, input: ValueId, i: usize) -> Result<ValueId, PassError> {
    let mut shape = g.ty(input).shape.clone();
    let mut starts = vec![0; shape.len()];
    let mut ends: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    starts[1] = i;
    ends[1] = i as i64 + 1;
    let steps = vec![1; shape.len()];
    let sliced = crate::add_op(pass, g, Op::Slice { starts, ends, steps }, vec![input])?;
    shape.remove(1);
    crate::add_op(pass, g, Op::Reshape { shape }, vec![sliced])
}

/// How many of `labels` are not `ignored`, as a `dtype` scalar.
pub(crate) fn count_labels(
    pass: &'static str,
    g: &mut Graph,
    labels: ValueId,
    ignored: i64,
    dtype: autotp_ir::DType,
) -> Result<ValueId, PassError> {
    let label_dtype = g.ty(labels).dtype;
    let ignored =
        crate::add_op(pass, g, Op::Constant { value: Tensor::full(label_dtype, vec![], ignored as f64) }, vec![])?;
    let is_ignored = crate::add_op(pass, g, Op::Binary(BinaryOp::Equal), vec![labels, ignored])?;
    let kept = crate::add_op(pass, g, Op::Unary(UnaryOp::Not), vec![is_ignored])?;
    let kept = crate::add_op(pass, g, Op::Cast { to: dtype }, vec![kept])?;
    let axes = (0..g.ty(kept).rank()).collect();
    crate::add_op(pass, g, Op::Reduce { op: ReduceOp::Sum, axes, keep_dims: false }, vec![kept])
}

/// A mean class loss that ignores a label index: (its labels input, the ignored index).
pub(crate) fn counted_loss(graph: &Graph) -> Option<(ValueId, i64)> {
    graph.nodes().find_map(|(_, n)| match n.op {
        Op::CrossEntropy { ignore_index: Some(ignored), reduction: Reduction::Mean }
        | Op::NllLoss { ignore_index: Some(ignored), reduction: Reduction::Mean } => Some((n.inputs[1], ignored)),
        _ => None,
    })
}

impl Pass for Accumulate {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let steps = self.micro_batches;
        if steps == 0 {
            return Err(invalid("--grad-accum must be at least 1".into()));
        }
        if steps == 1 {
            return Ok(());
        }
        let old = &*graph;
        if let Some((name, _)) = old.outputs().iter().find(|(n, _)| n != LOSS && !n.starts_with(GRAD_PREFIX)) {
            return Err(invalid(format!("output '{name}' is neither the loss nor a gradient: nothing to accumulate")));
        }
        let loss = old
            .outputs()
            .iter()
            .find(|(n, _)| n == LOSS)
            .map(|(_, v)| *v)
            .ok_or_else(|| invalid(format!("the graph has no '{LOSS}' output")))?;
        let dtype = old.ty(loss).dtype;
        let mut g = Graph::new(old.name.clone());
        // Old graph inputs, parameters and states: their values in the new graph; batch inputs
        // are [rows, A, ...].
        let mut outer: Vec<Option<ValueId>> = vec![None; old.num_values()];
        let mut batch = Vec::new();
        for &i in old.inputs() {
            let name = old.name_of(i).unwrap_or("").to_string();
            let ty = old.ty(i).clone();
            if self.batch_inputs.contains(&name) {
                if ty.rank() == 0 {
                    return Err(invalid(format!("batch input '{name}' {ty} has no batch dim")));
                }
                let mut shape = ty.shape.clone();
                shape.insert(1, steps);
                batch.push((i, g.add_input(name, TensorType::new(ty.dtype, shape))));
            } else {
                outer[i.index()] = Some(g.add_input(name, ty));
            }
        }
        for &p in old.params() {
            outer[p.index()] = Some(g.add_param(old.name_of(p).unwrap_or(""), old.ty(p).clone()));
        }
        for &s in old.states() {
            outer[s.index()] = Some(g.add_state(old.name_of(s).unwrap_or(""), old.ty(s).clone()));
        }
        let counted = counted_loss(old);
        // fp16's loss scaling: each micro-batch's backward starts from the scale times its weight
        // (as the pipeline pass does), so its 16-bit gradients are what the whole step's would be.
        let scaled = old.inputs().iter().copied().find(|&v| old.name_of(v) == Some(crate::precision::LOSS_SCALE));
        // Each micro-batch's weight is its share of the step's counted labels (counted first,
        // from the labels each micro-batch's loss reads: a model's own loss may shift them), or
        // 1 / A. The counting makes its own slices, so that only scalars wait for the
        // micro-batches (full recomputation cuts the forward where one activation crosses).
        let label_nodes: Vec<NodeId> = match counted {
            Some((labels, _)) => {
                let nodes: Vec<&autotp_ir::Node> = old.nodes().map(|(_, n)| n).collect();
                let needed = crate::pipeline::needed_by(&nodes, old.num_values(), &[labels], |_| true);
                (0..nodes.len()).filter(|&i| needed[i]).map(|i| NodeId(i as u32)).collect()
            }
            None => Vec::new(),
        };
        let mut counts = Vec::with_capacity(steps);
        if let Some((labels, ignored)) = counted {
            let read = |v: ValueId| labels == v || label_nodes.iter().any(|&n| old.node(n).inputs.contains(&v));
            for step in 0..steps {
                let mut map = outer.clone();
                for &(old_input, new_input) in batch.iter().filter(|(o, _)| read(*o)) {
                    map[old_input.index()] = Some(micro_batch(PASS, &mut g, new_input, step)?);
                }
                copy_nodes(old, &mut g, &label_nodes, &mut map);
                counts.push(count_labels(PASS, &mut g, map[labels.index()].expect("copied"), ignored, dtype)?);
            }
        }
        let mut total = None;
        for &count in &counts {
            total = Some(match total {
                Some(t) => add(&mut g, Op::Binary(BinaryOp::Add), vec![t, count])?,
                None => count,
            });
        }
        // Running sums: (output name, accumulated value).
        let mut sums: Vec<(String, Option<ValueId>)> = old.outputs().iter().map(|(n, _)| (n.clone(), None)).collect();
        let all_nodes: Vec<NodeId> = old.nodes().map(|(id, _)| id).collect();
        for step in 0..steps {
            let weight = match (counts.get(step), total) {
                (Some(&count), Some(total)) => add(&mut g, Op::Binary(BinaryOp::Div), vec![count, total])?,
                _ => add(&mut g, Op::Constant { value: Tensor::full(dtype, vec![], 1.0 / steps as f64) }, vec![])?,
            };
            let mut map = outer.clone();
            for &(old_input, new_input) in &batch {
                map[old_input.index()] = Some(micro_batch(PASS, &mut g, new_input, step)?);
            }
            if let Some(scale) = scaled {
                let outer_scale = outer[scale.index()].expect("an input");
                map[scale.index()] = Some(add(&mut g, Op::Binary(BinaryOp::Mul), vec![outer_scale, weight])?);
            }
            copy_nodes(old, &mut g, &all_nodes, &mut map);
            for ((name, old_value), (_, sum)) in old.outputs().iter().zip(sums.iter_mut()) {
                let mut value = map[old_value.index()].expect("outputs are defined");
                // A scaled backward's seed carried the weight already.
                if name == LOSS || scaled.is_none() {
                    let w = scalar_like(&mut g, weight, value)?;
                    value = add(&mut g, Op::Binary(BinaryOp::Mul), vec![value, w])?;
                }
                *sum = Some(match *sum {
                    Some(s) => add(&mut g, Op::Binary(BinaryOp::Add), vec![s, value])?,
                    None => value,
                });
            }
        }
        for (name, sum) in sums {
            g.add_output(name, sum.expect("at least one micro-batch"));
        }
        *graph = g;
        Ok(())
    }
}

/// Copies `nodes` of `old` into `g` through `map`.
fn copy_nodes(old: &Graph, g: &mut Graph, nodes: &[NodeId], map: &mut [Option<ValueId>]) {
    for &id in nodes {
        let node = old.node(id);
        let inputs = node.inputs.iter().map(|v| map[v.index()].expect("defined before use")).collect();
        let types = node.outputs.iter().map(|&o| old.ty(o).clone()).collect();
        let new = g.add_node_typed(node.op.clone(), inputs, types);
        for (&o, &n) in node.outputs.iter().zip(&g.node(new).outputs) {
            map[o.index()] = Some(n);
        }
    }
}

/// The scalar `v` in the dtype of `like` (cast when it is another).
fn scalar_like(g: &mut Graph, v: ValueId, like: ValueId) -> Result<ValueId, PassError> {
    let dtype = g.ty(like).dtype;
    if g.ty(v).dtype == dtype {
        Ok(v)
    } else {
        add(g, Op::Cast { to: dtype }, vec![v])
    }
}
