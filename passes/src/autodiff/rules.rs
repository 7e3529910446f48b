//! The vector-Jacobian product of every differentiable op ([`vjp`]), written with IR ops
//! through the backward builder; the larger rules have functions of their own.

use autotp_ir::{BinaryOp, DType, GeluApprox, Op, ReduceOp, Reduction, ScatterReduction, Tensor, UnaryOp, ValueId};

use super::{B, PASS};
use crate::PassError;

pub(super) fn no_gradient(op: &Op, detail: &str) -> PassError {
    PassError::NoGradient { pass: PASS, op: op.name(), detail: format!(" {detail}") }
}

/// The gradient of a unary op's input: `d` times the op's derivative at `x0` (or from its
/// output `y0` where that is cheaper); `None` where it is zero almost everywhere.
fn unary_vjp(b: &mut B, u: UnaryOp, x0: ValueId, y0: ValueId, d: ValueId) -> Result<Option<ValueId>, PassError> {
    let dtype = b.ty(x0).dtype;
    Ok(match u {
        UnaryOp::Neg => Some(b.un(UnaryOp::Neg, d)?),
        UnaryOp::Abs => {
            let s = b.un(UnaryOp::Sign, x0)?;
            Some(b.mul(d, s)?)
        }
        UnaryOp::Exp => Some(b.mul(d, y0)?),
        UnaryOp::Log => Some(b.div(d, x0)?),
        UnaryOp::Sqrt => {
            let half = b.scale(d, 0.5)?;
            Some(b.div(half, y0)?)
        }
        UnaryOp::Rsqrt => {
            let y2 = b.mul(y0, y0)?;
            let y3 = b.mul(y2, y0)?;
            let t = b.mul(d, y3)?;
            Some(b.scale(t, -0.5)?)
        }
        UnaryOp::Reciprocal => {
            let y2 = b.mul(y0, y0)?;
            let t = b.mul(d, y2)?;
            Some(b.un(UnaryOp::Neg, t)?)
        }
        UnaryOp::Tanh => {
            let y2 = b.mul(y0, y0)?;
            let one = b.scalar(dtype, 1.0)?;
            let g = b.sub(one, y2)?;
            Some(b.mul(d, g)?)
        }
        UnaryOp::Erf => {
            let x2 = b.mul(x0, x0)?;
            let nx2 = b.un(UnaryOp::Neg, x2)?;
            let e = b.un(UnaryOp::Exp, nx2)?;
            let g = b.scale(e, 2.0 / std::f64::consts::PI.sqrt())?;
            Some(b.mul(d, g)?)
        }
        UnaryOp::Sigmoid => {
            let one = b.scalar(dtype, 1.0)?;
            let om = b.sub(one, y0)?;
            let g = b.mul(y0, om)?;
            Some(b.mul(d, g)?)
        }
        UnaryOp::Softplus => {
            let s = b.un(UnaryOp::Sigmoid, x0)?;
            Some(b.mul(d, s)?)
        }
        UnaryOp::Relu => {
            let zero = b.scalar(dtype, 0.0)?;
            let pos = b.bin(BinaryOp::Greater, x0, zero)?;
            Some(b.mask(pos, d, false)?)
        }
        UnaryOp::Sin => {
            let c = b.un(UnaryOp::Cos, x0)?;
            Some(b.mul(d, c)?)
        }
        UnaryOp::Cos => {
            let s = b.un(UnaryOp::Sin, x0)?;
            let t = b.mul(d, s)?;
            Some(b.un(UnaryOp::Neg, t)?)
        }
        // Piecewise constant: zero gradient almost everywhere.
        UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::Sign | UnaryOp::FiniteZero => None,
        UnaryOp::Not => None,
    })
}

