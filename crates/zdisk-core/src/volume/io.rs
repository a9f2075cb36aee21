//! The host I/O paths: read, write, trim and write-zeroes.
//!
//! A write compresses its blocks before taking the state lock (in parallel
//! for large requests), then appends records and updates the map under it.
//! A read looks up locations under the lock, then reads and decompresses
//! outside it, verifying that each record is the one the map expected
//! (block number, version and CRC32C). If verification fails because the
//! cleaner moved the record meanwhile, the read looks again; if the map
//! still points there, the block is damaged and the read fails with an error
//! naming it, never returning wrong bytes.
//!
//! Requests need no alignment: partial blocks go through read-modify-write
//! under a stripe lock, so concurrent sub-block writes to one block do not
//! lose each other's bytes.

use crate::codec::{compress_block, decompress_block, CodecId};
use crate::error::{Error, Result};
use crate::map::{Location, RangeState, Slot};
use crate::media::HostDirection;
use crate::record::{
    decode_record, record_len_for_payload, RecordHeader, RecordKey, RecordKind, RANGE_PAYLOAD_LEN,
};
use crate::units::{Lba, BLOCK_SIZE, BLOCK_SIZE_U64};

use super::state::{State, StreamKind};
use super::Volume;

/// Requests at least this many blocks long compress on several threads.
const PARALLEL_MIN_BLOCKS: usize = 32;
/// Adjacent extents are read from the medium in one request up to this size.
const READ_COALESCE_BYTES: u64 = 1 << 20;

/// The three ways of discarding data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discard {
    Trim,
    /// Zeroes that may become holes.
    ZeroPunch,
    /// Zeroes that stay allocated (NBD's NO_HOLE).
    Zero,
}

/// One block prepared for appending.
enum Prepared {
    Zero,
    Data {
        codec: CodecId,
        start: usize,
        len: usize,
        crc: u32,
    },
}

/// Compressed blocks of (part of) one request.
struct Batch {
    arena: Vec<u8>,
    blocks: Vec<Prepared>,
}

fn prepare(codec: crate::codec::Codec, data: &[u8]) -> Batch {
    let mut batch = Batch {
        arena: Vec::with_capacity(data.len() / 2),
        blocks: Vec::with_capacity(data.len() / BLOCK_SIZE),
    };
    let mut scratch = Vec::with_capacity(BLOCK_SIZE + 64);
    for block in data.chunks_exact(BLOCK_SIZE) {
        if is_zero(block) {
            batch.blocks.push(Prepared::Zero);
            continue;
        }
        let codec_used = compress_block(codec, block, &mut scratch);
        let start = batch.arena.len();
        batch.arena.extend_from_slice(&scratch);
        batch.blocks.push(Prepared::Data {
            codec: codec_used,
            start,
            len: scratch.len(),
            crc: crc32c::crc32c(&scratch),
        });
    }
    batch
}

/// True if every byte is zero; checks 64 bytes at a time so it vectorises.
pub(crate) fn is_zero(block: &[u8]) -> bool {
    let mut chunks = block.chunks_exact(64);
    chunks.all(|chunk| chunk.iter().fold(0u8, |acc, &b| acc | b) == 0)
        && chunks.remainder().iter().all(|&b| b == 0)
}

pub(crate) const RANGE_RECORD_LEN: u64 =
    (crate::record::HEADER_SIZE as u64 + RANGE_PAYLOAD_LEN as u64).div_ceil(16) * 16;

impl Volume {
    pub(crate) fn read_bytes(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        self.lock().counters.host_read_bytes += buf.len() as u64;
        let result = self.read_bytes_inner(offset, buf);
        // The data leaves over the host link once it has been read.
        self.media
            .host_transfer(HostDirection::Read, buf.len() as u64);
        result
    }

