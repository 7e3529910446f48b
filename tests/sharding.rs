//! The `shard` pass on real training steps: the fixtures' step (loss, autodiff, AdamW with
//! clipping) placed on a mesh and run by the SPMD reference evaluator must match the
//! single-device step: the loss and every updated parameter and optimizer state, over two steps.

use std::collections::BTreeMap;

use autotp_ir::{DType, Graph, Tensor};
use autotp_passes::autodiff::Autodiff;
use autotp_passes::expert_dispatch::{DispatchExperts, DispatchLayout};
use autotp_passes::loss::{AttachLoss, LOSS};
use autotp_passes::optimize::{Optimize, Optimizer};
use autotp_passes::zero::{Zero, ZeroConfig};
use autotp_passes::{Pass, PassManager};

use crate::common::{fixture, max_abs_diff};

const BATCH: usize = 4;
const SEQ: usize = 16;

/// The single-device training step of a fixture and its initial weights.
fn training_step(arch: &str) -> (Graph, BTreeMap<String, Tensor>) {
    training_step_with(arch, false, None)
}

/// The step, with fused projections split first (as tensor parallelism compiles it) and its
/// experts' pairs dispatched in `dispatch`; the weights are reshaped to the views the step uses.
fn training_step_with(
    arch: &str,
    split_fused: bool,
    dispatch: Option<DispatchLayout>,
) -> (Graph, BTreeMap<String, Tensor>) {
    let options = autotp_frontend::ImportOptions { batch: Some(BATCH), seq_len: Some(SEQ), ..Default::default() };
    let model = autotp_frontend::import_onnx(&fixture(arch, "model.onnx"), &options).unwrap();
    let mut graph = model.graph;
    if dispatch.is_some() {
        // As the compiler simplifies first: the experts' lookups are found through it.
        PassManager::simplify_pipeline().run(&mut graph).unwrap();
    }
    let mut passes: Vec<Box<dyn Pass>> =
        vec![Box::new(autotp_passes::recognize::Recognize), Box::new(autotp_passes::dce::Dce), Box::new(AttachLoss)];
    if let Some(layout) = dispatch {
        passes.push(Box::new(DispatchExperts { layout, capacity: None }));
    }
    if split_fused {
        passes.push(Box::new(autotp_passes::split_fused::SplitFused));
    }
    passes.extend::<Vec<Box<dyn Pass>>>(vec![
        Box::new(Autodiff::new(LOSS)),
        Box::new(Optimize {
            optimizer: Optimizer::AdamW { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 },
            grad_clip: Some(1.0),
            stage: None,
            nonfinite: Default::default(),
        }),
        Box::new(autotp_passes::dce::Dce),
    ]);
    PassManager::new(passes).run(&mut graph).unwrap();
    let mut weights = model.weights;
    for &p in graph.params() {
        let name = graph.name_of(p).unwrap();
        let t = &weights[name];
        if t.ty != *graph.ty(p) {
            let view = Tensor::from_bytes(graph.ty(p).clone(), bytes::Bytes::copy_from_slice(t.bytes())).unwrap();
            weights.insert(name.to_string(), view);
        }
    }
    (graph, weights)
}

/// The step's inputs for optimizer step `step` (1-based): deterministic tokens, next-token labels.
fn feed(graph: &Graph, step: usize) -> Vec<Tensor> {
    let tokens: Vec<i64> = (0..BATCH * SEQ + 1).map(|i| ((i * 7919 + step * 104729) % 1000) as i64).collect();
    graph
        .inputs()
        .iter()
        .map(|&v| match graph.name_of(v).unwrap() {
            "input_ids" => Tensor::from_pod(DType::I64, vec![BATCH, SEQ], &tokens[..BATCH * SEQ]),
            "labels" => Tensor::from_pod(DType::I64, vec![BATCH, SEQ], &tokens[1..]),
            "lr" => Tensor::full(DType::F32, vec![], 2e-3),
            "step" => Tensor::full(DType::F32, vec![], step as f64),
            other => panic!("unexpected input {other}"),
        })
        .collect()
}

/// Runs two steps single-device and sharded; returns the worst relative differences of the loss
/// and of the updated tensors.
fn compare(arch: &str, shard: impl Pass + 'static) -> (f64, f64) {
    compare_dispatched(arch, None, shard)
}

