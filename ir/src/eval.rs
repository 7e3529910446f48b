//! The reference evaluator: runs single ops (constant folding) or whole graphs (test oracles)
//! on host tensors with the builtin kernels.

use std::collections::BTreeMap;

use autotp_kernels::{AlignedBuf, Kernel, KernelError};

use crate::{Graph, Op, Tensor, TensorType};

/// Why evaluation failed.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("{op}: {message}")]
    InvalidInputs { op: String, message: String },
    #[error("{op}: {source}")]
    Kernel { op: String, source: KernelError },
    #[error("no value given for {kind} '{name}'")]
    Missing { kind: &'static str, name: String },
    #[error("{kind} '{name}' should be {expected}, got {got}")]
    WrongType { kind: &'static str, name: String, expected: TensorType, got: TensorType },
}

/// Evaluates one op on concrete inputs.
pub fn eval_op(op: &Op, inputs: &[&Tensor], num_outputs: usize) -> Result<Vec<Tensor>, EvalError> {
    let types: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
    let out_types =
        op.infer(&types, num_outputs).map_err(|message| EvalError::InvalidInputs { op: op.name(), message })?;
    run_kernel(op, inputs, &out_types)
}

pub(crate) fn run_kernel(op: &Op, inputs: &[&Tensor], out_types: &[TensorType]) -> Result<Vec<Tensor>, EvalError> {
    match op {
        Op::Constant { value } => return Ok(vec![value.clone()]),
        Op::Collective { .. } => {
            return Err(EvalError::InvalidInputs {
                op: op.name(),
                message: "a collective needs ranks: evaluate the graph with eval_spmd".into(),
            })
        }
        _ => {}
    }
    let types: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
    let out_refs: Vec<&TensorType> = out_types.iter().collect();
    let kernel = crate::lower::kernel_for(op, &types, &out_refs).expect("only constants have no kernel");
    run(op, &kernel, inputs, out_types)
}

/// Runs `kernel` (computing `op`) on concrete inputs.
pub(crate) fn run(
    op: &Op,
    kernel: &Kernel,
    inputs: &[&Tensor],
    out_types: &[TensorType],
) -> Result<Vec<Tensor>, EvalError> {
    let mut bufs: Vec<AlignedBuf> = out_types.iter().map(|t| AlignedBuf::zeroed(t.size_bytes())).collect();
    {
        let ins: Vec<&[u8]> = inputs.iter().map(|t| t.bytes()).collect();
        let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        kernel.run(&ins, &mut outs).map_err(|source| EvalError::Kernel { op: op.name(), source })?;
    }
    Ok(out_types.iter().cloned().zip(bufs).map(|(t, b)| Tensor::from_aligned(t, b)).collect())
}

/// Runs a whole graph. `params` maps parameter and state names to tensors (a state missing from
/// it starts at zero); `inputs` are in graph-input order. Returns the outputs in graph-output
/// order. Updates are not applied: see [`eval_step`].
pub fn eval_graph(
    graph: &Graph,
    params: &BTreeMap<String, Tensor>,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>, EvalError> {
    let mut all = eval_graph_with_updates(graph, params, inputs)?;
    all.truncate(graph.outputs().len());
    Ok(all)
}

/// The outputs, then the updated values in update order.
fn eval_graph_with_updates(
    graph: &Graph,
    params: &BTreeMap<String, Tensor>,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>, EvalError> {
    let mut values: Vec<Option<Tensor>> = vec![None; graph.num_values()];
    let check = |kind: &'static str, name: &str, expected: &TensorType, got: &Tensor| {
        if &got.ty != expected {
            Err(EvalError::WrongType { kind, name: name.into(), expected: expected.clone(), got: got.ty.clone() })
        } else {
            Ok(())
        }
    };
    for (i, &v) in graph.inputs().iter().enumerate() {
        let name = graph.name_of(v).unwrap_or("");
        let t = inputs.get(i).ok_or_else(|| EvalError::Missing { kind: "input", name: name.into() })?;
        check("input", name, graph.ty(v), t)?;
        values[v.index()] = Some(t.clone());
    }
    for &v in graph.params() {
        let name = graph.name_of(v).unwrap_or("");
        let t = params.get(name).ok_or_else(|| EvalError::Missing { kind: "parameter", name: name.into() })?;
        check("parameter", name, graph.ty(v), t)?;
        values[v.index()] = Some(t.clone());
    }
    for &v in graph.states() {
        let name = graph.name_of(v).unwrap_or("");
        let t = params.get(name).cloned().unwrap_or_else(|| Tensor::zeros(graph.ty(v).clone()));
        check("state", name, graph.ty(v), &t)?;
        values[v.index()] = Some(t);
    }
    let mut remaining = graph.use_counts();
    for (_, node) in graph.nodes() {
        let ins: Vec<&Tensor> = node
            .inputs
            .iter()
            .map(|v| values[v.index()].as_ref().expect("verified graphs define before use"))
            .collect();
        let out_types: Vec<TensorType> = node.outputs.iter().map(|&o| graph.ty(o).clone()).collect();
        let outs = run_kernel(&node.op, &ins, &out_types)?;
        for v in &node.inputs {
            remaining[v.index()] -= 1;
            if remaining[v.index()] == 0 {
                values[v.index()] = None;
            }
        }
        for (&o, t) in node.outputs.iter().zip(outs) {
            values[o.index()] = Some(t);
        }
    }
    let value = |v: &crate::ValueId| values[v.index()].clone().expect("outputs and updates are defined");
    Ok(graph.outputs().iter().map(|(_, v)| value(v)).chain(graph.updates().iter().map(|(_, v)| value(v))).collect())
}

/// Runs one step of a graph with updates: returns its outputs and applies its updates to
/// `params` (parameters and states by name).
pub fn eval_step(
    graph: &Graph,
    params: &mut BTreeMap<String, Tensor>,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>, EvalError> {
    let mut all = eval_graph_with_updates(graph, params, inputs)?;
    let updates = all.split_off(graph.outputs().len());
    for ((target, _), t) in graph.updates().iter().zip(updates) {
        params.insert(graph.name_of(*target).unwrap_or("").to_string(), t);
    }
    Ok(all)
}
