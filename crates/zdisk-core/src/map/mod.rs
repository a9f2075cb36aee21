//! The logical-to-physical map.
//!
//! The map is sparse: a B-tree from each leaf's first block to the leaf, a
//! range of whole chunks ([`CHUNK_BLOCKS`] blocks) in one of three forms
//! (`leaf.rs`): a run of one state (a large WRITE_ZEROES costs one leaf
//! whatever its length), a dense chunk of narrow cells, or a sparse list of
//! at most 256 entries. Blocks outside every leaf are holes at version 0.
//! So the map's RAM grows with the entries it stores, never with the
//! logical size, and stays under 24 bytes per stored entry whatever the
//! pattern (under 16 for dense data). Leaves split, merge and change form
//! at thresholds, as a B+-tree's nodes do.
//!
//! The map pages (`page.rs`): a checkpoint writes each leaf that changed
//! since its last page (and each whose page it moves) as a page into its
//! dump ([`Map::snapshot_pages`]), and once that checkpoint is durable
//! ([`Map::commit_pages`]) a leaf unchanged since is *clean*: the
//! cache may evict it ([`Map::evict`]) down to [`Map::set_cache_bytes`],
//! leaving a [`Leaf::Paged`] stub with its range, and [`Map::load`] reads
//! it back before anything touches its blocks (or, without the map
//! borrowed while the page is read, [`Map::faults`] and [`Map::install`]:
//! `fault.rs`). Lookups and changes
//! require the leaves they touch to be in RAM (they panic otherwise): the
//! engine loads a range before it reads or changes it; whole-map walks
//! ([`Map::for_each_data`], [`Map::check_counts_with`]) read evicted pages
//! as they go without keeping them. A changed leaf is *dirty* and stays in
//! RAM until the next checkpoint.
//!
//! Every entry carries the version of the write that produced it. In normal
//! operation the newest write always wins, so versions only matter during
//! recovery, where records are replayed out of order and
//! [`Map::set_if_newer`] keeps the highest version; equal versions denote the
//! same data at a new location (a relocated copy), and the later one wins.
//! Recovery keeps trimmed entries as versioned tombstones so that an older
//! record replayed later cannot resurrect a trimmed block; [`Map::compact`]
//! drops them afterwards. In normal operation a trimmed block keeps its
//! version only inside a dense leaf; elsewhere it reads as version 0, which
//! only makes the cleaner keep a trim record it could have dropped.
//!
//! Invariants (checked by [`Map::check_counts`]): leaves are chunk-aligned
//! and disjoint; a sparse leaf is not empty, stores no hole at version 0 and,
//! in normal operation, no hole at all, holds fewer than `DENSE_FROM`
//! entries per chunk, and spans at most 2^32 blocks; a run is never data, and
//! a hole only during recovery; in normal operation a dense leaf keeps
//! `DENSE_KEEP` blocks that are not holes. `data_blocks`, `zero_blocks`,
//! `damaged_blocks`, `stored_bytes`, the dump's chunk count and the heap
//! bytes always equal a recount.

mod column;
mod entry;
mod fault;
mod leaf;
mod page;
#[cfg(test)]
mod page_golden_tests;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ops::ControlFlow;
use std::sync::Arc;

use crate::error::Result;
use crate::media::Media;
use crate::units::{Lba, SegmentId};
use column::alloc_bytes;

/// How far dirty leaves may take the leaves in RAM past the cache (or the
/// cache's own size, if that is more) before a checkpoint is due: see
/// [`Map::dirty_over_cache`].
const DIRTY_SLACK_BYTES: u64 = 1 << 20;
pub(crate) use entry::{
    kept_apart, key_block, key_space, space_key, table_content, table_key, Chunk, Entry, Location,
    MapCounts, RangeState, Slot, CHUNK_BLOCKS, SPACE_BLOCKS, TABLE_BASE, VERSION_MAX,
};
use entry::{CHUNK_MASK, CHUNK_SHIFT};
pub(crate) use fault::{Fault, FaultPin, ReadLeaf};
use leaf::{
    chunk_positions, grow_sparse, shares_chunk, shrink_sparse, sparse_heap_bytes, sparse_part,
    Leaf, Piece, DENSE_FROM, DENSE_KEEP, MERGED_MAX, SPAN_MAX, SPARSE_MAX, SPARSE_MIN,
};
pub(crate) use page::{read_page_payload, PageLoc, PageStore};

/// The sparse logical-to-physical map.
pub(crate) struct Map {
    /// Leaves by their first block.
    leaves: BTreeMap<u64, Leaf>,
    counts: MapCounts,
    /// The part of `counts` the shared table's cells make (kept by `set`,
    /// the only way a cell changes, once `table_counted`).
    table_counts: MapCounts,
    /// The part of `counts` snapshots' kept entries make (keys from
    /// `SPACE_BLOCKS` below `TABLE_BASE`), kept the same way.
    kept_counts: MapCounts,
    /// `kept_counts` by key space (snapshots' and clones'), kept the same
    /// way: what `zdisk stats` says each clone holds, in O(1).
    space_counts: BTreeMap<u16, MapCounts>,
    /// False while a dump's totals hold cells or kept entries not counted
    /// yet (from `add_paged_counts` until `recount_table`).
    table_counted: bool,
    /// Keep trimmed entries with their versions (during recovery).
    keep_tombstones: bool,
    /// Chunks a checkpoint dump of the map records.
    chunk_items: u64,
    /// Heap bytes of the leaves' cells and keys (of leaves in RAM).
    leaf_heap_bytes: u64,
    /// Leaves unchanged since a checkpoint's snapshot wrote them as pages,
    /// or since they were read back: `Some(page)` once that checkpoint is
    /// durable. Every paged-out leaf is here with its page; a leaf that
    /// changes leaves (it is dirty).
    written: HashMap<u64, Option<PageLoc>>,
    /// What reading pages back needs (shared with the faults that read
    /// outside the lock).
    store: Option<Arc<PageStore>>,
    /// Heap bytes of leaves in RAM beyond which clean ones are evicted.
    cache_bytes: u64,
    /// Clean leaves in RAM, oldest first: the eviction order (entries may
    /// be stale; eviction skips those).
    clean_queue: VecDeque<u64>,
    paged_leaves: u64,
    cache: CacheCounts,
    /// Hits of lookups made under the shared lock (`count_hit_shared`).
    shared_hits: std::sync::atomic::AtomicU64,
    /// Lookups served by reading a page without keeping its leaf
    /// (`count_peek`), and the leaves peeked lately (`peek_fault`).
    peeks: std::sync::atomic::AtomicU64,
    ghosts: fault::Ghosts,
    /// Ranges being faulted in outside the lock, and the dumps they read.
    pins: fault::Pins,
}

/// What the map's page cache did since the volume opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CacheCounts {
    /// Lookups that found every leaf they needed in RAM.
    pub hits: u64,
    /// Leaves read back from their pages and kept.
    pub misses: u64,
    /// Lookups that read a page back without keeping its leaf
    /// (`Map::peek_fault`).
    pub peeks: u64,
    /// Leaves evicted.
    pub evictions: u64,
    /// Pages checkpoints wrote (one per changed or moved leaf per
    /// checkpoint).
    pub pages_written: u64,
    /// Pages of clean leaves checkpoints kept where they were.
    pub pages_kept: u64,
}

/// Where a checkpoint takes a leaf's page from.
pub(crate) enum PageSource {
    /// Encoded from the leaf in RAM.
    Encoded(Vec<u8>),
    /// Copied from the page of an evicted leaf, which moves.
    Stored(PageLoc),
    /// The leaf is clean and its page stays where it is: the new dump's
    /// directory names it, and nothing is written for it.
    Kept(PageLoc),
}

/// One leaf as a checkpoint's snapshot saw it.
pub(crate) struct SnapshotPage {
    pub start: u64,
    pub blocks: u64,
    pub chunk_items: u64,
    pub source: PageSource,
}

impl SnapshotPage {
    /// Bytes of the page's payload.
    pub(crate) fn payload_len(&self) -> usize {
        match &self.source {
            PageSource::Encoded(payload) => payload.len(),
            PageSource::Stored(loc) | PageSource::Kept(loc) => {
                loc.len as usize - crate::record::HEADER_SIZE
            }
        }
    }

    /// True if the checkpoint writes this page (it is not kept in place).
    pub(crate) fn is_written(&self) -> bool {
        !matches!(self.source, PageSource::Kept(_))
    }
}

