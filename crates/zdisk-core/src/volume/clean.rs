//! The segment cleaner (garbage collector).
//!
//! One step: pick a sealed victim by policy, read it whole, and relocate its
//! live records into the GC stream unchanged — same payload, same codec,
//! same version — so a relocated copy can never override a newer write
//! during recovery (equal versions mean equal data). Range records (trim,
//! zero, damaged) in a victim written after the durable checkpoint are
//! relocated too, because recovery from that checkpoint still needs them.
//!
//! The victim becomes `Reclaimable`, not free: it is erased and reused only
//! after a barrier and a sync have made the relocated copies, and every
//! write that made its other records dead, durable.
//!
//! Damage found while cleaning is never laundered into a fresh checksum:
//! a live record that fails verification becomes a `Damaged` map entry
//! (reads fail with EIO) backed by a `Damaged` record in the log.

use crate::error::Result;
use crate::gc::GcPolicy;
use crate::map::{Location, Slot};
use crate::record::{decode_record, RecordHeader, RecordKind};
use crate::segments::SegmentState;
use crate::units::{Lba, SegmentId};

use super::scan::scan_segment;
use super::state::{State, StreamKind};
use super::Volume;

/// Room kept for small records a cleaning step may add beyond the live
/// data it relocates (damage markers).
const RELOCATION_SLACK_BYTES: u64 = 256;

/// A release generation that no barrier reaches: set while a checkpoint
/// must come first.
const AFTER_CHECKPOINT: u64 = u64::MAX;

/// The best victim under `policy` with at least `min_garbage_bytes` reclaimable.
pub(crate) fn pick_victim(
    state: &State,
    policy: GcPolicy,
    min_garbage_bytes: u64,
) -> Option<SegmentId> {
    let segment_size = state.segment_size();
    let now = state.next_version;
    let mut best: Option<(SegmentId, f64)> = None;
    for (segment, info) in state.segments.iter() {
        if info.state != SegmentState::Sealed {
            continue;
        }
        let garbage = segment_size - info.live_bytes;
        if garbage < min_garbage_bytes.max(1) {
            continue;
        }
        let age = now.saturating_sub(info.max_version);
        let Some(score) = policy.score(info.live_bytes, segment_size, age) else {
            continue;
        };
        if best.is_none_or(|(_, s)| score > s) {
            best = Some((segment, score));
        }
    }
    best.map(|(segment, _)| segment)
}

fn relocate(state: &mut State, header: RecordHeader, payload: &[u8]) -> Result<Location> {
    let loc = state.append(StreamKind::Gc, header, payload, crc32c::crc32c(payload), 0)?;
    state.counters.gc_write_bytes += loc.len as u64;
    Ok(loc)
}

/// Replaces a damaged block's entry with a `Damaged` marker, logged so it
/// survives restarts.
pub(crate) fn mark_damaged(state: &mut State, lba: Lba) -> Result<()> {
    let version = state.take_version();
    let payload = 1u64.to_le_bytes();
    let header = RecordHeader {
        kind: RecordKind::Damaged,
        codec: 0,
        seg_seq: 0,
        lba: lba.0,
        version,
        payload_len: payload.len() as u32,
        crc: 0,
    };
    state.append(
        StreamKind::Gc,
        header,
        &payload,
        crc32c::crc32c(&payload),
        0,
    )?;
    let old = state.map.set(lba, Slot::Damaged, version);
    if let Slot::Data(loc) = old.slot() {
        state.release_location(loc);
    }
    state.counters.damaged_blocks_found += 1;
    Ok(())
}

impl Volume {
    /// Garbage a victim must hold for a writer waiting on space to clean
    /// it. More than the tail a full segment always wastes (under one raw
    /// record), so that a volume whose only "garbage" is such tails reports
    /// ENOSPC instead of copying segments around to gain nothing.
    pub(crate) fn foreground_min_garbage(&self) -> u64 {
        2 * crate::record::RAW_RECORD_LEN
    }

    /// Cleans one victim with at least `min_garbage_bytes` of reclaimable
    /// space. Returns false if there is none, or no room to relocate into.
    pub fn clean_one(&self, min_garbage_bytes: u64) -> Result<bool> {
        if self.read_only {
            return Ok(false);
        }
        let _maintenance = self.maintenance.lock().expect("maintenance lock poisoned");
        self.clean_one_locked(min_garbage_bytes)
    }

