//! `attention`: scaled dot-product attention, found from dataflow, as one `attention` op.
//!
//! Exports write attention as `softmax(q @ k^T * c + m) @ v`: a matmul of two activations, a
//! scale (`mul` or `div` by a scalar constant), additive masks, a softmax over the last dim and a
//! second matmul. The pass replaces each such chain whose intermediate values nothing else reads
//! by `attention q, k, v[, bias] {scale, mask}`, which computes it without the `[.., Sq, Sk]`
//! scores (its backward recomputes them tile by tile from the log-sum-exp), so the activations
//! it saves grow linearly with the sequence.
//!
//! Each additive term is classified: a constant of zeros and "minus infinity" (at most
//! `-1e30`, as `torch.finfo.min` is; a constant, or a `select` between the two on a constant
//! boolean triangle, expanded) that keeps exactly the keys `j <= i`, or the last `W` of them,
//! becomes the op's `causal` or `sliding_window` mask (a row can never be all masked then,
//! so `-inf` and `finfo.min` give the same probabilities); other terms that no parameter reaches
//! (ALiBi's slopes, a padding mask from the inputs) are summed into the `bias` operand. A chain
//! with a term that a parameter reaches (its gradient would be the scores' own) stays unfused, as
//! does a scale applied after a mask, a softmax whose probabilities something else reads (a model
//! that outputs its attentions), or operands whose leading dims do not line up (`k` and `v` may
//! broadcast where they are 1: multi-query attention). Grouped-query attention's keys and values
//! repeated per query head (`repeat_kv`) are read before the repetition: the query's heads
//! become `[Hkv, G]` (a reshape), the unrepeated key and value broadcast over `G`, so neither
//! the repeated copies nor the gradient's sum over them exist.
//!
//! Input phase: imported (before `loss`; unless `compile --attention unfused`). The replaced
//! nodes are left for `dce`. Tests: tests/golden/attention_*.ir; tests/attention.rs (training
//! against the unfused graph).

use autotp_ir::{AttentionMask, BinaryOp, Def, Graph, NodeId, Op, Rewriter, ValueId};

use crate::recognize::View;
use crate::{Pass, PassError};

/// The pass, for a graph that tensor parallelism will split `tensor_parallel` ways: grouped
/// key/value heads are read unrepeated only where it divides their count (a rank's query heads
/// are then whole groups); otherwise (fewer key/value heads than ranks, which `autotp`
/// replicates) the op reads them repeated, split with the query heads.
///
/// Where context parallelism will split the queries over their sequence `context_parallel`
/// ways, a causal or sliding-window mask needs each query's position, which a rank holding
/// some of them does not know: the op takes the queries as that many runs, with their first
/// positions (`0, S/cp, ..`, an i64 constant) as its last operand, which split with the queries
/// (the attention kernel's `AttentionDims::query_runs`; on one device the same causal
/// mask). With `load_balanced` it takes twice as many runs, one per chunk of Megatron's load
/// balance (`crate::context_balance` arranges them).
#[derive(Clone, Copy, Debug)]
pub struct FuseAttention {
    pub tensor_parallel: usize,
    pub context_parallel: usize,
    pub load_balanced: bool,
}

impl Default for FuseAttention {
    fn default() -> FuseAttention {
        FuseAttention { tensor_parallel: 1, context_parallel: 1, load_balanced: false }
    }
}

/// An additive term that is at most this is a masked key.
const MASKED: f64 = -1e30;

/// One attention found: the second matmul's node and what replaces it.
struct Found {
    root: NodeId,
    q: ValueId,
    /// The key as the first matmul reads it, and whether it is `k^T` (the op takes `k`).
    k: ValueId,
    k_transposed: bool,
    v: ValueId,
    scale: f64,
    mask: AttentionMask,
    biases: Vec<ValueId>,
    /// The key's and value's heads before they were repeated, where both were.
    grouped: Option<[Repeated; 2]>,
}

/// A key or value whose heads were repeated for grouped-query attention (Hugging Face's
/// `repeat_kv`: a `reshape` to `[.., Hkv, 1, S, D]`, an `expand` to `[.., Hkv, G, S, D]` and a
/// `reshape` to `[.., Hkv * G, S, D]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Repeated {
    /// The `[.., Hkv, 1, S, D]` value before the `expand`.
    unexpanded: ValueId,
    /// The heads' dim in the query's shape.
    dim: usize,
    /// `G`: the query heads that share one key/value head.
    group: usize,
}

