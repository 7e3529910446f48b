//! Every gradient rule of `autodiff` against f64 central differences, on random inputs of
//! random shapes. Each case builds `y = f(params)`; the test appends `loss = sum(y * R)` with a
//! fixed random `R` (so the upstream gradient is generic), differentiates, and compares each
//! parameter's gradient element by element with `(loss(p + h) - loss(p - h)) / 2h`.

use std::collections::BTreeMap;

use autotp_ir::{
    BinaryOp, DType, GeluApprox, Graph, Op, ReduceOp, Reduction, ScatterReduction, Tensor, TensorType, UnaryOp, ValueId,
};
use autotp_passes::autodiff::{Autodiff, GRAD_PREFIX};
use autotp_passes::Pass;

/// A small deterministic generator for shapes and values.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    fn dim(&mut self) -> usize {
        1 + (self.next() * 4.0) as usize
    }

    fn shape(&mut self, rank: usize) -> Vec<usize> {
        (0..rank).map(|_| self.dim()).collect()
    }

    fn tensor(&mut self, shape: &[usize], lo: f64, hi: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let values: Vec<f64> = (0..n).map(|_| lo + (hi - lo) * self.next()).collect();
        Tensor::from_pod(DType::F64, shape.to_vec(), &values)
    }
}

/// A case: a graph with f64 parameters and one output `y`, and the parameters' values.
struct Case {
    graph: Graph,
    params: BTreeMap<String, Tensor>,
}

impl Case {
    fn new() -> Case {
        Case { graph: Graph::new("case"), params: BTreeMap::new() }
    }

    fn param(&mut self, rng: &mut Rng, shape: &[usize], lo: f64, hi: f64) -> ValueId {
        let name = format!("p{}", self.params.len());
        self.params.insert(name.clone(), rng.tensor(shape, lo, hi));
        self.graph.add_param(name, TensorType::new(DType::F64, shape.to_vec()))
    }

    fn constant(&mut self, t: Tensor) -> ValueId {
        self.graph.add(Op::Constant { value: t }, vec![]).unwrap()
    }

    fn op(&mut self, op: Op, inputs: Vec<ValueId>) -> ValueId {
        let name = op.name();
        self.graph.add(op, inputs).unwrap_or_else(|e| panic!("{name}: {e}"))
    }
}

fn loss_of(graph: &Graph, params: &BTreeMap<String, Tensor>) -> f64 {
    autotp_ir::eval::eval_graph(graph, params, &[]).unwrap()[0].get_f64(0)
}

/// Differentiates `case` (output `y`) and compares with central differences.
fn check(label: &str, mut case: Case, rng: &mut Rng) {
    let y = case.graph.outputs()[0].1;
    let shape = case.graph.ty(y).shape.clone();
    let r = case.constant(rng.tensor(&shape, -1.0, 1.0));
    let weighted = case.op(Op::Binary(BinaryOp::Mul), vec![y, r]);
    let all = (0..shape.len()).collect();
    let loss = case.op(Op::Reduce { op: ReduceOp::Sum, axes: all, keep_dims: false }, vec![weighted]);
    let mut forward = Graph::new("loss");
    std::mem::swap(&mut forward, &mut case.graph);
    // Keep only the loss as output so the finite differences evaluate just it.
    let mut with_loss = forward.clone();
    with_loss.add_output("loss", loss);
    let loss_only = {
        let mut g = with_loss.clone();
        let text = autotp_ir::text::print(&g);
        let text = text.lines().filter(|l| !l.trim_start().starts_with("output \"y\"")).collect::<Vec<_>>().join("\n");
        g = autotp_ir::text::parse(&text).unwrap();
        g
    };
    let mut grad_graph = with_loss.clone();
    Autodiff::new("loss").run(&mut grad_graph).unwrap_or_else(|e| panic!("{label}: {e}"));
    autotp_ir::verify(&grad_graph).unwrap_or_else(|e| panic!("{label}: {e}"));
    let outputs =
        autotp_ir::eval::eval_graph(&grad_graph, &case.params, &[]).unwrap_or_else(|e| panic!("{label}: {e}"));
    let h = 1e-6;
    for (name, value) in &case.params {
        let index = grad_graph.outputs().iter().position(|(n, _)| *n == format!("{GRAD_PREFIX}{name}")).unwrap();
        let analytic = &outputs[index];
        assert_eq!(analytic.ty, value.ty, "{label}: gradient of {name} has the wrong type");
        for i in 0..value.numel() {
            let perturbed = |delta: f64| {
                let mut values = value.to_f64_vec();
                values[i] += delta;
                let mut params = case.params.clone();
                params.insert(name.clone(), Tensor::from_pod(DType::F64, value.shape().to_vec(), &values));
                loss_of(&loss_only, &params)
            };
            let numeric = (perturbed(h) - perturbed(-h)) / (2.0 * h);
            let a = analytic.get_f64(i);
            let tolerance = 1e-6 + 1e-5 * a.abs().max(numeric.abs());
            assert!(
                (a - numeric).abs() <= tolerance,
                "{label}: d loss / d {name}[{i}] is {a}, finite differences give {numeric}"
            );
        }
    }
}

