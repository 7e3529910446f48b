//! `peephole`: small algebraic rewrites by equality saturation (the `egg` crate).
//! Input: any verified graph. Output: the same computation with fewer data-movement and
//! identity ops. Runs on the imported model (before `autodiff`, so the backward inherits the
//! savings), and, with the GEMM rule alone, inside `fusion`. Tests: tests/golden/peephole_*.ir.
//!
//! The transposes, reshapes, multiplications, additions and matmuls of the graph go into one
//! e-graph (every other value is a leaf), the rules run to saturation under node, iteration and
//! time limits, and each value takes its cheapest equal form (every op costs 1). The rules:
//!
//! - `transpose(transpose(x, p), q) = transpose(x, p∘q)`; a transpose by the identity is `x`;
//! - `reshape(reshape(x, s), t) = reshape(x, t)`; a reshape to `x`'s own shape is `x`;
//! - `x * 1 = 1 * x = x` and `x + 0 = 0 + x = x` for a constant whose every element is 1 (0)
//!   and that does not broadcast `x` larger (`x + 0` differs from `x` in the sign of a zero
//!   alone: `-0 + 0 = +0`);
//! - ([`Rules::Gemm`]) a matmul reading a transpose of its operand's last two dims reads the
//!   operand with its transpose flag instead (the GEMM takes the strides; nothing is copied),
//!   for operands held whole on every rank, where the flag and the transpose place values alike;
//!   a transpose of a matmul's last two dims is the product of the operands swapped, flags
//!   flipped (`(AB)^T = B^T A^T`: a weight gradient made in the layout of its weight), unless
//!   a mesh axis shards one of those two dims.
//!
//! No rule reorders or reassociates, so the e-graph stays small; rewritten values keep the
//! type, name and placements of the value they replace, and nodes nothing reads any more go.

use std::collections::HashMap;
use std::time::Duration;

use autotp_ir::{BinaryOp, Def, Graph, Op, Placement, Rewriter, TensorType, ValueId};
use egg::{define_language, rewrite as rw, Analysis, DidMerge, EGraph, Id, Language, Rewrite, Runner, Subst, Symbol};

use crate::{Pass, PassError};

define_language! {
    /// The ops the rewrites look at; attributes and other values are symbols.
    enum Peep {
        "transpose" = Transpose([Id; 2]),
        "reshape" = Reshape([Id; 2]),
        "mul" = Mul([Id; 2]),
        "add" = Add([Id; 2]),
        "matmul" = MatMul([Id; 3]),
        Symbol(Symbol),
    }
}

/// Which rules run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rules {
    /// Transposes, reshapes, `x * 1`, `x + 0`.
    Algebraic,
    /// Transposes folded into the matmuls that read them.
    Gemm,
}

pub struct Peephole {
    pub rules: Rules,
}

impl Pass for Peephole {
    fn name(&self) -> &'static str {
        "peephole"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        *graph = rewrite(graph, self.rules);
        Ok(())
    }
}

/// What is known of an e-class: an attribute, or a tensor's shape, whether every rank holds it
/// whole, and the value of every element when they are all one constant.
#[derive(Clone, Debug, PartialEq)]
enum Fact {
    Attribute,
    Tensor { shape: Vec<usize>, whole: bool, splat: Option<f64>, sharded_dims: Vec<usize> },
}

/// The facts of the graph's values (by symbol), for the leaves.
struct Facts {
    leaves: HashMap<Symbol, Fact>,
}

impl Analysis<Peep> for Facts {
    type Data = Option<Fact>;

    fn make(egraph: &mut EGraph<Peep, Self>, enode: &Peep, _id: Id) -> Option<Fact> {
        let shape_of = |id: &Id| match &egraph[*id].data {
            Some(Fact::Tensor { shape, whole, sharded_dims, .. }) => {
                Some((shape.clone(), *whole, sharded_dims.clone()))
            }
            _ => None,
        };
        match enode {
            Peep::Symbol(s) => Some(egraph.analysis.leaves.get(s).cloned().unwrap_or(Fact::Attribute)),
            Peep::Transpose([perm, x]) => {
                let (shape, whole, sharded) = shape_of(x)?;
                let perm = list(egraph, *perm)?;
                Some(Fact::Tensor {
                    shape: perm.iter().map(|&p| shape[p]).collect(),
                    whole,
                    splat: None,
                    sharded_dims: (0..perm.len()).filter(|&k| sharded.contains(&perm[k])).collect(),
                })
            }
            Peep::Reshape([shape, x]) => {
                let (_, whole, sharded) = shape_of(x)?;
                // Where a reshape moves a sharded dim is not followed (no rule needs it).
                if !sharded.is_empty() {
                    return None;
                }
                Some(Fact::Tensor { shape: list(egraph, *shape)?, whole, splat: None, sharded_dims: vec![] })
            }
            // The class of an original value knows its own facts; a new node of these kinds
            // only ever joins such a class (see the rules).
            Peep::Mul(_) | Peep::Add(_) | Peep::MatMul(_) => None,
        }
    }

