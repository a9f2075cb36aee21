//! A medium on a regular file (created sparse) or an existing block device.
//!
//! Layout: two metadata slots of [`FILE_META_SLOT_SIZE`] bytes at the start,
//! then segments back to back from [`FILE_DATA_OFFSET`]. The last
//! [`FILE_STAGING_AREA_BYTES`] of each metadata slot are its staging area:
//! a root never reaches them ([`FILE_ROOT_MAX_BYTES`]). Staging slot `i`
//! lives in metadata slot `i % 2`, so the two slots a stream alternates
//! between are far apart, and each has a 4 KiB page of its own, so that
//! the host's page cache never rewrites one while writing another.
//!
//! This is not flash: segments are written in 512-byte sectors (in order,
//! each once), and a flush keeps its partial last sector in a staging slot
//! instead of padding a page (see `Media::staging`).
//!
//! A segment is reused by overwriting it in place: the engine never relies
//! on erased contents (every record names its segment incarnation). An
//! explicit erase (recovery's, of leftovers a crashed run may have written)
//! punches a hole in a regular file and is a no-op on a block device.
//! Reuse does not punch: the hole would be filled again at once, and on a
//! dirty volume, where every segment is reused, freeing and reallocating
//! its pages costs the host filesystem more than the write itself.
//!
//! Host reads of a regular file take their records straight from a
//! read-only shared mapping of its data area ([`Media::mapped`]) instead of
//! copying them out of the page cache with `pread`: the copy and the page
//! cache lookups were a fifth of a 1 MiB sequential read's server CPU.
//! Everything else (the cleaner, map pages, recovery, metadata) reads with
//! `pread`. Mapped pages that host reads touched count in the server's RSS
//! (as RssFile, or RssShmem on tmpfs) for as long as the image is served,
//! although they are the page cache's and no extra memory; dropping them
//! every 16 MiB read (`MADV_DONTNEED`) gave back most of the gain to page
//! faults. Small reads copy instead (see `volume/io.rs`), so random 4 KiB
//! reads leave the RSS as it was.
//! A mapped page that cannot be read (a media error on the disk under the
//! file, or a file cut shorter by someone else despite the lock) kills the
//! server with SIGBUS where `pread` would have failed one request; the log
//! is durable, so a restart loses nothing that was flushed. A block device
//! is always read with `pread`, so that a bad sector fails one request, and
//! `serve --mapped-reads off` ([`set_mapped_reads`]) reads files that way too.
//!
//! The file is locked with `flock` for as long as the medium is open:
//! exclusively for read-write use, shared for read-only use. A second
//! server on the same image therefore fails at once with [`Error::Locked`].

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::{
    check_read_range, Media, MediaGeometry, PageDiscipline, Staging, SECTOR_BYTES, STAGING_SLOTS,
    STAGING_SLOT_BYTES,
};
use crate::error::{Error, Result};
use crate::units::{PageIndex, SegmentId};

/// Size of each of the two metadata slots.
pub const FILE_META_SLOT_SIZE: u32 = 512 * 1024;
/// Byte offset of segment 0.
pub const FILE_DATA_OFFSET: u64 = 2 * FILE_META_SLOT_SIZE as u64;
/// Page size used on files and block devices.
pub const FILE_PAGE_SIZE: u32 = 4096;
/// Bytes each staging slot takes: a page of its own.
const FILE_STAGING_SLOT_BYTES: u32 = 4096;
/// The staging area at the end of each metadata slot.
pub const FILE_STAGING_AREA_BYTES: u32 = (STAGING_SLOTS as u32 / 2) * FILE_STAGING_SLOT_BYTES;
/// The largest root a metadata slot takes: everything before its staging area.
pub const FILE_ROOT_MAX_BYTES: u32 = FILE_META_SLOT_SIZE - FILE_STAGING_AREA_BYTES;

const _: () = assert!(STAGING_SLOT_BYTES as u32 <= FILE_STAGING_SLOT_BYTES);

/// Byte offset of staging slot `slot` in the file.
fn staging_offset(slot: usize) -> u64 {
    assert!(slot < STAGING_SLOTS, "staging slot {slot} does not exist");
    let meta_slot = (slot % 2) as u64;
    let index = (slot / 2) as u64;
    meta_slot * FILE_META_SLOT_SIZE as u64
        + FILE_ROOT_MAX_BYTES as u64
        + index * FILE_STAGING_SLOT_BYTES as u64
}

