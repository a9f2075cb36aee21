//! The medium the engine stores its log on.
//!
//! The engine sees storage only through [`Media`], shaped like flash: a set
//! of equal segments (erase units) written sequentially in whole pages, plus
//! two small metadata slots for the superblock and checkpoint root. Keeping
//! to flash's rules on every medium means the same engine runs on a file,
//! in RAM under crash simulation, and on emulated NAND.
//!
//! Contract the engine keeps (checked by [`PageDiscipline`]):
//! - a segment is erased before it is written;
//! - after an erase, its pages are written in increasing order, each once;
//! - `write_pages` gets whole pages only.
//!
//! A medium adds to this core through *capabilities*, each a small trait
//! the engine asks for where it needs it ([`Media::staging`],
//! [`Media::drive`], [`Media::segment_events`], [`Media::admission`]): a
//! file or RAM offers staging, an emulated drive its timing model, the
//! object-store tier segment events and admission.
//!
//! A medium that is not flash (a file, a block device, RAM overwriting in
//! place) may offer *staging* ([`Staging`]): segments are
//! then written in 512-byte sectors, still in order and each once
//! (`write_sectors`), and [`STAGING_SLOTS`] small staging slots keep what
//! a flush could not write in place, the last partial sector of an open
//! segment, without padding it. What goes into a staging slot is the
//! engine's business (`volume/staging.rs`); the medium only stores bytes.
//!
//! Contract the engine relies on:
//! - a read returns the last bytes written, durable or not;
//! - after `sync` returns, every earlier write and erase survives power loss;
//! - a write or erase not yet synced may be lost, partly applied, or torn at
//!   512-byte granularity; nothing else changes (see docs/semantics.md);
//! - a metadata slot write is atomic only in the sense that a torn one fails
//!   its checksum.

mod checked;
mod file;
mod mem;

pub use checked::LockChecked;

pub use file::{
    file_geometry, lock_file, set_mapped_reads, FileMedia, FILE_DATA_OFFSET, FILE_META_SLOT_SIZE,
    FILE_ROOT_MAX_BYTES, FILE_STAGING_AREA_BYTES,
};
pub use mem::{CrashConfig, MemMedia};

/// The unit in which a medium with staging writes segments, and in which
/// any unsynced write may tear.
pub const SECTOR_BYTES: usize = 512;

/// The bytes every metadata slot of a zdisk image opens with (see
/// docs/format.md); here, so that a medium can tell damaged metadata from
/// a file that never was an image.
pub const META_MAGIC: &[u8; 8] = b"ZDISKMT1";

/// Staging slots of a medium with staging: two per writer stream, so that a
/// flush can always write one while the other keeps what the last
/// completed flush covered.
pub const STAGING_SLOTS: usize = 4;
/// Bytes the engine may write to one staging slot (a header and less than
/// a sector of data); a medium with staging keeps at least this many.
pub const STAGING_SLOT_BYTES: usize = 2 * SECTOR_BYTES;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::units::{PageIndex, SegmentId};

/// Shape of a medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaGeometry {
    /// The unit of writing.
    pub page_size_bytes: u32,
    /// The unit of erasing and of log writing; a multiple of the page size.
    pub segment_size_bytes: u64,
    pub segment_count: u32,
    /// Largest metadata slot payload.
    pub meta_slot_size_bytes: u32,
}

impl MediaGeometry {
    pub fn pages_per_segment(&self) -> u32 {
        (self.segment_size_bytes / self.page_size_bytes as u64) as u32
    }

    /// Bytes available for the log.
    pub fn log_capacity_bytes(&self) -> u64 {
        self.segment_size_bytes * self.segment_count as u64
    }

    /// Checks that the geometry is one the engine can use.
    pub fn validate(&self) -> Result<()> {
        let page = self.page_size_bytes as u64;
        if !page.is_multiple_of(16) || !(512..=1 << 20).contains(&page) {
            return Err(Error::InvalidArgument(format!(
                "page size {page} must be a multiple of 16 between 512 B and 1 MiB"
            )));
        }
        if self.segment_size_bytes < 8 * 4096 || !self.segment_size_bytes.is_multiple_of(page) {
            return Err(Error::InvalidArgument(format!(
                "segment size {} must be at least 32 KiB and a multiple of the page size {page}",
                self.segment_size_bytes
            )));
        }
        if self.segment_size_bytes > 1 << 30 {
            return Err(Error::InvalidArgument(format!(
                "segment size {} exceeds 1 GiB",
                self.segment_size_bytes
            )));
        }
        if self.segment_count >= 1 << 24 {
            return Err(Error::InvalidArgument(format!(
                "{} segments of {} bytes: at most 16 Mi segments are supported; use larger segments",
                self.segment_count, self.segment_size_bytes
            )));
        }
        if self.segment_count < 8 {
            return Err(Error::InvalidArgument(format!(
                "the medium holds only {} segments of {} bytes; at least 8 are needed",
                self.segment_count, self.segment_size_bytes
            )));
        }
        if self.meta_slot_size_bytes < 4096 {
            return Err(Error::InvalidArgument(
                "metadata slots must hold at least 4 KiB".into(),
            ));
        }
        Ok(())
    }
}