fn output(case: &mut Case, y: ValueId) {
    case.graph.add_output("y", y);
}

const SEEDS: [u64; 3] = [1, 2, 3];

#[test]
fn unary_ops() {
    use UnaryOp::*;
    for seed in SEEDS {
        for (op, lo, hi) in [
            (Neg, -1.0, 1.0),
            (Abs, 0.1, 1.0),
            (Exp, -1.0, 1.0),
            (Log, 0.5, 2.0),
            (Sqrt, 0.5, 2.0),
            (Rsqrt, 0.5, 2.0),
            (Reciprocal, 0.5, 2.0),
            (Tanh, -1.0, 1.0),
            (Erf, -1.0, 1.0),
            (Sigmoid, -2.0, 2.0),
            (Softplus, -3.0, 3.0),
            (Relu, 0.1, 1.0),
            (Sin, -2.0, 2.0),
            (Cos, -2.0, 2.0),
        ] {
            let mut rng = Rng(seed);
            let mut case = Case::new();
            let rank = 1 + (rng.next() * 3.0) as usize;
            let shape = rng.shape(rank);
            let p = case.param(&mut rng, &shape, lo, hi);
            // Relu and abs also on negative values: shift half the elements below zero.
            let x = if matches!(op, Relu | Abs) {
                let shift = case.param(&mut rng, &shape, -1.1, 0.0);
                case.op(Op::Binary(BinaryOp::Add), vec![p, shift])
            } else {
                p
            };
            let y = case.op(Op::Unary(op), vec![x]);
            output(&mut case, y);
            check(&format!("{} seed {seed}", op.name()), case, &mut rng);
        }
    }
}

/// Two shapes that broadcast: random dims of the second set to 1 or dropped.
fn broadcast_pair(rng: &mut Rng) -> (Vec<usize>, Vec<usize>) {
    let rank = 1 + (rng.next() * 3.0) as usize;
    let a = rng.shape(rank);
    let mut b: Vec<usize> = a.iter().map(|&d| if rng.next() < 0.4 { 1 } else { d }).collect();
    if rng.next() < 0.3 {
        b.remove(0);
    }
    if rng.next() < 0.5 {
        (a, b)
    } else {
        (b, a)
    }
}

#[test]
fn binary_ops_with_broadcasting() {
    use BinaryOp::*;
    for seed in SEEDS {
        for op in [Add, Sub, Mul, Div, Pow, Max, Min] {
            let mut rng = Rng(seed * 31 + op as u64);
            let mut case = Case::new();
            let (sa, sb) = broadcast_pair(&mut rng);
            let (lo, hi) = if matches!(op, Div | Pow) { (0.5, 2.0) } else { (-1.0, 1.0) };
            let a = case.param(&mut rng, &sa, lo, hi);
            let b = case.param(&mut rng, &sb, lo, hi);
            let y = case.op(Op::Binary(op), vec![a, b]);
            output(&mut case, y);
            check(&format!("{} {sa:?} {sb:?} seed {seed}", op.name()), case, &mut rng);
        }
    }
}

