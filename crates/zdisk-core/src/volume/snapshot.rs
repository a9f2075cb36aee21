//! Snapshots as the host sees them (issue #26): taking, listing and
//! deleting them, and a read-only [`SnapshotDevice`] per snapshot. The
//! model is in `snapshots.rs`; the map changes in `state/snapshots.rs`.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::sync::Arc;

use serde::Serialize;

use crate::device::{BlockDevice, Extent, ExtentState, StoredExtent};
use crate::error::{Error, Result};
use crate::map::{key_block, Slot, SPACE_BLOCKS};
use crate::snapshots::Snapshot;
use crate::units::{Lba, BLOCK_SIZE, BLOCK_SIZE_U64};

use super::io::{block_mut, Finder, Lookup, RANGE_RECORD_LEN};
use super::space::{Need, Reach, Writer};
use super::state::StreamKind;
use super::status::View;
use super::Volume;

/// Blocks one block-status call on a snapshot describes at most (a reply
/// may cover less than asked: the client asks again from where it ends).
const STATUS_BLOCKS_MAX: u64 = 1 << 16;

/// A snapshot, as `zdisk volumes` and the control socket list it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SnapshotInfo {
    pub name: String,
    /// The clone it was taken of; `None` for the image's volume.
    pub of: Option<String>,
    /// The version it was taken at (it holds every write before it).
    pub version: u64,
    pub created_unix_secs: u64,
    /// Blocks whose entries it keeps (the volume changed them since it
    /// was taken, and no newer snapshot keeps them), and their stored
    /// bytes.
    pub kept_blocks: u64,
    pub kept_stored_bytes: u64,
    /// Of those, the entries deleting it now would free (the rest go to
    /// the next older snapshot, which sees them), and their stored bytes
    /// (of a shared content, none: its record stays while others name it).
    /// Found by walking this snapshot's and the older one's kept entries:
    /// O(entries kept), never the volume's map.
    pub frees_blocks: u64,
    pub frees_stored_bytes: u64,
}

/// What deleting a snapshot did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DeletedSnapshot {
    /// Entries it kept that the next older snapshot sees: handed to it.
    pub handed_down: u64,
    /// Entries no snapshot sees any more: freed.
    pub freed: u64,
}

/// What `Volume::compact` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Compacted {
    pub segments_cleaned: u64,
    /// Medium bytes in use before and after (`physical_used_bytes`).
    pub used_before_bytes: u64,
    pub used_after_bytes: u64,
}

impl Volume {
    /// Cleans every segment with at least a sixteenth of a segment of
    /// garbage, then checkpoints, so the space deleted snapshots and
    /// trims freed is free now rather than when the cleaner gets to it.
    /// Bounded by one pass over the segments.
    pub fn compact(&self) -> Result<Compacted> {
        let used_before_bytes = self.stats().physical_used_bytes;
        let min_garbage = self.geometry.segment_size_bytes / 16;
        let mut segments_cleaned = 0;
        for _ in 0..self.geometry.segment_count {
            if !self.clean_one(min_garbage)? {
                break;
            }
            segments_cleaned += 1;
        }
        self.checkpoint()?;
        Ok(Compacted {
            segments_cleaned,
            used_before_bytes,
            used_after_bytes: self.stats().physical_used_bytes,
        })
    }

    /// Takes snapshot `name` of the volume: it holds every write that
    /// completed before the call, none issued after it returns, and each
    /// one in between whole or not at all. Durable when it returns. Costs
    /// one small record and a flush, whatever the volume's size.
    pub fn take_snapshot(&self, name: &str) -> Result<Snapshot> {
        self.take_snapshot_in(0, name)
    }

