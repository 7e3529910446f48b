//! Golden IR tests: each `tests/golden/*.ir` file holds
//!
//! ```text
//! # passes: recognize dce            (autodiff:freeze=P1,P2 freezes parameters)
//! graph "..." { ... }        <- input
//! # expect:
//! graph "..." { ... }        <- expected output of the passes
//! ```
//!
//! The runner parses and verifies the input, runs the passes, and compares the printed result
//! with the expectation (a mismatch prints both; `AUTOTP_BLESS=1` rewrites the expectation).
//! It also runs input and output through the reference evaluator on random data (the SPMD one
//! for a graph on a mesh): a pass must preserve what the graph computes. A second line
//! `# reference: PASSES` compares the output with the input after those passes instead (for
//! passes that change the model on purpose, as an expert capacity drops pairs: the layout must
//! compute what one device computes).
//!
//! A last pass `pipeline:P:M[:gpipe][:split]` cuts the graph into P stages over M micro-batches
//! (the backward whole unless `split`); the expectation is the stage graphs, each after a
//! `# stage S` line, and the stages run together by the pipeline evaluator must compute what
//! `autodiff` + `accumulate:M` computes.

use std::path::Path;

use autotp_passes::optimize::{Optimize, Optimizer};
use autotp_passes::shard::Shard;
use autotp_passes::{autodiff::Autodiff, dce::Dce, loss::AttachLoss, recognize::Recognize, Pass, PassManager};

use crate::common::{max_abs_diff, random_tensor, repo};

/// `shard:dp=2,tp=2:x=shard(0)/replicate,w=replicate/shard(1)`: the mesh, then the seeds (one
/// placement per mesh axis, `/`-separated).
fn shard_spec(spec: &str) -> Shard {
    use autotp_ir::{Mesh, MeshAxis, Placement};
    let (mesh, seeds) = spec.split_once(':').unwrap_or((spec, ""));
    let axes = mesh
        .split(',')
        .map(|a| {
            let (name, size) = a.split_once('=').expect("mesh axes are NAME=SIZE");
            MeshAxis { name: name.into(), size: size.parse().unwrap() }
        })
        .collect();
    let placement = |p: &str| match p {
        "replicate" => Placement::Replicate,
        _ => Placement::Shard(p.trim_start_matches("shard(").trim_end_matches(')').parse().unwrap()),
    };
    let seeds = seeds
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            let (name, placements) = s.split_once('=').expect("seeds are NAME=PLACEMENT[/PLACEMENT...]");
            (name.to_string(), placements.split('/').map(placement).collect())
        })
        .collect();
    Shard::seeded(Mesh { axes }, seeds)
}

