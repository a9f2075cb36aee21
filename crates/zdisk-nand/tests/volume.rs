//! End to end: the real engine (`zdisk_core::Volume`) on an emulated NAND
//! drive in virtual time. Random writes, reads, trims and flushes are
//! checked against a reference image of the volume; enough is written to
//! make the cleaner recycle segments; the image is closed and reopened,
//! and also dropped uncleanly after a flush (with and without power-loss
//! protection) and recovered. If the drive broke the `Media` contract
//! (a flash rule, a read returning the wrong bytes, a staged page lost),
//! the engine would panic, fail its checker, or return other data.

mod common;

use std::sync::Arc;

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use zdisk_core::clock::Timing;
use zdisk_core::media::Media;
use zdisk_core::meta::MediaKind;
use zdisk_core::{BlockDevice, Codec, CreateOptions, OpenOptions, Volume};
use zdisk_nand::{NandMedia, NandParams};

const BLOCK: u64 = 4096;

fn options() -> OpenOptions {
    OpenOptions {
        background: false,
        ..OpenOptions::default()
    }
}

fn create(path: &std::path::Path, params: &NandParams) -> (Arc<NandMedia>, Arc<Volume>) {
    let media = Arc::new(NandMedia::create(path, params.clone(), Timing::Virtual, false).unwrap());
    let profile = &params.profile;
    let create = CreateOptions {
        logical_size_bytes: profile.logical_size_bytes(),
        codec: Codec::parse(&profile.codec).unwrap(),
        unit_blocks: 1,
        media_kind: MediaKind::Nand,
        media_params: params.encode_params(),
        dedup: false,
        ..CreateOptions::new(profile.logical_size_bytes())
    };
    let volume = Volume::create(media.clone() as Arc<dyn Media>, create, options()).unwrap();
    (media, volume)
}

fn reopen(path: &std::path::Path) -> (Arc<NandMedia>, Arc<Volume>) {
    let media = Arc::new(NandMedia::open(path, Timing::Virtual).unwrap());
    let volume = Volume::open(media.clone() as Arc<dyn Media>, options()).unwrap();
    let recorded = NandParams::decode_params(&volume.superblock().media_params).unwrap();
    assert_eq!(
        &recorded,
        media.params(),
        "the superblock names the emulated drive"
    );
    assert_eq!(volume.superblock().media_kind, MediaKind::Nand);
    (media, volume)
}

/// A single-threaded harness in virtual time: operations at queue depth
/// one, background cleaning between them.
struct Harness {
    media: Arc<NandMedia>,
    volume: Arc<Volume>,
    reference: Vec<u8>,
    now_ns: u64,
    rng: SmallRng,
}

impl Harness {
    fn op<T>(&mut self, body: impl FnOnce(&Volume) -> T) -> T {
        self.media.begin_op(self.now_ns);
        let result = body(&self.volume);
        let done = self.media.end_op();
        assert!(done >= self.now_ns, "an operation ended before it began");
        self.now_ns = done;
        result
    }

    fn background(&mut self) {
        self.media.set_time(self.now_ns);
        while self.volume.maintenance_tick().unwrap() {}
    }

    fn data(&mut self, len: usize) -> Vec<u8> {
        let mut data = vec![0u8; len];
        match self.rng.gen_range(0..4) {
            0 => {} // zeros
            1 => {
                // Compressible: a short random pattern repeated.
                let mut unit = [0u8; 64];
                self.rng.fill_bytes(&mut unit);
                for (i, byte) in data.iter_mut().enumerate() {
                    *byte = unit[i % 64];
                }
            }
            _ => self.rng.fill_bytes(&mut data),
        }
        data
    }

    fn write(&mut self, incompressible: bool) {
        let size = self.reference.len() as u64;
        let len = self.rng.gen_range(1..=64 * 1024u64);
        let offset = self.rng.gen_range(0..size - len);
        let data = if incompressible {
            let mut data = vec![0u8; len as usize];
            self.rng.fill_bytes(&mut data);
            data
        } else {
            self.data(len as usize)
        };
        self.op(|v| v.write(offset, &data, false)).unwrap();
        self.reference[offset as usize..(offset + len) as usize].copy_from_slice(&data);
    }

    fn trim(&mut self) {
        let blocks = self.reference.len() as u64 / BLOCK;
        let count = self.rng.gen_range(1..=16);
        let first = self.rng.gen_range(0..blocks - count);
        let (offset, len) = (first * BLOCK, count * BLOCK);
        self.op(|v| v.trim(offset, len, false)).unwrap();
        self.reference[offset as usize..(offset + len) as usize].fill(0);
    }

    fn read_and_check(&mut self) {
        let size = self.reference.len() as u64;
        let len = self.rng.gen_range(1..=64 * 1024u64);
        let offset = self.rng.gen_range(0..size - len);
        let mut buf = vec![0u8; len as usize];
        self.op(|v| v.read(offset, &mut buf)).unwrap();
        assert!(
            buf == self.reference[offset as usize..(offset + len) as usize],
            "read of {len} bytes at {offset} differs from what was written"
        );
    }

    fn run(&mut self, ops: usize, incompressible: bool) {
        for _ in 0..ops {
            match self.rng.gen_range(0..20) {
                0..=11 => self.write(incompressible),
                12..=15 => self.read_and_check(),
                16 | 17 => self.trim(),
                _ => self.op(|v| v.flush()).unwrap(),
            }
            if self.rng.gen_range(0..8) == 0 {
                self.background();
            }
        }
    }

