//! Parallel training on CPU ranks (threads of one process) against the single-rank run with the
//! same global batch, by the contract's tolerance: 1e-5 relative at step 1, 1e-3 at every step
//! of 30 AdamW steps (lr 2e-3, betas 0.9/0.95, weight decay 0.01, global batch 8, sequence 32).

use std::path::Path;

use crate::common::{autotp, failure, fixture, losses, repo, scratch, success};

const ADAMW: [&str; 8] = ["--lr", "2e-3", "--betas", "0.9,0.95", "--eps", "1e-8", "--weight-decay", "0.01"];

/// Trains `arch` for 30 steps with `parallel` flags and a micro-batch giving a global batch of
/// 8; returns the loss per step.
fn train(dir: &Path, arch: &str, micro_batch: usize, parallel: &[&str]) -> Vec<f64> {
    train_model(dir, arch, "model.onnx", micro_batch, parallel)
}

/// [`train`] with another of the fixture's model files.
pub(crate) fn train_model(dir: &Path, arch: &str, file: &str, micro_batch: usize, parallel: &[&str]) -> Vec<f64> {
    let metrics = dir.join(format!("{arch}-{file}{}.jsonl", parallel.join("")));
    let micro = micro_batch.to_string();
    let model = fixture(arch, file);
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let mut args = vec!["train", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", &micro];
    args.extend(ADAMW);
    args.extend(parallel);
    args.extend(["--data", tokens.to_str().unwrap(), "--steps", "30", "--log-every", "30"]);
    args.extend(["--metrics-out", metrics.to_str().unwrap()]);
    success(autotp(&args));
    losses(&metrics).into_iter().map(|(_, loss)| loss).collect()
}

/// How many collectives of `kind` the first stage's instructions in a compile summary hold,
/// run in place or started and waited (`instructions: N (name count, ...)`).
fn collectives(summary: &str, kind: &str) -> usize {
    let line = summary.lines().find(|l| l.trim_start().starts_with("instructions: ")).unwrap_or_default();
    let counts = line.split_once('(').map_or("", |(_, rest)| rest.trim_end_matches(')'));
    let started = format!("{kind}_start");
    (counts.split(", "))
        .filter_map(|entry| entry.rsplit_once(' '))
        .filter(|(name, _)| *name == kind || *name == started)
        .map(|(_, count)| count.parse::<usize>().unwrap_or(0))
        .sum()
}

/// `autotp compile` of the GPT-2 fixture, micro-batch 4 x seq-len 32, with `extra` flags.
fn compile_gpt2(extra: &[&str]) -> std::process::Output {
    let model = fixture("gpt2", "model.onnx");
    autotp(&[&["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4"][..], extra].concat())
}

/// A `--report` file.
fn read_report(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Asserts the contract's tolerance and returns (step 1, worst) relative differences.
pub(crate) fn within_contract(label: &str, got: &[f64], want: &[f64]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "{label}");
    let relative: Vec<f64> = got.iter().zip(want).map(|(g, w)| (g - w).abs() / w.abs()).collect();
    let worst = relative.iter().copied().fold(0f64, f64::max);
    assert!(relative[0] <= 1e-5, "{label}: step 1 differs by {:.2e}", relative[0]);
    assert!(worst <= 1e-3, "{label}: a step differs by {worst:.2e} ({got:?} vs {want:?})");
    (relative[0], worst)
}

#[test]
fn data_parallel_trains_like_one_rank() {
    let dir = scratch("parallel-dp");
    for arch in ["gpt2", "llama", "gpt_neox"] {
        let single = train(&dir, arch, 8, &[]);
        for (dp, zero) in [(2, "0"), (2, "1"), (2, "2"), (2, "3"), (4, "0"), (4, "3")] {
            let dp_flag = dp.to_string();
            let got = train(&dir, arch, 8 / dp, &["--dp", &dp_flag, "--zero", zero]);
            let (first, worst) = within_contract(&format!("{arch} dp={dp} zero {zero}"), &got, &single);
            println!("{arch} dp={dp} zero {zero}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
    }
}

#[test]
fn tensor_parallel_trains_like_one_rank() {
    let dir = scratch("parallel-tp");
    // GPT-2: fused QKV and tied embeddings; Llama: grouped-query attention (2 key/value heads);
    // GPT-NeoX: per-head interleaved fused QKV.
    for (arch, tps) in [("gpt2", &[2, 4][..]), ("llama", &[2][..]), ("gpt_neox", &[2, 4][..])] {
        let single = train(&dir, arch, 8, &[]);
        for &tp in tps {
            let tp_flag = tp.to_string();
            let got = train(&dir, arch, 8, &["--tp", &tp_flag]);
            let (first, worst) = within_contract(&format!("{arch} tp={tp}"), &got, &single);
            println!("{arch} tp={tp}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
        for zero in ["1", "3"] {
            let got = train(&dir, arch, 4, &["--tp", "2", "--dp", "2", "--zero", zero]);
            let (first, worst) = within_contract(&format!("{arch} tp=2 dp=2 zero {zero}"), &got, &single);
            println!("{arch} tp=2 x dp=2 zero {zero}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
    }
}

#[test]
fn impossible_tensor_parallel_splits_are_refused() {
    let compile = |arch: &str, tp: &str| {
        let model = fixture(arch, "model.onnx");
        failure(autotp(&[
            "compile",
            model.to_str().unwrap(),
            "--seq-len",
            "32",
            "--micro-batch",
            "8",
            "--tp",
            tp,
            "-o",
            "/dev/null",
        ]))
    };
    // Llama's 4 query heads cannot be split 8 ways (its 2 key/value heads would be
    // replicated), nor the multi-query models' 4 query heads.
    for (arch, query) in [("llama", "q_proj.weight'"), ("falcon_mqa", "query_key_value.weight[0:64]'")] {
        let err = compile(arch, "8");
        assert!(err.contains("tp=8 cannot split the blocks") && err.contains(query), "{arch}: {err}");
        assert!(err.contains("the reshape makes 4 heads of it, which tp=8 does not divide"), "{arch}: {err}");
        // And how the weights it names were placed, as --explain-tp would have said.
        let placed =
            format!("(the split weights: 'm.{}", if arch == "llama" { "model.layers.0" } else { "transformer.h.0" });
        assert!(
            err.contains(&placed) && err.contains("shard(0), column-parallel: reads a normalised"),
            "{arch}: {err}"
        );
    }
    // 3 does not divide the 64 hidden features of a 4-head model.
    let err = compile("gpt_neox", "3");
    assert!(err.contains("over tp=3: dim") && err.contains("is not divisible"), "{err}");
    // BLOOM's 4 heads, merged with the batch in its attention, do not split 8 ways either.
    let err = compile("bloom", "8");
    assert!(err.contains("the reshape makes 4 heads of it, which tp=8 does not divide"), "{err}");
}

/// OPT's key bias gets a gradient of rounding noise only (softmax ignores what it adds to a
/// whole row of scores): `verify` must not call the plan wrong over noise against noise.
#[test]
fn verify_accepts_gradients_that_are_zero_but_for_rounding() {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let plan = scratch("verify-noise").join("opt.atp");
    let model = fixture("opt", "model.onnx");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "16", "--micro-batch", "2", "--tp", "2"];
    success(autotp(&[&args[..], &["-o", plan.to_str().unwrap()]].concat()));
    let report = success(autotp(&["verify", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap()]));
    assert!(report.contains("every gradient within 1e-5") && report.contains("trains like one device"), "{report}");
}

/// A bf16 plan is verified within bf16's tolerance by default (its gradients carry the rounding
/// of 16-bit activations summed in another order), which `--tolerance` still overrides.
#[test]
fn verify_takes_the_plans_precision_into_account() {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let plan = scratch("verify-bf16").join("gpt2.atp");
    let model = fixture("gpt2", "model.onnx");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4", "--dp", "2"];
    success(autotp(&[&args[..], &["--precision", "bf16", "-o", plan.to_str().unwrap()]].concat()));
    let verify = ["verify", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap()];
    let report = success(autotp(&verify));
    assert!(report.contains("every gradient within 3e-2") && report.contains("trains like one device"), "{report}");
    let strict = autotp(&[&verify[..], &["--tolerance", "1e-5"]].concat());
    assert_eq!(strict.status.code(), Some(1), "{}", String::from_utf8_lossy(&strict.stdout));
}

/// The `--explain-tp` line of `weight` in a compile's output.
fn explained<'a>(out: &'a str, weight: &str) -> Option<&'a str> {
    out.lines().find(|l| l.trim_start().strip_prefix(weight).is_some_and(|rest| rest.starts_with(' ')))
}

/// Key/value projections with fewer heads than tp ranks are replicated, the query heads split:
/// Llama's 2 key/value heads under `--tp 4` (separate projections), and the multi-query
/// models' one head under `--tp 2`, whose fused projection trains as three parameters.
/// `--explain-tp` says so, and `verify` finds every gradient as on one device.
#[test]
fn key_value_heads_fewer_than_tp_are_replicated() {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let dir = scratch("kv-replicated");
    for (arch, tp, query, key_value) in [
        ("llama", "4", "m.model.layers.1.self_attn.q_proj.weight", "m.model.layers.1.self_attn.v_proj.weight"),
        (
            "bigcode_mqa",
            "2",
            "m.transformer.h.1.attn.c_attn.weight[0:64]",
            "m.transformer.h.1.attn.c_attn.weight[64:80]",
        ),
        (
            "falcon_mqa",
            "2",
            "m.transformer.h.0.self_attention.query_key_value.weight[0:64]",
            "m.transformer.h.0.self_attention.query_key_value.weight[80:96]",
        ),
    ] {
        let model = fixture(arch, "model.onnx");
        let plan = dir.join(format!("{arch}.atp"));
        let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "8", "--tp", tp];
        let out = success(autotp(&[&args[..], &["--explain-tp", "-o", plan.to_str().unwrap()]].concat()));
        let line = |weight: &str| explained(&out, weight).unwrap_or_else(|| panic!("{out}"));
        assert!(line(query).contains("shard(0)") && line(query).contains("column-parallel"), "{arch}: {out}");
        let heads = if arch == "llama" { "2 heads" } else { "1 head " };
        let kv = line(key_value);
        assert!(kv.contains("replicate") && kv.contains(&format!("key/value projection with {heads}")), "{kv}");
        let report = success(autotp(&["verify", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap()]));
        assert!(report.contains("every gradient within 1e-5") && report.contains("trains like one device"), "{report}");
    }
}

/// `--tp-replicate-unsplittable`: Llama's attention, whose 4 heads tp=8 cannot split, stays
/// whole on every rank while its MLPs split 8 ways, said so by `--explain-tp`, and the plan
/// trains like one device.
#[test]
fn unsplittable_blocks_are_replicated_on_request() {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let dir = scratch("replicate-unsplittable");
    let (model, plan) = (fixture("llama", "model.onnx"), dir.join("llama.atp"));
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "8", "--tp", "8"];
    let refused = failure(autotp(&[&args[..], &["-o", "/dev/null"]].concat()));
    assert!(refused.contains("--tp-replicate-unsplittable keeps such a block whole"), "{refused}");
    let flags = ["--tp-replicate-unsplittable", "--explain-tp", "-o", plan.to_str().unwrap()];
    let out = success(autotp(&[&args[..], &flags].concat()));
    let line = |weight: &str| explained(&out, &format!("m.model.layers.1.{weight}")).unwrap_or_else(|| panic!("{out}"));
    // The key and value projections, with 2 heads, are replicated first, as always.
    for weight in ["self_attn.k_proj.weight", "self_attn.v_proj.weight"] {
        assert!(line(weight).contains("replicate  key/value projection with 2 heads"), "{out}");
    }
    let query = line("self_attn.q_proj.weight");
    assert!(query.contains("replicate  replicated with its block"), "{query}");
    assert!(query.contains("the reshape makes 4 heads of it, which tp=8 does not divide"), "{query}");
    assert!(line("mlp.up_proj.weight").contains("shard(0)") && line("mlp.down_proj.weight").contains("shard(1)"));
    let report = success(autotp(&["verify", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap()]));
    assert!(report.contains("every gradient within 1e-5") && report.contains("trains like one device"), "{report}");
}

/// OLMo 2's query and key norms are over all heads, which tp splits: `expand-norms` writes them
/// as arithmetic whose sums one all-reduce completes, their scales split with the features, and
/// `--explain-tp` says so rather than only that they follow their consumers.
#[test]
fn norms_over_split_features_are_explained() {
    let model = fixture("olmo2", "model.onnx");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "8", "--tp", "2"];
    let out = success(autotp(&[&args[..], &["--explain-tp", "-o", "/dev/null"]].concat()));
    for weight in ["m.model.layers.0.self_attn.q_norm.weight", "m.model.layers.1.self_attn.k_norm.weight"] {
        let line = explained(&out, weight).unwrap_or_default();
        assert!(
            line.contains("shard(0)") && line.contains("the scale of a norm over split features, expanded"),
            "{weight}: {out}"
        );
    }
}

/// Under bf16 a block reads a cast of its f32 norm and returns a cast of its 16-bit result to
/// the f32 residual stream (BLOOM's layer norms run in f32): `autotp` finds the block through
/// the casts, and `verify` finds the tp 2 plan training like one device. It was refused ("no
/// Megatron block").
#[test]
fn mixed_precision_blocks_are_found_through_casts() {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let plan = scratch("bloom-bf16").join("bloom.atp");
    let model = fixture("bloom", "model.onnx");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "8", "--tp", "2"];
    let out =
        success(autotp(&[&args[..], &["--precision", "bf16", "--explain-tp", "-o", plan.to_str().unwrap()]].concat()));
    let dense = explained(&out, "m.transformer.h.0.self_attention.dense.weight");
    assert!(dense.is_some_and(|l| l.contains("shard(1)") && l.contains("row-parallel")), "{out}");
    let report = success(autotp(&["verify", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap()]));
    assert!(report.contains("trains like one device"), "{report}");
}

