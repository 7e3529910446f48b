//! `autodiff`: reverse-mode differentiation of a scalar loss with respect to every parameter.
//!
//! Input phase: imported (or simplified), with a scalar floating-point output named by
//! [`Autodiff::loss`]. Output: the same graph, the forward nodes unchanged, followed by the
//! backward nodes; after the original outputs come one output per parameter, in parameter order,
//! named `grad.<parameter>` ([`GRAD_PREFIX`]). A parameter the loss does not depend on gets a
//! zero gradient.
//!
//! Every op that can carry a gradient has a rule (its vector-Jacobian product, written with IR
//! ops); composites keep their own rules (softmax, log_softmax, layer_norm, rms_norm, gelu,
//! cross_entropy, nll_loss). Integer and boolean values carry none, and rounding ops (floor,
//! ceil, round, sign) have zero gradient. Broadcasting is undone by summing (`sum_to`).
//! Not yet differentiable, with a clear error when a parameter's gradient needs it: `mod` with
//! respect to its divisor.
//!
//! The rules are in `rules.rs`; this module walks the graph backward and builds the gradient
//! graph ([`Autodiff::differentiate`]).
//!
//! Tests: tests/gradients.rs checks every rule against f64 central differences on random inputs
//! of random shapes.

mod rules;

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::{BinaryOp, DType, Graph, NodeId, Op, ReduceOp, Rewriter, Tensor, TensorType, UnaryOp, ValueId};

use crate::{Pass, PassError};
use rules::vjp;

/// Output-name prefix of the gradients.
pub const GRAD_PREFIX: &str = "grad.";

pub struct Autodiff {
    /// Name of the scalar loss output.
    pub loss: String,
    /// Parameters that get no gradient (`--freeze`), with the parts of a fused weight named:
    /// they stay parameters, but nothing flows back to them and they get no `grad.` output.
    pub frozen: BTreeSet<String>,
    /// Embedding tables' padding rows ([`crate::padding`]): the row gets no gradient from the
    /// table's gathers, as `nn.Embedding(padding_idx=row)` in PyTorch.
    pub padding_rows: BTreeMap<String, usize>,
    /// A graph input holding the gradient of the `loss` output (which may then be any
    /// floating-point tensor of the input's type): the vector-Jacobian product instead of the
    /// gradient of a scalar. A pipeline stage's backward starts from the gradient the next stage
    /// sends.
    pub cotangent: Option<String>,
    /// Graph inputs to differentiate too (`grad.<input>` outputs after the parameters'): what a
    /// pipeline stage sends back to the stage before it.
    pub wrt_inputs: Vec<String>,
}

const PASS: &str = "autodiff";

impl Autodiff {
    /// Differentiates the output `loss` with respect to every parameter.
    pub fn new(loss: &str) -> Autodiff {
        Autodiff {
            loss: loss.to_string(),
            frozen: BTreeSet::new(),
            padding_rows: BTreeMap::new(),
            cotangent: None,
            wrt_inputs: Vec::new(),
        }
    }
}

/// Builds backward ops into the new graph.
struct B<'g> {
    g: &'g mut Graph,
    /// The op whose rule is being applied, for error messages.
    op: String,
}

