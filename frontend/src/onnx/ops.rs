//! Conversion of each supported ONNX op into IR ops, with ONNX's defaults and per-opset input
//! conventions (attributes that became inputs: Split, Squeeze/Unsqueeze, Reduce*, Pad, Slice,
//! Dropout).

use autotp_ir::{BinaryOp, DType, GeluApprox, Op, ReduceOp, Reduction, Tensor, UnaryOp};

use super::proto::AttributeProto;
use super::tensor::{decode, ExternalFiles};
use super::{Importer, NodeCx, Sym};
use crate::FrontendError;

/// Every ONNX op type (default domain) the importer converts, sorted. The conformance manifest
/// lists the same set; a test keeps the two equal.
pub const SUPPORTED_OPS: &[&str] = &[
    "Abs",
    "Add",
    "And",
    "ArgMax",
    "ArgMin",
    "Cast",
    "CastLike",
    "Ceil",
    "Concat",
    "ConcatFromSequence",
    "Constant",
    "ConstantOfShape",
    "Cos",
    "CumSum",
    "Div",
    "Dropout",
    "Einsum",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Floor",
    "Gather",
    "GatherElements",
    "GatherND",
    "Gelu",
    "Gemm",
    "Greater",
    "GreaterOrEqual",
    "Identity",
    "LayerNormalization",
    "Less",
    "LessOrEqual",
    "Log",
    "LogSoftmax",
    "MatMul",
    "Max",
    "Min",
    "Mod",
    "Mul",
    "Neg",
    "NegativeLogLikelihoodLoss",
    "Not",
    "OneHot",
    "Or",
    "Pad",
    "Pow",
    "RMSNormalization",
    "Range",
    "Reciprocal",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "Relu",
    "Reshape",
    "RotaryEmbedding",
    "Round",
    "ScatterND",
    "SequenceAt",
    "SequenceConstruct",
    "SequenceLength",
    "Shape",
    "Sigmoid",
    "Sign",
    "Sin",
    "Size",
    "Slice",
    "Softmax",
    "SoftmaxCrossEntropyLoss",
    "Split",
    "SplitToSequence",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Tanh",
    "Tile",
    "TopK",
    "Transpose",
    "Trilu",
    "Unsqueeze",
    "Where",
    "Xor",
];

fn attr<'n>(cx: &NodeCx<'n>, name: &str) -> Option<&'n AttributeProto> {
    cx.node.attribute.iter().find(|a| a.name == name)
}

fn attr_int(cx: &NodeCx, name: &str, default: i64) -> i64 {
    attr(cx, name).map(|a| a.i).unwrap_or(default)
}

fn attr_float(cx: &NodeCx, name: &str, default: f32) -> f32 {
    attr(cx, name).map(|a| a.f).unwrap_or(default)
}

fn attr_ints(cx: &NodeCx, name: &str) -> Option<Vec<i64>> {
    attr(cx, name).map(|a| a.ints.clone())
}

fn attr_string(cx: &NodeCx, name: &str) -> Option<String> {
    attr(cx, name).map(|a| String::from_utf8_lossy(&a.s).into_owned())
}

/// Input `i`, or `None` when it is absent or the empty name (an omitted optional input).
fn opt_input(imp: &Importer, cx: &NodeCx, i: usize) -> Result<Option<Sym>, FrontendError> {
    match cx.node.input.get(i).map(String::as_str) {
        None | Some("") => Ok(None),
        Some(name) => imp.lookup(cx, name).map(Some),
    }
}

fn input(imp: &Importer, cx: &NodeCx, i: usize) -> Result<Sym, FrontendError> {
    opt_input(imp, cx, i)?.ok_or_else(|| cx.invalid(format!("required input {i} is missing")))
}

fn constant<'s>(cx: &NodeCx, sym: &'s Sym, i: usize) -> Result<&'s Tensor, FrontendError> {
    match sym {
        Sym::Const(t) => Ok(t),
        Sym::Value(_) => Err(FrontendError::NotConstant {
            op_type: cx.node.op_type.clone(),
            node: cx.node.name.clone(),
            input: cx.node.input.get(i).cloned().unwrap_or_default(),
        }),
    }
}

/// A constant integer input (`shape`, `axes`, `pads`...), or `None` when omitted.
fn const_ints(imp: &Importer, cx: &NodeCx, i: usize) -> Result<Option<Vec<i64>>, FrontendError> {
    match opt_input(imp, cx, i)? {
        None => Ok(None),
        Some(sym) => Ok(Some(constant(cx, &sym, i)?.to_i64_vec())),
    }
}

fn norm_axis(cx: &NodeCx, axis: i64, rank: usize) -> Result<usize, FrontendError> {
    let r = rank as i64;
    if axis < -r || axis >= r {
        return Err(cx.invalid(format!("axis {axis} is out of range for rank {rank}")));
    }
    Ok(if axis < 0 { (axis + r) as usize } else { axis as usize })
}

fn norm_axes(cx: &NodeCx, axes: &[i64], rank: usize) -> Result<Vec<usize>, FrontendError> {
    let mut out = axes.iter().map(|&a| norm_axis(cx, a, rank)).collect::<Result<Vec<_>, _>>()?;
    out.sort_unstable();
    if out.windows(2).any(|w| w[0] == w[1]) {
        return Err(cx.invalid(format!("axes {axes:?} repeat an axis")));
    }
    Ok(out)
}

fn dims(values: &[i64], cx: &NodeCx, what: &str) -> Result<Vec<usize>, FrontendError> {
    values
        .iter()
        .map(|&v| usize::try_from(v).map_err(|_| cx.invalid(format!("{what} {values:?} has a negative entry"))))
        .collect()
}

fn unary_op(op_type: &str) -> Option<UnaryOp> {
    Some(match op_type {
        "Neg" => UnaryOp::Neg,
        "Abs" => UnaryOp::Abs,
        "Exp" => UnaryOp::Exp,
        "Log" => UnaryOp::Log,
        "Sqrt" => UnaryOp::Sqrt,
        "Reciprocal" => UnaryOp::Reciprocal,
        "Tanh" => UnaryOp::Tanh,
        "Erf" => UnaryOp::Erf,
        "Sigmoid" => UnaryOp::Sigmoid,
        "Relu" => UnaryOp::Relu,
        "Sin" => UnaryOp::Sin,
        "Cos" => UnaryOp::Cos,
        "Floor" => UnaryOp::Floor,
        "Ceil" => UnaryOp::Ceil,
        "Round" => UnaryOp::Round,
        "Sign" => UnaryOp::Sign,
        "Not" => UnaryOp::Not,
        _ => return None,
    })
}