/// A place to keep a volume's log. See the module documentation for the contract.
pub trait Media: Send + Sync {
    fn geometry(&self) -> MediaGeometry;

    /// Total bytes of the medium, metadata area included.
    fn physical_size_bytes(&self) -> u64;

    /// Writes whole pages starting at `first_page` of `segment`.
    fn write_pages(&self, segment: SegmentId, first_page: PageIndex, data: &[u8]) -> Result<()>;

    /// Reads `buf.len()` bytes at `offset_bytes` within `segment`.
    fn read(&self, segment: SegmentId, offset_bytes: u64, buf: &mut [u8]) -> Result<()>;

    /// The `len` bytes at `offset_bytes` within `segment`, lent from a
    /// read-only mapping of the medium instead of copied; `Ok(None)` if the
    /// medium has no mapping (then `read` them). They are the bytes `read`
    /// would return, with one difference: they are not a copy. Should the
    /// segment be readied for a new incarnation and written while they are
    /// in use, they change under the borrower, which must therefore check
    /// afterwards that the segment's incarnation did not change (as the
    /// host read path does) before trusting what it made of them.
    fn mapped(&self, segment: SegmentId, offset_bytes: u64, len: usize) -> Result<Option<&[u8]>> {
        let _ = (segment, offset_bytes, len);
        Ok(None)
    }

    /// Reads several ranges, as one batch: a medium with internal
    /// parallelism (an SSD's dies) serves them concurrently. Returns one
    /// result per range. The default reads them one after another.
    fn read_batch(&self, reads: &mut [ReadRange<'_>]) -> Vec<Result<()>> {
        reads
            .iter_mut()
            .map(|r| self.read(r.segment, r.offset_bytes, r.buf))
            .collect()
    }

    /// Erases a segment so that it can be written again from page 0, and
    /// its old contents are gone (durably after `sync`).
    fn erase_segment(&self, segment: SegmentId) -> Result<()>;

    /// Readies a free segment for a new incarnation, written from page 0.
    /// The default erases it, as flash must be. A medium that overwrites in
    /// place need not: every record names its segment incarnation, so the
    /// old incarnation's bytes beyond the new one's are never taken for
    /// its records.
    fn prepare_segment(&self, segment: SegmentId) -> Result<()> {
        self.erase_segment(segment)
    }

    /// Makes every earlier write and erase durable.
    fn sync(&self) -> Result<()>;

    /// Replaces the contents of metadata slot 0 or 1 (durable after `sync`).
    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> Result<()>;

    /// Reads metadata slot 0 or 1 (its whole capacity; trailing bytes are junk).
    fn read_meta_slot(&self, slot: usize) -> Result<Vec<u8>>;

    /// A short human description, e.g. "file demo.zdisk".
    fn describe(&self) -> String;

    /// The volume was closed cleanly (its clean root is durable): a medium
    /// with work in the background finishes it before returning.
    fn close(&self) -> Result<()> {
        Ok(())
    }

    /// Counters of the medium's own, reported with the volume's stats
    /// (name, help, value); names are unique and snake_case.
    fn media_stats(&self) -> Vec<MediaStat> {
        Vec::new()
    }

    // --- Capabilities: what a medium adds to the core above. The engine
    // asks for one where it needs it; the defaults have none.

    /// Sector writes and staging slots, on a medium that is not flash.
    fn staging(&self) -> Option<&dyn Staging> {
        None
    }

    /// A drive's timing model and firmware, on an emulated drive.
    fn drive(&self) -> Option<&dyn DriveModel> {
        None
    }

    /// The fate of segment incarnations, on a medium that keeps segments
    /// elsewhere too (an object-store tier).
    fn segment_events(&self) -> Option<&dyn SegmentEvents> {
        None
    }

    /// Backpressure on host writes, on a medium that can fall behind them.
    fn admission(&self) -> Option<&dyn Admission> {
        None
    }
}

impl dyn Media + '_ {
    /// The staging capability, for a call the engine makes only on a
    /// medium that has it; an error otherwise.
    pub fn staging_required(&self) -> Result<&dyn Staging> {
        self.staging()
            .ok_or_else(|| Error::Unsupported(format!("{} has no staging", self.describe())))
    }

