//! The compiled training plan (`TrainingPlan`) and its file, `.atp`.
//!
//! A plan is everything `autotp run` needs besides the data: the [`Program`] of one training
//! step (one per pipeline stage), the validation step's programs on the same layout
//! ([`Evaluation`]), how to feed them ([`TrainingConfig`]: batch, labels, schedule) and where
//! the model came from ([`ModelSource`], for `autotp export`).
//!
//! An `.atp` file is a safetensors file, so any safetensors reader can open it:
//! - tensors: the initial weights, by parameter name (the ONNX initializer names; a parameter
//!   two stages hold is stored once), and the programs' constants as `u8` tensors named
//!   `autotp.constant.<program>.<index>` (the training stages' programs, then the
//!   evaluation's);
//! - header metadata: `autotp.format` ([`FORMAT`]), `autotp.plan` (the plan as JSON, constants'
//!   bytes left out), `autotp.weight_files` (the files that hold the initial weights the plan
//!   does not carry, [`crate::weight_files`]) and `autotp.fingerprint` (of every program and
//!   the weights files' record, checked on load, so a damaged file is refused rather than run).
//!
//! By default a plan names the initial weights where the model keeps them (compile
//! `--embed-weights` copies them in): the file holds the programs and the weights that are in
//! no file as they are (the parts of a fused projection).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use autotp_kernels::DType;
use serde::{Deserialize, Serialize};

use crate::lr_schedule::LrSchedule;
use crate::step::StepInput;
use crate::tensor_file::{self, TensorFile, TensorRef};
use crate::weight_files::{WeightFiles, WeightReference};
use crate::{Program, ProgramError, Slot};

/// The `.atp` format this build reads and writes.
pub const FORMAT: &str = "autotp-plan/4";
const CONSTANT_PREFIX: &str = "autotp.constant.";

/// Where the model's weights came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSource {
    /// The graph's name.
    pub name: String,
    /// The ONNX file, absolute; `autotp export` writes trained weights into a copy of it.
    pub path: PathBuf,
}

/// What the step's `labels` input receives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Labels {
    /// The next tokens (window[1..S+1]); the compiler added the loss.
    NextTokens,
    /// The input ids themselves: the model has its own `loss` and shifts internally
    /// (the Hugging Face convention).
    InputIds,
}

fn one() -> usize {
    1
}

/// How a plan is fed and scheduled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingConfig {
    pub seq_len: usize,
    /// Sequences per rank per forward pass.
    pub micro_batch: usize,
    /// Sequences per optimizer step, all ranks and micro-batches together (G in the contract).
    pub global_batch: usize,
    pub labels: Labels,
    /// The program output holding the step's mean loss.
    pub loss_output: String,
    /// The optimizer and its hyperparameters, for people (the program's kernels hold them).
    pub optimizer: String,
    pub schedule: LrSchedule,
    pub grad_clip: Option<f64>,
    /// Parameters excluded from training (`--freeze`).
    pub frozen: Vec<String>,
    /// Embedding tables' rows that get no gradient (`nn.Embedding(padding_idx)`).
    #[serde(default)]
    pub padding_rows: Vec<PaddingRow>,
    /// The `compile` flags that made the plan (what decides the step), for `autotp verify`.
    #[serde(default)]
    pub compile_flags: Option<serde_json::Value>,
    /// The ZeRO stage over the data-parallel ranks.
    #[serde(default)]
    pub zero_stage: u8,
    /// The order the token inputs hold each sequence in (context parallelism's load balance).
    #[serde(default)]
    pub sequence_order: crate::step::SequenceOrder,
    /// Micro-batches per optimizer step on each rank (`--grad-accum`).
    #[serde(default = "one")]
    pub grad_accum: usize,
    /// The shape of parameters in weight files (the model, checkpoints, exports) where the plan
    /// computes with another view of the same bytes (a fused projection stored `[in, k, n]`).
    #[serde(default)]
    pub weight_shapes: BTreeMap<String, Vec<usize>>,
    /// Parameters the plan computes with as parts of a model weight (the unequal parts of a
    /// fused projection: multi-query attention's `qkv`), by parameter name. Weight files and
    /// exports hold the model's weight; checkpoints hold the parts and join them when read.
    #[serde(default)]
    pub weight_parts: BTreeMap<String, WeightPart>,
    /// How the pipeline stages run, when there are several.
    #[serde(default)]
    pub pipeline: Option<PipelineConfig>,
    /// The f32 master copies of 16-bit parameters (`--precision bf16|fp16`), state name ->
    /// parameter name: a fresh run starts each from the parameter's f32 weights.
    #[serde(default)]
    pub masters: BTreeMap<String, String>,
    /// The type gradients are accumulated and reduced in (`--grad-accum-dtype`), where it is
    /// not the parameters' own.
    #[serde(default)]
    pub grad_accum_dtype: Option<DType>,
    /// fp16's loss scaler in its initial state (a checkpoint carries its current one).
    #[serde(default)]
    pub loss_scaler: Option<crate::loss_scale::LossScaler>,
    /// What `--recompute` recomputes, and what it saves and costs.
    #[serde(default)]
    pub recompute: Option<RecomputeSummary>,
    /// Where the offloaded optimizer state lives in files (`--offload-optimizer nvme`); the
    /// programs are those of `--offload-optimizer cpu`, so this is outside the fingerprint.
    #[serde(default)]
    pub nvme: Option<crate::offload::NvmeOffload>,
    /// Where parameter shards live in files (`--offload-param nvme`).
    #[serde(default)]
    pub nvme_params: Option<crate::param_file::NvmeParams>,
}

