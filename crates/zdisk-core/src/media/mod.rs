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
//! A medium that is not flash (a file, a block device, RAM overwriting in
//! place) may also offer *staging* ([`Media::has_staging`]): segments are
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

    // --- Staging: for media that are not flash. The defaults have none.

    /// True if the medium writes segments in sectors ([`Media::write_sectors`])
    /// and keeps [`STAGING_SLOTS`] staging slots of [`STAGING_SLOT_BYTES`],
    /// so that a flush need not pad the partial page.
    fn has_staging(&self) -> bool {
        false
    }

    /// Writes whole sectors at `offset_bytes` (a sector multiple) of
    /// `segment`, continuing where the segment's last write ended, page
    /// boundaries or not. Only called when [`Media::has_staging`] is true.
    fn write_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        let _ = (segment, offset_bytes, data);
        Err(Error::Unsupported("this medium has no staging".into()))
    }

    /// Writes whole sectors of a segment nobody is writing, out of the
    /// write order: recovery puts back what a crash left only in a staging
    /// slot. Only called when [`Media::has_staging`] is true.
    fn restore_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        let _ = (segment, offset_bytes, data);
        Err(Error::Unsupported("this medium has no staging".into()))
    }

    /// Replaces the beginning of staging slot `slot` (below [`STAGING_SLOTS`])
    /// with `data`, whole sectors of at most [`STAGING_SLOT_BYTES`]
    /// (durable after `sync`; until then it may be lost or torn like any write).
    fn write_staging(&self, slot: usize, data: &[u8]) -> Result<()> {
        let _ = (slot, data);
        Err(Error::Unsupported("this medium has no staging".into()))
    }

    /// Reads the first [`STAGING_SLOT_BYTES`] of staging slot `slot`.
    fn read_staging(&self, slot: usize) -> Result<Vec<u8>> {
        let _ = slot;
        Err(Error::Unsupported("this medium has no staging".into()))
    }

    // --- Hooks for media that model a whole drive (emulated NAND). The
    // defaults suit a plain file or RAM.

    /// The host moved `bytes` of logical data (before compression) in or
    /// out. A drive model charges its host link and compression engine.
    fn host_transfer(&self, direction: HostDirection, bytes: u64) {
        let _ = (direction, bytes);
    }

    /// True if the medium's write buffer survives power loss (PLP), so a
    /// flush need not pad and program a partial page.
    fn has_power_loss_protection(&self) -> bool {
        false
    }

    /// With power-loss protection: keeps `data`, the beginning of page
    /// `page` of `segment`, durable without programming the page. Reads
    /// return it until a `write_pages` of that page replaces it, and an
    /// erase of the segment drops it. Only called when
    /// [`Media::has_power_loss_protection`] is true.
    fn stage_partial_page(&self, segment: SegmentId, page: PageIndex, data: &[u8]) -> Result<()> {
        let _ = (segment, page, data);
        Err(Error::Unsupported(
            "this medium has no power-loss protection".into(),
        ))
    }

    /// The cleaner reclaimed a segment of `segment_bytes`, relocating
    /// `relocated_bytes`. A drive model charges its recycling engine.
    fn segment_recycled(&self, segment_bytes: u64, relocated_bytes: u64) {
        let _ = (segment_bytes, relocated_bytes);
    }

    /// False while a rate-capped recycling engine is still busy; the
    /// background cleaner then waits (foreground cleaning does not).
    fn recycling_ready(&self) -> bool {
        true
    }

    /// Erase counts, on a medium that wears (an emulated NAND drive).
    fn wear(&self) -> Option<crate::stats::Wear> {
        None
    }

    // --- Hooks for media that keep segments elsewhere too (an object-store
    // tier). The defaults do nothing.

    /// The engine freed `segment`: no root it may recover from needs the
    /// incarnation the segment held. A tier stops keeping it; most media
    /// ignore this.
    fn segment_freed(&self, segment: SegmentId) {
        let _ = segment;
    }

    /// The engine sealed this incarnation of `segment` at `fill_bytes`: it
    /// writes no more to it until a later `prepare_segment` or
    /// `erase_segment`. Called by the engine's log writer in order with the
    /// segment's writes, so after its last pages up to `fill_bytes`.
    fn segment_sealed(&self, segment: SegmentId, fill_bytes: u64) {
        let _ = (segment, fill_bytes);
    }

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

/// Direction of a host transfer, for [`Media::host_transfer`].
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
