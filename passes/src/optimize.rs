//! `optimize`: turns a differentiated graph into a training step. For every parameter `p` with
//! a `grad.p` output (from `autodiff`) it adds the optimizer update, its moments as `state`
//! values (`adamw.m.p`, `adamw.v.p`, or `sgd.momentum.p`), and `update` lines for the parameter
//! and its moments. The gradients stop being outputs. New scalar inputs: `lr` and, for AdamW,
//! `step` (1-based), so learning-rate schedules are computed by the host.
//!
//! A 16-bit parameter (`precision`) is trained through an f32 master copy, as DeepSpeed's and
//! Megatron's mixed-precision optimizers do: the state `master.p` (f32, initialised by the
//! trainer from the model's weights), the moments in f32, the gradient cast to f32 where it is
//! not already; the update writes the new master and the parameter rounded from it.
//!
//! With `grad_clip`, gradients are first scaled as torch.nn.utils.clip_grad_norm_ does
//! (`min(1, clip / (norm + 1e-6))` over the global L2 norm), and the norm becomes an output,
//! `grad_norm`. On a pipeline stage ([`StageNorm`]) the global norm adds every stage's sum of
//! squares (each stage sends its own to the others, all add them in stage order), a parameter
//! two stages hold counted by the first.
//!
//! Input phase: differentiated. Output: a training step. Tests: tests/golden/optimize_*.ir and
//! the training runs of tests/train.rs.

use std::collections::BTreeSet;

use autotp_ir::{BinaryOp, DType, Graph, Message, Op, ReduceOp, Rewriter, Tensor, TensorType, UnaryOp, ValueId};
use autotp_program::step::StepInput;

use crate::autodiff::GRAD_PREFIX;
use crate::{Pass, PassError};

#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    AdamW { beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
    Sgd { momentum: f64, weight_decay: f64, nesterov: bool },
}

pub struct Optimize {
    pub optimizer: Optimizer,
    pub grad_clip: Option<f64>,
    /// The pipeline stage this graph is, for the global norm of clipping.
    pub stage: Option<StageNorm>,
    pub nonfinite: NonFinite,
}

/// What a step does whose gradients hold an inf or NaN.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum NonFinite {
    /// Applies the update, as PyTorch does (f32 compiled with `--no-finite-check`).
    #[default]
    Apply,
    /// Skips the update (f32 and bf16): every updated parameter and state keeps its value
    /// (`select(finite, new, old)`, which codegen folds into the multi-tensor step as its
    /// guard), and the output `overflow` (1 or 0) tells the trainer, which then stops the run
    /// or does not count the step for AdamW's bias correction or the learning-rate schedule.
    Skip,
    /// Skips it as `Skip`, the gradients having been scaled by the graph input
    /// [`crate::precision::LOSS_SCALE`] (fp16 loss scaling): they are unscaled here, clipping
    /// folded into the unscaling as DeepSpeed does.
    SkipScaled,
}

/// A pipeline stage's part in the global gradient norm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageNorm {
    pub stage: usize,
    pub stages: usize,
    /// Parameters whose gradient an earlier stage holding them counts.
    pub counted_elsewhere: BTreeSet<String>,
}

/// The output that is 1 when a step's gradients were not all finite and its update was
/// skipped ([`NonFinite::Skip`]), else 0.
pub const OVERFLOW: &str = autotp_program::step::StepOutput::Overflow.name();

/// The tag of the overflow test's parts.
const OVERFLOW_TAG: u64 = NORM_TAG + 1;

/// A pipeline stage's scalar `part` summed with every other stage's (each sends its own to
/// the others, all add them in stage order), over messages tagged `tag`.
fn across_stages(g: &mut Graph, stage: &StageNorm, part: ValueId, tag: u64) -> Result<ValueId, PassError> {
    for other in (0..stage.stages).filter(|&o| o != stage.stage) {
        let send = Op::Send { to: other, tag, message: Message::NormPart };
        g.add_node(send, vec![part], 0)
            .map_err(|m| PassError::Invalid { pass: PASS, message: format!("send: {m}") })?;
    }
    let mut sum = None;
    for from in 0..stage.stages {
        let other = match from == stage.stage {
            true => part,
            false => {
                let ty = g.ty(part).clone();
                add(g, Op::Recv { from, tag, message: Message::NormPart, ty }, vec![])?
            }
        };
        sum = Some(match sum {
            Some(s) => add(g, Op::Binary(BinaryOp::Add), vec![s, other])?,
            None => other,
        });
    }
    Ok(sum.expect("at least one stage"))
}

