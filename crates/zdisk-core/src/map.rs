//! The logical-to-physical map.
//!
//! The map is sparse: a B-tree of chunks of [`CHUNK_BLOCKS`] blocks, created
//! only where blocks have been written, so its RAM grows with the data, not
//! with the logical size. A chunk whose blocks all share one state (all
//! zeros, or during recovery all trimmed) is stored as a single value.
//!
//! Every entry carries the version of the write that produced it. In normal
//! operation the newest write always wins, so versions only matter during
//! recovery, where records are replayed out of order and
//! [`Map::set_if_newer`] keeps the highest version; equal versions denote the
//! same data at a new location (a relocated copy), and the later one wins.
//! Recovery keeps trimmed entries as versioned tombstones so that an older
//! record replayed later cannot resurrect a trimmed block; [`Map::compact`]
//! drops them afterwards.
//!
//! Invariant: `data_blocks`, `zero_blocks`, `damaged_blocks` and
//! `stored_bytes` always equal what a full scan of the entries would count
//! (checked by `check_counts`).

use std::collections::BTreeMap;

use crate::units::{Lba, SegmentId};

pub(crate) const CHUNK_SHIFT: u32 = 8;
/// Blocks per map chunk (1 MiB of logical space).
pub(crate) const CHUNK_BLOCKS: u64 = 1 << CHUNK_SHIFT;
const CHUNK_MASK: u64 = CHUNK_BLOCKS - 1;

/// Where a block's record lives, and which of the record's blocks it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Location {
    pub segment: SegmentId,
    /// Byte offset of the record within the segment (a multiple of 16).
    pub offset: u32,
    /// Bytes the record occupies, alignment included (a multiple of 16).
    pub len: u32,
    /// The block's place among the record's blocks: 0 of 1 for a data
    /// record; `i` of `n` for block `lba + i` of a unit of `n`.
    pub member: u8,
    pub members: u8,
}

impl Location {
    /// A one-block record.
    pub(crate) fn record(segment: SegmentId, offset: u32, len: u32) -> Location {
        Location {
            segment,
            offset,
            len,
            member: 0,
            members: 1,
        }
    }

    /// Block `member` of a unit of `members` blocks.
    pub(crate) fn unit_member(
        segment: SegmentId,
        offset: u32,
        len: u32,
        member: u8,
        members: u8,
    ) -> Location {
        debug_assert!(member < members, "member {member} of {members}");
        Location {
            segment,
            offset,
            len,
            member,
            members,
        }
    }

    /// The record's bytes this block accounts for in live and stored
    /// bytes: all of a one-block record; an equal share of a unit (the
    /// shares of a unit's blocks add up to its length exactly).
    pub(crate) fn share(self) -> u64 {
        let (len, member, members) = (self.len as u64, self.member as u64, self.members as u64);
        len * (member + 1) / members - len * member / members
    }

    /// Block `member` of `members` of the record here.
    pub(crate) fn with_member_of(self, member: u8, members: u8) -> Location {
        Location::unit_member(self.segment, self.offset, self.len, member, members)
    }

    /// Where the record starts: the same for all of a unit's blocks.
    pub(crate) fn record_key(self) -> (SegmentId, u32) {
        (self.segment, self.offset)
    }
}

/// The state of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Unwritten or trimmed: reads as zeros, not allocated.
    Hole,
    /// Allocated zeros: reads as zeros, takes no payload space.
    Zero,
    Data(Location),
    /// Its data was found damaged; reads fail until it is rewritten.
    Damaged,
}

/// The states a whole range can be set to at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RangeState {
    Hole,
    Zero,
    Damaged,
}

impl RangeState {
    pub(crate) fn slot(self) -> Slot {
        match self {
            RangeState::Hole => Slot::Hole,
            RangeState::Zero => Slot::Zero,
            RangeState::Damaged => Slot::Damaged,
        }
    }
}

