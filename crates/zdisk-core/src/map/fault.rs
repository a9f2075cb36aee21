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
//! The race with checkpoints. A fault reads a page where the newest
//! durable root names it. While it reads, a checkpoint may move the page
//! (the leaf's page then lives in the new dump) and the next one may
//! release the dump segment being read (`State::release_dump_segments`),
//! which may then be reused and overwritten. Two things make this safe:
//!
//! - The pin. While a pinned fault reads a page, the segments of its
//!   copies are not released: their release waits for the last pin on
//!   them ([`Map::defer_dump_release`], [`Map::unpin_faults`]).
//!   A page read under a pin is never overwritten meanwhile, so a failed
//!   verification is the medium's damage, not the race.
//! - Detection. A leaf is installed only if it is still paged out and
//!   either its page is still where the fault read it (the same dump
//!   generation and place) or a pin covers it ([`Map::install`]): a leaf
//!   changes only in RAM, and a leaf installed under a pin is not evicted
//!   until the pin goes, so one still paged out under a pin is unchanged
//!   and only its page moved. Otherwise the fault is stale (another
//!   thread installed the leaf first) and is dropped, and the caller
//!   looks again. After a failed read, [`Map::fault_is_current`]
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};
use crate::media::Media;
use crate::units::{Lba, SegmentId};

use super::column::alloc_bytes;
use super::entry::{table_key, Entry, Slot, CHUNK_SHIFT, TABLE_BASE};
use super::leaf::Leaf;
use super::page::{self, PageLoc, PageStore};
use super::{check_leaf, Map};

/// Room a leaf faulted in takes at most (a full dense or sparse leaf
/// holds about 4 KiB): with less free in the cache, a lookup peeks.
const PEEK_ROOM_BYTES: u64 = 8192;

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

    /// The generation of the checkpoint that wrote the page.
    #[cfg(test)]
    pub(crate) fn generation(&self) -> u64 {
        self.loc.generation
    }

    /// The segment of the page's copy 0 (its pin's key).
    fn segment(&self) -> SegmentId {
        self.loc.segments[0]
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

    /// The entries of blocks `first..first+count`, all in this fault's
    /// leaf, read from its page without building the leaf (see
    /// [`Map::peek_fault`]). They are current only if the fault still is
    /// once the caller holds the state lock again
    /// ([`Map::fault_is_current`]). No pin is needed: a page read from a
    /// dump released and overwritten meanwhile fails its record check
    /// (first block and generation under the checksum), and the caller
    /// then faults the leaf in as usual, which tells a moved page from a
    /// damaged one.
    pub(crate) fn peek(&self, media: &dyn Media, first: Lba, count: u64) -> Result<Vec<Entry>> {
        let payload = page::read_page_payload(media, &self.store, self.start, self.loc)?;
        let offset = first.0.checked_sub(self.start).unwrap_or(u64::MAX);
        page::decode_page_range(
            &payload,
            self.store.segment_count,
            self.blocks,
            offset,
            count,
        )
        .map_err(|problem| {
            Error::CorruptImage(format!(
                "the map page of block {} is malformed: {problem}",
                self.start
            ))
        })
    }
}

/// Leaves recently looked up without being kept ([`Map::peek_fault`]),
/// one slot per hash of a leaf's start: a direct-mapped ghost list, as
/// ARC keeps for what it evicted. A leaf peeked again while its slot
/// still names it is taken into the cache; one a lookup meets only once
/// in the cache's turnover is not, so a random read over a map many
/// times the cache reads each page without building its leaf and
/// evicting another for it. Atomic, for lookups under the shared lock.
pub(super) struct Ghosts {
    /// Slots, a power of two (0: no bound, no peeks).
    count: usize,
    shift: u32,
    /// Allocated at the first peek: a map that never fills its cache
    /// spends nothing on them.
    slots: OnceLock<Box<[AtomicU64]>>,
}

impl Ghosts {
    /// About one slot per leaf the cache holds (a leaf holds about 4 KiB
    /// when full), 64 to 65,536.
    pub(super) fn for_cache(cache_bytes: u64) -> Ghosts {
        let count = if cache_bytes == u64::MAX {
            // No bound: the cache is never full, nothing peeks.
            0
        } else {
            (cache_bytes / 4096).clamp(64, 1 << 16).next_power_of_two() as usize
        };
        Ghosts {
            count,
            shift: 64 - count.max(1).trailing_zeros(),
            slots: OnceLock::new(),
        }
    }

