//! The tiny Hugging Face exports (tests/fixtures/make_fixtures.py) against PyTorch.

use autotp_frontend::ImportOptions;
use autotp_runtime::{Executor, HostTensor};

use crate::common::{fixture, max_abs_diff, read_npy, ARCHES};

fn options() -> ImportOptions {
    ImportOptions { batch: Some(4), seq_len: Some(32), ..ImportOptions::default() }
}

/// Imports, simplifies, lowers and runs a fixture model; returns its outputs.
fn run(arch: &str, file: &str, inputs: &[&str]) -> Vec<autotp_ir::Tensor> {
    let mut model = autotp_frontend::import_onnx(&fixture(arch, file), &options()).unwrap();
    autotp_passes::PassManager::simplify_pipeline().run(&mut model.graph).unwrap();
    let program = autotp_codegen::lower(&model.graph).unwrap();
    let mut exec = Executor::new(program).unwrap();
    for (name, t) in &model.weights {
        exec.load_slot(name, t.bytes()).unwrap();
    }
    let feed: Vec<HostTensor> = inputs
        .iter()
        .map(|n| {
            let t = read_npy(&fixture(arch, &format!("{n}.npy")));
            HostTensor { dtype: t.dtype(), shape: t.shape().to_vec(), data: t.bytes().to_vec() }
        })
        .collect();
    exec.run(&feed).unwrap().into_iter().map(|h| autotp_ir::Tensor::from_pod(h.dtype, h.shape, &h.data)).collect()
}

#[test]
fn logits_match_pytorch() {
    // llama_pad: padding tokens in the input (its padding row is zero, like any embedding row);
    // then issue 16's model families and issue 36's designs.
    let families = [
        "llama_pad",
        "gptj",
        "bloom",
        "opt",
        "mixtral",
        "falcon_mqa",
        "bigcode_mqa",
        "olmo2",
        "deepseek_v3",
        "gpt_oss",
        "lfm2",
        "apertus",
    ];
    for arch in ARCHES.iter().chain(&families) {
        let out = run(arch, "model.onnx", &["input_ids"]);
        let reference = read_npy(&fixture(arch, "logits.npy"));
        let (diff, scale) = max_abs_diff(&out[0], &reference);
        assert!(diff <= 1e-4 * scale, "{arch}: max |autotp - torch| = {diff}, reference max {scale}");
    }
}

/// The Llama fixture in f64 throughout (tests/fixtures/llama_f64) gives PyTorch's f64 logits
/// to f64's rounding, not f32's.
#[test]
fn f64_logits_match_pytorch_to_f64_rounding() {
    let out = run("llama_f64", "model.onnx", &["input_ids"]);
    let reference = read_npy(&fixture("llama_f64", "logits.npy"));
    assert_eq!((out[0].dtype(), reference.dtype()), (autotp_ir::DType::F64, autotp_ir::DType::F64));
    let (diff, scale) = max_abs_diff(&out[0], &reference);
    assert!(diff <= 1e-13 * scale, "max |autotp - torch| = {diff:e}, reference max {scale}");
    println!("llama_f64 logits: max |autotp - torch| = {diff:e}, reference max {scale}");
}

#[test]
fn loss_matches_pytorch() {
    for arch in ARCHES {
        // Hugging Face convention: labels = input_ids, the model shifts internally.
        let mut model = autotp_frontend::import_onnx(&fixture(arch, "model_loss.onnx"), &options()).unwrap();
        autotp_passes::PassManager::simplify_pipeline().run(&mut model.graph).unwrap();
        let ids = read_npy(&fixture(arch, "input_ids.npy"));
        let out = autotp_ir::eval::eval_graph(&model.graph, &model.weights, &[ids.clone(), ids]).unwrap();
        let reference = read_npy(&fixture(arch, "loss.npy"));
        let (diff, scale) = max_abs_diff(&out[0], &reference);
        assert!(diff <= 1e-5 * scale, "{arch}: loss differs by {diff} from {scale}");
    }
}

#[test]
fn composites_are_recognized() {
    let expect = [
        ("gpt2", "gelu", 2),
        ("bert", "gelu", 2),
        ("gpt_neox", "gelu", 2),
        ("llama", "rms_norm", 5),
        ("qwen2", "rms_norm", 5),
    ];
    for (arch, op, count) in expect {
        let mut model = autotp_frontend::import_onnx(&fixture(arch, "model.onnx"), &options()).unwrap();
        autotp_passes::PassManager::simplify_pipeline().run(&mut model.graph).unwrap();
        let found = model.graph.nodes().filter(|(_, n)| n.op.name() == op).count();
        assert!(found >= count, "{arch}: {found} {op} ops, expected at least {count}");
    }
}

#[test]
fn text_round_trips() {
    for arch in ARCHES {
        for file in ["model.onnx", "model_loss.onnx"] {
            let mut model = autotp_frontend::import_onnx(&fixture(arch, file), &options()).unwrap();
            for stage in ["imported", "simplified"] {
                let text = autotp_ir::text::print(&model.graph);
                let parsed = autotp_ir::text::parse(&text).unwrap_or_else(|e| panic!("{arch}/{file} {stage}: {e}"));
                assert!(parsed == model.graph, "{arch}/{file} {stage}: parse(print(g)) != g");
                assert_eq!(autotp_ir::text::print(&parsed), text);
                autotp_passes::PassManager::simplify_pipeline().run(&mut model.graph).unwrap();
            }
        }
    }
}