const STATE_HOLE: u64 = 0;
const STATE_ZERO: u64 = 1;
const STATE_DATA: u64 = 2;
const STATE_DAMAGED: u64 = 3;
/// Versions are stored in 48 bits.
pub(crate) const VERSION_MAX: u64 = (1 << 48) - 1;
/// Segments an entry can name: 24 bits (`MediaGeometry` enforces it).
pub(crate) const SEGMENTS_MAX: u32 = 1 << 24;
/// Records are at most this long: 14 bits of 16-byte units.
const LEN_MAX: u32 = ((1 << 14) - 1) * 16;
/// Offsets within a segment: 30 bits of 16-byte units.
const OFFSET_UNITS_MAX: u64 = (1 << 30) - 1;

/// One packed entry: 16 bytes.
/// `w0` = segment(24) << 40 | (members − 1)(5) << 35 | member(5) << 30 |
/// offset/16 (30); `w1` = version(48) << 16 | len/16 (14) << 2 | state(2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Entry {
    pub w0: u64,
    pub w1: u64,
}

impl Entry {
    pub(crate) fn new(slot: Slot, version: u64) -> Entry {
        assert!(version <= VERSION_MAX, "version {version} exceeds 48 bits");
        let entry = Entry::pack(slot, version);
        debug_assert!(entry.is_well_formed(), "{slot:?} v{version} packs badly");
        debug_assert_eq!(entry.slot(), slot);
        debug_assert_eq!(entry.version(), version);
        entry
    }

    fn pack(slot: Slot, version: u64) -> Entry {
        match slot {
            Slot::Hole => Entry {
                w0: 0,
                w1: version << 16 | STATE_HOLE,
            },
            Slot::Zero => Entry {
                w0: 0,
                w1: version << 16 | STATE_ZERO,
            },
            Slot::Damaged => Entry {
                w0: 0,
                w1: version << 16 | STATE_DAMAGED,
            },
            Slot::Data(loc) => {
                assert!(
                    loc.len > 0 && loc.len <= LEN_MAX && loc.len.is_multiple_of(16),
                    "record length {} out of range",
                    loc.len
                );
                assert!(
                    loc.segment.0 < SEGMENTS_MAX,
                    "segment {} beyond 24 bits",
                    loc.segment
                );
                assert!(
                    loc.offset.is_multiple_of(16) && (loc.offset as u64 / 16) <= OFFSET_UNITS_MAX,
                    "record offset {} out of range",
                    loc.offset
                );
                assert!(
                    (1..=32).contains(&loc.members) && loc.member < loc.members,
                    "member {} of {}",
                    loc.member,
                    loc.members
                );
                Entry {
                    w0: ((loc.segment.0 as u64) << 40)
                        | (((loc.members - 1) as u64) << 35)
                        | ((loc.member as u64) << 30)
                        | (loc.offset as u64 / 16),
                    w1: version << 16 | (loc.len as u64 / 16) << 2 | STATE_DATA,
                }
            }
        }
    }

    pub(crate) fn slot(self) -> Slot {
        match self.w1 & 3 {
            STATE_HOLE => Slot::Hole,
            STATE_ZERO => Slot::Zero,
            STATE_DAMAGED => Slot::Damaged,
            _ => Slot::Data(Location {
                segment: SegmentId((self.w0 >> 40) as u32),
                offset: ((self.w0 & OFFSET_UNITS_MAX) * 16) as u32,
                len: (((self.w1 >> 2) & 0x3FFF) * 16) as u32,
                member: ((self.w0 >> 30) & 31) as u8,
                members: ((self.w0 >> 35) & 31) as u8 + 1,
            }),
        }
    }

    pub(crate) fn version(self) -> u64 {
        self.w1 >> 16
    }

    /// True if the bits are laid out as `new` lays them out.
    fn is_well_formed(self) -> bool {
        match self.w1 & 3 {
            STATE_DATA => {
                let len_units = (self.w1 >> 2) & 0x3FFF;
                let member = (self.w0 >> 30) & 31;
                let members = ((self.w0 >> 35) & 31) + 1;
                len_units > 0 && member < members
            }
            _ => self.w0 == 0 && (self.w1 >> 2) & 0x3FFF == 0,
        }
    }
}

