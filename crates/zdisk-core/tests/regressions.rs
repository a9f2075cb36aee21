//! Regression tests for engine defects found in review: each reproduces the
//! scenario that exposed a defect and asserts the behaviour that fixes it.
//!
//! - a stored guest block that looks like a log record must not replay;
//! - trims must not wedge a volume, nor make cleaning churn;
//! - a victim parked for a checkpoint must not make maintenance spin;
//! - a failed checkpoint must not break the alternation of root slots;
//! - records with out-of-range versions are errors, not panics (dump
//!   chunks: `dump.rs`'s unit tests);
//! - `close` refuses writes instead of losing them;
//! - a power cut while a checkpoint writes map pages (some copied from
//!   the dump before, the map paged out) loses nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rand::{RngCore, SeedableRng};
use zdisk_core::media::{CrashConfig, Media, MediaGeometry, MemMedia};
use zdisk_core::meta::{read_roots, MediaKind, Root};
use zdisk_core::record::{
    encode_record, record_len_for_payload, RecordHeader, RecordKey, RecordKind,
};
use zdisk_core::units::PageIndex;
use zdisk_core::{
    BlockDevice, CreateOptions, Error, GcPolicy, OpenOptions, SegmentId, Volume, BLOCK_SIZE,
};

const BLOCK: u64 = BLOCK_SIZE as u64;

fn foreground() -> OpenOptions {
    OpenOptions {
        background: false,
        ..OpenOptions::default()
    }
}

fn create(media: Arc<dyn Media>, blocks: u64, options: OpenOptions) -> Arc<Volume> {
    let mut create = CreateOptions::new(blocks * BLOCK);
    create.media_kind = MediaKind::Memory;
    // These reproduce defects of records each block holds alone; their
    // blocks repeat, which dedup would share.
    create.dedup = false;
    Volume::create(media, create, options).expect("create")
}

/// Compressible block content that differs per `seed`.
fn block(seed: u64) -> Vec<u8> {
    (0..BLOCK_SIZE)
        .map(|i| (seed as u8) ^ ((i / 128) as u8))
        .collect()
}

fn random_block(rng: &mut rand::rngs::SmallRng) -> Vec<u8> {
    let mut data = vec![0u8; BLOCK_SIZE];
    rng.fill_bytes(&mut data);
    data
}

/// (segment, offset, segment seq) of a block's record, parsed from the
/// diagnostic description.
fn location(volume: &Volume, lba: u64) -> (u32, u32, u32) {
    let d = volume.describe_block(lba);
    let num = |key: &str| -> u32 {
        let at = d.find(key).unwrap_or_else(|| panic!("{key} in {d}")) + key.len();
        d[at..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect::<String>()
            .parse()
            .unwrap()
    };
    (num("SegmentId("), num("offset: "), num("seq: "))
}

fn record_page(key: &RecordKey, header: RecordHeader, payload: &[u8], page: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; page];
    let len = record_len_for_payload(payload.len()) as usize;
    encode_record(
        &mut bytes[..len],
        header,
        payload,
        crc32c::crc32c(payload),
        key,
    );
    bytes
}

/// A medium that fails the writes of checkpoint dumps while told to.
struct FailingDumps {
    inner: Arc<MemMedia>,
    fail: AtomicBool,
}

impl Media for FailingDumps {
    fn geometry(&self) -> MediaGeometry {
        self.inner.geometry()
    }
    fn physical_size_bytes(&self) -> u64 {
        self.inner.physical_size_bytes()
    }
    fn write_pages(&self, s: SegmentId, p: PageIndex, d: &[u8]) -> zdisk_core::Result<()> {
        // A dump segment starts with a map chunk record (kind 4).
        let dump = p.0 == 0 && &d[0..2] == b"ZR" && d[2] == RecordKind::MapChunk as u8;
        if dump && self.fail.load(Ordering::SeqCst) {
            return Err(Error::io(
                "writing a dump",
                std::io::Error::other("injected"),
            ));
        }
        self.inner.write_pages(s, p, d)
    }
    fn read(&self, s: SegmentId, o: u64, b: &mut [u8]) -> zdisk_core::Result<()> {
        self.inner.read(s, o, b)
    }
    fn erase_segment(&self, s: SegmentId) -> zdisk_core::Result<()> {
        self.inner.erase_segment(s)
    }
    fn sync(&self) -> zdisk_core::Result<()> {
        self.inner.sync()
    }
    fn write_meta_slot(&self, slot: usize, d: &[u8]) -> zdisk_core::Result<()> {
        self.inner.write_meta_slot(slot, d)
    }
    fn read_meta_slot(&self, slot: usize) -> zdisk_core::Result<Vec<u8>> {
        self.inner.read_meta_slot(slot)
    }
    fn describe(&self) -> String {
        "memory, failing dump writes on demand".into()
    }
}

