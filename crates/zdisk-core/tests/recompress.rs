//! The cold-data pass: data written with a fast codec in small units is
//! rewritten with the cold codec in whole units, by the idle pass
//! (`Volume::idle_step`) or by the background cleaner (`Recompress::Gc`);
//! what it rewrites reads back the same, survives a restart and a crash,
//! and is not rewritten again.

use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use zdisk_core::media::{CrashConfig, Media, MemMedia};
use zdisk_core::meta::MediaKind;
use zdisk_core::{
    BlockDevice, Codec, CreateOptions, OpenOptions, Recompress, Volume, WriteEffort, BLOCK_SIZE,
};

const BLOCK: u64 = BLOCK_SIZE as u64;
const SEGMENT: u64 = 1 << 20;
const SEGMENTS: u32 = 64;
const LOGICAL_BLOCKS: u64 = 8192;
/// The first blocks written, in 4 KiB units with lz4.
const WRITTEN_BLOCKS: u64 = 3072;

fn options(recompress: Recompress) -> OpenOptions {
    OpenOptions {
        background: false,
        recompress,
        ..OpenOptions::default()
    }
}

fn media() -> Arc<MemMedia> {
    Arc::new(MemMedia::with_size(4096, SEGMENT, SEGMENTS).expect("media"))
}

fn create(media: &Arc<MemMedia>, options: OpenOptions) -> Arc<Volume> {
    let mut create = CreateOptions::new(LOGICAL_BLOCKS * BLOCK);
    create.media_kind = MediaKind::Memory;
    create.codec = Codec::Lz4;
    create.unit_blocks = 1;
    Volume::create(media.clone() as Arc<dyn Media>, create, options).expect("create")
}

/// Text-like data: words from a small vocabulary, so that a stronger codec
/// over larger units finds much more to remove than lz4 in 4 KiB blocks.
fn text(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    const WORDS: [&str; 24] = [
        "block",
        "segment",
        "write",
        "flush",
        "the",
        "of",
        "and",
        "to",
        "compress",
        "unit",
        "record",
        "version",
        "cleaner",
        "victim",
        "page",
        "log",
        "map",
        "entry",
        "checkpoint",
        "root",
        "zstd",
        "lz4",
        "trim",
        "zero",
    ];
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[rng.gen_range(0..WORDS.len())].as_bytes());
        out.push(if rng.gen_ratio(1, 12) { b'\n' } else { b' ' });
    }
    out.truncate(len);
    out
}

/// Writes the first `WRITTEN_BLOCKS` blocks, then overwrites the second
/// half of every 64 KiB window of them, so that older segments hold both
/// garbage and cold live data, and trims a run in the middle (the trim
/// record must survive the pass: it makes the idle pass checkpoint before
/// it rewrites the segments around it). Returns the expected contents.
fn fill(volume: &Volume, seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut model = text(&mut rng, (WRITTEN_BLOCKS * BLOCK) as usize);
    for chunk in 0..WRITTEN_BLOCKS / 16 {
        let at = (chunk * 16 * BLOCK) as usize;
        volume
            .write(at as u64, &model[at..at + 16 * BLOCK_SIZE], false)
            .expect("write");
    }
    for window in 0..WRITTEN_BLOCKS / 16 {
        let at = ((window * 16 + 8) * BLOCK) as usize;
        let fresh = text(&mut rng, 8 * BLOCK_SIZE);
        volume.write(at as u64, &fresh, false).expect("overwrite");
        model[at..at + fresh.len()].copy_from_slice(&fresh);
        if window == WRITTEN_BLOCKS / 32 {
            let trimmed = (WRITTEN_BLOCKS / 2 - 40) * BLOCK..(WRITTEN_BLOCKS / 2 + 40) * BLOCK;
            volume
                .trim(trimmed.start, trimmed.end - trimmed.start, false)
                .expect("trim");
            model[trimmed.start as usize..trimmed.end as usize].fill(0);
        }
    }
    volume.flush().expect("flush");
    model
}

fn assert_reads(volume: &Volume, model: &[u8], when: &str) {
    let mut got = vec![0u8; model.len()];
    volume.read(0, &mut got).expect("read");
    for (block, (got, want)) in got
        .chunks(BLOCK_SIZE)
        .zip(model.chunks(BLOCK_SIZE))
        .enumerate()
    {
        assert!(got == want, "block {block} differs {when}");
    }
}

