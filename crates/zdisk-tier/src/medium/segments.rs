//! The segment table: what the tier knows of each segment of the local
//! cache, and which of them a thread is working on. Every change to a
//! segment's state goes through its methods, which keep these rules:
//!
//! - a segment is read from the bucket exactly when it is `Evicted`;
//! - one thread at a time reads, writes or drops a segment's local bytes
//!   without the lock: it *claims* the segment (`busy`) first and
//!   releases it after; a claim of a claimed segment is a bug;
//! - a segment is evicted only while its evictor holds the claim, no read
//!   of its local bytes is under way (`readers`), and its object in the
//!   bucket holds at least the bytes it was sealed with; it is written
//!   back, renewed or erased only under its claim too;
//! - `resident_bytes` is the sum of the local segments' footprints.

use std::collections::HashSet;

use crate::objects::{Incarnation, SegmentEntry};

#[derive(Debug, Clone)]
pub(super) enum Seg {
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
pub(super) struct LocalSeg {
    /// Low 32 bits of the incarnation's sequence number, from its first record.
    pub seq32: Option<u32>,
    /// The writer whose object holds the incarnation: this image, or for a
    /// segment written back from the bucket, the writer of that object.
    pub writer: u64,
    /// Bytes written from offset 0.
    pub written: u64,
    /// Where the engine sealed it (whole segment for one found at open).
    pub sealed: Option<u64>,
    /// Bytes the local file holds for the segment, this incarnation or older.
    pub footprint: u64,
    /// Reads under way.
    pub readers: u32,
    pub last_use: u64,
}

impl LocalSeg {
    /// A segment an earlier run wrote (recovery sealed it): `written`
    /// bytes of incarnation `seq32` of `writer`, never used yet.
    pub(super) fn found(seq32: u32, writer: u64, written: u64, footprint: u64) -> LocalSeg {
        LocalSeg {
            seq32: Some(seq32),
            writer,
            written,
            sealed: Some(written),
            footprint,
            readers: 0,
            last_use: 0,
        }
    }

    /// Its incarnation, once its first record is written.
    pub(super) fn incarnation(&self, index: u32) -> Option<Incarnation> {
        Some((index, self.seq32?, self.writer))
    }
}

/// Where a read of a segment goes.
pub(super) enum ReadFrom {
    /// The bucket: `len` bytes of this incarnation exist.
    Bucket(Incarnation, u64),
    /// The local cache (counted as a reader if the segment is local).
    Local,
}

/// What freeing a segment left to do.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Freed {
    /// Its local bytes are in use: the incarnation is forgotten, the bytes
    /// stay until the segment is prepared again.
    Kept,
    /// Its local bytes are to be dropped: it is empty now and claimed for that.
    Drop,
    /// It was evicted and is empty now: its eviction record goes.
    Unrecord,
    /// It held nothing.
    Nothing,
}

pub(super) struct SegmentTable {
    segs: Vec<Seg>,
    /// Segments whose local bytes a thread reads, writes or drops without
    /// the lock (an upload, an eviction, a write-back, a renewal, a freed
    /// segment's erase): nobody else starts on them until it is done.
    busy: HashSet<u32>,
    /// The clock of `last_use` (least recently used first).
    tick: u64,
    /// Sum of the local segments' footprints.
    resident_bytes: u64,
}

impl SegmentTable {
    pub(super) fn new(segs: Vec<Seg>) -> SegmentTable {
        let mut table = SegmentTable {
            segs,
            busy: HashSet::new(),
            tick: 1,
            resident_bytes: 0,
        };
        table.resident_bytes = table.footprints();
        table
    }

    fn footprints(&self) -> u64 {
        self.segs
            .iter()
            .map(|seg| match seg {
                Seg::Local(local) => local.footprint,
                _ => 0,
            })
            .sum()
    }

    fn check_resident(&self) {
        debug_assert_eq!(
            self.resident_bytes,
            self.footprints(),
            "resident bytes are the local segments' footprints"
        );
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    pub(super) fn get(&self, index: u32) -> &Seg {
        &self.segs[index as usize]
    }

    /// Every segment with its index.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &Seg)> {
        self.segs
            .iter()
            .enumerate()
            .map(|(index, seg)| (index as u32, seg))
    }

