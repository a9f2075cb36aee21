//! The host I/O counters, kept without the state lock.
//!
//! A 4 KiB read used to take the state lock twice just to count itself.
//! These counters are atomics instead, sharded so that threads on
//! different cores do not bounce one cache line: each thread adds to its
//! own shard, and a reader of the counters sums them. They hold what
//! happened since the volume opened; [`State::counters`](super::state::State)
//! adds them to what the last root carried.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::stats::Counters;

/// Counter events outside the mutation methods (which count their own).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Tally {
    /// A host WRITE request of this many bytes was served.
    HostWrite(u64),
    HostRead(u64),
    HostTrim(u64),
    HostZero(u64),
    /// Of a host write, this many bytes were compressed at fast effort.
    HostWriteFast(u64),
    /// Bytes read from the medium for host reads.
    MediaRead(u64),
    /// Bytes the cleaner read from a victim.
    GcRead(u64),
    Flush,
    /// A root of this many bytes was written to a metadata slot.
    RootWritten(u64),
    /// A checkpoint's dump of this many bytes was written.
    DumpWritten(u64),
    /// A read found a block damaged.
    DamageFound,
}

const SHARDS: usize = 8;

/// One shard: a cache line (two, against adjacent-line prefetch) of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard {
    host_write_bytes: AtomicU64,
    host_write_requests: AtomicU64,
    host_read_bytes: AtomicU64,
    host_trim_bytes: AtomicU64,
    host_zero_bytes: AtomicU64,
    host_write_fast_bytes: AtomicU64,
    media_read_bytes: AtomicU64,
    flushes: AtomicU64,
    damaged_blocks_found: AtomicU64,
}

/// Counters of host I/O since the volume opened. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Tallies {
    shards: [Shard; SHARDS],
}

thread_local! {
    /// This thread's shard.
    static SHARD: usize = {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS
    };
}

impl Tallies {
    /// Counts `tally` if it is one of the host I/O counters kept here;
    /// false if it is not (the state counts it under its lock).
    pub(crate) fn add(&self, tally: Tally) -> bool {
        let shard = &self.shards[SHARD.with(|s| *s)];
        let add = |counter: &AtomicU64, n: u64| {
            counter.fetch_add(n, Ordering::Relaxed);
        };
        match tally {
            Tally::HostWrite(bytes) => {
                add(&shard.host_write_bytes, bytes);
                add(&shard.host_write_requests, 1);
            }
            Tally::HostRead(bytes) => add(&shard.host_read_bytes, bytes),
            Tally::HostTrim(bytes) => add(&shard.host_trim_bytes, bytes),
            Tally::HostZero(bytes) => add(&shard.host_zero_bytes, bytes),
            Tally::HostWriteFast(bytes) => add(&shard.host_write_fast_bytes, bytes),
            Tally::MediaRead(bytes) => add(&shard.media_read_bytes, bytes),
            Tally::Flush => add(&shard.flushes, 1),
            Tally::DamageFound => add(&shard.damaged_blocks_found, 1),
            Tally::GcRead(_) | Tally::RootWritten(_) | Tally::DumpWritten(_) => return false,
        }
        true
    }

    /// `base` plus everything counted here.
    pub(crate) fn added_to(&self, mut base: Counters) -> Counters {
        for shard in &self.shards {
            let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
            base.host_write_bytes += get(&shard.host_write_bytes);
            base.host_write_requests += get(&shard.host_write_requests);
            base.host_read_bytes += get(&shard.host_read_bytes);
            base.host_trim_bytes += get(&shard.host_trim_bytes);
            base.host_zero_bytes += get(&shard.host_zero_bytes);
            base.host_write_fast_bytes += get(&shard.host_write_fast_bytes);
            base.media_read_bytes += get(&shard.media_read_bytes);
            base.flushes += get(&shard.flushes);
            base.damaged_blocks_found += get(&shard.damaged_blocks_found);
        }
        base
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tallies_from_many_threads_all_count() {
        let tallies = Tallies::default();
        std::thread::scope(|scope| {
            for _ in 0..(SHARDS + 3) {
                scope.spawn(|| {
                    for _ in 0..1000 {
                        assert!(tallies.add(Tally::HostRead(4096)));
                        assert!(tallies.add(Tally::HostWrite(512)));
                    }
                });
            }
        });
        assert!(
            !tallies.add(Tally::GcRead(1)),
            "the state counts the cleaner's reads"
        );
        let base = Counters {
            host_read_bytes: 7,
            ..Counters::default()
        };
        let counters = tallies.added_to(base);
        let threads = (SHARDS + 3) as u64;
        assert_eq!(counters.host_read_bytes, 7 + threads * 1000 * 4096);
        assert_eq!(counters.host_write_bytes, threads * 1000 * 512);
        assert_eq!(counters.host_write_requests, threads * 1000);
    }
}
