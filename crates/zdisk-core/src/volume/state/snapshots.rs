//! Snapshots in the map (issue #26; the model is in `snapshots.rs` and
//! docs/sharing.md, "Snapshots").
//!
//! Every change to a volume block's entry at a newer version goes through
//! [`State::release_entry`]: an entry the newest snapshot sees moves to that
//! snapshot's key space (where the cleaner finds it through the segment
//! summary, as it finds cells) instead of dying. Range changes move such
//! entries first ([`State::keep_range_for_snapshots`]). Nothing else
//! changes a kept entry but the cleaner moving its record and a snapshot's
//! deletion.
//!
//! Invariants (checked by `check.rs`): a snapshot's space holds only data,
//! shared or damaged entries older than the snapshot; entries in spaces no
//! snapshot owns do not exist; a kept entry counts in live bytes and in
//! shared counts exactly as a volume block's does.

use std::collections::BTreeSet;
use std::ops::ControlFlow;

use crate::error::{Error, Result};
use crate::map::{key_block, space_key, Entry, Slot, SPACE_BLOCKS, TABLE_BASE};
use crate::record::RecordKind;
use crate::snapshots::{encode_change, Snapshot, SnapshotChange, Snapshots, SNAPSHOTS_MAX};
use crate::units::Lba;

use super::{State, StreamKind};

/// True for the entries a snapshot keeps when the volume replaces them:
/// data, shared data and damage markers. Holes and zeros read as zeros
/// whether kept or not, so they are not kept (a zeroed range costs a
/// snapshot nothing).
pub(crate) fn keeps(entry: Entry) -> bool {
    matches!(
        entry.slot(),
        Slot::Data(_) | Slot::Shared { .. } | Slot::Damaged
    )
}

/// What deleting a snapshot did with the entries it kept.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Deleted {
    /// Entries handed to the next older snapshot, which sees them.
    pub handed_down: u64,
    /// Entries no snapshot sees any more: their records died (or their
    /// shared contents lost a reference).
    pub freed: u64,
}

impl State {
    pub(crate) fn snapshots(&self) -> &Snapshots {
        &self.snapshots
    }

    /// The key a kept copy of `old` goes to when volume block `key`
    /// changes at a newer version: the newest snapshot's, if it sees `old`
    /// and keeps nothing for the block yet. Its leaf must be in RAM.
    fn keeper(&self, key: Lba, old: Entry) -> Option<Lba> {
        let newest = self.snapshots.newest()?;
        if key.0 >= SPACE_BLOCKS || !keeps(old) || old.version() >= newest.version {
            return None;
        }
        let at = space_key(newest.space, key.0);
        self.map.get(at).is_hole().then_some(at)
    }

    /// The entry volume block `key` held before a change at a newer
    /// version: kept by the newest snapshot if it sees it, else dropped (a
    /// record share dies, or a shared content loses a reference).
    pub(super) fn release_entry(&mut self, key: Lba, old: Entry) -> Result<()> {
        if key.0 < SPACE_BLOCKS {
            if let Some(newest) = self.snapshots.newest() {
                let at = space_key(newest.space, key.0);
                self.load_map(at, 1)?;
            }
        }
        match self.keeper(key, old) {
            Some(at) => {
                self.keep(at, old);
                Ok(())
            }
            None => self.drop_slot(old.slot()),
        }
    }

    /// Sets kept entry `at` to `entry`, whose record member stays live
    /// (and whose shared content keeps its reference): the cleaner finds
    /// it through the segment's summary from now on.
    fn keep(&mut self, at: Lba, entry: Entry) {
        let before = self.map.set(at, entry.slot(), entry.version());
        debug_assert!(before.is_hole(), "kept entry {at} overwritten");
        if let Slot::Data(loc) = entry.slot() {
            self.space.add_member(loc.segment, at.0);
        }
    }

    /// Before volume blocks `first..first+count` change together (a trim,
    /// zeroes, damage): moves the entries the newest snapshot sees to its
    /// space, leaving holes, so the change itself drops only what no
    /// snapshot keeps. The range's leaves must be in RAM.
    pub(super) fn keep_range_for_snapshots(&mut self, first: Lba, count: u64) -> Result<()> {
        let Some(newest) = self.snapshots.newest() else {
            return Ok(());
        };
        let (space, version) = (newest.space, newest.version);
        let mut seen = Vec::new();
        self.map.for_each_run(first, count, |at, blocks, entry| {
            if blocks == 1 && keeps(entry) && entry.version() < version {
                seen.push((at, entry));
            }
            std::ops::ControlFlow::Continue(())
        });
        for (key, entry) in seen {
            let at = space_key(space, key.0);
            self.load_map(at, 1)?;
            if self.map.get(at).is_hole() {
                self.map.set(key, Slot::Hole, 0);
                self.keep(at, entry);
            }
        }
        Ok(())
    }

