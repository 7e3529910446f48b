//! `autotp export CKPT -o OUT.onnx [--safetensors OUT.safetensors] [--hf DIR [--dtype bf16]]`:
//! the trained weights of a checkpoint (a sharded run's consolidated from its ranks' blocks),
//! written back into the original ONNX model (every other part of the model unchanged), as one
//! consolidated safetensors file named by ONNX initializer, and/or as a Hugging Face model
//! directory that `from_pretrained` loads: `model.safetensors` under the model's own parameter
//! names (recorded by scripts/export_hf.py, [`autotp_frontend::HF_PARAMETERS_METADATA`]; a
//! tied weight once, under the name `save_pretrained` keeps), beside the export's `config.json`
//! (and `tokenizer.json`). A mixed-precision run exports its f32 master weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use autotp_frontend::onnx::export::{with_weights, Weight};
use autotp_ir::{DType, Tensor};
use autotp_passes::optimize::MASTER_PREFIX;
use autotp_program::tensor_file;
use autotp_train::checkpoint::{Checkpoint, StoredTensor};
use clap::{ArgGroup, Args};

#[derive(Args)]
#[command(group(ArgGroup::new("destination").required(true).multiple(true).args(["output", "safetensors", "hf"])))]
pub struct ExportArgs {
    /// A checkpoint: a --save directory (its latest) or one step directory.
    checkpoint: PathBuf,
    /// The ONNX model to write: the original with the trained weights.
    #[arg(short, long, value_name = "OUT.onnx")]
    output: Option<PathBuf>,
    /// Also (or only) write the trained weights as one safetensors file.
    #[arg(long, value_name = "OUT.safetensors")]
    safetensors: Option<PathBuf>,
    /// The original model, when it is no longer where it was compiled from.
    #[arg(long, value_name = "MODEL.onnx")]
    model: Option<PathBuf>,
    /// Store the weights in OUT.onnx.data beside the model (automatic above protobuf's 2 GiB).
    #[arg(long)]
    external_data: bool,
    /// Also (or only) write a Hugging Face model directory: model.safetensors under the model's
    /// own parameter names (a model exported by scripts/export_hf.py records them), with the
    /// config.json and tokenizer.json beside the original model.
    #[arg(long, value_name = "DIR")]
    hf: Option<PathBuf>,
    /// The dtype of --hf's weights: f32, bf16 or f16.
    #[arg(long, default_value = "f32", requires = "hf")]
    dtype: String,
}

/// A checkpoint's trained parameters: a mixed-precision run's are its f32 masters (full
/// precision, as DeepSpeed's zero_to_fp32 recovers them), not the 16-bit parameters rounded
/// from them.
pub(crate) fn trained_params(checkpoint: &Checkpoint) -> Vec<StoredTensor<'_>> {
    (checkpoint.params().into_iter())
        .map(|t| match checkpoint.tensor(&format!("{MASTER_PREFIX}{}", t.name)) {
            Some(master) => StoredTensor { name: t.name, ..master },
            None => t,
        })
        .collect()
}

pub fn run(args: &ExportArgs) -> Result<()> {
    let checkpoint = Checkpoint::open(&args.checkpoint)?;
    let manifest = &checkpoint.manifest;
    // Nothing the user has is written over: the model the plan was compiled from, nor a file
    // of the checkpoint being read.
    let original = args.model.clone().unwrap_or_else(|| manifest.model.path.clone());
    let checkpoint_files: Vec<PathBuf> = std::fs::read_dir(&checkpoint.dir)
        .map(|entries| entries.filter_map(|e| Some(e.ok()?.path())).collect())
        .unwrap_or_default();
    let hf_files: Vec<PathBuf> = ["model.safetensors", "config.json", "tokenizer.json"]
        .iter()
        .flat_map(|f| args.hf.as_ref().map(|d| d.join(f)))
        .collect();
    for destination in args.output.iter().chain(&args.safetensors).chain(&hf_files) {
        crate::refuse_overwrite(destination, &original, "the model the checkpoint was trained from")?;
        for file in &checkpoint_files {
            crate::refuse_overwrite(destination, file, "a file of the checkpoint being exported")?;
        }
    }
    if (args.output.is_some() || args.hf.is_some()) && !original.is_file() {
        bail!(
            "the checkpoint's model {} is not there any more: name the original with --model MODEL.onnx",
            original.display()
        );
    }
    let params = trained_params(&checkpoint);
    if let Some(path) = &args.safetensors {
        let metadata = BTreeMap::from([
            ("format".to_string(), "pt".to_string()),
            ("autotp.model".to_string(), manifest.model.name.clone()),
            ("autotp.step".to_string(), manifest.step.to_string()),
        ]);
        let tensors: Vec<tensor_file::TensorRef> = params
            .iter()
            .map(|t| tensor_file::TensorRef {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                bytes: &t.bytes,
            })
            .collect();
        tensor_file::write(path, &tensors, metadata)?;
        println!("wrote {}: {} tensors from step {}", path.display(), params.len(), manifest.step);
    }
    if let Some(dir) = &args.hf {
        write_hugging_face(dir, &original, &params, &args.dtype, manifest.step)?;
    }
    if let Some(output) = &args.output {
        let weights: BTreeMap<String, Weight> = params
            .iter()
            .map(|t| (t.name.clone(), Weight { dtype: t.dtype, shape: t.shape.clone(), bytes: &t.bytes }))
            .collect();
        let file_name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let external_name = format!("{file_name}.data");
        let exported =
            with_weights(&original, &weights, args.external_data.then_some(external_name.as_str()), &external_name)?;
        if let Some(data) = &exported.external_data {
            tensor_file::write_atomic(&output.with_file_name(&external_name), data)?;
        }
        tensor_file::write_atomic(output, &exported.model)?;
        println!(
            "wrote {}{}: {} initializers of {} replaced by the weights of step {}",
            output.display(),
            if exported.external_data.is_some() { format!(" (weights in {external_name})") } else { String::new() },
            exported.replaced,
            original.display(),
            manifest.step
        );
    }
    Ok(())
}

