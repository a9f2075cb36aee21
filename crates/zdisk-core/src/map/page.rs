//! Map pages: one leaf's entries as bytes on the medium, and reading a
//! page back into a leaf.
//!
//! A checkpoint writes a leaf as one page, a map-chunk record in its dump
//! after the dump's directory records (docs/format.md), when the leaf
//! changed since its last page was written, or when that page sits in a
//! dump segment mostly holding pages that are no longer needed; every
//! other leaf keeps its page where an earlier checkpoint wrote it. The
//! record's `lba` is the leaf's first block and its `version` the
//! generation of the root that wrote it, so a page is never taken for
//! another leaf's or another checkpoint's. A page's place ([`PageLoc`])
//! is absolute: the two segments of its copies, its offset and its
//! generation. A leaf the cache evicted is read back from there when
//! something needs it.
//!
//! Decoding trusts nothing it reads: lengths, keys, segments, offsets and
//! versions are checked before an entry is built, and the map checks the
//! leaf's own invariants before it takes it.

use crate::bytes::{ByteReader, ByteWriter};
use crate::codec::{lz4_compress, lz4_decompress};
use crate::error::{Error, Result};
use crate::media::Media;
use crate::record::{decode_record, RecordKey, RecordKind};
use crate::units::SegmentId;

use super::entry::{
    Entry, Location, Slot, CHUNK_BLOCKS, CHUNK_MASK, LEN_MAX, OFFSET_UNITS_MAX, SEGMENTS_MAX,
    VERSION_MAX,
};
use super::leaf::{Leaf, SPARSE_MAX};

const FORM_RUN: u8 = 0;
const FORM_DENSE: u8 = 1;
const FORM_SPARSE: u8 = 2;

const TAG_HOLE: u8 = 0;
const TAG_ZERO: u8 = 1;
const TAG_DATA: u8 = 2;
const TAG_DAMAGED: u8 = 3;
/// Format 5: a shared entry (its content version, then its version).
const TAG_SHARED: u8 = 4;

/// The largest uncompressed page a payload may claim: a full sparse leaf
/// takes under 7 KiB.
const PAGE_RAW_MAX_BYTES: usize = 64 * 1024;

/// Where a page lives: the segments of its two copies (the same offset in
/// each), the record's byte offset and length, and the generation of the
/// checkpoint that wrote it (the record carries it as its version).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PageLoc {
    pub segments: [SegmentId; 2],
    pub offset: u32,
    pub len: u32,
    pub generation: u64,
}

/// What reading pages back needs besides their places.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PageStore {
    pub key: RecordKey,
    /// Segments of the medium: a data entry naming one beyond is damage.
    pub segment_count: u32,
    pub segment_size_bytes: u64,
}

/// The previous data entry, which the next one is encoded against.
#[derive(Default)]
struct Previous {
    segment: i64,
    end_offset: i64,
    version: i64,
}

fn put_entry(out: &mut ByteWriter, entry: Entry, previous: &mut Previous) {
    match entry.slot() {
        Slot::Hole => {
            out.u8(TAG_HOLE);
            out.varint(entry.version());
        }
        Slot::Zero => {
            out.u8(TAG_ZERO);
            out.varint(entry.version());
        }
        Slot::Damaged => {
            out.u8(TAG_DAMAGED);
            out.varint(entry.version());
        }
        Slot::Shared { content } => {
            out.u8(TAG_SHARED);
            out.varint(content);
            out.varint(entry.version());
        }
        Slot::Data(loc) => {
            out.u8(TAG_DATA);
            out.zigzag(loc.segment.0 as i64 - previous.segment);
            out.zigzag(loc.offset as i64 - previous.end_offset);
            out.varint(loc.len as u64);
            out.u8(loc.member);
            out.u8(loc.members);
            out.zigzag(entry.version() as i64 - previous.version);
            *previous = Previous {
                segment: loc.segment.0 as i64,
                end_offset: loc.offset as i64 + loc.len as i64,
                version: entry.version() as i64,
            };
        }
    }
}

