//! The shape rule of every op ([`Op::infer`]): its output types from its input types, or why
//! the inputs are invalid. One function per op family; [`infer`] sends each op to its family
//! with an exhaustive `match`, so a new op does not compile until its family has its rule.

use autotp_kernels::shape::broadcast_shapes;

use crate::op::{check_index_dtype, float_only, slice_len};
use crate::{BinaryOp, DType, Op, Reduction, TensorType};
use autotp_kernels::AttentionDims;

/// Output types for the given input types, or why the inputs are invalid (see [`Op::infer`]).
pub(crate) fn infer(this: &Op, inputs: &[&TensorType], num_outputs: usize) -> Result<Vec<TensorType>, String> {
    if !matches!(
        this,
        Op::Split { .. }
            | Op::CrossEntropy { .. }
            | Op::NllLoss { .. }
            | Op::AdamW { .. }
            | Op::Sgd { .. }
            | Op::Send { .. }
            | Op::TopK { .. }
            | Op::Attention { .. }
            | Op::AttentionGrad { .. }
    ) && num_outputs != 1
    {
        return Err(format!("has {num_outputs} outputs, expects 1"));
    }
    // Exhaustive: a new op is a compile error here until its family has its rule.
    match this {
        Op::Constant { .. } | Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Cast { .. } | Op::Gelu { .. } => {
            elementwise(this, inputs, num_outputs)
        }
        Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::CumSum { .. }
        | Op::CrossEntropy { .. }
        | Op::NllLoss { .. }
        | Op::MatMul { .. } => reductions(this, inputs, num_outputs),
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Split { .. }
        | Op::Expand { .. }
        | Op::Pad { .. }
        | Op::Triangle { .. } => movement(this, inputs, num_outputs),
        Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::GatherElements { .. }
        | Op::GatherNd
        | Op::ScatterNd { .. }
        | Op::ScatterElements { .. }
        | Op::TopK { .. } => indexing(this, inputs, num_outputs),
        Op::AdamW { .. } | Op::Sgd { .. } | Op::Collective { .. } | Op::Wait | Op::Send { .. } | Op::Recv { .. } => {
            training(this, inputs, num_outputs)
        }
        Op::Attention { .. } | Op::AttentionGrad { .. } => attention(this, inputs, num_outputs),
    }
}

/// The optional operands of `attention q, k, v[, bias][, run_starts]` and of `attention_grad q,
/// k, v[, bias], out, lse, d_out[, run_starts]`: the additive bias (a float, fourth), and the
/// first position of each run of queries (i64, last: [`AttentionDims::query_runs`]), where given.
pub fn attention_operands<'t>(forward: bool, inputs: &[&'t TensorType]) -> [Option<&'t TensorType>; 2] {
    let run_starts = inputs.last().copied().filter(|t| inputs.len() > 3 && t.dtype == crate::DType::I64);
    let given = inputs.len() - usize::from(run_starts.is_some());
    let bias = (given > if forward { 3 } else { 6 }).then(|| inputs[3]);
    [bias, run_starts]
}

/// The shapes of `attention q, k, v[, bias][, run_starts] {kv_block}`, or why they do not fit
/// together.
pub(crate) fn attention_dims(
    q: &TensorType,
    k: &TensorType,
    v: &TensorType,
    [bias, run_starts]: [Option<&TensorType>; 2],
    kv_block: Option<usize>,
) -> Result<AttentionDims, String> {
    float_only(q)?;
    let rank = q.rank();
    if rank < 2 || k.rank() != rank || v.rank() != rank {
        return Err(format!("q, k and v must have one rank of at least 2, got {q}, {k} and {v}"));
    }
    if [k, v].iter().chain(&bias).any(|t| t.dtype != q.dtype) {
        return Err(format!("q, k, v and the bias must have one dtype, got {q}, {k} and {v}"));
    }
    let lead = rank - 2;
    let dims = AttentionDims {
        lead: q.shape[..lead].to_vec(),
        kv_lead: k.shape[..lead].to_vec(),
        q_len: q.shape[lead],
        kv_len: k.shape[lead],
        head_dim: q.shape[lead + 1],
        value_dim: v.shape[lead + 1],
        bias: bias.map(|b| b.shape.clone()),
        query_runs: run_starts.map(TensorType::numel),
        key_blocks: None,
    };
    let dims = match kv_block {
        None => dims,
        Some(block) if block > 0 && dims.kv_len.is_multiple_of(block) => {
            let blocks = dims.kv_len / block;
            let dims = AttentionDims { key_blocks: Some(blocks), ..dims };
            if !dims.is_valid() {
                return Err(format!(
                    "kv_block = {block}: {blocks} blocks of keys must divide the {} queries and their {} runs, \
                     without a bias",
                    dims.q_len,
                    dims.runs().0
                ));
            }
            dims
        }
        Some(block) => return Err(format!("kv_block = {block} must divide the {} keys", dims.kv_len)),
    };
    if let Some(starts) = run_starts.filter(|s| s.rank() != 1 || !dims.is_valid()) {
        return Err(format!(
            "the queries' run starts must be i64[R] with R dividing the {} queries, got {starts}",
            dims.q_len
        ));
    }
    if k.shape[lead + 1] != dims.head_dim || v.shape[..=lead] != k.shape[..=lead] || !dims.is_valid() {
        return Err(format!(
            "needs q [.., Sq, D], k [.., Sk, D] and v [.., Sk, Dv] with k's and v's leading dims 1 or q's (and a bias \
             broadcasting to [.., Sq, Sk]), got {q}, {k}, {v}{}",
            bias.map(|b| format!(" and {b}")).unwrap_or_default()
        ));
    }
    Ok(dims)
}

