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
use std::sync::OnceLock;

use crate::units::BLOCK_SIZE;

/// Bytes of a fingerprint.
pub const FINGERPRINT_LEN: usize = 32;

/// Blocks [`Fingerprint::of_blocks`] hashes side by side (BLAKE3's
/// widest SIMD degree).
pub const BATCH_BLOCKS: usize = 16;

/// BLAKE3's chunks in a block, its chaining values' bytes, its initial
/// value and the flags of its compression function (the BLAKE3 paper,
/// section 2.1 and table 3).
const CHUNKS: usize = BLOCK_SIZE / blake3::CHUNK_LEN;
const OUT: usize = blake3::OUT_LEN;
const IV: [u32; 8] = [
    0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19,
];
const CHUNK_START: u8 = 1;
const CHUNK_END: u8 = 2;
const PARENT: u8 = 4;
const ROOT: u8 = 8;

/// BLAKE3-256 of one block.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; FINGERPRINT_LEN]);

impl Fingerprint {
    /// The fingerprint of one whole block.
    pub fn of(block: &[u8]) -> Fingerprint {
        assert_eq!(block.len(), BLOCK_SIZE, "a fingerprint is of one block");
        Fingerprint(*blake3::hash(block).as_bytes())
    }

    /// The fingerprints of `blocks` (each one whole block), in order: the
    /// same as [`Fingerprint::of`] gives, a batch of up to
    /// [`BATCH_BLOCKS`] at a time. BLAKE3's SIMD code hashes up to 16
    /// inputs side by side, and a 4 KiB block alone (four 1 KiB chunks)
    /// fills a quarter of AVX-512's lanes: batched, each step hashes the
    /// same chunk of every block, then their parent nodes, then their
    /// roots, all at full width.
    ///
    /// It uses the `blake3` crate's `platform` module, which the crate
    /// keeps for its benchmarks and may change in a minor release (the
    /// build then fails; `Cargo.lock` pins the version). The tests check
    /// every batch size against `blake3::hash`.
    pub fn of_blocks(blocks: &[&[u8]]) -> Vec<Fingerprint> {
        use blake3::platform::Platform;
        use blake3::IncrementCounter;
        static PLATFORM: OnceLock<Platform> = OnceLock::new();
        let platform = PLATFORM.get_or_init(Platform::detect);
        let mut out = Vec::with_capacity(blocks.len());
        let mut chunk_cvs = [0u8; BATCH_BLOCKS * OUT];
        // Per block, its four chunks' chaining values in order, then its
        // two parents': each pair is the next level's 64-byte input.
        let mut leaves = [0u8; BATCH_BLOCKS * CHUNKS * OUT];
        let mut parents = [0u8; BATCH_BLOCKS * 2 * OUT];
        let mut roots = [0u8; BATCH_BLOCKS * OUT];
        for batch in blocks.chunks(BATCH_BLOCKS) {
            let n = batch.len();
            for chunk in 0..CHUNKS {
                let inputs: Vec<&[u8; blake3::CHUNK_LEN]> = batch
                    .iter()
                    .map(|block| {
                        assert_eq!(block.len(), BLOCK_SIZE, "a fingerprint is of one block");
                        block[chunk * blake3::CHUNK_LEN..(chunk + 1) * blake3::CHUNK_LEN]
                            .try_into()
                            .expect("a chunk")
                    })
                    .collect();
                platform.hash_many(
                    &inputs,
                    &IV,
                    chunk as u64,
                    IncrementCounter::No,
                    0,
                    CHUNK_START,
                    CHUNK_END,
                    &mut chunk_cvs[..n * OUT],
                );
                for (block, cv) in chunk_cvs[..n * OUT].chunks_exact(OUT).enumerate() {
                    let at = (block * CHUNKS + chunk) * OUT;
                    leaves[at..at + OUT].copy_from_slice(cv);
                }
            }
            let pairs = |level: &[u8]| -> Vec<[u8; 2 * OUT]> {
                level
                    .chunks_exact(2 * OUT)
                    .map(|pair| pair.try_into().expect("two chaining values"))
                    .collect()
            };
            let inputs = pairs(&leaves[..n * CHUNKS * OUT]);
            let inputs: Vec<&[u8; 2 * OUT]> = inputs.iter().collect();
            platform.hash_many(
                &inputs,
                &IV,
                0,
                IncrementCounter::No,
                PARENT,
                0,
                0,
                &mut parents[..n * 2 * OUT],
            );
            let inputs = pairs(&parents[..n * 2 * OUT]);
            let inputs: Vec<&[u8; 2 * OUT]> = inputs.iter().collect();
            platform.hash_many(
                &inputs,
                &IV,
                0,
                IncrementCounter::No,
                PARENT | ROOT,
                0,
                0,
                &mut roots[..n * OUT],
            );
            out.extend(
                roots[..n * OUT]
                    .chunks_exact(OUT)
                    .map(|root| Fingerprint(root.try_into().expect("32 bytes"))),
            );
        }
        out
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
    fn batches_of_any_size_fingerprint_as_one_block_at_a_time() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let blocks: Vec<Vec<u8>> = (0..(3 * BATCH_BLOCKS + 5))
            .map(|i| {
                (0..BLOCK_SIZE)
                    .map(|j| {
                        state = state
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        // Some blocks are runs, some noise.
                        if i % 3 == 0 {
                            (j / 512) as u8
                        } else {
                            (state >> 56) as u8
                        }
                    })
                    .collect()
            })
            .collect();
        for count in 0..blocks.len() {
            let refs: Vec<&[u8]> = blocks[..count].iter().map(Vec::as_slice).collect();
            let batched = Fingerprint::of_blocks(&refs);
            assert_eq!(batched.len(), count);
            for (block, fingerprint) in refs.iter().zip(&batched) {
                assert_eq!(*fingerprint, Fingerprint::of(block), "{count} blocks");
            }
        }
        let zero = [0u8; BLOCK_SIZE];
        assert_eq!(
            format!("{:?}", Fingerprint::of_blocks(&[&zero])[0]),
            ZERO_BLOCK_BLAKE3
        );
    }

    #[test]
    #[should_panic(expected = "one block")]
    fn a_partial_block_is_a_programmer_error() {
        Fingerprint::of(&[0u8; 100]);
    }
}
