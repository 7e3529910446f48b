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
//! A run on a mesh saves each rank's shards instead, `rank-00003.safetensors` per rank: the
//! blocks of parameters and states that rank holds, each written by one rank only (a block
//! replicated over an axis is written by that axis's rank 0). The manifest records each tensor's
//! global shape and each block's offset; reading a tensor assembles it ([`Checkpoint::tensor`]),
//! which is how `export` consolidates and how a resume loads.
//!
//! A save is atomic: it fills `DIR/.tmp-step-...` (every file fsynced), renames it to
//! `step-...`, fsyncs DIR, and only then replaces `latest` (temporary file, fsync, rename). A
//! process killed at any point leaves `latest` naming a complete checkpoint; the next save
//! removes the leftovers. Opening DIR follows `latest`, and falls back to the newest complete
//! step directory if `latest` names one that is gone. A save that fails (a full disk, a file
//! too large for a quota, the directory gone) removes its staging directory and stops the run
//! with one error naming the file, the cause and the checkpoint `--resume` takes instead
//! ([`abandoned`]).
//!
//! Fault injection for tests: with `AUTOTP_CRASH_DURING_CHECKPOINT=N` in the environment, the
//! save of step N aborts the process after writing the parameters, before the rest.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::TrainError;
use autotp_program::plan::{ModelSource, TrainingConfig};
use autotp_program::tensor_file::{self, io_error, TensorFile, TensorRef};

/// The checkpoint format this build reads and writes.
pub const FORMAT: &str = "autotp-checkpoint/1";
pub const LATEST: &str = "latest";
pub const MANIFEST: &str = "manifest.json";
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const TEMPORARY_PREFIX: &str = ".tmp-";
const CRASH_VARIABLE: &str = "AUTOTP_CRASH_DURING_CHECKPOINT";
const STOP_VARIABLE: &str = "AUTOTP_STOP_DURING_CHECKPOINT";

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
    /// The parameters among the tensors (the rest are optimizer state).
    #[serde(default)]
    pub params: Vec<String>,
    /// Global shape of every tensor saved in blocks.
    #[serde(default)]
    pub shapes: BTreeMap<String, Vec<usize>>,
    /// For a file of blocks: where each of its tensors starts in the global tensor.
    #[serde(default)]
    pub blocks: BTreeMap<String, BTreeMap<String, Vec<usize>>>,
    /// fp16's loss scaler as it stood after the last step.
    #[serde(default)]
    pub loss_scaler: Option<autotp_program::loss_scale::LossScaler>,
    /// Steps whose update was skipped for non-finite gradients (counted in `step`, not in the
    /// optimizer's steps).
    #[serde(default)]
    pub skipped_steps: usize,
    /// The CRC-32C (hex) of this manifest as written without it ([`manifest_checksum`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
}

/// The CRC-32C of `manifest` written without its checksum, as hex.
pub fn manifest_checksum(manifest: &Manifest) -> String {
    let unsigned = Manifest { checksum: None, ..manifest.clone() };
    let json = serde_json::to_vec_pretty(&unsigned).expect("a manifest always serializes");
    format!("{:08x}", crc32c::crc32c(&json))
}

/// A tensor to save: its bytes, and (for a block of a sharded tensor) where it lies in the
/// global tensor of `global_shape`.
pub struct SavedBlock<'a> {
    pub tensor: TensorRef<'a>,
    pub offsets: Option<(Vec<usize>, Vec<usize>)>,
}

/// A tensor read from a checkpoint, assembled from its blocks when it was saved sharded.
#[derive(Clone, Debug)]
pub struct StoredTensor<'a> {
    pub name: String,
    pub dtype: autotp_kernels::DType,
    pub shape: Vec<usize>,
    pub bytes: std::borrow::Cow<'a, [u8]>,
}

