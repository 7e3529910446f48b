//! `Kernel`: the descriptor of one builtin kernel with every shape resolved, and its dispatch.
//! A kernel reads its inputs and writes its outputs as contiguous row-major byte slices.

use serde::{Deserialize, Serialize};

use crate::attention::{lse_dtype, AttentionDims, AttentionMask};
use crate::elementwise::BinaryShapes;
use crate::grouped::GroupedDims;
use crate::nn::ClassLossDims;
use crate::optim::{AdamWConfig, Optimizer, SgdConfig};
use crate::{BinaryOp, DType, GeluApprox, KernelError, MatMulDims, ReduceOp, ScatterReduction, UnaryOp};

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
    /// A mixture of experts' per-pair products with the experts' matrices read in place, one
    /// GEMM per expert (`grouped.rs`; the buffers by [`crate::grouped::GroupedForm`]).
    GroupedMatMul { dtype: DType, index_dtype: DType, dims: Box<GroupedDims> },
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
    /// `[data, indices] -> [take(data, indices, axis)]`; with a `block`, `data` is that block of
    /// the table and rows outside it read as zeros.
    Gather {
        dtype: DType,
        index_dtype: DType,
        data: Vec<usize>,
        axis: usize,
        #[serde(default)]
        block: Option<IndexBlock>,
    },
    /// `[indices, updates] -> [zeros(out) with updates added at indices along axis]`; with a
    /// `block`, `out` is that block of the result and updates outside it are skipped.
    ScatterAdd {
        dtype: DType,
        index_dtype: DType,
        out: Vec<usize>,
        axis: usize,
        #[serde(default)]
        block: Option<IndexBlock>,
    },
    /// `[data, indices] -> [take_along_axis(data, indices, axis)]`
    GatherElements { dtype: DType, index_dtype: DType, data: Vec<usize>, indices: Vec<usize>, axis: usize },
    /// `[data, indices] -> [data[indices[..., :k]] ...]` (ONNX `GatherND`, no batch dims).
    GatherNd { dtype: DType, index_dtype: DType, data: Vec<usize>, indices: Vec<usize> },
    /// `[data, indices, updates] -> [data with the updates scattered in]` (ONNX `ScatterND`).
    ScatterNd { dtype: DType, index_dtype: DType, data: Vec<usize>, indices: Vec<usize>, reduction: ScatterReduction },
    /// `[indices, updates] -> [zeros(out) with each update added at its index along axis]`
    ScatterElements { dtype: DType, index_dtype: DType, updates: Vec<usize>, out: Vec<usize>, axis: usize },
    /// `[x] -> [values, indices (i64)]`: the `k` largest (or smallest) along the middle axis of
    /// `[outer, len, inner]`.
    TopK { dtype: DType, outer: usize, len: usize, inner: usize, k: usize, largest: bool },
    /// `[x] -> [pad(x, value)]`
    Pad { dtype: DType, shape: Vec<usize>, begin: Vec<usize>, out: Vec<usize>, value: f64 },
    /// `[x] -> [cumsum(x)]` along the middle axis of `[outer, len, inner]`.
    CumSum { dtype: DType, outer: usize, len: usize, inner: usize, exclusive: bool, reverse: bool },
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
    /// `[q, k, v, bias?] -> [out, lse (f32)]`: attention without the scores (`attention.rs`).
    /// `generated`: run by the generated functions ([`crate::attention::AttentionFunction`])
    /// on a target that has them (codegen's choice); this kernel otherwise.
    Attention {
        dtype: DType,
        dims: AttentionDims,
        scale: f64,
        mask: AttentionMask,
        #[serde(default)]
        generated: bool,
    },
    /// `[q, k, v, bias?, out, lse, d_out] -> [dq, dk, dv]`: its backward.
    AttentionGrad {
        dtype: DType,
        dims: AttentionDims,
        scale: f64,
        mask: AttentionMask,
        #[serde(default)]
        generated: bool,
    },
}

/// One rank's block, along the indexed axis, of a table split over a mesh axis (a
/// vocabulary-parallel embedding): indices stay global, and the kernel serves those in
/// `[start, start + block length)`. Every rank runs the same program, so the program stores
/// `start` 0 and each rank sets its own with [`Kernel::place_blocks`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IndexBlock {
    /// The mesh axis whose coordinate picks the block.
    pub mesh_axis: usize,
    /// The global index of the block's first row.
    pub start: usize,
    /// The length of the whole indexed axis.
    pub global_len: usize,
}

