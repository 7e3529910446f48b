//! [`compile`]: a model and validated options in, a training plan out. Imports the model (its
//! batch and sequence bound, shapes-only when its weights are not needed), makes the refusals
//! that need the model (`--freeze`, `--padding-idx`, a position table shorter than
//! `--seq-len`), runs the steps ([`crate::steps`]) and assembles the plan: the programs, how to
//! feed and train them, and where each parameter's initial weights come from.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use autotp_frontend::{ImportOptions, Model};
use autotp_ir::{Graph, Tensor};
use autotp_program::plan::{Evaluation, Labels, ModelSource, PaddingRow, TrainingConfig, TrainingPlan, WeightPart};
use autotp_program::weight_files::WeightReference;

use crate::steps::{run_steps, steps, CompileState, ModelFacts, Observer, Purpose, TpExplanation};
use crate::{CompileError, CompileOptions};

/// Whether a compile reads the model's weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Weights {
    /// Into the plan: it can be written and trained.
    Read,
    /// Not at all: the model is imported shapes-only ([`ImportOptions::shapes_only`]), for the
    /// memory and communication report (`compile --report` without `-o`, the layout search);
    /// with `layers`, cut to the numbered layers at those positions (`[0, 1]`: the first two;
    /// [`autotp_passes::depth`]). No PTX is made.
    ShapesOnly { layers: Option<Vec<usize>> },
}

/// A compiled plan with the model's weights it starts from.
pub struct Compiled {
    pub plan: TrainingPlan,
    /// The model's parameters by name (none when imported shapes-only).
    pub model_weights: BTreeMap<String, Tensor>,
    /// The initial weights of parameters that are parts of a model weight.
    pub part_weights: BTreeMap<String, Vec<u8>>,
    /// Where the model's weights lie in its files, by parameter name.
    pub weight_locations: BTreeMap<String, autotp_frontend::WeightLocation>,
    /// Whether the plan file carries its initial weights (`--embed-weights`).
    pub embed_weights: bool,
    /// Per stage, each weight tensor parallelism placed and why (`--explain-tp`).
    pub tp_explanations: Vec<Vec<TpExplanation>>,
    /// Each step's name and seconds.
    pub step_seconds: Vec<(&'static str, f64)>,
}

impl Compiled {
    /// The initial weights the plan file names in the model's files instead of carrying
    /// them: every model weight the plan starts a parameter from as it is, unless
    /// `--embed-weights` (the parts of a fused projection are computed, so carried).
    pub fn weight_references(&self) -> BTreeMap<String, WeightReference> {
        if self.embed_weights {
            return BTreeMap::new();
        }
        let params: std::collections::BTreeSet<&str> =
            self.plan.params().iter().map(|(_, s)| s.name.as_str()).collect();
        (self.weight_locations.iter())
            .filter(|(name, _)| params.contains(name.as_str()) && !self.part_weights.contains_key(*name))
            .map(|(name, at)| (name.clone(), WeightReference { file: at.file.clone(), offset: at.offset }))
            .collect()
    }