    /// The local segments that have an incarnation, with it.
    pub(super) fn local_incarnations(&self) -> impl Iterator<Item = (Incarnation, &LocalSeg)> {
        self.iter().filter_map(|(index, seg)| match seg {
            Seg::Local(local) => Some((local.incarnation(index)?, local)),
            _ => None,
        })
    }

    pub(super) fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// The segment entries a root made now would list.
    pub(super) fn entries(&self) -> Vec<SegmentEntry> {
        let mut entries = Vec::new();
        for (segment, seg) in self.iter() {
            let (seq32, writer, len_bytes) = match seg {
                Seg::Local(LocalSeg {
                    seq32: Some(seq32),
                    writer,
                    written,
                    ..
                }) if *written > 0 => (*seq32, *writer, *written),
                Seg::Evicted { seq32, writer, len } => (*seq32, *writer, *len),
                _ => continue,
            };
            entries.push(SegmentEntry {
                segment,
                seq32,
                writer,
                len_bytes,
            });
        }
        entries
    }

    /// True if `segment` is local and holds incarnation `seq32` (of any writer).
    pub(super) fn holds_local(&self, segment: u32, seq32: u32) -> bool {
        matches!(self.get(segment), Seg::Local(local) if local.seq32 == Some(seq32))
    }

    /// True if `segment` is local and holds `seq32` of `writer`.
    pub(super) fn holds_local_of(&self, segment: u32, seq32: u32, writer: u64) -> bool {
        matches!(self.get(segment),
            Seg::Local(local) if local.seq32 == Some(seq32) && local.writer == writer)
    }

    /// The incarnation and length of `segment` if it is evicted.
    pub(super) fn evicted(&self, segment: u32) -> Option<(Incarnation, u64)> {
        match *self.get(segment) {
            Seg::Evicted { seq32, writer, len } => Some(((segment, seq32, writer), len)),
            _ => None,
        }
    }

    /// True if `segment` is evicted and holds `seq32` of `writer`.
    pub(super) fn is_evicted_as(&self, segment: u32, seq32: u32, writer: u64) -> bool {
        matches!(self.evicted(segment), Some(((_, s, w), _)) if (s, w) == (seq32, writer))
    }

    /// Reads of `segment`'s local bytes under way.
    pub(super) fn readers(&self, segment: u32) -> u32 {
        match self.get(segment) {
            Seg::Local(local) => local.readers,
            _ => 0,
        }
    }

    pub(super) fn is_busy(&self, segment: u32) -> bool {
        self.busy.contains(&segment)
    }

    /// Claims `segment` for work on its local bytes without the lock.
    pub(super) fn claim(&mut self, segment: u32) {
        assert!(self.busy.insert(segment), "segment {segment} claimed twice");
    }

    pub(super) fn release(&mut self, segment: u32) {
        assert!(
            self.busy.remove(&segment),
            "segment {segment} released without a claim"
        );
    }

    /// The engine is about to write `segment`: it must have prepared it.
    pub(super) fn assert_prepared(&self, segment: u32) {
        assert!(
            matches!(self.get(segment), Seg::Local(_)),
            "segment {segment} written without being prepared"
        );
    }

    /// `segment`'s local bytes up to `end` are written; a write at page 0
    /// names the incarnation: `at_start` is then `Some` of the `seq32` its
    /// first record gives (`None` if it starts with none).
    pub(super) fn note_write(&mut self, segment: u32, at_start: Option<Option<u32>>, end: u64) {
        let tick = self.next_tick();
        if let Seg::Local(local) = &mut self.segs[segment as usize] {
            if let Some(seq32) = at_start {
                local.seq32 = seq32;
            }
            local.written = local.written.max(end);
            let grown = end.saturating_sub(local.footprint);
            local.footprint += grown;
            local.last_use = tick;
            self.resident_bytes += grown;
        }
    }

    /// A read of `segment` starts: a local one is counted until `end_read`.
    pub(super) fn begin_read(&mut self, segment: u32) -> ReadFrom {
        let tick = self.next_tick();
        match &mut self.segs[segment as usize] {
            Seg::Evicted { seq32, writer, len } => {
                ReadFrom::Bucket((segment, *seq32, *writer), *len)
            }
            Seg::Local(local) => {
                local.readers += 1;
                local.last_use = tick;
                ReadFrom::Local
            }
            Seg::Empty => ReadFrom::Local,
        }
    }

