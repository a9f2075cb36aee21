//! The engine's mutable state and the log writer streams.
//!
//! Everything here runs under the volume's state mutex. Two streams append
//! records: the host stream (new writes, trims, zeroes) and the GC stream
//! (relocated records), each into its own open segment, so that data the
//! cleaner has already proven cold does not mix with fresh writes.
//!
//! A stream buffers the tail of its segment in RAM. Whole pages go to the
//! medium in batches; a barrier pads the last partial page with zeros and
//! writes it too, so the medium only ever sees whole pages written in order
//! (see `media/mod.rs`). Padding is counted, as a real SSD's would be.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::map::{Location, Map};
use crate::media::{Media, MediaGeometry};
use crate::meta::{DumpRef, OpenSegmentPos};

use crate::record::{encode_record, RecordHeader, RecordKey, RAW_RECORD_LEN};
use crate::segments::{SegmentState, SegmentTable};
use crate::stats::Counters;
use crate::units::{PageIndex, SegmentId};

/// Which writer a record goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    Host = 0,
    Gc = 1,
}

/// How far ahead of use a root reserves sequence numbers and versions by
/// default; reservations are renewed once a quarter of that is left.
pub const SEQ_RESERVE_AHEAD: u64 = 1 << 16;
pub const VERSION_RESERVE_AHEAD: u64 = 1 << 26;

/// Segments kept back for the cleaner, beyond those a checkpoint needs.
pub const GC_RESERVE_SEGMENTS: u64 = 2;

/// What a root in a metadata slot needs kept for recovery to start from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetainedRoot {
    pub generation: u64,
    /// Segments with a sequence number at least this are replayed.
    pub boundary: u64,
    /// Segments open at its snapshot, replayed from the recorded offset.
    pub open: Vec<OpenSegmentPos>,
    pub dump: Option<DumpRef>,
}

/// Numbers and segments a root reserves for the run that writes it.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub seq: u64,
    pub version: u64,
    pub segments: Vec<SegmentId>,
}

/// An open segment being filled.
#[derive(Debug, Default)]
pub struct Stream {
    pub segment: Option<SegmentId>,
    pub seq: u64,
    /// Segment offset of `buf[0]`; always a page multiple.
    pub base_offset: u64,
    /// Bytes appended but not yet written to the medium.
    pub buf: Vec<u8>,
}

impl Stream {
    pub fn write_offset(&self) -> u64 {
        self.base_offset + self.buf.len() as u64
    }
}

pub struct State {
    pub media: Arc<dyn Media>,
    pub geometry: MediaGeometry,
    /// Mixed into every record checksum (see `RecordKey`).
    pub key: RecordKey,
    pub write_batch_bytes: usize,
    pub map: Map,
    pub segments: SegmentTable,
    pub streams: [Stream; 2],
    pub next_version: u64,
    pub next_seq: u64,
    /// Sequence numbers and versions below these are covered by the
    /// reservation in a durable root (see `CheckpointRoot::seq_reserved`).
    pub seq_limit: u64,
    pub version_limit: u64,
    pub seq_reserve_ahead: u64,
    pub version_reserve_ahead: u64,
    pub segment_reserve_ahead: u64,
    /// Barriers issued; a barrier writes every buffered byte to the medium.
    pub barrier_gen: u64,
    /// Highest barrier generation known to be durable.
    pub synced_gen: u64,
    pub counters: Counters,
    /// Generation of the newest root written.
    pub generation: u64,
    /// The roots in the two metadata slots (by slot). Recovery may start
    /// from either: the newest, or the older one if the newest is damaged.
    pub roots: [Option<RetainedRoot>; 2],
    /// Log bytes appended since the last checkpoint.
    pub log_bytes_since_checkpoint: u64,
    /// Of those, bytes of trim, zero and damaged records, which the
    /// cleaner must keep until a checkpoint.
    pub range_bytes_since_checkpoint: u64,
    /// Set after a failed medium write: the log may have a hole, so no more writes.
    pub failed: Option<String>,
    /// Set when `close` starts: no new host writes, so that none can land
    /// after the clean checkpoint's snapshot.
    pub closing: bool,
}

impl State {
    pub fn segment_size(&self) -> u64 {
        self.geometry.segment_size_bytes
    }

    fn page_size(&self) -> u64 {
        self.geometry.page_size_bytes as u64
    }

