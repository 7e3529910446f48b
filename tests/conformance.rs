//! ONNX conformance: the backend node test cases of every supported op (vendored under
//! tests/conformance/cases by tests/conformance/generate.py) run through import, the simplify
//! passes, codegen and the executor, and are compared with onnx's reference outputs (rtol 1e-3, atol 1e-7, as
//! onnx's backend tests). Inputs an op needs constant (shapes, repeats) are bound to each data
//! set's values, as static-shape compilation does. `tests/conformance/manifest.txt` lists, with a reason, the cases
//! that do not pass; a listed case that passes fails the test, so the list stays honest.
//! `AUTOTP_BLESS=1` rewrites the manifest from the current failures.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::Path;

use autotp_frontend::onnx::proto::TensorProto;
use autotp_frontend::ImportOptions;
use autotp_ir::{DType, Tensor};
use autotp_runtime::{Executor, HostTensor};
use prost::Message;

use crate::common::repo;

fn read_tensor(path: &Path) -> Result<Tensor, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let proto = TensorProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
    let mut external = autotp_frontend::onnx::tensor::ExternalFiles::new(path);
    autotp_frontend::onnx::tensor::decode(&proto, &path.display().to_string(), &mut external).map_err(|e| e.to_string())
}

fn close(dtype: DType, got: &Tensor, want: &Tensor) -> Result<(), String> {
    if got.ty != want.ty {
        return Err(format!("output is {}, expected {}", got.ty, want.ty));
    }
    if !dtype.is_float() {
        return if got.bytes() == want.bytes() { Ok(()) } else { Err("integer output differs".into()) };
    }
    for i in 0..got.numel() {
        let (g, w) = (got.get_f64(i), want.get_f64(i));
        let same = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= 1e-7 + 1e-3 * w.abs();
        if !same {
            return Err(format!("element {i} is {g}, expected {w}"));
        }
    }
    Ok(())
}

/// Runs one case's data sets. autotp compiles static shapes: where an op needs an input to be a
/// constant (a shape, repeats, a depth) and the case feeds it as a graph input, that input is
/// bound to the data set's value (a Constant node), as a user's export has it constant; the
/// other inputs are fed at run time.
fn run_case(dir: &Path) -> Result<(), String> {
    let model_bytes = std::fs::read(dir.join("model.onnx")).map_err(|e| format!("model.onnx: {e}"))?;
    let mut data_sets: Vec<_> =
        std::fs::read_dir(dir).map_err(|e| e.to_string())?.map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    data_sets.sort();
    if data_sets.is_empty() {
        // Import anyway, so an unsupported construct is what the manifest names.
        autotp_frontend::import_onnx(&dir.join("model.onnx"), &ImportOptions::default()).map_err(|e| e.to_string())?;
        return Err("the case has only sequence or optional test data, which the IR does not represent".into());
    }
    for ds in data_sets {
        let mut proto = autotp_frontend::onnx::proto::ModelProto::decode(model_bytes.as_slice())
            .map_err(|e| format!("model.onnx: {e}"))?;
        let graph = proto.graph.as_ref().ok_or("model.onnx has no graph")?;
        let names: Vec<String> = graph.input.iter().map(|i| i.name.clone()).collect();
        let mut fed: Vec<(String, TensorProto)> = Vec::new();
        for (k, name) in names.iter().enumerate() {
            let bytes = std::fs::read(ds.join(format!("input_{k}.pb"))).map_err(|e| e.to_string())?;
            let mut tensor = TensorProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
            tensor.name = name.clone();
            fed.push((name.clone(), tensor));
        }
        let model = loop {
            let path = dir.join("model.onnx");
            match autotp_frontend::onnx::import_bytes(proto.encode_to_vec().into(), &path, &ImportOptions::default()) {
                Ok(model) => break model,
                Err(autotp_frontend::FrontendError::NotConstant { input, .. })
                    if fed.iter().any(|(n, _)| *n == input) =>
                {
                    // A Constant node (an initializer of floats would be a parameter).
                    use autotp_frontend::onnx::proto::{attribute_proto::AttributeType, AttributeProto, NodeProto};
                    let at = fed.iter().position(|(n, _)| *n == input).expect("found");
                    let graph = proto.graph.as_mut().expect("checked");
                    graph.input.retain(|i| i.name != input);
                    let value = AttributeProto {
                        name: "value".into(),
                        t: Some(fed.remove(at).1),
                        r#type: AttributeType::Tensor as i32,
                        ..Default::default()
                    };
                    let node = NodeProto {
                        op_type: "Constant".into(),
                        output: vec![input],
                        attribute: vec![value],
                        ..Default::default()
                    };
                    graph.node.insert(0, node);
                }
                Err(e) => return Err(e.to_string()),
            }
        };
        let program = autotp_codegen::lower(&model.graph).map_err(|e| e.to_string())?;
        let mut exec = Executor::new(program).map_err(|e| e.to_string())?;
        for (name, t) in &model.weights {
            exec.load_slot(name, t.bytes()).map_err(|e| e.to_string())?;
        }
        let mut inputs = Vec::new();
        for (name, proto) in &fed {
            let mut external = autotp_frontend::onnx::tensor::ExternalFiles::new(&ds.join("input.pb"));
            let t = autotp_frontend::onnx::tensor::decode(proto, name, &mut external).map_err(|e| e.to_string())?;
            inputs.push(HostTensor { dtype: t.dtype(), shape: t.shape().to_vec(), data: t.bytes().to_vec() });
        }
        let outputs = exec.run(&inputs).map_err(|e| e.to_string())?;
        for (k, got) in outputs.iter().enumerate() {
            let want = read_tensor(&ds.join(format!("output_{k}.pb")))?;
            let got = Tensor::from_pod(got.dtype, got.shape.clone(), &got.data);
            close(want.dtype(), &got, &want).map_err(|e| format!("output {k}: {e}"))?;
        }
    }
    Ok(())
}