/// Activation recomputation in a plan (`--recompute`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecomputeSummary {
    /// The flag: `selective` (core attention), `full` (layers), `auto`.
    pub mode: String,
    /// Per stage, what it recomputes (`auto` chooses per stage): `none`, `selective`, `full`,
    /// `full (first K layers)`.
    #[serde(default)]
    pub chosen: Vec<String>,
    /// The `--memory-cap` every rank's arena fits in.
    #[serde(default)]
    pub memory_cap: Option<u64>,
    /// Per stage with full recomputation, the input kept per layer: elements (`sbh`) and bytes.
    #[serde(default)]
    pub layer_inputs: Vec<(usize, usize)>,
    /// Per stage with full recomputation, the layers recomputed (each micro-batch recomputes them).
    #[serde(default)]
    pub layers: Vec<usize>,
    /// Per stage: attention blocks or layers recomputed per step, their FLOPs, and the activation peak
    /// the stage would have without recomputation (none in a cut of the model the layout search
    /// compiles, which is not printed).
    pub blocks: Vec<usize>,
    pub flops: Vec<u64>,
    pub activations_peak_without: Vec<usize>,
    /// Per stage, the elements of one layer's attention probabilities (`a s^2 b`: heads,
    /// sequence squared, batch), for Korthikanti et al.'s `5as^2b` bytes per layer.
    #[serde(default)]
    pub probability_elements: Vec<usize>,
}

/// Where a parameter lies in the model weight it is a part of: `len` entries from `start`
/// along `dim` (the weight's features).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightPart {
    pub weight: String,
    pub dim: usize,
    pub start: usize,
    /// The model weight's shape.
    pub weight_shape: Vec<usize>,
}

impl TrainingConfig {
    /// The type a parameter's initial weights are stored in: f32 for a 16-bit parameter with an
    /// f32 master (the master starts from them unrounded), else the parameter's own.
    pub fn initial_weights_dtype(&self, slot: &crate::Slot) -> DType {
        match self.masters.values().any(|p| *p == slot.name) {
            true => DType::F32,
            false => slot.dtype,
        }
    }

    /// The model tensor that a plan parameter or optimizer state is a part of, and where:
    /// `W[0:64]` is part of `W`, its AdamW moment `adamw.m.W[0:64]` part of `adamw.m.W`.
    pub fn part_of(&self, tensor: &str) -> Option<(String, &WeightPart)> {
        self.weight_parts.iter().find_map(|(part, p)| {
            let prefix = tensor.strip_suffix(part.as_str())?;
            (prefix.is_empty() || prefix.ends_with('.')).then(|| (format!("{prefix}{}", p.weight), p))
        })
    }
}

