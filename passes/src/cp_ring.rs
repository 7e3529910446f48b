//! Context parallelism's ring (`--cp-comm-type p2p`, Megatron's default), the `cp-ring`
//! compile step: attention meets the other ranks' keys and values a block at a time, passed
//! around the ring of cp ranks, instead of all-gathered whole. A rank then holds at most two
//! blocks of a layer's keys and values (the one it attends over and the next, arriving), not
//! all N.
//!
//! The pass rewrites the placed graph the shard passes (and [`crate::context_balance`]) made:
//! each attention over keys and values all-gathered over cp, and its backward, whose key and
//! value gradients are reduce-scattered back, become N rounds. In round i rank r holds the
//! keys and values of rank r - i (`ring_shift` passes them on, started while the round
//! computes), and its queries attend over that block: one `attention {kv_block}` per
//! contiguous chunk of it (two under the load-balanced order), whose query runs start where
//! the queries are relative to the chunk (a constant table sliced over cp; a query before
//! every key of a chunk sees none of it). The rounds' outputs merge by their log-sum-exps, in
//! f32 (FlashAttention's rescaling):
//!
//! ```text
//! lse = log(exp(lse_a) + exp(lse_b)),  out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)
//! ```
//!
//! The backward passes the keys and values around again (rather than keeping every block from
//! the forward), with each block's key and value gradient sums travelling beside them: rank r
//! adds its part for the block it holds and passes the sum on, and one last shift brings each
//! sum home. Each round's backward takes the merged output and log-sum-exp, so its
//! probabilities are the whole attention's. The sums are kept in f32.
//!
//! A graph whose attention reads keys not all-gathered over cp, or that has a bias, or whose
//! attention is not fused (a model whose scores the `attention` pass does not recognize) keeps
//! the all-gather, and [`ring_attention`] says why.
//!
//! Tests: tests/golden/cp_ring*.ir, tests/context_parallel.rs.

use std::collections::{BTreeMap, BTreeSet};

use autotp_ir::{
    BinaryOp, Collective, DType, Def, Graph, NodeId, Op, Placement, Rewriter, Tensor, TensorType, UnaryOp, ValueId,
    CONTEXT_AXIS,
};
use autotp_program::step::SequenceOrder;

use crate::PassError;

/// The graph with every attention over cp computed around the ring, its sequences in `order`,
/// or why it keeps the all-gather (`Err`: the graph is then right as it is). A graph without a
/// cp axis, or without attention over it, is returned as it is.
pub fn ring_attention(graph: &Graph, order: SequenceOrder) -> Result<Result<Graph, String>, PassError> {
    let Some(axis) = graph.mesh.axes.iter().position(|a| a.name == CONTEXT_AXIS) else {
        return Ok(Ok(graph.clone()));
    };
    let rings = match Rings::find(graph, axis, order) {
        Ok(rings) => rings,
        Err(why) => return Ok(Err(why)),
    };
    if rings.forward.is_empty() {
        let cp = &graph.mesh.axes[axis].name;
        let gathers = graph.nodes().find(
            |(_, n)| matches!(&n.op, Op::Collective { kind: Collective::AllGather { .. }, axis: on, .. } if on == cp),
        );
        return Ok(match gathers {
            Some((id, _)) => Err(format!(
                "no fused attention takes its queries split over cp; the keys are all-gathered (all_gather, node {})",
                id.index()
            )),
            None => Ok(graph.clone()),
        });
    }
    rings.apply(graph).map(|g| Ok(g.without_dead_code()))
}

/// [`ring_attention`] as a pass that refuses a graph it cannot rewrite (for golden files).
pub struct RingAttention {
    pub order: SequenceOrder,
}

impl crate::Pass for RingAttention {
    fn name(&self) -> &'static str {
        "cp-ring"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        *graph =
            ring_attention(graph, self.order)?.map_err(|message| PassError::Invalid { pass: "cp-ring", message })?;
        Ok(())
    }
}

