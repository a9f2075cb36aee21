//! One block's map entry: where its record lives, and its state and
//! version packed into 16 bytes; and a 256-block chunk of entries, the unit
//! a checkpoint dump records (docs/format.md).

use crate::units::SegmentId;

pub(crate) const CHUNK_SHIFT: u32 = 8;
/// Blocks per chunk (1 MiB of logical space): the unit of a checkpoint
/// dump, and the alignment of every leaf of the map.
pub(crate) const CHUNK_BLOCKS: u64 = 1 << CHUNK_SHIFT;
pub(crate) const CHUNK_MASK: u64 = CHUNK_BLOCKS - 1;

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
    /// Its data is a record member other blocks share too: the one the
    /// block's content was written with, at version `content`. The shared
    /// table (the map's cell at [`table_key`]`(content)`) says where that
    /// member lives now and so is the only entry the cleaner updates when
    /// it moves the record (docs/sharing.md).
    Shared {
        content: u64,
    },
    /// Its data was found damaged; reads fail until it is rewritten.
    Damaged,
}

/// Where the map keeps the shared table: a cell per shared content at
/// `TABLE_BASE + content version`, far above any block a volume has
/// (versions have 48 bits, volumes fewer than 2^52 blocks). A cell is a
/// data entry at the content's own version; paging, checkpoints and the
/// cleaner's summaries treat it as any other entry.
pub(crate) const TABLE_BASE: u64 = 1 << 56;

/// Snapshots keep the entries the volume replaced but they still see in
/// key spaces of their own: space `s` (1 and up) holds block `lba`'s
/// entry at `s * SPACE_BLOCKS + lba`. Space 0 is the volume itself, whose
/// blocks (at most 2^40) are their own keys, so images without snapshots
/// are unchanged; spaces end below the shared table.
pub(crate) const SPACE_SHIFT: u32 = 40;
pub(crate) const SPACE_BLOCKS: u64 = 1 << SPACE_SHIFT;

/// The key of block `lba`'s entry in key space `space`.
pub(crate) fn space_key(space: u16, lba: u64) -> crate::units::Lba {
    debug_assert!(lba < SPACE_BLOCKS, "block {lba} beyond a key space");
    crate::units::Lba(((space as u64) << SPACE_SHIFT) | lba)
}

/// The key space of a block key (`None` for a shared table cell).
pub(crate) fn key_space(key: u64) -> Option<u16> {
    (key < TABLE_BASE).then_some((key >> SPACE_SHIFT) as u16)
}

/// True if `key` is a block's key in another key space than the one the
/// record key `named` names: a snapshot keeps that entry (a member in the
/// record's own space is its own; a table cell is no kept entry).
pub(crate) fn kept_apart(named: u64, key: u64) -> bool {
    let named = key_space(named).unwrap_or(0);
    key_space(key).is_some_and(|space| space != named)
}

/// The block a key of any key space names.
pub(crate) fn key_block(key: u64) -> u64 {
    key & (SPACE_BLOCKS - 1)
}

/// The map key of the shared table's cell for `content`.
pub(crate) fn table_key(content: u64) -> crate::units::Lba {
    debug_assert!(content <= VERSION_MAX, "content version {content}");
    crate::units::Lba(TABLE_BASE + content)
}