    fn merge(&mut self, to: &mut Option<Fact>, from: Option<Fact>) -> DidMerge {
        if to.is_none() && from.is_some() {
            *to = from;
            return DidMerge(true, false);
        }
        DidMerge(false, to.is_some() && from.is_none())
    }
}

type PeepGraph = EGraph<Peep, Facts>;

/// The numbers of an attribute symbol `name:1,2,3`.
fn list(egraph: &PeepGraph, id: Id) -> Option<Vec<usize>> {
    egraph[id].nodes.iter().find_map(|n| match n {
        Peep::Symbol(s) => {
            let (_, numbers) = s.as_str().split_once(':')?;
            numbers.split(',').filter(|x| !x.is_empty()).map(|x| x.parse().ok()).collect()
        }
        _ => None,
    })
}

fn attribute(kind: &str, numbers: &[usize]) -> Symbol {
    let numbers: Vec<String> = numbers.iter().map(usize::to_string).collect();
    format!("{kind}:{}", numbers.join(",")).into()
}

fn tensor(egraph: &PeepGraph, id: Id) -> Option<(Vec<usize>, bool, Option<f64>)> {
    match &egraph[id].data {
        Some(Fact::Tensor { shape, whole, splat, .. }) => Some((shape.clone(), *whole, *splat)),
        _ => None,
    }
}

/// Whether no mesh axis shards one of the last two dims of the class's value.
fn last_two_whole(egraph: &PeepGraph, id: Id) -> bool {
    match &egraph[id].data {
        Some(Fact::Tensor { shape, sharded_dims, .. }) => sharded_dims.iter().all(|&d| d + 2 < shape.len()),
        _ => false,
    }
}

/// Whether `perm` swaps the last two dims and keeps the others.
fn swaps_last_two(perm: &[usize]) -> bool {
    let rank = perm.len();
    rank >= 2
        && perm[..rank - 2].iter().enumerate().all(|(i, &p)| i == p)
        && perm[rank - 2] == rank - 1
        && perm[rank - 1] == rank - 2
}

fn var(name: &str) -> egg::Var {
    name.parse().expect("a pattern variable")
}

/// `?p` is the identity permutation.
fn identity(egraph: &mut PeepGraph, _: Id, subst: &Subst) -> bool {
    list(egraph, subst[var("?p")]).is_some_and(|p| p.iter().enumerate().all(|(i, &d)| i == d))
}

/// `?s` is `?x`'s own shape.
fn same_shape(egraph: &mut PeepGraph, _: Id, subst: &Subst) -> bool {
    match (list(egraph, subst[var("?s")]), tensor(egraph, subst[var("?x")])) {
        (Some(s), Some((shape, ..))) => s == shape,
        _ => false,
    }
}

/// `?c` is a constant of `value` everywhere and the result has `?x`'s shape.
fn neutral(value: f64) -> impl Fn(&mut PeepGraph, Id, &Subst) -> bool {
    move |egraph, class, subst| match (tensor(egraph, subst[var("?c")]), tensor(egraph, subst[var("?x")])) {
        (Some((_, _, Some(c))), Some((x, ..))) => c == value && tensor(egraph, class).is_some_and(|(out, ..)| out == x),
        _ => false,
    }
}

/// Adds `node` to `class`: the new e-node when that merged anything.
fn join(egraph: &mut PeepGraph, class: Id, node: Id) -> Vec<Id> {
    if egraph.union(class, node) {
        vec![node]
    } else {
        vec![]
    }
}

/// `transpose(transpose(x, p), q)` as `transpose(x, p∘q)`.
struct ComposeTransposes;