fn binary_op(op_type: &str) -> Option<BinaryOp> {
    Some(match op_type {
        "Add" => BinaryOp::Add,
        "Sub" => BinaryOp::Sub,
        "Mul" => BinaryOp::Mul,
        "Div" => BinaryOp::Div,
        "Pow" => BinaryOp::Pow,
        "Equal" => BinaryOp::Equal,
        "Less" => BinaryOp::Less,
        "LessOrEqual" => BinaryOp::LessEqual,
        "Greater" => BinaryOp::Greater,
        "GreaterOrEqual" => BinaryOp::GreaterEqual,
        "And" => BinaryOp::And,
        "Or" => BinaryOp::Or,
        "Xor" => BinaryOp::Xor,
        _ => return None,
    })
}

fn reduce_op(op_type: &str) -> Option<ReduceOp> {
    Some(match op_type {
        "ReduceSum" => ReduceOp::Sum,
        "ReduceMean" => ReduceOp::Mean,
        "ReduceMax" => ReduceOp::Max,
        "ReduceMin" => ReduceOp::Min,
        "ReduceProd" => ReduceOp::Prod,
        _ => return None,
    })
}

/// The shape of `x` with 1s inserted at `axes` (normalised against the output rank).
fn unsqueezed_shape(cx: &NodeCx, shape: &[usize], axes: &[i64]) -> Result<Vec<usize>, FrontendError> {
    let rank = shape.len() + axes.len();
    let axes = norm_axes(cx, axes, rank)?;
    let mut rest = shape.iter();
    Ok((0..rank).map(|d| if axes.contains(&d) { 1 } else { *rest.next().expect("counted") }).collect())
}