/// A pass from its spelling in a golden file: `name`, `autodiff:freeze=P1,P2`,
/// `shard:MESH:SEEDS` (see [`shard_spec`]), `peephole` / `peephole:gemm`, `autotp:TP[:replicate-unsplittable]`, `expert-dispatch:RANKS[:outer=G][:cp=CP]`, `accumulate:A`, `zero:DP:STAGE[:BUCKET:MAX_LIVE[:IN_FLIGHT]][:ep[=EP]][:cp=CP]` or
/// `optimize` (clipping at 1) / `optimize:noclip` / `optimize:skip` / `optimize:scaled` (clipping,
/// non-finite steps skipped, gradients unscaled), `precision:bf16|f16[:scaled]`,
/// `autodiff:scaled` (from the loss scale), `grad-accumulation:DTYPE`, `attention` /
/// `attention:tp=N` (for a graph tp will split N ways), `attention:cp=N[:balanced]`,
/// `cp-balance:SEQ_LEN`, `cp-ring` / `cp-ring:balanced=CP` (the sequence order), `fusion` /
/// `fusion:selective` / `fusion:full` (with recomputation).
fn pass_by_name(spec: &str) -> Box<dyn Pass> {
    let (name, argument) = spec.split_once(':').unwrap_or((spec, ""));
    match name {
        "dce" => Box::new(Dce),
        "fusion" => Box::new(autotp_passes::fusion::Fusion {
            recompute: match argument {
                "selective" => autotp_passes::recompute::Recompute::Selective,
                "full" => autotp_passes::recompute::Recompute::Full { layers: None },
                _ => autotp_passes::recompute::Recompute::None,
            },
        }),
        "peephole" => Box::new(autotp_passes::peephole::Peephole {
            rules: match argument {
                "gemm" => autotp_passes::peephole::Rules::Gemm,
                _ => autotp_passes::peephole::Rules::Algebraic,
            },
        }),
        "recognize" => Box::new(Recognize),
        "attention" => Box::new(autotp_passes::attention::FuseAttention {
            tensor_parallel: argument.strip_prefix("tp=").map_or(1, |tp| tp.parse().expect("attention:tp=N")),
            context_parallel: argument
                .strip_prefix("cp=")
                .map_or(1, |cp| cp.trim_end_matches(":balanced").parse().expect("attention:cp=N[:balanced]")),
            load_balanced: argument.ends_with(":balanced"),
        }),
        "cp-balance" => Box::new(autotp_passes::context_balance::LoadBalance {
            seq_len: argument.parse().expect("cp-balance:SEQ_LEN"),
        }),
        "cp-ring" => Box::new(autotp_passes::cp_ring::RingAttention {
            order: match argument.strip_prefix("balanced=") {
                Some(cp) => {
                    autotp_program::step::SequenceOrder::LoadBalanced { cp: cp.parse().expect("cp-ring:balanced=CP") }
                }
                None => autotp_program::step::SequenceOrder::Natural,
            },
        }),
        "precision" => {
            let (dtype, scaled) = argument.split_once(':').map_or((argument, false), |(d, s)| (d, s == "scaled"));
            Box::new(autotp_passes::precision::Precision {
                half: autotp_ir::DType::from_name(dtype).expect("precision:bf16 or precision:f16[:scaled]"),
                loss_scaling: scaled,
            })
        }
        "grad-accumulation" => Box::new(autotp_passes::precision::GradAccumulation {
            dtype: autotp_ir::DType::from_name(argument).expect("grad-accumulation:DTYPE"),
        }),
        "loss" => Box::new(AttachLoss),
        "shard" => Box::new(shard_spec(argument)),
        "split-fused" => Box::new(autotp_passes::split_fused::SplitFused),
        "expand-norms" => Box::new(autotp_passes::expand_norms::ExpandNorms),
        "expert-dispatch" => {
            // expert-dispatch:RANKS[:outer=G][:cp=CP][:capacity=F/S]: G groups of RANKS
            // expert-parallel ranks, each rank's tokens split over CP context ranks; each
            // expert's pairs bounded by capacity factor F, counted per sequence of S tokens.
            let usage = "expert-dispatch:RANKS[:outer=G][:cp=CP][:capacity=F/S][:probs]";
            let mut parts = argument.split(':');
            let ranks = parts.next().and_then(|r| r.parse().ok()).expect(usage);
            let mut layout = autotp_passes::expert_dispatch::DispatchLayout { ranks, outer: 1, inner: 1 };
            let mut capacity = None;
            for part in parts {
                match part.split_once('=') {
                    Some(("outer", g)) => layout.outer = g.parse().expect(usage),
                    Some(("cp", cp)) => layout.inner = cp.parse().expect(usage),
                    Some(("capacity", f_s)) => {
                        let (factor, sequence) = f_s.split_once('/').expect(usage);
                        capacity = Some(autotp_passes::expert_dispatch::ExpertCapacity {
                            factor: factor.parse().expect(usage),
                            sequence: sequence.parse().expect(usage),
                            policy: Default::default(),
                        });
                    }
                    None if part == "probs" => {
                        let capacity = capacity.as_mut().expect("probs follows the capacity");
                        capacity.policy = autotp_passes::expert_dispatch::DropPolicy::Probability;
                    }
                    _ => panic!("{usage}"),
                }
            }
            Box::new(autotp_passes::expert_dispatch::DispatchExperts { layout, capacity })
        }
        "unmerge-heads" => Box::new(autotp_passes::unmerge_heads::UnmergeHeads),
        "accumulate" => Box::new(autotp_passes::accumulate::Accumulate {
            micro_batches: argument.parse().expect("accumulate:A"),
            batch_inputs: vec!["input_ids".into(), "labels".into()],
        }),
        "zero" => {
            // A trailing `:cp=CP`: each sequence split over CP context ranks as well.
            let (argument, cp) = argument.split_once(":cp=").unwrap_or((argument, "1"));
            let cp = cp.parse().expect("zero:DP:STAGE[:BUCKET:MAX_LIVE[:IN_FLIGHT]][:ep[=EP]][:cp=CP]");
            // A trailing `:ep` or `:ep=EP`: the experts split by expert over dp (`--ep` = `--dp`) or
            // over EP ranks of each group of dp.
            let (argument, ep) = match argument.rsplit_once(":ep") {
                Some((rest, ep)) => {
                    (rest, Some(ep.strip_prefix('=').map(|n| n.parse::<usize>().expect("zero:..:ep=EP"))))
                }
                None => (argument, None),
            };
            let mut parts = argument
                .split(':')
                .map(|p| p.parse::<usize>().expect("zero:DP:STAGE[:BUCKET:MAX_LIVE[:IN_FLIGHT]][:ep[=EP]][:cp=CP]"));
            let (dp, stage) = (parts.next().unwrap(), parts.next().unwrap() as u8);
            let mut config = autotp_passes::zero::ZeroConfig { stage, ..Default::default() };
            if let (Some(bucket), Some(max_live)) = (parts.next(), parts.next()) {
                let max_in_flight = parts.next().unwrap_or(usize::MAX);
                config.prefetch = autotp_passes::zero::Prefetch {
                    bucket_elements: bucket,
                    max_live_elements: max_live,
                    max_in_flight,
                };
            }
            Box::new(autotp_passes::zero::Zero {
                dp,
                cp,
                config,
                batch_inputs: vec!["input_ids".into(), "labels".into()],
                param_placements: Default::default(),
                ep: match ep {
                    None => 1,
                    Some(None) => dp,
                    Some(Some(ep)) => ep,
                },
            })
        }
        "autotp" => {
            // autotp:TP[:replicate-unsplittable][:sp=SEQ_LEN]
            let mut parts = argument.split(':');
            let tp = parts.next().and_then(|tp| tp.parse().ok()).expect("autotp:TP");
            let options: Vec<&str> = parts.collect();
            Box::new(autotp_passes::autotp::AutoTp {
                tp,
                dp: 1,
                cp: 1,
                zero: Default::default(),
                batch_inputs: vec![],
                replicate_unsplittable: options.contains(&"replicate-unsplittable"),
                param_placements: Default::default(),
                sequence_parallel: options.iter().find_map(|o| o.strip_prefix("sp=")?.parse().ok()),
                ep: 1,
            })
        }
        "autodiff" => {
            let mut pass = Autodiff::new("loss");
            if let Some(frozen) = argument.strip_prefix("freeze=") {
                pass.frozen = frozen.split(',').map(str::to_string).collect();
            }
            if argument == "scaled" {
                pass.cotangent = Some(autotp_passes::precision::LOSS_SCALE.into());
            }
            if let Some(rows) = argument.strip_prefix("padding=") {
                let (table, row) = rows.split_once(':').expect("autodiff:padding=TABLE:ROW");
                pass.padding_rows.insert(table.to_string(), row.parse().expect("a row index"));
            }
            Box::new(pass)
        }
        "optimize" => Box::new(Optimize {
            optimizer: Optimizer::AdamW { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 },
            grad_clip: (argument != "noclip").then_some(1.0),
            stage: None,
            nonfinite: match argument {
                "skip" => autotp_passes::optimize::NonFinite::Skip,
                "scaled" => autotp_passes::optimize::NonFinite::SkipScaled,
                _ => autotp_passes::optimize::NonFinite::Apply,
            },
        }),
        other => panic!("unknown pass '{other}' in a golden file"),
    }
}

