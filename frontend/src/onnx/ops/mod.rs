//! Conversion of each supported ONNX op into IR ops, with ONNX's defaults and per-opset input
//! conventions (attributes that became inputs: Split, Squeeze/Unsqueeze, Reduce*, Pad, Slice,
//! Dropout). [`convert`] takes the elementwise tables here (unary, binary, reductions), then
//! asks each family in turn: [`elementwise`], [`constants`], [`shape`], [`sequence`],
//! [`indexing`], [`nn`] (with [`einsum`] and [`conv`]). A new op goes in its family's `match` and in
//! [`SUPPORTED_OPS`]; the attribute and input helpers below serve every family.

use autotp_ir::{BinaryOp, DType, GeluApprox, Op, ReduceOp, Reduction, Tensor, UnaryOp};

use super::proto::AttributeProto;
use super::tensor::{decode, ExternalFiles};
use super::{Importer, NodeCx, Sym};
use crate::FrontendError;

mod constants;
mod control;
mod conv;
mod einsum;
mod elementwise;
mod indexing;
mod nn;
mod sequence;
mod shape;

/// Every ONNX op type (default domain) the importer converts, sorted. The conformance manifest
/// lists the same set; a test keeps the two equal.
pub const SUPPORTED_OPS: &[&str] = &[
    "Abs",
    "Add",
    "And",
    "ArgMax",
    "ArgMin",
    "BitwiseAnd",
    "BitwiseNot",
    "BitwiseOr",
    "BitwiseXor",
    "Cast",
    "CastLike",
    "Ceil",
    "Clip",
    "Concat",
    "ConcatFromSequence",
    "Constant",
    "ConstantOfShape",
    "Conv",
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
    "If",
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
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "ReduceSumSquare",
    "Relu",
    "Reshape",
    "RotaryEmbedding",
    "Round",
    "ScatterElements",
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
    "Softplus",
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

pub(super) fn attr<'n>(cx: &NodeCx<'n>, name: &str) -> Option<&'n AttributeProto> {
    cx.node.attribute.iter().find(|a| a.name == name)
}

pub(super) fn attr_int(cx: &NodeCx, name: &str, default: i64) -> i64 {
    attr(cx, name).map(|a| a.i).unwrap_or(default)
}

pub(super) fn attr_float(cx: &NodeCx, name: &str, default: f32) -> f32 {
    attr(cx, name).map(|a| a.f).unwrap_or(default)
}

pub(super) fn attr_ints(cx: &NodeCx, name: &str) -> Option<Vec<i64>> {
    attr(cx, name).map(|a| a.ints.clone())
}

pub(super) fn attr_string(cx: &NodeCx, name: &str) -> Option<String> {
    attr(cx, name).map(|a| String::from_utf8_lossy(&a.s).into_owned())
}

/// Input `i`, or `None` when it is absent or the empty name (an omitted optional input).
pub(super) fn opt_input(imp: &Importer, cx: &NodeCx, i: usize) -> Result<Option<Sym>, FrontendError> {
    match cx.node.input.get(i).map(String::as_str) {
        None | Some("") => Ok(None),
        Some(name) => imp.lookup(cx, name).map(Some),
    }
}

pub(super) fn input(imp: &Importer, cx: &NodeCx, i: usize) -> Result<Sym, FrontendError> {
    opt_input(imp, cx, i)?.ok_or_else(|| cx.invalid(format!("required input {i} is missing")))
}

pub(super) fn constant<'s>(cx: &NodeCx, sym: &'s Sym, i: usize) -> Result<&'s Tensor, FrontendError> {
    match sym {
        Sym::Const(t) => Ok(t),
        Sym::Value(_) => Err(FrontendError::NotConstant {
            op_type: cx.node.op_type.clone(),
            node: cx.node.name.clone(),
            input: cx.node.input.get(i).cloned().unwrap_or_default(),
        }),
    }
}

