//! Segment, record, root and checkpoint-chunk decoding from arbitrary medium
//! bytes: must never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| zdisk_core::fuzz::fuzz_decoders(data));
