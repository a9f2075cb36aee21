//! What the tier's threads share: the local cache, the store, the state
//! behind the state lock (one owner per concern, see `mod.rs`), the fetch
//! cache behind the fetch lock, and the counters. Opening a tier builds it.

use std::collections::HashSet;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use object_store::ObjectStore;
use zdisk_core::held::{assert_none_held, Held};
use zdisk_core::media::{LockChecked, Media, MediaGeometry};
use zdisk_core::units::SegmentId;

use super::bucket::{get_root, list, Listing};
use super::collector::{CollectPlan, Collector};
use super::config::TierConfig;
use super::evictor::Evictor;
use super::fetch_cache::FetchCache;
use super::publisher::{LocalRoot, Publisher};
use super::record::Record;
use super::segments::{LocalSeg, Seg, SegmentTable};
use super::stats::Counters;
use super::uploads::Uploads;
use crate::error::{Result, TierError};
use crate::location::Location;
use crate::objects::{self, Incarnation, SegmentEntry};
use crate::reach::Contact;
use crate::sidecar::Sidecar;

/// The state behind the state lock ("tier"): each owner's fields are its
/// own; what spans owners is here.
pub(super) struct TierState {
    pub segments: SegmentTable,
    pub record: Record,
    pub uploads: Uploads,
    pub publisher: Publisher,
    pub evictor: Evictor,
    pub collector: Collector,
    /// Why the uploader stopped, if it did: then the tier publishes no more.
    failed: Option<String>,
    closing: bool,
}

impl TierState {
    /// Bytes written locally and not yet in the bucket.
    pub(super) fn lag_bytes(&self) -> u64 {
        self.uploads.lag_bytes(&self.segments)
    }

    pub(super) fn failed(&self) -> Option<&String> {
        self.failed.as_ref()
    }

    /// The tier stops publishing for `why`, unless it already has.
    pub(super) fn fail(&mut self, why: String) {
        self.failed.get_or_insert(why);
    }

    /// Another writer took the volume: that is why the tier stops.
    pub(super) fn refuse(&mut self, why: String) {
        self.failed = Some(why);
    }

    pub(super) fn closing(&self) -> bool {
        self.closing
    }

    pub(super) fn close(&mut self) {
        self.closing = true;
    }

    /// What a collection of the bucket would delete at `now`: nothing
    /// the cache, the stash or the root being published (of `writer`) names.
    pub(super) fn collect_plan(&self, now: Duration, writer: u64) -> Option<CollectPlan> {
        let mut in_use: HashSet<Incarnation> = self
            .segments
            .entries()
            .iter()
            .map(SegmentEntry::incarnation)
            .collect();
        in_use.extend(self.uploads.stashed(writer));
        in_use.extend(self.publisher.target_incarnations());
        self.collector.plan(now, &in_use, self.uploads.in_bucket())
    }

    /// Debug builds: a segment that is evicted and not claimed has its
    /// incarnation's eviction record (so a reopened image reads it from
    /// the bucket, never from the bytes dropped).
    pub(super) fn check(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        for (segment, seg) in self.segments.iter() {
            if let Seg::Evicted { seq32, writer, len } = *seg {
                let record = (segment, seq32, writer, len);
                assert!(
                    self.segments.is_busy(segment)
                        || self.record.sidecar().evicted.contains(&record),
                    "evicted segment {segment} is recorded"
                );
            }
        }
    }
}

pub(super) struct Shared {
    pub inner: Arc<dyn Media>,
    pub store: Arc<dyn ObjectStore>,
    pub location: Location,
    runtime: tokio::runtime::Runtime,
    pub config: TierConfig,
    pub sidecar_path: PathBuf,
    /// Held while the state file is written, so writes land in the order
    /// their snapshots were taken. Taken before `state`, never by a read.
    sidecar_file: Mutex<()>,
    pub writer_id: [u8; 16],
    /// `writer_id` as object names carry it.
    pub writer: u64,
    pub geometry: MediaGeometry,
    state: Mutex<TierState>,
    /// Signalled when the uploader has work, or finished some.
    pub changed: Condvar,
    pub counters: Counters,
    fetched: Mutex<FetchCache>,
    /// Signalled when a fetch of a granule ends.
    pub fetch_done: Condvar,
}

