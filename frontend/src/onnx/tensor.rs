//! Decoding of ONNX `TensorProto`s into IR tensors. Raw data stays a zero-copy slice of the
//! memory-mapped model (or of the memory-mapped external-data file).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use autotp_ir::{DType, Tensor, TensorType};
use bytes::Bytes;

use super::proto::{tensor_proto, TensorProto};
use crate::FrontendError;

/// Maps ONNX's element type codes to IR dtypes.
pub fn dtype_from_onnx(code: i32) -> Option<DType> {
    use tensor_proto::DataType as D;
    Some(match D::try_from(code).ok()? {
        D::Float => DType::F32,
        D::Double => DType::F64,
        D::Float16 => DType::F16,
        D::Bfloat16 => DType::BF16,
        D::Int64 => DType::I64,
        D::Int32 => DType::I32,
        D::Int8 => DType::I8,
        D::Uint8 => DType::U8,
        D::Bool => DType::Bool,
        _ => return None,
    })
}

pub fn onnx_type_name(code: i32) -> String {
    tensor_proto::DataType::try_from(code)
        .map(|d| d.as_str_name().to_string())
        .unwrap_or_else(|_| format!("type code {code}"))
}

/// Memory maps of external-data files, opened once each.
#[derive(Default)]
pub struct ExternalFiles {
    dir: PathBuf,
    maps: BTreeMap<String, Bytes>,
}

impl ExternalFiles {
    pub fn new(model_path: &Path) -> ExternalFiles {
        ExternalFiles { dir: model_path.parent().map(Path::to_path_buf).unwrap_or_default(), maps: BTreeMap::new() }
    }

    /// Each mapped file's path and bytes.
    pub fn mapped(&self) -> impl Iterator<Item = (PathBuf, &Bytes)> {
        self.maps.iter().map(|(location, bytes)| (self.dir.join(location), bytes))
    }

    fn file(&mut self, location: &str, tensor: &str) -> Result<Bytes, FrontendError> {
        if let Some(b) = self.maps.get(location) {
            return Ok(b.clone());
        }
        let path = autotp_program::folder_paths::inside_folder(&self.dir, location)
            .map_err(|why| tensor_error(tensor, format!("external data location '{location}' {why}: refused")))?;
        let file = std::fs::File::open(&path).map_err(|source| FrontendError::Io { path: path.clone(), source })?;
        // SAFETY: the file is mapped read-only; like every mmap user we assume nobody truncates
        // the model while it is being imported.
        let map =
            unsafe { memmap2::Mmap::map(&file) }.map_err(|source| FrontendError::Io { path: path.clone(), source })?;
        let bytes = Bytes::from_owner(map);
        tracing::debug!(tensor, location, "mapped external data");
        self.maps.insert(location.to_string(), bytes.clone());
        Ok(bytes)
    }
}

fn tensor_error(name: &str, message: impl Into<String>) -> FrontendError {
    FrontendError::Tensor { name: name.to_string(), message: message.into() }
}

/// A tensor's type, without reading its data; `name` names it in errors.
pub fn type_of(t: &TensorProto, name: &str) -> Result<TensorType, FrontendError> {
    let dtype = dtype_from_onnx(t.data_type)
        .ok_or_else(|| tensor_error(name, format!("unsupported element type {}", onnx_type_name(t.data_type))))?;
    let shape = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| tensor_error(name, format!("negative dimension {d}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let ty = TensorType::new(dtype, shape);
    ty.check_limits().map_err(|why| tensor_error(name, why))?;
    Ok(ty)
}

/// Decodes a tensor, naming it `name` in errors.
pub fn decode(t: &TensorProto, name: &str, external: &mut ExternalFiles) -> Result<Tensor, FrontendError> {
    let ty = type_of(t, name)?;
    let dtype = ty.dtype;
    let expected = ty.size_bytes();
    let wrong_size =
        |got: usize| tensor_error(name, format!("has {got} bytes of data, its type {ty} needs {expected}"));

    if t.data_location == tensor_proto::DataLocation::External as i32 {
        let entry = |key: &str| t.external_data.iter().find(|e| e.key == key).map(|e| e.value.clone());
        let location = entry("location").ok_or_else(|| tensor_error(name, "external data without a location"))?;
        let parse = |key: &str| -> Result<Option<usize>, FrontendError> {
            entry(key)
                .map(|v| v.parse::<usize>().map_err(|_| tensor_error(name, format!("bad external-data {key} '{v}'"))))
                .transpose()
        };
        let offset = parse("offset")?.unwrap_or(0);
        let file = external.file(&location, name)?;
        let length = parse("length")?.unwrap_or(file.len().saturating_sub(offset));
        if offset.checked_add(length).is_none_or(|end| end > file.len()) {
            return Err(tensor_error(
                name,
                format!(
                    "external data {location} is {} bytes, the tensor needs offset {offset} + length {length}",
                    file.len()
                ),
            ));
        }
        if length != expected {
            return Err(wrong_size(length));
        }
        return Ok(Tensor::from_bytes(ty, file.slice(offset..offset + length)).expect("length checked"));
    }
    if !t.raw_data.is_empty() || expected == 0 {
        if t.raw_data.len() != expected {
            return Err(wrong_size(t.raw_data.len()));
        }
        return Ok(Tensor::from_bytes(ty, t.raw_data.clone()).expect("length checked"));
    }
    // Typed fields: copied, as protobuf stores them in a wider type.
    let n = ty.numel();
    let bytes: Vec<u8> = match dtype {
        DType::F32 if t.float_data.len() == n => bytemuck::cast_slice(&t.float_data).to_vec(),
        DType::F64 if t.double_data.len() == n => bytemuck::cast_slice(&t.double_data).to_vec(),
        DType::I64 if t.int64_data.len() == n => bytemuck::cast_slice(&t.int64_data).to_vec(),
        DType::I32 if t.int32_data.len() == n => bytemuck::cast_slice(&t.int32_data).to_vec(),
        DType::F16 | DType::BF16 if t.int32_data.len() == n => {
            t.int32_data.iter().flat_map(|&v| (v as u16).to_le_bytes()).collect()
        }
        DType::I8 | DType::U8 | DType::Bool if t.int32_data.len() == n => {
            t.int32_data.iter().map(|&v| v as u8).collect()
        }
        _ => return Err(tensor_error(name, format!("has no data for its {n} elements of type {dtype}"))),
    };
    Ok(Tensor::from_aligned(ty, autotp_ir::AlignedBuf::from_bytes(&bytes)))
}
