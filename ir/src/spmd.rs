//! The SPMD reference evaluator: runs a graph over its mesh with every rank in one process, as
//! the test oracle for the sharding passes. Each rank holds its local shards; each op runs per
//! rank with the same kernel as on one device, on the rank's local types; a collective combines
//! the ranks of its mesh axis. Comparing [`eval_spmd_step`] with [`crate::eval::eval_step`] on the
//! unsharded graph checks that a sharded training step computes what the single-device one does.

use std::collections::BTreeMap;

use crate::eval::{run, run_kernel, EvalError};
use crate::sharding::local_type;
use crate::{BinaryOp, Collective, Graph, Mesh, Op, Placement, Tensor, TensorType};

/// Rank `r`'s coordinate on every mesh axis (row-major: the last axis varies fastest).
pub fn coordinates(mesh: &Mesh, mut rank: usize) -> Vec<usize> {
    let mut coords = vec![0; mesh.axes.len()];
    for (a, axis) in mesh.axes.iter().enumerate().rev() {
        coords[a] = rank % axis.size;
        rank /= axis.size;
    }
    coords
}

pub fn world_size(mesh: &Mesh) -> usize {
    mesh.axes.iter().map(|a| a.size).product()
}

/// Where a rank's block of a value starts in the global tensor, per dim. Axes sharding the same
/// dim nest in mesh-axis order (the first such axis cuts the biggest blocks).
pub fn block_offsets(mesh: &Mesh, shape: &[usize], placements: &[Placement], coords: &[usize]) -> Vec<usize> {
    autotp_kernels::shape::shard_block(shape, &cuts(mesh, placements, coords)).0
}

/// The `(dim, parts, index)` cuts of a value's placements for a rank at `coords`.
pub fn cuts(mesh: &Mesh, placements: &[Placement], coords: &[usize]) -> Vec<(usize, usize, usize)> {
    mesh.axes
        .iter()
        .zip(placements)
        .zip(coords)
        .filter_map(|((axis, p), &c)| match p {
            Placement::Shard(d) => Some((*d, axis.size, c)),
            _ => None,
        })
        .collect()
}

fn kernel_op(op: Op, inputs: &[&Tensor], out: TensorType) -> Result<Tensor, EvalError> {
    Ok(run_kernel(&op, inputs, &[out])?.remove(0))
}

/// The slice `[offsets, offsets + shape)` of `t`.
fn block(t: &Tensor, offsets: &[usize], shape: &[usize]) -> Result<Tensor, EvalError> {
    let op = Op::Slice {
        starts: offsets.to_vec(),
        ends: offsets.iter().zip(shape).map(|(o, s)| (o + s) as i64).collect(),
        steps: vec![1; shape.len()],
    };
    kernel_op(op, &[t], TensorType::new(t.dtype(), shape.to_vec()))
}

/// A rank's local shard of a global tensor.
fn shard_of(mesh: &Mesh, t: &Tensor, placements: &[Placement], coords: &[usize]) -> Result<Tensor, EvalError> {
    let local = local_type(mesh, &t.ty, placements);
    block(t, &block_offsets(mesh, &t.ty.shape, placements, coords), &local.shape)
}

/// The global value of a sharded value from every rank's local tensor: each distinct block once,
/// partial sums summed.
fn assemble(mesh: &Mesh, ty: &TensorType, placements: &[Placement], locals: &[Tensor]) -> Result<Tensor, EvalError> {
    let mut total: Option<Tensor> = None;
    for (rank, local) in locals.iter().enumerate() {
        let coords = coordinates(mesh, rank);
        if placements.iter().zip(&coords).any(|(p, &c)| *p == Placement::Replicate && c != 0) {
            continue;
        }
        let begin = block_offsets(mesh, &ty.shape, placements, &coords);
        let end: Vec<usize> = (0..ty.rank()).map(|d| ty.shape[d] - begin[d] - local.ty.shape[d]).collect();
        let padded = kernel_op(Op::Pad { begin, end, value: 0.0 }, &[local], ty.clone())?;
        total = Some(match total {
            Some(t) => kernel_op(Op::Binary(BinaryOp::Add), &[&t, &padded], ty.clone())?,
            None => padded,
        });
    }
    Ok(total.unwrap_or_else(|| Tensor::zeros(ty.clone())))
}

