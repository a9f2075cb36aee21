//! The evictor: keeps the local cache within its bound. While the cache
//! holds more than `cache_bytes` (the segment table counts them), it
//! chooses the least recently used segment that is sealed, wholly in the
//! bucket, not claimed and not being read; the uploader then records the
//! eviction durably and drops the segment's local bytes
//! (`Shared::evict`). It also counts reads of evicted segments: one read
//! twice is queued to be written back into the cache.
//!
//! Invariants: a segment is chosen only if its object holds at least its
//! sealed bytes, nobody has claimed it and no read of its local bytes is
//! under way; the choice claims it and records it evicted (the segment
//! table asserts the rest when the eviction is applied).

use std::collections::{HashMap, VecDeque};

use super::record::Record;
use super::segments::{Seg, SegmentTable};
use super::uploads::Uploads;

/// Reads of an evicted segment after which it is written back into the cache.
const WRITE_BACK_READS: u32 = 2;

/// A segment chosen for eviction: its incarnation, bytes in the bucket and
/// local footprint.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Eviction {
    pub segment: u32,
    pub seq32: u32,
    pub writer: u64,
    pub there: u64,
    pub footprint: u64,
}

impl Eviction {
    /// Its record in the `.tier` file.
    pub(super) fn record(&self) -> super::record::Eviction {
        (self.segment, self.seq32, self.writer, self.there)
    }
}

#[derive(Default)]
pub(super) struct Evictor {
    /// Reads per evicted segment since it was evicted.
    remote_reads: HashMap<u32, u32>,
    /// Evicted segments to write back into the local cache.
    write_back: VecDeque<u32>,
}

impl Evictor {
    /// If the cache holds more than `cache_bytes`, the least recently used
    /// segment that may be evicted, claimed and recorded evicted.
    pub(super) fn choose(
        &self,
        segments: &mut SegmentTable,
        uploads: &Uploads,
        record: &mut Record,
    ) -> Option<Eviction> {
        if segments.resident_bytes() <= record.cache_bytes() {
            return None;
        }
        let (_, eviction) = segments
            .iter()
            .filter_map(|(segment, seg)| match seg {
                Seg::Local(local) if !segments.is_busy(segment) && local.readers == 0 => {
                    let seq32 = local.seq32?;
                    let fill = local.sealed?;
                    let there = uploads
                        .in_bucket()
                        .get(&(segment, seq32, local.writer))
                        .copied()?;
                    let eviction = Eviction {
                        segment,
                        seq32,
                        writer: local.writer,
                        there,
                        footprint: local.footprint,
                    };
                    (local.written >= fill && there >= fill)
                        .then_some(((local.last_use, segment), eviction))
                }
                _ => None,
            })
            .min_by_key(|(order, _)| *order)?;
        segments.claim(eviction.segment);
        record.record_eviction(eviction.record());
        Some(eviction)
    }

    /// True if a new segment would take the cache past its bound.
    pub(super) fn full(segments: &SegmentTable, cache_bytes: u64, segment_bytes: u64) -> bool {
        segments.resident_bytes() + segment_bytes > cache_bytes.max(segment_bytes)
    }

    /// Counts a read of evicted `segment`; true if that queued it to be
    /// written back.
    pub(super) fn remote_read(&mut self, segment: u32) -> bool {
        let reads = self.remote_reads.entry(segment).or_insert(0);
        *reads += 1;
        if *reads == WRITE_BACK_READS {
            self.write_back.push_back(segment);
            return true;
        }
        false
    }

    /// `segment` was evicted, written back or freed: its count starts again.
    pub(super) fn forget(&mut self, segment: u32) {
        self.remote_reads.remove(&segment);
    }

    /// The next segment to write back, if any.
    pub(super) fn next_write_back(&mut self) -> Option<u32> {
        self.write_back.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::super::segments::LocalSeg;
    use super::*;
    use crate::sidecar::Sidecar;

    const ME: u64 = 1;

    /// Four sealed segments of 4096 bytes (incarnation 10 + index), all in
    /// the bucket, in a cache of 8192 bytes; used last in the order 2, 0, 3, 1.
    fn cache() -> (SegmentTable, Uploads, Record) {
        let mut segments = SegmentTable::new(
            (0..4)
                .map(|index| Seg::Local(LocalSeg::found(10 + index, ME, 4096, 4096)))
                .collect(),
        );
        for segment in [2, 0, 3, 1] {
            segments.begin_read(segment);
            segments.end_read(segment);
        }
        let in_bucket = (0..4)
            .map(|index| ((index, 10 + index, ME), 4096))
            .collect();
        let record = Record::new(Sidecar::new("s3://b/p", [1; 16], 0, 8192));
        (segments, Uploads::new(in_bucket), record)
    }

    #[test]
    fn the_least_recently_used_segment_goes_first() {
        let (mut segments, uploads, mut record) = cache();
        let evictor = Evictor::default();
        let chosen = evictor.choose(&mut segments, &uploads, &mut record);
        let chosen = chosen.expect("over the bound");
        assert_eq!((chosen.segment, chosen.there), (2, 4096));
        assert!(segments.is_busy(2), "the choice claims it");
        assert_eq!(record.eviction(2), Some((2, 12, ME, 4096)));
    }

    #[test]
    fn never_a_claimed_segment_one_being_read_or_one_not_in_the_bucket() {
        let (mut segments, mut uploads, mut record) = cache();
        let evictor = Evictor::default();
        segments.claim(2);
        segments.begin_read(0);
        uploads.deleted(&(3, 13, ME));
        uploads.landed((3, 13, ME), 4095);
        let chosen = evictor.choose(&mut segments, &uploads, &mut record);
        assert_eq!(chosen.map(|eviction| eviction.segment), Some(1));
        segments.end_read(0);
        let next = evictor.choose(&mut segments, &uploads, &mut record);
        assert_eq!(next.map(|eviction| eviction.segment), Some(0));
        assert_eq!(
            evictor.choose(&mut segments, &uploads, &mut record),
            None,
            "segment 3 is not all in the bucket"
        );
    }

    #[test]
    fn nothing_goes_within_the_bound() {
        let (mut segments, uploads, _) = cache();
        let mut roomy = Record::new(Sidecar::new("s3://b/p", [1; 16], 0, 4 * 4096));
        assert_eq!(
            Evictor::default().choose(&mut segments, &uploads, &mut roomy),
            None
        );
        assert!(Evictor::full(&segments, 4 * 4096, 4096));
        assert!(!Evictor::full(&segments, 5 * 4096, 4096));
    }

    #[test]
    fn the_second_read_of_an_evicted_segment_queues_its_write_back() {
        let mut evictor = Evictor::default();
        assert!(!evictor.remote_read(5));
        assert!(evictor.remote_read(5));
        assert!(!evictor.remote_read(5), "queued once");
        assert_eq!(evictor.next_write_back(), Some(5));
        assert_eq!(evictor.next_write_back(), None);
        evictor.forget(5);
        assert!(!evictor.remote_read(5));
    }
}