    /// The initial weights by parameter name (slices of the memory-mapped model).
    pub fn weights(&self) -> BTreeMap<String, &[u8]> {
        let parts = self.part_weights.iter().map(|(name, bytes)| (name.clone(), &bytes[..]));
        self.model_weights.iter().map(|(name, t)| (name.clone(), t.bytes())).chain(parts).collect()
    }
}

/// Compiles the model `options` names into a training plan.
pub fn compile(options: &CompileOptions, weights: Weights) -> Result<Compiled, CompileError> {
    let flags = &options.flags;
    let start = Instant::now();
    // The graph is imported for one micro-batch of every rank; `accumulate` or the pipeline
    // repeat it.
    let import = ImportOptions {
        batch: Some(flags.micro_batch * flags.dp),
        seq_len: Some(flags.seq_len),
        shapes_only: weights != Weights::Read,
        ..Default::default()
    };
    let mut model = match &weights {
        Weights::ShapesOnly { layers: Some(layers) } => imported_for_cuts(&flags.model, &import, layers)?,
        _ => autotp_frontend::import_onnx(&flags.model, &import)?,
    };
    check_constant_gathers(&model.graph, flags.seq_len)?;
    // The model's parameter shapes, which the steps may split.
    let model_shapes: BTreeMap<String, Vec<usize>> = (model.graph.params().iter())
        .filter_map(|&p| Some((model.graph.name_of(p)?.to_string(), model.graph.ty(p).shape.clone())))
        .collect();
    let mut frozen = frozen(&flags.freeze, &model.graph)?;
    let padding_rows = padding_rows(&flags.padding_idx, &model)?;
    let own_loss = model.graph.outputs().iter().any(|(n, _)| n == autotp_passes::loss::LOSS);
    let facts = ModelFacts {
        frozen: frozen.clone(),
        padding_rows: padding_rows.iter().map(|p| (p.table.clone(), p.row)).collect(),
    };
    let steps = steps(options, &facts, &weights, Purpose::Train);
    let name = model.graph.name.clone();
    let imported = std::mem::replace(&mut model.graph, Graph::new(name.clone()));
    // A plan that will run validates too; a report needs only the training step.
    let evaluated = (weights == Weights::Read).then(|| imported.clone());
    let mut state = CompileState::new(imported);
    let mut observer = Observer { dump_dir: flags.dump_ir.as_deref(), print_after: &flags.print_after };
    let mut step_seconds = run_steps(&steps, &mut state, &mut observer)?;
    let evaluation = match evaluated {
        Some(graph) => {
            let (evaluation, seconds) =
                compile_evaluation(options, &facts, graph, &state.programs, state.sequence_order);
            step_seconds.push(("evaluation", seconds));
            evaluation
        }
        None => Evaluation::Refused("the plan was compiled shapes-only".into()),
    };

    let mut origins = WeightOrigins::default();
    for graph in &state.graphs {
        origins.add(graph, &model, &model_shapes);
    }
    // A frozen fused weight's parts are frozen.
    let frozen_parts: Vec<String> = (origins.parts.iter())
        .filter(|(_, part)| frozen.contains(&part.weight))
        .map(|(name, _)| name.clone())
        .collect();
    frozen.extend(frozen_parts);
    let path = std::fs::canonicalize(&flags.model).unwrap_or_else(|_| flags.model.clone());
    let plan = TrainingPlan {
        stages: state.programs,
        evaluation,
        training: TrainingConfig {
            seq_len: flags.seq_len,
            micro_batch: flags.micro_batch,
            global_batch: options.global_batch,
            labels: if own_loss { Labels::InputIds } else { Labels::NextTokens },
            loss_output: autotp_passes::loss::LOSS.to_string(),
            optimizer: options.optimizer_description.clone(),
            schedule: options.lr_schedule.clone(),
            grad_clip: flags.grad_clip,
            frozen: frozen.into_iter().collect(),
            padding_rows,
            compile_flags: Some(flags.recorded()),
            zero_stage: flags.zero,
            sequence_order: state.sequence_order,
            grad_accum: options.grad_accum,
            weight_shapes: origins.shapes,
            weight_parts: origins.parts,
            pipeline: state.pipeline,
            masters: origins.masters,
            grad_accum_dtype: options.grad_accum_dtype(),
            loss_scaler: options.loss_scaler.clone(),
            recompute: state.recompute,
            nvme: options.nvme.clone(),
            nvme_params: options.nvme_params.clone(),
        },
        model: ModelSource { name, path },
    };
    plan.feeds()?;
    plan.check_evaluation()?;
    tracing::info!(seconds = start.elapsed().as_secs_f64(), "compiled {}", flags.model.display());
    Ok(Compiled {
        plan,
        weight_locations: model.weight_locations,
        embed_weights: flags.embed_weights,
        model_weights: model.weights,
        part_weights: origins.part_weights,
        tp_explanations: state.tp_explanations,
        step_seconds,
    })
}

/// The validation step's programs ([`Purpose::Evaluate`]) and the seconds they took. A compile
/// that trains but cannot evaluate still makes its plan: the plan records why it has no
/// evaluation, `run --eval-every` says so, and the compile warns.
fn compile_evaluation(
    options: &CompileOptions,
    facts: &ModelFacts,
    graph: Graph,
    training: &[autotp_program::Program],
    sequence_order: autotp_program::step::SequenceOrder,
) -> (Evaluation, f64) {
    let start = Instant::now();
    let placed = |p: &autotp_program::Program| {
        p.params.iter().map(|slot| (slot.name.clone(), slot.placements.clone())).collect()
    };
    let param_placements = training.iter().map(placed).collect();
    let steps = steps(options, facts, &Weights::Read, Purpose::Evaluate { param_placements, sequence_order });
    let mut state = CompileState::new(graph);
    let mut observer = Observer { dump_dir: None, print_after: &[] };
    let evaluation = match run_steps(&steps, &mut state, &mut observer) {
        Ok(_) => Evaluation::Programs(state.programs),
        Err(e) => {
            let why = crate::render_error(&e);
            tracing::warn!("the plan has no validation step (run --eval-every refuses it): {why}");
            Evaluation::Refused(why)
        }
    };
    (evaluation, start.elapsed().as_secs_f64())
}

/// Where the plan's parameters and states come from in the model's weights.
#[derive(Default)]
struct WeightOrigins {
    /// The model shape of parameters (and their states) the plan computes with in another.
    shapes: BTreeMap<String, Vec<usize>>,
    /// Parameters that are parts of a model weight.
    parts: BTreeMap<String, WeightPart>,
    part_weights: BTreeMap<String, Vec<u8>>,
    /// f32 masters of 16-bit parameters: state name -> parameter name.
    masters: BTreeMap<String, String>,
}

impl WeightOrigins {
    /// Adds the parameters and states of one stage's `graph`.
    fn add(&mut self, graph: &Graph, model: &Model, model_shapes: &BTreeMap<String, Vec<usize>>) {
        for &p in graph.params() {
            let Some(name) = graph.name_of(p) else { continue };
            if let Some(shape) = model_shapes.get(name).filter(|&shape| shape != &graph.ty(p).shape) {
                self.shapes.insert(name.to_string(), shape.clone());
            }
            if !model_shapes.contains_key(name) {
                if let Some((part, bytes)) = weight_part(model, model_shapes, name, &graph.ty(p).shape) {
                    if let Some(bytes) = bytes {
                        self.part_weights.insert(name.to_string(), bytes);
                    }
                    self.parts.insert(name.to_string(), part);
                }
            }
        }
        for &state in graph.states() {
            let Some(name) = graph.name_of(state) else { continue };
            if let Some(param) = name.strip_prefix(autotp_passes::optimize::MASTER_PREFIX) {
                self.masters.insert(name.to_string(), param.to_string());
            }
            // A parameter's states (its master, its moments: `<kind>.<parameter>`) are stored
            // in its model shape too, so a checkpoint reads the same under any layout.
            let of_param = self.shapes.iter().find(|(param, shape)| {
                name.strip_suffix(param.as_str()).is_some_and(|prefix| prefix.ends_with('.'))
                    && shape.iter().product::<usize>() == graph.ty(state).numel()
            });
            if let Some((_, shape)) = of_param {
                self.shapes.insert(name.to_string(), shape.clone());
            }
        }
    }
}

/// Where the parameter `name` of `shape` lies in a model weight, when it is one of the parts
/// `split-fused` made ([`autotp_passes::split_fused::part_name`]), and its initial bytes (when
/// the weights were read).
fn weight_part(
    model: &Model,
    model_shapes: &BTreeMap<String, Vec<usize>>,
    name: &str,
    shape: &[usize],
) -> Option<(WeightPart, Option<Vec<u8>>)> {
    let (weight, features) = autotp_passes::split_fused::parse_part_name(name)?;
    let weight_shape = model_shapes.get(weight)?.clone();
    let dim = (0..shape.len()).find(|&d| shape[d] != weight_shape[d])?;
    let mut offsets = vec![0; shape.len()];
    offsets[dim] = features.start;
    let bytes = model.weights.get(weight).map(|whole| {
        let size = whole.ty.dtype.size();
        let mut bytes = vec![0u8; shape.iter().product::<usize>() * size];
        autotp_kernels::shape::extract_block(&weight_shape, &offsets, shape, size, whole.bytes(), &mut bytes);
        bytes
    });
    let part = WeightPart { weight: weight.to_string(), dim, start: features.start, weight_shape };
    Some((part, bytes))
}

/// A shapes-only import of the model cut to the layers at positions `layers`: the layout search
/// compiles hundreds of cuts of one model at a few batch sizes and sets of layers, so the model
/// is imported once per batch size and cut once per set in a process (a cut of 2 layers is
/// cheap to copy; the 80 it is cut from are not).
fn imported_for_cuts(path: &Path, options: &ImportOptions, layers: &[usize]) -> Result<Model, CompileError> {
    // By path, batch and sequence length, and the layers kept (`None`: the whole model).
    type Imports = BTreeMap<(PathBuf, Option<usize>, Option<usize>, Option<Vec<usize>>), Model>;
    static IMPORTS: std::sync::OnceLock<std::sync::Mutex<Imports>> = std::sync::OnceLock::new();
    let imports = IMPORTS.get_or_init(Default::default);
    let cached = |layers: Option<Vec<usize>>| {
        let key = (path.to_path_buf(), options.batch, options.seq_len, layers);
        let model = imports.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get(&key).cloned();
        (key, model)
    };
    let keep = |key, model: &Model| {
        imports.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(key, model.clone());
    };
    let (cut_key, cut) = cached(Some(layers.to_vec()));
    if let Some(cut) = cut {
        return Ok(cut);
    }
    let mut model = match cached(None) {
        (_, Some(whole)) => whole,
        (key, None) => {
            let whole = autotp_frontend::import_onnx(path, options)?;
            keep(key, &whole);
            whole
        }
    };
    model.graph = autotp_passes::depth::keep_layers(&model.graph, layers)?;
    keep(cut_key, &model);
    Ok(model)
}

/// Refuses a model whose gathers with indices known at import read past their table: a
/// position embedding shorter than `--seq-len`, which would otherwise fail at the first step.
fn check_constant_gathers(graph: &Graph, seq_len: usize) -> Result<(), CompileError> {
    for (id, node) in graph.nodes() {
        let autotp_ir::Op::Gather { axis } = node.op else { continue };
        let autotp_ir::Def::Node(made_by, _) = graph.value(node.inputs[1]).def else { continue };
        let autotp_ir::Op::Constant { value } = &graph.node(made_by).op else { continue };
        let size = graph.ty(node.inputs[0]).shape[axis] as i64;
        let Some(index) = value.to_i64_vec().into_iter().find(|&i| i >= size || i < -size) else { continue };
        let table = match graph.name_of(node.inputs[0]) {
            Some(name) => format!("'{name}'"),
            None => "its input".to_string(),
        };
        refuse!(
            "--seq-len {seq_len}: the model reads entry {index} of {table} (dim {axis} of size {size}; gather, node {}); \
             a position table that long allows --seq-len {size} at most",
            id.index()
        );
    }
    Ok(())
}

/// The embedding tables' padding rows: `--padding-idx`, else the model's metadata
/// ([`autotp_frontend::PADDING_IDX_METADATA`]), else each table's one zero row.
fn padding_rows(padding_idx: &[String], model: &Model) -> Result<Vec<PaddingRow>, CompileError> {
    use autotp_frontend::PADDING_IDX_METADATA;
    use autotp_passes::padding::{choose_padding_rows, embedding_tables, PaddingFlag};
    let recorded = model.metadata.get(PADDING_IDX_METADATA).map_or("", String::as_str);
    let mut parsed: Vec<PaddingFlag> = (recorded.split(',').map(str::trim).filter(|e| !e.is_empty()))
        .map(|entry| {
            let flag: PaddingFlag = entry.parse().map_err(|_| {
                CompileError::Options(format!(
                    "the model's metadata '{PADDING_IDX_METADATA}' = '{recorded}': '{entry}' is not N, none, TABLE=N \
                     or TABLE=none (N a row index)"
                ))
            })?;
            Ok(PaddingFlag { from_metadata: true, ..flag })
        })
        .collect::<Result<_, CompileError>>()?;
    for flag in padding_idx {
        parsed.push(flag.parse().map_err(CompileError::Options)?);
    }
    let tables = embedding_tables(&model.graph, &model.weights);
    let (rows, ambiguous) = choose_padding_rows(&tables, &parsed).map_err(CompileError::Options)?;
    for table in ambiguous {
        tracing::warn!(
            "embedding table '{}' has {} rows of zeros ({:?}...): none is taken as its padding row; \
             set --padding-idx {}=N if one is",
            table.param,
            table.zero_rows.len(),
            &table.zero_rows[..table.zero_rows.len().min(4)],
            table.param
        );
    }
    Ok(rows
        .into_iter()
        .map(|r| PaddingRow { table: r.table, row: r.row, detected: r.detected, from_metadata: r.from_metadata })
        .collect())
}

/// The parameters `--freeze` names; each expression must match at least one.
fn frozen(patterns: &[String], graph: &Graph) -> Result<BTreeSet<String>, CompileError> {
    let params: Vec<&str> = graph.params().iter().filter_map(|&p| graph.name_of(p)).collect();
    let mut frozen = BTreeSet::new();
    for pattern in patterns {
        let regex = regex::Regex::new(pattern)
            .map_err(|e| CompileError::Options(format!("--freeze '{pattern}' is not a valid regex: {e}")))?;
        let matched: Vec<&str> = params.iter().copied().filter(|p| regex.is_match(p)).collect();
        if matched.is_empty() {
            let some: Vec<&str> = params.iter().copied().take(6).collect();
            refuse!(
                "--freeze '{pattern}' matches no parameter of the model (its {} parameters include {})",
                params.len(),
                some.join(", ")
            );
        }
        frozen.extend(matched.into_iter().map(str::to_string));
    }
    if !params.is_empty() && frozen.len() == params.len() {
        refuse!("--freeze leaves nothing to train: it matches all {} parameters", params.len());
    }
    Ok(frozen)
}
