//! A column: the entries of one leaf, in order, stored as narrowly as
//! their versions allow.
//!
//! A narrow cell takes 15 bytes instead of the entry's 16: a data entry
//! keeps its location word and stores its version as a 40-bit offset from
//! the column's `base`; an entry that is not data has no location, so its
//! whole version goes in that word. 2^40 versions are 4 PiB of 4 KiB
//! writes (or 16 Ki crashes, each skipping a reservation of 2^26), so a
//! column that cannot hold a version narrowly is rare; it is then moved to
//! a new base if its data versions still span less than 2^40, and widened
//! to 16-byte entries otherwise.
//!
//! Invariant: every narrow data cell's version lies in
//! `base..=base + DELTA_MAX` (so `get` returns exactly what `set` stored).

use super::entry::{Entry, STATE_DATA};

/// Bytes of a narrow cell.
pub(super) const NARROW_BYTES: usize = 15;
/// The largest version offset a narrow cell holds.
const DELTA_MAX: u64 = (1 << 40) - 1;
/// How far below its lowest data version a column's base is set, so that
/// the older versions recovery replays out of order rarely move it.
const BASE_SLACK: u64 = 1 << 24;

/// One entry in 15 bytes: bytes 0..8 the location word of a data entry
/// (the version of any other), bytes 8..15 the entry's low 16 bits of
/// `w1` (length and state) and a data entry's version offset above them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Narrow([u8; NARROW_BYTES]);

impl Narrow {
    /// `entry` relative to `base`; `None` if its version is out of reach.
    fn pack(entry: Entry, base: u64) -> Option<Narrow> {
        let low = entry.w1 & 0xFFFF;
        let (word, delta) = if entry.is_data() {
            let delta = entry.version().checked_sub(base)?;
            if delta > DELTA_MAX {
                return None;
            }
            (entry.w0, delta)
        } else {
            debug_assert_eq!(entry.w0, 0, "{entry:?} is not data but has a location");
            (entry.version(), 0)
        };
        let tail = low | delta << 16;
        let mut bytes = [0u8; NARROW_BYTES];
        bytes[..8].copy_from_slice(&word.to_le_bytes());
        bytes[8..].copy_from_slice(&tail.to_le_bytes()[..7]);
        Some(Narrow(bytes))
    }

    fn unpack(self, base: u64) -> Entry {
        let bytes = &self.0;
        let word = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        let tail = u64::from_le_bytes(bytes[7..].try_into().expect("8 bytes")) >> 8;
        let low = tail & 0xFFFF;
        if low & 3 == STATE_DATA {
            Entry {
                w0: word,
                w1: (base + (tail >> 16)) << 16 | low,
            }
        } else {
            Entry {
                w0: 0,
                w1: word << 16 | low,
            }
        }
    }
}

/// The heap bytes an allocation of `request` bytes takes, by glibc's rule
/// (8 bytes of header, 16-byte granules, 32 bytes at least).
pub(super) fn alloc_bytes(request: usize) -> u64 {
    match request {
        0 => 0,
        n => ((n as u64 + 8).div_ceil(16) * 16).max(32),
    }
}

/// Entries in order, narrow while their versions allow.
#[derive(Debug, Clone)]
pub(super) enum Column {
    Narrow { base: u64, cells: Vec<Narrow> },
    Wide(Vec<Entry>),
}

/// The lowest and highest version among the data entries of `entries`.
fn data_versions(entries: impl Iterator<Item = Entry>) -> Option<(u64, u64)> {
    entries
        .filter(|entry| entry.is_data())
        .map(Entry::version)
        .fold(None, |range, v| match range {
            None => Some((v, v)),
            Some((low, high)) => Some((low.min(v), high.max(v))),
        })
}