impl egg::Applier<Peep, Facts> for ComposeTransposes {
    fn apply_one(
        &self,
        egraph: &mut PeepGraph,
        class: Id,
        subst: &Subst,
        _: Option<&egg::PatternAst<Peep>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (Some(p), Some(q)) = (list(egraph, subst[var("?p")]), list(egraph, subst[var("?q")])) else {
            return vec![];
        };
        let composed: Vec<usize> = q.iter().map(|&k| p[k]).collect();
        let perm = egraph.add(Peep::Symbol(attribute("perm", &composed)));
        let node = egraph.add(Peep::Transpose([perm, subst[var("?x")]]));
        join(egraph, class, node)
    }
}

/// `matmul(transpose_last_two(a), b)` as a matmul reading `a` with the flag flipped (and the
/// same for the right operand), for operands held whole.
struct FoldTranspose {
    lhs: bool,
}

impl egg::Applier<Peep, Facts> for FoldTranspose {
    fn apply_one(
        &self,
        egraph: &mut PeepGraph,
        class: Id,
        subst: &Subst,
        _: Option<&egg::PatternAst<Peep>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (Some(perm), Some(flags)) = (list(egraph, subst[var("?p")]), list(egraph, subst[var("?f")])) else {
            return vec![];
        };
        let swaps = swaps_last_two(&perm);
        let whole = |id: Id| tensor(egraph, id).is_some_and(|(_, whole, _)| whole);
        let (a, t) = (subst[var("?a")], subst[var("?t")]);
        if !swaps || !whole(a) || !whole(t) || flags.len() != 2 {
            return vec![];
        }
        let mut flipped = flags;
        flipped[usize::from(!self.lhs)] ^= 1;
        let flags = egraph.add(Peep::Symbol(attribute("flags", &flipped)));
        let other = subst[var("?b")];
        let node = egraph.add(Peep::MatMul(if self.lhs { [flags, a, other] } else { [flags, other, a] }));
        join(egraph, class, node)
    }
}

/// `transpose_last_two(matmul(a, b))` as `matmul(b, a)` with both flags flipped and swapped
/// (`(AB)^T = B^T A^T`): the product is written in the order the reader wants, and the
/// transpose goes. Not where a mesh axis shards one of the two dims that trade places.
struct SwapProduct;

impl egg::Applier<Peep, Facts> for SwapProduct {
    fn apply_one(
        &self,
        egraph: &mut PeepGraph,
        class: Id,
        subst: &Subst,
        _: Option<&egg::PatternAst<Peep>>,
        _: Symbol,
    ) -> Vec<Id> {
        let product = subst[var("?m")];
        let swaps = list(egraph, subst[var("?p")]).is_some_and(|p| swaps_last_two(&p));
        if !swaps || !last_two_whole(egraph, product) || !last_two_whole(egraph, class) {
            return vec![];
        }
        let products: Vec<[Id; 3]> = egraph[product]
            .nodes
            .iter()
            .filter_map(|n| match n {
                Peep::MatMul(children) => Some(*children),
                _ => None,
            })
            .collect();
        let mut made = Vec::new();
        for [flags, a, b] in products {
            let Some(f) = list(egraph, flags).filter(|f| f.len() == 2) else { continue };
            let swapped = egraph.add(Peep::Symbol(attribute("flags", &[1 - f[1], 1 - f[0]])));
            let node = egraph.add(Peep::MatMul([swapped, b, a]));
            made.extend(join(egraph, class, node));
        }
        made
    }
}

fn rules(which: Rules) -> Vec<Rewrite<Peep, Facts>> {
    match which {
        Rules::Algebraic => vec![
            rw!("transpose-transpose"; "(transpose ?q (transpose ?p ?x))" => { ComposeTransposes }),
            rw!("transpose-identity"; "(transpose ?p ?x)" => "?x" if identity),
            rw!("reshape-reshape"; "(reshape ?t (reshape ?s ?x))" => "(reshape ?t ?x)"),
            rw!("reshape-identity"; "(reshape ?s ?x)" => "?x" if same_shape),
            rw!("mul-one"; "(mul ?x ?c)" => "?x" if neutral(1.0)),
            rw!("one-mul"; "(mul ?c ?x)" => "?x" if neutral(1.0)),
            rw!("add-zero"; "(add ?x ?c)" => "?x" if neutral(0.0)),
            rw!("zero-add"; "(add ?c ?x)" => "?x" if neutral(0.0)),
        ],
        Rules::Gemm => vec![
            rw!("matmul-transposed-lhs"; "(matmul ?f ?t ?b)" => { Matched { inner: FoldTranspose { lhs: true } } }),
            rw!("matmul-transposed-rhs"; "(matmul ?f ?b ?t)" => { Matched { inner: FoldTranspose { lhs: false } } }),
            rw!("transpose-of-matmul"; "(transpose ?p ?m)" => { SwapProduct }),
        ],
    }
}

