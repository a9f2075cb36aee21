//! The invariant checker, and repair.
//!
//! One checker serves unit tests, the crash simulator, fuzzers and
//! `zdisk check`. It verifies, against a quiescent volume:
//! - the map's running counts equal a recount;
//! - every segment's live bytes equal the bytes of map entries pointing into it;
//! - every data entry points into an open or sealed segment, inside its
//!   written part, and no two entries overlap;
//! - shared entries: every one names a content whose cell exists, every
//!   cell is named by at least one, and the volume's reference counts
//!   equal a recount; a damaged or unreadable shared record is reported
//!   for every block that shares it;
//! - the free list and segment states agree;
//! - with `verify_data`, every live extent decodes: right block, right
//!   version, checksum good, decompresses to one block: a map entry whose
//!   record cannot be found or verified is damage;
//! - recovery passed over no durable root: a root that decodes was
//!   written after its dump was synced, so a dump that cannot be read means
//!   records it named are gone (the medium was truncated, overwritten or
//!   rotted in both copies). Recovery falls back to the older root, whose
//!   map cannot name what only the newer one recorded, so this is reported
//!   as `lost`, never as clean.
//!
//! Blocks that fail data verification are listed by number. Repair drops
//! exactly those map entries (and entries already marked damaged), turning
//! them into holes, and never touches a readable block; it cannot bring
//! back what is `lost`.
//!
//! What no check can see: a whole log segment written after the newest
//! checkpoint that vanished (reads as never written) looks like one the
//! cleaner emptied, or like writes a crash lost before a flush; format v1
//! records nowhere which segments the log spans.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use crate::error::Result;
use crate::map::{key_block, key_space, table_content, Location, Slot, SPACE_BLOCKS, TABLE_BASE};
use crate::record::RecordKind;
use crate::segments::SegmentState;
use crate::units::{Lba, BLOCK_SIZE};

use super::io::{decode_into, Wanted, RANGE_RECORD_LEN};
use super::space::Writer;
use super::state::{keeps_in, State};
use super::Volume;

/// A live block: where its record is, its number and version.
type Extent = (Location, Lba, u64);

/// What a check found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckReport {
    /// Broken invariants: a bug or metadata damage.
    pub errors: Vec<String>,
    /// Blocks whose data cannot be read back intact.
    pub damaged_blocks: Vec<u64>,
    /// What a durable root says exists but could not be found: a
    /// checkpoint that recovery had to pass over for an older one (blocks
    /// written before it may be lost, and no map names them).
    pub lost: Vec<String>,
    pub extents_verified: u64,
    pub bytes_verified: u64,
    /// Blocks whose entries repair dropped (they now read as zeros).
    pub repaired_blocks: Vec<u64>,
    /// Lost checkpoints repair accepted: its new root replaces them.
    pub accepted_lost: Vec<String>,
}

impl CheckReport {
    pub fn is_clean(&self) -> bool {
        self.errors.is_empty() && self.damaged_blocks.is_empty() && self.lost.is_empty()
    }
}

impl Volume {
    /// Checks every invariant; with `verify_data`, also reads every live extent.
    pub fn check(&self, verify_data: bool) -> Result<CheckReport> {
        self.check_with_progress(verify_data, &mut |_, _| {})
    }

