//! The collector: which root objects the bucket keeps, and what it may
//! delete. A root object is kept for `keep_roots_for` after a newer one
//! is published (readers opened from it keep working that long), then
//! deleted; a segment object is deleted once no kept root and nothing in
//! use (the cache's incarnations, the stash, the root being published)
//! names it, which is known only once every kept root's names are read.
//! The uploader does the deletions (`Shared::collect`), roots first, so an
//! interrupted collection leaves only objects the next one deletes.
//!
//! Invariants: every kept root but the newest is superseded; the newest
//! root is never deleted, nor one kept less than `keep_roots_for` since
//! it was superseded; a root published is newer than every kept one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use crate::objects::Incarnation;

/// What a collection of the bucket's garbage would delete.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct CollectPlan {
    /// Root objects past their keeping time.
    pub roots: Vec<u64>,
    /// Kept roots whose names are not known yet.
    pub unknown: Vec<u64>,
    /// Segment objects nothing needs, with their sizes.
    pub segments: Vec<(Incarnation, u64)>,
}

/// A root object the bucket holds.
struct KeptRoot {
    /// When a newer root was published (or found at open).
    superseded: Option<Duration>,
    /// The incarnations it names, once known.
    names: Option<HashSet<Incarnation>>,
}

pub(super) struct Collector {
    /// Root objects in the bucket, by number.
    roots: BTreeMap<u64, KeptRoot>,
    keep_roots_for: Duration,
    last_collect: Duration,
    collected_at_close: bool,
}

impl Collector {
    /// The roots a listing found (ascending) at `now`: all but the newest
    /// are kept a whole period from now.
    pub(super) fn new(found: &[u64], keep_roots_for: Duration, now: Duration) -> Collector {
        let newest = found.last().copied();
        let roots = found
            .iter()
            .map(|&number| {
                let root = KeptRoot {
                    superseded: (Some(number) != newest).then_some(now),
                    names: None,
                };
                (number, root)
            })
            .collect();
        let collector = Collector {
            roots,
            keep_roots_for,
            last_collect: now,
            collected_at_close: false,
        };
        collector.check();
        collector
    }

    fn check(&self) {
        let newest = self.newest();
        for (&number, root) in &self.roots {
            debug_assert!(
                Some(number) == newest || root.superseded.is_some(),
                "root {number} is superseded by the newest"
            );
        }
    }

    fn newest(&self) -> Option<u64> {
        self.roots.keys().next_back().copied()
    }

    fn expired(&self, root: &KeptRoot, now: Duration) -> bool {
        root.superseded
            .is_some_and(|since| now.saturating_sub(since) >= self.keep_roots_for)
    }

    /// True if a periodic collection is due at `now` (one per `every`).
    pub(super) fn due(&mut self, now: Duration, every: Duration) -> bool {
        if now.saturating_sub(self.last_collect) < every {
            return false;
        }
        self.last_collect = now;
        true
    }

    /// True the first time it is asked: one last collection at close.
    pub(super) fn last_at_close(&mut self) -> bool {
        !std::mem::replace(&mut self.collected_at_close, true)
    }

    /// What a collection would do at `now`: root objects past their
    /// keeping time (never the newest), kept roots whose names must be
    /// read first, and (only once every kept root's names are known)
    /// objects in `in_bucket` that no kept root and nothing `in_use`
    /// names. None if there is nothing to do.
    pub(super) fn plan(
        &self,
        now: Duration,
        in_use: &HashSet<Incarnation>,
        in_bucket: &HashMap<Incarnation, u64>,
    ) -> Option<CollectPlan> {
        let newest = self.newest();
        let mut plan = CollectPlan::default();
        for (&number, root) in &self.roots {
            if self.expired(root, now) && Some(number) != newest {
                plan.roots.push(number);
            } else if root.names.is_none() {
                plan.unknown.push(number);
            }
        }
        if plan.unknown.is_empty() {
            let mut needed: HashSet<Incarnation> = in_use.clone();
            for (number, root) in &self.roots {
                if !plan.roots.contains(number) {
                    needed.extend(root.names.iter().flatten().copied());
                }
            }
            plan.segments = in_bucket
                .iter()
                .filter(|(key, _)| !needed.contains(key))
                .map(|(&key, &len)| (key, len))
                .collect();
            plan.segments.sort_unstable();
        }
        let empty = plan.roots.is_empty() && plan.unknown.is_empty() && plan.segments.is_empty();
        (!empty).then_some(plan)
    }

    /// Kept root `number` names `names` (read from the bucket; empty if
    /// it is gone already).
    pub(super) fn named(&mut self, number: u64, names: HashSet<Incarnation>) {
        let root = self.roots.get_mut(&number).expect("a named root is kept");
        root.names = Some(names);
    }

