//! Sharding: how values are laid out over the device mesh, and how each op may run on shards.
//!
//! Types in the graph are global; a value's [`Placement`] on each mesh axis says how the ranks
//! of that axis hold it (the DTensor / GSPMD model): `replicate`, `shard(d)` (contiguous equal
//! slices of dim d, in rank order; several axes sharding one dim nest in mesh-axis order) or
//! `partial(sum)` (the value is the sum of the ranks' tensors). [`local_shape`] is what one rank
//! holds.
//!
//! [`axis_rule`] is the sharding rule of every op along one mesh axis: given the placements its
//! inputs arrive in, the placements it needs them in and the placements of its outputs. Every op
//! runs on local shards with the same kernel as on one device (the kernel's shapes come from the
//! local types), so a rule only allows layouts where that is exact. Where an input arrives in
//! another placement, [`reshard`] gives the collectives that convert it. The verifier checks
//! every node against its rule, so a graph that verifies computes on its mesh what the
//! single-device graph computes.

use crate::{
    BinaryOp, Collective, DType, Def, Graph, Mesh, MeshAxis, Op, Placement, ReduceOp, Reduction, TensorType, UnaryOp,
    ValueId,
};

/// Expert parallelism's exchange of send buffers `[outer, n_src, inner, n_dst, P_s, width]`
/// between the sources' and the destinations' order (and back): the two rank dims swapped, as
/// `autotp_passes::expert_dispatch` lays them out. Over a mesh axis splitting dim 1 it is one
/// all-to-all.
pub const EXPERT_EXCHANGE: [usize; 6] = [0, 3, 2, 1, 4, 5];

/// The exchange that brought `ids` to their ranks, where `ids` are expert parallelism's
/// dispatched experts' ids: a cast to i64 of a reshape of the send buffers in the
/// destinations' order ([`EXPERT_EXCHANGE`], as many destinations as sources). Each
/// destination's rows are the pairs whose expert it holds, so a lookup by them in a table split
/// by expert over the exchange's axis reads its own block alone; the verifier accepts such a
/// lookup and its gradient's scatter on the block (`IndexBlock` kernels), which no rule gives
/// for indices in general.
pub fn dispatched_by(graph: &Graph, ids: ValueId) -> Option<ValueId> {
    let made_by = |v: ValueId| match graph.value(v).def {
        Def::Node(n, _) => Some(graph.node(n)),
        _ => None,
    };
    let cast = made_by(ids).filter(|n| matches!(n.op, Op::Cast { to: DType::I64 }))?;
    let reshape = made_by(cast.inputs[0]).filter(|n| matches!(n.op, Op::Reshape { .. }))?;
    let exchange = made_by(reshape.inputs[0])?;
    let square = graph.ty(exchange.inputs[0]).shape.get(..4).is_some_and(|d| d[1] == d[3]);
    (matches!(&exchange.op, Op::Transpose { perm } if perm[..] == EXPERT_EXCHANGE) && square)
        .then_some(reshape.inputs[0])
}

/// The shape one rank holds of a value of global `shape` with `placements` on `mesh`.
pub fn local_shape(mesh: &Mesh, shape: &[usize], placements: &[Placement]) -> Vec<usize> {
    let mut local = shape.to_vec();
    for (axis, p) in mesh.axes.iter().zip(placements) {
        if let Placement::Shard(d) = p {
            if let Some(size) = local.get_mut(*d) {
                *size /= axis.size.max(1);
            }
        }
    }
    local
}

/// The local type of a value.
pub fn local_type(mesh: &Mesh, ty: &TensorType, placements: &[Placement]) -> TensorType {
    TensorType::new(ty.dtype, local_shape(mesh, &ty.shape, placements))
}

/// The type the rule along mesh axis `a` decides on: `ty` as one rank of the axes before `a`
/// holds it. Axes sharding one dim nest in mesh-axis order, so an axis splits the blocks the
/// axes before it left each rank (dp's sequences, then cp's runs of their tokens, in the rows
/// that flatten both), and its collectives gather and scatter within those blocks.
pub fn type_within_outer_axes(mesh: &Mesh, ty: &TensorType, placements: &[Placement], a: usize) -> TensorType {
    let outer = Mesh { axes: mesh.axes[..a].to_vec() };
    local_type(&outer, ty, &placements[..a])
}

/// An op's placements along one mesh axis: what it needs its inputs in, and what it gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AxisRule {
    pub inputs: Vec<Placement>,
    pub outputs: Vec<Placement>,
}

impl AxisRule {
    fn all(inputs: usize, outputs: usize, p: Placement) -> AxisRule {
        AxisRule { inputs: vec![p; inputs], outputs: vec![p; outputs] }
    }

    fn replicated(inputs: usize, outputs: usize) -> AxisRule {
        AxisRule::all(inputs, outputs, Placement::Replicate)
    }
}

/// The placement on `axis` of a pipeline message of `shape`: an activation or gradient (a
/// `[batch, seq, ..]` hidden state) split like the batch inputs, its batch over the data-parallel
/// axes (dp, and ep where it is an axis of its own) and its tokens over the context-parallel one.
fn message_placement(message: crate::Message, shape: &[usize], axis: &MeshAxis) -> Placement {
    let dim = match axis.name.as_str() {
        crate::DATA_AXIS | crate::EXPERT_AXIS => 0,
        crate::CONTEXT_AXIS => 1,
        _ => return Placement::Replicate,
    };
    if message.batch_layout() && divisible(shape, dim, axis.size) {
        Placement::Shard(dim)
    } else {
        Placement::Replicate
    }
}

/// Whether a cast from `from` to `to` widens one float type into a wider one (f16/bf16 to f32):
/// a partial sum cast so is summed in the wider type.
pub fn widens(from: crate::DType, to: crate::DType) -> bool {
    from.is_float() && to.is_float() && to.size() > from.size()
}