#[test]
fn select_cast_and_reductions() {
    for seed in SEEDS {
        let mut rng = Rng(seed + 100);
        let shape = rng.shape(3);
        let mut case = Case::new();
        let a = case.param(&mut rng, &shape, -1.0, 1.0);
        let b = case.param(&mut rng, &shape[1..], -1.0, 1.0);
        let zero = case.constant(Tensor::full(DType::F64, vec![], 0.0));
        let cond = case.op(Op::Binary(BinaryOp::Greater), vec![a, zero]);
        let s = case.op(Op::Select, vec![cond, a, b]);
        let y = case.op(Op::Cast { to: DType::F64 }, vec![s]);
        output(&mut case, y);
        check(&format!("select/cast seed {seed}"), case, &mut rng);

        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod] {
            for keep_dims in [true, false] {
                let mut case = Case::new();
                let shape = rng.shape(3);
                let x = case.param(&mut rng, &shape, 0.5, 1.5);
                let axes: Vec<usize> = (0..3).filter(|_| rng.next() < 0.6).collect();
                let axes = if axes.is_empty() { vec![1] } else { axes };
                let y = case.op(Op::Reduce { op, axes: axes.clone(), keep_dims }, vec![x]);
                output(&mut case, y);
                check(&format!("reduce_{} {shape:?} axes {axes:?} keep {keep_dims}", op.name()), case, &mut rng);
            }
        }
    }
}

#[test]
fn matmul_all_layouts() {
    for seed in SEEDS {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut rng = Rng(seed * 7 + ta as u64 * 2 + tb as u64);
            let (m, k, n) = (rng.dim(), rng.dim(), rng.dim());
            let batch_rank = 1 + (rng.next() * 2.0) as usize;
            let batch = rng.shape(batch_rank);
            let mut a_shape = if rng.next() < 0.5 { batch.clone() } else { vec![] };
            a_shape.extend(if ta { [k, m] } else { [m, k] });
            let mut b_shape = if rng.next() < 0.5 {
                batch.iter().map(|&d| if rng.next() < 0.5 { 1 } else { d }).collect()
            } else {
                vec![]
            };
            b_shape.extend(if tb { [n, k] } else { [k, n] });
            let mut case = Case::new();
            let a = case.param(&mut rng, &a_shape, -1.0, 1.0);
            let b = case.param(&mut rng, &b_shape, -1.0, 1.0);
            let y = case.op(Op::MatMul { transpose_lhs: ta, transpose_rhs: tb }, vec![a, b]);
            output(&mut case, y);
            check(
                &format!(
                    "matmul {a_shape:?}{} x {b_shape:?}{}",
                    if ta { "^T" } else { "" },
                    if tb { "^T" } else { "" }
                ),
                case,
                &mut rng,
            );
        }
    }
}

/// Builds `y` from the case's parameter `x`.
type BuildFn = dyn Fn(&mut Case, &mut Rng, ValueId) -> ValueId;

