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
//! write that made its other records dead, durable. A victim nothing was
//! copied out of, whose killing writes are all durable already
//! (`SegmentInfo::killed_gen` synced), is free at once.
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

/// Live records closer than this are read in one request, gap included.
const MERGE_GAP_BYTES: u64 = 16 * 1024;

/// A release generation that no barrier reaches: set while a checkpoint
/// must come first.
const AFTER_CHECKPOINT: u64 = crate::segments::PARKED;

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
        // Trims recovery may still need move with the segment: they are
        // not garbage to reclaim.
        let kept = info.live_bytes
            + if info.range_bytes > 0 && state.needed_by_recovery(segment) {
                info.range_bytes
            } else {
                0
            };
        let garbage = segment_size.saturating_sub(kept);
        if garbage < min_garbage_bytes.max(1) {
            continue;
        }
        let age = now.saturating_sub(info.max_version);
        let Some(score) = policy.score(kept, segment_size, age) else {
            continue;
        };
        if best.is_none_or(|(_, s)| score > s) {
            best = Some((segment, score));
        }
    }
    best.map(|(segment, _)| segment)
}

/// Segments the GC stream needs to take `victim`'s live data and
/// `extra_bytes` of range records (plus slack for damage markers).
fn relocation_segments(state: &State, victim: SegmentId, extra_bytes: u64) -> u64 {
    let bytes = state.segments.get(victim).live_bytes + extra_bytes;
    if bytes == 0 {
        return 0;
    }
    state.segments_needed(StreamKind::Gc, bytes + RELOCATION_SLACK_BYTES)
}

/// Versions cleaning `victim` may take: one per damage marker, at most one
/// per record appended to it.
fn relocation_versions(state: &State, victim: SegmentId) -> u64 {
    state.segments.members(victim).len() as u64 + 1
}

/// Moves the live block `lba` (version `version`, at `from`) if `record`,
/// read back from there, is that very record; otherwise marks it damaged.
fn move_or_mark_damaged(
    state: &mut State,
    lba: Lba,
    from: Location,
    version: u64,
    record: Option<(RecordHeader, &[u8])>,
) -> Result<()> {
    match record {
        Some((header, payload))
            if header.kind == RecordKind::Data
                && header.lba == lba.0
                && header.version == version =>
        {
            move_record(state, from, header, payload)
        }
        _ => mark_damaged(state, lba),
    }
}

