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
                Some(r) => constant(cx, &r, 1)?.get_f64(0),
                None => 0.5,
            };
            let training = match opt_input(imp, cx, 2)? {
                Some(t) => constant(cx, &t, 2)?.get_f64(0) != 0.0,
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
    let rank = imp.ty(&x).rank();
    // ReduceSum takes axes as an input from opset 13, the others from opset 18.
    let axes_as_input = cx.node.op_type == "ReduceSum" || cx.opset >= 18;
    let axes = if axes_as_input { const_ints(imp, cx, 1)? } else { attr_ints(cx, "axes") };
    let axes = match axes {
        Some(a) if !a.is_empty() => norm_axes(cx, &a, rank)?,
        _ if attr_int(cx, "noop_with_empty_axes", 0) == 1 => return Ok(vec![x]),
        _ => (0..rank).collect(),
    };
    let keep_dims = attr_int(cx, "keepdims", 1) == 1;
    Ok(vec![imp.emit1(cx, Op::Reduce { op, axes, keep_dims }, &[x])?])
}
