//! `autotp compile` / `run` / `export` with checkpoints: resuming is bit-identical, a process
//! killed while saving leaves the previous checkpoint loadable, a checkpoint of another plan is
//! refused, and the exported model holds the trained weights.

use std::path::{Path, PathBuf};
use std::time::Duration;

use autotp_program::tensor_file::TensorFile;
use autotp_train::checkpoint::Checkpoint;

use crate::common::{autotp, bound, failure, fixture, losses, repo, scratch, success};

const CONTRACT: [&str; 10] =
    ["--seq-len", "32", "--micro-batch", "8", "--lr", "2e-3", "--betas", "0.9,0.95", "--weight-decay", "0.01"];

fn tokens() -> String {
    repo().join("tests/fixtures/train/tokens.bin").to_str().unwrap().to_string()
}

/// Compiles an architecture's logits export with the contract's settings (plus `extra`).
fn compile(arch: &str, dir: &Path, extra: &[&str]) -> PathBuf {
    let plan = dir.join(format!("{arch}.atp"));
    let model = fixture(arch, "model.onnx");
    let args: Vec<&str> =
        [&["compile", model.to_str().unwrap()][..], &CONTRACT, extra, &["-o", plan.to_str().unwrap()]].concat();
    success(autotp(&args));
    plan
}

/// `autotp run PLAN --data tokens.bin` plus `args`.
fn run(plan: &Path, args: &[&str]) -> std::process::Output {
    let tokens = tokens();
    autotp(&[&["run", plan.to_str().unwrap(), "--data", tokens.as_str()][..], args].concat())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn resume_is_bit_identical() {
    let dir = scratch("resume");
    let plan = compile("gpt2", &dir, &[]);
    let (straight, first, second) = (dir.join("straight.jsonl"), dir.join("first.jsonl"), dir.join("second.jsonl"));
    let (straight_ckpt, ckpt) = (dir.join("straight-ckpt"), dir.join("ckpt"));
    success(run(&plan, &["--steps", "30", "--metrics-out", s(&straight), "--save", s(&straight_ckpt)]));
    success(run(&plan, &["--steps", "15", "--metrics-out", s(&first), "--save", s(&ckpt)]));
    let stdout =
        success(run(&plan, &["--steps", "30", "--metrics-out", s(&second), "--resume", s(&ckpt), "--save", s(&ckpt)]));
    assert!(stdout.contains("step     16/30"), "the resumed run starts at step 16:\n{stdout}");

    let straight = losses(&straight);
    let resumed = losses(&second);
    assert_eq!(resumed.iter().map(|(step, _)| *step).collect::<Vec<_>>(), (16..=30).collect::<Vec<_>>());
    for ((step, want), (_, got)) in straight[15..].iter().zip(&resumed) {
        assert_eq!(got.to_bits(), want.to_bits(), "step {step}: resumed loss {got} != straight {want}");
    }
    assert_eq!(&losses(&first)[..], &straight[..15]);
    // The weights and optimizer state at step 30 are the same bytes too.
    let a = Checkpoint::open(&straight_ckpt).unwrap();
    let b = Checkpoint::open(&ckpt).unwrap();
    assert_eq!((a.manifest.step, b.manifest.step), (30, 30));
    for name in a.manifest.files.values().flatten() {
        assert_eq!(a.tensor(name).unwrap().bytes, b.tensor(name).unwrap().bytes, "tensor {name}");
    }
    println!("gpt2: steps 16-30 resumed from step 15 are bit-identical; final loss {}", resumed[14].1);
}

#[test]
fn a_save_killed_midway_leaves_the_previous_checkpoint() {
    let dir = scratch("crash");
    let plan = compile("gpt2", &dir, &[]);
    let ckpt = dir.join("ckpt");
    let crashed = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
        .args(["run", s(&plan), "--data", &tokens(), "--steps", "10", "--save", s(&ckpt), "--save-every", "5"])
        .env("AUTOTP_CRASH_DURING_CHECKPOINT", "10")
        .output()
        .unwrap();
    assert!(!crashed.status.success(), "the fault injection should have aborted the run");
    let stderr = String::from_utf8_lossy(&crashed.stderr);
    assert!(stderr.contains("aborting while writing"), "{stderr}");
    let leftovers: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-"))
        .collect();
    assert_eq!(leftovers.len(), 1, "the half-written step 10 is a staging directory: {leftovers:?}");
    assert_eq!(std::fs::read_to_string(ckpt.join("latest")).unwrap(), "step-00000005");
    assert_eq!(Checkpoint::open(&ckpt).unwrap().manifest.step, 5);

    // Resuming from what survived gives the uninterrupted run's losses, and the next save
    // clears the leftovers.
    let (straight, resumed) = (dir.join("straight.jsonl"), dir.join("resumed.jsonl"));
    success(run(&plan, &["--steps", "10", "--metrics-out", s(&straight)]));
    success(run(&plan, &["--steps", "10", "--resume", s(&ckpt), "--save", s(&ckpt), "--metrics-out", s(&resumed)]));
    assert_eq!(losses(&resumed), losses(&straight)[5..]);
    let names: Vec<String> =
        std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.starts_with(".tmp-")), "leftovers removed: {names:?}");
}