fn attention(this: &Op, inputs: &[&TensorType], num_outputs: usize) -> Result<Vec<TensorType>, String> {
    let forward = matches!(this, Op::Attention { .. });
    let (base, outputs) = if forward { (3, 2) } else { (6, 3) };
    expect_arity(inputs, base, base + 2)?;
    if num_outputs != outputs {
        return Err(format!("has {num_outputs} outputs, expects {outputs}"));
    }
    let operands = attention_operands(forward, inputs);
    let with_bias = operands[0].is_some();
    if inputs.len() != base + usize::from(with_bias) + usize::from(operands[1].is_some()) {
        return Err("takes at most a float bias and the queries' i64 run starts beyond its operands".into());
    }
    let kv_block = match this {
        Op::Attention { kv_block, .. } | Op::AttentionGrad { kv_block, .. } => *kv_block,
        _ => None,
    };
    let dims = attention_dims(inputs[0], inputs[1], inputs[2], operands, kv_block)?;
    let dtype = inputs[0].dtype;
    let mut out = dims.lead.clone();
    out.extend([dims.q_len, dims.value_dim]);
    let out = TensorType::new(dtype, out);
    let lse = TensorType::new(autotp_kernels::attention::lse_dtype(dtype), out.shape[..out.rank() - 1].to_vec());
    if forward {
        return Ok(vec![out, lse]);
    }
    let at = 3 + usize::from(with_bias);
    let expected = [&out, &lse, &out];
    if inputs[at..].iter().zip(expected).any(|(got, want)| *got != want) {
        return Err(format!("out, lse and d_out must be {out}, {lse} and {out}"));
    }
    Ok(inputs[..3].iter().map(|&t| t.clone()).collect())
}

fn expect_arity(inputs: &[&TensorType], lo: usize, hi: usize) -> Result<(), String> {
    if inputs.len() < lo || inputs.len() > hi {
        let want = if lo == hi { format!("{lo}") } else { format!("{lo} to {hi}") };
        Err(format!("expects {want} inputs, got {}", inputs.len()))
    } else {
        Ok(())
    }
}

fn one(t: TensorType) -> Result<Vec<TensorType>, String> {
    Ok(vec![t])
}

fn axis_ok(axis: usize, rank: usize) -> Result<(), String> {
    if axis < rank {
        Ok(())
    } else {
        Err(format!("axis {axis} is out of range for rank {rank}"))
    }
}