impl Kernel {
    /// The element type of output `index` when it is a float type (the outputs that can hold
    /// an inf or a NaN); `None` for an integer or bool output and for a byte copy.
    pub fn float_output(&self, index: usize) -> Option<DType> {
        let dtype = match self {
            Kernel::Copy => return None,
            Kernel::Binary { op, .. } if op.is_comparison() || op.is_logical() => return None,
            Kernel::Unary { op, .. } if op.is_logical() => return None,
            Kernel::Cast { to, .. } => *to,
            Kernel::TopK { .. } if index == 1 => return None,
            Kernel::Attention { dtype, .. } if index == 1 => lse_dtype(*dtype),
            Kernel::Unary { dtype, .. }
            | Kernel::Binary { dtype, .. }
            | Kernel::Select { dtype, .. }
            | Kernel::Reduce { dtype, .. }
            | Kernel::MatMul { dtype, .. }
            | Kernel::GroupedMatMul { dtype, .. }
            | Kernel::Transpose { dtype, .. }
            | Kernel::Slice { dtype, .. }
            | Kernel::Concat { dtype, .. }
            | Kernel::Split { dtype, .. }
            | Kernel::Expand { dtype, .. }
            | Kernel::Gather { dtype, .. }
            | Kernel::ScatterAdd { dtype, .. }
            | Kernel::GatherElements { dtype, .. }
            | Kernel::GatherNd { dtype, .. }
            | Kernel::ScatterNd { dtype, .. }
            | Kernel::ScatterElements { dtype, .. }
            | Kernel::TopK { dtype, .. }
            | Kernel::Pad { dtype, .. }
            | Kernel::CumSum { dtype, .. }
            | Kernel::Triangle { dtype, .. }
            | Kernel::Softmax { dtype, .. }
            | Kernel::LayerNorm { dtype, .. }
            | Kernel::RmsNorm { dtype, .. }
            | Kernel::Gelu { dtype, .. }
            | Kernel::CrossEntropy { dtype, .. }
            | Kernel::AdamW { dtype, .. }
            | Kernel::Sgd { dtype, .. }
            | Kernel::NllLoss { dtype, .. }
            | Kernel::Attention { dtype, .. }
            | Kernel::AttentionGrad { dtype, .. } => *dtype,
        };
        dtype.is_float().then_some(dtype)
    }

    /// Sets the start of an [`IndexBlock`] kernel's block for the rank at `coords` (its
    /// coordinate on every mesh axis); other kernels are unchanged.
    pub fn place_blocks(&mut self, coords: &[usize]) {
        if let Kernel::Gather { data: shape, axis, block: Some(block), .. }
        | Kernel::ScatterAdd { out: shape, axis, block: Some(block), .. } = self
        {
            let coordinate = coords.get(block.mesh_axis).copied().unwrap_or(0);
            block.start = coordinate * shape[*axis];
        }
        if let Kernel::GroupedMatMul { dims, .. } = self {
            let experts = dims.experts;
            if let Some(block) = &mut dims.block {
                block.start = coords.get(block.mesh_axis).copied().unwrap_or(0) * experts;
            }
        }
    }

    /// The rows this kernel's table (gather) or result (scatter-add) holds.
    fn rows(shape: &[usize], axis: usize, block: &Option<IndexBlock>) -> crate::movement::Rows {
        let len = shape[axis];
        match block {
            Some(b) => crate::movement::Rows { start: b.start, len, global_len: b.global_len },
            None => crate::movement::Rows { start: 0, len, global_len: len },
        }
    }

