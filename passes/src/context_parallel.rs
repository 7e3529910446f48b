//! Context parallelism's choices in the [`crate::shard`] pass, over the `cp` mesh axis (its
//! seeds are [`crate::zero::batch_placement`]'s; attention's sharding rule is
//! [`autotp_ir::sharding`]'s):
//!
//! - all-gather (Megatron's `--cp-comm-type all_gather`): attention's key and value gradients,
//!   each rank's part of a sum over its queries, are reduce-scattered over the keys' sequence
//!   where they are made ([`key_value_gradients`]), as Megatron returns them: the projections'
//!   backward then runs on each rank's tokens, and the scatter moves the keys' and values'
//!   bytes, not the hidden state's;
//! - all-to-all (DeepSpeed-Ulysses): a value split one way over cp is split another by one
//!   all-to-all ([`exchange`]); attention taken by its heads returns its output, and its
//!   backward the gradients, to the tokens' split as soon as they are made
//!   ([`ulysses_outputs`]).
//!
//! Tests: tests/golden/shard_context_parallel*.ir, tests/context_parallel.rs.

use std::collections::BTreeMap;

use autotp_ir::{Collective, Graph, Op, Placement, ValueId};

/// Over an axis that `exchanges` (the context-parallel axis: Ulysses' tokens and heads; expert
/// parallelism's: pairs to their experts), a value split on one dim is split on another by one
/// all-to-all; `None` elsewhere.
pub(crate) fn exchange(exchanges: bool, from: Placement, to: Placement) -> Option<Vec<Collective>> {
    match (from, to) {
        (Placement::Shard(concat), Placement::Shard(split)) if exchanges => {
            Some(vec![Collective::AllToAll { split, concat }])
        }
        _ => None,
    }
}

/// The partial key and value gradients of `placed`'s attention backwards over the
/// context-parallel axis, each with the axis and the keys' split it is scattered to.
pub(crate) fn key_value_gradients(placed: &Graph) -> Vec<(ValueId, usize, Placement)> {
    let Some(a) = placed.mesh.axes.iter().position(|a| a.name == autotp_ir::CONTEXT_AXIS) else {
        return Vec::new();
    };
    let mut gradients = Vec::new();
    for (_, node) in placed.nodes().filter(|(_, n)| matches!(n.op, Op::AttentionGrad { .. })) {
        for &gradient in &node.outputs[1..] {
            let keys = placed.ty(gradient).rank() - 2;
            let partial = placed.value(gradient).placements[a] == Placement::PartialSum;
            if partial && placed.ty(gradient).shape[keys].is_multiple_of(placed.mesh.axes[a].size) {
                gradients.push((gradient, a, Placement::Shard(keys)));
            }
        }
    }
    gradients
}

/// DeepSpeed-Ulysses: the outputs of an attention placed by heads over cp that go back to
/// their tokens' split as soon as they are made (the forward's `out`; the backward's `dq`,
/// `dk`, `dv`), by output: the axis, the tokens' dim and the heads' dim. The log-sum-exp stays
/// by heads: only the backward, by heads too, reads it.
pub(crate) fn ulysses_outputs(op: &Op, outputs: &[ValueId], graph: &Graph) -> BTreeMap<ValueId, (usize, usize, usize)> {
    let Some(a) = graph.mesh.axes.iter().position(|a| a.name == autotp_ir::CONTEXT_AXIS) else {
        return BTreeMap::new();
    };
    let returned = match op {
        Op::Attention { .. } => &outputs[..1],
        Op::AttentionGrad { .. } => outputs,
        _ => return BTreeMap::new(),
    };
    let mut by_heads = BTreeMap::new();
    for &v in returned {
        let tokens = graph.ty(v).rank() - 2;
        if let Placement::Shard(heads) = graph.value(v).placements[a] {
            if heads < tokens {
                by_heads.insert(v, (a, tokens, heads));
            }
        }
    }
    by_heads
}

/// Every attention forward runs on shards over cp (of its queries, or of its heads): one that
/// would run whole on every rank (its heads not divisible for Ulysses, say) is refused, naming
/// it, rather than compiled into a plan that gathers the whole sequence on every rank.
pub(crate) fn check_attention_split(graph: &Graph) -> Result<(), String> {
    let Some(a) = graph.mesh.axes.iter().position(|a| a.name == autotp_ir::CONTEXT_AXIS) else { return Ok(()) };
    let cp = graph.mesh.axes[a].size;
    for (id, node) in graph.nodes().filter(|(_, n)| matches!(n.op, Op::Attention { .. })) {
        if graph.value(node.inputs[0]).placements[a] == Placement::Replicate {
            return Err(format!(
                "attention (node {}) would run whole on every cp rank: cp={cp} divides neither its queries' heads \
                 {:?} (--cp-comm-type a2a) nor their runs (all_gather)",
                id.index(),
                graph.ty(node.inputs[0]).shape
            ));
        }
    }
    Ok(())
}
