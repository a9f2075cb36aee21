//! A clock the tier's unit tests move by hand (`advance`), so that what
//! the tier decides by time (publishing, collecting, giving up) is tested
//! without waiting.

use std::sync::Mutex;
use std::time::Duration;

use zdisk_core::Clock;

#[derive(Debug, Default)]
pub(super) struct ManualClock {
    now: Mutex<Duration>,
}

impl ManualClock {
    pub(super) fn new() -> ManualClock {
        ManualClock::default()
    }

    pub(super) fn advance(&self, by: Duration) {
        *self.now.lock().expect("manual clock") += by;
    }
}

impl Clock for ManualClock {
    fn unix_secs(&self) -> u64 {
        1_700_000_000 + self.monotonic().as_secs()
    }

    fn monotonic(&self) -> Duration {
        *self.now.lock().expect("manual clock")
    }
}
