//! `TieredMedia`: a [`Media`] that keeps a volume's segments in an object
//! store, with a local medium (a sparse image file) as the cache.
//!
//! The engine writes and reads the local medium as always. Beside it:
//! - a segment incarnation the engine sealed (`SegmentEvents::segment_sealed`) is
//!   uploaded whole, as one object, by a background thread;
//! - once the engine has made a root durable locally (a metadata-slot write
//!   followed by a sync), the thread publishes it, at most once per
//!   `publish_interval` and always at a clean close, and publishes the
//!   same root again each interval while more of the log it replays has
//!   been written (so the bucket lags by about an interval and the upload
//!   time, whether or not the engine writes roots): it uploads every
//!   segment incarnation the cache holds up to what is written (so the
//!   root's dump, the open segments and the log it would replay are all
//!   there), then writes the root object, which lists each incarnation and
//!   its length, with a conditional PUT. A root object is only written
//!   once everything it names is in the bucket, and segment objects are
//!   never deleted or shortened, so every root object in the bucket can
//!   be served whole;
//! - while the cache holds more than `cache_bytes`, the least recently used
//!   sealed segments that are entirely in the bucket are *evicted*: the
//!   eviction is recorded durably in the image's `.tier` file, then their
//!   local bytes are dropped (a hole is punched). Reads of an evicted
//!   segment are served by ranged GETs, through a bounded RAM cache of
//!   1 MiB granules.
//!
//! A segment the engine prepares for reuse is local again (its eviction
//! record is removed durably first); bytes of its old incarnation not yet
//! in the bucket are copied to RAM and uploaded from there, so a root
//! being published never loses them.
//!
//! Invariants: a segment is read from the bucket exactly when it is
//! `Evicted`; an `Evicted` segment's object holds at least the bytes its
//! incarnation was sealed with; one thread at a time reads, writes or
//! drops a segment's local bytes (`busy`), and none drops them while they
//! are being read (`readers`).
//!
//! Locks (issue #23: reads never wait behind I/O). A host read takes the
//! state lock (`state`, marked "tier") and, for an evicted segment, the
//! fetch lock (`fetched`, marked "tier fetch"); neither is ever held
//! during I/O: no object-store call, no read, write, erase or sync of the
//! local cache, no write of the `.tier` file and no sleep happens under
//! them (debug builds panic otherwise: every such call is preceded by
//! `assert_none_held`, and the local cache is wrapped in `LockChecked`).
//! Work on a segment's local bytes is claimed under the state lock
//! (`busy`), done without it, and its outcome applied under it again
//! after re-checking the segment's incarnation. Order: the state file's
//! own lock (`sidecar_file`, held while it is written, never taken by a
//! read) before the state lock; the state and fetch locks are never held
//! together; waits (for room in the cache, for a fetch, for a root to be
//! published) are condition-variable waits that release their lock.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};
use zdisk_core::held::{assert_none_held, Held};
use zdisk_core::media::{Admission, LockChecked, Media, MediaGeometry, MediaStat, SegmentEvents};
use zdisk_core::units::{PageIndex, SegmentId};

use crate::cause::StoreCause;
use crate::error::{Result, TierError};
use crate::location::Location;
use crate::objects::{self, Incarnation, RootObject, SegmentEntry};
use crate::reach::Contact;
use crate::sidecar::Sidecar;

/// Bytes of an evicted segment fetched at a time.
const GRANULE_BYTES: u64 = 1 << 20;
/// Reads of an evicted segment after which it is written back into the cache.
const WRITE_BACK_READS: u32 = 2;
/// Most bytes of reused segments' old incarnations held in RAM for upload.
const STASH_MAX_BYTES: u64 = 256 << 20;

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
        }
    }
}

#[derive(Debug, Clone)]
enum Seg {
    /// Nothing the tier keeps: never written, or erased.
    Empty,
    Local(LocalSeg),
    /// Only in the bucket: `len` bytes of incarnation `seq32`.
    Evicted {
        seq32: u32,
        /// The writer whose object holds it (`objects::short_writer`).
        writer: u64,
        len: u64,
    },
}

#[derive(Debug, Clone)]
struct LocalSeg {
    /// Low 32 bits of the incarnation's sequence number, from its first record.
    seq32: Option<u32>,
    /// The writer whose object holds the incarnation: this image, or for a
    /// segment written back from the bucket, the writer of that object.
    writer: u64,
    /// Bytes written from offset 0.
    written: u64,
    /// Where the engine sealed it (whole segment for one found at open).
    sealed: Option<u64>,
    /// Bytes the local file holds for the segment, this incarnation or older.
    footprint: u64,
    /// Reads under way.
    readers: u32,
    last_use: u64,
}

/// A root being published: what it needs uploaded first.
struct Target {
    generation: u64,
    clean: bool,
    /// The `--tier-sync` request it answers once published.
    covers_sync: u64,
    engine_root: Vec<u8>,
    entries: Vec<SegmentEntry>,
}

struct TierState {
    segs: Vec<Seg>,
    /// Segments whose local bytes a thread reads, writes or drops without
    /// the lock (an upload, an eviction, a write-back, a renewal, a freed
    /// segment's erase): nobody else starts on them until it is done.
    busy: HashSet<u32>,
    /// Bytes in the bucket per incarnation (segment, seq32).
    in_bucket: HashMap<Incarnation, u64>,
    /// Old incarnations of reused segments waiting for upload.
    stash: VecDeque<(u32, u32, Bytes)>,
    stash_bytes: u64,
    /// The newest root written to a slot and not yet synced.
    pending_root: Option<Vec<u8>>,
    /// The newest root durable locally: (generation, clean, bytes).
    latest_root: Option<(u64, bool, Vec<u8>)>,
    published_generation: Option<u64>,
    /// What the newest root this run published lists: incarnation → bytes.
    published_entries: HashMap<Incarnation, u64>,
    last_publish: Instant,
    target: Option<Target>,
    /// `--tier-sync`: requests made, and the newest one a published root covers.
    sync_requests: u64,
    sync_published: u64,
    /// When an upload or publication last succeeded.
    last_progress: Instant,
    /// Root objects in the bucket, by number.
    roots: BTreeMap<u64, KeptRoot>,
    last_collect: Instant,
    collected_at_close: bool,
    /// The state file lags `sidecar` by entries nothing depends on.
    sidecar_dirty: bool,
    /// Reads per evicted segment since it was evicted.
    remote_reads: HashMap<u32, u32>,
    /// Evicted segments to write back into the local cache.
    write_back: VecDeque<u32>,
    sidecar: Sidecar,
    failed: Option<String>,
    closing: bool,
    tick: u64,
}

/// What a collection of the bucket's garbage would delete.
#[derive(Default)]
struct CollectPlan {
    /// Root objects past their keeping time.
    roots: Vec<u64>,
    /// Kept roots whose names are not known yet.
    unknown: Vec<u64>,
    /// Segment objects nothing needs, with their sizes.
    segments: Vec<(Incarnation, u64)>,
}

/// A root object the bucket holds.
struct KeptRoot {
    /// When a newer root was published (or found at open).
    superseded: Option<Instant>,
    /// The incarnations it names, once known.
    names: Option<HashSet<Incarnation>>,
}

struct Counters {
    /// Time new segments waited for room in the cache.
    held_micros: AtomicU64,
    deleted_bytes: AtomicU64,
    deleted_roots: AtomicU64,
    written_back_bytes: AtomicU64,
    uploaded_bytes: AtomicU64,
    fetched_bytes: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    evicted_bytes: AtomicU64,
    roots_published: AtomicU64,
}

struct FetchCache {
    /// (incarnation, granule) → bytes and last use.
    granules: HashMap<(Incarnation, u64), (Bytes, u64)>,
    /// Granules being fetched: a read that wants one waits for that fetch
    /// (`Shared::fetch_done`) instead of fetching it again.
    in_flight: HashSet<(Incarnation, u64)>,
    bytes: u64,
    tick: u64,
}

struct Shared {
    inner: Arc<dyn Media>,
    store: Arc<dyn ObjectStore>,
    location: Location,
    runtime: tokio::runtime::Runtime,
    config: TierConfig,
    sidecar_path: PathBuf,
    /// Held while the state file is written, so writes land in the order
    /// their snapshots were taken. Taken before `state`, never by a read.
    sidecar_file: Mutex<()>,
    writer_id: [u8; 16],
    /// `writer_id` as object names carry it.
    writer: u64,
    geometry: MediaGeometry,
    state: Mutex<TierState>,
    /// Signalled when the uploader has work, or finished some.
    changed: Condvar,
    counters: Counters,
    fetched: Mutex<FetchCache>,
    /// Signalled when a fetch of a granule ends.
    fetch_done: Condvar,
}

