//! Images written by an earlier zdisk still open: the on-disk format is a
//! promise, not an accident of the code that happens to read it.
//!
//! `fixtures/v1-*.zdisk.zst` were written by the zdisk binary of commit
//! b62e4cb, before the engine refactor of issue #10, with
//! `fixtures/make_v1_images.py` (which says how): one closed cleanly (its
//! checkpoint is read, the log is not), one killed after its last flush
//! (recovery replays the log). `fixtures/v2-*.zdisk.zst` were written the
//! same way by the format 2 zdisk of commit eddf5ef (issue #12 item 1,
//! before the map was paged): their checkpoints hold the whole map as
//! chunks, which opens into a map in RAM that the first checkpoint writes
//! as pages. `fixtures/v3-*.zdisk.zst` are format 3 (the paged map: a
//! directory and one page per leaf), written the same way by the engine of
//! commit 1df04d9 (issue #22 item 6), the format the next changes start
//! from. `fixtures/v4-*.zdisk.zst` are format 4 (checkpoints that keep
//! unchanged pages in place), written by commit 92e55f2, the last before
//! format 5 shared records between blocks; `fixtures/v5-*.zdisk.zst` are
//! format 5, written by commit e945f6d, the last before format 6 added
//! the dedup setting and chapter records. Each test unpacks one, opens it with today's engine, compares
//! every block with the contents the script's operations produce, runs the
//! checker, and writes to it; after a clean close it opens again, from
//! today's format.

use std::path::PathBuf;
use std::sync::Arc;

use zdisk_core::media::{FileMedia, Media};
use zdisk_core::{BlockDevice, OpenOptions, Volume, BLOCK_SIZE};

const LOGICAL_BYTES: usize = 64 << 20;

fn text(block: usize, variant: usize) -> Vec<u8> {
    let line = format!("zdisk v1 fixture block {block} variant {variant}. ");
    line.bytes().cycle().take(BLOCK_SIZE).collect()
}

fn noise(block: usize) -> Vec<u8> {
    let mut state = block as u64 + 1;
    let mut out = Vec::with_capacity(BLOCK_SIZE);
    for _ in 0..BLOCK_SIZE / 8 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out
}

/// The contents `make_v1_images.py` leaves, rebuilt from its operations.
fn expected() -> Vec<u8> {
    let mut image = vec![0u8; LOGICAL_BYTES];
    let mut write = |first: usize, blocks: usize, content: &dyn Fn(usize) -> Vec<u8>| {
        for block in first..first + blocks {
            image[block * BLOCK_SIZE..(block + 1) * BLOCK_SIZE].copy_from_slice(&content(block));
        }
    };
    write(0, 1024, &|b| text(b, 0));
    write(2048, 8, &noise);
    // All-zero writes, a trim and write-zeroes (punching or not) read as zeros.
    write(3072, 256, &|_| vec![0; BLOCK_SIZE]);
    write(256, 256, &|_| vec![0; BLOCK_SIZE]);
    write(512, 128, &|_| vec![0; BLOCK_SIZE]);
    write(768, 64, &|_| vec![0; BLOCK_SIZE]);
    write(0, 128, &|b| text(b, 1));
    for variant in 1..7 {
        write(4096, 512, &|b| text(b, variant));
    }
    write(4352, 48, &|_| vec![0; BLOCK_SIZE]);
    // A 512-byte write inside a block (read-modify-write).
    let at = (5 << 20) + 1024;
    image[at..at + 512].fill(0xA5);
    image
}