/// `total` after a part of it went from `before` to `after`.
fn adjusted(total: u64, before: u64, after: u64) -> u64 {
    total + after - before
}

impl Map {
    pub(crate) fn new(keep_tombstones: bool) -> Map {
        Map {
            leaves: BTreeMap::new(),
            counts: MapCounts::default(),
            table_counts: MapCounts::default(),
            kept_counts: MapCounts::default(),
            space_counts: BTreeMap::new(),
            table_counted: true,
            keep_tombstones,
            chunk_items: 0,
            leaf_heap_bytes: 0,
            written: HashMap::new(),
            store: None,
            cache_bytes: u64::MAX,
            clean_queue: VecDeque::new(),
            paged_leaves: 0,
            cache: CacheCounts::default(),
            shared_hits: Default::default(),
            peeks: Default::default(),
            ghosts: fault::Ghosts::for_cache(u64::MAX),
            pins: fault::Pins::default(),
        }
    }

    /// Counts of every entry, the shared table's cells included (what a
    /// dump records).
    pub(crate) fn counts(&self) -> MapCounts {
        self.counts
    }

    /// Counts of the volume's blocks: a shared block counts as data
    /// taking no bytes, its content's cell as the bytes alone.
    /// Snapshots' kept entries (as stored bytes alone) are left out too.
    pub(crate) fn block_counts(&self) -> MapCounts {
        let cells = MapCounts {
            data_blocks: self.table_counts.data_blocks + self.kept_counts.data_blocks,
            damaged_blocks: self.table_counts.damaged_blocks + self.kept_counts.damaged_blocks,
            zero_blocks: self.kept_counts.zero_blocks,
            ..MapCounts::default()
        };
        self.counts.without(cells)
    }

    /// Counts of the entries snapshots keep (their key spaces).
    pub(crate) fn kept_counts(&self) -> MapCounts {
        self.kept_counts
    }

    /// Counts of the entries in key space `space` (1 and up).
    pub(crate) fn space_counts(&self, space: u16) -> MapCounts {
        self.space_counts.get(&space).copied().unwrap_or_default()
    }

    /// Counts the shared table's cells and the snapshots' kept entries
    /// again (after recovery's replay).
    pub(crate) fn recount_table(&mut self, media: &dyn Media) -> Result<()> {
        let mut table = MapCounts::default();
        let mut kept = MapCounts::default();
        let mut spaces: BTreeMap<u16, MapCounts> = BTreeMap::new();
        // From the leaf holding the first kept key: a leaf may span the
        // end of the volume's space if its blocks reach it.
        let from = self
            .leaves
            .range(..SPACE_BLOCKS)
            .next_back()
            .map_or(SPACE_BLOCKS, |(&start, _)| start);
        self.for_each_leaf_from(media, from, |start, leaf| {
            let _ = leaf.visit(start, start, start + leaf.blocks(), &mut |piece| {
                let (key, entry, count) = match piece {
                    Piece::One(key, entry) => (key, entry, 1),
                    Piece::Same(from, to, entry) => (from, entry, to - from),
                    Piece::Gap(..) => return ControlFlow::Continue(()),
                };
                if key >= TABLE_BASE {
                    table.add(entry.slot(), count);
                } else if key >= SPACE_BLOCKS {
                    kept.add(entry.slot(), count);
                    let space = (key >> entry::SPACE_SHIFT) as u16;
                    spaces.entry(space).or_default().add(entry.slot(), count);
                }
                ControlFlow::Continue(())
            });
            Ok(())
        })?;
        self.table_counts = table;
        self.kept_counts = kept;
        self.space_counts = spaces;
        self.table_counted = true;
        Ok(())
    }

    /// Heap bytes used: the cells and keys of the leaves in RAM with the
    /// allocator's overhead, and estimates of the B-tree's nodes (evicted
    /// leaves included) and of the page bookkeeping.
    pub(crate) fn memory_bytes(&self) -> u64 {
        let written_bytes = if self.written.capacity() == 0 {
            0
        } else {
            // hashbrown: a control byte per bucket, buckets a power of two
            // at least 8/7 of the capacity.
            let buckets = (self.written.capacity() * 8 / 7).next_power_of_two() as u64;
            alloc_bytes((buckets * (1 + size_of::<(u64, Option<PageLoc>)>() as u64)) as usize)
        };
        let queue_bytes = match self.clean_queue.capacity() {
            0 => 0,
            capacity => alloc_bytes(capacity * size_of::<u64>()),
        };
        self.leaf_heap_bytes
            + btree_bytes(self.leaves.len())
            + written_bytes
            + queue_bytes
            + self.ghosts.heap_bytes()
    }

    /// Heap bytes of the cells and keys of the leaves in RAM: what the
    /// cache bound applies to.
    pub(crate) fn resident_bytes(&self) -> u64 {
        self.leaf_heap_bytes
    }

    pub(crate) fn cache_counts(&self) -> CacheCounts {
        CacheCounts {
            hits: self.cache.hits + self.shared_hits.load(std::sync::atomic::Ordering::Relaxed),
            peeks: self.peeks.load(std::sync::atomic::Ordering::Relaxed),
            ..self.cache
        }
    }

    /// Leaves (a checkpoint writes a page for each: `Space` sizes the
    /// next dump by them), and how many of them are paged out.
    pub(crate) fn leaf_counts(&self) -> (u64, u64) {
        (self.leaves.len() as u64, self.paged_leaves)
    }

    /// Bounds the heap bytes of leaves in RAM (dirty leaves stay whatever
    /// the bound until a checkpoint writes them).
    pub(crate) fn set_cache_bytes(&mut self, bytes: u64) {
        self.cache_bytes = bytes;
        self.ghosts = fault::Ghosts::for_cache(bytes);
    }

    pub(crate) fn cache_bytes(&self) -> u64 {
        self.cache_bytes
    }

    pub(crate) fn store(&self) -> Option<&PageStore> {
        self.store.as_deref()
    }

    /// Chunks that hold an entry (what a format 2 dump recorded; a page's
    /// directory entry keeps its leaf's count).
    #[cfg(test)]
    pub(crate) fn chunk_count(&self) -> usize {
        self.chunk_items as usize
    }

    /// The leaf holding block `lba`, with its first block. A leaf starting
    /// at the block's chunk (every dense leaf) is found with one exact
    /// search; any other needs a search for the leaf before it.
    #[inline]
    fn leaf_at(&self, lba: u64) -> Option<(u64, &Leaf)> {
        let chunk = lba & !CHUNK_MASK;
        if let Some(leaf) = self.leaves.get(&chunk) {
            return Some((chunk, leaf));
        }
        let (&start, leaf) = self.leaves.range(..chunk).next_back()?;
        (lba - start < leaf.blocks()).then_some((start, leaf))
    }

    /// The entry for `lba` (a hole at version 0 if never written).
    #[inline]
    pub(crate) fn get(&self, lba: Lba) -> Entry {
        match self.leaf_at(lba.0) {
            None => Entry::default(),
            Some((start, leaf)) => leaf.get(lba.0 - start),
        }
    }

    /// Sets one block unconditionally; returns the previous entry.
    pub(crate) fn set(&mut self, lba: Lba, slot: Slot, version: u64) -> Entry {
        let new = Entry::new(slot, version);
        let old = self.put(lba.0, new);
        self.counts.sub(old.slot(), 1);
        self.counts.add(slot, 1);
        if lba.0 >= SPACE_BLOCKS && self.table_counted {
            if lba.0 >= TABLE_BASE {
                self.table_counts.sub(old.slot(), 1);
                self.table_counts.add(slot, 1);
            } else {
                self.kept_counts.sub(old.slot(), 1);
                self.kept_counts.add(slot, 1);
                let space = (lba.0 >> entry::SPACE_SHIFT) as u16;
                let counts = self.space_counts.entry(space).or_default();
                counts.sub(old.slot(), 1);
                counts.add(slot, 1);
            }
        }
        debug_assert_eq!(self.get(lba).slot(), slot);
        old
    }

    /// Sets one block if `version` is at least the current version; returns
    /// the previous entry if it was replaced.
    pub(crate) fn set_if_newer(&mut self, lba: Lba, slot: Slot, version: u64) -> Option<Entry> {
        if self.get(lba).version() > version {
            return None;
        }
        Some(self.set(lba, slot, version))
    }

    /// True if a sparse leaf keeps `entry`: a hole at version 0 is what an
    /// absent entry means, and outside recovery no hole is kept.
    fn stores(&self, entry: Entry) -> bool {
        stores(entry, self.keep_tombstones)
    }

