//! Snapshots and clones against a model: random writes (with duplicates,
//! so that dedup shares contents), trims, zeroes, snapshots taken and
//! deleted, clones of them made, written, snapshotted and deleted,
//! cleaning, checkpoints and power cuts; every snapshot, clone and the
//! volume read back as the model says, and `check` finds nothing wrong.

use std::collections::HashMap;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::device::{BlockDevice, ExtentState, Stored};
use crate::map::{Location, Slot};
use crate::media::{CrashConfig, Media, MemMedia};
use crate::record::decode_record;
use crate::segments::SegmentState;
use crate::units::{Lba, SegmentId, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::{CreateOptions, OpenOptions, Volume};

use super::clean::roomy;
use super::moves::{apply, plan_record, Move};

const BLOCKS: u64 = 2048;

fn options() -> OpenOptions {
    OpenOptions {
        background: false,
        ..OpenOptions::default()
    }
}

fn create(segment_size: u64, segments: u32, dedup: bool) -> (Arc<MemMedia>, Arc<Volume>) {
    let media = Arc::new(MemMedia::with_size(4096, segment_size, segments).unwrap());
    let create = CreateOptions {
        dedup,
        ..CreateOptions::new(BLOCKS * BLOCK_SIZE_U64)
    };
    let volume = Volume::create(media.clone() as Arc<dyn Media>, create, options()).unwrap();
    (media, volume)
}

/// Block contents by seed: 0 is zeros; a seed repeats its bytes, so equal
/// seeds are duplicates. Half compressible, half not.
fn content(seed: u64) -> Vec<u8> {
    if seed == 0 {
        return vec![0u8; BLOCK_SIZE];
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut block = vec![0u8; BLOCK_SIZE];
    rng.fill(&mut block[..BLOCK_SIZE / 2]);
    for (i, byte) in block[BLOCK_SIZE / 2..].iter_mut().enumerate() {
        *byte = (seed as u8).wrapping_add((i / 64) as u8);
    }
    block
}

/// What every block of the volume, of each snapshot and of each clone
/// holds (seeds).
#[derive(Default)]
struct Model {
    volume: Vec<u64>,
    snapshots: Vec<(String, Vec<u64>)>,
    /// The clone each snapshot was taken of, by snapshot name.
    of: HashMap<String, String>,
    /// Clones: name, the snapshot it was made from, its blocks.
    clones: Vec<(String, String, Vec<u64>)>,
}

impl Model {
    fn new() -> Model {
        Model {
            volume: vec![0; BLOCKS as usize],
            ..Model::default()
        }
    }

    /// The blocks of clone `at`, or of the volume.
    fn blocks_mut(&mut self, clone: Option<usize>) -> &mut Vec<u64> {
        match clone {
            Some(at) => &mut self.clones[at].2,
            None => &mut self.volume,
        }
    }

    fn check(&self, volume: &Arc<Volume>, context: &str) {
        let mut buf = vec![0u8; BLOCKS as usize * BLOCK_SIZE];
        volume.read(0, &mut buf).unwrap();
        compare(&buf, &self.volume, &format!("{context}: the volume"));
        for (name, seeds) in &self.snapshots {
            let device = volume.snapshot_device(name).unwrap();
            device.read(0, &mut buf).unwrap();
            compare(&buf, seeds, &format!("{context}: snapshot {name}"));
            compare_status(&device, seeds, &format!("{context}: snapshot {name}"));
        }
        let names: Vec<String> = volume
            .snapshots()
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        let want: Vec<String> = self.snapshots.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names, want, "{context}: the snapshots listed");
        for (name, _, seeds) in &self.clones {
            let device = volume.clone_device(name).unwrap();
            device.read(0, &mut buf).unwrap();
            compare(&buf, seeds, &format!("{context}: clone {name}"));
            compare_status(&device, seeds, &format!("{context}: clone {name}"));
            // The walk of its view counts the blocks of data it sees.
            let mapped = volume.clone_mapped(name).unwrap();
            let data = seeds.iter().filter(|&&seed| seed != 0).count() as u64;
            assert_eq!(mapped.mapped_blocks, data, "{context}: clone {name}");
            assert_eq!(
                mapped.own_data_blocks + mapped.shared_blocks,
                mapped.mapped_blocks
            );
        }
        let names: Vec<String> = volume
            .clones()
            .unwrap()
            .into_iter()
            .map(|c| c.name)
            .collect();
        let want: Vec<String> = self.clones.iter().map(|(n, _, _)| n.clone()).collect();
        assert_eq!(names, want, "{context}: the clones listed");
        let report = volume.check(true).unwrap();
        assert!(report.is_clean(), "{context}: {report:?}");
    }
}

/// A device's block status and stored status against the model: data
/// where a block holds a non-zero seed, a hole or zeros elsewhere.
fn compare_status(device: &dyn BlockDevice, seeds: &[u64], what: &str) {
    let end = seeds.len() as u64 * BLOCK_SIZE_U64;
    let (mut allocation, mut stored) = (Vec::new(), Vec::new());
    let mut offset = 0;
    while offset < end {
        let extents = device.block_status(offset, end - offset, 7).unwrap();
        assert!(!extents.is_empty(), "{what}: no extent at {offset}");
        for extent in extents {
            let data = extent.state == ExtentState::Data;
            allocation.extend((0..extent.length_bytes / BLOCK_SIZE_U64).map(|_| data));
            offset += extent.length_bytes;
        }
    }
    offset = 0;
    while offset < end {
        let extents = device.stored_status(offset, end - offset, 5).unwrap();
        assert!(!extents.is_empty(), "{what}: no stored extent at {offset}");
        for extent in extents {
            let data = !matches!(extent.stored, Stored::Hole | Stored::Zero);
            stored.extend((0..extent.length_bytes / BLOCK_SIZE_U64).map(|_| data));
            offset += extent.length_bytes;
        }
    }
    for (lba, &seed) in seeds.iter().enumerate() {
        assert_eq!(allocation[lba], seed != 0, "{what}: block {lba}'s status");
        assert_eq!(
            stored[lba],
            seed != 0,
            "{what}: block {lba}'s stored status"
        );
    }
}

fn compare(buf: &[u8], seeds: &[u64], what: &str) {
    for (lba, &seed) in seeds.iter().enumerate() {
        let got = &buf[lba * BLOCK_SIZE..(lba + 1) * BLOCK_SIZE];
        assert!(
            got == &content(seed)[..],
            "{what}: block {lba} does not hold seed {seed}"
        );
    }
}

#[test]
fn snapshots_see_what_was_there_through_cleaning_checkpoints_and_crashes() {
    // ZDISK_SNAPSHOT_SEEDS=n runs n seeds (8 by default).
    let seeds = std::env::var("ZDISK_SNAPSHOT_SEEDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(8u64);
    // ZDISK_SNAPSHOT_SEED=n runs that seed alone; with
    // ZDISK_SNAPSHOT_TRACE=lba it prints every step touching block lba.
    let only: Option<u64> = std::env::var("ZDISK_SNAPSHOT_SEED")
        .ok()
        .and_then(|n| n.parse().ok());
    let trace: Option<u64> = std::env::var("ZDISK_SNAPSHOT_TRACE")
        .ok()
        .and_then(|n| n.parse().ok());
    let seeds = match only {
        Some(seed) => seed..seed + 1,
        None => 0..seeds,
    };
    for seed in seeds {
        let mut rng = SmallRng::seed_from_u64(seed);
        let dedup = seed % 2 == 0;
        let (mut media, mut volume) = create(64 * 1024, 768, dedup);
        let mut model = Model::new();
        let mut taken = 0;
        for step in 0..1200 {
            let roll: u32 = rng.gen_range(0..100);
            // Writes go to a clone a third of the time there is one.
            let clone = (!model.clones.is_empty() && rng.gen_bool(0.35))
                .then(|| rng.gen_range(0..model.clones.len()));
            let clone_device;
            let device: &dyn BlockDevice = match clone {
                Some(at) => {
                    clone_device = volume.clone_device(&model.clones[at].0).unwrap();
                    &clone_device
                }
                None => &*volume,
            };
            if roll < 60 {
                let lba = rng.gen_range(0..BLOCKS);
                let count = rng.gen_range(1..=16).min(BLOCKS - lba);
                // Few distinct seeds: duplicates for dedup to share.
                let seeds: Vec<u64> = (0..count).map(|_| rng.gen_range(1..400u64)).collect();
                let data: Vec<u8> = seeds.iter().flat_map(|&s| content(s)).collect();
                device.write(lba * BLOCK_SIZE_U64, &data, false).unwrap();
                model.blocks_mut(clone)[lba as usize..(lba + count) as usize]
                    .copy_from_slice(&seeds);
            } else if roll < 68 {
                let lba = rng.gen_range(0..BLOCKS);
                let count = rng.gen_range(1..=300).min(BLOCKS - lba);
                let (offset, len) = (lba * BLOCK_SIZE_U64, count * BLOCK_SIZE_U64);
                if rng.gen_bool(0.5) {
                    device.trim(offset, len, false).unwrap();
                } else {
                    device.write_zeroes(offset, len, false, false).unwrap();
                }
                model.blocks_mut(clone)[lba as usize..(lba + count) as usize].fill(0);
            } else if roll < 74 && model.snapshots.len() < 6 {
                taken += 1;
                let name = format!("s{taken}");
                match clone {
                    Some(at) => {
                        let of = model.clones[at].0.clone();
                        volume.take_snapshot_of(&of, &name).unwrap();
                        model.of.insert(name.clone(), of);
                    }
                    None => {
                        volume.take_snapshot(&name).unwrap();
                    }
                }
                let seeds = model.blocks_mut(clone).clone();
                model.snapshots.push((name, seeds));
            } else if roll < 76 && !model.snapshots.is_empty() && model.clones.len() < 3 {
                let at = rng.gen_range(0..model.snapshots.len());
                let (base, seeds) = model.snapshots[at].clone();
                taken += 1;
                let name = format!("c{taken}");
                volume.make_clone(&base, &name).unwrap();
                model.clones.push((name, base, seeds));
            } else if roll < 77 && !model.clones.is_empty() {
                let at = rng.gen_range(0..model.clones.len());
                let name = model.clones[at].0.clone();
                if model.of.values().any(|of| *of == name) {
                    let refused = volume.delete_clone(&name).unwrap_err().to_string();
                    assert!(refused.contains("has snapshots"), "{refused}");
                } else {
                    volume.delete_clone(&name).unwrap();
                    model.clones.remove(at);
                }
            } else if roll < 78 && !model.snapshots.is_empty() {
                let at = rng.gen_range(0..model.snapshots.len());
                let name = model.snapshots[at].0.clone();
                if model.clones.iter().any(|(_, base, _)| *base == name) {
                    let refused = volume.delete_snapshot(&name).unwrap_err().to_string();
                    assert!(refused.contains("has clones"), "{refused}");
                    continue;
                }
                model.snapshots.remove(at);
                model.of.remove(&name);
                let listed = volume.snapshots().unwrap();
                let info = listed.iter().find(|s| s.name == name).unwrap();
                let deleted = volume.delete_snapshot(&name).unwrap();
                // `zdisk volumes` said what deleting it would free.
                assert_eq!(deleted.freed, info.frees_blocks, "seed {seed}: {info:?}");
                assert_eq!(deleted.freed + deleted.handed_down, info.kept_blocks);
            } else if roll < 90 {
                // A few victims with a quarter of a segment of garbage.
                for _ in 0..4 {
                    if !volume.clean_one(16 * 1024).unwrap() {
                        break;
                    }
                }
            } else if roll < 92 {
                volume.checkpoint().unwrap();
            } else if roll < 94 {
                // The cold-data pass rewrites whole runs of blocks.
                for _ in 0..4 {
                    volume.idle_step().unwrap();
                }
            } else {
                // Everything flushed survives a power cut exactly.
                volume.flush().unwrap();
                drop(volume);
                let crashed = media.crash(&mut rng, CrashConfig::default());
                media = Arc::new(crashed);
                volume = Volume::open(media.clone() as Arc<dyn Media>, options()).unwrap();
            }
            if let Some(lba) = trace {
                let seeds: Vec<u64> = model
                    .snapshots
                    .iter()
                    .map(|(_, s)| s[lba as usize])
                    .collect();
                let mut state = volume.lock();
                let spaces: Vec<u16> = state.snapshots().list().iter().map(|s| s.space).collect();
                state.load_map(crate::Lba(lba), 1).unwrap();
                for space in spaces {
                    state
                        .load_map(crate::map::space_key(space, lba), 1)
                        .unwrap();
                }
                let entries: Vec<String> = state
                    .snapshots()
                    .list()
                    .iter()
                    .map(|s| {
                        let own = state.map().get(crate::map::space_key(s.space, lba));
                        let seen = state.snapshot_entry(s.space, crate::Lba(lba));
                        format!(
                            "{}@{}: own {:?} v{} sees {:?} v{}",
                            s.name,
                            s.version,
                            own.slot(),
                            own.version(),
                            seen.slot(),
                            seen.version()
                        )
                    })
                    .collect();
                let live = state.map().get(crate::Lba(lba));
                println!(
                    "step {step} roll {roll}: model {} snapshots {seeds:?}; volume {:?} v{}; {entries:?}",
                    model.volume[lba as usize],
                    live.slot(),
                    live.version()
                );
            }
            if step % 50 == 49 {
                model.check(&volume, &format!("seed {seed} step {step}"));
            }
        }
        model.check(&volume, &format!("seed {seed} at the end"));
        let stats = volume.stats();
        println!(
            "seed {seed}: {taken} snapshots taken, {} kept blocks, {} segments cleaned, {} recoveries",
            stats.snapshot_kept_blocks, stats.counters.segments_cleaned, stats.counters.recoveries
        );
        assert!(
            stats.counters.segments_cleaned > 0,
            "seed {seed} cleaned nothing"
        );
        // Deleting every snapshot and clone (each clone before its
        // snapshot, each snapshot of a clone before the clone) leaves the
        // volume's own stored bytes.
        while !model.snapshots.is_empty() || !model.clones.is_empty() {
            if let Some(at) = model
                .clones
                .iter()
                .position(|(name, _, _)| !model.of.values().any(|of| of == name))
            {
                let (name, _, _) = model.clones.remove(at);
                volume.delete_clone(&name).unwrap();
            }
            if let Some(at) = model
                .snapshots
                .iter()
                .position(|(name, _)| !model.clones.iter().any(|(_, base, _)| base == name))
            {
                let (name, _) = model.snapshots.remove(at);
                model.of.remove(&name);
                volume.delete_snapshot(&name).unwrap();
            }
        }
        let stats = volume.stats();
        assert_eq!(stats.snapshots, 0);
        assert_eq!(stats.clones, 0);
        assert_eq!(stats.clone_blocks, 0, "seed {seed}");
        assert_eq!(stats.clone_bytes, 0, "seed {seed}");
        assert_eq!(stats.snapshot_kept_blocks, 0, "seed {seed}");
        assert_eq!(stats.snapshot_kept_bytes, 0, "seed {seed}");
        model.check(&volume, &format!("seed {seed} without snapshots"));
        volume.close().unwrap();
        let volume = Volume::open(media as Arc<dyn Media>, options()).unwrap();
        model.check(&volume, &format!("seed {seed} reopened"));
    }
}

fn at(lba: u64) -> u64 {
    lba * BLOCK_SIZE_U64
}

/// The segment block `lba`'s data is in.
fn segment_of(volume: &Volume, lba: u64) -> SegmentId {
    match volume.lock().map().get(Lba(lba)).slot() {
        Slot::Data(loc) => loc.segment,
        other => panic!("block {lba}: {other:?}"),
    }
}

/// Block `lba` as the volume, or its snapshot `snapshot`, reads it.
fn read_block(volume: &Arc<Volume>, snapshot: Option<&str>, lba: u64) -> Vec<u8> {
    let mut buf = vec![0xA5u8; BLOCK_SIZE];
    match snapshot {
        Some(name) => volume
            .snapshot_device(name)
            .unwrap()
            .read(at(lba), &mut buf),
        None => volume.read(at(lba), &mut buf),
    }
    .unwrap();
    buf
}

/// Asserts that the volume's block `lba` reads `expected` and that
/// `check` finds nothing wrong.
fn assert_clean_with(volume: &Arc<Volume>, lba: u64, expected: &[u8]) {
    assert!(
        read_block(volume, None, lba) == expected,
        "the volume's block {lba}"
    );
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

/// Cuts the power under `volume` (dropped), crash model seeded with
/// `seed`, and opens what the medium kept.
fn power_cut(media: &MemMedia, volume: Arc<Volume>, seed: u64) -> Arc<Volume> {
    drop(volume);
    let mut rng = SmallRng::seed_from_u64(seed);
    let crashed = Arc::new(media.crash(&mut rng, CrashConfig::default()));
    Volume::open(crashed as Arc<dyn Media>, options()).unwrap()
}

/// Makes a victim that the cleaner scans: `fill` writes its live data
/// (below block `BLOCKS - 256`, above the filler) and returns its
/// segment; a trim of the last block adds a range record (a victim a
/// retained root replays is scanned if it holds one), and filler seals
/// it and is overwritten, so it is mostly garbage. Then live data until
/// the cleaner may no longer wait for checkpoints. Returns the victim and
/// a test of whether it is still sealed.
fn fill_around_scanned_victim(
    volume: &Volume,
    fill: impl FnOnce(&Volume) -> SegmentId,
) -> (SegmentId, impl Fn(&Volume) -> bool) {
    let trimmed = BLOCKS - 1;
    volume.write(at(trimmed), &content(7), false).unwrap();
    let victim = fill(volume);
    volume.trim(at(trimmed), BLOCK_SIZE_U64, false).unwrap();
    let sealed =
        move |volume: &Volume| volume.lock().space().segment(victim).state == SegmentState::Sealed;
    let mut lba = 1;
    while !sealed(volume) {
        volume.write(at(lba), &content(lba + 1), false).unwrap();
        lba += 1;
    }
    for filler in 1..lba {
        volume
            .write(at(filler), &content(filler + 500), false)
            .unwrap();
    }
    while roomy(&volume.lock()) {
        assert!(lba < BLOCKS - 256, "the volume never filled");
        volume.write(at(lba), &content(lba + 1), false).unwrap();
        lba += 1;
    }
    (victim, sealed)
}

/// Cleans `victim`, which a retained root replays, short of space (the
/// cleaner cannot wait for checkpoints), and asserts that it did.
fn clean_at_once(volume: &Volume, victim: SegmentId, sealed: &impl Fn(&Volume) -> bool) {
    {
        let state = volume.lock();
        assert!(
            state.needed_by_recovery(victim),
            "no root replays the victim"
        );
        assert!(!roomy(&state), "the cleaner would wait for checkpoints");
    }
    assert!(volume.clean_one(32 * 1024).unwrap());
    assert!(!sealed(volume), "segment {victim} was not cleaned");
}

/// A victim that a retained root still replays and that holds a range
/// record is scanned when it is cleaned short of space (no checkpoint to
/// wait for). A data record in it whose entry a snapshot keeps must be
/// rewritten naming the snapshot's key, never copied naming the volume's
/// block: the snapshot's deletion, logged in the host segment opened
/// before the copy's GC segment, is replayed first, and the copy then
/// passed for a write of a block trimmed before the checkpoint (which
/// knows it only as a hole): the trimmed data came back.
#[test]
fn a_scanned_victim_never_copies_a_member_a_snapshot_keeps_unchanged() {
    let (media, volume) = create(64 * 1024, 40, false);
    // The victim: a block of a sparse map leaf (whose holes the
    // checkpoint does not store), a trim and filler.
    let kept = BLOCKS - 200;
    let (victim, sealed) = fill_around_scanned_victim(&volume, |volume| {
        volume.write(at(kept), &content(1), false).unwrap();
        segment_of(volume, kept)
    });
    volume.take_snapshot("s").unwrap();
    // The snapshot keeps the block's entry; the checkpoint knows the
    // block as a hole, without the trim's version.
    volume.trim(at(kept), BLOCK_SIZE_U64, false).unwrap();
    volume.checkpoint().unwrap();
    clean_at_once(&volume, victim, &sealed);
    volume.delete_snapshot("s").unwrap();
    volume.flush().unwrap();
    let mut buf = vec![0xA5u8; BLOCK_SIZE];
    volume.read(at(kept), &mut buf).unwrap();
    assert!(is_zero(&buf), "before the power cut");
    let volume = power_cut(&media, volume, 1);
    buf.fill(0xA5);
    volume.read(at(kept), &mut buf).unwrap();
    assert!(is_zero(&buf), "block {kept}, trimmed, came back");
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

/// A zero range in a victim that the newest root replays, taken by a
/// snapshot before the block was written again: the snapshot keeps the
/// zero entry, so the record still decides what it sees, though the
/// volume's block is newer. Cleaned (it holds no live data), the victim
/// must not be reused before a checkpoint: a replay without the zero
/// range kept the block's older data for the snapshot when it replayed
/// the write.
#[test]
fn a_replayed_zero_range_a_snapshot_keeps_outlives_its_victim() {
    let (media, volume) = create(64 * 1024, 40, false);
    let state_of = |volume: &Volume, segment| volume.lock().space().segment(segment).state;
    // Block 0's data, in a segment sealed before the checkpoint.
    volume.write(at(0), &content(1), false).unwrap();
    let first = segment_of(&volume, 0);
    let mut last = 100;
    while state_of(&volume, first) != SegmentState::Sealed {
        volume.write(at(last), &content(last + 1), false).unwrap();
        last += 1;
    }
    last -= 1;
    volume.checkpoint().unwrap();
    // The victim: a zero range over block 0, and filler overwritten later.
    volume
        .write_zeroes(at(0), BLOCK_SIZE_U64, false, false)
        .unwrap();
    volume.write(at(1), &content(2), false).unwrap();
    let victim = segment_of(&volume, 1);
    let mut lba = 2;
    while state_of(&volume, victim) != SegmentState::Sealed {
        volume.write(at(lba), &content(lba + 1), false).unwrap();
        lba += 1;
    }
    for filler in (1..lba).chain([last]) {
        volume
            .write(at(filler), &content(filler + 500), false)
            .unwrap();
    }
    volume.take_snapshot("s").unwrap();
    // The snapshot keeps the zero entry.
    volume.write(at(0), &content(3), false).unwrap();
    volume.flush().unwrap();
    let seq = {
        let state = volume.lock();
        assert!(
            state.needed_by_recovery(victim),
            "no root replays the victim"
        );
        let info = state.space().segment(victim);
        assert!(info.holds_ranges && info.live_bytes == 0, "{info:?}");
        info.seq
    };
    assert!(volume.clean_one(32 * 1024).unwrap());
    assert_ne!(
        state_of(&volume, victim),
        SegmentState::Sealed,
        "segment {victim} was not cleaned"
    );
    // Writes until the victim's segment is taken again, if it may be.
    let mut round = 0u64;
    while volume.lock().space().segment(victim).seq == seq {
        round += 1;
        assert!(round < 4000, "segment {victim} never came back");
        let block = 1000 + round % 16;
        volume
            .write(at(block), &content(round % 300 + 1), false)
            .unwrap();
    }
    volume.flush().unwrap();
    assert!(
        is_zero(&read_block(&volume, Some("s"), 0)),
        "before the power cut"
    );
    let volume = power_cut(&media, volume, 1);
    let snapshot = read_block(&volume, Some("s"), 0);
    assert!(is_zero(&snapshot), "the snapshot lost the zeros it took");
    assert_clean_with(&volume, 0, &content(3));
}

/// A settled victim's member a snapshot keeps is rewritten naming the
/// snapshot's key into the GC stream's open segment, opened after the
/// checkpoint but before the host segment holding the snapshot's record:
/// a replay meets the rewrite first, before it knows the snapshot. It
/// finds the entry at the rewrite's version in the checkpoint (the
/// volume's block: versions are unique) and moves it, so the write after
/// the snapshot keeps it for the snapshot as before the power cut.
#[test]
fn a_rewritten_kept_member_is_replayed_after_its_snapshot() {
    let (media, volume) = create(64 * 1024, 64, false);
    let sealed = |volume: &Volume, segment| {
        volume.lock().space().segment(segment).state == SegmentState::Sealed
    };
    let seq_of = |volume: &Volume, segment| volume.lock().space().segment(segment).seq;
    // A first victim: block 100 and filler.
    volume.write(at(100), &content(100), false).unwrap();
    let early = segment_of(&volume, 100);
    let mut lba = 101;
    while !sealed(&volume, early) {
        volume.write(at(lba), &content(lba), false).unwrap();
        lba += 1;
    }
    let early_end = lba;
    // The victim: block 0 and filler.
    volume.write(at(0), &content(1), false).unwrap();
    let victim = segment_of(&volume, 0);
    while !sealed(&volume, victim) {
        volume.write(at(lba), &content(lba), false).unwrap();
        lba += 1;
    }
    for filler in 101..early_end {
        volume
            .write(at(filler), &content(filler + 500), false)
            .unwrap();
    }
    // No retained root replays either.
    volume.checkpoint().unwrap();
    volume.checkpoint().unwrap();
    {
        let state = volume.lock();
        assert!(!state.needed_by_recovery(early) && !state.needed_by_recovery(victim));
    }
    // Cleaning the first opens a GC segment after the checkpoints.
    assert!(volume.clean_one(32 * 1024).unwrap());
    assert!(!sealed(&volume, early), "segment {early} was not cleaned");
    let gc = segment_of(&volume, 100);
    for filler in early_end - 1..lba {
        volume
            .write(at(filler), &content(filler + 500), false)
            .unwrap();
    }
    // The host stream moves on to a segment opened after it.
    let mut fresh = 1200;
    loop {
        volume.write(at(fresh), &content(fresh), false).unwrap();
        let host = segment_of(&volume, fresh);
        if seq_of(&volume, host) > seq_of(&volume, gc) {
            break;
        }
        fresh += 1;
        assert!(fresh < BLOCKS, "the host stream stayed behind");
    }
    volume.take_snapshot("s").unwrap();
    // The snapshot keeps block 0's entry.
    volume.write(at(0), &content(2), false).unwrap();
    assert!(volume.clean_one(32 * 1024).unwrap());
    assert!(!sealed(&volume, victim), "segment {victim} was not cleaned");
    volume.flush().unwrap();
    assert!(
        read_block(&volume, Some("s"), 0) == content(1),
        "before the power cut"
    );
    let volume = power_cut(&media, volume, 1);
    let snapshot = read_block(&volume, Some("s"), 0);
    assert!(snapshot == content(1), "the snapshot lost block 0");
    assert_clean_with(&volume, 0, &content(2));
}

#[test]
fn taking_a_snapshot_writes_a_record_whatever_the_volume_holds() {
    let mut costs = HashMap::new();
    for mapped_blocks in [64u64, 2048] {
        let (_media, volume) = create(256 * 1024, 256, false);
        let data: Vec<u8> = (0..mapped_blocks).flat_map(|s| content(s + 1)).collect();
        volume.write(0, &data, false).unwrap();
        volume.checkpoint().unwrap();
        let before = volume.stats().counters.media_write_bytes;
        volume.take_snapshot("now").unwrap();
        let cost = volume.stats().counters.media_write_bytes - before;
        costs.insert(mapped_blocks, cost);
        // The record and the flush's padding or staging: a page at most.
        assert!(cost <= 8192, "{mapped_blocks} blocks: {cost} bytes");
    }
    assert_eq!(costs[&64], costs[&2048], "{costs:?}");
}

#[test]
fn a_snapshot_is_durable_when_taken_and_unflushed_writes_after_it_never_reach_it() {
    let (media, volume) = create(256 * 1024, 256, true);
    let old: Vec<u8> = (1..=32).flat_map(content).collect();
    volume.write(0, &old, false).unwrap();
    volume.take_snapshot("before").unwrap();
    let new: Vec<u8> = (100..132).flat_map(content).collect();
    volume.write(0, &new, false).unwrap();
    volume
        .trim(32 * BLOCK_SIZE_U64, 8 * BLOCK_SIZE_U64, false)
        .unwrap();
    drop(volume);
    // Nothing flushed after the snapshot: any subset of it may survive.
    let mut rng = SmallRng::seed_from_u64(7);
    let crashed = Arc::new(media.crash(&mut rng, CrashConfig::default()));
    let volume = Volume::open(crashed as Arc<dyn Media>, options()).unwrap();
    let mut buf = vec![0u8; 32 * BLOCK_SIZE];
    volume
        .snapshot_device("before")
        .unwrap()
        .read(0, &mut buf)
        .unwrap();
    assert!(buf == old, "the snapshot lost what it held");
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

#[test]
fn snapshot_errors_are_clear() {
    let (_media, volume) = create(256 * 1024, 64, false);
    volume.take_snapshot("a").unwrap();
    let twice = volume.take_snapshot("a").unwrap_err().to_string();
    assert!(twice.contains("exists already"), "{twice}");
    let bad = volume.take_snapshot("a b").unwrap_err().to_string();
    assert!(bad.contains("letters, digits"), "{bad}");
    let missing = volume.delete_snapshot("nope").unwrap_err().to_string();
    assert!(missing.contains("no snapshot named \"nope\""), "{missing}");
    assert!(volume.snapshot_device("nope").is_err());
    let device = volume.snapshot_device("a").unwrap();
    assert!(device.write(0, &[0u8; 4096], false).is_err());
    assert!(device.is_read_only());
}

#[test]
fn making_a_clone_writes_a_record_whatever_the_volume_holds() {
    let mut costs = HashMap::new();
    for mapped_blocks in [64u64, 2048] {
        let (_media, volume) = create(256 * 1024, 256, false);
        let data: Vec<u8> = (0..mapped_blocks).flat_map(|s| content(s + 1)).collect();
        volume.write(0, &data, false).unwrap();
        volume.take_snapshot("golden").unwrap();
        volume.checkpoint().unwrap();
        let before = volume.stats().counters.media_write_bytes;
        volume.make_clone("golden", "vm").unwrap();
        let cost = volume.stats().counters.media_write_bytes - before;
        costs.insert(mapped_blocks, cost);
        assert!(cost <= 8192, "{mapped_blocks} blocks: {cost} bytes");
        // The clone holds nothing of its own yet.
        let stats = volume.stats();
        assert_eq!((stats.clones, stats.clone_blocks), (1, 0));
    }
    assert_eq!(costs[&64], costs[&2048], "{costs:?}");
}

/// A clone reads as its snapshot until written; what it writes, trims and
/// zeroes is its own, flushed writes survive a power cut, and the volume
/// and the snapshot never see any of it.
#[test]
fn a_clone_reads_as_its_snapshot_until_written_and_keeps_what_it_flushed() {
    let (media, volume) = create(256 * 1024, 256, true);
    let old: Vec<u8> = (1..=32).flat_map(content).collect();
    volume.write(0, &old, false).unwrap();
    volume.take_snapshot("golden").unwrap();
    volume.make_clone("golden", "vm").unwrap();
    let vm = volume.clone_device("vm").unwrap();
    let mut buf = vec![0u8; 32 * BLOCK_SIZE];
    vm.read(0, &mut buf).unwrap();
    assert!(buf == old, "a new clone reads as its snapshot");
    let new: Vec<u8> = (100..108).flat_map(content).collect();
    vm.write(0, &new, false).unwrap();
    vm.trim(8 * BLOCK_SIZE_U64, 4 * BLOCK_SIZE_U64, false)
        .unwrap();
    vm.write(12 * BLOCK_SIZE_U64 + 512, &[7u8; 1024], false)
        .unwrap();
    vm.flush().unwrap();
    let mut want = old.clone();
    want[..8 * BLOCK_SIZE].copy_from_slice(&new);
    want[8 * BLOCK_SIZE..12 * BLOCK_SIZE].fill(0);
    want[12 * BLOCK_SIZE + 512..12 * BLOCK_SIZE + 1536].fill(7);
    // The volume moves on; the clone does not see it.
    volume
        .write(20 * BLOCK_SIZE_U64, &content(500), false)
        .unwrap();
    drop((vm, volume));
    let mut rng = SmallRng::seed_from_u64(3);
    let crashed = Arc::new(media.crash(&mut rng, CrashConfig::default()));
    let volume = Volume::open(crashed as Arc<dyn Media>, options()).unwrap();
    let vm = volume.clone_device("vm").unwrap();
    vm.read(0, &mut buf).unwrap();
    assert!(buf == want, "the clone lost what it flushed");
    volume
        .snapshot_device("golden")
        .unwrap()
        .read(0, &mut buf)
        .unwrap();
    assert!(buf == old, "the snapshot saw the clone's writes");
    volume.read(0, &mut buf[..8 * BLOCK_SIZE]).unwrap();
    assert!(buf[..8 * BLOCK_SIZE] == old[..8 * BLOCK_SIZE]);
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
    let info = &volume.clones().unwrap()[0];
    assert_eq!((info.own_blocks, info.own_zero_blocks), (13, 4), "{info:?}");
    let stats = volume.stats();
    assert_eq!(stats.clone_blocks, 13);
    assert_eq!(
        (
            stats.clone_volumes[0].own_blocks,
            stats.clone_volumes[0].own_zero_blocks
        ),
        (13, 4)
    );
    let metrics = stats.to_prometheus();
    assert!(
        metrics.contains("zdisk_clone_own_blocks{clone=\"vm\"} 13\n"),
        "{metrics}"
    );
}

#[test]
fn clone_errors_are_clear() {
    let (_media, volume) = create(256 * 1024, 64, false);
    let missing = volume.make_clone("nope", "vm").unwrap_err().to_string();
    assert!(missing.contains("no snapshot named \"nope\""), "{missing}");
    volume.take_snapshot("golden").unwrap();
    volume.make_clone("golden", "vm").unwrap();
    for taken in ["golden", "vm"] {
        let error = volume.make_clone("golden", taken).unwrap_err().to_string();
        assert!(error.contains("exists already"), "{error}");
        let error = volume.take_snapshot(taken).unwrap_err().to_string();
        assert!(error.contains("exists already"), "{error}");
    }
    let refused = volume.delete_snapshot("golden").unwrap_err().to_string();
    assert!(refused.contains("has clones (\"vm\""), "{refused}");
    volume.take_snapshot_of("vm", "vm-1").unwrap();
    assert_eq!(volume.snapshot_volume("vm-1").as_deref(), Some("vm"));
    let refused = volume.delete_clone("vm").unwrap_err().to_string();
    assert!(refused.contains("has snapshots (\"vm-1\""), "{refused}");
    let device = volume.clone_device("vm").unwrap();
    volume.delete_snapshot("vm-1").unwrap();
    volume.delete_clone("vm").unwrap();
    // A device of a deleted clone is refused, even once its key space is
    // another clone's.
    volume.make_clone("golden", "other").unwrap();
    let gone = device
        .write(0, &[1u8; 4096], false)
        .unwrap_err()
        .to_string();
    assert!(gone.contains("deleted"), "{gone}");
    let gone = device.trim(0, 4096, false).unwrap_err().to_string();
    assert!(gone.contains("deleted"), "{gone}");
    let mut buf = vec![0u8; 4096];
    // Nor does it read the other clone's blocks.
    assert!(device.read(0, &mut buf).is_err());
    assert!(device.block_status(0, 4096, 1).is_err());
    volume
        .clone_device("other")
        .unwrap()
        .read(0, &mut buf)
        .unwrap();
    assert!(is_zero(&buf), "the other clone got the deleted one's write");
    assert!(volume.delete_clone("nope").is_err());
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

fn is_zero(buf: &[u8]) -> bool {
    buf.iter().all(|&b| b == 0)
}

/// A unit in a scanned victim (as above, no snapshot needed) with a
/// member written again since: its live member must move, rewritten,
/// before the victim is reused. `State::relocate` copies a record only
/// while all its members live, so `moves::apply` rewrites what is live.
#[test]
fn a_scanned_victim_moves_the_live_member_of_a_partly_dead_unit() {
    // Segments large enough for units of two blocks.
    let (media, volume) = create(128 * 1024, 24, false);
    let unit = BLOCKS - 220;
    let (victim, sealed) = fill_around_scanned_victim(&volume, |volume| {
        let both = [content(11), content(12)].concat();
        volume.write(at(unit), &both, false).unwrap();
        volume.write(at(unit + 1), &content(13), false).unwrap();
        segment_of(volume, unit)
    });
    match volume.lock().map().get(Lba(unit)).slot() {
        Slot::Data(loc) => assert_eq!(loc.members, 2, "block {unit} is not in a unit"),
        other => panic!("block {unit}: {other:?}"),
    }
    volume.checkpoint().unwrap();
    clean_at_once(&volume, victim, &sealed);
    let expect = |volume: &Volume, when: &str| {
        let mut buf = vec![0xA5u8; 2 * BLOCK_SIZE];
        volume.read(at(unit), &mut buf).unwrap();
        assert!(buf[..BLOCK_SIZE] == content(11), "block {unit} {when}");
        assert!(
            buf[BLOCK_SIZE..] == content(13),
            "block {} {when}",
            unit + 1
        );
        let report = volume.check(true).unwrap();
        assert!(report.is_clean(), "{when}: {report:?}");
    };
    expect(&volume, "after cleaning");
    volume.flush().unwrap();
    let volume = power_cut(&media, volume, 1);
    expect(&volume, "after a power cut");
}

/// The cleaner plans a live victim's moves outside the lock. A snapshot
/// taken before they are applied, and a write that makes it keep a block
/// planned as an unchanged copy, must not get that copy: it would name
/// the volume's block (see the scanned victim's test above).
/// `State::relocate` refuses a kept member, and `apply` rewrites it under
/// its key in the snapshot's space instead.
#[test]
fn a_copy_planned_before_a_snapshot_kept_its_block_is_rewritten() {
    let (_media, volume) = create(64 * 1024, 40, false);
    let block = 5;
    volume.write(at(block), &content(3), false).unwrap();
    volume.flush().unwrap();
    let (from, version) = {
        let state = volume.lock();
        let entry = state.map().get(Lba(block));
        match entry.slot() {
            Slot::Data(loc) => (loc, entry.version()),
            other => panic!("block {block}: {other:?}"),
        }
    };
    let seq32 = volume.lock().space().segment(from.segment).seq as u32;
    let read_record = |loc: Location| {
        let mut bytes = vec![0u8; loc.len as usize];
        volume
            .media()
            .read(loc.segment, loc.offset as u64, &mut bytes)
            .unwrap();
        bytes
    };
    let bytes = read_record(from);
    let live = [(Lba(block), from, version)];
    let codec = volume.settings.codec;
    let planned = plan_record(&volume.record_key, seq32, Some(&bytes), &live, codec);
    assert!(matches!(planned, Move::Copy { .. }), "{planned:?}");
    // Between the plan and the lock: the snapshot, and a write that makes
    // it keep the block's entry.
    volume.take_snapshot("s").unwrap();
    volume.write(at(block), &content(4), false).unwrap();
    let kept = volume.lock().member_keys(block, &[version]).unwrap()[0];
    assert_ne!(kept, Lba(block), "the snapshot keeps no entry");
    apply(&mut volume.lock(), vec![planned]).unwrap();
    volume.flush().unwrap();
    let moved = match volume.lock().map().get(kept).slot() {
        Slot::Data(loc) => loc,
        other => panic!("the snapshot's entry: {other:?}"),
    };
    assert_ne!(moved, from, "the block did not move");
    let seq32 = volume.lock().space().segment(moved.segment).seq as u32;
    let record = read_record(moved);
    let (header, _) = decode_record(&record, &volume.record_key, Some(seq32)).unwrap();
    assert_eq!(header.lba, kept.0, "the move names the volume's block");
    let mut buf = vec![0u8; BLOCK_SIZE];
    volume
        .snapshot_device("s")
        .unwrap()
        .read(at(block), &mut buf)
        .unwrap();
    assert!(buf == content(3), "the snapshot's block");
    volume.read(at(block), &mut buf).unwrap();
    assert!(buf == content(4), "the volume's block");
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

/// A victim a retained root replays, cleaned at once (short of space),
/// holding a content that a reference record in a later host segment
/// shares: the copy goes to a GC segment opened after that host segment
/// (it must follow the victim), so replay meets the reference before the
/// copy. Reused before a checkpoint, the victim took the content with it
/// and the reference found nothing: the deduplicated block read its old
/// contents after a power cut (simulator seed 3346, beyond CI's 2000). The
/// victim must wait for a checkpoint, whose dump names the copy.
#[test]
fn a_reference_replayed_before_the_copy_of_its_content_still_finds_it() {
    let (media, volume) = create(64 * 1024, 40, true);
    let (owner, sharer) = (BLOCKS - 230, BLOCKS - 240);
    volume.write(at(sharer), &content(7778), false).unwrap();
    let (victim, sealed) = fill_around_scanned_victim(&volume, |volume| {
        // Written after the newest checkpoint: only replay finds it.
        volume.checkpoint().unwrap();
        volume.write(at(owner), &content(7777), false).unwrap();
        segment_of(volume, owner)
    });
    // The host stream has moved on from the victim: the duplicate's
    // reference record lands in a later segment.
    volume.write(at(sharer), &content(7777), false).unwrap();
    assert!(
        volume.stats().dedup_found > 0,
        "the duplicate was not found"
    );
    volume.flush().unwrap();
    clean_at_once(&volume, victim, &sealed);
    // Free once the copy is durable (and a checkpoint, written at once,
    // names it); then its reuse erases it.
    volume.flush().unwrap();
    let state = volume.lock().space().segment(victim).state;
    assert_eq!(state, SegmentState::Free, "segment {victim}");
    media.erase_segment(victim).unwrap();
    volume.flush().unwrap();
    let volume = power_cut(&media, volume, 1);
    let mut buf = vec![0u8; BLOCK_SIZE];
    for block in [owner, sharer] {
        volume.read(at(block), &mut buf).unwrap();
        assert!(buf == content(7777), "block {block} after a power cut");
    }
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
}