/// `--hf DIR`: the trained weights as the Hugging Face model's `model.safetensors` (names from
/// the original model's `autotp.hf_parameters`, each tied weight once, in `dtype`), and the
/// `config.json` (and `tokenizer.json`, when there is one) that scripts/export_hf.py wrote
/// beside the original model.
fn write_hugging_face(dir: &Path, original: &Path, params: &[StoredTensor], dtype: &str, step: usize) -> Result<()> {
    use autotp_frontend::{HF_CLASS_METADATA, HF_PARAMETERS_METADATA};
    let Some(dtype) = DType::from_name(dtype).filter(|d| matches!(d, DType::F32 | DType::BF16 | DType::F16)) else {
        bail!("--dtype {dtype}: expected f32, bf16 or f16");
    };
    let (config, tokenizer) = (original.with_file_name("config.json"), original.with_file_name("tokenizer.json"));
    // DIR may be the original's own directory: its files are not copied onto themselves.
    for (copy, source) in [(dir.join("config.json"), &config), (dir.join("tokenizer.json"), &tokenizer)] {
        crate::refuse_overwrite(&copy, source, "the file --hf copies there")?;
    }
    let metadata = autotp_frontend::onnx_metadata(original)?;
    let Some(recorded) = metadata.get(HF_PARAMETERS_METADATA) else {
        bail!(
            "{} records no Hugging Face parameter names (metadata '{HF_PARAMETERS_METADATA}'): export the model with \
             scripts/export_hf.py for --hf",
            original.display()
        );
    };
    let names: BTreeMap<String, Vec<String>> = serde_json::from_str(recorded).map_err(|e| {
        anyhow::anyhow!(
            "{}: metadata '{HF_PARAMETERS_METADATA}' is not a JSON map of names to names: {e}",
            original.display()
        )
    })?;
    if !config.is_file() {
        bail!(
            "no config.json beside {}: --hf copies the one scripts/export_hf.py writes there (or put the model's \
             own there)",
            original.display()
        );
    }
    let mut weights = Vec::new();
    for name in names.keys() {
        if !params.iter().any(|t| &t.name == name) {
            bail!("the checkpoint holds no '{name}', a parameter of {} ({HF_PARAMETERS_METADATA})", original.display());
        }
    }
    for t in params {
        let Some(hf_name) = names.get(&t.name).and_then(|n| n.first()) else {
            bail!(
                "the checkpoint's '{}' has no Hugging Face name in {}'s metadata '{HF_PARAMETERS_METADATA}'",
                t.name,
                original.display()
            );
        };
        if t.bytes.len() != t.shape.iter().product::<usize>() * t.dtype.size() {
            bail!("the checkpoint's '{}' has {} bytes for {}{:?}", t.name, t.bytes.len(), t.dtype, t.shape);
        }
        let stored = Tensor::from_pod::<u8>(t.dtype, t.shape.clone(), &t.bytes);
        let converted = match dtype == t.dtype {
            true => stored,
            false => Tensor::from_f64_values(dtype, t.shape.clone(), &stored.to_f64_vec()),
        };
        weights.push((hf_name.clone(), converted));
    }
    std::fs::create_dir_all(dir)?;
    let tensors: Vec<tensor_file::TensorRef> = (weights.iter())
        .map(|(name, t)| tensor_file::TensorRef {
            name: name.clone(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            bytes: t.bytes(),
        })
        .collect();
    tensor_file::write(
        &dir.join("model.safetensors"),
        &tensors,
        BTreeMap::from([("format".to_string(), "pt".to_string())]),
    )?;
    std::fs::copy(&config, dir.join("config.json"))?;
    if tokenizer.is_file() {
        std::fs::copy(&tokenizer, dir.join("tokenizer.json"))?;
    }
    let class = metadata.get(HF_CLASS_METADATA).map_or(String::new(), |c| format!(" ({c})"));
    println!(
        "wrote {}{class}: model.safetensors ({} tensors in {dtype}, step {step}), config.json{}",
        dir.display(),
        weights.len(),
        if tokenizer.is_file() { ", tokenizer.json" } else { "" }
    );
    Ok(())
}