    /// Takes snapshot `name` of the volume in key space `volume` (0, or a
    /// clone's), as [`Volume::take_snapshot`] does.
    pub(super) fn take_snapshot_in(&self, volume: u16, name: &str) -> Result<Snapshot> {
        self.refuse_snapshots()?;
        crate::snapshots::check_name(name).map_err(Error::InvalidArgument)?;
        let (mut state, floor) = self.admit(Writer::Range, (Lba(0), 0), RANGE_RECORD_LEN, 1)?;
        let snapshot = state.take_snapshot(volume, name, unix_now_secs(), floor)?;
        drop(state);
        self.flush()?;
        Ok(snapshot)
    }

    /// Deletes snapshot `name`: what it alone kept is freed (the cleaner
    /// reclaims the space as it reclaims any dead record), what the next
    /// older snapshot of its volume sees is handed to it. Durable when it
    /// returns. A snapshot with clones is refused.
    pub fn delete_snapshot(&self, name: &str) -> Result<DeletedSnapshot> {
        self.refuse_snapshots()?;
        // No cleaning step between finding the kept entries and moving them.
        let _maintenance = self.maintenance.lock().expect("maintenance lock poisoned");
        let (space, ranges) = {
            let state = self.lock();
            let snapshot = state
                .snapshots()
                .by_name(name)
                .ok_or_else(|| no_such_snapshot(name))?;
            (snapshot.space, state.snapshot_delete_ranges(snapshot.space))
        };
        let (mut state, floor) = self.make_room_resident(Reach::Nested, &ranges, |state| Need {
            writer: Writer::Range,
            segments: state.segments_needed(StreamKind::Host, RANGE_RECORD_LEN),
            versions: 1,
            bytes: RANGE_RECORD_LEN,
        })?;
        if state.snapshots().by_space(space).is_none() {
            return Err(no_such_snapshot(name));
        }
        let deleted = state.delete_snapshot(space, floor)?;
        drop(state);
        self.flush()?;
        Ok(DeletedSnapshot {
            handed_down: deleted.handed_down,
            freed: deleted.freed,
        })
    }

