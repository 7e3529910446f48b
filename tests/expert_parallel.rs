//! Expert parallelism (`--ep N` with `--dp N`, or `--dp` a multiple of it: groups of N data
//! ranks, Megatron's expert-data-parallel groups): the token dispatch (`expert-dispatch`) on the
//! global graph computes the same logits, loss and gradients as the model undispatched; the
//! Mixtral, DeepSeek-V3 (a shared expert beside the routed ones) and gpt-oss (experts with
//! biases, each table looked up by its own copy of the choices) fixtures train as one
//! rank does with their experts split by expert, alone, under ZeRO, with tensor, pipeline and
//! context parallelism; checkpoints resume under ep and under dp; each rank holds its experts
//! alone, has room all-to-all for the bytes the formula says, and sends the pairs the routing
//! sends (checked on a routing known in advance).

use std::collections::BTreeMap;

use autotp_frontend::ImportOptions;
use autotp_ir::{Graph, Op, Tensor};
use autotp_passes::autodiff::{Autodiff, GRAD_PREFIX};
use autotp_passes::expert_dispatch::{DispatchExperts, DispatchLayout, DropPolicy};
use autotp_passes::{Pass, PassManager};

use crate::common::{fixture, losses, max_abs_diff, read_npy, run_plan};
use crate::parallel::{train_model, within_contract};

/// The fixture `arch`'s training graph (simplified, its loss attached, differentiated), with
/// its experts dispatched in `layout` first when it has more than one rank; and its weights.
fn training_graph(arch: &str, layout: DispatchLayout) -> (Graph, BTreeMap<String, Tensor>) {
    let options = ImportOptions { batch: Some(4), seq_len: Some(32), ..ImportOptions::default() };
    let mut model = autotp_frontend::import_onnx(&fixture(arch, "model.onnx"), &options).unwrap();
    PassManager::simplify_pipeline().run(&mut model.graph).unwrap();
    let passes: Vec<Box<dyn Pass>> = vec![
        Box::new(autotp_passes::loss::AttachLoss),
        Box::new(DispatchExperts { layout, capacity: None }),
        Box::new(Autodiff::new(autotp_passes::loss::LOSS)),
    ];
    PassManager::new(passes).run(&mut model.graph).unwrap_or_else(|e| panic!("{arch} in {layout:?}: {e}"));
    (model.graph, model.weights)
}

fn count(graph: &Graph, pick: fn(&Op) -> bool) -> usize {
    graph.nodes().filter(|(_, n)| pick(&n.op)).count()
}

