//! Deterministic crash simulation of the real engine.
//!
//! A seeded random sequence of operations — writes (some with FUA, some
//! partial-block), overwrites, trims, write-zeroes, flushes, cleaning steps,
//! checkpoints, snapshots taken, read and deleted, and power cuts — runs against a [`Volume`] on a crash-capable
//! [`MemMedia`], with background work off so that every run is exactly
//! reproducible from its seed. A [`Model`] tracks, per block, the content
//! that a completed flush or FUA made durable and every value written since.
//!
//! After each power cut the volume is reopened (recovery runs) and checked:
//! - every block returns its durable content or a value written after it —
//!   never anything else;
//! - the invariant checker, with data verification, finds nothing wrong;
//! - every snapshot reads as the volume did when it was taken (one whose
//!   take or delete the cut interrupted may exist or not).
//!
//! A failure names its seed; `ZDISK_SIM_SEED=<seed> cargo test -p zdisk-core
//! --profile ci --lib sim_replay -- --ignored --nocapture` replays it.
//!
//! The same runs take their choices from a fuzzer's input instead of a
//! seed ([`run_input`], the `engine_ops` fuzz target): each choice costs
//! one input byte, so a fuzzer mutates the operation sequence itself, and
//! keeps the sequences that reach new engine code. Block contents come
//! from a generator seeded by the input, not from the input.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::clock::FixedClock;
use crate::codec::Codec;
use crate::device::BlockDevice;
use crate::gc::GcPolicy;
use crate::media::{CrashConfig, Media, MemMedia};
use crate::meta::MediaKind;
use crate::units::{BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::volume::{CreateOptions, OpenOptions, Random, Recompress, Volume, WriteEffort};

/// Where a run draws its choices from: a seeded generator, or a fuzzer's
/// input ([`FuzzInput`]).
pub trait Choices: RngCore {
    /// True once a fuzzer's input is used up; a generator never is.
    fn exhausted(&self) -> bool {
        false
    }

    /// Fills `out` with block data.
    fn data_bytes(&mut self, out: &mut [u8]) {
        for byte in out.iter_mut() {
            *byte = self.gen();
        }
    }
}

impl Choices for SmallRng {}

/// A fuzzer's input as a source of choices: every draw takes one byte,
/// mixed with its position into a whole word (so that ranges and
/// probabilities see every outcome, and rejection sampling does not keep
/// refusing the same values). After the last byte, draws mix in zeros.
/// Block data comes from a generator seeded by the input, so that it does
/// not use the input up.
pub struct FuzzInput<'a> {
    bytes: &'a [u8],
    position: usize,
    data: SmallRng,
}

impl<'a> FuzzInput<'a> {
    pub fn new(bytes: &'a [u8]) -> FuzzInput<'a> {
        FuzzInput {
            bytes,
            position: 0,
            data: SmallRng::seed_from_u64(crc32c::crc32c(bytes) as u64),
        }
    }

    /// The next byte, mixed with its position (SplitMix64's finaliser).
    fn next_word(&mut self) -> u64 {
        let byte = self.bytes.get(self.position).copied().unwrap_or(0);
        let mut word = (self.position as u64) << 8 | byte as u64;
        self.position += 1;
        word = word.wrapping_add(0x9E37_79B9_7F4A_7C15);
        word = (word ^ (word >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        word = (word ^ (word >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        word ^ (word >> 31)
    }
}

impl RngCore for FuzzInput<'_> {
    fn next_u32(&mut self) -> u32 {
        (self.next_word() >> 32) as u32
    }

    fn next_u64(&mut self) -> u64 {
        self.next_word()
    }

    fn fill_bytes(&mut self, dest: &mut [u8]) {
        self.data.fill_bytes(dest);
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
}

impl Choices for FuzzInput<'_> {
    fn exhausted(&self) -> bool {
        self.position >= self.bytes.len()
    }

    fn data_bytes(&mut self, out: &mut [u8]) {
        self.data.fill_bytes(out);
    }
}

/// What one block may read as.
#[derive(Debug, Clone, Default)]
struct BlockModel {
    /// Content a completed flush or FUA made durable (`None`: zeros).
    durable: Option<Arc<Vec<u8>>>,
    /// Values acknowledged after that, oldest first.
    since: Vec<Option<Arc<Vec<u8>>>>,
}

impl BlockModel {
    fn latest(&self) -> Option<&Arc<Vec<u8>>> {
        match self.since.last() {
            Some(value) => value.as_ref(),
            None => self.durable.as_ref(),
        }
    }
}

/// The reference model: for each block, its durable value and what came after.
#[derive(Default)]
pub struct Model {
    blocks: BTreeMap<u64, BlockModel>,
}

fn is_zero(bytes: &[u8]) -> bool {
    bytes.iter().all(|&b| b == 0)
}

impl Model {
    fn write(&mut self, lba: u64, value: Option<Arc<Vec<u8>>>, durable: bool) {
        let value = value.filter(|v| !is_zero(v));
        let block = self.blocks.entry(lba).or_default();
        if durable {
            block.durable = value;
            block.since.clear();
        } else {
            block.since.push(value);
        }
    }

    fn flush(&mut self) {
        for block in self.blocks.values_mut() {
            if let Some(latest) = block.since.pop() {
                block.durable = latest;
                block.since.clear();
            }
        }
    }

    fn latest(&self, lba: u64) -> Option<&Arc<Vec<u8>>> {
        self.blocks.get(&lba).and_then(|b| b.latest())
    }

    fn expect_latest(&self, lba: u64, actual: &[u8]) -> Result<(), String> {
        let ok = match self.latest(lba) {
            None => is_zero(actual),
            Some(expected) => expected.as_slice() == actual,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "block {lba} does not hold its latest value ({})",
                describe(actual)
            ))
        }
    }

    /// After a crash: checks `actual` is a legitimate value and makes it durable.
    fn settle(&mut self, lba: u64, actual: &[u8]) -> Result<(), String> {
        let block = self.blocks.entry(lba).or_default();
        let matches = |value: &Option<Arc<Vec<u8>>>| match value {
            None => is_zero(actual),
            Some(bytes) => bytes.as_slice() == actual,
        };
        if matches(&block.durable) || block.since.iter().any(matches) {
            block.durable = if is_zero(actual) {
                None
            } else {
                Some(Arc::new(actual.to_vec()))
            };
            block.since.clear();
            Ok(())
        } else {
            Err(format!(
                "block {lba} reads {} after the crash; durable value {}, {} later value(s)",
                describe(actual),
                block
                    .durable
                    .as_ref()
                    .map_or("zeros".to_string(), |v| describe(v)),
                block.since.len()
            ))
        }
    }
}

fn describe(bytes: &[u8]) -> String {
    if is_zero(bytes) {
        "zeros".into()
    } else {
        format!(
            "data starting {:02x?} (crc {:08x})",
            &bytes[..8.min(bytes.len())],
            crc32c::crc32c(bytes)
        )
    }
}

/// Shape of one simulated drive.
#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    pub page_size_bytes: u32,
    pub segment_size_bytes: u64,
    pub segment_count: u32,
    pub logical_blocks: u64,
    pub operations: usize,
    pub crash: CrashConfig,
    /// A larger drive, with some requests of hundreds of blocks.
    pub big: bool,
    /// Segment reuse overwrites in place (a file, a block device) instead
    /// of erasing (flash): stale records of older incarnations stay.
    pub reuse_in_place: bool,
}

impl SimConfig {
    /// A small drive for fuzzing, its crash model chosen by `shape`: runs
    /// must take milliseconds.
    pub fn for_fuzzing(shape: u8) -> SimConfig {
        SimConfig {
            page_size_bytes: 4096,
            segment_size_bytes: 8 * 4096,
            segment_count: 24,
            logical_blocks: 64 + (shape as u64 & 0x3F),
            operations: 300,
            crash: CrashConfig {
                keep_probability: (shape >> 6) as f64 / 3.0,
                tear: true,
                flip_bit: shape & 1 == 1,
            },
            big: false,
            reuse_in_place: shape & 2 == 2,
        }
    }