    pub fn check_writable(&self) -> Result<()> {
        match &self.failed {
            None => Ok(()),
            Some(why) => Err(Error::io(
                "writing",
                std::io::Error::other(format!(
                    "the volume stopped writing after a medium error: {why}"
                )),
            )),
        }
    }

    fn fail<T>(&mut self, error: Error) -> Result<T> {
        if self.failed.is_none() {
            self.failed = Some(error.to_string());
        }
        Err(error)
    }

    /// Segments the next checkpoint's two dump copies need.
    pub fn dump_reserve_segments(&self) -> u64 {
        self.dump_reserve_segments_for(0)
    }

    /// Segments the next checkpoint's dump needs once `extra_blocks` more
    /// blocks may have been mapped (a write grows the map as it goes).
    pub fn dump_reserve_segments_for(&self, extra_blocks: u64) -> u64 {
        let extra_chunks = extra_blocks.div_ceil(crate::map::CHUNK_BLOCKS) + 1;
        crate::dump::dump_segments_for(
            self.map.chunk_count() as u64 + extra_chunks,
            self.segments.len() as u64,
            self.segment_size(),
        )
    }

    /// Free segments the cleaner keeps: the checkpoint's reserve less one.
    /// Cleaning borrows at most that one (see [`State::gc_has_room`]), and
    /// returns it once its victim is released, so a checkpoint is delayed
    /// at worst, never prevented.
    pub fn gc_floor_segments(&self) -> u64 {
        self.dump_reserve_segments().saturating_sub(1)
    }

    /// True if the cleaner may take `needed` free segments to relocate a
    /// victim. It keeps its floor for the next checkpoint, but it may
    /// always take one segment, since releasing the victim gives one back:
    /// a cleaning that takes no more than it returns can run at any fill.
    /// Without that, a checkpoint that leaves fewer free segments than the
    /// floor (the first one, with no older dump to release) would wedge a
    /// full volume for good.
    pub fn gc_has_room(&self, needed: u64) -> bool {
        let free = self.segments.free_count();
        needed == 0 || free >= needed + self.gc_floor_segments() || (needed == 1 && free >= 1)
    }

    /// Segments that host writes may not take: the cleaner's reserve plus
    /// room for the next checkpoint. The cleaner may use its reserve but
    /// not the checkpoint's; only trims, zeroes and dumps may use everything.
    pub fn reserved_segments(&self) -> u64 {
        self.reserved_segments_for(0)
    }

    /// [`State::reserved_segments`] after a write of `extra_blocks` blocks.
    pub fn reserved_segments_for(&self, extra_blocks: u64) -> u64 {
        GC_RESERVE_SEGMENTS + self.dump_reserve_segments_for(extra_blocks)
    }

    /// Bytes left in a stream's open segment.
    pub fn stream_room(&self, kind: StreamKind) -> u64 {
        let stream = &self.streams[kind as usize];
        match stream.segment {
            Some(_) => self.segment_size() - stream.write_offset(),
            None => 0,
        }
    }

    /// Segments a host append of `bytes` would need beyond the open one.
    pub fn segments_needed(&self, kind: StreamKind, bytes: u64) -> u64 {
        let room = self.stream_room(kind).saturating_sub(RAW_RECORD_LEN);
        if bytes <= room {
            return 0;
        }
        (bytes - room).div_ceil(self.segment_size() - RAW_RECORD_LEN)
    }

    /// True if the host stream can take `bytes` more while keeping `floor`
    /// segments free.
    pub fn host_has_room(&self, bytes: u64, floor: u64) -> bool {
        let needed = self.segments_needed(StreamKind::Host, bytes);
        needed == 0
            || (self.segments.free_count() >= floor + needed
                && self.segments.reserved_count() >= needed)
    }

