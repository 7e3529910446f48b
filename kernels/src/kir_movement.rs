//! Data movement as kernel IR: the builtin expand, transpose, slice, pad, concat and split
//! kernels written as [`kir`] kernels, so a GPU runs them as generated code (its PTX made when
//! a plan loads) instead of copying their operands to the host.
//!
//! Each output element is read from its place in an input (an index of the loop variables:
//! broadcast, permuted, strided or offset), or, for pad and concat, chosen among inputs and the
//! pad value by comparing its coordinate along the padded or concatenated dim with the inputs'
//! ranges (an input's coordinate wraps inside its length, as kernelgen's pad does, so every read
//! is in bounds and [`kir::Kernel::check`] proves it). Elements are moved, never computed, so
//! the results are the builtin kernels' bit for bit. Element types: those the kernel IR loads;
//! other kernels and negative slice steps have no form here. Empty tensors (a partial rotary
//! embedding's empty pass-through part) need none: an empty output is no kernel at all, an
//! empty part of a split or concat is left out, and a pad of an empty input is a fill.

use crate::kir::{self, Expr, Index, Stage, Store, Term, Var};
use crate::shape::{broadcast_strides, strides};
use crate::{BinaryOp, DType, Kernel};

/// One kernel of a builtin instruction's movement: its buffers are the instruction's inputs
/// `inputs` then its outputs `outputs` (positions in the instruction's lists).
#[derive(Clone, Debug, PartialEq)]
pub struct MovementKernel {
    pub kernel: kir::Kernel,
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
}

/// The iteration space of an output of shape `shape`: its last dim inner, the rest outer.
struct Space<'a> {
    shape: &'a [usize],
}

impl Space<'_> {
    fn rank(&self) -> usize {
        self.shape.len()
    }

    fn inner(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    fn outer(&self) -> usize {
        self.shape[..self.rank().saturating_sub(1)].iter().product()
    }

    /// Coordinate `d` of the element at (outer, inner), times `stride`.
    fn term(&self, d: usize, stride: usize) -> Term {
        let last = self.rank() - 1;
        if d == last {
            return Term::new(Var::Inner, 1, None, stride);
        }
        let div = self.shape[d + 1..last].iter().product();
        let modulo = (d > 0).then_some(self.shape[d]);
        Term::new(Var::Outer, div, modulo, stride)
    }

    /// `base` plus coordinate `d` times `strides[d]` over every dim longer than 1.
    fn index(&self, base: usize, strides: &[usize]) -> Index {
        let terms = (0..self.rank()).filter(|&d| self.shape[d] > 1).map(|d| self.term(d, strides[d])).collect();
        Index { base, terms }.plus(Index::default())
    }

    /// Coordinate `d` as an i64 value.
    fn coordinate(&self, d: usize) -> Expr {
        Expr::Coord(Index { base: 0, terms: vec![self.term(d, 1)] })
    }

    /// Whole output, row-major.
    fn output(&self) -> Index {
        self.index(0, &strides(self.shape))
    }

    /// A kernel storing `exprs`' last value at every output element.
    fn kernel(&self, name: &str, dtype: DType, inputs: Vec<usize>, exprs: Vec<Expr>) -> kir::Kernel {
        let numel: usize = self.shape.iter().product();
        let mut buffers: Vec<kir::Buffer> = inputs.iter().map(|&len| kir::Buffer { dtype, len }).collect();
        buffers.push(kir::Buffer { dtype, len: numel });
        let value = exprs.len() as kir::ExprRef - 1;
        let store = Store { buffer: inputs.len(), index: self.output(), value };
        kir::Kernel {
            name: format!("move.{name}"),
            num_inputs: inputs.len(),
            buffers,
            outer: self.outer(),
            inner: self.inner(),
            stages: vec![Stage::Map { exprs, stores: vec![store] }],
        }
    }
}

/// Pushes `e` and returns its position.
fn push(exprs: &mut Vec<Expr>, e: Expr) -> kir::ExprRef {
    exprs.push(e);
    exprs.len() as kir::ExprRef - 1
}