    /// Takes snapshot `name` of the volume as it is now: logs it (host
    /// stream, so a replay meets it among the writes in the order they
    /// were made) and adds it to the registry. Changes no map entry.
    pub(crate) fn take_snapshot(
        &mut self,
        name: &str,
        created_unix_secs: u64,
        floor: u64,
    ) -> Result<Snapshot> {
        crate::snapshots::check_name(name).map_err(Error::InvalidArgument)?;
        if self.snapshots.by_name(name).is_some() {
            return Err(Error::InvalidArgument(format!(
                "a snapshot named {name:?} exists already"
            )));
        }
        let Some(space) = self.snapshots.free_space() else {
            return Err(Error::InvalidArgument(format!(
                "the volume has {SNAPSHOTS_MAX} snapshots, as many as it may: delete one first"
            )));
        };
        let version = self.space.take_version();
        let snapshot = Snapshot {
            space,
            version,
            name: name.to_string(),
            created_unix_secs,
        };
        self.log_snapshot_change(SnapshotChange::Take(snapshot.clone()), version, floor)?;
        Ok(snapshot)
    }

    /// Logs `change` at `version` (host stream, so a replay meets it among
    /// the writes in the order they were made) and applies it to the
    /// registry.
    fn log_snapshot_change(
        &mut self,
        change: SnapshotChange,
        version: u64,
        floor: u64,
    ) -> Result<()> {
        self.append_metadata(
            StreamKind::Host,
            RecordKind::Snapshot,
            Lba(0),
            version,
            &encode_change(&change),
            floor,
        )?;
        self.snapshots.apply(&change);
        Ok(())
    }

    /// The map ranges deleting the snapshot in `space` changes: its key
    /// space and the next older snapshot's.
    pub(crate) fn snapshot_delete_ranges(&self, space: u16) -> Vec<(Lba, u64)> {
        let mut ranges = vec![(space_key(space, 0), SPACE_BLOCKS)];
        if let Some(older) = self.snapshots.older_than(space) {
            ranges.push((space_key(older.space, 0), SPACE_BLOCKS));
        }
        ranges
    }

    /// Deletes the snapshot in `space`: logs it, then hands each entry it
    /// kept to the next older snapshot if that one sees it and keeps
    /// nothing for the block, and frees the rest. The ranges of
    /// [`State::snapshot_delete_ranges`] must be in RAM.
    pub(crate) fn delete_snapshot(&mut self, space: u16, floor: u64) -> Result<Deleted> {
        if self.snapshots.by_space(space).is_none() {
            return Err(Error::InvalidArgument(format!(
                "no snapshot in key space {space}"
            )));
        }
        let older = self
            .snapshots
            .older_than(space)
            .map(|s| (s.space, s.version));
        let kept = kept_entries(self, space);
        let version = self.space.take_version();
        self.log_snapshot_change(SnapshotChange::Delete { space }, version, floor)?;
        let mut deleted = Deleted::default();
        for (key, entry) in kept {
            self.map.set(key, Slot::Hole, 0);
            if let Some((older_space, older_version)) = older {
                let at = space_key(older_space, key_block(key.0));
                if entry.version() < older_version && self.map.get(at).is_hole() {
                    self.keep(at, entry);
                    deleted.handed_down += 1;
                    continue;
                }
            }
            self.drop_slot(entry.slot())?;
            deleted.freed += 1;
        }
        Ok(deleted)
    }

    /// The entry the snapshot in `space` sees at volume block `lba`: the
    /// first one kept for it by this snapshot or a newer one, else the
    /// volume's, if older than the snapshot; a hole otherwise. The leaves
    /// of the block in the volume's and every snapshot's space must be in
    /// RAM (as `make_resident` of the volume's block brings them).
    pub(crate) fn snapshot_entry(&self, space: u16, lba: Lba) -> Entry {
        let Some(snapshot) = self.snapshots.by_space(space) else {
            return Entry::default();
        };
        // A volume entry older than the snapshot has not been replaced
        // since it was taken, so neither this snapshot nor a newer one
        // keeps anything at the block (an entry is kept only when a newer
        // one replaces it): one lookup for every block unchanged since.
        let current = self.map.get(lba);
        if !current.is_hole() && current.version() < snapshot.version {
            debug_assert_eq!(
                self.kept_view(snapshot, space, lba),
                current,
                "block {lba}: snapshot {space} keeps an entry the volume never replaced"
            );
            return current;
        }
        self.kept_view(snapshot, space, lba)
    }

