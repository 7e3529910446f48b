//! Activation recomputation (`--recompute selective|full|auto`): core attention or whole layers
//! recomputed in the backward train bit-identically to keeping them (the same kernels on the
//! same inputs), under every layout and precision, and lower the planned activation peak; `auto`
//! chooses the cheapest that fits `--memory-cap`.

use std::path::Path;

use crate::common::{autotp, failure, fixture, losses, run_plan, scratch, success};

/// Compiles `arch` at sequence length 128 with `flags`, attention unfused (the exported
/// scores and softmax: what selective recomputation makes again); the summary.
fn compile(arch: &str, plan: &Path, flags: &[&str]) -> String {
    let model = fixture(arch, "model.onnx");
    let args = [
        &["compile", model.to_str().unwrap(), "--seq-len", "128", "--lr", "2e-3", "--attention", "unfused"][..],
        flags,
        &["-o", plan.to_str().unwrap()],
    ]
    .concat();
    success(autotp(&args))
}

/// Six steps of `plan`; the losses. Every rank's activations, as `run` measures them (the
/// arena bytes its runs wrote), are within 5% of the plan's peak (the live bytes' maximum, which
/// placing values of many lifetimes need not reach). Here: 0.0% but for Llama's full
/// recomputation under ZeRO-3 with accumulation, 3.0% (dp 2) and 3.6% (tp 2 x dp 2), and its
/// pipeline's selective recomputation, 1.2%; first fit was 14% over on tp 2 x dp 2 and 41% on
/// Llama's, placing the largest first 6.5-15.8% on Llama's.
fn train(plan: &Path, metrics: &Path, save: &Path) -> Vec<(u64, f64)> {
    let stderr = run_plan(plan, metrics, 6, &["--save", save.to_str().unwrap()]);
    let measured: Vec<&str> = stderr.lines().filter(|l| l.starts_with("activations of rank")).collect();
    assert!(!measured.is_empty(), "{stderr}");
    for line in measured {
        let written = number(line.split(": ").nth(1).unwrap().split(' ').next().unwrap());
        let peak = number(line.split("plan's peak ").nth(1).unwrap().split(' ').next().unwrap());
        assert!(
            written as f64 >= 0.99 * peak as f64 && written as f64 <= 1.05 * peak as f64,
            "{}: {line}",
            plan.display()
        );
    }
    losses(metrics)
}

/// Six steps of `kept` and of `again` give the same losses and the same final weights, bit for
/// bit (their checkpoints under `dir`, named by `tag`).
fn assert_trains_identically(dir: &Path, kept: &Path, again: &Path, tag: &str, label: &str) {
    let (ck_kept, ck_again) = (dir.join(format!("ck-kept-{tag}")), dir.join(format!("ck-again-{tag}")));
    let a = train(kept, &dir.join("kept.jsonl"), &ck_kept);
    let b = train(again, &dir.join("again.jsonl"), &ck_again);
    assert_eq!(a, b, "{label}: losses");
    let (a, b) = (
        autotp_train::checkpoint::Checkpoint::open(&ck_kept).unwrap(),
        autotp_train::checkpoint::Checkpoint::open(&ck_again).unwrap(),
    );
    for t in a.params() {
        assert!(t.bytes == b.tensor(&t.name).unwrap().bytes, "{label}: '{}' after 6 steps", t.name);
    }
}

fn number(s: &str) -> usize {
    s.trim_matches(|c: char| !c.is_ascii_digit()).replace(',', "").parse::<usize>().unwrap()
}

/// The recompute lines of a summary for `mode` (`selective`, `full`, `full (first 1 layers)`):
/// (blocks or layers, with, without) per stage.
fn recompute_lines(summary: &str, mode: &str) -> Vec<(usize, usize, usize)> {
    summary
        .lines()
        .filter(|l| l.contains(&format!("recompute {mode}:")))
        .map(|l| {
            let what = match mode {
                "elementwise" => " elementwise ops",
                "selective" => " attention blocks",
                _ => " layers per step",
            };
            let blocks = number(l.split(what).next().unwrap().rsplit(' ').next().unwrap());
            let with = number(l.split("activations peak ").nth(1).unwrap().split(' ').next().unwrap());
            let without = number(l.split("without: ").nth(1).unwrap().split(", ").next().unwrap());
            (blocks, with, without)
        })
        .collect()
}

