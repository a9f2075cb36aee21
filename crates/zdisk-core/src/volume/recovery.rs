//! Opening a volume: load the newest checkpoint, then roll the log forward.
//!
//! The checkpoint root names a map dump and a sequence boundary. Every
//! segment whose first record carries a sequence number at or above the
//! boundary was opened after the snapshot and is replayed whole; segments
//! that were open at the snapshot are replayed from the recorded offset.
//! Replay applies each record if its version is at least the version the
//! map holds: the highest version wins, and among equal versions (a record
//! and its relocated copy, identical data) the one replayed last. Segments
//! are replayed in sequence order. Trims leave versioned tombstones while
//! replaying, so an older record replayed afterwards cannot resurrect a
//! trimmed block.
//!
//! On a medium with staging, the last flushes may have left the partial
//! last sector of an open segment only in a staging slot: before anything
//! is read, those sectors are laid back over their segments (`staging.rs`
//! decides which), and a writable recovery writes them back in place.
//!
//! A clean root (written by a clean shutdown) has nothing after it, so the
//! log is not scanned at all, nor are the staging slots: a clean shutdown
//! pads instead of staging.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde::Serialize;

use crate::dump::load_dump;
use crate::error::Result;
use crate::map::{
    key_block, key_space, space_key, table_content, table_key, Entry, Location, Map, RangeState,
    Slot, SPACE_BLOCKS, TABLE_BASE,
};
use crate::media::Media;
use crate::meta::{RetainedRoot, Root};
use crate::record::{
    decode_record, decode_unit, is_cold_unit, range_count, RecordKey, RecordKind, HEADER_SIZE,
};
use crate::segments::{SegmentInfo, SegmentState, SegmentTable};
use crate::stats::Counters;
use crate::units::{Lba, SegmentId, BLOCK_SIZE_U64};

use super::scan::{scan_segment, Scanned};
use super::staging::{lay_over, recover_staged, Staged};
use super::state::{keeps, keeps_in, SharedCounts};
use crate::snapshots::{decode_change, SnapshotChange, Snapshots, SNAPSHOTS_MAX};

/// What happened while opening a volume.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OpenReport {
    /// The root was written by a clean shutdown.
    pub clean: bool,
    pub root_generation: u64,
    pub replayed_segments: u64,
    pub replayed_records: u64,
    /// Undecodable bytes found between valid records while replaying
    /// (damage; the replay skipped over them).
    pub replay_damage: Vec<String>,
    /// Metadata slots that did not decode (a torn root write leaves one),
    /// and roots that could not be used.
    pub slot_problems: Vec<String>,
    /// Roots that were durable (they decode) but whose checkpoint could
    /// not be read, so that recovery started from an older one: whatever
    /// only they recorded may be lost. A torn root write does not count:
    /// that root never was durable.
    pub lost_checkpoints: Vec<String>,
    /// Map entries that pointed outside the log and were marked damaged.
    pub dangling_entries: u64,
    /// Reserved segments erased because the crashed run may have left
    /// half-written records in them.
    pub leftover_segments_erased: u64,
    /// Partial sectors whose flushed bytes were only in staging slots
    /// (the crash lost or tore their write in place), laid back over their
    /// segments, and written back in place unless the volume was opened
    /// read-only.
    pub staged_sectors: u64,
    /// Shared contents whose cell replay rebuilt from the content's own
    /// record, the record that first shared it being gone (see
    /// `Recovery::replay_ref`).
    pub cells_rebuilt: u64,
    #[serde(skip)]
    pub duration: Duration,
}

/// The incarnation of the first valid record anywhere in a segment.
fn first_record_seq(bytes: &[u8], key: &RecordKey) -> Option<u32> {
    (0..bytes.len().saturating_sub(HEADER_SIZE))
        .step_by(crate::record::RECORD_ALIGN as usize)
        .find_map(|at| decode_record(&bytes[at..], key, None).ok())
        .map(|(header, _)| header.seg_seq)
}

pub(crate) struct Recovered {
    pub roots: [Option<RetainedRoot>; 2],
    pub map: Map,
    /// References to each shared content, counted from the map.
    pub shared: SharedCounts,
    pub snapshots: Snapshots,
    pub segments: SegmentTable,
    pub next_seq: u64,
    pub next_version: u64,
    pub counters: Counters,
    pub report: OpenReport,
    /// The staged sectors laid over the segments, for a read-only volume
    /// to read through (a writable one wrote them back).
    pub staged: Vec<Staged>,
}

/// The full sequence number of a segment whose records carry `seq32`, if
/// it was opened at or after `boundary`.
fn seq_at_or_after(boundary: u64, seq32: u32) -> Option<u64> {
    let diff = seq32.wrapping_sub(boundary as u32) as i32;
    (diff >= 0).then(|| boundary + diff as u64)
}

/// A range record replay applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct ReplayedRange {
    seq: u64,
    segment: SegmentId,
    first: u64,
    count: u64,
    version: u64,
}

/// One segment to replay, from `start_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Planned {
    seq: u64,
    segment: SegmentId,
    start_offset: u64,
}

