//! `Op`: the closed set of IR operations, their typed attributes and their type rules.
//!
//! Adding a variant is a compile error everywhere an op must be handled: the type rule here,
//! the text format, the reference kernels (`lower.rs`) and, later, autodiff and sharding.

use crate::{AttentionMask, BinaryOp, Collective, DType, GeluApprox, ReduceOp, Reduction, Tensor, TensorType, UnaryOp};

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A literal tensor.
    Constant {
        value: Tensor,
    },
    /// Elementwise function of one tensor.
    Unary(UnaryOp),
    /// Elementwise function of two tensors, numpy broadcasting.
    Binary(BinaryOp),
    /// `select cond, x, y`: x where cond is true, else y (broadcasting).
    Select,
    Cast {
        to: DType,
    },
    Reduce {
        op: ReduceOp,
        axes: Vec<usize>,
        keep_dims: bool,
    },
    /// Batched matmul; batch dims broadcast; flags transpose the last two dims of an operand.
    MatMul {
        transpose_lhs: bool,
        transpose_rhs: bool,
    },
    Reshape {
        shape: Vec<usize>,
    },
    Transpose {
        perm: Vec<usize>,
    },
    /// Per-axis `start`, `end` (exclusive, or -1 below a negative step's end) and `step`,
    /// normalised: one entry per dimension, starts in range.
    Slice {
        starts: Vec<usize>,
        ends: Vec<i64>,
        steps: Vec<i64>,
    },
    Concat {
        axis: usize,
    },
    Split {
        axis: usize,
        sizes: Vec<usize>,
    },
    /// Broadcast to `shape`.
    Expand {
        shape: Vec<usize>,
    },
    /// `take(data, indices, axis)`.
    Gather {
        axis: usize,
    },
    /// `scatter_add indices, updates {axis, size}`: the gradient of `gather`. Zeros with dim
    /// `axis` of length `size`, plus each update slice added at its index.
    ScatterAdd {
        axis: usize,
        size: usize,
    },
    /// `take_along_axis(data, indices, axis)`.
    GatherElements {
        axis: usize,
    },
    /// `gather_nd data, indices`: `indices[..., :k]` pick `data[i0, .., ik-1]` (a slice of the
    /// remaining dims); ONNX `GatherND` with `batch_dims = 0`.
    GatherNd,
    /// `scatter_nd data, indices, updates {reduction}`: `data` with each `indices[..., :k]`
    /// element or slice replaced by (or combined with) its update, in order.
    ScatterNd {
        reduction: crate::ScatterReduction,
    },
    /// `scatter_elements indices, updates {axis, size}`: the gradient of `gather_elements`.
    /// Zeros of the updates' shape with dim `axis` of length `size`, plus each update added at
    /// its own position with the coordinate along `axis` replaced by its index.
    ScatterElements {
        axis: usize,
        size: usize,
    },
    /// The `k` largest (or smallest) elements along `axis`, in order, and their indices (i64);
    /// equal values keep index order (ONNX `TopK`).
    TopK {
        axis: usize,
        k: usize,
        largest: bool,
    },
    /// Constant padding with `begin[d]` and `end[d]` elements.
    Pad {
        begin: Vec<usize>,
        end: Vec<usize>,
        value: f64,
    },
    /// Running sums along `axis` (ONNX `CumSum`): `exclusive` leaves each element out of its
    /// own sum, `reverse` sums from the end.
    CumSum {
        axis: usize,
        exclusive: bool,
        reverse: bool,
    },
    /// Keep the upper (`triu`) or lower (`tril`) triangle relative to diagonal `k`.
    Triangle {
        upper: bool,
        k: i64,
    },
    Softmax {
        axis: usize,
    },
    LogSoftmax {
        axis: usize,
    },
    /// `attention q, k, v[, bias] {scale, mask} -> out, lse`: `softmax(q k^T * scale + bias +
    /// mask) v` over the last two dims, for every index of the leading ones (those of `k` and
    /// `v` are 1 where they broadcast), computed without the `[.., Sq, Sk]` scores; `lse`
    /// (`[.., Sq]`, f32, or f64 for f64) is each query's log-sum-exp, from which the backward
    /// recomputes them.
    ///
    /// With `kv_block = L` (a context-parallel ring's round: each rank's queries against the
    /// block of keys it holds), the keys come in blocks of `L` and the queries in as many
    /// blocks; a block's queries attend only to its own keys, at positions from 0 in the block
    /// (the run starts give the queries' positions relative to it).
    Attention {
        scale: f64,
        mask: AttentionMask,
        kv_block: Option<usize>,
    },
    /// `attention_grad q, k, v[, bias], out, lse, d_out {scale, mask} -> dq, dk, dv`: the
    /// attention's backward (the bias gets no gradient). With `kv_block`, `out` and `lse` are
    /// the whole attention's (over every block of keys), and the gradients this block's part.
    AttentionGrad {
        scale: f64,
        mask: AttentionMask,
        kv_block: Option<usize>,
    },
    /// `layer_norm x, scale[, bias]` over the dims from `axis` on.
    LayerNorm {
        axis: usize,
        eps: f64,
    },
    /// `rms_norm x, scale` over the dims from `axis` on.
    RmsNorm {
        axis: usize,
        eps: f64,
    },
    Gelu {
        approx: GeluApprox,
    },
    /// `cross_entropy scores[N, C, ...], labels[N, ...][, weights[C]]` -> loss, and
    /// log-probabilities when the node has a second output.
    CrossEntropy {
        ignore_index: Option<i64>,
        reduction: Reduction,
    },
    /// `adamw param, grad, m, v, lr, step -> param', m', v'`: one torch.optim.AdamW step
    /// (decoupled weight decay, bias correction); `lr` and `step` (1-based) are scalars.
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    /// `sgd param, grad, buffer, lr -> param', buffer'`: one torch.optim.SGD step (dampening 0).
    Sgd {
        momentum: f64,
        weight_decay: f64,
        nesterov: bool,
    },
    /// `nll_loss log_probs[N, C, ...], labels[N, ...][, weights[C]]` -> loss.
    NllLoss {
        ignore_index: Option<i64>,
        reduction: Reduction,
    },
    /// A collective over the ranks of one mesh axis (named). Types are global and unchanged;
    /// only the value's placement on `axis` changes, as [`Collective::transition`] says (but
    /// for a ring shift, which passes each rank's block to the next: the value rolls by one
    /// block).
    Collective {
        kind: Collective,
        axis: String,
        /// Started here and completed by the `wait` that is its only consumer, so computation
        /// can run while it communicates (`all_gather_start` ... `wait`).
        start: bool,
    },
    /// `wait %start`: the result of an asynchronous collective, once it has completed.
    Wait,
    /// `send %x {to = S, tag = T, message = M}`: hands `x` to pipeline stage `S`, whose `recv`
    /// with the same tag receives it. No result; asynchronous (the stage goes on at once), and
    /// never dead code. On a mesh each rank sends its block, laid out as the message's kind
    /// says, to the rank of stage `S` with the same coordinates.
    Send {
        to: usize,
        tag: u64,
        message: Message,
    },
    /// `recv {from = S, tag = T, message = M} : type`: the value pipeline stage `S` sent with
    /// tag `T`; waits for it. Stages send to each other in the order they receive, so tags only
    /// check that.
    Recv {
        from: usize,
        tag: u64,
        message: Message,
        ty: TensorType,
    },
}