    /// The drive capability, likewise.
    pub fn drive_required(&self) -> Result<&dyn DriveModel> {
        self.drive()
            .ok_or_else(|| Error::Unsupported(format!("{} is not a drive model", self.describe())))
    }

    /// True if the medium is a drive whose write buffer survives power loss.
    pub fn has_power_loss_protection(&self) -> bool {
        self.drive()
            .is_some_and(|drive| drive.power_loss_protection())
    }

    /// The host moves `bytes` of logical data: a medium that can fall
    /// behind admits a write first, and a drive charges the transfer.
    pub fn host_transfer(&self, direction: HostDirection, bytes: u64) {
        if let (HostDirection::Write, 1.., Some(admission)) = (direction, bytes, self.admission()) {
            admission.admit_write(bytes);
        }
        if let Some(drive) = self.drive() {
            drive.host_transfer(direction, bytes);
        }
    }

    /// Tells a medium that keeps segments elsewhere that `segment` was sealed.
    pub fn segment_sealed(&self, segment: SegmentId, fill_bytes: u64) {
        if let Some(events) = self.segment_events() {
            events.segment_sealed(segment, fill_bytes);
        }
    }

    /// Tells a medium that keeps segments elsewhere that `segment` was freed.
    pub fn segment_freed(&self, segment: SegmentId) {
        if let Some(events) = self.segment_events() {
            events.segment_freed(segment);
        }
    }
}

/// The staging capability ([`Media::staging`]): segments are written in
/// [`SECTOR_BYTES`] sectors, still in order and each once, and
/// [`STAGING_SLOTS`] slots of [`STAGING_SLOT_BYTES`] keep what a flush could
/// not write in place, so that a flush need not pad the partial page.
pub trait Staging: Send + Sync {
    /// Writes whole sectors at `offset_bytes` (a sector multiple) of
    /// `segment`, continuing where the segment's last write ended, page
    /// boundaries or not.
    fn write_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()>;

    /// Writes whole sectors of a segment nobody is writing, out of the
    /// write order: recovery puts back what a crash left only in a staging
    /// slot.
    fn restore_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()>;

    /// Replaces the beginning of staging slot `slot` (below [`STAGING_SLOTS`])
    /// with `data`, whole sectors of at most [`STAGING_SLOT_BYTES`]
    /// (durable after `sync`; until then it may be lost or torn like any write).
    fn write_staging(&self, slot: usize, data: &[u8]) -> Result<()>;

    /// Reads the first [`STAGING_SLOT_BYTES`] of staging slot `slot`.
    fn read_staging(&self, slot: usize) -> Result<Vec<u8>>;
}

/// The drive capability ([`Media::drive`]): a model of a whole drive
/// (emulated NAND) that charges time for what the engine does and keeps
/// firmware state the engine's choices depend on.
pub trait DriveModel: Send + Sync {
    /// The host moved `bytes` of logical data (before compression) in or
    /// out, or sent a command without data (`bytes` 0). The drive charges
    /// its host link and compression engine, and may sleep for them.
    fn host_transfer(&self, direction: HostDirection, bytes: u64);

    /// True if the drive's write buffer survives power loss (PLP), so a
    /// flush need not pad and program a partial page.
    fn power_loss_protection(&self) -> bool;

    /// With power-loss protection: keeps `data`, the beginning of page
    /// `page` of `segment`, durable without programming the page. Reads
    /// return it until a `write_pages` of that page replaces it, and an
    /// erase of the segment drops it. Only called when
    /// [`DriveModel::power_loss_protection`] is true.
    fn stage_partial_page(&self, segment: SegmentId, page: PageIndex, data: &[u8]) -> Result<()>;

    /// The cleaner reclaimed a segment of `segment_bytes`, relocating
    /// `relocated_bytes`: the drive charges its recycling engine.
    fn segment_recycled(&self, segment_bytes: u64, relocated_bytes: u64);