    /// A configuration chosen by the seed, so that seeds cover several shapes.
    pub fn for_seed(seed: u64) -> SimConfig {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x5EED_C0F1);
        if rng.gen_bool(0.25) {
            return SimConfig::units_shape(&mut rng);
        }
        let big_pages = rng.gen_bool(0.3);
        let page = if big_pages { 16 * 1024 } else { 4096 };
        let big = rng.gen_bool(0.2);
        SimConfig {
            page_size_bytes: page,
            segment_size_bytes: page as u64 * rng.gen_range(8..=16),
            segment_count: if big {
                rng.gen_range(60..=120)
            } else {
                rng.gen_range(24..=40)
            },
            logical_blocks: if big {
                rng.gen_range(300..=1200)
            } else {
                rng.gen_range(64..=256)
            },
            operations: rng.gen_range(150..=400),
            crash: CrashConfig {
                keep_probability: rng.gen_range(0.0..=1.0),
                tear: rng.gen_bool(0.8),
                flip_bit: rng.gen_bool(0.3),
            },
            big,
            reuse_in_place: rng.gen_bool(0.5),
        }
    }
}

impl SimConfig {
    /// Segments large enough for compression units of 8 to 16 blocks
    /// (units stay a sixteenth of a segment), few enough that the cleaner
    /// runs, and requests long enough to fill units.
    fn units_shape(rng: &mut SmallRng) -> SimConfig {
        SimConfig {
            page_size_bytes: 4096,
            segment_size_bytes: 4096 * rng.gen_range(128..=256),
            segment_count: rng.gen_range(12..=18),
            logical_blocks: rng.gen_range(300..=1200),
            operations: rng.gen_range(150..=400),
            crash: CrashConfig {
                keep_probability: rng.gen_range(0.0..=1.0),
                tear: rng.gen_bool(0.8),
                flip_bit: rng.gen_bool(0.3),
            },
            big: true,
            reuse_in_place: rng.gen_bool(0.5),
        }
    }
}

/// Counts of what a run exercised.
#[derive(Debug, Default, Clone, Copy)]
pub struct SimStats {
    pub operations: u64,
    pub crashes: u64,
    pub cleaned: u64,
    /// Steps of the idle pass that did something.
    pub idle_steps: u64,
    pub checkpoints: u64,
    pub no_space: u64,
    /// Operations a failed request applied to only some of its blocks.
    pub partial: u64,
    /// Power cuts in the middle of an operation.
    pub mid_operation_crashes: u64,
    /// Partial sectors recoveries found only in staging slots (on media
    /// that overwrite in place).
    pub staged_sectors: u64,
    /// Map leaves read back from their pages (evicted, then needed).
    pub map_pages_read: u64,
    /// Map pages checkpoints kept where an earlier one wrote them.
    pub map_pages_kept: u64,
    /// Ranges cloned by reference (shared).
    pub clones: u64,
    /// Blocks written that dedup found stored already (counted at each
    /// power cut, for the run the cut ends).
    pub dedup_found: u64,
    /// Snapshots taken and deleted, and snapshots read back and compared.
    pub snapshots_taken: u64,
    pub snapshots_deleted: u64,
    pub snapshot_reads: u64,
    /// Clones of snapshots made and deleted, snapshots taken of clones,
    /// and writes (trims, zeroes) to clones.
    pub volume_clones_made: u64,
    pub volume_clones_deleted: u64,
    pub snapshots_of_clones: u64,
    pub clone_writes: u64,
}

impl SimStats {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &SimStats) {
        self.operations += other.operations;
        self.crashes += other.crashes;
        self.cleaned += other.cleaned;
        self.idle_steps += other.idle_steps;
        self.checkpoints += other.checkpoints;
        self.no_space += other.no_space;
        self.partial += other.partial;
        self.mid_operation_crashes += other.mid_operation_crashes;
        self.staged_sectors += other.staged_sectors;
        self.map_pages_read += other.map_pages_read;
        self.map_pages_kept += other.map_pages_kept;
        self.clones += other.clones;
        self.dedup_found += other.dedup_found;
        self.snapshots_taken += other.snapshots_taken;
        self.snapshots_deleted += other.snapshots_deleted;
        self.snapshot_reads += other.snapshot_reads;
        self.volume_clones_made += other.volume_clones_made;
        self.volume_clones_deleted += other.volume_clones_deleted;
        self.snapshots_of_clones += other.snapshots_of_clones;
        self.clone_writes += other.clone_writes;
    }
}

/// Where a run's choices came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Seed(u64),
    /// A fuzzer's input: the fuzzer keeps it, and replays it.
    FuzzInput,
}

/// A failed run: everything needed to replay it.
#[derive(Debug)]
pub struct SimFailure {
    pub origin: Origin,
    pub step: usize,
    pub message: String,
    pub trace: Vec<String>,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let origin = match self.origin {
            Origin::Seed(seed) => format!("seed {seed}"),
            Origin::FuzzInput => "fuzz input".into(),
        };
        writeln!(
            f,
            "crash simulation failed: {origin} at step {}: {}",
            self.step, self.message
        )?;
        writeln!(f, "last operations:")?;
        let shown = if std::env::var_os("ZDISK_SIM_DEBUG").is_some() {
            usize::MAX
        } else {
            25
        };
        for line in self.trace.iter().rev().take(shown).rev() {
            writeln!(f, "  {line}")?;
        }
        match self.origin {
            Origin::Seed(seed) => write!(
                f,
                "replay: ZDISK_SIM_SEED={seed} cargo test -p zdisk-core --profile ci --lib sim_replay -- --ignored --nocapture"
            ),
            Origin::FuzzInput => write!(
                f,
                "replay: cargo fuzz run -O engine_ops <the input the fuzzer saved> (in fuzz/, see docs/testing.md)"
            ),
        }
    }
}

fn content(rng: &mut impl Choices) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK_SIZE];
    match rng.gen_range(0..6) {
        // One of a few blocks that recur, for dedup to find.
        4 | 5 => {
            let which = rng.gen_range(0..6u8);
            for (i, byte) in block.iter_mut().enumerate() {
                *byte = which.wrapping_mul(37) ^ (i % 251) as u8;
            }
        }
        0 => rng.fill_bytes(&mut block),
        1 => {
            let word = rng.next_u64().to_le_bytes();
            for (i, byte) in block.iter_mut().enumerate() {
                *byte = word[i % 8] ^ (i / 512) as u8;
            }
        }
        2 => {
            let text = b"zdisk simulated payload, compressible text. ";
            let shift = rng.gen_range(0..text.len());
            for (i, byte) in block.iter_mut().enumerate() {
                *byte = text[(i + shift) % text.len()];
            }
            let at = rng.gen_range(0..BLOCK_SIZE);
            block[at] = rng.gen();
        }
        _ => {
            let half = rng.gen_range(1..BLOCK_SIZE);
            rng.fill_bytes(&mut block[..half]);
        }
    }
    block
}

