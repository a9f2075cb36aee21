//! A medium wrapper that proves, in debug builds, that no medium I/O runs
//! under an engine lock a reader needs (see `held.rs`).
//!
//! [`Volume::open`](crate::Volume::open) wraps its medium in one when
//! debug assertions are on, so every test, the crash simulator and the
//! fuzz targets check it. Calls that only ask the medium a question
//! (geometry, capabilities, counters) are let through; everything that
//! reads, writes, syncs, erases or tells the medium of a segment's fate
//! panics if a marked lock is held.

use std::sync::Arc;

use crate::error::Result;
use crate::held::assert_none_held;
use crate::units::{PageIndex, SegmentId};

use super::{
    Admission, DriveModel, HostDirection, Media, MediaGeometry, MediaStat, ReadRange,
    SegmentEvents, Staging,
};

/// `inner`, with every I/O call checked against the locks this thread holds.
pub struct LockChecked {
    inner: Arc<dyn Media>,
}

impl LockChecked {
    /// `inner` wrapped in debug builds (and with `zdisk_lock_checks`); `inner`
    /// itself in release builds.
    pub fn wrap(inner: Arc<dyn Media>) -> Arc<dyn Media> {
        if cfg!(any(debug_assertions, zdisk_lock_checks)) {
            Arc::new(LockChecked { inner })
        } else {
            inner
        }
    }
}

impl Media for LockChecked {
    fn geometry(&self) -> MediaGeometry {
        self.inner.geometry()
    }

    fn physical_size_bytes(&self) -> u64 {
        self.inner.physical_size_bytes()
    }

    fn write_pages(&self, segment: SegmentId, first_page: PageIndex, data: &[u8]) -> Result<()> {
        assert_none_held("write_pages");
        self.inner.write_pages(segment, first_page, data)
    }

    fn read(&self, segment: SegmentId, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        assert_none_held("a medium read");
        self.inner.read(segment, offset_bytes, buf)
    }

    fn mapped(&self, segment: SegmentId, offset_bytes: u64, len: usize) -> Result<Option<&[u8]>> {
        assert_none_held("a mapped read");
        self.inner.mapped(segment, offset_bytes, len)
    }

    fn read_batch(&self, reads: &mut [ReadRange<'_>]) -> Vec<Result<()>> {
        assert_none_held("a batch of medium reads");
        self.inner.read_batch(reads)
    }

    fn erase_segment(&self, segment: SegmentId) -> Result<()> {
        assert_none_held("erase_segment");
        self.inner.erase_segment(segment)
    }

    fn prepare_segment(&self, segment: SegmentId) -> Result<()> {
        assert_none_held("prepare_segment");
        self.inner.prepare_segment(segment)
    }

    fn sync(&self) -> Result<()> {
        assert_none_held("a medium sync");
        self.inner.sync()
    }

    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> Result<()> {
        assert_none_held("write_meta_slot");
        self.inner.write_meta_slot(slot, data)
    }

    fn read_meta_slot(&self, slot: usize) -> Result<Vec<u8>> {
        assert_none_held("read_meta_slot");
        self.inner.read_meta_slot(slot)
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn close(&self) -> Result<()> {
        assert_none_held("closing the medium");
        self.inner.close()
    }

    fn media_stats(&self) -> Vec<MediaStat> {
        self.inner.media_stats()
    }
    fn staging(&self) -> Option<&dyn Staging> {
        self.inner.staging().map(|_| self as &dyn Staging)
    }

    fn drive(&self) -> Option<&dyn DriveModel> {
        self.inner.drive().map(|_| self as &dyn DriveModel)
    }

    fn segment_events(&self) -> Option<&dyn SegmentEvents> {
        self.inner
            .segment_events()
            .map(|_| self as &dyn SegmentEvents)
    }

    fn admission(&self) -> Option<&dyn Admission> {
        self.inner.admission().map(|_| self as &dyn Admission)
    }
}

// Each capability below is offered only when `inner` has it (see the
// accessors above), so `expect` cannot fail.

impl Staging for LockChecked {
    fn write_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        assert_none_held("write_sectors");
        self.inner_staging()
            .write_sectors(segment, offset_bytes, data)
    }

    fn restore_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        assert_none_held("restore_sectors");
        self.inner_staging()
            .restore_sectors(segment, offset_bytes, data)
    }

    fn write_staging(&self, slot: usize, data: &[u8]) -> Result<()> {
        assert_none_held("write_staging");
        self.inner_staging().write_staging(slot, data)
    }

    fn read_staging(&self, slot: usize) -> Result<Vec<u8>> {
        assert_none_held("read_staging");
        self.inner_staging().read_staging(slot)
    }
}

impl DriveModel for LockChecked {
    fn host_transfer(&self, direction: HostDirection, bytes: u64) {
        // A drive model may sleep here for its link's time.
        assert_none_held("host_transfer");
        self.inner_drive().host_transfer(direction, bytes)
    }

    fn power_loss_protection(&self) -> bool {
        self.inner_drive().power_loss_protection()
    }

    fn stage_partial_page(&self, segment: SegmentId, page: PageIndex, data: &[u8]) -> Result<()> {
        assert_none_held("stage_partial_page");
        self.inner_drive().stage_partial_page(segment, page, data)
    }

    fn segment_recycled(&self, segment_bytes: u64, relocated_bytes: u64) {
        self.inner_drive()
            .segment_recycled(segment_bytes, relocated_bytes)
    }

    fn recycling_ready(&self) -> bool {
        self.inner_drive().recycling_ready()
    }

    fn wear(&self) -> crate::stats::Wear {
        self.inner_drive().wear()
    }
}

impl SegmentEvents for LockChecked {
    fn segment_sealed(&self, segment: SegmentId, fill_bytes: u64) {
        assert_none_held("segment_sealed");
        self.inner_events().segment_sealed(segment, fill_bytes)
    }

    fn segment_freed(&self, segment: SegmentId) {
        assert_none_held("segment_freed");
        self.inner_events().segment_freed(segment)
    }
}

impl Admission for LockChecked {
    fn admit_write(&self, bytes: u64) {
        // A tier may wait here for its uploads to make room.
        assert_none_held("admit_write");
        self.inner
            .admission()
            .expect("offered only when the medium has it")
            .admit_write(bytes)
    }
}

impl LockChecked {
    fn inner_staging(&self) -> &dyn Staging {
        self.inner
            .staging()
            .expect("offered only when the medium has it")
    }

    fn inner_drive(&self) -> &dyn DriveModel {
        self.inner
            .drive()
            .expect("offered only when the medium has it")
    }

    fn inner_events(&self) -> &dyn SegmentEvents {
        self.inner
            .segment_events()
            .expect("offered only when the medium has it")
    }
}
