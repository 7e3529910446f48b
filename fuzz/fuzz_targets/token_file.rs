#![no_main]
//! `cargo fuzz run token_file`: [`autotp_fuzz::token_file`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| autotp_fuzz::token_file(data));
