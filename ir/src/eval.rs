//! The reference evaluator: runs single ops (constant folding) or whole graphs (test oracles)
//! on host tensors with the builtin kernels; [`eval_pipeline_step`] runs a pipeline's stage
//! graphs together, passing their sends to their receives.

use std::collections::{BTreeMap, VecDeque};

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
    #[error("pipeline: {0}")]
    Pipeline(String),
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
        Op::Send { .. } | Op::Recv { .. } => {
            return Err(EvalError::InvalidInputs {
                op: op.name(),
                message: "pipeline communication: evaluate the stages with eval_pipeline_step".into(),
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
    let mut frame = Frame::new(graph, params, inputs)?;
    if !frame.run(0, &mut Mailboxes::new())? {
        return Err(EvalError::Pipeline("a recv in a graph evaluated on its own: nothing was sent".into()));
    }
    Ok(frame.finish())
}

/// Messages between pipeline stages in flight: (from, to) -> (tag, value) in send order.
type Mailboxes = BTreeMap<(usize, usize), VecDeque<(u64, Tensor)>>;

/// One graph's evaluation in progress: its live values and the next node to run.
struct Frame<'g> {
    graph: &'g Graph,
    nodes: Vec<&'g crate::Node>,
    values: Vec<Option<Tensor>>,
    remaining: Vec<usize>,
    next: usize,
}

impl<'g> Frame<'g> {
    fn new(graph: &'g Graph, params: &BTreeMap<String, Tensor>, inputs: &[Tensor]) -> Result<Frame<'g>, EvalError> {
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
        let nodes = graph.nodes().map(|(_, n)| n).collect();
        Ok(Frame { graph, nodes, values, remaining: graph.use_counts(), next: 0 })
    }

    /// Runs nodes as stage `stage` until the end (true) or a `recv` whose message has not been
    /// sent yet (false); sends go into `mail`.
    fn run(&mut self, stage: usize, mail: &mut Mailboxes) -> Result<bool, EvalError> {
        while let Some(node) = self.nodes.get(self.next) {
            let outs = match &node.op {
                Op::Recv { from, tag, ty, .. } => {
                    let Some((sent, value)) = mail.get_mut(&(*from, stage)).and_then(VecDeque::pop_front) else {
                        return Ok(false);
                    };
                    if sent != *tag || &value.ty != ty {
                        return Err(EvalError::Pipeline(format!(
                            "stage {stage} expects tag {tag} ({ty}) from stage {from}, which sent tag {sent} ({})",
                            value.ty
                        )));
                    }
                    vec![value]
                }
                _ => {
                    let ins: Vec<&Tensor> = node
                        .inputs
                        .iter()
                        .map(|v| self.values[v.index()].as_ref().expect("verified graphs define before use"))
                        .collect();
                    if let Op::Send { to, tag, .. } = node.op {
                        mail.entry((stage, to)).or_default().push_back((tag, ins[0].clone()));
                        vec![]
                    } else {
                        let out_types: Vec<TensorType> =
                            node.outputs.iter().map(|&o| self.graph.ty(o).clone()).collect();
                        run_kernel(&node.op, &ins, &out_types)?
                    }
                }
            };
            for v in &node.inputs {
                self.remaining[v.index()] -= 1;
                if self.remaining[v.index()] == 0 {
                    self.values[v.index()] = None;
                }
            }
            for (&o, t) in node.outputs.iter().zip(outs) {
                self.values[o.index()] = Some(t);
            }
            self.next += 1;
        }
        Ok(true)
    }

    /// The outputs, then the updated values in update order.
    fn finish(self) -> Vec<Tensor> {
        let value = |v: &crate::ValueId| self.values[v.index()].clone().expect("outputs and updates are defined");
        let graph = self.graph;
        graph.outputs().iter().map(|(_, v)| value(v)).chain(graph.updates().iter().map(|(_, v)| value(v))).collect()
    }
}

/// Runs one step of a pipeline: `stages[s]` is stage `s`'s graph, fed `inputs[s]`; stages run
/// in turn, each until it waits for a message, so any schedule without a deadlock completes.
/// Updates are applied to `params` (shared by name: a parameter held by two stages must be
/// updated to the same value by both). Returns each stage's outputs.
pub fn eval_pipeline_step(
    stages: &[Graph],
    params: &mut BTreeMap<String, Tensor>,
    inputs: &[Vec<Tensor>],
) -> Result<Vec<Vec<Tensor>>, EvalError> {
    let mut frames = Vec::new();
    for (s, graph) in stages.iter().enumerate() {
        let feed = inputs.get(s).map(Vec::as_slice).unwrap_or_default();
        frames.push(Frame::new(graph, params, feed)?);
    }
    let mut mail = Mailboxes::new();
    let mut done = vec![false; stages.len()];
    while done.iter().any(|d| !d) {
        let mut progressed = false;
        for (s, frame) in frames.iter_mut().enumerate() {
            if !done[s] {
                let before = frame.next;
                done[s] = frame.run(s, &mut mail)?;
                progressed |= done[s] || frame.next != before;
            }
        }
        if !progressed {
            let waiting: Vec<String> = frames
                .iter()
                .enumerate()
                .filter(|(s, _)| !done[*s])
                .map(|(s, f)| format!("stage {s} at {}", f.nodes[f.next].op.name()))
                .collect();
            return Err(EvalError::Pipeline(format!("deadlock: {}", waiting.join(", "))));
        }
    }
    if let Some(((from, to), _)) = mail.iter().find(|(_, queue)| !queue.is_empty()) {
        return Err(EvalError::Pipeline(format!("stage {from} sent stage {to} a message it never received")));
    }
    let mut outputs = Vec::new();
    let mut updated: BTreeMap<String, Tensor> = BTreeMap::new();
    for (graph, frame) in stages.iter().zip(frames) {
        let mut all = frame.finish();
        let updates = all.split_off(graph.outputs().len());
        for ((target, _), t) in graph.updates().iter().zip(updates) {
            let name = graph.name_of(*target).unwrap_or("").to_string();
            if updated.get(&name).is_some_and(|other| other != &t) {
                return Err(EvalError::Pipeline(format!("stages update '{name}' to different values")));
            }
            updated.insert(name, t);
        }
        outputs.push(all);
    }
    params.extend(updated);
    Ok(outputs)
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
