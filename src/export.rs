//! `autotp export CKPT -o OUT.onnx [--safetensors OUT.safetensors]`: the trained weights of a
//! checkpoint (a sharded run's consolidated from its ranks' blocks), written back into the original ONNX model (every other part of the model
//! unchanged) and/or as one consolidated safetensors file named by ONNX initializer (for
//! Hugging Face exports, the PyTorch state-dict names). A mixed-precision run exports its f32
//! master weights.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Result};
use autotp_frontend::onnx::export::{with_weights, Weight};
use autotp_passes::optimize::MASTER_PREFIX;
use autotp_program::tensor_file;
use autotp_train::checkpoint::{Checkpoint, StoredTensor};
use clap::{ArgGroup, Args};

#[derive(Args)]
#[command(group(ArgGroup::new("destination").required(true).multiple(true).args(["output", "safetensors"])))]
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
    for destination in args.output.iter().chain(&args.safetensors) {
        crate::refuse_overwrite(destination, &original, "the model the checkpoint was trained from")?;
        for file in &checkpoint_files {
            crate::refuse_overwrite(destination, file, "a file of the checkpoint being exported")?;
        }
    }
    // A mixed-precision run's weights are its f32 masters (full precision, as DeepSpeed's
    // zero_to_fp32 recovers them), not the 16-bit parameters rounded from them.
    let params: Vec<_> = (checkpoint.params().into_iter())
        .map(|t| match checkpoint.tensor(&format!("{MASTER_PREFIX}{}", t.name)) {
            Some(master) => StoredTensor { name: t.name, ..master },
            None => t,
        })
        .collect();
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
    if let Some(output) = &args.output {
        if !original.is_file() {
            bail!(
                "the checkpoint's model {} is not there any more: name the original with --model MODEL.onnx",
                original.display()
            );
        }
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
