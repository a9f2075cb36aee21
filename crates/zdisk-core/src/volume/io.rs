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

use std::ops::Range;

use rayon::prelude::*;

use crate::codec::{compress_block, decompress_block, CodecId};
use crate::error::{Error, Result};
use crate::map::{Entry, Location, Slot};
use crate::media::{HostDirection, ReadRange};
use crate::record::{
    decode_record, record_len_for_payload, RecordKey, RecordKind, RANGE_PAYLOAD_LEN,
};
use crate::units::{Lba, SegmentId, BLOCK_SIZE, BLOCK_SIZE_U64};

use super::guard::StateGuard;
use super::space::{Need, Reach, Writer};
use super::state::{StreamKind, Tally};
use super::Volume;

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
        self.lock().tally(Tally::HostRead(buf.len() as u64));
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

    /// Reads whole blocks into `out`: looks them up, reads their records
    /// from the medium in one batch, verifies and decompresses them, and
    /// looks again at any that failed (the cleaner may have moved them).
    pub(crate) fn read_blocks(&self, first: Lba, out: &mut [u8]) -> Result<()> {
        let Lookup {
            mut wanted,
            buffered,
        } = self.look_up(first, out)?;
        let mut failed: Vec<(usize, Error)> = Vec::new();
        for (index, bytes, version) in buffered {
            let lba = Lba(first.0 + index as u64);
            // Still in a stream buffer: no medium location to report.
            let loc = Location {
                segment: SegmentId(0),
                offset: 0,
                len: bytes.len() as u32,
            };
            if let Err(error) = decode_block(
                &self.record_key,
                lba,
                version,
                &bytes,
                loc,
                block_mut(out, index),
            ) {
                failed.push((index, error));
            }
        }
        wanted.sort_by_key(|extent| (extent.loc.segment, extent.loc.offset));
        let runs = coalesce(&wanted);
        failed.extend(self.read_runs(first, &wanted, &runs, out));
        for (index, error) in failed {
            self.reread_block(Lba(first.0 + index as u64), block_mut(out, index), error)?;
        }
        Ok(())
    }

    /// Under the state lock: fills holes and zeros in `out`, copies
    /// records still in a stream buffer, and lists the rest for reading.
    fn look_up(&self, first: Lba, out: &mut [u8]) -> Result<Lookup> {
        let count = (out.len() / BLOCK_SIZE) as u64;
        let mut lookup = Lookup {
            wanted: Vec::new(),
            buffered: Vec::new(),
        };
        let state = self.lock();
        let mut error = None;
        state.map().for_each_in(first, count, |lba, entry| {
            if error.is_some() {
                return;
            }
            let index = (lba.0 - first.0) as usize;
            match entry.slot() {
                Slot::Hole | Slot::Zero => block_mut(out, index).fill(0),
                Slot::Damaged => {
                    error = Some(damaged_earlier(
                        lba,
                        "its data was found damaged earlier; rewrite the block to clear",
                    ))
                }
                Slot::Data(loc) => match state.read_buffered(loc) {
                    Ok(Some(bytes)) => lookup.buffered.push((index, bytes, entry.version())),
                    Ok(None) => lookup.wanted.push(Wanted {
                        index,
                        loc,
                        version: entry.version(),
                    }),
                    Err(e) => error = Some(e),
                },
            }
        });
        match error {
            Some(error) => Err(error),
            None => Ok(lookup),
        }
    }

    /// Reads every run in one batch (a drive with many dies serves them in
    /// parallel) and decodes each block into `out`; returns the blocks
    /// that failed.
    fn read_runs(
        &self,
        first: Lba,
        wanted: &[Wanted],
        runs: &[Run],
        out: &mut [u8],
    ) -> Vec<(usize, Error)> {
        let media_read: u64 = runs.iter().map(|run| run.span_bytes).sum();
        let mut scratch = vec![0u8; media_read as usize];
        let results = {
            let mut ranges = Vec::with_capacity(runs.len());
            let mut rest = scratch.as_mut_slice();
            for run in runs {
                let (buf, tail) = std::mem::take(&mut rest).split_at_mut(run.span_bytes as usize);
                rest = tail;
                ranges.push(ReadRange {
                    segment: run.start.segment,
                    offset_bytes: run.start.offset as u64,
                    buf,
                });
            }
            self.media.read_batch(&mut ranges)
        };
        let mut failed = Vec::new();
        let mut base = 0usize;
        for (run, read) in runs.iter().zip(results) {
            for extent in &wanted[run.members.clone()] {
                let lba = Lba(first.0 + extent.index as u64);
                let loc = extent.loc;
                let result = match &read {
                    Ok(()) => {
                        let at = base + (loc.offset - run.start.offset) as usize;
                        let bytes = &scratch[at..at + loc.len as usize];
                        let block = block_mut(out, extent.index);
                        decode_block(&self.record_key, lba, extent.version, bytes, loc, block)
                    }
                    Err(e) => Err(Error::io(
                        format!("reading block {lba}"),
                        std::io::Error::other(e.to_string()),
                    )),
                };
                if let Err(error) = result {
                    failed.push((extent.index, error));
                }
            }
            base += run.span_bytes as usize;
        }
        self.lock().tally(Tally::MediaRead(media_read));
        failed
    }

    /// A block failed verification: if the map moved on (the cleaner
    /// relocated it, or a write replaced it), read it again; otherwise the
    /// block is damaged.
    fn reread_block(&self, lba: Lba, out: &mut [u8], mut error: Error) -> Result<()> {
        let mut previous = None;
        for _ in 0..4 {
            let entry = self.lock().map().get(lba);
            if previous == Some(entry) {
                break;
            }
            previous = Some(entry);
            let mut block = vec![0u8; BLOCK_SIZE];
            match self.read_block_once(lba, entry, &mut block) {
                Ok(()) => {
                    out.copy_from_slice(&block);
                    return Ok(());
                }
                Err(e) => error = e,
            }
        }
        self.lock().tally(Tally::DamageFound);
        Err(error)
    }

    fn read_block_once(&self, lba: Lba, entry: Entry, out: &mut [u8]) -> Result<()> {
        match entry.slot() {
            Slot::Hole | Slot::Zero => {
                out.fill(0);
                Ok(())
            }
            Slot::Damaged => Err(damaged_earlier(lba, "its data was found damaged earlier")),
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
        self.lock().tally(Tally::HostWrite(data.len() as u64));
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
        let batches = self.compressors.compress(count, |parts| {
            if parts == 1 {
                return vec![prepare(codec, data)];
            }
            let per = count.div_ceil(parts) * BLOCK_SIZE;
            data.par_chunks(per)
                .map(|part| prepare(codec, part))
                .collect()
        });
        let mut needed = 0u64;
        for batch in &batches {
            for block in &batch.blocks {
                needed += match block {
                    Prepared::Zero => RANGE_RECORD_LEN,
                    Prepared::Data { len, .. } => record_len_for_payload(*len),
                };
            }
        }
        let (mut state, floor) = self.admit(
            Writer::Host {
                blocks: count as u64,
            },
            needed,
            count as u64,
        )?;
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
                            state.apply_range(RecordKind::Zero, Lba(start), n, floor)?;
                        }
                        let payload = &batch.arena[*start..*start + *len];
                        state.apply_write(Lba(lba), *codec as u8, payload, *crc, floor)?;
                    }
                }
                lba += 1;
            }
        }
        if let Some((start, n)) = zero_run.take() {
            state.apply_range(RecordKind::Zero, Lba(start), n, floor)?;
        }
        debug_assert_eq!(lba, first.0 + count as u64, "every block was applied");
        Ok(())
    }

    /// Takes the state lock once `writer` has room to append `bytes` to
    /// the host stream and number `versions` versions, climbing the ladder
    /// in this thread if needed (this is what throttles writers when space
    /// runs short). Returns the guard and the number of segments that must
    /// stay free.
    pub(crate) fn admit(
        &self,
        writer: Writer,
        bytes: u64,
        versions: u64,
    ) -> Result<(StateGuard<'_>, u64)> {
        self.make_room(Reach::All, |state| Need {
            writer,
            segments: state.segments_needed(StreamKind::Host, bytes),
            versions,
            bytes,
        })
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
            let (mut state, floor) = self.admit(Writer::Range, RANGE_RECORD_LEN, 1)?;
            let first = Lba(first_full / BLOCK_SIZE_U64);
            state.apply_range(kind, first, (end_full - first_full) / BLOCK_SIZE_U64, floor)?;
            drop(state);
            if zeroing && end_full < end {
                self.modify_block_with(end_full, None, (end - end_full) as usize)?;
            }
        }
        self.lock().tally(match mode {
            Discard::Trim => Tally::HostTrim(len),
            Discard::Zero | Discard::ZeroPunch => Tally::HostZero(len),
        });
        if fua {
            self.flush()?;
        }
        Ok(())
    }
}