/// Where the ranks' queries and keys are: positions of the sequence, by rank.
struct Layout {
    /// The sequence's tokens and the query runs over it (attention's operand).
    seq_len: usize,
    runs: usize,
    /// The ring's ranks (cp).
    ranks: usize,
    /// Each rank's tokens of a sequence.
    block: usize,
    /// The contiguous chunks of positions in a rank's block (1, or 2 in the balanced order).
    chunks: usize,
    /// The position of each rank's chunks' first token, by rank.
    chunk_starts: Vec<Vec<i64>>,
    /// The position of each rank's query runs' first query, by rank.
    run_starts: Vec<Vec<i64>>,
}

impl Layout {
    fn new(order: SequenceOrder, seq_len: usize, ranks: usize, runs: usize) -> Result<Layout, String> {
        let positions = order
            .positions(seq_len)
            .ok_or_else(|| format!("the sequence of {seq_len} tokens does not take the order {order:?}"))?;
        if !seq_len.is_multiple_of(ranks) || !runs.is_multiple_of(ranks) {
            return Err(format!("{seq_len} tokens in {runs} query runs do not divide over cp = {ranks}"));
        }
        let block = seq_len / ranks;
        // A rank's block is one chunk of consecutive positions, or two in the balanced order.
        let chunks = match order {
            SequenceOrder::Natural => 1,
            SequenceOrder::LoadBalanced { .. } => 2,
        };
        let runs_per_rank = runs / ranks;
        let chunk_len = block / chunks;
        let consecutive = (1..seq_len).all(|s| s % chunk_len == 0 || positions[s] == positions[s - 1] + 1);
        if !block.is_multiple_of(chunks) || !block.is_multiple_of(runs_per_rank) || !consecutive {
            return Err(format!("the ranks' tokens are not {chunks} chunks of positions in {runs_per_rank} runs"));
        }
        let starts = |count: usize| -> Vec<Vec<i64>> {
            (0..ranks).map(|r| (0..count).map(|c| positions[r * block + c * block / count] as i64).collect()).collect()
        };
        let (chunk_starts, run_starts) = (starts(chunks), starts(runs_per_rank));
        Ok(Layout { seq_len, runs, ranks, block, chunks, chunk_starts, run_starts })
    }

    /// Round `round`'s query positions relative to chunk `chunk` of the block rank r holds then
    /// (rank r - round's), every rank's runs in rank order: the table sliced over cp.
    fn relative_starts(&self, round: usize, chunk: usize) -> Vec<i64> {
        (0..self.ranks)
            .flat_map(|r| {
                let key = self.chunk_starts[(r + self.ranks - round) % self.ranks][chunk];
                self.run_starts[r].iter().map(move |&q| q - key)
            })
            .collect()
    }
}

/// The attentions to compute around the ring, found in one graph.
struct Rings {
    axis: usize,
    layout: Option<Layout>,
    /// Per attention forward: the key and value shards its all-gathers took.
    forward: BTreeMap<NodeId, [ValueId; 2]>,
    /// Per attention backward: its forward, and the values its reduce-scatters of the key and
    /// value gradients made (each rank's block of the sums).
    backward: BTreeMap<NodeId, (NodeId, [ValueId; 2])>,
    /// The gathers, reduce-scatters and waits between a backward and those values, which the
    /// ring replaces.
    replaced: BTreeSet<NodeId>,
}