    fn read_bytes_inner(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let first = offset / BLOCK_SIZE_U64;
        let end = (offset + buf.len() as u64).div_ceil(BLOCK_SIZE_U64);
        if offset.is_multiple_of(BLOCK_SIZE_U64) && buf.len().is_multiple_of(BLOCK_SIZE) {
            return self.read_blocks(Lba(first), buf);
        }
        let mut blocks = vec![0u8; ((end - first) * BLOCK_SIZE_U64) as usize];
        self.read_blocks(Lba(first), &mut blocks)?;
        let skip = (offset - first * BLOCK_SIZE_U64) as usize;
        buf.copy_from_slice(&blocks[skip..skip + buf.len()]);
        Ok(())
    }

    /// Reads whole blocks into `out`.
    pub(crate) fn read_blocks(&self, first: Lba, out: &mut [u8]) -> Result<()> {
        let count = (out.len() / BLOCK_SIZE) as u64;
        let mut wanted: Vec<(usize, Location, u64)> = Vec::new();
        let mut buffered: Vec<(usize, Vec<u8>, u64)> = Vec::new();
        {
            let state = self.lock();
            let mut error = None;
            state.map.for_each_in(first, count, |lba, entry| {
                if error.is_some() {
                    return;
                }
                let index = (lba.0 - first.0) as usize;
                match entry.slot() {
                    Slot::Hole | Slot::Zero => {
                        out[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE].fill(0)
                    }
                    Slot::Damaged => {
                        error = Some(Error::DamagedBlock {
                            lba: lba.0,
                            segment: 0,
                            offset: 0,
                            reason:
                                "its data was found damaged earlier; rewrite the block to clear"
                                    .into(),
                        })
                    }
                    Slot::Data(loc) => match state.read_buffered(loc) {
                        Ok(Some(bytes)) => buffered.push((index, bytes, entry.version())),
                        Ok(None) => wanted.push((index, loc, entry.version())),
                        Err(e) => error = Some(e),
                    },
                }
            });
            if let Some(error) = error {
                return Err(error);
            }
        }
        let mut failed: Vec<(usize, Error)> = Vec::new();
        for (index, bytes, version) in buffered {
            let lba = Lba(first.0 + index as u64);
            let block = &mut out[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE];
            if let Err(error) = decode_block(
                &self.record_key,
                lba,
                version,
                &bytes,
                Location {
                    segment: crate::units::SegmentId(0),
                    offset: 0,
                    len: bytes.len() as u32,
                },
                block,
            ) {
                failed.push((index, error));
            }
        }
        wanted.sort_by_key(|(_, loc, _)| (loc.segment, loc.offset));
        // Group adjacent records into runs, then read every run in one
        // batch, so a drive with many dies serves them in parallel.
        let mut runs: Vec<(std::ops::Range<usize>, Location, u64)> = Vec::new();
        let mut run_start = 0;
        while run_start < wanted.len() {
            let mut run_end = run_start + 1;
            let first_loc = wanted[run_start].1;
            let mut end_offset = first_loc.offset as u64 + first_loc.len as u64;
            while run_end < wanted.len() {
                let loc = wanted[run_end].1;
                if loc.segment != first_loc.segment
                    || loc.offset as u64 != end_offset
                    || end_offset + loc.len as u64 - first_loc.offset as u64 > READ_COALESCE_BYTES
                {
                    break;
                }
                end_offset += loc.len as u64;
                run_end += 1;
            }
            runs.push((
                run_start..run_end,
                first_loc,
                end_offset - first_loc.offset as u64,
            ));
            run_start = run_end;
        }
        let media_read: u64 = runs.iter().map(|(_, _, span)| span).sum();
        let mut scratch = vec![0u8; media_read as usize];
        let results = {
            let mut ranges = Vec::with_capacity(runs.len());
            let mut rest = scratch.as_mut_slice();
            for (_, loc, span) in &runs {
                let (buf, tail) = std::mem::take(&mut rest).split_at_mut(*span as usize);
                rest = tail;
                ranges.push(crate::media::ReadRange {
                    segment: loc.segment,
                    offset_bytes: loc.offset as u64,
                    buf,
                });
            }
            self.media.read_batch(&mut ranges)
        };
        let mut base = 0usize;
        for ((members, first_loc, span), read) in runs.iter().zip(results) {
            for &(index, loc, version) in &wanted[members.clone()] {
                let lba = Lba(first.0 + index as u64);
                let block = &mut out[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE];
                let result = match &read {
                    Ok(()) => {
                        let at = base + (loc.offset - first_loc.offset) as usize;
                        decode_block(
                            &self.record_key,
                            lba,
                            version,
                            &scratch[at..at + loc.len as usize],
                            loc,
                            block,
                        )
                    }
                    Err(e) => Err(Error::io(
                        format!("reading block {lba}"),
                        std::io::Error::other(e.to_string()),
                    )),
                };
                if let Err(error) = result {
                    failed.push((index, error));
                }
            }
            base += *span as usize;
        }
        self.lock().counters.media_read_bytes += media_read;
        for (index, error) in failed {
            self.reread_block(
                Lba(first.0 + index as u64),
                &mut out[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE],
                error,
            )?;
        }
        Ok(())
    }

