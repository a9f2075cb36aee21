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
//!   never deleted or shortened while a kept root names them, so every
//!   root object in the bucket can be served whole;
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
//! Owners. Each concern owns its fields and is the only code that changes
//! them; each states its invariants and asserts them where they change:
//! - `segments.rs`, the segment table: each segment's state (empty, local,
//!   evicted), which ones a thread has claimed (`busy`) and the reads of
//!   local bytes under way; the bytes the cache holds;
//! - `uploads.rs`: what the bucket holds of each incarnation, the upload
//!   queue and the stash of reused segments' old incarnations;
//! - `publisher.rs`: the roots written, durable and published, the root
//!   being published (target), `--tier-sync` requests and progress;
//! - `evictor.rs`: which segment to evict, reads of evicted segments and
//!   the write-backs they ask for;
//! - `fetch_cache.rs`: fetched granules and the fetches under way;
//! - `collector.rs`: the root objects kept, and what may be deleted;
//! - `record.rs`: the `.tier` file's contents (eviction records, the
//!   bucket root).
//!
//! They are plain data, handed the time (`now`, a reading of the
//! `TierConfig::clock`) where they decide by it. The I/O is done by
//! `Shared` (`shared.rs`), in the files of the threads that do it:
//! `uploader.rs` and `evicting.rs` (the uploader thread: uploads,
//! publications, collections, evictions, write-backs) and `host.rs` (the
//! engine's threads: reads, renewals, frees and the waits of a write or a
//! FLUSH); `bucket.rs` holds the whole-volume store calls.
//!
//! Invariants: a segment is read from the bucket exactly when it is
//! `Evicted`; an `Evicted` segment's object holds at least the bytes its
//! incarnation was sealed with, and while nobody has claimed it, its
//! eviction record is in the `.tier` state; one thread at a time reads,
//! writes or drops a segment's local bytes (`busy`), and none drops them
//! while they are being read (`readers`).
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

mod bucket;
mod collector;
mod config;
mod evicting;
mod evictor;
mod fetch_cache;
mod host;
mod publisher;
mod record;
mod segments;
mod shared;
mod stats;
mod uploader;
mod uploads;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use zdisk_core::media::{Admission, Media, MediaGeometry, MediaStat, SegmentEvents};
use zdisk_core::units::{PageIndex, SegmentId};

use crate::error::{Result, TierError};
use shared::Shared;

pub(crate) use bucket::{get_root, list};
pub use config::TierConfig;

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
        let shared = Arc::new(Shared::open(inner, sidecar_path, config)?);
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
        self.shared.lock().lag_bytes()
    }

    /// The newest root object this image published or started from.
    pub fn bucket_root(&self) -> u64 {
        self.shared.lock().record.bucket_root()
    }

    /// Bytes of segments the local cache holds.
    pub fn resident_bytes(&self) -> u64 {
        self.shared.lock().segments.resident_bytes()
    }

    /// Stops the uploader: it finishes (at a clean close) or gives up
    /// where it is.
    fn stop_uploader(&self) {
        if let Some(handle) = self.uploader.lock().expect("uploader lock").take() {
            let _ = handle.join();
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
        self.shared.lock().segments.assert_prepared(segment.0);
        self.shared.inner.write_pages(segment, first_page, data)?;
        self.shared.note_write(segment, first_page, data);
        Ok(())
    }

    fn read(
        &self,
        segment: SegmentId,
        offset_bytes: u64,
        buf: &mut [u8],
    ) -> zdisk_core::Result<()> {
        self.shared.read(segment, offset_bytes, buf)
    }

    fn erase_segment(&self, segment: SegmentId) -> zdisk_core::Result<()> {
        self.shared.renew(segment, true)
    }

    fn prepare_segment(&self, segment: SegmentId) -> zdisk_core::Result<()> {
        self.shared.renew(segment, false)
    }

    fn sync(&self) -> zdisk_core::Result<()> {
        self.shared.sync()
    }

    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> zdisk_core::Result<()> {
        self.shared.inner.write_meta_slot(slot, data)?;
        self.shared.lock().publisher.root_written(data.to_vec());
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
        self.shared.lock().close();
        self.shared.changed.notify_all();
        self.stop_uploader();
        match self.shared.lock().failed() {
            Some(message) => Err(TierError::OtherWriter(message.clone()).into()),
            None => Ok(()),
        }
    }

    fn media_stats(&self) -> Vec<MediaStat> {
        let (lag, resident, bucket_root) = {
            let state = self.shared.lock();
            let resident = state.segments.resident_bytes();
            (state.lag_bytes(), resident, state.record.bucket_root())
        };
        self.shared.counters.media_stats(lag, resident, bucket_root)
    }
}

impl SegmentEvents for TieredMedia {
    fn segment_sealed(&self, segment: SegmentId, fill_bytes: u64) {
        self.shared.lock().segments.seal(segment.0, fill_bytes);
        self.shared.changed.notify_all();
    }

    fn segment_freed(&self, segment: SegmentId) {
        self.shared.free(segment);
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
            if !state.closing() {
                state.fail("the medium was dropped without a close".into());
            }
            state.close();
            self.shared.changed.notify_all();
        }
        self.stop_uploader();
    }
}

/// The lock discipline (issue #23): a read goes on while the tier works on
/// another segment's local bytes, and in debug builds any I/O under a
/// marked lock panics. The tier runs over a RAM cache whose erases of one
/// chosen segment wait at a gate the test opens, and an in-memory bucket.
#[cfg(test)]
mod tests {
    use std::sync::{mpsc, Condvar};
    use std::time::Duration;

    #[cfg(any(debug_assertions, zdisk_lock_checks))]
    use zdisk_core::held::Held;
    use zdisk_core::media::MemMedia;

    use super::*;
    use crate::sidecar::Sidecar;

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

    #[cfg(any(debug_assertions, zdisk_lock_checks))]
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

    #[cfg(any(debug_assertions, zdisk_lock_checks))]
    #[test]
    #[should_panic(expected = "a medium read while holding the state lock")]
    fn a_cache_read_under_a_marked_lock_panics() {
        let (media, _gated) = tiered("cache-read");
        // As if the engine read under its state lock: the cache is checked.
        let _state = Held::mark("state");
        let mut buf = vec![0u8; PAGE as usize];
        let _ = media.read(SegmentId(0), 0, &mut buf);
    }

    #[cfg(any(debug_assertions, zdisk_lock_checks))]
    #[test]
    #[should_panic(expected = "reading an evicted segment while holding the state lock")]
    fn a_bucket_read_under_a_marked_lock_panics() {
        let (media, _gated) = tiered("bucket-read");
        let writer = media.shared.writer;
        media
            .shared
            .lock()
            .segments
            .force_evicted(2, 1, writer, 64 << 10);
        let _state = Held::mark("state");
        let mut buf = vec![0u8; PAGE as usize];
        let _ = media.read(SegmentId(2), 0, &mut buf);
    }
}
