//! Pipeline stages: where `pipeline::partition` cuts the fixtures' forward pass, by the cost
//! model and by named cuts, and what it refuses.

use std::collections::BTreeMap;

use autotp_ir::{Graph, Tensor};
use autotp_passes::accumulate::Accumulate;
use autotp_passes::autodiff::Autodiff;
use autotp_passes::loss::{AttachLoss, LABELS, LOSS};
use autotp_passes::pipeline::{partition, Pipeline, PipelineBackward, PipelineSchedule};
use autotp_passes::PassManager;

use crate::common::{fixture, max_abs_diff};

/// The differentiated one-micro-batch step of a fixture (batch 4, sequence 16).
fn differentiated(arch: &str) -> Graph {
    differentiated_model(arch, "model.onnx")
}

/// [`differentiated`] with another of the fixture's model files.
fn differentiated_model(arch: &str, file: &str) -> Graph {
    Autodiff::new(LOSS).differentiate(&model_with_loss(arch, file, 4, 16).graph).unwrap().0
}

/// The pipeline pass over `stages` stages and `micro_batches` micro-batches, cut by the cost
/// model, every parameter trained.
fn pipeline(stages: usize, micro_batches: usize, schedule: PipelineSchedule, backward: PipelineBackward) -> Pipeline {
    Pipeline {
        stages,
        virtual_stages: 1,
        cuts: vec![],
        micro_batches,
        schedule,
        backward,
        batch_inputs: vec!["input_ids".into(), LABELS.into()],
        frozen: Default::default(),
        padding_rows: Default::default(),
        grad_dtype: None,
        loss_scaling: false,
        forward_only: false,
    }
}

#[test]
fn cuts_fall_between_layers_and_balance_the_cost() {
    for (arch, layer) in
        [("gpt2", "m.transformer.h."), ("llama", "m.model.layers."), ("gpt_neox", "m.gpt_neox.layers.")]
    {
        let graph = differentiated(arch);
        // Named: the second stage starts with layer 1, and holds none of layer 0.
        let named = partition(&graph, 2, &[format!("{layer}1")], &[2, 1]).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let params = &named.params;
        assert!(params[0].iter().any(|p| p.starts_with(&format!("{layer}0."))), "{arch}: {params:?}");
        assert!(!params[0].iter().any(|p| p.starts_with(&format!("{layer}1."))), "{arch}: {params:?}");
        assert!(!params[1].iter().any(|p| p.starts_with(&format!("{layer}0."))), "{arch}: {params:?}");
        // The activation sent is the hidden state [batch, seq, hidden].
        let sent = graph.ty(named.boundaries[0]);
        assert_eq!(sent.shape, [4, 16, 64], "{arch}: {sent}");
        // Balanced: no stage takes longer than the named split's slowest.
        let balanced = partition(&graph, 2, &[], &[2, 1]).unwrap();
        let worst = |s: &autotp_passes::pipeline::Stages| *s.time.iter().max().unwrap();
        assert!(worst(&balanced) <= worst(&named), "{arch}: {:?} vs {:?}", balanced.time, named.time);
        let total: u64 = balanced.time.iter().sum();
        assert!(worst(&balanced) < total * 3 / 4, "{arch}: {:?}", balanced.time);
        println!("{arch}: 2 stages {:?} time (named at layer 1: {:?})", balanced.time, named.time);
        // GPT-2's tied embedding is on both ends.
        if arch == "gpt2" {
            assert!(named.params.iter().all(|p| p.contains(&"m.transformer.wte.weight".to_string())), "{params:?}");
        }
    }
}

