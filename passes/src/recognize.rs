//! `recognize`: rewrites decomposed composites, as PyTorch exports them, into the IR's
//! composite ops, which keep kernels and gradients simple:
//!
//! - GELU, exact: `x * 0.5 * (1 + erf(x / sqrt(2)))` in any association of the products, with
//!   `x / sqrt(2)` also written `x * (1 / sqrt(2))` -> `gelu x`.
//! - GELU, tanh: `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` -> `gelu x
//!   {approx = tanh}`.
//! - RMSNorm: `w * (x * 1 / sqrt(mean(x^2, last axis) + eps))` (rsqrt as `1 / sqrt`,
//!   `reciprocal(sqrt)` or `x / sqrt(...)`) -> `rms_norm x, w`.
//! - Softmax: `e / sum(e, axis)` with `e = exp(x)` or `e = exp(x - max(x, axis))` ->
//!   `softmax x {axis}` (the max subtraction only guards against overflow).
//!
//! Input and output phase: imported. The replaced pattern nodes are left for `dce`.
//! Tests: unit tests below and tests/golden/recognize*.ir.

use autotp_ir::{BinaryOp, GeluApprox, Graph, NodeId, Op, ReduceOp, Rewriter, UnaryOp, ValueId};

use crate::{Pass, PassError};

pub struct Recognize;

/// A match: replace node `root`'s output by `op` applied to `inputs`.
struct Match {
    root: NodeId,
    op: Op,
    inputs: Vec<ValueId>,
}

/// The graph with each value's producer and users, for matching patterns.
pub(crate) struct View<'g> {
    pub(crate) graph: &'g Graph,
    pub(crate) producer: Vec<Option<NodeId>>,
    pub(crate) users: Vec<Vec<NodeId>>,
}

impl<'g> View<'g> {
    pub(crate) fn new(graph: &'g Graph) -> View<'g> {
        let mut producer = vec![None; graph.num_values()];
        let mut users = vec![Vec::new(); graph.num_values()];
        for (id, node) in graph.nodes() {
            for &o in &node.outputs {
                producer[o.index()] = Some(id);
            }
            for &i in &node.inputs {
                users[i.index()].push(id);
            }
        }
        View { graph, producer, users }
    }

    pub(crate) fn op(&self, v: ValueId) -> Option<(&'g Op, &'g [ValueId])> {
        let node = self.graph.node(self.producer[v.index()]?);
        Some((&node.op, &node.inputs))
    }

    /// The value of a constant whose elements are all equal.
    pub(crate) fn scalar(&self, v: ValueId) -> Option<f64> {
        match self.op(v)? {
            (Op::Constant { value }, _) if value.numel() >= 1 && (value.numel() == 1 || value.is_splat()) => {
                Some(value.get_f64(0))
            }
            _ => None,
        }
    }

    fn is_scalar(&self, v: ValueId, expected: f64, tolerance: f64) -> bool {
        self.scalar(v).is_some_and(|s| (s - expected).abs() <= tolerance * expected.abs().max(1.0))
    }

    /// For `v = a op b` (commutative ops in either order): the operand beside `known`.
    fn other_operand(&self, v: ValueId, op: BinaryOp, known: ValueId) -> Option<ValueId> {
        match self.op(v)? {
            (Op::Binary(o), [a, b]) if *o == op && *a == known => Some(*b),
            (Op::Binary(o), [a, b]) if *o == op && *b == known => Some(*a),
            _ => None,
        }
    }

    /// `(a, b)` when `v = a op b`.
    fn binary(&self, v: ValueId, op: BinaryOp) -> Option<(ValueId, ValueId)> {
        match self.op(v)? {
            (Op::Binary(o), [a, b]) if *o == op => Some((*a, *b)),
            _ => None,
        }
    }

    fn unary(&self, v: ValueId, op: UnaryOp) -> Option<ValueId> {
        match self.op(v)? {
            (Op::Unary(o), [a]) if *o == op => Some(*a),
            _ => None,
        }
    }

    /// Outputs of `mul` nodes that read `v`.
    fn mul_users(&self, v: ValueId) -> impl Iterator<Item = ValueId> + '_ {
        self.users[v.index()].iter().filter_map(move |&n| {
            let node = self.graph.node(n);
            matches!(node.op, Op::Binary(BinaryOp::Mul)).then(|| node.outputs[0])
        })
    }