    // --- Leaves in and out of the tree, with the totals that follow them.

    fn insert_leaf(&mut self, start: u64, leaf: Leaf) {
        debug_assert!(
            start & CHUNK_MASK == 0,
            "leaf at {start} is not chunk-aligned"
        );
        debug_assert!(self.leaf_at(start).is_none(), "leaf at {start} overlaps");
        debug_assert!(
            self.leaves
                .range(start..)
                .next()
                .is_none_or(|(&next, _)| next >= start + leaf.blocks()),
            "leaf at {start} overlaps the next"
        );
        debug_assert!(leaf.is_resident(), "inserting a paged-out leaf");
        self.chunk_items += leaf.chunk_items();
        self.leaf_heap_bytes += leaf.heap_bytes();
        self.written.remove(&start);
        self.leaves.insert(start, leaf);
    }

    fn remove_leaf(&mut self, start: u64) -> Leaf {
        let leaf = self.leaves.remove(&start).expect("a leaf starts there");
        assert!(
            leaf.is_resident(),
            "map leaf at {start} changed while paged out"
        );
        self.written.remove(&start);
        self.chunk_items -= leaf.chunk_items();
        self.leaf_heap_bytes -= leaf.heap_bytes();
        leaf
    }

    /// Stores `new` for block `lba` and returns what it replaces; counts
    /// are the caller's.
    fn put(&mut self, lba: u64, new: Entry) -> Entry {
        let stores = self.stores(new);
        let keep_tombstones = self.keep_tombstones;
        let chunk = lba & !CHUNK_MASK;
        let found = match self.leaves.get_mut(&chunk) {
            Some(leaf) => Some((chunk, leaf)),
            None => self
                .leaves
                .range_mut(..chunk)
                .next_back()
                .filter(|(start, leaf)| lba - **start < leaf.blocks())
                .map(|(&start, leaf)| (start, leaf)),
        };
        let Some((start, leaf)) = found else {
            if stores {
                self.put_in_gap(lba, new);
            }
            return Entry::default();
        };
        let offset = lba - start;
        if !matches!(leaf, Leaf::Run { .. }) {
            self.written.remove(&start);
        }
        match leaf {
            Leaf::Paged { .. } => panic!("changing block {lba} of a map leaf that is paged out"),
            Leaf::Run { entry, .. } => {
                let old = *entry;
                if old == new {
                    return old;
                }
                self.densify_run(start, lba);
                self.put(lba, new)
            }
            Leaf::Dense { stored, column } => {
                let before = column.heap_bytes();
                let old = column.get(offset as usize);
                column.set(offset as usize, new);
                *stored = *stored + u32::from(!new.is_hole()) - u32::from(!old.is_hole());
                let demote = !keep_tombstones && *stored < DENSE_KEEP;
                self.leaf_heap_bytes = adjusted(self.leaf_heap_bytes, before, column.heap_bytes());
                if demote {
                    self.demote(start);
                    self.tidy(start);
                }
                old
            }
            Leaf::Sparse { keys, column, .. } => {
                let key = offset as u32;
                let before = sparse_heap_bytes(keys, column);
                // Blocks written in order land after the last key.
                let position = match keys.last() {
                    Some(&last) if last < key => Err(keys.len()),
                    _ => keys.binary_search(&key),
                };
                match position {
                    Ok(index) => {
                        let old = column.get(index);
                        if stores {
                            column.set(index, new);
                        } else {
                            let alone = !shares_chunk(keys, index);
                            keys.remove(index);
                            column.remove(index);
                            shrink_sparse(keys, column);
                            self.chunk_items -= u64::from(alone);
                        }
                        let small = !stores && keys.len() < SPARSE_MIN;
                        self.leaf_heap_bytes = adjusted(
                            self.leaf_heap_bytes,
                            before,
                            sparse_heap_bytes(keys, column),
                        );
                        if small {
                            self.tidy(start);
                        }
                        old
                    }
                    Err(_) if !stores => Entry::default(),
                    Err(_) if keys.len() >= SPARSE_MAX => {
                        self.split_sparse(start);
                        self.put(lba, new)
                    }
                    Err(index) => {
                        grow_sparse(keys, column);
                        keys.insert(index, key);
                        column.insert(index, new);
                        self.chunk_items += u64::from(!shares_chunk(keys, index));
                        let dense = keys.len() >= DENSE_FROM && {
                            let (low, high) = chunk_positions(keys, key);
                            high - low >= DENSE_FROM
                        };
                        self.leaf_heap_bytes = adjusted(
                            self.leaf_heap_bytes,
                            before,
                            sparse_heap_bytes(keys, column),
                        );
                        if dense {
                            self.densify_chunk(start, key as u64 & !CHUNK_MASK);
                        }
                        Entry::default()
                    }
                }
            }
        }
    }

    /// Stores `new` for block `lba`, which no leaf covers: the sparse leaf
    /// before it or after it stretches to its chunk if it has room, else
    /// the chunk gets a sparse leaf of its own.
    fn put_in_gap(&mut self, lba: u64, new: Entry) {
        let chunk = lba & !CHUNK_MASK;
        let chunk_end = chunk + CHUNK_BLOCKS;
        let before = match self.leaves.range(..lba).next_back() {
            Some((&start, Leaf::Sparse { keys, .. }))
                if keys.len() < SPARSE_MAX && chunk_end - start <= SPAN_MAX =>
            {
                Some(start)
            }
            _ => None,
        };
        let after = match self.leaves.range(lba..).next() {
            Some((&start, Leaf::Sparse { keys, blocks, .. }))
                if keys.len() < SPARSE_MAX && start + blocks - chunk <= SPAN_MAX =>
            {
                Some(start)
            }
            _ => None,
        };
        if let Some(start) = before {
            // Nothing lies between that leaf's end and `chunk_end`.
            if let Some(Leaf::Sparse { blocks, .. }) = self.leaves.get_mut(&start) {
                *blocks = chunk_end - start;
            }
            self.written.remove(&start);
        } else if let Some(start) = after {
            let Leaf::Sparse {
                blocks,
                mut keys,
                column,
            } = self.remove_leaf(start)
            else {
                unreachable!("matched a sparse leaf")
            };
            let shift = (start - chunk) as u32;
            keys.iter_mut().for_each(|key| *key += shift);
            let leaf = Leaf::Sparse {
                blocks: blocks + shift as u64,
                keys,
                column,
            };
            self.insert_leaf(chunk, leaf);
        } else {
            self.insert_leaf(chunk, Leaf::empty_sparse());
        }
        let old = self.put(lba, new);
        debug_assert_eq!(old, Entry::default());
    }

    /// Splits a full sparse leaf in two at a chunk boundary near its middle.
    fn split_sparse(&mut self, start: u64) {
        let Leaf::Sparse {
            blocks,
            keys,
            column,
        } = self.remove_leaf(start)
        else {
            unreachable!("splitting a leaf that is not sparse")
        };
        let middle = keys[keys.len() / 2] as u64 & !CHUNK_MASK;
        let mut cut = middle;
        let mut index = keys.partition_point(|&key| (key as u64) < cut);
        if index == 0 {
            cut = middle + CHUNK_BLOCKS;
            index = keys.partition_point(|&key| (key as u64) < cut);
        }
        assert!(
            0 < index && index < keys.len(),
            "a full sparse leaf spans two chunks at least"
        );
        self.insert_leaf(start, sparse_part(&keys, &column, 0..index, 0, cut));
        let right = sparse_part(&keys, &column, index..keys.len(), cut, blocks - cut);
        self.insert_leaf(start + cut, right);
    }

    /// Makes the chunk at `chunk` (an offset into the sparse leaf at
    /// `start`) a dense leaf, leaving the rest of that leaf sparse.
    fn densify_chunk(&mut self, start: u64, chunk: u64) {
        let Leaf::Sparse {
            blocks,
            keys,
            column,
        } = self.remove_leaf(start)
        else {
            unreachable!("densifying a leaf that is not sparse")
        };
        let (low, high) = chunk_positions(&keys, chunk as u32);
        if low > 0 {
            self.insert_leaf(start, sparse_part(&keys, &column, 0..low, 0, chunk));
        }
        let mut entries = [Entry::default(); CHUNK_BLOCKS as usize];
        for index in low..high {
            entries[(keys[index] as u64 - chunk) as usize] = column.get(index);
        }
        self.insert_leaf(start + chunk, Leaf::dense(&entries));
        let after = chunk + CHUNK_BLOCKS;
        if high < keys.len() {
            let right = sparse_part(&keys, &column, high..keys.len(), after, blocks - after);
            self.insert_leaf(start + after, right);
        }
    }

