//! The tier's counters: atomics every request may bump without a lock,
//! and the stats `media_stats` reports (names, help, values in order).

use std::sync::atomic::{AtomicU64, Ordering};

use zdisk_core::media::MediaStat;

/// The tier's stats, in the order `media_stats` gives their values.
const TIER_STATS: [(&str, &str); 13] = [
    (
        "tier_lag_bytes",
        "Bytes written locally and not yet in the bucket.",
    ),
    (
        "tier_uploaded_bytes",
        "Bytes of segments uploaded to the bucket.",
    ),
    (
        "tier_fetched_bytes",
        "Bytes of evicted segments fetched from the bucket.",
    ),
    (
        "tier_cache_hits",
        "Segment reads served by the local cache or fetched RAM.",
    ),
    ("tier_cache_misses", "Segment reads that needed the bucket."),
    (
        "tier_evicted_bytes",
        "Bytes of segments dropped from the local cache.",
    ),
    (
        "tier_resident_bytes",
        "Bytes of segments the local cache holds.",
    ),
    ("tier_roots_published", "Root objects this run published."),
    (
        "tier_deleted_bytes",
        "Bytes of segment objects deleted from the bucket (no kept root needed them).",
    ),
    (
        "tier_roots_deleted",
        "Old root objects deleted after --tier-keep.",
    ),
    (
        "tier_written_back_bytes",
        "Bytes of evicted segments fetched whole and written back into the cache.",
    ),
    (
        "tier_held_micros",
        "Microseconds new segments waited for uploads to make room in the cache.",
    ),
    (
        "tier_bucket_root",
        "Number of the newest root object published or restored from.",
    ),
];

#[derive(Default)]
pub(super) struct Counters {
    /// Time new segments waited for room in the cache.
    pub held_micros: AtomicU64,
    pub deleted_bytes: AtomicU64,
    pub deleted_roots: AtomicU64,
    pub written_back_bytes: AtomicU64,
    pub uploaded_bytes: AtomicU64,
    pub fetched_bytes: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub evicted_bytes: AtomicU64,
    pub roots_published: AtomicU64,
}

/// Adds `by` to `counter`.
pub(super) fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl Counters {
    /// The stats, with the three values read from the state.
    pub(super) fn media_stats(&self, lag: u64, resident: u64, bucket_root: u64) -> Vec<MediaStat> {
        let counter = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let values = [
            lag,
            counter(&self.uploaded_bytes),
            counter(&self.fetched_bytes),
            counter(&self.cache_hits),
            counter(&self.cache_misses),
            counter(&self.evicted_bytes),
            resident,
            counter(&self.roots_published),
            counter(&self.deleted_bytes),
            counter(&self.deleted_roots),
            counter(&self.written_back_bytes),
            counter(&self.held_micros),
            bucket_root,
        ];
        TIER_STATS
            .iter()
            .zip(values)
            .map(|(&(name, help), value)| MediaStat { name, help, value })
            .collect()
    }
}
