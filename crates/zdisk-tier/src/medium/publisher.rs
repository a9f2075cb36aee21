//! The publisher: which engine root the bucket is to get next, and when.
//!
//! The engine writes a root to a metadata slot (`pending`), syncs (it is
//! `latest` then), and the publisher makes it the *target*: a snapshot of
//! every incarnation the cache holds and its length. Once the bucket holds
//! all of that, the target is written as a root object and is
//! `published`. A root is due at most once per `publish_interval` (at
//! once at close, at the first publication and when a `--tier-sync`
//! FLUSH waits), and again while more of the log it replays is written.
//!
//! Invariants: a root is published only once everything it names is in
//! the bucket; the published engine generation never goes back; a sync
//! request is answered only by a root that covers it (`sync_published <=
//! sync_requests`).

use std::collections::HashMap;
use std::time::Duration;

use super::segments::SegmentTable;
use super::uploads::Uploads;
use crate::objects::{Incarnation, RootObject, SegmentEntry};

/// An engine root durable locally: (generation, clean, its bytes).
pub(super) type LocalRoot = (u64, bool, Vec<u8>);

/// A root being published: what it needs uploaded first.
struct Target {
    generation: u64,
    clean: bool,
    /// The `--tier-sync` request it answers once published.
    covers_sync: u64,
    engine_root: Vec<u8>,
    entries: Vec<SegmentEntry>,
}

/// What the publisher wants done next.
#[derive(Debug)]
pub(super) enum Step {
    /// Write this root object: engine root `generation`, answering sync
    /// request `covers_sync`.
    Publish(RootObject, u64, u64),
    /// The root being published waits for an upload (or was given up
    /// for a newer one: its incarnation was reused before it got there).
    Wait,
    /// A root is chosen: the uploads it needs come first.
    Chosen,
    /// Nothing to publish; `answered` if the published root was found to
    /// cover every sync asked for.
    Idle { answered: bool },
}

pub(super) struct Publisher {
    writer_id: [u8; 16],
    publish_interval: Duration,
    /// The newest root written to a slot and not yet synced.
    pending_root: Option<Vec<u8>>,
    /// The newest root durable locally.
    latest_root: Option<LocalRoot>,
    published_generation: Option<u64>,
    /// What the newest root this run published lists: incarnation → bytes.
    published_entries: HashMap<Incarnation, u64>,
    last_publish: Duration,
    target: Option<Target>,
    /// `--tier-sync`: requests made, and the newest one a published root covers.
    sync_requests: u64,
    sync_published: u64,
    /// When an upload or publication last succeeded.
    last_progress: Duration,
}

impl Publisher {
    pub(super) fn new(
        writer_id: [u8; 16],
        publish_interval: Duration,
        latest_root: Option<LocalRoot>,
        now: Duration,
    ) -> Publisher {
        Publisher {
            writer_id,
            publish_interval,
            pending_root: None,
            latest_root,
            published_generation: None,
            published_entries: HashMap::new(),
            last_publish: now,
            target: None,
            sync_requests: 0,
            sync_published: 0,
            last_progress: now,
        }
    }

    /// The engine wrote `root` to a metadata slot.
    pub(super) fn root_written(&mut self, root: Vec<u8>) {
        self.pending_root = Some(root);
    }

    /// The root written last, to be made durable by the sync under way.
    pub(super) fn take_pending(&mut self) -> Option<Vec<u8>> {
        self.pending_root.take()
    }

    /// A root is durable locally: the newest one is to be published.
    pub(super) fn root_durable(&mut self, generation: u64, clean: bool, root: Vec<u8>) {
        let newer = self
            .latest_root
            .as_ref()
            .is_none_or(|latest| latest.0 < generation);
        if newer {
            self.latest_root = Some((generation, clean, root));
        }
    }

    pub(super) fn has_published(&self) -> bool {
        self.published_generation.is_some()
    }

    /// True once the newest local root is the newest published one.
    pub(super) fn settled(&self) -> bool {
        self.has_published()
            && self.latest_root.as_ref().map(|root| root.0) == self.published_generation
    }

    /// What the root being published needs in the bucket: incarnation → bytes.
    pub(super) fn needs(&self) -> HashMap<Incarnation, u64> {
        self.target
            .iter()
            .flat_map(|target| target.entries.iter())
            .map(|entry| (entry.incarnation(), entry.len_bytes))
            .collect()
    }

