//! `precision`: mixed precision (`--precision bf16|fp16`), the cast policy of CUDA autocast on
//! a model whose weights are 16-bit, as DeepSpeed and Megatron train.
//!
//! [`Precision`] runs on the forward graph with its loss, before `autodiff` (so the backward
//! follows the forward's dtypes, as autograd does under autocast):
//!
//! - every f32 parameter becomes 16-bit (the optimizer keeps an f32 master copy: `optimize`);
//! - **16-bit ops** compute in 16-bit (f32 accumulation inside the kernel): matmuls and fused
//!   attention (whose softmax is f32 inside, as SDPA under autocast);
//! - **f32 ops** compute in f32 and give f32: softmax, log_softmax, layer_norm, rms_norm,
//!   cross-entropy and nll_loss, exp, log, rsqrt, reciprocal, pow, cumsum, and sum, mean and
//!   prod reductions (CUDA autocast's fp32 list; PyTorch's CPU autocast keeps softmax and
//!   layer_norm in bf16, autotp follows the CUDA lists on every device);
//! - **every other op** computes in the widest float type of its computed inputs (PyTorch's
//!   type promotion), so a chain after an f32 op stays f32 until a matmul;
//! - a constant takes the type of the computation it joins (PyTorch's Python scalars and
//!   zero-dim tensors do not promote; here no constant does: masks and rotary tables are the
//!   model's buffers, 16-bit where the model is); a constant that only meets constants keeps
//!   its type.
//!
//! A value is cast where an op needs it in another type, once per (value, type); a cast of a
//! constant is folded. Explicit casts of the model stay as they are.
//!
//! [`GradAccumulation`] runs after `autodiff`: each parameter gradient, made in its
//! parameter's 16-bit type, is cast to the accumulation type (`--grad-accum-dtype`, f32 by
//! default, as DeepSpeed's bf16 optimizer accumulates), so that `accumulate`, the data-parallel
//! reduction and the optimizer see it in that type.
//!
//! Input phase: forward with loss (`Precision`); differentiated (`GradAccumulation`). Tests:
//! tests/golden/precision_*.ir, the curves of tests/precision.rs.

use std::collections::BTreeMap;

use autotp_ir::{BinaryOp, DType, Def, Graph, Op, ReduceOp, Rewriter, Tensor, TensorType, UnaryOp, ValueId};

use crate::autodiff::GRAD_PREFIX;
use crate::{Pass, PassError};

const PASS: &str = "precision";

/// The graph input fp16's loss is scaled by (the gradient `autodiff` starts from).
pub const LOSS_SCALE: &str = autotp_program::step::StepInput::LossScale.name();

/// The forward's cast policy for 16-bit weights of type `half` (bf16 or f16); with
/// `loss_scaling`, also the scalar input [`LOSS_SCALE`] for `autodiff` to start from.
pub struct Precision {
    pub half: DType,
    pub loss_scaling: bool,
}

/// Which type an op computes in.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Policy {
    Half,
    F32,
    Promote,
}

fn policy(op: &Op) -> Policy {
    match op {
        Op::MatMul { .. } | Op::Attention { .. } => Policy::Half,
        Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::CrossEntropy { .. }
        | Op::NllLoss { .. }
        | Op::CumSum { .. }
        | Op::Reduce { op: ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod, .. }
        | Op::Unary(UnaryOp::Exp | UnaryOp::Log | UnaryOp::Rsqrt | UnaryOp::Reciprocal | UnaryOp::Softplus)
        | Op::Binary(BinaryOp::Pow)
        // Their gradients are scatters that sum in f32 (no 16-bit form on the CPU or a GPU);
        // the gather and the selection themselves are exact either way.
        | Op::GatherElements { .. }
        | Op::TopK { .. } => Policy::F32,
        _ => Policy::Promote,
    }
}

/// Float types from narrowest to widest.
fn width(dtype: DType) -> u8 {
    match dtype {
        DType::F16 | DType::BF16 => 1,
        DType::F32 => 2,
        _ => 3,
    }
}

fn invalid(message: String) -> PassError {
    PassError::Invalid { pass: PASS, message }
}