#[test]
fn weights_are_not_copied() {
    // Float initializers stored as raw_data stay slices of the model's bytes (in production
    // a memory map): every weight's data lies inside the buffer the model was decoded from.
    let path = fixture("gpt2", "model.onnx");
    let bytes = bytes::Bytes::from(std::fs::read(&path).unwrap());
    let range = bytes.as_ptr() as usize..bytes.as_ptr() as usize + bytes.len();
    let model = autotp_frontend::onnx::import_bytes(bytes.clone(), &path, &options()).unwrap();
    assert!(!model.weights.is_empty());
    for (name, t) in &model.weights {
        let at = t.bytes().as_ptr() as usize;
        assert!(range.contains(&at), "{name} was copied out of the model's bytes");
    }
}

#[test]
fn gradients_match_pytorch() {
    // autodiff over the imported loss graph against torch.autograd, parameter by parameter.
    for arch in ARCHES {
        let mut model = autotp_frontend::import_onnx(&fixture(arch, "model_loss.onnx"), &options()).unwrap();
        autotp_passes::PassManager::simplify_pipeline().run(&mut model.graph).unwrap();
        let manager = autotp_passes::PassManager::new(vec![Box::new(autotp_passes::autodiff::Autodiff::new("loss"))]);
        manager.run(&mut model.graph).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let ids = read_npy(&fixture(arch, "input_ids.npy"));
        let outputs = autotp_ir::eval::eval_graph(&model.graph, &model.weights, &[ids.clone(), ids]).unwrap();
        let (mut compared, mut worst) = (0, 0f64);
        for ((name, _), value) in model.graph.outputs().iter().zip(&outputs) {
            let Some(param) = name.strip_prefix(autotp_passes::autodiff::GRAD_PREFIX) else { continue };
            let reference = read_npy(&fixture(arch, &format!("grads/{param}.npy")));
            let (diff, scale) = max_abs_diff(value, &reference);
            assert!(
                diff <= 1e-4 * scale.max(1e-6),
                "{arch}: gradient of {param} differs by {diff} (reference max {scale})"
            );
            compared += 1;
            worst = worst.max(diff / scale.max(1e-6));
        }
        println!("{arch}: {compared} parameter gradients, worst max|diff| / max|ref| = {worst:.2e}");
        let expected = std::fs::read_dir(fixture(arch, "grads")).unwrap().count();
        assert_eq!(compared, expected, "{arch}: compared {compared} gradients, PyTorch has {expected}");
    }
}

/// DeepSeek-V3 assembles each head's key by assigning its two parts into an empty tensor
/// (`ScatterND` with every element's coordinates). Past the import's folding limit (at 4 x 160
/// tokens the indices have 81,920 elements; at 4096 tokens and 128 heads, 268 million) the
/// indices are ops, not a constant, and the assignments were left as scatters: tensor
/// parallelism refused to split the heads through them. They are concatenations at any size,
/// and the first 32 tokens of each sequence still give PyTorch's logits (attention is causal).
#[test]
fn keys_assembled_by_assignment_are_concatenations_at_any_length() {
    let (batch, seq) = (4, 160);
    let options = ImportOptions { batch: Some(batch), seq_len: Some(seq), ..ImportOptions::default() };
    let mut model = autotp_frontend::import_onnx(&fixture("deepseek_v3", "model.onnx"), &options).unwrap();
    let scatters = model.graph.nodes().filter(|(_, n)| matches!(n.op, autotp_ir::Op::ScatterNd { .. })).count();
    assert_eq!(scatters, 0, "{}", autotp_ir::text::print(&model.graph));
    autotp_passes::PassManager::simplify_pipeline().run(&mut model.graph).unwrap();
    let program = autotp_codegen::lower(&model.graph).unwrap();
    let mut exec = Executor::new(program).unwrap();
    for (name, t) in &model.weights {
        exec.load_slot(name, t.bytes()).unwrap();
    }
    // The fixture's 32 tokens of each sequence, then 128 more of its own.
    let ids = read_npy(&fixture("deepseek_v3", "input_ids.npy")).to_i64_vec();
    let long: Vec<i64> = ids.chunks(32).flat_map(|row| row.iter().cycle().take(seq).copied()).collect();
    let ids = autotp_ir::Tensor::from_i64(vec![batch, seq], &long);
    let feed = HostTensor { dtype: ids.dtype(), shape: ids.shape().to_vec(), data: ids.bytes().to_vec() };
    let out = exec.run(&[feed]).unwrap().remove(0);
    let logits = autotp_ir::Tensor::from_pod(out.dtype, out.shape, &out.data).to_f64_vec();
    let reference = read_npy(&fixture("deepseek_v3", "logits.npy"));
    let vocab = reference.shape()[2];
    let first_32: Vec<f64> = logits.chunks(seq * vocab).flat_map(|row| row[..32 * vocab].iter().copied()).collect();
    let prefix = autotp_ir::Tensor::from_f64_values(autotp_ir::DType::F32, vec![batch, 32, vocab], &first_32);
    let (diff, scale) = max_abs_diff(&prefix, &reference);
    assert!(diff <= 1e-4 * scale, "max |autotp - torch| = {diff}, reference max {scale}");

    let (length, batch) = (seq.to_string(), batch.to_string());
    let model = fixture("deepseek_v3", "model.onnx");
    let report = crate::common::scratch("assembled-keys").join("report.json");
    let flags = [
        &["compile", model.to_str().unwrap(), "--seq-len", &length, "--micro-batch", &batch][..],
        &["--tp", "2", "--report", report.to_str().unwrap()],
    ]
    .concat();
    crate::common::success(crate::common::autotp(&flags));
}