/// A padding row of an embedding table (`autotp_passes::padding`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaddingRow {
    pub table: String,
    pub row: usize,
    /// Found (the table's one zero row at import) rather than set by `--padding-idx` or the
    /// model's metadata.
    pub detected: bool,
    /// Set by the model's metadata (`autotp.padding_idx`).
    #[serde(default)]
    pub from_metadata: bool,
}

/// The pipeline's stages and schedule (`--pp`, `--schedule`); its micro-batches are the step's
/// `grad_accum`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelineConfig {
    /// `1f1b` (interleaved with virtual stages), `gpipe` or `zb-h1`.
    pub schedule: String,
    /// When a backward chunk sends its input's gradient: `split` (before the weights'
    /// gradients) or `whole` (after them).
    #[serde(default = "split_backward")]
    pub backward: String,
    /// Model chunks per rank (`--virtual-stages`; 1 in plans written before it existed).
    #[serde(default = "one")]
    pub virtual_stages: usize,
    /// Each stage's forward cost by the partition's model (FLOPs per micro-batch).
    pub stage_flops: Vec<u64>,
    /// The most micro-batches whose activations each stage holds at once.
    pub in_flight: Vec<usize>,
    /// The idle fraction of a step the schedule implies with equal stages: (P-1)/(V M+P-1),
    /// the bubble (P-1)/(V M) of the ideal step as a share of the step.
    pub bubble_fraction: f64,
    /// Each stage's idle fraction of a step the schedule implies with these stages' costs (a
    /// stage faster than the slowest waits for it every micro-batch; a backward that sends the
    /// input's gradient before making the weights' shortens the bubble).
    #[serde(default)]
    pub stage_idle: Vec<f64>,
}

/// Plans written before the field existed ran the split backward.
fn split_backward() -> String {
    "split".to_string()
}

impl PipelineConfig {
    /// Stage `stage`'s planned idle fraction ([`PipelineConfig::stage_idle`]; the equal-stage
    /// bubble for a plan written without it).
    pub fn planned_idle(&self, stage: usize) -> f64 {
        self.stage_idle.get(stage).copied().unwrap_or(self.bubble_fraction)
    }

    /// How [`PipelineConfig::bubble_fraction`] was computed, for tables.
    pub fn bubble_formula(&self) -> &'static str {
        if self.virtual_stages > 1 {
            "(P-1)/(V*M+P-1)"
        } else {
            "(P-1)/(M+P-1)"
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingPlan {
    /// The step's program of each pipeline stage (one without a pipeline): every rank of stage
    /// `s` runs `stages[s]`, all on the same mesh.
    pub stages: Vec<Program>,
    pub evaluation: Evaluation,
    pub training: TrainingConfig,
    pub model: ModelSource,
}

/// The validation step (`run --eval-every`): the training step's forward pass and mean loss on
/// one step's batch (the same token inputs), no gradient and no optimizer state, compiled
/// for the same layout so that each rank's program holds the same parameter blocks as its
/// training program and reads them from it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Evaluation {
    /// One program per pipeline stage, as `stages`.
    Programs(Vec<Program>),
    /// Why the plan has none (the compile said so too).
    Refused(String),
}

impl Evaluation {
    pub fn programs(&self) -> &[Program] {
        match self {
            Evaluation::Programs(programs) => programs,
            Evaluation::Refused(_) => &[],
        }
    }

    fn programs_mut(&mut self) -> &mut [Program] {
        match self {
            Evaluation::Programs(programs) => programs,
            Evaluation::Refused(_) => &mut [],
        }
    }
}

impl TrainingConfig {
    /// The shape of the token inputs (ids and labels) for `rows` sequences per micro-batch:
    /// `[rows, seq_len]`, or `[rows, grad_accum, seq_len]` when a step accumulates several
    /// micro-batches or runs a pipeline (the same row-major bytes as
    /// `[rows x grad_accum, seq_len]`).
    pub fn token_shape(&self, rows: usize) -> Vec<usize> {
        if self.grad_accum > 1 || self.pipeline.is_some() {
            vec![rows, self.grad_accum, self.seq_len]
        } else {
            vec![rows, self.seq_len]
        }
    }

