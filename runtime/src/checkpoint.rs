//! Checkpoints: `--save DIR` keeps one directory per saved step plus a pointer to the newest,
//! as DeepSpeed does:
//!
//! ```text
//! DIR/latest                          "step-00000015"
//! DIR/step-00000015/manifest.json     step, plan fingerprint, model, training config, data
//!                                     position, RNG state, which tensor is in which file
//! DIR/step-00000015/model.safetensors       parameters, by ONNX initializer name
//! DIR/step-00000015/optimizer.safetensors   optimizer state (adamw.m.<p>, adamw.v.<p>, ...)
//! ```
//!
//! A save is atomic: it fills `DIR/.tmp-step-...` (every file fsynced), renames it to
//! `step-...`, fsyncs DIR, and only then replaces `latest` (temporary file, fsync, rename). A
//! process killed at any point leaves `latest` naming a complete checkpoint; the next save
//! removes the leftovers. Opening DIR follows `latest`, and falls back to the newest complete
//! step directory if `latest` names one that is gone.
//!
//! Fault injection for tests: with `AUTOTP_CRASH_DURING_CHECKPOINT=N` in the environment, the
//! save of step N aborts the process after writing the parameters, before the rest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::plan::{ModelSource, TrainingConfig};
use crate::tensor_file::{self, io_error, TensorFile, TensorRef};
use crate::RuntimeError;

/// The checkpoint format this build reads and writes.
pub const FORMAT: &str = "autotp-checkpoint/1";
pub const LATEST: &str = "latest";
pub const MANIFEST: &str = "manifest.json";
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const TEMPORARY_PREFIX: &str = ".tmp-";
const CRASH_VARIABLE: &str = "AUTOTP_CRASH_DURING_CHECKPOINT";

/// Where the data stream stands after `step` steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    pub path: PathBuf,
    pub dtype: String,
    pub tokens: usize,
    pub windows: usize,
    /// The first window of the next step: (step x global batch) mod windows.
    pub next_window: usize,
}

/// The random-number state: the run's seed. Programs draw no random numbers yet (dropout with a
/// non-zero ratio is refused at compile time); random ops are to draw from a counter-based
/// generator keyed by (seed, step), so the seed and the step restore the state exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RngState {
    pub seed: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// Optimizer steps completed.
    pub step: usize,
    /// The fingerprint of the program that wrote it; only the same program may resume it.
    pub plan_fingerprint: String,
    pub model: ModelSource,
    pub training: TrainingConfig,
    /// The run's `--steps` (the length of a schedule that decays over the run).
    pub train_steps: usize,
    pub data: DataPosition,
    pub rng: RngState,
    /// Each file of the checkpoint and the tensors it holds.
    pub files: BTreeMap<String, Vec<String>>,
}

/// The directory name of the checkpoint of `step`.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

fn checkpoint_error(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Checkpoint { path: path.to_path_buf(), message: message.into() }
}

/// Saves `model` (parameters) and `optimizer` (states) under `dir`, atomically, and points
/// `latest` at them. With `keep_last`, older step directories beyond that many are removed.
/// Returns the new step directory.
pub fn save(
    dir: &Path,
    manifest: &Manifest,
    model: &[TensorRef],
    optimizer: &[TensorRef],
    keep_last: Option<usize>,
) -> Result<PathBuf, RuntimeError> {
    std::fs::create_dir_all(dir).map_err(io_error(dir, "create"))?;
    remove_leftovers(dir)?;
    let name = step_dir_name(manifest.step);
    let staging = dir.join(format!("{TEMPORARY_PREFIX}{name}-{}", std::process::id()));
    std::fs::create_dir(&staging).map_err(io_error(&staging, "create"))?;

    let mut manifest = manifest.clone();
    manifest.files = BTreeMap::from([
        (MODEL_FILE.to_string(), model.iter().map(|t| t.name.clone()).collect()),
        (OPTIMIZER_FILE.to_string(), optimizer.iter().map(|t| t.name.clone()).collect()),
    ]);
    tensor_file::write(&staging.join(MODEL_FILE), model, BTreeMap::new())?;
    if std::env::var(CRASH_VARIABLE).ok().and_then(|v| v.parse::<usize>().ok()) == Some(manifest.step) {
        eprintln!("{CRASH_VARIABLE}={}: aborting while writing {}", manifest.step, staging.display());
        std::process::abort();
    }
    tensor_file::write(&staging.join(OPTIMIZER_FILE), optimizer, BTreeMap::new())?;
    let json = serde_json::to_vec_pretty(&manifest).expect("a manifest always serializes");
    tensor_file::write_atomic(&staging.join(MANIFEST), &json)?;
    tensor_file::sync_dir(&staging)?;

    let target = dir.join(&name);
    if target.exists() {
        // Saving a step again (a resumed run): the old directory moves aside first, since a
        // rename cannot replace a non-empty directory.
        let replaced = dir.join(format!("{TEMPORARY_PREFIX}replaced-{name}-{}", std::process::id()));
        std::fs::rename(&target, &replaced).map_err(io_error(&target, "replace"))?;
    }
    std::fs::rename(&staging, &target).map_err(io_error(&target, "write"))?;
    tensor_file::sync_dir(dir)?;
    tensor_file::write_atomic(&dir.join(LATEST), name.as_bytes())?;
    remove_leftovers(dir)?;
    if let Some(keep) = keep_last {
        let mut steps = complete_steps(dir)?;
        steps.retain(|&(step, _)| step != manifest.step);
        let excess = (steps.len() + 1).saturating_sub(keep.max(1));
        for (_, old) in steps.into_iter().take(excess) {
            std::fs::remove_dir_all(&old).map_err(io_error(&old, "remove"))?;
        }
    }
    Ok(target)
}

