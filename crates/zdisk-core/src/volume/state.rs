//! The engine's mutable state, and the only code that changes it.
//!
//! Everything here runs under the volume's state mutex. [`State`]'s fields
//! are private: the map, the segments' live bytes ([`Space`]) and the
//! counters change together, in a few mutation methods that keep them
//! consistent and assert it:
//!
//! - [`State::apply_write`]: append a host data record and repoint its
//!   block, killing the old location;
//! - [`State::apply_range`]: a trim, zero or damaged range;
//! - [`State::relocate`] and [`State::relocate_range`]: the cleaner's
//!   unchanged copies;
//! - [`State::mark_damaged`]: a live record that failed verification.
//!
//! Two streams append records: the host stream (new writes, trims, zeroes)
//! and the GC stream (relocated records), each into its own open segment,
//! so that data the cleaner has already proven cold does not mix with
//! fresh writes. A stream buffers the tail of its segment in RAM. Whole
//! pages go to the medium in batches. A barrier makes the partial last page
//! durable one of three ways (see `media/mod.rs`): on flash it pads the
//! page with zeros and writes it, so the medium only ever sees whole pages
//! written in order, and the padding is counted, as a real SSD's would be;
//! with power-loss protection it hands the page to the drive; on a medium
//! with staging (a file, a block device) it writes the complete sectors in
//! place and stages the partial one (`staging.rs`).

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::map::{
    kept_apart, Fault, FaultPin, Location, Map, PageLoc, PageStore, RangeState, ReadLeaf, Slot,
    SnapshotPage,
};
use crate::media::{Media, MediaGeometry, SECTOR_BYTES};
use crate::meta::{OpenSegmentPos, RetainedRoot};
use crate::record::{
    append_record, record_len_for_payload, RecordHeader, RecordKey, RecordKind, RANGE_PAYLOAD_LEN,
};
use crate::segments::SegmentState;
use crate::stats::Counters;
use crate::units::{Lba, PageIndex, SegmentId};

use super::outbound::{Outbound, PageWrite, WriteKind};
use super::space::{Climbed, Need, Outlook, Reach, Reservation, Rung, Space, Writer};
use super::staging::{Staged, StagingSlots};
use super::tallies::Tallies;
pub(crate) use super::tallies::Tally;

mod shares;
mod snapshots;
pub(crate) use shares::{Dedup, SharedCounts};
pub(crate) use snapshots::{host_key, keeps, keeps_in, View};

/// Which writer a record goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamKind {
    Host = 0,
    Gc = 1,
}

/// An open segment being filled.
#[derive(Debug, Default)]
pub(crate) struct Stream {
    pub segment: Option<SegmentId>,
    pub seq: u64,
    /// Segment offset of `buf[0]`: a page multiple, or on a medium with
    /// staging a sector multiple once a barrier wrote a partial page's
    /// complete sectors.
    pub base_offset: u64,
    /// Bytes appended but not yet written to the medium.
    pub buf: Vec<u8>,
}

impl Stream {
    pub fn write_offset(&self) -> u64 {
        self.base_offset + self.buf.len() as u64
    }
}

/// A record copied from RAM under the lock, its first `on_medium` bytes
/// (already on the medium, so not in RAM) still to read.
#[derive(Debug)]
pub(crate) struct Buffered {
    loc: Location,
    bytes: Vec<u8>,
    on_medium: usize,
}

impl Buffered {
    /// The whole record: reads the part on the medium (outside the lock;
    /// it stays there for as long as the segment's incarnation lives, and
    /// the caller verifies the record anyway).
    pub(crate) fn complete(mut self, media: &dyn Media) -> Result<Vec<u8>> {
        if self.on_medium > 0 {
            let loc = self.loc;
            media.read(
                loc.segment,
                loc.offset as u64,
                &mut self.bytes[..self.on_medium],
            )?;
        }
        Ok(self.bytes)
    }

    pub(crate) fn loc(&self) -> Location {
        self.loc
    }

    /// The record's bytes, if all of them were in RAM.
    pub(crate) fn in_ram(&self) -> Option<&[u8]> {
        (self.on_medium == 0).then_some(&self.bytes[..])
    }
}

/// The mutable half of a volume. See the module documentation.
pub(crate) struct State {
    media: Arc<dyn Media>,
    geometry: MediaGeometry,
    /// Mixed into every record checksum (see `RecordKey`).
    key: RecordKey,
    logical_blocks: u64,
    write_batch_bytes: usize,
    map: Map,
    /// References to each shared content (`shares.rs`).
    shared: SharedCounts,
    /// The volume's snapshots (`snapshots.rs`).
    snapshots: crate::snapshots::Snapshots,
    space: Space,
    streams: [Stream; 2],
    /// Whole pages appended and not yet on the medium (see `outbound.rs`).
    outbound: Outbound,
    /// Which staging slot each stream's next barrier writes.
    staging: StagingSlots,
    counters: Counters,
    /// The host I/O counters, kept outside the lock (added to `counters`).
    tallies: Arc<Tallies>,
    /// Generation of the newest root written.
    generation: u64,
    /// The roots in the two metadata slots (by slot). Recovery may start
    /// from either: the newest, or the older one if the newest is damaged.
    roots: [Option<RetainedRoot>; 2],
    /// Set after a failed medium write: the log may have a hole, so no more writes.
    failed: Option<String>,
    /// Set when `close` starts: no new host writes, so that none can land
    /// after the clean checkpoint's snapshot, and barriers pad instead of
    /// staging, since recovery reads no staging slot after a clean root.
    closing: bool,
    /// While the cleaner relocates a victim a retained root would replay:
    /// its incarnation. The GC stream then appends only to a segment
    /// opened after it (`State::copies_follow`); 0 otherwise.
    copies_after_seq: u64,
}

/// What a State starts from: recovery's findings.
pub(crate) struct Start {
    pub map: Map,
    pub shared: SharedCounts,
    pub snapshots: crate::snapshots::Snapshots,
    pub space: Space,
    pub counters: Counters,
    pub generation: u64,
    pub roots: [Option<RetainedRoot>; 2],
}