/// The resynchronising scan steps through a damaged record's payload. A
/// raw-stored guest block holding bytes laid out like a trim record of the
/// same segment must not pass for one: records are keyed by the volume's
/// UUID, which the guest does not know.
#[test]
fn a_forged_record_inside_guest_data_is_not_replayed() {
    let media = Arc::new(MemMedia::with_size(4096, 64 * 1024, 32).unwrap());
    let volume = create(media.clone(), 64, foreground());
    for lba in 0..16 {
        volume.write(lba * BLOCK, &block(lba), false).unwrap();
    }
    volume.flush().unwrap();
    let (_, _, seq) = location(&volume, 15);
    let guessed_key = RecordKey([0x42; 16]);
    assert_ne!(guessed_key.0, volume.superblock().uuid);
    let header = RecordHeader {
        kind: RecordKind::Trim,
        codec: 0,
        seg_seq: seq,
        lba: 0,
        version: 1 << 40,
        payload_len: 8,
        crc: 0,
    };
    let mut guest = record_page(&guessed_key, header, &16u64.to_le_bytes(), BLOCK_SIZE);
    let len = record_len_for_payload(8) as usize;
    rand::rngs::SmallRng::seed_from_u64(1).fill_bytes(&mut guest[len..]);
    volume.write(40 * BLOCK, &guest, false).unwrap();
    volume.flush().unwrap();
    let (segment, offset, seq40) = location(&volume, 40);
    assert_eq!(
        seq40, seq,
        "the forged block shares the segment incarnation"
    );
    // Bit rot in the header of the record holding the guest block.
    media.corrupt(SegmentId(segment), offset as usize + 9, 0);
    drop(volume); // power cut: the log is replayed
    let volume = Volume::open(Arc::new(media.reopen()), foreground()).unwrap();
    let mut buf = vec![0u8; BLOCK_SIZE];
    for lba in 0..16 {
        volume.read(lba * BLOCK, &mut buf).unwrap();
        assert_eq!(buf, block(lba), "flushed block {lba} after replay");
    }
}

/// A long stream of small trims (online discard) on a volume full of
/// garbage must not take the segments the cleaner and checkpoints need.
#[test]
fn trims_do_not_wedge_a_volume() {
    let media = Arc::new(MemMedia::with_size(4096, 32 * 1024, 64).unwrap());
    let blocks = 256;
    let volume = create(media.clone(), blocks, foreground());
    let mut data = vec![0u8; BLOCK_SIZE * 16];
    for round in 0..3u64 {
        for lba in (0..blocks).step_by(16) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = ((i * 7 / 13) as u8) ^ ((i >> 9) as u8) ^ (round as u8);
            }
            volume.write(lba * BLOCK, &data, false).unwrap();
        }
    }
    volume.flush().unwrap();
    let mut no_space = 0;
    for trim in 0..20_000u64 {
        match volume.trim((trim % blocks) * BLOCK, BLOCK, false) {
            Ok(()) => {}
            Err(Error::NoSpace { .. }) => {
                no_space += 1;
                // What the background thread would do meanwhile.
                for _ in 0..8 {
                    volume.maintenance_tick().unwrap();
                }
            }
            Err(other) => panic!("trim {trim}: {other}"),
        }
        if trim % 64 == 0 {
            volume.maintenance_tick().unwrap();
        }
    }
    assert_eq!(volume.stats().stored_bytes, 0, "everything was trimmed");
    // Every block trimmed: the space must come back for writes.
    for lba in 0..blocks / 2 {
        volume
            .write(lba * BLOCK, &block(lba), false)
            .unwrap_or_else(|e| panic!("write {lba} after {no_space} refused trims: {e}"));
    }
    volume.close().unwrap();
    let volume = Volume::open(Arc::new(media.reopen()), foreground()).unwrap();
    let mut buf = vec![0u8; BLOCK_SIZE];
    volume.read(5 * BLOCK, &mut buf).unwrap();
    assert_eq!(buf, block(5));
    volume.write(200 * BLOCK, &block(9), false).unwrap();
}

