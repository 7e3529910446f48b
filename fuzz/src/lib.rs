//! The bodies of autotp's fuzz targets: each feeds one reader of files autotp did not write by
//! hand (or that may be damaged or hostile) the fuzzer's bytes, and checks what must hold of
//! any input: no panic, no hang, and for the IR text format, that what parses prints and
//! parses back to the same graph. `fuzz_targets/` runs them under libFuzzer
//! (`scripts/fuzz.sh`); `tests/fuzz_regressions.rs` runs them on the committed corpora and
//! on every input a fuzzer once crashed, in `cargo test`.
//!
//! Readers that take a path get the bytes in a file of a directory of this process's own
//! (in /dev/shm where there is one, so that a file costs no disk).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A target's body: the fuzzer's bytes in.
pub type Body = fn(&[u8]);

/// The targets, by name: the directory names under `fuzz/corpus/` and `fuzz/regressions/`.
pub const TARGETS: [(&str, Body); 8] = [
    ("onnx_model", onnx_model),
    ("ir_text", ir_text),
    ("plan_file", plan_file),
    ("safetensors", safetensors),
    ("checkpoint_manifest", checkpoint_manifest),
    ("deepspeed_config", deepspeed_config),
    ("token_file", token_file),
    ("megatron_index", megatron_index),
];

/// This process's scratch directory.
fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = Path::new("/dev/shm");
        let base = if base.is_dir() { base.to_path_buf() } else { std::env::temp_dir() };
        let dir = base.join(format!("autotp-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    })
}

/// `data` written to the scratch file `name`.
fn file_of(name: &str, data: &[u8]) -> PathBuf {
    let path = scratch().join(name);
    std::fs::write(&path, data).expect("a scratch file");
    path
}

/// An ONNX model's bytes, imported as `compile` imports one (batch 2, sequence 8): decoding,
/// the initializers, shape inference and every op's converter. External data may only lie in
/// the model's (empty) folder.
pub fn onnx_model(data: &[u8]) {
    let folder = scratch().join("onnx");
    std::fs::create_dir_all(&folder).expect("a scratch directory");
    let options = autotp_frontend::ImportOptions { batch: Some(2), seq_len: Some(8), ..Default::default() };
    let bytes = bytes::Bytes::copy_from_slice(data);
    if let Ok(model) = autotp_frontend::onnx::import_bytes(bytes, &folder.join("model.onnx"), &options) {
        let _ = autotp_ir::verify(&model.graph);
    }
}

/// IR text: what parses verifies without a panic, and prints to text that parses back to a
/// graph that prints the same. (Its values may be numbered otherwise than the first parse's:
/// the printer writes the inputs before the parameters, wherever the text declared them.)
pub fn ir_text(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(graph) = autotp_ir::text::parse(text) else { return };
    let _ = autotp_ir::verify(&graph);
    let printed = autotp_ir::text::print(&graph);
    let reparsed = autotp_ir::text::parse(&printed).unwrap_or_else(|e| panic!("the printed graph does not parse: {e}"));
    assert_eq!(autotp_ir::text::print(&reparsed), printed, "the printed graph prints otherwise once parsed");
}

/// A `.atp` plan file, opened and checked as `run` opens one (checksums, validation).
pub fn plan_file(data: &[u8]) {
    let path = file_of("plan.atp", data);
    if let Ok(file) = autotp_program::plan::PlanFile::open_checked(&path, true) {
        let _ = file.weights();
    }
}

/// A safetensors file (a checkpoint's, a Hugging Face model's): opened, verified against its
/// checksums, every tensor read.
pub fn safetensors(data: &[u8]) {
    let path = file_of("tensors.safetensors", data);
    let Ok(file) = autotp_program::tensor_file::TensorFile::open(&path) else { return };
    let _ = file.verify();
    let names: Vec<String> = file.names().map(str::to_string).collect();
    for name in names {
        if let Some(tensor) = file.get(&name) {
            let _ = tensor.bytes.iter().fold(0u8, |a, &b| a ^ b);
        }
    }
}

/// A checkpoint's `manifest.json` beside a valid checkpoint's tensor files: opened with its
/// checksums, every tensor it lists assembled from its blocks.
pub fn checkpoint_manifest(data: &[u8]) {
    let dir = scratch().join("checkpoint");
    if !dir.join("model.safetensors").exists() {
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        let bytes: Vec<u8> = (0..24u8).collect();
        for (file, name) in [("model.safetensors", "w"), ("optimizer.safetensors", "adamw.m.w")] {
            let tensor = autotp_program::tensor_file::TensorRef {
                name: name.into(),
                dtype: autotp_kernels::DType::F32,
                shape: vec![2, 3],
                bytes: &bytes,
            };
            autotp_program::tensor_file::write(&dir.join(file), &[tensor], Default::default())
                .expect("a template tensor file");
        }
    }
    std::fs::write(dir.join("manifest.json"), data).expect("a scratch file");
    for verify in [true, false] {
        let Ok(checkpoint) = autotp_train::checkpoint::Checkpoint::open_checked(&dir, verify) else { continue };
        for name in checkpoint.manifest.files.values().flatten() {
            let _ = checkpoint.tensor(name);
        }
    }
}

/// A DeepSpeed configuration, read as `--deepspeed` reads one.
pub fn deepspeed_config(data: &[u8]) {
    let path = file_of("ds_config.json", data);
    for run_flags in [false, true] {
        let _ = autotp_compiler::deepspeed::DeepSpeedConfig::read(&path, run_flags);
    }
}

/// A raw token file of u16 and of u32 ids, cut into windows of 4, and two batches read.
pub fn token_file(data: &[u8]) {
    let path = file_of("tokens.bin", data);
    for dtype in ["u16", "u32"] {
        let dtype = autotp_train::data::TokenDtype::parse(dtype).expect("a token type");
        let Ok(tokens) = autotp_train::data::TokenData::open(&path, dtype, 4) else { continue };
        if tokens.windows() > 0 {
            let _ = tokens.batch(0, 2);
            let _ = tokens.batch(7, 3);
        }
    }
}

/// A Megatron `.idx` file beside a `.bin` of 64 tokens: opened, every sequence read.
pub fn megatron_index(data: &[u8]) {
    let prefix = scratch().join("dataset");
    let (bin, idx) = autotp_train::indexed::paths(&prefix);
    if !bin.exists() {
        std::fs::write(&bin, (0..128u8).collect::<Vec<_>>()).expect("a scratch file");
    }
    std::fs::write(&idx, data).expect("a scratch file");
    let Ok(dataset) = autotp_train::indexed::IndexedDataset::open(&prefix) else { return };
    for i in 0..dataset.sequences().min(64) {
        let _ = dataset.sequence(i);
    }
}
