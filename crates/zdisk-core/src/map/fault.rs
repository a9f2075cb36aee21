//! Faulting paged-out leaves in without the map borrowed.
//!
//! [`Map::load`] reads pages while the map, and so the engine's state
//! lock, is held: every other request waits for the medium. The engine
//! instead lists a range's paged-out leaves under the lock
//! ([`Map::faults`]), each a [`Fault`] carrying everything reading and
//! verifying its page needs; pins them ([`Map::pin_faults`]); reads them
//! with no lock held ([`Fault::read`]); and, under the lock again,
//! installs what it read ([`Map::install`]) and unpins
//! ([`Map::unpin_faults`]). `volume/fault.rs` drives it.
//!
//! The race with checkpoints. A fault reads from the newest durable dump.
//! While it reads, a checkpoint may make a newer root durable (the leaf's
//! page then lives in the new dump) and the next one may release the dump
//! being read (`State::release_dump_unless_retained`), whose segments may
//! then be reused and overwritten. Two things make this safe:
//!
//! - The pin. While a pinned fault reads from a dump, that dump's
//!   segments are not released: their release waits for the last pin on
//!   its generation ([`Map::defer_dump_release`], [`Map::unpin_faults`]).
//!   A page read under a pin is never overwritten meanwhile, so a failed
//!   verification is the medium's damage, not the race.
//! - Detection. A leaf is installed only if it is still paged out and its
//!   page is still where the fault read it (the same dump generation and
//!   place); otherwise the fault is stale (another thread installed the
//!   leaf first, or a checkpoint moved its page) and is dropped, and the
//!   caller looks again. After a failed read, [`Map::fault_is_current`]
//!   tells damage (the page is still there: report it) from a page that
//!   moved (read it again from its new place); a page that moved is never
//!   reported as damage.
//!
//! Even unpinned, a read of a reused segment could not pass for the page:
//! a page's record carries its leaf's first block and its dump's
//! generation under the record checksum, and no later record repeats a
//! generation. The pin saves the wasted read and makes an error mean
//! damage.
//!
//! The pin also spares the range's leaves from eviction until it goes: the
//! faulting thread wants every leaf of its range in RAM at once, and
//! eviction, which runs at every release of the state lock, could
//! otherwise evict one leaf of the range while another is read (for ever,
//! with a cache of zero). A range may so take the leaves in RAM past the
//! cache by its own leaves, for as long as it is pinned.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::media::Media;
use crate::units::{Lba, SegmentId};

use super::leaf::Leaf;
use super::page::{self, PageLoc, PageStore};
use super::{check_leaf, Map};

/// A paged-out leaf to read back with no lock held: its range, where its
/// page is, and what verifying it needs.
pub(crate) struct Fault {
    start: u64,
    blocks: u64,
    chunk_items: u64,
    loc: PageLoc,
    store: Arc<PageStore>,
    keep_tombstones: bool,
}

/// A leaf read back from its page and verified, for [`Map::install`].
pub(crate) struct ReadLeaf(Leaf);

impl ReadLeaf {
    pub(super) fn into_leaf(self) -> Leaf {
        self.0
    }
}

impl Fault {
    /// The leaf's first block.
    pub(crate) fn start(&self) -> Lba {
        Lba(self.start)
    }

    /// The generation of the dump the page is read from.
    pub(crate) fn generation(&self) -> u64 {
        self.store.generation
    }

    /// Reads the page and verifies it: the record (checksum, kind, first
    /// block, generation; copy 1 if copy 0 fails), its decoding, its range
    /// and chunk count against the leaf's stub, and the leaf's invariants.
    pub(crate) fn read(&self, media: &dyn Media) -> Result<ReadLeaf> {
        let leaf = page::read_page(media, &self.store, self.start, self.loc)?;
        if leaf.blocks() != self.blocks || leaf.chunk_items() != self.chunk_items {
            return Err(Error::CorruptImage(format!(
                "the map page of block {} holds {} blocks in {} chunks, its directory says {} in {}",
                self.start,
                leaf.blocks(),
                leaf.chunk_items(),
                self.blocks,
                self.chunk_items
            )));
        }
        check_leaf(self.start, &leaf, self.keep_tombstones).map_err(Error::CorruptImage)?;
        Ok(ReadLeaf(leaf))
    }
}

/// A range being faulted in: its leaves stay in RAM and the dump it reads
/// stays on the medium until [`Map::unpin_faults`] takes it back.
#[must_use = "a pin must be given back to Map::unpin_faults"]
pub(crate) struct FaultPin {
    id: u64,
}

/// The pinned ranges, and the dumps whose release waits for them.
#[derive(Default)]
pub(super) struct Pins {
    ranges: Vec<PinnedRange>,
    next_id: u64,
    /// Dumps no root names any more, by generation, whose segments are
    /// released once no range reading from them is pinned.
    deferred: Vec<(u64, Vec<SegmentId>)>,
}

struct PinnedRange {
    id: u64,
    first: u64,
    end: u64,
    /// The dump its faults read from (none if it had no fault).
    generation: Option<u64>,
}

impl Pins {
    /// True if the leaf at `start` of `blocks` blocks overlaps a pinned
    /// range: eviction spares it.
    pub(super) fn spares(&self, start: u64, blocks: u64) -> bool {
        let end = start.saturating_add(blocks);
        self.ranges
            .iter()
            .any(|range| start < range.end && range.first < end)
    }

    fn pins_generation(&self, generation: u64) -> bool {
        self.ranges
            .iter()
            .any(|range| range.generation == Some(generation))
    }
}

