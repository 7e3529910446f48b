#![no_main]
//! `cargo fuzz run deepspeed_config`: [`autotp_fuzz::deepspeed_config`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| autotp_fuzz::deepspeed_config(data));