/// The gradients of a binary op's operands `a` and `c` (broadcasting undone by `sum_to`),
/// given its output `y0` and output gradient `d`; only those with `want` are made.
fn binary_vjp(
    b: &mut B,
    op: &BinaryOp,
    [a, c]: [ValueId; 2],
    y0: ValueId,
    d: ValueId,
    want: &[bool],
) -> Result<[Option<ValueId>; 2], PassError> {
    let (sa, sc) = (b.ty(a).shape, b.ty(c).shape);
    let (da, dc) = match op {
        BinaryOp::Add => (Some(d), Some(d)),
        BinaryOp::Sub => (Some(d), if want[1] { Some(b.un(UnaryOp::Neg, d)?) } else { None }),
        BinaryOp::Mul => {
            let da = if want[0] { Some(b.mul(d, c)?) } else { None };
            let dc = if want[1] { Some(b.mul(d, a)?) } else { None };
            (da, dc)
        }
        BinaryOp::Div => {
            let da = if want[0] { Some(b.div(d, c)?) } else { None };
            let dc = if want[1] {
                let t = b.mul(d, y0)?;
                let t = b.div(t, c)?;
                Some(b.un(UnaryOp::Neg, t)?)
            } else {
                None
            };
            (da, dc)
        }
        BinaryOp::Pow => {
            let da = if want[0] {
                let one = b.scalar(b.ty(c).dtype, 1.0)?;
                let cm1 = b.sub(c, one)?;
                let p = b.bin(BinaryOp::Pow, a, cm1)?;
                let t = b.mul(p, c)?;
                Some(b.mul(d, t)?)
            } else {
                None
            };
            let dc = if want[1] {
                let l = b.un(UnaryOp::Log, a)?;
                let t = b.mul(y0, l)?;
                Some(b.mul(d, t)?)
            } else {
                None
            };
            (da, dc)
        }
        BinaryOp::Max | BinaryOp::Min => {
            let cmp = if *op == BinaryOp::Max { BinaryOp::GreaterEqual } else { BinaryOp::LessEqual };
            let pick_a = b.bin(cmp, a, c)?;
            let da = if want[0] { Some(b.mask(pick_a, d, false)?) } else { None };
            let dc = if want[1] { Some(b.mask(pick_a, d, true)?) } else { None };
            (da, dc)
        }
        BinaryOp::Mod => {
            if want[1] {
                return Err(no_gradient(&Op::Binary(*op), "with respect to the divisor"));
            }
            (Some(d), None)
        }
        _ => (None, None),
    };
    let da = if want[0] { da.map(|g| b.sum_to(g, &sa)).transpose()? } else { None };
    let dc = if want[1] { dc.map(|g| b.sum_to(g, &sc)).transpose()? } else { None };
    Ok([da, dc])
}

/// The gradient of a reduction's input `x0` (output `y0`, output gradient `d`): the gradient
/// spread back over the reduced `axes` (shared equally by ties of a max or min).
fn reduce_vjp(
    b: &mut B,
    r: ReduceOp,
    axes: &[usize],
    keep_dims: bool,
    [x0, y0, d]: [ValueId; 3],
) -> Result<ValueId, PassError> {
    let xs = b.ty(x0).shape;
    let kept: Vec<usize> = (0..xs.len()).map(|i| if axes.contains(&i) { 1 } else { xs[i] }).collect();
    let dk = if keep_dims { d } else { b.reshape(d, &kept)? };
    let count: usize = axes.iter().map(|&a| xs[a]).product();
    Ok(match r {
        ReduceOp::Sum => b.expand(dk, &xs)?,
        ReduceOp::Mean => {
            let e = b.expand(dk, &xs)?;
            b.scale(e, 1.0 / count as f64)?
        }
        ReduceOp::Max | ReduceOp::Min => {
            // Ties share the gradient equally, as torch.amax/amin.
            let yk = if keep_dims { y0 } else { b.reshape(y0, &kept)? };
            let hit = b.bin(BinaryOp::Equal, x0, yk)?;
            let dtype = b.ty(x0).dtype;
            let hit = b.op(Op::Cast { to: dtype }, vec![hit])?;
            let n = b.reduce(ReduceOp::Sum, hit, axes.to_vec(), true)?;
            let share = b.div(dk, n)?;
            b.mul(hit, share)?
        }
        ReduceOp::Prod => {
            let yk = if keep_dims { y0 } else { b.reshape(y0, &kept)? };
            let t = b.mul(dk, yk)?;
            b.div(t, x0)?
        }
    })
}