fn codec_for(rng: &mut impl Choices) -> Codec {
    match rng.gen_range(0..4) {
        0 => Codec::Lz4,
        1 => Codec::Zstd {
            level: rng.gen_range(-5..=3).max(1),
        },
        2 => Codec::Deflate { level: 1 },
        _ => Codec::None,
    }
}

struct Run<C: Choices> {
    origin: Origin,
    rng: C,
    config: SimConfig,
    media: Arc<MemMedia>,
    volume: Arc<Volume>,
    model: Model,
    trace: Vec<String>,
    stats: SimStats,
    /// The blocks the current request writes, and their new values.
    attempt: Vec<(u64, Option<Arc<Vec<u8>>>)>,
    /// The snapshots taken and not deleted, and what each may hold.
    snapshots: Vec<SimSnapshot>,
    /// Snapshots and clones made so far (names them).
    snapshot_names: u64,
    /// The clones made and not deleted.
    volume_clones: Vec<SimClone>,
    /// The medium is failing (a power cut during an operation): what the
    /// volume reads is not checked until it recovers.
    failing: bool,
}

/// A clone the run made: what its blocks hold (a model of its own, as the
/// volume's), the snapshot it was made from, and whether it may exist at
/// all (a make or a delete cut short leaves either).
struct SimClone {
    name: String,
    base: String,
    model: Model,
    /// Blocks a failed write may or may not have changed: the next read
    /// pins them.
    unsure: BTreeSet<u64>,
    certain: bool,
}

/// A snapshot the run took: the values each block may read as (one, once
/// the snapshot is known to exist), and whether it may exist at all (a
/// take or a delete cut short by a power failure leaves either).
struct SimSnapshot {
    name: String,
    /// The clone it was taken of (`None`: the image's volume).
    of: Option<String>,
    blocks: Vec<Vec<Option<Arc<Vec<u8>>>>>,
    certain: bool,
}

impl SimClone {
    /// Checks that block `lba` reads as `actual`: its latest value, or if a
    /// failed request left it unsure, any value it may hold (which is then
    /// the latest, and the values written after it never were).
    fn check(&mut self, lba: u64, actual: &[u8]) -> Result<(), String> {
        if !self.unsure.remove(&lba) {
            return self.model.expect_latest(lba, actual);
        }
        let block = self.model.blocks.entry(lba).or_default();
        let matches = |value: &Option<Arc<Vec<u8>>>| match value {
            None => is_zero(actual),
            Some(bytes) => bytes.as_slice() == actual,
        };
        match block.since.iter().rposition(matches) {
            Some(at) => {
                block.since.truncate(at + 1);
                Ok(())
            }
            None if matches(&block.durable) => {
                block.since.clear();
                Ok(())
            }
            None => Err(format!(
                "block {lba} reads {}, none of the values a failed request may leave",
                describe(actual)
            )),
        }
    }
}

impl SimSnapshot {
    /// Block `lba`'s allowed values in `model` now.
    fn allowed(model: &Model, lba: u64) -> Vec<Option<Arc<Vec<u8>>>> {
        match model.blocks.get(&lba) {
            None => vec![None],
            Some(block) => std::iter::once(block.durable.clone())
                .chain(block.since.iter().cloned())
                .collect(),
        }
    }
}

/// A moment the simulated clock stands still at.
const SIM_UNIX_SECS: u64 = 1_700_000_000;

fn options(codec: Codec, policy: GcPolicy, origin: Origin) -> OpenOptions {
    let seed = match origin {
        Origin::Seed(seed) => seed,
        Origin::FuzzInput => 0,
    };
    OpenOptions {
        // Time and randomness (the volume's UUID) come from the run.
        clock: Arc::new(FixedClock {
            unix_secs: SIM_UNIX_SECS,
        }),
        random: Random::seeded(seed),
        codec: Some(codec),
        gc_policy: Some(policy),
        background: false,
        // Small enough that periodic checkpoints happen during a run.
        checkpoint_interval_bytes: 256 * 1024,
        write_batch_bytes: 8192,
        // Small reservations, so that renewing them is exercised too.
        seq_reserve_ahead: 64,
        version_reserve_ahead: 64 * 1024,
        segment_reserve_ahead: 4,
        // Each mode of the cold-data pass in a third of the runs.
        recompress: match seed % 3 {
            0 => Recompress::Off,
            1 => Recompress::Idle,
            _ => Recompress::Gc,
        },
        // How hard writes compress (issue #27): one request at a time
        // keeps adaptive effort full, so fast effort (marked records, the
        // pass's order, their counts through crashes) and deferred raw
        // writes (larger records, fuller media) each run in a quarter.
        // ZDISK_SIM_WRITE_EFFORT forces one policy on every seed.
        write_effort: match std::env::var("ZDISK_SIM_WRITE_EFFORT") {
            Ok(policy) => WriteEffort::parse(&policy).expect("ZDISK_SIM_WRITE_EFFORT"),
            Err(_) => match (seed / 9) % 4 {
                1 => WriteEffort::Fast,
                2 => WriteEffort::Full,
                3 => WriteEffort::Deferred,
                _ => WriteEffort::Adaptive,
            },
        },
        // The map paged out at every release of the state lock (every
        // clean leaf evicted), through a small cache, or all in RAM, each
        // in a third of the runs.
        map_cache_bytes: match (seed / 3) % 3 {
            0 => Some(0),
            1 => Some(16 * 1024),
            _ => None,
        },
        // Checkpoints keep every clean leaf's page where an earlier one
        // wrote it in a quarter of the runs (a simulated map is far
        // smaller than half a segment, so by default every page moves with
        // each dump). On these small media the pages kept take room the
        // writes then lack, so those runs meet NoSpace more often.
        map_page_keep_bytes: ((seed / 9) % 4 == 0).then_some(1),
        ..OpenOptions::default()
    }
}

impl<C: Choices> Run<C> {
    fn fail(&self, step: usize, message: impl Into<String>) -> SimFailure {
        SimFailure {
            origin: self.origin,
            step,
            message: message.into(),
            trace: self.trace.clone(),
        }
    }

    fn block_range(&mut self) -> (u64, u64) {
        let lba = self.rng.gen_range(0..self.config.logical_blocks);
        let cap = if self.config.big && self.rng.gen_bool(0.2) {
            600
        } else {
            12
        };
        let max = (self.config.logical_blocks - lba).min(cap);
        (lba, self.rng.gen_range(1..=max))
    }

    fn step(&mut self, step: usize) -> Result<(), SimFailure> {
        let choice = self.rng.gen_range(0..100);
        if choice >= 98 {
            return self.crash_during_operation(step);
        }
        if choice >= 96 {
            return self.crash(step);
        }
        self.attempt.clear();
        let result = self.operation(step, choice)?;
        match result {
            Ok(()) => Ok(()),
            Err(crate::Error::NoSpace { .. }) => {
                self.stats.no_space += 1;
                self.trace.push("  -> no space".into());
                self.settle_failed_request(step)
            }
            Err(error) => Err(self.fail(step, format!("operation failed: {error}"))),
        }
    }

