//! The host I/O paths: read, write, trim and write-zeroes.
//!
//! A write compresses its blocks before taking the state lock (in parallel
//! for large requests), then appends records and updates the map under it.
//! A read looks up locations under the lock, then reads and decompresses
//! outside it, verifying that each record is the one the map expected
//! (block number, version and CRC32C). If verification fails because the
//! cleaner moved the record meanwhile, the read looks again; if the map
//! still points there, the block is damaged and the read fails with an error
//! naming it, never returning wrong bytes. On a medium that lends its bytes
//! from a mapping, records are decoded where they lie, and a segment found
//! readied for a new incarnation afterwards has its blocks read again.
//!
//! Requests need no alignment: partial blocks go through read-modify-write
//! under a stripe lock, so concurrent sub-block writes to one block do not
//! lose each other's bytes.

use std::collections::HashMap;
use std::ops::Range;

use rayon::prelude::*;

use crate::codec::{
    compress_whole_blocks, decompress_block, decompress_exact, decompress_prefix, Codec, CodecId,
    Effort, RunPiece,
};
use crate::dedup::Hit;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::map::{key_block, table_key, Entry, Location, Slot, TABLE_BASE};
use crate::media::{HostDirection, ReadRange};
use crate::record::{
    decode_record, decode_unit, record_len_for_payload, unit_prefix_head, RecordKey, RecordKind,
    RefMember, CODEC_FAST_EFFORT, RANGE_PAYLOAD_LEN, REF_MEMBERS_MAX,
};
use crate::units::{Lba, SegmentId, BLOCK_SIZE, BLOCK_SIZE_U64};

use super::guard::StateGuard;
use super::space::{Need, Reach, Writer};
use super::state::{host_key, Buffered, Dedup, State, StreamKind, Tally, View};
use super::Volume;

/// Adjacent extents are read from the medium in one request up to this size.
const READ_COALESCE_BYTES: u64 = 1 << 20;
/// A read of fewer bytes from the medium copies them even where the medium
/// could lend them from a mapping: copying a few KiB costs little, while
/// each mapped page a read touches (64 KiB of them around each fault)
/// stays in the server's RSS, so random small reads over a large image
/// would make its RSS look like the image's size.
const MAPPED_READ_MIN_BYTES: u64 = 64 << 10;

/// The three ways of discarding data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discard {
    Trim,
    /// Zeroes that may become holes.
    ZeroPunch,
    /// Zeroes that stay allocated (NBD's NO_HOLE).
    Zero,
}

/// Blocks prepared for appending: a zero block, a block compressed alone,
/// or a unit of blocks compressed together. `start..start + len` is the
/// record payload in the batch's arena.
pub(super) enum Prepared {
    Zero,
    /// A block dedup found stored already: not compressed (`dedup.rs`).
    Found,
    Data {
        codec: CodecId,
        start: usize,
        len: usize,
        crc: u32,
    },
    /// A block stored raw: its payload is the request's own bytes, never
    /// copied into the batch.
    Raw {
        crc: u32,
    },
    Unit {
        codec: CodecId,
        start: usize,
        len: usize,
        crc: u32,
        blocks: usize,
    },
}

impl Prepared {
    pub(super) fn blocks(&self) -> usize {
        match self {
            Prepared::Unit { blocks, .. } => *blocks,
            _ => 1,
        }
    }

    pub(super) fn record_len(&self) -> u64 {
        match self {
            Prepared::Zero => RANGE_RECORD_LEN,
            // Its member of a reference record, with the record's header
            // counted whole: at most this.
            Prepared::Found => record_len_for_payload(4 + 16),
            Prepared::Data { len, .. } | Prepared::Unit { len, .. } => record_len_for_payload(*len),
            Prepared::Raw { .. } => record_len_for_payload(BLOCK_SIZE),
        }
    }
}

/// What dedup found for one block of a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    /// A zero block (stored as a range, never looked up).
    Zero,
    /// Not found: compressed and stored, then indexed.
    New(Fingerprint),
    /// The index names a block written with the same bytes.
    Stored(Fingerprint, Hit),
    /// The same bytes as new block `index` of this same request.
    Earlier(usize),
}

impl Found {
    /// True if the block is not compressed: it is shared, or skipped.
    pub(super) fn is_found(&self) -> bool {
        matches!(self, Found::Stored(..) | Found::Earlier(_))
    }
}

/// Compressed blocks of (part of) one request.
pub(super) struct Batch {
    arena: Vec<u8>,
    pub(super) blocks: Vec<Prepared>,
    /// The effort they were compressed at.
    effort: Effort,
}

impl Batch {
    /// The codec byte of a record of this batch compressed with `codec`:
    /// marked if written below full effort.
    fn codec_byte(&self, codec: CodecId) -> u8 {
        match self.effort {
            Effort::Full => codec as u8,
            Effort::Fast | Effort::Deferred => codec as u8 | CODEC_FAST_EFFORT,
        }
    }
}

/// Compresses `data`, whole blocks starting at block `first`: runs of
/// non-zero blocks within each aligned window of `unit_blocks` are tried
/// as one unit; what does not compress as a unit, and runs of one block,
/// are compressed block by block, all at `effort`. Blocks `found` marks
/// (dedup found them stored; empty: none) are left out, and end a run.
pub(super) fn prepare(
    codec: Codec,
    effort: Effort,
    data: &[u8],
    first: u64,
    unit_blocks: u64,
    found: &[bool],
) -> Batch {
    let count = data.len() / BLOCK_SIZE;
    debug_assert!(found.is_empty() || found.len() == count);
    let is_found = |index: usize| found.get(index).copied().unwrap_or(false);
    let mut batch = Batch {
        arena: Vec::with_capacity(data.len() / 2),
        blocks: Vec::with_capacity(count),
        effort,
    };
    let mut scratch = Vec::with_capacity(BLOCK_SIZE + 64);
    let block = |index: usize| &data[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE];
    let mut index = 0;
    while index < count {
        if is_found(index) {
            batch.blocks.push(Prepared::Found);
            index += 1;
            continue;
        }
        if is_zero(block(index)) {
            batch.blocks.push(Prepared::Zero);
            index += 1;
            continue;
        }
        // The run of non-zero blocks from here to the unit window's end.
        let window_end = ((first + index as u64) / unit_blocks + 1) * unit_blocks;
        let limit = count.min((window_end - first) as usize);
        let mut end = index + 1;
        while end < limit && !is_found(end) && !is_zero(block(end)) {
            end += 1;
        }
        let blocks = end - index;
        let run = &data[index * BLOCK_SIZE..end * BLOCK_SIZE];
        compress_whole_blocks(codec, effort, run, &mut scratch, |piece| {
            let start = batch.arena.len();
            match piece {
                RunPiece::Unit { codec, data } => {
                    batch
                        .arena
                        .extend_from_slice(&unit_prefix_head(blocks, true, false));
                    batch.arena.extend_from_slice(data);
                    let payload = &batch.arena[start..];
                    batch.blocks.push(Prepared::Unit {
                        codec,
                        start,
                        len: payload.len(),
                        crc: crc32c::crc32c(payload),
                        blocks,
                    });
                }
                RunPiece::Block {
                    codec: CodecId::Raw,
                    data,
                    ..
                } => batch.blocks.push(Prepared::Raw {
                    crc: crc32c::crc32c(data),
                }),
                RunPiece::Block { codec, data, .. } => {
                    batch.arena.extend_from_slice(data);
                    batch.blocks.push(Prepared::Data {
                        codec,
                        start,
                        len: data.len(),
                        crc: crc32c::crc32c(data),
                    });
                }
            }
        });
        index = end;
    }
    batch
}