/// When one stage sets the pace (cuts go only where one activation crosses, so the stages are
/// seldom equal), the other cuts go where the fullest stage is smallest: no cutting of the
/// 4-layer fixtures at layer boundaries or before the final norm is faster, or as fast and
/// smaller, by the cost model with 1F1B's micro-batches in flight.
#[test]
fn among_the_fastest_cuts_the_fullest_stage_is_smallest() {
    for (arch, layer, last) in
        [("gpt2", "m.transformer.h.", "m.transformer.ln_f"), ("llama", "m.model.layers.", "m.model.norm")]
    {
        let graph = differentiated_model(arch, "model_4_layers.onnx");
        let mut names: Vec<String> = (0..4).map(|i| format!("{layer}{i}")).collect();
        names.push(last.to_string());
        for stages in [3, 4] {
            let in_flight: Vec<usize> =
                (0..stages).map(|s| PipelineSchedule::OneFOneB.in_flight(s, stages, 1, 8)).collect();
            let balanced = partition(&graph, stages, &[], &in_flight).unwrap();
            let slowest = |s: &autotp_passes::pipeline::Stages| *s.time.iter().max().unwrap();
            let fullest = |s: &autotp_passes::pipeline::Stages| *s.memory.iter().max().unwrap();
            let mut compared = 0;
            for cuts in in_order(&names, stages - 1) {
                let named = partition(&graph, stages, &cuts, &in_flight).unwrap();
                let (time, memory) = (slowest(&named), fullest(&named));
                assert!(
                    slowest(&balanced) < time || (slowest(&balanced) == time && fullest(&balanced) <= memory),
                    "{arch} pp{stages}: balanced {:?} time {:?} bytes, cut at {cuts:?} {:?} time {:?} bytes",
                    balanced.time,
                    balanced.memory,
                    named.time,
                    named.memory
                );
                compared += 1;
            }
            assert!(compared > 0);
            println!("{arch} pp{stages}: {:?} time, {:?} bytes", balanced.time, balanced.memory);
        }
    }
}

/// On a model of equal layers (`linear`, `gelu`, residual add, `layer_norm`, 8 times) the cuts
/// fall between layers, two per stage: the cost model counts what the backward of the
/// elementwise ops and norms costs, not just the forward's FLOPs, which put cuts before norms
/// (a stage of three norms took 37% longer than one of one).
#[test]
fn cuts_of_equal_layers_fall_between_them() {
    let graph = with_loss("uniform", 16, 64).graph;
    let (stages, _) = pipeline(4, 8, PipelineSchedule::OneFOneB, PipelineBackward::Whole).run(&graph).unwrap();
    // The parameters each stage graph holds.
    for (s, params) in stages.params.iter().enumerate() {
        let layers: Vec<&String> = params.iter().filter(|p| p.starts_with("layers.")).collect();
        let norms: Vec<&String> = params.iter().filter(|p| p.starts_with("norms.")).collect();
        let (first, second) = (2 * s, 2 * s + 1);
        let want = |kind: &str| {
            [
                format!("{kind}.{first}.bias"),
                format!("{kind}.{first}.weight"),
                format!("{kind}.{second}.bias"),
                format!("{kind}.{second}.weight"),
            ]
        };
        assert_eq!(layers, want("layers").iter().collect::<Vec<_>>(), "stage {s}: {params:?}");
        assert_eq!(norms, want("norms").iter().collect::<Vec<_>>(), "stage {s}: {params:?}");
    }
    let (fastest, slowest) = (stages.time.iter().min().unwrap(), stages.time.iter().max().unwrap());
    assert!(slowest - fastest < slowest / 10, "{:?}", stages.time);
}

/// Every choice of `k` of `names`, each in the order of `names`.
fn in_order(names: &[String], k: usize) -> Vec<Vec<String>> {
    if k == 0 {
        return vec![Vec::new()];
    }
    let mut chosen = Vec::new();
    for (i, first) in names.iter().enumerate() {
        for mut rest in in_order(&names[i + 1..], k - 1) {
            rest.insert(0, first.clone());
            chosen.push(rest);
        }
    }
    chosen
}