    /// After a request failed: each block it addressed holds its old or
    /// its new value (a large write may fail part way); the model learns
    /// which.
    fn settle_failed_request(&mut self, step: usize) -> Result<(), SimFailure> {
        let attempt = std::mem::take(&mut self.attempt);
        let mut buf = vec![0u8; BLOCK_SIZE];
        let mut partial = false;
        for (lba, new) in attempt {
            self.volume
                .read(lba * BLOCK_SIZE_U64, &mut buf)
                .map_err(|e| self.fail(step, format!("read after a failed request: {e}")))?;
            if self.model.expect_latest(lba, &buf).is_ok() {
                continue;
            }
            let is_new = match &new {
                None => is_zero(&buf),
                Some(value) => value.as_slice() == buf.as_slice(),
            };
            if !is_new {
                return Err(self.fail(
                    step,
                    format!("block {lba} holds neither its old nor its new value after a failed request ({})", describe(&buf)),
                ));
            }
            partial = true;
            self.model.write(lba, new, false);
        }
        if partial {
            self.stats.partial += 1;
            self.trace.push("  (applied to some blocks)".into());
        }
        Ok(())
    }

    /// A power cut while an operation runs: the medium fails every write
    /// after a few, the operation sees errors, then the power goes.
    fn crash_during_operation(&mut self, step: usize) -> Result<(), SimFailure> {
        let allowed = self.rng.gen_range(0..12);
        let choice = loop {
            let choice = self.rng.gen_range(0..96);
            if !(73..=82).contains(&choice) {
                break choice; // not a read
            }
        };
        self.trace.push(format!(
            "power fails after {allowed} more medium operations:"
        ));
        self.media.set_fail_after(allowed);
        self.attempt.clear();
        self.failing = true;
        let result = self.operation(step, choice);
        self.failing = false;
        if let Err(error) = result? {
            self.trace.push(format!("  -> {error}"));
            // Whatever it did may or may not have reached the medium.
            for (lba, new) in std::mem::take(&mut self.attempt) {
                self.model.write(lba, new, false);
            }
        }
        self.stats.mid_operation_crashes += 1;
        self.crash(step)
    }

    /// Runs operation `choice` and updates the model if it succeeds.
    fn operation(&mut self, step: usize, choice: u32) -> Result<crate::Result<()>, SimFailure> {
        Ok(match choice {
            0..=44 if self.rng.gen_bool(0.15) => self.clone_blocks(),
            0..=44 if !self.certain_clones().is_empty() && self.rng.gen_bool(0.25) => {
                let clones = self.certain_clones();
                let at = clones[self.rng.gen_range(0..clones.len())];
                self.write_clone(step, at)?
            }
            0..=44 => {
                let (lba, count) = self.block_range();
                let fua = self.rng.gen_bool(0.1);
                let mut data = Vec::with_capacity(count as usize * BLOCK_SIZE);
                let blocks: Vec<Vec<u8>> = (0..count)
                    .map(|_| {
                        if self.rng.gen_bool(0.1) {
                            vec![0u8; BLOCK_SIZE]
                        } else {
                            content(&mut self.rng)
                        }
                    })
                    .collect();
                blocks.iter().for_each(|b| data.extend_from_slice(b));
                self.trace.push(format!("write {lba}+{count} fua={fua}"));
                self.attempt = blocks
                    .iter()
                    .enumerate()
                    .map(|(i, b)| (lba + i as u64, Some(Arc::new(b.clone()))))
                    .collect();
                let result = self.volume.write(lba * BLOCK_SIZE_U64, &data, fua);
                if result.is_ok() {
                    for (i, block) in blocks.into_iter().enumerate() {
                        self.model.write(lba + i as u64, Some(Arc::new(block)), fua);
                    }
                }
                result
            }
            45..=51 => {
                // A sub-block write at 512-byte granularity (read-modify-write).
                let lba = self.rng.gen_range(0..self.config.logical_blocks);
                let sector = self.rng.gen_range(0..8u64);
                let sectors = self.rng.gen_range(1..=(8 - sector));
                let mut bytes = vec![0u8; (sectors * 512) as usize];
                self.rng.data_bytes(&mut bytes);
                self.trace
                    .push(format!("write {lba} sectors {sector}+{sectors}"));
                let offset = lba * BLOCK_SIZE_U64 + sector * 512;
                let mut block = self
                    .model
                    .latest(lba)
                    .map_or(vec![0u8; BLOCK_SIZE], |v| v.to_vec());
                block[(sector * 512) as usize..((sector + sectors) * 512) as usize]
                    .copy_from_slice(&bytes);
                let block = Arc::new(block);
                self.attempt = vec![(lba, Some(block.clone()))];
                let result = self.volume.write(offset, &bytes, false);
                if result.is_ok() {
                    self.model.write(lba, Some(block), false);
                }
                result
            }
            52..=58 => {
                let (lba, count) = self.block_range();
                let fua = self.rng.gen_bool(0.2);
                self.trace.push(format!("trim {lba}+{count} fua={fua}"));
                self.attempt = (lba..lba + count).map(|b| (b, None)).collect();
                let result = self
                    .volume
                    .trim(lba * BLOCK_SIZE_U64, count * BLOCK_SIZE_U64, fua);
                if result.is_ok() {
                    (lba..lba + count).for_each(|b| self.model.write(b, None, fua));
                }
                result
            }
            59..=64 => {
                let (lba, count) = self.block_range();
                let punch = self.rng.gen_bool(0.5);
                self.trace
                    .push(format!("write_zeroes {lba}+{count} punch={punch}"));
                self.attempt = (lba..lba + count).map(|b| (b, None)).collect();
                let result = self.volume.write_zeroes(
                    lba * BLOCK_SIZE_U64,
                    count * BLOCK_SIZE_U64,
                    punch,
                    false,
                );
                if result.is_ok() {
                    (lba..lba + count).for_each(|b| self.model.write(b, None, false));
                }
                result
            }
            65..=72 => {
                self.trace.push("flush".into());
                let result = self.volume.flush();
                if result.is_ok() {
                    self.flush_models();
                }
                result
            }
            73..=82 => {
                let (lba, count) = self.block_range();
                self.trace.push(format!("read {lba}+{count}"));
                let mut buf = vec![0u8; (count * BLOCK_SIZE_U64) as usize];
                self.volume
                    .read(lba * BLOCK_SIZE_U64, &mut buf)
                    .map_err(|e| self.fail(step, format!("read failed: {e}")))?;
                for (i, block) in buf.chunks(BLOCK_SIZE).enumerate() {
                    self.model
                        .expect_latest(lba + i as u64, block)
                        .map_err(|e| self.fail(step, e))?;
                }
                Ok(())
            }
            83..=90 if self.rng.gen_bool(0.3) => {
                self.trace.push("idle step".into());
                let stepped = self.volume.idle_step();
                if let Ok(true) = stepped {
                    self.stats.idle_steps += 1;
                }
                stepped.map(|_| ())
            }
            83..=90 => {
                self.trace.push("clean".into());
                let cleaned = self.volume.clean_one(0);
                if let Ok(true) = cleaned {
                    self.stats.cleaned += 1;
                }
                cleaned.map(|_| ())
            }
            91..=93 if self.rng.gen_bool(0.6) => self.snapshot_operation(step)?,
            91..=93 => {
                self.trace.push("checkpoint".into());
                self.stats.checkpoints += 1;
                self.volume.checkpoint()
            }
            94..=95 => {
                self.trace.push("maintenance".into());
                self.volume.maintenance_tick().map(|_| ())
            }
            _ => unreachable!("choice {choice}"),
        })
    }