/// Moves a live data record from `from` to the GC stream, unchanged.
fn move_record(
    state: &mut State,
    from: Location,
    header: RecordHeader,
    payload: &[u8],
) -> Result<()> {
    let moved = relocate(state, header, payload)?;
    state.segments.add_live(moved.segment, moved.len as u64);
    state
        .map
        .set(Lba(header.lba), Slot::Data(moved), header.version);
    state.release_location(from);
    Ok(())
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
    /// The live records of `segment`: (block, location, version), found
    /// through the segment summary, or a scan of the map if it has none.
    fn live_extents(&self, segment: SegmentId) -> Vec<(Lba, Location, u64)> {
        let state = self.lock();
        let mut members = state.segments.members(segment).to_vec();
        members.sort_unstable();
        members.dedup();
        let mut live = Vec::new();
        let mut live_bytes = 0;
        for lba in members {
            let entry = state.map.get(Lba(lba));
            if let Slot::Data(loc) = entry.slot() {
                if loc.segment == segment {
                    live_bytes += loc.len as u64;
                    live.push((Lba(lba), loc, entry.version()));
                }
            }
        }
        if live_bytes != state.segments.get(segment).live_bytes {
            // The summary is incomplete (it is rebuilt from the map at open,
            // so this is a bug guard): fall back to the whole map.
            live.clear();
            state.map.for_each_data(|lba, loc, version| {
                if loc.segment == segment {
                    live.push((lba, loc, version));
                }
            });
        }
        live
    }

    fn has_relocation_room(&self, state: &State, victim: SegmentId, extra_bytes: u64) -> bool {
        let needed = relocation_segments(state, victim, extra_bytes);
        let versions = relocation_versions(state, victim);
        // A victim with nothing to move needs no room at all.
        state.gc_has_room(needed)
            && state.segments.reserved_count() >= needed
            && state.numbering_room(needed, versions)
    }

    /// Not enough room to relocate: renew the reservations if that is what
    /// is missing, or release cleaned segments if a barrier can, else report
    /// no progress. The caller holds the maintenance lock.
    fn short_of_room(
        &self,
        state: std::sync::MutexGuard<'_, State>,
        victim: SegmentId,
        extra_bytes: u64,
    ) -> Result<bool> {
        let needed = relocation_segments(&state, victim, extra_bytes);
        let versions = relocation_versions(&state, victim);
        let free_enough = state.gc_has_room(needed);
        if free_enough && state.reservation_short(needed, versions) {
            let wanted = needed + state.segment_reserve_ahead / 2;
            drop(state);
            self.write_root(false, wanted, versions)?;
            return Ok(true);
        }
        let reclaimable = state.reclaimable_count();
        drop(state);
        if reclaimable > 0 {
            self.flush()?;
            return Ok(true);
        }
        Ok(false)
    }

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
            let room_for = |state: &State, victim: SegmentId| relocation_segments(state, victim, 0);
            if !state.gc_has_room(room_for(&state, victim)) {
                // Short of free segments: take the emptiest victim instead,
                // which needs the least room to relocate.
                if let Some(emptiest) = pick_victim(&state, GcPolicy::Greedy, min_garbage_bytes) {
                    victim = emptiest;
                }
            }
            let info = *state.segments.get(victim);
            let needed = room_for(&state, victim);
            let versions = relocation_versions(&state, victim);
            if state.reservation_short(needed, versions) && state.gc_has_room(needed) {
                // Free segments exist but no root has reserved them (or
                // the numbers for them) yet.
                let wanted = needed + state.segment_reserve_ahead / 2;
                drop(state);
                self.write_root(false, wanted, versions)?;
                return Ok(true);
            }
            if !state.gc_has_room(needed) {
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

        // Trims in a segment written after the durable checkpoint must be
        // relocated, and only a full scan finds them. Otherwise the
        // segment summary (the blocks appended to it) and the map say which
        // records are live, and only those are read.
        let holds_ranges = self.lock().segments.get(victim).holds_ranges;
        let full_scan = post_checkpoint && holds_ranges;
        let mut checkpoint_first = false;
        let gc_written_before;
        let mut state = if full_scan {
            let mut bytes = vec![0u8; fill_bytes as usize];
            self.media.read(victim, 0, &mut bytes)?;
            let scan = scan_segment(&bytes, 0, seq as u32, page_size, &self.record_key);
            let mut state = self.lock();
            // Trim and zero records come on top of the live data: make sure
            // everything fits before changing anything.
            let range_bytes: u64 = scan
                .records
                .iter()
                .filter(|r| r.header.kind.is_range())
                .map(|r| r.header.record_len())
                .sum();
            if !self.has_relocation_room(&state, victim, range_bytes) {
                return self.short_of_room(state, victim, range_bytes);
            }
            gc_written_before = state.counters.gc_write_bytes;
            state.counters.gc_read_bytes += fill_bytes;
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
                        if state.map.get(Lba(header.lba)).slot() == Slot::Data(here) {
                            move_record(&mut state, here, header, payload)?;
                        }
                    }
                    RecordKind::Trim | RecordKind::Zero | RecordKind::Damaged => {
                        // Needed by recovery unless later writes replaced every block it covers.
                        let count = crate::record::range_count(payload);
                        if !state
                            .map
                            .all_newer_than(Lba(header.lba), count, header.version)
                        {
                            relocate(&mut state, header, payload)?;
                        }
                    }
                    RecordKind::MapChunk => {}
                }
            }
            // Range records lost to damage in the segment could not be
            // relocated: only a checkpoint makes them unnecessary.
            checkpoint_first = scan.first_error.is_some();
            state
        } else {
            let mut live = self.live_extents(victim);
            live.sort_by_key(|(_, loc, _)| loc.offset);
            // Read the live records, merging those close together.
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for (_, loc, _) in &live {
                let (start, end) = (loc.offset as u64, loc.offset as u64 + loc.len as u64);
                match runs.last_mut() {
                    Some(run) if start <= run.1 + MERGE_GAP_BYTES => run.1 = run.1.max(end),
                    _ => runs.push((start, end)),
                }
            }
            let mut buffers: Vec<(u64, Vec<u8>)> = runs
                .iter()
                .map(|&(start, end)| (start, vec![0u8; (end - start) as usize]))
                .collect();
            let read: u64 = runs.iter().map(|&(start, end)| end - start).sum();
            {
                let mut ranges: Vec<crate::media::ReadRange<'_>> = buffers
                    .iter_mut()
                    .map(|(start, buf)| crate::media::ReadRange {
                        segment: victim,
                        offset_bytes: *start,
                        buf,
                    })
                    .collect();
                for result in self.media.read_batch(&mut ranges) {
                    result?;
                }
            }
            let mut state = self.lock();
            if !self.has_relocation_room(&state, victim, 0) {
                return self.short_of_room(state, victim, 0);
            }
            gc_written_before = state.counters.gc_write_bytes;
            state.counters.gc_read_bytes += read;
            for (lba, loc, version) in live {
                // A host write may have replaced the block meanwhile.
                if state.map.get(lba).slot() != Slot::Data(loc) {
                    continue;
                }
                let index = buffers.partition_point(|(start, _)| *start <= loc.offset as u64) - 1;
                let (start, buffer) = &buffers[index];
                let at = (loc.offset as u64 - start) as usize;
                let record = buffer.get(at..at + loc.len as usize).and_then(|slice| {
                    decode_record(slice, &self.record_key, Some(seq as u32)).ok()
                });
                move_or_mark_damaged(&mut state, lba, loc, version, record)?;
            }
            state
        };
        if state.segments.get(victim).live_bytes > 0 {
            // Live records the scan could not reach (damage in the segment):
            // find them through the map and verify them one by one.
            drop(state);
            let stragglers = self.live_extents(victim);
            state = self.lock();
            for (lba, loc, version) in stragglers {
                if state.map.get(lba).slot() != Slot::Data(loc) {
                    continue;
                }
                let mut bytes = vec![0u8; loc.len as usize];
                let record = self
                    .media
                    .read(victim, loc.offset as u64, &mut bytes)
                    .ok()
                    .and_then(|_| decode_record(&bytes, &self.record_key, Some(seq as u32)).ok());
                move_or_mark_damaged(&mut state, lba, loc, version, record)?;
            }
        }
        checkpoint_first &= post_checkpoint;
        assert_eq!(
            state.segments.get(victim).live_bytes,
            0,
            "victim {victim} still has live bytes"
        );
        let relocated = state.counters.gc_write_bytes - gc_written_before;
        let killed_gen = state.segments.get(victim).killed_gen;
        let next_barrier = state.barrier_gen + 1;
        if checkpoint_first {
            state.segments.mark_reclaimable(victim, AFTER_CHECKPOINT);
        } else if relocated == 0 && killed_gen <= state.synced_gen {
            // Nothing was copied out, and every write that made its records
            // dead is already durable (typically a flushed TRIM or
            // overwrite): no barrier needs to wait for it.
            state.segments.release(victim);
        } else {
            state.segments.mark_reclaimable(victim, next_barrier);
        }
        state.counters.segments_cleaned += 1;
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