#[test]
fn data_movement() {
    for seed in SEEDS {
        let mut rng = Rng(seed + 500);
        let shape = rng.shape(3);
        let n: usize = shape.iter().product();
        let cases: Vec<(&str, Box<BuildFn>)> = vec![
            ("reshape", Box::new(move |c, _, x| c.op(Op::Reshape { shape: vec![n] }, vec![x]))),
            ("transpose", Box::new(|c, _, x| c.op(Op::Transpose { perm: vec![2, 0, 1] }, vec![x]))),
            (
                "slice",
                Box::new(|c, _, x| {
                    let s = c.graph.ty(x).shape.clone();
                    let starts: Vec<usize> = s.iter().map(|&d| d / 2).collect();
                    let ends = s.iter().map(|&d| d as i64).collect();
                    c.op(Op::Slice { starts, ends, steps: vec![1; 3] }, vec![x])
                }),
            ),
            (
                "strided and reversed slice",
                Box::new(|c, _, x| {
                    // Every other element from d/3 on; the dim reversed; every other one
                    // backwards from the end (GPT-J's rotary takes x[..., ::2], x[..., 1::2]).
                    let s = c.graph.ty(x).shape.clone();
                    let starts = vec![s[0] / 3, s[1] - 1, s[2] - 1];
                    let ends = vec![s[0] as i64, -1, -1];
                    c.op(Op::Slice { starts, ends, steps: vec![2, -1, -2] }, vec![x])
                }),
            ),
            (
                "odd elements",
                Box::new(|c, _, x| {
                    let s = c.graph.ty(x).shape.clone();
                    let starts = vec![0, 0, usize::from(s[2] > 1)];
                    let ends = s.iter().map(|&d| d as i64).collect();
                    c.op(Op::Slice { starts, ends, steps: vec![1, 1, 2] }, vec![x])
                }),
            ),
            (
                "interleaved halves",
                Box::new(|c, _, x| {
                    // One of every two of a whole even dim, from 0 and from 1 (gpt-oss's gate
                    // and up): the gradient spreads back without a slice.
                    let doubled = c.op(Op::Concat { axis: 2 }, vec![x, x]);
                    let s = c.graph.ty(doubled).shape.clone();
                    let half = |c: &mut Case, start: usize| {
                        let ends = s.iter().map(|&d| d as i64).collect();
                        c.op(Op::Slice { starts: vec![0, 0, start], ends, steps: vec![1, 1, 2] }, vec![doubled])
                    };
                    let (even, odd) = (half(c, 0), half(c, 1));
                    c.op(Op::Binary(BinaryOp::Mul), vec![even, odd])
                }),
            ),
            (
                "concat",
                Box::new(|c, r, x| {
                    let mut s = c.graph.ty(x).shape.clone();
                    s[1] = r.dim();
                    let other = c.param(r, &s, -1.0, 1.0);
                    c.op(Op::Concat { axis: 1 }, vec![x, other, x])
                }),
            ),
            (
                "expand",
                Box::new(|c, r, x| {
                    let mut s = vec![r.dim()];
                    s.extend(c.graph.ty(x).shape.clone());
                    c.op(Op::Expand { shape: s }, vec![x])
                }),
            ),
            (
                "pad",
                Box::new(|c, _, x| c.op(Op::Pad { begin: vec![1, 0, 2], end: vec![0, 3, 1], value: 0.5 }, vec![x])),
            ),
            ("triu", Box::new(|c, _, x| c.op(Op::Triangle { upper: true, k: 0 }, vec![x]))),
            ("tril", Box::new(|c, _, x| c.op(Op::Triangle { upper: false, k: 1 }, vec![x]))),
            ("cumsum", Box::new(|c, _, x| c.op(Op::CumSum { axis: 1, exclusive: false, reverse: false }, vec![x]))),
            (
                "cumsum exclusive reverse",
                Box::new(|c, _, x| c.op(Op::CumSum { axis: 2, exclusive: true, reverse: true }, vec![x])),
            ),
            (
                "gather",
                Box::new(|c, r, x| {
                    let len = c.graph.ty(x).shape[1];
                    let idx: Vec<i64> = (0..5).map(|_| (r.next() * len as f64) as i64).collect();
                    let idx = c.constant(Tensor::from_i64(vec![5], &idx));
                    c.op(Op::Gather { axis: 1 }, vec![x, idx])
                }),
            ),
            (
                "scatter_add",
                Box::new(|c, r, x| {
                    let s = c.graph.ty(x).shape.clone();
                    let idx: Vec<i64> = (0..s[1]).map(|_| (r.next() * 3.0) as i64).collect();
                    let idx = c.constant(Tensor::from_i64(vec![s[1]], &idx));
                    c.op(Op::ScatterAdd { axis: 1, size: 3 }, vec![idx, x])
                }),
            ),
            (
                "gather_elements",
                Box::new(|c, r, x| {
                    // Indices narrower than the data on the last dim: its gradient pads there.
                    let s = c.graph.ty(x).shape.clone();
                    let shape = vec![s[0], 5, s[2].div_ceil(2)];
                    let n: usize = shape.iter().product();
                    let idx: Vec<i64> = (0..n).map(|_| (r.next() * s[1] as f64) as i64).collect();
                    let idx = c.constant(Tensor::from_i64(shape, &idx));
                    c.op(Op::GatherElements { axis: 1 }, vec![x, idx])
                }),
            ),
            (
                "scatter_elements",
                Box::new(|c, r, x| {
                    let s = c.graph.ty(x).shape.clone();
                    let idx: Vec<i64> = (0..s.iter().product()).map(|_| (r.next() * 3.0) as i64).collect();
                    let idx = c.constant(Tensor::from_i64(s, &idx));
                    c.op(Op::ScatterElements { axis: 1, size: 3 }, vec![idx, x])
                }),
            ),
            (
                "gather_nd",
                Box::new(|c, r, x| {
                    // Rows of two indices pick [d2] slices (repeats included: their gradients add).
                    let s = c.graph.ty(x).shape.clone();
                    let idx: Vec<i64> = (0..6)
                        .flat_map(|_| [(r.next() * s[0] as f64) as i64, (r.next() * s[1] as f64) as i64])
                        .collect();
                    let idx = c.constant(Tensor::from_i64(vec![3, 2, 2], &idx));
                    c.op(Op::GatherNd, vec![x, idx])
                }),
            ),
            (
                "scatter_nd",
                Box::new(|c, r, x| {
                    // Distinct rows (a repeated one would overwrite: the last write wins) replaced
                    // by the same rows of a second parameter, and one added.
                    let s = c.graph.ty(x).shape.clone();
                    let rows: Vec<i64> = (0..s[0] as i64).rev().step_by(2).collect();
                    let n = rows.len();
                    let idx = c.constant(Tensor::from_i64(vec![n, 1], &rows));
                    let mut us = s.clone();
                    us[0] = n;
                    let updates = c.param(r, &us, -1.0, 1.0);
                    let replaced = c.op(Op::ScatterNd { reduction: ScatterReduction::None }, vec![x, idx, updates]);
                    c.op(Op::ScatterNd { reduction: ScatterReduction::Add }, vec![replaced, idx, updates])
                }),
            ),
            (
                "topk",
                Box::new(|c, _, x| {
                    let k = c.graph.ty(x).shape[2].min(2);
                    let node = c.graph.add_node(Op::TopK { axis: 2, k, largest: true }, vec![x], 2).unwrap();
                    c.graph.node(node).outputs[0]
                }),
            ),
        ];
        for (label, build) in cases {
            let mut case = Case::new();
            let x = case.param(&mut rng, &shape, -1.0, 1.0);
            let y = build(&mut case, &mut rng, x);
            output(&mut case, y);
            check(&format!("{label} {shape:?} seed {seed}"), case, &mut rng);
        }
        let mut case = Case::new();
        let mut wide = shape.clone();
        wide[2] += 2;
        let x = case.param(&mut rng, &wide, -1.0, 1.0);
        let node = case.graph.add_node(Op::Split { axis: 2, sizes: vec![shape[2], 2] }, vec![x], 2).unwrap();
        let outs = case.graph.node(node).outputs.clone();
        // Only the second piece reaches the loss: the first gets a zero gradient.
        output(&mut case, outs[1]);
        check(&format!("split {wide:?} seed {seed}"), case, &mut rng);
    }
}