/// The shape rule of constants, unary and binary ops (broadcasting), selects, casts, GELU.
fn elementwise(this: &Op, inputs: &[&TensorType], _num_outputs: usize) -> Result<Vec<TensorType>, String> {
    match this {
        Op::Constant { value } => {
            expect_arity(inputs, 0, 0)?;
            one(value.ty.clone())
        }
        Op::Unary(op) => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            if (op.is_logical() && t.dtype.is_float()) || (!op.is_logical() && t.dtype == DType::Bool) {
                return Err(format!("{} is not defined on {}", op.name(), t.dtype));
            }
            if op.needs_float() && !t.dtype.is_float() {
                return Err(format!("{} needs a floating-point input, got {}", op.name(), t.dtype));
            }
            one(t.clone())
        }
        Op::Binary(op) => {
            expect_arity(inputs, 2, 2)?;
            let (a, b) = (inputs[0], inputs[1]);
            if a.dtype != b.dtype {
                return Err(format!("operand dtypes differ: {} and {}", a.dtype, b.dtype));
            }
            if op.is_logical() && a.dtype.is_float() {
                return Err(format!("{} needs bool or integer operands, got {}", op.name(), a.dtype));
            }
            if a.dtype == DType::Bool && !op.is_logical() && *op != BinaryOp::Equal {
                return Err(format!("{} is not defined on bool", op.name()));
            }
            let shape = broadcast_shapes(&a.shape, &b.shape)
                .ok_or_else(|| format!("shapes {:?} and {:?} do not broadcast", a.shape, b.shape))?;
            let dtype = if op.is_comparison() { DType::Bool } else { a.dtype };
            one(TensorType::new(dtype, shape))
        }
        Op::Select => {
            expect_arity(inputs, 3, 3)?;
            let (c, x, y) = (inputs[0], inputs[1], inputs[2]);
            if c.dtype != DType::Bool {
                return Err(format!("condition must be bool, got {}", c.dtype));
            }
            if x.dtype != y.dtype {
                return Err(format!("branch dtypes differ: {} and {}", x.dtype, y.dtype));
            }
            let shape = broadcast_shapes(&c.shape, &x.shape)
                .and_then(|s| broadcast_shapes(&s, &y.shape))
                .ok_or_else(|| format!("shapes {:?}, {:?} and {:?} do not broadcast", c.shape, x.shape, y.shape))?;
            one(TensorType::new(x.dtype, shape))
        }
        Op::Cast { to } => {
            expect_arity(inputs, 1, 1)?;
            one(TensorType::new(*to, inputs[0].shape.clone()))
        }
        Op::Gelu { .. } => {
            expect_arity(inputs, 1, 1)?;
            float_only(inputs[0])?;
            one(inputs[0].clone())
        }
        _ => unreachable!("infer dispatches only this family's ops here"),
    }
}