/// The gradients of a matmul's operands `a` and `c` (`op(A) op(B)`, the transposes `ta`,
/// `tb`) for its output gradient `d`; only those with `want` are made.
fn matmul_vjp(
    b: &mut B,
    [a, c]: [ValueId; 2],
    d: ValueId,
    (ta, tb): (bool, bool),
    want: &[bool],
) -> Result<[Option<ValueId>; 2], PassError> {
    let mut out = [None, None];
    if want[0] {
        // d op(A) = dY op(B)^T
        let g = if ta {
            b.op(Op::MatMul { transpose_lhs: tb, transpose_rhs: true }, vec![c, d])?
        } else {
            b.op(Op::MatMul { transpose_lhs: false, transpose_rhs: !tb }, vec![d, c])?
        };
        out[0] = Some(b.sum_to(g, &b.ty(a).shape)?);
    }
    let (rank_a, rank_c) = (b.ty(a).rank(), b.ty(c).rank());
    if want[1] && rank_c == 2 && rank_a > 2 && !ta {
        // One B for every batch of A (a linear layer): its gradient sums op(A)^T dY over
        // the batches, which is one product with the batches merged into the
        // contraction, `[batch x m, k]^T [batch x m, n]`, not a batched product summed.
        let (sa, sd) = (b.ty(a).shape, b.ty(d).shape);
        let rows = sa[..rank_a - 1].iter().product::<usize>();
        let a_rows = b.reshape(a, &[rows, sa[rank_a - 1]])?;
        let d_rows = b.reshape(d, &[rows, sd[sd.len() - 1]])?;
        let (lhs, rhs) = if tb { (d_rows, a_rows) } else { (a_rows, d_rows) };
        out[1] = Some(b.op(Op::MatMul { transpose_lhs: true, transpose_rhs: false }, vec![lhs, rhs])?);
    } else if want[1] {
        // d op(B) = op(A)^T dY
        let g = if tb {
            b.op(Op::MatMul { transpose_lhs: true, transpose_rhs: ta }, vec![d, a])?
        } else {
            b.op(Op::MatMul { transpose_lhs: !ta, transpose_rhs: false }, vec![a, d])?
        };
        out[1] = Some(b.sum_to(g, &b.ty(c).shape)?);
    }
    Ok(out)
}

/// The gradient of a slice's input `x0` (output `y0`, output gradient `d`): strided dims
/// spread first, then the unit-step slice padded back with zeros.
fn slice_vjp(b: &mut B, starts: &[usize], steps: &[i64], [x0, y0, d]: [ValueId; 3]) -> Result<ValueId, PassError> {
    let (xs, ys) = (b.ty(x0).shape, b.ty(y0).shape);
    let mut g = d;
    // Strided and reversed dims first, one at a time: each spreads its gradient to
    // every `step`-th position (in forward order), leaving it a unit-step slice.
    let mut first = starts.to_vec();
    for dim in 0..xs.len() {
        if steps[dim] != 1 && ys[dim] > 0 {
            (g, first[dim]) = b.unstride(g, dim, starts[dim], steps[dim], xs[dim])?;
        }
    }
    let gs = b.ty(g).shape;
    let end: Vec<usize> = (0..xs.len()).map(|i| xs[i] - first[i] - gs[i]).collect();
    Ok(if first.iter().all(|&f| f == 0) && end.iter().all(|&e| e == 0) {
        g
    } else {
        b.op(Op::Pad { begin: first, end, value: 0.0 }, vec![g])?
    })
}

/// The gradient of `gather_elements`' data (of `data_value`, read at `index` along `axis`): the
/// output gradient `d` scattered back to the positions read.
fn gather_elements_vjp(b: &mut B, axis: usize, [data_value, index, d]: [ValueId; 3]) -> Result<ValueId, PassError> {
    // Scatter back to the index's positions; data larger than the indices outside
    // `axis` gets zeros there.
    let data = b.ty(data_value).shape;
    let g = b.op(Op::ScatterElements { axis, size: data[axis] }, vec![index, d])?;
    let scattered = b.ty(g).shape;
    Ok(if scattered == data {
        g
    } else {
        let end: Vec<usize> = data.iter().zip(&scattered).map(|(d, s)| d - s).collect();
        b.op(Op::Pad { begin: vec![0; data.len()], end, value: 0.0 }, vec![g])?
    })
}