fn check(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).unwrap();
    let passes_line =
        text.lines().next().and_then(|l| l.strip_prefix("# passes:")).ok_or("first line must be '# passes: ...'")?;
    let (input, expected) = text.split_once("# expect:\n").ok_or("missing '# expect:' line")?;
    let input_graph = autotp_ir::text::parse(input).map_err(|e| format!("input: {e}"))?;
    autotp_ir::verify(&input_graph).map_err(|e| format!("input: {e}"))?;
    let mut passes: Vec<&str> = passes_line.split_whitespace().collect();
    if let Some(spec) = passes.last().and_then(|p| p.strip_prefix("pipeline:")) {
        let spec = spec.to_string();
        passes.pop();
        return check_pipeline(path, &input_graph, &passes, &spec, input, expected);
    }
    let manager = PassManager::new(passes.into_iter().map(pass_by_name).collect());
    let mut output = input_graph.clone();
    manager.run(&mut output).map_err(|e| e.to_string())?;
    let printed = autotp_ir::text::print(&output);
    if printed != expected {
        if std::env::var_os("AUTOTP_BLESS").is_some() {
            std::fs::write(path, format!("{input}# expect:\n{printed}")).unwrap();
        } else {
            return Err(format!("output differs from the expectation.\n--- expected\n{expected}--- got\n{printed}(AUTOTP_BLESS=1 rewrites it)"));
        }
    }
    let reparsed = autotp_ir::text::parse(&printed).map_err(|e| format!("output does not parse: {e}"))?;
    if reparsed != output {
        return Err("parse(print(output)) != output".into());
    }
    // Same values for same-named inputs and parameters on both sides; outputs of the same name
    // must agree (a pass may add inputs, such as `labels`, and outputs, such as gradients).
    // Mixed precision changes what is computed by 16-bit rounding (2^-8 relative for bf16).
    let tolerance = if passes_line.contains("precision:") { 5e-2 } else { 1e-5 };
    let mut reference = input_graph.clone();
    if let Some(line) = text.lines().nth(1).and_then(|l| l.strip_prefix("# reference:")) {
        let manager = PassManager::new(line.split_whitespace().map(pass_by_name).collect());
        manager.run(&mut reference).map_err(|e| format!("reference: {e}"))?;
    }
    let before = run_named(&reference, &input_graph)?;
    let after = run_named(&output, &input_graph)?;
    for (name, b) in &before {
        if let Some(a) = after.get(name) {
            let (diff, scale) = max_abs_diff(a, b);
            if diff > tolerance * scale.max(1.0) {
                return Err(format!("output '{name}' changed by {diff} (scale {scale})"));
            }
        }
    }
    Ok(())
}