/// Binds `?t`'s transpose (`?p`, `?a`) when the e-class `?t` holds one, then applies `inner`.
struct Matched<A> {
    inner: A,
}

impl<A: egg::Applier<Peep, Facts>> egg::Applier<Peep, Facts> for Matched<A> {
    fn apply_one(
        &self,
        egraph: &mut PeepGraph,
        class: Id,
        subst: &Subst,
        ast: Option<&egg::PatternAst<Peep>>,
        rule: Symbol,
    ) -> Vec<Id> {
        let t = subst[var("?t")];
        let transposes: Vec<[Id; 2]> = egraph[t]
            .nodes
            .iter()
            .filter_map(|n| match n {
                Peep::Transpose(children) => Some(*children),
                _ => None,
            })
            .collect();
        let mut made = Vec::new();
        for [p, a] in transposes {
            let mut bound = subst.clone();
            bound.insert(var("?p"), p);
            bound.insert(var("?a"), a);
            made.extend(self.inner.apply_one(egraph, class, &bound, ast, rule));
        }
        made
    }
}

fn value_symbol(v: ValueId) -> Symbol {
    format!("%{}", v.index()).into()
}

/// The e-graph node of `op` on these child classes, if the rewrites look at `op`.
fn enode(egraph: &mut PeepGraph, op: &Op, inputs: &[Id]) -> Option<Peep> {
    Some(match op {
        Op::Transpose { perm } => Peep::Transpose([egraph.add(Peep::Symbol(attribute("perm", perm))), inputs[0]]),
        Op::Reshape { shape } => Peep::Reshape([egraph.add(Peep::Symbol(attribute("shape", shape))), inputs[0]]),
        Op::Binary(BinaryOp::Mul) => Peep::Mul([inputs[0], inputs[1]]),
        Op::Binary(BinaryOp::Add) => Peep::Add([inputs[0], inputs[1]]),
        Op::MatMul { transpose_lhs, transpose_rhs } => {
            let flags = attribute("flags", &[usize::from(*transpose_lhs), usize::from(*transpose_rhs)]);
            Peep::MatMul([egraph.add(Peep::Symbol(flags)), inputs[0], inputs[1]])
        }
        _ => return None,
    })
}

/// The op of an extracted e-graph node (its attributes read from their classes).
fn op_of(egraph: &PeepGraph, node: &Peep) -> Option<Op> {
    Some(match node {
        Peep::Transpose([perm, _]) => Op::Transpose { perm: list(egraph, *perm)? },
        Peep::Reshape([shape, _]) => Op::Reshape { shape: list(egraph, *shape)? },
        Peep::Mul(_) => Op::Binary(BinaryOp::Mul),
        Peep::Add(_) => Op::Binary(BinaryOp::Add),
        Peep::MatMul([flags, _, _]) => {
            let flags = list(egraph, *flags)?;
            Op::MatMul { transpose_lhs: flags[0] == 1, transpose_rhs: flags[1] == 1 }
        }
        Peep::Symbol(_) => return None,
    })
}