    /// Takes a snapshot (of the volume or of a clone), deletes one, reads
    /// one back and compares it with what it was taken from; or makes a
    /// clone, deletes one, or writes to one and reads it back.
    fn snapshot_operation(&mut self, step: usize) -> Result<crate::Result<()>, SimFailure> {
        let roll = self.rng.gen_range(0..16);
        if roll >= 10 {
            return self.clone_operation(step, roll);
        }
        if roll < 4 && self.snapshots.len() < 4 {
            self.snapshot_names += 1;
            let name = format!("s{}", self.snapshot_names);
            let of = match self.certain_clones().as_slice() {
                [] => None,
                clones if self.rng.gen_bool(0.5) => {
                    let at = clones[self.rng.gen_range(0..clones.len())];
                    Some(at)
                }
                _ => None,
            };
            let model = match of {
                Some(at) => &self.volume_clones[at].model,
                None => &self.model,
            };
            let blocks = (0..self.config.logical_blocks)
                .map(|lba| SimSnapshot::allowed(model, lba))
                .collect();
            let of = of.map(|at| self.volume_clones[at].name.clone());
            let result = match &of {
                Some(clone) => {
                    self.trace.push(format!("snapshot {name} of clone {clone}"));
                    self.volume.take_snapshot_of(clone, &name)
                }
                None => {
                    self.trace.push(format!("snapshot {name}"));
                    self.volume.take_snapshot(&name)
                }
            };
            let certain = result.is_ok();
            if certain {
                // Taking one flushes.
                self.flush_models();
                self.stats.snapshots_taken += 1;
                if of.is_some() {
                    self.stats.snapshots_of_clones += 1;
                }
            }
            let blocks: Vec<Vec<Option<Arc<Vec<u8>>>>> = if certain {
                let (model, unsure) = match &of {
                    Some(clone) => {
                        let clone = self
                            .volume_clones
                            .iter()
                            .find(|c| &c.name == clone)
                            .expect("the clone snapshotted");
                        (&clone.model, Some(&clone.unsure))
                    }
                    None => (&self.model, None),
                };
                // A block a failed write left unsure may hold any value
                // it allowed.
                (0..self.config.logical_blocks)
                    .map(|lba| match unsure {
                        Some(unsure) if unsure.contains(&lba) => SimSnapshot::allowed(model, lba),
                        _ => vec![model.latest(lba).cloned()],
                    })
                    .collect()
            } else {
                blocks
            };
            // A failed take may still have logged it: known after a crash.
            self.snapshots.push(SimSnapshot {
                name,
                of,
                blocks,
                certain,
            });
            return Ok(result.map(|_| ()));
        }
        let known: Vec<usize> = (0..self.snapshots.len())
            .filter(|&i| self.snapshots[i].certain)
            .collect();
        if known.is_empty() {
            return Ok(Ok(()));
        }
        let at = known[self.rng.gen_range(0..known.len())];
        if roll < 7 {
            let name = self.snapshots[at].name.clone();
            if self.volume_clones.iter().any(|c| c.base == name) {
                // Refused while it has clones: the volume says so.
                self.trace
                    .push(format!("delete snapshot {name} (has clones)"));
                if self.volume.delete_snapshot(&name).is_ok() {
                    return Err(
                        self.fail(step, format!("snapshot {name} deleted under its clones"))
                    );
                }
                return Ok(Ok(()));
            }
            self.trace.push(format!("delete snapshot {name}"));
            let result = self.volume.delete_snapshot(&name).map(|_| ());
            match &result {
                Ok(()) => {
                    self.snapshots.remove(at);
                    self.stats.snapshots_deleted += 1;
                }
                // It may or may not be gone: known after a crash.
                Err(_) => self.snapshots[at].certain = false,
            }
            return Ok(result);
        }
        self.trace
            .push(format!("read snapshot {}", self.snapshots[at].name));
        self.verify_snapshot(step, at)?;
        Ok(Ok(()))
    }

    /// Every model flushed: a flush of the image covers every volume.
    /// A block a failed write left unsure keeps every value it allows.
    fn flush_models(&mut self) {
        self.model.flush();
        for clone in &mut self.volume_clones {
            for (lba, block) in clone.model.blocks.iter_mut() {
                if clone.unsure.contains(lba) {
                    continue;
                }
                if let Some(latest) = block.since.pop() {
                    block.durable = latest;
                    block.since.clear();
                }
            }
        }
    }

    /// The clones known to exist.
    fn certain_clones(&self) -> Vec<usize> {
        (0..self.volume_clones.len())
            .filter(|&i| self.volume_clones[i].certain)
            .collect()
    }

    /// Makes a clone of a snapshot, deletes one, or writes (trims, zeroes)
    /// a clone's blocks and reads them back.
    fn clone_operation(&mut self, step: usize, roll: u32) -> Result<crate::Result<()>, SimFailure> {
        let clones = self.certain_clones();
        if roll < 12 || clones.is_empty() {
            let known: Vec<usize> = (0..self.snapshots.len())
                .filter(|&i| self.snapshots[i].certain)
                .collect();
            if known.is_empty() || self.volume_clones.len() >= 3 {
                return Ok(Ok(()));
            }
            let at = known[self.rng.gen_range(0..known.len())];
            // Its values pinned, so the clone starts from one per block.
            self.verify_snapshot(step, at)?;
            self.snapshot_names += 1;
            let name = format!("c{}", self.snapshot_names);
            let base = self.snapshots[at].name.clone();
            self.trace.push(format!("clone {name} of snapshot {base}"));
            let mut model = Model::default();
            for (lba, values) in self.snapshots[at].blocks.iter().enumerate() {
                model.write(lba as u64, values[0].clone(), true);
            }
            let result = self.volume.make_clone(&base, &name);
            let certain = result.is_ok();
            if certain {
                self.flush_models();
                self.stats.volume_clones_made += 1;
            }
            self.volume_clones.push(SimClone {
                name,
                base,
                model,
                unsure: BTreeSet::new(),
                certain,
            });
            return Ok(result.map(|_| ()));
        }
        let at = clones[self.rng.gen_range(0..clones.len())];
        let name = self.volume_clones[at].name.clone();
        if roll == 12 {
            if self.snapshots.iter().any(|s| s.of.as_ref() == Some(&name)) {
                self.trace
                    .push(format!("delete clone {name} (has snapshots)"));
                if self.volume.delete_clone(&name).is_ok() {
                    return Err(
                        self.fail(step, format!("clone {name} deleted under its snapshots"))
                    );
                }
                return Ok(Ok(()));
            }
            self.trace.push(format!("delete clone {name}"));
            let result = self.volume.delete_clone(&name).map(|_| ());
            match &result {
                Ok(()) => {
                    self.volume_clones.remove(at);
                    self.stats.volume_clones_deleted += 1;
                }
                Err(_) => self.volume_clones[at].certain = false,
            }
            return Ok(result);
        }
        self.write_clone(step, at)
    }

