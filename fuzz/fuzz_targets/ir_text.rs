#![no_main]
//! `cargo fuzz run ir_text`: [`autotp_fuzz::ir_text`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| autotp_fuzz::ir_text(data));