/// Runs a collective for every group of ranks along `axis`.
fn collective(
    mesh: &Mesh,
    kind: Collective,
    axis: usize,
    ty: &TensorType,
    from: &[Placement],
    to: &[Placement],
    locals: &[&Tensor],
) -> Result<Vec<Tensor>, EvalError> {
    let size = mesh.axes[axis].size;
    let out_type = local_type(mesh, ty, to);
    let mut results: Vec<Option<Tensor>> = vec![None; locals.len()];
    for rank in 0..locals.len() {
        let coords = coordinates(mesh, rank);
        if coords[axis] != 0 {
            continue;
        }
        // The group: this rank and those differing from it only along `axis`, in axis order.
        let stride: usize = mesh.axes[axis + 1..].iter().map(|a| a.size).product();
        let group: Vec<usize> = (0..size).map(|c| rank + c * stride).collect();
        let members: Vec<&Tensor> = group.iter().map(|&r| locals[r]).collect();
        let in_type = local_type(mesh, ty, from);
        match kind {
            Collective::AllReduce | Collective::ReduceScatter { .. } => {
                let mut sum = members[0].clone();
                for m in &members[1..] {
                    sum = kernel_op(Op::Binary(BinaryOp::Add), &[&sum, m], in_type.clone())?;
                }
                for (c, &r) in group.iter().enumerate() {
                    results[r] = Some(match kind {
                        Collective::ReduceScatter { dim } => {
                            let mut offsets = vec![0; ty.rank()];
                            offsets[dim] = c * out_type.shape[dim];
                            block(&sum, &offsets, &out_type.shape)?
                        }
                        _ => sum.clone(),
                    });
                }
            }
            Collective::AllGather { dim } => {
                let gathered = kernel_op(Op::Concat { axis: dim }, &members, out_type.clone())?;
                for &r in &group {
                    results[r] = Some(gathered.clone());
                }
            }
            Collective::AllToAll { split, concat } => {
                // Member c gets piece c (along `split`) of every member's block, in order.
                let mut piece = in_type.shape.clone();
                piece[split] /= size;
                for (c, &r) in group.iter().enumerate() {
                    let mut offsets = vec![0; ty.rank()];
                    offsets[split] = c * piece[split];
                    let pieces = members.iter().map(|m| block(m, &offsets, &piece)).collect::<Result<Vec<_>, _>>()?;
                    let pieces: Vec<&Tensor> = pieces.iter().collect();
                    results[r] = Some(kernel_op(Op::Concat { axis: concat }, &pieces, out_type.clone())?);
                }
            }
            Collective::RingShift { .. } => {
                for (c, &r) in group.iter().enumerate() {
                    results[r] = Some(members[(c + size - 1) % size].clone());
                }
            }
            Collective::ShardSlice { dim } => {
                for (c, &r) in group.iter().enumerate() {
                    let mut offsets = vec![0; ty.rank()];
                    offsets[dim] = c * out_type.shape[dim];
                    results[r] = Some(block(locals[r], &offsets, &out_type.shape)?);
                }
            }
        }
    }
    Ok(results.into_iter().map(|t| t.expect("every rank is in one group")).collect())
}

