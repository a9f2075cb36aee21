//! Checkpoint dumps: the map and segment table written into the log.
//!
//! A checkpoint serialises the map and the segment table into chunk records
//! (kind `MapChunk`), compresses them with LZ4, and writes them twice, into
//! two disjoint sets of segments with identical layout, so that a damaged
//! chunk in one copy is read from the other. The root in a metadata slot
//! then names those segments; the dump of the previous checkpoint is freed
//! only once the new root is durable.
//!
//! Chunk record: header `lba` = record index, `version` = root generation,
//! payload = u32 uncompressed length + LZ4 block. The uncompressed stream is
//! a sequence of tagged items, see docs/format.md.

use crate::bytes::{ByteReader, ByteWriter};
use crate::codec::{lz4_compress, lz4_decompress};
use crate::error::{Error, Result};
use crate::map::{Chunk, Entry, Map, RangeState, Slot, CHUNK_BLOCKS};
use crate::media::Media;
use crate::meta::DumpRef;
use crate::record::{
    decode_record, record_len_for_payload, RecordHeader, RecordKey, RecordKind,
    MAP_CHUNK_PAYLOAD_MAX,
};
use crate::segments::SegmentState;
use crate::units::SegmentId;

use super::state::State;

const ITEM_END: u8 = 0;
const ITEM_CHUNK: u8 = 1;
const ITEM_SEGMENT: u8 = 2;

const FORM_UNIFORM: u8 = 0;
const FORM_MIXED: u8 = 1;

const TAG_HOLE: u8 = 0;
const TAG_ZERO: u8 = 1;
const TAG_DATA: u8 = 2;
const TAG_DAMAGED: u8 = 3;

/// Upper bound of the bytes a dump of this state takes on the medium (one copy).
/// The most one map entry takes in a dump: a tag, zigzag varints of a
/// segment delta (33 bits: 5 bytes) and an offset delta (5 bytes), a
/// length (13 bits: 2 bytes) and a version delta (49 bits: 7 bytes).
const ENTRY_MAX_BYTES: u64 = 1 + 5 + 5 + 2 + 7;

/// Uncompressed bytes per checkpoint chunk record.
pub fn chunk_target_bytes(segment_size: u64) -> usize {
    (segment_size / 4).min(64 * 1024) as usize
}

/// The most a chunk record can occupy: a full target plus one item,
/// LZ4's worst-case expansion and the record header.
pub fn chunk_record_max_bytes(segment_size: u64) -> u64 {
    let raw = chunk_target_bytes(segment_size) as u64 + 16 + CHUNK_BLOCKS * ENTRY_MAX_BYTES + 1;
    raw + raw / 255 + 16 + 4 + 48
}

/// Segments a checkpoint's two dump copies need.
pub fn dump_segments_for(chunks: u64, segment_count: u64, segment_size: u64) -> u64 {
    let usable = segment_size
        .saturating_sub(chunk_record_max_bytes(segment_size))
        .max(1);
    2 * dump_size_for(chunks, segment_count).div_ceil(usable).max(1)
}

/// `extra_chunks` allows for map chunks a write in progress may add.
pub fn dump_size_estimate(state: &State, extra_chunks: u64) -> u64 {
    dump_size_for(
        state.map.chunk_count() as u64 + extra_chunks,
        state.segments.len() as u64,
    )
}

/// Upper bound of one dump copy's bytes for `chunks` map chunks and `segments` segments.
pub fn dump_size_for(chunks: u64, segments: u64) -> u64 {
    let raw = chunks * (16 + CHUNK_BLOCKS * ENTRY_MAX_BYTES) + segments * 40 + 64;
    // LZ4 worst case plus per-record headers.
    raw + raw / 255 + 16 + (raw / (16 * 1024) + 1) * 64
}

fn put_varint(out: &mut ByteWriter, mut value: u64) {
    while value >= 0x80 {
        out.u8((value as u8) | 0x80);
        value >>= 7;
    }
    out.u8(value as u8);
}