/// With gradient accumulation each micro-batch looks its token ids up in a slice of the step's
/// input: Llama's (untied) embedding is still split over the vocabulary, a rank holds the same
/// parameter bytes as without accumulation, and `verify` finds every gradient as on one device.
#[test]
fn the_vocabulary_parallel_embedding_survives_accumulation() {
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let dir = scratch("vocab-accumulated");
    let model = fixture("llama", "model.onnx");
    let mut params = Vec::new();
    for accumulation in ["1", "2"] {
        let plan = dir.join(format!("acc{accumulation}.atp"));
        let report = dir.join(format!("acc{accumulation}.json"));
        let args = ["compile", model.to_str().unwrap(), "--seq-len", "16", "--micro-batch", "2", "--tp", "2"];
        let extra = ["--grad-accum", accumulation, "--explain-tp", "--report", report.to_str().unwrap()];
        let out = success(autotp(&[&args[..], &extra, &["-o", plan.to_str().unwrap()]].concat()));
        let line = out.lines().find(|l| l.trim_start().starts_with("m.model.embed_tokens.weight ")).expect(&out);
        assert!(line.contains("shard(0)") && line.contains("vocabulary-parallel embedding"), "{line}");
        let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        params.push(report["ranks"][0]["params_bytes"].as_u64().unwrap());
        let verified = success(autotp(&["verify", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap()]));
        assert!(verified.contains("every gradient within 1e-5"), "{verified}");
    }
    assert_eq!(params[0], params[1]);
}

