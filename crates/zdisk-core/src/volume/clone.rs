//! Clones as the host sees them (issue #26): making, listing and deleting
//! them, snapshots of them, and a writable [`CloneDevice`] per clone. The
//! model is in `snapshots.rs` ("A clone"); the map changes in
//! `state/snapshots.rs`.

use std::sync::Arc;

use serde::Serialize;

use crate::device::{BlockDevice, Extent, StoredExtent};
use crate::error::{Error, Result};
use crate::map::{space_key, Slot, SPACE_BLOCKS};
use crate::snapshots::{CloneVolume, Snapshot};
use crate::units::Lba;

use super::io::{Discard, Target, RANGE_RECORD_LEN};
use super::snapshot::unix_now_secs;
use super::space::{Need, Reach, Writer};
use super::state::{StreamKind, View};
use super::Volume;

/// A clone, as `zdisk volumes` and the control socket list it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CloneInfo {
    pub name: String,
    /// The snapshot it was made from.
    pub snapshot: String,
    /// The version it was made at.
    pub version: u64,
    pub created_unix_secs: u64,
    /// Blocks written to the clone since it was made (its own entries:
    /// data, and zeros where it trimmed or zeroed), and the stored bytes of
    /// their records: what deleting it frees, once its snapshots are gone.
    /// Every other block is its snapshot's, shared. Counted by the map as
    /// it changes, per key space: reading them costs nothing.
    pub own_blocks: u64,
    pub own_zero_blocks: u64,
    pub own_stored_bytes: u64,
    /// Its snapshots, oldest first.
    pub snapshots: Vec<String>,
}

/// What a clone sees: found by walking its view
/// ([`Volume::clone_mapped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct CloneMapped {
    /// Blocks holding data in the clone's view.
    pub mapped_blocks: u64,
    /// Of those, the clone's own (written since it was made): exclusive
    /// to it and its snapshots.
    pub own_data_blocks: u64,
    /// The rest: its snapshot's blocks, stored once for every clone and
    /// snapshot that sees them.
    pub shared_blocks: u64,
}

/// Blocks one step of [`Volume::clone_mapped`] walks under the lock.
const MAPPED_WINDOW_BLOCKS: u64 = 1 << 16;

/// What deleting a clone did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DeletedClone {
    /// Data entries of its own that were freed.
    pub freed: u64,
}

impl Volume {
    /// Makes clone `name` of snapshot `snapshot`: a writable volume in the
    /// same image that reads as the snapshot until it is written. Costs one
    /// small record and a flush, whatever the volume's size.
    pub fn make_clone(&self, snapshot: &str, name: &str) -> Result<CloneVolume> {
        self.refuse_snapshots()?;
        crate::snapshots::check_name(name).map_err(Error::InvalidArgument)?;
        let (mut state, floor) = self.admit(Writer::Range, (Lba(0), 0), RANGE_RECORD_LEN, 1)?;
        let base = state
            .snapshots()
            .by_name(snapshot)
            .ok_or_else(|| Error::InvalidArgument(format!("no snapshot named {snapshot:?}")))?
            .space;
        let clone = state.make_clone(base, name, unix_now_secs(), floor)?;
        drop(state);
        self.flush()?;
        Ok(clone)
    }

    /// Takes snapshot `name` of clone `clone`, as
    /// [`Volume::take_snapshot`] takes one of the volume.
    pub fn take_snapshot_of(&self, clone: &str, name: &str) -> Result<Snapshot> {
        let space = self.clone_space(clone)?;
        self.take_snapshot_in(space, name)
    }

    /// Deletes clone `name`, which must have no snapshots: every block it
    /// wrote is freed at once (the cleaner or `compact` gives the medium
    /// back). Durable when it returns.
    pub fn delete_clone(&self, name: &str) -> Result<DeletedClone> {
        self.refuse_snapshots()?;
        // No cleaning step between finding the entries and dropping them.
        let _maintenance = self.maintenance.lock().expect("maintenance lock poisoned");
        let space = self.clone_space(name)?;
        let (mut state, floor) = self.make_room_resident(
            Reach::Nested,
            &[(space_key(space, 0), SPACE_BLOCKS)],
            |state| Need {
                writer: Writer::Range,
                segments: state.segments_needed(StreamKind::Host, RANGE_RECORD_LEN),
                versions: 1,
                bytes: RANGE_RECORD_LEN,
            },
        )?;
        if state.snapshots().clone_by_space(space).is_none() {
            return Err(no_such_clone(name));
        }
        let freed = state.delete_clone(space, floor)?;
        drop(state);
        self.flush()?;
        Ok(DeletedClone { freed })
    }

    /// The clones, oldest first, with what each wrote (the map's counts of
    /// their key spaces: O(1) each, no walk).
    pub fn clones(&self) -> Result<Vec<CloneInfo>> {
        let state = self.lock();
        let registry = state.snapshots();
        Ok(registry
            .clones()
            .iter()
            .map(|clone| {
                let counts = state.map().space_counts(clone.space);
                CloneInfo {
                    name: clone.name.clone(),
                    snapshot: registry
                        .by_space(clone.base)
                        .map_or_else(String::new, |s| s.name.clone()),
                    version: clone.version,
                    created_unix_secs: clone.created_unix_secs,
                    own_blocks: counts.data_blocks + counts.damaged_blocks + counts.zero_blocks,
                    own_zero_blocks: counts.zero_blocks,
                    own_stored_bytes: counts.stored_bytes,
                    snapshots: registry
                        .of_volume(clone.space)
                        .map(|s| s.name.clone())
                        .collect(),
                }
            })
            .collect())
    }