fn get_varint(input: &mut ByteReader) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = input.u8()?;
        value |= ((byte & 0x7F) as u64) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("varint longer than 64 bits".into())
}

fn zigzag(delta: i64) -> u64 {
    ((delta << 1) ^ (delta >> 63)) as u64
}

fn unzigzag(value: u64) -> i64 {
    ((value >> 1) as i64) ^ -((value & 1) as i64)
}

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

/// Serialises the map and segment table into chunk payloads of at most
/// `target_bytes` uncompressed each.
pub fn encode_dump(state: &State, target_bytes: usize) -> Vec<Vec<u8>> {
    let mut payloads = Vec::new();
    let mut out = ByteWriter::new();
    let mut flush = |out: &mut ByteWriter, force: bool| {
        if out.buf.len() >= target_bytes || (force && !out.buf.is_empty()) {
            out.u8(ITEM_END);
            let mut payload = ByteWriter::new();
            payload.u32(out.buf.len() as u32);
            payload.bytes(&lz4_compress(&out.buf));
            assert!(payload.buf.len() as u32 <= MAP_CHUNK_PAYLOAD_MAX);
            payloads.push(payload.buf);
            out.buf.clear();
        }
    };
    for (index, chunk) in state.map.chunks() {
        out.u8(ITEM_CHUNK);
        out.u64(index);
        match chunk {
            Chunk::Uniform { state, version } => {
                out.u8(FORM_UNIFORM);
                out.u8(range_tag(*state));
                put_varint(&mut out, *version);
            }
            Chunk::Mixed(entries) => {
                out.u8(FORM_MIXED);
                let (mut segment, mut offset, mut version) = (0i64, 0i64, 0i64);
                for entry in entries.iter() {
                    match entry.slot() {
                        Slot::Hole => out.u8(TAG_HOLE),
                        Slot::Zero | Slot::Damaged => {
                            out.u8(if entry.slot() == Slot::Zero {
                                TAG_ZERO
                            } else {
                                TAG_DAMAGED
                            });
                            put_varint(&mut out, entry.version());
                        }
                        Slot::Data(loc) => {
                            out.u8(TAG_DATA);
                            put_varint(&mut out, zigzag(loc.segment.0 as i64 - segment));
                            put_varint(&mut out, zigzag(loc.offset as i64 - offset));
                            put_varint(&mut out, loc.len as u64);
                            put_varint(&mut out, zigzag(entry.version() as i64 - version));
                            segment = loc.segment.0 as i64;
                            offset = loc.offset as i64 + loc.len as i64;
                            version = entry.version() as i64;
                        }
                    }
                }
            }
        }
        flush(&mut out, false);
    }
    for (segment, info) in state.segments.iter() {
        if info.seq == 0 && info.state == SegmentState::Free {
            continue;
        }
        out.u8(ITEM_SEGMENT);
        out.u32(segment.0);
        out.u64(info.seq);
        out.u64(info.fill_bytes);
        out.u64(info.max_version);
        flush(&mut out, false);
    }
    flush(&mut out, true);
    payloads
}

/// What a dump describes about a segment.
#[derive(Debug, Clone, Copy)]
pub struct DumpedSegment {
    pub seq: u64,
    pub fill_bytes: u64,
    pub max_version: u64,
}