impl<'g> View<'g> {
    /// The only user of `v`, when it has exactly one and is not a graph output.
    fn single_user(&self, v: ValueId) -> Option<NodeId> {
        let is_output = self.graph.outputs().iter().any(|(_, o)| *o == v);
        match self.users[v.index()].as_slice() {
            [only] if !is_output => Some(*only),
            _ => None,
        }
    }

    /// Whether a parameter's value reaches `v`.
    fn reaches_param(&self, v: ValueId) -> bool {
        let mut stack = vec![v];
        let mut seen = std::collections::BTreeSet::new();
        while let Some(v) = stack.pop() {
            if !seen.insert(v) {
                continue;
            }
            match self.graph.value(v).def {
                Def::Param(_) | Def::State(_) => return true,
                Def::Input(_) => {}
                Def::Node(n, _) => stack.extend(self.graph.node(n).inputs.iter().copied()),
            }
        }
        false
    }

    /// Attention ending at `out = matmul(p, v)`.
    fn attention(&self, root: NodeId, fuse: &FuseAttention) -> Option<Found> {
        let node = self.graph.node(root);
        let (Op::MatMul { transpose_lhs: false, transpose_rhs: false }, [p, v]) = (&node.op, &node.inputs[..]) else {
            return None;
        };
        let rank = self.graph.ty(*p).rank();
        let (Op::Softmax { axis }, [mut x]) = self.op(*p)? else { return None };
        if *axis + 1 != rank || self.single_user(*p) != Some(root) {
            return None;
        }
        let scores_shape = self.graph.ty(x).shape.clone();
        let mut terms = Vec::new();
        let mut scale = 1.0;
        // Walking back from the softmax: the masks are added after the scale.
        let mut scaled = false;
        loop {
            let (op, inputs) = self.op(x)?;
            self.single_user(x)?;
            match (op, inputs) {
                (Op::Binary(BinaryOp::Add), [a, b]) if !scaled => {
                    // The scores come from the weights; an additive term that a parameter
                    // reaches would need the scores' gradient.
                    let (rest, term) = match (self.reaches_param(*a), self.reaches_param(*b)) {
                        (true, false) => (*a, *b),
                        (false, true) => (*b, *a),
                        _ => return None,
                    };
                    if self.graph.ty(rest).shape != scores_shape {
                        return None;
                    }
                    terms.push(term);
                    x = rest;
                }
                (Op::Binary(BinaryOp::Mul), [a, b]) => {
                    let (rest, c) = match (self.scalar(*b), self.scalar(*a)) {
                        (Some(c), _) => (*a, c),
                        (None, Some(c)) => (*b, c),
                        _ => return None,
                    };
                    scale *= c;
                    scaled = true;
                    x = rest;
                }
                (Op::Binary(BinaryOp::Div), [a, c]) => {
                    scale /= self.scalar(*c)?;
                    scaled = true;
                    x = *a;
                }
                (Op::MatMul { transpose_lhs: false, transpose_rhs }, [q, k]) => {
                    return self.found(root, (*q, *k, *transpose_rhs), *v, scale, terms, fuse);
                }
                _ => return None,
            }
        }
    }

    fn found(
        &self,
        root: NodeId,
        (q, k, k_transposed_by_flag): (ValueId, ValueId, bool),
        v: ValueId,
        scale: f64,
        terms: Vec<ValueId>,
        fuse: &FuseAttention,
    ) -> Option<Found> {
        let ty = |v: ValueId| self.graph.ty(v);
        let (qt, kt, vt) = (ty(q), ty(k), ty(v));
        let rank = qt.rank();
        if kt.rank() != rank
            || vt.rank() != rank
            || !qt.dtype.is_float()
            || kt.dtype != qt.dtype
            || vt.dtype != qt.dtype
        {
            return None;
        }
        let lead = rank - 2;
        // k as the op takes it, [.., Sk, D].
        let mut k_shape = kt.shape.clone();
        if !k_transposed_by_flag {
            k_shape.swap(lead, lead + 1);
        }
        let dims_fit = (0..lead).all(|d| (k_shape[d] == qt.shape[d] || k_shape[d] == 1) && vt.shape[d] == k_shape[d])
            && k_shape[lead + 1] == qt.shape[lead + 1]
            && vt.shape[lead] == k_shape[lead];
        if !dims_fit {
            return None;
        }
        let (q_len, kv_len) = (qt.shape[lead], k_shape[lead]);
        let mut mask = AttentionMask::None;
        let mut biases = Vec::new();
        for term in terms {
            match self.mask_of(term, q_len, kv_len) {
                Some(m) if mask == AttentionMask::None => mask = m,
                _ => biases.push(term),
            }
        }
        if biases.iter().any(|&b| ty(b).dtype != qt.dtype || ty(b).rank() > rank) {
            return None;
        }
        let k_transposed = !k_transposed_by_flag;
        // Read unrepeated only where tp splits whole groups of query heads.
        let grouped = self.untransposed_key(k, k_transposed).and_then(|key| {
            let (k, v) = (self.repeated(key)?, self.repeated(v)?);
            let whole_groups = (qt.shape[k.dim] / k.group).is_multiple_of(fuse.tensor_parallel);
            (k.dim == v.dim && k.group == v.group && k.dim < lead && whole_groups).then_some([k, v])
        });
        Some(Found { root, q, k, k_transposed, v, scale, mask, biases, grouped })
    }

