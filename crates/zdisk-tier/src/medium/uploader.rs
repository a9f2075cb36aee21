//! The uploader thread ("zdisk-tier-upload"), the one writer to the
//! bucket: it takes the next job under the state lock (store the state
//! file, evict a segment, upload a segment or the stash, publish a root,
//! write a segment back, collect garbage), does its I/O without the lock,
//! and applies the outcome under it again. A failed job is retried with
//! a backoff; at close it gives up once nothing has succeeded for four
//! retry timeouts.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{PutMode, PutOptions, PutPayload};
use zdisk_core::held::assert_none_held;
use zdisk_core::units::SegmentId;

use super::bucket::{get_root, store_error};
use super::evictor::Eviction;
use super::publisher::Step;
use super::shared::{Shared, TierState};
use super::stats::bump;
use crate::error::{Result, TierError};
use crate::objects::{self, Incarnation, RootObject, SegmentEntry};

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
    /// A root object: of engine root generation `.1`, answering sync `.2`.
    Publish(RootObject, u64, u64),
    Collect,
    WriteBack(u32),
    Done,
}

impl Shared {
    pub(super) fn upload_loop(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(200);
        let mut closing_since: Option<Duration> = None;
        // Cleared when storing the state file or an eviction failed: the
        // next try waits for the next wake-up instead of spinning.
        let mut retry_local = true;
        loop {
            let job = {
                let mut state = self.lock();
                loop {
                    let now = self.now();
                    if state.closing() && closing_since.is_none() {
                        closing_since = Some(now);
                    }
                    if let Some(since) = closing_since {
                        // Gives up once nothing has succeeded for four
                        // retry timeouts of the close.
                        let stalled = now
                            .saturating_sub(since)
                            .min(state.publisher.since_progress(now));
                        if stalled > 4 * self.config.retry_timeout && state.failed().is_none() {
                            let why = format!(
                                "{}: the bucket was out of reach for {} s at close; {} bytes were not uploaded",
                                self.location.url,
                                stalled.as_secs(),
                                state.lag_bytes()
                            );
                            state.fail(why);
                        }
                    }
                    if retry_local && state.record.is_dirty() {
                        break Job::StoreSidecar;
                    }
                    if retry_local {
                        let state = &mut *state;
                        let chosen = state.evictor.choose(
                            &mut state.segments,
                            &state.uploads,
                            &mut state.record,
                        );
                        if let Some(eviction) = chosen {
                            break Job::Evict(eviction);
                        }
                    }
                    if let Some(job) = self.next_job(&mut state, now) {
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
                    let now = self.now();
                    self.lock().publisher.progressed(now);
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

    /// The next upload, publication, write-back or collection, if any:
    /// uploads first (the stash, then sealed segments and what the root
    /// being published needs), then the publication.
    fn next_job(&self, state: &mut TierState, now: Duration) -> Option<Job> {
        if state.failed().is_some() {
            return state.closing().then_some(Job::Done);
        }
        if !state.uploads.stash_is_empty() {
            return Some(Job::UploadStash);
        }
        let needs = state.publisher.needs();
        let upload = state
            .uploads
            .next_upload(&state.segments, &needs, self.writer);
        if let Some((segment, seq32, len)) = upload {
            return Some(Job::Upload {
                segment,
                seq32,
                len,
            });
        }
        let number = state.record.bucket_root() + 1;
        let closing = state.closing();
        match state
            .publisher
            .step(&state.segments, &state.uploads, now, closing, number)
        {
            Step::Publish(root, generation, covers_sync) => {
                return Some(Job::Publish(root, generation, covers_sync))
            }
            Step::Wait => return None,
            // The uploads it needs come first.
            Step::Chosen => return self.next_job(state, now),
            Step::Idle { answered } => {
                if answered {
                    self.changed.notify_all();
                }
            }
        }
        if let Some(segment) = state.evictor.next_write_back() {
            return Some(Job::WriteBack(segment));
        }
        let collect_every = self.config.publish_interval.max(Duration::from_secs(1));
        if state.publisher.has_published()
            && state.collector.due(now, collect_every)
            && state.collect_plan(now, self.writer).is_some()
        {
            return Some(Job::Collect);
        }
        let settled = state.publisher.settled();
        // One last collection at close, for roots the clean stop superseded.
        if state.closing()
            && settled
            && state.collector.last_at_close()
            && state.collect_plan(now, self.writer).is_some()
        {
            return Some(Job::Collect);
        }
        (state.closing() && settled).then_some(Job::Done)
    }

    fn upload_segment(&self, segment: u32, seq32: u32, len: u64) -> Result<()> {
        {
            let mut state = self.lock();
            if !state.segments.holds_local(segment, seq32) || state.segments.is_busy(segment) {
                return Ok(()); // reused meanwhile: its bytes went to the stash
            }
            state.segments.claim(segment);
        }
        let mut buf = vec![0u8; len as usize];
        let read = self.inner.read(SegmentId(segment), 0, &mut buf);
        self.lock().segments.release(segment);
        self.changed.notify_all();
        read.map_err(|e| TierError::Local(format!("reading segment {segment} to upload: {e}")))?;
        self.put_segment(segment, seq32, Bytes::from(buf))
    }

    fn upload_stash(&self) -> Result<()> {
        let Some((segment, seq32, bytes)) = self.lock().uploads.stash_front() else {
            return Ok(());
        };
        self.put_segment(segment, seq32, bytes)?;
        self.lock().uploads.stash_uploaded(segment, seq32);
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
        bump(&self.counters.uploaded_bytes, len);
        self.lock().uploads.landed(incarnation, len);
        Ok(())
    }

    /// Writes root object `root` with a conditional PUT (it must not
    /// exist), then records it published.
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
        self.lock().refuse(message);
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
        bump(&self.counters.roots_published, 1);
        let now = self.now();
        let names: HashSet<Incarnation> = entries.keys().copied().collect();
        {
            let mut locked = self.lock();
            let state = &mut *locked;
            state.record.set_bucket_root(number);
            state
                .publisher
                .published(generation, covers_sync, entries, &state.uploads, now);
            state.collector.published(number, names, now);
        }
        if let Err(error) = self.store_sidecar() {
            // The next open finds the root by its writer id.
            log::warn!("tier: {error}");
        }
    }

    /// Deletes what the bucket no longer needs (`Collector`): first root
    /// objects past their keeping time, then (only if all of those are
    /// gone) segment objects that no kept root and nothing in use names.
    fn collect(&self) -> Result<()> {
        let now = self.now();
        let unknown = match self.lock().collect_plan(now, self.writer) {
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
            self.lock().collector.named(number, names);
        }
        let now = self.now();
        let Some(plan) = self.lock().collect_plan(now, self.writer) else {
            return Ok(());
        };
        for &number in &plan.roots {
            let key = ObjectPath::from(objects::root_key(&self.location.prefix, number));
            self.delete(&key, "deleting an old root object")?;
            let now = self.now();
            self.lock().collector.root_deleted(number, now);
            bump(&self.counters.deleted_roots, 1);
        }
        // Names only the deleted roots held are free now.
        let now = self.now();
        let Some(plan) = self.lock().collect_plan(now, self.writer) else {
            return Ok(());
        };
        for (incarnation, len) in plan.segments {
            let key = ObjectPath::from(objects::segment_key(&self.location.prefix, incarnation));
            self.delete(&key, "deleting a segment object no root needs")?;
            self.lock().uploads.deleted(&incarnation);
            bump(&self.counters.deleted_bytes, len);
        }
        Ok(())
    }

    fn delete(&self, key: &ObjectPath, what: &str) -> Result<()> {
        match self.block_on(what, self.store.delete(key)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(error) => Err(store_error(&self.location, what, error)),
        }
    }
}