/// One of the tier's mutexes held, and marked held for the debug check
/// that no I/O runs under it (`zdisk_core::held`).
struct Locked<'a, T> {
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
    fn wait(self, changed: &Condvar) -> Locked<'a, T> {
        let Locked { guard, _held } = self;
        let guard = changed.wait(guard).expect("tier lock");
        Locked { guard, _held }
    }

    fn wait_timeout(self, changed: &Condvar, timeout: Duration) -> Locked<'a, T> {
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

/// A medium whose sealed segments live in an object store.
pub struct TieredMedia {
    shared: Arc<Shared>,
    uploader: Mutex<Option<JoinHandle<()>>>,
}

impl TieredMedia {
    /// Opens the tier of an image: `inner` is its local cache, `sidecar_path`
    /// its `.tier` file. Lists the bucket, checks that no other writer has
    /// published since this image did, and starts the uploader.
    pub fn open(
        inner: Arc<dyn Media>,
        sidecar_path: PathBuf,
        config: TierConfig,
    ) -> Result<Arc<TieredMedia>> {
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
        let newest = listing.roots.last().copied();
        match newest {
            Some(number) if number > sidecar.bucket_root => {
                let root = runtime.block_on(get_root(&store, &location, number))?;
                if root.writer_id != writer_id && !config.read_only {
                    return Err(TierError::OtherWriter(format!(
                        "{}: root object {number} was published by another writer after this \
                         image's {}; this image may no longer write the volume (make a new one \
                         with `zdisk create IMAGE --from {}`)",
                        location.url, sidecar.bucket_root, location.url
                    )));
                }
                if root.writer_id == writer_id {
                    // Published by this image just before it stopped.
                    sidecar.bucket_root = number;
                }
            }
            Some(_) => {}
            None if sidecar.bucket_root > 0 => {
                return Err(TierError::BadObject(format!(
                    "{} holds no root object, but this image published root {}: wrong bucket or prefix?",
                    location.url, sidecar.bucket_root
                )));
            }
            None => {}
        }
        let writer = objects::short_writer(&writer_id);
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
            if let Some(seq32) = first_record_seq(&header) {
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
                *seg = Seg::Local(LocalSeg {
                    seq32: Some(seq32),
                    writer,
                    written,
                    sealed: Some(written),
                    footprint: segment_size,
                    readers: 0,
                    last_use: 0,
                });
            }
        }
        let now = Instant::now();
        let newest_root = listing.roots.last().copied();
        let roots = listing
            .roots
            .iter()
            .map(|&number| {
                let root = KeptRoot {
                    // Found, not seen superseded: kept a whole period from now.
                    superseded: (Some(number) != newest_root).then_some(now),
                    names: None,
                };
                (number, root)
            })
            .collect();
        let state = TierState {
            segs,
            busy: HashSet::new(),
            in_bucket: listing.segments,
            stash: VecDeque::new(),
            stash_bytes: 0,
            pending_root: None,
            latest_root: newest_local_root(inner.as_ref()),
            published_generation: None,
            published_entries: HashMap::new(),
            last_publish: now,
            target: None,
            sync_requests: 0,
            sync_published: 0,
            last_progress: now,
            roots,
            last_collect: now,
            collected_at_close: false,
            sidecar_dirty: false,
            remote_reads: HashMap::new(),
            write_back: VecDeque::new(),
            sidecar,
            failed: None,
            closing: false,
            tick: 1,
        };
        let shared = Arc::new(Shared {
            inner,
            store,
            location,
            runtime,
            config,
            sidecar_path,
            sidecar_file: Mutex::new(()),
            writer_id,
            writer,
            geometry,
            state: Mutex::new(state),
            changed: Condvar::new(),
            counters: Counters {
                held_micros: AtomicU64::new(0),
                deleted_bytes: AtomicU64::new(0),
                deleted_roots: AtomicU64::new(0),
                written_back_bytes: AtomicU64::new(0),
                uploaded_bytes: AtomicU64::new(0),
                fetched_bytes: AtomicU64::new(0),
                cache_hits: AtomicU64::new(0),
                cache_misses: AtomicU64::new(0),
                evicted_bytes: AtomicU64::new(0),
                roots_published: AtomicU64::new(0),
            },
            fetch_done: Condvar::new(),
            fetched: Mutex::new(FetchCache {
                in_flight: HashSet::new(),
                granules: HashMap::new(),
                bytes: 0,
                tick: 0,
            }),
        });
        let uploader = if shared.config.read_only {
            None
        } else {
            let worker = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("zdisk-tier-upload".into())
                    .spawn(move || worker.upload_loop())
                    .map_err(|e| TierError::Local(format!("cannot start the uploader: {e}")))?,
            )
        };
        Ok(Arc::new(TieredMedia {
            shared,
            uploader: Mutex::new(uploader),
        }))
    }

    /// Bytes written locally and not yet in the bucket.
    pub fn lag_bytes(&self) -> u64 {
        self.shared.lag_bytes(&self.shared.lock())
    }

    /// The newest root object this image published or started from.
    pub fn bucket_root(&self) -> u64 {
        self.shared.lock().sidecar.bucket_root
    }

    /// Bytes of segments the local cache holds.
    pub fn resident_bytes(&self) -> u64 {
        resident(&self.shared.lock())
    }
}

/// The newest root durable in the local medium's metadata slots, as
/// (generation, clean, bytes): what the tier publishes first after an open.
fn newest_local_root(inner: &dyn Media) -> Option<(u64, bool, Vec<u8>)> {
    (0..2)
        .filter_map(|slot| inner.read_meta_slot(slot).ok())
        .filter_map(|bytes| zdisk_core::meta::Root::decode(&bytes).ok())
        .max_by_key(|root| root.generation)
        .map(|root| (root.generation, root.checkpoint.clean, root.encode()))
}

/// The sequence number a segment's first record names, if it starts with one.
fn first_record_seq(header: &[u8]) -> Option<u32> {
    if header.len() >= 8 && header[0] == b'Z' && header[1] == b'R' && header[2] != 0 {
        Some(u32::from_le_bytes(
            header[4..8].try_into().expect("4 bytes"),
        ))
    } else {
        None
    }
}

fn resident(state: &TierState) -> u64 {
    state
        .segs
        .iter()
        .map(|seg| match seg {
            Seg::Local(local) => local.footprint,
            _ => 0,
        })
        .sum()
}

/// What a listing of the volume's prefix found.
pub(crate) struct Listing {
    pub segments: HashMap<Incarnation, u64>,
    /// Root object numbers, ascending.
    pub roots: Vec<u64>,
}

pub(crate) async fn list(store: &Arc<dyn ObjectStore>, location: &Location) -> Result<Listing> {
    let prefix = ObjectPath::from(location.prefix.trim_end_matches('/'));
    let prefix = (!location.prefix.is_empty()).then_some(&prefix);
    let objects: Vec<_> = store
        .list(prefix)
        .try_collect()
        .await
        .map_err(|e| store_error(location, "listing", e))?;
    let mut listing = Listing {
        segments: HashMap::new(),
        roots: Vec::new(),
    };
    for object in objects {
        let name = object.location.as_ref();
        let Some(name) = name.strip_prefix(location.prefix.as_str()) else {
            continue;
        };
        if let Some(key) = objects::parse_segment_name(name) {
            listing.segments.insert(key, object.size);
        } else if let Some(number) = objects::parse_root_name(name) {
            listing.roots.push(number);
        }
    }
    listing.roots.sort_unstable();
    Ok(listing)
}

pub(crate) async fn get_root(
    store: &Arc<dyn ObjectStore>,
    location: &Location,
    number: u64,
) -> Result<RootObject> {
    let key = ObjectPath::from(objects::root_key(&location.prefix, number));
    let bytes = store
        .get(&key)
        .await
        .map_err(|e| match e {
            object_store::Error::NotFound { .. } => {
                TierError::Missing(format!("{}: {key} is gone", location.url))
            }
            e => store_error(location, "reading a root object", e),
        })?
        .bytes()
        .await
        .map_err(|e| store_error(location, "reading a root object", e))?;
    let root = RootObject::decode(&bytes)
        .map_err(|e| TierError::BadObject(format!("{}: {key}: {e}", location.url)))?;
    if root.number != number {
        return Err(TierError::BadObject(format!(
            "{}: {key} says it is root {}",
            location.url, root.number
        )));
    }
    Ok(root)
}

pub(crate) fn store_error(
    location: &Location,
    what: &str,
    error: object_store::Error,
) -> TierError {
    TierError::Bucket {
        url: location.url.clone(),
        doing: what.to_string(),
        cause: Box::new(StoreCause::of(&error, &location.target())),
        note: String::new(),
    }
}

/// Work the uploader found under the lock.
enum Job {
    /// The state file lags the state.
    StoreSidecar,
    /// The cache is over its bound: drop this segment's local bytes.
    Evict(Eviction),
    Upload {
        segment: u32,
        seq32: u32,
        len: u64,
    },
    UploadStash,
    Publish(RootObject, u64, u64),
    Collect,
    WriteBack(u32),
    Done,
}

