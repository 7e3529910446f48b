//! Megatron's sequence parallelism (`--sequence-parallel` with `--tp`): the hidden states
//! between the blocks split over the tp ranks by tokens. It trains the fixtures as one rank
//! does, moves the bytes tensor parallelism moves (each all-reduce of a hidden state now a
//! reduce-scatter and an all-gather; the norms' weight gradients are reduced too), and holds
//! less activation memory.

use crate::parallel::{train_model, within_contract};

/// 30 AdamW steps of a global batch of 8, against one rank.
#[test]
fn sequence_parallelism_trains_like_one_rank() {
    let dir = crate::common::scratch("sequence-parallel");
    let layouts: &[(&str, usize, &[&str])] = &[
        ("model.onnx", 8, &["--tp", "2", "--sequence-parallel"]),
        ("model.onnx", 8, &["--tp", "4", "--sequence-parallel"]),
        ("model.onnx", 1, &["--tp", "2", "--sequence-parallel", "--grad-accum", "8"]),
        ("model.onnx", 4, &["--tp", "2", "--dp", "2", "--zero", "3", "--sequence-parallel"]),
        ("model_4_layers.onnx", 4, &["--tp", "2", "--pp", "2", "--grad-accum", "2", "--sequence-parallel"]),
    ];
    for arch in ["gpt2", "llama"] {
        for (file, micro_batch, flags) in layouts {
            let single = train_model(&dir, arch, file, 8, &[]);
            let got = train_model(&dir, arch, file, *micro_batch, flags);
            let label = format!("{arch} {file} micro-batch {micro_batch} {}", flags.join(" "));
            let (first, worst) = within_contract(&label, &got, &single);
            println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
    }
}

/// One compile of `arch`'s fixture cut to `layers` layers (micro-batch 4 x 32 tokens) with
/// `flags`: rank 0's activation peak, and its bytes sent per step by all-reduces,
/// reduce-scatters and all-gathers.
fn compiled(arch: &str, layers: usize, flags: &[&str]) -> (i64, [i64; 3]) {
    compiled_at(4, arch, layers, flags)
}

/// [`compiled`] at `micro_batch` sequences.
fn compiled_at(micro_batch: usize, arch: &str, layers: usize, flags: &[&str]) -> (i64, [i64; 3]) {
    let model = crate::common::fixture(arch, "model.onnx");
    let micro_batch = micro_batch.to_string();
    let mut args: Vec<String> = [model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", &micro_batch]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(flags.iter().map(|s| s.to_string()));
    let plan = crate::common::compile_shapes(&args, layers);
    let report = autotp_program::report::report(&plan);
    let sent = &report.ranks[0].comm_bytes_per_step;
    let peak = plan.stages[0].memory.activations_peak_bytes as i64;
    (peak, [sent.all_reduce as i64, sent.reduce_scatter as i64, sent.all_gather as i64])
}

/// Korthikanti et al.: tensor parallelism holds `sbh(10 + 24/t + 5as/(ht))` bytes of
/// activations per layer, sequence parallelism `sbh(34/t + 5as/(ht))`: the part held whole on
/// every rank (the two norms' inputs, the two GEMM inputs they make, and, there, the dropout
/// masks) is split over the ranks too. Here, in f32, without dropout and with attention that
/// saves no scores, that part is the two norms' inputs and outputs (`4bsh` elements) and their
/// statistics (`2bs`): each layer of the compiled plan holds `(1 - 1/t)` of it less, exactly.
/// A layer's bytes are the difference of the model cut to 2 layers and to 1.
#[test]
fn sequence_parallelism_splits_the_activations_tensor_parallelism_keeps_whole() {
    let (b, s, h) = (4i64, 32i64, 64i64);
    for arch in ["llama", "gpt2"] {
        for t in [2i64, 4] {
            let tp = t.to_string();
            let layer = |flags: &[&str]| compiled(arch, 2, flags).0 - compiled(arch, 1, flags).0;
            let tensor_parallel = layer(&["--tp", &tp]);
            let sequence_parallel = layer(&["--tp", &tp, "--sequence-parallel"]);
            let whole = 4 * (4 * b * s * h + 2 * b * s);
            let want = whole - whole / t;
            println!(
                "{arch} tp {t}: per layer {tensor_parallel} bytes under tp, {sequence_parallel} with sequence \
                 parallelism: {} less, the formula {want}",
                tensor_parallel - sequence_parallel
            );
            assert_eq!(tensor_parallel - sequence_parallel, want, "{arch} tp {t}");
        }
    }
}

/// Sequence parallelism moves tensor parallelism's bytes: each all-reduce of a hidden state
/// becomes a reduce-scatter and an all-gather of half its bytes each. Beyond them, as in
/// Megatron: the backward gathers each column-parallel GEMM's input again (2 per layer and the
/// head's, rather than hold the forward's gathered copy), and the norms' weight gradients, made
/// on each rank's tokens, are all-reduced (2 per layer and the final norm).
#[test]
fn sequence_parallelism_moves_the_bytes_tensor_parallelism_moves() {
    let (layers, t) = (2i64, 2i64);
    let (hidden_state, norm_weight) = (4 * 4 * 32 * 64, 4 * 64);
    let (_, [ar_tp, rs_tp, ag_tp]) = compiled("llama", 2, &["--tp", "2"]);
    let (_, [ar, rs, ag]) = compiled("llama", 2, &["--tp", "2", "--sequence-parallel"]);
    let regathers = (2 * layers + 1) * hidden_state * (t - 1) / t;
    let norm_gradients = (2 * layers + 1) * norm_weight * 2 * (t - 1) / t;
    assert_eq!(rs_tp, 0);
    assert_eq!(ar - norm_gradients + 2 * rs, ar_tp, "all-reduces {ar}, reduce-scatters {rs}");
    assert_eq!(ag - regathers - rs, ag_tp, "all-gathers {ag}, reduce-scatters {rs}");
}

/// A batch of one sequence is split as a larger batch is: the reshapes that merge its tokens
/// with the batch (`[1, s, h]` to `[s, h]`, where a split by tokens could follow) gather them as
/// they must at any other batch, so it sends a quarter of a batch of four's reduce-scatter and
/// all-gather bytes (rather than gather the tokens again at each GEMM that reads the merge).
#[test]
fn a_batch_of_one_moves_a_quarter_of_the_bytes_of_four() {
    let flags = ["--tp", "2", "--sequence-parallel"];
    let (_, [_, rs_one, ag_one]) = compiled_at(1, "llama", 2, &flags);
    let (_, [_, rs_four, ag_four]) = compiled_at(4, "llama", 2, &flags);
    assert_eq!(
        (4 * rs_one, 4 * ag_one),
        (rs_four, ag_four),
        "reduce-scatters and all-gathers, batch of one and of four"
    );
}

/// `--explain-tp` says what sequence parallelism does; it needs tp and tokens tp divides.
#[test]
fn sequence_parallelism_is_explained_and_refused_without_its_tokens_split() {
    let model = crate::common::fixture("gpt2", "model.onnx");
    let m = model.to_str().unwrap();
    let flags = ["--micro-batch", "4", "--seq-len", "32", "--tp", "4", "--sequence-parallel", "--explain-tp"];
    let out = crate::common::success(crate::common::autotp(&[&["compile", m, "-o", "/dev/null"][..], &flags].concat()));
    assert!(out.contains("sequence parallelism: the hidden states between the blocks"), "{out}");
    assert!(out.contains("run on each rank's 8 of the 32 tokens of a sequence"), "{out}");
    let compile = |extra: &[&str]| {
        let args = [&["compile", model.to_str().unwrap(), "--micro-batch", "4", "-o", "/dev/null"][..], extra];
        crate::common::failure(crate::common::autotp(&args.concat()))
    };
    let err = compile(&["--seq-len", "32", "--sequence-parallel"]);
    assert!(
        err.contains("--sequence-parallel splits tensor parallelism's hidden states by tokens: it needs --tp 2"),
        "{err}"
    );
    let err = compile(&["--seq-len", "30", "--tp", "4", "--sequence-parallel"]);
    assert!(
        err.contains("--sequence-parallel splits each sequence's 30 tokens over --tp 4: they must divide"),
        "{err}"
    );
}