/// One of the tier's mutexes held, and marked held for the debug check
/// that no I/O runs under it (`zdisk_core::held`).
pub(super) struct Locked<'a, T> {
    guard: MutexGuard<'a, T>,
    _held: Held,
}

impl<'a, T> Locked<'a, T> {
    fn take(mutex: &'a Mutex<T>, name: &'static str) -> Locked<'a, T> {
        let guard = mutex.lock().expect(name);
        Locked {
            guard,
            _held: Held::mark(name),
        }
    }

    /// Waits on `changed`, which releases the lock meanwhile (the mark
    /// stays: the thread does nothing else while it waits).
    pub(super) fn wait(self, changed: &Condvar) -> Locked<'a, T> {
        let Locked { guard, _held } = self;
        let guard = changed.wait(guard).expect("tier lock");
        Locked { guard, _held }
    }

    /// As `wait`, for at most `timeout` of real time.
    pub(super) fn wait_timeout(self, changed: &Condvar, timeout: Duration) -> Locked<'a, T> {
        let Locked { guard, _held } = self;
        let (guard, _) = changed.wait_timeout(guard, timeout).expect("tier lock");
        Locked { guard, _held }
    }
}

impl<T> Deref for Locked<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for Locked<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl Shared {
    /// Opens the tier of an image: `inner` is its local cache, `sidecar_path`
    /// its `.tier` file. Lists the bucket, checks that no other writer has
    /// published since this image did, and finds what the cache holds.
    pub(super) fn open(
        inner: Arc<dyn Media>,
        sidecar_path: PathBuf,
        config: TierConfig,
    ) -> Result<Shared> {
        // Debug builds check that the tier never touches its cache while
        // holding a lock a read takes.
        let inner = LockChecked::wrap(inner);
        let mut sidecar = Sidecar::load(&sidecar_path)?;
        let writer_id = sidecar.writer_id()?;
        let location = Location::parse(&sidecar.url)?;
        let store = location.open_store(config.retry_timeout)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("zdisk-tier-io")
            .enable_all()
            .build()
            .map_err(|e| TierError::Local(format!("cannot start the tier's I/O threads: {e}")))?;
        location.reach(
            &runtime,
            Contact::Open {
                wait: config.wait_for_bucket,
            },
        )?;
        let listing = runtime.block_on(list(&store, &location))?;
        if let Some(&newest) = listing.roots.last() {
            if newest > sidecar.bucket_root {
                let root = runtime.block_on(get_root(&store, &location, newest))?;
                if root.writer_id != writer_id && !config.read_only {
                    return Err(TierError::OtherWriter(format!(
                        "{}: root object {newest} was published by another writer after this \
                         image's {}; this image may no longer write the volume (make a new one \
                         with `zdisk create IMAGE --from {}`)",
                        location.url, sidecar.bucket_root, location.url
                    )));
                }
                if root.writer_id == writer_id {
                    // Published by this image just before it stopped.
                    sidecar.bucket_root = newest;
                }
            }
        } else if sidecar.bucket_root > 0 {
            return Err(TierError::BadObject(format!(
                "{} holds no root object, but this image published root {}: wrong bucket or prefix?",
                location.url, sidecar.bucket_root
            )));
        }
        let writer = objects::short_writer(&writer_id);
        let geometry = inner.geometry();
        let segs = found_segments(inner.as_ref(), &sidecar, &listing, writer)?;
        let now = config.clock.monotonic();
        let state = TierState {
            segments: SegmentTable::new(segs),
            uploads: Uploads::new(listing.segments),
            publisher: Publisher::new(
                writer_id,
                config.publish_interval,
                newest_local_root(inner.as_ref()),
                now,
            ),
            evictor: Evictor::default(),
            collector: Collector::new(&listing.roots, config.keep_roots_for, now),
            record: Record::new(sidecar),
            failed: None,
            closing: false,
        };
        state.check();
        Ok(Shared {
            inner,
            store,
            location,
            runtime,
            sidecar_path,
            sidecar_file: Mutex::new(()),
            writer_id,
            writer,
            geometry,
            state: Mutex::new(state),
            changed: Condvar::new(),
            counters: Counters::default(),
            fetched: Mutex::new(FetchCache::new(config.fetch_cache_bytes)),
            fetch_done: Condvar::new(),
            config,
        })
    }