/// Decodes one chunk record's payload into `map` and `segments`.
pub fn decode_chunk_payload(
    payload: &[u8],
    map: &mut Map,
    segments: &mut [Option<DumpedSegment>],
    logical_blocks: u64,
) -> Result<(), String> {
    let mut head = ByteReader::new(payload);
    let raw_len = head.u32()? as usize;
    if raw_len > 64 * MAP_CHUNK_PAYLOAD_MAX as usize {
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
                let chunk = match input.u8()? {
                    FORM_UNIFORM => {
                        let state = tag_range(input.u8()?)?;
                        let version = get_varint(&mut input)?;
                        if version > crate::map::VERSION_MAX {
                            return Err(format!("version {version} out of range in chunk {index}"));
                        }
                        Chunk::Uniform { state, version }
                    }
                    FORM_MIXED => {
                        let mut entries = Box::new([Entry::default(); CHUNK_BLOCKS as usize]);
                        let (mut segment, mut offset, mut version) = (0i64, 0i64, 0i64);
                        for entry in entries.iter_mut() {
                            *entry = match input.u8()? {
                                TAG_HOLE => Entry::default(),
                                tag @ (TAG_ZERO | TAG_DAMAGED) => {
                                    let version = get_varint(&mut input)?;
                                    if version > crate::map::VERSION_MAX {
                                        return Err("version out of range".into());
                                    }
                                    Entry::new(tag_range(tag)?.slot(), version)
                                }
                                TAG_DATA => {
                                    segment += unzigzag(get_varint(&mut input)?);
                                    offset += unzigzag(get_varint(&mut input)?);
                                    let len = get_varint(&mut input)?;
                                    version += unzigzag(get_varint(&mut input)?);
                                    if !(0..segments.len() as i64).contains(&segment)
                                        || !(0..u32::MAX as i64).contains(&offset)
                                        || !(1..=8191).contains(&len)
                                        || !(0..=crate::map::VERSION_MAX as i64).contains(&version)
                                    {
                                        return Err(format!(
                                            "bad data entry in chunk {index}: segment {segment} offset {offset} len {len}"
                                        ));
                                    }
                                    let entry = Entry::new(
                                        Slot::Data(crate::map::Location {
                                            segment: SegmentId(segment as u32),
                                            offset: offset as u32,
                                            len: len as u32,
                                        }),
                                        version as u64,
                                    );
                                    offset += len as i64;
                                    entry
                                }
                                other => return Err(format!("bad entry tag {other}")),
                            };
                        }
                        Chunk::Mixed(entries)
                    }
                    other => return Err(format!("bad chunk form {other}")),
                };
                map.insert_chunk(index, chunk)?;
            }
            ITEM_SEGMENT => {
                let segment = input.u32()? as usize;
                let dumped = DumpedSegment {
                    seq: input.u64()?,
                    fill_bytes: input.u64()?,
                    max_version: input.u64()?,
                };
                if dumped.max_version > crate::map::VERSION_MAX {
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

/// Places chunk payloads into segments: returns, per segment, the payload
/// indices it holds. Both copies use this same layout.
pub fn layout(payloads: &[Vec<u8>], segment_size: u64) -> Vec<Vec<usize>> {
    let mut segments: Vec<Vec<usize>> = vec![Vec::new()];
    let mut offset = 0u64;
    for (index, payload) in payloads.iter().enumerate() {
        let len = record_len_for_payload(payload.len());
        assert!(len <= segment_size, "chunk record larger than a segment");
        if offset + len > segment_size {
            segments.push(Vec::new());
            offset = 0;
        }
        segments.last_mut().expect("one segment").push(index);
        offset += len;
    }
    segments
}

/// Builds the image of one dump segment: its records with `seq`, padded to whole pages.
pub fn build_segment(
    payloads: &[Vec<u8>],
    indices: &[usize],
    seq: u64,
    generation: u64,
    page_size: u64,
    key: &RecordKey,
) -> Vec<u8> {
    let mut image = Vec::new();
    for &index in indices {
        let payload = &payloads[index];
        let header = RecordHeader {
            kind: RecordKind::MapChunk,
            codec: crate::codec::CodecId::Lz4 as u8,
            seg_seq: seq as u32,
            lba: index as u64,
            version: generation,
            payload_len: payload.len() as u32,
            crc: 0,
        };
        let start = image.len();
        image.resize(start + record_len_for_payload(payload.len()) as usize, 0);
        crate::record::encode_record(
            &mut image[start..],
            header,
            payload,
            crc32c::crc32c(payload),
            key,
        );
    }
    let padded = (image.len() as u64).div_ceil(page_size) * page_size;
    image.resize(padded.max(page_size) as usize, 0);
    image
}

/// Reads a dump back into a map and per-segment facts. A chunk damaged in
/// one copy is taken from the other; damage in both is an error.
pub fn load_dump(
    media: &dyn Media,
    key: &RecordKey,
    dump: &DumpRef,
    generation: u64,
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
    for (position, (&first, &second)) in
        dump.copies[0].iter().zip(dump.copies[1].iter()).enumerate()
    {
        let copies = [read_segment(first)?, read_segment(second)?];
        let mut offset = 0usize;
        while expected < dump.record_count && offset < copies[0].len() {
            let mut decoded = None;
            for (copy, bytes) in copies.iter().enumerate() {
                match decode_record(&bytes[offset..], key, None) {
                    Ok((header, payload))
                        if header.kind == RecordKind::MapChunk
                            && header.version == generation
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
            decode_chunk_payload(payload, map, &mut segments, logical_blocks).map_err(|e| {
                Error::CorruptImage(format!("checkpoint chunk {expected} is malformed: {e}"))
            })?;
            expected += 1;
            offset += header.record_len() as usize;
        }
    }
    if expected != dump.record_count {
        return Err(Error::CorruptImage(format!(
            "checkpoint unreadable: chunk {expected} of {} is missing or damaged in both copies ({})",
            dump.record_count,
            problems.last().cloned().unwrap_or_default()
        )));
    }
    Ok(segments)
}

impl super::Volume {
    /// Writes a checkpoint; the caller holds the maintenance lock.
    ///
    /// 1. Under the state lock: a barrier, the map snapshot, and the open
    ///    stream positions (everything appended later is replayed on recovery).
    /// 2. Sync, so every record the snapshot points at is durable.
    /// 3. Write both dump copies into fresh segments and sync.
    /// 4. Write the root into the other metadata slot and sync: the commit point.
    /// 5. Free the previous dump's segments.
    pub(crate) fn checkpoint_locked(&self, clean: bool) -> Result<()> {
        let segment_size = self.geometry.segment_size_bytes;
        let target = chunk_target_bytes(segment_size);
        let (payloads, gen, boundary, open) = {
            let mut state = self.lock();
            let gen = state.barrier()?;
            let payloads = encode_dump(&state, target);
            (payloads, gen, state.next_seq, state.open_positions())
        };
        self.sync_to(gen)?;

        let placement = layout(&payloads, segment_size);
        let wanted = 2 * placement.len() as u64;
        let (short, ahead) = {
            let mut state = self.lock();
            // The root this checkpoint's root will overwrite stops being a
            // fallback as soon as that write starts, so its dump can make
            // room for the new one: a checkpoint never needs more than one
            // dump's worth of free space.
            let replaced = ((state.generation + 1) % 2) as usize;
            if let Some(old) = state.roots[replaced].take() {
                let other_uses = |dump: &DumpRef| {
                    state.roots[1 - replaced]
                        .as_ref()
                        .and_then(|root| root.dump.as_ref())
                        .is_some_and(|d| d.generation == dump.generation)
                };
                if let Some(dump) = old.dump.filter(|d| !other_uses(d)) {
                    for segment in dump.segments() {
                        state.segments.release(segment);
                    }
                }
            }
            (
                state.segments.reserved_count() < wanted || !state.numbering_room(wanted, 0),
                state.segment_reserve_ahead,
            )
        };
        if short {
            self.write_root(false, wanted + ahead / 2, 0)?;
        }
        // The generation is taken here but counted only once the root is
        // durable: a failed attempt must not skip a generation, or the next
        // root would overwrite the newest durable one in the same slot.
        let (copies, generation) = {
            let mut state = self.lock();
            let mut taken: Vec<(SegmentId, u64)> = Vec::with_capacity(2 * placement.len());
            while taken.len() < 2 * placement.len() {
                match state.allocate_segment() {
                    Ok(segment) => {
                        let info = state.segments.get_mut(segment);
                        info.state = SegmentState::Dump;
                        taken.push((segment, info.seq));
                    }
                    Err(error) => {
                        for (segment, _) in taken.into_iter().rev() {
                            state.segments.unallocate(segment);
                        }
                        return Err(error);
                    }
                }
            }
            let second = taken.split_off(placement.len());
            ([taken, second], state.generation + 1)
        };
        let result = self.write_dump_and_root(
            &payloads, &placement, &copies, generation, clean, boundary, &open,
        );
        let mut state = self.lock();
        let (dump, reservation) = match result {
            Ok(done) => done,
            Err(error) => {
                // Nothing refers to the new dump: its segments go back.
                for copy in copies.iter().rev() {
                    for &(segment, _) in copy.iter().rev() {
                        state.segments.unallocate(segment);
                    }
                }
                return Err(error);
            }
        };
        state.generation = generation;
        state.commit_reservation(&reservation);
        state.install_root(super::state::RetainedRoot {
            generation,
            boundary,
            open,
            dump: Some(dump),
        });
        state.log_bytes_since_checkpoint = 0;
        state.range_bytes_since_checkpoint = 0;
        // Segments cleaned while damage forced a checkpoint can go now.
        let release_gen = state.barrier_gen + 1;
        state.segments.unpark(release_gen);
        Ok(())
    }

    /// Steps 3 and 4 of a checkpoint: both dump copies, a sync, the root.
    #[allow(clippy::too_many_arguments)]
    fn write_dump_and_root(
        &self,
        payloads: &[Vec<u8>],
        placement: &[Vec<usize>],
        copies: &[Vec<(SegmentId, u64)>; 2],
        generation: u64,
        clean: bool,
        boundary: u64,
        open: &[crate::meta::OpenSegmentPos],
    ) -> Result<(DumpRef, super::state::Reservation)> {
        use crate::meta::{CheckpointRoot, Root};
        use crate::units::PageIndex;

        let page_size = self.geometry.page_size_bytes as u64;
        let mut written = 0u64;
        for copy in copies {
            for (&(segment, seq), indices) in copy.iter().zip(placement.iter()) {
                let image = build_segment(
                    payloads,
                    indices,
                    seq,
                    generation,
                    page_size,
                    &self.record_key,
                );
                self.media.write_pages(segment, PageIndex(0), &image)?;
                written += image.len() as u64;
                let mut state = self.lock();
                let info = state.segments.get_mut(segment);
                info.fill_bytes = image.len() as u64;
            }
        }
        if let Err(error) = self.media.sync() {
            // A failed sync may also have dropped data written since the
            // last one: stop writing, as a failed flush does.
            let mut state = self.lock();
            if state.failed.is_none() {
                state.failed = Some(error.to_string());
            }
            return Err(error);
        }

        let dump = DumpRef {
            copies: [
                copies[0].iter().map(|(s, _)| *s).collect(),
                copies[1].iter().map(|(s, _)| *s).collect(),
            ],
            record_count: payloads.len() as u64,
            generation,
        };
        let (root, reservation) = {
            let mut state = self.lock();
            let reservation = state.reservations_for_root(0, 0);
            state.counters.meta_write_bytes += written;
            state.counters.media_write_bytes += written;
            state.counters.checkpoints += 1;
            let root = Root {
                generation,
                superblock: self.superblock.clone(),
                settings: self.settings,
                checkpoint: CheckpointRoot {
                    clean,
                    seq_boundary: boundary,
                    next_seq: state.next_seq,
                    next_version: state.next_version,
                    seq_reserved: reservation.seq,
                    version_reserved: reservation.version,
                    reserved_segments: reservation.segments.clone(),
                    open_segments: open.to_vec(),
                    dump: Some(dump.clone()),
                    counters: state.counters,
                },
            };
            (root, reservation)
        };
        self.commit_root(&root)?;
        Ok((dump, reservation))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_zigzag_round_trip() {
        for value in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut out = ByteWriter::new();
            put_varint(&mut out, value);
            assert_eq!(get_varint(&mut ByteReader::new(&out.buf)), Ok(value));
        }
        for delta in [0i64, 1, -1, 1000, -1000, i64::MAX, i64::MIN] {
            assert_eq!(unzigzag(zigzag(delta)), delta);
        }
        assert!(get_varint(&mut ByteReader::new(&[0xFF; 11])).is_err());
    }
}