/// Trims of never-written space, repeated (periodic fstrim), leave only
/// trim records; once a checkpoint covers them, cleaning must free their
/// segments rather than copy them around.
#[test]
fn cleaning_trim_records_frees_space_after_a_checkpoint() {
    let media = Arc::new(MemMedia::with_size(4096, 32 * 1024, 64).unwrap());
    let volume = create(media, 4096, foreground());
    for i in 0..12_000u64 {
        volume.trim((i % 256) * BLOCK, BLOCK, false).unwrap();
    }
    volume.flush().unwrap();
    let full = volume.stats().free_segments;
    // Maintenance notices the kept range records and checkpoints.
    let mut ticks = 0;
    while volume.maintenance_tick().unwrap() && ticks < 1000 {
        ticks += 1;
    }
    for _ in 0..64 {
        volume.clean_one(0).unwrap();
        volume.flush().unwrap();
    }
    let stats = volume.stats();
    assert!(
        stats.free_segments >= 64 - 8,
        "free segments {full} -> {} after maintenance and cleaning ({} KiB relocated)",
        stats.free_segments,
        stats.gc_write_bytes >> 10
    );
}

/// A victim with damage is parked until a checkpoint. If that checkpoint
/// fails, maintenance must not spin on syncs, and a later checkpoint must
/// release the victim.
#[test]
fn a_parked_victim_does_not_make_maintenance_spin() {
    let inner = Arc::new(MemMedia::with_size(4096, 32 * 1024, 24).unwrap());
    let media = Arc::new(FailingDumps {
        inner: inner.clone(),
        fail: AtomicBool::new(false),
    });
    let mut create = CreateOptions::new(512 * BLOCK);
    create.media_kind = MediaKind::Memory;
    create.gc_policy = GcPolicy::Greedy;
    // Its blocks repeat; the defect is about records held alone.
    create.dedup = false;
    let options = OpenOptions {
        gc_low_free_segments: Some(16),
        ..foreground()
    };
    let volume = Volume::create(media.clone(), create, options).unwrap();
    volume.checkpoint().unwrap();
    for lba in 0..40 {
        volume.write(lba * BLOCK, &block(lba), false).unwrap();
    }
    // A trim in the same segment: recovery needs it until a checkpoint, so
    // cleaning this segment scans it whole, and damage there means some
    // range record may be lost, which only a checkpoint makes harmless.
    volume.trim(60 * BLOCK, 4 * BLOCK, false).unwrap();
    volume.flush().unwrap();
    // More data, until the first batch's segment is sealed and free
    // segments run low.
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut lba = 100;
    while volume.stats().free_segments > 10 {
        volume
            .write(lba * BLOCK, &random_block(&mut rng), false)
            .unwrap();
        lba += 1;
    }
    volume.flush().unwrap();
    // Overwrite all but one block of that segment, making it the emptiest,
    // and damage the survivor (written after the checkpoint).
    let victim_lba = 5;
    let (segment, _, _) = location(&volume, victim_lba);
    for lba in 0..40 {
        if lba != victim_lba && location(&volume, lba).0 == segment {
            volume.write(lba * BLOCK, &block(lba + 1), false).unwrap();
        }
    }
    volume.flush().unwrap();
    let description = volume.describe_block(victim_lba);
    assert!(description.contains("state: Sealed"), "{description}");
    let (segment, offset, _) = location(&volume, victim_lba);
    inner.corrupt(SegmentId(segment), offset as usize + 40, 3);
    media.fail.store(true, Ordering::SeqCst);
    let mut parked = false;
    for _ in 0..30 {
        let result = volume.clean_one(0);
        if result.is_err() && volume.stats().segments_by_state.reclaimable > 0 {
            parked = true;
            break;
        }
    }
    assert!(
        parked,
        "the damaged victim was parked behind a failed checkpoint"
    );
    // Each tick tries the checkpoint that would release the victim, and
    // reports the failure, so the background loop backs off instead of
    // spinning on "work done".
    let syncs = inner.sync_count();
    let (mut errors, mut worked) = (0, 0);
    for _ in 0..1000 {
        match volume.maintenance_tick() {
            Err(_) => errors += 1,
            Ok(true) => worked += 1,
            Ok(false) => {}
        }
    }
    let spent = inner.sync_count() - syncs;
    println!("1000 ticks: {errors} errors, {worked} worked, {spent} syncs");
    assert_eq!(worked, 0, "ticks claimed progress while none was possible");
    assert!(spent <= 2 * 1000, "{spent} syncs in 1000 ticks");
    // Once dumps can be written again, a tick checkpoints and the parked
    // victim comes back.
    media.fail.store(false, Ordering::SeqCst);
    for _ in 0..20 {
        volume.maintenance_tick().unwrap();
    }
    volume.flush().unwrap();
    let stats = volume.stats();
    assert_eq!(
        stats.segments_by_state.reclaimable, 0,
        "parked victim released"
    );
    let mut buf = vec![0u8; BLOCK_SIZE];
    assert!(
        volume.read(victim_lba * BLOCK, &mut buf).is_err(),
        "damage stays visible"
    );
    volume.read(6 * BLOCK, &mut buf).unwrap();
    assert_eq!(buf, block(7), "an overwritten neighbour reads back");
}

