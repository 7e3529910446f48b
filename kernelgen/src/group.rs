//! Groups of IR nodes -> one generated kernel ([`autotp_kernels::kir`]): how codegen computes a
//! fusion group, and how the `fusion` pass learns whether a group is legal (a group is legal
//! exactly when [`build`] builds it).
//!
//! A group computes over one iteration space: the shape of its row reductions' input (`[rows,
//! cols]` with the reduced trailing dims as `cols`), or for a purely elementwise group the shape
//! of its results. Every value the group makes is either *full* (the space's shape) or a *row*
//! value (one per row: a reduction's result, or arithmetic on those); an elementwise group may
//! also make a cheap value of a shape that broadcasts into the space (a bf16 weight widened),
//! computed at every element it is read at, never stored. Inputs from outside the
//! group are loaded through their broadcast into the space ([`broadcast_index`]), so a bias
//! `[h]`, a mask `[1, 1, s, s]` or a row statistic `[b, s, 1]` is read in place.
//!
//! Composite ops are written here as the arithmetic they stand for (softmax is a max reduce, a
//! sum reduce of `exp(x - max)` and a division), the same formulas as the builtin kernels,
//! which stay the oracle: `tests/kernels.rs` runs every op both ways.
//!
//! A value is computed in every stage that needs it, so two rules (XLA's) keep fusion from
//! costing more than it saves or changing results: the input of a max reduction (max, softmax,
//! log_softmax) is never computed inside the group (it is loaded), and a value made by an
//! expensive op (exp, log, tanh, erf, sigmoid, gelu, a norm's or softmax's result) is not
//! needed by more than one stage.
//!
//! [`build`] refuses, with a [`Refusal`], anything it does not handle (other dtypes, ops,
//! reductions not over trailing dims, an expensive value broadcast inside the group); codegen
//! then uses the builtin kernel of each node.

use std::collections::HashMap;

use autotp_ir::sharding::local_type;
use autotp_ir::{GeluApprox, Graph, NodeId, Op, ReduceOp, TensorType, ValueId};
use autotp_kernels::kir::{self, Expr, ExprRef, Fold, Index, Stage, Store, Term, Var};
use autotp_kernels::{BinaryOp, DType, UnaryOp};

/// A generated kernel and the values bound to its input buffers (its output buffers are the
/// `outputs` it was built for, in order).
pub struct Built {
    pub kernel: kir::Kernel,
    pub inputs: Vec<ValueId>,
}

/// Why a group is not one generated kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// An op, dtype or layout the kernel builder does not handle.
    Unsupported,
    /// The group's nodes do not share one iteration space.
    Spaces,
    /// A max reduction's input would be computed inside the group.
    MaxProducer,
    /// A value of an expensive op would be computed by more than one stage.
    Recomputed,
    /// More buffers than [`MAX_BUFFERS`].
    Buffers,
}

/// The most buffers one kernel takes. A GPU thread keeps every buffer's address in registers:
/// the bf16 guarded updates of GPT-2 124M's same-shaped parameters, fused into kernels of 109
/// buffers, took all 255 registers and spilled up to 1,868 bytes (`ptxas -v`), where kernels of
/// 26 buffers took 128 registers.
pub const MAX_BUFFERS: usize = 32;