    /// A local read of `segment` ended; true if it was the last one of a
    /// segment someone has claimed (an eviction waits for it).
    pub(super) fn end_read(&mut self, segment: u32) -> bool {
        let mut drained = false;
        if let Seg::Local(local) = &mut self.segs[segment as usize] {
            // A renewal under a read (the engine never does that) starts
            // the count again.
            local.readers = local.readers.saturating_sub(1);
            drained = local.readers == 0;
        }
        drained && self.is_busy(segment)
    }

    /// The engine sealed `segment` at `fill_bytes`.
    pub(super) fn seal(&mut self, segment: u32, fill_bytes: u64) {
        if let Seg::Local(local) = &mut self.segs[segment as usize] {
            local.sealed = Some(fill_bytes);
        }
    }

    /// Reads of `segment` go to `len` bytes of its incarnation in the
    /// bucket from now on; its local bytes are dropped next, under the
    /// evictor's claim.
    pub(super) fn evict(&mut self, segment: u32, seq32: u32, writer: u64, len: u64) {
        assert!(self.is_busy(segment), "segment {segment} evicted unclaimed");
        let Seg::Local(local) = self.get(segment) else {
            panic!("segment {segment} evicted while not local");
        };
        assert_eq!(
            local.seq32,
            Some(seq32),
            "segment {segment} evicted as another incarnation"
        );
        assert_eq!(
            local.writer, writer,
            "segment {segment} evicted as another writer's"
        );
        assert_eq!(local.readers, 0, "segment {segment} evicted under a read");
        let sealed = local.sealed.expect("only a sealed segment is evicted");
        assert!(
            len >= sealed,
            "segment {segment} evicted with {len} bytes in the bucket, sealed at {sealed}"
        );
        self.resident_bytes -= local.footprint;
        self.segs[segment as usize] = Seg::Evicted { seq32, writer, len };
        self.check_resident();
    }

    /// Evicted `segment` is local again, its `len` bytes written back
    /// (`footprint` bytes, whole pages) under the claim of its writer-back.
    pub(super) fn written_back(&mut self, segment: u32, footprint: u64) {
        assert!(
            self.is_busy(segment),
            "segment {segment} written back unclaimed"
        );
        let Some(((_, seq32, writer), len)) = self.evicted(segment) else {
            panic!("segment {segment} written back while not evicted");
        };
        assert!(
            len <= footprint,
            "segment {segment}'s {len} bytes written in {footprint}"
        );
        let last_use = self.next_tick();
        self.segs[segment as usize] = Seg::Local(LocalSeg {
            seq32: Some(seq32),
            writer,
            written: len,
            sealed: Some(len),
            footprint,
            readers: 0,
            last_use,
        });
        self.resident_bytes += footprint;
        self.check_resident();
    }

    /// `segment` is ready for a new incarnation of `writer`, under its
    /// renewer's claim: local, nothing written, its old bytes' footprint kept.
    pub(super) fn renewed(&mut self, segment: u32, writer: u64) {
        assert!(self.is_busy(segment), "segment {segment} renewed unclaimed");
        let footprint = match self.get(segment) {
            Seg::Local(local) => local.footprint,
            _ => 0,
        };
        let last_use = self.next_tick();
        self.segs[segment as usize] = Seg::Local(LocalSeg {
            seq32: None,
            writer,
            written: 0,
            sealed: None,
            footprint,
            readers: 0,
            last_use,
        });
        self.check_resident();
    }

    /// `segment` was erased under its renewer's claim: it holds nothing.
    pub(super) fn erased(&mut self, segment: u32) {
        assert!(self.is_busy(segment), "segment {segment} erased unclaimed");
        self.set_empty(segment);
    }

    fn set_empty(&mut self, segment: u32) {
        if let Seg::Local(local) = self.get(segment) {
            self.resident_bytes -= local.footprint;
        }
        self.segs[segment as usize] = Seg::Empty;
        self.check_resident();
    }

