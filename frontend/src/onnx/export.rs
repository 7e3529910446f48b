//! Writing trained weights back into an ONNX model (`autotp export`): the original model, every
//! node, attribute and non-trained initializer unchanged, with each trained initializer's data
//! replaced by the new little-endian bytes.
//!
//! Weights are stored inline, or in one external-data file beside the model when asked or when
//! the model would pass protobuf's 2 GiB limit. Initializers the original kept in external files
//! are carried into the new model, so it never points at the original's files.

use std::collections::BTreeMap;
use std::path::Path;

use autotp_ir::DType;
use bytes::Bytes;
use prost::Message;

use super::proto::{tensor_proto, ModelProto, StringStringEntryProto};
use super::tensor::{decode, dtype_from_onnx, ExternalFiles};
use crate::FrontendError;

/// Protobuf messages are limited to 2 GiB; above this much weight data, weights go external.
const INLINE_LIMIT: usize = (1 << 31) - (64 << 20);
/// External-data offsets are aligned so each tensor can be mapped on its own.
const EXTERNAL_ALIGNMENT: usize = 4096;

/// A trained weight for [`with_weights`].
#[derive(Clone, Debug)]
pub struct Weight<'a> {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: &'a [u8],
}

/// The serialized model and, when weights went external, the external-data file's bytes (to be
/// written beside the model under `external_name`).
pub struct Exported {
    pub model: Vec<u8>,
    pub external_data: Option<Vec<u8>>,
    /// Initializers replaced by trained weights.
    pub replaced: usize,
}

/// The ONNX model at `original` with `weights` (by initializer name) in place of its
/// initializers. Every weight must name an initializer of the same type and shape. With
/// `external_name`, or when the weights are too big to stay inline, all initializers' data goes
/// to an external-data file named `external_name` (default `<model>.data`).
pub fn with_weights(
    original: &Path,
    weights: &BTreeMap<String, Weight>,
    external_name: Option<&str>,
    default_external_name: &str,
) -> Result<Exported, FrontendError> {
    let bytes = super::map_file(original)?;
    let decode_error = |message: String| FrontendError::Decode { path: original.to_path_buf(), message };
    let mut model = ModelProto::decode(bytes).map_err(|e| decode_error(e.to_string()))?;
    let graph = model.graph.as_mut().ok_or_else(|| decode_error("it has no graph".into()))?;
    let mut external = ExternalFiles::new(original);
    let mut replaced = 0;
    // Each initializer's data: the trained weight, or the original's bytes.
    let mut data: Vec<Bytes> = Vec::with_capacity(graph.initializer.len());
    for t in &graph.initializer {
        let Some(w) = weights.get(&t.name) else {
            data.push(Bytes::copy_from_slice(decode(t, &t.name, &mut external)?.bytes()));
            continue;
        };
        let tensor_error = |message: String| FrontendError::Tensor { name: t.name.clone(), message };
        let dims: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        if dtype_from_onnx(t.data_type) != Some(w.dtype) || dims != w.shape {
            return Err(tensor_error(format!(
                "the model's initializer is {}{dims:?}, the trained weight {}{:?}",
                super::tensor::onnx_type_name(t.data_type),
                w.dtype,
                w.shape
            )));
        }
        data.push(Bytes::copy_from_slice(w.bytes));
        replaced += 1;
    }
    if let Some(name) = weights.keys().find(|n| !graph.initializer.iter().any(|t| &t.name == *n)) {
        return Err(FrontendError::Tensor {
            name: name.clone(),
            message: format!("is not an initializer of {}", original.display()),
        });
    }
    let total: usize = data.iter().map(Bytes::len).sum();
    let external_name = match external_name {
        Some(name) => Some(name),
        None if total > INLINE_LIMIT => Some(default_external_name),
        None => None,
    };
    let mut external_data = None;
    match external_name {
        None => {
            for (t, bytes) in graph.initializer.iter_mut().zip(data) {
                clear_data(t);
                t.raw_data = bytes;
            }
        }
        Some(location) => {
            let mut file = Vec::with_capacity(total);
            for (t, bytes) in graph.initializer.iter_mut().zip(data) {
                clear_data(t);
                file.resize(file.len().next_multiple_of(EXTERNAL_ALIGNMENT), 0);
                let entry = |key: &str, value: String| StringStringEntryProto { key: key.into(), value };
                t.external_data = vec![
                    entry("location", location.to_string()),
                    entry("offset", file.len().to_string()),
                    entry("length", bytes.len().to_string()),
                ];
                t.data_location = tensor_proto::DataLocation::External as i32;
                file.extend_from_slice(&bytes);
            }
            external_data = Some(file);
        }
    }
    Ok(Exported { model: model.encode_to_vec(), external_data, replaced })
}

fn clear_data(t: &mut super::proto::TensorProto) {
    t.float_data.clear();
    t.double_data.clear();
    t.int32_data.clear();
    t.int64_data.clear();
    t.uint64_data.clear();
    t.string_data.clear();
    t.external_data.clear();
    t.raw_data = Bytes::new();
    t.data_location = tensor_proto::DataLocation::Default as i32;
}