    /// The snapshots, oldest first, with what each keeps (a walk of the
    /// entries they keep: O(kept entries), nothing else).
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        let state = self.lock_frozen();
        let mut infos = Vec::new();
        // Per volume, the blocks the next older snapshot keeps entries
        // for: deleting a snapshot hands it an entry it sees only where it
        // keeps none.
        let mut olders: HashMap<u16, (u64, HashSet<u64>)> = HashMap::new();
        for snapshot in state.snapshots().list() {
            let older = olders.get(&snapshot.volume);
            let (mut blocks, mut bytes, mut frees, mut frees_bytes) = (0, 0, 0, 0);
            let mut own = HashSet::new();
            state.map().for_each_kept(
                &*self.media,
                crate::map::space_key(snapshot.space, 0),
                SPACE_BLOCKS,
                |key, entry| {
                    let block = key_block(key.0);
                    let stored = match entry.slot() {
                        Slot::Data(loc) => loc.share(),
                        _ => 0,
                    };
                    blocks += 1;
                    bytes += stored;
                    let handed_down = older.is_some_and(|(version, kept)| {
                        entry.version() < *version && !kept.contains(&block)
                    });
                    if !handed_down {
                        frees += 1;
                        frees_bytes += stored;
                    }
                    own.insert(block);
                },
            )?;
            infos.push(SnapshotInfo {
                name: snapshot.name.clone(),
                of: state
                    .snapshots()
                    .clone_by_space(snapshot.volume)
                    .map(|c| c.name.clone()),
                version: snapshot.version,
                created_unix_secs: snapshot.created_unix_secs,
                kept_blocks: blocks,
                kept_stored_bytes: bytes,
                frees_blocks: frees,
                frees_stored_bytes: frees_bytes,
            });
            olders.insert(snapshot.volume, (snapshot.version, own));
        }
        Ok(infos)
    }

    /// The snapshots, oldest first, without what they keep (cheap).
    pub fn snapshot_list(&self) -> Vec<Snapshot> {
        self.lock().snapshots().list().to_vec()
    }

    /// How many snapshots the volume has.
    pub fn snapshot_count(&self) -> usize {
        self.lock().snapshots().len()
    }

    /// Snapshot `name` as a read-only block device.
    pub fn snapshot_device(self: &Arc<Self>, name: &str) -> Result<SnapshotDevice> {
        let state = self.lock();
        let snapshot = state
            .snapshots()
            .by_name(name)
            .ok_or_else(|| no_such_snapshot(name))?;
        Ok(SnapshotDevice {
            volume: Arc::clone(self),
            space: snapshot.space,
            name: name.to_string(),
        })
    }

    /// Emulated drives model controllers without snapshots; the tier
    /// does not carry them yet.
    pub(super) fn refuse_snapshots(&self) -> Result<()> {
        use crate::meta::MediaKind;
        match self.superblock.media_kind {
            MediaKind::File | MediaKind::Memory => Ok(()),
            MediaKind::Nand => Err(Error::InvalidArgument(
                "an emulated drive takes no snapshots or clones (the controllers it models have \
                 none); \
                 use an image on a file or block device"
                    .into(),
            )),
            MediaKind::Tiered => Err(Error::InvalidArgument(
                "a tiered image takes no snapshots or clones yet (the bucket's copies would not keep \
                 them); snapshot an untiered image"
                    .into(),
            )),
        }
    }

    /// Reads blocks `first..` of a snapshot's or a clone's `view` into
    /// `out`; `name` is for the error if it is gone.
    pub(super) fn read_view_blocks(
        &self,
        view: View,
        name: &str,
        first: Lba,
        out: &mut [u8],
    ) -> Result<()> {
        let count = (out.len() / BLOCK_SIZE) as u64;
        let mut lookup = Lookup::with_capacity(count as usize);
        {
            // The same blocks in every snapshot's and clone's space come
            // with them.
            let state = self.make_resident(self.lock(), &[(first, count)])?;
            if !state.view_exists(view) {
                return Err(gone(view, name));
            }
            let mut finder = Finder::new(&state, first, out, &mut lookup).by_version();
            for i in 0..count {
                let lba = Lba(first.0 + i);
                finder.add(lba, state.view_entry(view, lba));
            }
            let complete = finder.finish()?;
            debug_assert!(complete, "cells of the snapshot's blocks are in RAM");
        }
        for (index, error) in self.fetch(first, lookup, out) {
            // The cleaner may have moved the record meanwhile: once more.
            let lba = Lba(first.0 + index as u64);
            let entry = {
                let state = self.make_resident(self.lock(), &[(lba, 1)])?;
                let entry = state.view_entry(view, lba);
                match entry.slot() {
                    Slot::Shared { content } => {
                        Some(state.map().get(crate::map::table_key(content)))
                    }
                    Slot::Hole | Slot::Zero => None,
                    _ => Some(entry),
                }
            };
            let block = block_mut(out, index);
            match entry {
                None => block.fill(0),
                Some(entry) => {
                    if self.read_block_once(lba, entry, true, block).is_err() {
                        return Err(error);
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads bytes `offset..` of a snapshot's or a clone's `view` into
    /// `buf`, whole blocks or not.
    pub(super) fn read_view_bytes(
        &self,
        view: View,
        name: &str,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let first = offset / BLOCK_SIZE_U64;
        let end = (offset + buf.len() as u64).div_ceil(BLOCK_SIZE_U64);
        let aligned = offset.is_multiple_of(BLOCK_SIZE_U64) && buf.len().is_multiple_of(BLOCK_SIZE);
        if aligned {
            return self.read_view_blocks(view, name, Lba(first), buf);
        }
        let mut blocks = vec![0u8; ((end - first) * BLOCK_SIZE_U64) as usize];
        self.read_view_blocks(view, name, Lba(first), &mut blocks)?;
        let skip = (offset - first * BLOCK_SIZE_U64) as usize;
        buf.copy_from_slice(&blocks[skip..skip + buf.len()]);
        Ok(())
    }

    /// Block status of a snapshot's or a clone's `view` over
    /// `offset..offset+len`, as NBD's `base:allocation` context says it.
    pub(super) fn view_block_status(
        &self,
        view: View,
        offset: u64,
        len: u64,
        max_extents: usize,
    ) -> Result<Vec<Extent>> {
        self.check_access(offset, len, false)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let first = offset / BLOCK_SIZE_U64;
        let end = (offset + len).div_ceil(BLOCK_SIZE_U64);
        let runs = self.view_status(view, Lba(first), end - first, max_extents)?;
        Ok(super::extents_of(offset, len, runs))
    }

    /// Block status runs of a snapshot's or a clone's `view`.
    fn view_status(
        &self,
        view: View,
        first: Lba,
        count: u64,
        max: usize,
    ) -> Result<Vec<(ExtentState, u64)>> {
        let count = count.min(STATUS_BLOCKS_MAX);
        let state = self.make_resident(self.lock(), &[(first, count)])?;
        if !state.view_exists(view) {
            return Err(gone(view, ""));
        }
        let mut runs: Vec<(ExtentState, u64)> = Vec::new();
        let max = max.max(1);
        state.for_each_view_run(view, first, count, |_, blocks, entry| {
            let extent = match entry.slot() {
                Slot::Hole => ExtentState::Hole,
                Slot::Zero => ExtentState::Zero,
                _ => ExtentState::Data,
            };
            let full = runs.len() == max;
            match runs.last_mut() {
                Some((last, n)) if *last == extent => *n += blocks,
                _ if full => return ControlFlow::Break(()),
                _ => runs.push((extent, blocks)),
            }
            ControlFlow::Continue(())
        });
        Ok(runs)
    }
}

pub(super) fn unix_now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn no_such_snapshot(name: &str) -> Error {
    Error::InvalidArgument(format!("no snapshot named {name:?}"))
}

/// The error for a read of a snapshot or clone deleted meanwhile.
pub(super) fn gone(view: View, name: &str) -> Error {
    match view {
        _ if name.is_empty() => Error::InvalidArgument("the snapshot or clone was deleted".into()),
        View::Clone(..) => Error::InvalidArgument(format!("no clone named {name:?}")),
        _ => no_such_snapshot(name),
    }
}

/// A snapshot served as a read-only block device.
pub struct SnapshotDevice {
    volume: Arc<Volume>,
    space: u16,
    name: String,
}

impl SnapshotDevice {
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl BlockDevice for SnapshotDevice {
    fn size_bytes(&self) -> u64 {
        self.volume.superblock.logical_size_bytes
    }

    fn is_read_only(&self) -> bool {
        true
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.volume.check_access(offset, buf.len() as u64, false)?;
        self.volume
            .read_view_bytes(View::Snapshot(self.space), &self.name, offset, buf)
    }

    fn write(&self, _offset: u64, _data: &[u8], _fua: bool) -> Result<()> {
        Err(Error::ReadOnly)
    }

    fn write_zeroes(&self, _offset: u64, _len: u64, _may_punch: bool, _fua: bool) -> Result<()> {
        Err(Error::ReadOnly)
    }

    fn trim(&self, _offset: u64, _len: u64, _fua: bool) -> Result<()> {
        Err(Error::ReadOnly)
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>> {
        self.volume
            .view_block_status(View::Snapshot(self.space), offset, len, max_extents)
    }

    /// How each block the snapshot sees is stored (`zdisk map`, NBD's
    /// `zdisk:compression`), as the volume's export says it.
    fn stored_status(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
    ) -> Result<Vec<StoredExtent>> {
        self.volume.check_access(offset, len, false)?;
        self.volume
            .stored_runs(View::Snapshot(self.space), offset, len, max_extents)
    }
}
