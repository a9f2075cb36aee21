//! Time, for every crate: what the engine reads, and how a modelled drive
//! spends it.
//!
//! - [`Clock`] is the only way the engine reads time (`OpenOptions::clock`):
//!   [`SystemClock`] in service, [`FixedClock`] for runs that replay from a
//!   seed, [`ManualClock`] for tests that move time by hand.
//! - [`Timing`] says how a model of a device (the emulated NAND drive)
//!   spends the time it charges: by sleeping, or on a virtual timeline.
//! - [`VirtualTime`] is how a harness drives such a timeline: it brackets
//!   each host operation and reads when the operation completed (the
//!   benchmark's virtual-time runs).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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

/// A clock that moves only when told to, for tests of what time decides
/// (idleness, keeping times, intervals). Its wall clock stands at
/// `unix_secs` plus the time advanced.
#[derive(Debug, Default)]
pub struct ManualClock {
    unix_secs: u64,
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock at monotonic zero whose wall clock reads `unix_secs`.
    pub fn new(unix_secs: u64) -> ManualClock {
        ManualClock {
            unix_secs,
            nanos: AtomicU64::new(0),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.nanos
            .fetch_add(by.as_nanos() as u64, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn unix_secs(&self) -> u64 {
        self.unix_secs + self.monotonic().as_secs()
    }

    fn monotonic(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }
}

/// How a model of a device spends the time it charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// Calls sleep until their modelled completion on the monotonic clock.
    Real,
    /// Calls never sleep; a harness brackets each host operation through
    /// [`VirtualTime`].
    Virtual,
}

/// A harness's control of a model running with [`Timing::Virtual`].
pub trait VirtualTime: Send + Sync {
    /// Starts an operation issued at `issue_ns` on the virtual timeline.
    fn begin_op(&self, issue_ns: u64);
    /// Ends it and returns its completion time.
    fn end_op(&self) -> u64;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_clock_stands_still_and_a_manual_one_moves_when_told() {
        let fixed = FixedClock { unix_secs: 42 };
        assert_eq!(fixed.unix_secs(), 42);
        assert_eq!(fixed.monotonic(), fixed.monotonic());
        let manual = ManualClock::new(1_700_000_000);
        assert_eq!(manual.monotonic(), Duration::ZERO);
        manual.advance(Duration::from_millis(2500));
        assert_eq!(manual.monotonic(), Duration::from_millis(2500));
        assert_eq!(manual.unix_secs(), 1_700_000_002);
    }

    #[test]
    fn the_system_clock_never_goes_back() {
        let clock = SystemClock::new();
        let (a, b) = (clock.monotonic(), clock.monotonic());
        assert!(b >= a);
        assert!(clock.unix_secs() > 1_600_000_000);
    }
}