    /// How many blocks clone `name` sees holding data, its own and its
    /// snapshot's: a walk of its view a window of 64 Ki blocks at a time,
    /// each under the lock once, cut where any of the maps it looks at
    /// changes, so O(entries of those spaces) plus one step per window.
    pub fn clone_mapped(&self, name: &str) -> Result<CloneMapped> {
        let Target { space, made } = self.clone_target(name)?;
        let view = View::Clone(space, made);
        let blocks = self.logical_blocks();
        let mut mapped = CloneMapped::default();
        let mut at = 0;
        while at < blocks {
            let count = (blocks - at).min(MAPPED_WINDOW_BLOCKS);
            let state = self.lock_resident(Lba(at), count)?;
            if !state.view_exists(view) {
                return Err(no_such_clone(name));
            }
            state.for_each_view_run(view, Lba(at), count, |first, run, entry| {
                if matches!(entry.slot(), Slot::Data(_) | Slot::Shared { .. }) {
                    mapped.mapped_blocks += run;
                    let own = state.map().get(space_key(space, first.0));
                    if !own.is_hole() {
                        mapped.own_data_blocks += run;
                    }
                }
                std::ops::ControlFlow::Continue(())
            });
            at += count;
        }
        mapped.shared_blocks = mapped.mapped_blocks - mapped.own_data_blocks;
        Ok(mapped)
    }

    /// The clones, oldest first, without what they hold (cheap).
    pub fn clone_list(&self) -> Vec<CloneVolume> {
        self.lock().snapshots().clones().to_vec()
    }

    /// The name of the volume snapshot `name` was taken of: `None` for the
    /// image's own, else the clone's.
    pub fn snapshot_volume(&self, name: &str) -> Option<String> {
        let state = self.lock();
        let registry = state.snapshots();
        let volume = registry.by_name(name)?.volume;
        registry.clone_by_space(volume).map(|c| c.name.clone())
    }

    /// Clone `name` as a block device, writable unless the image was
    /// opened read-only.
    pub fn clone_device(self: &Arc<Self>, name: &str) -> Result<CloneDevice> {
        Ok(CloneDevice {
            volume: Arc::clone(self),
            target: self.clone_target(name)?,
            name: name.to_string(),
        })
    }

    fn clone_space(&self, name: &str) -> Result<u16> {
        Ok(self.clone_target(name)?.space)
    }

    /// Clone `name`'s key space and the version it was made at.
    fn clone_target(&self, name: &str) -> Result<Target> {
        let state = self.lock();
        let clone = state
            .snapshots()
            .clone_by_name(name)
            .ok_or_else(|| no_such_clone(name))?;
        Ok(Target {
            space: clone.space,
            made: clone.version,
        })
    }
}

fn no_such_clone(name: &str) -> Error {
    Error::InvalidArgument(format!("no clone named {name:?}"))
}

/// A clone served as a block device.
pub struct CloneDevice {
    volume: Arc<Volume>,
    target: Target,
    name: String,
}

impl CloneDevice {
    pub fn name(&self) -> &str {
        &self.name
    }

    fn view(&self) -> View {
        View::Clone(self.target.space, self.target.made)
    }
}

impl BlockDevice for CloneDevice {
    fn size_bytes(&self) -> u64 {
        self.volume.superblock.logical_size_bytes
    }

    fn is_read_only(&self) -> bool {
        self.volume.read_only
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.volume.check_access(offset, buf.len() as u64, false)?;
        self.volume.note_host_io(false);
        self.volume
            .read_view_bytes(self.view(), &self.name, offset, buf)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.volume.check_access(offset, data.len() as u64, true)?;
        self.volume.note_host_io(true);
        self.volume.write_bytes(self.target, offset, data, fua)
    }

    fn write_zeroes(&self, offset: u64, len: u64, may_punch: bool, fua: bool) -> Result<()> {
        self.volume.check_access(offset, len, true)?;
        self.volume.note_host_io(true);
        let mode = if may_punch {
            Discard::ZeroPunch
        } else {
            Discard::Zero
        };
        self.volume.discard(self.target, offset, len, mode, fua)
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.volume.check_access(offset, len, true)?;
        self.volume.note_host_io(true);
        self.volume
            .discard(self.target, offset, len, Discard::Trim, fua)
    }

    fn flush(&self) -> Result<()> {
        BlockDevice::flush(&*self.volume)
    }

    fn block_status(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>> {
        self.volume
            .view_block_status(self.view(), offset, len, max_extents)
    }

    /// How each block the clone sees is stored (`zdisk map`, NBD's
    /// `zdisk:compression`).
    fn stored_status(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
    ) -> Result<Vec<StoredExtent>> {
        self.volume.check_access(offset, len, false)?;
        self.volume
            .stored_runs(self.view(), offset, len, max_extents)
    }
}