    /// A block failed verification: if the map moved on (the cleaner
    /// relocated it, or a write replaced it), read it again; otherwise the
    /// block is damaged.
    fn reread_block(&self, lba: Lba, out: &mut [u8], mut error: Error) -> Result<()> {
        let mut previous = None;
        for _ in 0..4 {
            let entry = self.lock().map.get(lba);
            if previous == Some(entry) {
                break;
            }
            previous = Some(entry);
            let mut block = vec![0u8; BLOCK_SIZE];
            let attempt = self.read_blocks_once(lba, entry, &mut block);
            match attempt {
                Ok(()) => {
                    out.copy_from_slice(&block);
                    return Ok(());
                }
                Err(e) => error = e,
            }
        }
        self.lock().counters.damaged_blocks_found += 1;
        Err(error)
    }

    fn read_blocks_once(&self, lba: Lba, entry: crate::map::Entry, out: &mut [u8]) -> Result<()> {
        match entry.slot() {
            Slot::Hole | Slot::Zero => {
                out.fill(0);
                Ok(())
            }
            Slot::Damaged => Err(Error::DamagedBlock {
                lba: lba.0,
                segment: 0,
                offset: 0,
                reason: "its data was found damaged earlier".into(),
            }),
            Slot::Data(loc) => {
                let buffered = self.lock().read_buffered(loc)?;
                let bytes = match buffered {
                    Some(bytes) => bytes,
                    None => {
                        let mut bytes = vec![0u8; loc.len as usize];
                        self.media
                            .read(loc.segment, loc.offset as u64, &mut bytes)?;
                        bytes
                    }
                };
                decode_block(&self.record_key, lba, entry.version(), &bytes, loc, out)
            }
        }
    }