/// An entry as a page holds it, before it is checked: what a reader
/// skipping to the entries it wants follows, cheaply.
enum RawEntry {
    Other(Slot, u64),
    Shared {
        content: u64,
        version: u64,
    },
    Data {
        segment: i64,
        offset: i64,
        len: u64,
        member: u8,
        members: u8,
        version: i64,
    },
}

/// Reads one entry, following the deltas from `previous` (which it moves
/// on), without checking its fields.
#[inline]
fn get_raw_entry(input: &mut ByteReader, previous: &mut Previous) -> Result<RawEntry, String> {
    let other = |input: &mut ByteReader, slot| Ok(RawEntry::Other(slot, input.varint()?));
    match input.u8()? {
        TAG_HOLE => other(input, Slot::Hole),
        TAG_ZERO => other(input, Slot::Zero),
        TAG_DAMAGED => other(input, Slot::Damaged),
        TAG_SHARED => Ok(RawEntry::Shared {
            content: input.varint()?,
            version: input.varint()?,
        }),
        TAG_DATA => {
            let add = |base: i64, delta: i64| {
                base.checked_add(delta)
                    .ok_or_else(|| "entry delta overflows".to_string())
            };
            let segment = add(previous.segment, input.zigzag()?)?;
            let offset = add(previous.end_offset, input.zigzag()?)?;
            let len = input.varint()?;
            let (member, members) = (input.u8()?, input.u8()?);
            let version = add(previous.version, input.zigzag()?)?;
            *previous = Previous {
                segment,
                end_offset: add(offset, len.min(i64::MAX as u64) as i64)?,
                version,
            };
            Ok(RawEntry::Data {
                segment,
                offset,
                len,
                member,
                members,
                version,
            })
        }
        other => Err(format!("bad entry tag {other}")),
    }
}

/// Checks an entry's fields against what the format and the medium allow.
fn check_entry(raw: RawEntry, segment_count: u32) -> Result<Entry, String> {
    match raw {
        RawEntry::Other(slot, version) => {
            if version > VERSION_MAX {
                return Err(format!("version {version} out of range"));
            }
            Ok(Entry::new(slot, version))
        }
        RawEntry::Shared { content, version } => {
            if content > VERSION_MAX || version > VERSION_MAX {
                return Err(format!(
                    "shared entry: content version {content} or version {version} out of range"
                ));
            }
            Ok(Entry::new(Slot::Shared { content }, version))
        }
        RawEntry::Data {
            segment,
            offset,
            len,
            member,
            members,
            version,
        } => {
            let segments = segment_count.min(SEGMENTS_MAX) as i64;
            let offset_max = (OFFSET_UNITS_MAX * 16) as i64;
            if !(0..segments).contains(&segment)
                || !(0..=offset_max).contains(&offset)
                || offset % 16 != 0
                || !(16..=LEN_MAX as u64).contains(&len)
                || len % 16 != 0
                || !(1..=32).contains(&members)
                || member >= members
                || !(0..=VERSION_MAX as i64).contains(&version)
            {
                return Err(format!(
                    "bad data entry: segment {segment} offset {offset} len {len} \
                     member {member} of {members} version {version}"
                ));
            }
            let loc = Location::unit_member(
                SegmentId(segment as u32),
                offset as u32,
                len as u32,
                member,
                members,
            );
            Ok(Entry::new(Slot::Data(loc), version as u64))
        }
    }
}

fn get_entry(
    input: &mut ByteReader,
    previous: &mut Previous,
    segment_count: u32,
) -> Result<Entry, String> {
    check_entry(get_raw_entry(input, previous)?, segment_count)
}

