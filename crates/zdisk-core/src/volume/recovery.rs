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
//! A clean root (written by a clean shutdown) has nothing after it, so the
//! log is not scanned at all.

use std::collections::HashSet;
use std::time::Duration;

use serde::Serialize;

use crate::dump::load_dump;
use crate::error::Result;
use crate::map::{Location, Map, RangeState, Slot};
use crate::media::Media;
use crate::meta::Root;
use crate::record::{decode_record, range_count, RecordKey, RecordKind, HEADER_SIZE};
use crate::segments::{SegmentInfo, SegmentState, SegmentTable};
use crate::stats::Counters;
use crate::units::{Lba, SegmentId, BLOCK_SIZE_U64};

use super::scan::scan_segment;
use super::state::RetainedRoot;

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
    /// Metadata slots that did not decode (a torn root write leaves one).
    pub slot_problems: Vec<String>,
    /// Map entries that pointed outside the log and were marked damaged.
    pub dangling_entries: u64,
    /// Reserved segments erased because the crashed run may have left
    /// half-written records in them.
    pub leftover_segments_erased: u64,
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
    pub segments: SegmentTable,
    pub next_seq: u64,
    pub next_version: u64,
    pub counters: Counters,
    pub report: OpenReport,
}

/// The full sequence number of a segment whose records carry `seq32`, if
/// it was opened at or after `boundary`.
fn seq_at_or_after(boundary: u64, seq32: u32) -> Option<u64> {
    let diff = seq32.wrapping_sub(boundary as u32) as i32;
    (diff >= 0).then(|| boundary + diff as u64)
}

