//! The tier's state as its `.tier` file is to hold it (see `sidecar.rs`
//! for the file and why its eviction records must be durable before a
//! segment's bytes are dropped). The record changes under the state lock;
//! `Shared::store_sidecar` writes a snapshot of it without that lock.
//!
//! Invariants: a segment is recorded evicted only while it has no record
//! (every way out of `Evicted` removes all of a segment's records), a
//! segment that is evicted and not claimed has the record of its
//! incarnation (checked by `TierState::check`), and the bucket root only
//! moves to the root object published next.

use crate::sidecar::Sidecar;

/// One eviction record: (segment, seq32, writer, bytes in the bucket).
pub(super) type Eviction = (u32, u32, u64, u64);

pub(super) struct Record {
    sidecar: Sidecar,
    /// The file lags the record by entries nothing depends on yet.
    dirty: bool,
}

impl Record {
    pub(super) fn new(sidecar: Sidecar) -> Record {
        Record {
            sidecar,
            dirty: false,
        }
    }

    pub(super) fn sidecar(&self) -> &Sidecar {
        &self.sidecar
    }

    pub(super) fn bucket_root(&self) -> u64 {
        self.sidecar.bucket_root
    }

    pub(super) fn cache_bytes(&self) -> u64 {
        self.sidecar.cache_bytes
    }

    pub(super) fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// The file must be written again before anything depends on it.
    pub(super) fn mark_dirty(&mut self) {
        self.dirty = true;
    }

    /// What the file is to hold now; it is current once that is stored.
    pub(super) fn snapshot(&mut self) -> Sidecar {
        self.dirty = false;
        self.sidecar.clone()
    }

    /// The eviction record of `segment`, if it has one.
    pub(super) fn eviction(&self, segment: u32) -> Option<Eviction> {
        self.sidecar
            .evicted
            .iter()
            .find(|entry| entry.0 == segment)
            .copied()
    }

    /// Records that `segment` is being evicted (stored before its bytes go).
    pub(super) fn record_eviction(&mut self, record: Eviction) {
        assert!(
            self.eviction(record.0).is_none(),
            "segment {} recorded evicted twice",
            record.0
        );
        self.sidecar.evicted.push(record);
    }

    /// An eviction that did not happen: its record goes (lazily).
    pub(super) fn undo_eviction(&mut self, record: Eviction) {
        let before = self.sidecar.evicted.len();
        self.sidecar.evicted.retain(|entry| *entry != record);
        assert_eq!(
            self.sidecar.evicted.len() + 1,
            before,
            "undone eviction was recorded"
        );
        self.dirty = true;
    }

    /// Removes `segment`'s eviction record; true if it had one.
    pub(super) fn forget_eviction(&mut self, segment: u32) -> bool {
        let before = self.sidecar.evicted.len();
        self.sidecar.evicted.retain(|entry| entry.0 != segment);
        self.sidecar.evicted.len() < before
    }

    /// `segment` holds `seq32` of `writer` locally again: it is not
    /// evicted, and if another writer's object holds it, that is noted
    /// (a later open must not upload it as this image's).
    pub(super) fn written_back(&mut self, segment: u32, seq32: u32, writer: u64, own: bool) {
        self.forget_eviction(segment);
        self.sidecar.written_back.retain(|entry| entry.0 != segment);
        if !own {
            self.sidecar.written_back.push((segment, seq32, writer));
        }
    }

    /// Root object `number`, the one after the current, is published.
    pub(super) fn set_bucket_root(&mut self, number: u64) {
        assert_eq!(
            number,
            self.sidecar.bucket_root + 1,
            "the root object published is the next one"
        );
        self.sidecar.bucket_root = number;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        Record::new(Sidecar::new("s3://b/p", [1; 16], 4, 1 << 20))
    }

    #[test]
    fn an_undone_eviction_leaves_the_file_to_be_written() {
        let mut record = record();
        record.record_eviction((3, 9, 1, 4096));
        assert_eq!(record.eviction(3), Some((3, 9, 1, 4096)));
        assert!(!record.is_dirty(), "a new record is stored by its evictor");
        record.undo_eviction((3, 9, 1, 4096));
        assert_eq!(record.eviction(3), None);
        assert!(record.is_dirty());
        assert!(!record.snapshot().evicted.contains(&(3, 9, 1, 4096)));
        assert!(!record.is_dirty(), "a snapshot is what the file is to hold");
    }

    #[test]
    fn a_segment_written_back_from_another_writer_is_noted() {
        let mut record = record();
        record.record_eviction((3, 9, 2, 4096));
        record.written_back(3, 9, 2, false);
        assert_eq!(record.eviction(3), None);
        assert_eq!(record.sidecar().written_back, vec![(3, 9, 2)]);
        record.written_back(3, 10, 1, true);
        assert!(
            record.sidecar().written_back.is_empty(),
            "its own bytes need no note"
        );
    }

    #[test]
    #[should_panic(expected = "recorded evicted twice")]
    fn a_segment_is_recorded_evicted_once() {
        let mut record = record();
        record.record_eviction((3, 9, 1, 4096));
        record.record_eviction((3, 9, 1, 8192));
    }

    #[test]
    #[should_panic(expected = "the next one")]
    fn the_bucket_root_moves_one_at_a_time() {
        let mut record = record();
        record.set_bucket_root(5);
        assert_eq!(record.bucket_root(), 5);
        record.set_bucket_root(7);
    }
}
