//! The snapshots of a volume: their names, the version each was taken at
//! and the key space holding what each keeps (issue #26; docs/sharing.md,
//! "Snapshots").
//!
//! A snapshot taken at version `v` sees every entry written before `v`.
//! Taking one writes a small record and changes no map entry, so its cost
//! does not depend on the volume's size. When the volume later replaces an
//! entry the newest snapshot sees (version below its `v`), the entry moves
//! to that snapshot's key space instead of dying: it is the snapshot's
//! *dead list*, as ZFS's dead lists keep the blocks a snapshot's successor
//! freed. A snapshot's view of block `b` is the first entry found at `b` in
//! its own space, then the spaces of the newer snapshots, then the volume:
//! that entry if it is older than `v`, else a hole (the block was written
//! only after the snapshot). Deleting a snapshot hands each entry it keeps
//! to the next older snapshot if that one sees it, and frees the rest.
//!
//! A clone (format 8) is a writable volume of its own made from a
//! snapshot: a key space whose entries are the blocks written to the clone
//! since; a hole there reads as the snapshot's view. A snapshot names the
//! volume it was taken of (0: the image's own volume; else a clone's
//! space), and "newest snapshot", chains and hand-downs are per volume, so
//! a clone can be snapshotted, and that snapshot cloned, as the volume can.
//!
//! This file holds the registry and its encodings; `volume/state/snapshots.rs`
//! changes the map.

use crate::bytes::{ByteReader, ByteWriter};

/// Snapshots and clones an image may have at once (they share the key
/// spaces 1 to 256).
pub const SNAPSHOTS_MAX: usize = 256;

/// The longest snapshot name, in bytes.
pub const NAME_MAX: usize = 64;

/// One snapshot.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Snapshot {
    /// The key space of the entries it keeps (1 and up).
    pub space: u16,
    /// The volume it was taken of: 0 for the image's own, else the space
    /// of a clone.
    pub volume: u16,
    /// The version it was taken at: it sees entries written before it.
    pub version: u64,
    pub name: String,
    pub created_unix_secs: u64,
}

/// A writable volume made from a snapshot (format 8).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CloneVolume {
    /// The key space of the blocks written to it (1 and up).
    pub space: u16,
    /// The space of the snapshot it was made from, which cannot be deleted
    /// while the clone lives.
    pub base: u16,
    /// The version it was made at.
    pub version: u64,
    pub name: String,
    pub created_unix_secs: u64,
}

/// What a snapshot record (kind 9) says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SnapshotChange {
    /// A snapshot taken (of the volume its `volume` names).
    Take(Snapshot),
    /// A snapshot deleted.
    Delete { space: u16 },
    /// A clone made.
    Clone(CloneVolume),
    /// A clone deleted.
    DeleteClone { space: u16 },
}

/// Change kinds: 1 is format 7's snapshot of the image's volume, with no
/// volume field; format 8 writes 5 for every snapshot taken.
const TAKE: u8 = 1;
const DELETE: u8 = 2;
const CLONE: u8 = 3;
const DELETE_CLONE: u8 = 4;
const TAKE_OF: u8 = 5;

/// The image's snapshots, oldest first, and its clones, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshots {
    list: Vec<Snapshot>,
    clones: Vec<CloneVolume>,
}