/// GPT-2 and Llama, f32 and bf16, one rank and tp 2, dp 2 ZeRO 3, pp 2: six steps with
/// core attention recomputed give the same losses and the same final weights, bit for bit, as
/// keeping it, with a lower planned activation peak where a stage holds attention.
#[test]
fn selective_recomputation_trains_bit_identically_with_less_memory() {
    let dir = scratch("recompute");
    let layouts: [&[&str]; 4] = [
        &["--micro-batch", "8"],
        &["--micro-batch", "8", "--tp", "2"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "3"],
        &["--micro-batch", "4", "--pp", "2", "--grad-accum", "2"],
    ];
    for arch in ["gpt2", "llama"] {
        for precision in ["f32", "bf16"] {
            for (l, layout) in layouts.iter().enumerate() {
                let flags = [&["--precision", precision][..], layout].concat();
                let label = format!("{arch} {precision} {layout:?}");
                let (kept, again) = (dir.join("kept.atp"), dir.join("again.atp"));
                compile(arch, &kept, &flags);
                let summary = compile(arch, &again, &[&flags[..], &["--recompute", "selective"]].concat());
                let lines = recompute_lines(&summary, "selective");
                assert_eq!(lines.len(), if l == 3 { 2 } else { 1 }, "{label}: a line per stage\n{summary}");
                let blocks: usize = lines.iter().map(|l| l.0).sum();
                assert_eq!(blocks, 2 * if l == 3 { 2 } else { 1 }, "{label}: a block per layer and micro-batch");
                for &(blocks, with, without) in &lines {
                    assert!(blocks == 0 || with < without, "{label}: peak {with} with, {without} without");
                }
                assert_trains_identically(&dir, &kept, &again, &format!("{l}"), &label);
            }
        }
    }
    // Fused attention (the default) keeps no scores: selective recomputation finds nothing to
    // make again, and says why.
    let model = fixture("gpt2", "model.onnx");
    let args = ["compile", model.to_str().unwrap(), "--seq-len", "128", "--micro-batch", "8"];
    let summary = success(autotp(&[&args[..], &["--recompute", "selective", "-o", "/dev/null"]].concat()));
    assert!(
        summary.contains("recompute selective: 0 attention blocks per step")
            && summary.contains("fused attention keeps no scores or probabilities"),
        "{summary}"
    );
}

/// The arena a summary gives each rank (the largest, over stages).
fn arena(summary: &str) -> usize {
    let arenas = summary.lines().filter(|l| l.trim_start().starts_with("total arena"));
    arenas.map(|l| number(l.split_whitespace().nth(2).unwrap())).max().unwrap()
}

/// Elementwise ops made again from what the backward keeps anyway (a GELU from its input, a
/// 16-bit copy from its f32 value): GPT-2 in bf16 and Llama in f32 under one rank, tp 2, dp 2
/// ZeRO 3 and pp 2 train bit-identically to keeping them, lower the planned peak on one rank
/// for a few FLOPs per element (far fewer than core attention's), and the runs' measured
/// activations stay within 5% of the plan.
#[test]
fn elementwise_recomputation_trains_bit_identically_with_less_memory() {
    let dir = scratch("recompute-elementwise");
    let layouts: [&[&str]; 4] = [
        &["--micro-batch", "8"],
        &["--micro-batch", "8", "--tp", "2"],
        &["--micro-batch", "4", "--dp", "2", "--zero", "3"],
        &["--micro-batch", "4", "--pp", "2", "--grad-accum", "2"],
    ];
    for (arch, precision) in [("gpt2", "bf16"), ("llama", "f32")] {
        for (l, layout) in layouts.iter().enumerate() {
            let flags = [&["--precision", precision][..], layout].concat();
            let label = format!("{arch} {precision} {layout:?}");
            let (kept, again) = (dir.join("kept.atp"), dir.join("again.atp"));
            compile(arch, &kept, &flags);
            let summary = compile(arch, &again, &[&flags[..], &["--recompute", "elementwise"]].concat());
            let lines = recompute_lines(&summary, "elementwise");
            if l == 0 {
                let (ops, with, without) = lines[0];
                assert!(ops > 0 && with < without, "{label}: {ops} ops, peak {with} with, {without} without");
                let selective =
                    compile(arch, &dir.join("s.atp"), &[&flags[..], &["--recompute", "selective"]].concat());
                let flops = |summary: &str, mode: &str| {
                    let line = summary.lines().find(|l| l.contains(&format!("recompute {mode}:"))).unwrap();
                    number(line.split(" FLOPs").next().unwrap().rsplit('+').next().unwrap())
                };
                assert!(10 * flops(&summary, "elementwise") < flops(&selective, "selective"), "{label}\n{summary}");
            }
            assert_trains_identically(&dir, &kept, &again, &format!("{arch}-{l}"), &label);
        }
    }
}

