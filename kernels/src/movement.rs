//! Kernels that move elements without arithmetic: transpose, slice, concat, split, expand,
//! gather, gather-elements, pad and triangular masks. They work on the element's bits, so one
//! implementation serves every dtype of the same size.

use rayon::prelude::*;

use crate::scalar::with_bits_type;
use crate::shape::{numel, rows_per_task, strides};
use crate::{view, view_mut, DType, KernelError};

/// Fills `out` (shape `out_shape`) row by row, reading element `i` of each row from
/// `input[base(row) + i * inner_stride]`.
fn gather_rows<T: Copy + Send + Sync>(
    input: &[T],
    out: &mut [T],
    out_shape: &[usize],
    src_strides: &[usize],
    base: usize,
) {
    let rank = out_shape.len();
    if rank == 0 {
        out[0] = input[base];
        return;
    }
    let inner = out_shape[rank - 1];
    if inner == 0 {
        return;
    }
    let inner_stride = src_strides[rank - 1];
    let outer = &out_shape[..rank - 1];
    out.par_chunks_mut(inner).with_min_len(rows_per_task(inner)).enumerate().for_each(|(mut row, o)| {
        let mut off = base;
        for d in (0..outer.len()).rev() {
            off += (row % outer[d]) * src_strides[d];
            row /= outer[d];
        }
        if inner_stride == 1 {
            o.copy_from_slice(&input[off..off + inner]);
        } else {
            for (i, slot) in o.iter_mut().enumerate() {
                *slot = input[off + i * inner_stride];
            }
        }
    });
}

pub(crate) fn transpose(
    dtype: DType,
    shape: &[usize],
    perm: &[usize],
    input: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let in_strides = strides(shape);
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let src: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    with_bits_type!(dtype, T => gather_rows::<T>(&view(input), view_mut(out)?, &out_shape, &src, 0));
    Ok(())
}

/// `out[i] = input[start + i * step]` along every axis; steps may be negative.
pub(crate) fn slice(
    dtype: DType,
    shape: &[usize],
    starts: &[usize],
    steps: &[i64],
    out_shape: &[usize],
    input: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let in_strides = strides(shape);
    let base: usize = starts.iter().zip(&in_strides).map(|(s, st)| s * st).sum();
    // Negative strides are expressed by offsetting: we compute with isize then check bounds.
    if steps.iter().all(|&s| s > 0) {
        let src: Vec<usize> = steps.iter().zip(&in_strides).map(|(&s, &st)| s as usize * st).collect();
        with_bits_type!(dtype, T => gather_rows::<T>(&view(input), view_mut(out)?, out_shape, &src, base));
        return Ok(());
    }
    with_bits_type!(dtype, T => {
        let input = view::<T>(input);
        let out = view_mut::<T>(out)?;
        let out_strides = strides(out_shape);
        for (i, slot) in out.iter_mut().enumerate() {
            let mut off = base as isize;
            for d in 0..out_shape.len() {
                let idx = (i / out_strides[d]) % out_shape[d];
                off += idx as isize * steps[d] as isize * in_strides[d] as isize;
            }
            *slot = input[off as usize];
        }
    });
    Ok(())
}

/// Concatenates inputs along `axis`.
pub(crate) fn concat(
    dtype: DType,
    shapes: &[Vec<usize>],
    axis: usize,
    inputs: &[&[u8]],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let size = dtype.size();
    let outer: usize = shapes[0][..axis].iter().product();
    let chunks: Vec<usize> = shapes.iter().map(|s| numel(&s[axis..]) * size).collect();
    let row: usize = chunks.iter().sum();
    for o in 0..outer {
        let mut at = o * row;
        for (input, &chunk) in inputs.iter().zip(&chunks) {
            out[at..at + chunk].copy_from_slice(&input[o * chunk..(o + 1) * chunk]);
            at += chunk;
        }
    }
    Ok(())
}

/// Splits along `axis` into pieces of the given sizes.
pub(crate) fn split(
    dtype: DType,
    shape: &[usize],
    axis: usize,
    sizes: &[usize],
    input: &[u8],
    outs: &mut [&mut [u8]],
) -> Result<(), KernelError> {
    let size = dtype.size();
    let outer: usize = shape[..axis].iter().product();
    let inner = numel(&shape[axis + 1..]) * size;
    let row = shape[axis] * inner;
    for o in 0..outer {
        let mut at = o * row;
        for (out, &len) in outs.iter_mut().zip(sizes) {
            let chunk = len * inner;
            out[o * chunk..(o + 1) * chunk].copy_from_slice(&input[at..at + chunk]);
            at += chunk;
        }
    }
    Ok(())
}