/// Where to cut a request of `count` blocks starting at block `first`
/// into about `parts` parts for parallel compression, on multiples of
/// `unit_blocks`: the cut points, from 0 to `count`.
fn split_on_windows(first: u64, count: usize, parts: usize, unit_blocks: u64) -> Vec<usize> {
    let per = (count.div_ceil(parts) as u64).div_ceil(unit_blocks).max(1) * unit_blocks;
    let mut cuts = vec![0];
    // The first window boundary after `first`, then every `per` blocks.
    let mut next = (first / unit_blocks + 1) * unit_blocks - first + per - unit_blocks;
    while (next as usize) < count {
        cuts.push(next as usize);
        next += per;
    }
    cuts.push(count);
    cuts
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
        self.tally(Tally::HostRead(buf.len() as u64));
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
    /// from the medium in one batch (each record once, however many of
    /// its blocks are wanted), verifies and decompresses them, and looks
    /// again at any block that failed (the cleaner may have moved it).
    pub(crate) fn read_blocks(&self, first: Lba, out: &mut [u8]) -> Result<()> {
        let lookup = self.look_up(first, out)?;
        let failed = self.fetch(first, lookup, out);
        for (index, error) in failed {
            self.reread_block(Lba(first.0 + index as u64), block_mut(out, index), error)?;
        }
        Ok(())
    }

    /// Reads, verifies and decodes into `out` what `lookup` found for the
    /// blocks from `first`; returns the blocks that failed.
    pub(super) fn fetch(&self, first: Lba, lookup: Lookup, out: &mut [u8]) -> Vec<(usize, Error)> {
        let Lookup {
            wanted,
            buffered,
            incarnations,
        } = lookup;
        let mut last_segment = None;
        for wanted in &wanted {
            if last_segment != Some(wanted.loc.segment) {
                last_segment = Some(wanted.loc.segment);
                self.note_segment_read(wanted.loc.segment);
            }
        }
        let mut failed: Vec<(usize, Error)> = Vec::new();
        for (buffered, members) in buffered {
            match buffered.complete(&*self.media) {
                Ok(bytes) => {
                    decode_into(&self.record_key, first, &bytes, &members, out, &mut failed)
                }
                Err(e) => {
                    failed.extend(members.iter().map(|w| (w.index, read_failed(first, w, &e))))
                }
            }
        }
        let records = by_record(wanted);
        let runs = coalesce(&records);
        failed.extend(self.read_runs(first, &records, &runs, &incarnations, out));
        failed
    }

    /// Under the state lock: fills holes and zeros in `out`, copies
    /// records not yet on the medium, and lists the rest for reading.
    /// The lock is taken shared when the range's map leaves are in RAM
    /// (the common case, beside other reads); else exclusively, to fault
    /// them in (`lock_resident`).
    fn look_up(&self, first: Lba, out: &mut [u8]) -> Result<Lookup> {
        let count = (out.len() / BLOCK_SIZE) as u64;
        // Allocated before the lock is taken, not under it.
        let mut lookup = Lookup {
            wanted: Vec::with_capacity(count as usize),
            buffered: Vec::new(),
            incarnations: Vec::with_capacity(count.min(16) as usize),
        };
        let peek = {
            let state = self.lock_shared();
            if state.map().is_resident(first, count) {
                state.map().count_hit_shared();
                if look_up_in(&state, first, out, &mut lookup)? {
                    return Ok(lookup);
                }
                lookup.clear();
                None
            } else {
                state.map().peek_fault(first, count)
            }
        };
        // With the cache full, a leaf met once is read from its page
        // without being kept (`Map::peek_fault`): no exclusive lock, no
        // leaf built, none evicted. Any failure, or a leaf that changed
        // meanwhile, falls back to faulting it in, which tells damage
        // from a page a checkpoint moved.
        if let Some(fault) = peek {
            if let Ok(entries) = fault.peek(&*self.media, first, count) {
                let state = self.lock_shared();
                if state.map().fault_is_current(&fault) {
                    state.map().count_peek();
                    let mut finder = Finder::new(&state, first, out, &mut lookup);
                    for (at, entry) in (first.0..).zip(entries) {
                        finder.add(Lba(at), entry);
                    }
                    if finder.finish()? {
                        return Ok(lookup);
                    }
                    lookup.clear();
                }
            }
        }
        // Brings in the cells of the range's shared blocks too.
        let state = self.lock_resident(first, count)?;
        let complete = look_up_in(&state, first, out, &mut lookup)?;
        debug_assert!(complete, "cells of blocks {first}+{count} are in RAM");
        if !complete {
            return Err(Error::io(
                format!("looking up blocks {first}+{count}"),
                std::io::Error::other("a shared block's map page could not be kept in RAM"),
            ));
        }
        Ok(lookup)
    }

    /// Reads every run in one batch (a drive with many dies serves them in
    /// parallel) and decodes each record's wanted blocks into `out`;
    /// returns the blocks that failed. On a medium with a mapping, decodes
    /// straight from it instead (`read_mapped`).
    fn read_runs(
        &self,
        first: Lba,
        records: &[Vec<Wanted>],
        runs: &[Run],
        incarnations: &[(SegmentId, u64)],
        out: &mut [u8],
    ) -> Vec<(usize, Error)> {
        let media_read: u64 = runs.iter().map(|run| run.span_bytes).sum();
        if media_read >= MAPPED_READ_MIN_BYTES {
            if let Some(failed) = self.read_mapped(first, records, runs, incarnations, out) {
                return failed;
            }
        }
        // The worker's buffer from its earlier reads: zeroing a fresh one
        // for every request showed as 8% of a sequential read's profile.
        let mut buffer = READ_SCRATCH.with(|kept| kept.take());
        if buffer.len() < media_read as usize {
            buffer.resize(media_read as usize, 0);
        }
        let scratch = &mut buffer[..media_read as usize];
        let results = {
            let mut ranges = Vec::with_capacity(runs.len());
            let mut rest = &mut *scratch;
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
            for members in &records[run.members.clone()] {
                let loc = members[0].loc;
                match &read {
                    Ok(()) => {
                        let at = base + (loc.offset - run.start.offset) as usize;
                        let bytes = &scratch[at..at + loc.len as usize];
                        decode_into(&self.record_key, first, bytes, members, out, &mut failed);
                    }
                    Err(e) => {
                        failed.extend(members.iter().map(|w| (w.index, read_failed(first, w, e))));
                    }
                }
            }
            base += run.span_bytes as usize;
        }
        if buffer.len() <= READ_SCRATCH_KEPT_BYTES {
            READ_SCRATCH.with(|kept| kept.replace(buffer));
        }
        self.tally(Tally::MediaRead(media_read));
        failed
    }

    /// `read_runs` on a medium with a mapping (`None` without one): each
    /// record is verified and decompressed where the medium keeps it, with
    /// no copy. The lent bytes are not a snapshot, so afterwards, under the
    /// lock, every segment read must still be the incarnation the lookup
    /// found (`incarnations`): records are never rewritten within an
    /// incarnation, so then the bytes did not change while in use. Blocks
    /// from a segment readied again meanwhile are failed, for
    /// `reread_block` to fetch wherever the map now points.
    fn read_mapped(
        &self,
        first: Lba,
        records: &[Vec<Wanted>],
        runs: &[Run],
        incarnations: &[(SegmentId, u64)],
        out: &mut [u8],
    ) -> Option<Vec<(usize, Error)>> {
        let mut failed = Vec::new();
        let mut media_read = 0;
        for (position, run) in runs.iter().enumerate() {
            let mapped = self.media.mapped(
                run.start.segment,
                run.start.offset as u64,
                run.span_bytes as usize,
            );
            let bytes = match mapped {
                Ok(Some(bytes)) => bytes,
                Ok(None) => {
                    assert_eq!(position, 0, "a medium maps all of its segments or none");
                    return None;
                }
                Err(e) => {
                    for members in &records[run.members.clone()] {
                        failed.extend(members.iter().map(|w| (w.index, read_failed(first, w, &e))));
                    }
                    continue;
                }
            };
            media_read += run.span_bytes;
            for members in &records[run.members.clone()] {
                let loc = members[0].loc;
                let at = (loc.offset - run.start.offset) as usize;
                let record = &bytes[at..at + loc.len as usize];
                decode_into(&self.record_key, first, record, members, out, &mut failed);
            }
        }
        // Every load from the mapping above comes before the check below.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let mut state = self.lock();
        state.tally(Tally::MediaRead(media_read));
        let reused: Vec<SegmentId> = incarnations
            .iter()
            .filter(|&&(segment, seq)| state.space().segment(segment).seq != seq)
            .map(|&(segment, _)| segment)
            .collect();
        drop(state);
        if !reused.is_empty() {
            let stale: Vec<&Wanted> = records
                .iter()
                .flatten()
                .filter(|w| reused.contains(&w.loc.segment))
                .collect();
            failed.retain(|(index, _)| !stale.iter().any(|w| w.index == *index));
            for wanted in stale {
                let reason = Error::io(
                    format!("reading segment {}", wanted.loc.segment),
                    std::io::Error::other("the segment was reused while it was being read"),
                );
                failed.push((wanted.index, read_failed(first, wanted, &reason)));
            }
        }
        Some(failed)
    }

    /// A block failed verification: if the map moved on (the cleaner
    /// relocated it, or a write replaced it), read it again; otherwise the
    /// block is damaged.
    fn reread_block(&self, lba: Lba, out: &mut [u8], mut error: Error) -> Result<()> {
        let mut previous = None;
        for _ in 0..4 {
            // A shared block is read where its content's cell says.
            let (entry, shared) = {
                let state = self.lock_resident(lba, 1)?;
                let entry = state.map().get(lba);
                match entry.slot() {
                    Slot::Shared { content } => (state.map().get(table_key(content)), true),
                    _ => (entry, false),
                }
            };
            if previous == Some(entry) {
                break;
            }
            previous = Some(entry);
            let mut block = vec![0u8; BLOCK_SIZE];
            match self.read_block_once(lba, entry, shared, &mut block) {
                Ok(()) => {
                    out.copy_from_slice(&block);
                    return Ok(());
                }
                Err(e) => error = e,
            }
        }
        self.tally(Tally::DamageFound);
        Err(error)
    }

    /// Reads block `lba`, whose entry is `entry` (for a shared block, its
    /// content's cell).
    pub(super) fn read_block_once(
        &self,
        lba: Lba,
        entry: Entry,
        shared: bool,
        out: &mut [u8],
    ) -> Result<()> {
        match entry.slot() {
            Slot::Hole if shared => Err(damaged_earlier(
                lba,
                "the data it shares is no longer stored",
            )),
            Slot::Shared { .. } => Err(damaged_earlier(
                lba,
                "the data it shares names other shared data",
            )),
            Slot::Hole | Slot::Zero => {
                out.fill(0);
                Ok(())
            }
            Slot::Damaged => Err(damaged_earlier(lba, "its data was found damaged earlier")),
            Slot::Data(loc) => {
                let buffered = self.lock().read_buffered(loc)?;
                let bytes = match buffered {
                    Some(buffered) => buffered.complete(&*self.media)?,
                    None => {
                        let mut bytes = vec![0u8; loc.len as usize];
                        self.media
                            .read(loc.segment, loc.offset as u64, &mut bytes)?;
                        bytes
                    }
                };
                let wanted = [Wanted {
                    index: 0,
                    loc,
                    version: entry.version(),
                    shared,
                }];
                let mut failed = Vec::new();
                decode_into(&self.record_key, lba, &bytes, &wanted, out, &mut failed);
                match failed.pop() {
                    Some((_, error)) => Err(error),
                    None => Ok(()),
                }
            }
        }
    }

    pub(crate) fn write_bytes(
        &self,
        target: Target,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> Result<()> {
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
                self.modify_block(target, position, Some(piece))?;
                position = piece_end;
            }
        } else {
            if offset < first_full {
                let head = &data[..(first_full - offset) as usize];
                self.modify_block(target, offset, Some(head))?;
            }
            let middle = &data[(first_full - offset) as usize..(end_full - offset) as usize];
            self.write_blocks(target, Lba(first_full / BLOCK_SIZE_U64), middle)?;
            if end_full < end {
                let tail = &data[(end_full - offset) as usize..];
                self.modify_block(target, end_full, Some(tail))?;
            }
        }
        self.tally(Tally::HostWrite(data.len() as u64));
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Read-modify-write of part of one block: `bytes` at byte `offset`, or
    /// zeros of `len` when `bytes` is `None`.
    fn modify_block(&self, target: Target, offset: u64, bytes: Option<&[u8]>) -> Result<()> {
        self.modify_block_with(target, offset, bytes, 0)
    }

    fn modify_block_with(
        &self,
        target: Target,
        offset: u64,
        bytes: Option<&[u8]>,
        zero_len: usize,
    ) -> Result<()> {
        let lba = Lba(offset / BLOCK_SIZE_U64);
        let key = host_key(target.space, lba.0);
        let _stripe = self.stripes[(key.0 % self.stripes.len() as u64) as usize]
            .lock()
            .expect("stripe lock poisoned");
        let mut block = vec![0u8; BLOCK_SIZE];
        match target.space {
            0 => self.read_blocks(lba, &mut block)?,
            space => {
                let view = View::Clone(space, target.made);
                self.read_view_blocks(view, "", lba, &mut block)?
            }
        }
        let at = (offset % BLOCK_SIZE_U64) as usize;
        match bytes {
            Some(bytes) => block[at..at + bytes.len()].copy_from_slice(bytes),
            None => block[at..at + zero_len].fill(0),
        }
        self.write_blocks(target, lba, &block)
    }

    /// The most blocks a write compresses as one unit: the image's setting,
    /// kept a fraction of a segment (see `record::unit_blocks_for_segment`).
    pub(crate) fn unit_blocks(&self) -> u8 {
        let segment_cap = crate::record::unit_blocks_for_segment(self.geometry.segment_size_bytes);
        self.settings.unit_blocks.min(segment_cap)
    }

    /// Compresses and appends whole blocks from block `first` of
    /// `target`; with dedup on, blocks of the image's volume found stored
    /// already are shared instead (`dedup.rs`; a clone's writes are not
    /// deduplicated).
    pub(crate) fn write_blocks(&self, target: Target, first: Lba, data: &[u8]) -> Result<()> {
        debug_assert_eq!(data.len() % BLOCK_SIZE, 0);
        let first = host_key(target.space, first.0);
        let codec = self.settings.codec;
        let unit_blocks = self.unit_blocks() as u64;
        let count = data.len() / BLOCK_SIZE;
        let found = match target.space {
            0 => self.find_stored(data),
            _ => None,
        };
        let skip: Vec<bool> = found
            .as_ref()
            .map(|found| found.iter().map(Found::is_found).collect())
            .unwrap_or_default();
        let batches = self.compressors.compress(count, |parts, effort| {
            if parts == 1 {
                return vec![prepare(codec, effort, data, first.0, unit_blocks, &skip)];
            }
            // Parts end on unit windows, so that no unit is cut in two.
            let cuts = split_on_windows(first.0, count, parts, unit_blocks);
            cuts.par_windows(2)
                .map(|cut| {
                    let part = &data[cut[0] * BLOCK_SIZE..cut[1] * BLOCK_SIZE];
                    let skip = skip.get(cut[0]..cut[1]).unwrap_or(&[]);
                    prepare(
                        codec,
                        effort,
                        part,
                        first.0 + cut[0] as u64,
                        unit_blocks,
                        skip,
                    )
                })
                .collect()
        });
        let fast_blocks: usize = batches
            .iter()
            .filter(|batch| batch.effort != Effort::Full)
            .flat_map(|batch| &batch.blocks)
            // Every stored block: zeros and found blocks store nothing.
            .filter(|block| !matches!(block, Prepared::Zero | Prepared::Found))
            .map(Prepared::blocks)
            .sum();
        if fast_blocks > 0 {
            self.tally(Tally::HostWriteFast((fast_blocks * BLOCK_SIZE) as u64));
        }
        let new_blocks = found.as_ref().map_or(0, |found| {
            found.iter().filter(|f| matches!(f, Found::New(_))).count() as u64
        });
        let needed: u64 = batches
            .iter()
            .flat_map(|batch| &batch.blocks)
            .map(Prepared::record_len)
            .sum::<u64>()
            + self.chapter_bytes_for(new_blocks);
        // The leaves of the blocks found and of their contents' cells come
        // into RAM with the request's.
        let mut ranges = vec![(first, count as u64)];
        if let Some(found) = &found {
            let mut extra: Vec<(Lba, u64)> = found
                .iter()
                .filter_map(|f| match f {
                    Found::Stored(_, hit) => {
                        Some([(table_key(hit.content), 1), (Lba(hit.owner), 1)])
                    }
                    _ => None,
                })
                .flatten()
                .filter(|(lba, _)| lba.0 >= crate::map::TABLE_BASE || lba.0 < self.logical_blocks())
                .collect();
            extra.sort_unstable();
            extra.dedup();
            ranges.extend(extra);
        }
        let (mut state, floor) = self.make_room_resident(Reach::All, &ranges, |state| Need {
            writer: Writer::Host {
                blocks: count as u64,
            },
            segments: state.segments_needed(StreamKind::Host, needed),
            versions: count as u64,
            bytes: needed,
        })?;
        state.check_clone_live(first, target.made)?;
        let mut apply = Applier {
            volume: self,
            first,
            found: found.as_deref(),
            data,
            floor,
            zero_run: None,
            refs: Vec::new(),
            refs_first: first,
            indexed: Vec::new(),
            shared_blocks: 0,
            saved_bytes: 0,
            stale: 0,
            unchanged: 0,
        };
        let mut lba = first.0;
        for batch in &batches {
            for block in &batch.blocks {
                apply.block(&mut state, Lba(lba), batch, block)?;
                lba += block.blocks() as u64;
            }
        }
        apply.finish(&mut state)?;
        self.compressors.note_room(
            state.free_segment_count(),
            u64::from(self.geometry.segment_count),
        );
        debug_assert_eq!(lba, first.0 + count as u64, "every block was applied");
        Ok(())
    }

    /// Takes the state lock once `writer` has room to append `bytes` to
    /// the host stream and number `versions` versions, climbing the ladder
    /// in this thread if needed (this is what throttles writers when space
    /// runs short). Returns the guard and the number of segments that must
    /// stay free.
    /// The map leaves of blocks `first..first+count`, which the caller
    /// changes, are in RAM then.
    pub(crate) fn admit(
        &self,
        writer: Writer,
        (first, count): (Lba, u64),
        bytes: u64,
        versions: u64,
    ) -> Result<(StateGuard<'_>, u64)> {
        self.make_room_resident(Reach::All, &[(first, count)], |state| Need {
            writer,
            segments: state.segments_needed(StreamKind::Host, bytes),
            versions,
            bytes,
        })
    }

    pub(crate) fn discard(
        &self,
        target: Target,
        offset: u64,
        len: u64,
        mode: Discard,
        fua: bool,
    ) -> Result<()> {
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
                    let len = (piece_end - position) as usize;
                    self.modify_block_with(target, position, None, len)?;
                    position = piece_end;
                }
            }
        } else {
            if zeroing && offset < first_full {
                self.modify_block_with(target, offset, None, (first_full - offset) as usize)?;
            }
            let kind = match mode {
                Discard::Trim | Discard::ZeroPunch => RecordKind::Trim,
                Discard::Zero => RecordKind::Zero,
            };
            // Trims and zeroes free space, so they may use the cleaner's reserve.
            let first = host_key(target.space, first_full / BLOCK_SIZE_U64);
            let count = (end_full - first_full) / BLOCK_SIZE_U64;
            let (mut state, floor) =
                self.admit(Writer::Range, (first, count), RANGE_RECORD_LEN, 1)?;
            state.check_clone_live(first, target.made)?;
            state.apply_range(kind, first, count, floor)?;
            drop(state);
            if zeroing && end_full < end {
                self.modify_block_with(target, end_full, None, (end - end_full) as usize)?;
            }
        }
        self.tally(match mode {
            Discard::Trim => Tally::HostTrim(len),
            Discard::Zero | Discard::ZeroPunch => Tally::HostZero(len),
        });
        if fua {
            self.flush()?;
        }
        Ok(())
    }
}

