//! Elementwise ops, casts, selects, clips, reductions (`Reduce*`), GELU and dropout.

use super::*;

/// The node's outputs, or `None` when its op is not of this family.
pub(super) fn convert(
    imp: &mut Importer,
    cx: &NodeCx,
    _external: &mut ExternalFiles,
) -> Result<Option<Vec<Sym>>, FrontendError> {
    let op_type = cx.node.op_type.as_str();
    let outputs: Result<Vec<Sym>, FrontendError> = match op_type {
        "Identity" => one(input(imp, cx, 0)?),
        "Max" | "Min" => {
            let op = if op_type == "Max" { BinaryOp::Max } else { BinaryOp::Min };
            let mut acc = input(imp, cx, 0)?;
            for i in 1..cx.node.input.len() {
                let next = input(imp, cx, i)?;
                acc = imp.emit1(cx, Op::Binary(op), &[acc, next])?;
            }
            one(acc)
        }
        // numpy's clip as PyTorch's clamp computes it, gradient included: a max with the lower
        // bound, the input first (at a tie the gradient passes to the input), then a min with
        // the upper (a lower bound above the upper gives the upper, as ONNX says).
        "Clip" => {
            let mut y = input(imp, cx, 0)?;
            if let Some(low) = opt_input(imp, cx, 1)? {
                y = imp.emit1(cx, Op::Binary(BinaryOp::Max), &[y, low])?;
            }
            if let Some(high) = opt_input(imp, cx, 2)? {
                y = imp.emit1(cx, Op::Binary(BinaryOp::Min), &[y, high])?;
            }
            one(y)
        }
        "Mod" => {
            let a = input(imp, cx, 0)?;
            let b = input(imp, cx, 1)?;
            let fmod = attr_int(cx, "fmod", 0);
            if imp.ty(&a).dtype.is_float() != (fmod == 1) {
                return Err(cx.invalid("fmod=1 is required for floats and supported only for floats"));
            }
            one(imp.emit1(cx, Op::Binary(BinaryOp::Mod), &[a, b])?)
        }
        "Cast" => {
            let code = attr_int(cx, "to", 0) as i32;
            let to = super::super::dtype_from_onnx(code).ok_or_else(|| {
                cx.invalid(format!("cast to unsupported type {}", super::super::tensor::onnx_type_name(code)))
            })?;
            let x = input(imp, cx, 0)?;
            if imp.ty(&x).dtype == to {
                return Ok(Some(vec![x]));
            }
            one(imp.emit1(cx, Op::Cast { to }, &[x])?)
        }
        "CastLike" => {
            let x = input(imp, cx, 0)?;
            let to = imp.ty(&input(imp, cx, 1)?).dtype;
            if imp.ty(&x).dtype == to {
                return Ok(Some(vec![x]));
            }
            one(imp.emit1(cx, Op::Cast { to }, &[x])?)
        }
        "Where" => {
            let c = input(imp, cx, 0)?;
            let x = input(imp, cx, 1)?;
            let y = input(imp, cx, 2)?;
            one(imp.emit1(cx, Op::Select, &[c, x, y])?)
        }
        "Gelu" => {
            let x = input(imp, cx, 0)?;
            let approx = match attr_string(cx, "approximate").as_deref() {
                None | Some("none") => GeluApprox::None,
                Some("tanh") => GeluApprox::Tanh,
                Some(other) => return Err(cx.invalid(format!("unknown approximate '{other}'"))),
            };
            one(imp.emit1(cx, Op::Gelu { approx }, &[x])?)
        }
        "Dropout" => {
            let x = input(imp, cx, 0)?;
            let ratio = match opt_input(imp, cx, 1)? {
                Some(r) => constant_scalar(cx, &r, 1)?.get_f64(0),
                None => 0.5,
            };
            let training = match opt_input(imp, cx, 2)? {
                Some(t) => constant_scalar(cx, &t, 2)?.get_f64(0) != 0.0,
                None => false,
            };
            if training && ratio != 0.0 {
                return Err(cx.invalid(format!("dropout with ratio {ratio} in training mode is not supported yet; export with dropout probability 0")));
            }
            let shape = imp.ty(&x).shape;
            let mut outs = vec![x];
            if cx.node.output.len() > 1 {
                let keep = Sym::Const(Tensor::full(DType::Bool, vec![], 1.0));
                outs.push(imp.emit1(cx, Op::Expand { shape }, &[keep])?);
            }
            Ok(outs)
        }
        _ => return Ok(None),
    };
    outputs.map(Some)
}

pub(super) fn convert_reduce(imp: &mut Importer, cx: &NodeCx, op: ReduceOp) -> Result<Vec<Sym>, FrontendError> {
    let x = input(imp, cx, 0)?;
    let Some((axes, keep_dims)) = reduce_axes(imp, cx, imp.ty(&x).rank())? else { return one(x) };
    Ok(vec![imp.emit1(cx, Op::Reduce { op, axes, keep_dims }, &[x])?])
}