    /// True if the leaf at `start` was peeked since its slot last changed
    /// (the slot is cleared); else the slot names it and false is returned.
    fn seen_again(&self, start: u64) -> bool {
        if self.count == 0 {
            return true;
        }
        let slots = self
            .slots
            .get_or_init(|| (0..self.count).map(|_| AtomicU64::new(0)).collect());
        let hash = (start >> CHUNK_SHIFT).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift;
        let slot = &slots[hash as usize];
        // Starts are chunk-aligned, so start + 1 is never 0 (an empty slot).
        let tag = start + 1;
        if slot.load(Ordering::Relaxed) == tag {
            slot.store(0, Ordering::Relaxed);
            true
        } else {
            slot.store(tag, Ordering::Relaxed);
            false
        }
    }

    /// Heap bytes of its slots, once allocated.
    pub(super) fn heap_bytes(&self) -> u64 {
        self.slots
            .get()
            .map_or(0, |slots| alloc_bytes(slots.len() * size_of::<AtomicU64>()))
    }
}

/// A range being faulted in: its leaves stay in RAM and the dump segments
/// it reads stay on the medium until [`Map::unpin_faults`] takes it back.
#[must_use = "a pin must be given back to Map::unpin_faults"]
pub(crate) struct FaultPin {
    id: u64,
}

/// The pinned ranges, and the dump segments whose release waits for them.
#[derive(Default)]
pub(super) struct Pins {
    ranges: Vec<PinnedRange>,
    next_id: u64,
    /// Dump segments no root names any more, as the pairs of the two
    /// copies, released once no range reading from them is pinned.
    deferred: Vec<[SegmentId; 2]>,
}

struct PinnedRange {
    id: u64,
    first: u64,
    end: u64,
    /// The segments (of copy 0) its faults read from.
    segments: Vec<SegmentId>,
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

