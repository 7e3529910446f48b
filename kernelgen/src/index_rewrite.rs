//! The index arithmetic of generated kernels, simplified by equality saturation (the `egg`
//! crate). The kernel builder writes every address naively, one term per dimension of the
//! iteration space (`((var / div) % size) * stride`, offsets and wraps where slices and pads
//! need them); [`simplify_kernel`] rewrites each [`Index`] of a finished kernel into the
//! cheapest equal form, counting a division or a modulo as 4 and an addition or a
//! multiplication as 1. The rules hold for the non-negative integers indices are:
//!
//! - constants fold, and a value whose bounds meet is that constant (size-1 dims vanish);
//! - `x % m = x` and `x / d = 0` when `x < m` (resp. `d`), from bounds of the loop variables
//!   (`0 <= outer < kernel.outer`, `0 <= inner < kernel.inner`) carried by an e-class analysis;
//! - `(x / a) / b = x / (a*b)`, `(x % ab) % a = x % a` when `a` divides `ab`;
//! - `x * 1 = x`, `x + 0 = x`, `x * 0 = 0`, `x / 1 = x`;
//! - contiguous dims merge: `((v/d) % m)*s + ((v/(d*m)) % n)*(s*m) = ((v/d) % (m*n))*s`, also when
//!   the outer one has no modulo, and next to the rest of the sum.
//!
//! Sums are built as right-leaning chains in a fixed term order (by variable, then divisor)
//! and the merge rules look at neighbours only, so there is no associativity or commutativity
//! rule to blow the e-graph up; node and time limits bound each run regardless. An index whose
//! best form is not a sum of terms again (never seen) keeps its original form. The rules are
//! built once, and each index's simplest form is remembered for the process (a model's layers,
//! micro-batches and stages repeat the same indices; `autotp plan` compiles hundreds of cuts). Tests: unit
//! tests below (every offset of random indices kept) and tests/golden/index_rewrites.txt.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use autotp_kernels::kir::{Expr, Index, Kernel, Stage, Term, Var};
use egg::{define_language, rewrite as rw, Analysis, DidMerge, EGraph, Id, RecExpr, Rewrite, Runner, Subst, Symbol};

define_language! {
    /// Index expressions over the two loop variables `o` and `i`.
    pub enum IndexExpr {
        "+" = Add([Id; 2]),
        "*" = Mul([Id; 2]),
        "/" = Div([Id; 2]),
        "%" = Mod([Id; 2]),
        Num(i64),
        Symbol(Symbol),
    }
}

/// The bounds of each e-class's values, given the loop variables' extents.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    pub outer: i64,
    pub inner: i64,
}

/// `lo..=hi`: every value of the e-class lies in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    pub lo: i64,
    pub hi: i64,
}

impl Analysis<IndexExpr> for Bounds {
    type Data = Interval;

    fn make(egraph: &mut EGraph<IndexExpr, Self>, enode: &IndexExpr, _id: Id) -> Interval {
        let at = |id: &Id| egraph[*id].data;
        let extent = |n: i64| Interval { lo: 0, hi: (n - 1).max(0) };
        match enode {
            IndexExpr::Num(n) => Interval { lo: *n, hi: *n },
            IndexExpr::Symbol(s) if s.as_str() == "o" => extent(egraph.analysis.outer),
            IndexExpr::Symbol(_) => extent(egraph.analysis.inner),
            IndexExpr::Add([a, b]) => Interval { lo: at(a).lo + at(b).lo, hi: at(a).hi + at(b).hi },
            IndexExpr::Mul([a, b]) => Interval { lo: at(a).lo * at(b).lo, hi: at(a).hi * at(b).hi },
            IndexExpr::Div([a, b]) => match constant(at(b)) {
                Some(d) if d > 0 => Interval { lo: at(a).lo / d, hi: at(a).hi / d },
                _ => Interval { lo: 0, hi: at(a).hi },
            },
            IndexExpr::Mod([a, b]) => match constant(at(b)) {
                Some(m) if m > 0 && at(a).hi < m => at(a),
                Some(m) if m > 0 => Interval { lo: 0, hi: m - 1 },
                _ => Interval { lo: 0, hi: at(a).hi },
            },
        }
    }

    fn merge(&mut self, to: &mut Interval, from: Interval) -> DidMerge {
        // Both are true of every value: keep their intersection.
        let merged = Interval { lo: to.lo.max(from.lo), hi: to.hi.min(from.hi) };
        let changed = DidMerge(merged != *to, merged != from);
        *to = merged;
        changed
    }

