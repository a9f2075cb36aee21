//! The checkpoint dump's byte format: the map's directory and pages and
//! the segment table as map-chunk records, written twice.
//!
//! A dump starts with a stream of tagged items (the map's totals, one
//! directory entry per leaf, then segments), cut into payloads of at most
//! [`chunk_target_bytes`] uncompressed bytes, each compressed with LZ4 into
//! one `MapChunk` record: header `lba` = record index, `version` = the
//! generation of the root that wrote it. The pages this checkpoint writes
//! follow, one record per leaf that changed or moved (`map/page.rs`: `lba`
//! = the leaf's first block). Both copies place the records identically
//! ([`place`]), each in its own segments, so that a record damaged in one
//! copy is read from the other. The directory names every leaf: a page
//! written with it by its length (opening works out where it is by the
//! same placement), a page an earlier checkpoint wrote and this one keeps
//! by its segment, offset and generation (format 4). The root's list of
//! dump segments ([`DumpRef`]) holds this dump's own segments, then every
//! earlier one a kept page lives in, so recovery keeps them all. Opening
//! reads only the directory records ([`load_dump`]); the map reads a page
//! when it needs the leaf. A format 2 dump holds map chunks instead of a
//! directory, and loads into a map entirely in RAM.
//! docs/format.md gives the layout; `volume/checkpoint.rs` is the
//! procedure that writes one.
//!
//! Decoding trusts nothing read from the medium: every length, index,
//! segment and version is checked before use.

use crate::bytes::{ByteReader, ByteWriter};
use crate::codec::{lz4_compress, lz4_decompress, CodecId};
use crate::error::{Error, Result};
use crate::map::{
    Chunk, Entry, Location, Map, MapCounts, PageLoc, PageSource, PageStore, RangeState, Slot,
    SnapshotPage, CHUNK_BLOCKS, SPACE_BLOCKS, TABLE_BASE, VERSION_MAX,
};
use crate::media::Media;
use crate::meta::DumpRef;
use crate::record::{
    append_record, decode_record, record_len_for_payload, RecordHeader, RecordKey, RecordKind,
    MAP_CHUNK_PAYLOAD_MAX, RECORD_ALIGN, UNIT_BLOCKS_MAX, UNIT_PAYLOAD_MAX,
};
use crate::snapshots::SNAPSHOTS_MAX;
use crate::units::SegmentId;

const ITEM_END: u8 = 0;
const ITEM_CHUNK: u8 = 1;
const ITEM_SEGMENT: u8 = 2;
/// A segment with the bytes the cold-data pass wrote into it (format 2).
const ITEM_SEGMENT_COLD: u8 = 3;
/// The map's counts, for a map whose leaves are pages (format 3).
const ITEM_MAP_TOTALS: u8 = 4;
/// A leaf's directory entry: its range and the length of its page, which
/// follows the directory in this dump (format 3).
const ITEM_PAGE: u8 = 5;
/// A leaf's directory entry whose page an earlier checkpoint wrote and
/// this one keeps: its range, the page's length, the segment of its copy
/// 0, its offset and the generation that wrote it (format 4).
const ITEM_KEPT_PAGE: u8 = 6;
/// A segment with the bytes the cold-data pass wrote into it and the
/// bytes written below full effort (format 9).
const ITEM_SEGMENT_EFFORT: u8 = 7;

const FORM_UNIFORM: u8 = 0;
const FORM_MIXED: u8 = 1;

const TAG_HOLE: u8 = 0;
const TAG_ZERO: u8 = 1;
const TAG_DATA: u8 = 2;
const TAG_DAMAGED: u8 = 3;
/// A block of a unit record (format 2): a data entry plus its place in
/// the unit.
const TAG_UNIT_MEMBER: u8 = 4;

/// The most one map entry takes in a dump: a tag, zigzag varints of a
/// segment delta (33 bits: 5 bytes) and an offset delta (5 bytes), a
/// length (13 bits: 2 bytes) and a version delta (49 bits: 7 bytes).
const ENTRY_MAX_BYTES: u64 = 1 + 5 + 5 + 2 + 7;

/// The largest uncompressed payload a chunk record may claim.
const RAW_CHUNK_MAX_BYTES: usize = 64 * MAP_CHUNK_PAYLOAD_MAX as usize;

