//! Context parallelism (`--cp N`): each sequence split over N ranks, attention taking each
//! rank's queries over the keys and values all-gathered from every rank, or (`--cp-comm-type
//! a2a`, DeepSpeed-Ulysses) each rank's heads over the whole sequence, exchanged all-to-all. It
//! trains the fixtures as one rank does, alone and with tensor, data (ZeRO 1 and 3) and
//! pipeline parallelism; it moves the bytes the formulas say, and each rank holds a share of the
//! activations.

use crate::parallel::{train_model, within_contract};

/// 30 AdamW steps of a global batch of 8 sequences of 32 tokens, against one rank, alone and
/// with tp, pp, dp and ZeRO; in Megatron's load-balanced order, and in contiguous blocks.
#[test]
fn context_parallelism_trains_like_one_rank() {
    let dir = crate::common::scratch("context-parallel");
    let layouts: &[&[&str]] = &[
        &["--cp", "2", "--grad-accum", "8"],
        &["--cp", "4", "--grad-accum", "8"],
        &["--cp", "4", "--cp-contiguous", "--grad-accum", "8"],
        &["--cp", "2", "--tp", "2", "--grad-accum", "8"],
        &["--cp", "2", "--pp", "2", "--grad-accum", "8"],
        &["--cp", "2", "--cp-comm-type", "a2a", "--grad-accum", "8"],
        &["--cp", "2", "--cp-comm-type", "a2a", "--pp", "2", "--grad-accum", "8"],
        // With dp: the rows that flatten a rank's sequence split over dp, then its tokens over cp.
        &["--cp", "2", "--dp", "2", "--grad-accum", "4"],
        &["--cp", "2", "--dp", "2", "--zero", "3", "--grad-accum", "4"],
        &["--cp", "2", "--dp", "2", "--tp", "2", "--grad-accum", "4"],
        &["--cp", "2", "--dp", "2", "--tp", "2", "--zero", "1", "--grad-accum", "4"],
        &["--cp", "2", "--dp", "2", "--cp-comm-type", "a2a", "--zero", "2", "--grad-accum", "4"],
        &["--cp", "2", "--dp", "2", "--pp", "2", "--grad-accum", "4"],
    ];
    for arch in ["llama", "gpt2"] {
        let single = train_model(&dir, arch, "model.onnx", 8, &[]);
        for flags in layouts {
            let got = train_model(&dir, arch, "model.onnx", 1, flags);
            let label = format!("{arch} micro-batch 1 {}", flags.join(" "));
            let (first, worst) = within_contract(&label, &got, &single);
            println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
    }
}

/// One compile of `arch`'s fixture cut to `layers` layers (one sequence of `seq_len` tokens)
/// a rank) over `--cp cp --dp dp --zero zero`: rank 0's activation peak, its bytes sent per
/// step by all-reduces, reduce-scatters and all-gathers, and its parameters' bytes.
fn compiled(arch: &str, layers: usize, seq_len: usize, cp: usize, dp: usize, zero: usize) -> (i64, [i64; 3], i64) {
    let model = crate::common::fixture(arch, "model.onnx");
    let args: Vec<String> = [model.to_str().unwrap(), "--micro-batch", "1"]
        .iter()
        .map(|s| s.to_string())
        .chain(["--seq-len".into(), seq_len.to_string(), "--cp".into(), cp.to_string()])
        .chain(["--dp".into(), dp.to_string(), "--zero".into(), zero.to_string()])
        .collect();
    let plan = crate::common::compile_shapes(&args, layers);
    let report = autotp_program::report::report(&plan);
    let sent = &report.ranks[0].comm_bytes_per_step;
    let memory = &plan.stages[0].memory;
    let sent = [sent.all_reduce as i64, sent.reduce_scatter as i64, sent.all_gather as i64];
    (memory.activations_peak_bytes as i64, sent, memory.params_bytes as i64)
}

/// Per layer, each rank all-gathers the key and the value (`b x h_kv x s x d` each, f32) and
/// reduce-scatters their gradients: `2 x 4bh_kv sd x (N-1)/N` bytes sent each way, with dp as
/// without (a rank's sequence is its own). The weights' gradients (and the loss) are
/// all-reduced over cp as over dp: `2 (N-1)/N` of their bytes; with dp, reduce-scattered over
/// cp, all-reduced over dp and gathered over cp, `2 (N-1)/N + 2 (D-1)/(DN)` (Megatron's one
/// all-reduce over dp x cp), except GPT-2's position table: every sequence reads the same
/// rows, so its gradient is summed over dp before the scatter into the table, on the rank's
/// `s/N` positions.
#[test]
fn context_parallelism_moves_the_keys_and_values_the_formula_says() {
    // (arch, tokens, key/value heads, head dim, position table bytes): GPT-2's position table
    // has 128 rows of 64.
    for (arch, s, kv_heads, head_dim, table) in
        [("llama", 1024i64, 2i64, 16i64, 0i64), ("gpt2", 128, 4, 16, 128 * 64 * 4)]
    {
        for (n, d) in [(2i64, 1i64), (4, 1), (2, 2)] {
            let (_, [ar, rs, ag], params) = compiled(arch, 2, s as usize, n as usize, d as usize, 0);
            let key_value = 2 * 4 * kv_heads * s * head_dim * (n - 1) / n;
            println!("{arch} cp {n} dp {d}: all-gathers {ag}, reduce-scatters {rs}, all-reduces {ar} bytes per rank");
            // `2 (N-1)/N` of `bytes` all-reduced over an axis of N ranks; on each axis, the
            // gradients and two one-element all-reduces: the loss and the finite check's flag.
            let over = |ranks: i64, bytes: i64| 2 * (ranks - 1) * bytes / ranks;
            let (all_reduced, scattered) = if d == 1 {
                (over(n, params + 8), 0)
            } else {
                // Each gradient is reduce-scattered over cp, its block all-reduced over dp and
                // gathered over cp; GPT-2's position table is summed over dp before its
                // scatter into the table (on the rank's positions) and over cp whole.
                let rest = params - table;
                (over(d, rest / n + table / n + 8) + over(n, table + 8), (n - 1) * rest / n)
            };
            assert_eq!(ag, 2 * key_value + scattered, "{arch} cp {n} dp {d}: all-gathers");
            assert_eq!(rs, 2 * key_value + scattered, "{arch} cp {n} dp {d}: reduce-scatters");
            assert_eq!(ar, all_reduced, "{arch} cp {n} dp {d}: all-reduces");
        }
        // ZeRO 1 reduce-scatters the gradients over dp first: each rank sums its shard over cp,
        // `2 (N-1)/N` of `1/D` of their bytes (the scalars as above).
        let (_, [ar, rs, _], params) = compiled(arch, 2, s as usize, 2, 2, 1);
        let key_value = 2 * 4 * kv_heads * s * head_dim / 2;
        assert_eq!(rs, params / 2 + 2 * key_value, "{arch} cp 2 dp 2 ZeRO 1: reduce-scatters");
        assert_eq!(ar, params / 2 + 8 + 8, "{arch} cp 2 dp 2 ZeRO 1: all-reduces");
    }
}

/// Ulysses (`--cp-comm-type a2a`): per layer each rank exchanges its tokens' query, key and
/// value for its heads' whole sequence and the output back, and the backward the gradients
/// likewise: `2 x (2h + 2h_kv) x 4 (s/N) d x (N-1)/N` bytes sent all-to-all, nothing gathered.
/// (GPT-2 at cp 4: one head a rank.)
#[test]
fn ulysses_exchanges_the_heads_the_formula_says() {
    for (arch, s, heads, kv_heads, head_dim, cps) in
        [("llama", 1024i64, 4i64, 2i64, 16i64, &[2i64][..]), ("gpt2", 128, 4, 4, 16, &[2, 4])]
    {
        for &n in cps {
            let model = crate::common::fixture(arch, "model.onnx");
            let args: Vec<String> = [model.to_str().unwrap(), "--micro-batch", "1", "--cp-comm-type", "a2a"]
                .iter()
                .map(|s| s.to_string())
                .chain(["--seq-len".into(), s.to_string(), "--cp".into(), n.to_string()])
                .collect();
            let plan = crate::common::compile_shapes(&args, 2);
            let sent = autotp_program::report::report(&plan).ranks[0].comm_bytes_per_step.clone();
            let per_layer = 2 * (2 * heads + 2 * kv_heads) * 4 * (s / n) * head_dim * (n - 1) / n;
            println!(
                "{arch} cp {n} a2a: all-to-all {} bytes per rank, all-gather {}",
                sent.all_to_all, sent.all_gather
            );
            assert_eq!(sent.all_to_all as i64, 2 * per_layer, "{arch} cp {n}");
            assert_eq!((sent.all_gather, sent.reduce_scatter), (0, 0), "{arch} cp {n}");
        }
    }
}

/// Each rank holds its tokens' activations: a layer holds `1/N` of what it holds on one rank,
/// and beside it the keys and values gathered from the other ranks for the backward (`2 x
/// 4bh_kv sd x (N-1)/N` bytes) and the positions its two runs of queries start at (i64s). The
/// keys and values put back in position order for attention replace the gathered ones, and
/// their gradients' reordering is transient: neither adds to a layer. The causal mask
/// is the attention op's, at each rank's positions: no `[s, s]` matrix is held. (Llama at 1024
/// tokens, where the layers' activations make the peak; GPT-2's position table stops at 128,
/// where the head's logits do.)
#[test]
fn context_parallelism_splits_the_activations() {
    for (arch, s, kv_heads, head_dim) in [("llama", 1024i64, 2i64, 16i64)] {
        let layer = |n: i64| {
            compiled(arch, 2, s as usize, n as usize, 1, 0).0 - compiled(arch, 1, s as usize, n as usize, 1, 0).0
        };
        let whole = layer(1);
        for n in [2i64, 4] {
            let split = layer(n);
            let gathered = 2 * 4 * kv_heads * s * head_dim * (n - 1) / n;
            println!(
                "{arch} cp {n}: a layer holds {split} bytes, {whole} on one rank; keys and values gathered {gathered}"
            );
            // Each rank's queries come in two runs (Megatron's load balance), each with its first
            // position (an i64).
            assert_eq!(split, whole / n + gathered + 2 * 8, "{arch} cp {n}");
        }
    }
}

/// `--cp` splits one sequence at a time, over tokens it divides, and not with Megatron's
/// sequence parallelism; the summary says what it does.
#[test]
fn context_parallelism_is_summarised_and_refused_where_it_cannot_split() {
    let model = crate::common::fixture("llama", "model.onnx");
    let m = model.to_str().unwrap();
    let out = crate::common::success(crate::common::autotp(&[
        "compile",
        m,
        "--seq-len",
        "32",
        "--micro-batch",
        "1",
        "--cp",
        "4",
        "-o",
        "/dev/null",
    ]));
    assert!(out.contains("context parallelism: each sequence's 32 tokens split over cp=4 (8 per rank)"), "{out}");
    assert!(out.contains("4 all-gathers of keys and values (12,288)"), "{out}");
    let compile = |extra: &[&str]| {
        let args = [&["compile", m, "-o", "/dev/null"][..], extra];
        crate::common::failure(crate::common::autotp(&args.concat()))
    };
    let err = compile(&["--seq-len", "30", "--micro-batch", "1", "--cp", "4"]);
    assert!(err.contains("--cp 4 splits each sequence's 30 tokens: they must divide"), "{err}");
    let err = compile(&["--seq-len", "32", "--micro-batch", "2", "--cp", "2"]);
    assert!(err.contains("give --micro-batch 1 and more sequences per step with --grad-accum"), "{err}");
    let err = compile(&["--seq-len", "32", "--micro-batch", "1", "--cp", "2", "--tp", "2", "--sequence-parallel"]);
    assert!(err.contains("--sequence-parallel and --cp both split a sequence's tokens"), "{err}");
    let err = compile(&["--seq-len", "32", "--micro-batch", "1", "--cp", "2", "--tp", "2", "--cp-comm-type", "a2a"]);
    assert!(err.contains("--cp-comm-type a2a splits attention's heads over cp: with --tp"), "{err}");
    // Heads cp does not divide (Llama's grouped query heads, [1, 2, 2, s, d], at cp 4): Ulysses'
    // attention would run whole on every rank.
    let err = compile(&["--seq-len", "32", "--micro-batch", "1", "--cp", "4", "--cp-comm-type", "a2a"]);
    assert!(err.contains("would run whole on every cp rank: cp=4 divides neither its queries' heads"), "{err}");
    let err = compile(&["--seq-len", "32", "--micro-batch", "1", "--cp", "2", "--cp-comm-type", "ring"]);
    assert!(err.contains("--cp-comm-type 'ring' is not one of all_gather, p2p, a2a"), "{err}");
}

/// Megatron's load balance is the default: every rank's causal attention covers as many
/// query-key pairs (the summary's figures: contiguous blocks of 8 of 32 tokens cover 36 to 228).
/// `--cp-contiguous`, or a sequence that 2 x cp does not divide, keeps contiguous blocks and
/// says why.
#[test]
fn load_balance_evens_the_causal_work() {
    let model = crate::common::fixture("llama", "model.onnx");
    let compile = |seq_len: &str, extra: &[&str]| {
        let base = ["compile", model.to_str().unwrap(), "--seq-len", seq_len, "--micro-batch", "1", "--cp", "4"];
        crate::common::autotp(&[&base[..], extra, &["-o", "/dev/null"]].concat())
    };
    let out = crate::common::success(compile("32", &[]));
    assert!(
        out.contains(
            "load-balanced (Megatron): the sequence in 8 chunks, rank r holding chunks r and 7-r; causal query-key \
             pairs per rank per sequence and head: 132 each (contiguous blocks: 36 to 228)"
        ),
        "{out}"
    );
    let out = crate::common::success(compile("32", &["--cp-contiguous"]));
    assert!(
        out.contains("contiguous blocks; causal query-key pairs per rank per sequence and head: 36 to 228"),
        "{out}"
    );
    let run = compile("36", &[]);
    let (out, err) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{err}");
    assert!(out.contains("contiguous blocks; causal query-key pairs per rank per sequence and head:"), "{out}");
    assert!(err.contains("not load-balanced: the sequence of 36 tokens does not cut into 2 x cp = 8 chunks"), "{err}");
}

/// DeepSeek-V3's group-limited routing marks each token's chosen groups by scattering ones
/// (ScatterElements along the groups). At its real shape over dp 8 (8 sequences of 4096 tokens)
/// those ones are a broadcast, not a folded constant, and the scatter stayed a ScatterND of
/// every token's coordinates: gathered over cp and dp to run whole on every rank, and counting
/// along the global token dim, so cp kept contiguous blocks (2026-11-30). It is a comparison per
/// token now: each rank marks its own tokens, nothing is gathered over dp, and cp load-balances.
#[test]
fn group_limited_routing_at_deepseek_v3_shape_keeps_cp_load_balanced() {
    use autotp_program::Instruction;
    let model = crate::common::fixture("plan", "deepseek_v3_8_layers.onnx");
    let args: Vec<String> =
        [model.to_str().unwrap(), "--seq-len", "4096", "--micro-batch", "1", "--dp", "8", "--cp", "2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    // Layer 3: the first of experts.
    let flags = autotp_compiler::CompileFlags::parse_args(&args).unwrap();
    let options = autotp_compiler::CompileOptions::from_flags(&flags).unwrap();
    let plan = autotp_compiler::compile(&options, autotp_compiler::Weights::ShapesOnly { layers: Some(vec![3]) })
        .unwrap()
        .plan;
    assert_eq!(plan.training.sequence_order, autotp_program::step::SequenceOrder::LoadBalanced { cp: 2 });
    let program = &plan.stages[0];
    let dp = program.mesh.iter().position(|a| a.name == autotp_program::mesh::DATA_AXIS).unwrap();
    let gathers_over_dp = (program.instructions.iter())
        .filter(|i| match i {
            Instruction::Collective { op, .. } | Instruction::CollectiveStart { op, .. } => {
                op.axis == dp && op.kind.name() == "all_gather"
            }
            _ => false,
        })
        .count();
    assert_eq!(gathers_over_dp, 0, "plain dp gathers nothing");
}

/// Context-parallel plans on emulated GPUs (`AUTOTP_GPU=emulated`, the ranks' cp communicator
/// over the emulated NCCL) train like their CPU ranks: the GPU's attention passes take each
/// rank's queries at their positions; Ulysses' all-to-alls run on NCCL; with dp, each axis has
/// its communicator.
#[test]
fn context_parallelism_on_emulated_gpus_trains_like_cpu_ranks() {
    for (comm, data_parallel) in [("all_gather", &[][..]), ("a2a", &[]), ("all_gather", &["--dp", "2", "--zero", "1"])]
    {
        on_emulated_gpus(comm, data_parallel);
    }
}

fn on_emulated_gpus(comm: &str, data_parallel: &[&str]) {
    let dir = crate::common::scratch(&format!("context-parallel-gpu-{comm}{}", data_parallel.join("")));
    let model = crate::common::fixture("llama", "model.onnx");
    let tokens = crate::common::repo().join("tests/fixtures/train/tokens.bin");
    let plan = dir.join("cp.atp");
    let m = model.to_str().unwrap();
    let flags = ["--seq-len", "32", "--micro-batch", "1", "--grad-accum", "4", "--cp", "2", "--cp-comm-type", comm];
    crate::common::success(crate::common::autotp(
        &[&["compile", m][..], &flags, data_parallel, &["-o", plan.to_str().unwrap()]].concat(),
    ));
    let run = |device: &str| {
        let metrics = dir.join(format!("{device}.jsonl"));
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"));
        command.args(["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "4"]);
        command.args(["--device", device, "--metrics-out", metrics.to_str().unwrap()]);
        let out = command.env("AUTOTP_GPU", "emulated").output().unwrap();
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        crate::common::success(out);
        (crate::common::losses(&metrics).into_iter().map(|(_, loss)| loss).collect::<Vec<f64>>(), said)
    };
    let (cpu, _) = run("cpu");
    let (gpu, said) = run("cuda");
    assert!(said.contains("cp over NCCL"), "{said}");
    let label = format!("cp 2 {comm} {} on emulated GPUs", data_parallel.join(" "));
    let (first, worst) = within_contract(&label, &gpu, &cpu);
    println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to CPU ranks");
    assert!(worst <= 1e-6, "{gpu:?} against {cpu:?}");
}

/// The load balance keeps the natural order, saying why, where something other than
/// attention would see the sequence in the balanced order: a value of the sequence all-gathered
/// over cp for a shift, a table sliced over cp that is not as long as the sequence. A table the
/// same all along the sequence needs no arranging.
#[test]
fn load_balance_keeps_the_natural_order_where_the_order_would_be_seen() {
    let balance = |text: &str| {
        let graph = autotp_ir::text::parse(text).expect("parses");
        autotp_ir::verify(&graph).expect("verifies");
        autotp_passes::context_balance::load_balance(&graph, 8).expect("rewrites")
    };
    let shifted = balance(
        r#"graph "shift" mesh [cp=2] {
  input %input_ids : i64[1,8] {cp = shard(1)}
  param %embed : f32[10,4]
  %0 = gather %embed, %input_ids {axis = 0} : f32[1,8,4] {cp = shard(1)}
  %1 = all_gather %0 {axis = cp, dim = 1} : f32[1,8,4]
  %2 = slice %1 {starts = [0, 1, 0], ends = [1, 8, 4], steps = [1, 1, 1]} : f32[1,7,4]
  output "y" = %2
}"#,
    );
    let why = shifted.expect_err("a shift sees the order");
    assert!(why.contains("all_gather (node 1) gathers the gather of node 0 over cp for slice"), "{why}");
    let table = |values: &str| {
        format!(
            r#"graph "table" mesh [cp=2] {{
  input %input_ids : i64[1,8] {{cp = shard(1)}}
  param %embed : f32[10,6]
  %0 = gather %embed, %input_ids {{axis = 0}} : f32[1,8,6] {{cp = shard(1)}}
  %1 = constant dense<[{values}]> : f32[6]
  %2 = shard_slice %1 {{axis = cp, dim = 0}} : f32[6] {{cp = shard(0)}}
  %3 = reduce_sum %2 {{axes = [0], keep_dims = false}} : f32[] {{cp = partial(sum)}}
  %4 = all_reduce %3 {{axis = cp}} : f32[]
  output "t" = %4
}}"#
        )
    };
    let why = balance(&table("1.0, 2.0, 3.0, 4.0, 5.0, 6.0")).expect_err("6 rows are not the sequence");
    assert!(
        why.contains("slices the constant of node 1 over cp along a dim of 6, which is not a sequence of 8"),
        "{why}"
    );
    let uniform = balance(&table("0.5, 0.5, 0.5, 0.5, 0.5, 0.5")).expect("a uniform table needs nothing");
    let printed = autotp_ir::text::print(&uniform);
    assert_eq!(printed.matches(" gather ").count(), 1, "only the embedding's:\n{printed}");
}