/// A chunk of [`CHUNK_BLOCKS`] entries.
#[derive(Debug, Clone)]
pub(crate) enum Chunk {
    /// Every block in this state at this version.
    Uniform {
        state: RangeState,
        version: u64,
    },
    Mixed(Box<[Entry; CHUNK_BLOCKS as usize]>),
}

/// Block counts by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct MapCounts {
    pub data_blocks: u64,
    pub zero_blocks: u64,
    pub damaged_blocks: u64,
    pub stored_bytes: u64,
}

impl MapCounts {
    fn add(&mut self, slot: Slot, count: u64) {
        match slot {
            Slot::Hole => {}
            Slot::Zero => self.zero_blocks += count,
            Slot::Damaged => self.damaged_blocks += count,
            Slot::Data(loc) => {
                self.data_blocks += count;
                self.stored_bytes += loc.share() * count;
            }
        }
    }

    fn sub(&mut self, slot: Slot, count: u64) {
        match slot {
            Slot::Hole => {}
            Slot::Zero => self.zero_blocks -= count,
            Slot::Damaged => self.damaged_blocks -= count,
            Slot::Data(loc) => {
                self.data_blocks -= count;
                self.stored_bytes -= loc.share() * count;
            }
        }
    }
}

/// The sparse logical-to-physical map.
pub(crate) struct Map {
    chunks: BTreeMap<u64, Chunk>,
    counts: MapCounts,
    /// Keep trimmed entries with their versions (during recovery).
    keep_tombstones: bool,
    mixed_chunks: u64,
}

impl Map {
    pub(crate) fn new(keep_tombstones: bool) -> Map {
        Map {
            chunks: BTreeMap::new(),
            counts: MapCounts::default(),
            keep_tombstones,
            mixed_chunks: 0,
        }
    }

    pub(crate) fn counts(&self) -> MapCounts {
        self.counts
    }

    /// Approximate heap bytes used.
    pub(crate) fn memory_bytes(&self) -> u64 {
        let node_overhead = 48u64;
        self.chunks.len() as u64 * (std::mem::size_of::<Chunk>() as u64 + 8 + node_overhead)
            + self.mixed_chunks * std::mem::size_of::<[Entry; CHUNK_BLOCKS as usize]>() as u64
    }

    pub(crate) fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The entry for `lba` (a hole at version 0 if never written).
    pub(crate) fn get(&self, lba: Lba) -> Entry {
        match self.chunks.get(&(lba.0 >> CHUNK_SHIFT)) {
            None => Entry::default(),
            Some(Chunk::Uniform { state, version }) => Entry::new(state.slot(), *version),
            Some(Chunk::Mixed(entries)) => entries[(lba.0 & CHUNK_MASK) as usize],
        }
    }

    fn mixed_entry(&mut self, lba: Lba) -> &mut Entry {
        let index = lba.0 >> CHUNK_SHIFT;
        let chunk = self.chunks.entry(index).or_insert(Chunk::Uniform {
            state: RangeState::Hole,
            version: 0,
        });
        if let Chunk::Uniform { state, version } = *chunk {
            *chunk = Chunk::Mixed(Box::new(
                [Entry::new(state.slot(), version); CHUNK_BLOCKS as usize],
            ));
            self.mixed_chunks += 1;
        }
        match chunk {
            Chunk::Mixed(entries) => &mut entries[(lba.0 & CHUNK_MASK) as usize],
            Chunk::Uniform { .. } => unreachable!(),
        }
    }

    /// Sets one block unconditionally; returns the previous entry.
    pub(crate) fn set(&mut self, lba: Lba, slot: Slot, version: u64) -> Entry {
        let new = Entry::new(slot, version);
        let entry = self.mixed_entry(lba);
        let old = *entry;
        *entry = new;
        self.counts.sub(old.slot(), 1);
        self.counts.add(slot, 1);
        if slot == Slot::Hole && !self.keep_tombstones {
            self.drop_chunk_if_empty(lba.0 >> CHUNK_SHIFT);
        }
        old
    }