/// Recovery in progress from one root.
struct Recovery<'a> {
    media: &'a dyn Media,
    root: &'a Root,
    key: RecordKey,
    logical_blocks: u64,
    map: Map,
    infos: Vec<SegmentInfo>,
    roots: [Option<RetainedRoot>; 2],
    /// Segments of every retained dump: never replayed, never reused.
    dump_segments: HashSet<SegmentId>,
    counters: Counters,
    next_seq: u64,
    next_version: u64,
    ranges: Vec<ReplayedRange>,
    /// Reference records replayed (`count` blocks from `first`, versions
    /// from `version`).
    refs: Vec<ReplayedRange>,
    /// Where each host block version replayed was written: a reference
    /// whose content's cell is missing finds the content here.
    replayed_contents: HashMap<u64, Location>,
    shared: SharedCounts,
    /// The snapshots, as the root's dump has them and as replayed records
    /// changed them since.
    snapshots: Snapshots,
    /// Segments holding a snapshot record replayed: needed until the next
    /// checkpoint, as reference records are.
    snapshot_segments: HashSet<SegmentId>,
    /// Replay changed a clone's key space, or one nobody owned then.
    clone_spaces_touched: bool,
    /// Changes applied to a key space nobody owned when they were
    /// replayed (first key, blocks, version): kept only if a clone made
    /// before them owns it in the end.
    unowned: Vec<(Lba, u64, u64)>,
    /// Sectors found only in staging slots, read as if they were in place.
    staged: Vec<Staged>,
    report: OpenReport,
}

/// Recovers from `root`. `older` is the root in the other slot, if it is
/// valid and older: its dump stays reserved so that it remains a fallback.
pub(crate) fn recover(
    media: &dyn Media,
    root: &Root,
    older: Option<&Root>,
    trust_clean: bool,
    writable: bool,
) -> Result<Recovered> {
    let mut recovery = Recovery::load(media, root, older, trust_clean)?;
    if !recovery.report.clean {
        recovery.staged = recover_staged(
            media,
            &recovery.key,
            &root.retained(),
            &recovery.dump_segments,
        )?;
        recovery.report.staged_sectors = recovery.staged.len() as u64;
        let plan = recovery.plan()?;
        recovery.replay(plan)?;
    }
    recovery.finish(writable)
}