/// A golden file ending in the pipeline pass (`spec` is `P:M[:gpipe|:zb-h1][:split][:vV]`, `V`
/// model chunks per stage).
fn check_pipeline(
    path: &Path,
    input_graph: &autotp_ir::Graph,
    passes: &[&str],
    spec: &str,
    input: &str,
    expected: &str,
) -> Result<(), String> {
    use autotp_passes::pipeline::{Pipeline, PipelineBackward, PipelineSchedule};
    let parts: Vec<&str> = spec.split(':').collect();
    let stages = parts[0].parse().expect("pipeline:P:M");
    let micro_batches = parts[1].parse().expect("pipeline:P:M");
    let schedule = parts[2..].iter().find_map(|p| PipelineSchedule::parse(p)).unwrap_or(PipelineSchedule::OneFOneB);
    let backward = if parts[2..].contains(&"split") { PipelineBackward::Split } else { PipelineBackward::Whole };
    let virtual_stages = parts[2..].iter().find_map(|p| p.strip_prefix('v')?.parse().ok()).unwrap_or(1);
    let mut graph = input_graph.clone();
    PassManager::new(passes.iter().map(|p| pass_by_name(p)).collect()).run(&mut graph).map_err(|e| e.to_string())?;
    let batch_inputs = vec!["input_ids".to_string(), "labels".to_string()];
    let pipeline = Pipeline {
        stages,
        virtual_stages,
        cuts: vec![],
        micro_batches,
        schedule,
        backward,
        batch_inputs: batch_inputs.clone(),
        frozen: Default::default(),
        padding_rows: Default::default(),
        grad_dtype: None,
        loss_scaling: false,
        forward_only: false,
    };
    let (_, graphs) = pipeline.run(&graph).map_err(|e| e.to_string())?;
    let printed: String =
        graphs.iter().enumerate().map(|(s, g)| format!("# stage {s}\n{}", autotp_ir::text::print(g))).collect();
    if printed != expected {
        if std::env::var_os("AUTOTP_BLESS").is_some() {
            std::fs::write(path, format!("{input}# expect:\n{printed}")).unwrap();
        } else {
            return Err(format!("output differs from the expectation.\n--- expected\n{expected}--- got\n{printed}(AUTOTP_BLESS=1 rewrites it)"));
        }
    }
    for (s, text) in printed.split("# stage ").skip(1).enumerate() {
        let text = text.split_once('\n').map(|(_, graph)| graph).unwrap_or("");
        let reparsed = autotp_ir::text::parse(text).map_err(|e| format!("stage {s} does not parse: {e}"))?;
        if reparsed != graphs[s] {
            return Err(format!("stage {s}: parse(print(output)) != output"));
        }
    }
    let mut reference = graph.clone();
    let passes: Vec<Box<dyn Pass>> = vec![
        Box::new(Autodiff::new("loss")),
        Box::new(autotp_passes::accumulate::Accumulate { micro_batches, batch_inputs }),
    ];
    PassManager::new(passes).run(&mut reference).map_err(|e| e.to_string())?;
    let expected = run_named(&reference, &reference)?;
    let seed_of = |name: &str| name.bytes().fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
    let mut params = std::collections::BTreeMap::new();
    let mut inputs = Vec::new();
    for g in &graphs {
        for &v in g.params() {
            let name = g.name_of(v).unwrap_or("");
            params.insert(name.to_string(), random_tensor(g.ty(v), seed_of(name)));
        }
        inputs.push(g.inputs().iter().map(|&v| random_tensor(g.ty(v), seed_of(g.name_of(v).unwrap_or("")))).collect());
    }
    let outputs = autotp_ir::eval::eval_pipeline_step(&graphs, &mut params, &inputs).map_err(|e| e.to_string())?;
    for (g, outs) in graphs.iter().zip(outputs) {
        for ((name, _), got) in g.outputs().iter().zip(outs) {
            let want = expected.get(name).ok_or_else(|| format!("stage output '{name}' is not a reference output"))?;
            let (diff, scale) = max_abs_diff(&got, want);
            if diff > 1e-5 * scale.max(1.0) {
                return Err(format!("stage output '{name}' differs from accumulation by {diff} (scale {scale})"));
            }
        }
    }
    Ok(())
}