/// The kernel computing `outputs` from the group `nodes` (in graph order), or why there is
/// none.
pub fn build(graph: &Graph, nodes: &[NodeId], outputs: &[ValueId]) -> Result<Built, Refusal> {
    let ty = |v: ValueId| local_type(&graph.mesh, graph.ty(v), &graph.value(v).placements);
    let space = Space::of(graph, nodes, &ty)?;
    for &n in nodes {
        let node = graph.node(n);
        let max_reduction =
            matches!(node.op, Op::Reduce { op: ReduceOp::Max, .. } | Op::Softmax { .. } | Op::LogSoftmax { .. });
        // A cast of a loaded value is a load (it widens, or rounds, as it reads): the one
        // producer a max reduction's input may have in the group.
        let loaded_cast = |m: NodeId| {
            let producer = graph.node(m);
            matches!(producer.op, Op::Cast { .. })
                && !nodes.iter().any(|&k| graph.node(k).outputs.contains(&producer.inputs[0]))
        };
        if max_reduction && nodes.iter().any(|&m| graph.node(m).outputs.contains(&node.inputs[0]) && !loaded_cast(m)) {
            return Err(Refusal::MaxProducer);
        }
    }
    let mut builder = Builder {
        graph,
        ty: &ty,
        space,
        producer: nodes.iter().flat_map(|&n| graph.node(n).outputs.iter().map(move |&v| (v, n))).collect(),
        reductions: HashMap::new(),
        stages: Vec::new(),
        stage_values: Vec::new(),
        inputs: Vec::new(),
        softmax_outputs: HashMap::new(),
    };
    for (o, &v) in outputs.iter().enumerate() {
        let softmax = builder.producer.get(&v).is_some_and(|&n| matches!(graph.node(n).op, Op::Softmax { .. }));
        if softmax && ty(v).dtype == DType::F32 && ty(v).shape == builder.space.shape {
            builder.softmax_outputs.insert(v, o);
        }
    }
    let mut map = StageBuilder::new(false);
    let mut row = StageBuilder::new(true);
    let mut map_stores = Vec::new();
    let mut row_stores = Vec::new();
    let rows = builder.space.outer;
    for (o, &v) in outputs.iter().enumerate() {
        let numel = ty(v).numel();
        if numel == rows * builder.space.inner && ty(v).shape == builder.space.shape {
            let value = builder.value(&mut map, v).ok_or(Refusal::Unsupported)?;
            map_stores.push((o, builder.space.index(&builder.space.shape), value));
        } else if numel == rows {
            let value = builder.value(&mut row, v).ok_or(Refusal::Unsupported)?;
            row_stores.push((o, Index::linear(Var::Outer, 1), value));
        } else {
            return Err(Refusal::Unsupported);
        }
    }
    let num_inputs = builder.inputs.len();
    let store = |list: Vec<(usize, Index, ExprRef)>| -> Vec<Store> {
        list.into_iter().map(|(o, index, value)| Store { buffer: num_inputs + o, index, value }).collect()
    };
    builder.stage_values.push(row.memo.keys().copied().collect());
    builder.stage_values.push(map.memo.keys().copied().collect());
    let mut stages_needing: HashMap<ValueId, usize> = HashMap::new();
    for v in builder.stage_values.iter().flatten() {
        *stages_needing.entry(*v).or_default() += 1;
    }
    let expensive = |v: &ValueId| builder.producer.get(v).is_some_and(|&n| is_expensive(&graph.node(n).op));
    if stages_needing.iter().any(|(v, &count)| count > 1 && expensive(v)) {
        return Err(Refusal::Recomputed);
    }
    if !row_stores.is_empty() {
        builder.stages.push(Stage::Row { exprs: row.exprs, stores: store(row_stores) });
    }
    if !map_stores.is_empty() {
        builder.stages.push(Stage::Map { exprs: map.exprs, stores: store(map_stores) });
    }
    for stage in &mut builder.stages {
        renumber_outputs(stage, num_inputs);
    }
    if builder.inputs.len() + outputs.len() > MAX_BUFFERS {
        return Err(Refusal::Buffers);
    }
    let mut buffers: Vec<kir::Buffer> =
        builder.inputs.iter().map(|&v| kir::Buffer { dtype: ty(v).dtype, len: ty(v).numel() }).collect();
    buffers.extend(outputs.iter().map(|&v| kir::Buffer { dtype: ty(v).dtype, len: ty(v).numel() }));
    let mut ops: Vec<String> = Vec::new();
    for &n in nodes {
        let op = graph.node(n).op.name();
        if !ops.contains(&op) {
            ops.push(op);
        }
    }
    let name = match ops.len() {
        0..=3 => ops.join("+"),
        more => format!("{}+{}", ops[..3].join("+"), more - 3),
    };
    let kernel = kir::Kernel {
        name,
        buffers,
        num_inputs,
        outer: builder.space.outer,
        inner: builder.space.inner,
        stages: builder.stages,
    };
    kernel.check().map_err(|_| Refusal::Unsupported)?;
    Ok(Built { kernel, inputs: builder.inputs })
}

/// The kernel of `nodes` as [`build`], or `None` when the nodes are not one kernel.
pub fn try_build(graph: &Graph, nodes: &[NodeId], outputs: &[ValueId]) -> Option<Built> {
    build(graph, nodes, outputs).ok()
}

/// Ops whose results cost more to recompute than to load.
fn is_expensive(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(UnaryOp::Exp | UnaryOp::Log | UnaryOp::Tanh | UnaryOp::Erf | UnaryOp::Sigmoid | UnaryOp::Softplus)
            | Op::Gelu { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
    )
}

/// The iteration space: the group's full values' `shape`, its dims taken in the order `perm`
/// (identity but for reductions over leading dims, whose kept dims come first), the first
/// `split` of them on the outer variable and the rest on the inner one.
struct Space {
    shape: Vec<usize>,
    perm: Vec<usize>,
    split: usize,
    outer: usize,
    inner: usize,
}

impl Space {
    /// The index of a value of shape `input` broadcast into the space's full shape.
    fn index(&self, input: &[usize]) -> Index {
        self.index_with_strides(&autotp_kernels::shape::broadcast_strides(input, &self.shape))
    }

    /// The index of a value laid out with these strides along the full shape's dims.
    fn index_with_strides(&self, strides: &[usize]) -> Index {
        let sizes: Vec<usize> = self.perm.iter().map(|&d| self.shape[d]).collect();
        let strides: Vec<usize> = self.perm.iter().map(|&d| strides[d]).collect();
        strided_index(&sizes, &strides, self.split)
    }
}

