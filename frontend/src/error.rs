//! The frontend's error type: every variant names the file, tensor, node or op it is about.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a valid ONNX model: {message}")]
    Decode { path: PathBuf, message: String },
    #[error("{path}: unsupported opset {version} for domain '{domain}' (supported: ai.onnx 13 to 28)")]
    UnsupportedOpset { path: PathBuf, domain: String, version: i64 },
    #[error("unsupported op {op_type} (node '{node}', opset {opset})")]
    UnsupportedOp { op_type: String, node: String, opset: i64 },
    #[error("{op_type} node '{node}': {message}")]
    InvalidNode { op_type: String, node: String, message: String },
    #[error("{op_type} node '{node}': input '{input}' must be a constant after folding the shape arithmetic")]
    NotConstant { op_type: String, node: String, input: String },
    #[error("tensor '{name}': {message}")]
    Tensor { name: String, message: String },
    #[error("input '{input}': {message}")]
    Input { input: String, message: String },
    #[error("the imported graph fails verification: {0}")]
    Verify(#[from] autotp_ir::VerifyErrors),
}
