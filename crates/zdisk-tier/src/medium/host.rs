//! What the engine's threads do in the tier, for `TieredMedia`'s `Media`
//! calls: reads (of the local cache, or of the bucket through the fetch
//! cache), the bookkeeping of writes and roots, readying a segment for a
//! new incarnation, freeing one, and the two waits a host write or FLUSH
//! may make (for room in the cache, for a root to be published).

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use zdisk_core::held::assert_none_held;
use zdisk_core::units::{PageIndex, SegmentId};

use super::bucket::store_error;
use super::evictor::Evictor;
use super::fetch_cache::{Lookup, GRANULE_BYTES};
use super::segments::{Freed, ReadFrom, Seg};
use super::shared::{first_record_seq, Shared};
use super::stats::bump;
use crate::error::{Result, TierError};
use crate::objects::{self, Incarnation};

impl Shared {
    /// Reads `buf.len()` bytes at `offset` of `segment`, wherever they are.
    pub(super) fn read(
        &self,
        segment: SegmentId,
        offset: u64,
        buf: &mut [u8],
    ) -> zdisk_core::Result<()> {
        let from = self.lock().segments.begin_read(segment.0);
        match from {
            ReadFrom::Bucket(incarnation, len) => self.read_remote(incarnation, len, offset, buf),
            ReadFrom::Local => {
                let result = self.inner.read(segment, offset, buf);
                if self.lock().segments.end_read(segment.0) {
                    // An eviction waits for the reads of its local bytes.
                    self.changed.notify_all();
                }
                bump(&self.counters.cache_hits, 1);
                result
            }
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
        bump(counter, 1);
        self.note_remote_read(incarnation);
        Ok(())
    }

    /// Granule `granule` of an incarnation `len` bytes long: from the
    /// fetch cache, from the fetch another read makes, or fetched here.
    /// `missed` is set if it was not in the cache.
    pub(super) fn granule(
        &self,
        incarnation: Incarnation,
        len: u64,
        granule: u64,
        missed: &mut bool,
    ) -> Result<Bytes> {
        let key = (incarnation, granule);
        let mut cache = self.lock_fetched();
        let mut waited = false;
        loop {
            match cache.lookup(key, waited) {
                Lookup::Hit(bytes) => return Ok(bytes),
                Lookup::Failed => {
                    return Err(TierError::Store(format!(
                        "{}: reading an evicted segment: the fetch of its granule {granule} failed",
                        self.location.url
                    )))
                }
                Lookup::Fetch => break,
                Lookup::Wait => {
                    *missed = true;
                    waited = true;
                    cache = cache.wait(&self.fetch_done);
                }
            }
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
        cache.fetch_done(key, fetched.as_ref().ok().cloned());
        self.fetch_done.notify_all();
        let bytes = fetched?;
        bump(&self.counters.fetched_bytes, bytes.len() as u64);
        Ok(bytes)
    }

    /// Bytes `range` of an incarnation's object, retried with backoff for
    /// at most the retry timeout (an S3 client retries inside too, so one
    /// attempt may take that long by itself).
    fn fetch_range(&self, incarnation: Incarnation, range: Range<u64>) -> Result<Bytes> {
        let object = ObjectPath::from(objects::segment_key(&self.location.prefix, incarnation));
        let deadline = self.now() + self.config.retry_timeout;
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.block_on(
                "reading an evicted segment",
                self.store.get_range(&object, range.clone()),
            ) {
                Ok(bytes) => return Ok(bytes),
                Err(error) if self.now() + backoff >= deadline => {
                    return Err(store_error(
                        &self.location,
                        "reading an evicted segment",
                        error,
                    ))
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

    /// Counts a read of an evicted segment (the evictor may queue it to
    /// be written back).
    fn note_remote_read(&self, (segment, seq32, writer): Incarnation) {
        let mut state = self.lock();
        if state.segments.is_evicted_as(segment, seq32, writer)
            && state.evictor.remote_read(segment)
        {
            self.changed.notify_all();
        }
    }

    /// The engine wrote `data` at `first_page` of `segment`.
    pub(super) fn note_write(&self, segment: SegmentId, first_page: PageIndex, data: &[u8]) {
        let end = first_page.0 as u64 * self.geometry.page_size_bytes as u64 + data.len() as u64;
        let at_start = (first_page.0 == 0).then(|| first_record_seq(data));
        self.lock().segments.note_write(segment.0, at_start, end);
    }

    /// The engine's sync: the root written last is durable once the
    /// cache is synced, and is to be published; with `--tier-sync`, the
    /// sync returns once a root covering it is.
    pub(super) fn sync(&self) -> zdisk_core::Result<()> {
        let pending = self.lock().publisher.take_pending();
        self.inner.sync()?;
        if let Some(bytes) = pending {
            match zdisk_core::meta::Root::decode(&bytes) {
                Ok(root) => {
                    let clean = root.checkpoint.clean;
                    self.lock()
                        .publisher
                        .root_durable(root.generation, clean, bytes);
                    self.changed.notify_all();
                }
                Err(error) => log::warn!("tier: a root the engine wrote does not decode: {error}"),
            }
        }
        if self.config.sync && !self.config.read_only {
            self.wait_published()?;
        }
        Ok(())
    }

    /// The cache's bound holds while uploads lag: a host write waits,
    /// before the engine takes any lock, until the cache has room for
    /// another segment, as long as uploads under way can make some (sealed
    /// segments not yet in the bucket become evictable once they are). So
    /// the bucket lags by at most about the cache size (plus the writes
    /// admitted at once, and what the cleaner and checkpoints write), and
    /// writes slow to the upload rate, or stop while the bucket is out of
    /// reach, instead of filling the local disk; reads go on meanwhile.
    pub(super) fn wait_for_room(&self) {
        // A writer waiting here must hold no lock a read takes.
        assert_none_held("waiting for room in the tier's cache");
        let segment_size = self.geometry.segment_size_bytes;
        let mut state = self.lock();
        let mut waiting_since: Option<Duration> = None;
        let mut last_warning = self.now();
        loop {
            let now = self.now();
            let full = Evictor::full(&state.segments, state.record.cache_bytes(), segment_size);
            let uploads_help = state.uploads.uploads_help(&state.segments);
            if !full || !uploads_help || state.failed().is_some() || state.closing() {
                if let Some(since) = waiting_since {
                    let held = now.saturating_sub(since).as_micros() as u64;
                    bump(&self.counters.held_micros, held);
                }
                return;
            }
            let since = *waiting_since.get_or_insert(now);
            if now.saturating_sub(last_warning) >= Duration::from_secs(30) {
                last_warning = now;
                log::warn!(
                    "tier: writes have waited {} s for uploads to make room in the cache ({} bytes not in {})",
                    now.saturating_sub(since).as_secs(),
                    state.lag_bytes(),
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
        let ticket = state.publisher.request_sync();
        let asked = self.now();
        self.changed.notify_all();
        while !state.publisher.synced(ticket) {
            if let Some(message) = state.failed() {
                return Err(TierError::OtherWriter(message.clone()).into());
            }
            let now = self.now();
            let stalled = state
                .publisher
                .since_progress(now)
                .min(now.saturating_sub(asked));
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
    /// done without it while the segment is claimed, applied under it.
    pub(super) fn renew(&self, segment: SegmentId, erase: bool) -> zdisk_core::Result<()> {
        let mut state = self.lock();
        while state.segments.is_busy(segment.0) {
            state = state.wait(&self.changed);
        }
        state.segments.claim(segment.0);
        // Bytes of the old incarnation to copy to the stash: (seq32, length).
        let mut to_stash = None;
        let mut unrecord = false;
        match state.segments.get(segment.0).clone() {
            Seg::Local(local) => {
                if let (Some(seq32), false) = (local.seq32, self.config.read_only || erase) {
                    let there = state.uploads.there(&(segment.0, seq32, local.writer));
                    if there < local.written {
                        if state.uploads.reserve_stash(local.written) {
                            // Counted now, so two renewals cannot both fit.
                            to_stash = Some((seq32, local.written));
                        } else {
                            log::warn!(
                                "tier: {} bytes of reused segments wait for upload; \
                                 segment {segment}'s old bytes are dropped (the bucket skips a root)",
                                state.uploads.stash_bytes()
                            );
                        }
                    }
                }
            }
            Seg::Evicted { .. } => {
                let had = state.record.forget_eviction(segment.0);
                debug_assert!(had, "an evicted segment has its record");
                unrecord = true;
            }
            Seg::Empty => {}
        }
        // A record removed lazily (a freed evicted segment) must be gone
        // from the file before the segment holds new bytes.
        unrecord |= state.record.is_dirty();
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
        let outcome = match stashed {
            Some((seq32, _, Ok(bytes))) => {
                state.uploads.stash(segment.0, seq32, bytes);
                renewed
            }
            Some((_, len, Err(error))) => {
                state.uploads.unreserve_stash(len);
                Err(error)
            }
            None => renewed,
        };
        if outcome.is_ok() {
            if erase {
                state.segments.erased(segment.0);
            } else {
                state.segments.renewed(segment.0, self.writer);
            }
        }
        state.segments.release(segment.0);
        state.check();
        self.changed.notify_all();
        outcome
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

    /// The engine freed `segment`: its local bytes go (unless a read or
    /// another claim holds them), or its eviction record does.
    pub(super) fn free(&self, segment: SegmentId) {
        let mut state = self.lock();
        state.evictor.forget(segment.0);
        match state.segments.free(segment.0) {
            Freed::Drop => {
                // Dropped without the lock; claimed meanwhile, so the
                // segment is not prepared again before its old bytes are gone.
                drop(state);
                if let Err(error) = self.inner.erase_segment(segment) {
                    log::warn!("tier: dropping freed segment {segment} from the cache: {error}");
                }
                self.lock().segments.release(segment.0);
            }
            Freed::Unrecord => {
                // Stored by the uploader soon, and at the latest before the
                // segment is prepared again (`renew`): until then a reopened
                // image finds it evicted, and the engine frees it again at open.
                state.record.forget_eviction(segment.0);
                state.record.mark_dirty();
                state.check();
            }
            // Kept: its bytes are being read; they stay until the segment
            // is prepared again.
            Freed::Kept | Freed::Nothing => {}
        }
        self.changed.notify_all();
    }
}
