//! The invariant checker, and repair.
//!
//! One checker serves unit tests, the crash simulator, fuzzers and
//! `zdisk check`. It verifies, against a quiescent volume:
//! - the map's running counts equal a recount;
//! - every segment's live bytes equal the bytes of map entries pointing into it;
//! - every data entry points into an open or sealed segment, inside its
//!   written part, and no two entries overlap;
//! - the free list and segment states agree;
//! - with `verify_data`, every live extent decodes: right block, right
//!   version, checksum good, decompresses to one block.
//!
//! Blocks that fail data verification are listed by number. Repair drops
//! exactly those map entries (and entries already marked damaged), turning
//! them into holes, and never touches a readable block.

use serde::Serialize;

use crate::error::Result;
use crate::map::Location;
use crate::segments::SegmentState;
use crate::units::{Lba, BLOCK_SIZE};

use super::io::{append_range, decode_block};
use super::Volume;

/// What a check found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckReport {
    /// Broken invariants: a bug or metadata damage.
    pub errors: Vec<String>,
    /// Blocks whose data cannot be read back intact.
    pub damaged_blocks: Vec<u64>,
    pub extents_verified: u64,
    pub bytes_verified: u64,
    /// Blocks whose entries repair dropped (they now read as zeros).
    pub repaired_blocks: Vec<u64>,
}

impl CheckReport {
    pub fn is_clean(&self) -> bool {
        self.errors.is_empty() && self.damaged_blocks.is_empty()
    }
}

impl Volume {
    /// Checks every invariant; with `verify_data`, also reads every live extent.
    pub fn check(&self, verify_data: bool) -> Result<CheckReport> {
        let _maintenance = self.maintenance.lock().expect("maintenance lock poisoned");
        let mut report = CheckReport::default();
        let state = self.lock();
        if let Err(problem) = state.map.check_counts() {
            report.errors.push(problem);
        }
        let segment_count = state.segments.len();
        let mut live = vec![0u64; segment_count];
        let mut extents: Vec<(Location, Lba, u64)> = Vec::new();
        state.map.for_each_data(|lba, loc, version| {
            extents.push((loc, lba, version));
        });
        for &(loc, lba, _) in &extents {
            if loc.segment.index() >= segment_count {
                report.errors.push(format!(
                    "block {lba} points at segment {} beyond the medium",
                    loc.segment
                ));
                continue;
            }
            live[loc.segment.index()] += loc.len as u64;
            let info = state.segments.get(loc.segment);
            if !matches!(info.state, SegmentState::Open | SegmentState::Sealed) {
                report.errors.push(format!(
                    "block {lba} points into segment {} which is {:?}",
                    loc.segment, info.state
                ));
            }
            if loc.offset as u64 + loc.len as u64 > info.fill_bytes {
                report.errors.push(format!(
                    "block {lba} extends past the written part of segment {} ({} + {} > {})",
                    loc.segment, loc.offset, loc.len, info.fill_bytes
                ));
            }
        }
        extents.sort_by_key(|(loc, _, _)| (loc.segment, loc.offset));
        for pair in extents.windows(2) {
            let (a, b) = (pair[0].0, pair[1].0);
            if a.segment == b.segment && a.offset + a.len > b.offset {
                report.errors.push(format!(
                    "blocks {} and {} overlap in segment {}",
                    pair[0].1, pair[1].1, a.segment
                ));
            }
        }
        let mut free = 0;
        for (segment, info) in state.segments.iter() {
            if info.live_bytes != live[segment.index()] {
                report.errors.push(format!(
                    "segment {segment}: live bytes {} but the map references {}",
                    info.live_bytes,
                    live[segment.index()]
                ));
            }
            if info.state == SegmentState::Free {
                free += 1;
            }
        }
        if free != state.segments.free_count() {
            report.errors.push(format!(
                "{free} segments are free but the free list holds {}",
                state.segments.free_count()
            ));
        }
        for (kind, stream) in state.streams.iter().enumerate() {
            if let Some(segment) = stream.segment {
                if state.segments.get(segment).state != SegmentState::Open {
                    report.errors.push(format!(
                        "stream {kind} writes into segment {segment} which is not open"
                    ));
                }
            }
        }
        for dump in state
            .roots
            .iter()
            .flatten()
            .filter_map(|root| root.dump.as_ref())
        {
            for segment in dump.segments() {
                if state.segments.get(segment).state != SegmentState::Dump {
                    report.errors.push(format!(
                        "checkpoint segment {segment} is not marked as such"
                    ));
                }
            }
        }
        let dump_segments: std::collections::HashSet<_> = state
            .roots
            .iter()
            .flatten()
            .filter_map(|root| root.dump.as_ref())
            .flat_map(|dump| dump.segments())
            .collect();
        for (segment, info) in state.segments.iter() {
            if info.state == SegmentState::Dump && !dump_segments.contains(&segment) {
                report.errors.push(format!(
                    "segment {segment} is marked as a checkpoint but no root uses it"
                ));
            }
        }
        state
            .map
            .for_each_damaged(|lba| report.damaged_blocks.push(lba.0));
        if verify_data {
            let mut block = vec![0u8; BLOCK_SIZE];
            for &(loc, lba, version) in &extents {
                let bytes = match state.read_buffered(loc)? {
                    Some(bytes) => bytes,
                    None => {
                        let mut bytes = vec![0u8; loc.len as usize];
                        if self
                            .media
                            .read(loc.segment, loc.offset as u64, &mut bytes)
                            .is_err()
                        {
                            report.damaged_blocks.push(lba.0);
                            continue;
                        }
                        bytes
                    }
                };
                report.extents_verified += 1;
                report.bytes_verified += loc.len as u64;
                if decode_block(&self.record_key, lba, version, &bytes, loc, &mut block).is_err() {
                    report.damaged_blocks.push(lba.0);
                }
            }
        }
        report.damaged_blocks.sort_unstable();
        report.damaged_blocks.dedup();
        Ok(report)
    }

    /// Checks with data verification, then drops the map entries of every
    /// damaged block (they become holes). Returns the report with
    /// `repaired_blocks` filled in; the change is durable when this returns.
    pub fn repair(&self) -> Result<CheckReport> {
        let mut report = self.check(true)?;
        if self.read_only || report.damaged_blocks.is_empty() {
            return Ok(report);
        }
        for &lba in &report.damaged_blocks {
            let (mut state, floor) = self.lock_with_room(super::io::RANGE_RECORD_LEN, None)?;
            append_range(
                &mut state,
                crate::record::RecordKind::Trim,
                Lba(lba),
                1,
                floor,
            )?;
        }
        report.repaired_blocks = std::mem::take(&mut report.damaged_blocks);
        self.checkpoint()?;
        let after = self.check(false)?;
        report.errors = after.errors;
        Ok(report)
    }
}