    pub(super) fn lock(&self) -> Locked<'_, TierState> {
        Locked::take(&self.state, "tier")
    }

    pub(super) fn lock_fetched(&self) -> Locked<'_, FetchCache> {
        Locked::take(&self.fetched, "tier fetch")
    }

    /// The tier's clock now (a `monotonic` reading).
    pub(super) fn now(&self) -> Duration {
        self.config.clock.monotonic()
    }

    /// Runs an object-store call to completion; never under a tier lock.
    #[track_caller]
    pub(super) fn block_on<F: Future>(&self, what: &str, call: F) -> F::Output {
        assert_none_held(what);
        self.runtime.block_on(call)
    }

    /// Writes the state file as the record holds it now. The snapshot is
    /// taken under the state lock and written after it is released; the
    /// file's own lock makes the last snapshot taken the last written.
    pub(super) fn store_sidecar(&self) -> Result<()> {
        let _file = self.sidecar_file.lock().expect("tier state file lock");
        let sidecar = self.lock().record.snapshot();
        let stored = sidecar.store(&self.sidecar_path);
        if stored.is_err() {
            self.lock().record.mark_dirty();
        }
        stored
    }
}

/// What the cache holds at open: segments the state file records evicted,
/// and segments an earlier run wrote (found by their first record).
fn found_segments(
    inner: &dyn Media,
    sidecar: &Sidecar,
    listing: &Listing,
    writer: u64,
) -> Result<Vec<Seg>> {
    let geometry = inner.geometry();
    let segment_size = geometry.segment_size_bytes;
    let mut segs = vec![Seg::Empty; geometry.segment_count as usize];
    for &(segment, seq32, writer, len) in &sidecar.evicted {
        if let Some(seg) = segs.get_mut(segment as usize) {
            *seg = Seg::Evicted { seq32, writer, len };
        }
    }
    for (index, seg) in segs.iter_mut().enumerate() {
        if matches!(seg, Seg::Evicted { .. }) {
            continue;
        }
        let mut header = [0u8; 8];
        inner
            .read(SegmentId(index as u32), 0, &mut header)
            .map_err(|e| TierError::Local(format!("reading the cache: {e}")))?;
        let Some(seq32) = first_record_seq(&header) else {
            continue;
        };
        // Written by an earlier run: sealed (recovery seals every
        // segment); how much of it is written is not known here.
        let foreign = sidecar
            .written_back
            .iter()
            .find(|entry| entry.0 == index as u32 && entry.1 == seq32)
            .map(|entry| entry.2);
        // A segment written back from another writer's object holds
        // exactly that object (it is never uploaded again, so its
        // length must be the object's).
        let (writer, written) = match foreign
            .and_then(|w| Some((w, *listing.segments.get(&(index as u32, seq32, w))?)))
        {
            Some((foreign, len)) => (foreign, len),
            None => (writer, segment_size),
        };
        *seg = Seg::Local(LocalSeg::found(seq32, writer, written, segment_size));
    }
    Ok(segs)
}

/// The newest root durable in the local medium's metadata slots: what the
/// tier publishes first after an open.
fn newest_local_root(inner: &dyn Media) -> Option<LocalRoot> {
    (0..2)
        .filter_map(|slot| inner.read_meta_slot(slot).ok())
        .filter_map(|bytes| zdisk_core::meta::Root::decode(&bytes).ok())
        .max_by_key(|root| root.generation)
        .map(|root| (root.generation, root.checkpoint.clean, root.encode()))
}

/// The sequence number a segment's first record names, if it starts with one.
pub(super) fn first_record_seq(header: &[u8]) -> Option<u32> {
    if header.len() >= 8 && header[0] == b'Z' && header[1] == b'R' && header[2] != 0 {
        Some(u32::from_le_bytes(
            header[4..8].try_into().expect("4 bytes"),
        ))
    } else {
        None
    }
}