pub(crate) fn expand(
    dtype: DType,
    in_shape: &[usize],
    out_shape: &[usize],
    input: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let src = crate::shape::broadcast_strides(in_shape, out_shape);
    with_bits_type!(dtype, T => gather_rows::<T>(&view(input), view_mut(out)?, out_shape, &src, 0));
    Ok(())
}

fn read_indices(index_dtype: DType, indices: &[u8]) -> Result<Vec<i64>, KernelError> {
    match index_dtype {
        DType::I64 => Ok(view::<i64>(indices).into_owned()),
        DType::I32 => Ok(view::<i32>(indices).iter().map(|&v| v as i64).collect()),
        other => Err(KernelError::Unsupported { kernel: "gather", what: format!("{other} indices") }),
    }
}

fn resolve_index(index: i64, bound: usize, kernel: &'static str) -> Result<usize, KernelError> {
    let resolved = if index < 0 { index + bound as i64 } else { index };
    if resolved < 0 || resolved as usize >= bound {
        return Err(KernelError::IndexOutOfRange { kernel, index, bound });
    }
    Ok(resolved as usize)
}

/// Indices into a dimension of size `bound`, negatives counted from the end, all checked.
pub(crate) fn resolved_indices(
    index_dtype: DType,
    indices: &[u8],
    bound: usize,
    kernel: &'static str,
) -> Result<Vec<usize>, KernelError> {
    read_indices(index_dtype, indices)?.into_iter().map(|i| resolve_index(i, bound, kernel)).collect()
}

/// The rows of a table that one kernel holds along its indexed axis: all of them, or one
/// rank's block of a table split along that axis (a vocabulary-parallel embedding).
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    /// The global index of the first row held.
    pub start: usize,
    /// Rows held.
    pub len: usize,
    /// Rows of the whole table (negative indices count back from it).
    pub global_len: usize,
}

impl Rows {
    /// The held row that global index `i` names, if this kernel holds it.
    pub(crate) fn local(&self, i: usize) -> Option<usize> {
        i.checked_sub(self.start).filter(|&l| l < self.len)
    }
}

/// `out[o, i, r] = data[o, indices[i], r]` over `[outer, axis, inner]`; rows another rank holds
/// read as zeros.
// The shapes, rows and buffers are all distinct inputs of this kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather(
    dtype: DType,
    index_dtype: DType,
    data_shape: &[usize],
    axis: usize,
    rows: Rows,
    data: &[u8],
    indices: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let resolved = resolved_indices(index_dtype, indices, rows.global_len, "gather")?;
    let inner = numel(&data_shape[axis + 1..]) * dtype.size();
    if inner == 0 {
        return Ok(());
    }
    out.par_chunks_mut(inner).with_min_len(rows_per_task(inner)).enumerate().for_each(|(row, o)| {
        let (outer_idx, i) = (row / resolved.len(), row % resolved.len());
        match rows.local(resolved[i]) {
            Some(local) => {
                let src = (outer_idx * rows.len + local) * inner;
                o.copy_from_slice(&data[src..src + inner]);
            }
            None => o.fill(0),
        }
    });
    Ok(())
}

/// The gradient of `gather`: `out[o, indices[i], r] += updates[o, i, r]` into zeros of shape
/// `[outer, size, inner]` (`updates` is `[outer, indices, inner]`); updates of rows another rank
/// holds are skipped.
#[allow(clippy::too_many_arguments)]
pub(crate) fn scatter_add(
    dtype: DType,
    index_dtype: DType,
    out_shape: &[usize],
    axis: usize,
    rows: Rows,
    indices: &[u8],
    updates: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let resolved = resolved_indices(index_dtype, indices, rows.global_len, "scatter_add")?;
    let outer: usize = out_shape[..axis].iter().product();
    let inner = numel(&out_shape[axis + 1..]);
    out.fill(0);
    match dtype {
        DType::F32 | DType::F64 => crate::scalar::with_num_type!(dtype, T => {
            let updates = view::<T>(updates);
            let out = view_mut::<T>(out)?;
            // Rows of one outer index write disjoint output blocks: parallel over `outer`.
            out.par_chunks_mut((rows.len * inner).max(1)).with_min_len(1).enumerate().take(outer).for_each(|(o, block)| {
                for (i, &target) in resolved.iter().enumerate() {
                    let Some(local) = rows.local(target) else { continue };
                    let src = &updates[(o * resolved.len() + i) * inner..][..inner];
                    for (d, s) in block[local * inner..][..inner].iter_mut().zip(src) {
                        *d = crate::scalar::Num::add(*d, *s);
                    }
                }
            });
        }, _ => unreachable!()),
        // Half types sum in f32 and round once per output element.
        DType::F16 | DType::BF16 => {
            let wide_updates =
                crate::AlignedBuf::from_bytes(bytemuck::cast_slice(&crate::scalar::widen(dtype, updates)));
            let mut wide = crate::AlignedBuf::zeroed(out.len() / dtype.size() * 4);
            let (updates, sums) = (wide_updates.as_slice(), wide.as_mut_slice());
            scatter_add(DType::F32, index_dtype, out_shape, axis, rows, indices, updates, sums)?;
            crate::scalar::narrow(dtype, &view::<f32>(wide.as_slice()), out)?;
        }
        other => return Err(KernelError::Unsupported { kernel: "scatter_add", what: format!("{other}") }),
    }
    Ok(())
}