#[test]
fn the_planned_bubble_follows_the_stages_costs() {
    use autotp_passes::pipeline::{bubble_fraction, stage_idle_fractions, ChunkCosts};
    let chunks = |forward, input_gradient, weight_gradients| ChunkCosts { forward, input_gradient, weight_gradients };
    let idle = |schedule, backward, costs: &[ChunkCosts], stages, micro_batches| {
        stage_idle_fractions(schedule, backward, costs, stages, micro_batches).unwrap()
    };
    // Equal stages whose backward sends at its end: the textbook bubble, either schedule.
    for schedule in [PipelineSchedule::OneFOneB, PipelineSchedule::GPipe] {
        for (stages, micro_batches) in [(2, 4), (4, 8), (3, 1)] {
            let mut costs = vec![chunks(5, 4, 6); stages];
            costs[0] = chunks(5, 0, 10);
            for idle in idle(schedule, PipelineBackward::Whole, &costs, stages, micro_batches) {
                assert!((idle - bubble_fraction(stages, 1, micro_batches)).abs() < 1e-12, "{schedule:?}: {idle}");
            }
        }
    }
    // Costs 1 and 2 over 4 micro-batches: the step is 1 + 2 + 3 x 2 = 9 units of a chunk.
    for backward in [PipelineBackward::Whole, PipelineBackward::Split] {
        let idle = idle(PipelineSchedule::OneFOneB, backward, &[chunks(1, 0, 2), chunks(2, 4, 0)], 2, 4);
        assert!((idle[0] - 5.0 / 9.0).abs() < 1e-12 && (idle[1] - 1.0 / 9.0).abs() < 1e-12, "{idle:?}");
    }
    // Sending the input's gradient before the weights' shortens the way back: 1/7, not 1/5.
    let equal = [chunks(1, 0, 2), chunks(1, 1, 1)];
    let split = idle(PipelineSchedule::OneFOneB, PipelineBackward::Split, &equal, 2, 4);
    assert!(split.iter().all(|idle| (idle - 1.0 / 7.0).abs() < 1e-12), "{split:?}");
    let whole = idle(PipelineSchedule::OneFOneB, PipelineBackward::Whole, &equal, 2, 4);
    assert!(whole.iter().all(|idle| (idle - 1.0 / 5.0).abs() < 1e-12), "{whole:?}");
}

/// Megatron's interleaved 1F1B over `V` model chunks per rank: with equal chunks, every rank
/// idles `(P - 1) / (V M + P - 1)` of the step (the bubble `(P - 1) / (V M)` of the ideal
/// time), and holds the activations Megatron's warmup implies.
#[test]
fn interleaving_divides_the_bubble_by_the_virtual_stages() {
    use autotp_passes::pipeline::{bubble_fraction, chunks_in_flight, stage_idle_fractions, ChunkCosts};
    for (stages, virtual_stages, micro_batches) in [(2, 2, 4), (2, 2, 2), (4, 2, 8), (2, 3, 6), (4, 4, 16), (3, 2, 9)] {
        let mut costs =
            vec![ChunkCosts { forward: 2, input_gradient: 2, weight_gradients: 2 }; stages * virtual_stages];
        costs[0] = ChunkCosts { forward: 2, input_gradient: 0, weight_gradients: 4 };
        let idle =
            stage_idle_fractions(PipelineSchedule::OneFOneB, PipelineBackward::Whole, &costs, stages, micro_batches)
                .unwrap();
        let textbook = bubble_fraction(stages, virtual_stages, micro_batches);
        for (rank, idle) in idle.iter().enumerate() {
            assert!(
                (idle - textbook).abs() < 1e-12,
                "P {stages} V {virtual_stages} M {micro_batches} rank {rank}: {idle} against {textbook}"
            );
        }
        assert!(textbook < bubble_fraction(stages, 1, micro_batches));
        for rank in 0..stages {
            let order = PipelineSchedule::OneFOneB.order(rank, stages, virtual_stages, micro_batches);
            // Every chunk of every micro-batch, once forward and once backward.
            assert_eq!(order.len(), 2 * virtual_stages * micro_batches);
            let held = chunks_in_flight(&order, virtual_stages).total;
            let warmup = if micro_batches == stages {
                virtual_stages * micro_batches
            } else {
                2 * (stages - 1 - rank) + (virtual_stages - 1) * stages + 1
            };
            assert_eq!(held, warmup.min(virtual_stages * micro_batches), "rank {rank}");
        }
    }
}