    /// The engine freed `segment`: its incarnation means nothing any more.
    pub(super) fn free(&mut self, segment: u32) -> Freed {
        let busy = self.is_busy(segment);
        match &mut self.segs[segment as usize] {
            Seg::Local(local) if busy || local.readers > 0 => {
                local.seq32 = None;
                local.written = 0;
                local.sealed = None;
                Freed::Kept
            }
            Seg::Local(_) => {
                self.set_empty(segment);
                self.claim(segment);
                Freed::Drop
            }
            Seg::Evicted { .. } => {
                self.set_empty(segment);
                Freed::Unrecord
            }
            Seg::Empty => Freed::Nothing,
        }
    }

    /// Tests (of the lock checks): makes `segment` evicted as if it had been.
    #[cfg(all(test, any(debug_assertions, zdisk_lock_checks)))]
    pub(super) fn force_evicted(&mut self, segment: u32, seq32: u32, writer: u64, len: u64) {
        self.set_empty(segment);
        self.segs[segment as usize] = Seg::Evicted { seq32, writer, len };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three segments: 0 found sealed at 4096 (incarnation 7), 1 and 2 empty.
    fn table() -> SegmentTable {
        SegmentTable::new(vec![
            Seg::Local(LocalSeg::found(7, 1, 4096, 8192)),
            Seg::Empty,
            Seg::Empty,
        ])
    }

    #[test]
    fn resident_bytes_follow_every_change() {
        let mut table = table();
        assert_eq!(table.resident_bytes(), 8192);
        table.claim(1);
        table.renewed(1, 1);
        table.release(1);
        table.note_write(1, Some(Some(9)), 12288);
        assert_eq!(table.resident_bytes(), 8192 + 12288);
        table.claim(0);
        table.evict(0, 7, 1, 4096);
        assert_eq!(table.resident_bytes(), 12288);
        table.written_back(0, 4096);
        table.release(0);
        assert_eq!(table.resident_bytes(), 12288 + 4096);
        assert_eq!(table.free(1), Freed::Drop);
        assert!(table.is_busy(1), "a dropped segment stays claimed");
        assert_eq!(table.resident_bytes(), 4096);
    }

    #[test]
    fn a_segment_under_a_read_keeps_its_bytes_when_freed() {
        let mut table = table();
        assert!(matches!(table.begin_read(0), ReadFrom::Local));
        assert_eq!(table.readers(0), 1);
        assert_eq!(table.free(0), Freed::Kept);
        assert!(!table.holds_local(0, 7), "the incarnation is forgotten");
        assert_eq!(table.resident_bytes(), 8192, "the bytes stay");
        assert!(!table.end_read(0), "nobody has claimed it");
        assert_eq!(table.readers(0), 0);
    }

    #[test]
    fn the_last_read_of_a_claimed_segment_says_so() {
        let mut table = table();
        table.begin_read(0);
        table.begin_read(0);
        table.claim(0);
        assert!(!table.end_read(0));
        assert!(table.end_read(0), "the second read was the last");
    }

    #[test]
    fn an_evicted_segment_is_read_from_the_bucket() {
        let mut table = table();
        table.claim(0);
        table.evict(0, 7, 1, 5000);
        table.release(0);
        assert!(matches!(
            table.begin_read(0),
            ReadFrom::Bucket((0, 7, 1), 5000)
        ));
        assert!(table.is_evicted_as(0, 7, 1));
        assert_eq!(table.entries().len(), 1, "an evicted segment is listed");
        assert_eq!(table.free(0), Freed::Unrecord);
        assert!(table.entries().is_empty());
    }

    #[test]
    #[should_panic(expected = "claimed twice")]
    fn a_segment_is_claimed_once() {
        let mut table = table();
        table.claim(2);
        table.claim(2);
    }

    #[test]
    #[should_panic(expected = "evicted under a read")]
    fn a_segment_under_a_read_is_not_evicted() {
        let mut table = table();
        table.begin_read(0);
        table.claim(0);
        table.evict(0, 7, 1, 4096);
    }

    #[test]
    #[should_panic(expected = "sealed at 4096")]
    fn a_segment_is_not_evicted_before_its_sealed_bytes_are_in_the_bucket() {
        let mut table = table();
        table.claim(0);
        table.evict(0, 7, 1, 4095);
    }

    #[test]
    #[should_panic(expected = "evicted unclaimed")]
    fn an_eviction_needs_the_claim() {
        table().evict(0, 7, 1, 4096);
    }
}
