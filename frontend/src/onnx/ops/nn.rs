//! Matrix products, convolutions (in [`super::conv`]), softmax, norms, rotary embeddings, the
//! losses.

use super::einsum::einsum;
use super::shape::slice_last;
use super::*;

/// The node's outputs, or `None` when its op is not of this family.
pub(super) fn convert(
    imp: &mut Importer,
    cx: &NodeCx,
    _external: &mut ExternalFiles,
) -> Result<Option<Vec<Sym>>, FrontendError> {
    let op_type = cx.node.op_type.as_str();
    let outputs: Result<Vec<Sym>, FrontendError> = match op_type {
        "Einsum" => {
            let operands = (0..cx.node.input.len()).map(|i| input(imp, cx, i)).collect::<Result<Vec<_>, _>>()?;
            one(einsum(imp, cx, operands)?)
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
        "Conv" => super::conv::convert_conv(imp, cx),
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
        _ => return Ok(None),
    };
    outputs.map(Some)
}

/// ONNX MatMul: numpy semantics including 1-D operands.
pub(super) fn matmul(
    imp: &mut Importer,
    cx: &NodeCx,
    a: Sym,
    b: Sym,
    ta: bool,
    tb: bool,
) -> Result<Sym, FrontendError> {
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

/// `RotaryEmbedding` (opset 23) as the arithmetic of its reference: the first
/// `rotary_embedding_dim` features of each head rotated by position, as halves
/// (`[x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos]`) or, `interleaved`, as pairs of even and
/// odd features; the other features pass through. The input is `[batch, heads, seq, head]`, or
/// `[batch, seq, hidden]` with `num_heads`; the caches are `[positions, rotary/2]` read at
/// `position_ids`, or `[batch, seq, rotary/2]` (or `[1, seq, rotary/2]`, for every sequence)
/// without them.
pub(super) fn convert_rotary_embedding(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
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