    /// Appends one record to a stream and returns where it landed, keeping
    /// `floor` segments free if a new segment must be opened.
    /// `header.seg_seq` and `header.crc` are filled in here.
    pub fn append(
        &mut self,
        kind: StreamKind,
        mut header: RecordHeader,
        payload: &[u8],
        payload_crc: u32,
        floor: u64,
    ) -> Result<Location> {
        self.check_writable()?;
        let len = header.record_len();
        debug_assert!(len <= self.segment_size());
        if self.stream_room(kind) < len {
            self.open_segment(kind, floor)?;
        }
        let segment_size = self.segment_size();
        let stream = &mut self.streams[kind as usize];
        let segment = stream.segment.expect("stream has an open segment");
        let offset = stream.write_offset();
        assert!(
            offset + len <= segment_size,
            "record overruns segment {segment}"
        );
        header.seg_seq = stream.seq as u32;
        let start = stream.buf.len();
        stream.buf.resize(start + len as usize, 0);
        encode_record(
            &mut stream.buf[start..],
            header,
            payload,
            payload_crc,
            &self.key,
        );
        let info = self.segments.get_mut(segment);
        info.max_version = info.max_version.max(header.version);
        info.fill_bytes = offset + len;
        if header.kind.is_range() {
            info.holds_ranges = true;
            info.range_bytes += len;
            self.range_bytes_since_checkpoint += len;
        }
        if header.kind == crate::record::RecordKind::Data {
            self.segments.add_member(segment, header.lba);
        }
        self.log_bytes_since_checkpoint += len;
        if self.streams[kind as usize].buf.len() >= self.write_batch_bytes {
            self.write_whole_pages(kind)?;
        }
        Ok(Location {
            segment,
            offset: offset as u32,
            len: len as u32,
        })
    }

    /// Writes the complete pages buffered in a stream, keeping the partial tail.
    fn write_whole_pages(&mut self, kind: StreamKind) -> Result<()> {
        let page = self.page_size() as usize;
        let stream = &mut self.streams[kind as usize];
        let whole = stream.buf.len() / page * page;
        if whole == 0 {
            return Ok(());
        }
        let segment = stream.segment.expect("stream has an open segment");
        let first_page = PageIndex((stream.base_offset / page as u64) as u32);
        let result = self
            .media
            .write_pages(segment, first_page, &stream.buf[..whole]);
        if let Err(error) = result {
            return self.fail(error);
        }
        stream.buf.drain(..whole);
        stream.base_offset += whole as u64;
        self.counters.media_write_bytes += whole as u64;
        Ok(())
    }

    /// Writes everything buffered in a stream, padding the last page (a
    /// flush's padding).
    pub fn pad_and_write(&mut self, kind: StreamKind) -> Result<()> {
        self.pad_and_write_as(kind, false)
    }

    /// `segment_end`: the padding completes a segment's last page because
    /// the next record does not fit; it is counted apart from flush padding.
    fn pad_and_write_as(&mut self, kind: StreamKind, segment_end: bool) -> Result<()> {
        let page = self.page_size() as usize;
        let stream = &mut self.streams[kind as usize];
        if stream.buf.is_empty() {
            return Ok(());
        }
        let padded = stream.buf.len().div_ceil(page) * page;
        let padding = (padded - stream.buf.len()) as u64;
        stream.buf.resize(padded, 0);
        if segment_end {
            self.counters.segment_tail_bytes += padding;
        } else {
            self.counters.padding_bytes += padding;
        }
        self.write_whole_pages(kind)?;
        let stream = &self.streams[kind as usize];
        let segment = stream.segment.expect("stream has an open segment");
        self.segments.get_mut(segment).fill_bytes = stream.base_offset;
        if stream.base_offset >= self.segment_size() {
            self.seal(kind)?;
        }
        Ok(())
    }

    /// Closes a stream's segment: writes its tail and marks it sealed.
    pub fn seal(&mut self, kind: StreamKind) -> Result<()> {
        if self.streams[kind as usize].segment.is_none() {
            return Ok(());
        }
        if !self.streams[kind as usize].buf.is_empty() {
            self.pad_and_write_as(kind, true)?;
            if self.streams[kind as usize].segment.is_none() {
                return Ok(()); // pad_and_write sealed a full segment
            }
        }
        let stream = &mut self.streams[kind as usize];
        let segment = stream.segment.take().expect("checked above");
        let info = self.segments.get_mut(segment);
        info.fill_bytes = stream.base_offset;
        info.state = SegmentState::Sealed;
        *stream = Stream::default();
        Ok(())
    }