/// ZB-H1 with `F = B = W`: every stage's bubble is `(P - 1)(F + B - W)`, a third of 1F1B's
/// `(P - 1)(F + B + W)`, and no stage holds more than `P` micro-batches' activations.
#[test]
fn zero_bubble_h1_shrinks_the_bubble_to_a_third() {
    use autotp_passes::pipeline::{stage_idle_fractions, ChunkCosts};
    for (stages, micro_batches) in [(2, 4), (4, 8), (4, 4), (3, 12)] {
        let mut costs = vec![ChunkCosts { forward: 1, input_gradient: 1, weight_gradients: 1 }; stages];
        costs[0] = ChunkCosts { forward: 1, input_gradient: 0, weight_gradients: 2 };
        let work = 3.0 * micro_batches as f64;
        let bubble = |idle: f64| idle * work / (1.0 - idle);
        let zb = stage_idle_fractions(
            PipelineSchedule::ZeroBubbleH1,
            PipelineBackward::Split,
            &costs,
            stages,
            micro_batches,
        )
        .unwrap();
        let one_f_one_b =
            stage_idle_fractions(PipelineSchedule::OneFOneB, PipelineBackward::Whole, &costs, stages, micro_batches)
                .unwrap();
        for rank in 0..stages {
            let want = (stages - 1) as f64;
            assert!((bubble(zb[rank]) - want).abs() < 1e-9, "P {stages} M {micro_batches} rank {rank}: {zb:?}");
            assert!((bubble(one_f_one_b[rank]) - 3.0 * want).abs() < 1e-9, "{one_f_one_b:?}");
            let in_flight = PipelineSchedule::ZeroBubbleH1.in_flight(rank, stages, 1, micro_batches);
            assert_eq!(in_flight, stages.min(micro_batches), "rank {rank}");
        }
    }
}

/// A split backward chunk sends the input's gradient before it computes the weights'
/// gradients; a whole one after.
#[test]
fn the_input_gradient_is_sent_before_the_weight_gradients() {
    let model = with_loss("gpt2", 2, 8);
    for backward in [PipelineBackward::Split, PipelineBackward::Whole] {
        let (stages, graphs) = pipeline(2, 2, PipelineSchedule::OneFOneB, backward).run(&model.graph).unwrap();
        let last = &graphs[1];
        let nodes: Vec<&autotp_ir::Node> = last.nodes().map(|(_, n)| n).collect();
        let gradient_send = nodes
            .iter()
            .position(|n| matches!(n.op, autotp_ir::Op::Send { message: autotp_ir::Message::Gradient, .. }))
            .unwrap();
        // Split: the micro-batch's weight gradients (a matmul among them) are made after the
        // send, before the next micro-batch's chunk receives anything. Whole: none are.
        let next_recv = nodes[gradient_send..]
            .iter()
            .position(|n| matches!(n.op, autotp_ir::Op::Recv { .. }))
            .map_or(nodes.len(), |k| gradient_send + k);
        let made_after =
            nodes[gradient_send + 1..next_recv].iter().filter(|n| matches!(n.op, autotp_ir::Op::MatMul { .. })).count();
        match backward {
            PipelineBackward::Split => {
                assert!(made_after > 0, "no matmul between the gradient's send and the next recv")
            }
            PipelineBackward::Whole => {
                assert_eq!(made_after, 0, "matmuls between the gradient's send and the next recv")
            }
        }
        let costs = stages.chunk_costs[1];
        assert!(costs.input_gradient > 0 && costs.weight_gradients > 0, "{costs:?}");
        assert_eq!(stages.chunk_costs[0].input_gradient, 0, "the first stage sends no gradient");
    }
}