impl Map {
    /// The fault of the paged-out leaf `stub` at `start`.
    pub(super) fn fault_at(&self, start: u64, stub: &Leaf) -> Fault {
        debug_assert!(!stub.is_resident(), "faulting a leaf in RAM");
        let loc = self
            .written
            .get(&start)
            .copied()
            .flatten()
            .expect("a paged-out leaf has its page");
        let store = self.store.clone().expect("paged-out leaves have a store");
        Fault {
            start,
            blocks: stub.blocks(),
            chunk_items: stub.chunk_items(),
            loc,
            store,
            keep_tombstones: self.keep_tombstones,
        }
    }

    /// The paged-out leaves holding a block of `first..first+count` (the
    /// ones [`Map::load`] would read), in block order. All of them read
    /// from the same dump.
    pub(crate) fn faults(&self, first: Lba, count: u64) -> Vec<Fault> {
        if self.paged_leaves == 0 {
            return Vec::new();
        }
        self.paged_in(first, count)
            .into_iter()
            .map(|start| self.fault_at(start, &self.leaves[&start]))
            .collect()
    }

    /// Counts a lookup that found every leaf it needed in RAM.
    pub(crate) fn count_hit(&mut self) {
        self.cache.hits += 1;
    }

    /// True if every leaf holding a block of `first..first+count` is in RAM.
    pub(crate) fn is_resident(&self, first: Lba, count: u64) -> bool {
        self.paged_leaves == 0 || self.paged_in(first, count).is_empty()
    }

    /// [`Map::count_hit`] for a lookup under the shared lock.
    pub(crate) fn count_hit_shared(&self) {
        self.shared_hits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Pins `first..first+count`, whose paged-out leaves are `faults`: its
    /// leaves are not evicted, and the dump the faults read from is not
    /// released, until the pin is given back.
    pub(crate) fn pin_faults(&mut self, first: Lba, count: u64, faults: &[Fault]) -> FaultPin {
        let generation = faults.first().map(Fault::generation);
        debug_assert!(
            faults.iter().all(|f| Some(f.generation()) == generation),
            "faults listed together read one dump"
        );
        let id = self.pins.next_id;
        self.pins.next_id += 1;
        self.pins.ranges.push(PinnedRange {
            id,
            first: first.0,
            end: first.0.saturating_add(count),
            generation,
        });
        FaultPin { id }
    }

    /// Gives a pin back. Returns the segments of a dump whose release
    /// waited for it (the caller releases them).
    pub(crate) fn unpin_faults(&mut self, pin: FaultPin) -> Vec<SegmentId> {
        let at = self
            .pins
            .ranges
            .iter()
            .position(|range| range.id == pin.id)
            .expect("a pin is given back once");
        let range = self.pins.ranges.swap_remove(at);
        let Some(generation) = range.generation else {
            return Vec::new();
        };
        if self.pins.pins_generation(generation) {
            return Vec::new();
        }
        let mut released = Vec::new();
        self.pins.deferred.retain_mut(|(deferred, segments)| {
            if *deferred != generation {
                return true;
            }
            released.append(segments);
            false
        });
        released
    }

    /// True if the leaf `fault` reads is still paged out and its page is
    /// still where the fault reads it (the same dump, the same place). A
    /// fault that is not current is stale: the leaf was installed
    /// meanwhile, or a checkpoint moved its page, and a failure to read it
    /// is no sign of damage.
    pub(crate) fn fault_is_current(&self, fault: &Fault) -> bool {
        let paged = matches!(
            self.leaves.get(&fault.start),
            Some(Leaf::Paged { blocks, chunk_items })
                if *blocks == fault.blocks && *chunk_items == fault.chunk_items
        );
        paged
            && self.written.get(&fault.start) == Some(&Some(fault.loc))
            && self
                .store
                .as_ref()
                .is_some_and(|store| store.generation == fault.store.generation)
    }

    /// Installs the leaf `fault` read, if the fault is still current
    /// ([`Map::fault_is_current`]); returns false, and drops the leaf, if
    /// it is stale. An installed leaf is clean: it may be evicted again.
    pub(crate) fn install(&mut self, fault: &Fault, leaf: ReadLeaf) -> bool {
        if !self.fault_is_current(fault) {
            return false;
        }
        let leaf = leaf.into_leaf();
        assert_eq!(leaf.blocks(), fault.blocks, "a leaf of another fault");
        assert_eq!(
            leaf.chunk_items(),
            fault.chunk_items,
            "a leaf of another fault"
        );
        self.leaf_heap_bytes += leaf.heap_bytes();
        self.paged_leaves -= 1;
        self.cache.misses += 1;
        self.leaves.insert(fault.start, leaf);
        self.clean_queue.push_back(fault.start);
        true
    }

    /// A dump of `generation` is no longer named by any root: if a pinned
    /// fault reads from it, keeps `segments` for [`Map::unpin_faults`] to
    /// hand back and returns true; otherwise returns false (release them
    /// now).
    pub(crate) fn defer_dump_release(
        &mut self,
        generation: u64,
        segments: impl Iterator<Item = SegmentId>,
    ) -> bool {
        if !self.pins.pins_generation(generation) {
            return false;
        }
        self.pins.deferred.push((generation, segments.collect()));
        true
    }

    /// Segments of dumps whose release waits for a pin: still in use.
    pub(crate) fn deferred_dump_segments(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.pins
            .deferred
            .iter()
            .flat_map(|(_, segments)| segments.iter().copied())
    }
}
