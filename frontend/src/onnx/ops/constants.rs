//! Values known at import: `Constant`, `ConstantOfShape`, `Shape`, `Size`, `Range`, `Trilu`.

use super::*;

/// The node's outputs, or `None` when its op is not of this family.
pub(super) fn convert(
    imp: &mut Importer,
    cx: &NodeCx,
    external: &mut ExternalFiles,
) -> Result<Option<Vec<Sym>>, FrontendError> {
    let op_type = cx.node.op_type.as_str();
    let outputs: Result<Vec<Sym>, FrontendError> = match op_type {
        "Constant" => {
            let a = cx.node.attribute.first().ok_or_else(|| cx.invalid("has no value attribute"))?;
            let t = match a.name.as_str() {
                "value" => {
                    decode(a.t.as_ref().ok_or_else(|| cx.invalid("value has no tensor"))?, &cx.node.name, external)?
                }
                "value_float" => Tensor::from_f32(vec![], &[a.f]),
                "value_floats" => Tensor::from_f32(vec![a.floats.len()], &a.floats),
                "value_int" => Tensor::from_i64(vec![], &[a.i]),
                "value_ints" => Tensor::from_i64(vec![a.ints.len()], &a.ints),
                other => return Err(cx.invalid(format!("unsupported value attribute '{other}'"))),
            };
            one(Sym::Const(t))
        }
        "ConstantOfShape" => {
            let shape = dims(&const_ints(imp, cx, 0)?.unwrap_or_default(), cx, "shape")?;
            let value = match attr(cx, "value").and_then(|a| a.t.as_ref()) {
                Some(t) => decode(t, &cx.node.name, external)?,
                None => Tensor::from_f32(vec![], &[0.0]),
            };
            if value.numel() != 1 {
                return Err(cx.invalid("value must have exactly one element"));
            }
            // A broadcast of the scalar: folded when small, an op over the scalar when large.
            let scalar = value.reshaped(vec![]).expect("one element");
            one(imp.emit1(cx, Op::Expand { shape }, &[Sym::Const(scalar)])?)
        }
        "Shape" => {
            let shape = imp.ty(&input(imp, cx, 0)?).shape;
            let rank = shape.len() as i64;
            let clamp = |v: i64| (if v < 0 { v + rank } else { v }).clamp(0, rank) as usize;
            let start = clamp(attr_int(cx, "start", 0));
            let end = clamp(attr_int(cx, "end", rank));
            let dims: Vec<i64> = shape[start..end.max(start)].iter().map(|&d| d as i64).collect();
            one(Sym::Const(Tensor::from_i64(vec![dims.len()], &dims)))
        }
        "Size" => {
            let n = imp.ty(&input(imp, cx, 0)?).numel() as i64;
            one(Sym::Const(Tensor::from_i64(vec![], &[n])))
        }
        "Range" => {
            let vals: Vec<Tensor> = (0..3)
                .map(|i| input(imp, cx, i).and_then(|s| constant_scalar(cx, &s, i).cloned()))
                .collect::<Result<_, _>>()?;
            let (start, limit, delta) = (vals[0].get_f64(0), vals[1].get_f64(0), vals[2].get_f64(0));
            if delta == 0.0 {
                return Err(cx.invalid("delta is zero"));
            }
            let n = ((limit - start) / delta).ceil().max(0.0) as usize;
            let dtype = vals[0].dtype();
            let values: Vec<f64> = (0..n).map(|i| start + i as f64 * delta).collect();
            one(Sym::Const(Tensor::from_f64_values(dtype, vec![n], &values)))
        }
        "Trilu" => {
            let x = input(imp, cx, 0)?;
            let k = const_ints(imp, cx, 1)?.and_then(|v| v.first().copied()).unwrap_or(0);
            one(imp.emit1(cx, Op::Triangle { upper: attr_int(cx, "upper", 1) == 1, k }, &[x])?)
        }
        _ => return Ok(None),
    };
    outputs.map(Some)
}