/// The layers a stage count is checked against: the numbers that follow a prefix in the
/// parameters' names (`layers.N` and `norms.N` number the same 8, and `layers` comes first in
/// name order); none in an unnumbered model.
#[test]
fn layers_are_counted_from_the_parameter_names() {
    use autotp_passes::pipeline::{numbered_layers, NumberedLayers};
    let numbered =
        |prefix: &str, count: u64| Some(NumberedLayers { prefix: prefix.into(), numbers: (0..count).collect() });
    assert_eq!(numbered_layers(&with_loss("uniform", 2, 8).graph), numbered("layers", 8));
    assert_eq!(numbered_layers(&with_loss("llama", 2, 8).graph), numbered("m.model.layers", 2));
    assert_eq!(
        numbered_layers(&model_with_loss("gpt2", "model_4_layers.onnx", 2, 8).graph),
        numbered("m.transformer.h", 4)
    );
    assert_eq!(numbered_layers(&tiny_lm()), None);
}

#[test]
fn impossible_cuts_are_refused() {
    let graph = differentiated("gpt2");
    let err = partition(&graph, 3, &[], &[1; 3]).unwrap_err().to_string();
    assert!(
        err.contains(
            "--pp 3 asks for more stages than the model has layers (2: m.transformer.h.0 to m.transformer.h.1)"
        ),
        "{err}"
    );
    let err = partition(&tiny_lm(), 10, &[], &[1; 10]).unwrap_err().to_string();
    assert!(err.contains("--pp 10 needs 9 cuts, but the forward pass has only"), "{err}");
    let err = partition(&graph, 2, &["m.transformer.h.7".into()], &[2, 1]).unwrap_err().to_string();
    assert!(err.contains("--pp-cuts 'm.transformer.h.7': no parameter of the forward pass is named so"), "{err}");
    let deep = differentiated_model("gpt2", "model_4_layers.onnx");
    let err = partition(&deep, 3, &["m.transformer.h.1".into(), "m.transformer.h.0".into()], &[3, 2, 1])
        .unwrap_err()
        .to_string();
    assert!(err.contains("'m.transformer.h.0' does not come after the cut before it"), "{err}");
    let err = partition(&deep, 3, &["m.transformer.h.1".into()], &[3, 2, 1]).unwrap_err().to_string();
    assert!(err.contains("--pp 3 needs 2 --pp-cuts, got 1"), "{err}");
}

/// The imported graph with its loss (`batch` x `seq_len` tokens), before autodiff, as the
/// pipeline pass takes it.
fn with_loss(arch: &str, batch: usize, seq_len: usize) -> autotp_frontend::Model {
    model_with_loss(arch, "model.onnx", batch, seq_len)
}

/// [`with_loss`] with another of the fixture's model files.
fn model_with_loss(arch: &str, file: &str, batch: usize, seq_len: usize) -> autotp_frontend::Model {
    let options = autotp_frontend::ImportOptions { batch: Some(batch), seq_len: Some(seq_len), ..Default::default() };
    let mut model = autotp_frontend::import_onnx(&fixture(arch, file), &options).unwrap();
    let passes: Vec<Box<dyn autotp_passes::Pass>> =
        vec![Box::new(autotp_passes::recognize::Recognize), Box::new(autotp_passes::dce::Dce), Box::new(AttachLoss)];
    PassManager::new(passes).run(&mut model.graph).unwrap();
    model
}

/// Token ids for a `[rows, micro-batches, seq]` input.
fn tokens(shape: &[usize], seed: i64) -> Tensor {
    let ids: Vec<i64> = (0..shape.iter().product::<usize>() as i64).map(|i| (i * 7919 + seed * 104_729) % 97).collect();
    let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    Tensor::from_pod(autotp_ir::DType::I64, shape.to_vec(), &bytes)
}

