//! Where page contents live: RAM (sparse) or an image file (sparse).
//!
//! Both back-ends return 0xFF for pages never programmed since their last
//! erase, as erased flash reads. Every store call is I/O as far as the
//! medium's locks go: it never runs under the model lock (debug builds
//! check it). The RAM store keeps each segment as the
//! bytes programmed so far (pages are programmed in order, so everything
//! past that is erased). The file store keeps the bitwise complement of
//! each page, so a hole — never written, or punched by an erase — reads
//! back as 0xFF.
//!
//! Image file layout (integers little-endian; see `Layout`):
//!
//! ```text
//! 0            header: "ZDISKNAND", format version, layout offsets,
//!              the encoded NandParams, CRC32C            (HEADER_AREA_BYTES)
//! meta         metadata slot 0, slot 1                   (2 × META_SLOT_SIZE_BYTES)
//! erase_counts u32 per block, block = segment × units + unit
//! staging      one slot per segment: 16-byte header (tag, page, length,
//!              CRC32C of the data) + up to one page of staged bytes
//! data         segments back to back, each page complemented
//! ```

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use zdisk_core::bytes::{ByteReader, ByteWriter};
use zdisk_core::held::{assert_none_held, Held};
use zdisk_core::media::lock_file;
use zdisk_core::{Error, Result};

use crate::profile::{NandParams, META_SLOT_SIZE_BYTES};

/// The first bytes of every NAND image (zdisk's own file images start
/// with "ZDISKMT1", so the two are told apart by their first bytes).
pub const IMAGE_MAGIC: &[u8; 9] = b"ZDISKNAND";
/// Image format version, the byte after the magic.
pub const IMAGE_VERSION: u8 = 1;

const HEADER_AREA_BYTES: u64 = 64 * 1024;
const STAGE_HEADER_BYTES: u64 = 16;
const STAGE_TAG: u32 = u32::from_le_bytes(*b"STG1");

/// True if `prefix` (the first bytes of a file) is a NAND image.
pub fn is_nand_image(prefix: &[u8]) -> bool {
    prefix.starts_with(IMAGE_MAGIC)
}

fn align_up(value: u64, align: u64) -> u64 {
    value.div_ceil(align) * align
}

/// Byte offsets of an image's regions, all derived from its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    meta_offset: u64,
    erase_counts_offset: u64,
    staging_offset: u64,
    staging_slot_bytes: u64,
    data_offset: u64,
    file_bytes: u64,
}

impl Layout {
    fn of(params: &NandParams) -> Layout {
        let profile = &params.profile;
        let segments = profile.segment_count() as u64;
        let meta_offset = HEADER_AREA_BYTES;
        let erase_counts_offset = meta_offset + 2 * META_SLOT_SIZE_BYTES as u64;
        let erase_counts_bytes = align_up(segments * profile.units() as u64 * 4, 4096);
        let staging_offset = erase_counts_offset + erase_counts_bytes;
        let staging_slot_bytes = align_up(STAGE_HEADER_BYTES + profile.page_bytes() as u64, 4096);
        let data_offset = align_up(staging_offset + segments * staging_slot_bytes, 64 * 1024);
        Layout {
            meta_offset,
            erase_counts_offset,
            staging_offset,
            staging_slot_bytes,
            data_offset,
            file_bytes: data_offset + segments * profile.segment_size_bytes(),
        }
    }
}

fn encode_header(params: &NandParams, layout: &Layout) -> Vec<u8> {
    let mut out = ByteWriter::new();
    out.bytes(IMAGE_MAGIC);
    out.u8(IMAGE_VERSION);
    out.u16(0);
    out.u32(0); // total length, patched below
    out.u32(META_SLOT_SIZE_BYTES);
    for offset in [
        layout.meta_offset,
        layout.erase_counts_offset,
        layout.staging_offset,
        layout.staging_slot_bytes,
        layout.data_offset,
        layout.file_bytes,
    ] {
        out.u64(offset);
    }
    let encoded = params.encode_params();
    out.u32(encoded.len() as u32);
    out.bytes(&encoded);
    let total = out.buf.len() as u32 + 4;
    out.buf[12..16].copy_from_slice(&total.to_le_bytes());
    let crc = crc32c::crc32c(&out.buf);
    out.u32(crc);
    assert!(
        out.buf.len() as u64 <= HEADER_AREA_BYTES,
        "image header too large"
    );
    out.buf
}