    /// Sets one block if `version` is at least the current version; returns
    /// the previous entry if it was replaced.
    pub(crate) fn set_if_newer(&mut self, lba: Lba, slot: Slot, version: u64) -> Option<Entry> {
        if self.get(lba).version() > version {
            return None;
        }
        Some(self.set(lba, slot, version))
    }

    fn drop_chunk_if_empty(&mut self, index: u64) {
        let empty = match self.chunks.get(&index) {
            Some(Chunk::Mixed(entries)) => entries.iter().all(|e| e.slot() == Slot::Hole),
            Some(Chunk::Uniform { state, .. }) => *state == RangeState::Hole,
            None => false,
        };
        if empty {
            if let Some(Chunk::Mixed(_)) = self.chunks.remove(&index) {
                self.mixed_chunks -= 1;
            }
        }
    }

    /// Sets `count` blocks from `first` to `state`, calling `displaced` with
    /// every data location that stops being referenced. With `only_newer`,
    /// blocks holding a higher version are left alone (recovery).
    pub(crate) fn set_range(
        &mut self,
        first: Lba,
        count: u64,
        state: RangeState,
        version: u64,
        only_newer: bool,
        displaced: &mut dyn FnMut(Location),
    ) {
        let end = first.0.checked_add(count).expect("range overflows");
        let mut lba = first.0;
        while lba < end {
            let index = lba >> CHUNK_SHIFT;
            let chunk_start = index << CHUNK_SHIFT;
            let chunk_end = chunk_start + CHUNK_BLOCKS;
            let run_end = end.min(chunk_end);
            let whole = lba == chunk_start && run_end == chunk_end;
            let drop_whole = whole && state == RangeState::Hole && !self.keep_tombstones;
            if whole && (drop_whole || !only_newer || self.chunk_max_version(index) <= version) {
                // Replace the whole chunk at once.
                let old = if drop_whole {
                    self.chunks.remove(&index)
                } else {
                    self.chunks.insert(index, Chunk::Uniform { state, version })
                };
                match old {
                    Some(Chunk::Mixed(entries)) => {
                        self.mixed_chunks -= 1;
                        for entry in entries.iter() {
                            let slot = entry.slot();
                            self.counts.sub(slot, 1);
                            if let Slot::Data(loc) = slot {
                                displaced(loc);
                            }
                        }
                    }
                    Some(Chunk::Uniform {
                        state: old_state, ..
                    }) => {
                        self.counts.sub(old_state.slot(), CHUNK_BLOCKS);
                    }
                    None => {}
                }
                if !drop_whole {
                    self.counts.add(state.slot(), CHUNK_BLOCKS);
                }
            } else if !self.chunks.contains_key(&index)
                && state == RangeState::Hole
                && !self.keep_tombstones
            {
                // Trimming blocks that were never written: nothing to do.
            } else {
                for block in lba..run_end {
                    let replaced = if only_newer {
                        self.set_if_newer(Lba(block), state.slot(), version)
                    } else {
                        Some(self.set(Lba(block), state.slot(), version))
                    };
                    if let Some(old) = replaced {
                        if let Slot::Data(loc) = old.slot() {
                            displaced(loc);
                        }
                    }
                }
                if state == RangeState::Hole && !self.keep_tombstones {
                    self.drop_chunk_if_empty(index);
                }
            }
            lba = run_end;
        }
    }

    fn chunk_max_version(&self, index: u64) -> u64 {
        match self.chunks.get(&index) {
            None => 0,
            Some(Chunk::Uniform { version, .. }) => *version,
            Some(Chunk::Mixed(entries)) => entries.iter().map(|e| e.version()).max().unwrap_or(0),
        }
    }

