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
pub const TARGETS: [(&str, Body); 9] = [
    ("onnx_model", onnx_model),
    ("onnx_graph", onnx_graph),
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

/// A well-formed ONNX model built from the fuzzer's bytes ([`structured_model`]), so that most
/// inputs get past decoding to shape inference and the converters; imported as
/// [`onnx_model`] imports one.
pub fn onnx_graph(data: &[u8]) {
    let mut unstructured = arbitrary::Unstructured::new(data);
    if let Ok(model) = structured_model(&mut unstructured) {
        onnx_model(&prost::Message::encode_to_vec(&model));
    }
}

/// The attributes a node may get, with the kinds of value each takes in ONNX.
const ATTRIBUTES: [(&str, AttributeKind); 16] = [
    ("axis", AttributeKind::Int),
    ("axes", AttributeKind::Ints),
    ("keepdims", AttributeKind::Int),
    ("perm", AttributeKind::Ints),
    ("to", AttributeKind::Int),
    ("alpha", AttributeKind::Float),
    ("beta", AttributeKind::Float),
    ("epsilon", AttributeKind::Float),
    ("transA", AttributeKind::Int),
    ("transB", AttributeKind::Int),
    ("group", AttributeKind::Int),
    ("pads", AttributeKind::Ints),
    ("strides", AttributeKind::Ints),
    ("kernel_shape", AttributeKind::Ints),
    ("equation", AttributeKind::String),
    ("value", AttributeKind::Tensor),
];

#[derive(Clone, Copy)]
enum AttributeKind {
    Int,
    Ints,
    Float,
    String,
    Tensor,
}

/// A small tensor of ONNX type `data_type` (1 f32, 7 i64) and `dims`, its values drawn.
fn small_tensor(
    u: &mut arbitrary::Unstructured,
    name: String,
    data_type: i32,
    dims: Vec<i64>,
) -> arbitrary::Result<autotp_frontend::onnx::proto::TensorProto> {
    let count = dims.iter().product::<i64>().max(0) as usize;
    let mut raw = Vec::with_capacity(count * 8);
    for _ in 0..count {
        match data_type {
            1 => raw.extend(f32::from(u.int_in_range(-8i8..=8)?).to_le_bytes()),
            _ => raw.extend(i64::from(u.int_in_range(-4i8..=8)?).to_le_bytes()),
        }
    }
    Ok(autotp_frontend::onnx::proto::TensorProto { name, data_type, dims, raw_data: raw.into(), ..Default::default() })
}

/// A graph of 1-3 inputs (f32 or i64, rank 0-3, dims 1-4), 0-2 small initializers and 1-8
/// nodes of ops autotp imports, each reading values made before it, with 0-3 attributes of the
/// names those ops take; its last value is the output.
pub fn structured_model(
    u: &mut arbitrary::Unstructured,
) -> arbitrary::Result<autotp_frontend::onnx::proto::ModelProto> {
    use autotp_frontend::onnx::proto::{
        tensor_shape_proto, type_proto, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
        TensorShapeProto, TypeProto, ValueInfoProto,
    };
    let dims = |u: &mut arbitrary::Unstructured| -> arbitrary::Result<Vec<i64>> {
        (0..u.int_in_range(0..=3)?).map(|_| u.int_in_range(1..=4)).collect()
    };
    let mut values: Vec<String> = Vec::new();
    let mut inputs = Vec::new();
    for i in 0..u.int_in_range(1..=3)? {
        let name = format!("x{i}");
        let elem_type = *u.choose(&[1, 7])?;
        let dim = dims(u)?
            .into_iter()
            .map(|d| tensor_shape_proto::Dimension {
                value: Some(tensor_shape_proto::dimension::Value::DimValue(d)),
                ..Default::default()
            })
            .collect();
        let tensor = type_proto::Tensor { elem_type, shape: Some(TensorShapeProto { dim }) };
        let r#type = Some(TypeProto { value: Some(type_proto::Value::TensorType(tensor)), ..Default::default() });
        inputs.push(ValueInfoProto { name: name.clone(), r#type, ..Default::default() });
        values.push(name);
    }
    let mut initializer = Vec::new();
    for i in 0..u.int_in_range(0..=2)? {
        let name = format!("w{i}");
        let data_type = *u.choose(&[1, 7])?;
        let shape = dims(u)?;
        initializer.push(small_tensor(u, name.clone(), data_type, shape)?);
        values.push(name);
    }
    let mut node = Vec::new();
    for n in 0..u.int_in_range(1..=8)? {
        let op_type = u.choose(autotp_frontend::onnx::SUPPORTED_OPS)?.to_string();
        let input = (0..u.int_in_range(1..=3)?).map(|_| u.choose(&values).cloned()).collect::<Result<_, _>>()?;
        let output: Vec<String> = (0..u.int_in_range(1..=2)?).map(|j| format!("y{n}_{j}")).collect();
        let mut attribute = Vec::new();
        for _ in 0..u.int_in_range(0..=3)? {
            let (name, kind) = *u.choose(&ATTRIBUTES)?;
            let mut a = AttributeProto { name: name.into(), ..Default::default() };
            match kind {
                AttributeKind::Int => (a.r#type, a.i) = (2, u.int_in_range(-3..=4)?),
                AttributeKind::Ints => {
                    a.r#type = 7;
                    a.ints = (0..u.int_in_range(0..=4)?).map(|_| u.int_in_range(-3..=4)).collect::<Result<_, _>>()?;
                }
                AttributeKind::Float => (a.r#type, a.f) = (1, f32::from(u.int_in_range(-4i8..=4)?) / 4.0),
                AttributeKind::String => {
                    let equation =
                        *u.choose(&["ij,jk->ik", "bij,bjk->bik", "ii->i", "ij->ji", "...i,i->...", "i,j->ij"])?;
                    (a.r#type, a.s) = (3, equation.as_bytes().to_vec().into());
                }
                AttributeKind::Tensor => {
                    let data_type = *u.choose(&[1, 7])?;
                    let shape = dims(u)?;
                    (a.r#type, a.t) = (4, Some(small_tensor(u, String::new(), data_type, shape)?));
                }
            }
            attribute.push(a);
        }
        values.extend(output.iter().cloned());
        node.push(NodeProto { op_type, name: format!("n{n}"), input, output, attribute, ..Default::default() });
    }
    let last = values.last().cloned().unwrap_or_default();
    let graph = GraphProto {
        name: "fuzz".into(),
        node,
        initializer,
        input: inputs,
        output: vec![ValueInfoProto { name: last, ..Default::default() }],
        ..Default::default()
    };
    let version = u.int_in_range(13..=28)?;
    Ok(ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto { domain: String::new(), version }],
        graph: Some(graph),
        ..Default::default()
    })
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