fn read_manifest(path: &Path) -> BTreeMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (case, reason) = l.split_once(':').unwrap_or((l, ""));
            (case.trim().to_string(), reason.trim().to_string())
        })
        .collect()
}

#[test]
fn onnx_node_cases() {
    let root = repo().join("tests/conformance");
    let manifest_path = root.join("manifest.txt");
    let manifest = read_manifest(&manifest_path);
    let mut cases: Vec<_> = std::fs::read_dir(root.join("cases")).unwrap().map(|e| e.unwrap().path()).collect();
    cases.sort();
    let mut failures = BTreeMap::new();
    let mut panics = Vec::new();
    for dir in &cases {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        match std::panic::catch_unwind(AssertUnwindSafe(|| run_case(dir))) {
            Ok(Ok(())) => {}
            Ok(Err(reason)) => {
                // Reasons name files relative to the case, so the manifest is machine-independent.
                let reason = reason.replace(&format!("{}/", dir.display()), "");
                failures.insert(name, reason.lines().next().unwrap_or("").to_string());
            }
            Err(_) => panics.push(name),
        }
    }
    let passed = cases.len() - failures.len() - panics.len();
    println!("conformance: {} cases, {passed} passed, {} failing", cases.len(), failures.len());
    assert!(panics.is_empty(), "cases that panicked (never acceptable): {panics:?}");
    if std::env::var_os("AUTOTP_BLESS").is_some() {
        let mut text = String::from(
            "# ONNX node test cases of supported ops that do not pass, with the reason (the error they\n\
             # fail with). Regenerate with AUTOTP_BLESS=1 cargo test --test main conformance.\n",
        );
        for (case, reason) in &failures {
            text.push_str(&format!("{case}: {reason}\n"));
        }
        std::fs::write(&manifest_path, text).unwrap();
        return;
    }
    let unexpected: Vec<_> =
        failures.iter().filter(|(c, _)| !manifest.contains_key(*c)).map(|(c, r)| format!("{c}: {r}")).collect();
    let now_passing: Vec<_> = manifest.keys().filter(|c| !failures.contains_key(*c)).collect();
    assert!(unexpected.is_empty(), "cases that fail and are not in the manifest:\n{}", unexpected.join("\n"));
    assert!(
        now_passing.is_empty(),
        "cases listed in the manifest that pass or no longer exist (remove them): {now_passing:?}"
    );
}

#[test]
fn manifest_ops_match_the_frontend() {
    let script = std::fs::read_to_string(repo().join("tests/conformance/generate.py")).unwrap();
    assert!(script.contains("SUPPORTED_OPS"), "the generator must take its op list from SUPPORTED_OPS");
    let mut sorted = autotp_frontend::onnx::SUPPORTED_OPS.to_vec();
    sorted.sort_unstable();
    assert_eq!(sorted, autotp_frontend::onnx::SUPPORTED_OPS, "keep SUPPORTED_OPS sorted");
}
