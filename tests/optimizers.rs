//! The optimizer update ops against torch.optim trajectories (tests/fixtures/optim, made by
//! tests/fixtures/make_optimizer_fixtures.py): each step runs the op through codegen and the
//! executor, feeds the new parameter and state into the next step, and compares the parameter
//! with torch's after every step.

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

fn to_f32(t: &HostTensor) -> Vec<f32> {
    t.data.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn replay(name: &str) {
    let text = std::fs::read_to_string(repo().join(format!("tests/fixtures/optim/{name}.json"))).unwrap();
    let record: Value = serde_json::from_str(&text).unwrap();
    let config = &record["config"];
    let get = |key: &str, default: f64| config.get(key).and_then(Value::as_f64).unwrap_or(default);
    let initial = floats(&record["initial"]);
    let n = initial.len();
    let adam = name.starts_with("adamw");
    let graph_text = if adam {
        let betas = config["betas"].as_array().unwrap();
        format!(
            "graph \"{name}\" {{\n input %p : f32[{n}]\n input %g : f32[{n}]\n input %m : f32[{n}]\n input %v : f32[{n}]\n \
             input %lr : f32[]\n input %step : f32[]\n %0, %1, %2 = adamw %p, %g, %m, %v, %lr, %step \
             {{beta1 = {:?}, beta2 = {:?}, eps = {:?}, weight_decay = {:?}}} : f32[{n}], f32[{n}], f32[{n}]\n \
             output \"p\" = %0\n output \"m\" = %1\n output \"v\" = %2\n}}\n",
            betas[0].as_f64().unwrap(),
            betas[1].as_f64().unwrap(),
            get("eps", 1e-8),
            get("weight_decay", 0.01)
        )
    } else {
        format!(
            "graph \"{name}\" {{\n input %p : f32[{n}]\n input %g : f32[{n}]\n input %buf : f32[{n}]\n input %lr : f32[]\n \
             %0, %1 = sgd %p, %g, %buf, %lr {{momentum = {:?}, weight_decay = {:?}, nesterov = {}}} : f32[{n}], f32[{n}]\n \
             output \"p\" = %0\n output \"buf\" = %1\n}}\n",
            get("momentum", 0.0),
            get("weight_decay", 0.0),
            config.get("nesterov").and_then(Value::as_bool).unwrap_or(false)
        )
    };
    let graph = autotp_ir::text::parse(&graph_text).unwrap();
    autotp_ir::verify(&graph).unwrap();
    assert!(autotp_ir::text::parse(&autotp_ir::text::print(&graph)).unwrap() == graph);
    let mut exec = Executor::new(autotp_codegen::lower(&graph).unwrap()).unwrap();
    let (mut p, mut state_a, mut state_b) = (initial, vec![0f32; n], vec![0f32; n]);
    let grads = record["grads"].as_array().unwrap();
    for (step, ((g, lr), want)) in
        grads.iter().zip(record["lrs"].as_array().unwrap()).zip(record["params"].as_array().unwrap()).enumerate()
    {
        let lr = lr.as_f64().unwrap() as f32;
        let mut feed = vec![host(&p), host(&floats(g)), host(&state_a)];
        if adam {
            feed.extend([host(&state_b), scalar(lr), scalar((step + 1) as f32)]);
        } else {
            feed.push(scalar(lr));
        }
        let out = exec.run(&feed).unwrap();
        p = to_f32(&out[0]);
        state_a = to_f32(&out[1]);
        if adam {
            state_b = to_f32(&out[2]);
        }
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