    pub(crate) fn clean_one_locked(&self, min_garbage_bytes: u64) -> Result<bool> {
        let page_size = self.geometry.page_size_bytes as u64;
        let (victim, seq, fill_bytes, post_checkpoint) = {
            let state = self.lock();
            state.check_writable()?;
            let Some(mut victim) = pick_victim(&state, self.settings.gc_policy, min_garbage_bytes)
            else {
                return Ok(false);
            };
            // Room for its live records plus a few small records (damage markers).
            let room_for = |state: &State, victim: SegmentId| {
                state.segments_needed(
                    StreamKind::Gc,
                    state.segments.get(victim).live_bytes + RELOCATION_SLACK_BYTES,
                )
            };
            let spare = state
                .segments
                .free_count()
                .saturating_sub(state.dump_reserve_segments());
            if room_for(&state, victim) > spare {
                // Short of free segments: take the emptiest victim instead,
                // which needs the least room to relocate.
                if let Some(emptiest) = pick_victim(&state, GcPolicy::Greedy, min_garbage_bytes) {
                    victim = emptiest;
                }
            }
            let info = *state.segments.get(victim);
            let needed = room_for(&state, victim);
            if state.segments.reserved_count() < needed
                && state.segments.free_count() >= needed + state.dump_reserve_segments()
            {
                // Free segments exist but no root has reserved them yet.
                let wanted = needed + state.segment_reserve_ahead / 2;
                drop(state);
                self.write_root(false, wanted)?;
                return Ok(true);
            }
            if state.segments.free_count() < needed + state.dump_reserve_segments() {
                let reclaimable = state.reclaimable_count();
                drop(state);
                if reclaimable > 0 {
                    self.flush()?;
                    return Ok(true);
                }
                return Ok(false);
            }
            (
                victim,
                info.seq,
                info.fill_bytes,
                state.needed_by_recovery(victim),
            )
        };

        let mut bytes = vec![0u8; fill_bytes as usize];
        self.media.read(victim, 0, &mut bytes)?;
        let scan = scan_segment(&bytes, 0, seq as u32, page_size);

        let mut state = self.lock();
        // Trim and zero records to relocate come on top of the live data:
        // make sure everything fits before changing anything.
        let range_bytes: u64 = scan
            .records
            .iter()
            .filter(|r| post_checkpoint && r.header.kind.is_range())
            .map(|r| r.header.record_len())
            .sum();
        let needed = state.segments_needed(
            StreamKind::Gc,
            state.segments.get(victim).live_bytes + range_bytes + RELOCATION_SLACK_BYTES,
        );
        if state.segments.free_count() < needed + state.dump_reserve_segments() {
            let reclaimable = state.reclaimable_count();
            drop(state);
            if reclaimable > 0 {
                self.flush()?;
                return Ok(true);
            }
            return Ok(false);
        }
        let gc_written_before = state.counters.gc_write_bytes;
        state.counters.gc_read_bytes += fill_bytes;
        assert_eq!(
            state.segments.get(victim).state,
            SegmentState::Sealed,
            "victim {victim} changed state during cleaning"
        );
        for record in &scan.records {
            let header = record.header;
            let payload = &bytes[record.payload.clone()];
            match header.kind {
                RecordKind::Data => {
                    let here = Location {
                        segment: victim,
                        offset: record.offset as u32,
                        len: header.record_len() as u32,
                    };
                    let entry = state.map.get(Lba(header.lba));
                    if entry.slot() == Slot::Data(here) {
                        let moved = relocate(&mut state, header, payload)?;
                        state.segments.add_live(moved.segment, moved.len as u64);
                        state
                            .map
                            .set(Lba(header.lba), Slot::Data(moved), header.version);
                        state.release_location(here);
                    }
                }
                RecordKind::Trim | RecordKind::Zero | RecordKind::Damaged if post_checkpoint => {
                    // Needed by recovery unless later writes replaced every block it covers.
                    let count = crate::record::range_count(payload);
                    if !state
                        .map
                        .all_newer_than(Lba(header.lba), count, header.version)
                    {
                        relocate(&mut state, header, payload)?;
                    }
                }
                _ => {}
            }
        }
        let mut checkpoint_first = false;
        if state.segments.get(victim).live_bytes > 0 {
            // The scan stopped at damage before reaching every live record:
            // find the rest through the map and verify them one by one.
            let mut stragglers = Vec::new();
            state.map.for_each_data(|lba, loc, version| {
                if loc.segment == victim {
                    stragglers.push((lba, loc, version));
                }
            });
            for (lba, loc, version) in stragglers {
                let start = loc.offset as usize;
                let record = bytes
                    .get(start..start + loc.len as usize)
                    .and_then(|slice| decode_record(slice, Some(seq as u32)).ok());
                match record {
                    Some((header, payload))
                        if header.kind == RecordKind::Data
                            && header.lba == lba.0
                            && header.version == version =>
                    {
                        let moved = relocate(&mut state, header, payload)?;
                        state.segments.add_live(moved.segment, moved.len as u64);
                        state.map.set(lba, Slot::Data(moved), version);
                        state.release_location(loc);
                    }
                    _ => mark_damaged(&mut state, lba)?,
                }
            }
            // Range records after the damage could not be relocated: only a
            // checkpoint makes them unnecessary.
            checkpoint_first = post_checkpoint && scan.first_error.is_some();
        }
        assert_eq!(
            state.segments.get(victim).live_bytes,
            0,
            "victim {victim} still has live bytes"
        );
        let release_gen = if checkpoint_first {
            AFTER_CHECKPOINT
        } else {
            state.barrier_gen + 1
        };
        state.segments.get_mut(victim).state = SegmentState::Reclaimable { release_gen };
        state.counters.segments_cleaned += 1;
        let relocated = state.counters.gc_write_bytes - gc_written_before;
        drop(state);
        self.media
            .segment_recycled(self.geometry.segment_size_bytes, relocated);
        if checkpoint_first {
            // Also releases the victim for the next barrier.
            self.checkpoint_locked(false)?;
        }
        Ok(true)
    }
}
