//! Snapshots and clones in the map (issue #26; the model is in
//! `snapshots.rs` and docs/sharing.md, "Snapshots" and "Clones").
//!
//! A *host key* is a key in the space of a volume the host writes: the
//! image's own (space 0) or a clone's. Every change to a host key's entry
//! at a newer version goes through [`State::release_entry`]: an entry the
//! newest snapshot of that volume sees moves to that snapshot's key space
//! (where the cleaner finds it through the segment summary, as it finds
//! cells) instead of dying. Range changes move such entries first
//! ([`State::keep_range_for_snapshots`]). Nothing else changes a kept entry
//! but the cleaner moving its record and a snapshot's deletion.
//!
//! A clone's hole reads as its snapshot's view, so in a clone's space a
//! trim or a zeroing sets zero entries, never holes, and leaves blocks that
//! are zeros already as they are (renumbering them would hide them from the
//! clone's snapshots); and a clone's snapshots keep its zeros too.
//!
//! Invariants (checked by `check.rs`): a snapshot's space holds only data,
//! shared or damaged entries (and zeros, for a clone's snapshot) older
//! than the snapshot; a clone's space holds only entries newer than the
//! clone; entries in spaces nothing owns do not exist; a kept entry counts
//! in live bytes and in shared counts exactly as a volume block's does.

use std::collections::BTreeSet;
use std::ops::ControlFlow;

use crate::error::{Error, Result};
use crate::map::{key_block, key_space, space_key, Entry, Slot, SPACE_BLOCKS, TABLE_BASE};
use crate::record::RecordKind;
use crate::snapshots::{
    encode_change, CloneVolume, Snapshot, SnapshotChange, Snapshots, SNAPSHOTS_MAX,
};
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

/// [`keeps`] for the snapshots of `volume`: a clone's keep its zeros too,
/// since a hole there would read as the clone's own snapshot.
pub(crate) fn keeps_in(volume: u16, entry: Entry) -> bool {
    keeps(entry) || (volume != 0 && entry.slot() == Slot::Zero)
}

/// Whose blocks a read or a status describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum View {
    /// The image's own volume.
    Volume,
    /// The snapshot whose key space this is.
    Snapshot(u16),
    /// The clone whose key space this is, made at this version (a clone
    /// deleted since, whose space another may have taken, is gone).
    Clone(u16, u64),
}