/// Uncompressed bytes per checkpoint chunk record.
pub(crate) fn chunk_target_bytes(segment_size: u64) -> usize {
    (segment_size / 4).min(64 * 1024) as usize
}

/// The most a chunk record can occupy: a full target plus one item,
/// LZ4's worst-case expansion and the record header.
fn chunk_record_max_bytes(segment_size: u64) -> u64 {
    let raw = chunk_target_bytes(segment_size) as u64 + 16 + CHUNK_BLOCKS * ENTRY_MAX_BYTES + 1;
    raw + raw / 255 + 16 + 4 + 48
}

/// Segments a checkpoint's two dump copies need, at most, for a map of
/// `pages` leaves on `segment_count` segments of `segment_size` bytes.
pub(crate) fn dump_segments_for(pages: u64, segment_count: u64, segment_size: u64) -> u64 {
    let usable = segment_size
        .saturating_sub(chunk_record_max_bytes(segment_size))
        .max(1);
    let segments = 2 * dump_size_for(pages, segment_count).div_ceil(usable).max(1);
    debug_assert!(
        segments.is_multiple_of(2),
        "both copies take the same segments"
    );
    segments
}

/// Upper bound of one dump copy's bytes for `pages` map leaves and `segments` segments.
fn dump_size_for(pages: u64, segments: u64) -> u64 {
    // A leaf holds at most 256 entries (a sparse leaf's carry a key of up
    // to 5 bytes, and a unit member's entry 2 bytes more); then its page's
    // length prefix, LZ4's worst case, record header and padding, and its
    // directory entry.
    let per_page = CHUNK_BLOCKS * (ENTRY_MAX_BYTES + 7) + 128;
    let raw = pages * per_page + segments * 40 + 64;
    // LZ4 worst case plus per-record headers.
    raw + raw / 255 + 16 + (raw / (16 * 1024) + 1) * 64
}

/// A version read from the medium, checked against the map's 48 bits.
fn get_version(input: &mut ByteReader, what: &str) -> Result<u64, String> {
    let version = input.varint()?;
    if version > VERSION_MAX {
        return Err(format!("version {version} out of range in {what}"));
    }
    Ok(version)
}

#[cfg(test)]
fn range_tag(state: RangeState) -> u8 {
    match state {
        RangeState::Hole => TAG_HOLE,
        RangeState::Zero => TAG_ZERO,
        RangeState::Damaged => TAG_DAMAGED,
    }
}

fn tag_range(tag: u8) -> Result<RangeState, String> {
    match tag {
        TAG_HOLE => Ok(RangeState::Hole),
        TAG_ZERO => Ok(RangeState::Zero),
        TAG_DAMAGED => Ok(RangeState::Damaged),
        other => Err(format!("bad range tag {other}")),
    }
}

/// What a dump records about one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DumpedSegment {
    pub seq: u64,
    pub fill_bytes: u64,
    pub max_version: u64,
    pub cold_bytes: u64,
    pub fast_bytes: u64,
}

/// Cuts the item stream into LZ4-compressed chunk payloads.
struct Payloads {
    target_bytes: usize,
    raw: ByteWriter,
    done: Vec<Vec<u8>>,
}

impl Payloads {
    /// Ends the current payload once it reaches the target (or, with
    /// `force`, if it holds anything).
    fn cut(&mut self, force: bool) {
        let raw = &mut self.raw;
        let full = raw.buf.len() >= self.target_bytes;
        if !full && (!force || raw.buf.is_empty()) {
            return;
        }
        raw.u8(ITEM_END);
        let mut payload = ByteWriter::new();
        payload.u32(raw.buf.len() as u32);
        payload.bytes(&lz4_compress(&raw.buf));
        assert!(
            payload.buf.len() as u32 <= MAP_CHUNK_PAYLOAD_MAX,
            "a dump chunk of {} bytes exceeds the record limit",
            payload.buf.len()
        );
        self.done.push(payload.buf);
        raw.buf.clear();
    }
}

