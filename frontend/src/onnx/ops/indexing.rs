//! Gathers and scatters, top-k and arg-max, cumulative sums, one-hots.

use autotp_ir::ValueId;

use super::shape::slice_axis;
use super::*;

/// The node's outputs, or `None` when its op is not of this family.
pub(super) fn convert(
    imp: &mut Importer,
    cx: &NodeCx,
    _external: &mut ExternalFiles,
) -> Result<Option<Vec<Sym>>, FrontendError> {
    let op_type = cx.node.op_type.as_str();
    let outputs: Result<Vec<Sym>, FrontendError> = match op_type {
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
            let axis = constant_scalar(cx, &axis_sym, 1)?.get_i64(0);
            let axis = norm_axis(cx, axis, imp.ty(&x).rank())?;
            let (exclusive, reverse) = (attr_int(cx, "exclusive", 0) == 1, attr_int(cx, "reverse", 0) == 1);
            one(imp.emit1(cx, Op::CumSum { axis, exclusive, reverse }, &[x])?)
        }
        "TopK" => {
            let x = input(imp, cx, 0)?;
            let k_sym = input(imp, cx, 1)?;
            let k = constant_scalar(cx, &k_sym, 1)?.get_i64(0);
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
        "GatherND" => {
            let data = input(imp, cx, 0)?;
            let mut idx = input(imp, cx, 1)?;
            let batch_dims =
                usize::try_from(attr_int(cx, "batch_dims", 0)).map_err(|_| cx.invalid("batch_dims is negative"))?;
            if batch_dims > 0 {
                idx = prepend_batch_coordinates(imp, cx, idx, batch_dims)?;
            }
            // One coordinate an index (torch.export's `weight[experts]`): rows looked up by
            // index, the `gather` that passes recognise as a lookup (of experts' weights, say).
            let index_shape = imp.ty(&idx).shape;
            if let [outer @ .., 1] = &index_shape[..] {
                let rows = imp.emit1(cx, Op::Reshape { shape: outer.to_vec() }, &[idx])?;
                one(imp.emit1(cx, Op::Gather { axis: 0 }, &[data, rows])?)
            } else {
                one(imp.emit1(cx, Op::GatherNd, &[data, idx])?)
            }
        }
        "ScatterND" => {
            let reduction = scatter_reduction(cx)?;
            let [data, idx, updates] = [input(imp, cx, 0)?, input(imp, cx, 1)?, input(imp, cx, 2)?];
            let (data_shape, updates_shape) = (imp.ty(&data).shape, imp.ty(&updates).shape);
            let block = match (&idx, reduction) {
                (Sym::Const(indices), autotp_ir::ScatterReduction::None) => {
                    assigned_block(indices, &data_shape, &updates_shape)
                }
                (Sym::Value(indices), autotp_ir::ScatterReduction::None) => {
                    assigned_block_unfolded(&imp.graph, *indices, &data_shape, &updates_shape)
                }
                _ => None,
            };
            match block {
                Some((axis, start)) => one(assign_block(imp, cx, data, updates, axis, start)?),
                None => one(imp.emit1(cx, Op::ScatterNd { reduction }, &[data, idx, updates])?),
            }
        }
        "ScatterElements" => convert_scatter_elements(imp, cx),
        "OneHot" => {
            // where(unsqueeze(i mod depth, axis) == range(depth) along axis, on, off), negative
            // indices counting from the end (an index outside [-depth, depth) is all off).
            let indices = input(imp, cx, 0)?;
            let depth_sym = input(imp, cx, 1)?;
            let depth = constant_scalar(cx, &depth_sym, 1)?.get_f64(0);
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
        _ => return Ok(None),
    };
    outputs.map(Some)
}

/// `GatherND`'s `batch_dims = b` as a plain gather: each row of indices `[B.., N.., k]` gets its
/// batch coordinates in front, `[B.., N.., b + k]`, so it picks from its own batch entry.
pub(super) fn prepend_batch_coordinates(
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

/// ONNX's scatter `reduction` attribute (`none` when absent).
fn scatter_reduction(cx: &NodeCx) -> Result<autotp_ir::ScatterReduction, FrontendError> {
    let reduction = attr_string(cx, "reduction").unwrap_or_else(|| "none".into());
    autotp_ir::ScatterReduction::from_name(&reduction)
        .ok_or_else(|| cx.invalid(format!("unknown reduction '{reduction}'")))
}

/// ScatterElements as a ScatterND with every update's full coordinates: its own position, with
/// its index in place of coordinate `axis` (a negative index counting from the end); one value
/// scattered at indices a `topk` chose, as a mask ([`scatter_one_value`]).
fn convert_scatter_elements(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
    let reduction = scatter_reduction(cx)?;
    let (data, idx, updates) = (input(imp, cx, 0)?, input(imp, cx, 1)?, input(imp, cx, 2)?);
    let (dt, it) = (imp.ty(&data), imp.ty(&idx));
    let axis = norm_axis(cx, attr_int(cx, "axis", 0), dt.rank())?;
    if it.rank() != dt.rank() {
        return Err(cx.invalid(format!("indices {it} and data {dt} differ in rank")));
    }
    let non_negative = non_negative(imp, &idx);
    let beside_axis = (0..dt.rank()).all(|d| d == axis || it.shape[d] == dt.shape[d]);
    if let Some(value) = splat_value(&imp.graph, &updates) {
        if reduction == autotp_ir::ScatterReduction::None && beside_axis && non_negative {
            return one(scatter_one_value(imp, cx, data, idx, value, axis)?);
        }
    }
    let idx = if non_negative {
        idx
    } else {
        let scalar = |v: f64| Sym::Const(Tensor::full(it.dtype, vec![], v));
        let negative = imp.emit1(cx, Op::Binary(BinaryOp::Less), &[idx.clone(), scalar(0.0)])?;
        let size = scalar(dt.shape[axis] as f64);
        let wrapped = imp.emit1(cx, Op::Binary(BinaryOp::Add), &[idx.clone(), size])?;
        imp.emit1(cx, Op::Select, &[negative, wrapped, idx])?
    };
    let mut column = it.shape.clone();
    column.push(1);
    let mut coordinates = Vec::with_capacity(it.rank());
    for d in 0..it.rank() {
        if d == axis {
            coordinates.push(imp.emit1(cx, Op::Reshape { shape: column.clone() }, std::slice::from_ref(&idx))?);
            continue;
        }
        // Coordinate d of every update: a range along dim d, broadcast over the others.
        let mut along = vec![1; it.rank() + 1];
        along[d] = it.shape[d];
        let values: Vec<f64> = (0..it.shape[d]).map(|i| i as f64).collect();
        let range = Sym::Const(Tensor::from_f64_values(it.dtype, along, &values));
        coordinates.push(imp.emit1(cx, Op::Expand { shape: column.clone() }, &[range])?);
    }
    let coordinates = imp.emit1(cx, Op::Concat { axis: it.rank() }, &coordinates)?;
    one(imp.emit1(cx, Op::ScatterNd { reduction }, &[data, coordinates, updates])?)
}

/// ScatterElements of one value (DeepSeek-V3's group mask: ones at the chosen groups of
/// zeros): where any index along `axis` names a position, the value, else the data. Built
/// from a comparison with the positions, a maximum over the indices and a select, which a
/// GPU runs as generated kernels (it has no scatter).
fn scatter_one_value(
    imp: &mut Importer,
    cx: &NodeCx,
    data: Sym,
    idx: Sym,
    value: f64,
    axis: usize,
) -> Result<Sym, FrontendError> {
    let (dt, it) = (imp.ty(&data), imp.ty(&idx));
    let mut column = it.shape.clone();
    column.insert(axis + 1, 1);
    let idx = imp.emit1(cx, Op::Reshape { shape: column }, &[idx])?;
    let mut along = vec![1; dt.rank() + 1];
    along[axis + 1] = dt.shape[axis];
    let positions: Vec<f64> = (0..dt.shape[axis]).map(|i| i as f64).collect();
    let positions = Sym::Const(Tensor::from_f64_values(it.dtype, along, &positions));
    let named = imp.emit1(cx, Op::Binary(BinaryOp::Equal), &[idx, positions])?;
    let named = imp.emit1(cx, Op::Cast { to: DType::F32 }, &[named])?;
    let any = imp.emit1(cx, Op::Reduce { op: ReduceOp::Max, axes: vec![axis], keep_dims: false }, &[named])?;
    let half = Sym::Const(Tensor::full(DType::F32, vec![], 0.5));
    let chosen = imp.emit1(cx, Op::Binary(BinaryOp::Greater), &[any, half])?;
    let value = Sym::Const(Tensor::full(dt.dtype, vec![], value));
    imp.emit1(cx, Op::Select, &[chosen, value, data])
}

/// The one value `updates` holds everywhere, where it is a constant of one value or a
/// broadcast of one (at a real model's size the broadcast is past the import's folding limit
/// and stays an `expand`).
fn splat_value(graph: &autotp_ir::Graph, updates: &Sym) -> Option<f64> {
    let mut v = match updates {
        Sym::Const(t) => return t.is_splat().then(|| t.get_f64(0)),
        Sym::Value(v) => *v,
    };
    loop {
        let autotp_ir::Def::Node(n, _) = graph.value(v).def else { return None };
        let node = graph.node(n);
        match &node.op {
            Op::Expand { .. } => v = node.inputs[0],
            Op::Constant { value } => return value.is_splat().then(|| value.get_f64(0)),
            _ => return None,
        }
    }
}

/// Whether indices are known not to be negative: constants that are not, or positions that a
/// `topk` chose (a router's experts or groups), through reshapes and broadcasts. Negative
/// indices need arithmetic on integers, which runs on the host of a GPU plan.
fn non_negative(imp: &Importer, idx: &Sym) -> bool {
    let mut v = match idx {
        Sym::Const(t) => return t.to_i64_vec().iter().all(|&i| i >= 0),
        Sym::Value(v) => *v,
    };
    loop {
        let autotp_ir::Def::Node(n, output) = imp.graph.value(v).def else { return false };
        let node = imp.graph.node(n);
        match node.op {
            Op::TopK { .. } => return output == 1,
            Op::Reshape { .. } | Op::Expand { .. } | Op::Transpose { .. } => v = node.inputs[0],
            _ => return false,
        }
    }
}

/// Where constant ScatterND indices write a block that is whole on every axis but one (as
/// `x[..., a:b] = u` exports: every update's own coordinates, offset on that axis): the axis and
/// the block's start on it. `None` for any other pattern (repeated, permuted or scattered
/// positions), which stays a scatter.
fn assigned_block(indices: &Tensor, data: &[usize], updates: &[usize]) -> Option<(usize, usize)> {
    let (&depth, positions) = indices.shape().split_last()?;
    let axis = narrow_axis(depth, positions, data, updates)?;
    let values = indices.to_i64_vec();
    let start = usize::try_from(*values.get(axis)?).ok()?;
    if start + updates[axis] > data[axis] {
        return None;
    }
    // Every update's coordinates in row-major order, offset by `start` on `axis`.
    let mut coordinate = vec![0usize; depth];
    for tuple in values.chunks(depth) {
        let expected = coordinate.iter().enumerate().map(|(d, &c)| (c + if d == axis { start } else { 0 }) as i64);
        if !tuple.iter().copied().eq(expected) {
            return None;
        }
        for d in (0..depth).rev() {
            coordinate[d] += 1;
            if coordinate[d] < positions[d] {
                break;
            }
            coordinate[d] = 0;
        }
    }
    Some((axis, start))
}

/// Of indices of `depth` coordinates at `positions` into `data`, writing `updates`: the axis
/// the block they may write is narrower than the data on (0 when none is), where every update
/// has its full coordinates and at most one axis, among the indexed ones, is narrower.
fn narrow_axis(depth: usize, positions: &[usize], data: &[usize], updates: &[usize]) -> Option<usize> {
    let full_coordinates = depth > 0 && depth <= data.len() && positions.len() == depth;
    if !full_coordinates || updates.len() != data.len() || positions != &updates[..depth] {
        return None;
    }
    let narrow: Vec<usize> = (0..data.len()).filter(|&d| updates[d] != data[d]).collect();
    match narrow[..] {
        [] => Some(0),
        [axis] if axis < depth => Some(axis),
        _ => None,
    }
}

/// [`assigned_block`] for indices too large to fold at import (at a real sequence length, as
/// DeepSeek-V3's keys are assembled: `[1, 128, 4096, 128, 4]`): a concat along the last axis
/// of one coordinate per indexed axis, each a small constant expanded along every axis but its
/// own, on which it counts up from the block's start (0 on the whole axes).
fn assigned_block_unfolded(
    graph: &autotp_ir::Graph,
    indices: ValueId,
    data: &[usize],
    updates: &[usize],
) -> Option<(usize, usize)> {
    let (&depth, positions) = graph.ty(indices).shape.split_last()?;
    let axis = narrow_axis(depth, positions, data, updates)?;
    let autotp_ir::Def::Node(concat, _) = graph.value(indices).def else { return None };
    let concat = graph.node(concat);
    if concat.op != (Op::Concat { axis: depth }) || concat.inputs.len() != depth {
        return None;
    }
    let starts: Vec<usize> = (concat.inputs.iter().enumerate())
        .map(|(d, &coordinate)| coordinate_start(graph, coordinate, positions, d))
        .collect::<Option<_>>()?;
    let whole_from_zero = starts.iter().enumerate().all(|(d, &start)| d == axis || start == 0);
    (whole_from_zero && starts[axis] + updates[axis] <= data[axis]).then_some((axis, starts[axis]))
}

/// Where `coordinate` (`positions` and a trailing 1) is a constant (folded whole, or small and
/// expanded to `positions`, then reshaped) whose value at every position is its index along
/// axis `d` plus a start, and does not change along the other axes: that start.
fn coordinate_start(graph: &autotp_ir::Graph, coordinate: ValueId, positions: &[usize], d: usize) -> Option<usize> {
    let made_by = |v: ValueId| match graph.value(v).def {
        autotp_ir::Def::Node(n, _) => Some(graph.node(n)),
        _ => None,
    };
    // A shape with the indices' trailing 1 dropped.
    let at_positions = |shape: &[usize]| shape.strip_suffix(&[1]).unwrap_or(shape) == positions;
    let mut node = made_by(coordinate)?;
    if matches!(node.op, Op::Reshape { .. }) && at_positions(&graph.ty(node.inputs[0]).shape) {
        node = made_by(node.inputs[0])?;
    }
    if matches!(node.op, Op::Expand { .. }) && at_positions(&graph.ty(node.outputs[0]).shape) {
        node = made_by(node.inputs[0])?;
    }
    let Op::Constant { value } = &node.op else { return None };
    // The constant's shape right-aligned to the positions (each dim theirs or 1).
    let shape = value.shape();
    let shape = if shape.len() == positions.len() + 1 { shape.strip_suffix(&[1])? } else { shape };
    let leading = positions.len().checked_sub(shape.len())?;
    let aligned: Vec<usize> = std::iter::repeat_n(1, leading).chain(shape.iter().copied()).collect();
    let broadcasts = aligned.iter().zip(positions).all(|(&a, &p)| a == p || a == 1);
    if !broadcasts || aligned[d] != positions[d] {
        return None;
    }
    let values = value.to_i64_vec();
    let start = *values.first()?;
    let stride: usize = aligned[d + 1..].iter().product();
    let counts_along_d = values.iter().enumerate().all(|(i, &v)| v == start + ((i / stride) % aligned[d]) as i64);
    counts_along_d.then(|| usize::try_from(start).ok()).flatten()
}

/// `data` with its elements `start..start + len` of `axis` replaced by `updates`: the data
/// before, the updates and the data after, concatenated.
fn assign_block(
    imp: &mut Importer,
    cx: &NodeCx,
    data: Sym,
    updates: Sym,
    axis: usize,
    start: usize,
) -> Result<Sym, FrontendError> {
    let (size, len) = (imp.ty(&data).shape[axis], imp.ty(&updates).shape[axis]);
    let mut pieces = Vec::new();
    if start > 0 {
        pieces.push(slice_axis(imp, cx, data.clone(), axis, 0, start as i64, 1)?);
    }
    pieces.push(updates);
    if start + len < size {
        pieces.push(slice_axis(imp, cx, data, axis, start + len, size as i64, 1)?);
    }
    if pieces.len() == 1 {
        return Ok(pieces.remove(0));
    }
    imp.emit1(cx, Op::Concat { axis }, &pieces)
}

#[cfg(test)]
mod tests {
    use super::*;
    use autotp_ir::Graph;

    /// The indices of `x[:, :, start:start + n] = u` into `x: [2, 3, 8]`, built as the legacy
    /// exporter builds them past the folding limit: per axis, a small constant `expand`ed to the
    /// positions `[2, 3, n]` and reshaped to `[2, 3, n, 1]`, concatenated. `coordinates[d]` is
    /// axis `d`'s constant (its shape right-aligned to the positions).
    fn indices(coordinates: [Tensor; 3], n: usize) -> (Graph, ValueId) {
        let mut g = Graph::new("indices");
        let positions = vec![2, 3, n];
        let parts: Vec<ValueId> = (coordinates.into_iter())
            .map(|c| {
                let c = g.add(Op::Constant { value: c }, vec![]).unwrap();
                let expanded = g.add(Op::Expand { shape: positions.clone() }, vec![c]).unwrap();
                g.add(Op::Reshape { shape: vec![2, 3, n, 1] }, vec![expanded]).unwrap()
            })
            .collect();
        let concat = g.add(Op::Concat { axis: 3 }, parts).unwrap();
        (g, concat)
    }

    fn counting(shape: Vec<usize>, start: i64) -> Tensor {
        let n = shape.iter().product::<usize>() as i64;
        Tensor::from_i64(shape, &(start..start + n).collect::<Vec<_>>())
    }

    /// DeepSeek-V3's group mask scatters ones; at 32768 tokens x 4 groups they are a broadcast
    /// scalar, not a folded constant, and still one value.
    #[test]
    fn a_broadcast_constant_is_one_value() {
        let mut g = Graph::new("updates");
        let one = g.add(Op::Constant { value: Tensor::from_f32(vec![], &[1.0]) }, vec![]).unwrap();
        let ones = g.add(Op::Expand { shape: vec![32768, 4] }, vec![one]).unwrap();
        assert_eq!(splat_value(&g, &Sym::Value(ones)), Some(1.0));
        let counting = g.add(Op::Constant { value: Tensor::from_f32(vec![2], &[1.0, 2.0]) }, vec![]).unwrap();
        let counting = g.add(Op::Expand { shape: vec![32768, 2] }, vec![counting]).unwrap();
        assert_eq!(splat_value(&g, &Sym::Value(counting)), None);
        let computed = g.add(Op::Unary(autotp_ir::UnaryOp::Neg), vec![ones]).unwrap();
        assert_eq!(splat_value(&g, &Sym::Value(computed)), None);
        assert_eq!(splat_value(&g, &Sym::Const(Tensor::from_f32(vec![3], &[0.5; 3]))), Some(0.5));
    }

    #[test]
    fn an_assigned_block_is_found_from_unfolded_indices() {
        let (g, v) = indices([counting(vec![2, 1, 1], 0), counting(vec![3, 1], 0), counting(vec![4], 4)], 4);
        assert_eq!(assigned_block_unfolded(&g, v, &[2, 3, 8], &[2, 3, 4]), Some((2, 4)));
        // Past the data's end.
        let (g, v) = indices([counting(vec![2, 1, 1], 0), counting(vec![3, 1], 0), counting(vec![4], 5)], 4);
        assert_eq!(assigned_block_unfolded(&g, v, &[2, 3, 8], &[2, 3, 4]), None);
        // A whole axis written from 1, not 0.
        let (g, v) = indices([counting(vec![2, 1, 1], 0), counting(vec![3, 1], 1), counting(vec![4], 4)], 4);
        assert_eq!(assigned_block_unfolded(&g, v, &[2, 4, 8], &[2, 3, 4]), None);
        // Axis 1's coordinate counting along axis 2: scattered positions stay a scatter.
        let (g, v) = indices([counting(vec![2, 1, 1], 0), counting(vec![3], 0), counting(vec![3], 5)], 3);
        assert_eq!(assigned_block_unfolded(&g, v, &[2, 3, 8], &[2, 3, 3]), None);
        // A coordinate that repeats along its axis.
        let repeated = Tensor::from_i64(vec![3, 1], &[0, 0, 1]);
        let (g, v) = indices([counting(vec![2, 1, 1], 0), repeated, counting(vec![4], 4)], 4);
        assert_eq!(assigned_block_unfolded(&g, v, &[2, 3, 8], &[2, 3, 4]), None);
    }
}
