//! Reductions over any set of axes. Sums and products accumulate in f64; max and min compare
//! in the element type, so i64 extremes stay exact.

use rayon::prelude::*;

use crate::scalar::{narrow, widen, with_num_type, Num};
use crate::shape::numel;
use crate::{view, view_mut, DType, KernelError, ReduceOp};

/// Reduces the middle axis of an `[outer, len, inner]` block.
fn reduce_block<T: Num>(op: ReduceOp, input: &[T], len: usize, inner: usize, count: f64, out: &mut [T]) {
    out.par_chunks_mut(inner.max(1)).with_min_len(1).enumerate().for_each(|(o, row)| {
        for (i, slot) in row.iter_mut().enumerate() {
            let at = |r: usize| input[(o * len + r) * inner + i];
            *slot = match op {
                ReduceOp::Max => (1..len).fold(at(0), |acc, r| acc.max_of(at(r))),
                ReduceOp::Min => (1..len).fold(at(0), |acc, r| acc.min_of(at(r))),
                ReduceOp::Sum => T::from_f64((0..len).map(|r| at(r).to_f64()).sum()),
                ReduceOp::Mean => T::from_f64((0..len).map(|r| at(r).to_f64()).sum::<f64>() / count),
                ReduceOp::Prod => T::from_f64((0..len).map(|r| at(r).to_f64()).product()),
            };
        }
    });
}

fn reduce_typed<T: Num>(op: ReduceOp, shape: &[usize], axes: &[usize], input: &[T]) -> Result<Vec<T>, KernelError> {
    let count: f64 = axes.iter().map(|&a| shape[a] as f64).product();
    let mut current = input.to_vec();
    let mut dims = shape.to_vec();
    if axes.iter().any(|&a| dims[a] == 0) && matches!(op, ReduceOp::Max | ReduceOp::Min) {
        return Err(KernelError::Unsupported { kernel: "reduce", what: "max/min over an empty axis".into() });
    }
    // Reduce one axis at a time, last first; a mean divides by the full count at the end.
    for (step, &axis) in axes.iter().rev().enumerate() {
        let outer: usize = dims[..axis].iter().product();
        let inner: usize = dims[axis + 1..].iter().product();
        let len = dims[axis];
        let last = step + 1 == axes.len();
        let step_op = match op {
            ReduceOp::Mean if !last => ReduceOp::Sum,
            other => other,
        };
        let mut next = vec![T::zero(); outer * inner];
        if len == 0 {
            let empty = if op == ReduceOp::Prod { 1.0 } else { 0.0 };
            next.iter_mut().for_each(|v| *v = T::from_f64(empty));
        } else {
            reduce_block(step_op, &current, len, inner, count, &mut next);
        }
        current = next;
        dims[axis] = 1;
    }
    Ok(current)
}

pub(crate) fn reduce(
    op: ReduceOp,
    dtype: DType,
    shape: &[usize],
    axes: &[usize],
    input: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    debug_assert_eq!(input.len(), numel(shape) * dtype.size());
    match dtype {
        DType::F16 | DType::BF16 => {
            let wide = widen(dtype, input);
            let result = reduce_typed::<f32>(op, shape, axes, &wide)?;
            narrow(dtype, &result, out)
        }
        _ => with_num_type!(dtype, T => {
            let result = reduce_typed::<T>(op, shape, axes, &view::<T>(input))?;
            view_mut::<T>(out)?.copy_from_slice(&result);
            Ok(())
        }, _ => Err(KernelError::Unsupported { kernel: "reduce", what: format!("{} on {dtype}", op.name()) })),
    }
}