    /// The shape of a step's whole token inputs: all ranks' sequences of one micro-batch, by
    /// micro-batch.
    pub fn global_token_shape(&self) -> Vec<usize> {
        self.token_shape(self.global_batch / self.grad_accum.max(1))
    }
}

impl TrainingPlan {
    /// What feeds each stage's program inputs, in input order; an input the trainer cannot feed,
    /// or a missing loss output, is an error naming it.
    pub fn feeds(&self) -> Result<Vec<Vec<StepInput>>, ProgramError> {
        if self.stages.is_empty() {
            return Err(ProgramError::Plan("has no program".into()));
        }
        let t = &self.training;
        if t.sequence_order.positions(t.seq_len).is_none() {
            return Err(ProgramError::Plan(format!(
                "holds its sequences in the order {:?}, which cannot cut a sequence of {} tokens",
                t.sequence_order, t.seq_len
            )));
        }
        let tokens = t.token_shape(t.micro_batch);
        let mut all = Vec::new();
        for program in &self.stages {
            let mut feeds = Vec::new();
            for slot in &program.inputs {
                let feed = StepInput::from_name(&slot.name)
                    .filter(|&input| input != StepInput::LossScale || t.loss_scaler.is_some())
                    .ok_or_else(|| {
                        ProgramError::Plan(format!(
                            "has an input '{}' the trainer cannot feed (it feeds input_ids, labels, lr, step and, \
                             with a loss scaler, loss_scale)",
                            slot.name
                        ))
                    })?;
                // Context parallelism splits each rank's sequences over their tokens.
                let context_split: usize = (program.mesh.iter().zip(&slot.placements))
                    .filter(|(_, p)| **p == crate::mesh::Placement::Shard(tokens.len() - 1))
                    .map(|(axis, _)| axis.size)
                    .product();
                let mut rank_tokens = tokens.clone();
                *rank_tokens.last_mut().expect("token shapes end with the sequence") /= context_split;
                // A scalar comes in the optimizer's arithmetic type: f64 for an f64 model.
                let (dtype, shape) = if feed.is_tokens() {
                    (DType::I64, &rank_tokens[..])
                } else if slot.dtype == DType::F64 {
                    (DType::F64, &[][..])
                } else {
                    (DType::F32, &[][..])
                };
                if slot.dtype != dtype || slot.shape != shape {
                    return Err(ProgramError::Plan(format!(
                        "input '{}' is {}{:?}; the trainer feeds it as {dtype}{shape:?}",
                        slot.name, slot.dtype, slot.shape
                    )));
                }
                feeds.push(feed);
            }
            all.push(feeds);
        }
        if !all.iter().flatten().any(|f| *f == StepInput::InputIds) {
            return Err(ProgramError::Plan("has no 'input_ids' input".into()));
        }
        if self.stages.iter().any(|p| p.mesh != self.stages[0].mesh) {
            return Err(ProgramError::Plan("has pipeline stages on different meshes".into()));
        }
        self.loss_index()?;
        Ok(all)
    }

    /// The program that computes the loss: the last stage's.
    pub fn loss_stage(&self) -> &Program {
        self.stages.last().expect("a plan has a program")
    }

    /// The position of the loss among the last stage's outputs.
    pub fn loss_index(&self) -> Result<usize, ProgramError> {
        let name = &self.training.loss_output;
        self.loss_stage()
            .outputs
            .iter()
            .position(|s| &s.name == name && s.is_float_scalar())
            .ok_or_else(|| ProgramError::Plan(format!("has no scalar f32 or f64 output '{name}' for the loss")))
    }

