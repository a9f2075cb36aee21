//! The segment cleaner (garbage collector).
//!
//! One step, in four parts:
//! 1. **choose** a sealed victim by policy, once the ladder has made room
//!    to relocate it;
//! 2. **read** its live records (found through the segment summary), or
//!    the whole segment if it holds range records recovery may still need
//!    (only a scan finds those);
//! 3. **relocate** its live records into the GC stream unchanged — same
//!    payload, same codec, same version — so a relocated copy can never
//!    override a newer write during recovery (equal versions mean equal
//!    data), together with range records (trim, zero, damaged) that
//!    recovery from the durable checkpoint still needs;
//! 4. **release** it: `Space::retire` decides when it is free again —
//!    after a barrier and a sync have made the relocated copies, and every
//!    write that made its other records dead, durable; at once if nothing
//!    was copied and those writes are durable already.
//!
//! Damage found while cleaning is never laundered into a fresh checksum:
//! a live record that fails verification becomes a `Damaged` map entry
//! (reads fail with EIO) backed by a `Damaged` record in the log.

use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::gc::GcPolicy;
use crate::map::{Location, Slot};
use crate::media::ReadRange;
use crate::record::{range_count, RecordHeader, RecordKind};
use crate::segments::SegmentState;
use crate::units::{Lba, SegmentId};

use super::guard::StateGuard;
use super::moves::{apply, by_record, member_cells, moves_ranges, plan_record, LiveExtent, Move};
use super::scan::{scan_segment, ScanResult};
use super::space::{Need, Reach, Writer};
use super::state::{State, Tally};
use super::Volume;

/// Room kept for small records a cleaning step may add beyond the live
/// data it relocates (damage markers).
const RELOCATION_SLACK_BYTES: u64 = 256;

/// Live records closer than this are read in one request, gap included.
const MERGE_GAP_BYTES: u64 = 16 * 1024;

/// The best victim under `policy` with at least `min_garbage_bytes` reclaimable.
/// Free segments beyond which the cleaner may wait for checkpoints rather
/// than copy what a recovery would replay (`Volume::clean_one_by`).
const SETTLING_SPARE_SEGMENTS: u64 = 8;

/// True if free segments leave room for the checkpoints that settle a
/// victim: below that, the cleaner takes the best victim as it is.
pub(super) fn roomy(state: &State) -> bool {
    state.space().free_count() >= state.floor(Writer::Cleaner) + SETTLING_SPARE_SEGMENTS
}