impl Rings {
    fn find(graph: &Graph, axis: usize, order: SequenceOrder) -> Result<Rings, String> {
        let consumers = graph.consumers();
        let mut rings = Rings {
            axis,
            layout: None,
            forward: BTreeMap::new(),
            backward: BTreeMap::new(),
            replaced: BTreeSet::new(),
        };
        let mut backward_shards = BTreeMap::new();
        for (id, node) in graph.nodes() {
            let forward = match node.op {
                Op::Attention { kv_block: None, .. } => true,
                Op::AttentionGrad { kv_block: None, .. } => false,
                _ => continue,
            };
            let q = node.inputs[0];
            let lead = graph.ty(q).rank() - 2;
            if graph.value(q).placements[axis] != Placement::Shard(lead) {
                continue;
            }
            let described = || format!("{} (node {})", node.op.name(), id.index());
            // Operands: q, k, v, [bias,] (out, lse, d_out of the backward,) query run starts.
            let operands = if forward { 3 } else { 6 };
            let starts = node.inputs.last().map(|&s| graph.ty(s)).filter(|t| t.dtype == DType::I64);
            let Some(starts) = starts.filter(|_| node.inputs.len() > operands) else {
                return Err(format!("{} has no query runs", described()));
            };
            if node.inputs.len() > operands + 1 {
                return Err(format!("{} adds a bias to its scores", described()));
            }
            let shards = [1, 2].map(|i| gathered_from(graph, node.inputs[i], axis, lead));
            let [Some(keys), Some(values)] = shards else {
                return Err(format!("{} reads keys and values not all-gathered over cp", described()));
            };
            for shard in [keys, values] {
                let placements = &graph.value(shard).placements;
                if placements
                    .iter()
                    .enumerate()
                    .any(|(a, p)| a != axis && matches!(p, Placement::Shard(d) if *d >= lead))
                {
                    return Err(format!("{} has keys split along their sequence or features beside cp", described()));
                }
            }
            let (seq_len, runs) = (graph.ty(q).shape[lead], starts.numel());
            match &rings.layout {
                Some(layout) if (layout.seq_len, layout.runs) != (seq_len, runs) => {
                    return Err(format!(
                        "{} attends over another sequence than the graph's first attention",
                        described()
                    ));
                }
                Some(_) => {}
                None => rings.layout = Some(Layout::new(order, seq_len, graph.mesh.axes[axis].size, runs)?),
            }
            if forward {
                rings.forward.insert(id, [keys, values]);
                continue;
            }
            let Def::Node(made_by, 1) = graph.value(node.inputs[4]).def else {
                return Err(format!("{} reads a log-sum-exp no attention made", described()));
            };
            let mut results = [keys; 2];
            for (g, result) in [1, 2].into_iter().zip(&mut results) {
                let (made, chain) = scattered_to(graph, &consumers, node.outputs[g], axis, lead).ok_or_else(|| {
                    format!("{}'s key and value gradients are not reduce-scattered over cp", described())
                })?;
                *result = made;
                rings.replaced.extend(chain);
            }
            rings.backward.insert(id, (made_by, results));
            backward_shards.insert(id, [keys, values]);
        }
        for (id, (forward, _)) in &rings.backward {
            if rings.forward.get(forward) != backward_shards.get(id) {
                return Err(format!(
                    "attention_grad (node {}) reads other keys and values than its forward",
                    id.index()
                ));
            }
        }
        Ok(rings)
    }

    fn apply(&self, graph: &Graph) -> Result<Graph, PassError> {
        let layout = self.layout.as_ref().expect("found with the attentions");
        let mut emit = Emit {
            rw: Rewriter::new(graph, |_| true),
            axis: self.axis,
            layout,
            tables: BTreeMap::new(),
            scalars: BTreeMap::new(),
            split: BTreeMap::new(),
        };
        for (id, node) in graph.nodes() {
            if let Some(&shards) = self.forward.get(&id) {
                let [out, lse] = emit.forward(node, shards)?;
                emit.rw.set(node.outputs[0], out);
                emit.rw.set(node.outputs[1], lse);
            } else if let Some(&(forward, results)) = self.backward.get(&id) {
                let shards = self.forward[&forward];
                let [dq, dk, dv] = emit.backward(node, shards, results)?;
                emit.rw.set(node.outputs[0], dq);
                emit.rw.set(results[0], dk);
                emit.rw.set(results[1], dv);
            } else if !self.replaced.contains(&id) {
                emit.rw.copy_node(id);
            }
        }
        Ok(emit.rw.finish())
    }
}