/// Runs the idle pass until it finds nothing to do; returns its steps.
fn idle_until_done(volume: &Volume) -> u32 {
    let mut steps = 0;
    while volume.idle_step().expect("idle step") {
        steps += 1;
        assert!(steps < 500, "the idle pass does not converge");
    }
    steps
}

#[test]
fn the_idle_pass_recompresses_cold_data_once_and_it_survives_restarts() {
    let media = media();
    let volume = create(&media, options(Recompress::Idle));
    let model = fill(&volume, 7);
    let before = volume.stats();
    let steps = idle_until_done(&volume);
    let after = volume.stats();
    assert!(steps > 0, "nothing was recompressed");
    assert!(
        after.counters.checkpoints > before.counters.checkpoints,
        "the trim since the last checkpoint did not make the pass checkpoint first"
    );
    assert_reads(&volume, &model, "after the idle pass");
    assert_eq!(after.mapped_bytes, before.mapped_bytes);
    assert!(
        after.recompressed_bytes >= after.mapped_bytes / 2,
        "only {} of {} bytes recompressed",
        after.recompressed_bytes,
        after.mapped_bytes
    );
    assert!(after.recompress_saved_bytes > 0);
    let (ratio_before, ratio_after) = (
        before.compression_ratio.unwrap(),
        after.compression_ratio.unwrap(),
    );
    assert!(
        ratio_after > ratio_before * 1.3,
        "ratio {ratio_before:.3} became only {ratio_after:.3}"
    );
    // Sealed segments are mostly full after the compaction.
    assert!(after.segments_by_state.sealed < before.segments_by_state.sealed);
    assert!(!volume.idle_step().unwrap(), "converged passes do nothing");

    // A clean restart: the dump remembers what is cold.
    volume.close().expect("close");
    drop(volume);
    let media = Arc::new(media.reopen());
    let volume =
        Volume::open(media.clone() as Arc<dyn Media>, options(Recompress::Idle)).expect("reopen");
    assert_reads(&volume, &model, "after a restart");
    // The segments left open at the close are sealed at the open, partly
    // filled: compacting them, and a flush to release them, is all there
    // is to do.
    let open_at_close = after.segments_by_state.open;
    let steps = idle_until_done(&volume);
    // Plus at most the two checkpoints that put those segments behind
    // both retained roots before anything is copied from them.
    assert!(
        u64::from(steps) <= open_at_close + 3,
        "{steps} idle steps after a restart ({open_at_close} segments were open)"
    );
    assert!(volume.stats().stored_bytes <= after.stored_bytes);
    assert_reads(
        &volume,
        &model,
        "after the idle pass that followed the restart",
    );
    volume.halt();
}

#[test]
fn recompressed_units_replay_after_a_crash() {
    let media = media();
    let volume = create(&media, options(Recompress::Idle));
    let model = fill(&volume, 11);
    idle_until_done(&volume);
    volume.flush().expect("flush");
    let stored = volume.stats().stored_bytes;
    volume.halt();
    drop(volume);
    let mut rng = SmallRng::seed_from_u64(3);
    let crashed = Arc::new(media.crash(&mut rng, CrashConfig::default()));
    let volume =
        Volume::open(crashed as Arc<dyn Media>, options(Recompress::Idle)).expect("recover");
    assert!(
        volume.open_report().replayed_records > 0,
        "nothing replayed"
    );
    assert_reads(&volume, &model, "after a crash");
    // Replay knows which units are cold: at most the partly filled
    // segments left open at the crash are compacted again (and a flush
    // releases them).
    // (and at most two checkpoints first, to put them behind both roots).
    let steps = idle_until_done(&volume);
    assert!(steps <= 5, "{steps} idle steps after recovery");
    assert!(volume.stats().stored_bytes <= stored);
    assert_reads(
        &volume,
        &model,
        "after the idle pass that followed the crash",
    );
    volume.halt();
}