#[cfg(test)]
fn encode_chunk(out: &mut ByteWriter, index: u64, chunk: &Chunk) {
    out.u8(ITEM_CHUNK);
    out.u64(index);
    match chunk {
        Chunk::Uniform { state, version } => {
            out.u8(FORM_UNIFORM);
            out.u8(range_tag(*state));
            out.varint(*version);
        }
        Chunk::Mixed(entries) => {
            out.u8(FORM_MIXED);
            let (mut segment, mut offset, mut version) = (0i64, 0i64, 0i64);
            for entry in entries.iter() {
                match entry.slot() {
                    Slot::Hole => out.u8(TAG_HOLE),
                    Slot::Zero => {
                        out.u8(TAG_ZERO);
                        out.varint(entry.version());
                    }
                    Slot::Damaged => {
                        out.u8(TAG_DAMAGED);
                        out.varint(entry.version());
                    }
                    Slot::Shared { .. } => unreachable!("format 2 had no shared entries"),
                    Slot::Data(loc) => {
                        out.u8(if loc.members > 1 {
                            TAG_UNIT_MEMBER
                        } else {
                            TAG_DATA
                        });
                        out.zigzag(loc.segment.0 as i64 - segment);
                        out.zigzag(loc.offset as i64 - offset);
                        out.varint(loc.len as u64);
                        if loc.members > 1 {
                            out.u8(loc.member);
                            out.u8(loc.members);
                        }
                        out.zigzag(entry.version() as i64 - version);
                        segment = loc.segment.0 as i64;
                        offset = loc.offset as i64 + loc.len as i64;
                        version = entry.version() as i64;
                    }
                }
            }
        }
    }
}

/// Serialises `map` and `segments` the way format 2 did (map chunks), for
/// the tests of reading old dumps.
#[cfg(test)]
pub(crate) fn encode_chunk_dump(
    map: &Map,
    segments: impl Iterator<Item = (SegmentId, DumpedSegment)>,
    target_bytes: usize,
) -> Vec<Vec<u8>> {
    let mut payloads = Payloads {
        target_bytes,
        raw: ByteWriter::new(),
        done: Vec::new(),
    };
    map.for_each_chunk(|index, chunk| {
        encode_chunk(&mut payloads.raw, index, chunk);
        payloads.cut(false);
    });
    encode_segments(&mut payloads, segments);
    payloads.cut(true);
    payloads.done
}

fn encode_segments(
    payloads: &mut Payloads,
    segments: impl Iterator<Item = (SegmentId, DumpedSegment)>,
) {
    for (segment, dumped) in segments {
        let out = &mut payloads.raw;
        let tag = match (dumped.cold_bytes, dumped.fast_bytes) {
            (0, 0) => ITEM_SEGMENT,
            (_, 0) => ITEM_SEGMENT_COLD,
            _ => ITEM_SEGMENT_EFFORT,
        };
        out.u8(tag);
        out.u32(segment.0);
        out.u64(dumped.seq);
        out.u64(dumped.fill_bytes);
        out.u64(dumped.max_version);
        if tag != ITEM_SEGMENT {
            out.u64(dumped.cold_bytes);
        }
        if tag == ITEM_SEGMENT_EFFORT {
            out.u64(dumped.fast_bytes);
        }
        payloads.cut(false);
    }
}

/// The directory of a dump whose map is `pages` (a checkpoint's snapshot,
/// in block order) with `counts`, and `segments` (every segment that is
/// not free and never used), as chunk payloads of at most `target_bytes`
/// uncompressed bytes each.
pub(crate) fn encode_directory(
    pages: &[SnapshotPage],
    counts: MapCounts,
    segments: impl Iterator<Item = (SegmentId, DumpedSegment)>,
    target_bytes: usize,
) -> Vec<Vec<u8>> {
    let mut payloads = Payloads {
        target_bytes,
        raw: ByteWriter::new(),
        done: Vec::new(),
    };
    let out = &mut payloads.raw;
    out.u8(ITEM_MAP_TOTALS);
    out.varint(counts.data_blocks);
    out.varint(counts.zero_blocks);
    out.varint(counts.damaged_blocks);
    out.varint(counts.stored_bytes);
    let mut end = 0u64;
    for page in pages {
        let out = &mut payloads.raw;
        let kept = match page.source {
            PageSource::Kept(loc) => Some(loc),
            _ => None,
        };
        out.u8(if kept.is_some() {
            ITEM_KEPT_PAGE
        } else {
            ITEM_PAGE
        });
        out.varint(page.start - end);
        out.varint(page.blocks);
        out.varint(page.chunk_items);
        out.varint(page.payload_len() as u64);
        if let Some(loc) = kept {
            out.varint(loc.segments[0].0 as u64);
            out.varint(loc.offset as u64 / RECORD_ALIGN);
            out.varint(loc.generation);
        }
        end = page.start + page.blocks;
        payloads.cut(false);
    }
    encode_segments(&mut payloads, segments);
    payloads.cut(true);
    payloads.done
}

