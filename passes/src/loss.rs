//! `loss`: makes the graph's only output a scalar training loss named `loss`, following the
//! training contract (DESIGN.md, "Contracts"):
//!
//! - a model with a `loss` output keeps it (a Hugging Face model with a `labels` input shifts
//!   the labels itself; the data loader feeds `labels = input_ids`);
//! - a model whose output is logits `[batch, seq, vocab]` gets a new input `labels: i64[batch,
//!   seq]` and `loss = mean cross-entropy` over all `batch x seq` positions.
//!
//! Input phase: imported. Output: the same graph with one output, `loss`. Other outputs are
//! dropped (training does not read them). Tests: tests/golden/loss_*.ir.

use autotp_ir::{DType, Graph, Op, Reduction, Rewriter, TensorType};
use autotp_program::step::{StepInput, StepOutput};

use crate::{Pass, PassError};

/// The name of the loss output, and of the labels input the pass adds.
pub const LOSS: &str = StepOutput::Loss.name();
pub const LABELS: &str = StepInput::Labels.name();

pub struct AttachLoss;

const PASS: &str = "loss";

impl Pass for AttachLoss {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        let invalid = |message: String| PassError::Invalid { pass: PASS, message };
        if let Some(&(_, loss)) = graph.outputs().iter().find(|(n, _)| n == LOSS) {
            let t = graph.ty(loss);
            if !t.dtype.is_float() || t.numel() != 1 {
                return Err(invalid(format!("the model's '{LOSS}' output must be a floating-point scalar, got {t}")));
            }
            let mut rw = Rewriter::new(graph, |_| true);
            for (id, _) in graph.nodes() {
                rw.copy_node(id);
            }
            let new_loss = rw.map(loss);
            let mut result = rw.finish_without_outputs();
            result.add_output(LOSS, new_loss);
            *graph = result.without_dead_code();
            return Ok(());
        }
        let candidates: Vec<_> = graph
            .outputs()
            .iter()
            .filter(|(_, v)| graph.ty(*v).rank() == 3 && graph.ty(*v).dtype.is_float())
            .map(|(n, v)| (n.clone(), *v))
            .collect();
        let (name, logits) = match candidates.as_slice() {
            [one] => one.clone(),
            _ => match candidates.iter().find(|(n, _)| n == "logits") {
                Some(found) => found.clone(),
                None => {
                    return Err(invalid(format!(
                        "the model has no '{LOSS}' output and not exactly one logits output [batch, seq, vocab] to attach cross-entropy to (outputs: {})",
                        graph.outputs().iter().map(|(n, v)| format!("{n}: {}", graph.ty(*v))).collect::<Vec<_>>().join(", ")
                    )))
                }
            },
        };
        if graph.inputs().iter().any(|&i| graph.name_of(i) == Some(LABELS)) {
            return Err(invalid(format!("the model already has an input named '{LABELS}' but no '{LOSS}' output")));
        }
        let shape = graph.ty(logits).shape.clone();
        let (batch, seq, vocab) = (shape[0], shape[1], shape[2]);
        let mut rw = Rewriter::new(graph, |_| true);
        let labels = rw.graph().add_input(LABELS, TensorType::new(DType::I64, vec![batch, seq]));
        for (id, _) in graph.nodes() {
            rw.copy_node(id);
        }
        let logits = rw.map(logits);
        let g = rw.graph();
        let internal =
            |m: String| PassError::Invalid { pass: PASS, message: format!("attaching the loss to '{name}': {m}") };
        let flat_logits = g.add(Op::Reshape { shape: vec![batch * seq, vocab] }, vec![logits]).map_err(internal)?;
        let flat_labels = g.add(Op::Reshape { shape: vec![batch * seq] }, vec![labels]).map_err(internal)?;
        let loss = g
            .add(Op::CrossEntropy { ignore_index: None, reduction: Reduction::Mean }, vec![flat_logits, flat_labels])
            .map_err(internal)?;
        let mut result = rw.finish_without_outputs();
        result.add_output(LOSS, loss);
        *graph = result.without_dead_code();
        Ok(())
    }
}
