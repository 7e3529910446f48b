//! Generates the ONNX protobuf message types from the vendored upstream `proto/onnx.proto`.
//!
//! The schema is first turned into its proto3 form the way ONNX's own `gen_proto.py` makes
//! `onnx.proto3` (proto3 syntax, `optional` dropped): same wire format, but scalar fields are
//! plain values instead of `Option`s. protox compiles it (pure Rust: no `protoc`), and prost
//! generates the types with `bytes` fields as `bytes::Bytes`, so tensor data decoded from a
//! memory-mapped model are slices of the map, not copies.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/onnx.proto");
    let proto2 = std::fs::read_to_string("proto/onnx.proto")?;
    let proto3 = proto2.replace("syntax = \"proto2\";", "syntax = \"proto3\";").replace("optional ", "");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let proto_dir = out_dir.join("proto");
    std::fs::create_dir_all(&proto_dir)?;
    std::fs::write(proto_dir.join("onnx.proto"), proto3)?;
    let descriptors = protox::compile(["onnx.proto"], [&proto_dir])?;
    prost_build::Config::new().bytes(["."]).compile_fds(descriptors)?;
    Ok(())
}