/// The gradients of `scatter_nd`'s data and updates (`x`: data, indices, updates) for its
/// output gradient `d`: overwritten elements take nothing from the data, each update its
/// gradient's element; only those with `want` are made.
fn scatter_nd_vjp(
    b: &mut B,
    reduction: ScatterReduction,
    x: &[ValueId],
    d: ValueId,
    want: &[bool],
) -> Result<[Option<ValueId>; 3], PassError> {
    let mut out = [None, None, None];
    match reduction {
        ScatterReduction::None | ScatterReduction::Add => {}
        _ => return Err(no_gradient(&Op::ScatterNd { reduction }, &format!("with reduction {}", reduction.name()))),
    }
    if want[0] {
        out[0] = Some(if reduction == ScatterReduction::Add {
            d
        } else {
            // Overwritten elements take nothing from the data.
            let t = b.ty(x[2]);
            let zeros = b.full(t.dtype, &t.shape, 0.0)?;
            b.op(Op::ScatterNd { reduction: ScatterReduction::None }, vec![d, x[1], zeros])?
        });
    }
    if want[2] {
        out[2] = Some(b.op(Op::GatherNd, vec![d, x[1]])?);
    }
    Ok(out)
}

/// The gradients of a concat's inputs `x` along `axis`: each its slice of the output
/// gradient `d`; only those with `want` are made.
fn concat_vjp(
    b: &mut B,
    axis: usize,
    x: &[ValueId],
    d: ValueId,
    want: &[bool],
) -> Result<Vec<Option<ValueId>>, PassError> {
    let mut out = vec![None; x.len()];
    let ds = b.ty(d).shape;
    let mut at = 0;
    for (i, &xi) in x.iter().enumerate() {
        let len = b.ty(xi).shape[axis];
        if want[i] {
            let mut starts = vec![0; ds.len()];
            let mut ends: Vec<i64> = ds.iter().map(|&v| v as i64).collect();
            starts[axis] = at;
            ends[axis] = (at + len) as i64;
            out[i] = Some(b.op(Op::Slice { starts, ends, steps: vec![1; ds.len()] }, vec![d])?);
        }
        at += len;
    }
    Ok(out)
}

