#![no_main]
//! `cargo fuzz run onnx_model`: [`autotp_fuzz::onnx_model`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| autotp_fuzz::onnx_model(data));
