//! `Kernel`: the descriptor of one builtin kernel with every shape resolved, and its dispatch.
//! A kernel reads its inputs and writes its outputs as contiguous row-major byte slices.

use serde::{Deserialize, Serialize};

use crate::elementwise::BinaryShapes;
use crate::nn::ClassLossDims;
use crate::optim::{AdamWConfig, SgdConfig};
use crate::{BinaryOp, DType, GeluApprox, KernelError, MatMulDims, ReduceOp, UnaryOp};

/// One builtin kernel, with static shapes. Inputs and outputs are listed in the order
/// `run` takes them; see each variant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Kernel {
    /// `[x] -> [f(x)]`
    Unary { op: UnaryOp, dtype: DType },
    /// `[lhs, rhs] -> [lhs op rhs]`, numpy broadcasting; comparisons output bool.
    Binary { op: BinaryOp, dtype: DType, lhs: Vec<usize>, rhs: Vec<usize>, out: Vec<usize> },
    /// `[cond, x, y] -> [cond ? x : y]`, broadcasting.
    Select { dtype: DType, cond: Vec<usize>, x: Vec<usize>, y: Vec<usize>, out: Vec<usize> },
    /// `[x] -> [x as to]`
    Cast { from: DType, to: DType },
    /// `[x] -> [reduce(x, axes)]`; `axes` sorted and unique.
    Reduce { op: ReduceOp, dtype: DType, shape: Vec<usize>, axes: Vec<usize> },
    /// `[lhs, rhs] -> [lhs x rhs]`
    MatMul { dtype: DType, dims: MatMulDims },
    /// `[x] -> [x]` byte copy (reshape, identity).
    Copy,
    /// `[x] -> [transpose(x, perm)]`
    Transpose { dtype: DType, shape: Vec<usize>, perm: Vec<usize> },
    /// `[x] -> [x[starts + i * steps]]`
    Slice { dtype: DType, shape: Vec<usize>, starts: Vec<usize>, steps: Vec<i64>, out: Vec<usize> },
    /// `[x0, x1, ...] -> [concat(xs, axis)]`
    Concat { dtype: DType, shapes: Vec<Vec<usize>>, axis: usize },
    /// `[x] -> [y0, y1, ...]`
    Split { dtype: DType, shape: Vec<usize>, axis: usize, sizes: Vec<usize> },
    /// `[x] -> [broadcast(x, out)]`
    Expand { dtype: DType, shape: Vec<usize>, out: Vec<usize> },
    /// `[data, indices] -> [take(data, indices, axis)]`
    Gather { dtype: DType, index_dtype: DType, data: Vec<usize>, axis: usize },
    /// `[indices, updates] -> [zeros(out) with updates added at indices along axis]`
    ScatterAdd { dtype: DType, index_dtype: DType, out: Vec<usize>, axis: usize },
    /// `[data, indices] -> [take_along_axis(data, indices, axis)]`
    GatherElements { dtype: DType, index_dtype: DType, data: Vec<usize>, indices: Vec<usize>, axis: usize },
    /// `[x] -> [pad(x, value)]`
    Pad { dtype: DType, shape: Vec<usize>, begin: Vec<usize>, out: Vec<usize>, value: f64 },
    /// `[x] -> [triu(x, k)]` or tril when `upper` is false.
    Triangle { dtype: DType, shape: Vec<usize>, k: i64, upper: bool },
    /// `[x] -> [softmax(x)]` over the middle axis of `[outer, len, inner]`.
    Softmax { dtype: DType, outer: usize, len: usize, inner: usize, log: bool },
    /// `[x, scale, bias?] -> [y]` over rows of `cols`.
    LayerNorm { dtype: DType, cols: usize, eps: f64, bias: bool },
    /// `[x, scale] -> [y]` over rows of `cols`.
    RmsNorm { dtype: DType, cols: usize, eps: f64 },
    /// `[x] -> [gelu(x)]`
    Gelu { dtype: DType, approx: GeluApprox },
    /// `[scores, labels, weights?] -> [loss, log_prob?]`
    CrossEntropy { dtype: DType, label_dtype: DType, dims: ClassLossDims, weighted: bool, log_prob: bool },
    /// `[param, grad, m, v, lr, step] -> [param', m', v']` (lr and step are scalars).
    AdamW { dtype: DType, config: AdamWConfig },
    /// `[param, grad, momentum_buffer, lr] -> [param', momentum_buffer']`
    Sgd { dtype: DType, config: SgdConfig },
    /// `[log_probs, labels, weights?] -> [loss]`
    NllLoss { dtype: DType, label_dtype: DType, dims: ClassLossDims, weighted: bool },
}