    fn verify_all(&self) {
        let mut buf = vec![0u8; 256 * 1024];
        for offset in (0..self.reference.len()).step_by(buf.len()) {
            let len = buf.len().min(self.reference.len() - offset);
            self.volume.read(offset as u64, &mut buf[..len]).unwrap();
            assert!(
                buf[..len] == self.reference[offset..offset + len],
                "volume differs from the reference in the 256 KiB at {offset}"
            );
        }
        let report = self.volume.check(true).unwrap();
        assert!(report.is_clean(), "checker: {:?}", report.errors);
    }
}

fn harness(path: &std::path::Path, params: &NandParams, seed: u64) -> Harness {
    let (media, volume) = create(path, params);
    let size = volume.superblock().logical_size_bytes as usize;
    Harness {
        media,
        volume,
        reference: vec![0u8; size],
        now_ns: 0,
        rng: SmallRng::seed_from_u64(seed),
    }
}

fn reopened(harness: Harness, path: &std::path::Path, clean: bool) -> Harness {
    if clean {
        harness.volume.close().unwrap();
    }
    // Dropping the volume without closing it is an unclean shutdown; the
    // image keeps only what the drive made durable or had in its store.
    let Harness {
        media,
        volume,
        reference,
        now_ns,
        rng,
    } = harness;
    drop(volume);
    assert_eq!(
        Arc::strong_count(&media),
        1,
        "the volume let go of the drive"
    );
    drop(media);
    let (media, volume) = reopen(path);
    Harness {
        media,
        volume,
        reference,
        now_ns,
        rng,
    }
}

#[test]
fn a_volume_on_a_tiny_nand_image_survives_cleaning_and_reopening() {
    let path = TempPath::new("volume.nand");
    let params = NandParams::named("tiny").unwrap();
    let mut h = harness(&path.0, &params, 1);
    h.run(1500, false);
    // Overwrite the volume with incompressible data until the cleaner has
    // had to recycle segments.
    let mut rounds = 0;
    while h.media.stats().segments_recycled < 20 {
        h.run(200, true);
        rounds += 1;
        assert!(rounds < 50, "the cleaner never ran: {:?}", h.media.stats());
    }
    h.verify_all();

    let mut h = reopened(h, &path.0, true);
    h.verify_all();
    h.run(500, false);
    h.op(|v| v.flush()).unwrap();
    // Unclean: no checkpoint after this flush. Recovery replays the log,
    // reading the open segments' erased (0xFF) tails.
    let h = reopened(h, &path.0, false);
    h.verify_all();

    // The image kept its wear: segments were erased many times over.
    let stats = h.media.stats();
    assert!(stats.erase_count_max >= 2, "{stats:?}");
    assert!(stats.erase_count_mean > 1.0, "{stats:?}");
}

/// Runs the same flush-heavy workload with or without PLP.
fn flush_heavy(path: &std::path::Path, plp: bool) -> Harness {
    let mut params = NandParams::named("tiny").unwrap();
    params.config.power_loss_protection = plp;
    let mut h = harness(path, &params, 2);
    h.run(800, false);
    for _ in 0..50 {
        h.write(false);
        h.op(|v| v.flush()).unwrap();
    }
    h
}

#[test]
fn with_power_loss_protection_a_flush_stages_the_tail_instead_of_padding() {
    let padded = {
        let path = TempPath::new("no-plp.nand");
        let h = flush_heavy(&path.0, false);
        assert_eq!(h.media.stats().staged_pages, 0);
        (
            h.volume.stats().padding_bytes,
            h.media.stats().pages_programmed,
        )
    };
    let path = TempPath::new("plp.nand");
    let h = flush_heavy(&path.0, true);
    let stats = h.media.stats();
    assert!(
        stats.staged_pages >= 50,
        "too few partial pages staged: {stats:?}"
    );
    // Flushes stop padding (segment ends still are), so fewer pages are programmed.
    let (padding, programmed) = (h.volume.stats().padding_bytes, stats.pages_programmed);
    assert!(
        padding < padded.0,
        "padding {padding} with PLP, {} without",
        padded.0
    );
    assert!(
        programmed < padded.1,
        "{programmed} pages with PLP, {} without",
        padded.1
    );
    h.verify_all();
    // Unclean shutdown right after a flush: the staged tail must survive.
    let h = reopened(h, &path.0, false);
    h.verify_all();
}

#[test]
fn a_drive_out_of_free_blocks_is_throttled_to_its_recycling_cap() {
    let path = TempPath::new("cap.nand");
    let mut params = NandParams::named("tiny").unwrap();
    // One 128 KiB segment per 10 ms: far slower than anything else here.
    params.config.recycle_cap_bytes_per_sec = Some(13_107_200);
    let mut h = harness(&path.0, &params, 3);
    let start_ns = h.now_ns;
    for _ in 0..3000 {
        h.write(true);
    }
    let elapsed_ns = h.now_ns - start_ns;
    let stats = h.media.stats();
    assert!(stats.segments_recycled > 10, "{stats:?}");
    // Foreground cleaning waited for every recycle: the run took at least
    // the recycling engine's busy time.
    assert!(
        elapsed_ns >= stats.recycle_busy_ns,
        "{elapsed_ns} ns elapsed, recycling engine busy {} ns",
        stats.recycle_busy_ns
    );
    assert!(stats.recycle_wait_ns > 0);
    h.verify_all();
}