/// Model tensors from plan tensors: the parts of a weight (`TrainingConfig::weight_parts`,
/// parameters and their optimizer states) joined into it, in the place of its first part; all
/// else as it is.
pub fn join_parts<'a>(training: &TrainingConfig, tensors: Vec<StoredTensor<'a>>) -> Vec<StoredTensor<'a>> {
    let mut joined: Vec<StoredTensor<'a>> = Vec::new();
    for t in tensors {
        let Some((name, part)) = training.part_of(&t.name) else {
            joined.push(t);
            continue;
        };
        let size = t.dtype.size();
        let at = match joined.iter().position(|j| j.name == name) {
            Some(at) => at,
            None => {
                let bytes = vec![0u8; part.weight_shape.iter().product::<usize>() * size];
                let shape = part.weight_shape.clone();
                joined.push(StoredTensor { name, dtype: t.dtype, shape, bytes: bytes.into() });
                joined.len() - 1
            }
        };
        let mut offsets = vec![0; part.weight_shape.len()];
        offsets[part.dim] = part.start;
        let whole = &mut joined[at];
        autotp_kernels::shape::insert_block(&whole.shape, &offsets, &t.shape, size, &t.bytes, whole.bytes.to_mut());
    }
    joined
}

/// The directory name of the checkpoint of `step`.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

fn checkpoint_error(path: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint { path: path.to_path_buf(), message: message.into() }
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
) -> Result<PathBuf, TrainError> {
    fn whole<'a>(tensors: &[TensorRef<'a>]) -> Vec<SavedBlock<'a>> {
        tensors.iter().map(|t| SavedBlock { tensor: t.clone(), offsets: None }).collect()
    }
    let params = model.iter().map(|t| t.name.clone()).collect();
    let files = vec![(MODEL_FILE.to_string(), whole(model)), (OPTIMIZER_FILE.to_string(), whole(optimizer))];
    save_files(dir, manifest, params, files, keep_last)
}

/// Which tensors a checkpoint file holds: each one's name and, for a block of a sharded tensor,
/// its offsets in the global tensor and the global shape.
pub type FileLayout = (String, Vec<(String, Option<(Vec<usize>, Vec<usize>)>)>);