/// How a node iterates: `Some((perm, split))` for a reduction (the reduced dims last, on the
/// inner variable), `None` for an elementwise node; `Err` for a node no kernel here computes.
#[allow(clippy::type_complexity)]
fn node_layout(op: &Op, input: &TensorType) -> Result<Option<(Vec<usize>, usize)>, Refusal> {
    let rank = input.shape.len();
    let trailing = |from: usize| Some(((0..rank).collect::<Vec<_>>(), from));
    let layout = match op {
        Op::Unary(op) if !matches!(op, UnaryOp::Sin | UnaryOp::Cos) => None,
        Op::Binary(
            BinaryOp::Add
            | BinaryOp::Sub
            | BinaryOp::Mul
            | BinaryOp::Div
            | BinaryOp::Max
            | BinaryOp::Min
            | BinaryOp::Equal
            | BinaryOp::Less
            | BinaryOp::LessEqual
            | BinaryOp::Greater
            | BinaryOp::GreaterEqual,
        ) => None,
        Op::Select | Op::Cast { .. } | Op::Gelu { .. } | Op::Transpose { .. } => None,
        Op::Slice { steps, .. } if steps.iter().all(|&s| s > 0) => None,
        Op::Pad { .. } | Op::GatherElements { .. } => None,
        Op::Reduce { op: ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Max, axes, .. } => {
            let first = *axes.first().ok_or(Refusal::Unsupported)?;
            let last = *axes.last().ok_or(Refusal::Unsupported)?;
            if axes.iter().copied().eq(first..rank) {
                trailing(first)
            } else {
                // Over leading dims (a bias gradient), middle ones (grouped-query attention's
                // key and value gradients, summed over the heads sharing them) or several
                // apart (gpt-oss's sink logits, summed over the batch and the queries): the
                // kept dims, in order, are the rows.
                if last >= rank || axes.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(Refusal::Unsupported);
                }
                let perm: Vec<usize> = (0..rank).filter(|d| !axes.contains(d)).chain(axes.iter().copied()).collect();
                Some((perm, rank - axes.len()))
            }
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } if *axis + 1 == rank => trailing(*axis),
        Op::LayerNorm { axis, .. } | Op::RmsNorm { axis, .. } => trailing(*axis),
        _ => return Err(Refusal::Unsupported),
    };
    Ok(layout)
}

impl Space {
    fn of(graph: &Graph, nodes: &[NodeId], ty: &dyn Fn(ValueId) -> TensorType) -> Result<Space, Refusal> {
        let mut reduced: Option<(Vec<usize>, Vec<usize>, usize)> = None;
        for &n in nodes {
            let node = graph.node(n);
            let input = ty(*node.inputs.first().ok_or(Refusal::Unsupported)?);
            if let Some((perm, split)) = node_layout(&node.op, &input)? {
                match &reduced {
                    None => reduced = Some((input.shape.clone(), perm, split)),
                    Some(layout) if *layout == (input.shape.clone(), perm, split) => {}
                    Some(_) => return Err(Refusal::Spaces),
                }
            }
        }
        let (shape, perm, split) = match reduced {
            Some(found) => found,
            None => {
                // Elementwise: the space is the results' shape. A cheap value of a shape that
                // broadcasts into it (a bf16 weight widened for the kernel reading it) is
                // computed where it is read, at the broadcast index of its inputs.
                let last = graph.node(*nodes.last().ok_or(Refusal::Unsupported)?).outputs[0];
                let shape = ty(last).shape;
                for &n in nodes {
                    let node = graph.node(n);
                    let fits = |o: &ValueId| {
                        let own = ty(*o).shape;
                        own == shape
                            || (!is_expensive(&node.op)
                                && own.len() <= shape.len()
                                && autotp_kernels::shape::broadcast_shapes(&own, &shape).as_ref() == Some(&shape))
                    };
                    if !node.outputs.iter().all(fits) {
                        return Err(Refusal::Spaces);
                    }
                }
                let split = Self::elementwise_split(graph, nodes, &shape, ty);
                (shape.clone(), (0..shape.len()).collect(), split)
            }
        };
        let sizes = |dims: &[usize]| dims.iter().map(|&d| shape[d]).product::<usize>();
        let (outer, inner) = (sizes(&perm[..split]), sizes(&perm[split..]));
        if outer == 0 || inner == 0 {
            return Err(Refusal::Unsupported);
        }
        Ok(Space { shape, perm, split, outer, inner })
    }

    /// Where an elementwise space splits into outer and inner: the trailing dims, widened while
    /// rows are short and every input is either whole or broadcast across the dims taken in.
    fn elementwise_split(
        graph: &Graph,
        nodes: &[NodeId],
        shape: &[usize],
        ty: &dyn Fn(ValueId) -> TensorType,
    ) -> usize {
        let rank = shape.len();
        if rank == 0 {
            return 0;
        }
        let inputs: Vec<Vec<bool>> = nodes
            .iter()
            .flat_map(|&n| graph.node(n).inputs.iter())
            .map(|&v| {
                let s = ty(v).shape;
                // Whether the input has dim d of the space (not broadcast along it).
                (0..rank).map(|d| d + s.len() >= rank && s[d + s.len() - rank] == shape[d] && shape[d] != 1).collect()
            })
            .collect();
        let mut split = rank - 1;
        while split > 0
            && shape[split..].iter().product::<usize>() < 4096
            && inputs.iter().all(|has| has[split - 1] == has[split] || shape[split - 1] == 1 || shape[split] == 1)
        {
            split -= 1;
        }
        split
    }
}

/// `stage` with its [`OUTPUT_BUFFER`] numbers made the outputs' numbers after `num_inputs`
/// inputs.
fn renumber_outputs(stage: &mut Stage, num_inputs: usize) {
    let renumber = |buffer: &mut usize| {
        if *buffer >= OUTPUT_BUFFER {
            *buffer = num_inputs + (*buffer - OUTPUT_BUFFER);
        }
    };
    let (exprs, stores) = match stage {
        Stage::Reduce { exprs, .. } => (exprs, None),
        Stage::Map { exprs, stores } | Stage::Row { exprs, stores } => (exprs, Some(stores)),
    };
    for expr in exprs {
        if let Expr::Load { buffer, .. } = expr {
            renumber(buffer);
        }
    }
    for store in stores.into_iter().flatten() {
        renumber(&mut store.buffer);
    }
}