    /// Makes the chunk of `lba` in the run at `start` a dense leaf.
    fn densify_run(&mut self, start: u64, lba: u64) {
        let Leaf::Run { blocks, entry } = self.remove_leaf(start) else {
            unreachable!("densifying a leaf that is not a run")
        };
        let chunk = lba & !CHUNK_MASK;
        let (end, chunk_end) = (start + blocks, chunk + CHUNK_BLOCKS);
        if chunk > start {
            let blocks = chunk - start;
            self.insert_leaf(start, Leaf::Run { blocks, entry });
        }
        self.insert_leaf(chunk, Leaf::dense(&[entry; CHUNK_BLOCKS as usize]));
        if chunk_end < end {
            let blocks = end - chunk_end;
            self.insert_leaf(chunk_end, Leaf::Run { blocks, entry });
        }
    }

    /// Makes the dense leaf at `start` sparse (it holds too few blocks);
    /// the caller tidies.
    fn demote(&mut self, start: u64) {
        let Leaf::Dense { column, .. } = self.remove_leaf(start) else {
            unreachable!("demoting a leaf that is not dense")
        };
        let (keys, entries): (Vec<u32>, Vec<Entry>) = column
            .entries()
            .enumerate()
            .filter(|(_, entry)| self.stores(*entry))
            .map(|(offset, entry)| (offset as u32, entry))
            .unzip();
        if !keys.is_empty() {
            self.insert_leaf(start, Leaf::sparse(CHUNK_BLOCKS, keys, &entries));
        }
    }

    /// Drops the sparse leaf at `start` if it is empty, or merges it with
    /// a neighbour if it holds few entries.
    fn tidy(&mut self, start: u64) {
        let (len, end) = match self.leaves.get(&start) {
            Some(Leaf::Sparse { keys, blocks, .. }) => (keys.len(), start + blocks),
            _ => return,
        };
        if len == 0 {
            self.remove_leaf(start);
            return;
        }
        if len >= SPARSE_MIN {
            return;
        }
        if let Some((&before, Leaf::Sparse { keys, .. })) = self.leaves.range(..start).next_back() {
            if keys.len() + len <= MERGED_MAX && end - before <= SPAN_MAX {
                self.merge(before, start);
                return;
            }
        }
        if let Some((&after, Leaf::Sparse { keys, blocks, .. })) = self.leaves.range(end..).next() {
            if keys.len() + len <= MERGED_MAX && after + blocks - start <= SPAN_MAX {
                self.merge(start, after);
            }
        }
    }

    /// Merges two neighbouring sparse leaves (and the gap between them).
    fn merge(&mut self, left: u64, right: u64) {
        let (
            Leaf::Sparse {
                keys: left_keys,
                column: left_column,
                ..
            },
            Leaf::Sparse {
                blocks: right_blocks,
                keys: right_keys,
                column: right_column,
            },
        ) = (self.remove_leaf(left), self.remove_leaf(right))
        else {
            unreachable!("merging leaves that are not sparse")
        };
        let shift = right - left;
        let keys: Vec<u32> = left_keys
            .iter()
            .copied()
            .chain(right_keys.iter().map(|&key| (key as u64 + shift) as u32))
            .collect();
        let entries: Vec<Entry> = left_column
            .entries()
            .chain(right_column.entries())
            .collect();
        self.insert_leaf(left, Leaf::sparse(shift + right_blocks, keys, &entries));
    }

    /// Splits the leaf holding block `at` (chunk-aligned), if it holds
    /// blocks on both sides of it.
    fn carve(&mut self, at: u64) {
        debug_assert!(at & CHUNK_MASK == 0);
        let Some((start, _)) = self.leaf_at(at) else {
            return;
        };
        if start == at {
            return;
        }
        let cut = at - start;
        match self.remove_leaf(start) {
            Leaf::Run { blocks, entry } => {
                self.insert_leaf(start, Leaf::Run { blocks: cut, entry });
                let blocks = blocks - cut;
                self.insert_leaf(at, Leaf::Run { blocks, entry });
            }
            Leaf::Dense { .. } => unreachable!("a dense leaf is one chunk"),
            Leaf::Paged { .. } => unreachable!("remove_leaf returns leaves in RAM"),
            Leaf::Sparse {
                blocks,
                keys,
                column,
            } => {
                let index = keys.partition_point(|&key| (key as u64) < cut);
                if index > 0 {
                    self.insert_leaf(start, sparse_part(&keys, &column, 0..index, 0, cut));
                }
                if index < keys.len() {
                    let right = sparse_part(&keys, &column, index..keys.len(), cut, blocks - cut);
                    self.insert_leaf(at, right);
                }
            }
        }
    }

    /// Inserts a run, joined with equal runs it touches.
    fn insert_run(&mut self, start: u64, blocks: u64, entry: Entry) {
        debug_assert!(!entry.is_data());
        let (mut start, mut blocks) = (start, blocks);
        let before = match self.leaves.range(..start).next_back() {
            Some((
                &before,
                Leaf::Run {
                    blocks: b,
                    entry: e,
                },
            )) if before + b == start && *e == entry => Some(before),
            _ => None,
        };
        if let Some(before) = before {
            blocks += start - before;
            start = before;
            self.remove_leaf(before);
        }
        let end = start + blocks;
        if let Some(Leaf::Run {
            blocks: b,
            entry: e,
        }) = self.leaves.get(&end)
        {
            if *e == entry {
                blocks += *b;
                self.remove_leaf(end);
            }
        }
        self.insert_leaf(start, Leaf::Run { blocks, entry });
    }

    /// Sets whole chunks `from..to` to `entry`: their leaves go, a run
    /// comes (none for a trim outside recovery).
    fn replace(&mut self, from: u64, to: u64, entry: Entry, displaced: &mut dyn FnMut(Slot)) {
        debug_assert!(from & CHUNK_MASK == 0 && to & CHUNK_MASK == 0 && from < to);
        self.carve(from);
        self.carve(to);
        let starts: Vec<u64> = self
            .leaves
            .range(from..to)
            .map(|(&start, _)| start)
            .collect();
        for start in starts {
            let leaf = self.remove_leaf(start);
            let counts = &mut self.counts;
            let _ = leaf.visit(start, start, start + leaf.blocks(), &mut |piece| {
                match piece {
                    Piece::Gap(..) => {}
                    Piece::Same(first, end, entry) => counts.sub(entry.slot(), end - first),
                    Piece::One(_, entry) => {
                        counts.sub(entry.slot(), 1);
                        if entry.is_data() {
                            displaced(entry.slot());
                        }
                    }
                }
                ControlFlow::Continue(())
            });
        }
        if self.stores(entry) {
            self.counts.add(entry.slot(), to - from);
            self.insert_run(from, to - from, entry);
        }
        // Carving may have left small sparse leaves on either side.
        if let Some((&before, _)) = self.leaves.range(..from).next_back() {
            self.tidy(before);
        }
        if let Some((&after, _)) = self.leaves.range(to..).next() {
            self.tidy(after);
        }
    }

    /// Sets blocks `from..to` one by one (at most a chunk's worth).
    fn set_blocks(
        &mut self,
        from: u64,
        to: u64,
        entry: Entry,
        only_newer: bool,
        displaced: &mut dyn FnMut(Slot),
    ) {
        let untouched =
            self.leaf_at(from).is_none() && self.leaves.range(from..to).next().is_none();
        if untouched && !self.stores(entry) {
            return; // trimming blocks that were never written
        }
        for lba in from..to {
            if only_newer && self.get(Lba(lba)).version() > entry.version() {
                continue;
            }
            let old = self.put(lba, entry);
            self.counts.sub(old.slot(), 1);
            self.counts.add(entry.slot(), 1);
            if old.is_data() {
                displaced(old.slot());
            }
        }
    }