/// A dump's directory as read back: the map's totals and its leaves'
/// ranges and page lengths, in block order.
#[derive(Debug, Default)]
pub(crate) struct Directory {
    totals: Option<MapCounts>,
    pages: Vec<DirectoryPage>,
    /// End of the last page's range.
    end: u64,
}

/// A directory page's (start, blocks, chunk items, payload length, and
/// for a kept page its copy-0 segment, offset and generation).
#[cfg(test)]
pub(crate) type PageFields = (u64, u64, u64, u32, Option<(u32, u32, u64)>);

#[cfg(test)]
impl Directory {
    /// The map's totals and every page's fields, for the golden tests.
    pub(crate) fn contents(&self) -> (Option<MapCounts>, Vec<PageFields>) {
        let pages = self
            .pages
            .iter()
            .map(|page| {
                let kept = page.kept.map(|k| (k.segment.0, k.offset, k.generation));
                (
                    page.start,
                    page.blocks,
                    page.chunk_items,
                    page.payload_len,
                    kept,
                )
            })
            .collect();
        (self.totals, pages)
    }
}

#[derive(Debug, Clone, Copy)]
struct DirectoryPage {
    start: u64,
    blocks: u64,
    chunk_items: u64,
    payload_len: u32,
    /// Where an earlier checkpoint wrote the page, if this dump keeps it.
    kept: Option<KeptPage>,
}

/// A kept page's place as the directory gives it.
#[derive(Debug, Clone, Copy)]
struct KeptPage {
    /// The segment of its copy 0.
    segment: SegmentId,
    offset: u32,
    /// The generation of the checkpoint that wrote it.
    generation: u64,
}

/// Decodes a data entry (or, with `unit`, a unit member) of a mixed
/// chunk, relative to the previous one.
fn decode_data_entry(
    input: &mut ByteReader,
    index: u64,
    segment_count: usize,
    previous: &mut (i64, i64, i64),
    unit: bool,
) -> Result<Entry, String> {
    let (segment, offset, version) = previous;
    *segment += input.zigzag()?;
    *offset += input.zigzag()?;
    let len = input.varint()?;
    let (member, members) = if unit {
        (input.u8()?, input.u8()?)
    } else {
        (0, 1)
    };
    *version += input.zigzag()?;
    let len_max = record_len_for_payload(UNIT_PAYLOAD_MAX as usize) as i64;
    if !(0..segment_count as i64).contains(segment)
        || !(0..u32::MAX as i64).contains(offset)
        || *offset % RECORD_ALIGN as i64 != 0
        || !(16..=len_max).contains(&(len as i64))
        || len % RECORD_ALIGN != 0
        || !(0..=VERSION_MAX as i64).contains(version)
        || (unit && !(2..=UNIT_BLOCKS_MAX as u8).contains(&members))
        || member >= members
    {
        return Err(format!(
            "bad data entry in chunk {index}: segment {segment} offset {offset} len {len} \
             member {member} of {members}"
        ));
    }
    let loc = Location::unit_member(
        SegmentId(*segment as u32),
        *offset as u32,
        len as u32,
        member,
        members,
    );
    let entry = Entry::new(Slot::Data(loc), *version as u64);
    *offset += len as i64;
    Ok(entry)
}

fn decode_chunk(input: &mut ByteReader, index: u64, segment_count: usize) -> Result<Chunk, String> {
    match input.u8()? {
        FORM_UNIFORM => {
            let state = tag_range(input.u8()?)?;
            let version = get_version(input, &format!("chunk {index}"))?;
            Ok(Chunk::Uniform { state, version })
        }
        FORM_MIXED => {
            let mut entries = Box::new([Entry::default(); CHUNK_BLOCKS as usize]);
            let mut previous = (0i64, 0i64, 0i64);
            for entry in entries.iter_mut() {
                *entry = match input.u8()? {
                    TAG_HOLE => Entry::default(),
                    tag @ (TAG_ZERO | TAG_DAMAGED) => {
                        let version = get_version(input, &format!("chunk {index}"))?;
                        Entry::new(tag_range(tag)?.slot(), version)
                    }
                    tag @ (TAG_DATA | TAG_UNIT_MEMBER) => decode_data_entry(
                        input,
                        index,
                        segment_count,
                        &mut previous,
                        tag == TAG_UNIT_MEMBER,
                    )?,
                    other => return Err(format!("bad entry tag {other}")),
                };
            }
            Ok(Chunk::Mixed(entries))
        }
        other => Err(format!("bad chunk form {other}")),
    }
}