/// The index of an input of shape `input` broadcast into `space` (row-major, right-aligned).
pub fn broadcast_index(input: &[usize], space: &[usize], split: usize) -> Index {
    strided_index(space, &autotp_kernels::shape::broadcast_strides(input, space), split)
}

/// The index that walks dims of these `sizes` with these element `strides` (0: broadcast), the
/// first `split` dims on the outer variable, the rest on the inner one, row-major: one term
/// `((var / div) % size) * stride` per dim. Codegen simplifies it ([`crate::index_rewrite`]:
/// size-1 and broadcast dims vanish, contiguous dims merge, the outermost modulo goes).
pub fn strided_index(sizes: &[usize], strides: &[usize], split: usize) -> Index {
    let mut terms: Vec<Term> = Vec::new();
    for (var, dims) in [(Var::Outer, 0..split), (Var::Inner, split..sizes.len())] {
        // From the innermost dim outwards: `div` is the product of the dims inside.
        let mut div = 1;
        for d in dims.rev() {
            terms.push(Term::new(var, div, Some(sizes[d]), strides[d]));
            div *= sizes[d];
        }
    }
    Index { base: 0, terms }
}

/// The expressions of one stage, with each value emitted once.
struct StageBuilder {
    exprs: Vec<Expr>,
    memo: HashMap<ValueId, ExprRef>,
    row: bool,
}

impl StageBuilder {
    fn new(row: bool) -> StageBuilder {
        StageBuilder { exprs: Vec::new(), memo: HashMap::new(), row }
    }

    fn push(&mut self, expr: Expr) -> ExprRef {
        if let Some(at) = self.exprs.iter().position(|e| *e == expr) {
            return at as ExprRef;
        }
        self.exprs.push(expr);
        (self.exprs.len() - 1) as ExprRef
    }

    fn f32(&mut self, x: f32) -> ExprRef {
        self.push(Expr::F32(x))
    }

    fn unary(&mut self, op: UnaryOp, a: ExprRef) -> ExprRef {
        self.push(Expr::Unary(op, a))
    }

    fn binary(&mut self, op: BinaryOp, a: ExprRef, b: ExprRef) -> ExprRef {
        self.push(Expr::Binary(op, a, b))
    }

    /// `gelu(x) = x/2 (1 + erf(x/sqrt 2))`, or with `tanh(sqrt(2/pi) (x + 0.044715 x^3))` for
    /// the tanh approximation.
    fn gelu(&mut self, x: ExprRef, approx: GeluApprox) -> ExprRef {
        let half = self.f32(0.5);
        let one = self.f32(1.0);
        let inner = match approx {
            GeluApprox::None => {
                let c = self.f32(std::f32::consts::FRAC_1_SQRT_2);
                let scaled = self.binary(BinaryOp::Mul, x, c);
                self.unary(UnaryOp::Erf, scaled)
            }
            // 0.5 * x * (1 + tanh(u)) is x * sigmoid(2u): one exponential and one division,
            // where tanh takes a polynomial besides, and no cancellation where tanh(u) is near -1.
            GeluApprox::Tanh => {
                let c = self.f32((8.0 / std::f64::consts::PI).sqrt() as f32);
                let a = self.f32(0.044715);
                let ax = self.binary(BinaryOp::Mul, a, x);
                let axx = self.binary(BinaryOp::Mul, ax, x);
                let axxx = self.binary(BinaryOp::Mul, axx, x);
                let sum = self.binary(BinaryOp::Add, x, axxx);
                let scaled = self.binary(BinaryOp::Mul, c, sum);
                let gate = self.unary(UnaryOp::Sigmoid, scaled);
                return self.binary(BinaryOp::Mul, x, gate);
            }
        };
        let hx = self.binary(BinaryOp::Mul, half, x);
        let one_plus = self.binary(BinaryOp::Add, one, inner);
        self.binary(BinaryOp::Mul, hx, one_plus)
    }
}

struct Builder<'g> {
    graph: &'g Graph,
    ty: &'g dyn Fn(ValueId) -> TensorType,
    space: Space,
    /// The group's node making each of its values.
    producer: HashMap<ValueId, NodeId>,
    /// Accumulators already made, by node and which of its reductions.
    reductions: HashMap<(NodeId, u8), usize>,
    stages: Vec<Stage>,
    /// The group's values each finished stage computes.
    stage_values: Vec<Vec<ValueId>>,
    inputs: Vec<ValueId>,
    /// Softmax results that are f32 outputs of the whole space, by value: their output's
    /// position. Such a softmax keeps its exponentials in the output ([`Builder::softmax`]).
    softmax_outputs: HashMap<ValueId, usize>,
}

/// The buffer number that stands for output `o` while the inputs are still being found
/// ([`Builder::output_buffer`]); `build` renumbers it `inputs + o`.
const OUTPUT_BUFFER: usize = usize::MAX / 2;