impl Pass for Precision {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        if !matches!(self.half, DType::BF16 | DType::F16) {
            return Err(invalid(format!("mixed precision is bf16 or f16, not {}", self.half)));
        }
        if let Some(&wide) = graph.params().iter().find(|&&p| graph.ty(p).dtype == DType::F64) {
            return Err(invalid(format!(
                "mixed precision casts an f32 model's parameters, and '{}' is f64: export the model in f32, \
                 or train it as it is with --precision f32",
                graph.name_of(wide).unwrap_or("")
            )));
        }
        let retyped: BTreeMap<ValueId, Vec<(String, TensorType)>> = (graph.params().iter())
            .filter(|&&p| graph.ty(p).dtype == DType::F32)
            .map(|&p| {
                let ty = TensorType::new(self.half, graph.ty(p).shape.clone());
                (p, vec![(graph.name_of(p).unwrap_or("").to_string(), ty)])
            })
            .collect();
        let (mut rw, replaced) = Rewriter::replacing_params(graph, |_| true, &retyped);
        for (old, new) in replaced {
            rw.set(old, new[0]);
        }
        let mut casts: BTreeMap<(ValueId, DType), ValueId> = BTreeMap::new();
        for (_, node) in graph.nodes() {
            let inputs: Vec<ValueId> = node.inputs.iter().map(|&v| rw.map(v)).collect();
            let g = rw.graph();
            let is_constant = |g: &Graph, v: ValueId| match g.value(v).def {
                Def::Node(n, _) => matches!(g.node(n).op, Op::Constant { .. }),
                _ => false,
            };
            let floats: Vec<usize> = (0..inputs.len()).filter(|&i| g.ty(inputs[i]).dtype.is_float()).collect();
            let computed = floats.iter().map(|&i| inputs[i]).filter(|&v| !is_constant(g, v));
            let target = match policy(&node.op) {
                _ if matches!(node.op, Op::Cast { .. }) => None,
                Policy::Half => Some(self.half),
                Policy::F32 => Some(DType::F32),
                Policy::Promote => computed.map(|v| g.ty(v).dtype).max_by_key(|&d| width(d)),
            };
            let mut inputs = inputs;
            if let Some(target) = target {
                for &i in &floats {
                    inputs[i] = cast(g, &mut casts, inputs[i], target)?;
                }
            }
            let new = g
                .add_node(node.op.clone(), inputs, node.outputs.len())
                .map_err(|m| invalid(format!("{}: {m}", node.op.name())))?;
            let outputs = g.node(new).outputs.clone();
            for (&old, &new) in node.outputs.iter().zip(&outputs) {
                g.value_mut(new).name = graph.value(old).name.clone();
            }
            for (&old, new) in node.outputs.iter().zip(outputs) {
                rw.set(old, new);
            }
        }
        let mut result = rw.finish();
        if self.loss_scaling {
            result.add_input(LOSS_SCALE, TensorType::scalar(DType::F32));
        }
        *graph = result.without_dead_code();
        Ok(())
    }
}

/// `value` as `dtype`: itself, a cast made earlier, a folded constant or a new cast.
fn cast(
    g: &mut Graph,
    casts: &mut BTreeMap<(ValueId, DType), ValueId>,
    value: ValueId,
    dtype: DType,
) -> Result<ValueId, PassError> {
    if g.ty(value).dtype == dtype {
        return Ok(value);
    }
    if let Some(&done) = casts.get(&(value, dtype)) {
        return Ok(done);
    }
    let constant = match g.value(value).def {
        Def::Node(n, _) => match &g.node(n).op {
            Op::Constant { value } => Some(value.clone()),
            _ => None,
        },
        _ => None,
    };
    let cast = match constant {
        Some(c) => {
            let folded = Tensor::from_f64_values(dtype, c.shape().to_vec(), &c.to_f64_vec());
            crate::add_op(PASS, g, Op::Constant { value: folded }, vec![])?
        }
        None => crate::add_op(PASS, g, Op::Cast { to: dtype }, vec![value])?,
    };
    casts.insert((value, dtype), cast);
    Ok(cast)
}

/// Casts every parameter gradient (`grad.*` outputs of `autodiff`) to `dtype`.
pub struct GradAccumulation {
    pub dtype: DType,
}

impl Pass for GradAccumulation {
    fn name(&self) -> &'static str {
        "grad_accumulation"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let mut rw = Rewriter::new(graph, |_| true);
        for (id, _) in graph.nodes() {
            rw.copy_node(id);
        }
        let mut outputs = Vec::new();
        for (name, v) in graph.outputs() {
            let mut value = rw.map(*v);
            let g = rw.graph();
            if name.starts_with(GRAD_PREFIX) && g.ty(value).dtype.is_float() && g.ty(value).dtype != self.dtype {
                value = crate::add_op("grad_accumulation", g, Op::Cast { to: self.dtype }, vec![value])?;
            }
            outputs.push((name.clone(), value));
        }
        let mut result = rw.finish_without_outputs();
        for (name, v) in outputs {
            result.add_output(name, v);
        }
        *graph = result;
        Ok(())
    }
}
