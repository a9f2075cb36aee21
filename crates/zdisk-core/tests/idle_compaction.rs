//! Idle-time compaction: once nobody has sent a request for
//! `OpenOptions::idle_after`, the background thread compacts mostly dead
//! segments within its budget, with the cold-data pass off too, so that
//! the space a volume takes on its medium falls toward what its data
//! needs, long before free segments run short. An emulated drive's volume
//! never does (its controller's cleaner is the one modelled).
//!
//! The volume runs its real background thread; the test moves the
//! engine's clock by hand to make it idle, and polls the statistics.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use zdisk_core::media::{Media, MemMedia};
use zdisk_core::meta::MediaKind;
use zdisk_core::{
    BlockDevice, Codec, CreateOptions, ManualClock, OpenOptions, Recompress, Stats, Volume,
    BLOCK_SIZE,
};

const BLOCK: u64 = BLOCK_SIZE as u64;
const SEGMENT: u64 = 1 << 20;
const SEGMENTS: u32 = 96;
/// 24 MiB of incompressible data: stored bytes are about what was written.
const WRITTEN_BLOCKS: u64 = 6144;

fn volume(clock: Arc<ManualClock>, recompress: Recompress) -> Arc<Volume> {
    let media = Arc::new(MemMedia::with_size(4096, SEGMENT, SEGMENTS).expect("media"));
    let mut create = CreateOptions::new(2 * WRITTEN_BLOCKS * BLOCK);
    create.media_kind = MediaKind::Memory;
    create.codec = Codec::Lz4;
    let options = OpenOptions {
        recompress,
        clock,
        ..OpenOptions::default()
    };
    Volume::create(media as Arc<dyn Media>, create, options).expect("create")
}

/// Writes `WRITTEN_BLOCKS` random blocks, then overwrites nine in every
/// ten of them, so that the first segments are about 10% live, as a
/// database's log-structured churn leaves them. Returns the contents.
fn churn(volume: &Volume) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(9);
    let mut model = vec![0u8; (WRITTEN_BLOCKS * BLOCK) as usize];
    rng.fill_bytes(&mut model);
    for chunk in model.chunks(64 * BLOCK_SIZE).enumerate() {
        let (index, data) = chunk;
        volume
            .write(index as u64 * 64 * BLOCK, data, false)
            .expect("write");
    }
    for block in (0..WRITTEN_BLOCKS).filter(|block| block % 10 != 0) {
        let at = (block * BLOCK) as usize;
        rng.fill_bytes(&mut model[at..at + BLOCK_SIZE]);
        volume
            .write(at as u64, &model[at..at + BLOCK_SIZE], false)
            .expect("overwrite");
    }
    volume.flush().expect("flush");
    model
}

/// Bytes in use that are not metadata: live data plus what cleaning
/// would give back.
fn data_area_used(stats: &Stats) -> u64 {
    stats.physical_used_bytes - stats.metadata_bytes
}

fn compacts_when_idle(recompress: Recompress) {
    let clock = Arc::new(ManualClock::new(1_700_000_000));
    let volume = volume(clock.clone(), recompress);
    let model = churn(&volume);
    let busy = volume.stats();
    assert!(
        busy.free_segments > busy.segment_count / 4,
        "the test wants free segments plentiful, so that only the idle pass cleans"
    );
    assert_eq!(
        data_area_used(&busy),
        busy.stored_bytes + busy.reclaimable_bytes,
        "allocated is live plus reclaimable plus metadata"
    );
    assert!(
        data_area_used(&busy) > busy.stored_bytes * 3 / 2,
        "the churn left little dead space: {busy:?}"
    );
    // Not idle yet: nothing is compacted.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(volume.stats().segments_cleaned, busy.segments_cleaned);

    clock.advance(Duration::from_secs(6));
    let started = Instant::now();
    let target = busy.stored_bytes + 4 * SEGMENT;
    let idle = loop {
        let stats = volume.stats();
        if data_area_used(&stats) <= target || started.elapsed() > Duration::from_secs(60) {
            break stats;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!(
        "{recompress}: data area used {} -> {} bytes, stored {} -> {}, reclaimable {} -> {}, {:.1} s",
        data_area_used(&busy),
        data_area_used(&idle),
        busy.stored_bytes,
        idle.stored_bytes,
        busy.reclaimable_bytes,
        idle.reclaimable_bytes,
        started.elapsed().as_secs_f64()
    );
    assert!(
        data_area_used(&idle) <= target,
        "idle compaction left {} bytes used for {} stored",
        data_area_used(&idle),
        idle.stored_bytes
    );
    assert!(idle.segments_cleaned > busy.segments_cleaned);
    assert!(idle.physical_used_bytes < busy.physical_used_bytes);
    // The pass may first take the checkpoints that put recent segments
    // behind both retained roots (nothing a recovery replays is copied):
    // their dumps hold a few segments while the roots keep them.
    assert!(
        idle.available_bytes + 4 * SEGMENT >= busy.available_bytes,
        "available {} -> {}",
        busy.available_bytes,
        idle.available_bytes
    );
    let mut got = vec![0u8; model.len()];
    volume.read(0, &mut got).expect("read");
    assert!(got == model, "compaction changed the data");
    volume.close().expect("close");
}

#[test]
fn an_idle_volume_compacts_mostly_dead_segments_with_recompress_off() {
    compacts_when_idle(Recompress::Off);
}

#[test]
fn an_idle_volume_compacts_mostly_dead_segments_with_recompress_idle() {
    compacts_when_idle(Recompress::Idle);
}

#[test]
fn idle_compaction_can_be_turned_off() {
    let clock = Arc::new(ManualClock::new(1_700_000_000));
    let media = Arc::new(MemMedia::with_size(4096, SEGMENT, SEGMENTS).expect("media"));
    let mut create = CreateOptions::new(2 * WRITTEN_BLOCKS * BLOCK);
    create.media_kind = MediaKind::Memory;
    let options = OpenOptions {
        recompress: Recompress::Off,
        idle_compact: false,
        clock: clock.clone(),
        ..OpenOptions::default()
    };
    let volume = Volume::create(media as Arc<dyn Media>, create, options).expect("create");
    churn(&volume);
    let before = volume.stats();
    clock.advance(Duration::from_secs(6));
    assert!(!volume.idle_step().expect("idle step"));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(volume.stats().segments_cleaned, before.segments_cleaned);
    volume.close().expect("close");
}