/// A checkpoint whose dump write fails must not use up a generation: the
/// next root would land in the slot of the newest durable one, and a torn
/// write of it would leave only a root whose dump has been reused.
#[test]
fn a_failed_checkpoint_keeps_root_slots_alternating() {
    let inner = Arc::new(MemMedia::with_size(4096, 32 * 1024, 48).unwrap());
    let media = Arc::new(FailingDumps {
        inner: inner.clone(),
        fail: AtomicBool::new(false),
    });
    let volume = create(media.clone(), 256, foreground());
    volume.write(0, &vec![0x5a; 8 * BLOCK_SIZE], false).unwrap();
    volume.checkpoint().unwrap();
    volume.write(0, &vec![0x5c; 8 * BLOCK_SIZE], false).unwrap();
    volume.checkpoint().unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
    for i in 0..600u64 {
        let lba = 8 + (i * 7) % 64;
        volume
            .write(lba * BLOCK, &random_block(&mut rng), false)
            .unwrap();
    }
    volume.flush().unwrap();
    let free_before = volume.stats().free_segments;
    media.fail.store(true, Ordering::SeqCst);
    assert!(
        volume.checkpoint().is_err(),
        "the injected dump failure surfaces"
    );
    media.fail.store(false, Ordering::SeqCst);
    assert!(
        volume.stats().free_segments + 1 >= free_before,
        "the failed dump's segments went back: {} free, {free_before} before",
        volume.stats().free_segments
    );
    assert!(volume.check(false).unwrap().errors.is_empty());
    volume.write(0, &vec![0x6b; 8 * BLOCK_SIZE], false).unwrap();
    volume.checkpoint().unwrap();
    let (roots, _) = read_roots(inner.as_ref()).unwrap();
    let newest = roots[0].clone();
    let older = Root::decode(&inner.read_meta_slot(1 - newest.slot()).unwrap()).unwrap();
    assert_eq!(
        newest.generation - older.generation,
        1,
        "the slots hold consecutive generations"
    );
    // Tear the newest root: recovery falls back to the other, intact one.
    let crashed = inner.reopen();
    crashed
        .write_meta_slot(newest.slot(), &[0xAB; 600])
        .unwrap();
    let reopened = Volume::open(Arc::new(crashed), foreground()).unwrap();
    let mut buf = vec![0u8; BLOCK_SIZE];
    reopened.read(0, &mut buf).unwrap();
    assert_eq!(
        buf,
        vec![0x6b; BLOCK_SIZE],
        "the flushed value after fallback"
    );
    assert!(reopened.check(true).unwrap().errors.is_empty());
}

/// A dirty image whose root reserves the sequence numbers after it, with
/// an erased segment for crafted records, and the image's record key.
fn dirty_image() -> (Arc<MemMedia>, u64, RecordKey, SegmentId) {
    let media = Arc::new(MemMedia::with_size(4096, 32 * 1024, 16).unwrap());
    let volume = create(media.clone(), 64, foreground());
    volume.write(0, &vec![7u8; BLOCK_SIZE], true).unwrap();
    drop(volume);
    let media = Arc::new(media.reopen());
    let (roots, _) = read_roots(media.as_ref()).unwrap();
    let root = &roots[0];
    let key = RecordKey(root.superblock.uuid);
    let segment = SegmentId(15);
    media.erase_segment(segment).unwrap();
    (media, root.checkpoint.seq_boundary, key, segment)
}