/// Decodes one chunk record's payload into `map` and `segments` (indexed
/// by segment; its length is the medium's segment count).
pub(crate) fn decode_chunk_payload(
    payload: &[u8],
    map: &mut Map,
    directory: &mut Directory,
    segments: &mut [Option<DumpedSegment>],
    logical_blocks: u64,
) -> Result<(), String> {
    let mut head = ByteReader::new(payload);
    let raw_len = head.u32()? as usize;
    if raw_len > RAW_CHUNK_MAX_BYTES {
        return Err(format!("chunk claims {raw_len} uncompressed bytes"));
    }
    let raw = lz4_decompress(&payload[4..], raw_len)?;
    let mut input = ByteReader::new(&raw);
    let chunk_limit = logical_blocks.div_ceil(CHUNK_BLOCKS);
    loop {
        match input.u8()? {
            ITEM_END => return Ok(()),
            ITEM_CHUNK => {
                let index = input.u64()?;
                if index >= chunk_limit {
                    return Err(format!("map chunk {index} lies beyond the volume"));
                }
                let chunk = decode_chunk(&mut input, index, segments.len())?;
                map.insert_chunk(index, chunk)?;
            }
            ITEM_MAP_TOTALS => {
                if directory.totals.is_some() {
                    return Err("the map's totals appear twice".into());
                }
                directory.totals = Some(MapCounts {
                    data_blocks: input.varint()?,
                    zero_blocks: input.varint()?,
                    damaged_blocks: input.varint()?,
                    stored_bytes: input.varint()?,
                });
            }
            tag @ (ITEM_PAGE | ITEM_KEPT_PAGE) => {
                let start = directory
                    .end
                    .checked_add(input.varint()?)
                    .ok_or("a map page beyond any volume")?;
                let blocks = input.varint()?;
                let chunk_items = input.varint()?;
                let payload_len = input.varint()?;
                let end = start
                    .checked_add(blocks)
                    .ok_or("a map page beyond any volume")?;
                // Within the volume, the snapshots' key spaces (format 7;
                // `check` verifies each kept entry names a block of the
                // volume) or the shared table's cells (format 5).
                let in_table = start >= TABLE_BASE
                    && end <= (TABLE_BASE + VERSION_MAX + 1).next_multiple_of(CHUNK_BLOCKS);
                let spaces_end = (SNAPSHOTS_MAX as u64 + 1) * SPACE_BLOCKS;
                let in_spaces = start < spaces_end && end <= spaces_end;
                if end > chunk_limit * CHUNK_BLOCKS && !in_table && !in_spaces {
                    return Err(format!("map page at {start} lies beyond the volume"));
                }
                if !(1..=MAP_CHUNK_PAYLOAD_MAX as u64).contains(&payload_len) {
                    return Err(format!("map page at {start} of {payload_len} bytes"));
                }
                let kept = if tag == ITEM_KEPT_PAGE {
                    let segment = input.varint()?;
                    let offset = input.varint()?.saturating_mul(RECORD_ALIGN);
                    let generation = input.varint()?;
                    if segment >= segments.len() as u64 || offset > u32::MAX as u64 {
                        return Err(format!(
                            "map page at {start} kept in segment {segment} at offset {offset}"
                        ));
                    }
                    Some(KeptPage {
                        segment: SegmentId(segment as u32),
                        offset: offset as u32,
                        generation,
                    })
                } else {
                    None
                };
                directory.pages.push(DirectoryPage {
                    start,
                    blocks,
                    chunk_items,
                    payload_len: payload_len as u32,
                    kept,
                });
                directory.end = end;
            }
            tag @ (ITEM_SEGMENT | ITEM_SEGMENT_COLD | ITEM_SEGMENT_EFFORT) => {
                let segment = input.u32()? as usize;
                let dumped = DumpedSegment {
                    seq: input.u64()?,
                    fill_bytes: input.u64()?,
                    max_version: input.u64()?,
                    cold_bytes: match tag {
                        ITEM_SEGMENT => 0,
                        _ => input.u64()?,
                    },
                    fast_bytes: match tag {
                        ITEM_SEGMENT_EFFORT => input.u64()?,
                        _ => 0,
                    },
                };
                if dumped.max_version > VERSION_MAX {
                    return Err(format!(
                        "segment {segment}: version {} out of range",
                        dumped.max_version
                    ));
                }
                let slot = segments
                    .get_mut(segment)
                    .ok_or_else(|| format!("segment {segment} lies beyond the medium"))?;
                *slot = Some(dumped);
            }
            other => return Err(format!("bad item tag {other}")),
        }
    }
}