/// Whether dim `d` of `shape` can be sharded `n` ways.
fn divisible(shape: &[usize], d: usize, n: usize) -> bool {
    shape.get(d).is_some_and(|&s| s % n == 0 && s >= n)
}

/// The rule of an elementwise op (with broadcasting): follow the biggest sharded operand, keep
/// partial sums through linear ops, else replicate.
fn elementwise_rule(op: &Op, inputs: &[&TensorType], out0: &[usize], current: &[Placement], n: usize) -> AxisRule {
    use Placement::{PartialSum, Replicate, Shard};
    let ni = inputs.len();
    let all_partial = !current.is_empty() && current.iter().all(|p| *p == PartialSum);
    let rank = out0.len();
    // The output dim of an input's dim, when the input is not broadcast along it.
    let out_dim = |i: usize, d: usize| {
        let offset = rank - inputs[i].rank();
        (inputs[i].shape[d] == out0[d + offset]).then_some(d + offset)
    };
    // Follow the biggest sharded operand (the activation, not a bias added to it).
    let mut by_size: Vec<usize> = (0..ni).collect();
    by_size.sort_by_key(|&i| std::cmp::Reverse(inputs[i].numel()));
    let target = by_size.into_iter().find_map(|i| match current[i] {
        Shard(d) => out_dim(i, d).filter(|&o| divisible(out0, o, n)),
        _ => None,
    });
    if let Some(o) = target {
        let needs = (0..ni)
            .map(|i| {
                let offset = rank - inputs[i].rank();
                match o.checked_sub(offset) {
                    Some(d) if inputs[i].shape[d] == out0[o] => Shard(d),
                    _ => Replicate,
                }
            })
            .collect();
        return AxisRule { inputs: needs, outputs: vec![Shard(o)] };
    }
    let linear = match op {
        Op::Unary(UnaryOp::Neg) => all_partial,
        // A widening float cast of a partial sum is summed in the wider type (mixed
        // precision's 16-bit gradients reduced in f32, as DeepSpeed and Megatron do).
        Op::Cast { to } => all_partial && widens(inputs[0].dtype, *to),
        Op::Binary(BinaryOp::Add | BinaryOp::Sub) => all_partial,
        Op::Binary(BinaryOp::Mul) => {
            matches!(current, [PartialSum, Replicate] | [Replicate, PartialSum])
        }
        Op::Binary(BinaryOp::Div) => matches!(current, [PartialSum, Replicate]),
        // 0 or NaN: a whole value's is also the partial sum whose ranks each hold it (n times 0
        // is 0), and the ranks' values of a partial sum add up to NaN exactly when one of the
        // parts is not finite (its total then is not either, unless the parts' sum overflows).
        Op::Unary(UnaryOp::FiniteZero) => true,
        _ => false,
    };
    if linear {
        AxisRule { inputs: current.to_vec(), outputs: vec![PartialSum] }
    } else {
        AxisRule::replicated(ni, 1)
    }
}

/// The rule of cross-entropy and NLL losses: scores `[N, C, ...]` and labels sharded on a
/// position dim (never the classes); a mean over sharded positions is not a sum of local
/// means, so only the per-position and summed losses follow a split.
fn class_loss_rule(reduction: Reduction, current: &[Placement], ni: usize, no: usize) -> AxisRule {
    use Placement::{PartialSum, Replicate, Shard};
    // Scores [N, C, ...] sharded on a position dim (not the classes), labels alike. A mean
    // over sharded positions is not a sum of local means: the pass rewrites it first.
    let position = match current[0] {
        Shard(d) if d != 1 => Some((d, if d == 0 { 0 } else { d - 1 })),
        _ => match current[1] {
            Shard(l) => Some((if l == 0 { 0 } else { l + 1 }, l)),
            _ => None,
        },
    };
    match (position, &reduction) {
        (Some((d, l)), Reduction::None | Reduction::Sum) => {
            let mut needs = vec![Shard(d), Shard(l)];
            needs.extend(std::iter::repeat_n(Replicate, ni - 2));
            let loss = if reduction == Reduction::Sum { PartialSum } else { Shard(l) };
            let mut outs = vec![loss];
            if no == 2 {
                outs.push(Shard(d));
            }
            AxisRule { inputs: needs, outputs: outs }
        }
        _ => AxisRule::replicated(ni, no),
    }
}

/// The rules of `gather_nd` and `scatter_nd`: indices that pick rows of the first `k` dims
/// leave the sliced dims after them free to stay split.
fn nd_rule(op: &Op, inputs: &[&TensorType], current: &[Placement]) -> AxisRule {
    use Placement::{Replicate, Shard};
    let k = *inputs[1].shape.last().unwrap_or(&0);
    let batch = inputs[1].rank().saturating_sub(1);
    if *op == Op::GatherNd {
        return match current[0] {
            Shard(d) if d >= k => AxisRule { inputs: vec![Shard(d), Replicate], outputs: vec![Shard(batch + d - k)] },
            _ => AxisRule::replicated(2, 1),
        };
    }
    let from_updates = match current[2] {
        Shard(u) if u >= batch => Some(k + u - batch),
        _ => None,
    };
    let d = match current[0] {
        Shard(d) if d >= k => Some(d),
        _ => from_updates,
    };
    match d {
        Some(d) => AxisRule { inputs: vec![Shard(d), Replicate, Shard(batch + d - k)], outputs: vec![Shard(d)] },
        None => AxisRule::replicated(3, 1),
    }
}