/// Cleans in the background (free segments always below the low mark)
/// until there is nothing left to clean; returns the stats.
fn clean_in_background(recompress: Recompress) -> (zdisk_core::Stats, Vec<u8>, Arc<Volume>) {
    let media = media();
    let options = OpenOptions {
        gc_low_free_segments: Some(u64::from(SEGMENTS)),
        gc_high_free_segments: Some(u64::from(SEGMENTS) + 1),
        ..options(recompress)
    };
    let volume = create(&media, options);
    let model = fill(&volume, 5);
    let mut ticks = 0;
    while volume.maintenance_tick().expect("tick") {
        ticks += 1;
        assert!(ticks < 1000, "background cleaning does not converge");
    }
    (volume.stats(), model, volume)
}

#[test]
fn recompress_gc_rewrites_cold_victims_and_off_leaves_them() {
    let (gc, model, volume) = clean_in_background(Recompress::Gc);
    assert!(gc.segments_cleaned > 0);
    assert!(
        gc.recompressed_bytes > 0,
        "the cleaner recompressed nothing"
    );
    assert_reads(&volume, &model, "after cleaning with recompression");
    volume.halt();

    let (off, model, volume) = clean_in_background(Recompress::Off);
    assert!(off.segments_cleaned > 0);
    assert_eq!(off.recompressed_bytes, 0);
    // With recompress off, the idle pass only compacts.
    idle_until_done(&volume);
    assert_eq!(
        volume.stats().recompressed_bytes,
        0,
        "the idle pass recompressed with recompress off"
    );
    assert!(gc.stored_bytes < off.stored_bytes);
    assert_reads(&volume, &model, "after cleaning without recompression");
    volume.halt();
}

#[test]
fn data_being_read_is_not_cold() {
    let clock = Arc::new(zdisk_core::ManualClock::new(1_700_000_000));
    let media = media();
    let options = OpenOptions {
        clock: clock.clone(),
        ..options(Recompress::Idle)
    };
    let warm_for = options.read_warm_for;
    let volume = create(&media, options);
    let model = fill(&volume, 11);
    assert_reads(&volume, &model, "before the idle pass");
    idle_until_done(&volume);
    assert_eq!(
        volume.stats().recompressed_bytes,
        0,
        "the pass recompressed data read a moment ago"
    );
    assert_reads(&volume, &model, "after compaction alone");
    clock.advance(warm_for + std::time::Duration::from_secs(1));
    assert!(
        idle_until_done(&volume) > 0,
        "nothing was done once reads stopped"
    );
    let after = volume.stats();
    assert!(
        after.recompressed_bytes >= after.mapped_bytes / 2,
        "only {} of {} bytes recompressed once the data went cold",
        after.recompressed_bytes,
        after.mapped_bytes
    );
    assert_reads(&volume, &model, "after recompression");
}

/// Writes blocks `range` as text, 16 blocks a request, into `model`.
fn write_text(volume: &Volume, model: &mut [u8], range: std::ops::Range<u64>, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    for first in range.step_by(16) {
        let data = text(&mut rng, 16 * BLOCK_SIZE);
        volume.write(first * BLOCK, &data, false).expect("write");
        let at = (first * BLOCK) as usize;
        model[at..at + data.len()].copy_from_slice(&data);
    }
    volume.flush().expect("flush");
}

#[test]
fn writes_at_fast_effort_are_counted_survive_restarts_and_are_rewritten_first() {
    cheap_writes_are_counted_survive_restarts_and_are_rewritten_first(WriteEffort::Fast);
}

/// Deferred writes are stored raw, marked like fast ones, and rewritten
/// first just the same.
#[test]
fn deferred_writes_are_stored_raw_counted_survive_restarts_and_are_rewritten_first() {
    cheap_writes_are_counted_survive_restarts_and_are_rewritten_first(WriteEffort::Deferred);
}

