//! The uploader's work on the local cache: dropping an evicted segment's
//! bytes, and writing a much-read evicted segment back. Both claim the
//! segment, do their I/O without the lock, and re-check its incarnation
//! before applying the outcome; the `.tier` file is made durable in the
//! order a crash needs (an eviction recorded before the bytes go; written
//! back bytes synced before the record goes).

use zdisk_core::units::{PageIndex, SegmentId};

use super::evictor::Eviction;
use super::fetch_cache::GRANULE_BYTES;
use super::shared::Shared;
use super::stats::bump;
use crate::error::{Result, TierError};

impl Shared {
    /// Evicts a segment the evictor chose (claimed, recorded): stores the
    /// record durably, then (once no read of its local bytes is under way,
    /// and if it still holds the same incarnation) serves it from the
    /// bucket, and only then drops its local bytes. An error leaves it
    /// local.
    pub(super) fn evict(&self, eviction: Eviction) -> Result<()> {
        let stored = self.store_sidecar();
        let Eviction {
            segment,
            seq32,
            writer,
            there,
            footprint,
        } = eviction;
        let mut state = self.lock();
        // Reads under way finish on the local bytes.
        while state.segments.readers(segment) > 0 {
            state = state.wait(&self.changed);
        }
        let current = state.segments.holds_local_of(segment, seq32, writer);
        if stored.is_err() || !current {
            // Freed meanwhile (its bytes stay until it is prepared), or not
            // recorded: the record goes again. Another thread's write may
            // have stored it, so the file is stale either way (`renew`
            // stores it before the segment is written again).
            state.record.undo_eviction(eviction.record());
            state.segments.release(segment);
            return stored;
        }
        state.segments.evict(segment, seq32, writer, there);
        state.evictor.forget(segment);
        state.check();
        drop(state);
        // Reads go to the bucket now; the segment stays claimed until its
        // local bytes are gone, so it is not prepared again before that.
        if let Err(error) = self.inner.erase_segment(SegmentId(segment)) {
            // The bytes stay; reads go to the bucket all the same.
            log::warn!("tier: dropping segment {segment} from the cache: {error}");
        }
        bump(&self.counters.evicted_bytes, footprint);
        self.lock().segments.release(segment);
        Ok(())
    }

    /// Fetches an evicted segment whole and writes it back into the local
    /// cache: the bytes are made durable first, then the eviction record is
    /// removed durably, so a crash between the two leaves it evicted.
    pub(super) fn write_back(&self, segment: u32) -> Result<()> {
        let Some((incarnation, len)) = self.lock().segments.evicted(segment) else {
            return Ok(());
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
            let bytes = self.granule(incarnation, len, granule, &mut missed)?;
            let start = (granule * GRANULE_BYTES) as usize;
            data[start..start + bytes.len()].copy_from_slice(&bytes);
        }
        let (_, seq32, writer) = incarnation;
        {
            let mut state = self.lock();
            if !state.segments.is_evicted_as(segment, seq32, writer)
                || state.segments.is_busy(segment)
            {
                return Ok(()); // being prepared for reuse, or freed
            }
            // Reads go on from the bucket while the bytes are written.
            state.segments.claim(segment);
        }
        // The segment's file range was punched at eviction: write it whole.
        let written = self
            .inner
            .prepare_segment(SegmentId(segment))
            .and_then(|()| {
                self.inner
                    .write_pages(SegmentId(segment), PageIndex(0), &data)
            })
            .and_then(|()| self.inner.sync())
            .map_err(|e| {
                TierError::Local(format!(
                    "writing segment {segment} back into the cache: {e}"
                ))
            });
        if let Err(error) = written {
            self.lock().segments.release(segment);
            self.changed.notify_all();
            return Err(error);
        }
        let stored = {
            let mut state = self.lock();
            if state.segments.is_evicted_as(segment, seq32, writer) {
                let own = writer == self.writer;
                state.record.written_back(segment, seq32, writer, own);
                drop(state);
                // The bytes are durable: the eviction record may go.
                Some(self.store_sidecar())
            } else {
                None
            }
        };
        let mut state = self.lock();
        let unchanged = state.segments.is_evicted_as(segment, seq32, writer);
        match stored {
            Some(Ok(())) if unchanged => {
                state.segments.written_back(segment, padded);
                state.evictor.forget(segment);
                state.segments.release(segment);
                state.check();
                bump(&self.counters.written_back_bytes, padded);
                self.changed.notify_all();
                return Ok(());
            }
            Some(Err(error)) if unchanged => {
                // Still evicted: its record stays.
                state.record.record_eviction((segment, seq32, writer, len));
                state.record.mark_dirty();
                state.segments.release(segment);
                state.check();
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
        self.lock().segments.release(segment);
        self.changed.notify_all();
        stored.unwrap_or(Ok(()))
    }
}