/// The gradients of a node's inputs, given its inputs `x`, outputs `y` and output gradients
/// `dy` (`None` where an output gets none). Only inputs with `want[i]` need a result.
pub(super) fn vjp(
    b: &mut B,
    op: &Op,
    x: &[ValueId],
    y: &[ValueId],
    dy: &[Option<ValueId>],
    want: &[bool],
) -> Result<Vec<Option<ValueId>>, PassError> {
    let mut out = vec![None; x.len()];
    // Multi-output ops handle missing output gradients themselves; the rest have one output.
    let d = match op {
        Op::Split { .. } | Op::CrossEntropy { .. } | Op::TopK { .. } | Op::Attention { .. } => None,
        _ => Some(dy[0].expect("the caller skips nodes without output gradients")),
    };
    let d0 = || d.expect("single-output op");
    let shape = |b: &B, v: ValueId| b.ty(v).shape;
    match op {
        Op::Constant { .. } => {}
        Op::Unary(u) => out[0] = unary_vjp(b, *u, x[0], y[0], d0())?,
        Op::Binary(op) => [out[0], out[1]] = binary_vjp(b, op, [x[0], x[1]], y[0], d0(), want)?,
        Op::Select => {
            let (cond, d) = (x[0], d0());
            if want[1] {
                let g = b.mask(cond, d, false)?;
                out[1] = Some(b.sum_to(g, &shape(b, x[1]))?);
            }
            if want[2] {
                let g = b.mask(cond, d, true)?;
                out[2] = Some(b.sum_to(g, &shape(b, x[2]))?);
            }
        }
        Op::Cast { .. } => {
            let to = b.ty(x[0]).dtype;
            out[0] = Some(b.op(Op::Cast { to }, vec![d0()])?);
        }
        Op::Reduce { op: r, axes, keep_dims } => {
            out[0] = Some(reduce_vjp(b, *r, axes, *keep_dims, [x[0], y[0], d0()])?)
        }
        Op::MatMul { transpose_lhs: ta, transpose_rhs: tb } => {
            [out[0], out[1]] = matmul_vjp(b, [x[0], x[1]], d0(), (*ta, *tb), want)?;
        }
        Op::Reshape { .. } => out[0] = Some(b.reshape(d0(), &shape(b, x[0]))?),
        Op::Transpose { perm } => {
            out[0] = Some(b.op(Op::Transpose { perm: crate::inverse_permutation(perm) }, vec![d0()])?);
        }
        Op::Slice { starts, steps, .. } => out[0] = Some(slice_vjp(b, starts, steps, [x[0], y[0], d0()])?),
        Op::Concat { axis } => out = concat_vjp(b, *axis, x, d0(), want)?,
        Op::Split { axis, .. } => {
            let mut parts = Vec::with_capacity(y.len());
            for (yi, dyi) in y.iter().zip(dy) {
                parts.push(match dyi {
                    Some(g) => *g,
                    None => {
                        let t = b.ty(*yi);
                        b.full(t.dtype, &t.shape, 0.0)?
                    }
                });
            }
            out[0] = Some(b.op(Op::Concat { axis: *axis }, parts)?);
        }
        Op::Expand { .. } => out[0] = Some(b.sum_to(d0(), &shape(b, x[0]))?),
        Op::Gather { axis } => {
            if want[0] {
                let size = shape(b, x[0])[*axis];
                out[0] = Some(b.op(Op::ScatterAdd { axis: *axis, size }, vec![x[1], d0()])?);
            }
        }
        Op::ScatterAdd { axis, .. } => {
            if want[1] {
                out[1] = Some(b.op(Op::Gather { axis: *axis }, vec![d0(), x[0]])?);
            }
        }
        Op::GatherElements { axis } => {
            if want[0] {
                out[0] = Some(gather_elements_vjp(b, *axis, [x[0], x[1], d0()])?);
            }
        }
        Op::GatherNd => {
            if want[0] {
                let t = b.ty(x[0]);
                let zeros = b.full(t.dtype, &t.shape, 0.0)?;
                let op = Op::ScatterNd { reduction: ScatterReduction::Add };
                out[0] = Some(b.op(op, vec![zeros, x[1], d0()])?);
            }
        }
        Op::ScatterNd { reduction } => [out[0], out[1], out[2]] = scatter_nd_vjp(b, *reduction, x, d0(), want)?,
        Op::ScatterElements { axis, .. } => {
            if want[1] {
                out[1] = Some(b.op(Op::GatherElements { axis: *axis }, vec![d0(), x[0]])?);
            }
        }
        // The chosen elements' gradients go back to where they were chosen from.
        Op::TopK { axis, .. } => {
            if let (Some(d), true) = (dy[0], want[0]) {
                let len = shape(b, x[0])[*axis];
                out[0] = Some(b.op(Op::ScatterElements { axis: *axis, size: len }, vec![y[1], d])?);
            }
        }
        Op::Pad { begin, .. } => {
            let xs = shape(b, x[0]);
            let ends = (0..xs.len()).map(|i| (begin[i] + xs[i]) as i64).collect();
            out[0] = Some(b.op(Op::Slice { starts: begin.clone(), ends, steps: vec![1; xs.len()] }, vec![d0()])?);
        }
        // Optimizer updates come after differentiation; nothing flows back through them.
        Op::AdamW { .. } | Op::Sgd { .. } => return Err(no_gradient(op, "(optimizer updates are not differentiable)")),
        Op::Collective { .. } | Op::Wait => {
            return Err(no_gradient(op, "(sharding passes run after autodiff, on the whole training step)"))
        }
        Op::Send { .. } | Op::Recv { .. } => {
            return Err(no_gradient(op, "(the pipeline pass differentiates each stage before it adds them)"))
        }
        Op::Triangle { upper, k } => out[0] = Some(b.op(Op::Triangle { upper: *upper, k: *k }, vec![d0()])?),
        // Each input adds to the sums after it (before it, reversed): the gradient runs the
        // other way.
        Op::CumSum { axis, exclusive, reverse } => {
            out[0] = Some(b.op(Op::CumSum { axis: *axis, exclusive: *exclusive, reverse: !*reverse }, vec![d0()])?)
        }
        Op::Softmax { axis } => {
            let (y0, d) = (y[0], d0());
            let dyy = b.mul(d, y0)?;
            let s = b.reduce(ReduceOp::Sum, dyy, vec![*axis], true)?;
            let t = b.sub(d, s)?;
            out[0] = Some(b.mul(y0, t)?);
        }
        Op::LogSoftmax { axis } => {
            let (y0, d) = (y[0], d0());
            let p = b.un(UnaryOp::Exp, y0)?;
            let s = b.reduce(ReduceOp::Sum, d, vec![*axis], true)?;
            let t = b.mul(p, s)?;
            out[0] = Some(b.sub(d, t)?);
        }
        // The backward recomputes the probabilities from the log-sum-exp (FlashAttention-2); the
        // log-sum-exp itself is only ever read by it.
        Op::Attention { scale, mask, kv_block } => {
            if want.get(3) == Some(&true) {
                return Err(no_gradient(op, "for its bias (attention is fused only with a bias that needs none)"));
            }
            if let Some(d_out) = dy[0] {
                // The queries' run starts, where given, stay the last input.
                let run_starts = x.last().copied().filter(|&s| x.len() > 3 && b.ty(s).dtype == DType::I64);
                let mut inputs = x[..x.len() - usize::from(run_starts.is_some())].to_vec();
                inputs.extend([y[0], y[1], d_out]);
                inputs.extend(run_starts);
                let grads = b.ops(Op::AttentionGrad { scale: *scale, mask: *mask, kv_block: *kv_block }, inputs, 3)?;
                out[..3].iter_mut().zip(grads).for_each(|(o, g)| *o = Some(g));
            }
        }
        Op::AttentionGrad { .. } => return Err(no_gradient(op, "(a backward op is not differentiated again)")),
        Op::LayerNorm { axis, eps } => layer_norm_vjp(b, x, d0(), *axis, *eps, want, &mut out)?,
        Op::RmsNorm { axis, eps } => rms_norm_vjp(b, x, d0(), *axis, *eps, want, &mut out)?,
        Op::Gelu { approx } => out[0] = Some(gelu_vjp(b, x[0], d0(), *approx)?),
        Op::CrossEntropy { ignore_index, reduction } | Op::NllLoss { ignore_index, reduction } => {
            if want[0] {
                out[0] = Some(class_loss_vjp(b, op, x, y, dy, *ignore_index, *reduction)?);
            }
            if x.len() == 3 && want[2] {
                return Err(no_gradient(op, "with respect to class weights"));
            }
        }
    }
    Ok(out)
}