    /// The incarnations the root being published names.
    pub(super) fn target_incarnations(&self) -> impl Iterator<Item = Incarnation> + '_ {
        self.target
            .iter()
            .flat_map(|target| target.entries.iter().map(SegmentEntry::incarnation))
    }

    /// True if a root made now would list bytes the newest published one
    /// does not.
    fn uncovered(&self, segments: &SegmentTable) -> bool {
        segments.entries().iter().any(|entry| {
            self.published_entries
                .get(&entry.incarnation())
                .is_none_or(|&published| published < entry.len_bytes)
        })
    }

    /// What to do next, at `now`, for root object `number` (the next).
    pub(super) fn step(
        &mut self,
        segments: &SegmentTable,
        uploads: &Uploads,
        now: Duration,
        closing: bool,
        number: u64,
    ) -> Step {
        if let Some(target) = &self.target {
            if let Some(entry) = uploads.missing(&target.entries) {
                if !segments.holds_local_of(entry.segment, entry.seq32, entry.writer) {
                    log::warn!(
                        "tier: segment {} changed before root {} could be published; a newer root will be",
                        entry.segment,
                        target.generation
                    );
                    self.target = None;
                }
                return Step::Wait;
            }
            let root = RootObject {
                number,
                writer_id: self.writer_id,
                clean: target.clean,
                segments: target.entries.clone(),
                engine_root: target.engine_root.clone(),
            };
            return Step::Publish(root, target.generation, target.covers_sync);
        }
        let sync_wanted = self.sync_requests > self.sync_published;
        let mut answered = false;
        if let Some((generation, clean, engine_root)) = &self.latest_root {
            // A newer root, or the same (not clean) root with more of the
            // log it replays: what a crash at this moment would leave.
            let newer = self.published_generation != Some(*generation);
            let more_log = !*clean && (uploads.lag_bytes(segments) > 0 || self.uncovered(segments));
            if !newer && !more_log && sync_wanted {
                // The published root already covers every sync asked for.
                self.sync_published = self.sync_requests;
                answered = true;
            }
            let due = (newer || more_log)
                && (closing
                    || sync_wanted
                    || self.published_generation.is_none()
                    || now.saturating_sub(self.last_publish) >= self.publish_interval);
            if due {
                self.target = Some(Target {
                    generation: *generation,
                    clean: *clean,
                    covers_sync: self.sync_requests,
                    engine_root: engine_root.clone(),
                    entries: segments.entries(),
                });
                return Step::Chosen;
            }
        }
        Step::Idle { answered }
    }

    /// A root object listing `entries` is in the bucket: the target, of
    /// engine root `generation` answering sync `covers_sync`; or, with no
    /// generation, an earlier snapshot, which leaves the target to be
    /// published next.
    pub(super) fn published(
        &mut self,
        generation: Option<u64>,
        covers_sync: u64,
        entries: HashMap<Incarnation, u64>,
        uploads: &Uploads,
        now: Duration,
    ) {
        if let Some(generation) = generation {
            let target = self.target.take().expect("the root published was chosen");
            assert_eq!(
                target.generation, generation,
                "the target is what was published"
            );
            for (key, &len) in &entries {
                assert!(
                    uploads.there(key) >= len,
                    "root of generation {generation} published before {key:?} was in the bucket"
                );
            }
            assert!(
                self.published_generation <= Some(generation),
                "a published root never goes back"
            );
            self.published_generation = Some(generation);
            self.last_publish = now;
            self.sync_published = self.sync_published.max(covers_sync);
            assert!(
                self.sync_published <= self.sync_requests,
                "a sync is answered once asked"
            );
        }
        self.published_entries = entries;
    }

    /// A `--tier-sync` FLUSH asks for a root covering what it made durable.
    pub(super) fn request_sync(&mut self) -> u64 {
        self.sync_requests += 1;
        self.sync_requests
    }

    pub(super) fn synced(&self, ticket: u64) -> bool {
        self.sync_published >= ticket
    }

    /// An upload or publication succeeded at `now`.
    pub(super) fn progressed(&mut self, now: Duration) {
        self.last_progress = now;
    }

    /// How long nothing has succeeded, at `now`.
    pub(super) fn since_progress(&self, now: Duration) -> Duration {
        now.saturating_sub(self.last_progress)
    }
}

#[cfg(test)]
mod tests {
    use super::super::segments::{LocalSeg, Seg};
    use super::*;

    const ME: u64 = 1;
    const INTERVAL: Duration = Duration::from_secs(10);

    /// Segment 0 written to 8192 (incarnation 4), not sealed.
    fn segments() -> SegmentTable {
        let mut open = LocalSeg::found(4, ME, 8192, 8192);
        open.sealed = None;
        SegmentTable::new(vec![Seg::Local(open), Seg::Empty])
    }

    fn publisher(now: Duration) -> Publisher {
        Publisher::new([1; 16], INTERVAL, Some((3, false, vec![3])), now)
    }