/// Checks a name a user gives a snapshot or a clone: 1 to 64 bytes of letters,
/// digits, `.`, `_` and `-`, not starting with `.` or `-`. It becomes an
/// NBD export name and a word on command lines, so nothing that needs
/// quoting.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > NAME_MAX {
        return Err(format!(
            "snapshot name {name:?}: 1 to {NAME_MAX} bytes, please"
        ));
    }
    if name.starts_with(['.', '-']) {
        return Err(format!(
            "snapshot name {name:?} starts with {:?}",
            &name[..1]
        ));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "snapshot name {name:?} holds {bad:?}: use letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}

impl Snapshots {
    /// No snapshot and no clone.
    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty() && self.clones.is_empty()
    }

    /// Snapshots, of every volume.
    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    /// Every snapshot, oldest first.
    pub(crate) fn list(&self) -> &[Snapshot] {
        &self.list
    }

    /// Every clone, oldest first.
    pub(crate) fn clones(&self) -> &[CloneVolume] {
        &self.clones
    }

    /// The snapshots of `volume`, oldest first.
    pub(crate) fn of_volume(&self, volume: u16) -> impl DoubleEndedIterator<Item = &Snapshot> {
        self.list.iter().filter(move |s| s.volume == volume)
    }

    /// The newest snapshot of `volume`.
    pub(crate) fn newest_of(&self, volume: u16) -> Option<&Snapshot> {
        self.of_volume(volume).next_back()
    }

    pub(crate) fn by_name(&self, name: &str) -> Option<&Snapshot> {
        self.list.iter().find(|s| s.name == name)
    }

    pub(crate) fn by_space(&self, space: u16) -> Option<&Snapshot> {
        self.list.iter().find(|s| s.space == space)
    }

    pub(crate) fn clone_by_name(&self, name: &str) -> Option<&CloneVolume> {
        self.clones.iter().find(|c| c.name == name)
    }

    pub(crate) fn clone_by_space(&self, space: u16) -> Option<&CloneVolume> {
        self.clones.iter().find(|c| c.space == space)
    }

    /// True if `name` names a snapshot or a clone (they share export names).
    pub(crate) fn names(&self, name: &str) -> bool {
        self.by_name(name).is_some() || self.clone_by_name(name).is_some()
    }

    /// The volume whose blocks key space `space` holds: 0 and clones their
    /// own, a snapshot's space its volume's (what it keeps was written
    /// there). `None` for a space nothing owns.
    pub(crate) fn volume_of_space(&self, space: u16) -> Option<u16> {
        if space == 0 || self.clone_by_space(space).is_some() {
            return Some(space);
        }
        self.by_space(space).map(|s| s.volume)
    }

    /// The snapshot of the same volume taken just before the one in
    /// `space`.
    pub(crate) fn older_than(&self, space: u16) -> Option<&Snapshot> {
        let snapshot = self.by_space(space)?;
        self.of_volume(snapshot.volume)
            .take_while(|s| s.space != space)
            .last()
    }

    /// The snapshot in `space` and every newer one of its volume, oldest
    /// first: the spaces its view looks in before the volume's.
    pub(crate) fn chain_from(&self, space: u16) -> impl Iterator<Item = &Snapshot> {
        let volume = self.by_space(space).map(|s| s.volume);
        self.list
            .iter()
            .skip_while(move |s| s.space != space)
            .filter(move |s| Some(s.volume) == volume)
    }

    /// The clones made from the snapshot in `space`.
    pub(crate) fn clones_of(&self, space: u16) -> impl Iterator<Item = &CloneVolume> {
        self.clones.iter().filter(move |c| c.base == space)
    }

    /// The lowest key space no snapshot or clone uses.
    pub(crate) fn free_space(&self) -> Option<u16> {
        (1..=SNAPSHOTS_MAX as u16).find(|&space| self.volume_of_space(space).is_none())
    }

    /// Every key space in use: the volume's (0), every snapshot's and
    /// every clone's.
    pub(crate) fn spaces(&self) -> impl Iterator<Item = u16> + '_ {
        std::iter::once(0)
            .chain(self.list.iter().map(|s| s.space))
            .chain(self.clones.iter().map(|c| c.space))
    }

    /// Applies a change (a new snapshot is the newest); false if it was
    /// applied already (recovery replays records a checkpoint holds).
    pub(crate) fn apply(&mut self, change: &SnapshotChange) -> bool {
        match change {
            SnapshotChange::Take(snapshot) => {
                if self.volume_of_space(snapshot.space).is_some() {
                    return false;
                }
                debug_assert!(
                    self.list
                        .last()
                        .is_none_or(|n| n.version < snapshot.version),
                    "snapshot {} taken before the newest",
                    snapshot.name
                );
                self.list.push(snapshot.clone());
                true
            }
            SnapshotChange::Delete { space } => {
                let before = self.list.len();
                self.list.retain(|s| s.space != *space);
                self.list.len() != before
            }
            SnapshotChange::Clone(clone) => {
                if self.volume_of_space(clone.space).is_some() {
                    return false;
                }
                self.clones.push(clone.clone());
                true
            }
            SnapshotChange::DeleteClone { space } => {
                let before = self.clones.len();
                self.clones.retain(|c| c.space != *space);
                self.clones.len() != before
            }
        }
    }

    /// The registry as a root holds it (format 8: each snapshot names its
    /// volume, and the clones follow the snapshots).
    pub(crate) fn encode(&self, out: &mut ByteWriter) {
        out.u16(self.list.len() as u16);
        for snapshot in &self.list {
            encode_snapshot(snapshot, true, out);
        }
        out.u16(self.clones.len() as u16);
        for clone in &self.clones {
            encode_clone(clone, out);
        }
    }

    /// Decodes a root's registry of format `version` (7: snapshots of the
    /// image's volume only).
    pub(crate) fn decode(input: &mut ByteReader, version: u32) -> Result<Snapshots, String> {
        let with_volumes = version >= 8;
        let count = input.u16()? as usize;
        if count > SNAPSHOTS_MAX {
            return Err(format!("{count} snapshots, at most {SNAPSHOTS_MAX}"));
        }
        let mut registry = Snapshots::default();
        for _ in 0..count {
            let snapshot = decode_snapshot(input, with_volumes)?;
            if registry.volume_of_space(snapshot.space).is_some() || registry.names(&snapshot.name)
            {
                return Err(format!("snapshot {} listed twice", snapshot.name));
            }
            if registry
                .list
                .last()
                .is_some_and(|s| s.version >= snapshot.version)
            {
                return Err(format!("snapshot {} out of order", snapshot.name));
            }
            registry.list.push(snapshot);
        }
        if with_volumes {
            let count = input.u16()? as usize;
            if count + registry.list.len() > SNAPSHOTS_MAX {
                return Err(format!(
                    "{count} clones beside {} snapshots",
                    registry.len()
                ));
            }
            for _ in 0..count {
                let clone = decode_clone(input)?;
                if registry.volume_of_space(clone.space).is_some() || registry.names(&clone.name) {
                    return Err(format!("clone {} listed twice", clone.name));
                }
                registry.clones.push(clone);
            }
            for clone in &registry.clones {
                if registry.by_space(clone.base).is_none() {
                    return Err(format!("clone {} of a missing snapshot", clone.name));
                }
            }
            for snapshot in &registry.list {
                if registry.volume_of_space(snapshot.volume) != Some(snapshot.volume) {
                    return Err(format!("snapshot {} of a missing clone", snapshot.name));
                }
            }
        }
        Ok(registry)
    }
}