    /// [`Volume::check`], calling `progress(blocks_verified, blocks)` as
    /// the live blocks' data is verified.
    pub fn check_with_progress(
        &self,
        verify_data: bool,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<CheckReport> {
        let _maintenance = self.maintenance.lock().expect("maintenance lock poisoned");
        let mut report = CheckReport {
            lost: self.open_report().lost_checkpoints,
            ..CheckReport::default()
        };
        // Everything queued on the medium first: the checker reads it.
        self.wait_all_written();
        let state = self.lock_frozen();
        let media = &*self.media;
        // Reads every evicted leaf's page: that checks the map's pages.
        if let Err(problem) = state.map().check_counts_with(Some(media)) {
            report.errors.push(problem);
        }
        let mut extents: Vec<Extent> = Vec::new();
        let walked = state.map().for_each_data(media, |lba, loc, version| {
            extents.push((loc, lba, version));
        });
        if let Err(error) = walked {
            report.errors.push(format!("map: {error}"));
        }
        check_extents(&state, &mut extents, &mut report.errors);
        if let Err(error) = check_snapshots(&state, media, &mut report.errors) {
            report.errors.push(format!("map: {error}"));
        }
        check_segments(&state, &extents, &mut report.errors);
        let referrers = match check_shared(&state, media) {
            Ok((referrers, errors)) => {
                report.errors.extend(errors);
                referrers
            }
            Err(error) => {
                report.errors.push(format!("map: {error}"));
                HashMap::new()
            }
        };
        let walked = state
            .map()
            .for_each_damaged(media, |lba| report.damaged_blocks.push(lba.0));
        if let Err(error) = walked {
            report.errors.push(format!("map: {error}"));
        }
        if verify_data {
            self.verify_extents(&state, &extents, &mut report, progress)?;
        }
        // A damaged cell is reported as every block that shares it.
        report.damaged_blocks = std::mem::take(&mut report.damaged_blocks)
            .into_iter()
            .flat_map(|key| match table_content(key) {
                Some(content) => referrers.get(&content).cloned().unwrap_or_default(),
                None => vec![key],
            })
            .collect();
        report.damaged_blocks.sort_unstable();
        report.damaged_blocks.dedup();
        Ok(report)
    }

    /// Reads every live record back once and verifies it (right blocks,
    /// right versions, checksum good, decompresses to its blocks).
    /// `extents` is sorted by location.
    fn verify_extents(
        &self,
        state: &State,
        extents: &[Extent],
        report: &mut CheckReport,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<()> {
        let total = extents.len() as u64;
        let mut start = 0;
        while start < extents.len() {
            progress(start as u64, total);
            let key = extents[start].0.record_key();
            let end = start
                + extents[start..]
                    .iter()
                    .take_while(|(loc, _, _)| loc.record_key() == key)
                    .count();
            self.verify_record(state, &extents[start..end], report)?;
            start = end;
        }
        progress(total, total);
        Ok(())
    }

    /// Verifies one record, `members` being its live blocks.
    fn verify_record(
        &self,
        state: &State,
        members: &[Extent],
        report: &mut CheckReport,
    ) -> Result<()> {
        let loc = members[0].0;
        let read = match state.read_buffered(loc)? {
            Some(buffered) => buffered.complete(&*self.media),
            None => {
                let mut bytes = vec![0u8; loc.len as usize];
                self.media
                    .read(loc.segment, loc.offset as u64, &mut bytes)
                    .map(|()| bytes)
            }
        };
        let Ok(bytes) = read else {
            report
                .damaged_blocks
                .extend(members.iter().map(|(_, lba, _)| lba.0));
            return Ok(());
        };
        report.extents_verified += members.len() as u64;
        report.bytes_verified += loc.len as u64;
        // Blocks are placed by their member number, from the unit's first
        // block as its direct members say (a cell's key says nothing of it).
        let direct = members
            .iter()
            .find(|(_, key, _)| table_content(key.0).is_none());
        let base = match direct {
            Some(&(loc, lba, _)) => match key_block(lba.0).checked_sub(loc.member as u64) {
                Some(base) => base,
                None => {
                    report.damaged_blocks.push(lba.0);
                    return Ok(());
                }
            },
            None => 0,
        };
        let mut wanted = Vec::with_capacity(members.len());
        let mut keys = Vec::with_capacity(members.len());
        for &(loc, key, version) in members {
            // A snapshot's kept entry may lie under another key than the
            // record names: versions are never reused, so the version
            // alone says the record holds it.
            let cell = table_content(key.0).is_some();
            let shared = cell || key.0 >= SPACE_BLOCKS;
            if cell || key_block(key.0).checked_sub(base) == Some(loc.member as u64) {
                wanted.push(Wanted {
                    index: loc.member as usize,
                    loc,
                    version,
                    shared,
                });
                keys.push(key.0);
            } else {
                report.damaged_blocks.push(key.0);
            }
        }
        let mut blocks = vec![0u8; loc.members as usize * BLOCK_SIZE];
        let mut failed = Vec::new();
        decode_into(
            &self.record_key,
            Lba(base),
            &bytes,
            &wanted,
            &mut blocks,
            &mut failed,
        );
        report
            .damaged_blocks
            .extend(failed.iter().filter_map(|(index, _)| {
                wanted
                    .iter()
                    .position(|w| w.index == *index)
                    .map(|at| keys[at])
            }));
        Ok(())
    }

    /// Checks with data verification, then drops the map entries of every
    /// damaged block (they become holes). Returns the report with
    /// `repaired_blocks` filled in; the change is durable when this returns.
    pub fn repair(&self) -> Result<CheckReport> {
        self.repair_with_progress(&mut |_, _| {})
    }

    /// [`Volume::repair`], reporting the check's progress as
    /// [`Volume::check_with_progress`] does.
    pub fn repair_with_progress(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<CheckReport> {
        let mut report = self.check_with_progress(true, progress)?;
        if !self.read_only && !report.lost.is_empty() {
            // The checkpoint below replaces the lost root: from then on
            // the volume is what recovery found, consistently.
            report.accepted_lost = std::mem::take(&mut report.lost);
            if report.damaged_blocks.is_empty() {
                self.checkpoint()?;
            }
        }
        if self.read_only || report.damaged_blocks.is_empty() {
            return Ok(report);
        }
        for &lba in &report.damaged_blocks {
            let (mut state, floor) =
                self.admit(Writer::Range, (Lba(lba), 1), RANGE_RECORD_LEN, 1)?;
            let kept =
                (SPACE_BLOCKS..TABLE_BASE).contains(&lba) && state.host_volume(Lba(lba)).is_none();
            if kept {
                // A snapshot's kept entry: marked damaged at its version
                // (a trim there would be a write to no volume).
                state.mark_damaged(Lba(lba))?;
            } else {
                state.apply_range(RecordKind::Trim, Lba(lba), 1, floor)?;
            }
        }
        report.repaired_blocks = std::mem::take(&mut report.damaged_blocks);
        self.checkpoint()?;
        let after = self.check(false)?;
        report.errors = after.errors;
        Ok(report)
    }
}

/// Every data entry points into an open or sealed segment, inside its
/// written part, and no two overlap. Sorts `extents` by location.
fn check_extents(state: &State, extents: &mut [Extent], errors: &mut Vec<String>) {
    let table = state.space().table();
    for &(loc, lba, _) in extents.iter() {
        if loc.segment.index() >= table.len() {
            errors.push(format!(
                "block {lba} points at segment {} beyond the medium",
                loc.segment
            ));
            continue;
        }
        let info = table.get(loc.segment);
        if !matches!(info.state, SegmentState::Open | SegmentState::Sealed) {
            errors.push(format!(
                "block {lba} points into segment {} which is {:?}",
                loc.segment, info.state
            ));
        }
        if loc.offset as u64 + loc.len as u64 > info.fill_bytes {
            errors.push(format!(
                "block {lba} extends past the written part of segment {} ({} + {} > {})",
                loc.segment, loc.offset, loc.len, info.fill_bytes
            ));
        }
    }
    extents.sort_by_key(|(loc, _, _)| (loc.segment, loc.offset, loc.member));
    for pair in extents.windows(2) {
        let ((a, a_lba, _), (b, b_lba, _)) = (pair[0], pair[1]);
        if a.record_key() == b.record_key() {
            // Two blocks of one unit: same record, different places in it,
            // counted from the same first block.
            // (A cell's key says nothing of the unit's first block.)
            // A snapshot's kept entry counts by its block.
            let cell = table_content(a_lba.0).is_some() || table_content(b_lba.0).is_some();
            let same_unit = a.len == b.len
                && a.members == b.members
                && a.member < b.member
                && (cell
                    || key_block(a_lba.0).checked_sub(a.member as u64)
                        == key_block(b_lba.0).checked_sub(b.member as u64));
            if !same_unit {
                errors.push(format!(
                    "blocks {a_lba} and {b_lba} claim one record in segment {} differently \
                     ({a:?} and {b:?})",
                    a.segment
                ));
            }
        } else if a.segment == b.segment && a.offset + a.len > b.offset {
            errors.push(format!(
                "blocks {a_lba} and {b_lba} overlap in segment {}",
                a.segment
            ));
        }
    }
}

/// Live bytes equal what the map references; the free list, the open
/// streams and the dumps of the retained roots agree with segment states.
fn check_segments(state: &State, extents: &[Extent], errors: &mut Vec<String>) {
    let table = state.space().table();
    let mut live = vec![0u64; table.len()];
    for &(loc, _, _) in extents {
        if let Some(bytes) = live.get_mut(loc.segment.index()) {
            *bytes += loc.share();
        }
    }
    let mut free = 0;
    for (segment, info) in table.iter() {
        if info.live_bytes != live[segment.index()] {
            errors.push(format!(
                "segment {segment}: live bytes {} but the map references {}",
                info.live_bytes,
                live[segment.index()]
            ));
        }
        if info.state == SegmentState::Free {
            free += 1;
        }
    }
    if free != table.free_count() {
        errors.push(format!(
            "{free} segments are free but the free list holds {}",
            table.free_count()
        ));
    }
    for (kind, stream) in state.streams().iter().enumerate() {
        if let Some(segment) = stream.segment {
            if table.get(segment).state != SegmentState::Open {
                errors.push(format!(
                    "stream {kind} writes into segment {segment} which is not open"
                ));
            }
        }
    }
    let dump_segments: HashSet<_> = state
        .roots()
        .iter()
        .flatten()
        .filter_map(|root| root.dump.as_ref())
        .flat_map(|dump| dump.segments())
        // A released dump a map fault still reads (`map/fault.rs`).
        .chain(state.map().deferred_dump_segments())
        .collect();
    for &segment in &dump_segments {
        if table.get(segment).state != SegmentState::Dump {
            errors.push(format!(
                "checkpoint segment {segment} is not marked as such"
            ));
        }
    }
    // Every clean leaf's page lies in a segment the newest root lists (the
    // map's pages before its first checkpoint lie nowhere).
    let newest = state.roots()[(state.generation() % 2) as usize]
        .as_ref()
        .and_then(|root| root.dump.as_ref());
    if let Some(newest) = newest {
        let listed: HashSet<_> = newest.copies[0].iter().copied().collect();
        for segment in state.map().page_bytes_by_segment().keys() {
            if !listed.contains(segment) {
                errors.push(format!(
                    "a map page lies in segment {segment}, which the newest root does not list"
                ));
            }
        }
    }
    for (segment, info) in table.iter() {
        if info.state == SegmentState::Dump && !dump_segments.contains(&segment) {
            errors.push(format!(
                "segment {segment} is marked as a checkpoint but no root uses it"
            ));
        }
    }
}

/// Every entry in a snapshot's key space belongs to a snapshot that sees
/// it: data, shared data or damage (or a zero, for a clone's snapshot),
/// older than the snapshot, for a block of the volume. Every entry in a
/// clone's key space is newer than the clone. No other key space holds
/// entries.
fn check_snapshots(
    state: &State,
    media: &dyn crate::media::Media,
    errors: &mut Vec<String>,
) -> Result<()> {
    let snapshots = state.snapshots();
    let logical = state.logical_blocks();
    state.map().for_each_stored(media, |key, entry| {
        if !(SPACE_BLOCKS..TABLE_BASE).contains(&key) || entry.is_hole() {
            return;
        }
        let space = key_space(key).expect("a block key");
        let block = key_block(key);
        if block >= logical {
            errors.push(format!(
                "key space {space} has an entry for block {block}, beyond the volume"
            ));
        }
        if let Some(clone) = snapshots.clone_by_space(space) {
            if entry.version() <= clone.version {
                errors.push(format!(
                    "clone {} (made at version {}) holds block {block} at older version {}",
                    clone.name,
                    clone.version,
                    entry.version()
                ));
            }
            return;
        }
        let Some(snapshot) = snapshots.by_space(space) else {
            errors.push(format!(
                "block {block} has an entry in key space {space}, which no snapshot or clone owns"
            ));
            return;
        };
        if !keeps_in(snapshot.volume, entry) {
            errors.push(format!(
                "snapshot {} keeps {:?} for block {block}",
                snapshot.name,
                entry.slot()
            ));
        } else if entry.version() >= snapshot.version {
            errors.push(format!(
                "snapshot {} (version {}) keeps block {block} at version {}, which it cannot see",
                snapshot.name,
                snapshot.version,
                entry.version()
            ));
        }
    })
}

/// The blocks sharing each content.
type Referrers = HashMap<u64, Vec<u64>>;

/// Shared entries against the shared table and the volume's counts:
/// returns the blocks sharing each content, and the errors found.
fn check_shared(
    state: &State,
    media: &dyn crate::media::Media,
) -> Result<(Referrers, Vec<String>)> {
    let mut errors = Vec::new();
    let mut referrers: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut cells: HashMap<u64, Slot> = HashMap::new();
    let shared = state.shared();
    state.map().for_each_stored(media, |key, entry| {
        match (table_content(key), entry.slot()) {
            (Some(_), Slot::Hole) => {}
            (Some(content), Slot::Data(_)) if entry.version() != content => errors.push(format!(
                "the cell of shared content {content} holds version {}",
                entry.version()
            )),
            (Some(content), slot @ (Slot::Data(_) | Slot::Damaged)) => {
                cells.insert(content, slot);
            }
            (Some(content), slot) => {
                errors.push(format!("the cell of shared content {content} is {slot:?}"))
            }
            (None, Slot::Shared { content }) => referrers.entry(content).or_default().push(key),
            // A shared content has one direct referrer: its cell.
            (None, Slot::Data(_)) if shared.count(entry.version()) > 0 => errors.push(format!(
                "block {key} holds shared content {} directly",
                entry.version()
            )),
            (None, _) => {}
        }
    })?;
    for (&content, blocks) in &referrers {
        if !cells.contains_key(&content) {
            errors.push(format!(
                "blocks {:?} share content {content}, which has no cell",
                &blocks[..blocks.len().min(8)]
            ));
        }
        if shared.count(content) as usize != blocks.len() {
            errors.push(format!(
                "content {content} has {} references but {} blocks share it",
                shared.count(content),
                blocks.len()
            ));
        }
    }
    for &content in cells.keys() {
        if !referrers.contains_key(&content) {
            errors.push(format!(
                "shared content {content} has a cell but no block shares it"
            ));
        }
    }
    if shared.contents() as usize != referrers.len() {
        errors.push(format!(
            "{} contents are counted as shared but {} are",
            shared.contents(),
            referrers.len()
        ));
    }
    Ok((referrers, errors))
}