fn retained(root: &Root) -> RetainedRoot {
    RetainedRoot {
        generation: root.generation,
        boundary: root.checkpoint.seq_boundary,
        open: root.checkpoint.open_segments.clone(),
        dump: root.checkpoint.dump.clone(),
    }
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
    let geometry = media.geometry();
    let segment_size = geometry.segment_size_bytes;
    let page_size = geometry.page_size_bytes as u64;
    let logical_blocks = root.superblock.logical_size_bytes / BLOCK_SIZE_U64;
    let key = RecordKey(root.superblock.uuid);
    let checkpoint = &root.checkpoint;
    let clean = checkpoint.clean && trust_clean;
    let mut report = OpenReport {
        clean,
        root_generation: root.generation,
        ..OpenReport::default()
    };
    let mut map = Map::new(true);
    let dumped = match &checkpoint.dump {
        Some(dump) => load_dump(media, &key, dump, logical_blocks, &mut map)?,
        None => vec![None; geometry.segment_count as usize],
    };
    let mut roots: [Option<RetainedRoot>; 2] = [None, None];
    roots[root.slot()] = Some(retained(root));
    if let Some(older) = older.filter(|o| o.generation < root.generation && o.slot() != root.slot())
    {
        roots[older.slot()] = Some(retained(older));
    }
    // Segments of every retained dump: never replayed, never reused.
    let dump_segments: HashSet<SegmentId> = roots
        .iter()
        .flatten()
        .filter_map(|r| r.dump.as_ref())
        .flat_map(|d| d.segments())
        .filter(|s| s.0 < geometry.segment_count)
        .collect();
    let mut infos: Vec<SegmentInfo> = dumped
        .iter()
        .map(|dumped| SegmentInfo {
            state: SegmentState::Free,
            seq: dumped.map_or(0, |d| d.seq),
            live_bytes: 0,
            fill_bytes: dumped.map_or(0, |d| d.fill_bytes.min(segment_size)),
            max_version: dumped.map_or(0, |d| d.max_version),
            holds_ranges: false,
            range_bytes: 0,
            killed_gen: 0,
        })
        .collect();
    let mut counters = checkpoint.counters;
    // Continue past everything the crashed run may have written.
    let mut next_seq = checkpoint.next_seq.max(checkpoint.seq_reserved);
    let mut next_version = checkpoint.next_version.max(checkpoint.version_reserved);
    let boundary = checkpoint.seq_boundary;
    // Range records replayed: (segment seq, segment, first block, count, version).
    let mut ranges: Vec<(u64, SegmentId, u64, u64, u64)> = Vec::new();

    if !clean {
        // Find the segments to replay: (seq, segment, start offset).
        let mut plan: Vec<(u64, SegmentId, u64)> = Vec::new();
        let mut head = vec![0u8; (HEADER_SIZE + 4096).min(segment_size as usize)];
        for index in 0..geometry.segment_count {
            let segment = SegmentId(index);
            if dump_segments.contains(&segment) {
                continue;
            }
            media.read(segment, 0, &mut head)?;
            let seg_seq = match decode_record(&head, &key, None) {
                Ok((header, _)) => header.seg_seq,
                // Never written, or erased.
                Err(_) if crate::meta::is_blank(&head) => continue,
                // The first record is torn or damaged: look further in.
                Err(_) => {
                    let mut bytes = vec![0u8; segment_size as usize];
                    media.read(segment, 0, &mut bytes)?;
                    match first_record_seq(&bytes, &key) {
                        Some(seq) => seq,
                        None => continue,
                    }
                }
            };
            if let Some(open) = checkpoint
                .open_segments
                .iter()
                .find(|open| open.segment == segment && open.seq as u32 == seg_seq)
            {
                plan.push((open.seq, segment, open.offset_bytes));
            } else if let Some(seq) = seq_at_or_after(boundary, seg_seq) {
                plan.push((seq, segment, 0));
            }
        }
        plan.sort();
        let mut versions_seen = HashSet::new();
        let mut bytes = vec![0u8; segment_size as usize];
        for (seq, segment, start) in plan {
            media.read(segment, 0, &mut bytes)?;
            let scan = scan_segment(&bytes, start, seq as u32, page_size, &key);
            for (offset, error) in &scan.damaged {
                report.replay_damage.push(format!(
                    "segment {segment} (seq {seq}) at offset {offset}: {error}"
                ));
            }
            report.replayed_segments += 1;
            let info = &mut infos[segment.index()];
            info.seq = seq;
            info.fill_bytes = scan.end_offset.max(start);
            counters.media_write_bytes += scan.end_offset.saturating_sub(start);
            next_seq = next_seq.max(seq + 1);
            for record in &scan.records {
                let header = record.header;
                let payload = &bytes[record.payload.clone()];
                if header.version > crate::map::VERSION_MAX {
                    // Only damage or a forgery gets past the checksum
                    // with this; the map cannot hold it.
                    report.replay_damage.push(format!(
                        "segment {segment} (seq {seq}) at offset {}: version {} out of range",
                        record.offset, header.version
                    ));
                    continue;
                }
                next_version = next_version.max(header.version + 1);
                let info = &mut infos[segment.index()];
                info.max_version = info.max_version.max(header.version);
                match header.kind {
                    RecordKind::Data => {
                        if header.lba >= logical_blocks {
                            continue;
                        }
                        report.replayed_records += 1;
                        let loc = Location {
                            segment,
                            offset: record.offset as u32,
                            len: header.record_len() as u32,
                        };
                        map.set_if_newer(Lba(header.lba), Slot::Data(loc), header.version);
                        if header.version >= checkpoint.next_version
                            && versions_seen.insert(header.version)
                        {
                            counters.host_write_bytes += BLOCK_SIZE_U64;
                        }
                    }
                    RecordKind::Trim | RecordKind::Zero | RecordKind::Damaged => {
                        let count = range_count(payload);
                        if count == 0
                            || header
                                .lba
                                .checked_add(count)
                                .is_none_or(|end| end > logical_blocks)
                        {
                            continue;
                        }
                        report.replayed_records += 1;
                        ranges.push((seq, segment, header.lba, count, header.version));
                        let state = match header.kind {
                            RecordKind::Trim => RangeState::Hole,
                            RecordKind::Zero => RangeState::Zero,
                            _ => RangeState::Damaged,
                        };
                        map.set_range(
                            Lba(header.lba),
                            count,
                            state,
                            header.version,
                            true,
                            &mut |_| {},
                        );
                    }
                    RecordKind::MapChunk => {}
                }
            }
        }
        if report.replayed_records > 0 {
            counters.recoveries += 1;
        }
    }
    // Until the next checkpoint is durable, a replay from the current one
    // needs every range record that still determines some block. Keep the
    // segments holding one copy of each (the cleaner may have left stale
    // copies behind in segments it had already freed).
    let mut holds_ranges: HashSet<SegmentId> = HashSet::new();
    let mut kept_versions: HashSet<u64> = HashSet::new();
    ranges.sort_by(|a, b| b.cmp(a));
    for &(_, segment, first, count, version) in &ranges {
        if kept_versions.contains(&version) && !holds_ranges.contains(&segment) {
            continue;
        }
        if map.any_at_version(Lba(first), count, version) {
            holds_ranges.insert(segment);
            kept_versions.insert(version);
        }
    }
    map.compact();

    // Rebuild live bytes from the map; entries that point nowhere valid
    // (only possible on a damaged image) become damaged markers.
    let mut dangling = Vec::new();
    map.for_each_data(|lba, loc, _| {
        let valid = (loc.segment.0 as usize) < infos.len()
            && !dump_segments.contains(&loc.segment)
            && loc.offset as u64 + loc.len as u64 <= segment_size;
        if valid {
            infos[loc.segment.index()].live_bytes += loc.len as u64;
        } else {
            dangling.push(lba);
        }
    });
    for lba in &dangling {
        let version = map.get(*lba).version();
        map.set(*lba, Slot::Damaged, version);
    }
    report.dangling_entries = dangling.len() as u64;

    for (index, info) in infos.iter_mut().enumerate() {
        let segment = SegmentId(index as u32);
        info.state = if dump_segments.contains(&segment) {
            SegmentState::Dump
        } else if info.live_bytes > 0 || holds_ranges.contains(&segment) {
            // A replayed segment's trims are needed until the next
            // checkpoint; the cleaner relocates them if it gets there first.
            // Dead data records are not needed: whatever superseded them is
            // live or is such a trim.
            SegmentState::Sealed
        } else {
            SegmentState::Free
        };
        info.holds_ranges = holds_ranges.contains(&segment);
        if info.state == SegmentState::Sealed && info.fill_bytes == 0 {
            info.fill_bytes = segment_size;
        }
        next_seq = next_seq.max(info.seq + 1);
        next_version = next_version.max(info.max_version + 1);
    }
    // Segments the crashed run was allowed to allocate but that recovery
    // did not adopt may hold half-written leftovers: erase them, durably,
    // before anything else happens, so no later recovery can replay them.
    if writable && !clean {
        let mut erased = 0;
        for &segment in &checkpoint.reserved_segments {
            if segment.0 < geometry.segment_count
                && infos[segment.index()].state == SegmentState::Free
            {
                media.erase_segment(segment)?;
                infos[segment.index()] = SegmentInfo {
                    state: SegmentState::Free,
                    seq: 0,
                    live_bytes: 0,
                    fill_bytes: 0,
                    max_version: 0,
                    holds_ranges: false,
                    range_bytes: 0,
                    killed_gen: 0,
                };
                erased += 1;
            }
        }
        if erased > 0 {
            media.sync()?;
        }
        report.leftover_segments_erased = erased;
    }
    let mut segments = SegmentTable::from_infos(infos);
    map.for_each_data(|lba, loc, _| segments.add_member(loc.segment, lba.0));
    Ok(Recovered {
        roots,
        map,
        segments,
        next_seq,
        next_version,
        counters,
        report,
    })
}