#[test]
fn dispatched_experts_train_as_the_undispatched_model() {
    for arch in ["mixtral", "deepseek_v3", "gpt_oss"] {
        let ids = read_npy(&fixture(arch, "input_ids.npy"));
        let inputs = [ids.clone(), ids];
        let (reference_graph, weights) = training_graph(arch, DispatchExperts::over(1).layout);
        let reference = autotp_ir::eval::eval_graph(&reference_graph, &weights, &inputs).unwrap();
        // Over 2 and 4 ranks, and over 2 with each rank's tokens in 2 context-parallel parts.
        let layouts = [(2, 1), (4, 1), (2, 2)].map(|(ranks, inner)| DispatchLayout { ranks, outer: 1, inner });
        for layout in layouts {
            let (graph, _) = training_graph(arch, layout);
            // Each mixture scatters its pairs into the send buffers and gathers them back: the
            // hidden states, the experts' ids and (Mixtral) the routing weights go out, the
            // pairs' results come back; the backward does the reverse.
            let scatters = count(&graph, |op| matches!(op, Op::ScatterElements { axis: 3, .. }));
            let gathers = count(&graph, |op| matches!(op, Op::GatherElements { axis: 3 }));
            assert!(scatters >= 2 && gathers >= 2, "{arch} in {layout:?}: {scatters} scatters, {gathers} gathers");

            let outputs = autotp_ir::eval::eval_graph(&graph, &weights, &inputs).unwrap();
            assert_eq!(graph.outputs().len(), reference_graph.outputs().len());
            let mut gradients = 0;
            for (((name, _), got), want) in graph.outputs().iter().zip(&outputs).zip(&reference) {
                let (diff, scale) = max_abs_diff(got, want);
                assert!(diff <= 1e-5 * scale.max(1e-3), "{arch} in {layout:?}: {name} differs by {diff} (max {scale})");
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
    let error = DispatchExperts::over(2).run(&mut llama.graph).unwrap_err().to_string();
    assert!(error.contains("--ep 2") && error.contains("has none"), "{error}");
    let mut mixtral = autotp_frontend::import_onnx(&fixture("mixtral", "model.onnx"), &options).unwrap();
    let error = DispatchExperts::over(3).run(&mut mixtral.graph).unwrap_err().to_string();
    assert!(error.contains("--ep 3 must divide the experts (4)") && error.contains("experts.gate_up_proj"), "{error}");
}

/// 30 AdamW steps of a global batch of 8 sequences of 32 tokens, against one rank: expert
/// parallelism alone, under ZeRO, with tensor parallelism (the experts split over ep and tp;
/// with sequence parallelism, as Megatron asks of ep with tp, also at a batch of one), with a
/// pipeline, beside context parallelism (each cp rank dispatching its own part of the
/// sequence; all-gathered keys and values, and around the ring under ZeRO 3), and over groups
/// of the data-parallel ranks (dp 4 x ep 2: ZeRO's shards over the groups, with a pipeline).
#[test]
fn expert_parallelism_trains_like_one_rank() {
    let dir = crate::common::scratch("expert-parallel");
    let layouts: &[(usize, &[&str])] = &[
        (4, &["--dp", "2", "--ep", "2"]),
        (2, &["--dp", "4", "--ep", "4"]),
        (4, &["--dp", "2", "--ep", "2", "--zero", "1"]),
        (4, &["--dp", "2", "--ep", "2", "--zero", "3"]),
        (2, &["--dp", "4", "--ep", "4", "--zero", "3"]),
        (4, &["--dp", "2", "--ep", "2", "--tp", "2"]),
        (4, &["--dp", "2", "--ep", "2", "--tp", "2", "--zero", "1"]),
        (4, &["--dp", "2", "--ep", "2", "--tp", "2", "--sequence-parallel"]),
        (1, &["--dp", "2", "--ep", "2", "--tp", "2", "--sequence-parallel", "--grad-accum", "4"]),
        (2, &["--dp", "2", "--ep", "2", "--pp", "2", "--grad-accum", "2"]),
        (1, &["--dp", "2", "--ep", "2", "--cp", "2", "--grad-accum", "4"]),
        (1, &["--dp", "2", "--ep", "2", "--cp", "2", "--cp-comm-type", "p2p", "--zero", "3", "--grad-accum", "4"]),
        (2, &["--dp", "4", "--ep", "2", "--zero", "1"]),
        (2, &["--dp", "4", "--ep", "2", "--zero", "3"]),
        (1, &["--dp", "4", "--ep", "2", "--pp", "2", "--grad-accum", "2"]),
    ];
    for arch in ["mixtral", "deepseek_v3", "gpt_oss"] {
        let single = train_model(&dir, arch, "model.onnx", 8, &[]);
        for &(micro_batch, flags) in layouts {
            let got = train_model(&dir, arch, "model.onnx", micro_batch, flags);
            let label = format!("{arch} {}", flags.join(" "));
            let (first, worst) = within_contract(&label, &got, &single);
            println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
    }
}

/// The experts' per-pair products run as grouped expert GEMMs (`autotp_kernels::grouped`; the
/// default, Megatron's `--moe-grouped-gemm`): one GEMM per expert over the pairs routed to it,
/// its matrix read where it lies. At dp 2 x ep 2, 8 sequences of 32 tokens a rank, every
/// mixture's lookup of an expert table and the products that read it (forward and input
/// gradient) and the outer products its gradient sums are grouped GEMMs (Mixtral and gpt-oss: 2
/// layers x 2 tables x 3; DeepSeek-V3: 1 layer, its first is dense), no gather copies a table
/// per pair, and the activations' peak is below one such copy (1024 pairs x Mixtral's `[256,
/// 64]` f32 matrix), which each lookup made before. Training matches the
/// batched form's (`--no-moe-grouped-gemm`: the gathers, batched matmuls and scatter-adds) and
/// the builtin kernels'.
#[test]
fn expert_products_run_as_grouped_gemms_without_a_matrix_per_pair() {
    use autotp_kernels::grouped::GroupedForm;
    use autotp_kernels::Kernel;
    use autotp_program::Instruction;
    let dir = crate::common::scratch("expert-parallel-grouped");
    let flags = ["--dp", "2", "--ep", "2"];
    for (arch, grouped_layers) in [("mixtral", 2), ("gpt_oss", 2), ("deepseek_v3", 1)] {
        let model = fixture(arch, "model.onnx");
        let args: Vec<String> = [model.to_str().unwrap(), "--micro-batch", "8", "--seq-len", "32"]
            .iter()
            .chain(&flags)
            .map(|s| s.to_string())
            .collect();
        let plan = crate::common::compile_shapes(&args, 2);
        let program = &plan.stages[0];
        let kernels: Vec<&Kernel> = (program.instructions.iter())
            .filter_map(|i| match i {
                Instruction::Kernel { kernel, .. } => Some(kernel),
                _ => None,
            })
            .collect();
        let forms: Vec<GroupedForm> = (kernels.iter())
            .filter_map(|k| match k {
                Kernel::GroupedMatMul { dims, .. } => Some(dims.form),
                _ => None,
            })
            .collect();
        let scattered = forms.iter().filter(|f| **f == GroupedForm::Scattered).count();
        assert_eq!((forms.len(), scattered), (grouped_layers * 2 * 3, grouped_layers * 2), "{arch}: {forms:?}");
        // What gathers remain look up token embeddings or gpt-oss's experts' biases: vectors.
        for kernel in &kernels {
            if let Kernel::Gather { data, .. } = kernel {
                assert!(data.len() == 2, "{arch}: a gather of a {data:?} table per pair remains");
            }
        }
        if arch == "mixtral" {
            let pairs_per_rank = 2 * 8 * 32 * 2;
            let one_copy = pairs_per_rank * 256 * 64 * 4;
            let peak = program.memory.activations_peak_bytes;
            println!("{arch}: activations peak {peak} bytes, one gathered copy {one_copy}");
            assert!(peak < one_copy, "{arch}: activations peak {peak} bytes, one gathered copy {one_copy}");
        }
        let grouped = train_model(&dir, arch, "model.onnx", 4, &flags);
        let batched = train_model(&dir, arch, "model.onnx", 4, &[&flags[..], &["--no-moe-grouped-gemm"]].concat());
        let builtin = train_model(&dir, arch, "model.onnx", 4, &[&flags[..], &["--kernels", "builtin"]].concat());
        for (against, curve) in [("batched", &batched), ("builtin", &builtin)] {
            let (first, worst) = within_contract(&format!("{arch} grouped against {against}"), &grouped, curve);
            println!("{arch}: grouped GEMMs against {against} ones: step 1 {first:.2e}, worst {worst:.2e}");
        }
        let grouped_count = |extra: &str| {
            let plan = crate::common::compile_shapes(&[&args[..], &[extra.to_string()]].concat(), 2);
            (plan.stages[0].instructions.iter())
                .filter(|i| matches!(i, Instruction::Kernel { kernel: Kernel::GroupedMatMul { .. }, .. }))
                .count()
        };
        assert_eq!(grouped_count("--no-moe-grouped-gemm"), 0, "{arch}: the experts' products stay batched");
        assert_eq!(grouped_count("--moe-grouped-gemm"), forms.len(), "{arch}: Megatron's flag names the default");
    }
}

/// A checkpoint of an expert-parallel run resumes bit-identically, and under plain data
/// parallelism (each rank's experts gathered into whole tables) and over groups of the
/// data-parallel ranks (dp 4 x ep 2 under ZeRO 1: the experts and the states split anew)
/// continues the same curve.
#[test]
fn expert_parallel_checkpoints_resume_under_ep_and_under_dp() {
    let dir = crate::common::scratch("expert-parallel-checkpoint");
    let model = fixture("mixtral", "model.onnx");
    let plan = |name: &str, micro_batch: &str, flags: &[&str]| {
        let path = dir.join(name);
        let mut args = vec!["compile", model.to_str().unwrap(), "--seq-len", "16", "--micro-batch", micro_batch];
        args.extend(flags);
        args.extend(["-o", path.to_str().unwrap()]);
        crate::common::success(crate::common::autotp(&args));
        path
    };
    let (ep, dp) = (plan("ep.atp", "4", &["--dp", "2", "--ep", "2"]), plan("dp.atp", "4", &["--dp", "2"]));
    let groups = plan("groups.atp", "2", &["--dp", "4", "--ep", "2", "--zero", "1"]);
    let (checkpoints, straight) = (dir.join("checkpoints"), dir.join("straight.jsonl"));
    run_plan(&ep, &straight, 6, &[]);
    run_plan(&ep, &dir.join("first.jsonl"), 3, &["--save", checkpoints.to_str().unwrap()]);
    let last = |path: &std::path::Path| losses(path).into_iter().map(|(_, l)| l).collect::<Vec<f64>>();
    let want = last(&straight)[3..].to_vec();
    for (label, resumed) in [("ep 2", &ep), ("dp 2", &dp), ("dp 4 x ep 2", &groups)] {
        let metrics = dir.join(format!("resumed-{}.jsonl", label.replace(' ', "")));
        run_plan(resumed, &metrics, 6, &["--resume", checkpoints.to_str().unwrap()]);
        if resumed == &ep {
            assert_eq!(last(&metrics), want, "resumed under {label}");
        } else {
            let (_, worst) = within_contract(&format!("resumed under {label}"), &last(&metrics), &want);
            println!("resumed under {label}: worst {worst:.2e} relative to ep 2 straight");
        }
    }
}

/// Rank 0's parameter and optimizer state bytes and bytes sent all-to-all per step, for the
/// Mixtral fixture at `micro_batch` sequences of 16 tokens per rank over `flags`.
fn mixtral_per_rank(micro_batch: usize, flags: &[&str]) -> (usize, usize, usize) {
    let model = fixture("mixtral", "model.onnx");
    let micro_batch = micro_batch.to_string();
    let args: Vec<String> = [model.to_str().unwrap(), "--micro-batch", &micro_batch, "--seq-len", "16"]
        .iter()
        .chain(flags)
        .map(|s| s.to_string())
        .collect();
    let plan = crate::common::compile_shapes(&args, 2);
    let report = autotp_program::report::report(&plan);
    let memory = &plan.stages[0].memory;
    (memory.params_bytes, memory.states_bytes, report.ranks[0].comm_bytes_per_step.all_to_all)
}

/// Each rank holds `1/n` of every layer's experts (Mixtral: 4 experts of `[256, 64]` and
/// `[64, 128]` f32 weights in each of 2 layers) and the rest of the model whole. Per layer each
/// rank exchanges send buffers of `n x P_r` rows (dropless: room for every pair of its own
/// with any one destination; `P_r` its pairs: its tokens x 2 choices) and sends `(n-1)/n` of
/// them: the forward sends each pair's hidden state, expert id and routing weight (`H + 2`
/// floats) and gets its result back (`H`); the backward returns the result's gradient (`H`) and
/// sends the hidden state's and routing weight's (`H + 1`). Beside context parallelism a rank's
/// tokens are its part of a sequence: `1/cp` of them, and so of the bytes. With an expert
/// capacity, a block holds each of the destination's experts' room for each of the rank's
/// sequences in place of all its pairs. Under ZeRO 1 (AdamW's
/// two states a parameter) the dense parameters' states are split over all dp ranks and a
/// rank's experts' over the `dp / n` groups that hold the same experts (none where ep = dp).
#[test]
fn expert_parallelism_holds_its_experts_and_exchanges_the_pairs_the_formula_says() {
    let (hidden, layers, choices) = (64, 2, 2);
    let expert_bytes = layers * 4 * (256 * 64 + 64 * 128) * 4;
    let floats = (hidden + 2) + hidden + hidden + (hidden + 1);
    for (dp, n, cp) in [(2usize, 2usize, 1usize), (4, 4, 1), (2, 2, 2), (4, 2, 1)] {
        let (dp_ranks, ranks, cp_ranks) = (dp.to_string(), n.to_string(), cp.to_string());
        // Context parallelism takes one sequence at a time.
        let micro_batch = if cp > 1 { 1 } else { 4 };
        let data = ["--dp", &dp_ranks, "--cp", &cp_ranks, "--zero", "1"];
        let (dp_params, _, dp_exchanged) = mixtral_per_rank(micro_batch, &data);
        let (ep_params, states, exchanged) = mixtral_per_rank(micro_batch, &[&data[..], &["--ep", &ranks]].concat());
        let label = format!("dp {dp} ep {n} cp {cp}");
        println!("{label}: parameters {ep_params} bytes per rank (dp alone {dp_params}), all-to-all {exchanged}");
        assert_eq!(dp_exchanged, 0, "dp {dp} alone exchanges nothing");
        assert_eq!(dp_params - ep_params, expert_bytes * (n - 1) / n, "{label}: each rank holds 1/{n} of the experts");
        let own_experts = expert_bytes / n;
        let split_states = 2 * ((ep_params - own_experts) / dp + own_experts / (dp / n));
        assert_eq!(states, split_states, "{label}: optimizer states under ZeRO 1");
        let pairs_per_rank = micro_batch * 16 / cp * choices;
        assert_eq!(exchanged, layers * (n - 1) * pairs_per_rank * floats * 4, "{label}: all-to-all bytes");
        if cp == 1 {
            // A capacity factor of 0.5: each expert's room is ceil(0.5 x 16 x 2 / 4) = 4 of a
            // sequence's 32 pairs, and a destination's block holds its 4/n experts' rooms for
            // each of the rank's sequences, in place of all the rank's pairs.
            let capacity = [&data[..], &["--ep", &ranks, "--moe-expert-capacity-factor", "0.5"]].concat();
            let (_, _, bounded) = mixtral_per_rank(micro_batch, &capacity);
            let room = micro_batch * (4 / n) * 4;
            println!("{label}: all-to-all {bounded} at capacity 0.5");
            assert_eq!(bounded, layers * (n - 1) * room * floats * 4, "{label}: all-to-all bytes at capacity 0.5");
        }
    }
    // The compile summary says what ep 2 beside cp 2 exchanges, among which ranks: 7
    // all-to-alls a layer (4 forward, 3 backward) of 16 pairs' 259 floats.
    let model = fixture("mixtral", "model.onnx");
    let plan = crate::common::scratch("expert-parallel-summary").join("plan.atp");
    let summary = crate::common::success(crate::common::autotp(&[
        "compile",
        model.to_str().unwrap(),
        "--seq-len",
        "16",
        "--micro-batch",
        "1",
        "--dp",
        "2",
        "--ep",
        "2",
        "--cp",
        "2",
        "-o",
        plan.to_str().unwrap(),
    ]));
    let line = summary.lines().find(|l| l.contains("expert parallelism:")).unwrap_or_default();
    assert!(
        line.contains("among the dp ranks of the same part of the sequence (cp=2)")
            && line.contains("14 all-to-alls per rank per step (at most 33,152 bytes sent"),
        "{summary}"
    );
}

/// Over groups of the data-parallel ranks, tensor parallelism splits what it splits over dp
/// alone: gpt-oss's per-head sink logits follow their heads (their broadcast over the batch is
/// sliced over ep before tp slices it).
#[test]
fn expert_parallel_groups_keep_the_tensor_parallel_splits() {
    let model = fixture("gpt_oss", "model.onnx");
    let plan = crate::common::scratch("expert-parallel-groups-tp").join("plan.atp");
    let explain = |flags: &[&str]| {
        let compile = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "2", "--tp", "2"];
        let args = [&compile[..], flags, &["--explain-tp", "-o", plan.to_str().unwrap()]].concat();
        let out = crate::common::success(crate::common::autotp(&args));
        out.lines().find(|l| l.contains("layers.0.self_attn.sinks")).unwrap_or_default().to_string()
    };
    for flags in [&["--dp", "4"][..], &["--dp", "4", "--ep", "4"], &["--dp", "4", "--ep", "2"]] {
        let line = explain(flags);
        assert!(line.contains("shard(0)") && line.contains("attention sinks"), "{flags:?}: {line}");
    }
}

#[test]
fn expert_parallelism_refuses_layouts_it_does_not_build() {
    let plan = crate::common::scratch("expert-parallel-refusals").join("plan.atp");
    let compile_model = |arch: &str, flags: &[&str]| {
        let model = fixture(arch, "model.onnx");
        let mut args = vec!["compile", model.to_str().unwrap(), "--seq-len", "16", "--micro-batch", "4"];
        args.extend(flags);
        args.extend(["-o", plan.to_str().unwrap()]);
        crate::common::failure(crate::common::autotp(&args))
    };
    let compile = |flags: &[&str]| compile_model("mixtral", flags);
    let message = compile(&["--ep", "2"]);
    assert!(message.contains("--ep 2 splits the experts over groups of 2 data-parallel ranks: it must divide --dp 1"));
    let message = compile(&["--dp", "6", "--ep", "4"]);
    assert!(message.contains("it must divide --dp 6"), "{message}");
    let message = compile_model("llama", &["--dp", "2", "--ep", "2"]);
    assert!(message.contains("this model has none"), "{message}");
    // A capacity counts each sequence's pairs: it needs a mixture, whole sequences on each rank,
    // a positive factor and one of Megatron's drop policies.
    let message = compile_model("llama", &["--moe-expert-capacity-factor", "1"]);
    assert!(message.contains("--moe-expert-capacity-factor 1 is for a mixture of experts"), "{message}");
    let message = compile(&["--dp", "2", "--ep", "2", "--cp", "2", "--moe-expert-capacity-factor", "1"]);
    assert!(message.contains("--cp 2 splits each sequence"), "{message}");
    let message = compile(&["--moe-expert-capacity-factor", "0"]);
    assert!(message.contains("--moe-expert-capacity-factor 0 must be a positive number"), "{message}");
    let message = compile(&["--moe-expert-capacity-factor", "1", "--moe-token-drop-policy", "random"]);
    assert!(message.contains("'random'") && message.contains("position, probs"), "{message}");
    // Megatron's other MoE flags: padding to the capacity needs one; the dispatch is all-to-all.
    let message = compile(&["--moe-pad-expert-input-to-capacity"]);
    assert!(message.contains("it needs --moe-expert-capacity-factor"), "{message}");
    let message = compile(&["--dp", "2", "--ep", "2", "--moe-token-dispatcher-type", "allgather"]);
    assert!(message.contains("'allgather'") && message.contains("alltoall"), "{message}");
    let plan = crate::common::scratch("expert-parallel-refusals").join("megatron.atp");
    let model = fixture("mixtral", "model.onnx");
    crate::common::success(crate::common::autotp(&[
        "compile",
        model.to_str().unwrap(),
        "--seq-len",
        "16",
        "--micro-batch",
        "2",
        "--dp",
        "2",
        "--ep",
        "2",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--moe-expert-capacity-factor",
        "1",
        "--moe-pad-expert-input-to-capacity",
        "-o",
        plan.to_str().unwrap(),
    ]));
}

/// An expert-parallel plan's ranks as MPI processes train bit for bit as its CPU rank threads
/// do, and on emulated GPUs (the exchanges over the emulated NCCL) within rounding: over dp,
/// and over groups of it (dp 4 x ep 2 under ZeRO 1: all-to-alls over the ep axis, reductions
/// over both).
#[test]
fn expert_parallel_ranks_as_processes_and_on_emulated_gpus_train_like_threads() {
    let dir = crate::common::scratch("expert-parallel-devices");
    let model = fixture("mixtral", "model.onnx");
    let layouts: [(&str, &str, &[&str]); 2] =
        [("ep", "4", &["--dp", "2", "--ep", "2"]), ("groups", "2", &["--dp", "4", "--ep", "2", "--zero", "1"])];
    for (name, micro_batch, flags) in layouts {
        let plan = dir.join(format!("{name}.atp"));
        let compile = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", micro_batch];
        crate::common::success(crate::common::autotp(&[&compile[..], flags, &["-o", plan.to_str().unwrap()]].concat()));
        let run = |device: &str, extra: &[&str]| {
            let metrics = dir.join(format!("{name}-{device}.jsonl"));
            let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
            command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "6"]);
            command.args(["--metrics-out", metrics.to_str().unwrap()]).args(extra);
            let out = command.env("AUTOTP_GPU", "emulated").output().unwrap();
            let printed = String::from_utf8_lossy(&out.stderr).into_owned() + &crate::common::success(out);
            let exchanged: Vec<String> =
                printed.lines().filter(|l| l.starts_with("all-to-all of rank")).map(str::to_string).collect();
            (losses(&metrics), exchanged)
        };
        let ranks = (flags[1]).to_string();
        let (threads, exchanged) = run("threads", &["--device", "cpu"]);
        let (processes, exchanged_by_processes) = run("processes", &["--device", "cpu", "--launch", &ranks]);
        assert_eq!(processes, threads, "{name}: ranks as MPI processes");
        // Each rank sends the pairs its routing sends (MPI_Alltoallv), not its buffers' room:
        // about half of it with 2 ranks, and what the threads count.
        println!("{name}: {exchanged:#?}");
        assert_eq!(exchanged_by_processes, exchanged, "{name}: all-to-all bytes of MPI processes and threads");
        assert_eq!(exchanged.len(), ranks.parse::<usize>().unwrap(), "{name}: a line per rank");
        for line in &exchanged {
            let percent: f64 = line.split(", ").nth(1).and_then(|p| p.split('%').next()?.parse().ok()).unwrap();
            assert!(percent > 25.0 && percent < 75.0, "{name}: {line}");
        }
        // Within rounding on emulated GPUs: the Mixtral plan without ep differs from its CPU
        // ranks by the same 1.4e-7 at step 4 (a GPU form that sums in another order).
        let on_gpus: Vec<f64> = run("emulated-gpus", &["--device", "cuda"]).0.into_iter().map(|(_, l)| l).collect();
        let threads: Vec<f64> = threads.into_iter().map(|(_, l)| l).collect();
        let (first, worst) = within_contract(&format!("{name} on emulated GPUs"), &on_gpus, &threads);
        assert!(first == 0.0 && worst < 1e-6, "{name} on emulated GPUs: step 1 {first:.2e}, worst {worst:.2e}");
    }
}

/// The bytes each rank sends all-to-all per step (`run`'s "all-to-all of rank R" lines), by rank.
fn all_to_all_sent(stderr: &str) -> Vec<usize> {
    let sent = |line: &str| line.split(": ").nth(1)?.split(' ').next()?.replace(',', "").parse().ok();
    stderr.lines().filter(|l| l.starts_with("all-to-all of rank")).map(|l| sent(l).unwrap()).collect()
}

/// The all-to-all bytes checked against a routing known in advance: with every router weight
/// zero, each token's scores tie and the top 2 are experts 0 and 1, both on rank 0 of 2. So
/// rank 1 sends every one of its `P` pairs' hidden state, expert id and routing weight, and
/// later their results' gradients (`(H + 2) + H` floats a pair, a layer), rank 0 their results
/// and the hidden states' and routing weights' gradients (`H + (H + 1)`), and nothing else
/// moves: not rank 0's pairs, which stay on it, nor any padding. A zero learning rate keeps the
/// routing for every step.
#[test]
fn expert_parallel_all_to_alls_send_what_the_routing_sends() {
    let dir = crate::common::scratch("expert-parallel-routing");
    let original = fixture("mixtral", "model.onnx");
    let (layers, hidden, experts, choices) = (2, 64, 4, 2);
    let zeros = vec![0u8; experts * hidden * 4];
    let weights: BTreeMap<String, autotp_frontend::onnx::export::Weight> = (0..layers)
        .map(|l| {
            let weight = autotp_frontend::onnx::export::Weight {
                dtype: autotp_ir::DType::F32,
                shape: vec![experts, hidden],
                bytes: &zeros,
            };
            (format!("m.model.layers.{l}.mlp.gate.weight"), weight)
        })
        .collect();
    let exported = autotp_frontend::onnx::export::with_weights(&original, &weights, None, "model.onnx.data").unwrap();
    assert_eq!((exported.replaced, exported.external_data.is_none()), (layers, true));
    let model = dir.join("tied-router.onnx");
    std::fs::write(&model, exported.model).unwrap();
    let plan = dir.join("plan.atp");
    let (micro_batch, seq_len) = (4, 16);
    crate::common::success(crate::common::autotp(&[
        "compile",
        model.to_str().unwrap(),
        "--seq-len",
        &seq_len.to_string(),
        "--micro-batch",
        &micro_batch.to_string(),
        "--dp",
        "2",
        "--ep",
        "2",
        "--lr",
        "0",
        "-o",
        plan.to_str().unwrap(),
    ]));
    let stderr = run_plan(&plan, &dir.join("metrics.jsonl"), 3, &[]);
    let pairs = micro_batch * seq_len * choices;
    let bytes = |floats: usize| layers * pairs * floats * 4;
    assert_eq!(all_to_all_sent(&stderr), [bytes(hidden + 1 + hidden), bytes(hidden + 2 + hidden)], "{stderr}");
}

/// `--moe-expert-capacity-factor` (Megatron's, counted per sequence) with its `position`
/// policy: on expert_dispatch.ir's mixture (top-2 of 4 experts, 4 tokens in 2 sequences of 2)
/// with a factor of 1, each expert takes ceil(1 x 2 x 2 / 4) = 1 pair of each sequence, the
/// first in token order. Both tokens of each sequence are the same, so they choose the same two
/// experts and the second token's pairs are dropped. The output is what the undispatched model's
/// per-pair results give with the dropped pairs left out of each token's sum, counted here from
/// the router's choices on their own; over 2 expert-parallel ranks it is the same.
#[test]
fn a_capacity_drops_each_experts_pairs_past_its_room_in_token_order() {
    let x_row = [0.3f32, -1.2, 0.8, -0.5, 0.9, 0.1];
    let x = [&x_row[..3], &x_row[..3], &x_row[3..], &x_row[3..]].concat();
    let dropped = capacity_case(&x, DropPolicy::Position);
    assert_eq!(dropped, [2, 3, 6, 7], "the second token of each sequence repeats the first's choices");
}

/// The same with Megatron's `probs` policy: of the pairs a sequence routes to an expert, it
/// keeps the one of the largest routing weight. The two tokens of each sequence differ here and
/// share an expert, and the pair dropped is not always the later one: the policies differ.
#[test]
fn a_probs_capacity_keeps_each_experts_pairs_of_the_largest_weights() {
    let x = [0.3f32, -1.2, 0.8, 0.9, -0.4, 0.2, -0.5, 0.9, 0.1, 0.7, 0.3, -0.8];
    let by_weight = capacity_case(&x, DropPolicy::Probability);
    let by_position = capacity_case(&x, DropPolicy::Position);
    assert!(!by_weight.is_empty(), "the tokens of a sequence share an expert");
    assert_ne!(by_weight, by_position, "the policies drop different pairs of this input");
    println!("dropped by weight {by_weight:?}, by position {by_position:?}");
    // A mixture whose pairs' results no routing weight multiplies has nothing to rank them by.
    let text = std::fs::read_to_string(crate::common::repo().join("tests/golden/expert_dispatch.ir")).unwrap();
    let unweighted = text.split_once("# expect:\n").unwrap().0.replace("%15 = mul %13, %14", "%15 = relu %13");
    let mut graph = autotp_ir::text::parse(&unweighted).unwrap();
    let capacity =
        autotp_passes::expert_dispatch::ExpertCapacity { sequence: 2, factor: 1.0, policy: DropPolicy::Probability };
    let layout = DispatchLayout { ranks: 2, outer: 1, inner: 1 };
    let message = DispatchExperts { layout, capacity: Some(capacity) }.run(&mut graph).unwrap_err().to_string();
    assert!(message.contains("ranks each expert's pairs by their routing weights"), "{message}");
}

/// Runs expert_dispatch.ir's mixture on `x` (4 tokens of 3, two sequences of two) with a
/// capacity factor of 1 under `policy`, on one rank and over 2, against its undispatched
/// per-pair results summed over the pairs the policy keeps, counted here from the router's
/// choices and weights on their own; returns the dropped pairs.
fn capacity_case(x: &[f32], policy: DropPolicy) -> Vec<usize> {
    use autotp_passes::expert_dispatch::ExpertCapacity;
    let text = std::fs::read_to_string(crate::common::repo().join("tests/golden/expert_dispatch.ir")).unwrap();
    let original = autotp_ir::text::parse(text.split_once("# expect:\n").unwrap().0).unwrap();
    // The choices (the lookups' ids), their weights (the router's top-k values) and the
    // per-pair results (what the sum over choices reads).
    let ids = (original.nodes()).find(|(_, n)| matches!(n.op, Op::Gather { axis: 0 })).unwrap().1.inputs[1];
    let top_k = original.nodes().find(|(_, n)| matches!(n.op, Op::TopK { .. })).unwrap().1.outputs[0];
    let sum = original.nodes().find(|(_, n)| matches!(n.op, Op::Reduce { .. })).unwrap().1;
    let autotp_ir::Def::Node(reshape, _) = original.value(sum.inputs[0]).def else { panic!("the sum reads a reshape") };
    let per_pair = original.node(reshape).inputs[0];
    let mut probed = original.clone();
    probed.add_output("ids", ids);
    probed.add_output("weights", top_k);
    probed.add_output("per_pair", per_pair);

    let x = Tensor::from_f32(vec![4, 3], x);
    let weights: BTreeMap<String, Tensor> = (original.params().iter())
        .map(|&p| {
            let name = original.name_of(p).unwrap().to_string();
            let seed = name.len() as u64;
            (name, crate::common::random_tensor(original.ty(p), seed))
        })
        .collect();
    let probes = autotp_ir::eval::eval_graph(&probed, &weights, std::slice::from_ref(&x)).unwrap();
    let (choices, routing, results) = (&probes[1], &probes[2], &probes[3]);
    let (tokens_per_sequence, k, width, room) = (2, 2, 3, 1);
    // Each sequence's pairs of each expert, in the order the policy keeps them.
    let mut by_expert: BTreeMap<(usize, i64), Vec<usize>> = BTreeMap::new();
    for pair in 0..8 {
        let (token, expert) = (pair / k, choices.get_f64(pair) as i64);
        by_expert.entry((token / tokens_per_sequence, expert)).or_default().push(pair);
    }
    if policy == DropPolicy::Probability {
        for pairs in by_expert.values_mut() {
            // Largest weight first; a stable sort keeps token order among equal weights.
            pairs.sort_by(|&a, &b| routing.get_f64(b).total_cmp(&routing.get_f64(a)));
        }
    }
    let mut dropped: Vec<usize> = by_expert.values().flat_map(|pairs| pairs[room..].to_vec()).collect();
    dropped.sort();
    let mut want = vec![0f32; 4 * width];
    for pair in (0..8).filter(|p| !dropped.contains(p)) {
        for j in 0..width {
            want[pair / k * width + j] += results.get_f64(pair * width + j) as f32;
        }
    }
    for ranks in [1, 2] {
        let mut graph = original.clone();
        let capacity = Some(ExpertCapacity { sequence: tokens_per_sequence, factor: 1.0, policy });
        let layout = DispatchLayout { ranks, outer: 1, inner: 1 };
        DispatchExperts { layout, capacity }.run(&mut graph).unwrap();
        let got = autotp_ir::eval::eval_graph(&graph, &weights, std::slice::from_ref(&x)).unwrap();
        let want = Tensor::from_f32(vec![4, width], &want);
        let (diff, scale) = max_abs_diff(&got[0], &want);
        assert!(
            diff <= 1e-6 * scale.max(1.0),
            "{policy:?} over {ranks} ranks: {diff} from the kept pairs' sum (max {scale}; dropped {dropped:?})"
        );
    }
    dropped
}

/// 30 AdamW steps of 8 sequences of 32 tokens with `--moe-expert-capacity-factor 1` (each of
/// the Mixtral and DeepSeek-V3 fixtures' 4 experts takes 16 of a sequence's 64 (token, choice)
/// pairs): the same pairs drop in every layout, so every layout trains like one rank with the
/// same capacity, and the drops change the curve from the dropless one. A factor of 2 (E / k)
/// gives each expert room for a whole sequence: nothing drops, and it trains like the dropless
/// model. With `--moe-token-drop-policy probs` other pairs drop, again the same in every
/// layout.
#[test]
fn expert_capacity_drops_the_same_pairs_in_every_layout() {
    let dir = crate::common::scratch("expert-capacity");
    let layouts: &[(usize, &[&str])] = &[
        (4, &["--dp", "2"]),
        (4, &["--dp", "2", "--ep", "2"]),
        (2, &["--dp", "4", "--ep", "4"]),
        (4, &["--dp", "2", "--ep", "2", "--zero", "3"]),
        (4, &["--dp", "2", "--ep", "2", "--tp", "2", "--sequence-parallel"]),
        (2, &["--dp", "2", "--ep", "2", "--pp", "2", "--grad-accum", "2"]),
        (2, &["--dp", "4", "--ep", "2", "--zero", "1"]),
    ];
    let capacity = ["--moe-expert-capacity-factor", "1"];
    for arch in ["mixtral", "deepseek_v3"] {
        let dropless = train_model(&dir, arch, "model.onnx", 8, &[]);
        let single = train_model(&dir, arch, "model.onnx", 8, &capacity);
        let first_step_change = (single[0] - dropless[0]).abs() / dropless[0].abs();
        println!("{arch}: capacity 1 against dropless at step 1: {first_step_change:.2e} relative");
        assert!(first_step_change > 1e-5, "{arch}: a capacity of 1 drops pairs and changes the loss");
        for &(micro_batch, flags) in layouts {
            let got = train_model(&dir, arch, "model.onnx", micro_batch, &[&capacity[..], flags].concat());
            let label = format!("{arch} capacity 1 {}", flags.join(" "));
            let (first, worst) = within_contract(&label, &got, &single);
            println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
        let roomy = ["--moe-expert-capacity-factor", "2", "--dp", "2", "--ep", "2"];
        let got = train_model(&dir, arch, "model.onnx", 4, &roomy);
        let (first, worst) = within_contract(&format!("{arch} capacity 2"), &got, &dropless);
        println!("{arch}: capacity 2 (room for a whole sequence): step 1 {first:.2e}, worst {worst:.2e}");
        // Megatron's `probs` policy keeps other pairs, the same in every layout.
        let probs = [&capacity[..], &["--moe-token-drop-policy", "probs"]].concat();
        let by_weight = train_model(&dir, arch, "model.onnx", 8, &probs);
        let change = (by_weight[0] - single[0]).abs() / single[0].abs();
        println!("{arch}: probs against position at step 1: {change:.2e} relative");
        assert!(change > 1e-5, "{arch}: the probs policy drops other pairs than the position policy");
        for &(micro_batch, flags) in &layouts[1..5] {
            let got = train_model(&dir, arch, "model.onnx", micro_batch, &[&probs[..], flags].concat());
            let label = format!("{arch} capacity 1 probs {}", flags.join(" "));
            let (first, worst) = within_contract(&label, &got, &by_weight);
            println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
    }
}