    fn modify(egraph: &mut EGraph<IndexExpr, Self>, id: Id) {
        if let Some(n) = constant(egraph[id].data) {
            let folded = egraph.add(IndexExpr::Num(n));
            egraph.union(id, folded);
        }
    }
}

fn constant(interval: Interval) -> Option<i64> {
    (interval.lo == interval.hi).then_some(interval.lo)
}

type IndexGraph = EGraph<IndexExpr, Bounds>;

fn value(egraph: &IndexGraph, subst: &Subst, var: &str) -> Option<i64> {
    constant(egraph[subst[var.parse().expect("a pattern variable")]].data)
}

/// `?x < ?c` for every value.
fn below(x: &'static str, c: &'static str) -> impl Fn(&mut IndexGraph, Id, &Subst) -> bool {
    move |egraph, _, subst| {
        let bound = value(egraph, subst, c);
        bound.is_some_and(|c| egraph[subst[x.parse().expect("a pattern variable")]].data.hi < c)
    }
}

/// `?big` is a multiple of `?small`.
fn divides(small: &'static str, big: &'static str) -> impl Fn(&mut IndexGraph, Id, &Subst) -> bool {
    move |egraph, _, subst| match (value(egraph, subst, small), value(egraph, subst, big)) {
        (Some(a), Some(b)) => a > 0 && b % a == 0,
        _ => false,
    }
}

/// The next term continues the previous one: `?e = ?d*?m` and `?t = ?s*?m`.
fn contiguous(egraph: &mut IndexGraph, _: Id, subst: &Subst) -> bool {
    let get = |v: &str| value(egraph, subst, v);
    match (get("?d"), get("?m"), get("?s"), get("?e"), get("?t")) {
        (Some(d), Some(m), Some(s), Some(e), Some(t)) => e == d * m && t == s * m,
        _ => false,
    }
}

fn rules() -> &'static [Rewrite<IndexExpr, Bounds>] {
    static RULES: OnceLock<Vec<Rewrite<IndexExpr, Bounds>>> = OnceLock::new();
    RULES.get_or_init(built_rules)
}

fn built_rules() -> Vec<Rewrite<IndexExpr, Bounds>> {
    vec![
        rw!("mod-below"; "(% ?x ?c)" => "?x" if below("?x", "?c")),
        rw!("div-div"; "(/ (/ ?x ?a) ?b)" => "(/ ?x (* ?a ?b))"),
        rw!("mod-mod"; "(% (% ?x ?ab) ?a)" => "(% ?x ?a)" if divides("?a", "?ab")),
        rw!("mul-1"; "(* ?x 1)" => "?x"),
        rw!("mul-0"; "(* ?x 0)" => "0"),
        rw!("add-0"; "(+ ?x 0)" => "?x"),
        rw!("zero-add"; "(+ 0 ?x)" => "?x"),
        rw!("div-1"; "(/ ?x 1)" => "?x"),
        rw!("merge";
            "(+ (* (% (/ ?v ?d) ?m) ?s) (* (% (/ ?v ?e) ?n) ?t))" => "(* (% (/ ?v ?d) (* ?m ?n)) ?s)"
            if contiguous),
        rw!("merge-outermost";
            "(+ (* (% (/ ?v ?d) ?m) ?s) (* (/ ?v ?e) ?t))" => "(* (/ ?v ?d) ?s)"
            if contiguous),
        rw!("merge-in-sum";
            "(+ (* (% (/ ?v ?d) ?m) ?s) (+ (* (% (/ ?v ?e) ?n) ?t) ?rest))"
                => "(+ (* (% (/ ?v ?d) (* ?m ?n)) ?s) ?rest)"
            if contiguous),
        rw!("merge-outermost-in-sum";
            "(+ (* (% (/ ?v ?d) ?m) ?s) (+ (* (/ ?v ?e) ?t) ?rest))" => "(+ (* (/ ?v ?d) ?s) ?rest)"
            if contiguous),
    ]
}

/// Divisions and modulos cost 4, additions and multiplications 1, leaves nothing.
struct OpCost;

impl egg::CostFunction<IndexExpr> for OpCost {
    type Cost = usize;

    fn cost<C: FnMut(Id) -> usize>(&mut self, enode: &IndexExpr, mut costs: C) -> usize {
        let own = match enode {
            IndexExpr::Div(_) | IndexExpr::Mod(_) => 4,
            IndexExpr::Add(_) | IndexExpr::Mul(_) => 1,
            IndexExpr::Num(_) | IndexExpr::Symbol(_) => 0,
        };
        egg::Language::fold(enode, own, |sum, id| sum + costs(id))
    }
}