    /// Calls `f` with each block's entry in `first..first+count`, in order.
    pub(crate) fn for_each_in(&self, first: Lba, count: u64, mut f: impl FnMut(Lba, Entry)) {
        let end = first.0 + count;
        let mut lba = first.0;
        while lba < end {
            let index = lba >> CHUNK_SHIFT;
            let run_end = end.min((index + 1) << CHUNK_SHIFT);
            match self.chunks.get(&index) {
                None => (lba..run_end).for_each(|b| f(Lba(b), Entry::default())),
                Some(Chunk::Uniform { state, version }) => {
                    let entry = Entry::new(state.slot(), *version);
                    (lba..run_end).for_each(|b| f(Lba(b), entry));
                }
                Some(Chunk::Mixed(entries)) => {
                    (lba..run_end).for_each(|b| f(Lba(b), entries[(b & CHUNK_MASK) as usize]))
                }
            }
            lba = run_end;
        }
    }

    /// Runs of equal state starting at `first`, for block status: returns
    /// (state, blocks) pairs covering at most `count` blocks and `max_runs` runs.
    /// Large unwritten areas are skipped without visiting each block.
    pub(crate) fn runs(&self, first: Lba, count: u64, max_runs: usize) -> Vec<(Slot, u64)> {
        let end = first.0.saturating_add(count);
        let mut runs: Vec<(Slot, u64)> = Vec::new();
        let push = |runs: &mut Vec<(Slot, u64)>, slot: Slot, blocks: u64| {
            let kind = match slot {
                Slot::Data(_) => Slot::Data(Location::record(SegmentId(0), 0, 16)),
                other => other,
            };
            match runs.last_mut() {
                Some((last, n)) if *last == kind => *n += blocks,
                _ => runs.push((kind, blocks)),
            }
        };
        let mut lba = first.0;
        while lba < end && runs.len() <= max_runs {
            let index = lba >> CHUNK_SHIFT;
            match self.chunks.range(index..).next() {
                None => {
                    push(&mut runs, Slot::Hole, end - lba);
                    lba = end;
                }
                Some((&next, chunk)) => {
                    let next_start = next << CHUNK_SHIFT;
                    if next_start > lba {
                        let gap_end = next_start.min(end);
                        push(&mut runs, Slot::Hole, gap_end - lba);
                        lba = gap_end;
                        continue;
                    }
                    let run_end = end.min(next_start + CHUNK_BLOCKS);
                    match chunk {
                        Chunk::Uniform { state, .. } => {
                            push(&mut runs, state.slot(), run_end - lba)
                        }
                        Chunk::Mixed(entries) => {
                            for b in lba..run_end {
                                push(&mut runs, entries[(b & CHUNK_MASK) as usize].slot(), 1);
                            }
                        }
                    }
                    lba = run_end;
                }
            }
        }
        runs.truncate(max_runs.max(1));
        runs
    }

    /// True if some block in the range holds exactly `version` (the record
    /// with that version still determines it).
    pub(crate) fn any_at_version(&self, first: Lba, count: u64, version: u64) -> bool {
        self.any_in(first, count, |entry_version| entry_version == version)
    }

    /// True if every block in the range holds a version newer than `version`
    /// (a record with that version no longer determines any of them).
    pub(crate) fn all_newer_than(&self, first: Lba, count: u64, version: u64) -> bool {
        !self.any_in(first, count, |entry_version| entry_version <= version)
    }

    fn any_in(&self, first: Lba, count: u64, test: impl Fn(u64) -> bool) -> bool {
        let end = first.0.saturating_add(count);
        let mut lba = first.0;
        while lba < end {
            let index = lba >> CHUNK_SHIFT;
            let run_end = end.min((index + 1) << CHUNK_SHIFT);
            let hit = match self.chunks.get(&index) {
                None => test(0),
                Some(Chunk::Uniform { version, .. }) => test(*version),
                Some(Chunk::Mixed(entries)) => {
                    (lba..run_end).any(|b| test(entries[(b & CHUNK_MASK) as usize].version()))
                }
            };
            if hit {
                return true;
            }
            lba = run_end;
        }
        false
    }