fn norm_axes(b: &B, x: ValueId, axis: usize) -> Vec<usize> {
    (axis..b.ty(x).rank()).collect()
}

/// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))` with `g = dy * scale`.
fn layer_norm_vjp(
    b: &mut B,
    x: &[ValueId],
    d: ValueId,
    axis: usize,
    eps: f64,
    want: &[bool],
    out: &mut [Option<ValueId>],
) -> Result<(), PassError> {
    let (x0, scale) = (x[0], x[1]);
    let axes = norm_axes(b, x0, axis);
    let dtype = b.ty(x0).dtype;
    let mean = b.reduce(ReduceOp::Mean, x0, axes.clone(), true)?;
    let xc = b.sub(x0, mean)?;
    let sq = b.mul(xc, xc)?;
    let var = b.reduce(ReduceOp::Mean, sq, axes.clone(), true)?;
    let e = b.scalar(dtype, eps)?;
    let ve = b.add(var, e)?;
    let rstd = b.un(UnaryOp::Rsqrt, ve)?;
    let xhat = b.mul(xc, rstd)?;
    if want[0] {
        let g = b.mul(d, scale)?;
        let mg = b.reduce(ReduceOp::Mean, g, axes.clone(), true)?;
        let gx = b.mul(g, xhat)?;
        let mgx = b.reduce(ReduceOp::Mean, gx, axes.clone(), true)?;
        let t = b.sub(g, mg)?;
        let u = b.mul(xhat, mgx)?;
        let t = b.sub(t, u)?;
        out[0] = Some(b.mul(rstd, t)?);
    }
    if want[1] {
        let t = b.mul(d, xhat)?;
        out[1] = Some(b.sum_to(t, &b.ty(scale).shape)?);
    }
    if x.len() == 3 && want[2] {
        out[2] = Some(b.sum_to(d, &b.ty(x[2]).shape)?);
    }
    Ok(())
}