/// Half the blocks written at full effort, then half at `cheap` effort.
fn cheap_writes_are_counted_survive_restarts_and_are_rewritten_first(cheap: WriteEffort) {
    let media = media();
    let with = |effort: WriteEffort| OpenOptions {
        write_effort: effort,
        ..options(Recompress::Idle)
    };
    // Older data at full effort, newer at fast effort: the pass's usual
    // order (oldest first) would take the full-effort segments first.
    let volume = create(&media, with(WriteEffort::Full));
    let mut model = vec![0u8; (WRITTEN_BLOCKS * BLOCK) as usize];
    write_text(&volume, &mut model, 0..WRITTEN_BLOCKS / 2, 21);
    let full = volume.stats();
    assert_eq!(full.write_effort, "full");
    assert_eq!(full.host_write_fast_bytes, 0);
    assert_eq!(full.fast_stored_bytes, 0);
    assert_eq!(full.recompress_expected_saving_bytes, None);
    volume.close().expect("close");
    drop(volume);

    let media = Arc::new(media.reopen());
    let volume = Volume::open(media.clone() as Arc<dyn Media>, with(cheap)).expect("open");
    write_text(&volume, &mut model, WRITTEN_BLOCKS / 2..WRITTEN_BLOCKS, 22);
    let fast = volume.stats();
    assert_eq!(fast.write_effort, cheap.to_string());
    let fast_written = WRITTEN_BLOCKS / 2 * BLOCK;
    assert_eq!(fast.host_write_fast_bytes, fast_written);
    assert!(fast.fast_stored_bytes > 0);
    assert!(fast.fast_stored_bytes <= fast.recompress_pending_bytes);
    assert!(fast.recompress_pending_bytes <= fast.stored_bytes);
    // Fast effort stores more for the same kind of data.
    let full_per_block = full.stored_bytes as f64 / (WRITTEN_BLOCKS / 2) as f64;
    let fast_per_block =
        (fast.stored_bytes - full.stored_bytes) as f64 / (WRITTEN_BLOCKS / 2) as f64;
    assert!(
        fast_per_block > full_per_block,
        "{fast_per_block} vs {full_per_block}"
    );
    if cheap == WriteEffort::Deferred {
        // Raw: a whole block and a record header each.
        assert!(fast_per_block >= (BLOCK + 32) as f64, "{fast_per_block}");
    }
    assert_reads(&volume, &model, "after fast writes");

    // A crash: replay finds the marked records again.
    volume.halt();
    drop(volume);
    let mut rng = SmallRng::seed_from_u64(5);
    let crashed = Arc::new(media.crash(&mut rng, CrashConfig::default()));
    let volume =
        Volume::open(crashed.clone() as Arc<dyn Media>, with(WriteEffort::Full)).expect("recover");
    let recovered = volume.stats();
    // Counters are as of the last root; the marks are in the log.
    assert!(recovered.host_write_fast_bytes <= fast_written);
    assert_eq!(
        recovered.fast_stored_bytes, fast.fast_stored_bytes,
        "replay counts the marks"
    );
    assert_reads(&volume, &model, "after a crash");
    // A clean restart: the dump keeps them.
    volume.close().expect("close");
    drop(volume);
    let media = Arc::new(crashed.reopen());
    let volume =
        Volume::open(media.clone() as Arc<dyn Media>, with(WriteEffort::Full)).expect("reopen");
    assert_eq!(
        volume.stats().fast_stored_bytes,
        fast.fast_stored_bytes,
        "the dump counts them"
    );

    // The pass rewrites every fast-effort byte before the older data.
    let mut steps = 0;
    while volume.stats().fast_stored_bytes > 0 {
        assert!(
            volume.idle_step().expect("idle step"),
            "the pass stopped with fast data left"
        );
        steps += 1;
        assert!(steps < 500, "the idle pass does not converge");
    }
    let midway = volume.stats();
    assert!(
        midway.recompress_pending_bytes >= full.stored_bytes / 2,
        "the full-effort data went first: {} of {} bytes left",
        midway.recompress_pending_bytes,
        full.stored_bytes
    );
    let expected = midway
        .recompress_expected_saving_bytes
        .expect("known once the pass rewrote something");
    assert!(expected > 0 && expected < midway.recompress_pending_bytes);
    idle_until_done(&volume);
    let done = volume.stats();
    assert_eq!(done.recompress_pending_bytes, 0);
    assert_eq!(done.recompress_expected_saving_bytes, Some(0));
    assert!(
        done.stored_bytes < full.stored_bytes,
        "the pass made it all smaller than even full effort"
    );
    assert_reads(&volume, &model, "after the idle pass");
    volume.halt();
}