impl State {
    pub(crate) fn new(
        media: Arc<dyn Media>,
        key: RecordKey,
        logical_blocks: u64,
        write_batch_bytes: usize,
        start: Start,
    ) -> State {
        let geometry = media.geometry();
        assert!(
            start.roots.iter().any(Option::is_some),
            "a volume has a root"
        );
        State {
            media,
            geometry,
            key,
            logical_blocks,
            write_batch_bytes: write_batch_bytes.max(geometry.page_size_bytes as usize),
            map: start.map,
            shared: start.shared,
            snapshots: start.snapshots,
            space: start.space,
            streams: [Stream::default(), Stream::default()],
            outbound: Outbound::default(),
            staging: StagingSlots::default(),
            counters: start.counters,
            tallies: Arc::default(),
            generation: start.generation,
            roots: start.roots,
            failed: None,
            closing: false,
            copies_after_seq: 0,
        }
    }

    // --- Reading.

    pub(crate) fn map(&self) -> &Map {
        &self.map
    }

    pub(crate) fn logical_blocks(&self) -> u64 {
        self.logical_blocks
    }

    /// Reads back the paged-out leaves of blocks `first..first+count`, so
    /// that `map()` may look them up (until the lock is released).
    pub(crate) fn load_map(&mut self, first: Lba, count: u64) -> Result<()> {
        self.map.load(&*self.media, first, count)
    }

    /// Evicts clean map leaves beyond the cache (as the lock is released).
    pub(crate) fn evict_map_leaves(&mut self) {
        if self.map.over_cache() {
            self.map.evict();
        }
    }

    /// A checkpoint's snapshot of the map, as pages. A clean leaf keeps
    /// its page unless it lies in a dump segment holding less than
    /// `keep_from_bytes` of pages the map still needs, or beyond the
    /// fullest segments that together may stay: at most one segment per
    /// half a segment of needed pages (and one). Those pages move, so the
    /// dump segments kept never outnumber twice what the needed pages
    /// would fill, whatever `keep_from_bytes` is.
    pub(crate) fn snapshot_map(&mut self, keep_from_bytes: u64) -> Vec<SnapshotPage> {
        let needed = self.map.page_bytes_by_segment();
        let segment_size = self.space.segment_size_bytes();
        let total: u64 = needed.values().sum();
        let most = (2 * total).div_ceil(segment_size).max(1) as usize;
        let mut fullest: Vec<(u64, SegmentId)> = needed
            .iter()
            .filter(|&(_, &bytes)| bytes >= keep_from_bytes)
            .map(|(&segment, &bytes)| (bytes, segment))
            .collect();
        fullest.sort_unstable_by(|a, b| b.cmp(a));
        fullest.truncate(most);
        let kept: std::collections::HashSet<SegmentId> =
            fullest.into_iter().map(|(_, segment)| segment).collect();
        self.map
            .snapshot_pages(|loc: &PageLoc| !kept.contains(&loc.segments[0]))
    }

    /// The checkpoint that placed its pages at `placed`, and kept `kept`
    /// others in place, is durable.
    pub(crate) fn commit_map_pages(
        &mut self,
        placed: &[(u64, PageLoc)],
        kept: u64,
        store: PageStore,
    ) {
        self.map.commit_pages(placed, kept, store);
    }

    pub(crate) fn set_map_cache_bytes(&mut self, bytes: u64) {
        self.map.set_cache_bytes(bytes);
    }

    pub(crate) fn space(&self) -> &Space {
        &self.space
    }

    pub(crate) fn counters(&self) -> Counters {
        self.tallies.added_to(self.counters)
    }

    /// The host I/O counters the volume bumps without the lock.
    pub(crate) fn tallies(&self) -> &Arc<Tallies> {
        &self.tallies
    }

    pub(crate) fn streams(&self) -> &[Stream; 2] {
        &self.streams
    }

    pub(crate) fn roots(&self) -> &[Option<RetainedRoot>; 2] {
        &self.roots
    }