/// Places records of `record_lens` bytes into segments in order, each
/// where the last ended or, if it does not fit there, at the start of the
/// next segment. Both
/// copies use this same layout, and opening works out where pages are by
/// it ([`Cursor`]).
pub(crate) fn place(record_lens: &[u64], segment_size: u64) -> Placement {
    let mut placement = Placement {
        segments: vec![Vec::new()],
        at: Vec::with_capacity(record_lens.len()),
    };
    let mut cursor = Cursor::default();
    for (index, &len) in record_lens.iter().enumerate() {
        assert!(len <= segment_size, "dump record larger than a segment");
        let (position, offset) = cursor.place(len, segment_size);
        if position as usize == placement.segments.len() {
            placement.segments.push(Vec::new());
        }
        placement.segments[position as usize].push(index);
        placement.at.push((position, offset));
    }
    placement
}

/// Where [`place`] put a dump's records.
pub(crate) struct Placement {
    /// Per segment, the indices of the records it holds.
    pub segments: Vec<Vec<usize>>,
    /// Per record, its segment's position and its offset there.
    pub at: Vec<(u32, u64)>,
}

/// Where the next dump record goes: a segment's position and an offset.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Cursor {
    position: u32,
    offset: u64,
}

impl Cursor {
    /// Places a record of `len` bytes; returns its position and offset.
    pub(crate) fn place(&mut self, len: u64, segment_size: u64) -> (u32, u64) {
        if self.offset + len > segment_size {
            self.position += 1;
            self.offset = 0;
        }
        let at = (self.position, self.offset);
        self.offset += len;
        at
    }
}

/// Builds the image of one dump segment: its records with `seq`, padded to whole pages.
/// `records` are (header `lba`, payload) pairs.
pub(crate) fn build_segment(
    records: &[(u64, &[u8])],
    seq: u64,
    generation: u64,
    page_size: u64,
    key: &RecordKey,
) -> Vec<u8> {
    let mut image = Vec::new();
    for &(lba, payload) in records {
        let header = RecordHeader {
            kind: RecordKind::MapChunk,
            codec: CodecId::Lz4 as u8,
            seg_seq: seq as u32,
            lba,
            version: generation,
            payload_len: payload.len() as u32,
            crc: 0,
        };
        append_record(&mut image, header, payload, crc32c::crc32c(payload), key);
    }
    let padded = (image.len() as u64).div_ceil(page_size) * page_size;
    image.resize(padded.max(page_size) as usize, 0);
    debug_assert!((image.len() as u64).is_multiple_of(page_size));
    image
}