/// A block a read must fetch from the medium.
struct Wanted {
    /// Its position in the request.
    index: usize,
    loc: Location,
    version: u64,
}

/// What a read finds under the lock.
struct Lookup {
    wanted: Vec<Wanted>,
    /// Records still in a stream buffer: (position, bytes, version).
    buffered: Vec<(usize, Vec<u8>, u64)>,
}

/// Adjacent records read from the medium in one request.
struct Run {
    /// Positions in the sorted `wanted` list.
    members: Range<usize>,
    start: Location,
    span_bytes: u64,
}

/// Groups `wanted` (sorted by location) into runs of adjacent records, up
/// to `READ_COALESCE_BYTES` each.
fn coalesce(wanted: &[Wanted]) -> Vec<Run> {
    let mut runs = Vec::new();
    let mut run_start = 0;
    while run_start < wanted.len() {
        let start = wanted[run_start].loc;
        let mut run_end = run_start + 1;
        let mut end_offset = start.offset as u64 + start.len as u64;
        while let Some(next) = wanted.get(run_end).map(|w| w.loc) {
            let span = end_offset + next.len as u64 - start.offset as u64;
            if next.segment != start.segment
                || next.offset as u64 != end_offset
                || span > READ_COALESCE_BYTES
            {
                break;
            }
            end_offset += next.len as u64;
            run_end += 1;
        }
        runs.push(Run {
            members: run_start..run_end,
            start,
            span_bytes: end_offset - start.offset as u64,
        });
        run_start = run_end;
    }
    runs
}

/// The `index`th block of `out`.
fn block_mut(out: &mut [u8], index: usize) -> &mut [u8] {
    &mut out[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE]
}

fn damaged_earlier(lba: Lba, reason: &str) -> Error {
    Error::DamagedBlock {
        lba: lba.0,
        segment: 0,
        offset: 0,
        reason: reason.into(),
    }
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
