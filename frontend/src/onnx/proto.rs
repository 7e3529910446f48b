//! ONNX protobuf message types, generated at build time from `proto/onnx.proto`.
#![allow(clippy::all, missing_docs, rustdoc::all)]

include!(concat!(env!("OUT_DIR"), "/onnx.rs"));
