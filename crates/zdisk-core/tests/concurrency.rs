//! Concurrent readers, writers, trimmers and flushers against a volume
//! with its background threads (the log writer and maintenance), then a
//! power cut. Guards the hazards of doing the medium's work outside the
//! state lock (issue #23):
//!
//! - a reader never sees bytes that were never written to a block;
//! - every flush covers every write acknowledged before it, including
//!   those still in the log writer's queue: after the power cut, each block
//!   holds what its last completed flush covered, or something written
//!   after it;
//! - the medium hears of each segment's fate in order: prepared before it
//!   is written, no write after it is sealed or freed until it is prepared
//!   again (a late `segment_freed` would let a tier erase a live
//!   incarnation);
//! - staging slots: on a medium with staging, concurrent flushes each
//!   write a slot of their own, or recovery would lose a flushed tail.
//!
//! Debug builds (the `ci` profile) also run the lock check on every
//! medium call (`held.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use zdisk_core::media::{
    CrashConfig, Media, MediaGeometry, MemMedia, ReadRange, SegmentEvents, Staging,
};
use zdisk_core::meta::MediaKind;
use zdisk_core::units::PageIndex;
use zdisk_core::{BlockDevice, CreateOptions, OpenOptions, Result, SegmentId, Volume, BLOCK_SIZE};

const BLOCK: u64 = BLOCK_SIZE as u64;
const WRITERS: u64 = 3;
const BLOCKS_PER_WRITER: u64 = 96;
const READERS: usize = 2;

/// What the medium was last told about a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Prepared,
    Sealed,
    Freed,
}

/// A medium that checks the order of each segment's events.
struct Ordered {
    inner: Arc<MemMedia>,
    fates: Mutex<HashMap<u32, Fate>>,
    violations: Mutex<Vec<String>>,
}

impl Ordered {
    fn note(&self, segment: SegmentId, event: &str) {
        let mut fates = self.fates.lock().unwrap();
        let fate = fates.get(&segment.0).copied();
        let next = match event {
            "prepare" => Some(Fate::Prepared),
            "sealed" => Some(Fate::Sealed),
            "freed" => Some(Fate::Freed),
            _ => None,
        };
        let wrong = match (event, fate) {
            ("write", Some(Fate::Prepared)) => false,
            ("write", _) => true,
            ("sealed", Some(Fate::Prepared)) => false,
            ("sealed", _) => true,
            _ => false,
        };
        if wrong {
            self.violations
                .lock()
                .unwrap()
                .push(format!("{event} of segment {segment} after {fate:?}"));
        }
        if let Some(next) = next {
            fates.insert(segment.0, next);
        }
    }
}

impl Media for Ordered {
    fn geometry(&self) -> MediaGeometry {
        self.inner.geometry()
    }
    fn physical_size_bytes(&self) -> u64 {
        self.inner.physical_size_bytes()
    }
    fn write_pages(&self, segment: SegmentId, first_page: PageIndex, data: &[u8]) -> Result<()> {
        self.note(segment, "write");
        self.inner.write_pages(segment, first_page, data)
    }
    fn read(&self, segment: SegmentId, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        self.inner.read(segment, offset_bytes, buf)
    }
    fn read_batch(&self, reads: &mut [ReadRange<'_>]) -> Vec<Result<()>> {
        self.inner.read_batch(reads)
    }
    fn erase_segment(&self, segment: SegmentId) -> Result<()> {
        self.note(segment, "prepare");
        self.inner.erase_segment(segment)
    }
    fn prepare_segment(&self, segment: SegmentId) -> Result<()> {
        self.note(segment, "prepare");
        self.inner.prepare_segment(segment)
    }
    fn sync(&self) -> Result<()> {
        self.inner.sync()
    }
    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> Result<()> {
        self.inner.write_meta_slot(slot, data)
    }
    fn read_meta_slot(&self, slot: usize) -> Result<Vec<u8>> {
        self.inner.read_meta_slot(slot)
    }
    fn describe(&self) -> String {
        "ordered RAM".into()
    }
    fn staging(&self) -> Option<&dyn Staging> {
        self.inner.staging().map(|_| self as &dyn Staging)
    }
    fn segment_events(&self) -> Option<&dyn SegmentEvents> {
        Some(self)
    }
}

impl Staging for Ordered {
    fn write_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        self.note(segment, "write");
        self.inner_staging()
            .write_sectors(segment, offset_bytes, data)
    }
    fn restore_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        self.inner_staging()
            .restore_sectors(segment, offset_bytes, data)
    }
    fn write_staging(&self, slot: usize, data: &[u8]) -> Result<()> {
        self.inner_staging().write_staging(slot, data)
    }
    fn read_staging(&self, slot: usize) -> Result<Vec<u8>> {
        self.inner_staging().read_staging(slot)
    }
}

