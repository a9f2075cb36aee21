//! How a volume is created and how it runs, and what it takes from the
//! world: time and randomness.
//!
//! Architecture invariant: the engine reads the clock and draws random
//! numbers only through [`OpenOptions::clock`] and
//! [`OpenOptions::random`], so that the crash simulator decides both and
//! a run replays exactly from its seed. (The background thread's idle wait
//! uses the operating system's timer; the simulator runs without it.)

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::{SmallRng, StdRng};
use rand::{RngCore, SeedableRng};

use crate::clock::{Clock, SystemClock};
use crate::codec::Codec;
use crate::gc::GcPolicy;
use crate::meta::MediaKind;

use super::cold::{IdleBudget, Recompress};
use super::compressors::WriteEffort;

use super::space;

/// How a new volume is laid out.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub logical_size_bytes: u64,
    pub codec: Codec,
    pub gc_policy: GcPolicy,
    /// Most blocks a write compresses together (1 to 32; 1: each alone).
    pub unit_blocks: u8,
    pub media_kind: MediaKind,
    pub media_params: Vec<u8>,
    /// Share blocks stored already instead of storing them again
    /// (persisted; [`DEFAULT_DEDUP`] unless chosen).
    pub dedup: bool,
}

/// Whether a new volume deduplicates unless its creator says otherwise.
/// On: as measured in docs/sharing.md ("The index"), fingerprints cost
/// unique data 3–4% of its write rate, and duplicates are written about
/// twice as fast and stored once.
pub const DEFAULT_DEDUP: bool = true;

impl CreateOptions {
    pub fn new(logical_size_bytes: u64) -> Self {
        CreateOptions {
            logical_size_bytes,
            codec: Codec::default(),
            gc_policy: GcPolicy::default(),
            unit_blocks: crate::meta::default_unit_blocks(Codec::default()),
            media_kind: MediaKind::File,
            media_params: Vec::new(),
            dedup: DEFAULT_DEDUP,
        }
    }
}

/// How a volume runs.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Codec for new writes (persisted); `None` keeps the image's setting.
    pub codec: Option<Codec>,
    /// Cleaner policy (persisted); `None` keeps the image's setting.
    pub gc_policy: Option<GcPolicy>,
    /// Most blocks a write compresses together (persisted); `None` keeps
    /// the image's setting.
    pub unit_blocks: Option<u8>,
    /// When the cold-data pass rewrites cold data with a stronger codec.
    pub recompress: Recompress,
    /// How hard host writes compress (issue #27).
    pub write_effort: WriteEffort,
    /// How long without host requests makes the volume idle
    /// (for `Recompress::Idle` and idle-time compaction).
    pub idle_after: Duration,
    /// Compact mostly dead segments while the volume is idle, whatever
    /// `recompress` says (emulated drives never do: their controller's
    /// cleaner is the one modelled).
    pub idle_compact: bool,
    /// How much of the machine the idle pass may take.
    pub idle_budget: IdleBudget,
    /// Data read within this long is not cold: the cold-data pass leaves
    /// its segment's codec alone (it may still compact it).
    pub read_warm_for: Duration,
    /// Run the cleaner and periodic checkpoints on a background thread.
    pub background: bool,
    /// Log bytes written between periodic checkpoints.
    pub checkpoint_interval_bytes: u64,
    /// Stream buffers write to the medium in batches of this many bytes.
    pub write_batch_bytes: usize,
    /// The background cleaner starts below this many free segments
    /// (`None`: derived from the segment count).
    pub gc_low_free_segments: Option<u64>,
    /// ... and stops once this many are free.
    pub gc_high_free_segments: Option<u64>,
    /// How many segment sequence numbers and versions a root reserves
    /// ahead of use (tests shrink these to exercise renewal).
    pub seq_reserve_ahead: u64,
    pub version_reserve_ahead: u64,
    /// How many free segments a root reserves for allocation.
    pub segment_reserve_ahead: u64,
    /// Where the engine reads the time: a new volume's creation time, how
    /// long opening took.
    pub clock: Arc<dyn Clock>,
    /// Where the engine draws random numbers: a new volume's UUID, which
    /// keys every record checksum.
    pub random: Random,
    /// Open for writing even if the newest durable root's checkpoint cannot
    /// be read (recovery then starts from the older root, and blocks
    /// written in between may be lost). Off, such an image opens read-only
    /// only: writing would replace the lost root and hide the loss.
    pub accept_lost_checkpoint: bool,
    /// Heap bytes the map's leaves may take in RAM; clean leaves beyond it
    /// are evicted and read back from their pages when needed. `None`:
    /// [`default_map_cache_bytes`] of the volume's size.
    pub map_cache_bytes: Option<u64>,
    /// A checkpoint keeps a clean map leaf's page where an earlier one
    /// wrote it if the page's dump segment holds at least this many bytes
    /// of pages the map still needs; otherwise the page moves into the new
    /// dump, so that half-empty dump segments are given back. `None`: half
    /// a segment. (The simulator lowers it, so that its small maps keep
    /// pages too.)
    pub map_page_keep_bytes: Option<u64>,
    /// Deduplicate new writes (persisted); `None` keeps the image's
    /// setting.
    pub dedup: Option<bool>,
    /// RAM the dedup index may take (`--dedup-cache`). `None`:
    /// [`default_dedup_cache_bytes`] of the volume's size.
    pub dedup_cache_bytes: Option<u64>,
}