    /// Sets whole chunks `from..to`; with `only_newer`, chunks holding a
    /// newer entry are set block by block and newer runs are kept.
    fn set_chunks(
        &mut self,
        from: u64,
        to: u64,
        entry: Entry,
        only_newer: bool,
        displaced: &mut dyn FnMut(Slot),
    ) {
        // The ranges not replaced whole: (first, end, block by block).
        let mut spared: Vec<(u64, u64, bool)> = Vec::new();
        if only_newer {
            let version = entry.version();
            let first = self.leaf_at(from).map_or(from, |(start, _)| start);
            for (&start, leaf) in self.leaves.range(first..to) {
                let (low, high) = (start.max(from), (start + leaf.blocks()).min(to));
                match leaf {
                    Leaf::Run { entry, .. } if entry.version() > version => {
                        spared.push((low, high, false))
                    }
                    Leaf::Run { .. } => {}
                    Leaf::Dense { column, .. } => {
                        if column.entries().any(|entry| entry.version() > version) {
                            spared.push((low, high, true));
                        }
                    }
                    Leaf::Paged { .. } => panic!("map leaf at {start} is paged out"),
                    Leaf::Sparse { keys, column, .. } => {
                        let first = keys.partition_point(|&key| start + (key as u64) < low);
                        for (index, &key) in keys.iter().enumerate().skip(first) {
                            let lba = start + key as u64;
                            if lba >= high {
                                break;
                            }
                            let chunk = lba & !CHUNK_MASK;
                            let newer = column.get(index).version() > version;
                            if newer && spared.last() != Some(&(chunk, chunk + CHUNK_BLOCKS, true))
                            {
                                spared.push((chunk, chunk + CHUNK_BLOCKS, true));
                            }
                        }
                    }
                }
            }
        }
        let mut cursor = from;
        for (first, end, block_by_block) in spared {
            if cursor < first {
                self.replace(cursor, first, entry, displaced);
            }
            if block_by_block {
                self.set_blocks(first, end, entry, true, displaced);
            }
            cursor = end;
        }
        if cursor < to {
            self.replace(cursor, to, entry, displaced);
        }
    }

    /// Sets `count` blocks from `first` to `state`, calling `displaced` with
    /// every data or shared entry's slot it replaces (a record share that
    /// dies, or a reference to shared content that goes). With `only_newer`,
    /// blocks holding a higher version are left alone (recovery).
    pub(crate) fn set_range(
        &mut self,
        first: Lba,
        count: u64,
        state: RangeState,
        version: u64,
        only_newer: bool,
        displaced: &mut dyn FnMut(Slot),
    ) {
        // A range in a clone's key space counts among the kept entries
        // (`kept_counts`), as its single entries do.
        let kept = (SPACE_BLOCKS..TABLE_BASE).contains(&first.0) && self.table_counted;
        let before = self.counts;
        self.set_range_counted(first, count, state, version, only_newer, displaced);
        if kept {
            // What the range changed in the totals, it changed in these.
            let (after, space) = (self.counts, (first.0 >> entry::SPACE_SHIFT) as u16);
            let moved = |counts: &mut MapCounts| {
                counts.merge(after);
                *counts = counts.without(before);
            };
            moved(&mut self.kept_counts);
            moved(self.space_counts.entry(space).or_default());
        }
    }

    fn set_range_counted(
        &mut self,
        first: Lba,
        count: u64,
        state: RangeState,
        version: u64,
        only_newer: bool,
        displaced: &mut dyn FnMut(Slot),
    ) {
        let end = first.0.checked_add(count).expect("range overflows");
        let entry = Entry::new(state.slot(), version);
        let whole_from = first
            .0
            .checked_next_multiple_of(CHUNK_BLOCKS)
            .unwrap_or(end);
        let whole_to = end & !CHUNK_MASK;
        if whole_from >= whole_to {
            self.set_blocks(first.0, end, entry, only_newer, displaced);
            return;
        }
        self.set_blocks(first.0, whole_from, entry, only_newer, displaced);
        self.set_chunks(whole_from, whole_to, entry, only_newer, displaced);
        self.set_blocks(whole_to, end, entry, only_newer, displaced);
    }

    /// Calls `f` with the pieces of blocks `from..to`, in order, until it breaks.
    fn visit(&self, from: u64, to: u64, mut f: impl FnMut(Piece) -> ControlFlow<()>) {
        if from >= to {
            return;
        }
        let mut cursor = from;
        if let Some((start, leaf)) = self.leaf_at(from) {
            let end = (start + leaf.blocks()).min(to);
            if leaf.visit(start, from, end, &mut f).is_break() {
                return;
            }
            cursor = end;
        }
        if cursor >= to {
            return;
        }
        for (&start, leaf) in self.leaves.range(cursor..to) {
            if start > cursor && f(Piece::Gap(cursor, start)).is_break() {
                return;
            }
            let end = (start + leaf.blocks()).min(to);
            if leaf.visit(start, start, end, &mut f).is_break() {
                return;
            }
            cursor = end;
        }
        if cursor < to {
            let _ = f(Piece::Gap(cursor, to));
        }
    }

    /// Calls `f` with each block's entry in `first..first+count`, in order.
    pub(crate) fn for_each_in(&self, first: Lba, count: u64, mut f: impl FnMut(Lba, Entry)) {
        let end = first.0 + count;
        self.visit(first.0, end, |piece| {
            match piece {
                Piece::Gap(from, to) => (from..to).for_each(|b| f(Lba(b), Entry::default())),
                Piece::Same(from, to, entry) => (from..to).for_each(|b| f(Lba(b), entry)),
                Piece::One(lba, entry) => f(Lba(lba), entry),
            }
            ControlFlow::Continue(())
        });
    }

    /// Visits `first..first + count` as runs: `f(first block, blocks,
    /// entry)`, a gap as one run of holes, a run leaf as one run, a single
    /// block as a run of one; stops when `f` breaks.
    pub(crate) fn for_each_run(
        &self,
        first: Lba,
        count: u64,
        mut f: impl FnMut(Lba, u64, Entry) -> ControlFlow<()>,
    ) {
        self.visit(
            first.0,
            first.0.saturating_add(count),
            |piece| match piece {
                Piece::Gap(from, to) => f(Lba(from), to - from, Entry::default()),
                Piece::Same(from, to, entry) => f(Lba(from), to - from, entry),
                Piece::One(lba, entry) => f(Lba(lba), 1, entry),
            },
        );
    }

    /// Runs of equal state starting at `first`, for block status: returns
    /// (state, blocks) pairs covering at most `count` blocks and `max_runs` runs.
    /// Large unwritten areas are skipped without visiting each block.
    pub(crate) fn runs(&self, first: Lba, count: u64, max_runs: usize) -> Vec<(Slot, u64)> {
        let end = first.0.saturating_add(count);
        let mut runs: Vec<(Slot, u64)> = Vec::new();
        let mut push = |slot: Slot, blocks: u64| {
            let kind = match slot {
                Slot::Data(_) => Slot::Data(Location::record(crate::units::SegmentId(0), 0, 16)),
                other => other,
            };
            match runs.last_mut() {
                Some((last, n)) if *last == kind => *n += blocks,
                _ => runs.push((kind, blocks)),
            }
            match runs.len() > max_runs {
                true => ControlFlow::Break(()),
                false => ControlFlow::Continue(()),
            }
        };
        self.visit(first.0, end, |piece| match piece {
            Piece::Gap(from, to) => push(Slot::Hole, to - from),
            Piece::Same(from, to, entry) => push(entry.slot(), to - from),
            Piece::One(_, entry) => push(entry.slot(), 1),
        });
        runs.truncate(max_runs.max(1));
        runs
    }

    /// True if some block in the range holds exactly `version` (the record
    /// with that version still determines it).
    pub(crate) fn any_at_version(&self, first: Lba, count: u64, version: u64) -> bool {
        self.any_in(first, count, |entry_version| entry_version == version)
    }

    /// True if every block in the range holds a version newer than `version`
    /// (a record with that version no longer determines any of them).
    pub(crate) fn all_newer_than(&self, first: Lba, count: u64, version: u64) -> bool {
        !self.any_in(first, count, |entry_version| entry_version <= version)
    }

    fn any_in(&self, first: Lba, count: u64, test: impl Fn(u64) -> bool) -> bool {
        let mut hit = false;
        self.visit(first.0, first.0.saturating_add(count), |piece| {
            let version = match piece {
                Piece::Gap(..) => 0,
                Piece::Same(_, _, entry) | Piece::One(_, entry) => entry.version(),
            };
            hit = test(version);
            match hit {
                true => ControlFlow::Break(()),
                false => ControlFlow::Continue(()),
            }
        });
        hit
    }

