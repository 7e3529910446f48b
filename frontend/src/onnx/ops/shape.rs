//! Data movement: reshapes, transposes, slices, pads, concats, splits, expands, tiles.

use super::*;

/// The node's outputs, or `None` when its op is not of this family.
pub(super) fn convert(
    imp: &mut Importer,
    cx: &NodeCx,
    _external: &mut ExternalFiles,
) -> Result<Option<Vec<Sym>>, FrontendError> {
    let op_type = cx.node.op_type.as_str();
    let outputs: Result<Vec<Sym>, FrontendError> = match op_type {
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
            // Negative entries count from the end (numpy's, and torch.export's for Mamba 2's
            // scan).
            let perm = match attr_ints(cx, "perm") {
                Some(p) => p.iter().map(|&a| norm_axis(cx, a, rank)).collect::<Result<Vec<_>, _>>()?,
                None => (0..rank).rev().collect(),
            };
            let mut sorted = perm.clone();
            sorted.sort_unstable();
            if !sorted.iter().copied().eq(0..rank) {
                return Err(cx.invalid(format!("perm {perm:?} is not a permutation of {rank} axes")));
            }
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
        "Expand" => {
            let x = input(imp, cx, 0)?;
            let s = imp.ty(&x).shape;
            let target = dims(&const_ints(imp, cx, 1)?.ok_or_else(|| cx.invalid("missing shape"))?, cx, "shape")?;
            let shape = autotp_ir::broadcast_shapes(&s, &target)
                .ok_or_else(|| cx.invalid(format!("cannot expand {s:?} to {target:?}")))?;
            one(imp.emit1(cx, Op::Expand { shape }, &[x])?)
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
        "Pad" => convert_pad(imp, cx),
        _ => return Ok(None),
    };
    outputs.map(Some)
}

pub(super) fn reshape_target(
    cx: &NodeCx,
    input: &[usize],
    target: &[i64],
    allow_zero: bool,
) -> Result<Vec<usize>, FrontendError> {
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

pub(super) fn convert_slice(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
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

pub(super) fn convert_pad(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
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
        Some(v) => constant_scalar(cx, &v, 2)?.get_f64(0),
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

/// Elements `start..end` by `step` of dim `axis` of `x` (the normalised form of `Op::Slice`:
/// a negative step ends at -1 to reach element 0).
pub(super) fn slice_axis(
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
pub(super) fn slice_last(
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