#[test]
fn a_failing_rank_stops_the_others() {
    // Rank 1's half of the first batch holds a token id past the vocabulary: its embedding
    // lookup fails while rank 0 waits in a collective; the run must end with rank 1's error.
    let dir = scratch("parallel-failure");
    let tokens: Vec<u16> = (0..9).map(|i| if i == 6 { 5000 } else { i }).collect();
    let data = dir.join("tokens.bin");
    std::fs::write(&data, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let model = fixture("gpt2", "model.onnx");
    let args = ["train", model.to_str().unwrap(), "--seq-len", "4", "--micro-batch", "1", "--dp", "2"];
    let err = failure(autotp(&[&args[..], &["--data", data.to_str().unwrap(), "--steps", "1"]].concat()));
    assert!(err.contains("rank 1:") && err.contains("5000"), "{err}");
    assert_eq!(err.matches("out of range").count(), 1, "the cause is said once: {err}");
    // A pipeline: stage 0 fails on the second micro-batch while stage 1 waits for it.
    let args = ["train", model.to_str().unwrap(), "--seq-len", "4", "--micro-batch", "1", "--pp", "2"];
    let flags = ["--grad-accum", "2", "--data", data.to_str().unwrap(), "--steps", "1"];
    let err = failure(autotp(&[&args[..], &flags].concat()));
    assert!(err.contains("rank 0:") && err.contains("5000"), "{err}");
    assert_eq!(err.matches("out of range").count(), 1, "the cause is said once: {err}");
}

/// The compile-time report follows ZeRO's formulas for f32 AdamW (16 bytes per parameter: 4
/// weights, 4 gradients, 8 moments; P parameters, n = dp ranks): stage 0 holds 16P, stage 1
/// 8P + 8P/n, stage 2 4P + 12P/n, stage 3 16P/n. Stage 0 all-reduces the gradients (2(n-1)/n of
/// 4P bytes sent per rank); stages 1-2 reduce-scatter them and all-gather the updated
/// parameters ((n-1)/n of 4P each); stage 3 gathers parameters in the forward and again in the
/// backward (only those the backward uses). One saving beyond DeepSpeed's: the position
/// embedding's gradient is reduced before it is scattered into the table, so only the 32 rows
/// a 32-token sequence uses travel. Every stage all-reduces two scalars: the loss and the finite
/// check's flag. A run measures the bytes and the peak the plan states.
#[test]
fn reports_follow_the_zero_formulas() {
    let dir = scratch("parallel-report");
    let model = fixture("gpt2", "model.onnx");
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let p = 172_288u64;
    let positions_saved = (128 - 32) * 64;
    for (zero, state) in [(0, 16 * p), (1, 8 * p + 8 * p / 2), (2, 4 * p + 12 * p / 2), (3, 16 * p / 2)] {
        let (plan, report) = (dir.join(format!("gpt2-{zero}.atp")), dir.join(format!("report-{zero}.json")));
        let zero_flag = zero.to_string();
        let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4", "--dp", "2"];
        let out =
            [&["--zero", zero_flag.as_str(), "--report", report.to_str().unwrap(), "-o", plan.to_str().unwrap()][..]];
        success(autotp(&[&args[..], out[0]].concat()));
        let json = read_report(&report);
        let ranks = json["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 2);
        let rank = &ranks[0];
        let field = |k: &str| rank[k].as_u64().unwrap_or_else(|| panic!("no {k} in {rank}"));
        let comm = |k: &str| rank["comm_bytes_per_step"][k].as_u64().unwrap();
        assert_eq!(
            field("params_bytes") + field("grads_bytes") + field("optimizer_bytes"),
            state,
            "zero {zero}: {rank}"
        );
        assert!(
            field("peak_bytes") >= field("params_bytes") + field("optimizer_bytes") + field("activations_peak_bytes")
        );
        match zero {
            0 => {
                assert_eq!(comm("all_reduce"), 4 * (p - positions_saved) + 4 + 4, "gradients, loss, finite check");
                assert_eq!((comm("reduce_scatter"), comm("all_gather")), (0, 0));
            }
            1 | 2 => {
                assert_eq!(comm("reduce_scatter"), 4 * p / 2, "zero {zero}");
                assert_eq!(comm("all_gather"), 4 * p / 2, "zero {zero}");
                assert_eq!(comm("all_reduce"), 4 + 4, "the loss and the finite check's flag");
            }
            _ => {
                assert_eq!(comm("reduce_scatter"), 4 * p / 2);
                assert!(
                    comm("all_gather") > 4 * p / 2 && comm("all_gather") <= 2 * 4 * p / 2,
                    "{}",
                    comm("all_gather")
                );
            }
        }
        assert_eq!(json["comm_bytes_per_step"]["reduce_scatter"].as_u64().unwrap(), 2 * comm("reduce_scatter"));

        let out = autotp(&["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "3"]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        let rows: Vec<Vec<u64>> = stderr
            .lines()
            .filter_map(|l| {
                let fields: Vec<u64> = l.split_whitespace().filter_map(|f| f.parse().ok()).collect();
                (fields.len() == 5).then_some(fields)
            })
            .collect();
        assert_eq!(rows.len(), 2, "one line per rank:\n{stderr}");
        for row in rows {
            assert_eq!(row[1], row[2], "zero {zero}: measured peak equals the plan: {row:?}");
            assert_eq!(row[3], row[4], "zero {zero}: measured communication equals the plan: {row:?}");
        }
    }
}

/// Megatron's communication: per transformer block, one all-reduce after the attention and one
/// after the MLP in the forward, and one for each block's input gradient in the backward; each
/// of a [batch, seq, hidden] activation. The vocabulary split adds one for the embedding's
/// output and one for the LM head's input gradient (activations too), and the cross-entropy's
/// two [tokens, 1] all-reduces (sum of exponentials, the label's score) and one all-gather of
/// each rank's block maxima [tokens, tp]. One more all-reduce, of one element, totals the
/// finite check of the gradients. Nothing else is gathered.
#[test]
fn tensor_parallel_all_reduces_per_block() {
    let dir = scratch("parallel-tp-count");
    for arch in ["gpt2", "llama", "gpt_neox"] {
        let model = fixture(arch, "model.onnx");
        let report = dir.join(format!("{arch}.json"));
        let plan = dir.join(format!("{arch}.atp"));
        let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "8", "--tp", "2"];
        let out = success(autotp(
            &[&args[..], &["--report", report.to_str().unwrap(), "-o", plan.to_str().unwrap()]].concat(),
        ));
        let count = |kind: &str| collectives(&out, kind);
        let layers = 2;
        assert_eq!(count("all_reduce"), 4 * layers + 2 + 2 + 1, "{arch}:\n{out}");
        assert_eq!((count("all_gather"), count("reduce_scatter")), (1, 0), "{arch}:\n{out}");
        let json = read_report(&report);
        let tokens = 8 * 32;
        let activation = tokens * 64 * 4;
        let sent = &json["ranks"][0]["comm_bytes_per_step"];
        let all_reduced = sent["all_reduce"].as_u64().unwrap() as usize;
        // At tp=2 a ring all-reduce sends 2(n-1)/n = 1 times its tensor, an all-gather (n-1)
        // times a rank's block.
        assert_eq!(all_reduced, (4 * layers + 2) * activation + 2 * tokens * 4 + 4, "{arch}");
        assert_eq!(sent["all_gather"].as_u64().unwrap() as usize, tokens * 4, "{arch}");
    }
}

/// `--param-persistence-threshold` keeps small parameters whole at ZeRO stage 3: GPT-2's 1,792
/// elements of biases and norm weights (all below 1,000 elements each) stay on every rank.
#[test]
fn small_parameters_persist_at_stage_3() {
    let dir = scratch("parallel-persist");
    let (plan, report) = (dir.join("gpt2.atp"), dir.join("report.json"));
    success(compile_gpt2(&[
        "--dp",
        "2",
        "--zero",
        "3",
        "--param-persistence-threshold",
        "1000",
        "--report",
        report.to_str().unwrap(),
        "-o",
        plan.to_str().unwrap(),
    ]));
    let json = read_report(&report);
    let params = json["ranks"][0]["params_bytes"].as_u64().unwrap();
    assert_eq!(params, 4 * 172_288 / 2 + 4 * 1_792 / 2, "sharded halves plus the persistent halves");
    let err = failure(compile_gpt2(&["--dp", "2", "--param-persistence-threshold", "10", "-o", "/dev/null"]));
    assert!(err.contains("--param-persistence-threshold applies to --zero 3"), "{err}");
}

/// ZeRO-3's prefetch budgets: they bound what is gathered ahead, as DeepSpeed's do. A
/// `--max-live-params` smaller than a parameter gathers it at its use all the same (each gather
/// of a parameter over 1,000 elements is waited for at once; refused until 2026-11-30, where
/// DeepSpeed fetches a module's own parameters whatever the budget) and trains like one rank; a
/// tight budget too; the budgets are stage-3 flags.
#[test]
fn zero_3_prefetch_budgets() {
    let dir = scratch("parallel-prefetch");
    let plan = dir.join("gpt2.atp");
    let dump = dir.join("ir");
    let report = dir.join("report.json");
    let live_1000 = ["--dp", "2", "--zero", "3", "--max-live-params", "1000"];
    let (dump_flag, report_flag) = (dump.to_str().unwrap(), report.to_str().unwrap());
    success(compile_gpt2(&[&live_1000[..], &["--dump-ir", dump_flag, "--report", report_flag]].concat()));
    let zero = std::fs::read_dir(&dump).unwrap().map(|e| e.unwrap().path()).find(|p| p.ends_with("11-zero.ir"));
    let ir = std::fs::read_to_string(zero.expect("the IR after zero")).unwrap();
    let lines: Vec<&str> = ir.lines().collect();
    let mut at_use = 0;
    for (i, line) in lines.iter().enumerate().filter(|(_, l)| l.contains("= all_gather_start ")) {
        let value = line.split(" = ").next().unwrap().trim();
        let shape = line.rsplit_once('[').unwrap().1.trim_end_matches(']');
        let elements: usize = shape.split(',').map(|d| d.trim().parse::<usize>().unwrap()).product();
        if elements > 1000 {
            assert!(lines[i + 1].contains(&format!("= wait {value} ")), "{line}\n{}", lines[i + 1]);
            at_use += 1;
        }
    }
    // The forward's embeddings and 4 matrices a layer, the backward's the same but the position
    // embedding.
    assert_eq!(at_use, 19, "gathers of parameters over the budget");
    let single = train(&dir, "gpt2", 8, &[]);
    let got = train(&dir, "gpt2", 4, &live_1000);
    within_contract("gpt2 dp=2 zero 3 max-live 1000", &got, &single);
    let err = failure(compile_gpt2(&[
        "--dp",
        "2",
        "--zero",
        "2",
        "--prefetch-bucket-size",
        "1000",
        "-o",
        plan.to_str().unwrap(),
    ]));
    assert!(err.contains("--prefetch-bucket-size applies to --zero 3"), "{err}");

    let tight = ["--dp", "2", "--zero", "3", "--prefetch-bucket-size", "10000", "--max-live-params", "100000"];
    let got = train(&dir, "gpt2", 4, &tight);
    let (first, worst) = within_contract("gpt2 dp=2 zero 3 tight prefetch", &got, &single);
    println!("gpt2 dp=2 zero 3, prefetch 1e4 / live 1e5: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
}

/// `--reduce-bucket-size` merges gradient reductions into fewer, bigger ones moving the same
/// bytes: all-reduces (ZeRO 0) and, at stage 2, reduce-scatters (the training tests above run
/// with DeepSpeed's default buckets, so bucketed steps train like one rank).
#[test]
fn gradient_buckets_merge_reductions() {
    let dir = scratch("parallel-buckets");
    let model = fixture("gpt2", "model.onnx");
    let compile = |zero: &str, bucket: &str, kind: &str| {
        let (plan, report) = (dir.join(format!("{zero}-{bucket}.atp")), dir.join(format!("{zero}-{bucket}.json")));
        let args = ["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4", "--dp", "2"];
        let extra = [
            "--zero",
            zero,
            "--reduce-bucket-size",
            bucket,
            "--report",
            report.to_str().unwrap(),
            "-o",
            plan.to_str().unwrap(),
        ];
        let out = success(autotp(&[&args[..], &extra[..]].concat()));
        let json = read_report(&report);
        (collectives(&out, kind), json["ranks"][0]["comm_bytes_per_step"][kind].as_u64().unwrap())
    };
    for (zero, kind, unbucketed) in [("0", "all_reduce", 30), ("2", "reduce_scatter", 28)] {
        let (separate, bytes) = compile(zero, "0", kind);
        let (bucketed, bucketed_bytes) = compile(zero, "500000000", kind);
        assert_eq!(separate, unbucketed, "zero {zero}: one {kind} per gradient (and the loss and finite check)");
        assert!(bucketed < separate, "zero {zero}: {bucketed} {kind}s with buckets, {separate} without");
        assert_eq!(bucketed_bytes, bytes, "zero {zero}: the same bytes travel");
    }
    let err = failure(compile_gpt2(&["--reduce-bucket-size", "10", "-o", "/dev/null"]));
    assert!(
        err.contains("--reduce-bucket-size buckets data-parallel gradient reductions: it needs --dp 2 or more"),
        "{err}"
    );
}

/// Gradient accumulation (`--grad-accum A`): the step's batch runs as A micro-batches whose
/// gradients are summed as they are made and reduced once per step. Trains like one rank with
/// the whole batch, alone and beside data parallelism (ZeRO 2 and 3) and tensor parallelism.
#[test]
fn gradient_accumulation_trains_like_one_rank() {
    let dir = scratch("parallel-accum");
    let configs: [(usize, &[&str]); 4] = [
        (2, &["--grad-accum", "4"]),
        (1, &["--grad-accum", "4", "--dp", "2", "--zero", "2"]),
        (1, &["--grad-accum", "4", "--dp", "2", "--zero", "3"]),
        (4, &["--grad-accum", "2", "--tp", "2"]),
    ];
    for arch in ["gpt2", "llama"] {
        let single = train(&dir, arch, 8, &[]);
        for (micro_batch, flags) in configs {
            let got = train(&dir, arch, micro_batch, flags);
            let label = format!("{arch} micro-batch {micro_batch} {}", flags.join(" "));
            let (first, worst) = within_contract(&label, &got, &single);
            println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
    }
}

/// A model's own loss (Hugging Face's mean cross-entropy with `ignore_index = -100`): each
/// micro-batch is weighed by its counted labels, so accumulating gives the whole batch's mean.
#[test]
fn gradient_accumulation_of_a_models_own_loss() {
    let dir = scratch("parallel-accum-own-loss");
    let single = train_model(&dir, "gpt2", "model_loss.onnx", 8, &[]);
    let got = train_model(&dir, "gpt2", "model_loss.onnx", 2, &["--grad-accum", "4"]);
    let (first, worst) = within_contract("gpt2 model_loss.onnx --grad-accum 4", &got, &single);
    println!("gpt2 own loss, grad-accum 4: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
}

/// Accumulating keeps one micro-batch's activations alive, not the step's. The gradients are
/// reduced as DeepSpeed's stages reduce them: at ZeRO 1 the sums once per step (the same
/// reduce-scatter bytes as one micro-batch per step, and whole sums of 4 bytes per parameter),
/// at ZeRO 2 and 3 each micro-batch's as they are made (A times the bytes), summed as shards
/// of 4 / dp bytes per parameter.
#[test]
fn gradient_accumulation_reduces_as_deepspeed_does() {
    let dir = scratch("parallel-accum-plan");
    let plan = |name: &str, flags: &[&str]| {
        let report = dir.join(format!("{name}.json"));
        let out = [&["--dp", "2", "--report", report.to_str().unwrap(), "-o", "/dev/null"][..], flags];
        let model = fixture("gpt2", "model.onnx");
        let args = ["compile", model.to_str().unwrap(), "--seq-len", "32"];
        success(autotp(&[&args[..], &out.concat()].concat()));
        let json = read_report(&report);
        let rank = &json["ranks"][0];
        (
            rank["activations_peak_bytes"].as_u64().unwrap(),
            rank["comm_bytes_per_step"]["reduce_scatter"].as_u64().unwrap(),
        )
    };
    const PARAMS: u64 = 172_288;
    // The loss's sum, and the micro-batch's slices of the two token inputs (a plan of one
    // micro-batch reads its inputs in place: 2 x 32 i64 per rank each).
    let loss_and_slices = 64 + 2 * 2 * 32 * 8;
    // ZeRO 3 prefetches no parameter ahead (a gather of the next micro-batch's would differ).
    for (zero, prefetch, sums, reductions) in
        [("1", "", 4 * PARAMS, 1), ("2", "", 2 * PARAMS, 4), ("3", "1", 2 * PARAMS, 4)]
    {
        let mut zero_flags = vec!["--zero", zero];
        if !prefetch.is_empty() {
            zero_flags.extend(["--prefetch-bucket-size", prefetch]);
        }
        let with = |more: &[&'static str]| [&zero_flags[..], more].concat();
        let (whole_peak, whole_scattered) = plan(&format!("whole-{zero}"), &with(&["--micro-batch", "8"]));
        let (accumulated_peak, accumulated_scattered) =
            plan(&format!("accumulated-{zero}"), &with(&["--micro-batch", "2", "--grad-accum", "4"]));
        let (one_peak, _) = plan(&format!("one-{zero}"), &with(&["--micro-batch", "2"]));
        assert_eq!(accumulated_scattered, reductions * whole_scattered, "zero {zero}: reduce-scatter bytes");
        assert!(
            accumulated_peak < whole_peak / 2,
            "zero {zero}: {accumulated_peak} vs {whole_peak} without accumulation"
        );
        // The placement packs each plan's blocks on its own (up to 15.8% over the live peak
        // where it does worst, codegen's memory plan measures), so the bound allows a fifth of
        // one micro-batch more.
        assert!(
            accumulated_peak <= one_peak + one_peak / 5 + sums + loss_and_slices,
            "zero {zero}: {accumulated_peak} vs {one_peak} for one micro-batch and {sums} of sums"
        );
    }
    let err = failure(compile_gpt2(&["--grad-accum", "0", "-o", "/dev/null"]));
    assert!(err.contains("--grad-accum"), "{err}");
    // DeepSpeed's train_batch_size: --global-batch sets the accumulation, and must agree.
    let out = success(compile_gpt2(&["--dp", "2", "--global-batch", "32", "-o", "/dev/null"]));
    assert!(out.contains("micro-batch 4 x seq-len 32 x 4 micro-batches = 1024 tokens"), "{out}");
    let err = failure(compile_gpt2(&["--dp", "2", "--global-batch", "30", "-o", "/dev/null"]));
    assert!(err.contains("--global-batch 30 is not a multiple of micro-batch 4 x dp 2 = 8"), "{err}");
    let err = failure(compile_gpt2(&["--dp", "2", "--global-batch", "32", "--grad-accum", "2", "-o", "/dev/null"]));
    assert!(err.contains("--global-batch 32 contradicts --grad-accum 2"), "{err}");
}

/// Pipeline stages (rank threads) interleaving the step's micro-batches train like one rank
/// with the same global batch: 1F1B with 4 and 8 micro-batches on 2 stages (the 2-layer
/// fixtures) and 4 (their 4-layer exports), GPipe, and pipelines of tensor- and data-parallel
/// stages with ZeRO 2 and 3; with clipping, the norm covers every stage's gradients.
#[test]
fn pipeline_trains_like_one_rank() {
    let dir = scratch("parallel-pp");
    let two_layers: &[(usize, &[&str])] = &[
        (2, &["--pp", "2", "--grad-accum", "4"]),
        (1, &["--pp", "2", "--grad-accum", "8"]),
        (2, &["--pp", "2", "--grad-accum", "4", "--schedule", "gpipe"]),
        (2, &["--pp", "2", "--grad-accum", "4", "--tp", "2"]),
        (1, &["--pp", "2", "--grad-accum", "4", "--dp", "2", "--zero", "2"]),
        (1, &["--pp", "2", "--grad-accum", "4", "--dp", "2", "--zero", "3"]),
        (2, &["--pp", "2", "--grad-accum", "2", "--dp", "2", "--tp", "2", "--zero", "1"]),
    ];
    let four_layers: &[(usize, &[&str])] = &[
        (2, &["--pp", "4", "--grad-accum", "4"]),
        (1, &["--pp", "4", "--grad-accum", "8"]),
        (1, &["--pp", "4", "--grad-accum", "8", "--pp-backward", "split"]),
        (1, &["--pp", "4", "--grad-accum", "8", "--schedule", "gpipe"]),
    ];
    let clipped_two_layers: &[(usize, &[&str])] =
        &[(2, &["--pp", "2", "--grad-accum", "2", "--dp", "2", "--tp", "2", "--zero", "2"])];
    let clipped_four_layers: &[(usize, &[&str])] = &[(2, &["--pp", "4", "--grad-accum", "4"])];
    let clip = ["--grad-clip", "0.5"];
    for arch in ["gpt2", "llama"] {
        // Each group's runs, and the single-rank run they are held to, add `common` to the flags.
        for (file, common, configs) in [
            ("model.onnx", &[][..], two_layers),
            ("model_4_layers.onnx", &[][..], four_layers),
            ("model.onnx", &clip[..], clipped_two_layers),
            ("model_4_layers.onnx", &clip[..], clipped_four_layers),
        ] {
            let single = train_model(&dir, arch, file, 8, common);
            for &(micro_batch, flags) in configs {
                let flags = [flags, common].concat();
                let got = train_model(&dir, arch, file, micro_batch, &flags);
                let label = format!("{arch} {file} micro-batch {micro_batch} {}", flags.join(" "));
                let (first, worst) = within_contract(&label, &got, &single);
                println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
            }
        }
    }
}

/// The plan holds one set of activations per micro-batch in flight: under 1F1B stage s holds
/// at most P - s, under GPipe all M; the report says so and the memory plan follows.
#[test]
fn pipeline_schedules_bound_the_activations_in_flight() {
    let dir = scratch("parallel-pp-plan");
    let plan = |name: &str, flags: &[&str]| {
        let report = dir.join(format!("{name}.json"));
        success(compile_gpt2(&[&["--report", report.to_str().unwrap(), "-o", "/dev/null"][..], flags].concat()));
        read_report(&report)
    };
    let peak = |json: &serde_json::Value, rank: usize| json["ranks"][rank]["activations_peak_bytes"].as_u64().unwrap();
    let in_flight = |json: &serde_json::Value, rank: usize| json["ranks"][rank]["micro_batches_in_flight"].as_u64();
    let one_f_one_b = plan("1f1b", &["--pp", "2", "--grad-accum", "8"]);
    let one_f_one_b_4 = plan("1f1b-4", &["--pp", "2", "--grad-accum", "4"]);
    let gpipe = plan("gpipe", &["--pp", "2", "--grad-accum", "8", "--schedule", "gpipe"]);
    let gpipe_4 = plan("gpipe-4", &["--pp", "2", "--grad-accum", "4", "--schedule", "gpipe"]);
    let one = plan("one", &["--pp", "2", "--grad-accum", "1"]);
    assert_eq!((in_flight(&one_f_one_b, 0), in_flight(&one_f_one_b, 1)), (Some(2), Some(1)));
    assert_eq!((in_flight(&gpipe, 0), in_flight(&gpipe, 1)), (Some(8), Some(8)));
    let bubble = one_f_one_b["pipeline"]["bubble_fraction"].as_f64().unwrap();
    assert!((bubble - 1.0 / 9.0).abs() < 1e-12, "{bubble}");
    // The stages' own costs: the slowest idles no more than equal stages would, the others more.
    let stage_idle: Vec<f64> =
        one_f_one_b["pipeline"]["stage_idle"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(stage_idle.len(), 2);
    let fewest = stage_idle.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(fewest <= bubble + 1e-12 && stage_idle.iter().any(|&idle| idle > bubble), "{stage_idle:?} vs {bubble}");
    for stage in 0..2 {
        let single = peak(&one, stage);
        let (bounded_4, bounded_8) = (peak(&one_f_one_b_4, stage), peak(&one_f_one_b, stage));
        let (all_4, all_8) = (peak(&gpipe_4, stage), peak(&gpipe, stage));
        println!(
            "stage {stage}: activations peak, 1 micro-batch {single}; 1F1B x 4 {bounded_4}, x 8 {bounded_8}; \
             GPipe x 4 {all_4}, x 8 {all_8}"
        );
        // 1F1B holds the same micro-batches in flight whatever M is; GPipe holds every one, so
        // four more cost four micro-batches' saved activations (a good part of one's peak).
        assert_eq!(bounded_8, bounded_4, "stage {stage}");
        assert!(all_8 - all_4 >= 4 * single / 3, "stage {stage}: GPipe x 8 {all_8} vs x 4 {all_4}");
        assert!(all_8 > 2 * bounded_8, "stage {stage}: GPipe {all_8} vs 1F1B {bounded_8}");
    }
    // A split backward holds each layer's output gradient until the weights' gradients are
    // made; a whole one frees it after the layer's own two gradients (the uniform fixture's last
    // stage: 11.4 MB against 8.9 MB).
    let uniform = |backward: &str| {
        let report = dir.join(format!("uniform-{backward}.json"));
        let model = fixture("uniform", "model.onnx");
        success(autotp(&[
            "compile",
            model.to_str().unwrap(),
            "--seq-len",
            "64",
            "--micro-batch",
            "16",
            "--pp",
            "2",
            "--grad-accum",
            "4",
            "--pp-backward",
            backward,
            "--report",
            report.to_str().unwrap(),
            "-o",
            "/dev/null",
        ]));
        read_report(&report)
    };
    let (split, whole) = (uniform("split"), uniform("whole"));
    assert!(peak(&whole, 1) < peak(&split, 1), "{} vs {}", peak(&whole, 1), peak(&split, 1));
    assert!(peak(&whole, 0) <= peak(&split, 0), "{} vs {}", peak(&whole, 0), peak(&split, 0));
}

/// `run --clock cpu` times each pipeline stage by its own thread's CPU time (the idle shares of
/// stages with a core each, on a machine with fewer) and trains the same losses as the wall
/// clock; plans whose ranks meet in collectives are refused, as is an unknown clock.
#[test]
fn the_cpu_clock_times_pipeline_stages() {
    let dir = scratch("parallel-cpu-clock");
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let (pipelined, meshed) = (dir.join("pp2.atp"), dir.join("dp2.atp"));
    success(compile_gpt2(&["--pp", "2", "--grad-accum", "2", "-o", pipelined.to_str().unwrap()]));
    success(compile_gpt2(&["--dp", "2", "-o", meshed.to_str().unwrap()]));
    let run = |plan: &Path, clock: &str| {
        let metrics = dir.join(format!("{clock}.jsonl"));
        let args = ["--steps", "3", "--clock", clock, "--metrics-out", metrics.to_str().unwrap()];
        let out = autotp(&[&["run", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap()][..], &args].concat());
        (out, metrics)
    };
    let (wall, wall_metrics) = run(&pipelined, "wall");
    let (cpu, cpu_metrics) = run(&pipelined, "cpu");
    let log = String::from_utf8_lossy(&cpu.stderr).into_owned();
    success(wall);
    success(cpu);
    assert!(log.contains("idle share of a step per stage (median over steps, cpu clock)"), "{log}");
    let idle: Vec<f64> = log
        .lines()
        .filter(|l| l.split_whitespace().next().is_some_and(|first| first.parse::<usize>().is_ok()))
        .filter_map(|l| l.split_whitespace().nth(2)?.strip_suffix('%')?.parse().ok())
        .collect();
    assert_eq!(idle.len(), 2, "{log}");
    assert!(idle.iter().all(|share| (0.0..100.0).contains(share)), "{log}");
    assert_eq!(losses(&cpu_metrics), losses(&wall_metrics));
    let err = failure(run(&meshed, "cpu").0);
    assert!(
        err.contains(
            "--clock cpu: the training plan has 1 stage(s) of 2 rank(s), and the cpu clock times pipeline stages of one rank each"
        ),
        "{err}"
    );
    let err = failure(run(&pipelined, "sundial").0);
    assert!(err.contains("--clock 'sundial' is not one of wall, cpu"), "{err}");
}

#[test]
fn impossible_pipelines_are_refused() {
    let err = failure(compile_gpt2(&["--pp", "3", "--grad-accum", "4", "-o", "/dev/null"]));
    assert!(err.contains("--pp 3 asks for more stages than the model has layers (2: m.transformer.h.0 to"), "{err}");
    let err = failure(compile_gpt2(&["--pp", "2", "--pp-cuts", "m.transformer.h.7", "-o", "/dev/null"]));
    assert!(err.contains("--pp-cuts 'm.transformer.h.7': no parameter of the forward pass is named so"), "{err}");
    let cuts = "m.transformer.h.1,m.transformer.ln_f";
    let err = failure(compile_gpt2(&["--pp", "2", "--pp-cuts", cuts, "-o", "/dev/null"]));
    assert!(err.contains("--pp 2 needs 1 --pp-cuts, got 2"), "{err}");
    let err = failure(compile_gpt2(&["--pp-cuts", "m.transformer.h.1", "-o", "/dev/null"]));
    assert!(err.contains("need --pp 2 or more"), "{err}");
    let err = failure(compile_gpt2(&["--pp", "2", "--schedule", "zigzag", "-o", "/dev/null"]));
    assert!(err.contains("--schedule 'zigzag' is not one of 1f1b, gpipe"), "{err}");
    let err = failure(compile_gpt2(&["--pp", "2", "--pp-backward", "late", "-o", "/dev/null"]));
    assert!(err.contains("--pp-backward 'late' is not one of split, whole"), "{err}");
    let err = failure(compile_gpt2(&["--pp-backward", "split", "-o", "/dev/null"]));
    assert!(err.contains("need --pp 2 or more"), "{err}");
    // Named cuts: the second stage starts at layer 1.
    let out = success(compile_gpt2(&["--pp", "2", "--pp-cuts", "m.transformer.h.1", "-o", "/dev/null"]));
    assert!(out.contains("pipeline: 2 stages, 1f1b schedule (whole backward)"), "{out}");
}

/// A mixture of experts pipelined and split over tensor-parallel ranks with the GPipe
/// schedule: the split no longer stops on a stage's sends (nodes without outputs: it panicked),
/// and `verify` compiles its one-device reference without the pipeline's schedule (it refused
/// `--schedule gpipe` with one stage), then finds it training like one device.
#[test]
fn pipelined_tensor_parallel_experts_verify_against_one_device() {
    let dir = scratch("pp-tp-moe");
    let plan = dir.join("moe.atp");
    let model = fixture("mixtral", "model.onnx");
    let flags = ["--seq-len", "32", "--micro-batch", "4", "--pp", "2", "--tp", "2", "--grad-accum", "4"];
    let schedule = ["--schedule", "gpipe", "-o", plan.to_str().unwrap()];
    success(autotp(&[&["compile", model.to_str().unwrap()][..], &flags, &schedule].concat()));
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let report = success(autotp(&["verify", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap()]));
    assert!(report.contains("every gradient within 1e-5") && report.contains("trains like one device"), "{report}");
}

/// `autotp verify` on a tensor-parallel GPT-2 plan: within tolerance as compiled. Then with a
/// wrong split planted: the last backward all-reduce (the gradient entering the first block,
/// summed over the ranks' halves of its heads) becomes a plain copy, so each rank goes on with
/// its partial sum. The loss still agrees, the exit status is 1, and verify names the first
/// parameter whose gradient went wrong: the first block's input layer norm, the first gradient
/// the missing sum feeds.
#[test]
fn verify_names_the_first_wrong_gradient() {
    use autotp_program::{plan, Instruction};
    let dir = scratch("verify");
    let (compiled, planted) = (dir.join("tp2.atp"), dir.join("planted.atp"));
    let model = fixture("gpt2", "model.onnx");
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let args = ["--seq-len", "32", "--micro-batch", "8", "--tp", "2", "--lr", "2e-3"];
    success(autotp(&[&["compile", model.to_str().unwrap()][..], &args, &["-o", compiled.to_str().unwrap()]].concat()));
    let verify = |plan: &Path| autotp(&["verify", plan.to_str().unwrap(), "--data", tokens.to_str().unwrap()]);
    let report = success(verify(&compiled));
    assert!(report.contains("every gradient within 1e-5") && report.contains("trains like one device"), "{report}");

    let file = plan::PlanFile::open(&compiled).unwrap();
    let weights: std::collections::BTreeMap<String, Vec<u8>> =
        file.weights().into_iter().map(|(name, bytes)| (name, bytes.to_vec())).collect();
    let mut training = file.plan.clone();
    let program = &mut training.stages[0];
    // The last of the activations' (the finite check's one-element sum comes after them).
    let start = (program.instructions.iter())
        .rposition(|i| matches!(i, Instruction::CollectiveStart { input, .. } if input.len > 4))
        .unwrap();
    let wait = program
        .instructions
        .iter()
        .position(|i| matches!(i, Instruction::Wait { start: s, .. } if *s == start))
        .unwrap();
    let Instruction::CollectiveStart { input, output, .. } = program.instructions[start].clone() else {
        unreachable!()
    };
    let copy = autotp_kernels::Kernel::Copy;
    program.instructions[start] = Instruction::Kernel {
        kernel: copy,
        inputs: vec![input],
        outputs: vec![output],
        label: "planted".into(),
        gpu: None,
    };
    program.instructions.remove(wait);
    for instruction in &mut program.instructions {
        if let Instruction::Wait { start, .. } = instruction {
            *start -= usize::from(*start > wait);
        }
    }
    let borrowed = weights.iter().map(|(name, bytes)| (name.clone(), bytes.as_slice())).collect();
    plan::write(&planted, &training, &borrowed, &Default::default()).unwrap();
    let out = verify(&planted);
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}\n{}", String::from_utf8_lossy(&out.stderr));
    let step1 = report.lines().find(|l| l.trim_start().starts_with("1 ")).unwrap();
    assert!(!step1.contains("beyond"), "the forward pass is untouched: {report}");
    assert!(report.contains("first gradient beyond 1e-5: m.transformer.h.0.ln_1."), "{report}");
    assert!(report.contains("the plan differs from one device"), "{report}");
}