    /// Every chunk that holds an entry, in block order, as a format 2
    /// checkpoint dump records it (the chunk's index and its entries): the
    /// tests' way to write an old dump.
    #[cfg(test)]
    pub(crate) fn for_each_chunk(&self, mut f: impl FnMut(u64, &Chunk)) {
        let mut mixed = Chunk::Mixed(Box::new([Entry::default(); CHUNK_BLOCKS as usize]));
        let mut emitted = 0u64;
        for (&start, leaf) in &self.leaves {
            let index = start >> CHUNK_SHIFT;
            match leaf {
                Leaf::Run { blocks, entry } => {
                    let state = entry.range_state().expect("a run is never data");
                    let uniform = Chunk::Uniform {
                        state,
                        version: entry.version(),
                    };
                    for chunk in 0..blocks >> CHUNK_SHIFT {
                        f(index + chunk, &uniform);
                    }
                    emitted += blocks >> CHUNK_SHIFT;
                }
                Leaf::Dense { column, .. } => {
                    if let Chunk::Mixed(entries) = &mut mixed {
                        for (cell, entry) in entries.iter_mut().zip(column.entries()) {
                            *cell = entry;
                        }
                    }
                    f(index, &mixed);
                    if let Chunk::Mixed(entries) = &mut mixed {
                        entries.fill(Entry::default());
                    }
                    emitted += 1;
                }
                Leaf::Sparse { keys, column, .. } => {
                    let mut first = 0;
                    while first < keys.len() {
                        let (_, end) = chunk_positions(keys, keys[first]);
                        let chunk = keys[first] as u64 >> CHUNK_SHIFT;
                        if let Chunk::Mixed(entries) = &mut mixed {
                            for position in first..end {
                                entries[(keys[position] as u64 & CHUNK_MASK) as usize] =
                                    column.get(position);
                            }
                        }
                        f(index + chunk, &mixed);
                        if let Chunk::Mixed(entries) = &mut mixed {
                            for &key in &keys[first..end] {
                                entries[(key as u64 & CHUNK_MASK) as usize] = Entry::default();
                            }
                        }
                        emitted += 1;
                        first = end;
                    }
                }
                Leaf::Paged { .. } => panic!("dumping a map leaf that is paged out"),
            }
        }
        debug_assert_eq!(emitted, self.chunk_items);
    }

    /// True if some leaf stores an entry in the chunk at `start`.
    fn chunk_present(&self, start: u64) -> bool {
        match self.leaf_at(start) {
            None => false,
            Some((_, Leaf::Run { .. } | Leaf::Dense { .. } | Leaf::Paged { .. })) => true,
            Some((leaf_start, Leaf::Sparse { keys, .. })) => {
                let offset = start - leaf_start;
                let index = keys.partition_point(|&key| (key as u64) < offset);
                keys.get(index)
                    .is_some_and(|&key| (key as u64) < offset + CHUNK_BLOCKS)
            }
        }
    }

