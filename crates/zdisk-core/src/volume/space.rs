//! Free space: one owner for every decision about taking a segment.
//!
//! [`Space`] owns the segment table, the numbering of segment incarnations
//! and versions, and the barrier generations that decide when a cleaned
//! segment comes back. Every segment goes through one lifecycle, as in
//! TigerBeetle's `FreeSet`:
//!
//! - **reserve**: a root names the free segments, and the ranges of
//!   sequence numbers and versions, the run may use before it writes a
//!   newer root ([`Space::propose_reservation`], made usable by
//!   [`Space::commit_reservation`] once the root is durable). Nothing is
//!   taken that no durable root reserved, so recovery knows everything a
//!   crashed run may have written.
//! - **acquire**: a stream or a checkpoint takes the oldest reserved free
//!   segment ([`Space::acquire`]).
//! - **release**: a cleaned victim is retired ([`Space::retire`]) and comes
//!   back once everything that emptied it is durable
//!   ([`Space::note_synced`]), or after the next checkpoint if recovery
//!   might still need something it held; a replaced root's dump comes back
//!   at once ([`Space::release`]).
//! - **forfeit**: a checkpoint that failed gives its dump segments back,
//!   still reserved ([`Space::forfeit`]).
//!
//! Two words for two kinds of keeping back. A *reservation* is what a
//! durable root lets this run allocate and number. A *floor* is how many
//! free segments a [`Writer`] must leave for those that come after it:
//! host writes leave the cleaner's segments and the next checkpoint's;
//! trims, zeroes and repairs (which free space) only the checkpoint's; the
//! cleaner the checkpoint's less one (it gives one back when its victim
//! is released); a checkpoint takes what is left.
//!
//! One ladder makes room. When a writer cannot go ahead,
//! [`Space::next_rung`] says what to try next, and `Volume::make_room`
//! (`volume/room.rs`) climbs: renew the reservations, else flush (freeing
//! segments cleaned before), else clean a segment, else checkpoint (which
//! frees trims kept for recovery and victims parked for it), else the
//! medium is full. Writers, the cleaner, checkpoints and the background
//! thread all climb this same ladder; what differs is their floor and how
//! far up they may go ([`Reach`]).

use crate::dump::dump_segments_for;
use crate::map::{CHUNK_BLOCKS, VERSION_MAX};
use crate::record::{max_record_len, RecordHeader};
use crate::segments::{SegmentInfo, SegmentState, SegmentTable, PARKED};
use crate::units::SegmentId;

/// How far ahead of use a root reserves sequence numbers and versions by
/// default; reservations are renewed once a quarter of that is left.
pub(crate) const SEQ_RESERVE_AHEAD: u64 = 1 << 16;
pub(crate) const VERSION_RESERVE_AHEAD: u64 = 1 << 26;
/// Free segments a root reserves for allocation, by default.
pub(crate) const SEGMENT_RESERVE_AHEAD: u64 = 64;

/// Segments kept back for the cleaner, beyond those a checkpoint needs.
pub(crate) const GC_RESERVE_SEGMENTS: u64 = 2;

/// How far ahead of use roots reserve (tests shrink these to exercise renewal).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ahead {
    pub seq: u64,
    pub version: u64,
    pub segments: u64,
}

impl Ahead {
    /// The requested amounts, raised to what keeps renewals rare enough.
    pub(crate) fn at_least_minimum(self) -> Ahead {
        Ahead {
            seq: self.seq.max(64),
            version: self.version.max(64 * 1024),
            segments: self.segments.max(4),
        }
    }
}

/// Numbers and segments a root reserves for the run that writes it.
#[derive(Debug, Clone)]
pub(crate) struct Reservation {
    /// No incarnation numbered at or above this is written before a newer root.
    pub seq: u64,
    /// Likewise for versions.
    pub version: u64,
    /// The only free segments the run may allocate before a newer root.
    pub segments: Vec<SegmentId>,
}

