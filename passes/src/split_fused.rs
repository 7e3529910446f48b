//! `split-fused`: a fused projection (one weight whose matmul result is read in parts, as
//! GPT-2's `c_attn` gives q, k and v) becomes one projection per part, so that `autotp` can
//! split each part over its own heads. Runs before autodiff, only under tensor parallelism.
//!
//! What reads the parts: one `split` of the output features, or slices and single-index
//! gathers that together cover them (Falcon reshapes to `[b, s, heads + 2, d]` and takes
//! `[..., :-2, :]`, `[..., [-2], :]` and `[..., [-1], :]`), through reshapes that keep the
//! features whole, or through one transpose that moves the features axis (LFM2's gated short
//! convolution transposes its `in_proj` to channels first and chunks it into B, C and x).
//! Elementwise ops of the whole output by scalar constants before the reshapes (DBRX clamps its
//! fused `Wqkv` to `±clip_qkv`) are applied to each part.
//!
//! - **Equal parts** (GPT-2; BigCode with multi-head attention): the parameter keeps its bytes
//!   and is viewed `[in, k, n]` (`[k, n, in]` for an `[out, in]` weight), its bias `[k, n]`;
//!   each part is a slice of the view, and `autotp` splits the view on `n`, so each rank holds
//!   its heads of every part. Plans record the model shape (`TrainingConfig::weight_shapes`).
//! - **Unequal parts** (multi-query and grouped-query attention: Falcon-7B's
//!   `query_key_value`, BigCode's `c_attn`, Phi-3's `qkv_proj`): each part becomes a parameter
//!   of its own, named after its features of the weight ([`part_name`], `W[64:80]`), so the
//!   query part can split over its heads while a single key/value head is replicated. Plans
//!   record how the parts join (`TrainingConfig::weight_parts`); weight files, checkpoints'
//!   manifests and exports keep the model's weight.
//!
//! Layouts that already interleave q, k and v per head (GPT-NeoX, Falcon-40B) are read whole
//! by one reshape and are not matched: they need no split.
//!
//! Tests: tests/golden/split_fused*.ir, tests/parallel.rs.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use autotp_ir::{BinaryOp, Def, Graph, Node, NodeId, Op, Rewriter, TensorType, ValueId};

use crate::{Pass, PassError};

const PASS: &str = "split-fused";

pub struct SplitFused;

/// The name of the parameter holding output features `features` of the fused weight `weight`.
pub fn part_name(weight: &str, features: &Range<usize>) -> String {
    format!("{weight}[{}:{}]", features.start, features.end)
}

/// The weight and the features a part's name names (the inverse of [`part_name`]).
pub fn parse_part_name(name: &str) -> Option<(&str, Range<usize>)> {
    let open = name.strip_suffix(']')?.rfind('[')?;
    let (start, end) = name[open + 1..name.len() - 1].split_once(':')?;
    Some((&name[..open], start.parse().ok()?..end.parse().ok()?))
}

/// A matched fused projection: `readers(reshape*(add?(matmul(x, path(weight)), bias)))`, or
/// `matmul(path(weight), x)` with the weight on the left (a batched-experts export), where
/// the path transposes an `[out, in]` weight or looks up experts' weights by index.
struct Fused {
    matmul: usize,
    weight_on_left: bool,
    /// The nodes from the weight to the matmul's operand, in order.
    path: Vec<usize>,
    /// The weight's dim that holds the output features.
    features_dim: usize,
    add: Option<usize>,
    /// Elementwise ops of the whole output with scalar constants (a clamp), in order.
    elementwise: Vec<usize>,
    reshapes: Vec<usize>,
    /// A transpose after the reshapes, which the readers read: each part is transposed so.
    transpose: Option<usize>,
    readers: Vec<usize>,
    weight: ValueId,
    bias: Option<ValueId>,
    /// The output features each reader's output holds.
    reads: Vec<(ValueId, Range<usize>)>,
    /// The parts, in feature order: they partition the output features.
    parts: Vec<Range<usize>>,
}

impl Fused {
    fn equal_parts(&self) -> bool {
        self.parts.iter().all(|p| p.len() == self.parts[0].len())
    }

    /// The nodes the rewrite replaces.
    fn replaced_nodes(&self) -> impl Iterator<Item = usize> + '_ {
        [self.matmul]
            .into_iter()
            .chain(self.path.iter().copied())
            .chain(self.add)
            .chain(self.elementwise.iter().copied())
            .chain(self.reshapes.iter().copied())
            .chain(self.transpose)
            .chain(self.readers.iter().copied())
    }
}