/// The content version a table key names (`None` for a block's key).
pub(crate) fn table_content(key: u64) -> Option<u64> {
    key.checked_sub(TABLE_BASE)
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
pub(super) const STATE_DATA: u64 = 2;
const STATE_DAMAGED: u64 = 3;
/// Versions are stored in 48 bits.
pub(crate) const VERSION_MAX: u64 = (1 << 48) - 1;
/// Segments an entry can name: 24 bits (`MediaGeometry` enforces it).
pub(crate) const SEGMENTS_MAX: u32 = 1 << 24;
/// The segment field of a shared entry: one `MediaGeometry` never allows
/// (it keeps segment counts below 2^24 − 1).
const SHARED_SEGMENT: u64 = (SEGMENTS_MAX - 1) as u64;
/// Records are at most this long: 14 bits of 16-byte units.
pub(super) const LEN_MAX: u32 = ((1 << 14) - 1) * 16;
/// Offsets within a segment: 30 bits of 16-byte units.
pub(super) const OFFSET_UNITS_MAX: u64 = (1 << 30) - 1;

/// One packed entry: 16 bytes.
/// `w0` = segment(24) << 40 | (members − 1)(5) << 35 | member(5) << 30 |
/// offset/16 (30); `w1` = version(48) << 16 | len/16 (14) << 2 | state(2).
/// A shared entry is a data entry whose segment is `SHARED_SEGMENT`: `w0`
/// holds the content version's low 40 bits, the length field its high 8.
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
            Slot::Shared { content } => {
                assert!(content <= VERSION_MAX, "content version {content}");
                Entry {
                    w0: SHARED_SEGMENT << 40 | (content & ((1 << 40) - 1)),
                    w1: version << 16 | (content >> 40) << 2 | STATE_DATA,
                }
            }
            Slot::Data(loc) => {
                assert!(
                    loc.len > 0 && loc.len <= LEN_MAX && loc.len.is_multiple_of(16),
                    "record length {} out of range",
                    loc.len
                );
                assert!(
                    (loc.segment.0 as u64) < SHARED_SEGMENT,
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
            _ if self.w0 >> 40 == SHARED_SEGMENT => Slot::Shared {
                content: (self.w0 & ((1 << 40) - 1)) | ((self.w1 >> 2) & 0xFF) << 40,
            },
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

    /// True for a data entry, shared or not (the only kinds whose `w0`
    /// is used).
    pub(super) fn is_data(self) -> bool {
        self.w1 & 3 == STATE_DATA
    }

    /// True for a hole (unwritten or trimmed), whatever its version.
    pub(crate) fn is_hole(self) -> bool {
        self.w1 & 3 == STATE_HOLE
    }

    /// The state of an entry that is not data.
    #[cfg(test)]
    pub(super) fn range_state(self) -> Option<RangeState> {
        match self.w1 & 3 {
            STATE_HOLE => Some(RangeState::Hole),
            STATE_ZERO => Some(RangeState::Zero),
            STATE_DAMAGED => Some(RangeState::Damaged),
            _ => None,
        }
    }

    /// True if the bits are laid out as `new` lays them out.
    pub(super) fn is_well_formed(self) -> bool {
        match self.w1 & 3 {
            // The length field holds the content's high 8 bits.
            STATE_DATA if self.w0 >> 40 == SHARED_SEGMENT => (self.w1 >> 2) & 0x3FFF <= 0xFF,
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

/// A chunk of [`CHUNK_BLOCKS`] entries, as a checkpoint dump records it.
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
    /// Adds another part's counts (an evicted leaf's, a dump's totals).
    pub(crate) fn merge(&mut self, other: MapCounts) {
        self.data_blocks += other.data_blocks;
        self.zero_blocks += other.zero_blocks;
        self.damaged_blocks += other.damaged_blocks;
        self.stored_bytes += other.stored_bytes;
    }

    /// These counts less `part`'s (which they include).
    pub(crate) fn without(self, part: MapCounts) -> MapCounts {
        MapCounts {
            data_blocks: self.data_blocks - part.data_blocks,
            zero_blocks: self.zero_blocks - part.zero_blocks,
            damaged_blocks: self.damaged_blocks - part.damaged_blocks,
            stored_bytes: self.stored_bytes - part.stored_bytes,
        }
    }

    pub(super) fn add(&mut self, slot: Slot, count: u64) {
        match slot {
            Slot::Hole => {}
            Slot::Zero => self.zero_blocks += count,
            Slot::Damaged => self.damaged_blocks += count,
            Slot::Data(loc) => {
                self.data_blocks += count;
                self.stored_bytes += loc.share() * count;
            }
            // Its bytes count once, in the table's cell.
            Slot::Shared { .. } => self.data_blocks += count,
        }
    }

    pub(super) fn sub(&mut self, slot: Slot, count: u64) {
        match slot {
            Slot::Hole => {}
            Slot::Zero => self.zero_blocks -= count,
            Slot::Damaged => self.damaged_blocks -= count,
            Slot::Data(loc) => {
                self.data_blocks -= count;
                self.stored_bytes -= loc.share() * count;
            }
            Slot::Shared { .. } => self.data_blocks -= count,
        }
    }
}