    /// Generation of the newest root written.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.closing
    }

    pub(crate) fn segment_size_bytes(&self) -> u64 {
        self.geometry.segment_size_bytes
    }

    fn page_size(&self) -> u64 {
        self.geometry.page_size_bytes as u64
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
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

    /// Bytes left in a stream's open segment.
    pub(crate) fn stream_room(&self, kind: StreamKind) -> u64 {
        let stream = &self.streams[kind as usize];
        match stream.segment {
            Some(_) => self.segment_size_bytes() - stream.write_offset(),
            None => 0,
        }
    }

    /// Segments an append of `bytes` to a stream would open beyond its
    /// current one.
    pub(crate) fn segments_needed(&self, kind: StreamKind, bytes: u64) -> u64 {
        self.segments_needed_from(self.stream_room(kind), bytes)
    }

    /// [`State::segments_needed`] for the GC stream, for copies that must
    /// land in a segment opened after incarnation `after` (0: anywhere;
    /// see [`State::copies_follow`]): an older open segment's room does
    /// not count.
    pub(crate) fn gc_segments_needed(&self, bytes: u64, after: u64) -> u64 {
        let room = match self.gc_opened_before(after) {
            true => 0,
            false => self.stream_room(StreamKind::Gc),
        };
        self.segments_needed_from(room, bytes)
    }

    /// True if the GC stream's open segment was opened before incarnation
    /// `seq`.
    fn gc_opened_before(&self, seq: u64) -> bool {
        let stream = &self.streams[StreamKind::Gc as usize];
        stream.segment.is_some() && stream.seq < seq
    }

    /// Segments an append of `bytes` opens beyond `room` left in the open one.
    fn segments_needed_from(&self, room: u64, bytes: u64) -> u64 {
        // Each segment may waste up to one record at its end.
        let longest = self.space.max_record_len();
        let room = room.saturating_sub(longest);
        if bytes <= room {
            return 0;
        }
        (bytes - room).div_ceil(self.segment_size_bytes() - longest)
    }

    /// Free segments `writer` must leave untouched.
    pub(crate) fn floor(&self, writer: Writer) -> u64 {
        self.space.floor(writer, self.map.leaf_counts().0)
    }

    /// The ladder's next rung for `need` (see `Space::next_rung`).
    pub(crate) fn next_rung(
        &self,
        need: &Need,
        reach: Reach,
        climbed: &Climbed,
        checkpoint_interval_bytes: u64,
    ) -> Option<Rung> {
        let stream = match need.writer {
            Writer::Cleaner => StreamKind::Gc,
            _ => StreamKind::Host,
        };
        let background = matches!(need.writer, Writer::Background { .. });
        let outlook = Outlook {
            map_pages: self.map.leaf_counts().0,
            stream_room: self.stream_room(stream),
            checkpoint_interval_bytes,
            map_dirty_over_cache: self.map.dirty_over_cache(),
            // Only the background thread waits for a recycling engine.
            recycling_ready: !background
                || self
                    .media
                    .drive()
                    .is_none_or(|drive| drive.recycling_ready()),
        };
        self.space.next_rung(need, &outlook, reach, climbed)
    }

    /// The bytes of a record that is not (all) on the medium yet: still in
    /// a stream buffer, or in pages queued for writing. `None` if it is
    /// all on the medium. A part already on the medium is left for the
    /// caller to read after releasing the lock ([`Buffered::complete`]).
    pub(crate) fn read_buffered(&self, loc: Location) -> Result<Option<Buffered>> {
        let segment = loc.segment;
        let start = loc.offset as u64;
        let end = start + loc.len as u64;
        let stream = self.streams.iter().find(|s| s.segment == Some(segment));
        // Everything below the first queued page, or the stream's buffer,
        // is on the medium.
        let unwritten_from = self
            .outbound
            .of_segment(segment)
            .next()
            .map(|write| write.offset)
            .or(stream.map(|s| s.base_offset));
        let Some(unwritten_from) = unwritten_from else {
            return Ok(None);
        };
        if end <= unwritten_from {
            return Ok(None);
        }
        let known_end = stream.map_or_else(
            || {
                self.outbound
                    .of_segment(segment)
                    .map(PageWrite::end_offset)
                    .max()
                    .unwrap_or(0)
            },
            |s| s.write_offset(),
        );
        if end > known_end {
            return Err(Error::CorruptImage(format!(
                "record at segment {segment} offset {} lies beyond the write pointer",
                loc.offset
            )));
        }
        let mut bytes = vec![0u8; loc.len as usize];
        let on_medium = unwritten_from.saturating_sub(start) as usize;
        let mut overlay = |from: u64, data: &[u8]| {
            let lo = from.max(start);
            let hi = (from + data.len() as u64).min(end);
            if lo < hi {
                bytes[(lo - start) as usize..(hi - start) as usize]
                    .copy_from_slice(&data[(lo - from) as usize..(hi - from) as usize]);
            }
        };
        for write in self.outbound.of_segment(segment) {
            overlay(write.offset, &write.bytes);
        }
        if let Some(stream) = stream {
            overlay(stream.base_offset, &stream.buf);
        }
        Ok(Some(Buffered {
            loc,
            bytes,
            on_medium,
        }))
    }

    /// The root with the highest generation.
    pub(crate) fn newest_root(&self) -> &RetainedRoot {
        self.roots
            .iter()
            .flatten()
            .max_by_key(|root| root.generation)
            .expect("a volume always has a root")
    }

    /// True if a recovery from either retained root could replay records
    /// of `segment` (so trims in it must survive cleaning).
    pub(crate) fn needed_by_recovery(&self, segment: SegmentId) -> bool {
        let info = self.space.segment(segment);
        self.roots
            .iter()
            .flatten()
            .any(|root| root.replays(segment, info.seq))
    }

    /// Positions of the open streams, for a checkpoint root.
    pub(crate) fn open_positions(&self) -> Vec<OpenSegmentPos> {
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

    // Faulting map leaves in without the lock held (`volume/fault.rs`;
    // the race with checkpoints is in `map/fault.rs`). The faults
    // themselves come from `map().faults(..)`.

    /// Counts a map lookup that found every leaf it needed in RAM.
    pub(crate) fn note_map_hit(&mut self) {
        self.map.count_hit();
    }

    /// Pins a range being faulted in: its leaves stay in RAM and the dump
    /// `faults` read from stays on the medium until `unpin_map_faults`.
    pub(crate) fn pin_map_faults(&mut self, first: Lba, count: u64, faults: &[Fault]) -> FaultPin {
        self.map.pin_faults(first, count, faults)
    }

    /// Installs a leaf a fault read, unless the fault went stale.
    pub(crate) fn install_map_fault(&mut self, fault: &Fault, leaf: ReadLeaf) -> bool {
        self.map.install(fault, leaf)
    }

    /// Gives a pin back, releasing the dump segments whose release waited
    /// for it (as `release_dump_unless_retained` would have).
    pub(crate) fn unpin_map_faults(&mut self, pin: FaultPin) {
        let released = self.map.unpin_faults(pin);
        if !released.is_empty() {
            for segment in released {
                self.space.release(segment);
            }
            self.report_freed();
        }
    }

    // --- The mutation methods: map, live bytes and counters in step.

    /// Appends host data for block `lba` (`payload` compressed with
    /// `codec`, `payload_crc` its CRC32C) under a new version, and points
    /// the block at it; the record it replaces dies. Keeps `floor` free
    /// segments if a new one must be opened.
    pub(crate) fn apply_write(
        &mut self,
        lba: Lba,
        codec: u8,
        payload: &[u8],
        payload_crc: u32,
        floor: u64,
    ) -> Result<()> {
        debug_assert!(
            crate::map::key_block(lba.0) < self.logical_blocks && self.host_volume(lba).is_some(),
            "block {lba} beyond the volume"
        );
        self.load_map(lba, 1)?;
        let version = self.space.take_version();
        let header = RecordHeader {
            kind: RecordKind::Data,
            codec,
            seg_seq: 0,
            lba: lba.0,
            version,
            payload_len: payload.len() as u32,
            crc: 0,
        };
        let loc = self.append(StreamKind::Host, header, payload, payload_crc, floor)?;
        debug_assert_eq!(loc.len as u64, record_len_for_payload(payload.len()));
        self.repoint(lba, loc, version)?;
        Ok(())
    }

    /// Appends a trim, zero or damaged record for `count` blocks from
    /// `first` under a new version, and applies it to the map. Keeps
    /// `floor` free segments if a new one must be opened.
    pub(crate) fn apply_range(
        &mut self,
        kind: RecordKind,
        first: Lba,
        count: u64,
        floor: u64,
    ) -> Result<()> {
        // A hole in a clone reads as its snapshot: a clone's trim zeroes.
        let in_clone = self.host_volume(first).is_some_and(|volume| volume != 0);
        let kind = match kind {
            RecordKind::Trim if in_clone => RecordKind::Zero,
            kind => kind,
        };
        let state = match kind {
            RecordKind::Trim => RangeState::Hole,
            RecordKind::Zero => RangeState::Zero,
            RecordKind::Damaged => RangeState::Damaged,
            other => panic!("{other:?} is not a range record"),
        };
        assert!(count > 0, "an empty range");
        debug_assert!(
            crate::map::key_block(first.0) + count <= self.logical_blocks
                && self.host_volume(first).is_some(),
            "range {first}+{count} beyond the volume"
        );
        self.load_map(first, count)?;
        let version = self.space.take_version();
        let payload = count.to_le_bytes();
        debug_assert_eq!(payload.len() as u32, RANGE_PAYLOAD_LEN);
        self.append_metadata(StreamKind::Host, kind, first, version, &payload, floor)?;
        self.keep_range_for_snapshots(first, count)?;
        let parts = self.range_parts(first, count);
        let mut unshared = Vec::new();
        let State { map, space, .. } = self;
        for (from, blocks) in parts {
            map.set_range(
                from,
                blocks,
                state,
                version,
                false,
                &mut |slot| match slot {
                    Slot::Data(loc) => space.kill(loc.segment, loc.share()),
                    Slot::Shared { content } => unshared.push(content),
                    _ => {}
                },
            );
        }
        for content in unshared {
            self.release_shared(content)?;
        }
        debug_assert!(
            state == RangeState::Hole || self.map.get(first).slot() == state.slot(),
            "block {first} after a {kind:?} range"
        );
        Ok(())
    }

    /// Appends host data for the unit of blocks `first`.. compressed
    /// together (`payload` is the unit's prefix for consecutive versions
    /// and the compressed blocks, `payload_crc` its CRC32C), under a new
    /// version per block, and points each block at it; the records they
    /// replace die. Keeps `floor` free segments if a new one must be opened.
    pub(crate) fn apply_unit(
        &mut self,
        first: Lba,
        codec: u8,
        payload: &[u8],
        payload_crc: u32,
        floor: u64,
    ) -> Result<()> {
        let count = payload[0] as u64;
        debug_assert!(
            count >= 2 && payload[1] == crate::record::UNIT_CONSECUTIVE_VERSIONS,
            "a host unit has consecutive versions"
        );
        debug_assert!(
            crate::map::key_block(first.0) + count <= self.logical_blocks
                && self.host_volume(first).is_some(),
            "unit beyond the volume"
        );
        self.load_map(first, count)?;
        let versions: Vec<u64> = (0..count).map(|_| self.space.take_version()).collect();
        debug_assert!(versions.windows(2).all(|pair| pair[1] == pair[0] + 1));
        let header = RecordHeader {
            kind: RecordKind::Unit,
            codec,
            seg_seq: 0,
            lba: first.0,
            version: crate::record::unit_header_version(&versions),
            payload_len: payload.len() as u32,
            crc: 0,
        };
        let record = self.append(StreamKind::Host, header, payload, payload_crc, floor)?;
        for (member, &version) in versions.iter().enumerate() {
            let loc = record.with_member_of(member as u8, count as u8);
            self.repoint(Lba(first.0 + member as u64), loc, version)?;
        }
        Ok(())
    }

    /// Moves the data or unit record `header`, read back from `from` (the
    /// location of any of its blocks), to the GC stream unchanged (same
    /// payload, codec and versions), and points its blocks at the copy —
    /// only if every one of its blocks still lives there, and no snapshot
    /// keeps one. Otherwise it copies nothing and returns false: a copy
    /// appended now must not carry a block that died since (a trimmed
    /// block's record, replayed after a checkpoint that no longer knows the
    /// trim's version, would come back), nor name the volume's block for an
    /// entry a snapshot taken since the plan keeps (the caller rewrites it
    /// under the snapshot's key: `moves::apply`).
    pub(crate) fn relocate(
        &mut self,
        from: Location,
        header: RecordHeader,
        payload: &[u8],
    ) -> Result<bool> {
        let versions = record_versions(&header, payload);
        let keys = self.member_keys(header.lba, &versions)?;
        // A member a snapshot keeps is never copied unchanged (moves.rs,
        // `plan_record`): a snapshot taken since the plan may keep one.
        if keys.iter().any(|key| kept_apart(header.lba, key.0))
            || !self.all_live_at(&keys, &versions, |member| {
                from.with_member_of(member as u8, versions.len() as u8)
            })
        {
            return Ok(false);
        }
        let moved = self.append_gc(header, payload)?;
        debug_assert_ne!(moved.segment, from.segment, "relocated into its victim");
        debug_assert_eq!(moved.len, from.len, "a relocated record keeps its length");
        if crate::record::is_cold_unit(&header, payload) {
            self.space.add_cold(moved.segment, moved.len as u64);
        }
        for (member, &version) in versions.iter().enumerate() {
            let loc = moved.with_member_of(member as u8, versions.len() as u8);
            if keys[member].0 != header.lba + member as u64 {
                // A shared member: the copy's summary lists its block, and
                // must list its cell too.
                self.space.add_member(moved.segment, keys[member].0);
            }
            self.repoint(keys[member], loc, version)?;
        }
        Ok(true)
    }

    /// The keys of the entries naming the members at `versions` of a
    /// record whose header names block `lba` ([`State::member_key`]), their
    /// leaves read in.
    pub(crate) fn member_keys(&mut self, lba: u64, versions: &[u64]) -> Result<Vec<Lba>> {
        self.load_map(Lba(lba), versions.len() as u64)?;
        if lba < crate::map::TABLE_BASE {
            for &version in versions {
                self.load_map(crate::map::table_key(version), 1)?;
            }
            if !self.snapshots.is_empty() || lba >= crate::map::SPACE_BLOCKS {
                let candidates: Vec<Lba> = self.member_candidates(lba).collect();
                for key in candidates {
                    self.load_map(key, versions.len() as u64)?;
                }
            }
        }
        Ok(versions
            .iter()
            .enumerate()
            .map(|(i, &version)| self.member_key(lba + i as u64, version))
            .collect())
    }

    /// The keys of the entries of blocks `first..` at `versions`, which a
    /// rewrite planned as consecutive: each one's own, unless an entry a
    /// snapshot keeps moved to another key space since (a write kept it,
    /// a deletion handed it down). The leaves must be in RAM, as
    /// `Volume::make_resident` brings them with the range.
    pub(crate) fn rewritten_keys(&self, first: Lba, versions: &[u64]) -> Vec<Lba> {
        (0..versions.len())
            .map(|i| {
                let key = Lba(first.0 + i as u64);
                let holds = |at: Lba| {
                    let entry = self.map.get(at);
                    matches!(entry.slot(), Slot::Data(_)) && entry.version() == versions[i]
                };
                let kept = key.0 >= crate::map::SPACE_BLOCKS;
                if key.0 >= crate::map::TABLE_BASE
                    || (self.snapshots.is_empty() && !kept)
                    || holds(key)
                {
                    return key;
                }
                self.member_candidates(key.0)
                    .find(|&at| holds(at))
                    .unwrap_or(key)
            })
            .collect()
    }

    /// True if the entry at `keys[i]` names `source(i)` at `versions[i]`,
    /// for every `i`.
    pub(crate) fn all_live_at(
        &self,
        keys: &[Lba],
        versions: &[u64],
        source: impl Fn(usize) -> Location,
    ) -> bool {
        versions.iter().enumerate().all(|(i, &version)| {
            let entry = self.map.get(keys[i]);
            entry.slot() == Slot::Data(source(i)) && entry.version() == version
        })
    }

    /// The cleaner rewrote blocks `first`.. (each at its version, with the
    /// same contents, now compressed as one record: a data record for one
    /// block, a unit for several) that lived at `sources`: appends the
    /// record to the GC stream and points the blocks at it — only if every
    /// one of them still lives at its source (see [`State::relocate`]);
    /// otherwise returns false, having done nothing.
    pub(crate) fn relocate_rewritten(
        &mut self,
        first: Lba,
        codec: u8,
        data: &[u8],
        versions: &[u64],
        sources: &[Location],
        cold: bool,
    ) -> Result<bool> {
        assert_eq!(versions.len(), sources.len(), "a version per source");
        self.load_map(first, versions.len() as u64)?;
        let keys = self.rewritten_keys(first, versions);
        if !self.all_live_at(&keys, versions, |i| sources[i]) {
            return Ok(false);
        }
        let (kind, payload) = if versions.len() == 1 {
            (RecordKind::Data, data.to_vec())
        } else {
            let mut payload = crate::record::encode_unit_prefix(versions, cold);
            payload.extend_from_slice(data);
            (RecordKind::Unit, payload)
        };
        let before: u64 = sources.iter().map(|loc| loc.share()).sum();
        let header = RecordHeader {
            kind,
            codec,
            seg_seq: 0,
            lba: first.0,
            version: crate::record::unit_header_version(versions),
            payload_len: payload.len() as u32,
            crc: 0,
        };
        let moved = self.append_gc(header, &payload)?;
        for (i, &version) in versions.iter().enumerate() {
            let loc = moved.with_member_of(i as u8, versions.len() as u8);
            if keys[i].0 != first.0 + i as u64 {
                self.space.add_member(moved.segment, keys[i].0);
            }
            self.repoint(keys[i], loc, version)?;
        }
        if cold {
            self.space.add_cold(moved.segment, moved.len as u64);
            self.counters.recompressed_blocks += versions.len() as u64;
            self.counters.recompress_in_bytes += before;
            self.counters.recompress_out_bytes += moved.len as u64;
        }
        Ok(true)
    }

    /// Copies a range record recovery from the durable checkpoint still
    /// needs to the GC stream, unchanged.
    pub(crate) fn relocate_range(&mut self, header: RecordHeader, payload: &[u8]) -> Result<()> {
        assert!(
            header.kind.is_range(),
            "{:?} is not a range record",
            header.kind
        );
        self.append_gc(header, payload)?;
        Ok(())
    }

    /// Replaces a live block whose record failed verification with a
    /// `Damaged` entry, logged (in the GC stream) so that it survives
    /// restarts.
    pub(crate) fn mark_damaged(&mut self, lba: Lba) -> Result<()> {
        self.load_map(lba, 1)?;
        let version = self.space.take_version();
        let payload = 1u64.to_le_bytes();
        self.append_metadata(
            StreamKind::Gc,
            RecordKind::Damaged,
            lba,
            version,
            &payload,
            0,
        )?;
        if lba.0 < crate::map::TABLE_BASE && self.host_volume(lba).is_none() {
            // An entry a snapshot keeps stays at its version, which says
            // the snapshot sees it.
            let old = self
                .map
                .set(lba, Slot::Damaged, self.map.get(lba).version());
            self.drop_slot(old.slot())?;
        } else {
            let old = self.map.set(lba, Slot::Damaged, version);
            debug_assert!(old.version() < version, "block {lba} went back in time");
            self.release_entry(lba, old)?;
        }
        self.counters.damaged_blocks_found += 1;
        Ok(())
    }

    /// Points `lba` at the live record `loc` (version `version`), and the
    /// record it pointed at dies.
    fn repoint(&mut self, lba: Lba, loc: Location, version: u64) -> Result<()> {
        self.space.add_live(loc.segment, loc.share());
        let old = self.map.set(lba, Slot::Data(loc), version);
        debug_assert!(
            old.version() <= version,
            "block {lba}: version {} replaced by older {version}",
            old.version()
        );
        debug_assert_ne!(
            old.slot(),
            Slot::Data(loc),
            "block {lba} repointed at itself"
        );
        if old.version() < version {
            self.release_entry(lba, old)?;
        } else {
            // The cleaner moved the record: the old place dies.
            self.drop_slot(old.slot())?;
        }
        debug_assert_eq!(self.map.get(lba).slot(), Slot::Data(loc));
        Ok(())
    }

    /// Appends a record that carries no block data (a range or reference
    /// record) naming block `lba` at `version`.
    pub(super) fn append_metadata(
        &mut self,
        stream: StreamKind,
        kind: RecordKind,
        lba: Lba,
        version: u64,
        payload: &[u8],
        floor: u64,
    ) -> Result<Location> {
        let header = RecordHeader {
            kind,
            codec: 0,
            seg_seq: 0,
            lba: lba.0,
            version,
            payload_len: payload.len() as u32,
            crc: 0,
        };
        self.append(stream, header, payload, crc32c::crc32c(payload), floor)
    }

    /// Copies the cleaner appends from now on land in a GC segment opened
    /// after incarnation `seq` (0: anywhere). Recovery replays segments in
    /// sequence order, so a copy of a record in a segment a retained root
    /// replays must come after it, as the original did after everything
    /// written before it: a copy in a GC segment opened earlier would be
    /// replayed ahead of the snapshot records, writes and trims that
    /// preceded its original (a zero range replayed before the snapshot it
    /// followed hides the data that snapshot keeps).
    pub(crate) fn copies_follow(&mut self, seq: u64) {
        self.copies_after_seq = seq;
    }

    fn append_gc(&mut self, header: RecordHeader, payload: &[u8]) -> Result<Location> {
        let loc = self.append(StreamKind::Gc, header, payload, crc32c::crc32c(payload), 0)?;
        self.counters.gc_write_bytes += loc.len as u64;
        Ok(loc)
    }

    /// Appends one record to a stream and returns where it landed, keeping
    /// `floor` segments free if a new segment must be opened.
    /// `header.seg_seq` and `header.crc` are filled in here.
    fn append(
        &mut self,
        kind: StreamKind,
        mut header: RecordHeader,
        payload: &[u8],
        payload_crc: u32,
        floor: u64,
    ) -> Result<Location> {
        self.check_writable()?;
        let len = header.record_len();
        debug_assert!(len <= self.segment_size_bytes());
        let too_old = kind == StreamKind::Gc && self.gc_opened_before(self.copies_after_seq);
        if too_old || self.stream_room(kind) < len {
            self.open_segment(kind, floor)?;
        }
        let segment_size = self.segment_size_bytes();
        let stream = &mut self.streams[kind as usize];
        let segment = stream.segment.expect("stream has an open segment");
        let offset = stream.write_offset();
        assert!(
            offset + len <= segment_size,
            "record overruns segment {segment}"
        );
        header.seg_seq = stream.seq as u32;
        append_record(&mut stream.buf, header, payload, payload_crc, &self.key);
        debug_assert_eq!(stream.write_offset(), offset + len);
        let blocks = match header.kind {
            RecordKind::Data => 1,
            RecordKind::Unit => payload[0] as u64,
            _ => 0,
        };
        self.space
            .note_append(segment, &header, blocks, offset + len);
        if self.streams[kind as usize].buf.len() >= self.write_batch_bytes {
            self.write_whole_pages(kind)?;
        }
        Ok(Location::record(segment, offset as u32, len as u32))
    }

    /// Segments free now.
    pub(crate) fn free_segment_count(&self) -> u64 {
        self.space.free_count()
    }

    // --- Streams and barriers.

    /// Stops all writing after a medium error: the log may have a hole.
    pub(crate) fn note_failure(&mut self, error: &Error) {
        if self.failed.is_none() {
            self.failed = Some(error.to_string());
        }
    }

    /// Queues the complete pages buffered in a stream for writing (after
    /// the state lock is released: see `outbound.rs`), keeping the
    /// partial tail.
    fn write_whole_pages(&mut self, kind: StreamKind) -> Result<()> {
        let page = self.page_size();
        let stream = &self.streams[kind as usize];
        let end = stream.write_offset() / page * page;
        if end <= stream.base_offset {
            return Ok(());
        }
        self.write_out(kind, (end - stream.base_offset) as usize)
    }

    /// Queues the first `len` buffered bytes of a stream for writing: whole
    /// pages, or on a medium with staging, whole sectors from a sector
    /// boundary.
    fn write_out(&mut self, kind: StreamKind, len: usize) -> Result<()> {
        let page = self.page_size();
        let stream = &mut self.streams[kind as usize];
        let segment = stream.segment.expect("stream has an open segment");
        let offset = stream.base_offset;
        // The next batch's buffer, sized so that appends do not grow it.
        let mut tail = self
            .outbound
            .spare_buffer()
            .unwrap_or_else(|| Vec::with_capacity(self.write_batch_bytes * 2));
        let stream = &mut self.streams[kind as usize];
        tail.extend_from_slice(&stream.buf[len..]);
        let mut data = std::mem::replace(&mut stream.buf, tail);
        data.truncate(len);
        stream.base_offset += len as u64;
        // Whole pages, or on a medium with staging, whole sectors from a
        // sector boundary (after a barrier staged a partial page).
        let kind = if offset.is_multiple_of(page) && (len as u64).is_multiple_of(page) {
            WriteKind::Pages
        } else {
            WriteKind::Sectors
        };
        let first_page = PageIndex((offset / page) as u32);
        self.outbound.push(kind, segment, first_page, offset, data);
        self.counters.media_write_bytes += len as u64;
        Ok(())
    }

    // --- The log writer's queue (driven by `volume/guard.rs`).

    /// Queued page writes nobody is writing yet.
    pub(crate) fn page_writes_unclaimed(&self) -> bool {
        self.outbound.unclaimed()
    }

    /// More is queued than the bound allows: the queuer should wait.
    pub(crate) fn page_writes_over_limit(&self) -> bool {
        self.outbound.over_limit()
    }

    /// Makes the caller the log writer, with everything queued now.
    pub(crate) fn claim_page_writes(&mut self) -> Option<Vec<PageWrite>> {
        self.outbound.claim()
    }

    /// The log writer performed through `ticket`; `failure`, if the next
    /// write failed (the log may then have a hole: writing stops).
    pub(crate) fn page_writes_done(&mut self, ticket: u64, failure: Option<&Error>) {
        self.outbound.written(ticket);
        if let Some(error) = failure {
            self.note_failure(error);
            // Nothing queued after a hole may reach the medium.
            self.outbound.discard();
        }
    }

    /// The ticket of the last page write queued.
    pub(crate) fn last_page_ticket(&self) -> u64 {
        self.outbound.last_ticket()
    }

    pub(crate) fn pages_written_through(&self) -> u64 {
        self.outbound.written_through()
    }

    pub(crate) fn page_writer_busy(&self) -> bool {
        self.outbound.is_busy()
    }

    /// Writes everything buffered in a stream, padding the last page.
    /// `segment_end`: the padding completes a segment's last page because
    /// the next record does not fit; it is counted apart from a flush's.
    fn pad_and_write(&mut self, kind: StreamKind, segment_end: bool) -> Result<()> {
        let page = self.page_size();
        let stream = &mut self.streams[kind as usize];
        if stream.buf.is_empty() {
            return Ok(());
        }
        let padded = (stream.write_offset().div_ceil(page) * page - stream.base_offset) as usize;
        let padding = (padded - stream.buf.len()) as u64;
        stream.buf.resize(padded, 0);
        if segment_end {
            self.counters.segment_tail_bytes += padding;
        } else {
            self.counters.padding_bytes += padding;
        }
        self.write_whole_pages(kind)?;
        let stream = &self.streams[kind as usize];
        debug_assert!(stream.buf.is_empty(), "padding left a partial page");
        let segment = stream.segment.expect("stream has an open segment");
        let written = stream.base_offset;
        self.space.set_fill(segment, written);
        if written >= self.segment_size_bytes() {
            self.seal(kind)?;
        }
        Ok(())
    }

    /// Closes a stream's segment: writes its tail and marks it sealed.
    fn seal(&mut self, kind: StreamKind) -> Result<()> {
        if self.streams[kind as usize].segment.is_none() {
            return Ok(());
        }
        if !self.streams[kind as usize].buf.is_empty() {
            self.pad_and_write(kind, true)?;
            if self.streams[kind as usize].segment.is_none() {
                return Ok(()); // pad_and_write sealed a full segment
            }
        }
        let stream = std::mem::take(&mut self.streams[kind as usize]);
        let segment = stream.segment.expect("checked above");
        self.space.seal(segment, stream.base_offset);
        self.outbound
            .push_event(WriteKind::Sealed, segment, stream.base_offset);
        Ok(())
    }

    /// Seals a stream's segment and opens a fresh one, keeping `floor`
    /// segments free.
    fn open_segment(&mut self, kind: StreamKind, floor: u64) -> Result<()> {
        self.seal(kind)?;
        if self.space.free_count() <= floor {
            return Err(Error::NoSpace {
                free_segments: self.space.free_count(),
                reserved_segments: floor,
            });
        }
        let segment = self.acquire(SegmentState::Open)?;
        let seq = self.space.segment(segment).seq;
        self.streams[kind as usize] = Stream {
            segment: Some(segment),
            seq,
            base_offset: 0,
            buf: Vec::new(),
        };
        Ok(())
    }

    /// Takes a reserved free segment as a new incarnation and queues the
    /// medium's readying of it for writing from page 0 (flash erases it; a
    /// file does not), ahead of every write to it. A failure to ready it
    /// stops all writing, as a failed page write does.
    fn acquire(&mut self, state: SegmentState) -> Result<SegmentId> {
        let segment = self.space.acquire(state).ok_or(Error::NoSpace {
            free_segments: self.space.free_count(),
            reserved_segments: 0,
        })?;
        self.outbound.push_event(WriteKind::Prepare, segment, 0);
        Ok(segment)
    }

    /// Writes every buffered byte of both streams (padding partial pages)
    /// and returns the barrier generation that a sync must reach to make
    /// all of it durable.
    pub(crate) fn barrier(&mut self) -> Result<u64> {
        self.check_writable()?;
        for kind in [StreamKind::Host, StreamKind::Gc] {
            if self.media.has_power_loss_protection() {
                self.stage_tail(kind)?;
            } else if self.media.staging().is_some() && !self.closing {
                self.stage_sector(kind)?;
            } else {
                self.pad_and_write(kind, false)?;
            }
        }
        Ok(self.space.note_barrier())
    }

    /// On a medium with staging: writes a stream's complete sectors in
    /// place and the partial last one to a staging slot, unless the slot
    /// last written for the stream holds it already. The sector stays in
    /// the buffer and is written in place once complete (see `staging.rs`).
    fn stage_sector(&mut self, kind: StreamKind) -> Result<()> {
        let stream = &self.streams[kind as usize];
        let Some(segment) = stream.segment else {
            return Ok(());
        };
        let sector = SECTOR_BYTES as u64;
        let complete = stream.write_offset() / sector * sector;
        if complete > stream.base_offset {
            self.write_out(kind, (complete - stream.base_offset) as usize)?;
        }
        let stream = &self.streams[kind as usize];
        let (offset, len) = (stream.base_offset, stream.buf.len());
        if len == 0 || self.staging.holds(kind as usize, segment, offset, len) {
            return Ok(());
        }
        let staged = Staged {
            segment,
            seq: stream.seq,
            offset_bytes: offset,
            data: stream.buf.clone(),
        };
        let bytes = staged.encode(&self.key);
        // The slot and the barrier generation are decided here, under the
        // lock, so two barriers never pick one slot; the write is queued
        // behind the sectors written in place above, and a sync covering
        // the barrier waits for the queue.
        let slot = self.staging.slot_for(kind as usize);
        let len = bytes.len() as u64;
        self.outbound.push(
            WriteKind::Staging(slot),
            segment,
            PageIndex(0),
            offset,
            bytes,
        );
        // Durable once a sync covers the barrier being issued.
        let gen = self.space.barrier_gen() + 1;
        self.staging.note_written(slot, gen, &staged);
        self.counters.staging_bytes += len;
        self.counters.media_write_bytes += len;
        Ok(())
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
        // After the whole pages queued before it, which the medium wants
        // programmed first.
        let (offset, bytes) = (stream.base_offset, stream.buf.clone());
        self.outbound
            .push(WriteKind::Stage, segment, first_page, offset, bytes);
        Ok(())
    }

    /// Frees reclaimable segments once barrier `gen` is durable; the
    /// staging it covers is then kept from the next barriers.
    pub(crate) fn note_synced(&mut self, gen: u64) {
        self.space.note_synced(gen);
        self.staging.note_synced(gen);
        self.report_freed();
    }

    /// Tells the medium of segments freed since the last report.
    fn report_freed(&mut self) {
        for segment in self.space.take_freed() {
            self.outbound.push_event(WriteKind::Freed, segment, 0);
        }
    }

    /// Every free segment, for the medium to hear of once recovery has
    /// settled what is free (before anything else runs, so outside the
    /// lock and in order with what follows).
    pub(crate) fn all_free(&mut self) -> Vec<SegmentId> {
        self.space.take_freed();
        self.space.free_segments().collect()
    }

    /// A cleaned victim (see `Space::retire`).
    pub(crate) fn retire(
        &mut self,
        victim: SegmentId,
        relocated_bytes: u64,
        after_checkpoint: bool,
    ) {
        debug_assert!(
            self.streams.iter().all(|s| s.segment != Some(victim)),
            "victim {victim} is open"
        );
        self.space.retire(victim, relocated_bytes, after_checkpoint);
        self.counters.segments_cleaned += 1;
        self.report_freed();
    }

    /// Drops everything buffered, as a power cut would (for `Volume::halt`).
    pub(crate) fn halt(&mut self, why: &str) {
        self.failed = Some(why.into());
        for stream in self.streams.iter_mut() {
            stream.buf.clear();
        }
        self.outbound.discard();
    }

    /// `close` has begun: no new host writes.
    pub(crate) fn set_closing(&mut self) {
        self.closing = true;
    }

    /// After the clean checkpoint of `close`: nothing more is written.
    pub(crate) fn set_closed(&mut self) {
        self.failed = Some("the volume is closed".into());
    }

    pub(crate) fn tally(&mut self, tally: Tally) {
        if self.tallies.add(tally) {
            return;
        }
        let counters = &mut self.counters;
        match tally {
            Tally::HostWrite(bytes) => {
                counters.host_write_bytes += bytes;
                counters.host_write_requests += 1;
            }
            Tally::HostRead(bytes) => counters.host_read_bytes += bytes,
            Tally::HostTrim(bytes) => counters.host_trim_bytes += bytes,
            Tally::HostZero(bytes) => counters.host_zero_bytes += bytes,
            Tally::HostWriteFast(bytes) => counters.host_write_fast_bytes += bytes,
            Tally::MediaRead(bytes) => counters.media_read_bytes += bytes,
            Tally::GcRead(bytes) => counters.gc_read_bytes += bytes,
            Tally::Flush => counters.flushes += 1,
            Tally::RootWritten(bytes) => {
                counters.meta_write_bytes += bytes;
                counters.media_write_bytes += bytes;
            }
            Tally::DumpWritten(bytes) => {
                counters.meta_write_bytes += bytes;
                counters.media_write_bytes += bytes;
                counters.checkpoints += 1;
            }
            Tally::DamageFound => counters.damaged_blocks_found += 1,
        }
    }

    // --- Roots and checkpoints.

    /// The reservations a root written now should carry.
    pub(crate) fn propose_reservation(&self, min_segments: u64, min_versions: u64) -> Reservation {
        self.space.propose_reservation(min_segments, min_versions)
    }

    /// Records that `root`, carrying `reservation`, is durable in its slot:
    /// the reservation becomes usable, the root replaces the one written
    /// there two generations ago, and the dump segments no remaining root
    /// refers to are freed.
    pub(crate) fn install_root(&mut self, root: RetainedRoot, reservation: &Reservation) {
        assert_eq!(
            root.generation,
            self.generation + 1,
            "roots are installed in generation order"
        );
        self.generation = root.generation;
        self.space.commit_reservation(reservation);
        let slot = root.slot();
        let replaced = self.roots[slot].replace(root);
        if let Some(dump) = replaced.and_then(|replaced| replaced.dump) {
            self.release_dump_unless_retained(&dump);
        }
    }

    /// A checkpoint is about to overwrite the root in the slot of the next
    /// generation: that root stops being a fallback as soon as the write
    /// starts, so its dump can make room for the new one (a checkpoint
    /// never needs more than one dump's worth of free space).
    pub(crate) fn release_replaced_root(&mut self) {
        let replaced = ((self.generation + 1) % 2) as usize;
        if let Some(dump) = self.roots[replaced].take().and_then(|root| root.dump) {
            self.release_dump_unless_retained(&dump);
        }
    }

    /// Releases the segments of `dump` that no retained root lists (a
    /// newer dump may keep pages in them). A fault reading a page outside
    /// the lock has pinned its segments: those go when the last pin on
    /// them does (`map/fault.rs`).
    fn release_dump_unless_retained(&mut self, dump: &crate::meta::DumpRef) {
        let retained: std::collections::HashSet<SegmentId> = self
            .roots
            .iter()
            .flatten()
            .filter_map(|root| root.dump.as_ref())
            .flat_map(|d| d.segments())
            .collect();
        let unused = dump.pairs().filter(|pair| !retained.contains(&pair[0]));
        let released = self.map.defer_dump_release(unused);
        if !released.is_empty() {
            for segment in released {
                self.space.release(segment);
            }
            self.report_freed();
        }
    }

    /// Takes `count` reserved segments for a checkpoint's dump, as
    /// (segment, seq); on failure none is taken.
    pub(crate) fn acquire_dump_segments(&mut self, count: usize) -> Result<Vec<(SegmentId, u64)>> {
        let mut taken: Vec<(SegmentId, u64)> = Vec::with_capacity(count);
        while taken.len() < count {
            match self.acquire(SegmentState::Dump) {
                Ok(segment) => taken.push((segment, self.space.segment(segment).seq)),
                Err(error) => {
                    self.forfeit_dump_segments(&taken);
                    return Err(error);
                }
            }
        }
        Ok(taken)
    }

    /// Gives back the segments of a dump no root will name.
    pub(crate) fn forfeit_dump_segments(&mut self, segments: &[(SegmentId, u64)]) {
        for &(segment, _) in segments.iter().rev() {
            self.space.forfeit(segment);
        }
    }

    /// `bytes` of a dump were written into `segment`.
    pub(crate) fn note_dump_segment(&mut self, segment: SegmentId, bytes: u64) {
        debug_assert_eq!(self.space.segment(segment).state, SegmentState::Dump);
        self.space.set_fill(segment, bytes);
    }

    /// A checkpoint's root is durable: its log and range records since
    /// the last one are covered.
    pub(crate) fn note_checkpoint(&mut self) {
        self.space.note_checkpoint();
    }
}

/// The versions of a data or unit record's blocks (a unit that passed
/// its checksum always decodes).
pub(crate) fn record_versions(header: &RecordHeader, payload: &[u8]) -> Vec<u64> {
    match header.kind {
        RecordKind::Data => vec![header.version],
        RecordKind::Unit => {
            crate::record::decode_unit(header, payload)
                .expect("a unit that passed its checksum decodes")
                .versions
        }
        other => panic!("a {other:?} record holds no blocks"),
    }
}