/// `low <= coordinate d < high` as a bool expression.
fn within(space: &Space, exprs: &mut Vec<Expr>, d: usize, low: usize, high: usize) -> kir::ExprRef {
    let c = push(exprs, space.coordinate(d));
    let (l, h) = (push(exprs, Expr::I64(low as i64)), push(exprs, Expr::I64(high as i64)));
    let above = push(exprs, Expr::Binary(BinaryOp::GreaterEqual, c, l));
    let below = push(exprs, Expr::Binary(BinaryOp::Less, c, h));
    push(exprs, Expr::Binary(BinaryOp::And, above, below))
}

/// Term `d` of `index` made to read coordinate `c - start` of a dim of length `len`, wrapped
/// into `0..len` (read only where the coordinate is in `start..start + len`).
fn shift(index: &mut Index, space: &Space, d: usize, stride: usize, start: usize, len: usize) {
    index.terms.retain(|t| *t != space.term(d, stride));
    let mut term = space.term(d, stride);
    term.offset = (len - start % len) % len;
    term.wrap = Some(len);
    index.terms.push(term);
}

/// The movement kernels of `kernel`, or `None` where it has no form here (see the module doc).
pub fn movement_kernels(kernel: &Kernel) -> Option<Vec<MovementKernel>> {
    let single = |k: kir::Kernel| Some(vec![MovementKernel { kernel: k, inputs: vec![0], outputs: vec![0] }]);
    let numel = |shape: &[usize]| shape.iter().product::<usize>();
    let kernels = match kernel {
        _ if writes_nothing(kernel) => Vec::new(),
        Kernel::Pad { dtype, shape, out, value, .. } if usable(*dtype, out) && numel(shape) == 0 => {
            let space = Space { shape: out };
            single(space.kernel("fill", *dtype, vec![0], vec![constant(*dtype, *value)?]))?
        }
        Kernel::Expand { dtype, shape, out } if usable(*dtype, out) && numel(shape) > 0 => {
            let space = Space { shape: out };
            let load = Expr::Load { buffer: 0, index: space.index(0, &broadcast_strides(shape, out)) };
            single(space.kernel("expand", *dtype, vec![numel(shape)], vec![load]))?
        }
        Kernel::Transpose { dtype, shape, perm } => {
            let out: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
            if !usable(*dtype, &out) {
                return None;
            }
            let own = strides(shape);
            let space = Space { shape: &out };
            let load =
                Expr::Load { buffer: 0, index: space.index(0, &perm.iter().map(|&p| own[p]).collect::<Vec<_>>()) };
            single(space.kernel("transpose", *dtype, vec![numel(shape)], vec![load]))?
        }
        Kernel::Slice { dtype, shape, starts, steps, out } if usable(*dtype, out) && steps.iter().all(|&s| s > 0) => {
            let own = strides(shape);
            let base = starts.iter().zip(&own).map(|(s, o)| s * o).sum();
            let stepped: Vec<usize> = own.iter().zip(steps).map(|(&o, &s)| o * s as usize).collect();
            let space = Space { shape: out };
            let load = Expr::Load { buffer: 0, index: space.index(base, &stepped) };
            single(space.kernel("slice", *dtype, vec![numel(shape)], vec![load]))?
        }
        Kernel::Pad { dtype, shape, begin, out, value } if usable(*dtype, out) && numel(shape) > 0 => {
            let space = Space { shape: out };
            let own = strides(shape);
            let mut index = space.index(0, &own);
            let mut exprs = Vec::new();
            let mut inside = None;
            for d in 0..out.len() {
                if shape[d] != out[d] {
                    shift(&mut index, &space, d, own[d], begin[d], shape[d]);
                    let here = within(&space, &mut exprs, d, begin[d], begin[d] + shape[d]);
                    inside = Some(match inside {
                        Some(before) => push(&mut exprs, Expr::Binary(BinaryOp::And, before, here)),
                        None => here,
                    });
                }
            }
            let load = push(&mut exprs, Expr::Load { buffer: 0, index });
            if let Some(inside) = inside {
                let fill = push(&mut exprs, constant(*dtype, *value)?);
                push(&mut exprs, Expr::Select(inside, load, fill));
            }
            single(space.kernel("pad", *dtype, vec![numel(shape)], exprs))?
        }
        Kernel::Concat { dtype, shapes, axis } => {
            let mut out = shapes.first()?.clone();
            out[*axis] = shapes.iter().map(|s| s[*axis]).sum();
            if !usable(*dtype, &out) {
                return None;
            }
            let space = Space { shape: &out };
            let mut exprs = Vec::new();
            let mut value: Option<kir::ExprRef> = None;
            let mut start = 0;
            let mut parts = Vec::new();
            for (j, shape) in shapes.iter().enumerate() {
                let len = shape[*axis];
                if len > 0 {
                    parts.push((j, start, len));
                }
                start += len;
            }
            let inputs: Vec<usize> = parts.iter().map(|&(j, ..)| j).collect();
            // The last part is read where no earlier one is; each earlier one where it lies.
            for (b, &(j, start, len)) in parts.iter().enumerate().rev() {
                let own = strides(&shapes[j]);
                let mut index = space.index(0, &own);
                if len != out[*axis] {
                    shift(&mut index, &space, *axis, own[*axis], start, len);
                }
                let load = push(&mut exprs, Expr::Load { buffer: b, index });
                value = Some(match value {
                    None => load,
                    Some(later) => {
                        let here = within(&space, &mut exprs, *axis, start, start + len);
                        push(&mut exprs, Expr::Select(here, load, later))
                    }
                });
            }
            value?;
            let lens = inputs.iter().map(|&j| numel(&shapes[j])).collect();
            vec![MovementKernel { kernel: space.kernel("concat", *dtype, lens, exprs), inputs, outputs: vec![0] }]
        }
        Kernel::Split { dtype, shape, axis, sizes } => {
            let own = strides(shape);
            let mut start = 0;
            let mut kernels = Vec::new();
            for (j, &size) in sizes.iter().enumerate() {
                let mut out = shape.clone();
                out[*axis] = size;
                if out.contains(&0) {
                    continue;
                }
                if !usable(*dtype, &out) {
                    return None;
                }
                let space = Space { shape: &out };
                let load = Expr::Load { buffer: 0, index: space.index(start * own[*axis], &own) };
                let kernel = space.kernel("split", *dtype, vec![numel(shape)], vec![load]);
                kernels.push(MovementKernel { kernel, inputs: vec![0], outputs: vec![j] });
                start += size;
            }
            kernels
        }
        _ => return None,
    };
    kernels.iter().all(|k| k.kernel.check().is_ok()).then_some(kernels)
}