    /// Every parameter once, with the first stage holding it (a parameter two stages hold,
    /// such as tied embeddings, has the same value on both).
    pub fn params(&self) -> Vec<(usize, &Slot)> {
        let mut seen = std::collections::BTreeSet::new();
        let mut params = Vec::new();
        for (stage, program) in self.stages.iter().enumerate() {
            for slot in &program.params {
                if seen.insert(slot.name.as_str()) {
                    params.push((stage, slot));
                }
            }
        }
        params
    }

    /// A SHA-256 over the stages' programs: the program's own fingerprint without a pipeline.
    /// What a checkpoint records of the plan that trained it.
    pub fn fingerprint(&self) -> String {
        if let [only] = &self.stages[..] {
            return only.fingerprint();
        }
        joined_fingerprint(&self.stages)
    }

    /// The training programs' [`TrainingPlan::fingerprint`] with the evaluation's: what the
    /// `.atp` file is checked against.
    fn file_fingerprint(&self) -> String {
        match self.evaluation.programs() {
            [] => self.fingerprint(),
            programs => {
                use sha2::Digest;
                let joined = format!("{},{}", self.fingerprint(), joined_fingerprint(programs));
                sha2::Sha256::digest(joined.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
            }
        }
    }

    /// Every program: the training stages', then the evaluation's.
    fn programs(&self) -> impl Iterator<Item = &Program> {
        self.stages.iter().chain(self.evaluation.programs())
    }

    /// Checks that each evaluation program feeds like its stage's training program and holds
    /// the same parameter blocks (the trainer copies them over before it evaluates).
    pub fn check_evaluation(&self) -> Result<(), ProgramError> {
        let programs = self.evaluation.programs();
        if programs.is_empty() {
            return Ok(());
        }
        if programs.len() != self.stages.len() {
            return Err(ProgramError::Plan(format!(
                "has {} evaluation programs for {} stages",
                programs.len(),
                self.stages.len()
            )));
        }
        for (stage, (eval, train)) in programs.iter().zip(&self.stages).enumerate() {
            let mismatch = |what: String| ProgramError::Plan(format!("stage {stage}'s evaluation program {what}"));
            if eval.mesh != train.mesh {
                return Err(mismatch("is on another mesh".into()));
            }
            let held = |slot: &Slot| format!("{}{:?} placed {:?}", slot.dtype, slot.shape, slot.placements);
            for slot in &eval.params {
                match train.params.iter().find(|t| t.name == slot.name) {
                    Some(t) if held(t) == held(slot) && t.global_shape == slot.global_shape => {}
                    Some(t) => {
                        return Err(mismatch(format!(
                            "holds '{}' as {}, its training program as {}",
                            slot.name,
                            held(slot),
                            held(t)
                        )))
                    }
                    None => return Err(mismatch(format!("holds '{}', which its training program lacks", slot.name))),
                }
            }
            for slot in &eval.inputs {
                let fed = train.inputs.iter().find(|t| t.name == slot.name);
                if !fed.is_some_and(|t| t.dtype == slot.dtype && t.shape == slot.shape) {
                    return Err(mismatch(format!("has an input '{}' its training program lacks", slot.name)));
                }
            }
        }
        let last = programs.last().expect("checked non-empty");
        let name = &self.training.loss_output;
        if !last.outputs.iter().any(|s| &s.name == name && s.is_float_scalar()) {
            return Err(ProgramError::Plan(format!("'s evaluation program has no scalar f32 or f64 output '{name}'")));
        }
        Ok(())
    }

    /// Parameters plus states, in bytes: what a checkpoint holds.
    pub fn model_state_bytes(&self) -> usize {
        let params: usize = self.params().iter().map(|(_, s)| s.region.len).sum();
        params + self.stages.iter().flat_map(|p| &p.states).map(|s| s.region.len).sum::<usize>()
    }
}

/// A SHA-256 over several programs' fingerprints.
fn joined_fingerprint(programs: &[Program]) -> String {
    use sha2::Digest;
    let joined: Vec<String> = programs.iter().map(Program::fingerprint).collect();
    sha2::Sha256::digest(joined.join(",").as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Constant `index` of the plan's program `program` (training stages first, then evaluation).
fn constant_name(program: usize, index: usize) -> String {
    format!("{CONSTANT_PREFIX}{program}.{index}")
}

/// Writes `plan` and the initial `weights` (by parameter name) as an `.atp` file, atomically;
/// the parameters `references` names are not copied but named where they are
/// ([`crate::weight_files`]), and must hold the same bytes there.
pub fn write(
    path: &Path,
    plan: &TrainingPlan,
    weights: &BTreeMap<String, &[u8]>,
    references: &BTreeMap<String, WeightReference>,
) -> Result<(), ProgramError> {
    for program in plan.programs() {
        program.validate()?;
    }
    plan.feeds()?;
    plan.check_evaluation()?;
    let fingerprint = plan.file_fingerprint();
    let mut header = plan.clone();
    let constants: Vec<Vec<crate::ConstantData>> = (header.stages.iter_mut())
        .chain(header.evaluation.programs_mut())
        .map(|p| std::mem::take(&mut p.constants))
        .collect();
    let mut tensors = Vec::new();
    for (_, slot) in plan.params() {
        if slot.name.starts_with(CONSTANT_PREFIX) {
            return Err(ProgramError::Plan(format!("parameter '{}' uses a name reserved for constants", slot.name)));
        }
        let bytes = weights
            .get(&slot.name)
            .ok_or_else(|| ProgramError::Plan(format!("parameter '{}' has no initial weights", slot.name)))?;
        let dtype = plan.training.initial_weights_dtype(slot);
        let expected = slot.global_shape.iter().product::<usize>() * dtype.size();
        if bytes.len() != expected {
            return Err(ProgramError::WrongSize {
                what: format!("the weights of '{}'", slot.name),
                expected,
                got: bytes.len(),
            });
        }
        if !references.contains_key(&slot.name) {
            tensors.push(TensorRef { name: slot.name.clone(), dtype, shape: slot.global_shape.clone(), bytes });
        }
    }
    let weight_files = WeightFiles::record(references)?;
    // The header keeps each constant's region; its bytes become a tensor.
    let mut regions = Vec::with_capacity(constants.len());
    for (stage, stage_constants) in constants.iter().enumerate() {
        let mut stage_regions = Vec::with_capacity(stage_constants.len());
        for (i, c) in stage_constants.iter().enumerate() {
            let name = constant_name(stage, i);
            tensors.push(TensorRef { name, dtype: DType::U8, shape: vec![c.bytes.len()], bytes: &c.bytes });
            stage_regions.push(c.region);
        }
        regions.push(stage_regions);
    }
    let plan_json = serde_json::json!({ "plan": header, "constant_regions": regions });
    let weight_files = serde_json::to_string(&weight_files).expect("serialisable");
    let metadata = BTreeMap::from([
        ("autotp.format".to_string(), FORMAT.to_string()),
        ("autotp.plan".to_string(), plan_json.to_string()),
        ("autotp.fingerprint".to_string(), with_weight_files(&fingerprint, &weight_files)),
        ("autotp.weight_files".to_string(), weight_files),
    ]);
    tensor_file::write(path, &tensors, metadata)
}

/// The fingerprint a file records: the programs' with the record of its weights files.
fn with_weight_files(fingerprint: &str, weight_files: &str) -> String {
    use sha2::Digest;
    let joined = format!("{fingerprint},{weight_files}");
    sha2::Sha256::digest(joined.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// An opened `.atp` file: the plan, and the initial weights still memory-mapped (in the file,
/// or in the weights files it names).
pub struct PlanFile {
    pub plan: TrainingPlan,
    pub fingerprint: String,
    file: TensorFile,
    weight_files: WeightFiles,
    weight_maps: Vec<memmap2::Mmap>,
}

impl PlanFile {
    /// Opens the plan at `path`, its tensors checked against their checksums.
    pub fn open(path: &Path) -> Result<PlanFile, ProgramError> {
        PlanFile::open_checked(path, true)
    }

    /// Opens the plan at `path`; with `verify`, every tensor it holds (constants, embedded
    /// weights) checked against the CRC-32C it was written with ([`TensorFile::verify`]).
    pub fn open_checked(path: &Path, verify: bool) -> Result<PlanFile, ProgramError> {
        let file = TensorFile::open(path)?;
        if verify {
            file.verify()?;
        }
        let bad = |message: String| ProgramError::File { path: path.to_path_buf(), message };
        match file.metadata("autotp.format") {
            Some(FORMAT) => {}
            Some(other) => {
                return Err(bad(format!(
                    "is a plan of format '{other}'; this autotp reads '{FORMAT}': compile the model again"
                )))
            }
            None => return Err(bad("is not an autotp plan (no autotp.format in its header)".into())),
        }
        #[derive(Deserialize)]
        struct Header {
            plan: TrainingPlan,
            constant_regions: Vec<Vec<crate::Region>>,
        }
        let json = file.metadata("autotp.plan").ok_or_else(|| bad("has no autotp.plan in its header".into()))?;
        let Header { mut plan, constant_regions } =
            serde_json::from_str(json).map_err(|e| bad(format!("its plan does not parse: {e}")))?;
        let programs = plan.stages.len() + plan.evaluation.programs().len();
        if constant_regions.len() != programs {
            return Err(bad("is damaged: its constants do not match its programs".into()));
        }
        let all = plan.stages.iter_mut().chain(plan.evaluation.programs_mut());
        for (p, (program, regions)) in all.zip(constant_regions).enumerate() {
            for (i, region) in regions.into_iter().enumerate() {
                let bytes = file.expect(&constant_name(p, i), DType::U8, &[region.len])?.to_vec();
                program.constants.push(crate::ConstantData { region, bytes });
            }
        }
        let recorded = file.metadata("autotp.weight_files").unwrap_or("{}");
        if file.metadata("autotp.fingerprint") != Some(with_weight_files(&plan.file_fingerprint(), recorded).as_str()) {
            return Err(bad("is damaged: its program does not match the fingerprint it was written with".into()));
        }
        let weight_files: WeightFiles =
            serde_json::from_str(recorded).map_err(|e| bad(format!("its autotp.weight_files does not parse: {e}")))?;
        for program in plan.programs() {
            program.validate()?;
        }
        plan.feeds()?;
        plan.check_evaluation()?;
        let fingerprint = plan.fingerprint();
        let weight_maps = weight_files.open()?;
        for (_, slot) in plan.params() {
            let dtype = plan.training.initial_weights_dtype(slot);
            match weight_files.tensors.get(&slot.name) {
                None => {
                    file.expect(&slot.name, dtype, &slot.global_shape)?;
                }
                Some(&(index, offset)) => {
                    let length = slot.global_shape.iter().product::<usize>() * dtype.size();
                    let (map, weights_file) =
                        weight_maps.get(index).zip(weight_files.files.get(index)).ok_or_else(|| {
                            bad(format!("names weights file {index} for '{}', which it does not list", slot.name))
                        })?;
                    if offset.checked_add(length as u64).is_none_or(|end| end > map.len() as u64) {
                        return Err(ProgramError::File {
                            path: weights_file.path.clone(),
                            message: format!("holds no {length} bytes at {offset} for '{}'", slot.name),
                        });
                    }
                }
            }
        }
        Ok(PlanFile { plan, fingerprint, file, weight_files, weight_maps })
    }

    /// The initial weights, by parameter name, as slices of the file or of the weights files it
    /// names.
    pub fn weights(&self) -> BTreeMap<String, &[u8]> {
        let bytes = |slot: &Slot| match self.weight_files.tensors.get(&slot.name) {
            Some(&(index, offset)) => {
                let length =
                    slot.global_shape.iter().product::<usize>() * self.plan.training.initial_weights_dtype(slot).size();
                &self.weight_maps[index][offset as usize..offset as usize + length]
            }
            None => self.file.get(&slot.name).expect("checked at open").bytes,
        };
        self.plan.params().into_iter().map(|(_, slot)| (slot.name.clone(), bytes(slot))).collect()
    }

    /// The weights files the plan reads its initial weights from (none when it carries them).
    pub fn weight_files(&self) -> &[crate::weight_files::WeightFile] {
        &self.weight_files.files
    }
}
