//! Engine tests against a reference model and for space management: random
//! operation sequences checked block by block, a thin volume driven to
//! ENOSPC and back, and the cleaner under sustained overwrites.

use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::device::BlockDevice;
use crate::media::{FileMedia, Media, MemMedia, FILE_DATA_OFFSET};
use crate::units::BLOCK_SIZE;
use crate::{CreateOptions, Error, OpenOptions, Volume};

const MIB: u64 = 1 << 20;

fn volume(segment_size: u64, segments: u32, logical: u64) -> (Arc<MemMedia>, Arc<Volume>) {
    let media = Arc::new(MemMedia::with_size(4096, segment_size, segments).unwrap());
    let options = OpenOptions {
        background: false,
        ..OpenOptions::default()
    };
    let volume = Volume::create(
        media.clone() as Arc<dyn Media>,
        CreateOptions::new(logical),
        options,
    )
    .unwrap();
    (media, volume)
}

fn random(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    rng.fill_bytes(&mut data);
    data
}

#[test]
fn thin_volume_fills_then_trim_gives_space_back() {
    let (_media, volume) = volume(256 * 1024, 252, 256 * MIB);
    let mut rng = SmallRng::seed_from_u64(1);
    let mut written = Vec::new();
    let mut offset = 0;
    loop {
        let data = random(&mut rng, MIB as usize);
        match volume.write(offset, &data, false) {
            Ok(()) => written.push((offset, data)),
            Err(Error::NoSpace { .. }) => break,
            Err(other) => panic!("unexpected error {other}"),
        }
        offset += MIB;
        assert!(offset < 256 * MIB, "never ran out of space");
    }
    let full_at = offset;
    let mut buf = vec![0u8; MIB as usize];
    for (offset, data) in &written {
        volume.read(*offset, &mut buf).unwrap();
        assert_eq!(&buf, data);
    }
    // Trim every other MiB, then the space must come back.
    let mut trimmed = Vec::new();
    let mut kept = Vec::new();
    for (i, (offset, data)) in written.into_iter().enumerate() {
        if i % 2 == 0 {
            volume.trim(offset, MIB, false).unwrap();
            trimmed.push(offset);
        } else {
            kept.push((offset, data));
        }
    }
    volume.flush().unwrap();
    for offset in trimmed.iter().take(trimmed.len() * 3 / 4) {
        let data = random(&mut rng, MIB as usize);
        if let Err(error) = volume.write(*offset, &data, false) {
            let stats = volume.stats();
            panic!(
                "rewrite at {offset} after trimming failed: {error}; full at {full_at}; {:?} {:?}",
                stats.segments_by_state, stats.sealed_utilization_histogram
            );
        }
        kept.push((*offset, data));
    }
    for (offset, data) in &kept {
        volume.read(*offset, &mut buf).unwrap();
        assert_eq!(&buf, data);
    }
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

/// A volume filled to what incompressible data can occupy and overwritten
/// until its spare area is gone, with no checkpoint asked for: its first
/// ones come when the cleaner, short of space, copies out of segments
/// recovery replays (no older dump is released to make up for the first
/// one), and one asked for then takes several segments. Random 4 KiB
/// overwrites must never fail. The cleaner takes no more segments than it
/// gives back, so it may always run, below its floor included.
#[test]
fn a_full_volume_keeps_cleaning_after_its_first_checkpoint() {
    const SEGMENT: u64 = 64 * 1024;
    const SEGMENTS: u32 = 1000;
    let block = BLOCK_SIZE as u64;
    let blocks_that_fit = {
        let raw_blocks = SEGMENTS as u64 * SEGMENT / crate::record::RAW_RECORD_LEN;
        let overhead = Volume::overhead_segments_for(raw_blocks, SEGMENTS as u64, SEGMENT);
        let usable = SEGMENTS as u64 - overhead - SEGMENTS as u64 / 8;
        // Records do not straddle segments.
        usable * (SEGMENT / crate::record::RAW_RECORD_LEN)
    };
    let logical = blocks_that_fit * block;
    let (_media, volume) = volume(SEGMENT, SEGMENTS, logical);
    let mut rng = SmallRng::seed_from_u64(7);
    let mut expected = vec![Vec::new(); blocks_that_fit as usize];
    let mut write = |volume: &Volume, lba: u64, rng: &mut SmallRng| {
        let data = random(rng, BLOCK_SIZE);
        if let Err(error) = volume.write(lba * block, &data, false) {
            let stats = volume.stats();
            panic!(
                "overwrite of block {lba} failed: {error}; {:?}",
                stats.segments_by_state
            );
        }
        expected[lba as usize] = data;
    };
    // Every block, then random overwrites: the map loses its runs, so the
    // first checkpoint's dump takes several segments.
    for lba in 0..blocks_that_fit {
        write(&volume, lba, &mut rng);
    }
    for _ in 0..blocks_that_fit {
        let lba = rng.gen_range(0..blocks_that_fit);
        write(&volume, lba, &mut rng);
    }
    volume.checkpoint().unwrap();
    let after = volume.stats().segments_by_state;
    assert!(
        after.checkpoint >= 4,
        "the dump should take several segments: {after:?}"
    );
    for _ in 0..blocks_that_fit {
        let lba = rng.gen_range(0..blocks_that_fit);
        write(&volume, lba, &mut rng);
    }
    let mut buf = vec![0u8; BLOCK_SIZE];
    for (lba, data) in expected.iter().enumerate() {
        volume.read(lba as u64 * block, &mut buf).unwrap();
        assert_eq!(&buf, data, "block {lba}");
    }
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

/// One operation of a random sequence checked against the model.
#[derive(Debug, Clone)]
enum Op {
    /// Write `blocks` blocks of the given kind of content at a block.
    Write {
        lba: u64,
        blocks: u64,
        kind: u8,
        seed: u64,
    },
    /// Write `len` bytes at a byte offset (exercises read-modify-write).
    WriteBytes {
        offset: u64,
        len: u64,
        seed: u64,
    },
    Trim {
        lba: u64,
        blocks: u64,
    },
    Zero {
        lba: u64,
        blocks: u64,
        punch: bool,
    },
    Read {
        offset: u64,
        len: u64,
    },
    Flush,
    Clean,
    Checkpoint,
    /// Clean shutdown and reopen: everything must survive exactly.
    Reopen,
}

fn op_strategy(blocks: u64) -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    let size = blocks * BLOCK_SIZE as u64;
    prop_oneof![
        6 => (0..blocks, 1..16u64, 0..4u8, any::<u64>())
            .prop_map(move |(lba, n, kind, seed)| Op::Write { lba, blocks: n.min(blocks - lba), kind, seed }),
        2 => (0..size, 1..20_000u64, any::<u64>())
            .prop_map(move |(offset, len, seed)| Op::WriteBytes { offset, len: len.min(size - offset), seed }),
        2 => (0..blocks, 1..32u64).prop_map(move |(lba, n)| Op::Trim { lba, blocks: n.min(blocks - lba) }),
        1 => (0..blocks, 1..32u64, any::<bool>())
            .prop_map(move |(lba, n, punch)| Op::Zero { lba, blocks: n.min(blocks - lba), punch }),
        3 => (0..size, 1..40_000u64).prop_map(move |(offset, len)| Op::Read { offset, len: len.min(size - offset) }),
        1 => Just(Op::Flush),
        1 => Just(Op::Clean),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Reopen),
    ]
}