impl B<'_> {
    fn op(&mut self, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
        let name = op.name();
        self.g
            .add(op, inputs)
            .map_err(|m| PassError::Invalid { pass: PASS, message: format!("gradient of {}: {name}: {m}", self.op) })
    }

    /// The outputs of a node of `op` with `num_outputs` results.
    fn ops(&mut self, op: Op, inputs: Vec<ValueId>, num_outputs: usize) -> Result<Vec<ValueId>, PassError> {
        let name = op.name();
        let node = self
            .g
            .add_node(op, inputs, num_outputs)
            .map_err(|m| PassError::Invalid { pass: PASS, message: format!("gradient of {}: {name}: {m}", self.op) })?;
        Ok(self.g.node(node).outputs.clone())
    }

    fn ty(&self, v: ValueId) -> TensorType {
        self.g.ty(v).clone()
    }

    fn scalar(&mut self, dtype: DType, value: f64) -> Result<ValueId, PassError> {
        self.op(Op::Constant { value: Tensor::full(dtype, vec![], value) }, vec![])
    }

    /// `value` broadcast to `shape`, without materialising a big constant.
    fn full(&mut self, dtype: DType, shape: &[usize], value: f64) -> Result<ValueId, PassError> {
        let s = self.scalar(dtype, value)?;
        if shape.is_empty() {
            return Ok(s);
        }
        self.op(Op::Expand { shape: shape.to_vec() }, vec![s])
    }

    fn un(&mut self, op: UnaryOp, x: ValueId) -> Result<ValueId, PassError> {
        self.op(Op::Unary(op), vec![x])
    }

    fn bin(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.op(Op::Binary(op), vec![a, b])
    }

    fn add(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.bin(BinaryOp::Add, a, b)
    }

    fn sub(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.bin(BinaryOp::Sub, a, b)
    }

    fn mul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.bin(BinaryOp::Mul, a, b)
    }

    fn div(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.bin(BinaryOp::Div, a, b)
    }

    /// `x * c` for a scalar constant `c`.
    fn scale(&mut self, x: ValueId, c: f64) -> Result<ValueId, PassError> {
        let c = self.scalar(self.ty(x).dtype, c)?;
        self.mul(x, c)
    }

    fn reduce(&mut self, op: ReduceOp, x: ValueId, axes: Vec<usize>, keep_dims: bool) -> Result<ValueId, PassError> {
        self.op(Op::Reduce { op, axes, keep_dims }, vec![x])
    }

    fn reshape(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId, PassError> {
        if self.ty(x).shape == shape {
            return Ok(x);
        }
        self.op(Op::Reshape { shape: shape.to_vec() }, vec![x])
    }

    fn expand(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId, PassError> {
        if self.ty(x).shape == shape {
            return Ok(x);
        }
        self.op(Op::Expand { shape: shape.to_vec() }, vec![x])
    }

    /// Sums `d` (a gradient of a broadcast result) down to `shape`: the inverse of broadcasting.
    fn sum_to(&mut self, d: ValueId, shape: &[usize]) -> Result<ValueId, PassError> {
        let from = self.ty(d).shape;
        if from == shape {
            return Ok(d);
        }
        let lead = from.len() - shape.len();
        let axes: Vec<usize> =
            (0..from.len()).filter(|&i| i < lead || (shape[i - lead] == 1 && from[i] != 1)).collect();
        let summed = if axes.is_empty() { d } else { self.reduce(ReduceOp::Sum, d, axes, true)? };
        self.reshape(summed, shape)
    }

    /// The gradient `g` of a slice along `dim` that took `n` elements from `start` in steps of
    /// `step` (negative: backwards), spread to consecutive positions `first..`: the elements
    /// in forward order with `|step| - 1` zeros after each but the last. Returns it and `first`.
    /// A slice that takes one of every `step` of all `size` elements (an interleaved pair's
    /// half, as gpt-oss's gate and up) spreads to all of them at once, `first` 0: each element
    /// padded to `step` on both sides, which keeps a split of `dim` (every rank its rows).
    fn unstride(
        &mut self,
        g: ValueId,
        dim: usize,
        start: usize,
        step: i64,
        size: usize,
    ) -> Result<(ValueId, usize), PassError> {
        let shape = self.ty(g).shape;
        let n = shape[dim];
        let stride = step.unsigned_abs() as usize;
        let (g, first) = if step < 0 {
            // Taken from `start` down to `start - (n-1)*stride`: reverse it into forward order.
            let mut starts = vec![0; shape.len()];
            let mut ends: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            let mut steps = vec![1; shape.len()];
            (starts[dim], ends[dim], steps[dim]) = (n - 1, -1, -1);
            (self.op(Op::Slice { starts, ends, steps }, vec![g])?, start - (n - 1) * stride)
        } else {
            (g, start)
        };
        if stride == 1 {
            return Ok((g, first));
        }
        // [.., n, ..] -> [.., n, 1, ..] -> pad to [.., n, stride, ..] -> [.., n*stride, ..],
        // then drop the zeros after the last element.
        let interleaved = step > 0 && start < stride && n * stride == size;
        let mut column = shape.clone();
        column.insert(dim + 1, 1);
        let g = self.reshape(g, &column)?;
        let (mut begin, mut end) = (vec![0; column.len()], vec![0; column.len()]);
        (begin[dim + 1], end[dim + 1]) = if interleaved { (start, stride - 1 - start) } else { (0, stride - 1) };
        let g = self.op(Op::Pad { begin, end, value: 0.0 }, vec![g])?;
        let mut spread = shape.clone();
        spread[dim] = n * stride;
        let g = self.reshape(g, &spread)?;
        if interleaved {
            return Ok((g, 0));
        }
        let mut ends: Vec<i64> = spread.iter().map(|&d| d as i64).collect();
        ends[dim] = ((n - 1) * stride + 1) as i64;
        let g = self.op(Op::Slice { starts: vec![0; spread.len()], ends, steps: vec![1; spread.len()] }, vec![g])?;
        Ok((g, first))
    }

    /// `d`, the gradient of a gather of table rows by `ids`, zero where the index is `row`.
    fn without_padding_row(&mut self, ids: ValueId, d: ValueId, row: usize) -> Result<ValueId, PassError> {
        let ids_type = self.ty(ids);
        let padding = self.scalar(ids_type.dtype, row as f64)?;
        let is_padding = self.bin(BinaryOp::Equal, ids, padding)?;
        let rows_shape: Vec<usize> = ids_type.shape.iter().copied().chain([1]).collect();
        let is_padding = self.reshape(is_padding, &rows_shape)?;
        self.mask(is_padding, d, true)
    }

    /// `select(cond, d, 0)` or, with `flip`, `select(cond, 0, d)`.
    fn mask(&mut self, cond: ValueId, d: ValueId, flip: bool) -> Result<ValueId, PassError> {
        let zero = self.scalar(self.ty(d).dtype, 0.0)?;
        let (a, b) = if flip { (zero, d) } else { (d, zero) };
        self.op(Op::Select, vec![cond, a, b])
    }
}

impl Pass for Autodiff {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        *graph = self.differentiate(graph)?.0;
        Ok(())
    }
}