#[test]
fn composite_ops() {
    for seed in SEEDS {
        let mut rng = Rng(seed + 900);
        let shape = rng.shape(3);
        for axis in 0..3 {
            for log in [false, true] {
                let mut case = Case::new();
                let x = case.param(&mut rng, &shape, -2.0, 2.0);
                let op = if log { Op::LogSoftmax { axis } } else { Op::Softmax { axis } };
                let y = case.op(op, vec![x]);
                output(&mut case, y);
                check(&format!("softmax log={log} axis {axis} {shape:?}"), case, &mut rng);
            }
        }
        for axis in 1..3 {
            for bias in [false, true] {
                let mut case = Case::new();
                let x = case.param(&mut rng, &shape, -2.0, 2.0);
                let w = case.param(&mut rng, &shape[axis..], 0.5, 1.5);
                let mut ins = vec![x, w];
                if bias {
                    ins.push(case.param(&mut rng, &shape[axis..], -1.0, 1.0));
                }
                let y = case.op(Op::LayerNorm { axis, eps: 1e-5 }, ins);
                output(&mut case, y);
                check(&format!("layer_norm axis {axis} bias {bias} {shape:?}"), case, &mut rng);
            }
            let mut case = Case::new();
            let x = case.param(&mut rng, &shape, -2.0, 2.0);
            let w = case.param(&mut rng, &shape[axis..], 0.5, 1.5);
            let y = case.op(Op::RmsNorm { axis, eps: 1e-6 }, vec![x, w]);
            output(&mut case, y);
            check(&format!("rms_norm axis {axis} {shape:?}"), case, &mut rng);
        }
        for approx in [GeluApprox::None, GeluApprox::Tanh] {
            let mut case = Case::new();
            let x = case.param(&mut rng, &shape, -3.0, 3.0);
            let y = case.op(Op::Gelu { approx }, vec![x]);
            output(&mut case, y);
            check(&format!("gelu {approx:?} {shape:?}"), case, &mut rng);
        }
    }
}

