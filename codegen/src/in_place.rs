//! Operands that kernels read where another value lies, so the ops that would copy them make
//! nothing:
//!
//! - a transpose that only matmuls read: they read its input through strides
//!   ([`strided_operands`]);
//! - a mixture of experts' lookup of its experts' matrices, `gather(W, ids)`, that only
//!   batched matmuls read, and the per-pair outer products that only a `scatter_add(ids, ..)`
//!   sums: the grouped expert GEMM ([`autotp_kernels::grouped`]) reads `W` in place and sums
//!   the products where they are made ([`grouped_products`]). The gather's copy (a matrix per
//!   pair) and the `[pairs, rows, cols]` products never exist, and the pairs whose vectors are
//!   zeros (expert parallelism's padding) cost nothing.

use std::collections::{HashMap, HashSet};

use autotp_ir::{Def, Graph, NodeId, Op, ValueId};
use autotp_kernels::grouped::{GroupedDims, GroupedForm};
use autotp_kernels::{Kernel, MatMulDims, OperandLayout};

use crate::local;

/// The transposes (by their values) that matmuls read in place through strides, with the
/// layout they read: a transpose outside fusion groups whose value only matmuls read.
pub(crate) fn strided_operands(graph: &Graph) -> HashMap<ValueId, OperandLayout> {
    let mut read_otherwise = results(graph);
    for (_, node) in graph.nodes() {
        if !matches!(node.op, Op::MatMul { .. }) {
            for v in &node.inputs {
                read_otherwise[v.index()] = true;
            }
        }
    }
    let fused = fused_nodes(graph);
    let mut layouts = HashMap::new();
    for (_, node) in graph.nodes() {
        if !matches!(node.op, Op::MatMul { .. }) {
            continue;
        }
        for &v in &node.inputs {
            let Def::Node(t, _) = graph.value(v).def else { continue };
            let Op::Transpose { perm } = &graph.node(t).op else { continue };
            if read_otherwise[v.index()] || fused.contains(&t.index()) {
                continue;
            }
            let stored = local(graph, graph.node(t).inputs[0]).shape;
            let shape = local(graph, v).shape;
            let stored_strides = autotp_kernels::shape::strides(&stored);
            let stride = |j: usize| stored_strides[perm[j]];
            let rank = perm.len();
            // The operand's own batch dims; each matmul reading it pads them to its batch rank
            // ([`at_batch_rank`]), as two matmuls of other ranks may read one transpose.
            let batch = (0..rank - 2).map(|j| if shape[j] == 1 { 0 } else { stride(j) }).collect();
            layouts.insert(v, OperandLayout { batch, rows: stride(rank - 2), cols: stride(rank - 1) });
        }
    }
    layouts
}

/// `layout` read by a matmul of `batch_rank` batch dims: the operand's batch dims are the
/// output's last ones (numpy broadcasting), the leading ones broadcast (stride 0).
pub(crate) fn at_batch_rank(layout: &OperandLayout, batch_rank: usize) -> OperandLayout {
    let mut batch = vec![0; batch_rank.saturating_sub(layout.batch.len())];
    batch.extend(&layout.batch);
    OperandLayout { batch, ..layout.clone() }
}

/// By value: whether it is a graph output, an update or an updated value (read after the step).
fn results(graph: &Graph) -> Vec<bool> {
    let mut result = vec![false; graph.num_values()];
    for v in graph.outputs().iter().map(|(_, v)| v).chain(graph.updates().iter().flat_map(|(t, v)| [t, v])) {
        result[v.index()] = true;
    }
    result
}

/// The nodes inside fusion groups, by index.
fn fused_nodes(graph: &Graph) -> HashSet<usize> {
    graph.fusions().iter().flat_map(|f| f.nodes.clone()).collect()
}