    /// Seals a stream's segment and opens a fresh one, keeping `floor`
    /// segments free.
    pub fn open_segment(&mut self, kind: StreamKind, floor: u64) -> Result<()> {
        self.seal(kind)?;
        if self.segments.free_count() <= floor {
            return Err(Error::NoSpace {
                free_segments: self.segments.free_count(),
                reserved_segments: floor,
            });
        }
        let segment = self.allocate_segment()?;
        let stream = &mut self.streams[kind as usize];
        stream.segment = Some(segment);
        stream.seq = self.segments.get(segment).seq;
        stream.base_offset = 0;
        stream.buf.clear();
        Ok(())
    }

    /// Takes a free segment, gives it a new incarnation and has the medium
    /// ready it for writing from page 0 (flash erases it; a file does not).
    pub fn allocate_segment(&mut self) -> Result<SegmentId> {
        let seq = self.next_seq;
        assert!(
            seq < self.seq_limit,
            "sequence reservation {} exhausted",
            self.seq_limit
        );
        let segment = self.segments.allocate(seq).ok_or(Error::NoSpace {
            free_segments: self.segments.free_count(),
            reserved_segments: 0,
        })?;
        self.next_seq += 1;
        if let Err(error) = self.media.prepare_segment(segment) {
            return self.fail(error);
        }
        Ok(segment)
    }

    /// Writes every buffered byte of both streams (padding partial pages)
    /// and returns the barrier generation that a sync must reach to make
    /// all of it durable.
    pub fn barrier(&mut self) -> Result<u64> {
        self.check_writable()?;
        for kind in [StreamKind::Host, StreamKind::Gc] {
            if self.media.has_power_loss_protection() {
                self.stage_tail(kind)?;
            } else {
                self.pad_and_write(kind)?;
            }
        }
        self.barrier_gen += 1;
        Ok(self.barrier_gen)
    }

    /// With power-loss protection: writes a stream's whole pages and hands
    /// the partial last page to the medium's non-volatile buffer, instead
    /// of padding and programming it. The page is programmed later, whole.
    fn stage_tail(&mut self, kind: StreamKind) -> Result<()> {
        self.write_whole_pages(kind)?;
        let page = self.page_size();
        let stream = &self.streams[kind as usize];
        let (Some(segment), false) = (stream.segment, stream.buf.is_empty()) else {
            return Ok(());
        };
        debug_assert!((stream.buf.len() as u64) < page);
        let first_page = PageIndex((stream.base_offset / page) as u32);
        let result = self
            .media
            .stage_partial_page(segment, first_page, &stream.buf);
        if let Err(error) = result {
            return self.fail(error);
        }
        Ok(())
    }

    /// The bytes of a record that is still (partly) in a stream buffer.
    pub fn read_buffered(&self, loc: Location) -> Result<Option<Vec<u8>>> {
        for stream in &self.streams {
            if stream.segment != Some(loc.segment) {
                continue;
            }
            let start = loc.offset as u64;
            let end = start + loc.len as u64;
            if end <= stream.base_offset {
                return Ok(None);
            }
            let mut bytes = vec![0u8; loc.len as usize];
            let split = stream.base_offset.max(start);
            if start < split {
                self.media
                    .read(loc.segment, start, &mut bytes[..(split - start) as usize])?;
            }
            let from = (split - stream.base_offset) as usize;
            let to = (end - stream.base_offset) as usize;
            if to > stream.buf.len() {
                return Err(Error::CorruptImage(format!(
                    "record at segment {} offset {} lies beyond the write pointer",
                    loc.segment, loc.offset
                )));
            }
            bytes[(split - start) as usize..].copy_from_slice(&stream.buf[from..to]);
            return Ok(Some(bytes));
        }
        Ok(None)
    }

    /// The root with the highest generation.
    pub fn newest_root(&self) -> &RetainedRoot {
        self.roots
            .iter()
            .flatten()
            .max_by_key(|root| root.generation)
            .expect("a volume always has a root")
    }

    /// True if a recovery from either retained root could replay records
    /// of `segment` (so trims in it must survive cleaning).
    pub fn needed_by_recovery(&self, segment: SegmentId) -> bool {
        let info = self.segments.get(segment);
        self.roots.iter().flatten().any(|root| {
            info.seq >= root.boundary
                || root
                    .open
                    .iter()
                    .any(|open| open.segment == segment && open.seq == info.seq)
        })
    }