/// A convolution to check: its label, input shape, weight shape and attributes.
type ConvForm<'a> = (&'a str, &'a [usize], &'a [usize], Vec<(&'a str, Vec<i64>)>);

/// One ONNX node of type `op_type` whose inputs are all f64 initializers of the given names
/// and shapes (so all are parameters), as the frontend imports it; its output is `y`. An
/// attribute named in `scalars` is an INT, any other INTS.
fn imported_node(
    rng: &mut Rng,
    op_type: &str,
    inputs: &[(&str, &[usize])],
    attributes: &[(&str, Vec<i64>)],
    scalars: &[&str],
) -> Case {
    use autotp_frontend::onnx::proto;
    use prost::Message;
    let initializer = |rng: &mut Rng, name: &str, shape: &[usize]| {
        let values = rng.tensor(shape, -1.0, 1.0);
        proto::TensorProto {
            name: name.into(),
            dims: shape.iter().map(|&d| d as i64).collect(),
            data_type: 11, // DOUBLE
            raw_data: values.bytes().to_vec().into(),
            ..Default::default()
        }
    };
    let attribute = |(name, ints): &(&str, Vec<i64>)| proto::AttributeProto {
        name: (*name).into(),
        r#type: if scalars.contains(name) { 2 } else { 7 }, // INT, INTS
        i: ints[0],
        ints: ints.clone(),
        ..Default::default()
    };
    let model = proto::ModelProto {
        ir_version: 8,
        opset_import: vec![proto::OperatorSetIdProto { domain: String::new(), version: 17 }],
        graph: Some(proto::GraphProto {
            name: op_type.into(),
            node: vec![proto::NodeProto {
                op_type: op_type.into(),
                name: format!("the_{op_type}"),
                input: inputs.iter().map(|(name, _)| (*name).into()).collect(),
                output: vec!["y".into()],
                attribute: attributes.iter().map(attribute).collect(),
                ..Default::default()
            }],
            initializer: inputs.iter().map(|(name, shape)| initializer(rng, name, shape)).collect(),
            output: vec![proto::ValueInfoProto { name: "y".into(), ..Default::default() }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let path = std::path::Path::new("node.onnx");
    let imported = autotp_frontend::onnx::import_bytes(model.encode_to_vec().into(), path, &Default::default())
        .unwrap_or_else(|e| panic!("{op_type}: {e}"));
    assert_eq!(imported.weights.len(), inputs.len(), "{op_type}: every input is a parameter");
    Case { graph: imported.graph, params: imported.weights }
}

/// `Conv` imported as its taps: depthwise (causal 1-D, with a channel multiplier), grouped with
/// strides and dilations (im2col), and dense 2-D with asymmetric padding. The input, weight and
/// bias gradients against central differences.
#[test]
fn imported_convolutions() {
    let forms: [ConvForm; 4] = [
        ("depthwise causal 1-D", &[2, 4, 6], &[4, 1, 3], vec![("group", vec![4]), ("pads", vec![2, 2])]),
        ("depthwise x2 1-D", &[1, 2, 5], &[4, 1, 2], vec![("group", vec![2])]),
        (
            "grouped strided dilated 1-D",
            &[2, 4, 7],
            &[6, 2, 2],
            vec![("group", vec![2]), ("pads", vec![1, 0]), ("strides", vec![2]), ("dilations", vec![2])],
        ),
        ("dense 2-D", &[1, 3, 4, 4], &[2, 3, 2, 2], vec![("pads", vec![1, 0, 0, 1]), ("strides", vec![1, 2])]),
    ];
    let mut rng = Rng(1200);
    for (label, x, w, attributes) in forms {
        let inputs: [(&str, &[usize]); 3] = [("x", x), ("w", w), ("b", &w[..1])];
        let case = imported_node(&mut rng, "Conv", &inputs, &attributes, &["group"]);
        check(label, case, &mut rng);
    }
}

/// The reductions ONNX composes from a sum (`ReduceLogSumExp` from the maximum), imported as
/// that arithmetic, over one axis and two, kept or not; `ReduceLogSum` of positive terms.
#[test]
fn imported_composite_reductions() {
    let mut rng = Rng(1300);
    for op in ["ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp"] {
        for (axes, keep) in [(vec![1], 1), (vec![0, 2], 0)] {
            let attributes = [("axes", axes.clone()), ("keepdims", vec![keep])];
            let case = imported_node(&mut rng, op, &[("x", &[2, 3, 4])], &attributes, &["keepdims"]);
            check(&format!("{op} {axes:?} keepdims {keep}"), case, &mut rng);
        }
    }
    let attributes = [("axes", vec![2]), ("keepdims", vec![1])];
    let mut case = imported_node(&mut rng, "ReduceLogSum", &[("x", &[2, 3, 4])], &attributes, &["keepdims"]);
    for value in case.params.values_mut() {
        let positive: Vec<f64> = value.to_f64_vec().iter().map(|v| v + 2.0).collect();
        *value = Tensor::from_pod(DType::F64, value.shape().to_vec(), &positive);
    }
    check("ReduceLogSum", case, &mut rng);
}

/// Fused attention (`q`, `k`, `v` trained; the bias a constant) under every mask, with one
/// key/value head shared by the query heads.
#[test]
fn attention() {
    use autotp_ir::AttentionMask;
    for seed in SEEDS {
        let mut rng = Rng(seed + 950);
        let (q_len, d, dv) = (1 + rng.dim(), rng.dim(), rng.dim());
        for (mask, kv_heads, bias) in [
            (AttentionMask::None, 3, false),
            (AttentionMask::Causal, 1, true),
            (AttentionMask::SlidingWindow { window: 2 }, 3, true),
        ] {
            let mut case = Case::new();
            let q = case.param(&mut rng, &[2, 3, q_len, d], -1.0, 1.0);
            let k = case.param(&mut rng, &[2, kv_heads, q_len, d], -1.0, 1.0);
            let v = case.param(&mut rng, &[2, kv_heads, q_len, dv], -1.0, 1.0);
            let mut inputs = vec![q, k, v];
            if bias {
                inputs.push(case.constant(rng.tensor(&[1, 3, q_len, q_len], -1.0, 1.0)));
            }
            let node = case.graph.add_node(Op::Attention { scale: 0.7, mask, kv_block: None }, inputs, 2).unwrap();
            let out = case.graph.node(node).outputs[0];
            output(&mut case, out);
            check(&format!("attention {mask:?} kv heads {kv_heads} bias {bias} q_len {q_len}"), case, &mut rng);
        }
    }
}

#[test]
fn classification_losses() {
    for seed in SEEDS {
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            for (ignore, weighted, log_prob, nll) in [
                (false, false, false, false),
                (true, false, false, false),
                (true, true, false, false),
                (false, false, true, false),
                (true, true, false, true),
                (false, false, false, true),
            ] {
                let mut rng = Rng(seed * 13 + reduction as u64);
                let (n, classes, inner) = (rng.dim(), 1 + rng.dim(), rng.dim());
                let mut case = Case::new();
                let scores = case.param(&mut rng, &[n, classes, inner], -2.0, 2.0);
                let mut labels: Vec<i64> = (0..n * inner).map(|_| (rng.next() * classes as f64) as i64).collect();
                if ignore {
                    labels[0] = -100;
                }
                let labels = case.constant(Tensor::from_i64(vec![n, inner], &labels));
                let mut ins = vec![scores, labels];
                if weighted {
                    let w = rng.tensor(&[classes], 0.5, 2.0);
                    ins.push(case.constant(w));
                }
                let ignore_index = ignore.then_some(-100);
                let label = format!(
                    "{} {reduction:?} ignore {ignore} weighted {weighted} log_prob {log_prob}",
                    if nll { "nll" } else { "cross_entropy" }
                );
                if nll {
                    let lp = case.op(Op::LogSoftmax { axis: 1 }, vec![scores]);
                    ins[0] = lp;
                    let y = case.op(Op::NllLoss { ignore_index, reduction }, ins);
                    output(&mut case, y);
                } else {
                    let node = case
                        .graph
                        .add_node(Op::CrossEntropy { ignore_index, reduction }, ins, if log_prob { 2 } else { 1 })
                        .unwrap();
                    let outs = case.graph.node(node).outputs.clone();
                    let y = if log_prob {
                        // Use both outputs: the loss and the log-probabilities.
                        let all = (0..3).collect();
                        let s = case.op(Op::Reduce { op: ReduceOp::Sum, axes: all, keep_dims: false }, vec![outs[1]]);
                        let total = case.op(
                            Op::Reduce {
                                op: ReduceOp::Sum,
                                axes: (0..case.graph.ty(outs[0]).rank()).collect(),
                                keep_dims: false,
                            },
                            vec![outs[0]],
                        );
                        case.op(Op::Binary(BinaryOp::Add), vec![s, total])
                    } else {
                        outs[0]
                    };
                    output(&mut case, y);
                }
                check(&format!("{label} seed {seed}"), case, &mut rng);
            }
        }
    }
}

#[test]
fn refuses_what_it_cannot_differentiate() {
    let mut case = Case::new();
    let mut rng = Rng(5);
    let x = case.param(&mut rng, &[4], -1.0, 1.0);
    let ten = case.constant(Tensor::full(DType::F64, vec![4], 10.0));
    let y = case.op(Op::Binary(BinaryOp::Mod), vec![ten, x]);
    let all = vec![0];
    let loss = case.op(Op::Reduce { op: ReduceOp::Sum, axes: all, keep_dims: false }, vec![y]);
    case.graph.add_output("loss", loss);
    let err = Autodiff::new("loss").run(&mut case.graph).unwrap_err();
    assert!(err.to_string().contains("mod has no gradient rule"), "{err}");
    let err = Autodiff::new("nope").run(&mut case.graph).unwrap_err();
    assert!(err.to_string().contains("the graph has no output named 'nope'"), "{err}");
}
