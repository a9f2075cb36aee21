//! The sparse log's space on a compressing volume: each commit takes a
//! fresh 4 KiB block of logical space but only its compressed size of
//! physical space. A ring whose checkpoints trim what they pass keeps both
//! flat while the log writes forty times the medium's size; a log that
//! never trims runs out of logical space, not physical.
//!
//! The volume is zdisk's engine on a 4 MiB `MemMedia` that reuses segments
//! in place and stages partial sectors at flushes, as on an image file,
//! with 16 MiB of logical space (four times its physical size, as a
//! compressing drive exports more than it holds); its cleaner runs between
//! commits, as a drive's background work would.

use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use zdisk_bench::driver::Target;
use zdisk_bench::wal::{
    Layout, TargetDevice, Wal, WalConfig, WalError, BLOCK_BYTES, RECORD_HEADER_BYTES,
};
use zdisk_core::media::{Media, MemMedia};
use zdisk_core::meta::MediaKind;
use zdisk_core::{Codec, CreateOptions, GcPolicy, OpenOptions, Volume};

const PHYSICAL_BYTES: u64 = 64 * 64 * 1024;
const LOGICAL_BYTES: u64 = 16 << 20;

fn volume() -> Arc<Volume> {
    let media = Arc::new(
        MemMedia::with_size(4096, 64 * 1024, 64)
            .unwrap()
            .reusing_in_place(),
    );
    let create = CreateOptions {
        logical_size_bytes: LOGICAL_BYTES,
        codec: Codec::Lz4,
        gc_policy: GcPolicy::Greedy,
        unit_blocks: 1,
        media_kind: MediaKind::Memory,
        media_params: Vec::new(),
        dedup: false,
    };
    let options = OpenOptions {
        background: false,
        ..OpenOptions::default()
    };
    Volume::create(media as Arc<dyn Media>, create, options).unwrap()
}

/// Commits of 128 bytes, each flushed; a checkpoint every
/// `checkpoint_every` commits if any. Returns the commits written before
/// the log filled (or all of them), and the most logical space in use
/// (`mapped_bytes`) and bytes stored (`stored_bytes`) meanwhile.
fn run(
    target: &mut Target,
    ring_bytes: u64,
    checkpoint_every: Option<u64>,
    commits: u64,
) -> (u64, u64, u64) {
    let volume = target.volume.clone();
    let config = WalConfig {
        layout: Layout::Sparse,
        base_offset: 0,
        area_bytes: ring_bytes,
        log_id: 1,
    };
    let mut wal = Wal::create(TargetDevice::new(target), config).unwrap();
    let mut rng = SmallRng::seed_from_u64(1);
    let mut payload = [0u8; 128 - RECORD_HEADER_BYTES];
    let (mut most_stored, mut most_mapped) = (0, 0);
    for commit in 1..=commits {
        rng.fill_bytes(&mut payload);
        match wal.append(&payload) {
            Ok(_) => {}
            Err(WalError::Full { .. }) => return (commit - 1, most_mapped, most_stored),
            Err(other) => panic!("commit {commit}: {other}"),
        }
        wal.flush().unwrap();
        if checkpoint_every.is_some_and(|every| commit.is_multiple_of(every)) {
            wal.checkpoint().unwrap();
        }
        if commit.is_multiple_of(16) {
            // The drive's background work: cleaning, checkpoints.
            volume.maintenance_tick().unwrap();
        }
        let stats = volume.stats();
        most_stored = most_stored.max(stats.stored_bytes);
        most_mapped = most_mapped.max(stats.mapped_bytes);
    }
    (commits, most_mapped, most_stored)
}

#[test]
fn trimming_checkpoints_keep_logical_and_physical_space_flat() {
    let mut target = Target::real(volume());
    let commits = 40_000;
    let (written, most_mapped, most_stored) =
        run(&mut target, 2048 * BLOCK_BYTES, Some(512), commits);
    let stats = target.volume.stats();
    println!(
        "trim: {written} commits, {} MiB written by the host, {} MiB by the medium \
         ({} segments cleaned); at most {} KiB of logical space in use and {} KiB stored; \
         medium in use at the end {} KiB",
        stats.host_write_bytes >> 20,
        stats.media_write_bytes >> 20,
        stats.segments_cleaned,
        most_mapped >> 10,
        most_stored >> 10,
        stats.physical_used_bytes >> 10,
    );
    assert_eq!(written, commits);
    // The log passed through the medium several times, and was cleaned.
    assert!(stats.host_write_bytes >= 36 * PHYSICAL_BYTES);
    assert!(stats.media_write_bytes >= 4 * PHYSICAL_BYTES);
    assert!(stats.segments_cleaned > 0);
    // At most one checkpoint interval (and the anchors) is ever live.
    assert!(most_mapped <= (512 + 2) * BLOCK_BYTES, "{most_mapped}");
    assert!(most_stored <= 512 * 256, "{most_stored}");
}

#[test]
fn without_trim_the_log_runs_out_of_logical_space_first() {
    let mut target = Target::real(volume());
    // The whole logical space as the ring, never checkpointed.
    let ring = LOGICAL_BYTES - 2 * BLOCK_BYTES;
    let (written, most_mapped, most_stored) = run(&mut target, ring, None, 40_000);
    println!(
        "no trim: full after {written} commits, {} KiB of logical space in use, {} KiB stored",
        most_mapped >> 10,
        most_stored >> 10,
    );
    assert_eq!(written, ring / BLOCK_BYTES, "one block per commit");
    assert!(most_mapped >= ring);
    // What it holds would fit the medium several times over.
    assert!(most_stored <= PHYSICAL_BYTES / 4, "{most_stored}");
}