/// Reads a dump back into a map and per-segment facts. A record damaged in
/// one copy is taken from the other; damage in both is an error. Reads
/// only the directory: the map's leaves stay paged out, and the map reads
/// them from this dump when it needs them.
pub(crate) fn load_dump(
    media: &dyn Media,
    key: &RecordKey,
    dump: &DumpRef,
    logical_blocks: u64,
    map: &mut Map,
) -> Result<Vec<Option<DumpedSegment>>> {
    let geometry = media.geometry();
    let mut segments = vec![None; geometry.segment_count as usize];
    if dump.copies[0].len() != dump.copies[1].len() {
        return Err(Error::CorruptImage(
            "the two checkpoint copies differ in length".into(),
        ));
    }
    let read_segment = |segment: SegmentId| -> Result<Vec<u8>> {
        if segment.0 >= geometry.segment_count {
            return Err(Error::CorruptImage(format!(
                "checkpoint names segment {segment} beyond the medium"
            )));
        }
        let mut bytes = vec![0u8; geometry.segment_size_bytes as usize];
        media.read(segment, 0, &mut bytes)?;
        Ok(bytes)
    };
    let mut expected = 0u64;
    let mut problems = Vec::new();
    let mut directory = Directory::default();
    let mut cursor = Cursor::default();
    for (position, (&first, &second)) in
        dump.copies[0].iter().zip(dump.copies[1].iter()).enumerate()
    {
        if expected == dump.record_count {
            break;
        }
        let copies = [read_segment(first)?, read_segment(second)?];
        let mut offset = 0usize;
        while expected < dump.record_count && offset < copies[0].len() {
            let mut decoded = None;
            for (copy, bytes) in copies.iter().enumerate() {
                match decode_record(&bytes[offset..], key, None) {
                    Ok((header, payload))
                        if header.kind == RecordKind::MapChunk
                            && header.version == dump.generation
                            && header.lba == expected =>
                    {
                        decoded = Some((header, payload));
                        break;
                    }
                    Ok((header, _)) => problems.push(format!(
                        "copy {copy} segment #{position} offset {offset}: unexpected record {:?} #{} gen {}",
                        header.kind, header.lba, header.version
                    )),
                    Err(e) => problems.push(format!("copy {copy} segment #{position} offset {offset}: {e}")),
                }
            }
            let Some((header, payload)) = decoded else {
                break; // end of this segment's records, or damage in both copies
            };
            decode_chunk_payload(payload, map, &mut directory, &mut segments, logical_blocks)
                .map_err(|e| {
                    Error::CorruptImage(format!("checkpoint chunk {expected} is malformed: {e}"))
                })?;
            expected += 1;
            offset += header.record_len() as usize;
            cursor = Cursor {
                position: position as u32,
                offset: offset as u64,
            };
        }
    }
    if expected != dump.record_count {
        return Err(Error::CorruptImage(format!(
            "checkpoint unreadable: chunk {expected} of {} is missing or damaged in both copies ({})",
            dump.record_count,
            problems.last().cloned().unwrap_or_default()
        )));
    }
    install_pages(map, directory, cursor, dump, key, geometry)?;
    Ok(segments)
}