/// With `settled`, only victims whose copies no recovery would replay out
/// of order with what they copy: no retained root replays them, or they
/// hold no live data to copy (see `Volume::clean_one_by`).
fn pick_victim(
    state: &State,
    policy: GcPolicy,
    min_garbage_bytes: u64,
    settled: bool,
) -> Option<SegmentId> {
    let space = state.space();
    let segment_size = state.segment_size_bytes();
    let now = space.next_version();
    let mut best: Option<(SegmentId, f64)> = None;
    for (segment, info) in space.table().iter() {
        if info.state != SegmentState::Sealed {
            continue;
        }
        if settled && info.live_bytes > 0 && state.needed_by_recovery(segment) {
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

/// What relocating `victim`'s live data and `extra_bytes` of range
/// records (plus slack for damage markers) asks of the ladder: the GC
/// stream's segments, and a version per damage marker (at most one per
/// record appended to it).
fn relocation_need(state: &State, victim: SegmentId, extra_bytes: u64) -> Need {
    let space = state.space();
    let bytes = space.segment(victim).live_bytes + extra_bytes;
    let segments = match bytes {
        0 => 0,
        _ => state.gc_segments_needed(bytes + RELOCATION_SLACK_BYTES, copies_after(state, victim)),
    };
    Need {
        writer: Writer::Cleaner,
        segments,
        versions: space.table().member_count(victim) + 1,
        bytes: 0,
    }
}

/// The incarnation the copies of `victim` must follow in replay order
/// (`State::copies_follow`): its own if a retained root would replay it,
/// else 0 (no recovery replays the original, only the copy).
fn copies_after(state: &State, victim: SegmentId) -> u64 {
    match state.needed_by_recovery(victim) {
        true => state.space().segment(victim).seq,
        false => 0,
    }
}

/// Runs `copy`, the relocation of `victim`'s live records, with the GC
/// stream held to segments its copies may go to (`copies_after`), and
/// lets it append anywhere again afterwards, failed or not.
fn copying<T>(
    state: &mut State,
    victim: SegmentId,
    copy: impl FnOnce(&mut State) -> Result<T>,
) -> Result<T> {
    let after = copies_after(state, victim);
    state.copies_follow(after);
    let result = copy(state);
    state.copies_follow(0);
    result
}

/// The bytes of the record at `loc` in the runs read from its victim.
fn record_in_runs(runs: &[(u64, Vec<u8>)], loc: Location) -> Option<&[u8]> {
    let index = runs.partition_point(|(start, _)| *start <= loc.offset as u64) - 1;
    let (start, run) = &runs[index];
    let at = (loc.offset as u64 - start) as usize;
    run.get(at..at + loc.len as usize)
}

/// A victim chosen for one cleaning step.
#[derive(Debug, Clone, Copy)]
pub(super) struct Victim {
    segment: SegmentId,
    seq: u64,
    fill_bytes: u64,
    /// A recovery from a retained root would replay it, so range records
    /// in it must be relocated, and only a scan finds them.
    needed_by_recovery: bool,
    holds_ranges: bool,
    /// Its newest record is older than the newest quarter of all writes,
    /// and the cold-data pass has not rewritten most of it yet.
    cold: bool,
    /// Rewrite its live data with the cold-data codec.
    pub(super) recompress: bool,
}

/// The facts a cleaning step needs about `segment`.
pub(super) fn victim_of(state: &State, segment: SegmentId) -> Victim {
    let info = state.space().segment(segment);
    debug_assert_eq!(info.state, SegmentState::Sealed, "victim {segment}");
    let now = state.space().next_version();
    Victim {
        segment,
        seq: info.seq,
        fill_bytes: info.fill_bytes,
        needed_by_recovery: state.needed_by_recovery(segment),
        holds_ranges: info.holds_ranges,
        cold: info.max_version < now - now / 4 && info.cold_bytes < info.live_bytes / 2,
        recompress: false,
    }
}

impl Victim {
    fn full_scan(&self) -> bool {
        self.needed_by_recovery && self.holds_ranges
    }
}

/// What was read of a victim.
enum Contents {
    /// The whole segment, scanned.
    Scanned { bytes: Vec<u8>, scan: ScanResult },
    /// Only its live records, read in runs merged across small gaps, and
    /// what to do with each.
    Live { moves: Vec<Move>, read_bytes: u64 },
}

/// What relocation left to the release.
struct Relocated<'a> {
    state: StateGuard<'a>,
    relocated_bytes: u64,
    /// The victim is one a retained root replays, and range records lost
    /// to damage could not be relocated, or records were copied out of it
    /// (replay meets a copy later than its original), or it holds records
    /// a snapshot followed: only a checkpoint makes them unnecessary.
    checkpoint_first: bool,
}

/// Who is cleaning: a writer waiting for room (never slowed by the
/// cold-data pass), or the background thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cleaning {
    Foreground,
    Background,
}

impl Volume {
    /// Cleans one victim with at least `min_garbage_bytes` of reclaimable
    /// space. Returns false if there is none, or no room to relocate into.
    pub fn clean_one(&self, min_garbage_bytes: u64) -> Result<bool> {
        self.clean_one_by(min_garbage_bytes, Cleaning::Foreground)
    }

    /// [`Volume::clean_one`], for `who`.
    pub(crate) fn clean_one_by(&self, min_garbage_bytes: u64, who: Cleaning) -> Result<bool> {
        if self.read_only {
            return Ok(false);
        }
        let _maintenance = self.maintenance.lock().expect("maintenance lock poisoned");
        let Some(mut victim) = self.choose_victim(min_garbage_bytes)? else {
            return Ok(false);
        };
        // No copy may be replayed out of order with the records it
        // copies: a recovery replays segments in sequence order, so a copy
        // in a GC segment can come before a reference record that needs
        // the data it copies (the reference is lost), or before a snapshot
        // record (the entry is kept for the wrong snapshot). A victim with
        // live data that a retained root would replay waits for
        // checkpoints (two at most, for both roots) to put it behind every
        // root; victims behind them are chosen first (`choose_victim`).
        // With few free segments (`roomy`), or if no checkpoint fits, it is
        // cleaned at once, and its copies go to a GC segment opened after
        // it (`State::copies_follow`): the GC stream's open segment may be
        // older than the victim, and a copy there would be replayed, by
        // the newest root too, ahead of what its original followed.
        for _ in 0..2 {
            let unsettled = {
                let state = self.lock();
                victim.needed_by_recovery
                    && state.space().segment(victim.segment).live_bytes > 0
                    && roomy(&state)
            };
            if !unsettled {
                break;
            }
            match self.checkpoint_locked(false) {
                Ok(()) => {}
                Err(Error::NoSpace { .. }) => break,
                Err(other) => return Err(other),
            }
            let state = self.lock();
            if state.space().segment(victim.segment).state != SegmentState::Sealed {
                // The checkpoint cleaned it to make room for itself.
                return Ok(true);
            }
            victim = victim_of(&state, victim.segment);
        }
        // With `--recompress gc`, the background cleaner rewrites cold
        // victims with the stronger codec.
        victim.recompress = self.recompress_when_cleaning(who, victim.cold);
        self.clean_victim(&victim)
    }

    /// Cleans `victim` (chosen under the maintenance lock, held).
    pub(super) fn clean_victim(&self, victim: &Victim) -> Result<bool> {
        let victim = *victim;
        let contents = self.read_victim(&victim)?;
        let Some(relocated) = self.relocate_victim(&victim, contents)? else {
            return Ok(false);
        };
        self.release_victim(&victim, relocated)?;
        Ok(true)
    }

    /// The ladder, for the cleaner: `None` if even renewing the
    /// reservations and flushing leave no room to relocate.
    /// The map leaves of `ranges`, the blocks relocation changes, are in
    /// RAM then.
    pub(super) fn room_to_relocate(
        &self,
        victim: SegmentId,
        extra_bytes: u64,
        ranges: &[(Lba, u64)],
    ) -> Result<Option<StateGuard<'_>>> {
        match self.make_room_resident(Reach::Nested, ranges, |state| {
            relocation_need(state, victim, extra_bytes)
        }) {
            Ok((state, _)) => Ok(Some(state)),
            Err(Error::NoSpace { .. }) => Ok(None),
            Err(other) => Err(other),
        }
    }

    /// Step 1: the victim with the best score, or, when free segments are
    /// short, the emptiest, which needs the least room to relocate.
    fn choose_victim(&self, min_garbage_bytes: u64) -> Result<Option<Victim>> {
        let segment = {
            let state = self.lock();
            state.check_writable()?;
            let policy = self.settings.gc_policy;
            // Settled victims first while there is room to wait for
            // checkpoints; others only if there is none.
            let settled_first = roomy(&state);
            let settled = settled_first
                .then(|| pick_victim(&state, policy, min_garbage_bytes, true))
                .flatten();
            let (best, settled) = match settled {
                Some(best) => (best, true),
                None => match pick_victim(&state, policy, min_garbage_bytes, false) {
                    Some(best) => (best, false),
                    None => return Ok(None),
                },
            };
            let need = relocation_need(&state, best, 0);
            if state
                .space()
                .segments_fit(&need, state.floor(Writer::Cleaner))
            {
                best
            } else {
                pick_victim(&state, GcPolicy::Greedy, min_garbage_bytes, settled).unwrap_or(best)
            }
        };
        let Some(state) = self.room_to_relocate(segment, 0, &[])? else {
            return Ok(None);
        };
        Ok(Some(victim_of(&state, segment)))
    }

    /// The live records of `segment`: (block, location, version), found
    /// through the segment summary, or a scan of the map if it has none.
    fn live_extents(&self, segment: SegmentId) -> Result<Vec<LiveExtent>> {
        // The members' map leaves in RAM, read without the lock; the
        // members may change while it is released, so until they hold still.
        let mut state = self.lock();
        let members = loop {
            let members: Vec<u64> = state.space().table().members(segment);
            let ranges: Vec<(Lba, u64)> = members.iter().map(|&lba| (Lba(lba), 1)).collect();
            if ranges
                .iter()
                .all(|&(lba, count)| state.map().faults(lba, count).is_empty())
            {
                break members;
            }
            state = self.make_resident(state, &ranges)?;
        };
        let (map, space) = (state.map(), state.space());
        let mut live = Vec::new();
        let mut live_bytes = 0;
        for lba in members {
            let entry = map.get(Lba(lba));
            if let Slot::Data(loc) = entry.slot() {
                if loc.segment == segment {
                    live_bytes += loc.share();
                    live.push((Lba(lba), loc, entry.version()));
                }
            }
        }
        if live_bytes != space.segment(segment).live_bytes {
            // The summary is incomplete (it is rebuilt from the map at open,
            // so this is a bug guard): fall back to the whole map.
            live.clear();
            map.for_each_data(&*self.media, |lba, loc, version| {
                if loc.segment == segment {
                    live.push((lba, loc, version));
                }
            })?;
        }
        Ok(live)
    }

    /// Step 2, outside the state lock: the whole victim if it must be
    /// scanned, otherwise its live records, merged into few requests.
    fn read_victim(&self, victim: &Victim) -> Result<Contents> {
        let segment = victim.segment;
        // Its last pages may still be queued: they must be on the medium.
        self.wait_all_written();
        if victim.full_scan() {
            let mut bytes = vec![0u8; victim.fill_bytes as usize];
            self.media.read(segment, 0, &mut bytes)?;
            let page_size = self.geometry.page_size_bytes as u64;
            let scan = scan_segment(&bytes, 0, victim.seq as u32, page_size, &self.record_key);
            return Ok(Contents::Scanned { bytes, scan });
        }
        let mut live = self.live_extents(segment)?;
        live.sort_by_key(|(_, loc, _)| loc.offset);
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for (_, loc, _) in &live {
            let (start, end) = (loc.offset as u64, loc.offset as u64 + loc.len as u64);
            match spans.last_mut() {
                Some(span) if start <= span.1 + MERGE_GAP_BYTES => span.1 = span.1.max(end),
                _ => spans.push((start, end)),
            }
        }
        let mut runs: Vec<(u64, Vec<u8>)> = spans
            .iter()
            .map(|&(start, end)| (start, vec![0u8; (end - start) as usize]))
            .collect();
        let read_bytes = spans.iter().map(|&(start, end)| end - start).sum();
        let mut ranges: Vec<ReadRange<'_>> = runs
            .iter_mut()
            .map(|(start, buf)| ReadRange {
                segment,
                offset_bytes: *start,
                buf,
            })
            .collect();
        for result in self.media.read_batch(&mut ranges) {
            result?;
        }
        let codec = self.settings.codec;
        let seq32 = victim.seq as u32;
        let records = by_record(live);
        let moves = if victim.recompress {
            let read: Vec<(Option<&[u8]>, &[LiveExtent])> = records
                .iter()
                .map(|record| (record_in_runs(&runs, record[0].1), record.as_slice()))
                .collect();
            self.plan_cold(seq32, &read)
        } else {
            records
                .iter()
                .map(|record| {
                    let bytes = record_in_runs(&runs, record[0].1);
                    plan_record(&self.record_key, seq32, bytes, record, codec)
                })
                .collect()
        };
        Ok(Contents::Live { moves, read_bytes })
    }

    /// Step 3: relocates what is live (and, from a scan, the range records
    /// recovery still needs); `None` if the ladder finds no room for it.
    fn relocate_victim<'a>(
        &'a self,
        victim: &Victim,
        contents: Contents,
    ) -> Result<Option<Relocated<'a>>> {
        let segment = victim.segment;
        let (mut state, gc_written_before, checkpoint_first) = match contents {
            Contents::Scanned { bytes, scan } => {
                // Trim and zero records come on top of the live data: make
                // sure everything fits before changing anything.
                let range_bytes: u64 = scan
                    .records
                    .iter()
                    .filter(|r| r.header.kind.is_range())
                    .map(|r| r.header.record_len())
                    .sum();
                let ranges: Vec<(Lba, u64)> = scan
                    .records
                    .iter()
                    .flat_map(|record| {
                        scanned_ranges(&record.header, &bytes[record.payload.clone()])
                    })
                    .collect();
                let Some(mut state) = self.room_to_relocate(segment, range_bytes, &ranges)? else {
                    return Ok(None);
                };
                let before = state.counters().gc_write_bytes;
                state.tally(Tally::GcRead(victim.fill_bytes));
                let codec = self.settings.codec;
                let refs = copying(&mut state, segment, |state| {
                    relocate_scanned(state, victim.segment, &bytes, &scan, codec)
                })?;
                (state, before, scan.first_error.is_some() || refs)
            }
            Contents::Live { moves, read_bytes } => {
                let ranges = moves_ranges(&moves);
                let Some(mut state) = self.room_to_relocate(segment, 0, &ranges)? else {
                    return Ok(None);
                };
                let before = state.counters().gc_write_bytes;
                state.tally(Tally::GcRead(read_bytes));
                copying(&mut state, segment, |state| apply(state, moves))?;
                (state, before, false)
            }
        };
        if state.space().segment(segment).live_bytes > 0 {
            // Live records the scan could not reach (damage in the segment).
            drop(state);
            state = self.relocate_stragglers(victim)?;
        }
        let relocated_bytes = state.counters().gc_write_bytes - gc_written_before;
        Ok(Some(Relocated {
            state,
            relocated_bytes,
            // A copy a retained root replays comes after its original in
            // replay order, and so after records written since: a
            // reference record among them would not find the content it
            // shares once the original's segment is reused (simulator
            // seed 3346, beyond CI's 2000). The victim waits for a
            // checkpoint, whose dump names the copy.
            checkpoint_first: (checkpoint_first || relocated_bytes > 0)
                && victim.needed_by_recovery,
        }))
    }

    /// Finds the victim's remaining live records through the map and
    /// verifies them one by one; returns the state lock.
    fn relocate_stragglers(&self, victim: &Victim) -> Result<StateGuard<'_>> {
        self.wait_all_written();
        let stragglers = self.live_extents(victim.segment)?;
        let moves: Vec<Move> = by_record(stragglers)
            .iter()
            .map(|record| {
                let loc = record[0].1;
                let mut bytes = vec![0u8; loc.len as usize];
                let read = self
                    .media
                    .read(victim.segment, loc.offset as u64, &mut bytes)
                    .ok()
                    .map(|()| bytes.as_slice());
                plan_record(
                    &self.record_key,
                    victim.seq as u32,
                    read,
                    record,
                    self.settings.codec,
                )
            })
            .collect();
        let ranges = moves_ranges(&moves);
        let mut state = self.make_resident(self.lock(), &ranges)?;
        copying(&mut state, victim.segment, |state| apply(state, moves))?;
        Ok(state)
    }

    /// Step 4: the victim is retired; if damage hid range records a
    /// recovery might need, or a snapshot followed its records, it waits
    /// for a checkpoint, written at once if there is room (else the
    /// ladder's checkpoint rung frees it: `Space::checkpoint_frees_space`).
    fn release_victim(&self, victim: &Victim, relocated: Relocated<'_>) -> Result<()> {
        let Relocated {
            mut state,
            relocated_bytes,
            checkpoint_first,
        } = relocated;
        state.retire(victim.segment, relocated_bytes, checkpoint_first);
        drop(state);
        if let Some(drive) = self.media.drive() {
            drive.segment_recycled(self.geometry.segment_size_bytes, relocated_bytes);
        }
        if checkpoint_first {
            // Also releases the victim for the next barrier.
            match self.checkpoint_locked(false) {
                Ok(()) | Err(Error::NoSpace { .. }) => {}
                Err(other) => return Err(other),
            }
        }
        Ok(())
    }
}