    /// Writes, trims or zeroes a range of clone `at`, then reads the range
    /// back (every block the latest value, or one a failed request may have
    /// left).
    fn write_clone(&mut self, step: usize, at: usize) -> Result<crate::Result<()>, SimFailure> {
        let name = self.volume_clones[at].name.clone();
        let device = self
            .volume
            .clone_device(&name)
            .map_err(|e| self.fail(step, format!("clone {name}: {e}")))?;
        let (lba, count) = self.block_range();
        let kind = self.rng.gen_range(0..5);
        let fua = self.rng.gen_bool(0.1);
        if kind == 4 {
            // Part of one block: read-modify-write of the clone's view. A
            // block a failed write left unsure is read (pinned) first.
            if self.volume_clones[at].unsure.contains(&lba) {
                if self.failing {
                    return Ok(Ok(()));
                }
                let mut buf = vec![0u8; BLOCK_SIZE];
                device.read(lba * BLOCK_SIZE_U64, &mut buf).map_err(|e| {
                    self.fail(step, format!("clone {name}: read of block {lba}: {e}"))
                })?;
                self.volume_clones[at]
                    .check(lba, &buf)
                    .map_err(|e| self.fail(step, format!("clone {name}: {e}")))?;
            }
            let sector = self.rng.gen_range(0..8u64);
            let sectors = self.rng.gen_range(1..=(8 - sector));
            let mut bytes = vec![0u8; (sectors * 512) as usize];
            self.rng.data_bytes(&mut bytes);
            self.trace.push(format!(
                "write clone {name} {lba} sectors {sector}+{sectors}"
            ));
            let model = &self.volume_clones[at].model;
            let mut block = model
                .latest(lba)
                .map_or(vec![0u8; BLOCK_SIZE], |v| v.to_vec());
            block[(sector * 512) as usize..((sector + sectors) * 512) as usize]
                .copy_from_slice(&bytes);
            let result = device.write(lba * BLOCK_SIZE_U64 + sector * 512, &bytes, fua);
            let clone = &mut self.volume_clones[at];
            clone
                .model
                .write(lba, Some(Arc::new(block)), result.is_ok() && fua);
            if result.is_err() {
                clone.unsure.insert(lba);
            }
            return Ok(result);
        }
        let values: Vec<Option<Arc<Vec<u8>>>> = (0..count)
            .map(|_| match kind {
                0 | 1 if !self.rng.gen_bool(0.1) => Some(Arc::new(content(&mut self.rng))),
                _ => None,
            })
            .collect();
        let (offset, len) = (lba * BLOCK_SIZE_U64, count * BLOCK_SIZE_U64);
        let result = match kind {
            0 | 1 => {
                self.trace
                    .push(format!("write clone {name} {lba}+{count} fua={fua}"));
                let mut data = Vec::with_capacity(len as usize);
                for value in &values {
                    match value {
                        Some(bytes) => data.extend_from_slice(bytes),
                        None => data.resize(data.len() + BLOCK_SIZE, 0),
                    }
                }
                device.write(offset, &data, fua)
            }
            2 => {
                self.trace
                    .push(format!("trim clone {name} {lba}+{count} fua={fua}"));
                device.trim(offset, len, fua)
            }
            _ => {
                self.trace
                    .push(format!("write_zeroes clone {name} {lba}+{count}"));
                device.write_zeroes(offset, len, self.rng.gen_bool(0.5), fua)
            }
        };
        let clone = &mut self.volume_clones[at];
        for (i, value) in values.into_iter().enumerate() {
            let block = lba + i as u64;
            clone.model.write(block, value, result.is_ok() && fua);
            if result.is_err() {
                clone.unsure.insert(block);
            }
        }
        if let Err(error) = result {
            return Ok(Err(error));
        }
        self.stats.clone_writes += 1;
        if self.failing {
            return Ok(Ok(()));
        }
        let mut buf = vec![0u8; BLOCK_SIZE];
        for block in lba..lba + count {
            device.read(block * BLOCK_SIZE_U64, &mut buf).map_err(|e| {
                self.fail(step, format!("clone {name}: read of block {block}: {e}"))
            })?;
            self.volume_clones[at]
                .check(block, &buf)
                .map_err(|e| self.fail(step, format!("clone {name}: {e}")))?;
        }
        Ok(Ok(()))
    }

    /// After a recovery: the clones are those the run knows, and those
    /// whose make or delete a crash cut short, if it left them; each reads
    /// as a legitimate value, which becomes durable.
    fn verify_clones(&mut self, step: usize) -> Result<(), SimFailure> {
        let listed: Vec<String> = self
            .volume
            .clone_list()
            .into_iter()
            .map(|c| c.name)
            .collect();
        for name in &listed {
            if !self.volume_clones.iter().any(|c| &c.name == name) {
                return Err(self.fail(step, format!("clone {name} exists, never made")));
            }
        }
        let mut at = 0;
        let mut buf = vec![0u8; BLOCK_SIZE];
        while at < self.volume_clones.len() {
            let name = self.volume_clones[at].name.clone();
            if !listed.contains(&name) {
                if self.volume_clones[at].certain {
                    return Err(self.fail(step, format!("clone {name} was lost")));
                }
                self.volume_clones.remove(at);
                continue;
            }
            self.volume_clones[at].certain = true;
            self.volume_clones[at].unsure.clear();
            let device = self
                .volume
                .clone_device(&name)
                .map_err(|e| self.fail(step, format!("clone {name}: {e}")))?;
            for lba in 0..self.config.logical_blocks {
                device.read(lba * BLOCK_SIZE_U64, &mut buf).map_err(|e| {
                    self.fail(step, format!("clone {name}: read of block {lba}: {e}"))
                })?;
                self.volume_clones[at]
                    .model
                    .settle(lba, &buf)
                    .map_err(|e| self.fail(step, format!("clone {name}: {e}")))?;
            }
            at += 1;
        }
        Ok(())
    }

    /// Reads snapshot `at` whole: every block holds one of its allowed
    /// values, which becomes the only one.
    fn verify_snapshot(&mut self, step: usize, at: usize) -> Result<(), SimFailure> {
        let name = self.snapshots[at].name.clone();
        let device = self
            .volume
            .snapshot_device(&name)
            .map_err(|e| self.fail(step, format!("snapshot {name}: {e}")))?;
        let mut buf = vec![0u8; BLOCK_SIZE];
        for lba in 0..self.config.logical_blocks {
            device.read(lba * BLOCK_SIZE_U64, &mut buf).map_err(|e| {
                self.fail(step, format!("snapshot {name}: read of block {lba}: {e}"))
            })?;
            let allowed = &self.snapshots[at].blocks[lba as usize];
            let found = allowed.iter().find(|value| match value {
                None => is_zero(&buf),
                Some(bytes) => bytes.as_slice() == buf.as_slice(),
            });
            match found {
                Some(value) => {
                    let value = value.clone();
                    self.snapshots[at].blocks[lba as usize] = vec![value];
                }
                None => {
                    return Err(self.fail(
                        step,
                        format!(
                            "snapshot {name}: block {lba} reads {}, none of its {} allowed values",
                            describe(&buf),
                            allowed.len()
                        ),
                    ))
                }
            }
        }
        self.stats.snapshot_reads += 1;
        Ok(())
    }

    /// After a recovery: the snapshots are those the run knows, and those
    /// whose take or delete a crash cut short, if it left them; each
    /// reads as it should.
    fn verify_snapshots(&mut self, step: usize) -> Result<(), SimFailure> {
        let listed: Vec<String> = self
            .volume
            .snapshots()
            .map_err(|e| self.fail(step, format!("listing snapshots: {e}")))?
            .into_iter()
            .map(|s| s.name)
            .collect();
        for name in &listed {
            if !self.snapshots.iter().any(|s| &s.name == name) {
                return Err(self.fail(
                    step,
                    format!("snapshot {name} exists, never taken or deleted"),
                ));
            }
        }
        let mut at = 0;
        while at < self.snapshots.len() {
            let snapshot = &self.snapshots[at];
            if !listed.contains(&snapshot.name) {
                if snapshot.certain {
                    let name = snapshot.name.clone();
                    return Err(self.fail(step, format!("snapshot {name} was lost")));
                }
                self.snapshots.remove(at);
                continue;
            }
            self.snapshots[at].certain = true;
            self.verify_snapshot(step, at)?;
            at += 1;
        }
        Ok(())
    }