/// The output features each output of `reader` holds, when it reads whole rows of features:
/// `shape` is the value it reads, whose dims from some axis on hold the `features` features,
/// or whose axis `features_axis` holds them (a transposed projection).
fn read_features(
    graph: &Graph,
    reader: &Node,
    shape: &[usize],
    features: usize,
    features_axis: Option<usize>,
) -> Option<Vec<(ValueId, Range<usize>)>> {
    let unit = |axis: usize| -> Option<usize> {
        if let Some(whole) = features_axis {
            return (axis == whole && shape[axis] == features).then_some(1);
        }
        let inner: usize = shape[axis + 1..].iter().product();
        (shape[axis] * inner == features).then_some(inner)
    };
    match &reader.op {
        Op::Split { axis, sizes } => {
            let unit = unit(*axis)?;
            let mut start = 0;
            let reads = reader.outputs.iter().zip(sizes).map(|(&out, &size)| {
                start += size;
                (out, (start - size) * unit..start * unit)
            });
            Some(reads.collect())
        }
        Op::Slice { starts, ends, steps } => {
            let cut: Vec<usize> =
                (0..shape.len()).filter(|&d| starts[d] != 0 || ends[d] != shape[d] as i64 || steps[d] != 1).collect();
            let [axis] = cut[..] else { return None };
            let (start, end) = (starts[axis], usize::try_from(ends[axis]).ok()?);
            let unit = unit(axis)?;
            (steps[axis] == 1 && start < end).then(|| vec![(reader.outputs[0], start * unit..end * unit)])
        }
        Op::Gather { axis } => {
            let unit = unit(*axis)?;
            let Def::Node(index_node, 0) = graph.value(reader.inputs[1]).def else { return None };
            let Op::Constant { value } = &graph.node(index_node).op else { return None };
            if value.numel() != 1 || reader.inputs[0] == reader.inputs[1] {
                return None;
            }
            let index = value.get_i64(0);
            let index = usize::try_from(if index < 0 { index + shape[*axis] as i64 } else { index }).ok()?;
            (index < shape[*axis]).then(|| vec![(reader.outputs[0], index * unit..(index + 1) * unit)])
        }
        _ => None,
    }
}

/// The parameter `operand` is made from, through a transpose of an `[out, in]` weight or a
/// lookup of experts' weights by index, each read by nothing else; and that path's nodes from
/// the parameter on.
fn weight_path(graph: &Graph, operand: ValueId, uses: &[usize]) -> Option<(ValueId, Vec<usize>)> {
    let mut v = operand;
    let mut path = Vec::new();
    while !graph.params().contains(&v) {
        let Def::Node(n, 0) = graph.value(v).def else { return None };
        let node = graph.node(n);
        let follows = match &node.op {
            Op::Transpose { perm } => perm[..] == [1, 0],
            Op::Gather { axis: 0 } => node.inputs[0] != node.inputs[1],
            _ => false,
        };
        if !follows || uses[v.index()] != 1 || path.len() == 2 {
            return None;
        }
        path.insert(0, n.index());
        v = node.inputs[0];
    }
    (uses[v.index()] == 1).then_some((v, path))
}

/// Whether `v` is a constant of one element.
fn is_scalar_constant(graph: &Graph, v: ValueId) -> bool {
    matches!(graph.value(v).def, Def::Node(n, _) if matches!(graph.node(n).op, Op::Constant { .. }))
        && graph.ty(v).numel() == 1
}