    /// The key as `[.., Sk, D]` where the graph holds it so: `k` itself, or the input of the
    /// transpose that made `k^T`.
    fn untransposed_key(&self, k: ValueId, transposed: bool) -> Option<ValueId> {
        if !transposed {
            return Some(k);
        }
        let (Op::Transpose { perm }, [key]) = self.op(k)? else { return None };
        let mut last_two_swapped: Vec<usize> = (0..perm.len()).collect();
        last_two_swapped.swap(perm.len() - 2, perm.len() - 1);
        (*perm == last_two_swapped).then_some(*key)
    }

    /// `x` as the heads of a key or value repeated ([`Repeated`]), where it is one.
    fn repeated(&self, x: ValueId) -> Option<Repeated> {
        let (Op::Reshape { .. }, [expanded]) = self.op(x)? else { return None };
        let (Op::Expand { .. }, [unexpanded]) = self.op(*expanded)? else { return None };
        let shape = &self.graph.ty(x).shape;
        let (wide, narrow) = (&self.graph.ty(*expanded).shape, &self.graph.ty(*unexpanded).shape);
        if wide.len() != shape.len() + 1 || narrow.len() != wide.len() {
            return None;
        }
        (0..shape.len()).find_map(|dim| {
            let group = wide[dim + 1];
            let fits = narrow[dim + 1] == 1
                && group > 1
                && (0..wide.len()).all(|d| d == dim + 1 || wide[d] == narrow[d])
                && shape[..dim] == wide[..dim]
                && shape[dim] == wide[dim] * group
                && shape[dim + 1..] == wide[dim + 2..];
            fits.then_some(Repeated { unexpanded: *unexpanded, dim, group })
        })
    }

    /// The values of a constant term (`[.., rows, cols]`, leading dims unexpanded): a constant,
    /// or `select` between two scalar constants on a constant condition (how exports write a
    /// causal mask from a boolean triangle), through `expand`s of the leading dims.
    fn constant_values(&self, term: ValueId) -> Option<(Vec<usize>, Vec<f64>)> {
        match self.op(term)? {
            (Op::Constant { value }, _) => {
                Some((value.shape().to_vec(), (0..value.numel()).map(|i| value.get_f64(i)).collect()))
            }
            (Op::Expand { shape }, [x]) => {
                let (inner, values) = self.constant_values(*x)?;
                let keeps_rows = inner.len() >= 2 && shape.ends_with(&inner[inner.len() - 2..]);
                keeps_rows.then_some((inner, values))
            }
            (Op::Select, [condition, on_true, on_false]) => {
                let (a, b) = (self.scalar(*on_true)?, self.scalar(*on_false)?);
                let (shape, condition) = self.constant_values(*condition)?;
                Some((shape, condition.into_iter().map(|c| if c != 0.0 { a } else { b }).collect()))
            }
            _ => None,
        }
    }

    /// `v` through `expand`s that keep its last two dims.
    fn unexpanded(&self, mut v: ValueId) -> ValueId {
        while let Some((Op::Expand { shape }, [x])) = self.op(v) {
            let inner = &self.graph.ty(*x).shape;
            if inner.len() < 2 || !shape.ends_with(&inner[inner.len() - 2..]) {
                break;
            }
            v = *x;
        }
        v
    }