/// The shape rule of reductions, matmuls, softmax, norms, cumulative sums, the losses.
fn reductions(this: &Op, inputs: &[&TensorType], num_outputs: usize) -> Result<Vec<TensorType>, String> {
    match this {
        Op::Reduce { op, axes, keep_dims } => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            if t.dtype == DType::Bool {
                return Err(format!("reduce_{} is not defined on bool", op.name()));
            }
            if axes.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("axes {axes:?} must be sorted and unique"));
            }
            for &a in axes {
                axis_ok(a, t.rank())?;
            }
            let shape = (0..t.rank())
                .filter_map(|d| match (axes.contains(&d), keep_dims) {
                    (false, _) => Some(t.shape[d]),
                    (true, true) => Some(1),
                    (true, false) => None,
                })
                .collect::<Vec<_>>();
            one(TensorType::new(t.dtype, shape))
        }
        Op::MatMul { transpose_lhs, transpose_rhs } => {
            expect_arity(inputs, 2, 2)?;
            let (a, b) = (inputs[0], inputs[1]);
            if a.dtype != b.dtype {
                return Err(format!("operand dtypes differ: {} and {}", a.dtype, b.dtype));
            }
            if a.rank() < 2 || b.rank() < 2 {
                return Err(format!("operands must have rank >= 2, got {} and {}", a.rank(), b.rank()));
            }
            let (ar, br) = (a.rank(), b.rank());
            let (m, ka) =
                if *transpose_lhs { (a.shape[ar - 1], a.shape[ar - 2]) } else { (a.shape[ar - 2], a.shape[ar - 1]) };
            let (kb, n) =
                if *transpose_rhs { (b.shape[br - 1], b.shape[br - 2]) } else { (b.shape[br - 2], b.shape[br - 1]) };
            if ka != kb {
                return Err(format!("contraction dims differ: {ka} and {kb} (shapes {:?} and {:?})", a.shape, b.shape));
            }
            let mut shape = broadcast_shapes(&a.shape[..ar - 2], &b.shape[..br - 2])
                .ok_or_else(|| format!("batch dims of {:?} and {:?} do not broadcast", a.shape, b.shape))?;
            shape.extend([m, n]);
            one(TensorType::new(a.dtype, shape))
        }
        Op::CumSum { axis, .. } => {
            expect_arity(inputs, 1, 1)?;
            axis_ok(*axis, inputs[0].rank())?;
            if inputs[0].dtype == DType::Bool {
                return Err("needs numbers, got bool".into());
            }
            one(inputs[0].clone())
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            axis_ok(*axis, t.rank())?;
            float_only(t)?;
            one(t.clone())
        }
        Op::LayerNorm { axis, .. } | Op::RmsNorm { axis, .. } => {
            let max = if matches!(this, Op::LayerNorm { .. }) { 3 } else { 2 };
            expect_arity(inputs, 2, max)?;
            let x = inputs[0];
            axis_ok(*axis, x.rank())?;
            float_only(x)?;
            for p in &inputs[1..] {
                if p.dtype != x.dtype || p.shape[..] != x.shape[*axis..] {
                    return Err(format!("scale/bias {p} must be {}{:?}", x.dtype, &x.shape[*axis..]));
                }
            }
            one(x.clone())
        }
        Op::CrossEntropy { reduction, .. } | Op::NllLoss { reduction, .. } => {
            expect_arity(inputs, 2, 3)?;
            let (scores, labels) = (inputs[0], inputs[1]);
            float_only(scores)?;
            check_index_dtype(labels.dtype)?;
            let mut expected = scores.shape.clone();
            if expected.len() < 2 {
                return Err(format!("scores must be [N, C, ...], got {:?}", scores.shape));
            }
            let classes = expected.remove(1);
            if labels.shape != expected {
                return Err(format!("labels {:?} must be {expected:?} for scores {:?}", labels.shape, scores.shape));
            }
            if let Some(weights) = inputs.get(2) {
                if weights.dtype != scores.dtype || weights.shape != [classes] {
                    return Err(format!("class weights {weights} must be {}[{classes}]", scores.dtype));
                }
            }
            let max_outputs = if matches!(this, Op::CrossEntropy { .. }) { 2 } else { 1 };
            if !(1..=max_outputs).contains(&num_outputs) {
                return Err(format!("has {num_outputs} outputs, expects at most {max_outputs}"));
            }
            let loss_shape = if *reduction == Reduction::None { expected } else { vec![] };
            let mut out = vec![TensorType::new(scores.dtype, loss_shape)];
            if num_outputs == 2 {
                out.push(scores.clone());
            }
            Ok(out)
        }
        _ => unreachable!("infer dispatches only this family's ops here"),
    }
}