/// [`compare`], with the experts' pairs dispatched in `dispatch` on both.
fn compare_dispatched(arch: &str, dispatch: Option<DispatchLayout>, shard: impl Pass + 'static) -> (f64, f64) {
    let (single, weights) = training_step_with(arch, true, dispatch);
    let mut sharded = single.clone();
    let manager = PassManager::new(vec![Box::new(shard)]);
    manager.run(&mut sharded).unwrap_or_else(|e| panic!("{arch}: {e}"));
    let (mut a, mut b) = (weights.clone(), weights);
    let (mut worst_loss, mut worst_tensor) = (0f64, 0f64);
    for step in 1..=2 {
        let want = autotp_ir::eval::eval_step(&single, &mut a, &feed(&single, step)).unwrap();
        let got = autotp_ir::spmd::eval_spmd_step(&sharded, &mut b, &feed(&sharded, step)).unwrap();
        for ((name, _), (w, g)) in single.outputs().iter().zip(want.iter().zip(&got)) {
            let (diff, scale) = max_abs_diff(g, w);
            let relative = diff / scale.max(1e-12);
            assert!(relative <= 1e-5, "{arch} step {step}: output {name} differs by {relative:.2e} relative");
            if name == LOSS {
                worst_loss = worst_loss.max(relative);
            }
        }
        // The gradients are checked tightly through step 1's optimizer moments (m is
        // (1 - beta1) x gradient). Parameters get a loose bar: AdamW normalises a gradient that
        // is zero up to rounding (the key bias's) into a step of up to lr, whatever the rounding,
        // so such a parameter can differ by a good part of lr; the loss, checked tightly above,
        // does not depend on it. Later steps compound rounding: the contract's 1e-3.
        for (name, w) in &a {
            let is_state = single.states().iter().any(|&v| single.name_of(v) == Some(name.as_str()));
            let bar = match (step, is_state) {
                (1, true) => 1e-5,
                (_, true) => 1e-3,
                (_, false) => 1e-2,
            };
            let (diff, scale) = max_abs_diff(&b[name], w);
            let relative = diff / scale.max(1e-12);
            assert!(relative <= bar, "{arch} step {step}: {name} differs by {relative:.2e} relative");
            worst_tensor = worst_tensor.max(relative);
        }
    }
    (worst_loss, worst_tensor)
}

/// Data parallelism with ZeRO stage 0: the batch inputs sharded over `dp` ranks.
fn data_parallel(dp: usize) -> Zero {
    Zero {
        dp,
        cp: 1,
        config: ZeroConfig::default(),
        batch_inputs: vec!["input_ids".into(), "labels".into()],
        param_placements: Default::default(),
        ep: 1,
    }
}

#[test]
fn data_parallel_steps_match_one_device() {
    for (arch, dp) in [("gpt2", 2), ("llama", 2), ("gpt2", 4), ("gpt_neox", 2)] {
        let (loss, tensors) = compare(arch, data_parallel(dp));
        println!("{arch} dp={dp}: loss {loss:.2e}, parameters and states {tensors:.2e} (worst relative)");
    }
}

#[test]
fn data_parallel_step_all_reduces_each_gradient_once() {
    let (mut graph, _) = training_step("gpt2");
    let params = graph.params().len();
    data_parallel(2).run(&mut graph).unwrap();
    let all_reduces = graph.nodes().filter(|(_, n)| matches!(n.op, autotp_ir::Op::Collective { .. })).count();
    // One per gradient, one for the loss; nothing is gathered or sliced but the loss's weights.
    // Each started (asynchronous) or run in place.
    let names: Vec<String> =
        graph.nodes().map(|(_, n)| n.op.name()).filter(|n| n == "all_reduce" || n == "all_reduce_start").collect();
    assert_eq!(names.len(), params + 1, "{} collectives in all", all_reduces);
}

#[test]
fn tensor_and_zero_parallel_steps_match_one_device() {
    use autotp_passes::autotp::AutoTp;
    for (arch, zero) in [("gpt2", 3), ("gpt2", 1), ("gpt_neox", 3), ("llama", 0)] {
        let zero = autotp_passes::zero::ZeroConfig { stage: zero, ..Default::default() };
        let autotp = AutoTp {
            tp: 2,
            dp: 2,
            cp: 1,
            zero,
            batch_inputs: vec!["input_ids".into(), "labels".into()],
            replicate_unsplittable: false,
            sequence_parallel: None,
            ep: 1,
            param_placements: Default::default(),
        };
        let (loss, tensors) = compare(arch, autotp);
        println!(
            "{arch} tp=2 dp=2 zero {}: loss {loss:.2e}, parameters and states {tensors:.2e} (worst relative)",
            zero.stage
        );
    }
}

/// Expert parallelism over groups of the data-parallel ranks beside tensor parallelism (dp 4 as
/// 2 groups of ep 2, tp 2): every gradient, however small, through step 1's optimizer moments.
#[test]
fn expert_parallel_groups_with_tensor_parallelism_match_one_device() {
    use autotp_passes::autotp::AutoTp;
    for arch in ["gpt_oss", "mixtral"] {
        let autotp = AutoTp {
            tp: 2,
            dp: 4,
            cp: 1,
            zero: ZeroConfig::default(),
            batch_inputs: vec!["input_ids".into(), "labels".into()],
            replicate_unsplittable: false,
            sequence_parallel: None,
            ep: 2,
            param_placements: Default::default(),
        };
        let layout = DispatchLayout { ranks: 2, outer: 2, inner: 1 };
        let (loss, tensors) = compare_dispatched(arch, Some(layout), autotp);
        println!("{arch} dp 4 ep 2 tp 2: loss {loss:.2e}, parameters and states {tensors:.2e} (worst relative)");
    }
}

