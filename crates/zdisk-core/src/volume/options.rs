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
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::rngs::{SmallRng, StdRng};
use rand::{RngCore, SeedableRng};

use crate::codec::Codec;
use crate::gc::GcPolicy;
use crate::meta::MediaKind;

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
}

impl CreateOptions {
    pub fn new(logical_size_bytes: u64) -> Self {
        CreateOptions {
            logical_size_bytes,
            codec: Codec::default(),
            gc_policy: GcPolicy::default(),
            unit_blocks: crate::meta::default_unit_blocks(Codec::default()),
            media_kind: MediaKind::File,
            media_params: Vec::new(),
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
        }
    }
}

/// The idle pass's share of the machine: after each step it pauses long
/// enough that its CPU time stays within `cpu_share` of one core and the
/// bytes it reads and writes within `io_bytes_per_sec`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdleBudget {
    /// Fraction of one core, above 0 and at most 1.
    pub cpu_share: f64,
    /// Bytes per second the pass may read and write together.
    pub io_bytes_per_sec: u64,
}

impl Default for IdleBudget {
    fn default() -> Self {
        IdleBudget {
            cpu_share: 0.5,
            io_bytes_per_sec: 64 << 20,
        }
    }
}

impl IdleBudget {
    /// The pause after a step that took `busy` and moved `io_bytes`.
    pub fn pause_after(&self, busy: Duration, io_bytes: u64) -> Duration {
        let share = self.cpu_share.clamp(0.01, 1.0);
        let for_cpu = busy.mul_f64((1.0 - share) / share);
        let for_io = match self.io_bytes_per_sec {
            0 => Duration::ZERO,
            rate => Duration::from_secs_f64(io_bytes as f64 / rate as f64).saturating_sub(busy),
        };
        for_cpu.max(for_io)
    }
}

/// The engine's only view of time.
pub trait Clock: fmt::Debug + Send + Sync {
    /// Seconds since the Unix epoch.
    fn unix_secs(&self) -> u64;
    /// A monotonic reading: only differences between readings mean anything.
    fn monotonic(&self) -> Duration;
}

/// The operating system's clocks.
#[derive(Debug)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> SystemClock {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn unix_secs(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }

    fn monotonic(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that stands still at `unix_secs`, for runs that must replay
/// exactly.
#[derive(Debug, Clone, Copy)]
pub struct FixedClock {
    pub unix_secs: u64,
}

impl Clock for FixedClock {
    fn unix_secs(&self) -> u64 {
        self.unix_secs
    }

    fn monotonic(&self) -> Duration {
        Duration::ZERO
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
    fn seeded_randomness_and_a_fixed_clock_repeat() {
        let (a, b) = (Random::seeded(3), Random::seeded(3));
        let (mut x, mut y) = ([0u8; 16], [0u8; 16]);
        a.fill(&mut x);
        b.fill(&mut y);
        assert_eq!(x, y);
        a.fill(&mut y);
        assert_ne!(x, y, "a source moves on");
        let clock = FixedClock { unix_secs: 42 };
        assert_eq!(clock.unix_secs(), 42);
        assert_eq!(clock.monotonic(), clock.monotonic());
    }

    #[test]
    fn the_idle_budget_bounds_cpu_and_io() {
        let budget = IdleBudget {
            cpu_share: 0.5,
            io_bytes_per_sec: 10 << 20,
        };
        let ms = Duration::from_millis;
        // CPU-bound: as long a pause as the step took.
        assert_eq!(budget.pause_after(ms(40), 0), ms(40));
        // IO-bound: 20 MiB at 10 MiB/s is 2 s in all, step included.
        assert_eq!(budget.pause_after(ms(40), 20 << 20), ms(1960));
        let quarter = IdleBudget {
            cpu_share: 0.25,
            io_bytes_per_sec: 0,
        };
        assert_eq!(quarter.pause_after(ms(10), 1 << 30), ms(30));
    }
}

/// When data found cold is rewritten in larger units with a stronger
/// codec, so that a volume's ratio improves over time (see
/// `volume/moves.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompress {
    /// Never.
    Off,
    /// When the volume is idle: a background pass with a CPU budget
    /// rewrites cold segments, and compacts mostly dead ones.
    #[default]
    Idle,
    /// Also whenever the background cleaner relocates a cold victim.
    Gc,
}

impl Recompress {
    pub fn parse(text: &str) -> std::result::Result<Recompress, String> {
        match text {
            "off" => Ok(Recompress::Off),
            "idle" => Ok(Recompress::Idle),
            "gc" => Ok(Recompress::Gc),
            other => Err(format!(
                "unknown recompress mode {other:?}: use off, idle or gc"
            )),
        }
    }
}

impl fmt::Display for Recompress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Recompress::Off => "off",
            Recompress::Idle => "idle",
            Recompress::Gc => "gc",
        })
    }
}