fn encode_snapshot(snapshot: &Snapshot, with_volume: bool, out: &mut ByteWriter) {
    out.u16(snapshot.space);
    if with_volume {
        out.u16(snapshot.volume);
    }
    out.u64(snapshot.version);
    out.u64(snapshot.created_unix_secs);
    encode_name(&snapshot.name, out);
}

fn encode_name(name: &str, out: &mut ByteWriter) {
    out.u8(name.len() as u8);
    out.bytes(name.as_bytes());
}

fn decode_name(input: &mut ByteReader) -> Result<String, String> {
    let len = input.u8()? as usize;
    let name = std::str::from_utf8(input.take(len)?)
        .map_err(|_| "a snapshot name is not UTF-8".to_string())?
        .to_string();
    check_name(&name)?;
    Ok(name)
}

fn check_space(what: &str, name: &str, space: u16) -> Result<(), String> {
    if space == 0 || space as usize > SNAPSHOTS_MAX {
        return Err(format!("{what} {name} in key space {space}"));
    }
    Ok(())
}

fn check_version(what: &str, name: &str, version: u64) -> Result<(), String> {
    if version > crate::map::VERSION_MAX {
        return Err(format!("{what} {name} at version {version}"));
    }
    Ok(())
}

fn decode_snapshot(input: &mut ByteReader, with_volume: bool) -> Result<Snapshot, String> {
    let space = input.u16()?;
    let volume = if with_volume { input.u16()? } else { 0 };
    let version = input.u64()?;
    let created_unix_secs = input.u64()?;
    let name = decode_name(input)?;
    check_space("snapshot", &name, space)?;
    check_version("snapshot", &name, version)?;
    if volume as usize > SNAPSHOTS_MAX || volume == space {
        return Err(format!("snapshot {name} of volume {volume}"));
    }
    Ok(Snapshot {
        space,
        volume,
        version,
        name,
        created_unix_secs,
    })
}