    /// False while a rate-capped recycling engine is still busy; the
    /// background cleaner then waits (foreground cleaning does not).
    fn recycling_ready(&self) -> bool;

    /// Erase counts.
    fn wear(&self) -> crate::stats::Wear;
}

/// The segment-events capability ([`Media::segment_events`]): the engine
/// tells a medium that keeps segments elsewhere too when an incarnation is
/// complete and when no root needs it any more.
pub trait SegmentEvents: Send + Sync {
    /// The engine sealed this incarnation of `segment` at `fill_bytes`: it
    /// writes no more to it until a later `prepare_segment` or
    /// `erase_segment`. Called by the engine's log writer in order with the
    /// segment's writes, so after its last pages up to `fill_bytes`.
    fn segment_sealed(&self, segment: SegmentId, fill_bytes: u64);

    /// The engine freed `segment`: no root it may recover from needs the
    /// incarnation the segment held.
    fn segment_freed(&self, segment: SegmentId);
}

/// The admission capability ([`Media::admission`]): a medium that can fall
/// behind the host (a tier uploading to a slower bucket) holds host writes
/// back until it has room for them.
pub trait Admission: Send + Sync {
    /// The host is about to write `bytes` of logical data: returns when
    /// the medium can take them. Never called with a state lock held.
    fn admit_write(&self, bytes: u64);
}

/// One counter of [`Media::media_stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaStat {
    pub name: &'static str,
    pub help: &'static str,
    pub value: u64,
}

/// One range of a [`Media::read_batch`].
#[derive(Debug)]
pub struct ReadRange<'a> {
    pub segment: SegmentId,
    pub offset_bytes: u64,
    pub buf: &'a mut [u8],
}

/// Direction of a host transfer, for [`DriveModel::host_transfer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostDirection {
    /// Host to drive (WRITE).
    Write,
    /// Drive to host (READ).
    Read,
}

/// Enforces flash write rules: erase before write, pages in order, each
/// once; on a medium with staging, sectors in order, each once.
/// A violation is an engine bug, so it panics.
pub struct PageDiscipline {
    /// Next byte offset that may be written per segment; `UNKNOWN` until erased.
    next_offset: Vec<AtomicU64>,
    segment_size_bytes: u64,
    page_size_bytes: u64,
}

const UNKNOWN: u64 = u64::MAX;

impl PageDiscipline {
    pub fn new(geometry: &MediaGeometry) -> Self {
        PageDiscipline {
            next_offset: (0..geometry.segment_count)
                .map(|_| AtomicU64::new(UNKNOWN))
                .collect(),
            segment_size_bytes: geometry.segment_size_bytes,
            page_size_bytes: geometry.page_size_bytes as u64,
        }
    }

    pub fn on_erase(&self, segment: SegmentId) {
        self.next_offset[segment.index()].store(0, Ordering::Release);
    }

    /// Checks a `write_pages` call and advances the segment's write pointer.
    pub fn on_write(&self, segment: SegmentId, first_page: PageIndex, len_bytes: usize) {
        assert!(
            len_bytes > 0 && (len_bytes as u64).is_multiple_of(self.page_size_bytes),
            "write of {len_bytes} bytes to segment {segment} is not whole pages"
        );
        let offset = first_page.0 as u64 * self.page_size_bytes;
        self.advance(segment, offset, len_bytes as u64);
    }

    /// Checks a `write_sectors` call and advances the segment's write pointer.
    pub fn on_write_sectors(&self, segment: SegmentId, offset_bytes: u64, len_bytes: usize) {
        let sector = SECTOR_BYTES as u64;
        assert!(
            len_bytes > 0
                && (len_bytes as u64).is_multiple_of(sector)
                && offset_bytes.is_multiple_of(sector),
            "write of {len_bytes} bytes at offset {offset_bytes} of segment {segment} \
             is not whole sectors"
        );
        self.advance(segment, offset_bytes, len_bytes as u64);
    }

    fn advance(&self, segment: SegmentId, offset: u64, len: u64) {
        assert!(
            segment.index() < self.next_offset.len(),
            "write to segment {segment} beyond the medium"
        );
        let expected = self.next_offset[segment.index()].load(Ordering::Acquire);
        assert_ne!(
            expected, UNKNOWN,
            "segment {segment} written without an erase"
        );
        assert_eq!(
            offset, expected,
            "segment {segment}: offset {offset} written out of order (next writable offset is {expected})"
        );
        assert!(
            offset + len <= self.segment_size_bytes,
            "segment {segment}: write of {len} bytes at offset {offset} runs past the segment end"
        );
        self.next_offset[segment.index()].store(offset + len, Ordering::Release);
    }
}