impl<'a> Recovery<'a> {
    /// Loads the root's dump, and what the segment table said at its snapshot.
    fn load(
        media: &'a dyn Media,
        root: &'a Root,
        older: Option<&Root>,
        trust_clean: bool,
    ) -> Result<Recovery<'a>> {
        let geometry = media.geometry();
        let segment_size = geometry.segment_size_bytes;
        let logical_blocks = root.superblock.logical_size_bytes / BLOCK_SIZE_U64;
        let key = RecordKey(root.superblock.uuid);
        let checkpoint = &root.checkpoint;
        let mut map = Map::new(true);
        let dumped = match &checkpoint.dump {
            Some(dump) => load_dump(media, &key, dump, logical_blocks, &mut map)?,
            None => vec![None; geometry.segment_count as usize],
        };
        let mut roots: [Option<RetainedRoot>; 2] = [None, None];
        roots[root.slot()] = Some(root.retained());
        if let Some(older) =
            older.filter(|o| o.generation < root.generation && o.slot() != root.slot())
        {
            roots[older.slot()] = Some(older.retained());
        }
        let dump_segments = roots
            .iter()
            .flatten()
            .filter_map(|r| r.dump.as_ref())
            .flat_map(|d| d.segments())
            .filter(|s| s.0 < geometry.segment_count)
            .collect();
        let infos = dumped
            .iter()
            .map(|dumped| SegmentInfo {
                seq: dumped.map_or(0, |d| d.seq),
                fill_bytes: dumped.map_or(0, |d| d.fill_bytes.min(segment_size)),
                max_version: dumped.map_or(0, |d| d.max_version),
                cold_bytes: dumped.map_or(0, |d| d.cold_bytes),
                fast_bytes: dumped.map_or(0, |d| d.fast_bytes),
                ..SegmentInfo::free()
            })
            .collect();
        Ok(Recovery {
            media,
            root,
            key,
            logical_blocks,
            map,
            infos,
            roots,
            dump_segments,
            counters: checkpoint.counters,
            // Continue past everything the crashed run may have written.
            next_seq: checkpoint.next_seq.max(checkpoint.seq_reserved),
            next_version: checkpoint.next_version.max(checkpoint.version_reserved),
            ranges: Vec::new(),
            refs: Vec::new(),
            replayed_contents: HashMap::new(),
            shared: SharedCounts::default(),
            snapshots: checkpoint.snapshots.clone(),
            snapshot_segments: HashSet::new(),
            clone_spaces_touched: false,
            unowned: Vec::new(),
            staged: Vec::new(),
            report: OpenReport {
                clean: checkpoint.clean && trust_clean,
                root_generation: root.generation,
                ..OpenReport::default()
            },
        })
    }

    /// Reads `buf.len()` bytes of `segment` from `offset`, staged sectors laid over.
    fn read(&self, segment: SegmentId, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.media.read(segment, offset, buf)?;
        lay_over(&self.staged, segment, offset, buf);
        Ok(())
    }

    /// The incarnation a segment's records carry, from its first record
    /// (or, if that is torn or damaged, the first valid one further in);
    /// `None` if it holds none.
    fn segment_seq(&self, segment: SegmentId, head: &mut [u8]) -> Result<Option<u32>> {
        self.read(segment, 0, head)?;
        match decode_record(head, &self.key, None) {
            Ok((header, _)) => Ok(Some(header.seg_seq)),
            // Never written, or erased.
            Err(_) if crate::meta::is_blank(head) => Ok(None),
            Err(_) => {
                let segment_size = self.media.geometry().segment_size_bytes;
                let mut bytes = vec![0u8; segment_size as usize];
                self.read(segment, 0, &mut bytes)?;
                Ok(first_record_seq(&bytes, &self.key))
            }
        }
    }

    /// The segments to replay, in sequence order: those opened after the
    /// snapshot, whole, and those open at it, from the recorded offset.
    fn plan(&self) -> Result<Vec<Planned>> {
        let geometry = self.media.geometry();
        let checkpoint = &self.root.checkpoint;
        let mut plan = Vec::new();
        let mut head = vec![0u8; (HEADER_SIZE + 4096).min(geometry.segment_size_bytes as usize)];
        for index in 0..geometry.segment_count {
            let segment = SegmentId(index);
            if self.dump_segments.contains(&segment) {
                continue;
            }
            let Some(seg_seq) = self.segment_seq(segment, &mut head)? else {
                continue;
            };
            let open = checkpoint
                .open_segments
                .iter()
                .find(|open| open.segment == segment && open.seq as u32 == seg_seq);
            if let Some(open) = open {
                plan.push(Planned {
                    seq: open.seq,
                    segment,
                    start_offset: open.offset_bytes,
                });
            } else if let Some(seq) = seq_at_or_after(checkpoint.seq_boundary, seg_seq) {
                plan.push(Planned {
                    seq,
                    segment,
                    start_offset: 0,
                });
            }
        }
        plan.sort();
        Ok(plan)
    }

    /// Replays the planned segments in order: each record wins if its
    /// version is at least the map's.
    fn replay(&mut self, plan: Vec<Planned>) -> Result<()> {
        let geometry = self.media.geometry();
        let page_size = geometry.page_size_bytes as u64;
        let mut versions_seen = HashSet::new();
        let mut bytes = vec![0u8; geometry.segment_size_bytes as usize];
        for Planned {
            seq,
            segment,
            start_offset,
        } in plan
        {
            self.read(segment, 0, &mut bytes)?;
            let scan = scan_segment(&bytes, start_offset, seq as u32, page_size, &self.key);
            for (offset, error) in &scan.damaged {
                self.report.replay_damage.push(format!(
                    "segment {segment} (seq {seq}) at offset {offset}: {error}"
                ));
            }
            self.report.replayed_segments += 1;
            let info = &mut self.infos[segment.index()];
            info.seq = seq;
            info.fill_bytes = scan.end_offset.max(start_offset);
            self.counters.media_write_bytes += scan.end_offset.saturating_sub(start_offset);
            self.next_seq = self.next_seq.max(seq + 1);
            for record in &scan.records {
                let payload = &bytes[record.payload.clone()];
                self.replay_record(seq, segment, record, payload, &mut versions_seen)?;
            }
        }
        if self.report.replayed_records > 0 {
            self.counters.recoveries += 1;
        }
        Ok(())
    }

    fn replay_record(
        &mut self,
        seq: u64,
        segment: SegmentId,
        record: &Scanned,
        payload: &[u8],
        versions_seen: &mut HashSet<u64>,
    ) -> Result<()> {
        let header = record.header;
        if header.version > crate::map::VERSION_MAX {
            // Only damage or a forgery gets past the checksum with this;
            // the map cannot hold it.
            self.report.replay_damage.push(format!(
                "segment {segment} (seq {seq}) at offset {}: version {} out of range",
                record.offset, header.version
            ));
            return Ok(());
        }
        self.next_version = self.next_version.max(header.version + 1);
        let info = &mut self.infos[segment.index()];
        info.max_version = info.max_version.max(header.version);
        match header.kind {
            RecordKind::Data | RecordKind::Unit => {
                let versions = match header.kind {
                    RecordKind::Unit => match decode_unit(&header, payload) {
                        Ok(unit) => unit.versions,
                        Err(why) => {
                            self.report.replay_damage.push(format!(
                                "segment {segment} (seq {seq}) at offset {}: {why}",
                                record.offset
                            ));
                            return Ok(());
                        }
                    },
                    _ => vec![header.version],
                };
                // A record the cleaner rewrote from shared members names
                // their cells: member i at `TABLE_BASE + versions[i]`.
                let cells = header.lba >= TABLE_BASE;
                let beyond = if cells {
                    (0..versions.len())
                        .any(|i| table_content(header.lba + i as u64) != Some(versions[i]))
                } else {
                    // A record the cleaner rewrote from entries a snapshot
                    // kept names their keys in its space.
                    key_block(header.lba)
                        .checked_add(versions.len() as u64)
                        .is_none_or(|end| end > self.logical_blocks)
                };
                if beyond {
                    return Ok(());
                }
                self.report.replayed_records += 1;
                self.map
                    .load(self.media, Lba(header.lba), versions.len() as u64)?;
                if !cells {
                    for &version in &versions {
                        self.map.load(self.media, table_key(version), 1)?;
                    }
                }
                let len = header.record_len() as u32;
                if is_cold_unit(&header, payload) {
                    self.infos[segment.index()].cold_bytes += len as u64;
                }
                if header.fast_effort() {
                    self.infos[segment.index()].fast_bytes += len as u64;
                }
                let members = versions.len() as u8;
                for (member, &version) in versions.iter().enumerate() {
                    let loc = Location::unit_member(
                        segment,
                        record.offset as u32,
                        len,
                        member as u8,
                        members,
                    );
                    // A shared member's copy updates its cell, whichever
                    // block the record was written for.
                    let lba = Lba(header.lba + member as u64);
                    if cells || !self.map.get(table_key(version)).is_hole() {
                        let key = if cells { lba } else { table_key(version) };
                        self.map.set_if_newer(key, Slot::Data(loc), version);
                    } else {
                        self.replay_block(lba, Slot::Data(loc), version)?;
                    }
                    if !cells {
                        self.replayed_contents.insert(version, loc);
                    }
                    if version >= self.root.checkpoint.next_version && versions_seen.insert(version)
                    {
                        self.counters.host_write_bytes += BLOCK_SIZE_U64;
                    }
                }
            }
            // A shared content found damaged: its cell is marked.
            RecordKind::Damaged
                if header.lba >= TABLE_BASE
                    && range_count(payload) == 1
                    && table_content(header.lba).is_some_and(|c| c <= crate::map::VERSION_MAX) =>
            {
                self.report.replayed_records += 1;
                self.map.load(self.media, Lba(header.lba), 1)?;
                if !self.map.get(Lba(header.lba)).is_hole() {
                    self.map
                        .set_if_newer(Lba(header.lba), Slot::Damaged, header.version);
                }
            }
            RecordKind::Trim | RecordKind::Zero | RecordKind::Damaged => {
                let count = range_count(payload);
                // A clone's ranges name its keys.
                let beyond = header.lba >= TABLE_BASE
                    || key_block(header.lba)
                        .checked_add(count)
                        .is_none_or(|end| end > self.logical_blocks);
                if count == 0 || beyond {
                    return Ok(());
                }
                self.map.load(self.media, Lba(header.lba), count)?;
                self.report.replayed_records += 1;
                self.ranges.push(ReplayedRange {
                    seq,
                    segment,
                    first: header.lba,
                    count,
                    version: header.version,
                });
                self.replay_range(header.kind, Lba(header.lba), count, header.version)?;
            }
            RecordKind::Ref => self.replay_ref(seq, segment, record, payload, versions_seen)?,
            RecordKind::Snapshot => match decode_change(payload) {
                Ok(change) => {
                    self.report.replayed_records += 1;
                    self.snapshot_segments.insert(segment);
                    self.replay_snapshot(&change, header.version)?;
                }
                Err(why) => self.report.replay_damage.push(format!(
                    "segment {segment} (seq {seq}) at offset {}: {why}",
                    record.offset
                )),
            },
            RecordKind::MapChunk | RecordKind::Chapter => {}
        }
        Ok(())
    }

    /// Replays a reference record: each block shares the content it names,
    /// whose owner becomes shared first if its cell is not there yet. A
    /// content found nowhere leaves its block as it was: the reference was
    /// not flushed (the crash lost the earlier record that shared its
    /// content, as it may lose any unflushed write), or the block changed
    /// since anyway (the content went with its last reference before the
    /// checkpoint). A flushed reference finds its content: the records
    /// before it were flushed with it. If the one that first shared it is
    /// gone all the same (its segment died and was reused under a newer
    /// root, and recovery fell back to the older root because the newer
    /// one rotted), the cell is rebuilt from the content's own record when
    /// replay met it.
    fn replay_ref(
        &mut self,
        seq: u64,
        segment: SegmentId,
        record: &Scanned,
        payload: &[u8],
        versions_seen: &mut HashSet<u64>,
    ) -> Result<()> {
        let header = record.header;
        let members = match crate::record::decode_ref(payload) {
            Ok(members) => members,
            Err(why) => {
                self.report.replay_damage.push(format!(
                    "segment {segment} (seq {seq}) at offset {}: {why}",
                    record.offset
                ));
                return Ok(());
            }
        };
        let count = members.len() as u64;
        let beyond = header
            .lba
            .checked_add(count)
            .is_none_or(|end| end > self.logical_blocks)
            || header.version + count > crate::map::VERSION_MAX + 1
            || members
                .iter()
                .any(|m| m.content > crate::map::VERSION_MAX || m.content >= header.version);
        if beyond {
            self.report.replay_damage.push(format!(
                "segment {segment} (seq {seq}) at offset {}: reference record out of range",
                record.offset
            ));
            return Ok(());
        }
        self.report.replayed_records += 1;
        self.next_version = self.next_version.max(header.version + count);
        self.map.load(self.media, Lba(header.lba), count)?;
        self.refs.push(ReplayedRange {
            seq,
            segment,
            first: header.lba,
            count,
            version: header.version,
        });
        // Owners become shared first, as `State::apply_ref` did it: a block
        // both owner and target is shared before it changes.
        let mut found = Vec::with_capacity(members.len());
        for member in &members {
            let cell = table_key(member.content);
            self.map.load(self.media, cell, 1)?;
            let owner = (member.owner < self.logical_blocks).then_some(Lba(member.owner));
            if let Some(owner) = owner {
                self.map.load(self.media, owner, 1)?;
            }
            let mut stored = !self.map.get(cell).is_hole();
            if let Some(owner) = owner {
                let entry = self.map.get(owner);
                if let (Slot::Data(loc), true) = (entry.slot(), entry.version() == member.content) {
                    // The owner holds the content directly: it becomes
                    // shared. Its cell may be there already, if a copy the
                    // cleaner wrote of the shared member (naming the cell)
                    // replayed first: the cell keeps that copy.
                    if !stored {
                        self.map.set(cell, Slot::Data(loc), member.content);
                    }
                    self.map.set(
                        owner,
                        Slot::Shared {
                            content: member.content,
                        },
                        member.content,
                    );
                    stored = true;
                }
            }
            if !stored {
                // The record that first shared the content (making its
                // cell) may be gone: all of its segment died and was
                // reused once a newer root no longer needed it, and that
                // root rotted. The content's own record, replayed here
                // under its unique version, is still the content.
                if let Some(&loc) = self.replayed_contents.get(&member.content) {
                    self.map.set(cell, Slot::Data(loc), member.content);
                    self.report.cells_rebuilt += 1;
                    stored = true;
                }
            }
            found.push(stored);
        }
        for (i, (member, stored)) in members.iter().zip(found).enumerate() {
            let version = header.version + i as u64;
            if stored {
                let slot = Slot::Shared {
                    content: member.content,
                };
                self.replay_block(Lba(header.lba + i as u64), slot, version)?;
            }
            if version >= self.root.checkpoint.next_version && versions_seen.insert(version) {
                self.counters.host_write_bytes += BLOCK_SIZE_U64;
            }
        }
        Ok(())
    }

    /// Until the next checkpoint is durable, a replay from the current one
    /// needs every range record that still determines some block: the
    /// segments holding one copy of each (the cleaner may have left stale
    /// copies behind in segments it had already freed).
    fn segments_holding_needed_ranges(&mut self) -> Result<HashSet<SegmentId>> {
        let mut holds_ranges: HashSet<SegmentId> = HashSet::new();
        let mut kept_versions: HashSet<u64> = HashSet::new();
        self.ranges.sort_by(|a, b| b.cmp(a));
        for range in &self.ranges {
            if kept_versions.contains(&range.version) && !holds_ranges.contains(&range.segment) {
                continue;
            }
            self.map.load(self.media, Lba(range.first), range.count)?;
            if self
                .map
                .any_at_version(Lba(range.first), range.count, range.version)
            {
                holds_ranges.insert(range.segment);
                kept_versions.insert(range.version);
            }
        }
        for replayed in &self.refs {
            if holds_ranges.contains(&replayed.segment) {
                continue;
            }
            self.map
                .load(self.media, Lba(replayed.first), replayed.count)?;
            let needed = (0..replayed.count)
                .any(|i| self.map.get(Lba(replayed.first + i)).version() == replayed.version + i);
            if needed {
                holds_ranges.insert(replayed.segment);
            }
        }
        Ok(holds_ranges)
    }

    /// Replays `slot` at `version` for block key `key` (a host key, or an
    /// entry a snapshot kept if the cleaner rewrote it from there): a copy
    /// of an entry that exists at that version (in any key space: versions
    /// are unique) moves it; else, for a host key, a newer write replaces
    /// the entry, which the newest snapshot of its volume keeps if it sees
    /// it, as `State::release_entry` did.
    fn replay_block(&mut self, key: Lba, slot: Slot, version: u64) -> Result<()> {
        if self.snapshots.is_empty() && key.0 < SPACE_BLOCKS {
            self.map.set_if_newer(key, slot, version);
            return Ok(());
        }
        let block = key_block(key.0);
        let candidates: Vec<Lba> = self
            .snapshots
            .spaces()
            .map(|space| space_key(space, block))
            .collect();
        for &at in &candidates {
            self.map.load(self.media, at, 1)?;
            let entry = self.map.get(at);
            let data = matches!(entry.slot(), Slot::Data(_) | Slot::Shared { .. });
            if data && entry.version() == version {
                self.map.set(at, slot, version);
                return Ok(());
            }
        }
        if !self.replays_host_change(key, 1, version) {
            // A copy of an entry no snapshot keeps any more, or a write to
            // a clone deleted since.
            return Ok(());
        }
        self.map.load(self.media, key, 1)?;
        let old = self.map.get(key);
        if old.version() > version || !self.superseded_blocks(key, 1, version)?.is_empty() {
            return Ok(());
        }
        self.keep_replayed(key, old, version)?;
        self.map.set(key, slot, version);
        Ok(())
    }

    /// True if a change at `version` to key `key` is a host change to
    /// replay: the key is the image volume's, or in a space no snapshot
    /// owns and no clone made at or after the change owns. A space nobody
    /// owns now may be a clone's whose making is replayed later (a copy
    /// the cleaner wrote into a segment opened before it), or a deleted
    /// clone's: [`Replay::sweep_clone_spaces`] settles which at the end.
    ///
    /// A change applied to a space nobody owns is remembered: the space
    /// may also be a deleted snapshot's (a record the cleaner rewrote from
    /// an entry it kept), which a later snapshot may take; only a clone
    /// made before the change keeps it in the end.
    fn replays_host_change(&mut self, key: Lba, count: u64, version: u64) -> bool {
        match key_space(key.0) {
            Some(0) => true,
            Some(space) if self.snapshots.by_space(space).is_some() => false,
            Some(space) => match self.snapshots.clone_by_space(space) {
                Some(clone) => clone.version < version,
                None => {
                    self.clone_spaces_touched = true;
                    self.unowned.push((key, count, version));
                    true
                }
            },
            None => false,
        }
    }

    /// After the log is replayed: a key space that no snapshot or clone
    /// owns holds nothing, and a clone's holds nothing older than the
    /// clone (changes of a clone deleted before, in the same space).
    fn sweep_clone_spaces(&mut self) -> Result<()> {
        if !self.clone_spaces_touched {
            return Ok(());
        }
        // What was applied to a space nobody owned then, and is not a
        // later clone's in the end, goes (a snapshot may own the space now).
        for (first, count, version) in std::mem::take(&mut self.unowned) {
            let space = key_space(first.0).unwrap_or(0);
            let kept = self
                .snapshots
                .clone_by_space(space)
                .is_some_and(|clone| clone.version < version);
            if kept {
                continue;
            }
            self.map.load(self.media, first, count)?;
            let mut applied = Vec::new();
            self.map.for_each_run(first, count, |at, blocks, entry| {
                if !entry.is_hole() && entry.version() == version {
                    applied.push((at, blocks));
                }
                std::ops::ControlFlow::Continue(())
            });
            for (at, blocks) in applied {
                self.map
                    .set_range(at, blocks, RangeState::Hole, 0, false, &mut |_| {});
            }
        }
        for space in 1..=SNAPSHOTS_MAX as u16 {
            if self.snapshots.by_space(space).is_some() {
                continue;
            }
            let made = self.snapshots.clone_by_space(space).map(|c| c.version);
            let first = space_key(space, 0);
            self.map.load(self.media, first, SPACE_BLOCKS)?;
            let mut stale = Vec::new();
            self.map
                .for_each_run(first, SPACE_BLOCKS, |at, blocks, entry| {
                    if !entry.is_hole() && made.is_none_or(|made| entry.version() <= made) {
                        stale.push((at, blocks));
                    }
                    std::ops::ControlFlow::Continue(())
                });
            for (at, blocks) in stale {
                self.map
                    .set_range(at, blocks, RangeState::Hole, 0, false, &mut |_| {});
            }
        }
        Ok(())
    }

    /// Host key `key`'s entry `old` is being replaced: the newest snapshot
    /// of its volume keeps it if it sees it and keeps nothing there yet.
    ///
    /// Only a snapshot taken before the change at `version` keeps what it
    /// replaced: a copy the cleaner made of an old change (a range record
    /// relocated unchanged, say) may be replayed after a newer snapshot
    /// is in the registry, and the snapshot never saw that replacement.
    fn keep_replayed(&mut self, key: Lba, old: Entry, version: u64) -> Result<()> {
        let volume = key_space(key.0).unwrap_or(0);
        let Some(newest) = self.snapshots.newest_of(volume) else {
            return Ok(());
        };
        if !keeps_in(volume, old) || old.version() >= newest.version || newest.version >= version {
            return Ok(());
        }
        let at = space_key(newest.space, key_block(key.0));
        self.map.load(self.media, at, 1)?;
        if self.map.get(at).is_hole() {
            self.map.set(at, old.slot(), old.version());
            self.map.set(key, Slot::Hole, 0);
        }
        Ok(())
    }

    /// Replays a range record of `kind` at `version` over host keys
    /// `first..first+count`: what the newest snapshot of their volume sees
    /// there moves to its space first; a clone's zeros stay as they are
    /// (`State::range_parts`).
    fn replay_range(
        &mut self,
        kind: RecordKind,
        first: Lba,
        count: u64,
        version: u64,
    ) -> Result<()> {
        let state = match kind {
            RecordKind::Trim => RangeState::Hole,
            RecordKind::Zero => RangeState::Zero,
            _ => RangeState::Damaged,
        };
        self.map.load(self.media, first, count)?;
        let space = key_space(first.0).unwrap_or(0);
        if space != 0 && self.snapshots.by_space(space).is_some() {
            // A kept entry found damaged (`State::mark_damaged`): it stays
            // at its version, which says the snapshot sees it.
            if state == RangeState::Damaged {
                for key in first.0..first.0 + count {
                    let entry = self.map.get(Lba(key));
                    if !entry.is_hole() {
                        self.map.set(Lba(key), Slot::Damaged, entry.version());
                    }
                }
            }
            return Ok(());
        }
        if !self.replays_host_change(first, count, version) {
            return Ok(());
        }
        self.keep_replayed_range(first, count, version)?;
        let mut parts: Vec<(Lba, u64)> = Vec::new();
        if first.0 < SPACE_BLOCKS {
            parts.push((first, count));
        } else {
            self.map.for_each_run(first, count, |at, blocks, entry| {
                if entry.slot() != Slot::Zero {
                    parts.push((at, blocks));
                }
                std::ops::ControlFlow::Continue(())
            });
        }
        let superseded = self.superseded_blocks(first, count, version)?;
        let parts = without_blocks(parts, &superseded);
        for (from, blocks) in parts {
            self.map
                .set_range(from, blocks, state, version, true, &mut |_| {});
        }
        Ok(())
    }

    /// The host keys among `first..first+count` whose entry a snapshot of
    /// their volume keeps at a version above `version`: the change at
    /// `version` was overwritten there before that entry was kept (a copy
    /// of an old change the cleaner made, replayed over a block a later
    /// trim left a hole, must not come back: the snapshot's view would
    /// take it for the volume's unchanged entry).
    fn superseded_blocks(&mut self, first: Lba, count: u64, version: u64) -> Result<Vec<u64>> {
        let volume = key_space(first.0).unwrap_or(0);
        let spaces: Vec<u16> = self.snapshots.of_volume(volume).map(|s| s.space).collect();
        let block = key_block(first.0);
        let mut superseded = Vec::new();
        for space in spaces {
            let at = space_key(space, block);
            self.map.load(self.media, at, count)?;
            self.map.for_each_run(at, count, |key, blocks, entry| {
                if !entry.is_hole() && entry.version() > version {
                    let offset = key_block(key.0) - block;
                    superseded.extend((0..blocks).map(|i| first.0 + offset + i));
                }
                std::ops::ControlFlow::Continue(())
            });
        }
        superseded.sort_unstable();
        superseded.dedup();
        Ok(superseded)
    }

    /// Before a range record at `version` replays over host keys
    /// `first..first+count`: what the newest snapshot of their volume sees
    /// there moves to its space.
    fn keep_replayed_range(&mut self, first: Lba, count: u64, version: u64) -> Result<()> {
        if self.snapshots.is_empty() {
            return Ok(());
        }
        let mut seen = Vec::new();
        self.map.for_each_run(first, count, |at, blocks, entry| {
            if blocks == 1 && keeps(entry) && entry.version() < version {
                seen.push((at, entry));
            }
            std::ops::ControlFlow::Continue(())
        });
        for (key, old) in seen {
            self.keep_replayed(key, old, version)?;
        }
        Ok(())
    }

    /// Replays a snapshot taken or deleted, or a clone made or deleted,
    /// unless the dump has it so already. A snapshot's deletion hands down
    /// or drops the entries it kept, as `State::delete_snapshot` did; a
    /// clone's drops its entries (live bytes and counts are derived from
    /// the map afterwards).
    ///
    /// A clone's deletion at `version` drops its entries older than that:
    /// a newer one there can only be a later clone's in the same space,
    /// replayed ahead of its making (`replays_host_change`).
    fn replay_snapshot(&mut self, change: &SnapshotChange, version: u64) -> Result<()> {
        if let SnapshotChange::DeleteClone { space } = *change {
            if self.snapshots.clone_by_space(space).is_none() {
                return Ok(());
            }
            let first = space_key(space, 0);
            self.map.load(self.media, first, SPACE_BLOCKS)?;
            let mut entries = Vec::new();
            self.map
                .for_each_run(first, SPACE_BLOCKS, |at, blocks, entry| {
                    if !entry.is_hole() && entry.version() < version {
                        entries.push((at, blocks));
                    }
                    std::ops::ControlFlow::Continue(())
                });
            for (at, blocks) in entries {
                self.map
                    .set_range(at, blocks, RangeState::Hole, 0, false, &mut |_| {});
            }
        }
        if let SnapshotChange::Delete { space } = *change {
            if self.snapshots.by_space(space).is_none() {
                return Ok(());
            }
            let older = self
                .snapshots
                .older_than(space)
                .map(|s| (s.space, s.version));
            self.map
                .load(self.media, space_key(space, 0), SPACE_BLOCKS)?;
            if let Some((older_space, _)) = older {
                self.map
                    .load(self.media, space_key(older_space, 0), SPACE_BLOCKS)?;
            }
            let mut kept = Vec::new();
            self.map
                .for_each_run(space_key(space, 0), SPACE_BLOCKS, |at, blocks, entry| {
                    if !entry.is_hole() {
                        kept.extend((0..blocks).map(|i| (Lba(at.0 + i), entry)));
                    }
                    std::ops::ControlFlow::Continue(())
                });
            for (key, entry) in kept {
                self.map.set(key, Slot::Hole, 0);
                if let Some((older_space, older_version)) = older {
                    let at = space_key(older_space, key_block(key.0));
                    if entry.version() < older_version && self.map.get(at).is_hole() {
                        self.map.set(at, entry.slot(), entry.version());
                    }
                }
            }
        }
        self.snapshots.apply(change);
        Ok(())
    }

    /// Rebuilds live bytes from the map; entries that point nowhere valid
    /// (only possible on a damaged image) become damaged markers.
    ///
    /// Also counts the references to each shared content, and settles
    /// what a crash may have left half done:
    /// - a block that holds a shared content directly (its reference
    ///   record was lost, unflushed, but a copy the cleaner wrote of the
    ///   shared member, naming the cell, was not) becomes shared: the cell
    ///   holds the content, once;
    /// - a cell nothing references any more (its last reference went after
    ///   the checkpoint) goes, without counting. The walk meets every
    ///   block's entry before any cell (cells' keys are higher), so the
    ///   counts are known when the cells are met;
    /// - a shared entry whose cell is missing (damage) becomes damaged.
    fn count_live_bytes(&mut self) -> Result<()> {
        let segment_size = self.media.geometry().segment_size_bytes;
        let cells = self.map.table_contents(self.media)?;
        let mut dangling = Vec::new();
        let mut orphans = Vec::new();
        let mut owners = Vec::new();
        let Recovery {
            media,
            map,
            infos,
            dump_segments,
            shared,
            ..
        } = self;
        map.for_each_stored(*media, |key, entry| {
            let slot = entry.slot();
            match table_content(key) {
                Some(content) => {
                    if entry.is_hole() {
                        return;
                    }
                    let moved_on = matches!(slot, Slot::Data(_)) && entry.version() != content;
                    if shared.count(content) == 0 || moved_on {
                        orphans.push(Lba(key));
                        return;
                    }
                }
                None => {
                    if let (Slot::Data(_), true) = (slot, cells.contains(&entry.version())) {
                        owners.push((Lba(key), entry.version()));
                        shared.add(entry.version());
                        return;
                    }
                }
            }
            match slot {
                Slot::Shared { content } => shared.add(content),
                Slot::Data(loc) => {
                    let valid = (loc.segment.0 as usize) < infos.len()
                        && !dump_segments.contains(&loc.segment)
                        && loc.offset as u64 + loc.len as u64 <= segment_size;
                    if valid {
                        infos[loc.segment.index()].live_bytes += loc.share();
                    } else {
                        dangling.push(Lba(key));
                    }
                }
                _ => {}
            }
        })?;
        for (lba, content) in owners {
            self.map.load(self.media, lba, 1)?;
            self.map.set(lba, Slot::Shared { content }, content);
        }
        for key in orphans {
            self.map.load(self.media, key, 1)?;
            self.map.set(key, Slot::Hole, 0);
        }
        for lba in &dangling {
            self.map.load(self.media, *lba, 1)?;
            let version = self.map.get(*lba).version();
            self.map.set(*lba, Slot::Damaged, version);
        }
        let mut lost = 0;
        if self
            .shared
            .iter()
            .any(|(content, _)| !cells.contains(&content))
        {
            // Shared entries naming a content with no cell: damage.
            let mut referrers = Vec::new();
            self.map.for_each_stored(self.media, |key, entry| {
                if let Slot::Shared { content } = entry.slot() {
                    if !cells.contains(&content) {
                        referrers.push((Lba(key), content, entry.version()));
                    }
                }
            })?;
            for (lba, content, version) in referrers {
                self.map.load(self.media, lba, 1)?;
                self.map.set(lba, Slot::Damaged, version);
                self.shared.remove(content);
                lost += 1;
            }
        }
        self.report.dangling_entries = dangling.len() as u64 + lost;
        Ok(())
    }

    /// Segments the crashed run was allowed to allocate but that recovery
    /// did not adopt may hold half-written leftovers: erases them (the
    /// caller syncs before anything else happens), so no later recovery can
    /// replay them.
    fn erase_leftovers(&mut self) -> Result<u64> {
        let segment_count = self.media.geometry().segment_count;
        let mut erased = 0;
        for &segment in &self.root.checkpoint.reserved_segments {
            if segment.0 < segment_count && self.infos[segment.index()].state == SegmentState::Free
            {
                self.media.erase_segment(segment)?;
                self.infos[segment.index()] = SegmentInfo::free();
                erased += 1;
            }
        }
        self.report.leftover_segments_erased = erased;
        Ok(erased)
    }

    /// Writes the staged sectors of the segments recovery adopted back in
    /// place (the caller syncs), so that this run's flushes may reuse the
    /// staging slots; returns how many differed from what was in place.
    fn restore_staged(&self) -> Result<u64> {
        let mut restored = 0;
        let mut laid = vec![0u8; crate::media::SECTOR_BYTES];
        let mut in_place = vec![0u8; crate::media::SECTOR_BYTES];
        for staged in &self.staged {
            if self.infos[staged.segment.index()].state == SegmentState::Free {
                continue;
            }
            self.media
                .read(staged.segment, staged.offset_bytes, &mut in_place)?;
            self.read(staged.segment, staged.offset_bytes, &mut laid)?;
            if laid != in_place {
                self.media.staging_required()?.restore_sectors(
                    staged.segment,
                    staged.offset_bytes,
                    &laid,
                )?;
                restored += 1;
            }
        }
        Ok(restored)
    }

    /// Settles every segment's state from the map and what replay kept.
    fn finish(mut self, writable: bool) -> Result<Recovered> {
        self.sweep_clone_spaces()?;
        let segment_size = self.media.geometry().segment_size_bytes;
        let mut holds_ranges = self.segments_holding_needed_ranges()?;
        holds_ranges.extend(self.snapshot_segments.iter().copied());
        self.map.compact();
        self.count_live_bytes()?;
        self.map.recount_table(self.media)?;
        for (index, info) in self.infos.iter_mut().enumerate() {
            let segment = SegmentId(index as u32);
            info.state = if self.dump_segments.contains(&segment) {
                SegmentState::Dump
            } else if info.live_bytes > 0 || holds_ranges.contains(&segment) {
                // A replayed segment's trims are needed until the next
                // checkpoint; the cleaner relocates them if it gets there
                // first. Dead data records are not needed: whatever
                // superseded them is live or is such a trim.
                SegmentState::Sealed
            } else {
                SegmentState::Free
            };
            info.holds_ranges = holds_ranges.contains(&segment);
            if info.state == SegmentState::Sealed && info.fill_bytes == 0 {
                info.fill_bytes = segment_size;
            }
            self.next_seq = self.next_seq.max(info.seq + 1);
            self.next_version = self.next_version.max(info.max_version + 1);
        }
        debug_assert!(
            self.infos
                .iter()
                .all(|info| info.live_bytes <= info.fill_bytes && info.seq < self.next_seq),
            "recovered segments outgrow what was written, or numbering would repeat"
        );
        if writable && !self.report.clean {
            let written = self.erase_leftovers()? + self.restore_staged()?;
            if written > 0 {
                self.media.sync()?;
            }
        }
        let mut segments = SegmentTable::from_infos(self.infos);
        self.map.for_each_data(self.media, |lba, loc, _| {
            segments.add_member(loc.segment, lba.0)
        })?;
        segments.seal_members();
        Ok(Recovered {
            roots: self.roots,
            map: self.map,
            shared: self.shared,
            snapshots: self.snapshots,
            segments,
            next_seq: self.next_seq,
            next_version: self.next_version,
            counters: self.counters,
            report: self.report,
            staged: self.staged,
        })
    }
}