    fn pins_segment(&self, segment: SegmentId) -> bool {
        self.ranges
            .iter()
            .any(|range| range.segments.contains(&segment))
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
    /// ones [`Map::load`] would read), in block order.
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

    /// A fault to read the entries of `first..first+count` from
    /// ([`Fault::peek`]) rather than take the leaf into the cache, or None
    /// to fault it in: Some only if the range lies in one paged-out leaf,
    /// the cache is full, and the leaf was not peeked lately ([`Ghosts`]).
    /// Counts nothing; [`Map::count_peek`] counts a peek that served a
    /// lookup.
    pub(crate) fn peek_fault(&self, first: Lba, count: u64) -> Option<Fault> {
        let (start, leaf) = self.leaf_at(first.0)?;
        let cache_full = self.leaf_heap_bytes.saturating_add(PEEK_ROOM_BYTES) > self.cache_bytes;
        if leaf.is_resident()
            || first.0.saturating_add(count) > start + leaf.blocks()
            || !cache_full
            || self.ghosts.seen_again(start)
        {
            return None;
        }
        Some(self.fault_at(start, leaf))
    }

    /// Counts a lookup served by [`Fault::peek`]: a page read back.
    pub(crate) fn count_peek(&self) {
        self.peeks.fetch_add(1, Ordering::Relaxed);
    }

    /// True if every leaf holding a block of `first..first+count` is in RAM.
    /// The shared table's cells that shared entries in `ranges` name and
    /// that are paged out: what must be read in beside the ranges, so that
    /// changing or reading those blocks finds their cells. Only ranges in
    /// RAM are looked at (the others' cells come once they are in).
    pub(crate) fn paged_cells(&self, ranges: &[(Lba, u64)]) -> Vec<(Lba, u64)> {
        if self.paged_leaves == 0 {
            return Vec::new();
        }
        let mut cells = Vec::new();
        for &(first, count) in ranges {
            if first.0 >= TABLE_BASE || !self.is_resident(first, count) {
                continue;
            }
            self.for_each_in(first, count, |_, entry| {
                if let Slot::Shared { content } = entry.slot() {
                    let cell = table_key(content);
                    if !self.is_resident(cell, 1) {
                        cells.push((cell, 1));
                    }
                }
            });
        }
        cells.sort_unstable();
        cells.dedup();
        cells
    }

    pub(crate) fn is_resident(&self, first: Lba, count: u64) -> bool {
        self.paged_leaves == 0 || self.paged_starts(first, count).next().is_none()
    }

    /// [`Map::count_hit`] for a lookup under the shared lock.
    pub(crate) fn count_hit_shared(&self) {
        self.shared_hits.fetch_add(1, Ordering::Relaxed);
    }

    /// Pins `first..first+count`, whose paged-out leaves are `faults`: its
    /// leaves are not evicted, and the dump segments the faults read from
    /// are not released, until the pin is given back.
    pub(crate) fn pin_faults(&mut self, first: Lba, count: u64, faults: &[Fault]) -> FaultPin {
        let mut segments: Vec<SegmentId> = faults.iter().map(Fault::segment).collect();
        segments.sort_unstable();
        segments.dedup();
        let id = self.pins.next_id;
        self.pins.next_id += 1;
        self.pins.ranges.push(PinnedRange {
            id,
            first: first.0,
            end: first.0.saturating_add(count),
            segments,
        });
        FaultPin { id }
    }

    /// Gives a pin back. Returns the dump segments whose release waited
    /// for it (the caller releases them).
    pub(crate) fn unpin_faults(&mut self, pin: FaultPin) -> Vec<SegmentId> {
        let at = self
            .pins
            .ranges
            .iter()
            .position(|range| range.id == pin.id)
            .expect("a pin is given back once");
        self.pins.ranges.swap_remove(at);
        let mut released = Vec::new();
        let Pins {
            ranges, deferred, ..
        } = &mut self.pins;
        deferred.retain(|pair| {
            let pinned = ranges.iter().any(|range| range.segments.contains(&pair[0]));
            if !pinned {
                released.extend(pair);
            }
            pinned
        });
        released
    }

    /// True if the leaf `fault` reads is still paged out and its page is
    /// still where the fault reads it (the same dump, the same place). A
    /// fault that is not current is stale: the leaf was installed
    /// meanwhile, or a checkpoint moved its page, and a failure to read it
    /// is no sign of damage.
    pub(crate) fn fault_is_current(&self, fault: &Fault) -> bool {
        self.still_paged(fault) && self.written.get(&fault.start) == Some(&Some(fault.loc))
    }

    /// True if the leaf `fault` reads is still paged out, as the fault
    /// found it, and a pin covers it: then only its page moved (a
    /// checkpoint wrote it again), and what the fault read from the old
    /// page is still the leaf. A leaf changes only in RAM, and one
    /// installed under a pin stays in RAM until the pin goes, so a leaf
    /// paged out under a pin is one nobody installed since the pin was
    /// taken. Without this, faults under checkpoints in a tight loop
    /// would be read again and again and could give up (issue #23's
    /// `peeks_racing_checkpoints_read_what_was_written`).
    fn only_moved(&self, fault: &Fault) -> bool {
        self.still_paged(fault) && self.pins.spares(fault.start, fault.blocks)
    }

    /// True if the leaf `fault` reads is paged out with the range and
    /// chunk count the fault found.
    fn still_paged(&self, fault: &Fault) -> bool {
        matches!(
            self.leaves.get(&fault.start),
            Some(Leaf::Paged { blocks, chunk_items })
                if *blocks == fault.blocks && *chunk_items == fault.chunk_items
        )
    }

    /// Installs the leaf `fault` read, if the fault is still current
    /// ([`Map::fault_is_current`]) or its page only moved while a pin
    /// covered it ([`Map::only_moved`]); returns false, and drops the
    /// leaf, if it is stale. An installed leaf is clean: it may be evicted
    /// again.
    pub(crate) fn install(&mut self, fault: &Fault, leaf: ReadLeaf) -> bool {
        if !self.fault_is_current(fault) && !self.only_moved(fault) {
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

    /// The dump segment pairs `pairs` (copy 0, copy 1) are no longer
    /// named by any root: keeps those a pinned fault reads for
    /// [`Map::unpin_faults`] to hand back, and returns the segments of the
    /// others (release them now).
    pub(crate) fn defer_dump_release(
        &mut self,
        pairs: impl Iterator<Item = [SegmentId; 2]>,
    ) -> Vec<SegmentId> {
        let mut released = Vec::new();
        for pair in pairs {
            if self.pins.pins_segment(pair[0]) {
                self.pins.deferred.push(pair);
            } else {
                released.extend(pair);
            }
        }
        released
    }

    /// Dump segments whose release waits for a pin: still in use.
    pub(crate) fn deferred_dump_segments(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.pins.deferred.iter().flatten().copied()
    }
}