/// A base that reaches every version in `low..=high`, or `None` if no base does.
fn base_for(range: Option<(u64, u64)>) -> Option<u64> {
    match range {
        None => Some(0),
        Some((low, high)) if high - low <= DELTA_MAX => Some(
            low.saturating_sub(BASE_SLACK)
                .max(high.saturating_sub(DELTA_MAX)),
        ),
        Some(_) => None,
    }
}

impl Column {
    /// A column of `entries`, with room for `capacity` of them.
    pub(super) fn from_entries(entries: &[Entry], capacity: usize) -> Column {
        let capacity = capacity.max(entries.len());
        match base_for(data_versions(entries.iter().copied())) {
            Some(base) => {
                let mut cells = Vec::with_capacity(capacity);
                cells.extend(
                    entries
                        .iter()
                        .map(|&entry| Narrow::pack(entry, base).expect("the base reaches it")),
                );
                Column::Narrow { base, cells }
            }
            None => {
                let mut wide = Vec::with_capacity(capacity);
                wide.extend_from_slice(entries);
                Column::Wide(wide)
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Column::Narrow { cells, .. } => cells.len(),
            Column::Wide(entries) => entries.len(),
        }
    }

    pub(super) fn capacity(&self) -> usize {
        match self {
            Column::Narrow { cells, .. } => cells.capacity(),
            Column::Wide(entries) => entries.capacity(),
        }
    }

    /// True if the cells are 16-byte entries.
    #[cfg(test)]
    pub(super) fn is_wide(&self) -> bool {
        matches!(self, Column::Wide(_))
    }

    /// Heap bytes, allocator overhead included.
    pub(super) fn heap_bytes(&self) -> u64 {
        match self {
            Column::Narrow { cells, .. } => alloc_bytes(cells.capacity() * NARROW_BYTES),
            Column::Wide(entries) => alloc_bytes(entries.capacity() * size_of::<Entry>()),
        }
    }

    #[inline]
    pub(super) fn get(&self, index: usize) -> Entry {
        match self {
            Column::Narrow { base, cells } => cells[index].unpack(*base),
            Column::Wide(entries) => entries[index],
        }
    }

    /// Every entry, in order.
    pub(super) fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        (0..self.len()).map(|index| self.get(index))
    }

    #[inline]
    pub(super) fn set(&mut self, index: usize, entry: Entry) {
        match self {
            Column::Narrow { base, cells } => match Narrow::pack(entry, *base) {
                Some(cell) => cells[index] = cell,
                None => {
                    self.make_room_for(entry);
                    self.set(index, entry);
                }
            },
            Column::Wide(entries) => entries[index] = entry,
        }
        debug_assert_eq!(self.get(index), entry);
    }

    pub(super) fn insert(&mut self, index: usize, entry: Entry) {
        match self {
            Column::Narrow { base, cells } => match Narrow::pack(entry, *base) {
                Some(cell) => cells.insert(index, cell),
                None => {
                    self.make_room_for(entry);
                    self.insert(index, entry);
                }
            },
            Column::Wide(entries) => entries.insert(index, entry),
        }
    }

    pub(super) fn remove(&mut self, index: usize) -> Entry {
        match self {
            Column::Narrow { base, cells } => cells.remove(index).unpack(*base),
            Column::Wide(entries) => entries.remove(index),
        }
    }

    /// Room for `additional` more entries, exactly.
    pub(super) fn reserve_exact(&mut self, additional: usize) {
        match self {
            Column::Narrow { cells, .. } => cells.reserve_exact(additional),
            Column::Wide(entries) => entries.reserve_exact(additional),
        }
    }

    pub(super) fn shrink_to(&mut self, capacity: usize) {
        match self {
            Column::Narrow { cells, .. } => cells.shrink_to(capacity),
            Column::Wide(entries) => entries.shrink_to(capacity),
        }
    }

