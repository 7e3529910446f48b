#![no_main]
//! `cargo fuzz run checkpoint_manifest`: [`autotp_fuzz::checkpoint_manifest`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| autotp_fuzz::checkpoint_manifest(data));