/// Converts one node; returns one symbol per ONNX output.
pub(super) fn convert(
    imp: &mut Importer,
    cx: &NodeCx,
    external: &mut ExternalFiles,
) -> Result<Vec<Sym>, FrontendError> {
    let op_type = cx.node.op_type.as_str();
    if !cx.node.domain.is_empty() && cx.node.domain != "ai.onnx" {
        return Err(FrontendError::UnsupportedOp {
            op_type: format!("{}.{}", cx.node.domain, op_type),
            node: cx.node.name.clone(),
            opset: cx.opset,
        });
    }
    let one = |s: Sym| Ok(vec![s]);
    if let Some(op) = unary_op(op_type) {
        let x = input(imp, cx, 0)?;
        return one(imp.emit1(cx, Op::Unary(op), &[x])?);
    }
    if let Some(op) = binary_op(op_type) {
        let a = input(imp, cx, 0)?;
        let mut b = input(imp, cx, 1)?;
        let (ta, tb) = (imp.ty(&a), imp.ty(&b));
        if op == BinaryOp::Pow && ta.dtype != tb.dtype {
            // ONNX allows an exponent of another type; compute in the base's type.
            b = imp.emit1(cx, Op::Cast { to: ta.dtype }, &[b])?;
        }
        return one(imp.emit1(cx, Op::Binary(op), &[a, b])?);
    }
    if let Some(op) = reduce_op(op_type) {
        return convert_reduce(imp, cx, op);
    }
    match op_type {
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
            let to = super::dtype_from_onnx(code).ok_or_else(|| {
                cx.invalid(format!("cast to unsupported type {}", super::tensor::onnx_type_name(code)))
            })?;
            let x = input(imp, cx, 0)?;
            if imp.ty(&x).dtype == to {
                return one(x);
            }
            one(imp.emit1(cx, Op::Cast { to }, &[x])?)
        }
        "CastLike" => {
            let x = input(imp, cx, 0)?;
            let to = imp.ty(&input(imp, cx, 1)?).dtype;
            if imp.ty(&x).dtype == to {
                return one(x);
            }
            one(imp.emit1(cx, Op::Cast { to }, &[x])?)
        }
        "Where" => {
            let c = input(imp, cx, 0)?;
            let x = input(imp, cx, 1)?;
            let y = input(imp, cx, 2)?;
            one(imp.emit1(cx, Op::Select, &[c, x, y])?)
        }
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
                .map(|i| input(imp, cx, i).and_then(|s| constant(cx, &s, i).cloned()))
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
        "Reshape" => {
            let x = input(imp, cx, 0)?;
            let in_shape = imp.ty(&x).shape;
            let target = const_ints(imp, cx, 1)?.ok_or_else(|| cx.invalid("missing shape"))?;
            let allow_zero = attr_int(cx, "allowzero", 0) == 1;
            let shape = reshape_target(cx, &in_shape, &target, allow_zero)?;
            one(imp.emit1(cx, Op::Reshape { shape }, &[x])?)
        }
        "Flatten" => {
            let x = input(imp, cx, 0)?;
            let s = imp.ty(&x).shape;
            // The axis is in [-rank, rank]; a negative one counts from the rank.
            let rank = s.len() as i64;
            let axis = attr_int(cx, "axis", 1);
            if axis < -rank || axis > rank {
                return Err(cx.invalid(format!("axis {axis} is out of range for rank {rank}")));
            }
            let axis = if axis < 0 { axis + rank } else { axis } as usize;
            let shape = vec![s[..axis].iter().product(), s[axis..].iter().product()];
            one(imp.emit1(cx, Op::Reshape { shape }, &[x])?)
        }
        "Unsqueeze" => {
            let x = input(imp, cx, 0)?;
            let axes = const_ints(imp, cx, 1)?.ok_or_else(|| cx.invalid("missing axes"))?;
            let shape = unsqueezed_shape(cx, &imp.ty(&x).shape, &axes)?;
            one(imp.emit1(cx, Op::Reshape { shape }, &[x])?)
        }
        "Squeeze" => {
            let x = input(imp, cx, 0)?;
            let s = imp.ty(&x).shape;
            let axes = match const_ints(imp, cx, 1)? {
                Some(a) => norm_axes(cx, &a, s.len())?,
                None => (0..s.len()).filter(|&d| s[d] == 1).collect(),
            };
            if let Some(&d) = axes.iter().find(|&&d| s[d] != 1) {
                return Err(cx.invalid(format!("cannot squeeze dim {d} of size {}", s[d])));
            }
            let shape = (0..s.len()).filter(|d| !axes.contains(d)).map(|d| s[d]).collect();
            one(imp.emit1(cx, Op::Reshape { shape }, &[x])?)
        }
        "Transpose" => {
            let x = input(imp, cx, 0)?;
            let rank = imp.ty(&x).rank();
            let perm = match attr_ints(cx, "perm") {
                Some(p) => dims(&p, cx, "perm")?,
                None => (0..rank).rev().collect(),
            };
            one(imp.emit1(cx, Op::Transpose { perm }, &[x])?)
        }
        "Concat" => {
            let xs: Vec<Sym> = (0..cx.node.input.len()).map(|i| input(imp, cx, i)).collect::<Result<_, _>>()?;
            let rank = imp.ty(xs.first().ok_or_else(|| cx.invalid("has no inputs"))?).rank();
            let axis = norm_axis(cx, attr_int(cx, "axis", 0), rank)?;
            one(imp.emit1(cx, Op::Concat { axis }, &xs)?)
        }
        "Split" => {
            let x = input(imp, cx, 0)?;
            let s = imp.ty(&x).shape;
            let axis = norm_axis(cx, attr_int(cx, "axis", 0), s.len())?;
            let outputs = cx.node.output.len();
            let sizes = match const_ints(imp, cx, 1)? {
                Some(sizes) => dims(&sizes, cx, "split")?,
                None => {
                    let parts =
                        if cx.opset >= 18 { attr_int(cx, "num_outputs", outputs as i64) as usize } else { outputs };
                    if parts == 0 {
                        return Err(cx.invalid("splits into zero parts"));
                    }
                    let chunk = s[axis].div_ceil(parts);
                    (0..parts).map(|i| chunk.min(s[axis].saturating_sub(i * chunk))).collect()
                }
            };
            imp.emit(cx, Op::Split { axis, sizes }, &[x], outputs)
        }
        "Slice" => convert_slice(imp, cx),
        "SplitToSequence" | "SequenceConstruct" => {
            let items = if op_type == "SequenceConstruct" {
                (0..cx.node.input.len()).map(|i| input(imp, cx, i)).collect::<Result<Vec<_>, _>>()?
            } else {
                split_to_sequence(imp, cx)?
            };
            let name = cx.node.output.first().ok_or_else(|| cx.invalid("has no output"))?;
            imp.sequences.insert(name.clone(), items);
            Ok(vec![])
        }
        "SequenceAt" => {
            let items = imp.lookup_sequence(cx, &cx.node.input[0])?;
            let position = const_ints(imp, cx, 1)?.and_then(|p| p.first().copied());
            let position = position.ok_or_else(|| cx.invalid("the position must be a constant"))?;
            let n = items.len() as i64;
            if position < -n || position >= n {
                return Err(cx.invalid(format!("position {position} is out of range for a sequence of {n}")));
            }
            one(items[(if position < 0 { position + n } else { position }) as usize].clone())
        }
        "SequenceLength" => {
            let n = imp.lookup_sequence(cx, &cx.node.input[0])?.len();
            one(Sym::Const(Tensor::from_i64(vec![], &[n as i64])))
        }
        "ConcatFromSequence" => {
            let items = imp.lookup_sequence(cx, &cx.node.input[0])?.to_vec();
            let first = items.first().ok_or_else(|| cx.invalid("the sequence is empty"))?;
            let shape = imp.ty(first).shape;
            let new_axis = attr_int(cx, "new_axis", 0) == 1;
            let axis = norm_axis(cx, attr_int(cx, "axis", 0), shape.len() + usize::from(new_axis))?;
            let items = if new_axis {
                let mut spread = shape.clone();
                spread.insert(axis, 1);
                items
                    .into_iter()
                    .map(|item| imp.emit1(cx, Op::Reshape { shape: spread.clone() }, &[item]))
                    .collect::<Result<Vec<_>, _>>()?
            } else {
                items
            };
            one(imp.emit1(cx, Op::Concat { axis }, &items)?)
        }
        "Expand" => {
            let x = input(imp, cx, 0)?;
            let s = imp.ty(&x).shape;
            let target = dims(&const_ints(imp, cx, 1)?.ok_or_else(|| cx.invalid("missing shape"))?, cx, "shape")?;
            let shape = autotp_ir::broadcast_shapes(&s, &target)
                .ok_or_else(|| cx.invalid(format!("cannot expand {s:?} to {target:?}")))?;
            one(imp.emit1(cx, Op::Expand { shape }, &[x])?)
        }
        "Gather" | "GatherElements" => {
            let data = input(imp, cx, 0)?;
            let idx = input(imp, cx, 1)?;
            let axis = norm_axis(cx, attr_int(cx, "axis", 0), imp.ty(&data).rank())?;
            let op = if op_type == "Gather" { Op::Gather { axis } } else { Op::GatherElements { axis } };
            one(imp.emit1(cx, op, &[data, idx])?)
        }
        "CumSum" => {
            let x = input(imp, cx, 0)?;
            let axis_sym = input(imp, cx, 1)?;
            let axis = constant(cx, &axis_sym, 1)?.get_i64(0);
            let axis = norm_axis(cx, axis, imp.ty(&x).rank())?;
            let (exclusive, reverse) = (attr_int(cx, "exclusive", 0) == 1, attr_int(cx, "reverse", 0) == 1);
            one(imp.emit1(cx, Op::CumSum { axis, exclusive, reverse }, &[x])?)
        }
        "TopK" => {
            let x = input(imp, cx, 0)?;
            let k_sym = input(imp, cx, 1)?;
            let k = constant(cx, &k_sym, 1)?.get_i64(0);
            let k = usize::try_from(k).map_err(|_| cx.invalid(format!("k = {k} is negative")))?;
            let axis = norm_axis(cx, attr_int(cx, "axis", -1), imp.ty(&x).rank())?;
            // `sorted = 0` leaves the order to the implementation: sorted is one.
            imp.emit(cx, Op::TopK { axis, k, largest: attr_int(cx, "largest", 1) == 1 }, &[x], 2)
        }
        "ArgMax" | "ArgMin" => {
            // The index of the first extreme: `topk` with k = 1 keeps equal values in index
            // order. The last one (`select_last_index`) is the first of the reversed axis.
            let x = input(imp, cx, 0)?;
            let shape = imp.ty(&x).shape;
            let axis = norm_axis(cx, attr_int(cx, "axis", 0), shape.len())?;
            let last = attr_int(cx, "select_last_index", 0) == 1;
            let len = shape[axis];
            let source = if last { slice_axis(imp, cx, x, axis, len.saturating_sub(1), -1, -1)? } else { x };
            let largest = op_type == "ArgMax";
            let mut index = imp.emit(cx, Op::TopK { axis, k: 1, largest }, &[source], 2)?.remove(1);
            if last {
                let top = Sym::Const(Tensor::full(DType::I64, vec![], len as f64 - 1.0));
                index = imp.emit1(cx, Op::Binary(BinaryOp::Sub), &[top, index])?;
            }
            if attr_int(cx, "keepdims", 1) == 1 {
                one(index)
            } else {
                let mut squeezed = shape;
                squeezed.remove(axis);
                one(imp.emit1(cx, Op::Reshape { shape: squeezed }, &[index])?)
            }
        }
        "Einsum" => {
            let operands = (0..cx.node.input.len()).map(|i| input(imp, cx, i)).collect::<Result<Vec<_>, _>>()?;
            one(einsum(imp, cx, operands)?)
        }
        "GatherND" => {
            let data = input(imp, cx, 0)?;
            let mut idx = input(imp, cx, 1)?;
            let batch_dims =
                usize::try_from(attr_int(cx, "batch_dims", 0)).map_err(|_| cx.invalid("batch_dims is negative"))?;
            if batch_dims > 0 {
                idx = prepend_batch_coordinates(imp, cx, idx, batch_dims)?;
            }
            one(imp.emit1(cx, Op::GatherNd, &[data, idx])?)
        }
        "ScatterND" => {
            let reduction = attr_string(cx, "reduction").unwrap_or_else(|| "none".into());
            let reduction = autotp_ir::ScatterReduction::from_name(&reduction)
                .ok_or_else(|| cx.invalid(format!("unknown reduction '{reduction}'")))?;
            let inputs = [input(imp, cx, 0)?, input(imp, cx, 1)?, input(imp, cx, 2)?];
            one(imp.emit1(cx, Op::ScatterNd { reduction }, &inputs)?)
        }
        "Tile" => {
            // x[d0, d1, ..] -> [1, d0, 1, d1, ..] -> expand to [r0, d0, r1, d1, ..] -> [r0*d0, r1*d1, ..]:
            // reshapes and a broadcast, so the gradient is a sum over the repeats.
            let x = input(imp, cx, 0)?;
            let s = imp.ty(&x).shape;
            let repeats = dims(&const_ints(imp, cx, 1)?.ok_or_else(|| cx.invalid("missing repeats"))?, cx, "repeats")?;
            if repeats.len() != s.len() {
                return Err(cx.invalid(format!(
                    "repeats {repeats:?} has {} entries for a rank-{} input",
                    repeats.len(),
                    s.len()
                )));
            }
            let spread: Vec<usize> = s.iter().flat_map(|&d| [1, d]).collect();
            let repeated: Vec<usize> = s.iter().zip(&repeats).flat_map(|(&d, &r)| [r, d]).collect();
            let tiled: Vec<usize> = s.iter().zip(&repeats).map(|(&d, &r)| d * r).collect();
            let y = imp.emit1(cx, Op::Reshape { shape: spread }, &[x])?;
            let y = imp.emit1(cx, Op::Expand { shape: repeated }, &[y])?;
            one(imp.emit1(cx, Op::Reshape { shape: tiled }, &[y])?)
        }
        "OneHot" => {
            // where(unsqueeze(i mod depth, axis) == range(depth) along axis, on, off), negative
            // indices counting from the end (an index outside [-depth, depth) is all off).
            let indices = input(imp, cx, 0)?;
            let depth_sym = input(imp, cx, 1)?;
            let depth = constant(cx, &depth_sym, 1)?.get_f64(0);
            if !depth.is_finite() || depth < 1.0 {
                return Err(cx.invalid(format!("depth {depth} is not a positive number")));
            }
            let depth = depth as usize;
            let values = input(imp, cx, 2)?;
            let values = constant(cx, &values, 2)?.clone();
            if values.numel() != 2 {
                return Err(cx.invalid(format!("values has {} elements, expected [off, on]", values.numel())));
            }
            let it = imp.ty(&indices);
            let axis = norm_axis(cx, attr_int(cx, "axis", -1), it.rank() + 1)?;
            let scalar = |v: f64| Sym::Const(Tensor::full(it.dtype, vec![], v));
            let negative = imp.emit1(cx, Op::Binary(BinaryOp::Less), &[indices.clone(), scalar(0.0)])?;
            let wrapped = imp.emit1(cx, Op::Binary(BinaryOp::Add), &[indices.clone(), scalar(depth as f64)])?;
            let index = imp.emit1(cx, Op::Select, &[negative, wrapped, indices])?;
            let mut spread = it.shape.clone();
            spread.insert(axis, 1);
            let index = imp.emit1(cx, Op::Reshape { shape: spread }, &[index])?;
            let mut range_shape = vec![1; it.rank() + 1];
            range_shape[axis] = depth;
            let range: Vec<f64> = (0..depth).map(|d| d as f64).collect();
            let range = Tensor::from_f64_values(it.dtype, range_shape, &range);
            let hot = imp.emit1(cx, Op::Binary(BinaryOp::Equal), &[index, Sym::Const(range)])?;
            let pick = |k: usize| Sym::Const(Tensor::full(values.dtype(), vec![], values.get_f64(k)));
            one(imp.emit1(cx, Op::Select, &[hot, pick(1), pick(0)])?)
        }
        "Trilu" => {
            let x = input(imp, cx, 0)?;
            let k = const_ints(imp, cx, 1)?.and_then(|v| v.first().copied()).unwrap_or(0);
            one(imp.emit1(cx, Op::Triangle { upper: attr_int(cx, "upper", 1) == 1, k }, &[x])?)
        }
        "MatMul" => {
            let a = input(imp, cx, 0)?;
            let b = input(imp, cx, 1)?;
            one(matmul(imp, cx, a, b, false, false)?)
        }
        "Gemm" => {
            let a = input(imp, cx, 0)?;
            let b = input(imp, cx, 1)?;
            let (ta, tb) = (attr_int(cx, "transA", 0) == 1, attr_int(cx, "transB", 0) == 1);
            let (alpha, beta) = (attr_float(cx, "alpha", 1.0), attr_float(cx, "beta", 1.0));
            let dtype = imp.ty(&a).dtype;
            let mut y = matmul(imp, cx, a, b, ta, tb)?;
            if alpha != 1.0 {
                let s = Sym::Const(Tensor::full(dtype, vec![], alpha as f64));
                y = imp.emit1(cx, Op::Binary(BinaryOp::Mul), &[y, s])?;
            }
            if let Some(mut c) = opt_input(imp, cx, 2)? {
                if beta != 1.0 {
                    let s = Sym::Const(Tensor::full(dtype, vec![], beta as f64));
                    c = imp.emit1(cx, Op::Binary(BinaryOp::Mul), &[c, s])?;
                }
                y = imp.emit1(cx, Op::Binary(BinaryOp::Add), &[y, c])?;
            }
            one(y)
        }
        "Softmax" | "LogSoftmax" => {
            let x = input(imp, cx, 0)?;
            let axis = norm_axis(cx, attr_int(cx, "axis", -1), imp.ty(&x).rank())?;
            let op = if op_type == "Softmax" { Op::Softmax { axis } } else { Op::LogSoftmax { axis } };
            one(imp.emit1(cx, op, &[x])?)
        }
        "LayerNormalization" => {
            if let Some(extra) = cx.node.output.iter().skip(1).find(|o| !o.is_empty()) {
                return Err(cx.invalid(format!("output '{extra}' (saved mean or inverse std-dev) is not supported; only the normalized output may be used")));
            }
            let x = input(imp, cx, 0)?;
            let axis = norm_axis(cx, attr_int(cx, "axis", -1), imp.ty(&x).rank())?;
            let eps = attr_float(cx, "epsilon", 1e-5) as f64;
            let mut ins = vec![x, input(imp, cx, 1)?];
            if let Some(bias) = opt_input(imp, cx, 2)? {
                ins.push(bias);
            }
            one(imp.emit1(cx, Op::LayerNorm { axis, eps }, &ins)?)
        }
        "RMSNormalization" => {
            let x = input(imp, cx, 0)?;
            let axis = norm_axis(cx, attr_int(cx, "axis", -1), imp.ty(&x).rank())?;
            let eps = attr_float(cx, "epsilon", 1e-5) as f64;
            let scale = input(imp, cx, 1)?;
            one(imp.emit1(cx, Op::RmsNorm { axis, eps }, &[x, scale])?)
        }
        "RotaryEmbedding" => convert_rotary_embedding(imp, cx),
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
        "Pad" => convert_pad(imp, cx),
        "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss" => {
            let mut inputs = vec![input(imp, cx, 0)?, input(imp, cx, 1)?];
            inputs.extend(opt_input(imp, cx, 2)?);
            let reduction = match attr_string(cx, "reduction").as_deref() {
                None | Some("mean") => Reduction::Mean,
                Some("sum") => Reduction::Sum,
                Some("none") => Reduction::None,
                Some(other) => return Err(cx.invalid(format!("unknown reduction '{other}'"))),
            };
            let ignore_index = attr(cx, "ignore_index").map(|a| a.i);
            if op_type == "SoftmaxCrossEntropyLoss" {
                let outputs = cx.node.output.iter().filter(|o| !o.is_empty()).count().max(1);
                imp.emit(cx, Op::CrossEntropy { ignore_index, reduction }, &inputs, outputs)
            } else {
                Ok(vec![imp.emit1(cx, Op::NllLoss { ignore_index, reduction }, &inputs)?])
            }
        }
        _ => Err(FrontendError::UnsupportedOp {
            op_type: op_type.to_string(),
            node: cx.node.name.clone(),
            opset: cx.opset,
        }),
    }
}