/// Who wants segments; each leaves a different floor of free segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writer {
    /// Host data: `blocks` blocks about to be mapped (the map, and so the
    /// next dump, may grow by that much while it is written).
    Host { blocks: u64 },
    /// Trims, zeroes and repairs: they free space, so they may use the
    /// cleaner's segments, never the checkpoint's.
    Range,
    /// The cleaner relocating a victim.
    Cleaner,
    /// A checkpoint's dump.
    Checkpoint,
    /// The background thread, cleaning ahead of writers: it wants
    /// `low` segments free (free or reclaimable), and once it has started,
    /// `high` before it stops.
    Background { low: u64, high: u64, active: bool },
}

/// What a caller asks the ladder for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Need {
    pub writer: Writer,
    /// Fresh segments the writer will open.
    pub segments: u64,
    /// Versions it will number.
    pub versions: u64,
    /// Bytes it will append, if it knows (writers: it lets the ladder see
    /// that cleaning cannot make enough room before trying).
    pub bytes: u64,
}

/// What else the ladder looks at, which the state beside [`Space`] knows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Outlook {
    /// Map leaves now: the next dump holds a page for each.
    pub map_pages: u64,
    /// Bytes left in the writer's open segment.
    pub stream_room: u64,
    /// Log bytes after which the background thread checkpoints.
    pub checkpoint_interval_bytes: u64,
    /// Dirty map leaves hold the map's RAM well past its cache: a
    /// checkpoint writes them, and then they may be evicted.
    pub map_dirty_over_cache: bool,
    /// False while a rate-capped recycling engine is busy.
    pub recycling_ready: bool,
}

/// How far up the ladder a caller may climb.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Holding no lock: every rung.
    All,
    /// Inside a cleaning step or a checkpoint, with the maintenance lock
    /// held and work half done: renew and flush, never clean or checkpoint
    /// (they would run inside it).
    Nested,
}

/// One rung of the ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rung {
    /// Write a root reserving at least `segments` segments and `versions` versions.
    Renew { segments: u64, versions: u64 },
    /// A barrier and sync: frees the segments cleaned before it.
    Flush,
    /// Clean one victim holding at least `min_garbage_bytes` of garbage.
    Clean { min_garbage_bytes: u64 },
    /// A checkpoint: frees what only it can (trims kept for recovery,
    /// victims parked for it, the dump it replaces).
    Checkpoint,
    /// Nothing left to try: the medium is full (for the background
    /// thread: nothing to do now).
    Full,
}

/// What a caller has tried while climbing, so that no rung is retried
/// when it cannot help.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Climbed {
    /// A root was written since the last other rung.
    pub renewed: bool,
    /// A checkpoint was tried (writers try one at most).
    pub checkpointed: bool,
    /// The last cleaning step found nothing to clean.
    pub clean_failed: bool,
}

impl Climbed {
    /// Forgets what failed, to climb again from the bottom.
    pub(crate) fn restart(&mut self) {
        self.checkpointed = false;
        self.clean_failed = false;
        self.renewed = false;
    }

    /// Notes that `rung` was climbed; `progress` is false for a cleaning
    /// step that found no victim.
    pub(crate) fn note(&mut self, rung: Rung, progress: bool) {
        self.renewed = matches!(rung, Rung::Renew { .. });
        match rung {
            Rung::Checkpoint => {
                self.checkpointed = true;
                self.clean_failed = false;
            }
            Rung::Clean { .. } => self.clean_failed = !progress,
            Rung::Flush => self.clean_failed = false,
            Rung::Renew { .. } | Rung::Full => {}
        }
    }
}

/// The owner of free space. See the module documentation.
pub(crate) struct Space {
    table: SegmentTable,
    segment_size_bytes: u64,
    /// The longest record this volume can hold (see `record::max_record_len`).
    max_record_len: u64,
    ahead: Ahead,
    next_seq: u64,
    next_version: u64,
    /// Sequence numbers and versions below these are covered by the
    /// reservation in a durable root (see `CheckpointRoot::seq_reserved`).
    seq_limit: u64,
    version_limit: u64,
    /// Barriers issued; a barrier writes every buffered byte to the medium.
    barrier_gen: u64,
    /// Highest barrier generation known to be durable.
    synced_gen: u64,
    /// Log bytes appended since the last checkpoint.
    log_bytes_since_checkpoint: u64,
    /// Of those, bytes of trim, zero and damaged records, which the
    /// cleaner must keep until a checkpoint.
    range_bytes_since_checkpoint: u64,
}