/// The name prefix of master parameters: `master.p` is the f32 copy of 16-bit parameter `p`.
pub const MASTER_PREFIX: &str = "master.";

/// The parameter an optimizer node trains and the states it keeps for it (the moments, and the
/// f32 master of a 16-bit parameter, which is what the node steps); `None` for other nodes.
pub fn trained_by(graph: &Graph, node: &autotp_ir::Node) -> Option<(ValueId, Vec<ValueId>)> {
    let tensors = match node.op {
        Op::AdamW { .. } => 4,
        Op::Sgd { .. } => 3,
        _ => return None,
    };
    let stepped = node.inputs[0];
    let moments = node.inputs[2..tensors].iter().copied();
    let master_of = graph
        .name_of(stepped)
        .and_then(|n| n.strip_prefix(MASTER_PREFIX))
        .and_then(|name| graph.params().iter().copied().find(|&p| graph.name_of(p) == Some(name)));
    Some(match master_of {
        Some(param) => (param, std::iter::once(stepped).chain(moments).collect()),
        None => (stepped, moments.collect()),
    })
}

/// The tag of the norm parts (distinct from the pipeline's activation and gradient tags).
const NORM_TAG: u64 = 1 << 40;

const PASS: &str = "optimize";

fn add(g: &mut Graph, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
    crate::add_op(PASS, g, op, inputs)
}