fn var_name(var: Var) -> &'static str {
    match var {
        Var::Outer => "o",
        Var::Inner => "i",
    }
}

/// `index` as an expression: a right-leaning sum of its terms (ordered by variable, then
/// divisor), then the base.
pub fn to_expr(index: &Index) -> RecExpr<IndexExpr> {
    let mut expr = RecExpr::default();
    let mut terms: Vec<&Term> = index.terms.iter().collect();
    terms.sort_by_key(|t| (t.var == Var::Inner, t.div));
    let mut parts: Vec<Id> = Vec::new();
    for t in terms {
        let num = |expr: &mut RecExpr<IndexExpr>, n: usize| expr.add(IndexExpr::Num(n as i64));
        let mut x = expr.add(IndexExpr::Symbol(var_name(t.var).into()));
        let div = num(&mut expr, t.div);
        x = expr.add(IndexExpr::Div([x, div]));
        if let Some(m) = t.modulo {
            let m = num(&mut expr, m);
            x = expr.add(IndexExpr::Mod([x, m]));
        }
        if t.offset != 0 || t.wrap.is_some() {
            let offset = num(&mut expr, t.offset);
            x = expr.add(IndexExpr::Add([x, offset]));
        }
        if let Some(w) = t.wrap {
            let w = num(&mut expr, w);
            x = expr.add(IndexExpr::Mod([x, w]));
        }
        let stride = num(&mut expr, t.stride);
        parts.push(expr.add(IndexExpr::Mul([x, stride])));
    }
    let mut sum = expr.add(IndexExpr::Num(index.base as i64));
    for part in parts.into_iter().rev() {
        sum = expr.add(IndexExpr::Add([part, sum]));
    }
    expr
}

/// The index an expression of the shape [`to_expr`] makes (and its simplifications) stands
/// for, or `None` when it is not a sum of terms.
pub fn from_expr(expr: &RecExpr<IndexExpr>) -> Option<Index> {
    let mut index = Index::default();
    add_terms(expr, Id::from(expr.as_ref().len() - 1), &mut index)?;
    Some(index)
}

fn num(expr: &RecExpr<IndexExpr>, id: Id) -> Option<usize> {
    match expr[id] {
        IndexExpr::Num(n) if n >= 0 => Some(n as usize),
        _ => None,
    }
}

fn add_terms(expr: &RecExpr<IndexExpr>, id: Id, index: &mut Index) -> Option<()> {
    match &expr[id] {
        IndexExpr::Add([a, b]) if num(expr, *b).is_none() || !is_term_body(expr, *a) => {
            add_terms(expr, *a, index)?;
            add_terms(expr, *b, index)
        }
        IndexExpr::Num(n) => {
            index.base += usize::try_from(*n).ok()?;
            Some(())
        }
        IndexExpr::Mul([x, s]) => {
            let stride = num(expr, *s)?;
            index.terms.push(term(expr, *x, stride)?);
            Some(())
        }
        _ => {
            index.terms.push(term(expr, id, 1)?);
            Some(())
        }
    }
}

/// Whether `id` is the body of a term (a variable, possibly divided and reduced), so that
/// `(+ body n)` is a term's offset rather than a sum with a base.
fn is_term_body(expr: &RecExpr<IndexExpr>, id: Id) -> bool {
    matches!(expr[id], IndexExpr::Symbol(_) | IndexExpr::Div(_) | IndexExpr::Mod(_))
}

/// `((((var / div) % modulo) + offset) % wrap)` with these parts optional.
fn term(expr: &RecExpr<IndexExpr>, id: Id, stride: usize) -> Option<Term> {
    let mut id = id;
    let mut wrap = None;
    let mut offset = 0;
    if let IndexExpr::Mod([x, w]) = expr[id] {
        if let IndexExpr::Add([y, o]) = expr[x] {
            wrap = Some(num(expr, w)?);
            offset = num(expr, o)?;
            id = y;
        }
    }
    if let IndexExpr::Add([y, o]) = expr[id] {
        // An offset without a wrap: only after a wrap was not found above.
        if wrap.is_none() {
            offset = num(expr, o)?;
            id = y;
        }
    }
    let mut modulo = None;
    if let IndexExpr::Mod([x, m]) = expr[id] {
        modulo = Some(num(expr, m)?);
        id = x;
    }
    let mut div = 1;
    if let IndexExpr::Div([x, d]) = expr[id] {
        div = num(expr, d)?;
        id = x;
    }
    let var = match &expr[id] {
        IndexExpr::Symbol(s) if s.as_str() == "o" => Var::Outer,
        IndexExpr::Symbol(s) if s.as_str() == "i" => Var::Inner,
        _ => return None,
    };
    Some(Term { var, div, modulo, stride, offset, wrap })
}