impl SegmentEvents for Ordered {
    fn segment_freed(&self, segment: SegmentId) {
        self.note(segment, "freed");
    }
    fn segment_sealed(&self, segment: SegmentId, _fill_bytes: u64) {
        self.note(segment, "sealed");
    }
}

impl Ordered {
    fn inner_staging(&self) -> &dyn Staging {
        self.inner
            .staging()
            .expect("offered only when the inner medium has it")
    }
}

/// Block `lba` at `version`: the two numbers, then compressible filler
/// derived from them (0 is never a version: a zero block is a hole).
fn content(lba: u64, version: u64) -> Vec<u8> {
    let mut data = vec![0u8; BLOCK_SIZE];
    data[..8].copy_from_slice(&lba.to_le_bytes());
    data[8..16].copy_from_slice(&version.to_le_bytes());
    for (i, byte) in data[16..].iter_mut().enumerate() {
        *byte = (version as u8).wrapping_mul(31) ^ (i / 64) as u8;
    }
    data
}

/// The version a block's bytes hold (0 for zeros), or a panic naming what
/// is wrong: nobody ever wrote these bytes there.
fn version_of(lba: u64, data: &[u8]) -> u64 {
    if data.iter().all(|&b| b == 0) {
        return 0;
    }
    let version = u64::from_le_bytes(data[8..16].try_into().unwrap());
    assert!(
        data == content(lba, version),
        "block {lba} holds bytes never written to it"
    );
    version
}

/// Per block, in its writer's steps: what the last completed flush
/// covered, the last step that wrote or trimmed it, and the last trim.
#[derive(Default, Clone, Copy)]
struct Known {
    durable: u64,
    written: u64,
    trimmed: u64,
}