fn block_content(kind: u8, seed: u64, index: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    match kind {
        0 => vec![0u8; BLOCK_SIZE],
        1 => random(&mut rng, BLOCK_SIZE),
        2 => {
            let word: u32 = rng.gen();
            (0..BLOCK_SIZE)
                .map(|i| (word >> (i % 4 * 8)) as u8 ^ (i / 700) as u8)
                .collect()
        }
        _ => {
            let mut block = vec![b'z'; BLOCK_SIZE];
            let half = rng.gen_range(0..BLOCK_SIZE);
            rng.fill_bytes(&mut block[..half]);
            block
        }
    }
}

/// Runs `ops` on a volume in RAM, or on a file at `file` (whose host reads
/// decode straight from its mapping), checking every read against a model.
fn run_against_model(ops: &[Op], file: Option<&std::path::Path>) {
    const BLOCKS: u64 = 192;
    const SEGMENT: u64 = 64 * 1024;
    let mut mem = Arc::new(MemMedia::with_size(4096, SEGMENT, 24).unwrap());
    let media: Arc<dyn Media> = match file {
        None => mem.clone(),
        Some(path) => {
            let size = FILE_DATA_OFFSET + 24 * SEGMENT;
            Arc::new(FileMedia::create(path, Some(size), SEGMENT, true).unwrap())
        }
    };
    let options = || OpenOptions {
        background: false,
        checkpoint_interval_bytes: 128 * 1024,
        ..OpenOptions::default()
    };
    let mut volume = Volume::create(
        media,
        CreateOptions::new(BLOCKS * BLOCK_SIZE as u64),
        options(),
    )
    .unwrap();
    let mut model = vec![0u8; (BLOCKS * BLOCK_SIZE as u64) as usize];
    for op in ops {
        match op.clone() {
            Op::Write {
                lba,
                blocks,
                kind,
                seed,
            } => {
                let data: Vec<u8> = (0..blocks)
                    .flat_map(|i| block_content(kind, seed, i))
                    .collect();
                match volume.write(lba * BLOCK_SIZE as u64, &data, false) {
                    Ok(()) => {
                        let at = (lba * BLOCK_SIZE as u64) as usize;
                        model[at..at + data.len()].copy_from_slice(&data);
                    }
                    Err(Error::NoSpace { .. }) => {}
                    Err(other) => panic!("{op:?}: {other}"),
                }
            }
            Op::WriteBytes { offset, len, seed } => {
                let data = random(&mut SmallRng::seed_from_u64(seed), len as usize);
                match volume.write(offset, &data, false) {
                    Ok(()) => {
                        model[offset as usize..(offset + len) as usize].copy_from_slice(&data)
                    }
                    Err(Error::NoSpace { .. }) => {}
                    Err(other) => panic!("{op:?}: {other}"),
                }
            }
            Op::Trim { lba, blocks } => {
                volume
                    .trim(lba * BLOCK_SIZE as u64, blocks * BLOCK_SIZE as u64, false)
                    .unwrap();
                let at = (lba * BLOCK_SIZE as u64) as usize;
                model[at..at + (blocks as usize * BLOCK_SIZE)].fill(0);
            }
            Op::Zero { lba, blocks, punch } => {
                volume
                    .write_zeroes(
                        lba * BLOCK_SIZE as u64,
                        blocks * BLOCK_SIZE as u64,
                        punch,
                        false,
                    )
                    .unwrap();
                let at = (lba * BLOCK_SIZE as u64) as usize;
                model[at..at + (blocks as usize * BLOCK_SIZE)].fill(0);
            }
            Op::Read { offset, len } => {
                let mut buf = vec![0u8; len as usize];
                volume.read(offset, &mut buf).unwrap();
                assert!(
                    buf == model[offset as usize..(offset + len) as usize],
                    "{op:?} returned wrong bytes"
                );
                if file.is_some() {
                    // Large enough to decode from the file's mapping.
                    let mut all = vec![0u8; model.len()];
                    volume.read(0, &mut all).unwrap();
                    assert!(all == model, "after {op:?}, a whole read differs");
                }
            }
            Op::Flush => volume.flush().unwrap(),
            Op::Clean => {
                volume.clean_one(0).unwrap();
            }
            Op::Checkpoint => volume.checkpoint().unwrap(),
            Op::Reopen => {
                volume.close().unwrap();
                // The old volume lets go of the file (and its lock) first.
                drop(volume);
                let media: Arc<dyn Media> = match file {
                    None => {
                        mem = Arc::new(mem.reopen());
                        mem.clone()
                    }
                    Some(path) => Arc::new(
                        FileMedia::open(path, false, crate::meta::geometry_in_slots).unwrap(),
                    ),
                };
                volume = Volume::open(media, options()).unwrap();
                assert_eq!(
                    volume.open_report().replayed_records,
                    0,
                    "a clean close leaves nothing to replay"
                );
            }
        }
    }
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
    let mut all = vec![0u8; model.len()];
    volume.read(0, &mut all).unwrap();
    assert!(all == model, "final contents differ from the model");
    let stats = volume.stats();
    let data_blocks = model
        .chunks(BLOCK_SIZE)
        .filter(|b| b.iter().any(|&x| x != 0))
        .count() as u64;
    assert_eq!(
        stats.mapped_bytes,
        data_blocks * BLOCK_SIZE as u64,
        "mapped_bytes counts the non-zero blocks"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    #[test]
    fn random_operations_match_the_model(ops in proptest::collection::vec(op_strategy(192), 1..120)) {
        run_against_model(&ops, None);
    }

    /// The same on a file, where host reads take the mapped path.
    #[test]
    fn random_operations_on_a_file_match_the_model(ops in proptest::collection::vec(op_strategy(192), 1..120)) {
        let path = std::env::temp_dir().join(format!("zdisk-model-{}", std::process::id()));
        run_against_model(&ops, Some(&path));
        std::fs::remove_file(&path).unwrap();
    }
}

/// A 1 TiB thin volume on 256 MiB of RAM, without background work,
/// whose map may keep `cache` bytes of leaves in RAM.
fn small_map_cache_volume(cache: u64) -> Arc<Volume> {
    let media = Arc::new(MemMedia::with_size(4096, 4 * MIB, 64).unwrap());
    let options = OpenOptions {
        background: false,
        map_cache_bytes: Some(cache),
        ..OpenOptions::default()
    };
    Volume::create(
        media as Arc<dyn Media>,
        CreateOptions::new(1 << 40),
        options,
    )
    .unwrap()
}

#[test]
fn dirty_map_leaves_past_the_cache_make_a_checkpoint_due() {
    // One block in every 257: every write lands in a leaf of its own, so
    // the map grows by a sparse leaf per write, all of them dirty.
    let cache = 64 * 1024;
    let volume = small_map_cache_volume(cache);
    let bound = (2 * cache).max(cache + MIB);
    let mut block = vec![7u8; BLOCK_SIZE];
    let mut lba = 0u64;
    while volume.stats().map_resident_bytes <= bound {
        block[..8].copy_from_slice(&lba.to_le_bytes());
        volume
            .write(lba * BLOCK_SIZE as u64, &block, false)
            .unwrap();
        lba += 257;
    }
    let before = volume.stats();
    assert_eq!(before.map_paged_leaves, 0, "dirty leaves are never evicted");
    // The log is far from the checkpoint interval; only the dirty leaves
    // make the background work checkpoint.
    while volume.maintenance_tick().unwrap() {}
    let after = volume.stats();
    assert!(
        after.map_pages_written > before.map_pages_written,
        "a checkpoint must have written the map's pages"
    );
    assert!(
        after.map_resident_bytes <= cache,
        "once written, leaves past the cache are evicted: {} bytes resident, cache {cache}",
        after.map_resident_bytes
    );
    assert!(after.map_paged_leaves > 0);
    // Every block still reads back.
    let mut read = vec![0u8; BLOCK_SIZE];
    for lba in (0..lba).step_by(257) {
        volume.read(lba * BLOCK_SIZE as u64, &mut read).unwrap();
        assert_eq!(read[..8], lba.to_le_bytes());
    }
}

/// A read whose map leaf is in RAM takes the state lock shared, never
/// exclusively (issue #23); one whose leaf is paged out takes it
/// exclusively to fault the leaf in, and shared again once it is there.
/// With the cache full, the first read of a paged-out leaf reads its page
/// under the shared lock alone and keeps nothing (a peek); the second
/// faults it in.
#[test]
fn a_read_takes_the_lock_exclusively_only_to_fault_its_map_leaf_in() {
    let cache = 64 * 1024;
    let volume = small_map_cache_volume(cache);
    let block = vec![7u8; BLOCK_SIZE];
    let mut read = vec![0u8; BLOCK_SIZE];
    volume.write(0, &block, false).unwrap();
    let before = volume.lock_profile();
    volume.read(0, &mut read).unwrap();
    let used = volume.lock_profile().since(&before);
    assert_eq!(read, block);
    assert_eq!((used.acquisitions, used.shared_acquisitions), (0, 1));

    // A leaf per write, until checkpoints page the oldest (block 0's) out.
    let mut lba = 257u64;
    while volume.stats().map_paged_leaves == 0 {
        for _ in 0..64 {
            volume
                .write(lba * BLOCK_SIZE as u64, &block, false)
                .unwrap();
            lba += 257;
        }
        while volume.maintenance_tick().unwrap() {}
    }
    // The cache is full: the first read of the leaf reads its page
    // without keeping the leaf (a peek), under the shared lock only.
    let stats = volume.stats();
    let before = volume.lock_profile();
    volume.read(0, &mut read).unwrap();
    let used = volume.lock_profile().since(&before);
    assert_eq!(read, block);
    let now = volume.stats();
    assert_eq!(now.map_cache_misses, stats.map_cache_misses + 1);
    assert_eq!(now.map_cache_peeks, stats.map_cache_peeks + 1);
    assert_eq!((used.acquisitions, used.shared_acquisitions), (0, 2));
    assert_eq!(now.map_paged_leaves, stats.map_paged_leaves);
    // Met again at once, the leaf is faulted in, exclusively.
    let before = volume.lock_profile();
    volume.read(0, &mut read).unwrap();
    let used = volume.lock_profile().since(&before);
    assert_eq!(read, block);
    let then = volume.stats();
    assert_eq!(then.map_cache_misses, now.map_cache_misses + 1);
    assert_eq!(then.map_cache_peeks, now.map_cache_peeks);
    assert!(
        used.acquisitions >= 1,
        "the fault takes the lock exclusively"
    );
    let before = volume.lock_profile();
    volume.read(0, &mut read).unwrap();
    let used = volume.lock_profile().since(&before);
    assert_eq!((used.acquisitions, used.shared_acquisitions), (0, 1));
}

/// A checkpoint writes the pages of the map leaves that changed, not the
/// whole map (format 4): the others keep their pages where an earlier
/// checkpoint wrote them, in dump segments the root still lists. Across
/// many checkpoints the dump segments stay bounded (a segment holding
/// under half a segment of needed pages has them moved and is released),
/// the check finds every dump segment accounted for, and a volume
/// reopened from the root, with a map cache that keeps nothing, reads
/// every block back from pages written by many different checkpoints.
#[test]
fn a_checkpoint_writes_only_the_map_pages_that_changed() {
    // Each leaf a dense chunk of 256 blocks, written whole; its page takes
    // about 100 bytes, so the map's pages fill several 64 KiB segments.
    const LEAVES: u64 = 2_000;
    const CHUNK: usize = 256;
    const SEGMENT: u64 = 64 * 1024;
    let media = Arc::new(MemMedia::with_size(4096, SEGMENT, 2048).unwrap());
    let options = || OpenOptions {
        background: false,
        map_cache_bytes: Some(0),
        ..OpenOptions::default()
    };
    let volume = Volume::create(
        media.clone() as Arc<dyn Media>,
        CreateOptions::new(1 << 40),
        options(),
    )
    .unwrap();
    let write = |volume: &Volume, leaf: u64, round: u64| {
        let mut chunk = vec![0x5Au8; CHUNK * BLOCK_SIZE];
        for (index, block) in chunk.chunks_mut(BLOCK_SIZE).enumerate() {
            block[..8].copy_from_slice(&leaf.to_le_bytes());
            block[8..16].copy_from_slice(&round.to_le_bytes());
            block[16..24].copy_from_slice(&(index as u64).to_le_bytes());
        }
        volume
            .write(leaf * (CHUNK * BLOCK_SIZE) as u64, &chunk, false)
            .unwrap();
    };
    let dump_segments = |volume: &Volume| {
        volume
            .lock()
            .space()
            .table()
            .iter()
            .filter(|(_, info)| info.state == crate::segments::SegmentState::Dump)
            .count()
    };
    let mut rounds = vec![0u64; LEAVES as usize];
    for leaf in 0..LEAVES {
        write(&volume, leaf, 0);
    }
    volume.checkpoint().unwrap();
    let full = volume.stats();
    assert!(
        full.map_pages_written >= LEAVES,
        "the first checkpoint writes every leaf: {} pages",
        full.map_pages_written
    );
    let full_bytes = full.counters.meta_write_bytes;
    let full_segments = dump_segments(&volume);
    // The pages half a segment holds (the dump is written twice).
    let page_bytes = full_bytes / 2 / full.map_pages_written;
    let half_segment_pages = SEGMENT / 2 / page_bytes;

    let mut rng = SmallRng::seed_from_u64(25);
    let (mut most_segments, mut most_pages, mut most_bytes, mut all_bytes) = (0, 0, 0, 0);
    for round in 1..=40u64 {
        let before = volume.stats();
        for _ in 0..20 {
            let leaf = rng.gen_range(0..LEAVES);
            rounds[leaf as usize] = round;
            write(&volume, leaf, round);
        }
        volume.checkpoint().unwrap();
        let after = volume.stats();
        let pages = after.map_pages_written - before.map_pages_written;
        let bytes = after.counters.meta_write_bytes - before.counters.meta_write_bytes;
        most_pages = most_pages.max(pages);
        most_bytes = most_bytes.max(bytes);
        all_bytes += bytes;
        // 20 changed leaves, plus the pages of the dump segments that fell
        // under half full (under half a segment's worth each: some rounds
        // move one or two), never the map's 2,000.
        assert!(
            pages <= 20 + 2 * half_segment_pages,
            "round {round}: {pages} pages written for 20 changed leaves"
        );
        assert!(
            bytes * 2 <= full_bytes,
            "round {round}: a checkpoint of 20 changed leaves wrote {bytes} bytes, \
             the whole map {full_bytes}"
        );
        let report = volume.check(false).unwrap();
        assert!(report.is_clean(), "round {round}: {:?}", report.errors);
        most_segments = most_segments.max(dump_segments(&volume));
    }
    // Kept pages fill their segments at least half, so the two retained
    // roots' dumps take at most about twice a full dump's segments each.
    assert!(
        most_segments <= 4 * full_segments,
        "{most_segments} dump segments, a full dump took {full_segments}"
    );
    eprintln!(
        "first checkpoint: {} pages of about {page_bytes} bytes, {full_bytes} bytes, \
         {full_segments} dump segments; \
         later ones at most {most_pages} pages, {most_bytes} bytes ({} on average), \
         {most_segments} dump segments",
        full.map_pages_written,
        all_bytes / 40
    );

    // Reopened from its root (after a crash: no clean checkpoint), with
    // nothing cached: every leaf is read back from the page its root names.
    volume.halt();
    drop(volume);
    let volume = Volume::open(media as Arc<dyn Media>, options()).unwrap();
    let mut read = vec![0u8; BLOCK_SIZE];
    for leaf in 0..LEAVES {
        for index in [0u64, 255] {
            let lba = leaf * CHUNK as u64 + index;
            volume.read(lba * BLOCK_SIZE as u64, &mut read).unwrap();
            assert_eq!(read[..8], leaf.to_le_bytes(), "leaf {leaf}");
            assert_eq!(
                read[8..16],
                rounds[leaf as usize].to_le_bytes(),
                "leaf {leaf}"
            );
            assert_eq!(read[16..24], index.to_le_bytes(), "leaf {leaf}");
        }
    }
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{:?}", report.errors);
}