impl Optimize {
    /// DeepSpeed's overflow test: a gradient's sum is not finite. Returns the boolean `finite`
    /// and the `overflow` output (1 or 0 in `dtype`). Each sum becomes `finite_zero` (0, or
    /// NaN), and those are concatenated and summed (one kernel each, however many gradients): a
    /// sharded gradient's sum is partial, a whole one's is not, but `finite_zero` of either is
    /// a partial sum (see its sharding rule), so the total stays partial and one all-reduce of
    /// one scalar totals it, whatever the layout.
    fn finite_check(&self, g: &mut Graph, grads: &[ValueId], dtype: DType) -> Result<(ValueId, ValueId), PassError> {
        let mut flags = Vec::with_capacity(grads.len());
        for &grad in grads {
            let axes = (0..g.ty(grad).rank()).collect();
            let sum = add(g, Op::Reduce { op: ReduceOp::Sum, axes, keep_dims: false }, vec![grad])?;
            let flag = add(g, Op::Unary(UnaryOp::FiniteZero), vec![sum])?;
            flags.push(add(g, Op::Reshape { shape: vec![1] }, vec![flag])?);
        }
        let mut total = match flags.len() {
            0 => constant(g, dtype, 0.0)?,
            _ => {
                let all = add(g, Op::Concat { axis: 0 }, flags)?;
                add(g, Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keep_dims: false }, vec![all])?
            }
        };
        if let Some(stage) = &self.stage {
            total = across_stages(g, stage, total, OVERFLOW_TAG)?;
        }
        let zero = constant(g, dtype, 0.0)?;
        let finite = add(g, Op::Binary(BinaryOp::Equal), vec![total, zero])?;
        let overflow = add(g, Op::Unary(UnaryOp::Not), vec![finite])?;
        Ok((finite, add(g, Op::Cast { to: dtype }, vec![overflow])?))
    }

    /// Scales `grads` to a global L2 norm of at most `clip` (those not `counted` are left out of
    /// the norm), unscaling them by `loss_scale` in the same multiplier; returns the norm.
    fn clip_gradients(
        &self,
        g: &mut Graph,
        grads: &mut [ValueId],
        counted: &[bool],
        clip: f64,
        loss_scale: Option<ValueId>,
        dtype: DType,
    ) -> Result<ValueId, PassError> {
        let mut total = None;
        for (_, &grad) in counted.iter().zip(grads.iter()).filter(|(counted, _)| **counted) {
            let sq = add(g, Op::Binary(BinaryOp::Mul), vec![grad, grad])?;
            let axes = (0..g.ty(grad).rank()).collect();
            let s = add(g, Op::Reduce { op: ReduceOp::Sum, axes, keep_dims: false }, vec![sq])?;
            total = Some(match total {
                Some(t) => add(g, Op::Binary(BinaryOp::Add), vec![t, s])?,
                None => s,
            });
        }
        let mut total = match total {
            Some(t) => t,
            None => constant(g, dtype, 0.0)?,
        };
        if let Some(stage) = &self.stage {
            total = across_stages(g, stage, total, NORM_TAG)?;
        }
        let norm = add(g, Op::Unary(UnaryOp::Sqrt), vec![total])?;
        let eps = constant(g, dtype, 1e-6)?;
        let max_norm = constant(g, dtype, clip)?;
        let one = constant(g, dtype, 1.0)?;
        let (norm, coef) = match loss_scale {
            None => {
                let denom = add(g, Op::Binary(BinaryOp::Add), vec![norm, eps])?;
                let coef = add(g, Op::Binary(BinaryOp::Div), vec![max_norm, denom])?;
                (norm, add(g, Op::Binary(BinaryOp::Min), vec![coef, one])?)
            }
            // DeepSpeed's `unscale_and_clip_grads`: the norm of the scaled gradients over the
            // scale, and one multiplier 1 / (scale * max(1, (norm + 1e-6) / clip)).
            Some(scale) => {
                let norm = add(g, Op::Binary(BinaryOp::Div), vec![norm, scale])?;
                let over = add(g, Op::Binary(BinaryOp::Add), vec![norm, eps])?;
                let over = add(g, Op::Binary(BinaryOp::Div), vec![over, max_norm])?;
                let clip_factor = add(g, Op::Binary(BinaryOp::Max), vec![over, one])?;
                let combined = add(g, Op::Binary(BinaryOp::Mul), vec![scale, clip_factor])?;
                (norm, add(g, Op::Unary(UnaryOp::Reciprocal), vec![combined])?)
            }
        };
        for grad in grads {
            *grad = add(g, Op::Binary(BinaryOp::Mul), vec![*grad, coef])?;
        }
        Ok(norm)
    }

    /// Adds the optimizer step of parameter `p` (of `graph`, the differentiated graph) with
    /// gradient `grad` (in the new graph), and its states; pushes each `(target, new value)`.
    fn update(
        &self,
        rw: &mut Rewriter,
        graph: &Graph,
        (p, grad): (ValueId, ValueId),
        scalars: &StepScalars,
        updates: &mut Vec<(ValueId, ValueId)>,
    ) -> Result<(), PassError> {
        let StepScalars { dtype, lr, step } = *scalars;
        let invalid = |message: String| PassError::Invalid { pass: PASS, message };
        let name = graph.name_of(p).unwrap_or("").to_string();
        let param_ty = graph.ty(p).clone();
        let ty = TensorType::new(dtype, param_ty.shape.clone());
        let g = rw.graph();
        let (param, master) = match param_ty.dtype == dtype {
            true => (rw.map(p), None),
            false => (g.add_state(format!("{MASTER_PREFIX}{name}"), ty.clone()), Some(rw.map(p))),
        };
        let g = rw.graph();
        let updated = match self.optimizer {
            Optimizer::AdamW { beta1, beta2, eps, weight_decay } => {
                let m = g.add_state(format!("adamw.m.{name}"), ty.clone());
                let v = g.add_state(format!("adamw.v.{name}"), ty.clone());
                let inputs = vec![param, grad, m, v, lr, step.expect("adamw has a step input")];
                let node = g
                    .add_node(Op::AdamW { beta1, beta2, eps, weight_decay }, inputs, 3)
                    .map_err(|m| invalid(format!("adamw for '{name}': {m}")))?;
                let outs = g.node(node).outputs.clone();
                updates.extend([(m, outs[1]), (v, outs[2])]);
                outs[0]
            }
            Optimizer::Sgd { momentum, weight_decay, nesterov } => {
                let buf = g.add_state(format!("sgd.momentum.{name}"), ty.clone());
                let node = g
                    .add_node(Op::Sgd { momentum, weight_decay, nesterov }, vec![param, grad, buf, lr], 2)
                    .map_err(|m| invalid(format!("sgd for '{name}': {m}")))?;
                let outs = g.node(node).outputs.clone();
                updates.push((buf, outs[1]));
                outs[0]
            }
        };
        updates.push((param, updated));
        if let Some(half) = master {
            let rounded = add(g, Op::Cast { to: param_ty.dtype }, vec![updated])?;
            updates.push((half, rounded));
        }
        Ok(())
    }
}

/// The optimizer's arithmetic type and the step's scalar inputs.
#[derive(Copy, Clone)]
struct StepScalars {
    dtype: DType,
    lr: ValueId,
    /// AdamW's (1-based) step.
    step: Option<ValueId>,
}