/// The shard over cp that `gathered` (an attention's keys or values) was all-gathered from,
/// through a wait and the balanced order's gather.
fn gathered_from(graph: &Graph, gathered: ValueId, axis: usize, lead: usize) -> Option<ValueId> {
    let mut v = gathered;
    loop {
        let Def::Node(n, 0) = graph.value(v).def else { return None };
        let node = graph.node(n);
        match &node.op {
            Op::Gather { axis: dim } if *dim == lead && v == gathered => v = node.inputs[0],
            Op::Wait => v = node.inputs[0],
            Op::Collective { kind: Collective::AllGather { dim }, axis: on, .. }
                if *dim == lead && graph.mesh.axes[axis].name == *on =>
            {
                return Some(node.inputs[0]);
            }
            _ => return None,
        }
    }
}

/// What reduce-scattering `partial` (an attention backward's key or value gradient) over cp
/// made, through the balanced order's gather and a wait, and the nodes on the way.
fn scattered_to(
    graph: &Graph,
    consumers: &[Vec<NodeId>],
    partial: ValueId,
    axis: usize,
    lead: usize,
) -> Option<(ValueId, Vec<NodeId>)> {
    let mut v = partial;
    let mut chain = Vec::new();
    loop {
        let [n] = consumers[v.index()][..] else { return None };
        let node = graph.node(n);
        chain.push(n);
        v = node.outputs[0];
        match &node.op {
            Op::Gather { axis: dim } if *dim == lead && chain.len() == 1 && node.inputs[0] == partial => {}
            Op::Collective { kind: Collective::ReduceScatter { dim }, axis: on, start }
                if *dim == lead && graph.mesh.axes[axis].name == *on =>
            {
                if !start {
                    return Some((v, chain));
                }
            }
            Op::Wait if chain.len() > 1 => return Some((v, chain)),
            _ => return None,
        }
    }
}

/// Emits the ring's nodes into the rewritten graph.
struct Emit<'g, 'l> {
    rw: Rewriter<'g>,
    axis: usize,
    layout: &'l Layout,
    /// The relative query starts by round and chunk, sliced over cp, each made once.
    tables: BTreeMap<(usize, usize), ValueId>,
    /// Scalar constants by dtype and bits, each made once.
    scalars: BTreeMap<(DType, u64), ValueId>,
    /// Keys and values (new ids) reshaped to `[.., N, chunks, L, D]`, each once.
    split: BTreeMap<ValueId, ValueId>,
}

impl Emit<'_, '_> {
    /// `op` on `inputs` (new values), its single result placed as `like` (an old value's
    /// placements) or replicated.
    fn op(&mut self, op: Op, inputs: Vec<ValueId>, like: Option<&[Placement]>) -> Result<ValueId, PassError> {
        let g = self.rw.graph();
        let made = crate::add_op("cp-ring", g, op, inputs)?;
        if let Some(placements) = like {
            g.value_mut(made).placements = placements.to_vec();
        }
        Ok(made)
    }

    fn placements(&mut self, new: ValueId) -> Vec<Placement> {
        self.rw.graph().value(new).placements.clone()
    }