/// Evaluates a graph on pseudo-random inputs and parameters chosen by name. A parameter that
/// is a part of a weight of `source` (`split-fused`'s `W[a:b]`) gets its part of the weight's.
fn run_named(
    graph: &autotp_ir::Graph,
    source: &autotp_ir::Graph,
) -> Result<std::collections::BTreeMap<String, autotp_ir::Tensor>, String> {
    let seed_of = |name: &str| name.bytes().fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
    let source_param = |name: &str| source.params().iter().copied().find(|&p| source.name_of(p) == Some(name));
    let feed = |v: autotp_ir::ValueId| {
        let name = graph.name_of(v).unwrap_or("");
        let ty = graph.ty(v);
        let part = autotp_passes::split_fused::parse_part_name(name)
            .filter(|_| source_param(name).is_none())
            .and_then(|(weight, features)| Some((weight, features, source_param(weight)?)));
        let Some((weight, features, whole)) = part else {
            return (name.to_string(), random_tensor(ty, seed_of(name)));
        };
        let whole_ty = source.ty(whole);
        let whole = random_tensor(whole_ty, seed_of(weight));
        let dim = (0..ty.rank()).find(|&d| ty.shape[d] != whole_ty.shape[d]).expect("a part is smaller");
        let mut offsets = vec![0; ty.rank()];
        offsets[dim] = features.start;
        let size = ty.dtype.size();
        let mut bytes = vec![0u8; ty.numel() * size];
        autotp_kernels::shape::extract_block(&whole_ty.shape, &offsets, &ty.shape, size, whole.bytes(), &mut bytes);
        (name.to_string(), autotp_ir::Tensor::from_pod(ty.dtype, ty.shape.clone(), &bytes[..]))
    };
    let inputs: Vec<_> = graph.inputs().iter().map(|&v| feed(v).1).collect();
    let mut params = graph.params().iter().map(|&v| feed(v)).collect();
    let outputs = if graph.mesh.axes.is_empty() {
        autotp_ir::eval::eval_graph(graph, &params, &inputs)
    } else {
        autotp_ir::spmd::eval_spmd_step(graph, &mut params, &inputs)
    }
    .map_err(|e| e.to_string())?;
    Ok(graph.outputs().iter().map(|(n, _)| n.clone()).zip(outputs).collect())
}

#[test]
fn golden_files() {
    let dir = repo().join("tests/golden");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ir"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no golden files in {}", dir.display());
    let failures: Vec<String> =
        files.iter().filter_map(|f| check(f).err().map(|e| format!("{}: {e}", f.display()))).collect();
    assert!(
        failures.is_empty(),
        "{} of {} golden files failed:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n\n")
    );
}