/// A read-only shared mapping of an image file's data area, through which
/// host reads take records without copying them (see [`Media::mapped`]).
struct Mapping {
    address: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is only ever read, and lives until the struct drops.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared reads of a read-only mapping.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` from `offset` (a multiple of the page
    /// size); `None` if the system refuses, and reads then copy.
    fn new(file: &File, offset: u64, len: u64) -> Option<Mapping> {
        let len = usize::try_from(len).ok().filter(|&len| len > 0)?;
        let offset = libc::off_t::try_from(offset).ok()?;
        // SAFETY: a new read-only mapping at an address the kernel chooses,
        // of a valid descriptor; it aliases no Rust object.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset,
            )
        };
        if address == libc::MAP_FAILED {
            return None;
        }
        Some(Mapping {
            address: std::ptr::NonNull::new(address.cast())?,
            len,
        })
    }

    /// The `len` mapped bytes at `offset`.
    fn bytes(&self, offset: u64, len: usize) -> &[u8] {
        let end = offset.checked_add(len as u64);
        assert!(
            end.is_some_and(|end| end <= self.len as u64),
            "mapped read of {len} bytes at {offset} beyond the mapping's {} bytes",
            self.len
        );
        // SAFETY: the range lies within the mapping (asserted), which lives
        // as long as `self`. Its bytes change only if the engine rewrites
        // that part of the file, which `Media::mapped` tells its callers.
        unsafe { std::slice::from_raw_parts(self.address.as_ptr().add(offset as usize), len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the range mmap returned; nothing borrows it any
        // more, since borrows live no longer than `&self`.
        unsafe { libc::munmap(self.address.as_ptr().cast(), self.len) };
    }
}

pub struct FileMedia {
    file: File,
    /// The data area mapped for host reads; `None` on a block device, or
    /// if mapping failed.
    map: Option<Mapping>,
    path: PathBuf,
    geometry: MediaGeometry,
    physical_size_bytes: u64,
    is_block_device: bool,
    discipline: PageDiscipline,
}

/// Locks an image file with `flock` (exclusive for read-write use, shared
/// for read-only), failing at once with [`Error::Locked`] if another holds it.
pub fn lock_file(file: &File, path: &Path, exclusive: bool) -> Result<()> {
    let mode = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    // SAFETY: flock on a valid descriptor owned by `file`.
    let rc = unsafe { libc::flock(file.as_raw_fd(), mode | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(Error::Locked {
                path: path.display().to_string(),
            });
        }
        return Err(Error::io(format!("locking {}", path.display()), err));
    }
    Ok(())
}

/// Why the file at `path` (of `physical` bytes, its metadata slots read
/// into `slots`) does not open: damaged zdisk metadata, or something else
/// altogether, named when its signature is known.
fn not_an_image(path: &Path, physical: u64, slots: &[Vec<u8>; 2]) -> Error {
    let magic = super::META_MAGIC.as_slice();
    if slots.iter().any(|slot| slot.starts_with(magic)) {
        return Error::CorruptImage(format!(
            "{}: neither metadata slot holds a readable superblock (both are damaged)",
            path.display()
        ));
    }
    let what = match what_it_holds(&slots[0], physical) {
        Some(what) => format!("; it holds {what}"),
        None => String::new(),
    };
    Error::NotAnImage(format!(
        "{} is not a zdisk image{what} (create one with `zdisk create`)",
        path.display()
    ))
}

/// What the first bytes of a file or device say it holds, for the formats
/// someone may well point zdisk at by mistake.
fn what_it_holds(start: &[u8], physical: u64) -> Option<&'static str> {
    let at = |offset: usize, signature: &[u8]| {
        start
            .get(offset..offset + signature.len())
            .is_some_and(|bytes| bytes == signature)
    };
    if physical == 0 {
        return Some("nothing (it is empty)");
    }
    if start.is_empty() {
        return Some("too few bytes for any zdisk image");
    }
    let signatures: [(usize, &[u8], &'static str); 12] = [
        (0, b"QFI\xfb", "a qcow2 disk image"),
        (0, b"LUKS\xba\xbe", "a LUKS encrypted volume"),
        (0, b"XFSB", "an XFS filesystem"),
        (0x10040, b"_BHRfS_M", "a btrfs filesystem"),
        (1080, &[0x53, 0xef], "an ext2/3/4 filesystem"),
        (512, b"EFI PART", "a GPT-partitioned disk"),
        (0, b"\x7fELF", "an ELF executable"),
        (0, &[0x1f, 0x8b], "gzip-compressed data"),
        (0, &[0x28, 0xb5, 0x2f, 0xfd], "zstd-compressed data"),
        (257, b"ustar", "a tar archive"),
        (0, b"SQLite format 3\0", "an SQLite database"),
        (
            510,
            &[0x55, 0xaa],
            "a disk with an MBR partition table or boot sector",
        ),
    ];
    for (offset, signature, what) in signatures {
        if at(offset, signature) {
            return Some(what);
        }
    }
    if start.iter().all(|&byte| byte == 0) {
        return Some("only zeros where a zdisk image starts (never written?)");
    }
    None
}

fn device_size(file: &File, path: &Path) -> Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut handle = file;
    handle
        .seek(SeekFrom::End(0))
        .map_err(|e| Error::io(format!("measuring {}", path.display()), e))
}

/// Whether file media opened from now on map their data area for host
/// reads (`serve --mapped-reads`); on by default.
static MAPPED_READS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns mapped host reads on or off for file media opened after the call:
/// off, every read is a `pread`, and a media error fails one request
/// instead of raising SIGBUS.
pub fn set_mapped_reads(enabled: bool) {
    MAPPED_READS.store(enabled, std::sync::atomic::Ordering::Relaxed);
}

/// The mapping host reads use: a regular file's data area, never a block
/// device's (see the module documentation).
fn map_data_area(file: &File, is_block_device: bool, geometry: &MediaGeometry) -> Option<Mapping> {
    if is_block_device || !MAPPED_READS.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    Mapping::new(file, FILE_DATA_OFFSET, geometry.log_capacity_bytes())
}

/// Geometry of a file medium of `physical_size_bytes` with the given segment size.
pub fn file_geometry(physical_size_bytes: u64, segment_size_bytes: u64) -> Result<MediaGeometry> {
    if physical_size_bytes <= FILE_DATA_OFFSET {
        return Err(Error::InvalidArgument(format!(
            "physical size {physical_size_bytes} is too small: the metadata area alone takes {FILE_DATA_OFFSET} bytes"
        )));
    }
    let segment_count = (physical_size_bytes - FILE_DATA_OFFSET) / segment_size_bytes.max(1);
    let geometry = MediaGeometry {
        page_size_bytes: FILE_PAGE_SIZE,
        segment_size_bytes,
        segment_count: segment_count.min(u32::MAX as u64 - 1) as u32,
        meta_slot_size_bytes: FILE_META_SLOT_SIZE,
    };
    geometry.validate()?;
    Ok(geometry)
}

impl FileMedia {
    /// Creates a new image. A regular file must not exist yet unless `overwrite`;
    /// it is created sparse with `physical_size_bytes`. For a block device,
    /// `physical_size_bytes` of `None` means the whole device.
    pub fn create(
        path: &Path,
        physical_size_bytes: Option<u64>,
        segment_size_bytes: u64,
        overwrite: bool,
    ) -> Result<FileMedia> {
        let existing = std::fs::metadata(path).ok();
        let is_block_device = existing
            .as_ref()
            .is_some_and(|m| m.file_type().is_block_device());
        if existing.is_some() && !is_block_device && !overwrite {
            return Err(Error::InvalidArgument(format!(
                "{} already exists; pass --force to overwrite it",
                path.display()
            )));
        }
        if !is_block_device {
            // Validate before touching the file, so a bad size destroys nothing.
            let size = physical_size_bytes.ok_or_else(|| {
                Error::InvalidArgument("a physical size is required for a regular file".into())
            })?;
            file_geometry(size, segment_size_bytes)?;
        }
        // Never truncate at open: the lock must be ours before an existing
        // image loses a byte, or a served image would be wiped under its server.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(!is_block_device)
            .truncate(false)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        lock_file(&file, path, true)?;
        let physical = if is_block_device {
            let device = device_size(&file, path)?;
            match physical_size_bytes {
                Some(size) if size > device => {
                    return Err(Error::InvalidArgument(format!(
                        "physical size {size} exceeds the size of {} ({device} bytes)",
                        path.display()
                    )))
                }
                Some(size) => size,
                None => device,
            }
        } else {
            let size = physical_size_bytes.expect("checked above");
            // Empty first, so the new image is sparse, then size it.
            file.set_len(0)
                .and_then(|()| file.set_len(size))
                .map_err(|e| Error::io(format!("sizing {}", path.display()), e))?;
            size
        };
        let geometry = file_geometry(physical, segment_size_bytes)?;
        // Clear both metadata slots so no stale root survives on a reused device.
        let zeros = vec![0u8; FILE_META_SLOT_SIZE as usize];
        for slot in 0..2u64 {
            file.write_all_at(&zeros, slot * FILE_META_SLOT_SIZE as u64)
                .map_err(|e| Error::io(format!("clearing metadata of {}", path.display()), e))?;
        }
        Ok(FileMedia {
            map: map_data_area(&file, is_block_device, &geometry),
            file,
            path: path.to_path_buf(),
            discipline: PageDiscipline::new(&geometry),
            geometry,
            physical_size_bytes: physical,
            is_block_device,
        })
    }

    /// Opens an existing image. The medium does not know the engine's
    /// format: it hands the raw contents of both metadata slots to
    /// `geometry_of` (the engine's `meta::geometry_in_slots`), which says
    /// how the file is laid out, or `None` if it is not an image.
    pub fn open(
        path: &Path,
        read_only: bool,
        geometry_of: impl FnOnce(&[Vec<u8>; 2]) -> Option<MediaGeometry>,
    ) -> Result<FileMedia> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        lock_file(&file, path, !read_only)?;
        let metadata = file
            .metadata()
            .map_err(|e| Error::io(format!("inspecting {}", path.display()), e))?;
        let is_block_device = metadata.file_type().is_block_device();
        let physical = device_size(&file, path)?;
        let mut slots = [Vec::new(), Vec::new()];
        for (slot, bytes) in slots.iter_mut().enumerate() {
            let offset = slot as u64 * FILE_META_SLOT_SIZE as u64;
            if physical < offset + FILE_META_SLOT_SIZE as u64 {
                break;
            }
            bytes.resize(FILE_META_SLOT_SIZE as usize, 0);
            file.read_exact_at(bytes, offset)
                .map_err(|e| Error::io(format!("reading metadata of {}", path.display()), e))?;
        }
        let geometry = geometry_of(&slots).ok_or_else(|| not_an_image(path, physical, &slots))?;
        geometry.validate()?;
        let needed = FILE_DATA_OFFSET + geometry.log_capacity_bytes();
        if physical < needed {
            return Err(Error::CorruptImage(format!(
                "{} is {physical} bytes but its superblock describes {needed} bytes; was it truncated?",
                path.display()
            )));
        }
        Ok(FileMedia {
            map: map_data_area(&file, is_block_device, &geometry),
            file,
            path: path.to_path_buf(),
            discipline: PageDiscipline::new(&geometry),
            geometry,
            physical_size_bytes: physical,
            is_block_device,
        })
    }

    fn segment_offset(&self, segment: SegmentId) -> u64 {
        FILE_DATA_OFFSET + segment.0 as u64 * self.geometry.segment_size_bytes
    }

    fn write_segment_at(&self, segment: SegmentId, offset: u64, data: &[u8]) -> Result<()> {
        assert!(
            offset + data.len() as u64 <= self.geometry.segment_size_bytes,
            "write past the end of segment {segment}"
        );
        self.file
            .write_all_at(data, self.segment_offset(segment) + offset)
            .map_err(|e| {
                Error::io(
                    format!("writing segment {segment} of {}", self.path.display()),
                    e,
                )
            })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Media for FileMedia {
    fn geometry(&self) -> MediaGeometry {
        self.geometry
    }

    fn physical_size_bytes(&self) -> u64 {
        self.physical_size_bytes
    }

    fn write_pages(&self, segment: SegmentId, first_page: PageIndex, data: &[u8]) -> Result<()> {
        self.discipline.on_write(segment, first_page, data.len());
        let offset = first_page.0 as u64 * self.geometry.page_size_bytes as u64;
        self.write_segment_at(segment, offset, data)
    }

    fn read(&self, segment: SegmentId, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        check_read_range(&self.geometry, segment, offset_bytes, buf.len())?;
        self.file
            .read_exact_at(buf, self.segment_offset(segment) + offset_bytes)
            .map_err(|e| {
                Error::io(
                    format!("reading segment {segment} of {}", self.path.display()),
                    e,
                )
            })
    }

    fn mapped(&self, segment: SegmentId, offset_bytes: u64, len: usize) -> Result<Option<&[u8]>> {
        check_read_range(&self.geometry, segment, offset_bytes, len)?;
        let start = self.segment_offset(segment) - FILE_DATA_OFFSET + offset_bytes;
        Ok(self.map.as_ref().map(|map| map.bytes(start, len)))
    }

    fn erase_segment(&self, segment: SegmentId) -> Result<()> {
        assert!(
            segment.0 < self.geometry.segment_count,
            "erase of segment {segment} beyond the medium"
        );
        if !self.is_block_device {
            // SAFETY: fallocate on a valid descriptor; range within the file.
            let rc = unsafe {
                libc::fallocate(
                    self.file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    self.segment_offset(segment) as libc::off_t,
                    self.geometry.segment_size_bytes as libc::off_t,
                )
            };
            if rc != 0 {
                let err = std::io::Error::last_os_error();
                // Filesystems without hole punching still work: erase is only a hint.
                if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
                    return Err(Error::io(
                        format!("erasing segment {segment} of {}", self.path.display()),
                        err,
                    ));
                }
            }
        }
        self.discipline.on_erase(segment);
        Ok(())
    }

    fn prepare_segment(&self, segment: SegmentId) -> Result<()> {
        assert!(
            segment.0 < self.geometry.segment_count,
            "reuse of segment {segment} beyond the medium"
        );
        self.discipline.on_erase(segment);
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| Error::io(format!("syncing {}", self.path.display()), e))
    }

    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> Result<()> {
        assert!(slot < 2, "metadata slot {slot} does not exist");
        if data.len() > FILE_ROOT_MAX_BYTES as usize {
            return Err(Error::InvalidArgument(format!(
                "a root of {} bytes exceeds the {FILE_ROOT_MAX_BYTES} bytes a metadata slot \
                 keeps for it",
                data.len()
            )));
        }
        self.file
            .write_all_at(data, slot as u64 * FILE_META_SLOT_SIZE as u64)
            .map_err(|e| {
                Error::io(
                    format!("writing metadata slot {slot} of {}", self.path.display()),
                    e,
                )
            })
    }

    fn read_meta_slot(&self, slot: usize) -> Result<Vec<u8>> {
        assert!(slot < 2, "metadata slot {slot} does not exist");
        let mut bytes = vec![0u8; FILE_META_SLOT_SIZE as usize];
        self.file
            .read_exact_at(&mut bytes, slot as u64 * FILE_META_SLOT_SIZE as u64)
            .map_err(|e| {
                Error::io(
                    format!("reading metadata slot {slot} of {}", self.path.display()),
                    e,
                )
            })?;
        Ok(bytes)
    }

    fn staging(&self) -> Option<&dyn Staging> {
        Some(self)
    }

    fn describe(&self) -> String {
        if self.is_block_device {
            format!("block device {}", self.path.display())
        } else {
            format!("file {}", self.path.display())
        }
    }
}

impl Staging for FileMedia {
    fn write_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        self.discipline
            .on_write_sectors(segment, offset_bytes, data.len());
        self.write_segment_at(segment, offset_bytes, data)
    }

    fn restore_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        assert!(
            offset_bytes.is_multiple_of(SECTOR_BYTES as u64)
                && data.len().is_multiple_of(SECTOR_BYTES),
            "restoring part of a sector"
        );
        self.write_segment_at(segment, offset_bytes, data)
    }

    fn write_staging(&self, slot: usize, data: &[u8]) -> Result<()> {
        assert!(
            data.len() <= STAGING_SLOT_BYTES && data.len().is_multiple_of(SECTOR_BYTES),
            "staging write of {} bytes",
            data.len()
        );
        self.file
            .write_all_at(data, staging_offset(slot))
            .map_err(|e| {
                Error::io(
                    format!("writing staging slot {slot} of {}", self.path.display()),
                    e,
                )
            })
    }

    fn read_staging(&self, slot: usize) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; STAGING_SLOT_BYTES];
        self.file
            .read_exact_at(&mut bytes, staging_offset(slot))
            .map_err(|e| {
                Error::io(
                    format!("reading staging slot {slot} of {}", self.path.display()),
                    e,
                )
            })?;
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_not_an_image_is_named() {
        let mut ext4 = vec![0u8; 4096];
        ext4[1080..1082].copy_from_slice(&[0x53, 0xef]);
        assert_eq!(
            what_it_holds(&ext4, 1 << 20),
            Some("an ext2/3/4 filesystem")
        );
        let mut qcow2 = vec![0u8; 4096];
        qcow2[..4].copy_from_slice(b"QFI\xfb");
        assert_eq!(what_it_holds(&qcow2, 1 << 20), Some("a qcow2 disk image"));
        assert!(what_it_holds(&[0u8; 4096], 1 << 20)
            .unwrap()
            .contains("only zeros"));
        assert_eq!(what_it_holds(&[], 0), Some("nothing (it is empty)"));
        assert_eq!(what_it_holds(&[7u8; 4096], 1 << 20), None);
        let slots = [vec![1u8; 16], Vec::new()];
        let error = not_an_image(Path::new("x.img"), 1 << 20, &slots).to_string();
        assert!(!error.contains("corrupt"), "{error}");
        assert!(error.starts_with("x.img is not a zdisk image"), "{error}");
        let mut damaged = vec![0u8; 64];
        damaged[..8].copy_from_slice(crate::media::META_MAGIC);
        let error = not_an_image(Path::new("x.img"), 1 << 20, &[damaged, Vec::new()]);
        assert!(matches!(error, Error::CorruptImage(_)), "{error}");
    }

    /// Mapped bytes are the bytes `read` returns, on every segment, and a
    /// range beyond a segment is refused, not lent.
    #[test]
    fn mapped_bytes_are_what_read_returns() {
        let path = std::env::temp_dir().join(format!("zdisk-mapped-media-{}", std::process::id()));
        let media = FileMedia::create(&path, Some(8 << 20), 256 * 1024, true).unwrap();
        let segments = media.geometry().segment_count;
        for segment in [0, 1, segments - 1] {
            let page = vec![segment as u8 + 1; FILE_PAGE_SIZE as usize];
            media.prepare_segment(SegmentId(segment)).unwrap();
            media
                .write_pages(SegmentId(segment), PageIndex(0), &page)
                .unwrap();
            let mut read = vec![0u8; 1000];
            media.read(SegmentId(segment), 100, &mut read).unwrap();
            let mapped = media.mapped(SegmentId(segment), 100, 1000).unwrap();
            assert_eq!(mapped, Some(read.as_slice()), "segment {segment}");
        }
        assert!(media.mapped(SegmentId(0), 256 * 1024 - 10, 11).is_err());
        assert!(media.mapped(SegmentId(segments), 0, 1).is_err());
        drop(media);
        std::fs::remove_file(&path).unwrap();
    }

    /// Roots and staging slots share the metadata slots without ever
    /// overlapping, and a root that would reach a staging area is refused.
    #[test]
    fn roots_and_staging_slots_never_collide() {
        let path = std::env::temp_dir().join(format!("zdisk-staging-{}", std::process::id()));
        let media = FileMedia::create(&path, Some(8 << 20), 256 * 1024, true).unwrap();
        for slot in 0..STAGING_SLOTS {
            media
                .write_staging(slot, &[slot as u8 + 1; STAGING_SLOT_BYTES])
                .unwrap();
        }
        for slot in 0..2 {
            let root = vec![0xA0 + slot as u8; FILE_ROOT_MAX_BYTES as usize];
            media.write_meta_slot(slot, &root).unwrap();
            let too_big = vec![0; FILE_ROOT_MAX_BYTES as usize + 1];
            assert!(media.write_meta_slot(slot, &too_big).is_err());
        }
        for slot in 0..STAGING_SLOTS {
            let bytes = media.read_staging(slot).unwrap();
            assert!(bytes.iter().all(|&b| b == slot as u8 + 1), "slot {slot}");
        }
        for slot in 0..2 {
            let bytes = media.read_meta_slot(slot).unwrap();
            let (root, staging) = bytes.split_at(FILE_ROOT_MAX_BYTES as usize);
            assert!(root.iter().all(|&b| b == 0xA0 + slot as u8));
            // Slot i's staging lives in metadata slot i % 2.
            let (first, second) = staging.split_at(FILE_STAGING_SLOT_BYTES as usize);
            assert_eq!(first[0], slot as u8 + 1);
            assert_eq!(second[0], slot as u8 + 3);
        }
        drop(media);
        std::fs::remove_file(&path).unwrap();
    }
}