fn find_fused(graph: &Graph) -> Vec<Fused> {
    let nodes: Vec<&Node> = graph.nodes().map(|(_, n)| n).collect();
    let uses = graph.use_counts();
    let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); graph.num_values()];
    for (i, node) in nodes.iter().enumerate() {
        for &v in node.inputs.iter().collect::<BTreeSet<_>>() {
            consumers[v.index()].push(i);
        }
    }
    let is_param = |v: ValueId| graph.params().contains(&v);
    let mut found = Vec::new();
    for (m, node) in nodes.iter().enumerate() {
        let Op::MatMul { transpose_lhs: false, transpose_rhs: false } = node.op else { continue };
        let out = &graph.ty(node.outputs[0]).shape;
        // x @ W (features last), else W @ x with W's rows the features and x one column.
        let (weight_on_left, (weight, path)) = match weight_path(graph, node.inputs[1], &uses) {
            Some(found) => (false, found),
            None if out.last() == Some(&1) => match weight_path(graph, node.inputs[0], &uses) {
                Some(found) => (true, found),
                None => continue,
            },
            None => continue,
        };
        let operand = node.inputs[usize::from(!weight_on_left)];
        let operand_rank = graph.ty(operand).rank();
        let operand_features = if weight_on_left { operand_rank - 2 } else { operand_rank - 1 };
        let Some((_, features_dim)) = crate::autotp::trace_param(graph, operand, operand_features) else { continue };
        let features = graph.ty(operand).shape[operand_features];
        // Forward through the bias, reshapes and a transpose, each the only reader of what it
        // reads.
        let (mut v, mut add, mut bias, mut reshapes) = (node.outputs[0], None, None, Vec::new());
        let mut elementwise = Vec::new();
        let (mut transpose, mut features_axis) = (None, None);
        while let ([c], 1) = (&consumers[v.index()][..], uses[v.index()]) {
            if transpose.is_some() {
                break;
            }
            match &nodes[*c].op {
                // The bias, before any elementwise op (each part adds its bias first).
                Op::Binary(BinaryOp::Add) if add.is_none() && elementwise.is_empty() && reshapes.is_empty() => {
                    let other = if nodes[*c].inputs[0] == v { nodes[*c].inputs[1] } else { nodes[*c].inputs[0] };
                    if !is_param(other) || graph.ty(other).shape != [features] || uses[other.index()] != 1 {
                        break;
                    }
                    (add, bias) = (Some(*c), Some(other));
                }
                Op::Unary(_) | Op::Binary(_)
                    if reshapes.is_empty()
                        && graph.ty(nodes[*c].outputs[0]) == graph.ty(v)
                        && nodes[*c].inputs.iter().all(|&i| i == v || is_scalar_constant(graph, i)) =>
                {
                    elementwise.push(*c)
                }
                Op::Reshape { .. } => reshapes.push(*c),
                // Only while the features are still the last axis, whole.
                Op::Transpose { perm } if graph.ty(v).shape.last() == Some(&features) => {
                    transpose = Some(*c);
                    features_axis = perm.iter().position(|&a| a == perm.len() - 1);
                }
                _ => break,
            }
            v = nodes[*c].outputs[0];
        }
        if uses[v.index()] != consumers[v.index()].len() {
            continue;
        }
        let shape = &graph.ty(v).shape;
        let mut reads = Vec::new();
        let readers = consumers[v.index()].clone();
        let all_read = readers.iter().all(|&r| match read_features(graph, nodes[r], shape, features, features_axis) {
            Some(list) => {
                reads.extend(list);
                true
            }
            None => false,
        });
        let parts: Vec<Range<usize>> = reads
            .iter()
            .map(|(_, r)| (r.start, r.end))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(|(start, end)| start..end)
            .collect();
        let partition = parts.first().is_some_and(|p| p.start == 0)
            && parts.last().is_some_and(|p| p.end == features)
            && parts.windows(2).all(|w| w[0].end == w[1].start);
        if all_read && partition && parts.len() >= 2 {
            found.push(Fused {
                matmul: m,
                weight_on_left,
                path,
                features_dim,
                add,
                elementwise,
                reshapes,
                transpose,
                readers,
                weight,
                bias,
                reads,
                parts,
            });
        }
    }
    found
}

impl Pass for SplitFused {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let fused = find_fused(graph);
        if fused.is_empty() {
            return Ok(());
        }
        // Equal parts: the same parameters, viewed with a parts dim.
        let mut source = graph.clone();
        for f in fused.iter().filter(|f| f.equal_parts()) {
            let (k, n) = (f.parts.len(), f.parts[0].len());
            let shape = &mut source.value_mut(f.weight).ty.shape;
            shape.splice(f.features_dim..=f.features_dim, [k, n]);
            if let Some(b) = f.bias {
                source.value_mut(b).ty.shape = vec![k, n];
            }
        }
        // Unequal parts: a parameter per part.
        let mut replace = BTreeMap::new();
        for f in fused.iter().filter(|f| !f.equal_parts()) {
            let w = source.ty(f.weight).clone();
            for (param, dim) in [(f.weight, f.features_dim)].into_iter().chain(f.bias.map(|b| (b, 0))) {
                let name = source.name_of(param).unwrap_or("").to_string();
                let parts = f
                    .parts
                    .iter()
                    .map(|p| {
                        let mut shape = source.ty(param).shape.clone();
                        shape[dim] = p.len();
                        (part_name(&name, p), TensorType::new(w.dtype, shape))
                    })
                    .collect();
                replace.insert(param, parts);
            }
        }
        let skip: BTreeSet<usize> = fused.iter().flat_map(Fused::replaced_nodes).collect();
        let at_reader: BTreeMap<usize, &Fused> =
            fused.iter().map(|f| (*f.readers.iter().min().expect("readers"), f)).collect();
        let (mut rw, part_params) = Rewriter::replacing_params(&source, |_| true, &replace);
        for (id, _) in source.nodes() {
            if let Some(f) = at_reader.get(&id.index()) {
                rewrite(&mut rw, &source, f, &part_params)?;
            } else if !skip.contains(&id.index()) {
                rw.copy_node(id);
            }
        }
        // The gathers' constant indices read nothing else now.
        *graph = rw.finish().without_dead_code();
        Ok(())
    }
}