    /// Moves the base, or widens the column, as `entry`'s version is out
    /// of the narrow cells' reach.
    #[cold]
    fn make_room_for(&mut self, entry: Entry) {
        let Column::Narrow { base, cells } = self else {
            unreachable!("a wide column holds any entry")
        };
        debug_assert!(entry.is_data() && Narrow::pack(entry, *base).is_none());
        let old_base = *base;
        let versions = data_versions(
            cells
                .iter()
                .map(|cell| cell.unpack(old_base))
                .chain(std::iter::once(entry)),
        );
        match base_for(versions) {
            Some(new_base) => {
                for cell in cells.iter_mut() {
                    *cell = Narrow::pack(cell.unpack(old_base), new_base)
                        .expect("the new base reaches every data version");
                }
                *base = new_base;
            }
            None => {
                let mut wide = Vec::with_capacity(cells.capacity());
                wide.extend(cells.iter().map(|cell| cell.unpack(old_base)));
                *self = Column::Wide(wide);
            }
        }
    }

    /// True if every narrow data cell is within reach of the base.
    pub(super) fn is_well_formed(&self) -> bool {
        match self {
            Column::Narrow { base, cells } => cells.iter().all(|cell| {
                let entry = cell.unpack(*base);
                entry.is_well_formed() && Narrow::pack(entry, *base) == Some(*cell)
            }),
            Column::Wide(entries) => entries.iter().all(|entry| entry.is_well_formed()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::entry::{Location, Slot, VERSION_MAX};
    use crate::units::SegmentId;

    fn data(version: u64) -> Entry {
        Entry::new(
            Slot::Data(Location::unit_member(
                SegmentId(0xAB_CDEF),
                0x3FFF_FFF0,
                4096,
                7,
                8,
            )),
            version,
        )
    }

    #[test]
    fn narrow_cells_hold_every_kind_of_entry() {
        assert_eq!(size_of::<Narrow>(), NARROW_BYTES);
        for base in [0, 1 << 30, VERSION_MAX - DELTA_MAX] {
            for entry in [
                data(base),
                data(base + DELTA_MAX),
                Entry::default(),
                Entry::new(Slot::Zero, VERSION_MAX),
                Entry::new(Slot::Damaged, 3),
                Entry::new(Slot::Hole, VERSION_MAX),
            ] {
                let cell = Narrow::pack(entry, base).expect("in reach");
                assert_eq!(cell.unpack(base), entry, "base {base}");
            }
            if base + DELTA_MAX < VERSION_MAX {
                assert_eq!(Narrow::pack(data(base + DELTA_MAX + 1), base), None);
            }
        }
        assert_eq!(Narrow::pack(data(5), 6), None);
    }

    fn base(column: &Column) -> Option<u64> {
        match column {
            Column::Narrow { base, .. } => Some(*base),
            Column::Wide(_) => None,
        }
    }

    #[test]
    fn columns_move_their_base_then_widen() {
        let high = 1 << 44;
        let mut column = Column::from_entries(&[data(high), Entry::default()], 4);
        assert_eq!(base(&column), Some(high - BASE_SLACK));
        column.insert(1, data(high - (1 << 30)));
        assert_eq!(
            base(&column),
            Some(high - (1 << 30) - BASE_SLACK),
            "an older version moves the base down"
        );
        let mut rising = Column::from_entries(&[data(1 << 30)], 1);
        rising.set(0, data(1 << 30));
        rising.insert(1, data((1 << 30) + DELTA_MAX));
        assert_eq!(base(&rising), Some(1 << 30), "a newer one moves it up");
        column.insert(0, data(VERSION_MAX));
        assert!(column.is_wide(), "2^48 apart: only wide entries hold both");
        let want = [
            data(VERSION_MAX),
            data(high),
            data(high - (1 << 30)),
            Entry::default(),
        ];
        assert_eq!(column.entries().collect::<Vec<_>>(), want);
        assert!(column.is_well_formed() && rising.is_well_formed());
        assert_eq!(column.remove(0), data(VERSION_MAX));
        assert!(!Column::from_entries(&want[1..], 0).is_wide());
    }
}