    /// Clones a range of blocks onto another (sharing their records, as
    /// deduplication does): afterwards the destination reads as the source
    /// did.
    fn clone_blocks(&mut self) -> crate::Result<()> {
        let (source, count) = self.block_range();
        let dest = self.rng.gen_range(0..=self.config.logical_blocks - count);
        if source < dest + count && dest < source + count {
            self.trace.push(format!(
                "clone {source}+{count} to {dest}: overlaps, skipped"
            ));
            return Ok(());
        }
        self.trace.push(format!("clone {source}+{count} to {dest}"));
        let values: Vec<Option<Arc<Vec<u8>>>> = (0..count)
            .map(|i| self.model.latest(source + i).cloned())
            .collect();
        self.attempt = values
            .iter()
            .enumerate()
            .map(|(i, value)| (dest + i as u64, value.clone()))
            .collect();
        let result =
            self.volume
                .clone_blocks(crate::units::Lba(source), crate::units::Lba(dest), count);
        if result.is_ok() {
            self.stats.clones += 1;
            for (i, value) in values.into_iter().enumerate() {
                self.model.write(dest + i as u64, value, false);
            }
        }
        result
    }

    fn crash(&mut self, step: usize) -> Result<(), SimFailure> {
        self.stats.crashes += 1;
        let stats = self.volume.stats();
        self.stats.map_pages_read += stats.map_cache_misses;
        self.stats.dedup_found += stats.dedup_found;
        self.stats.map_pages_kept += stats.map_pages_kept;
        let pending = self.media.pending_count();
        self.trace
            .push(format!("power cut ({pending} pending operations)"));
        let crashed = Arc::new(self.media.crash(&mut self.rng, self.config.crash));
        if std::env::var_os("ZDISK_SIM_DEBUG").is_some() {
            for lba in 0..self.config.logical_blocks {
                println!("before crash: {}", self.volume.describe_block(lba));
            }
            for line in &self.trace {
                println!("TRACE {line}");
            }
        }
        self.media = crashed;
        // Sometimes the newest root rots too: recovery must fall back to
        // the older root and still find every flushed block.
        if self.rng.gen_bool(0.15) {
            if let Ok((roots, _)) = crate::meta::read_roots(self.media.as_ref()) {
                if roots.len() == 2 {
                    let slot = roots[0].slot();
                    let len = roots[0].encode().len();
                    let at = self.rng.gen_range(0..len);
                    self.trace
                        .push(format!("  newest root (slot {slot}) damaged at byte {at}"));
                    self.media.corrupt_meta(slot, at, self.rng.gen());
                }
            }
        }
        let codec = codec_for(&mut self.rng);
        let policy = if self.rng.gen_bool(0.5) {
            GcPolicy::Greedy
        } else {
            GcPolicy::CostBenefit
        };
        self.volume = Volume::open(
            self.media.clone() as Arc<dyn Media>,
            options(codec, policy, self.origin),
        )
        .map_err(|e| self.fail(step, format!("reopen after power cut failed: {e}")))?;
        self.stats.staged_sectors += self.volume.open_report().staged_sectors;
        if std::env::var_os("ZDISK_SIM_DEBUG").is_some() {
            println!("{:?}", self.volume.open_report());
            for lba in 0..self.config.logical_blocks {
                println!("after crash: {}", self.volume.describe_block(lba));
            }
        }
        self.verify_after_recovery(step)
    }

    fn verify_after_recovery(&mut self, step: usize) -> Result<(), SimFailure> {
        let report = self
            .volume
            .check(true)
            .map_err(|e| self.fail(step, format!("check failed to run: {e}")))?;
        if !report.is_clean() {
            return Err(self.fail(step, format!("invariant check after recovery: {report:?}")));
        }
        let mut buf = vec![0u8; BLOCK_SIZE];
        for lba in 0..self.config.logical_blocks {
            self.volume
                .read(lba * BLOCK_SIZE_U64, &mut buf)
                .map_err(|e| {
                    self.fail(
                        step,
                        format!("read of block {lba} after recovery failed: {e}"),
                    )
                })?;
            self.model
                .settle(lba, &buf)
                .map_err(|e| self.fail(step, e))?;
        }
        self.verify_snapshots(step)?;
        self.verify_clones(step)
    }
}

/// Runs one seed to completion.
pub fn run_seed(seed: u64) -> Result<SimStats, SimFailure> {
    let config = SimConfig::for_seed(seed);
    run(config, SmallRng::seed_from_u64(seed), Origin::Seed(seed))
}

/// Runs the operations a fuzzer's input chooses (its first byte chooses
/// the drive's shape and crash model), until the input is used up.
pub fn run_input(input: &[u8]) -> Result<SimStats, SimFailure> {
    let Some((&shape, choices)) = input.split_first() else {
        return Ok(SimStats::default());
    };
    let config = SimConfig::for_fuzzing(shape);
    run(config, FuzzInput::new(choices), Origin::FuzzInput)
}