/// The rules of `gather` (an embedding's lookup: a table split along the looked-up axis gives
/// partial sums, each rank's rows) and of its gradient `scatter_add`.
fn lookup_rule(op: &Op, inputs: &[&TensorType], current: &[Placement]) -> AxisRule {
    use Placement::{PartialSum, Replicate, Shard};
    match *op {
        Op::Gather { axis } => {
            let index_rank = inputs[1].rank();
            match (current[0], current[1]) {
                (_, Shard(i)) => AxisRule { inputs: vec![Replicate, Shard(i)], outputs: vec![Shard(axis + i)] },
                (Shard(d), _) if d != axis => {
                    let o = if d < axis { d } else { d + index_rank - 1 };
                    AxisRule { inputs: vec![Shard(d), Replicate], outputs: vec![Shard(o)] }
                }
                (PartialSum, _) => AxisRule { inputs: vec![PartialSum, Replicate], outputs: vec![PartialSum] },
                // The table split along the looked-up axis (a vocabulary-parallel embedding):
                // each rank looks up the rows it holds and gives zeros for the others' (an
                // `IndexBlock` kernel), so the ranks' results sum to the lookup.
                (Shard(_), Replicate) => AxisRule { inputs: vec![current[0], Replicate], outputs: vec![PartialSum] },
                _ => AxisRule::replicated(2, 1),
            }
        }
        Op::ScatterAdd { axis, .. } => {
            let index_rank = inputs[0].rank();
            match (current[0], current[1]) {
                (_, Shard(u)) if u >= axis && u < axis + index_rank => {
                    AxisRule { inputs: vec![Shard(u - axis), Shard(u)], outputs: vec![PartialSum] }
                }
                (Shard(i), _) => AxisRule { inputs: vec![Shard(i), Shard(axis + i)], outputs: vec![PartialSum] },
                (_, Shard(u)) => {
                    let o = if u < axis { u } else { u + 1 - index_rank };
                    AxisRule { inputs: vec![Replicate, Shard(u)], outputs: vec![Shard(o)] }
                }
                (_, PartialSum) => AxisRule { inputs: vec![Replicate, PartialSum], outputs: vec![PartialSum] },
                _ => AxisRule::replicated(2, 1),
            }
        }
        _ => unreachable!("axis_rule sends only gathers and scatter-adds here"),
    }
}

