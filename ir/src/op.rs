//! `Op`: the closed set of IR operations, their typed attributes and their type rules.
//!
//! Adding a variant is a compile error everywhere an op must be handled: the type rule here,
//! the text format, the reference kernels (`lower.rs`) and, later, autodiff and sharding.

use autotp_kernels::shape::broadcast_shapes;

use crate::{BinaryOp, Collective, DType, GeluApprox, ReduceOp, Reduction, Tensor, TensorType, UnaryOp};

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
    /// only the value's placement on `axis` changes, as [`Collective::transition`] says.
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

    /// Output types for the given input types, or why the inputs are invalid.
    pub fn infer(&self, inputs: &[&TensorType], num_outputs: usize) -> Result<Vec<TensorType>, String> {
        let expect_arity = |lo: usize, hi: usize| {
            if inputs.len() < lo || inputs.len() > hi {
                let want = if lo == hi { format!("{lo}") } else { format!("{lo} to {hi}") };
                Err(format!("expects {want} inputs, got {}", inputs.len()))
            } else {
                Ok(())
            }
        };
        let one = |t: TensorType| Ok(vec![t]);
        let axis_ok = |axis: usize, rank: usize| {
            if axis < rank {
                Ok(())
            } else {
                Err(format!("axis {axis} is out of range for rank {rank}"))
            }
        };
        if !matches!(
            self,
            Op::Split { .. }
                | Op::CrossEntropy { .. }
                | Op::NllLoss { .. }
                | Op::AdamW { .. }
                | Op::Sgd { .. }
                | Op::Send { .. }
                | Op::TopK { .. }
        ) && num_outputs != 1
        {
            return Err(format!("has {num_outputs} outputs, expects 1"));
        }
        match self {
            Op::Constant { value } => {
                expect_arity(0, 0)?;
                one(value.ty.clone())
            }
            Op::Unary(op) => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                if op.is_logical() != (t.dtype == DType::Bool) {
                    return Err(format!("{} is not defined on {}", op.name(), t.dtype));
                }
                if op.needs_float() && !t.dtype.is_float() {
                    return Err(format!("{} needs a floating-point input, got {}", op.name(), t.dtype));
                }
                one(t.clone())
            }
            Op::Binary(op) => {
                expect_arity(2, 2)?;
                let (a, b) = (inputs[0], inputs[1]);
                if a.dtype != b.dtype {
                    return Err(format!("operand dtypes differ: {} and {}", a.dtype, b.dtype));
                }
                if op.is_logical() && a.dtype != DType::Bool {
                    return Err(format!("{} needs bool operands, got {}", op.name(), a.dtype));
                }
                if a.dtype == DType::Bool && !op.is_logical() && *op != BinaryOp::Equal {
                    return Err(format!("{} is not defined on bool", op.name()));
                }
                let shape = broadcast_shapes(&a.shape, &b.shape)
                    .ok_or_else(|| format!("shapes {:?} and {:?} do not broadcast", a.shape, b.shape))?;
                let dtype = if op.is_comparison() { DType::Bool } else { a.dtype };
                one(TensorType::new(dtype, shape))
            }
            Op::Select => {
                expect_arity(3, 3)?;
                let (c, x, y) = (inputs[0], inputs[1], inputs[2]);
                if c.dtype != DType::Bool {
                    return Err(format!("condition must be bool, got {}", c.dtype));
                }
                if x.dtype != y.dtype {
                    return Err(format!("branch dtypes differ: {} and {}", x.dtype, y.dtype));
                }
                let shape = broadcast_shapes(&c.shape, &x.shape)
                    .and_then(|s| broadcast_shapes(&s, &y.shape))
                    .ok_or_else(|| format!("shapes {:?}, {:?} and {:?} do not broadcast", c.shape, x.shape, y.shape))?;
                one(TensorType::new(x.dtype, shape))
            }
            Op::Cast { to } => {
                expect_arity(1, 1)?;
                one(TensorType::new(*to, inputs[0].shape.clone()))
            }
            Op::Reduce { op, axes, keep_dims } => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                if t.dtype == DType::Bool {
                    return Err(format!("reduce_{} is not defined on bool", op.name()));
                }
                if axes.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(format!("axes {axes:?} must be sorted and unique"));
                }
                for &a in axes {
                    axis_ok(a, t.rank())?;
                }
                let shape = (0..t.rank())
                    .filter_map(|d| match (axes.contains(&d), keep_dims) {
                        (false, _) => Some(t.shape[d]),
                        (true, true) => Some(1),
                        (true, false) => None,
                    })
                    .collect::<Vec<_>>();
                one(TensorType::new(t.dtype, shape))
            }
            Op::MatMul { transpose_lhs, transpose_rhs } => {
                expect_arity(2, 2)?;
                let (a, b) = (inputs[0], inputs[1]);
                if a.dtype != b.dtype {
                    return Err(format!("operand dtypes differ: {} and {}", a.dtype, b.dtype));
                }
                if a.rank() < 2 || b.rank() < 2 {
                    return Err(format!("operands must have rank >= 2, got {} and {}", a.rank(), b.rank()));
                }
                let (ar, br) = (a.rank(), b.rank());
                let (m, ka) = if *transpose_lhs {
                    (a.shape[ar - 1], a.shape[ar - 2])
                } else {
                    (a.shape[ar - 2], a.shape[ar - 1])
                };
                let (kb, n) = if *transpose_rhs {
                    (b.shape[br - 1], b.shape[br - 2])
                } else {
                    (b.shape[br - 2], b.shape[br - 1])
                };
                if ka != kb {
                    return Err(format!(
                        "contraction dims differ: {ka} and {kb} (shapes {:?} and {:?})",
                        a.shape, b.shape
                    ));
                }
                let mut shape = broadcast_shapes(&a.shape[..ar - 2], &b.shape[..br - 2])
                    .ok_or_else(|| format!("batch dims of {:?} and {:?} do not broadcast", a.shape, b.shape))?;
                shape.extend([m, n]);
                one(TensorType::new(a.dtype, shape))
            }
            Op::Reshape { shape } => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                if shape.iter().product::<usize>() != t.numel() {
                    return Err(format!("cannot reshape {:?} ({} elements) to {shape:?}", t.shape, t.numel()));
                }
                one(TensorType::new(t.dtype, shape.clone()))
            }
            Op::Transpose { perm } => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                let mut seen = perm.clone();
                seen.sort_unstable();
                if seen != (0..t.rank()).collect::<Vec<_>>() {
                    return Err(format!("perm {perm:?} is not a permutation of rank {}", t.rank()));
                }
                one(TensorType::new(t.dtype, perm.iter().map(|&p| t.shape[p]).collect::<Vec<_>>()))
            }
            Op::Slice { starts, ends, steps } => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                if starts.len() != t.rank() || ends.len() != t.rank() || steps.len() != t.rank() {
                    return Err(format!("needs one start, end and step per dimension (rank {})", t.rank()));
                }
                let mut shape = Vec::with_capacity(t.rank());
                for d in 0..t.rank() {
                    shape.push(slice_len(starts[d], ends[d], steps[d], t.shape[d]).ok_or_else(|| {
                        format!(
                            "slice {}:{}:{} is invalid for dim {d} of size {}",
                            starts[d], ends[d], steps[d], t.shape[d]
                        )
                    })?);
                }
                one(TensorType::new(t.dtype, shape))
            }
            Op::Concat { axis } => {
                if inputs.is_empty() {
                    return Err("expects at least 1 input".into());
                }
                let first = inputs[0];
                axis_ok(*axis, first.rank())?;
                let mut shape = first.shape.clone();
                shape[*axis] = 0;
                for t in inputs {
                    let same_other =
                        t.rank() == first.rank() && (0..t.rank()).all(|d| d == *axis || t.shape[d] == first.shape[d]);
                    if t.dtype != first.dtype || !same_other {
                        return Err(format!("input {t} does not match {first} outside axis {axis}"));
                    }
                    shape[*axis] += t.shape[*axis];
                }
                one(TensorType::new(first.dtype, shape))
            }
            Op::Split { axis, sizes } => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                axis_ok(*axis, t.rank())?;
                if sizes.iter().sum::<usize>() != t.shape[*axis] || sizes.len() != num_outputs {
                    return Err(format!(
                        "sizes {sizes:?} do not split dim {axis} of size {} into {num_outputs} outputs",
                        t.shape[*axis]
                    ));
                }
                Ok(sizes
                    .iter()
                    .map(|&s| {
                        let mut shape = t.shape.clone();
                        shape[*axis] = s;
                        TensorType::new(t.dtype, shape)
                    })
                    .collect())
            }
            Op::Expand { shape } => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                match broadcast_shapes(&t.shape, shape) {
                    Some(s) if &s == shape => one(TensorType::new(t.dtype, shape.clone())),
                    _ => Err(format!("cannot expand {:?} to {shape:?}", t.shape)),
                }
            }
            Op::Gather { axis } => {
                expect_arity(2, 2)?;
                let (data, idx) = (inputs[0], inputs[1]);
                axis_ok(*axis, data.rank())?;
                check_index_dtype(idx.dtype)?;
                let mut shape = data.shape[..*axis].to_vec();
                shape.extend(&idx.shape);
                shape.extend(&data.shape[axis + 1..]);
                one(TensorType::new(data.dtype, shape))
            }
            Op::ScatterAdd { axis, size } => {
                expect_arity(2, 2)?;
                let (idx, updates) = (inputs[0], inputs[1]);
                check_index_dtype(idx.dtype)?;
                float_only(updates)?;
                if updates.rank() < axis + idx.rank() || updates.shape[*axis..axis + idx.rank()] != idx.shape[..] {
                    return Err(format!("updates {:?} must hold indices {:?} at dim {axis}", updates.shape, idx.shape));
                }
                let mut shape = updates.shape[..*axis].to_vec();
                shape.push(*size);
                shape.extend(&updates.shape[axis + idx.rank()..]);
                one(TensorType::new(updates.dtype, shape))
            }
            Op::GatherElements { axis } => {
                expect_arity(2, 2)?;
                let (data, idx) = (inputs[0], inputs[1]);
                axis_ok(*axis, data.rank())?;
                check_index_dtype(idx.dtype)?;
                if idx.rank() != data.rank() {
                    return Err(format!("indices rank {} differs from data rank {}", idx.rank(), data.rank()));
                }
                if (0..data.rank()).any(|d| d != *axis && idx.shape[d] > data.shape[d]) {
                    return Err(format!("indices {:?} exceed data {:?} outside axis {axis}", idx.shape, data.shape));
                }
                one(TensorType::new(data.dtype, idx.shape.clone()))
            }
            Op::GatherNd => {
                expect_arity(2, 2)?;
                let (data, idx) = (inputs[0], inputs[1]);
                check_index_dtype(idx.dtype)?;
                let k = *idx.shape.last().ok_or("needs indices of rank 1 or more")?;
                if k > data.rank() {
                    return Err(format!("indices pick {k} dims of a rank-{} tensor", data.rank()));
                }
                let mut shape = idx.shape[..idx.rank() - 1].to_vec();
                shape.extend(&data.shape[k..]);
                one(TensorType::new(data.dtype, shape))
            }
            Op::ScatterNd { .. } => {
                expect_arity(3, 3)?;
                let (data, idx, updates) = (inputs[0], inputs[1], inputs[2]);
                check_index_dtype(idx.dtype)?;
                let k = *idx.shape.last().ok_or("needs indices of rank 1 or more")?;
                let mut want = idx.shape[..idx.rank() - 1].to_vec();
                if k <= data.rank() {
                    want.extend(&data.shape[k..]);
                }
                if k > data.rank() || updates.shape != want || updates.dtype != data.dtype {
                    return Err(format!("updates {updates} do not fit indices {:?} into data {data}", idx.shape));
                }
                one(data.clone())
            }
            Op::ScatterElements { axis, size } => {
                expect_arity(2, 2)?;
                let (idx, updates) = (inputs[0], inputs[1]);
                axis_ok(*axis, updates.rank())?;
                check_index_dtype(idx.dtype)?;
                float_only(updates)?;
                if idx.shape != updates.shape {
                    return Err(format!("indices {:?} and updates {:?} differ in shape", idx.shape, updates.shape));
                }
                let mut shape = updates.shape.clone();
                shape[*axis] = *size;
                one(TensorType::new(updates.dtype, shape))
            }
            Op::TopK { axis, k, .. } => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                axis_ok(*axis, t.rank())?;
                if t.dtype == DType::Bool {
                    return Err("needs numbers, got bool".into());
                }
                if *k > t.shape[*axis] {
                    return Err(format!("k = {k} exceeds the {} elements along axis {axis}", t.shape[*axis]));
                }
                let mut shape = t.shape.clone();
                shape[*axis] = *k;
                if num_outputs != 2 {
                    return Err(format!("has 2 outputs (values, indices), got {num_outputs}"));
                }
                Ok(vec![TensorType::new(t.dtype, shape.clone()), TensorType::new(DType::I64, shape)])
            }
            Op::Pad { begin, end, .. } => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                if begin.len() != t.rank() || end.len() != t.rank() {
                    return Err(format!("needs one begin and end pad per dimension (rank {})", t.rank()));
                }
                let shape = (0..t.rank()).map(|d| t.shape[d] + begin[d] + end[d]).collect::<Vec<_>>();
                one(TensorType::new(t.dtype, shape))
            }
            Op::CumSum { axis, .. } => {
                expect_arity(1, 1)?;
                axis_ok(*axis, inputs[0].rank())?;
                if inputs[0].dtype == DType::Bool {
                    return Err("needs numbers, got bool".into());
                }
                one(inputs[0].clone())
            }
            Op::Triangle { .. } => {
                expect_arity(1, 1)?;
                if inputs[0].rank() < 2 {
                    return Err(format!("needs rank >= 2, got {}", inputs[0].rank()));
                }
                one(inputs[0].clone())
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                expect_arity(1, 1)?;
                let t = inputs[0];
                axis_ok(*axis, t.rank())?;
                float_only(t)?;
                one(t.clone())
            }
            Op::LayerNorm { axis, .. } | Op::RmsNorm { axis, .. } => {
                let max = if matches!(self, Op::LayerNorm { .. }) { 3 } else { 2 };
                expect_arity(2, max)?;
                let x = inputs[0];
                axis_ok(*axis, x.rank())?;
                float_only(x)?;
                for p in &inputs[1..] {
                    if p.dtype != x.dtype || p.shape[..] != x.shape[*axis..] {
                        return Err(format!("scale/bias {p} must be {}{:?}", x.dtype, &x.shape[*axis..]));
                    }
                }
                one(x.clone())
            }
            Op::Gelu { .. } => {
                expect_arity(1, 1)?;
                float_only(inputs[0])?;
                one(inputs[0].clone())
            }
            Op::AdamW { .. } | Op::Sgd { .. } => {
                // AdamW: param, grad, m, v + lr, step. SGD: param, grad, buffer + lr.
                let (tensors, scalars, outputs) = if matches!(self, Op::AdamW { .. }) { (4, 2, 3) } else { (3, 1, 2) };
                expect_arity(tensors + scalars, tensors + scalars)?;
                let p = inputs[0];
                float_only(p)?;
                if let Some(t) = inputs[1..tensors].iter().find(|t| **t != p) {
                    return Err(format!("gradient and state must match the parameter {p}, got {t}"));
                }
                if let Some(t) = inputs[tensors..].iter().find(|t| t.dtype != p.dtype || t.rank() != 0) {
                    return Err(format!("learning rate and step must be {} scalars, got {t}", p.dtype));
                }
                if num_outputs != outputs {
                    return Err(format!("has {num_outputs} outputs, expects {outputs}"));
                }
                Ok(vec![p.clone(); outputs])
            }
            Op::Collective { kind, .. } => {
                expect_arity(1, 1)?;
                if let Some(dim) = kind.dim() {
                    axis_ok(dim, inputs[0].rank())?;
                }
                one(inputs[0].clone())
            }
            Op::Wait => {
                expect_arity(1, 1)?;
                one(inputs[0].clone())
            }
            Op::Send { .. } => {
                expect_arity(1, 1)?;
                if num_outputs != 0 {
                    return Err(format!("has {num_outputs} outputs, expects none"));
                }
                Ok(vec![])
            }
            Op::Recv { ty, .. } => {
                expect_arity(0, 0)?;
                one(ty.clone())
            }
            Op::CrossEntropy { reduction, .. } | Op::NllLoss { reduction, .. } => {
                expect_arity(2, 3)?;
                let (scores, labels) = (inputs[0], inputs[1]);
                float_only(scores)?;
                check_index_dtype(labels.dtype)?;
                let mut expected = scores.shape.clone();
                if expected.len() < 2 {
                    return Err(format!("scores must be [N, C, ...], got {:?}", scores.shape));
                }
                let classes = expected.remove(1);
                if labels.shape != expected {
                    return Err(format!(
                        "labels {:?} must be {expected:?} for scores {:?}",
                        labels.shape, scores.shape
                    ));
                }
                if let Some(weights) = inputs.get(2) {
                    if weights.dtype != scores.dtype || weights.shape != [classes] {
                        return Err(format!("class weights {weights} must be {}[{classes}]", scores.dtype));
                    }
                }
                let max_outputs = if matches!(self, Op::CrossEntropy { .. }) { 2 } else { 1 };
                if !(1..=max_outputs).contains(&num_outputs) {
                    return Err(format!("has {num_outputs} outputs, expects at most {max_outputs}"));
                }
                let loss_shape = if *reduction == Reduction::None { expected } else { vec![] };
                let mut out = vec![TensorType::new(scores.dtype, loss_shape)];
                if num_outputs == 2 {
                    out.push(scores.clone());
                }
                Ok(out)
            }
        }
    }
}

fn float_only(t: &TensorType) -> Result<(), String> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("needs a floating-point input, got {}", t.dtype))
    }
}

fn check_index_dtype(dtype: DType) -> Result<(), String> {
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
}