/// The shape rule of reshapes, transposes, slices, concats, splits, expands, pads, triangles.
fn movement(this: &Op, inputs: &[&TensorType], num_outputs: usize) -> Result<Vec<TensorType>, String> {
    match this {
        Op::Reshape { shape } => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            let reshaped = TensorType::new(t.dtype, shape.clone());
            reshaped.check_limits()?;
            if reshaped.numel() != t.numel() {
                return Err(format!("cannot reshape {:?} ({} elements) to {shape:?}", t.shape, t.numel()));
            }
            one(reshaped)
        }
        Op::Transpose { perm } => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            let mut seen = perm.clone();
            seen.sort_unstable();
            if seen != (0..t.rank()).collect::<Vec<_>>() {
                return Err(format!("perm {perm:?} is not a permutation of rank {}", t.rank()));
            }
            one(TensorType::new(t.dtype, perm.iter().map(|&p| t.shape[p]).collect::<Vec<_>>()))
        }
        Op::Slice { starts, ends, steps } => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            if starts.len() != t.rank() || ends.len() != t.rank() || steps.len() != t.rank() {
                return Err(format!("needs one start, end and step per dimension (rank {})", t.rank()));
            }
            let mut shape = Vec::with_capacity(t.rank());
            for d in 0..t.rank() {
                shape.push(slice_len(starts[d], ends[d], steps[d], t.shape[d]).ok_or_else(|| {
                    format!(
                        "slice {}:{}:{} is invalid for dim {d} of size {}",
                        starts[d], ends[d], steps[d], t.shape[d]
                    )
                })?);
            }
            one(TensorType::new(t.dtype, shape))
        }
        Op::Concat { axis } => {
            if inputs.is_empty() {
                return Err("expects at least 1 input".into());
            }
            let first = inputs[0];
            axis_ok(*axis, first.rank())?;
            let mut shape = first.shape.clone();
            shape[*axis] = 0;
            for t in inputs {
                let same_other =
                    t.rank() == first.rank() && (0..t.rank()).all(|d| d == *axis || t.shape[d] == first.shape[d]);
                if t.dtype != first.dtype || !same_other {
                    return Err(format!("input {t} does not match {first} outside axis {axis}"));
                }
                shape[*axis] += t.shape[*axis];
            }
            one(TensorType::new(first.dtype, shape))
        }
        Op::Split { axis, sizes } => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            axis_ok(*axis, t.rank())?;
            if sizes.is_empty() {
                return Err("has no sizes: a split makes at least one output".into());
            }
            if sizes.iter().sum::<usize>() != t.shape[*axis] || sizes.len() != num_outputs {
                return Err(format!(
                    "sizes {sizes:?} do not split dim {axis} of size {} into {num_outputs} outputs",
                    t.shape[*axis]
                ));
            }
            Ok(sizes
                .iter()
                .map(|&s| {
                    let mut shape = t.shape.clone();
                    shape[*axis] = s;
                    TensorType::new(t.dtype, shape)
                })
                .collect())
        }
        Op::Expand { shape } => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            match broadcast_shapes(&t.shape, shape) {
                Some(s) if &s == shape => one(TensorType::new(t.dtype, shape.clone())),
                _ => Err(format!("cannot expand {:?} to {shape:?}", t.shape)),
            }
        }
        Op::Pad { begin, end, .. } => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            if begin.len() != t.rank() || end.len() != t.rank() {
                return Err(format!("needs one begin and end pad per dimension (rank {})", t.rank()));
            }
            let shape = (0..t.rank()).map(|d| t.shape[d] + begin[d] + end[d]).collect::<Vec<_>>();
            one(TensorType::new(t.dtype, shape))
        }
        Op::Triangle { .. } => {
            expect_arity(inputs, 1, 1)?;
            if inputs[0].rank() < 2 {
                return Err(format!("needs rank >= 2, got {}", inputs[0].rank()));
            }
            one(inputs[0].clone())
        }
        _ => unreachable!("infer dispatches only this family's ops here"),
    }
}

