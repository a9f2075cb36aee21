//! NBD option haggling from arbitrary client bytes: must never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| zdisk_nbd::fuzz_handshake(data));