impl Kernel {
    /// A short name for profiles and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Unary { .. } => "unary",
            Kernel::Binary { .. } => "binary",
            Kernel::Select { .. } => "select",
            Kernel::Cast { .. } => "cast",
            Kernel::Reduce { .. } => "reduce",
            Kernel::MatMul { .. } => "matmul",
            Kernel::Copy => "copy",
            Kernel::Transpose { .. } => "transpose",
            Kernel::Slice { .. } => "slice",
            Kernel::Concat { .. } => "concat",
            Kernel::Split { .. } => "split",
            Kernel::Expand { .. } => "expand",
            Kernel::Gather { .. } => "gather",
            Kernel::ScatterAdd { .. } => "scatter_add",
            Kernel::GatherElements { .. } => "gather_elements",
            Kernel::Pad { .. } => "pad",
            Kernel::Triangle { .. } => "triangle",
            Kernel::Softmax { .. } => "softmax",
            Kernel::LayerNorm { .. } => "layer_norm",
            Kernel::RmsNorm { .. } => "rms_norm",
            Kernel::Gelu { .. } => "gelu",
            Kernel::CrossEntropy { .. } => "cross_entropy",
            Kernel::NllLoss { .. } => "nll_loss",
            Kernel::AdamW { .. } => "adamw",
            Kernel::Sgd { .. } => "sgd",
        }
    }

    /// Runs the kernel. The slices must have the sizes the descriptor implies.
    pub fn run(&self, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<(), KernelError> {
        let arity = |n_in: usize, n_out: usize| {
            if inputs.len() < n_in || outputs.len() < n_out {
                Err(KernelError::Arity { kernel: self.name(), inputs: inputs.len(), outputs: outputs.len() })
            } else {
                Ok(())
            }
        };
        match self {
            Kernel::Unary { op, dtype } => {
                arity(1, 1)?;
                crate::elementwise::unary(*op, *dtype, inputs[0], outputs[0])
            }
            Kernel::Binary { op, dtype, lhs, rhs, out } => {
                arity(2, 1)?;
                let shapes = BinaryShapes { lhs, rhs, out };
                crate::elementwise::binary(*op, *dtype, &shapes, inputs[0], inputs[1], outputs[0])
            }
            Kernel::Select { dtype, cond, x, y, out } => {
                arity(3, 1)?;
                crate::elementwise::select(*dtype, [cond, x, y], out, inputs[0], inputs[1], inputs[2], outputs[0])
            }
            Kernel::Cast { from, to } => {
                arity(1, 1)?;
                crate::elementwise::cast(*from, *to, inputs[0], outputs[0])
            }
            Kernel::Reduce { op, dtype, shape, axes } => {
                arity(1, 1)?;
                crate::reduce::reduce(*op, *dtype, shape, axes, inputs[0], outputs[0])
            }
            Kernel::MatMul { dtype, dims } => {
                arity(2, 1)?;
                crate::matmul::matmul(*dtype, dims, inputs[0], inputs[1], outputs[0])
            }
            Kernel::Copy => {
                arity(1, 1)?;
                if inputs[0].len() != outputs[0].len() {
                    return Err(KernelError::BufferSize { kernel: "copy" });
                }
                outputs[0].copy_from_slice(inputs[0]);
                Ok(())
            }
            Kernel::Transpose { dtype, shape, perm } => {
                arity(1, 1)?;
                crate::movement::transpose(*dtype, shape, perm, inputs[0], outputs[0])
            }
            Kernel::Slice { dtype, shape, starts, steps, out } => {
                arity(1, 1)?;
                crate::movement::slice(*dtype, shape, starts, steps, out, inputs[0], outputs[0])
            }
            Kernel::Concat { dtype, shapes, axis } => {
                arity(shapes.len(), 1)?;
                crate::movement::concat(*dtype, shapes, *axis, inputs, outputs[0])
            }
            Kernel::Split { dtype, shape, axis, sizes } => {
                arity(1, sizes.len())?;
                crate::movement::split(*dtype, shape, *axis, sizes, inputs[0], outputs)
            }
            Kernel::Expand { dtype, shape, out } => {
                arity(1, 1)?;
                crate::movement::expand(*dtype, shape, out, inputs[0], outputs[0])
            }
            Kernel::Gather { dtype, index_dtype, data, axis } => {
                arity(2, 1)?;
                crate::movement::gather(*dtype, *index_dtype, data, *axis, inputs[0], inputs[1], outputs[0])
            }
            Kernel::ScatterAdd { dtype, index_dtype, out, axis } => {
                arity(2, 1)?;
                crate::movement::scatter_add(*dtype, *index_dtype, out, *axis, inputs[0], inputs[1], outputs[0])
            }
            Kernel::GatherElements { dtype, index_dtype, data, indices, axis } => {
                arity(2, 1)?;
                crate::movement::gather_elements(
                    *dtype,
                    *index_dtype,
                    data,
                    indices,
                    *axis,
                    inputs[0],
                    inputs[1],
                    outputs[0],
                )
            }
            Kernel::Pad { dtype, shape, begin, out, value } => {
                arity(1, 1)?;
                crate::movement::pad(*dtype, shape, begin, out, *value, inputs[0], outputs[0])
            }
            Kernel::Triangle { dtype, shape, k, upper } => {
                arity(1, 1)?;
                crate::movement::triangle(*dtype, shape, *k, *upper, inputs[0], outputs[0])
            }
            Kernel::Softmax { dtype, outer, len, inner, log } => {
                arity(1, 1)?;
                crate::nn::softmax(*dtype, *outer, *len, *inner, *log, inputs[0], outputs[0])
            }
            Kernel::LayerNorm { dtype, cols, eps, bias } => {
                arity(if *bias { 3 } else { 2 }, 1)?;
                crate::nn::layer_norm(*dtype, *cols, *eps, inputs[0], inputs[1], bias.then(|| inputs[2]), outputs[0])
            }
            Kernel::RmsNorm { dtype, cols, eps } => {
                arity(2, 1)?;
                crate::nn::rms_norm(*dtype, *cols, *eps, inputs[0], inputs[1], outputs[0])
            }
            Kernel::Gelu { dtype, approx } => {
                arity(1, 1)?;
                crate::nn::gelu(*dtype, *approx, inputs[0], outputs[0])
            }
            Kernel::CrossEntropy { dtype, label_dtype, dims, weighted, log_prob } => {
                let n_in = if *weighted { 3 } else { 2 };
                arity(n_in, if *log_prob { 2 } else { 1 })?;
                let (loss, rest) = outputs.split_first_mut().expect("arity checked");
                let log_prob = if *log_prob { rest.first_mut().map(|b| &mut **b) } else { None };
                let weights = weighted.then(|| inputs[2]);
                crate::nn::cross_entropy(*dtype, *label_dtype, dims, inputs[0], inputs[1], weights, loss, log_prob)
            }
            Kernel::AdamW { dtype, config } => {
                arity(6, 3)?;
                crate::optim::adamw(*dtype, config, inputs, outputs)
            }
            Kernel::Sgd { dtype, config } => {
                arity(4, 2)?;
                crate::optim::sgd(*dtype, config, inputs, outputs)
            }
            Kernel::NllLoss { dtype, label_dtype, dims, weighted } => {
                arity(if *weighted { 3 } else { 2 }, 1)?;
                let weights = weighted.then(|| inputs[2]);
                crate::nn::nll_loss(*dtype, *label_dtype, dims, inputs[0], inputs[1], weights, outputs[0])
            }
        }
    }
}