/// `index` in its cheapest equal form for loop variables below `outer` and `inner`.
pub fn simplify(index: &Index, outer: usize, inner: usize) -> Index {
    type Known = HashMap<(Index, usize, usize), Index>;
    static KNOWN: OnceLock<Mutex<Known>> = OnceLock::new();
    let known = KNOWN.get_or_init(Mutex::default);
    let key = (index.clone(), outer, inner);
    if let Some(simplified) = known.lock().expect("simplified indices").get(&key) {
        return simplified.clone();
    }
    let simplified = saturated(index, outer, inner);
    known.lock().expect("simplified indices").entry(key).or_insert(simplified).clone()
}

/// [`simplify`]'s equality saturation.
fn saturated(index: &Index, outer: usize, inner: usize) -> Index {
    let expr = to_expr(index);
    let runner = Runner::<IndexExpr, Bounds, ()>::new(Bounds { outer: outer as i64, inner: inner as i64 })
        .with_node_limit(2_000)
        .with_iter_limit(16)
        .with_time_limit(Duration::from_millis(50))
        .with_expr(&expr)
        .run(rules());
    let extractor = egg::Extractor::new(&runner.egraph, OpCost);
    let (_, best) = extractor.find_best(runner.roots[0]);
    let mut simplified = from_expr(&best).unwrap_or_else(|| index.clone());
    simplified.terms.retain(|t| t.stride != 0);
    simplified
}

/// Every index of `kernel` (loads, coordinates, stores) in its simplest form.
pub fn simplify_kernel(kernel: &mut Kernel) {
    let (outer, inner) = (kernel.outer, kernel.inner);
    let mut memo: Vec<(Index, Index)> = Vec::new();
    let mut simplify_memo = |index: &mut Index| {
        let known = memo.iter().find(|(from, _)| from == index).map(|(_, to)| to.clone());
        let simplified = known.unwrap_or_else(|| {
            let to = simplify(index, outer, inner);
            memo.push((index.clone(), to.clone()));
            to
        });
        *index = simplified;
    };
    for stage in &mut kernel.stages {
        let (exprs, stores) = match stage {
            Stage::Reduce { exprs, .. } => (exprs, None),
            Stage::Map { exprs, stores } | Stage::Row { exprs, stores } => (exprs, Some(stores)),
        };
        for e in exprs.iter_mut() {
            if let Expr::Load { index, .. } | Expr::Pick { index, .. } | Expr::Coord(index) = e {
                simplify_memo(index);
            }
        }
        for store in stores.into_iter().flatten() {
            simplify_memo(&mut store.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offsets(index: &Index, outer: usize, inner: usize) -> Vec<usize> {
        (0..outer).flat_map(|o| (0..inner).map(move |i| (o, i))).map(|(o, i)| index.offset(o, i)).collect()
    }

    /// The kernel builder's naive index of a walk over `sizes` with `strides`.
    fn naive(sizes: &[usize], strides: &[usize], split: usize) -> Index {
        crate::group::strided_index(sizes, strides, split)
    }

    #[test]
    fn simplified_indices_reach_the_same_offsets() {
        let mut state = 7u64;
        let mut next = |n: usize| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize % n
        };
        for _ in 0..200 {
            let rank = 1 + next(4);
            let sizes: Vec<usize> = (0..rank).map(|_| 1 + next(5)).collect();
            // Row-major, permuted, or broadcast (stride 0) strides.
            let mut strides = vec![0; rank];
            let mut step = 1;
            for d in (0..rank).rev() {
                strides[d] = step;
                step *= sizes[d];
            }
            if next(2) == 0 && rank > 1 {
                strides.swap(0, rank - 1);
            }
            if next(3) == 0 {
                strides[next(rank)] = 0;
            }
            let split = next(rank + 1);
            let index = naive(&sizes, &strides, split);
            let (outer, inner) = (sizes[..split].iter().product(), sizes[split..].iter().product());
            let simple = simplify(&index, outer, inner);
            assert_eq!(offsets(&simple, outer, inner), offsets(&index, outer, inner), "{index} -> {simple}");
            assert!(simple.terms.len() <= index.terms.len());
        }
    }

    #[test]
    fn a_contiguous_walk_becomes_one_term_per_variable() {
        let index = naive(&[2, 3, 4, 5], &[60, 20, 5, 1], 2);
        let simple = simplify(&index, 6, 20);
        assert_eq!(simple.to_string(), "o*20 + i", "{index}");
    }
}
