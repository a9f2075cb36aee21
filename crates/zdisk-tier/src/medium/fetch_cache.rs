//! The fetch cache: granules of evicted segments fetched from the bucket,
//! kept in RAM within a bound, and the fetches under way. It lives behind
//! its own lock ("tier fetch"), never held with the state lock nor during
//! a fetch: a read that finds its granule being fetched waits for that
//! fetch (`Shared::fetch_done`) instead of fetching it again.
//!
//! Invariants: `bytes` is the sum of the granules' lengths and at most
//! the bound once a fetch has been added; a granule is fetched by one
//! reader at a time, and only while it is not cached; the least recently
//! used granule goes first.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;

use crate::objects::Incarnation;

/// Bytes of an evicted segment fetched at a time.
pub(super) const GRANULE_BYTES: u64 = 1 << 20;

/// A granule: its incarnation and its number in it.
pub(super) type GranuleKey = (Incarnation, u64);

/// What a read finds for a granule.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Lookup {
    Hit(Bytes),
    /// Nobody fetches it: this read does, and must call `fetch_done`.
    Fetch,
    /// Another read fetches it: wait for `fetch_done`, then look again.
    Wait,
    /// The fetch this read waited for failed.
    Failed,
}

pub(super) struct FetchCache {
    /// Granule → bytes and last use.
    granules: HashMap<GranuleKey, (Bytes, u64)>,
    /// Granules being fetched.
    in_flight: HashSet<GranuleKey>,
    bytes: u64,
    bound_bytes: u64,
    tick: u64,
}

impl FetchCache {
    pub(super) fn new(bound_bytes: u64) -> FetchCache {
        FetchCache {
            granules: HashMap::new(),
            in_flight: HashSet::new(),
            bytes: 0,
            bound_bytes,
            tick: 0,
        }
    }

    fn check(&self) {
        debug_assert_eq!(
            self.bytes,
            self.granules
                .values()
                .map(|(bytes, _)| bytes.len() as u64)
                .sum::<u64>(),
            "the fetch cache counts its granules' bytes"
        );
        assert!(
            self.bytes <= self.bound_bytes,
            "the fetch cache within its bound"
        );
    }

    /// Looks `key` up for a read; `waited` if that read already waited
    /// for another's fetch of it.
    pub(super) fn lookup(&mut self, key: GranuleKey, waited: bool) -> Lookup {
        self.tick += 1;
        let tick = self.tick;
        if let Some((bytes, used)) = self.granules.get_mut(&key) {
            *used = tick;
            return Lookup::Hit(bytes.clone());
        }
        if waited && !self.in_flight.contains(&key) {
            return Lookup::Failed;
        }
        if self.in_flight.insert(key) {
            Lookup::Fetch
        } else {
            Lookup::Wait
        }
    }

    /// The fetch of `key` this read made ended, with its bytes if it
    /// succeeded: they are kept, and the least recently used granules
    /// go while the cache is over its bound.
    pub(super) fn fetch_done(&mut self, key: GranuleKey, fetched: Option<Bytes>) {
        assert!(self.in_flight.remove(&key), "a granule's fetch ends once");
        let Some(bytes) = fetched else { return };
        self.tick += 1;
        self.bytes += bytes.len() as u64;
        let old = self.granules.insert(key, (bytes, self.tick));
        assert!(old.is_none(), "a granule is fetched only while not cached");
        while self.bytes > self.bound_bytes {
            let oldest = self
                .granules
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(key, _)| *key)
                .expect("a cache over its bound holds something");
            let (old, _) = self.granules.remove(&oldest).expect("present");
            self.bytes -= old.len() as u64;
        }
        self.check();
    }

    #[cfg(test)]
    fn holds(&self, key: &GranuleKey) -> bool {
        self.granules.contains_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(granule: u64) -> GranuleKey {
        ((3, 7, 1), granule)
    }

    fn fetch(cache: &mut FetchCache, granule: u64, len: usize) {
        assert_eq!(cache.lookup(key(granule), false), Lookup::Fetch);
        cache.fetch_done(key(granule), Some(Bytes::from(vec![granule as u8; len])));
    }

    #[test]
    fn the_cache_stays_within_its_bound_and_drops_the_least_recently_used() {
        let mut cache = FetchCache::new(300);
        fetch(&mut cache, 0, 100);
        fetch(&mut cache, 1, 100);
        fetch(&mut cache, 2, 100);
        assert!(
            matches!(cache.lookup(key(0), false), Lookup::Hit(_)),
            "0 used again"
        );
        fetch(&mut cache, 3, 100);
        assert!(!cache.holds(&key(1)), "1 was the least recently used");
        assert!(cache.holds(&key(0)) && cache.holds(&key(2)) && cache.holds(&key(3)));
        fetch(&mut cache, 4, 250);
        assert!(cache.holds(&key(4)));
        assert_eq!(cache.bytes, 250, "all older granules went");
        fetch(&mut cache, 5, 301);
        assert_eq!(
            cache.bytes, 0,
            "a granule larger than the bound is not kept"
        );
    }

    #[test]
    fn a_second_reader_waits_for_the_fetch_under_way() {
        let mut cache = FetchCache::new(300);
        assert_eq!(cache.lookup(key(0), false), Lookup::Fetch);
        assert_eq!(cache.lookup(key(0), false), Lookup::Wait);
        assert_eq!(cache.lookup(key(0), true), Lookup::Wait, "still under way");
        cache.fetch_done(key(0), Some(Bytes::from_static(b"abc")));
        assert_eq!(
            cache.lookup(key(0), true),
            Lookup::Hit(Bytes::from_static(b"abc"))
        );
    }

    #[test]
    fn a_waiter_sees_the_fetch_fail_and_a_new_read_fetches_again() {
        let mut cache = FetchCache::new(300);
        assert_eq!(cache.lookup(key(0), false), Lookup::Fetch);
        assert_eq!(cache.lookup(key(0), false), Lookup::Wait);
        cache.fetch_done(key(0), None);
        assert_eq!(cache.lookup(key(0), true), Lookup::Failed);
        assert_eq!(cache.lookup(key(0), false), Lookup::Fetch);
    }

    #[test]
    #[should_panic(expected = "ends once")]
    fn a_fetch_nobody_started_cannot_end() {
        FetchCache::new(300).fetch_done(key(0), None);
    }
}