/// The stages' step, run together by the pipeline evaluator, computes the loss and gradients
/// of gradient accumulation over the same micro-batches on one device, for every schedule.
#[test]
fn stage_graphs_compute_the_accumulated_step() {
    let batch_inputs = vec!["input_ids".to_string(), LABELS.to_string()];
    for (arch, file, stages, micro_batches, schedule, backward) in [
        ("gpt2", "model.onnx", 2, 4, PipelineSchedule::OneFOneB, PipelineBackward::Split),
        ("gpt2", "model.onnx", 2, 3, PipelineSchedule::GPipe, PipelineBackward::Split),
        ("llama", "model.onnx", 2, 4, PipelineSchedule::OneFOneB, PipelineBackward::Split),
        ("llama", "model_4_layers.onnx", 4, 4, PipelineSchedule::OneFOneB, PipelineBackward::Split),
        ("llama", "model_4_layers.onnx", 3, 4, PipelineSchedule::OneFOneB, PipelineBackward::Whole),
        ("gpt_neox", "model_4_layers.onnx", 3, 2, PipelineSchedule::OneFOneB, PipelineBackward::Split),
    ] {
        let model = model_with_loss(arch, file, 2, 8);
        let graph = &model.graph;
        let (_, graphs) =
            pipeline(stages, micro_batches, schedule, backward).run(graph).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(graphs.len(), stages);
        let mut reference = graph.clone();
        let passes: Vec<Box<dyn autotp_passes::Pass>> = vec![
            Box::new(Autodiff::new(LOSS)),
            Box::new(Accumulate { micro_batches, batch_inputs: batch_inputs.clone() }),
        ];
        PassManager::new(passes).run(&mut reference).unwrap();
        let mut params: BTreeMap<String, Tensor> =
            model.weights.iter().map(|(name, t)| (name.clone(), t.clone())).collect();
        let feed = |g: &Graph| -> Vec<Tensor> {
            g.inputs()
                .iter()
                .map(|&v| match g.name_of(v).unwrap() {
                    "input_ids" => tokens(&g.ty(v).shape, 1),
                    "labels" => tokens(&g.ty(v).shape, 2),
                    other => panic!("{arch}: unexpected input {other}"),
                })
                .collect()
        };
        let expected = autotp_ir::eval::eval_graph(&reference, &params, &feed(&reference)).unwrap();
        let inputs: Vec<Vec<Tensor>> = graphs.iter().map(feed).collect();
        let outputs = autotp_ir::eval::eval_pipeline_step(&graphs, &mut params, &inputs)
            .unwrap_or_else(|e| panic!("{arch} pp {stages}: {e}"));
        let mut compared = 0;
        for (g, outs) in graphs.iter().zip(&outputs) {
            for ((name, _), got) in g.outputs().iter().zip(outs) {
                let index = reference.outputs().iter().position(|(n, _)| n == name).unwrap();
                let (diff, scale) = max_abs_diff(got, &expected[index]);
                assert!(
                    diff <= 1e-5 * scale.max(1e-3),
                    "{arch} pp {stages} {schedule:?} {backward:?}: {name} differs by {diff} (scale {scale})"
                );
                compared += 1;
            }
        }
        println!("{arch} pp {stages} x {micro_batches} {schedule:?}: {compared} outputs agree");
        // Every gradient (a shared one on each of its stages) and the loss.
        assert!(compared >= reference.outputs().len(), "{arch}: compared {compared} of {}", reference.outputs().len());
    }
}

/// A stage that recomputes a value from a parameter (the transposed tied embedding its head
/// reads, computed before the cut in the model) holds that parameter, so its gradient is
/// exchanged and the clipping norm counts it once.
#[test]
fn stages_hold_the_parameters_they_recompute_from() {
    let (stages, graphs) = pipeline(2, 2, PipelineSchedule::OneFOneB, PipelineBackward::Split).run(&tiny_lm()).unwrap();
    assert_eq!(stages.params, [vec!["embed".to_string(), "w".to_string()], vec!["embed".to_string()]]);
    // The transpose sits before the cut in the model, yet only the head's stage computes it.
    let transposes = |g: &Graph| g.nodes().filter(|(_, n)| n.op.name() == "transpose").count();
    assert_eq!(transposes(&graphs[0]), 0);
    assert!(transposes(&graphs[1]) > 0);
}

/// The pipeline golden files' model (an embedding, one unnumbered block, the tied head) with
/// its loss.
fn tiny_lm() -> Graph {
    let text = std::fs::read_to_string(crate::common::repo().join("tests/golden/pipeline_1f1b.ir")).unwrap();
    let input = text.split("# expect:").next().unwrap();
    let mut graph = autotp_ir::text::parse(input).unwrap();
    PassManager::new(vec![Box::new(AttachLoss)]).run(&mut graph).unwrap();
    graph
}