    /// Given `gate` (the `1 + erf(..)` or `1 + tanh(..)` value) and `x`, finds the value
    /// `0.5 * x * gate` in any association.
    fn half_x_times(&self, gate: ValueId, x: ValueId) -> Option<ValueId> {
        for m in self.mul_users(gate) {
            let other = self.other_operand(m, BinaryOp::Mul, gate)?;
            // (x * 0.5) * gate  or  (0.5 * x) * gate
            if let Some(half) = self.other_operand(other, BinaryOp::Mul, x) {
                if self.is_scalar(half, 0.5, 1e-6) {
                    return Some(m);
                }
            }
            // (x * gate) * 0.5
            if other == x {
                for outer in self.mul_users(m) {
                    let half = self.other_operand(outer, BinaryOp::Mul, m)?;
                    if self.is_scalar(half, 0.5, 1e-6) {
                        return Some(outer);
                    }
                }
            }
        }
        None
    }

    /// `1 + v` as a value read by some add node.
    fn plus_one(&self, v: ValueId) -> Option<ValueId> {
        self.users[v.index()].iter().find_map(|&n| {
            let node = self.graph.node(n);
            let out = node.outputs[0];
            let one = self.other_operand(out, BinaryOp::Add, v)?;
            self.is_scalar(one, 1.0, 0.0).then_some(out)
        })
    }

    fn gelu_erf(&self, erf_out: ValueId) -> Option<(ValueId, ValueId)> {
        let scaled = self.unary(erf_out, UnaryOp::Erf)?;
        let x = if let Some((x, c)) = self.binary(scaled, BinaryOp::Div) {
            self.is_scalar(c, std::f64::consts::SQRT_2, 1e-6).then_some(x)?
        } else {
            let (a, b) = self.binary(scaled, BinaryOp::Mul)?;
            let (x, c) = if self.scalar(b).is_some() { (a, b) } else { (b, a) };
            self.is_scalar(c, std::f64::consts::FRAC_1_SQRT_2, 1e-6).then_some(x)?
        };
        let gate = self.plus_one(erf_out)?;
        Some((x, self.half_x_times(gate, x)?))
    }

    fn gelu_tanh(&self, tanh_out: ValueId) -> Option<(ValueId, ValueId)> {
        let arg = self.unary(tanh_out, UnaryOp::Tanh)?;
        let (a, b) = self.binary(arg, BinaryOp::Mul)?;
        let (inner, c) = if self.scalar(a).is_some() { (b, a) } else { (a, b) };
        if !self.is_scalar(c, (2.0 / std::f64::consts::PI).sqrt(), 1e-5) {
            return None;
        }
        // inner = x + 0.044715 * x^3
        let (p, q) = self.binary(inner, BinaryOp::Add)?;
        let cubic_term = |x: ValueId, t: ValueId| -> bool {
            let Some((m1, m2)) = self.binary(t, BinaryOp::Mul) else {
                return false;
            };
            let (cube, k) = if self.scalar(m1).is_some() { (m2, m1) } else { (m1, m2) };
            self.is_scalar(k, 0.044715, 1e-5)
                && self.binary(cube, BinaryOp::Pow).is_some_and(|(base, e)| base == x && self.is_scalar(e, 3.0, 0.0))
        };
        let x = if cubic_term(p, q) {
            p
        } else if cubic_term(q, p) {
            q
        } else {
            return None;
        };
        let gate = self.plus_one(tanh_out)?;
        Some((x, self.half_x_times(gate, x)?))
    }

    /// From the `reduce_mean(x^2)` value: `(x, w, eps, result)`.
    fn rms_norm(&self, mean: ValueId) -> Option<(ValueId, ValueId, f64, ValueId)> {
        let (op, ins) = self.op(mean)?;
        let Op::Reduce { op: ReduceOp::Mean, axes, keep_dims: true } = op else {
            return None;
        };
        let square = ins[0];
        let (x, e) = self
            .binary(square, BinaryOp::Pow)
            .or_else(|| self.binary(square, BinaryOp::Mul).filter(|(a, b)| a == b).map(|(a, _)| (a, a)))?;
        if e != x && !self.is_scalar(e, 2.0, 0.0) {
            return None;
        }
        let rank = self.graph.ty(x).rank();
        if axes.as_slice() != [rank - 1] {
            return None;
        }
        let add = self.users[mean.index()]
            .iter()
            .map(|&n| self.graph.node(n).outputs[0])
            .find(|&o| self.other_operand(o, BinaryOp::Add, mean).is_some())?;
        let eps = self.scalar(self.other_operand(add, BinaryOp::Add, mean)?)?;
        let sqrt = self.users[add.index()]
            .iter()
            .map(|&n| self.graph.node(n).outputs[0])
            .find(|&o| self.unary(o, UnaryOp::Sqrt) == Some(add))?;
        // normalized = x * (1 / sqrt)  |  x * reciprocal(sqrt)  |  x / sqrt
        let normalized = self.users[sqrt.index()].iter().find_map(|&n| {
            let out = self.graph.node(n).outputs[0];
            if self.binary(out, BinaryOp::Div) == Some((x, sqrt)) {
                return Some(out);
            }
            let inv = match self.binary(out, BinaryOp::Div) {
                Some((one, s)) if s == sqrt && self.is_scalar(one, 1.0, 0.0) => out,
                _ if self.unary(out, UnaryOp::Reciprocal) == Some(sqrt) => out,
                _ => return None,
            };
            self.mul_users(inv).find(|&m| self.other_operand(m, BinaryOp::Mul, inv) == Some(x))
        })?;
        let result = self.mul_users(normalized).find(|&m| {
            self.other_operand(m, BinaryOp::Mul, normalized).is_some_and(|w| {
                self.graph.ty(w).shape[..] == self.graph.ty(x).shape[rank - 1..]
                    && self.graph.ty(w).dtype == self.graph.ty(x).dtype
            })
        })?;
        let w = self.other_operand(result, BinaryOp::Mul, normalized)?;
        Some((x, w, eps, result))
    }
}