impl Autodiff {
    /// The differentiated graph (what [`Pass::run`] makes of `graph`), and for each of its
    /// nodes the node of `graph` whose rule made it: `None` for the nodes copied from `graph`,
    /// the loss's seed and the zero gradients of parameters the loss does not use. A cost
    /// model reads a forward node's backward cost from it.
    pub fn differentiate(&self, graph: &Graph) -> Result<(Graph, Vec<Option<NodeId>>), PassError> {
        let invalid = |message: String| PassError::Invalid { pass: PASS, message };
        let loss = graph
            .outputs()
            .iter()
            .find(|(n, _)| *n == self.loss)
            .map(|(_, v)| *v)
            .ok_or_else(|| invalid(format!("the graph has no output named '{}'", self.loss)))?;
        let lt = graph.ty(loss);
        let input = |name: &str| {
            graph
                .inputs()
                .iter()
                .copied()
                .find(|&v| graph.name_of(v) == Some(name))
                .ok_or_else(|| invalid(format!("the graph has no input named '{name}'")))
        };
        let cotangent = self.cotangent.as_deref().map(input).transpose()?;
        match cotangent {
            Some(c) if graph.ty(c) != lt || !lt.dtype.is_float() => {
                return Err(invalid(format!(
                    "the gradient input '{}' is {}, the output '{}' it is the gradient of is {lt}",
                    self.cotangent.as_deref().unwrap_or(""),
                    graph.ty(c),
                    self.loss
                )))
            }
            None if !lt.dtype.is_float() || lt.numel() != 1 => {
                return Err(invalid(format!(
                    "the loss output '{}' must be a floating-point scalar, got {lt}",
                    self.loss
                )))
            }
            _ => {}
        }
        let wrt_inputs = self.wrt_inputs.iter().map(|name| input(name)).collect::<Result<Vec<_>, _>>()?;
        let n = graph.num_values();
        // Values that depend on a parameter (or an input differentiated) through floating-point
        // dataflow...
        let trainable: Vec<ValueId> = graph
            .params()
            .iter()
            .copied()
            .filter(|&p| {
                // A part of a fused weight (`split-fused`) is frozen with its weight.
                let name = graph.name_of(p).unwrap_or("");
                let weight = crate::split_fused::parse_part_name(name).map_or(name, |(weight, _)| weight);
                !self.frozen.contains(name) && !self.frozen.contains(weight)
            })
            .chain(wrt_inputs.iter().copied())
            .collect();
        let mut depends = vec![false; n];
        for &p in &trainable {
            depends[p.index()] = true;
        }
        for (_, node) in graph.nodes() {
            if node.inputs.iter().any(|v| depends[v.index()]) {
                for &o in &node.outputs {
                    depends[o.index()] = graph.ty(o).dtype.is_float();
                }
            }
        }
        // ...and that the loss depends on.
        let mut useful = vec![false; n];
        useful[loss.index()] = true;
        for (_, node) in graph.nodes().collect::<Vec<_>>().into_iter().rev() {
            if node.outputs.iter().any(|o| useful[o.index()]) {
                for v in &node.inputs {
                    useful[v.index()] = true;
                }
            }
        }

        let old = graph;
        let mut rw = Rewriter::new(old, |_| true);
        for (id, _) in old.nodes() {
            rw.copy_node(id);
        }
        let mut grads: Vec<Option<ValueId>> = vec![None; n];
        let seed = match cotangent {
            Some(c) => rw.map(c),
            None => rw
                .graph()
                .add(Op::Constant { value: Tensor::full(lt.dtype, lt.shape.clone(), 1.0) }, vec![])
                .expect("constant"),
        };
        grads[loss.index()] = Some(seed);
        let mut origins: Vec<Option<NodeId>> = vec![None; rw.graph().num_nodes()];
        for (id, node) in old.nodes().collect::<Vec<_>>().into_iter().rev() {
            let dy: Vec<Option<ValueId>> = node.outputs.iter().map(|o| grads[o.index()]).collect();
            if dy.iter().all(Option::is_none) {
                continue;
            }
            let want: Vec<bool> = node.inputs.iter().map(|v| depends[v.index()] && useful[v.index()]).collect();
            if !want.iter().any(|&w| w) {
                continue;
            }
            let xs: Vec<ValueId> = node.inputs.iter().map(|&v| rw.map(v)).collect();
            let ys: Vec<ValueId> = node.outputs.iter().map(|&v| rw.map(v)).collect();
            let mut b = B { g: rw.graph(), op: node.op.name() };
            let mut dy = dy;
            let padding_row = old.name_of(node.inputs[0]).and_then(|name| self.padding_rows.get(name));
            if let (Op::Gather { axis: 0 }, Some(&row), Some(d)) = (&node.op, padding_row, dy[0]) {
                dy[0] = Some(b.without_padding_row(xs[1], d, row)?);
            }
            let dxs = vjp(&mut b, &node.op, &xs, &ys, &dy, &want)?;
            for ((&v, dx), &w) in node.inputs.iter().zip(dxs).zip(&want) {
                let (Some(dx), true) = (dx, w) else { continue };
                grads[v.index()] = Some(match grads[v.index()] {
                    Some(acc) => b.add(acc, dx)?,
                    None => dx,
                });
            }
            origins.resize(rw.graph().num_nodes(), Some(id));
        }
        let param_grads: Vec<(String, ValueId)> = trainable
            .iter()
            .map(|&p| {
                let name = format!("{GRAD_PREFIX}{}", old.name_of(p).unwrap_or(""));
                let grad = match grads[p.index()] {
                    Some(g) => Ok(g),
                    None => {
                        let t = old.ty(p).clone();
                        let mut b = B { g: rw.graph(), op: "a value the loss does not use".into() };
                        b.full(t.dtype, &t.shape, 0.0)
                    }
                }?;
                Ok((name, grad))
            })
            .collect::<Result<_, PassError>>()?;
        let mut result = rw.finish();
        for (name, g) in param_grads {
            result.add_output(name, g);
        }
        origins.resize(result.num_nodes(), None);
        Ok((result, origins))
    }
}