impl Space {
    /// Space over `table`, numbering from `next_seq` and `next_version`.
    /// Nothing may be numbered or allocated until a root reserves it.
    pub(crate) fn new(
        table: SegmentTable,
        segment_size_bytes: u64,
        next_seq: u64,
        next_version: u64,
        ahead: Ahead,
    ) -> Space {
        assert!(next_version <= VERSION_MAX + 1, "version {next_version}");
        assert_eq!(table.reserved_count(), 0, "a new run starts unreserved");
        Space {
            table,
            segment_size_bytes,
            max_record_len: max_record_len(segment_size_bytes),
            ahead: ahead.at_least_minimum(),
            next_seq,
            next_version,
            seq_limit: next_seq,
            version_limit: next_version,
            barrier_gen: 0,
            synced_gen: 0,
            log_bytes_since_checkpoint: 0,
            range_bytes_since_checkpoint: 0,
        }
    }

    // --- Reading.

    /// The longest record this volume can hold.
    pub(crate) fn max_record_len(&self) -> u64 {
        self.max_record_len
    }

    /// Garbage a victim must hold for a writer waiting on space to clean
    /// it: more than the tail a full segment may always waste (under one
    /// record), so that a volume whose only "garbage" is such tails
    /// reports ENOSPC instead of copying segments around to gain nothing.
    pub(crate) fn foreground_min_garbage(&self) -> u64 {
        2 * self.max_record_len
    }

    pub(crate) fn table(&self) -> &SegmentTable {
        &self.table
    }

    pub(crate) fn segment(&self, segment: SegmentId) -> &SegmentInfo {
        self.table.get(segment)
    }

    /// Segments freed since the last call (for the medium to hear of).
    pub(crate) fn take_freed(&mut self) -> Vec<SegmentId> {
        self.table.take_freed()
    }

    /// Every free segment.
    pub(crate) fn free_segments(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.table.free_segments()
    }

    /// Bytes per segment.
    pub(crate) fn segment_size_bytes(&self) -> u64 {
        self.segment_size_bytes
    }

    pub(crate) fn free_count(&self) -> u64 {
        self.table.free_count()
    }

    /// Free segments a durable root lets this run allocate.
    pub(crate) fn reserved_count(&self) -> u64 {
        self.table.reserved_count()
    }

    /// Cleaned segments waiting only for a barrier to become free.
    pub(crate) fn reclaimable_count(&self) -> u64 {
        self.table.reclaimable_count()
    }

    /// Cleaned segments waiting for a checkpoint.
    pub(crate) fn parked_count(&self) -> u64 {
        self.table.parked_count()
    }

    pub(crate) fn next_seq(&self) -> u64 {
        self.next_seq
    }

    pub(crate) fn next_version(&self) -> u64 {
        self.next_version
    }

    pub(crate) fn ahead(&self) -> Ahead {
        self.ahead
    }

    pub(crate) fn barrier_gen(&self) -> u64 {
        self.barrier_gen
    }

    // --- Numbering.