/// Saves named files of tensors or blocks (a sharded run's per-rank files) as [`save`] does.
/// `params` names the parameters among them.
pub fn save_files(
    dir: &Path,
    manifest: &Manifest,
    params: Vec<String>,
    files: Vec<(String, Vec<SavedBlock<'_>>)>,
    keep_last: Option<usize>,
) -> Result<PathBuf, TrainError> {
    let layout: Vec<FileLayout> = files
        .iter()
        .map(|(file, blocks)| {
            (file.clone(), blocks.iter().map(|b| (b.tensor.name.clone(), b.offsets.clone())).collect())
        })
        .collect();
    let staging =
        stage(dir, manifest.step, std::process::id().into()).map_err(|e| abandoned(dir, None, manifest.step, e))?;
    let written = files.iter().enumerate().try_for_each(|(i, (file, blocks))| {
        write_file(&staging, file, blocks)?;
        if i == 0 {
            crash_if_asked(manifest.step, &staging);
        }
        Ok(())
    });
    written
        .and_then(|()| commit(dir, &staging, &with_layout(manifest, params, &layout), keep_last))
        .map_err(|e| abandoned(dir, Some(&staging), manifest.step, e))
}

/// The error of a save of `step` under `dir` that failed with `error` (a full disk, the
/// directory gone): its staging directory is removed first, so that a full disk gets the space
/// back, and the message names the checkpoint `--resume` takes instead, which the failed save
/// left as it was.
pub fn abandoned(dir: &Path, staging: Option<&Path>, step: usize, error: TrainError) -> TrainError {
    if let Some(staging) = staging {
        // Best effort: the save's own error is the one to report, and the next save removes
        // what is left.
        let _ = std::fs::remove_dir_all(staging);
    }
    let kept = match resolve(dir) {
        Ok(kept) => format!("--resume takes {}, which is intact", kept.display()),
        Err(_) => "no earlier checkpoint is there".to_string(),
    };
    checkpoint_error(dir, format!("step {step} not saved: {error}; {kept}"))
}

/// Prepares a save of `step` under `dir` (created if missing, a killed save's leftovers
/// removed) and returns the staging directory its files go to; `job` tells apart the staging
/// directories of two runs saving to one place (a process id; rank 0's, in a job of several).
pub fn stage(dir: &Path, step: usize, job: u64) -> Result<PathBuf, TrainError> {
    std::fs::create_dir_all(dir).map_err(io_error(dir, "create"))?;
    remove_leftovers(dir)?;
    let staging = staging_dir(dir, step, job);
    std::fs::create_dir(&staging).map_err(io_error(&staging, "create"))?;
    Ok(staging)
}

/// The staging directory [`stage`] makes.
pub fn staging_dir(dir: &Path, step: usize, job: u64) -> PathBuf {
    dir.join(format!("{TEMPORARY_PREFIX}{}-{job}", step_dir_name(step)))
}

/// Writes one file of a save into its staging directory.
pub fn write_file(staging: &Path, file: &str, blocks: &[SavedBlock<'_>]) -> Result<(), TrainError> {
    let tensors: Vec<TensorRef> = blocks.iter().map(|b| b.tensor.clone()).collect();
    Ok(tensor_file::write(&staging.join(file), &tensors, BTreeMap::new())?)
}

/// The test hook: with `AUTOTP_CRASH_DURING_CHECKPOINT=step`, aborts the process.
pub fn crash_if_asked(step: usize, staging: &Path) {
    if std::env::var(CRASH_VARIABLE).ok().and_then(|v| v.parse::<usize>().ok()) == Some(step) {
        eprintln!("{CRASH_VARIABLE}={step}: aborting while writing {}", staging.display());
        std::process::abort();
    }
}

/// The test hook of a rank stopped mid-save: with `AUTOTP_STOP_DURING_CHECKPOINT=RANK:STEP`, the
/// process of rank RANK stops itself (SIGSTOP) once it has written its file of step STEP.
pub fn stop_if_asked(rank: usize, step: usize) {
    let asked = std::env::var(STOP_VARIABLE).ok();
    let asked = asked.as_deref().and_then(|v| v.split_once(':'));
    if asked.and_then(|(r, s)| Some((r.parse::<usize>().ok()?, s.parse::<usize>().ok()?))) == Some((rank, step)) {
        eprintln!("{STOP_VARIABLE}={rank}:{step}: rank {rank} stops");
        // SAFETY: raise only sends a signal to this process.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
}

/// `manifest` listing the files of `layout`, and `params` as the parameters among them.
pub fn with_layout(manifest: &Manifest, params: Vec<String>, layout: &[FileLayout]) -> Manifest {
    let mut manifest = manifest.clone();
    manifest.params = params;
    manifest.files =
        layout.iter().map(|(f, tensors)| (f.clone(), tensors.iter().map(|t| t.0.clone()).collect())).collect();
    for (file, tensors) in layout {
        for (name, offsets) in tensors {
            if let Some((offsets, global)) = offsets {
                manifest.shapes.insert(name.clone(), global.clone());
                manifest.blocks.entry(file.clone()).or_default().insert(name.clone(), offsets.clone());
            }
        }
    }
    manifest
}

/// Makes the files in `staging` the checkpoint `manifest` describes: writes the manifest,
/// renames the directory into place, points `latest` at it and removes checkpoints beyond
/// `keep_last`. Returns the step directory.
pub fn commit(
    dir: &Path,
    staging: &Path,
    manifest: &Manifest,
    keep_last: Option<usize>,
) -> Result<PathBuf, TrainError> {
    let name = step_dir_name(manifest.step);
    let signed = Manifest { checksum: Some(manifest_checksum(manifest)), ..manifest.clone() };
    let json = serde_json::to_vec_pretty(&signed).expect("a manifest always serializes");
    tensor_file::write_atomic(&staging.join(MANIFEST), &json)?;
    tensor_file::sync_dir(staging)?;

    let target = dir.join(&name);
    if target.exists() {
        // Saving a step again (a resumed run): the old directory moves aside first, since a
        // rename cannot replace a non-empty directory.
        let replaced = dir.join(format!("{TEMPORARY_PREFIX}replaced-{name}-{}", std::process::id()));
        std::fs::rename(&target, &replaced).map_err(io_error(&target, "replace"))?;
    }
    std::fs::rename(staging, &target).map_err(io_error(&target, "write"))?;
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
fn remove_leftovers(dir: &Path) -> Result<(), TrainError> {
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
fn complete_steps(dir: &Path) -> Result<Vec<(usize, PathBuf)>, TrainError> {
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
pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(checkpoint_error(path, "does not exist or is not a directory"));
    }
    if let Ok(name) = std::fs::read_to_string(path.join(LATEST)) {
        let named = autotp_program::folder_paths::inside_folder(path, name.trim()).map_err(|why| {
            checkpoint_error(&path.join(LATEST), format!("names the step directory '{}', which {why}", name.trim()))
        })?;
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
    pub fn open(path: &Path) -> Result<Checkpoint, TrainError> {
        Checkpoint::open_checked(path, true)
    }

    /// [`Checkpoint::open`]; with `verify`, the manifest and every tensor are checked against
    /// the CRC-32C they were written with, naming the file and tensor that differ.
    pub fn open_checked(path: &Path, verify: bool) -> Result<Checkpoint, TrainError> {
        let dir = resolve(path)?;
        let manifest_path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&manifest_path).map_err(io_error(&manifest_path, "read"))?;
        let json = serde_json::from_str::<serde_json::Value>(&text)
            .map_err(|e| checkpoint_error(&manifest_path, format!("is not JSON (damaged?): {e}")))?;
        match json.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT) => {}
            Some(other) => {
                return Err(checkpoint_error(&dir, format!("has format '{other}'; this autotp reads '{FORMAT}'")))
            }
            None => return Err(checkpoint_error(&manifest_path, format!("names no format ('{FORMAT}' expected)"))),
        }
        let manifest: Manifest = serde_json::from_value(json)
            .map_err(|e| checkpoint_error(&manifest_path, format!("the manifest does not parse: {e}")))?;
        if verify {
            if let Some(written) = &manifest.checksum {
                let computed = manifest_checksum(&manifest);
                if *written != computed {
                    return Err(checkpoint_error(
                        &manifest_path,
                        format!(
                            "is damaged: its CRC-32C is {computed}, written {written} (--no-verify reads it anyway)"
                        ),
                    ));
                }
            }
        }
        let mut files = BTreeMap::new();
        for (file, names) in &manifest.files {
            let path = autotp_program::folder_paths::inside_folder(&dir, file)
                .map_err(|why| checkpoint_error(&manifest_path, format!("names the file '{file}', which {why}")))?;
            let opened = TensorFile::open(&path)?;
            if verify {
                opened.verify()?;
            }
            if let Some(missing) = names.iter().find(|n| opened.get(n).is_none()) {
                return Err(checkpoint_error(&dir, format!("{file} lacks the tensor '{missing}' its manifest lists")));
            }
            files.insert(file.clone(), opened);
        }
        Ok(Checkpoint { dir, manifest, files })
    }

    /// A tensor by name: as stored, or assembled from its blocks. Parameters saved in a view of
    /// their model shape (`TrainingConfig::weight_shapes`) come back in the model shape.
    pub fn tensor(&self, name: &str) -> Option<StoredTensor<'_>> {
        let holders: Vec<(&String, TensorRef<'_>)> =
            self.files.iter().filter_map(|(file, f)| f.get(name).map(|t| (file, t))).collect();
        let Some((_, first)) = holders.first() else {
            // A model weight the plan trained in parts.
            let stored: BTreeSet<&String> = self.manifest.files.values().flatten().collect();
            let parts: Vec<StoredTensor<'_>> = stored
                .into_iter()
                .filter(|t| self.manifest.training.part_of(t).is_some_and(|(joined, _)| joined == name))
                .map(|t| self.tensor(t))
                .collect::<Option<_>>()?;
            return join_parts(&self.manifest.training, parts).into_iter().next();
        };
        let shape = self.manifest.training.weight_shapes.get(name).cloned();
        let Some(global) = self.manifest.shapes.get(name) else {
            let shape = shape.unwrap_or_else(|| first.shape.clone());
            return Some(StoredTensor { name: name.into(), dtype: first.dtype, shape, bytes: first.bytes.into() });
        };
        let size = first.dtype.size();
        let mut bytes = vec![0u8; global.iter().product::<usize>() * size];
        for (file, block) in &holders {
            let offsets = self.manifest.blocks.get(*file)?.get(name)?;
            autotp_kernels::shape::insert_block(global, offsets, &block.shape, size, block.bytes, &mut bytes);
        }
        let shape = shape.unwrap_or_else(|| global.clone());
        Some(StoredTensor { name: name.into(), dtype: first.dtype, shape, bytes: bytes.into() })
    }

    /// A stored tensor's dtype and shape as the model has it, without reading it (`None` when
    /// the checkpoint lacks it; a weight stored in parts is not one tensor here).
    pub fn stored_type(&self, name: &str) -> Option<(autotp_kernels::DType, Vec<usize>)> {
        let first = self.files.values().find_map(|f| f.get(name))?;
        let shape = (self.manifest.training.weight_shapes.get(name))
            .or_else(|| self.manifest.shapes.get(name))
            .cloned()
            .unwrap_or(first.shape);
        Some((first.dtype, shape))
    }

    /// The block at `offsets` with `extent` of tensor `name`, read as a tensor of `shape` (its
    /// global shape in the plan, which may be a view of the stored one: same elements, same
    /// order), into `block`: only the stored bytes that fall in it are read, so a rank resuming
    /// reads its own block and nothing of the others'. `None` when the checkpoint lacks the
    /// tensor or its blocks do not cover the one asked for.
    pub fn read_block(
        &self,
        name: &str,
        shape: &[usize],
        offsets: &[usize],
        extent: &[usize],
        block: &mut [u8],
    ) -> Option<()> {
        use autotp_kernels::shape::{extract_block, insert_block};
        let holders: Vec<(&String, TensorRef<'_>)> =
            self.files.iter().filter_map(|(file, f)| f.get(name).map(|t| (file, t))).collect();
        let size = holders.first()?.1.dtype.size();
        if block.len() != extent.iter().product::<usize>() * size {
            return None;
        }
        let Some(written) = self.manifest.shapes.get(name) else {
            // Stored whole.
            let (_, whole) = holders.first()?;
            if whole.bytes.len() != shape.iter().product::<usize>() * size {
                return None;
            }
            extract_block(shape, offsets, extent, size, whole.bytes, block);
            return Some(());
        };
        if written.len() != shape.len() {
            // Blocks of another view of the tensor (a plan of another layout computing with
            // `[in, 3, heads]` where this one has `[in, 3 heads]`): the same bytes whole, then
            // this block of them.
            let whole = self.tensor(name)?;
            if whole.bytes.len() != shape.iter().product::<usize>() * size {
                return None;
            }
            extract_block(shape, offsets, extent, size, &whole.bytes, block);
            return Some(());
        }
        let mut covered = 0;
        for (file, stored) in holders {
            let at = self.manifest.blocks.get(file)?.get(name)?;
            // The part of the stored block inside the one asked for.
            let low: Vec<usize> = at.iter().zip(offsets).map(|(&a, &o)| a.max(o)).collect();
            if stored.shape.len() != shape.len() || at.len() != shape.len() {
                return None;
            }
            let high: Vec<usize> =
                (0..shape.len()).map(|d| (at[d] + stored.shape[d]).min(offsets[d] + extent[d])).collect();
            if low.iter().zip(&high).any(|(l, h)| l >= h) {
                continue;
            }
            let part: Vec<usize> = low.iter().zip(&high).map(|(l, h)| h - l).collect();
            let from: Vec<usize> = low.iter().zip(at).map(|(l, a)| l - a).collect();
            let to: Vec<usize> = low.iter().zip(offsets).map(|(l, o)| l - o).collect();
            let mut piece = vec![0u8; part.iter().product::<usize>() * size];
            extract_block(&stored.shape, &from, &part, size, stored.bytes, &mut piece);
            insert_block(extent, &to, &part, size, &piece, block);
            covered += piece.len();
        }
        (covered == block.len()).then_some(())
    }

    /// The parameters, by name.
    pub fn params(&self) -> Vec<StoredTensor<'_>> {
        self.manifest.params.iter().filter_map(|n| self.tensor(n)).collect()
    }

    /// The optimizer's states (every saved tensor not a parameter), by name.
    pub fn states(&self) -> Vec<StoredTensor<'_>> {
        let saved: BTreeSet<&String> = self.manifest.files.values().flatten().collect();
        saved.into_iter().filter(|n| !self.manifest.params.contains(n)).filter_map(|n| self.tensor(n)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use autotp_kernels::DType;

    fn manifest(step: usize) -> Manifest {
        serde_json::from_value(serde_json::json!({
            "format": FORMAT, "step": step, "plan_fingerprint": "f",
            "model": {"name": "m", "path": "/m.onnx"},
            "training": {
                "seq_len": 4, "micro_batch": 1, "global_batch": 1, "labels": "next_tokens",
                "loss_output": "loss", "optimizer": "sgd", "schedule": {"kind": "constant", "lr": 0.1},
                "grad_clip": null, "frozen": []
            },
            "train_steps": 1,
            "data": {"path": "/t.bin", "dtype": "u16", "tokens": 10, "windows": 2, "next_window": 0},
            "rng": {"seed": 0}, "files": {}
        }))
        .unwrap()
    }

    fn f32_bytes(values: impl Iterator<Item = f32>) -> Vec<u8> {
        values.flat_map(f32::to_le_bytes).collect()
    }

    /// A column block of 4 x 6, `first` its first column.
    fn column_block(bytes: &[u8], first: usize) -> Vec<SavedBlock<'_>> {
        let tensor = TensorRef { name: "w".into(), dtype: DType::F32, shape: vec![4, 3], bytes };
        vec![SavedBlock { tensor, offsets: Some((vec![0, first], vec![4, 6])) }]
    }

    /// A tensor of 4 x 6 saved as two column blocks reads back as any block, whichever stored
    /// blocks it spans, and a block the stored ones do not cover is refused.
    #[test]
    fn blocks_read_across_the_stored_blocks() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("checkpoint");
        let global: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let columns =
            |first: usize| f32_bytes((0..4).flat_map(|r| (first..first + 3).map(move |c| (r * 6 + c) as f32)));
        let (left, right) = (columns(0), columns(3));
        let files = vec![
            ("rank-00000.safetensors".to_string(), column_block(&left, 0)),
            ("rank-00001.safetensors".to_string(), column_block(&right, 3)),
        ];
        save_files(&dir, &manifest(1), vec!["w".into()], files, None).unwrap();
        let checkpoint = Checkpoint::open(&dir).unwrap();
        assert_eq!(checkpoint.stored_type("w"), Some((DType::F32, vec![4, 6])));
        let mut got = vec![0u8; 6 * 4];
        checkpoint.read_block("w", &[4, 6], &[1, 2], &[2, 3], &mut got).unwrap();
        let want = f32_bytes((1..3).flat_map(|r| (2..5).map(|c| global[r * 6 + c]).collect::<Vec<_>>()));
        assert_eq!(got, want);
        let mut whole = vec![0u8; 24 * 4];
        checkpoint.read_block("w", &[4, 6], &[0, 0], &[4, 6], &mut whole).unwrap();
        assert_eq!(whole, f32_bytes(global.iter().copied()));
        // Columns 4..7 of a 4 x 7 view: column 6 was never stored.
        assert!(checkpoint.read_block("w", &[4, 7], &[0, 4], &[4, 3], &mut [0u8; 12 * 4]).is_none());
    }
}