    /// Root object `number` was deleted at `now`.
    pub(super) fn root_deleted(&mut self, number: u64, now: Duration) {
        assert_ne!(
            Some(number),
            self.newest(),
            "the newest root is never deleted"
        );
        let root = self.roots.remove(&number).expect("a deleted root was kept");
        assert!(
            self.expired(&root, now),
            "root {number} deleted before its time"
        );
    }

    /// Root object `number`, naming `names`, was published at `now`.
    pub(super) fn published(&mut self, number: u64, names: HashSet<Incarnation>, now: Duration) {
        assert!(
            self.newest().is_none_or(|newest| newest < number),
            "root {number} is newer than every kept root"
        );
        for older in self.roots.values_mut() {
            older.superseded.get_or_insert(now);
        }
        let root = KeptRoot {
            superseded: None,
            names: Some(names),
        };
        self.roots.insert(number, root);
        self.check();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zdisk_core::Clock;
    use zdisk_core::ManualClock;

    const KEEP: Duration = Duration::from_secs(600);

    fn names(list: &[Incarnation]) -> HashSet<Incarnation> {
        list.iter().copied().collect()
    }

    #[test]
    fn a_superseded_root_is_kept_for_its_time_then_deleted() {
        let clock = ManualClock::new(1_700_000_000);
        let mut collector = Collector::new(&[], KEEP, clock.monotonic());
        let in_bucket = HashMap::from([((0, 1, 9), 4096), ((1, 2, 9), 4096)]);
        let none = HashSet::new();
        collector.published(1, names(&[(0, 1, 9)]), clock.monotonic());
        assert_eq!(
            collector.plan(clock.monotonic(), &none, &in_bucket),
            Some(CollectPlan {
                segments: vec![((1, 2, 9), 4096)],
                ..CollectPlan::default()
            }),
            "only what no root names"
        );
        clock.advance(Duration::from_secs(5));
        collector.published(2, names(&[(1, 2, 9)]), clock.monotonic());
        clock.advance(KEEP - Duration::from_secs(1));
        assert_eq!(collector.plan(clock.monotonic(), &none, &in_bucket), None);
        clock.advance(Duration::from_secs(1));
        let plan = collector.plan(clock.monotonic(), &none, &in_bucket);
        let plan = plan.expect("root 1 has had its time");
        assert_eq!(plan.roots, vec![1]);
        assert_eq!(
            plan.segments,
            vec![((0, 1, 9), 4096)],
            "named by root 1 only"
        );
        collector.root_deleted(1, clock.monotonic());
        assert!(collector.last_at_close());
        assert!(!collector.last_at_close(), "once");
    }

    #[test]
    fn the_newest_root_stays_and_segments_wait_for_every_roots_names() {
        let clock = ManualClock::new(1_700_000_000);
        let mut collector = Collector::new(&[4, 5], KEEP, clock.monotonic());
        let in_bucket = HashMap::from([((0, 1, 9), 4096), ((1, 2, 9), 4096), ((2, 3, 9), 10)]);
        let in_use = names(&[(2, 3, 9)]);
        let plan = collector.plan(clock.monotonic(), &in_use, &in_bucket);
        assert_eq!(plan.map(|plan| plan.unknown), Some(vec![4, 5]));
        collector.named(4, names(&[(0, 1, 9)]));
        collector.named(5, names(&[(1, 2, 9)]));
        assert_eq!(collector.plan(clock.monotonic(), &in_use, &in_bucket), None);
        clock.advance(KEEP * 10);
        let plan = collector.plan(clock.monotonic(), &in_use, &in_bucket);
        assert_eq!(
            plan,
            Some(CollectPlan {
                roots: vec![4],
                unknown: vec![],
                segments: vec![((0, 1, 9), 4096)],
            }),
            "never the newest root, nor what is in use"
        );
    }

    #[test]
    fn collections_come_once_a_period() {
        let mut collector = Collector::new(&[], KEEP, Duration::ZERO);
        let every = Duration::from_secs(10);
        assert!(!collector.due(Duration::from_secs(9), every));
        assert!(collector.due(Duration::from_secs(10), every));
        assert!(!collector.due(Duration::from_secs(19), every));
        assert!(collector.due(Duration::from_secs(20), every));
    }

    #[test]
    #[should_panic(expected = "deleted before its time")]
    fn a_root_is_not_deleted_before_its_time() {
        let mut collector = Collector::new(&[], KEEP, Duration::ZERO);
        collector.published(1, HashSet::new(), Duration::ZERO);
        collector.published(2, HashSet::new(), Duration::from_secs(1));
        collector.root_deleted(1, Duration::from_secs(2));
    }
}