/// The volume a host write goes to: the image's own (space 0), or the
/// clone in key space `space` made at version `made` (a write to a clone
/// deleted since, whose space may be reused, is refused under the lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Target {
    pub space: u16,
    pub made: u64,
}

impl Target {
    pub(crate) const VOLUME: Target = Target { space: 0, made: 0 };
}

/// A block a read must fetch from the medium.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wanted {
    /// Its position in the request.
    pub index: usize,
    pub loc: Location,
    /// The version the record holds it at: the block's own, or for a
    /// shared block, its content's.
    pub version: u64,
    /// The block shares its content: the record was written for another
    /// block, so only the version identifies it.
    pub shared: bool,
}

/// Why block `wanted` of a read from block `first` failed: reading its record did.
/// Applies a write's prepared blocks in order, under the state lock:
/// zero runs and runs of shared blocks become one record each.
struct Applier<'a> {
    volume: &'a Volume,
    first: Lba,
    /// What dedup found for each block (`None`: dedup is off).
    found: Option<&'a [Found]>,
    data: &'a [u8],
    floor: u64,
    zero_run: Option<(u64, u64)>,
    /// The run of shared blocks from `refs_first` not yet applied.
    refs: Vec<RefMember>,
    refs_first: Lba,
    /// New blocks written, to index once applied.
    indexed: Vec<(Fingerprint, Lba)>,
    shared_blocks: u64,
    saved_bytes: u64,
    stale: u64,
    unchanged: u64,
}

