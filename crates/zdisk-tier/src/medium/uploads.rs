//! What the bucket holds of each incarnation, and what is still to go
//! there: the upload queue (sealed segments, and what the root being
//! published needs) and the stash of reused segments' old incarnations.
//!
//! Invariants: the bytes the bucket holds of an incarnation only grow
//! (objects are never shortened) until the collector deletes the object;
//! `stash_bytes` is the sum of the stash's bytes plus those reserved for
//! copies under way, and never more than `STASH_MAX_BYTES`; the stash is
//! uploaded in order, its front only ever taken by the uploader.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use super::segments::SegmentTable;
use crate::objects::{Incarnation, SegmentEntry};

/// Most bytes of reused segments' old incarnations held in RAM for upload.
pub(super) const STASH_MAX_BYTES: u64 = 256 << 20;

/// An old incarnation waiting in RAM: (segment, seq32, its bytes).
pub(super) type Stashed = (u32, u32, Bytes);

pub(super) struct Uploads {
    /// Bytes in the bucket per incarnation (segment, seq32, writer).
    in_bucket: HashMap<Incarnation, u64>,
    /// Old incarnations of reused segments waiting for upload.
    stash: VecDeque<Stashed>,
    /// The stash's bytes plus `reserved_bytes`.
    stash_bytes: u64,
    /// Counted for copies to the stash under way, so two cannot both fit.
    reserved_bytes: u64,
}

impl Uploads {
    pub(super) fn new(in_bucket: HashMap<Incarnation, u64>) -> Uploads {
        Uploads {
            in_bucket,
            stash: VecDeque::new(),
            stash_bytes: 0,
            reserved_bytes: 0,
        }
    }

    fn check_stash(&self) {
        let held: u64 = self
            .stash
            .iter()
            .map(|(_, _, bytes)| bytes.len() as u64)
            .sum();
        debug_assert_eq!(
            self.stash_bytes,
            held + self.reserved_bytes,
            "the stash's bytes are counted"
        );
        assert!(
            self.stash_bytes <= STASH_MAX_BYTES,
            "the stash within its bound"
        );
    }

    /// Bytes of the incarnation `key` the bucket holds.
    pub(super) fn there(&self, key: &Incarnation) -> u64 {
        self.in_bucket.get(key).copied().unwrap_or(0)
    }

    /// Every incarnation the bucket holds, with its bytes.
    pub(super) fn in_bucket(&self) -> &HashMap<Incarnation, u64> {
        &self.in_bucket
    }

    /// `len` bytes of `key` landed in the bucket.
    pub(super) fn landed(&mut self, key: Incarnation, len: u64) {
        let there = self.in_bucket.entry(key).or_insert(0);
        *there = (*there).max(len);
    }

    /// The collector deleted `key`'s object.
    pub(super) fn deleted(&mut self, key: &Incarnation) {
        assert!(
            self.in_bucket.remove(key).is_some(),
            "a deleted object was in the bucket"
        );
    }

    /// The first of `entries` the bucket does not hold whole yet.
    pub(super) fn missing<'a>(&self, entries: &'a [SegmentEntry]) -> Option<&'a SegmentEntry> {
        entries
            .iter()
            .find(|entry| self.there(&entry.incarnation()) < entry.len_bytes)
    }

    /// Bytes written locally and not yet in the bucket (the stash's too).
    pub(super) fn lag_bytes(&self, segments: &SegmentTable) -> u64 {
        let mut lag = self.stash_bytes;
        for (key, local) in segments.local_incarnations() {
            lag += local.written.saturating_sub(self.there(&key));
        }
        lag
    }

    /// The next segment of `writer` (this image) to upload: one whose
    /// sealed bytes, or the bytes `needs` says a root being published
    /// lists, are not all in the bucket, and that nobody has claimed.
    /// As (segment, seq32, bytes written).
    pub(super) fn next_upload(
        &self,
        segments: &SegmentTable,
        needs: &HashMap<Incarnation, u64>,
        writer: u64,
    ) -> Option<(u32, u32, u64)> {
        segments.local_incarnations().find_map(|(key, local)| {
            let (segment, seq32, owner) = key;
            if segments.is_busy(segment) || owner != writer {
                return None;
            }
            let sealed_need = local
                .sealed
                .filter(|&fill| local.written >= fill)
                .unwrap_or(0);
            let need = sealed_need.max(needs.get(&key).copied().unwrap_or(0));
            (self.there(&key) < need).then_some((segment, seq32, local.written))
        })
    }

    /// True if uploads to come free room in the cache: something is
    /// stashed, or a sealed segment is not all in the bucket yet.
    pub(super) fn uploads_help(&self, segments: &SegmentTable) -> bool {
        !self.stash.is_empty()
            || segments.local_incarnations().any(|(key, local)| {
                matches!(local.sealed, Some(fill) if local.written >= fill && self.there(&key) < fill)
            })
    }

    pub(super) fn stash_bytes(&self) -> u64 {
        self.stash_bytes
    }

    pub(super) fn stash_is_empty(&self) -> bool {
        self.stash.is_empty()
    }

    /// The stashed incarnations, as `writer`'s.
    pub(super) fn stashed(&self, writer: u64) -> impl Iterator<Item = Incarnation> + '_ {
        self.stash
            .iter()
            .map(move |&(segment, seq32, _)| (segment, seq32, writer))
    }

    /// Reserves room for `len` bytes to be copied to the stash; false if
    /// they would take it past its bound.
    pub(super) fn reserve_stash(&mut self, len: u64) -> bool {
        if self.stash_bytes + len > STASH_MAX_BYTES {
            return false;
        }
        self.stash_bytes += len;
        self.reserved_bytes += len;
        self.check_stash();
        true
    }

    /// A reserved copy is done: `bytes` of `seq32` of `segment` wait for upload.
    pub(super) fn stash(&mut self, segment: u32, seq32: u32, bytes: Bytes) {
        let len = bytes.len() as u64;
        assert!(len <= self.reserved_bytes, "stashed bytes were reserved");
        self.reserved_bytes -= len;
        self.stash.push_back((segment, seq32, bytes));
        self.check_stash();
    }

    /// A reserved copy of `len` bytes failed.
    pub(super) fn unreserve_stash(&mut self, len: u64) {
        assert!(len <= self.reserved_bytes, "unreserved bytes were reserved");
        self.reserved_bytes -= len;
        self.stash_bytes -= len;
        self.check_stash();
    }

    /// The oldest stashed incarnation, to upload next.
    pub(super) fn stash_front(&self) -> Option<Stashed> {
        self.stash.front().cloned()
    }

    /// The stash's front, `segment`'s `seq32`, is in the bucket.
    pub(super) fn stash_uploaded(&mut self, segment: u32, seq32: u32) {
        let (front_segment, front_seq32, bytes) =
            self.stash.pop_front().expect("an uploaded stash entry");
        assert_eq!(
            (front_segment, front_seq32),
            (segment, seq32),
            "the stash's front is what was uploaded"
        );
        self.stash_bytes -= bytes.len() as u64;
        self.check_stash();
    }
}

