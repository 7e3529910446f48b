//! `unmerge-heads`: attention written over `[batch x heads, s, d]` (BLOOM's `baddbmm` and
//! `bmm`, with the ALiBi bias `[batch x heads, 1, s]`) is computed over `[batch, heads, s, d]`.
//!
//! A *merge* is a reshape whose output's first dim is the product of its input's leading dims
//! and whose other dims are the input's trailing ones (`[b, h, s, d] -> [b*h, s, d]`). What
//! reads merged values and works row by row along that first dim is rewritten over the leading
//! dims instead: elementwise ops, batched matmuls, softmax and reductions over the other dims,
//! transposes that keep the first dim, reshapes that keep it. A reshape back to the leading
//! dims (the *unmerge*) then reads the rewritten value itself and goes. Another operand
//! of the merged size is viewed with the leading dims (a constant is reshaped in place: ALiBi's
//! bias becomes `[b, h, 1, s]`); one that broadcasts along the first dim is read as it is.
//! Whatever else reads a merged value reads it merged again.
//!
//! Nothing is computed differently (each row is the same row), but the heads stay a dim of
//! their own, so `autotp` splits them as in any other attention, and the ALiBi bias with them.
//! A graph with no unmerge is left as it is. Runs on the imported model (before autodiff).
//! Tests: tests/golden/unmerge_heads.ir, tests/train.rs (BLOOM under `--tp 2`).

use std::collections::BTreeMap;

use autotp_ir::{Def, Graph, Node, Op, Rewriter, ValueId};

use crate::{Pass, PassError};

const PASS: &str = "unmerge-heads";

pub struct UnmergeHeads;

/// The leading dims a merged value's first dim stands for.
type Leading = Vec<usize>;

/// A merge: `[lead.., rest..] -> [prod(lead), rest..]` with at least two leading dims.
fn merged_leading(input: &[usize], output: &[usize]) -> Option<Leading> {
    // A reshape to a scalar or a vector merges nothing (and would leave no dims to slice).
    if output.len() < 2 {
        return None;
    }
    let k = input.len().checked_sub(output.len())? + 1;
    let lead = &input[..k];
    let merges = k >= 2
        && input[k..] == output[1..]
        && lead.iter().product::<usize>() == output[0]
        && lead.iter().filter(|&&d| d > 1).count() >= 2;
    merges.then(|| lead.to_vec())
}

/// How a node reading merged values is computed over the leading dims.
enum Lift {
    /// The node over the lifted operands, with this op: its output is merged too.
    Node(Op),
    /// A reshape to the leading dims (and then any trailing shape): its output is the lifted
    /// operand, or that operand reshaped.
    Unmerge(Option<Op>),
}

/// How `node`, whose first operand is merged (`[prod(lead), ..]`), is computed over the
/// leading dims, if it works row by row along the first dim.
fn lifted_op(node: &Node, input: &[usize], lead: &[usize]) -> Option<Lift> {
    let k = lead.len();
    let shift = |d: usize| if d == 0 { None } else { Some(d + k - 1) };
    Some(match &node.op {
        Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Cast { .. } => Lift::Node(node.op.clone()),
        Op::MatMul { .. } if input.len() == 3 => Lift::Node(node.op.clone()),
        Op::Softmax { axis } => Lift::Node(Op::Softmax { axis: shift(*axis)? }),
        Op::LogSoftmax { axis } => Lift::Node(Op::LogSoftmax { axis: shift(*axis)? }),
        Op::Reduce { op, axes, keep_dims } => {
            let axes = axes.iter().map(|&a| shift(a)).collect::<Option<_>>()?;
            Lift::Node(Op::Reduce { op: *op, axes, keep_dims: *keep_dims })
        }
        Op::Transpose { perm } if perm[0] == 0 => {
            let inner = perm[1..].iter().map(|&p| p + k - 1);
            Lift::Node(Op::Transpose { perm: (0..k).chain(inner).collect() })
        }
        Op::Reshape { shape } if shape.len() > k && shape[..k] == *lead => {
            let lifted: Vec<usize> = lead.iter().chain(&input[1..]).copied().collect();
            Lift::Unmerge((*shape != lifted).then(|| node.op.clone()))
        }
        Op::Reshape { shape } if shape.len() > 1 && shape[0] == input[0] => {
            Lift::Node(Op::Reshape { shape: lead.iter().chain(&shape[1..]).copied().collect() })
        }
        _ => return None,
    })
}