    pub(crate) fn write_bytes(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        // The data crosses the host link (and a drive's compressor) first.
        self.media
            .host_transfer(HostDirection::Write, data.len() as u64);
        if data.is_empty() {
            return Ok(());
        }
        let end = offset + data.len() as u64;
        let first_full = offset.div_ceil(BLOCK_SIZE_U64) * BLOCK_SIZE_U64;
        let end_full = end / BLOCK_SIZE_U64 * BLOCK_SIZE_U64;
        if first_full >= end_full {
            // Everything lies within one or two partial blocks.
            let mut position = offset;
            while position < end {
                let block_end = ((position / BLOCK_SIZE_U64) + 1) * BLOCK_SIZE_U64;
                let piece_end = block_end.min(end);
                let piece = &data[(position - offset) as usize..(piece_end - offset) as usize];
                self.modify_block(position, Some(piece))?;
                position = piece_end;
            }
        } else {
            if offset < first_full {
                self.modify_block(offset, Some(&data[..(first_full - offset) as usize]))?;
            }
            let middle = &data[(first_full - offset) as usize..(end_full - offset) as usize];
            self.write_blocks(Lba(first_full / BLOCK_SIZE_U64), middle)?;
            if end_full < end {
                self.modify_block(end_full, Some(&data[(end_full - offset) as usize..]))?;
            }
        }
        {
            let mut state = self.lock();
            state.counters.host_write_bytes += data.len() as u64;
            state.counters.host_write_requests += 1;
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Read-modify-write of part of one block: `bytes` at byte `offset`, or
    /// zeros of `len` when `bytes` is `None`.
    fn modify_block(&self, offset: u64, bytes: Option<&[u8]>) -> Result<()> {
        self.modify_block_with(offset, bytes, 0)
    }

    fn modify_block_with(&self, offset: u64, bytes: Option<&[u8]>, zero_len: usize) -> Result<()> {
        let lba = Lba(offset / BLOCK_SIZE_U64);
        let _stripe = self.stripes[(lba.0 % self.stripes.len() as u64) as usize]
            .lock()
            .expect("stripe lock poisoned");
        let mut block = vec![0u8; BLOCK_SIZE];
        self.read_blocks(lba, &mut block)?;
        let at = (offset % BLOCK_SIZE_U64) as usize;
        match bytes {
            Some(bytes) => block[at..at + bytes.len()].copy_from_slice(bytes),
            None => block[at..at + zero_len].fill(0),
        }
        self.write_blocks(lba, &block)
    }

    /// Compresses and appends whole blocks.
    pub(crate) fn write_blocks(&self, first: Lba, data: &[u8]) -> Result<()> {
        debug_assert_eq!(data.len() % BLOCK_SIZE, 0);
        let codec = self.settings.codec;
        let count = data.len() / BLOCK_SIZE;
        let threads = self.compress_threads;
        let batches: Vec<Batch> = if count >= PARALLEL_MIN_BLOCKS && threads > 1 {
            let per = count.div_ceil(threads) * BLOCK_SIZE;
            std::thread::scope(|scope| {
                let handles: Vec<_> = data
                    .chunks(per)
                    .map(|part| scope.spawn(move || prepare(codec, part)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("compression thread panicked"))
                    .collect()
            })
        } else {
            vec![prepare(codec, data)]
        };
        let mut needed = 0u64;
        for batch in &batches {
            for block in &batch.blocks {
                needed += match block {
                    Prepared::Zero => RANGE_RECORD_LEN,
                    Prepared::Data { len, .. } => record_len_for_payload(*len),
                };
            }
        }
        let floor_blocks = Some(count as u64);
        let (mut state, floor) = self.lock_with_room(needed, floor_blocks)?;
        let mut lba = first.0;
        let mut zero_run: Option<(u64, u64)> = None;
        for batch in &batches {
            for block in &batch.blocks {
                match block {
                    Prepared::Zero => {
                        zero_run = match zero_run {
                            Some((start, n)) => Some((start, n + 1)),
                            None => Some((lba, 1)),
                        };
                    }
                    Prepared::Data {
                        codec,
                        start,
                        len,
                        crc,
                    } => {
                        if let Some((start, n)) = zero_run.take() {
                            append_range(&mut state, RecordKind::Zero, Lba(start), n, floor)?;
                        }
                        let version = state.take_version();
                        let header = RecordHeader {
                            kind: RecordKind::Data,
                            codec: *codec as u8,
                            seg_seq: 0,
                            lba,
                            version,
                            payload_len: *len as u32,
                            crc: 0,
                        };
                        let loc = state.append(
                            StreamKind::Host,
                            header,
                            &batch.arena[*start..*start + *len],
                            *crc,
                            floor,
                        )?;
                        state.segments.add_live(loc.segment, loc.len as u64);
                        let old = state.map.set(Lba(lba), Slot::Data(loc), version);
                        if let Slot::Data(old_loc) = old.slot() {
                            state.release_location(old_loc);
                        }
                    }
                }
                lba += 1;
            }
        }
        if let Some((start, n)) = zero_run.take() {
            append_range(&mut state, RecordKind::Zero, Lba(start), n, floor)?;
        }
        Ok(())
    }

    /// Takes the state lock once the host stream has room for `bytes`,
    /// cleaning segments in this thread if needed (this is what throttles
    /// writers when space runs short).
    /// `reserve_for_blocks`: keep the reserve, sized for a write of that
    /// many blocks; `None`: only keep room for a checkpoint, so that trims
    /// and zeroes work on a full medium.
    /// Returns the guard and the number of segments that must stay free.
    pub(crate) fn lock_with_room(
        &self,
        bytes: u64,
        reserve_for_blocks: Option<u64>,
    ) -> Result<(std::sync::MutexGuard<'_, State>, u64)> {
        let mut attempts = 0u64;
        let mut checkpointed = false;
        let limit = 4 * self.geometry.segment_count as u64 + 16;
        loop {
            let mut state = self.lock();
            state.check_writable()?;
            if state.closing {
                return Err(Error::ShutDown);
            }
            let floor = match reserve_for_blocks {
                Some(blocks) => state.reserved_segments_for(blocks),
                None => state.dump_reserve_segments(),
            };
            let needed = state.segments_needed(StreamKind::Host, bytes);
            // A write numbers each block (data or zero run); a range, itself.
            let versions = reserve_for_blocks.unwrap_or(1);
            if state.reservation_short(needed, versions) {
                drop(state);
                self.renew_reservations(needed, versions)?;
                state = self.lock();
            }
            if state.host_has_room(bytes, floor) {
                if state.numbering_room(needed, versions) {
                    return Ok((state, floor));
                }
                // Other writers used the renewed numbers first: renew again.
                attempts += 1;
                if attempts > limit {
                    return Err(Error::NoSpace {
                        free_segments: state.segments.free_count(),
                        reserved_segments: floor,
                    });
                }
                continue;
            }
            let reclaimable = state.reclaimable_count();
            let free = state.segments.free_count();
            let reserved = floor;
            // Give up at once if all the garbage there is could not make room:
            // cleaning would only churn.
            let segment_size = state.segment_size();
            let min_garbage = self.foreground_min_garbage();
            let garbage: u64 = state
                .segments
                .iter()
                .filter(|(_, info)| info.state == crate::segments::SegmentState::Sealed)
                .map(|(_, info)| segment_size - info.live_bytes)
                .filter(|&g| g >= min_garbage)
                .sum();
            let available = (free + reclaimable).saturating_sub(reserved) * segment_size
                + state.stream_room(StreamKind::Host)
                + garbage;
            // Only a checkpoint frees trims kept for recovery and parked segments.
            let checkpoint_would_help = !checkpointed
                && (state.range_bytes_since_checkpoint > 0 || state.segments.parked_count() > 0);
            drop(state);
            let no_space = Error::NoSpace {
                free_segments: free,
                reserved_segments: reserved,
            };
            // Trims kept for recovery, or segments parked until a
            // checkpoint, may be what holds the space: a checkpoint
            // releases them. Try that once before giving up.
            let checkpoint_or_give_up = || {
                if !checkpoint_would_help {
                    return Err(no_space);
                }
                checkpointed = true;
                match self.checkpoint() {
                    Ok(()) | Err(Error::NoSpace { .. }) => Ok(()),
                    Err(other) => Err(other),
                }
            };
            if available < bytes + crate::record::RAW_RECORD_LEN {
                checkpoint_or_give_up()?;
                continue;
            }
            self.poke();
            attempts += 1;
            if attempts > limit {
                return Err(Error::NoSpace {
                    free_segments: free,
                    reserved_segments: reserved,
                });
            }
            if reclaimable > 0 {
                self.flush()?;
                continue;
            }
            if !self.clean_one(self.foreground_min_garbage())? {
                checkpoint_or_give_up()?;
            }
        }
    }

    pub(crate) fn discard(&self, offset: u64, len: u64, mode: Discard, fua: bool) -> Result<()> {
        self.media.host_transfer(HostDirection::Write, 0);
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        let first_full = offset.div_ceil(BLOCK_SIZE_U64) * BLOCK_SIZE_U64;
        let end_full = end / BLOCK_SIZE_U64 * BLOCK_SIZE_U64;
        let zeroing = mode != Discard::Trim;
        if first_full >= end_full {
            if zeroing {
                let mut position = offset;
                while position < end {
                    let block_end = ((position / BLOCK_SIZE_U64) + 1) * BLOCK_SIZE_U64;
                    let piece_end = block_end.min(end);
                    self.modify_block_with(position, None, (piece_end - position) as usize)?;
                    position = piece_end;
                }
            }
        } else {
            if zeroing && offset < first_full {
                self.modify_block_with(offset, None, (first_full - offset) as usize)?;
            }
            let kind = match mode {
                Discard::Trim | Discard::ZeroPunch => RecordKind::Trim,
                Discard::Zero => RecordKind::Zero,
            };
            // Trims and zeroes free space, so they may use the cleaner's reserve.
            let (mut state, floor) = self.lock_with_room(RANGE_RECORD_LEN, None)?;
            append_range(
                &mut state,
                kind,
                Lba(first_full / BLOCK_SIZE_U64),
                (end_full - first_full) / BLOCK_SIZE_U64,
                floor,
            )?;
            drop(state);
            if zeroing && end_full < end {
                self.modify_block_with(end_full, None, (end - end_full) as usize)?;
            }
        }
        {
            let mut state = self.lock();
            match mode {
                Discard::Trim => state.counters.host_trim_bytes += len,
                _ => state.counters.host_zero_bytes += len,
            }
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }
}

/// Appends a range record and applies it to the map, keeping `floor`
/// segments free.
pub(crate) fn append_range(
    state: &mut State,
    kind: RecordKind,
    first: Lba,
    count: u64,
    floor: u64,
) -> Result<()> {
    let version = state.take_version();
    let payload = count.to_le_bytes();
    let header = RecordHeader {
        kind,
        codec: 0,
        seg_seq: 0,
        lba: first.0,
        version,
        payload_len: RANGE_PAYLOAD_LEN,
        crc: 0,
    };
    state.append(
        StreamKind::Host,
        header,
        &payload,
        crc32c::crc32c(&payload),
        floor,
    )?;
    let range_state = match kind {
        RecordKind::Trim => RangeState::Hole,
        RecordKind::Zero => RangeState::Zero,
        RecordKind::Damaged => RangeState::Damaged,
        other => panic!("{other:?} is not a range record"),
    };
    let State { map, segments, .. } = state;
    map.set_range(first, count, range_state, version, false, &mut |loc| {
        segments.sub_live(loc.segment, loc.len as u64)
    });
    Ok(())
}

/// Verifies the record in `bytes` is block `lba` at `version` and decompresses it.
pub(crate) fn decode_block(
    key: &RecordKey,
    lba: Lba,
    version: u64,
    bytes: &[u8],
    loc: Location,
    out: &mut [u8],
) -> Result<()> {
    let damaged = |reason: String| Error::DamagedBlock {
        lba: lba.0,
        segment: loc.segment.0,
        offset: loc.offset,
        reason,
    };
    let (header, payload) = match decode_record(bytes, key, None) {
        Ok(decoded) => decoded,
        Err(crate::record::RecordError::Checksum { expected, actual }) => {
            return Err(Error::ChecksumMismatch {
                lba: lba.0,
                segment: loc.segment.0,
                offset: loc.offset,
                expected,
                actual,
            })
        }
        Err(e) => return Err(damaged(e.to_string())),
    };
    if header.kind != RecordKind::Data || header.lba != lba.0 || header.version != version {
        return Err(damaged(format!(
            "found {:?} record of block {} version {}, expected block {lba} version {version}",
            header.kind, header.lba, header.version
        )));
    }
    let codec = CodecId::from_u8(header.codec)
        .ok_or_else(|| damaged(format!("unknown codec {}", header.codec)))?;
    decompress_block(codec, payload, out).map_err(damaged)
}