#[test]
fn sigkill_during_saves_leaves_a_loadable_checkpoint() {
    let dir = scratch("sigkill");
    let plan = compile("gpt2", &dir, &[]);
    // Kill the process at three different moments while it saves after every step.
    for (attempt, delay_ms) in [7u64, 23, 61].into_iter().enumerate() {
        let ckpt = dir.join(format!("ckpt-{attempt}"));
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
            .args(["run", s(&plan), "--data", &tokens(), "--steps", "100000", "--log-every", "100000"])
            .args(["--save", s(&ckpt), "--save-every", "1", "--keep-last", "2"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while !ckpt.join("latest").exists() {
            assert!(std::time::Instant::now() < deadline, "no checkpoint appeared");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let checkpoint = Checkpoint::open(&ckpt).unwrap_or_else(|e| panic!("attempt {attempt}: {e}"));
        let step = checkpoint.manifest.step;
        let next = (step + 1).to_string();
        let out = success(run(&plan, &["--steps", &next, "--resume", s(&ckpt)]));
        assert!(out.contains(&format!("step {next:>6}/{next}")), "{out}");
    }
}

#[test]
fn a_checkpoint_of_another_plan_is_refused() {
    let dir = scratch("refuse");
    let gpt2 = compile("gpt2", &dir, &[]);
    let ckpt = dir.join("ckpt");
    success(run(&gpt2, &["--steps", "1", "--save", s(&ckpt)]));

    let llama = compile("llama", &dir, &[]);
    let err = failure(run(&llama, &["--steps", "2", "--resume", s(&ckpt)]));
    assert!(err.contains("was written by another compiled plan"), "{err}");
    assert!(err.contains("the checkpoint has no tensor"), "names the first tensor that differs: {err}");

    // Same model, other sequence length: the tensors match, the settings say why.
    let short = dir.join("short");
    std::fs::create_dir_all(&short).unwrap();
    let model = fixture("gpt2", "model.onnx");
    let short_plan = short.join("gpt2.atp");
    let mut args = vec!["compile", s(&model)];
    args.extend(CONTRACT.iter().map(|a| if *a == "32" { "16" } else { a }));
    args.extend(["-o", s(&short_plan)]);
    success(autotp(&args));
    let err = failure(run(&short_plan, &["--steps", "2", "--resume", s(&ckpt)]));
    assert!(err.contains("seq-len 32 vs 16"), "{err}");

    let err = failure(run(&gpt2, &["--steps", "2", "--resume", s(&dir.join("nothing-here"))]));
    assert!(err.contains("does not exist or is not a directory"), "{err}");

    // A damaged checkpoint is refused, naming its file and what is wrong, never resumed from
    // an older one in its place.
    let step = std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().path()).find(|p| p.is_dir()).unwrap();
    let manifest = step.join("manifest.json");
    let damaged: [(&str, &[u8], &str); 3] = [
        ("manifest.json", b"{", "manifest.json: is not JSON (damaged?)"),
        ("manifest.json", b"{}", "manifest.json: names no format ('autotp-checkpoint/1' expected)"),
        ("model.safetensors", b"\x01\x02", "model.safetensors: not a valid safetensors file"),
    ];
    let intact = std::fs::read(&manifest).unwrap();
    for (file, bytes, expected) in damaged {
        let path = step.join(file);
        let kept = std::fs::read(&path).unwrap();
        std::fs::write(&path, bytes).unwrap();
        let err = failure(run(&gpt2, &["--steps", "2", "--resume", s(&ckpt)]));
        assert!(err.contains(expected), "{file}: {err}");
        std::fs::write(&path, kept).unwrap();
    }
    assert_eq!(std::fs::read(&manifest).unwrap(), intact);

    // A flipped byte inside a tensor, or in the manifest, is refused, naming the file and the
    // tensor; --no-verify reads them anyway.
    let weights = step.join("model.safetensors");
    let kept = std::fs::read(&weights).unwrap();
    let mut flipped = kept.clone();
    *flipped.last_mut().unwrap() ^= 0x10;
    std::fs::write(&weights, &flipped).unwrap();
    let err = failure(run(&gpt2, &["--steps", "2", "--resume", s(&ckpt)]));
    assert!(err.contains("model.safetensors: is damaged: tensor '") && err.contains("has CRC-32C"), "{err}");
    success(run(&gpt2, &["--steps", "2", "--resume", s(&ckpt), "--no-verify"]));
    std::fs::write(&weights, kept).unwrap();
    let text = String::from_utf8(intact.clone()).unwrap();
    let renumbered = text.replacen("\"train_steps\": 1", "\"train_steps\": 7", 1);
    assert_ne!(renumbered, text, "the manifest records train_steps 1");
    std::fs::write(&manifest, renumbered).unwrap();
    let err = failure(run(&gpt2, &["--steps", "2", "--resume", s(&ckpt)]));
    assert!(err.contains("manifest.json: is damaged: its CRC-32C is"), "{err}");
    std::fs::write(&manifest, &intact).unwrap();

    // Paths a checkpoint names stay inside it: a manifest naming a file up and out, or a
    // `latest` naming a step directory elsewhere, is refused, naming the file and the path.
    let text = String::from_utf8(intact.clone()).unwrap();
    let outside = text.replacen("\"model.safetensors\"", "\"../../model.safetensors\"", 1);
    assert_ne!(outside, text, "the manifest lists model.safetensors");
    std::fs::write(&manifest, outside).unwrap();
    let err = failure(run(&gpt2, &["--steps", "2", "--resume", s(&ckpt)]));
    assert!(err.contains("manifest.json: is damaged"), "its checksum catches the change first: {err}");
    // A manifest rewritten with its checksum (or read with --no-verify) meets the path rule.
    let err = failure(run(&gpt2, &["--steps", "2", "--resume", s(&ckpt), "--no-verify"]));
    assert!(err.contains("manifest.json: names the file '../../model.safetensors', which climbs out of"), "{err}");
    std::fs::write(&manifest, &intact).unwrap();
    let latest = ckpt.join("latest");
    let kept = std::fs::read(&latest).unwrap();
    std::fs::write(&latest, "/tmp").unwrap();
    let err = failure(run(&gpt2, &["--steps", "2", "--resume", s(&ckpt)]));
    assert!(err.contains("latest: names the step directory '/tmp', which is an absolute path"), "{err}");
    std::fs::write(&latest, kept).unwrap();
    success(run(&gpt2, &["--steps", "2", "--resume", s(&ckpt)]));
}

/// A checkpoint resumes under another parallel layout of the same training (DeepSpeed's
/// universal checkpoints): dp 2 ZeRO 3 -> tp 2, tp 2 -> pp 2 x dp 2, one rank -> dp 2 ZeRO 1.
/// Each rank reads its block of every parameter and AdamW state (a fused projection's states
/// in the model's shape, whatever view a layout computes with), and the next 10 steps follow the
/// uninterrupted run within 1e-5 relative.
#[test]
fn a_checkpoint_resumes_under_another_layout() {
    let dir = scratch("relayout");
    let model = fixture("gpt2", "model.onnx");
    let compile = |plan: &Path, layout: &[&str]| {
        let args = [
            &["compile", s(&model), "--seq-len", "32", "--lr", "2e-3", "--grad-clip", "1.0"][..],
            layout,
            &["-o", s(plan)],
        ]
        .concat();
        success(autotp(&args));
    };
    let losses_of = |metrics: &Path| crate::common::losses(metrics).into_iter().map(|(_, l)| l).collect::<Vec<f64>>();
    let layouts: [(&[&str], &[&str]); 3] = [
        (&["--micro-batch", "4", "--dp", "2", "--zero", "3"], &["--micro-batch", "8", "--tp", "2"]),
        (&["--micro-batch", "8", "--tp", "2"], &["--micro-batch", "4", "--pp", "2", "--dp", "2"]),
        (&["--micro-batch", "8"], &["--micro-batch", "4", "--dp", "2", "--zero", "1"]),
    ];
    for (from, to) in layouts {
        let (before, after, ckpt) = (dir.join("before.atp"), dir.join("after.atp"), dir.join("ckpt"));
        let _ = std::fs::remove_dir_all(&ckpt);
        compile(&before, from);
        compile(&after, to);
        let (whole, rest) = (dir.join("whole.jsonl"), dir.join("rest.jsonl"));
        // A resumed run appends to its metrics.
        let _ = std::fs::remove_file(&rest);
        success(run(&before, &["--steps", "15", "--metrics-out", s(&whole)]));
        success(run(&before, &["--steps", "5", "--save", s(&ckpt)]));
        let out = run(&after, &["--steps", "15", "--resume", s(&ckpt), "--metrics-out", s(&rest)]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        success(out);
        assert!(stderr.contains("written by another parallel layout"), "{stderr}");
        let (whole, rest) = (losses_of(&whole), losses_of(&rest));
        assert_eq!(rest.len(), 10);
        let worst = whole[5..].iter().zip(&rest).map(|(a, b)| ((a - b) / a).abs()).fold(0.0, f64::max);
        assert!(worst <= 1e-5, "{from:?} -> {to:?}: {worst:.2e} relative");
    }
}

#[test]
fn export_writes_the_trained_weights_into_the_model() {
    let dir = scratch("export");
    let plan = compile("gpt2", &dir, &[]);
    let ckpt = dir.join("ckpt");
    success(run(&plan, &["--steps", "3", "--save", s(&ckpt)]));
    let (onnx, external, st) = (dir.join("trained.onnx"), dir.join("external.onnx"), dir.join("trained.safetensors"));
    let out = success(autotp(&["export", s(&ckpt), "-o", s(&onnx), "--safetensors", s(&st)]));
    assert!(out.contains("28 initializers"), "{out}");
    success(autotp(&["export", s(&ckpt), "-o", s(&external), "--external-data"]));
    assert!(dir.join("external.onnx.data").is_file());

    let checkpoint = Checkpoint::open(&ckpt).unwrap();
    let original = autotp_frontend::import_onnx(&fixture("gpt2", "model.onnx"), &bound()).unwrap();
    let consolidated = TensorFile::open(&st).unwrap();
    for path in [&onnx, &external] {
        let trained = autotp_frontend::import_onnx(path, &bound()).unwrap();
        assert_eq!(trained.weights.len(), checkpoint.params().len());
        for t in checkpoint.params() {
            assert_eq!(trained.weights[&t.name].bytes(), &*t.bytes, "{}: {}", path.display(), t.name);
            assert_eq!(consolidated.get(&t.name).unwrap().bytes, &*t.bytes);
        }
        assert_eq!(autotp_ir::text::print(&trained.graph), autotp_ir::text::print(&original.graph), "same graph");
    }
    let changed = checkpoint.params().iter().filter(|t| original.weights[&t.name].bytes() != &*t.bytes).count();
    assert_eq!(changed, checkpoint.params().len(), "three AdamW steps change every parameter");

    let err = failure(autotp(&["export", s(&ckpt), "-o", s(&onnx), "--model", s(&fixture("llama", "model.onnx"))]));
    assert!(err.contains("is not an initializer of") || err.contains("the trained weight"), "{err}");

    // Nothing the user has is written over: the source model, a file of the checkpoint.
    let model = dir.join("source.onnx");
    std::fs::copy(fixture("gpt2", "model.onnx"), &model).unwrap();
    let source = std::fs::read(&model).unwrap();
    let err = failure(autotp(&["export", s(&ckpt), "-o", s(&model), "--model", s(&model)]));
    assert!(err.contains("source.onnx is the model the checkpoint was trained from"), "{err}");
    assert_eq!(std::fs::read(&model).unwrap(), source);
    let shard = std::fs::read_dir(Checkpoint::open(&ckpt).unwrap().dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .unwrap();
    let err = failure(autotp(&["export", s(&ckpt), "--safetensors", s(&shard)]));
    assert!(err.contains("is a file of the checkpoint being exported"), "{err}");
    Checkpoint::open(&ckpt).unwrap();
}

/// `export --hf` of a model that scripts/export_hf.py exported (the hf_export fixture, a Llama
/// with tied embeddings): model.safetensors under the model's own names (the tied weight once,
/// under the name `save_pretrained` keeps), bf16 on request, and the export's config.json and
/// tokenizer.json beside it. A model without the names is refused, naming the metadata.
#[test]
fn export_writes_a_hugging_face_directory() {
    let dir = scratch("export-hf");
    let plan = compile("hf_export", &dir, &[]);
    let ckpt = dir.join("ckpt");
    success(run(&plan, &["--steps", "2", "--save", s(&ckpt)]));
    let (hf, hf16) = (dir.join("hf"), dir.join("hf16"));
    let out = success(autotp(&["export", s(&ckpt), "--hf", s(&hf)]));
    assert!(out.contains("(LlamaForCausalLM): model.safetensors (20 tensors in f32, step 2)"), "{out}");
    success(autotp(&["export", s(&ckpt), "--hf", s(&hf16), "--dtype", "bf16"]));
    let checkpoint = Checkpoint::open(&ckpt).unwrap();
    let weights = TensorFile::open(&hf.join("model.safetensors")).unwrap();
    let weights16 = TensorFile::open(&hf16.join("model.safetensors")).unwrap();
    let names: Vec<&str> = weights.names().collect();
    assert!(names.contains(&"model.embed_tokens.weight") && !names.contains(&"lm_head.weight"), "{names:?}");
    assert_eq!(names.len(), checkpoint.params().len());
    assert_eq!(weights.metadata("format"), Some("pt"));
    for t in checkpoint.params() {
        let name = t.name.strip_prefix("m.").unwrap();
        assert_eq!(weights.get(name).unwrap().bytes, &*t.bytes, "{name}");
        let half = weights16.get(name).unwrap();
        assert_eq!(half.dtype, autotp_ir::DType::BF16);
        // bf16 keeps an f32's upper 16 bits, rounded to nearest even: within half an ulp (2^-8).
        let first = f32::from_le_bytes(t.bytes[..4].try_into().unwrap());
        let rounded = f32::from_bits(u32::from(u16::from_le_bytes(half.bytes[..2].try_into().unwrap())) << 16);
        assert!((first - rounded).abs() <= first.abs() / 256.0, "{name}: {first} as bf16 {rounded}");
    }
    for file in ["config.json", "tokenizer.json"] {
        assert_eq!(std::fs::read(hf.join(file)).unwrap(), std::fs::read(fixture("hf_export", file)).unwrap());
    }
    // --hf into the original model's own directory would copy its config.json onto itself.
    let beside = dir.join("beside");
    std::fs::create_dir_all(&beside).unwrap();
    for file in ["model.onnx", "config.json", "tokenizer.json"] {
        std::fs::copy(fixture("hf_export", file), beside.join(file)).unwrap();
    }
    let model = beside.join("model.onnx");
    let err = failure(autotp(&["export", s(&ckpt), "--hf", s(&beside), "--model", s(&model)]));
    assert!(err.contains("config.json is the file --hf copies there"), "{err}");
    assert_eq!(
        std::fs::read(beside.join("config.json")).unwrap(),
        std::fs::read(fixture("hf_export", "config.json")).unwrap()
    );
    let plan = compile("gpt2", &dir, &[]);
    let gpt2 = dir.join("gpt2-ckpt");
    success(run(&plan, &["--steps", "1", "--save", s(&gpt2)]));
    let err = failure(autotp(&["export", s(&gpt2), "--hf", s(&dir.join("gpt2-hf"))]));
    assert!(err.contains("records no Hugging Face parameter names (metadata 'autotp.hf_parameters')"), "{err}");
}

/// The first step of a cosine schedule has learning rate 0: the weights must not move. (The
/// step's `lr` input must carry the schedule, not the peak.)
#[test]
fn the_schedule_feeds_the_learning_rate() {
    let dir = scratch("warmup");
    let plan = compile("gpt2", &dir, &["--lr-schedule", "cosine", "--warmup-steps", "4"]);
    let ckpt = dir.join("ckpt");
    success(run(&plan, &["--steps", "1", "--save", s(&ckpt)]));
    let original = autotp_frontend::import_onnx(&fixture("gpt2", "model.onnx"), &bound()).unwrap();
    let checkpoint = Checkpoint::open(&ckpt).unwrap();
    for t in checkpoint.params() {
        assert_eq!(original.weights[&t.name].bytes(), &*t.bytes, "{} moved at lr 0", t.name);
    }
}

/// A run on a mesh saves each rank's shards; resuming it on the same plan is bit-identical, and
/// `export` consolidates the shards into the model (GPT-2's fused QKV back in its ONNX shape).
/// With gradient accumulation too (the data position counts whole steps), and pipelines.
#[test]
fn sharded_resume_is_bit_identical_and_exports() {
    for (name, parallel) in [
        ("dp2", &["--dp", "2"][..]),
        ("tp2-dp2-zero3", &["--tp", "2", "--dp", "2", "--zero", "3"][..]),
        ("dp2-accum2-zero2", &["--dp", "2", "--grad-accum", "2", "--zero", "2"][..]),
        // Pipeline stages: each stage's ranks write what they hold; the tied embedding once.
        ("pp2", &["--pp", "2", "--grad-accum", "2"][..]),
        ("pp2-tp2", &["--pp", "2", "--tp", "2", "--grad-accum", "2"][..]),
    ] {
        let dir = scratch(&format!("resume-{name}"));
        let model = fixture("gpt2", "model.onnx");
        let plan = dir.join("gpt2.atp");
        let mut args = vec!["compile", s(&model)];
        args.extend(CONTRACT.iter().map(|a| if *a == "8" { "4" } else { a }));
        args.extend(parallel);
        args.extend(["-o", s(&plan)]);
        success(autotp(&args));
        let (straight, resumed, ckpt) = (dir.join("straight.jsonl"), dir.join("resumed.jsonl"), dir.join("ckpt"));
        let straight_run = run(&plan, &["--steps", "10", "--metrics-out", s(&straight)]);
        let log = String::from_utf8_lossy(&straight_run.stderr).into_owned();
        success(straight_run);
        if name.starts_with("pp2") {
            // Each stage's idle share, and the busiest stage's beside the textbook 1 / (2 + 1).
            assert!(log.contains("pipeline (1f1b schedule, whole backward): idle share"), "{name}: {log}");
            let bubble = log.lines().find(|l| l.starts_with("bubble")).unwrap_or_else(|| panic!("{name}: {log}"));
            assert!(bubble.contains("(stage ") && bubble.trim_end().ends_with("33.3%"), "{name}: {bubble}");
        }
        success(run(&plan, &["--steps", "5", "--save", s(&ckpt)]));
        let step_dir = ckpt.join("step-00000005");
        let ranks = if name.starts_with("dp2") || name == "pp2" { 2 } else { 4 };
        for rank in 0..ranks {
            assert!(step_dir.join(format!("rank-{rank:05}.safetensors")).is_file(), "{name}: rank {rank}'s shard file");
        }
        success(run(&plan, &["--steps", "10", "--resume", s(&ckpt), "--metrics-out", s(&resumed)]));
        let straight = losses(&straight);
        let resumed = losses(&resumed);
        assert_eq!(resumed.len(), 5, "{name}");
        for ((step, want), (_, got)) in straight[5..].iter().zip(&resumed) {
            assert_eq!(got.to_bits(), want.to_bits(), "{name} step {step}: resumed loss {got} != straight {want}");
        }
        let trained = dir.join("trained.onnx");
        let out = success(autotp(&["export", s(&ckpt), "-o", s(&trained)]));
        assert!(out.contains("28 initializers"), "{name}: {out}");
        let exported = autotp_frontend::import_onnx(&trained, &bound()).unwrap();
        let checkpoint = Checkpoint::open(&ckpt).unwrap();
        for t in checkpoint.params() {
            assert_eq!(exported.weights[&t.name].bytes(), &*t.bytes, "{name}: {}", t.name);
            assert_eq!(exported.weights[&t.name].ty.shape, t.shape, "{name}: {} in its ONNX shape", t.name);
        }
    }
}

/// A multi-query model under `--tp 2`: its fused `c_attn` trains as three parameters (the
/// query part split, the key and value parts replicated). Checkpoints hold the parts and
/// resume bit-identically; `export` and `Checkpoint::params` join them into the model's
/// weights, and the joined gradient evidence (AdamW's first moment at step 1) matches the
/// one-device run's.
#[test]
fn fused_weights_trained_in_parts_resume_and_export_whole() {
    let dir = scratch("resume-parts");
    let parts_plan = dir.join("bigcode-tp2.atp");
    std::fs::rename(compile("bigcode_mqa", &dir, &["--tp", "2"]), &parts_plan).unwrap();
    let one_device = compile("bigcode_mqa", &dir, &[]);
    let (straight, resumed, ckpt) = (dir.join("straight.jsonl"), dir.join("resumed.jsonl"), dir.join("ckpt"));
    success(run(&parts_plan, &["--steps", "4", "--metrics-out", s(&straight)]));
    success(run(&parts_plan, &["--steps", "2", "--save", s(&ckpt)]));
    success(run(&parts_plan, &["--steps", "4", "--resume", s(&ckpt), "--metrics-out", s(&resumed)]));
    for ((step, want), (_, got)) in losses(&straight)[2..].iter().zip(&losses(&resumed)) {
        assert_eq!(got.to_bits(), want.to_bits(), "step {step}: resumed loss {got} != straight {want}");
    }

    let original = autotp_frontend::import_onnx(&fixture("bigcode_mqa", "model.onnx"), &bound()).unwrap();
    let parts = Checkpoint::open(&ckpt).unwrap();
    let names: Vec<String> = parts.params().into_iter().map(|t| t.name).collect();
    assert_eq!(names.len(), original.weights.len(), "{names:?}");
    let trained = dir.join("trained.onnx");
    success(autotp(&["export", s(&ckpt), "-o", s(&trained)]));
    let exported = autotp_frontend::import_onnx(&trained, &bound()).unwrap();
    for t in parts.params() {
        assert_eq!(t.shape, original.weights[&t.name].ty.shape, "{}", t.name);
        assert_ne!(original.weights[&t.name].bytes(), &*t.bytes, "{} trained", t.name);
        assert_eq!(exported.weights[&t.name].bytes(), &*t.bytes, "{}", t.name);
    }

    let (step1, reference) = (dir.join("step1"), dir.join("reference"));
    success(run(&parts_plan, &["--steps", "1", "--save", s(&step1)]));
    success(run(&one_device, &["--steps", "1", "--save", s(&reference)]));
    let (parts, whole) = (Checkpoint::open(&step1).unwrap(), Checkpoint::open(&reference).unwrap());
    let floats = |bytes: &[u8]| bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    for name in &names {
        let moment = format!("adamw.m.{name}");
        let (got, want) = (parts.tensor(&moment).unwrap(), whole.tensor(&moment).unwrap());
        assert_eq!(got.shape, want.shape, "{moment}");
        let (a, b) = (floats(&got.bytes), floats(&want.bytes));
        let largest = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 1e-5 * largest, "{moment}: differs by {worst} (largest {largest})");
    }
}