/// What a pipeline message carries, which fixes how the ranks of a stage's mesh hold it: both
/// ends agree on that without knowing each other's graph.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// A micro-batch's activation, forward to the next stage; laid out as the batch inputs
    /// (dim 0 split over the data-parallel axis, whole on the others).
    Activation,
    /// The gradient of an activation, back to the stage before; laid out as the batch.
    Gradient,
    /// A parameter's gradient sum, to another stage holding the parameter; whole on every rank.
    SharedGradient,
    /// A stage's sum of squared gradients, to every other stage for the global norm that
    /// clipping scales by; whole on every rank.
    NormPart,
}

impl Message {
    pub fn name(self) -> &'static str {
        match self {
            Message::Activation => "activation",
            Message::Gradient => "gradient",
            Message::SharedGradient => "shared_gradient",
            Message::NormPart => "norm_part",
        }
    }

    pub fn from_name(name: &str) -> Option<Message> {
        match name {
            "activation" => Some(Message::Activation),
            "gradient" => Some(Message::Gradient),
            "shared_gradient" => Some(Message::SharedGradient),
            "norm_part" => Some(Message::NormPart),
            _ => None,
        }
    }

    /// Laid out as the batch (or else whole).
    pub fn batch_layout(self) -> bool {
        matches!(self, Message::Activation | Message::Gradient)
    }
}

impl Op {
    /// The op's name in the text format.
    pub fn name(&self) -> String {
        match self {
            Op::Constant { .. } => "constant".into(),
            Op::Unary(u) => u.name().into(),
            Op::Binary(b) => b.name().into(),
            Op::Select => "select".into(),
            Op::Cast { .. } => "cast".into(),
            Op::Reduce { op, .. } => format!("reduce_{}", op.name()),
            Op::MatMul { .. } => "matmul".into(),
            Op::Reshape { .. } => "reshape".into(),
            Op::Transpose { .. } => "transpose".into(),
            Op::Slice { .. } => "slice".into(),
            Op::Concat { .. } => "concat".into(),
            Op::Split { .. } => "split".into(),
            Op::Expand { .. } => "expand".into(),
            Op::Gather { .. } => "gather".into(),
            Op::ScatterAdd { .. } => "scatter_add".into(),
            Op::GatherElements { .. } => "gather_elements".into(),
            Op::ScatterElements { .. } => "scatter_elements".into(),
            Op::GatherNd => "gather_nd".into(),
            Op::ScatterNd { .. } => "scatter_nd".into(),
            Op::TopK { .. } => "topk".into(),
            Op::Pad { .. } => "pad".into(),
            Op::CumSum { .. } => "cumsum".into(),
            Op::Triangle { upper: true, .. } => "triu".into(),
            Op::Triangle { upper: false, .. } => "tril".into(),
            Op::Softmax { .. } => "softmax".into(),
            Op::LogSoftmax { .. } => "log_softmax".into(),
            Op::Attention { .. } => "attention".into(),
            Op::AttentionGrad { .. } => "attention_grad".into(),
            Op::LayerNorm { .. } => "layer_norm".into(),
            Op::RmsNorm { .. } => "rms_norm".into(),
            Op::Gelu { .. } => "gelu".into(),
            Op::CrossEntropy { .. } => "cross_entropy".into(),
            Op::NllLoss { .. } => "nll_loss".into(),
            Op::AdamW { .. } => "adamw".into(),
            Op::Sgd { .. } => "sgd".into(),
            Op::Collective { kind, start: false, .. } => kind.name().into(),
            Op::Collective { kind, start: true, .. } => format!("{}_start", kind.name()),
            Op::Wait => "wait".into(),
            Op::Send { .. } => "send".into(),
            Op::Recv { .. } => "recv".into(),
        }
    }