pub(crate) fn check_read_range(
    geometry: &MediaGeometry,
    segment: SegmentId,
    offset: u64,
    len: usize,
) -> Result<()> {
    if segment.0 >= geometry.segment_count || offset + len as u64 > geometry.segment_size_bytes {
        return Err(Error::CorruptImage(format!(
            "read of {len} bytes at segment {segment} offset {offset} is outside the medium"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn geometry() -> MediaGeometry {
        MediaGeometry {
            page_size_bytes: 4096,
            segment_size_bytes: 64 * 1024,
            segment_count: 8,
            meta_slot_size_bytes: 4096,
        }
    }

    /// A medium that only admits writes and hears of segments, and records
    /// both; the test never stores anything on it.
    struct Watching {
        heard: Mutex<Vec<String>>,
    }

    impl Media for Watching {
        fn geometry(&self) -> MediaGeometry {
            geometry()
        }
        fn physical_size_bytes(&self) -> u64 {
            0
        }
        fn write_pages(&self, _: SegmentId, _: PageIndex, _: &[u8]) -> Result<()> {
            unreachable!("this test stores nothing")
        }
        fn read(&self, _: SegmentId, _: u64, _: &mut [u8]) -> Result<()> {
            unreachable!("this test stores nothing")
        }
        fn erase_segment(&self, _: SegmentId) -> Result<()> {
            unreachable!("this test stores nothing")
        }
        fn sync(&self) -> Result<()> {
            unreachable!("this test stores nothing")
        }
        fn write_meta_slot(&self, _: usize, _: &[u8]) -> Result<()> {
            unreachable!("this test stores nothing")
        }
        fn read_meta_slot(&self, _: usize) -> Result<Vec<u8>> {
            unreachable!("this test stores nothing")
        }
        fn describe(&self) -> String {
            "a watching medium".into()
        }
        fn segment_events(&self) -> Option<&dyn SegmentEvents> {
            Some(self)
        }
        fn admission(&self) -> Option<&dyn Admission> {
            Some(self)
        }
    }

    impl SegmentEvents for Watching {
        fn segment_sealed(&self, segment: SegmentId, fill_bytes: u64) {
            let heard = format!("sealed {segment} at {fill_bytes}");
            self.heard.lock().unwrap().push(heard);
        }
        fn segment_freed(&self, segment: SegmentId) {
            self.heard.lock().unwrap().push(format!("freed {segment}"));
        }
    }

    impl Admission for Watching {
        fn admit_write(&self, bytes: u64) {
            self.heard.lock().unwrap().push(format!("admit {bytes}"));
        }
    }

    #[test]
    fn a_wrapped_medium_offers_exactly_the_capabilities_of_the_one_inside() {
        let flash: Arc<dyn Media> = Arc::new(MemMedia::new(geometry()).unwrap());
        let file_like: Arc<dyn Media> =
            Arc::new(MemMedia::new(geometry()).unwrap().reusing_in_place());
        for (media, staging) in [(flash, false), (file_like, true)] {
            let checked = LockChecked::wrap(media);
            assert_eq!(checked.staging().is_some(), staging);
            assert!(checked.drive().is_none());
            assert!(checked.segment_events().is_none());
            assert!(checked.admission().is_none());
            assert!(!checked.has_power_loss_protection());
        }
        let flash: Arc<dyn Media> = Arc::new(MemMedia::new(geometry()).unwrap());
        let error = flash.staging_required().map(|_| ()).unwrap_err();
        assert!(matches!(error, Error::Unsupported(_)), "{error}");
        assert!(flash.drive_required().is_err());
    }

    #[test]
    fn only_a_host_write_with_data_asks_for_admission_and_events_reach_the_medium() {
        let watching = Arc::new(Watching {
            heard: Mutex::new(Vec::new()),
        });
        let media: Arc<dyn Media> = LockChecked::wrap(watching.clone());
        media.host_transfer(HostDirection::Read, 4096);
        media.host_transfer(HostDirection::Write, 0);
        media.host_transfer(HostDirection::Write, 8192);
        media.segment_sealed(SegmentId(3), 512);
        media.segment_freed(SegmentId(3));
        assert_eq!(
            *watching.heard.lock().unwrap(),
            ["admit 8192", "sealed 3 at 512", "freed 3"]
        );
    }
}