/// Records with a valid checksum but a version the map cannot hold (only
/// damage or a forgery by someone holding the image makes one) are
/// reported as replay damage and skipped; they neither panic nor poison
/// the version counter.
#[test]
fn replayed_records_with_impossible_versions_are_skipped() {
    for (kind, version, payload) in [
        (RecordKind::Data, 1u64 << 50, vec![1u8; 16]),
        (RecordKind::Zero, (1 << 48) + 5, 2u64.to_le_bytes().to_vec()),
        (RecordKind::Trim, 9, vec![1u8; 3]),
    ] {
        let (media, boundary, key, segment) = dirty_image();
        let header = RecordHeader {
            kind,
            codec: 0,
            seg_seq: boundary as u32 + 5,
            lba: 1,
            version,
            payload_len: payload.len() as u32,
            crc: 0,
        };
        let page = record_page(&key, header, &payload, 4096);
        media.write_pages(segment, PageIndex(0), &page).unwrap();
        let volume = Volume::open(media.clone(), foreground())
            .unwrap_or_else(|e| panic!("{kind:?} v{version}: {e}"));
        let report = volume.open_report();
        if version > 1 << 48 {
            assert!(
                report
                    .replay_damage
                    .iter()
                    .any(|d| d.contains("out of range")),
                "{kind:?}: {report:?}"
            );
        }
        volume.write(8 * BLOCK, &block(8), false).unwrap();
        let mut buf = vec![0u8; BLOCK_SIZE];
        volume.read(0, &mut buf).unwrap();
        assert_eq!(buf, vec![7u8; BLOCK_SIZE]);
        assert!(volume.check(true).unwrap().errors.is_empty());
    }
}

/// Writes racing `close` are refused, never acknowledged and then lost
/// behind the clean checkpoint (whose log recovery does not replay).
#[test]
fn writes_racing_close_are_refused_or_kept() {
    for round in 0..20u64 {
        let media = Arc::new(MemMedia::with_size(4096, 64 * 1024, 64).unwrap());
        let volume = create(media.clone(), 1024, foreground());
        let writer = {
            let volume = volume.clone();
            std::thread::spawn(move || {
                let mut acknowledged = Vec::new();
                for lba in 0..1024u64 {
                    match volume.write(lba * BLOCK, &block(lba + round), false) {
                        Ok(()) => acknowledged.push(lba),
                        Err(_) => break,
                    }
                }
                acknowledged
            })
        };
        std::thread::sleep(std::time::Duration::from_micros(200 * round));
        volume.close().unwrap();
        let acknowledged = writer.join().unwrap();
        let volume = Volume::open(Arc::new(media.reopen()), foreground()).unwrap();
        assert!(volume.open_report().clean);
        let mut buf = vec![0u8; BLOCK_SIZE];
        for lba in acknowledged {
            volume.read(lba * BLOCK, &mut buf).unwrap();
            assert_eq!(
                buf,
                block(lba + round),
                "round {round}: acknowledged block {lba}"
            );
        }
    }
}

/// A medium whose syncs and root writes take a while, as a disk's do.
struct SlowSync {
    inner: Arc<MemMedia>,
}

impl Media for SlowSync {
    fn geometry(&self) -> MediaGeometry {
        self.inner.geometry()
    }
    fn physical_size_bytes(&self) -> u64 {
        self.inner.physical_size_bytes()
    }
    fn write_pages(
        &self,
        segment: SegmentId,
        first_page: PageIndex,
        data: &[u8],
    ) -> zdisk_core::Result<()> {
        self.inner.write_pages(segment, first_page, data)
    }
    fn read(
        &self,
        segment: SegmentId,
        offset_bytes: u64,
        buf: &mut [u8],
    ) -> zdisk_core::Result<()> {
        self.inner.read(segment, offset_bytes, buf)
    }
    fn erase_segment(&self, segment: SegmentId) -> zdisk_core::Result<()> {
        self.inner.erase_segment(segment)
    }
    fn sync(&self) -> zdisk_core::Result<()> {
        std::thread::sleep(std::time::Duration::from_millis(2));
        self.inner.sync()
    }
    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> zdisk_core::Result<()> {
        std::thread::sleep(std::time::Duration::from_millis(1));
        self.inner.write_meta_slot(slot, data)
    }
    fn read_meta_slot(&self, slot: usize) -> zdisk_core::Result<Vec<u8>> {
        self.inner.read_meta_slot(slot)
    }
    fn describe(&self) -> String {
        "memory with slow syncs".into()
    }
}