/// The page payload of a leaf that is in RAM: its uncompressed length
/// (u32), then the LZ4 block of its encoding.
pub(super) fn encode_page(leaf: &Leaf) -> Vec<u8> {
    let mut raw = ByteWriter::new();
    let mut previous = Previous::default();
    match leaf {
        Leaf::Run { blocks, entry } => {
            raw.u8(FORM_RUN);
            raw.varint(*blocks);
            put_entry(&mut raw, *entry, &mut previous);
        }
        Leaf::Dense { column, .. } => {
            raw.u8(FORM_DENSE);
            for entry in column.entries() {
                put_entry(&mut raw, entry, &mut previous);
            }
        }
        Leaf::Sparse {
            blocks,
            keys,
            column,
        } => {
            raw.u8(FORM_SPARSE);
            raw.varint(*blocks);
            raw.varint(keys.len() as u64);
            let mut last = 0u32;
            for (index, &key) in keys.iter().enumerate() {
                raw.varint((key - last) as u64);
                last = key;
                put_entry(&mut raw, column.get(index), &mut previous);
            }
        }
        Leaf::Paged { .. } => unreachable!("encoding a leaf that is not in RAM"),
    }
    debug_assert!(raw.buf.len() <= PAGE_RAW_MAX_BYTES);
    let mut payload = ByteWriter::new();
    payload.u32(raw.buf.len() as u32);
    payload.bytes(&lz4_compress(&raw.buf));
    payload.buf
}

/// Blocks a run or sparse leaf read from a page covers: whole chunks.
fn get_blocks(input: &mut ByteReader) -> Result<u64, String> {
    let blocks = input.varint()?;
    if blocks == 0 || blocks & CHUNK_MASK != 0 {
        return Err(format!("a leaf of {blocks} blocks"));
    }
    Ok(blocks)
}

/// A run leaf's blocks and entry (which is not data).
fn get_run(input: &mut ByteReader, segment_count: u32) -> Result<(u64, Entry), String> {
    let blocks = get_blocks(input)?;
    let entry = get_entry(input, &mut Previous::default(), segment_count)?;
    if entry.is_data() {
        return Err("a run of data".into());
    }
    Ok((blocks, entry))
}

/// How many entries a sparse leaf lists.
fn get_key_count(input: &mut ByteReader) -> Result<usize, String> {
    let count = input.varint()? as usize;
    if count == 0 || count > SPARSE_MAX {
        return Err(format!("a sparse leaf of {count} entries"));
    }
    Ok(count)
}

/// A sparse leaf's key `index`, after `key` (keys strictly increase).
fn get_key(input: &mut ByteReader, index: usize, key: u64) -> Result<u64, String> {
    let delta = input.varint()?;
    if index > 0 && delta == 0 {
        return Err("sparse keys out of order".into());
    }
    Ok(key.saturating_add(delta))
}

/// Decodes a page payload into a leaf (whose invariants the map checks).
pub(super) fn decode_page(payload: &[u8], segment_count: u32) -> Result<Leaf, String> {
    let raw = decompress_page(payload)?;
    let mut input = ByteReader::new(&raw);
    let mut previous = Previous::default();
    let leaf = match input.u8()? {
        FORM_RUN => {
            let (blocks, entry) = get_run(&mut input, segment_count)?;
            Leaf::Run { blocks, entry }
        }
        FORM_DENSE => {
            let mut entries = [Entry::default(); CHUNK_BLOCKS as usize];
            for entry in entries.iter_mut() {
                *entry = get_entry(&mut input, &mut previous, segment_count)?;
            }
            Leaf::dense(&entries)
        }
        FORM_SPARSE => {
            let blocks = get_blocks(&mut input)?;
            let count = get_key_count(&mut input)?;
            let (mut keys, mut entries) = (Vec::with_capacity(count), Vec::with_capacity(count));
            let mut key = 0u64;
            for index in 0..count {
                key = get_key(&mut input, index, key)?;
                if key >= blocks {
                    return Err(format!("key {key} beyond a leaf of {blocks} blocks"));
                }
                keys.push(key as u32);
                entries.push(get_entry(&mut input, &mut previous, segment_count)?);
            }
            Leaf::sparse(blocks, keys, &entries)
        }
        other => return Err(format!("bad leaf form {other}")),
    };
    if input.remaining() != 0 {
        return Err(format!("{} bytes after the leaf", input.remaining()));
    }
    Ok(leaf)
}

/// A page payload's encoding, decompressed.
fn decompress_page(payload: &[u8]) -> Result<Vec<u8>, String> {
    let mut head = ByteReader::new(payload);
    let raw_len = head.u32()? as usize;
    if raw_len > PAGE_RAW_MAX_BYTES {
        return Err(format!("page claims {raw_len} uncompressed bytes"));
    }
    lz4_decompress(&payload[4..], raw_len)
}