/// The host key volume `volume` (0 or a clone's space) has for `lba`.
pub(crate) fn host_key(volume: u16, lba: u64) -> Lba {
    space_key(volume, lba)
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

    /// The volume whose host key `key` is (0 or a clone's space); `None`
    /// for a snapshot's kept entry, a cell, or a space nothing owns.
    pub(crate) fn host_volume(&self, key: Lba) -> Option<u16> {
        let space = key_space(key.0)?;
        (space == 0 || self.snapshots.clone_by_space(space).is_some()).then_some(space)
    }

    /// The volume that wrote the records of entries at `key`: a host
    /// key's own, a snapshot's key's volume; `None` for a cell or a space
    /// nothing owns.
    pub(crate) fn owner_volume(&self, key: u64) -> Option<u16> {
        self.snapshots.volume_of_space(key_space(key)?)
    }

    /// The key a kept copy of `old` goes to when host key `key` changes at
    /// a newer version: its volume's newest snapshot's, if that sees `old`
    /// and keeps nothing for the block yet. Its leaf must be in RAM.
    fn keeper(&self, key: Lba, old: Entry) -> Option<Lba> {
        let volume = self.host_volume(key)?;
        let newest = self.snapshots.newest_of(volume)?;
        if !keeps_in(volume, old) || old.version() >= newest.version {
            return None;
        }
        let at = space_key(newest.space, key_block(key.0));
        self.map.get(at).is_hole().then_some(at)
    }

    /// The entry host key `key` held before a change at a newer version:
    /// kept by its volume's newest snapshot if that sees it, else dropped
    /// (a record share dies, or a shared content loses a reference).
    pub(super) fn release_entry(&mut self, key: Lba, old: Entry) -> Result<()> {
        if let Some(volume) = self.host_volume(key) {
            if let Some(newest) = self.snapshots.newest_of(volume) {
                let at = space_key(newest.space, key_block(key.0));
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

    /// Before host keys `first..first+count` change together (a trim,
    /// zeroes, damage): moves the entries their volume's newest snapshot
    /// sees to its space, leaving holes, so the change itself drops only
    /// what no snapshot keeps. A clone's zeros stay (see
    /// [`State::range_parts`]). The range's leaves must be in RAM.
    pub(super) fn keep_range_for_snapshots(&mut self, first: Lba, count: u64) -> Result<()> {
        let Some(volume) = self.host_volume(first) else {
            return Ok(());
        };
        let Some(newest) = self.snapshots.newest_of(volume) else {
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
            let at = space_key(space, key_block(key.0));
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
        volume: u16,
        name: &str,
        created_unix_secs: u64,
        floor: u64,
    ) -> Result<Snapshot> {
        let space = self.new_space(name)?;
        if volume != 0 && self.snapshots.clone_by_space(volume).is_none() {
            return Err(Error::InvalidArgument(
                "the clone was deleted meanwhile".into(),
            ));
        }
        let version = self.space.take_version();
        let snapshot = Snapshot {
            space,
            volume,
            version,
            name: name.to_string(),
            created_unix_secs,
        };
        self.log_snapshot_change(SnapshotChange::Take(snapshot.clone()), version, floor)?;
        Ok(snapshot)
    }

    /// A key space for a new snapshot or clone named `name`, if the name is
    /// good and free and a space is.
    fn new_space(&self, name: &str) -> Result<u16> {
        crate::snapshots::check_name(name).map_err(Error::InvalidArgument)?;
        if self.snapshots.by_name(name).is_some() {
            return Err(Error::InvalidArgument(format!(
                "a snapshot named {name:?} exists already"
            )));
        }
        if self.snapshots.clone_by_name(name).is_some() {
            return Err(Error::InvalidArgument(format!(
                "a clone named {name:?} exists already"
            )));
        }
        self.snapshots.free_space().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the image has {SNAPSHOTS_MAX} snapshots and clones, as many as it may: \
                 delete one first"
            ))
        })
    }

    /// Makes clone `name` of the snapshot in `base`: logs it and adds it
    /// to the registry. Changes no map entry: every block reads as the
    /// snapshot's until the clone writes it.
    pub(crate) fn make_clone(
        &mut self,
        base: u16,
        name: &str,
        created_unix_secs: u64,
        floor: u64,
    ) -> Result<CloneVolume> {
        let space = self.new_space(name)?;
        if self.snapshots.by_space(base).is_none() {
            return Err(Error::InvalidArgument(
                "the snapshot was deleted meanwhile".into(),
            ));
        }
        let version = self.space.take_version();
        let clone = CloneVolume {
            space,
            base,
            version,
            name: name.to_string(),
            created_unix_secs,
        };
        self.log_snapshot_change(SnapshotChange::Clone(clone.clone()), version, floor)?;
        Ok(clone)
    }

    /// Deletes the clone in `space`, which has no snapshots: logs it, then
    /// drops every entry in its space (the records die, shared contents
    /// lose a reference). Its whole space must be in RAM. Returns the data
    /// entries dropped.
    pub(crate) fn delete_clone(&mut self, space: u16, floor: u64) -> Result<u64> {
        let Some(clone) = self.snapshots.clone_by_space(space) else {
            return Err(Error::InvalidArgument(format!(
                "no clone in key space {space}"
            )));
        };
        if let Some(snapshot) = self.snapshots.newest_of(space) {
            return Err(Error::InvalidArgument(format!(
                "clone {:?} has snapshots ({:?} among them): delete them first",
                clone.name, snapshot.name
            )));
        }
        let version = self.space.take_version();
        self.log_snapshot_change(SnapshotChange::DeleteClone { space }, version, floor)?;
        let mut dropped = Vec::new();
        self.map.set_range(
            space_key(space, 0),
            SPACE_BLOCKS,
            crate::map::RangeState::Hole,
            0,
            false,
            &mut |slot| dropped.push(slot),
        );
        for &slot in &dropped {
            self.drop_slot(slot)?;
        }
        Ok(dropped.len() as u64)
    }

    /// Refuses a change to host key `first`'s volume if it is a clone
    /// other than the one made at `made` (deleted since, its space maybe
    /// reused): checked under the lock before every write to a clone.
    pub(crate) fn check_clone_live(&self, first: Lba, made: u64) -> Result<()> {
        let space = key_space(first.0).unwrap_or(0);
        if space == 0 {
            return Ok(());
        }
        match self.snapshots.clone_by_space(space) {
            Some(clone) if clone.version == made => Ok(()),
            _ => Err(Error::InvalidArgument("the clone was deleted".into())),
        }
    }

    /// The parts of host key range `first..first+count` a trim or zeroing
    /// changes: all of it on the image's volume; on a clone, the runs that
    /// are not zeros already. The range's leaves must be in RAM.
    pub(crate) fn range_parts(&self, first: Lba, count: u64) -> Vec<(Lba, u64)> {
        if key_space(first.0).unwrap_or(0) == 0 {
            return vec![(first, count)];
        }
        let mut parts: Vec<(Lba, u64)> = Vec::new();
        self.map.for_each_run(first, count, |at, blocks, entry| {
            if entry.slot() != Slot::Zero {
                match parts.last_mut() {
                    Some((start, n)) if start.0 + *n == at.0 => *n += blocks,
                    _ => parts.push((at, blocks)),
                }
            }
            ControlFlow::Continue(())
        });
        parts
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
        if let Some(clone) = self.snapshots.clones_of(space).next() {
            return Err(Error::InvalidArgument(format!(
                "snapshot {:?} has clones ({:?} among them): delete them first",
                self.snapshots.by_space(space).map_or("", |s| &s.name),
                clone.name
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
        let current = self.map.get(host_key(snapshot.volume, lba.0));
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

    /// The entry clone `space` has at block `lba`: its own, or where it
    /// has none, its snapshot's view. Leaves as for
    /// [`State::snapshot_entry`], and the clone's.
    pub(crate) fn clone_entry(&self, space: u16, lba: Lba) -> Entry {
        let own = self.map.get(space_key(space, lba.0));
        match self.snapshots.clone_by_space(space) {
            Some(clone) if own.is_hole() => self.snapshot_entry(clone.base, lba),
            _ => own,
        }
    }

    /// What `view` sees at block `lba`.
    pub(crate) fn view_entry(&self, view: View, lba: Lba) -> Entry {
        match view {
            View::Volume => self.map.get(lba),
            View::Snapshot(space) => self.snapshot_entry(space, lba),
            View::Clone(space, _) => self.clone_entry(space, lba),
        }
    }

    /// True if the snapshot or clone `view` names is still there.
    pub(crate) fn view_exists(&self, view: View) -> bool {
        match view {
            View::Volume => true,
            View::Snapshot(space) => self.snapshots.by_space(space).is_some(),
            View::Clone(space, made) => self
                .snapshots
                .clone_by_space(space)
                .is_some_and(|clone| clone.version == made),
        }
    }

    /// The key spaces whose maps make `view`'s entries: a clone's own and
    /// its snapshot's; a snapshot's, those of the newer snapshots of its
    /// volume, and its volume's.
    pub(crate) fn view_spaces(&self, view: View) -> Vec<u16> {
        let mut spaces = Vec::new();
        let mut next = Some(view);
        while let Some(view) = next.take() {
            match view {
                View::Volume => spaces.push(0),
                View::Snapshot(space) => {
                    let Some(snapshot) = self.snapshots.by_space(space) else {
                        break;
                    };
                    spaces.extend(self.snapshots.chain_from(space).map(|s| s.space));
                    next = Some(match snapshot.volume {
                        0 => View::Volume,
                        clone => View::Clone(
                            clone,
                            self.snapshots
                                .clone_by_space(clone)
                                .map_or(0, |c| c.version),
                        ),
                    });
                }
                View::Clone(space, _) => {
                    spaces.push(space);
                    next = self
                        .snapshots
                        .clone_by_space(space)
                        .map(|c| View::Snapshot(c.base));
                }
            }
        }
        spaces
    }

    /// Visits `view` over blocks `first..first+count` as runs of one
    /// entry: `f(first block, blocks, entry)`, until it breaks. The runs
    /// are cut wherever the map of a space of [`State::view_spaces`]
    /// changes, so a sparse range costs its entries, not its blocks. The
    /// leaves of those ranges must be in RAM.
    pub(crate) fn for_each_view_run(
        &self,
        view: View,
        first: Lba,
        count: u64,
        mut f: impl FnMut(Lba, u64, Entry) -> ControlFlow<()>,
    ) {
        if view == View::Volume {
            self.map.for_each_run(first, count, f);
            return;
        }
        let end = first.0 + count;
        let mut cuts = BTreeSet::from([first.0, end]);
        for in_space in self.view_spaces(view) {
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
            if f(Lba(from), to - from, self.view_entry(view, Lba(from))).is_break() {
                return;
            }
        }
    }

    /// [`State::snapshot_entry`] by the chain: the snapshot's own space,
    /// the newer snapshots' spaces of its volume, then the volume. Where
    /// the volume held nothing when the snapshot was taken, a clone's
    /// snapshot sees the clone's own snapshot (a clone's hole reads so, and
    /// every entry a clone replaces is kept, zeros included).
    fn kept_view(&self, snapshot: &Snapshot, space: u16, lba: Lba) -> Entry {
        let nothing = || match self.snapshots.clone_by_space(snapshot.volume) {
            Some(clone) => self.snapshot_entry(clone.base, lba),
            None => Entry::default(),
        };
        let seen = |entry: Entry| {
            if entry.version() < snapshot.version {
                entry
            } else {
                nothing()
            }
        };
        for newer in self.snapshots.chain_from(space) {
            let entry = self.map.get(space_key(newer.space, lba.0));
            if !entry.is_hole() {
                return seen(entry);
            }
        }
        let entry = self.map.get(host_key(snapshot.volume, lba.0));
        if entry.is_hole() {
            nothing()
        } else {
            seen(entry)
        }
    }

    /// For map ranges of blocks (in any key space), the same blocks in the
    /// volume's and every snapshot's and clone's key space, less the
    /// ranges given: what a change there, a read of a view, or a member's
    /// move may touch besides.
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
            for space in self.snapshots.spaces() {
                let at = space_key(space, block);
                if at != first {
                    kept.push((at, count));
                }
            }
        }
        kept
    }

    /// The candidates for the entry naming the member at `version` of a
    /// record written for block key `key`, beside its cell: the block's
    /// host key in the volume that wrote it, and each kept copy of it by
    /// that volume's snapshots, newest first.
    ///
    /// Every other space follows: versions are unique, so a match is the
    /// entry wherever it is, and the record's key space may since have
    /// been deleted (its entries handed down) and reused by another.
    pub(super) fn member_candidates(&self, key: u64) -> impl Iterator<Item = Lba> + '_ {
        let lba = key_block(key);
        let volume = self.owner_volume(key);
        let own = volume.map(|volume| host_key(volume, lba));
        let kept = self
            .snapshots
            .list()
            .iter()
            .rev()
            .filter(move |s| Some(s.volume) == volume)
            .map(|s| s.space);
        let others = self.snapshots.spaces().filter(move |&space| {
            Some(space) != volume
                && self
                    .snapshots
                    .by_space(space)
                    .is_none_or(|s| Some(s.volume) != volume)
        });
        own.into_iter()
            .chain(kept.chain(others).map(move |space| space_key(space, lba)))
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