/// A reduction's axes and `keepdims`; `None` for an empty list with `noop_with_empty_axes`.
fn reduce_axes(imp: &Importer, cx: &NodeCx, rank: usize) -> Result<Option<(Vec<usize>, bool)>, FrontendError> {
    // ReduceSum takes axes as an input from opset 13, the others from opset 18.
    let axes_as_input = cx.node.op_type == "ReduceSum" || cx.opset >= 18;
    let axes = if axes_as_input { const_ints(imp, cx, 1)? } else { attr_ints(cx, "axes") };
    let axes = match axes {
        Some(a) if !a.is_empty() => norm_axes(cx, &a, rank)?,
        _ if attr_int(cx, "noop_with_empty_axes", 0) == 1 => return Ok(None),
        _ => (0..rank).collect(),
    };
    Ok(Some((axes, attr_int(cx, "keepdims", 1) == 1)))
}

/// The reductions ONNX composes from a sum: `ReduceSumSquare`, `ReduceL1`, `ReduceL2`,
/// `ReduceLogSum`, and `ReduceLogSumExp` (from the maximum: `m + log(sum(exp(x - m)))`, `m`
/// taken as 0 where it is infinite, as `torch.logsumexp`); `None` for another op. An empty
/// axis list with `noop_with_empty_axes` gives the elementwise part alone, as ONNX's
/// reference does.
pub(super) fn convert_composite_reduce(imp: &mut Importer, cx: &NodeCx) -> Result<Option<Vec<Sym>>, FrontendError> {
    let op_type = cx.node.op_type.as_str();
    if !matches!(op_type, "ReduceSumSquare" | "ReduceL1" | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp") {
        return Ok(None);
    }
    let x = input(imp, cx, 0)?;
    let ty = imp.ty(&x);
    if !ty.dtype.is_float() {
        return Err(cx.invalid(format!("{op_type} of {} is not supported (only floats)", ty.dtype)));
    }
    let scalar = |v: f64| Sym::Const(Tensor::full(ty.dtype, vec![], v));
    let reduced = reduce_axes(imp, cx, ty.rank())?;
    let sum = |imp: &mut Importer, v: Sym| -> Result<Sym, FrontendError> {
        match &reduced {
            Some((axes, keep_dims)) => {
                imp.emit1(cx, Op::Reduce { op: ReduceOp::Sum, axes: axes.clone(), keep_dims: *keep_dims }, &[v])
            }
            None => Ok(v),
        }
    };
    let y = match op_type {
        "ReduceSumSquare" | "ReduceL2" => {
            let square = imp.emit1(cx, Op::Binary(BinaryOp::Mul), &[x.clone(), x])?;
            let total = sum(imp, square)?;
            if op_type == "ReduceL2" {
                imp.emit1(cx, Op::Unary(UnaryOp::Sqrt), &[total])?
            } else {
                total
            }
        }
        "ReduceL1" => {
            let magnitude = imp.emit1(cx, Op::Unary(UnaryOp::Abs), &[x])?;
            sum(imp, magnitude)?
        }
        "ReduceLogSum" => {
            let total = sum(imp, x)?;
            imp.emit1(cx, Op::Unary(UnaryOp::Log), &[total])?
        }
        _ => {
            let Some((axes, keep_dims)) = reduced.clone() else {
                return Ok(Some(vec![x]));
            };
            if axes.iter().any(|&a| ty.shape[a] == 0) {
                // The log of an empty sum.
                let mut shape = reduced_shape(&ty.shape, &reduced);
                if keep_dims {
                    shape = ty.shape.iter().enumerate().map(|(d, &n)| if axes.contains(&d) { 1 } else { n }).collect();
                }
                return Ok(Some(vec![Sym::Const(Tensor::full(ty.dtype, shape, f64::NEG_INFINITY))]));
            }
            let max = imp.emit1(
                cx,
                Op::Reduce { op: ReduceOp::Max, axes: axes.clone(), keep_dims: true },
                std::slice::from_ref(&x),
            )?;
            let magnitude = imp.emit1(cx, Op::Unary(UnaryOp::Abs), std::slice::from_ref(&max))?;
            let infinite = imp.emit1(cx, Op::Binary(BinaryOp::Equal), &[magnitude, scalar(f64::INFINITY)])?;
            let max = imp.emit1(cx, Op::Select, &[infinite, scalar(0.0), max])?;
            let shifted = imp.emit1(cx, Op::Binary(BinaryOp::Sub), &[x, max.clone()])?;
            let exp = imp.emit1(cx, Op::Unary(UnaryOp::Exp), &[shifted])?;
            let total = imp.emit1(cx, Op::Reduce { op: ReduceOp::Sum, axes, keep_dims: true }, &[exp])?;
            let log = imp.emit1(cx, Op::Unary(UnaryOp::Log), &[total])?;
            let y = imp.emit1(cx, Op::Binary(BinaryOp::Add), &[log, max])?;
            if keep_dims {
                y
            } else {
                let shape = reduced_shape(&ty.shape, &reduced);
                imp.emit1(cx, Op::Reshape { shape }, &[y])?
            }
        }
    };
    Ok(Some(vec![y]))
}

/// The shape left by a reduction without `keepdims`.
fn reduced_shape(shape: &[usize], reduced: &Option<(Vec<usize>, bool)>) -> Vec<usize> {
    match reduced {
        Some((axes, _)) => (0..shape.len()).filter(|d| !axes.contains(d)).map(|d| shape[d]).collect(),
        None => shape.to_vec(),
    }
}