    /// A short name for profiles and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Unary { .. } => "unary",
            Kernel::Binary { .. } => "binary",
            Kernel::Select { .. } => "select",
            Kernel::Cast { .. } => "cast",
            Kernel::Reduce { .. } => "reduce",
            Kernel::MatMul { .. } => "matmul",
            Kernel::GroupedMatMul { .. } => "grouped_matmul",
            Kernel::Copy => "copy",
            Kernel::Transpose { .. } => "transpose",
            Kernel::Slice { .. } => "slice",
            Kernel::Concat { .. } => "concat",
            Kernel::Split { .. } => "split",
            Kernel::Expand { .. } => "expand",
            Kernel::Gather { .. } => "gather",
            Kernel::ScatterAdd { .. } => "scatter_add",
            Kernel::GatherElements { .. } => "gather_elements",
            Kernel::ScatterElements { .. } => "scatter_elements",
            Kernel::GatherNd { .. } => "gather_nd",
            Kernel::ScatterNd { .. } => "scatter_nd",
            Kernel::TopK { .. } => "topk",
            Kernel::Pad { .. } => "pad",
            Kernel::Triangle { .. } => "triangle",
            Kernel::CumSum { .. } => "cumsum",
            Kernel::Softmax { .. } => "softmax",
            Kernel::LayerNorm { .. } => "layer_norm",
            Kernel::RmsNorm { .. } => "rms_norm",
            Kernel::Gelu { .. } => "gelu",
            Kernel::CrossEntropy { .. } => "cross_entropy",
            Kernel::NllLoss { .. } => "nll_loss",
            Kernel::Attention { .. } => "attention",
            Kernel::AttentionGrad { .. } => "attention_grad",
            Kernel::AdamW { .. } => "adamw",
            Kernel::Sgd { .. } => "sgd",
        }
    }

    /// Checks that buffers of these byte lengths are what the descriptor implies (arity and
    /// sizes), and that its axes and permutations are in range. A program loaded from a file runs
    /// this on every instruction before the first step, so `run` never indexes out of bounds.
    pub fn check_buffers(&self, inputs: &[usize], outputs: &[usize]) -> Result<(), KernelError> {
        let check = Buffers { kernel: self.name(), inputs, outputs };
        match self {
            Kernel::Unary { dtype, .. } | Kernel::Gelu { dtype, .. } => check.same(dtype.size()),
            Kernel::Copy => check.same(1),
            Kernel::Cast { from, to } => match (inputs, outputs) {
                ([i], [o]) if i % from.size() == 0 && i / from.size() * to.size() == *o => Ok(()),
                _ => check.fail(),
            },
            Kernel::Binary { op, dtype, lhs, rhs, out } => {
                let out_dtype = if op.is_comparison() { DType::Bool } else { *dtype };
                check.exact(&[bytes(*dtype, lhs), bytes(*dtype, rhs)], &[bytes(out_dtype, out)])
            }
            Kernel::Select { dtype, cond, x, y, out } => {
                check.exact(&[bytes(DType::Bool, cond), bytes(*dtype, x), bytes(*dtype, y)], &[bytes(*dtype, out)])
            }
            Kernel::Reduce { dtype, shape, axes, .. } => {
                check.require(axes.iter().all(|&a| a < shape.len()))?;
                let kept: usize = shape.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, d)| d).product();
                check.exact(&[bytes(*dtype, shape)], &[kept * dtype.size()])
            }
            Kernel::MatMul { dtype, dims } => check.matmul(*dtype, dims),
            Kernel::GroupedMatMul { dtype, index_dtype, dims } => {
                check.require(dims.is_valid())?;
                let (inputs, output) = dims.buffer_bytes(*dtype, *index_dtype);
                check.exact(&inputs, &[output])
            }
            Kernel::Transpose { dtype, shape, perm } => {
                let mut sorted = perm.clone();
                sorted.sort_unstable();
                check.require(sorted == (0..shape.len()).collect::<Vec<_>>())?;
                check.exact(&[bytes(*dtype, shape)], &[bytes(*dtype, shape)])
            }
            Kernel::Slice { dtype, shape, starts, steps, out } => {
                check.require(slice_in_range(shape, starts, steps, out))?;
                check.exact(&[bytes(*dtype, shape)], &[bytes(*dtype, out)])
            }
            Kernel::Concat { dtype, shapes, axis } => check.concat(*dtype, shapes, *axis),
            Kernel::Split { dtype, shape, axis, sizes } => check.split(*dtype, shape, *axis, sizes),
            Kernel::Expand { dtype, shape, out } => {
                check.require(crate::shape::broadcast_shapes(shape, out).as_deref() == Some(&out[..]))?;
                check.exact(&[bytes(*dtype, shape)], &[bytes(*dtype, out)])
            }
            Kernel::Gather { dtype, index_dtype, data, axis, .. } => {
                let ([data_len, index_len], [out_len]) = (inputs, outputs) else { return check.fail() };
                let want = check.indexed_rows_bytes(*dtype, *index_dtype, data, *axis, *index_len)?;
                check.require(*data_len == bytes(*dtype, data) && *out_len == want)
            }
            Kernel::ScatterAdd { dtype, index_dtype, out, axis, .. } => {
                let ([index_len, updates_len], [out_len]) = (inputs, outputs) else { return check.fail() };
                let want = check.indexed_rows_bytes(*dtype, *index_dtype, out, *axis, *index_len)?;
                check.require(*updates_len == want && *out_len == bytes(*dtype, out))
            }
            Kernel::GatherNd { dtype, index_dtype, data, indices } => {
                let picked = check.nd_picked_bytes(*dtype, data, indices)?;
                check.exact(&[bytes(*dtype, data), bytes(*index_dtype, indices)], &[picked])
            }
            Kernel::ScatterNd { dtype, index_dtype, data, indices, .. } => {
                let picked = check.nd_picked_bytes(*dtype, data, indices)?;
                let data_bytes = bytes(*dtype, data);
                check.exact(&[data_bytes, bytes(*index_dtype, indices), picked], &[data_bytes])
            }
            Kernel::ScatterElements { dtype, index_dtype, updates, out, axis } => {
                let same_outside_axis = (0..out.len()).all(|d| d == *axis || updates[d] == out[d]);
                check.require(*axis < out.len() && updates.len() == out.len() && same_outside_axis)?;
                check.exact(&[bytes(*index_dtype, updates), bytes(*dtype, updates)], &[bytes(*dtype, out)])
            }
            Kernel::TopK { dtype, outer, len, inner, k, .. } => {
                check.require(k <= len)?;
                let values = outer * k * inner * dtype.size();
                check.exact(&[outer * len * inner * dtype.size()], &[values, outer * k * inner * 8])
            }
            Kernel::GatherElements { dtype, index_dtype, data, indices, axis } => {
                check.require(*axis < data.len() && data.len() == indices.len())?;
                check.exact(&[bytes(*dtype, data), bytes(*index_dtype, indices)], &[bytes(*dtype, indices)])
            }
            Kernel::Pad { dtype, shape, begin, out, .. } => {
                let fits = shape.len() == out.len()
                    && begin.len() == shape.len()
                    && (0..shape.len()).all(|d| begin[d] + shape[d] <= out[d]);
                check.require(fits)?;
                check.exact(&[bytes(*dtype, shape)], &[bytes(*dtype, out)])
            }
            Kernel::Triangle { dtype, shape, .. } => {
                check.require(shape.len() >= 2)?;
                check.exact(&[bytes(*dtype, shape)], &[bytes(*dtype, shape)])
            }
            Kernel::Softmax { dtype, outer, len, inner, .. } | Kernel::CumSum { dtype, outer, len, inner, .. } => {
                let n = outer * len * inner * dtype.size();
                check.exact(&[n], &[n])
            }
            Kernel::LayerNorm { dtype, cols, bias, .. } => check.layer_norm(*dtype, *cols, *bias),
            Kernel::RmsNorm { dtype, cols, .. } => {
                let row = cols * dtype.size();
                match (inputs, outputs) {
                    ([x, scale], [y]) if x == y && row > 0 && x % row == 0 && *scale == row => Ok(()),
                    _ => check.fail(),
                }
            }
            Kernel::CrossEntropy { dtype, label_dtype, dims, weighted, log_prob } => {
                let scores = dims.n * dims.classes * dims.inner * dtype.size();
                let mut ins = vec![scores, dims.n * dims.inner * label_dtype.size()];
                if *weighted {
                    ins.push(dims.classes * dtype.size());
                }
                let mut outs = vec![self::loss_bytes(*dtype, dims)];
                if *log_prob {
                    outs.push(scores);
                }
                check.exact(&ins, &outs)
            }
            Kernel::NllLoss { dtype, label_dtype, dims, weighted } => {
                let mut ins =
                    vec![dims.n * dims.classes * dims.inner * dtype.size(), dims.n * dims.inner * label_dtype.size()];
                if *weighted {
                    ins.push(dims.classes * dtype.size());
                }
                check.exact(&ins, &[self::loss_bytes(*dtype, dims)])
            }
            Kernel::Attention { dtype, dims, .. } => {
                check.require(dims.is_valid())?;
                let [q, k, v, bias, out, lse] = dims.numels().map(|n| n * dtype.size());
                let mut ins = vec![q, k, v];
                ins.extend(dims.bias.is_some().then_some(bias));
                ins.extend(dims.query_runs.map(|runs| runs * 8));
                check.exact(&ins, &[out, lse / dtype.size() * lse_dtype(*dtype).size()])
            }
            Kernel::AttentionGrad { dtype, dims, .. } => {
                check.require(dims.is_valid())?;
                let [q, k, v, bias, out, lse] = dims.numels().map(|n| n * dtype.size());
                let mut ins = vec![q, k, v];
                ins.extend(dims.bias.is_some().then_some(bias));
                ins.extend([out, lse / dtype.size() * lse_dtype(*dtype).size(), out]);
                ins.extend(dims.query_runs.map(|runs| runs * 8));
                check.exact(&ins, &[q, k, v])
            }
            Kernel::AdamW { dtype, .. } => check.optimizer(*dtype, 2, 2),
            Kernel::Sgd { dtype, .. } => check.optimizer(*dtype, 1, 1),
        }
    }

    /// How many inputs and outputs `run` reads and writes at least; `None` for the optimizer
    /// steps, whose kernels check their own.
    fn arity(&self) -> Option<(usize, usize)> {
        Some(match self {
            Kernel::Unary { .. }
            | Kernel::Cast { .. }
            | Kernel::Reduce { .. }
            | Kernel::Copy
            | Kernel::Transpose { .. }
            | Kernel::Slice { .. }
            | Kernel::Expand { .. }
            | Kernel::Pad { .. }
            | Kernel::CumSum { .. }
            | Kernel::Triangle { .. }
            | Kernel::Softmax { .. }
            | Kernel::Gelu { .. } => (1, 1),
            Kernel::Binary { .. }
            | Kernel::MatMul { .. }
            | Kernel::Gather { .. }
            | Kernel::ScatterAdd { .. }
            | Kernel::GatherNd { .. }
            | Kernel::ScatterElements { .. }
            | Kernel::GatherElements { .. }
            | Kernel::RmsNorm { .. } => (2, 1),
            Kernel::Select { .. } | Kernel::ScatterNd { .. } | Kernel::GroupedMatMul { .. } => (3, 1),
            Kernel::Concat { shapes, .. } => (shapes.len(), 1),
            Kernel::Split { sizes, .. } => (1, sizes.len()),
            Kernel::TopK { .. } => (1, 2),
            Kernel::LayerNorm { bias, .. } => (if *bias { 3 } else { 2 }, 1),
            Kernel::CrossEntropy { weighted, log_prob, .. } => {
                (if *weighted { 3 } else { 2 }, if *log_prob { 2 } else { 1 })
            }
            Kernel::NllLoss { weighted, .. } => (if *weighted { 3 } else { 2 }, 1),
            Kernel::Attention { dims, .. } => {
                (3 + usize::from(dims.bias.is_some()) + usize::from(dims.query_runs.is_some()), 2)
            }
            Kernel::AttentionGrad { dims, .. } => {
                (6 + usize::from(dims.bias.is_some()) + usize::from(dims.query_runs.is_some()), 3)
            }
            Kernel::AdamW { .. } | Kernel::Sgd { .. } => return None,
        })
    }

    /// Runs the kernel. The slices must have the sizes the descriptor implies.
    pub fn run(&self, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<(), KernelError> {
        use crate::{elementwise, movement, nn, reduce};
        if let Some((n_in, n_out)) = self.arity() {
            if inputs.len() < n_in || outputs.len() < n_out {
                return Err(KernelError::Arity { kernel: self.name(), inputs: inputs.len(), outputs: outputs.len() });
            }
        }
        match self {
            Kernel::Unary { op, dtype } => elementwise::unary(*op, *dtype, inputs[0], outputs[0]),
            Kernel::Binary { op, dtype, lhs, rhs, out } => {
                let shapes = BinaryShapes { lhs, rhs, out };
                elementwise::binary(*op, *dtype, &shapes, inputs[0], inputs[1], outputs[0])
            }
            Kernel::Select { dtype, cond, x, y, out } => {
                elementwise::select(*dtype, [cond, x, y], out, inputs[0], inputs[1], inputs[2], outputs[0])
            }
            Kernel::Cast { from, to } => elementwise::cast(*from, *to, inputs[0], outputs[0]),
            Kernel::Reduce { op, dtype, shape, axes } => {
                reduce::reduce(*op, *dtype, shape, axes, inputs[0], outputs[0])
            }
            Kernel::MatMul { dtype, dims } => crate::matmul::matmul(*dtype, dims, inputs[0], inputs[1], outputs[0]),
            Kernel::GroupedMatMul { dtype, index_dtype, dims } => {
                crate::grouped::grouped_matmul(*dtype, *index_dtype, dims, &inputs[..3], outputs[0])
            }
            Kernel::Copy => {
                if inputs[0].len() != outputs[0].len() {
                    return Err(KernelError::BufferSize { kernel: "copy" });
                }
                outputs[0].copy_from_slice(inputs[0]);
                Ok(())
            }
            Kernel::Transpose { dtype, shape, perm } => movement::transpose(*dtype, shape, perm, inputs[0], outputs[0]),
            Kernel::Slice { dtype, shape, starts, steps, out } => {
                movement::slice(*dtype, shape, starts, steps, out, inputs[0], outputs[0])
            }
            Kernel::Concat { dtype, shapes, axis } => movement::concat(*dtype, shapes, *axis, inputs, outputs[0]),
            Kernel::Split { dtype, shape, axis, sizes } => {
                movement::split(*dtype, shape, *axis, sizes, inputs[0], outputs)
            }
            Kernel::Expand { dtype, shape, out } => movement::expand(*dtype, shape, out, inputs[0], outputs[0]),
            Kernel::Gather { dtype, index_dtype, data, axis, block } => {
                let rows = Kernel::rows(data, *axis, block);
                movement::gather(*dtype, *index_dtype, data, *axis, rows, inputs[0], inputs[1], outputs[0])
            }
            Kernel::ScatterAdd { dtype, index_dtype, out, axis, block } => {
                let rows = Kernel::rows(out, *axis, block);
                movement::scatter_add(*dtype, *index_dtype, out, *axis, rows, inputs[0], inputs[1], outputs[0])
            }
            Kernel::GatherNd { dtype, index_dtype, data, indices } => {
                movement::gather_nd(*dtype, *index_dtype, data, indices, inputs[0], inputs[1], outputs[0])
            }
            Kernel::ScatterNd { dtype, index_dtype, data, indices, reduction } => {
                let (data_in, idx, updates) = (inputs[0], inputs[1], inputs[2]);
                movement::scatter_nd(*dtype, *index_dtype, data, indices, *reduction, data_in, idx, updates, outputs[0])
            }
            Kernel::ScatterElements { dtype, index_dtype, updates, out, axis } => {
                let (idx, values) = (inputs[0], inputs[1]);
                movement::scatter_elements(*dtype, *index_dtype, updates, out, *axis, idx, values, outputs[0])
            }
            Kernel::TopK { dtype, len, inner, k, largest, .. } => {
                let [values, indices, ..] = outputs else { unreachable!("arity checked") };
                reduce::top_k(*dtype, *len, *inner, *k, *largest, inputs[0], values, indices)
            }
            Kernel::GatherElements { dtype, index_dtype, data, indices, axis } => {
                let (table, idx) = (inputs[0], inputs[1]);
                movement::gather_elements(*dtype, *index_dtype, data, indices, *axis, table, idx, outputs[0])
            }
            Kernel::Pad { dtype, shape, begin, out, value } => {
                movement::pad(*dtype, shape, begin, out, *value, inputs[0], outputs[0])
            }
            Kernel::CumSum { dtype, len, inner, exclusive, reverse, .. } => {
                reduce::cumsum(*dtype, *len, *inner, *exclusive, *reverse, inputs[0], outputs[0])
            }
            Kernel::Triangle { dtype, shape, k, upper } => {
                movement::triangle(*dtype, shape, *k, *upper, inputs[0], outputs[0])
            }
            Kernel::Softmax { dtype, outer, len, inner, log } => {
                nn::softmax(*dtype, *outer, *len, *inner, *log, inputs[0], outputs[0])
            }
            Kernel::LayerNorm { dtype, cols, eps, bias } => {
                nn::layer_norm(*dtype, *cols, *eps, inputs[0], inputs[1], bias.then(|| inputs[2]), outputs[0])
            }
            Kernel::RmsNorm { dtype, cols, eps } => nn::rms_norm(*dtype, *cols, *eps, inputs[0], inputs[1], outputs[0]),
            Kernel::Gelu { dtype, approx } => nn::gelu(*dtype, *approx, inputs[0], outputs[0]),
            Kernel::CrossEntropy { dtype, label_dtype, dims, weighted, log_prob } => {
                let (loss, rest) = outputs.split_first_mut().expect("arity checked");
                let log_prob = if *log_prob { rest.first_mut().map(|b| &mut **b) } else { None };
                let weights = weighted.then(|| inputs[2]);
                nn::cross_entropy(*dtype, *label_dtype, dims, inputs[0], inputs[1], weights, loss, log_prob)
            }
            Kernel::AdamW { dtype, config } => {
                crate::optim::single_tensor(*dtype, &Optimizer::AdamW(config.clone()), inputs, outputs)
            }
            Kernel::Sgd { dtype, config } => {
                crate::optim::single_tensor(*dtype, &Optimizer::Sgd(config.clone()), inputs, outputs)
            }
            Kernel::NllLoss { dtype, label_dtype, dims, weighted } => {
                let weights = weighted.then(|| inputs[2]);
                nn::nll_loss(*dtype, *label_dtype, dims, inputs[0], inputs[1], weights, outputs[0])
            }
            Kernel::Attention { dtype, dims, scale, mask, .. } => {
                let [out, lse, ..] = outputs else { unreachable!("arity checked") };
                crate::attention::forward(*dtype, dims, *scale, *mask, inputs, out, lse)
            }
            Kernel::AttentionGrad { dtype, dims, scale, mask, .. } => {
                crate::attention::backward(*dtype, dims, *scale, *mask, inputs, outputs)
            }
        }
    }
}

