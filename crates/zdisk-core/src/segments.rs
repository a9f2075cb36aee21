//! The segment table: the state, incarnation and live bytes of every segment.
//!
//! Life of a segment: `Free` → (erase) `Open` for one writer stream →
//! `Sealed` when full → picked by the cleaner, its live records relocated →
//! `Reclaimable` until a durability barrier makes the relocations and every
//! write that superseded its dead records durable → `Free` again. Segments
//! holding a checkpoint's map dump are `Dump` until a newer checkpoint is
//! durable.
//!
//! Invariant: `live_bytes` of a segment equals the sum of the record lengths
//! of map entries pointing into it (checked by `Volume::check`).
//!
//! This is the table's data; the decisions (which segment may be taken,
//! by whom, and when one comes back) belong to `volume::space::Space`,
//! the only caller of the mutating methods.

use std::collections::VecDeque;

use crate::record::{RecordHeader, RecordKind};
use crate::units::SegmentId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SegmentState {
    Free,
    Open,
    Sealed,
    Dump,
    /// Cleaned; becomes free once barrier generation `release_gen` is durable.
    Reclaimable {
        release_gen: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegmentInfo {
    pub state: SegmentState,
    /// Sequence number of the current incarnation (0 if never written).
    pub seq: u64,
    pub live_bytes: u64,
    /// Bytes written so far (a page multiple once sealed).
    pub fill_bytes: u64,
    /// Highest version of any record written into this incarnation.
    pub max_version: u64,
    /// The incarnation holds trim, zero, damaged or reference records
    /// (written in this run or found by recovery's replay).
    pub holds_ranges: bool,
    /// Bytes of range records appended in this run.
    pub range_bytes: u64,
    /// The barrier generation whose sync makes durable every write that
    /// made a record of this incarnation dead in this run (0: none did).
    /// Once it is synced, a cleaned victim that relocated nothing can be
    /// reused at once.
    pub killed_gen: u64,
    /// Bytes appended by the cold-data pass (stronger codec): a segment
    /// mostly of these is not worth recompressing again.
    pub cold_bytes: u64,
    /// Bytes of data and unit records written below full effort (issue #27,
    /// the codec byte's `CODEC_FAST_EFFORT`): the cold-data pass rewrites
    /// the segments that hold them first.
    pub fast_bytes: u64,
}

impl SegmentInfo {
    /// A segment never written, or erased.
    pub(crate) fn free() -> SegmentInfo {
        SegmentInfo::fresh(SegmentState::Free, 0)
    }

    /// A new incarnation `seq` in `state`, nothing written yet.
    fn fresh(state: SegmentState, seq: u64) -> SegmentInfo {
        SegmentInfo {
            state,
            seq,
            live_bytes: 0,
            fill_bytes: 0,
            max_version: 0,
            holds_ranges: false,
            range_bytes: 0,
            killed_gen: 0,
            cold_bytes: 0,
            fast_bytes: 0,
        }
    }
}

/// The release generation of a cleaned segment that must wait for a
/// checkpoint (its trims could not all be relocated).
pub(crate) const PARKED: u64 = u64::MAX;

/// One segment's summary: the blocks of the data records appended to it.
/// While the segment is written, a word per record (`lba << 6 | blocks −
/// 1`); once sealed, the blocks sorted and each listed once, encoded as
/// runs (2 to 3 bytes a block for random writes, a few per run of
/// consecutive ones; it was 8 bytes a block, and twice that in a vector's
/// spare room), as the cleaner reads them in that order anyway. A segment
/// freed or cleaned drops its summary.
#[derive(Debug, Clone, Default)]
struct Members {
    /// Blocks listed (duplicates included while the segment is written).
    count: u64,
    records: Vec<u64>,
    /// Runs of the sealed summary: varint(gap << 1 | longer), then, if
    /// longer, varint(blocks − 2); a gap is counted from the previous run's end.
    runs: Box<[u8]>,
}

/// Bits of a summary word that count a record's blocks.
const MEMBER_BLOCK_BITS: u32 = 6;

impl Members {
    fn push(&mut self, lba: u64, blocks: u64) {
        debug_assert!(
            (1..=1 << MEMBER_BLOCK_BITS).contains(&blocks),
            "{blocks} blocks"
        );
        debug_assert!(lba >> (64 - MEMBER_BLOCK_BITS) == 0, "block {lba}");
        self.records.push(lba << MEMBER_BLOCK_BITS | (blocks - 1));
        self.count += blocks;
    }

    fn blocks(&self) -> Vec<u64> {
        let mut blocks = Vec::with_capacity(self.count as usize);
        for &word in &self.records {
            let lba = word >> MEMBER_BLOCK_BITS;
            blocks.extend(lba..=lba + (word & ((1 << MEMBER_BLOCK_BITS) - 1)));
        }
        blocks.sort_unstable();
        blocks.dedup();
        let mut input = &self.runs[..];
        let mut end = 0u64;
        while !input.is_empty() {
            let head = take_varint(&mut input);
            let length = match head & 1 {
                0 => 1,
                _ => take_varint(&mut input) + 2,
            };
            let first = end + (head >> 1);
            blocks.extend(first..first + length);
            end = first + length;
        }
        // Keys added after sealing (a member that became shared names the
        // shared table's cell too).
        if !self.records.is_empty() && !self.runs.is_empty() {
            blocks.sort_unstable();
            blocks.dedup();
        }
        blocks
    }

    /// Encodes the summary as runs and frees the record words.
    fn seal(&mut self) {
        if self.records.is_empty() {
            return;
        }
        let blocks = self.blocks();
        let mut runs = Vec::new();
        let mut end = 0u64;
        let mut index = 0;
        while index < blocks.len() {
            let first = blocks[index];
            let mut length = 1;
            while index + (length as usize) < blocks.len()
                && blocks[index + length as usize] == first + length
            {
                length += 1;
            }
            let gap = first - end;
            put_varint(&mut runs, gap << 1 | u64::from(length > 1));
            if length > 1 {
                put_varint(&mut runs, length - 2);
            }
            end = first + length;
            index += length as usize;
        }
        *self = Members {
            count: blocks.len() as u64,
            records: Vec::new(),
            runs: runs.into_boxed_slice(),
        };
        debug_assert_eq!(self.blocks(), blocks);
    }
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A varint this module encoded (never read from the medium).
fn take_varint(input: &mut &[u8]) -> u64 {
    let mut value = 0u64;
    let mut shift = 0;
    loop {
        let (&byte, rest) = input.split_first().expect("a whole varint");
        *input = rest;
        value |= u64::from(byte & 0x7F) << shift;
        if byte & 0x80 == 0 {
            return value;
        }
        shift += 7;
    }
}

pub(crate) struct SegmentTable {
    infos: Vec<SegmentInfo>,
    /// Cleaned segments waiting for a barrier, in release order.
    reclaimable: std::collections::VecDeque<(u64, SegmentId)>,
    /// Cleaned segments waiting for a checkpoint.
    parked: Vec<SegmentId>,
    /// Blocks whose data records were appended to each segment's current
    /// incarnation (possibly since overwritten): the cleaner's segment
    /// summary, so it can find live records without reading the segment.
    members: Vec<Members>,
    /// Free segments, oldest-freed first, so that wear spreads evenly.
    free: VecDeque<SegmentId>,
    /// The first `reserved` free segments are named in a durable root as the
    /// only ones this run may allocate (see `CheckpointRoot::reserved_segments`).
    reserved: usize,
    /// Segments released since the last [`SegmentTable::take_freed`], for
    /// the medium to hear of (a tier stops keeping them).
    freed: Vec<SegmentId>,
}

impl SegmentTable {
    /// A table with every segment free.
    #[cfg(test)]
    pub(crate) fn new(segment_count: u32) -> SegmentTable {
        SegmentTable {
            infos: vec![SegmentInfo::free(); segment_count as usize],
            members: vec![Members::default(); segment_count as usize],
            reclaimable: Default::default(),
            parked: Vec::new(),
            freed: Vec::new(),
            free: (0..segment_count).map(SegmentId).collect(),
            reserved: 0,
        }
    }

    /// A table from known infos; free segments are queued in index order.
    pub(crate) fn from_infos(infos: Vec<SegmentInfo>) -> SegmentTable {
        let free = infos
            .iter()
            .enumerate()
            .filter(|(_, info)| info.state == SegmentState::Free)
            .map(|(index, _)| SegmentId(index as u32))
            .collect();
        SegmentTable {
            reclaimable: Default::default(),
            parked: Vec::new(),
            freed: Vec::new(),
            members: vec![Members::default(); infos.len()],
            infos,
            free,
            reserved: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.infos.len()
    }

    pub(crate) fn get(&self, segment: SegmentId) -> &SegmentInfo {
        &self.infos[segment.index()]
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (SegmentId, &SegmentInfo)> {
        self.infos
            .iter()
            .enumerate()
            .map(|(i, info)| (SegmentId(i as u32), info))
    }

    pub(crate) fn free_count(&self) -> u64 {
        self.free.len() as u64
    }

    /// Free segments a durable root lets this run allocate.
    pub(crate) fn reserved_count(&self) -> u64 {
        self.reserved as u64
    }

    /// The segments a root written now should reserve: the first `count`
    /// free ones (those already reserved come first).
    pub(crate) fn propose_reservation(&self, count: usize) -> Vec<SegmentId> {
        self.free
            .iter()
            .take(count.max(self.reserved))
            .copied()
            .collect()
    }

    /// Makes a proposed reservation usable once its root is durable.
    /// Segments of it allocated meanwhile were taken from the front.
    pub(crate) fn commit_reservation(&mut self, proposal: &[SegmentId]) {
        let still_free = proposal
            .iter()
            .filter(|s| self.infos[s.index()].state == SegmentState::Free)
            .count();
        for (index, segment) in proposal.iter().rev().take(still_free).rev().enumerate() {
            assert_eq!(
                self.free.get(index),
                Some(segment),
                "a reserved segment is no longer at the front of the free list"
            );
        }
        self.reserved = self.reserved.max(still_free);
    }

    /// Takes the longest-free reserved segment as incarnation `seq` in
    /// `state` (`Open` for a stream, `Dump` for a checkpoint); `None` when
    /// no reserved segment is left.
    pub(crate) fn allocate(&mut self, seq: u64, state: SegmentState) -> Option<SegmentId> {
        assert!(
            matches!(state, SegmentState::Open | SegmentState::Dump),
            "a segment is allocated to a stream or a dump, not as {state:?}"
        );
        if self.reserved == 0 {
            return None;
        }
        self.reserved -= 1;
        let segment = self.free.pop_front()?;
        let info = &mut self.infos[segment.index()];
        assert_eq!(
            info.state,
            SegmentState::Free,
            "segment {segment} on the free list is not free"
        );
        *info = SegmentInfo::fresh(state, seq);
        self.members[segment.index()] = Members::default();
        Some(segment)
    }

    /// Records that `header`'s record was appended to `segment`, ending at
    /// `end_offset`.
    /// A record of `blocks` data blocks (0 for other kinds) was appended.
    pub(crate) fn note_append(
        &mut self,
        segment: SegmentId,
        header: &RecordHeader,
        blocks: u64,
        end_offset: u64,
    ) {
        let info = &mut self.infos[segment.index()];
        debug_assert_eq!(
            info.state,
            SegmentState::Open,
            "append to segment {segment}"
        );
        debug_assert!(end_offset > info.fill_bytes, "segment {segment} refilled");
        info.max_version = info.max_version.max(header.version);
        info.fill_bytes = end_offset;
        if header.kind.is_range() {
            info.holds_ranges = true;
            info.range_bytes += header.record_len();
        }
        // Reference and snapshot records too are needed by recovery until
        // a checkpoint covers them (they are not relocated: the cleaner checkpoints
        // first, `clean.rs`).
        if matches!(header.kind, RecordKind::Ref | RecordKind::Snapshot) {
            info.holds_ranges = true;
        }
        if matches!(header.kind, RecordKind::Data | RecordKind::Unit) {
            debug_assert!(blocks >= 1, "a data record without blocks");
            self.members[segment.index()].push(header.lba, blocks);
        }
        if header.fast_effort() {
            info.fast_bytes += header.record_len();
        }
    }

    /// Sets how much of `segment` is written (whole pages once flushed or sealed).
    pub(crate) fn set_fill(&mut self, segment: SegmentId, fill_bytes: u64) {
        self.infos[segment.index()].fill_bytes = fill_bytes;
    }

    /// Closes an open segment: its stream moved on, `fill_bytes` are written.
    pub(crate) fn seal(&mut self, segment: SegmentId, fill_bytes: u64) {
        let info = &mut self.infos[segment.index()];
        assert_eq!(info.state, SegmentState::Open, "sealing segment {segment}");
        assert!(
            info.live_bytes <= fill_bytes,
            "segment {segment} sealed with more live bytes than written"
        );
        info.fill_bytes = fill_bytes;
        info.state = SegmentState::Sealed;
        self.members[segment.index()].seal();
    }

    /// Returns a segment to the free list.
    pub(crate) fn release(&mut self, segment: SegmentId) {
        let info = &mut self.infos[segment.index()];
        assert_ne!(
            info.state,
            SegmentState::Free,
            "segment {segment} freed twice"
        );
        assert_ne!(
            info.state,
            SegmentState::Open,
            "open segment {segment} freed"
        );
        assert_eq!(info.live_bytes, 0, "segment {segment} freed with live data");
        info.state = SegmentState::Free;
        self.members[segment.index()] = Members::default();
        self.free.push_back(segment);
        self.freed.push(segment);
    }

    /// Segments released since the last call.
    pub(crate) fn take_freed(&mut self) -> Vec<SegmentId> {
        std::mem::take(&mut self.freed)
    }

    /// Every free segment.
    pub(crate) fn free_segments(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.free.iter().copied()
    }

    /// Undoes [`SegmentTable::allocate`] of a segment nothing refers to
    /// (a failed checkpoint's dump): it is free again and still reserved,
    /// as the root that reserved it still names it.
    pub(crate) fn unallocate(&mut self, segment: SegmentId) {
        let info = &mut self.infos[segment.index()];
        assert!(
            matches!(info.state, SegmentState::Open | SegmentState::Dump),
            "segment {segment} was not allocated"
        );
        assert_eq!(
            info.live_bytes, 0,
            "segment {segment} unallocated with live data"
        );
        info.state = SegmentState::Free;
        self.members[segment.index()] = Members::default();
        self.free.push_front(segment);
        self.reserved += 1;
    }

    /// Marks a cleaned segment reclaimable once barrier `release_gen` is
    /// durable ([`PARKED`]: once the next checkpoint is).
    pub(crate) fn mark_reclaimable(&mut self, segment: SegmentId, release_gen: u64) {
        let info = &mut self.infos[segment.index()];
        assert_eq!(
            info.live_bytes, 0,
            "segment {segment} cleaned with live data"
        );
        info.state = SegmentState::Reclaimable { release_gen };
        self.members[segment.index()] = Members::default();
        if release_gen == PARKED {
            self.parked.push(segment);
        } else {
            debug_assert!(self
                .reclaimable
                .back()
                .is_none_or(|&(g, _)| g <= release_gen));
            self.reclaimable.push_back((release_gen, segment));
        }
    }

    /// Releases every reclaimable segment whose barrier is durable.
    pub(crate) fn release_reclaimable(&mut self, synced_gen: u64) -> u64 {
        let mut released = 0;
        while let Some(&(release_gen, segment)) = self.reclaimable.front() {
            if release_gen > synced_gen {
                break;
            }
            self.reclaimable.pop_front();
            self.release(segment);
            released += 1;
        }
        released
    }

    /// Cleaned segments a barrier and sync would free.
    pub(crate) fn reclaimable_count(&self) -> u64 {
        self.reclaimable.len() as u64
    }

    /// Cleaned segments waiting for a checkpoint.
    pub(crate) fn parked_count(&self) -> u64 {
        self.parked.len() as u64
    }

    /// After a durable checkpoint: parked segments wait only for a barrier.
    pub(crate) fn unpark(&mut self, release_gen: u64) {
        for segment in std::mem::take(&mut self.parked) {
            self.infos[segment.index()].state = SegmentState::Reclaimable { release_gen };
            self.reclaimable.push_back((release_gen, segment));
        }
    }

    /// Notes that `segment` holds a live record of block `lba` (rebuilding
    /// the summary after recovery; [`SegmentTable::seal_members`] follows),
    /// or of the shared table's cell `lba` (a member that became shared:
    /// added to the summary, sealed or not).
    pub(crate) fn add_member(&mut self, segment: SegmentId, lba: u64) {
        self.members[segment.index()].push(lba, 1);
    }

    /// Encodes the summary of every segment not open for writing (after
    /// recovery has rebuilt them).
    pub(crate) fn seal_members(&mut self) {
        for (info, members) in self.infos.iter().zip(self.members.iter_mut()) {
            if info.state != SegmentState::Open {
                members.seal();
            }
        }
    }

    /// Blocks whose records were appended to `segment` (some may be
    /// stale), in order, each once.
    pub(crate) fn members(&self, segment: SegmentId) -> Vec<u64> {
        self.members[segment.index()].blocks()
    }

    /// How many blocks [`SegmentTable::members`] lists, at most.
    pub(crate) fn member_count(&self, segment: SegmentId) -> u64 {
        self.members[segment.index()].count
    }

    /// `bytes` of cold-data records were appended to `segment`.
    pub(crate) fn add_cold(&mut self, segment: SegmentId, bytes: u64) {
        self.infos[segment.index()].cold_bytes += bytes;
    }

    pub(crate) fn add_live(&mut self, segment: SegmentId, bytes: u64) {
        let info = &mut self.infos[segment.index()];
        info.live_bytes += bytes;
    }

    /// `bytes` of `segment` stopped being live; the write that did it is
    /// made durable by barrier generation `killed_gen` (0: durable already).
    pub(crate) fn sub_live(&mut self, segment: SegmentId, bytes: u64, killed_gen: u64) {
        let info = &mut self.infos[segment.index()];
        assert!(
            info.live_bytes >= bytes,
            "segment {segment}: live bytes {} would go negative (-{bytes})",
            info.live_bytes
        );
        info.live_bytes -= bytes;
        info.killed_gen = info.killed_gen.max(killed_gen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cycle_through_their_states() {
        let mut table = SegmentTable::new(4);
        assert_eq!(
            table.allocate(1, SegmentState::Open),
            None,
            "nothing is allocatable before a reservation"
        );
        let proposal = table.propose_reservation(4);
        table.commit_reservation(&proposal);
        let a = table.allocate(1, SegmentState::Open).unwrap();
        assert_eq!(table.get(a).state, SegmentState::Open);
        assert_eq!(table.free_count(), 3);
        table.add_live(a, 100);
        table.seal(a, 4096);
        table.sub_live(a, 100, 0);
        table.mark_reclaimable(a, 5);
        assert_eq!(table.release_reclaimable(4), 0);
        assert_eq!(table.release_reclaimable(5), 1);
        assert_eq!(table.free_count(), 4);
        assert_eq!(
            table.reserved_count(),
            3,
            "a freed segment is not reserved yet"
        );
        // Freed segments queue behind the ones that were already free.
        assert_ne!(table.allocate(2, SegmentState::Open), Some(a));
    }

    /// A summary lists the same blocks before and after it is sealed, and
    /// a sealed one of random single blocks takes about 2 bytes a block.
    #[test]
    fn summaries_seal_into_runs() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        let mut members = Members::default();
        let mut want = Vec::new();
        for _ in 0..5000 {
            let lba = rng.gen_range(0..1u64 << 28);
            let blocks = if rng.gen_ratio(1, 4) {
                rng.gen_range(1..=32)
            } else {
                1
            };
            members.push(lba, blocks);
            want.extend(lba..lba + blocks);
        }
        members.push(1 << 40, 64);
        want.extend((1 << 40)..(1 << 40) + 64);
        want.sort_unstable();
        want.dedup();
        assert_eq!(members.blocks(), want);
        members.seal();
        assert!(members.records.is_empty());
        assert_eq!(members.blocks(), want);
        assert_eq!(members.count, want.len() as u64);
        let random = 3750;
        assert!(
            members.runs.len() < 3 * random + 4 * (5000 - random),
            "{} bytes",
            members.runs.len()
        );
    }

    #[test]
    #[should_panic(expected = "freed with live data")]
    fn freeing_live_data_is_a_bug() {
        let mut table = SegmentTable::new(2);
        let proposal = table.propose_reservation(2);
        table.commit_reservation(&proposal);
        let proposal = table.propose_reservation(2);
        table.commit_reservation(&proposal);
        let a = table.allocate(1, SegmentState::Open).unwrap();
        table.add_live(a, 1);
        table.seal(a, 4096);
        table.release(a);
    }
}