    /// Records that `root` is now durable in its slot, replacing the root
    /// written there two generations ago, and frees the dump segments no
    /// remaining root refers to.
    pub fn install_root(&mut self, root: RetainedRoot) {
        let slot = (root.generation % 2) as usize;
        let replaced = self.roots[slot].replace(root);
        let Some(replaced) = replaced else { return };
        let Some(old_dump) = replaced.dump else {
            return;
        };
        let still_used = self.roots.iter().flatten().any(|root| {
            root.dump
                .as_ref()
                .is_some_and(|d| d.generation == old_dump.generation)
        });
        if !still_used {
            for segment in old_dump.segments() {
                self.segments.release(segment);
            }
        }
    }

    /// Positions of the open streams, for a checkpoint root.
    pub fn open_positions(&self) -> Vec<OpenSegmentPos> {
        self.streams
            .iter()
            .filter_map(|stream| {
                stream.segment.map(|segment| OpenSegmentPos {
                    segment,
                    seq: stream.seq,
                    offset_bytes: stream.write_offset(),
                })
            })
            .collect()
    }

    /// Records that a map entry moved away from `loc` (overwritten, trimmed or relocated).
    pub fn release_location(&mut self, loc: Location) {
        self.segments.sub_live(loc.segment, loc.len as u64);
        // The record that replaced this one is in a stream buffer; the next
        // barrier writes it out.
        let info = self.segments.get_mut(loc.segment);
        info.killed_gen = info.killed_gen.max(self.barrier_gen + 1);
    }

    pub fn take_version(&mut self) -> u64 {
        let version = self.next_version;
        // Admission (`numbering_room`) checked this before the caller
        // started; running out here is a bug, not an operating error.
        assert!(
            version < self.version_limit,
            "version reservation {} exhausted",
            self.version_limit
        );
        self.next_version += 1;
        version
    }

    /// True if `segments` more segments and `versions` more versions can
    /// be numbered under the current reservation.
    pub fn numbering_room(&self, segments: u64, versions: u64) -> bool {
        self.next_seq + segments <= self.seq_limit
            && self.next_version + versions <= self.version_limit
    }

    /// True when a root should be written to renew the reservations.
    pub fn reservation_low(&self) -> bool {
        let segments_low = self.segments.reserved_count() < self.segment_reserve_ahead / 2
            && self.segments.free_count() > self.segments.reserved_count();
        segments_low
            || self.next_seq + self.seq_reserve_ahead / 4 > self.seq_limit
            || self.next_version + self.version_reserve_ahead / 4 > self.version_limit
    }

    /// True when a root must be written before `segments` segments and
    /// `versions` versions can be used (or the reservations are low).
    pub fn reservation_short(&self, segments: u64, versions: u64) -> bool {
        self.reservation_low()
            || self.segments.reserved_count() < segments
            || !self.numbering_room(segments, versions)
    }

    /// The reservations a root written now should carry, with at least
    /// `min_segments` segments.
    /// `min_segments` segments (and twice that many sequence numbers) and
    /// twice `min_versions` versions.
    pub fn reservations_for_root(&self, min_segments: u64, min_versions: u64) -> Reservation {
        let segments = self.segment_reserve_ahead.max(min_segments) as usize;
        let seq_ahead = self.seq_reserve_ahead.max(2 * min_segments);
        let version_ahead = self.version_reserve_ahead.max(2 * min_versions);
        let version_end = crate::map::VERSION_MAX + 1;
        Reservation {
            seq: (self.next_seq + seq_ahead).max(self.seq_limit),
            version: (self.next_version + version_ahead)
                .min(version_end)
                .max(self.version_limit),
            segments: self.segments.propose_reservation(segments),
        }
    }

    /// Makes a reservation usable once the root carrying it is durable.
    pub fn commit_reservation(&mut self, reservation: &Reservation) {
        self.seq_limit = self.seq_limit.max(reservation.seq);
        self.version_limit = self.version_limit.max(reservation.version);
        self.segments.commit_reservation(&reservation.segments);
    }

    /// Frees reclaimable segments once `synced_gen` covers their barrier.
    pub fn note_synced(&mut self, gen: u64) {
        if gen > self.synced_gen {
            self.synced_gen = gen;
        }
        self.segments.release_reclaimable(self.synced_gen);
    }

    /// Segments waiting only for a barrier to become free.
    pub fn reclaimable_count(&self) -> u64 {
        self.segments.reclaimable_count()
    }
}