fn decode_header(bytes: &[u8]) -> std::result::Result<(NandParams, Layout), String> {
    if !is_nand_image(bytes) {
        return Err("not a zdisk NAND image (no ZDISKNAND magic)".into());
    }
    let mut input = ByteReader::new(bytes);
    input.take(IMAGE_MAGIC.len())?;
    let version = input.u8()?;
    if version != IMAGE_VERSION {
        return Err(format!(
            "NAND image format version {version}, this zdisk reads version {IMAGE_VERSION}"
        ));
    }
    input.u16()?;
    let total = input.u32()? as usize;
    if total < 20 || total > bytes.len() {
        return Err(format!("impossible header length {total}"));
    }
    let stored = u32::from_le_bytes(bytes[total - 4..total].try_into().expect("4 bytes"));
    let actual = crc32c::crc32c(&bytes[..total - 4]);
    if stored != actual {
        return Err(format!(
            "header checksum mismatch ({stored:#010x} != {actual:#010x})"
        ));
    }
    let mut input = ByteReader::new(&bytes[16..total - 4]);
    let meta_slot = input.u32()?;
    let mut offsets = [0u64; 6];
    for offset in offsets.iter_mut() {
        *offset = input.u64()?;
    }
    let params_len = input.u32()? as usize;
    let params = NandParams::decode_params(input.take(params_len)?).map_err(|e| e.to_string())?;
    let layout = Layout::of(&params);
    let stored_layout = Layout {
        meta_offset: offsets[0],
        erase_counts_offset: offsets[1],
        staging_offset: offsets[2],
        staging_slot_bytes: offsets[3],
        data_offset: offsets[4],
        file_bytes: offsets[5],
    };
    if meta_slot != META_SLOT_SIZE_BYTES || stored_layout != layout {
        return Err(format!(
            "header layout {stored_layout:?} (slots of {meta_slot} bytes) does not match its parameters ({layout:?})"
        ));
    }
    Ok((params, layout))
}

/// A staged page found when an image is opened.
pub(crate) struct StagedPage {
    pub segment: u32,
    pub page: u32,
    pub data: Vec<u8>,
}

pub(crate) enum Store {
    Ram(RamStore),
    File(FileStore),
}

pub(crate) struct RamStore {
    /// Per segment, the bytes programmed since its last erase. A read
    /// holds its segment's lock only to copy bytes out of RAM, a program
    /// only to append its pages (memory copies of at most one call's data,
    /// no I/O), so a read waits at most for one such copy of the same
    /// segment; marked "nand segment" while held.
    segments: Vec<RwLock<Vec<u8>>>,
    segment_size_bytes: u64,
    meta: Mutex<[Vec<u8>; 2]>,
}

pub(crate) struct FileStore {
    file: File,
    path: PathBuf,
    layout: Layout,
    segment_size_bytes: u64,
    page_size_bytes: u64,
}

fn complement(bytes: &mut [u8]) {
    for byte in bytes {
        *byte = !*byte;
    }
}

impl Store {
    pub fn ram(params: &NandParams) -> Store {
        let profile = &params.profile;
        Store::Ram(RamStore {
            segments: (0..profile.segment_count())
                .map(|_| RwLock::new(Vec::new()))
                .collect(),
            segment_size_bytes: profile.segment_size_bytes(),
            meta: Mutex::new([Vec::new(), Vec::new()]),
        })
    }