/// Creates a volume shaped by `config`, runs operations chosen by `rng`
/// against it and the model, and ends with a power cut, then a clean
/// shutdown and reopen, checking everything after each.
fn run<C: Choices>(config: SimConfig, mut rng: C, origin: Origin) -> Result<SimStats, SimFailure> {
    let media = Arc::new(
        MemMedia::with_size(
            config.page_size_bytes,
            config.segment_size_bytes,
            config.segment_count,
        )
        .map(|media| {
            if config.reuse_in_place {
                media.reusing_in_place()
            } else {
                media
            }
        })
        .expect("valid simulated geometry"),
    );
    let codec = codec_for(&mut rng);
    let policy = if rng.gen_bool(0.5) {
        GcPolicy::Greedy
    } else {
        GcPolicy::CostBenefit
    };
    // Units of every size, from blocks alone to the largest.
    let unit_blocks = [1u8, 2, 4, 8, 32][rng.gen_range(0..5)];
    let create_dedup = rng.gen_bool(0.7);
    let create = CreateOptions {
        logical_size_bytes: config.logical_blocks * BLOCK_SIZE_U64,
        codec,
        gc_policy: policy,
        unit_blocks,
        media_kind: MediaKind::Memory,
        media_params: Vec::new(),
        dedup: create_dedup,
    };
    let volume = Volume::create(
        media.clone() as Arc<dyn Media>,
        create,
        options(codec, policy, origin),
    )
    .map_err(|e| SimFailure {
        origin,
        step: 0,
        message: format!("create failed: {e}"),
        trace: Vec::new(),
    })?;
    let mut run = Run {
        origin,
        rng,
        config,
        media,
        volume,
        model: Model::default(),
        trace: vec![format!(
            "{config:?} codec {codec} policy {policy} dedup {}",
            create_dedup
        )],
        stats: SimStats::default(),
        attempt: Vec::new(),
        snapshots: Vec::new(),
        snapshot_names: 0,
        volume_clones: Vec::new(),
        failing: false,
    };
    let mut steps = 0;
    while steps < config.operations && !run.rng.exhausted() {
        steps += 1;
        run.step(steps)?;
        run.stats.operations += 1;
    }
    // Always end with a power cut, then a clean shutdown and reopen.
    run.crash(steps + 1)?;
    run.volume
        .close()
        .map_err(|e| run.fail(steps + 2, format!("close failed: {e}")))?;
    run.media = Arc::new(run.media.reopen());
    run.volume = Volume::open(
        run.media.clone() as Arc<dyn Media>,
        options(Codec::Lz4, GcPolicy::Greedy, origin),
    )
    .map_err(|e| {
        run.fail(
            steps + 2,
            format!("reopen after clean shutdown failed: {e}"),
        )
    })?;
    if run.volume.open_report().replayed_records != 0 {
        return Err(run.fail(steps + 2, "a clean shutdown left log to replay"));
    }
    run.flush_models();
    run.verify_after_recovery(steps + 2)?;
    Ok(run.stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeds_from_env(default: u64) -> u64 {
        std::env::var("ZDISK_SIM_SEEDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    }

    /// The optimisation level this crate was built with (build.rs passes
    /// cargo's `OPT_LEVEL` on): "0" in a plain debug build.
    const OPT_LEVEL: &str = env!("ZDISK_OPT_LEVEL");

    /// One simulation thread's totals, how many of its seeds reused
    /// segments in place, and its failing seed with the failure, if any.
    type ThreadResult = (SimStats, u64, Option<(u64, String)>);

    /// Runs many seeds: 2000 in any optimised build, 40 in an unoptimised
    /// one (where 2000 take hours); ZDISK_SIM_SEEDS overrides. CI runs the
    /// 2000 with `--profile ci` (release plus debug assertions and overflow
    /// checks, see the workspace Cargo.toml), and `.ci/test` prints the
    /// line below, which says how many seeds ran and with what checks.
    #[test]
    fn sim_seeds() {
        let count = seeds_from_env(if OPT_LEVEL == "0" { 40 } else { 2000 });
        let first: u64 = std::env::var("ZDISK_SIM_FIRST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1);
        // Seeds are independent: spread them over the host's cores, each
        // thread taking the next seed; a failure reports the lowest seed
        // that failed, so the message does not depend on scheduling.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let next = std::sync::atomic::AtomicU64::new(first);
        let results: Vec<ThreadResult> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut totals = SimStats::default();
                        let mut in_place = 0;
                        let mut failed: Option<(u64, String)> = None;
                        loop {
                            let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if seed >= first + count || failed.is_some() {
                                break;
                            }
                            in_place += SimConfig::for_seed(seed).reuse_in_place as u64;
                            // A panic (an engine assertion) names its seed too.
                            match std::panic::catch_unwind(|| run_seed(seed)) {
                                Ok(Ok(stats)) => totals.add(&stats),
                                Ok(Err(failure)) => failed = Some((seed, failure.to_string())),
                                Err(_) => {
                                    failed = Some((
                                        seed,
                                        format!(
                                            "seed {seed} panicked (see above); replay: \
                                             ZDISK_SIM_SEED={seed} cargo test -p zdisk-core \
                                             --profile ci --lib sim_replay -- --ignored --nocapture"
                                        ),
                                    ))
                                }
                            }
                        }
                        (totals, in_place, failed)
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|worker| worker.join().expect("a simulation thread panicked"))
                .collect()
        });
        let mut totals = SimStats::default();
        let mut in_place = 0;
        let mut failures: Vec<(u64, String)> = Vec::new();
        for (stats, reusing, failed) in results {
            totals.add(&stats);
            in_place += reusing;
            failures.extend(failed);
        }
        if let Some((_, failure)) = failures.into_iter().min_by_key(|(seed, _)| *seed) {
            panic!("{failure}");
        }
        let assertions = if cfg!(debug_assertions) { "on" } else { "off" };
        println!(
            "crash simulation: {count} seeds passed (seeds {first}..{last}, debug assertions \
             {assertions}, opt-level {OPT_LEVEL}; {in_place} reusing segments in place, the rest \
             erasing): {totals:?}",
            last = first + count - 1
        );
        if count >= 20 {
            assert!(
                in_place > 0 && in_place < count,
                "seeds must cover both erasing and in-place reuse"
            );
        }
        assert!(
            totals.crashes >= count,
            "every seed ends with at least one power cut"
        );
        assert!(totals.cleaned > 0, "the cleaner must run in the simulation");
        assert!(
            totals.idle_steps > 0,
            "the idle pass must run in the simulation"
        );
        if count >= 20 {
            assert!(
                totals.map_pages_read > 0,
                "map leaves must be evicted and read back in the simulation"
            );
            assert!(
                totals.map_pages_kept > 0,
                "checkpoints must keep map pages in place in the simulation"
            );
            assert!(
                totals.clones > 0,
                "blocks must be cloned by reference in the simulation"
            );
            assert!(
                totals.snapshots_taken > 0
                    && totals.snapshots_deleted > 0
                    && totals.snapshot_reads > 0,
                "snapshots must be taken, read back and deleted in the simulation"
            );
            assert!(
                totals.volume_clones_made > 0
                    && totals.volume_clones_deleted > 0
                    && totals.snapshots_of_clones > 0
                    && totals.clone_writes > 0,
                "clones must be made, written, snapshotted and deleted in the simulation"
            );
            assert!(
                totals.dedup_found > 0,
                "writes must find blocks stored already in the simulation"
            );
            assert!(
                totals.staged_sectors > 0,
                "power cuts must find flushed records only in staging slots"
            );
        }
    }

    /// The `ci` profile CI builds these tests with has overflow checks as
    /// well as debug assertions (Cargo.toml); a build with debug assertions
    /// but without overflow checks fails here. Ignored in release builds,
    /// which have neither.
    #[test]
    #[cfg_attr(
        not(debug_assertions),
        ignore = "a release build has no overflow checks"
    )]
    #[should_panic(expected = "attempt to add with overflow")]
    fn overflow_checks_are_on_with_debug_assertions() {
        let top = std::hint::black_box(u8::MAX);
        let _ = std::hint::black_box(top + std::hint::black_box(1u8));
    }

    /// The fuzz target's runs work on any input: random bytes drive a
    /// volume through writes, cleaning, checkpoints and power cuts.
    #[test]
    fn fuzz_inputs_drive_the_engine() {
        let mut rng = SmallRng::seed_from_u64(11);
        let mut totals = SimStats::default();
        for _ in 0..40 {
            let mut input = vec![0u8; rng.gen_range(0..600)];
            rng.fill_bytes(&mut input);
            match run_input(&input) {
                Ok(stats) => {
                    totals.operations += stats.operations;
                    totals.mid_operation_crashes += stats.mid_operation_crashes;
                    totals.checkpoints += stats.checkpoints;
                }
                Err(failure) => panic!("{failure}"),
            }
        }
        assert!(totals.operations > 500, "{totals:?}");
        assert!(totals.mid_operation_crashes > 0, "{totals:?}");
        assert!(totals.checkpoints > 0, "{totals:?}");
    }

    /// Replays one seed: ZDISK_SIM_SEED=<seed>, with `--ignored` (a run
    /// without a seed replays nothing, so it is not a test of its own).
    #[test]
    #[ignore = "replays one seed: ZDISK_SIM_SEED=N cargo test -p zdisk-core --profile ci --lib sim_replay -- --ignored --nocapture"]
    fn sim_replay() {
        let seed: u64 = match std::env::var("ZDISK_SIM_SEED") {
            Ok(text) => text
                .parse()
                .unwrap_or_else(|_| panic!("ZDISK_SIM_SEED={text:?} is not a seed number")),
            Err(_) => panic!("sim_replay replays ZDISK_SIM_SEED, which is not set"),
        };
        match run_seed(seed) {
            Ok(stats) => println!("seed {seed} passed: {stats:?}"),
            Err(failure) => panic!("{failure}"),
        }
    }
}