/// The entries of blocks `offset..offset + count` of the leaf of `blocks`
/// blocks a page payload holds, without building the leaf (a lookup that
/// does not keep the leaf: `Map::peek_fault`). The encoding is read up to
/// the last of them; the entries before them are skipped, their deltas
/// followed but their fields unchecked, and those returned are checked as
/// [`decode_page`] checks every entry. The leaf's size must match `blocks`.
pub(super) fn decode_page_range(
    payload: &[u8],
    segment_count: u32,
    blocks: u64,
    offset: u64,
    count: u64,
) -> Result<Vec<Entry>, String> {
    let end = offset
        .checked_add(count)
        .filter(|&end| end <= blocks)
        .ok_or_else(|| format!("blocks {offset}+{count} beyond a leaf of {blocks}"))?;
    let raw = decompress_page(payload)?;
    let mut input = ByteReader::new(&raw);
    let mut previous = Previous::default();
    let mut entries = vec![Entry::default(); count as usize];
    let leaf_blocks = |found: u64| {
        if found == blocks {
            Ok(())
        } else {
            Err(format!("a page of {found} blocks for a leaf of {blocks}"))
        }
    };
    match input.u8()? {
        FORM_RUN => {
            let (found, entry) = get_run(&mut input, segment_count)?;
            leaf_blocks(found)?;
            entries.fill(entry);
        }
        FORM_DENSE => {
            leaf_blocks(CHUNK_BLOCKS)?;
            for _ in 0..offset {
                get_raw_entry(&mut input, &mut previous)?;
            }
            for entry in entries.iter_mut() {
                *entry = get_entry(&mut input, &mut previous, segment_count)?;
            }
        }
        FORM_SPARSE => {
            leaf_blocks(get_blocks(&mut input)?)?;
            let mut key = 0u64;
            for index in 0..get_key_count(&mut input)? {
                key = get_key(&mut input, index, key)?;
                if key >= end {
                    break;
                }
                if key < offset {
                    get_raw_entry(&mut input, &mut previous)?;
                } else {
                    entries[(key - offset) as usize] =
                        get_entry(&mut input, &mut previous, segment_count)?;
                }
            }
        }
        other => return Err(format!("bad leaf form {other}")),
    }
    Ok(entries)
}

/// The payload of the page of the leaf at `start`, read at `loc`: from
/// copy 0, or copy 1 if copy 0's does not verify.
pub(crate) fn read_page_payload(
    media: &dyn Media,
    store: &PageStore,
    start: u64,
    loc: PageLoc,
) -> Result<Vec<u8>> {
    let mut problems = Vec::new();
    let mut bytes = vec![0u8; loc.len as usize];
    let fits = loc.offset as u64 + loc.len as u64 <= store.segment_size_bytes;
    for (copy, &segment) in loc.segments.iter().enumerate() {
        if !fits || segment.0 >= store.segment_count {
            problems.push(format!("copy {copy}: no segment holds {loc:?}"));
            continue;
        }
        media.read(segment, loc.offset as u64, &mut bytes)?;
        match decode_record(&bytes, &store.key, None) {
            Ok((header, payload))
                if header.kind == RecordKind::MapChunk
                    && header.lba == start
                    && header.version == loc.generation =>
            {
                return Ok(payload.to_vec());
            }
            Ok((header, _)) => problems.push(format!(
                "copy {copy}: found {:?} #{} of generation {}",
                header.kind, header.lba, header.version
            )),
            Err(error) => problems.push(format!("copy {copy}: {error}")),
        }
    }
    Err(Error::CorruptImage(format!(
        "the map page of block {start} is damaged in both checkpoint copies ({})",
        problems.join("; ")
    )))
}

/// The leaf at `start` read back from its page.
pub(super) fn read_page(
    media: &dyn Media,
    store: &PageStore,
    start: u64,
    loc: PageLoc,
) -> Result<Leaf> {
    let payload = read_page_payload(media, store, start, loc)?;
    decode_page(&payload, store.segment_count).map_err(|problem| {
        Error::CorruptImage(format!(
            "the map page of block {start} is malformed: {problem}"
        ))
    })
}