    /// Every chunk in block order (for checkpoint dumps and checks).
    pub(crate) fn chunks(&self) -> impl Iterator<Item = (u64, &Chunk)> {
        self.chunks.iter().map(|(index, chunk)| (*index, chunk))
    }

    /// Installs a chunk read from a checkpoint; a chunk listed twice is an error.
    pub(crate) fn insert_chunk(&mut self, index: u64, chunk: Chunk) -> Result<(), String> {
        if self.chunks.contains_key(&index) {
            return Err(format!("map chunk {index} appears twice"));
        }
        match &chunk {
            Chunk::Uniform { state, .. } => self.counts.add(state.slot(), CHUNK_BLOCKS),
            Chunk::Mixed(entries) => {
                self.mixed_chunks += 1;
                for entry in entries.iter() {
                    self.counts.add(entry.slot(), 1);
                }
            }
        }
        self.chunks.insert(index, chunk);
        Ok(())
    }

    /// Every data block and its location.
    pub(crate) fn for_each_data(&self, mut f: impl FnMut(Lba, Location, u64)) {
        for (&index, chunk) in &self.chunks {
            if let Chunk::Mixed(entries) = chunk {
                for (i, entry) in entries.iter().enumerate() {
                    if let Slot::Data(loc) = entry.slot() {
                        f(Lba((index << CHUNK_SHIFT) + i as u64), loc, entry.version());
                    }
                }
            }
        }
    }

    /// Every damaged block.
    pub(crate) fn for_each_damaged(&self, mut f: impl FnMut(Lba)) {
        for (&index, chunk) in &self.chunks {
            match chunk {
                Chunk::Uniform {
                    state: RangeState::Damaged,
                    ..
                } => (0..CHUNK_BLOCKS).for_each(|i| f(Lba((index << CHUNK_SHIFT) + i))),
                Chunk::Uniform { .. } => {}
                Chunk::Mixed(entries) => {
                    for (i, entry) in entries.iter().enumerate() {
                        if entry.slot() == Slot::Damaged {
                            f(Lba((index << CHUNK_SHIFT) + i as u64));
                        }
                    }
                }
            }
        }
    }

    /// Drops tombstones and switches to normal operation (end of recovery).
    pub(crate) fn compact(&mut self) {
        self.keep_tombstones = false;
        let indices: Vec<u64> = self.chunks.keys().copied().collect();
        for index in indices {
            self.drop_chunk_if_empty(index);
        }
    }