/// Removes staging directories and temporary files a killed save left behind.
fn remove_leftovers(dir: &Path) -> Result<(), RuntimeError> {
    for entry in std::fs::read_dir(dir).map_err(io_error(dir, "read"))? {
        let entry = entry.map_err(io_error(dir, "read"))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(TEMPORARY_PREFIX) || name.starts_with(&format!(".{LATEST}.tmp-")) {
            let path = entry.path();
            let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed.map_err(io_error(&path, "remove"))?;
        }
    }
    Ok(())
}

/// The step directories under `dir` that have a manifest, oldest first.
fn complete_steps(dir: &Path) -> Result<Vec<(usize, PathBuf)>, RuntimeError> {
    let mut steps = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error(dir, "read"))? {
        let entry = entry.map_err(io_error(dir, "read"))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse::<usize>().ok()) else { continue };
        if entry.path().join(MANIFEST).is_file() {
            steps.push((step, entry.path()));
        }
    }
    steps.sort();
    Ok(steps)
}

/// The step directory `path` names: itself if it holds a manifest, else what its `latest`
/// points to (or its newest complete step directory).
pub fn resolve(path: &Path) -> Result<PathBuf, RuntimeError> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(checkpoint_error(path, "does not exist or is not a directory"));
    }
    if let Ok(name) = std::fs::read_to_string(path.join(LATEST)) {
        let named = path.join(name.trim());
        if named.join(MANIFEST).is_file() {
            return Ok(named);
        }
        tracing::warn!(
            "{}: 'latest' names {}, which is incomplete; using the newest complete one",
            path.display(),
            name.trim()
        );
    }
    complete_steps(path)?
        .pop()
        .map(|(_, dir)| dir)
        .ok_or_else(|| checkpoint_error(path, "holds no checkpoint (no manifest.json, no complete step directory)"))
}

/// An opened checkpoint: its manifest and its tensor files, memory-mapped.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub manifest: Manifest,
    files: BTreeMap<String, TensorFile>,
}

impl Checkpoint {
    /// Opens the checkpoint at `path` (a save directory or one step directory) and checks that
    /// every tensor its manifest lists is there.
    pub fn open(path: &Path) -> Result<Checkpoint, RuntimeError> {
        let dir = resolve(path)?;
        let manifest_path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&manifest_path).map_err(io_error(&manifest_path, "read"))?;
        let format = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("format").and_then(|f| f.as_str().map(str::to_string)));
        if format.as_deref() != Some(FORMAT) {
            return Err(checkpoint_error(&dir, format!("has format {format:?}; this autotp reads '{FORMAT}'")));
        }
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| checkpoint_error(&manifest_path, format!("the manifest does not parse: {e}")))?;
        let mut files = BTreeMap::new();
        for (file, names) in &manifest.files {
            if file.contains('/') || file.contains("..") {
                return Err(checkpoint_error(&dir, format!("the manifest names a file outside it: '{file}'")));
            }
            let opened = TensorFile::open(&dir.join(file))?;
            if let Some(missing) = names.iter().find(|n| opened.get(n).is_none()) {
                return Err(checkpoint_error(&dir, format!("{file} lacks the tensor '{missing}' its manifest lists")));
            }
            files.insert(file.clone(), opened);
        }
        Ok(Checkpoint { dir, manifest, files })
    }

    /// A tensor by name, from whichever file holds it.
    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        self.files.values().find_map(|f| f.get(name))
    }

    /// The parameters (the model file's tensors), by name.
    pub fn params(&self) -> Vec<TensorRef<'_>> {
        let names = self.manifest.files.get(MODEL_FILE).map(Vec::as_slice).unwrap_or_default();
        names.iter().filter_map(|n| self.tensor(n)).collect()
    }
}