/// `out[idx] = data[idx with idx[axis] replaced by indices[idx]]`; out has the indices' shape.
// The shapes, axis and buffers are all distinct inputs of this kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather_elements(
    dtype: DType,
    index_dtype: DType,
    data_shape: &[usize],
    index_shape: &[usize],
    axis: usize,
    data: &[u8],
    indices: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let offsets = along_axis_offsets(index_dtype, indices, index_shape, data_shape, axis, "gather_elements")?;
    with_bits_type!(dtype, T => {
        let data = view::<T>(data);
        for (slot, &off) in view_mut::<T>(out)?.iter_mut().zip(&offsets) {
            *slot = data[off];
        }
    });
    Ok(())
}

/// For each element of `indices` (of `index_shape`), the offset in a tensor of `target_shape`
/// at the element's own coordinates with the one along `axis` replaced by its index (negatives
/// from the end, all checked): where `gather_elements` reads and `scatter_elements` adds.
fn along_axis_offsets(
    index_dtype: DType,
    indices: &[u8],
    index_shape: &[usize],
    target_shape: &[usize],
    axis: usize,
    kernel: &'static str,
) -> Result<Vec<usize>, KernelError> {
    let indices = read_indices(index_dtype, indices)?;
    let target_strides = strides(target_shape);
    let index_strides = strides(index_shape);
    (0..indices.len())
        .map(|i| {
            let mut off = 0;
            for d in 0..index_shape.len() {
                let coord = if d == axis {
                    resolve_index(indices[i], target_shape[d], kernel)?
                } else {
                    (i / index_strides[d]) % index_shape[d]
                };
                off += coord * target_strides[d];
            }
            Ok(off)
        })
        .collect()
}

/// Element offsets into `data_shape` picked by each row of `k` indices (the leading dims), with
/// the size of the slice each one starts.
fn nd_offsets(
    index_dtype: DType,
    indices: &[u8],
    index_shape: &[usize],
    data_shape: &[usize],
    kernel: &'static str,
) -> Result<(Vec<usize>, usize), KernelError> {
    let indices = read_indices(index_dtype, indices)?;
    let k = *index_shape.last().unwrap_or(&0);
    let data_strides = strides(data_shape);
    let slice: usize = data_shape[k..].iter().product();
    let rows = numel(&index_shape[..index_shape.len().saturating_sub(1)]);
    let mut offsets = Vec::with_capacity(rows);
    for r in 0..rows {
        let mut off = 0;
        for d in 0..k {
            off += resolve_index(indices[r * k + d], data_shape[d], kernel)? * data_strides[d];
        }
        offsets.push(off);
    }
    Ok((offsets, slice))
}

/// ONNX `GatherND` (no batch dims): each row of `k` indices picks a slice of `data`.
pub(crate) fn gather_nd(
    dtype: DType,
    index_dtype: DType,
    data_shape: &[usize],
    index_shape: &[usize],
    data: &[u8],
    indices: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let (offsets, slice) = nd_offsets(index_dtype, indices, index_shape, data_shape, "gather_nd")?;
    let size = dtype.size();
    for (r, off) in offsets.into_iter().enumerate() {
        out[r * slice * size..][..slice * size].copy_from_slice(&data[off * size..][..slice * size]);
    }
    Ok(())
}