impl Pass for UnmergeHeads {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        // Merged values (by the leading dims they stand for) and how each node is lifted.
        let mut merged: BTreeMap<ValueId, Leading> = BTreeMap::new();
        let mut seeds: BTreeMap<usize, ValueId> = BTreeMap::new();
        let mut lifts: BTreeMap<usize, (Lift, Leading)> = BTreeMap::new();
        for (id, node) in graph.nodes() {
            if let Op::Reshape { .. } = node.op {
                let (from, to) = (&graph.ty(node.inputs[0]).shape, &graph.ty(node.outputs[0]).shape);
                if !merged.contains_key(&node.inputs[0]) {
                    if let Some(lead) = merged_leading(from, to) {
                        merged.insert(node.outputs[0], lead);
                        seeds.insert(id.index(), node.inputs[0]);
                        continue;
                    }
                }
            }
            let Some(lead) = node.inputs.iter().find_map(|v| merged.get(v)).cloned() else { continue };
            let lead = &lead;
            let out = &graph.ty(node.outputs[0]).shape;
            let operands_fit = node
                .inputs
                .iter()
                .all(|v| merged.get(v).map_or_else(|| lifts_as_operand(&graph.ty(*v).shape, out, lead), |l| l == lead));
            let first_merged = merged.contains_key(&node.inputs[0]);
            let input = &graph.ty(node.inputs[0]).shape;
            let lift = lifted_op(node, input, lead).filter(|_| operands_fit && first_merged && node.outputs.len() == 1);
            if let Some(lift) = lift {
                if matches!(lift, Lift::Node(_)) {
                    merged.insert(node.outputs[0], lead.clone());
                }
                lifts.insert(id.index(), (lift, lead.clone()));
            }
        }
        if !lifts.values().any(|(lift, _)| matches!(lift, Lift::Unmerge(_))) {
            return Ok(());
        }
        let source = graph.clone();
        let mut rw = Rewriter::new(&source, |_| true);
        // Each merged value's form over its leading dims, in the new graph.
        let mut lifted: BTreeMap<ValueId, ValueId> = BTreeMap::new();
        for (id, node) in source.nodes() {
            if let Some(&input) = seeds.get(&id.index()) {
                lifted.insert(node.outputs[0], rw.map(input));
                continue;
            }
            if let Some((lift, lead)) = lifts.get(&id.index()) {
                let operand = |rw: &mut Rewriter<'_>, v: ValueId| -> Result<ValueId, PassError> {
                    match lifted.get(&v) {
                        Some(&l) => Ok(l),
                        None => view_with_leading(rw, &source, v, lead),
                    }
                };
                match lift {
                    Lift::Unmerge(reshape) => {
                        let mut v = operand(&mut rw, node.inputs[0])?;
                        if let Some(op) = reshape {
                            v = crate::add_op(PASS, rw.graph(), op.clone(), vec![v])?;
                        }
                        rw.set(node.outputs[0], v);
                    }
                    Lift::Node(op) => {
                        let inputs = node.inputs.iter().map(|&v| operand(&mut rw, v)).collect::<Result<Vec<_>, _>>()?;
                        let v = crate::add_op(PASS, rw.graph(), op.clone(), inputs)?;
                        lifted.insert(node.outputs[0], v);
                    }
                }
                continue;
            }
            for &v in &node.inputs {
                merge_again(&mut rw, &source, &lifted, v)?;
            }
            rw.copy_node(id);
        }
        for (_, v) in source.outputs() {
            merge_again(&mut rw, &source, &lifted, *v)?;
        }
        for (_, v) in source.updates() {
            merge_again(&mut rw, &source, &lifted, *v)?;
        }
        *graph = rw.finish().without_dead_code();
        Ok(())
    }
}

/// Whether an operand of `shape` beside merged values can be read over the leading dims: it
/// broadcasts along the first dim (lower rank, or a first dim of 1), or has the merged size
/// there (it is viewed with the leading dims).
fn lifts_as_operand(shape: &[usize], out: &[usize], lead: &[usize]) -> bool {
    shape.len() < out.len() || shape.first() == Some(&1) || shape.first() == Some(&lead.iter().product())
}

/// `v` (not merged) read over the leading dims: as it is when it broadcasts, else viewed with
/// them (a constant reshaped in place).
fn view_with_leading(rw: &mut Rewriter<'_>, source: &Graph, v: ValueId, lead: &[usize]) -> Result<ValueId, PassError> {
    let shape = &source.ty(v).shape;
    let mapped = rw.map(v);
    if shape.first() != Some(&lead.iter().product()) || lead.iter().product::<usize>() == 1 {
        return Ok(mapped);
    }
    let viewed: Vec<usize> = lead.iter().chain(&shape[1..]).copied().collect();
    if let Def::Node(n, 0) = source.value(v).def {
        if let Op::Constant { value } = &source.node(n).op {
            let value = value.reshaped(viewed.clone()).expect("the same elements");
            return crate::add_op(PASS, rw.graph(), Op::Constant { value }, vec![]);
        }
    }
    crate::add_op(PASS, rw.graph(), Op::Reshape { shape: viewed }, vec![mapped])
}

/// Gives a merged value its merged form in the new graph (once) for a reader that is not
/// lifted.
fn merge_again(
    rw: &mut Rewriter<'_>,
    source: &Graph,
    lifted: &BTreeMap<ValueId, ValueId>,
    v: ValueId,
) -> Result<(), PassError> {
    if rw.mapped(v).is_some() {
        return Ok(());
    }
    let Some(&l) = lifted.get(&v) else { return Ok(()) };
    let merged = crate::add_op(PASS, rw.graph(), Op::Reshape { shape: source.ty(v).shape.clone() }, vec![l])?;
    rw.set(v, merged);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_are_leading_dims_into_the_first() {
        assert_eq!(merged_leading(&[2, 4, 16, 8], &[8, 16, 8]), Some(vec![2, 4]));
        assert_eq!(merged_leading(&[2, 4, 16, 8], &[2, 64, 8]), None, "merges heads with s, not the batch");
        assert_eq!(merged_leading(&[1, 4, 16, 8], &[4, 16, 8]), None, "drops a unit dim only");
        assert_eq!(merged_leading(&[2, 4, 16], &[128]), None, "flattens everything");
    }
}