/// `graph` with `which` rules applied.
pub fn rewrite(graph: &Graph, which: Rules) -> Graph {
    let whole = |v: ValueId| graph.value(v).placements.iter().all(|p| *p == Placement::Replicate);
    let mut leaves = HashMap::new();
    for (id, value) in graph.values() {
        let splat = match &value.def {
            Def::Node(n, _) => match &graph.node(*n).op {
                Op::Constant { value } if value.numel() > 0 && value.is_splat() && value.dtype().is_float() => {
                    Some(value.get_f64(0))
                }
                _ => None,
            },
            _ => None,
        };
        let sharded_dims = value
            .placements
            .iter()
            .filter_map(|p| match p {
                Placement::Shard(d) => Some(*d),
                _ => None,
            })
            .collect();
        leaves.insert(
            value_symbol(id),
            Fact::Tensor { shape: value.ty.shape.clone(), whole: whole(id), splat, sharded_dims },
        );
    }
    let mut egraph = EGraph::new(Facts { leaves });
    // Each value's class: a leaf, or its op's node over its inputs' classes.
    let mut class: Vec<Option<Id>> = vec![None; graph.num_values()];
    let leaf = |egraph: &mut PeepGraph, v: ValueId| egraph.add(Peep::Symbol(value_symbol(v)));
    let mut rewritable = Vec::new();
    for (id, node) in graph.nodes() {
        let inputs: Vec<Id> =
            node.inputs.iter().map(|&v| class[v.index()].unwrap_or_else(|| leaf(&mut egraph, v))).collect();
        if let Some(n) = enode(&mut egraph, &node.op, &inputs) {
            let c = egraph.add(n);
            let out = node.outputs[0];
            egraph[c].data = egraph.analysis.leaves.get(&value_symbol(out)).cloned();
            class[out.index()] = Some(c);
            rewritable.push(id);
        } else {
            for &o in &node.outputs {
                class[o.index()] = Some(leaf(&mut egraph, o));
            }
        }
    }
    egraph.rebuild();
    if rewritable.is_empty() {
        return graph.clone();
    }
    let runner = Runner::<Peep, Facts, ()>::new(Facts { leaves: HashMap::new() })
        .with_egraph(egraph)
        .with_node_limit(20 * graph.num_nodes() + 1_000)
        .with_iter_limit(32)
        .with_time_limit(Duration::from_secs(2))
        .run(&rules(which));
    let egraph = runner.egraph;
    let extractor = egg::Extractor::new(&egraph, Cost);

    let mut rewriter = Rewriter::new(graph, |_| true);
    let mut built: HashMap<Id, ValueId> = HashMap::new();
    let mut original: HashMap<Id, ValueId> = HashMap::new();
    for (v, c) in class.iter().enumerate() {
        if let Some(c) = c {
            original.entry(egraph.find(*c)).or_insert(ValueId(v as u32));
        }
    }
    let is_rewritable: std::collections::HashSet<_> = rewritable.iter().copied().collect();
    for (id, node) in graph.nodes() {
        if !is_rewritable.contains(&id) {
            rewriter.copy_node(id);
            continue;
        }
        let out = node.outputs[0];
        let c = egraph.find(class[out.index()].expect("every value has a class"));
        match build(&egraph, &extractor, c, &original, &mut built, &mut rewriter) {
            Some(new) => rewriter.set(out, new),
            None => rewriter.copy_node(id),
        }
    }
    rewriter.finish().without_dead_code()
}

/// The cheapest form of class `c` in the new graph: an existing value (a leaf mapped already)
/// or a node over such values, typed and placed as the class's original value.
fn build(
    egraph: &PeepGraph,
    extractor: &egg::Extractor<Cost, Peep, Facts>,
    c: Id,
    original: &HashMap<Id, ValueId>,
    built: &mut HashMap<Id, ValueId>,
    rewriter: &mut Rewriter,
) -> Option<ValueId> {
    let c = egraph.find(c);
    if let Some(&v) = built.get(&c) {
        return Some(v);
    }
    let best = extractor.find_best_node(c).clone();
    let value = match &best {
        Peep::Symbol(s) => {
            let index: usize = s.as_str().strip_prefix('%')?.parse().ok()?;
            rewriter.mapped(ValueId(index as u32))?
        }
        node => {
            let op = op_of(egraph, node)?;
            let operands: Vec<Id> = match node {
                Peep::Transpose([_, x]) | Peep::Reshape([_, x]) => vec![*x],
                Peep::Mul([a, b]) | Peep::Add([a, b]) | Peep::MatMul([_, a, b]) => vec![*a, *b],
                Peep::Symbol(_) => unreachable!("handled above"),
            };
            let inputs: Vec<ValueId> = operands
                .into_iter()
                .map(|x| build(egraph, extractor, x, original, built, rewriter))
                .collect::<Option<_>>()?;
            let like = *original.get(&c)?;
            let (ty, name, placements) = {
                let old = rewriter.old().value(like);
                (old.ty.clone(), old.name.clone(), old.placements.clone())
            };
            let new = rewriter.graph().add_node_typed(op, inputs, vec![TensorType::clone(&ty)]);
            let v = rewriter.graph().node(new).outputs[0];
            rewriter.graph().value_mut(v).name = name;
            rewriter.graph().value_mut(v).placements = placements;
            v
        }
    };
    built.insert(c, value);
    Some(value)
}

/// Every op costs 1; values and attributes nothing.
struct Cost;

impl egg::CostFunction<Peep> for Cost {
    type Cost = usize;

    fn cost<C: FnMut(Id) -> usize>(&mut self, enode: &Peep, mut costs: C) -> usize {
        let own = usize::from(!matches!(enode, Peep::Symbol(_)));
        enode.fold(own, |sum, id| sum + costs(id))
    }
}