fn run(seed: u64, staging: bool) {
    let geometry = MediaGeometry {
        page_size_bytes: 4096,
        segment_size_bytes: 256 << 10,
        segment_count: 64,
        meta_slot_size_bytes: 64 << 10,
    };
    let mut memory = MemMedia::new(geometry).unwrap();
    if staging {
        memory = memory.reusing_in_place();
    }
    let memory = Arc::new(memory);
    let ordered = Arc::new(Ordered {
        inner: Arc::clone(&memory),
        fates: Mutex::default(),
        violations: Mutex::default(),
    });
    let mut create = CreateOptions::new(WRITERS * BLOCKS_PER_WRITER * BLOCK);
    create.media_kind = MediaKind::Memory;
    let options = OpenOptions {
        background: true,
        ..OpenOptions::default()
    };
    let volume = Volume::create(ordered.clone() as Arc<dyn Media>, create, options).unwrap();
    let known: Vec<Mutex<Known>> = (0..WRITERS * BLOCKS_PER_WRITER)
        .map(|_| Mutex::default())
        .collect();
    let stop = AtomicBool::new(false);
    let reads = AtomicU64::new(0);
    std::thread::scope(|scope| {
        let mut writers = Vec::new();
        for writer in 0..WRITERS {
            let (volume, known) = (&volume, &known);
            writers.push(scope.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed * 100 + writer);
                let first = writer * BLOCKS_PER_WRITER;
                for version in 1..=400u64 {
                    let lba = first + rng.gen_range(0..BLOCKS_PER_WRITER);
                    let run = rng.gen_range(1..=4).min(first + BLOCKS_PER_WRITER - lba);
                    if rng.gen_bool(0.1) {
                        volume.trim(lba * BLOCK, run * BLOCK, false).unwrap();
                        for block in lba..lba + run {
                            let mut k = known[block as usize].lock().unwrap();
                            k.written = version;
                            k.trimmed = version;
                        }
                    } else {
                        let data: Vec<u8> = (lba..lba + run)
                            .flat_map(|block| content(block, version))
                            .collect();
                        let fua = rng.gen_bool(0.05);
                        volume.write(lba * BLOCK, &data, fua).unwrap();
                        for block in lba..lba + run {
                            let mut k = known[block as usize].lock().unwrap();
                            k.written = version;
                            if fua {
                                k.durable = k.written;
                            }
                        }
                    }
                    if rng.gen_bool(0.08) {
                        // Everything this writer wrote is covered now.
                        let before: Vec<u64> = (first..first + BLOCKS_PER_WRITER)
                            .map(|b| known[b as usize].lock().unwrap().written)
                            .collect();
                        volume.flush().unwrap();
                        for (i, written) in before.into_iter().enumerate() {
                            let mut k = known[first as usize + i].lock().unwrap();
                            k.durable = k.durable.max(written);
                        }
                    }
                }
            }));
        }
        for reader in 0..READERS {
            let (volume, stop, reads) = (&volume, &stop, &reads);
            scope.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed * 1000 + reader as u64);
                let mut buf = vec![0u8; 4 * BLOCK_SIZE];
                while !stop.load(Ordering::Relaxed) {
                    let lba = rng.gen_range(0..WRITERS * BLOCKS_PER_WRITER - 4);
                    volume.read(lba * BLOCK, &mut buf).unwrap();
                    for (i, block) in buf.chunks(BLOCK_SIZE).enumerate() {
                        version_of(lba + i as u64, block);
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        // The readers stop once the writers are done.
        for writer in writers {
            writer.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(reads.load(Ordering::Relaxed) > 0, "the readers ran");
    let violations = ordered.violations.lock().unwrap().clone();
    assert!(
        violations.is_empty(),
        "segment events out of order: {violations:?}"
    );

    // The power cut: only what a sync made durable (and some of what was
    // pending) survives.
    volume.halt();
    drop(volume);
    let mut rng = SmallRng::seed_from_u64(seed);
    let crashed = memory.crash(&mut rng, CrashConfig::default());
    let reopened = Volume::open(
        Arc::new(crashed) as Arc<dyn Media>,
        OpenOptions {
            background: false,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    let mut buf = vec![0u8; BLOCK_SIZE];
    for (lba, known) in known.iter().enumerate() {
        let known = *known.lock().unwrap();
        reopened.read(lba as u64 * BLOCK, &mut buf).unwrap();
        let version = version_of(lba as u64, &buf);
        // Zeros are right if a trim is at least as new as what the flush
        // covered (or nothing was ever flushed there).
        let zeros_ok = known.trimmed >= known.durable;
        assert!(
            version >= known.durable || (version == 0 && zeros_ok),
            "seed {seed}: block {lba} went back to step {version} after a flush covered step {}",
            known.durable
        );
        assert!(version <= known.written, "block {lba} from the future");
    }
    let report = reopened.check(true).unwrap();
    assert!(report.is_clean(), "seed {seed}: {report:?}");
}

#[test]
fn concurrent_io_on_flash_keeps_flushed_data_and_segment_order() {
    for seed in 1..=3 {
        run(seed, false);
    }
}

#[test]
fn concurrent_io_with_staging_keeps_flushed_data_and_segment_order() {
    for seed in 1..=3 {
        run(seed, true);
    }
}
