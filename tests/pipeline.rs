//! Pipeline stages: where `pipeline::partition` cuts the fixtures' forward pass, by the cost
//! model and by named cuts, and what it refuses.

use autotp_ir::Graph;
use autotp_passes::autodiff::Autodiff;
use autotp_passes::loss::{AttachLoss, LOSS};
use autotp_passes::pipeline::partition;
use autotp_passes::PassManager;

use crate::common::fixture;

/// The differentiated one-micro-batch step of a fixture (batch 4, sequence 16).
fn differentiated(arch: &str) -> Graph {
    let options = autotp_frontend::ImportOptions { batch: Some(4), seq_len: Some(16), ..Default::default() };
    let mut graph = autotp_frontend::import_onnx(&fixture(arch, "model.onnx"), &options).unwrap().graph;
    let passes: Vec<Box<dyn autotp_passes::Pass>> = vec![
        Box::new(autotp_passes::recognize::Recognize),
        Box::new(autotp_passes::dce::Dce),
        Box::new(AttachLoss),
        Box::new(Autodiff::new(LOSS)),
    ];
    PassManager::new(passes).run(&mut graph).unwrap();
    graph
}

#[test]
fn cuts_fall_between_layers_and_balance_the_cost() {
    for (arch, layer) in
        [("gpt2", "m.transformer.h."), ("llama", "m.model.layers."), ("gpt_neox", "m.gpt_neox.layers.")]
    {
        let graph = differentiated(arch);
        // Named: the second stage starts with layer 1, and holds none of layer 0.
        let named = partition(&graph, 2, &[format!("{layer}1")]).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let params = &named.params;
        assert!(params[0].iter().any(|p| p.starts_with(&format!("{layer}0."))), "{arch}: {params:?}");
        assert!(!params[0].iter().any(|p| p.starts_with(&format!("{layer}1."))), "{arch}: {params:?}");
        assert!(!params[1].iter().any(|p| p.starts_with(&format!("{layer}0."))), "{arch}: {params:?}");
        // The activation sent is the hidden state [batch, seq, hidden].
        let sent = graph.ty(named.boundaries[0]);
        assert_eq!(sent.shape, [4, 16, 64], "{arch}: {sent}");
        // Balanced: no stage costs more than the named split's worst.
        let balanced = partition(&graph, 2, &[]).unwrap();
        let worst = |s: &autotp_passes::pipeline::Stages| *s.flops.iter().max().unwrap();
        assert!(worst(&balanced) <= worst(&named), "{arch}: {:?} vs {:?}", balanced.flops, named.flops);
        let total: u64 = balanced.flops.iter().sum();
        assert!(worst(&balanced) < total * 3 / 4, "{arch}: {:?}", balanced.flops);
        println!("{arch}: 2 stages {:?} FLOPs (named at layer 1: {:?})", balanced.flops, named.flops);
        // GPT-2's tied embedding is on both ends.
        if arch == "gpt2" {
            assert!(named.params.iter().all(|p| p.contains(&"m.transformer.wte.weight".to_string())), "{params:?}");
        }
    }
}

#[test]
fn impossible_cuts_are_refused() {
    let graph = differentiated("gpt2");
    let err = partition(&graph, 40, &[]).unwrap_err().to_string();
    assert!(err.contains("--pp 40 needs 39 cuts, but the forward pass has only"), "{err}");
    let err = partition(&graph, 2, &["m.transformer.h.7".into()]).unwrap_err().to_string();
    assert!(err.contains("--pp-cuts 'm.transformer.h.7': no parameter of the forward pass is named so"), "{err}");
    let err = partition(&graph, 3, &["m.transformer.h.1".into(), "m.transformer.h.0".into()]).unwrap_err().to_string();
    assert!(err.contains("'m.transformer.h.0' does not come after the cut before it"), "{err}");
    let err = partition(&graph, 3, &["m.transformer.h.1".into()]).unwrap_err().to_string();
    assert!(err.contains("--pp 3 needs 2 --pp-cuts, got 1"), "{err}");
}
