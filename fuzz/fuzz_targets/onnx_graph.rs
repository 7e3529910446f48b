#![no_main]
//! `cargo fuzz run onnx_graph`: [`autotp_fuzz::onnx_graph`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| autotp_fuzz::onnx_graph(data));