fn reshape_target(cx: &NodeCx, input: &[usize], target: &[i64], allow_zero: bool) -> Result<Vec<usize>, FrontendError> {
    let total: usize = input.iter().product();
    let mut shape = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &t) in target.iter().enumerate() {
        match t {
            -1 if infer.is_none() => {
                infer = Some(i);
                shape.push(1);
            }
            0 if !allow_zero => shape.push(*input.get(i).ok_or_else(|| {
                cx.invalid(format!("shape {target:?} copies dim {i}, the input has rank {}", input.len()))
            })?),
            t if t >= 0 => shape.push(t as usize),
            _ => return Err(cx.invalid(format!("invalid target shape {target:?}"))),
        }
    }
    if let Some(i) = infer {
        let known: usize = shape.iter().product();
        if known == 0 || !total.is_multiple_of(known) {
            return Err(cx.invalid(format!("cannot reshape {input:?} to {target:?}")));
        }
        shape[i] = total / known;
    }
    Ok(shape)
}

fn convert_reduce(imp: &mut Importer, cx: &NodeCx, op: ReduceOp) -> Result<Vec<Sym>, FrontendError> {
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

fn convert_slice(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
    let x = input(imp, cx, 0)?;
    let shape = imp.ty(&x).shape;
    let rank = shape.len();
    let starts_in = const_ints(imp, cx, 1)?.ok_or_else(|| cx.invalid("missing starts"))?;
    let ends_in = const_ints(imp, cx, 2)?.ok_or_else(|| cx.invalid("missing ends"))?;
    let axes_in = const_ints(imp, cx, 3)?.unwrap_or_else(|| (0..starts_in.len() as i64).collect());
    let steps_in = const_ints(imp, cx, 4)?.unwrap_or_else(|| vec![1; starts_in.len()]);
    if ends_in.len() != starts_in.len() || axes_in.len() != starts_in.len() || steps_in.len() != starts_in.len() {
        return Err(cx.invalid("starts, ends, axes and steps differ in length"));
    }
    let mut starts = vec![0usize; rank];
    let mut ends: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let mut steps = vec![1i64; rank];
    for i in 0..starts_in.len() {
        let axis = norm_axis(cx, axes_in[i], rank)?;
        let dim = shape[axis] as i64;
        let step = steps_in[i];
        if step == 0 {
            return Err(cx.invalid("a step is zero"));
        }
        let resolve = |v: i64| if v < 0 { v.saturating_add(dim) } else { v };
        let (start, end) = if step > 0 {
            (resolve(starts_in[i]).clamp(0, dim), resolve(ends_in[i]).clamp(0, dim))
        } else {
            // For an empty dim `dim - 1` is -1: both clamp to -1 and the slice is empty.
            (resolve(starts_in[i]).clamp(-1, (dim - 1).max(-1)), resolve(ends_in[i]).clamp(-1, (dim - 1).max(-1)))
        };
        let empty = if step > 0 { end <= start } else { end >= start || dim == 0 };
        if empty {
            starts[axis] = 0;
            ends[axis] = 0;
            steps[axis] = 1;
        } else {
            starts[axis] = usize::try_from(start).expect("a non-empty slice starts inside the dim");
            ends[axis] = end;
            steps[axis] = step;
        }
    }
    // A slice of everything (torch.export writes `x[:, :, :]` as one) is the input.
    let shape = imp.ty(&x).shape;
    let whole = (0..shape.len()).all(|d| starts[d] == 0 && ends[d] == shape[d] as i64 && steps[d] == 1);
    if whole {
        return Ok(vec![x]);
    }
    Ok(vec![imp.emit1(cx, Op::Slice { starts, ends, steps }, &[x])?])
}

fn convert_pad(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
    let x = input(imp, cx, 0)?;
    let ty = imp.ty(&x);
    let rank = ty.rank();
    if let Some(mode) = attr_string(cx, "mode") {
        if mode != "constant" {
            return Err(cx.invalid(format!("pad mode '{mode}' is not supported (only constant)")));
        }
    }
    let pads = const_ints(imp, cx, 1)?.ok_or_else(|| cx.invalid("missing pads"))?;
    let value = match opt_input(imp, cx, 2)? {
        Some(v) => constant(cx, &v, 2)?.get_f64(0),
        None => 0.0,
    };
    let axes = match const_ints(imp, cx, 3)? {
        Some(a) => a.iter().map(|&v| norm_axis(cx, v, rank)).collect::<Result<Vec<_>, _>>()?,
        None => (0..rank).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err(cx.invalid(format!("pads {pads:?} must have 2 entries per padded axis ({})", axes.len())));
    }
    let (mut begin, mut end) = (vec![0i64; rank], vec![0i64; rank]);
    for (i, &axis) in axes.iter().enumerate() {
        begin[axis] = pads[i];
        end[axis] = pads[i + axes.len()];
    }
    // Negative pads crop: slice first, then pad what is left.
    let mut x = x;
    if begin.iter().chain(&end).any(|&p| p < 0) {
        let starts = begin.iter().map(|&b| (-b).max(0) as usize).collect::<Vec<_>>();
        let ends = (0..rank).map(|d| ty.shape[d] as i64 + end[d].min(0)).collect::<Vec<_>>();
        let steps = vec![1; rank];
        x = imp.emit1(cx, Op::Slice { starts, ends, steps }, &[x])?;
    }
    let clamp = |v: &[i64]| v.iter().map(|&p| p.max(0) as usize).collect::<Vec<_>>();
    Ok(vec![imp.emit1(cx, Op::Pad { begin: clamp(&begin), end: clamp(&end), value }, &[x])?])
}

/// ONNX MatMul: numpy semantics including 1-D operands.
fn matmul(imp: &mut Importer, cx: &NodeCx, a: Sym, b: Sym, ta: bool, tb: bool) -> Result<Sym, FrontendError> {
    let (sa, sb) = (imp.ty(&a).shape, imp.ty(&b).shape);
    let a = if sa.len() == 1 { imp.emit1(cx, Op::Reshape { shape: vec![1, sa[0]] }, &[a])? } else { a };
    let b = if sb.len() == 1 { imp.emit1(cx, Op::Reshape { shape: vec![sb[0], 1] }, &[b])? } else { b };
    let mut y = imp.emit1(cx, Op::MatMul { transpose_lhs: ta, transpose_rhs: tb }, &[a, b])?;
    if sa.len() == 1 || sb.len() == 1 {
        let mut shape = imp.ty(&y).shape;
        let r = shape.len();
        if sb.len() == 1 {
            shape.remove(r - 1);
        }
        if sa.len() == 1 {
            shape.remove(r - 2);
        }
        y = imp.emit1(cx, Op::Reshape { shape }, &[y])?;
    }
    Ok(y)
}

/// `GatherND`'s `batch_dims = b` as a plain gather: each row of indices `[B.., N.., k]` gets its
/// batch coordinates in front, `[B.., N.., b + k]`, so it picks from its own batch entry.
fn prepend_batch_coordinates(
    imp: &mut Importer,
    cx: &NodeCx,
    idx: Sym,
    batch_dims: usize,
) -> Result<Sym, FrontendError> {
    let ty = imp.ty(&idx);
    if batch_dims + 1 > ty.rank() {
        return Err(cx.invalid(format!("batch_dims {batch_dims} leaves no index dims in indices {ty}")));
    }
    let rows = &ty.shape[..ty.rank() - 1];
    let mut coordinates = Vec::with_capacity(batch_dims);
    for d in 0..batch_dims {
        // Coordinate d of every row: a range along dim d, broadcast over the other dims.
        let mut along = vec![1; ty.rank()];
        along[d] = rows[d];
        let values: Vec<f64> = (0..rows[d]).map(|i| i as f64).collect();
        let range = Tensor::from_f64_values(ty.dtype, along, &values);
        let mut full: Vec<usize> = rows.to_vec();
        full.push(1);
        coordinates.push(imp.emit1(cx, Op::Expand { shape: full }, &[Sym::Const(range)])?);
    }
    coordinates.push(idx);
    imp.emit1(cx, Op::Concat { axis: ty.rank() - 1 }, &coordinates)
}

/// An operand of an einsum: its value and one label per dim (letters; the dims an ellipsis
/// stands for get `'0'`, `'1'`, ... aligned from the right, so they broadcast like numpy's).
struct Labelled {
    value: Sym,
    labels: Vec<char>,
}

/// An operand with a label repeated (`ii`) reduced to its diagonal: multiplied by an identity
/// mask over the two dims, then summed over the second.
fn take_diagonals(imp: &mut Importer, cx: &NodeCx, mut o: Labelled) -> Result<Labelled, FrontendError> {
    while let Some((first, second)) = (0..o.labels.len())
        .find_map(|d| o.labels[d + 1..].iter().position(|&c| c == o.labels[d]).map(|p| (d, d + 1 + p)))
    {
        let ty = imp.ty(&o.value);
        let n = ty.shape[first];
        if ty.shape[second] != n {
            return Err(cx.invalid(format!("a diagonal of dims of sizes {n} and {}", ty.shape[second])));
        }
        let mut mask_shape = vec![1; ty.rank()];
        (mask_shape[first], mask_shape[second]) = (n, n);
        let eye: Vec<f64> = (0..n * n).map(|i| if i / n == i % n { 1.0 } else { 0.0 }).collect();
        let eye = Tensor::from_f64_values(ty.dtype, mask_shape, &eye);
        let masked = imp.emit1(cx, Op::Binary(BinaryOp::Mul), &[o.value, Sym::Const(eye)])?;
        let sum = Op::Reduce { op: ReduceOp::Sum, axes: vec![second], keep_dims: false };
        o.value = imp.emit1(cx, sum, &[masked])?;
        o.labels.remove(second);
    }
    Ok(o)
}

/// `Einsum` of one or two operands as transposes, sums and one batched matmul: labels only in
/// one operand and not in the output are summed first; the two operands are laid out as
/// `[batch, free, contracted]` and `[batch, contracted, free]`, multiplied, and the result
/// permuted to the output's labels; a label repeated inside one operand takes its diagonal.
fn einsum(imp: &mut Importer, cx: &NodeCx, operands: Vec<Sym>) -> Result<Sym, FrontendError> {
    let equation: String =
        attr_string(cx, "equation").unwrap_or_default().chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match equation.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (equation.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != operands.len() || !(1..=2).contains(&terms.len()) {
        return Err(cx.invalid(format!(
            "equation '{equation}' for {} operands: one or two operands are supported",
            operands.len()
        )));
    }
    let ranks: Vec<usize> = operands.iter().map(|o| imp.ty(o).rank()).collect();
    let explicit = |t: &str| t.replace("...", "").chars().count();
    let ellipsis =
        terms.iter().zip(&ranks).map(|(t, &r)| if t.contains("...") { r.saturating_sub(explicit(t)) } else { 0 });
    let ellipsis_rank = ellipsis.max().unwrap_or(0);
    let ellipsis_labels: Vec<char> = (0..ellipsis_rank).map(|i| char::from(b'0' + i as u8)).collect();
    let expand = |term: &str, rank: usize| -> Result<Vec<char>, FrontendError> {
        let mut labels = Vec::new();
        let (before, after) = term.split_once("...").map_or((term, None), |(b, a)| (b, Some(a)));
        labels.extend(before.chars());
        if let Some(after) = after {
            let own = rank.saturating_sub(explicit(term));
            labels.extend(&ellipsis_labels[ellipsis_rank - own..]);
            labels.extend(after.chars());
        }
        if labels.len() != rank || labels.iter().any(|c| !(c.is_ascii_alphanumeric())) {
            return Err(
                cx.invalid(format!("equation '{equation}': term '{term}' does not match a rank-{rank} operand"))
            );
        }
        Ok(labels)
    };
    let mut ops: Vec<Labelled> = Vec::new();
    for ((term, value), &rank) in terms.iter().zip(operands).zip(&ranks) {
        let operand = Labelled { labels: expand(term, rank)?, value };
        ops.push(take_diagonals(imp, cx, operand)?);
    }
    let count = |c: char| ops.iter().filter(|o| o.labels.contains(&c)).count();
    let output: Vec<char> = match &rhs {
        Some(r) => expand(r, explicit(r) + if r.contains("...") { ellipsis_rank } else { 0 })?,
        None => {
            let mut once: Vec<char> = ops
                .iter()
                .flat_map(|o| o.labels.iter().copied())
                .filter(|c| c.is_ascii_alphabetic() && count(*c) == 1)
                .collect();
            once.sort_unstable();
            once.dedup();
            ellipsis_labels.iter().copied().chain(once).collect()
        }
    };
    // Sum each operand's labels that neither the other operand nor the output has.
    for k in 0..ops.len() {
        let other: Vec<char> =
            ops.iter().enumerate().filter(|(j, _)| *j != k).flat_map(|(_, o)| o.labels.clone()).collect();
        let summed: Vec<usize> = (0..ops[k].labels.len())
            .filter(|&d| !output.contains(&ops[k].labels[d]) && !other.contains(&ops[k].labels[d]))
            .collect();
        if !summed.is_empty() {
            let op = Op::Reduce { op: ReduceOp::Sum, axes: summed.clone(), keep_dims: false };
            ops[k].value = imp.emit1(cx, op, &[ops[k].value.clone()])?;
            let labels =
                ops[k].labels.iter().enumerate().filter(|(d, _)| !summed.contains(d)).map(|(_, c)| *c).collect();
            ops[k].labels = labels;
        }
    }
    let permute = |imp: &mut Importer, o: Labelled, order: &[char]| -> Result<Sym, FrontendError> {
        let perm: Vec<usize> =
            order.iter().map(|c| o.labels.iter().position(|l| l == c).expect("a label of o")).collect();
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            Ok(o.value)
        } else {
            imp.emit1(cx, Op::Transpose { perm }, &[o.value])
        }
    };
    if ops.len() == 1 {
        let only = ops.pop().expect("one operand");
        return permute(imp, only, &output);
    }
    let b_op = ops.pop().expect("two operands");
    let a_op = ops.pop().expect("two operands");
    let size_of = |o: &Labelled, imp: &Importer, c: char| {
        imp.ty(&o.value).shape[o.labels.iter().position(|l| *l == c).expect("label")]
    };
    let batch: Vec<char> =
        a_op.labels.iter().copied().filter(|c| b_op.labels.contains(c) && output.contains(c)).collect();
    let contracted: Vec<char> =
        a_op.labels.iter().copied().filter(|c| b_op.labels.contains(c) && !output.contains(c)).collect();
    let a_free: Vec<char> = a_op.labels.iter().copied().filter(|c| !b_op.labels.contains(c)).collect();
    let b_free: Vec<char> = b_op.labels.iter().copied().filter(|c| !a_op.labels.contains(c)).collect();
    // Shared labels must agree in size, but for numpy broadcasting of 1s.
    let mut sizes = std::collections::BTreeMap::new();
    for &c in batch.iter().chain(&contracted) {
        let (sa, sb) = (size_of(&a_op, imp, c), size_of(&b_op, imp, c));
        if sa != sb && sa != 1 && sb != 1 {
            return Err(
                cx.invalid(format!("equation '{equation}': label '{c}' is {sa} in one operand and {sb} in the other"))
            );
        }
        sizes.insert(c, sa.max(sb));
    }
    for &c in &a_free {
        sizes.insert(c, size_of(&a_op, imp, c));
    }
    for &c in &b_free {
        sizes.insert(c, size_of(&b_op, imp, c));
    }
    let product = |labels: &[char]| labels.iter().map(|c| sizes[c]).product::<usize>();
    let lay_out =
        |imp: &mut Importer, o: Labelled, order: Vec<char>, shape: Vec<usize>| -> Result<Sym, FrontendError> {
            let full: Vec<usize> = order.iter().map(|c| sizes[c]).collect();
            let mut v = permute(imp, o, &order)?;
            if imp.ty(&v).shape != full {
                v = imp.emit1(cx, Op::Expand { shape: full }, &[v])?;
            }
            imp.emit1(cx, Op::Reshape { shape }, &[v])
        };
    let (nb, m, k, n) = (product(&batch), product(&a_free), product(&contracted), product(&b_free));
    let a = lay_out(imp, a_op, [&batch[..], &a_free, &contracted].concat(), vec![nb, m, k])?;
    let b = lay_out(imp, b_op, [&batch[..], &contracted, &b_free].concat(), vec![nb, k, n])?;
    let y = imp.emit1(cx, Op::MatMul { transpose_lhs: false, transpose_rhs: false }, &[a, b])?;
    let labels: Vec<char> = [&batch[..], &a_free, &b_free].concat();
    let shape: Vec<usize> = labels.iter().map(|c| sizes[c]).collect();
    let y = imp.emit1(cx, Op::Reshape { shape }, &[y])?;
    permute(imp, Labelled { value: y, labels }, &output)
}

/// `RotaryEmbedding` (opset 23) as the arithmetic of its reference: the first
/// `rotary_embedding_dim` features of each head rotated by position, as halves
/// (`[x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos]`) or, `interleaved`, as pairs of even and
/// odd features; the other features pass through. The input is `[batch, heads, seq, head]`, or
/// `[batch, seq, hidden]` with `num_heads`; the caches are `[positions, rotary/2]` read at
/// `position_ids`, or `[batch, seq, rotary/2]` (or `[1, seq, rotary/2]`, for every sequence)
/// without them.
fn convert_rotary_embedding(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
    let x = input(imp, cx, 0)?;
    let (mut cos, mut sin) = (input(imp, cx, 1)?, input(imp, cx, 2)?);
    let shape = imp.ty(&x).shape;
    let interleaved = attr_int(cx, "interleaved", 0) == 1;
    // Work over [batch, heads, seq, head] (4-D input) or [batch, seq, heads, head] (3-D).
    let (x, heads_at) = match shape.len() {
        4 => (x, 1),
        3 => {
            let heads = usize::try_from(attr_int(cx, "num_heads", 0)).unwrap_or(0);
            if heads == 0 || !shape[2].is_multiple_of(heads) {
                return Err(cx.invalid(format!("num_heads {heads} does not divide the hidden size {}", shape[2])));
            }
            (imp.emit1(cx, Op::Reshape { shape: vec![shape[0], shape[1], heads, shape[2] / heads] }, &[x])?, 2)
        }
        rank => return Err(cx.invalid(format!("input of rank {rank}: expected 3 or 4"))),
    };
    let work = imp.ty(&x).shape;
    let head = work[3];
    let rotary = match usize::try_from(attr_int(cx, "rotary_embedding_dim", 0)).unwrap_or(0) {
        0 => head,
        r => r,
    };
    if rotary > head || rotary % 2 != 0 {
        return Err(cx.invalid(format!("rotary_embedding_dim {rotary} must be even and at most the head size {head}")));
    }
    let half = rotary / 2;
    // The caches at each position: [batch, seq, rotary/2], then a unit dim for the heads.
    if let Some(positions) = opt_input(imp, cx, 3)? {
        cos = imp.emit1(cx, Op::Gather { axis: 0 }, &[cos, positions.clone()])?;
        sin = imp.emit1(cx, Op::Gather { axis: 0 }, &[sin, positions])?;
    }
    let (batch, seq) = (shape[0], if heads_at == 1 { work[2] } else { work[1] });
    let mut cached = Vec::new();
    for cache in [cos, sin] {
        let cs = imp.ty(&cache).shape;
        if cs.len() != 3 || (cs[0] != batch && cs[0] != 1) || cs[1] != seq || cs[2] < half {
            return Err(cx.invalid(format!(
                "a cache of shape {cs:?} for {batch} sequences of {seq} positions and {half} rotated pairs"
            )));
        }
        let cache = slice_last(imp, cx, cache, 0, half, 1)?;
        let mut with_heads = vec![cs[0], seq, half];
        with_heads.insert(heads_at, 1);
        cached.push(imp.emit1(cx, Op::Reshape { shape: with_heads }, &[cache])?);
    }
    let (cos, sin) = (cached[0].clone(), cached[1].clone());
    let rotated = if rotary == head { x.clone() } else { slice_last(imp, cx, x.clone(), 0, rotary, 1)? };
    let (x1, x2) = if interleaved {
        (slice_last(imp, cx, rotated.clone(), 0, rotary, 2)?, slice_last(imp, cx, rotated, 1, rotary, 2)?)
    } else {
        (slice_last(imp, cx, rotated.clone(), 0, half, 1)?, slice_last(imp, cx, rotated, half, rotary, 1)?)
    };
    let mut binary = |op: BinaryOp, a: Sym, b: Sym| imp.emit1(cx, Op::Binary(op), &[a, b]);
    let (x1_cos, x2_sin) =
        (binary(BinaryOp::Mul, x1.clone(), cos.clone())?, binary(BinaryOp::Mul, x2.clone(), sin.clone())?);
    let real = binary(BinaryOp::Sub, x1_cos, x2_sin)?;
    let (x1_sin, x2_cos) = (binary(BinaryOp::Mul, x1, sin)?, binary(BinaryOp::Mul, x2, cos)?);
    let imaginary = binary(BinaryOp::Add, x1_sin, x2_cos)?;
    let mut y = if interleaved {
        // Pairs back in place: [.., half, 2] -> [.., rotary].
        let pair = |imp: &mut Importer, v: Sym| {
            let mut s = imp.ty(&v).shape;
            s.push(1);
            imp.emit1(cx, Op::Reshape { shape: s }, &[v])
        };
        let (real, imaginary) = (pair(imp, real)?, pair(imp, imaginary)?);
        let pairs = imp.emit1(cx, Op::Concat { axis: 4 }, &[real, imaginary])?;
        imp.emit1(cx, Op::Reshape { shape: [&work[..3], &[rotary]].concat() }, &[pairs])?
    } else {
        imp.emit1(cx, Op::Concat { axis: 3 }, &[real, imaginary])?
    };
    if rotary < head {
        let passed = slice_last(imp, cx, x, rotary, head, 1)?;
        y = imp.emit1(cx, Op::Concat { axis: 3 }, &[y, passed])?;
    }
    if shape.len() == 3 {
        y = imp.emit1(cx, Op::Reshape { shape }, &[y])?;
    }
    Ok(vec![y])
}

/// Elements `start..end` by `step` of dim `axis` of `x` (the normalised form of `Op::Slice`:
/// a negative step ends at -1 to reach element 0).
fn slice_axis(
    imp: &mut Importer,
    cx: &NodeCx,
    x: Sym,
    axis: usize,
    start: usize,
    end: i64,
    step: i64,
) -> Result<Sym, FrontendError> {
    let shape = imp.ty(&x).shape;
    let mut starts = vec![0; shape.len()];
    let mut ends: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let mut steps = vec![1; shape.len()];
    (starts[axis], ends[axis], steps[axis]) = (start, end, step);
    imp.emit1(cx, Op::Slice { starts, ends, steps }, &[x])
}

/// Elements `start..end` by `step` of the last dim of `x`.
fn slice_last(
    imp: &mut Importer,
    cx: &NodeCx,
    x: Sym,
    start: usize,
    end: usize,
    step: i64,
) -> Result<Sym, FrontendError> {
    let last = imp.ty(&x).rank() - 1;
    slice_axis(imp, cx, x, last, start, end as i64, step)
}

/// `SplitToSequence`'s items: pieces of the given sizes (a 1-D `split`), of one size (a scalar
/// `split`, the last piece shorter), or of one element each (no `split`; without the axis when
/// `keepdims` is 0).
fn split_to_sequence(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
    let x = input(imp, cx, 0)?;
    let shape = imp.ty(&x).shape;
    let axis = norm_axis(cx, attr_int(cx, "axis", 0), shape.len())?;
    let length = shape[axis];
    let split = match opt_input(imp, cx, 1)? {
        Some(sym) => Some(constant(cx, &sym, 1)?.clone()),
        None => None,
    };
    let sizes = match &split {
        Some(split) if split.shape().is_empty() => {
            let chunk = usize::try_from(split.get_i64(0)).ok().filter(|&c| c > 0);
            let chunk =
                chunk.ok_or_else(|| cx.invalid(format!("split {} is not a positive size", split.get_i64(0))))?;
            (0..length.div_ceil(chunk)).map(|i| chunk.min(length - i * chunk)).collect()
        }
        Some(split) => dims(&split.to_i64_vec(), cx, "split")?,
        None => vec![1; length],
    };
    if sizes.iter().sum::<usize>() != length {
        return Err(cx.invalid(format!("split sizes {sizes:?} do not add up to the axis' {length}")));
    }
    let pieces = imp.emit(cx, Op::Split { axis, sizes: sizes.clone() }, &[x], sizes.len())?;
    if split.is_some() || attr_int(cx, "keepdims", 1) == 1 {
        return Ok(pieces);
    }
    let mut squeezed = shape.clone();
    squeezed.remove(axis);
    pieces.into_iter().map(|p| imp.emit1(cx, Op::Reshape { shape: squeezed.clone() }, &[p])).collect()
}