impl View<'_> {
    /// From the `exp` value: `(x, axis, result)` of `exp(..) / reduce_sum(exp(..), [axis])`.
    fn softmax(&self, e: ValueId) -> Option<(ValueId, usize, ValueId)> {
        let arg = self.unary(e, UnaryOp::Exp)?;
        let sum = self.users[e.index()].iter().map(|&n| self.graph.node(n)).find_map(|node| match &node.op {
            Op::Reduce { op: ReduceOp::Sum, axes, keep_dims: true } if axes.len() == 1 => {
                Some((node.outputs[0], axes[0]))
            }
            _ => None,
        });
        let (sum, axis) = sum?;
        let result = self.users[e.index()]
            .iter()
            .map(|&n| self.graph.node(n).outputs[0])
            .find(|&o| self.binary(o, BinaryOp::Div) == Some((e, sum)))?;
        // exp(x - max(x)) or exp(x)
        let x = match self.binary(arg, BinaryOp::Sub) {
            Some((x, max)) => match self.op(max)? {
                (Op::Reduce { op: ReduceOp::Max, axes, keep_dims: true }, [m])
                    if *m == x && axes.as_slice() == [axis] =>
                {
                    x
                }
                _ => arg,
            },
            None => arg,
        };
        Some((x, axis, result))
    }
}

fn find_matches(graph: &Graph) -> Vec<Match> {
    let view = View::new(graph);
    let root_of = |v: ValueId| view.producer[v.index()].expect("pattern roots are node outputs");
    let mut matches = Vec::new();
    for (_, node) in graph.nodes() {
        let out = node.outputs[0];
        let found = match &node.op {
            Op::Unary(UnaryOp::Erf) => {
                view.gelu_erf(out).map(|(x, r)| (Op::Gelu { approx: GeluApprox::None }, vec![x], r))
            }
            Op::Unary(UnaryOp::Tanh) => {
                view.gelu_tanh(out).map(|(x, r)| (Op::Gelu { approx: GeluApprox::Tanh }, vec![x], r))
            }
            Op::Unary(UnaryOp::Exp) => view.softmax(out).map(|(x, axis, r)| (Op::Softmax { axis }, vec![x], r)),
            Op::Reduce { op: ReduceOp::Mean, .. } => view.rms_norm(out).map(|(x, w, eps, r)| {
                let axis = graph.ty(x).rank() - 1;
                (Op::RmsNorm { axis, eps }, vec![x, w], r)
            }),
            _ => None,
        };
        if let Some((op, inputs, result)) = found {
            if graph.ty(inputs[0]).dtype.is_float() {
                matches.push(Match { root: root_of(result), op, inputs });
            }
        }
    }
    matches
}

impl Pass for Recognize {
    fn name(&self) -> &'static str {
        "recognize"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let matches = find_matches(graph);
        if matches.is_empty() {
            return Ok(());
        }
        let old = &*graph;
        let mut rw = Rewriter::new(old, |_| true);
        for (id, node) in old.nodes() {
            match matches.iter().find(|m| m.root == id) {
                Some(m) => {
                    let inputs = m.inputs.iter().map(|&v| rw.map(v)).collect();
                    let new = rw.graph().add(m.op.clone(), inputs).expect("the matched pattern type-checks");
                    rw.set(node.outputs[0], new);
                }
                None => rw.copy_node(id),
            }
        }
        tracing::debug!(count = matches.len(), "recognized composites");
        *graph = rw.finish();
        Ok(())
    }
}