/// Whole layers recomputed from their inputs (all of them, or the first of each stage) under
/// one rank, tp 2, dp 2 ZeRO 3 with accumulation, pp 2 and tp 2 x dp 2 ZeRO 3: the same losses
/// and final weights bit for bit as keeping every activation, a layer per layer and
/// micro-batch, and a lower peak on the stages that keep activations across layers.
#[test]
fn full_recomputation_trains_bit_identically_with_less_memory() {
    let dir = scratch("recompute-full");
    let layouts: [&[&str]; 5] = [
        &["--micro-batch", "8"],
        &["--micro-batch", "8", "--tp", "2"],
        &["--micro-batch", "2", "--dp", "2", "--zero", "3", "--grad-accum", "2"],
        &["--micro-batch", "4", "--pp", "2", "--grad-accum", "2"],
        &["--micro-batch", "2", "--tp", "2", "--dp", "2", "--zero", "3", "--grad-accum", "2"],
    ];
    for (arch, precision) in [("gpt2", "bf16"), ("llama", "f32")] {
        for (l, layout) in layouts.iter().enumerate() {
            let flags = [&["--precision", precision][..], layout].concat();
            let label = format!("{arch} {precision} {layout:?}");
            let kept = dir.join("kept.atp");
            compile(arch, &kept, &flags);
            let ck_kept = dir.join(format!("ck-kept-{arch}-{l}"));
            let a = train(&kept, &dir.join("kept.jsonl"), &ck_kept);
            let a_weights = autotp_train::checkpoint::Checkpoint::open(&ck_kept).unwrap();
            let micro_batches = if l >= 2 { 2 } else { 1 };
            for (mode, extra) in [("full", &[][..]), ("full (first 1 layers)", &["--recompute-layers", "1"][..])] {
                let label = format!("{label} {mode}");
                let again = dir.join("again.atp");
                let summary = compile(arch, &again, &[&flags[..], &["--recompute", "full"], extra].concat());
                let lines = recompute_lines(&summary, mode);
                let pipelined = l == 3;
                assert_eq!(lines.len(), if pipelined { 2 } else { 1 }, "{label}: a line per stage\n{summary}");
                let layers = if extra.is_empty() { 2 } else { 1 };
                if !pipelined {
                    assert_eq!(lines[0].0, layers * micro_batches, "{label}: a layer per layer and micro-batch");
                }
                let (_, with, without) = lines[0];
                assert!(with < without, "{label}: peak {with} with, {without} without\n{summary}");
                let ck_again = dir.join(format!("ck-again-{arch}-{l}-{}", extra.len()));
                let b = train(&again, &dir.join("again.jsonl"), &ck_again);
                assert_eq!(a, b, "{label}: losses");
                let b_weights = autotp_train::checkpoint::Checkpoint::open(&ck_again).unwrap();
                for t in a_weights.params() {
                    assert!(t.bytes == b_weights.tensor(&t.name).unwrap().bytes, "{label}: '{}' after 6 steps", t.name);
                }
            }
        }
    }
}