/// The sharding rule of `op` along the mesh axis `axis`, for inputs arriving in `current`.
/// Types are global. Rules follow a sharded input where the op allows it (so data parallelism
/// and tensor parallelism flow through the graph without communication), keep partial sums
/// through linear ops, and otherwise ask for replicated inputs.
pub fn axis_rule(
    op: &Op,
    inputs: &[&TensorType],
    outputs: &[&TensorType],
    current: &[Placement],
    axis: &MeshAxis,
) -> AxisRule {
    use Placement::{PartialSum, Replicate, Shard};
    let (ni, no, n) = (inputs.len(), outputs.len(), axis.size);
    let out0 = outputs.first().map(|t| t.shape.as_slice()).unwrap_or_default();
    let all_partial = !current.is_empty() && current.iter().all(|p| *p == PartialSum);
    match op {
        Op::Constant { .. } => AxisRule::replicated(0, no),
        // Pipeline messages go between the ranks of two stages with the same coordinates, laid
        // out as their op says.
        Op::Send { message, .. } => {
            AxisRule { inputs: vec![message_placement(*message, &inputs[0].shape, axis)], outputs: vec![] }
        }
        Op::Recv { message, .. } => AxisRule { inputs: vec![], outputs: vec![message_placement(*message, out0, axis)] },
        Op::Collective { kind, axis: name, .. } if *name == axis.name => {
            let (from, to) = kind.transition();
            AxisRule { inputs: vec![from], outputs: vec![to] }
        }
        // A collective over another axis leaves this one as it is; so does waiting for one.
        Op::Collective { .. } | Op::Wait => AxisRule { inputs: current.to_vec(), outputs: current.to_vec() },
        Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Cast { .. } | Op::Gelu { .. } => {
            elementwise_rule(op, inputs, out0, current, n)
        }
        Op::Reduce { op: reduce, axes, keep_dims } => match current[0] {
            Shard(d) if !axes.contains(&d) => {
                let o = if *keep_dims { d } else { d - axes.iter().filter(|&&a| a < d).count() };
                AxisRule { inputs: vec![Shard(d)], outputs: vec![Shard(o)] }
            }
            Shard(d) if *reduce == ReduceOp::Sum => AxisRule { inputs: vec![Shard(d)], outputs: vec![PartialSum] },
            PartialSum if *reduce == ReduceOp::Sum => AxisRule::all(1, 1, PartialSum),
            _ => AxisRule::replicated(1, 1),
        },
        Op::MatMul { transpose_lhs, transpose_rhs } => {
            matmul_rule(inputs, out0, current, n, *transpose_lhs, *transpose_rhs)
        }
        Op::Attention { .. } | Op::AttentionGrad { .. } => attention_rule(op, inputs, current, axis),
        Op::Reshape { .. } => match current[0] {
            Shard(d) => match reshape_dim(&inputs[0].shape, out0, d) {
                Some(o) if divisible(out0, o, n) => AxisRule { inputs: vec![Shard(d)], outputs: vec![Shard(o)] },
                _ => AxisRule::replicated(1, 1),
            },
            p => AxisRule::all(1, 1, p),
        },
        Op::Transpose { perm } => match current[0] {
            Shard(d) => {
                let o = perm.iter().position(|&p| p == d).expect("a permutation");
                AxisRule { inputs: vec![Shard(d)], outputs: vec![Shard(o)] }
            }
            p => AxisRule::all(1, 1, p),
        },
        Op::Slice { starts, steps, .. } => match current[0] {
            Shard(d) if starts[d] == 0 && steps[d] == 1 && out0[d] == inputs[0].shape[d] => {
                AxisRule::all(1, 1, Shard(d))
            }
            // One of every `step` elements of the whole dim (half of an interleaved pair):
            // each rank's block, a multiple of `step` long, holds its share of the result.
            Shard(d)
                if steps[d] > 1
                    && starts[d] < steps[d] as usize
                    && out0[d] * steps[d] as usize == inputs[0].shape[d]
                    && divisible(&inputs[0].shape, d, axis.size * steps[d] as usize) =>
            {
                AxisRule::all(1, 1, Shard(d))
            }
            PartialSum => AxisRule::all(1, 1, PartialSum),
            _ => AxisRule::replicated(1, 1),
        },
        Op::Concat { axis } => {
            let shard = current.iter().find_map(|p| match p {
                Shard(d) if d != axis => Some(*d),
                _ => None,
            });
            match shard {
                Some(d) => AxisRule::all(ni, 1, Shard(d)),
                None if all_partial => AxisRule::all(ni, 1, PartialSum),
                None => AxisRule::replicated(ni, 1),
            }
        }
        Op::Split { axis, .. } => match current[0] {
            Shard(d) if d != *axis => AxisRule { inputs: vec![Shard(d)], outputs: vec![Shard(d); no] },
            PartialSum => AxisRule::all(1, no, PartialSum),
            _ => AxisRule::replicated(1, no),
        },
        Op::Expand { .. } => {
            let offset = out0.len() - inputs[0].rank();
            match current[0] {
                Shard(d) if inputs[0].shape[d] == out0[d + offset] => {
                    AxisRule { inputs: vec![Shard(d)], outputs: vec![Shard(d + offset)] }
                }
                PartialSum => AxisRule::all(1, 1, PartialSum),
                _ => AxisRule::replicated(1, 1),
            }
        }
        Op::Gather { .. } | Op::ScatterAdd { .. } => lookup_rule(op, inputs, current),
        Op::Pad { begin, end, value } => match current[0] {
            Shard(d) if begin[d] == 0 && end[d] == 0 => AxisRule::all(1, 1, Shard(d)),
            PartialSum if *value == 0.0 => AxisRule::all(1, 1, PartialSum),
            _ => AxisRule::replicated(1, 1),
        },
        Op::CumSum { axis, .. } => match current[0] {
            Shard(d) if d != *axis => AxisRule::all(1, 1, Shard(d)),
            PartialSum => AxisRule::all(1, 1, PartialSum),
            _ => AxisRule::replicated(1, 1),
        },
        Op::Triangle { .. } => match current[0] {
            Shard(d) if d + 2 < inputs[0].rank() => AxisRule::all(1, 1, Shard(d)),
            PartialSum => AxisRule::all(1, 1, PartialSum),
            _ => AxisRule::replicated(1, 1),
        },
        Op::Softmax { axis } | Op::LogSoftmax { axis } => match current[0] {
            Shard(d) if d != *axis => AxisRule::all(1, 1, Shard(d)),
            _ => AxisRule::replicated(1, 1),
        },
        Op::LayerNorm { axis, .. } | Op::RmsNorm { axis, .. } => match current[0] {
            Shard(d) if d < *axis => {
                let mut needs = vec![Replicate; ni];
                needs[0] = Shard(d);
                AxisRule { inputs: needs, outputs: vec![Shard(d)] }
            }
            _ => AxisRule::replicated(ni, 1),
        },
        Op::CrossEntropy { reduction, .. } | Op::NllLoss { reduction, .. } => {
            class_loss_rule(*reduction, current, ni, no)
        }
        Op::GatherNd | Op::ScatterNd { .. } => nd_rule(op, inputs, current),
        // Elements picked along `axis` from the same position on every other dim: a split of
        // another dim the data and the indices share splits both alike.
        Op::GatherElements { axis } => match (current[0], current[1]) {
            (Shard(d), _) | (_, Shard(d)) if d != *axis && inputs[0].shape[d] == inputs[1].shape[d] => {
                AxisRule::all(2, 1, Shard(d))
            }
            _ => AxisRule::replicated(ni, no),
        },
        Op::ScatterElements { axis, .. } => match current[1] {
            Shard(d) if d != *axis => AxisRule::all(2, 1, Shard(d)),
            _ => AxisRule::replicated(2, 1),
        },
        Op::TopK { axis, .. } => match current[0] {
            Shard(d) if d != *axis => AxisRule::all(1, 2, Shard(d)),
            _ => AxisRule::replicated(1, 2),
        },
        Op::AdamW { .. } | Op::Sgd { .. } => {
            // The optimizer state's placement decides (ZeRO shards it); every tensor operand
            // follows it; lr and step are replicated scalars.
            let tensors = if matches!(op, Op::AdamW { .. }) { 4 } else { 3 };
            let state = match current[2] {
                Shard(d) => Shard(d),
                _ => Replicate,
            };
            let mut needs = vec![state; tensors];
            needs.extend(std::iter::repeat_n(Replicate, ni - tensors));
            AxisRule { inputs: needs, outputs: vec![state; no] }
        }
    }
}

/// Whether `op`, with inputs in the placements its rule takes for a replicated output, can
/// compute just a rank's block of that output along `dim` instead, with no communication (so
/// a `shard_slice` of its result folds into it): an expand along a dim it broadcasts (the
/// kernel broadcasts to the block), and a scatter-add along its axis (an `IndexBlock` kernel
/// keeps the updates of the rows the rank holds; the gradient of a vocabulary-parallel
/// embedding).
pub fn computes_block(op: &Op, inputs: &[&TensorType], outputs: &[&TensorType], dim: usize) -> bool {
    let divisible = outputs.len() == 1 && dim < outputs[0].rank();
    divisible
        && match op {
            Op::Expand { shape } => {
                let offset = shape.len() - inputs[0].rank();
                dim < offset || inputs[0].shape[dim - offset] == 1
            }
            Op::ScatterAdd { axis, .. } => dim == *axis,
            _ => false,
        }
}