impl Applier<'_> {
    fn block(
        &mut self,
        state: &mut State,
        lba: Lba,
        batch: &Batch,
        block: &Prepared,
    ) -> Result<()> {
        match block {
            Prepared::Zero => {
                self.flush_refs(state)?;
                self.zero_run = match self.zero_run {
                    Some((start, n)) => Some((start, n + 1)),
                    None => Some((lba.0, 1)),
                };
            }
            Prepared::Found => {
                self.flush_zeros(state)?;
                self.found_block(state, lba)?;
            }
            Prepared::Data {
                codec,
                start,
                len,
                crc,
            } => {
                self.flush_zeros(state)?;
                self.flush_refs(state)?;
                let payload = &batch.arena[*start..*start + *len];
                let codec = batch.codec_byte(*codec);
                state.apply_write(lba, codec, payload, *crc, self.floor)?;
                self.note_new(lba, 1);
            }
            Prepared::Raw { crc } => {
                self.flush_zeros(state)?;
                self.flush_refs(state)?;
                let payload = self.block_data(lba);
                let codec = batch.codec_byte(CodecId::Raw);
                state.apply_write(lba, codec, payload, *crc, self.floor)?;
                self.note_new(lba, 1);
            }
            Prepared::Unit {
                codec,
                start,
                len,
                crc,
                blocks,
            } => {
                self.flush_zeros(state)?;
                self.flush_refs(state)?;
                let payload = &batch.arena[*start..*start + *len];
                let codec = batch.codec_byte(*codec);
                state.apply_unit(lba, codec, payload, *crc, self.floor)?;
                self.note_new(lba, *blocks);
            }
        }
        Ok(())
    }

    fn index_of(&self, lba: Lba) -> usize {
        (lba.0 - self.first.0) as usize
    }

    /// The bytes the request writes to block `lba`.
    fn block_data(&self, lba: Lba) -> &[u8] {
        let at = self.index_of(lba) * BLOCK_SIZE;
        &self.data[at..at + BLOCK_SIZE]
    }

    /// Queues new blocks `lba..lba+blocks` for the index.
    fn note_new(&mut self, lba: Lba, blocks: usize) {
        let Some(found) = self.found else {
            return;
        };
        for i in 0..blocks as u64 {
            let block = Lba(lba.0 + i);
            if let Found::New(fingerprint) = found[self.index_of(block)] {
                self.indexed.push((fingerprint, block));
            }
        }
    }

    /// A block dedup found: shared if its content is still stored,
    /// skipped if the block holds it already, else stored after all.
    fn found_block(&mut self, state: &mut State, lba: Lba) -> Result<()> {
        let found = self.found.expect("found blocks come from dedup")[self.index_of(lba)];
        let (fingerprint, verdict) = match found {
            Found::Stored(fingerprint, hit) => (
                Some(fingerprint),
                state.dedup_member(lba, hit.content, hit.owner),
            ),
            Found::Earlier(earlier) => {
                // Written earlier in this request, so still in the map.
                let owner = Lba(self.first.0 + earlier as u64);
                let content = state.map().get(owner).version();
                (None, state.dedup_member(lba, content, owner.0))
            }
            Found::Zero | Found::New(_) => unreachable!("{found:?} was compressed"),
        };
        match verdict {
            Dedup::Share(member, bytes) => {
                let contiguous = self.refs_first.0 + self.refs.len() as u64 == lba.0;
                if !contiguous || self.refs.len() == REF_MEMBERS_MAX as usize {
                    self.flush_refs(state)?;
                }
                if self.refs.is_empty() {
                    self.refs_first = lba;
                }
                self.refs.push(member);
                self.shared_blocks += 1;
                self.saved_bytes += bytes;
            }
            Dedup::Held => {
                self.flush_refs(state)?;
                self.unchanged += 1;
            }
            Dedup::Gone => {
                self.flush_refs(state)?;
                self.stale += 1;
                let block = self.block_data(lba);
                let codec = self.volume.settings.codec;
                let batch = prepare(codec, Effort::Full, block, lba.0, 1, &[]);
                match &batch.blocks[..] {
                    [Prepared::Data {
                        codec,
                        start,
                        len,
                        crc,
                    }] => {
                        let payload = &batch.arena[*start..*start + *len];
                        state.apply_write(lba, *codec as u8, payload, *crc, self.floor)?;
                    }
                    [Prepared::Raw { crc }] => {
                        state.apply_write(lba, CodecId::Raw as u8, block, *crc, self.floor)?;
                    }
                    other => {
                        unreachable!("a non-zero block alone compresses alone: {}", other.len())
                    }
                }
                if let Some(fingerprint) = fingerprint {
                    self.indexed.push((fingerprint, lba));
                }
            }
        }
        Ok(())
    }

    fn flush_zeros(&mut self, state: &mut State) -> Result<()> {
        if let Some((start, n)) = self.zero_run.take() {
            state.apply_range(RecordKind::Zero, Lba(start), n, self.floor)?;
        }
        Ok(())
    }

    fn flush_refs(&mut self, state: &mut State) -> Result<()> {
        if !self.refs.is_empty() {
            state.apply_ref(self.refs_first, &self.refs, self.floor)?;
            self.refs.clear();
        }
        Ok(())
    }

    /// Applies what is pending, indexes the new blocks, and counts.
    fn finish(mut self, state: &mut State) -> Result<()> {
        self.flush_zeros(state)?;
        self.flush_refs(state)?;
        if self.found.is_none() {
            return Ok(());
        }
        state.note_deduplicated(self.shared_blocks, self.saved_bytes);
        self.volume.note_dedup(self.stale, self.unchanged);
        self.volume
            .index_new_blocks(state, &self.indexed, self.floor)
    }
}