    fn binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        let like = self.placements(a);
        self.op(Op::Binary(op), vec![a, b], Some(&like))
    }

    fn unary(&mut self, op: UnaryOp, a: ValueId) -> Result<ValueId, PassError> {
        let like = self.placements(a);
        self.op(Op::Unary(op), vec![a], Some(&like))
    }

    fn cast(&mut self, x: ValueId, to: DType) -> Result<ValueId, PassError> {
        if self.rw.graph().ty(x).dtype == to {
            return Ok(x);
        }
        let like = self.placements(x);
        self.op(Op::Cast { to }, vec![x], Some(&like))
    }

    fn reshape(&mut self, x: ValueId, shape: Vec<usize>) -> Result<ValueId, PassError> {
        let like = self.placements(x);
        self.op(Op::Reshape { shape }, vec![x], Some(&like))
    }

    fn scalar(&mut self, dtype: DType, value: f64) -> Result<ValueId, PassError> {
        if let Some(&made) = self.scalars.get(&(dtype, value.to_bits())) {
            return Ok(made);
        }
        let made = self.op(Op::Constant { value: Tensor::from_f64_values(dtype, vec![], &[value]) }, vec![], None)?;
        self.scalars.insert((dtype, value.to_bits()), made);
        Ok(made)
    }

    /// `x` (split over cp) passed one rank on around the ring: started now, and the wait that
    /// completes it, to call when the value is needed.
    fn shift_start(&mut self, x: ValueId) -> Result<ValueId, PassError> {
        let like = self.placements(x);
        let dim = self.rw.graph().ty(x).rank() - 2;
        let axis = self.rw.graph().mesh.axes[self.axis].name.clone();
        self.op(Op::Collective { kind: Collective::RingShift { dim }, axis, start: true }, vec![x], Some(&like))
    }

    fn wait(&mut self, started: ValueId) -> Result<ValueId, PassError> {
        let like = self.placements(started);
        self.op(Op::Wait, vec![started], Some(&like))
    }

    /// The table of round `round`'s query starts relative to chunk `chunk`, sliced over cp.
    fn relative_starts(&mut self, round: usize, chunk: usize) -> Result<ValueId, PassError> {
        if let Some(&made) = self.tables.get(&(round, chunk)) {
            return Ok(made);
        }
        let values = self.layout.relative_starts(round, chunk);
        let table = self.op(Op::Constant { value: Tensor::from_i64(vec![values.len()], &values) }, vec![], None)?;
        let mut sliced = self.placements(table);
        sliced[self.axis] = Placement::Shard(0);
        let axis = self.rw.graph().mesh.axes[self.axis].name.clone();
        let op = Op::Collective { kind: Collective::ShardSlice { dim: 0 }, axis, start: false };
        let made = self.op(op, vec![table], Some(&sliced))?;
        self.tables.insert((round, chunk), made);
        Ok(made)
    }

    /// Chunk `chunk` of each rank's block of `x` (`[.., S, D]` split over cp along S): `x`
    /// itself with one chunk.
    fn chunk(&mut self, x: ValueId, chunk: usize) -> Result<ValueId, PassError> {
        let chunks = self.layout.chunks;
        if chunks == 1 {
            return Ok(x);
        }
        let shape = self.rw.graph().ty(x).shape.clone();
        let lead = shape.len() - 2;
        let (ranks, chunk_len) = (self.layout.ranks, self.layout.block / chunks);
        let mut split = shape[..lead].to_vec();
        split.extend([ranks, chunks, chunk_len, shape[lead + 1]]);
        let blocks = match self.split.get(&x) {
            Some(&made) => made,
            None => {
                let made = self.reshape(x, split.clone())?;
                self.split.insert(x, made);
                made
            }
        };
        let (mut starts, mut ends) = (vec![0; split.len()], split.clone());
        starts[lead + 1] = chunk;
        ends[lead + 1] = chunk + 1;
        let like = self.placements(blocks);
        let op = Op::Slice { starts, ends: ends.iter().map(|&e| e as i64).collect(), steps: vec![1; split.len()] };
        let sliced = self.op(op, vec![blocks], Some(&like))?;
        let mut joined = shape[..lead].to_vec();
        joined.extend([ranks * chunk_len, shape[lead + 1]]);
        self.reshape(sliced, joined)
    }

    /// The chunks' gradients (each `[.., N * L, D]`) joined into the blocks' (`[.., S, D]`).
    fn join(&mut self, parts: &[ValueId]) -> Result<ValueId, PassError> {
        if let [whole] = parts {
            return Ok(*whole);
        }
        let shape = self.rw.graph().ty(parts[0]).shape.clone();
        let lead = shape.len() - 2;
        let (ranks, chunk_len) = (self.layout.ranks, self.layout.block / parts.len());
        let mut split = shape[..lead].to_vec();
        split.extend([ranks, 1, chunk_len, shape[lead + 1]]);
        let blocks = parts.iter().map(|&p| self.reshape(p, split.clone())).collect::<Result<Vec<_>, _>>()?;
        let like = self.placements(blocks[0]);
        let joined = self.op(Op::Concat { axis: lead + 1 }, blocks, Some(&like))?;
        let mut whole = shape[..lead].to_vec();
        whole.extend([ranks * self.layout.block, shape[lead + 1]]);
        self.reshape(joined, whole)
    }

    /// `(out_a, lse_a)` and `(out_b, lse_b)` (outputs in the log-sum-exp's dtype) merged.
    fn merge(
        &mut self,
        (out_a, lse_a): (ValueId, ValueId),
        (out_b, lse_b): (ValueId, ValueId),
    ) -> Result<(ValueId, ValueId), PassError> {
        let dtype = self.rw.graph().ty(lse_a).dtype;
        // The larger log-sum-exp, at least the lowest finite value: rows that have seen no key
        // yet (-inf on both sides) weigh 0.
        let (lowest, tiny) = match dtype {
            DType::F64 => (f64::MIN, f64::MIN_POSITIVE),
            _ => (f32::MIN as f64, f32::MIN_POSITIVE as f64),
        };
        let (lowest, tiny) = (self.scalar(dtype, lowest)?, self.scalar(dtype, tiny)?);
        let larger = self.binary(BinaryOp::Max, lse_a, lse_b)?;
        let max = self.binary(BinaryOp::Max, larger, lowest)?;
        let [a, b] =
            [lse_a, lse_b].map(|l| self.binary(BinaryOp::Sub, l, max).and_then(|d| self.unary(UnaryOp::Exp, d)));
        let (a, b) = (a?, b?);
        let sum = self.binary(BinaryOp::Add, a, b)?;
        let log_sum = self.unary(UnaryOp::Log, sum)?;
        let lse = self.binary(BinaryOp::Add, max, log_sum)?;
        let divisor = self.binary(BinaryOp::Max, sum, tiny)?;
        let mut column = self.rw.graph().ty(lse_a).shape.clone();
        column.push(1);
        let mut weighted = Vec::new();
        for (weight, out) in [(a, out_a), (b, out_b)] {
            let weight = self.binary(BinaryOp::Div, weight, divisor)?;
            let weight = self.reshape(weight, column.clone())?;
            weighted.push(self.binary(BinaryOp::Mul, out, weight)?);
        }
        let out = self.binary(BinaryOp::Add, weighted[0], weighted[1])?;
        Ok((out, lse))
    }

    /// The forward `node` around the ring over the key and value `shards`: its output and
    /// log-sum-exp.
    fn forward(&mut self, node: &autotp_ir::Node, shards: [ValueId; 2]) -> Result<[ValueId; 2], PassError> {
        let Op::Attention { scale, mask, .. } = node.op else { unreachable!("found as a forward") };
        let old = self.rw.old();
        let (out_like, lse_like) =
            (old.value(node.outputs[0]).placements.clone(), old.value(node.outputs[1]).placements.clone());
        let (out_type, lse_type) = (old.ty(node.outputs[0]).clone(), old.ty(node.outputs[1]).clone());
        let q = self.rw.map(node.inputs[0]);
        let [mut keys, mut values] = shards.map(|s| self.rw.map(s));
        let kv_block = Some(self.layout.block / self.layout.chunks);
        let mut merged: Option<(ValueId, ValueId)> = None;
        for round in 0..self.layout.ranks {
            let next = match round + 1 < self.layout.ranks {
                true => Some([self.shift_start(keys)?, self.shift_start(values)?]),
                false => None,
            };
            for chunk in 0..self.layout.chunks {
                let (k, v) = (self.chunk(keys, chunk)?, self.chunk(values, chunk)?);
                let starts = self.relative_starts(round, chunk)?;
                let g = self.rw.graph();
                let made = g.add_node_typed(
                    Op::Attention { scale, mask, kv_block },
                    vec![q, k, v, starts],
                    vec![out_type.clone(), lse_type.clone()],
                );
                let [out, lse] = [0, 1].map(|i| g.node(made).outputs[i]);
                g.value_mut(out).placements = out_like.clone();
                g.value_mut(lse).placements = lse_like.clone();
                let out = self.cast(out, lse_type.dtype)?;
                merged = Some(match merged {
                    None => (out, lse),
                    Some(so_far) => self.merge(so_far, (out, lse))?,
                });
            }
            if let Some([k, v]) = next {
                keys = self.wait(k)?;
                values = self.wait(v)?;
            }
        }
        let (out, lse) = merged.expect("cp > 1 rounds");
        Ok([self.cast(out, out_type.dtype)?, lse])
    }

    /// The backward `node` around the ring over the key and value `shards`: the query
    /// gradient and the key and value gradients (each rank's block, as `results` were).
    fn backward(
        &mut self,
        node: &autotp_ir::Node,
        shards: [ValueId; 2],
        results: [ValueId; 2],
    ) -> Result<[ValueId; 3], PassError> {
        let Op::AttentionGrad { scale, mask, .. } = node.op else { unreachable!("found as a backward") };
        let old = self.rw.old();
        let dq_like = old.value(node.outputs[0]).placements.clone();
        let shard_like = old.value(shards[0]).placements.clone();
        let dq_type = old.ty(node.outputs[0]).clone();
        let result_types = results.map(|r| old.ty(r).clone());
        let sum_dtype = if dq_type.dtype == DType::F64 { DType::F64 } else { DType::F32 };
        let [q, out, lse, d_out] = [0, 3, 4, 5].map(|i| self.rw.map(node.inputs[i]));
        let [mut keys, mut values] = shards.map(|s| self.rw.map(s));
        let kv_block = Some(self.layout.block / self.layout.chunks);
        let mut dq: Option<ValueId> = None;
        let mut sums: Option<[ValueId; 2]> = None;
        for round in 0..self.layout.ranks {
            let next = match round + 1 < self.layout.ranks {
                true => Some([self.shift_start(keys)?, self.shift_start(values)?]),
                false => None,
            };
            // The sums so far pass on to the rank that holds their block this round.
            let arriving = match sums {
                Some([k, v]) => Some([self.shift_start(k)?, self.shift_start(v)?]),
                None => None,
            };
            let (mut key_parts, mut value_parts) = (Vec::new(), Vec::new());
            for chunk in 0..self.layout.chunks {
                let (k, v) = (self.chunk(keys, chunk)?, self.chunk(values, chunk)?);
                let starts = self.relative_starts(round, chunk)?;
                let types = vec![dq_type.clone(), self.rw.graph().ty(k).clone(), self.rw.graph().ty(v).clone()];
                let g = self.rw.graph();
                let made = g.add_node_typed(
                    Op::AttentionGrad { scale, mask, kv_block },
                    vec![q, k, v, out, lse, d_out, starts],
                    types,
                );
                let [dq_part, dk, dv] = [0, 1, 2].map(|i| g.node(made).outputs[i]);
                g.value_mut(dq_part).placements = dq_like.clone();
                g.value_mut(dk).placements = shard_like.clone();
                g.value_mut(dv).placements = shard_like.clone();
                let dq_part = self.cast(dq_part, sum_dtype)?;
                dq = Some(match dq {
                    None => dq_part,
                    Some(total) => self.binary(BinaryOp::Add, total, dq_part)?,
                });
                key_parts.push(self.cast(dk, sum_dtype)?);
                value_parts.push(self.cast(dv, sum_dtype)?);
            }
            let parts = [self.join(&key_parts)?, self.join(&value_parts)?];
            sums = Some(match arriving {
                None => parts,
                Some([k, v]) => {
                    let (k, v) = (self.wait(k)?, self.wait(v)?);
                    [self.binary(BinaryOp::Add, k, parts[0])?, self.binary(BinaryOp::Add, v, parts[1])?]
                }
            });
            if let Some([k, v]) = next {
                keys = self.wait(k)?;
                values = self.wait(v)?;
            }
        }
        let [dk, dv] = sums.expect("cp > 1 rounds");
        // One last shift brings each block's sums home.
        let (dk, dv) = (self.shift_start(dk)?, self.shift_start(dv)?);
        let (dk, dv) = (self.wait(dk)?, self.wait(dv)?);
        let dq = self.cast(dq.expect("cp > 1 rounds"), dq_type.dtype)?;
        let [dk, dv] = [(dk, &result_types[0]), (dv, &result_types[1])]
            .map(|(x, t): (ValueId, &TensorType)| self.cast(x, t.dtype));
        Ok([dq, dk?, dv?])
    }
}