/// `y = x * r * w` with `r = 1 / sqrt(mean(x^2) + eps)`:
/// `dx = r * g - x * r^3 * mean(g * x)` with `g = dy * w`; `dw = sum(dy * x * r)`.
fn rms_norm_vjp(
    b: &mut B,
    x: &[ValueId],
    d: ValueId,
    axis: usize,
    eps: f64,
    want: &[bool],
    out: &mut [Option<ValueId>],
) -> Result<(), PassError> {
    let (x0, w) = (x[0], x[1]);
    let axes = norm_axes(b, x0, axis);
    let dtype = b.ty(x0).dtype;
    let sq = b.mul(x0, x0)?;
    let ms = b.reduce(ReduceOp::Mean, sq, axes.clone(), true)?;
    let e = b.scalar(dtype, eps)?;
    let mse = b.add(ms, e)?;
    let r = b.un(UnaryOp::Rsqrt, mse)?;
    if want[0] {
        let g = b.mul(d, w)?;
        let gx = b.mul(g, x0)?;
        let mgx = b.reduce(ReduceOp::Mean, gx, axes.clone(), true)?;
        let r2 = b.mul(r, r)?;
        let r3 = b.mul(r2, r)?;
        let t = b.mul(x0, r3)?;
        let t = b.mul(t, mgx)?;
        let rg = b.mul(r, g)?;
        out[0] = Some(b.sub(rg, t)?);
    }
    if want[1] {
        let xr = b.mul(x0, r)?;
        let t = b.mul(d, xr)?;
        out[1] = Some(b.sum_to(t, &b.ty(w).shape)?);
    }
    Ok(())
}

fn gelu_vjp(b: &mut B, x: ValueId, d: ValueId, approx: GeluApprox) -> Result<ValueId, PassError> {
    let dtype = b.ty(x).dtype;
    let one = b.scalar(dtype, 1.0)?;
    let g = match approx {
        GeluApprox::None => {
            // Phi(x) + x * phi(x)
            let xs = b.scale(x, std::f64::consts::FRAC_1_SQRT_2)?;
            let erf = b.un(UnaryOp::Erf, xs)?;
            let cdf = b.add(one, erf)?;
            let cdf = b.scale(cdf, 0.5)?;
            let x2 = b.mul(x, x)?;
            let e = b.scale(x2, -0.5)?;
            let e = b.un(UnaryOp::Exp, e)?;
            let pdf = b.scale(e, 1.0 / (2.0 * std::f64::consts::PI).sqrt())?;
            let xpdf = b.mul(x, pdf)?;
            b.add(cdf, xpdf)?
        }
        GeluApprox::Tanh => {
            // 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2), t = tanh(c (x + a x^3))
            let (c, a) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
            let x2 = b.mul(x, x)?;
            let x3 = b.mul(x2, x)?;
            let ax3 = b.scale(x3, a)?;
            let inner = b.add(x, ax3)?;
            let u = b.scale(inner, c)?;
            let t = b.un(UnaryOp::Tanh, u)?;
            let opt = b.add(one, t)?;
            let left = b.scale(opt, 0.5)?;
            let t2 = b.mul(t, t)?;
            let omt2 = b.sub(one, t2)?;
            let ax2 = b.scale(x2, 3.0 * a)?;
            let du = b.add(one, ax2)?;
            let du = b.scale(du, c)?;
            let right = b.mul(omt2, du)?;
            let right = b.mul(x, right)?;
            let right = b.scale(right, 0.5)?;
            b.add(left, right)?
        }
    };
    b.mul(d, g)
}