/// The grouped expert GEMMs of a graph: the nodes whose instruction is one, and the nodes whose
/// work they do.
#[derive(Default)]
pub(crate) struct GroupedProducts {
    /// By the node that runs it (a matmul reading a gathered table, or a scatter-add of
    /// products): the kernel and the values it reads.
    pub kernels: HashMap<NodeId, (Kernel, Vec<ValueId>)>,
    /// The gathers and matmuls that make nothing: a grouped GEMM does their work.
    pub absorbed: HashSet<NodeId>,
}

/// A batched matmul's geometry when it is a product per pair (`[pairs, ..]` operands, one
/// batch dim) that a grouped GEMM of `form` computes.
fn pair_dims(graph: &Graph, node: &autotp_ir::Node, form: GroupedForm) -> Option<(autotp_kernels::DType, MatMulDims)> {
    let Some(Kernel::MatMul { dtype, dims }) = autotp_ir::lower::node_kernel(graph, node) else { return None };
    let grouped = GroupedDims { pair: dims.clone(), form, experts: 0, block: None };
    (dtype.is_float() && grouped.is_valid()).then_some((dtype, dims))
}

/// Finds the grouped expert GEMMs (see the module doc): gathers along dim 0 of a 3-D table
/// by 1-D ids, outside fusion groups, whose every reader is a per-pair matmul with a vector on
/// the pairs' side; and scatter-adds along dim 0 whose updates only they read, made by such a
/// matmul of outer products. `layouts` are the strided operands, which a grouped GEMM does not
/// read.
pub(crate) fn grouped_products(graph: &Graph, layouts: &HashMap<ValueId, OperandLayout>) -> GroupedProducts {
    let consumers = graph.consumers();
    let read_otherwise = results(graph);
    let fused = fused_nodes(graph);
    let free = |n: NodeId| !fused.contains(&n.index());
    let mut grouped = GroupedProducts::default();
    for (id, node) in graph.nodes() {
        let Op::Gather { axis: 0 } = node.op else { continue };
        let (table, ids, gathered) = (node.inputs[0], node.inputs[1], node.outputs[0]);
        let Some(Kernel::Gather { index_dtype, data, block, .. }) = autotp_ir::lower::node_kernel(graph, node) else {
            continue;
        };
        let readers = &consumers[gathered.index()];
        if !free(id) || data.len() != 3 || local(graph, ids).shape.len() != 1 || read_otherwise[gathered.index()] {
            continue;
        }
        let products: Option<Vec<(NodeId, Kernel, Vec<ValueId>)>> = (readers.iter())
            .map(|&m| {
                let reader = graph.node(m);
                if !matches!(reader.op, Op::MatMul { .. }) {
                    return None;
                }
                let side = reader.inputs.iter().position(|&v| v == gathered)?;
                let other = reader.inputs[1 - side];
                let form = if side == 0 { GroupedForm::GatheredLhs } else { GroupedForm::GatheredRhs };
                if !free(m) || other == gathered || layouts.contains_key(&other) {
                    return None;
                }
                let (dtype, pair) = pair_dims(graph, reader, form)?;
                let dims = GroupedDims { pair, form, experts: data[0], block };
                Some((m, Kernel::GroupedMatMul { dtype, index_dtype, dims: Box::new(dims) }, vec![table, ids, other]))
            })
            .collect();
        let Some(products) = products.filter(|p| !p.is_empty()) else { continue };
        grouped.absorbed.insert(id);
        for (m, kernel, inputs) in products {
            grouped.kernels.insert(m, (kernel, inputs));
        }
    }
    for (id, node) in graph.nodes() {
        let Op::ScatterAdd { axis: 0, .. } = node.op else { continue };
        let (ids, updates) = (node.inputs[0], node.inputs[1]);
        let Def::Node(product, _) = graph.value(updates).def else { continue };
        let Some(Kernel::ScatterAdd { index_dtype, out, block, .. }) = autotp_ir::lower::node_kernel(graph, node)
        else {
            continue;
        };
        let matmul = graph.node(product);
        let sole_reader = consumers[updates.index()] == [id] && !read_otherwise[updates.index()];
        let absorbed_operand = |v: &ValueId| {
            layouts.contains_key(v) || matches!(graph.value(*v).def, Def::Node(n, _) if grouped.absorbed.contains(&n))
        };
        if !matches!(matmul.op, Op::MatMul { .. })
            || !free(id)
            || !free(product)
            || !sole_reader
            || out.len() != 3
            || local(graph, ids).shape.len() != 1
            || grouped.kernels.contains_key(&product)
            || matmul.inputs.iter().any(absorbed_operand)
        {
            continue;
        }
        let Some((dtype, pair)) = pair_dims(graph, matmul, GroupedForm::Scattered) else { continue };
        let dims = GroupedDims { pair, form: GroupedForm::Scattered, experts: out[0], block };
        let inputs = vec![ids, matmul.inputs[0], matmul.inputs[1]];
        grouped.absorbed.insert(product);
        grouped.kernels.insert(id, (Kernel::GroupedMatMul { dtype, index_dtype, dims: Box::new(dims) }, inputs));
    }
    grouped
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grouped kernels of a graph, by form, and how many gathers of a 3-D table remain.
    fn lowered(text: &str) -> (Vec<GroupedForm>, usize) {
        let graph = autotp_ir::text::parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let options = crate::LowerOptions { grouped_experts: true, ..Default::default() };
        let program = crate::lower_with(&graph, &options).unwrap();
        let mut forms = Vec::new();
        let mut gathers = 0;
        for instruction in &program.instructions {
            match instruction {
                autotp_program::Instruction::Kernel { kernel: Kernel::GroupedMatMul { dims, .. }, .. } => {
                    forms.push(dims.form)
                }
                autotp_program::Instruction::Kernel { kernel: Kernel::Gather { data, .. }, .. } => {
                    gathers += usize::from(data.len() == 3)
                }
                _ => {}
            }
        }
        (forms, gathers)
    }

    const EXPERTS: &str = "graph \"experts\" {
  input %ids : i64[6]
  input %x : f32[6,4,1]
  input %dy : f32[6,2,1]
  param %w : f32[3,2,4]
  %g = gather %w, %ids {axis = 0} : f32[6,2,4]
  %y = matmul %g, %x : f32[6,2,1]
  %dx = matmul %g, %dy {transpose_lhs = true} : f32[6,4,1]
  %p = matmul %dy, %x {transpose_rhs = true} : f32[6,2,4]
  %dw = scatter_add %ids, %p {axis = 0, size = 3} : f32[3,2,4]
  output \"y\" = %y
  output \"dx\" = %dx
  output \"dw\" = %dw
}
";

    /// A lookup read by matmuls alone, and the outer products only a scatter-add reads, become
    /// grouped GEMMs and no gather of the table remains; a lookup that another op also reads
    /// (an elementwise op, a select of three inputs) stays a gather, read by batched matmuls.
    #[test]
    fn lookups_read_by_matmuls_alone_become_grouped_gemms() {
        let (forms, gathers) = lowered(EXPERTS);
        assert_eq!(forms, [GroupedForm::GatheredLhs, GroupedForm::GatheredLhs, GroupedForm::Scattered]);
        assert_eq!(gathers, 0);
        for other in ["%n = neg %g : f32[6,2,4]", "%n = select %c, %z, %g : f32[6,2,4]"] {
            let text = EXPERTS
                .replace("  param %w", "  input %c : bool[6,2,4]\n  input %z : f32[6,2,4]\n  param %w")
                .replace("  output \"y\"", &format!("  {other}\n  output \"n\" = %n\n  output \"y\""));
            let (forms, gathers) = lowered(&text);
            assert_eq!((forms, gathers), (vec![GroupedForm::Scattered], 1), "{other}");
        }
    }
}