    /// Installs a chunk read from a checkpoint; a chunk listed twice is an error.
    pub(crate) fn insert_chunk(
        &mut self,
        index: u64,
        chunk: Chunk,
    ) -> std::result::Result<(), String> {
        let start = index
            .checked_mul(CHUNK_BLOCKS)
            .filter(|start| start.checked_add(CHUNK_BLOCKS).is_some())
            .ok_or_else(|| format!("map chunk {index} lies beyond any volume"))?;
        if self.chunk_present(start) {
            return Err(format!("map chunk {index} appears twice"));
        }
        match chunk {
            Chunk::Uniform { state, version } => {
                let entry = Entry::new(state.slot(), version);
                if self.stores(entry) {
                    self.counts.add(entry.slot(), CHUNK_BLOCKS);
                    self.carve(start);
                    self.carve(start + CHUNK_BLOCKS);
                    self.insert_run(start, CHUNK_BLOCKS, entry);
                }
            }
            Chunk::Mixed(entries) => {
                let stored = entries.iter().filter(|e| self.stores(**e)).count();
                if stored >= DENSE_FROM {
                    self.carve(start);
                    self.carve(start + CHUNK_BLOCKS);
                    entries.iter().for_each(|e| self.counts.add(e.slot(), 1));
                    self.insert_leaf(start, Leaf::dense(&entries));
                } else {
                    for (offset, &entry) in entries.iter().enumerate() {
                        if self.stores(entry) {
                            let old = self.put(start + offset as u64, entry);
                            debug_assert_eq!(old, Entry::default());
                            self.counts.add(entry.slot(), 1);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Every data block and its location, in block order; evicted leaves
    /// are read from their pages (and not kept).
    pub(crate) fn for_each_data(
        &self,
        media: &dyn Media,
        mut f: impl FnMut(Lba, Location, u64),
    ) -> Result<()> {
        self.for_each_stored(media, |lba, entry| {
            if let Slot::Data(loc) = entry.slot() {
                f(Lba(lba), loc, entry.version());
            }
        })
    }

    /// Every damaged block, in order.
    pub(crate) fn for_each_damaged(&self, media: &dyn Media, mut f: impl FnMut(Lba)) -> Result<()> {
        self.for_each_leaf(media, |start, leaf| {
            let _ = leaf.visit(start, start, start + leaf.blocks(), &mut |piece| {
                match piece {
                    Piece::Same(from, to, entry) if entry.slot() == Slot::Damaged => {
                        (from..to).for_each(|lba| f(Lba(lba)))
                    }
                    Piece::One(lba, entry) if entry.slot() == Slot::Damaged => f(Lba(lba)),
                    _ => {}
                }
                ControlFlow::Continue(())
            });
            Ok(())
        })
    }

    /// Every entry held in a dense or sparse leaf, in block order.
    pub(crate) fn for_each_stored(
        &self,
        media: &dyn Media,
        mut f: impl FnMut(u64, Entry),
    ) -> Result<()> {
        self.for_each_leaf(media, |start, leaf| {
            match leaf {
                Leaf::Run { .. } | Leaf::Paged { .. } => {}
                Leaf::Dense { column, .. } => column
                    .entries()
                    .enumerate()
                    .for_each(|(offset, entry)| f(start + offset as u64, entry)),
                Leaf::Sparse { keys, column, .. } => keys
                    .iter()
                    .enumerate()
                    .for_each(|(index, &key)| f(start + key as u64, column.get(index))),
            }
            Ok(())
        })
    }

    /// Every leaf in block order, an evicted one read from its page and
    /// checked (and dropped after `f`).
    fn for_each_leaf(
        &self,
        media: &dyn Media,
        f: impl FnMut(u64, &Leaf) -> Result<()>,
    ) -> Result<()> {
        self.for_each_leaf_from(media, 0, f)
    }

    /// Calls `f` with every key among `first..first+count` whose entry is
    /// not a hole, and the entry, reading evicted leaves' pages as it goes
    /// (without keeping them).
    pub(crate) fn for_each_kept(
        &self,
        media: &dyn Media,
        first: Lba,
        count: u64,
        mut f: impl FnMut(Lba, Entry),
    ) -> Result<()> {
        let end = first.0.saturating_add(count);
        let from = self
            .leaves
            .range(..=first.0)
            .next_back()
            .map_or(first.0, |(&start, _)| start);
        for (&start, leaf) in self.leaves.range(from..end) {
            let (lo, hi) = (start.max(first.0), (start + leaf.blocks()).min(end));
            if lo >= hi {
                continue;
            }
            let read;
            let leaf = if leaf.is_resident() {
                leaf
            } else {
                read = self.read_leaf(media, start, leaf)?;
                &read
            };
            let _ = leaf.visit(start, lo, hi, &mut |piece| {
                match piece {
                    Piece::One(at, entry) if !entry.is_hole() => f(Lba(at), entry),
                    Piece::Same(from, to, entry) if !entry.is_hole() => {
                        (from..to).for_each(|at| f(Lba(at), entry))
                    }
                    _ => {}
                }
                ControlFlow::Continue(())
            });
        }
        Ok(())
    }

    /// Every shared content whose cell holds data or damage.
    pub(crate) fn table_contents(&self, media: &dyn Media) -> Result<HashSet<u64>> {
        let mut contents = HashSet::new();
        self.for_each_leaf_from(media, TABLE_BASE, |start, leaf| {
            let _ = leaf.visit(start, start, start + leaf.blocks(), &mut |piece| {
                if let Piece::One(key, entry) = piece {
                    if !entry.is_hole() {
                        contents.insert(key - TABLE_BASE);
                    }
                }
                ControlFlow::Continue(())
            });
            Ok(())
        })?;
        Ok(contents)
    }

    fn for_each_leaf_from(
        &self,
        media: &dyn Media,
        from: u64,
        mut f: impl FnMut(u64, &Leaf) -> Result<()>,
    ) -> Result<()> {
        for (&start, leaf) in self.leaves.range(from..) {
            if leaf.is_resident() {
                f(start, leaf)?;
            } else {
                let read = self.read_leaf(media, start, leaf)?;
                f(start, &read)?;
            }
        }
        Ok(())
    }

    /// The paged-out leaf at `start` read back from its page and checked
    /// against its stub and the leaves' invariants.
    fn read_leaf(&self, media: &dyn Media, start: u64, stub: &Leaf) -> Result<Leaf> {
        Ok(self.fault_at(start, stub).read(media)?.into_leaf())
    }

    // --- Paging.

    /// Reads back every paged-out leaf holding a block of
    /// `first..first+count`, so that lookups and changes there may follow.
    pub(crate) fn load(&mut self, media: &dyn Media, first: Lba, count: u64) -> Result<()> {
        if self.paged_leaves == 0 {
            self.cache.hits += 1;
            return Ok(());
        }
        let paged = self.paged_in(first, count);
        if paged.is_empty() {
            self.cache.hits += 1;
        }
        for start in paged {
            let stub = &self.leaves[&start];
            let leaf = self.read_leaf(media, start, stub)?;
            self.leaf_heap_bytes += leaf.heap_bytes();
            self.paged_leaves -= 1;
            self.cache.misses += 1;
            self.leaves.insert(start, leaf);
            // Still clean: it may go again.
            self.clean_queue.push_back(start);
        }
        Ok(())
    }

    /// True if the leaves in RAM take more than twice the cache, and at
    /// least `DIRTY_SLACK_BYTES` more than it: eviction runs at every
    /// release of the state lock, so what is left over is dirty, and only
    /// a checkpoint makes it clean (the background thread then takes one).
    pub(crate) fn dirty_over_cache(&self) -> bool {
        let bound = (self.cache_bytes.saturating_mul(2)).max(self.cache_bytes + DIRTY_SLACK_BYTES);
        self.leaf_heap_bytes > bound
    }

    /// True if the leaves in RAM take more than the cache may.
    #[inline]
    pub(crate) fn over_cache(&self) -> bool {
        self.leaf_heap_bytes > self.cache_bytes && !self.clean_queue.is_empty()
    }

    /// The first block of every paged-out leaf holding a block of
    /// `first..first+count`, in order.
    fn paged_in(&self, first: Lba, count: u64) -> Vec<u64> {
        self.paged_starts(first, count).collect()
    }

    /// The starts of the paged-out leaves holding a block of
    /// `first..first+count`, in block order.
    fn paged_starts(&self, first: Lba, count: u64) -> impl Iterator<Item = u64> + '_ {
        let end = first.0.saturating_add(count);
        let before = self
            .leaf_at(first.0)
            .filter(|&(start, leaf)| start < first.0 && !leaf.is_resident())
            .map(|(start, _)| start);
        before.into_iter().chain(
            self.leaves
                .range(first.0..end)
                .filter(|(_, leaf)| !leaf.is_resident())
                .map(|(&start, _)| start),
        )
    }

    /// Evicts clean leaves, oldest first, until the leaves in RAM fit the
    /// cache or none is clean, sparing those of a range being faulted in
    /// ([`Map::pin_faults`]). Nothing else may rely on a leaf staying in
    /// RAM across a call (the engine calls it as it releases the state
    /// lock).
    pub(crate) fn evict(&mut self) {
        let mut spared = Vec::new();
        while self.leaf_heap_bytes > self.cache_bytes {
            let Some(start) = self.clean_queue.pop_front() else {
                break;
            };
            let clean = matches!(self.written.get(&start), Some(Some(_)));
            let Some(leaf) = self.leaves.get_mut(&start).filter(|_| clean) else {
                continue;
            };
            if !leaf.is_resident() {
                continue;
            }
            if self.pins.spares(start, leaf.blocks()) {
                spared.push(start);
                continue;
            }
            let stub = Leaf::Paged {
                blocks: leaf.blocks(),
                chunk_items: leaf.chunk_items(),
            };
            let old = std::mem::replace(leaf, stub);
            self.leaf_heap_bytes -= old.heap_bytes();
            self.paged_leaves += 1;
            self.cache.evictions += 1;
        }
        self.clean_queue.extend(spared);
        if self.clean_queue.capacity() > 64
            && self.clean_queue.len() < self.clean_queue.capacity() / 4
        {
            self.clean_queue.shrink_to(self.clean_queue.len() * 2);
        }
    }

    /// A checkpoint's snapshot: every leaf, in block order, with where the
    /// checkpoint takes its page from. A clean leaf keeps its page unless
    /// `moves` says that page moves; a leaf that moves or changed is
    /// encoded if in RAM, copied from its page if paged out. Every leaf
    /// counts as written from now on, until it changes.
    pub(crate) fn snapshot_pages(&mut self, moves: impl Fn(&PageLoc) -> bool) -> Vec<SnapshotPage> {
        let mut pages = Vec::with_capacity(self.leaves.len());
        for (&start, leaf) in &self.leaves {
            let page = self.written.get(&start).copied().flatten();
            let source = match (leaf, page) {
                (_, Some(loc)) if !moves(&loc) => PageSource::Kept(loc),
                (Leaf::Paged { .. }, Some(loc)) => PageSource::Stored(loc),
                (Leaf::Paged { .. }, None) => panic!("paged-out leaf at {start} has no page"),
                _ => PageSource::Encoded(page::encode_page(leaf)),
            };
            self.written.entry(start).or_insert(None);
            pages.push(SnapshotPage {
                start,
                blocks: leaf.blocks(),
                chunk_items: leaf.chunk_items(),
                source,
            });
        }
        pages
    }

    /// Bytes of the clean leaves' pages, by the segment of their copy 0:
    /// what each dump segment holds that the map still needs.
    pub(crate) fn page_bytes_by_segment(&self) -> HashMap<SegmentId, u64> {
        let mut bytes: HashMap<SegmentId, u64> = HashMap::new();
        for loc in self.written.values().flatten() {
            *bytes.entry(loc.segments[0]).or_default() += loc.len as u64;
        }
        bytes
    }

    /// The checkpoint whose snapshot wrote pages at `placed` (leaf start,
    /// page) and kept `kept` others in place is durable: every leaf
    /// unchanged since the snapshot is clean (at its new page, or the page
    /// it kept), read back with `store`.
    pub(crate) fn commit_pages(&mut self, placed: &[(u64, PageLoc)], kept: u64, store: PageStore) {
        self.cache.pages_kept += kept;
        for &(start, loc) in placed {
            if let Some(page) = self.written.get_mut(&start) {
                *page = Some(loc);
            }
        }
        self.cache.pages_written += placed.len() as u64;
        self.store = Some(Arc::new(store));
        self.clean_queue.clear();
        for (&start, leaf) in &self.leaves {
            let page = self.written.get(&start).copied().flatten();
            match leaf.is_resident() {
                true if page.is_some() => self.clean_queue.push_back(start),
                true => {}
                false => assert!(page.is_some(), "paged-out leaf at {start} lost its page"),
            }
        }
    }

    /// Installs a paged-out leaf from a checkpoint's directory.
    pub(crate) fn insert_paged(
        &mut self,
        start: u64,
        blocks: u64,
        chunk_items: u64,
        loc: PageLoc,
    ) -> std::result::Result<(), String> {
        let end = start
            .checked_add(blocks)
            .ok_or_else(|| format!("map page at {start} of {blocks} blocks overflows"))?;
        if start & CHUNK_MASK != 0 || blocks == 0 || blocks & CHUNK_MASK != 0 {
            return Err(format!(
                "map page at {start} of {blocks} blocks is not chunk-aligned"
            ));
        }
        if chunk_items == 0 || chunk_items > blocks >> CHUNK_SHIFT {
            return Err(format!("map page at {start} claims {chunk_items} chunks"));
        }
        if self.leaf_at(start).is_some() || self.leaves.range(start..end).next().is_some() {
            return Err(format!("map page at {start} overlaps another"));
        }
        self.leaves.insert(
            start,
            Leaf::Paged {
                blocks,
                chunk_items,
            },
        );
        self.chunk_items += chunk_items;
        self.written.insert(start, Some(loc));
        self.paged_leaves += 1;
        Ok(())
    }

    /// Adds the counts of leaves installed paged out (a dump's totals).
    pub(crate) fn add_paged_counts(&mut self, counts: MapCounts) {
        self.counts.merge(counts);
        // They may include cells: `recount_table` tells.
        self.table_counted = false;
    }

    /// Where paged-out leaves are read from (after a dump was loaded).
    pub(crate) fn set_store(&mut self, store: PageStore) {
        self.store = Some(Arc::new(store));
    }

    /// Drops tombstones and switches to normal operation (end of recovery).
    pub(crate) fn compact(&mut self) {
        self.keep_tombstones = false;
        let starts: Vec<u64> = self.leaves.keys().copied().collect();
        for &start in &starts {
            // A paged-out leaf was written by a checkpoint outside recovery:
            // it holds no tombstone.
            match self.leaves.get(&start) {
                Some(Leaf::Run { entry, .. }) if entry.is_hole() => {
                    self.remove_leaf(start);
                }
                Some(Leaf::Dense { stored, .. }) if *stored < DENSE_KEEP => self.demote(start),
                Some(Leaf::Sparse { column, .. }) if column.entries().any(Entry::is_hole) => {
                    let Leaf::Sparse {
                        blocks,
                        keys,
                        column,
                    } = self.remove_leaf(start)
                    else {
                        unreachable!("matched a sparse leaf")
                    };
                    let (keys, entries): (Vec<u32>, Vec<Entry>) = keys
                        .iter()
                        .zip(column.entries())
                        .filter(|(_, entry)| !entry.is_hole())
                        .unzip();
                    if !keys.is_empty() {
                        self.insert_leaf(start, Leaf::sparse(blocks, keys, &entries));
                    }
                }
                _ => {}
            }
        }
        let starts: Vec<u64> = self.leaves.keys().copied().collect();
        for start in starts {
            self.tidy(start);
        }
    }

    /// Recounts everything from scratch, compares with the running totals,
    /// and checks the leaves' invariants (with every leaf in RAM).
    #[cfg(test)]
    pub(crate) fn check_counts(&self) -> std::result::Result<(), String> {
        self.check_counts_with(None)
    }

    /// Recounts everything from scratch, compares with the running totals,
    /// and checks the leaves' invariants; evicted leaves are read from
    /// their pages, which are checked too.
    pub(crate) fn check_counts_with(
        &self,
        media: Option<&dyn Media>,
    ) -> std::result::Result<(), String> {
        let mut counts = MapCounts::default();
        let mut spaces: BTreeMap<u16, MapCounts> = BTreeMap::new();
        let (mut chunk_items, mut heap_bytes, mut end) = (0u64, 0u64, 0u64);
        let mut paged = 0u64;
        for (&start, stub) in &self.leaves {
            let read;
            let leaf = if stub.is_resident() {
                stub
            } else {
                paged += 1;
                let media = media.ok_or_else(|| format!("map leaf at {start} is paged out"))?;
                read = self
                    .read_leaf(media, start, stub)
                    .map_err(|e| e.to_string())?;
                &read
            };
            let blocks = leaf.blocks();
            if start < end || start & CHUNK_MASK != 0 || blocks == 0 || blocks & CHUNK_MASK != 0 {
                return Err(format!(
                    "leaf at {start} of {blocks} blocks overlaps or is not chunk-aligned"
                ));
            }
            end = start + blocks;
            chunk_items += leaf.chunk_items();
            if stub.is_resident() {
                heap_bytes += leaf.heap_bytes();
            }
            check_leaf(start, leaf, self.keep_tombstones)?;
            let _ = leaf.visit(start, start, end, &mut |piece| {
                let (key, entry, n) = match piece {
                    Piece::Gap(..) => return ControlFlow::Continue(()),
                    Piece::Same(from, to, entry) => (from, entry, to - from),
                    Piece::One(key, entry) => (key, entry, 1),
                };
                counts.add(entry.slot(), n);
                if (SPACE_BLOCKS..TABLE_BASE).contains(&key) {
                    let space = (key >> entry::SPACE_SHIFT) as u16;
                    spaces.entry(space).or_default().add(entry.slot(), n);
                }
                ControlFlow::Continue(())
            });
        }
        if counts != self.counts {
            return Err(format!(
                "map counts drifted: running {:?}, recount {:?}",
                self.counts, counts
            ));
        }
        if self.table_counted {
            for (&space, &recount) in &spaces {
                if recount != self.space_counts(space) {
                    return Err(format!(
                        "key space {space}'s counts drifted: running {:?}, recount {recount:?}",
                        self.space_counts(space)
                    ));
                }
            }
            for (&space, &running) in &self.space_counts {
                if running != MapCounts::default() && !spaces.contains_key(&space) {
                    return Err(format!(
                        "key space {space} counts {running:?} but holds nothing"
                    ));
                }
            }
        }
        if paged != self.paged_leaves {
            return Err(format!(
                "{paged} leaves paged out, {} counted",
                self.paged_leaves
            ));
        }
        if chunk_items != self.chunk_items || heap_bytes != self.leaf_heap_bytes {
            return Err(format!(
                "map totals drifted: chunks {} (recount {chunk_items}), heap bytes {} (recount {heap_bytes})",
                self.chunk_items, self.leaf_heap_bytes
            ));
        }
        Ok(())
    }
}

/// True if a sparse leaf keeps `entry`: a hole at version 0 is what an
/// absent entry means, and outside recovery (`keep_tombstones` off) no
/// hole is kept.
fn stores(entry: Entry, keep_tombstones: bool) -> bool {
    entry != Entry::default() && (keep_tombstones || !entry.is_hole())
}

/// Checks a leaf's own invariants (a leaf read from a page is checked
/// before the map takes it).
fn check_leaf(start: u64, leaf: &Leaf, keep_tombstones: bool) -> std::result::Result<(), String> {
    let problem = match leaf {
        Leaf::Paged { .. } => None,
        Leaf::Run { entry, .. } => {
            if entry.is_data() || !entry.is_well_formed() {
                Some(format!("holds {entry:?}"))
            } else if !stores(*entry, keep_tombstones) {
                Some(format!("is a run of {:?} outside recovery", entry.slot()))
            } else {
                None
            }
        }
        Leaf::Dense { stored, column } => {
            let count = column.entries().filter(|e| !e.is_hole()).count() as u32;
            if column.len() != CHUNK_BLOCKS as usize || count != *stored {
                Some(format!(
                    "has {} cells, {count} stored ({stored} counted)",
                    column.len()
                ))
            } else if !column.is_well_formed() {
                Some("has a cell out of its base's reach".into())
            } else if !keep_tombstones && count < DENSE_KEEP {
                Some(format!("is dense with {count} blocks stored"))
            } else {
                None
            }
        }
        Leaf::Sparse {
            blocks,
            keys,
            column,
        } => {
            let sorted = keys.windows(2).all(|pair| pair[0] < pair[1]);
            let most_in_a_chunk = (0..keys.len())
                .map(|index| {
                    let (low, high) = chunk_positions(keys, keys[index]);
                    high - low
                })
                .max()
                .unwrap_or(0);
            if keys.is_empty() || keys.len() > SPARSE_MAX || keys.len() != column.len() {
                Some(format!(
                    "has {} keys and {} cells",
                    keys.len(),
                    column.len()
                ))
            } else if !sorted || keys.last().is_some_and(|&key| key as u64 >= *blocks) {
                Some(format!("has keys out of order or beyond {blocks} blocks"))
            } else if *blocks > SPAN_MAX || most_in_a_chunk >= DENSE_FROM {
                Some(format!(
                    "spans {blocks} blocks, {most_in_a_chunk} in one chunk"
                ))
            } else if !column.is_well_formed() {
                Some("has a cell out of its base's reach".into())
            } else {
                let kept = column.entries().find(|e| !stores(*e, keep_tombstones));
                kept.map(|entry| format!("stores {entry:?}"))
            }
        }
    };
    match problem {
        Some(problem) => Err(format!("map leaf at {start} {problem}")),
        None => Ok(()),
    }
}

/// An estimate of the heap bytes of a B-tree of `len` leaves. std's nodes
/// hold at most 11 pairs; filled in block order, as a map mostly is, a
/// node keeps 6 and hands one to its parent, so about 7 pairs per node.
fn btree_bytes(len: usize) -> u64 {
    if len == 0 {
        return 0;
    }
    let pair_bytes = size_of::<u64>() + size_of::<Leaf>();
    let leaf_node_bytes = 16 + 11 * pair_bytes;
    let internal_node_bytes = leaf_node_bytes + 12 * size_of::<usize>();
    let leaf_nodes = len.div_ceil(7) as u64;
    let internal_nodes = (leaf_nodes - 1).div_ceil(6);
    leaf_nodes * alloc_bytes(leaf_node_bytes) + internal_nodes * alloc_bytes(internal_node_bytes)
}