/// The blocks a scanned record names.
fn scanned_ranges(header: &RecordHeader, payload: &[u8]) -> Vec<(Lba, u64)> {
    let count = match header.kind {
        RecordKind::Unit => payload.first().copied().unwrap_or(1) as u64,
        RecordKind::Trim | RecordKind::Zero | RecordKind::Damaged => range_count(payload),
        // Not relocated (see `relocate_scanned`).
        RecordKind::Ref => return Vec::new(),
        _ => 1,
    };
    let mut ranges = vec![(Lba(header.lba), count.max(1))];
    if matches!(header.kind, RecordKind::Data | RecordKind::Unit) {
        // The cells of its members, if they are shared.
        ranges.extend(member_cells(header, payload));
    }
    ranges
}

/// Relocates, from a scanned victim, each data record the map still points
/// at, and each range record that still determines a block (recovery from
/// the durable checkpoint needs it). Returns true if the victim holds a
/// reference record: those are never copied (replayed after the records
/// written after them, they could find their content's owner overwritten),
/// so the victim waits for a checkpoint instead. So it does if it holds a
/// range record older than a snapshot (`snapshot_follows`), copied or not
/// (and if anything was copied at all: `Volume::relocate_victim`).
///
/// A record is copied through `moves::apply`: one with a member a snapshot
/// keeps, or a dead member, is rewritten from what is live (compressed
/// with `codec`), never copied unchanged. An unchanged copy of a kept
/// member would name the volume's (or clone's) block, and a replay that
/// applies the snapshot's deletion first (its record in a host segment
/// older than the copy's) took it for a write of that block after a trim
/// the checkpoint knew only as a hole.
fn relocate_scanned(
    state: &mut State,
    segment: SegmentId,
    bytes: &[u8],
    scan: &ScanResult,
    codec: Codec,
) -> Result<bool> {
    let mut refs = false;
    for record in &scan.records {
        let header = record.header;
        let payload = &bytes[record.payload.clone()];
        match header.kind {
            // Copied whole if all its blocks live there and no snapshot
            // keeps one; else what is live is rewritten.
            RecordKind::Data | RecordKind::Unit => {
                let blocks = match header.kind {
                    RecordKind::Unit => payload[0],
                    _ => 1,
                };
                let here = Location::unit_member(
                    segment,
                    record.offset as u32,
                    header.record_len() as u32,
                    0,
                    blocks,
                );
                let copy = Move::Copy {
                    from: here,
                    header,
                    payload: payload.to_vec(),
                    codec,
                };
                apply(state, vec![copy])?;
            }
            RecordKind::Trim | RecordKind::Zero | RecordKind::Damaged => {
                let count = range_count(payload);
                state.load_map(Lba(header.lba), count)?;
                if !state
                    .map()
                    .all_newer_than(Lba(header.lba), count, header.version)
                {
                    state.relocate_range(header, payload)?;
                }
                refs |= snapshot_follows(state, header.version);
            }
            // Snapshot records a replay still needs hold the victim as
            // reference records do, until a checkpoint.
            RecordKind::Ref | RecordKind::Snapshot => refs = true,
            RecordKind::MapChunk | RecordKind::Chapter => {}
        }
    }
    Ok(refs)
}

/// True if a snapshot was taken after version `version`. A recovery from
/// a root that replays a range record at that version meets it before
/// the snapshot's record and the writes after that, and keeps for the
/// snapshot what the record left (a zero range whose blocks are newer
/// now); a range whose blocks are all newer is not copied at all. So the
/// victim holding it must stay until a checkpoint.
fn snapshot_follows(state: &State, version: u64) -> bool {
    state
        .snapshots()
        .list()
        .iter()
        .any(|snapshot| snapshot.version > version)
}