/// A segment chosen for eviction: its incarnation, bytes in the bucket and
/// local footprint.
struct Eviction {
    segment: u32,
    seq32: u32,
    writer: u64,
    there: u64,
    footprint: u64,
}

impl Shared {
    fn lock(&self) -> Locked<'_, TierState> {
        Locked::take(&self.state, "tier")
    }

    fn lock_fetched(&self) -> Locked<'_, FetchCache> {
        Locked::take(&self.fetched, "tier fetch")
    }

    /// Runs an object-store call to completion; never under a tier lock.
    #[track_caller]
    fn block_on<F: Future>(&self, what: &str, call: F) -> F::Output {
        assert_none_held(what);
        self.runtime.block_on(call)
    }

    /// Writes the state file as the state holds it now. The snapshot is
    /// taken under the state lock and written after it is released; the
    /// file's own lock makes the last snapshot taken the last written.
    fn store_sidecar(&self) -> Result<()> {
        let _file = self.sidecar_file.lock().expect("tier state file lock");
        let sidecar = {
            let mut state = self.lock();
            state.sidecar_dirty = false;
            state.sidecar.clone()
        };
        let stored = sidecar.store(&self.sidecar_path);
        if stored.is_err() {
            self.lock().sidecar_dirty = true;
        }
        stored
    }

    /// Bytes of the incarnation `key` the bucket holds.
    fn there(state: &TierState, key: &Incarnation) -> u64 {
        state.in_bucket.get(key).copied().unwrap_or(0)
    }

    fn lag_bytes(&self, state: &TierState) -> u64 {
        let mut lag = state.stash_bytes;
        for (index, seg) in state.segs.iter().enumerate() {
            if let Seg::Local(LocalSeg {
                seq32: Some(seq32),
                writer,
                written,
                ..
            }) = seg
            {
                let there = Self::there(state, &(index as u32, *seq32, *writer));
                lag += written.saturating_sub(there);
            }
        }
        lag
    }

    /// The segment entries a root made now would list.
    fn current_entries(state: &TierState) -> Vec<SegmentEntry> {
        let mut entries = Vec::new();
        for (index, seg) in state.segs.iter().enumerate() {
            match seg {
                Seg::Local(LocalSeg {
                    seq32: Some(seq32),
                    writer,
                    written,
                    ..
                }) if *written > 0 => entries.push(SegmentEntry {
                    segment: index as u32,
                    seq32: *seq32,
                    writer: *writer,
                    len_bytes: *written,
                }),
                Seg::Evicted { seq32, writer, len } => entries.push(SegmentEntry {
                    segment: index as u32,
                    seq32: *seq32,
                    writer: *writer,
                    len_bytes: *len,
                }),
                _ => {}
            }
        }
        entries
    }

    /// True if a root made now would list bytes the newest published one
    /// does not.
    fn uncovered(state: &TierState) -> bool {
        state.segs.iter().enumerate().any(|(index, seg)| {
            let (key, len) = match seg {
                Seg::Local(LocalSeg {
                    seq32: Some(seq32),
                    writer,
                    written,
                    ..
                }) if *written > 0 => ((index as u32, *seq32, *writer), *written),
                Seg::Evicted { seq32, writer, len } => ((index as u32, *seq32, *writer), *len),
                _ => return false,
            };
            state
                .published_entries
                .get(&key)
                .is_none_or(|&published| published < len)
        })
    }

    fn upload_loop(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(200);
        let mut closing_since: Option<Instant> = None;
        // Cleared when storing the state file or an eviction failed: the
        // next try waits for the next wake-up instead of spinning.
        let mut retry_local = true;
        loop {
            let job = {
                let mut state = self.lock();
                loop {
                    if state.closing && closing_since.is_none() {
                        closing_since = Some(Instant::now());
                    }
                    if let Some(since) = closing_since {
                        // Gives up once nothing has succeeded for four
                        // retry timeouts of the close.
                        let stalled = since.elapsed().min(state.last_progress.elapsed());
                        if stalled > 4 * self.config.retry_timeout && state.failed.is_none() {
                            state.failed = Some(format!(
                                "{}: the bucket was out of reach for {} s at close; {} bytes were not uploaded",
                                self.location.url,
                                stalled.as_secs(),
                                self.lag_bytes(&state)
                            ));
                        }
                    }
                    if retry_local && state.sidecar_dirty {
                        break Job::StoreSidecar;
                    }
                    if retry_local {
                        if let Some(eviction) = self.eviction_candidate(&mut state) {
                            break Job::Evict(eviction);
                        }
                    }
                    if let Some(job) = self.next_job(&mut state) {
                        break job;
                    }
                    state = state.wait_timeout(&self.changed, Duration::from_millis(250));
                    retry_local = true;
                }
            };
            let outcome = match job {
                Job::Done => return,
                Job::StoreSidecar => {
                    if let Err(error) = self.store_sidecar() {
                        log::warn!("tier: {error}");
                        retry_local = false;
                    }
                    continue;
                }
                Job::Evict(eviction) => {
                    if let Err(error) = self.evict(eviction) {
                        log::warn!("tier: cannot evict: {error}");
                        retry_local = false;
                    }
                    self.changed.notify_all();
                    continue;
                }
                Job::Upload {
                    segment,
                    seq32,
                    len,
                } => self.upload_segment(segment, seq32, len),
                Job::UploadStash => self.upload_stash(),
                Job::Publish(root, generation, covers_sync) => {
                    self.publish(root, generation, covers_sync)
                }
                Job::Collect => self.collect(),
                Job::WriteBack(segment) => self.write_back(segment),
            };
            match outcome {
                Ok(()) => {
                    backoff = Duration::from_millis(200);
                    self.lock().last_progress = Instant::now();
                }
                Err(error) => {
                    log::warn!("tier: {error}; retrying in {} ms", backoff.as_millis());
                    assert_none_held("the uploader's backoff");
                    std::thread::sleep(backoff);
                    // Never longer than a retry timeout, so a close notices
                    // the bucket is back well before it would give up.
                    backoff = (backoff * 2)
                        .min(Duration::from_secs(10))
                        .min(self.config.retry_timeout);
                }
            }
            self.changed.notify_all();
        }
    }

    /// The next upload or publication, if any.
    fn next_job(&self, state: &mut TierState) -> Option<Job> {
        if state.failed.is_some() {
            return state.closing.then_some(Job::Done);
        }
        if !state.stash.is_empty() {
            return Some(Job::UploadStash);
        }
        // Sealed segments, and whatever the root being published needs.
        let needs: HashMap<Incarnation, u64> = state
            .target
            .iter()
            .flat_map(|target| target.entries.iter())
            .map(|entry| (entry.incarnation(), entry.len_bytes))
            .collect();
        for (index, seg) in state.segs.iter().enumerate() {
            let Seg::Local(local) = seg else { continue };
            let Some(seq32) = local.seq32 else { continue };
            if state.busy.contains(&(index as u32)) || local.writer != self.writer {
                continue;
            }
            let key = (index as u32, seq32, self.writer);
            let there = Self::there(state, &key);
            let sealed_need = local
                .sealed
                .filter(|&fill| local.written >= fill)
                .unwrap_or(0);
            let need = sealed_need.max(needs.get(&key).copied().unwrap_or(0));
            if there < need {
                return Some(Job::Upload {
                    segment: index as u32,
                    seq32,
                    len: local.written,
                });
            }
        }
        if let Some(target) = &state.target {
            let missing = target
                .entries
                .iter()
                .find(|entry| Self::there(state, &entry.incarnation()) < entry.len_bytes);
            if let Some(entry) = missing {
                // The incarnation was reused before its bytes were uploaded
                // and is gone: publish a newer root instead.
                let current = match &state.segs[entry.segment as usize] {
                    Seg::Local(local) => {
                        local.seq32 == Some(entry.seq32) && entry.writer == local.writer
                    }
                    _ => false,
                };
                if !current {
                    log::warn!(
                        "tier: segment {} changed before root {} could be published; a newer root will be",
                        entry.segment,
                        target.generation
                    );
                    state.target = None;
                }
                return None;
            }
            let root = RootObject {
                number: state.sidecar.bucket_root + 1,
                writer_id: self.writer_id,
                clean: target.clean,
                segments: target.entries.clone(),
                engine_root: target.engine_root.clone(),
            };
            return Some(Job::Publish(root, target.generation, target.covers_sync));
        }
        let sync_wanted = state.sync_requests > state.sync_published;
        if let Some((generation, clean, engine_root)) = &state.latest_root {
            // A newer root, or the same (not clean) root with more of the
            // log it replays: what a crash at this moment would leave.
            let newer = state.published_generation != Some(*generation);
            let more_log = !*clean && (self.lag_bytes(state) > 0 || Self::uncovered(state));
            if !newer && !more_log && sync_wanted {
                // The published root already covers every sync asked for.
                state.sync_published = state.sync_requests;
                self.changed.notify_all();
            }
            let due = (newer || more_log)
                && (state.closing
                    || sync_wanted
                    || state.published_generation.is_none()
                    || state.last_publish.elapsed() >= self.config.publish_interval);
            if due {
                state.target = Some(Target {
                    generation: *generation,
                    clean: *clean,
                    covers_sync: state.sync_requests,
                    engine_root: engine_root.clone(),
                    entries: Self::current_entries(state),
                });
                // The uploads it needs come first.
                return self.next_job(state);
            }
        }
        if let Some(segment) = state.write_back.pop_front() {
            return Some(Job::WriteBack(segment));
        }
        let collect_every = self.config.publish_interval.max(Duration::from_secs(1));
        if state.published_generation.is_some() && state.last_collect.elapsed() >= collect_every {
            state.last_collect = Instant::now();
            if self.collect_plan(state).is_some() {
                return Some(Job::Collect);
            }
        }
        let settled = state.published_generation.is_some()
            && state.latest_root.as_ref().map(|root| root.0) == state.published_generation;
        if state.closing && settled && !state.collected_at_close {
            // One last collection, for roots the clean stop superseded.
            state.collected_at_close = true;
            if self.collect_plan(state).is_some() {
                return Some(Job::Collect);
            }
        }
        (state.closing && settled).then_some(Job::Done)
    }

    /// What a collection would do now: root objects past their keeping
    /// time (never the newest), kept roots whose names must be read first,
    /// and segment objects nothing needs (only once every kept root's
    /// names are known). None if there is nothing to do.
    fn collect_plan(&self, state: &TierState) -> Option<CollectPlan> {
        let newest = state.roots.keys().next_back().copied();
        let mut plan = CollectPlan::default();
        for (&number, root) in &state.roots {
            let expired = root
                .superseded
                .is_some_and(|since| since.elapsed() >= self.config.keep_roots_for);
            if expired && Some(number) != newest {
                plan.roots.push(number);
            } else if root.names.is_none() {
                plan.unknown.push(number);
            }
        }
        if plan.unknown.is_empty() {
            let mut needed: HashSet<Incarnation> = HashSet::new();
            for (number, root) in &state.roots {
                if !plan.roots.contains(number) {
                    needed.extend(root.names.iter().flatten().copied());
                }
            }
            needed.extend(
                Self::current_entries(state)
                    .iter()
                    .map(SegmentEntry::incarnation),
            );
            needed.extend(
                state
                    .stash
                    .iter()
                    .map(|&(segment, seq32, _)| (segment, seq32, self.writer)),
            );
            needed.extend(
                state
                    .target
                    .iter()
                    .flat_map(|target| target.entries.iter().map(SegmentEntry::incarnation)),
            );
            plan.segments = state
                .in_bucket
                .iter()
                .filter(|(key, _)| !needed.contains(key))
                .map(|(&key, &len)| (key, len))
                .collect();
            plan.segments.sort_unstable();
        }
        let empty = plan.roots.is_empty() && plan.unknown.is_empty() && plan.segments.is_empty();
        (!empty).then_some(plan)
    }

    /// Deletes what the bucket no longer needs: first root objects past
    /// their keeping time, then (only if all of those are gone) segment
    /// objects that no kept root and no current incarnation names. An
    /// interrupted collection leaves only objects the next one deletes.
    fn collect(&self) -> Result<()> {
        let unknown = match self.collect_plan(&self.lock()) {
            Some(plan) => plan.unknown,
            None => return Ok(()),
        };
        for number in unknown {
            let names = match self.block_on(
                "reading an old root object",
                get_root(&self.store, &self.location, number),
            ) {
                Ok(root) => root
                    .segments
                    .iter()
                    .map(SegmentEntry::incarnation)
                    .collect(),
                // Deleted by an earlier collection that stopped before the list said so.
                Err(TierError::Missing(_)) => HashSet::new(),
                Err(error) => return Err(error),
            };
            if let Some(root) = self.lock().roots.get_mut(&number) {
                root.names = Some(names);
            }
        }
        let Some(plan) = self.collect_plan(&self.lock()) else {
            return Ok(());
        };
        for &number in &plan.roots {
            let key = ObjectPath::from(objects::root_key(&self.location.prefix, number));
            self.delete(&key, "deleting an old root object")?;
            self.lock().roots.remove(&number);
            self.counters.deleted_roots.fetch_add(1, Ordering::Relaxed);
        }
        // Names only the deleted roots held are free now.
        let Some(plan) = self.collect_plan(&self.lock()) else {
            return Ok(());
        };
        for (incarnation, len) in plan.segments {
            let key = ObjectPath::from(objects::segment_key(&self.location.prefix, incarnation));
            self.delete(&key, "deleting a segment object no root needs")?;
            self.lock().in_bucket.remove(&incarnation);
            self.counters
                .deleted_bytes
                .fetch_add(len, Ordering::Relaxed);
        }
        Ok(())
    }

    fn delete(&self, key: &ObjectPath, what: &str) -> Result<()> {
        match self.block_on(what, self.store.delete(key)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(error) => Err(store_error(&self.location, what, error)),
        }
    }

    /// If the cache is over its bound, the least recently used segment
    /// that is wholly in the bucket, claimed (`busy`) and its eviction
    /// recorded in the state; [`Shared::evict`] does the rest without the
    /// lock.
    fn eviction_candidate(&self, state: &mut TierState) -> Option<Eviction> {
        if resident(state) <= state.sidecar.cache_bytes {
            return None;
        }
        let (_, eviction) = state
            .segs
            .iter()
            .enumerate()
            .filter_map(|(index, seg)| match seg {
                Seg::Local(local)
                    if !state.busy.contains(&(index as u32)) && local.readers == 0 =>
                {
                    let seq32 = local.seq32?;
                    let fill = local.sealed?;
                    let there = state
                        .in_bucket
                        .get(&(index as u32, seq32, local.writer))
                        .copied()?;
                    (local.written >= fill && there >= fill).then_some((
                        local.last_use,
                        index,
                        seq32,
                        local.writer,
                        there,
                        local.footprint,
                    ))
                }
                _ => None,
            })
            .min()
            .map(|(last_use, index, seq32, writer, there, footprint)| {
                let eviction = Eviction {
                    segment: index as u32,
                    seq32,
                    writer,
                    there,
                    footprint,
                };
                (last_use, eviction)
            })?;
        state.busy.insert(eviction.segment);
        state.sidecar.evicted.push((
            eviction.segment,
            eviction.seq32,
            eviction.writer,
            eviction.there,
        ));
        Some(eviction)
    }

    /// Evicts a segment [`Shared::eviction_candidate`] chose: records the
    /// eviction durably, then (once no read of its local bytes is under
    /// way, and if it still holds the same incarnation) serves it from
    /// the bucket, and only then drops its local bytes. An error leaves it
    /// local.
    fn evict(&self, eviction: Eviction) -> Result<()> {
        let Eviction {
            segment,
            seq32,
            writer,
            there,
            footprint,
        } = eviction;
        let stored = self.store_sidecar();
        let mut state = self.lock();
        // Reads under way finish on the local bytes.
        while matches!(&state.segs[segment as usize], Seg::Local(local) if local.readers > 0) {
            state = state.wait(&self.changed);
        }
        let current = matches!(&state.segs[segment as usize],
            Seg::Local(local) if local.seq32 == Some(seq32) && local.writer == writer);
        if stored.is_err() || !current {
            // Freed meanwhile (its bytes stay until it is prepared), or not
            // recorded: the record goes again. Another thread's write may
            // have stored it, so the file is stale either way (`renew`
            // stores it before the segment is written again).
            let record = (segment, seq32, writer, there);
            state.sidecar.evicted.retain(|entry| *entry != record);
            state.sidecar_dirty = true;
            state.busy.remove(&segment);
            return stored;
        }
        state.segs[segment as usize] = Seg::Evicted {
            seq32,
            writer,
            len: there,
        };
        state.remote_reads.remove(&segment);
        drop(state);
        // Reads go to the bucket now; the segment stays busy until its
        // local bytes are gone, so it is not prepared again before that.
        if let Err(error) = self.inner.erase_segment(SegmentId(segment)) {
            // The bytes stay; reads go to the bucket all the same.
            log::warn!("tier: dropping segment {segment} from the cache: {error}");
        }
        self.counters
            .evicted_bytes
            .fetch_add(footprint, Ordering::Relaxed);
        self.lock().busy.remove(&segment);
        Ok(())
    }

    fn upload_segment(&self, segment: u32, seq32: u32, len: u64) -> Result<()> {
        {
            let mut state = self.lock();
            let current = matches!(&state.segs[segment as usize],
                Seg::Local(local) if local.seq32 == Some(seq32));
            if !current || state.busy.contains(&segment) {
                return Ok(()); // reused meanwhile: its bytes went to the stash
            }
            state.busy.insert(segment);
        }
        let mut buf = vec![0u8; len as usize];
        let read = self.inner.read(SegmentId(segment), 0, &mut buf);
        self.lock().busy.remove(&segment);
        self.changed.notify_all();
        read.map_err(|e| TierError::Local(format!("reading segment {segment} to upload: {e}")))?;
        self.put_segment(segment, seq32, Bytes::from(buf))
    }

    fn upload_stash(&self) -> Result<()> {
        let Some((segment, seq32, bytes)) = self.lock().stash.front().cloned() else {
            return Ok(());
        };
        self.put_segment(segment, seq32, bytes.clone())?;
        let mut state = self.lock();
        state.stash.pop_front();
        state.stash_bytes -= bytes.len() as u64;
        Ok(())
    }

    fn put_segment(&self, segment: u32, seq32: u32, bytes: Bytes) -> Result<()> {
        let len = bytes.len() as u64;
        let incarnation = (segment, seq32, self.writer);
        let key = ObjectPath::from(objects::segment_key(&self.location.prefix, incarnation));
        self.block_on(
            "uploading a segment",
            self.store.put(&key, PutPayload::from(bytes)),
        )
        .map_err(|e| store_error(&self.location, "uploading a segment", e))?;
        self.counters
            .uploaded_bytes
            .fetch_add(len, Ordering::Relaxed);
        let mut state = self.lock();
        let there = state.in_bucket.entry(incarnation).or_insert(0);
        *there = (*there).max(len);
        Ok(())
    }

    fn publish(&self, root: RootObject, generation: u64, covers_sync: u64) -> Result<()> {
        let number = root.number;
        let entries: HashMap<Incarnation, u64> = root
            .segments
            .iter()
            .map(|entry| (entry.incarnation(), entry.len_bytes))
            .collect();
        let key = ObjectPath::from(objects::root_key(&self.location.prefix, number));
        let options = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        let put = self.block_on(
            "publishing a root object",
            self.store
                .put_opts(&key, PutPayload::from(root.encode()), options),
        );
        match put {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => {
                let theirs = self.block_on(
                    "reading a root object",
                    get_root(&self.store, &self.location, number),
                )?;
                if theirs.writer_id != self.writer_id {
                    self.refuse_other_writer(number);
                    return Ok(());
                }
                if theirs != root {
                    // An earlier snapshot of ours whose reply was lost: it
                    // stands as root `number`, and this one follows it.
                    let names = theirs
                        .segments
                        .iter()
                        .map(|e| (e.incarnation(), e.len_bytes));
                    self.published(number, None, 0, names.collect());
                    return Ok(());
                }
                // A retry of a PUT that had in fact succeeded (its reply was
                // lost): this very snapshot, published like any other.
            }
            Err(error) => return Err(store_error(&self.location, "publishing a root", error)),
        }
        self.published(number, Some(generation), covers_sync, entries);
        Ok(())
    }

    /// Another writer published root object `number`: this image stops publishing.
    fn refuse_other_writer(&self, number: u64) {
        let message = format!(
            "{}: another writer published root object {number} of this volume; \
             this image stops publishing (its writes stay in {}); only one machine \
             may write a tiered volume",
            self.location.url,
            self.sidecar_path.display()
        );
        log::error!("tier: {message}");
        self.lock().failed = Some(message);
    }

    /// Root object `number` (listing `entries`) is in the bucket. Made
    /// from the snapshot being published, of engine root `generation`,
    /// answering sync request `covers_sync`; or, with no generation, an
    /// earlier snapshot, which leaves the current one to be published next.
    fn published(
        &self,
        number: u64,
        generation: Option<u64>,
        covers_sync: u64,
        entries: HashMap<Incarnation, u64>,
    ) {
        self.counters
            .roots_published
            .fetch_add(1, Ordering::Relaxed);
        let mut state = self.lock();
        state.sidecar.bucket_root = number;
        if let Some(generation) = generation {
            state.published_generation = Some(generation);
            state.last_publish = Instant::now();
            state.target = None;
            state.sync_published = state.sync_published.max(covers_sync);
        }
        let now = Instant::now();
        for older in state.roots.values_mut() {
            older.superseded.get_or_insert(now);
        }
        state.roots.insert(
            number,
            KeptRoot {
                superseded: None,
                names: Some(entries.keys().copied().collect()),
            },
        );
        state.published_entries = entries;
        drop(state);
        if let Err(error) = self.store_sidecar() {
            // The next open finds the root by its writer id.
            log::warn!("tier: {error}");
        }
    }

    /// Reads from the bucket: `buf.len()` bytes at `offset` of an
    /// incarnation, of which `len` bytes exist (zeros past them).
    fn read_remote(
        &self,
        incarnation: Incarnation,
        len: u64,
        offset: u64,
        buf: &mut [u8],
    ) -> zdisk_core::Result<()> {
        let end = offset + buf.len() as u64;
        let mut position = offset;
        let mut missed = false;
        while position < end {
            let granule = position / GRANULE_BYTES;
            let start = granule * GRANULE_BYTES;
            let data = self.granule(incarnation, len, granule, &mut missed)?;
            let stop = end.min(start + GRANULE_BYTES);
            let out = &mut buf[(position - offset) as usize..(stop - offset) as usize];
            let from = (position - start) as usize;
            let available = data.len().saturating_sub(from).min(out.len());
            out[..available].copy_from_slice(&data[from..from + available]);
            out[available..].fill(0);
            position = stop;
        }
        let counter = if missed {
            &self.counters.cache_misses
        } else {
            &self.counters.cache_hits
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.note_remote_read(incarnation);
        Ok(())
    }

    fn granule(
        &self,
        incarnation: Incarnation,
        len: u64,
        granule: u64,
        missed: &mut bool,
    ) -> zdisk_core::Result<Bytes> {
        let key = (incarnation, granule);
        let mut cache = self.lock_fetched();
        let mut waited = false;
        loop {
            cache.tick += 1;
            let tick = cache.tick;
            if let Some((bytes, used)) = cache.granules.get_mut(&key) {
                *used = tick;
                return Ok(bytes.clone());
            }
            if waited && !cache.in_flight.contains(&key) {
                // The fetch this read waited for failed.
                return Err(TierError::Store(format!(
                    "{}: reading an evicted segment: the fetch of its granule {granule} failed",
                    self.location.url
                ))
                .into());
            }
            if cache.in_flight.insert(key) {
                break;
            }
            *missed = true;
            waited = true;
            cache = cache.wait(&self.fetch_done);
        }
        drop(cache);
        *missed = true;
        let start = granule * GRANULE_BYTES;
        let stop = len.min(start + GRANULE_BYTES);
        let fetched = if start >= stop {
            Ok(Bytes::new())
        } else {
            self.fetch_range(incarnation, start..stop)
        };
        let mut cache = self.lock_fetched();
        cache.in_flight.remove(&key);
        self.fetch_done.notify_all();
        let bytes = fetched?;
        self.counters
            .fetched_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        cache.tick += 1;
        let tick = cache.tick;
        cache.bytes += bytes.len() as u64;
        if let Some((old, _)) = cache.granules.insert(key, (bytes.clone(), tick)) {
            cache.bytes -= old.len() as u64;
        }
        while cache.bytes > self.config.fetch_cache_bytes {
            let oldest = cache
                .granules
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(key, _)| *key)
                .expect("a cache over its bound holds something");
            let (old, _) = cache.granules.remove(&oldest).expect("present");
            cache.bytes -= old.len() as u64;
        }
        Ok(bytes)
    }

    /// Bytes `range` of an incarnation's object, retried with backoff for
    /// at most the retry timeout (an S3 client retries inside too, so one
    /// attempt may take that long by itself).
    fn fetch_range(
        &self,
        incarnation: Incarnation,
        range: std::ops::Range<u64>,
    ) -> zdisk_core::Result<Bytes> {
        let object = ObjectPath::from(objects::segment_key(&self.location.prefix, incarnation));
        let deadline = Instant::now() + self.config.retry_timeout;
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.block_on(
                "reading an evicted segment",
                self.store.get_range(&object, range.clone()),
            ) {
                Ok(bytes) => return Ok(bytes),
                Err(error) if Instant::now() + backoff >= deadline => {
                    return Err(
                        store_error(&self.location, "reading an evicted segment", error).into(),
                    )
                }
                Err(error) => {
                    log::debug!("tier: {error}; retrying in {} ms", backoff.as_millis());
                    assert_none_held("a fetch's backoff");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Counts a read of an evicted segment; the second one queues the
    /// segment to be written back into the local cache.
    fn note_remote_read(&self, (segment, seq32, writer): Incarnation) {
        let mut state = self.lock();
        if !matches!(state.segs[segment as usize], Seg::Evicted { seq32: s, writer: w, .. } if s == seq32 && w == writer)
        {
            return;
        }
        let reads = state.remote_reads.entry(segment).or_insert(0);
        *reads += 1;
        if *reads == WRITE_BACK_READS {
            state.write_back.push_back(segment);
            self.changed.notify_all();
        }
    }

    /// Fetches an evicted segment whole and writes it back into the local
    /// cache: the bytes are made durable first, then the eviction record is
    /// removed durably, so a crash between the two leaves it evicted.
    fn write_back(&self, segment: u32) -> Result<()> {
        let (incarnation, len) = match self.lock().segs[segment as usize] {
            Seg::Evicted { seq32, writer, len } => ((segment, seq32, writer), len),
            _ => return Ok(()),
        };
        let page = self.geometry.page_size_bytes as u64;
        let padded = len.div_ceil(page) * page;
        if padded == 0 || padded > self.geometry.segment_size_bytes {
            return Ok(());
        }
        // Through the granule cache: the reads that queued it have most
        // of it there already.
        let mut data = vec![0u8; padded as usize];
        let mut missed = false;
        for granule in 0..len.div_ceil(GRANULE_BYTES) {
            let bytes = self
                .granule(incarnation, len, granule, &mut missed)
                .map_err(|e| TierError::Store(e.to_string()))?;
            let start = (granule * GRANULE_BYTES) as usize;
            data[start..start + bytes.len()].copy_from_slice(&bytes);
        }
        let (_, seq32, writer) = incarnation;
        let unchanged = |state: &TierState| {
            matches!(state.segs[segment as usize],
                Seg::Evicted { seq32: s, writer: w, .. } if (s, w) == (seq32, writer))
        };
        {
            let mut state = self.lock();
            if !unchanged(&state) || state.busy.contains(&segment) {
                return Ok(()); // being prepared for reuse, or freed
            }
            // Reads go on from the bucket while the bytes are written.
            state.busy.insert(segment);
        }
        let local_error = |e: zdisk_core::Error| {
            TierError::Local(format!(
                "writing segment {segment} back into the cache: {e}"
            ))
        };
        // The segment's file range was punched at eviction: write it whole.
        let written = self
            .inner
            .prepare_segment(SegmentId(segment))
            .and_then(|()| {
                self.inner
                    .write_pages(SegmentId(segment), PageIndex(0), &data)
            })
            .and_then(|()| self.inner.sync())
            .map_err(local_error);
        if let Err(error) = written {
            self.lock().busy.remove(&segment);
            self.changed.notify_all();
            return Err(error);
        }
        let record = (segment, seq32, writer, len);
        let stored = {
            let mut state = self.lock();
            if unchanged(&state) {
                state.sidecar.evicted.retain(|entry| entry.0 != segment);
                state
                    .sidecar
                    .written_back
                    .retain(|entry| entry.0 != segment);
                if writer != self.writer {
                    state.sidecar.written_back.push((segment, seq32, writer));
                }
                drop(state);
                // The bytes are durable: the eviction record may go.
                Some(self.store_sidecar())
            } else {
                None
            }
        };
        let mut state = self.lock();
        match stored {
            Some(Ok(())) if unchanged(&state) => {
                state.tick += 1;
                let tick = state.tick;
                state.segs[segment as usize] = Seg::Local(LocalSeg {
                    seq32: Some(seq32),
                    writer,
                    written: len,
                    sealed: Some(len),
                    footprint: padded,
                    readers: 0,
                    last_use: tick,
                });
                state.remote_reads.remove(&segment);
                state.busy.remove(&segment);
                self.counters
                    .written_back_bytes
                    .fetch_add(padded, Ordering::Relaxed);
                self.changed.notify_all();
                return Ok(());
            }
            Some(Err(error)) if unchanged(&state) => {
                // Still evicted: its record stays.
                state.sidecar.evicted.push(record);
                state.sidecar_dirty = true;
                state.busy.remove(&segment);
                self.changed.notify_all();
                return Err(error);
            }
            _ => {}
        }
        // Freed while it was written back: its new local bytes go again.
        drop(state);
        if let Err(error) = self.inner.erase_segment(SegmentId(segment)) {
            log::warn!("tier: dropping freed segment {segment} from the cache: {error}");
        }
        self.lock().busy.remove(&segment);
        self.changed.notify_all();
        stored.unwrap_or(Ok(()))
    }

    /// The cache's bound holds while uploads lag: a host write waits,
    /// before the engine takes any lock, until the cache has room for
    /// another segment, as long as uploads under way can make some (sealed
    /// segments not yet in the bucket become evictable once they are). So
    /// the bucket lags by at most about the cache size (plus the writes
    /// admitted at once, and what the cleaner and checkpoints write), and
    /// writes slow to the upload rate, or stop while the bucket is out of
    /// reach, instead of filling the local disk; reads go on meanwhile.
    fn wait_for_room(&self) {
        // A writer waiting here must hold no lock a read takes.
        assert_none_held("waiting for room in the tier's cache");
        let segment_size = self.geometry.segment_size_bytes;
        let mut state = self.lock();
        let mut waiting_since: Option<Instant> = None;
        let mut last_warning = Instant::now();
        loop {
            let over =
                resident(&state) + segment_size > state.sidecar.cache_bytes.max(segment_size);
            let uploads_help = !state.stash.is_empty()
                || state.segs.iter().enumerate().any(|(index, seg)| match seg {
                    Seg::Local(LocalSeg {
                        seq32: Some(seq32),
                        writer,
                        sealed: Some(fill),
                        written,
                        ..
                    }) => {
                        written >= fill
                            && Self::there(&state, &(index as u32, *seq32, *writer)) < *fill
                    }
                    _ => false,
                });
            if !over || !uploads_help || state.failed.is_some() || state.closing {
                if let Some(since) = waiting_since {
                    self.counters
                        .held_micros
                        .fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
                }
                return;
            }
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if last_warning.elapsed() >= Duration::from_secs(30) {
                last_warning = Instant::now();
                log::warn!(
                    "tier: writes have waited {} s for uploads to make room in the cache ({} bytes not in {})",
                    since.elapsed().as_secs(),
                    self.lag_bytes(&state),
                    self.location.url
                );
            }
            self.changed.notify_all();
            state = state.wait_timeout(&self.changed, Duration::from_millis(100));
        }
    }

    /// `--tier-sync`: returns once a root object covering everything
    /// written so far is in the bucket. Fails if the bucket takes nothing
    /// for the retry timeout (what was synced is still durable locally).
    fn wait_published(&self) -> zdisk_core::Result<()> {
        assert_none_held("waiting for a root object to be published");
        let mut state = self.lock();
        state.sync_requests += 1;
        let ticket = state.sync_requests;
        let asked = Instant::now();
        self.changed.notify_all();
        while state.sync_published < ticket {
            if let Some(message) = &state.failed {
                return Err(TierError::OtherWriter(message.clone()).into());
            }
            let stalled = state.last_progress.elapsed().min(asked.elapsed());
            if stalled > self.config.retry_timeout {
                return Err(TierError::Store(format!(
                    "{}: --tier-sync: the bucket took nothing for {} s; this flush is durable locally only",
                    self.location.url,
                    stalled.as_secs()
                ))
                .into());
            }
            state = state.wait_timeout(&self.changed, Duration::from_millis(100));
        }
        Ok(())
    }

    /// Readies `segment` for a new incarnation (or erases it): its old
    /// bytes not yet uploaded go to the stash, its eviction record is
    /// removed durably, and it is local again. Decided under the lock,
    /// done without it while the segment is `busy`, applied under it.
    fn renew(&self, segment: SegmentId, erase: bool) -> zdisk_core::Result<()> {
        let index = segment.index();
        let mut state = self.lock();
        while state.busy.contains(&segment.0) {
            state = state.wait(&self.changed);
        }
        state.busy.insert(segment.0);
        let mut footprint = 0;
        // Bytes of the old incarnation to copy to the stash: (seq32, length).
        let mut to_stash = None;
        let mut unrecord = false;
        match state.segs[index].clone() {
            Seg::Local(local) => {
                footprint = local.footprint;
                if let (Some(seq32), false) = (local.seq32, self.config.read_only || erase) {
                    let there = Self::there(&state, &(segment.0, seq32, local.writer));
                    if there < local.written {
                        if state.stash_bytes + local.written > STASH_MAX_BYTES {
                            log::warn!(
                                "tier: {} bytes of reused segments wait for upload; \
                                 segment {segment}'s old bytes are dropped (the bucket skips a root)",
                                state.stash_bytes
                            );
                        } else {
                            // Counted now, so two renewals cannot both fit.
                            state.stash_bytes += local.written;
                            to_stash = Some((seq32, local.written));
                        }
                    }
                }
            }
            Seg::Evicted { .. } => {
                let before = state.sidecar.evicted.len();
                state.sidecar.evicted.retain(|entry| entry.0 != segment.0);
                debug_assert!(state.sidecar.evicted.len() < before);
                unrecord = true;
            }
            Seg::Empty => {}
        }
        // A record removed lazily (a freed evicted segment) must be gone
        // from the file before the segment holds new bytes.
        unrecord |= state.sidecar_dirty;
        drop(state);
        let stashed = to_stash.map(|(seq32, len)| {
            let mut buf = vec![0u8; len as usize];
            let read = self.inner.read(segment, 0, &mut buf);
            (seq32, len, read.map(|()| Bytes::from(buf)))
        });
        let renewed = match &stashed {
            // Nothing more is done: the read's error is returned below.
            Some((_, _, Err(_))) => Ok(()),
            _ => self.renew_io(segment, erase, unrecord),
        };
        let mut state = self.lock();
        state.busy.remove(&segment.0);
        self.changed.notify_all();
        if let Some((seq32, len, read)) = stashed {
            match read {
                Ok(bytes) => state.stash.push_back((segment.0, seq32, bytes)),
                Err(error) => {
                    state.stash_bytes -= len;
                    return Err(error);
                }
            }
        }
        renewed?;
        if erase {
            state.segs[index] = Seg::Empty;
        } else {
            state.tick += 1;
            let tick = state.tick;
            state.segs[index] = Seg::Local(LocalSeg {
                seq32: None,
                writer: self.writer,
                written: 0,
                sealed: None,
                footprint,
                readers: 0,
                last_use: tick,
            });
        }
        Ok(())
    }

    /// A renewal's I/O, without the lock: the state file made current (an
    /// eviction record's removal durable), then the local segment erased
    /// or prepared.
    fn renew_io(&self, segment: SegmentId, erase: bool, unrecord: bool) -> zdisk_core::Result<()> {
        if unrecord {
            self.store_sidecar()?;
        }
        if erase {
            self.inner.erase_segment(segment)
        } else {
            self.inner.prepare_segment(segment)
        }
    }
}

impl Media for TieredMedia {
    fn geometry(&self) -> MediaGeometry {
        self.shared.geometry
    }

    fn physical_size_bytes(&self) -> u64 {
        self.shared.inner.physical_size_bytes()
    }

    fn write_pages(
        &self,
        segment: SegmentId,
        first_page: PageIndex,
        data: &[u8],
    ) -> zdisk_core::Result<()> {
        let shared = &self.shared;
        {
            let state = shared.lock();
            assert!(
                matches!(state.segs[segment.index()], Seg::Local(_)),
                "segment {segment} written without being prepared"
            );
        }
        shared.inner.write_pages(segment, first_page, data)?;
        let end = first_page.0 as u64 * shared.geometry.page_size_bytes as u64 + data.len() as u64;
        let mut state = shared.lock();
        state.tick += 1;
        let tick = state.tick;
        if let Seg::Local(local) = &mut state.segs[segment.index()] {
            if first_page.0 == 0 {
                local.seq32 = first_record_seq(data);
            }
            local.written = local.written.max(end);
            local.footprint = local.footprint.max(end);
            local.last_use = tick;
        }
        Ok(())
    }

    fn read(
        &self,
        segment: SegmentId,
        offset_bytes: u64,
        buf: &mut [u8],
    ) -> zdisk_core::Result<()> {
        let shared = &self.shared;
        let remote = {
            let mut state = shared.lock();
            state.tick += 1;
            let tick = state.tick;
            match &mut state.segs[segment.index()] {
                Seg::Evicted { seq32, writer, len } => Some(((segment.0, *seq32, *writer), *len)),
                Seg::Local(local) => {
                    local.readers += 1;
                    local.last_use = tick;
                    None
                }
                Seg::Empty => None,
            }
        };
        match remote {
            Some((incarnation, len)) => shared.read_remote(incarnation, len, offset_bytes, buf),
            None => {
                let result = shared.inner.read(segment, offset_bytes, buf);
                let mut state = shared.lock();
                let mut drained = false;
                if let Seg::Local(local) = &mut state.segs[segment.index()] {
                    local.readers = local.readers.saturating_sub(1);
                    drained = local.readers == 0;
                }
                if drained && state.busy.contains(&segment.0) {
                    // An eviction waits for the reads of its local bytes.
                    shared.changed.notify_all();
                }
                shared.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
                result
            }
        }
    }

    fn erase_segment(&self, segment: SegmentId) -> zdisk_core::Result<()> {
        self.shared.renew(segment, true)
    }

    fn prepare_segment(&self, segment: SegmentId) -> zdisk_core::Result<()> {
        self.shared.renew(segment, false)
    }

    fn sync(&self) -> zdisk_core::Result<()> {
        let shared = &self.shared;
        let pending = shared.lock().pending_root.take();
        shared.inner.sync()?;
        if let Some(bytes) = pending {
            match zdisk_core::meta::Root::decode(&bytes) {
                Ok(root) => {
                    let mut state = shared.lock();
                    let newer = state
                        .latest_root
                        .as_ref()
                        .is_none_or(|latest| latest.0 < root.generation);
                    if newer {
                        state.latest_root = Some((root.generation, root.checkpoint.clean, bytes));
                    }
                    shared.changed.notify_all();
                }
                Err(error) => log::warn!("tier: a root the engine wrote does not decode: {error}"),
            }
        }
        if shared.config.sync && !shared.config.read_only {
            shared.wait_published()?;
        }
        Ok(())
    }

    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> zdisk_core::Result<()> {
        self.shared.inner.write_meta_slot(slot, data)?;
        self.shared.lock().pending_root = Some(data.to_vec());
        Ok(())
    }

    fn read_meta_slot(&self, slot: usize) -> zdisk_core::Result<Vec<u8>> {
        self.shared.inner.read_meta_slot(slot)
    }

    fn describe(&self) -> String {
        format!(
            "{} tiered to {}",
            self.shared.inner.describe(),
            self.shared.location.url
        )
    }

    fn segment_events(&self) -> Option<&dyn SegmentEvents> {
        Some(self)
    }

    fn admission(&self) -> Option<&dyn Admission> {
        Some(self)
    }

    fn close(&self) -> zdisk_core::Result<()> {
        {
            let mut state = self.shared.lock();
            state.closing = true;
            self.shared.changed.notify_all();
        }
        let handle = self.uploader.lock().expect("uploader lock").take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
        match &self.shared.lock().failed {
            Some(message) => Err(TierError::OtherWriter(message.clone()).into()),
            None => Ok(()),
        }
    }

    fn media_stats(&self) -> Vec<MediaStat> {
        let shared = &self.shared;
        let (lag, resident_bytes, bucket_root) = {
            let state = shared.lock();
            (
                shared.lag_bytes(&state),
                resident(&state),
                state.sidecar.bucket_root,
            )
        };
        let counter = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let c = &shared.counters;
        let values = [
            lag,
            counter(&c.uploaded_bytes),
            counter(&c.fetched_bytes),
            counter(&c.cache_hits),
            counter(&c.cache_misses),
            counter(&c.evicted_bytes),
            resident_bytes,
            counter(&c.roots_published),
            counter(&c.deleted_bytes),
            counter(&c.deleted_roots),
            counter(&c.written_back_bytes),
            counter(&c.held_micros),
            bucket_root,
        ];
        TIER_STATS
            .iter()
            .zip(values)
            .map(|(&(name, help), value)| MediaStat { name, help, value })
            .collect()
    }
}

impl SegmentEvents for TieredMedia {
    fn segment_freed(&self, segment: SegmentId) {
        let shared = &self.shared;
        let mut state = shared.lock();
        let index = segment.index();
        state.remote_reads.remove(&segment.0);
        let busy = state.busy.contains(&segment.0);
        match &mut state.segs[index] {
            Seg::Local(local) if busy || local.readers > 0 => {
                // Its bytes are being read: forget the incarnation, keep the
                // bytes until the segment is prepared again.
                local.seq32 = None;
                local.written = 0;
                local.sealed = None;
            }
            Seg::Local(_) => {
                state.segs[index] = Seg::Empty;
                // Dropped without the lock; busy meanwhile, so the segment
                // is not prepared again before its old bytes are gone.
                state.busy.insert(segment.0);
                drop(state);
                if let Err(error) = shared.inner.erase_segment(segment) {
                    log::warn!("tier: dropping freed segment {segment} from the cache: {error}");
                }
                shared.lock().busy.remove(&segment.0);
            }
            Seg::Evicted { .. } => {
                // Stored by the uploader soon, and at the latest before the
                // segment is prepared again (`renew`): until then a reopened
                // image finds it evicted, and the engine frees it again at open.
                state.segs[index] = Seg::Empty;
                state.sidecar.evicted.retain(|entry| entry.0 != segment.0);
                state.sidecar_dirty = true;
            }
            Seg::Empty => {}
        }
        shared.changed.notify_all();
    }

    fn segment_sealed(&self, segment: SegmentId, fill_bytes: u64) {
        let mut state = self.shared.lock();
        if let Seg::Local(local) = &mut state.segs[segment.index()] {
            local.sealed = Some(fill_bytes);
        }
        self.shared.changed.notify_all();
    }
}

impl Admission for TieredMedia {
    /// Holds a write back while the cache is full of segments not yet in
    /// the bucket.
    fn admit_write(&self, _bytes: u64) {
        if !self.shared.config.read_only {
            self.shared.wait_for_room();
        }
    }
}

impl Drop for TieredMedia {
    fn drop(&mut self) {
        // Without a clean close (a crash, a halt): stop the uploader where it is.
        {
            let mut state = self.shared.lock();
            if state.failed.is_none() && !state.closing {
                state.failed = Some("the medium was dropped without a close".into());
            }
            state.closing = true;
            self.shared.changed.notify_all();
        }
        if let Some(handle) = self.uploader.lock().expect("uploader lock").take() {
            let _ = handle.join();
        }
    }
}

/// The lock discipline (issue #23): a read goes on while the tier works on
/// another segment's local bytes, and in debug builds any I/O under a
/// marked lock panics. The tier runs over a RAM cache whose erases of one
/// chosen segment wait at a gate the test opens, and an in-memory bucket.
#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use zdisk_core::media::MemMedia;

    use super::*;

    const PAGE: u32 = 4096;

    /// Erases of `closed` wait until it is opened; `waiting` says one does.
    #[derive(Default)]
    struct GateState {
        closed: Option<u32>,
        waiting: bool,
    }

    struct Gated {
        inner: MemMedia,
        gate: Mutex<GateState>,
        changed: Condvar,
    }

    impl Gated {
        fn close(&self, segment: u32) {
            self.gate.lock().unwrap().closed = Some(segment);
        }

        fn open(&self) {
            self.gate.lock().unwrap().closed = None;
            self.changed.notify_all();
        }

        /// Whether an erase is held at the gate within a minute (the
        /// bound only turns a hang into a failure).
        fn wait_held(&self) -> bool {
            let gate = self.gate.lock().unwrap();
            let (gate, _) = self
                .changed
                .wait_timeout_while(gate, Duration::from_secs(60), |gate| !gate.waiting)
                .unwrap();
            gate.waiting
        }
    }

    impl Media for Gated {
        fn geometry(&self) -> MediaGeometry {
            self.inner.geometry()
        }
        fn physical_size_bytes(&self) -> u64 {
            self.inner.physical_size_bytes()
        }
        fn write_pages(&self, s: SegmentId, p: PageIndex, data: &[u8]) -> zdisk_core::Result<()> {
            self.inner.write_pages(s, p, data)
        }
        fn read(&self, s: SegmentId, offset: u64, buf: &mut [u8]) -> zdisk_core::Result<()> {
            self.inner.read(s, offset, buf)
        }
        fn erase_segment(&self, segment: SegmentId) -> zdisk_core::Result<()> {
            let mut gate = self.gate.lock().unwrap();
            if gate.closed == Some(segment.0) {
                gate.waiting = true;
                self.changed.notify_all();
                while gate.closed == Some(segment.0) {
                    gate = self.changed.wait(gate).unwrap();
                }
                gate.waiting = false;
            }
            drop(gate);
            self.inner.erase_segment(segment)
        }
        fn sync(&self) -> zdisk_core::Result<()> {
            self.inner.sync()
        }
        fn write_meta_slot(&self, slot: usize, data: &[u8]) -> zdisk_core::Result<()> {
            self.inner.write_meta_slot(slot, data)
        }
        fn read_meta_slot(&self, slot: usize) -> zdisk_core::Result<Vec<u8>> {
            self.inner.read_meta_slot(slot)
        }
        fn describe(&self) -> String {
            "gated RAM".into()
        }
    }

    /// A read-only tier (no uploader) over a gated RAM cache of 8 segments
    /// of 64 KiB, with segments 0 and 1 written with 0x10 and 0x11.
    fn tiered(name: &str) -> (Arc<TieredMedia>, Arc<Gated>) {
        let gated = Arc::new(Gated {
            inner: MemMedia::with_size(PAGE, 64 << 10, 8).expect("a RAM medium"),
            gate: Mutex::new(GateState::default()),
            changed: Condvar::new(),
        });
        let dir = std::env::temp_dir().join(format!("zdisk-tier-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        let sidecar_path = dir.join("a.img.tier");
        let url = format!("memory://tier-unit-{name}-{}/v", std::process::id());
        Sidecar::new(&url, [9; 16], 0, 1 << 30)
            .store(&sidecar_path)
            .expect("the state file");
        let config = TierConfig {
            read_only: true,
            retry_timeout: Duration::from_secs(1),
            ..TierConfig::default()
        };
        let media = TieredMedia::open(gated.clone(), sidecar_path, config).expect("the tier opens");
        for segment in 0..2 {
            media.prepare_segment(SegmentId(segment)).expect("prepare");
            let data = vec![0x10 + segment as u8; 2 * PAGE as usize];
            media
                .write_pages(SegmentId(segment), PageIndex(0), &data)
                .expect("write");
        }
        let _ = std::fs::remove_dir_all(&dir);
        (media, gated)
    }

    /// Reads segment `segment`'s first page on another thread; None if it
    /// has not finished within a minute (it waits for something).
    fn read_elsewhere(media: &Arc<TieredMedia>, segment: u32) -> Option<Vec<u8>> {
        let media = media.clone();
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; PAGE as usize];
            media
                .read(SegmentId(segment), 0, &mut buf)
                .expect("the read succeeds");
            let _ = done.send(buf);
        });
        finished.recv_timeout(Duration::from_secs(60)).ok()
    }

    #[test]
    fn reads_go_on_while_another_segment_is_dropped_or_prepared() {
        let (media, gated) = tiered("gate");
        // Freeing segment 1 drops its local bytes: the erase waits at the gate.
        gated.close(1);
        let freer = {
            let media = media.clone();
            std::thread::spawn(move || media.segment_freed(SegmentId(1)))
        };
        assert!(
            gated.wait_held(),
            "the freed segment's erase reached the gate"
        );
        let read = read_elsewhere(&media, 0).expect("a read waited for another segment's erase");
        assert!(read.iter().all(|&byte| byte == 0x10), "segment 0's bytes");
        gated.open();
        freer.join().expect("the freeing thread");

        // Preparing segment 1 again erases it (a RAM cache is flash-like).
        gated.close(1);
        let preparer = {
            let media = media.clone();
            std::thread::spawn(move || media.prepare_segment(SegmentId(1)))
        };
        assert!(
            gated.wait_held(),
            "the preparation's erase reached the gate"
        );
        let read = read_elsewhere(&media, 0).expect("a read waited for another segment's prepare");
        assert!(read.iter().all(|&byte| byte == 0x10), "segment 0's bytes");
        gated.open();
        preparer
            .join()
            .expect("the preparing thread")
            .expect("the preparation succeeds");
        media.close().expect("close");
    }

    #[cfg(any(debug_assertions, feature = "lock-checks"))]
    #[test]
    fn the_tier_locks_are_marked_while_held() {
        let (media, _gated) = tiered("marks");
        {
            let _state = media.shared.lock();
            assert_eq!(zdisk_core::held::held_lock(), Some("tier"));
        }
        {
            let _fetched = media.shared.lock_fetched();
            assert_eq!(zdisk_core::held::held_lock(), Some("tier fetch"));
        }
        assert_eq!(zdisk_core::held::held_lock(), None);
    }

    #[cfg(any(debug_assertions, feature = "lock-checks"))]
    #[test]
    #[should_panic(expected = "a medium read while holding the state lock")]
    fn a_cache_read_under_a_marked_lock_panics() {
        let (media, _gated) = tiered("cache-read");
        // As if the engine read under its state lock: the cache is checked.
        let _state = Held::mark("state");
        let mut buf = vec![0u8; PAGE as usize];
        let _ = media.read(SegmentId(0), 0, &mut buf);
    }

    #[cfg(any(debug_assertions, feature = "lock-checks"))]
    #[test]
    #[should_panic(expected = "reading an evicted segment while holding the state lock")]
    fn a_bucket_read_under_a_marked_lock_panics() {
        let (media, _gated) = tiered("bucket-read");
        media.shared.lock().segs[2] = Seg::Evicted {
            seq32: 1,
            writer: media.shared.writer,
            len: 64 << 10,
        };
        let _state = Held::mark("state");
        let mut buf = vec![0u8; PAGE as usize];
        let _ = media.read(SegmentId(2), 0, &mut buf);
    }
}