fn matmul_rule(
    inputs: &[&TensorType],
    out: &[usize],
    current: &[Placement],
    n: usize,
    transpose_lhs: bool,
    transpose_rhs: bool,
) -> AxisRule {
    use Placement::{PartialSum, Replicate, Shard};
    let (lhs, rhs) = (&inputs[0].shape, &inputs[1].shape);
    let (rl, rr, ro) = (lhs.len(), rhs.len(), out.len());
    let (lhs_m, lhs_k) = if transpose_lhs { (rl - 1, rl - 2) } else { (rl - 2, rl - 1) };
    let (rhs_k, rhs_n) = if transpose_rhs { (rr - 1, rr - 2) } else { (rr - 2, rr - 1) };
    // Batch dim `o` of the output, in an operand of rank r, if the operand is not broadcast there.
    let batch_of = |shape: &[usize], o: usize| {
        let offset = ro - shape.len();
        o.checked_sub(offset).filter(|&d| d + 2 < shape.len() && shape[d] == out[o])
    };
    let rule = |l: Placement, r: Placement, o: Placement| AxisRule { inputs: vec![l, r], outputs: vec![o] };
    match (current[0], current[1]) {
        (Shard(d), _) if d + 2 < rl => {
            let o = d + ro - rl;
            if lhs[d] != out[o] || !divisible(out, o, n) {
                return AxisRule::replicated(2, 1);
            }
            rule(Shard(d), batch_of(rhs, o).map_or(Replicate, Shard), Shard(o))
        }
        // Activations split by rows (sequence parallelism's tokens) into a weight split by
        // columns: the activations are gathered, as Megatron's sequence parallelism does before
        // a column-parallel GEMM, and the weight stays split.
        (Shard(d), Shard(e)) if d == lhs_m && e == rhs_n => rule(Replicate, Shard(e), Shard(ro - 1)),
        (Shard(d), _) if d == lhs_m => rule(Shard(d), Replicate, Shard(ro - 2)),
        (_, Shard(d)) if d == rhs_n => rule(Replicate, Shard(d), Shard(ro - 1)),
        (Shard(d), _) if d == lhs_k => rule(Shard(d), Shard(rhs_k), PartialSum),
        (_, Shard(d)) if d == rhs_k => rule(Shard(lhs_k), Shard(d), PartialSum),
        // A batch dim of the rhs; the lhs split there too, or broadcast (a weight times a
        // transposed batch of activations: `(x w^T)^T = w x^T`).
        (_, Shard(d)) => {
            let o = d + ro - rr;
            if rhs[d] != out[o] || !divisible(out, o, n) {
                return AxisRule::replicated(2, 1);
            }
            rule(batch_of(lhs, o).map_or(Replicate, Shard), Shard(d), Shard(o))
        }
        (PartialSum, Replicate) | (PartialSum, PartialSum) => rule(PartialSum, Replicate, PartialSum),
        (Replicate, PartialSum) => rule(Replicate, PartialSum, PartialSum),
        _ => AxisRule::replicated(2, 1),
    }
}

/// Attention runs independently for every index of its leading dims (batch, heads), so it runs
/// on shards of one of them: the query-shaped operands and results and the log-sum-exp split
/// there, and the key, value and bias split too, or stay whole where they broadcast (one
/// key/value head for the query heads of every rank). The backward's gradient of such a shared
/// key or value is then each rank's part of a sum.
///
/// It also runs independently for every query: the queries split over their sequence (context
/// parallelism), each rank attends over the whole key and value, whose gradients are then each
/// rank's part of a sum; a bias's rows split with the queries. A mask is the query's position,
/// which a rank holding some of the queries knows only from the runs' starts
/// ([`crate::shape_rules::attention_operands`]): with a mask, the queries split with their runs.
///
/// With `kv_block` (a ring's round) the keys and values split with the queries, each rank
/// holding whole blocks, and their gradients are each rank's block, not a part of a sum.
///
/// On the context-parallel axis, queries split over their sequence with a mask and no runs
/// (DeepSpeed-Ulysses, `--cp-comm-type a2a`) are taken by their heads instead: each rank
/// attends over the whole sequence for its heads (the shard pass exchanges them all-to-all).
/// Anything else runs whole.
fn attention_rule(op: &Op, inputs: &[&TensorType], current: &[Placement], axis: &MeshAxis) -> AxisRule {
    let n = axis.size;
    use Placement::{PartialSum, Replicate, Shard};
    let (forward, mask, kv_block) = match op {
        Op::Attention { mask, kv_block, .. } => (true, *mask, *kv_block),
        Op::AttentionGrad { mask, kv_block, .. } => (false, *mask, *kv_block),
        _ => unreachable!("attention_rule is called for attention ops"),
    };
    let [bias, run_starts] = crate::shape_rules::attention_operands(forward, inputs);
    let outputs = if forward { 2 } else { 3 };
    let q = &inputs[0].shape;
    let lead = q.len() - 2;
    // The run starts' dim is no leading dim of the query's.
    let tensors = inputs.len() - usize::from(run_starts.is_some());
    let split = current[..tensors].iter().zip(inputs).find_map(|(p, t)| match p {
        Shard(d) if *d < lead && t.shape[*d] == q[*d] && divisible(q, *d, n) => Some(*d),
        _ => None,
    });
    let runs_split = match run_starts {
        Some(starts) => divisible(&starts.shape, 0, n),
        None => !mask.is_positional(),
    };
    // A ring's blocks of queries and keys split together, whole blocks to a rank.
    let blocks = kv_block.map(|block| inputs[1].shape[lead] / block);
    let queries_split =
        current[0] == Shard(lead) && runs_split && divisible(q, lead, n) && blocks.is_none_or(|b| b % n == 0);
    // Ulysses: the first heads dim (after the batch) that the ranks divide.
    let heads = (axis.name == crate::CONTEXT_AXIS && current[0] == Shard(lead) && run_starts.is_none())
        .then(|| (1..lead).find(|&d| divisible(q, d, n)))
        .flatten();
    let d = match (split, heads) {
        (Some(d), _) => d,
        _ if queries_split => lead,
        (None, Some(d)) => d,
        (None, None) => return AxisRule::replicated(inputs.len(), outputs),
    };
    // The query's rows: a key or value has none when the queries split (it is whole), unless
    // they come in blocks.
    let follows = |i: usize, t: &TensorType| {
        let keys = (1..3).contains(&i) && d == lead;
        match keys {
            true if blocks.is_some() => Shard(d),
            true => Replicate,
            false if t.shape[d] == q[d] => Shard(d),
            false => Replicate,
        }
    };
    let mut ins: Vec<Placement> =
        inputs[..3 + usize::from(bias.is_some())].iter().enumerate().map(|(i, t)| follows(i, t)).collect();
    let starts = if d == lead { Shard(0) } else { Replicate };
    if forward {
        ins.extend(run_starts.map(|_| starts));
        return AxisRule { inputs: ins, outputs: vec![Shard(d), Shard(d)] };
    }
    ins.extend([Shard(d); 3]);
    ins.extend(run_starts.map(|_| starts));
    let gradient = |i: usize, t: &TensorType| if follows(i, t) == Shard(d) { Shard(d) } else { PartialSum };
    AxisRule { inputs: ins, outputs: vec![Shard(d), gradient(1, inputs[1]), gradient(2, inputs[2])] }
}