fn constant(g: &mut Graph, dtype: DType, value: f64) -> Result<ValueId, PassError> {
    add(g, Op::Constant { value: Tensor::full(dtype, vec![], value) }, vec![])
}

impl Pass for Optimize {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let invalid = |message: String| PassError::Invalid { pass: PASS, message };
        let grad_of = |p: ValueId| {
            let name = format!("{GRAD_PREFIX}{}", graph.name_of(p).unwrap_or(""));
            graph.outputs().iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
        };
        // The trainable parameters are those autodiff gave a gradient (frozen ones have none).
        let pairs: Vec<(ValueId, ValueId)> =
            graph.params().iter().filter_map(|&p| grad_of(p).map(|g| (p, g))).collect();
        let Some(&(first, _)) = pairs.first() else {
            return Err(invalid(
                "no parameter has a gradient output: run autodiff first, and leave something unfrozen".into(),
            ));
        };
        // The optimizer's arithmetic is f32 for 16-bit parameters (their masters are f32).
        let dtype = match graph.ty(first).dtype {
            DType::F16 | DType::BF16 => DType::F32,
            dtype => dtype,
        };
        let mut rw = Rewriter::new(graph, |_| true);
        let scalar = TensorType::scalar(dtype);
        let lr = rw.graph().add_input(StepInput::Lr.name(), scalar.clone());
        let step = matches!(self.optimizer, Optimizer::AdamW { .. })
            .then(|| rw.graph().add_input(StepInput::Step.name(), scalar.clone()));
        for (id, _) in graph.nodes() {
            rw.copy_node(id);
        }
        let mut grads = Vec::new();
        for &(_, grad) in &pairs {
            let grad = rw.map(grad);
            let g = rw.graph();
            grads.push(match g.ty(grad).dtype {
                DType::F16 | DType::BF16 => add(g, Op::Cast { to: DType::F32 }, vec![grad])?,
                _ => grad,
            });
        }
        let mut outputs: Vec<(String, ValueId)> = graph
            .outputs()
            .iter()
            .filter(|(n, _)| !n.starts_with(GRAD_PREFIX))
            .map(|(n, v)| (n.clone(), rw.map(*v)))
            .collect();
        let g = rw.graph();
        let loss_scale = match self.nonfinite {
            NonFinite::SkipScaled => Some(
                (g.inputs().iter().copied())
                    .find(|&v| g.name_of(v) == Some(crate::precision::LOSS_SCALE))
                    .ok_or_else(|| invalid(format!("no '{}' input to unscale by", crate::precision::LOSS_SCALE)))?,
            ),
            _ => None,
        };
        let finite = match self.nonfinite {
            NonFinite::Apply => None,
            NonFinite::Skip | NonFinite::SkipScaled => {
                let (finite, overflow) = self.finite_check(g, &grads, dtype)?;
                outputs.push((OVERFLOW.into(), overflow));
                Some(finite)
            }
        };
        if let (Some(scale), None) = (loss_scale, self.grad_clip) {
            let inverse = add(g, Op::Unary(UnaryOp::Reciprocal), vec![scale])?;
            for grad in &mut grads {
                *grad = add(g, Op::Binary(BinaryOp::Mul), vec![*grad, inverse])?;
            }
        }
        if let Some(clip) = self.grad_clip {
            let counted: Vec<bool> = pairs
                .iter()
                .map(|&(p, _)| {
                    let name = graph.name_of(p).unwrap_or("");
                    self.stage.as_ref().is_none_or(|s| !s.counted_elsewhere.contains(name))
                })
                .collect();
            let norm = self.clip_gradients(g, &mut grads, &counted, clip, loss_scale, dtype)?;
            outputs.push((autotp_program::step::StepOutput::GradNorm.name().into(), norm));
        }
        let scalars = StepScalars { dtype, lr, step };
        let mut updates = Vec::new();
        for (&(p, _), &grad) in pairs.iter().zip(&grads) {
            self.update(&mut rw, graph, (p, grad), &scalars, &mut updates)?;
        }
        if let Some(finite) = finite {
            let g = rw.graph();
            for (target, value) in &mut updates {
                *value = add(g, Op::Select, vec![finite, *value, *target])?;
            }
        }
        let mut result = rw.finish_without_outputs();
        for (name, v) in outputs {
            result.add_output(name, v);
        }
        for (target, value) in updates {
            result.add_update(target, value);
        }
        *graph = result.without_dead_code();
        Ok(())
    }
}