/// Emits one projection per part of `f` and makes each reader's output a reshape of its part.
fn rewrite(
    rw: &mut Rewriter<'_>,
    source: &Graph,
    f: &Fused,
    part_params: &BTreeMap<ValueId, Vec<ValueId>>,
) -> Result<(), PassError> {
    let x = rw.map(source.node(NodeId(f.matmul as u32)).inputs[usize::from(f.weight_on_left)]);
    let mut projections = Vec::new();
    for j in 0..f.parts.len() {
        // Part j of a parameter: its own parameter, or a slice of the parameter's view.
        let part_of = |rw: &mut Rewriter<'_>, param: ValueId, axis: usize| -> Result<ValueId, PassError> {
            if let Some(parts) = part_params.get(&param) {
                return Ok(parts[j]);
            }
            let view = rw.map(param);
            let g = rw.graph();
            let shape = g.ty(view).shape.clone();
            let mut starts = vec![0; shape.len()];
            let mut ends: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            starts[axis] = j;
            ends[axis] = j as i64 + 1;
            let sliced = add(g, Op::Slice { starts, ends, steps: vec![1; shape.len()] }, vec![view])?;
            let kept = shape.iter().enumerate().filter(|&(d, _)| d != axis).map(|(_, &s)| s).collect();
            add(g, Op::Reshape { shape: kept }, vec![sliced])
        };
        let mut weight = part_of(rw, f.weight, f.features_dim)?;
        for &p in &f.path {
            let node = source.node(NodeId(p as u32));
            let inputs = [weight].into_iter().chain(node.inputs[1..].iter().map(|&i| rw.map(i))).collect();
            weight = add(rw.graph(), node.op.clone(), inputs)?;
        }
        let operands = if f.weight_on_left { vec![weight, x] } else { vec![x, weight] };
        let g = rw.graph();
        let mut y = add(g, Op::MatMul { transpose_lhs: false, transpose_rhs: false }, operands)?;
        if let Some(b) = f.bias {
            let b = part_of(rw, b, 0)?;
            y = add(rw.graph(), Op::Binary(BinaryOp::Add), vec![y, b])?;
        }
        for &e in &f.elementwise {
            let node = source.node(NodeId(e as u32));
            // Every input but the fused output is a scalar constant.
            let inputs =
                node.inputs.iter().map(|&i| if is_scalar_constant(source, i) { rw.map(i) } else { y }).collect();
            y = add(rw.graph(), node.op.clone(), inputs)?;
        }
        if let Some(t) = f.transpose {
            y = add(rw.graph(), source.node(NodeId(t as u32)).op.clone(), vec![y])?;
        }
        projections.push(y);
    }
    for (out, features) in &f.reads {
        let j = f.parts.iter().position(|p| p == features).expect("a read is a part");
        let g = rw.graph();
        let target = source.ty(*out).shape.clone();
        let y = if g.ty(projections[j]).shape == target {
            projections[j]
        } else {
            add(g, Op::Reshape { shape: target }, vec![projections[j]])?
        };
        rw.set(*out, y);
    }
    Ok(())
}

fn add(g: &mut Graph, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
    crate::add_op(PASS, g, op, inputs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_names_round_trip() {
        let name = part_name("h.0.attn.c_attn.weight", &(64..80));
        assert_eq!(name, "h.0.attn.c_attn.weight[64:80]");
        assert_eq!(parse_part_name(&name), Some(("h.0.attn.c_attn.weight", 64..80)));
        assert_eq!(parse_part_name("h.0.attn.c_attn.weight"), None);
        assert_eq!(parse_part_name("w[a:3]"), None);
    }
}
