//! Entry points for fuzzers: the real handshake and request state machines
//! over an in-memory byte stream and a small [`RamDevice`], with no sockets
//! and no threads.
//!
//! What they guarantee to a fuzzer: for any input they return without
//! panicking, and memory stays bounded by the device size and the protocol
//! limits (option data is capped at 64 KiB, payload buffers are only
//! allocated after a request was checked against the device's size), never
//! by a length the input claims. Replies are written to a sink.

use std::io;
use std::sync::Arc;

use crate::budget::{InFlightLimits, MemoryBudget};
use crate::handshake::{greet, haggle, Export, Negotiated, Outcome, TlsState};
use crate::request::Session;
use crate::session::ConnLog;
use crate::testing::RamDevice;
use crate::tls::TlsMode;
use crate::transmission::{serve, Connection, Inline, Outbox};
use crate::wire::{BASE_ALLOCATION_ID, MIN_BLOCK_BYTES, ZDISK_COMPRESSION_ID};

/// Size of the fuzzing device: big enough for several allocation blocks,
/// small enough that a maximal READ costs nothing.
const FUZZ_DEVICE_BYTES: u64 = 256 * 1024;

fn fuzz_export() -> Export {
    Export {
        name: "zdisk".to_string(),
        description: Some("fuzzing export".to_string()),
        size_bytes: FUZZ_DEVICE_BYTES,
        read_only: false,
    }
}

fn transmit(mut input: &[u8], device: Arc<RamDevice>, negotiated: Negotiated, read_only: bool) {
    let session = Session {
        device,
        size_bytes: FUZZ_DEVICE_BYTES,
        read_only,
        structured_replies: negotiated.structured_replies,
        base_allocation_id: negotiated.base_allocation_id,
        compression_id: negotiated.compression_id,
        min_block_bytes: if negotiated.block_size_agreed {
            u64::from(MIN_BLOCK_BYTES)
        } else {
            1
        },
    };
    let connection = Arc::new(Connection::new(
        session,
        ConnLog::quiet(),
        // Replies go nowhere, all at once: no sender thread is needed.
        Outbox::new(Box::new(|reply| Ok(reply.len()))),
        Box::new(|| {}),
        InFlightLimits {
            max_requests: 1,
            max_buffer_bytes: usize::MAX,
        },
        Arc::new(MemoryBudget::unlimited()),
    ));
    serve(&mut input, &connection, &Inline, &|| false);
}

/// Feeds `bytes` to the server as everything a client sends from the moment
/// it connects: client flags, options, and, if it gets that far,
/// transmission requests. The same bytes are run once with TLS allowed and
/// once with TLS required; a STARTTLS that is accepted continues as if the
/// TLS handshake had succeeded, so the option rules after TLS are reached.
pub fn fuzz_handshake(bytes: &[u8]) {
    for mode in [TlsMode::On, TlsMode::Require] {
        handshake_then_transmit(bytes, Arc::new(RamDevice::new(FUZZ_DEVICE_BYTES)), mode);
    }
}

fn handshake_then_transmit(bytes: &[u8], device: Arc<RamDevice>, mode: TlsMode) {
    let export = fuzz_export();
    let mut input = bytes;
    let Ok(flags) = greet(&mut input, &mut io::sink()) else {
        return;
    };
    let mut tls = TlsState {
        mode,
        active: false,
    };
    let negotiated = loop {
        match haggle(
            &mut input,
            &mut io::sink(),
            &export.clone().into(),
            flags,
            tls,
            &|| None,
        ) {
            Ok(Outcome::Transmission(negotiated)) => break negotiated,
            Ok(Outcome::StartTls) => {
                assert!(!tls.active, "STARTTLS accepted twice");
                tls.active = true;
            }
            Err(_) => return,
        }
    };
    if mode == TlsMode::Require {
        assert!(tls.active, "transmission reached without TLS under require");
    }
    transmit(input, device, negotiated, export.read_only);
}

/// Feeds `bytes` to the server as transmission-phase requests. The first
/// byte picks what the handshake would have settled and which faults the
/// device injects, so one corpus reaches every request path:
/// bit 0 structured replies, bit 1 `base:allocation` selected, bit 2 512-byte
/// blocks agreed, bit 3 read-only, bit 4 I/O errors at offset 8192,
/// bit 5 device out of space, bit 6 device shut down, bit 7
/// `zdisk:compression` selected.
pub fn fuzz_transmission(bytes: &[u8]) {
    let Some((&setup, requests)) = bytes.split_first() else {
        return;
    };
    let bit = |n: u8| setup & (1 << n) != 0;
    let structured_replies = bit(0);
    let negotiated = Negotiated {
        structured_replies,
        // A context can only be selected once structured replies are on.
        base_allocation_id: (structured_replies && bit(1)).then_some(BASE_ALLOCATION_ID),
        compression_id: (structured_replies && bit(7)).then_some(ZDISK_COMPRESSION_ID),
        block_size_agreed: bit(2),
        export: None,
    };
    let device = Arc::new(RamDevice::new(FUZZ_DEVICE_BYTES));
    if bit(4) {
        device.fail_io_at(8192);
    }
    device.set_no_space(bit(5));
    device.set_shut_down(bit(6));
    transmit(requests, device, negotiated, bit(3));
}