fn encode_clone(clone: &CloneVolume, out: &mut ByteWriter) {
    out.u16(clone.space);
    out.u16(clone.base);
    out.u64(clone.version);
    out.u64(clone.created_unix_secs);
    encode_name(&clone.name, out);
}

fn decode_clone(input: &mut ByteReader) -> Result<CloneVolume, String> {
    let space = input.u16()?;
    let base = input.u16()?;
    let version = input.u64()?;
    let created_unix_secs = input.u64()?;
    let name = decode_name(input)?;
    check_space("clone", &name, space)?;
    check_space("the snapshot of clone", &name, base)?;
    check_version("clone", &name, version)?;
    Ok(CloneVolume {
        space,
        base,
        version,
        name,
        created_unix_secs,
    })
}

/// The payload of a snapshot record.
pub(crate) fn encode_change(change: &SnapshotChange) -> Vec<u8> {
    let mut out = ByteWriter::new();
    match change {
        SnapshotChange::Take(snapshot) => {
            out.u8(TAKE_OF);
            encode_snapshot(snapshot, true, &mut out);
        }
        SnapshotChange::Delete { space } => {
            out.u8(DELETE);
            out.u16(*space);
        }
        SnapshotChange::Clone(clone) => {
            out.u8(CLONE);
            encode_clone(clone, &mut out);
        }
        SnapshotChange::DeleteClone { space } => {
            out.u8(DELETE_CLONE);
            out.u16(*space);
        }
    }
    out.buf
}