    /// Recounts everything from scratch and compares with the running totals.
    pub(crate) fn check_counts(&self) -> Result<(), String> {
        let mut counts = MapCounts::default();
        for chunk in self.chunks.values() {
            match chunk {
                Chunk::Uniform { state, .. } => counts.add(state.slot(), CHUNK_BLOCKS),
                Chunk::Mixed(entries) => entries.iter().for_each(|e| counts.add(e.slot(), 1)),
            }
        }
        if counts != self.counts {
            return Err(format!(
                "map counts drifted: running {:?}, recount {:?}",
                self.counts, counts
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(segment: u32, offset: u32, len: u32) -> Slot {
        Slot::Data(Location::record(SegmentId(segment), offset, len))
    }

    #[test]
    fn entries_pack_and_unpack() {
        for slot in [
            Slot::Hole,
            Slot::Zero,
            Slot::Damaged,
            loc(7, 123_456, 4128),
            loc(SEGMENTS_MAX - 1, u32::MAX - 15, 48),
            Slot::Data(Location::unit_member(
                SegmentId(3),
                1 << 20,
                LEN_MAX,
                31,
                32,
            )),
            Slot::Data(Location::unit_member(SegmentId(0), 0, 16, 0, 2)),
        ] {
            let entry = Entry::new(slot, VERSION_MAX);
            assert_eq!(entry.slot(), slot);
            assert_eq!(entry.version(), VERSION_MAX);
            assert!(entry.is_well_formed());
        }
    }

    #[test]
    fn unit_shares_add_up_to_the_record() {
        for (len, members) in [(4128u32, 1u8), (16, 2), (30_000, 7), (LEN_MAX, 32)] {
            let total: u64 = (0..members)
                .map(|m| Location::unit_member(SegmentId(1), 0, len, m, members).share())
                .sum();
            assert_eq!(total, len as u64, "{len} bytes over {members}");
        }
    }

    #[test]
    fn unwritten_space_costs_no_memory() {
        let map = Map::new(false);
        assert_eq!(map.get(Lba(1 << 40)).slot(), Slot::Hole);
        assert_eq!(map.memory_bytes(), 0);
        assert_eq!(map.runs(Lba(0), 1 << 40, 10), vec![(Slot::Hole, 1 << 40)]);
    }

    #[test]
    fn set_and_trim_keep_counts_and_free_chunks() {
        let mut map = Map::new(false);
        map.set(Lba(5), loc(1, 0, 112), 1);
        map.set(Lba(6), Slot::Zero, 2);
        assert_eq!(map.counts().data_blocks, 1);
        assert_eq!(map.counts().stored_bytes, 112);
        assert_eq!(map.counts().zero_blocks, 1);
        let mut freed = Vec::new();
        map.set_range(Lba(0), 10, RangeState::Hole, 3, false, &mut |l| {
            freed.push(l)
        });
        assert_eq!(freed.len(), 1);
        assert_eq!(map.counts(), MapCounts::default());
        assert_eq!(map.chunk_count(), 0, "an all-hole chunk is dropped");
        map.check_counts().unwrap();
    }

    #[test]
    fn whole_chunk_ranges_are_stored_compactly() {
        let mut map = Map::new(false);
        map.set(Lba(300), loc(2, 16, 64), 1);
        let mut freed = Vec::new();
        map.set_range(Lba(0), 1 << 20, RangeState::Zero, 2, false, &mut |l| {
            freed.push(l)
        });
        assert_eq!(freed.len(), 1);
        assert_eq!(map.counts().zero_blocks, 1 << 20);
        assert_eq!(map.chunk_count(), (1 << 20) / CHUNK_BLOCKS as usize);
        assert!(map.memory_bytes() < 16 * 4096 * 8);
        assert_eq!(map.runs(Lba(10), 100, 10), vec![(Slot::Zero, 100)]);
        map.check_counts().unwrap();
    }

    #[test]
    fn recovery_keeps_the_highest_version() {
        let mut map = Map::new(true);
        map.set_if_newer(Lba(1), loc(1, 0, 48), 10);
        assert!(map.set_if_newer(Lba(1), loc(2, 0, 48), 9).is_none());
        map.set_range(Lba(0), 4, RangeState::Hole, 12, true, &mut |_| {});
        assert_eq!(map.get(Lba(1)).slot(), Slot::Hole);
        assert_eq!(
            map.get(Lba(1)).version(),
            12,
            "the tombstone keeps its version"
        );
        assert!(
            map.set_if_newer(Lba(1), loc(3, 0, 48), 11).is_none(),
            "an older write cannot resurrect"
        );
        assert!(
            map.set_if_newer(Lba(1), loc(3, 0, 48), 12).is_some(),
            "equal versions: later copy wins"
        );
        map.compact();
        map.check_counts().unwrap();
    }

    #[test]
    fn runs_merge_equal_states() {
        let mut map = Map::new(false);
        for lba in 10..20 {
            map.set(Lba(lba), loc(1, lba as u32 * 64, 64), lba);
        }
        map.set(Lba(20), Slot::Zero, 50);
        let runs = map.runs(Lba(0), 1000, 100);
        let kinds: Vec<u64> = runs.iter().map(|r| r.1).collect();
        assert_eq!(kinds, vec![10, 10, 1, 979]);
        assert_eq!(map.runs(Lba(0), 1000, 2).len(), 2);
    }
}
