//! Minimal `.npy` reading and writing (format versions 1 to 3, little-endian, C order), for
//! `autotp infer` inputs and outputs and for test fixtures.

use std::path::Path;

use autotp_kernels::DType;

use crate::{HostTensor, RuntimeError};

const MAGIC: &[u8] = b"\x93NUMPY";

fn descr(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::F16 => "<f2",
        DType::I64 => "<i8",
        DType::I32 => "<i4",
        DType::I8 => "|i1",
        DType::U8 => "|u1",
        DType::Bool => "|b1",
        DType::BF16 => return None,
    })
}

fn dtype_of(text: &str) -> Option<DType> {
    // `=` (native order) is little-endian on every machine we run on; `|` marks single bytes.
    let kind = text.get(1..)?;
    if !matches!(text.as_bytes()[0], b'<' | b'=' | b'|') {
        return None;
    }
    DType::ALL.into_iter().find(|&d| descr(d).is_some_and(|s| &s[1..] == kind))
}

/// Parses `.npy` bytes; `origin` names the file in errors.
pub fn decode(bytes: &[u8], origin: &str) -> Result<HostTensor, RuntimeError> {
    let err = |message: &str| RuntimeError::Npy { path: origin.to_string(), message: message.to_string() };
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(err("not a .npy file (bad magic)"));
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        _ => return Err(err("unsupported .npy version")),
    };
    let header = bytes.get(start..start + header_len).ok_or_else(|| err("truncated header"))?;
    let header = std::str::from_utf8(header).map_err(|_| err("header is not text"))?;
    let field = |key: &str| -> Option<&str> {
        let at = header.find(&format!("'{key}'"))? + key.len() + 2;
        let rest = header[at..].trim_start().strip_prefix(':')?.trim_start();
        Some(rest)
    };
    let descr_text = field("descr")
        .and_then(|r| r.strip_prefix('\''))
        .and_then(|r| r.split('\'').next())
        .ok_or_else(|| err("header has no descr"))?;
    let dtype = dtype_of(descr_text).ok_or_else(|| err(&format!("unsupported dtype '{descr_text}'")))?;
    if field("fortran_order").is_some_and(|r| r.starts_with("True")) {
        return Err(err("Fortran-order arrays are not supported"));
    }
    let shape_text = field("shape")
        .and_then(|r| r.strip_prefix('('))
        .and_then(|r| r.split(')').next())
        .ok_or_else(|| err("header has no shape"))?;
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| err(&format!("bad shape ({shape_text})"))))
        .collect::<Result<Vec<_>, _>>()?;
    let data = &bytes[start + header_len..];
    let expected = shape.iter().product::<usize>() * dtype.size();
    if data.len() != expected {
        return Err(err(&format!("has {} data bytes, shape {shape:?} of {dtype} needs {expected}", data.len())));
    }
    Ok(HostTensor { dtype, shape, data: data.to_vec() })
}

pub fn read(path: &Path) -> Result<HostTensor, RuntimeError> {
    let bytes = std::fs::read(path)
        .map_err(|e| RuntimeError::Npy { path: path.display().to_string(), message: e.to_string() })?;
    decode(&bytes, &path.display().to_string())
}

/// Serialises a tensor as `.npy` version 1.0. bf16 has no numpy dtype and is written as f32.
pub fn encode(t: &HostTensor) -> Vec<u8> {
    let (descr, data) = match descr(t.dtype) {
        Some(d) => (d, t.data.clone()),
        None => {
            let widened: Vec<u8> =
                t.data.chunks(2).flat_map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32().to_le_bytes()).collect();
            ("<f4", widened)
        }
    };
    let shape = match t.shape.len() {
        0 => "()".to_string(),
        1 => format!("({},)", t.shape[0]),
        _ => format!("({})", t.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let unpadded = MAGIC.len() + 4 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len());
    out.extend(MAGIC);
    out.extend([1, 0]);
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

pub fn write(path: &Path, t: &HostTensor) -> Result<(), RuntimeError> {
    std::fs::write(path, encode(t))
        .map_err(|e| RuntimeError::Npy { path: path.display().to_string(), message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let t = HostTensor {
            dtype: DType::I64,
            shape: vec![2, 3],
            data: (0..6i64).flat_map(|v| v.to_le_bytes()).collect(),
        };
        let bytes = encode(&t);
        assert_eq!((10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize) % 64, 0);
        assert_eq!(decode(&bytes, "t").unwrap(), t);
        let scalar = HostTensor { dtype: DType::F32, shape: vec![], data: 1.5f32.to_le_bytes().to_vec() };
        assert_eq!(decode(&encode(&scalar), "s").unwrap(), scalar);
    }

    #[test]
    fn rejects_bad_files() {
        assert!(decode(b"hello world", "x").unwrap_err().to_string().contains("bad magic"));
        let mut bytes = encode(&HostTensor { dtype: DType::F32, shape: vec![4], data: vec![0; 16] });
        bytes.truncate(bytes.len() - 4);
        assert!(decode(&bytes, "x").unwrap_err().to_string().contains("needs 16"));
    }
}
