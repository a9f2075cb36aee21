//! Sequences of engine operations (writes, trims, zeroes, flushes,
//! cleaning, checkpoints, power cuts mid-operation) chosen by the input,
//! run through the crash simulator against its reference model: every
//! block must read back a value a client could have seen, and the
//! invariant checker must find nothing, after every power cut.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| zdisk_core::fuzz::fuzz_engine(data));