#[cfg(test)]
mod tests {
    //! A cheap stand-in for a fuzzing campaign, run on every `cargo test`:
    //! seeded random inputs, both raw and shaped like real conversations
    //! (a valid handshake, then requests drawn from boundary values), must
    //! pass through both entry points without panicking. A failure names
    //! its seed so it can be replayed.

    use super::*;
    use crate::wire::*;

    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
            choices[(self.next() % choices.len() as u64) as usize]
        }
    }

    fn option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&option.to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(data);
    }

    fn handshake_prefix(rng: &mut XorShift) -> Vec<u8> {
        let mut out = (NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES)
            .to_be_bytes()
            .to_vec();
        if rng.next().is_multiple_of(2) {
            option(&mut out, NBD_OPT_STRUCTURED_REPLY, &[]);
            let mut meta = vec![0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 15];
            meta.extend_from_slice(BASE_ALLOCATION.as_bytes());
            option(&mut out, NBD_OPT_SET_META_CONTEXT, &meta);
        }
        if rng.next().is_multiple_of(3) {
            option(&mut out, NBD_OPT_EXPORT_NAME, b"zdisk");
        } else {
            let block_size = rng.next().is_multiple_of(2);
            let mut go = vec![0, 0, 0, 0, 0, block_size as u8];
            if block_size {
                go.extend_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
            }
            option(&mut out, NBD_OPT_GO, &go);
        }
        out
    }

    fn random_requests(rng: &mut XorShift, out: &mut Vec<u8>) {
        let size = FUZZ_DEVICE_BYTES;
        let offsets = [
            0,
            1,
            511,
            512,
            8192,
            size - 512,
            size - 1,
            size,
            u64::MAX - 511,
        ];
        let lengths = [
            0u32,
            1,
            512,
            4096,
            65536,
            MAX_PAYLOAD_BYTES,
            MAX_PAYLOAD_BYTES + 1,
            u32::MAX,
        ];
        for _ in 0..rng.next() % 40 {
            let command = (rng.next() % 10) as u16;
            let any_flags = rng.next() as u16;
            let flags = rng.pick(&[0u16, 1, 2, 4, 8, 16, 0x1f, any_flags]);
            let offset = rng.pick(&offsets);
            let length = rng.pick(&lengths);
            let magic = if rng.next().is_multiple_of(50) {
                0x1234_5678
            } else {
                NBD_REQUEST_MAGIC
            };
            out.extend_from_slice(&magic.to_be_bytes());
            out.extend_from_slice(&flags.to_be_bytes());
            out.extend_from_slice(&command.to_be_bytes());
            out.extend_from_slice(&rng.next().to_be_bytes());
            out.extend_from_slice(&offset.to_be_bytes());
            out.extend_from_slice(&length.to_be_bytes());
            if command == NBD_CMD_WRITE {
                // Usually the full payload when it is small, sometimes short.
                let sent = if length <= 65536 && !rng.next().is_multiple_of(8) {
                    length as usize
                } else {
                    (rng.next() % 1024) as usize
                };
                out.resize(out.len() + sent, 0xa5);
            }
        }
    }

    #[test]
    fn a_valid_conversation_reaches_the_device() {
        // Guards the generator below: if its handshake were wrong, every
        // shaped input would stop at the handshake and test nothing deeper.
        for seed in 1..50u64 {
            let mut rng = XorShift(seed);
            let mut bytes = handshake_prefix(&mut rng);
            bytes.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
            bytes.extend_from_slice(&[0, 0, 0, NBD_CMD_WRITE as u8]);
            bytes.extend_from_slice(&[0; 8]);
            bytes.extend_from_slice(&4096u64.to_be_bytes());
            bytes.extend_from_slice(&512u32.to_be_bytes());
            bytes.extend_from_slice(&[0x5a; 512]);
            let device = Arc::new(RamDevice::new(FUZZ_DEVICE_BYTES));
            handshake_then_transmit(&bytes, Arc::clone(&device), TlsMode::On);
            assert_eq!(device.snapshot(4096, 512), vec![0x5a; 512], "seed {seed}");
        }
    }

    #[test]
    fn random_bytes_never_panic() {
        for seed in 1..3000u64 {
            let mut rng = XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let length = (rng.next() % 300) as usize;
            let bytes: Vec<u8> = (0..length).map(|_| rng.next() as u8).collect();
            let result = std::panic::catch_unwind(|| {
                fuzz_handshake(&bytes);
                fuzz_transmission(&bytes);
            });
            assert!(result.is_ok(), "seed {seed} panicked");
        }
    }

    #[test]
    fn shaped_conversations_never_panic() {
        for seed in 1..1500u64 {
            let mut rng = XorShift(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1);
            let mut bytes = handshake_prefix(&mut rng);
            random_requests(&mut rng, &mut bytes);
            let mut transmission = vec![rng.next() as u8];
            random_requests(&mut rng, &mut transmission);
            let result = std::panic::catch_unwind(|| {
                fuzz_handshake(&bytes);
                fuzz_transmission(&transmission);
            });
            assert!(result.is_ok(), "seed {seed} panicked");
        }
    }
}