/// A constant input that holds one value (a scalar or a one-element tensor: `axis`, `k`,
/// `depth`...); an empty one is refused.
pub(super) fn constant_scalar<'s>(cx: &NodeCx, sym: &'s Sym, i: usize) -> Result<&'s Tensor, FrontendError> {
    let tensor = constant(cx, sym, i)?;
    if tensor.numel() == 0 {
        let name = cx.node.input.get(i).cloned().unwrap_or_default();
        return Err(cx.invalid(format!("input '{name}' is empty where it should hold one value")));
    }
    Ok(tensor)
}

/// A constant integer input (`shape`, `axes`, `pads`...), or `None` when omitted.
pub(super) fn const_ints(imp: &Importer, cx: &NodeCx, i: usize) -> Result<Option<Vec<i64>>, FrontendError> {
    match opt_input(imp, cx, i)? {
        None => Ok(None),
        Some(sym) => Ok(Some(constant(cx, &sym, i)?.to_i64_vec())),
    }
}

pub(super) fn norm_axis(cx: &NodeCx, axis: i64, rank: usize) -> Result<usize, FrontendError> {
    let r = rank as i64;
    if axis < -r || axis >= r {
        return Err(cx.invalid(format!("axis {axis} is out of range for rank {rank}")));
    }
    Ok(if axis < 0 { (axis + r) as usize } else { axis as usize })
}

pub(super) fn norm_axes(cx: &NodeCx, axes: &[i64], rank: usize) -> Result<Vec<usize>, FrontendError> {
    let mut out = axes.iter().map(|&a| norm_axis(cx, a, rank)).collect::<Result<Vec<_>, _>>()?;
    out.sort_unstable();
    if out.windows(2).any(|w| w[0] == w[1]) {
        return Err(cx.invalid(format!("axes {axes:?} repeat an axis")));
    }
    Ok(out)
}

pub(super) fn dims(values: &[i64], cx: &NodeCx, what: &str) -> Result<Vec<usize>, FrontendError> {
    values
        .iter()
        .map(|&v| usize::try_from(v).map_err(|_| cx.invalid(format!("{what} {values:?} has a negative entry"))))
        .collect()
}

pub(super) fn unary_op(op_type: &str) -> Option<UnaryOp> {
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
        "Softplus" => UnaryOp::Softplus,
        "Relu" => UnaryOp::Relu,
        "Sin" => UnaryOp::Sin,
        "Cos" => UnaryOp::Cos,
        "Floor" => UnaryOp::Floor,
        "Ceil" => UnaryOp::Ceil,
        "Round" => UnaryOp::Round,
        "Sign" => UnaryOp::Sign,
        "Not" | "BitwiseNot" => UnaryOp::Not,
        _ => return None,
    })
}

pub(super) fn binary_op(op_type: &str) -> Option<BinaryOp> {
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
        "And" | "BitwiseAnd" => BinaryOp::And,
        "Or" | "BitwiseOr" => BinaryOp::Or,
        "Xor" | "BitwiseXor" => BinaryOp::Xor,
        _ => return None,
    })
}

pub(super) fn reduce_op(op_type: &str) -> Option<ReduceOp> {
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
pub(super) fn unsqueezed_shape(cx: &NodeCx, shape: &[usize], axes: &[i64]) -> Result<Vec<usize>, FrontendError> {
    let rank = shape.len() + axes.len();
    let axes = norm_axes(cx, axes, rank)?;
    let mut rest = shape.iter();
    Ok((0..rank).map(|d| if axes.contains(&d) { 1 } else { *rest.next().expect("counted") }).collect())
}

/// A node's one output.
pub(super) fn one(s: Sym) -> Result<Vec<Sym>, FrontendError> {
    Ok(vec![s])
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
        return elementwise::convert_reduce(imp, cx, op);
    }
    if let Some(outputs) = elementwise::convert_composite_reduce(imp, cx)? {
        return Ok(outputs);
    }
    let families = [
        elementwise::convert,
        constants::convert,
        shape::convert,
        sequence::convert,
        indexing::convert,
        nn::convert,
        control::convert,
    ];
    for family in families {
        if let Some(outputs) = family(imp, cx, external)? {
            return Ok(outputs);
        }
    }
    Err(FrontendError::UnsupportedOp { op_type: op_type.to_string(), node: cx.node.name.clone(), opset: cx.opset })
}