    /// A constant of positions along one of the scores' last two dims: an arange plus an
    /// offset, `[.., 1, n]` (keys: `true`) or `[.., n, 1]` (queries), and the offset.
    fn positions(&self, v: ValueId) -> Option<(bool, i64)> {
        let (Op::Constant { value }, _) = self.op(v)? else { return None };
        let shape = value.shape();
        let along = match shape {
            [lead @ .., 1, n] if lead.iter().all(|&d| d == 1) && *n > 1 => true,
            [lead @ .., n, 1] if lead.iter().all(|&d| d == 1) && *n > 1 => false,
            _ => return None,
        };
        let offset = value.get_i64(0);
        (0..value.numel()).all(|i| value.get_i64(i) == offset + i as i64).then_some((along, offset))
    }

    /// A causal mask written as `select(compare(a, b), 0, MIN)` (through `expand`s) where `a` and
    /// `b` are the keys' and the queries' positions ([`View::positions`]): read from the
    /// comparison, not from the `[Sq, Sk]` matrix (which exports compute at run time where it is
    /// too big to fold).
    fn compared_positions(&self, term: ValueId) -> Option<AttentionMask> {
        let (Op::Select, [condition, kept, masked]) = self.op(self.unexpanded(term))? else { return None };
        if self.scalar(*kept)? != 0.0 || self.scalar(*masked)? > MASKED {
            return None;
        }
        let (Op::Binary(compare), [a, b]) = self.op(self.unexpanded(*condition))? else { return None };
        let ((a_keys, a_at), (b_keys, b_at)) = (self.positions(*a)?, self.positions(*b)?);
        // The comparison as `key <op> query + shift`, keys at 0.. and queries at 0..
        let (op, shift) = match (a_keys, b_keys) {
            (true, false) => (*compare, b_at - a_at),
            (false, true) => (flipped(*compare)?, a_at - b_at),
            _ => return None,
        };
        match (op, shift) {
            (BinaryOp::LessEqual, 0) | (BinaryOp::Less, 1) => Some(AttentionMask::Causal),
            _ => None,
        }
    }

    /// The mask a constant term is: zeros where keys are kept, at most [`MASKED`] elsewhere,
    /// the same for every leading index.
    fn mask_of(&self, term: ValueId, q_len: usize, kv_len: usize) -> Option<AttentionMask> {
        if let Some(mask) = self.compared_positions(term) {
            return Some(mask);
        }
        let (shape, values) = self.constant_values(term)?;
        let (rows, cols) = match shape[..] {
            [.., r, c] => (r, c),
            _ => return None,
        };
        if rows != q_len || cols != kv_len {
            return None;
        }
        // Which keys the last query keeps: a window ending at it (or every key up to it).
        let last = q_len.checked_sub(1)?;
        let window = (0..kv_len).filter(|&j| values[last * cols + j] == 0.0).count();
        let mask = if window > last { AttentionMask::Causal } else { AttentionMask::SlidingWindow { window } };
        let block = rows * cols;
        let fits = values.chunks(block).all(|values| {
            (0..rows).all(|i| {
                let keys = mask.keys(i as i64, cols);
                (0..cols).all(|j| {
                    if keys.contains(&j) {
                        values[i * cols + j] == 0.0
                    } else {
                        values[i * cols + j] <= MASKED
                    }
                })
            })
        });
        (fits && window > 0).then_some(mask)
    }
}

