#![no_main]
//! `cargo fuzz run megatron_index`: [`autotp_fuzz::megatron_index`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| autotp_fuzz::megatron_index(data));