/// Running sums along the middle axis of an `[outer, len, inner]` block: `exclusive` leaves
/// each element out of its own sum (the first is 0), `reverse` runs from the end. Floats
/// accumulate in f64 and round each sum once (as torch's CPU `cumsum`); integers add exactly
/// in their own type, wrapping as numpy's does.
fn cumsum_block<T: Num>(input: &[T], len: usize, inner: usize, exclusive: bool, reverse: bool, out: &mut [T]) {
    // The running sum: an f64 for floats, the element type for integers.
    let add = |sum: f64, exact: T, x: T| if T::IS_INTEGER { (sum, exact.add(x)) } else { (sum + x.to_f64(), exact) };
    let value = |sum: f64, exact: T| if T::IS_INTEGER { exact } else { T::from_f64(sum) };
    out.par_chunks_mut((len * inner).max(1)).enumerate().for_each(|(o, block)| {
        for i in 0..inner {
            let (mut sum, mut exact) = (0f64, T::zero());
            for step in 0..len {
                let r = if reverse { len - 1 - step } else { step };
                let x = input[(o * len + r) * inner + i];
                if exclusive {
                    block[r * inner + i] = value(sum, exact);
                }
                (sum, exact) = add(sum, exact, x);
                if !exclusive {
                    block[r * inner + i] = value(sum, exact);
                }
            }
        }
    });
}

pub(crate) fn cumsum(
    dtype: DType,
    len: usize,
    inner: usize,
    exclusive: bool,
    reverse: bool,
    input: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    match dtype {
        DType::F16 | DType::BF16 => {
            let wide = widen(dtype, input);
            let mut result = vec![0f32; wide.len()];
            cumsum_block(&wide, len, inner, exclusive, reverse, &mut result);
            narrow(dtype, &result, out)
        }
        _ => with_num_type!(dtype, T => {
            cumsum_block::<T>(&view::<T>(input), len, inner, exclusive, reverse, view_mut::<T>(out)?);
            Ok(())
        }, _ => Err(KernelError::Unsupported { kernel: "cumsum", what: format!("{dtype} elements") })),
    }
}

/// The `k` largest (or smallest) elements along the middle axis of `[outer, len, inner]`, in
/// order, and their indices: equal values keep index order (ONNX's rule) and NaN counts as
/// the largest value (as torch's `topk`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn top_k(
    dtype: DType,
    len: usize,
    inner: usize,
    k: usize,
    largest: bool,
    input: &[u8],
    values: &mut [u8],
    indices: &mut [u8],
) -> Result<(), KernelError> {
    fn typed<T: Num>(
        input: &[T],
        len: usize,
        inner: usize,
        k: usize,
        largest: bool,
        values: &mut [T],
        indices: &mut [i64],
    ) {
        let order = |a: T, b: T| match (a.is_nan(), b.is_nan()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            _ => a.partial_cmp(&b).expect("no NaN"),
        };
        let mut positions: Vec<usize> = Vec::with_capacity(len);
        for o in 0..values.len() / (k * inner).max(1) {
            for i in 0..inner {
                let at = |r: usize| input[(o * len + r) * inner + i];
                positions.clear();
                positions.extend(0..len);
                // A stable sort: among equal values the lower index stays first.
                positions.sort_by(|&a, &b| if largest { order(at(b), at(a)) } else { order(at(a), at(b)) });
                for (j, &r) in positions[..k].iter().enumerate() {
                    values[(o * k + j) * inner + i] = at(r);
                    indices[(o * k + j) * inner + i] = r as i64;
                }
            }
        }
    }
    let indices = view_mut::<i64>(indices)?;
    match dtype {
        DType::F16 | DType::BF16 => {
            let wide = widen(dtype, input);
            let mut result = vec![0f32; indices.len()];
            typed(&wide, len, inner, k, largest, &mut result, indices);
            narrow(dtype, &result, values)
        }
        _ => with_num_type!(dtype, T => {
            typed::<T>(&view::<T>(input), len, inner, k, largest, view_mut::<T>(values)?, indices);
            Ok(())
        }, _ => Err(KernelError::Unsupported { kernel: "topk", what: format!("{dtype} elements") })),
    }
}