    /// Visits the snapshot in `space`'s view of blocks `first..first+count`
    /// as runs of one entry: `f(first block, blocks, entry)`, until it
    /// breaks. The runs are cut wherever the volume's or a chain space's
    /// map changes, so a sparse range costs its entries, not its blocks.
    /// The leaves of those ranges must be in RAM.
    pub(crate) fn for_each_snapshot_run(
        &self,
        space: u16,
        first: Lba,
        count: u64,
        mut f: impl FnMut(Lba, u64, Entry) -> ControlFlow<()>,
    ) {
        let end = first.0 + count;
        let mut cuts = BTreeSet::from([first.0, end]);
        let spaces =
            std::iter::once(0).chain(self.snapshots.chain_from(space).iter().map(|s| s.space));
        for in_space in spaces {
            self.map
                .for_each_run(space_key(in_space, first.0), count, |at, blocks, _| {
                    let block = key_block(at.0);
                    cuts.insert(block);
                    cuts.insert(block + blocks);
                    ControlFlow::Continue(())
                });
        }
        let cuts: Vec<u64> = cuts.into_iter().filter(|&cut| cut <= end).collect();
        for pair in cuts.windows(2) {
            let (from, to) = (pair[0], pair[1]);
            if f(Lba(from), to - from, self.snapshot_entry(space, Lba(from))).is_break() {
                return;
            }
        }
    }

    /// [`State::snapshot_entry`] by the chain: the snapshot's own space,
    /// the newer snapshots' spaces, then the volume.
    fn kept_view(&self, snapshot: &Snapshot, space: u16, lba: Lba) -> Entry {
        let seen = |entry: Entry| {
            if entry.version() < snapshot.version {
                entry
            } else {
                Entry::default()
            }
        };
        for newer in self.snapshots.chain_from(space) {
            let entry = self.map.get(space_key(newer.space, lba.0));
            if !entry.is_hole() {
                return seen(entry);
            }
        }
        let entry = self.map.get(lba);
        if entry.is_hole() {
            entry
        } else {
            seen(entry)
        }
    }

    /// For map ranges of blocks (in any key space), the same blocks in the
    /// volume's and every snapshot's key space, less the ranges given:
    /// what a change there or a member's move may touch besides.
    pub(crate) fn kept_ranges(&self, ranges: &[(Lba, u64)]) -> Vec<(Lba, u64)> {
        let mut kept = Vec::new();
        for &(first, count) in ranges {
            // Without snapshots, only a range named in a snapshot's space
            // (a record rewritten from a kept entry) needs the volume's.
            if first.0 >= TABLE_BASE || (self.snapshots.is_empty() && first.0 < SPACE_BLOCKS) {
                continue;
            }
            let block = key_block(first.0);
            let count = count.min(SPACE_BLOCKS - block);
            let spaces = std::iter::once(0).chain(self.snapshots.list().iter().map(|s| s.space));
            for space in spaces {
                let at = space_key(space, block);
                if at != first {
                    kept.push((at, count));
                }
            }
        }
        kept
    }

    /// The candidates for the entry naming the member at `version` of a
    /// record written for block key `key`, beside its cell: the volume's
    /// block and each snapshot's kept copy of it.
    pub(super) fn member_candidates(&self, key: u64) -> impl Iterator<Item = Lba> + '_ {
        let lba = key_block(key);
        std::iter::once(Lba(lba)).chain(
            self.snapshots
                .list()
                .iter()
                .rev()
                .map(move |s| space_key(s.space, lba)),
        )
    }
}

/// Every entry the snapshot in `space` keeps.
fn kept_entries(state: &State, space: u16) -> Vec<(Lba, Entry)> {
    let mut kept = Vec::new();
    state
        .map
        .for_each_run(space_key(space, 0), SPACE_BLOCKS, |at, blocks, entry| {
            if !entry.is_hole() {
                debug_assert_eq!(blocks, 1, "a run kept at {at}");
                for i in 0..blocks {
                    kept.push((Lba(at.0 + i), entry));
                }
            }
            std::ops::ControlFlow::Continue(())
        });
    kept
}