/// Many writers overwriting a nearly full volume on a medium with slow
/// syncs: each writer's flushes and cleaning steps make room that others
/// take first. That is contention, not a full medium: no write may fail
/// with ENOSPC while the others get on (the ladder once gave up after a
/// fixed number of rungs, which `bench --scenario wa` hit on a disk).
#[test]
fn contended_writers_on_a_slow_medium_never_see_enospc() {
    const SEGMENTS: u32 = 48;
    const SEGMENT_BYTES: u64 = 256 << 10;
    let inner = Arc::new(MemMedia::with_size(4096, SEGMENT_BYTES, SEGMENTS).expect("media"));
    let media = Arc::new(SlowSync { inner });
    // Live incompressible data for about 70% of the log.
    let blocks = SEGMENTS as u64 * SEGMENT_BYTES / BLOCK * 7 / 10;
    let mut create_options = CreateOptions::new(blocks * BLOCK);
    create_options.media_kind = MediaKind::Memory;
    let volume = Volume::create(media, create_options, OpenOptions::default()).expect("create");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(17);
    for lba in 0..blocks {
        volume
            .write(lba * BLOCK, &random_block(&mut rng), false)
            .expect("fill");
    }
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for writer in 0..24u64 {
            let (volume, failures) = (&volume, &failures);
            scope.spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(100 + writer);
                for _ in 0..400 {
                    let lba = rng.next_u64() % blocks;
                    if let Err(error) = volume.write(lba * BLOCK, &random_block(&mut rng), false) {
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("block {lba}: {error}"));
                        return;
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "writes failed: {failures:?}");
    assert!(volume.check(true).expect("check").is_clean());
}

/// A power cut at every point of a checkpoint that writes map pages: the
/// map is paged out at every release of the lock (cache 0), so the
/// checkpoint copies most pages from the dump before and encodes the
/// leaves changed since; whatever the cut left, the volume reopens with
/// every flushed block, and `check` reads every page back clean.
#[test]
fn a_power_cut_while_map_pages_are_written_loses_nothing() {
    let blocks = 1u64 << 20;
    let options = || OpenOptions {
        map_cache_bytes: Some(0),
        ..foreground()
    };
    let mut expected: std::collections::BTreeMap<u64, Vec<u8>> = Default::default();
    let mut cuts_inside = 0;
    for allowed in 0..40u64 {
        let media = Arc::new(MemMedia::with_size(4096, 32 * 1024, 512).unwrap());
        let volume = create(media.clone(), blocks, options());
        expected.clear();
        let mut write = |volume: &Volume, lba: u64, seed: u64| {
            let data = block(seed);
            volume.write(lba * BLOCK, &data, false).unwrap();
            expected.insert(lba, data);
        };
        // Dense chunks, and blocks scattered over the volume.
        for chunk in 0..12u64 {
            for lba in 0..256 {
                write(&volume, chunk * 40_000 + lba, chunk + lba);
            }
        }
        for i in 0..600u64 {
            write(&volume, (i * 7919 * 131) % blocks, i);
        }
        volume.checkpoint().unwrap();
        assert!(volume.stats().map_paged_leaves > 0, "the map is paged out");
        for i in 0..40u64 {
            write(&volume, (i * 7919 * 131) % blocks, 1000 + i);
            write(&volume, 3 * 40_000 + i, 2000 + i);
        }
        volume.flush().unwrap();
        let written_before = volume.stats().map_pages_written;
        media.set_fail_after(allowed);
        let finished = volume.checkpoint().is_ok();
        cuts_inside += u64::from(!finished);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(allowed);
        let crashed = media.crash(&mut rng, CrashConfig::default());
        drop(volume);
        let reopened = Volume::open(Arc::new(crashed), options())
            .unwrap_or_else(|e| panic!("cut after {allowed} operations: reopen failed: {e}"));
        let mut buf = vec![0u8; BLOCK_SIZE];
        for (&lba, data) in &expected {
            reopened.read(lba * BLOCK, &mut buf).unwrap();
            assert!(
                &buf == data,
                "cut after {allowed} operations: block {lba} lost its flushed value"
            );
        }
        let report = reopened.check(true).unwrap();
        assert!(report.is_clean(), "cut after {allowed}: {report:?}");
        if finished {
            assert!(written_before > 0);
        }
    }
    assert!(
        cuts_inside >= 5,
        "the cuts must land inside checkpoints: {cuts_inside}"
    );
}