/// The output dim a sharded input dim `d` of a reshape maps to, when the shards stay contiguous
/// blocks: `d` must be the outermost non-unit dim of its group of merged/split dims, and the
/// result is the outermost non-unit output dim of that group.
fn reshape_dim(input: &[usize], output: &[usize], d: usize) -> Option<usize> {
    let (mut i, mut o) = (0, 0);
    while i < input.len() || o < output.len() {
        // Skip unit dims, which never carry a shard.
        while i < input.len() && input[i] == 1 && i != d {
            i += 1;
        }
        while o < output.len() && output[o] == 1 {
            o += 1;
        }
        if i >= input.len() || o >= output.len() {
            return None;
        }
        let (group_i, group_o) = (i, o);
        let (mut pi, mut po) = (input[i], output[o]);
        i += 1;
        o += 1;
        while pi != po {
            if pi < po {
                pi *= input.get(i)?;
                i += 1;
            } else {
                po *= output.get(o)?;
                o += 1;
            }
        }
        if (group_i..i).contains(&d) {
            return (d == group_i).then_some(group_o);
        }
    }
    None
}

/// The collectives that take a value from placement `from` to `to` along one axis, in order.
/// `None` when no collective does it (making a partial sum out of whole values).
pub fn reshard(from: Placement, to: Placement) -> Option<Vec<Collective>> {
    use Placement::{PartialSum, Replicate, Shard};
    Some(match (from, to) {
        (Replicate, Replicate) | (PartialSum, PartialSum) => vec![],
        (Shard(d), Shard(e)) if d == e => vec![],
        (PartialSum, Replicate) => vec![Collective::AllReduce],
        (PartialSum, Shard(d)) => vec![Collective::ReduceScatter { dim: d }],
        (Shard(d), Replicate) => vec![Collective::AllGather { dim: d }],
        (Replicate, Shard(d)) => vec![Collective::ShardSlice { dim: d }],
        (Shard(d), Shard(e)) => vec![Collective::AllGather { dim: d }, Collective::ShardSlice { dim: e }],
        (Replicate | Shard(_), PartialSum) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn t(shape: &[usize]) -> TensorType {
        TensorType::new(DType::F32, shape.to_vec())
    }

    #[test]
    fn reshape_dims() {
        // [B, S, H*D] -> [B, S, H, D]: a shard of the hidden dim is a shard of the heads.
        assert_eq!(reshape_dim(&[2, 8, 64], &[2, 8, 4, 16], 2), Some(2));
        assert_eq!(reshape_dim(&[2, 8, 64], &[2, 8, 4, 16], 0), Some(0));
        // [B, S, H] -> [B*S, H]: the batch shard stays contiguous; a sequence shard does not.
        assert_eq!(reshape_dim(&[2, 8, 64], &[16, 64], 0), Some(0));
        assert_eq!(reshape_dim(&[2, 8, 64], &[16, 64], 1), None);
        assert_eq!(reshape_dim(&[1, 8, 64], &[8, 1, 64], 1), Some(0));
    }

    #[test]
    fn matmul_rules() {
        use Placement::*;
        let op = Op::MatMul { transpose_lhs: false, transpose_rhs: false };
        let (x, w, y) = (t(&[4, 8, 16]), t(&[16, 32]), t(&[4, 8, 32]));
        let tp = MeshAxis { name: "tp".into(), size: 2 };
        let rule = |p: [Placement; 2]| axis_rule(&op, &[&x, &w], &[&y], &p, &tp);
        // Data parallel: the batch shard flows through.
        assert_eq!(rule([Shard(0), Replicate]).outputs, [Shard(0)]);
        // Column parallel: weight sharded on n. Row parallel: both on k gives a partial sum.
        assert_eq!(rule([Replicate, Shard(1)]).outputs, [Shard(2)]);
        assert_eq!(
            rule([Shard(2), Shard(0)]),
            AxisRule { inputs: vec![Shard(2), Shard(0)], outputs: vec![PartialSum] }
        );
        // A partial lhs stays partial through a replicated weight.
        assert_eq!(rule([PartialSum, Replicate]).outputs, [PartialSum]);
        // A weight times a batch of activations split on the batch: the weight broadcasts.
        let (w, x, y) = (t(&[32, 16]), t(&[4, 16, 8]), t(&[4, 32, 8]));
        let swapped = axis_rule(&op, &[&w, &x], &[&y], &[Replicate, Shard(0)], &tp);
        assert_eq!(swapped, AxisRule { inputs: vec![Replicate, Shard(0)], outputs: vec![Shard(0)] });
    }

    #[test]
    fn a_finite_zero_is_a_partial_sum_whatever_its_input() {
        use Placement::*;
        let op = Op::Unary(UnaryOp::FiniteZero);
        let tp = MeshAxis { name: "tp".into(), size: 2 };
        let scalar = t(&[]);
        let rule = |p: Placement| axis_rule(&op, &[&scalar], &[&scalar], &[p], &tp);
        // A whole value's 0 or NaN, held by every rank, adds up to the same 0 or NaN.
        assert_eq!(rule(Replicate), AxisRule { inputs: vec![Replicate], outputs: vec![PartialSum] });
        assert_eq!(rule(PartialSum), AxisRule { inputs: vec![PartialSum], outputs: vec![PartialSum] });
        // The sum of a whole and a sharded gradient's flags needs no collective.
        let add = Op::Binary(BinaryOp::Add);
        let sum = axis_rule(&add, &[&scalar, &scalar], &[&scalar], &[PartialSum, PartialSum], &tp);
        assert_eq!(sum.outputs, [PartialSum]);
        // A sharded tensor's flags stay sharded, as any elementwise op's.
        let (x, y) = (t(&[4, 8]), t(&[4, 8]));
        assert_eq!(axis_rule(&op, &[&x], &[&y], &[Shard(1)], &tp).outputs, [Shard(1)]);
    }

    #[test]
    fn interleaved_halves_keep_a_split() {
        use Placement::*;
        let tp = MeshAxis { name: "tp".into(), size: 2 };
        let slice = |start: usize, width: usize| {
            let op = Op::Slice { starts: vec![0, start], ends: vec![4, width as i64], steps: vec![1, 2] };
            axis_rule(&op, &[&t(&[4, width])], &[&t(&[4, width / 2])], &[Shard(1)], &tp)
        };
        // Each rank's 4 of 8 hold 2 of the even (or odd) elements, in order.
        assert_eq!(slice(0, 8), AxisRule::all(1, 1, Shard(1)));
        assert_eq!(slice(1, 8), AxisRule::all(1, 1, Shard(1)));
        // Blocks of 3 do not start on an even element.
        assert_eq!(slice(1, 6), AxisRule::replicated(1, 1));
    }

    #[test]
    fn attention_runs_on_shards_of_its_heads() {
        use Placement::*;
        let mask = crate::AttentionMask::Causal;
        let (q, kv, lse) = (t(&[2, 4, 8, 16]), t(&[2, 1, 8, 16]), t(&[2, 4, 8]));
        let tp = MeshAxis { name: "tp".into(), size: 2 };
        let forward = Op::Attention { scale: 0.25, mask, kv_block: None };
        let rule = |p: [Placement; 3]| axis_rule(&forward, &[&q, &kv, &kv], &[&q, &lse], &p, &tp);
        // Heads split; the one key/value head stays whole on every rank.
        assert_eq!(
            rule([Shard(1), Replicate, Replicate]),
            AxisRule { inputs: vec![Shard(1), Replicate, Replicate], outputs: vec![Shard(1), Shard(1)] }
        );
        assert_eq!(rule([Shard(0), Shard(0), Shard(0)]).outputs, [Shard(0), Shard(0)]);
        // Not along the sequence or the head dim, nor a pending sum.
        assert_eq!(rule([Shard(3), Replicate, Replicate]), AxisRule::replicated(3, 2));
        assert_eq!(rule([PartialSum, Replicate, Replicate]), AxisRule::replicated(3, 2));
        // The shared key/value head's gradients: each rank's part of a sum over the heads.
        let backward = Op::AttentionGrad { scale: 0.25, mask, kv_block: None };
        let ins = [&q, &kv, &kv, &q, &lse, &q];
        let current = [Shard(1), Replicate, Replicate, Shard(1), Shard(1), Shard(1)];
        let r = axis_rule(&backward, &ins, &[&q, &kv, &kv], &current, &tp);
        assert_eq!(r.outputs, [Shard(1), PartialSum, PartialSum]);
    }

    /// A ring's round (`kv_block`): the queries and keys split together over cp, whole blocks
    /// to a rank, and the key and value gradients are each rank's block, not a part of a sum.
    #[test]
    fn blocked_attention_splits_its_keys_with_its_queries() {
        use Placement::*;
        let mask = crate::AttentionMask::Causal;
        // Four blocks of 4 queries (two runs each) and 2 keys.
        let (q, kv, lse, starts) =
            (t(&[1, 2, 16, 8]), t(&[1, 1, 8, 8]), t(&[1, 2, 16]), TensorType::new(DType::I64, vec![8]));
        let forward = Op::Attention { scale: 0.25, mask, kv_block: Some(2) };
        let rule = |size: usize| {
            let cp = MeshAxis { name: crate::CONTEXT_AXIS.into(), size };
            let current = [Shard(2), Shard(2), Shard(2), Shard(0)];
            axis_rule(&forward, &[&q, &kv, &kv, &starts], &[&q, &lse], &current, &cp)
        };
        assert_eq!(
            rule(2),
            AxisRule { inputs: vec![Shard(2), Shard(2), Shard(2), Shard(0)], outputs: vec![Shard(2); 2] }
        );
        // Eight ranks divide the queries and their runs, but would cut the blocks.
        assert_eq!(rule(8), AxisRule::replicated(4, 2));
        let backward = Op::AttentionGrad { scale: 0.25, mask, kv_block: Some(2) };
        let cp = MeshAxis { name: crate::CONTEXT_AXIS.into(), size: 4 };
        let current = [Shard(2), Shard(2), Shard(2), Shard(2), Shard(2), Shard(2), Shard(0)];
        let r = axis_rule(&backward, &[&q, &kv, &kv, &q, &lse, &q, &starts], &[&q, &kv, &kv], &current, &cp);
        assert_eq!(r.outputs, [Shard(2), Shard(2), Shard(2)]);
    }

    #[test]
    fn attention_without_a_positional_mask_runs_on_shards_of_its_queries() {
        use Placement::*;
        let (q, kv, lse, bias) = (t(&[2, 4, 8, 16]), t(&[2, 4, 8, 16]), t(&[2, 4, 8]), t(&[2, 1, 8, 8]));
        let cp = MeshAxis { name: "cp".into(), size: 2 };
        let scale = 0.25;
        let forward = Op::Attention { scale, mask: crate::AttentionMask::None, kv_block: None };
        let current = [Shard(2), Shard(2), Shard(2), Replicate];
        let r = axis_rule(&forward, &[&q, &kv, &kv, &bias], &[&q, &lse], &current, &cp);
        // Every rank's queries over the whole key and value; the mask's rows split with them.
        assert_eq!(
            r,
            AxisRule { inputs: vec![Shard(2), Replicate, Replicate, Shard(2)], outputs: vec![Shard(2), Shard(2)] }
        );
        let backward = Op::AttentionGrad { scale, mask: crate::AttentionMask::None, kv_block: None };
        let ins = [&q, &kv, &kv, &bias, &q, &lse, &q];
        let current = [Shard(2), Replicate, Replicate, Shard(2), Shard(2), Shard(2), Shard(2)];
        let r = axis_rule(&backward, &ins, &[&q, &kv, &kv], &current, &cp);
        assert_eq!(r.outputs, [Shard(2), PartialSum, PartialSum]);
        // A causal mask is the query's position: the queries split where each rank knows where
        // its queries start (without, Ulysses takes the heads: the next test).
        let causal = Op::Attention { scale, mask: crate::AttentionMask::Causal, kv_block: None };
        let starts = TensorType::new(crate::DType::I64, vec![2]);
        let current = [Shard(2), Shard(2), Shard(2), Replicate];
        let r = axis_rule(&causal, &[&q, &kv, &kv, &starts], &[&q, &lse], &current, &cp);
        assert_eq!(
            r,
            AxisRule { inputs: vec![Shard(2), Replicate, Replicate, Shard(0)], outputs: vec![Shard(2), Shard(2)] }
        );
    }

    /// Over the context-parallel axis, causal attention without run starts is taken by its
    /// heads (DeepSpeed-Ulysses), its gradients too; over any other axis it runs whole.
    #[test]
    fn causal_attention_without_run_starts_runs_on_shards_of_its_heads_over_cp() {
        use Placement::*;
        let (q, kv, lse) = (t(&[1, 4, 8, 16]), t(&[1, 4, 8, 16]), t(&[1, 4, 8]));
        let causal = Op::Attention { scale: 0.25, mask: crate::AttentionMask::Causal, kv_block: None };
        let tokens = [Shard(2), Shard(2), Shard(2)];
        let cp = MeshAxis { name: "cp".into(), size: 2 };
        let r = axis_rule(&causal, &[&q, &kv, &kv], &[&q, &lse], &tokens, &cp);
        assert_eq!(r, AxisRule { inputs: vec![Shard(1); 3], outputs: vec![Shard(1), Shard(1)] });
        let backward = Op::AttentionGrad { scale: 0.25, mask: crate::AttentionMask::Causal, kv_block: None };
        let current = [Shard(2), Shard(2), Shard(2), Shard(2), Shard(2), Shard(2)];
        let r = axis_rule(&backward, &[&q, &kv, &kv, &q, &lse, &q], &[&q, &kv, &kv], &current, &cp);
        assert_eq!(r.outputs, [Shard(1), Shard(1), Shard(1)]);
        let other = MeshAxis { name: "sp".into(), size: 2 };
        assert_eq!(axis_rule(&causal, &[&q, &kv, &kv], &[&q, &lse], &tokens, &other), AxisRule::replicated(3, 2));
    }

    #[test]
    fn gather_elements_keeps_a_split_of_another_dim() {
        use Placement::*;
        let (data, idx) = (t(&[2, 8, 3]), TensorType::new(DType::I64, vec![2, 4, 3]));
        let dp = MeshAxis { name: "dp".into(), size: 2 };
        let op = Op::GatherElements { axis: 1 };
        let out = t(&[2, 4, 3]);
        let rule = axis_rule(&op, &[&data, &idx], &[&out], &[Replicate, Shard(0)], &dp);
        assert_eq!(rule, AxisRule::all(2, 1, Shard(0)));
        // Along the picked axis, or where the indices cover part of a dim, it needs them whole.
        assert_eq!(axis_rule(&op, &[&data, &idx], &[&out], &[Shard(1), Shard(1)], &dp), AxisRule::replicated(2, 1));
        let wide = t(&[2, 8, 6]);
        assert_eq!(axis_rule(&op, &[&wide, &idx], &[&out], &[Shard(2), Shard(2)], &dp), AxisRule::replicated(2, 1));
    }

    #[test]
    fn local_shapes_and_reshards() {
        let mesh =
            Mesh { axes: vec![MeshAxis { name: "dp".into(), size: 2 }, MeshAxis { name: "tp".into(), size: 4 }] };
        assert_eq!(local_shape(&mesh, &[8, 64], &[Placement::Shard(0), Placement::Shard(1)]), [4, 16]);
        assert_eq!(local_shape(&mesh, &[64], &[Placement::Shard(0), Placement::Shard(0)]), [8]);
        assert_eq!(
            reshard(Placement::PartialSum, Placement::Shard(1)),
            Some(vec![Collective::ReduceScatter { dim: 1 }])
        );
        assert_eq!(reshard(Placement::Replicate, Placement::PartialSum), None);
    }
}