#[cfg(test)]
mod tests {
    use super::super::segments::{LocalSeg, Seg};
    use super::*;

    const ME: u64 = 1;

    /// Segment 0 sealed at 4096 of ours, 1 written to 8192 unsealed, 2 another writer's.
    fn segments() -> SegmentTable {
        let mut open = LocalSeg::found(5, ME, 8192, 8192);
        open.sealed = None;
        SegmentTable::new(vec![
            Seg::Local(LocalSeg::found(4, ME, 4096, 4096)),
            Seg::Local(open),
            Seg::Local(LocalSeg::found(6, 2, 4096, 4096)),
        ])
    }

    #[test]
    fn sealed_segments_are_uploaded_and_then_not_again() {
        let segments = segments();
        let mut uploads = Uploads::new(HashMap::new());
        let none = HashMap::new();
        assert_eq!(
            uploads.next_upload(&segments, &none, ME),
            Some((0, 4, 4096))
        );
        assert!(uploads.uploads_help(&segments));
        assert_eq!(uploads.lag_bytes(&segments), 4096 + 8192 + 4096);
        uploads.landed((0, 4, ME), 4096);
        assert_eq!(
            uploads.next_upload(&segments, &none, ME),
            None,
            "the open segment waits"
        );
        assert!(
            uploads.uploads_help(&segments),
            "segment 2 is not in the bucket"
        );
        uploads.landed((2, 6, 2), 4096);
        assert!(!uploads.uploads_help(&segments));
        uploads.landed((0, 4, ME), 100);
        assert_eq!(uploads.there(&(0, 4, ME)), 4096, "an object never shrinks");
    }

    #[test]
    fn what_a_root_needs_is_uploaded_unless_claimed() {
        let mut segments = segments();
        let mut uploads = Uploads::new(HashMap::new());
        uploads.landed((0, 4, ME), 4096);
        let needs = HashMap::from([((1, 5, ME), 8192), ((2, 6, 2), 4096)]);
        assert_eq!(
            uploads.next_upload(&segments, &needs, ME),
            Some((1, 5, 8192))
        );
        segments.claim(1);
        assert_eq!(
            uploads.next_upload(&segments, &needs, ME),
            None,
            "not a claimed segment, nor another writer's"
        );
        let entries = segments.entries();
        assert_eq!(
            uploads.missing(&entries).map(|entry| entry.segment),
            Some(1)
        );
    }

    #[test]
    fn the_stash_counts_its_bytes_and_keeps_its_bound() {
        let mut uploads = Uploads::new(HashMap::new());
        assert!(uploads.reserve_stash(STASH_MAX_BYTES - 10));
        assert!(!uploads.reserve_stash(11), "past the bound");
        assert!(uploads.reserve_stash(10));
        uploads.unreserve_stash(10);
        assert_eq!(uploads.stash_bytes(), STASH_MAX_BYTES - 10);
        uploads.unreserve_stash(STASH_MAX_BYTES - 10);
        assert!(uploads.reserve_stash(3));
        uploads.stash(7, 9, Bytes::from_static(b"abc"));
        assert_eq!(uploads.stash_bytes(), 3);
        assert_eq!(uploads.stashed(ME).collect::<Vec<_>>(), vec![(7, 9, ME)]);
        let (segment, seq32, _) = uploads.stash_front().expect("stashed");
        uploads.stash_uploaded(segment, seq32);
        assert_eq!(uploads.stash_bytes(), 0);
        assert!(uploads.stash_is_empty());
    }

    #[test]
    #[should_panic(expected = "were reserved")]
    fn stashed_bytes_must_be_reserved() {
        let mut uploads = Uploads::new(HashMap::new());
        uploads.stash(7, 9, Bytes::from_static(b"abc"));
    }
}
