//! The fingerprint of one 4 KiB block, for deduplication (issue #25).
//!
//! A fingerprint is the BLAKE3-256 hash of a block's bytes. It is a
//! cryptographic hash on purpose: two blocks with the same fingerprint are
//! taken to be the same block, so finding a duplicate costs no read of the
//! earlier copy and no byte-by-byte compare. A collision would need a
//! second preimage of a 256-bit hash; nothing the engine stores is as
//! likely to be wrong.
//!
//! Why BLAKE3 and not SHA-256: per 4 KiB block it was the faster of the
//! two on the machine zdisk is developed on (AMD EPYC, one core, with
//! SHA-NI and AVX2): BLAKE3 1.77–1.98 GB/s, SHA-256 1.38–1.41 GB/s with
//! the `sha2` crate using SHA-NI, and `openssl speed -evp sha256 -bytes
//! 4096` 1.31 GB/s. The `blake3` crate picks its SIMD code at run time, so
//! one binary is fast on every x86-64 or ARM host. `cargo run --release -p
//! zdisk-core --example fingerprint_speed [-- FILE]` measures it again.
//!
//! Invariant: a fingerprint depends only on the block's bytes, never on
//! where the block lies or on the volume; the same bytes give the same
//! fingerprint in every build and on every machine.

use std::fmt;

use crate::units::BLOCK_SIZE;

/// Bytes of a fingerprint.
pub const FINGERPRINT_LEN: usize = 32;

/// BLAKE3-256 of one block.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; FINGERPRINT_LEN]);

impl Fingerprint {
    /// The fingerprint of one whole block.
    pub fn of(block: &[u8]) -> Fingerprint {
        assert_eq!(block.len(), BLOCK_SIZE, "a fingerprint is of one block");
        Fingerprint(*blake3::hash(block).as_bytes())
    }

    /// A fingerprint read back from its bytes.
    pub fn from_bytes(bytes: [u8; FINGERPRINT_LEN]) -> Fingerprint {
        Fingerprint(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; FINGERPRINT_LEN] {
        &self.0
    }

    /// The first 8 bytes as a little-endian integer: a cheap key for RAM
    /// indexes and for hash sampling. Its bits are as uniform as the hash's.
    pub fn tag(&self) -> u64 {
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(head)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|byte| write!(f, "{byte:02x}"))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BLAKE3 of 4096 zero bytes, as another implementation (the `blake3`
    /// Python package) computes it.
    const ZERO_BLOCK_BLAKE3: &str =
        "b6fb73fc46938c981e2b0b4b1ef282adcfc89854d01bfe3972fdc4785b41b2c7";

    #[test]
    fn zero_block_matches_the_reference_vector() {
        let zero = vec![0u8; BLOCK_SIZE];
        assert_eq!(format!("{:?}", Fingerprint::of(&zero)), ZERO_BLOCK_BLAKE3);
    }

    #[test]
    fn equal_blocks_are_equal_and_different_blocks_differ() {
        let mut a = vec![0u8; BLOCK_SIZE];
        a.iter_mut()
            .enumerate()
            .for_each(|(i, byte)| *byte = (i * 7) as u8);
        let b = a.clone();
        assert_eq!(Fingerprint::of(&a), Fingerprint::of(&b));
        assert_eq!(Fingerprint::of(&a).tag(), Fingerprint::of(&b).tag());
        // One bit anywhere changes it.
        for at in [0, 1, 2047, BLOCK_SIZE - 1] {
            let mut c = a.clone();
            c[at] ^= 1;
            assert_ne!(Fingerprint::of(&a), Fingerprint::of(&c), "bit at {at}");
            assert_ne!(Fingerprint::of(&a).tag(), Fingerprint::of(&c).tag());
        }
    }

    #[test]
    fn tag_is_the_first_eight_bytes_little_endian() {
        let fingerprint = Fingerprint::of(&[0x5a; BLOCK_SIZE]);
        let bytes = fingerprint.as_bytes();
        assert_eq!(fingerprint.tag() & 0xff, u64::from(bytes[0]));
        assert_eq!(fingerprint.tag() >> 56, u64::from(bytes[7]));
        assert_eq!(Fingerprint::from_bytes(*bytes), fingerprint);
        assert_eq!(format!("{fingerprint:?}").len(), 2 * FINGERPRINT_LEN);
    }

    #[test]
    #[should_panic(expected = "one block")]
    fn a_partial_block_is_a_programmer_error() {
        Fingerprint::of(&[0u8; 100]);
    }
}
