//! How a tiered volume runs: the settings the binary or a test hands
//! `TieredMedia::open`, the clock the tier reads time from among them.

use std::sync::Arc;
use std::time::Duration;

use zdisk_core::{Clock, SystemClock};

/// How a tiered volume runs.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Longest time between root objects while the volume is written.
    pub publish_interval: Duration,
    /// RAM for fetched granules of evicted segments.
    pub fetch_cache_bytes: u64,
    /// How long one request to the store is retried before it fails.
    pub retry_timeout: Duration,
    /// Upload and publish nothing (a reader of someone else's volume).
    pub read_only: bool,
    /// A FLUSH returns only once a root object covering it is in the bucket.
    pub sync: bool,
    /// How long a root object stays in the bucket after a newer one is
    /// published (readers opened from it keep working that long); segment
    /// objects no kept root names are then deleted.
    pub keep_roots_for: Duration,
    /// At open, how long to wait for a bucket that is out of reach (the
    /// gateway down, the network not up yet) before refusing to open.
    pub wait_for_bucket: Duration,
    /// Where the tier reads the time for its decisions (when to publish,
    /// collect, give up); its `monotonic` readings are all it keeps.
    /// Waits on condition variables still time out in real time.
    pub clock: Arc<dyn Clock>,
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            publish_interval: Duration::from_secs(10),
            fetch_cache_bytes: 64 << 20,
            retry_timeout: Duration::from_secs(30),
            read_only: false,
            sync: false,
            keep_roots_for: Duration::from_secs(600),
            wait_for_bucket: Duration::ZERO,
            clock: Arc::new(SystemClock::new()),
        }
    }
}
