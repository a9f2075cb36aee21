//! How fast one core fingerprints 4 KiB blocks (BLAKE3-256, the hash
//! deduplication uses; see crates/zdisk-core/src/fingerprint.rs):
//!
//!     cargo run --release -p zdisk-core --example fingerprint_speed [-- FILE]
//!
//! Hashes 256 MiB of blocks, one `Fingerprint::of` call per block, then
//! in batches with `Fingerprint::of_blocks` as the write path does: the
//! first 256 MiB of FILE (repeated if it is shorter),
//! or pseudo-random bytes without one. The data is in RAM before the clock
//! starts, so the figure is the hash's alone. The best of three passes is
//! printed, in GB/s (10^9 bytes) and seconds per GiB.

use std::io::Read;
use std::time::Instant;

use rand::{RngCore, SeedableRng};
use zdisk_core::fingerprint::BATCH_BLOCKS;
use zdisk_core::{Fingerprint, BLOCK_SIZE};

const TOTAL_BYTES: usize = 256 << 20;
const PASSES: usize = 3;

fn main() {
    let path = std::env::args().nth(1);
    let (data, source) = match &path {
        Some(path) => match read_up_to(path, TOTAL_BYTES) {
            Ok(data) if data.len() >= BLOCK_SIZE => (data, path.clone()),
            Ok(_) => fail(&format!("{path} holds less than one 4 KiB block")),
            Err(e) => fail(&format!("cannot read {path}: {e}")),
        },
        None => {
            let mut data = vec![0u8; TOTAL_BYTES];
            rand::rngs::SmallRng::seed_from_u64(25).fill_bytes(&mut data);
            (data, "pseudo-random bytes".to_string())
        }
    };
    // Whole blocks of the file, cycled until there are 256 MiB of them.
    let blocks: Vec<&[u8]> = data
        .chunks_exact(BLOCK_SIZE)
        .cycle()
        .take(TOTAL_BYTES / BLOCK_SIZE)
        .collect();
    let bytes = (blocks.len() * BLOCK_SIZE) as f64;
    let one = time(|| {
        blocks
            .iter()
            .fold(0u64, |acc, block| acc ^ Fingerprint::of(block).tag())
    });
    let batched = time(|| {
        blocks
            .chunks(BATCH_BLOCKS)
            .flat_map(Fingerprint::of_blocks)
            .fold(0u64, |acc, fingerprint| acc ^ fingerprint.tag())
    });
    assert_eq!(one.1, batched.1, "the batches hash as single blocks do");
    for (how, (best, check)) in [("one block at a time", one), ("in batches of 16", batched)] {
        println!(
            "BLAKE3-256 of {} blocks of 4 KiB ({source}) {how}, one core, best of {PASSES}: \
             {:.2} GB/s, {:.3} s per GiB (xor of tags {check:016x})",
            blocks.len(),
            bytes / best / 1e9,
            best * (1u64 << 30) as f64 / bytes
        );
    }
}

/// The best of `PASSES` runs of `hash`, in seconds, and what it returned.
fn time(hash: impl Fn() -> u64) -> (f64, u64) {
    let mut best = f64::INFINITY;
    let mut check = 0;
    for _ in 0..PASSES {
        let started = Instant::now();
        check = hash();
        best = best.min(started.elapsed().as_secs_f64());
    }
    (best, check)
}

fn read_up_to(path: &str, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut data = Vec::new();
    std::fs::File::open(path)?
        .take(limit as u64)
        .read_to_end(&mut data)?;
    Ok(data)
}

fn fail(message: &str) -> ! {
    eprintln!("fingerprint_speed: {message}");
    std::process::exit(1)
}