fn unpack(name: &str) -> PathBuf {
    let fixture = format!("{}/tests/fixtures/{name}.zst", env!("CARGO_MANIFEST_DIR"));
    let packed = std::fs::read(&fixture).unwrap_or_else(|e| panic!("{fixture}: {e}"));
    let bytes = zstd::decode_all(packed.as_slice()).expect("fixture decompresses");
    let dir = std::env::temp_dir().join(format!("zdisk-format-v1-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn open(path: &std::path::Path, read_only: bool) -> Arc<Volume> {
    let media = FileMedia::open(path, read_only, zdisk_core::meta::geometry_in_slots)
        .expect("the medium opens");
    let options = OpenOptions {
        read_only,
        background: false,
        ..OpenOptions::default()
    };
    Volume::open(Arc::new(media) as Arc<dyn Media>, options).expect("the volume opens")
}

fn assert_contents(volume: &Volume, expected: &[u8]) {
    let mut actual = vec![0u8; LOGICAL_BYTES];
    volume.read(0, &mut actual).expect("every block reads");
    for (block, (want, got)) in expected
        .chunks(BLOCK_SIZE)
        .zip(actual.chunks(BLOCK_SIZE))
        .enumerate()
    {
        assert!(want == got, "block {block} differs from what was written");
    }
}

fn opens_reads_and_takes_writes(name: &str, written_clean: bool) {
    let path = unpack(name);
    let mut expected = expected();
    {
        let volume = open(&path, true);
        assert_eq!(volume.size_bytes(), LOGICAL_BYTES as u64);
        // Images older than format 6 did not deduplicate, and still do not.
        assert!(!volume.settings().dedup);
        let report = volume.open_report();
        assert_eq!(report.clean, written_clean, "{report:?}");
        assert_eq!(report.replayed_records > 0, !written_clean, "{report:?}");
        assert!(report.slot_problems.is_empty(), "{report:?}");
        assert_contents(&volume, &expected);
        let check = volume.check(true).expect("check runs");
        assert!(check.is_clean(), "{check:?}");
        assert!(check.extents_verified > 1000, "{check:?}");
    }
    {
        let volume = open(&path, false);
        assert_contents(&volume, &expected);
        let new = text(77, 9);
        volume.write(77 * BLOCK_SIZE as u64, &new, false).unwrap();
        volume
            .trim(2048 * BLOCK_SIZE as u64, BLOCK_SIZE as u64, false)
            .unwrap();
        expected[77 * BLOCK_SIZE..78 * BLOCK_SIZE].copy_from_slice(&new);
        expected[2048 * BLOCK_SIZE..2049 * BLOCK_SIZE].fill(0);
        volume.close().unwrap();
    }
    let volume = open(&path, true);
    assert!(volume.open_report().clean);
    assert_contents(&volume, &expected);
    assert!(volume.check(true).unwrap().is_clean());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_v1_image_closed_cleanly_opens_unchanged() {
    opens_reads_and_takes_writes("v1-clean.zdisk", true);
}

#[test]
fn a_v1_image_killed_after_a_flush_recovers_unchanged() {
    opens_reads_and_takes_writes("v1-crashed.zdisk", false);
}

#[test]
fn a_v2_image_closed_cleanly_opens_unchanged() {
    opens_reads_and_takes_writes("v2-clean.zdisk", true);
}

#[test]
fn a_v2_image_killed_after_a_flush_recovers_unchanged() {
    opens_reads_and_takes_writes("v2-crashed.zdisk", false);
}

#[test]
fn a_v3_image_closed_cleanly_opens_unchanged() {
    opens_reads_and_takes_writes("v3-clean.zdisk", true);
}

#[test]
fn a_v3_image_killed_after_a_flush_recovers_unchanged() {
    opens_reads_and_takes_writes("v3-crashed.zdisk", false);
}

#[test]
fn a_v4_image_closed_cleanly_opens_unchanged() {
    opens_reads_and_takes_writes("v4-clean.zdisk", true);
}

#[test]
fn a_v4_image_killed_after_a_flush_recovers_unchanged() {
    opens_reads_and_takes_writes("v4-crashed.zdisk", false);
}

#[test]
fn a_v5_image_closed_cleanly_opens_unchanged() {
    opens_reads_and_takes_writes("v5-clean.zdisk", true);
}

#[test]
fn a_v5_image_killed_after_a_flush_recovers_unchanged() {
    opens_reads_and_takes_writes("v5-crashed.zdisk", false);
}