impl Pass for FuseAttention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let view = View::new(graph);
        let found: Vec<Found> = graph.nodes().filter_map(|(id, _)| view.attention(id, self)).collect();
        if found.is_empty() {
            return Ok(());
        }
        let old = &*graph;
        let mut rw = Rewriter::new(old, |_| true);
        let invalid = |message: String| PassError::Invalid { pass: "attention", message };
        for (id, node) in old.nodes() {
            let Some(f) = found.iter().find(|f| f.root == id) else {
                rw.copy_node(id);
                continue;
            };
            let rank = old.ty(f.q).rank();
            let mut inputs = match f.grouped {
                // The query's heads as [.., Hkv, G]: the unrepeated key and value broadcast
                // over G, and each query head meets its own key/value head.
                Some([k, v]) => {
                    let q = rw.map(f.q);
                    let shape = grouped_shape(&old.ty(f.q).shape, k);
                    let q = rw.graph().add(Op::Reshape { shape }, vec![q]).map_err(&invalid)?;
                    vec![q, rw.map(k.unexpanded), rw.map(v.unexpanded)]
                }
                None => vec![rw.map(f.q), key(&mut rw, old, f.k, f.k_transposed).map_err(&invalid)?, rw.map(f.v)],
            };
            let grouped_key = f.grouped.map(|[k, _]| k);
            if let Some(bias) = bias(&mut rw, &f.biases, rank, grouped_key).map_err(&invalid)? {
                inputs.push(bias);
            }
            let q_len = old.ty(f.q).shape[rank - 2];
            let chunks = if self.load_balanced { 2 * self.context_parallel } else { self.context_parallel };
            let runs = if q_len.is_multiple_of(chunks) { chunks } else { self.context_parallel };
            if f.mask.is_positional() && runs > 1 && q_len.is_multiple_of(runs) {
                let starts: Vec<i64> = (0..runs).map(|r| (r * q_len / runs) as i64).collect();
                let value = autotp_ir::Tensor::from_i64(vec![runs], &starts);
                inputs.push(rw.graph().add(Op::Constant { value }, vec![]).map_err(&invalid)?);
            }
            let g = rw.graph();
            let op = Op::Attention { scale: f.scale, mask: f.mask, kv_block: None };
            let attention = g.add_node(op, inputs, 2).map_err(|m| invalid(format!("attention: {m}")))?;
            let mut out = g.node(attention).outputs[0];
            if f.grouped.is_some() {
                let shape = old.ty(node.outputs[0]).shape.clone();
                out = g.add(Op::Reshape { shape }, vec![out]).map_err(&invalid)?;
            }
            rw.set(node.outputs[0], out);
        }
        tracing::debug!(count = found.len(), "fused attention");
        *graph = rw.finish();
        Ok(())
    }
}

/// `b <op'> a` for `a <op> b`, for the order comparisons.
fn flipped(op: BinaryOp) -> Option<BinaryOp> {
    Some(match op {
        BinaryOp::Less => BinaryOp::Greater,
        BinaryOp::LessEqual => BinaryOp::GreaterEqual,
        BinaryOp::Greater => BinaryOp::Less,
        BinaryOp::GreaterEqual => BinaryOp::LessEqual,
        _ => return None,
    })
}

/// The key as `[.., Sk, D]`: `k` itself, or `k^T` transposed back (one transpose, composed
/// with the one that made `k^T` when there is one).
fn key(rw: &mut Rewriter, old: &Graph, k: ValueId, transposed: bool) -> Result<ValueId, String> {
    if !transposed {
        return Ok(rw.map(k));
    }
    let rank = old.ty(k).rank();
    let mut swap: Vec<usize> = (0..rank).collect();
    swap.swap(rank - 2, rank - 1);
    let (source, perm) = match old.value(k).def {
        Def::Node(n, _) => match &old.node(n).op {
            Op::Transpose { perm } => (old.node(n).inputs[0], swap.iter().map(|&s| perm[s]).collect()),
            _ => (k, swap),
        },
        _ => (k, swap),
    };
    let source = rw.map(source);
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        return Ok(source);
    }
    rw.graph().add(Op::Transpose { perm }, vec![source])
}

/// `shape` (a query's, or a bias's that broadcasts against the scores) with its heads' dim as
/// `[Hkv, G]` for the grouped key/value heads `heads`, or `[1, 1]` where it broadcasts.
fn grouped_shape(shape: &[usize], heads: Repeated) -> Vec<usize> {
    let mut shape = shape.to_vec();
    let split = match shape[heads.dim] {
        1 => [1, 1],
        h => [h / heads.group, heads.group],
    };
    shape.splice(heads.dim..=heads.dim, split);
    shape
}

/// The additive terms that are not the mask, summed and given the scores' rank (with the
/// heads grouped as the query's are, for grouped key/value heads).
fn bias(
    rw: &mut Rewriter,
    terms: &[ValueId],
    rank: usize,
    grouped: Option<Repeated>,
) -> Result<Option<ValueId>, String> {
    let mut sum: Option<ValueId> = None;
    for &t in terms {
        let t = rw.map(t);
        sum = Some(match sum {
            None => t,
            Some(s) => rw.graph().add(Op::Binary(BinaryOp::Add), vec![s, t])?,
        });
    }
    let Some(sum) = sum else { return Ok(None) };
    let shape = rw.graph().ty(sum).shape.clone();
    let mut full = vec![1; rank - shape.len()];
    full.extend(&shape);
    if let Some(heads) = grouped {
        full = grouped_shape(&full, heads);
    }
    if full == shape {
        return Ok(Some(sum));
    }
    rw.graph().add(Op::Reshape { shape: full }, vec![sum]).map(Some)
}