/// Korthikanti et al.'s figures beside autotp's: in bf16, full recomputation keeps 2sbh bytes
/// per layer (its input), and the summary prints both; fewer layers recomputed keep more. The
/// recomputed layers run after the forward's loss (the schedule fuses no clone into the
/// forward, which would keep its output alive as before).
#[test]
fn full_recomputation_keeps_each_layers_input_as_korthikanti_counts() {
    let dir = scratch("recompute-korthikanti");
    let flags = ["--precision", "bf16", "--micro-batch", "8"];
    let dump = dir.join("ir");
    let summary = compile(
        "gpt2",
        &dir.join("full.atp"),
        &[&flags[..], &["--recompute", "full", "--dump-ir", dump.to_str().unwrap()]].concat(),
    );
    let fused = std::fs::read_dir(&dump)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_str().unwrap().ends_with("fusion.ir"))
        .unwrap();
    let fused = std::fs::read_to_string(fused).unwrap();
    let loss_at = fused.find("= cross_entropy").unwrap();
    let norms_before = fused[..loss_at].matches("= layer_norm").count();
    let norms_after = fused[loss_at..].matches("= layer_norm").count();
    assert_eq!((norms_before, norms_after), (5, 4), "2 norms per layer and the final one, then the clones");
    let line = summary.lines().find(|l| l.contains("per layer: keeps its input")).expect(&summary);
    let kept = number(line.split("keeps its input, ").nth(1).unwrap().split(' ').next().unwrap());
    let formula = number(line.split("2sbh = ").nth(1).unwrap().split(' ').next().unwrap());
    // s = 128, b = 8, h = 64, two bytes each.
    assert_eq!((kept, formula), (2 * 128 * 8 * 64, 2 * 128 * 8 * 64), "{line}");
    assert!(line.contains("sbh(34 + 5as/h) - 2sbh = "), "{line}");
    let first = compile(
        "gpt2",
        &dir.join("first.atp"),
        &[&flags[..], &["--recompute", "full", "--recompute-layers", "1"]].concat(),
    );
    let (all, one) = (recompute_lines(&summary, "full")[0], recompute_lines(&first, "full (first 1 layers)")[0]);
    assert!(all.1 < one.1 && one.1 < one.2, "peaks: all layers {all:?}, the first {one:?}");
}

/// `--recompute auto` takes the cheapest recomputation that fits `--memory-cap`: nothing when
/// the plan fits, elementwise ops when that is enough, then core attention, whole layers below,
/// and refuses with the smallest reachable arena below that; any mode above the cap is refused,
/// naming the bytes.
#[test]
fn auto_recomputation_fits_the_memory_cap() {
    let dir = scratch("recompute-auto");
    let flags = ["--precision", "bf16", "--micro-batch", "8"];
    let plan = dir.join("plan.atp");
    let arenas: Vec<usize> = ["none", "elementwise", "selective", "full"]
        .iter()
        .map(|mode| arena(&compile("gpt2", &plan, &[&flags[..], &["--recompute", mode]].concat())))
        .collect();
    assert!(arenas[0] > arenas[1] && arenas[1] > arenas[2] && arenas[2] > arenas[3], "{arenas:?}");
    let auto = |cap: usize| {
        let cap = cap.to_string();
        let model = fixture("gpt2", "model.onnx");
        let args = [
            &["compile", model.to_str().unwrap(), "--seq-len", "128", "--lr", "2e-3", "--attention", "unfused"][..],
            &flags,
            &["--recompute", "auto", "--memory-cap", &cap, "-o", plan.to_str().unwrap()],
        ]
        .concat();
        autotp(&args)
    };
    for (cap, chosen) in
        [(arenas[0], "none"), (arenas[1], "elementwise"), (arenas[2], "selective"), (arenas[3], "full")]
    {
        let summary = success(auto(cap));
        assert!(summary.contains(&format!("recompute {chosen}:")), "cap {cap}: {chosen} expected\n{summary}");
        assert!(arena(&summary) <= cap, "cap {cap}\n{summary}");
    }
    let refused = failure(auto(arenas[3] - 1));
    assert!(refused.contains(&format!("needs at least {}", arenas[3])), "{refused}");
    let model = fixture("gpt2", "model.onnx");
    let cap = (arenas[0] - 1).to_string();
    let args = [
        &["compile", model.to_str().unwrap(), "--seq-len", "128", "--attention", "unfused"][..],
        &flags,
        &["--memory-cap", &cap, "-o", plan.to_str().unwrap()],
    ]
    .concat();
    let refused = failure(autotp(&args));
    assert!(refused.contains(&format!("needs {} bytes, over --memory-cap {cap}", arenas[0])), "{refused}");
}