    /// Takes the next version. Admission (the ladder) checked the
    /// reservation covers it before the caller started; running out here
    /// is a bug, not an operating error.
    pub(crate) fn take_version(&mut self) -> u64 {
        let version = self.next_version;
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
    pub(crate) fn numbering_room(&self, segments: u64, versions: u64) -> bool {
        self.next_seq + segments <= self.seq_limit
            && self.next_version + versions <= self.version_limit
    }

    /// True once `versions` more versions would exceed the map's 48 bits:
    /// no root can reserve them.
    pub(crate) fn versions_exhausted(&self, versions: u64) -> bool {
        self.next_version + versions > VERSION_MAX + 1
    }

    // --- Reserve.

    /// True when a root should be written to renew the reservations.
    pub(crate) fn reservation_low(&self) -> bool {
        let reserved = self.reserved_count();
        let segments_low = reserved < self.ahead.segments / 2 && self.free_count() > reserved;
        segments_low
            || self.next_seq + self.ahead.seq / 4 > self.seq_limit
            || self.next_version + self.ahead.version / 4 > self.version_limit
    }

    /// True when a root must be written before `segments` segments and
    /// `versions` versions can be used (or the reservations are low).
    pub(crate) fn reservation_short(&self, segments: u64, versions: u64) -> bool {
        self.reservation_low()
            || self.reserved_count() < segments
            || !self.numbering_room(segments, versions)
    }

    /// The reservations a root written now should carry: at least
    /// `min_segments` segments (and twice that many sequence numbers) and
    /// twice `min_versions` versions.
    pub(crate) fn propose_reservation(&self, min_segments: u64, min_versions: u64) -> Reservation {
        let segments = self.ahead.segments.max(min_segments) as usize;
        let seq_ahead = self.ahead.seq.max(2 * min_segments);
        let version_ahead = self.ahead.version.max(2 * min_versions);
        let reservation = Reservation {
            seq: (self.next_seq + seq_ahead).max(self.seq_limit),
            version: (self.next_version + version_ahead)
                .min(VERSION_MAX + 1)
                .max(self.version_limit),
            segments: self.table.propose_reservation(segments),
        };
        debug_assert!(reservation.seq > self.next_seq);
        debug_assert!(reservation.version >= self.version_limit);
        debug_assert!(reservation.segments.len() as u64 <= self.free_count());
        reservation
    }

    /// Makes a reservation usable once the root carrying it is durable.
    pub(crate) fn commit_reservation(&mut self, reservation: &Reservation) {
        self.seq_limit = self.seq_limit.max(reservation.seq);
        self.version_limit = self.version_limit.max(reservation.version);
        self.table.commit_reservation(&reservation.segments);
        debug_assert!(self.reserved_count() <= self.free_count());
        debug_assert!(self.next_seq <= self.seq_limit);
    }

    // --- Acquire and forfeit.

    /// Takes the oldest reserved free segment as a new incarnation, `Open`
    /// for a stream or `Dump` for a checkpoint; `None` if no reserved
    /// segment is left. The caller readies it on the medium.
    pub(crate) fn acquire(&mut self, state: SegmentState) -> Option<SegmentId> {
        let seq = self.next_seq;
        assert!(
            seq < self.seq_limit,
            "sequence reservation {} exhausted",
            self.seq_limit
        );
        let segment = self.table.allocate(seq, state)?;
        self.next_seq += 1;
        debug_assert_eq!(self.table.get(segment).seq, seq);
        debug_assert_eq!(self.table.get(segment).live_bytes, 0);
        Some(segment)
    }

    /// Gives back a segment a failed checkpoint acquired for its dump:
    /// free again, and still reserved, as the root that reserved it still
    /// names it.
    pub(crate) fn forfeit(&mut self, segment: SegmentId) {
        self.table.unallocate(segment);
    }

    // --- Accounting, by the state's mutation methods.

    /// A record was appended to an open segment, ending at `end_offset`.
    pub(crate) fn note_append(
        &mut self,
        segment: SegmentId,
        header: &RecordHeader,
        blocks: u64,
        end_offset: u64,
    ) {
        debug_assert!(end_offset <= self.segment_size_bytes);
        self.table.note_append(segment, header, blocks, end_offset);
        let len = header.record_len();
        self.log_bytes_since_checkpoint += len;
        if header.kind.is_range() {
            self.range_bytes_since_checkpoint += len;
        }
    }

    pub(crate) fn set_fill(&mut self, segment: SegmentId, fill_bytes: u64) {
        debug_assert!(fill_bytes <= self.segment_size_bytes);
        self.table.set_fill(segment, fill_bytes);
    }

    pub(crate) fn seal(&mut self, segment: SegmentId, fill_bytes: u64) {
        self.table.seal(segment, fill_bytes);
    }

    /// `bytes` of cold-data records were appended to `segment`.
    pub(crate) fn add_cold(&mut self, segment: SegmentId, bytes: u64) {
        self.table.add_cold(segment, bytes);
    }

    /// `bytes` in `segment` became live (a map entry points at them).
    /// Lists the shared table's cell `key` in `segment`'s summary (its
    /// member became shared).
    pub(crate) fn add_member(&mut self, segment: SegmentId, key: u64) {
        self.table.add_member(segment, key);
    }

    pub(crate) fn add_live(&mut self, segment: SegmentId, bytes: u64) {
        self.table.add_live(segment, bytes);
        let info = self.table.get(segment);
        debug_assert!(
            info.live_bytes <= info.fill_bytes,
            "segment {segment}: {} live bytes of {} written",
            info.live_bytes,
            info.fill_bytes
        );
    }

    /// `bytes` in `segment` stopped being live: the record that replaced
    /// them is in a stream buffer, so the next barrier makes that durable.
    pub(crate) fn kill(&mut self, segment: SegmentId, bytes: u64) {
        self.table.sub_live(segment, bytes, self.barrier_gen + 1);
    }

    /// A barrier wrote everything buffered; returns its generation.
    pub(crate) fn note_barrier(&mut self) -> u64 {
        self.barrier_gen += 1;
        self.barrier_gen
    }

    // --- Release.

    /// Frees reclaimable segments once barrier `gen` is durable.
    pub(crate) fn note_synced(&mut self, gen: u64) {
        debug_assert!(
            gen <= self.barrier_gen,
            "synced {gen} of {}",
            self.barrier_gen
        );
        self.synced_gen = self.synced_gen.max(gen);
        self.table.release_reclaimable(self.synced_gen);
    }

    /// A cleaned victim, emptied of live records: free at once if nothing
    /// was copied out of it and every write that emptied it is durable;
    /// after the next checkpoint if recovery may need a range record the
    /// cleaner could not relocate (`after_checkpoint`); otherwise once the
    /// next barrier, which makes its relocations durable, is synced.
    pub(crate) fn retire(
        &mut self,
        victim: SegmentId,
        relocated_bytes: u64,
        after_checkpoint: bool,
    ) {
        let info = *self.table.get(victim);
        assert_eq!(info.live_bytes, 0, "victim {victim} still has live bytes");
        assert_eq!(info.state, SegmentState::Sealed, "victim {victim}");
        if after_checkpoint {
            self.table.mark_reclaimable(victim, PARKED);
        } else if relocated_bytes == 0 && info.killed_gen <= self.synced_gen {
            // Typically a flushed TRIM or overwrite: no barrier needs to wait.
            self.table.release(victim);
        } else {
            self.table.mark_reclaimable(victim, self.barrier_gen + 1);
        }
    }

    /// Frees a segment nothing refers to any more (a replaced root's dump).
    pub(crate) fn release(&mut self, segment: SegmentId) {
        debug_assert_eq!(self.table.get(segment).state, SegmentState::Dump);
        self.table.release(segment);
    }

    /// A checkpoint is durable: range records before it are no longer
    /// needed, and parked victims wait only for the next barrier.
    pub(crate) fn note_checkpoint(&mut self) {
        self.log_bytes_since_checkpoint = 0;
        self.range_bytes_since_checkpoint = 0;
        self.table.unpark(self.barrier_gen + 1);
    }

    // --- Floors and the ladder.

    /// Segments the next checkpoint's two dump copies need, once
    /// `extra_blocks` more blocks may have been mapped: each chunk they
    /// touch may split a leaf in three.
    pub(crate) fn dump_segments(&self, map_pages: u64, extra_blocks: u64) -> u64 {
        let extra_pages = 2 * (extra_blocks.div_ceil(CHUNK_BLOCKS) + 2);
        dump_segments_for(
            map_pages + extra_pages,
            self.table.len() as u64,
            self.segment_size_bytes,
        )
    }

    /// Free segments `writer` must leave untouched.
    pub(crate) fn floor(&self, writer: Writer, map_pages: u64) -> u64 {
        match writer {
            Writer::Host { blocks } => GC_RESERVE_SEGMENTS + self.dump_segments(map_pages, blocks),
            Writer::Range => self.dump_segments(map_pages, 0),
            // Cleaning borrows at most one of the checkpoint's segments
            // (see `fits`), and returns it once its victim is released,
            // so a checkpoint is delayed at worst, never prevented.
            Writer::Cleaner => self.dump_segments(map_pages, 0).saturating_sub(1),
            Writer::Checkpoint | Writer::Background { .. } => 0,
        }
    }

    /// True if `need` finds enough free segments above its floor.
    pub(crate) fn segments_fit(&self, need: &Need, floor: u64) -> bool {
        let free = self.free_count();
        match need.writer {
            // The cleaner may always take one segment, since releasing the
            // victim gives one back: a cleaning that takes no more than it
            // returns can run at any fill. Without that, a checkpoint that
            // leaves fewer free segments than the floor (the first one,
            // with no older dump to release) would wedge a full volume.
            Writer::Cleaner => {
                need.segments == 0
                    || free >= need.segments + floor
                    || (need.segments == 1 && free >= 1)
            }
            Writer::Background { low, high, active } => {
                let target = if active { high } else { low };
                free + self.reclaimable_count() >= target
            }
            _ => need.segments == 0 || free >= floor + need.segments,
        }
    }

    /// True if renewing the reservations now would let `need` go ahead,
    /// or they run low.
    fn renewal_helps(&self, need: &Need) -> bool {
        let reserved = self.reserved_count();
        let more_to_reserve = reserved < need.segments && self.free_count() > reserved;
        more_to_reserve
            || self.reservation_low()
            || !self.numbering_room(need.segments, need.versions)
    }

    /// What changes when anyone makes progress: free and reclaimable
    /// segments, and the versions host writes and relocations number.
    pub(crate) fn progress_mark(&self) -> (u64, u64, u64) {
        (
            self.free_count(),
            self.reclaimable_count(),
            self.next_version,
        )
    }

    /// Garbage the sealed segments hold in victims of at least
    /// `min_garbage_bytes` (what cleaning could give back).
    fn garbage_bytes(&self, min_garbage_bytes: u64) -> u64 {
        self.table
            .iter()
            .filter(|(_, info)| info.state == SegmentState::Sealed)
            .map(|(_, info)| self.segment_size_bytes - info.live_bytes)
            .filter(|&garbage| garbage >= min_garbage_bytes)
            .sum()
    }

    /// True if cleaning could give `need` its bytes: everything free,
    /// reclaimable and collectable above its floor is enough.
    fn cleaning_can_help(&self, need: &Need, floor: u64, outlook: &Outlook) -> bool {
        if need.bytes == 0 {
            return true;
        }
        let segments = (self.free_count() + self.reclaimable_count()).saturating_sub(floor);
        let available = segments * self.segment_size_bytes
            + outlook.stream_room
            + self.garbage_bytes(self.foreground_min_garbage());
        available >= need.bytes + self.max_record_len
    }

    /// True if only a checkpoint gives back some space: trims kept for
    /// recovery, victims parked for it.
    fn checkpoint_frees_space(&self) -> bool {
        self.range_bytes_since_checkpoint > 0 || self.parked_count() > 0
    }

    /// True when the background thread should checkpoint: the log since
    /// the last one is long (recovery would replay it all), dirty map
    /// leaves hold too much RAM, or space only a checkpoint gives back has
    /// grown.
    fn checkpoint_due(&self, outlook: &Outlook) -> bool {
        let log_capacity = self.segment_size_bytes * self.table.len() as u64;
        let range_limit = (log_capacity / 64).min(outlook.checkpoint_interval_bytes);
        self.log_bytes_since_checkpoint >= outlook.checkpoint_interval_bytes
            || outlook.map_dirty_over_cache
            || self.range_bytes_since_checkpoint >= range_limit
            || self.parked_count() > 0
    }

    /// The ladder: what `need` should try next, or `None` if it may go
    /// ahead (for the background thread: if it has nothing to do).
    ///
    /// 1. Renew the reservations, when that is what is missing (or they
    ///    run low). The background thread also checkpoints here when one
    ///    is due.
    /// 2. Go ahead, if the free segments above the floor suffice.
    /// 3. Flush, if segments wait only for a barrier to be free.
    /// 4. Clean a victim, unless all the garbage there is would not make
    ///    enough room, or the last step found none.
    /// 5. Checkpoint, once, if only a checkpoint frees some space.
    /// 6. Full.
    pub(crate) fn next_rung(
        &self,
        need: &Need,
        outlook: &Outlook,
        reach: Reach,
        climbed: &Climbed,
    ) -> Option<Rung> {
        let floor = self.floor(need.writer, outlook.map_pages);
        let background = matches!(need.writer, Writer::Background { .. });
        if background {
            if self.reservation_low() {
                return Some(Rung::Renew {
                    segments: 0,
                    versions: 0,
                });
            }
            if self.checkpoint_due(outlook) {
                return Some(Rung::Checkpoint);
            }
        } else if !self.numbering_room(need.segments, need.versions)
            || (!climbed.renewed && self.renewal_helps(need))
        {
            return Some(Rung::Renew {
                segments: need.segments,
                versions: need.versions,
            });
        }
        let reserved = background || self.reserved_count() >= need.segments;
        if reserved && self.segments_fit(need, floor) {
            return None;
        }
        let flush_below = match need.writer {
            Writer::Background { low, .. } => low,
            _ => u64::MAX,
        };
        if self.reclaimable_count() > 0 && self.free_count() < flush_below {
            return Some(Rung::Flush);
        }
        if reach == Reach::Nested {
            return Some(Rung::Full);
        }
        if background {
            if !outlook.recycling_ready {
                return Some(Rung::Full);
            }
            return Some(Rung::Clean {
                min_garbage_bytes: self.segment_size_bytes / 16,
            });
        }
        if !climbed.clean_failed && self.cleaning_can_help(need, floor, outlook) {
            return Some(Rung::Clean {
                min_garbage_bytes: self.foreground_min_garbage(),
            });
        }
        let checkpoint_may_help = need.writer != Writer::Checkpoint && !climbed.checkpointed;
        if checkpoint_may_help && self.checkpoint_frees_space() {
            return Some(Rung::Checkpoint);
        }
        Some(Rung::Full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RecordKind;

    const SEGMENT: u64 = 64 * 1024;

    fn barrier_and_sync(space: &mut Space) {
        let barrier = space.note_barrier();
        space.note_synced(barrier);
    }

    fn space(segments: u32) -> Space {
        let ahead = Ahead {
            seq: 64,
            version: 64 * 1024,
            segments: 8,
        };
        Space::new(SegmentTable::new(segments), SEGMENT, 1, 1, ahead)
    }

    fn reserve(space: &mut Space, segments: u64) {
        let reservation = space.propose_reservation(segments, 0);
        space.commit_reservation(&reservation);
    }

    fn outlook() -> Outlook {
        Outlook {
            map_pages: 1,
            stream_room: 0,
            checkpoint_interval_bytes: 1 << 30,
            map_dirty_over_cache: false,
            recycling_ready: true,
        }
    }

    fn host(segments: u64) -> Need {
        Need {
            writer: Writer::Host { blocks: 16 },
            segments,
            versions: 16,
            bytes: segments * SEGMENT,
        }
    }

    /// Fills `segment` with one data record and seals it, `live` bytes live.
    fn fill(space: &mut Space, live: u64) -> SegmentId {
        let segment = space.acquire(SegmentState::Open).unwrap();
        let header = RecordHeader {
            kind: RecordKind::Data,
            codec: 0,
            seg_seq: 0,
            lba: 0,
            version: space.take_version(),
            payload_len: 4096,
            crc: 0,
        };
        space.note_append(segment, &header, 1, SEGMENT);
        space.add_live(segment, live);
        space.seal(segment, SEGMENT);
        segment
    }

    #[test]
    fn nothing_is_taken_before_a_root_reserves_it() {
        let mut space = space(16);
        let need = host(1);
        assert_eq!(
            space.next_rung(&need, &outlook(), Reach::All, &Climbed::default()),
            Some(Rung::Renew {
                segments: 1,
                versions: 16
            })
        );
        reserve(&mut space, 1);
        assert_eq!(space.reserved_count(), 8, "a root reserves ahead");
        assert_eq!(
            space.next_rung(&need, &outlook(), Reach::All, &Climbed::default()),
            None
        );
    }

    #[test]
    fn the_ladder_flushes_then_cleans_then_checkpoints_then_gives_up() {
        let mut space = space(12);
        reserve(&mut space, 12);
        // Fill every segment the host may take, half of them half dead.
        let floor = space.floor(Writer::Host { blocks: 16 }, 1);
        let mut victims = Vec::new();
        while space.free_count() > floor {
            let live = if victims.len() % 2 == 0 {
                SEGMENT / 2
            } else {
                SEGMENT - 16
            };
            victims.push(fill(&mut space, live));
        }
        let mut climbed = Climbed {
            renewed: true,
            ..Climbed::default()
        };
        let need = host(1);
        let clean = Rung::Clean {
            min_garbage_bytes: space.foreground_min_garbage(),
        };
        assert_eq!(
            space.next_rung(&need, &outlook(), Reach::All, &climbed),
            Some(clean)
        );
        // Inside a cleaning step or a checkpoint, cleaning is out of reach.
        assert_eq!(
            space.next_rung(&need, &outlook(), Reach::Nested, &climbed),
            Some(Rung::Full)
        );
        // A cleaned victim waits for a barrier: flushing comes first.
        let victim = victims[0];
        space.table.sub_live(victim, SEGMENT / 2, 0);
        space.retire(victim, 4096, false);
        assert_eq!(space.reclaimable_count(), 1);
        assert_eq!(
            space.next_rung(&need, &outlook(), Reach::All, &climbed),
            Some(Rung::Flush)
        );
        barrier_and_sync(&mut space);
        assert_eq!(space.reclaimable_count(), 0);
        // No garbage worth cleaning and no checkpoint to help: full.
        climbed.note(clean, false);
        climbed.renewed = true;
        assert_eq!(
            space.next_rung(&host(20), &outlook(), Reach::All, &climbed),
            Some(Rung::Full)
        );
        // Trims kept for recovery: one checkpoint is worth trying.
        space.range_bytes_since_checkpoint = 48;
        assert_eq!(
            space.next_rung(&host(20), &outlook(), Reach::All, &climbed),
            Some(Rung::Checkpoint)
        );
        climbed.note(Rung::Checkpoint, true);
        climbed.note(clean, false);
        climbed.renewed = true;
        assert_eq!(
            space.next_rung(&host(20), &outlook(), Reach::All, &climbed),
            Some(Rung::Full)
        );
    }

    #[test]
    fn floors_order_the_writers() {
        let space = space(64);
        let host = space.floor(Writer::Host { blocks: 0 }, 4);
        let range = space.floor(Writer::Range, 4);
        let cleaner = space.floor(Writer::Cleaner, 4);
        let checkpoint = space.floor(Writer::Checkpoint, 4);
        assert_eq!(host, range + GC_RESERVE_SEGMENTS);
        assert_eq!(cleaner + 1, range);
        assert_eq!(checkpoint, 0);
        assert!(space.floor(Writer::Host { blocks: 1 << 20 }, 4) > host);
    }

    #[test]
    fn a_victim_comes_back_after_the_barrier_that_covers_it() {
        let mut space = space(8);
        reserve(&mut space, 8);
        let victim = fill(&mut space, 100);
        space.kill(victim, 100);
        space.retire(victim, 0, false);
        assert_eq!(
            space.segment(victim).state,
            SegmentState::Reclaimable { release_gen: 1 },
            "the write that emptied it is not durable yet"
        );
        barrier_and_sync(&mut space);
        assert_eq!(space.segment(victim).state, SegmentState::Free);

        let parked = fill(&mut space, 0);
        space.retire(parked, 0, true);
        barrier_and_sync(&mut space);
        assert_ne!(space.segment(parked).state, SegmentState::Free);
        space.note_checkpoint();
        barrier_and_sync(&mut space);
        assert_eq!(space.segment(parked).state, SegmentState::Free);
    }
}
