//! Tensor sequences (torch.export's `torch.split`): they live only during import, their items
//! ordinary values.

use super::*;

/// The node's outputs, or `None` when its op is not of this family.
pub(super) fn convert(
    imp: &mut Importer,
    cx: &NodeCx,
    _external: &mut ExternalFiles,
) -> Result<Option<Vec<Sym>>, FrontendError> {
    let op_type = cx.node.op_type.as_str();
    let outputs: Result<Vec<Sym>, FrontendError> = match op_type {
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
        _ => return Ok(None),
    };
    outputs.map(Some)
}

/// `SplitToSequence`'s items: pieces of the given sizes (a 1-D `split`), of one size (a scalar
/// `split`, the last piece shorter), or of one element each (no `split`; without the axis when
/// `keepdims` is 0).
pub(super) fn split_to_sequence(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
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