/// The bytes of a `dtype` tensor of `shape`.
fn bytes(dtype: DType, shape: &[usize]) -> usize {
    crate::numel(shape) * dtype.size()
}

/// Whether every element a slice reads lies inside its input.
fn slice_in_range(shape: &[usize], starts: &[usize], steps: &[i64], out: &[usize]) -> bool {
    starts.len() == shape.len()
        && steps.len() == shape.len()
        && out.len() == shape.len()
        && (0..shape.len()).all(|d| {
            out[d] == 0 || {
                let last = starts[d] as i64 + steps[d] * (out[d] as i64 - 1);
                starts[d] < shape[d] && last >= 0 && (last as usize) < shape[d]
            }
        })
}

/// The byte lengths of one instruction's buffers, checked against what a kernel implies; every
/// failure is a [`KernelError::BufferSize`] naming the kernel.
struct Buffers<'a> {
    kernel: &'static str,
    inputs: &'a [usize],
    outputs: &'a [usize],
}

impl Buffers<'_> {
    fn fail(&self) -> Result<(), KernelError> {
        Err(KernelError::BufferSize { kernel: self.kernel })
    }

    fn require(&self, holds: bool) -> Result<(), KernelError> {
        if holds {
            Ok(())
        } else {
            self.fail()
        }
    }

    /// Exactly these inputs and outputs.
    fn exact(&self, inputs: &[usize], outputs: &[usize]) -> Result<(), KernelError> {
        self.require(self.inputs == inputs && self.outputs == outputs)
    }

    /// Elementwise kernels without shapes: one input and one output of equal, whole size.
    fn same(&self, element: usize) -> Result<(), KernelError> {
        match (self.inputs, self.outputs) {
            ([i], [o]) if i == o && i % element == 0 => Ok(()),
            _ => self.fail(),
        }
    }

    fn matmul(&self, dtype: DType, dims: &MatMulDims) -> Result<(), KernelError> {
        let batch = |b: &[usize]| b.iter().product::<usize>();
        self.require(
            dims.lhs_batch.len() == dims.batch.len()
                && dims.rhs_batch.len() == dims.batch.len()
                && dims.layouts_in_bounds(),
        )?;
        let size = dtype.size();
        self.exact(
            &[batch(&dims.lhs_batch) * dims.m * dims.k * size, batch(&dims.rhs_batch) * dims.k * dims.n * size],
            &[batch(&dims.batch) * dims.m * dims.n * size],
        )
    }

    fn concat(&self, dtype: DType, shapes: &[Vec<usize>], axis: usize) -> Result<(), KernelError> {
        let Some(first) = shapes.first() else { return self.fail() };
        self.require(
            axis < first.len()
                && shapes.iter().all(|s| s.len() == first.len() && (0..s.len()).all(|d| d == axis || s[d] == first[d])),
        )?;
        let ins: Vec<usize> = shapes.iter().map(|s| bytes(dtype, s)).collect();
        self.exact(&ins, &[ins.iter().sum()])
    }

    fn split(&self, dtype: DType, shape: &[usize], axis: usize, sizes: &[usize]) -> Result<(), KernelError> {
        self.require(axis < shape.len() && sizes.iter().sum::<usize>() == shape[axis])?;
        let outs: Vec<usize> = sizes
            .iter()
            .map(|&n| {
                let mut s = shape.to_vec();
                s[axis] = n;
                bytes(dtype, &s)
            })
            .collect();
        self.exact(&[bytes(dtype, shape)], &outs)
    }

    /// The bytes a gather writes (or a scatter-add reads) for `index_len` bytes of indices into
    /// `axis` of `table`.
    fn indexed_rows_bytes(
        &self,
        dtype: DType,
        index_dtype: DType,
        table: &[usize],
        axis: usize,
        index_len: usize,
    ) -> Result<usize, KernelError> {
        self.require(axis < table.len() && index_len.is_multiple_of(index_dtype.size()))?;
        let rows = crate::numel(&table[..axis]) * crate::numel(&table[axis + 1..]);
        Ok(rows * (index_len / index_dtype.size()) * dtype.size())
    }

    /// The bytes of the slices an ONNX `GatherND` picks (or a `ScatterND` writes).
    fn nd_picked_bytes(&self, dtype: DType, data: &[usize], indices: &[usize]) -> Result<usize, KernelError> {
        let Some(&k) = indices.last() else { return Err(KernelError::BufferSize { kernel: self.kernel }) };
        self.require(k <= data.len())?;
        let slice: usize = data[k..].iter().product();
        Ok(indices[..indices.len() - 1].iter().product::<usize>() * slice * dtype.size())
    }

    fn layer_norm(&self, dtype: DType, cols: usize, bias: bool) -> Result<(), KernelError> {
        let row = cols * dtype.size();
        let inputs = self.inputs;
        let params = if bias { &inputs[1..] } else { inputs.get(1..2).unwrap_or_default() };
        match (inputs.first(), self.outputs) {
            (Some(x), [y]) if x == y && row > 0 && x % row == 0 && params.iter().all(|&p| p == row) => {
                self.require(inputs.len() == if bias { 3 } else { 2 })
            }
            _ => self.fail(),
        }
    }

    /// A single-tensor optimizer step: param, grad, `states` states and `scalars` scalars in;
    /// param and states out, every tensor the param's size.
    fn optimizer(&self, dtype: DType, states: usize, scalars: usize) -> Result<(), KernelError> {
        let Some(&param) = self.inputs.first() else { return self.fail() };
        let tensors_in = &self.inputs[..(2 + states).min(self.inputs.len())];
        self.require(
            self.inputs.len() == 2 + states + scalars
                && self.outputs.len() == 1 + states
                && tensors_in.iter().chain(self.outputs).all(|&len| len == param)
                && self.inputs[2 + states..].iter().all(|&s| s == dtype.size())
                && param % dtype.size() == 0,
        )
    }
}