impl Builder<'_> {
    fn load(&mut self, stage: &mut StageBuilder, v: ValueId) -> Option<ExprRef> {
        let ty = (self.ty)(v);
        kir::scalar_type(ty.dtype)?;
        if ty.shape.len() > self.space.shape.len()
            || autotp_kernels::shape::broadcast_shapes(&ty.shape, &self.space.shape).as_ref() != Some(&self.space.shape)
        {
            return None;
        }
        let index = self.space.index(&ty.shape);
        if stage.row && index.uses(Var::Inner) {
            return None;
        }
        let buffer = self.buffer(v);
        Some(stage.push(Expr::Load { buffer, index }))
    }

    /// The buffer of output `o`, as a stage reads it back (see [`OUTPUT_BUFFER`]).
    fn output_buffer(&self, o: usize) -> usize {
        OUTPUT_BUFFER + o
    }

    /// The input buffer holding `v`, added if new.
    fn buffer(&mut self, v: ValueId) -> usize {
        match self.inputs.iter().position(|&i| i == v) {
            Some(b) => b,
            None => {
                self.inputs.push(v);
                self.inputs.len() - 1
            }
        }
    }

    /// The accumulator of `fold` over `value` for reduction `which` of `node`, made once.
    fn reduction(
        &mut self,
        node: NodeId,
        which: u8,
        fold: Fold,
        value: impl FnOnce(&mut Self, &mut StageBuilder) -> Option<ExprRef>,
    ) -> Option<usize> {
        if let Some(&k) = self.reductions.get(&(node, which)) {
            return Some(k);
        }
        let mut stage = StageBuilder::new(false);
        let value = value(self, &mut stage)?;
        self.stage_values.push(stage.memo.keys().copied().collect());
        self.stages.push(Stage::Reduce { fold, exprs: stage.exprs, value });
        let k = self.stages.iter().filter(|s| matches!(s, Stage::Reduce { .. })).count() - 1;
        self.reductions.insert((node, which), k);
        Some(k)
    }

    fn value(&mut self, stage: &mut StageBuilder, v: ValueId) -> Option<ExprRef> {
        if let Some(&e) = stage.memo.get(&v) {
            return Some(e);
        }
        let Some(&n) = self.producer.get(&v) else {
            let e = self.load(stage, v)?;
            stage.memo.insert(v, e);
            return Some(e);
        };
        let node = self.graph.node(n);
        let input = |i: usize| node.inputs[i];
        let float = |v: ValueId| matches!((self.ty)(v).dtype, DType::F32 | DType::BF16 | DType::F16);
        let cols = self.space.inner as f32;
        let e = match &node.op {
            Op::Unary(op) if float(v) => {
                let x = self.value(stage, input(0))?;
                stage.unary(*op, x)
            }
            // The overflow test's `not finite`, so that it stays on the device.
            Op::Unary(UnaryOp::Not) if (self.ty)(v).dtype == DType::Bool => {
                let x = self.value(stage, input(0))?;
                stage.unary(UnaryOp::Not, x)
            }
            Op::Binary(op) if float(input(0)) || (op.is_comparison() && (self.ty)(input(0)).dtype == DType::I64) => {
                let a = self.value(stage, input(0))?;
                let b = self.value(stage, input(1))?;
                stage.binary(*op, a, b)
            }
            // Index arithmetic (wrapping negative indices, as ScatterElements' import does).
            Op::Binary(op @ (BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Max | BinaryOp::Min))
                if (self.ty)(input(0)).dtype == DType::I64 =>
            {
                let a = self.value(stage, input(0))?;
                let b = self.value(stage, input(1))?;
                stage.binary(*op, a, b)
            }
            Op::Select if float(v) || (self.ty)(v).dtype == DType::I64 => {
                let c = self.value(stage, input(0))?;
                let a = self.value(stage, input(1))?;
                let b = self.value(stage, input(2))?;
                stage.push(Expr::Select(c, a, b))
            }
            // To a 16-bit type, rounded below like every op with a 16-bit result.
            Op::Cast { to: DType::F32 | DType::BF16 | DType::F16 } => {
                let x = self.value(stage, input(0))?;
                match (self.ty)(input(0)).dtype {
                    DType::F32 | DType::BF16 | DType::F16 => x,
                    DType::Bool | DType::I64 => stage.push(Expr::ToF32(x)),
                    _ => return None,
                }
            }
            // To bool: not equal to zero (a mask computed in floats, as DeepSeek-V3's groups).
            Op::Cast { to: DType::Bool } if float(input(0)) => {
                let x = self.value(stage, input(0))?;
                let zero = stage.f32(0.0);
                let is_zero = stage.binary(BinaryOp::Equal, x, zero);
                stage.unary(UnaryOp::Not, is_zero)
            }
            // A transpose reads its input (from memory, not the group) with permuted strides.
            Op::Transpose { perm } if !self.producer.contains_key(&input(0)) => {
                self.transposed_read(stage, input(0), v, perm)?
            }
            // A slice reads its input (from memory) from its start with its steps.
            Op::Slice { starts, steps, .. } if !self.producer.contains_key(&input(0)) => {
                self.sliced_read(stage, input(0), v, starts, steps)?
            }
            Op::Pad { begin, value, .. } if !self.producer.contains_key(&input(0)) => {
                self.pad(stage, input(0), v, begin, *value)?
            }
            // Elements of each row of `data` (in memory) chosen by the indices (a router's
            // weights of its chosen experts).
            Op::GatherElements { axis } if float(v) && *axis + 1 == (self.ty)(v).rank() => {
                if self.producer.contains_key(&input(0)) {
                    return None;
                }
                self.picked(stage, input(0), input(1), v)?
            }
            Op::Gelu { approx } if float(v) => {
                let x = self.value(stage, input(0))?;
                stage.gelu(x, *approx)
            }
            Op::Reduce { op, .. } if float(v) => {
                let x = input(0);
                let fold = if *op == ReduceOp::Max { Fold::Max } else { Fold::Sum };
                let k = self.reduction(n, 0, fold, |b, s| b.value(s, x))?;
                let acc = stage.push(Expr::Acc(k));
                if *op == ReduceOp::Mean {
                    let c = stage.f32(cols);
                    stage.binary(BinaryOp::Div, acc, c)
                } else {
                    acc
                }
            }
            Op::Softmax { .. } | Op::LogSoftmax { .. } if float(v) => {
                let log = matches!(node.op, Op::LogSoftmax { .. });
                self.softmax(stage, n, input(0), log)?
            }
            Op::LayerNorm { eps, .. } if float(v) => self.layer_norm(stage, n, *eps)?,
            Op::RmsNorm { eps, .. } if float(v) => {
                let x = input(0);
                let squares = self.reduction(n, 0, Fold::Sum, |b, s| {
                    let x = b.value(s, x)?;
                    Some(s.binary(BinaryOp::Mul, x, x))
                })?;
                let xv = self.value(stage, x)?;
                let inv = self.inverse_root(stage, squares, *eps);
                let normal = stage.binary(BinaryOp::Mul, xv, inv);
                let scale = self.value(stage, input(1))?;
                stage.binary(BinaryOp::Mul, normal, scale)
            }
            _ => return None,
        };
        // An op with a 16-bit result rounds it (reads of 16-bit memory are exact already).
        let reads = matches!(
            node.op,
            Op::Transpose { .. } | Op::Slice { .. } | Op::Pad { .. } | Op::Select | Op::GatherElements { .. }
        );
        let e = match (self.ty)(v).dtype {
            dtype @ (DType::BF16 | DType::F16) if !reads => stage.push(Expr::Round(dtype, e)),
            _ => e,
        };
        stage.memo.insert(v, e);
        Some(e)
    }

    /// `v`, the transpose by `perm` of `x` in memory: `x` read with permuted strides.
    fn transposed_read(&mut self, stage: &mut StageBuilder, x: ValueId, v: ValueId, perm: &[usize]) -> Option<ExprRef> {
        let ty = (self.ty)(x);
        kir::scalar_type(ty.dtype)?;
        let own = autotp_kernels::shape::strides(&ty.shape);
        let strides: Vec<usize> = perm.iter().map(|&p| own[p]).collect();
        if strides.len() != self.space.shape.len() || (self.ty)(v).shape != self.space.shape {
            return None;
        }
        let index = self.space.index_with_strides(&strides);
        if stage.row && index.uses(Var::Inner) {
            return None;
        }
        let buffer = self.buffer(x);
        Some(stage.push(Expr::Load { buffer, index }))
    }

    /// `v`, a slice of `x` in memory: `x` read from `starts` with its strides times `steps`.
    fn sliced_read(
        &mut self,
        stage: &mut StageBuilder,
        x: ValueId,
        v: ValueId,
        starts: &[usize],
        steps: &[i64],
    ) -> Option<ExprRef> {
        let ty = (self.ty)(x);
        kir::scalar_type(ty.dtype)?;
        if (self.ty)(v).shape != self.space.shape {
            return None;
        }
        let own = autotp_kernels::shape::strides(&ty.shape);
        let strides: Vec<usize> = own.iter().zip(steps).map(|(&s, &step)| s * step as usize).collect();
        let mut index = self.space.index_with_strides(&strides);
        index.base = starts.iter().zip(&own).map(|(&start, &s)| start * s).sum();
        if stage.row && index.uses(Var::Inner) {
            return None;
        }
        let buffer = self.buffer(x);
        Some(stage.push(Expr::Load { buffer, index }))
    }

    /// `v`, the elements of the last dim of `data` (in memory) at `indices` (negative ones
    /// counting from the end): a pick from each element's row of `data`; an index outside the
    /// row gives NaN (the builtin kernel's error).
    fn picked(&mut self, stage: &mut StageBuilder, data: ValueId, indices: ValueId, v: ValueId) -> Option<ExprRef> {
        let ty = (self.ty)(data);
        kir::scalar_type(ty.dtype)?;
        if (self.ty)(v).shape != self.space.shape || (self.ty)(indices).dtype != DType::I64 {
            return None;
        }
        let width = *ty.shape.last()?;
        let mut strides = autotp_kernels::shape::strides(&ty.shape);
        *strides.last_mut()? = 0;
        let row = self.space.index_with_strides(&strides);
        if stage.row && row.uses(Var::Inner) {
            return None;
        }
        let index = self.value(stage, indices)?;
        let zero = stage.push(Expr::I64(0));
        let size = stage.push(Expr::I64(width as i64));
        let negative = stage.binary(BinaryOp::Less, index, zero);
        let from_end = stage.binary(BinaryOp::Add, index, size);
        let index = stage.push(Expr::Select(negative, from_end, index));
        let below = stage.binary(BinaryOp::Less, index, zero);
        let past = stage.binary(BinaryOp::GreaterEqual, index, size);
        let outside = stage.binary(BinaryOp::Or, below, past);
        let buffer = self.buffer(data);
        let picked = stage.push(Expr::Pick { buffer, index: row, offset: index, bound: width });
        let nan = stage.f32(f32::NAN);
        Some(stage.push(Expr::Select(outside, nan, picked)))
    }

    /// The (log-)softmax node `n` of `x` over the row: a max reduction, a sum of the shifted
    /// exponentials, then each element.
    /// The softmax (or log-softmax) node `n` of `x`: its maximum, the sum of its exponentials,
    /// then each element. A softmax that is an f32 output of the whole space stores its
    /// exponentials in the output in a map stage of their own, which the sum and the last stage
    /// read back, so each is computed once (else twice: for the sum and for the element).
    fn softmax(&mut self, stage: &mut StageBuilder, n: NodeId, x: ValueId, log: bool) -> Option<ExprRef> {
        let max = self.reduction(n, 0, Fold::Max, |b, s| b.value(s, x))?;
        let output = self.graph.node(n).outputs[0];
        if let Some(&o) = self.softmax_outputs.get(&output).filter(|_| !log && !stage.row) {
            let (buffer, index) = (self.output_buffer(o), self.space.index(&self.space.shape));
            let exponential = Expr::Load { buffer, index: index.clone() };
            if !self.reductions.contains_key(&(n, 1)) {
                let mut exponentials = StageBuilder::new(false);
                let xv = self.value(&mut exponentials, x)?;
                let m = exponentials.push(Expr::Acc(max));
                let shifted = exponentials.binary(BinaryOp::Sub, xv, m);
                let value = exponentials.unary(UnaryOp::Exp, shifted);
                self.stage_values.push(exponentials.memo.keys().copied().collect());
                let stores = vec![Store { buffer, index, value }];
                self.stages.push(Stage::Map { exprs: exponentials.exprs, stores });
            }
            let sum = self.reduction(n, 1, Fold::Sum, |_, s| Some(s.push(exponential.clone())))?;
            let e = stage.push(exponential);
            let s = stage.push(Expr::Acc(sum));
            let one = stage.f32(1.0);
            let inv = stage.binary(BinaryOp::Div, one, s);
            return Some(stage.binary(BinaryOp::Mul, e, inv));
        }
        let sum = self.reduction(n, 1, Fold::Sum, |b, s| {
            let x = b.value(s, x)?;
            let m = s.push(Expr::Acc(max));
            let shifted = s.binary(BinaryOp::Sub, x, m);
            Some(s.unary(UnaryOp::Exp, shifted))
        })?;
        let x = self.value(stage, x)?;
        let m = stage.push(Expr::Acc(max));
        let s = stage.push(Expr::Acc(sum));
        let shifted = stage.binary(BinaryOp::Sub, x, m);
        Some(if log {
            let log_sum = stage.unary(UnaryOp::Log, s);
            stage.binary(BinaryOp::Sub, shifted, log_sum)
        } else {
            let e = stage.unary(UnaryOp::Exp, shifted);
            let one = stage.f32(1.0);
            let inv = stage.binary(BinaryOp::Div, one, s);
            stage.binary(BinaryOp::Mul, e, inv)
        })
    }

    /// The layer norm node `n` (inputs x, scale, bias?): a sum for the mean, a sum of the
    /// centred squares, then each element.
    fn layer_norm(&mut self, stage: &mut StageBuilder, n: NodeId, eps: f64) -> Option<ExprRef> {
        let node = self.graph.node(n);
        let (x, scale, bias) = (node.inputs[0], node.inputs[1], node.inputs.get(2).copied());
        let cols = self.space.inner as f32;
        let sum = self.reduction(n, 0, Fold::Sum, |b, s| b.value(s, x))?;
        let mean = |s: &mut StageBuilder| {
            let acc = s.push(Expr::Acc(sum));
            let c = s.f32(cols);
            s.binary(BinaryOp::Div, acc, c)
        };
        let squares = self.reduction(n, 1, Fold::Sum, |b, s| {
            let x = b.value(s, x)?;
            let m = mean(s);
            let d = s.binary(BinaryOp::Sub, x, m);
            Some(s.binary(BinaryOp::Mul, d, d))
        })?;
        let xv = self.value(stage, x)?;
        let m = mean(stage);
        let centered = stage.binary(BinaryOp::Sub, xv, m);
        let inv = self.inverse_root(stage, squares, eps);
        let normal = stage.binary(BinaryOp::Mul, centered, inv);
        let scale = self.value(stage, scale)?;
        let scaled = stage.binary(BinaryOp::Mul, normal, scale);
        Some(match bias {
            Some(bias) => {
                let bias = self.value(stage, bias)?;
                stage.binary(BinaryOp::Add, scaled, bias)
            }
            None => scaled,
        })
    }

    /// `x` padded to `v`'s shape, `begin` elements before each dim: the input read at its
    /// coordinates wrapped into range (so every read is in bounds), selected where the output
    /// coordinate lies inside the input, `value` elsewhere.
    fn pad(
        &mut self,
        stage: &mut StageBuilder,
        x: ValueId,
        v: ValueId,
        begin: &[usize],
        value: f64,
    ) -> Option<ExprRef> {
        let (input, out) = ((self.ty)(x), (self.ty)(v));
        kir::scalar_type(input.dtype)?;
        let identity = self.space.perm.iter().enumerate().all(|(i, &p)| i == p);
        if out.shape != self.space.shape || !identity || input.numel() == 0 {
            return None;
        }
        let rank = out.shape.len();
        let own = autotp_kernels::shape::strides(&input.shape);
        let split = self.space.split;
        let mut terms = Vec::new();
        let mut inside: Option<ExprRef> = None;
        for d in 0..rank {
            let (var, dims) = if d < split { (Var::Outer, d + 1..split) } else { (Var::Inner, d + 1..rank) };
            let div: usize = out.shape[dims].iter().product();
            let first = d == 0 || d == split;
            let modulo = (!first).then_some(out.shape[d]);
            let (size, start) = (input.shape[d], begin[d]);
            let mut term = Term::new(var, div, modulo, own[d]);
            if size != out.shape[d] {
                term.offset = (size - start % size) % size;
                term.wrap = Some(size);
                let coordinate =
                    stage.push(Expr::Coord(Index { base: 0, terms: vec![Term::new(var, div, modulo, 1)] }));
                if stage.row && var == Var::Inner {
                    return None;
                }
                let low = stage.push(Expr::I64(start as i64));
                let high = stage.push(Expr::I64((start + size) as i64));
                let above = stage.binary(BinaryOp::GreaterEqual, coordinate, low);
                let below = stage.binary(BinaryOp::Less, coordinate, high);
                let here = stage.binary(BinaryOp::And, above, below);
                inside = Some(match inside {
                    Some(before) => stage.binary(BinaryOp::And, before, here),
                    None => here,
                });
            }
            if out.shape[d] > 1 {
                terms.push(term);
            }
        }
        let index = Index { base: 0, terms };
        if stage.row && index.uses(Var::Inner) {
            return None;
        }
        let buffer = self.buffer(x);
        let loaded = stage.push(Expr::Load { buffer, index });
        let Some(inside) = inside else { return Some(loaded) };
        let fill = match kir::scalar_type(input.dtype)? {
            kir::ScalarType::F32 => stage.f32(value as f32),
            kir::ScalarType::I64 => stage.push(Expr::I64(value as i64)),
            kir::ScalarType::Bool => return None,
        };
        Some(stage.push(Expr::Select(inside, loaded, fill)))
    }

    /// `1 / sqrt(acc / cols + eps)`: a norm's inverse root mean square.
    fn inverse_root(&self, stage: &mut StageBuilder, acc: usize, eps: f64) -> ExprRef {
        let acc = stage.push(Expr::Acc(acc));
        let c = stage.f32(self.space.inner as f32);
        let mean = stage.binary(BinaryOp::Div, acc, c);
        let eps = stage.f32(eps as f32);
        let shifted = stage.binary(BinaryOp::Add, mean, eps);
        stage.unary(UnaryOp::Rsqrt, shifted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group of elementwise ops reading one input and a parameter each builds up to
    /// [`MAX_BUFFERS`] buffers and is refused beyond.
    #[test]
    fn a_kernel_takes_at_most_max_buffers() {
        let group = |n: usize| {
            let mut text = String::from("graph \"g\" {\n  input %x : f32[4,8]\n");
            for i in 0..n {
                text.push_str(&format!("  param %p{i} : f32[4,8]\n"));
            }
            for i in 0..n {
                text.push_str(&format!("  %{i} = add %x, %p{i} : f32[4,8]\n"));
            }
            for i in 0..n {
                text.push_str(&format!("  output \"y{i}\" = %{i}\n"));
            }
            let graph = autotp_ir::text::parse(&(text + "}\n")).unwrap();
            let nodes: Vec<NodeId> = graph.nodes().map(|(id, _)| id).collect();
            let outputs: Vec<ValueId> = graph.outputs().iter().map(|(_, v)| *v).collect();
            build(&graph, &nodes, &outputs).map(|built| built.kernel.buffers.len())
        };
        let widest = (MAX_BUFFERS - 1) / 2;
        assert_eq!(group(widest), Ok(2 * widest + 1));
        assert_eq!(group(widest + 1), Err(Refusal::Buffers));
    }

    fn offsets(index: &Index, outer: usize, inner: usize) -> Vec<usize> {
        (0..outer).flat_map(|o| (0..inner).map(move |i| (o, i))).map(|(o, i)| index.offset(o, i)).collect()
    }

    /// The offsets numpy broadcasting gives, in the space's row-major order.
    fn expected(input: &[usize], space: &[usize]) -> Vec<usize> {
        let rank = space.len();
        let strides = autotp_kernels::shape::broadcast_strides(input, space);
        let total: usize = space.iter().product();
        (0..total)
            .map(|flat| {
                let mut rest = flat;
                let mut offset = 0;
                for d in (0..rank).rev() {
                    offset += (rest % space[d]) * strides[d];
                    rest /= space[d];
                }
                offset
            })
            .collect()
    }

    #[test]
    fn broadcast_indices_match_numpy_broadcasting() {
        let cases: &[(&[usize], &[usize])] = &[
            (&[2, 3, 4], &[2, 3, 4]),
            (&[4], &[2, 3, 4]),
            (&[3, 1], &[2, 3, 4]),
            (&[2, 1, 4], &[2, 3, 4]),
            (&[1, 1, 5, 5], &[2, 3, 5, 5]),
            (&[2, 3, 1], &[2, 3, 7]),
            (&[], &[2, 3]),
            (&[6], &[6]),
        ];
        for &(input, space) in cases {
            for split in 0..=space.len() {
                let index = broadcast_index(input, space, split);
                let outer: usize = space[..split].iter().product();
                let inner: usize = space[split..].iter().product();
                assert_eq!(
                    offsets(&index, outer, inner),
                    expected(input, space),
                    "{input:?} into {space:?} split {split}"
                );
                let max = expected(input, space).into_iter().max().unwrap_or(0);
                assert_eq!(index.max_offset(outer, inner), max, "{input:?} into {space:?} split {split}");
            }
        }
    }
}
