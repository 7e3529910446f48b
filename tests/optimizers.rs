//! The optimizer update ops against torch.optim trajectories (tests/fixtures/optim, made by
//! tests/fixtures/make_optimizer_fixtures.py). The parameter and moments are program state,
//! updated in place by `update` lines; after every step the executor's parameter is compared
//! with torch's, and with the reference evaluator's `eval_step` (bit for bit).

use autotp_runtime::{Executor, HostTensor};
use serde_json::Value;

use crate::common::repo;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn host(values: &[f32]) -> HostTensor {
    HostTensor {
        dtype: autotp_ir::DType::F32,
        shape: vec![values.len()],
        data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn scalar(v: f32) -> HostTensor {
    HostTensor { dtype: autotp_ir::DType::F32, shape: vec![], data: v.to_le_bytes().to_vec() }
}

fn replay(name: &str) {
    let text = std::fs::read_to_string(repo().join(format!("tests/fixtures/optim/{name}.json"))).unwrap();
    let record: Value = serde_json::from_str(&text).unwrap();
    let config = &record["config"];
    let get = |key: &str, default: f64| config.get(key).and_then(Value::as_f64).unwrap_or(default);
    let initial = floats(&record["initial"]);
    let n = initial.len();
    let adam = name.starts_with("adamw");
    // The parameter and the optimizer moments live in the program (param / state) and are
    // updated in place by `update` lines; the host only feeds gradient, lr and step.
    let graph_text = if adam {
        let betas = config["betas"].as_array().unwrap();
        format!(
            "graph \"{name}\" {{\n input %g : f32[{n}]\n input %lr : f32[]\n input %step : f32[]\n param %p : f32[{n}]\n \
             state %m : f32[{n}]\n state %v : f32[{n}]\n %0, %1, %2 = adamw %p, %g, %m, %v, %lr, %step \
             {{beta1 = {:?}, beta2 = {:?}, eps = {:?}, weight_decay = {:?}}} : f32[{n}], f32[{n}], f32[{n}]\n \
             update %p = %0\n update %m = %1\n update %v = %2\n}}\n",
            betas[0].as_f64().unwrap(),
            betas[1].as_f64().unwrap(),
            get("eps", 1e-8),
            get("weight_decay", 0.01)
        )
    } else {
        format!(
            "graph \"{name}\" {{\n input %g : f32[{n}]\n input %lr : f32[]\n param %p : f32[{n}]\n state %buf : f32[{n}]\n \
             %0, %1 = sgd %p, %g, %buf, %lr {{momentum = {:?}, weight_decay = {:?}, nesterov = {}}} : f32[{n}], f32[{n}]\n \
             update %p = %0\n update %buf = %1\n}}\n",
            get("momentum", 0.0),
            get("weight_decay", 0.0),
            config.get("nesterov").and_then(Value::as_bool).unwrap_or(false)
        )
    };
    let graph = autotp_ir::text::parse(&graph_text).unwrap();
    autotp_ir::verify(&graph).unwrap();
    assert!(autotp_ir::text::parse(&autotp_ir::text::print(&graph)).unwrap() == graph);
    let mut exec = Executor::new(autotp_codegen::lower(&graph).unwrap()).unwrap();
    exec.load_slot("p", &host(&initial).data).unwrap();
    // The reference evaluator applies the same updates: it must agree with the executor.
    let mut reference =
        std::collections::BTreeMap::from([("p".to_string(), autotp_ir::Tensor::from_f32(vec![n], &initial))]);
    let grads = record["grads"].as_array().unwrap();
    for (step, ((g, lr), want)) in
        grads.iter().zip(record["lrs"].as_array().unwrap()).zip(record["params"].as_array().unwrap()).enumerate()
    {
        let lr = lr.as_f64().unwrap() as f32;
        let mut feed = vec![host(&floats(g)), scalar(lr)];
        if adam {
            feed.push(scalar((step + 1) as f32));
        }
        exec.run(&feed).unwrap();
        let inputs: Vec<autotp_ir::Tensor> =
            feed.iter().map(|h| autotp_ir::Tensor::from_pod(h.dtype, h.shape.clone(), &h.data)).collect();
        autotp_ir::eval::eval_step(&graph, &mut reference, &inputs).unwrap();
        let p: Vec<f32> =
            exec.read_slot("p").unwrap().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(
            reference["p"].bytes(),
            exec.read_slot("p").unwrap(),
            "{name} step {}: evaluator and executor differ",
            step + 1
        );
        for (i, (&got, want)) in p.iter().zip(floats(want)).enumerate() {
            let tolerance = 1e-6 * want.abs().max(1.0);
            assert!((got - want).abs() <= tolerance, "{name} step {}: p[{i}] = {got}, torch has {want}", step + 1);
        }
    }
}

#[test]
fn adamw_matches_torch() {
    replay("adamw");
    replay("adamw_lr_schedule");
}

#[test]
fn sgd_matches_torch() {
    replay("sgd_momentum");
    replay("sgd_nesterov");
    replay("sgd_plain");
}
