//! `autotp compile`: the summary, `--dump-ir`, `--print-after`, `--freeze`, and `.atp` files
//! that are damaged or of another kind.

use std::path::Path;

use autotp_train::checkpoint::Checkpoint;

use crate::common::{autotp, bound, failure, fixture, repo, scratch, success};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn compile_args<'a>(model: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    [&["compile", s(model), "--seq-len", "32", "--micro-batch", "4"][..], extra].concat()
}

#[test]
fn summary_and_ir_dumps() {
    let dir = scratch("compile-dump");
    let model = fixture("gpt2", "model.onnx");
    let (plan, dumps) = (dir.join("gpt2.atp"), dir.join("ir"));
    let out =
        success(autotp(&compile_args(&model, &["--dump-ir", s(&dumps), "--print-after", "loss", "-o", s(&plan)])));
    for expected in [
        "parameters: 172,288 in 28 tensors (172,288 trainable, 0 frozen in 0 tensors)",
        "optimizer state",
        "activations peak",
        "instructions: ",
        "matmul",
        "multi_tensor_adamw 1",
        "fingerprint: ",
        "# IR after pass 7 (loss)",
        "output \"loss\" = ",
    ] {
        assert!(out.contains(expected), "summary lacks '{expected}':\n{out}");
    }
    // A reshape is the same bytes under another shape: it shares its input's region, no copy;
    // only the reshape of the labels (a trainer's buffer) is copied (`peephole` removed the
    // input ids' reshape to their own shape).
    let reshapes = std::fs::read_to_string(dumps.join("10-dce.ir")).unwrap().matches(" = reshape ").count();
    assert!(reshapes > 20 && out.contains(" copy 1,"), "{reshapes} reshapes:\n{out}");
    let mut files: Vec<String> =
        std::fs::read_dir(&dumps).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(
        files,
        [
            "00-import.ir",
            "01-recognize.ir",
            "02-peephole.ir",
            "03-unmerge-heads.ir",
            "04-dce.ir",
            "05-attention.ir",
            "06-dce.ir",
            "07-loss.ir",
            "08-autodiff.ir",
            "09-optimize.ir",
            "10-dce.ir",
            "11-fusion.ir"
        ]
    );
    // Every dump is valid IR.
    for f in &files {
        let text = std::fs::read_to_string(dumps.join(f)).unwrap();
        let graph = autotp_ir::text::parse(&text).unwrap_or_else(|e| panic!("{f}: {e}"));
        autotp_ir::verify(&graph).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    let err = failure(autotp(&compile_args(&model, &["--print-after", "zero", "-o", s(&plan)])));
    assert!(
        err.contains(
            "--print-after 'zero': no such pass (the pipeline runs recognize, peephole, unmerge-heads, dce, \
             attention, dce, loss"
        ),
        "{err}"
    );
}

/// With a pipeline, the dumps after the pipeline pass are per stage, every one valid IR, and
/// the stages pass messages; `--print-after` prints each stage's.
#[test]
fn pipeline_ir_dumps_are_per_stage() {
    let dir = scratch("compile-dump-pp");
    let model = fixture("gpt2", "model.onnx");
    let dumps = dir.join("ir");
    let flags = ["--pp", "2", "--grad-accum", "2", "--dp", "2", "--zero", "1"];
    let args =
        [&compile_args(&model, &flags)[..], &["--dump-ir", s(&dumps), "--print-after", "pipeline", "-o", "/dev/null"]];
    let out = success(autotp(&args.concat()));
    assert!(
        out.contains("# IR after pass 8 (pipeline, stage 0)") && out.contains("# IR after pass 8 (pipeline, stage 1)")
    );
    let mut files: Vec<String> =
        std::fs::read_dir(&dumps).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    let per_stage = |name: &str| [format!("{name}.stage0.ir"), format!("{name}.stage1.ir")];
    let mut expected: Vec<String> =
        ["import", "recognize", "peephole", "unmerge-heads", "dce", "attention", "dce", "loss"]
            .iter()
            .enumerate()
            .map(|(n, pass)| format!("{n:02}-{pass}.ir"))
            .collect();
    for name in ["08-pipeline", "09-optimize", "10-dce", "11-zero", "12-fusion"] {
        expected.extend(per_stage(name));
    }
    expected.sort();
    assert_eq!(files, expected);
    for f in &files {
        let text = std::fs::read_to_string(dumps.join(f)).unwrap();
        let graph = autotp_ir::text::parse(&text).unwrap_or_else(|e| panic!("{f}: {e}"));
        autotp_ir::verify(&graph).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    // The data-parallel stage 1 receives its rows of each activation and sends their gradients.
    let stage1 = std::fs::read_to_string(dumps.join("11-zero.stage1.ir")).unwrap();
    assert!(
        stage1.contains("= recv {from = 0, tag = 0, message = activation} : f32[8,32,64] {dp = shard(0)}"),
        "{stage1}"
    );
    assert!(stage1.contains("send "), "{stage1}");
}

#[test]
fn frozen_parameters_do_not_train() {
    let dir = scratch("compile-freeze");
    let model = fixture("gpt2", "model.onnx");
    let plan = dir.join("gpt2.atp");
    // Freeze the embeddings (wte is tied to the LM head) and the first block's layer norms.
    let out =
        success(autotp(&compile_args(&model, &["--freeze", "wte|wpe", "--freeze", r"h\.0\.ln_", "-o", s(&plan)])));
    assert!(out.contains("frozen in 6 tensors"), "{out}");
    let ckpt = dir.join("ckpt");
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    success(autotp(&["run", s(&plan), "--data", s(&tokens), "--steps", "3", "--save", s(&ckpt)]));
    let original = autotp_frontend::import_onnx(&model, &bound()).unwrap();
    let checkpoint = Checkpoint::open(&ckpt).unwrap();
    let frozen = &checkpoint.manifest.training.frozen;
    assert_eq!(frozen.len(), 6, "{frozen:?}");
    for t in checkpoint.params() {
        let moved = original.weights[&t.name].bytes() != &*t.bytes;
        assert_eq!(moved, !frozen.contains(&t.name), "{}: moved={moved}", t.name);
        let has_state = checkpoint.tensor(&format!("adamw.m.{}", t.name)).is_some();
        assert_eq!(has_state, !frozen.contains(&t.name), "{}: optimizer state", t.name);
    }

    let err = failure(autotp(&compile_args(&model, &["--freeze", "no_such_weight", "-o", s(&plan)])));
    assert!(err.contains("--freeze 'no_such_weight' matches no parameter of the model"), "{err}");
    let err = failure(autotp(&compile_args(&model, &["--freeze", "(", "-o", s(&plan)])));
    assert!(err.contains("--freeze '(' is not a valid regex"), "{err}");
    let err = failure(autotp(&compile_args(&model, &["--freeze", ".", "-o", s(&plan)])));
    assert!(err.contains("--freeze leaves nothing to train"), "{err}");
}

#[test]
fn damaged_or_foreign_plans_are_refused() {
    let dir = scratch("compile-damaged");
    let model = fixture("gpt2", "model.onnx");
    let plan = dir.join("gpt2.atp");
    success(autotp(&compile_args(&model, &["-o", s(&plan)])));
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let run = |path: &Path| autotp(&["run", s(path), "--data", s(&tokens), "--steps", "1"]);

    let bytes = std::fs::read(&plan).unwrap();
    let truncated = dir.join("truncated.atp");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let err = failure(run(&truncated));
    assert!(err.contains("truncated.atp: not a valid safetensors file"), "{err}");

    // Flip one byte of the last tensor's data (a constant of the program, written last).
    let mut flipped = bytes.clone();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let constant = &header["autotp.constant.0.0"]["data_offsets"][0];
    flipped[8 + header_len + constant.as_u64().unwrap() as usize] ^= 0x40;
    let damaged = dir.join("damaged.atp");
    std::fs::write(&damaged, flipped).unwrap();
    let err = failure(run(&damaged));
    assert!(err.contains("damaged.atp: is damaged: tensor 'autotp.constant.0.0' has CRC-32C"), "{err}");
    let unverified = autotp(&["run", s(&damaged), "--data", s(&tokens), "--steps", "1", "--no-verify"]);
    let err = failure(unverified);
    assert!(err.contains("is damaged: its program does not match the fingerprint"), "{err}");

    // A plan with its weights embedded: a flipped byte of a weight is refused, naming it;
    // --no-verify trains on it.
    let embedded = dir.join("embedded.atp");
    success(autotp(&compile_args(&model, &["--embed-weights", "-o", s(&embedded)])));
    let mut bytes = std::fs::read(&embedded).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let (weight, entry) = (header.as_object().unwrap().iter())
        .find(|(name, _)| *name != "__metadata__" && !name.starts_with("autotp.constant."))
        .expect("an embedded weight");
    let start = entry["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + header_len + start] ^= 0x01;
    std::fs::write(&embedded, bytes).unwrap();
    let err = failure(run(&embedded));
    assert!(err.contains(&format!("embedded.atp: is damaged: tensor '{weight}' has CRC-32C")), "{err}");
    success(autotp(&["run", s(&embedded), "--data", s(&tokens), "--steps", "1", "--no-verify"]));

    let err = failure(run(&fixture("gpt2", "model.onnx")));
    assert!(err.contains("not a valid safetensors file"), "an ONNX file is not a plan: {err}");
    let checkpoint_file = dir.join("weights.safetensors");
    autotp_program::tensor_file::write(&checkpoint_file, &[], Default::default()).unwrap();
    let err = failure(run(&checkpoint_file));
    assert!(err.contains("is not an autotp plan"), "{err}");
}

/// `--dump-kernels` writes every generated kernel's kernel IR and LLVM IR, and the PTX modules;
/// `--kernels builtin` compiles no kernels and runs no fusion pass.
#[test]
fn dump_kernels_and_the_builtin_oracle() {
    let dir = scratch("compile-dump-kernels");
    let model = fixture("gpt2", "model.onnx");
    let kernels = dir.join("kernels");
    success(autotp(&compile_args(&model, &["--dump-kernels", s(&kernels), "-o", "/dev/null"])));
    let files: Vec<String> =
        std::fs::read_dir(&kernels).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    let count = |suffix: &str| files.iter().filter(|f| f.ends_with(suffix)).count();
    assert!(count(".kir") >= 10 && count(".kir") == count(".ll"), "{files:?}");
    assert_eq!(count(".ptx"), 2, "{files:?}");
    for f in &files {
        let text = std::fs::read_to_string(kernels.join(f)).unwrap();
        let marker = match f.rsplit('.').next() {
            Some("kir") => "kernel \"",
            Some("ll") => "define void @",
            _ => ".entry autotp_kernel_0",
        };
        assert!(text.contains(marker), "{f} lacks '{marker}'");
    }
    let out = success(autotp(&compile_args(&model, &["--kernels", "builtin", "-o", "/dev/null"])));
    assert!(out.contains("instructions: ") && !out.contains("gen."), "{out}");
    let err =
        failure(autotp(&compile_args(&model, &["--kernels", "builtin", "--print-after", "fusion", "-o", "/dev/null"])));
    assert!(err.contains("--print-after 'fusion': no such pass"), "{err}");
}

/// A padding row the export records in the model's metadata (`autotp.padding_idx`: what a
/// pretrained embedding, whose padding row is not zero, needs) is taken and named as the
/// reason; `--padding-idx` overrides it; a malformed entry or an unknown table is refused
/// naming the key.
#[test]
fn padding_rows_from_the_models_metadata() {
    use autotp_frontend::onnx::proto::{ModelProto, StringStringEntryProto};
    use prost::Message;
    let dir = scratch("padding-metadata");
    let bytes = std::fs::read(fixture("llama", "model.onnx")).unwrap();
    let with_metadata = |value: &str, name: &str| {
        let mut model = ModelProto::decode(bytes.as_slice()).unwrap();
        let key = autotp_frontend::PADDING_IDX_METADATA.to_string();
        model.metadata_props.push(StringStringEntryProto { key, value: value.into() });
        let path = dir.join(format!("{name}.onnx"));
        std::fs::write(&path, model.encode_to_vec()).unwrap();
        path
    };
    let compile = |model: &Path, extra: &[&str]| autotp(&compile_args(model, &[extra, &["-o", "/dev/null"]].concat()));
    let recorded = with_metadata("m.model.embed_tokens.weight=3", "recorded");
    let out = success(compile(&recorded, &[]));
    assert!(
        out.contains(
            "padding row: m.model.embed_tokens.weight row 3 gets no gradient (the model's metadata 'autotp.padding_idx')"
        ),
        "{out}"
    );
    let out = success(compile(&recorded, &["--padding-idx", "none"]));
    assert!(!out.contains("padding row"), "{out}");
    let out = success(compile(&recorded, &["--padding-idx", "m.model.embed_tokens.weight=5"]));
    assert!(out.contains("m.model.embed_tokens.weight row 5 gets no gradient (--padding-idx)"), "{out}");
    let err = failure(compile(&with_metadata("3, wte=x", "malformed"), &[]));
    assert!(err.contains("the model's metadata 'autotp.padding_idx' = '3, wte=x': 'wte=x' is not N"), "{err}");
    let err = failure(compile(&with_metadata("lm_head=1", "unknown"), &[]));
    assert!(err.contains("the model's metadata: 'lm_head' is not an embedding table"), "{err}");
}

/// A plan names the initial weights where the model keeps them, here its external-data file:
/// it is smaller than the one that carries them (`--embed-weights`) by about their size,
/// trains bit-identically to it, and is refused, naming the file, once that file changed or
/// is gone.
#[test]
fn plans_name_the_models_weights_files() {
    let dir = scratch("compile-weight-files");
    let gpt2 = fixture("gpt2", "model.onnx");
    let (first, ckpt) = (dir.join("first.atp"), dir.join("ckpt"));
    success(autotp(&compile_args(&gpt2, &["--embed-weights", "-o", s(&first)])));
    let tokens = repo().join("tests/fixtures/train/tokens.bin");
    let run = |plan: &Path, metrics: &Path, extra: &[&str]| {
        let args = ["run", s(plan), "--data", s(&tokens), "--steps", "5", "--metrics-out", s(metrics)];
        autotp(&[&args[..], extra].concat())
    };
    success(run(&first, &dir.join("first.jsonl"), &["--save", s(&ckpt)]));
    // A model whose weights are in an external-data file.
    let model = dir.join("model.onnx");
    success(autotp(&["export", s(&ckpt), "-o", s(&model), "--external-data"]));
    let data = dir.join("model.onnx.data");
    let (named, embedded) = (dir.join("named.atp"), dir.join("embedded.atp"));
    success(autotp(&compile_args(&model, &["-o", s(&named)])));
    success(autotp(&compile_args(&model, &["--embed-weights", "-o", s(&embedded)])));
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    assert!(
        size(&named) + size(&data) * 9 / 10 < size(&embedded),
        "{} + {} against {}",
        size(&named),
        size(&data),
        size(&embedded)
    );
    let file = autotp_program::plan::PlanFile::open(&named).unwrap();
    let files: Vec<&Path> = file.weight_files().iter().map(|f| f.path.as_path()).collect();
    assert_eq!(files, [data.canonicalize().unwrap()]);
    drop(file);
    let losses = |metrics: &Path| crate::common::losses(metrics);
    success(run(&named, &dir.join("named.jsonl"), &[]));
    success(run(&embedded, &dir.join("embedded.jsonl"), &[]));
    assert_eq!(losses(&dir.join("named.jsonl")), losses(&dir.join("embedded.jsonl")));

    let mut bytes = std::fs::read(&data).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&data, &bytes).unwrap();
    let err = failure(run(&named, &dir.join("changed.jsonl"), &[]));
    assert!(err.contains(s(&data.canonicalize().unwrap())) && err.contains("it changed"), "{err}");
    success(run(&embedded, &dir.join("embedded-again.jsonl"), &[]));
    std::fs::remove_file(&data).unwrap();
    let err = failure(run(&named, &dir.join("gone.jsonl"), &[]));
    assert!(err.contains("cannot read this weights file the plan names"), "{err}");
}