/// The loss output of a class loss: a scalar, or one value per position with no reduction.
fn loss_bytes(dtype: DType, dims: &ClassLossDims) -> usize {
    match dims.reduction {
        crate::Reduction::None => dims.n * dims.inner * dtype.size(),
        _ => dtype.size(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    /// Rank 1 of 2 holds rows 2 and 3 of a 4-row table: indices stay global, other rows read as
    /// zeros, negative indices count back from the whole table.
    #[test]
    fn index_blocks_serve_their_rows() {
        let block = IndexBlock { mesh_axis: 0, start: 0, global_len: 4 };
        let mut gather = Kernel::Gather {
            dtype: DType::F32,
            index_dtype: DType::I64,
            data: vec![2, 2],
            axis: 0,
            block: Some(block),
        };
        gather.place_blocks(&[1]);
        let table: Vec<u8> = [20.0f32, 21.0, 30.0, 31.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let indices: Vec<u8> = [3i64, 0, -2].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![0u8; 3 * 2 * 4];
        gather.run(&[&table, &indices], &mut [&mut out]).unwrap();
        assert_eq!(f32s(&out), [30.0, 31.0, 0.0, 0.0, 20.0, 21.0]);

        let mut scatter = Kernel::ScatterAdd {
            dtype: DType::F32,
            index_dtype: DType::I64,
            out: vec![2, 2],
            axis: 0,
            block: Some(block),
        };
        scatter.place_blocks(&[1]);
        let updates: Vec<u8> = [1.0f32, 2.0, 5.0, 6.0, 7.0, 8.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut grad = vec![0u8; 2 * 2 * 4];
        scatter.run(&[&indices, &updates], &mut [&mut grad]).unwrap();
        assert_eq!(f32s(&grad), [7.0, 8.0, 1.0, 2.0]);
    }

    /// Integer `and`/`or`/`xor` are bitwise, broadcasting (CPM-Ant's masks: `context | causal`),
    /// and `not` flips every bit; on floats both are refused, not computed on their bits.
    #[test]
    fn bitwise_ops_on_integers() {
        let lhs: Vec<u8> = [0b1100i32, 0b1010, -1, 0, 5, 6].iter().flat_map(|v| v.to_le_bytes()).collect();
        let rhs: Vec<u8> = [0b0110i32, 1, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let i32s = |bytes: &[u8]| -> Vec<i32> {
            bytes.chunks(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        let mut results = Vec::new();
        for op in [BinaryOp::And, BinaryOp::Or, BinaryOp::Xor] {
            let kernel = Kernel::Binary { op, dtype: DType::I32, lhs: vec![2, 3], rhs: vec![3], out: vec![2, 3] };
            let mut out = vec![0u8; 6 * 4];
            kernel.run(&[&lhs, &rhs], &mut [&mut out]).unwrap();
            results.push(i32s(&out));
        }
        assert_eq!(results[0], [0b0100, 0, 0, 0, 1, 0]);
        assert_eq!(results[1], [0b1110, 0b1011, -1, 0b0110, 5, 6]);
        assert_eq!(results[2], [0b1010, 0b1011, -1, 0b0110, 4, 6]);

        let mut out = vec![0u8; 6 * 4];
        Kernel::Unary { op: UnaryOp::Not, dtype: DType::I32 }.run(&[&lhs], &mut [&mut out]).unwrap();
        assert_eq!(i32s(&out), [!0b1100, !0b1010, 0, -1, !5, !6]);

        let floats = Kernel::Binary { op: BinaryOp::Or, dtype: DType::F32, lhs: vec![3], rhs: vec![3], out: vec![3] };
        let mut out = vec![0u8; 3 * 4];
        assert!(floats.run(&[&rhs, &rhs], &mut [&mut out]).is_err());
        assert!(Kernel::Unary { op: UnaryOp::Not, dtype: DType::F32 }.run(&[&rhs], &mut [&mut out]).is_err());
    }
}
