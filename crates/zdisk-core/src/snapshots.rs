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
//! This file holds the registry and its encodings; `volume/state/snapshots.rs`
//! changes the map.

use crate::bytes::{ByteReader, ByteWriter};

/// Snapshots one volume may have at once.
pub const SNAPSHOTS_MAX: usize = 256;

/// The longest snapshot name, in bytes.
pub const NAME_MAX: usize = 64;

/// One snapshot.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Snapshot {
    /// The key space of the entries it keeps (1 and up).
    pub space: u16,
    /// The version it was taken at: it sees entries written before it.
    pub version: u64,
    pub name: String,
    pub created_unix_secs: u64,
}

/// What a snapshot record (kind 9) says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SnapshotChange {
    Take(Snapshot),
    Delete { space: u16 },
}

const TAKE: u8 = 1;
const DELETE: u8 = 2;

/// The volume's snapshots, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshots {
    list: Vec<Snapshot>,
}

/// Checks a name a user gives a snapshot: 1 to 64 bytes of letters,
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
    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    /// Oldest first.
    pub(crate) fn list(&self) -> &[Snapshot] {
        &self.list
    }

    pub(crate) fn newest(&self) -> Option<&Snapshot> {
        self.list.last()
    }

    pub(crate) fn by_name(&self, name: &str) -> Option<&Snapshot> {
        self.list.iter().find(|s| s.name == name)
    }

    pub(crate) fn by_space(&self, space: u16) -> Option<&Snapshot> {
        self.list.iter().find(|s| s.space == space)
    }

    /// The snapshot taken just before the one in `space`.
    pub(crate) fn older_than(&self, space: u16) -> Option<&Snapshot> {
        let at = self.list.iter().position(|s| s.space == space)?;
        at.checked_sub(1).map(|i| &self.list[i])
    }

    /// The snapshot in `space` and every newer one, oldest first: the
    /// spaces its view looks in before the volume's.
    pub(crate) fn chain_from(&self, space: u16) -> &[Snapshot] {
        match self.list.iter().position(|s| s.space == space) {
            Some(at) => &self.list[at..],
            None => &[],
        }
    }

    /// The lowest key space no snapshot uses.
    pub(crate) fn free_space(&self) -> Option<u16> {
        (1..=SNAPSHOTS_MAX as u16).find(|&space| self.by_space(space).is_none())
    }

    /// Applies a change (a new snapshot is the newest); false if it was
    /// applied already (recovery replays records a checkpoint holds).
    pub(crate) fn apply(&mut self, change: &SnapshotChange) -> bool {
        match change {
            SnapshotChange::Take(snapshot) => {
                if self.by_space(snapshot.space).is_some() {
                    return false;
                }
                debug_assert!(
                    self.newest().is_none_or(|n| n.version < snapshot.version),
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
        }
    }

    /// The registry as a root holds it (format 7).
    pub(crate) fn encode(&self, out: &mut ByteWriter) {
        out.u16(self.list.len() as u16);
        for snapshot in &self.list {
            encode_snapshot(snapshot, out);
        }
    }

    pub(crate) fn decode(input: &mut ByteReader) -> Result<Snapshots, String> {
        let count = input.u16()? as usize;
        if count > SNAPSHOTS_MAX {
            return Err(format!("{count} snapshots, at most {SNAPSHOTS_MAX}"));
        }
        let mut list: Vec<Snapshot> = Vec::with_capacity(count);
        for _ in 0..count {
            let snapshot = decode_snapshot(input)?;
            if list
                .iter()
                .any(|s| s.space == snapshot.space || s.name == snapshot.name)
            {
                return Err(format!("snapshot {} listed twice", snapshot.name));
            }
            if list.last().is_some_and(|s| s.version >= snapshot.version) {
                return Err(format!("snapshot {} out of order", snapshot.name));
            }
            list.push(snapshot);
        }
        Ok(Snapshots { list })
    }
}

fn encode_snapshot(snapshot: &Snapshot, out: &mut ByteWriter) {
    out.u16(snapshot.space);
    out.u64(snapshot.version);
    out.u64(snapshot.created_unix_secs);
    out.u8(snapshot.name.len() as u8);
    out.bytes(snapshot.name.as_bytes());
}

fn decode_snapshot(input: &mut ByteReader) -> Result<Snapshot, String> {
    let space = input.u16()?;
    let version = input.u64()?;
    let created_unix_secs = input.u64()?;
    let len = input.u8()? as usize;
    let name = std::str::from_utf8(input.take(len)?)
        .map_err(|_| "a snapshot name is not UTF-8".to_string())?
        .to_string();
    check_name(&name)?;
    if space == 0 || space as usize > SNAPSHOTS_MAX {
        return Err(format!("snapshot {name} in key space {space}"));
    }
    if version > crate::map::VERSION_MAX {
        return Err(format!("snapshot {name} at version {version}"));
    }
    Ok(Snapshot {
        space,
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
            out.u8(TAKE);
            encode_snapshot(snapshot, &mut out);
        }
        SnapshotChange::Delete { space } => {
            out.u8(DELETE);
            out.u16(*space);
        }
    }
    out.buf
}

pub(crate) fn decode_change(payload: &[u8]) -> Result<SnapshotChange, String> {
    let mut input = ByteReader::new(payload);
    let change = match input.u8()? {
        TAKE => SnapshotChange::Take(decode_snapshot(&mut input)?),
        DELETE => {
            let space = input.u16()?;
            if space == 0 || space as usize > SNAPSHOTS_MAX {
                return Err(format!("deleting key space {space}"));
            }
            SnapshotChange::Delete { space }
        }
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
        assert_eq!(snapshots.chain_from(1).len(), 2);
        assert_eq!(snapshots.free_space(), Some(3));
        let mut out = ByteWriter::new();
        snapshots.encode(&mut out);
        let bytes = out.buf;
        let back = Snapshots::decode(&mut ByteReader::new(&bytes)).unwrap();
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
        assert!(decode_change(&[DELETE, 0, 0]).is_err());
    }

    #[test]
    fn the_longest_change_fits_a_snapshot_record() {
        let longest = encode_change(&SnapshotChange::Take(snap(1, 2, &"n".repeat(NAME_MAX))));
        assert_eq!(longest.len(), crate::record::SNAPSHOT_PAYLOAD_MAX as usize);
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
