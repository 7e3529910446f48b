#![no_main]
//! `cargo fuzz run safetensors`: [`autotp_fuzz::safetensors`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| autotp_fuzz::safetensors(data));