pub(crate) fn decode_change(payload: &[u8]) -> Result<SnapshotChange, String> {
    let mut input = ByteReader::new(payload);
    let deleted = |input: &mut ByteReader| -> Result<u16, String> {
        let space = input.u16()?;
        if space == 0 || space as usize > SNAPSHOTS_MAX {
            return Err(format!("deleting key space {space}"));
        }
        Ok(space)
    };
    let change = match input.u8()? {
        TAKE => SnapshotChange::Take(decode_snapshot(&mut input, false)?),
        TAKE_OF => SnapshotChange::Take(decode_snapshot(&mut input, true)?),
        DELETE => SnapshotChange::Delete {
            space: deleted(&mut input)?,
        },
        CLONE => SnapshotChange::Clone(decode_clone(&mut input)?),
        DELETE_CLONE => SnapshotChange::DeleteClone {
            space: deleted(&mut input)?,
        },
        other => return Err(format!("snapshot change {other}")),
    };
    if input.remaining() != 0 {
        return Err("trailing bytes after a snapshot change".into());
    }
    Ok(change)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(space: u16, version: u64, name: &str) -> Snapshot {
        Snapshot {
            space,
            volume: 0,
            version,
            name: name.into(),
            created_unix_secs: 1_790_000_000,
        }
    }

    #[test]
    fn registry_round_trips_and_rejects_what_it_cannot_hold() {
        let mut snapshots = Snapshots::default();
        assert!(snapshots.apply(&SnapshotChange::Take(snap(1, 10, "a"))));
        assert!(snapshots.apply(&SnapshotChange::Take(snap(2, 20, "b-2.x_y"))));
        assert!(!snapshots.apply(&SnapshotChange::Take(snap(2, 20, "b-2.x_y"))));
        assert_eq!(snapshots.older_than(2).unwrap().name, "a");
        assert!(snapshots.older_than(1).is_none());
        assert_eq!(snapshots.chain_from(1).count(), 2);
        assert_eq!(snapshots.free_space(), Some(3));
        let mut out = ByteWriter::new();
        snapshots.encode(&mut out);
        let bytes = out.buf;
        let back = Snapshots::decode(&mut ByteReader::new(&bytes), 8).unwrap();
        assert_eq!(back, snapshots);
        assert!(snapshots.apply(&SnapshotChange::Delete { space: 1 }));
        assert!(!snapshots.apply(&SnapshotChange::Delete { space: 1 }));
        assert_eq!(snapshots.free_space(), Some(1));
        for change in [
            SnapshotChange::Take(snap(7, 99, "seven")),
            SnapshotChange::Delete { space: 7 },
        ] {
            assert_eq!(decode_change(&encode_change(&change)).unwrap(), change);
        }
        assert!(decode_change(&[9]).is_err());
        // Format 7's snapshot record, without a volume: the image's volume.
        let mut seven = vec![TAKE];
        let mut out = ByteWriter::new();
        encode_snapshot(&snap(3, 40, "old"), false, &mut out);
        seven.extend(out.buf);
        assert_eq!(
            decode_change(&seven).unwrap(),
            SnapshotChange::Take(snap(3, 40, "old"))
        );
        assert!(decode_change(&[DELETE, 0, 0]).is_err());
    }

    #[test]
    fn clones_and_snapshots_of_clones_round_trip_and_chain_per_volume() {
        let mut registry = Snapshots::default();
        registry.apply(&SnapshotChange::Take(snap(1, 10, "base")));
        let clone = CloneVolume {
            space: 2,
            base: 1,
            version: 11,
            name: "vm1".into(),
            created_unix_secs: 5,
        };
        assert!(registry.apply(&SnapshotChange::Clone(clone.clone())));
        assert!(!registry.apply(&SnapshotChange::Clone(clone.clone())));
        let of_clone = Snapshot {
            volume: 2,
            ..snap(3, 12, "vm1-a")
        };
        registry.apply(&SnapshotChange::Take(of_clone.clone()));
        registry.apply(&SnapshotChange::Take(snap(4, 13, "later")));
        assert_eq!(registry.newest_of(0).unwrap().name, "later");
        assert_eq!(registry.newest_of(2).unwrap().name, "vm1-a");
        assert!(registry.older_than(3).is_none(), "the clone's first");
        assert_eq!(registry.older_than(4).unwrap().name, "base");
        let chain: Vec<u16> = registry.chain_from(1).map(|s| s.space).collect();
        assert_eq!(chain, [1, 4], "the volume's snapshots only");
        assert_eq!(registry.volume_of_space(3), Some(2));
        assert_eq!(registry.volume_of_space(2), Some(2));
        assert_eq!(registry.volume_of_space(9), None);
        assert_eq!(registry.free_space(), Some(5));
        assert!(registry.names("vm1") && registry.names("base") && !registry.names("x"));
        assert_eq!(registry.clones_of(1).count(), 1);
        let mut out = ByteWriter::new();
        registry.encode(&mut out);
        let back = Snapshots::decode(&mut ByteReader::new(&out.buf), 8).unwrap();
        assert_eq!(back, registry);
        for change in [
            SnapshotChange::Clone(clone),
            SnapshotChange::DeleteClone { space: 2 },
            SnapshotChange::Take(of_clone),
        ] {
            assert_eq!(decode_change(&encode_change(&change)).unwrap(), change);
        }
        assert!(registry.apply(&SnapshotChange::DeleteClone { space: 2 }));
        assert!(registry.clone_by_name("vm1").is_none());
        // A root listing a snapshot of a clone that is not there.
        let mut out = ByteWriter::new();
        registry.encode(&mut out);
        let error = Snapshots::decode(&mut ByteReader::new(&out.buf), 8).unwrap_err();
        assert!(error.contains("missing clone"), "{error}");
    }

    #[test]
    fn the_longest_change_fits_a_snapshot_record() {
        let longest = encode_change(&SnapshotChange::Take(snap(1, 2, &"n".repeat(NAME_MAX))));
        assert_eq!(longest.len(), crate::record::SNAPSHOT_PAYLOAD_MAX as usize);
        let clone = encode_change(&SnapshotChange::Clone(CloneVolume {
            space: 1,
            base: 2,
            version: 3,
            name: "n".repeat(NAME_MAX),
            created_unix_secs: 4,
        }));
        assert_eq!(clone.len(), crate::record::SNAPSHOT_PAYLOAD_MAX as usize);
    }

    #[test]
    fn names_that_need_quoting_are_refused() {
        for good in ["a", "nightly-2026.11.27", "X_1"] {
            check_name(good).unwrap();
        }
        for bad in ["", ".hidden", "-x", "a b", "a/b", "é", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }
}