fn read_failed(first: Lba, wanted: &Wanted, error: &Error) -> Error {
    let lba = Lba(first.0 + wanted.index as u64);
    Error::io(
        format!("reading block {lba}"),
        std::io::Error::other(error.to_string()),
    )
}

/// The lookup [`Volume::look_up`] makes under the lock, shared or not.
/// Ok(false) if a shared block's cell was paged out (`Finder::finish`).
fn look_up_in(state: &State, first: Lba, out: &mut [u8], lookup: &mut Lookup) -> Result<bool> {
    let count = (out.len() / BLOCK_SIZE) as u64;
    let mut finder = Finder::new(state, first, out, lookup);
    state
        .map()
        .for_each_in(first, count, |lba, entry| finder.add(lba, entry));
    finder.finish()
}

/// Sorts the entries a read looks up, block by block, under the state
/// lock: holes and zeros filled in `out`, records not on the medium yet
/// copied, the rest listed with their segments' incarnations.
pub(super) struct Finder<'a, 'b> {
    state: &'a State,
    /// Verify records by version alone (a snapshot's view: the entry may
    /// be kept under another key than the record's block).
    by_version: bool,
    first: Lba,
    out: &'b mut [u8],
    lookup: &'b mut Lookup,
    /// Records not on the medium yet, by where they start.
    copied: HashMap<(SegmentId, u32), usize>,
    error: Option<Error>,
    /// A shared block's cell was not in RAM.
    cells_paged: bool,
}

