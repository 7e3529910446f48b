//! Expert parallelism's token dispatch (`expert-dispatch`): the Mixtral and DeepSeek-V3
//! fixtures with their experts' per-pair computation moved into the dispatched layout of 2 and
//! 4 ranks compute the same logits, loss and gradients as the model does undispatched.

use std::collections::BTreeMap;

use autotp_frontend::ImportOptions;
use autotp_ir::{Graph, Op, Tensor};
use autotp_passes::autodiff::{Autodiff, GRAD_PREFIX};
use autotp_passes::expert_dispatch::DispatchExperts;
use autotp_passes::{Pass, PassManager};

use crate::common::{fixture, max_abs_diff, read_npy};

/// The fixture `arch`'s training graph (simplified, its loss attached, differentiated), with
/// its experts dispatched over `ranks` first when there are more than one; and its weights.
fn training_graph(arch: &str, ranks: usize) -> (Graph, BTreeMap<String, Tensor>) {
    let options = ImportOptions { batch: Some(4), seq_len: Some(32), ..ImportOptions::default() };
    let mut model = autotp_frontend::import_onnx(&fixture(arch, "model.onnx"), &options).unwrap();
    PassManager::simplify_pipeline().run(&mut model.graph).unwrap();
    let passes: Vec<Box<dyn Pass>> = vec![
        Box::new(autotp_passes::loss::AttachLoss),
        Box::new(DispatchExperts { ranks }),
        Box::new(Autodiff::new(autotp_passes::loss::LOSS)),
    ];
    PassManager::new(passes).run(&mut model.graph).unwrap_or_else(|e| panic!("{arch} over {ranks}: {e}"));
    (model.graph, model.weights)
}

fn count(graph: &Graph, pick: fn(&Op) -> bool) -> usize {
    graph.nodes().filter(|(_, n)| pick(&n.op)).count()
}

#[test]
fn dispatched_experts_train_as_the_undispatched_model() {
    for arch in ["mixtral", "deepseek_v3"] {
        let ids = read_npy(&fixture(arch, "input_ids.npy"));
        let inputs = [ids.clone(), ids];
        let (reference_graph, weights) = training_graph(arch, 1);
        let reference = autotp_ir::eval::eval_graph(&reference_graph, &weights, &inputs).unwrap();
        for ranks in [2, 4] {
            let (graph, _) = training_graph(arch, ranks);
            // Each mixture scatters its pairs into the send buffers and gathers them back: the
            // hidden states, the experts' ids and (Mixtral) the routing weights go out, the
            // pairs' results come back; the backward does the reverse.
            let scatters = count(&graph, |op| matches!(op, Op::ScatterElements { axis: 1, .. }));
            let gathers = count(&graph, |op| matches!(op, Op::GatherElements { axis: 1 }));
            assert!(scatters >= 2 && gathers >= 2, "{arch} over {ranks}: {scatters} scatters, {gathers} gathers");

            let outputs = autotp_ir::eval::eval_graph(&graph, &weights, &inputs).unwrap();
            assert_eq!(graph.outputs().len(), reference_graph.outputs().len());
            let mut gradients = 0;
            for (((name, _), got), want) in graph.outputs().iter().zip(&outputs).zip(&reference) {
                let (diff, scale) = max_abs_diff(got, want);
                assert!(
                    diff <= 1e-5 * scale.max(1e-3),
                    "{arch} over {ranks} ranks: {name} differs by {diff} (max {scale})"
                );
                gradients += name.starts_with(GRAD_PREFIX) as usize;
            }
            assert!(gradients > 10, "{arch}: {gradients} gradients compared");
        }
    }
}

#[test]
fn dispatch_refuses_a_model_without_experts_and_an_uneven_split() {
    let options = ImportOptions { batch: Some(4), seq_len: Some(32), ..ImportOptions::default() };
    let mut llama = autotp_frontend::import_onnx(&fixture("llama", "model.onnx"), &options).unwrap();
    let error = DispatchExperts { ranks: 2 }.run(&mut llama.graph).unwrap_err().to_string();
    assert!(error.contains("--ep 2") && error.contains("has none"), "{error}");
    let mut mixtral = autotp_frontend::import_onnx(&fixture("mixtral", "model.onnx"), &options).unwrap();
    let error = DispatchExperts { ranks: 3 }.run(&mut mixtral.graph).unwrap_err().to_string();
    assert!(error.contains("--ep 3 must divide the experts (4)") && error.contains("experts.gate_up_proj"), "{error}");
}