/// Gradient of cross-entropy (w.r.t. scores) or NLL (w.r.t. log-probabilities).
/// Position `i` with label `t` and weight `w_t` (0 when ignored) contributes `coef_i =
/// w_t * dy_i` (divided by the summed weights for a mean); then
/// cross-entropy: `dscores = (softmax(scores) - onehot) * coef`, NLL: `dlp = -onehot * coef`.
fn class_loss_vjp(
    b: &mut B,
    op: &Op,
    x: &[ValueId],
    y: &[ValueId],
    dy: &[Option<ValueId>],
    ignore_index: Option<i64>,
    reduction: Reduction,
) -> Result<ValueId, PassError> {
    let (scores, labels) = (x[0], x[1]);
    let st = b.ty(scores);
    let (dtype, classes) = (st.dtype, st.shape[1]);
    let lt = b.ty(labels);
    let mut unsq = lt.shape.clone();
    unsq.insert(1, 1);
    // Valid positions, and labels made safe to gather with (ignored ones point at class 0).
    let valid = match ignore_index {
        Some(ii) => {
            let ii = b.op(Op::Constant { value: Tensor::full(lt.dtype, vec![], ii as f64) }, vec![])?;
            let eq = b.bin(BinaryOp::Equal, labels, ii)?;
            Some(b.un(UnaryOp::Not, eq)?)
        }
        None => None,
    };
    let safe_labels = match valid {
        Some(v) => {
            let zero = b.op(Op::Constant { value: Tensor::full(lt.dtype, vec![], 0.0) }, vec![])?;
            b.op(Op::Select, vec![v, labels, zero])?
        }
        None => labels,
    };
    let mut weight = match x.get(2) {
        Some(&w) => b.op(Op::Gather { axis: 0 }, vec![w, safe_labels])?,
        None => b.full(dtype, &lt.shape, 1.0)?,
    };
    if let Some(v) = valid {
        weight = b.mask(v, weight, false)?;
    }
    let mut coef = match dy[0] {
        Some(d) => b.mul(weight, d)?,
        None => b.full(dtype, &lt.shape, 0.0)?,
    };
    if reduction == Reduction::Mean {
        let all: Vec<usize> = (0..lt.shape.len()).collect();
        let total = b.reduce(ReduceOp::Sum, weight, all, false)?;
        coef = b.div(coef, total)?;
    }
    let coef = b.reshape(coef, &unsq)?;
    let labels_u = b.reshape(safe_labels, &unsq)?;
    let mut iota_shape = vec![1; unsq.len()];
    iota_shape[1] = classes;
    let iota: Vec<i64> = (0..classes as i64).collect();
    let iota = Tensor::from_i64(iota_shape, &iota);
    let iota = if lt.dtype == DType::I64 {
        b.op(Op::Constant { value: iota }, vec![])?
    } else {
        let c = b.op(Op::Constant { value: iota }, vec![])?;
        b.op(Op::Cast { to: lt.dtype }, vec![c])?
    };
    let hot = b.bin(BinaryOp::Equal, iota, labels_u)?;
    let onehot = b.op(Op::Cast { to: dtype }, vec![hot])?;
    let mut grad = match op {
        Op::CrossEntropy { .. } => {
            let p = b.op(Op::Softmax { axis: 1 }, vec![scores])?;
            let diff = b.sub(p, onehot)?;
            b.mul(diff, coef)?
        }
        _ => {
            let t = b.mul(onehot, coef)?;
            b.un(UnaryOp::Neg, t)?
        }
    };
    // Cross-entropy's optional log-probability output: the log_softmax rule.
    if let (Op::CrossEntropy { .. }, Some(Some(dlp))) = (op, dy.get(1)) {
        let lp = y[1];
        let p = b.un(UnaryOp::Exp, lp)?;
        let s = b.reduce(ReduceOp::Sum, *dlp, vec![1], true)?;
        let t = b.mul(p, s)?;
        let g = b.sub(*dlp, t)?;
        grad = b.add(grad, g)?;
    }
    Ok(grad)
}