impl<'a, 'b> Finder<'a, 'b> {
    pub(super) fn new(
        state: &'a State,
        first: Lba,
        out: &'b mut [u8],
        lookup: &'b mut Lookup,
    ) -> Self {
        Finder {
            state,
            by_version: false,
            first,
            out,
            lookup,
            copied: HashMap::new(),
            error: None,
            cells_paged: false,
        }
    }

    /// Records are verified by version alone.
    pub(super) fn by_version(mut self) -> Self {
        self.by_version = true;
        self
    }

    pub(super) fn add(&mut self, lba: Lba, entry: Entry) {
        if self.error.is_some() {
            return;
        }
        let index = (lba.0 - self.first.0) as usize;
        match entry.slot() {
            Slot::Hole | Slot::Zero => block_mut(self.out, index).fill(0),
            Slot::Damaged => {
                self.error = Some(damaged_earlier(
                    lba,
                    "its data was found damaged earlier; rewrite the block to clear",
                ))
            }
            Slot::Data(loc) => self.add_stored(index, loc, entry.version(), self.by_version),
            Slot::Shared { content } => {
                let cell = table_key(content);
                if !self.state.map().is_resident(cell, 1) {
                    self.cells_paged = true;
                    return;
                }
                match self.state.map().get(cell).slot() {
                    Slot::Data(loc) => self.add_stored(index, loc, content, true),
                    _ => self.error = Some(damaged_earlier(
                        lba,
                        "the data it shares was found damaged earlier; rewrite the block to clear",
                    )),
                }
            }
        }
    }