/// Runs one step of a graph over its mesh. `params` (parameters and states, global, by name;
/// a missing state starts at zero) and `inputs` (global, in graph-input order) are sharded by
/// their placements. Returns the outputs (replicated) and applies the updates to `params`,
/// reassembled to global tensors.
pub fn eval_spmd_step(
    graph: &Graph,
    params: &mut BTreeMap<String, Tensor>,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>, EvalError> {
    let mesh = &graph.mesh;
    let world = world_size(mesh);
    let placements = |v: crate::ValueId| graph.value(v).placements.as_slice();
    let mut values: Vec<Vec<Option<Tensor>>> = vec![vec![None; graph.num_values()]; world];
    let mut globals: Vec<(crate::ValueId, Tensor)> = Vec::new();
    for (i, &v) in graph.inputs().iter().enumerate() {
        let name = graph.name_of(v).unwrap_or("");
        let t = inputs.get(i).ok_or_else(|| EvalError::Missing { kind: "input", name: name.into() })?;
        globals.push((v, t.clone()));
    }
    for &v in graph.params().iter().chain(graph.states()) {
        let name = graph.name_of(v).unwrap_or("");
        let t = match params.get(name) {
            Some(t) => t.clone(),
            None if graph.states().contains(&v) => Tensor::zeros(graph.ty(v).clone()),
            None => return Err(EvalError::Missing { kind: "parameter", name: name.into() }),
        };
        globals.push((v, t));
    }
    for (v, t) in &globals {
        if &t.ty != graph.ty(*v) {
            let name = graph.name_of(*v).unwrap_or("").to_string();
            return Err(EvalError::WrongType {
                kind: "value",
                name,
                expected: graph.ty(*v).clone(),
                got: t.ty.clone(),
            });
        }
        if placements(*v).contains(&Placement::PartialSum) {
            let name = graph.name_of(*v).unwrap_or("");
            return Err(EvalError::InvalidInputs {
                op: name.into(),
                message: "a graph input cannot be a partial sum".into(),
            });
        }
        for (rank, rank_values) in values.iter_mut().enumerate() {
            rank_values[v.index()] = Some(shard_of(mesh, t, placements(*v), &coordinates(mesh, rank))?);
        }
    }
    for (_, node) in graph.nodes() {
        let locals: Vec<Vec<Tensor>> = match &node.op {
            Op::Collective { kind, axis, .. } => {
                let a = mesh.axes.iter().position(|x| &x.name == axis).ok_or_else(|| EvalError::InvalidInputs {
                    op: node.op.name(),
                    message: format!("unknown mesh axis '{axis}'"),
                })?;
                let (x, y) = (node.inputs[0], node.outputs[0]);
                let ins: Vec<&Tensor> = values.iter().map(|r| r[x.index()].as_ref().expect("defined")).collect();
                collective(mesh, *kind, a, graph.ty(x), placements(x), placements(y), &ins)?
                    .into_iter()
                    .map(|t| vec![t])
                    .collect()
            }
            op => {
                let out_types: Vec<TensorType> =
                    node.outputs.iter().map(|&o| local_type(mesh, graph.ty(o), placements(o))).collect();
                let kernel = crate::lower::node_kernel(graph, node);
                let mut locals = Vec::with_capacity(world);
                for (rank, rank_values) in values.iter().enumerate() {
                    let ins: Vec<&Tensor> =
                        node.inputs.iter().map(|v| rank_values[v.index()].as_ref().expect("defined")).collect();
                    locals.push(match &kernel {
                        Some(kernel) => {
                            let mut kernel = kernel.clone();
                            kernel.place_blocks(&coordinates(mesh, rank));
                            run(op, &kernel, &ins, &out_types)?
                        }
                        None => run_kernel(op, &ins, &out_types)?,
                    });
                }
                locals
            }
        };
        for (rank_values, outs) in values.iter_mut().zip(locals) {
            for (&o, t) in node.outputs.iter().zip(outs) {
                rank_values[o.index()] = Some(t);
            }
        }
    }
    let outputs = graph.outputs().iter().map(|(_, v)| values[0][v.index()].clone().expect("defined")).collect();
    let mut updated = Vec::new();
    for (target, v) in graph.updates() {
        let locals: Vec<Tensor> = values.iter().map(|r| r[v.index()].clone().expect("defined")).collect();
        updated.push((*target, assemble(mesh, graph.ty(*v), placements(*v), &locals)?));
    }
    for (target, t) in updated {
        params.insert(graph.name_of(target).unwrap_or("").to_string(), t);
    }
    Ok(outputs)
}