    /// Creates a sparse image file holding `params`.
    pub fn create_file(path: &Path, params: &NandParams, overwrite: bool) -> Result<Store> {
        let layout = Layout::of(params);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(overwrite)
            .create_new(!overwrite)
            .truncate(false)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    Error::InvalidArgument(format!(
                        "{} already exists; pass --force to overwrite it",
                        path.display()
                    ))
                } else {
                    Error::io(format!("creating {}", path.display()), e)
                }
            })?;
        lock_file(&file, path, true)?;
        let io = |what: &str, e| Error::io(format!("{what} {}", path.display()), e);
        // Truncating to zero first drops any old contents: a fresh image is all holes.
        file.set_len(0).map_err(|e| io("clearing", e))?;
        file.set_len(layout.file_bytes)
            .map_err(|e| io("sizing", e))?;
        file.write_all_at(&encode_header(params, &layout), 0)
            .map_err(|e| io("writing the header of", e))?;
        file.sync_all().map_err(|e| io("syncing", e))?;
        Ok(Store::File(FileStore {
            file,
            path: path.to_path_buf(),
            layout,
            segment_size_bytes: params.profile.segment_size_bytes(),
            page_size_bytes: params.profile.page_bytes() as u64,
        }))
    }

    /// Opens an image, returning its parameters, erase counts and staged pages.
    pub fn open_file(path: &Path) -> Result<(Store, NandParams, Vec<u32>, Vec<StagedPage>)> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        lock_file(&file, path, true)?;
        let io = |what: &str, e| Error::io(format!("{what} {}", path.display()), e);
        let file_bytes = file.metadata().map_err(|e| io("inspecting", e))?.len();
        let mut header = vec![0u8; HEADER_AREA_BYTES.min(file_bytes) as usize];
        file.read_exact_at(&mut header, 0)
            .map_err(|e| io("reading the header of", e))?;
        let (params, layout) = decode_header(&header)
            .map_err(|problem| Error::CorruptImage(format!("{}: {problem}", path.display())))?;
        if file_bytes < layout.file_bytes {
            return Err(Error::CorruptImage(format!(
                "{} is {file_bytes} bytes but its header describes {} bytes; was it truncated?",
                path.display(),
                layout.file_bytes
            )));
        }
        let profile = &params.profile;
        let blocks = profile.segment_count() as usize * profile.units() as usize;
        let mut raw = vec![0u8; blocks * 4];
        file.read_exact_at(&mut raw, layout.erase_counts_offset)
            .map_err(|e| io("reading the erase counts of", e))?;
        let erase_counts = raw
            .chunks_exact(4)
            .map(|chunk| u32::from_le_bytes(chunk.try_into().expect("4 bytes")))
            .collect();
        let mut staged = Vec::new();
        let page_size = profile.page_bytes() as u64;
        let mut slot = vec![0u8; (STAGE_HEADER_BYTES + page_size) as usize];
        for segment in 0..profile.segment_count() {
            let offset = layout.staging_offset + segment as u64 * layout.staging_slot_bytes;
            file.read_exact_at(&mut slot[..STAGE_HEADER_BYTES as usize], offset)
                .map_err(|e| io("reading the staging area of", e))?;
            let word =
                |i: usize| u32::from_le_bytes(slot[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
            let (tag, page, len, crc) = (word(0), word(1), word(2), word(3));
            if tag != STAGE_TAG {
                continue;
            }
            let pages_per_segment = profile.geometry().pages_per_segment();
            if page >= pages_per_segment || len == 0 || len as u64 >= page_size {
                return Err(Error::CorruptImage(format!(
                    "{}: staged page of segment {segment} has page {page} and length {len}",
                    path.display()
                )));
            }
            let mut data = vec![0u8; len as usize];
            file.read_exact_at(&mut data, offset + STAGE_HEADER_BYTES)
                .map_err(|e| io("reading the staging area of", e))?;
            // A torn staging write never completed, so it was never acknowledged.
            if crc32c::crc32c(&data) == crc {
                staged.push(StagedPage {
                    segment,
                    page,
                    data,
                });
            }
        }
        let store = Store::File(FileStore {
            file,
            path: path.to_path_buf(),
            layout,
            segment_size_bytes: profile.segment_size_bytes(),
            page_size_bytes: page_size,
        });
        Ok((store, params, erase_counts, staged))
    }

    pub fn path(&self) -> Option<&Path> {
        match self {
            Store::Ram(_) => None,
            Store::File(store) => Some(&store.path),
        }
    }

    /// Stores programmed pages; `offset` is a page boundary of `segment`.
    pub fn write(&self, segment: u32, offset: u64, data: &[u8]) -> Result<()> {
        assert_none_held("a NAND store write");
        match self {
            Store::Ram(store) => {
                let mut bytes = store.segments[segment as usize]
                    .write()
                    .expect("segment lock");
                let _held = Held::mark("nand segment");
                // Pages are programmed in order from page 0 after an erase
                // (the model asserted it), so the data always extends the end.
                assert_eq!(
                    bytes.len() as u64,
                    offset,
                    "segment {segment} written out of order"
                );
                if bytes.capacity() == 0 {
                    bytes.reserve_exact(store.segment_size_bytes as usize);
                }
                bytes.extend_from_slice(data);
                Ok(())
            }
            Store::File(store) => {
                let mut inverted = data.to_vec();
                complement(&mut inverted);
                store
                    .file
                    .write_all_at(&inverted, store.data_offset(segment) + offset)
                    .map_err(|e| store.io(format!("writing segment {segment} of"), e))
            }
        }
    }

    /// Reads bytes of a segment; unprogrammed bytes read as 0xFF.
    pub fn read(&self, segment: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        assert_none_held("a NAND store read");
        match self {
            Store::Ram(store) => {
                let bytes = store.segments[segment as usize]
                    .read()
                    .expect("segment lock");
                let _held = Held::mark("nand segment");
                let start = offset as usize;
                let have = bytes.len().saturating_sub(start).min(buf.len());
                if have > 0 {
                    buf[..have].copy_from_slice(&bytes[start..start + have]);
                }
                buf[have..].fill(0xFF);
                Ok(())
            }
            Store::File(store) => {
                store
                    .file
                    .read_exact_at(buf, store.data_offset(segment) + offset)
                    .map_err(|e| store.io(format!("reading segment {segment} of"), e))?;
                complement(buf);
                Ok(())
            }
        }
    }

    pub fn erase(&self, segment: u32) -> Result<()> {
        assert_none_held("a NAND store erase");
        match self {
            Store::Ram(store) => {
                let erased = std::mem::take(
                    &mut *store.segments[segment as usize]
                        .write()
                        .expect("segment lock"),
                );
                // Freed after the lock is released.
                drop(erased);
                Ok(())
            }
            Store::File(store) => store.erase(segment),
        }
    }

    pub fn write_meta(&self, slot: usize, data: &[u8]) -> Result<()> {
        assert_none_held("a NAND metadata slot write");
        match self {
            Store::Ram(store) => {
                store.meta.lock().expect("meta lock")[slot] = data.to_vec();
                Ok(())
            }
            Store::File(store) => store
                .file
                .write_all_at(
                    data,
                    store.layout.meta_offset + slot as u64 * META_SLOT_SIZE_BYTES as u64,
                )
                .map_err(|e| store.io(format!("writing metadata slot {slot} of"), e)),
        }
    }

    pub fn read_meta(&self, slot: usize) -> Result<Vec<u8>> {
        assert_none_held("a NAND metadata slot read");
        let mut bytes = vec![0u8; META_SLOT_SIZE_BYTES as usize];
        match self {
            Store::Ram(store) => {
                let meta = store.meta.lock().expect("meta lock");
                bytes[..meta[slot].len()].copy_from_slice(&meta[slot]);
            }
            Store::File(store) => store
                .file
                .read_exact_at(
                    &mut bytes,
                    store.layout.meta_offset + slot as u64 * META_SLOT_SIZE_BYTES as u64,
                )
                .map_err(|e| store.io(format!("reading metadata slot {slot} of"), e))?,
        }
        Ok(bytes)
    }

    /// Persists a staged page (the RAM store keeps it in the model only).
    pub fn stage(&self, segment: u32, page: u32, data: &[u8]) -> Result<()> {
        assert_none_held("staging a page in the NAND store");
        let Store::File(store) = self else {
            return Ok(());
        };
        let offset = store.staging_slot(segment);
        let mut slot = ByteWriter::new();
        slot.u32(STAGE_TAG);
        slot.u32(page);
        slot.u32(data.len() as u32);
        slot.u32(crc32c::crc32c(data));
        // Data first, then the header that makes it count.
        store
            .file
            .write_all_at(data, offset + STAGE_HEADER_BYTES)
            .and_then(|()| store.file.write_all_at(&slot.buf, offset))
            .map_err(|e| store.io(format!("staging a page of segment {segment} in"), e))
    }

    pub fn unstage(&self, segment: u32) -> Result<()> {
        assert_none_held("dropping a staged page from the NAND store");
        let Store::File(store) = self else {
            return Ok(());
        };
        store
            .file
            .write_all_at(
                &[0u8; STAGE_HEADER_BYTES as usize],
                store.staging_slot(segment),
            )
            .map_err(|e| {
                store.io(
                    format!("dropping the staged page of segment {segment} in"),
                    e,
                )
            })
    }

    pub fn save_erase_counts(&self, segment: u32, counts: &[u32]) -> Result<()> {
        assert_none_held("saving NAND erase counts");
        let Store::File(store) = self else {
            return Ok(());
        };
        let bytes: Vec<u8> = counts
            .iter()
            .flat_map(|count| count.to_le_bytes())
            .collect();
        let offset = store.layout.erase_counts_offset + segment as u64 * bytes.len() as u64;
        store
            .file
            .write_all_at(&bytes, offset)
            .map_err(|e| store.io(format!("recording erase counts of segment {segment} in"), e))
    }

    /// Makes the backing store durable (a no-op in RAM).
    pub fn sync(&self) -> Result<()> {
        assert_none_held("a NAND store sync");
        match self {
            Store::Ram(_) => Ok(()),
            Store::File(store) => store
                .file
                .sync_data()
                .map_err(|e| store.io("syncing".to_string(), e)),
        }
    }
}

impl FileStore {
    fn data_offset(&self, segment: u32) -> u64 {
        self.layout.data_offset + segment as u64 * self.segment_size_bytes
    }

    fn staging_slot(&self, segment: u32) -> u64 {
        self.layout.staging_offset + segment as u64 * self.layout.staging_slot_bytes
    }

    fn io(&self, what: String, error: std::io::Error) -> Error {
        Error::io(format!("{what} {}", self.path.display()), error)
    }

    fn erase(&self, segment: u32) -> Result<()> {
        let offset = self.data_offset(segment);
        // SAFETY: fallocate on a valid descriptor; the range lies within the file.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                self.segment_size_bytes as libc::off_t,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(self.io(format!("erasing segment {segment} of"), err));
        }
        // No hole punching here: write the complement of 0xFF explicitly.
        let zeros = vec![0u8; self.page_size_bytes.max(1 << 20) as usize];
        let mut done = 0;
        while done < self.segment_size_bytes {
            let len = (self.segment_size_bytes - done).min(zeros.len() as u64) as usize;
            self.file
                .write_all_at(&zeros[..len], offset + done)
                .map_err(|e| self.io(format!("erasing segment {segment} of"), e))?;
            done += len as u64;
        }
        Ok(())
    }
}
