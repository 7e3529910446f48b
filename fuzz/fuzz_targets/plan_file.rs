#![no_main]
//! `cargo fuzz run plan_file`: [`autotp_fuzz::plan_file`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| autotp_fuzz::plan_file(data));