/// The dedup index's RAM a volume of `logical_size_bytes` gets by
/// default: half a byte per 4 KiB block it holds, at most 1 GiB (a small
/// volume's index takes its floor, about 70 KB, whatever this says). The
/// index's hooks take about half a byte per distinct block stored at its
/// initial sampling, so a volume filled with distinct blocks keeps about
/// all of them findable, beyond the chapters cached; past that the index
/// samples harder (`dedup/mod.rs`). Measured in docs/sharing.md.
pub fn default_dedup_cache_bytes(logical_size_bytes: u64) -> u64 {
    (logical_size_bytes / 8192).min(1 << 30)
}

/// The map cache a volume of `logical_size_bytes` gets by default: an
/// eighth of its map if every block were written (2 bytes per 4 KiB
/// block), at least 64 MiB and at most 4 GiB. A 1 TiB volume gets 512 MiB;
/// a dense map needs 16 bytes per block, so a quarter of a 1 TiB volume
/// written densely fits in it, and so does any sparse fill of 25 million
/// blocks.
pub fn default_map_cache_bytes(logical_size_bytes: u64) -> u64 {
    (logical_size_bytes / 4096 * 2).clamp(64 << 20, 4 << 30)
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            codec: None,
            gc_policy: None,
            unit_blocks: None,
            recompress: Recompress::Idle,
            write_effort: WriteEffort::Adaptive,
            idle_after: Duration::from_secs(5),
            idle_compact: true,
            idle_budget: IdleBudget::default(),
            read_warm_for: Duration::from_secs(60),
            background: true,
            checkpoint_interval_bytes: 1 << 30,
            write_batch_bytes: 128 * 1024,
            gc_low_free_segments: None,
            gc_high_free_segments: None,
            seq_reserve_ahead: space::SEQ_RESERVE_AHEAD,
            version_reserve_ahead: space::VERSION_RESERVE_AHEAD,
            segment_reserve_ahead: space::SEGMENT_RESERVE_AHEAD,
            clock: Arc::new(SystemClock::new()),
            random: Random::from_entropy(),
            accept_lost_checkpoint: false,
            map_cache_bytes: None,
            map_page_keep_bytes: None,
            dedup: None,
            dedup_cache_bytes: None,
        }
    }
}

/// The engine's only source of randomness, shared by the clones of one
/// set of options.
#[derive(Clone)]
pub struct Random(Arc<Mutex<dyn RngCore + Send>>);

impl Random {
    /// Seeded by the operating system.
    pub fn from_entropy() -> Random {
        Random(Arc::new(Mutex::new(StdRng::from_entropy())))
    }

    /// The same numbers for the same seed, for runs that must replay exactly.
    pub fn seeded(seed: u64) -> Random {
        Random(Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))))
    }

    /// Fills `out` with random bytes.
    pub fn fill(&self, out: &mut [u8]) {
        self.0.lock().expect("random source lock").fill_bytes(out);
    }
}

impl fmt::Debug for Random {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Random")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_randomness_repeats() {
        let (a, b) = (Random::seeded(3), Random::seeded(3));
        let (mut x, mut y) = ([0u8; 16], [0u8; 16]);
        a.fill(&mut x);
        b.fill(&mut y);
        assert_eq!(x, y);
        a.fill(&mut y);
        assert_ne!(x, y, "a source moves on");
    }
}
