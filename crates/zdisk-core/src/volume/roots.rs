//! Roots: the one place a [`Root`] is built, and writing one to its slot.
//!
//! A root is written to create a volume, at every checkpoint (naming its
//! dump), and in between to mark the volume dirty when it opens and to
//! renew the reservations of segments and numbers (naming the newest
//! checkpoint's dump). Generation `g` goes to slot `g % 2`, and counts only
//! once it is durable, so that a failed write never breaks the alternation.

use crate::error::{Error, Result};
use crate::meta::{CheckpointRoot, RetainedRoot, Root, Settings, Superblock};
use crate::stats::Counters;

use super::space::Reservation;
use super::state::{State, Tally};
use super::Volume;

/// Everything a root records beyond the superblock and settings.
pub(super) struct RootContents<'a> {
    pub generation: u64,
    /// Written by a clean shutdown: nothing after it to replay.
    pub clean: bool,
    /// The checkpoint it points at: dump, boundary, open segments.
    pub retained: &'a RetainedRoot,
    pub next_seq: u64,
    pub next_version: u64,
    pub reservation: &'a Reservation,
    pub counters: Counters,
}

/// Builds a root. Every root zdisk writes comes from here.
pub(super) fn build_root(
    superblock: &Superblock,
    settings: Settings,
    contents: RootContents,
) -> Root {
    let RootContents {
        generation,
        clean,
        retained,
        next_seq,
        next_version,
        reservation,
        counters,
    } = contents;
    assert_eq!(retained.generation, generation, "a root retains itself");
    assert!(
        reservation.seq >= next_seq,
        "the reservation starts at next_seq"
    );
    assert!(
        reservation.version >= next_version,
        "the reservation starts at next_version"
    );
    debug_assert!(
        retained.boundary <= next_seq,
        "the boundary lies behind next_seq"
    );
    Root {
        generation,
        superblock: superblock.clone(),
        settings,
        checkpoint: CheckpointRoot {
            clean,
            seq_boundary: retained.boundary,
            next_seq,
            next_version,
            seq_reserved: reservation.seq,
            version_reserved: reservation.version,
            reserved_segments: reservation.segments.clone(),
            open_segments: retained.open.clone(),
            dump: retained.dump.clone(),
            counters,
            snapshots: retained.snapshots.clone(),
        },
    }
}

impl Volume {
    /// Writes a root that points at the newest checkpoint dump: to mark
    /// the volume dirty when it opens, and to renew reservations (with at
    /// least `min_segments` segments and `min_versions` versions). The
    /// caller holds the maintenance lock or has the volume to itself.
    pub(super) fn write_root(
        &self,
        clean: bool,
        min_segments: u64,
        min_versions: u64,
    ) -> Result<()> {
        let (root, retained, reservation) = {
            let state = self.lock();
            // Counted only once durable (see `checkpoint_locked`).
            let generation = state.generation() + 1;
            let reservation = state.propose_reservation(min_segments, min_versions);
            let retained = RetainedRoot {
                generation,
                ..state.newest_root().clone()
            };
            let root = self.root_of(&state, clean, &retained, &reservation);
            (root, retained, reservation)
        };
        self.commit_root(&root)?;
        self.lock().install_root(retained, &reservation);
        Ok(())
    }

    /// The root that records `state` now, pointing at the checkpoint
    /// `retained` describes (its generation is the root's) and carrying
    /// `reservation`.
    pub(super) fn root_of(
        &self,
        state: &State,
        clean: bool,
        retained: &RetainedRoot,
        reservation: &Reservation,
    ) -> Root {
        let space = state.space();
        let contents = RootContents {
            generation: retained.generation,
            clean,
            retained,
            next_seq: space.next_seq(),
            next_version: space.next_version(),
            reservation,
            counters: state.counters(),
        };
        build_root(&self.superblock, self.settings, contents)
    }

    /// Writes `root` to its slot and syncs: the commit point of a root.
    pub(super) fn commit_root(&self, root: &Root) -> Result<()> {
        let bytes = root.encode();
        if bytes.len() > self.geometry.meta_slot_size_bytes as usize {
            return Err(Error::CorruptImage(format!(
                "checkpoint root of {} bytes exceeds the {}-byte metadata slot",
                bytes.len(),
                self.geometry.meta_slot_size_bytes
            )));
        }
        self.media.write_meta_slot(root.slot(), &bytes)?;
        self.media.sync()?;
        self.lock().tally(Tally::RootWritten(bytes.len() as u64));
        Ok(())
    }
}