/// Installs the directory's leaves in `map`, paged out, at the places the
/// dump's layout gives their pages after the directory's records.
fn install_pages(
    map: &mut Map,
    directory: Directory,
    mut cursor: Cursor,
    dump: &DumpRef,
    key: &RecordKey,
    geometry: crate::media::MediaGeometry,
) -> Result<()> {
    let segment_size = geometry.segment_size_bytes;
    let corrupt = |problem: String| Error::CorruptImage(format!("checkpoint directory: {problem}"));
    let Some(totals) = directory.totals else {
        if directory.pages.is_empty() {
            return Ok(()); // a format 2 dump: the map is in RAM
        }
        return Err(corrupt("map pages without the map's totals".into()));
    };
    // Where each copy-0 segment of the root's list is, for kept pages.
    let positions: std::collections::HashMap<SegmentId, usize> = dump.copies[0]
        .iter()
        .enumerate()
        .map(|(position, &segment)| (segment, position))
        .collect();
    for page in &directory.pages {
        let len = record_len_for_payload(page.payload_len as usize);
        if len > segment_size {
            return Err(corrupt(format!(
                "map page at {} exceeds a segment",
                page.start
            )));
        }
        let (position, offset, generation) = match page.kept {
            None => {
                let (position, offset) = cursor.place(len, segment_size);
                (position as usize, offset, dump.generation)
            }
            Some(kept) => {
                let position = *positions.get(&kept.segment).ok_or_else(|| {
                    corrupt(format!(
                        "map page at {} is kept in segment {}, which the root does not list",
                        page.start, kept.segment
                    ))
                })?;
                let generation = kept.generation;
                if generation == 0 || generation >= dump.generation {
                    return Err(corrupt(format!(
                        "map page at {} is kept from generation {generation}, \
                         not older than its dump's {}",
                        page.start, dump.generation
                    )));
                }
                if kept.offset as u64 + len > segment_size {
                    return Err(corrupt(format!(
                        "map page at {} is kept beyond its segment's end",
                        page.start
                    )));
                }
                (position, kept.offset as u64, generation)
            }
        };
        if position >= dump.copies[0].len() {
            return Err(corrupt(format!(
                "map page at {} lies beyond the dump's segments",
                page.start
            )));
        }
        let loc = PageLoc {
            segments: [dump.copies[0][position], dump.copies[1][position]],
            offset: offset as u32,
            len: len as u32,
            generation,
        };
        map.insert_paged(page.start, page.blocks, page.chunk_items, loc)
            .map_err(corrupt)?;
    }
    map.add_paged_counts(totals);
    map.set_store(PageStore {
        key: *key,
        segment_count: geometry.segment_count,
        segment_size_bytes: segment_size,
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_zigzag_round_trip() {
        for value in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut out = ByteWriter::new();
            out.varint(value);
            assert_eq!(ByteReader::new(&out.buf).varint(), Ok(value));
        }
        for delta in [0i64, 1, -1, 1000, -1000, i64::MAX, i64::MIN] {
            let mut out = ByteWriter::new();
            out.zigzag(delta);
            assert_eq!(ByteReader::new(&out.buf).zigzag(), Ok(delta));
        }
        assert!(ByteReader::new(&[0xFF; 11]).varint().is_err());
    }

    /// A map chunk with an out-of-range uniform version is a decode error.
    #[test]
    fn a_chunk_with_an_impossible_version_is_rejected() {
        let mut raw = ByteWriter::new();
        raw.u8(ITEM_CHUNK);
        raw.u64(0);
        raw.u8(FORM_UNIFORM);
        raw.u8(TAG_ZERO);
        raw.varint(1 << 60);
        raw.u8(ITEM_END);
        let mut payload = ByteWriter::new();
        payload.u32(raw.buf.len() as u32);
        payload.bytes(&lz4_compress(&raw.buf));
        let mut map = Map::new(true);
        let mut segments = vec![None; 16];
        let decoded = decode_chunk_payload(
            &payload.buf,
            &mut map,
            &mut Directory::default(),
            &mut segments,
            1 << 20,
        );
        assert!(decoded.is_err(), "{decoded:?}");
    }

    /// A dump of a map with every kind of entry decodes to the same map
    /// and segment facts, across several payloads.
    #[test]
    fn dumps_round_trip() {
        let mut map = Map::new(false);
        for lba in 0..3000u64 {
            let slot = match lba % 5 {
                0 => Slot::Zero,
                1 => Slot::Damaged,
                2 => Slot::Hole,
                3 => Slot::Data(Location::record(
                    SegmentId((lba % 7) as u32),
                    (lba * 48 % 60_000) as u32,
                    48 + (lba % 3) as u32 * 16,
                )),
                _ => Slot::Data(Location::unit_member(
                    SegmentId((lba % 5) as u32),
                    (lba * 64 % 60_000) as u32,
                    32_768,
                    (lba % 8) as u8,
                    8,
                )),
            };
            map.set(crate::units::Lba(lba * 3), slot, lba + 1);
        }
        map.set_range(
            crate::units::Lba(20_480),
            CHUNK_BLOCKS,
            RangeState::Zero,
            9,
            false,
            &mut |_| {},
        );
        let dumped = |i: u32| DumpedSegment {
            seq: 10 + i as u64,
            fill_bytes: 4096 * i as u64,
            max_version: 100 + i as u64,
            cold_bytes: if i.is_multiple_of(2) {
                0
            } else {
                u64::from(i) * 4096
            },
            fast_bytes: if i.is_multiple_of(3) {
                0
            } else {
                u64::from(i) * 512
            },
        };
        let payloads = encode_chunk_dump(&map, (0..7).map(|i| (SegmentId(i), dumped(i))), 4096);
        assert!(payloads.len() > 1, "small targets cut several payloads");
        let mut decoded = Map::new(true);
        let mut segments = vec![None; 8];
        for payload in &payloads {
            decode_chunk_payload(
                payload,
                &mut decoded,
                &mut Directory::default(),
                &mut segments,
                1 << 20,
            )
            .unwrap();
        }
        decoded.compact();
        assert_eq!(decoded.counts(), map.counts());
        for lba in 0..30_000u64 {
            let lba = crate::units::Lba(lba);
            let (want, got) = (map.get(lba), decoded.get(lba));
            assert_eq!(got.slot(), want.slot(), "block {lba}");
            if want.slot() != Slot::Hole {
                // A hole keeps no version in a dump.
                assert_eq!(got.version(), want.version(), "block {lba}");
            }
        }
        for i in 0..7 {
            assert_eq!(segments[i as usize], Some(dumped(i)));
        }
        assert_eq!(segments[7], None);
    }
}