/// The vocabulary split: on every tensor-parallel rank, each value with a vocabulary-sized dim
/// (the tables, the logits, the cross-entropy's intermediates, their gradients) holds only its
/// block of it; only the class-index constants are whole, and they are sliced before use.
#[test]
fn no_rank_holds_the_whole_vocabulary() {
    use autotp_ir::{Op, Placement};
    use autotp_passes::autotp::AutoTp;
    for arch in ["gpt2", "llama", "gpt_neox"] {
        for dp in [1, 2] {
            let (mut graph, _) = training_step_with(arch, true, None);
            let batch_inputs = vec!["input_ids".into(), "labels".into()];
            let zero = ZeroConfig { stage: 1, ..Default::default() };
            AutoTp {
                tp: 2,
                dp,
                cp: 1,
                zero,
                batch_inputs,
                replicate_unsplittable: false,
                sequence_parallel: None,
                ep: 1,
                param_placements: Default::default(),
            }
            .run(&mut graph)
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
            let tp = graph.mesh.axes.len() - 1;
            let vocab = 1000;
            for (id, value) in graph.values() {
                let Some(dim) = value.ty.shape.iter().position(|&d| d == vocab) else { continue };
                let is_constant =
                    matches!(value.def, autotp_ir::Def::Node(n, _) if matches!(graph.node(n).op, Op::Constant { .. }));
                if is_constant {
                    continue;
                }
                assert_eq!(
                    value.placements[tp],
                    Placement::Shard(dim),
                    "{arch} dp={dp}: value {} {} is whole on the tp ranks",
                    id.index(),
                    value.ty
                );
            }
        }
    }
}

/// A vocabulary that tp does not divide is refused, naming the table.
#[test]
fn an_indivisible_vocabulary_is_refused() {
    use autotp_passes::autotp::AutoTp;
    let text = "graph \"lm\" {
  input %input_ids : i64[2,4]
  param %embed : f32[15,8]
  param %ln.weight : f32[8]
  param %ln.bias : f32[8]
  param %up.weight : f32[8,8]
  param %down.weight : f32[8,8]
  %0 = gather %embed, %input_ids {axis = 0} : f32[2,4,8]
  %1 = layer_norm %0, %ln.weight, %ln.bias {axis = 2, eps = 1e-5} : f32[2,4,8]
  %2 = matmul %1, %up.weight : f32[2,4,8]
  %3 = gelu %2 : f32[2,4,8]
  %4 = matmul %3, %down.weight : f32[2,4,8]
  %5 = add %0, %4 : f32[2,4,8]
  %6 = transpose %embed {perm = [1, 0]} : f32[8,15]
  %7 = matmul %5, %6 : f32[2,4,15]
  output \"logits\" = %7
}
";
    let mut graph = autotp_ir::text::parse(text).unwrap();
    let passes: Vec<Box<dyn Pass>> = vec![
        Box::new(AttachLoss),
        Box::new(Autodiff::new(LOSS)),
        Box::new(Optimize {
            optimizer: Optimizer::Sgd { momentum: 0.0, weight_decay: 0.0, nesterov: false },
            grad_clip: None,
            stage: None,
            nonfinite: Default::default(),
        }),
        Box::new(AutoTp {
            tp: 2,
            dp: 1,
            cp: 1,
            zero: ZeroConfig::default(),
            batch_inputs: vec![],
            replicate_unsplittable: false,
            sequence_parallel: None,
            ep: 1,
            param_placements: Default::default(),
        }),
    ];
    let error = PassManager::new(passes).run(&mut graph).unwrap_err().to_string();
    assert!(error.contains("'embed'") && error.contains("15") && error.contains("vocabulary"), "{error}");
}

/// A step whose tokens are split over a mesh axis (the sequence, as context parallelism splits
/// it): the `shard` pass places every value of the forward, backward and optimizer step so
/// that the SPMD reference computes what one device does (Llama: rotary tables and a causal
/// mask; GPT-2: learned positions).
#[test]
fn a_step_with_its_sequence_split_matches_one_device() {
    use autotp_ir::{Mesh, MeshAxis, Placement};
    for arch in ["llama", "gpt2"] {
        let mesh = Mesh { axes: vec![MeshAxis { name: "cp".into(), size: 2 }] };
        let seeds = ["input_ids", "labels"].map(|name| (name.to_string(), vec![Placement::Shard(1)]));
        let shard = autotp_passes::shard::Shard::seeded(mesh, seeds.into());
        let (loss, tensors) = compare(arch, shard);
        println!("{arch}: loss within {loss:.1e}, parameters and states within {tensors:.1e}");
    }
}