    /// Block `index` is in the record at `loc`, at `version`.
    fn add_stored(&mut self, index: usize, loc: Location, version: u64, shared: bool) {
        let wanted = Wanted {
            index,
            loc,
            version,
            shared,
        };
        if let Some(&at) = self.copied.get(&loc.record_key()) {
            self.lookup.buffered[at].1.push(wanted);
            return;
        }
        match self.state.read_buffered(loc) {
            Ok(Some(bytes)) => {
                self.copied
                    .insert(loc.record_key(), self.lookup.buffered.len());
                self.lookup.buffered.push((bytes, vec![wanted]));
            }
            Ok(None) => {
                self.lookup.wanted.push(wanted);
                let segment = loc.segment;
                if !self.lookup.incarnations.iter().any(|&(s, _)| s == segment) {
                    let seq = self.state.space().segment(segment).seq;
                    self.lookup.incarnations.push((segment, seq));
                }
            }
            Err(e) => self.error = Some(e),
        }
    }

    /// Ok(false) if a shared block's cell was paged out: the lookup must
    /// be made again with it in RAM.
    pub(super) fn finish(self) -> Result<bool> {
        match self.error {
            Some(error) => Err(error),
            None => Ok(!self.cells_paged),
        }
    }
}

/// What a read finds under the lock.
pub(super) struct Lookup {
    wanted: Vec<Wanted>,
    /// Each segment `wanted` reads from, with its incarnation (`seq`) at lookup.
    incarnations: Vec<(SegmentId, u64)>,
    /// Records not on the medium yet, copied, with the blocks wanted of each.
    buffered: Vec<(Buffered, Vec<Wanted>)>,
}

impl Lookup {
    pub(super) fn with_capacity(count: usize) -> Lookup {
        Lookup {
            wanted: Vec::with_capacity(count),
            buffered: Vec::new(),
            incarnations: Vec::with_capacity(count.min(16)),
        }
    }

    /// Forgets a lookup to be made again.
    fn clear(&mut self) {
        self.wanted.clear();
        self.incarnations.clear();
        self.buffered.clear();
    }
}

/// Groups wanted blocks by record, in medium order.
fn by_record(mut wanted: Vec<Wanted>) -> Vec<Vec<Wanted>> {
    wanted.sort_by_key(|w| (w.loc.record_key(), w.loc.member));
    let mut records: Vec<Vec<Wanted>> = Vec::new();
    for w in wanted {
        match records.last_mut() {
            Some(record) if record[0].loc.record_key() == w.loc.record_key() => record.push(w),
            _ => records.push(vec![w]),
        }
    }
    records
}

/// Adjacent records read from the medium in one request.
struct Run {
    /// Positions in the sorted record list.
    members: Range<usize>,
    start: Location,
    span_bytes: u64,
}