/// Whether `kernel` is a movement whose outputs are all empty.
fn writes_nothing(kernel: &Kernel) -> bool {
    match kernel {
        Kernel::Expand { out, .. } | Kernel::Slice { out, .. } | Kernel::Pad { out, .. } => out.contains(&0),
        Kernel::Transpose { shape, .. } => shape.contains(&0),
        Kernel::Concat { shapes, axis, .. } => {
            let along: usize = shapes.iter().map(|s| s.get(*axis).copied().unwrap_or(0)).sum();
            let across = shapes.first().is_some_and(|s| s.iter().enumerate().any(|(d, &n)| d != *axis && n == 0));
            along == 0 || across
        }
        Kernel::Split { shape, .. } => shape.contains(&0),
        _ => false,
    }
}

/// Whether the kernel IR moves elements of `dtype` into a non-empty output of `shape`.
fn usable(dtype: DType, shape: &[usize]) -> bool {
    kir::scalar_type(dtype).is_some() && !shape.is_empty() && shape.iter().all(|&d| d > 0)
}

/// The pad value as a constant of the element type.
fn constant(dtype: DType, value: f64) -> Option<Expr> {
    match kir::scalar_type(dtype)? {
        kir::ScalarType::F32 => Some(Expr::F32(value as f32)),
        kir::ScalarType::I64 => Some(Expr::I64(value as i64)),
        kir::ScalarType::Bool => None,
    }
}