/// The shape rule of gathers, scatters and top-k.
fn indexing(this: &Op, inputs: &[&TensorType], num_outputs: usize) -> Result<Vec<TensorType>, String> {
    match this {
        Op::Gather { axis } => {
            expect_arity(inputs, 2, 2)?;
            let (data, idx) = (inputs[0], inputs[1]);
            axis_ok(*axis, data.rank())?;
            check_index_dtype(idx.dtype)?;
            let mut shape = data.shape[..*axis].to_vec();
            shape.extend(&idx.shape);
            shape.extend(&data.shape[axis + 1..]);
            one(TensorType::new(data.dtype, shape))
        }
        Op::ScatterAdd { axis, size } => {
            expect_arity(inputs, 2, 2)?;
            let (idx, updates) = (inputs[0], inputs[1]);
            check_index_dtype(idx.dtype)?;
            float_only(updates)?;
            if updates.rank() < axis + idx.rank() || updates.shape[*axis..axis + idx.rank()] != idx.shape[..] {
                return Err(format!("updates {:?} must hold indices {:?} at dim {axis}", updates.shape, idx.shape));
            }
            let mut shape = updates.shape[..*axis].to_vec();
            shape.push(*size);
            shape.extend(&updates.shape[axis + idx.rank()..]);
            one(TensorType::new(updates.dtype, shape))
        }
        Op::GatherElements { axis } => {
            expect_arity(inputs, 2, 2)?;
            let (data, idx) = (inputs[0], inputs[1]);
            axis_ok(*axis, data.rank())?;
            check_index_dtype(idx.dtype)?;
            if idx.rank() != data.rank() {
                return Err(format!("indices rank {} differs from data rank {}", idx.rank(), data.rank()));
            }
            if (0..data.rank()).any(|d| d != *axis && idx.shape[d] > data.shape[d]) {
                return Err(format!("indices {:?} exceed data {:?} outside axis {axis}", idx.shape, data.shape));
            }
            one(TensorType::new(data.dtype, idx.shape.clone()))
        }
        Op::GatherNd => {
            expect_arity(inputs, 2, 2)?;
            let (data, idx) = (inputs[0], inputs[1]);
            check_index_dtype(idx.dtype)?;
            let k = *idx.shape.last().ok_or("needs indices of rank 1 or more")?;
            if k > data.rank() {
                return Err(format!("indices pick {k} dims of a rank-{} tensor", data.rank()));
            }
            let mut shape = idx.shape[..idx.rank() - 1].to_vec();
            shape.extend(&data.shape[k..]);
            one(TensorType::new(data.dtype, shape))
        }
        Op::ScatterNd { .. } => {
            expect_arity(inputs, 3, 3)?;
            let (data, idx, updates) = (inputs[0], inputs[1], inputs[2]);
            check_index_dtype(idx.dtype)?;
            let k = *idx.shape.last().ok_or("needs indices of rank 1 or more")?;
            let mut want = idx.shape[..idx.rank() - 1].to_vec();
            if k <= data.rank() {
                want.extend(&data.shape[k..]);
            }
            if k > data.rank() || updates.shape != want || updates.dtype != data.dtype {
                return Err(format!("updates {updates} do not fit indices {:?} into data {data}", idx.shape));
            }
            one(data.clone())
        }
        Op::ScatterElements { axis, size } => {
            expect_arity(inputs, 2, 2)?;
            let (idx, updates) = (inputs[0], inputs[1]);
            axis_ok(*axis, updates.rank())?;
            check_index_dtype(idx.dtype)?;
            float_only(updates)?;
            if idx.shape != updates.shape {
                return Err(format!("indices {:?} and updates {:?} differ in shape", idx.shape, updates.shape));
            }
            let mut shape = updates.shape.clone();
            shape[*axis] = *size;
            one(TensorType::new(updates.dtype, shape))
        }
        Op::TopK { axis, k, .. } => {
            expect_arity(inputs, 1, 1)?;
            let t = inputs[0];
            axis_ok(*axis, t.rank())?;
            if t.dtype == DType::Bool {
                return Err("needs numbers, got bool".into());
            }
            if *k > t.shape[*axis] {
                return Err(format!("k = {k} exceeds the {} elements along axis {axis}", t.shape[*axis]));
            }
            let mut shape = t.shape.clone();
            shape[*axis] = *k;
            if num_outputs != 2 {
                return Err(format!("has 2 outputs (values, indices), got {num_outputs}"));
            }
            Ok(vec![TensorType::new(t.dtype, shape.clone()), TensorType::new(DType::I64, shape)])
        }
        _ => unreachable!("infer dispatches only this family's ops here"),
    }
}

/// The shape rule of optimizer updates, collectives and pipeline messages.
fn training(this: &Op, inputs: &[&TensorType], num_outputs: usize) -> Result<Vec<TensorType>, String> {
    match this {
        Op::AdamW { .. } | Op::Sgd { .. } => {
            // AdamW: param, grad, m, v + lr, step. SGD: param, grad, buffer + lr.
            let (tensors, scalars, outputs) = if matches!(this, Op::AdamW { .. }) { (4, 2, 3) } else { (3, 1, 2) };
            expect_arity(inputs, tensors + scalars, tensors + scalars)?;
            let p = inputs[0];
            float_only(p)?;
            if let Some(t) = inputs[1..tensors].iter().find(|t| **t != p) {
                return Err(format!("gradient and state must match the parameter {p}, got {t}"));
            }
            if let Some(t) = inputs[tensors..].iter().find(|t| t.dtype != p.dtype || t.rank() != 0) {
                return Err(format!("learning rate and step must be {} scalars, got {t}", p.dtype));
            }
            if num_outputs != outputs {
                return Err(format!("has {num_outputs} outputs, expects {outputs}"));
            }
            Ok(vec![p.clone(); outputs])
        }
        Op::Collective { kind, .. } => {
            expect_arity(inputs, 1, 1)?;
            for (_, dim) in kind.dims() {
                axis_ok(dim, inputs[0].rank())?;
            }
            one(inputs[0].clone())
        }
        Op::Wait => {
            expect_arity(inputs, 1, 1)?;
            one(inputs[0].clone())
        }
        Op::Send { .. } => {
            expect_arity(inputs, 1, 1)?;
            if num_outputs != 0 {
                return Err(format!("has {num_outputs} outputs, expects none"));
            }
            Ok(vec![])
        }
        Op::Recv { ty, .. } => {
            expect_arity(inputs, 0, 0)?;
            one(ty.clone())
        }
        _ => unreachable!("infer dispatches only this family's ops here"),
    }
}