    /// Output types for the given input types, or why the inputs are invalid (the shape rules,
    /// by op family: [`crate::shape_rules`]); every output within autotp's limits
    /// ([`TensorType::check_limits`]).
    pub fn infer(&self, inputs: &[&TensorType], num_outputs: usize) -> Result<Vec<TensorType>, String> {
        let outputs = crate::shape_rules::infer(self, inputs, num_outputs)?;
        outputs.iter().try_for_each(TensorType::check_limits)?;
        Ok(outputs)
    }
}

pub(crate) fn float_only(t: &TensorType) -> Result<(), String> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("needs a floating-point input, got {}", t.dtype))
    }
}

pub(crate) fn check_index_dtype(dtype: DType) -> Result<(), String> {
    if matches!(dtype, DType::I64 | DType::I32) {
        Ok(())
    } else {
        Err(format!("indices must be i64 or i32, got {dtype}"))
    }
}

/// Number of elements `start, start+step, ...` strictly before `end` (after it for negative
/// steps); `None` when the slice is malformed.
pub fn slice_len(start: usize, end: i64, step: i64, dim: usize) -> Option<usize> {
    if step == 0 || start > dim || end < -1 || end > dim as i64 {
        return None;
    }
    let start_i = start as i64;
    let len = if step > 0 {
        if end <= start_i {
            0
        } else {
            (end - start_i + step - 1) / step
        }
    } else if end >= start_i {
        0
    } else {
        (start_i - end + (-step) - 1) / (-step)
    };
    // A non-empty slice must start inside the dimension.
    if len > 0 && start >= dim {
        return None;
    }
    Some(len as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_lengths() {
        assert_eq!(slice_len(0, 10, 1, 10), Some(10));
        assert_eq!(slice_len(2, 10, 3, 10), Some(3));
        assert_eq!(slice_len(9, -1, -1, 10), Some(10));
        assert_eq!(slice_len(9, 4, -2, 10), Some(3));
        assert_eq!(slice_len(0, 11, 1, 10), None);
        assert_eq!(slice_len(0, 5, 0, 10), None);
    }

    #[test]
    fn matmul_types() {
        let a = TensorType::new(DType::F32, vec![4, 1, 8, 16]);
        let b = TensorType::new(DType::F32, vec![3, 32, 16]);
        let op = Op::MatMul { transpose_lhs: false, transpose_rhs: true };
        assert_eq!(op.infer(&[&a, &b], 1).unwrap(), vec![TensorType::new(DType::F32, vec![4, 3, 8, 32])]);
        let bad = Op::MatMul { transpose_lhs: false, transpose_rhs: false };
        assert!(bad.infer(&[&a, &b], 1).unwrap_err().contains("contraction dims differ"));
    }

    /// `and`/`or`/`xor`/`not` are logical on bools and bitwise on integers; floats are refused.
    #[test]
    fn logical_ops_take_bools_and_integers() {
        let ints = TensorType::new(DType::I32, vec![2, 3]);
        let row = TensorType::new(DType::I32, vec![3]);
        let or = Op::Binary(BinaryOp::Or);
        assert_eq!(or.infer(&[&ints, &row], 1).unwrap(), vec![ints.clone()]);
        assert_eq!(Op::Unary(UnaryOp::Not).infer(&[&ints], 1).unwrap(), vec![ints.clone()]);
        let floats = TensorType::new(DType::F32, vec![3]);
        assert!(or.infer(&[&floats, &floats], 1).unwrap_err().contains("or needs bool or integer operands, got f32"));
        assert!(Op::Unary(UnaryOp::Not).infer(&[&floats], 1).unwrap_err().contains("not is not defined on f32"));
        let bools = TensorType::new(DType::Bool, vec![3]);
        assert!(Op::Unary(UnaryOp::Neg).infer(&[&bools], 1).unwrap_err().contains("neg is not defined on bool"));
    }
}