    fn publish(publisher: &mut Publisher, uploads: &Uploads, now: Duration) -> RootObject {
        let Step::Publish(root, generation, covers_sync) =
            publisher.step(&segments(), uploads, now, false, 1)
        else {
            panic!("a root to publish");
        };
        let entries = root
            .segments
            .iter()
            .map(|entry| (entry.incarnation(), entry.len_bytes));
        publisher.published(
            Some(generation),
            covers_sync,
            entries.collect(),
            uploads,
            now,
        );
        root
    }

    #[test]
    fn a_root_is_not_published_before_all_it_names_is_uploaded() {
        let segments = segments();
        let mut uploads = Uploads::new(HashMap::new());
        let mut publisher = publisher(Duration::ZERO);
        let now = Duration::from_secs(1);
        assert!(matches!(
            publisher.step(&segments, &uploads, now, false, 1),
            Step::Chosen
        ));
        assert_eq!(publisher.needs(), HashMap::from([((0, 4, ME), 8192)]));
        uploads.landed((0, 4, ME), 4096);
        assert!(matches!(
            publisher.step(&segments, &uploads, now, false, 1),
            Step::Wait
        ));
        uploads.landed((0, 4, ME), 8192);
        let root = publish(&mut publisher, &uploads, now);
        assert_eq!((root.number, root.segments.len()), (1, 1));
        assert!(publisher.settled());
        assert!(matches!(
            publisher.step(&segments, &uploads, now, false, 2),
            Step::Idle { answered: false }
        ));
    }

    #[test]
    #[should_panic(expected = "published before")]
    fn publishing_what_the_bucket_lacks_panics() {
        let mut uploads = Uploads::new(HashMap::new());
        let mut publisher = publisher(Duration::ZERO);
        publisher.step(&segments(), &uploads, Duration::ZERO, false, 1);
        uploads.landed((0, 4, ME), 8192);
        let _ = publish(&mut publisher, &uploads, Duration::ZERO);
        let entries = HashMap::from([((1, 2, ME), 4096)]);
        publisher.root_durable(4, false, vec![4]);
        publisher.step(&segments(), &uploads, Duration::ZERO, true, 2);
        publisher.published(Some(4), 0, entries, &uploads, Duration::ZERO);
    }

    #[test]
    fn a_newer_root_waits_for_the_publish_interval_unless_a_sync_asks() {
        let start = Duration::from_secs(100);
        let segments = segments();
        let mut uploads = Uploads::new(HashMap::new());
        uploads.landed((0, 4, ME), 8192);
        let mut publisher = publisher(start);
        publisher.step(&segments, &uploads, start, false, 1);
        let _ = publish(&mut publisher, &uploads, start);
        publisher.root_durable(5, false, vec![5]);
        let soon = start + INTERVAL - Duration::from_millis(1);
        assert!(matches!(
            publisher.step(&segments, &uploads, soon, false, 2),
            Step::Idle { .. }
        ));
        assert!(matches!(
            publisher.step(&segments, &uploads, start + INTERVAL, false, 2),
            Step::Chosen
        ));
        // Chosen now; a sync asked later waits for the next root.
        let ticket = publisher.request_sync();
        let Step::Publish(_, generation, covers_sync) =
            publisher.step(&segments, &uploads, start + INTERVAL, false, 2)
        else {
            panic!("the chosen root is published");
        };
        assert_eq!((generation, covers_sync), (5, 0));
        let entries = HashMap::from([((0, 4, ME), 8192)]);
        publisher.published(Some(5), covers_sync, entries, &uploads, start + INTERVAL);
        assert!(!publisher.synced(ticket));
        // Nothing new since: the published root covers the sync.
        assert!(matches!(
            publisher.step(&segments, &uploads, start + INTERVAL, false, 3),
            Step::Idle { answered: true }
        ));
        assert!(publisher.synced(ticket));
    }

    #[test]
    fn a_root_whose_incarnation_was_reused_is_given_up() {
        let mut segments = segments();
        let uploads = Uploads::new(HashMap::new());
        let mut publisher = publisher(Duration::ZERO);
        publisher.step(&segments, &uploads, Duration::ZERO, false, 1);
        assert_eq!(segments.free(0), super::super::segments::Freed::Drop);
        assert!(matches!(
            publisher.step(&segments, &uploads, Duration::ZERO, false, 1),
            Step::Wait
        ));
        assert_eq!(publisher.needs().len(), 0, "the target is gone");
    }

    #[test]
    fn progress_is_measured_on_the_clock_handed_in() {
        let mut publisher = publisher(Duration::from_secs(5));
        assert_eq!(
            publisher.since_progress(Duration::from_secs(7)),
            Duration::from_secs(2)
        );
        publisher.progressed(Duration::from_secs(7));
        assert_eq!(
            publisher.since_progress(Duration::from_secs(7)),
            Duration::ZERO
        );
    }
}