/// `parts` (runs of keys, in order) less the keys in `gone` (sorted).
fn without_blocks(parts: Vec<(Lba, u64)>, gone: &[u64]) -> Vec<(Lba, u64)> {
    if gone.is_empty() {
        return parts;
    }
    let mut out = Vec::new();
    for (from, blocks) in parts {
        let mut start = from.0;
        let end = from.0 + blocks;
        let lo = gone.partition_point(|&key| key < start);
        for &key in gone[lo..].iter().take_while(|&&key| key < end) {
            if key > start {
                out.push((Lba(start), key - start));
            }
            start = key + 1;
        }
        if start < end {
            out.push((Lba(start), end - start));
        }
    }
    out
}

#[cfg(test)]
mod without_blocks_tests {
    use super::*;

    #[test]
    fn runs_lose_exactly_the_keys_named() {
        let parts = vec![(Lba(10), 5), (Lba(20), 3)];
        assert_eq!(without_blocks(parts.clone(), &[]), parts);
        assert_eq!(
            without_blocks(parts.clone(), &[10, 12, 14, 21, 30]),
            vec![(Lba(11), 1), (Lba(13), 1), (Lba(20), 1), (Lba(22), 1)]
        );
        assert_eq!(without_blocks(vec![(Lba(0), 2)], &[0, 1]), vec![]);
    }
}
