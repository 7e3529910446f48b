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
        let p: Vec<f32> = exec
            .read_slot("p")
            .unwrap()
            .unwrap()
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(
            reference["p"].bytes(),
            &*exec.read_slot("p").unwrap().unwrap(),
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

/// A step of AdamW (or SGD) over several parameters: the `fusion` pass makes one multi-tensor
/// optimizer step of the updates, which codegen runs in place. Its parameters and states must
/// be bit-identical to the single-tensor builtin kernels' over several steps; with `read_after`
/// the first parameter is also an output (read after the step), so its update cannot be in
/// place and is copied instead.
fn multi_tensor_step(optimizer: &str, read_after: bool) {
    use autotp_codegen::{lower_with, KernelChoice, LowerOptions};
    use autotp_program::Instruction;
    // Sizes: one element, an odd vector tail, more than one task of the step (16K elements).
    let sizes = [1usize, 37, 40_000];
    let mut text = format!("graph \"multi_{optimizer}\" {{\n input %lr : f32[]\n input %step : f32[]\n");
    for (k, n) in sizes.iter().enumerate() {
        text += &format!(" input %g{k} : f32[{n}]\n param %p{k} : f32[{n}]\n state %m{k} : f32[{n}]\n");
        if optimizer == "adamw" {
            text += &format!(" state %v{k} : f32[{n}]\n");
        }
    }
    for (k, n) in sizes.iter().enumerate() {
        text += &match optimizer {
            "adamw" => format!(
                " %a{k}, %b{k}, %c{k} = adamw %p{k}, %g{k}, %m{k}, %v{k}, %lr, %step \
                 {{beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1}} : f32[{n}], f32[{n}], f32[{n}]\n \
                 update %p{k} = %a{k}\n update %m{k} = %b{k}\n update %v{k} = %c{k}\n"
            ),
            "sgd" => format!(
                " %a{k}, %b{k} = sgd %p{k}, %g{k}, %m{k}, %lr {{momentum = 0.9, weight_decay = 0.01, nesterov = true}} \
                 : f32[{n}], f32[{n}]\n update %p{k} = %a{k}\n update %m{k} = %b{k}\n"
            ),
            _ => format!(
                " %a{k}, %b{k} = sgd %p{k}, %g{k}, %m{k}, %lr {{momentum = 0.0, weight_decay = 0.0, nesterov = false}} \
                 : f32[{n}], f32[{n}]\n update %p{k} = %a{k}\n update %m{k} = %b{k}\n"
            ),
        };
    }
    if read_after {
        text += " output \"p0\" = %p0\n";
    }
    text += " output \"p2_new\" = %a2\n}\n";
    let graph = autotp_ir::text::parse(&text).unwrap();
    let mut fused = graph.clone();
    autotp_passes::PassManager::new(vec![Box::new(autotp_passes::fusion::Fusion::default())]).run(&mut fused).unwrap();
    assert!(autotp_ir::text::print(&fused).contains("fusion \"f"), "{}", autotp_ir::text::print(&fused));
    let fused_program =
        lower_with(&fused, &LowerOptions { kernels: KernelChoice::Generated, ..Default::default() }).unwrap();
    let steps: Vec<&Instruction> =
        fused_program.instructions.iter().filter(|i| matches!(i, Instruction::OptimizerStep { .. })).collect();
    assert_eq!(steps.len(), 1, "one multi-tensor step: {:#?}", fused_program.instructions);
    // In place: no copies after the step, but for the parameter read after it.
    let copies = fused_program.updates.len();
    assert_eq!(copies, usize::from(read_after), "updates left: {:?}", fused_program.updates);
    let builtin = lower_with(&graph, &LowerOptions { kernels: KernelChoice::Builtin, ..Default::default() }).unwrap();
    assert!(fused_program.memory.activations_peak_bytes < builtin.memory.activations_peak_bytes);

    let mut runs = [Executor::new(builtin).unwrap(), Executor::new(fused_program).unwrap()];
    for (k, &n) in sizes.iter().enumerate() {
        let ty = autotp_ir::TensorType::new(autotp_ir::DType::F32, vec![n]);
        let p = crate::common::random_tensor(&ty, 100 + k as u64);
        for exec in &mut runs {
            exec.load_slot(&format!("p{k}"), p.bytes()).unwrap();
        }
    }
    // The bias corrections at late steps too: every bit of the step count's power counts.
    for step in [1u64, 2, 3, 1000, 65_537, 1 << 23] {
        let mut feed = vec![scalar(1e-2 / step as f32), scalar(step as f32)];
        for (k, &n) in sizes.iter().enumerate() {
            let ty = autotp_ir::TensorType::new(autotp_ir::DType::F32, vec![n]);
            let g = crate::common::random_tensor(&ty, step * 10 + k as u64);
            feed.push(HostTensor { dtype: g.dtype(), shape: vec![n], data: g.bytes().to_vec() });
        }
        let [builtin, fused] = &mut runs;
        let (want, got) = (builtin.run(&feed).unwrap(), fused.run(&feed).unwrap());
        assert_eq!(want, got, "{optimizer} step {step}: outputs differ");
        let slots: &[&str] = if optimizer == "adamw" { &["p", "m", "v"] } else { &["p", "m"] };
        for (k, slot) in (0..sizes.len()).flat_map(|k| slots.iter().map(move |s| (k, s))) {
            let name = format!("{slot}{k}");
            assert!(
                builtin.read_slot(&name).unwrap().unwrap() == fused.read_slot(&name).unwrap().unwrap(),
                "{optimizer} step {step}: {name} differs between the multi-tensor step and the builtin kernels"
            );
        }
    }
}

#[test]
fn multi_tensor_steps_match_the_single_tensor_kernels_bit_for_bit() {
    for optimizer in ["adamw", "sgd", "sgd_plain"] {
        for read_after in [false, true] {
            multi_tensor_step(optimizer, read_after);
        }
    }
}