/// ONNX `ScatterND`: `data` with each update slice written to (or combined with) the slice its
/// row of indices picks, rows in order (a repeated index: the last write wins, or all combine).
#[allow(clippy::too_many_arguments)]
pub(crate) fn scatter_nd(
    dtype: DType,
    index_dtype: DType,
    data_shape: &[usize],
    index_shape: &[usize],
    reduction: crate::ScatterReduction,
    data: &[u8],
    indices: &[u8],
    updates: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    use crate::scalar::Num;
    use crate::ScatterReduction as R;
    let (offsets, slice) = nd_offsets(index_dtype, indices, index_shape, data_shape, "scatter_nd")?;
    out.copy_from_slice(data);
    // Bools (a mask built by index_put): plain stores, and `or` / `and` for add / mul.
    if dtype == DType::Bool {
        for (r, off) in offsets.into_iter().enumerate() {
            for (o, &u) in out[off..off + slice].iter_mut().zip(&updates[r * slice..(r + 1) * slice]) {
                *o = match reduction {
                    R::None => u,
                    R::Add | R::Max => u8::from(*o != 0 || u != 0),
                    R::Mul | R::Min => u8::from(*o != 0 && u != 0),
                };
            }
        }
        return Ok(());
    }
    crate::scalar::with_num_type!(dtype, T => {
        let updates = view::<T>(updates);
        let out = view_mut::<T>(out)?;
        for (r, off) in offsets.into_iter().enumerate() {
            for (o, &u) in out[off..off + slice].iter_mut().zip(&updates[r * slice..(r + 1) * slice]) {
                *o = match reduction {
                    R::None => u,
                    R::Add => o.add(u),
                    R::Mul => o.mul(u),
                    R::Max => o.max_of(u),
                    R::Min => o.min_of(u),
                };
            }
        }
    }, other => return Err(KernelError::Unsupported { kernel: "scatter_nd", what: format!("{other} elements") }));
    Ok(())
}

/// The gradient of [`gather_elements`]: `out` starts at zero and each update is added at its
/// own position with the coordinate along `axis` replaced by its index (in order, so repeated
/// indices sum deterministically).
#[allow(clippy::too_many_arguments)]
pub(crate) fn scatter_elements(
    dtype: DType,
    index_dtype: DType,
    updates_shape: &[usize],
    out_shape: &[usize],
    axis: usize,
    indices: &[u8],
    updates: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let offsets = along_axis_offsets(index_dtype, indices, updates_shape, out_shape, axis, "scatter_elements")?;
    out.fill(0);
    match dtype {
        DType::F32 | DType::F64 => crate::scalar::with_num_type!(dtype, T => {
            let out = view_mut::<T>(out)?;
            for (&u, &off) in view::<T>(updates).iter().zip(&offsets) {
                out[off] = crate::scalar::Num::add(out[off], u);
            }
        }, _ => unreachable!()),
        other => return Err(KernelError::Unsupported { kernel: "scatter_elements", what: format!("{other}") }),
    }
    Ok(())
}

/// Constant padding: `begin[d]` elements before and the rest after along each axis.
pub(crate) fn pad(
    dtype: DType,
    shape: &[usize],
    begin: &[usize],
    out_shape: &[usize],
    value: f64,
    input: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let fill = crate::scalar_bytes(dtype, value);
    for chunk in out.chunks_mut(dtype.size()) {
        chunk.copy_from_slice(&fill);
    }
    let size = dtype.size();
    let in_strides = strides(shape);
    let out_strides = strides(out_shape);
    let rank = shape.len();
    let count = numel(shape);
    for i in 0..count {
        let mut off = 0;
        for d in 0..rank {
            off += ((i / in_strides[d]) % shape[d] + begin[d]) * out_strides[d];
        }
        out[off * size..(off + 1) * size].copy_from_slice(&input[i * size..(i + 1) * size]);
    }
    Ok(())
}

/// Keeps the upper (or lower) triangle of the last two dims relative to diagonal `k`.
pub(crate) fn triangle(
    dtype: DType,
    shape: &[usize],
    k: i64,
    upper: bool,
    input: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let rank = shape.len();
    let (rows, cols) = (shape[rank - 2], shape[rank - 1]);
    with_bits_type!(dtype, T => {
        let input = view::<T>(input);
        let out = view_mut::<T>(out)?;
        for (i, (o, &v)) in out.iter_mut().zip(input.iter()).enumerate() {
            let (r, c) = (((i / cols) % rows) as i64, (i % cols) as i64);
            let keep = if upper { c - r >= k } else { c - r <= k };
            *o = if keep { v } else { 0 as T };
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScatterReduction;

    /// A bool mask built by `index_put` (torch.export's): rows of `true` stored over `false`,
    /// and `or` as the sum.
    #[test]
    fn scatter_nd_stores_bools() -> Result<(), KernelError> {
        let data = [0u8; 6];
        let indices: Vec<u8> = [2i64, 0].iter().flat_map(|i| i.to_le_bytes()).collect();
        let updates = [1u8, 0, 1, 1];
        let mut out = [9u8; 6];
        let run = |reduction, out: &mut [u8]| {
            scatter_nd(DType::Bool, DType::I64, &[3, 2], &[2, 1], reduction, &data, &indices, &updates, out)
        };
        run(ScatterReduction::None, &mut out)?;
        assert_eq!(out, [1, 1, 0, 0, 1, 0]);
        run(ScatterReduction::Add, &mut out)?;
        assert_eq!(out, [1, 1, 0, 0, 1, 0]);
        Ok(())
    }
}