/// Groups records (sorted by location) into runs of adjacent ones, up to
/// `READ_COALESCE_BYTES` each.
fn coalesce(records: &[Vec<Wanted>]) -> Vec<Run> {
    let mut runs = Vec::new();
    let mut run_start = 0;
    while run_start < records.len() {
        let start = records[run_start][0].loc;
        let mut run_end = run_start + 1;
        let mut end_offset = start.offset as u64 + start.len as u64;
        while let Some(next) = records.get(run_end).map(|r| r[0].loc) {
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
pub(super) fn block_mut(out: &mut [u8], index: usize) -> &mut [u8] {
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
/// True if a record whose header names key `named` was written for block
/// key `lba`: the same key, or the same block in another key space (the
/// cleaner rewrites an entry a snapshot keeps under its key there, and a
/// replay that lost the change which made it kept gives it back to the
/// volume; the version, never reused, says it is that block's).
fn names_block(named: u64, lba: u64) -> bool {
    named == lba || (named < TABLE_BASE && lba < TABLE_BASE && key_block(named) == key_block(lba))
}

pub(crate) fn decode_block(
    key: &RecordKey,
    lba: Lba,
    version: u64,
    shared: bool,
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
    // A shared block's record was written for another block (or names its
    // content's cell): versions are never reused, so the version alone
    // says the record holds the content.
    if header.kind != RecordKind::Data
        || (!names_block(header.lba, lba.0) && !shared)
        || header.version != version
    {
        return Err(damaged(format!(
            "found {:?} record of block {} version {}, expected block {lba} version {version}",
            header.kind, header.lba, header.version
        )));
    }
    let codec = header
        .codec_id()
        .ok_or_else(|| damaged(format!("unknown codec {}", header.codec)))?;
    decompress_block(codec, payload, out).map_err(damaged)
}

/// The largest read buffer a thread keeps for its next request.
const READ_SCRATCH_KEPT_BYTES: usize = 4 << 20;

thread_local! {
    /// Where a thread reads records from the medium (up to
    /// `READ_SCRATCH_KEPT_BYTES` kept between requests).
    static READ_SCRATCH: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
    /// Where a unit is decompressed when only some of its blocks are wanted.
    static UNIT_SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Verifies the record in `bytes` and decodes its blocks `members` (all
/// wanted from this one record; `index` counts from block `first`) into
/// `out`. A block whose record is not what the map expects (wrong block,
/// version, incarnation, or checksum) is added to `failed`, never filled.
pub(crate) fn decode_into(
    key: &RecordKey,
    first: Lba,
    bytes: &[u8],
    members: &[Wanted],
    out: &mut [u8],
    failed: &mut Vec<(usize, Error)>,
) {
    let lba_of = |wanted: &Wanted| Lba(first.0 + wanted.index as u64);
    let damaged = |wanted: &Wanted, reason: String| Error::DamagedBlock {
        lba: lba_of(wanted).0,
        segment: wanted.loc.segment.0,
        offset: wanted.loc.offset,
        reason,
    };
    let header = match crate::record::RecordHeader::decode(bytes) {
        Ok(header) if header.kind == RecordKind::Unit => header,
        // One block per record: the single-block path.
        _ => {
            for wanted in members {
                let block = block_mut(out, wanted.index);
                if let Err(error) = decode_block(
                    key,
                    lba_of(wanted),
                    wanted.version,
                    wanted.shared,
                    bytes,
                    wanted.loc,
                    block,
                ) {
                    failed.push((wanted.index, error));
                }
            }
            return;
        }
    };
    let decoded = match decode_record(bytes, key, None) {
        Ok((_, payload)) => decode_unit(&header, payload),
        Err(crate::record::RecordError::Checksum { expected, actual }) => {
            for wanted in members {
                failed.push((
                    wanted.index,
                    Error::ChecksumMismatch {
                        lba: lba_of(wanted).0,
                        segment: wanted.loc.segment.0,
                        offset: wanted.loc.offset,
                        expected,
                        actual,
                    },
                ));
            }
            return;
        }
        Err(e) => Err(e.to_string()),
    };
    let unit = match decoded {
        Ok(unit) => unit,
        Err(reason) => {
            failed.extend(
                members
                    .iter()
                    .map(|w| (w.index, damaged(w, reason.clone()))),
            );
            return;
        }
    };
    let count = unit.count();
    let mut good: Vec<&Wanted> = Vec::with_capacity(members.len());
    for wanted in members {
        let member = wanted.loc.member as usize;
        let expected = (wanted.shared
            || lba_of(wanted)
                .0
                .checked_sub(member as u64)
                .is_some_and(|first| names_block(header.lba, first)))
            && wanted.loc.members as usize == count
            && unit.versions.get(member) == Some(&wanted.version);
        if expected {
            good.push(wanted);
        } else {
            failed.push((
                wanted.index,
                damaged(
                    wanted,
                    format!(
                        "found a unit of {count} blocks from block {} (versions {:?}), \
                         expected block {} version {} as its member {member}",
                        header.lba,
                        unit.versions,
                        lba_of(wanted),
                        wanted.version
                    ),
                ),
            ));
        }
    }
    if good.is_empty() {
        return;
    }
    let Some(codec) = header.codec_id() else {
        let reason = format!("unknown codec {}", header.codec);
        failed.extend(good.iter().map(|w| (w.index, damaged(w, reason.clone()))));
        return;
    };
    // All of the unit, in order, where it goes: decompress in place.
    let in_place = good.len() == count
        && good
            .iter()
            .enumerate()
            .all(|(i, w)| w.loc.member as usize == i && w.index == good[0].index + i);
    let result = if in_place {
        let at = good[0].index * BLOCK_SIZE;
        decompress_exact(codec, unit.data, &mut out[at..at + count * BLOCK_SIZE])
    } else {
        // Only as far as the last block wanted.
        let want = (good
            .iter()
            .map(|w| w.loc.member as usize)
            .max()
            .unwrap_or(0)
            + 1)
            * BLOCK_SIZE;
        UNIT_SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            scratch.resize(count * BLOCK_SIZE, 0);
            decompress_prefix(codec, unit.data, &mut scratch, want)?;
            for wanted in &good {
                let member = wanted.loc.member as usize;
                block_mut(out, wanted.index)
                    .copy_from_slice(&scratch[member * BLOCK_SIZE..(member + 1) * BLOCK_SIZE]);
            }
            Ok(())
        })
    };
    if let Err(reason) = result {
        failed.extend(good.iter().map(|w| (w.index, damaged(w, reason.clone()))));
    }
}

#[cfg(test)]
mod tests {
    //! The mapped read path: a segment found reused after decoding fails
    //! its blocks, and the read then fetches them again, correctly.

    use std::sync::Arc;

    use super::*;
    use crate::device::BlockDevice;
    use crate::media::{FileMedia, Media};
    use crate::{CreateOptions, OpenOptions};

    #[test]
    fn blocks_of_a_segment_reused_during_a_mapped_read_are_fetched_again() {
        let path = std::env::temp_dir().join(format!("zdisk-mapped-{}", std::process::id()));
        let media = FileMedia::create(&path, Some(64 << 20), 1 << 20, true).unwrap();
        let options = OpenOptions {
            background: false,
            ..OpenOptions::default()
        };
        let volume = Volume::create(
            Arc::new(media) as Arc<dyn Media>,
            CreateOptions::new(16 << 20),
            options,
        )
        .unwrap();
        let data: Vec<u8> = (0..64 * BLOCK_SIZE)
            .map(|i| (i / 700 + i % 7) as u8)
            .collect();
        volume.write(0, &data, false).unwrap();
        volume.flush().unwrap();

        let mut out = vec![0u8; data.len()];
        let lookup = volume.look_up(Lba(0), &mut out).unwrap();
        // A flush leaves the last partial sector in the stream's buffer.
        let mut from_medium: Vec<usize> = lookup.wanted.iter().map(|w| w.index).collect();
        from_medium.sort_unstable();
        assert!(from_medium.len() >= 60, "{from_medium:?}");
        assert!(!lookup.incarnations.is_empty());
        let mut failed = Vec::new();
        for (buffered, members) in lookup.buffered {
            let bytes = buffered.complete(&*volume.media).unwrap();
            decode_into(
                &volume.record_key,
                Lba(0),
                &bytes,
                &members,
                &mut out,
                &mut failed,
            );
        }
        assert!(failed.is_empty(), "{failed:?}");
        let records = by_record(lookup.wanted);
        let runs = coalesce(&records);
        let failed = volume
            .read_mapped(Lba(0), &records, &runs, &lookup.incarnations, &mut out)
            .expect("a regular file is mapped");
        assert!(failed.is_empty(), "{failed:?}");
        assert!(out == data, "decoded from the mapping");

        // As if every segment read had been readied again meanwhile.
        let stale: Vec<(SegmentId, u64)> = lookup
            .incarnations
            .iter()
            .map(|&(segment, seq)| (segment, seq + 1))
            .collect();
        for &index in &from_medium {
            block_mut(&mut out, index).fill(0xEE);
        }
        let failed = volume
            .read_mapped(Lba(0), &records, &runs, &stale, &mut out)
            .unwrap();
        let mut indices: Vec<usize> = failed.iter().map(|(index, _)| *index).collect();
        indices.sort_unstable();
        assert_eq!(
            indices, from_medium,
            "each block read from the medium failed once"
        );
        assert!(
            failed[0].1.to_string().contains("reused"),
            "{}",
            failed[0].1
        );
        for (index, error) in failed {
            volume
                .reread_block(Lba(index as u64), block_mut(&mut out, index), error)
                .unwrap();
        }
        assert!(out == data, "fetched again");
        drop(volume);
        std::fs::remove_file(&path).unwrap();
    }
}
